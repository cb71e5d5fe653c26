//! The `strata` command line: `strata train`, `strata devices`, `strata bench ...`.

use clap::Parser;

/// mimalloc keeps freed blocks for reuse: candle allocates a fresh buffer for every tensor, and
/// with the system allocator each large one is a new mapping whose pages fault in every step.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
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
            let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("error: invalid arguments");
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
