//! The hierarchical all-reduce of a multi-worker job.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::TensorId;

use super::compression::{matrix_shape, Compression, HalfFormat, PowerSgdState};
use super::{CpuCrossDeviceOps, CrossDeviceOps, Destination, ReduceRequest, Started, WorkerCollectives};
use crate::group::OpKey;
use crate::{Error, ReduceOp, Result};

/// Hierarchical all-reduce: the worker's replicas reduce to replica 0 in memory, replica 0
/// all-reduces across the workers ([`WorkerCollectives::all_reduce`]), and every local replica
/// receives the result (in host pieces, like the CPU ops). Reduces to every replica only.
///
/// Gradient buckets ([`CrossDeviceOps::start_gradients`]) cross the workers under the ops'
/// [`Compression`]: in 16 bits, or with PowerSGD, whose per-gradient state (error feedback,
/// warm `Q`) replica 0 keeps here, by variable.
#[derive(Debug)]
pub struct HierarchicalOps {
    local: CpuCrossDeviceOps,
    workers: Arc<dyn WorkerCollectives>,
    /// How gradient buckets cross the workers.
    compression: Compression,
    /// PowerSGD's states, by variable, and the buckets in flight.
    power: Mutex<PowerStates>,
}

#[derive(Debug, Default)]
struct PowerStates {
    seed: u64,
    /// How many states were created: the next one's seed, alike on every worker (buckets are
    /// started in the same order everywhere).
    created: u64,
    states: HashMap<TensorId, PowerSgdState>,
    /// Gradients reduced so far, by variable, while fewer than the compression's start step.
    warming: HashMap<TensorId, u64>,
    /// Buckets whose `P` round is in flight, by the request's sequence number.
    in_flight: HashMap<u64, InFlight>,
}

/// A bucket between PowerSGD's `P` round and its `Q` round: the wire is the bucket's
/// uncompressed tensors in f32, then each compressed tensor's `P`.
#[derive(Debug)]
struct InFlight {
    /// For each tensor of the bucket in order: its state if it is compressed (taken out of
    /// the map while in flight), else `None`.
    tensors: Vec<(Option<(TensorId, PowerSgdState)>, usize)>,
    /// The elements of the uncompressed tensors, first on the wire.
    raw: usize,
}

impl HierarchicalOps {
    /// Reduces this worker's replicas with `local` and across workers with `workers`.
    pub fn new(local: CpuCrossDeviceOps, workers: Arc<dyn WorkerCollectives>) -> Self {
        Self { local, workers, compression: Compression::None, power: Mutex::new(PowerStates::default()) }
    }

    /// Sends gradient buckets across the workers under `compression`; PowerSGD's warm `Q`s
    /// are drawn from `seed` (the same on every worker), one stream per variable in the order
    /// their gradients are first reduced.
    pub fn with_compression(mut self, compression: Compression, seed: u64) -> Self {
        self.compression = compression;
        self.power = Mutex::new(PowerStates { seed, ..PowerStates::default() });
        self
    }

    fn power(&self) -> std::sync::MutexGuard<'_, PowerStates> {
        self.power.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Replica 0's contribution (or the only replica's): the worker's reduced values.
    fn local_sum(&self, req: ReduceRequest<'_>) -> Result<Option<Vec<f32>>> {
        let ReduceRequest { group, replica, dest, input, weight, .. } = req;
        if dest != Destination::AllReplicas {
            return Err(Error::InvalidArgument(
                "multi-worker mirrored reduces to every replica; reduction to one device is not supported".into(),
            ));
        }
        if group.num_replicas() == 1 {
            let mut buf = Vec::with_capacity(req.len());
            for t in input {
                let v = t.flatten_all()?.to_vec1::<f32>()?;
                if weight == 1.0 {
                    buf.extend_from_slice(&v);
                } else {
                    buf.extend(v.iter().map(|x| x * weight));
                }
            }
            return Ok(Some(buf));
        }
        let mut buf = Vec::new();
        let local = ReduceRequest { dest: Destination::Replica(0), ..req };
        self.local.reduce(local, &mut |p| buf.extend_from_slice(p))?;
        Ok((replica == 0).then_some(buf))
    }

    fn start_with(&self, req: ReduceRequest<'_>, wire: Option<HalfFormat>) -> Result<Started> {
        let op = req.op;
        let buf = self.local_sum(req)?;
        Ok(Started::AcrossWorkers(buf.map(|buf| match wire {
            Some(format) if op == ReduceOp::Sum => self.workers.start_all_reduce_half(buf, format),
            _ => self.workers.start_all_reduce(op, buf),
        })))
    }

    /// PowerSGD's first half on replica 0: each compressed tensor's `P` (after its error is
    /// added), behind the uncompressed tensors, all-reduced in one collective.
    fn start_power(&self, req: ReduceRequest<'_>, ids: &[TensorId], rank: usize, start_step: u64) -> Result<Started> {
        if ids.len() != req.input.len() {
            return Err(Error::InvalidArgument(format!(
                "a gradient bucket of {} tensors came with {} variable ids",
                req.input.len(),
                ids.len()
            )));
        }
        let Some(buf) = self.local_sum(req)? else { return Ok(Started::AcrossWorkers(None)) };
        let mut power = self.power();
        let mut tensors = Vec::with_capacity(ids.len());
        let (mut wire, mut ps) = (Vec::with_capacity(buf.len()), Vec::new());
        let mut offset = 0;
        for (t, &id) in req.input.iter().zip(ids) {
            let len = t.elem_count();
            let grad = &buf[offset..offset + len];
            offset += len;
            let shape = t.dims();
            // The first `start_step` gradients of a variable travel uncompressed.
            let warm = match power.warming.get_mut(&id) {
                _ if start_step == 0 => true,
                Some(n) if *n >= start_step => true,
                Some(n) => {
                    *n += 1;
                    false
                }
                None => {
                    power.warming.insert(id, 1);
                    false
                }
            };
            let compressed = warm && self.compression.compresses(shape);
            let Some((rows, cols)) = matrix_shape(shape).filter(|_| compressed) else {
                wire.extend_from_slice(grad);
                tensors.push((None, len));
                continue;
            };
            let mut state = match power.states.remove(&id) {
                Some(s) if (s.rows(), s.cols()) == (rows, cols) => s,
                _ => {
                    let seed = power.seed ^ power.created.wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    power.created += 1;
                    PowerSgdState::new(rows, cols, rank, seed)?
                }
            };
            ps.extend_from_slice(state.compress_p(grad));
            tensors.push((Some((id, state)), len));
        }
        let raw = wire.len();
        wire.extend_from_slice(&ps);
        // A bucket with nothing compressed is a plain all-reduce: no `Q` round.
        if tensors.iter().any(|(s, _)| s.is_some()) {
            power.in_flight.insert(req.seq, InFlight { tensors, raw });
        }
        drop(power);
        Ok(Started::AcrossWorkers(Some(self.workers.start_all_reduce(ReduceOp::Sum, wire))))
    }

    /// PowerSGD's second half on replica 0, given the reduced wire of its first: `Q` of every
    /// compressed tensor all-reduced in one collective, then the bucket's values.
    fn finish_power(&self, flight: InFlight, reduced: Result<Vec<f32>>) -> Result<Vec<f32>> {
        let InFlight { mut tensors, raw } = flight;
        let outcome = (|| {
            let reduced = reduced?;
            let mut at = raw;
            let mut qs = Vec::new();
            for (state, _) in tensors.iter_mut() {
                if let Some((_, s)) = state {
                    let p = s.p_mut();
                    let n = p.len();
                    let got = reduced.get(at..at + n).ok_or_else(|| {
                        Error::Cluster("a compressed bucket came back shorter than it was sent".into())
                    })?;
                    p.copy_from_slice(got);
                    at += n;
                    qs.extend_from_slice(s.after_p_reduced());
                }
            }
            self.workers.all_reduce(ReduceOp::Sum, &mut qs)?;
            let (mut out, mut raw_at, mut q_at) = (Vec::with_capacity(reduced.len()), 0, 0);
            for (state, len) in tensors.iter_mut() {
                match state {
                    Some((_, s)) => {
                        let q = s.q_mut();
                        let n = q.len();
                        q.copy_from_slice(&qs[q_at..q_at + n]);
                        q_at += n;
                        let from = out.len();
                        out.resize(from + *len, 0.0);
                        s.decompress(&mut out[from..]);
                    }
                    None => {
                        out.extend_from_slice(&reduced[raw_at..raw_at + *len]);
                        raw_at += *len;
                    }
                }
            }
            Ok(out)
        })();
        // The states go back whatever happened: an abandoned step's gradient stays in the
        // error buffer, and the next step's first phase starts over.
        let mut power = self.power();
        for (id, state) in tensors.into_iter().filter_map(|(s, _)| s) {
            power.states.insert(id, state);
        }
        outcome
    }
}

impl CrossDeviceOps for HierarchicalOps {
    fn name(&self) -> &'static str {
        "hierarchical(in-memory, ring)"
    }

    fn reduce(&self, req: ReduceRequest<'_>, out: &mut dyn FnMut(&[f32])) -> Result<()> {
        let started = self.start(req, out)?;
        self.finish(req, started, out)
    }

    /// Reduces the worker's replicas in memory to replica 0, which starts the cross-worker
    /// all-reduce and returns without waiting for it.
    fn start(&self, req: ReduceRequest<'_>, _out: &mut dyn FnMut(&[f32])) -> Result<Started> {
        self.start_with(req, None)
    }

    /// [`start`](CrossDeviceOps::start) over the gradient wire, compressed if so configured.
    fn start_gradients(
        &self,
        req: ReduceRequest<'_>,
        ids: &[TensorId],
        _out: &mut dyn FnMut(&[f32]),
    ) -> Result<Started> {
        match self.compression {
            Compression::PowerSgd { rank, start_step } if req.op == ReduceOp::Sum => {
                self.start_power(req, ids, rank, start_step)
            }
            c => self.start_with(req, c.half_format()),
        }
    }

    /// Rows reduce as the whole does, except under PowerSGD, which compresses whole matrices.
    fn takes_row_blocks(&self) -> bool {
        !matches!(self.compression, Compression::PowerSgd { .. })
    }

    fn check_gradients(&self, shapes: &[&[usize]]) -> Result<()> {
        Ok(self.compression.check_model(shapes.iter().copied())?)
    }

    /// Waits for the cross-worker all-reduce (replica 0) and hands its result to every local
    /// replica.
    fn finish(&self, req: ReduceRequest<'_>, started: Started, out: &mut dyn FnMut(&[f32])) -> Result<()> {
        let ReduceRequest { group, replica, op, seq, .. } = req;
        let Started::AcrossWorkers(pending) = started else { return Ok(()) };
        let result = || {
            let flight = self.power().in_flight.remove(&seq);
            let reduced = match pending {
                Some(p) => p.wait(),
                None => {
                    Err(Error::Scope("a cross-worker reduction was finished on a replica that did not start it".into()))
                }
            };
            match flight {
                Some(flight) => self.finish_power(flight, reduced),
                None => reduced,
            }
        };
        if group.num_replicas() == 1 {
            out(&result()?);
            return Ok(());
        }
        let mine: std::result::Result<Arc<Vec<f32>>, String> =
            if replica == 0 { result().map(Arc::new).map_err(|e| e.to_string()) } else { Ok(Arc::new(Vec::new())) };
        let key = OpKey { seq: group.next_seq(replica), op: format!("all_reduce({op}) across workers"), shape: vec![] };
        let all = group.exchange(replica, &key, mine)?;
        match all.into_iter().next() {
            Some(Ok(v)) => {
                out(&v);
                Ok(())
            }
            Some(Err(e)) => Err(Error::Cluster(e)),
            None => Err(Error::Scope("a cross-worker reduction produced no result".into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use candle_core::{Device, Tensor};

    use super::*;
    use crate::group::ReplicaGroup;
    use crate::ReduceOp;

    /// `workers` workers whose every replica contributes what this one's do: an all-reduce
    /// multiplies by the number of workers (`Sum`) or leaves the values (`Mean`, `Max`, `Min`).
    #[derive(Debug)]
    struct Mirror {
        workers: usize,
    }

    impl WorkerCollectives for Mirror {
        fn num_workers(&self) -> usize {
            self.workers
        }
        fn worker_index(&self) -> usize {
            0
        }
        fn all_reduce(&self, op: ReduceOp, data: &mut [f32]) -> Result<()> {
            if op == ReduceOp::Sum {
                data.iter_mut().for_each(|x| *x *= self.workers as f32);
            }
            Ok(())
        }
        fn all_gather(&self, mine: &[f32]) -> Result<Vec<Vec<f32>>> {
            Ok(vec![mine.to_vec(); self.workers])
        }
        fn broadcast(&self, _root: usize, _data: &mut [f32]) -> Result<()> {
            Ok(())
        }
        fn broadcast_u64s(&self, _root: usize, _data: &mut [u64]) -> Result<()> {
            Ok(())
        }
        fn barrier(&self) -> Result<()> {
            Ok(())
        }
    }

    fn run(k: usize, dest: Destination, weight: f32) -> Vec<Result<Vec<f32>>> {
        let ops =
            HierarchicalOps::new(CpuCrossDeviceOps::in_memory_all_reduce(k).unwrap(), Arc::new(Mirror { workers: 3 }));
        let group = ReplicaGroup::new(k, Duration::from_secs(30)).unwrap();
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..k)
                .map(|r| {
                    let (ops, group) = (&ops, &group);
                    s.spawn(move || {
                        let input = [Tensor::from_vec(vec![r as f32 + 1.0; 5], 5, &Device::Cpu).unwrap()];
                        let seq = group.next_seq(r);
                        let req =
                            ReduceRequest { group, replica: r, seq, op: ReduceOp::Sum, dest, input: &input, weight };
                        let mut got = Vec::new();
                        ops.reduce(req, &mut |p| got.extend_from_slice(p)).map(|()| got)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn every_local_replica_gets_the_sum_over_replicas_and_workers() {
        for k in [1, 2, 4] {
            // replicas contribute 1, 2, .., k (times the weight), and three workers do the same
            let want = 3.0 * 0.5 * (k * (k + 1) / 2) as f32;
            for (r, got) in run(k, Destination::AllReplicas, 0.5).into_iter().enumerate() {
                assert_eq!(got.unwrap(), vec![want; 5], "k={k} replica {r}");
            }
        }
    }

    #[test]
    fn reduction_to_one_device_is_refused() {
        for got in run(2, Destination::Replica(0), 1.0) {
            let e = got.unwrap_err().to_string();
            assert!(e.contains("reduction to one device is not supported"), "{e}");
        }
    }
}
