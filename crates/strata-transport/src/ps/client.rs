//! The blocking client of a parameter-server task, used by workers and the coordinator.

use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use prost::bytes::Bytes;
use prost::Message;
use strata_proto::v1::parameter_server_client::ParameterServerClient;
use strata_proto::v1::{
    self as proto, create_message, push_message, CreateMessage, PsCheckpointRequest, PsConfigureRequest,
    PsStatusRequest, PullHeader, PullRequest, PullRowsRequest, PushMessage, PushResponse,
};
use strata_ps::{copy_f32s, Chunk, LrSchedule, RowGrads, StaleRate, WireFormat};
use tokio_stream::wrappers::ReceiverStream;
use tonic::codegen::Service;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Code, Status};

use super::convert;
use super::staged::{self, StagedPush};
use super::tables;
use super::wire;
use super::{
    CreateOutcome, F32Bytes, PsMode, PsStatus, Pulled, PushOutcome, RowsPulled, ServerOptimizer, UpdateId,
    VariableInfo, MAX_CHUNK_BYTES, MAX_CHUNK_ELEMENTS,
};
use crate::auth::{client_interceptor, ClientAuth, ClusterToken};
use crate::ring::{raised, AbortSignal};
use crate::rt::runtime;
use crate::{Error, Result};

type Authed = InterceptedService<Channel, ClientAuth>;
type Raw = ParameterServerClient<Authed>;

/// The largest message a client decodes: one chunk plus its framing.
const MAX_MESSAGE_BYTES: usize = MAX_CHUNK_BYTES + (64 << 10);

/// Where pulled values go.
enum Dest<'a, 'b> {
    /// Buffers allocated from the pull's header.
    Allocated(Vec<Vec<f32>>),
    /// The caller's buffers, one per variable.
    Given(&'a mut [&'b mut [f32]]),
}

/// Pulled chunks copied where they belong, checked to cover each variable exactly, in order.
struct Filling<'a, 'b> {
    into: Dest<'a, 'b>,
    /// Per variable: the elements filled so far.
    next: Vec<usize>,
}

impl Filling<'_, '_> {
    /// The pull's header: sizes the buffers (or checks the caller's).
    fn start(&mut self, header: &PullHeader) -> Result<(), String> {
        let n = header.variables.len();
        match &mut self.into {
            Dest::Allocated(values) => {
                *values = convert::pulled_variables(header)
                    .map_err(|e| Error::from(e).to_string())?
                    .iter()
                    .map(|i| vec![0.0; i.numel()])
                    .collect();
            }
            Dest::Given(out) if out.len() != n => return Err(format!("pulled {n} variables, asked for {}", out.len())),
            Dest::Given(_) => {}
        }
        self.next = vec![0; n];
        Ok(())
    }

    fn slot(&mut self, v: usize) -> Option<&mut [f32]> {
        match &mut self.into {
            Dest::Allocated(values) => values.get_mut(v).map(Vec::as_mut_slice),
            Dest::Given(out) => out.get_mut(v).map(|s| &mut **s),
        }
    }

    fn chunk(&mut self, c: &Chunk) -> Result<(), String> {
        let v = c.var as usize;
        let (start, n) = (c.offset as usize, c.elements());
        let expected = self.next.get(v).copied();
        let Some(dst) = self.slot(v) else {
            return Err(format!("a chunk of variable #{v}, which was not pulled"));
        };
        if Some(start) != expected || start + n > dst.len() {
            return Err(format!("a malformed chunk of variable #{v} at element {start}"));
        }
        let mut at = start;
        for p in &c.pieces {
            copy_f32s(p, &mut dst[at..at + p.len() / 4]);
            at += p.len() / 4;
        }
        self.next[v] += n;
        Ok(())
    }

    fn finish(&self) -> Result<(), String> {
        let lens: Vec<usize> = match &self.into {
            Dest::Allocated(values) => values.iter().map(Vec::len).collect(),
            Dest::Given(out) => out.iter().map(|s| s.len()).collect(),
        };
        for (v, (covered, len)) in self.next.iter().zip(lens).enumerate() {
            if *covered != len {
                return Err(format!("variable #{v} has {len} elements, {covered} were pulled"));
            }
        }
        Ok(())
    }
}

/// Sends a `Push` or `Pull` below tonic's codec ([`wire`]) and returns the response's messages.
async fn frames_call(
    mut svc: Authed,
    path: &'static str,
    body: tonic::body::Body,
) -> Result<wire::Messages<tonic::body::Body>, Status> {
    std::future::poll_fn(|cx| svc.poll_ready(cx)).await.map_err(|e| Status::from_error(Box::new(e)))?;
    let response = svc.call(wire::request(path, body)).await.map_err(|e| Status::from_error(Box::new(e)))?;
    wire::response_messages(response.map(tonic::body::Body::new), MAX_MESSAGE_BYTES)
}

/// Sends a `Push` below tonic's codec and decodes its one answer.
async fn push_call(svc: Authed, body: tonic::body::Body) -> Result<PushResponse, Status> {
    let mut messages = frames_call(svc, wire::PUSH_PATH, body).await?;
    let answer = match (messages.next().await?, messages.next().await?) {
        (Some(m), None) => PushResponse::decode(m.contiguous())
            .map_err(|e| Status::internal(format!("a Push answer that is not valid protobuf: {e}")))?,
        _ => return Err(Status::internal("a Push answer must be one message")),
    };
    messages.finish()?;
    Ok(answer)
}

/// Deadlines and retries of a [`PsClient`].
#[derive(Clone, Debug)]
pub struct PsClientConfig {
    /// The deadline of one call (default 60 s).
    pub timeout: Duration,
    /// For how long a call is retried, with backoff from 50 ms to 1 s, while the task is
    /// unavailable (not yet started, restarting, or answering `UNAVAILABLE`); zero: never.
    /// A retried push carries the same [`UpdateId`], so it is applied at most once.
    pub retry_for: Duration,
}

impl Default for PsClientConfig {
    fn default() -> Self {
        Self { timeout: Duration::from_secs(60), retry_for: Duration::from_secs(30) }
    }
}

/// A connection to one parameter-server task. Cheap to clone (clones share the connection).
///
/// Every method blocks the calling thread on the transport runtime: never call them from a
/// thread of a tokio runtime.
#[derive(Clone)]
pub struct PsClient {
    raw: Raw,
    svc: Authed,
    address: String,
    task: String,
    config: PsClientConfig,
    /// Whether it connects over mutual TLS.
    tls: bool,
    /// When raised, calls in flight and later calls fail at once (the job failed).
    abort: Option<AbortSignal>,
    /// The element type of pushed gradients and pulled values on the wire.
    wire_format: WireFormat,
}

impl std::fmt::Debug for PsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PsClient").field("task", &self.task).field("address", &self.address).finish()
    }
}

/// The numbers in a message, in order.
fn numbers(text: &str) -> Vec<u64> {
    text.split(|c: char| !c.is_ascii_digit()).filter(|s| !s.is_empty()).filter_map(|s| s.parse().ok()).collect()
}

impl PsClient {
    /// A client of task `task` (`ps:<index>`, named in errors) at `address` (`host:port`).
    /// The connection is made on the first call (and remade after a failure).
    pub fn connect(address: &str, task: &str, token: ClusterToken, config: PsClientConfig) -> Result<Self> {
        let tls = token.tls().is_some();
        let endpoint = crate::auth::endpoint(address, task, &token)?
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true)
            .initial_stream_window_size(8 << 20)
            .initial_connection_window_size(32 << 20)
            .max_frame_size(crate::rt::frame_size());
        let channel = {
            let _entered = runtime().enter();
            endpoint.connect_lazy()
        };
        let svc = InterceptedService::new(channel, client_interceptor(token));
        let raw = ParameterServerClient::new(svc.clone())
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        Ok(Self {
            raw,
            svc,
            address: address.to_string(),
            task: task.to_string(),
            config,
            tls,
            abort: None,
            wire_format: WireFormat::F32,
        })
    }

    /// The same client, whose pushes send gradients and whose pulls ask for values in `format`
    /// (default [`WireFormat::F32`], exact). With a 16-bit format each gradient element is
    /// rounded to nearest even before it is sent (the task decodes it exactly and applies it in
    /// f32), and each pulled value is rounded to nearest even by the task (the client decodes
    /// it exactly): half the bytes either way. Creating variables and other calls are not
    /// affected (initial values always travel as f32).
    pub fn with_wire_format(mut self, format: WireFormat) -> Self {
        self.wire_format = format;
        self
    }

    /// The element type of this client's pushes and pulls.
    pub fn wire_format(&self) -> WireFormat {
        self.wire_format
    }

    /// The same client, whose calls (in flight or later) fail at once with [`Error::Aborted`]
    /// once `abort` is raised: a coordinator raises it when the job fails, so that nothing
    /// waits out a deadline on a lost task.
    pub fn with_abort(mut self, abort: AbortSignal) -> Self {
        self.abort = Some(abort);
        self
    }

    fn aborted(&self, rpc: &str) -> Option<Error> {
        let reason = self.abort.as_ref()?.reason()?;
        Some(Error::Aborted(format!("{rpc} to {} was abandoned: {reason}", self.task)))
    }

    /// Whether the task answers a health check within `deadline` (a liveness probe; the
    /// health service does not take the task's lock, so a busy task answers too).
    pub fn probe(&self, deadline: Duration) -> Result<()> {
        let mut health = tonic_health::pb::health_client::HealthClient::new(self.svc.clone());
        let mut req = tonic::Request::new(tonic_health::pb::HealthCheckRequest { service: String::new() });
        req.set_timeout(deadline);
        let answer = runtime().block_on(async {
            tokio::select! {
                r = tokio::time::timeout(deadline, health.check(req)) => Some(r),
                () = raised(self.abort.as_ref()) => None,
            }
        });
        match answer {
            None => Err(self.aborted("a health check").unwrap_or_else(|| Error::Aborted("aborted".into()))),
            Some(Ok(Ok(_))) => Ok(()),
            // An answer of the task's own, even a refusal, means it is alive (a deadline that
            // passed comes back as CANCELLED from the client itself).
            Some(Ok(Err(s)))
                if matches!(
                    s.code(),
                    Code::Unimplemented | Code::NotFound | Code::Unauthenticated | Code::PermissionDenied
                ) =>
            {
                Ok(())
            }
            Some(Ok(Err(s))) => Err(self.error("a health check", s)),
            Some(Err(_)) => Err(Error::Timeout {
                task: self.task.clone(),
                collective: "a health check".into(),
                step: 0,
                timeout: deadline,
            }),
        }
    }

    /// The task's address.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// The task's name.
    pub fn task(&self) -> &str {
        &self.task
    }

    fn error(&self, rpc: &str, s: Status) -> Error {
        let detail = s.message().to_string();
        match s.code() {
            Code::Unauthenticated => {
                Error::Unauthenticated(format!("{rpc} to {} at {}: {detail}", self.task, self.address))
            }
            // ABORTED: a streamed push another update overtook; nothing of it was applied.
            Code::Unavailable | Code::Cancelled | Code::Aborted => {
                Error::Unavailable { peer: self.task.clone(), rpc: rpc.into(), detail }
            }
            Code::Unknown
                if std::error::Error::source(&s).is_some()
                    || detail.contains("transport")
                    || detail.contains("connection") =>
            {
                Error::Unavailable { peer: self.task.clone(), rpc: rpc.into(), detail }
            }
            Code::FailedPrecondition if detail.starts_with("stale push") => {
                let n = numbers(&detail);
                Error::Stale {
                    peer: self.task.clone(),
                    base: n.first().copied().unwrap_or(0),
                    current: n.get(1).copied().unwrap_or(0),
                    bound: n.get(2).copied().unwrap_or(0),
                }
            }
            Code::DeadlineExceeded => {
                Error::Rejected { peer: self.task.clone(), rpc: rpc.into(), code: "DeadlineExceeded".into(), detail }
            }
            // A plaintext client's HTTP/2 bytes reaching a TLS server (or the other way round).
            Code::Internal if detail.contains("h2 protocol error") && !self.tls => Error::Rejected {
                peer: self.task.clone(),
                rpc: rpc.into(),
                code: "Internal".into(),
                detail: format!("{detail} (if the cluster uses mutual TLS, set STRATA_TLS_DIR in this task too)"),
            },
            code => Error::Rejected { peer: self.task.clone(), rpc: rpc.into(), code: format!("{code:?}"), detail },
        }
    }

    /// Runs `attempt` (`None`: it passed the deadline) until it succeeds, fails for good, or
    /// the task stayed unavailable for `retry_for`.
    fn retry<T>(&self, rpc: &str, mut attempt: impl FnMut() -> Option<Result<T, Status>>) -> Result<T> {
        let deadline = Instant::now() + self.config.retry_for;
        let mut backoff = Duration::from_millis(50);
        loop {
            if let Some(e) = self.aborted(rpc) {
                return Err(e);
            }
            let outcome = attempt();
            if let Some(e) = self.aborted(rpc) {
                return Err(e);
            }
            let err = match outcome {
                Some(Ok(v)) => return Ok(v),
                Some(Err(s)) => self.error(rpc, s),
                None => {
                    return Err(Error::Timeout {
                        task: self.task.clone(),
                        collective: rpc.into(),
                        step: 0,
                        timeout: self.config.timeout,
                    })
                }
            };
            if matches!(err, Error::Unavailable { .. }) && Instant::now() + backoff < deadline {
                tracing::debug!(task = %self.task, rpc, error = %err, "retrying");
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
            return Err(err);
        }
    }

    /// Runs one call with the deadline, retrying while the task is unavailable.
    fn call<T, F, Fut>(&self, rpc: &str, mut f: F) -> Result<T>
    where
        F: FnMut(Raw) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        let timeout = self.config.timeout;
        let abort = self.abort.as_ref();
        self.retry(rpc, || {
            runtime().block_on(async {
                tokio::select! {
                    r = tokio::time::timeout(timeout, f(self.raw.clone())) => r.ok(),
                    () = raised(abort) => Some(Err(Status::cancelled("the job failed"))),
                }
            })
        })
    }

    /// Runs a client-streaming call whose messages this thread makes (`produce` hands each to
    /// its argument, which says whether the call still takes them) while the runtime sends
    /// the earlier ones, so copying a tensor into chunks overlaps with sending it. Retried like
    /// [`call`](Self::call), producing the messages again.
    fn stream_call<M, T, F, Fut>(&self, rpc: &str, produce: impl Fn(&mut dyn FnMut(M) -> bool), start: F) -> Result<T>
    where
        M: Send + 'static,
        T: Send + 'static,
        F: Fn(ReceiverStream<M>) -> Fut,
        Fut: Future<Output = Result<T, Status>> + Send + 'static,
    {
        let timeout = self.config.timeout;
        self.retry(rpc, || {
            let (tx, rx) = tokio::sync::mpsc::channel::<M>(8);
            let call = start(ReceiverStream::new(rx));
            let abort = self.abort.clone();
            let task = runtime().spawn(async move {
                tokio::select! {
                    r = tokio::time::timeout(timeout, call) => r,
                    () = raised(abort.as_ref()) => Ok(Err(Status::cancelled("the job failed"))),
                }
            });
            produce(&mut |m| tx.blocking_send(m).is_ok());
            drop(tx);
            match runtime().block_on(task) {
                Ok(outcome) => outcome.ok(),
                Err(e) => Some(Err(Status::internal(format!("the {rpc} call stopped: {e}")))),
            }
        })
    }

    /// Creates variables with their initial values and sets the optimizer (at its constant
    /// rate) and mode. Creating variables that exist with the same spec is a no-op (`existed`).
    pub fn create_variables(
        &self,
        vars: &[(VariableInfo, &[f32])],
        optimizer: &ServerOptimizer,
        mode: PsMode,
    ) -> Result<CreateOutcome> {
        self.create_variables_scheduled(vars, optimizer, None, mode)
    }

    /// [`create_variables`](Self::create_variables) with the optimizer following `schedule`:
    /// the task's update `n` (its version before the update: one per applied push in async and
    /// stale modes, one per applied round in sync mode) is applied at `schedule.at(n)`, see
    /// [`strata_ps::CreateHeader::schedule`]. The task refuses a bad schedule with
    /// `INVALID_ARGUMENT` naming the field, and creates nothing.
    pub fn create_variables_scheduled(
        &self,
        vars: &[(VariableInfo, &[f32])],
        optimizer: &ServerOptimizer,
        schedule: Option<&LrSchedule>,
        mode: PsMode,
    ) -> Result<CreateOutcome> {
        self.create_variables_for_job(vars, optimizer, schedule, mode, WireFormat::F32)
    }

    /// [`create_variables_scheduled`](Self::create_variables_scheduled) that also records
    /// `job_format` on the task as the element type the job's workers push and pull in
    /// ([`strata_ps::CreateHeader::wire_format`]): workers read it from
    /// [`status`](Self::status) ([`PsStatus::wire_format`]). Every create sets it, also one
    /// that finds the variables existing. The initial values travel as f32 whatever it is.
    pub fn create_variables_for_job(
        &self,
        vars: &[(VariableInfo, &[f32])],
        optimizer: &ServerOptimizer,
        schedule: Option<&LrSchedule>,
        mode: PsMode,
        job_format: WireFormat,
    ) -> Result<CreateOutcome> {
        self.create_with_tables(vars, &[], optimizer, schedule, StaleRate::Constant, mode, job_format)
    }

    /// [`create_variables_for_job`](Self::create_variables_for_job) that also creates the
    /// shards of embedding tables `tables` this task holds (their rows appear as workers pull
    /// them), and applies stale pushes' dense variables at `stale_rate`
    /// ([`strata_ps::CreateHeader::stale_rate`]; the other ways of creating take
    /// [`StaleRate::Constant`]). Creating tables that exist as described is a no-op; a
    /// different description is `FAILED_PRECONDITION` naming the table, and so is another
    /// `stale_rate` than the task's.
    #[allow(clippy::too_many_arguments)]
    pub fn create_with_tables(
        &self,
        vars: &[(VariableInfo, &[f32])],
        tables: &[strata_ps::TableInfo],
        optimizer: &ServerOptimizer,
        schedule: Option<&LrSchedule>,
        stale_rate: StaleRate,
        mode: PsMode,
        job_format: WireFormat,
    ) -> Result<CreateOutcome> {
        for (info, values) in vars {
            if info.numel() != values.len() {
                return Err(Error::Config(format!(
                    "variable {} has shape {:?} ({} elements) but {} initial values",
                    info.name,
                    info.shape,
                    info.numel(),
                    values.len()
                )));
            }
        }
        let mut header =
            convert::create_header_spec(vars.iter().map(|(i, _)| i), optimizer, schedule, stale_rate, mode, job_format);
        header.tables = tables.iter().map(tables::table_spec).collect();
        let produce = |send: &mut dyn FnMut(CreateMessage) -> bool| {
            if !send(CreateMessage { kind: Some(create_message::Kind::Header(header.clone())) }) {
                return;
            }
            for (k, (_, values)) in vars.iter().enumerate() {
                for c in convert::chunks_of(k as u32, values) {
                    if !send(CreateMessage { kind: Some(create_message::Kind::Chunk(c)) }) {
                        return;
                    }
                }
            }
        };
        let r = self.stream_call("CreateVariables", produce, |stream| {
            let mut raw = self.raw.clone();
            async move { raw.create_variables(stream).await }
        })?;
        Ok(convert::create_outcome(r.into_inner()))
    }

    /// Pushes one update computed from task version `base_version`. Retried with the same
    /// `id` while the task is unavailable, so it is applied at most once; a push refused as
    /// stale is [`Error::Stale`] (pull and compute it again). The gradients are copied once,
    /// chunk by chunk while earlier chunks are sent; [`push_shared`](Self::push_shared) sends
    /// buffers the caller hands over without that copy. In a 16-bit
    /// [`wire_format`](Self::with_wire_format) the gradients are encoded chunk by chunk instead
    /// (rounded to nearest even).
    pub fn push(&self, id: &UpdateId, base_version: u64, grads: &[(&str, &[f32])]) -> Result<PushOutcome> {
        let names: Vec<&str> = grads.iter().map(|(n, _)| *n).collect();
        let lens: Vec<usize> = grads.iter().map(|(_, g)| g.len()).collect();
        let half = self.wire_format.half();
        self.push_with(id, base_version, &names, &lens, |k, r| match half {
            None => Bytes::copy_from_slice(bytemuck::cast_slice(&grads[k].1[r])),
            Some(h) => strata_ps::encode_half(&grads[k].1[r], h),
        })
    }

    /// [`push`](Self::push) of gradients in [`F32Bytes`]: their memory goes to the connection
    /// as it is, with no copy (in a 16-bit wire format, encoded chunk by chunk).
    pub fn push_shared(&self, id: &UpdateId, base_version: u64, grads: &[(&str, F32Bytes)]) -> Result<PushOutcome> {
        let names: Vec<&str> = grads.iter().map(|(n, _)| *n).collect();
        let lens: Vec<usize> = grads.iter().map(|(_, g)| g.len()).collect();
        let half = self.wire_format.half();
        self.push_with(id, base_version, &names, &lens, |k, r| match half {
            None => grads[k].1.elements(r),
            Some(h) => strata_ps::encode_half_bytes(&grads[k].1.elements(r), h),
        })
    }

    /// [`push`](Self::push) of gradients handed over while the call runs (see [`StagedPush`]):
    /// the call starts when the first gradient is staged (or the push committed), with the
    /// header naming `names` (of the staged push's lengths, in that order), and each
    /// variable's chunks go as soon as it is staged, and the call ends, and the task applies
    /// the push, only once it is committed. An abandoned push is cancelled before its end, so
    /// the task applies nothing of it: [`Error::Aborted`], after which the same update may be
    /// pushed again. Retried like [`push`](Self::push), sending the staged gradients again.
    pub fn push_staged(
        &self,
        id: &UpdateId,
        base_version: u64,
        names: &[&str],
        staged: &StagedPush,
    ) -> Result<PushOutcome> {
        let lens = staged.lens();
        if lens.len() != names.len() {
            return Err(Error::Config(format!(
                "a staged push of {} variables was sent with {} names; name every variable once",
                lens.len(),
                names.len()
            )));
        }
        let header = convert::push_header_spec(id, base_version, names, self.wire_format);
        let half = self.wire_format.half();
        let abandoned = std::sync::atomic::AtomicBool::new(false);
        let timeout = self.config.timeout;
        crate::hooks::before_send_blocking();
        let r = self.retry("Push", || {
            // The call starts with the first gradient (a task may stream a large push from its
            // header on, making other pushes wait), and not at all for a push given up before.
            if let staged::Next::Abandoned = staged.next(0) {
                abandoned.store(true, std::sync::atomic::Ordering::Relaxed);
                return Some(Err(Status::failed_precondition("the push was abandoned")));
            }
            let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(8);
            let svc = self.svc.clone();
            let call = push_call(svc, wire::body(ReceiverStream::new(rx), false));
            let abort = self.abort.clone();
            let task = runtime().spawn(async move {
                tokio::select! {
                    r = tokio::time::timeout(timeout, call) => r,
                    () = raised(abort.as_ref()) => Ok(Err(Status::cancelled("the job failed"))),
                }
            });
            let mut complete = tx
                .blocking_send(wire::message(&PushMessage { kind: Some(push_message::Kind::Header(header.clone())) }))
                .is_ok();
            let mut i = 0;
            while complete {
                let (k, g) = match staged.next(i) {
                    staged::Next::Variable(k, g) => (k, g),
                    staged::Next::End => break,
                    staged::Next::Abandoned => {
                        abandoned.store(true, std::sync::atomic::Ordering::Relaxed);
                        break;
                    }
                };
                i += 1;
                let len = g.len();
                'chunks: for start in (0..len).step_by(MAX_CHUNK_ELEMENTS) {
                    let end = (start + MAX_CHUNK_ELEMENTS).min(len);
                    let data = match half {
                        None => g.elements(start..end),
                        Some(h) => strata_ps::encode_half_bytes(&g.elements(start..end), h),
                    };
                    for b in wire::chunk_message(k as u32, start as u64, data) {
                        if tx.blocking_send(b).is_err() {
                            complete = false;
                            break 'chunks;
                        }
                    }
                }
            }
            if abandoned.load(std::sync::atomic::Ordering::Relaxed) {
                // Cancelled while the request is still open (its sender alive), so the task
                // never sees its end and applies nothing.
                task.abort();
                let _ = runtime().block_on(task);
                drop(tx);
                return Some(Err(Status::failed_precondition("the push was abandoned")));
            }
            drop(tx);
            match runtime().block_on(task) {
                Ok(outcome) => outcome.ok(),
                Err(e) => Some(Err(Status::internal(format!("the Push call stopped: {e}")))),
            }
        });
        if abandoned.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(Error::Aborted(format!(
                "the push to {} was abandoned before its gradients were complete; nothing of it was applied",
                self.task
            )));
        }
        let r = r?;
        crate::hooks::sent(lens.iter().sum::<usize>() * self.wire_format.element_bytes());
        Ok(convert::push_outcome(&r))
    }

    /// [`push`](Self::push) of one update that carries the gradients of variables (`grads`)
    /// and of rows of embedding tables (`rows`, each pulled under its lease by `id.worker`
    /// with [`pull_rows`](Self::pull_rows)): applied as one update, exactly once.
    pub fn push_rows(
        &self,
        id: &UpdateId,
        base_version: u64,
        grads: &[(&str, &[f32])],
        rows: &[RowGrads],
    ) -> Result<PushOutcome> {
        let names: Vec<&str> = grads.iter().map(|(n, _)| *n).collect();
        let values: Vec<&[f32]> =
            grads.iter().map(|(_, g)| *g).chain(rows.iter().map(|r| r.grads.as_slice())).collect();
        let lens: Vec<usize> = values.iter().map(|g| g.len()).collect();
        let half = self.wire_format.half();
        let mut header = convert::push_header_spec(id, base_version, &names, self.wire_format);
        header.rows = tables::rows_spec(rows);
        self.push_header_with(header, &lens, |k, r| match half {
            None => Bytes::copy_from_slice(bytemuck::cast_slice(&values[k][r])),
            Some(h) => strata_ps::encode_half(&values[k][r], h),
        })
    }

    /// The rows `ids` of each table of `tables` this task holds, pulled by `worker` under
    /// `lease` (its step: a push's rows must name the lease they were pulled under; pulling
    /// under the same lease again replaces its rows), in this client's wire format; an
    /// id-space table's rows not seen before are created.
    pub fn pull_rows(&self, worker: &str, lease: u64, tables: &[(&str, &[u64])]) -> Result<RowsPulled> {
        let request = self.pull_rows_request(worker, lease, tables);
        Ok(self.call_pull_rows(request, tables.len(), false)?.0)
    }

    /// Applies the update `id` of `rows` (computed from `base_version`), exactly once as
    /// [`push_rows`](Self::push_rows) does, then pulls the rows of `tables` as
    /// [`pull_rows`](Self::pull_rows) does, in one call: a worker's push of its last step's
    /// rows and its pull of the next step's, in one round trip, the pull reading the push. An
    /// update too large for one request (over [`MAX_CHUNK_BYTES`] with the pull) is pushed on
    /// its own first. A push the task refuses fails the call, and nothing is pulled.
    pub fn push_rows_and_pull(
        &self,
        id: &UpdateId,
        base_version: u64,
        rows: &[RowGrads],
        worker: &str,
        lease: u64,
        tables: &[(&str, &[u64])],
    ) -> Result<(PushOutcome, RowsPulled)> {
        let mut request = self.pull_rows_request(worker, lease, tables);
        let mut header = convert::push_header_spec(id, base_version, &[], self.wire_format);
        header.rows = tables::rows_spec(rows);
        request.push = Some(header);
        request.push_chunks = tables::row_chunks(rows.iter().map(|r| r.grads.as_slice()), self.wire_format);
        if request.encoded_len() > MAX_CHUNK_BYTES {
            let pushed = self.push_rows(id, base_version, &[], rows)?;
            return Ok((pushed, self.pull_rows(worker, lease, tables)?));
        }
        let elements: usize = rows.iter().map(|r| r.grads.len()).sum();
        let (pulled, answer) = self.call_pull_rows(request, tables.len(), true)?;
        crate::hooks::sent(elements * self.wire_format.element_bytes());
        let answer = answer.ok_or_else(|| {
            self.protocol("a PullRows answer without the answer of the push it carried (a parameter server that predates pushes with pulls?)".into())
        })?;
        Ok((convert::push_outcome(&answer), pulled))
    }

    /// The `PullRows` request of `worker`'s rows of `tables` under `lease`, in this client's
    /// wire format.
    fn pull_rows_request(&self, worker: &str, lease: u64, tables: &[(&str, &[u64])]) -> PullRowsRequest {
        PullRowsRequest {
            worker: worker.to_string(),
            lease,
            tables: tables
                .iter()
                .map(|(t, ids)| proto::RowsSpec { table: t.to_string(), lease, ids: ids.to_vec() })
                .collect(),
            wire_format: convert::wire_format_spec(self.wire_format),
            push: None,
            push_chunks: Vec::new(),
        }
    }

    /// Calls `PullRows` with `request` (for `tables` tables; `carries_push`: the request holds
    /// a push, whose answer the header must hold): the rows, and the push's answer.
    fn call_pull_rows(
        &self,
        request: PullRowsRequest,
        tables: usize,
        carries_push: bool,
    ) -> Result<(RowsPulled, Option<proto::PushResponse>)> {
        let format = self.wire_format;
        crate::hooks::before_send_blocking();
        let rpc = if carries_push { "PullRows (with a push)" } else { "PullRows" };
        let messages = self.call(rpc, |mut raw| {
            let request = request.clone();
            async move {
                let mut stream = raw.pull_rows(request).await?.into_inner();
                let mut messages = Vec::new();
                while let Some(m) = stream.message().await? {
                    messages.push(m);
                }
                Ok(messages)
            }
        })?;
        let (pulled, answer) = rows_pulled(messages, tables, format).map_err(|d| self.protocol(d))?;
        crate::hooks::received(pulled.values.iter().map(Vec::len).sum::<usize>() * format.element_bytes());
        Ok((pulled, answer))
    }

    /// Pushes variables `names` of `lens` elements, chunk `r` of variable `k` being `data(k, r)`.
    fn push_with(
        &self,
        id: &UpdateId,
        base_version: u64,
        names: &[&str],
        lens: &[usize],
        data: impl Fn(usize, std::ops::Range<usize>) -> Bytes,
    ) -> Result<PushOutcome> {
        let header = convert::push_header_spec(id, base_version, names, self.wire_format);
        self.push_header_with(header, lens, data)
    }

    /// Pushes the update `header` heads, whose tensors (its variables', then its rows') have
    /// `lens` elements, chunk `r` of tensor `k` being `data(k, r)`.
    fn push_header_with(
        &self,
        header: proto::PushHeader,
        lens: &[usize],
        data: impl Fn(usize, std::ops::Range<usize>) -> Bytes,
    ) -> Result<PushOutcome> {
        let produce = |send: &mut dyn FnMut(Bytes) -> bool| {
            if !send(wire::message(&PushMessage { kind: Some(push_message::Kind::Header(header.clone())) })) {
                return;
            }
            for (k, &len) in lens.iter().enumerate() {
                for start in (0..len).step_by(MAX_CHUNK_ELEMENTS) {
                    let end = (start + MAX_CHUNK_ELEMENTS).min(len);
                    for b in wire::chunk_message(k as u32, start as u64, data(k, start..end)) {
                        if !send(b) {
                            return;
                        }
                    }
                }
            }
        };
        crate::hooks::before_send_blocking();
        let call = |body: tonic::body::Body| push_call(self.svc.clone(), body);
        let r = if lens.iter().sum::<usize>() <= MAX_CHUNK_ELEMENTS {
            // One chunk at most: its messages are made here at once and the call runs on this
            // thread, with no hand-over to the runtime's threads.
            let mut messages = Vec::with_capacity(1 + 2 * lens.len());
            produce(&mut |m| {
                messages.push(m);
                true
            });
            self.call("Push", |_| call(wire::body(tokio_stream::iter(messages.clone()), false)))?
        } else {
            self.stream_call("Push", produce, |stream| call(wire::body(stream, false)))?
        };
        crate::hooks::sent(lens.iter().sum::<usize>() * self.wire_format.element_bytes());
        Ok(convert::push_outcome(&r))
    }

    /// Pulls `names` into `fill`, chunk by chunk as they arrive (while their bytes are still in
    /// cache); returns the pull's header.
    fn pull_with(&self, names: &[&str], min_version: u64, fill: &mut Filling<'_, '_>) -> Result<PullHeader> {
        let format = self.wire_format;
        let request = PullRequest {
            variables: names.iter().map(|n| n.to_string()).collect(),
            min_version,
            wire_format: convert::wire_format_spec(format),
        };
        let request = wire::message(&request);
        crate::hooks::before_send_blocking();
        let fill = std::cell::RefCell::new(fill);
        let pulled = self.call("Pull", |_| {
            let body = wire::body(tokio_stream::once(request.clone()), false);
            let svc = self.svc.clone();
            let fill = &fill;
            async move {
                let mut messages = frames_call(svc, wire::PULL_PATH, body).await?;
                let mut header = None;
                while let Some(m) = messages.next().await? {
                    // Chunks come in the format asked for, which the header confirms.
                    let step = match wire::decode_part::<PullHeader>(m, "Pull", format)? {
                        wire::Part::Header(h) if header.is_none() => {
                            let started = if h.wire_format == convert::wire_format_spec(format) {
                                fill.borrow_mut().start(&h)
                            } else {
                                Err(format!(
                                    "asked for {format} values, the answer holds wire format {} (a parameter server that predates 16-bit pulls?)",
                                    h.wire_format
                                ))
                            };
                            header = Some(h);
                            started
                        }
                        wire::Part::Chunk(c) if header.is_some() => fill.borrow_mut().chunk(&c),
                        _ => Err("the pull stream is out of order".to_string()),
                    };
                    if let Err(detail) = step {
                        return Ok(Err(detail));
                    }
                }
                messages.finish()?;
                Ok(header.ok_or_else(|| "the pull stream has no header".to_string()))
            }
        })?;
        let header = pulled.and_then(|h| fill.borrow().finish().map(|()| h)).map_err(|d| self.protocol(d))?;
        crate::hooks::received(fill.borrow().next.iter().sum::<usize>() * format.element_bytes());
        Ok(header)
    }

    fn protocol(&self, detail: String) -> Error {
        Error::Protocol { peer: self.task.clone(), detail }
    }

    /// The current values of `names` (every variable if empty) once the task's version has
    /// reached `min_version`.
    pub fn pull(&self, names: &[&str], min_version: u64) -> Result<Pulled> {
        let mut fill = Filling { into: Dest::Allocated(Vec::new()), next: Vec::new() };
        let header = self.pull_with(names, min_version, &mut fill)?;
        let Dest::Allocated(values) = fill.into else {
            return Err(self.protocol("pulled values went to the wrong buffers".into()));
        };
        let infos = convert::pulled_variables(&header).map_err(|e| self.protocol(Error::from(e).to_string()))?;
        let versions = header.variable_versions.iter().copied().chain(std::iter::repeat(0));
        Ok(Pulled {
            version: header.version,
            variables: infos.into_iter().zip(versions).zip(values).map(|((i, v), x)| (i, v, x)).collect(),
        })
    }

    /// The hot path of a worker: writes the named variables' values into `out` (same order,
    /// exact lengths) and returns the task's version. Chunks are copied into `out` as they
    /// arrive: after an error, `out` may hold part of the pulled values.
    pub fn pull_into(&self, names: &[&str], min_version: u64, out: &mut [&mut [f32]]) -> Result<u64> {
        if names.is_empty() || names.len() != out.len() {
            return Err(Error::Config(format!(
                "pull_into needs one output buffer per named variable ({} names, {} buffers)",
                names.len(),
                out.len()
            )));
        }
        let mut fill = Filling { into: Dest::Given(out), next: Vec::new() };
        Ok(self.pull_with(names, min_version, &mut fill)?.version)
    }

    /// Writes a checkpoint named for `step`; returns its directory and the task's version.
    pub fn checkpoint(&self, step: u64) -> Result<(PathBuf, u64)> {
        self.checkpoint_of_job(step, 0)
    }

    /// [`checkpoint`](Self::checkpoint) of a task of a job of `num_tasks` ps tasks (0: not
    /// said), which the checkpoint records, so that a restore of the job's checkpoints onto
    /// another number of tasks can tell that it has every old task's.
    pub fn checkpoint_of_job(&self, step: u64, num_tasks: u32) -> Result<(PathBuf, u64)> {
        let request = PsCheckpointRequest { step, num_tasks };
        let r = self.call("Checkpoint", |mut raw| async move { raw.checkpoint(request).await })?;
        let r = r.into_inner();
        Ok((PathBuf::from(r.path), r.version))
    }

    /// What the task holds and has done.
    pub fn status(&self) -> Result<PsStatus> {
        let r = self.call("Status", |mut raw| async move { raw.status(PsStatusRequest {}).await })?.into_inner();
        convert::ps_status(r).map_err(|e| self.protocol(Error::from(e).to_string()))
    }

    /// Tells a sync-mode task how many workers are alive (a round then needs no more pushes
    /// than that).
    pub fn configure(&self, live_workers: u32) -> Result<()> {
        self.call("Configure", |mut raw| async move { raw.configure(PsConfigureRequest { live_workers }).await })?;
        Ok(())
    }
}

/// The rows of a `PullRows` answer's messages (a header, then chunks of `tables` tables in
/// `format`, each table's in order), or what is wrong with them.
fn rows_pulled(
    messages: Vec<proto::PullMessage>,
    tables: usize,
    format: WireFormat,
) -> std::result::Result<(RowsPulled, Option<proto::PushResponse>), String> {
    let mut messages = messages.into_iter();
    let (version, push) = match messages.next().and_then(|m| m.kind) {
        Some(proto::pull_message::Kind::Header(h)) if h.wire_format == convert::wire_format_spec(format) => {
            (h.version, h.push)
        }
        Some(proto::pull_message::Kind::Header(h)) => {
            return Err(format!("asked for {format} rows, the answer holds wire format {}", h.wire_format))
        }
        _ => return Err("the rows' answer does not start with its header".into()),
    };
    let mut values = vec![Vec::new(); tables];
    for m in messages {
        let Some(proto::pull_message::Kind::Chunk(c)) = m.kind else {
            return Err("the rows' answer holds a second header".into());
        };
        let chunk = convert::chunk(c, format).map_err(|e| e.to_string())?;
        let Some(v) = values.get_mut(chunk.var as usize) else {
            return Err(format!("a chunk of table {} of {tables}", chunk.var));
        };
        if chunk.offset != v.len() as u64 {
            return Err(format!("a chunk of table {} at element {} follows {}", chunk.var, chunk.offset, v.len()));
        }
        for piece in &chunk.pieces {
            strata_ps::extend_f32s(piece, v);
        }
    }
    Ok((RowsPulled { version, values }, push))
}
