//! What a process sends and receives, and the network delay `strata compare` injects: the
//! ready-made [`DataPlaneHooks`] ([`Recorder`]) and the process's own recorder.
//!
//! The counters cover the data plane: the ring's frames (headers included) and the
//! parameter-server client's tensor payloads. The delay, when set, is added before every message
//! this process sends on the data plane (a ring frame, a pull or push request), modelling a
//! link's one-way latency; the control plane (coordination, heartbeats) is not delayed.
//!
//! [`bytes`] and [`set_network_delay`] install the process's recorder ([`install`]) on first use,
//! so bytes are counted from then on. If the process installed other hooks first, the recorder
//! counts nothing and delays nothing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::hooks::{self, DataPlaneHooks};

/// Data-plane hooks that count the bytes sent and received and hold every message sent for a
/// fixed delay (none at first).
#[derive(Debug, Default)]
pub struct Recorder {
    sent: AtomicU64,
    received: AtomicU64,
    delay_ns: AtomicU64,
}

impl Recorder {
    /// A recorder with zero counts and no delay.
    pub const fn new() -> Self {
        Self { sent: AtomicU64::new(0), received: AtomicU64::new(0), delay_ns: AtomicU64::new(0) }
    }

    /// Bytes sent and received so far.
    pub fn bytes(&self) -> (u64, u64) {
        (self.sent.load(Ordering::Relaxed), self.received.load(Ordering::Relaxed))
    }

    /// Holds every message sent for `delay` from now on (zero: none).
    pub fn set_delay(&self, delay: Duration) {
        self.delay_ns.store(delay.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
    }

    /// The delay, if any.
    pub fn delay(&self) -> Option<Duration> {
        match self.delay_ns.load(Ordering::Relaxed) {
            0 => None,
            ns => Some(Duration::from_nanos(ns)),
        }
    }
}

impl DataPlaneHooks for Recorder {
    fn on_send(&self, bytes: usize) {
        self.sent.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    fn on_receive(&self, bytes: usize) {
        self.received.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    fn before_send(&self) -> Option<Duration> {
        self.delay()
    }
}

/// The process's recorder (what [`bytes`] and [`set_network_delay`] read and set).
static RECORDER: Recorder = Recorder::new();

/// Installs the process's recorder as its data-plane hooks (once; later calls change nothing);
/// `false` if other hooks were installed first.
pub fn install() -> bool {
    hooks::set_hooks(&RECORDER)
        || hooks::installed()
            .is_some_and(|h| std::ptr::addr_eq(h as *const dyn DataPlaneHooks, &RECORDER as *const Recorder))
}

/// Bytes this process has sent and received on the data plane since its recorder was
/// installed (by this call at the latest).
pub fn bytes() -> (u64, u64) {
    install();
    RECORDER.bytes()
}

/// Adds `delay` before every data-plane message this process sends (zero: none).
pub fn set_network_delay(delay: Duration) {
    install();
    RECORDER.set_delay(delay);
}

/// The injected delay, if any.
pub fn network_delay() -> Option<Duration> {
    RECORDER.delay()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_add_up_and_the_delay_is_kept() {
        assert!(install());
        let (s0, r0) = bytes();
        hooks::sent(10);
        hooks::received(7);
        let (s1, r1) = bytes();
        assert!(s1 - s0 >= 10 && r1 - r0 >= 7);
        assert_eq!(network_delay(), None);
        set_network_delay(Duration::from_micros(1500));
        assert_eq!(network_delay(), Some(Duration::from_micros(1500)));
        let t = std::time::Instant::now();
        hooks::before_send_blocking();
        assert!(t.elapsed() >= Duration::from_micros(1500));
        set_network_delay(Duration::ZERO);
        assert_eq!(network_delay(), None);
    }

    #[test]
    fn a_recorder_of_its_own_counts_what_it_is_told() {
        let r = Recorder::new();
        r.on_send(3);
        r.on_receive(4);
        r.on_send(5);
        assert_eq!(r.bytes(), (8, 4));
        assert_eq!(r.before_send(), None);
        r.set_delay(Duration::from_millis(2));
        assert_eq!(r.before_send(), Some(Duration::from_millis(2)));
    }
}
