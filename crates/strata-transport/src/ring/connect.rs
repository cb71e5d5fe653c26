//! Building the mesh: every task dials the lower ranks and accepts the higher ones, in any start
//! order, until the connect deadline. Each connection starts with a handshake: the dialer
//! presents its rank, the cluster token and the fingerprint; the acceptor refuses a wrong token
//! (and keeps waiting for the right peer) and refuses a different fingerprint or ring
//! configuration (and fails, as does the dialer, with an error naming both tasks).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use subtle::ConstantTimeEq;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio::time::{sleep, sleep_until, timeout_at, Instant};

use super::wire::{self, Hello, Reply, HELLO_FIXED};
use super::{AbortSignal, ABORT_POLL};
use crate::{Error, Result};

/// What the handshake needs to know about this task and its cluster.
#[derive(Debug)]
pub(crate) struct Params {
    pub rank: usize,
    pub addresses: Vec<SocketAddr>,
    pub names: Vec<String>,
    pub token: Option<Vec<u8>>,
    pub fingerprint: Vec<u8>,
    pub chunk_bytes: usize,
    pub small_bytes: usize,
    pub connect_timeout: Duration,
    pub socket_buffer: Option<usize>,
}

impl Params {
    fn n(&self) -> usize {
        self.addresses.len()
    }

    fn name(&self, p: usize) -> String {
        self.names.get(p).cloned().unwrap_or_else(|| format!("rank {p}"))
    }

    fn me(&self) -> String {
        self.name(self.rank)
    }

    fn hello(&self) -> Hello {
        Hello {
            rank: self.rank as u32,
            size: self.n() as u32,
            chunk_bytes: self.chunk_bytes as u64,
            small_bytes: self.small_bytes as u64,
            token: self.token.clone(),
            fingerprint: self.fingerprint.clone(),
        }
    }
}

/// The longest a single handshake may take (a silent connection must not hold up the others).
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Applies the socket options of every ring connection.
pub(crate) fn configure(s: &TcpStream, buffer: Option<usize>) -> Result<()> {
    s.set_nodelay(true).map_err(|e| Error::io("setting TCP_NODELAY on a ring connection", e))?;
    if let Some(bytes) = buffer {
        let sock = socket2::SockRef::from(s);
        // Best effort: the kernel caps these at net.core.{w,r}mem_max.
        let _ = sock.set_send_buffer_size(bytes);
        let _ = sock.set_recv_buffer_size(bytes);
    }
    Ok(())
}

/// Connects to every peer; `streams[p]` is the connection to rank `p`.
pub(crate) async fn build(
    p: Arc<Params>,
    listener: Option<TcpListener>,
    abort: &AbortSignal,
) -> Result<Vec<Option<TcpStream>>> {
    let n = p.n();
    let deadline = Instant::now() + p.connect_timeout;
    let mut streams: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    let claimed = Arc::new(Mutex::new(vec![false; n]));
    let mut dials = JoinSet::new();
    for j in 0..p.rank {
        dials.spawn(dial(p.clone(), j));
    }
    let mut handshakes = JoinSet::new();
    let mut refused: Vec<SocketAddr> = Vec::new();
    let mut tick = tokio::time::interval(ABORT_POLL);
    let accepting = p.rank + 1 < n;
    if accepting && listener.is_none() {
        return Err(Error::Config(format!("task {} needs a listener to accept the higher ranks", p.me())));
    }
    loop {
        let missing: Vec<usize> = (0..n).filter(|&j| j != p.rank && streams[j].is_none()).collect();
        if missing.is_empty() {
            return Ok(streams);
        }
        tokio::select! {
            _ = sleep_until(deadline) => {
                let names: Vec<String> = missing.iter().map(|&j| p.name(j)).collect();
                if !refused.is_empty() {
                    let addrs: Vec<String> = refused.iter().map(|a| a.to_string()).collect();
                    return Err(Error::Unauthenticated(format!(
                        "task {} refused {} connection(s) from {} with a wrong or missing cluster token, and task(s) {} \
                         did not connect within {:?}; give every task the same cluster token",
                        p.me(), refused.len(), addrs.join(", "), names.join(", "), p.connect_timeout
                    )));
                }
                return Err(Error::Timeout {
                    task: names.join(", "),
                    collective: "connecting the ring".into(),
                    step: 0,
                    timeout: p.connect_timeout,
                });
            }
            _ = tick.tick() => {
                if let Some(reason) = abort.reason() {
                    return Err(Error::Aborted(format!("connecting the ring on task {} was aborted: {reason}", p.me())));
                }
            }
            acc = accept(listener.as_ref()), if accepting => match acc {
                Ok((s, addr)) => {
                    handshakes.spawn(accept_one(p.clone(), claimed.clone(), s, addr, deadline));
                }
                // Transient (e.g. out of file descriptors): try again shortly.
                Err(_) => sleep(Duration::from_millis(20)).await,
            },
            Some(res) = dials.join_next() => match res {
                Ok(Ok((j, s))) => streams[j] = Some(s),
                Ok(Err(e)) => return Err(e),
                Err(e) => return Err(Error::Config(format!("dialing a peer failed: {e}"))),
            },
            Some(res) = handshakes.join_next() => match res {
                Ok(Accepted::Peer(j, s)) => streams[j] = Some(s),
                Ok(Accepted::Unauthenticated(addr)) => refused.push(addr),
                Ok(Accepted::Ignored) => {}
                Ok(Accepted::Fatal(e)) => return Err(e),
                Err(e) => return Err(Error::Config(format!("a ring handshake failed: {e}"))),
            },
        }
    }
}

async fn accept(listener: Option<&TcpListener>) -> std::io::Result<(TcpStream, SocketAddr)> {
    match listener {
        Some(l) => l.accept().await,
        None => std::future::pending().await,
    }
}

/// Dials rank `j` until it answers (the outer deadline stops it); fails at once when the peer
/// refuses this task.
async fn dial(p: Arc<Params>, j: usize) -> Result<(usize, TcpStream)> {
    let addr = p.addresses[j];
    let mut backoff = Duration::from_millis(10);
    loop {
        if let Ok(Ok(s)) = tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(addr)).await {
            configure(&s, p.socket_buffer)?;
            match dialer_handshake(&p, j, s).await {
                Ok(Some(s)) => return Ok((j, s)),
                Ok(None) => {}
                Err(e) => return Err(e),
            }
        }
        sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_millis(200));
    }
}

/// `Ok(None)`: the connection closed before an answer (try again).
async fn dialer_handshake(p: &Params, j: usize, mut s: TcpStream) -> Result<Option<TcpStream>> {
    let until = Instant::now() + HANDSHAKE_TIMEOUT;
    let io = async {
        s.write_all(&p.hello().encode()).await?;
        let mut status = [0u8; 1];
        s.read_exact(&mut status).await?;
        match status[0] {
            0 => {
                let mut rank = [0u8; 4];
                s.read_exact(&mut rank).await?;
                Ok(Reply::Accept { rank: u32::from_le_bytes(rank) })
            }
            1 => Ok(Reply::Unauthenticated),
            2 => {
                let fingerprint = read_field(&mut s, "fingerprint").await?;
                let reason = read_field(&mut s, "reason").await?;
                Ok(Reply::Refused { fingerprint, reason: String::from_utf8_lossy(&reason).into_owned() })
            }
            x => Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("unknown handshake status {x}"))),
        }
    };
    let reply = match timeout_at(until, io).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::InvalidData => {
            return Err(Error::Protocol { peer: p.name(j), detail: format!("during the ring handshake: {e}") })
        }
        // Closed, reset or silent: perhaps not the peer yet (or a previous run's); try again.
        _ => return Ok(None),
    };
    match reply {
        Reply::Accept { rank } if rank as usize == j => Ok(Some(s)),
        Reply::Accept { rank } => Err(Error::Config(format!(
            "task {} at {} answered as rank {rank}, but rank {j} was expected there: check the cluster addresses",
            p.name(j),
            p.addresses[j]
        ))),
        Reply::Unauthenticated => Err(Error::Unauthenticated(format!(
            "task {} at {} refused task {}: the cluster token does not match; give every task the same cluster token",
            p.name(j),
            p.addresses[j],
            p.me()
        ))),
        Reply::Refused { reason, .. } => Err(Error::Config(reason)),
    }
}

async fn read_field(s: &mut TcpStream, what: &str) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).await?;
    let len = wire::field_len(len, what).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    let mut v = vec![0u8; len];
    s.read_exact(&mut v).await?;
    Ok(v)
}

/// What one accepted connection turned out to be.
enum Accepted {
    /// The peer of that rank, authenticated and agreeing.
    Peer(usize, TcpStream),
    /// Refused: a wrong or missing token.
    Unauthenticated(SocketAddr),
    /// Not a ring peer (garbage, silence, a duplicate): closed, keep waiting.
    Ignored,
    /// A peer of this cluster that runs something else: both sides fail.
    Fatal(Error),
}

async fn accept_one(
    p: Arc<Params>,
    claimed: Arc<Mutex<Vec<bool>>>,
    mut s: TcpStream,
    addr: SocketAddr,
    deadline: Instant,
) -> Accepted {
    let until = deadline.min(Instant::now() + HANDSHAKE_TIMEOUT);
    let read = async {
        let mut fixed = [0u8; HELLO_FIXED];
        s.read_exact(&mut fixed).await?;
        let fixed =
            wire::parse_hello_fixed(&fixed).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        let token = read_field(&mut s, "token").await?;
        let fingerprint = read_field(&mut s, "fingerprint").await?;
        Ok::<_, std::io::Error>((fixed, token, fingerprint))
    };
    let ((rank, size, chunk_bytes, small_bytes, has_token), token, fingerprint) = match timeout_at(until, read).await {
        Ok(Ok(h)) => h,
        _ => return Accepted::Ignored,
    };
    let token_ok = match (&p.token, has_token) {
        (None, false) => true,
        (Some(mine), true) => bool::from(mine.as_slice().ct_eq(token.as_slice())),
        _ => false,
    };
    if !token_ok {
        send_reply(&mut s, &Reply::Unauthenticated, until).await;
        return Accepted::Unauthenticated(addr);
    }
    let n = p.n();
    let r = rank as usize;
    let theirs = if r < n { p.name(r) } else { format!("rank {rank} at {addr}") };
    let refusal = if fingerprint != p.fingerprint {
        Some(format!(
            "task {theirs} runs cluster spec and strategy fingerprint `{}` but task {} runs `{}`: start every task \
             with the same cluster spec and strategy",
            wire::show_fingerprint(&fingerprint),
            p.me(),
            wire::show_fingerprint(&p.fingerprint)
        ))
    } else if size as usize != n || r >= n || r <= p.rank {
        Some(format!(
            "task {theirs} says it is rank {rank} of {size} tasks, but task {} (rank {}) expects ranks above {} of \
             {n} tasks to dial it: check the cluster addresses",
            p.me(),
            p.rank,
            p.rank
        ))
    } else if chunk_bytes != p.chunk_bytes as u64 || small_bytes != p.small_bytes as u64 {
        Some(format!(
            "task {theirs} uses ring chunk_bytes {chunk_bytes} and small_bytes {small_bytes} but task {} uses {} and \
             {}: give every task the same ring configuration",
            p.me(),
            p.chunk_bytes,
            p.small_bytes
        ))
    } else {
        None
    };
    if let Some(reason) = refusal {
        send_reply(&mut s, &Reply::Refused { fingerprint: p.fingerprint.clone(), reason: reason.clone() }, until).await;
        return Accepted::Fatal(Error::Config(reason));
    }
    {
        let mut c = claimed.lock().unwrap_or_else(|e| e.into_inner());
        if c[r] {
            return Accepted::Ignored;
        }
        c[r] = true;
    }
    if !send_reply(&mut s, &Reply::Accept { rank: p.rank as u32 }, until).await
        || configure(&s, p.socket_buffer).is_err()
    {
        claimed.lock().unwrap_or_else(|e| e.into_inner())[r] = false;
        return Accepted::Ignored;
    }
    Accepted::Peer(r, s)
}

/// Writes a handshake reply; false if it could not be written in time.
async fn send_reply(s: &mut TcpStream, r: &Reply, until: Instant) -> bool {
    matches!(timeout_at(until, s.write_all(&r.encode())).await, Ok(Ok(())))
}
