//! The blocking client of a parameter-server task, used by workers and the coordinator.

use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use prost::bytes::Bytes;
use prost::Message;
use strata_proto::v1::parameter_server_client::ParameterServerClient;
use strata_proto::v1::{
    create_message, push_message, CreateHeader, CreateMessage, PsCheckpointRequest, PsConfigureRequest,
    PsStatusRequest, PullHeader, PullRequest, PushHeader, PushMessage, PushResponse,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::codegen::Service;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use super::state::{chunks_of, copy_f32s, Chunk};
use super::wire;
use super::{
    CreateOutcome, PsMode, PsStatus, Pulled, PushOutcome, ServerOptimizer, UpdateId, VariableInfo, MAX_CHUNK_BYTES,
    MAX_CHUNK_ELEMENTS,
};
use crate::auth::{client_interceptor, ClientAuth, ClusterToken};
use crate::rt::runtime;
use crate::{Error, Result};

type Authed = InterceptedService<Channel, ClientAuth>;
type Raw = ParameterServerClient<Authed>;

/// The largest message a client decodes: one chunk plus its framing.
const MAX_MESSAGE_BYTES: usize = MAX_CHUNK_BYTES + (64 << 10);

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
        let endpoint = Endpoint::from_shared(format!("http://{address}"))
            .map_err(|e| Error::Config(format!("the address {address:?} of {task} is not usable: {e}")))?
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
        Ok(Self { raw, svc, address: address.to_string(), task: task.to_string(), config })
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
            Code::Unavailable | Code::Cancelled => {
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
            code => Error::Rejected { peer: self.task.clone(), rpc: rpc.into(), code: format!("{code:?}"), detail },
        }
    }

    /// Runs `attempt` (`None`: it passed the deadline) until it succeeds, fails for good, or
    /// the task stayed unavailable for `retry_for`.
    fn retry<T>(&self, rpc: &str, mut attempt: impl FnMut() -> Option<Result<T, Status>>) -> Result<T> {
        let deadline = Instant::now() + self.config.retry_for;
        let mut backoff = Duration::from_millis(50);
        loop {
            let err = match attempt() {
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
        self.retry(rpc, || runtime().block_on(async { tokio::time::timeout(timeout, f(self.raw.clone())).await }).ok())
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
            let task = runtime().spawn(async move { tokio::time::timeout(timeout, call).await });
            produce(&mut |m| tx.blocking_send(m).is_ok());
            drop(tx);
            match runtime().block_on(task) {
                Ok(outcome) => outcome.ok(),
                Err(e) => Some(Err(Status::internal(format!("the {rpc} call stopped: {e}")))),
            }
        })
    }

    /// Creates variables with their initial values and sets the optimizer and mode. Creating
    /// variables that exist with the same spec is a no-op (`existed`).
    pub fn create_variables(
        &self,
        vars: &[(VariableInfo, &[f32])],
        optimizer: &ServerOptimizer,
        mode: PsMode,
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
        let header = CreateHeader {
            variables: vars.iter().map(|(i, _)| i.to_spec()).collect(),
            optimizer: Some(optimizer.to_spec()),
            mode: Some(mode.to_spec()),
        };
        let produce = |send: &mut dyn FnMut(CreateMessage) -> bool| {
            if !send(CreateMessage { kind: Some(create_message::Kind::Header(header.clone())) }) {
                return;
            }
            for (k, (_, values)) in vars.iter().enumerate() {
                for c in chunks_of(k as u32, values) {
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
        let r = r.into_inner();
        Ok(CreateOutcome { versions: r.versions, existed: r.existed, version: r.version })
    }

    /// Pushes one update computed from task version `base_version`. Retried with the same
    /// `id` while the task is unavailable, so it is applied at most once; a push refused as
    /// stale is [`Error::Stale`] (pull and compute it again).
    pub fn push(&self, id: &UpdateId, base_version: u64, grads: &[(&str, &[f32])]) -> Result<PushOutcome> {
        let header = PushHeader {
            worker: id.worker.clone(),
            client: id.client.clone(),
            step: id.step,
            seq: id.seq,
            base_version,
            variables: grads.iter().map(|(n, _)| n.to_string()).collect(),
        };
        // The gradient's bytes are copied once, into the buffers the connection sends from.
        let produce = |send: &mut dyn FnMut(Bytes) -> bool| {
            if !send(wire::message(&PushMessage { kind: Some(push_message::Kind::Header(header.clone())) })) {
                return;
            }
            for (k, (_, g)) in grads.iter().enumerate() {
                for (i, c) in g.chunks(MAX_CHUNK_ELEMENTS).enumerate() {
                    let data = Bytes::copy_from_slice(bytemuck::cast_slice(c));
                    for b in wire::chunk_message(k as u32, (i * MAX_CHUNK_ELEMENTS) as u64, data) {
                        if !send(b) {
                            return;
                        }
                    }
                }
            }
        };
        crate::inject::delay_blocking();
        let r = self.stream_call("Push", produce, |stream| {
            let svc = self.svc.clone();
            async move {
                let mut messages = frames_call(svc, wire::PUSH_PATH, wire::body(stream, false)).await?;
                let answer = match (messages.next().await?, messages.next().await?) {
                    (Some(m), None) => PushResponse::decode(m.contiguous())
                        .map_err(|e| Status::internal(format!("a Push answer that is not valid protobuf: {e}")))?,
                    _ => return Err(Status::internal("a Push answer must be one message")),
                };
                messages.finish()?;
                Ok(answer)
            }
        })?;
        crate::inject::count_sent(grads.iter().map(|(_, g)| g.len() * 4).sum());
        Ok(if r.dropped {
            PushOutcome::Dropped { version: r.version }
        } else {
            PushOutcome::Applied { version: r.version, duplicate: r.duplicate }
        })
    }

    fn pull_chunks(&self, names: &[&str], min_version: u64) -> Result<(PullHeader, Vec<Chunk>)> {
        let request = PullRequest { variables: names.iter().map(|n| n.to_string()).collect(), min_version };
        let request = wire::message(&request);
        crate::inject::delay_blocking();
        let pulled = self.call("Pull", |_| {
            let body = wire::body(tokio_stream::once(request.clone()), false);
            let svc = self.svc.clone();
            async move {
                let mut messages = frames_call(svc, wire::PULL_PATH, body).await?;
                let mut header = None;
                let mut chunks = Vec::new();
                while let Some(m) = messages.next().await? {
                    match wire::decode_part::<PullHeader>(m, "Pull")? {
                        wire::Part::Header(h) if header.is_none() => header = Some(h),
                        wire::Part::Chunk(c) if header.is_some() => chunks.push(c),
                        _ => return Err(Status::internal("the pull stream is out of order")),
                    }
                }
                messages.finish()?;
                let header = header.ok_or_else(|| Status::internal("the pull stream has no header"))?;
                Ok((header, chunks))
            }
        })?;
        crate::inject::count_received(pulled.1.iter().map(|c| c.elements() * 4).sum());
        Ok(pulled)
    }

    fn protocol(&self, detail: String) -> Error {
        Error::Protocol { peer: self.task.clone(), detail }
    }

    /// Copies `chunks` into `out` (one slice per variable of the header), checking that they
    /// cover each exactly.
    fn fill(&self, header: &PullHeader, chunks: &[Chunk], out: &mut [&mut [f32]]) -> Result<()> {
        if header.variables.len() != out.len() {
            return Err(self.protocol(format!("pulled {} variables, asked for {}", header.variables.len(), out.len())));
        }
        let mut next = vec![0usize; out.len()];
        for c in chunks {
            let v = c.var as usize;
            let n = c.elements();
            let Some(dst) = out.get_mut(v) else {
                return Err(self.protocol(format!("a chunk of variable #{v}, which was not pulled")));
            };
            let start = c.offset as usize;
            if start != next[v] || start + n > dst.len() {
                return Err(self.protocol(format!("a malformed chunk of variable #{v} at element {start}")));
            }
            let mut at = start;
            for p in &c.pieces {
                copy_f32s(p, &mut dst[at..at + p.len() / 4]);
                at += p.len() / 4;
            }
            next[v] += n;
        }
        for (v, (covered, dst)) in next.iter().zip(out.iter()).enumerate() {
            if *covered != dst.len() {
                return Err(self.protocol(format!("variable #{v} has {} elements, {covered} were pulled", dst.len())));
            }
        }
        Ok(())
    }

    /// The current values of `names` (every variable if empty) once the task's version has
    /// reached `min_version`.
    pub fn pull(&self, names: &[&str], min_version: u64) -> Result<Pulled> {
        let (header, chunks) = self.pull_chunks(names, min_version)?;
        let infos = header
            .variables
            .iter()
            .map(VariableInfo::from_spec)
            .collect::<Result<Vec<_>>>()
            .map_err(|e| self.protocol(e.to_string()))?;
        let mut values: Vec<Vec<f32>> = infos.iter().map(|i| vec![0.0; i.numel()]).collect();
        {
            let mut out: Vec<&mut [f32]> = values.iter_mut().map(|v| v.as_mut_slice()).collect();
            self.fill(&header, &chunks, &mut out)?;
        }
        let versions = header.variable_versions.iter().copied().chain(std::iter::repeat(0));
        Ok(Pulled {
            version: header.version,
            variables: infos.into_iter().zip(versions).zip(values).map(|((i, v), x)| (i, v, x)).collect(),
        })
    }

    /// The hot path of a worker: writes the named variables' values into `out` (same order,
    /// exact lengths) and returns the task's version.
    pub fn pull_into(&self, names: &[&str], min_version: u64, out: &mut [&mut [f32]]) -> Result<u64> {
        if names.is_empty() || names.len() != out.len() {
            return Err(Error::Config(format!(
                "pull_into needs one output buffer per named variable ({} names, {} buffers)",
                names.len(),
                out.len()
            )));
        }
        let (header, chunks) = self.pull_chunks(names, min_version)?;
        self.fill(&header, &chunks, out)?;
        Ok(header.version)
    }

    /// Writes a checkpoint named for `step`; returns its directory and the task's version.
    pub fn checkpoint(&self, step: u64) -> Result<(PathBuf, u64)> {
        let r = self.call("Checkpoint", |mut raw| async move { raw.checkpoint(PsCheckpointRequest { step }).await })?;
        let r = r.into_inner();
        Ok((PathBuf::from(r.path), r.version))
    }

    /// What the task holds and has done.
    pub fn status(&self) -> Result<PsStatus> {
        let r = self.call("Status", |mut raw| async move { raw.status(PsStatusRequest {}).await })?.into_inner();
        let variables = r
            .variables
            .iter()
            .map(VariableInfo::from_spec)
            .collect::<Result<Vec<_>>>()
            .map_err(|e| self.protocol(e.to_string()))?;
        let versions = r.variable_versions.iter().copied().chain(std::iter::repeat(0));
        Ok(PsStatus {
            task: r.task,
            version: r.version,
            variables: variables.into_iter().zip(versions).collect(),
            pushes_applied: r.pushes_applied,
            pushes_duplicate: r.pushes_duplicate,
            pushes_dropped: r.pushes_dropped,
            pushes_stale: r.pushes_stale,
            restored_step: r.restored_step,
            restored_version: r.restored_version,
            mode: PsMode::from_spec(&r.mode.unwrap_or_default()).map_err(|e| self.protocol(e.to_string()))?,
            optimizer: r
                .optimizer
                .map(|o| ServerOptimizer::from_spec(&o))
                .transpose()
                .map_err(|e| self.protocol(e.to_string()))?,
            rounds: r.rounds,
            applied_by_worker: r.applied_by_worker.into_iter().collect(),
        })
    }

    /// Tells a sync-mode task how many workers are alive (a round then needs no more pushes
    /// than that).
    pub fn configure(&self, live_workers: u32) -> Result<()> {
        self.call("Configure", |mut raw| async move { raw.configure(PsConfigureRequest { live_workers }).await })?;
        Ok(())
    }
}
