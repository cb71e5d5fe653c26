//! The output directory of `strata compare`: `runs.csv`, `summary.json`, the plots and
//! `REPORT.md`.
//!
//! - `runs.csv`: every metric record of every run, one row each (long format);
//! - `summary.json`: the experiment's settings, what was injected, whether the figures are
//!   simulated, and the table's figures per run ([`super::summarize`]) with each run's error;
//! - the plots of [`super::plot`], as PNG and SVG;
//! - `REPORT.md`: what was run, the table, the plots and what the numbers show.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::json;

use super::experiment::Experiment;
use super::plot::{self, Plot};
use super::{summarize, RunResult, RunSummary};
use crate::{Error, Result};
use strata::metrics::RecordKind;

/// The columns of `runs.csv`, in order.
pub const CSV_COLUMNS: [&str; 19] = [
    "run",
    "strategy",
    "mode",
    "workers",
    "simulated",
    "kind",
    "step",
    "updates",
    "wall_s",
    "examples",
    "loss",
    "staleness",
    "bytes_sent",
    "bytes_received",
    "worker",
    "dropped",
    "accuracy",
    "validation_loss",
    "auc",
];

/// What [`write_outputs`] wrote.
#[derive(Clone, Debug)]
pub struct Outputs {
    /// The output directory.
    pub dir: PathBuf,
    /// `runs.csv`.
    pub runs_csv: PathBuf,
    /// `summary.json`.
    pub summary_json: PathBuf,
    /// `REPORT.md`.
    pub report_md: PathBuf,
    /// The plots, in the order the report shows them.
    pub plots: Vec<Plot>,
    /// The table's figures, one per run, in the runs' order.
    pub summaries: Vec<RunSummary>,
}

impl Outputs {
    /// Every file written, the plots' PNG and SVG included.
    pub fn files(&self) -> Vec<PathBuf> {
        let mut out = vec![self.runs_csv.clone(), self.summary_json.clone(), self.report_md.clone()];
        for p in &self.plots {
            out.push(p.png.clone());
            out.push(p.svg.clone());
        }
        out
    }
}

/// Creates `dir` (and its parents) and writes `runs.csv`, `summary.json`, the plots and
/// `REPORT.md` for `runs` of `exp`; `simulated` says whether the figures are virtual.
pub fn write_outputs(dir: &Path, exp: &Experiment, runs: &[RunResult], simulated: bool) -> Result<Outputs> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(format!("cannot create {}", dir.display()), e))?;
    let summaries = summarize(runs, exp.target);

    let runs_csv = dir.join("runs.csv");
    write_file(&runs_csv, &runs_csv_text(runs))?;

    let summary_json = dir.join("summary.json");
    let value = summary_value(exp, runs, &summaries, simulated);
    let text = serde_json::to_string_pretty(&value)
        .map_err(|e| Error::io(format!("cannot encode {}", summary_json.display()), e.into()))?;
    write_file(&summary_json, &(text + "\n"))?;

    let auc = plot::AucLines { target: exp.target.auc(), best: best_auc(&summaries) };
    let plots = plot::draw_all(dir, runs, &summaries, exp.target.accuracy().unwrap_or(f32::NAN), auc, simulated)?;

    let report_md = dir.join("REPORT.md");
    write_file(&report_md, &report_text(exp, runs, &summaries, &plots, simulated))?;

    Ok(Outputs { dir: dir.to_path_buf(), runs_csv, summary_json, report_md, plots, summaries })
}

fn write_file(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(|e| Error::io(format!("cannot write {}", path.display()), e))
}

/// One CSV field, quoted when it holds a comma, a quote or a line break.
pub fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

fn opt<T: ToString>(v: Option<T>) -> String {
    v.map(|x| x.to_string()).unwrap_or_default()
}

/// `runs.csv`: a header and one row per record of every run (absent values: empty cells).
pub fn runs_csv_text(runs: &[RunResult]) -> String {
    let mut out = CSV_COLUMNS.join(",");
    out.push('\n');
    for r in runs {
        for m in &r.records {
            let kind = match m.kind {
                RecordKind::Step => "step",
                RecordKind::Eval => "eval",
            };
            let row = [
                r.name.clone(),
                r.strategy.clone(),
                r.mode.clone().unwrap_or_default(),
                r.workers.to_string(),
                r.simulated.to_string(),
                kind.to_string(),
                m.step.to_string(),
                m.updates.to_string(),
                m.wall_s.to_string(),
                m.examples.to_string(),
                opt(m.loss),
                opt(m.staleness),
                m.bytes_sent.to_string(),
                m.bytes_received.to_string(),
                opt(m.worker),
                m.dropped.to_string(),
                opt(m.accuracy),
                opt(m.validation_loss),
                opt(m.auc),
            ];
            let cells: Vec<String> = row.iter().map(|c| csv_field(c)).collect();
            out.push_str(&cells.join(","));
            out.push('\n');
        }
    }
    out
}

/// Logical CPU cores of this machine (0 when unknown).
fn cores() -> usize {
    std::thread::available_parallelism().map_or(0, |n| n.get())
}

/// `summary.json`'s content.
pub fn summary_value(
    exp: &Experiment,
    runs: &[RunResult],
    summaries: &[RunSummary],
    simulated: bool,
) -> serde_json::Value {
    let runs_json: Vec<serde_json::Value> = summaries
        .iter()
        .zip(runs)
        .map(|(s, r)| {
            let mut v = serde_json::to_value(s).unwrap_or(serde_json::Value::Null);
            if let Some(map) = v.as_object_mut() {
                map.insert("error".into(), json!(r.error));
                map.insert("global_batch".into(), json!(r.global_batch));
                map.insert("wall_s".into(), json!(r.wall_s));
                map.insert("records".into(), json!(r.records.len()));
                map.insert("hosts".into(), json!(r.hosts));
                if !r.faults.is_empty() {
                    map.insert("faults".into(), json!(r.faults));
                }
                if let Some(l) = &r.local_sgd {
                    map.insert("local_sgd".into(), json!(l));
                }
                if let Some(spec) =
                    exp.runs.iter().find(|x| x.name == r.name).filter(|_| !exp.injection.kill.is_empty())
                {
                    map.insert("recovery".into(), json!(recovery(spec)));
                }
            }
            v
        })
        .collect();
    json!({
        "experiment": {
            "name": exp.name,
            "description": exp.description,
            "path": exp.path.display().to_string(),
            "hidden": exp.hidden,
            "epochs": exp.epochs,
            "global_batch": exp.global_batch,
            "lr": exp.lr,
            "optimizer": exp.optimizer,
            "seed": exp.seed,
            "model": exp.model.name(),
            "target_accuracy": exp.target.accuracy(),
            "target_loss": match exp.target { crate::Target::Loss(t) => Some(t), _ => None },
            "target_auc": exp.target.auc(),
            "ctr": exp.ctr,
            "data": exp.data.as_ref().map(|p| p.display().to_string()),
            "run_timeout_s": exp.run_timeout.as_secs_f64(),
            "simulate": exp.simulate,
        },
        "injection": exp.injection.describe(),
        "network": exp.network.as_ref().filter(|_| !simulated).map(|n| json!({
            "hosts": n.hosts,
            "link": n.link,
            "rate_bps": n.rate_bps,
            "measured_link_goodput_bps": runs.iter().find_map(|r| r.link_goodput_bps),
            "placement": crate::hosts::PLACEMENT,
        })),
        "simulated": simulated,
        "machine": { "cores": cores() },
        "runs": runs_json,
    })
}

/// Escapes text for a markdown table cell (one line, no column breaks, no markup).
pub fn md_cell(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for ch in s.trim().chars() {
        match ch {
            '|' => out.push_str("\\|"),
            '\\' | '*' | '_' | '`' | '[' | ']' => {
                out.push('\\');
                out.push(ch);
            }
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '\n' => out.push_str("<br>"),
            '\r' => {}
            c => out.push(c),
        }
    }
    out
}

/// Seconds with two decimals (`12.34 s`); four below a tenth of a second (`0.0412 s`).
pub fn fmt_seconds(s: f64) -> String {
    if s.abs() < 0.1 && s != 0.0 {
        format!("{s:.4} s")
    } else {
        format!("{s:.2} s")
    }
}

/// An accuracy in [0, 1] as a percentage with two decimals: `97.12%`.
pub fn fmt_accuracy(a: f32) -> String {
    format!("{:.2}%", f64::from(a) * 100.0)
}

/// Bytes with decimal units: `512 B`, `1.23 kB`, `4.50 MB`.
pub fn fmt_bytes(b: f64) -> String {
    if !b.is_finite() {
        return "—".into();
    }
    let units = ["B", "kB", "MB", "GB", "TB"];
    let mut v = b;
    let mut u = 0;
    while v.abs() >= 1000.0 && u + 1 < units.len() {
        v /= 1000.0;
        u += 1;
    }
    if u == 0 {
        format!("{v:.0} B")
    } else {
        format!("{v:.2} {}", units[u])
    }
}

const NONE: &str = "—";

fn or_dash<T>(v: Option<T>, f: impl Fn(T) -> String) -> String {
    v.map_or_else(|| NONE.to_string(), f)
}

/// The table's header, its separator and one row per run.
pub fn table(summaries: &[RunSummary], simulated: bool) -> String {
    let time = if simulated { "time to target (virtual)" } else { "time to target" };
    let eps = if simulated { "examples/s (virtual)" } else { "examples/s" };
    let loss_only = summaries.iter().all(|s| s.final_accuracy.is_none())
        && summaries.iter().any(|s| s.final_validation_loss.is_some());
    let last = if loss_only { "final validation loss" } else { "final accuracy" };
    let mut out = format!(
        "| run | strategy | mode | workers | status | {time} | updates to target | {last} | {eps} | scaling efficiency | bytes/example | bytes sent per worker | staleness mean / max |\n"
    );
    out.push_str("|---|---|---|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|\n");
    for s in summaries {
        out.push_str(&table_row(s));
        out.push('\n');
    }
    out
}

/// One row of the table.
pub fn table_row(s: &RunSummary) -> String {
    let status = match &s.error {
        Some(e) => format!("failed: {}", md_cell(e)),
        None => md_cell(&s.status),
    };
    let staleness = match (s.mean_staleness, s.max_staleness) {
        (Some(m), Some(x)) => format!("{m:.2} / {x}"),
        _ => NONE.to_string(),
    };
    let cells = [
        md_cell(&s.name),
        md_cell(&s.strategy),
        s.mode.as_deref().map_or_else(|| NONE.to_string(), md_cell),
        s.workers.to_string(),
        status,
        or_dash(s.time_to_target_s, fmt_seconds),
        or_dash(s.updates_to_target, |u| plot::group_thousands(u as f64)),
        match (s.final_accuracy, s.final_validation_loss) {
            (None, Some(loss)) => format!("loss {loss:.4}"),
            (a, _) => or_dash(a, fmt_accuracy),
        },
        or_dash(s.examples_per_s, plot::group_thousands),
        or_dash(s.scaling_efficiency, |e| format!("{:.0}%", e * 100.0)),
        or_dash(s.bytes_per_example, fmt_bytes),
        or_dash(s.bytes_sent_per_worker, fmt_bytes),
        staleness,
    ];
    format!("| {} |", cells.join(" | "))
}

/// The line that says every figure is simulated.
pub const SIMULATED_LINE: &str =
    "**Every figure in this report is simulated: times are virtual seconds, compute and network \
are modelled, and nothing was measured on this machine.**";

/// `REPORT.md`'s text.
pub fn report_text(
    exp: &Experiment,
    runs: &[RunResult],
    summaries: &[RunSummary],
    plots: &[Plot],
    simulated: bool,
) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# Strata compare: {}\n", exp.name);
    if !exp.description.trim().is_empty() {
        let _ = writeln!(md, "{}\n", exp.description.trim());
    }
    if simulated {
        let _ = writeln!(md, "{SIMULATED_LINE}\n");
    }
    what_was_run(&mut md, exp, runs, simulated);
    results_section(&mut md, exp, runs, summaries, simulated);
    plots_section(&mut md, plots);
    md.push_str("## What it shows\n\n");
    let findings = findings(exp, runs, summaries, simulated);
    if findings.is_empty() {
        md.push_str("- The runs produced too few figures to compare.\n");
    }
    for f in findings {
        let _ = writeln!(md, "- {f}");
    }
    md
}

/// The report's "What was run": the model and its training, the simulation model, the target,
/// what was injected, the emulated network, the runs and the machine.
fn what_was_run(md: &mut String, exp: &Experiment, runs: &[RunResult], simulated: bool) {
    md.push_str("## What was run\n\n");
    // Simulated runs train the [simulate] table's model, optimizer and batch.
    let sim = exp.simulate.as_ref().filter(|_| simulated);
    let model = model_line(exp, simulated);
    let _ = writeln!(
        md,
        "- Model: {}; optimizer {} with learning rate {}; {}; seed {}{}.",
        model,
        sim.and_then(|s| s.optimizer.clone()).unwrap_or_else(|| exp.optimizer.clone()),
        sim.and_then(|s| s.lr).unwrap_or(exp.lr),
        match sim {
            Some(s) => format!("{} examples per worker step (global batch: workers × that)", s.per_worker_batch),
            None => format!("global batch {}", exp.global_batch),
        },
        sim.and_then(|s| s.seed).unwrap_or(exp.seed),
        if simulated { String::new() } else { format!("; {} epoch(s)", exp.epochs) },
    );
    if let Some(sim) = exp.simulate.as_ref().filter(|_| simulated) {
        if let Ok(serde_json::Value::Object(map)) = serde_json::to_value(sim) {
            let items: Vec<String> = map.iter().map(|(k, v)| format!("{k} = {v}")).collect();
            let _ = writeln!(md, "- Simulation model (`[simulate]`): {}.", md_cell(&items.join(", ")));
        }
        if let Some(n) = &exp.network {
            let _ = writeln!(
                md,
                "- Links: bandwidth_gbps {} ({}), the real runs' `[network]` link is `{}` on {} emulated hosts.",
                sim.bandwidth_gbps,
                if n.rate_bps.is_some_and(|b| (b / 1e9 - sim.bandwidth_gbps).abs() < 1e-12) {
                    "from `[network]`"
                } else {
                    "set in `[simulate]`"
                },
                n.link,
                n.hosts
            );
        }
    }
    if let crate::Target::Auc(t) = exp.target {
        let best = best_auc(&summarize(runs, exp.target))
            .map_or_else(String::new, |b| format!("; the best reachable, the planted model's, is {b:.4}"));
        let _ = match t {
            Some(_) => writeln!(md, "- Target: {} (test records){best}.", exp.target.describe()),
            None => writeln!(
                md,
                "- Target: none set (`target_auc`): the final test AUC and its gap to the best reachable{best}."
            ),
        };
    } else {
        let _ = writeln!(
            md,
            "- Target: {} ({}).",
            target_words(exp, simulated),
            if exp.target.accuracy().is_some() || simulated { "test set" } else { "validation text" }
        );
    }
    let injection = exp.injection.describe();
    if injection.is_empty() {
        md.push_str("- Injected: nothing.\n");
    } else {
        md.push_str("- Injected:\n");
        for line in &injection {
            let _ = writeln!(md, "  - {line}");
        }
    }
    if let Some(n) = exp.network.as_ref().filter(|_| !simulated) {
        let measured = runs.iter().find_map(|r| r.link_goodput_bps).map_or_else(
            || "not measured".to_string(),
            |g| format!("{:.3} Gbit/s measured (one TCP stream, host 1 to host 2)", g / 1e9),
        );
        let on_hosts: Vec<&str> = runs.iter().filter(|r| r.hosts > 0).map(|r| r.name.as_str()).collect();
        let _ = writeln!(
            md,
            "- Network (`[network]`): {}; link goodput {measured}. Runs on the hosts: {}; {}; single-process runs ran on this machine outside the hosts.",
            n.describe(),
            if on_hosts.is_empty() { "none".to_string() } else { on_hosts.join(", ") },
            crate::hosts::PLACEMENT,
        );
    }
    let failed = runs.iter().filter(|r| r.error.is_some()).count();
    let _ = writeln!(
        md,
        "- Runs: {}{}.",
        runs.len(),
        if failed > 0 { format!(", {failed} of them failed") } else { String::new() }
    );
    let cores = cores();
    let cores = if cores == 0 { "an unknown number of".to_string() } else { cores.to_string() };
    if simulated {
        let _ = writeln!(
            md,
            "- Machine: generated on a machine with {cores} logical CPU cores; simulated figures do not depend on it.\n"
        );
    } else {
        let _ = writeln!(md, "- Machine: {cores} logical CPU cores, shared by every process of a run.\n");
    }
}

/// The target in words: simulated runs measure a loss target on the MLP's test set, in nats
/// (not per character).
fn target_words(exp: &Experiment, simulated: bool) -> String {
    match exp.target {
        crate::Target::Loss(t) if simulated => format!("a test loss of {t:.2} nats (the simulated MLP's)"),
        t => t.describe(),
    }
}

/// The model every run trained, in words (simulated runs train the `[simulate]` table's MLP).
fn model_line(exp: &Experiment, simulated: bool) -> String {
    // Simulated runs train the [simulate] table's model.
    let sim = exp.simulate.as_ref().filter(|_| simulated);
    let hidden: Vec<String> = sim.map_or(&exp.hidden, |s| &s.hidden).iter().map(usize::to_string).collect();
    let hidden = if hidden.is_empty() {
        "no hidden layer".to_string()
    } else {
        format!("hidden layers {}", hidden.join(" × "))
    };
    match exp.model {
        _ if simulated => format!("MLP on the digits data, {hidden}"),
        crate::experiment::RunModel::Mlp => format!("MLP on the digits data, {hidden}"),
        crate::experiment::RunModel::Cnn => "CNN on the digits data as 8×8 images".to_string(),
        crate::experiment::RunModel::Transformer => format!(
            "character transformer on Tiny Shakespeare ({} steps of windows per epoch)",
            exp.steps.map_or_else(|| "strata train's default".to_string(), |n| n.to_string())
        ),
        crate::experiment::RunModel::Ctr => ctr_model_line(exp),
    }
}

/// The ctr model in words: its table, its records and, where a parameter-server run steps the
/// table's rows on ps tasks, their optimizer.
fn ctr_model_line(exp: &Experiment) -> String {
    let c = exp.ctr.unwrap_or_default();
    let ps = exp.runs.iter().any(|r| r.strategy == crate::experiment::RunStrategy::ParameterServer);
    let local = c.table_optimizer.is_some()
        && exp.runs.iter().any(|r| {
            r.strategy != crate::experiment::RunStrategy::ParameterServer
                && crate::experiment::CtrSettings::steps_rows(r.strategy)
        });
    let (optimizer, lr) = c.table_optimizer();
    format!(
        "DLRM-style click model on generated records (the 26 fields share an embedding table of {} rows × {}); {} training records an epoch, {} test records{}",
        plot::group_thousands(c.rows() as f64),
        c.dim(),
        plot::group_thousands(c.train_records() as f64),
        plot::group_thousands(c.test_records() as f64),
        match (ps, local) {
            (true, true) => Some("the ps tasks, and the in-process runs in the process,"),
            (true, false) => Some("the ps tasks"),
            (false, true) => Some("the runs, in the process,"),
            (false, false) => None,
        }
        .map_or(String::new(), |who| format!("; {who} step the table's rows with {} at {lr}", optimizer.name())),
    )
}

/// The best reachable AUC of the runs (the planted model's on the test records: the same for
/// every run of an experiment, which shares the seed and the records).
fn best_auc(summaries: &[RunSummary]) -> Option<f64> {
    summaries.iter().find_map(|s| s.best_auc)
}

/// The report's "Results": the table, what its columns measure, the lost workers and the failed
/// runs' errors.
fn results_section(md: &mut String, exp: &Experiment, runs: &[RunResult], summaries: &[RunSummary], simulated: bool) {
    md.push_str("## Results\n\n");
    let failed = runs.iter().filter(|r| r.error.is_some()).count();
    if exp.model == crate::experiment::RunModel::Ctr {
        md.push_str(&ctr_table(summaries, exp.target));
        md.push_str(CTR_COLUMNS);
        if failed > 0 {
            failed_runs(md, runs);
        }
        return;
    }
    md.push_str(&table(summaries, simulated));
    let _ = writeln!(
        md,
        "\nTime and updates to target: until the first evaluation that reached {}. Examples/s: between a run's \
         first and last step record. Scaling efficiency: examples/s over (workers × the 1-worker run's). \
         Bytes/example: bytes sent and received between processes per training example. Bytes sent per \
         worker: over the whole run, every step's bytes (all workers') over the workers; local SGD and DiLoCo \
         (mode `diloco H=100`, `local SGD H=20`) send only at their meetings. Staleness: model \
         updates between a worker's pull and its push (parameter servers only). {NONE}: not measured or not reached.",
        target_words(exp, simulated)
    );
    if !exp.injection.kill.is_empty() && !simulated {
        md.push_str(&lost_workers(exp, runs, summaries));
    }
    if failed > 0 {
        failed_runs(md, runs);
    }
}

/// The report's "Failed runs": each failed run's error.
fn failed_runs(md: &mut String, runs: &[RunResult]) {
    md.push_str("\n### Failed runs\n\n");
    for r in runs.iter().filter(|r| r.error.is_some()) {
        let error = r.error.as_deref().unwrap_or_default();
        let _ = writeln!(md, "- {}:\n\n  ```text\n{}\n  ```", md_cell(&r.name), indent(error.trim_end(), "  "));
    }
}

/// What the ctr table's columns measure.
const CTR_COLUMNS: &str = "\nTime and updates to target: until the first evaluation (one after each epoch) whose test AUC \
reached the target. Final AUC: the trained model's test AUC in the run's own summary; gap: the best reachable AUC (the \
planted model's, on the same test records) less it. Examples/s: between a run's first and last step record. Pulled / \
pushed per step: the bytes a worker step pulled from and pushed to the ps tasks, the table's rows and the dense \
variables, the mean over the step records (f32 payloads, framing not counted); for hybrid, the table's rows only, as its \
summary counts them: its dense gradients cross the workers' ring, in bytes sent per worker. Bytes sent per worker: over \
the whole run, every step's bytes (all workers') over the workers. Staleness: model updates between a worker's pull \
and its push (parameter servers only). —: not measured, not reached or no target.\n";

/// The ctr model's table: AUC instead of accuracy, the gap to the best reachable AUC, and the
/// bytes pulled and pushed per step; the time-to-target columns only where the experiment
/// sets `target_auc`.
pub fn ctr_table(summaries: &[RunSummary], target: crate::Target) -> String {
    let with_target = target.is_set();
    let mut out = String::from("| run | strategy | mode | workers | status |");
    if with_target {
        let _ = write!(out, " time to {} | updates to target |", target.short());
    }
    out.push_str(" final AUC | gap to best | examples/s | pulled / pushed per step | bytes sent per worker | staleness mean / max |\n");
    out.push_str(if with_target { "|---|---|---|--:|---|--:|--:|" } else { "|---|---|---|--:|---|" });
    out.push_str("--:|--:|--:|--:|--:|--:|\n");
    for s in summaries {
        out.push_str(&ctr_table_row(s, with_target));
        out.push('\n');
    }
    out
}

/// One row of [`ctr_table`].
pub fn ctr_table_row(s: &RunSummary, with_target: bool) -> String {
    let status = match &s.error {
        Some(e) => format!("failed: {}", md_cell(e)),
        None => md_cell(&s.status),
    };
    let mut cells = vec![
        md_cell(&s.name),
        md_cell(&s.strategy),
        s.mode.as_deref().map_or_else(|| NONE.to_string(), md_cell),
        s.workers.to_string(),
        status,
    ];
    if with_target {
        cells.push(or_dash(s.time_to_target_s, fmt_seconds));
        cells.push(or_dash(s.updates_to_target, |u| plot::group_thousands(u as f64)));
    }
    cells.extend([
        or_dash(s.final_auc, |a| format!("{a:.4}")),
        or_dash(s.auc_gap, |g| format!("{g:.4}")),
        or_dash(s.examples_per_s, plot::group_thousands),
        match (s.pulled_per_step, s.pushed_per_step) {
            (None, None) => NONE.to_string(),
            (a, b) => format!("{} / {}", or_dash(a, fmt_bytes), or_dash(b, fmt_bytes)),
        },
        or_dash(s.bytes_sent_per_worker, fmt_bytes),
        match (s.mean_staleness, s.max_staleness) {
            (Some(m), Some(x)) => format!("{m:.2} / {x}"),
            _ => NONE.to_string(),
        },
    ]);
    format!("| {} |", cells.join(" | "))
}

/// The report's "Plots": each plot's PNG and SVG, or why it is empty.
fn plots_section(md: &mut String, plots: &[Plot]) {
    md.push_str("\n## Plots\n\n");
    for p in plots {
        let file = |path: &Path| path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
        if p.empty {
            let _ = writeln!(md, "- {}: nothing to draw ([{}]({}) says why).\n", p.title, file(&p.png), file(&p.png));
        } else {
            let _ = writeln!(md, "### {}\n", p.title);
            if let Some(note) = &p.note {
                let _ = writeln!(md, "{}.\n", capitalize(note));
            }
            let _ = writeln!(md, "![{}]({})\n", p.title, file(&p.png));
            let _ = writeln!(md, "[SVG]({})\n", file(&p.svg));
        }
    }
}

/// How a run recovers from a lost worker, for the report.
pub fn recovery(spec: &crate::experiment::RunSpec) -> String {
    use crate::experiment::RunStrategy;
    let restarts = |what: &str| match spec.restarts {
        0 => String::new(),
        1 => format!("; a new process {what} (once)"),
        k => format!("; a new process {what} (up to {k} times)"),
    };
    match (spec.strategy, spec.min_workers, spec.checkpoint_every) {
        _ if !spec.faults => "not killed (undisturbed)".into(),
        (RunStrategy::MultiWorkerMirrored, Some(m), _) => {
            format!("elastic: the others re-form and go on (at least {m}){}", restarts("joins"))
        }
        (RunStrategy::MultiWorkerMirrored, None, Some(every)) if spec.restarts > 0 => {
            format!("restart the world: relaunched whole from its last checkpoint (every {every} steps)")
        }
        (RunStrategy::MultiWorkerMirrored, None, _) => "none: the job fails".into(),
        (RunStrategy::ParameterServer, ..) if spec.mode == Some(crate::experiment::PsMode::Hybrid) => {
            "none: the job fails (its dense layers are synchronous)".into()
        }
        (RunStrategy::ParameterServer, ..) => {
            format!("its steps run on the other workers{}", restarts("is given steps"))
        }
        _ => "loses no worker (one process)".into(),
    }
}

/// The report's section on `[injection] kill`: per run, how it recovers, when the worker was
/// killed and what it cost.
fn lost_workers(exp: &Experiment, runs: &[RunResult], summaries: &[RunSummary]) -> String {
    let mut md = String::from("\n### Lost workers\n\n");
    md.push_str(
        "| Run | Recovery | Killed | Longest pause after | Steps trained again | Relaunches | Wall time over undisturbed | Time to target | Final accuracy |\n\
         |---|---|---|---|---|---|---|---|---|\n",
    );
    let spec_of = |name: &str| exp.runs.iter().find(|x| x.name == name);
    let last_step =
        |r: &RunResult| r.records.iter().filter(|m| m.kind == RecordKind::Step).map(|m| m.wall_s).reduce(f64::max);
    for (r, s) in runs.iter().zip(summaries) {
        let Some(spec) = spec_of(&r.name) else { continue };
        // The undisturbed twin: the same strategy, mode and workers with faults = false.
        let twin = runs.iter().find(|o| {
            spec.faults
                && o.error.is_none()
                && spec_of(&o.name).is_some_and(|t| {
                    !t.faults && t.strategy == spec.strategy && t.mode == spec.mode && t.workers == spec.workers
                })
        });
        let over = match (twin, last_step(r), r.error.is_none()) {
            (Some(t), Some(mine), true) => last_step(t).map(|theirs| mine - theirs),
            _ => None,
        };
        let killed: Vec<String> = r
            .faults
            .iter()
            .map(|f| format!("worker {} at {} (step {})", f.worker, fmt_seconds(f.wall_s), f.step))
            .collect();
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            md_cell(&r.name),
            md_cell(&recovery(spec)),
            if killed.is_empty() { NONE.to_string() } else { md_cell(&killed.join("; ")) },
            or_dash(s.longest_pause_s, fmt_seconds),
            s.steps_repeated,
            s.relaunches,
            or_dash(over, |d| format!("{}{}", if d < 0.0 { "-" } else { "+" }, fmt_seconds(d.abs()))),
            or_dash(s.time_to_target_s, fmt_seconds),
            or_dash(s.final_accuracy, fmt_accuracy),
        );
    }
    md.push_str(
        "\nKilled: SIGKILL from outside once the job had trained that many global batches (the harness reads the \
         step records, so the kill lands a step or two after). Longest pause after: the longest time without a \
         step record from the kill on (noticing the loss, re-forming or relaunching, steps trained again before \
         they are recorded). Wall time over undisturbed: the run's last step record less that of the \
         run with the same strategy, mode and workers and `faults = false`, if the experiment has one (one \
         run each: the machine's noise is in it). The dotted lines of the time-to-accuracy plot mark the kills.\n",
    );
    md
}

fn indent(text: &str, prefix: &str) -> String {
    text.lines().map(|l| format!("{prefix}{l}")).collect::<Vec<_>>().join("\n")
}

fn capitalize(s: &str) -> String {
    let mut c = s.chars();
    c.next().map_or_else(String::new, |f| f.to_uppercase().chain(c).collect())
}

fn name(s: &RunSummary) -> String {
    format!("`{}`", s.name.replace('`', "'"))
}

/// Plain statements the table supports, one per line.
pub fn findings(exp: &Experiment, runs: &[RunResult], summaries: &[RunSummary], simulated: bool) -> Vec<String> {
    let mut out = Vec::new();
    let time = |t: f64| if simulated { format!("{} (virtual)", fmt_seconds(t)) } else { fmt_seconds(t) };
    let ok: Vec<&RunSummary> = summaries.iter().filter(|s| s.error.is_none()).collect();
    let reached = if exp.target.is_set() { time_to_target(&mut out, exp, &ok, &time) } else { Vec::new() };
    out.extend(fewest_updates(&reached));
    out.extend(final_accuracy(&ok));
    out.extend(final_auc(&ok));
    out.extend(throughput(&ok, simulated));
    if exp.model == crate::experiment::RunModel::Ctr {
        out.extend(ctr_modes(&ok));
        out.extend(ctr_bytes(&ok));
    } else {
        sync_against_async(&mut out, exp, runs, &ok, &time);
    }
    out.extend(most_stale(&ok));
    if plot::is_sweep(runs) {
        out.extend(sweep_efficiency(&ok));
    }
    let failed: Vec<String> = summaries.iter().filter(|s| s.error.is_some()).map(name).collect();
    if !failed.is_empty() {
        out.push(format!("Failed (see above): {}.", failed.join(", ")));
    }
    if simulated && !out.is_empty() {
        out.push("All of these are properties of the simulation's model, not measurements.".into());
    }
    out
}

/// Which run reached the target first and how long the next took, and the runs that never
/// reached it. Returns the runs that reached it, fastest first.
fn time_to_target<'a>(
    out: &mut Vec<String>,
    exp: &Experiment,
    ok: &[&'a RunSummary],
    time: &dyn Fn(f64) -> String,
) -> Vec<&'a RunSummary> {
    let target = exp.target.short();
    let mut reached: Vec<&RunSummary> = ok.iter().copied().filter(|s| s.time_to_target_s.is_some()).collect();
    reached.sort_by(|a, b| {
        a.time_to_target_s.unwrap_or(f64::INFINITY).total_cmp(&b.time_to_target_s.unwrap_or(f64::INFINITY))
    });
    match reached.as_slice() {
        [] if !ok.is_empty() => out.push(format!("No run reached the target of {}.", exp.target.describe())),
        [] => {}
        [first, rest @ ..] => {
            let mut s = format!(
                "{} reached {target} first, after {} ({} updates)",
                name(first),
                time(first.time_to_target_s.unwrap_or_default()),
                plot::group_thousands(first.updates_to_target.unwrap_or_default() as f64)
            );
            if let Some(second) = rest.first() {
                let t1 = first.time_to_target_s.unwrap_or_default();
                let t2 = second.time_to_target_s.unwrap_or_default();
                let _ = write!(s, "; the next, {}, took {}", name(second), time(t2));
                if t1 > 0.0 {
                    let _ = write!(s, " ({:.2}× as long)", t2 / t1);
                }
            }
            s.push('.');
            out.push(s);
            let missed: Vec<String> = ok.iter().filter(|s| s.time_to_target_s.is_none()).map(|s| name(s)).collect();
            if !missed.is_empty() && missed.len() <= 8 {
                out.push(format!("Never reached {target}: {}.", missed.join(", ")));
            } else if !missed.is_empty() {
                out.push(format!("{} runs never reached {target}.", missed.len()));
            }
        }
    }
    reached
}

/// The fewest model updates to the target (accuracy per update), and the most.
fn fewest_updates(reached: &[&RunSummary]) -> Option<String> {
    if let Some(best) = reached.iter().filter(|s| s.updates_to_target.is_some()).min_by_key(|s| s.updates_to_target) {
        let most = reached.iter().filter_map(|s| s.updates_to_target.map(|u| (u, s))).max_by_key(|(u, _)| *u);
        let mut s = format!(
            "Fewest model updates to the target: {} with {}",
            name(best),
            plot::group_thousands(best.updates_to_target.unwrap_or_default() as f64)
        );
        if let Some((u, worst)) = most {
            if worst.name != best.name {
                let _ = write!(s, " (most: {} with {})", name(worst), plot::group_thousands(u as f64));
            }
        }
        s.push('.');
        return Some(s);
    }
    None
}

/// The highest and lowest final accuracy.
fn final_accuracy(ok: &[&RunSummary]) -> Option<String> {
    if let Some(best) = ok
        .iter()
        .filter(|s| s.final_accuracy.is_some_and(f32::is_finite))
        .max_by(|a, b| a.final_accuracy.unwrap_or_default().total_cmp(&b.final_accuracy.unwrap_or_default()))
    {
        let worst = ok
            .iter()
            .filter(|s| s.final_accuracy.is_some_and(f32::is_finite))
            .min_by(|a, b| a.final_accuracy.unwrap_or_default().total_cmp(&b.final_accuracy.unwrap_or_default()));
        let best_acc = best.final_accuracy.unwrap_or_default();
        let s = match worst {
            Some(w) if w.final_accuracy.unwrap_or_default() < best_acc => format!(
                "Highest final accuracy: {} at {}; lowest: {} at {}.",
                name(best),
                fmt_accuracy(best_acc),
                name(w),
                fmt_accuracy(w.final_accuracy.unwrap_or_default())
            ),
            _ if ok.len() > 1 => format!("Every run that finished ended at {} accuracy.", fmt_accuracy(best_acc)),
            _ => format!("Final accuracy: {} at {}.", name(best), fmt_accuracy(best_acc)),
        };
        return Some(s);
    }
    None
}

/// The highest and lowest final AUC (the ctr model), each with its gap to the best reachable.
fn final_auc(ok: &[&RunSummary]) -> Option<String> {
    let with: Vec<&&RunSummary> = ok.iter().filter(|s| s.final_auc.is_some_and(f64::is_finite)).collect();
    let auc = |s: &RunSummary| s.final_auc.unwrap_or_default();
    let best = with.iter().max_by(|a, b| auc(a).total_cmp(&auc(b)))?;
    let worst = with.iter().min_by(|a, b| auc(a).total_cmp(&auc(b)))?;
    let gap = |s: &RunSummary| s.auc_gap.map_or_else(String::new, |g| format!(", {g:.4} below the best reachable"));
    Some(if auc(worst) < auc(best) {
        format!(
            "Highest final AUC: {} at {:.4}{}; lowest: {} at {:.4}{}.",
            name(best),
            auc(best),
            gap(best),
            name(worst),
            auc(worst),
            gap(worst)
        )
    } else {
        format!("Final AUC: {} at {:.4}{}.", name(best), auc(best), gap(best))
    })
}

/// The ctr model's parameter-server modes against each other, on the same workers: examples/s
/// and final AUC (what asynchrony and the hybrid's ring cost or gain).
fn ctr_modes(ok: &[&RunSummary]) -> Vec<String> {
    let mode = |m: &str| ok.iter().copied().find(|s| s.mode.as_deref() == Some(m));
    let mut out = Vec::new();
    for (a, b) in [("hybrid", "async"), ("hybrid", "sync"), ("sync", "async")] {
        let (Some(x), Some(y)) = (mode(a), mode(b)) else { continue };
        if x.workers != y.workers {
            continue;
        }
        let mut parts = Vec::new();
        if let (Some(ex), Some(ey)) = (x.examples_per_s, y.examples_per_s.filter(|e| *e > 0.0)) {
            parts.push(format!(
                "{} examples/s against {} ({:+.0}%)",
                plot::group_thousands(ex),
                plot::group_thousands(ey),
                (ex / ey - 1.0) * 100.0
            ));
        }
        if let (Some(ax), Some(ay)) = (x.final_auc, y.final_auc) {
            parts.push(format!("a final AUC of {ax:.4} against {ay:.4} ({:+.4})", ax - ay));
        }
        if let (Some(tx), Some(ty)) = (x.time_to_target_s, y.time_to_target_s) {
            parts.push(format!("the target after {} against {}", fmt_seconds(tx), fmt_seconds(ty)));
        }
        if !parts.is_empty() {
            out.push(format!("{} against {} on {} workers: {}.", name(x), name(y), x.workers, parts.join(", ")));
        }
    }
    out
}

/// What a worker step moved in each ctr run that counted it, smallest pull first.
fn ctr_bytes(ok: &[&RunSummary]) -> Option<String> {
    let mut with: Vec<&&RunSummary> = ok.iter().filter(|s| s.pulled_per_step.is_some()).collect();
    with.sort_by(|a, b| a.pulled_per_step.unwrap_or_default().total_cmp(&b.pulled_per_step.unwrap_or_default()));
    let parts: Vec<String> = with
        .iter()
        .map(|s| {
            let what =
                if s.mode.as_deref() == Some("hybrid") { "the table's rows" } else { "rows and dense variables" };
            format!(
                "{} pulled {} and pushed {} ({what})",
                name(s),
                or_dash(s.pulled_per_step, fmt_bytes),
                or_dash(s.pushed_per_step, fmt_bytes)
            )
        })
        .collect();
    (!parts.is_empty()).then(|| format!("Per worker step, {}.", parts.join("; ")))
}

/// The highest throughput, with its scaling efficiency.
fn throughput(ok: &[&RunSummary], simulated: bool) -> Option<String> {
    let secs = if simulated { "virtual seconds" } else { "seconds" };
    if let Some(best) = ok
        .iter()
        .filter(|s| s.examples_per_s.is_some())
        .max_by(|a, b| a.examples_per_s.unwrap_or_default().total_cmp(&b.examples_per_s.unwrap_or_default()))
    {
        let eps = best.examples_per_s.unwrap_or_default();
        let mut s = format!(
            "Highest throughput: {} with {} examples per {}",
            name(best),
            plot::group_thousands(eps),
            &secs[..secs.len() - 1]
        );
        if let Some(e) = best.scaling_efficiency {
            let _ = write!(s, " ({:.0}% scaling efficiency on {} workers)", e * 100.0, best.workers);
        }
        s.push('.');
        return Some(s);
    }
    None
}

/// Sync against async parameter servers with the same workers (what stragglers cost), and
/// sync with backup workers against sync.
fn sync_against_async(
    out: &mut Vec<String>,
    exp: &Experiment,
    runs: &[RunResult],
    ok: &[&RunSummary],
    time: &dyn Fn(f64) -> String,
) {
    let injected = !exp.injection.is_empty();
    // In a sweep, only at the largest worker count (one statement per strategy pair).
    let largest_sync = ok.iter().filter(|s| s.mode.as_deref() == Some("sync")).map(|s| s.workers).max().unwrap_or(0);
    let sweep = plot::is_sweep(runs);
    for sync in ok
        .iter()
        .filter(|s| s.mode.as_deref() == Some("sync") && s.workers > 1 && (!sweep || s.workers == largest_sync))
    {
        let Some(asy) = ok
            .iter()
            .find(|a| a.mode.as_deref() == Some("async") && a.workers == sync.workers && a.simulated == sync.simulated)
        else {
            continue;
        };
        if let (Some(se), Some(ae)) = (sync.examples_per_s, asy.examples_per_s) {
            if ae > 0.0 {
                out.push(format!(
                    "{}: {} processed {} examples/s against {}'s {} ({:+.0}%) on {} workers.",
                    if injected { "With the injected delays" } else { "With nothing injected" },
                    name(sync),
                    plot::group_thousands(se),
                    name(asy),
                    plot::group_thousands(ae),
                    (se / ae - 1.0) * 100.0,
                    sync.workers
                ));
            }
        }
        let backup = ok.iter().find(|b| {
            b.workers == sync.workers
                && b.simulated == sync.simulated
                && b.mode.as_deref().is_some_and(|m| m.starts_with("sync,"))
        });
        if let Some(b) = backup {
            if let (Some(ts), Some(tb)) = (sync.time_to_target_s, b.time_to_target_s) {
                if ts > 0.0 {
                    out.push(format!(
                        "Backup workers: {} reached the target in {} against {} for {} ({:+.0}%).",
                        name(b),
                        time(tb),
                        time(ts),
                        name(sync),
                        (tb / ts - 1.0) * 100.0
                    ));
                }
            }
        }
    }
}

/// The run whose pushes were the most stale on average.
fn most_stale(ok: &[&RunSummary]) -> Option<String> {
    if let Some(s) = ok
        .iter()
        .filter(|s| s.mean_staleness.is_some())
        .max_by(|a, b| a.mean_staleness.unwrap_or_default().total_cmp(&b.mean_staleness.unwrap_or_default()))
    {
        if s.mean_staleness.unwrap_or_default() > 0.0 {
            return Some(format!(
                "Most stale: {}, whose pushes were {:.2} updates old on average (at most {}).",
                name(s),
                s.mean_staleness.unwrap_or_default(),
                s.max_staleness.unwrap_or_default()
            ));
        }
    }
    None
}

/// Sweeps: the scaling efficiency at the largest worker count of each strategy.
fn sweep_efficiency(ok: &[&RunSummary]) -> Option<String> {
    let mut bases: Vec<&str> = Vec::new();
    for s in ok {
        let b = plot::sweep_base(&s.name);
        if s.name.contains("/N=") && !bases.contains(&b) {
            bases.push(b);
        }
    }
    let mut parts = Vec::new();
    for b in bases {
        let largest = ok
            .iter()
            .filter(|s| s.name.contains("/N=") && plot::sweep_base(&s.name) == b && s.scaling_efficiency.is_some())
            .max_by_key(|s| s.workers);
        if let Some(s) = largest {
            parts.push(format!(
                "{} {:.0}% at {} workers",
                b,
                s.scaling_efficiency.unwrap_or_default() * 100.0,
                s.workers
            ));
        }
    }
    (!parts.is_empty())
        .then(|| format!("Scaling efficiency at each strategy's largest worker count: {}.", parts.join("; ")))
}

/// The extrapolation's table (`strata compare --simulate --extrapolate`): virtual time to the
/// target test loss, one row per run and worker count, one column per link rate.
pub fn extrapolation_table(cells: &[crate::simulate::Extrapolated], target_loss: f64) -> String {
    let mut links: Vec<f64> = Vec::new();
    let mut rows: Vec<(&str, &str, usize)> = Vec::new();
    for c in cells {
        if !links.contains(&c.link_gbps) {
            links.push(c.link_gbps);
        }
        if !rows.iter().any(|r| r.0 == c.run && r.2 == c.workers) {
            rows.push((&c.run, &c.label, c.workers));
        }
    }
    let mut md = format!(
        "Virtual time to a test loss of {target_loss} (nats); in brackets, the bytes each worker sent until then. {NONE}: not reached.\n\n| run | workers |"
    );
    for l in &links {
        let _ = write!(md, " {} |", link_name(*l));
    }
    md.push_str("\n|---|--:|");
    md.push_str(&"--:|".repeat(links.len()));
    md.push('\n');
    for (run, label, n) in rows {
        let modelled = cells.iter().filter(|c| c.run == run).all(|c| c.loss_modelled);
        let _ = write!(md, "| {}{} | {n} |", md_cell(label), if modelled { "" } else { " (time only)" });
        for l in &links {
            let cell = cells.iter().find(|c| c.run == run && c.workers == n && c.link_gbps == *l);
            let text = match cell.and_then(|c| c.time_to_target_s.map(|t| (t, c.bytes_per_worker_to_target))) {
                Some((t, Some(b))) => format!("{} ({})", fmt_seconds(t), fmt_bytes(b)),
                Some((t, None)) => fmt_seconds(t),
                None => NONE.to_string(),
            };
            let _ = write!(md, " {text} |");
        }
        md.push('\n');
    }
    md
}

/// `extrapolation.csv`: one row per cell.
pub fn extrapolation_csv(cells: &[crate::simulate::Extrapolated]) -> String {
    let mut out = String::from(
        "run,label,workers,link_gbps,time_to_target_s,updates_to_target,bytes_per_worker_to_target,loss_modelled\n",
    );
    for c in cells {
        let row = [
            c.run.clone(),
            c.label.clone(),
            c.workers.to_string(),
            c.link_gbps.to_string(),
            opt(c.time_to_target_s),
            opt(c.updates_to_target),
            opt(c.bytes_per_worker_to_target),
            c.loss_modelled.to_string(),
        ];
        out.push_str(&row.iter().map(|c| csv_field(c)).collect::<Vec<_>>().join(","));
        out.push('\n');
    }
    out
}

/// A link rate in words: `10 Mbit/s`, `1 Gbit/s`.
pub fn link_name(gbps: f64) -> String {
    if gbps >= 1.0 {
        format!("{} Gbit/s", trim_number(gbps))
    } else {
        format!("{} Mbit/s", trim_number(gbps * 1000.0))
    }
}

fn trim_number(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// Writes `EXTRAPOLATION.md` and `extrapolation.csv` into `dir` (created if need be); returns
/// the markdown.
pub fn write_extrapolation(
    dir: &Path,
    exp: &Experiment,
    cfg: &crate::simulate::SimConfig,
    cells: &[crate::simulate::Extrapolated],
    target_loss: f64,
) -> Result<String> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(format!("cannot create {}", dir.display()), e))?;
    write_file(&dir.join("extrapolation.csv"), &extrapolation_csv(cells))?;
    let mut md = format!("# Strata compare: {} extrapolated\n\n{SIMULATED_LINE}\n\n", exp.name);
    let _ = writeln!(
        md,
        "- Learning: the simulator's MLP (hidden {:?}) on the digits data, {} examples per worker step, its optimizer {}; the time model sends {} parameters ({}) and computes {} ms a step, overlap {}, latency {} µs.",
        cfg.hidden,
        cfg.per_worker_batch,
        cfg.optimizer.clone().unwrap_or_else(|| exp.optimizer.clone()),
        cfg.wire_parameters.unwrap_or_else(|| cfg.mlp_parameters()),
        if cfg.wire_parameters.is_some() { "`wire_parameters`" } else { "the MLP's own" },
        cfg.compute_ms,
        cfg.overlap,
        cfg.latency_us,
    );
    md.push_str(
        "- PowerSGD (time only): its messages carry its factors' bytes, but the simulator applies the uncompressed \
         gradients, so its updates to target are per-step sync's; only its time is modelled.\n\
         - Local SGD / DiLoCo: the real update rules on the MLP (each worker's inner optimizer, the outer optimizer on \
         the mean outer gradient, fragments as `LocalSgd::meeting` staggers them); the wire's rounding is not modelled.\n\n",
    );
    md.push_str(&extrapolation_table(cells, target_loss));
    write_file(&dir.join("EXTRAPOLATION.md"), &md)?;
    Ok(md)
}
