//! `ParameterServerStrategy` end to end, in one process over real gRPC on loopback: ps tasks
//! ([`PsServerHandle`]) and worker tasks ([`serve_worker`]) on `127.0.0.1:0`, a coordinator
//! that creates the variables and schedules registered steps. Every test body runs in its own
//! thread under a hard timeout, and asserts exact (or closed-form) values.

use crate::common;

use std::sync::{mpsc, Arc};
use std::time::Duration;

use crate::common::models::{data, BnNet, Frozen, Heads, TestModel, Tied};
use crate::common::with_timeout;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Init, Linear, VarBuilder};
use strata_core::data::Batch;
use strata_core::optim::FusedAdamW;
use strata_core::{Strategy, StrategyOptions};
use strata_strategies::cluster::{ClusterSpec, TaskType};
use strata_strategies::parameter_server::{
    rows_per_shard, serve_worker, ClusterCoordinator, ParameterServerOptions, ParameterServerStrategy, Partitioner,
    PsModel, PsWorkerModel, StepRegistry, WorkerContext, WorkerOptions,
};
use strata_strategies::OneDeviceStrategy;
use strata_transport::executor::WorkerExecutorHandle;
use strata_transport::ps::{PsMode, PsServerConfig, PsServerHandle, PsStatus, ServerOptimizer, StaleRate};
use strata_transport::ClusterToken;

const TOKEN: &str = "0123456789abcdef0123";

/// The hard limit of every test body.
const TEST_LIMIT: Duration = Duration::from_secs(120);

fn token() -> ClusterToken {
    ClusterToken::new(TOKEN).unwrap()
}

// ---------------------------------------------------------------------------------------------
// The step functions every test worker registers.
// ---------------------------------------------------------------------------------------------

/// Fresh variables shaped as the ps tasks hold them, for a step to pull into.
fn ps_vars(ctx: &WorkerContext) -> strata_core::Result<Vec<(String, Var)>> {
    let placement = ctx.placement()?;
    let mut vars = Vec::new();
    for (name, shape) in placement.variables() {
        vars.push((name.clone(), Var::zeros(shape.as_slice(), DType::F32, &Device::Cpu)?));
    }
    Ok(vars)
}

/// Pulls every variable, waits `sleep_ms`, and pushes all-ones gradients; returns whether the
/// push was applied.
fn ones_step(ctx: &WorkerContext, sleep_ms: u64) -> strata_core::Result<bool> {
    let vars = ps_vars(ctx)?;
    let ticket = ctx.pull(&vars)?;
    if sleep_ms > 0 {
        std::thread::sleep(Duration::from_millis(sleep_ms));
    }
    let grads: Vec<(String, Vec<f32>)> = vars.iter().map(|(n, v)| (n.clone(), vec![1.0; v.elem_count()])).collect();
    Ok(ctx.push(&ticket, &grads)?.applied())
}

/// The fixed data of the linear regression: 8 examples of 3 features, `y = x . [1, -2, 0.5] + 0.25`.
fn linreg_data() -> candle_core::Result<(Tensor, Tensor)> {
    let mut x = Vec::with_capacity(24);
    let mut y = Vec::with_capacity(8);
    for i in 0..8 {
        let row: Vec<f32> = (0..3).map(|j| ((i * 3 + j) % 7) as f32 / 4.0 - 0.5).collect();
        y.push(row[0] - 2.0 * row[1] + 0.5 * row[2] + 0.25);
        x.extend(row);
    }
    Ok((Tensor::from_vec(x, (8, 3), &Device::Cpu)?, Tensor::from_vec(y, (8, 1), &Device::Cpu)?))
}

/// The gradients of the mean squared error of `x w + b` with respect to `w` and `b`.
fn linreg_grads(w: &Var, b: &Var) -> candle_core::Result<(Vec<f32>, Vec<f32>)> {
    let (x, y) = linreg_data()?;
    let pred = x.matmul(w.as_tensor())?.broadcast_add(b.as_tensor())?;
    let loss = (pred - y)?.sqr()?.mean_all()?;
    let grads = loss.backward()?;
    let flat = |v: &Var| -> candle_core::Result<Vec<f32>> {
        match grads.get(v.as_tensor()) {
            Some(g) => g.flatten_all()?.to_vec1::<f32>(),
            None => Ok(vec![0.0; v.elem_count()]),
        }
    };
    Ok((flat(w)?, flat(b)?))
}

fn linreg_step(ctx: &WorkerContext) -> strata_core::Result<bool> {
    let vars = ps_vars(ctx)?;
    let find = |name: &str| {
        vars.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone()).ok_or_else(|| {
            strata_core::Error::InvalidArgument(format!("the parameter servers hold no variable {name:?}"))
        })
    };
    let (w, b) = (find("w")?, find("b")?);
    let ticket = ctx.pull(&vars)?;
    let (gw, gb) = linreg_grads(&w, &b)?;
    Ok(ctx.push(&ticket, &[("w".to_string(), gw), ("b".to_string(), gb)])?.applied())
}

fn registry() -> StepRegistry {
    let mut r = StepRegistry::new();
    r.register("ones", |ctx: &WorkerContext, (): ()| ones_step(ctx, 0));
    r.register("ones_slow", |ctx: &WorkerContext, sleep_ms: u64| ones_step(ctx, sleep_ms));
    r.register("linreg", |ctx: &WorkerContext, (): ()| linreg_step(ctx));
    register_model::<Heads>(&mut r, "heads", 2, &[]);
    register_model::<Frozen>(&mut r, "frozen", 1, &["late.*"]);
    // Two replicas: the worker reduces their gradients, which share tensors, before pushing.
    register_model::<Tied>(&mut r, "tied", 2, &[]);
    register_model::<BnNet<false>>(&mut r, "bn", 1, &[]);
    register_quadratic(&mut r, "quadratic_ahead", true);
    register_quadratic(&mut r, "quadratic_pulled", false);
    r
}

/// Registers `name`: a step of [`build_constant`]'s variables under the loss
/// `(|w|^2 + |b|^2) / 2` (whose gradient is the values it is computed at) on a worker whose
/// look-ahead is `lookahead`. Between its pull and its push the step pushes another update of
/// all-twos gradients, as another worker would: its own push lands one update stale.
fn register_quadratic(r: &mut StepRegistry, name: &str, lookahead: bool) {
    let mut worker = PsWorkerModel::new(1, StrategyOptions::default(), |s| build_constant(s.var_builder())).unwrap();
    worker.set_lookahead(lookahead);
    r.register(name, move |ctx: &WorkerContext, (): ()| -> strata_core::Result<bool> {
        let batch = data(1, 1, 0);
        let out = worker.run_batch(ctx, &batch, |rctx, _| {
            let others = ps_vars(ctx)?;
            let ticket = ctx.pull(&others)?;
            let twos: Vec<(String, Vec<f32>)> =
                others.iter().map(|(n, v)| (n.clone(), vec![2.0; v.elem_count()])).collect();
            assert!(ctx.push(&ticket, &twos)?.applied());
            let (w, b) = worker.model().on(rctx)?;
            let loss = ((w.sqr()?.sum_all()? + b.sqr()?.sum_all()?)? * 0.5)?;
            rctx.backward_and_sync(&loss, worker.optimizer())
        })?;
        Ok(out.push.is_some_and(|p| p.applied()))
    });
}

/// One step of a test model on a parameter-server worker.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
struct ModelStep {
    /// The model's phase (which head `Heads` uses).
    phase: usize,
    /// The seed of the step's batch.
    seed: u64,
    /// Examples in the batch.
    examples: usize,
}

/// Registers `name`: a step of `M` over `replicas` local replicas of the worker (frozen
/// `freeze`), written as under any strategy with [`PsWorkerModel`].
fn register_model<M: TestModel + 'static>(r: &mut StepRegistry, name: &str, replicas: usize, freeze: &[&str]) {
    let mut worker = PsWorkerModel::new(replicas, StrategyOptions::default(), M::build).unwrap();
    if !freeze.is_empty() {
        worker.freeze(freeze).unwrap();
    }
    r.register(name, move |ctx: &WorkerContext, s: ModelStep| -> strata_core::Result<bool> {
        let batch = data(s.examples, M::DIM, s.seed);
        let out = worker.run_batch(ctx, &batch, |rctx, shard| {
            let loss = worker.model().on(rctx)?.loss(s.phase, &shard.batch, rctx.candle_device())?;
            rctx.backward_and_sync(&loss, worker.optimizer())
        })?;
        Ok(out.push.is_some_and(|p| p.applied() || p.dropped()))
    });
}

// ---------------------------------------------------------------------------------------------
// A job in this process.
// ---------------------------------------------------------------------------------------------

/// `num_ps` ps tasks and `num_workers` worker tasks serving on loopback.
struct Job {
    ps: Vec<PsServerHandle>,
    workers: Vec<WorkerExecutorHandle>,
    spec: ClusterSpec,
}

impl Job {
    fn start(num_ps: usize, num_workers: usize, round_timeout: Option<Duration>) -> Self {
        let mut ps = Vec::new();
        for i in 0..num_ps {
            let mut config = PsServerConfig::new(format!("ps:{i}"), token());
            if let Some(t) = round_timeout {
                config.round_timeout = t;
            }
            ps.push(PsServerHandle::start("127.0.0.1:0".parse().unwrap(), config).unwrap());
        }
        let ps_addresses: Vec<String> = ps.iter().map(|p| p.address().to_string()).collect();
        let mut workers = Vec::new();
        for i in 0..num_workers {
            let options = WorkerOptions::new(i, ps_addresses.clone(), token());
            workers.push(serve_worker("127.0.0.1:0".parse().unwrap(), registry(), options).unwrap());
        }
        let worker_addresses: Vec<String> = workers.iter().map(|w| w.address().to_string()).collect();
        let spec = ClusterSpec::new([(TaskType::Ps, ps_addresses), (TaskType::Worker, worker_addresses)]).unwrap();
        Self { ps, workers, spec }
    }

    fn strategy(&self, options: ParameterServerOptions) -> ParameterServerStrategy {
        ParameterServerStrategy::new(self.spec.clone(), options).unwrap()
    }

    fn shutdown(self) {
        for w in self.workers {
            w.shutdown();
        }
        for p in self.ps {
            p.shutdown();
        }
    }
}

fn options(optimizer: ServerOptimizer, mode: PsMode) -> ParameterServerOptions {
    let mut o = ParameterServerOptions::new(token());
    o.optimizer = optimizer;
    o.mode = mode;
    o.seed = 7;
    o
}

fn status(strategy: &ParameterServerStrategy, ps: usize) -> PsStatus {
    strategy.ps_clients()[ps].status().unwrap()
}

/// The coordinator's copy of every variable, flattened, by name.
fn values<M>(model: &PsModel<M>) -> Vec<(String, Vec<f32>)> {
    model
        .variables()
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

/// Every variable's values after pulling them from the ps tasks.
fn pulled<M>(model: &PsModel<M>) -> Vec<(String, Vec<f32>)> {
    model.pull().unwrap();
    values(model)
}

/// A model of two variables with constant, exactly representable values: `w` (4x3) = 10,
/// `b` (3) = -2.
fn build_constant(vb: VarBuilder) -> candle_core::Result<(Tensor, Tensor)> {
    Ok((vb.get_with_hints((4, 3), "w", Init::Const(10.0))?, vb.get_with_hints(3, "b", Init::Const(-2.0))?))
}

/// Asserts every element of `w` is `w0` and every element of `b` is `b0`, exactly.
fn assert_constant(vals: &[(String, Vec<f32>)], w0: f32, b0: f32) {
    assert_eq!(vals.len(), 2, "{vals:?}");
    for (name, v) in vals {
        let want = match name.as_str() {
            "w" => w0,
            "b" => b0,
            other => panic!("unexpected variable {other}"),
        };
        assert!(v.iter().all(|x| *x == want), "{name} should be all {want}, is {v:?}");
    }
}

/// Runs `steps` steps of `function` with `args` and waits for them; every step must report
/// its push applied.
fn run_steps<A: serde::Serialize>(coordinator: &ClusterCoordinator, function: &str, args: &A, steps: usize) {
    let values: Vec<_> = (0..steps).map(|_| coordinator.schedule::<A, bool>(function, args)).collect();
    coordinator.join().unwrap();
    for v in values {
        assert!(v.fetch().unwrap(), "step {} was not applied", v.step());
    }
}

// ---------------------------------------------------------------------------------------------
// The tests.
// ---------------------------------------------------------------------------------------------

/// A linear layer 16 -> 8 and a 64x4 table.
struct Small {
    _linear: Linear,
    _table: Tensor,
}

fn build_small(vb: VarBuilder) -> candle_core::Result<Small> {
    Ok(Small {
        _linear: candle_nn::linear(16, 8, vb.pp("l"))?,
        _table: vb.get_with_hints((64, 4), "table", candle_nn::init::DEFAULT_KAIMING_NORMAL)?,
    })
}

#[test]
fn scope_places_shards_on_ps_tasks() {
    with_timeout(TEST_LIMIT, "scope_places_shards_on_ps_tasks", || {
        let job = Job::start(2, 1, None);
        let mut o = options(ServerOptimizer::Sgd { lr: 0.5 }, PsMode::Async);
        o.partitioner = Partitioner::FixedShards(2);
        let strategy = job.strategy(o);
        let model = strategy.scope(|s| build_small(s.var_builder())).unwrap();
        let initial = values(&model);

        // The same values as any other strategy built with the same seed.
        let cpu = strata_core::device::logical_cpus(1).unwrap().remove(0);
        let local = OneDeviceStrategy::with_options(cpu, StrategyOptions { seed: 7, ..Default::default() }).unwrap();
        let reference = local.scope(|s| build_small(s.var_builder())).unwrap();
        let mut reference: Vec<(String, Vec<f32>)> = reference
            .variables(0)
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap()))
            .collect();
        let mut sorted = initial.clone();
        sorted.sort_by(|a, b| a.0.cmp(&b.0));
        reference.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(sorted, reference);

        // Every variable has two shards of equal rows: part_i lands on ps:i (balanced bytes).
        let full: [(&str, Vec<usize>); 3] = [("l.weight", vec![8, 16]), ("l.bias", vec![8]), ("table", vec![64, 4])];
        for (ps, client) in strategy.ps_clients().iter().enumerate() {
            let st = client.status().unwrap();
            assert_eq!(st.task, format!("ps:{ps}"));
            assert_eq!(st.optimizer, Some(ServerOptimizer::Sgd { lr: 0.5 }));
            let mut held: Vec<_> = st.variables.iter().map(|(info, version)| (info.clone(), *version)).collect();
            held.sort_by(|a, b| a.0.name.cmp(&b.0.name));
            let mut want: Vec<(String, Vec<usize>, u64)> = full
                .iter()
                .map(|(name, shape)| {
                    let rows = rows_per_shard(shape[0], 2);
                    let mut s = shape.clone();
                    s[0] = rows[ps];
                    let offset: usize = rows[..ps].iter().sum();
                    (format!("{name}/part_{ps}"), s, offset as u64)
                })
                .collect();
            want.sort();
            assert_eq!(held.len(), want.len(), "ps:{ps} holds {held:?}");
            for ((info, version), (name, shape, offset)) in held.iter().zip(&want) {
                assert_eq!(&info.name, name);
                assert_eq!(&info.shape, shape, "{name}");
                assert_eq!(info.row_offset, *offset, "{name}");
                assert_eq!(info.part as usize, ps);
                assert_eq!(info.num_parts, 2);
                assert_eq!(*version, 0);
                let (whole, full_shape) = full.iter().find(|(n, _)| *n == info.variable).unwrap();
                assert_eq!(info.variable, *whole);
                assert_eq!(&info.full_shape, full_shape);
            }
            // Each shard holds exactly its rows of the initial values.
            let names: Vec<&str> = want.iter().map(|(n, _, _)| n.as_str()).collect();
            let got = client.pull(&names, 0).unwrap();
            for (info, _, data) in &got.variables {
                let whole = &initial.iter().find(|(n, _)| *n == info.variable).unwrap().1;
                let row: usize = info.full_shape.iter().skip(1).product();
                let start = info.row_offset as usize * row;
                assert_eq!(data.as_slice(), &whole[start..start + info.numel()], "{}", info.name);
            }
        }
        assert_eq!(strategy.placement().unwrap().shards().len(), 6);

        // Pulling reassembles the variables exactly, even over a clobbered local copy.
        for (_, v) in model.variables() {
            v.set(&v.as_tensor().zeros_like().unwrap()).unwrap();
        }
        assert_ne!(values(&model), initial);
        let versions = model.pull().unwrap();
        assert_eq!(versions, vec![0, 0]);
        assert_eq!(values(&model), initial);
        drop(model);
        drop(strategy);
        job.shutdown();
    });
}

#[test]
fn async_all_ones_closed_form() {
    with_timeout(TEST_LIMIT, "async_all_ones_closed_form", || {
        let job = Job::start(1, 2, None);
        let strategy = job.strategy(options(ServerOptimizer::Sgd { lr: 0.5 }, PsMode::Async));
        let model = strategy.scope(|s| build_constant(s.var_builder())).unwrap();
        assert_constant(&values(&model), 10.0, -2.0);
        let coordinator = strategy.coordinator().unwrap();
        run_steps(&coordinator, "ones", &(), 10);
        assert_eq!(coordinator.steps_completed(), 10);
        // Ten applied updates of lr * 1 = 0.5 each: 10 - 5 and -2 - 5, exactly.
        assert_constant(&pulled(&model), 5.0, -7.0);
        let st = status(&strategy, 0);
        assert_eq!(st.pushes_applied, 10);
        assert_eq!(st.applied_by_worker.values().sum::<u64>(), 10);
        assert_eq!(st.version, 10);
        assert_eq!(st.pushes_duplicate, 0);
        assert_eq!(st.pushes_stale, 0);
        assert_eq!(st.mode, PsMode::Async);
        drop(coordinator);
        drop(model);
        drop(strategy);
        job.shutdown();
    });
}

/// The look-ahead in closed form. SGD at 0.5 from `w` = 10, `b` = -2, each step one update
/// stale (another update of twos lands between its pull and its push):
/// - step 1 (nothing to extrapolate from): the twos take `w` to 9, its gradient 10 to 4; `b`
///   goes -3, then -2;
/// - step 2 pulls `w` = 4 two updates after the last pull's 10, and its pushes have landed one
///   update stale: its gradient is computed at `4 + 1/2 (4 - 10)` = 1, so `w` goes 3, then
///   2.5 (without the look-ahead, at 4: 3, then 1); `b` did not move between the pulls and
///   is -2 either way.
#[test]
fn lookahead_computes_a_stale_push_where_it_lands() {
    with_timeout(TEST_LIMIT, "lookahead_computes_a_stale_push_where_it_lands", || {
        for (step, w_end) in [("quadratic_ahead", 2.5), ("quadratic_pulled", 1.0)] {
            let job = Job::start(1, 1, None);
            let strategy = job.strategy(options(ServerOptimizer::Sgd { lr: 0.5 }, PsMode::Async));
            let model = strategy.scope(|s| build_constant(s.var_builder())).unwrap();
            let coordinator = strategy.coordinator().unwrap();
            run_steps(&coordinator, step, &(), 1);
            assert_constant(&pulled(&model), 4.0, -2.0);
            run_steps(&coordinator, step, &(), 1);
            assert_constant(&pulled(&model), w_end, -2.0);
            assert_eq!(status(&strategy, 0).version, 4, "{step}: two updates a step");
            drop(coordinator);
            drop(model);
            drop(strategy);
            job.shutdown();
        }
    });
}

/// `StaleRate::Inverse` in closed form, through the options to the ps tasks. SGD at 0.5 from
/// `w` = 10, `b` = -2, each step's push one update stale (the twos land between its pull and
/// it, themselves fresh, at 0.5), its own at 0.5 / 2, without the look-ahead:
/// - step 1: the twos take `w` to 9 and `b` to -3; the gradient (10, -2) at 0.25 gives 6.5, -2.5;
/// - step 2: twos 5.5, -3.5; the gradient (6.5, -2.5) at 0.25 gives 3.875, -2.875.
#[test]
fn an_inverse_stale_rate_applies_a_push_one_update_stale_at_half_the_rate() {
    with_timeout(TEST_LIMIT, "an_inverse_stale_rate_applies_a_push_one_update_stale_at_half_the_rate", || {
        let job = Job::start(1, 1, None);
        let mut o = options(ServerOptimizer::Sgd { lr: 0.5 }, PsMode::Async);
        o.stale_rate = StaleRate::Inverse;
        let strategy = job.strategy(o);
        let model = strategy.scope(|s| build_constant(s.var_builder())).unwrap();
        assert_eq!(status(&strategy, 0).stale_rate, StaleRate::Inverse);
        let coordinator = strategy.coordinator().unwrap();
        run_steps(&coordinator, "quadratic_pulled", &(), 1);
        assert_constant(&pulled(&model), 6.5, -2.5);
        run_steps(&coordinator, "quadratic_pulled", &(), 1);
        assert_constant(&pulled(&model), 3.875, -2.875);
        assert_eq!(status(&strategy, 0).version, 4, "two updates a step");
        drop(coordinator);
        drop(model);
        drop(strategy);
        job.shutdown();
    });
}

#[test]
fn sync_one_worker_equals_local_sgd() {
    with_timeout(TEST_LIMIT, "sync_one_worker_equals_local_sgd", || {
        const STEPS: usize = 20;
        const LR: f32 = 0.1;
        let job = Job::start(1, 1, None);
        let strategy = job.strategy(options(
            ServerOptimizer::Sgd { lr: f64::from(LR) },
            PsMode::Sync { workers: 1, backup_workers: 0 },
        ));
        let model = strategy
            .scope(|s| {
                let vb = s.var_builder();
                Ok((
                    vb.get_with_hints((3, 1), "w", candle_nn::init::DEFAULT_KAIMING_NORMAL)?,
                    vb.get_with_hints(1, "b", Init::Randn { mean: 0.0, stdev: 0.5 })?,
                ))
            })
            .unwrap();
        let initial = values(&model);
        let coordinator = strategy.coordinator().unwrap();
        run_steps(&coordinator, "linreg", &(), STEPS);

        // The same steps of plain SGD here, in f32, with the same gradients.
        let get = |name: &str| initial.iter().find(|(n, _)| n == name).unwrap().1.clone();
        let w = Var::from_tensor(&Tensor::from_vec(get("w"), (3, 1), &Device::Cpu).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::from_vec(get("b"), 1, &Device::Cpu).unwrap()).unwrap();
        for _ in 0..STEPS {
            let (gw, gb) = linreg_grads(&w, &b).unwrap();
            for (var, g) in [(&w, gw), (&b, gb)] {
                let mut v = var.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                v.iter_mut().zip(&g).for_each(|(x, g)| *x -= LR * g);
                var.set(&Tensor::from_vec(v, var.dims(), &Device::Cpu).unwrap()).unwrap();
            }
        }
        let local: Vec<(String, Vec<f32>)> = [("w", &w), ("b", &b)]
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap()))
            .collect();
        let remote = pulled(&model);
        let mut moved = 0f32;
        for (name, want) in &local {
            let got = &remote.iter().find(|(n, _)| n == name).unwrap().1;
            let start = &initial.iter().find(|(n, _)| n == name).unwrap().1;
            assert_eq!(got.len(), want.len());
            for ((g, w), s) in got.iter().zip(want).zip(start) {
                assert!((g - w).abs() <= 1e-6, "{name}: parameter server {g} vs local SGD {w}");
                moved = moved.max((w - s).abs());
            }
        }
        assert!(moved > 1e-3, "training did not move the parameters (by {moved})");
        let st = status(&strategy, 0);
        assert_eq!(st.rounds, STEPS as u64);
        assert_eq!(st.pushes_applied, STEPS as u64);
        assert_eq!(st.pushes_dropped, 0);
        drop(coordinator);
        drop(model);
        drop(strategy);
        job.shutdown();
    });
}

#[test]
fn sync_two_workers_drain_odd_steps() {
    with_timeout(TEST_LIMIT, "sync_two_workers_drain_odd_steps", || {
        let job = Job::start(1, 2, Some(Duration::from_secs(30)));
        let strategy =
            job.strategy(options(ServerOptimizer::Sgd { lr: 0.5 }, PsMode::Sync { workers: 2, backup_workers: 0 }));
        let model = strategy.scope(|s| build_constant(s.var_builder())).unwrap();
        let coordinator = Arc::new(strategy.coordinator().unwrap());
        // Each step waits 200 ms after its pull, so that all five are queued before the first
        // push: rounds then pair steps (0, 1) and (2, 3), and step 4 drains alone.
        let values: Vec<_> = (0..5).map(|_| coordinator.schedule::<u64, bool>("ones_slow", &200)).collect();
        let (tx, rx) = mpsc::channel();
        let c = coordinator.clone();
        std::thread::spawn(move || {
            let _ = tx.send(c.join());
        });
        match rx.recv_timeout(Duration::from_secs(25)) {
            Ok(r) => r.unwrap(),
            Err(_) => panic!("join did not return within 25 s: the last, odd sync round was not drained"),
        }
        for v in &values {
            assert!(v.fetch().unwrap(), "step {} was not applied", v.step());
        }
        let st = status(&strategy, 0);
        assert_eq!(st.rounds, 3, "{st:?}");
        assert_eq!(st.pushes_applied, 5, "{st:?}");
        assert_eq!(st.pushes_dropped, 0, "{st:?}");
        // Three rounds, each applying the mean of all-ones gradients (ones): 10 - 1.5, -2 - 1.5.
        assert_constant(&pulled(&model), 8.5, -3.5);
        drop(coordinator);
        drop(model);
        drop(strategy);
        job.shutdown();
    });
}

#[test]
fn stale_zero_reruns_refused_pushes() {
    with_timeout(TEST_LIMIT, "stale_zero_reruns_refused_pushes", || {
        const STEPS: usize = 6;
        let job = Job::start(1, 2, None);
        let strategy = job.strategy(options(ServerOptimizer::Sgd { lr: 0.5 }, PsMode::Stale { staleness: 0 }));
        let model = strategy.scope(|s| build_constant(s.var_builder())).unwrap();
        let coordinator = strategy.coordinator().unwrap();
        run_steps(&coordinator, "ones_slow", &20u64, STEPS);
        let st = status(&strategy, 0);
        assert_eq!(st.pushes_applied, STEPS as u64, "{st:?}");
        assert_eq!(st.version, STEPS as u64, "{st:?}");
        assert_eq!(st.applied_by_worker.values().sum::<u64>(), STEPS as u64);
        eprintln!("stale pushes refused and re-run: {}", st.pushes_stale);
        // Six applied updates of 0.5 each: 10 - 3, -2 - 3.
        assert_constant(&pulled(&model), 7.0, -5.0);
        drop(coordinator);
        drop(model);
        drop(strategy);
        job.shutdown();
    });
}

#[test]
fn unregistered_step_fails_naming_it() {
    with_timeout(TEST_LIMIT, "unregistered_step_fails_naming_it", || {
        let job = Job::start(1, 1, None);
        let strategy = job.strategy(options(ServerOptimizer::Sgd { lr: 0.5 }, PsMode::Async));
        let model = strategy.scope(|s| build_constant(s.var_builder())).unwrap();
        let coordinator = strategy.coordinator().unwrap();
        let missing = coordinator.schedule::<(), bool>("no_such_step", &());
        let err = coordinator.fetch(&missing).unwrap_err().to_string();
        assert!(err.contains("no_such_step"), "{err}");
        assert!(coordinator.join().is_err());
        // Nothing was pushed, and the worker still runs registered steps.
        assert_eq!(status(&strategy, 0).pushes_applied, 0);
        run_steps(&coordinator, "ones", &(), 1);
        assert_constant(&pulled(&model), 9.5, -2.5);
        drop(coordinator);
        drop(model);
        drop(strategy);
        job.shutdown();
    });
}

#[test]
fn restarted_coordinator_gets_trained_values() {
    with_timeout(TEST_LIMIT, "restarted_coordinator_gets_trained_values", || {
        let job = Job::start(2, 2, None);
        let make = || {
            let mut o = options(ServerOptimizer::Sgd { lr: 0.5 }, PsMode::Async);
            o.partitioner = Partitioner::FixedShards(2);
            o
        };
        {
            let first = job.strategy(make());
            let model = first.scope(|s| build_constant(s.var_builder())).unwrap();
            assert_constant(&values(&model), 10.0, -2.0);
            let coordinator = first.coordinator().unwrap();
            run_steps(&coordinator, "ones", &(), 4);
            assert_constant(&pulled(&model), 8.0, -4.0);
        }
        // A second coordinator on the same ps tasks: its scope finds the variables existing and
        // returns the trained values, not the seed's.
        let second = job.strategy(make());
        let model = second.scope(|s| build_constant(s.var_builder())).unwrap();
        assert_constant(&values(&model), 8.0, -4.0);
        let applied: u64 = (0..2).map(|ps| status(&second, ps).pushes_applied).sum();
        assert_eq!(applied, 8, "4 steps, each pushing to both ps tasks");
        // And it trains on from there.
        let coordinator = second.coordinator().unwrap();
        run_steps(&coordinator, "ones", &(), 2);
        assert_constant(&pulled(&model), 7.0, -5.0);
        drop(coordinator);
        drop(model);
        drop(second);
        job.shutdown();
    });
}

/// One device's parameters after the steps `rounds` (each a phase and the batches whose
/// concatenation is the round's global batch) of `M` with AdamW (`opt`'s parameters), `freeze`
/// frozen, from the seed-7 initial values the ps tasks start from.
fn one_device_reference<M: TestModel>(
    rounds: &[(usize, Vec<Batch>)],
    opt: &candle_nn::ParamsAdamW,
    freeze: &[&str],
) -> Vec<(String, Vec<f32>)> {
    let cpu = strata_core::device::logical_cpus(1).unwrap().remove(0);
    let one = OneDeviceStrategy::with_options(cpu, StrategyOptions { seed: 7, ..Default::default() }).unwrap();
    let mut model = one.scope(M::build).unwrap();
    if !freeze.is_empty() {
        model.freeze(freeze).unwrap();
    }
    let o = model.optimizer::<FusedAdamW>(opt.clone()).unwrap();
    for (phase, parts) in rounds {
        let mut global = parts[0].clone();
        for p in &parts[1..] {
            global.features.extend_from_slice(&p.features);
            global.labels.extend_from_slice(&p.labels);
        }
        let db = strata_core::data::DistributedBatch::split(&global, 1).unwrap();
        one.run_batch(&db, |ctx, shard| {
            let loss = model.on(ctx)?.loss(*phase, &shard.batch, ctx.candle_device())?;
            ctx.backward_and_sync(&loss, &o)
        })
        .unwrap();
    }
    model.values().unwrap().into_iter().map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect()
}

fn adamw() -> (ServerOptimizer, candle_nn::ParamsAdamW) {
    let p = candle_nn::ParamsAdamW { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-7, weight_decay: 0.1 };
    (ServerOptimizer::AdamW { lr: p.lr, beta1: p.beta1, beta2: p.beta2, eps: p.eps, weight_decay: p.weight_decay }, p)
}

/// Parameter values by name.
type Values = Vec<(String, Vec<f32>)>;

/// Runs `steps` of the registered step `name` (of `M`, `freeze` frozen) on `job` in `mode`
/// with AdamW, one at a time when `sequential`; returns the ps tasks' values and one device's
/// on `rounds`.
fn ps_against_one_device<M: TestModel>(
    job: &Job,
    mode: PsMode,
    name: &str,
    freeze: &[&str],
    steps: &[ModelStep],
    rounds: &[(usize, Vec<Batch>)],
    sequential: bool,
) -> (ParameterServerStrategy, Values, Values) {
    let (server, params) = adamw();
    let strategy = job.strategy(options(server, mode));
    let model = strategy.scope(M::build).unwrap();
    let want = one_device_reference::<M>(rounds, &params, freeze);
    let coordinator = strategy.coordinator().unwrap();
    let mut pending = Vec::new();
    for s in steps {
        let v = coordinator.schedule::<ModelStep, bool>(name, s);
        if sequential {
            // One at a time, so that each step starts from the previous one's values.
            assert!(v.fetch().unwrap(), "{name}: step {} was not applied", v.step());
        } else {
            pending.push(v);
        }
    }
    coordinator.join().unwrap();
    for v in pending {
        assert!(v.fetch().unwrap(), "{name}: step {} was not applied", v.step());
    }
    let got = pulled(&model);
    drop(coordinator);
    (strategy, want, got)
}

/// Async with one worker: the steps of a model with heads unused in some steps (and on some
/// of the worker's two replicas) and of a model with frozen layers end on one device's
/// parameters under AdamW with weight decay (which a zero gradient would move), over two ps
/// tasks, one of which gets empty pushes; and a model with BatchNorm, whose running statistics
/// (state on the ps tasks, moved by the worker's pushed changes) end as one device's too.
#[test]
fn async_one_worker_unused_and_frozen_end_as_one_device() {
    with_timeout(TEST_LIMIT, "async_one_worker_unused_and_frozen_end_as_one_device", || {
        let steps: Vec<ModelStep> =
            (0..8).map(|k| ModelStep { phase: k / 3, seed: 300 + k as u64, examples: 15 }).collect();
        let rounds: Vec<_> = steps.iter().map(|s| (s.phase, vec![data(s.examples, 6, s.seed)])).collect();
        let images: Vec<_> = steps.iter().map(|s| (s.phase, vec![data(s.examples, 36, s.seed)])).collect();
        for name in ["heads", "frozen", "bn"] {
            let job = Job::start(2, 1, None);
            let (strategy, want, got) = match name {
                "heads" => ps_against_one_device::<Heads>(&job, PsMode::Async, name, &[], &steps, &rounds, true),
                "frozen" => {
                    ps_against_one_device::<Frozen>(&job, PsMode::Async, name, &["late.*"], &steps, &rounds, true)
                }
                _ => ps_against_one_device::<BnNet<false>>(&job, PsMode::Async, name, &[], &steps, &images, true),
            };
            if name == "bn" {
                let mean = &got.iter().find(|(n, _)| n == "bn.running_mean").unwrap().1;
                assert!(mean.iter().all(|x| *x != 0.0), "the statistics must move: {mean:?}");
            }
            let d = common::max_rel_diff(&want, &got);
            assert!(d <= 1e-5, "{name}: the parameter servers differ from one device by {d}");
            for ps in 0..2 {
                assert_eq!(status(&strategy, ps).version, 8, "{name}: every step is one update of every task");
            }
            drop(strategy);
            job.shutdown();
        }
    });
}

/// Sync with two workers: each round averages the two workers' pushes, with zeros for a head
/// only one of them used; it ends on one device's parameters on the concatenated batches, as
/// does a model whose variables share gradient tensors (on workers of two replicas).
#[test]
fn sync_two_workers_unused_and_frozen_end_as_one_device() {
    with_timeout(TEST_LIMIT, "sync_two_workers_unused_and_frozen_end_as_one_device", || {
        // Round r is steps 2r and 2r + 1 (a worker waits in its push until its round is
        // applied), both in phase r.
        let steps: Vec<ModelStep> =
            (0..8).map(|k| ModelStep { phase: k / 2, seed: 500 + k as u64, examples: 12 }).collect();
        let rounds: Vec<(usize, Vec<Batch>)> =
            steps.chunks(2).map(|r| (r[0].phase, r.iter().map(|s| data(s.examples, 6, s.seed)).collect())).collect();
        let mode = PsMode::Sync { workers: 2, backup_workers: 0 };
        for name in ["heads", "frozen", "tied"] {
            let job = Job::start(1, 2, Some(Duration::from_secs(30)));
            let (strategy, want, got) = match name {
                "heads" => ps_against_one_device::<Heads>(&job, mode, name, &[], &steps, &rounds, false),
                "frozen" => ps_against_one_device::<Frozen>(&job, mode, name, &["late.*"], &steps, &rounds, false),
                _ => ps_against_one_device::<Tied>(&job, mode, name, &[], &steps, &rounds, false),
            };
            let d = common::max_rel_diff(&want, &got);
            assert!(d <= 1e-5, "{name}: the sync parameter servers differ from one device by {d}");
            assert_eq!(status(&strategy, 0).rounds, 4);
            drop(strategy);
            job.shutdown();
        }
    });
}
