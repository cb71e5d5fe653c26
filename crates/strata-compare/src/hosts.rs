//! Emulated hosts for `strata compare`: an experiment's `[network]` (`hosts = N`, `link =
//! "1gbit"`) runs its multi-process runs on `N` network namespaces on one bridge, every host's
//! link shaped with tc's tbf in both directions, as `scripts/bench/hosts.sh` does.
//!
//! Topology (every name starts with [`PREFIX`]; nothing is added to the root namespace, so the
//! traffic stays on this machine): the namespace `strata-cx-br` holds the bridge `br0`; host
//! `i` (0-based) is the namespace `strata-cx-h<i+1>` with `eth0` = `10.213.78.(11+i)/24`, whose
//! veth peer `h<i+1>` is a port of `br0`. A link at RATE is shaped on the egress of each end of
//! its veth pair:
//!
//! ```text
//! tc -n strata-cx-h<i> qdisc add dev eth0 root tbf rate RATE burst B latency 20ms
//! tc -n strata-cx-br   qdisc add dev h<i> root tbf rate RATE burst B latency 20ms
//! ```
//!
//! with `B = max(256 KiB, 4 ms at RATE)` (hosts.sh's: smaller bursts do not reach the rate on a
//! veth). [`Hosts`] is the guard: it takes a lock (`/run/lock/strata-cx.lock`, one harness at
//! a time), removes a killed run's leftovers ([`remove_leftovers`]), builds the hosts, and on
//! drop (the end, an error, a panic) kills every process left in its namespaces and deletes
//! them, their veths and the bridge with them.

use std::ffi::OsStr;
use std::fs::File;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde::Serialize;

/// The prefix of every namespace this module makes (hosts.sh's is `strata-bh-`).
pub const PREFIX: &str = "strata-cx-";
/// The most hosts an experiment may ask for.
pub const MAX_HOSTS: usize = 16;
/// The lock one harness holds while its hosts exist.
pub const LOCK: &str = "/run/lock/strata-cx.lock";
const BRIDGE_NS: &str = "strata-cx-br";
const SUBNET: [u8; 3] = [10, 213, 78];
const LATENCY: &str = "20ms";

/// Why the hosts cannot be built (each message one line that says what to change).
#[derive(Debug, thiserror::Error)]
pub enum HostsError {
    /// Not root.
    #[error("emulated hosts need root (network namespaces, tc): run as root, e.g. with sudo, or drop [network] to run on loopback")]
    NotRoot,
    /// `ip` or `tc` is not on PATH.
    #[error("emulated hosts need `{0}` on PATH: install iproute2 (Debian: apt-get install iproute2), or drop [network] to run on loopback")]
    MissingTool(&'static str),
    /// Another harness holds the lock.
    #[error("another strata compare with [network] holds {}: wait for it to end", .0.display())]
    Locked(PathBuf),
    /// A command that builds or shapes the hosts failed.
    #[error("{command} failed: {stderr}")]
    Command {
        /// The command line.
        command: String,
        /// What it printed.
        stderr: String,
    },
    /// An I/O error with context.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

impl From<HostsError> for crate::Error {
    fn from(e: HostsError) -> Self {
        match e {
            HostsError::Io { context, source } => crate::Error::io(context, source),
            // Root, the tools and the lock are the user's to fix (exit code 2); so is a
            // command that fails on this machine (with what it said).
            e => crate::Error::Usage(e.to_string()),
        }
    }
}

/// A link's rate: `None` for `unshaped`, else bits per second. Accepts tc's syntax: a
/// positive number and a unit of `bit`, `kbit`, `mbit`, `gbit`, `tbit` (bits per second) or
/// `bps`, `kbps`, `mbps`, `gbps`, `tbps` (bytes per second), in any case.
pub fn parse_rate(text: &str) -> Result<Option<f64>, String> {
    let t = text.trim();
    if t == "unshaped" {
        return Ok(None);
    }
    let bad = || {
        format!(
            "{text:?} is not a link rate: write a number and one of tc's units bit, kbit, mbit, gbit, bps, kbps, mbps, gbps (bps: bytes per second), e.g. \"1gbit\", or \"unshaped\""
        )
    };
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).ok_or_else(bad)?;
    let (num, unit) = t.split_at(split);
    let scale = match unit.to_ascii_lowercase().as_str() {
        "bit" => 1.0,
        "kbit" => 1e3,
        "mbit" => 1e6,
        "gbit" => 1e9,
        "tbit" => 1e12,
        "bps" => 8.0,
        "kbps" => 8e3,
        "mbps" => 8e6,
        "gbps" => 8e9,
        "tbps" => 8e12,
        _ => return Err(bad()),
    };
    if num.is_empty() || num.starts_with('.') || num.ends_with('.') || num.matches('.').count() > 1 {
        return Err(bad());
    }
    let v: f64 = num.parse().map_err(|_| bad())?;
    let bits = v * scale;
    if !(8_000.0..=1e13).contains(&bits) {
        return Err(format!("{text:?} is out of range: a link rate from 8kbit to 10tbit, e.g. \"1gbit\""));
    }
    Ok(Some(bits))
}

/// `1 Gbit/s`, `100 Mbit/s`, `unshaped`.
pub fn describe_rate(bits: Option<f64>) -> String {
    let Some(bits) = bits else { return "unshaped".into() };
    for (unit, mult) in [("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)] {
        if bits >= mult {
            return format!("{} {unit}", trim_float(bits / mult));
        }
    }
    format!("{} bit/s", trim_float(bits))
}

fn trim_float(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// tbf's burst for a rate: `max(256 KiB, 4 ms at the rate)`, in bytes.
pub fn burst_bytes(bits: f64) -> u64 {
    (256 * 1024).max((bits / 8.0 * 0.004) as u64)
}

/// An experiment's `[network]`: the hosts and their links.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Network {
    /// Emulated hosts, 2 to [`MAX_HOSTS`].
    pub hosts: usize,
    /// The link as written (`1gbit`, `unshaped`).
    pub link: String,
    /// The link's rate in bits per second (`None`: unshaped).
    pub rate_bps: Option<f64>,
}

impl Network {
    /// One line for the report: `2 emulated hosts, links of 1 Gbit/s`.
    pub fn describe(&self) -> String {
        match self.rate_bps {
            Some(_) => format!(
                "{} emulated hosts (network namespaces on one bridge), every link tbf-shaped at {} in both directions",
                self.hosts,
                describe_rate(self.rate_bps)
            ),
            None => format!("{} emulated hosts (network namespaces on one bridge), links unshaped", self.hosts),
        }
    }
}

/// How tasks map to hosts, for the report.
pub const PLACEMENT: &str = "worker i on host i mod N, ps task j on host W + j where the N hosts have one for each of the W workers and the ps tasks, else on host j mod N, the parameter-server coordinator on host 0";

/// Which host each task of a multi-process run of `workers` workers and `ps_tasks` ps tasks is
/// on: worker `i` on host `i mod N`; ps task `j` on a host of its own, `workers + j`, where
/// there are hosts enough for every worker and ps task, else (colocated, as TensorFlow's
/// layout) on host `j mod N`; a parameter-server run's coordinator (chief) on host 0.
pub fn host_of(kind: TaskKind, index: usize, hosts: usize, workers: usize, ps_tasks: usize) -> usize {
    match kind {
        TaskKind::Chief => 0,
        TaskKind::Ps if hosts >= workers + ps_tasks => workers + index,
        TaskKind::Worker | TaskKind::Ps => index % hosts.max(1),
    }
}

/// A task's kind, as `TF_CONFIG` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskKind {
    /// The parameter-server coordinator.
    Chief,
    /// A worker.
    Worker,
    /// A parameter server.
    Ps,
}

impl TaskKind {
    /// `chief`, `worker`, `ps`.
    pub fn name(self) -> &'static str {
        match self {
            TaskKind::Chief => "chief",
            TaskKind::Worker => "worker",
            TaskKind::Ps => "ps",
        }
    }
}

/// Whether `tool` is an executable file in one of `path`'s directories.
fn on_path(tool: &str, path: Option<&OsStr>) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.is_some_and(|p| {
        std::env::split_paths(p)
            .any(|d| std::fs::metadata(d.join(tool)).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
    })
}

/// The checks made before anything is created: root, then `ip` and `tc` on `path`.
pub fn preflight_with(is_root: bool, path: Option<&OsStr>) -> Result<(), HostsError> {
    if !is_root {
        return Err(HostsError::NotRoot);
    }
    for tool in ["ip", "tc"] {
        if !on_path(tool, path) {
            return Err(HostsError::MissingTool(tool));
        }
    }
    Ok(())
}

/// [`preflight_with`] for this process.
pub fn preflight() -> Result<(), HostsError> {
    preflight_with(nix::unistd::geteuid().is_root(), std::env::var_os("PATH").as_deref())
}

fn sh(args: &[&str]) -> Result<String, HostsError> {
    let (prog, rest) = args
        .split_first()
        .ok_or_else(|| HostsError::Command { command: String::new(), stderr: "no command".into() })?;
    let out = Command::new(prog)
        .args(rest)
        .output()
        .map_err(|e| HostsError::Io { context: format!("cannot run {prog}"), source: e })?;
    if !out.status.success() {
        return Err(HostsError::Command {
            command: args.join(" "),
            stderr: String::from_utf8_lossy(&out.stderr).trim().replace('\n', "; "),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The namespaces whose names start with [`PREFIX`].
pub fn our_namespaces() -> Vec<String> {
    let out = Command::new("ip").args(["netns", "list"]).output();
    let text = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(PREFIX))
        .map(str::to_string)
        .collect()
}

/// The processes in namespace `ns`.
pub fn pids_in(ns: &str) -> Vec<i32> {
    let out = Command::new("ip").args(["netns", "pids", ns]).output();
    let text = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
    text.split_whitespace().filter_map(|p| p.parse().ok()).collect()
}

/// SIGTERM to every process in `namespaces`, then SIGKILL to those still there after `grace`.
pub fn kill_in(namespaces: &[String], grace: Duration) {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    let all = || namespaces.iter().flat_map(|ns| pids_in(ns)).collect::<Vec<_>>();
    let pids = all();
    if pids.is_empty() {
        return;
    }
    for p in &pids {
        let _ = kill(Pid::from_raw(*p), Signal::SIGTERM);
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline && !all().is_empty() {
        std::thread::sleep(Duration::from_millis(50));
    }
    for p in all() {
        let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline && !all().is_empty() {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Kills every process left in a `strata-cx-` namespace and deletes the namespaces (their
/// veths and the bridge go with them): a killed harness's leftovers. Call it with the lock held.
pub fn remove_leftovers() {
    let namespaces = our_namespaces();
    kill_in(&namespaces, Duration::from_secs(2));
    for ns in &namespaces {
        let _ = Command::new("ip").args(["netns", "del", ns]).output();
    }
}

/// `N` emulated hosts; dropping it removes them (and every process in them).
#[derive(Debug)]
pub struct Hosts {
    n: usize,
    rate_bps: Option<f64>,
    _lock: File,
    torn_down: bool,
}

impl Hosts {
    /// Checks root and the tools, takes the lock, removes leftovers, builds `net.hosts` hosts
    /// and shapes their links. On an error whatever was built is removed.
    pub fn build(net: &Network) -> Result<Hosts, HostsError> {
        preflight()?;
        let lock_path = Path::new(LOCK);
        if let Some(dir) = lock_path.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| HostsError::Io { context: format!("cannot create {}", dir.display()), source: e })?;
        }
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(lock_path)
            .map_err(|e| HostsError::Io { context: format!("cannot open {LOCK}"), source: e })?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => return Err(HostsError::Locked(lock_path.to_path_buf())),
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(HostsError::Io { context: format!("cannot lock {LOCK}"), source: e })
            }
        }
        remove_leftovers();
        let hosts = Hosts { n: net.hosts, rate_bps: net.rate_bps, _lock: lock, torn_down: false };
        hosts.create()?;
        Ok(hosts)
    }

    fn create(&self) -> Result<(), HostsError> {
        sh(&["ip", "netns", "add", BRIDGE_NS])?;
        sh(&["ip", "-n", BRIDGE_NS, "link", "add", "br0", "type", "bridge"])?;
        sh(&["ip", "-n", BRIDGE_NS, "link", "set", "br0", "up"])?;
        for i in 0..self.n {
            let ns = self.netns(i);
            let port = format!("h{}", i + 1);
            sh(&["ip", "netns", "add", &ns])?;
            sh(&[
                "ip", "link", "add", "eth0", "netns", &ns, "type", "veth", "peer", "name", &port, "netns", BRIDGE_NS,
            ])?;
            sh(&["ip", "-n", BRIDGE_NS, "link", "set", &port, "master", "br0", "up"])?;
            sh(&["ip", "-n", &ns, "addr", "add", &format!("{}/24", self.addr(i)), "dev", "eth0"])?;
            sh(&["ip", "-n", &ns, "link", "set", "eth0", "up"])?;
            sh(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
            if let Some(bits) = self.rate_bps {
                let rate = format!("{}bit", bits.round() as u64);
                let burst = burst_bytes(bits).to_string();
                for (space, dev) in [(ns.as_str(), "eth0"), (BRIDGE_NS, port.as_str())] {
                    sh(&[
                        "tc", "-n", space, "qdisc", "add", "dev", dev, "root", "tbf", "rate", &rate, "burst", &burst,
                        "latency", LATENCY,
                    ])?;
                }
            }
        }
        Ok(())
    }

    /// The number of hosts.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Never true: there are 2 hosts at least.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Host `i`'s namespace (`strata-cx-h<i+1>`).
    pub fn netns(&self, i: usize) -> String {
        format!("{PREFIX}h{}", i + 1)
    }

    /// Every host's namespace.
    pub fn namespaces(&self) -> Vec<String> {
        (0..self.n).map(|i| self.netns(i)).collect()
    }

    /// Host `i`'s address.
    pub fn addr(&self, i: usize) -> Ipv4Addr {
        let [a, b, c] = SUBNET;
        Ipv4Addr::new(a, b, c, 11 + i as u8)
    }

    /// `program` run on host `i` (`ip netns exec`, which execs it: the child's id is the
    /// program's).
    pub fn command(&self, i: usize, program: impl AsRef<OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.netns(i)]).arg(program);
        c
    }

    /// Kills whatever a run left in the hosts.
    pub fn kill_all(&self) {
        kill_in(&self.namespaces(), Duration::from_secs(5));
    }

    /// TCP goodput from host 0 to host 1 over about `secs` seconds (one stream), in bits per
    /// second; `None` if it cannot be measured.
    pub fn measure_goodput(&self, secs: f64) -> Option<f64> {
        use std::io::{Read, Write};
        if self.n < 2 {
            return None;
        }
        let server_ns = format!("/run/netns/{}", self.netns(1));
        let client_ns = format!("/run/netns/{}", self.netns(0));
        let target = std::net::SocketAddr::from((self.addr(1), 19_999));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<bool>();
        let server = std::thread::spawn(move || -> Option<f64> {
            let ok = enter_netns(&server_ns).is_ok();
            let listener = ok.then(|| std::net::TcpListener::bind(target).ok()).flatten();
            let _ = ready_tx.send(listener.is_some());
            let (mut c, _) = listener?.accept().ok()?;
            c.set_read_timeout(Some(Duration::from_secs(20))).ok()?;
            let mut buf = vec![0u8; 1 << 20];
            let (mut n, mut t0) = (0u64, None);
            loop {
                match c.read(&mut buf) {
                    Ok(0) => break,
                    Ok(k) => {
                        t0.get_or_insert_with(Instant::now);
                        n += k as u64;
                    }
                    Err(_) => return None,
                }
            }
            let t = t0?.elapsed().as_secs_f64();
            (t > 0.0).then(|| n as f64 * 8.0 / t)
        });
        if ready_rx.recv_timeout(Duration::from_secs(5)) != Ok(true) {
            return None;
        }
        let client = std::thread::spawn(move || -> Option<()> {
            enter_netns(&client_ns).ok()?;
            let mut c = std::net::TcpStream::connect_timeout(&target, Duration::from_secs(5)).ok()?;
            c.set_write_timeout(Some(Duration::from_secs(10))).ok()?;
            let buf = vec![0u8; 1 << 20];
            let end = Instant::now() + Duration::from_secs_f64(secs);
            while Instant::now() < end {
                c.write_all(&buf).ok()?;
            }
            Some(())
        });
        let _ = client.join();
        server.join().ok().flatten()
    }

    /// Kills every process in the hosts and deletes them (also on drop).
    pub fn teardown(&mut self) {
        if self.torn_down {
            return;
        }
        self.torn_down = true;
        let mut all = self.namespaces();
        all.push(BRIDGE_NS.to_string());
        kill_in(&all, Duration::from_secs(5));
        for ns in &all {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// Moves the calling thread into the network namespace at `path` (a thread of its own: the
/// namespace is per thread).
fn enter_netns(path: &str) -> std::io::Result<()> {
    let f = File::open(path)?;
    nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse_as_tc_writes_them() {
        assert_eq!(parse_rate("1gbit"), Ok(Some(1e9)));
        assert_eq!(parse_rate("10Gbit"), Ok(Some(1e10)));
        assert_eq!(parse_rate("100mbit"), Ok(Some(1e8)));
        assert_eq!(parse_rate("2.5gbit"), Ok(Some(2.5e9)));
        assert_eq!(parse_rate("125mbps"), Ok(Some(1e9)));
        assert_eq!(parse_rate("64kbit"), Ok(Some(64e3)));
        assert_eq!(parse_rate("unshaped"), Ok(None));
        for bad in ["1 gigabit", "gbit", "1", "1gb", "-1gbit", "1..5gbit", ".5gbit", "1e9bit", ""] {
            let e = parse_rate(bad).unwrap_err();
            assert!(e.contains("is not a link rate") && e.contains("e.g. \"1gbit\""), "{bad}: {e}");
        }
        assert!(parse_rate("0gbit").unwrap_err().contains("out of range"));
        assert!(parse_rate("100tbit").unwrap_err().contains("out of range"));
        assert_eq!(describe_rate(Some(1e9)), "1 Gbit/s");
        assert_eq!(describe_rate(Some(2.5e8)), "250 Mbit/s");
        assert_eq!(describe_rate(None), "unshaped");
        assert_eq!(burst_bytes(1e9), 500_000);
        assert_eq!(burst_bytes(1e8), 262_144);
    }

    #[test]
    fn tasks_map_round_robin_by_kind_with_the_chief_on_host_0() {
        let at = |k, i| host_of(k, i, 2, 3, 2);
        assert_eq!((at(TaskKind::Worker, 0), at(TaskKind::Worker, 1), at(TaskKind::Worker, 2)), (0, 1, 0));
        assert_eq!((at(TaskKind::Ps, 0), at(TaskKind::Ps, 1), at(TaskKind::Chief, 0)), (0, 1, 0));
        assert_eq!(host_of(TaskKind::Worker, 5, 4, 6, 0), 1);
        // Hosts enough for every task: each ps task on one of its own, after the workers'.
        let four = |k, i| host_of(k, i, 4, 2, 2);
        assert_eq!((four(TaskKind::Worker, 0), four(TaskKind::Worker, 1)), (0, 1));
        assert_eq!((four(TaskKind::Ps, 0), four(TaskKind::Ps, 1), four(TaskKind::Chief, 0)), (2, 3, 0));
        // One short: colocated again.
        assert_eq!((host_of(TaskKind::Ps, 0, 3, 2, 2), host_of(TaskKind::Ps, 1, 3, 2, 2)), (0, 1));
    }

    #[test]
    fn preflight_names_what_is_missing() {
        assert_eq!(
            preflight_with(false, None).unwrap_err().to_string(),
            "emulated hosts need root (network namespaces, tc): run as root, e.g. with sudo, or drop [network] to run on loopback"
        );
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(
            preflight_with(true, Some(empty.path().as_os_str())).unwrap_err().to_string(),
            "emulated hosts need `ip` on PATH: install iproute2 (Debian: apt-get install iproute2), or drop [network] to run on loopback"
        );
        // Only `ip` there: `tc` is named.
        let ip = empty.path().join("ip");
        std::fs::write(&ip, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&ip, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let e = preflight_with(true, Some(empty.path().as_os_str())).unwrap_err();
        assert!(e.to_string().starts_with("emulated hosts need `tc` on PATH"), "{e}");
    }
}
