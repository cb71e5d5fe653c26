//! The piece service: ZeRO stage 3 across workers pulls the other workers' runs of a
//! parameter when a replica first uses it, in no order with the ring's collectives
//! ([`Ring::serve_pieces`]).
//!
//! It runs on a second mesh of connections, built as the ring's is (the same handshake, token
//! and fingerprint, on ports every worker learns from one all-gather on the ring), so that a
//! pull never waits behind a collective's bytes and no worker has to pull in the order
//! another does. Each connection carries requests both ways: a reader thread hands the
//! peer's requests to a server thread (which may wait for this worker to reach the version
//! asked for) and the answers to this worker's requests to the one request waiting for them.
//! Requests from this worker to a peer go one at a time.
//!
//! Frames (little endian): a request `Q`, id (u64), variable (u32), version (u64), length
//! (u64); an answer `A`, id (u64), length (u64), then that many f32 values; a refusal `E`, id
//! (u64), message length (u32, at most [`MAX_MESSAGE`]), then the message. A reader accepts an
//! answer only of the length the request waiting for it asked for, so a peer cannot make it
//! allocate more, and closes a connection that sends anything else.
//!
//! This module must not know what the pieces are: it moves f32 values between a
//! [`PieceSource`] and its peers.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use strata_core::cross_device::{PeerPieces, PieceSource};

use super::{connect, Ring};
use crate::{Error, Result};

/// The longest refusal message accepted.
const MAX_MESSAGE: usize = 4096;
/// Requests a connection's reader holds for its server thread before it stops reading.
const QUEUED_REQUESTS: usize = 8;
const TAG_REQUEST: u8 = b'Q';
const TAG_ANSWER: u8 = b'A';
const TAG_REFUSAL: u8 = b'E';

/// This worker's requests to its peers for their pieces, and (on threads of its own) its
/// answers to theirs; both end when it is dropped.
#[derive(Debug)]
pub struct Pieces {
    peers: Vec<Option<Arc<Peer>>>,
    names: Vec<String>,
    timeout: Duration,
}

/// One peer's connection.
#[derive(Debug)]
struct Peer {
    name: String,
    stream: TcpStream,
    /// Writes (requests and answers) one frame at a time.
    writer: Mutex<TcpStream>,
    /// This worker's request in flight to the peer, one at a time, and its answers.
    asking: Mutex<Receiver<Answer>>,
    /// The length the request in flight asked for (the most an answer may carry).
    expected: AtomicU64,
    next_id: AtomicU64,
}

/// What a reader hands to the request waiting: its id and the values, or the peer's refusal.
type Answer = (u64, std::result::Result<Vec<f32>, String>);

/// A peer's request.
struct Request {
    id: u64,
    var: u32,
    version: u64,
    len: u64,
}

impl Ring {
    /// Starts the piece service (collective: every worker calls it at the same point with the
    /// same `step`): binds a port beside this worker's ring address, learns every worker's
    /// from one all-gather, connects to every peer, and answers their requests from `source`
    /// while it lives.
    pub fn serve_pieces(&self, step: u64, source: Weak<dyn PieceSource>) -> Result<Pieces> {
        let p = &self.params;
        let n = p.addresses.len();
        let me = p.addresses[self.rank];
        let listener = TcpListener::bind(SocketAddr::new(me.ip(), 0)).map_err(|e| {
            Error::io(format!("task {} binding its piece service beside {me}", self.names[self.rank]), e)
        })?;
        let port = listener.local_addr().map_err(|e| Error::io("reading the piece service's address", e))?.port();
        // Ports are below 2^16: exact in an f32.
        let ports = self.all_gather(step, &[f32::from(port)])?;
        let mut addresses = Vec::with_capacity(n);
        for (j, a) in p.addresses.iter().enumerate() {
            let port = ports.get(j).and_then(|v| v.first()).copied().unwrap_or(-1.0);
            if !(1.0..=65535.0).contains(&port) || port.fract() != 0.0 {
                return Err(Error::Protocol {
                    peer: self.names[j].clone(),
                    detail: format!("its piece service's port {port} is no port"),
                });
            }
            addresses.push(SocketAddr::new(a.ip(), port as u16));
        }
        let mut fingerprint = p.fingerprint.clone();
        fingerprint.extend_from_slice(b"/pieces");
        let params = Arc::new(connect::Params {
            rank: self.rank,
            addresses,
            names: p.names.clone(),
            token: p.token.clone(),
            fingerprint,
            chunk_bytes: p.chunk_bytes,
            small_bytes: p.small_bytes,
            connect_timeout: p.connect_timeout,
            socket_buffer: p.socket_buffer,
        });
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(|e| Error::io("starting the piece service's runtime", e))?;
        let streams = rt.block_on(async {
            listener.set_nonblocking(true).map_err(|e| Error::io("making the piece listener non-blocking", e))?;
            let listener = tokio::net::TcpListener::from_std(listener)
                .map_err(|e| Error::io("registering the piece listener", e))?;
            connect::build(params, Some(listener), &self.abort).await
        })?;
        let mut peers = Vec::with_capacity(n);
        for (j, s) in streams.into_iter().enumerate() {
            let Some(s) = s else {
                peers.push(None);
                continue;
            };
            let stream = s.into_std().map_err(|e| Error::io("taking over a piece connection", e))?;
            stream.set_nonblocking(false).map_err(|e| Error::io("making a piece connection blocking", e))?;
            peers.push(Some(Peer::start(self.names[j].clone(), stream, source.clone(), self.timeout)?));
        }
        Ok(Pieces { peers, names: self.names.clone(), timeout: self.timeout })
    }
}

impl Peer {
    /// The peer's connection, its reader thread and its server thread started.
    fn start(name: String, stream: TcpStream, source: Weak<dyn PieceSource>, timeout: Duration) -> Result<Arc<Peer>> {
        let clone = |what: &str| {
            stream.try_clone().map_err(|e| Error::io(format!("sharing the piece connection to {name} ({what})"), e))
        };
        let (writer, reader) = (clone("writer")?, clone("reader")?);
        writer
            .set_write_timeout(Some(timeout))
            .map_err(|e| Error::io("setting a piece connection's write timeout", e))?;
        let (answers_tx, answers_rx) = mpsc::sync_channel::<Answer>(1);
        let (requests_tx, requests_rx) = mpsc::sync_channel::<Request>(QUEUED_REQUESTS);
        let peer = Arc::new(Peer {
            name: name.clone(),
            stream,
            writer: Mutex::new(writer),
            asking: Mutex::new(answers_rx),
            expected: AtomicU64::new(0),
            next_id: AtomicU64::new(1),
        });
        let weak = Arc::downgrade(&peer);
        std::thread::Builder::new()
            .name("strata-pieces-read".into())
            .spawn(move || read_frames(reader, &weak, &answers_tx, &requests_tx))
            .map_err(|e| Error::io("starting a piece connection's reader", e))?;
        let weak = Arc::downgrade(&peer);
        std::thread::Builder::new()
            .name("strata-pieces-serve".into())
            .spawn(move || serve(&requests_rx, &weak, &source, timeout))
            .map_err(|e| Error::io("starting a piece connection's server", e))?;
        Ok(peer)
    }

    fn write(&self, frame: &[u8]) -> std::io::Result<()> {
        self.writer.lock().unwrap_or_else(PoisonError::into_inner).write_all(frame)
    }
}

impl Drop for Pieces {
    fn drop(&mut self) {
        // The readers see the end of their connections, and the server threads their queues'.
        for p in self.peers.iter().flatten() {
            let _ = p.stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Pieces {
    /// Worker `worker`'s pieces of variable `var` at `version`: `len` values.
    pub fn pull_values(&self, worker: usize, var: usize, version: u64, len: usize) -> Result<Vec<f32>> {
        let name = self.names.get(worker).cloned().unwrap_or_else(|| format!("worker {worker}"));
        let peer = self.peers.get(worker).and_then(Option::as_ref).ok_or_else(|| {
            Error::Config(format!("no piece connection to {name}: a worker pulls only from its peers"))
        })?;
        let lost = |detail: String| Error::PeerLost {
            task: name.clone(),
            collective: "pulling parameters".into(),
            step: version,
            detail,
        };
        let answers = peer.asking.lock().unwrap_or_else(PoisonError::into_inner);
        let id = peer.next_id.fetch_add(1, Ordering::Relaxed);
        peer.expected.store(len as u64, Ordering::Release);
        let mut frame = Vec::with_capacity(29);
        frame.push(TAG_REQUEST);
        frame.extend_from_slice(&id.to_le_bytes());
        let var = u32::try_from(var).map_err(|_| Error::Config(format!("variable {var} is past a request's u32")))?;
        frame.extend_from_slice(&var.to_le_bytes());
        frame.extend_from_slice(&version.to_le_bytes());
        frame.extend_from_slice(&(len as u64).to_le_bytes());
        peer.write(&frame).map_err(|e| lost(format!("sending a request: {e}")))?;
        let deadline = Instant::now() + self.timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match answers.recv_timeout(left) {
                // An answer to an earlier request that timed out: not this one's.
                Ok((got, _)) if got != id => continue,
                Ok((_, Ok(values))) => return Ok(values),
                Ok((_, Err(refusal))) => {
                    return Err(Error::Protocol {
                        peer: name,
                        detail: format!("refused its pieces of variable {var}: {refusal}"),
                    })
                }
                Err(RecvTimeoutError::Timeout) => {
                    return Err(Error::Timeout {
                        task: name,
                        collective: "pulling parameters".into(),
                        step: version,
                        timeout: self.timeout,
                    })
                }
                Err(RecvTimeoutError::Disconnected) => return Err(lost("its piece connection closed".into())),
            }
        }
    }
}

impl PeerPieces for Pieces {
    fn pull(&self, worker: usize, var: usize, version: u64, len: usize) -> strata_core::Result<Vec<f32>> {
        self.pull_values(worker, var, version, len).map_err(|e| strata_core::Error::Cluster(e.to_string()))
    }
}

/// A connection's reader: requests to the server thread, answers to the request waiting.
/// Ends at the connection's end or at the first frame it cannot accept (then closes it).
fn read_frames(mut s: TcpStream, peer: &Weak<Peer>, answers: &SyncSender<Answer>, requests: &SyncSender<Request>) {
    let why = loop {
        let mut tag = [0u8; 1];
        if s.read_exact(&mut tag).is_err() {
            return;
        }
        let mut id = [0u8; 8];
        if s.read_exact(&mut id).is_err() {
            return;
        }
        let id = u64::from_le_bytes(id);
        match tag[0] {
            TAG_REQUEST => {
                let mut rest = [0u8; 20];
                if s.read_exact(&mut rest).is_err() {
                    return;
                }
                let var = u32::from_le_bytes(rest[..4].try_into().unwrap_or_default());
                let version = u64::from_le_bytes(rest[4..12].try_into().unwrap_or_default());
                let len = u64::from_le_bytes(rest[12..].try_into().unwrap_or_default());
                if requests.send(Request { id, var, version, len }).is_err() {
                    return;
                }
            }
            TAG_ANSWER => {
                let mut len = [0u8; 8];
                if s.read_exact(&mut len).is_err() {
                    return;
                }
                let len = u64::from_le_bytes(len);
                let Some(expected) = peer.upgrade().map(|p| p.expected.load(Ordering::Acquire)) else { return };
                if len != expected {
                    break format!("an answer of {len} values where {expected} were asked for");
                }
                let mut bytes = vec![0u8; len as usize * 4];
                if s.read_exact(&mut bytes).is_err() {
                    return;
                }
                let values = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
                // No request waits (it timed out): the answer is dropped.
                let _ = answers.try_send((id, Ok(values)));
            }
            TAG_REFUSAL => {
                let mut len = [0u8; 4];
                if s.read_exact(&mut len).is_err() {
                    return;
                }
                let len = u32::from_le_bytes(len) as usize;
                if len > MAX_MESSAGE {
                    break format!("a refusal of {len} bytes (at most {MAX_MESSAGE})");
                }
                let mut text = vec![0u8; len];
                if s.read_exact(&mut text).is_err() {
                    return;
                }
                let _ = answers.try_send((id, Err(String::from_utf8_lossy(&text).into_owned())));
            }
            other => break format!("a frame of unknown tag {other:#04x}"),
        }
    };
    let name = peer.upgrade().map_or_else(String::new, |p| p.name.clone());
    tracing::warn!(peer = %name, why = %why, "closing a piece connection");
    let _ = s.shutdown(std::net::Shutdown::Both);
}

/// A connection's server thread: answers the peer's requests from `source`, one at a time.
fn serve(requests: &Receiver<Request>, peer: &Weak<Peer>, source: &Weak<dyn PieceSource>, timeout: Duration) {
    while let Ok(r) = requests.recv() {
        let answer = match source.upgrade() {
            // Within 80% of the requester's own deadline, so that a version not reached comes
            // back as this refusal, which says why, rather than as the requester's timeout.
            Some(src) => src
                .pieces(r.var as usize, r.version, Instant::now() + timeout.mul_f32(0.8))
                .map_err(|e| e.to_string())
                .and_then(|v| {
                    if v.len() as u64 == r.len {
                        Ok(v)
                    } else {
                        Err(format!(
                            "it holds {} values of variable {}, not {}; every worker must build the same model",
                            v.len(),
                            r.var,
                            r.len
                        ))
                    }
                }),
            None => Err("this worker's optimizer is gone".to_string()),
        };
        let mut frame;
        match answer {
            Ok(values) => {
                frame = Vec::with_capacity(17 + values.len() * 4);
                frame.push(TAG_ANSWER);
                frame.extend_from_slice(&r.id.to_le_bytes());
                frame.extend_from_slice(&(values.len() as u64).to_le_bytes());
                for x in values {
                    frame.extend_from_slice(&x.to_le_bytes());
                }
            }
            Err(message) => {
                let mut text = message.into_bytes();
                text.truncate(MAX_MESSAGE);
                frame = Vec::with_capacity(13 + text.len());
                frame.push(TAG_REFUSAL);
                frame.extend_from_slice(&r.id.to_le_bytes());
                frame.extend_from_slice(&(text.len() as u32).to_le_bytes());
                frame.extend_from_slice(&text);
            }
        }
        let Some(p) = peer.upgrade() else { return };
        if p.write(&frame).is_err() {
            return;
        }
    }
}
