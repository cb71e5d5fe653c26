//! Cluster resolution: TF_CONFIG as TensorFlow and the Kubeflow TFJob operator write it, the
//! variables of Slurm allocations, node-list expansion, explicit specs, and one-line errors that
//! name the field.

use std::collections::HashMap;

use strata_core::Error;
use strata_strategies::cluster::{
    expand_nodelist, split_host_port, ClusterConfig, ClusterResolver, ClusterSpec, SimpleClusterResolver,
    SlurmClusterResolver, SlurmJobs, SlurmLayout, TFConfigClusterResolver, TaskId, TaskType,
};

/// Resolves a TF_CONFIG JSON.
fn tf(json: &str) -> Result<ClusterConfig, Error> {
    TFConfigClusterResolver::from_json(json).resolve()
}

/// The one-line message of an error that must be an invalid cluster configuration.
fn message(result: Result<impl std::fmt::Debug, Error>) -> String {
    match result {
        Ok(v) => panic!("expected an invalid cluster configuration, got {v:?}"),
        Err(e @ Error::InvalidCluster(_)) => {
            let m = e.to_string();
            assert!(!m.contains('\n'), "message is not one line: {m}");
            assert!(m.starts_with("invalid cluster configuration: "), "{m}");
            m
        }
        Err(e) => panic!("expected Error::InvalidCluster, got {e:?}"),
    }
}

/// Asserts that resolving `json` fails with a message containing every one of `parts`.
fn tf_err(json: &str, parts: &[&str]) {
    let m = message(tf(json));
    for part in parts {
        assert!(m.contains(part), "message for {json} lacks {part:?}: {m}");
    }
}

fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn strings(s: &[&str]) -> Vec<String> {
    s.iter().map(|s| s.to_string()).collect()
}

// ---------------------------------------------------------------- TF_CONFIG, valid

#[test]
fn tf_config_with_chief_worker_ps() {
    let json = r#"{"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"], "ps": ["host3:2222"]},
                   "task": {"type": "worker", "index": 1}, "rpc_layer": "grpc"}"#;
    let c = tf(json).unwrap();
    assert_eq!(c.task, TaskId::worker(1));
    assert_eq!(c.rpc_layer.as_deref(), Some("grpc"));
    assert_eq!(c.environment, None);
    assert_eq!(c.address().unwrap(), "host2:2222");
    assert_eq!(c.port().unwrap(), 2222);
    assert_eq!(c.rank(), Some(2));
    assert!(!c.is_chief());
    assert_eq!(c.num_sync_workers(), 3);
    assert_eq!(c.spec.sync_workers(), vec![TaskId::chief(), TaskId::worker(0), TaskId::worker(1)]);
    assert_eq!(c.spec.chief(), Some(TaskId::chief()));
    assert_eq!(c.spec.num_tasks(TaskType::Ps), 1);
    assert_eq!(c.spec.num_tasks(TaskType::Evaluator), 0);
    assert_eq!(c.spec.total_tasks(), 4);
    c.spec.require_ps().unwrap();
    c.spec.require_workers().unwrap();

    let chief = tf(&json.replace(r#""type": "worker", "index": 1"#, r#""type": "chief", "index": 0"#)).unwrap();
    assert!(chief.is_chief());
    assert_eq!(chief.rank(), Some(0));
    let ps = tf(&json.replace(r#""type": "worker", "index": 1"#, r#""type": "ps", "index": 0"#)).unwrap();
    assert_eq!(ps.rank(), None);
    assert!(!ps.is_chief());
    assert_eq!(ps.address().unwrap(), "host3:2222");
}

#[test]
fn tf_config_without_chief_worker_zero_is_chief() {
    let json = r#"{"cluster": {"worker": ["a:1000", "b:1000", "c:1000"]}, "task": {"type": "worker", "index": 0}}"#;
    let c = tf(json).unwrap();
    assert!(c.is_chief());
    assert_eq!(c.rank(), Some(0));
    assert_eq!(c.spec.chief(), Some(TaskId::worker(0)));
    assert_eq!(c.spec.sync_workers(), vec![TaskId::worker(0), TaskId::worker(1), TaskId::worker(2)]);
    let w2 = tf(&json.replace(r#""index": 0"#, r#""index": 2"#)).unwrap();
    assert!(!w2.is_chief());
    assert_eq!(w2.rank(), Some(2));
    assert_eq!(
        message(w2.spec.require_ps()),
        "invalid cluster configuration: cluster spec: the cluster has no ps tasks; ParameterServerStrategy needs at \
         least one (add a \"ps\" job; jobs now: \"worker\")"
    );
}

#[test]
fn tf_config_with_ps_and_evaluator() {
    let json = r#"{"cluster": {"chief": ["c:2222"], "worker": ["w:2222"], "ps": ["p0:2222", "p1:2222"],
                   "evaluator": ["e:2222"]}, "task": {"type": "evaluator", "index": 0}, "environment": "cloud"}"#;
    let c = tf(json).unwrap();
    assert_eq!(c.task, TaskId::evaluator());
    assert_eq!(c.rank(), None);
    assert!(!c.is_chief());
    assert_eq!(c.environment.as_deref(), Some("cloud"));
    assert_eq!(c.address().unwrap(), "e:2222");
    // The evaluator is not a synchronous worker.
    assert_eq!(c.spec.sync_workers(), vec![TaskId::chief(), TaskId::worker(0)]);
    assert_eq!(c.spec.rank_of(TaskId::ps(1)), None);
    let ps1 = tf(&json.replace(r#""type": "evaluator", "index": 0"#, r#""type": "ps", "index": 1"#)).unwrap();
    assert_eq!(ps1.address().unwrap(), "p1:2222");

    // TensorFlow lets the evaluator run outside the cluster it evaluates.
    let outside = tf(r#"{"cluster": {"worker": ["w:2222"]}, "task": {"type": "evaluator", "index": 0}}"#).unwrap();
    assert_eq!(outside.task, TaskId::evaluator());
    assert_eq!(outside.rank(), None);
    assert!(outside.address().is_err());
}

/// The TF_CONFIG the Kubeflow TFJob operator writes for worker 1 of a 2-worker job.
#[test]
fn tf_config_of_kubeflow_tfjob_operator() {
    let json = r#"{"cluster":{"worker":["digits-worker-0.default.svc:2222","digits-worker-1.default.svc:2222"]},"task":{"type":"worker","index":1},"environment":"cloud"}"#;
    let c = tf(json).unwrap();
    assert_eq!(c.task, TaskId::worker(1));
    assert_eq!(c.environment.as_deref(), Some("cloud"));
    assert_eq!(c.rpc_layer, None);
    assert_eq!(c.address().unwrap(), "digits-worker-1.default.svc:2222");
    assert_eq!(c.port().unwrap(), 2222);
    assert_eq!(c.rank(), Some(1));
    assert!(!c.is_chief());
    assert_eq!(c.spec.chief(), Some(TaskId::worker(0)));
    // What the operator wrote is what we write back.
    assert_eq!(c.to_tf_config(), json);

    // The operator's TF_CONFIG for a job with a PS replica, seen from the PS.
    let ps = tf(r#"{"cluster":{"ps":["dist-mnist-ps-0.kubeflow.svc:2222"],"worker":["dist-mnist-worker-0.kubeflow.svc:2222","dist-mnist-worker-1.kubeflow.svc:2222"]},"task":{"type":"ps","index":0},"environment":"cloud"}"#).unwrap();
    assert_eq!(ps.task, TaskId::ps(0));
    assert_eq!(ps.spec.num_tasks(TaskType::Worker), 2);
    assert_eq!(ps.spec.chief(), Some(TaskId::worker(0)));
}

#[test]
fn tf_config_ignores_unknown_keys_and_accepts_pretty_json_and_ipv6() {
    let json = r#"{
  "cluster": {
    "worker": ["[::1]:2222", "[fe80::1]:2223", "127.0.0.1:2224"]
  },
  "task": {"type": "worker", "index": 0, "trial": "7"},
  "job": {"whatever": true},
  "rpc_layer": null
}"#;
    let c = tf(json).unwrap();
    assert_eq!(c.address().unwrap(), "[::1]:2222");
    assert_eq!(c.port().unwrap(), 2222);
    assert_eq!(c.rpc_layer, None);
    assert_eq!(split_host_port("[fe80::1]:2223").unwrap(), ("[fe80::1]", 2223));
    assert_eq!(split_host_port("worker-0.svc:65535").unwrap(), ("worker-0.svc", 65535));
}

// ---------------------------------------------------------------- TF_CONFIG, malformed

#[test]
fn tf_config_index_out_of_range_message() {
    let m = message(tf(r#"{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 3}}"#));
    assert_eq!(
        m,
        "invalid cluster configuration: TF_CONFIG: task.index 3 is out of range: the cluster has 2 worker tasks \
         (indices 0..=1)"
    );
    let m = message(tf(r#"{"cluster": {"chief": ["a:1"], "worker": ["b:1"]}, "task": {"type": "chief", "index": 1}}"#));
    assert!(m.ends_with("TF_CONFIG: task.index 1 is out of range: the cluster has 1 chief task (index 0)"), "{m}");
}

#[test]
fn tf_config_not_json_says_where() {
    tf_err(r#"{"cluster": {"worker": ["a:1"]}, "task": "#, &["TF_CONFIG is not valid JSON", "line 1 column"]);
    tf_err(
        "{\n  \"cluster\": {\"worker\": [\"a:1\"]},\n  \"task\": {\"type\": \"worker\" \"index\": 0}\n}",
        &["TF_CONFIG is not valid JSON", "line 3 column"],
    );
    tf_err("", &["TF_CONFIG is empty"]);
    tf_err("  ", &["TF_CONFIG is empty"]);
    tf_err(r#"["a:1"]"#, &["TF_CONFIG: expected a JSON object", "got an array"]);
}

#[test]
fn tf_config_missing_fields() {
    tf_err(r#"{"task": {"type": "worker", "index": 0}}"#, &["TF_CONFIG: missing \"cluster\"", "add \"cluster\""]);
    tf_err(r#"{"cluster": {"worker": ["a:1"]}}"#, &["TF_CONFIG: missing \"task\"", "add \"task\""]);
    tf_err(r#"{"cluster": {"worker": ["a:1"]}, "task": {"index": 0}}"#, &["TF_CONFIG: missing task.type"]);
    tf_err(r#"{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}}"#, &["TF_CONFIG: missing task.index"]);
    tf_err(r#"{"cluster": {"worker": ["a:1"]}, "task": "worker:0"}"#, &["TF_CONFIG: \"task\" must be an object"]);
    tf_err(
        r#"{"cluster": ["a:1"], "task": {"type": "worker", "index": 0}}"#,
        &["TF_CONFIG: cluster must be an object"],
    );
}

#[test]
fn tf_config_bad_task_type_and_index() {
    let base = |task: &str| format!(r#"{{"cluster": {{"worker": ["a:1", "b:1"]}}, "task": {task}}}"#);
    tf_err(
        &base(r#"{"type": "ps", "index": 0}"#),
        &["TF_CONFIG: task.type \"ps\" is not a job of the cluster", "add a \"ps\" job"],
    );
    tf_err(&base(r#"{"type": "chief", "index": 0}"#), &["task.type \"chief\" is not a job of the cluster"]);
    tf_err(&base(r#"{"type": "boss", "index": 0}"#), &["TF_CONFIG: task.type \"boss\" is not a job name"]);
    tf_err(&base(r#"{"type": 3, "index": 0}"#), &["TF_CONFIG: task.type must be a job name", "a number (3)"]);
    tf_err(&base(r#"{"type": "worker", "index": -1}"#), &["TF_CONFIG: task.index -1 is negative"]);
    tf_err(&base(r#"{"type": "worker", "index": 1.5}"#), &["TF_CONFIG: task.index 1.5 is not an integer"]);
    tf_err(&base(r#"{"type": "worker", "index": "1"}"#), &["TF_CONFIG: task.index \"1\" is a string", "\"index\": 1"]);
    tf_err(&base(r#"{"type": "worker", "index": true}"#), &["TF_CONFIG: task.index must be a non-negative integer"]);
    tf_err(&base(r#"{"type": "evaluator", "index": 1}"#), &["TF_CONFIG: task.index 1 is out of range"]);
}

#[test]
fn tf_config_bad_cluster() {
    tf_err(
        r#"{"cluster": {"chief": ["a:1", "b:1"], "worker": ["c:1"]}, "task": {"type": "worker", "index": 0}}"#,
        &["TF_CONFIG: cluster.chief has 2 tasks; a cluster has at most one chief"],
    );
    tf_err(
        r#"{"cluster": {"evaluator": ["a:1", "b:1"], "worker": ["c:1"]}, "task": {"type": "worker", "index": 0}}"#,
        &["TF_CONFIG: cluster.evaluator has 2 tasks"],
    );
    tf_err(
        r#"{"cluster": {"worker": [], "chief": ["c:1"]}, "task": {"type": "chief", "index": 0}}"#,
        &["TF_CONFIG: cluster.worker is empty"],
    );
    tf_err(
        r#"{"cluster": {"worker": ["a:1"], "ps": ["a:1"]}, "task": {"type": "worker", "index": 0}}"#,
        &["TF_CONFIG: cluster.ps[0] \"a:1\" is also the address of cluster.worker[0]", "use another port"],
    );
    tf_err(
        r#"{"cluster": {"master": ["a:1"]}, "task": {"type": "master", "index": 0}}"#,
        &["TF_CONFIG: cluster: \"master\" is not a supported job name", "\"chief\""],
    );
    tf_err(
        r#"{"cluster": {"worker": {"0": "a:1"}}, "task": {"type": "worker", "index": 0}}"#,
        &["TF_CONFIG: cluster.worker is an object"],
    );
    tf_err(
        r#"{"cluster": {"worker": ["a:1", 2222]}, "task": {"type": "worker", "index": 0}}"#,
        &["TF_CONFIG: cluster.worker[1] must be a \"host:port\" string"],
    );
    tf_err(
        r#"{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}, "rpc_layer": 5}"#,
        &["TF_CONFIG: rpc_layer must be a string"],
    );
}

#[test]
fn tf_config_bad_addresses() {
    let cases = [
        ("host", "has no port"),
        ("host:", "has an empty port"),
        (":2222", "has an empty host"),
        ("host:0", "has port 0 out of range"),
        ("host:65536", "has port 65536 out of range"),
        ("host:99999999999999999999", "out of range"),
        ("host:abc", "has port \"abc\", which is not a number"),
        ("host:-1", "which is not a number"),
        ("::1:2222", "looks like an IPv6 address without brackets"),
        ("[::1:2222", "has an unclosed '['"),
        ("[::1]2222", "has no \":port\" after its IPv6 host"),
        ("[zz]:2222", "not an IPv6 address"),
        ("bad host:22", "which is not a host name"),
        ("-a:1", "which is not a host name"),
        ("a..b:1", "which is not a host name"),
        ("256.1.1.1:80", "which is not an IPv4 address"),
        ("", "is empty"),
    ];
    for (address, why) in cases {
        let json = format!(
            r#"{{"cluster": {{"worker": ["ok:2222", {}]}}, "task": {{"type": "worker", "index": 0}}}}"#,
            serde_json::to_string(address).unwrap()
        );
        tf_err(&json, &[&format!("TF_CONFIG: cluster.worker[1] {address:?} "), why]);
    }
}

// ---------------------------------------------------------------- ClusterSpec and TaskId

#[test]
fn task_type_and_task_id_forms() {
    for kind in TaskType::ALL {
        assert_eq!(kind.to_string().parse::<TaskType>().unwrap(), kind);
    }
    assert_eq!(TaskType::Ps.to_string(), "ps");
    assert!(message("master".parse::<TaskType>()).contains("\"master\" is \"chief\" now"));
    let t = TaskId::worker(1);
    assert_eq!(t.to_string(), "worker:1");
    assert_eq!(t.device_prefix(), "/job:worker/replica:0/task:1");
    assert_eq!(TaskId::chief().device_prefix(), "/job:chief/replica:0/task:0");
    assert_eq!("ps:3".parse::<TaskId>().unwrap(), TaskId::ps(3));
    assert!(message("worker".parse::<TaskId>()).contains("write it as worker:1"));
    assert!(message("worker:-1".parse::<TaskId>()).contains("not a non-negative integer"));
    assert_eq!(serde_json::to_string(&t).unwrap(), r#"{"type":"worker","index":1}"#);
}

#[test]
fn cluster_spec_accessors_and_fingerprint() {
    let spec = ClusterSpec::new([
        (TaskType::Worker, vec!["w0:1", "w1:1"]),
        (TaskType::Ps, vec!["p:1"]),
        (TaskType::Chief, vec!["c:1"]),
    ])
    .unwrap();
    let tasks: Vec<(TaskId, &str)> = spec.tasks().collect();
    assert_eq!(
        tasks,
        vec![
            (TaskId::chief(), "c:1"),
            (TaskId::worker(0), "w0:1"),
            (TaskId::worker(1), "w1:1"),
            (TaskId::ps(0), "p:1"),
        ]
    );
    let jobs: Vec<TaskType> = spec.jobs().map(|(k, _)| k).collect();
    assert_eq!(jobs, vec![TaskType::Chief, TaskType::Worker, TaskType::Ps]);
    assert_eq!(spec.rank_of(TaskId::worker(1)), Some(2));
    assert_eq!(spec.rank_of(TaskId::worker(2)), None);
    assert_eq!(spec.rank_of(TaskId::ps(0)), None);
    assert_eq!(spec.fingerprint(), "chief=c:1;ps=p:1;worker=w0:1,w1:1");

    // The same cluster given in another order has the same fingerprint; another cluster not.
    let same = ClusterSpec::new([
        (TaskType::Chief, vec!["c:1"]),
        (TaskType::Ps, vec!["p:1"]),
        (TaskType::Worker, vec!["w0:1", "w1:1"]),
    ])
    .unwrap();
    assert_eq!(same.fingerprint(), spec.fingerprint());
    assert_eq!(same, spec);
    let swapped = ClusterSpec::new([
        (TaskType::Chief, vec!["c:1"]),
        (TaskType::Ps, vec!["p:1"]),
        (TaskType::Worker, vec!["w1:1", "w0:1"]),
    ])
    .unwrap();
    assert_ne!(swapped.fingerprint(), spec.fingerprint());

    assert_eq!(
        message(spec.address(TaskId::worker(5))),
        "invalid cluster configuration: cluster spec: task worker:5 is not in the cluster: the cluster has 2 worker \
         tasks (indices 0..=1)"
    );
    assert!(message(spec.address(TaskId::evaluator())).contains("it has no \"evaluator\" job"));
}

#[test]
fn cluster_spec_validation() {
    assert!(message(ClusterSpec::new([(TaskType::Worker, vec!["a:1"]), (TaskType::Worker, vec!["b:1"])]))
        .contains("cluster spec: job \"worker\" is given twice"));
    assert!(message(ClusterSpec::workers(["a:1", "b"])).contains("cluster spec: worker[1] \"b\" has no port"));
    assert!(message(ClusterSpec::new([(TaskType::Chief, vec!["a:1", "b:2"])])).contains("chief has 2 tasks"));
    assert!(message(ClusterSpec::new([(TaskType::Ps, Vec::<String>::new())])).contains("cluster spec: ps is empty"));
    let ps_only = ClusterSpec::new([(TaskType::Ps, vec!["p:1"])]).unwrap();
    assert_eq!(ps_only.chief(), None);
    assert!(message(ps_only.require_workers()).contains("the cluster has no chief or worker tasks"));
}

#[test]
fn cluster_spec_serde_is_tf_cluster_dict() {
    let spec = ClusterSpec::new([(TaskType::Ps, vec!["p:1"]), (TaskType::Worker, vec!["w0:1", "w1:1"])]).unwrap();
    let json = serde_json::to_string(&spec).unwrap();
    assert_eq!(json, r#"{"worker":["w0:1","w1:1"],"ps":["p:1"]}"#);
    assert_eq!(spec.to_string(), json);
    let back: ClusterSpec = serde_json::from_str(&json).unwrap();
    assert_eq!(back, spec);
    let bad = serde_json::from_str::<ClusterSpec>(r#"{"worker":["w0:1","w0:1"]}"#).unwrap_err().to_string();
    assert!(bad.contains("cluster.worker[1] \"w0:1\" is also the address of cluster.worker[0]"), "{bad}");
}

// ---------------------------------------------------------------- ClusterConfig

#[test]
fn config_round_trips_through_tf_config() {
    let spec = ClusterSpec::new([
        (TaskType::Chief, vec!["c:2222"]),
        (TaskType::Worker, vec!["w0:2222", "w1:2222"]),
        (TaskType::Ps, vec!["p:2222"]),
        (TaskType::Evaluator, vec!["e:2222"]),
    ])
    .unwrap();
    let base = ClusterConfig::new(spec.clone(), TaskId::chief()).unwrap().with_rpc_layer("grpc");
    let mut n = 0;
    for (task, _) in spec.tasks() {
        let config = base.for_task(task).unwrap();
        let json = config.to_tf_config();
        let back = TFConfigClusterResolver::from_json(json.clone()).resolve().unwrap();
        assert_eq!(back, config, "{json}");
        assert_eq!(ClusterConfig::from_tf_config(&json).unwrap(), config);
        assert_eq!(serde_json::from_str::<ClusterConfig>(&json).unwrap(), config);
        n += 1;
    }
    assert_eq!(n, 5);
    assert_eq!(
        base.for_task(TaskId::worker(1)).unwrap().with_environment("cloud").to_tf_config(),
        r#"{"cluster":{"chief":["c:2222"],"worker":["w0:2222","w1:2222"],"ps":["p:2222"],"evaluator":["e:2222"]},"task":{"type":"worker","index":1},"rpc_layer":"grpc","environment":"cloud"}"#
    );
    assert!(message(base.for_task(TaskId::worker(2)))
        .contains("cluster config: task worker:2 is out of range: the cluster has 2 worker tasks"));
}

#[test]
fn simple_resolver() {
    let spec = ClusterSpec::workers(["localhost:5000", "localhost:5001"]).unwrap();
    let c = SimpleClusterResolver::new(spec.clone(), TaskId::worker(1)).with_rpc_layer("grpc").resolve().unwrap();
    assert_eq!(c.rank(), Some(1));
    assert_eq!(c.port().unwrap(), 5001);
    assert_eq!(c.rpc_layer.as_deref(), Some("grpc"));
    let m = message(SimpleClusterResolver::new(spec, TaskId::ps(0)).resolve());
    assert!(m.contains("cluster config: task ps:0: job \"ps\" is not a job of the cluster"), "{m}");
    // Resolvers are usable as trait objects.
    let resolvers: Vec<Box<dyn ClusterResolver>> = vec![
        Box::new(TFConfigClusterResolver::from_json(c.to_tf_config())),
        Box::new(SimpleClusterResolver::new(c.spec.clone(), c.task)),
    ];
    for r in resolvers {
        assert_eq!(r.resolve().unwrap().task, TaskId::worker(1));
    }
}

// ---------------------------------------------------------------- Slurm

/// The variables `srun` sets for task 1 of a 2-node allocation, one task per node.
#[test]
fn slurm_two_node_allocation() {
    let mut v = vars(&[
        ("SLURM_PROCID", "1"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_NODEID", "1"),
        ("SLURM_JOB_NODELIST", "node[07-08]"),
        ("SLURM_TASKS_PER_NODE", "1(x2)"),
        ("SLURM_JOB_ID", "4242"),
    ]);
    let r = SlurmClusterResolver::from_vars(&v);
    let c = r.resolve().unwrap();
    assert_eq!(c.task, TaskId::worker(1));
    assert_eq!(c.spec.num_tasks(TaskType::Worker), 2);
    assert_eq!(c.spec.jobs().count(), 1);
    assert_eq!(c.spec.address(TaskId::worker(0)).unwrap(), "node07:8888");
    assert_eq!(c.address().unwrap(), "node08:8888");
    assert_eq!(c.rank(), Some(1));
    assert!(!c.is_chief());
    assert_eq!(r.visible_devices().unwrap(), None);
    assert_eq!(
        r.layout().unwrap(),
        SlurmLayout {
            nodes: strings(&["node07", "node08"]),
            tasks_per_node: vec![1, 1],
            proc_id: 1,
            node_index: 1,
            local_id: 0,
        }
    );

    v.insert("SLURM_PROCID".into(), "0".into());
    let chief = SlurmClusterResolver::from_vars(&v).resolve().unwrap();
    assert!(chief.is_chief());
    assert_eq!(chief.spec.fingerprint(), c.spec.fingerprint());
}

/// A parameter-server job under Slurm: `chief=1,ps=1,worker=2` over 2 nodes x 2 tasks assigns
/// the ranks to the jobs in order, as TensorFlow's `SlurmClusterResolver(jobs=...)` does.
#[test]
fn slurm_jobs_assign_ranks_in_order() {
    let jobs: SlurmJobs = "chief=1, ps=1,worker=2".parse().unwrap();
    assert_eq!(jobs.to_string(), "chief=1,ps=1,worker=2");
    let expected = [TaskId::chief(), TaskId::ps(0), TaskId::worker(0), TaskId::worker(1)];
    let mut fingerprints = Vec::new();
    for (rank, want) in expected.iter().enumerate() {
        let local = (rank % 2).to_string();
        let rank = rank.to_string();
        let v = vars(&[
            ("SLURM_PROCID", &rank),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", &local),
            ("SLURM_JOB_NODELIST", "n[1-2]"),
            ("SLURM_TASKS_PER_NODE", "2(x2)"),
        ]);
        let c = SlurmClusterResolver::from_vars(&v).jobs(jobs.clone()).resolve().unwrap();
        assert_eq!(c.task, *want);
        assert_eq!(c.spec.address(TaskId::chief()).unwrap(), "n1:8888");
        assert_eq!(c.spec.address(TaskId::ps(0)).unwrap(), "n1:8889");
        assert_eq!(c.spec.address(TaskId::worker(0)).unwrap(), "n2:8888");
        assert_eq!(c.spec.address(TaskId::worker(1)).unwrap(), "n2:8889");
        fingerprints.push(c.spec.fingerprint());
    }
    assert!(fingerprints.windows(2).all(|w| w[0] == w[1]), "every task sees the same cluster");

    // A mapping that does not cover the step is refused, naming both counts.
    let v = vars(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "3"), ("SLURM_JOB_NODELIST", "n[1-3]")]);
    let e = SlurmClusterResolver::from_vars(&v).jobs(jobs).resolve().unwrap_err().to_string();
    assert!(e.contains("chief=1,ps=1,worker=2 has 4 tasks but the job step has 3"), "{e}");

    for (bad, why) in [
        ("", "is not job=count"),
        ("ps", "is not job=count"),
        ("ps=1,ps=2", "names ps twice"),
        ("ps=0,worker=1", "gives ps no task"),
        ("chief=2,worker=1", "at most one chief"),
        ("master=1", "is \"chief\" now"),
        ("boss=1", "\"boss\" is not a job name"),
        ("worker=x", "is not a whole number"),
    ] {
        let e = bad.parse::<SlurmJobs>().unwrap_err().to_string();
        assert!(e.contains(why), "{bad:?}: {e}");
        assert!(!e.contains('\n') && !e.ends_with('.'), "{e}");
    }
}

/// 2 nodes x 2 tasks, 2 GPUs per task: the last task gets GPUs 2,3 of the second node.
#[test]
fn slurm_two_nodes_two_tasks_with_gpus() {
    let v = vars(&[
        ("SLURM_PROCID", "3"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_JOB_NODELIST", "gpu-a[1-2]"),
        ("SLURM_TASKS_PER_NODE", "2(x2)"),
    ]);
    let r = SlurmClusterResolver::from_vars(&v).base_port(9000).gpus_per_task(2);
    let c = r.resolve().unwrap();
    let addresses: Vec<&str> = c.spec.tasks().map(|(_, a)| a).collect();
    assert_eq!(addresses, vec!["gpu-a1:9000", "gpu-a1:9001", "gpu-a2:9000", "gpu-a2:9001"]);
    assert_eq!(c.task, TaskId::worker(3));
    assert_eq!(c.address().unwrap(), "gpu-a2:9001");
    assert_eq!(r.visible_devices().unwrap().as_deref(), Some("2,3"));
    let layout = r.layout().unwrap();
    assert_eq!((layout.node(), layout.local_id, layout.num_tasks()), ("gpu-a2", 1, 4));

    let mut v0 = v.clone();
    v0.insert("SLURM_PROCID".into(), "2".into());
    v0.insert("SLURM_LOCALID".into(), "0".into());
    let r0 = SlurmClusterResolver::from_vars(&v0).gpus_per_task(2);
    assert_eq!(r0.visible_devices().unwrap().as_deref(), Some("0,1"));
    assert_eq!(r0.resolve().unwrap().address().unwrap(), "gpu-a2:8888");
    let one = SlurmClusterResolver::from_vars(&v).gpus_per_task(1);
    assert_eq!(one.visible_devices().unwrap().as_deref(), Some("1"));
}

#[test]
fn slurm_task_layouts() {
    // No SLURM_TASKS_PER_NODE: tasks spread evenly.
    let even = vars(&[("SLURM_PROCID", "2"), ("SLURM_NTASKS", "4"), ("SLURM_JOB_NODELIST", "n[1-2]")]);
    assert_eq!(SlurmClusterResolver::from_vars(&even).resolve().unwrap().address().unwrap(), "n2:8888");
    // Uneven counts from SLURM_TASKS_PER_NODE.
    let uneven = vars(&[
        ("SLURM_PROCID", "2"),
        ("SLURM_NTASKS", "3"),
        ("SLURM_JOB_NODELIST", "n[1-2]"),
        ("SLURM_TASKS_PER_NODE", "2,1"),
    ]);
    let c = SlurmClusterResolver::from_vars(&uneven).resolve().unwrap();
    assert_eq!(c.address().unwrap(), "n2:8888");
    assert_eq!(c.spec.address(TaskId::worker(1)).unwrap(), "n1:8889");
    // The tasks-per-node setting overrides the variable.
    let c = SlurmClusterResolver::from_vars(&even).tasks_per_node(2).resolve().unwrap();
    assert_eq!(c.spec.address(TaskId::worker(1)).unwrap(), "n1:8889");
    // The step's node list and counts come before the job's (a step on part of the allocation).
    let step = vars(&[
        ("SLURM_PROCID", "1"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_JOB_NODELIST", "n[1-4]"),
        ("SLURM_TASKS_PER_NODE", "4(x4)"),
        ("SLURM_STEP_NODELIST", "n[3-4]"),
        ("SLURM_STEP_TASKS_PER_NODE", "1(x2)"),
    ]);
    let c = SlurmClusterResolver::from_vars(&step).resolve().unwrap();
    assert_eq!(c.spec.tasks().map(|(_, a)| a.to_string()).collect::<Vec<_>>(), strings(&["n3:8888", "n4:8888"]));
    // SLURM_NODELIST is the last fallback.
    let old = vars(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1"), ("SLURM_NODELIST", "solo")]);
    assert_eq!(SlurmClusterResolver::from_vars(&old).resolve().unwrap().address().unwrap(), "solo:8888");
}

#[test]
fn slurm_errors_name_the_variable() {
    let ok = [
        ("SLURM_PROCID", "1"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_JOB_NODELIST", "node[07-08]"),
        ("SLURM_TASKS_PER_NODE", "1(x2)"),
    ];
    let with = |changes: &[(&str, Option<&str>)]| {
        let mut v = vars(&ok);
        for (k, val) in changes {
            match val {
                Some(val) => v.insert(k.to_string(), val.to_string()),
                None => v.remove(*k),
            };
        }
        v
    };
    let cases: Vec<(HashMap<String, String>, &str)> = vec![
        (with(&[("SLURM_PROCID", None)]), "SLURM_PROCID is not set: run the command under srun"),
        (with(&[("SLURM_PROCID", Some("one"))]), "SLURM_PROCID \"one\" is not a non-negative integer"),
        (with(&[("SLURM_PROCID", Some("-1"))]), "SLURM_PROCID \"-1\" is not a non-negative integer"),
        (with(&[("SLURM_NTASKS", Some("2x"))]), "SLURM_NTASKS \"2x\" is not a non-negative integer"),
        (with(&[("SLURM_NTASKS", None)]), "SLURM_NTASKS is not set"),
        (with(&[("SLURM_NTASKS", Some("0"))]), "SLURM_NTASKS is 0"),
        (with(&[("SLURM_PROCID", Some("2"))]), "SLURM_PROCID 2 is out of range: SLURM_NTASKS is 2 (ranks 0..=1)"),
        (with(&[("SLURM_LOCALID", Some("x"))]), "SLURM_LOCALID \"x\" is not a non-negative integer"),
        (with(&[("SLURM_LOCALID", Some("1"))]), "SLURM_LOCALID 1 does not match task 1's place"),
        (with(&[("SLURM_JOB_NODELIST", None)]), "SLURM_JOB_NODELIST is not set"),
        (with(&[("SLURM_JOB_NODELIST", Some("node[07-"))]), "SLURM_JOB_NODELIST \"node[07-\" has an unclosed '['"),
        (with(&[("SLURM_JOB_NODELIST", Some("node[8-7]"))]), "SLURM_JOB_NODELIST \"node[8-7]\" has the descending"),
        (with(&[("SLURM_JOB_NODELIST", Some("a,,b"))]), "SLURM_JOB_NODELIST \"a,,b\" has an empty node name"),
        (with(&[("SLURM_TASKS_PER_NODE", Some("1(x3)"))]), "SLURM_TASKS_PER_NODE \"1(x3)\" describes more nodes"),
        (
            with(&[("SLURM_TASKS_PER_NODE", Some("2"))]),
            "SLURM_TASKS_PER_NODE \"2\" gives 1 nodes but SLURM_JOB_NODELIST",
        ),
        (
            with(&[("SLURM_TASKS_PER_NODE", Some("2(x2)"))]),
            "SLURM_TASKS_PER_NODE \"2(x2)\" adds up to 4 tasks but SLURM_NTASKS is 2",
        ),
        (
            with(&[("SLURM_TASKS_PER_NODE", Some("1(x"))]),
            "SLURM_TASKS_PER_NODE \"1(x\" has \"1(x\", which is not N or N(xM)",
        ),
        (with(&[("SLURM_TASKS_PER_NODE", Some("1(y2)"))]), "which is not N or N(xM)"),
        (with(&[("SLURM_TASKS_PER_NODE", Some("1(x0)"))]), "repeats over 0 nodes"),
        (
            with(&[("SLURM_TASKS_PER_NODE", None), ("SLURM_NTASKS", Some("3"))]),
            "SLURM_NTASKS 3 does not divide evenly over the 2 nodes of SLURM_JOB_NODELIST",
        ),
    ];
    let n = cases.len();
    for (v, expected) in cases {
        let m = message(SlurmClusterResolver::from_vars(&v).resolve());
        assert!(m.contains(expected), "expected {expected:?} in: {m}");
    }
    assert_eq!(n, 20);

    let v = vars(&ok);
    assert!(message(SlurmClusterResolver::from_vars(&v).tasks_per_node(2).resolve())
        .contains("tasks per node 2 x 2 nodes of SLURM_JOB_NODELIST is 4 tasks, but SLURM_NTASKS is 2"));
    assert!(message(SlurmClusterResolver::from_vars(&v).tasks_per_node(0).resolve()).contains("tasks per node is 0"));
    assert!(message(SlurmClusterResolver::from_vars(&v).base_port(0).resolve()).contains("base port is 0"));
    let two_per_node =
        with(&[("SLURM_NTASKS", Some("4")), ("SLURM_TASKS_PER_NODE", Some("2(x2)")), ("SLURM_LOCALID", Some("1"))]);
    assert!(message(SlurmClusterResolver::from_vars(&two_per_node).base_port(65535).resolve())
        .contains("base port 65535 with 2 tasks on a node goes past port 65535; choose a base port of at most 65534"));
    let c = SlurmClusterResolver::from_vars(&two_per_node).base_port(65534).resolve().unwrap();
    assert_eq!(c.spec.address(TaskId::worker(3)).unwrap(), "node08:65535");
    assert!(message(
        SlurmClusterResolver::from_vars(&v)
            .gpus_per_task(1)
            .visible_devices()
            .map(|_| ())
            .and(SlurmClusterResolver::from_vars(&with(&[("SLURM_PROCID", None)])).gpus_per_task(1).visible_devices())
    )
    .contains("SLURM_PROCID is not set"));
}

#[test]
fn nodelist_expansion_table() {
    let cases: &[(&str, &[&str])] = &[
        ("node[01-04,07],gpu-a[1-2]", &["node01", "node02", "node03", "node04", "node07", "gpu-a1", "gpu-a2"]),
        ("r[1-2]n[1-2]", &["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("single", &["single"]),
        ("a,b,c", &["a", "b", "c"]),
        ("node[8-10]", &["node8", "node9", "node10"]),
        ("node[008-010]", &["node008", "node009", "node010"]),
        ("n[1]", &["n1"]),
        ("n[1,3,5-6]", &["n1", "n3", "n5", "n6"]),
        (
            "rack[1-2]-node[01-02].cluster",
            &["rack1-node01.cluster", "rack1-node02.cluster", "rack2-node01.cluster", "rack2-node02.cluster"],
        ),
        ("gpu[09-11],cpu7", &["gpu09", "gpu10", "gpu11", "cpu7"]),
        ("[1-2]x", &["1x", "2x"]),
    ];
    for (list, expected) in cases {
        assert_eq!(expand_nodelist(list).unwrap(), strings(expected), "{list}");
    }
    assert_eq!(expand_nodelist("  node[1-2]\n").unwrap(), strings(&["node1", "node2"]));
    assert_eq!(expand_nodelist("n[0-99]").unwrap().len(), 100);
}

#[test]
fn nodelist_malformed_table() {
    let cases = [
        ("node[01-", "has an unclosed '['"),
        ("node[3-1]", "has the descending range \"3-1\""),
        ("a,,b", "has an empty node name"),
        (",a", "has an empty node name"),
        ("a,", "has an empty node name"),
        ("", "is empty"),
        ("node[]", "has empty brackets"),
        ("node[a-b]", "which is not a number or a low-high range"),
        ("node[1-]", "which is not a number or a low-high range"),
        ("node[1,,2]", "\"\" in the brackets"),
        ("node1-2]", "has a ']' without a '['"),
        ("n[1[2]]", "brackets do not nest"),
        ("a b", "has ' ' in node name"),
        ("n1,n[1-2]", "lists node \"n1\" twice"),
        ("-n[1-2]", "gives node \"-n1\", which is not a host name"),
        ("n[0-99999999]", "has more than 100000 nodes"),
        ("a[1-1000]b[1-1000]", "has more than 100000 nodes"),
    ];
    for (list, why) in cases {
        let m = message(expand_nodelist(list));
        assert!(m.contains(&format!("node list {list:?} ")), "{m}");
        assert!(m.contains(why), "expected {why:?} for {list:?}: {m}");
    }
}

/// The resolvers read the process environment, which no test here may change: the test
/// binary's other tests run on parallel threads, and a C library reading it (a name lookup, say)
/// while it changes can crash the process. So each case runs in a child process of this binary
/// with its own environment ([`resolvers_read_the_environment_in_a_child`]).
#[test]
fn resolvers_from_env() {
    let tf_config = r#"{"cluster":{"worker":["w0:2222","w1:2222"]},"task":{"type":"worker","index":0}}"#;
    let slurm = [("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1"), ("SLURM_JOB_NODELIST", "envnode")];
    for (case, vars) in [("tf_config", &[("TF_CONFIG", tf_config)][..]), ("unset", &[][..]), ("slurm", &slurm[..])] {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap());
        child.args([
            "--ignored",
            "--exact",
            "cluster::resolvers_read_the_environment_in_a_child",
            "--test-threads",
            "1",
        ]);
        for k in ["TF_CONFIG", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_NODELIST"] {
            child.env_remove(k);
        }
        let out = child.envs(vars.iter().copied()).env("STRATA_RESOLVER_CASE", case).output().unwrap();
        let log = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && log.contains("1 passed"), "case {case}: {log}");
    }
}

/// One case of [`resolvers_from_env`], named by `STRATA_RESOLVER_CASE`, in the environment its
/// parent gave it.
#[test]
#[ignore = "run by resolvers_from_env in a child process, with the environment of each case"]
fn resolvers_read_the_environment_in_a_child() {
    match std::env::var("STRATA_RESOLVER_CASE").as_deref() {
        Ok("tf_config") => {
            let c = TFConfigClusterResolver::from_env().unwrap().resolve().unwrap();
            assert!(c.is_chief());
        }
        Ok("slurm") => {
            let c = SlurmClusterResolver::from_env().base_port(7000).resolve().unwrap();
            assert_eq!(c.address().unwrap(), "envnode:7000");
        }
        _ => {
            if std::env::var_os("TF_CONFIG").is_none() {
                assert!(message(TFConfigClusterResolver::from_env()).contains("TF_CONFIG is not set"));
            }
        }
    }
}
