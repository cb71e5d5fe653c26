//! What a process sends and receives, and the network delay `strata compare` injects.
//!
//! Counters are process-wide: the ring's frames (headers included) and the parameter-server
//! client's tensor payloads. The delay, when set, is added before every message this process
//! sends on the data plane (a ring frame, a pull or push request), modelling a link's one-way
//! latency; the control plane (coordination, heartbeats) is not delayed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

static SENT: AtomicU64 = AtomicU64::new(0);
static RECEIVED: AtomicU64 = AtomicU64::new(0);
static DELAY_NS: AtomicU64 = AtomicU64::new(0);

/// Bytes this process has sent and received on the data plane so far.
pub fn bytes() -> (u64, u64) {
    (SENT.load(Ordering::Relaxed), RECEIVED.load(Ordering::Relaxed))
}

pub(crate) fn count_sent(n: usize) {
    SENT.fetch_add(n as u64, Ordering::Relaxed);
}

pub(crate) fn count_received(n: usize) {
    RECEIVED.fetch_add(n as u64, Ordering::Relaxed);
}

/// Adds `delay` before every data-plane message this process sends (zero: none).
pub fn set_network_delay(delay: Duration) {
    DELAY_NS.store(delay.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
}

/// The injected delay, if any.
pub fn network_delay() -> Option<Duration> {
    match DELAY_NS.load(Ordering::Relaxed) {
        0 => None,
        ns => Some(Duration::from_nanos(ns)),
    }
}

/// Waits the injected delay (async data plane).
pub(crate) async fn delay_async() {
    if let Some(d) = network_delay() {
        tokio::time::sleep(d).await;
    }
}

/// Waits the injected delay (blocking clients).
pub(crate) fn delay_blocking() {
    if let Some(d) = network_delay() {
        std::thread::sleep(d);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_add_up_and_the_delay_is_kept() {
        let (s0, r0) = bytes();
        count_sent(10);
        count_received(7);
        let (s1, r1) = bytes();
        assert!(s1 - s0 >= 10 && r1 - r0 >= 7);
        assert_eq!(network_delay(), None);
        set_network_delay(Duration::from_micros(1500));
        assert_eq!(network_delay(), Some(Duration::from_micros(1500)));
        let t = std::time::Instant::now();
        delay_blocking();
        assert!(t.elapsed() >= Duration::from_micros(1500));
        set_network_delay(Duration::ZERO);
        assert_eq!(network_delay(), None);
    }
}
