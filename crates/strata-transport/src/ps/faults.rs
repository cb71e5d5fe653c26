//! Faults a parameter server injects on purpose, for the tests of the exactly-once and retry
//! paths: a layer around the service, installed only when [`FaultInjection`] asks for a fault,
//! so the production path has no fault branches.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use http_body_util::BodyExt;
use tonic::codegen::{http, Service};
use tonic::Status;

use super::wire;

/// Faults a parameter server injects on purpose: a test facility for the exactly-once and
/// retry paths (`strata ps --inject-drop-reply-every`), never used in a real job. Both count
/// `Push` and `PullRows` calls (which may carry a push) that passed the cluster token check.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultInjection {
    /// Every k-th push or pull of rows (k > 0) is served normally but answered `UNAVAILABLE`, as if the reply
    /// was lost (a push the task refused keeps its refusal).
    pub drop_reply_every: u64,
    /// Every k-th push or pull of rows (k > 0) is refused with `UNAVAILABLE` before anything is applied.
    pub drop_request_every: u64,
}

impl FaultInjection {
    /// Whether any fault is asked for.
    pub fn any(&self) -> bool {
        self.drop_reply_every > 0 || self.drop_request_every > 0
    }

    fn hits(every: u64, n: u64) -> bool {
        every > 0 && n.is_multiple_of(every)
    }
}

/// The service `inner` with [`FaultInjection`]'s faults on its `Push` and `PullRows` calls;
/// other calls pass through untouched.
#[derive(Clone)]
pub(crate) struct Faulty<S> {
    inner: S,
    faults: FaultInjection,
    /// `Push` and `PullRows` calls so far.
    pushes: Arc<AtomicU64>,
}

impl<S> Faulty<S> {
    pub(crate) fn new(inner: S, faults: FaultInjection) -> Self {
        Self { inner, faults, pushes: Arc::new(AtomicU64::new(0)) }
    }
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for Faulty<S> {
    const NAME: &'static str = S::NAME;
}

type Response = http::Response<tonic::body::Body>;

impl<S> Service<http::Request<tonic::body::Body>> for Faulty<S>
where
    S: Service<http::Request<tonic::body::Body>, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        // The clone that was made ready serves this call (tower's convention).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        // A pull of rows may carry a push (and a pull alone is retried as safely).
        if req.uri().path() != wire::PUSH_PATH && req.uri().path() != wire::PULL_ROWS_PATH {
            return Box::pin(inner.call(req));
        }
        let n = self.pushes.fetch_add(1, Ordering::Relaxed) + 1;
        if FaultInjection::hits(self.faults.drop_request_every, n) {
            return Box::pin(async move {
                // Read the request as the task would have, then drop it.
                let mut body = req.into_body();
                while let Some(Ok(_)) = body.frame().await {}
                Ok(Status::unavailable("injected fault: request dropped").into_http())
            });
        }
        let drop_reply = FaultInjection::hits(self.faults.drop_reply_every, n);
        let call = inner.call(req);
        Box::pin(async move {
            let response = call.await?;
            // A refusal is answered with its status in the headers; an answer has none there.
            let refused = Status::from_header_map(response.headers()).is_some_and(|s| s.code() != tonic::Code::Ok);
            if drop_reply && !refused {
                return Ok(Status::unavailable("injected fault: reply dropped").into_http());
            }
            Ok(response)
        })
    }
}
