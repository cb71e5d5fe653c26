//! One collective's view of the connections: framed reads and writes that turn every failure
//! into an error naming the peer task, the collective and the step.

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};

use super::wire::{self, Call, WireError, HEADER, MAX_ERROR_BYTES, TAG_DATA, TAG_ERROR, TAG_OPEN};
use crate::{Error, Result};

/// The read half of a ring connection (TCP, or a Unix socket to a worker on this host).
pub(crate) type ReadHalf = Box<dyn AsyncRead + Send + Unpin>;

/// The write half of a ring connection.
pub(crate) type WriteHalf = Box<dyn AsyncWrite + Send + Unpin>;

/// What every future of one collective shares: who this task is, what it called, and which
/// peers it is waiting on (for the timeout error).
pub(crate) struct Ctx<'a> {
    pub rank: usize,
    pub n: usize,
    pub names: &'a [String],
    pub step: u64,
    pub call: Call,
    /// f32 elements per DATA frame.
    pub chunk_elems: usize,
    /// Per peer: reads in progress.
    reading: RefCell<Vec<u32>>,
    /// Per peer: writes in progress.
    writing: RefCell<Vec<u32>>,
}

impl<'a> Ctx<'a> {
    pub(crate) fn new(rank: usize, names: &'a [String], step: u64, call: Call, chunk_elems: usize) -> Self {
        let n = names.len();
        Self {
            rank,
            n,
            names,
            step,
            call,
            chunk_elems,
            reading: RefCell::new(vec![0; n]),
            writing: RefCell::new(vec![0; n]),
        }
    }

    /// The task name of rank `p`.
    pub(crate) fn name(&self, p: usize) -> &str {
        self.names.get(p).map(String::as_str).unwrap_or("unknown")
    }

    /// This task's name.
    pub(crate) fn me(&self) -> &str {
        self.name(self.rank)
    }

    /// Peer `p` was lost.
    pub(crate) fn lost(&self, p: usize, detail: impl std::fmt::Display) -> Error {
        Error::PeerLost {
            task: self.name(p).to_string(),
            collective: self.call.to_string(),
            step: self.step,
            detail: format!("{detail} (seen by task {})", self.me()),
        }
    }

    /// Peer `p` broke the protocol.
    pub(crate) fn protocol(&self, p: usize, detail: impl std::fmt::Display) -> Error {
        Error::Protocol { peer: self.name(p).to_string(), detail: format!("{detail} during {}", self.call) }
    }

    /// The deadline passed: names the peers this task was reading from (else writing to).
    pub(crate) fn timed_out(&self, timeout: Duration) -> Error {
        let names = |counts: &[u32]| -> Vec<String> {
            counts.iter().enumerate().filter(|(_, c)| **c > 0).map(|(p, _)| self.name(p).to_string()).collect()
        };
        let mut waiting = names(&self.reading.borrow());
        if waiting.is_empty() {
            waiting = names(&self.writing.borrow());
        }
        let task = if waiting.is_empty() { "unknown".to_string() } else { waiting.join(", ") };
        Error::Timeout { task, collective: self.call.to_string(), step: self.step, timeout }
    }

    fn begin(which: &RefCell<Vec<u32>>, p: usize) {
        if let Some(c) = which.borrow_mut().get_mut(p) {
            *c += 1;
        }
    }

    fn end(which: &RefCell<Vec<u32>>, p: usize) {
        if let Some(c) = which.borrow_mut().get_mut(p) {
            *c = c.saturating_sub(1);
        }
    }
}

/// The read half of the connection to one peer.
pub(crate) struct Reader {
    pub peer: usize,
    rd: BufReader<ReadHalf>,
}

/// Capacity of a reader's buffer: frame headers and small frames arrive in one system call, and
/// ring payloads are reduced straight out of it.
const READ_BUFFER: usize = 256 << 10;

/// The largest unit [`Reader::data_with_width`] hands over whole: an int8 block (64 values and
/// their scale).
pub(crate) const MAX_UNIT: usize = strata_core::cross_device::compression::INT8_BLOCK + 1;

impl Reader {
    pub(crate) fn new(peer: usize, rd: impl AsyncRead + Send + Unpin + 'static) -> Self {
        let rd: ReadHalf = Box::new(rd);
        Self { peer, rd: BufReader::with_capacity(READ_BUFFER, rd) }
    }

    async fn exact(&mut self, ctx: &Ctx<'_>, buf: &mut [u8]) -> Result<()> {
        Ctx::begin(&ctx.reading, self.peer);
        let r = self.rd.read_exact(buf).await;
        Ctx::end(&ctx.reading, self.peer);
        match r {
            Ok(_) => {
                crate::hooks::received(buf.len());
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(ctx.lost(self.peer, "connection closed")),
            Err(e) => Err(ctx.lost(self.peer, format!("receive failed: {e}"))),
        }
    }

    /// The next frame header; an ERROR frame becomes the error it carries.
    async fn header(&mut self, ctx: &Ctx<'_>) -> Result<(u8, usize)> {
        let mut h = [0u8; HEADER];
        self.exact(ctx, &mut h).await?;
        let (tag, len) = wire::parse_header(&h);
        if tag == TAG_ERROR {
            if len > MAX_ERROR_BYTES {
                return Err(ctx.protocol(self.peer, format!("an ERROR frame of {len} bytes")));
            }
            let mut p = vec![0u8; len];
            self.exact(ctx, &mut p).await?;
            return Err(match WireError::parse(&p) {
                Some(w) => w.into_error(ctx.name(self.peer)),
                None => ctx.protocol(self.peer, "an undecodable ERROR frame"),
            });
        }
        Ok((tag, len))
    }

    /// Reads the peer's OPEN frame and checks that it called the same collective at the same
    /// step; returns its call (an all-gather's length is the peer's own).
    pub(crate) async fn open(&mut self, ctx: &Ctx<'_>) -> Result<Call> {
        let (tag, len) = self.header(ctx).await?;
        if tag != TAG_OPEN || len != wire::OPEN_LEN {
            return Err(
                ctx.protocol(self.peer, format!("frame tag {tag:#x} of {len} bytes where an OPEN frame belongs"))
            );
        }
        let mut p = [0u8; wire::OPEN_LEN];
        self.exact(ctx, &mut p).await?;
        let (step, theirs) = wire::parse_open(&p).map_err(|e| ctx.protocol(self.peer, e))?;
        if step != ctx.step || !ctx.call.agrees_with(&theirs) {
            let (mine, theirs) = if step == ctx.step {
                (ctx.call.to_string(), theirs.to_string())
            } else {
                (format!("{} as collective #{}", ctx.call, ctx.step), format!("{theirs} as collective #{step}"))
            };
            return Err(Error::Mismatch {
                step: ctx.step,
                me: ctx.me().to_string(),
                mine,
                peer: ctx.name(self.peer).to_string(),
                theirs,
            });
        }
        Ok(theirs)
    }

    /// Resolves with the error a peer sends on a connection this collective does not read
    /// from; `Ok` once anything else arrives (the peer's next collective) or the connection
    /// closes (a lost peer is reported by the connections that carry data). A peer's timeout
    /// is not taken over: it is a symptom (that peer waited, perhaps on this task), and this
    /// task's own deadline names whom it waited for.
    async fn watch(&mut self, ctx: &Ctx<'_>) -> Result<()> {
        match self.rd.fill_buf().await {
            Ok(b) if b.first() == Some(&TAG_ERROR) => match self.header(ctx).await {
                Err(Error::Timeout { .. }) => Ok(()),
                other => other.map(|_| ()),
            },
            _ => Ok(()),
        }
    }

    /// Reads and discards until the peer closes or the connection fails.
    pub(crate) async fn drain(&mut self) -> Result<()> {
        let mut buf = vec![0u8; READ_BUFFER];
        while let Ok(1..) = self.rd.read(&mut buf).await {}
        Ok(())
    }

    /// Reads one DATA frame of exactly `len` bytes, handing its payload to `sink` straight from
    /// the read buffer (no copy), in pieces of whole units of `width` bytes (4: f32s, 2: a
    /// 16-bit wire, 65: an int8 block): `sink(first unit, bytes)`.
    pub(crate) async fn data_with_width(
        &mut self,
        ctx: &Ctx<'_>,
        len: usize,
        width: usize,
        mut sink: impl FnMut(usize, &[u8]),
    ) -> Result<()> {
        debug_assert!((1..=MAX_UNIT).contains(&width));
        let (tag, flen) = self.header(ctx).await?;
        if tag != TAG_DATA || flen != len {
            return Err(ctx.protocol(
                self.peer,
                format!("frame tag {tag:#x} of {flen} bytes where a DATA frame of {len} bytes belongs"),
            ));
        }
        let mut done = 0usize; // payload bytes consumed
        let mut carry = [0u8; MAX_UNIT]; // a unit split between two reads
        let mut carried = 0usize;
        while done < len {
            Ctx::begin(&ctx.reading, self.peer);
            let r = self.rd.fill_buf().await;
            Ctx::end(&ctx.reading, self.peer);
            let avail = match r {
                Ok([]) => return Err(ctx.lost(self.peer, "connection closed")),
                Ok(b) => b,
                Err(e) => return Err(ctx.lost(self.peer, format!("receive failed: {e}"))),
            };
            let take = avail.len().min(len - done);
            let mut piece = &avail[..take];
            if carried > 0 {
                let k = (width - carried).min(piece.len());
                carry[carried..carried + k].copy_from_slice(&piece[..k]);
                carried += k;
                piece = &piece[k..];
                if carried == width {
                    sink((done + k) / width - 1, &carry[..width]);
                    carried = 0;
                }
            }
            let whole = piece.len() / width * width;
            if whole > 0 {
                sink((done + take - piece.len()) / width, &piece[..whole]);
            }
            let rest = &piece[whole..];
            carry[..rest.len()].copy_from_slice(rest);
            carried += rest.len();
            self.rd.consume(take);
            done += take;
        }
        // A run of values may end with a shorter unit (an int8 block of fewer than 64).
        if carried > 0 {
            sink(len / width, &carry[..carried]);
        }
        Ok(())
    }

    /// Reads one DATA frame of exactly `buf.len()` bytes into `buf`.
    pub(crate) async fn data(&mut self, ctx: &Ctx<'_>, buf: &mut [u8]) -> Result<()> {
        let (tag, len) = self.header(ctx).await?;
        if tag != TAG_DATA || len != buf.len() {
            return Err(ctx.protocol(
                self.peer,
                format!("frame tag {tag:#x} of {len} bytes where a DATA frame of {} bytes belongs", buf.len()),
            ));
        }
        self.exact(ctx, buf).await
    }
}

/// The write half of the connection to one peer.
pub(crate) struct Writer {
    pub peer: usize,
    wr: WriteHalf,
    /// False while a frame is partly written (an ERROR frame cannot follow then).
    clean: bool,
}

impl Writer {
    pub(crate) fn new(peer: usize, wr: impl AsyncWrite + Send + Unpin + 'static) -> Self {
        Self { peer, wr: Box::new(wr), clean: true }
    }

    /// Writes whole frames.
    pub(crate) async fn send(&mut self, ctx: &Ctx<'_>, bytes: &[u8]) -> Result<()> {
        crate::hooks::before_send().await;
        self.clean = false;
        Ctx::begin(&ctx.writing, self.peer);
        let r = self.wr.write_all(bytes).await;
        if r.is_ok() {
            crate::hooks::sent(bytes.len());
        }
        Ctx::end(&ctx.writing, self.peer);
        r.map_err(|e| ctx.lost(self.peer, format!("send failed: {e}")))?;
        self.clean = true;
        Ok(())
    }

    /// Writes one frame from its header and its payload, in place (a vectored write: the
    /// payload is not copied into a frame buffer first).
    pub(crate) async fn send_parts(&mut self, ctx: &Ctx<'_>, header: &[u8], payload: &[u8]) -> Result<()> {
        crate::hooks::before_send().await;
        self.clean = false;
        Ctx::begin(&ctx.writing, self.peer);
        let r = write_all_parts(&mut self.wr, header, payload).await;
        if r.is_ok() {
            crate::hooks::sent(header.len() + payload.len());
        }
        Ctx::end(&ctx.writing, self.peer);
        r.map_err(|e| ctx.lost(self.peer, format!("send failed: {e}")))?;
        self.clean = true;
        Ok(())
    }

    /// Best effort: tells the peer why this task failed (only at a frame boundary), then
    /// closes the write side.
    pub(crate) async fn send_error(&mut self, frame: &[u8]) {
        if self.clean {
            let _ = self.wr.write_all(frame).await;
        }
        let _ = self.wr.shutdown().await;
    }
}

/// `write_all` of `head` then `tail`, in vectored writes while `head` is not all written.
async fn write_all_parts(wr: &mut WriteHalf, mut head: &[u8], mut tail: &[u8]) -> std::io::Result<()> {
    while !head.is_empty() {
        let n = wr.write_vectored(&[std::io::IoSlice::new(head), std::io::IoSlice::new(tail)]).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        let from_head = n.min(head.len());
        head = &head[from_head..];
        tail = &tail[n - from_head..];
    }
    wr.write_all(tail).await
}

/// The connections of this task: `readers[p]` and `writers[p]` talk to rank `p` (`None` for
/// this task itself).
pub(crate) struct Links {
    pub readers: Vec<Option<Reader>>,
    pub writers: Vec<Option<Writer>>,
}

impl Links {
    /// The reader from `left`, the writer to `right` (the same peer on a ring of two), and the
    /// readers this collective does not use.
    pub(crate) fn pair(&mut self, left: usize, right: usize) -> Result<(&mut Reader, &mut Writer, Vec<&mut Reader>)> {
        let mut used = None;
        let mut idle = Vec::new();
        for rd in self.readers.iter_mut().flatten() {
            if rd.peer == left {
                used = Some(rd);
            } else {
                idle.push(rd);
            }
        }
        let rd = used.ok_or_else(|| missing(left))?;
        let wr = self.writers.get_mut(right).and_then(Option::as_mut).ok_or_else(|| missing(right))?;
        Ok((rd, wr, idle))
    }
}

/// A connection that should exist does not.
pub(crate) fn missing(p: usize) -> Error {
    Error::Config(format!("no connection to rank {p}: the ring is not connected"))
}

/// Resolves with the first error a peer sends on one of the `idle` connections; never resolves
/// otherwise.
pub(crate) async fn watch(ctx: &Ctx<'_>, idle: Vec<&mut Reader>) -> Error {
    let watches: Vec<_> = idle.into_iter().map(|rd| rd.watch(ctx)).collect();
    match try_join_all(watches).await {
        Err(e) => e,
        Ok(_) => std::future::pending().await,
    }
}

/// Runs `work`; fails early with an error a peer sends on a connection that `work` does not
/// read from (a peer that detected a mismatch or a lost task tells every task at once).
pub(crate) async fn watching<T>(
    ctx: &Ctx<'_>,
    idle: Vec<&mut Reader>,
    work: impl Future<Output = Result<T>>,
) -> Result<T> {
    if idle.is_empty() {
        return work.await;
    }
    tokio::select! {
        biased;
        r = work => r,
        e = watch(ctx, idle) => Err(e),
    }
}

/// Runs the futures concurrently on this task; the first error wins (the others are dropped).
pub(crate) async fn try_join_all<T, F: Future<Output = Result<T>>>(futs: Vec<F>) -> Result<Vec<T>> {
    let mut futs: Vec<Pin<Box<F>>> = futs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<T>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in futs.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                match f.as_mut().poll(cx) {
                    Poll::Ready(Ok(v)) => *o = Some(v),
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(Ok(()))
        }
    })
    .await?;
    Ok(out.into_iter().flatten().collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::{TcpListener, TcpStream};

    /// A DATA frame that arrives in odd-sized pieces (f32s split between reads) reaches the
    /// sink whole, in order, at the right offsets; a short frame is a lost peer.
    #[test]
    fn data_frames_split_anywhere_are_reassembled() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let mut tx = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
            tx.set_nodelay(true).unwrap();
            let (rx, _) = l.accept().await.unwrap();
            let (rd, _wr) = rx.into_split();
            let names = ["worker:0".to_string(), "worker:1".to_string()];
            let ctx = Ctx::new(0, &names, 3, Call::Barrier, 64);
            let mut reader = Reader::new(1, rd);
            let values: Vec<f32> = (0..50).map(|i| i as f32 * 1.5 - 7.0).collect();
            let mut frame = wire::header(TAG_DATA, values.len() * 4).to_vec();
            wire::put_f32s(&mut frame, &values);
            let writer = async {
                let mut at = 0;
                for k in [1usize, 3, 5, 2, 7, 9, 4, 1, 6].iter().cycle() {
                    if at >= frame.len() {
                        break;
                    }
                    let end = (at + k).min(frame.len());
                    tx.write_all(&frame[at..end]).await.unwrap();
                    tx.flush().await.unwrap();
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    at = end;
                }
                // A second frame, cut short by the peer closing.
                tx.write_all(&wire::header(TAG_DATA, 8)).await.unwrap();
                tx.write_all(&[1, 2, 3]).await.unwrap();
                drop(tx);
            };
            let mut got = vec![f32::NAN; values.len()];
            let reading = async {
                reader
                    .data_with_width(&ctx, values.len() * 4, 4, |at, bytes| {
                        assert_eq!(bytes.len() % 4, 0);
                        wire::store_f32s(&mut got[at..at + bytes.len() / 4], bytes);
                    })
                    .await
                    .unwrap();
                reader.data_with_width(&ctx, 8, 4, |_, _| {}).await.unwrap_err()
            };
            let ((), e) = tokio::join!(writer, reading);
            assert_eq!(got, values);
            assert!(matches!(&e, Error::PeerLost { task, step: 3, .. } if task == "worker:1"), "{e}");
        });
    }

    #[test]
    fn a_frame_of_the_wrong_length_is_a_protocol_error() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let mut tx = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
            let (rx, _) = l.accept().await.unwrap();
            let names = ["worker:0".to_string(), "worker:1".to_string()];
            let ctx = Ctx::new(0, &names, 0, Call::Barrier, 64);
            let mut reader = Reader::new(1, rx.into_split().0);
            // A huge claimed length is refused before anything is allocated or read.
            tx.write_all(&wire::header(TAG_DATA, u32::MAX as usize)).await.unwrap();
            let e = reader.data_with_width(&ctx, 16, 4, |_, _| {}).await.unwrap_err();
            assert!(matches!(&e, Error::Protocol { peer, .. } if peer == "worker:1"), "{e}");
            tx.write_all(&wire::header(TAG_ERROR, MAX_ERROR_BYTES + 1)).await.unwrap();
            let e = reader.open(&ctx).await.unwrap_err();
            assert!(matches!(&e, Error::Protocol { .. }), "{e}");
        });
    }
}
