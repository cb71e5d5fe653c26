//! Simulated mode (`strata compare --simulate`): orderings and closed forms that hold by
//! construction of the model.

use std::path::PathBuf;
use std::time::Duration;

use strata::metrics::{MetricRecord, RecordKind};
use strata::model::Mlp;
use strata_compare::experiment::{Experiment, Injection, PsMode, RunSpec, RunStrategy, Stragglers};
use strata_compare::simulate::{simulate, SimConfig};
use strata_compare::{summarize, RunResult};
use strata_core::cross_device::compression::Compression;

fn spec(name: &str, strategy: RunStrategy, mode: Option<PsMode>, backup_workers: usize, staleness: u64) -> RunSpec {
    RunSpec {
        name: name.into(),
        strategy,
        replicas: 1,
        workers: 1,
        ps_tasks: 1,
        mode,
        backup_workers,
        staleness,
        timeout: None,
        compression: Compression::None,
        min_workers: None,
        restarts: 0,
        checkpoint_every: None,
        faults: true,
        zero_stage: strata_core::ZeroStage::Off,
        recompute: false,
        local_sgd: None,
    }
}

fn experiment(runs: Vec<RunSpec>, injection: Injection) -> Experiment {
    Experiment {
        path: PathBuf::from("sim.toml"),
        name: "sim".into(),
        description: String::new(),
        model: strata_compare::experiment::RunModel::Mlp,
        hidden: vec![32],
        steps: None,
        transformer: None,
        ctr: None,
        epochs: 1,
        global_batch: 32,
        lr: 0.003,
        optimizer: "adamw".into(),
        seed: 0,
        target: strata_compare::Target::Accuracy(0.9),
        data: None,
        run_timeout: Duration::from_secs(60),
        runs,
        injection,
        simulate: None,
        network: None,
    }
}

fn all_specs() -> Vec<RunSpec> {
    vec![
        spec("one-device", RunStrategy::OneDevice, None, 0, 0),
        spec("mirrored", RunStrategy::Mirrored, None, 0, 0),
        spec("central-storage", RunStrategy::CentralStorage, None, 0, 0),
        spec("mwm", RunStrategy::MultiWorkerMirrored, None, 0, 0),
        spec("ps-sync", RunStrategy::ParameterServer, Some(PsMode::Sync), 0, 0),
        spec("ps-backup", RunStrategy::ParameterServer, Some(PsMode::Sync), 1, 0),
        spec("ps-async", RunStrategy::ParameterServer, Some(PsMode::Async), 0, 0),
        spec("ps-stale", RunStrategy::ParameterServer, Some(PsMode::Stale), 0, 4),
    ]
}

fn run<'a>(runs: &'a [RunResult], name: &str) -> &'a RunResult {
    runs.iter().find(|r| r.name == name).unwrap_or_else(|| panic!("no run {name}"))
}

fn steps(r: &RunResult) -> impl Iterator<Item = &MetricRecord> {
    r.records.iter().filter(|x| x.kind == RecordKind::Step)
}

fn ttt(runs: &[RunResult], target: f32, name: &str) -> f64 {
    let s = summarize(runs, strata_compare::Target::Accuracy(target));
    let s = s.iter().find(|s| s.name == name).unwrap();
    s.time_to_target_s.unwrap_or_else(|| panic!("{name} never reached {target}: {s:?}"))
}

fn quiet(_: &str, _: f64) {}

/// Parameters of the default model (64 inputs, hidden [32], 10 classes).
fn model_bytes(hidden: &[usize]) -> f64 {
    4.0 * Mlp::parameter_count(64, hidden, 10) as f64
}

#[test]
fn with_a_3x_straggler_async_and_backup_workers_reach_the_target_sooner_than_sync() {
    let exp = experiment(
        vec![
            spec("sync", RunStrategy::ParameterServer, Some(PsMode::Sync), 0, 0),
            spec("backup", RunStrategy::ParameterServer, Some(PsMode::Sync), 1, 0),
            spec("async", RunStrategy::ParameterServer, Some(PsMode::Async), 0, 0),
            spec("mirrored", RunStrategy::Mirrored, None, 0, 0),
        ],
        Injection { slowdown: vec![(1, 3.0)], ..Default::default() },
    );
    let cfg = SimConfig { workers: vec![4], max_updates: 300, ..Default::default() };
    let runs = simulate(&exp, &cfg, &quiet).unwrap();
    assert!(runs.iter().all(|r| r.simulated && r.workers == 4 && r.global_batch == 128 && r.error.is_none()));
    let target = 0.9;
    let (sync, backup, asy, mirrored) = (
        ttt(&runs, target, "sync"),
        ttt(&runs, target, "backup"),
        ttt(&runs, target, "async"),
        ttt(&runs, target, "mirrored"),
    );
    println!("time to {target}: sync {sync:.3} s, mirrored {mirrored:.3} s, backup {backup:.3} s, async {asy:.3} s");
    // Every sync round waits for the 3x worker; backups and async do not.
    assert!(backup < 0.6 * sync, "backup {backup} vs sync {sync}");
    assert!(asy < 0.6 * sync, "async {asy} vs sync {sync}");
    assert!(backup < 0.6 * mirrored && asy < 0.6 * mirrored);
}

#[test]
fn without_stragglers_sync_is_at_least_as_accurate_as_async_per_update() {
    let exp = experiment(
        vec![
            spec("sync", RunStrategy::ParameterServer, Some(PsMode::Sync), 0, 0),
            spec("async", RunStrategy::ParameterServer, Some(PsMode::Async), 0, 0),
        ],
        Injection::default(),
    );
    let cfg = SimConfig { workers: vec![8], max_updates: 300, ..Default::default() };
    let runs = simulate(&exp, &cfg, &quiet).unwrap();
    let evals = |name: &str| -> Vec<(u64, f32)> {
        run(&runs, name)
            .records
            .iter()
            .filter(|x| x.kind == RecordKind::Eval)
            .map(|x| (x.updates, x.accuracy.unwrap()))
            .collect()
    };
    let (sync, asy) = (evals("sync"), evals("async"));
    assert_eq!(sync.iter().map(|e| e.0).collect::<Vec<_>>(), asy.iter().map(|e| e.0).collect::<Vec<_>>());
    assert_eq!(sync.len(), 30);
    let s = summarize(&runs, strata_compare::Target::Accuracy(0.9));
    let (us, ua) = (s[0].updates_to_target.unwrap(), s[1].updates_to_target.unwrap_or(u64::MAX));
    println!("updates to 0.9: sync {us}, async {ua}");
    assert!(us <= ua);
    let mean = |v: &[(u64, f32)]| v.iter().map(|e| e.1).sum::<f32>() / v.len() as f32;
    println!("mean accuracy over the evaluations: sync {}, async {}", mean(&sync), mean(&asy));
    assert!(mean(&sync) >= mean(&asy));
    assert!(sync.last().unwrap().1 >= asy.last().unwrap().1);
}

#[test]
fn the_same_seed_gives_the_same_records() {
    let exp = experiment(
        all_specs(),
        Injection {
            slowdown: vec![(0, 2.0)],
            stragglers: Some(Stragglers { probability: 0.3, delay: "exp:5ms".parse().unwrap() }),
            network_delay: Duration::from_micros(100),
            ..Default::default()
        },
    );
    let cfg = SimConfig { workers: vec![1, 3], max_updates: 40, ..Default::default() };
    let a = simulate(&exp, &cfg, &quiet).unwrap();
    let b = simulate(&exp, &cfg, &quiet).unwrap();
    let names: Vec<&str> = a.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "one-device/N=1",
            "mirrored/N=1",
            "mirrored/N=3",
            "central-storage/N=1",
            "central-storage/N=3",
            "mwm/N=1",
            "mwm/N=3",
            "ps-sync/N=1",
            "ps-sync/N=3",
            "ps-backup/N=3",
            "ps-async/N=1",
            "ps-async/N=3",
            "ps-stale/N=1",
            "ps-stale/N=3",
        ]
    );
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.records, y.records, "{}", x.name);
        assert_eq!(x.wall_s, y.wall_s);
        assert_eq!(x.mode, y.mode);
    }
    assert_eq!(run(&a, "ps-backup/N=3").mode.as_deref(), Some("sync, 1 backup"));
    assert_eq!(run(&a, "ps-stale/N=3").mode.as_deref(), Some("stale <= 4"));
    assert_eq!(run(&a, "mwm/N=3").strategy, "multi-worker-mirrored");
    let other = simulate(&exp, &SimConfig { seed: Some(7), ..cfg }, &quiet).unwrap();
    assert_ne!(other[2].records, a[2].records, "another seed trains differently");
}

#[test]
fn staleness_is_zero_for_sync_and_positive_for_async() {
    let exp = experiment(all_specs(), Injection::default());
    let cfg = SimConfig { workers: vec![1, 4], max_updates: 60, ..Default::default() };
    let runs = simulate(&exp, &cfg, &quiet).unwrap();
    for name in ["ps-sync/N=1", "ps-sync/N=4", "ps-backup/N=4", "ps-async/N=1", "ps-stale/N=1"] {
        assert!(steps(run(&runs, name)).filter(|s| !s.dropped).all(|s| s.staleness == Some(0)), "{name}");
    }
    for name in ["mirrored/N=4", "central-storage/N=4", "one-device/N=1"] {
        assert!(steps(run(&runs, name)).all(|s| s.staleness.is_none()), "{name}");
    }
    let asy: Vec<u64> = steps(run(&runs, "ps-async/N=4")).filter_map(|s| s.staleness).collect();
    assert_eq!(asy.len(), 60);
    assert!(asy.iter().any(|&s| s > 0), "{asy:?}");
    // One pull and one push per applied async update.
    let r = run(&runs, "ps-async/N=4");
    let m = model_bytes(&[32]) as u64;
    assert!(steps(r).all(|s| s.bytes_sent == m && s.bytes_received == m && s.worker.is_some()));
    assert_eq!(steps(r).last().unwrap().updates, 60);
}

#[test]
fn stale_mode_never_applies_a_push_beyond_the_bound() {
    let exp = experiment(
        vec![spec("stale", RunStrategy::ParameterServer, Some(PsMode::Stale), 0, 2)],
        Injection {
            stragglers: Some(Stragglers { probability: 0.5, delay: "uniform:0ms..20ms".parse().unwrap() }),
            ..Default::default()
        },
    );
    let cfg = SimConfig { workers: vec![8], max_updates: 100, ..Default::default() };
    let runs = simulate(&exp, &cfg, &quiet).unwrap();
    let r = &runs[0];
    let applied: Vec<&MetricRecord> = steps(r).filter(|s| !s.dropped).collect();
    let refused: Vec<&MetricRecord> = steps(r).filter(|s| s.dropped).collect();
    assert_eq!(applied.len(), 100);
    assert!(applied.iter().all(|s| s.staleness.is_some_and(|x| x <= 2)));
    assert!(applied.iter().any(|s| s.staleness == Some(2)));
    assert!(!refused.is_empty(), "8 workers and a bound of 2 must refuse some pushes");
    assert!(refused.iter().all(|s| s.staleness.is_none() && s.loss.is_none() && s.worker.is_some()));
    // Updates count the applied pushes only.
    for (i, s) in applied.iter().enumerate() {
        assert_eq!(s.updates, i as u64 + 1);
    }
}

#[test]
fn backup_workers_drop_exactly_b_pushes_per_round() {
    let exp = experiment(
        vec![spec("backup", RunStrategy::ParameterServer, Some(PsMode::Sync), 2, 0)],
        Injection {
            stragglers: Some(Stragglers { probability: 0.3, delay: "exp:10ms".parse().unwrap() }),
            ..Default::default()
        },
    );
    let cfg = SimConfig { workers: vec![2, 6], max_updates: 50, ..Default::default() };
    let runs = simulate(&exp, &cfg, &quiet).unwrap();
    assert_eq!(runs.len(), 1, "2 backups of 2 workers is skipped");
    let r = &runs[0];
    assert_eq!(r.name, "backup/N=6");
    for u in 1..=50 {
        let round: Vec<&MetricRecord> = steps(r).filter(|s| s.updates == u).collect();
        assert_eq!(round.iter().filter(|s| s.dropped).count(), 2, "round {u}");
        assert_eq!(round.iter().filter(|s| !s.dropped).count(), 1, "round {u}");
        assert_eq!(round.last().unwrap().step, 6 * u);
        assert_eq!(round.last().unwrap().examples, 6 * 32 * u);
    }
}

#[test]
fn step_times_follow_the_closed_forms() {
    let delay = Duration::from_micros(30);
    let exp = experiment(all_specs(), Injection { network_delay: delay, ..Default::default() });
    let cfg = SimConfig { workers: vec![1, 4], max_updates: 20, eval_every_updates: 5, ..Default::default() };
    let runs = simulate(&exp, &cfg, &quiet).unwrap();
    let c = cfg.compute_ms * 1e-3;
    let l = cfg.latency_us * 1e-6 + delay.as_secs_f64();
    let bw = cfg.bandwidth_gbps * 1e9 / 8.0;
    let m = model_bytes(&cfg.hidden);
    let n = 4.0;
    let expect = [
        ("one-device/N=1", c),
        ("mirrored/N=1", c),
        ("mirrored/N=4", c + 2.0 * (n - 1.0) * (l + m / (n * bw))),
        ("mwm/N=4", c + 2.0 * (n - 1.0) * (l + m / (n * bw))),
        ("central-storage/N=4", c + 2.0 * (l + n * m / bw)),
        ("ps-sync/N=1", c + 2.0 * (l + m / bw)),
        // 4 pulls queue on the one ps link; the last pull's worker pushes last.
        ("ps-sync/N=4", (l + 4.0 * m / bw) + c + (l + m / bw)),
        ("ps-async/N=1", c + 2.0 * (l + m / bw)),
    ];
    let s = summarize(&runs, strata_compare::Target::Accuracy(0.5));
    for (name, step) in expect {
        let r = run(&runs, name);
        let times: Vec<f64> = steps(r).map(|s| s.wall_s).collect();
        assert_eq!(times.len(), 20, "{name}");
        for (i, t) in times.iter().enumerate() {
            let want = step * (i + 1) as f64;
            assert!((t - want).abs() <= 1e-9 * want.max(1.0), "{name} step {i}: {t} vs {want}");
        }
        assert!((r.wall_s - 20.0 * step).abs() < 1e-9);
        let eps = s.iter().find(|x| x.name == name).unwrap().examples_per_s.unwrap();
        let want = r.workers as f64 * 32.0 / step;
        assert!((eps - want).abs() <= 1e-6 * want, "{name}: {eps} vs {want}");
        assert_eq!(r.records.iter().filter(|x| x.kind == RecordKind::Eval).count(), 4, "{name}");
    }
    let ring = steps(run(&runs, "mirrored/N=4")).next().unwrap().bytes_sent as f64;
    assert_eq!(ring, 2.0 * 3.0 * m);
}

/// Compression sets the bytes of every message (16 bits: half of f32; PowerSGD of rank R: the
/// factors `4 R (out + in)` of each weight that shrinks, the rest in f32), and overlap hides
/// that share of the compute's time of the all-reduce: the ring steps follow the closed form.
#[test]
fn compression_and_overlap_set_the_ring_step_in_closed_form() {
    let with = |name: &str, strategy, compression| RunSpec { compression, ..spec(name, strategy, None, 0, 0) };
    let ps = |name: &str, compression| RunSpec {
        compression,
        ..spec(name, RunStrategy::ParameterServer, Some(PsMode::Async), 0, 0)
    };
    let exp = experiment(
        vec![
            with("none", RunStrategy::MultiWorkerMirrored, Compression::None),
            with("bf16", RunStrategy::MultiWorkerMirrored, Compression::Bf16),
            with("p2", RunStrategy::MultiWorkerMirrored, Compression::PowerSgd { rank: 2, start_step: 0 }),
            ps("ps-bf16", Compression::Bf16),
        ],
        Injection::default(),
    );
    // 64-32-10: weights 32x64 (shrinks at rank 2: 2048 > 2 * 96) and 10x32 (320 > 2 * 42).
    let cfg = SimConfig { workers: vec![4], max_updates: 5, bandwidth_gbps: 0.1, overlap: 0.25, ..Default::default() };
    let m = model_bytes(&cfg.hidden);
    assert_eq!(cfg.wire_bytes(Compression::None) as f64, m);
    assert_eq!(cfg.wire_bytes(Compression::Bf16) as f64, m / 2.0);
    let p2 = 4.0 * 2.0 * (32.0 + 64.0) + 4.0 * 32.0 + 4.0 * 2.0 * (10.0 + 32.0) + 4.0 * 10.0;
    assert_eq!(cfg.wire_bytes(Compression::PowerSgd { rank: 2, start_step: 0 }) as f64, p2);
    let runs = simulate(&exp, &cfg, &quiet).unwrap();
    let (c, l, bw, n) = (cfg.compute_ms * 1e-3, cfg.latency_us * 1e-6, cfg.bandwidth_gbps * 1e9 / 8.0, 4.0);
    for (name, bytes) in [("none", m), ("bf16", m / 2.0), ("p2", p2)] {
        let ring = 2.0 * (n - 1.0) * (l + bytes / (n * bw));
        let step = c + (ring - 0.25 * c).max(0.0);
        let first = steps(run(&runs, name)).next().unwrap();
        assert!((first.wall_s - step).abs() <= 1e-9, "{name}: {} vs {step}", first.wall_s);
        assert_eq!(first.bytes_sent as f64, 2.0 * (n - 1.0) * bytes, "{name}");
    }
    let push = steps(run(&runs, "ps-bf16")).next().unwrap();
    assert_eq!(push.bytes_sent as f64, m / 2.0, "a 16-bit push carries half the model");
}

#[test]
fn sync_throughput_falls_behind_async_as_workers_grow() {
    let exp = experiment(
        vec![
            spec("mirrored", RunStrategy::Mirrored, None, 0, 0),
            spec("async", RunStrategy::ParameterServer, Some(PsMode::Async), 0, 0),
        ],
        Injection {
            stragglers: Some(Stragglers { probability: 0.1, delay: "fixed:20ms".parse().unwrap() }),
            ..Default::default()
        },
    );
    let counts = [2usize, 8, 32];
    let cfg = SimConfig { workers: counts.to_vec(), max_updates: 200, ..Default::default() };
    let runs = simulate(&exp, &cfg, &quiet).unwrap();
    let s = summarize(&runs, strata_compare::Target::Accuracy(0.5));
    let eps = |name: String| s.iter().find(|x| x.name == name).unwrap().examples_per_s.unwrap();
    let ratios: Vec<f64> =
        counts.iter().map(|n| eps(format!("mirrored/N={n}")) / eps(format!("async/N={n}"))).collect();
    println!("sync / async examples per second at N = {counts:?}: {ratios:?}");
    assert!(ratios.windows(2).all(|w| w[1] < w[0]), "{ratios:?}");
    assert!(ratios[2] < 0.8);
}

#[test]
fn hundreds_of_async_workers_saturate_the_ps_link() {
    let hidden = [256];
    let mut ps = spec("async", RunStrategy::ParameterServer, Some(PsMode::Async), 0, 0);
    ps.ps_tasks = 2;
    let exp = experiment(vec![ps], Injection::default());
    let (n, updates) = (128, 150);
    let cfg = SimConfig {
        workers: vec![n],
        hidden: hidden.to_vec(),
        compute_ms: 1.0,
        max_updates: updates,
        ..Default::default()
    };
    let runs = simulate(&exp, &cfg, &quiet).unwrap();
    // Each task's link carries M / 2 bytes of every pull and push: the n first pulls and the
    // applied pushes at least went through it before the last update.
    let shard_s = model_bytes(&hidden) / 2.0 / (cfg.bandwidth_gbps * 1e9 / 8.0);
    let busy = (n + updates as usize) as f64 * shard_s;
    println!("last update at {:.6} s, link busy at least {busy:.6} s", runs[0].wall_s);
    assert!(runs[0].wall_s >= busy);
    // Unlimited links would let 128 workers of 1 ms run far faster.
    let eps = summarize(&runs, strata_compare::Target::Accuracy(0.5))[0].examples_per_s.unwrap();
    let unlimited = n as f64 * 32.0 / (1e-3 + 2.0 * (50e-6 + 2.0 * shard_s));
    println!("examples/s {eps:.0}, without the link bottleneck {unlimited:.0}");
    assert!(eps < 0.25 * unlimited);
}

#[test]
fn the_config_has_defaults_and_checks_its_values() {
    let cfg: SimConfig = toml::from_str("workers = [4, 16]\nmax_virtual_s = 2.5").unwrap();
    assert_eq!(cfg, SimConfig { workers: vec![4, 16], max_virtual_s: Some(2.5), ..Default::default() });
    assert!(toml::from_str::<SimConfig>("worker = [4]").is_err());
    assert_eq!(toml::from_str::<SimConfig>("").unwrap(), SimConfig::default());
    assert!(SimConfig::default().validate().is_ok());
    let bad = |c: SimConfig, want: &str| {
        let e = c.validate().unwrap_err();
        assert!(e.contains(want), "{e}");
        assert_eq!(e, e.to_lowercase(), "{e}");
    };
    bad(SimConfig { workers: vec![4, 0], ..Default::default() }, "workers must be at least 1");
    bad(SimConfig { workers: vec![], ..Default::default() }, "workers must list");
    bad(SimConfig { per_worker_batch: 0, ..Default::default() }, "per_worker_batch");
    bad(SimConfig { compute_ms: f64::NAN, ..Default::default() }, "compute_ms");
    bad(SimConfig { bandwidth_gbps: 0.0, ..Default::default() }, "bandwidth_gbps");
    bad(SimConfig { latency_us: -1.0, ..Default::default() }, "latency_us");
    bad(SimConfig { overlap: 1.0, ..Default::default() }, "overlap must be a share of the step in [0, 1)");
    bad(SimConfig { overlap: -0.1, ..Default::default() }, "overlap");
    bad(SimConfig { max_updates: 0, ..Default::default() }, "max_updates");
    bad(SimConfig { eval_every_updates: 0, ..Default::default() }, "eval_every_updates");
    bad(SimConfig { optimizer: Some("lion".into()), ..Default::default() }, "optimizer");
    bad(SimConfig { hidden: vec![0], ..Default::default() }, "hidden");
    let exp = experiment(all_specs(), Injection::default());
    let e = simulate(&exp, &SimConfig { max_updates: 0, ..Default::default() }, &quiet).unwrap_err();
    assert!(e.to_string().contains("max_updates"), "{e}");
}

#[test]
fn a_virtual_time_budget_stops_every_run_at_the_same_time() {
    let exp = experiment(all_specs(), Injection::default());
    let cfg = SimConfig { workers: vec![4], max_updates: 10_000, max_virtual_s: Some(0.5), ..Default::default() };
    let seen = std::cell::RefCell::new(Vec::new());
    let runs = simulate(&exp, &cfg, &|name, f| seen.borrow_mut().push((name.to_string(), f))).unwrap();
    for r in &runs {
        assert!(r.wall_s <= 0.5 && r.wall_s > 0.4, "{} {}", r.name, r.wall_s);
        assert!(r.records.iter().all(|x| x.wall_s <= 0.5));
    }
    let seen = seen.into_inner();
    assert!(seen.iter().all(|(_, f)| (0.0..=1.0).contains(f)));
    for r in &runs {
        assert_eq!(seen.iter().filter(|(n, f)| n == &r.name && *f == 1.0).count(), 1, "{}", r.name);
    }
}

fn local(name: &str, every: u64, outer: strata::OuterOptimizer, fragments: usize) -> RunSpec {
    RunSpec {
        local_sgd: Some(strata::LocalSgd { every, outer, fragments, ..strata::LocalSgd::default() }),
        ..spec(name, RunStrategy::MultiWorkerMirrored, None, 0, 0)
    }
}

/// Local SGD's clock: compute every step, a blocking ring all-reduce of the whole model at a
/// meeting without delay; with 4 fragments met 2 steps apart and landing 1 step later, a
/// quarter of the bytes at each meeting, hidden behind the next step when it fits there.
#[test]
fn local_sgd_steps_and_meetings_follow_the_closed_forms() {
    let exp = experiment(
        vec![
            local("diloco", 5, strata::OuterOptimizer::diloco(), 1),
            local("streaming", 8, strata::OuterOptimizer::diloco(), 4),
            spec("mwm", RunStrategy::MultiWorkerMirrored, None, 0, 0),
        ],
        Injection::default(),
    );
    // The time model sends 100x the MLP's bytes, in 4 equal fragments.
    let cfg = SimConfig {
        workers: vec![4],
        max_updates: 16,
        eval_every_updates: 8,
        bandwidth_gbps: 0.05,
        wire_parameters: Some(241_000),
        ..Default::default()
    };
    let runs = simulate(&exp, &cfg, &quiet).unwrap();
    let (c, l, bw, n) = (cfg.compute_ms * 1e-3, cfg.latency_us * 1e-6, cfg.bandwidth_gbps * 1e9 / 8.0, 4.0);
    let m = 4.0 * 241_000.0;
    let ring = |bytes: f64| 2.0 * (n - 1.0) * (l + bytes / (n * bw));
    let d = steps(run(&runs, "diloco")).collect::<Vec<_>>();
    assert_eq!(d.len(), 16);
    for (i, r) in d.iter().enumerate() {
        let s = i as f64 + 1.0;
        let want = s * c + (s / 5.0).floor() * ring(m);
        assert!((r.wall_s - want).abs() < 1e-9, "diloco step {s}: {} vs {want}", r.wall_s);
        let met = (i + 1).is_multiple_of(5);
        let last = i + 1 == 16;
        // Every meeting sends 2(n-1)/n M from each worker; the last step's final one too.
        let want_bytes = if met || last { (2.0 * (n - 1.0) * m).round() as u64 } else { 0 };
        assert_eq!(r.bytes_sent, want_bytes, "diloco step {s}");
    }
    // The final meeting (step 16 is not a meeting) ends the run: its evaluation after it.
    let last_eval = run(&runs, "diloco").records.iter().rfind(|r| r.kind == RecordKind::Eval).unwrap();
    assert!((last_eval.wall_s - (16.0 * c + 3.0 * ring(m) + ring(m))).abs() < 1e-9);
    assert!(last_eval.validation_loss.is_some_and(f32::is_finite));
    // A quarter of M takes ring(M/4) = 0.0291 s: more than one step of 10 ms, so each meeting
    // leaves ring(M/4) - c exposed at the step it lands (one step after it is sent).
    let q = ring(m / 4.0);
    assert!(q > c);
    let s = steps(run(&runs, "streaming")).collect::<Vec<_>>();
    let mut t = 0.0;
    let mut lands = None;
    for (i, r) in s.iter().enumerate() {
        let step = i as u64 + 1;
        t += c;
        if lands.is_some_and(|(due, _)| due == step) {
            t = f64::max(t, lands.unwrap().1);
            lands = None;
        }
        if step.is_multiple_of(2) {
            lands = Some((step + 1, t + q));
        }
        assert!((r.wall_s - t).abs() < 1e-9, "streaming step {step}: {} vs {t}", r.wall_s);
    }
    // Per-step sync sends 2(n-1)/n M every step; DiLoCo 1/5 of that before its final meeting.
    let sync_bytes: u64 = steps(run(&runs, "mwm")).map(|r| r.bytes_sent).sum();
    let diloco_bytes: u64 = d.iter().take(15).map(|r| r.bytes_sent).sum();
    assert_eq!(3 * sync_bytes, 16 * diloco_bytes, "{sync_bytes} {diloco_bytes}");
}

/// One worker averaging with itself every few steps is one-device training: the same losses.
/// Several workers under DiLoCo learn (the test loss falls well below its start) on the same
/// batches as per-step sync.
#[test]
fn local_sgd_learns_and_one_averaging_worker_is_one_device() {
    let exp = experiment(
        vec![
            local("avg", 4, strata::OuterOptimizer::Average, 1),
            spec("mwm", RunStrategy::MultiWorkerMirrored, None, 0, 0),
            local("diloco", 10, strata::OuterOptimizer::diloco(), 2),
        ],
        Injection::default(),
    );
    let one = SimConfig { workers: vec![1], max_updates: 40, eval_every_updates: 40, ..Default::default() };
    let runs = simulate(&exp, &one, &quiet).unwrap();
    let a: Vec<f32> = steps(run(&runs, "avg")).map(|r| r.loss.unwrap()).collect();
    let b: Vec<f32> = steps(run(&runs, "mwm")).map(|r| r.loss.unwrap()).collect();
    assert_eq!(a.len(), 40);
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!((x - y).abs() <= 1e-4 * y.abs().max(1.0), "step {i}: {x} vs {y}");
    }
    let four = SimConfig { workers: vec![4], max_updates: 200, eval_every_updates: 20, ..Default::default() };
    let runs = simulate(&exp, &four, &quiet).unwrap();
    let evals: Vec<f32> = run(&runs, "diloco")
        .records
        .iter()
        .filter(|r| r.kind == RecordKind::Eval)
        .map(|r| r.validation_loss.unwrap())
        .collect();
    assert_eq!(evals.len(), 10);
    assert!(evals[9] < 0.6 * evals[0], "{evals:?}");
    assert_eq!(run(&runs, "diloco").mode.as_deref(), Some("diloco H=10, 2 fragments"));
}

/// The extrapolation: time to a test loss against link rate and workers. The learning of
/// sync and DiLoCo does not depend on the link, so slower links only add time; DiLoCo sends
/// far fewer bytes to the target; PowerSGD's loss is not modelled and says so.
#[test]
fn the_extrapolation_sweeps_links_and_workers() {
    let exp = experiment(
        vec![
            spec("sync", RunStrategy::MultiWorkerMirrored, None, 0, 0),
            spec("ps-async", RunStrategy::ParameterServer, Some(PsMode::Async), 0, 0),
            RunSpec {
                compression: Compression::PowerSgd { rank: 2, start_step: 0 },
                ..spec("powersgd", RunStrategy::MultiWorkerMirrored, None, 0, 0)
            },
            local("diloco", 10, strata::OuterOptimizer::diloco(), 1),
        ],
        Injection::default(),
    );
    let cfg = SimConfig {
        workers: vec![2, 8],
        links_gbps: vec![0.01, 10.0],
        max_updates: 300,
        eval_every_updates: 10,
        wire_parameters: Some(816_705),
        compute_ms: 38.0,
        target_loss: Some(0.6),
        ..Default::default()
    };
    let no_target = SimConfig { target_loss: None, ..cfg.clone() };
    let e = strata_compare::simulate::extrapolate(&exp, &no_target, &quiet).unwrap_err().to_string();
    assert!(e.contains("set target_loss in [simulate]") && !e.ends_with('.'), "{e}");
    let cells = strata_compare::simulate::extrapolate(&exp, &cfg, &quiet).unwrap();
    assert_eq!(cells.len(), 4 * 2 * 2);
    let cell = |run: &str, n: usize, gbps: f64| {
        cells.iter().find(|c| c.run == run && c.workers == n && c.link_gbps == gbps).unwrap()
    };
    for n in [2, 8] {
        for run in ["sync", "diloco", "powersgd"] {
            let (slow, fast) = (cell(run, n, 0.01), cell(run, n, 10.0));
            let (ts, tf) = (slow.time_to_target_s.unwrap(), fast.time_to_target_s.unwrap());
            assert_eq!(slow.updates_to_target, fast.updates_to_target, "{run} N={n}: the same learning");
            assert!(ts > tf, "{run} N={n}: {ts} vs {tf}");
        }
        // At 10 Mbit/s a 3.3 MB all-reduce a step costs seconds: DiLoCo gets there first and
        // sends far fewer bytes.
        let (s, d) = (cell("sync", n, 0.01), cell("diloco", n, 0.01));
        assert!(d.time_to_target_s.unwrap() < s.time_to_target_s.unwrap() / 3.0, "{s:?} {d:?}");
        assert!(d.bytes_per_worker_to_target.unwrap() < s.bytes_per_worker_to_target.unwrap() / 3.0);
        assert!(!cell("powersgd", n, 0.01).loss_modelled && cell("sync", n, 0.01).loss_modelled);
        assert_eq!(cell("powersgd", n, 0.01).updates_to_target, s.updates_to_target);
        assert_eq!(cell("ps-async", n, 0.01).label, "async ps");
        assert_eq!(d.label, "diloco H=10");
    }
    let table = strata_compare::report::extrapolation_table(&cells, 0.6);
    assert!(table.contains("| diloco H=10 | 8 |"), "{table}");
}

/// A simulated DiLoCo run beside per-step sync: its own mode in the table, far fewer bytes per
/// worker, and the loss-against-bytes plot in the report.
#[test]
fn a_diloco_run_is_its_own_mode_in_the_report_with_its_bytes() {
    let exp = experiment(
        vec![
            spec("sync", RunStrategy::MultiWorkerMirrored, None, 0, 0),
            local("diloco", 20, strata::OuterOptimizer::diloco(), 1),
        ],
        Injection::default(),
    );
    let cfg = SimConfig { workers: vec![4], max_updates: 100, eval_every_updates: 20, ..Default::default() };
    let runs = simulate(&exp, &cfg, &quiet).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = strata_compare::report::write_outputs(dir.path(), &exp, &runs, true).unwrap();
    let s = |name: &str| out.summaries.iter().find(|s| s.name == name).unwrap();
    assert_eq!(s("diloco").mode.as_deref(), Some("diloco H=20"));
    let (sync, diloco) = (s("sync").bytes_sent_per_worker.unwrap(), s("diloco").bytes_sent_per_worker.unwrap());
    // 100 all-reduces against 5 meetings (steps 20..100, none after: the last step met).
    assert!((sync / diloco - 20.0).abs() < 1e-9, "{sync} {diloco}");
    assert!(out.plots.iter().any(|p| p.name == "loss_vs_bytes" && !p.empty));
    let md = std::fs::read_to_string(&out.report_md).unwrap();
    assert!(md.contains("| diloco | multi-worker-mirrored | diloco H=20 | 4 |"), "{md}");
    assert!(md.contains("(loss_vs_bytes.png)"));
}
