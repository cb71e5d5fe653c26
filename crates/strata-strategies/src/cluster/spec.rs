//! The vocabulary of a cluster: task types, task ids, the cluster spec (jobs and their
//! addresses) and one task's view of the cluster ([`ClusterConfig`]).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use strata_core::{Error, Result};

/// A job of a cluster, named as TensorFlow names it.
///
/// `chief` coordinates (writes checkpoints and summaries), `worker`s compute, `ps` tasks hold
/// sharded variables for the parameter-server strategy, and the `evaluator` evaluates
/// checkpoints on the side. The order of the variants is the order jobs are written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TaskType {
    /// The `chief` job: at most one task, the first of the synchronous workers.
    Chief,
    /// The `worker` job.
    Worker,
    /// The `ps` (parameter server) job.
    Ps,
    /// The `evaluator` job: at most one task, outside synchronous training.
    Evaluator,
}

impl TaskType {
    /// Every task type, in the order jobs are written.
    pub const ALL: [TaskType; 4] = [TaskType::Chief, TaskType::Worker, TaskType::Ps, TaskType::Evaluator];

    /// TensorFlow's job name: `"chief"`, `"worker"`, `"ps"` or `"evaluator"`.
    pub fn as_str(self) -> &'static str {
        match self {
            TaskType::Chief => "chief",
            TaskType::Worker => "worker",
            TaskType::Ps => "ps",
            TaskType::Evaluator => "evaluator",
        }
    }

    /// Parses a job name; the error (without a field prefix) says which names are accepted.
    pub(crate) fn parse(name: &str) -> std::result::Result<TaskType, String> {
        match name {
            "chief" => Ok(TaskType::Chief),
            "worker" => Ok(TaskType::Worker),
            "ps" => Ok(TaskType::Ps),
            "evaluator" => Ok(TaskType::Evaluator),
            "master" => Err(format!(
                "{name:?} is not a supported job name; TensorFlow 1's \"master\" is \"chief\" now (rename it)"
            )),
            _ => Err(format!("{name:?} is not a job name; use \"chief\", \"worker\", \"ps\" or \"evaluator\"")),
        }
    }
}

impl fmt::Display for TaskType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TaskType {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        TaskType::parse(s).map_err(|m| Error::InvalidCluster(format!("task type {m}")))
    }
}

impl Serialize for TaskType {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for TaskType {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        TaskType::parse(&name).map_err(serde::de::Error::custom)
    }
}

/// One task of a cluster: a job and an index in it. Displays as `worker:1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct TaskId {
    /// The task's job.
    #[serde(rename = "type")]
    pub kind: TaskType,
    /// The task's index in its job, from 0.
    pub index: usize,
}

impl TaskId {
    /// The task `index` of job `kind`.
    pub fn new(kind: TaskType, index: usize) -> Self {
        TaskId { kind, index }
    }

    /// `chief:0`.
    pub fn chief() -> Self {
        TaskId::new(TaskType::Chief, 0)
    }

    /// `worker:index`.
    pub fn worker(index: usize) -> Self {
        TaskId::new(TaskType::Worker, index)
    }

    /// `ps:index`.
    pub fn ps(index: usize) -> Self {
        TaskId::new(TaskType::Ps, index)
    }

    /// `evaluator:0`.
    pub fn evaluator() -> Self {
        TaskId::new(TaskType::Evaluator, 0)
    }

    /// TensorFlow's device prefix of the task, `/job:worker/replica:0/task:1`.
    pub fn device_prefix(&self) -> String {
        format!("/job:{}/replica:0/task:{}", self.kind, self.index)
    }
}

impl fmt::Display for TaskId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.kind, self.index)
    }
}

impl FromStr for TaskId {
    type Err = Error;

    /// Parses `worker:1` (the form [`Display`](fmt::Display) writes).
    fn from_str(s: &str) -> Result<Self> {
        let bad = |why: String| Error::InvalidCluster(format!("task {s:?} {why}"));
        let (kind, index) =
            s.split_once(':').ok_or_else(|| bad("is not of the form job:index; write it as worker:1".into()))?;
        let kind = TaskType::parse(kind).map_err(|m| bad(format!("has job {m}")))?;
        let index = index
            .parse::<usize>()
            .map_err(|_| bad(format!("has index {index:?}, not a non-negative integer; write it as {kind}:0")))?;
        Ok(TaskId::new(kind, index))
    }
}

/// The jobs of a cluster and the `host:port` address of every task, as TensorFlow's
/// `ClusterSpec`: a job's list order gives its task indices.
///
/// A valid spec has every address of the form `host:port` (a host name, an IPv4 address or a
/// bracketed IPv6 address such as `[::1]:2222`; a port in 1..=65535), at most one chief, at
/// most one evaluator, no empty job and no address used twice. It serializes as TensorFlow's
/// cluster dict, `{"chief": ["host:port"], "worker": ["host:port", ...]}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterSpec {
    jobs: BTreeMap<TaskType, Vec<String>>,
}

impl ClusterSpec {
    /// A spec of the given jobs, validated (see the type's documentation).
    ///
    /// ```
    /// use strata_strategies::cluster::{ClusterSpec, TaskId, TaskType};
    /// let spec = ClusterSpec::new([(TaskType::Worker, vec!["10.0.0.1:2222", "10.0.0.2:2222"])])?;
    /// assert_eq!(spec.address(TaskId::worker(1))?, "10.0.0.2:2222");
    /// assert_eq!(spec.chief(), Some(TaskId::worker(0)));
    /// # Ok::<(), strata_core::Error>(())
    /// ```
    pub fn new<I, A>(jobs: I) -> Result<Self>
    where
        I: IntoIterator<Item = (TaskType, Vec<A>)>,
        A: Into<String>,
    {
        let mut map = BTreeMap::new();
        for (kind, addresses) in jobs {
            let addresses: Vec<String> = addresses.into_iter().map(Into::into).collect();
            if map.insert(kind, addresses).is_some() {
                return Err(Error::InvalidCluster(format!(
                    "cluster spec: job \"{kind}\" is given twice; give each job once, with all its addresses"
                )));
            }
        }
        ClusterSpec::validated(map, "").map_err(|m| Error::InvalidCluster(format!("cluster spec: {m}")))
    }

    /// A spec with only a `worker` job (worker 0 acts as chief).
    pub fn workers<A: Into<String>>(addresses: impl IntoIterator<Item = A>) -> Result<Self> {
        ClusterSpec::new([(TaskType::Worker, addresses.into_iter().map(Into::into).collect::<Vec<String>>())])
    }

    /// Validates `jobs`; messages name the field as `{path}{job}[{index}]`, without a prefix.
    pub(crate) fn validated(jobs: BTreeMap<TaskType, Vec<String>>, path: &str) -> std::result::Result<Self, String> {
        let mut seen: HashMap<&str, TaskId> = HashMap::new();
        for (&kind, addresses) in &jobs {
            if addresses.is_empty() {
                return Err(format!(
                    "{path}{kind} is empty; list at least one \"host:port\" address or leave the job out"
                ));
            }
            for (index, address) in addresses.iter().enumerate() {
                if let Err(why) = split_host_port(address) {
                    return Err(format!("{path}{kind}[{index}] {address:?} {why}"));
                }
                if let Some(first) = seen.insert(address.as_str(), TaskId::new(kind, index)) {
                    return Err(format!(
                        "{path}{kind}[{index}] {address:?} is also the address of {path}{}[{}]; every task needs its \
                         own address (use another port)",
                        first.kind, first.index
                    ));
                }
            }
        }
        for single in [TaskType::Chief, TaskType::Evaluator] {
            let n = jobs.get(&single).map_or(0, Vec::len);
            if n > 1 {
                let hint = if single == TaskType::Chief { " (move the others to \"worker\")" } else { "" };
                return Err(format!("{path}{single} has {n} tasks; a cluster has at most one {single}{hint}"));
            }
        }
        Ok(ClusterSpec { jobs })
    }

    /// The number of tasks of job `kind` (0 when the cluster has no such job).
    pub fn num_tasks(&self, kind: TaskType) -> usize {
        self.jobs.get(&kind).map_or(0, Vec::len)
    }

    /// Whether `task` is a task of this cluster.
    pub fn contains(&self, task: TaskId) -> bool {
        task.index < self.num_tasks(task.kind)
    }

    /// The `host:port` address of `task`.
    pub fn address(&self, task: TaskId) -> Result<&str> {
        match self.jobs.get(&task.kind) {
            None => Err(Error::InvalidCluster(format!(
                "cluster spec: task {task} is not in the cluster: it has no \"{}\" job (jobs: {})",
                task.kind,
                self.job_names()
            ))),
            Some(addresses) => addresses.get(task.index).map(String::as_str).ok_or_else(|| {
                Error::InvalidCluster(format!(
                    "cluster spec: task {task} is not in the cluster: {}",
                    range_note(task.kind, addresses.len())
                ))
            }),
        }
    }

    /// The port of `task`'s address.
    pub fn port(&self, task: TaskId) -> Result<u16> {
        let address = self.address(task)?;
        split_host_port(address)
            .map(|(_, port)| port)
            .map_err(|why| Error::InvalidCluster(format!("cluster spec: {task} {address:?} {why}")))
    }

    /// The jobs and their addresses, in the order chief, worker, ps, evaluator.
    pub fn jobs(&self) -> impl Iterator<Item = (TaskType, &[String])> + '_ {
        self.jobs.iter().map(|(&kind, addresses)| (kind, addresses.as_slice()))
    }

    /// Every task and its address, job by job (chief, worker, ps, evaluator), in index order.
    pub fn tasks(&self) -> impl Iterator<Item = (TaskId, &str)> + '_ {
        self.jobs.iter().flat_map(|(&kind, addresses)| {
            addresses.iter().enumerate().map(move |(index, a)| (TaskId::new(kind, index), a.as_str()))
        })
    }

    /// The total number of tasks of every job.
    pub fn total_tasks(&self) -> usize {
        self.jobs.values().map(Vec::len).sum()
    }

    /// The tasks that take part in synchronous (multi-worker mirrored) training, in rank order:
    /// the chief first (when there is a chief job), then workers 0..n.
    pub fn sync_workers(&self) -> Vec<TaskId> {
        let chief = (0..self.num_tasks(TaskType::Chief)).map(|i| TaskId::new(TaskType::Chief, i));
        chief.chain((0..self.num_tasks(TaskType::Worker)).map(TaskId::worker)).collect()
    }

    /// The number of synchronous workers (chief and workers).
    pub fn num_sync_workers(&self) -> usize {
        self.num_tasks(TaskType::Chief) + self.num_tasks(TaskType::Worker)
    }

    /// `task`'s position in [`sync_workers`](Self::sync_workers); `None` for ps and evaluator
    /// tasks and for tasks not in the cluster.
    pub fn rank_of(&self, task: TaskId) -> Option<usize> {
        if !self.contains(task) {
            return None;
        }
        match task.kind {
            TaskType::Chief => Some(task.index),
            TaskType::Worker => Some(self.num_tasks(TaskType::Chief) + task.index),
            TaskType::Ps | TaskType::Evaluator => None,
        }
    }

    /// The task that acts as chief: `chief:0`, or `worker:0` when there is no chief job
    /// (TensorFlow's rule); `None` for a cluster with neither.
    pub fn chief(&self) -> Option<TaskId> {
        self.sync_workers().first().copied()
    }

    /// A stable, canonical string of the cluster (jobs sorted by name, each job's addresses in
    /// index order), compared at rendezvous so that every peer runs the same cluster.
    pub fn fingerprint(&self) -> String {
        let mut jobs: Vec<(&str, &Vec<String>)> = self.jobs.iter().map(|(k, a)| (k.as_str(), a)).collect();
        jobs.sort_by_key(|&(name, _)| name);
        let parts: Vec<String> =
            jobs.iter().map(|(name, addresses)| format!("{name}={}", addresses.join(","))).collect();
        parts.join(";")
    }

    /// Ok when the cluster has at least one `ps` task, which `ParameterServerStrategy` needs.
    pub fn require_ps(&self) -> Result<()> {
        if self.num_tasks(TaskType::Ps) == 0 {
            return Err(Error::InvalidCluster(format!(
                "cluster spec: the cluster has no ps tasks; ParameterServerStrategy needs at least one (add a \"ps\" \
                 job; jobs now: {})",
                self.job_names()
            )));
        }
        Ok(())
    }

    /// Ok when the cluster has at least one chief or worker task to train.
    pub fn require_workers(&self) -> Result<()> {
        if self.num_sync_workers() == 0 {
            return Err(Error::InvalidCluster(format!(
                "cluster spec: the cluster has no chief or worker tasks; training needs at least one (add a \
                 \"worker\" job; jobs now: {})",
                self.job_names()
            )));
        }
        Ok(())
    }

    /// The job names, `"chief", "worker"`, for messages.
    fn job_names(&self) -> String {
        let names: Vec<String> = self.jobs.keys().map(|k| format!("\"{k}\"")).collect();
        names.join(", ")
    }
}

impl fmt::Display for ClusterSpec {
    /// The cluster dict as compact JSON.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let json = serde_json::to_string(self).map_err(|_| fmt::Error)?;
        f.write_str(&json)
    }
}

impl Serialize for ClusterSpec {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.jobs.len()))?;
        for (kind, addresses) in &self.jobs {
            map.serialize_entry(kind.as_str(), addresses)?;
        }
        map.end()
    }
}

/// The valid task indices of a job, for messages: `the cluster has 2 worker tasks (indices 0..=1)`.
pub(crate) fn range_note(kind: TaskType, n: usize) -> String {
    match n {
        0 => format!("the cluster has no {kind} tasks"),
        1 => format!("the cluster has 1 {kind} task (index 0)"),
        n => format!("the cluster has {n} {kind} tasks (indices 0..={})", n - 1),
    }
}

/// Splits `host:port`, checking the host (a host name, an IPv4 address or a bracketed IPv6
/// address) and the port (1..=65535). The error completes a sentence starting with the address.
pub fn split_host_port(address: &str) -> std::result::Result<(&str, u16), String> {
    const FORM: &str = "write it as host:port, e.g. worker-0:2222 or [::1]:2222";
    if address.is_empty() {
        return Err(format!("is empty; {FORM}"));
    }
    let (host, port) = if let Some(rest) = address.strip_prefix('[') {
        let (inner, after) =
            rest.split_once(']').ok_or_else(|| format!("has an unclosed '[' in its IPv6 host; {FORM}"))?;
        if inner.parse::<Ipv6Addr>().is_err() {
            return Err(format!("has {inner:?} in brackets, which is not an IPv6 address; {FORM}"));
        }
        let port = after.strip_prefix(':').ok_or_else(|| format!("has no \":port\" after its IPv6 host; {FORM}"))?;
        (&address[..inner.len() + 2], port)
    } else {
        let (host, port) = address.rsplit_once(':').ok_or_else(|| format!("has no port; {FORM}"))?;
        if host.contains(':') {
            return Err(format!("looks like an IPv6 address without brackets; write it as [{host}]:{port}"));
        }
        if host.is_empty() {
            return Err(format!("has an empty host; {FORM}"));
        }
        check_host(host).map_err(|why| format!("has host {host:?}, which {why}"))?;
        (host, port)
    };
    if port.is_empty() {
        return Err(format!("has an empty port; {FORM}"));
    }
    if !port.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("has port {port:?}, which is not a number; use a port in 1..=65535"));
    }
    match port.parse::<u16>() {
        Ok(p) if p >= 1 => Ok((host, p)),
        _ => Err(format!("has port {port} out of range; use a port in 1..=65535")),
    }
}

/// Checks a host name or an IPv4 address (the host of an address without brackets); the
/// error completes `... which`.
pub(crate) fn check_host(host: &str) -> std::result::Result<(), String> {
    if host.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return match host.parse::<Ipv4Addr>() {
            Ok(_) => Ok(()),
            Err(_) => Err("is not an IPv4 address (four numbers 0..=255)".into()),
        };
    }
    if host.len() > 253 {
        return Err(format!("is {} characters long; host names have at most 253", host.len()));
    }
    for label in host.split('.') {
        let valid_chars = label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if label.is_empty() || label.len() > 63 || !valid_chars || label.starts_with('-') || label.ends_with('-') {
            return Err("is not a host name (dot-separated labels of letters, digits, '-' and '_', not starting \
                        or ending with '-')"
                .into());
        }
    }
    Ok(())
}

/// One task's view of its cluster: the spec, the task this process runs, and TF_CONFIG's
/// optional `rpc_layer` and `environment`.
///
/// The fields are public for convenience; [`ClusterConfig::new`] and the resolvers check that
/// `task` is in `spec` (an `evaluator` may be absent from the spec, as in TensorFlow).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ClusterConfig {
    /// The cluster.
    #[serde(rename = "cluster")]
    pub spec: ClusterSpec,
    /// This process's task.
    pub task: TaskId,
    /// TF_CONFIG's `rpc_layer` (for example `"grpc"`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rpc_layer: Option<String>,
    /// TF_CONFIG's `environment` (for example `"cloud"`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub environment: Option<String>,
}

impl ClusterConfig {
    /// The config of `task` in `spec`; an error when `task` is not in the cluster.
    pub fn new(spec: ClusterSpec, task: TaskId) -> Result<Self> {
        let config = ClusterConfig { spec, task, rpc_layer: None, environment: None };
        config.validate()?;
        Ok(config)
    }

    /// Sets the `rpc_layer`.
    pub fn with_rpc_layer(mut self, rpc_layer: impl Into<String>) -> Self {
        self.rpc_layer = Some(rpc_layer.into());
        self
    }

    /// Sets the `environment`.
    pub fn with_environment(mut self, environment: impl Into<String>) -> Self {
        self.environment = Some(environment.into());
        self
    }

    /// The same cluster seen from another task (a launcher writes one TF_CONFIG per task).
    pub fn for_task(&self, task: TaskId) -> Result<Self> {
        let config = ClusterConfig { task, ..self.clone() };
        config.validate()?;
        Ok(config)
    }

    /// Checks that `task` is in `spec`.
    pub fn validate(&self) -> Result<()> {
        let task = self.task;
        check_task(&self.spec, task, &format!("task {task}: job \"{}\"", task.kind), &format!("task {task}"))
            .map_err(|m| Error::InvalidCluster(format!("cluster config: {m}")))
    }

    /// Whether this task acts as chief (`chief:0`, or `worker:0` without a chief job).
    pub fn is_chief(&self) -> bool {
        self.spec.chief() == Some(self.task)
    }

    /// This task's rank among the synchronous workers; `None` for ps and evaluator tasks.
    pub fn rank(&self) -> Option<usize> {
        self.spec.rank_of(self.task)
    }

    /// The number of synchronous workers (chief and workers).
    pub fn num_sync_workers(&self) -> usize {
        self.spec.num_sync_workers()
    }

    /// This task's `host:port` address.
    pub fn address(&self) -> Result<&str> {
        self.spec.address(self.task)
    }

    /// This task's port (to bind, for example, `0.0.0.0:port` in a pod).
    pub fn port(&self) -> Result<u16> {
        self.spec.port(self.task)
    }

    /// The TF_CONFIG JSON of this task, as TensorFlow writes it (compact, keys in the order
    /// `cluster`, `task`, `rpc_layer`, `environment`; the last two only when set).
    pub fn to_tf_config(&self) -> String {
        // Serializing strings, numbers and maps of strings cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// Checks that `task` is in `spec`: its job exists (an evaluator may be absent, with index 0)
/// and its index is in range. `type_field` and `index_field` start the messages.
pub(crate) fn check_task(
    spec: &ClusterSpec,
    task: TaskId,
    type_field: &str,
    index_field: &str,
) -> std::result::Result<(), String> {
    let n = spec.num_tasks(task.kind);
    if n == 0 {
        if task.kind == TaskType::Evaluator {
            // TensorFlow lets the evaluator run outside the cluster it evaluates.
            return match task.index {
                0 => Ok(()),
                _ => Err(format!("{index_field} is out of range: there is at most one evaluator (index 0)")),
            };
        }
        return Err(format!(
            "{type_field} is not a job of the cluster (jobs: {}); add a \"{}\" job to the cluster or change the task \
             type",
            spec.job_names(),
            task.kind
        ));
    }
    if task.index >= n {
        return Err(format!("{index_field} is out of range: {}", range_note(task.kind, n)));
    }
    Ok(())
}
