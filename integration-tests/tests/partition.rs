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

/// Steps the chief's metrics file records so far.
fn steps(metrics: &std::path::Path) -> usize {
    std::fs::read_to_string(metrics).unwrap_or_default().lines().filter(|l| l.contains("\"kind\":\"step\"")).count()
}

/// An elastic job of three hosts (`--min-workers 2`, the coordination service on the test's
/// side of the bridge) loses one host to a partition: the two others go on without it, and when
/// the partition heals the cut-off process, which still holds the old membership, is fenced:
/// it exits with one line and never joins the new ring.
#[test]
fn an_elastic_job_goes_on_across_a_partition_and_fences_the_cut_off_worker() {
    strata_bin();
    let Some(mut hosts) = or_skip(Hosts::new(3)) else { return };
    let dir = tmp("elastic");
    let metrics = dir.join("metrics.jsonl");
    let port = (20_000 + std::process::id() % 20_000).to_string();
    let coordinator = format!("{}:{port}", hosts.gateway());
    let service = std::process::Command::new(strata_bin())
        .args(["coordinator", "--workers", "3", "--min-workers", "2", "--port", &port, "--bind"])
        .arg(hosts.gateway().to_string())
        .env("STRATA_CLUSTER_TOKEN", TOKEN)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let addresses: Vec<String> = (0..3).map(|i| hosts.addr(i).to_string()).collect();
    let workers: Vec<String> = addresses.iter().map(|a| format!("\"{a}:7077\"")).collect();
    let children: Vec<_> = (0..3)
        .map(|i| {
            let tf_config =
                format!(r#"{{"cluster":{{"worker":[{}]}},"task":{{"type":"worker","index":{i}}}}}"#, workers.join(","));
            hosts
                .command(i, strata_bin())
                .args(["train", "--strategy", "multi-worker-mirrored", "--min-workers", "2", "--no-progress"])
                .args(["--coordinator", &coordinator, "--bind", &addresses[i]])
                .args(["--epochs", "60", "--hidden", "512,512", "--optimizer", "sgd", "--metrics"])
                .arg(&metrics)
                .arg("--save-params")
                .arg(dir.join("p{task}.safetensors"))
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
    while steps(&metrics) < 30 {
        assert!(Instant::now() < deadline, "the job did not start across the namespaces");
        std::thread::sleep(Duration::from_millis(5));
    }
    hosts.cut(2);
    let cut_at = Instant::now();
    let at_cut = steps(&metrics);
    // The two others go on without worker:2 (after its heartbeat timeout, 3 s).
    let deadline = Instant::now() + Duration::from_secs(60);
    while steps(&metrics) < at_cut + 30 {
        assert!(Instant::now() < deadline, "the job did not go on without the cut-off host (step {})", steps(&metrics));
        std::thread::sleep(Duration::from_millis(5));
    }
    hosts.heal(2);
    let healed = Instant::now();
    eprintln!("cut at step {at_cut}, {:?} to go on 30 steps without the host", healed - cut_at);
    let outputs: Vec<_> = children.into_iter().map(|c| wait(c, Instant::now() + Duration::from_secs(120))).collect();
    let service = wait(service, Instant::now() + Duration::from_secs(30));
    eprintln!("every process ended {:?} after the heal", healed.elapsed());
    let log = |o: &std::process::Output| String::from_utf8_lossy(&o.stderr).into_owned();
    for (i, o) in outputs.iter().enumerate().take(2) {
        assert!(o.status.success(), "worker:{i}: {}", log(o));
    }
    let cut_off = log(&outputs[2]);
    eprintln!("worker:2 after the partition healed: {}", cut_off.lines().last().unwrap_or_default());
    assert!(!outputs[2].status.success(), "{cut_off}");
    assert_eq!(cut_off.lines().filter(|l| l.starts_with("error:")).count(), 1, "one line: {cut_off}");
    assert!(!dir.join("p2.safetensors").exists(), "the fenced process wrote no parameters");
    let said = String::from_utf8_lossy(&service.stdout);
    assert!(service.status.success(), "{said}{}", log(&service));
    assert!(said.contains("the job completed in generation 2 with worker:0, worker:1"), "{said}");
    assert!(log(&service).contains("lost on the way: worker:2"), "{}", log(&service));
    let params: Vec<_> = (0..2)
        .map(|i| {
            std::fs::read(dir.join(format!("p{i}.safetensors"))).unwrap_or_else(|e| {
                let o = &outputs[i];
                panic!("worker:{i} wrote no parameters ({e}): {}{}", String::from_utf8_lossy(&o.stdout), log(o))
            })
        })
        .collect();
    assert!(params[0] == params[1], "the survivors hold the same bits");
    let left = hosts.teardown();
    assert!(left.is_empty(), "the hosts left behind: {left:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
