//! The end of a job (`proto/strata/v1/control.proto`): the `TaskControl` service that a
//! parameter server and a worker executor serve beside their own, and its client.
//!
//! TensorFlow's ps and worker tasks serve until they are killed: a cluster manager then sees a
//! killed step even when training succeeded. Here the chief ends the job by calling
//! [`finish_task`] on every task; the task answers, and its [`JobEnd`] says so
//! ([`ServerHandle::finished`](crate::lifecycle::ServerHandle::finished)) for the program to stop serving
//! and exit 0. A task whose chief is gone for good (no admitted call at all for a while, though
//! the chief probes every task twice a second) learns it from
//! [`ServerHandle::idle_for`](crate::lifecycle::ServerHandle::idle_for).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use strata_proto::v1::task_control_client::TaskControlClient;
use strata_proto::v1::task_control_server::{TaskControl, TaskControlServer};
use strata_proto::v1::{FinishRequest, FinishResponse};
use tonic::service::interceptor::InterceptedService;
use tonic::{Code, Request, Response, Status};

use crate::auth::{client_interceptor, NoteCalls, ServerAuth};
use crate::guard::DecodeErrors;
use crate::rt::runtime;
use crate::{ClusterToken, Error, Result};

/// The longest reason a `Finish` may carry, in bytes.
pub const MAX_REASON_BYTES: usize = 256;

/// The reason given when a `Finish` carries none.
const NO_REASON: &str = "the chief ended the job";

/// What a task's server knows of its job's end: whether the chief said it is over, and when
/// the last admitted call arrived.
#[derive(Debug)]
pub struct JobEnd {
    task: String,
    started: Instant,
    /// Milliseconds from `started` to the last admitted call, plus one; 0 before the first.
    last_call: AtomicU64,
    finished: Mutex<Option<String>>,
}

impl JobEnd {
    pub(crate) fn new(task: &str) -> Arc<Self> {
        Arc::new(Self {
            task: task.to_string(),
            started: Instant::now(),
            last_call: AtomicU64::new(0),
            finished: Mutex::new(None),
        })
    }

    /// Why the job is over, once the chief said so.
    pub fn finished(&self) -> Option<String> {
        self.finished.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// How long since the last admitted call; `None` before the first.
    pub fn idle_for(&self) -> Option<Duration> {
        match self.last_call.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(self.started.elapsed().saturating_sub(Duration::from_millis(ms - 1))),
        }
    }

    /// Ends the job for `reason`; whether it had ended already (the first reason is kept).
    fn finish(&self, reason: String) -> bool {
        let mut finished = self.finished.lock().unwrap_or_else(PoisonError::into_inner);
        if finished.is_some() {
            return true;
        }
        *finished = Some(reason);
        false
    }
}

impl NoteCalls for JobEnd {
    /// Notes an admitted call (the token check calls it).
    fn admitted(&self) {
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX - 1);
        self.last_call.store(ms + 1, Ordering::Relaxed);
    }
}

#[derive(Clone)]
pub(crate) struct Svc(Arc<JobEnd>);

#[tonic::async_trait]
impl TaskControl for Svc {
    async fn finish(&self, req: Request<FinishRequest>) -> std::result::Result<Response<FinishResponse>, Status> {
        let reason = req.into_inner().reason;
        if reason.len() > MAX_REASON_BYTES {
            return Err(Status::invalid_argument(format!(
                "a finish reason of {} bytes; the limit is {MAX_REASON_BYTES} bytes",
                reason.len()
            )));
        }
        // The reason ends up in the task's last line: one line, no control characters.
        let reason: String = reason.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
        let reason = if reason.trim().is_empty() { NO_REASON.to_string() } else { reason.trim().to_string() };
        let already = self.0.finish(reason);
        if !already {
            tracing::info!(task = %self.0.task, "the chief finished the job");
        }
        Ok(Response::new(FinishResponse { task: self.0.task.clone(), already }))
    }
}

/// The `TaskControl` service of the task `end` belongs to, behind the token check `auth`.
pub(crate) fn service(
    end: Arc<JobEnd>,
    auth: ServerAuth,
) -> InterceptedService<DecodeErrors<TaskControlServer<Svc>>, ServerAuth> {
    InterceptedService::new(DecodeErrors(TaskControlServer::new(Svc(end))), auth)
}

/// Tells task `task` at `address` that the job is over, for `reason` (at most
/// [`MAX_REASON_BYTES`]), within `deadline`. `Ok(true)` when an earlier call had finished it.
/// Must not be called from inside a tokio runtime thread.
pub fn finish_task(address: &str, task: &str, token: ClusterToken, reason: &str, deadline: Duration) -> Result<bool> {
    let endpoint = crate::auth::endpoint(address, task, &token)?
        .connect_timeout(deadline.max(Duration::from_millis(10)))
        .timeout(deadline.max(Duration::from_millis(10)));
    let channel = {
        let _guard = runtime().enter();
        endpoint.connect_lazy()
    };
    let mut client = TaskControlClient::new(InterceptedService::new(channel, client_interceptor(token)));
    let req = Request::new(FinishRequest { reason: reason.to_string() });
    let answer = runtime().block_on(async { tokio::time::timeout(deadline, client.finish(req)).await });
    let rpc = "Finish";
    match answer {
        Ok(Ok(r)) => Ok(r.into_inner().already),
        Err(_) => Err(Error::Timeout { task: task.into(), collective: rpc.into(), step: 0, timeout: deadline }),
        Ok(Err(s)) => Err(match s.code() {
            Code::Unauthenticated => Error::Unauthenticated(format!("{rpc} to {task}: {}", s.message())),
            Code::DeadlineExceeded => {
                Error::Timeout { task: task.into(), collective: rpc.into(), step: 0, timeout: deadline }
            }
            Code::Unavailable | Code::Unknown | Code::Cancelled => Error::Unavailable {
                peer: task.into(),
                rpc: rpc.into(),
                detail: format!("at {address}: {}", s.message()),
            },
            code => Error::Rejected {
                peer: task.into(),
                rpc: rpc.into(),
                code: format!("{code:?}"),
                detail: s.message().into(),
            },
        }),
    }
}
