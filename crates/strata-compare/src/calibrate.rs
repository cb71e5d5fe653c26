//! The simulator's time model against measured runs: the slow-links records of
//! `scripts/bench/slow-links.sh --save` (`docs/bench/slow-links-*.json`: tokens/s of per-step
//! sync, DiLoCo, int8 outer gradients and streaming fragments on emulated hosts).
//!
//! The model takes three figures from the records and predicts every other row by running the
//! simulator's clock ([`crate::simulate::simulate_clock`]: the times of
//! [`crate::simulate::simulate`], without the learning they do not depend on) on the record's
//! hosts, link, steps and settings, with [`SimConfig::wire_parameters`] the record's parameter
//! count:
//!
//! - **compute per step**: from an unshaped DiLoCo run (`diloco:H`, f32, one fragment): its
//!   step time less its meetings' ring all-reduces at the link's measured goodput. The same
//!   figure serves every host count: each step is the same global batch on the same machine's
//!   cores, whichever hosts split it.
//! - **link rate**: the shaped link's rate (`50mbit`: 50 Mbit/s), the measured TCP goodput
//!   for `unshaped`.
//! - **overlap** ([`SimConfig::overlap`]): fitted to the shaped per-step run whose all-reduce
//!   is nearest its compute time (where it matters most): the share of the compute that hides
//!   the all-reduce. That row agrees by construction.
//!
//! Per-step sync on unshaped links is outside the model: there the ring is not waiting for the
//! link but for the CPU (every host's process shares the same cores, and the ring's copies and
//! sums take their time), which the model does not charge. Those rows are reported, not
//! claimed.
//!
//! A prediction is the simulated run's tokens per second over the steps the trainer counts as
//! steady state (the 4th to the last), as `strata train` measures them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use strata::metrics::RecordKind;
use strata_core::cross_device::compression::Compression;

use crate::experiment::{Experiment, Injection, RunModel, RunSpec, RunStrategy};
use crate::simulate::{simulate_clock, Network, SimConfig};
use crate::Result;

/// Steps at the start of a run that `strata train` leaves out of its steady-state throughput.
pub const WARMUP_STEPS: u64 = 3;
/// Latency of a message between two emulated hosts (one bridge, no added delay), seconds.
pub const HOST_LATENCY_US: f64 = 50.0;

/// A slow-links record (`--save` of `scripts/bench/slow-links.sh`).
#[derive(Clone, Debug, Deserialize)]
pub struct BenchRecord {
    /// When it started.
    pub started: String,
    /// The record's header lines (the command, the machine, the model, the measured goodput).
    pub header: Vec<String>,
    /// Emulated hosts, one worker each.
    pub hosts: usize,
    /// Links measured (`50mbit`, `1gbit`, `unshaped`).
    pub links: Vec<String>,
    /// Configurations (`sync`, `diloco:H`, `diloco:H:int8`, `streaming:H:F`, `torch-...`).
    pub configs: Vec<String>,
    /// Steps of a run.
    pub steps: u64,
    /// Per round, `link|config` to what it measured.
    pub rounds: Vec<BTreeMap<String, Measured>>,
}

/// One run of a record.
#[derive(Clone, Copy, Debug, Deserialize)]
pub struct Measured {
    /// Tokens per second in steady state.
    pub rate: f64,
    /// Steps it ran.
    pub steps: u64,
    /// Parameters of the model.
    pub parameters: u64,
}

/// Why a calibration cannot run.
#[derive(Debug, thiserror::Error)]
pub enum CalibrationError {
    /// The record cannot be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The record is not a slow-links record.
    #[error("{path} is not a slow-links record ({reason}): write one with scripts/bench/slow-links.sh --save")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// No run gives the compute time.
    #[error("no unshaped diloco run in the records gives the compute time: add one (slow-links.sh --links unshaped --configs diloco:100)")]
    NoComputeRun,
    /// No run gives the overlap.
    #[error(
        "no shaped per-step sync run in the records to fit the overlap to: add one (slow-links.sh --configs sync)"
    )]
    NoOverlapRun,
    /// A link name the model does not know.
    #[error("link {0:?} has no rate: name shaped links NNmbit or NNgbit, and record the goodput of unshaped ones")]
    Link(String),
    /// A header without the batch's shape.
    #[error("the record's header does not say its global batch (\"N windows of M tokens\"): add it")]
    NoBatch,
}

impl From<CalibrationError> for crate::Error {
    fn from(e: CalibrationError) -> Self {
        crate::Error::Usage(e.to_string())
    }
}

/// What a row is to the calibration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Predicted from the three figures.
    Predicted,
    /// The compute time was taken from it.
    ComputeSource,
    /// The overlap was fitted to it.
    OverlapSource,
    /// Per-step sync on an unshaped link: CPU-bound, outside the model.
    OutsideModel,
}

/// One measured run and the simulator's prediction of it.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// Emulated hosts.
    pub hosts: usize,
    /// The link.
    pub link: String,
    /// The configuration.
    pub config: String,
    /// Median tokens/s measured.
    pub measured: f64,
    /// Tokens/s the simulator predicts.
    pub predicted: f64,
    /// `predicted / measured - 1`.
    pub error: f64,
    /// What the row is to the calibration.
    pub role: Role,
}

/// The calibrated figures and every row.
#[derive(Clone, Debug, Serialize)]
pub struct Calibration {
    /// Compute seconds of one step.
    pub compute_s: f64,
    /// The share of the compute that hides a per-step all-reduce.
    pub overlap: f64,
    /// Parameters of the model (what crosses the links: 4 bytes each in f32).
    pub parameters: u64,
    /// Tokens of a global batch.
    pub tokens_per_step: f64,
    /// Every Strata row of the records.
    pub rows: Vec<Row>,
}

impl Calibration {
    /// The rows the model claims (predicted ones), and the largest error among them.
    pub fn worst_predicted(&self) -> Option<&Row> {
        self.rows.iter().filter(|r| r.role == Role::Predicted).max_by(|a, b| a.error.abs().total_cmp(&b.error.abs()))
    }

    /// A markdown table of every row.
    pub fn table(&self) -> String {
        let mut out = String::from(
            "| hosts | link | configuration | measured tokens/s | predicted tokens/s | error | row |\n|--:|---|---|--:|--:|--:|---|\n",
        );
        for r in &self.rows {
            let role = match r.role {
                Role::Predicted => "predicted",
                Role::ComputeSource => "compute time taken from it",
                Role::OverlapSource => "overlap fitted to it",
                Role::OutsideModel => "outside the model (CPU-bound ring)",
            };
            out.push_str(&format!(
                "| {} | {} | {} | {} | {} | {:+.1}% | {role} |\n",
                r.hosts,
                r.link,
                r.config,
                crate::plot::group_thousands(r.measured),
                crate::plot::group_thousands(r.predicted),
                r.error * 100.0
            ));
        }
        out
    }
}

/// Reads a record.
pub fn load(path: &Path) -> std::result::Result<BenchRecord, CalibrationError> {
    let text =
        std::fs::read_to_string(path).map_err(|source| CalibrationError::Read { path: path.to_path_buf(), source })?;
    serde_json::from_str(&text).map_err(|e| CalibrationError::Parse { path: path.to_path_buf(), reason: e.to_string() })
}

/// A Strata configuration of a record.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Config {
    Sync,
    Local { every: u64, fragments: usize, wire: Compression },
}

fn parse_config(c: &str) -> Option<Config> {
    let parts: Vec<&str> = c.split(':').collect();
    match parts.as_slice() {
        ["sync"] => Some(Config::Sync),
        ["diloco", h] => Some(Config::Local { every: h.parse().ok()?, fragments: 1, wire: Compression::None }),
        ["diloco", h, w] => Some(Config::Local { every: h.parse().ok()?, fragments: 1, wire: w.parse().ok()? }),
        ["streaming", h, f] => {
            Some(Config::Local { every: h.parse().ok()?, fragments: f.parse().ok()?, wire: Compression::None })
        }
        _ => None,
    }
}

/// Bits per second of `link` (`50mbit`, `1gbit`), or its measured goodput from the header.
fn link_bps(record: &BenchRecord, link: &str) -> std::result::Result<f64, CalibrationError> {
    let bad = || CalibrationError::Link(link.to_string());
    for (suffix, unit) in [("mbit", 1e6), ("gbit", 1e9), ("kbit", 1e3)] {
        if let Some(v) = link.strip_suffix(suffix) {
            return v.parse::<f64>().map(|v| v * unit).map_err(|_| bad());
        }
    }
    // "- measured TCP goodput host 1 -> host 2 (one stream, 1.5 s): 50mbit 0.049 Gbit/s, unshaped 13.653 Gbit/s"
    let line = record.header.iter().find(|l| l.contains("measured TCP goodput")).ok_or_else(bad)?;
    let list = line.split_once("): ").map(|(_, l)| l).ok_or_else(bad)?;
    list.split(", ")
        .find_map(|item| {
            let mut w = item.split_whitespace();
            (w.next() == Some(link)).then(|| w.next().and_then(|v| v.parse::<f64>().ok())).flatten()
        })
        .map(|g| g * 1e9)
        .ok_or_else(bad)
}

/// Tokens of a global batch, from the header's "N windows of M tokens".
fn tokens_per_step(record: &BenchRecord) -> std::result::Result<f64, CalibrationError> {
    for line in &record.header {
        let words: Vec<&str> = line.split_whitespace().collect();
        for w in words.windows(5) {
            if w[1] == "windows" && w[2] == "of" && w[4].starts_with("tokens") {
                if let (Ok(n), Ok(m)) = (w[0].parse::<f64>(), w[3].parse::<f64>()) {
                    return Ok(n * m);
                }
            }
        }
    }
    Err(CalibrationError::NoBatch)
}

/// The median of every `link|config` over the rounds.
fn medians(record: &BenchRecord) -> BTreeMap<String, Measured> {
    let mut out = BTreeMap::new();
    let keys: Vec<&String> = record.rounds.iter().flat_map(|r| r.keys()).collect();
    for key in keys {
        if out.contains_key(key) {
            continue;
        }
        let mut runs: Vec<Measured> = record.rounds.iter().filter_map(|r| r.get(key).copied()).collect();
        runs.sort_by(|a, b| a.rate.total_cmp(&b.rate));
        if let Some(m) = runs.get(runs.len() / 2) {
            out.insert(key.clone(), *m);
        }
    }
    out
}

/// Meetings of a single-fragment period `every` among steps `from..=to`.
fn meetings(every: u64, from: u64, to: u64) -> u64 {
    (from..=to).filter(|s| s % every == 0).count() as u64
}

/// Calibrates the time model on `records` and predicts every Strata row of them.
pub fn calibrate(records: &[BenchRecord]) -> Result<Calibration> {
    struct Entry<'a> {
        record: &'a BenchRecord,
        link: String,
        config_name: String,
        config: Config,
        measured: Measured,
    }
    let mut entries = Vec::new();
    for record in records {
        for (key, measured) in medians(record) {
            let Some((link, config_name)) = key.split_once('|') else { continue };
            let Some(config) = parse_config(config_name) else { continue };
            entries.push(Entry { record, link: link.into(), config_name: config_name.into(), config, measured });
        }
    }
    // Compute: an unshaped DiLoCo run, less its meetings.
    let source = entries
        .iter()
        .position(|e| {
            e.link == "unshaped" && matches!(e.config, Config::Local { fragments: 1, wire: Compression::None, .. })
        })
        .ok_or(CalibrationError::NoComputeRun)?;
    let e = &entries[source];
    let tokens = tokens_per_step(e.record)?;
    let parameters = e.measured.parameters;
    let network = |record: &BenchRecord, link: &str| -> std::result::Result<Network, CalibrationError> {
        Ok(Network {
            latency_s: HOST_LATENCY_US * 1e-6,
            bytes_per_s: link_bps(record, link)? / 8.0,
            model_bytes: 4.0 * parameters as f64,
        })
    };
    let Config::Local { every, .. } = e.config else { unreachable!("matched a local run above") };
    let span = e.measured.steps - WARMUP_STEPS;
    let ring = network(e.record, &e.link)?.ring_allreduce_s(e.record.hosts);
    let step_s = tokens / e.measured.rate;
    let compute_s =
        (span as f64 * step_s - meetings(every, WARMUP_STEPS + 1, e.measured.steps) as f64 * ring) / span as f64;
    // Overlap: the shaped per-step run whose all-reduce is nearest its compute.
    let mut best: Option<(usize, f64, f64)> = None;
    for (i, e) in entries.iter().enumerate() {
        if e.config != Config::Sync || e.link == "unshaped" {
            continue;
        }
        let ring = network(e.record, &e.link)?.ring_allreduce_s(e.record.hosts);
        let nearness = (ring / compute_s).ln().abs();
        if best.is_none_or(|(_, _, b)| nearness < b) {
            let exposed = tokens_per_step(e.record)? / e.measured.rate - compute_s;
            best = Some((i, ((ring - exposed) / compute_s).clamp(0.0, 0.99), nearness));
        }
    }
    let (overlap_source, overlap, _) = best.ok_or(CalibrationError::NoOverlapRun)?;
    let mut rows = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        let tokens = tokens_per_step(e.record)?;
        let predicted = predict(e.record, &e.link, e.config, e.measured, compute_s, overlap, tokens)?;
        let role = match i {
            _ if i == source => Role::ComputeSource,
            _ if i == overlap_source => Role::OverlapSource,
            _ if e.config == Config::Sync && e.link == "unshaped" => Role::OutsideModel,
            _ => Role::Predicted,
        };
        rows.push(Row {
            hosts: e.record.hosts,
            link: e.link.clone(),
            config: e.config_name.clone(),
            measured: e.measured.rate,
            predicted,
            error: predicted / e.measured.rate - 1.0,
            role,
        });
    }
    Ok(Calibration { compute_s, overlap, parameters, tokens_per_step: tokens, rows })
}

/// The simulator's tokens/s for one row.
fn predict(
    record: &BenchRecord,
    link: &str,
    config: Config,
    measured: Measured,
    compute_s: f64,
    overlap: f64,
    tokens: f64,
) -> Result<f64> {
    let local_sgd = match config {
        Config::Sync => None,
        Config::Local { every, fragments, wire } => {
            Some(strata::LocalSgd { every, fragments, wire, ..strata::LocalSgd::default() })
        }
    };
    let compression = match config {
        Config::Local { wire, .. } => wire,
        Config::Sync => Compression::None,
    };
    let spec = RunSpec {
        name: format!("{link}|{}", record.hosts),
        strategy: RunStrategy::MultiWorkerMirrored,
        replicas: 1,
        workers: record.hosts,
        ps_tasks: 1,
        mode: None,
        backup_workers: 0,
        staleness: 0,
        timeout: None,
        compression,
        min_workers: None,
        restarts: 0,
        checkpoint_every: None,
        faults: false,
        zero_stage: strata_core::ZeroStage::Off,
        recompute: false,
        local_sgd,
    };
    // A small MLP with enough variables for the fragments: the learning does not set the time.
    let cfg = SimConfig {
        workers: vec![record.hosts],
        per_worker_batch: 4,
        hidden: vec![8, 8],
        compute_ms: compute_s * 1e3,
        bandwidth_gbps: link_bps(record, link)? / 1e9,
        overlap,
        latency_us: HOST_LATENCY_US,
        max_updates: measured.steps,
        eval_every_updates: measured.steps,
        optimizer: Some("sgd".into()),
        lr: Some(0.01),
        wire_parameters: Some(measured.parameters),
        ..SimConfig::default()
    };
    let exp = Experiment {
        path: PathBuf::from("calibration"),
        name: "calibration".into(),
        description: String::new(),
        model: RunModel::Mlp,
        hidden: cfg.hidden.clone(),
        steps: None,
        transformer: None,
        ctr: None,
        epochs: 1,
        global_batch: cfg.per_worker_batch * record.hosts,
        lr: 0.01,
        optimizer: "sgd".into(),
        seed: 0,
        target: crate::Target::Accuracy(0.9),
        data: None,
        run_timeout: Duration::from_secs(60),
        runs: vec![spec],
        injection: Injection::default(),
        simulate: None,
        network: None,
    };
    let run = simulate_clock(&exp, &cfg)?.remove(0);
    let steps: Vec<f64> = run.records.iter().filter(|r| r.kind == RecordKind::Step).map(|r| r.wall_s).collect();
    let first = steps.get(WARMUP_STEPS as usize - 1).copied().unwrap_or(0.0);
    let last = steps.last().copied().unwrap_or(0.0);
    let counted = steps.len() as f64 - WARMUP_STEPS as f64;
    Ok(if last > first { tokens * counted / (last - first) } else { 0.0 })
}
