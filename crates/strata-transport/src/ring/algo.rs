//! The collectives' algorithms, as futures over one task's [`Links`].
//!
//! - **Ring all-reduce** (buffers above `small_bytes`): reduce-scatter then all-gather, n-1
//!   transfers each, over the buffer split into n segments (segment k is
//!   `[k*len/n, (k+1)*len/n)`, so uneven lengths and empty segments need no special case). Every
//!   segment travels in DATA frames of `chunk_bytes`, and one future per link sends while
//!   another receives: the sender serializes chunk c of transfer t as soon as the receiver has
//!   reduced chunk c of transfer t-1, so both directions of every link stay busy. Each
//!   segment's final value is computed by one task and then copied around the ring as bytes,
//!   so every task ends with bitwise-identical results.
//! - **Direct all-reduce** (buffers up to `small_bytes`): every task sends its whole buffer to
//!   every peer in one write and reduces the n buffers in rank order itself: one network hop
//!   instead of 2(n-1), and the same order (so the same bits) on every task.
//! - **Reduce-scatter**: the ring all-reduce's first n-1 transfers (above `small_bytes`), or
//!   the direct exchange of each peer's segment only (up to it). Rank r ends with segment
//!   (r+1) mod n reduced, bit for bit as the all-reduce of the same size computes it.
//! - **All-gather**: every task sends its buffer to every peer (the same bytes per task as a
//!   ring, in one hop); lengths may differ.
//! - **Broadcast**: up to `small_bytes` the root sends to every peer; above, a pipelined chain
//!   around the ring starting at the root, so the root sends the buffer once. A broadcast of
//!   u64s (integers such as a checkpoint's step) always goes directly, its bytes in the same
//!   DATA frames.
//! - **Barrier**: every task sends its OPEN frame to every peer and waits for theirs.
//!
//! Every collective starts with OPEN frames, compared on receipt, so a peer that called a
//! different collective is reported before any data is used.

use std::cell::{Cell, RefCell};
use std::ops::Range;

use strata_core::cross_device::compression::SumWire;
use strata_core::ReduceOp;
use tokio::sync::Notify;

use super::link::{missing, try_join_all, watching, Ctx, Links, Reader, Writer};
use super::wire::{self, Call, HEADER, TAG_DATA};
use crate::{Error, Result};

/// Start of segment `k` of `n` over `len` elements.
fn seg_start(len: usize, n: usize, k: usize) -> usize {
    (len as u128 * k as u128 / n.max(1) as u128) as usize
}

/// The chunk ranges covering `range`, at most `chunk` elements each.
fn chunks(range: Range<usize>, chunk: usize) -> impl Iterator<Item = Range<usize>> {
    let chunk = chunk.max(1);
    (range.start..range.end).step_by(chunk).map(move |s| s..(s + chunk).min(range.end))
}

/// `(x mod n)` for a signed offset from a rank.
fn ring_pos(r: usize, offset: isize, n: usize) -> usize {
    (r as isize + offset).rem_euclid(n as isize) as usize
}

/// An OPEN frame followed by `len` payload bytes in DATA frames of the chunk size
/// (`4 * chunk_elems` bytes), `put(out, range)` appending the payload bytes of `range`.
fn framed(ctx: &Ctx<'_>, len: usize, mut put: impl FnMut(&mut Vec<u8>, Range<usize>)) -> Vec<u8> {
    let chunk = ctx.chunk_elems.max(1) * 4;
    let frames = len.div_ceil(chunk);
    let mut out = Vec::with_capacity(HEADER + wire::OPEN_LEN + frames * HEADER + len);
    out.extend_from_slice(&wire::open_frame(ctx.step, &ctx.call));
    for r in chunks(0..len, chunk) {
        out.extend_from_slice(&wire::header(TAG_DATA, r.len()));
        put(&mut out, r);
    }
    out
}

/// An OPEN frame followed by `data` in DATA frames of `chunk_elems` f32 each.
fn message(ctx: &Ctx<'_>, data: &[f32]) -> Vec<u8> {
    framed(ctx, data.len() * 4, |out, r| wire::put_f32s(out, &data[r.start / 4..r.end / 4]))
}

/// Reads `len` bytes in DATA frames of the chunk size (as [`framed`] sends them).
async fn read_bytes(ctx: &Ctx<'_>, rd: &mut Reader, len: usize) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    for r in chunks(0..len, ctx.chunk_elems.max(1) * 4) {
        rd.data(ctx, &mut buf[r]).await?;
    }
    Ok(buf)
}

/// Reads `len` f32s in DATA frames of the chunk size, as raw bytes.
async fn read_f32s(ctx: &Ctx<'_>, rd: &mut Reader, len: usize) -> Result<Vec<u8>> {
    read_bytes(ctx, rd, len * 4).await
}

/// One chunk to send: which chunk of the buffer, and how many received chunks must be
/// processed first.
struct SendItem {
    chunk: usize,
    need: usize,
}

/// What to do with a received chunk.
#[derive(Clone, Copy)]
enum Action {
    /// Combine into the buffer; `finish`: this completes the segment (Mean divides).
    Reduce { finish: bool },
    /// Overwrite the buffer.
    Store,
}

/// One chunk to receive: which chunk of the buffer, what to do with it, and how many sends
/// must be complete first (the sends that read this chunk before: a correct peer never makes
/// this wait, since what it sends here depends on them; a faulty one is not allowed to
/// overwrite a chunk while it is being sent).
struct RecvItem {
    chunk: usize,
    action: Action,
    after_sends: usize,
}

/// The buffer split into the pipeline's chunks (disjoint, in order, covering it), each its own
/// cell: the sender holds a chunk while the kernel copies it out of place, the receiver writes
/// others meanwhile.
fn split_chunks<'d>(mut data: &'d mut [f32], ranges: &[Range<usize>]) -> Vec<RefCell<&'d mut [f32]>> {
    let mut at = 0;
    let mut out = Vec::with_capacity(ranges.len());
    for r in ranges {
        debug_assert_eq!(r.start, at, "chunks cover the buffer in order");
        let (head, tail) = std::mem::take(&mut data).split_at_mut(r.len());
        out.push(RefCell::new(head));
        data = tail;
        at = r.end;
    }
    out
}

/// A chunk's cell, or the protocol error of a schedule that would use it twice at once (never
/// for the schedules built here: the dependencies order every use).
fn chunk_error(ctx: &Ctx<'_>, peer: usize) -> Error {
    ctx.protocol(peer, "a ring chunk was received while it was being sent")
}

/// Sends `sends` to `writer` while receiving `recvs` from `reader`, both preceded by OPEN
/// frames, over `chunks` (the buffer's chunks, [`split_chunks`]). A send waits until the
/// receives it depends on are processed; a receive until the sends it must follow are written.
/// f32 chunks are sent from the buffer itself and stored straight from the socket (little-
/// endian machines); with a 16-bit `half` wire (sums only), every value travels encoded and
/// is added in f32.
// A chunk's borrow is held across the await that writes or reads it (that is the point: the
// kernel copies straight from or into the tensor). Every borrow is a `try_borrow`, and the
// schedule's dependencies order the sender's and the receiver's uses of a chunk, so a conflict
// is an error, never a panic.
#[allow(clippy::too_many_arguments, clippy::await_holding_refcell_ref)]
async fn pipeline(
    ctx: &Ctx<'_>,
    reader: &mut Reader,
    writer: &mut Writer,
    chunks: &[RefCell<&mut [f32]>],
    op: ReduceOp,
    half: Option<SumWire>,
    sends: &[SendItem],
    recvs: &[RecvItem],
) -> Result<()> {
    let done = Cell::new(0usize);
    let sent = Cell::new(0usize);
    let progress = Notify::new();
    let written = Notify::new();
    let n = ctx.n;
    // Bytes of a unit on the wire, values of a unit, and the bytes of a run of values.
    let width = half.map_or(4, SumWire::unit_bytes);
    let unit = half.map_or(1, SumWire::unit_values);
    let bytes_of = |n: usize| half.map_or(4 * n, |w| w.encoded_len(n));
    let (left, right) = (reader.peer, writer.peer);
    // Before either future runs: nothing holds a chunk yet.
    let most = sends.iter().map(|i| chunks[i.chunk].borrow().len()).max().unwrap_or(0);
    let send = async {
        writer.send(ctx, &wire::open_frame(ctx.step, &ctx.call)).await?;
        let mut buf =
            if half.is_some() || cfg!(target_endian = "big") { vec![0u8; bytes_of(most)] } else { Vec::new() };
        for (k, item) in sends.iter().enumerate() {
            while done.get() < item.need {
                progress.notified().await;
            }
            // Held across the write: the receiver writes other chunks meanwhile, and waits
            // for this send before it writes this one.
            let chunk = chunks[item.chunk].try_borrow().map_err(|_| chunk_error(ctx, right))?;
            let len = bytes_of(chunk.len());
            let header = wire::header(TAG_DATA, len);
            match half {
                None if cfg!(target_endian = "little") => {
                    writer.send_parts(ctx, &header, bytemuck::cast_slice(&chunk[..])).await?;
                }
                None => {
                    wire::write_f32s(&mut buf[..len], &chunk);
                    writer.send_parts(ctx, &header, &buf[..len]).await?;
                }
                Some(format) => {
                    wire::write_compact(&mut buf[..len], &chunk, format);
                    writer.send_parts(ctx, &header, &buf[..len]).await?;
                }
            }
            drop(chunk);
            sent.set(k + 1);
            written.notify_one();
        }
        Ok::<_, Error>(())
    };
    let recv = async {
        reader.open(ctx).await?;
        for (i, item) in recvs.iter().enumerate() {
            while sent.get() < item.after_sends {
                written.notified().await;
            }
            let cell = &chunks[item.chunk];
            let len = cell.try_borrow().map_err(|_| chunk_error(ctx, left))?.len();
            match (item.action, half) {
                (Action::Store, None) if cfg!(target_endian = "little") => {
                    let mut dst = cell.try_borrow_mut().map_err(|_| chunk_error(ctx, left))?;
                    reader.data(ctx, bytemuck::cast_slice_mut(&mut dst[..])).await?;
                }
                _ => {
                    let mut failed = false;
                    reader
                        .data_with_width(ctx, bytes_of(len), width, |at, bytes| {
                            let Ok(mut d) = cell.try_borrow_mut() else {
                                failed = true;
                                return;
                            };
                            // Whole units; the run's last may hold fewer values.
                            let start = (at * unit).min(len);
                            let end = ((at + bytes.len().div_ceil(width)) * unit).min(len);
                            let dst = &mut d[start..end];
                            match (item.action, half) {
                                (Action::Reduce { .. }, None) => wire::combine_bytes(op, dst, bytes),
                                (Action::Store, None) => wire::store_f32s(dst, bytes),
                                (Action::Reduce { .. }, Some(format)) => wire::read_compact(dst, bytes, format, true),
                                (Action::Store, Some(format)) => wire::read_compact(dst, bytes, format, false),
                            }
                        })
                        .await?;
                    if failed {
                        return Err(chunk_error(ctx, left));
                    }
                }
            }
            if let Action::Reduce { finish: true } = item.action {
                let mut d = cell.try_borrow_mut().map_err(|_| chunk_error(ctx, left))?;
                op.finish(&mut d, n);
                if let Some(format) = half {
                    // This task sends the segment on in the compact wire: it keeps what it sends
                    // (a chunk's units start where it starts, on every send).
                    format.round(&mut d);
                }
            }
            done.set(i + 1);
            progress.notify_one();
        }
        Ok::<_, Error>(())
    };
    tokio::try_join!(send, recv)?;
    Ok(())
}

/// The segment of a `len`-element buffer that rank `rank` of `n` holds reduced after a
/// reduce-scatter: segment `(rank + 1) mod n`, where the ring's last reducing transfer leaves
/// it (the same segments, so the same bits, as the all-reduce's).
pub(crate) fn scatter_segment(len: usize, n: usize, rank: usize) -> Range<usize> {
    let k = (rank + 1) % n.max(1);
    seg_start(len, n, k)..seg_start(len, n, k + 1)
}

/// Ring all-reduce: reduce-scatter, then all-gather; over a 16-bit wire when `half` is given
/// (sums only).
pub(crate) async fn ring_all_reduce(
    ctx: &Ctx<'_>,
    links: &mut Links,
    op: ReduceOp,
    data: &mut [f32],
    half: Option<SumWire>,
) -> Result<()> {
    ring(ctx, links, op, data, half, true).await
}

/// Ring reduce-scatter: the all-reduce's first n-1 transfers only, after which this task holds
/// [`scatter_segment`] reduced, bit for bit as the ring all-reduce ends with it; the rest of
/// `data` holds partial values.
pub(crate) async fn ring_reduce_scatter(
    ctx: &Ctx<'_>,
    links: &mut Links,
    op: ReduceOp,
    data: &mut [f32],
) -> Result<()> {
    ring(ctx, links, op, data, None, false).await
}

/// The ring's transfers: the reduce-scatter's n-1, then, with `gather`, the all-gather's n-1.
async fn ring(
    ctx: &Ctx<'_>,
    links: &mut Links,
    op: ReduceOp,
    data: &mut [f32],
    half: Option<SumWire>,
    gather: bool,
) -> Result<()> {
    let (n, r, len) = (ctx.n, ctx.rank, data.len());
    let seg_chunks: Vec<Vec<Range<usize>>> =
        (0..n).map(|k| chunks(seg_start(len, n, k)..seg_start(len, n, k + 1), ctx.chunk_elems).collect()).collect();
    // Transfer t sends segment sseg(t) and receives rseg(t); sseg(t) == rseg(t-1).
    let transfer = |t: usize| -> (usize, usize) {
        let t = t as isize;
        let n1 = n as isize - 1;
        if t < n1 {
            (ring_pos(r, -t, n), ring_pos(r, -t - 1, n))
        } else {
            let s = t - n1;
            (ring_pos(r, 1 - s, n), ring_pos(r, -s, n))
        }
    };
    // Transfer by transfer: a link carries all of transfer t before any of t+1, so a sender
    // is a whole segment ahead of what it depends on and never waits while its link could
    // carry data. (Interleaving the transfers so that a chunk moves on while still in cache
    // measured slower: it caps the bytes in flight at a few chunks, and every scheduling
    // hiccup on a shared machine then stalls the whole ring.)
    let mut ranges = Vec::new();
    let mut first = Vec::with_capacity(n);
    for seg in &seg_chunks {
        first.push(ranges.len());
        ranges.extend(seg.iter().cloned());
    }
    let mut recvs = Vec::new();
    let mut sends: Vec<SendItem> = Vec::new();
    // The sends of each chunk so far: a receive into it waits for them.
    let mut last_send: Vec<usize> = vec![0; ranges.len()];
    let mut prev_recv_start = 0;
    let transfers = if gather { 2 * (n - 1) } else { n - 1 };
    for t in 0..transfers {
        let (sseg, rseg) = transfer(t);
        for c in 0..seg_chunks[sseg].len() {
            let need = if t == 0 { 0 } else { prev_recv_start + c + 1 };
            sends.push(SendItem { chunk: first[sseg] + c, need });
            last_send[first[sseg] + c] = sends.len();
        }
        prev_recv_start = recvs.len();
        let action = if t < n - 1 { Action::Reduce { finish: t == n - 2 } } else { Action::Store };
        recvs.extend((0..seg_chunks[rseg].len()).map(|c| RecvItem {
            chunk: first[rseg] + c,
            action,
            after_sends: last_send[first[rseg] + c],
        }));
    }
    let chunks = split_chunks(data, &ranges);
    let (reader, writer, idle) = links.pair(ring_pos(r, -1, n), ring_pos(r, 1, n))?;
    watching(ctx, idle, pipeline(ctx, reader, writer, &chunks, op, half, &sends, &recvs)).await
}

/// Direct all-reduce: every task sends its buffer to every peer and reduces in rank order.
pub(crate) async fn direct_all_reduce(ctx: &Ctx<'_>, links: &mut Links, op: ReduceOp, data: &mut [f32]) -> Result<()> {
    let msg = message(ctx, data);
    let got = exchange(ctx, links, |_| &msg, data.len()).await?;
    reduce_in_rank_order(ctx, op, data, got)
}

/// Sends `msg(peer)` to every peer while reading `len` f32s from every peer: the bytes
/// received, with the peer they came from.
async fn exchange<'m>(
    ctx: &Ctx<'_>,
    links: &mut Links,
    msg: impl Fn(usize) -> &'m [u8],
    len: usize,
) -> Result<Vec<(usize, Vec<u8>)>> {
    let sends: Vec<_> = links.writers.iter_mut().flatten().map(|w| w.send(ctx, msg(w.peer))).collect();
    let recvs: Vec<_> = links
        .readers
        .iter_mut()
        .flatten()
        .map(|rd| async move {
            rd.open(ctx).await?;
            let bytes = read_f32s(ctx, rd, len).await?;
            Ok((rd.peer, bytes))
        })
        .collect();
    let (_, got) = tokio::try_join!(try_join_all(sends), try_join_all(recvs))?;
    Ok(got)
}

/// `mine` reduced with the peers' buffers (`got`, by peer) in rank order,
/// ((x0 op x1) op x2) ...: the same order, so the same bits, on every task.
fn reduce_in_rank_order(ctx: &Ctx<'_>, op: ReduceOp, mine: &mut [f32], got: Vec<(usize, Vec<u8>)>) -> Result<()> {
    let mut by_rank: Vec<Option<Vec<u8>>> = (0..ctx.n).map(|_| None).collect();
    for (p, bytes) in got {
        by_rank[p] = Some(bytes);
    }
    let mut acc = vec![0f32; mine.len()];
    for (p, bytes) in by_rank.iter().enumerate() {
        match (p == ctx.rank, bytes, p == 0) {
            (true, _, true) => acc.copy_from_slice(mine),
            (true, _, false) => op.combine(&mut acc, mine),
            (false, Some(b), true) => wire::store_f32s(&mut acc, b),
            (false, Some(b), false) => wire::combine_bytes(op, &mut acc, b),
            (false, None, _) => return Err(missing(p)),
        }
    }
    op.finish(&mut acc, ctx.n);
    mine.copy_from_slice(&acc);
    Ok(())
}

/// Direct reduce-scatter: every task sends each peer that peer's [`scatter_segment`] and
/// reduces its own from the n buffers in rank order (as [`direct_all_reduce`] does, so the
/// same bits). The rest of `data` is left as it was.
pub(crate) async fn direct_reduce_scatter(
    ctx: &Ctx<'_>,
    links: &mut Links,
    op: ReduceOp,
    data: &mut [f32],
) -> Result<()> {
    let (n, len) = (ctx.n, data.len());
    let own = scatter_segment(len, n, ctx.rank);
    // Every peer's segment in a message of its own (none for this task's).
    let messages: Vec<Vec<u8>> = (0..n)
        .map(|p| if p == ctx.rank { Vec::new() } else { message(ctx, &data[scatter_segment(len, n, p)]) })
        .collect();
    let got = exchange(ctx, links, |p| &messages[p], own.len()).await?;
    reduce_in_rank_order(ctx, op, &mut data[own], got)
}

/// Sends an OPEN frame and `data` in DATA frames of `chunk_elems` f32 each, every frame
/// written from `data` itself (little-endian machines) with no whole framed copy.
async fn send_f32s(ctx: &Ctx<'_>, w: &mut Writer, data: &[f32]) -> Result<()> {
    w.send(ctx, &wire::open_frame(ctx.step, &ctx.call)).await?;
    let mut buf = if cfg!(target_endian = "big") { vec![0u8; ctx.chunk_elems.min(data.len()) * 4] } else { Vec::new() };
    for r in chunks(0..data.len(), ctx.chunk_elems) {
        let header = wire::header(TAG_DATA, r.len() * 4);
        if cfg!(target_endian = "little") {
            w.send_parts(ctx, &header, bytemuck::cast_slice(&data[r])).await?;
        } else {
            let bytes = &mut buf[..r.len() * 4];
            wire::write_f32s(bytes, &data[r]);
            w.send_parts(ctx, &header, bytes).await?;
        }
    }
    Ok(())
}

/// Reads `dst.len()` f32s in DATA frames of `chunk_elems` each straight into `dst`
/// (little-endian machines; else through one chunk's buffer).
async fn recv_f32s_into(ctx: &Ctx<'_>, rd: &mut Reader, dst: &mut [f32]) -> Result<()> {
    let mut buf = if cfg!(target_endian = "big") { vec![0u8; ctx.chunk_elems.min(dst.len()) * 4] } else { Vec::new() };
    for r in chunks(0..dst.len(), ctx.chunk_elems) {
        if cfg!(target_endian = "little") {
            rd.data(ctx, bytemuck::cast_slice_mut(&mut dst[r])).await?;
        } else {
            let bytes = &mut buf[..r.len() * 4];
            rd.data(ctx, bytes).await?;
            wire::store_f32s(&mut dst[r], bytes);
        }
    }
    Ok(())
}

/// The element count of a peer's OPEN frame for an all-gather.
fn gather_count(ctx: &Ctx<'_>, peer: usize, theirs: Call) -> Result<u64> {
    match theirs {
        Call::AllGather { count } => Ok(count),
        other => Err(ctx.protocol(peer, format!("an OPEN frame for {other} where all_gather belongs"))),
    }
}

/// All-gather: every task sends its buffer to every peer.
pub(crate) async fn all_gather(ctx: &Ctx<'_>, links: &mut Links, mine: &[f32]) -> Result<Vec<Vec<f32>>> {
    let sends: Vec<_> = links.writers.iter_mut().flatten().map(|w| send_f32s(ctx, w, mine)).collect();
    let recvs: Vec<_> = links
        .readers
        .iter_mut()
        .flatten()
        .map(|rd| async move {
            let count = gather_count(ctx, rd.peer, rd.open(ctx).await?)?;
            let len = usize::try_from(count).ok().filter(|c| c.checked_mul(4).is_some()).ok_or_else(|| {
                ctx.protocol(rd.peer, format!("an all_gather of {count} f32, more than this machine can hold"))
            })?;
            // Grows with the bytes that arrive, never with the length a peer claims.
            let mut out: Vec<f32> = Vec::with_capacity(len.min(ctx.chunk_elems));
            let mut buf = vec![0u8; ctx.chunk_elems.min(len) * 4];
            for r in chunks(0..len, ctx.chunk_elems) {
                let bytes = &mut buf[..r.len() * 4];
                rd.data(ctx, bytes).await?;
                let at = out.len();
                out.resize(at + r.len(), 0.0);
                wire::store_f32s(&mut out[at..], bytes);
            }
            Ok((rd.peer, out))
        })
        .collect();
    let (_, got) = tokio::try_join!(try_join_all(sends), try_join_all(recvs))?;
    let mut out: Vec<Vec<f32>> = (0..ctx.n).map(|_| Vec::new()).collect();
    out[ctx.rank] = mine.to_vec();
    for (p, v) in got {
        out[p] = v;
    }
    Ok(out)
}

/// All-gather into `out`, rank after rank, where the caller knows every rank's count
/// (`counts`, summing to `out.len()`, `counts[rank] == mine.len()`): each peer's buffer is
/// received straight into its place, and a peer whose OPEN frame announces another count is a
/// protocol error before any of its data is read.
pub(crate) async fn all_gather_into(
    ctx: &Ctx<'_>,
    links: &mut Links,
    mine: &[f32],
    out: &mut [f32],
    counts: &[usize],
) -> Result<()> {
    let mut places: Vec<&mut [f32]> = Vec::with_capacity(counts.len());
    let mut rest = out;
    for &c in counts {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(c);
        places.push(head);
        rest = tail;
    }
    places[ctx.rank].copy_from_slice(mine);
    let sends: Vec<_> = links.writers.iter_mut().flatten().map(|w| send_f32s(ctx, w, mine)).collect();
    let recvs: Vec<_> = links
        .readers
        .iter_mut()
        .zip(places)
        .filter_map(|(rd, place)| rd.as_mut().map(|rd| (rd, place)))
        .map(|(rd, place)| async move {
            let count = gather_count(ctx, rd.peer, rd.open(ctx).await?)?;
            if count != place.len() as u64 {
                return Err(ctx.protocol(
                    rd.peer,
                    format!("an all_gather of {count} f32 where this task expects {} from it", place.len()),
                ));
            }
            recv_f32s_into(ctx, rd, place).await
        })
        .collect();
    tokio::try_join!(try_join_all(sends), try_join_all(recvs))?;
    Ok(())
}

/// Broadcast from `root` to every peer directly: the root sends `message()` (an OPEN frame and
/// `len` payload bytes, [`framed`]) to every peer and waits for their OPEN frames; every other
/// task sends its OPEN frame to the root and returns the `len` bytes it receives.
async fn direct_broadcast_bytes(
    ctx: &Ctx<'_>,
    links: &mut Links,
    root: usize,
    message: impl FnOnce() -> Vec<u8>,
    len: usize,
) -> Result<Option<Vec<u8>>> {
    if ctx.rank == root {
        let msg = message();
        let sends: Vec<_> = links.writers.iter_mut().flatten().map(|w| w.send(ctx, &msg)).collect();
        let opens: Vec<_> = links.readers.iter_mut().flatten().map(|rd| rd.open(ctx)).collect();
        tokio::try_join!(try_join_all(sends), try_join_all(opens))?;
        return Ok(None);
    }
    let (rd, wr, idle) = links.pair(root, root)?;
    let open = wire::open_frame(ctx.step, &ctx.call);
    let recv = async {
        rd.open(ctx).await?;
        read_bytes(ctx, rd, len).await
    };
    let (_, bytes) = watching(ctx, idle, async { tokio::try_join!(wr.send(ctx, &open), recv) }).await?;
    Ok(Some(bytes))
}

/// Broadcast from `root` to every peer directly.
pub(crate) async fn direct_broadcast(ctx: &Ctx<'_>, links: &mut Links, root: usize, data: &mut [f32]) -> Result<()> {
    let len = data.len() * 4;
    if let Some(bytes) = direct_broadcast_bytes(ctx, links, root, || message(ctx, data), len).await? {
        wire::store_f32s(data, &bytes);
    }
    Ok(())
}

/// Broadcast of u64s from `root` to every peer directly (integers, bit for bit).
pub(crate) async fn broadcast_u64s(ctx: &Ctx<'_>, links: &mut Links, root: usize, data: &mut [u64]) -> Result<()> {
    let len = data.len() * 8;
    let message = || {
        let mut bytes = Vec::with_capacity(len);
        wire::put_u64s(&mut bytes, data);
        framed(ctx, len, |out, r| out.extend_from_slice(&bytes[r]))
    };
    if let Some(bytes) = direct_broadcast_bytes(ctx, links, root, message, len).await? {
        wire::store_u64s(data, &bytes);
    }
    Ok(())
}

/// Broadcast along the ring from `root`, pipelined in chunks.
pub(crate) async fn chain_broadcast(ctx: &Ctx<'_>, links: &mut Links, root: usize, data: &mut [f32]) -> Result<()> {
    let (n, r) = (ctx.n, ctx.rank);
    let pos = ring_pos(r, -(root as isize), n);
    let all: Vec<Range<usize>> = chunks(0..data.len(), ctx.chunk_elems).collect();
    let sends: Vec<SendItem> = if pos == 0 {
        (0..all.len()).map(|chunk| SendItem { chunk, need: 0 }).collect()
    } else if pos < n - 1 {
        (0..all.len()).map(|chunk| SendItem { chunk, need: chunk + 1 }).collect()
    } else {
        Vec::new()
    };
    // A chunk is received before it is sent on: no receive waits for a send.
    let recvs: Vec<RecvItem> = if pos == 0 {
        Vec::new()
    } else {
        (0..all.len()).map(|chunk| RecvItem { chunk, action: Action::Store, after_sends: 0 }).collect()
    };
    let chunks = split_chunks(data, &all);
    let (reader, writer, idle) = links.pair(ring_pos(r, -1, n), ring_pos(r, 1, n))?;
    watching(ctx, idle, pipeline(ctx, reader, writer, &chunks, ReduceOp::Sum, None, &sends, &recvs)).await
}

/// Barrier: OPEN frames to and from every peer.
pub(crate) async fn barrier(ctx: &Ctx<'_>, links: &mut Links) -> Result<()> {
    let open = wire::open_frame(ctx.step, &ctx.call);
    let sends: Vec<_> = links.writers.iter_mut().flatten().map(|w| w.send(ctx, &open)).collect();
    let opens: Vec<_> = links.readers.iter_mut().flatten().map(|rd| rd.open(ctx)).collect();
    tokio::try_join!(try_join_all(sends), try_join_all(opens))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_cover_the_buffer_unevenly() {
        for len in [0usize, 1, 2, 7, 10, 1_000_003] {
            for n in 1..=5 {
                let mut covered = 0;
                for k in 0..n {
                    let (s, e) = (seg_start(len, n, k), seg_start(len, n, k + 1));
                    assert!(s <= e && e - s <= len / n + 1, "len {len} n {n} k {k}");
                    covered += e - s;
                }
                assert_eq!((seg_start(len, n, 0), seg_start(len, n, n), covered), (0, len, len));
            }
        }
    }

    #[test]
    fn chunks_cover_a_range_in_order() {
        let c: Vec<_> = chunks(3..14, 4).collect();
        assert_eq!(c, vec![3..7, 7..11, 11..14]);
        assert_eq!(chunks(5..5, 4).count(), 0);
    }

    #[test]
    fn each_transfer_sends_what_the_previous_one_received() {
        assert_eq!(ring_pos(0, -1, 3), 2);
        assert_eq!(ring_pos(2, 1, 3), 0);
        assert_eq!(ring_pos(1, -5, 3), 2);
    }
}
