//! Jobs on a real Slurm cluster of several hosts (network namespaces on one bridge, Debian's
//! slurmctld, slurmd and munged): the shipped sbatch scripts unchanged, several tasks per host,
//! a parameter-server job, preemption, and a node name that does not resolve.
//!
//! Skipped with a message when not root or without the packages (`slurm-wlm`, `munge`);
//! `STRATA_REQUIRE_CLUSTER=1` (CI) makes that a failure. Each test checks that its cluster
//! left nothing behind. Wall times and the bytes that crossed the hosts' links are printed
//! (`cargo test -p strata-integration-tests --test slurm -- --nocapture`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use strata_integration_tests::cluster::{or_skip, Hosts, JobEnd, Slurm};
use strata_integration_tests::{strata_bin, TOKEN};

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/slurm").join(name)
}

/// A Slurm cluster of `n` hosts with 2 CPUs each, or `None` (skipped).
fn cluster(hosts: Result<Hosts, strata_integration_tests::cluster::Skip>) -> Option<Slurm> {
    // The binary first: building it must not count against a job's time.
    strata_bin();
    or_skip(hosts.and_then(|h| Slurm::start(h, 2)))
}

/// The submission directory every host sees (the cluster's shared file system), with the
/// cluster token file the scripts read.
fn job_dir() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::Builder::new().prefix("strata-slurm-job-").tempdir().expect("a job directory");
    let token = dir.path().join("token");
    std::fs::write(&token, TOKEN).expect("the token file");
    (dir, token)
}

/// Submits `script` with `args`, waits (hard timeout) and returns how it ended, its output,
/// the wall time and the bytes that crossed the links.
fn submit(slurm: &Slurm, dir: &Path, token: &Path, args: &[&str], script: &Path, out_prefix: &str) -> Run {
    let bin = strata_bin().to_str().expect("a UTF-8 path").to_string();
    let token = token.to_str().expect("a UTF-8 path");
    let bytes = slurm.hosts().link_bytes();
    let started = Instant::now();
    let job =
        slurm.sbatch(dir, args, script, &[("STRATA", &bin), ("STRATA_TOKEN_FILE", token), ("STRATA_LOG", "warn")]);
    let end = slurm.wait(job, Duration::from_secs(300));
    let wall = started.elapsed();
    let output = std::fs::read_to_string(dir.join(format!("{out_prefix}-{job}.out"))).unwrap_or_default();
    Run { job, end, output, wall, bytes: slurm.hosts().link_bytes() - bytes }
}

struct Run {
    job: u32,
    end: JobEnd,
    output: String,
    wall: Duration,
    bytes: u64,
}

impl Run {
    fn assert_completed(&self, slurm: &Slurm) {
        assert!(
            self.end.state == "COMPLETED" && self.end.exit_code == "0:0",
            "job {} ended {:?}; its output:\n{}\nslurmctld:\n{}",
            self.job,
            self.end,
            self.output,
            slurm.log()
        );
    }

    fn report(&self, what: &str) {
        eprintln!(
            "{what}: job {} {} in {:.1} s wall ({} s by Slurm), {:.1} MB across the hosts' links",
            self.job,
            self.end.state,
            self.wall.as_secs_f64(),
            self.end.seconds,
            self.bytes as f64 / 1e6
        );
    }

    /// The digests the workers printed (`worker N: parameter digest D`).
    fn digests(&self) -> Vec<String> {
        self.output
            .lines()
            .filter_map(|l| l.split_once(": parameter digest ").map(|(_, d)| d.trim().to_string()))
            .collect()
    }

    /// The accuracy of the `test accuracy NN.NN%` line.
    fn accuracy(&self) -> f64 {
        let line = self.output.lines().find(|l| l.contains("test accuracy")).unwrap_or_else(|| {
            panic!("no accuracy line in the job's output:\n{}", self.output);
        });
        let after = line.split("test accuracy ").nth(1).expect("the accuracy");
        after.split('%').next().and_then(|a| a.trim().parse().ok()).expect("a percentage")
    }
}

fn assert_clean(mut slurm: Slurm) {
    let left = slurm.teardown();
    assert!(left.is_empty(), "the cluster left behind: {left:?}");
}

/// `train-digits.sbatch`, unchanged, on `n` hosts with one task each: every worker ends with
/// the same parameters, the accuracy is the digits MLP's, and the training traffic crossed
/// the hosts' links.
fn digits_on(n: usize) {
    let Some(slurm) = cluster(Hosts::new(n)) else { return };
    let (dir, token) = job_dir();
    let nodes = format!("--nodes={n}");
    let run = submit(&slurm, dir.path(), &token, &[&nodes], &script("train-digits.sbatch"), "strata-digits");
    run.report(&format!("train-digits.sbatch on {n} hosts"));
    run.assert_completed(&slurm);
    let digests = run.digests();
    assert_eq!(digests.len(), n, "one digest per worker:\n{}", run.output);
    assert!(digests.windows(2).all(|w| w[0] == w[1]), "the workers' parameters differ:\n{}", run.output);
    assert!(run.accuracy() > 90.0, "{}", run.output);
    assert!(run.bytes > 1_000_000, "only {} bytes crossed the links", run.bytes);
    assert!(dir.path().join(format!("strata-digits-{}.json", run.job)).is_file(), "the chief's summary");
    assert_clean(slurm);
}

#[test]
fn digits_script_on_two_hosts() {
    digits_on(2);
}

#[test]
fn digits_script_on_three_hosts() {
    digits_on(3);
}

/// Two tasks per host on two hosts: 4 workers, the second of each host on port 8889.
#[test]
fn two_tasks_per_host() {
    let Some(slurm) = cluster(Hosts::new(2)) else { return };
    let (dir, token) = job_dir();
    let run = submit(
        &slurm,
        dir.path(),
        &token,
        &["--nodes=2", "--ntasks-per-node=2"],
        &script("train-digits.sbatch"),
        "strata-digits",
    );
    run.report("train-digits.sbatch, 2 tasks on each of 2 hosts");
    run.assert_completed(&slurm);
    let digests = run.digests();
    assert_eq!(digests.len(), 4, "one digest per worker:\n{}", run.output);
    assert!(digests.windows(2).all(|w| w[0] == w[1]), "the workers' parameters differ:\n{}", run.output);
    assert!(run.output.contains("x4: test accuracy"), "4 workers trained:\n{}", run.output);
    assert!(run.bytes > 1_000_000, "only {} bytes crossed the links", run.bytes);
    assert_clean(slurm);
}

/// `train-digits-ps.sbatch`: chief, one ps task and two workers over two hosts, from Slurm's
/// variables and the job mapping.
#[test]
fn parameter_server_job() {
    let Some(slurm) = cluster(Hosts::new(2)) else { return };
    let (dir, token) = job_dir();
    let run = submit(&slurm, dir.path(), &token, &[], &script("train-digits-ps.sbatch"), "strata-digits-ps");
    run.report("train-digits-ps.sbatch (chief, ps, 2 workers) on 2 hosts");
    // COMPLETED: srun exited 0, so every task did; the ps task and the workers ended because
    // the chief told them the job was over, not because srun stopped them.
    run.assert_completed(&slurm);
    for task in ["ps:0", "worker:0", "worker:1"] {
        assert!(
            run.output.contains(&format!("{task}: the chief finished training; the job is over, exiting")),
            "{task} did not end with the job:\n{}",
            run.output
        );
    }
    assert!(run.accuracy() > 85.0, "{}", run.output);
    let summary = std::fs::read_to_string(dir.path().join(format!("strata-digits-ps-{}.json", run.job)))
        .expect("the chief's summary");
    let summary: serde_json::Value = serde_json::from_str(&summary).expect("JSON");
    let ps = &summary["parameter_servers"];
    assert_eq!(ps["workers"], 2, "{summary}");
    assert_eq!(ps["tasks"].as_array().map(Vec::len), Some(1), "{summary}");
    // Both workers (on the second host) pushed, and every step was applied once.
    let by_worker = ps["tasks"][0]["applied_by_worker"].as_object().expect("applies per worker");
    assert_eq!(by_worker.len(), 2, "{summary}");
    assert!(by_worker.values().all(|n| n.as_u64() > Some(0)), "{summary}");
    assert_eq!(ps["tasks"][0]["pushes_applied"], ps["tasks"][0]["version"], "{summary}");
    assert!(run.bytes > 1_000_000, "only {} bytes crossed the links", run.bytes);
    assert_clean(slurm);
}

/// A node name that resolves nowhere (Slurm reaches the node by its NodeAddr): the job fails
/// in under 5 s, naming the host, instead of retrying for the rendezvous deadline.
#[test]
fn unresolvable_node_name_fails_fast() {
    let Some(slurm) = cluster(Hosts::with_unresolvable(2, &[1])) else { return };
    let (dir, token) = job_dir();
    let run = submit(&slurm, dir.path(), &token, &["--nodes=2"], &script("train-digits.sbatch"), "strata-digits");
    run.report("train-digits.sbatch with node2 unresolvable");
    assert_eq!(run.end.state, "FAILED", "{}", run.output);
    assert!(
        run.output.contains("host \"node2\"") && run.output.contains("does not resolve"),
        "the error names the host:\n{}",
        run.output
    );
    assert!(run.output.contains("Slurm's job step"), "the error names the resolver:\n{}", run.output);
    assert!(run.end.seconds < 5.0, "the job took {} s", run.end.seconds);
    assert_clean(slurm);
}

/// Preemption as a scheduler does it: `scancel --signal=TERM` mid-training. Every task
/// finishes its step, the chief checkpoints it, the job fails with the tasks' 143; submitting
/// the same script again from the same directory resumes and ends with the parameters of a
/// job that was never interrupted, bit for bit.
#[test]
fn preempted_job_resumes_bitwise() {
    let Some(slurm) = cluster(Hosts::new(2)) else { return };
    let bin = strata_bin().to_str().expect("a UTF-8 path").to_string();
    let epochs = "150";
    // The uninterrupted reference.
    let (reference_dir, token) = job_dir();
    let token_path = token.to_str().expect("a UTF-8 path");
    let env = [("STRATA", bin.as_str()), ("STRATA_TOKEN_FILE", token_path), ("STRATA_EPOCHS", epochs)];
    let script = script("train-digits.sbatch");
    let job = slurm.sbatch(reference_dir.path(), &["--nodes=2"], &script, &env);
    let reference = slurm.wait(job, Duration::from_secs(300));
    let reference_out =
        std::fs::read_to_string(reference_dir.path().join(format!("strata-digits-{job}.out"))).unwrap_or_default();
    assert_eq!(reference.state, "COMPLETED", "{reference_out}");
    let reference_digest = digest_of(&reference_out);

    // The preempted job: SIGTERM once the first checkpoint exists (training is under way).
    let (dir, _) = job_dir();
    std::fs::write(dir.path().join("token"), TOKEN).expect("the token file");
    let token = dir.path().join("token");
    let env =
        [("STRATA", bin.as_str()), ("STRATA_TOKEN_FILE", token.to_str().expect("UTF-8")), ("STRATA_EPOCHS", epochs)];
    let started = Instant::now();
    let job = slurm.sbatch(dir.path(), &["--nodes=2"], &script, &env);
    slurm.wait_running(job, Duration::from_secs(60));
    let checkpoints = dir.path().join("strata-digits-checkpoints");
    strata_integration_tests::cluster::wait_for(Duration::from_secs(120), "the first checkpoint", || {
        checkpoints.join("latest").exists()
    });
    let signalled = Instant::now();
    slurm.signal(job, "TERM");
    let preempted = slurm.wait(job, Duration::from_secs(120));
    let stopped_in = signalled.elapsed();
    let out = std::fs::read_to_string(dir.path().join(format!("strata-digits-{job}.out"))).unwrap_or_default();
    eprintln!(
        "preempted job {job}: {} {} {:.1} s after SIGTERM ({:.1} s in all)",
        preempted.state,
        preempted.exit_code,
        stopped_in.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    assert_eq!(preempted.state, "FAILED", "{out}");
    assert!(preempted.exit_code.starts_with("143:"), "the tasks' exit code 143 ends the job: {preempted:?}\n{out}");
    assert!(stopped_in < Duration::from_secs(30), "stopping took {stopped_in:?}");
    assert!(digest_of_opt(&out).is_none(), "the preempted job did not finish training:\n{out}");

    // The same script again, from the same directory: resumes and ends bitwise equal.
    let job = slurm.sbatch(dir.path(), &["--nodes=2"], &script, &env);
    let resumed = slurm.wait(job, Duration::from_secs(300));
    let out = std::fs::read_to_string(dir.path().join(format!("strata-digits-{job}.out"))).unwrap_or_default();
    assert_eq!(resumed.state, "COMPLETED", "{out}");
    assert!(out.contains("resum"), "the job resumed from the checkpoint:\n{out}");
    assert_eq!(digest_of(&out), reference_digest, "the resumed job's parameters differ from the uninterrupted job's");
    assert_clean(slurm);
}

fn digest_of_opt(out: &str) -> Option<String> {
    out.lines().find_map(|l| l.split_once(": parameter digest ").map(|(_, d)| d.trim().to_string()))
}

fn digest_of(out: &str) -> String {
    digest_of_opt(out).unwrap_or_else(|| panic!("no parameter digest in the job's output:\n{out}"))
}

/// `train-digits-elastic.sbatch`, unchanged, on 3 hosts: one host's task is killed mid-job, the
/// other two go on, and the job ends COMPLETED with the accuracy of an undisturbed run.
#[test]
fn elastic_job_survives_a_killed_task() {
    let Some(slurm) = cluster(Hosts::new(3)) else { return };
    let bin = strata_bin().to_str().expect("a UTF-8 path").to_string();
    let (dir, token) = job_dir();
    let token = token.to_str().expect("a UTF-8 path").to_string();
    // 400 epochs: about 15 s of training here with another suite's job beside it, so the kill
    // 2 s after the third task starts lands mid-job (1,500 took 66 s of the suite's time).
    let env = [("STRATA", bin.as_str()), ("STRATA_TOKEN_FILE", token.as_str()), ("STRATA_EPOCHS", "400")];
    let job = slurm.sbatch(dir.path(), &["--nodes=3"], &script("train-digits-elastic.sbatch"), &env);
    slurm.wait_running(job, Duration::from_secs(60));
    // The third task's process, once it trains.
    let mut victim = None;
    strata_integration_tests::cluster::wait_for(Duration::from_secs(60), "the third task", || {
        victim = slurm.hosts().processes().into_iter().find_map(|(pid, cmd)| {
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            let third = env.split(|&b| b == 0).any(|v| v == b"SLURM_PROCID=2");
            (third && cmd.contains(" train ")).then_some(pid)
        });
        victim.is_some()
    });
    std::thread::sleep(Duration::from_secs(2));
    let victim = victim.expect("found");
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(victim as i32), nix::sys::signal::Signal::SIGKILL);
    let end = slurm.wait(job, Duration::from_secs(300));
    let out = std::fs::read_to_string(dir.path().join(format!("strata-digits-elastic-{job}.out"))).unwrap_or_default();
    eprintln!("elastic job {job}: {} {} in {} s", end.state, end.exit_code, end.seconds);
    assert!(end.state == "COMPLETED" && end.exit_code == "0:0", "{end:?}\n{out}\nslurmctld:\n{}", slurm.log());
    assert!(out.contains("lost on the way: worker:2"), "{out}");
    assert!(out.contains("the job completed in generation 2 with worker:0, worker:1"), "{out}");
    let digests: Vec<&str> =
        out.lines().filter_map(|l| l.split_once(": parameter digest ").map(|(_, d)| d.trim())).collect();
    assert_eq!(digests.len(), 2, "the two workers that finished:\n{out}");
    assert_eq!(digests[0], digests[1], "{out}");
    let accuracy: f64 = out
        .lines()
        .find_map(|l| l.split("test accuracy ").nth(1))
        .and_then(|a| a.split('%').next())
        .and_then(|a| a.trim().parse().ok())
        .unwrap_or_else(|| panic!("no accuracy line:\n{out}"));
    assert!(accuracy > 90.0, "{out}");
    assert_clean(slurm);
}
