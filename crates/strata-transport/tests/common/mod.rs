//! What the transport's test files share.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::Duration;

/// The hard limit of every test body.
pub const LIMIT: Duration = Duration::from_secs(60);

/// Runs `body` in its own thread and fails the test if it panics or does not finish within
/// [`LIMIT`].
pub fn within_limit<F: FnOnce() + Send + 'static>(name: &str, body: F) {
    let (tx, rx) = mpsc::channel();
    let handle = std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || {
            body();
            let _ = tx.send(());
        })
        .unwrap();
    match rx.recv_timeout(LIMIT) {
        Ok(()) => handle.join().unwrap(),
        Err(RecvTimeoutError::Disconnected) => match handle.join() {
            Err(panic) => std::panic::resume_unwind(panic),
            Ok(()) => panic!("{name}: the test body ended without reporting"),
        },
        Err(RecvTimeoutError::Timeout) => panic!("{name} did not finish within {LIMIT:?}"),
    }
}
