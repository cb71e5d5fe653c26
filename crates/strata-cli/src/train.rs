//! `strata train`: the main job. Its flags are in `train_args`, the end of a run (the summary)
//! in `summary`, and a parameter-server job's coordinator in `ps`.

use std::sync::Arc;

use strata_core::strategy::AutoShardPolicy;
use strata_core::timeline::Timeline;
use strata_core::{Strategy, StrategyHandle, StrategyOptions};
use strata_strategies::{
    CentralStorageStrategy, CpuReduction, MirroredStrategy, MultiWorkerMirroredStrategy, MultiWorkerOptions,
    OneDeviceStrategy,
};

use strata::cnn::Cnn;
use strata::digits;
use strata::model::Mlp;
use strata::shakespeare;
use strata::trainer::{FitReport, StopSignal, TrainConfig, Trainer};
use strata::transformer::{CharTransformer, TransformerConfig};
use strata::StrategyKind;

use crate::summary::{finish, save_params};
pub use crate::summary::{CtrSummary, PsSummary, Summary};
use crate::train_args::checkpoint_dir_writable;
pub use crate::train_args::{
    resolver, transformer_schedule, AutoShardKind, ClusterSource, ModelKind, PsModeKind, ReductionKind, TrainArgs,
    TRANSFORMER_STEPS,
};
use crate::{Error, Result};

/// Builds the strategy the flags ask for.
pub fn make_strategy(args: &TrainArgs, options: StrategyOptions) -> Result<StrategyHandle> {
    if let Some(n) = args.gpus {
        return strata::gpu::gpu_strategy(args.strategy, n, args.cross_device_ops, options);
    }
    let reduction = match args.reduction {
        ReductionKind::InMemory => CpuReduction::InMemoryAllReduce,
        ReductionKind::ToOneDevice => CpuReduction::ReductionToOneDevice,
    };
    if args.replicas == Some(0) {
        return Err(Error::Usage(
            "--replicas 0: a strategy needs at least one replica; pass --replicas 1 or more".into(),
        ));
    }
    Ok(match args.strategy {
        StrategyKind::OneDevice => {
            if let Some(n) = args.replicas.filter(|&n| n != 1) {
                return Err(Error::Usage(format!(
                    "--strategy one-device runs 1 replica, not {n}; drop --replicas or use --strategy mirrored"
                )));
            }
            let device = cpus(args, 1)?.remove(0);
            OneDeviceStrategy::with_options(device, options)?.handle()
        }
        StrategyKind::Mirrored => {
            let devices = cpus(args, args.replicas.unwrap_or(2))?;
            MirroredStrategy::with_options(devices, reduction, options)?.handle()
        }
        StrategyKind::CentralStorage => {
            let devices = cpus(args, args.replicas.unwrap_or(2))?;
            CentralStorageStrategy::with_options(devices, reduction, options)?.handle()
        }
        StrategyKind::MultiWorkerMirrored | StrategyKind::ParameterServer => {
            return Err(Error::Usage("multi-worker strategies are built by their own functions".into()))
        }
    })
}

/// Joins the multi-worker job this task belongs to.
pub fn make_multi_worker(args: &TrainArgs, options: StrategyOptions) -> Result<MultiWorkerMirroredStrategy> {
    // The GPU checks first (`multi_worker_gpus` calls `check_gpus`): they are this task's own,
    // and fail without a cluster.
    let gpus = args.gpus.map(|n| strata::gpu::multi_worker_gpus(n, args.cross_device_ops)).transpose()?;
    let resolver = resolver(args)?;
    let token = crate::cluster_token::resolve(args.cluster_token_file.as_deref())?;
    let mw = multi_worker_options(args, options, token, gpus)?;
    Ok(MultiWorkerMirroredStrategy::from_resolver(resolver.as_ref(), mw)?)
}

/// A hybrid job's worker: multi-worker mirrored over the job's chief and workers (its dense
/// layers), its tables on the ps tasks (`options.tables`).
fn hybrid_multi_worker(
    args: &TrainArgs,
    options: StrategyOptions,
    hybrid: &crate::hybrid::HybridWorker,
) -> Result<MultiWorkerMirroredStrategy> {
    let mw = multi_worker_options(args, options, hybrid.token.clone(), None)?;
    Ok(MultiWorkerMirroredStrategy::new(hybrid.cluster.clone(), mw)?)
}

/// The options of this task's multi-worker strategy, on `gpus` if given.
fn multi_worker_options(
    args: &TrainArgs,
    options: StrategyOptions,
    token: strata_transport::ClusterToken,
    gpus: Option<(Vec<strata_core::device::LogicalDevice>, Option<strata_strategies::CrossWorkerOps>)>,
) -> Result<MultiWorkerOptions> {
    let mut mw = MultiWorkerOptions::new(token)?;
    match gpus {
        Some((devices, ops)) => {
            mw.local_devices = devices;
            mw.cross_worker_ops = ops;
        }
        None => mw.local_devices = cpus(args, args.replicas.unwrap_or(1))?,
    }
    mw.bind = args.bind;
    mw.options = options;
    mw.compression = args.compression;
    if let (Some(min_workers), Some(coordinator)) = (args.min_workers, &args.coordinator) {
        mw.elastic = Some(strata::ElasticOptions { min_workers, coordinator: coordinator.clone() });
    }
    mw.auto_shard = match args.auto_shard() {
        AutoShardKind::Data => AutoShardPolicy::Data,
        AutoShardKind::Off => AutoShardPolicy::Off,
        // The command hands each worker its files itself (`worker_data`); what a worker then
        // holds is its own part of every step.
        AutoShardKind::File => AutoShardPolicy::Off,
    };
    Ok(mw)
}

/// `n` logical CPU devices of one thread each, with `--memory-limit` if given.
fn cpus(args: &TrainArgs, n: usize) -> Result<Vec<strata_core::device::LogicalDevice>> {
    let mut devices = strata_core::device::logical_cpus(n)?;
    for d in &mut devices {
        if let strata_core::device::LogicalKind::Cpu { memory_limit, .. } = &mut d.kind {
            *memory_limit = args.memory_limit;
        }
    }
    Ok(devices)
}

/// Trains and reports.
pub fn run(args: &TrainArgs) -> Result<()> {
    let started = std::time::Instant::now();
    args.check_model_flags()?;
    let hidden = args.hidden();
    if hidden.is_empty() || hidden.contains(&0) {
        return Err(Error::Usage("--hidden needs layer sizes of at least 1, e.g. --hidden 256,256".into()));
    }
    strata::model::check_mlp(digits::FEATURES, &hidden, digits::CLASSES)
        .map_err(|e| Error::Usage(format!("--hidden: {e}")))?;
    if args.epochs() == 0 {
        return Err(Error::Usage("--epochs 0 trains nothing; pass --epochs 1 or more".into()));
    }
    if !(args.lr.is_finite() && args.lr > 0.0) {
        return Err(Error::Usage(format!("--lr {} is not a positive learning rate", args.lr)));
    }
    if args.batch() == 0 {
        return Err(Error::Usage("--batch 0: a step needs at least 1 example; pass --batch 1 or more".into()));
    }
    if !(args.bucket_mib().is_finite() && args.bucket_mib() >= 0.0) {
        return Err(Error::Usage(format!("--bucket-mib {} must be 0 or more", args.bucket_mib())));
    }
    if !(args.row_block_mib().is_finite() && args.row_block_mib() >= 0.0) {
        return Err(Error::Usage(format!("--row-block-mib {} must be 0 or more", args.row_block_mib())));
    }
    let timeline = args.timeline.as_ref().map(|_| Arc::new(Timeline::new()));
    if !(args.collective_timeout().is_finite() && args.collective_timeout() > 0.0) {
        return Err(Error::Usage(format!(
            "--collective-timeout {} must be a positive number of seconds",
            args.collective_timeout()
        )));
    }
    let delays = args.step_delays()?;
    // The cheap checks of the replica count come before any thread or device exists.
    if let Some(n) = args.replicas {
        strata_core::device::check_replicas(n, "replicas").map_err(|_| {
            Error::Usage(format!(
                "--replicas {n}: over the limit of {} replicas per process (one thread each); pass {} or fewer",
                strata_core::device::MAX_REPLICAS,
                strata_core::device::MAX_REPLICAS
            ))
        })?;
    }
    let distributed = matches!(args.strategy, StrategyKind::MultiWorkerMirrored | StrategyKind::ParameterServer);
    if let Some(dir) = args.checkpoint_dir.as_ref().filter(|_| !distributed) {
        // A multi-worker chief checks it itself (only the chief writes there), and so do the
        // ps tasks (each under `ps-<index>`) and a local parameter-server job's coordinator.
        checkpoint_dir_writable(dir)?;
    }
    if let Some(d) = args.network_delay {
        strata_transport::inject::set_network_delay(d);
    }
    if args.strategy == StrategyKind::ParameterServer && args.ps_mode != PsModeKind::Hybrid {
        return crate::ps::train(args, started);
    }
    // A hybrid job's ps task serves here; its workers train as multi-worker mirrored ones.
    let hybrid = match args.strategy {
        StrategyKind::ParameterServer => match crate::hybrid::join(args)? {
            crate::hybrid::Joined::Served => return Ok(()),
            crate::hybrid::Joined::Worker(w) => Some(w),
        },
        _ => None,
    };
    let local_replicas = match args.strategy {
        StrategyKind::OneDevice => 1,
        _ => args.gpus.or(args.replicas).unwrap_or(2),
    };
    if args.batch() < local_replicas {
        return Err(Error::Usage(format!(
            "--batch {} is smaller than the {local_replicas} replicas; every replica needs at least one example per step",
            args.batch()
        )));
    }
    if args.strategy != StrategyKind::MultiWorkerMirrored {
        if let Some((w, _)) = delays.slowdown.iter().find(|(w, _)| *w >= local_replicas) {
            return Err(Error::Usage(format!(
                "--worker-slowdown names replica {w}, but this run has {local_replicas}; slow a replica below that"
            )));
        }
    }
    let options = StrategyOptions {
        bucket_bytes: (args.bucket_mib() * 1024.0 * 1024.0) as usize,
        timeline: timeline.clone(),
        seed: args.seed,
        collective_timeout: std::time::Duration::from_secs_f64(args.collective_timeout()),
        overlap: !args.no_overlap,
        row_block_bytes: (args.row_block_mib() * 1024.0 * 1024.0) as usize,
        zero_stage: args.zero_stage,
        zero_units: args.zero_units.clone(),
        // Mirrored over this machine's CPUs steps shards at --zero-stage 0 (the same bits).
        host_shards: true,
        local_sgd: args.local_sgd(),
        tables: match &hybrid {
            Some(h) => Some(h.store.clone() as Arc<dyn strata_core::embedding::TableStore>),
            None => crate::local_tables::store(args),
        },
    };
    // SIGTERM and SIGINT stop training after the current step (with a checkpoint when
    // --checkpoint-dir is set); a second signal ends the process at once.
    let stop = StopSignal::new();
    arm(&stop, hybrid.as_ref().and_then(|h| h.stopper()))?;
    let multi = match (&hybrid, args.strategy) {
        (Some(h), _) => Some(hybrid_multi_worker(args, options.clone(), h)?),
        (None, StrategyKind::MultiWorkerMirrored) => Some(make_multi_worker(args, options.clone())?),
        _ => None,
    };
    let result = train_with(
        args,
        started,
        multi.as_ref().map_or_else(|| make_strategy(args, options), |m| Ok(m.handle()))?,
        &timeline,
        multi.as_ref(),
        hybrid.as_deref(),
        &stop,
    );
    if let Some(m) = &multi {
        let finished = match &result {
            // A stop on request is agreed by every worker: they leave the job cleanly, saying
            // why (a worker that left an elastic job alone has left it already).
            Ok(()) => m.finish().map_err(Error::from),
            Err(Error::Stopped { code, .. }) => m.finish_with(Some(*code)).map_err(Error::from),
            Err(e) => {
                m.report_error(&strata_core::Error::Cluster(e.to_string()));
                Ok(())
            }
        };
        let result = result.and(finished);
        // A hybrid job's ps tasks are told once every worker is done.
        if let Some(h) = hybrid {
            h.end(m.is_chief(), &result);
        }
        return result;
    }
    result
}

/// Makes SIGTERM, SIGINT and SIGHUP request `stop` (the first one) or end the process at once
/// with 128 + the signal (the second).
/// `before_exit`: what a second signal does before the process exits (stops the tasks it started).
fn arm(stop: &StopSignal, before_exit: Option<Box<dyn Fn() + Send + Sync>>) -> Result<()> {
    let signals = crate::signals::handle()?;
    let stop = stop.clone();
    std::thread::spawn(move || {
        let mut asked = false;
        while let Ok(signal) = signals.recv() {
            if asked {
                eprintln!("strata train: second signal ({signal}); exiting now");
                if let Some(f) = &before_exit {
                    f();
                }
                std::process::exit(crate::signals::exit_code(signal));
            }
            asked = true;
            eprintln!(
                "strata train: {signal} received; stopping after the current step (a second signal exits at once)"
            );
            stop.request(signal as u32);
        }
    });
    Ok(())
}

/// The error that ends a run stopped on request: where it stopped, and how to resume.
fn stopped_error(args: &TrainArgs, stopped: &strata::trainer::Stopped) -> Error {
    let signal = nix::sys::signal::Signal::try_from(stopped.code as i32)
        .map_or_else(|_| format!("code {}", stopped.code), |s| s.to_string());
    let resume = match (&stopped.checkpoint, &args.checkpoint_dir) {
        (Some(dir), _) => format!(
            "; the checkpoint of step {} is in {}: run the same command again to resume",
            stopped.step,
            dir.display()
        ),
        (None, Some(_)) => String::new(),
        (None, None) => "; without --checkpoint-dir nothing was saved".to_string(),
    };
    if stopped.left_job {
        return Error::Stopped {
            step: stopped.step,
            code: stopped.code,
            detail: format!("asked to stop by {signal}: this worker left the elastic job, which goes on without it"),
        };
    }
    Error::Stopped { step: stopped.step, code: stopped.code, detail: format!("asked to stop by {signal}{resume}") }
}

/// This worker's data and the batch its trainer cuts: every row and `--batch` rows, or, under
/// `--auto-shard file` in a job of `W` workers, the rows of files `i`, `i + W`, ... of the
/// `--data` directory and `--batch / W` rows (this worker's part of each step).
fn worker_data(args: &TrainArgs, multi: Option<&MultiWorkerMirroredStrategy>) -> Result<(strata::data::Batch, usize)> {
    let workers = multi.map_or(1, |m| m.num_workers());
    if args.auto_shard() != AutoShardKind::File || workers == 1 {
        return Ok((digits::load(args.data.as_deref())?, args.batch()));
    }
    let Some(dir) = args.data.as_deref() else {
        return Err(Error::Usage(format!(
            "--auto-shard file hands each worker whole files: pass --data with a directory of at least {workers} digits files"
        )));
    };
    let files = digits::shard_files(dir)?;
    if files.len() < workers {
        return Err(Error::Usage(format!(
            "--auto-shard file over {workers} workers needs at least {workers} files, but --data {} has {}; shard the data into more files or use --auto-shard data",
            dir.display(),
            files.len()
        )));
    }
    if !args.batch().is_multiple_of(workers) {
        return Err(Error::Usage(format!(
            "--batch {} over {workers} workers with --auto-shard file: each worker takes an equal part of a step; use a multiple of {workers}",
            args.batch()
        )));
    }
    let index = multi.map_or(0, |m| m.worker_index());
    let mine: Vec<_> = files.into_iter().skip(index).step_by(workers).collect();
    Ok((digits::load_files(&mine)?, args.batch() / workers))
}

fn train_with(
    args: &TrainArgs,
    started: std::time::Instant,
    strategy: StrategyHandle,
    timeline: &Option<Arc<Timeline>>,
    multi: Option<&MultiWorkerMirroredStrategy>,
    hybrid: Option<&crate::hybrid::HybridWorker>,
    stop: &StopSignal,
) -> Result<()> {
    let replicas = strategy.num_replicas_in_sync();
    if args.batch() < replicas {
        return Err(Error::Usage(format!(
            "--batch {} is smaller than the {replicas} replicas; every replica needs at least one example per step",
            args.batch()
        )));
    }
    let is_chief = multi.is_none_or(|m| m.is_chief());
    let joined = multi.and_then(|m| m.extended().workers()).is_some_and(|w| w.joined_under_way());
    let config = |global_batch: usize| -> Result<TrainConfig> {
        Ok(TrainConfig {
            epochs: args.epochs(),
            global_batch,
            seed: args.seed,
            progress: Some(Arc::new(strata_compare::progress::Bar::new(!args.no_progress && is_chief))),
            checkpoint: args.trainer_checkpoint_dir().map(|dir| strata::trainer::CheckpointConfig {
                dir,
                every_steps: args.checkpoint_every.max(1),
                keep: 3,
            }),
            max_steps: args.max_steps,
            metrics: args.metrics_writer(is_chief && !joined)?,
            step_hook: args.step_hook()?,
            stop: Some(stop.clone()),
            loss_scale: args.loss_scale(),
            ..Default::default()
        })
    };
    let run = Run { args, started, timeline, multi, hybrid, replicas, is_chief };
    match args.model {
        ModelKind::Mlp | ModelKind::Cnn => {
            let (all, global_batch) = worker_data(args, multi)?;
            let (train, test) = digits::train_test_split(&all, 0.2, 0);
            let trainer = Trainer::new(config(global_batch)?);
            if args.model == ModelKind::Mlp {
                let hidden = args.hidden();
                let model = strategy.scope(|s| {
                    Ok(Mlp::new(s.var_builder(), digits::FEATURES, &hidden, digits::CLASSES)?
                        .with_recompute(args.recompute)
                        .with_precision(args.precision))
                })?;
                let report = args.optimizer.fit(args.hyper(), &trainer, &strategy, &model, &train, &test)?;
                run.end(&report, &model, None)
            } else {
                let model = strategy.scope(|s| Ok(Cnn::new(s.var_builder())?.with_precision(args.precision)))?;
                let report = args.optimizer.fit(args.hyper(), &trainer, &strategy, &model, &train, &test)?;
                run.end(&report, &model, None)
            }
        }
        ModelKind::Transformer => {
            let corpus = shakespeare::load()?;
            let shape = TransformerConfig { vocab: corpus.vocab_size(), ..args.transformer() };
            shape.check()?;
            let steps = args.steps.unwrap_or(TRANSFORMER_STEPS);
            let windows = steps.checked_mul(args.batch()).filter(|&n| n <= 1 << 24).ok_or_else(|| {
                Error::Usage(format!(
                    "--steps {steps} of --batch {} draws more than 2^24 windows; use fewer steps per epoch and more --epochs",
                    args.batch()
                ))
            })?;
            let train = corpus.random_windows(windows, shape.context, args.seed)?;
            let validation = corpus.validation_windows(shape.context)?;
            let mut cfg = config(args.batch())?;
            let total = (steps * args.epochs()) as u64;
            cfg.clip_global_norm = Some(1.0);
            cfg.schedule = Some(transformer_schedule(args.lr, total));
            let trainer = Trainer::new(cfg);
            let model = strategy.scope(|s| {
                Ok(CharTransformer::new(shape, s.var_builder())?
                    .with_recompute(args.recompute)
                    .with_precision(args.precision))
            })?;
            let task = strata::transformer::task();
            let report =
                args.optimizer.fit_task(args.hyper(), &trainer, &strategy, &model, &task, &train, &validation)?;
            run.end(&report, &model, None)?;
            if let (Some(n), true) = (args.sample, is_chief) {
                let prompt = corpus.encode("\n")?;
                let ids = model.primary().generate(&prompt, n, 0.8, args.seed)?;
                println!("sample ({n} characters, temperature 0.8):\n{}", corpus.decode(&ids));
            }
            Ok(())
        }
        ModelKind::Ctr => train_ctr(&run, &strategy, config(args.batch())?),
    }
}

/// `--model ctr`: the generated records (their keys: every worker holds them all, the strategy
/// keeps each worker's part of every step, and a step generates its records from them), the
/// DLRM-style model, the AUCs.
fn train_ctr(run: &Run<'_>, strategy: &StrategyHandle, mut config: TrainConfig) -> Result<()> {
    use strata::ctr::{CtrData, Dlrm, Split};
    let args = run.args;
    let shape = args.ctr();
    let (train_records, test_records) = args.ctr_records();
    let data = CtrData::new(args.seed, shape.embedding_rows)?;
    let cpu = candle_core::Device::Cpu;
    // The records' keys (8 bytes a record): each step generates its records from them, as a
    // parameter-server worker does, so no process holds the records and a step's time
    // includes making its batch in every mode.
    let train = data.keys(Split::Train, 0..train_records, &cpu)?;
    let test = data.keys(Split::Test, 0..test_records, &cpu)?;
    // The records are generated in random order already; taken in their order, every
    // strategy's step `s` holds records `s * batch..`, as a parameter-server worker streams
    // them, so one device, hybrid and the ps modes see the same batches in the same order.
    config.shuffle = false;
    let trainer = Trainer::new(config);
    let model = strategy.scope(|s| Dlrm::new(s, shape))?;
    if let Some(h) = run.hybrid {
        h.create_tables(args)?;
    }
    let task = strata::ctr::streamed_task(&data);
    let report = args.optimizer.fit_task(args.hyper(), &trainer, strategy, &model, &task, &train, &test)?;
    // Before the AUC's lookups, which are not a training step's.
    let traffic = run.hybrid.map(|h| h.traffic());
    let ctr = if run.is_chief {
        Some(CtrSummary {
            embedding_rows: shape.embedding_rows,
            embedding_dim: shape.embedding_dim,
            train_records,
            test_records,
            final_test_auc: model.primary().auc_of_keys(&data, &test)?,
            best_test_auc: data.best_auc(Split::Test, test_records),
            // A hybrid job's table is not reduced: its rows go to the ps tasks.
            dense_gradient_bytes_per_step: match run.hybrid {
                Some(_) => (shape.parameter_count() - shape.embedding_rows * shape.embedding_dim as u64) * 4,
                None => shape.parameter_count() * 4,
            },
            table_bytes_pulled_per_step: traffic.map(|t| t.bytes_pulled as f64 / t.steps.max(1) as f64),
            table_bytes_pushed_per_step: traffic.map(|t| t.bytes_pushed as f64 / t.steps.max(1) as f64),
        })
    } else {
        None
    };
    run.end(&report, &model, ctr)
}

/// What the end of a run needs to know about it.
struct Run<'a> {
    args: &'a TrainArgs,
    started: std::time::Instant,
    timeline: &'a Option<Arc<Timeline>>,
    multi: Option<&'a MultiWorkerMirroredStrategy>,
    /// A hybrid job's worker (its tables on the ps tasks).
    hybrid: Option<&'a crate::hybrid::HybridWorker>,
    replicas: usize,
    is_chief: bool,
}

impl Run<'_> {
    /// The end of a fit: the stop error, the timeline, the state's mean, the digest and the
    /// chief's summary (or a worker's own `--save-params`).
    fn end<M>(&self, report: &FitReport, model: &strata_core::Replicated<M>, ctr: Option<CtrSummary>) -> Result<()> {
        let (args, multi) = (self.args, self.multi);
        if let Some(stopped) = &report.stopped {
            // No summary and no final parameters: the run is not over.
            return Err(stopped_error(args, stopped));
        }
        // The saved (and compared) state is the mean over replicas and workers (every worker
        // calls it; the trainer did in an elastic job, where it can survive a loss).
        if !multi.is_some_and(|m| m.is_elastic()) {
            model.sync_state()?;
        }
        if let Some(ls) = report.loss_scale {
            let who = multi.map_or(String::new(), |m| format!("worker {}: ", m.worker_index()));
            eprintln!(
                "{who}loss scale {} at the end, {} steps skipped for a gradient that was not finite",
                ls.scale, ls.skipped_steps
            );
        }
        if let Some(m) = multi {
            // Every worker must end with the same parameters; print a digest to compare.
            eprintln!("worker {}: parameter digest {}", m.worker_index(), parameter_digest(model)?);
        }
        // `{task}` in --save-params and --timeline: the worker's rank, or in an elastic job
        // (where ranks change with the membership) its task's place in the cluster spec.
        let index = match multi {
            Some(m) if m.is_elastic() => {
                let c = m.cluster();
                c.spec.sync_workers().iter().position(|t| *t == c.task).unwrap_or_else(|| m.worker_index())
            }
            Some(m) => m.worker_index(),
            None => 0,
        };
        if let (Some(path), Some(t)) = (&args.timeline, self.timeline) {
            let path = match multi {
                Some(_) => {
                    let path = worker_path(path, index);
                    t.write_process_trace(&path, index as u32 + 1, Some(&format!("worker {index}")))?;
                    path
                }
                None => {
                    t.write_chrome_trace(path)?;
                    path.clone()
                }
            };
            eprintln!("timeline: {} events written to {}", t.len(), path.display());
        }
        // In an elastic job the chief is worker 0 of the generation that finished.
        if multi.map_or(self.is_chief, |m| m.is_chief()) {
            let ps = self.hybrid.map(|h| h.summary()).transpose()?;
            finish(args, self.started, self.replicas, report, model.variables(0), index, ps, ctr)?;
        } else if let Some(path) = &args.save_params {
            if path.to_string_lossy().contains("{task}") {
                save_params(path, index, model.variables(0))?;
            }
        }
        Ok(())
    }
}

/// A digest of every parameter's bits (FNV-1a over the f32 bit patterns, in variable order).
pub fn parameter_digest<M>(model: &strata_core::Replicated<M>) -> Result<String> {
    let mut h: u64 = 0xcbf29ce484222325;
    for (name, v) in model.variables(0) {
        for b in name.bytes() {
            h = (h ^ b as u64).wrapping_mul(0x100000001b3);
        }
        for x in v.as_tensor().flatten_all()?.to_vec1::<f32>()? {
            h = (h ^ x.to_bits() as u64).wrapping_mul(0x100000001b3);
        }
    }
    Ok(format!("{h:016x}"))
}

/// Where worker `w` of a multi-worker job (its `{task}` index) writes a file named `path`:
/// `{task}` in the path becomes `w`; without it, worker 0 writes `path` itself and worker `w` the same name with
/// `-worker<w>` before the extension (`t.json`, `t-worker1.json`), so that the processes of a
/// job on one host never write the same file.
fn worker_path(path: &std::path::Path, w: usize) -> std::path::PathBuf {
    if path.to_string_lossy().contains("{task}") {
        return crate::summary::task_path(path, w);
    }
    if w == 0 {
        return path.to_path_buf();
    }
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let name = match path.extension() {
        Some(ext) => format!("{stem}-worker{w}.{}", ext.to_string_lossy()),
        None => format!("{stem}-worker{w}"),
    };
    path.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    /// `strata train`'s flags alone.
    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        args: TrainArgs,
    }

    fn train_args(flags: &[&str]) -> TrainArgs {
        let argv = ["train", "--no-progress"].iter().chain(flags).copied();
        Flags::try_parse_from(argv).unwrap().args
    }

    #[test]
    fn every_worker_writes_its_own_timeline() {
        use std::path::{Path, PathBuf};
        assert_eq!(worker_path(Path::new("out/t.json"), 0), PathBuf::from("out/t.json"));
        assert_eq!(worker_path(Path::new("out/t.json"), 3), PathBuf::from("out/t-worker3.json"));
        assert_eq!(worker_path(Path::new("trace"), 1), PathBuf::from("trace-worker1"));
        assert_eq!(worker_path(Path::new("run-{task}/t.json"), 2), PathBuf::from("run-2/t.json"));
        assert_eq!(worker_path(Path::new("t-{task}.json"), 0), PathBuf::from("t-0.json"));
    }

    #[test]
    fn the_ctr_model_on_one_device_nears_the_planted_auc() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("summary.json");
        let out_flag = out.to_str().unwrap();
        run(&train_args(&["--model", "ctr", "--strategy", "one-device", "--out", out_flag])).unwrap();
        let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        let (auc, best) = (summary["final_test_auc"].as_f64().unwrap(), summary["best_test_auc"].as_f64().unwrap());
        // Measured with the defaults (10,000 rows, 391 steps of 256, AdamW at 0.003): 0.828,
        // the planted model 0.874.
        assert!(auc > 0.79 && best > 0.85 && auc < best, "auc {auc}, planted best {best}");
        assert_eq!(summary["model"], "ctr");
        assert_eq!(summary["embedding_rows"], 10_000);
        assert_eq!(
            summary["dense_gradient_bytes_per_step"].as_u64().unwrap(),
            4 * summary["parameters"].as_u64().unwrap()
        );
        assert!(summary.get("final_test_accuracy").is_none());
    }

    #[test]
    fn the_ctr_model_s_refusals_are_one_line() {
        let refused = |flags: &[&str]| run(&train_args(flags)).unwrap_err().to_string();
        let e = refused(&["--model", "ctr", "--strategy", "parameter-server", "--table-lr=-1"]);
        assert_eq!(e, "--table-lr -1 is not a positive learning rate");
        let e = refused(&["--model", "ctr", "--strategy", "parameter-server", "--replicas", "2"]);
        assert!(e.starts_with("--replicas 2: a parameter-server worker with embedding tables runs one replica"), "{e}");
        let e = refused(&["--model", "mlp", "--embedding-rows", "100"]);
        assert_eq!(e, "--embedding-rows applies to --model ctr, not --model mlp; drop it");
        let e = refused(&["--model", "ctr", "--precision", "bf16"]);
        assert!(e.starts_with("--precision bf16 applies to --model mlp, cnn or transformer"), "{e}");
        let e = refused(&["--model", "ctr", "--embedding-rows", "20"]);
        assert!(e.contains("at least 26 rows"), "{e}");
        let hybrid = |flags: &[&str]| {
            let mut all = vec!["--strategy", "parameter-server", "--ps-mode", "hybrid"];
            all.extend_from_slice(flags);
            refused(&all)
        };
        let e = hybrid(&["--model", "mlp"]);
        assert!(e.starts_with("--ps-mode hybrid trains --model ctr"), "{e}");
        let e = hybrid(&["--model", "ctr", "--max-restarts", "1"]);
        assert!(e.starts_with("--max-restarts 1: a hybrid job's dense layers are synchronous"), "{e}");
        let e = hybrid(&["--model", "ctr", "--backup-workers", "1"]);
        assert!(e.starts_with("--backup-workers 1 applies to --ps-mode sync"), "{e}");
        for e in [e, refused(&["--model", "ctr", "--train-records", "0"])] {
            assert!(!e.contains('\n') && !e.ends_with('.'), "{e}");
        }
    }

    /// The all-reduce's flags on an async, sync or stale parameter-server job, whose workers
    /// push and pull, are refused in one line naming the flag, even at their default values;
    /// a hybrid job, whose workers all-reduce the dense layers, takes them.
    #[test]
    fn the_all_reduce_s_flags_on_a_push_and_pull_job_are_refused() {
        let refused = |flags: &[&str]| run(&train_args(flags)).unwrap_err().to_string();
        for mode in ["async", "sync", "stale"] {
            for (flag, value) in [
                ("--bucket-mib", "25"),
                ("--row-block-mib", "2"),
                ("--collective-timeout", "60"),
                ("--auto-shard", "data"),
            ] {
                let e = refused(&["--strategy", "parameter-server", "--ps-mode", mode, flag, value]);
                assert_eq!(
                    e,
                    format!("{flag} applies to workers that all-reduce (multi-worker-mirrored, mirrored, --ps-mode hybrid), and a --ps-mode {mode} job's workers push and pull; drop it")
                );
            }
        }
        let args = train_args(&[
            "--strategy",
            "parameter-server",
            "--ps-mode",
            "hybrid",
            "--model",
            "ctr",
            "--bucket-mib",
            "1",
        ]);
        assert!(args.check_model_flags().is_ok());
        assert_eq!((args.bucket_mib(), args.row_block_mib(), args.collective_timeout()), (1.0, 2.0, 60.0));
    }
}
