//! The CPU cross-device operations.

use std::sync::{PoisonError, RwLock};

use candle_core::{CpuStorage, Storage, Tensor};

use super::{CrossDeviceOps, Destination, ReduceRequest};
use crate::device::{DeviceSpec, MemoryTracker};
use crate::group::OpKey;
use crate::{Error, ReduceOp, Result};

/// Which replica reduces chunk `j`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reducer {
    /// Replica `j` reduces chunk `j` (reduce-scatter).
    ChunkOwner,
    /// The destination (replica 0 for an all-reduce) reduces every chunk.
    Destination,
}

/// CPU collectives: replicas exchange handles to their input tensors (no copy), each reducer
/// reads its chunk of every input in place and writes the result once into a buffer it owns
/// (two sets, alternating by sequence number, so no trailing rendezvous is needed), and every
/// receiving replica then reads the reduced chunks in place.
#[derive(Debug)]
pub struct CpuCrossDeviceOps {
    n: usize,
    /// Chunks per reduction: one per replica, but no more than the cores that can reduce them
    /// at once (more replicas than cores would only interleave their passes over memory).
    chunks: usize,
    reducer: Reducer,
    /// `results[parity][chunk]`, written by the chunk's reducer.
    results: [Vec<RwLock<Vec<f32>>>; 2],
    /// The device each replica's buffers are accounted to in the [`MemoryTracker`].
    devices: Vec<DeviceSpec>,
    /// What was accounted, to give back on drop: (replica, bytes).
    accounted: std::sync::Mutex<Vec<(usize, u64)>>,
}

fn unpoison<T>(e: PoisonError<T>) -> T {
    e.into_inner()
}

/// A replica's input: its tensors' f32 slices, seen as one concatenated buffer.
struct Segments<'a> {
    slices: Vec<&'a [f32]>,
    starts: Vec<usize>,
}

impl<'a> Segments<'a> {
    fn new(slices: Vec<&'a [f32]>) -> Self {
        let mut starts = Vec::with_capacity(slices.len());
        let mut at = 0;
        for s in &slices {
            starts.push(at);
            at += s.len();
        }
        Self { slices, starts }
    }

    /// The input from `pos` to the end of the tensor that holds it (`pos` < total length).
    fn piece(&self, pos: usize) -> &'a [f32] {
        let i = self.starts.partition_point(|&s| s <= pos).saturating_sub(1);
        &self.slices[i][pos - self.starts[i]..]
    }
}

/// The f32 slices of contiguous CPU tensors, read in place.
pub(crate) fn read_slices<'g>(
    guards: &'g [(candle_core::StorageRef<'g>, &'g candle_core::Layout)],
) -> Result<Vec<&'g [f32]>> {
    guards
        .iter()
        .map(|(storage, layout)| match &**storage {
            Storage::Cpu(CpuStorage::F32(v)) => {
                let (lo, hi) = layout.contiguous_offsets().ok_or_else(|| {
                    Error::InvalidArgument("cross-device ops need contiguous tensors; call .contiguous() first".into())
                })?;
                Ok(&v[lo..hi])
            }
            other => Err(Error::InvalidArgument(format!(
                "the CPU cross-device ops reduce f32 CPU tensors, got {:?} on {:?}",
                other.dtype(),
                other.device().location()
            ))),
        })
        .collect()
}

/// Combines up to four weighted inputs element-wise, in input order, with `f`: into new
/// elements appended to `acc` (`init`), or into `acc[base..]`. One pass reads every input once
/// and writes the result once: the inputs stream side by side, which keeps more memory
/// requests in flight than a pass per input.
#[inline(always)]
fn fused<F: Fn(f32, f32) -> f32>(acc: &mut Vec<f32>, base: usize, xs: &[(&[f32], f32)], init: bool, f: F) {
    let m = xs[0].0.len();
    let x = |k: usize| (&xs[k].0[..m], xs[k].1);
    match (xs.len(), init) {
        (1, true) => {
            let (a, wa) = x(0);
            acc.extend(a.iter().map(|p| p * wa));
        }
        (2, true) => {
            let ((a, wa), (b, wb)) = (x(0), x(1));
            acc.extend(a.iter().zip(b).map(|(p, q)| f(p * wa, q * wb)));
        }
        (3, true) => {
            let ((a, wa), (b, wb), (c, wc)) = (x(0), x(1), x(2));
            acc.extend(a.iter().zip(b).zip(c).map(|((p, q), r)| f(f(p * wa, q * wb), r * wc)));
        }
        (_, true) => {
            let ((a, wa), (b, wb), (c, wc), (d, wd)) = (x(0), x(1), x(2), x(3));
            acc.extend(a.iter().zip(b).zip(c).zip(d).map(|(((p, q), r), s)| f(f(f(p * wa, q * wb), r * wc), s * wd)));
        }
        (1, false) => {
            let (a, wa) = x(0);
            acc[base..base + m].iter_mut().zip(a).for_each(|(o, p)| *o = f(*o, p * wa));
        }
        (2, false) => {
            let ((a, wa), (b, wb)) = (x(0), x(1));
            acc[base..base + m].iter_mut().zip(a.iter().zip(b)).for_each(|(o, (p, q))| *o = f(f(*o, p * wa), q * wb));
        }
        (3, false) => {
            let ((a, wa), (b, wb), (c, wc)) = (x(0), x(1), x(2));
            acc[base..base + m]
                .iter_mut()
                .zip(a.iter().zip(b).zip(c))
                .for_each(|(o, ((p, q), r))| *o = f(f(f(*o, p * wa), q * wb), r * wc));
        }
        (_, false) => {
            let ((a, wa), (b, wb), (c, wc), (d, wd)) = (x(0), x(1), x(2), x(3));
            acc[base..base + m]
                .iter_mut()
                .zip(a.iter().zip(b).zip(c).zip(d))
                .for_each(|(o, (((p, q), r), s))| *o = f(f(f(f(*o, p * wa), q * wb), r * wc), s * wd));
        }
    }
}

/// Reduces `xs` (every replica's piece of one range, equally long) with `op` onto `acc`.
fn reduce_pieces(op: ReduceOp, acc: &mut Vec<f32>, xs: &[(&[f32], f32)]) {
    let base = acc.len();
    for (g, group) in xs.chunks(4).enumerate() {
        match op {
            ReduceOp::Sum | ReduceOp::Mean => fused(acc, base, group, g == 0, |a, b| a + b),
            ReduceOp::Max => fused(acc, base, group, g == 0, f32::max),
            ReduceOp::Min => fused(acc, base, group, g == 0, f32::min),
        }
    }
}

impl CpuCrossDeviceOps {
    fn new(n: usize, reducer: Reducer) -> Result<Self> {
        if n == 0 {
            return Err(Error::ZeroReplicas);
        }
        let set = || (0..n).map(|_| RwLock::new(Vec::new())).collect();
        let devices = (0..n).map(|r| DeviceSpec::cpu(r as u32)).collect();
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        Ok(Self {
            n,
            chunks: n.min(cores).max(1),
            reducer,
            results: [set(), set()],
            devices,
            accounted: Default::default(),
        })
    }

    /// Accounts replica `r`'s result buffers to `devices[r]` (by default `/device:CPU:r`), so
    /// that `memory_info` reports them and a memory limit on the device bounds them.
    pub fn with_devices(mut self, devices: Vec<DeviceSpec>) -> Result<Self> {
        if devices.len() != self.n {
            return Err(Error::InvalidArgument(format!("{} devices for {} replicas", devices.len(), self.n)));
        }
        self.devices = devices;
        Ok(self)
    }

    /// Grows `acc` to hold `len` elements, accounting the growth to replica `r`'s device.
    fn reserve(&self, r: usize, acc: &mut Vec<f32>, len: usize) -> Result<()> {
        if acc.capacity() < len {
            acc.clear();
            let before = acc.capacity();
            MemoryTracker::global().allocate(&self.devices[r], ((len - before) * std::mem::size_of::<f32>()) as u64)?;
            acc.reserve_exact(len);
            let grown = ((acc.capacity() - before) * std::mem::size_of::<f32>()) as u64;
            let asked = ((len - before) * std::mem::size_of::<f32>()) as u64;
            if grown > asked {
                MemoryTracker::global().allocate(&self.devices[r], grown - asked)?;
            }
            self.accounted.lock().unwrap_or_else(unpoison).push((r, grown));
        }
        Ok(())
    }

    /// The operations of a single replica (nothing to combine; the default strategy's).
    pub fn one_replica() -> Self {
        Self {
            n: 1,
            chunks: 1,
            reducer: Reducer::ChunkOwner,
            results: [vec![RwLock::new(Vec::new())], vec![RwLock::new(Vec::new())]],
            devices: vec![DeviceSpec::cpu(0)],
            accounted: Default::default(),
        }
    }

    /// The in-memory all-reduce for `n` replicas: each replica thread reduces its own chunk.
    pub fn in_memory_all_reduce(n: usize) -> Result<Self> {
        Self::new(n, Reducer::ChunkOwner)
    }

    /// Reduction to one device for `n` replicas: the destination replica reduces everything.
    pub fn reduction_to_one_device(n: usize) -> Result<Self> {
        Self::new(n, Reducer::Destination)
    }

    fn chunk_range(&self, len: usize, j: usize) -> std::ops::Range<usize> {
        (len * j / self.chunks)..(len * (j + 1) / self.chunks)
    }

    fn reducer_of(&self, chunk: usize, dest: Destination) -> usize {
        match (self.reducer, dest) {
            (Reducer::ChunkOwner, _) => chunk,
            (Reducer::Destination, Destination::Replica(d)) => d,
            (Reducer::Destination, Destination::AllReplicas) => 0,
        }
    }

    /// Reduces `range` of every replica's input into `acc`, in one pass over each input: in
    /// stretches where no input crosses from one tensor to the next, all inputs are combined
    /// element by element (in replica order, so every reducer computes the same bits).
    fn reduce_range(op: ReduceOp, inputs: &[(Segments<'_>, f32)], range: std::ops::Range<usize>, acc: &mut Vec<f32>) {
        acc.clear();
        let mut pieces: Vec<(&[f32], f32)> = Vec::with_capacity(inputs.len());
        let mut start = range.start;
        while start < range.end {
            pieces.clear();
            let mut len = range.end - start;
            for (segs, w) in inputs {
                let p = segs.piece(start);
                len = len.min(p.len());
                pieces.push((p, *w));
            }
            for p in &mut pieces {
                p.0 = &p.0[..len];
            }
            let from = acc.len();
            reduce_pieces(op, acc, &pieces);
            op.finish(&mut acc[from..], inputs.len());
            start += len;
        }
    }
}

impl Drop for CpuCrossDeviceOps {
    fn drop(&mut self) {
        for (r, bytes) in self.accounted.lock().unwrap_or_else(unpoison).drain(..) {
            MemoryTracker::global().free(&self.devices[r], bytes);
        }
    }
}

impl CrossDeviceOps for CpuCrossDeviceOps {
    fn name(&self) -> &'static str {
        match self.reducer {
            Reducer::ChunkOwner => "in-memory-all-reduce",
            Reducer::Destination => "reduction-to-one-device",
        }
    }

    /// Element by element, each element's inputs summed in replica order: a block of rows, or
    /// any run of a buffer, reduces to the bits of the whole.
    fn takes_row_blocks(&self) -> bool {
        true
    }

    /// The sums `reduce` makes: each element's inputs times their weights, in replica order.
    fn sums_in_step(&self, _replica: usize, _elements: usize) -> bool {
        true
    }

    fn reduce(&self, req: ReduceRequest<'_>, out: &mut dyn FnMut(&[f32])) -> Result<()> {
        let ReduceRequest { group, replica, seq, op, dest, input, weight } = req;
        let n = self.n;
        if group.num_replicas() != n {
            return Err(Error::InvalidArgument(format!(
                "cross-device ops built for {n} replicas used by a group of {}",
                group.num_replicas()
            )));
        }
        if let Destination::Replica(d) = dest {
            if d >= n {
                return Err(Error::InvalidArgument(format!(
                    "reduction destination replica {d} is out of range for {n} replicas"
                )));
            }
        }
        let len = req.len();
        let key = OpKey {
            seq,
            op: match dest {
                Destination::AllReplicas => format!("all_reduce({op})"),
                Destination::Replica(d) => format!("reduce({op}) to replica {d}"),
            },
            shape: vec![len],
        };
        let results = &self.results[(seq % 2) as usize];
        // Check this replica's own input before anyone waits on it.
        {
            let guards: Vec<_> = input.iter().map(Tensor::storage_and_layout).collect();
            if let Err(e) = read_slices(&guards) {
                group.poison(format!("replica {replica} passed an unusable input to {}: {e}", key.op));
                return Err(e);
            }
        }
        let all = group.exchange(replica, &key, (input.to_vec(), weight))?;

        let mine: Vec<usize> = (0..self.chunks).filter(|&j| self.reducer_of(j, dest) == replica).collect();
        if !mine.is_empty() {
            let guards: Vec<Vec<_>> =
                all.iter().map(|(ts, _)| ts.iter().map(Tensor::storage_and_layout).collect()).collect();
            let inputs: Vec<(Segments<'_>, f32)> = guards
                .iter()
                .zip(&all)
                .map(|(g, (_, w))| Ok((Segments::new(read_slices(g)?), *w)))
                .collect::<Result<_>>()?;
            for j in mine {
                let mut acc = results[j].write().unwrap_or_else(unpoison);
                let range = self.chunk_range(len, j);
                if let Err(e) = self.reserve(replica, &mut acc, range.len()) {
                    group.poison(format!("replica {replica} cannot hold its reduction buffer: {e}"));
                    return Err(e);
                }
                Self::reduce_range(op, &inputs, range, &mut acc);
            }
        }
        drop(all);
        group.arrive(replica, &OpKey { op: format!("{} (read)", key.op), ..key.clone() })?;
        // Every reducer is done with the inputs: drop this replica's handles to its tensors.
        group.release(replica, seq);

        if req.receives() {
            for r in &results[..self.chunks] {
                out(&r.read().unwrap_or_else(unpoison));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::ReplicaGroup;
    use candle_core::Device;
    use std::time::Duration;

    /// Replica `r`'s value at element `i`: distinct per replica and element, exact in f32.
    fn value(r: usize, i: usize) -> f32 {
        ((i % 1013) as f32) * if r.is_multiple_of(2) { 1.0 } else { -0.5 } + r as f32
    }

    fn expected(op: ReduceOp, k: usize, i: usize) -> f32 {
        let xs: Vec<f32> = (0..k).map(|r| value(r, i)).collect();
        match op {
            ReduceOp::Sum => xs.iter().sum(),
            ReduceOp::Mean => xs.iter().sum::<f32>() / k as f32,
            ReduceOp::Max => xs.iter().copied().fold(f32::NEG_INFINITY, f32::max),
            ReduceOp::Min => xs.iter().copied().fold(f32::INFINITY, f32::min),
        }
    }

    /// Replica `r`'s input as two tensors of uneven sizes, to exercise the segmented reads.
    fn inputs(r: usize, len: usize) -> Vec<Tensor> {
        let data: Vec<f32> = (0..len).map(|i| value(r, i)).collect();
        let cut = len / 3;
        vec![
            Tensor::from_slice(&data[..cut], cut, &Device::Cpu).unwrap(),
            Tensor::from_slice(&data[cut..], len - cut, &Device::Cpu).unwrap(),
        ]
    }

    fn run(ops: &CpuCrossDeviceOps, k: usize, len: usize, op: ReduceOp, dest: Destination) -> Vec<Option<Vec<f32>>> {
        let group = ReplicaGroup::new(k, Duration::from_secs(30)).unwrap();
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..k)
                .map(|r| {
                    let group = &group;
                    s.spawn(move || {
                        let input = inputs(r, len);
                        let mut got = Vec::new();
                        let mut any = false;
                        // twice, to exercise both buffer sets
                        for seq in 0..2 {
                            got.clear();
                            let req = ReduceRequest { group, replica: r, seq, op, dest, input: &input, weight: 1.0 };
                            ops.reduce(req, &mut |p| {
                                any = true;
                                got.extend_from_slice(p)
                            })
                            .unwrap();
                        }
                        any.then_some(got)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn closed_form_for_every_op_replica_count_and_size() {
        for make in [CpuCrossDeviceOps::in_memory_all_reduce, CpuCrossDeviceOps::reduction_to_one_device] {
            for k in 1..=8 {
                let ops = make(k).unwrap();
                for len in [0usize, 1, 7, 1_000_003] {
                    for op in ReduceOp::ALL {
                        let got = run(&ops, k, len, op, Destination::AllReplicas);
                        for (r, g) in got.iter().enumerate() {
                            let g = g.as_ref().unwrap_or_else(|| panic!("replica {r} got nothing"));
                            assert_eq!(g.len(), len, "{} k={k} len={len} {op}", ops.name());
                            for (i, x) in g.iter().enumerate() {
                                let e = expected(op, k, i);
                                assert!(
                                    (x - e).abs() <= 1e-5 * e.abs().max(1.0),
                                    "{} k={k} len={len} {op} replica {r} element {i}: {x} != {e}",
                                    ops.name()
                                );
                            }
                        }
                        for g in &got[1..] {
                            assert_eq!(g.as_ref().unwrap(), got[0].as_ref().unwrap(), "replicas must agree bitwise");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn reduce_to_one_delivers_only_to_the_destination() {
        for make in [CpuCrossDeviceOps::in_memory_all_reduce, CpuCrossDeviceOps::reduction_to_one_device] {
            for k in 1..=5 {
                let ops = make(k).unwrap();
                let dst = k - 1;
                for op in ReduceOp::ALL {
                    let got = run(&ops, k, 1001, op, Destination::Replica(dst));
                    for (r, g) in got.iter().enumerate() {
                        if r == dst {
                            let g = g.as_ref().unwrap();
                            assert_eq!(g.len(), 1001);
                            for (i, x) in g.iter().enumerate() {
                                assert!((x - expected(op, k, i)).abs() <= 1e-5 * x.abs().max(1.0));
                            }
                        } else {
                            assert!(g.is_none(), "replica {r} is not the destination");
                        }
                    }
                }
            }
        }
    }

    /// Replica `replica`'s request for the first all-reduce (sum) of a step.
    fn first_sum<'a>(group: &'a ReplicaGroup, replica: usize, input: &'a [Tensor], weight: f32) -> ReduceRequest<'a> {
        ReduceRequest { group, replica, seq: 0, op: ReduceOp::Sum, dest: Destination::AllReplicas, input, weight }
    }

    #[test]
    fn weights_scale_each_contribution() {
        let ops = CpuCrossDeviceOps::in_memory_all_reduce(2).unwrap();
        let group = ReplicaGroup::new(2, Duration::from_secs(10)).unwrap();
        let res: Vec<Vec<f32>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|r| {
                    let (ops, group) = (&ops, &group);
                    s.spawn(move || {
                        let data = vec![Tensor::ones(5, candle_core::DType::F32, &Device::Cpu).unwrap()];
                        let w = if r == 0 { 0.75 } else { 0.25 };
                        let mut got = Vec::new();
                        ops.reduce(first_sum(group, r, &data, w), &mut |p| got.extend_from_slice(p)).unwrap();
                        got
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(res[0], vec![1.0; 5]);
        assert_eq!(res[1], vec![1.0; 5]);
    }

    #[test]
    fn mismatched_lengths_are_a_clear_error_not_a_hang() {
        let ops = CpuCrossDeviceOps::in_memory_all_reduce(2).unwrap();
        let group = ReplicaGroup::new(2, Duration::from_secs(10)).unwrap();
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|r| {
                    let (ops, group) = (&ops, &group);
                    s.spawn(move || {
                        let data = vec![Tensor::ones(5 + r, candle_core::DType::F32, &Device::Cpu).unwrap()];
                        ops.reduce(first_sum(group, r, &data, 1.0), &mut |_| {})
                    })
                })
                .collect();
            for h in hs {
                let e = h.join().unwrap().unwrap_err();
                assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
                assert!(e.to_string().contains("[5]") && e.to_string().contains("[6]"), "{e}");
            }
        });
    }
}
