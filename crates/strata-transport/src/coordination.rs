//! The coordination service of a multi-worker job (served by the chief; every task is a
//! client): rendezvous, heartbeats, barriers, error propagation and a key-value store.
//!
//! - **Rendezvous.** Each task registers with its cluster fingerprint, its strategy
//!   fingerprint and its data-plane address. A task whose fingerprints differ from the chief's
//!   is refused (`FAILED_PRECONDITION`, naming both); registration returns, once every task is
//!   in, every task's data-plane address in rank order.
//! - **Refusals.** A task refused at registration for its cluster or strategy fingerprint (it
//!   presented the token, so it is one of the job's own tasks) fails the job at once, naming it
//!   and the difference; every task waiting in the rendezvous hears it as a misconfiguration
//!   (`FAILED_PRECONDITION`, the refused task's own code), not as an aborted job. A call refused for its *token* never reaches the service; the token
//!   check records it under the task name the caller claims (`x-strata-task`), in one slot per
//!   task of the job. Such a record is never trusted to fail a job on its own (anyone who can
//!   reach the port can claim any name): it only ends a rendezvous early when every other task
//!   has registered, the claimed task has not, and neither changed for
//!   [`CoordinationConfig::refusal_grace`]; the error then says which task was refused, why,
//!   and from which address. The rendezvous would otherwise wait its whole timeout for a task
//!   that already gave up, so the worst an impostor without the token can do is end a
//!   rendezvous early whose real task is more than that grace late.
//! - **Heartbeats.** Every task calls `Heartbeat` in a loop with the collective it is in; the
//!   service holds each answer for up to [`CoordinationConfig::heartbeat_interval`] unless the
//!   job fails meanwhile (a long poll), so every task hears of a failure the moment it is
//!   declared, not at its next heartbeat. The service marks a task whose heartbeats stop
//!   arriving for [`CoordinationConfig::heartbeat_timeout`] as lost ("lost task worker:1: no
//!   heartbeat for 3.0 s, last seen in all_reduce(sum) #57"); a task whose heartbeats go
//!   unanswered for as long concludes that the task serving the service is lost. Both sides
//!   measure from the last heartbeat that crossed, so a task that is killed, stopped
//!   (SIGSTOP) or cut off is declared lost by everyone within the timeout, whichever task it
//!   is. Heartbeat calls have deadlines that end when the timeout does: a stopped peer's TCP
//!   connection stays open and would never answer. A task that was itself stopped while it
//!   waited (its timers then fire late, all at once) asks once more before it concludes the
//!   service lost: the silence was its own, and a member the job fenced meanwhile hears so.
//! - **No shutdown waits on a lost task.** Reports to a lost service are skipped, and a service
//!   whose job failed stops as soon as every surviving task has heard why (at most
//!   [`LINGER`]), without the graceful HTTP/2 shutdown that waits for every client's
//!   acknowledgement.
//! - **Agreed collective order.** Every collective has a sequence number that every task counts
//!   the same way; the data plane checks it in every frame, and the heartbeats record it here so
//!   that a timeout or a loss names what each task was doing.
//! - **Key-value store.** Set once, read with a wait (the NCCL unique id travels this way).
//! - **Bounded requests.** Every name, string and count a request brings is checked against a
//!   limit ([`MAX_KEY_BYTES`], [`MAX_KV_BYTES`], [`MAX_KEYS`], [`MAX_BARRIERS`],
//!   [`MAX_ERROR_BYTES`], [`MAX_FINGERPRINT_BYTES`], [`MAX_TASK_TYPE_BYTES`],
//!   [`MAX_REQUEST_BYTES`]) before it is used; a request over one is `INVALID_ARGUMENT` naming
//!   the limit, and so is one that does not decode.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use strata_proto::v1::coordination_client::CoordinationClient;
use strata_proto::v1::coordination_server::{Coordination, CoordinationServer};
use strata_proto::v1::{
    BarrierRequest, BarrierResponse, Empty, GetKeyRequest, GetKeyResponse, HeartbeatRequest, HeartbeatResponse,
    JoinRequest, JoinResponse, LeaveRequest, RegisterRequest, RegisterResponse, ReportErrorRequest, SetKeyRequest,
    TaskName,
};
use tokio::sync::Notify;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

use crate::auth::{client_interceptor_as, server_interceptor_recording, ClientAuth, ClusterToken, Refusal};
use crate::guard::DecodeErrors;
use crate::lifecycle::ServerTask;
use crate::rt::runtime;
use crate::{Error, Result};

/// The largest value the key-value store accepts.
pub const MAX_KV_BYTES: usize = 64 * 1024;

/// The longest key of the key-value store and the longest barrier name, in bytes.
pub const MAX_KEY_BYTES: usize = 256;

/// The most keys the key-value store holds.
pub const MAX_KEYS: usize = 1024;

/// The most distinct barriers a job enters.
pub const MAX_BARRIERS: usize = 1024;

/// The longest error a task reports, in bytes ([`CoordinationMember::report_error`] cuts
/// longer ones to this).
pub const MAX_ERROR_BYTES: usize = 4096;

/// The longest cluster or strategy fingerprint, in bytes.
pub const MAX_FINGERPRINT_BYTES: usize = 64 * 1024;

/// The longest task type (`chief`, `worker`, ...), in bytes.
pub const MAX_TASK_TYPE_BYTES: usize = 32;

/// The largest request message the service decodes: a value of the key-value store, or two
/// fingerprints, and their framing.
pub const MAX_REQUEST_BYTES: usize = 2 * MAX_FINGERPRINT_BYTES + 4096;

/// A refusal of a request over a limit.
fn over_limit(what: &str, bytes: usize, limit: usize) -> Status {
    Status::invalid_argument(format!("{what} of {bytes} bytes is over the limit of {limit} bytes"))
}

/// The sizes a registration or a join brings: two fingerprints and a data address.
fn check_sizes(cluster: &str, strategy: &str, data_address: &str) -> std::result::Result<(), Status> {
    for (what, f) in [("a cluster fingerprint", cluster), ("a strategy fingerprint", strategy)] {
        if f.len() > MAX_FINGERPRINT_BYTES {
            return Err(over_limit(what, f.len(), MAX_FINGERPRINT_BYTES));
        }
    }
    if data_address.len() > 512 {
        return Err(over_limit("a data address", data_address.len(), 512));
    }
    Ok(())
}

/// `s` cut to at most `max` bytes, at a character boundary.
fn truncated(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// How much longer than it should a heartbeat's attempt must have taken for the member to
/// conclude that its own process was stopped meanwhile (its timers fire late, all at once).
const STALL: Duration = Duration::from_secs(1);

/// The longest the service holds a heartbeat's answer.
const MAX_HEARTBEAT_WAIT: Duration = Duration::from_secs(5);

/// How long a service whose job failed keeps answering, at most, so that every surviving task
/// hears why before it stops.
pub const LINGER: Duration = Duration::from_secs(1);

/// The deadline of a report of this task's own failure: the job fails anyway when the report
/// does not arrive (this task's heartbeats stop), so it never waits long on a lost service.
const REPORT_DEADLINE: Duration = Duration::from_secs(2);

/// Timing of the coordination service.
#[derive(Clone, Debug)]
pub struct CoordinationConfig {
    /// How long registration waits for every task (default 120 s).
    pub rendezvous_timeout: Duration,
    /// How often each task's heartbeat reaches the service (default 500 ms): the service holds
    /// each answer this long unless the job fails.
    pub heartbeat_interval: Duration,
    /// How long a task may stay silent before it is declared lost, and how long the service may
    /// leave heartbeats unanswered before a task declares it lost (default 3 s).
    pub heartbeat_timeout: Duration,
    /// The deadline of one RPC that does not wait for peers (default 10 s).
    pub rpc_timeout: Duration,
    /// Where the cluster comes from, as the service's messages name it (`"TF_CONFIG"`,
    /// `"Slurm's job step"`; default `"the cluster spec"`).
    pub cluster_source: &'static str,
    /// How long a rendezvous waits, once every task but those refused for their token has
    /// registered, before it fails naming the refused ones (default 2 s; see the module's
    /// documentation for why it waits at all).
    pub refusal_grace: Duration,
    /// Elastic jobs: how long the first generation waits for more tasks once the fewest it
    /// may start with have joined (default 10 s; it forms at once when every task is in).
    pub join_window: Duration,
}

impl Default for CoordinationConfig {
    fn default() -> Self {
        Self {
            rendezvous_timeout: Duration::from_secs(120),
            heartbeat_interval: Duration::from_millis(500),
            heartbeat_timeout: Duration::from_secs(3),
            rpc_timeout: Duration::from_secs(10),
            cluster_source: "the cluster spec",
            refusal_grace: Duration::from_secs(2),
            join_window: Duration::from_secs(10),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn task_string(t: &Option<TaskName>) -> String {
    match t {
        Some(t) => format!("{}:{}", t.r#type, t.index),
        None => "<unnamed task>".into(),
    }
}

fn task_proto(name: &str) -> TaskName {
    let (kind, index) = name.split_once(':').unwrap_or((name, "0"));
    TaskName { r#type: kind.to_string(), index: index.parse().unwrap_or(0) }
}

#[derive(Debug, Default)]
struct TaskState {
    incarnation: Option<u64>,
    data_address: String,
    last_seen: Option<Instant>,
    left: bool,
    collective: String,
    seq: u64,
    /// Declared lost (its heartbeats stopped).
    lost: bool,
    /// Was answered with the job's error.
    told: bool,
    /// The last call refused for its token that claimed to be this task.
    refused: Option<RefusedCall>,
    /// Elastic jobs: the process (incarnation) declared lost or replaced, and why; it is
    /// refused from then on.
    fenced: Option<(u64, String)>,
    /// Left on request: the stop's code, and whether the job went on without the task.
    stop: Option<(u32, bool)>,
}

/// A call refused for its token, recorded under the task it claimed to be.
#[derive(Clone, Copy, Debug)]
struct RefusedCall {
    why: Refusal,
    peer: Option<SocketAddr>,
    at: Instant,
    count: u64,
}

#[derive(Debug)]
struct JobState {
    tasks: Vec<TaskState>,
    rendezvous_done: bool,
    /// When the last task registered (the rendezvous' progress).
    last_registered: Instant,
    error: Option<String>,
    /// The job failed because a task was refused at registration (its cluster or strategy
    /// differs from the chief's): every waiting task hears it as a misconfiguration.
    misconfigured: bool,
    barriers: HashMap<String, HashSet<usize>>,
    kv: HashMap<String, Vec<u8>>,
    /// Refused calls that claimed no task of this job.
    refused_unnamed: u64,
    /// Elastic jobs: the membership.
    members: Membership,
}

/// The membership of an elastic job: its generations.
#[derive(Debug, Default)]
struct Membership {
    /// The current generation (0: none formed yet).
    generation: u64,
    /// Its members, by task index, ascending (their ranks).
    members: Vec<usize>,
    /// Whether the next generation is forming (a member was lost or abandoned its step).
    forming: bool,
    /// The tasks that called `Join` for the next generation: members and waiting tasks.
    joined: BTreeSet<usize>,
    /// When the last task joined (the first generation's window counts from it).
    last_join: Option<Instant>,
    /// The fingerprints the first task joined with; every other must match them.
    cluster_fingerprint: Option<String>,
    strategy_fingerprint: Option<String>,
    /// Why each lost task was lost, for the error when too few remain.
    lost: Vec<String>,
}

impl Membership {
    /// Tasks that joined but are not members: they wait for a step boundary.
    fn waiting(&self) -> usize {
        self.joined.iter().filter(|t| !self.members.contains(t)).count()
    }
}
#[derive(Debug)]
struct Service {
    /// Elastic jobs: the fewest tasks the job runs with.
    min_tasks: Option<usize>,
    names: Vec<String>,
    cluster_fingerprint: String,
    strategy_fingerprint: String,
    config: CoordinationConfig,
    state: Mutex<JobState>,
    changed: Notify,
}

impl Service {
    fn rank(&self, task: &Option<TaskName>) -> std::result::Result<usize, Status> {
        if let Some(t) = task.as_ref().filter(|t| t.r#type.len() > MAX_TASK_TYPE_BYTES) {
            return Err(over_limit("a task type", t.r#type.len(), MAX_TASK_TYPE_BYTES));
        }
        let name = task_string(task);
        self.names.iter().position(|n| *n == name).ok_or_else(|| {
            Status::not_found(format!(
                "task {name} is not in this job (its tasks are {}); check this task's place in {}",
                self.names.join(", "),
                self.config.cluster_source
            ))
        })
    }

    fn fail(&self, st: &mut JobState, message: String) {
        if st.error.is_none() {
            tracing::error!(%message, "the job failed");
            st.error = Some(message);
        }
        self.changed.notify_waiters();
    }

    /// Declares tasks lost whose heartbeats stopped; ends a rendezvous that waits only for
    /// tasks refused for their token.
    fn check_liveness(&self) {
        let mut st = lock(&self.state);
        if st.error.is_some() {
            return;
        }
        if self.min_tasks.is_some() {
            self.check_members(&mut st);
            return;
        }
        if !st.rendezvous_done {
            if let Some(m) = self.refused_rendezvous(&st) {
                self.fail(&mut st, m);
            }
            return;
        }
        let now = Instant::now();
        let mut lost = Vec::new();
        for (i, t) in st.tasks.iter_mut().enumerate() {
            let Some(seen) = t.last_seen else { continue };
            let silent = now.duration_since(seen);
            if t.left || silent <= self.config.heartbeat_timeout {
                continue;
            }
            t.lost = true;
            // The collective's number stays in the log: an error names one counter, the
            // training step of whoever reports it.
            tracing::warn!(task = %self.names[i], collective = %t.collective, seq = t.seq, "a task stopped sending heartbeats");
            let doing = if !t.collective.is_empty() {
                format!(", last seen in {}", t.collective)
            } else if t.seq == 0 {
                ", its last heartbeat came before its first collective".to_string()
            } else {
                String::new()
            };
            lost.push(format!("lost task {}: no heartbeat for {:.1} s{doing}", self.names[i], silent.as_secs_f64()));
        }
        if !lost.is_empty() {
            self.fail(&mut st, lost.join("; "));
        }
    }

    /// The rendezvous' error when every task that has not registered was refused for its token
    /// and nothing changed for the grace period (see the module documentation).
    fn refused_rendezvous(&self, st: &JobState) -> Option<String> {
        let missing: Vec<usize> = (0..st.tasks.len()).filter(|&i| st.tasks[i].incarnation.is_none()).collect();
        let refused: Vec<RefusedCall> = missing.iter().map(|&i| st.tasks[i].refused).collect::<Option<_>>()?;
        let latest = refused.iter().map(|r| r.at).chain([st.last_registered]).max()?;
        if missing.is_empty() || latest.elapsed() < self.config.refusal_grace {
            return None;
        }
        Some(format!(
            "rendezvous failed: {}; give every task the same cluster token ({})",
            self.refusals(st, &missing).join("; "),
            crate::auth::TOKEN_ENV
        ))
    }

    /// Elastic jobs: declares silent tasks lost (fenced: their process is refused from now
    /// on), starts forming the next generation when a member is among them, fails the job when
    /// fewer tasks than its minimum remain, and forms a generation when it is complete.
    fn check_members(&self, st: &mut JobState) {
        let now = Instant::now();
        let mut changed = false;
        for i in 0..st.tasks.len() {
            let t = &mut st.tasks[i];
            let (Some(seen), Some(inc)) = (t.last_seen, t.incarnation) else { continue };
            let silent = now.duration_since(seen);
            if t.left || t.lost || silent <= self.config.heartbeat_timeout {
                continue;
            }
            t.lost = true;
            let doing =
                if t.collective.is_empty() { String::new() } else { format!(", last seen in {}", t.collective) };
            let why = format!("no heartbeat for {:.1} s{doing}", silent.as_secs_f64());
            tracing::warn!(task = %self.names[i], %why, "a task of the elastic job was lost");
            t.fenced = Some((inc, format!("was declared lost ({why})")));
            let m = &mut st.members;
            m.joined.remove(&i);
            if m.members.contains(&i) {
                m.forming = true;
            }
            m.lost.push(format!("{} ({why})", self.names[i]));
            changed = true;
        }
        self.try_form(st);
        if changed {
            self.changed.notify_waiters();
        }
    }

    /// Forms the next generation of an elastic job when it is complete: the first once every
    /// task joined (or the fewest it may start with, and no other for the join window); a
    /// later one once every live member joined again (tasks waiting to join come with it).
    fn try_form(&self, st: &mut JobState) {
        let Some(min) = self.min_tasks else { return };
        if st.error.is_some() {
            return;
        }
        let m = &st.members;
        let live = |i: &usize| !st.tasks[*i].lost && !st.tasks[*i].left;
        if m.generation > 0 && m.forming {
            let remaining = m.members.iter().filter(|i| live(i)).count() + m.waiting();
            if remaining < min {
                let message = format!(
                    "{remaining} of the job's workers remain, fewer than the {min} it needs: lost {}; start more workers or lower the job's minimum",
                    m.lost.join(", ")
                );
                self.fail(st, message);
                return;
            }
        }
        let complete = if m.generation == 0 {
            m.joined.len() == self.names.len()
                || (m.joined.len() >= min && m.last_join.is_some_and(|t| t.elapsed() >= self.config.join_window))
        } else {
            m.forming && m.members.iter().filter(|i| live(i)).all(|i| m.joined.contains(i))
        };
        if !complete || m.joined.is_empty() {
            return;
        }
        let now = Instant::now();
        let m = &mut st.members;
        m.generation += 1;
        m.members = std::mem::take(&mut m.joined).into_iter().collect();
        m.forming = false;
        let members = m.members.clone();
        for &i in &members {
            st.tasks[i].last_seen = Some(now);
        }
        tracing::info!(
            generation = st.members.generation,
            members = %members.iter().map(|&i| self.names[i].as_str()).collect::<Vec<_>>().join(","),
            "a generation formed"
        );
        self.changed.notify_waiters();
    }

    /// "worker:1 was refused: wrong cluster token (3 calls, the last from 10.0.0.2:4711)" for
    /// each of `tasks` that has a record.
    fn refusals(&self, st: &JobState, tasks: &[usize]) -> Vec<String> {
        tasks
            .iter()
            .filter_map(|&i| {
                let r = st.tasks[i].refused?;
                let from = r.peer.map(|p| format!(", the last from {p}")).unwrap_or_default();
                let calls = if r.count == 1 { "1 call".to_string() } else { format!("{} calls", r.count) };
                Some(format!("{} was refused: {} ({calls}{from})", self.names[i], r.why))
            })
            .collect()
    }

    /// Records a call the token check refused (bounded: one slot per task of the job).
    fn record_refusal(&self, claimed: &str, peer: Option<SocketAddr>, why: Refusal) {
        let mut st = lock(&self.state);
        let Some(i) = self.names.iter().position(|n| n == claimed) else {
            st.refused_unnamed += 1;
            if st.refused_unnamed.is_power_of_two() {
                tracing::warn!(?peer, %why, count = st.refused_unnamed, "refused calls that name no task of this job");
            }
            return;
        };
        let count = st.tasks[i].refused.map_or(0, |r| r.count) + 1;
        st.tasks[i].refused = Some(RefusedCall { why, peer, at: Instant::now(), count });
        if count.is_power_of_two() {
            tracing::warn!(task = %self.names[i], ?peer, %why, count, "refused a call that claims to be a task of this job");
        }
    }

    /// Fails the job when an authenticated task was refused at registration: it is one of the
    /// job's own tasks, misconfigured, and the rendezvous cannot complete without it.
    fn refuse(&self, status: Status) -> Status {
        let mut st = lock(&self.state);
        if !st.rendezvous_done && st.error.is_none() {
            // Every task prints it as its one-line error: no log line of the service's beside it.
            tracing::info!(why = %status.message(), "a task was refused at the rendezvous; the job fails");
            st.error = Some(format!("rendezvous failed: {}", status.message()));
            st.misconfigured = true;
            self.changed.notify_waiters();
        }
        status
    }

    /// The status a task hears when the job failed with `e`: a misconfiguration
    /// (`FAILED_PRECONDITION`) where a task was refused at registration, else `ABORTED`.
    fn failed(st: &JobState, e: &str) -> Status {
        if st.misconfigured {
            Status::failed_precondition(e.to_string())
        } else {
            Status::aborted(e.to_string())
        }
    }

    /// Marks `rank` as told of the job's error.
    fn told(&self, rank: usize) {
        if let Some(t) = lock(&self.state).tasks.get_mut(rank) {
            t.told = true;
        }
    }

    /// An elastic job's heartbeat: a fenced process is told so (it stops); a member hears the
    /// generation, whether the next one is forming and how many tasks wait to join, and the
    /// answer comes early when any of those changes.
    async fn elastic_heartbeat(
        &self,
        rank: usize,
        r: &HeartbeatRequest,
    ) -> std::result::Result<HeartbeatResponse, Status> {
        let view = |st: &JobState| (st.members.generation, st.members.forming, st.members.waiting() as u32);
        let answer = |st: &mut JobState| -> Option<HeartbeatResponse> {
            if let Some(e) = st.error.clone() {
                st.tasks[rank].told = true;
                return Some(HeartbeatResponse { error: e, ..Default::default() });
            }
            if let Some((_, why)) = st.tasks[rank].fenced.as_ref().filter(|(inc, _)| *inc == r.incarnation) {
                return Some(HeartbeatResponse {
                    error: self.fenced_message(rank, why, st.members.generation),
                    ..Default::default()
                });
            }
            None
        };
        let start = {
            let mut st = lock(&self.state);
            if let Some(a) = answer(&mut st) {
                return Ok(a);
            }
            let t = &mut st.tasks[rank];
            if t.incarnation == Some(r.incarnation) {
                t.last_seen = Some(Instant::now());
                t.seq = r.collective_seq;
                t.collective = r.collective.chars().take(200).collect();
            }
            view(&st)
        };
        let wait = Duration::from_millis(r.wait_ms).min(MAX_HEARTBEAT_WAIT);
        let early = self
            .wait_until(Instant::now() + wait, |st| {
                answer(st).or_else(|| (view(st) != start).then(HeartbeatResponse::default)).map(Ok)
            })
            .await
            .ok()
            .filter(|a| !a.error.is_empty());
        if let Some(a) = early {
            self.told(rank);
            return Ok(a);
        }
        let st = lock(&self.state);
        let (generation, forming, waiting) = view(&st);
        Ok(HeartbeatResponse { error: String::new(), generation, forming, waiting })
    }

    /// What a fenced process is told: why, and that it stops.
    fn fenced_message(&self, rank: usize, why: &str, generation: u64) -> String {
        format!(
            "task {} {why}, and the job went on without it (generation {generation}); this process stops: start a new one to join the job again",
            self.names[rank]
        )
    }

    async fn wait_until<T>(
        &self,
        deadline: Instant,
        mut ready: impl FnMut(&mut JobState) -> Option<std::result::Result<T, Status>>,
    ) -> std::result::Result<T, Status> {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(r) = ready(&mut lock(&self.state)) {
                return r;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Status::deadline_exceeded(String::new()));
            }
            // Wake at least every 100 ms: liveness is checked by time, not by events.
            let _ = tokio::time::timeout((deadline - now).min(Duration::from_millis(100)), notified).await;
        }
    }
}

/// The service object tonic serves (a handle on the shared state).
#[derive(Clone, Debug)]
struct Svc(Arc<Service>);

impl std::ops::Deref for Svc {
    type Target = Service;
    fn deref(&self) -> &Service {
        &self.0
    }
}

#[tonic::async_trait]
impl Coordination for Svc {
    async fn register(&self, req: Request<RegisterRequest>) -> std::result::Result<Response<RegisterResponse>, Status> {
        let r = req.into_inner();
        // A request over a limit or without a task is malformed, not a misconfigured task of
        // the job: refused without failing the rendezvous. A well-formed refusal fails it.
        check_sizes(&r.cluster_fingerprint, &r.strategy_fingerprint, &r.data_address)?;
        if r.task.as_ref().is_none_or(|t| t.r#type.is_empty()) {
            return Err(Status::invalid_argument(format!(
                "a registration that names no task; give this task its place in {}",
                self.config.cluster_source
            )));
        }
        if let Some(min) = self.min_tasks {
            return Err(Status::failed_precondition(format!(
                "this coordination service runs an elastic job (at least {min} workers): a task joins it with Join; run every task with the same elastic setting"
            )));
        }
        let rank =
            self.rank(&r.task).map_err(|s| if s.code() == Code::InvalidArgument { s } else { self.refuse(s) })?;
        let name = &self.names[rank];
        if r.cluster_fingerprint != self.cluster_fingerprint {
            return Err(self.refuse(Status::failed_precondition(format!(
                "task {name} runs cluster [{}] but the chief runs [{}]; give every task the same cluster ({})",
                r.cluster_fingerprint, self.cluster_fingerprint, self.config.cluster_source
            ))));
        }
        if r.strategy_fingerprint != self.strategy_fingerprint {
            return Err(self.refuse(Status::failed_precondition(format!(
                "task {name} runs strategy [{}] but the chief runs [{}]; run the same program and flags on every task",
                r.strategy_fingerprint, self.strategy_fingerprint
            ))));
        }
        if r.data_address.parse::<SocketAddr>().is_err() && !r.data_address.contains(':') {
            return Err(self.refuse(Status::invalid_argument(format!("task {name} sent a malformed data address"))));
        }
        {
            let mut st = lock(&self.state);
            if let Some(e) = &st.error {
                return Err(Service::failed(&st, e));
            }
            match st.tasks[rank].incarnation {
                Some(inc) if inc != r.incarnation => {
                    let m = format!(
                        "task {name} registered twice (a restarted process, or two processes given the same task by {}); relaunch the whole job",
                        self.config.cluster_source
                    );
                    self.fail(&mut st, m.clone());
                    return Err(Status::already_exists(m));
                }
                _ => {}
            }
            let t = &mut st.tasks[rank];
            t.incarnation = Some(r.incarnation);
            t.data_address = r.data_address;
            t.last_seen = Some(Instant::now());
            st.last_registered = Instant::now();
            if st.tasks.iter().all(|t| t.incarnation.is_some()) && !st.rendezvous_done {
                st.rendezvous_done = true;
                let now = Instant::now();
                for t in &mut st.tasks {
                    t.last_seen = Some(now);
                }
                tracing::info!(tasks = self.names.len(), "every task registered");
            }
            self.changed.notify_waiters();
        }
        let deadline = Instant::now() + self.config.rendezvous_timeout;
        let names = self.names.clone();
        let result = self
            .wait_until(deadline, |st| {
                if let Some(e) = st.error.clone() {
                    st.tasks[rank].told = true;
                    return Some(Err(Service::failed(st, &e)));
                }
                st.rendezvous_done.then(|| {
                    Ok(RegisterResponse {
                        rank: rank as u32,
                        num_tasks: names.len() as u32,
                        data_addresses: st.tasks.iter().map(|t| t.data_address.clone()).collect(),
                        task_names: names.clone(),
                    })
                })
            })
            .await;
        match result {
            Err(s) if s.code() == Code::DeadlineExceeded => {
                let st = lock(&self.state);
                let missing: Vec<usize> = (0..st.tasks.len()).filter(|&i| st.tasks[i].incarnation.is_none()).collect();
                let names: Vec<&str> = missing.iter().map(|&i| self.names[i].as_str()).collect();
                let refused: String = self.refusals(&st, &missing).into_iter().map(|r| format!(" ({r})")).collect();
                Err(Status::deadline_exceeded(format!(
                    "rendezvous timed out after {:?}: {} never registered{refused}; start every task of the cluster ({})",
                    self.config.rendezvous_timeout,
                    names.join(", "),
                    self.config.cluster_source
                )))
            }
            other => other.map(Response::new),
        }
    }

    async fn join(&self, req: Request<JoinRequest>) -> std::result::Result<Response<JoinResponse>, Status> {
        let r = req.into_inner();
        let Some(_) = self.min_tasks else {
            return Err(Status::failed_precondition(
                "this job is not elastic: its tasks register once; run every task with the same elastic setting",
            ));
        };
        check_sizes(&r.cluster_fingerprint, &r.strategy_fingerprint, &r.data_address)?;
        let rank = self.rank(&r.task)?;
        let name = self.names[rank].clone();
        if !r.data_address.contains(':') {
            return Err(Status::invalid_argument(format!("task {name} sent a malformed data address")));
        }
        let seen = {
            let mut st = lock(&self.state);
            if let Some(e) = &st.error {
                return Err(Status::aborted(e.clone()));
            }
            if let Some((_, why)) = st.tasks[rank].fenced.as_ref().filter(|(inc, _)| *inc == r.incarnation) {
                return Err(Status::aborted(self.fenced_message(rank, why, st.members.generation)));
            }
            // A task whose settings differ is refused; the running job is unharmed.
            let m = &mut st.members;
            for (what, mine, job, hint) in [
                ("cluster", &r.cluster_fingerprint, &mut m.cluster_fingerprint, self.config.cluster_source),
                (
                    "strategy",
                    &r.strategy_fingerprint,
                    &mut m.strategy_fingerprint,
                    "the program and flags of the others",
                ),
            ] {
                match job {
                    Some(j) if j != mine => {
                        return Err(Status::failed_precondition(format!(
                            "task {name} runs {what} [{mine}] but the job runs [{j}]; give it the same {what} ({hint})"
                        )))
                    }
                    Some(_) => {}
                    None => *job = Some(mine.clone()),
                }
            }
            let (generation, member) = (m.generation, m.members.contains(&rank));
            if r.generation != 0 && (r.generation != generation || !member) {
                return Err(Status::aborted(format!(
                    "task {name} was a member of generation {} but the job is at generation {generation} without it; this process stops: start a new one to join the job again",
                    r.generation
                )));
            }
            let t = &mut st.tasks[rank];
            if let Some(old) = t.incarnation.filter(|&old| old != r.incarnation && member) {
                // A new process of a member (restarted before it was declared lost): the old
                // one is fenced, and the members form a generation with the new one.
                t.fenced = Some((old, "was replaced by a new process of the same task".into()));
                st.members.forming = true;
            }
            let t = &mut st.tasks[rank];
            t.incarnation = Some(r.incarnation);
            t.data_address = r.data_address;
            t.last_seen = Some(Instant::now());
            t.lost = false;
            t.left = false;
            let m = &mut st.members;
            m.joined.insert(rank);
            m.last_join = Some(Instant::now());
            if r.generation != 0 && member {
                // A member left its step (it failed, or the members agreed to admit waiting
                // tasks): the next generation forms.
                m.forming = true;
            }
            self.try_form(&mut st);
            self.changed.notify_waiters();
            generation
        };
        let deadline = Instant::now() + self.config.rendezvous_timeout;
        let incarnation = r.incarnation;
        let result = self
            .wait_until(deadline, |st| {
                if let Some(e) = &st.error {
                    st.tasks[rank].told = true;
                    return Some(Err(Status::aborted(e.clone())));
                }
                if let Some((_, why)) = st.tasks[rank].fenced.as_ref().filter(|(inc, _)| *inc == incarnation) {
                    return Some(Err(Status::aborted(self.fenced_message(rank, why, st.members.generation))));
                }
                let m = &st.members;
                if m.generation > 0 && !m.members.is_empty() && m.members.iter().all(|&i| st.tasks[i].left) {
                    // The job ended while this task waited to join it.
                    return Some(Err(Status::aborted(format!(
                        "the job finished (generation {}) before task {} could join it",
                        m.generation, self.names[rank]
                    ))));
                }
                (m.generation > seen && m.members.contains(&rank)).then(|| {
                    Ok(JoinResponse {
                        generation: m.generation,
                        rank: m.members.iter().position(|&i| i == rank).unwrap_or(0) as u32,
                        data_addresses: m.members.iter().map(|&i| st.tasks[i].data_address.clone()).collect(),
                        task_names: m.members.iter().map(|&i| self.names[i].clone()).collect(),
                        resumed: m.generation > 1,
                    })
                })
            })
            .await;
        match result {
            Err(s) if s.code() == Code::DeadlineExceeded => Err(Status::deadline_exceeded(format!(
                "task {name} waited {:?} to join the job, and no generation formed with it; start at least the job's minimum of workers ({})",
                self.config.rendezvous_timeout, self.config.cluster_source
            ))),
            other => other.map(Response::new),
        }
    }

    async fn heartbeat(
        &self,
        req: Request<HeartbeatRequest>,
    ) -> std::result::Result<Response<HeartbeatResponse>, Status> {
        let r = req.into_inner();
        let rank = self.rank(&r.task)?;
        if self.min_tasks.is_some() {
            return self.elastic_heartbeat(rank, &r).await.map(Response::new);
        }
        {
            let mut st = lock(&self.state);
            if st.tasks[rank].incarnation.is_some_and(|i| i != r.incarnation) {
                let m = format!("task {} sent heartbeats from two processes; relaunch the whole job", self.names[rank]);
                self.fail(&mut st, m);
            }
            let t = &mut st.tasks[rank];
            t.last_seen = Some(Instant::now());
            t.seq = r.collective_seq;
            t.collective = r.collective.chars().take(200).collect();
            if let Some(e) = st.error.clone() {
                st.tasks[rank].told = true;
                return Ok(Response::new(HeartbeatResponse { error: e, ..Default::default() }));
            }
        }
        // A long poll: answer when the job fails, or once the wait is over.
        let wait = Duration::from_millis(r.wait_ms).min(MAX_HEARTBEAT_WAIT);
        let error = self.wait_until(Instant::now() + wait, |st| st.error.clone().map(Ok)).await.unwrap_or_default();
        if !error.is_empty() {
            self.told(rank);
        }
        Ok(Response::new(HeartbeatResponse { error, ..Default::default() }))
    }

    async fn barrier(&self, req: Request<BarrierRequest>) -> std::result::Result<Response<BarrierResponse>, Status> {
        let r = req.into_inner();
        let rank = self.rank(&r.task)?;
        if r.name.len() > MAX_KEY_BYTES {
            return Err(over_limit("a barrier name", r.name.len(), MAX_KEY_BYTES));
        }
        let n = self.names.len();
        {
            let mut st = lock(&self.state);
            if !st.barriers.contains_key(&r.name) && st.barriers.len() >= MAX_BARRIERS {
                return Err(Status::invalid_argument(format!(
                    "the job has entered {MAX_BARRIERS} barriers, the limit; reuse barrier names"
                )));
            }
            st.barriers.entry(r.name.clone()).or_default().insert(rank);
        }
        self.changed.notify_waiters();
        let timeout = Duration::from_millis(r.timeout_ms.clamp(1, 24 * 3600 * 1000));
        let name = r.name.clone();
        let elastic = self.min_tasks.is_some();
        let result = self
            .wait_until(Instant::now() + timeout, |st| {
                if let Some(e) = &st.error {
                    st.tasks[rank].told = true;
                    return Some(Err(Status::aborted(e.clone())));
                }
                // An elastic job's barrier waits for the current generation's members.
                let n = if elastic { st.members.members.len() } else { n };
                (st.barriers.get(&name).map_or(0, HashSet::len) >= n).then_some(Ok(BarrierResponse {}))
            })
            .await;
        match result {
            Err(s) if s.code() == Code::DeadlineExceeded => {
                let st = lock(&self.state);
                let arrived = st.barriers.get(&r.name).cloned().unwrap_or_default();
                let missing: Vec<&str> =
                    (0..n).filter(|i| !arrived.contains(i)).map(|i| self.names[i].as_str()).collect();
                Err(Status::deadline_exceeded(format!(
                    "barrier {:?} timed out after {timeout:?} waiting for {}",
                    r.name,
                    missing.join(", ")
                )))
            }
            other => other.map(Response::new),
        }
    }

    async fn report_error(&self, req: Request<ReportErrorRequest>) -> std::result::Result<Response<Empty>, Status> {
        let r = req.into_inner();
        let rank = self.rank(&r.task)?;
        if r.message.len() > MAX_ERROR_BYTES {
            return Err(over_limit("an error message", r.message.len(), MAX_ERROR_BYTES));
        }
        let message = r.message;
        let mut st = lock(&self.state);
        if self.min_tasks.is_some() {
            let t = &st.tasks[rank];
            let fenced = t.fenced.as_ref().is_some_and(|(inc, _)| *inc == r.incarnation);
            if fenced || t.incarnation != Some(r.incarnation) {
                // A process the job already went on without: its failure is not the job's.
                tracing::warn!(task = %self.names[rank], %message, "ignored the error of a process that is no longer a member");
                return Ok(Response::new(Empty {}));
            }
        }
        self.fail(&mut st, format!("task {} failed: {message}", self.names[rank]));
        Ok(Response::new(Empty {}))
    }

    async fn leave(&self, req: Request<LeaveRequest>) -> std::result::Result<Response<Empty>, Status> {
        let r = req.into_inner();
        let rank = self.rank(&r.task)?;
        let mut st = lock(&self.state);
        if self.min_tasks.is_some() && st.tasks[rank].incarnation.is_some_and(|i| i != r.incarnation) {
            // A fenced or replaced process: its leaving says nothing of the task's current one.
            return Ok(Response::new(Empty {}));
        }
        let t = &mut st.tasks[rank];
        t.left = true;
        if r.stop_code > 0 {
            t.stop = Some((r.stop_code, r.job_goes_on));
        }
        if r.job_goes_on && self.min_tasks.is_some() {
            // One member stops on request: the others form the next generation without it now,
            // not after its heartbeat timeout.
            tracing::info!(task = %self.names[rank], "a task left the elastic job on request; the others go on");
            let m = &mut st.members;
            m.joined.remove(&rank);
            if m.generation > 0 && m.members.contains(&rank) {
                m.forming = true;
            }
            self.try_form(&mut st);
        }
        self.changed.notify_waiters();
        Ok(Response::new(Empty {}))
    }

    async fn set_key(&self, req: Request<SetKeyRequest>) -> std::result::Result<Response<Empty>, Status> {
        let r = req.into_inner();
        if r.key.len() > MAX_KEY_BYTES {
            return Err(over_limit("a key", r.key.len(), MAX_KEY_BYTES));
        }
        if r.value.len() > MAX_KV_BYTES {
            return Err(over_limit("a value", r.value.len(), MAX_KV_BYTES));
        }
        let mut st = lock(&self.state);
        if !st.kv.contains_key(&r.key) && st.kv.len() >= MAX_KEYS {
            return Err(Status::invalid_argument(format!(
                "the key-value store holds {MAX_KEYS} keys, the limit; reuse keys"
            )));
        }
        match st.kv.get(&r.key) {
            Some(v) if *v != r.value => {
                return Err(Status::already_exists(format!("key {:?} is already set to another value", r.key)))
            }
            _ => {
                st.kv.insert(r.key, r.value);
            }
        }
        self.changed.notify_waiters();
        Ok(Response::new(Empty {}))
    }

    async fn get_key(&self, req: Request<GetKeyRequest>) -> std::result::Result<Response<GetKeyResponse>, Status> {
        let r = req.into_inner();
        if r.key.len() > MAX_KEY_BYTES {
            return Err(over_limit("a key", r.key.len(), MAX_KEY_BYTES));
        }
        let timeout = Duration::from_millis(r.timeout_ms.clamp(1, 24 * 3600 * 1000));
        let key = r.key.clone();
        self.wait_until(Instant::now() + timeout, |st| {
            if let Some(e) = &st.error {
                return Some(Err(Status::aborted(e.clone())));
            }
            st.kv.get(&key).map(|v| Ok(GetKeyResponse { value: v.clone() }))
        })
        .await
        .map_err(|s| {
            if s.code() == Code::DeadlineExceeded {
                Status::deadline_exceeded(format!("key {:?} was not set within {timeout:?}", r.key))
            } else {
                s
            }
        })
        .map(Response::new)
    }
}

/// A running coordination service (held by the chief).
#[derive(Debug)]
pub struct CoordinationServerHandle {
    service: Arc<Service>,
    address: SocketAddr,
    server: ServerTask,
}

/// Refuses an elastic job of `workers` workers whose minimum `min` is outside 1 to `workers`:
/// [`CoordinationServerHandle::start_elastic`] calls it, and so does a program that takes the
/// minimum from its user (`strata train --min-workers`) before anything starts.
pub fn check_min_workers(min: usize, workers: usize) -> Result<()> {
    if min == 0 || min > workers {
        return Err(Error::MinWorkers { min, workers });
    }
    Ok(())
}

impl CoordinationServerHandle {
    /// Starts the service on `bind` (port 0 picks a free one) for the tasks `names` (in rank
    /// order), admitting only calls with `token`.
    pub fn start(
        bind: SocketAddr,
        names: Vec<String>,
        cluster_fingerprint: String,
        strategy_fingerprint: String,
        token: ClusterToken,
        config: CoordinationConfig,
    ) -> Result<Self> {
        Self::start_inner(bind, names, cluster_fingerprint, strategy_fingerprint, token, config, None)
    }

    /// Starts the service of an elastic job on `bind` for the tasks `names` (the most the job
    /// runs with), which runs while at least `min_tasks` of them live: tasks join with
    /// [`CoordinationMember::join`], a lost one is fenced and the others form the next
    /// generation without it, a task that starts later joins at the next step boundary. The
    /// cluster and strategy fingerprints are the first joiner's. Serve it from a process that
    /// outlives any one worker (`strata launch` does).
    pub fn start_elastic(
        bind: SocketAddr,
        names: Vec<String>,
        min_tasks: usize,
        token: ClusterToken,
        config: CoordinationConfig,
    ) -> Result<Self> {
        check_min_workers(min_tasks, names.len())?;
        Self::start_inner(bind, names, String::new(), String::new(), token, config, Some(min_tasks))
    }

    fn start_inner(
        bind: SocketAddr,
        names: Vec<String>,
        cluster_fingerprint: String,
        strategy_fingerprint: String,
        token: ClusterToken,
        config: CoordinationConfig,
        min_tasks: Option<usize>,
    ) -> Result<Self> {
        if names.is_empty() {
            return Err(Error::Config("a coordination service needs at least one task".into()));
        }
        let state = JobState {
            tasks: names.iter().map(|_| TaskState::default()).collect(),
            rendezvous_done: false,
            last_registered: Instant::now(),
            error: None,
            misconfigured: false,
            barriers: HashMap::new(),
            kv: HashMap::new(),
            refused_unnamed: 0,
            members: Membership::default(),
        };
        let service = Arc::new(Service {
            min_tasks,
            names,
            cluster_fingerprint,
            strategy_fingerprint,
            config,
            state: Mutex::new(state),
            changed: Notify::new(),
        });
        let (listener, address) = crate::lifecycle::listen(bind, "the coordination service")?;
        let svc = service.clone();
        let mut builder = crate::auth::server_builder(&token)?;
        let recorder = {
            let svc = service.clone();
            Arc::new(move |claimed: &str, peer: Option<SocketAddr>, why: Refusal| {
                svc.record_refusal(claimed, peer, why)
            })
        };
        let interceptor = server_interceptor_recording(token, recorder);
        let what = "the coordination service".to_string();
        let server = crate::lifecycle::spawn_server::<CoordinationServer<Svc>, _, _>(
            listener,
            what,
            tokio::sync::watch::channel(false).0,
            interceptor.clone(),
            |health, (incoming, stop)| async move {
                let monitor = {
                    let svc = svc.clone();
                    tokio::spawn(async move {
                        let mut tick = tokio::time::interval(Duration::from_millis(100));
                        loop {
                            tick.tick().await;
                            svc.check_liveness();
                        }
                    })
                };
                let coordination = CoordinationServer::new(Svc(svc)).max_decoding_message_size(MAX_REQUEST_BYTES);
                let result = builder
                    .add_service(health)
                    .add_service(InterceptedService::new(DecodeErrors(coordination), interceptor))
                    .serve_with_incoming_shutdown(incoming, stop)
                    .await;
                monitor.abort();
                result
            },
        );
        tracing::info!(%address, "coordination service listening");
        Ok(Self { service, address, server })
    }

    /// Where the service listens.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// The job's error, if it failed.
    pub fn error(&self) -> Option<String> {
        lock(&self.service.state).error.clone()
    }

    /// An elastic job's current generation and its members' names, in rank order.
    pub fn membership(&self) -> (u64, Vec<String>) {
        let st = lock(&self.service.state);
        (st.members.generation, st.members.members.iter().map(|&i| self.service.names[i].clone()).collect())
    }

    /// An elastic job's lost tasks so far, each with why ("worker:1 (no heartbeat for 3.1 s)").
    pub fn lost_tasks(&self) -> Vec<String> {
        lock(&self.service.state).members.lost.clone()
    }

    /// The tasks that left an elastic job on request while it went on.
    pub fn left_on_request(&self) -> Vec<String> {
        let st = lock(&self.service.state);
        let left = st.tasks.iter().enumerate().filter(|(_, t)| t.stop.is_some_and(|(_, goes_on)| goes_on));
        left.map(|(i, _)| self.service.names[i].clone()).collect()
    }

    /// The code of a stop on request that ended the job (every task that stayed to the end left
    /// with it), if the job ended that way rather than by finishing its training.
    pub fn stopped(&self) -> Option<u32> {
        let st = lock(&self.service.state);
        st.tasks.iter().filter_map(|t| t.stop.filter(|(_, goes_on)| !goes_on).map(|(code, _)| code)).max()
    }

    /// Whether every task that joined has left (an elastic job that ended).
    pub fn all_left(&self) -> bool {
        let st = lock(&self.service.state);
        st.tasks.iter().any(|t| t.left) && st.tasks.iter().all(|t| t.left || t.lost || t.incarnation.is_none())
    }

    /// Waits (up to `timeout`) until every task has left or the job failed, then stops.
    pub fn shutdown_after_all_left(mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            {
                let st = lock(&self.service.state);
                if st.error.is_some() || st.tasks.iter().all(|t| t.left || t.lost || t.incarnation.is_none()) {
                    break;
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.stop();
    }

    /// Stops. After a failure, first lets every surviving task hear why (at most [`LINGER`]),
    /// then drops the connections without waiting for a graceful shutdown, which a lost task
    /// would never acknowledge.
    fn stop(&mut self) {
        let failed = {
            let deadline = Instant::now() + LINGER;
            loop {
                let st = lock(&self.service.state);
                if st.error.is_none() {
                    break false;
                }
                let untold = st.tasks.iter().any(|t| t.incarnation.is_some() && !t.lost && !t.left && !t.told);
                if !untold || Instant::now() >= deadline {
                    break true;
                }
                drop(st);
                std::thread::sleep(Duration::from_millis(10));
            }
        };
        if failed {
            self.server.stop_within(Duration::from_millis(100));
        } else {
            self.server.stop();
        }
    }
}

impl Drop for CoordinationServerHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

type Client = CoordinationClient<InterceptedService<Channel, ClientAuth>>;

/// What registration returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    /// This task's rank.
    pub rank: usize,
    /// Every task's data-plane address, in rank order.
    pub data_addresses: Vec<String>,
    /// Every task's name, in rank order.
    pub task_names: Vec<String>,
}

/// A generation of an elastic job, as [`CoordinationMember::join`] returns it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Generation {
    /// Its number (from 1).
    pub generation: u64,
    /// This task's rank in it.
    pub rank: usize,
    /// Every member's data-plane address, in rank order.
    pub data_addresses: Vec<String>,
    /// Every member's name, in rank order.
    pub task_names: Vec<String>,
    /// Whether the job was under way before it (a member of an earlier generation is in it):
    /// a task new to the job takes its state from a member.
    pub resumed: bool,
}

/// What an elastic job's heartbeats said last about its membership.
#[derive(Debug, Default)]
pub struct MembershipView {
    generation: std::sync::atomic::AtomicU64,
    forming: AtomicBool,
    waiting: std::sync::atomic::AtomicU32,
}

impl MembershipView {
    /// The job's current generation.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }
    /// Whether the next generation is forming.
    pub fn forming(&self) -> bool {
        self.forming.load(Ordering::Acquire)
    }
    /// How many tasks wait to join at the next step boundary.
    pub fn waiting(&self) -> u32 {
        self.waiting.load(Ordering::Acquire)
    }
}

/// What a task reports in its heartbeats: the collective it is in.
#[derive(Debug, Default)]
pub struct Progress {
    seq: std::sync::atomic::AtomicU64,
    what: Mutex<&'static str>,
}

impl Progress {
    /// Records that the task entered collective `seq` (`what`: its kind).
    pub fn enter(&self, seq: u64, what: &'static str) {
        self.seq.store(seq, Ordering::Relaxed);
        *lock(&self.what) = what;
    }
}

/// A task's connection to the coordination service.
pub struct CoordinationMember {
    client: Client,
    task: String,
    incarnation: u64,
    config: CoordinationConfig,
    peer: String,
    /// The task that serves the service (`chief:0`, or `worker:0` when there is no chief job;
    /// named when it is lost).
    service_task: String,
    progress: Arc<Progress>,
    /// Elastic jobs: what the heartbeats say about the membership.
    view: Arc<MembershipView>,
    /// Set once the heartbeats concluded that the service is lost: nothing more is sent to it.
    service_lost: Arc<AtomicBool>,
    stop: tokio::sync::watch::Sender<bool>,
    heartbeats: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for CoordinationMember {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CoordinationMember").field("task", &self.task).field("service", &self.peer).finish()
    }
}

fn rpc_error(rpc: &str, peer: &str, s: Status) -> Error {
    match s.code() {
        Code::Unauthenticated => Error::Unauthenticated(format!("{rpc} to {peer}: {}", s.message())),
        Code::FailedPrecondition | Code::NotFound | Code::InvalidArgument | Code::AlreadyExists => {
            Error::Config(s.message().to_string())
        }
        Code::Aborted | Code::DeadlineExceeded => Error::Aborted(s.message().to_string()),
        _ => Error::Rpc { rpc: rpc.into(), peer: peer.into(), status: format!("{:?}: {}", s.code(), s.message()) },
    }
}

impl CoordinationMember {
    /// Connects task `task` (e.g. `worker:1`) to the service that task `chief` (`chief:0`, or
    /// `worker:0` when the cluster has no chief job; errors name it) serves at `address`,
    /// retrying until the rendezvous deadline (the chief may start after its workers).
    pub fn connect(
        address: &str,
        chief: &str,
        task: &str,
        token: ClusterToken,
        config: CoordinationConfig,
    ) -> Result<Self> {
        let endpoint = crate::auth::endpoint(address, "the coordination service", &token)?
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true);
        let deadline = Instant::now() + config.rendezvous_timeout;
        let channel = runtime().block_on(async {
            loop {
                match endpoint.connect().await {
                    Ok(c) => return Ok(c),
                    Err(e) if Instant::now() >= deadline => {
                        return Err(Error::PeerLost {
                            task: chief.to_string(),
                            collective: "rendezvous".into(),
                            step: 0,
                            detail: format!("the coordination service at {address} did not answer: {e}"),
                        })
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
        })?;
        let client = CoordinationClient::with_interceptor(channel, client_interceptor_as(token, task));
        Ok(Self {
            client,
            task: task.to_string(),
            incarnation: rand_incarnation(),
            config,
            peer: format!("the coordination service at {address}"),
            service_task: chief.to_string(),
            progress: Arc::new(Progress::default()),
            view: Arc::new(MembershipView::default()),
            service_lost: Arc::new(AtomicBool::new(false)),
            stop: tokio::sync::watch::channel(false).0,
            heartbeats: None,
        })
    }

    /// The task's progress record, which its heartbeats report.
    pub fn progress(&self) -> Arc<Progress> {
        self.progress.clone()
    }

    /// What the heartbeats say about an elastic job's membership.
    pub fn membership(&self) -> Arc<MembershipView> {
        self.view.clone()
    }

    /// Joins the next generation of an elastic job (`generation`: the one this task was a
    /// member of, 0 when none) and waits until it forms (see the service's `Join`). A task
    /// declared lost, replaced, or presenting an old generation gets [`Error::Aborted`] saying
    /// so: it must stop.
    pub fn join(
        &self,
        cluster_fingerprint: &str,
        strategy_fingerprint: &str,
        data_address: &str,
        generation: u64,
    ) -> Result<Generation> {
        let mut client = self.client.clone();
        let mut req = Request::new(JoinRequest {
            task: Some(task_proto(&self.task)),
            incarnation: self.incarnation,
            cluster_fingerprint: cluster_fingerprint.into(),
            strategy_fingerprint: strategy_fingerprint.into(),
            data_address: data_address.into(),
            generation,
        });
        req.set_timeout(self.config.rendezvous_timeout + Duration::from_secs(5));
        let r = runtime().block_on(client.join(req)).map_err(|s| rpc_error("Join", &self.peer, s))?.into_inner();
        let g = Generation {
            generation: r.generation,
            rank: r.rank as usize,
            data_addresses: r.data_addresses,
            task_names: r.task_names,
            resumed: r.resumed,
        };
        self.view.generation.fetch_max(g.generation, Ordering::AcqRel);
        Ok(g)
    }

    /// Whether the heartbeats concluded that the service is lost.
    pub fn service_lost(&self) -> bool {
        self.service_lost.load(Ordering::Relaxed)
    }

    /// Registers and waits for every task (the rendezvous).
    pub fn register(
        &self,
        cluster_fingerprint: &str,
        strategy_fingerprint: &str,
        data_address: &str,
    ) -> Result<Registration> {
        let mut client = self.client.clone();
        let mut req = Request::new(RegisterRequest {
            task: Some(task_proto(&self.task)),
            cluster_fingerprint: cluster_fingerprint.into(),
            strategy_fingerprint: strategy_fingerprint.into(),
            data_address: data_address.into(),
            incarnation: self.incarnation,
        });
        req.set_timeout(self.config.rendezvous_timeout + Duration::from_secs(5));
        let r =
            runtime().block_on(client.register(req)).map_err(|s| rpc_error("Register", &self.peer, s))?.into_inner();
        Ok(Registration { rank: r.rank as usize, data_addresses: r.data_addresses, task_names: r.task_names })
    }

    /// Starts the heartbeat thread. `on_failure` is called once, with the reason, when the job
    /// fails (a task lost or an error reported) or the service stops answering: within
    /// [`CoordinationConfig::heartbeat_timeout`] of the last answer, however the service was
    /// lost (killed, stopped, cut off).
    pub fn start_heartbeats(&mut self, on_failure: impl Fn(String) + Send + 'static) {
        self.start_heartbeats_with(on_failure, |_| {});
    }

    /// [`CoordinationMember::start_heartbeats`], and `on_membership` with every answer of an
    /// elastic job (after [`CoordinationMember::membership`]'s view is updated): a member
    /// abandons its step when the next generation is forming.
    pub fn start_heartbeats_with(
        &mut self,
        on_failure: impl Fn(String) + Send + 'static,
        on_membership: impl Fn(&MembershipView) + Send + 'static,
    ) {
        let mut client = self.client.clone();
        let view = self.view.clone();
        let (task, incarnation, config, peer, service_task) =
            (self.task.clone(), self.incarnation, self.config.clone(), self.peer.clone(), self.service_task.clone());
        let (progress, lost, mut stop) = (self.progress.clone(), self.service_lost.clone(), self.stop.subscribe());
        let handle = std::thread::Builder::new().name("strata-heartbeat".into()).spawn(move || {
            runtime().block_on(async move {
                let interval = config.heartbeat_interval.max(Duration::from_millis(10));
                // The service holds an answer for `interval`; give the answer as long again.
                let patience = interval * 2 + Duration::from_millis(200);
                let mut last_ok = Instant::now();
                let mut last_error = String::from("no answer yet");
                // Set when this process itself was stopped (SIGSTOP, a suspended machine) while
                // it waited: the silence was its own, so the service is asked once more, with
                // the full patience, before it is concluded lost. A stopped member that the job
                // fenced meanwhile hears so, instead of blaming the service.
                let mut stalled = false;
                loop {
                    if *stop.borrow() {
                        return;
                    }
                    let left = (last_ok + config.heartbeat_timeout).saturating_duration_since(Instant::now());
                    if left.is_zero() && !stalled {
                        lost.store(true, Ordering::Relaxed);
                        let what = *lock(&progress.what);
                        let doing = if what.is_empty() {
                            String::new()
                        } else {
                            // The collective's number stays in the log (one counter per error).
                            tracing::warn!(%task, collective = what, seq = progress.seq.load(Ordering::Relaxed), "the coordination service stopped answering");
                            format!("; task {task} was in {what}")
                        };
                        on_failure(format!(
                            "lost task {service_task}: {peer} has not answered heartbeats for {:.1} s ({last_error}){doing}",
                            last_ok.elapsed().as_secs_f64(),
                        ));
                        return;
                    }
                    let mut req = Request::new(HeartbeatRequest {
                        task: Some(task_proto(&task)),
                        incarnation,
                        collective_seq: progress.seq.load(Ordering::Relaxed),
                        collective: (*lock(&progress.what)).to_string(),
                        wait_ms: interval.as_millis() as u64,
                    });
                    let deadline = if stalled { patience } else { left.min(patience) };
                    stalled = false;
                    let started = Instant::now();
                    req.set_timeout(deadline);
                    let call = tokio::time::timeout(deadline, client.heartbeat(req));
                    let outcome = tokio::select! {
                        _ = stop.changed() => return,
                        outcome = call => outcome,
                    };
                    match outcome {
                        Ok(Ok(r)) => {
                            last_ok = Instant::now();
                            let r = r.into_inner();
                            if !r.error.is_empty() {
                                on_failure(r.error);
                                return;
                            }
                            if r.generation > 0 {
                                view.generation.store(r.generation, Ordering::Release);
                                view.forming.store(r.forming, Ordering::Release);
                                view.waiting.store(r.waiting, Ordering::Release);
                                on_membership(&view);
                            }
                            continue;
                        }
                        Ok(Err(s)) => last_error = format!("{:?}: {}", s.code(), s.message()),
                        Err(_) => last_error = format!("no answer within {deadline:?}"),
                    }
                    // Refused or unreachable: try again soon, until the timeout says it is lost.
                    let pause = Duration::from_millis(100).min(left);
                    tokio::select! {
                        _ = stop.changed() => return,
                        _ = tokio::time::sleep(pause) => {}
                    }
                    stalled = started.elapsed() > deadline + pause + STALL;
                }
            })
        });
        self.heartbeats = handle.ok();
    }

    /// Waits until every task enters the barrier `name`.
    pub fn barrier(&self, name: &str, timeout: Duration) -> Result<()> {
        let mut client = self.client.clone();
        let mut req = Request::new(BarrierRequest {
            task: Some(task_proto(&self.task)),
            name: name.into(),
            timeout_ms: timeout.as_millis() as u64,
        });
        req.set_timeout(timeout + Duration::from_secs(5));
        runtime().block_on(client.barrier(req)).map_err(|s| rpc_error("Barrier", &self.peer, s))?;
        Ok(())
    }

    /// Tells every task that this one failed. Does nothing when the service is known to be
    /// lost, and waits at most 2 s (the job fails anyway once this task stops sending
    /// heartbeats).
    pub fn report_error(&self, message: &str) -> Result<()> {
        if self.service_lost() {
            return Ok(());
        }
        let mut client = self.client.clone();
        let message = truncated(message, MAX_ERROR_BYTES);
        let mut req = Request::new(ReportErrorRequest {
            task: Some(task_proto(&self.task)),
            message: message.into(),
            incarnation: self.incarnation,
        });
        let deadline = self.config.rpc_timeout.min(REPORT_DEADLINE);
        req.set_timeout(deadline);
        runtime()
            .block_on(async { tokio::time::timeout(deadline, client.report_error(req)).await })
            .map_err(|_| Error::Timeout {
                task: self.service_task.clone(),
                collective: "ReportError".into(),
                step: 0,
                timeout: deadline,
            })?
            .map_err(|s| rpc_error("ReportError", &self.peer, s))?;
        Ok(())
    }

    /// Leaves the job cleanly and stops the heartbeats.
    pub fn leave(&mut self) -> Result<()> {
        self.leave_on_request(0, false)
    }

    /// Leaves the job after a stop on request (`code`, a signal's number; 0 for a task that
    /// finished its training) and stops the heartbeats. With `job_goes_on` (elastic jobs) the
    /// task alone stops: the other members form the next generation without it at once.
    pub fn leave_on_request(&mut self, code: u32, job_goes_on: bool) -> Result<()> {
        self.stop_heartbeats();
        if self.service_lost() {
            return Err(Error::Aborted(format!("task {} cannot leave: {} is lost", self.task, self.service_task)));
        }
        let mut client = self.client.clone();
        let mut req = Request::new(LeaveRequest {
            task: Some(task_proto(&self.task)),
            incarnation: self.incarnation,
            stop_code: code,
            job_goes_on,
        });
        req.set_timeout(self.config.rpc_timeout);
        runtime().block_on(client.leave(req)).map_err(|s| rpc_error("Leave", &self.peer, s))?;
        Ok(())
    }

    /// Sets `key` (once).
    pub fn set_key(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut client = self.client.clone();
        let mut req = Request::new(SetKeyRequest { key: key.into(), value: value.to_vec() });
        req.set_timeout(self.config.rpc_timeout);
        runtime().block_on(client.set_key(req)).map_err(|s| rpc_error("SetKey", &self.peer, s))?;
        Ok(())
    }

    /// Reads `key`, waiting up to `timeout` for it to be set.
    pub fn get_key(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let mut client = self.client.clone();
        let mut req = Request::new(GetKeyRequest { key: key.into(), timeout_ms: timeout.as_millis() as u64 });
        req.set_timeout(timeout + Duration::from_secs(5));
        Ok(runtime().block_on(client.get_key(req)).map_err(|s| rpc_error("GetKey", &self.peer, s))?.into_inner().value)
    }

    fn stop_heartbeats(&mut self) {
        self.stop.send_replace(true);
        if let Some(h) = self.heartbeats.take() {
            let _ = h.join();
        }
    }
}

impl Drop for CoordinationMember {
    fn drop(&mut self) {
        self.stop_heartbeats();
    }
}

fn rand_incarnation() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.write_u32(std::process::id());
    h.finish()
}
