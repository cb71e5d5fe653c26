//! ZeRO stages 1 to 3 through `strata train --zero-stage`, in real processes: Mirrored over 3
//! replicas and MultiWorkerMirrored with 3 workers of 1 replica and 2 workers of 2 replicas
//! (uneven shards), each bit for bit the parameters of the same job at stage 0; the transformer
//! (clipped by global norm) within reassociation of stage 0, by a bound that a skipped step
//! breaks; every worker the same; what cannot run on shards refused with one line and exit
//! code 2. Every wait has a hard deadline.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use strata_integration_tests::{free_ports, strata, wait, worker_tf_config};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("strata-zero-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The digits MLP under AdamW (the default optimizer), 1 epoch; 5,018 parameters, so that the
/// shards over 3 and 4 replicas are uneven.
const TRAIN: &[&str] = &["--epochs", "1", "--batch", "96", "--hidden", "48,32", "--lr", "0.01", "--no-progress"];

fn check(o: &Output, what: &str) {
    assert!(o.status.success(), "{what} failed: {}", String::from_utf8_lossy(&o.stderr));
}

/// `workers` processes of `--replicas local` each at `stage`; every worker's parameters, as
/// `--save-params` writes them.
fn multi_worker(dir: &Path, workers: usize, local: usize, stage: &str, args: &[&str]) -> Vec<Vec<u8>> {
    let file = format!("w{workers}x{local}-z{stage}");
    let save = format!("{file}-{{task}}.safetensors");
    let args: Vec<&str> = args.iter().copied().chain(["--save-params", &save]).collect();
    workers_run(dir, workers, local, stage, &args);
    (0..workers).map(|i| std::fs::read(dir.join(format!("{file}-{i}.safetensors"))).unwrap()).collect()
}

/// Runs `workers` processes of `--replicas local` each at `stage`, with `args` beside the
/// training ones; each worker's standard error, once all succeeded.
fn workers_run(dir: &Path, workers: usize, local: usize, stage: &str, args: &[&str]) -> Vec<String> {
    let local = local.to_string();
    let what = format!("{workers}x{local} at stage {stage} with {args:?}");
    multi_worker_job(dir, workers, &[&["--replicas", &local, "--zero-stage", stage], TRAIN, args].concat(), &what)
}

/// Runs `workers` processes of `strata train --strategy multi-worker-mirrored {args}`; each
/// worker's standard error, once all succeeded within 240 s (`what` names the job in a failure).
fn multi_worker_job(dir: &Path, workers: usize, args: &[&str], what: &str) -> Vec<String> {
    let ports = free_ports(workers);
    let deadline = Instant::now() + Duration::from_secs(240);
    let children: Vec<_> = (0..workers)
        .map(|i| {
            strata()
                .args(["train", "--strategy", "multi-worker-mirrored"])
                .args(args)
                .env("TF_CONFIG", worker_tf_config(&ports, i))
                .current_dir(dir)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<Output> = children.into_iter().map(|c| wait(c, deadline)).collect();
    for (i, o) in outs.iter().enumerate() {
        check(o, &format!("worker {i} of {what}"));
    }
    outs.iter().map(|o| String::from_utf8_lossy(&o.stderr).into_owned()).collect()
}

/// 2 workers at `stages.0` for 6 steps with a checkpoint every 3, then 3 workers at
/// `stages.1` resuming from it to the end: the chief's parameters.
fn resumed_on_3_workers(dir: &Path, stages: (&str, &str)) -> Vec<u8> {
    let ck = format!("ck-{}-{}", stages.0, stages.1);
    let saved = format!("resumed-{}-{}.safetensors", stages.0, stages.1);
    workers_run(dir, 2, 1, stages.0, &["--checkpoint-dir", &ck, "--checkpoint-every", "3", "--max-steps", "6"]);
    let err = workers_run(dir, 3, 1, stages.1, &["--checkpoint-dir", &ck, "--save-params", &saved]);
    assert!(err[0].contains("resumed from the checkpoint of step 6"), "{stages:?}: {}", err[0]);
    std::fs::read(dir.join(saved)).unwrap()
}

#[test]
fn a_job_checkpointed_on_2_workers_at_stages_1_to_3_resumes_on_3_at_any_stage_as_stage_0_does() {
    let dir = tmp("resume");
    let whole = resumed_on_3_workers(&dir, ("0", "0"));
    assert!(resumed_on_3_workers(&dir, ("1", "2")) == whole, "2 workers at stage 1, then 3 at stage 2");
    assert!(resumed_on_3_workers(&dir, ("2", "0")) == whole, "2 workers at stage 2, then 3 at stage 0");
    // Stage 3 across workers: the checkpoint's parameters are pulled from every worker's
    // pieces, and a resumed worker's peers wait for its load before they answer.
    assert!(resumed_on_3_workers(&dir, ("3", "0")) == whole, "2 workers at stage 3, then 3 at stage 0");
    assert!(resumed_on_3_workers(&dir, ("0", "3")) == whole, "2 workers at stage 0, then 3 at stage 3");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Mirrored(3) at `stages.0` for 6 steps with a checkpoint every 3, then Mirrored(2) at
/// `stages.1` resuming from it to the end: the parameters.
fn resumed_on_2_replicas(dir: &Path, stages: (&str, &str)) -> Vec<u8> {
    let ck = format!("mck-{}-{}", stages.0, stages.1);
    let saved = format!("mresumed-{}-{}.safetensors", stages.0, stages.1);
    let run = |replicas: &str, stage: &str, args: &[&str]| {
        let ck = ["--checkpoint-dir", ck.as_str()];
        train_mirrored(dir, replicas, stage, &[TRAIN, &ck, args].concat())
    };
    run("3", stages.0, &["--checkpoint-every", "3", "--max-steps", "6"]);
    let err = run("2", stages.1, &["--save-params", &saved]);
    assert!(err.contains("resumed from the checkpoint of step 6"), "{stages:?}: {err}");
    std::fs::read(dir.join(saved)).unwrap()
}

/// Stage 3's checkpoints hold the whole model and state: a job checkpointed at stage 3 resumes
/// at stage 0 on fewer replicas, and one checkpointed at stage 0 resumes at stage 3, both as
/// stage 0 throughout does, bit for bit.
#[test]
fn a_mirrored_job_checkpointed_at_stage_3_resumes_at_stage_0_and_back_as_stage_0_does() {
    let dir = tmp("resume-3");
    let whole = resumed_on_2_replicas(&dir, ("0", "0"));
    assert!(resumed_on_2_replicas(&dir, ("3", "0")) == whole, "3 replicas at stage 3, then 2 at stage 0");
    assert!(resumed_on_2_replicas(&dir, ("0", "3")) == whole, "3 replicas at stage 0, then 2 at stage 3");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn stages_1_to_3_across_worker_processes_are_stage_0_bit_for_bit() {
    let dir = tmp("workers");
    for (workers, local) in [(3, 1), (2, 2)] {
        let whole = multi_worker(&dir, workers, local, "0", &[]);
        for stage in ["1", "2", "3"] {
            let sharded = multi_worker(&dir, workers, local, stage, &[]);
            for (i, p) in sharded.iter().enumerate() {
                assert!(p == &sharded[0], "{workers}x{local}: worker {i}'s parameters differ from the chief's");
                assert!(p == &whole[i], "{workers}x{local}: worker {i} at stage {stage} differs from stage 0");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn stages_1_to_3_under_mirrored_are_stage_0_bit_for_bit() {
    let dir = tmp("mirrored");
    let run = |stage: &str| mirrored(&dir, stage, TRAIN);
    let whole = run("0");
    assert!(run("1") == whole, "Mirrored(3) at stage 1 differs from stage 0");
    assert!(run("2") == whole, "Mirrored(3) at stage 2 differs from stage 0");
    assert!(run("3") == whole, "Mirrored(3) at stage 3 differs from stage 0");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `strata train --strategy mirrored --replicas 3` at `stage` with `args`: the parameters, as
/// `--save-params` writes them.
fn mirrored(dir: &Path, stage: &str, args: &[&str]) -> Vec<u8> {
    let file = format!("m-z{stage}.safetensors");
    train_mirrored(dir, "3", stage, &[args, &["--save-params", &file]].concat());
    std::fs::read(dir.join(file)).unwrap()
}

/// `strata train --strategy mirrored --replicas {replicas} --zero-stage {stage} {args}` in
/// `dir`, which must succeed within 180 s; returns its stderr.
fn train_mirrored(dir: &Path, replicas: &str, stage: &str, args: &[&str]) -> String {
    let strategy = ["--strategy", "mirrored", "--replicas", replicas, "--zero-stage", stage];
    train(dir, &[&strategy, args].concat(), &format!("mirrored({replicas}) at stage {stage} with {args:?}"))
}

/// `strata train {args}` in `dir`, which must succeed within 180 s (`what` names it in a
/// failure); returns its stderr.
fn train(dir: &Path, args: &[&str], what: &str) -> String {
    let o = wait(
        strata().arg("train").args(args).current_dir(dir).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap(),
        Instant::now() + Duration::from_secs(180),
    );
    check(&o, what);
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `‖a - b‖ / ‖b‖` over every tensor of two `--save-params` files.
fn l2_relative(a: &[u8], b: &[u8]) -> f64 {
    let dev = candle_core::Device::Cpu;
    let (a, b) = (
        candle_core::safetensors::load_buffer(a, &dev).unwrap(),
        candle_core::safetensors::load_buffer(b, &dev).unwrap(),
    );
    assert_eq!(a.len(), b.len());
    let (mut diff, mut norm) = (0f64, 0f64);
    for (name, tb) in &b {
        let ta = a[name].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (x, y) in ta.iter().zip(tb.flatten_all().unwrap().to_vec1::<f32>().unwrap()) {
            diff += ((x - y) as f64).powi(2);
            norm += (y as f64).powi(2);
        }
    }
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}

/// How far the transformer at stages 1 and 2 may end from stage 0 (`‖a - b‖ / ‖b‖`): its
/// clipping norm is summed shard by shard. Measured 3.4e-8 at both stages on 2026-12-02 on this
/// project's 2-core Xeon (AVX-512; the test prints each distance); the bound is about 4.4x that
/// (at most 10x, the project's rule for tolerances). The test's negative control: the same
/// run one step short (a step skipped) ends 8.1e-2 away, far outside it.
const TRANSFORMER_REASSOCIATION: f64 = 1.5e-7;

#[test]
fn the_transformer_at_stages_1_to_3_is_stage_0_within_reassociation() {
    // Clipped by its global norm, which a shard sums over its elements only: the same within
    // reassociation, not bit for bit.
    let dir = tmp("transformer");
    let args = ["--model", "transformer", "--steps", "4", "--batch", "12", "--no-progress"];
    let whole = mirrored(&dir, "0", &args);
    for stage in ["1", "2", "3"] {
        let err = l2_relative(&mirrored(&dir, stage, &args), &whole);
        eprintln!("the transformer at stage {stage}: {err:e} from stage 0 (bound {TRANSFORMER_REASSOCIATION:e})");
        assert!(err <= TRANSFORMER_REASSOCIATION, "the transformer at stage {stage} is {err:e} from stage 0");
    }
    // A step skipped: the bound must tell it from reassociation.
    let short = ["--model", "transformer", "--steps", "3", "--batch", "12", "--no-progress"];
    let skipped = l2_relative(&mirrored(&dir, "1", &short), &whole);
    eprintln!("the transformer at stage 1 one step short: {skipped:e} from stage 0");
    assert!(skipped > 100.0 * TRANSFORMER_REASSOCIATION, "a skipped step ends only {skipped:e} from stage 0");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Activation recomputation (`--recompute`) trains the same job: the MLP bit for bit on one
/// device, Mirrored(3) at stages 0 and 3 and 2 worker processes; the transformer (whose
/// blocks take two contributions to an input's gradient at most, which add in either order
/// alike) bit for bit at stage 0, and at stage 3 within the reassociation stage 3 has alone.
#[test]
fn recomputation_trains_the_same_job_alone_at_stage_3_and_across_workers() {
    let dir = tmp("recompute");
    let with = |args: &[&'static str]| -> Vec<&'static str> { args.iter().copied().chain(["--recompute"]).collect() };
    let one = |args: &[&str]| {
        let save = ["--strategy", "one-device", "--save-params", "one.safetensors"];
        train(&dir, &[args, &save].concat(), &format!("one device with {args:?}"));
        std::fs::read(dir.join("one.safetensors")).unwrap()
    };
    assert!(one(&with(TRAIN)) == one(TRAIN), "one device recomputing differs");
    let whole = mirrored(&dir, "0", TRAIN);
    assert!(mirrored(&dir, "0", &with(TRAIN)) == whole, "Mirrored(3) recomputing differs");
    assert!(mirrored(&dir, "3", &with(TRAIN)) == whole, "Mirrored(3) at stage 3 recomputing differs");
    let workers = multi_worker(&dir, 2, 1, "0", &[]);
    let recomputed = multi_worker(&dir, 2, 1, "0", &["--recompute"]);
    assert!(recomputed == workers, "2 workers recomputing differ");
    let stage_3 = multi_worker(&dir, 2, 1, "3", &["--recompute"]);
    assert!(stage_3 == workers, "2 workers at stage 3 recomputing differ");
    let transformer = ["--model", "transformer", "--steps", "3", "--batch", "12", "--no-progress"];
    let whole = mirrored(&dir, "0", &transformer);
    assert!(mirrored(&dir, "0", &with(&transformer)) == whole, "the transformer recomputing differs");
    let err = l2_relative(&mirrored(&dir, "3", &with(&transformer)), &whole);
    eprintln!("the transformer at stage 3 recomputing: {err:e} from stage 0");
    assert!(err <= TRANSFORMER_REASSOCIATION, "the transformer at stage 3 recomputing is {err:e} from stage 0");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn what_cannot_run_on_shards_is_refused_in_one_line() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["--strategy", "one-device", "--zero-stage", "1"],
            "zero stage 1 with the one-device strategy: one replica holds the whole model; use stage 0, or mirrored over several devices",
        ),
        (
            &["--strategy", "parameter-server", "--zero-stage", "1"],
            "zero stage 1 with the parameter-server strategy: its variables live on the ps tasks, which step each of them once; use stage 0, or mirrored or multi-worker-mirrored",
        ),
        (
            &["--strategy", "mirrored", "--zero-stage", "1", "--optimizer", "candle-adamw"],
            "zero stage 1 with the optimizer candle-adamw: it steps whole variables; stages 1 to 3 step runs of a variable's elements, which needs an optimizer that implements ShardableOptimizer (strata's FusedAdamW, FusedSgd and FusedMomentum do)",
        ),
        (&["--strategy", "mirrored", "--zero-stage", "4"], "zero stage \"4\" is not a stage"),
        (
            &["--strategy", "multi-worker-mirrored", "--zero-stage", "3", "--min-workers", "1", "--coordinator", "127.0.0.1:9", "--optimizer", "sgd"],
            "an elastic job at ZeRO stage 3: a lost worker takes its shard of the parameters with it, and the job then rolls back to its last checkpoint; give it a checkpoint directory",
        ),
        (
            &["--strategy", "mirrored", "--zero-stage", "3", "--zero-units", "layer1,dec"],
            "zero stage 3's unit \"dec\" names no trainable variable of the model",
        ),
        (
            &["--strategy", "mirrored", "--zero-stage", "2", "--zero-units", "layer1"],
            "--zero-units applies to --zero-stage 3, which gathers parameters by unit (this run is at stage 2)",
        ),
        (
            &["--strategy", "one-device", "--zero-stage", "3"],
            "zero stage 3 with the one-device strategy: one replica holds the whole model",
        ),
        (
            &["--strategy", "central-storage", "--zero-stage", "2"],
            "zero stage 2 with the central-storage strategy: its one central copy is stepped once",
        ),
        (&["--strategy", "mirrored", "--memory-limit", "1KiB"], "no zero stage fits (stage 2 needs "),
        (&["--strategy", "mirrored", "--memory-limit", "0"], "a memory limit of 0 bytes"),
        (
            &["--strategy", "parameter-server", "--memory-limit", "1MiB"],
            "--memory-limit 1.0 MiB applies to the logical CPU devices",
        ),
    ];
    let dir = tmp("refused");
    for (args, want) in cases {
        let o = train_refused(&dir, args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!dir.join("never.safetensors").exists(), "{args:?} wrote parameters");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `strata train ARGS` on the shipped data in `dir`, told to save its parameters to
/// `never.safetensors` (which a refused job must not write); waits at most 60 s.
fn train_refused(dir: &Path, args: &[&str]) -> Output {
    train_refused_with(dir, args, TRAIN)
}

/// [`train_refused`] with `train` for [`TRAIN`].
fn train_refused_with(dir: &Path, args: &[&str], train: &[&str]) -> Output {
    wait(
        strata()
            .arg("train")
            .args(args)
            .args(train)
            .args(["--save-params", "never.safetensors"])
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
        Instant::now() + Duration::from_secs(60),
    )
}

/// `--memory-limit` just above what a stage 3 step holds (its model state and activations,
/// counted: `peak_replica_bytes` in `--out`'s summary), which is less than stage 2's whole
/// parameters for an MLP of twelve hidden layers (13 units) at 8 examples per replica. Stages
/// 0 to 2 are refused in one line naming stage 3, exit code 2, nothing written; stage 3 trains
/// under it to stage 0's parameters bit for bit; and a limit a little under what its step
/// holds (above its model state, so the job starts) fails that step in one line naming the
/// replica, the bytes by kind and what to change, with no parameters written.
#[test]
fn a_job_over_its_memory_limit_is_refused_at_stages_0_to_2_and_trains_at_stage_3() {
    let dir = tmp("memory-limit");
    let hidden = ["48"; 12].join(",");
    let deep: Vec<&str> = TRAIN
        .iter()
        .map(|&a| match a {
            "48,32" => hidden.as_str(),
            "96" => "24",
            a => a,
        })
        .collect();
    let refused = |stage: &str, limit: &str| {
        let args = ["--strategy", "mirrored", "--replicas", "3", "--zero-stage", stage, "--memory-limit", limit];
        let o = train_refused_with(&dir, &args, &deep);
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        assert!(!dir.join("never.safetensors").exists(), "a refused job wrote parameters");
        err
    };
    let err = refused("0", "1KiB");
    let need = err.split("stage 3 needs ").nth(1).and_then(|r| r.split(')').next()).expect(&err);
    let need = strata::device::parse_bytes(need).unwrap();
    // What a stage 3 step holds, counted, with no limit.
    let out = dir.join("stage-3.json");
    let args: Vec<&str> = deep.iter().copied().chain(["--out", out.to_str().unwrap()]).collect();
    mirrored(&dir, "3", &args);
    let summary: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let held = summary["peak_replica_bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap()).max().unwrap();
    assert!(held > need, "a step holds its activations too: {held} B counted, {need} B of model state");
    // format_bytes rounds to a tenth of its unit: 2% above is above the exact figure.
    let limit = (held + held / 50).to_string();
    for stage in ["0", "1", "2"] {
        let err = refused(stage, &limit);
        // Mirrored on one machine's CPU runs stage 0 as stage 1 (`host_shards`), and says so.
        let runs = if stage == "0" { "1" } else { stage };
        assert!(
            err.contains(&format!("at zero stage {runs} (parameters ")) && err.contains("use it (--zero-stage 3)"),
            "{err}"
        );
    }
    let whole = mirrored(&dir, "0", &deep);
    let args: Vec<&str> = deep.iter().copied().chain(["--memory-limit", limit.as_str()]).collect();
    assert!(mirrored(&dir, "3", &args) == whole, "stage 3 within the limit differs from stage 0");
    // Between the model state and what the step holds: the first step fails, in one line.
    let under = ((need + held) / 2).to_string();
    let args = ["--strategy", "mirrored", "--replicas", "3", "--zero-stage", "3", "--memory-limit", under.as_str()];
    let o = train_refused_with(&dir, &args, &deep);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("held ") && err.contains("in step 1 at zero stage 3 (parameters "), "{err}");
    assert!(err.contains(", activations ") && err.contains("recompute them (strata::recompute, --recompute)"), "{err}");
    assert!(!dir.join("never.safetensors").exists(), "a failed job wrote parameters");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The digits MLP of [`TRAIN`] for 2 epochs (30 steps) in fp16, from a loss scale of 2^30, so
/// that the first steps overflow fp16 and are skipped.
const FP16: &[&str] = &[
    "--epochs",
    "2",
    "--batch",
    "96",
    "--hidden",
    "48,32",
    "--lr",
    "0.01",
    "--no-progress",
    "--precision",
    "fp16",
    "--initial-loss-scale",
    "1073741824",
];

/// The `loss scale S at the end, N steps skipped` lines of a job's standard error.
fn loss_scale_lines(err: &str) -> Vec<String> {
    err.lines()
        .filter(|l| l.contains("loss scale"))
        .map(|l| l.split("loss scale").nth(1).unwrap().to_string())
        .collect()
}

/// fp16's loss scaling across worker processes: the steps that overflow are skipped on both
/// workers (the same count, the same final scale, the same parameters), and Mirrored(2), whose
/// replicas see the same shards, skips exactly as many.
#[test]
fn fp16_on_2_worker_processes_skips_the_same_steps_and_ends_alike() {
    let dir = tmp("fp16-workers");
    let errs = multi_worker_job(&dir, 2, &[&["--replicas", "1"], FP16].concat(), "fp16 on 2 workers");
    let digests: Vec<&str> =
        errs.iter().map(|e| e.lines().find(|l| l.contains("parameter digest")).expect("a digest line")).collect();
    assert_eq!(digests[0].split("digest").nth(1), digests[1].split("digest").nth(1), "the workers' parameters");
    let (w0, w1) = (loss_scale_lines(&errs[0]), loss_scale_lines(&errs[1]));
    assert_eq!((w0.len(), &w0), (1, &w1), "{}", errs[0]);
    let skipped: u64 = w0[0].split(", ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    assert!(skipped >= 5, "a scale of 2^30 overflows fp16 for several steps: {}", w0[0]);
    let mirrored = train(&dir, &[&["--strategy", "mirrored", "--replicas", "2"], FP16].concat(), "fp16 mirrored(2)");
    assert_eq!(loss_scale_lines(&mirrored), w0, "mirrored(2) skips as the two workers do");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The loss scale is in checkpoints: an fp16 job stopped at step 6, in the middle of its
/// skipped steps, resumes with the scale it had and ends bit for bit where the job run through
/// ends (a resume from the initial scale would skip six more steps).
#[test]
fn an_fp16_job_resumes_from_a_checkpoint_with_its_loss_scale() {
    let dir = tmp("fp16-resume");
    let m2 = ["--strategy", "mirrored", "--replicas", "2"];
    let through = train(&dir, &[&m2, FP16, &["--save-params", "through.safetensors"]].concat(), "fp16 through");
    let ck = ["--checkpoint-dir", "ck"];
    train(&dir, &[&m2, FP16, &ck, &["--checkpoint-every", "3", "--max-steps", "6"]].concat(), "fp16 to step 6");
    let resumed = train(&dir, &[&m2, FP16, &ck, &["--save-params", "resumed.safetensors"]].concat(), "fp16 resumed");
    assert!(resumed.contains("resumed from the checkpoint of step 6"), "{resumed}");
    assert_eq!(loss_scale_lines(&resumed), loss_scale_lines(&through));
    let read = |f: &str| std::fs::read(dir.join(f)).unwrap();
    assert!(read("resumed.safetensors") == read("through.safetensors"), "the resumed job's parameters");
    let _ = std::fs::remove_dir_all(&dir);
}
