//! The elastic TFJob, `deploy/kubeflow/tfjob-digits-elastic.yaml`, without Kubernetes: the
//! manifest is parsed (PyYAML, as `kubectl` would read it: every argument must be a string), its
//! objects are checked against each other (the Service reaches the coordinator's port, the
//! coordinator expects the TFJob's workers, both ends agree on the minimum), and its containers'
//! own commands, arguments and environment run as local processes the way the operator and the
//! kubelet would run them: the coordinator pod, then each worker with the `TF_CONFIG` the
//! training-operator writes (its service names replaced by 127.0.0.1 and free ports, and the
//! coordinator's Service by the local coordinator's address). Worker 0 is killed (SIGKILL)
//! mid-job and started again with the same command and environment, as the kubelet restarts a
//! container under `restartPolicy: OnFailure`; the job must end as an undisturbed one does.
//!
//! Skipped with a message without `python3` or PyYAML (Debian's `python3-yaml`);
//! `STRATA_REQUIRE_CLUSTER=1` (CI) makes that a failure. Every wait has a hard deadline.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use strata_integration_tests::cluster::{or_skip, Skip};
use strata_integration_tests::{free_ports, strata_bin, TOKEN};

/// The longest any process of the job may take.
const TIMEOUT: Duration = Duration::from_secs(120);

/// The manifest's 30 epochs of the digits MLP take about a second here: too short to kill a
/// worker in the middle of. The test runs the same job for longer (`--epochs`, about 10 s on 2
/// shared cores), and kills worker 0 once it has logged `KILL_AT` epochs.
const EPOCHS: &str = "400";
const KILL_AT: usize = 80;

fn manifest(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubeflow").join(name)
}

/// Every YAML document of `path`, as JSON (PyYAML's safe loader), or why it cannot be read here.
fn load(path: &Path) -> Result<Vec<Value>, Skip> {
    let probe = Command::new("python3").args(["-c", "import yaml"]).stderr(Stdio::null()).status();
    match probe {
        Err(e) => return Err(Skip(format!("python3 does not run ({e}); the manifest is read with PyYAML"))),
        Ok(s) if !s.success() => {
            return Err(Skip("PyYAML is missing (Debian: apt-get install python3-yaml); it reads the manifest".into()))
        }
        Ok(_) => {}
    }
    let out = Command::new("python3")
        .args(["-c", "import json, sys, yaml; json.dump(list(yaml.safe_load_all(sys.stdin)), sys.stdout)"])
        .stdin(File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .output()
        .expect("python3 runs");
    assert!(out.status.success(), "{} is not valid YAML: {}", path.display(), String::from_utf8_lossy(&out.stderr));
    let docs: Vec<Value> = serde_json::from_slice(&out.stdout).expect("PyYAML's JSON");
    Ok(docs.into_iter().filter(|d| !d.is_null()).collect())
}

/// The one object of `kind` in the manifest.
fn object<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let found: Vec<&Value> = docs.iter().filter(|d| d["kind"] == kind).collect();
    assert_eq!(found.len(), 1, "one {kind} in the manifest");
    found[0]
}

fn string(v: &Value, what: &str) -> String {
    // Kubernetes refuses a number or a boolean where it takes a string (an argument, an env value).
    v.as_str().unwrap_or_else(|| panic!("{what} must be a string (quote it in the YAML), not {v}")).to_string()
}

fn strings(v: &Value, what: &str) -> Vec<String> {
    v.as_array().unwrap_or_else(|| panic!("{what} is a list")).iter().map(|s| string(s, what)).collect()
}

/// What a container runs.
#[derive(Clone, Debug)]
struct Container {
    command: Vec<String>,
    args: Vec<String>,
    env: BTreeMap<String, String>,
    ports: BTreeMap<String, u64>,
    image: String,
}

impl Container {
    /// The container `name` of a pod spec, its Secret references resolved (`strata-cluster-token`
    /// holds the test token).
    fn of(pod_spec: &Value, name: &str) -> Container {
        let c = pod_spec["containers"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["name"] == name))
            .unwrap_or_else(|| panic!("no container named {name}"));
        let mut env = BTreeMap::new();
        for e in c["env"].as_array().into_iter().flatten() {
            let key = string(&e["name"], "an env name");
            let value = if let Some(secret) = e["valueFrom"].get("secretKeyRef") {
                assert_eq!(
                    (secret["name"].as_str(), secret["key"].as_str()),
                    (Some("strata-cluster-token"), Some("token")),
                    "{key}: the token Secret, as tfjob-digits.yaml's"
                );
                TOKEN.to_string()
            } else {
                string(&e["value"], &format!("env {key}"))
            };
            env.insert(key, value);
        }
        let ports = c["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| (string(&p["name"], "a port name"), p["containerPort"].as_u64().expect("a port number")))
            .collect();
        Container {
            command: strings(&c["command"], "command"),
            args: strings(&c["args"], "args"),
            env,
            ports,
            image: string(&c["image"], "image"),
        }
    }

    /// The value after `flag` in the arguments.
    fn flag(&self, flag: &str) -> &str {
        let i = self.args.iter().position(|a| a == flag).unwrap_or_else(|| panic!("{flag} in {:?}", self.args));
        self.args.get(i + 1).unwrap_or_else(|| panic!("a value after {flag}"))
    }

    /// The same container with `flag`'s value replaced.
    fn with_flag(&self, flag: &str, value: &str) -> Container {
        let mut c = self.clone();
        let i = c.args.iter().position(|a| a == flag).unwrap_or_else(|| panic!("{flag} in {:?}", c.args));
        c.args[i + 1] = value.to_string();
        c
    }

    /// The process the kubelet would start: `strata` is the binary under test, and the
    /// environment is the container's only (plus `extra`).
    fn command(&self, extra: &[(&str, String)]) -> Command {
        assert_eq!(self.command, ["strata"], "the image's strata binary");
        let mut cmd = Command::new(strata_bin());
        cmd.args(&self.args).env_clear().envs(&self.env);
        for (k, v) in extra {
            cmd.env(k, v);
        }
        cmd
    }
}

/// The manifest's pieces.
struct Manifest {
    coordinator: Container,
    worker: Container,
    workers: usize,
}

/// The TFJob's worker container and its number of replicas.
fn tfjob_workers(docs: &[Value]) -> (Container, usize) {
    let spec = &object(docs, "TFJob")["spec"]["tfReplicaSpecs"]["Worker"];
    let replicas = spec["replicas"].as_u64().expect("Worker replicas") as usize;
    (Container::of(&spec["template"]["spec"], "tensorflow"), replicas)
}

fn parse(docs: &[Value]) -> Manifest {
    let (worker, workers) = tfjob_workers(docs);
    Manifest { coordinator: Container::of(&object(docs, "Pod")["spec"], "coordinator"), worker, workers }
}

/// Whether `selector` (matchLabels) selects a pod labelled `labels`.
fn selects(selector: &Value, labels: &Value) -> bool {
    let selector = selector.as_object().expect("a selector");
    !selector.is_empty() && selector.iter().all(|(k, v)| labels[k] == *v)
}

/// The objects fit together as Kubernetes and the operator would use them.
#[test]
fn manifest_fits_together() {
    let Some(docs) = or_skip(load(&manifest("tfjob-digits-elastic.yaml"))) else { return };
    let m = parse(&docs);
    let pod = object(&docs, "Pod");
    let service = object(&docs, "Service");
    let tfjob = object(&docs, "TFJob");
    let budgets: Vec<&Value> = docs.iter().filter(|d| d["kind"] == "PodDisruptionBudget").collect();
    assert_eq!(budgets.len(), 2, "a budget for the coordinator, one for the workers");
    assert_eq!(tfjob["apiVersion"], "kubeflow.org/v1");
    let replicas = tfjob["spec"]["tfReplicaSpecs"].as_object().expect("replica specs");
    assert_eq!(replicas.keys().collect::<Vec<_>>(), ["Worker"], "workers only: worker 0 is the chief");
    let workers = &replicas["Worker"];
    assert_eq!(m.workers, 3);
    assert_eq!(workers["restartPolicy"], "OnFailure", "a killed worker's container restarts and joins");
    assert_eq!(pod["spec"]["restartPolicy"], "Never", "a coordinator started again would know nothing of the job");
    assert!(tfjob["spec"]["runPolicy"]["backoffLimit"].as_u64() > Some(0));

    // The coordinator expects the TFJob's workers, with the workers' minimum.
    assert_eq!(m.coordinator.args[0], "coordinator");
    assert_eq!(m.coordinator.flag("--workers"), m.workers.to_string());
    assert!(!m.coordinator.args.contains(&"--chief".to_string()), "the TFJob has no Chief replica");
    assert_eq!(m.worker.args[0], "train");
    assert_eq!(m.worker.flag("--strategy"), "multi-worker-mirrored");
    assert_eq!(m.worker.flag("--cluster"), "tf-config");
    assert_eq!(m.coordinator.flag("--min-workers"), m.worker.flag("--min-workers"));
    assert_eq!(m.coordinator.flag("--bind"), "0.0.0.0");
    assert_eq!(m.worker.flag("--bind"), "0.0.0.0");

    // The workers reach the coordinator through the Service: its name, its port, and a
    // target that is the coordinator's listening port.
    let address = &m.worker.env["STRATA_COORDINATOR"];
    let (host, port) = address.rsplit_once(':').expect("STRATA_COORDINATOR is host:port");
    let name = service["metadata"]["name"].as_str().expect("the Service's name");
    assert!(host == name || host.starts_with(&format!("{name}.")), "{address} names the Service {name}");
    let service_port = service["spec"]["ports"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["port"].as_u64().map(|p| p.to_string()).as_deref() == Some(port)))
        .unwrap_or_else(|| panic!("the Service {name} has port {port}"));
    let target = match &service_port["targetPort"] {
        Value::String(named) => m.coordinator.ports[named.as_str()],
        Value::Number(n) => n.as_u64().expect("a port"),
        _ => port.parse().expect("a port"),
    };
    assert_eq!(m.coordinator.flag("--port"), target.to_string(), "the coordinator listens where the Service sends");
    assert!(selects(&service["spec"]["selector"], &pod["metadata"]["labels"]), "the Service selects the coordinator");
    let worker_labels = &workers["template"]["metadata"]["labels"];
    assert!(!selects(&service["spec"]["selector"], worker_labels), "the Service selects no worker");

    // The operator's conventions, as for tfjob-digits.yaml.
    assert_eq!(m.worker.ports.get("tfjob-port"), Some(&2222));
    assert!(!m.worker.env.contains_key("TF_CONFIG"), "the operator writes TF_CONFIG");
    let (plain, _) = tfjob_workers(&load(&manifest("tfjob-digits.yaml")).expect("read like the elastic one"));
    assert_eq!(m.worker.image, plain.image, "the same image as tfjob-digits.yaml");
    assert_eq!(m.coordinator.image, plain.image, "the coordinator runs the same image");

    // Drains keep off the coordinator, and take the workers one at a time (each leaves alone).
    let selecting = |labels: &Value| -> Vec<&Value> {
        budgets.iter().copied().filter(|b| selects(&b["spec"]["selector"]["matchLabels"], labels)).collect()
    };
    let (for_pod, for_workers) = (selecting(&pod["metadata"]["labels"]), selecting(worker_labels));
    assert!(for_pod.len() == 1 && for_workers.len() == 1, "one budget each");
    assert_eq!(for_pod[0]["spec"]["minAvailable"].as_u64(), Some(1), "the coordinator stays");
    assert_eq!(for_workers[0]["spec"]["maxUnavailable"].as_u64(), Some(1), "workers one at a time");
}

/// A process of the job, its output (stdout and stderr, as `kubectl logs` shows them) in a file.
struct Proc {
    name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl Proc {
    fn spawn(name: &str, mut cmd: Command, dir: &Path) -> Proc {
        let log = dir.join(format!("{name}.log"));
        let out = File::create(&log).expect("a log file");
        let err = out.try_clone().expect("the log file twice");
        let child = cmd.stdin(Stdio::null()).stdout(out).stderr(err).spawn().expect("strata runs");
        Proc { name: name.to_string(), child: Some(child), log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits for the process until `deadline` (killing it, and failing, past it).
    fn wait(&mut self, deadline: Instant) -> ExitStatus {
        let child = self.child.as_mut().expect("a running process");
        loop {
            if let Some(status) = child.try_wait().expect("the process can be waited for") {
                self.child = None;
                return status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                self.child = None;
                panic!("{} did not finish in time; its log:\n{}", self.name, self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL, as the OOM killer or a lost node ends a container.
    fn kill(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("a running process");
        child.kill().expect("SIGKILL");
        child.wait().expect("the killed process")
    }
}

impl Drop for Proc {
    /// Nothing outlives the test, a failing one included.
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The digest a worker printed at the end (`worker N: parameter digest D`).
fn digest(log: &str) -> Option<String> {
    log.lines().find_map(|l| l.split_once(": parameter digest ").map(|(_, d)| d.trim().to_string()))
}

/// The manifest's job, run as the operator runs it; worker 0's container is killed mid-job and
/// started again; the restarted process joins, and every worker ends with the same parameters.
#[test]
fn killed_worker_pod_restarts_and_rejoins() {
    let Some(docs) = or_skip(load(&manifest("tfjob-digits-elastic.yaml"))) else { return };
    let m = parse(&docs);
    // The binary first: building it must not count against the job's time.
    strata_bin();
    let dir = tempfile::Builder::new().prefix("strata-kubeflow-").tempdir().expect("a directory");
    let ports = free_ports(m.workers + 1);
    let coordinator_address = format!("127.0.0.1:{}", ports[0]);
    // The TF_CONFIG of worker i, as the operator writes it, with every
    // `<job>-worker-<i>.<namespace>.svc:2222` replaced by a loopback address.
    let workers: Vec<String> = ports[1..].iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let tf_config = |i: usize| {
        serde_json::json!({
            "cluster": { "worker": workers },
            "task": { "type": "worker", "index": i },
            "environment": "cloud",
        })
        .to_string()
    };
    let worker = m.worker.with_flag("--epochs", EPOCHS);
    let start_worker = |i: usize, name: &str| {
        let cmd = worker.command(&[("TF_CONFIG", tf_config(i)), ("STRATA_COORDINATOR", coordinator_address.clone())]);
        Proc::spawn(name, cmd, dir.path())
    };

    let started = Instant::now();
    let coordinator = m.coordinator.with_flag("--port", &ports[0].to_string());
    let mut coordinator = Proc::spawn("coordinator", coordinator.command(&[]), dir.path());
    let mut pods: Vec<Proc> = (0..m.workers).map(|i| start_worker(i, &format!("worker-{i}"))).collect();

    // Worker 0, once it trains: killed, and its container started again at once (the kubelet's
    // first restart of a container has no back-off).
    let deadline = Instant::now() + TIMEOUT;
    while pods[0].log().matches("epoch done").count() < KILL_AT {
        assert!(Instant::now() < deadline, "worker 0 never reached epoch {KILL_AT}; its log:\n{}", pods[0].log());
        assert!(pods[0].child.as_mut().is_some_and(|c| c.try_wait().ok().flatten().is_none()), "{}", pods[0].log());
        std::thread::sleep(Duration::from_millis(10));
    }
    let killed = pods[0].kill();
    let killed_at = started.elapsed();
    assert_eq!(killed.signal(), Some(9), "SIGKILL ended the first worker 0");
    let first = std::mem::replace(&mut pods[0], start_worker(0, "worker-0-restarted"));

    let deadline = Instant::now() + TIMEOUT;
    let ended: Vec<ExitStatus> = pods.iter_mut().map(|p| p.wait(deadline)).collect();
    let coordinator_end = coordinator.wait(deadline);
    let wall = started.elapsed();
    let logs: Vec<String> = pods.iter().map(Proc::log).collect();
    let all = || {
        let mut s = format!("coordinator ({coordinator_end}):\n{}\n", coordinator.log());
        for (p, (log, end)) in pods.iter().zip(logs.iter().zip(&ended)) {
            s += &format!("{} ({end}):\n{log}\n", p.name);
        }
        s
    };
    eprintln!(
        "elastic TFJob, 3 workers x {EPOCHS} epochs: worker 0 SIGKILLed at {:.1} s (epoch {KILL_AT}) and restarted; \
         the job ended in {:.1} s",
        killed_at.as_secs_f64(),
        wall.as_secs_f64()
    );

    // The first worker 0 was killed in the middle of the job.
    assert!(digest(&first.log()).is_none(), "the first worker 0 had not finished:\n{}", first.log());
    // The coordinator's outcome is the job's: completed, with the restarted worker 0 back in.
    assert!(coordinator_end.success(), "{}", all());
    let completed = coordinator
        .log()
        .lines()
        .find_map(|l| l.strip_prefix("strata coordinator: the job completed in generation ").map(str::to_string))
        .unwrap_or_else(|| panic!("no completion line:\n{}", all()));
    let (generation, members) = completed.split_once(" with ").expect("generation G with members");
    assert!(generation.parse::<u64>().expect("a generation") >= 2, "the restart formed a new generation:\n{}", all());
    assert_eq!(members, "worker:0, worker:1, worker:2", "every worker finished, the restarted one too:\n{}", all());
    // Every worker exited 0 (restartPolicy OnFailure restarts none of them) with the same
    // parameters.
    assert!(ended.iter().all(ExitStatus::success), "{}", all());
    let digests: Vec<Option<String>> = logs.iter().map(|l| digest(l)).collect();
    assert!(digests[0].is_some() && digests.windows(2).all(|w| w[0] == w[1]), "digests {digests:?}:\n{}", all());
    let accuracy: f64 = logs
        .iter()
        .find_map(|l| l.lines().find_map(|l| l.split("test accuracy ").nth(1)))
        .and_then(|a| a.split('%').next())
        .and_then(|a| a.trim().parse().ok())
        .unwrap_or_else(|| panic!("no accuracy line:\n{}", all()));
    assert!(accuracy > 90.0, "{}", all());
}
