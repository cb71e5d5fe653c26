//! What the tests that run real `strata` processes share: the `strata` binary (built on demand,
//! so `cargo test -p strata-integration-tests` works alone), a fixed cluster token, free
//! loopback ports, and waiting for a process with a hard deadline.
//!
//! The binary is `$STRATA_BIN` when set (to test a release build, say); otherwise this crate
//! builds the `strata-cli` package's `strata` binary with the profile the tests were built
//! with, the whole workspace selected (as `cargo test --workspace` selects it) and this crate's
//! `cuda` feature, once per test process (a no-op when it is up to date), and runs it from the
//! target directory.

pub mod cluster;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The cluster token every test process shares.
pub const TOKEN: &str = "0123456789abcdef0123456789abcdef";

/// The `strata` binary's path: `$STRATA_BIN`, or the workspace's own, built if needed.
pub fn strata_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(bin) = std::env::var_os("STRATA_BIN") {
            return PathBuf::from(bin);
        }
        let dir = build_in_workspace(&["--bin", "strata"], "the strata binary");
        let bin = dir.join("strata");
        assert!(bin.is_file(), "the strata binary is not at {}", bin.display());
        bin
    })
}

/// Builds `targets` (cargo's target flags) as the tests were built and returns the target
/// directory of their profile (`target/debug` for the tests' builds).
///
/// The profile is the tests' own. The whole workspace is selected, as the README's and CI's
/// `cargo test --workspace` select it: cargo turns on the `default` feature of every selected
/// package (strata's among them), so a narrower selection resolved other features for strata,
/// strata-compare and strata-cli and compiled all three again (a minute here) for one binary.
/// With this crate's `cuda` feature it is passed on (CI's GPU build, which also turns the
/// default features off, builds the binary itself and passes it as `$STRATA_BIN`). A test run
/// of one package (`-p`) pays that build once.
pub fn build_in_workspace(targets: &[&str], what: &str) -> PathBuf {
    // The test executable is target/<profile dir>/deps/<test>-<hash>.
    let exe = std::env::current_exe().expect("the test executable has a path");
    let dir = exe.parent().and_then(Path::parent).expect("the test executable is in target/<profile>/deps");
    let profile = if cfg!(debug_assertions) { "test" } else { "release" };
    let mut cargo = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cargo.args(["build", "--quiet", "--profile", profile, "--workspace"]).args(targets);
    // What `cargo test` sets for the test process describes this package, not the build's:
    // ring's build script tracks CARGO_MANIFEST_DIR, so with it inherited every crate above
    // ring (rustls, the transport and all that use it) was compiled again here, and again by
    // the next `cargo test` in a shell that does not set it.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        let set_by_cargo_test = name.starts_with("CARGO_PKG_")
            || matches!(
                &*name,
                "CARGO_MANIFEST_DIR"
                    | "CARGO_MANIFEST_PATH"
                    | "CARGO_CRATE_NAME"
                    | "CARGO_BIN_NAME"
                    | "CARGO_PRIMARY_PACKAGE"
                    | "CARGO_TARGET_TMPDIR"
                    | "CARGO_RUSTC_CURRENT_DIR"
                    | "OUT_DIR"
            );
        if set_by_cargo_test {
            cargo.env_remove(&*name);
        }
    }
    if cfg!(feature = "cuda") {
        cargo.args(["--features", "strata-integration-tests/cuda"]);
    }
    let status = cargo.current_dir(env!("CARGO_MANIFEST_DIR")).status().expect("cargo runs");
    assert!(status.success(), "building {what} failed");
    dir.to_path_buf()
}

/// The `strata` binary as a user runs it (the environment untouched).
pub fn strata_command() -> Command {
    Command::new(strata_bin())
}

/// The `strata` binary with the test token, no `TF_CONFIG`, and warnings only.
pub fn strata() -> Command {
    let mut c = strata_command();
    c.env("STRATA_CLUSTER_TOKEN", TOKEN).env_remove("TF_CONFIG").env("STRATA_LOG", "warn");
    c
}

/// The `TF_CONFIG` of worker `index` of a job of workers on loopback `ports`.
pub fn worker_tf_config(ports: &[u16], index: usize) -> String {
    let workers: Vec<String> = ports.iter().map(|p| format!("\"127.0.0.1:{p}\"")).collect();
    format!(r#"{{"cluster":{{"worker":[{}]}},"task":{{"type":"worker","index":{index}}}}}"#, workers.join(","))
}

/// Runs `strata compare` on the experiment `toml` (written as `name` in a new temporary
/// directory) with `--out out --no-progress`, within `limit`: the directory (removed when
/// dropped), the output directory and the process's output.
pub fn run_compare(name: &str, toml: &str, limit: Duration) -> (tempfile::TempDir, std::path::PathBuf, Output) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let file = dir.path().join(name);
    std::fs::write(&file, toml).expect("the experiment file written");
    let out_dir = dir.path().join("out");
    let child = strata()
        .arg("compare")
        .arg(&file)
        .arg("--out")
        .arg(&out_dir)
        .arg("--no-progress")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("strata compare starts");
    let out = wait(child, Instant::now() + limit);
    (dir, out_dir, out)
}

/// `n` loopback ports that were free a moment ago, from below the kernel's ephemeral range, so
/// that no other test's connection takes one before the test's processes bind it
/// ([`strata_transport::ports::free_ports`], which the launcher uses too).
pub fn free_ports(n: usize) -> Vec<u16> {
    strata_transport::ports::free_ports([127, 0, 0, 1].into(), n).expect("free loopback ports")
}

/// Waits for a child with a hard deadline (killing it, and failing, if it passes).
pub fn wait(mut child: Child, deadline: Instant) -> Output {
    loop {
        if child.try_wait().expect("the child can be waited for").is_some() {
            return child.wait_with_output().expect("the child's output");
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("the child's output");
            panic!(
                "a process did not finish in time; stdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
