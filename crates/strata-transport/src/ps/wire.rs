//! The tensor data path below tonic's codec. `Push` and `Pull` carry exactly the gRPC messages
//! of `ps.proto` (length-prefixed protobuf over one HTTP/2 stream, 1 MiB chunks at most), so any
//! gRPC client speaks to them; but their tensor bytes go between the HTTP/2 frames and the
//! variables without the copies of tonic's codec: a received chunk stays in the frames it arrived
//! in ([`Rope`]) until it is applied or copied into its destination, and a sent chunk goes to
//! the connection as the variable's (or the gradient's) own memory, behind a few bytes of
//! framing. Everything else about a call (routing, the cluster token, HTTP/2 windows, deadlines)
//! is tonic's.

use std::collections::VecDeque;
use std::pin::Pin;

use http_body_util::BodyExt;
use prost::bytes::{Buf, Bytes, BytesMut};
use prost::Message;
use tonic::codegen::http;
use tonic::Status;

use strata_ps::{check_chunk_len_in, decode_half, Chunk, WireFormat};

use super::convert::status;

/// The HTTP/2 path of `ParameterServer.Push`.
pub(crate) const PUSH_PATH: &str = "/strata.v1.ParameterServer/Push";
/// The HTTP/2 path of `ParameterServer.Pull`.
pub(crate) const PULL_PATH: &str = "/strata.v1.ParameterServer/Pull";
/// The HTTP/2 path of `ParameterServer.PullRows` (served by the generated server).
pub(crate) const PULL_ROWS_PATH: &str = "/strata.v1.ParameterServer/PullRows";

/// gRPC's message prefix: a compression flag and a big-endian length.
const PREFIX: usize = 5;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Received bytes not yet consumed, as the HTTP/2 DATA frames they came in: never copied
/// together.
#[derive(Clone, Debug, Default)]
pub(crate) struct Rope {
    segments: VecDeque<Bytes>,
    len: usize,
}

fn truncated(what: &str) -> Status {
    Status::invalid_argument(format!("a {what} message is truncated: a field runs past its end"))
}

impl Rope {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn push(&mut self, b: Bytes) {
        if !b.is_empty() {
            self.len += b.len();
            self.segments.push_back(b);
        }
    }

    /// The first `n` bytes (at most [`PREFIX`]), copied, without consuming them.
    fn peek<const N: usize>(&self) -> Option<[u8; N]> {
        if self.len < N {
            return None;
        }
        let mut out = [0u8; N];
        let mut at = 0;
        for s in &self.segments {
            let take = (N - at).min(s.len());
            out[at..at + take].copy_from_slice(&s[..take]);
            at += take;
            if at == N {
                break;
            }
        }
        Some(out)
    }

    fn byte(&mut self) -> Option<u8> {
        let front = self.segments.front_mut()?;
        let b = front[0];
        front.advance(1);
        if front.is_empty() {
            self.segments.pop_front();
        }
        self.len -= 1;
        Some(b)
    }

    /// The first `n` bytes (`n <= len`), taken off without a copy.
    fn split_to(&mut self, mut n: usize) -> Rope {
        let mut out = Rope::default();
        while n > 0 {
            let Some(front) = self.segments.front_mut() else { break };
            let piece =
                if front.len() <= n { self.segments.pop_front().unwrap_or_default() } else { front.split_to(n) };
            n -= piece.len();
            self.len -= piece.len();
            out.push(piece);
        }
        out
    }

    /// A protobuf varint.
    fn varint(&mut self, what: &str) -> Result<u64, Status> {
        let mut v = 0u64;
        for i in 0..10 {
            let b = self.byte().ok_or_else(|| truncated(what))?;
            v |= u64::from(b & 0x7f) << (7 * i);
            if b < 0x80 {
                return Ok(v);
            }
        }
        Err(Status::invalid_argument(format!("a {what} message holds a varint longer than 10 bytes")))
    }

    /// The next `n` bytes of a field, or a truncation error.
    fn field(&mut self, n: u64, what: &str) -> Result<Rope, Status> {
        match usize::try_from(n) {
            Ok(n) if n <= self.len => Ok(self.split_to(n)),
            _ => Err(truncated(what)),
        }
    }

    /// The bytes in one buffer (a copy only when they span frames).
    pub(crate) fn contiguous(mut self) -> Bytes {
        if self.segments.len() == 1 {
            return self.segments.pop_front().unwrap_or_default();
        }
        let mut out = BytesMut::with_capacity(self.len);
        for s in &self.segments {
            out.extend_from_slice(s);
        }
        out.freeze()
    }

    /// The bytes (a multiple of 4 long) in pieces of whole f32 elements: the frames
    /// themselves, and a 4-byte copy for an element a frame boundary cuts.
    fn into_f32_pieces(self) -> Vec<Bytes> {
        let mut out = Vec::with_capacity(self.segments.len() + 1);
        let (mut carry, mut carried) = ([0u8; 4], 0usize);
        for mut s in self.segments {
            if carried > 0 {
                let take = (4 - carried).min(s.len());
                carry[carried..carried + take].copy_from_slice(&s[..take]);
                carried += take;
                s.advance(take);
                if carried == 4 {
                    out.push(Bytes::copy_from_slice(&carry));
                    carried = 0;
                }
            }
            let whole = s.len() / 4 * 4;
            if whole > 0 {
                out.push(s.split_to(whole));
            }
            if !s.is_empty() {
                carry[..s.len()].copy_from_slice(&s);
                carried = s.len();
            }
        }
        out
    }
}

/// The gRPC messages of an HTTP/2 body, each as a [`Rope`] of the frames it arrived in.
pub(crate) struct Messages<B> {
    body: Pin<Box<B>>,
    buffered: Rope,
    limit: usize,
    ended: bool,
    trailers: Option<http::HeaderMap>,
}

impl<B> Messages<B>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    /// Messages of at most `limit` bytes from `body`.
    pub(crate) fn new(body: B, limit: usize) -> Self {
        Self { body: Box::pin(body), buffered: Rope::default(), limit, ended: false, trailers: None }
    }

    /// The next message; `None` at the end of the body.
    pub(crate) async fn next(&mut self) -> Result<Option<Rope>, Status> {
        loop {
            if let Some([flag, a, b, c, d]) = self.buffered.peek::<PREFIX>() {
                if flag != 0 {
                    return Err(Status::invalid_argument(format!(
                        "a message with compression flag {flag}: the parameter server takes uncompressed messages only (flag 0)"
                    )));
                }
                let len = u32::from_be_bytes([a, b, c, d]) as usize;
                if len > self.limit {
                    return Err(Status::invalid_argument(format!(
                        "a message of {len} bytes; the limit is {} (a 1 MiB chunk and its framing)",
                        self.limit
                    )));
                }
                if self.buffered.len() >= PREFIX + len {
                    self.buffered.split_to(PREFIX);
                    return Ok(Some(self.buffered.split_to(len)));
                }
            }
            if self.ended {
                if self.buffered.len() > 0 {
                    return Err(Status::invalid_argument("the stream ended inside a message"));
                }
                return Ok(None);
            }
            match self.body.frame().await {
                None => self.ended = true,
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => self.buffered.push(data),
                    Err(frame) => {
                        if let Ok(t) = frame.into_trailers() {
                            self.trailers = Some(t);
                        }
                    }
                },
                Some(Err(e)) => return Err(Status::from_error(e.into())),
            }
        }
    }

    /// After the last message of a response: the call's status from its trailers.
    pub(crate) fn finish(&self) -> Result<(), Status> {
        match self.trailers.as_ref().and_then(Status::from_header_map) {
            Some(s) if s.code() == tonic::Code::Ok => Ok(()),
            Some(s) => Err(s),
            None => Err(Status::internal("the response ended without a grpc-status")),
        }
    }
}

/// One message of a `Push`, `Pull` or `CreateVariables` stream: `oneof kind { H header = 1;
/// TensorChunk chunk = 2; }`.
pub(crate) enum Part<H> {
    Header(H),
    Chunk(Chunk),
}

/// Decodes a stream message; a chunk's data, in `format` (the stream's header says which),
/// stays in its frames when it is f32, and is decoded to f32 (exactly) when it is 16-bit.
/// `what` names the stream.
pub(crate) fn decode_part<H: Message + Default>(
    mut m: Rope,
    what: &str,
    format: WireFormat,
) -> Result<Part<H>, Status> {
    let mut part = None;
    while m.len() > 0 {
        let key = m.varint(what)?;
        match (key >> 3, key & 7) {
            (1, 2) => {
                let len = m.varint(what)?;
                let bytes = m.field(len, what)?.contiguous();
                let h = H::decode(bytes)
                    .map_err(|e| Status::invalid_argument(format!("a {what} header is not valid protobuf: {e}")))?;
                part = Some(Part::Header(h));
            }
            (2, 2) => {
                let len = m.varint(what)?;
                part = Some(Part::Chunk(decode_chunk(m.field(len, what)?, what, format)?));
            }
            (_, wire) => skip(&mut m, wire, what)?,
        }
    }
    part.ok_or_else(|| Status::invalid_argument(format!("an empty {what} message")))
}

/// `TensorChunk { uint32 variable = 1; uint64 offset = 2; bytes data = 3; }`, its data in
/// `format`: checked to be whole elements, at most [`strata_ps::MAX_CHUNK_ELEMENTS`] of them.
fn decode_chunk(mut m: Rope, what: &str, format: WireFormat) -> Result<Chunk, Status> {
    let (mut var, mut offset, mut data) = (0u32, 0u64, Rope::default());
    while m.len() > 0 {
        let key = m.varint(what)?;
        match (key >> 3, key & 7) {
            // proto3 uint32: the low 32 bits of the varint.
            (1, 0) => var = m.varint(what)? as u32,
            (2, 0) => offset = m.varint(what)?,
            (3, 2) => {
                let len = m.varint(what)?;
                data = m.field(len, what)?;
            }
            (_, wire) => skip(&mut m, wire, what)?,
        }
    }
    check_chunk_len_in(data.len(), format).map_err(status)?;
    let pieces = match format.half() {
        None => data.into_f32_pieces(),
        // At most 512 KiB here (checked above), 1 MiB decoded.
        Some(half) => vec![decode_half(&data.contiguous(), half)],
    };
    Ok(Chunk { var, offset, pieces })
}

/// Skips a field of an unknown number.
fn skip(m: &mut Rope, wire: u64, what: &str) -> Result<(), Status> {
    let n = match wire {
        0 => {
            m.varint(what)?;
            return Ok(());
        }
        1 => 8,
        2 => m.varint(what)?,
        5 => 4,
        _ => return Err(Status::invalid_argument(format!("a {what} message holds a field of wire type {wire}"))),
    };
    m.field(n, what).map(drop)
}

/// A gRPC message: its prefix and protobuf encoding, in one buffer.
pub(crate) fn message(m: &impl Message) -> Bytes {
    let len = m.encoded_len();
    let mut out = BytesMut::with_capacity(PREFIX + len);
    out.extend_from_slice(&[0]);
    out.extend_from_slice(&(len as u32).to_be_bytes());
    // Cannot fail: the buffer has room for the encoded length.
    let _ = m.encode(&mut out);
    out.freeze()
}

/// A stream message carrying a chunk (field 2 of the message, as [`decode_part`] reads it):
/// the framing in one small buffer and the data, not copied, in the other.
pub(crate) fn chunk_message(var: u32, offset: u64, data: Bytes) -> [Bytes; 2] {
    use prost::encoding::{encode_varint, encoded_len_varint};
    let data_len = data.len() as u64;
    let inner = 1
        + encoded_len_varint(u64::from(var))
        + 1
        + encoded_len_varint(offset)
        + 1
        + encoded_len_varint(data_len)
        + data.len();
    let outer = 1 + encoded_len_varint(inner as u64) + inner;
    let mut head = BytesMut::with_capacity(PREFIX + 32);
    head.extend_from_slice(&[0]);
    head.extend_from_slice(&(outer as u32).to_be_bytes());
    head.extend_from_slice(&[0x12]);
    encode_varint(inner as u64, &mut head);
    head.extend_from_slice(&[0x08]);
    encode_varint(u64::from(var), &mut head);
    head.extend_from_slice(&[0x10]);
    encode_varint(offset, &mut head);
    head.extend_from_slice(&[0x1a]);
    encode_varint(data_len, &mut head);
    [head.freeze(), data]
}

type FrameStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<http_body::Frame<Bytes>, Status>> + Send>>;

/// A body of the given buffers, then (for a response) the trailers `grpc-status: 0`.
pub(crate) fn body(
    buffers: impl tokio_stream::Stream<Item = Bytes> + Send + 'static,
    ok_trailers: bool,
) -> tonic::body::Body {
    use tokio_stream::StreamExt;
    let frames = buffers.map(|b| Ok(http_body::Frame::data(b)));
    let frames: FrameStream = if ok_trailers {
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        Box::pin(frames.chain(tokio_stream::once(Ok(http_body::Frame::trailers(trailers)))))
    } else {
        Box::pin(frames)
    };
    tonic::body::Body::new(http_body_util::StreamBody::new(frames))
}

/// The answer to a call: `messages` and `grpc-status: 0`, or the status alone.
pub(crate) fn response(
    answer: Result<impl tokio_stream::Stream<Item = Bytes> + Send + 'static, Status>,
) -> http::Response<tonic::body::Body> {
    match answer {
        Ok(messages) => {
            let mut r = http::Response::new(body(messages, true));
            r.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/grpc"));
            r
        }
        Err(status) => status.into_http(),
    }
}

/// A gRPC request to `path` carrying `body`.
pub(crate) fn request(path: &'static str, body: tonic::body::Body) -> http::Request<tonic::body::Body> {
    let mut r = http::Request::new(body);
    *r.method_mut() = http::Method::POST;
    *r.uri_mut() = http::Uri::from_static(path);
    let h = r.headers_mut();
    h.insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/grpc"));
    h.insert(http::header::TE, http::HeaderValue::from_static("trailers"));
    r
}

/// The messages of a call's response, or its status when it was refused outright.
pub(crate) fn response_messages<B>(r: http::Response<B>, limit: usize) -> Result<Messages<B>, Status>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    if let Some(s) = Status::from_header_map(r.headers()) {
        if s.code() != tonic::Code::Ok {
            return Err(s);
        }
    }
    if r.status() != http::StatusCode::OK {
        return Err(Status::unknown(format!("the server answered HTTP {}", r.status())));
    }
    Ok(Messages::new(r.into_body(), limit))
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_proto::v1::{push_message, PushHeader, PushMessage, TensorChunk};

    /// `bytes` cut at `cuts`, as frames would cut it.
    fn rope(bytes: &[u8], cuts: &[usize]) -> Rope {
        let mut r = Rope::default();
        let mut at = 0;
        for &c in cuts.iter().chain(std::iter::once(&bytes.len())) {
            r.push(Bytes::copy_from_slice(&bytes[at..c]));
            at = c;
        }
        r
    }

    fn floats(pieces: &[Bytes]) -> Vec<f32> {
        pieces.iter().flat_map(|p| p.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))).collect()
    }

    #[test]
    fn chunk_messages_decode_as_prost_encodes_them_and_back_across_any_cuts() {
        let values: Vec<f32> = (0..37).map(|i| i as f32 * 0.5 - 3.0).collect();
        let data = Bytes::copy_from_slice(bytemuck::cast_slice(&values));
        let ours: Vec<u8> = chunk_message(3, 1_000_000_007, data.clone()).concat();
        let prost = message(&PushMessage {
            kind: Some(push_message::Kind::Chunk(TensorChunk { variable: 3, offset: 1_000_000_007, data })),
        });
        assert_eq!(ours, prost.to_vec(), "our framing is prost's encoding");
        for cuts in [vec![], vec![1], vec![5, 6, 7], vec![9, 10, 11, 13, 50, 51, 150], (1..ours.len()).collect()] {
            let mut r = rope(&ours, &cuts);
            let [0, a, b, c, d] = r.peek::<5>().unwrap() else { panic!("flag") };
            r.split_to(5);
            assert_eq!(u32::from_be_bytes([a, b, c, d]) as usize, r.len());
            let Part::Chunk(chunk) = decode_part::<PushHeader>(r, "Push", WireFormat::F32).unwrap() else {
                panic!("not a chunk")
            };
            assert_eq!((chunk.var, chunk.offset), (3, 1_000_000_007));
            assert!(chunk.pieces.iter().all(|p| p.len() % 4 == 0), "{cuts:?}");
            assert_eq!(floats(&chunk.pieces), values, "{cuts:?}");
        }
    }

    #[test]
    fn headers_and_unknown_fields_decode_and_garbage_is_refused() {
        let h = PushHeader { worker: "worker:1".into(), step: 7, variables: vec!["w".into()], ..Default::default() };
        let mut m = PushMessage { kind: Some(push_message::Kind::Header(h.clone())) }.encode_to_vec();
        // An unknown varint field and an unknown length-delimited one.
        m.extend_from_slice(&[0x38, 0x96, 0x01, 0x42, 0x02, 0xaa, 0xbb]);
        let Part::Header(got) = decode_part::<PushHeader>(rope(&m, &[2, 3]), "Push", WireFormat::F32).unwrap() else {
            panic!()
        };
        assert_eq!(got, h);
        let code = |bytes: &[u8]| match decode_part::<PushHeader>(rope(bytes, &[]), "Push", WireFormat::F32) {
            Err(e) => e.code(),
            Ok(_) => tonic::Code::Ok,
        };
        assert_eq!(code(&[]), tonic::Code::InvalidArgument, "empty");
        assert_eq!(code(&[0x12, 0x05, 0x08]), tonic::Code::InvalidArgument, "truncated");
        assert_eq!(code(&[0xff; 12]), tonic::Code::InvalidArgument, "endless varint");
        assert_eq!(code(&[0x0b]), tonic::Code::InvalidArgument, "a group");
        assert_eq!(code(&[0x0a, 0x02, 0xff, 0xff]), tonic::Code::InvalidArgument, "a header that is not protobuf");
        // A chunk of 6 bytes: not whole f32 elements.
        assert_eq!(code(&[0x12, 0x08, 0x1a, 0x06, 1, 2, 3, 4, 5, 6]), tonic::Code::InvalidArgument);
    }

    #[test]
    fn half_chunks_decode_exactly_across_any_cuts_and_odd_lengths_are_refused() {
        use strata_core::cross_device::compression::HalfFormat;
        let values: Vec<f32> = (0..37).map(|i| i as f32 * 0.25 - 3.0 + 2f32.powi(-9)).collect();
        for (format, half) in [(WireFormat::F16, HalfFormat::F16), (WireFormat::Bf16, HalfFormat::Bf16)] {
            let wire = strata_ps::encode_half(&values, half);
            let mut bits = vec![0u16; values.len()];
            half.encode(&values, &mut bits);
            let mut want = vec![0f32; values.len()];
            half.decode(&bits, &mut want);
            let ours: Vec<u8> = chunk_message(2, 40, wire).concat();
            for cuts in [vec![], vec![9, 10, 11, 13, 50, 51], (1..ours.len()).collect()] {
                let mut r = rope(&ours, &cuts);
                r.split_to(5);
                let Part::Chunk(chunk) = decode_part::<PushHeader>(r, "Push", format).unwrap() else { panic!() };
                assert_eq!((chunk.var, chunk.offset, chunk.elements()), (2, 40, 37));
                assert_eq!(floats(&chunk.pieces), want, "{format:?} {cuts:?}");
            }
        }
        let odd = [0x12, 0x05, 0x1a, 0x03, 1, 2, 3];
        let e = match decode_part::<PushHeader>(rope(&odd, &[]), "Push", WireFormat::Bf16) {
            Err(e) => e,
            Ok(_) => panic!("an odd chunk was taken"),
        };
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert_eq!(e.message(), "a chunk carries 3 bytes, not a whole number of bf16 elements (2 bytes each)");
    }

    #[tokio::test]
    async fn messages_are_cut_from_frames_and_limits_hold() {
        let a = message(&PushMessage { kind: Some(push_message::Kind::Header(PushHeader::default())) });
        let [h, d] = chunk_message(0, 0, Bytes::from(vec![0u8; 64]));
        let stream = [a.slice(..3), a.slice(3..), h.clone(), d.clone()];
        let mut m = Messages::new(body(tokio_stream::iter(stream), true), 1 << 10);
        assert_eq!(m.next().await.unwrap().unwrap().len(), a.len() - PREFIX);
        assert_eq!(m.next().await.unwrap().unwrap().len(), h.len() + d.len() - PREFIX);
        assert!(m.next().await.unwrap().is_none());
        m.finish().unwrap();
        // Over the limit, compressed, and cut short.
        let first = |bytes: Vec<u8>, limit: usize| async move {
            let mut m = Messages::new(body(tokio_stream::iter([Bytes::from(bytes)]), false), limit);
            m.next().await.map(|o| o.map(|r| r.len())).map_err(|e| e.code())
        };
        // Every refusal of a request is the caller's: INVALID_ARGUMENT, the limit named.
        assert_eq!(first([&[0, 0, 0, 4, 1][..], &[0; 1025]].concat(), 1024).await, Err(tonic::Code::InvalidArgument));
        let mut m = Messages::new(body(tokio_stream::iter([Bytes::from(vec![0, 0, 0, 4, 1, 0])]), false), 1024);
        let e = m.next().await.unwrap_err();
        assert!(e.message().contains("a message of 1025 bytes; the limit is 1024"), "{}", e.message());
        assert_eq!(first(vec![1, 0, 0, 0, 1, 0], 1024).await, Err(tonic::Code::InvalidArgument));
        assert_eq!(first(vec![7, 0, 0, 0, 1, 0], 1024).await, Err(tonic::Code::InvalidArgument));
        assert_eq!(first(vec![0, 0, 0, 0, 9, 0], 1024).await, Err(tonic::Code::InvalidArgument));
    }
}
