//! `strata launch`, run as a user runs it: real processes, a hard timeout on every wait.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::Value;

/// The longest any launcher in these tests may run.
const TIMEOUT: Duration = Duration::from_secs(20);

fn launcher(args: &[&str]) -> Command {
    let mut cmd = Command::new(strata_integration_tests::strata_bin());
    cmd.arg("launch").args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd
}

/// A running launcher whose stdout lines arrive on a channel and whose stderr is collected.
struct Launched {
    child: Child,
    lines: Receiver<String>,
    stdout: Vec<String>,
    stderr: std::thread::JoinHandle<String>,
}

/// The outcome of a launcher that finished.
struct Finished {
    status: ExitStatus,
    stdout: Vec<String>,
    stderr: String,
}

impl Launched {
    fn start(mut cmd: Command) -> Launched {
        let mut child = cmd.spawn().expect("the strata binary runs");
        let out = child.stdout.take().expect("stdout is piped");
        let mut err = child.stderr.take().expect("stderr is piped");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = err.read_to_string(&mut text);
            text
        });
        Launched { child, lines, stdout: Vec::new(), stderr }
    }

    /// Waits (at most until the hard timeout) for `n` stdout lines that contain `needle`.
    fn wait_for_lines(&mut self, needle: &str, n: usize) -> Vec<String> {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let found: Vec<String> = self.stdout.iter().filter(|l| l.contains(needle)).cloned().collect();
            if found.len() >= n {
                return found;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => self.stdout.push(line),
                Err(_) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    panic!("{n} lines with {needle:?} expected within {TIMEOUT:?}; got {:?}", self.stdout);
                }
            }
        }
    }

    /// Waits for the launcher to exit, killing it and failing the test past the hard timeout.
    fn finish(mut self) -> Finished {
        let deadline = Instant::now() + TIMEOUT;
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                break status;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("the launcher did not exit within {TIMEOUT:?}; stdout so far: {:?}", self.stdout);
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        // The pipes close when the launcher exits; whatever is left is already written.
        let drain_by = Instant::now() + TIMEOUT;
        loop {
            let left = drain_by.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => self.stdout.push(line),
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Err(mpsc::RecvTimeoutError::Timeout) => panic!("the launcher's stdout did not close"),
            }
        }
        let stderr = self.stderr.join().expect("stderr reader");
        Finished { status, stdout: self.stdout, stderr }
    }
}

fn run(cmd: Command) -> Finished {
    Launched::start(cmd).finish()
}

/// The stdout lines of `task`, without the prefix.
fn lines_of<'a>(lines: &'a [String], task: &str) -> Vec<&'a str> {
    let prefix = format!("[{task}] ");
    lines.iter().filter_map(|l| l.strip_prefix(&prefix)).collect()
}

fn tf_config_of(lines: &[String], task: &str) -> Value {
    let mine = lines_of(lines, task);
    let json =
        mine.iter().find(|l| l.starts_with('{')).unwrap_or_else(|| panic!("no TF_CONFIG from {task}: {lines:?}"));
    serde_json::from_str(json).unwrap_or_else(|e| panic!("TF_CONFIG of {task} is not JSON ({e}): {json}"))
}

fn ports(cluster: &Value) -> Vec<u16> {
    let mut ports = Vec::new();
    for job in cluster.as_object().expect("cluster is an object").values() {
        for address in job.as_array().expect("a job is a list") {
            let address = address.as_str().expect("an address is a string");
            let (host, port) = address.rsplit_once(':').expect("host:port");
            assert_eq!(host, "127.0.0.1");
            ports.push(port.parse().expect("a port"));
        }
    }
    ports
}

/// Whether `pid` is a live process (a zombie counts as gone).
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => false,
        Ok(stat) => {
            let state = stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next());
            !matches!(state, Some('Z') | Some('X'))
        }
    }
}

#[test]
fn every_worker_gets_its_tf_config_on_distinct_ports() {
    let o = run({
        let mut c = launcher(&["--workers", "3", "--", "sh", "-c", r#"echo "$TF_CONFIG""#]);
        c.env_remove("TF_CONFIG");
        c
    });
    assert!(o.status.success(), "status {:?}, stderr: {}", o.status, o.stderr);
    assert_eq!(o.stdout.len(), 3, "{:?}", o.stdout);
    let configs: Vec<Value> = (0..3).map(|i| tf_config_of(&o.stdout, &format!("worker:{i}"))).collect();
    let cluster = &configs[0]["cluster"];
    assert_eq!(cluster.as_object().unwrap().len(), 1, "only the worker job: {cluster}");
    assert_eq!(cluster["worker"].as_array().unwrap().len(), 3);
    for (i, config) in configs.iter().enumerate() {
        assert_eq!(&config["cluster"], cluster);
        assert_eq!(config["task"]["type"], "worker");
        assert_eq!(config["task"]["index"], i);
    }
    let ports = ports(cluster);
    assert_eq!(ports.iter().collect::<BTreeSet<_>>().len(), 3, "distinct ports: {ports:?}");
}

#[test]
fn chief_workers_and_ps_are_three_jobs() {
    let o = run(launcher(&[
        "--chief",
        "--workers",
        "2",
        "--ps",
        "1",
        "--",
        "sh",
        "-c",
        r#"echo "$STRATA_TASK"; echo "$TF_CONFIG""#,
    ]));
    assert!(o.status.success(), "status {:?}, stderr: {}", o.status, o.stderr);
    let tasks = ["chief:0", "worker:0", "worker:1", "ps:0"];
    let mut cluster = None;
    for task in tasks {
        assert_eq!(lines_of(&o.stdout, task).first(), Some(&task), "STRATA_TASK of {task}");
        let config = tf_config_of(&o.stdout, task);
        let (job, index) = task.split_once(':').unwrap();
        assert_eq!(config["task"]["type"], job);
        assert_eq!(config["task"]["index"].as_u64(), Some(index.parse().unwrap()));
        let c = cluster.get_or_insert_with(|| config["cluster"].clone());
        assert_eq!(&config["cluster"], c);
    }
    let cluster = cluster.unwrap();
    let raw = lines_of(&o.stdout, "worker:0")[1];
    let at = |job: &str| raw.find(&format!("\"{job}\":[")).unwrap_or_else(|| panic!("no {job} job in {raw}"));
    assert!(at("chief") < at("worker") && at("worker") < at("ps"), "TensorFlow's job order: {raw}");
    assert_eq!(cluster.as_object().unwrap().len(), 3);
    assert_eq!(cluster["chief"].as_array().unwrap().len(), 1);
    assert_eq!(cluster["worker"].as_array().unwrap().len(), 2);
    assert_eq!(cluster["ps"].as_array().unwrap().len(), 1);
    assert_eq!(ports(&cluster).iter().collect::<BTreeSet<_>>().len(), 4);
    assert_eq!(o.stdout.len(), 8, "{:?}", o.stdout);
}

#[test]
fn a_failing_task_stops_the_group_with_its_exit_code() {
    let script = r#"if [ "$STRATA_TASK" = worker:1 ]; then sleep 1; exit 7; fi; echo "pid $$"; exec sleep 30"#;
    // The binary first (the harness may build it), so that the bound is the launcher's own.
    strata_integration_tests::strata_bin();
    let started = Instant::now();
    let o = run(launcher(&["--workers", "3", "--grace-period", "2s", "--", "sh", "-c", script]));
    assert_eq!(o.status.code(), Some(7), "stderr: {}", o.stderr);
    assert!(started.elapsed() < TIMEOUT);
    let failure: Vec<&str> = o.stderr.lines().filter(|l| l.contains("worker:1")).collect();
    assert_eq!(failure.len(), 1, "one line names the failed task: {}", o.stderr);
    assert!(failure[0].contains("exited with code 7"), "{}", failure[0]);
    let pids: Vec<i32> =
        o.stdout.iter().filter_map(|l| l.split_once("] pid ").and_then(|(_, pid)| pid.trim().parse().ok())).collect();
    assert_eq!(pids.len(), 2, "the two sleeping tasks print their pid: {:?}", o.stdout);
    let deadline = Instant::now() + Duration::from_secs(5);
    while pids.iter().any(|&p| alive(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let left: Vec<i32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    for &p in &left {
        let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
    }
    assert!(left.is_empty(), "tasks left running: {left:?}");
}

/// The task that exits first is not always the one that had the error: a worker that lost its
/// peer ends before the chief has finished reporting why. The launcher names the task whose
/// stderr carried the `error:` line and exits with its code.
#[test]
fn the_task_with_the_error_is_named_not_the_first_to_exit() {
    // worker:0 is slow to fail (it ignores the SIGTERM the launcher sends when worker:1 exits);
    // worker:1 exits first, without an error line.
    let script = r#"if [ "$STRATA_TASK" = worker:0 ]; then trap '' TERM; sleep 1; echo 'error: checkpoint: the real cause' >&2; exit 3; fi; sleep 0.2; exit 1"#;
    let o = run(launcher(&["--workers", "2", "--grace-period", "5s", "--", "sh", "-c", script]));
    assert_eq!(o.status.code(), Some(3), "the code of the task with the error; stderr: {}", o.stderr);
    assert!(
        o.stderr.contains("strata launch: task worker:1 exited with code 1; stopping the other tasks"),
        "{}",
        o.stderr
    );
    let last = o.stderr.lines().rfind(|l| l.starts_with("strata launch:")).unwrap_or_default();
    assert_eq!(
        last, "strata launch: the job failed in task worker:0 (exited with code 3): error: checkpoint: the real cause",
        "stderr: {}",
        o.stderr
    );
}

#[test]
fn a_task_killed_by_a_signal_gives_128_plus_the_signal() {
    let o = run(launcher(&[
        "--workers",
        "2",
        "--",
        "sh",
        "-c",
        r#"[ "$STRATA_TASK" = worker:0 ] && kill -KILL $$; exec sleep 30"#,
    ]));
    assert_eq!(o.status.code(), Some(128 + 9), "stderr: {}", o.stderr);
    assert!(o.stderr.contains("worker:0 was killed by SIGKILL"), "{}", o.stderr);
}

#[test]
fn sigint_is_forwarded_to_every_task() {
    // Worker 0 exits 0 and worker 1 exits 130 after the signal; both print the marker.
    let script = r#"trap 'echo got-int; [ "$STRATA_TASK" = worker:1 ] && exit 130; exit 0' INT
        echo ready; while true; do sleep 0.1; done"#;
    let mut launched = Launched::start(launcher(&["--workers", "2", "--", "sh", "-c", script]));
    launched.wait_for_lines("ready", 2);
    kill(Pid::from_raw(launched.child.id() as i32), Signal::SIGINT).expect("signal the launcher");
    let o = launched.finish();
    assert_eq!(o.status.code(), Some(130), "interrupted: 128 + SIGINT; stderr: {}", o.stderr);
    for task in ["worker:0", "worker:1"] {
        assert_eq!(lines_of(&o.stdout, task), ["ready", "got-int"], "{task}: {:?}", o.stdout);
    }
    assert!(o.stderr.contains("SIGINT"), "{}", o.stderr);
}

#[test]
fn sigterm_is_forwarded_as_sigterm() {
    let script = r#"trap 'echo got-int; exit 130' INT; echo ready; while true; do sleep 0.1; done"#;
    let mut launched = Launched::start(launcher(&["--workers", "2", "--", "sh", "-c", script]));
    launched.wait_for_lines("ready", 2);
    kill(Pid::from_raw(launched.child.id() as i32), Signal::SIGTERM).expect("signal the launcher");
    // SIGTERM is forwarded as SIGTERM: the INT trap does not run, the shells die of SIGTERM.
    let o = launched.finish();
    assert_eq!(o.status.code(), Some(128 + 15), "stderr: {}", o.stderr);
    assert!(o.stdout.iter().all(|l| !l.contains("got-int")), "{:?}", o.stdout);
}

#[test]
fn the_cluster_token_is_inherited_or_fresh_and_shared() {
    let print = ["--workers", "2", "--chief", "--", "sh", "-c", r#"echo "token=$STRATA_CLUSTER_TOKEN""#];
    let tokens = |o: &Finished| -> Vec<String> {
        assert!(o.status.success(), "stderr: {}", o.stderr);
        o.stdout.iter().filter_map(|l| l.split_once("token=").map(|(_, t)| t.to_string())).collect()
    };

    let mut inherited = launcher(&print);
    inherited.env("STRATA_CLUSTER_TOKEN", "s3cret-token");
    assert_eq!(tokens(&run(inherited)), ["s3cret-token"; 3]);

    let fresh = || {
        let mut c = launcher(&print);
        c.env_remove("STRATA_CLUSTER_TOKEN");
        let tokens = tokens(&run(c));
        assert_eq!(tokens.len(), 3);
        assert!(tokens.iter().all(|t| t == &tokens[0]), "one token for the cluster: {tokens:?}");
        assert_eq!(tokens[0].len(), 64, "32 bytes in hex: {}", tokens[0]);
        assert!(tokens[0].chars().all(|c| c.is_ascii_hexdigit()));
        tokens[0].clone()
    };
    assert_ne!(fresh(), fresh(), "every launch makes a new token");
}

#[test]
fn output_lines_are_prefixed_on_their_stream() {
    let script = r#"echo out-line; echo err-line >&2; printf 'last-without-newline'"#;
    let o = run(launcher(&["--workers", "1", "--", "sh", "-c", script]));
    assert!(o.status.success(), "stderr: {}", o.stderr);
    assert_eq!(o.stdout, ["[worker:0] out-line", "[worker:0] last-without-newline"]);
    assert_eq!(o.stderr.lines().collect::<Vec<_>>(), ["[worker:0] err-line"]);
}

#[test]
fn strata_as_the_program_runs_this_executable() {
    let mut cmd = launcher(&["--workers", "1", "--", "strata", "--version"]);
    cmd.env("PATH", "/nonexistent");
    let o = run(cmd);
    assert!(o.status.success(), "stderr: {}", o.stderr);
    assert_eq!(o.stdout, [format!("[worker:0] strata {}", env!("CARGO_PKG_VERSION"))]);
}

#[test]
fn a_program_that_does_not_exist_is_a_usage_error() {
    let o = run(launcher(&["--workers", "2", "--", "no-such-program-strata-xyz", "--flag"]));
    assert_eq!(o.status.code(), Some(2), "stderr: {}", o.stderr);
    assert_eq!(o.stderr.trim_end().lines().count(), 1, "one line: {}", o.stderr);
    assert!(o.stderr.contains("no-such-program-strata-xyz"), "{}", o.stderr);
    assert!(o.stdout.is_empty());
}

#[test]
fn no_task_at_all_is_a_usage_error() {
    let o = run(launcher(&["--workers", "0", "--", "true"]));
    assert_eq!(o.status.code(), Some(2), "stderr: {}", o.stderr);
    assert!(o.stderr.contains("--workers"), "{}", o.stderr);
    let o = run(launcher(&["--workers", "0", "--chief", "--", "sh", "-c", r#"echo "$TF_CONFIG""#]));
    assert!(o.status.success(), "a chief alone is a cluster: {}", o.stderr);
    let config = tf_config_of(&o.stdout, "chief:0");
    assert_eq!(config["cluster"].as_object().unwrap().keys().collect::<Vec<_>>(), ["chief"]);
}

#[test]
fn tasks_start_with_no_signal_blocked() {
    // The issue measured SigBlk 0x4003 (SIGHUP, SIGINT, SIGTERM) in every task: the launcher's
    // own blocked mask was inherited.
    let o = run(launcher(&["--workers", "2", "--", "sh", "-c", "grep -E '^Sig(Blk|Ign)' /proc/self/status"]));
    assert!(o.status.success(), "stderr: {}", o.stderr);
    for task in ["worker:0", "worker:1"] {
        let lines = lines_of(&o.stdout, task);
        let blocked = lines.iter().find(|l| l.starts_with("SigBlk:")).unwrap_or_else(|| panic!("{:?}", o.stdout));
        assert_eq!(blocked.split_whitespace().nth(1), Some("0000000000000000"), "{task}: {blocked}");
    }
}

/// A stopped task (SIGSTOP) cannot act on SIGTERM: when another task fails, reporting it lost,
/// the launcher kills the stopped one at once instead of waiting out the grace period (60 s
/// here, past the hard timeout), names it with the survivor's report, and exits with the
/// survivor's code, not its own kill's (137).
#[test]
fn a_stopped_task_is_killed_at_once_and_named_from_the_survivors_report() {
    let script = r#"if [ "$STRATA_TASK" = worker:1 ]; then kill -STOP $$; exit 0; fi; sleep 0.5; echo 'error: training step 3 (epoch 0): task worker:0: all_reduce(sum, 10 f32) was aborted: lost task worker:1: no heartbeat for 3.1 s' >&2; exit 1"#;
    let o = run(launcher(&["--workers", "2", "--grace-period", "60s", "--", "sh", "-c", script]));
    assert_eq!(o.status.code(), Some(1), "the survivor's code; stderr: {}", o.stderr);
    let last = o.stderr.lines().rfind(|l| l.starts_with("strata launch:")).unwrap_or_default();
    assert!(
        last.starts_with("strata launch: the job failed in task worker:1, which task worker:0 reported lost: error:")
            && last.contains("lost task worker:1: no heartbeat"),
        "stderr: {}",
        o.stderr
    );
    assert!(!o.stderr.contains("was killed by SIGKILL"), "the launcher's own kill is no cause: {}", o.stderr);
}
