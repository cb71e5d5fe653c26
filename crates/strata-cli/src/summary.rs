//! The end of a `strata train` run: the one-line result, `--save-params` and the JSON summary
//! `--out` writes ([`Summary`], with [`PsSummary`] for a parameter-server job), written by the
//! chief of any strategy or by a parameter-server job's coordinator.

use std::path::PathBuf;

use serde::Serialize;
use strata::cnn::Cnn;
use strata::digits;
use strata::model::Mlp;
use strata::ps_job;
use strata::trainer::FitReport;
use strata::{OptimizerKind, StrategyKind};

use crate::train_args::{ModelKind, TrainArgs};
use crate::{Error, Result};

/// The JSON summary `--out` writes.
#[derive(Debug, Serialize)]
pub struct Summary {
    /// The model (mlp, cnn, transformer).
    pub model: ModelKind,
    /// The strategy.
    pub strategy: StrategyKind,
    /// Replicas in sync.
    pub replicas: usize,
    /// Hidden layer sizes (the MLP's).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub hidden: Vec<usize>,
    /// Parameters of the model.
    pub parameters: usize,
    /// Epochs.
    pub epochs: usize,
    /// Global batch.
    pub global_batch: usize,
    /// Optimizer.
    pub optimizer: OptimizerKind,
    /// Learning rate.
    pub learning_rate: f64,
    /// Seed.
    pub seed: u64,
    /// Test accuracy after the last epoch (the digits models).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub final_test_accuracy: Option<f32>,
    /// The transformer: validation loss after the last epoch, in nats per character.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub validation_loss: Option<f64>,
    /// The transformer: training tokens per second over the steady-state steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_second: Option<f64>,
    /// Examples per second over the steady-state steps.
    pub examples_per_second: f64,
    /// Wall seconds of the whole run (data loading and evaluation included).
    pub wall_seconds: f64,
    /// Per epoch: loss, test accuracy, step seconds.
    pub history: Vec<strata::trainer::EpochReport>,
    /// The most bytes each replica of the process that wrote this summary held at once in a
    /// step, counted (parameters as resident, gradients, optimizer state, activations); the
    /// chief's replica under multi-worker mirrored, where every worker logs its own. Absent for
    /// a parameter-server job.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub peak_replica_bytes: Vec<u64>,
    /// The same peaks, by kind.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub peak_replica: Vec<strata::Footprint>,
    /// The type the model computed in (`--precision`).
    pub precision: strata::Precision,
    /// fp16's dynamic loss scaling at the end: the scale, and the steps skipped for a gradient
    /// that was not finite.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<strata::LossScaleState>,
    /// Parameter server: what the ps tasks and the coordinator did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameter_servers: Option<PsSummary>,
    /// Local SGD / DiLoCo (`--sync-every`): its settings and this worker's outer traffic.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub local_sgd: Option<LocalSgdSummary>,
    /// `--model ctr`: the table, the records and the AUCs (at the summary's top level).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub ctr: Option<CtrSummary>,
}

/// What a `--model ctr` run adds to the summary.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct CtrSummary {
    /// Rows of the embedding table.
    pub embedding_rows: u64,
    /// The embedding dimension.
    pub embedding_dim: usize,
    /// Generated training records.
    pub train_records: u64,
    /// Generated test records.
    pub test_records: u64,
    /// The trained model's AUC on the test records.
    pub final_test_auc: f64,
    /// The planted model's AUC on the same records: the best any model can reach.
    pub best_test_auc: f64,
    /// The bytes of gradient each replica gives the reduction each step: every parameter's,
    /// the whole table's included, in f32 (the strategies reduce the table's gradient densely;
    /// the summary has no count of what the reductions sent).
    pub dense_gradient_bytes_per_step: u64,
    /// A hybrid job: the bytes of row values the chief's training steps pulled from the ps
    /// tasks, per step (f32: distinct rows x dim x 4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table_bytes_pulled_per_step: Option<f64>,
    /// A hybrid job: the bytes of row gradients (f32) and ids (8 bytes each) the chief's
    /// training steps pushed, per step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table_bytes_pushed_per_step: Option<f64>,
}

/// What a local SGD / DiLoCo run did.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct LocalSgdSummary {
    /// `--sync-every`: inner steps between two meetings of a fragment.
    pub sync_every: u64,
    /// The outer optimizer, as `average` or `nesterov(lr=..,momentum=..)`.
    pub outer_optimizer: String,
    /// `--fragments`.
    pub fragments: usize,
    /// Inner steps an exchange ran behind.
    pub delay: u64,
    /// How outer gradients crossed (`--compression`).
    pub wire: String,
    /// Bytes of outer gradients the chief sent.
    pub outer_bytes_sent: u64,
    /// Meetings (of a fragment each) completed, the final synchronisation's included.
    pub meetings: u64,
}

/// `path` with `{task}` replaced by a worker's `index` (`--save-params`, `--timeline`).
pub(crate) fn task_path(path: &std::path::Path, index: usize) -> PathBuf {
    PathBuf::from(path.to_string_lossy().replace("{task}", &index.to_string()))
}

/// Writes `vars` as safetensors to `path` with `{task}` replaced by `index`.
pub(crate) fn save_params(path: &std::path::Path, index: usize, vars: &[(String, candle_core::Var)]) -> Result<()> {
    let path = task_path(path, index);
    let tensors: std::collections::HashMap<String, candle_core::Tensor> =
        vars.iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect();
    candle_core::safetensors::save(&tensors, &path)
        .map_err(|e| Error::io(format!("cannot write {}", path.display()), std::io::Error::other(e)))
}

/// The chief's (or coordinator's) end of a run: the one-line result, `--save-params` and `--out`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn finish(
    args: &TrainArgs,
    started: std::time::Instant,
    replicas: usize,
    report: &FitReport,
    vars: &[(String, candle_core::Var)],
    task_index: usize,
    parameter_servers: Option<PsSummary>,
    ctr: Option<CtrSummary>,
) -> Result<()> {
    let transformer = args.model == ModelKind::Transformer;
    let context = args.transformer().context;
    let validation_loss =
        transformer.then(|| report.final_metrics.iter().find(|m| m.name == "loss").map_or(f64::NAN, |m| m.value));
    let parameters = match args.model {
        ModelKind::Mlp => Mlp::parameter_count(digits::FEATURES, &args.hidden(), digits::CLASSES),
        ModelKind::Cnn => Cnn::parameter_count(),
        ModelKind::Transformer => args.transformer().parameter_count(),
        ModelKind::Ctr => args.ctr().parameter_count() as usize,
    };
    let summary = Summary {
        model: args.model,
        strategy: args.strategy,
        replicas,
        parameters,
        hidden: if args.model == ModelKind::Mlp { args.hidden() } else { Vec::new() },
        epochs: args.epochs(),
        global_batch: args.batch(),
        optimizer: args.optimizer,
        learning_rate: args.lr,
        seed: args.seed,
        final_test_accuracy: (!transformer && args.model != ModelKind::Ctr).then_some(report.final_test_accuracy),
        validation_loss,
        tokens_per_second: transformer.then_some(report.examples_per_second * context as f64),
        examples_per_second: report.examples_per_second,
        wall_seconds: started.elapsed().as_secs_f64(),
        history: report.epochs.clone(),
        peak_replica_bytes: report.peak_footprints.iter().map(strata::Footprint::total).collect(),
        peak_replica: report.peak_footprints.clone(),
        precision: args.precision,
        loss_scale: report.loss_scale,
        parameter_servers,
        local_sgd: args.local_sgd().zip(report.outer_traffic).map(|(l, (bytes, meetings))| LocalSgdSummary {
            sync_every: l.every,
            outer_optimizer: l.outer.to_string(),
            fragments: l.fragments,
            delay: l.delay(),
            wire: args.compression.to_string(),
            outer_bytes_sent: bytes,
            meetings,
        }),
        ctr,
    };
    if let Some(c) = &summary.ctr {
        println!(
            "{} x{}: ctr test auc {:.4} (planted best {:.4}) after {} epochs ({} steps), {} of dense gradient per step, {:.0} examples/s in steady state, {:.2} s",
            args.strategy,
            replicas,
            c.final_test_auc,
            c.best_test_auc,
            args.epochs(),
            report.steps,
            strata_core::device::format_bytes(c.dense_gradient_bytes_per_step),
            summary.examples_per_second,
            summary.wall_seconds
        );
    } else if let (Some(loss), Some(tokens)) = (summary.validation_loss, summary.tokens_per_second) {
        println!(
            "{} x{}: transformer validation loss {loss:.4} nats per character after {} epochs ({} steps), {tokens:.0} tokens/s in steady state, {:.2} s",
            args.strategy,
            replicas,
            args.epochs(),
            report.steps,
            summary.wall_seconds
        );
    } else {
        println!(
            "{} x{}: {}test accuracy {:.2}% after {} epochs ({} steps), {:.0} examples/s in steady state, {:.2} s",
            args.strategy,
            replicas,
            if args.model == ModelKind::Cnn { "cnn " } else { "" },
            report.final_test_accuracy * 100.0,
            args.epochs(),
            report.steps,
            summary.examples_per_second,
            summary.wall_seconds
        );
    }
    if let Some(path) = &args.save_params {
        save_params(path, task_index, vars)?;
    }
    if let Some(path) = &args.out {
        let json =
            serde_json::to_string_pretty(&summary).map_err(|e| Error::io("cannot encode the summary", e.into()))?;
        std::fs::write(path, json + "\n").map_err(|e| Error::io(format!("cannot write {}", path.display()), e))?;
    }
    Ok(())
}

/// The parameter-server part of `--out`.
#[derive(Debug, Serialize)]
pub struct PsSummary {
    /// The mode, as the ps tasks report it.
    pub mode: String,
    /// The rate of stale pushes' dense variables, as the ps tasks report it (`--stale-rate`;
    /// none in a hybrid job, whose dense layers are all-reduced).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stale_rate: Option<String>,
    /// Worker tasks.
    pub workers: usize,
    /// What the coordinator saw (none in a hybrid job, which has no coordinator).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub coordinator: Option<ps_job::CoordinatorStats>,
    /// What each ps task did.
    pub tasks: Vec<PsTaskSummary>,
}

/// One ps task's counters at the end of training.
#[derive(Debug, Serialize)]
pub struct PsTaskSummary {
    /// `ps:<index>`.
    pub task: String,
    /// Applies made (the task's version).
    pub version: u64,
    /// Updates applied.
    pub pushes_applied: u64,
    /// Retries answered as duplicates.
    pub pushes_duplicate: u64,
    /// Sync pushes dropped.
    pub pushes_dropped: u64,
    /// Stale pushes refused.
    pub pushes_stale: u64,
    /// Pushes applied while they arrived (counted in `pushes_applied` too).
    pub pushes_streamed: u64,
    /// Streamed pushes refused because another update overtook them (sent again).
    pub pushes_aborted: u64,
    /// The checkpoint step it was restored from (0: fresh).
    pub restored_step: u64,
    /// Its version in that checkpoint.
    pub restored_version: u64,
    /// Sync rounds applied.
    pub rounds: u64,
    /// Updates applied per worker.
    pub applied_by_worker: std::collections::BTreeMap<String, u64>,
    /// Bytes of variables it holds.
    pub bytes: u64,
}
