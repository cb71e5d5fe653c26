//! The parameter server's gRPC service (`strata ps` runs it).

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use prost::bytes::Bytes;
use prost::Message;
use strata_proto::v1::parameter_server_server::{ParameterServer, ParameterServerServer};
use strata_proto::v1::{
    create_message, pull_message, push_message, CreateMessage, CreateVariablesResponse, PsCheckpointRequest,
    PsCheckpointResponse, PsConfigureRequest, PsConfigureResponse, PsStatusRequest, PsStatusResponse, PullHeader,
    PullMessage, PullRequest, PullRowsRequest, PushMessage, PushResponse, TensorChunk,
};
use strata_ps::{
    job_checkpoint_tasks, read_job_checkpoint_at, read_snapshot, write_job_snapshot, write_snapshot, Chunk, PullResult,
    PushDecision, PushHeader, PushReply, RowPull, State, Streamed, UpdateKey, WireFormat, MAX_CHUNK_BYTES,
};
use tokio::sync::watch;
use tokio_stream::Stream;
use tonic::codegen::{http, Service};
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status, Streaming};

use super::convert::{self, status};
use super::faults::Faulty;
use super::tables;
use super::wire;
use super::PsServerConfig;
use crate::auth::server_interceptor;
use crate::guard::DecodeErrors;
use crate::lifecycle::ServerHandle;
use crate::Result;

/// The largest message the server decodes: one chunk plus its framing.
const MAX_MESSAGE_BYTES: usize = MAX_CHUNK_BYTES + (64 << 10);

/// How long a pull waits for `min_version` when the call carries no deadline.
const MAX_PULL_WAIT: Duration = Duration::from_secs(300);

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
    /// Counts a received push chunk, if the config asks for it.
    fn count_push_chunk(&self) {
        if let Some(c) = &self.config.push_chunks {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic under the lock cannot leave the state half-changed (every method validates
        // first), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[derive(Clone)]
struct Svc(Arc<Shared>);

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
                "the {} stream carries more than {} bytes, the limit: more than its variables can hold",
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

/// A status from reading a request stream: the codec's refusals of undecodable messages are
/// `INVALID_ARGUMENT` (see [`crate::guard`]).
fn decode_status(s: Status) -> Status {
    crate::guard::undecodable(&s).unwrap_or(s)
}

/// Waits until the task's version exceeds `base` (the round computed from it was applied).
async fn wait_round(shared: &Shared, key: &UpdateKey, base: u64, duplicate: bool) -> strata_ps::Result<PushReply> {
    let mut rx = shared.version.subscribe();
    let waited = tokio::time::timeout(shared.config.round_timeout, rx.wait_for(|&v| v > base)).await.map(|_| ());
    let reply = shared.lock().answer(key).and_then(|a| a.reply(duplicate));
    let task = shared.config.task.clone();
    match (waited, reply) {
        (_, Some(reply)) => Ok(reply),
        (Err(_), None) => Err(strata_ps::Error::RoundTimeout { task, base, timeout: shared.config.round_timeout }),
        (Ok(_), None) => Err(strata_ps::Error::RoundUnrecorded { task, base }),
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
                s.apply(&c).map_err(status)?;
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
) -> strata_ps::Result<PushResponse> {
    let mut waiting = None;
    let decision = loop {
        // A collected push waits for a streamed one in progress (checked again under the lock,
        // where streams begin), unless that one stalled.
        let stalled = stream.streamed.is_none() && wait_for_stream(shared, &mut waiting).await;
        let mut state = shared.lock();
        let before = state.version();
        let decision = match stream.streamed.take() {
            Some(s) => {
                let decision = state.finish_stream(s);
                shared.streaming.send_replace(false);
                decision
            }
            None if state.streaming() && !stalled => continue,
            None => state.push(header, chunks),
        };
        if state.version() != before {
            shared.version.send_replace(state.version());
        }
        break decision?;
    };
    drop(waiting);
    let reply = match decision {
        PushDecision::Done(r) => r,
        PushDecision::Wait { key, base, duplicate } => wait_round(shared, &key, base, duplicate).await?,
    };
    Ok(convert::push_response(reply))
}

/// The header and chunks (sharing the variables' memory) of a pull, once the task's version
/// has reached the request's `min_version`.
async fn pull(shared: &Shared, r: &PullRequest) -> strata_ps::Result<PullResult> {
    if r.min_version > 0 {
        let mut rx = shared.version.subscribe();
        if tokio::time::timeout(MAX_PULL_WAIT, rx.wait_for(|&v| v >= r.min_version)).await.is_err() {
            return Err(strata_ps::Error::VersionTimeout {
                task: shared.config.task.clone(),
                version: r.min_version,
                waited: MAX_PULL_WAIT,
            });
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
    // The chunks' element type, from the header (chunks before it are refused).
    let mut format = WireFormat::F32;
    while let Some(m) = messages.next().await? {
        match wire::decode_part::<strata_proto::v1::PushHeader>(m, "Push", format)? {
            wire::Part::Header(h) => {
                let (h, f) = convert::push_header(h).map_err(status)?;
                if parts.header.is_none() {
                    format = f;
                    // A push's rows of embedding tables may carry their gradients too.
                    parts.max_bytes = parts.max_bytes.saturating_add(shared.lock().row_bytes(&h.rows));
                    stream.begin(&h);
                }
                parts.header(h)?
            }
            wire::Part::Chunk(c) => {
                shared.count_push_chunk();
                stream.chunk(c, &mut parts)?
            }
        }
    }
    let (mut header, chunks) = parts.finish()?;
    let chunks = tables::take_row_chunks(&mut header, chunks).map_err(status)?;
    push(shared, &header, &chunks, stream).await.map_err(status)
}

/// The push a `PullRows` request carries (`header`, its gradients in `chunks`): read and
/// bounded as `Push`'s messages are, then applied (exactly once) as a collected push.
async fn carried_push(
    shared: &Shared,
    header: strata_proto::v1::PushHeader,
    chunks: Vec<strata_proto::v1::TensorChunk>,
) -> Result<PushResponse, Status> {
    let (h, format) = convert::push_header(header).map_err(status)?;
    let mut parts = Collect::new("PullRows push", shared.lock().bytes());
    parts.max_bytes = parts.max_bytes.saturating_add(shared.lock().row_bytes(&h.rows));
    parts.header(h)?;
    for c in chunks {
        shared.count_push_chunk();
        parts.chunk(convert::chunk(c, format).map_err(status)?)?;
    }
    let (mut header, chunks) = parts.finish()?;
    let chunks = tables::take_row_chunks(&mut header, chunks).map_err(status)?;
    push(shared, &header, &chunks, StreamGuard::new(shared)).await.map_err(status)
}

/// The buffers of a `Pull` answer, made as the connection takes them.
type PullBuffers = Box<dyn Iterator<Item = Bytes> + Send>;

/// `Pull` below tonic's codec: every f32 chunk leaves as the variable's own memory; a 16-bit
/// chunk is encoded when the connection takes it (one chunk's copy at a time).
async fn pull_frames(shared: &Shared, body: tonic::body::Body) -> Result<PullBuffers, Status> {
    let mut messages = wire::Messages::new(body, MAX_MESSAGE_BYTES);
    let request = match (messages.next().await?, messages.next().await?) {
        (Some(m), None) => PullRequest::decode(m.contiguous())
            .map_err(|e| Status::invalid_argument(format!("a Pull request that is not valid protobuf: {e}")))?,
        _ => return Err(Status::invalid_argument("a Pull call carries exactly one request message")),
    };
    // Refused before waiting for `min_version` and before reading anything.
    let format = convert::wire_format(request.wire_format).map_err(status)?;
    let pulled = pull(shared, &request).await.map_err(status)?;
    let (header, chunks) = convert::pull_parts(pulled, format);
    let header = wire::message(&PullMessage { kind: Some(pull_message::Kind::Header(header)) });
    let chunks = chunks.flat_map(|(var, offset, data)| wire::chunk_message(var, offset, data));
    Ok(Box::new(std::iter::once(header).chain(chunks)))
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
        // Bounded by what the header declares (itself bounded by the task's limits), once it
        // has arrived: the chunks before it are refused.
        let mut parts = Collect::new("CreateVariables", 0);
        while let Some(msg) = stream.message().await.map_err(decode_status)? {
            match msg.kind {
                Some(create_message::Kind::Header(h)) => {
                    let header = convert::create_header(&h).map_err(status)?;
                    parts.max_bytes = convert::declared_bytes(&header).map_err(status)?;
                    parts.header(header)?
                }
                Some(create_message::Kind::Chunk(c)) => {
                    // Initial values travel as f32.
                    parts.chunk(convert::chunk(c, WireFormat::F32).map_err(status)?)?;
                }
                None => return Err(Status::invalid_argument("an empty CreateVariables message")),
            }
        }
        let (header, chunks) = parts.finish()?;
        let outcome = self.0.lock().create(&header, &chunks).map_err(status)?;
        tracing::info!(task = %self.0.config.task, variables = header.variables.len(), existed = outcome.existed, "variables created");
        Ok(Response::new(convert::create_response(outcome)))
    }

    async fn push(&self, req: Request<Streaming<PushMessage>>) -> Result<Response<PushResponse>, Status> {
        let mut stream = req.into_inner();
        let mut parts = Collect::new("Push", self.0.lock().bytes());
        let mut format = WireFormat::F32;
        while let Some(msg) = stream.message().await.map_err(decode_status)? {
            match msg.kind {
                Some(push_message::Kind::Header(h)) => {
                    let (h, f) = convert::push_header(h).map_err(status)?;
                    if parts.header.is_none() {
                        format = f;
                        parts.max_bytes = parts.max_bytes.saturating_add(self.0.lock().row_bytes(&h.rows));
                    }
                    parts.header(h)?
                }
                Some(push_message::Kind::Chunk(c)) => {
                    self.0.count_push_chunk();
                    parts.chunk(convert::chunk(c, format).map_err(status)?)?;
                }
                None => return Err(Status::invalid_argument("an empty Push message")),
            }
        }
        let (mut header, chunks) = parts.finish()?;
        let chunks = tables::take_row_chunks(&mut header, chunks).map_err(status)?;
        push(&self.0, &header, &chunks, StreamGuard::new(&self.0)).await.map(Response::new).map_err(status)
    }

    type PullRowsStream = PullStream;

    async fn pull_rows(&self, req: Request<PullRowsRequest>) -> Result<Response<Self::PullRowsStream>, Status> {
        let mut r = req.into_inner();
        let format = convert::wire_format(r.wire_format).map_err(status)?;
        // The update the request carries is applied (or refused, and nothing is read) first.
        let pushed = match r.push.take() {
            Some(h) => Some(carried_push(&self.0, h, std::mem::take(&mut r.push_chunks)).await?),
            None if !r.push_chunks.is_empty() => {
                return Err(Status::invalid_argument("a PullRows request with push_chunks and no push header"))
            }
            None => None,
        };
        let (version, values) = {
            let mut state = self.0.lock();
            let mut values = Vec::with_capacity(r.tables.len());
            let mut version = state.version();
            for t in r.tables {
                let pull = RowPull { worker: r.worker.clone(), lease: r.lease, table: t.table, ids: t.ids };
                let pulled = state.pull_rows(&pull).map_err(status)?;
                version = pulled.version;
                values.push(pulled.values);
            }
            (version, values)
        };
        let header =
            PullHeader { version, wire_format: convert::wire_format_spec(format), push: pushed, ..Default::default() };
        let messages = std::iter::once(PullMessage { kind: Some(pull_message::Kind::Header(header)) })
            .chain(
                tables::row_chunks(values.iter().map(Vec::as_slice), format)
                    .into_iter()
                    .map(|c| PullMessage { kind: Some(pull_message::Kind::Chunk(c)) }),
            )
            .map(Ok);
        Ok(Response::new(Box::pin(tokio_stream::iter(messages))))
    }

    type PullStream = PullStream;

    async fn pull(&self, req: Request<PullRequest>) -> Result<Response<Self::PullStream>, Status> {
        let request = req.into_inner();
        let format = convert::wire_format(request.wire_format).map_err(status)?;
        let pulled = pull(&self.0, &request).await.map_err(status)?;
        let (header, chunks) = convert::pull_parts(pulled, format);
        let chunks = chunks.map(|(variable, offset, data)| TensorChunk { variable, offset, data });
        let messages = std::iter::once(PullMessage { kind: Some(pull_message::Kind::Header(header)) })
            .chain(chunks.map(|c| PullMessage { kind: Some(pull_message::Kind::Chunk(c)) }))
            .map(Ok);
        Ok(Response::new(Box::pin(tokio_stream::iter(messages))))
    }

    async fn checkpoint(&self, req: Request<PsCheckpointRequest>) -> Result<Response<PsCheckpointResponse>, Status> {
        let PsCheckpointRequest { step, num_tasks } = req.into_inner();
        let Some(root) = self.0.config.checkpoint_dir.clone() else {
            return Err(status(strata_ps::Error::NoCheckpointDir { task: self.0.config.task.clone() }));
        };
        let snapshot = self.0.lock().snapshot();
        let keep = self.0.config.keep_checkpoints.max(1);
        let version = snapshot.version;
        let written = tokio::task::spawn_blocking(move || match num_tasks {
            0 => write_snapshot(&root, step, snapshot, keep),
            n => write_job_snapshot(&root, step, snapshot, keep, n),
        })
        .await
        .map_err(|_| Status::internal("the checkpoint writer stopped"))?
        .map_err(status)?;
        tracing::info!(task = %self.0.config.task, step, version, path = %written.display(), "checkpoint written");
        Ok(Response::new(PsCheckpointResponse { path: written.display().to_string(), version }))
    }

    async fn status(&self, _req: Request<PsStatusRequest>) -> Result<Response<PsStatusResponse>, Status> {
        Ok(Response::new(convert::status_response(self.0.lock().status())))
    }

    async fn configure(&self, req: Request<PsConfigureRequest>) -> Result<Response<PsConfigureResponse>, Status> {
        let live = req.into_inner().live_workers;
        let mut state = self.0.lock();
        if state.configure(live).map_err(status)? {
            self.0.version.send_replace(state.version());
        }
        Ok(Response::new(PsConfigureResponse {}))
    }
}

/// Restores `state` from `path`: a whole job's checkpoint (`ps-0`, `ps-1`, ...) onto the
/// task's place in its job (refused without one), or one task's own checkpoint.
fn restore(state: &mut State, path: &std::path::Path, config: &PsServerConfig) -> Result<()> {
    let task = &config.task;
    match job_checkpoint_tasks(path)? {
        Some(tasks) => {
            let Some((index, num_tasks)) = config.job_place else {
                return Err(strata_ps::Error::JobPlaceUnknown { dir: path.to_path_buf(), tasks }.into());
            };
            let restored = read_job_checkpoint_at(path, index, num_tasks, config.restore_step)?;
            let (step, version, parts) = (restored.step, restored.snapshot.version, restored.pool.parts());
            tracing::info!(%task, step, version, old_tasks = tasks, index, num_tasks, parts, "restored from a job's checkpoint");
            state.restore_job(restored);
        }
        None => {
            let named;
            let path = match config.restore_step {
                Some(step) if !path.join(strata_core::checkpoint::MANIFEST).is_file() => {
                    named = path.join(strata_core::checkpoint::checkpoint_dir_name(step));
                    &named
                }
                _ => path,
            };
            let (snap, step) = read_snapshot(path)?;
            if let Some(want) = config.restore_step.filter(|&s| s != step) {
                let task = config.job_place.map_or(0, |(i, _)| i as usize);
                let err =
                    strata_ps::Error::StepNotInJob { dir: path.to_path_buf(), step: want, task, latest: Some(step) };
                return Err(err.into());
            }
            tracing::info!(%task, step, version = snap.version, "restored from a checkpoint");
            state.restore(snap, step);
        }
    }
    Ok(())
}

/// Marks a [`ServerHandle`] as a parameter-server task's.
#[derive(Debug)]
pub enum PsTask {}

/// A running parameter-server task.
pub type PsServerHandle = ServerHandle<PsTask>;

impl PsServerHandle {
    /// Checks that `config.checkpoint_dir` (if set) can be written, restores `config.restore`
    /// (if set) and starts serving on `bind` (port 0 picks a free one). Must not be called
    /// from inside a tokio runtime thread.
    pub fn start(bind: SocketAddr, config: PsServerConfig) -> Result<Self> {
        if let Some(dir) = &config.checkpoint_dir {
            // At start, not at the first checkpoint the coordinator asks for.
            strata_core::checkpoint::check_writable(dir)?;
        }
        let mut state = State::new(config.task.clone(), config.stream_min_bytes);
        if let Some(path) = &config.restore {
            restore(&mut state, path, &config)?;
        }
        let (listener, address) = crate::lifecycle::listen(bind, &format!("the parameter server {}", config.task))?;
        let (version, _) = watch::channel(state.version());
        let task = config.task.clone();
        let end = crate::control::JobEnd::new(&task);
        let interceptor = server_interceptor(config.token.clone()).noting_calls(end.clone());
        let control = crate::control::service(end.clone(), interceptor.clone());
        let shared = Arc::new(Shared {
            config,
            state: Mutex::new(state),
            version,
            streaming: watch::channel(false).0,
            streamed_chunks: AtomicU64::new(0),
            waiting: AtomicUsize::new(0),
        });
        let builder = crate::auth::server_builder(&shared.config.token)?;
        let what = format!("the parameter server {task}");
        let stop = watch::channel(false).0;
        let server = crate::lifecycle::spawn_server::<ParameterServerServer<Svc>, _, _>(
            listener,
            what,
            stop,
            interceptor.clone(),
            |health, (incoming, stop)| async move {
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
                    .add_service(health)
                    .add_service(control);
                // Faults (tests only) are a layer around the service, never a branch of its pushes.
                let router = if faults.any() {
                    router.add_service(InterceptedService::new(DecodeErrors(Faulty::new(service, faults)), interceptor))
                } else {
                    router.add_service(InterceptedService::new(DecodeErrors(service), interceptor))
                };
                router.serve_with_incoming_shutdown(incoming, stop).await
            },
        );
        tracing::info!(%task, %address, "parameter server listening");
        Ok(Self::new(address, task, server).with_end(end))
    }
}
