//! `strata compare`'s output directory: files, plots (decoded as images), CSV, JSON, report.
//!
//! Set `STRATA_SAMPLE_DIR` to keep the rendered sample outputs there for a look.

use std::path::{Path, PathBuf};
use std::time::Duration;

use strata::metrics::MetricRecord;
use strata_compare::experiment::{Experiment, Injection};
use strata_compare::report::{self, write_outputs, CSV_COLUMNS, SIMULATED_LINE};
use strata_compare::{plot, RunResult};

fn experiment(name: &str) -> Experiment {
    Experiment {
        path: PathBuf::from(format!("experiments/{name}.toml")),
        name: name.into(),
        description: "Synthetic runs for the report's tests.".into(),
        model: strata_compare::experiment::RunModel::Mlp,
        hidden: vec![64, 32],
        steps: None,
        transformer: None,
        ctr: None,
        epochs: 3,
        global_batch: 64,
        lr: 0.01,
        optimizer: "adamw".into(),
        seed: 7,
        target: strata_compare::Target::Accuracy(0.9),
        data: None,
        run_timeout: Duration::from_secs(600),
        runs: vec![],
        injection: Injection { slowdown: vec![(1, 3.0)], ..Default::default() },
        simulate: None,
        network: None,
    }
}

/// A run of `steps` steps: loss falling from 2.3, accuracy rising to `final_acc`, every
/// `every` steps an evaluation; `speed` examples per second.
fn run(
    name: &str,
    strategy: &str,
    mode: Option<&str>,
    workers: usize,
    steps: u64,
    speed: f64,
    final_acc: f32,
) -> RunResult {
    let batch = 64u64;
    let mut records = Vec::new();
    for s in 1..=steps {
        let t = (s * batch) as f64 / speed;
        let frac = s as f32 / steps as f32;
        let wobble = if s % 2 == 0 { 0.05 } else { -0.05 };
        let mut r = MetricRecord::step(s, s, t, s * batch, 2.3 * (1.0 - frac) + 0.1 + wobble);
        if mode.is_some() {
            r.staleness = Some(if mode == Some("async") { s % (workers as u64 + 2) } else { 0 });
            r.worker = Some((s % workers as u64) as u32);
            r.bytes_sent = 1000;
            r.bytes_received = 1500;
        }
        records.push(r);
        if s % 10 == 0 || s == steps {
            records.push(MetricRecord::eval(s, s, t + 0.01, s * batch, 0.1 + (final_acc - 0.1) * frac));
        }
    }
    RunResult {
        name: name.into(),
        strategy: strategy.into(),
        mode: mode.map(str::to_string),
        workers,
        global_batch: batch as usize,
        simulated: false,
        wall_s: (steps * batch) as f64 / speed,
        records,
        error: None,
        hosts: 0,
        link_goodput_bps: None,
        faults: Vec::new(),
        relaunches: 0,
        local_sgd: None,
        ctr: None,
    }
}

fn sample_runs() -> Vec<RunResult> {
    let mut failed = run("multi-worker-mirrored", "multi-worker-mirrored", None, 2, 0, 1.0, 0.0);
    failed.error = Some("worker 1 exited with status 3 | see worker-1.log".into());
    let mut nan = run("ps-sync", "parameter-server", Some("sync"), 4, 60, 2000.0, 0.92);
    nan.records[5].loss = Some(f32::NAN);
    nan.records[7].loss = Some(f32::INFINITY);
    vec![
        run("one-device", "one-device", None, 1, 80, 1000.0, 0.95),
        run("mirrored", "mirrored", None, 2, 80, 1800.0, 0.94),
        run("ps-async", "parameter-server", Some("async"), 4, 120, 3000.0, 0.91),
        nan,
        failed,
    ]
}

fn sweep_runs() -> Vec<RunResult> {
    let mut out = Vec::new();
    for (base, mode, eff) in
        [("ps-async", "async", 0.9f64), ("ps-sync", "sync", 0.6), ("ps-sync-backup", "sync, 1 backup", 0.75)]
    {
        for k in 0..=8 {
            let n = 1usize << k;
            let speed = 1000.0 * n as f64 * eff.powf(k as f64 / 2.0);
            let mut r =
                run(&format!("{base}/N={n}"), "parameter-server", Some(mode), n, 40 + 5 * k as u64, speed, 0.93);
            r.simulated = true;
            for m in &mut r.records {
                m.staleness = m.staleness.map(|s| if mode == "async" { s.min(n as u64) } else { 0 });
            }
            out.push(r);
        }
    }
    out
}

fn out_dir(name: &str) -> (Option<tempfile::TempDir>, PathBuf) {
    match std::env::var_os("STRATA_SAMPLE_DIR") {
        Some(d) => (None, PathBuf::from(d).join(name)),
        None => {
            let t = tempfile::tempdir().unwrap();
            let p = t.path().join(name);
            (Some(t), p)
        }
    }
}

/// Decodes a PNG and checks its size and that it is not blank.
fn check_png(path: &Path, width: u32, min_height: u32, series: &[plotters::style::RGBColor]) {
    let img = image::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())).to_rgb8();
    assert_eq!(img.width(), width, "{}", path.display());
    assert!(img.height() >= min_height, "{}", path.display());
    let mut colours = std::collections::HashSet::new();
    let mut non_white = 0usize;
    for p in img.pixels() {
        colours.insert(p.0);
        if p.0 != [255, 255, 255] {
            non_white += 1;
        }
    }
    assert!(colours.len() > 20, "{}: only {} colours", path.display(), colours.len());
    assert!(non_white > 5000, "{}: only {non_white} non-white pixels", path.display());
    for c in series {
        let want = [c.0, c.1, c.2];
        assert!(
            img.pixels().filter(|p| p.0 == want).count() > 30,
            "{}: series colour {want:?} missing",
            path.display()
        );
    }
}

#[test]
fn real_runs_give_every_file_and_readable_plots() {
    let (_keep, dir) = out_dir("real");
    let exp = experiment("digits-test");
    let runs = sample_runs();
    let out = write_outputs(&dir, &exp, &runs, false).unwrap();

    let names: Vec<&str> = out.plots.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "loss_vs_time",
            "accuracy_vs_steps",
            "examples_per_second",
            "staleness_histogram",
            "accuracy_vs_time",
            "loss_vs_bytes"
        ]
    );
    for f in out.files() {
        assert!(f.is_file(), "{} missing", f.display());
    }
    for f in ["runs.csv", "summary.json", "REPORT.md", "loss_vs_time.png", "loss_vs_time.svg"] {
        assert!(dir.join(f).is_file(), "{f} missing");
    }

    // Plots: decodable, right size, not blank, the first runs' colours drawn.
    for p in &out.plots {
        let series: Vec<_> = match p.name.as_str() {
            "staleness_histogram" => vec![plot::color(2)],
            // Only the parameter-server runs sent bytes.
            "loss_vs_bytes" => vec![plot::color(2), plot::color(3)],
            _ => vec![plot::color(0), plot::color(1)],
        };
        check_png(&p.png, plot::WIDTH, plot::HEIGHT, &series);
        let svg = std::fs::read_to_string(&p.svg).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{}", p.svg.display());
        assert!(svg.contains(&p.title), "{} lacks its title {:?}", p.svg.display(), p.title);
        assert!(!p.title.contains("simulated"));
        assert!(!p.empty, "{}", p.name);
    }
    assert!(out.plots[0].title.starts_with("Training loss against wall time"));
    assert!(out.plots[1].title.starts_with("Test accuracy against model updates"));

    // runs.csv: a header and one row per record, values round-trip.
    let csv = std::fs::read_to_string(&out.runs_csv).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    let records: usize = runs.iter().map(|r| r.records.len()).sum();
    assert_eq!(lines.len(), 1 + records);
    assert_eq!(lines[0], CSV_COLUMNS.join(","));
    let row: Vec<&str> = lines[1].split(',').collect();
    let col = |name: &str| CSV_COLUMNS.iter().position(|c| *c == name).unwrap();
    assert_eq!(row.len(), CSV_COLUMNS.len());
    assert_eq!(row[col("run")], "one-device");
    assert_eq!(row[col("kind")], "step");
    assert_eq!(row[col("mode")], "");
    assert_eq!(row[col("staleness")], "");
    assert_eq!(row[col("accuracy")], "");
    assert_eq!(row[col("wall_s")].parse::<f64>().unwrap(), runs[0].records[0].wall_s);
    assert_eq!(row[col("loss")].parse::<f32>().unwrap(), runs[0].records[0].loss.unwrap());
    let eval = lines.iter().find(|l| l.contains(",eval,")).unwrap();
    let eval: Vec<&str> = eval.split(',').collect();
    assert_eq!(eval[col("loss")], "");
    assert_eq!(eval[col("accuracy")].parse::<f32>().unwrap(), runs[0].records[10].accuracy.unwrap());
    let ps = lines.iter().find(|l| l.starts_with("ps-async,")).unwrap();
    let ps: Vec<&str> = ps.split(',').collect();
    assert_eq!(ps[col("mode")], "async");
    assert_eq!(ps[col("staleness")], "1");
    assert_eq!(ps[col("bytes_sent")], "1000");
    assert_eq!(report::csv_field("a,\"b\""), "\"a,\"\"b\"\"\"");

    // summary.json: settings, injection, the summary's figures and the error.
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out.summary_json).unwrap()).unwrap();
    assert_eq!(json["simulated"], false);
    assert_eq!(json["experiment"]["name"], "digits-test");
    assert_eq!(json["experiment"]["global_batch"], 64);
    assert_eq!(json["injection"][0], "worker 1 is 3x slower");
    let jruns = json["runs"].as_array().unwrap();
    assert_eq!(jruns.len(), runs.len());
    let s0 = &out.summaries[0];
    assert_eq!(jruns[0]["name"], "one-device");
    assert_eq!(jruns[0]["examples_per_s"].as_f64(), s0.examples_per_s);
    assert_eq!(jruns[0]["time_to_target_s"].as_f64(), s0.time_to_target_s);
    assert_eq!(jruns[0]["status"], "ok");
    assert_eq!(jruns[4]["status"], "failed");
    assert_eq!(jruns[4]["error"], "worker 1 exited with status 3 | see worker-1.log");
    assert!(jruns[0]["error"].is_null());

    // REPORT.md: a row per run, the error (escaped), the plots, no simulated line.
    let md = std::fs::read_to_string(&out.report_md).unwrap();
    for s in &out.summaries {
        assert!(md.contains(&report::table_row(s)), "row of {} missing", s.name);
    }
    assert!(md.contains("| one-device | one-device | — | 1 | ok |"));
    assert!(md.contains("failed: worker 1 exited with status 3 \\| see worker-1.log"));
    assert!(md.contains("![Training loss against wall time](loss_vs_time.png)"));
    assert!(md.contains("![Training loss against bytes sent per worker](loss_vs_bytes.png)"), "{md}");
    assert!(md.contains("| bytes sent per worker |"));
    assert!(md.contains("## What it shows"));
    assert!(md.contains("`ps-sync` reached 90.00% first"), "{md}");
    assert!(!md.contains(SIMULATED_LINE));
    assert!(!md.contains("simulated"));
}

#[test]
fn a_simulated_sweep_adds_the_scaling_plots_and_says_it_is_simulated() {
    let (_keep, dir) = out_dir("sweep");
    let mut exp = experiment("sweep-test");
    exp.injection = Injection::default();
    let runs = sweep_runs();
    let out = write_outputs(&dir, &exp, &runs, true).unwrap();
    let names: Vec<&str> = out.plots.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "loss_vs_time",
            "accuracy_vs_steps",
            "examples_per_second",
            "staleness_histogram",
            "accuracy_vs_time",
            "loss_vs_bytes",
            "scaling",
            "scaling_efficiency",
            "time_to_target_vs_workers"
        ]
    );
    for p in &out.plots {
        assert!(p.title.ends_with("(simulated)"), "{}", p.title);
        let min_h = plot::HEIGHT;
        check_png(&p.png, plot::WIDTH, min_h, &[plot::color(0), plot::color(1), plot::color(2)]);
        assert!(std::fs::read_to_string(&p.svg).unwrap().contains(&p.title));
    }
    // 27 runs: the line plots show one worker count.
    assert!(out.plots[0].note.as_deref().unwrap_or_default().contains("workers"), "{:?}", out.plots[0].note);
    let md = std::fs::read_to_string(&out.report_md).unwrap();
    assert!(md.contains(SIMULATED_LINE));
    assert!(md.contains("(virtual)"));
    assert!(md.contains("![Throughput against worker count (simulated)](scaling.png)"));
    assert!(md.contains("![Scaling efficiency against worker count (simulated)](scaling_efficiency.png)"));
    assert!(md.contains("Scaling efficiency at each strategy's largest worker count"));
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out.summary_json).unwrap()).unwrap();
    assert_eq!(json["simulated"], true);
}

#[test]
fn no_records_at_all_does_not_panic() {
    let (_keep, dir) = out_dir("empty");
    let exp = experiment("empty");
    let mut failed = run("ps-async", "parameter-server", Some("async"), 2, 0, 1.0, 0.0);
    failed.error = Some("could not start:\nport in use".into());
    let runs = vec![run("one-device", "one-device", None, 1, 0, 1.0, 0.0), failed];
    let out = write_outputs(&dir, &exp, &runs, false).unwrap();
    for p in &out.plots {
        assert!(p.empty, "{}", p.name);
        check_png(&p.png, plot::WIDTH, plot::HEIGHT, &[]);
    }
    let csv = std::fs::read_to_string(&out.runs_csv).unwrap();
    assert_eq!(csv.lines().count(), 1);
    let md = std::fs::read_to_string(&out.report_md).unwrap();
    assert!(md.contains("failed: could not start:<br>port in use"));
    assert!(md.contains("| one-device | one-device | — | 1 | below target | — |"));

    // No runs at all, and a single point each.
    write_outputs(&dir.join("none"), &exp, &[], true).unwrap();
    let one = vec![run("one-device", "one-device", None, 1, 1, 100.0, 0.5)];
    let out = write_outputs(&dir.join("one"), &exp, &one, false).unwrap();
    assert!(!out.plots[0].empty);
    let sweep_one = vec![run("ps-async/N=4", "parameter-server", Some("async"), 4, 1, 100.0, 0.5)];
    write_outputs(&dir.join("sweep-one"), &exp, &sweep_one, true).unwrap();
}

/// A ctr run: `run`'s records with the evaluations' accuracy turned into an AUC rising from
/// 0.6 to `final_auc`, and its summary's figures (the best reachable 0.83).
fn ctr_run(name: &str, mode: &str, steps: u64, speed: f64, final_auc: f64, table_bytes: Option<f64>) -> RunResult {
    let mut r = run(name, "parameter-server", Some(mode), 2, steps, speed, 0.5);
    for m in r.records.iter_mut().filter(|m| m.kind == strata::metrics::RecordKind::Eval) {
        let frac = m.step as f64 / steps as f64;
        m.accuracy = None;
        m.auc = Some((0.6 + (final_auc - 0.6) * frac) as f32);
    }
    r.ctr = Some(strata_compare::results::CtrFigures {
        final_test_auc: Some(final_auc),
        best_test_auc: Some(0.83),
        table_bytes_pulled_per_step: table_bytes,
        table_bytes_pushed_per_step: table_bytes.map(|b| b / 2.0),
    });
    r
}

#[test]
fn a_ctr_report_shows_the_auc_its_gap_and_the_bytes_per_step_instead_of_accuracy() {
    let (_keep, dir) = out_dir("ctr");
    let mut exp = experiment("ctr-test");
    exp.model = strata_compare::experiment::RunModel::Ctr;
    exp.hidden = Vec::new();
    exp.injection = Injection::default();
    exp.ctr = Some(strata_compare::experiment::CtrSettings { embedding_rows: Some(1_000_000), ..Default::default() });
    exp.target = strata_compare::Target::Auc(Some(0.75));
    let mut failed = ctr_run("ps-broken", "async", 0, 1.0, 0.0, None);
    failed.error = Some("ps:1 exited with code 1".into());
    failed.ctr = None;
    let runs = vec![
        ctr_run("ps-async", "async", 100, 3000.0, 0.80, None),
        ctr_run("ps-sync", "sync", 100, 2000.0, 0.79, None),
        ctr_run("ps-hybrid", "hybrid", 100, 2500.0, 0.81, Some(4000.0)),
        failed,
    ];
    let out = write_outputs(&dir, &exp, &runs, false).unwrap();
    let names: Vec<&str> = out.plots.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
        ["loss_vs_time", "auc_vs_time", "auc_vs_steps", "examples_per_second", "staleness_histogram", "loss_vs_bytes"]
    );
    for p in out.plots.iter().filter(|p| p.name.starts_with("auc_")) {
        check_png(&p.png, plot::WIDTH, plot::HEIGHT, &[plot::color(0), plot::color(1), plot::color(2)]);
        let svg = std::fs::read_to_string(&p.svg).unwrap();
        assert!(svg.contains("target 0.7500") && svg.contains("best reachable 0.8300"), "{}", p.svg.display());
    }

    let md = std::fs::read_to_string(&out.report_md).unwrap();
    assert!(
        md.contains("| run | strategy | mode | workers | status | time to AUC 0.7500 | updates to target | final AUC | gap to best | examples/s | pulled / pushed per step | bytes sent per worker | staleness mean / max |"),
        "{md}"
    );
    assert!(!md.contains("final accuracy") && !md.contains("accuracy_vs"), "{md}");
    assert!(md.contains("| ps-hybrid | parameter-server | hybrid | 2 | ok |"), "{md}");
    // The AUC, its gap to the best reachable, and the bytes: the hybrid's from its summary, the
    // others' the mean of their step records.
    assert!(md.contains("| 0.8100 | 0.0200 |") && md.contains("| 4.00 kB / 2.00 kB |"), "{md}");
    assert!(md.contains("| 0.8000 | 0.0300 |") && md.contains("| 1.50 kB / 1.00 kB |"), "{md}");
    assert!(md.contains("the best reachable, the planted model's, is 0.8300"), "{md}");
    assert!(md.contains("embedding table of 1,000,000 rows"), "{md}");
    assert!(md.contains("Highest final AUC: `ps-hybrid` at 0.8100, 0.0200 below the best reachable"), "{md}");
    assert!(md.contains("`ps-hybrid` against `ps-async` on 2 workers:"), "{md}");
    assert!(md.contains("failed: ps:1 exited with code 1") && md.contains("### Failed runs"), "{md}");
    let csv = std::fs::read_to_string(&out.runs_csv).unwrap();
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    let auc = header.iter().position(|h| *h == "auc").unwrap();
    assert!(csv.lines().filter(|l| l.contains(",eval,")).all(|l| l
        .split(',')
        .nth(auc)
        .unwrap()
        .parse::<f64>()
        .is_ok()));
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out.summary_json).unwrap()).unwrap();
    assert_eq!(json["experiment"]["target_auc"], 0.75);
    assert_eq!(json["experiment"]["ctr"]["embedding_rows"], 1_000_000);
    assert_eq!(json["runs"][2]["final_auc"], 0.81);

    // Without a target: no time-to-target columns, and a finished run is ok.
    exp.target = strata_compare::Target::Auc(None);
    let out = write_outputs(&dir.join("no-target"), &exp, &runs[..1], false).unwrap();
    let md = std::fs::read_to_string(&out.report_md).unwrap();
    assert!(md.contains("| ps-async | parameter-server | async | 2 | ok | 0.8000 | 0.0300 |"), "{md}");
    assert!(!md.contains("time to") && md.contains("Target: none set"), "{md}");
}
