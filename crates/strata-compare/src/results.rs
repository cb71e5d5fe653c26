//! What runs produced ([`RunResult`]: every record of one run) and the report's figures of each
//! ([`RunSummary`], from [`summarize`]).

use serde::Serialize;

use strata::metrics::{MetricRecord, RecordKind};

use crate::faults;
use crate::target::Target;

/// Everything one run produced.
#[derive(Clone, Debug, Serialize)]
pub struct RunResult {
    /// The run's name, unique in the experiment (e.g. `ps-async`).
    pub name: String,
    /// The strategy, as `strata train --strategy` names it.
    pub strategy: String,
    /// The parameter-server mode (`async`, `sync`, `sync, 1 backup`, `stale <= 4`), if any.
    pub mode: Option<String>,
    /// Replicas (in-process strategies) or worker tasks (multi-process strategies).
    pub workers: usize,
    /// Examples per synchronous step (parameter servers: per round of one push per worker).
    pub global_batch: usize,
    /// Whether the figures are virtual (simulated mode).
    pub simulated: bool,
    /// The per-step and per-evaluation records, in the order they were written.
    pub records: Vec<MetricRecord>,
    /// Why the run failed, if it did.
    pub error: Option<String>,
    /// Seconds the whole run took (virtual seconds in simulated mode).
    pub wall_s: f64,
    /// The emulated hosts its processes ran on (`[network]`; 0: this machine's loopback).
    pub hosts: usize,
    /// The measured TCP goodput of one link of those hosts, bits per second, if measured.
    pub link_goodput_bps: Option<f64>,
    /// The workers `[injection] kill` killed, and when.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub faults: Vec<faults::FaultEvent>,
    /// How many times the harness relaunched the whole job from its last checkpoint.
    #[serde(default)]
    pub relaunches: usize,
    /// A real local-SGD run's outer traffic, from its `strata train --out` summary (the
    /// chief's, the final synchronisation after the last step included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_sgd: Option<OuterTraffic>,
    /// A real ctr run's AUCs and table traffic, from its `strata train --out` summary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ctr: Option<CtrFigures>,
}

/// What a ctr run's summary (`strata train --out`) says: the trained model's test AUC, the
/// best reachable (the planted model's on the same records), and where the summary has them
/// (hybrid parameter servers), the table's bytes a worker pulled and pushed per step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct CtrFigures {
    /// `final_test_auc` (`None`: not a number).
    pub final_test_auc: Option<f64>,
    /// `best_test_auc`.
    pub best_test_auc: Option<f64>,
    /// `table_bytes_pulled_per_step`, at the summary's top level or in `parameter_servers`.
    pub table_bytes_pulled_per_step: Option<f64>,
    /// `table_bytes_pushed_per_step`, likewise.
    pub table_bytes_pushed_per_step: Option<f64>,
}

impl CtrFigures {
    /// The ctr figures of a `strata train --out` summary, if it is a ctr run's.
    pub fn from_summary(json: &str) -> Option<Self> {
        let v: serde_json::Value = serde_json::from_str(json).ok()?;
        let number = |key: &str| {
            let at = |o: &serde_json::Value| o.get(key).and_then(serde_json::Value::as_f64);
            at(&v).or_else(|| v.get("parameter_servers").and_then(at)).filter(|x| x.is_finite())
        };
        let has_auc = v.get("final_test_auc").is_some() || v.get("best_test_auc").is_some();
        has_auc.then(|| CtrFigures {
            final_test_auc: number("final_test_auc"),
            best_test_auc: number("best_test_auc"),
            table_bytes_pulled_per_step: number("table_bytes_pulled_per_step"),
            table_bytes_pushed_per_step: number("table_bytes_pushed_per_step"),
        })
    }
}

/// What a local-SGD run's summary says crossed (`local_sgd` of `strata train --out`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct OuterTraffic {
    /// Bytes of outer gradients the chief sent, on their wire.
    pub outer_bytes_sent: u64,
    /// Meetings (of a fragment each) completed.
    pub meetings: u64,
}

impl OuterTraffic {
    /// The `local_sgd` block of a `strata train --out` summary, if it has one.
    pub fn from_summary(json: &str) -> Option<Self> {
        let v: serde_json::Value = serde_json::from_str(json).ok()?;
        serde_json::from_value(v.get("local_sgd")?.clone()).ok()
    }
}

/// One line of the report's table.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RunSummary {
    /// The run's name.
    pub name: String,
    /// The strategy.
    pub strategy: String,
    /// The parameter-server mode, if any.
    pub mode: Option<String>,
    /// Replicas or workers.
    pub workers: usize,
    /// Whether the figures are virtual.
    pub simulated: bool,
    /// `ok`, `failed` or `below target`.
    pub status: String,
    /// The failure, if any.
    pub error: Option<String>,
    /// Seconds until the first evaluation that reached the target (accuracy or AUC at or above
    /// it, validation loss at or below it).
    pub time_to_target_s: Option<f64>,
    /// Model updates until then.
    pub updates_to_target: Option<u64>,
    /// The last evaluation's accuracy (the digits models).
    pub final_accuracy: Option<f32>,
    /// The last evaluation's validation loss, nats per character (the transformer).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub final_validation_loss: Option<f32>,
    /// The ctr model's final test AUC: its summary's (`final_test_auc`), else the last
    /// evaluation's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub final_auc: Option<f64>,
    /// The best AUC reachable on the same test records (the planted model's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub best_auc: Option<f64>,
    /// `best_auc - final_auc`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auc_gap: Option<f64>,
    /// A ctr run's bytes a worker pulled per step: the summary's table rows where it has them
    /// (hybrid), else a parameter-server step record's mean `bytes_received` (rows and dense
    /// variables).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pulled_per_step: Option<f64>,
    /// Pushed per step, likewise (`bytes_sent`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pushed_per_step: Option<f64>,
    /// Training examples per second between the first and the last step record.
    pub examples_per_s: Option<f64>,
    /// Examples per second over `workers` times the single-worker run's (the first run with
    /// one worker, of the same kind: real or simulated).
    pub scaling_efficiency: Option<f64>,
    /// Bytes sent and received between processes per training example.
    pub bytes_per_example: Option<f64>,
    /// Bytes each worker sent over the run: the step records' `bytes_sent` (all workers
    /// together) summed, over the workers.
    pub bytes_sent_per_worker: Option<f64>,
    /// Mean staleness of the steps that report one.
    pub mean_staleness: Option<f64>,
    /// Largest staleness seen.
    pub max_staleness: Option<u64>,
    /// Step records.
    pub steps: u64,
    /// Updates applied in the end.
    pub updates: u64,
    /// When the first worker was killed (`[injection] kill`), seconds from the start.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub killed_at_s: Option<f64>,
    /// The longest time without a step record from the first kill on: what the loss cost
    /// before training went on (detection, re-forming or relaunching).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub longest_pause_s: Option<f64>,
    /// Step records trained again after a relaunch from an earlier checkpoint (steps whose
    /// number was already recorded).
    pub steps_repeated: u64,
    /// Relaunches of the whole job.
    pub relaunches: usize,
}

/// The table's figures for every run, against `target`.
pub fn summarize(runs: &[RunResult], target: Target) -> Vec<RunSummary> {
    let mut out: Vec<RunSummary> = runs.iter().map(|r| summarize_one(r, target)).collect();
    for i in 0..out.len() {
        let base = runs
            .iter()
            .zip(&out)
            .find(|(r, s)| r.workers == 1 && r.simulated == runs[i].simulated && s.examples_per_s.is_some())
            .and_then(|(_, s)| s.examples_per_s);
        if let (Some(base), Some(eps)) = (base, out[i].examples_per_s) {
            if base > 0.0 {
                out[i].scaling_efficiency = Some(eps / (base * runs[i].workers.max(1) as f64));
            }
        }
    }
    out
}

fn summarize_one(r: &RunResult, target: Target) -> RunSummary {
    let steps: Vec<&MetricRecord> = r.records.iter().filter(|x| x.kind == RecordKind::Step).collect();
    let evals: Vec<&MetricRecord> = r.records.iter().filter(|x| x.kind == RecordKind::Eval).collect();
    let hit = evals.iter().find(|e| target.reached(e));
    let final_accuracy = evals.last().and_then(|e| e.accuracy);
    let final_validation_loss = evals.last().and_then(|e| e.validation_loss);
    let ctr = ctr_summary(r, &steps, &evals);
    let examples_per_s = match (steps.first(), steps.last()) {
        (Some(a), Some(b)) if b.wall_s > a.wall_s && b.examples > a.examples => {
            Some((b.examples - a.examples) as f64 / (b.wall_s - a.wall_s))
        }
        _ => None,
    };
    let examples = steps.iter().map(|s| s.examples).max().unwrap_or(0);
    let bytes: u64 = steps.iter().map(|s| s.bytes_sent + s.bytes_received).sum();
    let stale: Vec<u64> = steps.iter().filter_map(|s| s.staleness).collect();
    let killed_at_s = r.faults.iter().map(|f| f.wall_s).reduce(f64::min);
    let longest_pause_s = killed_at_s.map(|k| {
        let mut times: Vec<f64> = steps.iter().map(|s| s.wall_s).filter(|t| *t >= k).collect();
        times.sort_by(f64::total_cmp);
        let mut last = k;
        let mut longest: f64 = 0.0;
        for t in times {
            longest = longest.max(t - last);
            last = t;
        }
        // A run that never stepped again paused until it ended.
        if last == k {
            longest = longest.max(r.wall_s - k);
        }
        longest
    });
    let mut highest = 0u64;
    let mut steps_repeated = 0u64;
    for s in &steps {
        if s.step <= highest {
            steps_repeated += 1;
        }
        highest = highest.max(s.step);
    }
    let status = match (&r.error, hit) {
        (Some(_), _) => "failed",
        (None, Some(_)) => "ok",
        (None, None) if target.is_set() => "below target",
        (None, None) => "ok",
    };
    RunSummary {
        name: r.name.clone(),
        strategy: r.strategy.clone(),
        mode: r.mode.clone(),
        workers: r.workers,
        simulated: r.simulated,
        status: status.into(),
        error: r.error.clone(),
        time_to_target_s: hit.map(|e| e.wall_s),
        updates_to_target: hit.map(|e| e.updates),
        final_accuracy,
        final_validation_loss,
        final_auc: ctr.final_auc,
        best_auc: ctr.best_auc,
        auc_gap: ctr.final_auc.zip(ctr.best_auc).map(|(f, b)| b - f),
        pulled_per_step: ctr.pulled,
        pushed_per_step: ctr.pushed,
        examples_per_s,
        scaling_efficiency: None,
        bytes_per_example: (examples > 0).then(|| bytes as f64 / examples as f64),
        bytes_sent_per_worker: (!steps.is_empty())
            .then(|| steps.iter().map(|s| s.bytes_sent).sum::<u64>() as f64 / r.workers.max(1) as f64),
        mean_staleness: (!stale.is_empty()).then(|| stale.iter().sum::<u64>() as f64 / stale.len() as f64),
        max_staleness: stale.iter().copied().max(),
        steps: steps.len() as u64,
        updates: r.records.iter().map(|x| x.updates).max().unwrap_or(0),
        killed_at_s,
        longest_pause_s,
        steps_repeated,
        relaunches: r.relaunches,
    }
}

/// A ctr run's figures of [`RunSummary`].
struct CtrSummary {
    final_auc: Option<f64>,
    best_auc: Option<f64>,
    pulled: Option<f64>,
    pushed: Option<f64>,
}

fn ctr_summary(r: &RunResult, steps: &[&MetricRecord], evals: &[&MetricRecord]) -> CtrSummary {
    let last_eval = evals.iter().rev().find_map(|e| e.auc).map(f64::from).filter(|a| a.is_finite());
    let figures = r.ctr.unwrap_or_default();
    // A parameter-server step record is one worker's step: its pulls and its push.
    let mean = |f: fn(&MetricRecord) -> u64| {
        let ps = r.strategy == "parameter-server" && r.ctr.is_some() && !steps.is_empty();
        ps.then(|| steps.iter().map(|s| f(s) as f64).sum::<f64>() / steps.len() as f64).filter(|m| *m > 0.0)
    };
    CtrSummary {
        final_auc: figures.final_test_auc.or(last_eval),
        best_auc: figures.best_test_auc,
        pulled: figures.table_bytes_pulled_per_step.or_else(|| mean(|s| s.bytes_received)),
        pushed: figures.table_bytes_pushed_per_step.or_else(|| mean(|s| s.bytes_sent)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(name: &str, workers: usize, records: Vec<MetricRecord>) -> RunResult {
        RunResult {
            name: name.into(),
            strategy: "mirrored".into(),
            mode: None,
            workers,
            global_batch: 8,
            simulated: false,
            records,
            error: None,
            wall_s: 10.0,
            hosts: 0,
            link_goodput_bps: None,
            faults: Vec::new(),
            relaunches: 0,
            local_sgd: None,
            ctr: None,
        }
    }

    #[test]
    fn a_local_sgd_summary_gives_its_outer_traffic() {
        let json = r#"{"model":"transformer","local_sgd":{"sync_every":100,"outer_optimizer":"average","fragments":1,"delay":0,"wire":"none","outer_bytes_sent":39201840,"meetings":12}}"#;
        assert_eq!(OuterTraffic::from_summary(json), Some(OuterTraffic { outer_bytes_sent: 39_201_840, meetings: 12 }));
        assert_eq!(OuterTraffic::from_summary(r#"{"model":"mlp"}"#), None);
        assert_eq!(OuterTraffic::from_summary("not json"), None);
    }

    #[test]
    fn summary_figures_follow_from_the_records() {
        let mut a = vec![
            MetricRecord::step(1, 1, 1.0, 100, 2.0),
            MetricRecord::step(2, 2, 2.0, 200, 1.5),
            MetricRecord::eval(2, 2, 2.5, 200, 0.5),
            MetricRecord::step(3, 3, 3.0, 300, 1.0),
            MetricRecord::eval(3, 3, 3.5, 300, 0.9),
        ];
        a[1].bytes_sent = 500;
        a[3].bytes_received = 100;
        a[3].staleness = Some(4);
        a[1].staleness = Some(0);
        let b = vec![MetricRecord::step(1, 1, 1.0, 100, 2.0), MetricRecord::step(2, 2, 1.25, 400, 1.0)];
        let mut failed = run("c", 2, vec![]);
        failed.error = Some("boom".into());
        let s = summarize(&[run("a", 1, a), run("b", 2, b), failed], Target::Accuracy(0.8));
        assert_eq!(s[0].status, "ok");
        assert_eq!(s[0].time_to_target_s, Some(3.5));
        assert_eq!(s[0].updates_to_target, Some(3));
        assert_eq!(s[0].final_accuracy, Some(0.9));
        assert_eq!(s[0].examples_per_s, Some(100.0));
        assert_eq!(s[0].scaling_efficiency, Some(1.0));
        assert_eq!(s[0].bytes_per_example, Some(2.0));
        assert_eq!(s[0].mean_staleness, Some(2.0));
        assert_eq!(s[0].max_staleness, Some(4));
        assert_eq!(s[1].status, "below target");
        assert_eq!(s[1].examples_per_s, Some(1200.0));
        assert_eq!(s[1].scaling_efficiency, Some(6.0));
        assert_eq!(s[2].status, "failed");
        assert_eq!(s[2].error.as_deref(), Some("boom"));
    }

    #[test]
    fn a_ctr_summary_gives_its_aucs_and_table_bytes() {
        let json = r#"{"model":"ctr","final_test_auc":0.81,"best_test_auc":0.84,"parameter_servers":{"mode":"hybrid","table_bytes_pulled_per_step":1000.5,"table_bytes_pushed_per_step":900}}"#;
        let c = CtrFigures::from_summary(json).unwrap();
        assert_eq!((c.final_test_auc, c.best_test_auc), (Some(0.81), Some(0.84)));
        assert_eq!((c.table_bytes_pulled_per_step, c.table_bytes_pushed_per_step), (Some(1000.5), Some(900.0)));
        let top =
            CtrFigures::from_summary(r#"{"final_test_auc":null,"best_test_auc":0.8,"table_bytes_pulled_per_step":7}"#);
        assert_eq!(top.map(|c| (c.final_test_auc, c.table_bytes_pulled_per_step)), Some((None, Some(7.0))));
        assert_eq!(CtrFigures::from_summary(r#"{"model":"mlp","final_test_accuracy":0.9}"#), None);
        assert_eq!(CtrFigures::from_summary("{"), None);
    }

    #[test]
    fn a_ctr_run_s_figures_are_its_auc_the_gap_and_its_bytes_per_step() {
        let mut steps: Vec<MetricRecord> = (1..=4).map(|k| MetricRecord::step(k, k, k as f64, k * 128, 0.6)).collect();
        for (k, s) in steps.iter_mut().enumerate() {
            (s.bytes_received, s.bytes_sent) = (1000 + 100 * k as u64, 800);
        }
        let mut records = steps.clone();
        records.insert(2, MetricRecord::eval_auc(2, 2, 2.5, 256, 0.70));
        records.push(MetricRecord::eval_auc(4, 4, 4.5, 512, 0.78));
        let mut ps = run("ps-async", 2, records.clone());
        ps.strategy = "parameter-server".into();
        ps.ctr = Some(CtrFigures { final_test_auc: Some(0.78), best_test_auc: Some(0.83), ..Default::default() });
        let mut hybrid = ps.clone();
        hybrid.name = "ps-hybrid".into();
        hybrid.ctr = Some(CtrFigures {
            final_test_auc: None,
            best_test_auc: Some(0.83),
            table_bytes_pulled_per_step: Some(400.0),
            table_bytes_pushed_per_step: Some(300.0),
        });
        let one = run("one-device", 1, records);
        let s = summarize(&[ps, hybrid, one], Target::Auc(Some(0.75)));
        assert_eq!((s[0].status.as_str(), s[0].time_to_target_s, s[0].updates_to_target), ("ok", Some(4.5), Some(4)));
        assert_eq!((s[0].final_auc, s[0].best_auc), (Some(0.78), Some(0.83)));
        assert!((s[0].auc_gap.unwrap() - 0.05).abs() < 1e-12);
        // A parameter-server step record is one worker step: the means of its bytes.
        assert_eq!((s[0].pulled_per_step, s[0].pushed_per_step), (Some(1150.0), Some(800.0)));
        // The summary's table bytes where it has them; the last evaluation's AUC where it has none.
        assert_eq!((s[1].pulled_per_step, s[1].pushed_per_step), (Some(400.0), Some(300.0)));
        assert_eq!(s[1].final_auc, Some(f64::from(0.78f32)));
        // Not a ctr summary: no bytes per step, the AUC from the records, no best.
        assert_eq!((s[2].pulled_per_step, s[2].best_auc, s[2].auc_gap), (None, None, None));
        // Without a target a finished run is ok, never "below target".
        let s = summarize(&[run("one-device", 1, steps)], Target::Auc(None));
        assert_eq!((s[0].status.as_str(), s[0].time_to_target_s, s[0].final_auc), ("ok", None, None));
    }

    #[test]
    fn a_loss_target_is_reached_at_or_below_it() {
        let evals = vec![
            MetricRecord::step(1, 1, 1.0, 100, 4.1),
            MetricRecord::eval_loss(1, 1, 1.5, 100, 3.0),
            MetricRecord::eval_loss(2, 2, 2.5, 200, 1.9),
            MetricRecord::eval_loss(3, 3, 3.5, 300, 1.7),
        ];
        let s = summarize(&[run("t", 1, evals.clone())], Target::Loss(1.9));
        assert_eq!((s[0].status.as_str(), s[0].time_to_target_s, s[0].updates_to_target), ("ok", Some(2.5), Some(2)));
        assert_eq!((s[0].final_accuracy, s[0].final_validation_loss), (None, Some(1.7)));
        let s = summarize(&[run("t", 1, evals)], Target::Loss(1.5));
        assert_eq!((s[0].status.as_str(), s[0].time_to_target_s), ("below target", None));
        assert!(!Target::Accuracy(0.5).reached(&MetricRecord::eval_loss(1, 1, 1.0, 1, 0.1)));
    }

    #[test]
    fn a_kill_gives_the_longest_pause_after_it_and_the_steps_trained_again() {
        // Steps 1..4, a kill at 4.5 s, a relaunch that resumes after step 2 at 7 s.
        let mut r = run(
            "restart",
            3,
            [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (3, 7.0), (4, 7.5), (5, 8.0)]
                .into_iter()
                .map(|(k, t)| MetricRecord::step(k, k, t, k * 8, 1.0))
                .collect(),
        );
        r.faults = vec![faults::FaultEvent { worker: 1, at_step: 4, step: 4, wall_s: 4.5 }];
        r.relaunches = 1;
        let s = summarize(&[r.clone()], Target::Accuracy(0.5)).remove(0);
        assert_eq!((s.killed_at_s, s.longest_pause_s), (Some(4.5), Some(2.5)));
        assert_eq!((s.steps_repeated, s.relaunches), (2, 1));
        // A run that never stepped after the kill paused until it ended (wall_s 10).
        r.records.truncate(4);
        let s = summarize(&[r], Target::Accuracy(0.5)).remove(0);
        assert_eq!(s.longest_pause_s, Some(5.5));
    }
}
