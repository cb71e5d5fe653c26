//! The worker executor service of a parameter-server job: every worker task serves it, and the
//! coordinator asks a worker to run a step function **by name** (a Rust closure cannot travel;
//! every task runs the same binary, in which the step functions are registered by name).
//!
//! - The server ([`WorkerExecutorHandle`]) admits only calls carrying the cluster token, serves
//!   `grpc.health.v1` behind the same check, and runs [`StepHandler::run`] on tokio's blocking
//!   pool (step functions call the blocking parameter-server clients).
//! - [`StepFailure::NotFound`] is answered `NOT_FOUND`, [`StepFailure::InvalidArgument`]
//!   `INVALID_ARGUMENT` (arguments that do not decode, or ask for more than the step allows),
//!   [`StepFailure::Unavailable`] `UNAVAILABLE` (message prefixed `"step unavailable: "`: a
//!   parameter server could not be reached and the coordinator retries the step),
//!   [`StepFailure::Failed`] `INTERNAL` with its message.
//! - Requests are bounded: a function or client name of at most [`MAX_NAME_BYTES`], arguments
//!   of at most [`MAX_ARGS_BYTES`], at most [`MAX_STEPS_IN_FLIGHT`] steps running at once
//!   (`RESOURCE_EXHAUSTED` beyond); an undecodable request is `INVALID_ARGUMENT`.
//! - The client ([`WorkerClient`]) is blocking and tells a worker that could not be reached
//!   (`Error::Unavailable` whose detail starts with `"worker unreachable"`) from a step that
//!   reported a parameter server unavailable (detail starting with `"step unavailable: "`).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prost::bytes::Bytes;
use strata_proto::v1::worker_executor_client::WorkerExecutorClient;
use strata_proto::v1::worker_executor_server::{WorkerExecutor, WorkerExecutorServer};
use strata_proto::v1::{RunStepRequest, RunStepResponse, WorkerPingRequest, WorkerPingResponse};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

use crate::auth::{client_interceptor, server_interceptor, ClientAuth, ClusterToken};
use crate::guard::DecodeErrors;
use crate::lifecycle::ServerHandle;
use crate::ring::AbortSignal;
use crate::rt::runtime;
use crate::{Error, Result};

/// The prefix of the message of a step that reported a parameter server unavailable.
pub const STEP_UNAVAILABLE: &str = "step unavailable: ";

/// The prefix of the detail of an [`Error::Unavailable`] for a worker that could not be reached.
pub const WORKER_UNREACHABLE: &str = "worker unreachable";

/// The largest step result (serialized) the coordinator accepts.
pub const MAX_MESSAGE_BYTES: usize = 256 << 20;

/// The largest `RunStep` request (the step's serialized arguments and names) a worker accepts:
/// steps name their work (a batch, a file), they do not carry it.
pub const MAX_ARGS_BYTES: usize = 16 << 20;

/// The longest function or client name a worker accepts, in bytes.
pub const MAX_NAME_BYTES: usize = 256;

/// The most steps a worker runs at once; more are refused with `RESOURCE_EXHAUSTED` (a
/// coordinator runs one step per worker at a time).
pub const MAX_STEPS_IN_FLIGHT: usize = 32;

/// Why a step function did not return a result.
#[derive(Debug, Clone)]
pub enum StepFailure {
    /// No function of this name is registered (the text: the function's name, or more detail).
    NotFound(String),
    /// The arguments do not decode, or ask for more than the step function allows (the text
    /// says which, and the limit).
    InvalidArgument(String),
    /// A parameter server could not be reached; the coordinator retries the step.
    Unavailable(String),
    /// The function failed; the text says why.
    Failed(String),
}

/// What a worker process runs: implemented in strata-strategies by the step registry.
pub trait StepHandler: Send + Sync + 'static {
    /// The names of the registered step functions.
    fn functions(&self) -> Vec<String>;
    /// Runs `function` as step `step` of the coordinator run `client` with its serialized
    /// arguments, and returns its serialized result. Runs on a blocking thread.
    fn run(&self, function: &str, step: u64, client: &str, args: &[u8]) -> std::result::Result<Vec<u8>, StepFailure>;
}

/// What a worker answers to a ping.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerInfo {
    /// The worker's task name, `worker:<index>`.
    pub task: String,
    /// The step functions it has registered.
    pub functions: Vec<String>,
    /// How many steps it has run successfully since it started.
    pub steps_run: u64,
    /// A random number per process start: tells a restarted worker from the old one.
    pub incarnation: u64,
}

struct Service {
    task: String,
    handler: Arc<dyn StepHandler>,
    steps_run: AtomicU64,
    incarnation: u64,
    stopping: tokio::sync::watch::Receiver<bool>,
    /// Steps running now (at most [`MAX_STEPS_IN_FLIGHT`]).
    in_flight: Arc<tokio::sync::Semaphore>,
}

#[derive(Clone)]
struct Svc(Arc<Service>);

impl Svc {
    fn failure_status(&self, function: &str, step: u64, failure: StepFailure) -> Status {
        let task = &self.0.task;
        match failure {
            StepFailure::NotFound(detail) => {
                let mut registered = self.0.handler.functions();
                registered.sort();
                let have = if registered.is_empty() { "none".to_string() } else { registered.join(", ") };
                let extra =
                    if detail.is_empty() || detail == function { String::new() } else { format!(" ({detail})") };
                Status::not_found(format!(
                    "no step function named {function} is registered in {task}{extra} (registered: {have}); register it in the binary every task runs"
                ))
            }
            StepFailure::InvalidArgument(detail) => {
                Status::invalid_argument(format!("step {step} ({function}) refused by {task}: {detail}"))
            }
            StepFailure::Unavailable(detail) => Status::unavailable(format!("{STEP_UNAVAILABLE}{detail}")),
            StepFailure::Failed(detail) => {
                Status::internal(format!("step {step} ({function}) failed in {task}: {detail}"))
            }
        }
    }
}

#[tonic::async_trait]
impl WorkerExecutor for Svc {
    async fn run_step(&self, req: Request<RunStepRequest>) -> std::result::Result<Response<RunStepResponse>, Status> {
        let r = req.into_inner();
        if r.function.is_empty() || r.function.len() > MAX_NAME_BYTES {
            return Err(Status::invalid_argument(format!(
                "a step function name of {} bytes; the limit is 1 to {MAX_NAME_BYTES} bytes",
                r.function.len()
            )));
        }
        if r.client.len() > MAX_NAME_BYTES {
            return Err(Status::invalid_argument(format!(
                "a client name of {} bytes; the limit is {MAX_NAME_BYTES} bytes",
                r.client.len()
            )));
        }
        let mut stopping = self.0.stopping.clone();
        if *stopping.borrow() {
            return Err(Status::unavailable(format!("worker {} is shutting down", self.0.task)));
        }
        let Ok(permit) = self.0.in_flight.clone().try_acquire_owned() else {
            return Err(Status::resource_exhausted(format!(
                "worker {} runs {MAX_STEPS_IN_FLIGHT} steps already, the limit; send the step again when one has finished",
                self.0.task
            )));
        };
        let svc = self.0.clone();
        let (function, step) = (r.function.clone(), r.step);
        let job = tokio::task::spawn_blocking(move || {
            let result = svc.handler.run(&r.function, r.step, &r.client, &r.args);
            drop(permit);
            result
        });
        let outcome = tokio::select! {
            joined = job => joined,
            _ = stopping.wait_for(|s| *s) => {
                // The worker stops: the coordinator sees it lost and runs the step elsewhere.
                return Err(Status::unavailable(format!("worker {} is shutting down", self.0.task)));
            }
        };
        match outcome {
            Ok(Ok(result)) => {
                self.0.steps_run.fetch_add(1, Ordering::Relaxed);
                Ok(Response::new(RunStepResponse { result: Bytes::from(result) }))
            }
            Ok(Err(failure)) => Err(self.failure_status(&function, step, failure)),
            Err(e) => {
                let why = if e.is_panic() { "panicked" } else { "was cancelled" };
                tracing::error!(%function, step, "step function {why}");
                Err(Status::internal(format!("step {step} ({function}) {why} in {}", self.0.task)))
            }
        }
    }

    async fn ping(
        &self,
        _req: Request<WorkerPingRequest>,
    ) -> std::result::Result<Response<WorkerPingResponse>, Status> {
        let handler = self.0.handler.clone();
        let functions = tokio::task::spawn_blocking(move || handler.functions())
            .await
            .map_err(|_| Status::internal(format!("listing the step functions of {} failed", self.0.task)))?;
        Ok(Response::new(WorkerPingResponse {
            task: self.0.task.clone(),
            functions,
            steps_run: self.0.steps_run.load(Ordering::Relaxed),
            incarnation: self.0.incarnation,
        }))
    }
}

/// Marks a [`ServerHandle`] as a worker executor's.
#[derive(Debug)]
pub enum WorkerExecutorTask {}

/// A running worker executor service (held by a worker task). Its `shutdown` answers running
/// steps `UNAVAILABLE` at once (the coordinator runs them elsewhere; their step functions finish
/// in the background) and refuses new connections.
pub type WorkerExecutorHandle = ServerHandle<WorkerExecutorTask>;

impl WorkerExecutorHandle {
    /// Starts serving task `task` (`worker:<index>`) on `bind` (port 0 picks a free one),
    /// admitting only calls with `token`. Must not be called from inside a tokio runtime thread.
    pub fn start(bind: SocketAddr, task: String, token: ClusterToken, handler: Arc<dyn StepHandler>) -> Result<Self> {
        let (listener, address) = crate::lifecycle::listen(bind, &format!("the worker executor of {task}"))?;
        let (tx, rx) = tokio::sync::watch::channel(false);
        let service = Arc::new(Service {
            task: task.clone(),
            handler,
            steps_run: AtomicU64::new(0),
            incarnation: random_u64(),
            stopping: rx,
            in_flight: Arc::new(tokio::sync::Semaphore::new(MAX_STEPS_IN_FLIGHT)),
        });
        let mut builder = crate::auth::server_builder(&token)?;
        let end = crate::control::JobEnd::new(&task);
        let interceptor = server_interceptor(token).noting_calls(end.clone());
        let control = crate::control::service(end.clone(), interceptor.clone());
        let what = format!("the worker executor of {task}");
        let server = crate::lifecycle::spawn_server::<WorkerExecutorServer<Svc>, _, _>(
            listener,
            what,
            tx,
            interceptor.clone(),
            |health, (incoming, stop)| async move {
                let service = WorkerExecutorServer::new(Svc(service))
                    .max_decoding_message_size(MAX_ARGS_BYTES)
                    .max_encoding_message_size(MAX_MESSAGE_BYTES);
                builder
                    .add_service(health)
                    .add_service(control)
                    .add_service(InterceptedService::new(DecodeErrors(service), interceptor))
                    .serve_with_incoming_shutdown(incoming, stop)
                    .await
            },
        );
        tracing::info!(%task, %address, "worker executor listening");
        Ok(Self::new(address, task, server).with_end(end))
    }
}

type Client = WorkerExecutorClient<InterceptedService<Channel, ClientAuth>>;

/// A blocking client of one worker's executor service. Clone + Send + Sync; its methods must
/// not be called from inside a tokio runtime thread.
#[derive(Clone)]
pub struct WorkerClient {
    client: Client,
    /// The same authenticated channel, for the health service.
    raw: InterceptedService<Channel, ClientAuth>,
    address: String,
    task: String,
    timeout: Duration,
}

impl std::fmt::Debug for WorkerClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerClient").field("task", &self.task).field("address", &self.address).finish()
    }
}

/// Whether a status comes from the connection rather than from the worker's answer: statuses
/// the server sent carry no source error, those made from a transport failure do. A worker's own
/// UNAVAILABLE (it is shutting down) counts as unreachable unless the step reported it.
fn is_transport_failure(s: &Status) -> bool {
    use std::error::Error as _;
    match s.code() {
        Code::Unavailable => !s.message().starts_with(STEP_UNAVAILABLE),
        Code::Unknown | Code::Cancelled | Code::Internal => s.source().is_some(),
        _ => false,
    }
}

impl WorkerClient {
    /// A client of task `task` (`worker:<index>`, named in errors) at `address` (`host:port`);
    /// `timeout` bounds each RPC. Connects lazily: an unreachable worker fails its first call.
    pub fn connect(address: &str, task: &str, token: ClusterToken, timeout: Duration) -> Result<Self> {
        let endpoint = crate::auth::endpoint(address, task, &token)?
            .connect_timeout(Duration::from_secs(2).min(timeout.max(Duration::from_millis(100))))
            .tcp_nodelay(true);
        let channel = {
            let _guard = runtime().enter();
            endpoint.connect_lazy()
        };
        let raw = InterceptedService::new(channel, client_interceptor(token));
        let client = WorkerExecutorClient::new(raw.clone())
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        Ok(Self { client, raw, address: address.to_string(), task: task.to_string(), timeout })
    }

    /// The worker's address.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// The worker's task name.
    pub fn task(&self) -> &str {
        &self.task
    }

    fn error(&self, rpc: &str, step: u64, s: Status) -> Error {
        let task = self.task.clone();
        match s.code() {
            Code::Unauthenticated => Error::Unauthenticated(format!("{rpc} to {task}: {}", s.message())),
            Code::DeadlineExceeded => Error::Timeout { task, collective: rpc.to_string(), step, timeout: self.timeout },
            Code::Unavailable if s.message().starts_with(STEP_UNAVAILABLE) => {
                Error::Unavailable { peer: task, rpc: rpc.into(), detail: s.message().to_string() }
            }
            _ if is_transport_failure(&s) => Error::Unavailable {
                peer: task,
                rpc: rpc.into(),
                detail: format!("{WORKER_UNREACHABLE} at {}: {}", self.address, s.message()),
            },
            code => {
                Error::Rejected { peer: task, rpc: rpc.into(), code: format!("{code:?}"), detail: s.message().into() }
            }
        }
    }

    /// Runs the registered function `function` as step `step` of the coordinator run `client`
    /// with the serialized `args`, and returns its serialized result.
    ///
    /// Errors: [`Error::Unavailable`] with a detail starting `"worker unreachable"` when the
    /// worker could not be reached (or stopped during the step), or `"step unavailable: "`
    /// when the step reported a parameter server unavailable; [`Error::Rejected`] for an
    /// unregistered function (`NotFound`) or a failed one (`Internal`); [`Error::Timeout`].
    pub fn run_step(&self, function: &str, step: u64, client: &str, args: &[u8]) -> Result<Vec<u8>> {
        self.run_step_until(function, step, client, args, &AbortSignal::new())
    }

    /// [`run_step`](Self::run_step) that gives up once `cancel` is raised (the coordinator
    /// found the worker lost, or the job failed): an [`Error::Unavailable`] whose detail starts
    /// with `"worker unreachable"` and carries the reason. The step may still finish on the
    /// worker; its pushes are then answered as duplicates of the re-run's.
    pub fn run_step_until(
        &self,
        function: &str,
        step: u64,
        client: &str,
        args: &[u8],
        cancel: &AbortSignal,
    ) -> Result<Vec<u8>> {
        let mut c = self.client.clone();
        let mut req = Request::new(RunStepRequest {
            function: function.to_string(),
            step,
            client: client.to_string(),
            args: Bytes::copy_from_slice(args),
        });
        req.set_timeout(self.timeout);
        let rpc = format!("RunStep({function}) of step {step}");
        let outcome = runtime().block_on(async {
            tokio::select! {
                r = c.run_step(req) => Some(r),
                () = crate::ring::raised(Some(cancel)) => None,
            }
        });
        match outcome {
            Some(Ok(r)) => Ok(r.into_inner().result.to_vec()),
            Some(Err(s)) => Err(self.error(&rpc, step, s)),
            None => Err(Error::Unavailable {
                peer: self.task.clone(),
                rpc,
                detail: format!(
                    "{WORKER_UNREACHABLE} at {}: {}",
                    self.address,
                    cancel.reason().unwrap_or_else(|| "cancelled".into())
                ),
            }),
        }
    }

    /// Whether the worker's `grpc.health.v1` service answers SERVING for the executor.
    pub fn serving(&self) -> Result<bool> {
        use tonic_health::pb::health_check_response::ServingStatus;
        use tonic_health::pb::health_client::HealthClient;
        use tonic_health::pb::HealthCheckRequest;
        let mut health = HealthClient::new(self.raw.clone());
        let service = <WorkerExecutorServer<Svc> as tonic::server::NamedService>::NAME;
        let mut req = Request::new(HealthCheckRequest { service: service.into() });
        req.set_timeout(self.timeout.min(Duration::from_secs(10)));
        let r = runtime().block_on(health.check(req)).map_err(|s| self.error("Check", 0, s))?.into_inner();
        Ok(r.status == ServingStatus::Serving as i32)
    }

    /// Asks the worker who it is and what it offers.
    pub fn ping(&self) -> Result<WorkerInfo> {
        self.ping_within(self.timeout.min(Duration::from_secs(10)))
    }

    /// [`ping`](Self::ping) with its own deadline (a liveness probe).
    pub fn ping_within(&self, deadline: Duration) -> Result<WorkerInfo> {
        let mut c = self.client.clone();
        let mut req = Request::new(WorkerPingRequest {});
        req.set_timeout(deadline);
        let r = runtime()
            .block_on(async { tokio::time::timeout(deadline, c.ping(req)).await })
            .map_err(|_| Error::Timeout {
                task: self.task.clone(),
                collective: "Ping".into(),
                step: 0,
                timeout: deadline,
            })?
            .map_err(|s| self.error("Ping", 0, s))?
            .into_inner();
        Ok(WorkerInfo { task: r.task, functions: r.functions, steps_run: r.steps_run, incarnation: r.incarnation })
    }
}

fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.write_u32(std::process::id());
    h.finish()
}
