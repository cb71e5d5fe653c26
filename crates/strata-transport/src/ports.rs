//! Ports for tasks that a launcher (or a test) starts on this machine: picked free now, and
//! unlikely to be taken before the tasks bind them.
//!
//! A port the kernel hands out for a bind to port 0 comes from its ephemeral range, the range
//! every outgoing connection's source port also comes from. Picked that way and released, a
//! port can become some other process's connection before a task binds it ("address already in
//! use"). So the ports here come from below that range (`/proc/sys/net/ipv4/ip_local_port_range`
//! on Linux; 32768 elsewhere), where the kernel never picks one by itself: each handed out once
//! per process (a counter that starts at an offset of the process id, so that two launchers
//! start apart), and only one that a bind on the host succeeds on now. Where the range leaves no
//! room below it, the kernel's own picks.

use std::net::{IpAddr, TcpListener};
use std::sync::atomic::{AtomicU32, Ordering};

/// The lowest port handed out.
const LOW: u32 = 10_000;

/// Fewer ports than this below the ephemeral range: use the kernel's picks.
const ROOM: u32 = 1_000;

/// `n` distinct ports on `host` that a bind succeeded on just now; see the module. Errors: a
/// bind to port 0 on `host` fails (an address of no interface here), or every port below the
/// ephemeral range is in use.
pub fn free_ports(host: IpAddr, n: usize) -> std::io::Result<Vec<u16>> {
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let ephemeral = ephemeral_start();
    let span = ephemeral.saturating_sub(LOW);
    if span < ROOM {
        let ls = (0..n).map(|_| TcpListener::bind((host, 0))).collect::<std::io::Result<Vec<_>>>()?;
        return ls.iter().map(|l| l.local_addr().map(|a| a.port())).collect();
    }
    // The host must be bindable at all: otherwise every port below would fail, one by one.
    drop(TcpListener::bind((host, 0))?);
    let start = std::process::id().wrapping_mul(7_919) % span;
    let _ = NEXT.compare_exchange(u32::MAX, start, Ordering::Relaxed, Ordering::Relaxed);
    let mut ports = Vec::with_capacity(n);
    for _ in 0..span {
        if ports.len() == n {
            break;
        }
        let port = u16::try_from(LOW + NEXT.fetch_add(1, Ordering::Relaxed) % span).expect("below the ephemeral range");
        if TcpListener::bind((host, port)).is_ok() {
            ports.push(port);
        }
    }
    if ports.len() < n {
        return Err(std::io::Error::new(
            std::io::ErrorKind::AddrInUse,
            format!("fewer than {n} free ports between {LOW} and {ephemeral} on {host}"),
        ));
    }
    Ok(ports)
}

/// The first port of the kernel's ephemeral range.
fn ephemeral_start() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| t.split_whitespace().next().and_then(|l| l.parse().ok()))
        .unwrap_or(32_768)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_below_the_ephemeral_range_and_bindable() {
        let host: IpAddr = "127.0.0.1".parse().unwrap();
        let a = free_ports(host, 8).unwrap();
        let b = free_ports(host, 8).unwrap();
        let all: std::collections::BTreeSet<u16> = a.iter().chain(&b).copied().collect();
        assert_eq!(all.len(), 16, "{a:?} {b:?}");
        if ephemeral_start() >= LOW + ROOM {
            assert!(all.iter().all(|&p| u32::from(p) >= LOW && u32::from(p) < ephemeral_start()), "{all:?}");
        }
        for p in a {
            TcpListener::bind((host, p)).unwrap();
        }
    }

    #[test]
    fn a_port_in_use_is_never_handed_out() {
        let host: IpAddr = "127.0.0.1".parse().unwrap();
        let next = free_ports(host, 1).unwrap()[0];
        // Hold the ports the counter comes to next, then ask: none of them comes back.
        let held: Vec<TcpListener> =
            (1..=4).filter_map(|d| TcpListener::bind((host, next.checked_add(d)?)).ok()).collect();
        let held_ports: Vec<u16> = held.iter().map(|l| l.local_addr().unwrap().port()).collect();
        let got = free_ports(host, 4).unwrap();
        assert!(got.iter().all(|p| !held_ports.contains(p)), "{got:?} {held_ports:?}");
    }

    #[test]
    fn an_address_of_no_interface_is_an_error() {
        assert!(free_ports("192.0.2.1".parse().unwrap(), 1).is_err());
    }
}
