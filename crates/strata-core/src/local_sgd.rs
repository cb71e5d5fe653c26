//! Local SGD and DiLoCo: a multi-worker job whose workers step on their own between
//! synchronisations ([`LocalSgd`], set in [`StrategyOptions::local_sgd`](crate::StrategyOptions)).
//!
//! Every step is local: a worker's replicas reduce their gradients among themselves (Mirrored
//! within the worker) and the inner optimizer (its state local too) applies them. Every `H`
//! steps the workers meet: each sends its *outer gradient*, how far its parameters moved from
//! the global ones of the last meeting (`global - local`), the mean of them is all-reduced,
//! and the outer optimizer applies it to the global parameters, which every worker then takes
//! (Douillard et al. 2023). With fragments the parameters are split in `F` parts met at
//! staggered steps, each exchange running while the inner steps after it compute, and applied
//! a fixed number of steps later, every worker keeping the progress it made meanwhile
//! (Streaming DiLoCo, 2025).
//!
//! This module must not know the transport: it speaks to the other workers through
//! [`WorkerCollectives`] only.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::{DType, Tensor, Var};

use crate::context::ReplicaContext;
use crate::cross_device::compression::SumWire;
use crate::cross_device::PendingAllReduce;
use crate::extended::WorkerCollectives;
use crate::optim::rules;
use crate::{Error, ReduceOp, Result};

pub use crate::extended::local_sgd::{
    check_local_sgd_strategy, fragment_runs, LocalSgd, OuterOptimizer, DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM,
};

/// An exchange in flight.
#[derive(Debug)]
struct InFlight {
    fragment: usize,
    /// The inner step it was sent after.
    sent: u64,
    /// The step at which it is applied.
    due: u64,
    pending: PendingAllReduce,
    /// This worker's outer gradient, as computed (before the wire's rounding).
    mine: Vec<f32>,
    /// The meeting it completes when it lands (meetings land in the order they are sent).
    seq: u64,
}

/// An exchange whose all-reduce failed (a worker of an elastic job was lost): its fragment
/// is met again, or takes the global values another worker landed, when the job re-forms
/// ([`OuterSync::rejoin`]).
#[derive(Debug)]
struct Owed {
    fragment: usize,
    mine: Vec<f32>,
    seq: u64,
}

#[derive(Debug, Default)]
struct State {
    /// The global parameters of the last meeting, by variable.
    global: Vec<Vec<f32>>,
    /// The outer optimizer's velocity, by variable (Nesterov).
    velocity: Vec<Vec<f32>>,
    /// What the wire's rounding dropped of the outer gradients sent, by variable.
    error: Vec<Vec<f32>>,
    in_flight: VecDeque<InFlight>,
    /// Exchanges whose all-reduce failed, until the job re-forms.
    owed: Vec<Owed>,
    /// The inner step at which each fragment was last sent (0: never).
    sent_at: Vec<u64>,
    /// Bytes of outer gradients this worker sent.
    sent_bytes: u64,
    /// Meetings completed.
    meetings: u64,
}

/// What the local replicas do to their variables after a meeting: per variable of the
/// fragment, the new values (`Set`) or what to add (`Add`, keeping the progress made while
/// the exchange ran).
#[derive(Clone, Debug)]
enum Update {
    Set(usize, Arc<Vec<f32>>),
    Add(usize, Arc<Vec<f32>>),
}

/// The outer synchronisation of a [`DistributedOptimizer`](crate::DistributedOptimizer) under
/// local SGD: the global parameters, the outer optimizer's state and the exchanges in flight.
#[derive(Debug)]
pub(crate) struct OuterSync {
    cfg: LocalSgd,
    workers: Arc<dyn WorkerCollectives>,
    /// The inner steps taken so far (replica 0's count).
    step: std::sync::atomic::AtomicU64,
    runs: Vec<Range<usize>>,
    shapes: Vec<Vec<usize>>,
    state: Mutex<State>,
}

impl OuterSync {
    /// The outer synchronisation of `vars` (copy 0's trainable variables, whose values now
    /// are the global parameters: every worker starts from the chief's).
    pub(crate) fn new(cfg: LocalSgd, workers: Arc<dyn WorkerCollectives>, vars: &[Var]) -> Result<Self> {
        cfg.check()?;
        if vars.is_empty() {
            return Err(Error::InvalidArgument(
                "local SGD over a model with no trainable variable: nothing to synchronise".into(),
            ));
        }
        let sizes: Vec<usize> = vars.iter().map(|v| v.elem_count()).collect();
        let cfg_fragments = cfg.fragments;
        if cfg.fragments > sizes.len() {
            return Err(Error::InvalidArgument(format!(
                "{} fragments of a model of {} trainable variables: use at most {} (a fragment holds whole variables)",
                cfg.fragments,
                sizes.len(),
                sizes.len()
            )));
        }
        let global = vars.iter().map(|v| read(v.as_tensor())).collect::<Result<Vec<_>>>()?;
        let zeros = || sizes.iter().map(|&n| vec![0f32; n]).collect::<Vec<_>>();
        let velocity = if matches!(cfg.outer, OuterOptimizer::Nesterov { .. }) { zeros() } else { Vec::new() };
        let error = if cfg.wire.sum_wire().is_some() { zeros() } else { Vec::new() };
        Ok(Self {
            runs: fragment_runs(&sizes, cfg.fragments),
            shapes: vars.iter().map(|v| v.dims().to_vec()).collect(),
            cfg,
            workers,
            step: std::sync::atomic::AtomicU64::new(0),
            state: Mutex::new(State { global, velocity, error, sent_at: vec![0; cfg_fragments], ..State::default() }),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Bytes of outer gradients this worker sent, and meetings completed.
    pub(crate) fn traffic(&self) -> (u64, u64) {
        let s = self.state();
        (s.sent_bytes, s.meetings)
    }

    /// After inner step `step` (counted from 1) of every local replica: exchanges due are
    /// applied, and a fragment met now is sent. Replica 0 talks to the workers; every replica
    /// then updates its copy `vars` alike.
    pub(crate) fn after_step(&self, ctx: &ReplicaContext<'_>, vars: &[Var], step: u64) -> Result<()> {
        if ctx.replica_id() == 0 {
            self.step.store(step, Ordering::Relaxed);
        }
        let delay = self.cfg.delay();
        let meets = self.cfg.meeting(step).is_some();
        let due = step > delay && self.cfg.meeting(step - delay).is_some();
        if !meets && !due {
            return Ok(());
        }
        let updates = if ctx.replica_id() == 0 {
            self.exchange(vars, step).map(Arc::new).map_err(|e| e.to_string())
        } else {
            Ok(Arc::new(Vec::new()))
        };
        let updates = ctx.share_from_first("outer synchronisation", updates)?;
        apply(vars, &self.shapes, &updates)
    }

    /// Replica 0's part of step `step`: the exchanges due collected, the fragment met now sent
    /// (and, without delay, collected at once).
    fn exchange(&self, vars: &[Var], step: u64) -> Result<Vec<Update>> {
        let mut st = self.state();
        let mut updates = Vec::new();
        while st.in_flight.front().is_some_and(|f| f.due <= step) {
            let f = st.in_flight.pop_front().expect("checked above");
            updates.extend(self.land(&mut st, f, true)?);
        }
        if let Some(fragment) = self.cfg.meeting(step) {
            let flight = self.send(&mut st, vars, fragment, step + self.cfg.delay())?;
            if self.cfg.delay() == 0 {
                updates.extend(self.land(&mut st, flight, false)?);
            } else {
                st.in_flight.push_back(flight);
            }
        }
        Ok(updates)
    }

    /// Sends `fragment`'s outer gradient, read from `vars`.
    fn send(&self, st: &mut State, vars: &[Var], fragment: usize, due: u64) -> Result<InFlight> {
        let workers = &self.workers;
        let run = self.runs[fragment].clone();
        let sent = self.step.load(Ordering::Relaxed);
        st.sent_at[fragment] = sent;
        let mut mine = Vec::with_capacity(run.clone().map(|i| st.global[i].len()).sum());
        for i in run.clone() {
            let local = read(vars[i].as_tensor())?;
            mine.extend(st.global[i].iter().zip(&local).map(|(g, l)| g - l));
        }
        let format = self.cfg.wire.sum_wire();
        let pending = match format {
            None => {
                st.sent_bytes += 4 * mine.len() as u64;
                workers.start_all_reduce(ReduceOp::Sum, mine.clone())
            }
            Some(format) => {
                // Error feedback: what the last rounding dropped travels with this one.
                let mut wire = Vec::with_capacity(mine.len());
                let mut at = 0;
                for i in run {
                    let dropped = &mut st.error[i];
                    let len = dropped.len();
                    let start = wire.len();
                    wire.extend(mine[at..at + len].iter().zip(dropped.iter()).map(|(d, e)| d + e));
                    // What the wire drops of this variable's values (int8's blocks counted from
                    // the variable's start: the ring's own blocks start at its chunks', so for
                    // int8 this is the drop's estimate, for 16 bits its exact value).
                    let mut rounded = wire[start..].to_vec();
                    format.round(&mut rounded);
                    for ((e, w), r) in dropped.iter_mut().zip(&wire[start..]).zip(&rounded) {
                        *e = w - r;
                    }
                    at += len;
                }
                st.sent_bytes += format.encoded_len(mine.len()) as u64;
                match format {
                    SumWire::Half(half) => workers.start_all_reduce_half(wire, half),
                    SumWire::Int8 => workers.start_all_reduce_int8(wire),
                }
            }
        };
        let seq = st.meetings + st.in_flight.len() as u64;
        Ok(InFlight { fragment, sent, due, pending, mine, seq })
    }

    /// Waits for `flight`'s sum, applies the outer optimizer to the fragment's global
    /// parameters and says what the replicas do: take them (`kept_progress: false`), or add the
    /// step the global parameters took plus this worker's own outer gradient, keeping the inner
    /// steps taken while the exchange ran.
    fn land(&self, st: &mut State, flight: InFlight, kept_progress: bool) -> Result<Vec<Update>> {
        let InFlight { fragment, pending, mine, seq, .. } = flight;
        let mut sum = match pending.wait() {
            Ok(sum) => sum,
            Err(e) => {
                // An elastic job re-forms and meets it again ([`Self::rejoin`]).
                st.owed.push(Owed { fragment, mine, seq });
                return Err(e);
            }
        };
        if sum.len() != mine.len() {
            return Err(Error::Cluster(format!(
                "an outer gradient came back with {} values for {} sent",
                sum.len(),
                mine.len()
            )));
        }
        let n = self.workers.num_workers().max(1) as f32;
        sum.iter_mut().for_each(|x| *x /= n);
        let mut at = 0;
        let mut updates = Vec::new();
        for i in self.runs[fragment].clone() {
            let len = st.global[i].len();
            let d = &sum[at..at + len];
            let before = kept_progress.then(|| st.global[i].clone());
            self.outer_step(st, i, d);
            updates.push(match before {
                None => Update::Set(i, Arc::new(st.global[i].clone())),
                Some(before) => replay_progress(i, &st.global[i], &before, &mine[at..at + len]),
            });
            at += len;
        }
        st.meetings += 1;
        Ok(updates)
    }

    /// The exchanges that can be in flight at once (with a delay: one, since a fragment's
    /// exchange lands before the next fragment is sent; without: none), and the longest
    /// fragment's elements: a checkpoint's fixed room for them.
    fn in_flight_room(&self) -> (usize, usize) {
        let slots = usize::from(self.cfg.delay() > 0);
        let longest = self.runs.iter().map(|r| r.clone().map(|i| self.shapes[i].iter().product::<usize>()).sum()).max();
        (slots, longest.unwrap_or(0))
    }

    /// The outer synchronisation's part of a checkpoint (a collective: every worker calls it
    /// at the same step): the global parameters, the outer optimizer's velocity and the
    /// schedule's phase (the step, every fragment's last meeting, the exchange in flight with
    /// its landed sum), the same on every worker; and every worker's own state, gathered:
    /// its parameters `vars`, its optimizer's state `own` (names and shapes alike on every
    /// worker), what its wire's rounding dropped and its part of the exchange in flight, as
    /// one flat tensor `local_sgd/worker<k>` each.
    pub(crate) fn state_tensors(&self, vars: &[Var], own: &[(String, Tensor)]) -> Result<Vec<(String, Tensor)>> {
        let mut st = self.state();
        let (slots, longest) = self.in_flight_room();
        let mut mine = Vec::new();
        for v in vars {
            mine.extend(read(v.as_tensor())?);
        }
        for (_, t) in own {
            mine.extend(read(t)?);
        }
        for e in &st.error {
            mine.extend(e);
        }
        let mut sums = Vec::new();
        for slot in 0..slots {
            let (m, sum) = match st.in_flight.get_mut(slot) {
                // An exchange in flight is waited for (every worker started it), not applied:
                // its sum is saved, and lands where it is due, in this run and a resumed one.
                Some(f) => {
                    let pending = std::mem::replace(&mut f.pending, PendingAllReduce::ready(Ok(Vec::new())));
                    let sum = pending.wait()?;
                    f.pending = PendingAllReduce::ready(Ok(sum.clone()));
                    (f.mine.clone(), sum)
                }
                None => (Vec::new(), Vec::new()),
            };
            mine.extend(padded(&m, longest));
            sums.extend(padded(&sum, longest));
        }
        let all = self.workers.all_gather(&mine)?;
        let mut phase = vec![all.len() as u64, self.runs.len() as u64, self.step.load(Ordering::Relaxed)];
        phase.extend([st.sent_bytes, st.meetings]);
        phase.extend(&st.sent_at);
        for slot in 0..slots {
            match st.in_flight.get(slot) {
                Some(f) => phase.extend([1, f.fragment as u64, f.sent, f.due]),
                None => phase.extend([0; 4]),
            }
        }
        let cpu = &candle_core::Device::Cpu;
        let mut out = vec![(format!("{PREFIX}phase"), Tensor::new(encode_u64s(&phase), cpu)?)];
        for (i, g) in st.global.iter().enumerate() {
            out.push((format!("{PREFIX}global/{i}"), Tensor::from_slice(g, self.shapes[i].as_slice(), cpu)?));
        }
        for (i, v) in st.velocity.iter().enumerate() {
            out.push((format!("{PREFIX}velocity/{i}"), Tensor::from_slice(v, self.shapes[i].as_slice(), cpu)?));
        }
        if slots > 0 {
            out.push((format!("{PREFIX}in_flight_sum"), Tensor::new(sums, cpu)?));
        }
        for (k, m) in all.into_iter().enumerate() {
            out.push((format!("{PREFIX}worker{k}"), Tensor::new(m, cpu)?));
        }
        Ok(out)
    }

    /// Loads a checkpoint's outer synchronisation ([`Self::state_tensors`]'s entries among
    /// `state`): the outer state, and this worker's own: its parameters into every copy of
    /// `copies`, and its optimizer's state, returned in the names and shapes of `own` (this
    /// worker's current state) for the optimizer to load. A checkpoint of another number of
    /// workers or fragments is refused.
    pub(crate) fn load_state(
        &self,
        state: &[(String, Tensor)],
        own: &[(String, Tensor)],
        copies: &[Vec<Var>],
    ) -> Result<Vec<(String, Tensor)>> {
        let find = |name: &str| {
            state.iter().find(|(n, _)| n == name).map(|(_, t)| t).ok_or_else(|| {
                Error::Checkpoint(format!(
                    "the checkpoint holds no {name}: it was not written by a job under local SGD of these settings; resume it with the settings it was written with"
                ))
            })
        };
        let phase = decode_u64s(&read(find(&format!("{PREFIX}phase"))?)?);
        let workers = self.workers.num_workers();
        let (slots, longest) = self.in_flight_room();
        let fragments = self.runs.len();
        let want = 5 + fragments + 4 * slots;
        if phase.len() != want || phase[1] != fragments as u64 {
            return Err(Error::Checkpoint(format!(
                "the checkpoint's local SGD phase does not match {fragments} fragment(s) with an exchange delay of {}; resume it with the settings it was written with",
                self.cfg.delay()
            )));
        }
        if phase[0] != workers as u64 {
            return Err(Error::Checkpoint(format!(
                "the checkpoint holds the local SGD state of {} workers; resume it on {} workers, not {workers}",
                phase[0], phase[0]
            )));
        }
        let me = self.workers.worker_index();
        let mine = read(find(&format!("{PREFIX}worker{me}"))?)?;
        let sizes: Vec<usize> = self.shapes.iter().map(|s| s.iter().product()).collect();
        let params: usize = sizes.iter().sum();
        let own_len: usize = own.iter().map(|(_, t)| t.elem_count()).sum();
        let error_len = if self.cfg.wire.sum_wire().is_some() { params } else { 0 };
        if mine.len() != params + own_len + error_len + slots * longest {
            return Err(Error::Checkpoint(format!(
                "the checkpoint's local SGD state of worker {me} holds {} values, {} expected; resume it into the model and optimizer that wrote it",
                mine.len(),
                params + own_len + error_len + slots * longest
            )));
        }
        let mut at = 0;
        let mut take = |n: usize| {
            let s = &mine[at..at + n];
            at += n;
            s
        };
        let locals: Vec<Vec<f32>> = sizes.iter().map(|&n| take(n).to_vec()).collect();
        let mut loaded = Vec::with_capacity(own.len());
        for (name, t) in own {
            let v = Tensor::from_slice(take(t.elem_count()), t.shape(), t.device())?.to_dtype(t.dtype())?;
            loaded.push((name.clone(), v));
        }
        let error: Vec<Vec<f32>> =
            if error_len > 0 { sizes.iter().map(|&n| take(n).to_vec()).collect() } else { Vec::new() };
        let sums = if slots > 0 { read(find(&format!("{PREFIX}in_flight_sum"))?)? } else { Vec::new() };
        let mut global = Vec::with_capacity(sizes.len());
        let mut velocity = Vec::new();
        for i in 0..sizes.len() {
            global.push(read(find(&format!("{PREFIX}global/{i}"))?)?);
            if matches!(self.cfg.outer, OuterOptimizer::Nesterov { .. }) {
                velocity.push(read(find(&format!("{PREFIX}velocity/{i}"))?)?);
            }
        }
        let mut in_flight = VecDeque::new();
        for slot in 0..slots {
            let m = take(longest);
            let p = &phase[5 + fragments + 4 * slot..][..4];
            if p[0] == 1 {
                let fragment = p[1] as usize;
                let len: usize = self.runs.get(fragment).map_or(0, |r| r.clone().map(|i| sizes[i]).sum());
                let sum = sums[slot * longest..][..len].to_vec();
                in_flight.push_back(InFlight {
                    fragment,
                    sent: p[2],
                    due: p[3],
                    pending: PendingAllReduce::ready(Ok(sum)),
                    mine: m[..len].to_vec(),
                    seq: phase[4],
                });
            }
        }
        for vars in copies {
            let updates: Vec<Update> =
                locals.iter().enumerate().map(|(i, l)| Update::Set(i, Arc::new(l.clone()))).collect();
            apply(vars, &self.shapes, &updates)?;
        }
        self.step.store(phase[2], Ordering::Relaxed);
        let mut st = self.state();
        *st = State {
            global,
            velocity,
            error,
            in_flight,
            owed: Vec::new(),
            sent_at: phase[5..5 + fragments].to_vec(),
            sent_bytes: phase[3],
            meetings: phase[4],
        };
        Ok(loaded)
    }

    /// The workers it meets.
    pub(crate) fn workers(&self) -> &Arc<dyn WorkerCollectives> {
        &self.workers
    }

    /// The inner steps this worker applied (a step whose meeting failed was applied).
    pub(crate) fn steps(&self) -> u64 {
        self.step.load(Ordering::Relaxed)
    }

    /// An elastic job re-formed (every member calls it, after agreeing on the position `step`;
    /// `joined`: this worker joined under way, its variables the most advanced member's):
    ///
    /// - the members agree on the outer state: where a meeting landed on some members and
    ///   failed on others (a worker was lost during its all-reduce), the member with the most
    ///   meetings hands its global parameters and outer momentum to every member, and a member
    ///   whose exchange failed takes that meeting's result as if it had landed (keeping the
    ///   inner steps it took since it sent it); a joiner takes them as its parameters;
    /// - every fragment still in flight or owed on any member is met again at once, over the
    ///   new membership (the lost worker's outer gradient left out: it costs its inner steps
    ///   since its last meeting, and nothing else), every member then holding its global
    ///   values.
    ///
    /// Writes every copy of `copies`.
    pub(crate) fn rejoin(&self, copies: &[Vec<Var>], joined: bool, step: u64) -> Result<()> {
        let w = &self.workers;
        let me = w.worker_index();
        let mut st = self.state();
        let mut updates = Vec::new();
        // Meetings completed are below 2^24: exact in an f32; a joiner has none.
        let meetings = if joined { -1.0 } else { st.meetings as f32 };
        let all = w.all_gather(&[meetings])?;
        let count = |x: &Vec<f32>| x.first().copied().unwrap_or(-1.0);
        let lead = (0..all.len()).fold(0, |b, r| if count(&all[r]) > count(&all[b]) { r } else { b });
        let most = count(&all[lead]);
        if most < 0.0 {
            return Err(Error::InvalidArgument(
                "every worker of the elastic job joined it under way: none has the global parameters; restart the job"
                    .into(),
            ));
        }
        let contributors = all.iter().filter(|x| count(x) >= 0.0).count().max(1);
        if all.iter().any(|x| count(x) != most) {
            let mut flat: Vec<f32> = Vec::new();
            let len: usize = st.global.iter().map(Vec::len).sum::<usize>() * (1 + usize::from(!st.velocity.is_empty()));
            if me == lead {
                st.global.iter().chain(st.velocity.iter()).for_each(|v| flat.extend(v));
            } else {
                flat.resize(len, 0.0);
            }
            w.broadcast(lead, &mut flat)?;
            if me != lead {
                let old = std::mem::take(&mut st.global);
                let mut at = 0;
                for g in &old {
                    st.global.push(flat[at..at + g.len()].to_vec());
                    at += g.len();
                }
                for v in st.velocity.iter_mut() {
                    let n = v.len();
                    v.copy_from_slice(&flat[at..at + n]);
                    at += n;
                }
                if joined {
                    for (i, g) in st.global.iter().enumerate() {
                        updates.push(Update::Set(i, Arc::new(g.clone())));
                    }
                    st.error.iter_mut().for_each(|e| e.fill(0.0));
                    st.in_flight.clear();
                    st.owed.clear();
                } else {
                    // The exchanges the leader landed: taken as landed, keeping the inner steps
                    // since they were sent (local + (new - old) + own outer gradient).
                    let landed = most as u64;
                    let mut resolved: Vec<(usize, Vec<f32>)> =
                        st.owed.iter().filter(|o| o.seq < landed).map(|o| (o.fragment, o.mine.clone())).collect();
                    resolved
                        .extend(st.in_flight.iter().filter(|f| f.seq < landed).map(|f| (f.fragment, f.mine.clone())));
                    for (fragment, mine) in resolved {
                        let mut at = 0;
                        for i in self.runs[fragment].clone() {
                            let len = old[i].len();
                            updates.push(replay_progress(i, &st.global[i], &old[i], &mine[at..at + len]));
                            at += len;
                        }
                    }
                    st.owed.retain(|o| o.seq >= landed);
                    st.in_flight.retain(|f| f.seq >= landed);
                }
                st.meetings = most as u64;
            }
        }
        for vars in copies {
            apply(vars, &self.shapes, &updates)?;
        }
        // Every fragment still in flight or owed on any member, met again now.
        let fragments = self.runs.len();
        // Per fragment: whether it is in flight or owed here, and when it was last sent (steps
        // below 2^24: exact), so that every member holds the same phase after.
        let mut pending = vec![0f32; 2 * fragments];
        for f in st.in_flight.iter().map(|f| f.fragment).chain(st.owed.iter().map(|o| o.fragment)) {
            pending[f] = 1.0;
        }
        for (f, &at) in st.sent_at.iter().enumerate() {
            pending[fragments + f] = at.min(1 << 24) as f32;
        }
        let masks = w.all_gather(&pending)?;
        for f in 0..fragments {
            let latest = masks.iter().map(|m| m.get(fragments + f).copied().unwrap_or(0.0)).fold(0.0, f32::max);
            st.sent_at[f] = latest as u64;
        }
        st.in_flight.clear();
        st.owed.clear();
        let first = copies.first().map(Vec::as_slice).unwrap_or_default();
        let mut updates = Vec::new();
        for fragment in 0..fragments {
            if !masks.iter().any(|m| m.get(fragment).copied().unwrap_or(0.0) > 0.0) {
                continue;
            }
            let mut sum = Vec::new();
            for i in self.runs[fragment].clone() {
                let local = read(first[i].as_tensor())?;
                sum.extend(st.global[i].iter().zip(&local).map(|(g, l)| g - l));
            }
            st.sent_bytes += 4 * sum.len() as u64;
            w.all_reduce(ReduceOp::Sum, &mut sum)?;
            // The mean over the members that trained (a joiner's outer gradient is zero).
            sum.iter_mut().for_each(|x| *x /= contributors as f32);
            let mut at = 0;
            for i in self.runs[fragment].clone() {
                let len = st.global[i].len();
                self.outer_step(&mut st, i, &sum[at..at + len]);
                updates.push(Update::Set(i, Arc::new(st.global[i].clone())));
                at += len;
            }
            st.sent_at[fragment] = step;
            st.meetings += 1;
        }
        for vars in copies {
            apply(vars, &self.shapes, &updates)?;
        }
        self.step.store(step, Ordering::Relaxed);
        Ok(())
    }

    /// The outer optimizer's step on variable `i`'s global values with the mean outer gradient
    /// `d`.
    fn outer_step(&self, st: &mut State, i: usize, d: &[f32]) {
        match self.cfg.outer {
            OuterOptimizer::Average => st.global[i].iter_mut().zip(d).for_each(|(g, d)| *g -= d),
            OuterOptimizer::Nesterov { lr, momentum } => {
                let State { global, velocity, .. } = st;
                for ((g, v), &d) in global[i].iter_mut().zip(velocity[i].iter_mut()).zip(d) {
                    rules::nesterov(g, v, d, lr, momentum);
                }
            }
        }
    }

    /// Outside a step: every exchange in flight applied, then every fragment that took inner
    /// steps since it was last sent met once more without delay, so that every worker holds
    /// the same (global) parameters. Writes every copy of `copies`.
    pub(crate) fn synchronize(&self, copies: &[Vec<Var>]) -> Result<()> {
        let Some(first) = copies.first() else { return Ok(()) };
        let mut st = self.state();
        let mut updates = Vec::new();
        let step = self.step.load(Ordering::Relaxed);
        while let Some(f) = st.in_flight.pop_front() {
            // Without inner steps since it was sent, every worker takes the global values.
            let kept = step > f.sent;
            updates.extend(self.land(&mut st, f, kept)?);
        }
        for vars in copies {
            apply(vars, &self.shapes, &updates)?;
        }
        let mut updates = Vec::new();
        for fragment in 0..self.runs.len() {
            if st.sent_at[fragment] == step && step > 0 {
                // Met at the last step: every worker already holds its global values.
                continue;
            }
            let flight = self.send(&mut st, first, fragment, 0)?;
            updates.extend(self.land(&mut st, flight, false)?);
        }
        for vars in copies {
            apply(vars, &self.shapes, &updates)?;
        }
        Ok(())
    }
}

/// The names of the outer synchronisation's checkpoint entries begin with this (under the
/// optimizer's own, `optimizer/`).
pub(crate) const PREFIX: &str = "local_sgd/";

/// `v` padded with zeros to `len` values.
fn padded(v: &[f32], len: usize) -> Vec<f32> {
    let mut out = v.to_vec();
    out.resize(len, 0.0);
    out
}

/// Integers as f32 values, exactly: 16 bits a value, four values each.
fn encode_u64s(v: &[u64]) -> Vec<f32> {
    v.iter().flat_map(|x| (0..4).map(move |k| ((x >> (16 * k)) & 0xffff) as f32)).collect()
}

/// [`encode_u64s`]'s integers back.
fn decode_u64s(v: &[f32]) -> Vec<u64> {
    v.chunks(4).map(|c| c.iter().enumerate().fold(0u64, |x, (k, &p)| x | ((p as u64 & 0xffff) << (16 * k)))).collect()
}

/// What a worker adds to variable `i` when an exchange lands after it took inner steps since
/// sending it: the step the global values took (`new - old`) plus its own outer gradient
/// (`own`), so that it holds the new global values with its progress since the send replayed.
fn replay_progress(i: usize, new: &[f32], old: &[f32], own: &[f32]) -> Update {
    Update::Add(i, Arc::new(new.iter().zip(old).zip(own).map(|((new, old), own)| (new - old) + own).collect()))
}

/// A variable's values in f32 on the host.
fn read(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

/// Writes `updates` into `vars`.
fn apply(vars: &[Var], shapes: &[Vec<usize>], updates: &[Update]) -> Result<()> {
    for u in updates {
        let (i, values, add) = match u {
            Update::Set(i, v) => (*i, v, false),
            Update::Add(i, v) => (*i, v, true),
        };
        let var = &vars[i];
        let t = Tensor::from_slice(values.as_slice(), shapes[i].as_slice(), &candle_core::Device::Cpu)?;
        let t =
            if add { (var.as_tensor().to_dtype(DType::F32)?.to_device(&candle_core::Device::Cpu)? + t)? } else { t };
        var.set(&t.to_dtype(var.dtype())?.to_device(var.device())?)?;
    }
    Ok(())
}
