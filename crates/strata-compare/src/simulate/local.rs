//! Local SGD and DiLoCo in virtual time (a run with `sync_every` above 1).
//!
//! **Learning.** Every worker holds its own copy of the MLP and its own inner optimizer (the
//! simulator's optimizer, its slots and step count the worker's own) and steps on its own
//! batches (the same stream of batches worker `w` draws under every strategy). The meetings
//! follow [`LocalSgd::meeting`]: after inner step `s`, exchanges due at `s` land first, then
//! the fragment met at `s` (if any) is sent: every worker's outer gradient `global - local` of
//! the fragment's variables ([`fragment_runs`] over the MLP's variables). When it lands, the
//! mean of the workers' outer gradients goes through the outer optimizer (averaging:
//! `global -= d`; Nesterov: [`rules::nesterov`] per value, PyTorch's form, from a velocity of
//! zero) and each worker takes the new global values (no delay) or adds the step the global
//! values took plus its own outer gradient (delay: the progress made meanwhile kept). After
//! the last step the exchanges in flight land and every fragment not met at that step meets
//! once more, so every worker ends on the global parameters, as `strata train` does. This is
//! the algorithm of `strata_core::local_sgd`, on the simulator's model. The wire's rounding
//! (fp16, bf16, int8) is not modelled: the outer gradients are summed in f32, only their bytes
//! follow the wire.
//!
//! The learning does not depend on time (every exchange lands at a fixed step), so it is
//! computed once per worker count and setting and shared by every link rate.
//!
//! **Time.** Each worker has its own clock: a step adds its compute time (slowdowns and
//! stragglers included). A meeting's ring all-reduce of the fragment's bytes starts when the
//! last worker has finished the step (and the previous exchange has left the link) and takes
//! `2(n-1)(L + bytes / (n B))`; without delay every worker waits for it, with a delay of `D`
//! steps it runs while the inner steps go on and a worker that reaches step `s + D` before it
//! has landed waits for it. A step's record is written when its slowest worker has finished
//! it.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;

use strata::metrics::MetricRecord;
use strata_core::local_sgd::{fragment_runs, LocalSgd, OuterOptimizer};
use strata_core::optim::rules;

use super::parts::{Clock, Evaluation, Params, Progress, Server, SimCore, Stream};
use crate::Result;

/// What a local-SGD run learned, round by round (independent of time).
pub(super) struct LocalTrajectory {
    /// The workers' mean batch loss of inner step `i + 1`.
    losses: Vec<f32>,
    /// Worker 0's evaluation after the inner step that is the key (after the final
    /// synchronisation at the last one).
    evals: HashMap<u64, Evaluation>,
}

impl LocalTrajectory {
    /// No learning: `rounds` losses of 0 and no evaluation (the clock alone).
    pub(super) fn clock_only(rounds: u64) -> Self {
        Self { losses: vec![0.0; rounds as usize], evals: HashMap::new() }
    }
}

/// An exchange in flight: the workers' outer gradients of a fragment, by worker.
struct Flight {
    fragment: usize,
    sent: u64,
    due: u64,
    mine: Vec<Vec<f32>>,
}

/// The global parameters and the outer optimizer's state.
struct Outer<'a> {
    cfg: &'a LocalSgd,
    runs: Vec<Range<usize>>,
    global: Params,
    velocity: Params,
}

impl Outer<'_> {
    /// Every worker's outer gradient of `fragment`: `global - local`, its variables in a row.
    fn send(&self, workers: &[Server], fragment: usize) -> Vec<Vec<f32>> {
        workers
            .iter()
            .map(|w| {
                self.runs[fragment]
                    .clone()
                    .flat_map(|i| self.global[i].iter().zip(&w.params[i]).map(|(g, l)| g - l))
                    .collect()
            })
            .collect()
    }

    /// The mean of `mine` through the outer optimizer; every worker takes the new global
    /// values (`kept: false`) or adds their step plus its own outer gradient.
    fn land(&mut self, workers: &mut [Server], fragment: usize, mine: &[Vec<f32>], kept: bool) {
        let n = mine.len().max(1) as f32;
        let mut at = 0;
        for i in self.runs[fragment].clone() {
            let len = self.global[i].len();
            let mean: Vec<f32> = (0..len).map(|k| mine.iter().map(|m| m[at + k]).sum::<f32>() / n).collect();
            let before = kept.then(|| self.global[i].clone());
            match self.cfg.outer {
                OuterOptimizer::Average => self.global[i].iter_mut().zip(&mean).for_each(|(g, d)| *g -= d),
                OuterOptimizer::Nesterov { lr, momentum } => {
                    for ((g, v), &d) in self.global[i].iter_mut().zip(self.velocity[i].iter_mut()).zip(&mean) {
                        rules::nesterov(g, v, d, lr, momentum);
                    }
                }
            }
            for (w, own) in workers.iter_mut().zip(mine) {
                match &before {
                    None => w.params[i].copy_from_slice(&self.global[i]),
                    Some(old) => {
                        for (k, l) in w.params[i].iter_mut().enumerate() {
                            *l += (self.global[i][k] - old[k]) + own[at + k];
                        }
                    }
                }
            }
            at += len;
        }
    }
}

/// The learning of `cfg` over `n` workers from `initial`, through `max_updates` inner steps.
pub(super) fn trajectory(
    core: &SimCore<'_>,
    initial: &Params,
    seed: u64,
    n: usize,
    cfg: &LocalSgd,
    progress: &mut Progress<'_>,
) -> Result<LocalTrajectory> {
    let sizes: Vec<usize> = initial.iter().map(Vec::len).collect();
    let fragments = cfg.fragments.clamp(1, sizes.len());
    let velocity = match cfg.outer {
        OuterOptimizer::Nesterov { .. } => sizes.iter().map(|&s| vec![0.0; s]).collect(),
        OuterOptimizer::Average => Vec::new(),
    };
    let mut outer = Outer { cfg, runs: fragment_runs(&sizes, fragments), global: initial.clone(), velocity };
    let mut workers: Vec<Server> = (0..n).map(|_| Server::new(initial.clone(), core.opt)).collect();
    let mut streams: Vec<Stream> = (0..n).map(|w| Stream::new(seed, w, core.train.len())).collect();
    let mut counts = vec![0u32; core.train.len()];
    let mut rows = Vec::with_capacity(core.cfg.per_worker_batch);
    let mut in_flight: VecDeque<Flight> = VecDeque::new();
    let mut sent_at = vec![0u64; fragments];
    let delay = cfg.delay();
    let last = core.cfg.max_updates;
    let mut out = LocalTrajectory { losses: Vec::with_capacity(last as usize), evals: HashMap::new() };
    for s in 1..=last {
        let mut sum = 0.0;
        for (w, stream) in workers.iter_mut().zip(&mut streams) {
            rows.clear();
            stream.next_into(core.cfg.per_worker_batch, &mut rows);
            let (loss, g) = core.net.gradient(&w.params, core.train, &rows, &mut counts)?;
            w.apply(core.opt, &g);
            sum += loss;
        }
        out.losses.push(sum / n as f32);
        while in_flight.front().is_some_and(|f| f.due <= s) {
            let f = in_flight.pop_front().expect("checked above");
            outer.land(&mut workers, f.fragment, &f.mine, true);
        }
        if let Some(fragment) = cfg.meeting(s).filter(|&f| f < fragments) {
            let mine = outer.send(&workers, fragment);
            sent_at[fragment] = s;
            if delay == 0 {
                outer.land(&mut workers, fragment, &mine, false);
            } else {
                in_flight.push_back(Flight { fragment, sent: s, due: s + delay, mine });
            }
        }
        if s == last {
            while let Some(f) = in_flight.pop_front() {
                outer.land(&mut workers, f.fragment, &f.mine, s > f.sent);
            }
            for (fragment, &sent) in sent_at.iter().enumerate() {
                if sent != s {
                    let mine = outer.send(&workers, fragment);
                    outer.land(&mut workers, fragment, &mine, false);
                }
            }
        }
        if core.evaluates(s) {
            out.evals.insert(s, core.accuracy(&workers[0].params)?);
        }
        progress.update(s as f64 / last as f64);
    }
    Ok(out)
}

/// The bytes of each fragment's outer gradient on the wire: `total` (the whole model's, on
/// the run's wire) split as the fragments' variables split it, or in `F` equal parts when the
/// time model sends another model's bytes (`equal`).
pub(super) fn fragment_bytes(cfg: &LocalSgd, shapes: &[Vec<usize>], total: f64, equal: bool) -> Vec<f64> {
    let sizes: Vec<usize> = shapes.iter().map(|s| s.iter().product()).collect();
    let fragments = cfg.fragments.clamp(1, sizes.len().max(1));
    if equal || sizes.is_empty() {
        return vec![total / fragments as f64; fragments];
    }
    let per_var: Vec<f64> = shapes.iter().map(|s| cfg.wire.wire_bytes(s) as f64).collect();
    let all: f64 = per_var.iter().sum::<f64>().max(1.0);
    fragment_runs(&sizes, fragments).into_iter().map(|r| total * per_var[r].iter().sum::<f64>() / all).collect()
}

/// The records of a local-SGD run of `traj` over `n` workers: one step record per inner step
/// (its loss the workers' mean, its bytes every worker's sends at a meeting), an evaluation
/// where the trajectory has one; and the run's end.
#[allow(clippy::too_many_arguments)]
pub(super) fn timeline(
    traj: &LocalTrajectory,
    cfg: &LocalSgd,
    sim: &super::SimConfig,
    mut clock: Clock,
    ring_s: &dyn Fn(f64) -> f64,
    frag_bytes: &[f64],
    n: usize,
) -> (Vec<MetricRecord>, f64) {
    let b = sim.per_worker_batch as u64;
    let nu = n as u64;
    let sent_by_all = |bytes: f64| (2.0 * (n as f64 - 1.0) * bytes).round() as u64;
    let delay = cfg.delay();
    let fragments = frag_bytes.len();
    let mut t = vec![0.0f64; n];
    // Exchanges in flight: (due step, when it lands).
    let mut flying: VecDeque<(u64, f64)> = VecDeque::new();
    let mut link_free = 0.0f64;
    let mut sent_at = vec![0u64; fragments];
    let mut records = Vec::new();
    let mut end = 0.0f64;
    for s in 1..=traj.losses.len() as u64 {
        for (w, tw) in t.iter_mut().enumerate() {
            *tw += clock.step_s(w);
        }
        while flying.front().is_some_and(|f| f.0 <= s) {
            let (_, lands) = flying.pop_front().expect("checked above");
            t.iter_mut().for_each(|tw| *tw = tw.max(lands));
        }
        let mut sent = 0u64;
        if let Some(fragment) = cfg.meeting(s).filter(|&f| f < fragments) {
            let start = t.iter().copied().fold(link_free, f64::max);
            let lands = start + ring_s(frag_bytes[fragment]);
            link_free = lands;
            sent = sent_by_all(frag_bytes[fragment]);
            sent_at[fragment] = s;
            if delay == 0 {
                t.iter_mut().for_each(|tw| *tw = lands);
            } else {
                flying.push_back((s + delay, lands));
            }
        }
        let step_end = t.iter().copied().fold(0.0, f64::max);
        if sim.max_virtual_s.is_some_and(|cap| step_end > cap) {
            break;
        }
        end = step_end;
        let mut eval_at = step_end;
        let last = s == sim.max_updates;
        if last {
            // The final synchronisation: what is in flight lands, every fragment not met at
            // this step meets once more, everyone waiting.
            let mut now = flying.drain(..).fold(step_end, |a, (_, lands)| a.max(lands)).max(link_free);
            for (fragment, bytes) in frag_bytes.iter().enumerate() {
                if sent_at[fragment] != s {
                    now += ring_s(*bytes);
                    sent += sent_by_all(*bytes);
                }
            }
            eval_at = now;
            end = now;
        }
        let mut r = MetricRecord::step(s, s, step_end, s * nu * b, traj.losses[s as usize - 1]);
        r.bytes_sent = sent;
        r.bytes_received = sent;
        records.push(r);
        if let Some(e) = traj.evals.get(&s) {
            records.push(e.record(s, s, eval_at, s * nu * b));
        }
    }
    (records, end)
}
