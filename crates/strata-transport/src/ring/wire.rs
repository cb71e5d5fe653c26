//! The bytes on a ring connection: the handshake, frames, and f32 conversion.
//!
//! Every frame starts with an 8-byte header: a tag byte, three zero bytes, and the payload
//! length (u32, little endian). Three tags exist:
//!
//! - `OPEN` (32-byte payload): the collective a task is about to run (step, kind, op, root,
//!   element count). Each side compares the peer's with its own before any data moves.
//! - `DATA`: f32 values (u64 values for `broadcast_u64s`), little endian; at most `chunk_bytes`
//!   of them per frame, and exactly the lengths both sides compute from the collective, so a
//!   receiver knows every length in advance.
//! - `ERROR` (JSON, at most [`MAX_ERROR_BYTES`]): the task failed; the payload says why, so its
//!   peers fail with the same cause instead of a bare "connection closed".
//!
//! Nothing here trusts a length from the wire before checking it against what the collective
//! expects or against a fixed cap.

use std::fmt;

use serde::{Deserialize, Serialize};
use strata_core::cross_device::compression::{add_decoded_into, HalfFormat, Int8Blocks, SumWire, INT8_BLOCK};
use strata_core::ReduceOp;

use crate::Error;

/// Frame header length.
pub(crate) const HEADER: usize = 8;
/// Frame tags.
pub(crate) const TAG_OPEN: u8 = 0x4f;
pub(crate) const TAG_DATA: u8 = 0x44;
pub(crate) const TAG_ERROR: u8 = 0x45;
/// The OPEN payload length.
pub(crate) const OPEN_LEN: usize = 32;
/// The largest ERROR payload accepted.
pub(crate) const MAX_ERROR_BYTES: usize = 64 << 10;

/// Handshake magic and protocol version.
pub(crate) const HELLO_MAGIC: [u8; 8] = *b"STRRING1";
/// The largest token or fingerprint accepted in a handshake.
pub(crate) const MAX_HANDSHAKE_FIELD: usize = 16 << 10;

/// A frame header.
pub(crate) fn header(tag: u8, len: usize) -> [u8; HEADER] {
    let len = u32::try_from(len).unwrap_or(u32::MAX).to_le_bytes();
    [tag, 0, 0, 0, len[0], len[1], len[2], len[3]]
}

/// Parses a frame header into (tag, payload length).
pub(crate) fn parse_header(h: &[u8; HEADER]) -> (u8, usize) {
    (h[0], u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize)
}

/// A collective as one task called it: what OPEN frames carry and errors print.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Call {
    /// `all_reduce(op, count f32)`.
    AllReduce { op: ReduceOp, count: u64 },
    /// `all_gather(count f32)`: counts may differ between tasks.
    AllGather { count: u64 },
    /// `broadcast(root, count f32)`.
    Broadcast { root: u32, count: u64 },
    /// `broadcast(root, count u64)`: integers, bit for bit.
    BroadcastU64 { root: u32, count: u64 },
    /// `barrier()`.
    Barrier,
    /// `all_reduce(sum, count f32)` with every value on the wire in 16 bits.
    AllReduceHalf { half: HalfFormat, count: u64 },
    /// `reduce_scatter(op, count f32)`.
    ReduceScatter { op: ReduceOp, count: u64 },
    /// `all_reduce(sum, count f32)` with the values on the wire in int8 blocks.
    AllReduceInt8 { count: u64 },
}

impl Call {
    /// Whether a peer's call at the same step is the same collective. All-gathers agree
    /// whatever their lengths; everything else must match exactly.
    pub(crate) fn agrees_with(&self, theirs: &Call) -> bool {
        match (self, theirs) {
            (Call::AllGather { .. }, Call::AllGather { .. }) => true,
            (a, b) => a == b,
        }
    }

    fn encode_fields(&self) -> (u8, u8, u32, u64) {
        match *self {
            Call::AllReduce { op, count } => (1, op_code(op), 0, count),
            Call::AllGather { count } => (2, NO_OP, 0, count),
            Call::Broadcast { root, count } => (3, NO_OP, root, count),
            Call::Barrier => (4, NO_OP, 0, 0),
            Call::BroadcastU64 { root, count } => (5, NO_OP, root, count),
            Call::AllReduceHalf { half, count } => (6, half_code(half), 0, count),
            Call::ReduceScatter { op, count } => (7, op_code(op), 0, count),
            Call::AllReduceInt8 { count } => (8, NO_OP, 0, count),
        }
    }
}

impl fmt::Display for Call {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Call::AllReduce { op, count } => write!(f, "all_reduce({op}, {count} f32)"),
            Call::AllGather { count } => write!(f, "all_gather({count} f32)"),
            Call::Broadcast { root, count } => write!(f, "broadcast(root {root}, {count} f32)"),
            Call::Barrier => f.write_str("barrier"),
            Call::ReduceScatter { op, count } => write!(f, "reduce_scatter({op}, {count} f32)"),
            Call::BroadcastU64 { root, count } => write!(f, "broadcast(root {root}, {count} u64)"),
            Call::AllReduceHalf { half, count } => {
                let name = match half {
                    HalfFormat::F16 => "fp16",
                    HalfFormat::Bf16 => "bf16",
                };
                write!(f, "all_reduce(sum, {count} f32 as {name} on the wire)")
            }
            Call::AllReduceInt8 { count } => write!(f, "all_reduce(sum, {count} f32 as int8 blocks on the wire)"),
        }
    }
}

const NO_OP: u8 = 0xff;

fn op_code(op: ReduceOp) -> u8 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Mean => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
    }
}

fn half_code(h: HalfFormat) -> u8 {
    match h {
        HalfFormat::F16 => 0,
        HalfFormat::Bf16 => 1,
    }
}

fn op_from_code(c: u8) -> Option<ReduceOp> {
    Some(match c {
        0 => ReduceOp::Sum,
        1 => ReduceOp::Mean,
        2 => ReduceOp::Max,
        3 => ReduceOp::Min,
        _ => return None,
    })
}

/// An OPEN frame (header and payload) for `call` at `step`.
pub(crate) fn open_frame(step: u64, call: &Call) -> [u8; HEADER + OPEN_LEN] {
    let (kind, op, root, count) = call.encode_fields();
    let mut out = [0u8; HEADER + OPEN_LEN];
    out[..HEADER].copy_from_slice(&header(TAG_OPEN, OPEN_LEN));
    let p = &mut out[HEADER..];
    p[0..8].copy_from_slice(&step.to_le_bytes());
    p[8] = kind;
    p[9] = op;
    p[12..16].copy_from_slice(&root.to_le_bytes());
    p[16..24].copy_from_slice(&count.to_le_bytes());
    out
}

/// Decodes an OPEN payload into (step, call); `Err` says what is malformed.
pub(crate) fn parse_open(p: &[u8]) -> Result<(u64, Call), String> {
    if p.len() != OPEN_LEN {
        return Err(format!("an OPEN frame of {} bytes (expected {OPEN_LEN})", p.len()));
    }
    let u64_at = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&p[i..i + 8]);
        u64::from_le_bytes(b)
    };
    let step = u64_at(0);
    let root = u32::from_le_bytes([p[12], p[13], p[14], p[15]]);
    let count = u64_at(16);
    let call = match p[8] {
        1 => match op_from_code(p[9]) {
            Some(op) => Call::AllReduce { op, count },
            None => return Err(format!("an all_reduce with unknown op code {}", p[9])),
        },
        2 => Call::AllGather { count },
        3 => Call::Broadcast { root, count },
        4 => Call::Barrier,
        5 => Call::BroadcastU64 { root, count },
        6 => match p[9] {
            0 => Call::AllReduceHalf { half: HalfFormat::F16, count },
            1 => Call::AllReduceHalf { half: HalfFormat::Bf16, count },
            c => return Err(format!("a 16-bit all_reduce with unknown format code {c}")),
        },
        7 => match op_from_code(p[9]) {
            Some(op) => Call::ReduceScatter { op, count },
            None => return Err(format!("a reduce_scatter with unknown op code {}", p[9])),
        },
        8 => Call::AllReduceInt8 { count },
        k => return Err(format!("an OPEN frame for unknown collective kind {k}")),
    };
    Ok((step, call))
}

/// Why a task failed, as sent to its peers in an ERROR frame.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub(crate) enum WireError {
    Mismatch { step: u64, me: String, mine: String, peer: String, theirs: String },
    PeerLost { task: String, collective: String, step: u64, detail: String },
    Timeout { task: String, collective: String, step: u64, timeout_ms: u64 },
    Aborted { reason: String },
    Protocol { peer: String, detail: String },
    Other { message: String },
}

impl WireError {
    /// What to tell the peers about `e`.
    pub(crate) fn from_error(e: &Error) -> Self {
        match e {
            Error::Mismatch { step, me, mine, peer, theirs } => WireError::Mismatch {
                step: *step,
                me: me.clone(),
                mine: mine.clone(),
                peer: peer.clone(),
                theirs: theirs.clone(),
            },
            Error::PeerLost { task, collective, step, detail } => WireError::PeerLost {
                task: task.clone(),
                collective: collective.clone(),
                step: *step,
                detail: detail.clone(),
            },
            Error::Timeout { task, collective, step, timeout } => WireError::Timeout {
                task: task.clone(),
                collective: collective.clone(),
                step: *step,
                timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
            },
            Error::Aborted(reason) => WireError::Aborted { reason: reason.clone() },
            Error::Protocol { peer, detail } => WireError::Protocol { peer: peer.clone(), detail: detail.clone() },
            other => WireError::Other { message: other.to_string() },
        }
    }

    /// The error a task reports when peer `from` sent this: the original cause where it has
    /// one (a mismatch names both tasks, a lost peer names the lost task).
    pub(crate) fn into_error(self, from: &str) -> Error {
        match self {
            WireError::Mismatch { step, me, mine, peer, theirs } => Error::Mismatch { step, me, mine, peer, theirs },
            WireError::PeerLost { task, collective, step, detail } => {
                Error::PeerLost { task, collective, step, detail: format!("{detail} (reported by task {from})") }
            }
            WireError::Timeout { task, collective, step, timeout_ms } => {
                Error::Timeout { task, collective, step, timeout: std::time::Duration::from_millis(timeout_ms) }
            }
            WireError::Aborted { reason } => Error::Aborted(reason),
            WireError::Protocol { peer, detail } => Error::Protocol { peer, detail },
            WireError::Other { message } => Error::Aborted(format!("task {from} failed: {message}")),
        }
    }

    /// An ERROR frame carrying this error (truncated to fit the cap).
    pub(crate) fn frame(&self) -> Vec<u8> {
        let mut json = serde_json::to_vec(self).unwrap_or_default();
        if json.len() > MAX_ERROR_BYTES {
            json = serde_json::to_vec(&WireError::Other {
                message: "a peer failed (its error was too long to send)".into(),
            })
            .unwrap_or_default();
        }
        let mut out = Vec::with_capacity(HEADER + json.len());
        out.extend_from_slice(&header(TAG_ERROR, json.len()));
        out.extend_from_slice(&json);
        out
    }

    /// Decodes an ERROR payload.
    pub(crate) fn parse(p: &[u8]) -> Option<Self> {
        serde_json::from_slice(p).ok()
    }
}

/// Appends `src` as little-endian bytes to `out`.
pub(crate) fn put_f32s(out: &mut Vec<u8>, src: &[f32]) {
    let start = out.len();
    out.resize(start + src.len() * 4, 0);
    for (o, x) in out[start..].chunks_exact_mut(4).zip(src) {
        o.copy_from_slice(&x.to_le_bytes());
    }
}

/// Writes `src` as little-endian bytes into `dst` (`dst.len() == 4 * src.len()`).
pub(crate) fn write_f32s(dst: &mut [u8], src: &[f32]) {
    for (o, x) in dst.chunks_exact_mut(4).zip(src) {
        o.copy_from_slice(&x.to_le_bytes());
    }
}

/// Appends `src` as little-endian bytes to `out`.
pub(crate) fn put_u64s(out: &mut Vec<u8>, src: &[u64]) {
    out.extend(src.iter().flat_map(|x| x.to_le_bytes()));
}

/// Overwrites `dst` with the little-endian u64s in `bytes` (`bytes.len() == 8 * dst.len()`).
pub(crate) fn store_u64s(dst: &mut [u64], bytes: &[u8]) {
    for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(8)) {
        let mut x = [0u8; 8];
        x.copy_from_slice(b);
        *d = u64::from_le_bytes(x);
    }
}

fn f32_at(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Overwrites `dst` with the little-endian f32s in `bytes` (`bytes.len() == 4 * dst.len()`).
pub(crate) fn store_f32s(dst: &mut [f32], bytes: &[u8]) {
    for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
        *d = f32_at(b);
    }
}

/// `acc[i] = acc[i] op x[i]` with `x` read from little-endian bytes (Mean sums; the caller
/// finishes). The same element order and operand order as [`ReduceOp::combine`].
pub(crate) fn combine_bytes(op: ReduceOp, acc: &mut [f32], bytes: &[u8]) {
    let xs = bytes.chunks_exact(4).map(f32_at);
    match op {
        ReduceOp::Sum | ReduceOp::Mean => acc.iter_mut().zip(xs).for_each(|(a, x)| *a += x),
        ReduceOp::Max => acc.iter_mut().zip(xs).for_each(|(a, x)| *a = a.max(x)),
        ReduceOp::Min => acc.iter_mut().zip(xs).for_each(|(a, x)| *a = a.min(x)),
    }
}

/// Elements per stack buffer of the 16-bit conversions below (no allocation per frame).
const HALF_BLOCK: usize = 512;

/// Writes `src` encoded in `format` as little-endian 16-bit words into `dst`
/// (`dst.len() == 2 * src.len()`).
pub(crate) fn write_halves(dst: &mut [u8], src: &[f32], format: HalfFormat) {
    let mut words = [0u16; HALF_BLOCK];
    for (d, s) in dst.chunks_mut(2 * HALF_BLOCK).zip(src.chunks(HALF_BLOCK)) {
        let w = &mut words[..s.len()];
        format.encode(s, w);
        for (o, x) in d.chunks_exact_mut(2).zip(w.iter()) {
            o.copy_from_slice(&x.to_le_bytes());
        }
    }
}

/// Calls `f` with the little-endian 16-bit words in `bytes`, a block at a time, with the
/// block's first element.
fn word_blocks(bytes: &[u8], mut f: impl FnMut(usize, &[u16])) {
    let mut words = [0u16; HALF_BLOCK];
    for (k, b) in bytes.chunks(2 * HALF_BLOCK).enumerate() {
        let n = b.len() / 2;
        for (w, x) in words[..n].iter_mut().zip(b.chunks_exact(2)) {
            *w = u16::from_le_bytes([x[0], x[1]]);
        }
        f(k * HALF_BLOCK, &words[..n]);
    }
}

/// `acc[i] += x[i]` with `x` the 16-bit values in `bytes`, decoded and added in f32 (the
/// codec's [`add_decoded_into`]: the ring's hop is the bytes around it).
pub(crate) fn add_halves(acc: &mut [f32], bytes: &[u8], format: HalfFormat) {
    word_blocks(bytes, |at, ws| add_decoded_into(&mut acc[at..at + ws.len()], ws, format));
}

/// Overwrites `dst` with the 16-bit values in `bytes`.
pub(crate) fn store_halves(dst: &mut [f32], bytes: &[u8], format: HalfFormat) {
    word_blocks(bytes, |at, ws| format.decode(ws, &mut dst[at..at + ws.len()]));
}

/// Writes `src` in `wire`'s units into `dst` (`dst.len() == wire.encoded_len(src.len())`).
pub(crate) fn write_compact(dst: &mut [u8], src: &[f32], wire: SumWire) {
    match wire {
        SumWire::Half(format) => write_halves(dst, src, format),
        SumWire::Int8 => {
            for (d, s) in dst.chunks_mut(INT8_BLOCK + 1).zip(src.chunks(INT8_BLOCK)) {
                Int8Blocks::encode_block(s, d);
            }
        }
    }
}

/// `acc[i] += x[i]` (`add`) or `acc[i] = x[i]` with `x` the values of whole units of `wire` in
/// `bytes` (the last unit of a run may be shorter: `acc` says how many values it holds).
pub(crate) fn read_compact(acc: &mut [f32], bytes: &[u8], wire: SumWire, add: bool) {
    match (wire, add) {
        (SumWire::Half(format), true) => add_halves(acc, bytes, format),
        (SumWire::Half(format), false) => store_halves(acc, bytes, format),
        (SumWire::Int8, _) => {
            for (a, b) in acc.chunks_mut(INT8_BLOCK).zip(bytes.chunks(INT8_BLOCK + 1)) {
                if add {
                    Int8Blocks::add_block(b, a);
                } else {
                    Int8Blocks::store_block(b, a);
                }
            }
        }
    }
}

/// The handshake a dialing task sends: who it is and what it runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    pub rank: u32,
    pub size: u32,
    pub chunk_bytes: u64,
    pub small_bytes: u64,
    pub token: Option<Vec<u8>>,
    pub fingerprint: Vec<u8>,
}

/// The accepting task's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Reply {
    /// Accepted; the acceptor's rank.
    Accept { rank: u32 },
    /// The token did not match.
    Unauthenticated,
    /// A different cluster spec, strategy or ring configuration: the acceptor's fingerprint and
    /// a sentence saying what differs.
    Refused { fingerprint: Vec<u8>, reason: String },
}

fn put_field(out: &mut Vec<u8>, f: &[u8]) {
    out.extend_from_slice(&u32::try_from(f.len()).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(f);
}

impl Hello {
    /// The bytes on the wire: magic, fixed fields, then the length-prefixed token and fingerprint.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.fingerprint.len());
        out.extend_from_slice(&HELLO_MAGIC);
        out.extend_from_slice(&self.rank.to_le_bytes());
        out.extend_from_slice(&self.size.to_le_bytes());
        out.extend_from_slice(&self.chunk_bytes.to_le_bytes());
        out.extend_from_slice(&self.small_bytes.to_le_bytes());
        out.push(u8::from(self.token.is_some()));
        put_field(&mut out, self.token.as_deref().unwrap_or_default());
        put_field(&mut out, &self.fingerprint);
        out
    }
}

/// The fixed part of a hello: magic, rank, size, chunk, small, has-token.
pub(crate) const HELLO_FIXED: usize = 8 + 4 + 4 + 8 + 8 + 1;

/// Decodes the fixed part of a hello; `Err` says what is wrong.
pub(crate) fn parse_hello_fixed(b: &[u8; HELLO_FIXED]) -> Result<(u32, u32, u64, u64, bool), String> {
    if b[..8] != HELLO_MAGIC {
        return Err("not a strata ring handshake (bad magic bytes)".into());
    }
    let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let u64_at = |i: usize| {
        let mut x = [0u8; 8];
        x.copy_from_slice(&b[i..i + 8]);
        u64::from_le_bytes(x)
    };
    let has_token = match b[32] {
        0 => false,
        1 => true,
        x => return Err(format!("bad token flag {x}")),
    };
    Ok((u32_at(8), u32_at(12), u64_at(16), u64_at(24), has_token))
}

impl Reply {
    /// The bytes on the wire: a status byte, then per status fields.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Reply::Accept { rank } => {
                out.push(0);
                out.extend_from_slice(&rank.to_le_bytes());
            }
            Reply::Unauthenticated => out.push(1),
            Reply::Refused { fingerprint, reason } => {
                out.push(2);
                put_field(&mut out, fingerprint);
                put_field(&mut out, reason.as_bytes());
            }
        }
        out
    }
}

/// Checks a length-prefix from the handshake against the cap.
pub(crate) fn field_len(prefix: [u8; 4], what: &str) -> Result<usize, String> {
    let len = u32::from_le_bytes(prefix) as usize;
    if len > MAX_HANDSHAKE_FIELD {
        return Err(format!("a {what} of {len} bytes (at most {MAX_HANDSHAKE_FIELD})"));
    }
    Ok(len)
}

/// A fingerprint for error messages: lossy UTF-8, shortened to 120 characters.
pub(crate) fn show_fingerprint(f: &[u8]) -> String {
    let s = String::from_utf8_lossy(f);
    if s.chars().count() > 120 {
        format!("{}...", s.chars().take(117).collect::<String>())
    } else {
        s.into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_frames_round_trip() {
        let calls = [
            Call::AllReduce { op: ReduceOp::Mean, count: 1_000_003 },
            Call::AllGather { count: 0 },
            Call::Broadcast { root: 3, count: 7 },
            Call::Barrier,
            Call::BroadcastU64 { root: 1, count: 2 },
            Call::AllReduceHalf { half: HalfFormat::Bf16, count: 5 },
            Call::ReduceScatter { op: ReduceOp::Max, count: 11 },
        ];
        for (i, c) in calls.iter().enumerate() {
            let f = open_frame(i as u64 + 9, c);
            let mut h = [0u8; HEADER];
            h.copy_from_slice(&f[..HEADER]);
            assert_eq!(parse_header(&h), (TAG_OPEN, OPEN_LEN));
            assert_eq!(parse_open(&f[HEADER..]).unwrap(), (i as u64 + 9, *c));
        }
        assert_eq!(calls[0].to_string(), "all_reduce(mean, 1000003 f32)");
        assert_eq!(calls[2].to_string(), "broadcast(root 3, 7 f32)");
        assert_eq!(calls[4].to_string(), "broadcast(root 1, 2 u64)");
        assert!(!calls[4].agrees_with(&Call::Broadcast { root: 1, count: 2 }));
        assert_eq!(calls[6].to_string(), "reduce_scatter(max, 11 f32)");
        assert!(!calls[6].agrees_with(&Call::AllReduce { op: ReduceOp::Max, count: 11 }));
    }

    #[test]
    fn malformed_open_frames_are_errors() {
        assert!(parse_open(&[0u8; 31]).is_err());
        let mut p = [0u8; OPEN_LEN];
        p[8] = 9;
        assert!(parse_open(&p).unwrap_err().contains("unknown collective kind 9"));
        p[8] = 1;
        p[9] = 7;
        assert!(parse_open(&p).unwrap_err().contains("unknown op code 7"));
        p[8] = 7;
        assert!(parse_open(&p).unwrap_err().contains("a reduce_scatter with unknown op code 7"));
    }

    #[test]
    fn all_gathers_agree_whatever_their_lengths() {
        assert!(Call::AllGather { count: 1 }.agrees_with(&Call::AllGather { count: 5 }));
        let ar = Call::AllReduce { op: ReduceOp::Sum, count: 4 };
        assert!(ar.agrees_with(&ar));
        assert!(!ar.agrees_with(&Call::AllReduce { op: ReduceOp::Max, count: 4 }));
        assert!(!ar.agrees_with(&Call::AllReduce { op: ReduceOp::Sum, count: 5 }));
        assert!(!ar.agrees_with(&Call::Broadcast { root: 0, count: 4 }));
    }

    #[test]
    fn error_frames_round_trip_and_garbage_is_rejected() {
        let e = Error::Mismatch {
            step: 4,
            me: "worker:1".into(),
            mine: "broadcast(root 0, 3 f32)".into(),
            peer: "worker:0".into(),
            theirs: "all_reduce(sum, 3 f32)".into(),
        };
        let f = WireError::from_error(&e).frame();
        let w = WireError::parse(&f[HEADER..]).unwrap();
        assert_eq!(w.into_error("worker:1").to_string(), e.to_string());
        assert!(WireError::parse(b"{\"kind\":\"nonsense\"}").is_none());
        assert!(WireError::parse(&[0xff, 0x00, 0x13]).is_none());
        let lost =
            WireError::PeerLost { task: "worker:2".into(), collective: "barrier".into(), step: 1, detail: "x".into() };
        assert!(lost.into_error("worker:0").to_string().contains("lost task worker:2"));
    }

    #[test]
    fn f32_bytes_round_trip_and_combine_like_reduce_op() {
        let a = [1.5f32, -2.0, f32::MAX, 0.0];
        let b = [0.25f32, 7.0, -1.0, -0.0];
        let mut bytes = Vec::new();
        put_f32s(&mut bytes, &b);
        assert_eq!(bytes.len(), 16);
        let mut back = [0f32; 4];
        store_f32s(&mut back, &bytes);
        assert_eq!(back.map(f32::to_bits), b.map(f32::to_bits));
        for op in ReduceOp::ALL {
            let mut x = a;
            combine_bytes(op, &mut x, &bytes);
            let mut y = a;
            op.combine(&mut y, &b);
            assert_eq!(x.map(f32::to_bits), y.map(f32::to_bits), "{op}");
        }
    }

    #[test]
    fn half_bytes_add_and_store_as_the_codec_does() {
        // Longer than a block, and not a whole number of blocks.
        let n = 2 * HALF_BLOCK + 3;
        let xs: Vec<f32> = (0..n).map(|i| (i as f32 - 400.0) * 0.37).collect();
        let acc0: Vec<f32> = (0..n).map(|i| 1.0 / (i as f32 + 1.0)).collect();
        for format in [HalfFormat::F16, HalfFormat::Bf16] {
            let mut bytes = vec![0u8; 2 * n];
            write_halves(&mut bytes, &xs, format);
            let mut words = vec![0u16; n];
            format.encode(&xs, &mut words);
            let le: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            assert_eq!(bytes, le, "{format:?}");
            let (mut got, mut want) = (acc0.clone(), acc0.clone());
            add_halves(&mut got, &bytes, format);
            add_decoded_into(&mut want, &words, format);
            assert_eq!(
                got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
            let mut stored = vec![0f32; n];
            store_halves(&mut stored, &bytes, format);
            format.decode(&words, &mut want);
            assert_eq!(
                stored.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn u64_bytes_round_trip_bit_for_bit() {
        let xs = [0u64, 1, u64::MAX, 0x0123_4567_89ab_cdef, 1 << 53 | 1];
        let mut bytes = Vec::new();
        put_u64s(&mut bytes, &xs);
        assert_eq!(bytes.len(), 40);
        let mut back = [0u64; 5];
        store_u64s(&mut back, &bytes);
        assert_eq!(back, xs);
    }

    #[test]
    fn hello_fixed_part_decodes_and_rejects_bad_magic() {
        let h = Hello {
            rank: 3,
            size: 4,
            chunk_bytes: 65536,
            small_bytes: 1024,
            token: Some(b"t".to_vec()),
            fingerprint: b"fp".to_vec(),
        };
        let b = h.encode();
        let mut fixed = [0u8; HELLO_FIXED];
        fixed.copy_from_slice(&b[..HELLO_FIXED]);
        assert_eq!(parse_hello_fixed(&fixed).unwrap(), (3, 4, 65536, 1024, true));
        fixed[0] = b'X';
        assert!(parse_hello_fixed(&fixed).is_err());
        assert!(field_len((MAX_HANDSHAKE_FIELD as u32 + 1).to_le_bytes(), "token").is_err());
        assert_eq!(show_fingerprint(&[b'a'; 300]).chars().count(), 120);
    }
}
