//! The one seam through which a test or `strata compare` watches and shapes the data plane:
//! [`DataPlaneHooks`], installed at most once per process with [`set_hooks`]. The data plane
//! (ring frames, the parameter-server client's pushes and pulls) calls the functions of this
//! module at fixed points, and they do nothing when no hooks are installed; the control plane
//! (coordination, heartbeats) is never hooked. [`inject::Recorder`](crate::inject::Recorder) is
//! the ready-made implementation: byte counters and a fixed delay.
//!
//! ```
//! use std::sync::atomic::{AtomicU64, Ordering};
//! use strata_transport::hooks::{self, DataPlaneHooks};
//!
//! struct Frames(AtomicU64);
//!
//! impl DataPlaneHooks for Frames {
//!     fn on_send(&self, _bytes: usize) {
//!         self.0.fetch_add(1, Ordering::Relaxed);
//!     }
//! }
//!
//! static FRAMES: Frames = Frames(AtomicU64::new(0));
//! assert!(hooks::set_hooks(&FRAMES));
//! assert!(!hooks::set_hooks(&FRAMES), "installed once per process");
//! ```

use std::sync::OnceLock;
use std::time::Duration;

/// What a process observes of, and adds to, its data plane. Every method has a default that
/// does nothing. Implementations are called from the data plane's threads and tasks, so they
/// must be cheap and must not block (apart from the delay they ask for).
pub trait DataPlaneHooks: Send + Sync {
    /// `bytes` were sent: a ring frame (its header included), or a push's tensor payload.
    fn on_send(&self, bytes: usize) {
        let _ = bytes;
    }

    /// `bytes` were received: a ring frame's bytes, or a pull's tensor payload.
    fn on_receive(&self, bytes: usize) {
        let _ = bytes;
    }

    /// How long to hold a data-plane message before sending it (a link's one-way latency);
    /// `None`: send at once.
    fn before_send(&self) -> Option<Duration> {
        None
    }
}

static HOOKS: OnceLock<&'static dyn DataPlaneHooks> = OnceLock::new();

/// Installs `hooks` for the rest of the process; `false` if hooks were installed already (they
/// stay).
pub fn set_hooks(hooks: &'static dyn DataPlaneHooks) -> bool {
    HOOKS.set(hooks).is_ok()
}

/// The installed hooks, if any.
pub fn installed() -> Option<&'static dyn DataPlaneHooks> {
    HOOKS.get().copied()
}

/// Reports bytes sent on the data plane.
pub(crate) fn sent(bytes: usize) {
    if let Some(h) = installed() {
        h.on_send(bytes);
    }
}

/// Reports bytes received on the data plane.
pub(crate) fn received(bytes: usize) {
    if let Some(h) = installed() {
        h.on_receive(bytes);
    }
}

/// Waits what the hooks ask before a message is sent (the async data plane).
pub(crate) async fn before_send() {
    if let Some(d) = installed().and_then(|h| h.before_send()) {
        tokio::time::sleep(d).await;
    }
}

/// Waits what the hooks ask before a message is sent (blocking clients).
pub(crate) fn before_send_blocking() {
    if let Some(d) = installed().and_then(|h| h.before_send()) {
        std::thread::sleep(d);
    }
}
