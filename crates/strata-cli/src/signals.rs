//! SIGINT, SIGTERM and SIGHUP for the command's long-running subcommands, without touching the
//! signal mask.
//!
//! Blocking the signals and waiting for them with `sigwait` looks simpler, but the mask is
//! inherited across `fork` and `exec` (std's `Command` does not reset it), so every process the
//! launcher started ran with SIGHUP, SIGINT and SIGTERM blocked: Ctrl-C and SIGTERM never reached
//! a task, which was SIGKILLed after the grace period. Here the signals get handlers instead
//! (tokio's signal driver, on a thread of its own): the mask stays empty, and handlers, unlike a
//! mask, do not survive `exec`, so children start with every signal at its default.

use std::sync::mpsc;

use nix::sys::signal::Signal;
use tokio::signal::unix::{signal, SignalKind};

use crate::{Error, Result};

/// The signals a subcommand handles.
const HANDLED: [(Signal, fn() -> SignalKind); 3] = [
    (Signal::SIGINT, SignalKind::interrupt),
    (Signal::SIGTERM, SignalKind::terminate),
    (Signal::SIGHUP, SignalKind::hangup),
];

/// Installs handlers for SIGINT, SIGTERM and SIGHUP and returns the channel on which every
/// signal received from now on arrives. The handlers stay for the life of the process: these
/// signals no longer end it by themselves, the receiver decides what they do.
pub(crate) fn handle() -> Result<mpsc::Receiver<Signal>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::io("starting the signal handler's runtime", e))?;
    // Installed here, before returning, so that no signal is missed (or kills the process).
    let streams = rt
        .block_on(async {
            HANDLED.iter().map(|(sig, kind)| signal(kind()).map(|s| (*sig, s))).collect::<std::io::Result<Vec<_>>>()
        })
        .map_err(|e| Error::io("installing the handlers of SIGINT, SIGTERM and SIGHUP", e))?;
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("strata-signals".into())
        .spawn(move || {
            rt.block_on(async move {
                let mut streams = streams;
                loop {
                    let next = std::future::poll_fn(|cx| {
                        for (sig, s) in streams.iter_mut() {
                            if let std::task::Poll::Ready(got) = s.poll_recv(cx) {
                                return std::task::Poll::Ready(got.map(|()| *sig));
                            }
                        }
                        std::task::Poll::Pending
                    })
                    .await;
                    match next {
                        Some(sig) if tx.send(sig).is_ok() => {}
                        _ => return,
                    }
                }
            })
        })
        .map_err(|e| Error::io("starting the signal handler's thread", e))?;
    Ok(rx)
}

/// The exit status of a process that stopped because of `signal`: 128 plus its number.
pub(crate) fn exit_code(signal: Signal) -> i32 {
    128 + signal as i32
}
