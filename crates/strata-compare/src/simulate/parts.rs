//! The simulator's parts that the strategies' simulations share: the model whose gradients are
//! computed ([`Net`]), the server's values, a worker's stream of batches, a worker's clock, the
//! evaluation and the progress report, and [`SimCore`] over them. It knows neither strategy's
//! schedule (`simulate`'s, `local`'s).

use std::collections::HashMap;

use candle_core::{Device, Tensor, Var, D};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use strata_core::data::Batch;
use strata_core::Replicated;
use strata_transport::ps::ServerOptimizer;

use crate::experiment::Injection;
use crate::sim_config::SimConfig;
use crate::Result;
use strata::digits;
use strata::metrics::MetricRecord;
use strata::model::{Classifier, Mlp};

/// The closed-form communication times of the synchronous strategies (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Network {
    /// Seconds of latency per message.
    pub latency_s: f64,
    /// Bytes per second of every link.
    pub bytes_per_s: f64,
    /// Bytes of the model (and of its gradient).
    pub model_bytes: f64,
}

impl Network {
    /// Seconds of a ring all-reduce over `n` workers: `2(n-1) (L + M / (n B))`.
    pub fn ring_allreduce_s(&self, n: usize) -> f64 {
        self.ring_s(n, self.model_bytes)
    }

    /// Seconds of a ring all-reduce of `bytes` over `n` workers: `2(n-1) (L + bytes / (n B))`.
    pub fn ring_s(&self, n: usize, bytes: f64) -> f64 {
        let n = n as f64;
        2.0 * (n - 1.0) * (self.latency_s + bytes / (n * self.bytes_per_s))
    }

    /// Seconds of a central-storage step's communication over `n` replicas:
    /// `2 (L + n M / B)`.
    pub fn central_storage_s(&self, n: usize) -> f64 {
        2.0 * (self.latency_s + n as f64 * self.model_bytes / self.bytes_per_s)
    }

    /// Seconds of one uncontended parameter-server message (a pull or a push): `L + M / B`.
    pub fn message_s(&self) -> f64 {
        self.latency_s + self.model_bytes / self.bytes_per_s
    }
}

/// Mixes a seed with two keys (SplitMix64), for independent generator streams.
pub(super) fn mix(seed: u64, a: u64, b: u64) -> u64 {
    let mut z = seed ^ a.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ b.wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The candle model whose variables take the values a gradient is computed at.
pub(super) struct Net {
    pub(super) model: Replicated<Mlp>,
    pub(super) vars: Vec<Var>,
}

pub(super) type Params = Vec<Vec<f32>>;

impl Net {
    pub(super) fn load(&self, params: &Params) -> Result<()> {
        for (v, p) in self.vars.iter().zip(params) {
            v.set(&Tensor::from_slice(p, v.shape(), &Device::Cpu)?)?;
        }
        Ok(())
    }

    /// The mean cross-entropy of the training rows `rows` (repeats counted) and its gradient
    /// at `params`. Each distinct row is computed once, weighted by how often it occurs:
    /// candle-nn's `cross_entropy` (log-softmax, the label's entry, the mean) written out with
    /// per-row weights, so a 256-worker round over a 1,438-row training set costs at most
    /// 1,438 rows.
    pub(super) fn gradient(
        &self,
        params: &Params,
        train: &Batch,
        rows: &[usize],
        counts: &mut [u32],
    ) -> Result<(f32, Params)> {
        let mut distinct = Vec::with_capacity(rows.len().min(train.len()));
        for &r in rows {
            if counts[r] == 0 {
                distinct.push(r);
            }
            counts[r] += 1;
        }
        let total = rows.len().max(1) as f32;
        let weights: Vec<f32> = distinct.iter().map(|&r| counts[r] as f32 / total).collect();
        for &r in &distinct {
            counts[r] = 0;
        }
        let batch = digits::gather(train, &distinct);
        self.load(params)?;
        let x = batch.features_tensor(&Device::Cpu)?;
        let y = batch.labels_tensor(&Device::Cpu)?;
        let w = Tensor::from_vec(weights, distinct.len(), &Device::Cpu)?;
        let logits = self.model.primary().logits(&x)?;
        let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        let picked = logp.gather(&y.unsqueeze(1)?, 1)?.squeeze(1)?;
        let loss = picked.mul(&w)?.sum_all()?.neg()?;
        let grads = loss.backward()?;
        let g = self
            .vars
            .iter()
            .map(|v| match grads.get(v.as_tensor()) {
                Some(g) => Ok(g.flatten_all()?.to_vec1::<f32>()?),
                None => Ok(vec![0.0; v.elem_count()]),
            })
            .collect::<Result<Params>>()?;
        Ok((loss.to_scalar::<f32>()?, g))
    }
}

/// The parameters (the server's values) and the optimizer's slots.
#[derive(Clone)]
pub(super) struct Server {
    pub(super) params: Params,
    pub(super) slots: Vec<Vec<Vec<f32>>>,
    pub(super) version: u64,
}

impl Server {
    pub(super) fn new(params: Params, opt: &ServerOptimizer) -> Self {
        let start = match *opt {
            ServerOptimizer::Adagrad { initial_accumulator, .. } => initial_accumulator as f32,
            _ => 0.0,
        };
        let slots = params.iter().map(|p| vec![vec![start; p.len()]; opt.slots()]).collect();
        Self { params, slots, version: 0 }
    }

    pub(super) fn apply(&mut self, opt: &ServerOptimizer, grad: &Params) {
        self.version += 1;
        for ((w, g), slots) in self.params.iter_mut().zip(grad).zip(&mut self.slots) {
            let mut refs: Vec<&mut [f32]> = slots.iter_mut().map(Vec::as_mut_slice).collect();
            opt.apply(w, g, &mut refs, self.version);
        }
    }
}

/// One worker's batches: its own seeded shuffle of the training rows, reshuffled per epoch.
#[derive(Clone)]
pub(super) struct Stream {
    pub(super) rng: ChaCha8Rng,
    pub(super) perm: Vec<usize>,
    pub(super) pos: usize,
}

impl Stream {
    pub(super) fn new(seed: u64, worker: usize, rows: usize) -> Self {
        let mut s =
            Self { rng: ChaCha8Rng::seed_from_u64(mix(seed, worker as u64, 1)), perm: (0..rows).collect(), pos: 0 };
        s.perm.shuffle(&mut s.rng);
        s
    }

    pub(super) fn next_into(&mut self, size: usize, out: &mut Vec<usize>) {
        for _ in 0..size {
            if self.pos == self.perm.len() {
                self.perm.shuffle(&mut self.rng);
                self.pos = 0;
            }
            out.push(self.perm[self.pos]);
            self.pos += 1;
        }
    }
}

/// Compute times of every worker's steps.
pub(super) struct Clock {
    pub(super) compute_s: f64,
    pub(super) factors: Vec<f64>,
    pub(super) injection: Injection,
    pub(super) rngs: Vec<ChaCha8Rng>,
}

impl Clock {
    pub(super) fn new(cfg: &SimConfig, injection: &Injection, seed: u64, n: usize) -> Self {
        Self {
            compute_s: cfg.compute_ms * 1e-3,
            factors: (0..n).map(|w| injection.factor(w)).collect(),
            injection: injection.clone(),
            rngs: (0..n).map(|w| ChaCha8Rng::seed_from_u64(mix(seed, w as u64, 2))).collect(),
        }
    }

    /// Seconds of worker `w`'s next step.
    pub(super) fn step_s(&mut self, w: usize) -> f64 {
        let mut t = self.compute_s * self.factors[w];
        if let Some(s) = &self.injection.stragglers {
            let rng = &mut self.rngs[w];
            if rng.random::<f64>() < s.probability {
                t += s.delay.sample(rng.random::<f64>()).as_secs_f64();
            }
        }
        t
    }
}

/// The parameter-server links: every task's link sees the same traffic (each message is split
/// evenly over the tasks), so one FIFO stands for all of them.
pub(super) struct PsLink {
    pub(super) free: f64,
    pub(super) latency_s: f64,
    pub(super) shard_s: f64,
    pub(super) whole_s: f64,
}

impl PsLink {
    pub(super) fn new(network: &Network, ps_tasks: usize) -> Self {
        let whole_s = network.model_bytes / network.bytes_per_s;
        Self { free: 0.0, latency_s: network.latency_s, shard_s: whole_s / ps_tasks.max(1) as f64, whole_s }
    }

    /// Delivery time of a message sent at `t` (messages must be sent in time order).
    pub(super) fn send(&mut self, t: f64) -> f64 {
        let arrive = t + self.latency_s;
        let start = arrive.max(self.free);
        self.free = start + self.shard_s;
        self.free.max(arrive + self.whole_s)
    }
}

/// Synchronous training state: the server and every worker's batches.
pub(super) struct SyncState {
    pub(super) server: Server,
    pub(super) streams: Vec<Stream>,
    pub(super) rows: Vec<usize>,
    pub(super) counts: Vec<u32>,
    pub(super) per_worker: usize,
}

impl SyncState {
    /// One round: every worker draws its batch, those in `applied` contribute to the mean
    /// gradient, which is applied. Returns the applied batches' mean loss.
    pub(super) fn round(&mut self, sim: &SimCore<'_>, applied: &[bool]) -> Result<f32> {
        self.rows.clear();
        let mut scratch = Vec::with_capacity(self.per_worker);
        for (stream, &used) in self.streams.iter_mut().zip(applied) {
            scratch.clear();
            stream.next_into(self.per_worker, &mut scratch);
            if used {
                self.rows.extend_from_slice(&scratch);
            }
        }
        let (loss, g) = sim.net.gradient(&self.server.params, sim.train, &self.rows, &mut self.counts)?;
        self.server.apply(sim.opt, &g);
        Ok(loss)
    }
}

/// The shared trajectory of the plain synchronous strategies at one worker count.
pub(super) struct SyncTrajectory {
    pub(super) state: SyncState,
    /// Loss of round `i` (update `i + 1`).
    pub(super) losses: Vec<f32>,
    /// Accuracy after the update that is the key.
    pub(super) accuracy: HashMap<u64, Evaluation>,
}

/// The borrowed parts every run needs.
pub(super) struct SimCore<'a> {
    pub(super) cfg: &'a SimConfig,
    pub(super) net: &'a Net,
    pub(super) train: &'a Batch,
    pub(super) test_x: &'a Tensor,
    pub(super) test_y: &'a Tensor,
    pub(super) test_len: usize,
    pub(super) opt: &'a ServerOptimizer,
}

impl SimCore<'_> {
    /// Test accuracy and test loss at `params`.
    pub(super) fn accuracy(&self, params: &Params) -> Result<Evaluation> {
        self.net.load(params)?;
        let model = self.net.model.primary();
        let correct = model.correct(self.test_x, self.test_y)?;
        let logits = model.logits(self.test_x)?;
        let loss = candle_nn::loss::cross_entropy(&logits, self.test_y)?.to_scalar::<f32>()?;
        Ok(Evaluation { accuracy: correct as f32 / self.test_len.max(1) as f32, loss })
    }

    pub(super) fn evaluates(&self, updates: u64) -> bool {
        updates.is_multiple_of(self.cfg.eval_every_updates) || updates == self.cfg.max_updates
    }

    pub(super) fn sync_state(&self, server: Server, seed: u64, n: usize) -> SyncState {
        SyncState {
            server,
            streams: (0..n).map(|w| Stream::new(seed, w, self.train.len())).collect(),
            rows: Vec::new(),
            counts: vec![0; self.train.len()],
            per_worker: self.cfg.per_worker_batch,
        }
    }
}

/// An evaluation on the test split.
#[derive(Clone, Copy, Debug)]
pub(super) struct Evaluation {
    pub(super) accuracy: f32,
    /// Mean cross-entropy, nats.
    pub(super) loss: f32,
}

impl Evaluation {
    pub(super) fn record(self, steps: u64, updates: u64, t: f64, examples: u64) -> MetricRecord {
        let mut r = MetricRecord::eval(steps, updates, t, examples, self.accuracy);
        r.validation_loss = Some(self.loss);
        r
    }
}

/// Calls `progress` when the fraction has moved on by a percent.
pub(super) struct Progress<'a> {
    pub(super) name: &'a str,
    pub(super) f: &'a dyn Fn(&str, f64),
    pub(super) last: f64,
}

impl Progress<'_> {
    pub(super) fn update(&mut self, fraction: f64) {
        let fraction = fraction.clamp(0.0, 1.0);
        if fraction >= self.last + 0.01 {
            self.last = fraction;
            (self.f)(self.name, fraction);
        }
    }
}
