#![allow(dead_code)]
//! Helpers of the tests that run `strata` processes: the binary with a fixed cluster token,
//! free loopback ports, and waiting for a process with a hard deadline.

use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

/// The cluster token every test process shares.
pub const TOKEN: &str = "0123456789abcdef0123456789abcdef";

/// The `strata` binary with the test token, no `TF_CONFIG`, and warnings only.
pub fn strata() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_strata"));
    c.env("STRATA_CLUSTER_TOKEN", TOKEN).env_remove("TF_CONFIG").env("STRATA_LOG", "warn");
    c
}

/// `n` loopback ports that were free a moment ago.
pub fn free_ports(n: usize) -> Vec<u16> {
    let ls: Vec<_> = (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    ls.iter().map(|l| l.local_addr().unwrap().port()).collect()
}

/// Waits for a child with a hard deadline (killing it, and failing, if it passes).
pub fn wait(mut child: Child, deadline: Instant) -> Output {
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "a process did not finish in time; stdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
