//! The parameter server's gRPC service (`strata ps` runs it).

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use candle_core::{Device, Tensor};
use prost::bytes::Bytes;
use prost::Message;
use serde::{Deserialize, Serialize};
use strata_core::checkpoint::{self, CheckpointTensor, CheckpointWriter, ShardInfo};
use strata_proto::v1::parameter_server_server::{ParameterServer, ParameterServerServer};
use strata_proto::v1::{
    create_message, pull_message, push_message, CreateMessage, CreateVariablesResponse, PsCheckpointRequest,
    PsCheckpointResponse, PsConfigureRequest, PsConfigureResponse, PsStatusRequest, PsStatusResponse, PullHeader,
    PullMessage, PullRequest, PushHeader, PushMessage, PushResponse, TensorChunk,
};
use tokio::sync::watch;
use tokio_stream::Stream;
use tonic::codegen::{http, Service};
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status, Streaming};

use super::faults::Faulty;
use super::state::{check_chunk_len, Answer, Chunk, Counters, PushDecision, Snapshot, State, Streamed, UpdateKey};
use super::wire;
use super::{PsMode, PsServerConfig, ServerOptimizer, VariableInfo, MAX_CHUNK_BYTES};
use crate::auth::server_interceptor;
use crate::rt::{runtime, ServerTask};
use crate::{Error, Result};

/// The largest message the server decodes: one chunk plus its framing.
const MAX_MESSAGE_BYTES: usize = MAX_CHUNK_BYTES + (64 << 10);

/// How long a pull waits for `min_version` when the call carries no deadline.
const MAX_PULL_WAIT: Duration = Duration::from_secs(300);

/// The safetensors file of a ps checkpoint.
const VARIABLES_FILE: &str = "variables.safetensors";

/// A collected push waits to be applied while a streamed push is in progress and receives a
/// chunk at least this often: applying it would make the streamed one fail with `ABORTED` (it
/// commits only onto the version it was computed from). A stream that stalls this long loses
/// its turn, so a stalled client delays the others by this much at most.
const STREAM_STALL: Duration = Duration::from_secs(1);

struct Shared {
    config: PsServerConfig,
    state: Mutex<State>,
    version: watch::Sender<u64>,
    /// Whether a streamed push is in progress (mirrors the state's flag, for waiting).
    streaming: watch::Sender<bool>,
    /// Chunks applied by streamed pushes (their progress, for waiting).
    streamed_chunks: AtomicU64,
    /// Collected pushes waiting for a stream to end: no new stream begins while there are any,
    /// so a steady flow of large pushes cannot keep them waiting.
    waiting: AtomicUsize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic under the lock cannot leave the state half-changed (every method validates
        // first), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[derive(Clone)]
struct Svc(Arc<Shared>);

fn chunk_of(c: strata_proto::v1::TensorChunk) -> Result<Chunk, Status> {
    check_chunk_len(c.data.len())?;
    Ok(Chunk { var: c.variable, offset: c.offset, pieces: vec![c.data] })
}

/// Collects the parts of a `Push` (or `CreateVariables`) stream: one header first, then chunks,
/// their bytes bounded by what the task could hold (`max_bytes`).
struct Collect<H> {
    what: &'static str,
    header: Option<H>,
    chunks: Vec<Chunk>,
    bytes: usize,
    max_bytes: usize,
}

impl<H> Collect<H> {
    fn new(what: &'static str, max_bytes: usize) -> Self {
        Self { what, header: None, chunks: Vec::new(), bytes: 0, max_bytes }
    }

    fn header(&mut self, h: H) -> Result<(), Status> {
        if self.header.replace(h).is_some() {
            return Err(Status::invalid_argument(format!("a {} stream carries two headers", self.what)));
        }
        Ok(())
    }

    /// Keeps a chunk that [`count`](Self::count) took.
    fn keep(&mut self, c: Chunk) {
        self.chunks.push(c);
    }

    /// Counts a chunk against the stream's bound, and keeps it.
    fn chunk(&mut self, c: Chunk) -> Result<(), Status> {
        self.count(&c)?;
        self.keep(c);
        Ok(())
    }

    /// Counts a chunk against the stream's bound.
    fn count(&mut self, c: &Chunk) -> Result<(), Status> {
        if self.header.is_none() {
            return Err(Status::invalid_argument(format!("a {} stream must start with its header", self.what)));
        }
        self.bytes += c.elements() * 4;
        if self.bytes > self.max_bytes {
            return Err(Status::invalid_argument(format!(
                "the {} stream carries more than {} bytes, more than its variables can hold",
                self.what, self.max_bytes
            )));
        }
        Ok(())
    }

    fn finish(self) -> Result<(H, Vec<Chunk>), Status> {
        let header =
            self.header.ok_or_else(|| Status::invalid_argument(format!("a {} stream without a header", self.what)))?;
        Ok((header, self.chunks))
    }
}

/// Waits until the task's version exceeds `base` (the round computed from it was applied).
async fn wait_round(shared: &Shared, key: &UpdateKey, base: u64, duplicate: bool) -> Result<PushResponse, Status> {
    let mut rx = shared.version.subscribe();
    let waited = tokio::time::timeout(shared.config.round_timeout, rx.wait_for(|&v| v > base)).await.map(|_| ());
    let answer = shared.lock().answer(key);
    match (waited, answer) {
        (_, Some(Answer::Applied(version))) => Ok(PushResponse { applied: true, duplicate, dropped: false, version }),
        (_, Some(Answer::Dropped(version))) => Ok(PushResponse { applied: false, duplicate, dropped: true, version }),
        (Err(_), _) => Err(Status::deadline_exceeded(format!(
            "the sync round from version {base} of {} did not complete within {:?}: fewer workers pushed than it needs (is a worker down?)",
            shared.config.task, shared.config.round_timeout
        ))),
        (Ok(_), _) => Err(Status::internal(format!(
            "the sync round from version {base} of {} completed without recording this update",
            shared.config.task
        ))),
    }
}

type PullStream = Pin<Box<dyn Stream<Item = Result<PullMessage, Status>> + Send>>;

/// The streamed push a `Push` call may carry: aborted if the call ends (or its future is
/// dropped, as when the client goes away) before [`push`] finishes it.
struct StreamGuard<'a> {
    shared: &'a Shared,
    streamed: Option<Streamed>,
}

impl<'a> StreamGuard<'a> {
    fn new(shared: &'a Shared) -> Self {
        Self { shared, streamed: None }
    }

    /// Streams the push headed by `h`, if the task takes it as a streamed push and no
    /// collected push is waiting.
    fn begin(&mut self, h: &PushHeader) {
        if self.shared.waiting.load(Ordering::Relaxed) > 0 {
            return;
        }
        let mut state = self.shared.lock();
        self.streamed = state.begin_stream(h);
        if self.streamed.is_some() {
            self.shared.streaming.send_replace(true);
        }
    }

    /// Applies a received chunk if the push is streamed (the chunk is dropped then), or keeps
    /// it in `parts`.
    fn chunk(&mut self, c: Chunk, parts: &mut Collect<PushHeader>) -> Result<(), Status> {
        parts.count(&c)?;
        match &mut self.streamed {
            Some(s) => {
                s.apply(&c)?;
                self.shared.streamed_chunks.fetch_add(1, Ordering::Relaxed);
            }
            None => parts.keep(c),
        }
        Ok(())
    }
}

/// Counts a collected push among the waiting ones until it is dropped (also when its call is).
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Self(count)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Waits while a streamed push is in progress and making progress (see [`STREAM_STALL`]);
/// returns whether one stalled. A push that waits is counted in `waiting` until it is
/// decided, so that no new stream begins before it.
async fn wait_for_stream<'a>(shared: &'a Shared, waiting: &mut Option<Waiting<'a>>) -> bool {
    let mut rx = shared.streaming.subscribe();
    if !*rx.borrow_and_update() {
        return false;
    }
    waiting.get_or_insert_with(|| Waiting::new(&shared.waiting));
    while *rx.borrow_and_update() {
        let seen = shared.streamed_chunks.load(Ordering::Relaxed);
        if tokio::time::timeout(STREAM_STALL, rx.wait_for(|s| !*s)).await.is_ok() {
            return false;
        }
        if shared.streamed_chunks.load(Ordering::Relaxed) == seen {
            return true;
        }
    }
    false
}

impl Drop for StreamGuard<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.streamed.take() {
            let mut state = self.shared.lock();
            state.abort_stream(s);
            self.shared.streaming.send_replace(false);
        }
    }
}

/// Applies (or queues, or refuses) a received push, and answers it; `stream` finishes it if it
/// was streamed.
async fn push(
    shared: &Shared,
    header: &PushHeader,
    chunks: &[Chunk],
    mut stream: StreamGuard<'_>,
) -> Result<PushResponse, Status> {
    let mut waiting = None;
    let decision = loop {
        // A collected push waits for a streamed one in progress (checked again under the lock,
        // where streams begin), unless that one stalled.
        let stalled = stream.streamed.is_none() && wait_for_stream(shared, &mut waiting).await;
        let mut state = shared.lock();
        let before = state.version;
        let decision = match stream.streamed.take() {
            Some(s) => {
                let decision = state.finish_stream(s);
                shared.streaming.send_replace(false);
                decision
            }
            None if state.streaming() && !stalled => continue,
            None => state.push(header, chunks),
        };
        if state.version != before {
            shared.version.send_replace(state.version);
        }
        break decision?;
    };
    drop(waiting);
    Ok(match decision {
        PushDecision::Done(r) => r,
        PushDecision::Wait { key, base, duplicate } => wait_round(shared, &key, base, duplicate).await?,
    })
}

/// The header and chunks (sharing the variables' memory) of a pull, once the task's version
/// has reached the request's `min_version`.
async fn pull(shared: &Shared, r: &PullRequest) -> Result<(PullHeader, Vec<TensorChunk>), Status> {
    if r.min_version > 0 {
        let mut rx = shared.version.subscribe();
        if tokio::time::timeout(MAX_PULL_WAIT, rx.wait_for(|&v| v >= r.min_version)).await.is_err() {
            return Err(Status::deadline_exceeded(format!(
                "{} did not reach version {} within {MAX_PULL_WAIT:?}",
                shared.config.task, r.min_version
            )));
        }
    }
    shared.lock().pull(&r.variables)
}

/// `Push` below tonic's codec: the chunks stay in the HTTP/2 frames they arrived in until they
/// are applied.
async fn push_frames(shared: &Shared, body: tonic::body::Body) -> Result<PushResponse, Status> {
    let mut messages = wire::Messages::new(body, MAX_MESSAGE_BYTES);
    let mut parts = Collect::new("Push", shared.lock().bytes());
    let mut stream = StreamGuard::new(shared);
    while let Some(m) = messages.next().await? {
        match wire::decode_part::<PushHeader>(m, "Push")? {
            wire::Part::Header(h) => {
                if parts.header.is_none() {
                    stream.begin(&h);
                }
                parts.header(h)?
            }
            wire::Part::Chunk(c) => stream.chunk(c, &mut parts)?,
        }
    }
    let (header, chunks) = parts.finish()?;
    push(shared, &header, &chunks, stream).await
}

/// `Pull` below tonic's codec: every chunk leaves as the variable's own memory.
async fn pull_frames(shared: &Shared, body: tonic::body::Body) -> Result<Vec<Bytes>, Status> {
    let mut messages = wire::Messages::new(body, MAX_MESSAGE_BYTES);
    let request = match (messages.next().await?, messages.next().await?) {
        (Some(m), None) => PullRequest::decode(m.contiguous())
            .map_err(|e| Status::invalid_argument(format!("a Pull request that is not valid protobuf: {e}")))?,
        _ => return Err(Status::invalid_argument("a Pull call carries exactly one request message")),
    };
    let (header, chunks) = pull(shared, &request).await?;
    let mut out = Vec::with_capacity(1 + 2 * chunks.len());
    out.push(wire::message(&PullMessage { kind: Some(pull_message::Kind::Header(header)) }));
    for c in chunks {
        out.extend(wire::chunk_message(c.variable, c.offset, c.data));
    }
    Ok(out)
}

/// The `ParameterServer` service with `Push` and `Pull` served below tonic's codec
/// ([`wire`]) and every other method by the generated server.
#[derive(Clone)]
struct TensorPaths {
    shared: Arc<Shared>,
    generated: ParameterServerServer<Svc>,
}

impl tonic::server::NamedService for TensorPaths {
    const NAME: &'static str = <ParameterServerServer<Svc> as tonic::server::NamedService>::NAME;
}

impl Service<http::Request<tonic::body::Body>> for TensorPaths {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let shared = self.shared.clone();
        match req.uri().path() {
            wire::PUSH_PATH => Box::pin(async move {
                let answer = push_frames(&shared, req.into_body()).await;
                Ok(wire::response(answer.map(|r| tokio_stream::once(wire::message(&r)))))
            }),
            wire::PULL_PATH => Box::pin(async move {
                let answer = pull_frames(&shared, req.into_body()).await;
                Ok(wire::response(answer.map(tokio_stream::iter)))
            }),
            _ => {
                let mut generated = self.generated.clone();
                Box::pin(async move { generated.call(req).await })
            }
        }
    }
}

#[tonic::async_trait]
impl ParameterServer for Svc {
    async fn create_variables(
        &self,
        req: Request<Streaming<CreateMessage>>,
    ) -> Result<Response<CreateVariablesResponse>, Status> {
        let mut stream = req.into_inner();
        let mut parts = Collect::new("CreateVariables", usize::MAX);
        while let Some(msg) = stream.message().await? {
            match msg.kind {
                Some(create_message::Kind::Header(h)) => parts.header(h)?,
                Some(create_message::Kind::Chunk(c)) => {
                    parts.chunk(chunk_of(c)?)?;
                }
                None => return Err(Status::invalid_argument("an empty CreateVariables message")),
            }
        }
        let (header, chunks) = parts.finish()?;
        let response = self.0.lock().create(&header, &chunks)?;
        tracing::info!(task = %self.0.config.task, variables = header.variables.len(), existed = response.existed, "variables created");
        Ok(Response::new(response))
    }

    async fn push(&self, req: Request<Streaming<PushMessage>>) -> Result<Response<PushResponse>, Status> {
        let mut stream = req.into_inner();
        let mut parts = Collect::new("Push", self.0.lock().bytes());
        while let Some(msg) = stream.message().await? {
            match msg.kind {
                Some(push_message::Kind::Header(h)) => parts.header(h)?,
                Some(push_message::Kind::Chunk(c)) => {
                    parts.chunk(chunk_of(c)?)?;
                }
                None => return Err(Status::invalid_argument("an empty Push message")),
            }
        }
        let (header, chunks) = parts.finish()?;
        push(&self.0, &header, &chunks, StreamGuard::new(&self.0)).await.map(Response::new)
    }

    type PullStream = PullStream;

    async fn pull(&self, req: Request<PullRequest>) -> Result<Response<Self::PullStream>, Status> {
        let (header, chunks) = pull(&self.0, &req.into_inner()).await?;
        let messages = std::iter::once(PullMessage { kind: Some(pull_message::Kind::Header(header)) })
            .chain(chunks.into_iter().map(|c| PullMessage { kind: Some(pull_message::Kind::Chunk(c)) }))
            .map(Ok);
        Ok(Response::new(Box::pin(tokio_stream::iter(messages))))
    }

    async fn checkpoint(&self, req: Request<PsCheckpointRequest>) -> Result<Response<PsCheckpointResponse>, Status> {
        let step = req.into_inner().step;
        let Some(root) = self.0.config.checkpoint_dir.clone() else {
            return Err(Status::failed_precondition(format!(
                "{} has no checkpoint directory; start the ps task with one (strata ps --checkpoint-dir DIR)",
                self.0.config.task
            )));
        };
        let snapshot = self.0.lock().snapshot();
        let keep = self.0.config.keep_checkpoints.max(1);
        let version = snapshot.version;
        let written = tokio::task::spawn_blocking(move || write_snapshot(&root, step, snapshot, keep))
            .await
            .map_err(|_| Status::internal("the checkpoint writer stopped"))?
            .map_err(|e| Status::internal(e.to_string()))?;
        tracing::info!(task = %self.0.config.task, step, version, path = %written.display(), "checkpoint written");
        Ok(Response::new(PsCheckpointResponse { path: written.display().to_string(), version }))
    }

    async fn status(&self, _req: Request<PsStatusRequest>) -> Result<Response<PsStatusResponse>, Status> {
        Ok(Response::new(self.0.lock().status()))
    }

    async fn configure(&self, req: Request<PsConfigureRequest>) -> Result<Response<PsConfigureResponse>, Status> {
        let live = req.into_inner().live_workers;
        let mut state = self.0.lock();
        if state.configure(live) {
            self.0.version.send_replace(state.version);
        }
        Ok(Response::new(PsConfigureResponse {}))
    }
}

/// The metadata of a ps checkpoint (in the manifest, as JSON).
#[derive(Serialize, Deserialize)]
struct PsMeta {
    task: String,
    version: u64,
    variables: Vec<(VariableInfo, u64)>,
    optimizer: Option<ServerOptimizer>,
    mode: Option<PsMode>,
    counters: Counters,
    table: Vec<(UpdateKey, Answer)>,
}

const META_KEY: &str = "strata.ps";

fn to_tensor(values: Vec<f32>, shape: &[usize]) -> Result<Tensor> {
    Tensor::from_vec(values, shape, &Device::Cpu)
        .map_err(|e| Error::Config(format!("building a checkpoint tensor: {e}")))
}

fn write_snapshot(root: &Path, step: u64, snap: Snapshot, keep: usize) -> Result<PathBuf> {
    let mut entries = Vec::new();
    let mut infos = Vec::new();
    for (info, version, value, slots) in snap.variables {
        let shard = (info.num_parts > 1).then_some(ShardInfo {
            index: info.part as usize,
            count: info.num_parts as usize,
            offset: info.row_offset as usize,
        });
        let mut t =
            CheckpointTensor::new(format!("var/{}", info.name), to_tensor(value, &info.shape)?).with_version(version);
        if let Some(s) = shard {
            t = t.with_shard(s);
        }
        entries.push(t);
        for (k, slot) in slots.into_iter().enumerate() {
            entries.push(CheckpointTensor::new(format!("slot/{}/{k}", info.name), to_tensor(slot, &info.shape)?));
        }
        infos.push((info, version));
    }
    let meta = PsMeta {
        task: snap.task,
        version: snap.version,
        variables: infos,
        optimizer: snap.optimizer,
        mode: snap.mode,
        counters: snap.counters,
        table: snap.table,
    };
    let meta = serde_json::to_string(&meta).map_err(|e| Error::Config(format!("encoding checkpoint metadata: {e}")))?;
    let dir = CheckpointWriter::new(root, step).meta(META_KEY, meta).file(VARIABLES_FILE, entries).write()?;
    checkpoint::keep_last(root, keep)?;
    Ok(dir)
}

/// Reads a ps checkpoint: `path` is one `ckpt-*` directory or a root holding them.
fn read_snapshot(path: &Path) -> Result<(Snapshot, u64)> {
    let ckpt = if path.join(checkpoint::MANIFEST).is_file() {
        checkpoint::read_checkpoint(path)?
    } else {
        checkpoint::read_latest(path)?.ok_or_else(|| {
            Error::Config(format!("{}: no checkpoint to restore (no ckpt-* directory in it)", path.display()))
        })?
    };
    let bad = |what: String| Error::Config(format!("{}: {what}", ckpt.dir.display()));
    let meta = ckpt.metadata.get(META_KEY).ok_or_else(|| {
        bad("not a parameter-server checkpoint (no strata.ps metadata); restore a ps task's own".into())
    })?;
    let meta: PsMeta =
        serde_json::from_str(meta).map_err(|e| bad(format!("corrupt parameter-server metadata: {e}")))?;
    let slots = meta.optimizer.as_ref().map_or(0, ServerOptimizer::slots);
    let read = |name: &str, numel: usize| -> Result<Vec<f32>> {
        let t = ckpt.tensor(name)?;
        let v = t
            .flatten_all()
            .and_then(|t| t.to_dtype(candle_core::DType::F32))
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| bad(format!("tensor {name}: {e}")))?;
        if v.len() != numel {
            return Err(bad(format!("tensor {name} has {} elements, the manifest says {numel}", v.len())));
        }
        Ok(v)
    };
    let mut variables = Vec::new();
    for (info, version) in meta.variables {
        let n = info.numel();
        let value = read(&format!("var/{}", info.name), n)?;
        let slots = (0..slots).map(|k| read(&format!("slot/{}/{k}", info.name), n)).collect::<Result<Vec<_>>>()?;
        variables.push((info, version, value, slots));
    }
    let snap = Snapshot {
        task: meta.task,
        version: meta.version,
        variables,
        optimizer: meta.optimizer,
        mode: meta.mode,
        counters: meta.counters,
        table: meta.table,
    };
    Ok((snap, ckpt.step))
}

/// A running parameter-server task.
pub struct PsServerHandle {
    address: SocketAddr,
    task: String,
    server: ServerTask,
}

impl std::fmt::Debug for PsServerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PsServerHandle").field("task", &self.task).field("address", &self.address).finish()
    }
}

impl PsServerHandle {
    /// Restores `config.restore` (if set) and starts serving on `bind` (port 0 picks a free
    /// one). Must not be called from inside a tokio runtime thread.
    pub fn start(bind: SocketAddr, config: PsServerConfig) -> Result<Self> {
        let mut state = State::new(config.task.clone(), config.stream_min_bytes);
        if let Some(path) = &config.restore {
            let (snap, step) = read_snapshot(path)?;
            tracing::info!(task = %config.task, step, version = snap.version, "restored from a checkpoint");
            state.restore(snap, step);
        }
        let listener = runtime()
            .block_on(tokio::net::TcpListener::bind(bind))
            .map_err(|e| Error::io(format!("binding the parameter server {} to {bind}", config.task), e))?;
        let address =
            listener.local_addr().map_err(|e| Error::io(format!("reading the address of {}", config.task), e))?;
        let (version, _) = watch::channel(state.version);
        let task = config.task.clone();
        let interceptor = server_interceptor(config.token.clone());
        let shared = Arc::new(Shared {
            config,
            state: Mutex::new(state),
            version,
            streaming: watch::channel(false).0,
            streamed_chunks: AtomicU64::new(0),
            waiting: AtomicUsize::new(0),
        });
        let (tx, mut rx) = watch::channel(false);
        let name = task.clone();
        let builder = crate::auth::server_builder(&shared.config.token)?;
        let done = runtime().spawn(async move {
            let (reporter, health) = tonic_health::server::health_reporter();
            reporter.set_serving::<ParameterServerServer<Svc>>().await;
            let generated = ParameterServerServer::new(Svc(shared.clone()))
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES);
            let faults = shared.config.faults.clone();
            let service = TensorPaths { shared, generated };
            let router = builder
                .tcp_nodelay(true)
                .initial_stream_window_size(8 << 20)
                .initial_connection_window_size(32 << 20)
                .max_frame_size(crate::rt::frame_size())
                .add_service(InterceptedService::new(health, interceptor.clone()));
            // Faults (tests only) are a layer around the service, never a branch of its pushes.
            let router = if faults.any() {
                router.add_service(InterceptedService::new(Faulty::new(service, faults), interceptor))
            } else {
                router.add_service(InterceptedService::new(service, interceptor))
            };
            let result = router
                .serve_with_incoming_shutdown(crate::rt::incoming(listener), async {
                    let _ = rx.wait_for(|s| *s).await;
                })
                .await;
            if let Err(e) = result {
                tracing::error!(task = %name, error = %e, "the parameter server stopped");
            }
        });
        tracing::info!(%task, %address, "parameter server listening");
        Ok(Self { address, task, server: ServerTask::new(tx, done) })
    }

    /// Where the task listens.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Stops serving and returns when the server task ended (open calls get up to 5 s).
    pub fn shutdown(mut self) {
        self.server.stop();
    }

    /// Blocks until the server stops.
    pub fn wait(mut self) {
        self.server.wait();
    }
}
