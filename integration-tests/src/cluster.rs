//! Hosts as network namespaces on one bridge, and a real Slurm on them, for the tests that
//! need more than loopback.
//!
//! [`Hosts::new`] builds `n` hosts: each a network namespace with its own address on a bridge
//! private to the harness, its own host name (a UTS namespace per command), and a hosts file
//! and an empty `resolv.conf` private to the harness (`/etc/netns/<namespace>/`, which `ip
//! netns exec` mounts over `/etc`), so host names resolve as they would on a real cluster and
//! nowhere else. [`Slurm::start`] runs Debian's Slurm on them: munged, slurmctld on the first
//! host, one `slurmd -N` per host. Everything is torn down on every exit path (drop, a test's
//! panic included), and [`Hosts::teardown`] reports anything left behind: a process in one of
//! the namespaces, a namespace, a link or a mount.
//!
//! Building hosts needs root (`ip netns`); Slurm needs the packages `slurm-wlm` and `munge`,
//! which CI installs. Without them the tests skip with a message, unless
//! `STRATA_REQUIRE_CLUSTER=1` (CI sets it), which turns a skip into a failure.

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Why a cluster test cannot run here.
#[derive(Debug)]
pub struct Skip(pub String);

/// Runs `f` with what `setup` made, or prints why the test is skipped (and fails instead when
/// `STRATA_REQUIRE_CLUSTER=1`).
pub fn or_skip<T>(setup: Result<T, Skip>) -> Option<T> {
    match setup {
        Ok(t) => Some(t),
        Err(Skip(why)) => {
            if std::env::var("STRATA_REQUIRE_CLUSTER").is_ok_and(|v| v == "1") {
                panic!("STRATA_REQUIRE_CLUSTER=1 but the cluster test cannot run: {why}");
            }
            eprintln!("skipped: {why}");
            None
        }
    }
}

fn run(cmd: &mut Command) -> Output {
    cmd.output().unwrap_or_else(|e| panic!("{cmd:?} could not start: {e}"))
}

fn must(cmd: &mut Command) -> String {
    let o = run(cmd);
    assert!(o.status.success(), "{cmd:?} failed ({}): {}", o.status, String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn ip(args: &[&str]) -> Command {
    let mut c = Command::new("ip");
    c.args(args);
    c
}

/// One cluster at a time in a test process: the tests are heavy, and two would share nothing.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
static NEXT: AtomicU32 = AtomicU32::new(0);

/// `n` hosts as network namespaces on one bridge.
pub struct Hosts {
    tag: String,
    subnet: [u8; 3],
    names: Vec<String>,
    /// The network namespaces' inodes, to find any process left in one.
    inodes: Vec<u64>,
    dir: tempfile::TempDir,
    torn_down: bool,
    _one: MutexGuard<'static, ()>,
}

impl Hosts {
    /// `n` hosts named `node1`..`node<n>`, every name resolvable on every host.
    pub fn new(n: usize) -> Result<Hosts, Skip> {
        Hosts::build(n, &[])
    }

    /// `n` hosts whose hosts files leave out the names of the hosts in `unresolvable`
    /// (0-based), as on a cluster where a node name is an alias nobody resolves.
    pub fn with_unresolvable(n: usize, unresolvable: &[usize]) -> Result<Hosts, Skip> {
        Hosts::build(n, unresolvable)
    }

    fn build(n: usize, unresolvable: &[usize]) -> Result<Hosts, Skip> {
        assert!((1..=200).contains(&n), "1 to 200 hosts");
        if !is_root() {
            return Err(Skip("building hosts from network namespaces needs root".into()));
        }
        for tool in ["ip", "unshare"] {
            if Command::new(tool).arg("-V").output().is_err() {
                return Err(Skip(format!("`{tool}` is not installed (Debian: iproute2, util-linux)")));
            }
        }
        let one = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let pid = std::process::id();
        let k = NEXT.fetch_add(1, Ordering::Relaxed);
        let tag = format!("{}{}", pid % 100_000, k % 100);
        let subnet = [10, 100 + (pid % 100) as u8, (k % 250) as u8];
        let dir = tempfile::Builder::new().prefix("strata-hosts-").tempdir().expect("a temporary directory");
        let names: Vec<String> = (1..=n).map(|i| format!("node{i}")).collect();
        let mut hosts = Hosts { tag, subnet, names, inodes: Vec::new(), dir, torn_down: false, _one: one };
        let bridge = hosts.bridge();
        let o = run(&mut ip(&["link", "add", &bridge, "type", "bridge"]));
        if !o.status.success() {
            return Err(Skip(format!(
                "cannot create a bridge ({}); the cluster tests need CAP_NET_ADMIN",
                String::from_utf8_lossy(&o.stderr).trim()
            )));
        }
        must(&mut ip(&["addr", "add", &format!("{}/24", hosts.gateway()), "dev", &bridge]));
        must(&mut ip(&["link", "set", &bridge, "up"]));
        let mut hosts_file = String::from("127.0.0.1 localhost\n");
        for i in 0..n {
            if !unresolvable.contains(&i) {
                hosts_file.push_str(&format!("{} {}\n", hosts.addr(i), hosts.names[i]));
            }
        }
        for i in 0..n {
            let ns = hosts.netns(i);
            let veth = format!("sv{}x{i}", hosts.tag);
            must(&mut ip(&["netns", "add", &ns]));
            let inode = std::fs::metadata(format!("/run/netns/{ns}")).map(|m| std::os::unix::fs::MetadataExt::ino(&m));
            hosts.inodes.push(inode.expect("the namespace's file"));
            must(&mut ip(&["link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns]));
            must(&mut ip(&["link", "set", &veth, "master", &bridge, "up"]));
            must(&mut ip(&["-n", &ns, "addr", "add", &format!("{}/24", hosts.addr(i)), "dev", "eth0"]));
            must(&mut ip(&["-n", &ns, "link", "set", "eth0", "up"]));
            must(&mut ip(&["-n", &ns, "link", "set", "lo", "up"]));
            let etc = Path::new("/etc/netns").join(&ns);
            std::fs::create_dir_all(&etc).expect("/etc/netns/<namespace>");
            std::fs::write(etc.join("hosts"), &hosts_file).expect("the hosts file");
            std::fs::write(etc.join("resolv.conf"), "").expect("resolv.conf");
        }
        Ok(hosts)
    }

    /// The number of hosts.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Whether there are no hosts (never: a cluster has one at least).
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Host `i`'s name (`node<i+1>`).
    pub fn name(&self, i: usize) -> &str {
        &self.names[i]
    }

    /// Host `i`'s address.
    pub fn addr(&self, i: usize) -> Ipv4Addr {
        let [a, b, c] = self.subnet;
        Ipv4Addr::new(a, b, c, 11 + i as u8)
    }

    /// The bridge's own address (the test process reaches the hosts through it).
    pub fn gateway(&self) -> Ipv4Addr {
        let [a, b, c] = self.subnet;
        Ipv4Addr::new(a, b, c, 1)
    }

    /// Host `i`'s network namespace.
    pub fn netns(&self, i: usize) -> String {
        format!("strata-{}-h{}", self.tag, i + 1)
    }

    fn bridge(&self) -> String {
        format!("sb{}", self.tag)
    }

    /// A directory that lives as long as the hosts (configuration, logs).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `program` run on host `i`: in its network namespace, with its host name.
    pub fn command(&self, i: usize, program: impl AsRef<OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.netns(i), "unshare", "--uts", "sh", "-c", "hostname \"$0\" && exec \"$@\""]);
        c.arg(&self.names[i]).arg(program);
        c
    }

    /// Cuts host `i` off the others (its link down at both ends), as a network partition does.
    pub fn cut(&self, i: usize) {
        must(&mut ip(&["-n", &self.netns(i), "link", "set", "eth0", "down"]));
        must(&mut ip(&["link", "set", &format!("sv{}x{i}", self.tag), "down"]));
    }

    /// Joins host `i` to the others again after [`cut`](Self::cut), as a healed partition does.
    pub fn heal(&self, i: usize) {
        must(&mut ip(&["link", "set", &format!("sv{}x{i}", self.tag), "up"]));
        must(&mut ip(&["-n", &self.netns(i), "link", "set", "eth0", "up"]));
    }

    /// Bytes that crossed the hosts' links so far (every byte a host sent onto the bridge).
    pub fn link_bytes(&self) -> u64 {
        (0..self.len())
            .map(|i| {
                let f = format!("/sys/class/net/sv{}x{i}/statistics/rx_bytes", self.tag);
                std::fs::read_to_string(f).ok().and_then(|s| s.trim().parse::<u64>().ok()).unwrap_or(0)
            })
            .sum()
    }

    /// The processes running in any of the hosts.
    pub fn processes(&self) -> Vec<(u32, String)> {
        let wanted: BTreeSet<String> = self.inodes.iter().map(|i| format!("net:[{i}]")).collect();
        let mut found = Vec::new();
        let Ok(entries) = std::fs::read_dir("/proc") else { return found };
        for e in entries.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
            let Ok(ns) = std::fs::read_link(e.path().join("ns/net")) else { continue };
            if wanted.contains(ns.to_string_lossy().as_ref()) {
                let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
                let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
                found.push((pid, cmd.trim().to_string()));
            }
        }
        found
    }

    /// Stops every process in the hosts and removes the namespaces, the bridge, the links and
    /// the hosts files; returns what is left behind (nothing, when all went well).
    pub fn teardown(&mut self) -> Vec<String> {
        if self.torn_down {
            return Vec::new();
        }
        self.torn_down = true;
        for signal in [nix::sys::signal::Signal::SIGTERM, nix::sys::signal::Signal::SIGKILL] {
            let procs = self.processes();
            if procs.is_empty() {
                break;
            }
            for (pid, _) in &procs {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid as i32), signal);
            }
            let until = Instant::now() + Duration::from_secs(3);
            while Instant::now() < until && !self.processes().is_empty() {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        for i in 0..self.len() {
            // Deleting the host's end of the link pair removes both ends now; a namespace's
            // removal would remove them later.
            let _ = run(&mut ip(&["link", "del", &format!("sv{}x{i}", self.tag)]));
            let _ = run(&mut ip(&["netns", "del", &self.netns(i)]));
            let _ = std::fs::remove_dir_all(Path::new("/etc/netns").join(self.netns(i)));
        }
        let _ = run(&mut ip(&["link", "del", &self.bridge()]));
        // The kernel may finish removing links a moment after the commands return.
        let until = Instant::now() + Duration::from_secs(3);
        loop {
            let left = self.leftovers();
            if left.is_empty() || Instant::now() > until {
                return left;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// What of these hosts still exists: processes, namespaces, links, mounts.
    pub fn leftovers(&self) -> Vec<String> {
        let mut left: Vec<String> =
            self.processes().into_iter().map(|(pid, cmd)| format!("process {pid} ({cmd})")).collect();
        let namespaces = String::from_utf8_lossy(&run(&mut ip(&["netns", "list"])).stdout).into_owned();
        let prefix = format!("strata-{}-", self.tag);
        left.extend(namespaces.lines().filter(|l| l.starts_with(&prefix)).map(|l| format!("namespace {l}")));
        let links = String::from_utf8_lossy(&run(&mut ip(&["-o", "link"])).stdout).into_owned();
        for l in links.lines() {
            let name = l.split(':').nth(1).unwrap_or("").trim();
            let name = name.split('@').next().unwrap_or("");
            if name == self.bridge() || name.starts_with(&format!("sv{}x", self.tag)) {
                left.push(format!("link {name}"));
            }
        }
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        left.extend(mounts.lines().filter(|l| l.contains(&prefix)).map(|l| format!("mount {l}")));
        if Path::new("/etc/netns").exists() {
            for e in std::fs::read_dir("/etc/netns").into_iter().flatten().flatten() {
                if e.file_name().to_string_lossy().starts_with(&prefix) {
                    left.push(format!("directory {}", e.path().display()));
                }
            }
        }
        left
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        let left = self.teardown();
        if !left.is_empty() {
            eprintln!("the hosts left behind: {}", left.join("; "));
        }
    }
}

/// How a Slurm job ended.
#[derive(Debug, Clone, PartialEq)]
pub struct JobEnd {
    /// `COMPLETED`, `FAILED`, `CANCELLED`, `TIMEOUT`...
    pub state: String,
    /// The batch script's exit code and, after the colon, the signal that ended it.
    pub exit_code: String,
    /// Seconds from start to end, as Slurm measured them.
    pub seconds: f64,
}

/// A real Slurm cluster on [`Hosts`]: munged, slurmctld on the first host, a slurmd per host.
pub struct Slurm {
    daemons: Vec<(String, Child)>,
    conf: PathBuf,
    run: PathBuf,
    hosts: Hosts,
}

impl Slurm {
    /// Starts Slurm on `hosts`, each with `cpus` CPUs; returns once every node is idle.
    pub fn start(hosts: Hosts, cpus: usize) -> Result<Slurm, Skip> {
        for tool in ["slurmctld", "slurmd", "munged", "sbatch", "scontrol", "sinfo", "scancel"] {
            if !["/usr/sbin", "/usr/bin"].iter().any(|d| Path::new(d).join(tool).exists()) {
                return Err(Skip(format!(
                    "`{tool}` is not installed; install Debian's slurm-wlm and munge (.ci/run does)"
                )));
            }
        }
        let run = hosts.dir().join("slurm");
        for d in ["state", "spool", "munge", "log"] {
            std::fs::create_dir_all(run.join(d)).expect("the cluster's directories");
        }
        let munge_dir = run.join("munge");
        set_mode(&munge_dir, 0o700);
        let key = run.join("munge.key");
        let mut bytes = vec![0u8; 1024];
        getrandom(&mut bytes);
        std::fs::write(&key, &bytes).expect("the munge key");
        set_mode(&key, 0o400);
        let socket = munge_dir.join("munge.socket");
        let n = hosts.len();
        let conf = run.join("slurm.conf");
        let log = run.join("log");
        let nodes = (0..n)
            .map(|i| format!("NodeName={} NodeAddr={} CPUs={cpus} State=UNKNOWN\n", hosts.name(i), hosts.addr(i)))
            .collect::<String>();
        let text = format!(
            "ClusterName=strata\n\
             SlurmctldHost={ctl}({ctl_addr})\n\
             SlurmUser=root\nSlurmdUser=root\n\
             AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={socket}\n\
             MailProg=/bin/true\n\
             StateSaveLocation={state}\nSlurmdSpoolDir={spool}/%n\n\
             SlurmctldPidFile={run}/slurmctld.pid\nSlurmdPidFile={run}/slurmd-%n.pid\n\
             SlurmctldLogFile={log}/slurmctld.log\nSlurmdLogFile={log}/slurmd-%n.log\n\
             SlurmctldPort=6817\nSlurmdPort=6818\n\
             ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n\
             SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n\
             MpiDefault=none\nReturnToService=2\nSchedulerType=sched/backfill\n\
             JobCompType=jobcomp/none\nJobAcctGatherType=jobacct_gather/none\n\
             KillWait=5\nMinJobAge=3600\n\
             {nodes}\
             PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n",
            ctl = hosts.name(0),
            ctl_addr = hosts.addr(0),
            socket = socket.display(),
            state = run.join("state").display(),
            spool = run.join("spool").display(),
            run = run.display(),
            log = log.display(),
        );
        std::fs::write(&conf, text).expect("slurm.conf");
        // `ip netns exec` gives the daemons a /sys without cgroups: name the plugin, so that
        // slurmd does not look for one.
        std::fs::write(run.join("cgroup.conf"), "CgroupPlugin=cgroup/v1\n").expect("cgroup.conf");
        let mut slurm = Slurm { daemons: Vec::new(), conf, run: run.clone(), hosts };
        let quiet = |mut c: Command| {
            c.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
            c
        };
        // munged refuses a socket under a 0700 directory unless forced.
        let mut munged = quiet(slurm.hosts.command(0, "munged"));
        munged.args(["--foreground", "--force", "--key-file"]).arg(&key);
        munged.arg("--socket").arg(&socket).arg("--pid-file").arg(munge_dir.join("munged.pid"));
        munged.arg("--log-file").arg(log.join("munged.log")).arg("--seed-file").arg(munge_dir.join("seed"));
        slurm.spawn("munged", munged);
        wait_for(Duration::from_secs(10), "munged's socket", || socket.exists());
        let mut ctld = quiet(slurm.hosts.command(0, "slurmctld"));
        ctld.args(["-D", "-i", "-f"]).arg(&slurm.conf);
        slurm.spawn("slurmctld", ctld);
        for i in 0..n {
            std::fs::create_dir_all(run.join("spool").join(slurm.hosts.name(i))).expect("the spool directory");
            let mut d = quiet(slurm.hosts.command(i, "slurmd"));
            d.args(["-D", "-f"]).arg(&slurm.conf).args(["-N", slurm.hosts.name(i)]);
            let name = format!("slurmd on {}", slurm.hosts.name(i));
            slurm.spawn(&name, d);
        }
        let conf_for = slurm.conf.clone();
        wait_for(Duration::from_secs(30), "every node idle", || {
            let o = Command::new("sinfo").env("SLURM_CONF", &conf_for).args(["-h", "-o", "%t %D"]).output();
            o.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == format!("idle {n}"))
        });
        Ok(slurm)
    }

    fn spawn(&mut self, name: &str, mut cmd: Command) {
        let child = cmd.spawn().unwrap_or_else(|e| panic!("{name} could not start: {e}"));
        self.daemons.push((name.to_string(), child));
    }

    /// The hosts Slurm runs on.
    pub fn hosts(&self) -> &Hosts {
        &self.hosts
    }

    /// A Slurm command (`sbatch`, `scontrol`...) run from the test process, with this
    /// cluster's configuration.
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", &self.conf);
        c
    }

    /// Submits `script` from `dir` (the jobs' working directory, shared by every host as a
    /// cluster's file system is) with `args` before it and `env` added; returns the job id.
    pub fn sbatch(&self, dir: &Path, args: &[&str], script: &Path, env: &[(&str, &str)]) -> u32 {
        let mut c = self.command("sbatch");
        c.arg("--parsable").arg("--chdir").arg(dir).args(args).arg(script).current_dir(dir);
        for (k, v) in env {
            c.env(k, v);
        }
        let out = must(&mut c);
        out.trim().split(';').next().and_then(|id| id.parse().ok()).unwrap_or_else(|| panic!("sbatch printed {out:?}"))
    }

    /// `scontrol show job` of `job`, as `Key=Value` pairs.
    pub fn job(&self, job: u32) -> Vec<(String, String)> {
        let out = run(self.command("scontrol").args(["show", "job", "-o", &job.to_string()]));
        let text = String::from_utf8_lossy(&out.stdout);
        text.split_whitespace()
            .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
            .collect()
    }

    fn field(&self, job: u32, key: &str) -> Option<String> {
        self.job(job).into_iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Waits until `job` is running (or has ended), at most `timeout`.
    pub fn wait_running(&self, job: u32, timeout: Duration) {
        wait_for(timeout, &format!("job {job} running"), || {
            self.field(job, "JobState").is_some_and(|s| s != "PENDING" && s != "CONFIGURING")
        });
    }

    /// Waits for `job` to end, at most `timeout` (the job is cancelled, and the test fails, if
    /// it passes).
    pub fn wait(&self, job: u32, timeout: Duration) -> JobEnd {
        let until = Instant::now() + timeout;
        loop {
            let fields = self.job(job);
            let get = |k: &str| fields.iter().find(|(f, _)| f == k).map(|(_, v)| v.clone()).unwrap_or_default();
            let state = get("JobState");
            if !state.is_empty()
                && !["PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED"].contains(&state.as_str())
            {
                let seconds = parse_run_time(&get("RunTime"));
                return JobEnd { state, exit_code: get("ExitCode"), seconds };
            }
            if Instant::now() > until {
                let _ = run(self.command("scancel").arg(job.to_string()));
                panic!("job {job} did not end within {timeout:?} (state {state}); slurmctld's log:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Sends `signal` (`TERM`, `INT`...) to the tasks of `job`'s steps, as `scancel --signal`
    /// does on a preemption.
    pub fn signal(&self, job: u32, signal: &str) {
        must(self.command("scancel").arg(format!("--signal={signal}")).arg(job.to_string()));
    }

    /// The end of slurmctld's log (for a failing test's message).
    pub fn log(&self) -> String {
        let text = std::fs::read_to_string(self.run.join("log/slurmctld.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// Stops the daemons and the hosts; returns what is left behind.
    pub fn teardown(&mut self) -> Vec<String> {
        for (_, child) in &mut self.daemons {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        let until = Instant::now() + Duration::from_secs(5);
        for (_, child) in &mut self.daemons {
            while Instant::now() < until && matches!(child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        self.daemons.clear();
        self.hosts.teardown()
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        let left = self.teardown();
        if !left.is_empty() {
            eprintln!("the Slurm cluster left behind: {}", left.join("; "));
        }
    }
}

/// Slurm's `RunTime` (`[days-]HH:MM:SS`) in seconds.
fn parse_run_time(t: &str) -> f64 {
    let (days, hms) = t.split_once('-').map_or((0.0, t), |(d, r)| (d.parse().unwrap_or(0.0), r));
    let secs = hms.split(':').fold(0.0, |acc, p| acc * 60.0 + p.parse::<f64>().unwrap_or(0.0));
    days * 86_400.0 + secs
}

/// Whether this process runs as root (its effective uid, from /proc).
fn is_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let uid = status.lines().find_map(|l| l.strip_prefix("Uid:"));
    uid.and_then(|u| u.split_whitespace().nth(1)).is_some_and(|euid| euid == "0")
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("permissions");
}

fn getrandom(buf: &mut [u8]) {
    use std::io::Read;
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(buf)).expect("random bytes");
}

/// Polls `ready` every 50 ms until it holds; panics after `timeout`, naming `what`.
pub fn wait_for(timeout: Duration, what: &str, mut ready: impl FnMut() -> bool) {
    let until = Instant::now() + timeout;
    while !ready() {
        assert!(Instant::now() < until, "{what}: not reached within {timeout:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
