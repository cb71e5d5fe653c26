//! The `strata` command line: `strata train`, `strata devices`, `strata bench ...`.

use clap::Parser;

/// mimalloc keeps freed blocks for reuse: candle allocates a fresh buffer for every tensor, and
/// with the system allocator each large one is a new mapping whose pages fault in every step.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's options, which it reads from the environment before `main` runs: a process
/// started without them executes itself once more with them set (the same process id,
/// arguments and environment otherwise). A variable the user set is kept; if the executable
/// cannot be found or run again, the process goes on with mimalloc's defaults.
///
/// - `MIMALLOC_PURGE_DELAY=30000`: mimalloc returns memory that stays free for this many
///   milliseconds (default 1000) to the kernel, which must then clear the pages again when
///   they are next touched. A training step frees and reallocates the same large buffers
///   every step, and on the transformer that was 35,000 page faults in 6 s and 4-5% of a step
///   (`clear_page_erms`); with 30 s, about 500 in all.
/// - `MIMALLOC_ALLOW_THP=0`: with transparent huge pages, each region mimalloc touches first
///   is cleared 2 MiB at a time. A hybrid click job's workers, whose buffers change size every
///   step, spent 10% of the job's CPU there; without, the 4.3M MLP and the transformer train
///   as fast, in 15% less memory (`docs/bench/2026-12-06-2300-ctr-rows-with-pull.md`).
fn allocator_options() {
    use std::os::unix::process::CommandExt;
    const OPTIONS: [(&str, &str); 2] = [("MIMALLOC_PURGE_DELAY", "30000"), ("MIMALLOC_ALLOW_THP", "0")];
    let unset: Vec<(&str, &str)> = OPTIONS.into_iter().filter(|(var, _)| std::env::var_os(var).is_none()).collect();
    if unset.is_empty() {
        return;
    }
    let Ok(exe) = std::env::current_exe() else { return };
    let mut args = std::env::args_os();
    let mut command = std::process::Command::new(exe);
    if let Some(arg0) = args.next() {
        command.arg0(arg0);
    }
    // `exec` returns only if it failed.
    let _failed = command.args(args).envs(unset).exec();
}

fn main() {
    allocator_options();
    // Before any thread exists: each replica is one thread (see `strata::init_cpu_threads`).
    // `strata launch` runs no replica, and its tasks must inherit the user's environment as is.
    if std::env::args_os().nth(1).is_none_or(|a| a != "launch") {
        strata::init_cpu_threads();
    }
    let cli = match strata_cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(
                e.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                e.exit();
            }
            // One line, exit code 2: what was wrong, and where to look.
            let text = e.to_string();
            let mut lines = text.lines().skip_while(|l| l.trim().is_empty());
            let mut first = lines.next().unwrap_or("error: invalid arguments").to_string();
            // A list under the first line ("the following required arguments were not
            // provided:" and the arguments, indented) joins it.
            if first.ends_with(':') {
                let listed: Vec<&str> =
                    lines.take_while(|l| l.starts_with(' ') && !l.trim().is_empty()).map(str::trim).collect();
                if !listed.is_empty() {
                    first = format!("{first} {}", listed.join(", "));
                }
            }
            let tip =
                text.lines().find_map(|l| l.trim().strip_prefix("tip: ")).map(|t| format!("; {t}")).unwrap_or_default();
            eprintln!("{first}{tip} (see strata --help)");
            std::process::exit(2);
        }
    };
    let filter =
        tracing_subscriber::EnvFilter::try_new(&cli.log).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    if let Err(e) = strata_cli::run(cli) {
        eprintln!("error: {e}");
        std::process::exit(e.exit_code());
    }
}
