//! A misconfigured cluster fails a task at once, naming the host or address and what to check:
//! a host name that does not resolve, an address no interface has, a port in use. Only a peer
//! that has not started yet is waited for (the other tests start tasks in any order).

use std::process::Stdio;
use std::time::{Duration, Instant};

use strata_integration_tests::{free_ports, strata, strata_bin, wait};

/// Runs one multi-worker task of `cluster` (JSON list of worker addresses) as `index`, with
/// `args`, and returns its exit code, stderr and how long it took.
fn one_task(workers: &[String], index: usize, args: &[&str]) -> (Option<i32>, String, Duration) {
    strata_bin();
    let list: Vec<String> = workers.iter().map(|w| format!("\"{w}\"")).collect();
    let tf_config =
        format!(r#"{{"cluster":{{"worker":[{}]}},"task":{{"type":"worker","index":{index}}}}}"#, list.join(","));
    let started = Instant::now();
    let child = strata()
        .args(["train", "--strategy", "multi-worker-mirrored", "--no-progress", "--epochs", "1"])
        .args(args)
        .env("TF_CONFIG", tf_config)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("strata starts");
    let out = wait(child, Instant::now() + Duration::from_secs(60));
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned(), started.elapsed())
}

/// A worker whose peer's name resolves nowhere fails at once (not at the 120 s rendezvous
/// deadline), naming the host, its task and the resolver.
#[test]
fn an_unresolvable_host_fails_at_once() {
    let ports = free_ports(2);
    let workers = vec![format!("127.0.0.1:{}", ports[0]), format!("no-such-node.invalid:{}", ports[1])];
    let (code, err, took) = one_task(&workers, 0, &[]);
    assert_ne!(code, Some(0), "{err}");
    assert!(
        err.contains("host \"no-such-node.invalid\" of task worker:1 (from TF_CONFIG) does not resolve"),
        "the error names the host, its task and the resolver: {err}"
    );
    assert_eq!(err.trim().lines().filter(|l| l.starts_with("error:")).count(), 1, "{err}");
    assert!(took < Duration::from_secs(5), "failing took {took:?}");
}

/// `--bind` with an address no interface of this host has fails at once, naming it.
#[test]
fn an_address_no_interface_has_fails_at_once() {
    let ports = free_ports(2);
    let workers: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let (code, err, took) = one_task(&workers, 0, &["--bind", "192.0.2.77"]);
    assert_ne!(code, Some(0), "{err}");
    assert!(err.contains("192.0.2.77"), "the error names the address: {err}");
    assert!(err.contains("no interface of this host has that address"), "and what to check: {err}");
    assert!(took < Duration::from_secs(5), "failing took {took:?}");
}

/// The chief's port held by another process: the chief fails at once, naming the port.
#[test]
fn a_port_in_use_fails_at_once() {
    let holder = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let port = holder.local_addr().expect("its address").port();
    let other = free_ports(1)[0];
    let workers = vec![format!("127.0.0.1:{port}"), format!("127.0.0.1:{other}")];
    let (code, err, took) = one_task(&workers, 0, &[]);
    assert_ne!(code, Some(0), "{err}");
    assert!(err.contains(&format!("127.0.0.1:{port}")), "the error names the address: {err}");
    assert!(err.contains("holds the port"), "and what to check: {err}");
    assert!(took < Duration::from_secs(5), "failing took {took:?}");
    drop(holder);
}
