//! `strata train --strategy parameter-server --ps-mode hybrid`: PERSIA's hybrid training of the
//! ctr model. Its embedding table lives on the ps tasks, row-sharded, and trains
//! asynchronously: each worker pulls the rows its batch touches and pushes their gradients, which
//! a ps task applies as they arrive ([`PsTables`]). Its dense layers live on every worker and
//! train synchronously: their gradients are all-reduced over the workers' ring, as under
//! multi-worker mirrored, which is the strategy each worker runs.
//!
//! Without `TF_CONFIG` this process is worker 0: it starts the ps tasks (`strata ps`) and the
//! other workers (this same command, with `TF_CONFIG` naming their task) on loopback, and stops
//! them when it ends. With `TF_CONFIG` (e.g. under `strata launch --ps N`), a ps task serves and
//! the chief and workers train; the first of them (the chief, else worker 0) writes the summary
//! and tells the ps tasks that the job is over.

use std::sync::Arc;
use std::time::Duration;

use strata_strategies::cluster::{ClusterConfig, TaskId, TaskType};
use strata_strategies::parameter_server::{PsTables, RowsPush, TableTraffic};
use strata_transport::ps::{PsClient, PsClientConfig, PsMode};
use strata_transport::{ClusterToken, MutualTls};

use crate::ps::{self, LocalCluster};
use crate::summary::PsSummary;
use crate::train_args::{ModelKind, TrainArgs};
use crate::{cluster_token, launch, Error, Result};

/// What this process is in a hybrid job.
pub(crate) enum Joined {
    /// A ps task, which served until the job ended.
    Served,
    /// A worker, with what it trains by.
    Worker(Box<HybridWorker>),
}

/// A worker of a hybrid job: its cluster, its token, the store of its embedding tables on
/// the ps tasks, and (worker 0 of a job it started itself) the other tasks' processes.
pub(crate) struct HybridWorker {
    /// The cluster, as this worker's task.
    pub(crate) cluster: ClusterConfig,
    /// The token every task presents.
    pub(crate) token: ClusterToken,
    /// The tables' store (the strategy's `StrategyOptions::tables`).
    pub(crate) store: Arc<PsTables>,
    /// The ps tasks and their addresses.
    ps: Vec<(TaskId, String)>,
    /// A client of every ps task, by index.
    clients: Vec<PsClient>,
    /// The tasks this process started (none under `TF_CONFIG`).
    local: Option<LocalCluster>,
}

/// The flags a hybrid job refuses, before any task starts.
fn check(args: &TrainArgs) -> Result<()> {
    let refuse = |what: String| Err(Error::Usage(what));
    if args.model != ModelKind::Ctr {
        return refuse(format!(
            "--ps-mode hybrid trains --model ctr (its table on the ps tasks, its dense layers all-reduced); --model {} has no table: use --strategy multi-worker-mirrored",
            args.model.name()
        ));
    }
    if let Some(n) = args.replicas.filter(|&n| n != 1) {
        return refuse(format!(
            "--replicas {n}: a hybrid worker runs one replica (its rows are pulled and pushed once per step); start more --workers instead"
        ));
    }
    if args.gpus.is_some() {
        return refuse("--gpus: a hybrid job's workers train on the CPU here; drop it".into());
    }
    if args.max_restarts > 0 {
        return refuse(format!(
            "--max-restarts {}: a hybrid job's dense layers are synchronous, so a lost worker stops the job (as under multi-worker mirrored); drop it",
            args.max_restarts
        ));
    }
    if args.backup_workers > 0 {
        return refuse(format!(
            "--backup-workers {} applies to --ps-mode sync; a hybrid job's tables are asynchronous and its dense layers wait for every worker, drop it",
            args.backup_workers
        ));
    }
    if args.min_workers.is_some() {
        return refuse("--min-workers: a hybrid job is not elastic; drop it".into());
    }
    Ok(())
}

/// Joins the hybrid job `args` describe: serves a ps task of a `TF_CONFIG` cluster, or
/// returns the worker this process is (starting the local cluster without `TF_CONFIG`).
pub(crate) fn join(args: &TrainArgs) -> Result<Joined> {
    check(args)?;
    let (from_env, _) = ps::cluster_from_env(args)?;
    let (cluster, token, local) = match from_env {
        Some(c) => match c.task.kind {
            TaskType::Ps => {
                ps::serve_task(args, c)?;
                return Ok(Joined::Served);
            }
            TaskType::Worker | TaskType::Chief => {
                let token = cluster_token::resolve(args.cluster_token_file.as_deref())?;
                (c, token, None)
            }
            other => {
                return Err(Error::Usage(format!(
                    "TF_CONFIG names a {other} task; a hybrid job has chief or worker tasks (which train) and ps tasks"
                )))
            }
        },
        None => {
            let (c, token, local) = start_local(args)?;
            (c, token, Some(local))
        }
    };
    cluster.spec.require_ps()?;
    let ps: Vec<(TaskId, String)> = (0..cluster.spec.num_tasks(TaskType::Ps))
        .map(|i| Ok((TaskId::ps(i), cluster.spec.address(TaskId::ps(i))?.to_string())))
        .collect::<Result<_>>()?;
    // A ps task may still be starting: calls are retried while it is unavailable.
    let config = PsClientConfig { timeout: Duration::from_secs(60), retry_for: Duration::from_secs(60) };
    let clients = ps
        .iter()
        .map(|(task, address)| PsClient::connect(address, &task.to_string(), token.clone(), config.clone()))
        .collect::<strata_transport::Result<Vec<_>>>()
        .map_err(strata_core::Error::from)?;
    let store = Arc::new(PsTables::new(cluster.task.to_string(), clients.clone()).pushing_rows(rows_push()?));
    Ok(Joined::Worker(Box::new(HybridWorker { cluster, token, store, ps, clients, local })))
}

/// When a worker's rows leave for the ps tasks: with the next step's pull
/// ([`RowsPush::WithNextPull`]), unless `STRATA_ROWS_PUSH=step-end` (for measurements) has
/// them pushed at the end of each step.
fn rows_push() -> Result<RowsPush> {
    match std::env::var("STRATA_ROWS_PUSH").as_deref() {
        Err(_) | Ok("next-pull") => Ok(RowsPush::WithNextPull),
        Ok("step-end") => Ok(RowsPush::AtStepEnd),
        Ok(other) => Err(Error::Usage(format!("STRATA_ROWS_PUSH={other:?}: say next-pull or step-end, or unset it"))),
    }
}

/// Starts `--ps-tasks` ps tasks and `--workers - 1` workers on loopback; this process is
/// worker 0.
fn start_local(args: &TrainArgs) -> Result<(ClusterConfig, ClusterToken, LocalCluster)> {
    ps::check_local_sizes(args, "hybrid")?;
    let tasks = launch::tasks(false, args.workers, args.ps_tasks);
    let addresses = launch::free_addresses(args.bind, tasks.len())?;
    let spec = launch::cluster_spec(&tasks, &addresses)?;
    // The workers this process starts read --cluster-token-file as it does; the ps tasks
    // take the same token from their environment.
    let text = match &args.cluster_token_file {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("reading the cluster token {}", path.display()), e))?
            .trim()
            .to_string(),
        None => cluster_token::for_local_cluster(),
    };
    let mut token = ClusterToken::new(&text).map_err(|e| Error::Usage(e.to_string()))?;
    if let Some(tls) = MutualTls::from_env().map_err(|e| Error::Usage(e.to_string()))? {
        token = token.with_tls(tls);
    }
    let delays = args.step_delays()?;
    let resume = ps::ps_resume(args, args.ps_tasks)?;
    let local = LocalCluster::start(args, &spec, &text, &delays, true, resume)?;
    Ok((ClusterConfig::new(spec, TaskId::worker(0))?, token, local))
}

impl HybridWorker {
    /// Creates the tables' shards on the ps tasks (after the model declared them in the scope):
    /// rows stepped by `--table-optimizer`, applied as they arrive. Every worker does it; a
    /// task answers a table that exists as described without changing it.
    pub(crate) fn create_tables(&self, args: &TrainArgs) -> Result<()> {
        let optimizer = args.row_optimizer();
        Ok(self.store.create_tables(args.seed, &optimizer, PsMode::Async)?)
    }

    /// What stops the tasks this process started, if it started any (worker 0 of a local job):
    /// run before the process exits on a second signal.
    pub(crate) fn stopper(&self) -> Option<Box<dyn Fn() + Send + Sync>> {
        self.local.as_ref().map(|l| Box::new(l.stopper()) as Box<dyn Fn() + Send + Sync>)
    }

    /// What this worker's steps pulled and pushed.
    pub(crate) fn traffic(&self) -> TableTraffic {
        self.store.traffic()
    }

    /// The summary's parameter-server part: the ps tasks' counters, in mode `hybrid`.
    pub(crate) fn summary(&self) -> Result<PsSummary> {
        let (_, _, tasks) = ps::task_summaries(&self.clients)?;
        let workers = self.cluster.spec.num_sync_workers();
        Ok(PsSummary { mode: "hybrid".into(), stale_rate: None, workers, coordinator: None, tasks })
    }

    /// The end of the job, after every worker finished training (`outcome`): the first worker
    /// tells the ps tasks that the job is over, and worker 0 of a local job waits for its
    /// tasks to exit (those left are stopped when it is dropped).
    pub(crate) fn end(self, first: bool, outcome: &Result<()>) {
        if first {
            let reason = match outcome {
                Ok(()) => "the hybrid job finished training".to_string(),
                Err(e) => format!("the hybrid job failed: {e}"),
            };
            let reason = ps::within_bytes(&reason, strata_transport::control::MAX_REASON_BYTES);
            let deadline = if outcome.is_ok() { ps::FINISH_DEADLINE } else { ps::FINISH_DEADLINE_AFTER_FAILURE };
            if let Some(local) = &self.local {
                local.finishing.store(true, std::sync::atomic::Ordering::SeqCst);
            }
            for (task, address) in &self.ps {
                let told = strata_transport::control::finish_task(
                    address,
                    &task.to_string(),
                    self.token.clone(),
                    &reason,
                    deadline,
                );
                if let Err(e) = told {
                    eprintln!("strata train: {task} was not told that the job is over ({e}); it stops after its --chief-timeout");
                }
            }
        }
        if let Some(local) = &self.local {
            // The other workers leave the ring after the last step, then exit by themselves.
            local.wait_exited(if outcome.is_ok() { Duration::from_secs(30) } else { ps::FINISH_DEADLINE });
        }
    }
}
