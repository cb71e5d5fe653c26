//! `strata compare EXPERIMENT.toml`: see [`crate::compare`].

use std::path::PathBuf;

use strata_compare::{self as compare, experiment::Experiment, runner};

use crate::{Error, Result};

/// `strata compare` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct CompareArgs {
    /// The experiment file (TOML; see experiments/ for ready-made ones).
    pub experiment: PathBuf,
    /// Simulate the runs in virtual time over the worker counts of the file's `[simulate]` table,
    /// instead of running real processes.
    #[arg(long)]
    pub simulate: bool,
    /// With --simulate: the time to `[simulate] target_loss` of every multi-worker run against
    /// the link rates of `[simulate] links_gbps` and the worker counts of `workers`, printed
    /// and written to EXTRAPOLATION.md and extrapolation.csv (instead of the usual report).
    #[arg(long, requires = "simulate")]
    pub extrapolate: bool,
    /// Output directory (default: compare-out/NAME, or compare-out/NAME-simulated).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Run only these runs (by name, comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Do not draw progress bars.
    #[arg(long)]
    pub no_progress: bool,
}

/// Runs `strata compare`.
pub fn run(args: &CompareArgs) -> Result<()> {
    let exp = Experiment::load(&args.experiment)?;
    if let Some(name) = args.only.iter().find(|n| !exp.runs.iter().any(|r| &r.name == *n)) {
        let names: Vec<&str> = exp.runs.iter().map(|r| r.name.as_str()).collect();
        return Err(Error::Usage(format!("--only {name:?}: no such run; the runs are {}", names.join(", "))));
    }
    let dir = args.out.clone().unwrap_or_else(|| runner::default_dir(&exp, args.simulate));
    let runs = if args.simulate {
        let cfg = exp.simulate.clone().ok_or_else(|| {
            Error::Usage(format!(
                "{}: --simulate needs a [simulate] table (worker counts, compute time, bandwidth, latency); see experiments/straggler.toml",
                args.experiment.display()
            ))
        })?;
        let mut exp = exp.clone();
        if !args.only.is_empty() {
            exp.runs.retain(|r| args.only.contains(&r.name));
        }
        let bar = strata_compare::progress::bar(!args.no_progress, 1000);
        if args.extrapolate {
            let cells = compare::simulate::extrapolate(&exp, &cfg, &|name: &str, done: f64| {
                bar.set_message(name.to_string());
                bar.set_position((done.clamp(0.0, 1.0) * 1000.0) as u64);
            })?;
            bar.finish_and_clear();
            let target = cfg.target_loss.unwrap_or_default();
            compare::report::write_extrapolation(&dir, &exp, &cfg, &cells, target)?;
            print!("{}", compare::report::extrapolation_table(&cells, target));
            println!("extrapolation: {}", dir.join("EXTRAPOLATION.md").display());
            return Ok(());
        }
        let runs = compare::simulate::simulate(&exp, &cfg, &|name: &str, done: f64| {
            bar.set_message(name.to_string());
            bar.set_position((done.clamp(0.0, 1.0) * 1000.0) as u64);
        })?;
        bar.finish_and_clear();
        runs
    } else {
        // Ctrl-C, SIGTERM or SIGHUP: the run in progress is killed and the emulated hosts are
        // removed by the runner, then the command exits as that signal would; a second signal
        // (or a runner that does not stop within 30 s) cleans up from here and exits.
        let signals = crate::signals::handle()?;
        std::thread::Builder::new()
            .name("strata-compare-signals".into())
            .spawn(move || {
                if let Ok(signal) = signals.recv() {
                    eprintln!("strata compare: {signal} received; stopping the runs");
                    runner::request_stop(signal as i32);
                    let _ = signals.recv_timeout(std::time::Duration::from_secs(30));
                    runner::emergency_cleanup();
                    std::process::exit(crate::signals::exit_code(signal));
                }
            })
            .map_err(|e| Error::io("starting the signal thread", e))?;
        let result = runner::run_all(&exp, &dir, &args.only, !args.no_progress);
        if let Some(signal) = runner::stop_requested() {
            eprintln!("strata compare: stopped by signal {signal}; its processes and emulated hosts are removed");
            std::process::exit(128 + signal);
        }
        result?
    };
    // Simulated runs are measured against [simulate] target_loss where it is set.
    let exp = match exp.simulate.as_ref().and_then(|c| c.target_loss).filter(|_| args.simulate) {
        Some(t) => Experiment { target: compare::Target::Loss(t), ..exp },
        None => exp,
    };
    compare::report::write_outputs(&dir, &exp, &runs, args.simulate)?;
    for s in compare::summarize(&runs, exp.target) {
        let fmt = |v: Option<f64>, unit: &str| v.map_or("-".to_string(), |v| format!("{v:.2}{unit}"));
        let last = match (s.final_accuracy, s.final_validation_loss, s.final_auc) {
            (None, _, Some(auc)) => format!("auc {auc:>7.4}"),
            (None, Some(loss), None) => format!("loss {loss:>7.4}"),
            (a, ..) => format!("accuracy {:>7}", a.map_or("-".into(), |a| format!("{:.2}%", a * 100.0))),
        };
        println!(
            "{:<28} {:<13} {last}  to {}: {:>9}  {:>9} ex/s{}",
            s.name,
            s.status,
            exp.target.short(),
            fmt(s.time_to_target_s, " s"),
            s.examples_per_s.map_or("-".into(), |v| format!("{v:.0}")),
            s.error.map(|e| format!("  error: {e}")).unwrap_or_default()
        );
    }
    println!("report: {}", dir.join("REPORT.md").display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use strata_compare::experiment as exp;

    use crate::train_args::{self, TrainArgs};

    /// `strata train`'s flags alone.
    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        args: TrainArgs,
    }

    #[test]
    fn the_harness_knows_strata_train_s_ctr_defaults() {
        assert_eq!(exp::CTR_DEFAULT_ROWS, train_args::CTR_ROWS);
        assert_eq!(exp::CTR_DEFAULT_TRAIN_RECORDS, train_args::CTR_TRAIN_RECORDS);
        assert_eq!(exp::CTR_DEFAULT_TEST_RECORDS, train_args::CTR_TEST_RECORDS);
        // The rows' optimizer strata train steps a parameter-server run's table with when the
        // flags leave it out.
        let args = Flags::try_parse_from(["train", "--model", "ctr"]).unwrap().args;
        let default = <train_args::TableOptimizerKind as clap::ValueEnum>::from_str(
            exp::CTR_DEFAULT_TABLE_OPTIMIZER.name(),
            false,
        )
        .unwrap();
        assert_eq!(
            format!("{:?}", args.row_optimizer()),
            format!("{:?}", default.row_optimizer(exp::CTR_DEFAULT_TABLE_LR))
        );
        // Every row optimizer the harness names is one strata train takes.
        for o in [
            exp::TableOptimizer::Sgd,
            exp::TableOptimizer::Adagrad,
            exp::TableOptimizer::Ftrl,
            exp::TableOptimizer::LazyAdam,
        ] {
            assert!(Flags::try_parse_from(["train", "--table-optimizer", o.name()]).is_ok(), "{}", o.name());
        }
        // And every parameter-server mode.
        for m in [exp::PsMode::Async, exp::PsMode::Sync, exp::PsMode::Stale, exp::PsMode::Hybrid] {
            assert!(Flags::try_parse_from(["train", "--ps-mode", m.name()]).is_ok(), "{}", m.name());
        }
    }
}
