//! The hierarchical all-reduce of a multi-worker job.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{Tensor, TensorId};

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
    /// The job scales its loss (fp16; learned from its first step's end): every state keeps
    /// what undoes a skipped step.
    scaled: bool,
    /// How many states were created: the next one's seed, alike on every worker (buckets are
    /// started in the same order everywhere).
    created: u64,
    states: HashMap<TensorId, PowerSgdState>,
    /// Gradients reduced so far, by variable, while fewer than the compression's start step.
    warming: HashMap<TensorId, u64>,
    /// Buckets whose `P` round is in flight, by the request's sequence number.
    in_flight: HashMap<u64, InFlight>,
    /// The variables whose `warming` count a bucket not yet finished raised, by the request's
    /// sequence number: an abandoned step's counts are undone.
    counted: HashMap<u64, Vec<TensorId>>,
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
            // The ring's buffer, written once: a contiguous f32 CPU gradient is read in place
            // (a copy through `to_vec1` first cost 2.6-3.1 ms of CPU a worker's 4.3M MLP step
            // on an AVX2 host), any other through a vector of its own.
            let mut buf = Vec::with_capacity(req.len());
            let mut put = |v: &[f32]| {
                if weight == 1.0 {
                    buf.extend_from_slice(v);
                } else {
                    buf.extend(v.iter().map(|x| x * weight));
                }
            };
            for t in input {
                let guard = [t.storage_and_layout()];
                if let Ok(v) = crate::cross_device::read_slices(&guard) {
                    put(v[0]);
                    continue;
                }
                drop(guard);
                put(&t.flatten_all()?.to_vec1::<f32>()?);
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
        let mut counted = Vec::new();
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
                    counted.push(id);
                    false
                }
                None => {
                    power.warming.insert(id, 1);
                    counted.push(id);
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
                    let state = PowerSgdState::new(rows, cols, rank, seed)?;
                    if self.workers.is_elastic() || power.scaled {
                        state.keeping_rollback()
                    } else {
                        state
                    }
                }
            };
            ps.extend_from_slice(state.compress_p(grad));
            tensors.push((Some((id, state)), len));
        }
        let raw = wire.len();
        wire.extend_from_slice(&ps);
        if !counted.is_empty() {
            power.counted.insert(req.seq, counted);
        }
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

    /// Uncompressed: a reduce-scatter across the workers, so that each worker receives (and
    /// sends) about half an all-reduce's bytes. Compressed ones go as `start_gradients` does.
    fn start_scatter(&self, req: ReduceRequest<'_>, ids: &[TensorId], out: &mut dyn FnMut(&[f32])) -> Result<Started> {
        match self.compression {
            Compression::None => {
                let op = req.op;
                let buf = self.local_sum(req)?;
                Ok(Started::AcrossWorkers(buf.map(|buf| self.workers.start_reduce_scatter(op, buf))))
            }
            _ => self.start_gradients(req, ids, out),
        }
    }

    /// PowerSGD's state (the only state these ops keep): every step in flight is undone (its
    /// gradients leave the error buffers, its `warming` counts go back), then worker `source`
    /// hands every worker its set of compressed variables, their warm `Q`s and counts, the
    /// members' error buffers are summed and split evenly over the new membership (only their
    /// sum enters the next step's `P` and `Q`, so the split does not change what is sent), and
    /// every state's generator restarts from the generation. A lost worker's own error is lost
    /// with it; a joiner starts with its share of the others'.
    /// PowerSGD's error feedback under fp16's loss scaling: a skipped step's gradient (not
    /// finite on some worker, so `P` and `Q` are not finite on every one) is undone in every
    /// state, error and warm `Q`, and the error follows the scale into the next gradients'
    /// units. From the first call on, every state keeps a copy of its error and `Q` from
    /// before each step (a state's first step is undone exactly without it).
    fn loss_scale_step(&self, applied: bool, factor: f64) {
        if !matches!(self.compression, Compression::PowerSgd { .. }) {
            return;
        }
        let mut power = self.power();
        power.scaled = true;
        for state in power.states.values_mut() {
            if !applied {
                state.undo();
            }
            if factor != 1.0 {
                state.scale_error(factor as f32);
            }
            state.keep_rollback();
        }
    }

    fn carry_over(&self, vars: &[Tensor], source: usize) -> Result<()> {
        let Compression::PowerSgd { rank, .. } = self.compression else { return Ok(()) };
        let w = &self.workers;
        let mut power = self.power();
        let power = &mut *power;
        for flight in std::mem::take(&mut power.in_flight).into_values() {
            for (id, state) in flight.tensors.into_iter().filter_map(|(s, _)| s) {
                power.states.insert(id, state);
            }
        }
        for state in power.states.values_mut() {
            state.roll_back();
        }
        for id in std::mem::take(&mut power.counted).into_values().flatten() {
            if let Some(n) = power.warming.get_mut(&id) {
                *n = n.saturating_sub(1);
            }
        }
        // Worker `source`'s view: how many states it created, then for every variable
        // whether it has a state and how many gradients it counted.
        let mut header = Vec::with_capacity(1 + 2 * vars.len());
        header.push(power.created);
        for v in vars {
            header.push(u64::from(power.states.contains_key(&v.id())));
            header.push(power.warming.get(&v.id()).copied().unwrap_or(0));
        }
        w.broadcast_u64s(source, &mut header)?;
        power.created = header[0];
        let mut kept = Vec::new();
        for (v, flags) in vars.iter().zip(header[1..].chunks_exact(2)) {
            let id = v.id();
            match flags[1] {
                0 => power.warming.remove(&id),
                n => power.warming.insert(id, n),
            };
            if flags[0] == 0 {
                power.states.remove(&id);
                continue;
            }
            let (rows, cols) = matrix_shape(v.dims()).ok_or_else(|| {
                Error::Cluster(format!(
                    "worker {source} compresses a variable of shape {:?} that is no matrix here: the workers' models differ",
                    v.dims()
                ))
            })?;
            if power.states.get(&id).is_none_or(|s| (s.rows(), s.cols()) != (rows, cols)) {
                power.states.insert(id, PowerSgdState::new(rows, cols, rank, 0)?.keeping_rollback());
            }
            kept.push(id);
        }
        let mut errors = Vec::new();
        let mut qs = Vec::new();
        for id in &kept {
            errors.extend_from_slice(power.states[id].error());
            qs.extend_from_slice(power.states[id].q());
        }
        w.all_reduce(ReduceOp::Sum, &mut errors)?;
        w.broadcast(source, &mut qs)?;
        let share = 1.0 / w.num_workers() as f32;
        errors.iter_mut().for_each(|e| *e *= share);
        let generation = w.generation().wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let (mut e_at, mut q_at) = (0, 0);
        for (k, id) in kept.iter().enumerate() {
            let state = power.states.get_mut(id).expect("kept above");
            let (ne, nq) = (state.error().len(), state.q().len());
            let seed = power.seed ^ generation ^ (k as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            state.reset(&errors[e_at..e_at + ne], Some(&qs[q_at..q_at + nq]), seed);
            e_at += ne;
            q_at += nq;
        }
        Ok(())
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
            let done = match flight {
                Some(flight) => self.finish_power(flight, reduced),
                None => reduced,
            };
            if done.is_ok() {
                self.power().counted.remove(&seq);
            }
            done
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
        elastic: bool,
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
        fn is_elastic(&self) -> bool {
            self.elastic
        }
    }

    fn run(k: usize, dest: Destination, weight: f32) -> Vec<Result<Vec<f32>>> {
        let ops = HierarchicalOps::new(
            CpuCrossDeviceOps::in_memory_all_reduce(k).unwrap(),
            Arc::new(Mirror { workers: 3, elastic: false }),
        );
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

    /// One replica of one of four mirrored workers (sums are exact multiples), under PowerSGD.
    fn power_ops(elastic: bool, start_step: u64) -> (HierarchicalOps, ReplicaGroup) {
        let workers = Arc::new(Mirror { workers: 4, elastic });
        let ops = HierarchicalOps::new(CpuCrossDeviceOps::in_memory_all_reduce(1).unwrap(), workers)
            .with_compression(Compression::PowerSgd { rank: 1, start_step }, 7);
        (ops, ReplicaGroup::new(1, Duration::from_secs(30)).unwrap())
    }

    /// One bucket of `var`'s gradient `k`: its reduction, or `None` when `abandon` drops it
    /// after its first round started (a collective that failed).
    fn bucket(ops: &HierarchicalOps, group: &ReplicaGroup, var: &Tensor, k: f32, abandon: bool) -> Option<Vec<u32>> {
        let grad: Vec<f32> = (0..48).map(|i| ((i as f32) * 0.61 + k).sin()).collect();
        let input = [Tensor::from_vec(grad, (8, 6), &Device::Cpu).unwrap()];
        let seq = group.next_seq(0);
        let req = ReduceRequest {
            group,
            replica: 0,
            seq,
            op: ReduceOp::Sum,
            dest: Destination::AllReplicas,
            input: &input,
            weight: 1.0,
        };
        let mut got = Vec::new();
        let started = ops.start_gradients(req, &[var.id()], &mut |p| got.extend_from_slice(p)).unwrap();
        if abandon {
            return None;
        }
        ops.finish(req, started, &mut |p| got.extend_from_slice(p)).unwrap();
        Some(got.iter().map(|x| x.to_bits()).collect())
    }

    #[test]
    fn carry_over_undoes_an_abandoned_powersgd_step_and_its_warm_up_count() {
        let var = Tensor::zeros((8, 6), candle_core::DType::F32, &Device::Cpu).unwrap();
        // A step abandoned, the membership carried over, the step run again: as if the
        // abandoned step never happened.
        let (ops, group) = power_ops(true, 0);
        bucket(&ops, &group, &var, 1.0, false);
        bucket(&ops, &group, &var, 2.0, true);
        ops.carry_over(std::slice::from_ref(&var), 0).unwrap();
        let again = bucket(&ops, &group, &var, 3.0, false);
        let (reference, group_r) = power_ops(true, 0);
        bucket(&reference, &group_r, &var, 1.0, false);
        reference.carry_over(std::slice::from_ref(&var), 0).unwrap();
        assert_eq!(again, bucket(&reference, &group_r, &var, 3.0, false));
        // Without it (a job that is not elastic goes on only in this test), the abandoned
        // gradient travels with the next one.
        let (plain, group_p) = power_ops(false, 0);
        bucket(&plain, &group_p, &var, 1.0, false);
        bucket(&plain, &group_p, &var, 2.0, true);
        assert_ne!(again, bucket(&plain, &group_p, &var, 3.0, false));

        // Two uncompressed steps first: the abandoned one does not count.
        let (ops, group) = power_ops(true, 2);
        bucket(&ops, &group, &var, 1.0, false);
        bucket(&ops, &group, &var, 2.0, true);
        ops.carry_over(std::slice::from_ref(&var), 0).unwrap();
        let sum = |k: f32| -> Vec<u32> { (0..48).map(|i| (((i as f32) * 0.61 + k).sin() * 4.0).to_bits()).collect() };
        assert_eq!(bucket(&ops, &group, &var, 3.0, false).unwrap(), sum(3.0), "the second gradient is uncompressed");
        assert_ne!(bucket(&ops, &group, &var, 4.0, false).unwrap(), sum(4.0), "the third is compressed");
    }

    /// Workers on threads of this process, whose membership the test changes (an elastic
    /// job's generations): collectives meet in the current generation's slots.
    #[derive(Debug)]
    struct Party(Mutex<(usize, u64, Arc<Meeting>)>);

    #[derive(Debug)]
    struct Meeting {
        n: usize,
        barrier: std::sync::Barrier,
        slots: Mutex<Vec<Vec<f32>>>,
        words: Mutex<Vec<Vec<u64>>>,
    }

    impl Meeting {
        fn new(n: usize) -> Arc<Self> {
            Arc::new(Self {
                n,
                barrier: std::sync::Barrier::new(n),
                slots: Mutex::new(vec![Vec::new(); n]),
                words: Mutex::new(vec![Vec::new(); n]),
            })
        }
    }

    impl Party {
        fn at(&self) -> (usize, u64, Arc<Meeting>) {
            self.0.lock().unwrap().clone()
        }
        /// Everyone's `mine`, in worker order.
        fn meet<T: Clone>(&self, slots: impl Fn(&Meeting) -> &Mutex<Vec<Vec<T>>>, mine: &[T]) -> Vec<Vec<T>> {
            let (index, _, m) = self.at();
            slots(&m).lock().unwrap()[index] = mine.to_vec();
            m.barrier.wait();
            let all = slots(&m).lock().unwrap().clone();
            m.barrier.wait();
            all
        }
    }

    impl WorkerCollectives for Party {
        fn num_workers(&self) -> usize {
            self.at().2.n
        }
        fn worker_index(&self) -> usize {
            self.at().0
        }
        fn all_reduce(&self, op: ReduceOp, data: &mut [f32]) -> Result<()> {
            assert_eq!(op, ReduceOp::Sum);
            let all = self.meet(|m| &m.slots, data);
            for (i, x) in data.iter_mut().enumerate() {
                *x = all.iter().map(|v| v[i]).fold(0.0, |a, b| a + b);
            }
            Ok(())
        }
        fn all_gather(&self, mine: &[f32]) -> Result<Vec<Vec<f32>>> {
            Ok(self.meet(|m| &m.slots, mine))
        }
        fn broadcast(&self, root: usize, data: &mut [f32]) -> Result<()> {
            data.copy_from_slice(&self.meet(|m| &m.slots, data)[root]);
            Ok(())
        }
        fn broadcast_u64s(&self, root: usize, data: &mut [u64]) -> Result<()> {
            data.copy_from_slice(&self.meet(|m| &m.words, data)[root]);
            Ok(())
        }
        fn barrier(&self) -> Result<()> {
            self.at().2.barrier.wait();
            Ok(())
        }
        fn generation(&self) -> u64 {
            self.at().1
        }
        fn is_elastic(&self) -> bool {
            true
        }
    }

    #[test]
    fn carry_over_hands_a_joiner_the_warm_q_and_splits_the_members_errors() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let var = || Tensor::zeros((8, 6), candle_core::DType::F32, &Device::Cpu).unwrap();
        let first = Meeting::new(2);
        let parties: Vec<Arc<Party>> = (0..2).map(|i| Arc::new(Party(Mutex::new((i, 0, first.clone()))))).collect();
        let compression = Compression::PowerSgd { rank: 1, start_step: 0 };
        let ops = |p: &Arc<Party>| {
            let local = CpuCrossDeviceOps::in_memory_all_reduce(1).unwrap();
            (
                HierarchicalOps::new(local, p.clone()).with_compression(compression, 7),
                ReplicaGroup::new(1, Duration::from_secs(30)).unwrap(),
            )
        };
        let workers: Vec<_> = parties.iter().map(ops).collect();
        let vars = [var(), var()];
        let steps = |ks: std::ops::Range<usize>, abandon: bool| {
            std::thread::scope(|s| {
                for (w, ((o, g), v)) in workers.iter().zip(&vars).enumerate() {
                    let ks = ks.clone();
                    s.spawn(move || ks.for_each(|k| drop(bucket(o, g, v, (10 * w + k) as f32, abandon))));
                }
            })
        };
        let state = |o: &HierarchicalOps, v: &Tensor| {
            let p = o.power();
            let s = &p.states[&v.id()];
            (s.error().to_vec(), s.q().to_vec(), p.created, p.warming.get(&v.id()).copied())
        };
        // Two steps, then a third abandoned by both after its first round.
        steps(0..2, false);
        let (error_before, q_before, _, _) = state(&workers[0].0, &vars[0]);
        steps(2..3, true);
        // Worker 1 is lost; a new process joins as worker 1 of generation 1, and worker 0
        // hands it its state.
        let second = Meeting::new(2);
        *parties[0].0.lock().unwrap() = (0, 1, second.clone());
        let joiner = Arc::new(Party(Mutex::new((1, 1, second))));
        let new = ops(&joiner);
        let joiner_var = var();
        std::thread::scope(|s| {
            s.spawn(|| workers[0].0.carry_over(std::slice::from_ref(&vars[0]), 0).unwrap());
            s.spawn(|| new.0.carry_over(std::slice::from_ref(&joiner_var), 0).unwrap());
        });
        let (e0, q0, c0, w0) = state(&workers[0].0, &vars[0]);
        let (e1, q1, c1, w1) = state(&new.0, &joiner_var);
        assert_eq!(bits(&q0), bits(&q_before), "the warm q is the source's");
        assert_eq!(bits(&q1), bits(&q0), "the joiner's q is the source's");
        assert_eq!((c0, w0), (c1, w1));
        let half: Vec<f32> = error_before.iter().map(|e| (e + 0.0) * 0.5).collect();
        assert!(half.iter().any(|&x| x != 0.0));
        assert_eq!(bits(&e0), bits(&half), "the members' errors, summed and split");
        assert_eq!(bits(&e1), bits(&half));
        // The next step gives both the same bits.
        let outs: Vec<_> = std::thread::scope(|s| {
            let a = s.spawn(|| bucket(&workers[0].0, &workers[0].1, &vars[0], 5.0, false));
            let b = s.spawn(|| bucket(&new.0, &new.1, &joiner_var, 6.0, false));
            vec![a.join().unwrap(), b.join().unwrap()]
        });
        assert_eq!(outs[0], outs[1]);
    }

    #[test]
    fn the_default_all_gather_into_places_every_worker_and_refuses_another_count() {
        let m = Meeting::new(3);
        let parties: Vec<Party> = (0..3).map(|i| Party(Mutex::new((i, 0, m.clone())))).collect();
        let results: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = parties
                .iter()
                .enumerate()
                .map(|(w, p)| {
                    s.spawn(move || {
                        let mine: Vec<f32> = (0..w + 1).map(|i| (10 * w + i) as f32).collect();
                        let mut out = vec![f32::NAN; 6];
                        p.all_gather_into(&mine, &mut out, &[1, 2, 3]).unwrap();
                        // Worker 0 expects 2 values from worker 2, which gives 3.
                        let counts = if w == 0 { [1, 2, 2] } else { [1, 2, 3] };
                        let mut short = vec![0f32; counts.iter().sum()];
                        let err = p.all_gather_into(&mine, &mut short, &counts).err().map(|e| e.to_string());
                        (out, err)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (w, (out, err)) in results.iter().enumerate() {
            assert_eq!(out, &[0.0, 10.0, 11.0, 20.0, 21.0, 22.0], "worker {w}");
            assert_eq!(err.is_some(), w == 0, "worker {w}: {err:?}");
        }
        assert!(results[0].1.as_deref().unwrap().contains("expected [1, 2, 2] from the workers and got [1, 2, 3]"));
    }
}
