//! The switch that stops a ring's collectives from outside, and the poll that watches it.
//!
//! Its own module so that the ring's connection set-up (`connect.rs`), its collectives and
//! the gRPC clients that give up with a job (`raised`) share it without importing the ring.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often a collective in progress checks its [`AbortSignal`].
pub const ABORT_POLL: Duration = Duration::from_millis(50);

/// Aborts the collectives of a ring from outside (the coordination service calls
/// [`AbortSignal::abort`] when a heartbeat says a peer died). Clones share the signal.
#[derive(Clone, Debug, Default)]
pub struct AbortSignal(Arc<AbortInner>);

#[derive(Debug, Default)]
struct AbortInner {
    set: AtomicBool,
    reason: Mutex<Option<String>>,
}

impl AbortSignal {
    /// A signal not yet raised.
    pub fn new() -> Self {
        Self::default()
    }

    /// Raises the signal: the collective in progress (within ~50 ms) and every later one fail
    /// with [`Error::Aborted`](crate::Error::Aborted) carrying `reason`. The first reason is kept.
    pub fn abort(&self, reason: impl Into<String>) {
        let mut r = self.0.reason.lock().unwrap_or_else(|e| e.into_inner());
        if r.is_none() {
            *r = Some(reason.into());
            self.0.set.store(true, Ordering::Release);
        }
    }

    /// The reason, once raised.
    pub fn reason(&self) -> Option<String> {
        if !self.0.set.load(Ordering::Acquire) {
            return None;
        }
        self.0.reason.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Completes when `abort` is raised (never without one), checking every [`ABORT_POLL`]: for
/// calls that must give up when the job fails.
pub(crate) async fn raised(abort: Option<&AbortSignal>) {
    let Some(a) = abort else { return std::future::pending().await };
    while a.reason().is_none() {
        tokio::time::sleep(ABORT_POLL).await;
    }
}
