//! A network partition between two hosts (the cluster harness's network namespaces on one
//! bridge, addresses that exist only inside them): a 2-worker MultiWorkerMirrored job is cut in
//! two mid-training, and both sides must fail within the heartbeat timeout (plus slack for a
//! loaded machine), each naming the other. Needs root (CAP_NET_ADMIN) and `ip`; skipped with a
//! message otherwise (a failure with `STRATA_REQUIRE_CLUSTER=1`). The hosts are removed on
//! every exit path, and the test checks that nothing was left behind.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use strata_integration_tests::cluster::{or_skip, Hosts};
use strata_integration_tests::{strata_bin, wait, TOKEN};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("strata-partition-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn a_partition_between_two_hosts_fails_both_sides_within_the_heartbeat_timeout() {
    strata_bin();
    let Some(mut hosts) = or_skip(Hosts::new(2)) else { return };
    let dir = tmp("mw");
    let ckpt = dir.join("ckpt");
    let addresses: Vec<String> = (0..2).map(|i| hosts.addr(i).to_string()).collect();
    let workers: Vec<String> = addresses.iter().map(|a| format!("\"{a}:7077\"")).collect();
    let children: Vec<_> = (0..2)
        .map(|i| {
            let tf_config =
                format!(r#"{{"cluster":{{"worker":[{}]}},"task":{{"type":"worker","index":{i}}}}}"#, workers.join(","));
            hosts
                .command(i, strata_bin())
                .args(["train", "--strategy", "multi-worker-mirrored", "--no-progress", "--bind", &addresses[i]])
                .args(["--epochs", "500", "--batch", "64", "--hidden", "64", "--optimizer", "sgd"])
                .args(["--checkpoint-every", "10", "--checkpoint-dir"])
                .arg(&ckpt)
                .env("TF_CONFIG", tf_config)
                .env("STRATA_CLUSTER_TOKEN", TOKEN)
                .env("STRATA_LOG", "warn")
                .current_dir(&dir)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    while !ckpt.join("latest").exists() {
        if Instant::now() > deadline {
            for mut c in children {
                let _ = c.kill();
                let o = c.wait_with_output().unwrap();
                eprintln!("{}", String::from_utf8_lossy(&o.stderr));
            }
            panic!("no checkpoint was written: the job did not start across the namespaces");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    hosts.cut(1);
    let cut = Instant::now();
    for (i, c) in children.into_iter().enumerate() {
        let o = wait(c, cut + Duration::from_secs(20));
        let took = cut.elapsed();
        let err = String::from_utf8_lossy(&o.stderr);
        let last = err.lines().last().unwrap_or("");
        eprintln!("worker:{i} failed {took:?} after the partition: {last}");
        assert!(!o.status.success(), "worker:{i} exited 0: {err}");
        assert!(last.contains(&format!("lost task worker:{}", 1 - i)), "worker:{i} does not name its peer: {err}");
        assert!(
            took < Duration::from_secs(3 + 3),
            "worker:{i} took {took:?} (asked for: a 3 s timeout + 1 s; asserted with 2 s more for a loaded machine)"
        );
    }
    let left = hosts.teardown();
    assert!(left.is_empty(), "the hosts left behind: {left:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
