//! `strata compare`: the same training under several strategies, measured and drawn.
//!
//! An experiment file (TOML, see `experiments/`) names the model, the data, the seed, the
//! global batch and a list of runs (one device, Mirrored, CentralStorage, MultiWorkerMirrored,
//! ParameterServer in async, sync, sync-with-backup and bounded-staleness modes), plus the
//! heterogeneity to inject (slow workers, random stragglers, network delay). Every run is a
//! real `strata train` process (several, for the multi-process strategies) that writes its
//! per-step and per-evaluation records ([`strata::metrics`]); `--simulate` runs the same
//! strategies in virtual time over hundreds of workers instead ([`simulate`]). The output is
//! one directory per experiment: `runs.csv`, `summary.json`, plots (PNG and SVG) and
//! `REPORT.md`.

pub mod calibrate;
pub mod experiment;
pub mod faults;
pub mod hosts;
pub mod inject;
pub mod plot;
pub mod progress;
pub mod report;
pub mod results;
pub mod runner;
pub mod sim_config;
pub mod simulate;
pub mod target;

pub use results::{summarize, RunResult, RunSummary};
pub use strata::{Error, Result};
pub use target::Target;
