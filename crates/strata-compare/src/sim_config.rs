//! Simulated mode's settings ([`SimConfig`], the experiment file's `[simulate]` table) and
//! their checks; what a simulated run does with them is [`crate::simulate`]'s.

use serde::{Deserialize, Serialize};
use strata::model::Mlp;
use strata::{digits, OptimizerKind};
use strata_core::cross_device::compression::Compression;

/// The most workers one simulated run may have.
pub const MAX_WORKERS: usize = 4096;

/// Simulated mode's settings (the experiment file's `[simulate]` table). Every field is
/// optional; [`SimConfig::default`] holds the defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimConfig {
    /// The worker counts to sweep: every run of the experiment (but one-device, which runs
    /// with one) is simulated once per count. Default `[1, 2, 4, ..., 256]`.
    #[serde(default = "default_workers")]
    pub workers: Vec<usize>,
    /// Examples in one worker's batch (a run's global batch is `workers` times this).
    /// Default 32.
    #[serde(default = "default_per_worker_batch")]
    pub per_worker_batch: usize,
    /// Hidden layer sizes of the simulated MLP (64 inputs, 10 classes). Default `[32]`.
    #[serde(default = "default_hidden")]
    pub hidden: Vec<usize>,
    /// Modelled milliseconds of one worker step (one gradient on its batch), before slowdown
    /// and stragglers. Default 10.
    #[serde(default = "default_compute_ms")]
    pub compute_ms: f64,
    /// Bandwidth of every link, in gigabits per second. Default 10.
    #[serde(default = "default_bandwidth_gbps")]
    pub bandwidth_gbps: f64,
    /// The share of a synchronous step's compute that its all-reduce can run behind
    /// (overlap with the backward pass), in [0, 1): a ring step takes
    /// `compute + max(0, all-reduce - overlap x compute)`. Default 0: no overlap. The hosts
    /// benchmark (`scripts/bench/hosts.sh`) fits it to a model's measured runs and prints the
    /// value: 0.60 for the 4.3M MLP with its weight's gradient in blocks of rows (2 hosts, 1
    /// Gbit/s), within 2% of every shaped run.
    #[serde(default)]
    pub overlap: f64,
    /// Latency of every message, in microseconds (the injection's `network_delay` is added).
    /// Default 50.
    #[serde(default = "default_latency_us")]
    pub latency_us: f64,
    /// Updates after which a run stops. Default 600.
    #[serde(default = "default_max_updates")]
    pub max_updates: u64,
    /// Virtual seconds after which a run stops (no update is applied later); default none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_virtual_s: Option<f64>,
    /// An evaluation on the test set every this many updates. Default 10.
    #[serde(default = "default_eval_every_updates")]
    pub eval_every_updates: u64,
    /// Seed of initialisation, data order and stragglers (default: the experiment's seed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Optimizer (a `strata train --optimizer` name; default: the experiment's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<String>,
    /// Learning rate (default: the experiment's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    /// Parameters the time model sends (every message's bytes are this model's, e.g. 816705
    /// for the default transformer), while the learning stays the simulated MLP's; default:
    /// the MLP's own. Compressed messages keep the MLP's ratio of compressed to f32 bytes, and
    /// a local-SGD fragment carries `1 / fragments` of the bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wire_parameters: Option<u64>,
    /// The simulated runs' target: a test-set cross-entropy in nats (the MLP's validation
    /// loss), instead of the experiment's target; `--extrapolate` needs it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_loss: Option<f64>,
    /// The link rates `strata compare --simulate --extrapolate` sweeps, in gigabits per
    /// second. Default `[0.01, 0.1, 1, 10]` (10 Mbit/s to 10 Gbit/s).
    #[serde(default = "default_links_gbps")]
    pub links_gbps: Vec<f64>,
}

fn default_links_gbps() -> Vec<f64> {
    vec![0.01, 0.1, 1.0, 10.0]
}

fn default_workers() -> Vec<usize> {
    vec![1, 2, 4, 8, 16, 32, 64, 128, 256]
}
fn default_per_worker_batch() -> usize {
    32
}
fn default_hidden() -> Vec<usize> {
    vec![32]
}
fn default_compute_ms() -> f64 {
    10.0
}
fn default_bandwidth_gbps() -> f64 {
    10.0
}
fn default_latency_us() -> f64 {
    50.0
}
fn default_max_updates() -> u64 {
    600
}
fn default_eval_every_updates() -> u64 {
    10
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            workers: default_workers(),
            per_worker_batch: default_per_worker_batch(),
            hidden: default_hidden(),
            compute_ms: default_compute_ms(),
            bandwidth_gbps: default_bandwidth_gbps(),
            overlap: 0.0,
            latency_us: default_latency_us(),
            max_updates: default_max_updates(),
            max_virtual_s: None,
            eval_every_updates: default_eval_every_updates(),
            seed: None,
            optimizer: None,
            lr: None,
            wire_parameters: None,
            target_loss: None,
            links_gbps: default_links_gbps(),
        }
    }
}

impl SimConfig {
    /// Checks the values; the message names the field and says what to write instead.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.workers.is_empty() {
            return Err("workers must list at least one worker count, e.g. [1, 4, 16]".into());
        }
        if let Some(&n) = self.workers.iter().find(|&&n| n == 0) {
            return Err(format!("workers must be at least 1, not {n}"));
        }
        if let Some(&n) = self.workers.iter().find(|&&n| n > MAX_WORKERS) {
            return Err(format!("workers must be at most {MAX_WORKERS}, not {n}"));
        }
        if self.per_worker_batch == 0 {
            return Err("per_worker_batch must be at least 1".into());
        }
        if self.hidden.contains(&0) {
            return Err("hidden layer sizes must be at least 1".into());
        }
        let positive = |what: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(format!("{what} must be a number above 0, not {}", v.to_string().to_lowercase()))
            }
        };
        positive("compute_ms", self.compute_ms)?;
        positive("bandwidth_gbps", self.bandwidth_gbps)?;
        if !(self.overlap.is_finite() && (0.0..1.0).contains(&self.overlap)) {
            let v = self.overlap.to_string().to_lowercase();
            return Err(format!("overlap must be a share of the step in [0, 1), e.g. 0.3, not {v}"));
        }
        if !(self.latency_us.is_finite() && self.latency_us >= 0.0) {
            let v = self.latency_us.to_string().to_lowercase();
            return Err(format!("latency_us must be a number of 0 or more, not {v}"));
        }
        if self.max_updates == 0 {
            return Err("max_updates must be at least 1".into());
        }
        if let Some(s) = self.max_virtual_s {
            positive("max_virtual_s", s)?;
        }
        if self.eval_every_updates == 0 {
            return Err("eval_every_updates must be at least 1".into());
        }
        if let Some(o) = &self.optimizer {
            optimizer_kind(o)?;
        }
        if let Some(lr) = self.lr {
            positive("lr", lr)?;
        }
        if self.wire_parameters == Some(0) {
            return Err("wire_parameters must be at least 1, e.g. 816705 (the default transformer)".into());
        }
        if let Some(t) = self.target_loss {
            positive("target_loss", t)?;
        }
        if self.links_gbps.is_empty() {
            return Err("links_gbps must list at least one link rate, e.g. [0.01, 0.1, 1, 10]".into());
        }
        for &g in &self.links_gbps {
            positive("links_gbps", g)?;
        }
        Ok(())
    }

    /// The simulated model's bytes (4 per parameter, [`SimConfig::wire_parameters`] if set),
    /// what every message carries.
    pub fn model_bytes(&self) -> u64 {
        4 * self.wire_parameters.unwrap_or(self.mlp_parameters())
    }

    /// Parameters of the simulated MLP.
    pub fn mlp_parameters(&self) -> u64 {
        Mlp::parameter_count(digits::FEATURES, &self.hidden, digits::CLASSES) as u64
    }

    /// How many times the MLP's bytes every message carries: `wire_parameters` over the MLP's
    /// parameters (1 without it).
    pub fn wire_scale(&self) -> f64 {
        self.wire_parameters.map_or(1.0, |p| p as f64 / self.mlp_parameters() as f64)
    }

    /// The bytes one gradient (or parameter) message of the simulated model carries under
    /// `compression`: each variable's [`Compression::wire_bytes`] (weights `out x in`, biases
    /// `out`), so PowerSGD compresses the weights that shrink at its rank and 16 bits halve
    /// everything (with [`SimConfig::wire_parameters`], scaled to that model). `none` is
    /// [`SimConfig::model_bytes`].
    pub fn wire_bytes(&self, compression: Compression) -> u64 {
        let mut dims = vec![digits::FEATURES];
        dims.extend(&self.hidden);
        dims.push(digits::CLASSES);
        let mlp: u64 = dims
            .windows(2)
            .map(|w| (compression.wire_bytes(&[w[1], w[0]]) + compression.wire_bytes(&[w[1]])) as u64)
            .sum();
        match self.wire_parameters {
            None => mlp,
            Some(_) => (mlp as f64 * self.wire_scale()).round() as u64,
        }
    }
}

/// The optimizer kind of `name` (any case), or a message that lists the known ones.
pub(crate) fn optimizer_kind(name: &str) -> std::result::Result<OptimizerKind, String> {
    name.to_ascii_lowercase().parse::<OptimizerKind>().map_err(|_| {
        format!("optimizer {name:?} is not known; write adamw, sgd, candle-adamw, candle-sgd, momentum or adagrad")
    })
}
