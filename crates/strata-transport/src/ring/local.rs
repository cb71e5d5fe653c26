//! Unix sockets between the workers of one host: after the TCP mesh is built and authenticated,
//! each connection whose two ends have the same address (both processes on this host, in this
//! network namespace) moves to a Unix stream socket, and the TCP connection closes.
//!
//! Why: on loopback a ring's bytes are CPU, not wire. TCP costs its whole stack per segment
//! (the receive path runs as a softirq in the sender's time, ACKs, segmentation); a Unix stream
//! socket is two copies and a wake-up. Moving 2 x 512 MiB both ways at once between two
//! processes here took 0.29-0.42 s of CPU per GB over loopback TCP and 0.14-0.18 s over Unix
//! sockets with 4 MiB buffers (five alternating rounds, 2026-12-05); in a multi-worker step of
//! the 4.3M MLP the ring thread spent 6.4 ms of CPU per step over TCP (`--timeline`).
//!
//! The move is a short exchange on the authenticated TCP connection: both ends say whether
//! their two addresses agree (only if both do does anything change); the lower rank binds a
//! listener at a random abstract name (Linux's abstract namespace: no file, gone with the
//! process) and sends the name and a random 32-byte secret; the higher rank connects, says so
//! on TCP, and presents the secret on the Unix socket, which the lower rank compares in
//! constant time before it answers. Another process that connects first is dropped and the
//! listener goes on waiting until the handshake deadline. If the higher rank cannot connect
//! (another network namespace with the same address), both keep the TCP connection.
//! `STRATA_RING_UNIX=0` keeps every connection on TCP.

use std::os::linux::net::SocketAddrExt;

use subtle::ConstantTimeEq;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UnixListener, UnixStream};
use tokio::time::{timeout_at, Instant};

use super::link::{ReadHalf, WriteHalf};
use crate::{Error, Result};

/// The bytes of the secret a Unix connection presents.
const SECRET: usize = 32;

/// The send and receive buffers of a Unix ring connection (the kernel caps them at
/// `net.core.wmem_max` and `rmem_max`): with the default 208 KiB a 256 KiB chunk never fits, and
/// both directions at once ran at a tenth of their speed in some rounds.
pub const UNIX_BUFFER: usize = 4 << 20;

/// Whether `STRATA_RING_UNIX` allows Unix sockets (anything but `0`, `false`, `off` or `no`).
pub(crate) fn allowed_by_env() -> bool {
    std::env::var("STRATA_RING_UNIX")
        .map(|v| !matches!(v.trim().to_ascii_lowercase().as_str(), "0" | "false" | "off" | "no"))
        .unwrap_or(true)
}

/// One ring connection: TCP, or a Unix stream socket to a worker on this host.
#[derive(Debug)]
pub(crate) enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    /// The read and write halves.
    pub(crate) fn into_split(self) -> (ReadHalf, WriteHalf) {
        match self {
            Stream::Tcp(s) => {
                let (r, w) = s.into_split();
                (Box::new(r), Box::new(w))
            }
            Stream::Unix(s) => {
                let (r, w) = s.into_split();
                (Box::new(r), Box::new(w))
            }
        }
    }

    /// Whether this is a Unix socket.
    pub(crate) fn is_unix(&self) -> bool {
        matches!(self, Stream::Unix(_))
    }
}

/// Whether the two ends of `s` have one address: the peer runs on this host.
fn same_host(s: &TcpStream) -> bool {
    matches!((s.local_addr(), s.peer_addr()), (Ok(l), Ok(p)) if l.ip() == p.ip())
}

/// Moves the TCP connection `s` to rank `peer` onto a Unix socket where both ends are on this
/// host and both `allow` it; `me` is this task's rank, `name` the peer's task name (for errors).
/// Both ends call it at once, after the ring's handshake.
pub(crate) async fn upgrade(mut s: TcpStream, me: usize, peer: usize, name: &str, allow: bool) -> Result<Stream> {
    let until = Instant::now() + super::connect::HANDSHAKE_TIMEOUT;
    let lost = |what: &str, e: std::io::Error| Error::PeerLost {
        task: name.to_string(),
        collective: "connecting the ring".into(),
        step: 0,
        detail: format!("{what}: {e}"),
    };
    let protocol = |detail: String| Error::Protocol { peer: name.to_string(), detail };
    let timed_out = || Error::Timeout {
        task: name.to_string(),
        collective: "moving a ring connection to a Unix socket".into(),
        step: 0,
        timeout: super::connect::HANDSHAKE_TIMEOUT,
    };
    let want = allow && same_host(&s);
    let theirs = timeout_at(until, async {
        s.write_all(&[want as u8]).await?;
        s.read_u8().await
    })
    .await
    .map_err(|_| timed_out())?
    .map_err(|e| lost("exchanging the Unix socket offer", e))?;
    if theirs > 1 {
        return Err(protocol(format!("a Unix socket offer of {theirs}")));
    }
    if !(want && theirs == 1) {
        return Ok(Stream::Tcp(s));
    }
    let io = |what: &'static str| move |e: std::io::Error| lost(what, e);
    if me < peer {
        let secret: [u8; SECRET] = rand::random();
        let label = format!("strata-ring-{:032x}", rand::random::<u128>());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(label.as_bytes())
            .map_err(io("naming the Unix listener"))?;
        let listener = std::os::unix::net::UnixListener::bind_addr(&addr).map_err(io("binding the Unix listener"))?;
        listener.set_nonblocking(true).map_err(io("binding the Unix listener"))?;
        let listener = UnixListener::from_std(listener).map_err(io("binding the Unix listener"))?;
        let mut offer = Vec::with_capacity(1 + label.len() + SECRET);
        offer.push(label.len() as u8);
        offer.extend_from_slice(label.as_bytes());
        offer.extend_from_slice(&secret);
        let connected = timeout_at(until, async {
            s.write_all(&offer).await?;
            s.read_u8().await
        })
        .await
        .map_err(|_| timed_out())?
        .map_err(io("sending the Unix socket's name"))?;
        match connected {
            0 => return Ok(Stream::Tcp(s)),
            1 => {}
            x => return Err(protocol(format!("a Unix connection report of {x}"))),
        }
        loop {
            let (mut u, _) = timeout_at(until, listener.accept())
                .await
                .map_err(|_| timed_out())?
                .map_err(io("accepting the Unix connection"))?;
            let mut presented = [0u8; SECRET];
            let read = timeout_at(until, u.read_exact(&mut presented)).await;
            if matches!(read, Ok(Ok(_))) && bool::from(presented.ct_eq(&secret)) {
                timeout_at(until, u.write_all(&[1]))
                    .await
                    .map_err(|_| timed_out())?
                    .map_err(io("accepting the Unix connection"))?;
                configure(&u);
                return Ok(Stream::Unix(u));
            }
            // Not the peer (no secret, or another one): closed; go on waiting.
        }
    } else {
        let len = timeout_at(until, s.read_u8())
            .await
            .map_err(|_| timed_out())?
            .map_err(io("reading the Unix socket's name"))? as usize;
        if !(1..=100).contains(&len) {
            return Err(protocol(format!("a Unix socket name of {len} bytes")));
        }
        let mut offer = vec![0u8; len + SECRET];
        timeout_at(until, s.read_exact(&mut offer))
            .await
            .map_err(|_| timed_out())?
            .map_err(io("reading the Unix socket's name"))?;
        let (label, secret) = offer.split_at(len);
        let dialed = std::os::unix::net::SocketAddr::from_abstract_name(label)
            .and_then(|a| std::os::unix::net::UnixStream::connect_addr(&a))
            .and_then(|u| u.set_nonblocking(true).map(|()| u))
            .and_then(UnixStream::from_std);
        let Ok(mut u) = dialed else {
            // Another network namespace behind the same address: stay on TCP.
            timeout_at(until, s.write_all(&[0]))
                .await
                .map_err(|_| timed_out())?
                .map_err(io("reporting the Unix connection"))?;
            return Ok(Stream::Tcp(s));
        };
        let ack = timeout_at(until, async {
            s.write_all(&[1]).await?;
            u.write_all(secret).await?;
            u.read_u8().await
        })
        .await
        .map_err(|_| timed_out())?
        .map_err(io("presenting the Unix connection's secret"))?;
        if ack != 1 {
            return Err(protocol(format!("a Unix connection answer of {ack}")));
        }
        configure(&u);
        Ok(Stream::Unix(u))
    }
}

/// Best effort: the kernel caps the buffers at its maxima.
fn configure(u: &UnixStream) {
    let sock = socket2::SockRef::from(u);
    let _ = sock.set_send_buffer_size(UNIX_BUFFER);
    let _ = sock.set_recv_buffer_size(UNIX_BUFFER);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How long a test waits before it gives up on an upgrade.
    const TEST_WAIT: std::time::Duration = std::time::Duration::from_secs(20);
    use tokio::net::TcpListener;

    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (b, _) = l.accept().await.unwrap();
        (a, b)
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
    }

    #[test]
    fn loopback_peers_move_to_a_unix_socket_that_carries_bytes_both_ways() {
        rt().block_on(async {
            let (a, b) = pair().await;
            let (low, high) = tokio::time::timeout(TEST_WAIT, async {
                tokio::join!(upgrade(b, 0, 1, "w1", true), upgrade(a, 1, 0, "w0", true))
            })
            .await
            .unwrap();
            let (low, high) = (low.unwrap(), high.unwrap());
            assert!(low.is_unix() && high.is_unix());
            let ((mut lr, mut lw), (mut hr, mut hw)) = (low.into_split(), high.into_split());
            let payload: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
            let (mut x, mut y) = (vec![0u8; payload.len()], vec![0u8; payload.len()]);
            let (r1, r2, r3, r4) = tokio::join!(
                lw.write_all(&payload),
                hr.read_exact(&mut x),
                hw.write_all(&payload),
                lr.read_exact(&mut y)
            );
            r1.unwrap();
            r2.unwrap();
            r3.unwrap();
            r4.unwrap();
            assert!(x == payload && y == payload);
        });
    }

    #[test]
    fn either_side_can_keep_tcp() {
        for (low_allows, high_allows) in [(false, true), (true, false), (false, false)] {
            rt().block_on(async {
                let (a, b) = pair().await;
                let (low, high) = tokio::join!(upgrade(b, 0, 1, "w1", low_allows), upgrade(a, 1, 0, "w0", high_allows));
                let (low, high) = (low.unwrap(), high.unwrap());
                assert!(!low.is_unix() && !high.is_unix());
                // The TCP connection still works.
                let ((_, mut lw), (mut hr, _)) = (low.into_split(), high.into_split());
                lw.write_all(b"still tcp").await.unwrap();
                let mut got = [0u8; 9];
                hr.read_exact(&mut got).await.unwrap();
                assert_eq!(&got, b"still tcp");
            });
        }
    }

    /// A process that connects to the lower rank's listener first, with a wrong secret, is
    /// dropped, and the listener goes on to take the peer that presents the right one.
    #[test]
    fn a_stranger_on_the_unix_listener_is_dropped() {
        rt().block_on(async {
            let (a, mut b) = pair().await;
            // The higher rank's side played by hand, from the offer the lower rank sends.
            let low = tokio::spawn(async move { upgrade(a, 0, 1, "w1", true).await });
            b.write_all(&[1]).await.unwrap();
            assert_eq!(b.read_u8().await.unwrap(), 1);
            let len = b.read_u8().await.unwrap() as usize;
            let mut offer = vec![0u8; len + SECRET];
            b.read_exact(&mut offer).await.unwrap();
            let (label, secret) = offer.split_at(len);
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(label).unwrap();
            b.write_all(&[1]).await.unwrap();
            let mut stranger = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
            std::io::Write::write_all(&mut stranger, &[0u8; SECRET]).unwrap();
            let peer = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
            peer.set_nonblocking(true).unwrap();
            let mut peer = UnixStream::from_std(peer).unwrap();
            peer.write_all(secret).await.unwrap();
            assert_eq!(peer.read_u8().await.unwrap(), 1, "the peer is accepted");
            assert!(low.await.unwrap().unwrap().is_unix());
            // The stranger's connection was closed without an answer.
            let mut answer = Vec::new();
            assert_eq!(std::io::Read::read_to_end(&mut stranger, &mut answer).unwrap(), 0);
        });
    }
}
