//! The Slurm resolver: the cluster from the variables `srun` sets for each task.

use std::collections::{BTreeMap, HashMap, HashSet};

use strata_core::{Error, Result};

use super::spec::{check_host, ClusterConfig, ClusterSpec, TaskId, TaskType};
use super::ClusterResolver;

/// The most nodes a node list may expand to (a guard against `node[0-999999999]`).
const MAX_NODES: usize = 100_000;

/// Resolves the cluster of a Slurm job step from the variables `srun` sets for each task.
///
/// Reads `SLURM_PROCID` (this task's rank), the task count (`SLURM_STEP_NUM_TASKS`, else
/// `SLURM_NTASKS`, else `SLURM_NPROCS`), the node list (`SLURM_STEP_NODELIST`, else
/// `SLURM_JOB_NODELIST`, else `SLURM_NODELIST`; bracket ranges such as `node[01-04,07]` are
/// expanded, see [`expand_nodelist`]), the tasks per node (`SLURM_STEP_TASKS_PER_NODE`, else
/// `SLURM_TASKS_PER_NODE`, in Slurm's `2(x3),1` form; without either, the tasks are spread
/// evenly) and, when set, checks `SLURM_LOCALID`. The step's variables come first because a
/// step may run on part of the job's allocation.
///
/// Tasks are numbered node by node (Slurm's default block distribution): task `i`'s address is
/// `node:base_port + its local index on the node`. By default every task is a `worker` and
/// `worker:0` acts as chief; [`jobs`](Self::jobs) assigns the ranks to jobs in order instead
/// (`chief=1,ps=1,worker=2`: rank 0 is the chief, rank 1 `ps:0`, ranks 2 and 3 the workers), as
/// TensorFlow's `SlurmClusterResolver(jobs={...})` does.
///
/// ```
/// use std::collections::HashMap;
/// use strata_strategies::cluster::{ClusterResolver, SlurmClusterResolver, TaskId};
/// let vars: HashMap<String, String> = [
///     ("SLURM_PROCID", "1"),
///     ("SLURM_NTASKS", "2"),
///     ("SLURM_LOCALID", "0"),
///     ("SLURM_JOB_NODELIST", "node[07-08]"),
///     ("SLURM_TASKS_PER_NODE", "1(x2)"),
/// ]
/// .into_iter()
/// .map(|(k, v)| (k.to_string(), v.to_string()))
/// .collect();
/// let config = SlurmClusterResolver::from_vars(&vars).resolve()?;
/// assert_eq!(config.task, TaskId::worker(1));
/// assert_eq!(config.address()?, "node08:8888");
/// # Ok::<(), strata_core::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct SlurmClusterResolver {
    vars: HashMap<String, String>,
    base_port: u16,
    gpus_per_task: usize,
    tasks_per_node: Option<usize>,
    jobs: Option<SlurmJobs>,
}

/// How a Slurm step's ranks are assigned to jobs: `(job, count)` in rank order, parsed from
/// `chief=1,ps=1,worker=2`.
///
/// ```
/// use strata_strategies::cluster::{SlurmJobs, TaskType};
/// let jobs: SlurmJobs = "ps=1,worker=3".parse()?;
/// assert_eq!(jobs.jobs(), &[(TaskType::Ps, 1), (TaskType::Worker, 3)]);
/// assert_eq!(jobs.total(), 4);
/// # Ok::<(), strata_core::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmJobs {
    jobs: Vec<(TaskType, usize)>,
}

impl SlurmJobs {
    /// The jobs and their task counts, in rank order; each job once, `chief` and `evaluator`
    /// with at most one task.
    pub fn new(jobs: impl IntoIterator<Item = (TaskType, usize)>) -> Result<Self> {
        let jobs: Vec<_> = jobs.into_iter().collect();
        check_jobs(&jobs).map_err(|why| Error::InvalidCluster(format!("Slurm job mapping {why}")))?;
        Ok(SlurmJobs { jobs })
    }

    /// The jobs and their task counts, in rank order.
    pub fn jobs(&self) -> &[(TaskType, usize)] {
        &self.jobs
    }

    /// The number of tasks the mapping covers.
    pub fn total(&self) -> usize {
        self.jobs.iter().map(|&(_, n)| n).sum()
    }

    /// The task that rank `rank` runs, if the mapping covers it.
    pub fn task(&self, rank: usize) -> Option<TaskId> {
        let mut first = 0;
        for &(kind, n) in &self.jobs {
            if rank < first + n {
                return Some(TaskId::new(kind, rank - first));
            }
            first += n;
        }
        None
    }
}

impl std::fmt::Display for SlurmJobs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (kind, n)) in self.jobs.iter().enumerate() {
            write!(f, "{}{kind}={n}", if i > 0 { "," } else { "" })?;
        }
        Ok(())
    }
}

impl std::str::FromStr for SlurmJobs {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = |why: String| Error::InvalidCluster(format!("Slurm job mapping {s:?} {why}"));
        let mut jobs = Vec::new();
        for part in s.split(',') {
            let (name, count) = part.trim().split_once('=').ok_or_else(|| {
                bad(format!("has {part:?}, which is not job=count; write it as e.g. chief=1,ps=1,worker=2"))
            })?;
            let kind = TaskType::parse(name.trim()).map_err(|why| bad(format!("names {why}")))?;
            let count: usize = count
                .trim()
                .parse()
                .map_err(|_| bad(format!("gives {name} the count {count:?}, which is not a whole number")))?;
            jobs.push((kind, count));
        }
        check_jobs(&jobs).map_err(bad)?;
        Ok(SlurmJobs { jobs })
    }
}

/// The most tasks one job of a mapping may have (the node-list bound).
const MAX_JOB_TASKS: usize = MAX_NODES * 64;

fn check_jobs(jobs: &[(TaskType, usize)]) -> std::result::Result<(), String> {
    if jobs.is_empty() {
        return Err("is empty; give each job its task count, e.g. ps=1,worker=2".into());
    }
    let mut seen = HashSet::new();
    for &(kind, n) in jobs {
        if !seen.insert(kind) {
            return Err(format!("names {kind} twice; give each job once"));
        }
        if n == 0 {
            return Err(format!("gives {kind} no task; leave the job out or give it 1 or more"));
        }
        if n > MAX_JOB_TASKS {
            return Err(format!("gives {kind} {n} tasks, more than {MAX_JOB_TASKS}"));
        }
        if matches!(kind, TaskType::Chief | TaskType::Evaluator) && n > 1 {
            return Err(format!("gives {kind} {n} tasks; a cluster has at most one {kind}"));
        }
    }
    Ok(())
}

/// Where a Slurm task sits in its job step, as [`SlurmClusterResolver::layout`] finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmLayout {
    /// The step's nodes, expanded from the node list, in order.
    pub nodes: Vec<String>,
    /// The number of tasks on each node of `nodes`.
    pub tasks_per_node: Vec<usize>,
    /// This task's rank (`SLURM_PROCID`).
    pub proc_id: usize,
    /// The index in `nodes` of this task's node.
    pub node_index: usize,
    /// This task's index among the tasks of its node (`SLURM_LOCALID`).
    pub local_id: usize,
}

impl SlurmLayout {
    /// The total number of tasks.
    pub fn num_tasks(&self) -> usize {
        self.tasks_per_node.iter().sum()
    }

    /// This task's node.
    pub fn node(&self) -> &str {
        &self.nodes[self.node_index]
    }
}

impl SlurmClusterResolver {
    /// The default base port: task `l` of a node listens on `8888 + l`.
    pub const DEFAULT_BASE_PORT: u16 = 8888;

    /// A resolver over this process's `SLURM_*` environment variables.
    pub fn from_env() -> Self {
        let vars = std::env::vars_os()
            .filter_map(|(k, v)| {
                let k = k.into_string().ok()?;
                k.starts_with("SLURM").then(|| (k, v.to_string_lossy().into_owned()))
            })
            .collect();
        SlurmClusterResolver::with_vars(vars)
    }

    /// A resolver over the given variables (for tests, and for launchers that pass them on).
    pub fn from_vars(vars: &HashMap<String, String>) -> Self {
        SlurmClusterResolver::with_vars(vars.clone())
    }

    fn with_vars(vars: HashMap<String, String>) -> Self {
        SlurmClusterResolver {
            vars,
            base_port: Self::DEFAULT_BASE_PORT,
            gpus_per_task: 0,
            tasks_per_node: None,
            jobs: None,
        }
    }

    /// The port of each node's first task (default 8888); the node's task `l` uses
    /// `base_port + l`.
    pub fn base_port(mut self, port: u16) -> Self {
        self.base_port = port;
        self
    }

    /// GPUs per task (default 0): with `g > 0`, [`visible_devices`](Self::visible_devices)
    /// gives local task `l` the GPUs `l*g .. l*g+g-1` of its node.
    pub fn gpus_per_task(mut self, gpus: usize) -> Self {
        self.gpus_per_task = gpus;
        self
    }

    /// Overrides the tasks per node (the same on every node), instead of
    /// `SLURM_TASKS_PER_NODE`.
    pub fn tasks_per_node(mut self, tasks: usize) -> Self {
        self.tasks_per_node = Some(tasks);
        self
    }

    /// Assigns the step's ranks to jobs in order (see [`SlurmJobs`]); without it every task is
    /// a worker. The mapping must cover exactly the step's tasks.
    pub fn jobs(mut self, jobs: SlurmJobs) -> Self {
        self.jobs = Some(jobs);
        self
    }

    /// Where this task sits: the nodes, tasks per node, and this task's node and local index.
    pub fn layout(&self) -> Result<SlurmLayout> {
        self.layout_inner().map_err(Error::InvalidCluster)
    }

    /// The `CUDA_VISIBLE_DEVICES` value of this task, `"2,3"` for local task 1 with 2 GPUs per
    /// task; `None` when GPUs per task is 0.
    ///
    /// Use it where Slurm does not bind GPUs to tasks itself (no `--gpus-per-task` / `--gpu-bind`).
    pub fn visible_devices(&self) -> Result<Option<String>> {
        if self.gpus_per_task == 0 {
            return Ok(None);
        }
        let layout = self.layout()?;
        let first = layout.local_id * self.gpus_per_task;
        let ids: Vec<String> = (first..first + self.gpus_per_task).map(|i| i.to_string()).collect();
        Ok(Some(ids.join(",")))
    }

    fn layout_inner(&self) -> std::result::Result<SlurmLayout, String> {
        let (procid_var, procid) = self
            .first(&["SLURM_PROCID"])
            .ok_or("SLURM_PROCID is not set: run the command under srun, which sets it for each task")?;
        let proc_id = number(procid_var, procid)?;
        let (ntasks_var, ntasks) = self.first(&["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"]).ok_or(
            "SLURM_NTASKS is not set: run the command under srun (e.g. srun --ntasks-per-node=1), which sets it",
        )?;
        let num_tasks = number(ntasks_var, ntasks)?;
        if num_tasks == 0 {
            return Err(format!("{ntasks_var} is 0; a job step needs at least one task"));
        }
        if proc_id >= num_tasks {
            return Err(format!(
                "{procid_var} {proc_id} is out of range: {ntasks_var} is {num_tasks} (ranks 0..={})",
                num_tasks - 1
            ));
        }
        let (list_var, list) = self
            .first(&["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"])
            .ok_or("SLURM_JOB_NODELIST is not set: run the command under srun inside an allocation")?;
        let nodes = expand(list).map_err(|why| format!("{list_var} {list:?} {why}"))?;

        let tasks_per_node = if let Some(n) = self.tasks_per_node {
            if n == 0 {
                return Err("tasks per node is 0; set it to 1 or more, or leave it unset".into());
            }
            let total = n.saturating_mul(nodes.len());
            if total != num_tasks {
                return Err(format!(
                    "tasks per node {n} x {} nodes of {list_var} is {total} tasks, but {ntasks_var} is {num_tasks}; \
                     change the tasks per node setting",
                    nodes.len()
                ));
            }
            vec![n; nodes.len()]
        } else if let Some((tpn_var, tpn)) = self.first(&["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]) {
            let counts = parse_tasks_per_node(tpn, nodes.len()).map_err(|why| format!("{tpn_var} {tpn:?} {why}"))?;
            if counts.len() != nodes.len() {
                return Err(format!(
                    "{tpn_var} {tpn:?} gives {} nodes but {list_var} {list:?} has {}; the two must describe the same \
                     nodes",
                    counts.len(),
                    nodes.len()
                ));
            }
            let total: usize = counts.iter().sum();
            if total != num_tasks {
                return Err(format!(
                    "{tpn_var} {tpn:?} adds up to {total} tasks but {ntasks_var} is {num_tasks}; the two must agree"
                ));
            }
            counts
        } else {
            if num_tasks % nodes.len() != 0 {
                return Err(format!(
                    "{ntasks_var} {num_tasks} does not divide evenly over the {} nodes of {list_var} and \
                     SLURM_TASKS_PER_NODE is not set; set SLURM_TASKS_PER_NODE (e.g. \"2,1\") or the tasks per node",
                    nodes.len()
                ));
            }
            vec![num_tasks / nodes.len(); nodes.len()]
        };

        let mut first = 0;
        let mut place = None;
        for (node_index, &n) in tasks_per_node.iter().enumerate() {
            if proc_id < first + n {
                place = Some((node_index, proc_id - first));
                break;
            }
            first += n;
        }
        // The counts add up to num_tasks > proc_id, so the task has a place.
        let (node_index, local_id) = place.ok_or_else(|| format!("{procid_var} {proc_id} has no node"))?;
        if let Some((localid_var, localid)) = self.first(&["SLURM_LOCALID"]) {
            let given = number(localid_var, localid)?;
            if given != local_id {
                return Err(format!(
                    "{localid_var} {given} does not match task {proc_id}'s place in a block layout (local task \
                     {local_id} on {}); launch with srun --distribution=block",
                    nodes[node_index]
                ));
            }
        }
        Ok(SlurmLayout { nodes, tasks_per_node, proc_id, node_index, local_id })
    }

    /// The first of `names` that is set to a non-empty value, with its name.
    fn first<'a>(&'a self, names: &[&'static str]) -> Option<(&'static str, &'a str)> {
        names.iter().find_map(|&name| {
            let value = self.vars.get(name)?.trim();
            (!value.is_empty()).then_some((name, value))
        })
    }
}

impl ClusterResolver for SlurmClusterResolver {
    fn source(&self) -> &'static str {
        "Slurm's job step"
    }

    fn resolve(&self) -> Result<ClusterConfig> {
        let layout = self.layout()?;
        if self.base_port == 0 {
            return Err(Error::InvalidCluster("base port is 0; use a port in 1..=65535 (default 8888)".into()));
        }
        let most = layout.tasks_per_node.iter().copied().max().unwrap_or(0);
        if most > 0 && usize::from(self.base_port) + most - 1 > usize::from(u16::MAX) {
            return Err(Error::InvalidCluster(format!(
                "base port {} with {most} tasks on a node goes past port 65535; choose a base port of at most {}",
                self.base_port,
                usize::from(u16::MAX) + 1 - most
            )));
        }
        let mut addresses = Vec::with_capacity(layout.num_tasks());
        for (node, &n) in layout.nodes.iter().zip(&layout.tasks_per_node) {
            for local in 0..n {
                addresses.push(format!("{node}:{}", usize::from(self.base_port) + local));
            }
        }
        let (jobs, task) = match &self.jobs {
            None => (BTreeMap::from([(TaskType::Worker, addresses)]), TaskId::worker(layout.proc_id)),
            Some(mapping) => {
                if mapping.total() != addresses.len() {
                    return Err(Error::InvalidCluster(format!(
                        "the Slurm job mapping {mapping} has {} tasks but the job step has {}; make them agree \
                         (srun --ntasks, or the mapping's counts)",
                        mapping.total(),
                        addresses.len()
                    )));
                }
                let mut jobs = BTreeMap::new();
                let mut rest = addresses.into_iter();
                for &(kind, n) in mapping.jobs() {
                    jobs.insert(kind, rest.by_ref().take(n).collect::<Vec<_>>());
                }
                let task = mapping.task(layout.proc_id).ok_or_else(|| {
                    Error::InvalidCluster(format!("rank {} is past the Slurm job mapping {mapping}", layout.proc_id))
                })?;
                (jobs, task)
            }
        };
        let spec =
            ClusterSpec::validated(jobs, "").map_err(|m| Error::InvalidCluster(format!("Slurm node list: {m}")))?;
        ClusterConfig::new(spec, task)
    }
}

/// Expands a Slurm node list: `node[01-04,07],gpu-a[1-2]` gives `node01`..`node04`, `node07`,
/// `gpu-a1`, `gpu-a2`.
///
/// Zero padding is kept (the width of a range's first number), several bracket groups in one
/// name expand as a product (`r[1-2]n[1-2]` gives `r1n1`, `r1n2`, `r2n1`, `r2n2`) and commas
/// inside brackets do not split names.
pub fn expand_nodelist(list: &str) -> Result<Vec<String>> {
    expand(list).map_err(|why| Error::InvalidCluster(format!("node list {list:?} {why}")))
}

/// [`expand_nodelist`] with an error that completes `node list "..."`.
fn expand(list: &str) -> std::result::Result<Vec<String>, String> {
    let list = list.trim();
    if list.is_empty() {
        return Err("is empty; list the nodes, e.g. node[01-04]".into());
    }
    let mut names = Vec::new();
    let mut depth = 0;
    let mut start = 0;
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth > 0 => return Err("has a '[' inside brackets; brackets do not nest".into()),
            '[' => depth = 1,
            ']' if depth == 0 => return Err("has a ']' without a '['".into()),
            ']' => depth = 0,
            ',' if depth == 0 => {
                names.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth > 0 {
        return Err("has an unclosed '['; close every range, e.g. node[01-04]".into());
    }
    names.push(&list[start..]);

    let mut nodes = Vec::new();
    let mut seen = HashSet::new();
    for name in names {
        if name.is_empty() {
            return Err("has an empty node name; check the commas".into());
        }
        for node in expand_name(name)? {
            check_host(&node).map_err(|why| format!("gives node {node:?}, which {why}"))?;
            if !seen.insert(node.clone()) {
                return Err(format!("lists node {node:?} twice; list each node once"));
            }
            nodes.push(node);
            if nodes.len() > MAX_NODES {
                return Err(format!("has more than {MAX_NODES} nodes"));
            }
        }
    }
    Ok(nodes)
}

/// Expands one name of a node list (no top-level commas): the product of its bracket groups.
fn expand_name(name: &str) -> std::result::Result<Vec<String>, String> {
    let mut out = vec![String::new()];
    let mut rest = name;
    while !rest.is_empty() {
        let (literal, group) = match rest.find('[') {
            None => (rest, None),
            Some(open) => {
                // The caller checked that every '[' is closed, without nesting.
                let close = rest[open..].find(']').map(|c| open + c).ok_or("has an unclosed '['")?;
                (&rest[..open], Some((&rest[open + 1..close], close)))
            }
        };
        if let Some(c) = literal.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))) {
            return Err(format!("has {c:?} in node name {name:?}; node names are letters, digits, '-', '_' and '.'"));
        }
        for prefix in &mut out {
            prefix.push_str(literal);
        }
        match group {
            None => rest = "",
            Some((inner, close)) => {
                let values = expand_group(inner, name)?;
                if out.len().saturating_mul(values.len()) > MAX_NODES {
                    return Err(format!("has more than {MAX_NODES} nodes"));
                }
                out = out.iter().flat_map(|prefix| values.iter().map(move |v| format!("{prefix}{v}"))).collect();
                rest = &rest[close + 1..];
            }
        }
    }
    Ok(out)
}

/// Expands the inside of one bracket group, `01-04,07`, keeping zero padding.
fn expand_group(inner: &str, name: &str) -> std::result::Result<Vec<String>, String> {
    if inner.is_empty() {
        return Err(format!("has empty brackets in {name:?}; write a range such as [1-4]"));
    }
    let mut values = Vec::new();
    for item in inner.split(',') {
        let (lo, hi) = item.split_once('-').unwrap_or((item, item));
        let digits = |s: &str| !s.is_empty() && s.len() <= 18 && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(lo) || !digits(hi) {
            return Err(format!(
                "has {item:?} in the brackets of {name:?}, which is not a number or a low-high range such as 01-04"
            ));
        }
        // At most 18 digits: these parse.
        let (a, b) = (lo.parse::<u64>().unwrap_or(0), hi.parse::<u64>().unwrap_or(0));
        if a > b {
            return Err(format!("has the descending range {item:?} in {name:?}; write it low-high, e.g. {hi}-{lo}"));
        }
        if (b - a) as usize >= MAX_NODES || values.len() + (b - a) as usize >= MAX_NODES {
            return Err(format!("has more than {MAX_NODES} nodes"));
        }
        let width = lo.len();
        values.extend((a..=b).map(|v| format!("{v:0width$}")));
    }
    Ok(values)
}

/// Parses Slurm's tasks per node, `2(x3),1` (2 tasks on each of 3 nodes, then 1), into one
/// count per node; `max_nodes` bounds the expansion. The error completes a sentence starting
/// with the value.
fn parse_tasks_per_node(value: &str, max_nodes: usize) -> std::result::Result<Vec<usize>, String> {
    let mut counts = Vec::new();
    for item in value.split(',') {
        let item = item.trim();
        let bad = || format!("has {item:?}, which is not N or N(xM) (N tasks on each of M nodes)");
        let (count, repeat) = match item.split_once('(') {
            None => (item, "1"),
            Some((count, rest)) => {
                let repeat = rest.strip_prefix('x').and_then(|r| r.strip_suffix(')')).ok_or_else(bad)?;
                (count, repeat)
            }
        };
        let is_num = |s: &str| !s.is_empty() && s.len() <= 9 && s.bytes().all(|b| b.is_ascii_digit());
        if !is_num(count) || !is_num(repeat) {
            return Err(bad());
        }
        let (count, repeat) = (count.parse::<usize>().unwrap_or(0), repeat.parse::<usize>().unwrap_or(0));
        if repeat == 0 {
            return Err(format!("has {item:?}, which repeats over 0 nodes; use (x1) or more"));
        }
        if counts.len() + repeat > max_nodes {
            return Err(format!("describes more nodes than the node list's {max_nodes}; the two must agree"));
        }
        counts.extend(std::iter::repeat_n(count, repeat));
    }
    Ok(counts)
}

/// Parses a variable's non-negative integer value; the error names the variable.
fn number(var: &str, value: &str) -> std::result::Result<usize, String> {
    value
        .parse::<usize>()
        .map_err(|_| format!("{var} {value:?} is not a non-negative integer; srun sets it to a number"))
}
