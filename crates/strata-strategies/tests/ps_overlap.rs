//! Parameter-server pushes that start while the backward pass runs
//! ([`PsWorkerModel::backward_and_push`]), end to end over real gRPC on loopback: the same
//! results bit for bit with overlap on and off, a push the ps task receives while the worker's
//! backward pass is held before its last gradients, a stale refusal of an overlapped push
//! re-run and applied once, and clipping falling back to a push after the pass. Every test
//! body runs under a hard timeout; nothing asserts a duration.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::models::{data, BnNet, Frozen, Heads, TestModel};
use crate::common::with_timeout;
use candle_core::{CpuStorage, DType, Device, Layout, Module, Shape, Tensor};
use candle_nn::Linear;
use strata_core::cross_device::compression::Compression;
use strata_core::{Scope, StrategyOptions};
use strata_strategies::cluster::{ClusterSpec, TaskType};
use strata_strategies::parameter_server::{
    serve_worker, ClusterCoordinator, ParameterServerOptions, ParameterServerStrategy, Partitioner, PsModel,
    PsWorkerModel, StepRegistry, WorkerContext, WorkerOptions,
};
use strata_transport::executor::WorkerExecutorHandle;
use strata_transport::ps::{PsMode, PsServerConfig, PsServerHandle, PsStatus, ServerOptimizer};
use strata_transport::ClusterToken;

const TOKEN: &str = "0123456789abcdef0123";

/// The hard limit of every test body.
const TEST_LIMIT: Duration = Duration::from_secs(180);

/// How long a gate waits at most before it lets the backward pass go on (a gate whose
/// condition never holds ends its wait here, and the test fails on what it recorded).
const GATE_LIMIT: Duration = Duration::from_secs(30);

fn token() -> ClusterToken {
    ClusterToken::new(TOKEN).unwrap()
}

// ---------------------------------------------------------------------------------------------
// A gate in the backward pass.
// ---------------------------------------------------------------------------------------------

/// What a test watches: push chunks ps task 0 received, steps whose push was applied, and
/// what each gate saw.
#[derive(Clone, Default)]
struct Probes {
    chunks: Arc<AtomicU64>,
    done: Arc<AtomicU64>,
    /// Gates of kind [`GateKind::Barrier`] reached.
    arrived: Arc<AtomicU64>,
    /// Gates of kind [`GateKind::AfterSteps`] reached.
    reached: Arc<AtomicU64>,
    /// Per registered function: its worker model's overlapped pushes (committed, given up),
    /// after its last step (summed over the workers of the job).
    overlapped: Arc<Mutex<std::collections::BTreeMap<String, (u64, u64)>>>,
    /// Per gate that waited: the push chunks ps task 0 received between the step's forward
    /// pass and the gate's opening (`None`: its condition did not hold within its limit).
    seen: Arc<Mutex<Vec<Option<u64>>>>,
}

impl Probes {
    /// Adds a step's change of a worker model's overlapped pushes to `function`'s.
    fn record(&self, function: &str, before: (u64, u64), after: (u64, u64)) {
        let mut all = self.overlapped.lock().unwrap();
        let e = all.entry(function.to_string()).or_default();
        e.0 += after.0 - before.0;
        e.1 += after.1 - before.1;
    }

    /// `function`'s overlapped pushes: (committed, given up).
    fn overlapped(&self, function: &str) -> (u64, u64) {
        self.overlapped.lock().unwrap().get(function).copied().unwrap_or_default()
    }
}

/// When a gated step's backward pass goes on past the gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
enum GateKind {
    /// At once.
    Open,
    /// Once ps task 0 received a chunk of a push after this step's forward pass, or after
    /// `limit_ms`.
    Chunks { limit_ms: u64 },
    /// Once `steps` steps had their push applied (the ps tasks moved past this step's pull);
    /// counts the gate as reached first.
    AfterSteps { steps: u64 },
    /// Once `count` gates of kind [`GateKind::AfterSteps`] were reached (their steps pulled).
    AfterReached { count: u64 },
    /// Once `parties` gates of this kind were reached (steps running at once, on different
    /// workers).
    Barrier { parties: u64 },
}

/// The identity, whose gradient waits for its condition: everything after it in the forward
/// pass (the last layer) has its gradient final while the pass waits here, and everything
/// before it (the first layer) gets its gradient only once the gate opens.
struct Gate {
    kind: GateKind,
    probes: Probes,
    base: u64,
}

impl candle_core::CustomOp1 for Gate {
    fn name(&self) -> &'static str {
        "test-gate"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        match (storage, layout.contiguous_offsets()) {
            (CpuStorage::F32(v), Some((lo, hi))) => Ok((CpuStorage::F32(v[lo..hi].to_vec()), layout.shape().clone())),
            _ => candle_core::bail!("the gate takes a contiguous f32 CPU tensor"),
        }
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let (holds, limit): (Box<dyn Fn() -> bool>, Duration) = match self.kind {
            GateKind::Open => return Ok(Some(grad.clone())),
            GateKind::Chunks { limit_ms } => {
                let (chunks, base) = (self.probes.chunks.clone(), self.base);
                (Box::new(move || chunks.load(Ordering::SeqCst) > base), Duration::from_millis(limit_ms))
            }
            GateKind::AfterSteps { steps } => {
                self.probes.reached.fetch_add(1, Ordering::SeqCst);
                let done = self.probes.done.clone();
                (Box::new(move || done.load(Ordering::SeqCst) >= steps), GATE_LIMIT)
            }
            GateKind::AfterReached { count } => {
                let reached = self.probes.reached.clone();
                (Box::new(move || reached.load(Ordering::SeqCst) >= count), GATE_LIMIT)
            }
            GateKind::Barrier { parties } => {
                let arrived = self.probes.arrived.clone();
                arrived.fetch_add(1, Ordering::SeqCst);
                (Box::new(move || arrived.load(Ordering::SeqCst) >= parties), GATE_LIMIT)
            }
        };
        let start = Instant::now();
        let held = loop {
            if holds() {
                break true;
            }
            if start.elapsed() >= limit {
                break false;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let received = self.probes.chunks.load(Ordering::SeqCst) - self.base;
        self.probes.seen.lock().unwrap().push(held.then_some(received));
        Ok(Some(grad.clone()))
    }
}

/// `last(gate(tanh(first(x))))`, and `side` added to the logits in odd phases (a variable
/// with a gradient in some steps only).
struct Gated {
    first: Linear,
    last: Linear,
    side: Linear,
}

impl Gated {
    fn build(sc: &Scope) -> candle_core::Result<Self> {
        let vb = sc.var_builder();
        Ok(Self {
            first: candle_nn::linear(6, 8, vb.pp("first"))?,
            last: candle_nn::linear(8, 3, vb.pp("last"))?,
            side: candle_nn::linear(8, 3, vb.pp("side"))?,
        })
    }

    fn loss(&self, s: &GatedStep, probes: &Probes, dev: &Device) -> candle_core::Result<Tensor> {
        let b = data(s.examples, 6, s.seed);
        let x = Tensor::from_slice(&b.features, (b.len(), 6), dev)?;
        let y = Tensor::from_slice(&b.labels, b.len(), dev)?;
        let h = self.first.forward(&x)?.tanh()?.contiguous()?;
        let base = probes.chunks.load(Ordering::SeqCst);
        let h = h.apply_op1(Gate { kind: s.gate, probes: probes.clone(), base })?;
        let mut logits = self.last.forward(&h)?;
        if s.phase % 2 == 1 {
            logits = (logits + self.side.forward(&h)?)?;
        }
        candle_nn::loss::cross_entropy(&logits, &y)
    }
}

/// One step of [`Gated`].
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
struct GatedStep {
    phase: usize,
    seed: u64,
    examples: usize,
    gate: GateKind,
}

impl GatedStep {
    fn open(k: usize) -> Self {
        Self { phase: 0, seed: 900 + k as u64, examples: 10, gate: GateKind::Open }
    }
}

// ---------------------------------------------------------------------------------------------
// The workers' steps.
// ---------------------------------------------------------------------------------------------

/// One step of a common test model.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
struct ModelStep {
    phase: usize,
    seed: u64,
    examples: usize,
}

fn worker_options(overlap: bool) -> StrategyOptions {
    StrategyOptions { overlap, ..Default::default() }
}

/// Registers `<name>:on` and `<name>:off`: a step of `M` (`freeze` frozen) pushing with
/// [`PsWorkerModel::backward_and_push`], overlap on or off; buckets of one variable each
/// (`bucket_bytes` 0), so that several buckets start while the pass runs.
fn register_model<M: TestModel + 'static>(r: &mut StepRegistry, probes: &Probes, name: &str, freeze: &[&str]) {
    for overlap in [true, false] {
        let mut worker = PsWorkerModel::new(1, worker_options(overlap), M::build).unwrap();
        if !freeze.is_empty() {
            worker.freeze(freeze).unwrap();
        }
        worker.set_push_bucket_bytes(0);
        assert_eq!(worker.overlaps(), overlap);
        let key = format!("{name}:{}", if overlap { "on" } else { "off" });
        let (probes, function) = (probes.clone(), key.clone());
        r.register(key, move |ctx: &WorkerContext, s: ModelStep| -> strata_core::Result<bool> {
            let batch = data(s.examples, M::DIM, s.seed);
            let before = worker.overlapped_pushes();
            let out = worker.run_batch(ctx, &batch, |rctx, shard| {
                let loss = worker.model().on(rctx)?.loss(s.phase, &shard.batch, rctx.candle_device())?;
                worker.backward_and_push(rctx, &loss)
            });
            probes.record(&function, before, worker.overlapped_pushes());
            let out = out?;
            Ok(out.push.is_some_and(|p| p.applied() || p.dropped()))
        });
    }
}

/// Registers `gated:on`, `gated:off`, `gated:clip` (overlap on, clipping to a global norm of
/// 0.5, which needs every gradient before the push) and `gated:clipoff` (clipping, overlap
/// off).
fn register_gated(r: &mut StepRegistry, probes: &Probes) {
    for key in ["gated:on", "gated:off", "gated:clip", "gated:clipoff"] {
        let overlap = key == "gated:on" || key == "gated:clip";
        let mut worker = PsWorkerModel::new(1, worker_options(overlap), Gated::build).unwrap();
        worker.set_push_bucket_bytes(0);
        if key.starts_with("gated:clip") {
            worker.clip_global_norm(0.5).unwrap();
        }
        assert_eq!(worker.overlaps(), key == "gated:on");
        let probes = probes.clone();
        let function = key.to_string();
        r.register(key, move |ctx: &WorkerContext, s: GatedStep| -> strata_core::Result<bool> {
            let before = worker.overlapped_pushes();
            let out = worker.run_batch(ctx, &data(s.examples, 6, s.seed), |rctx, _shard| {
                let loss = worker.model().on(rctx)?.loss(&s, &probes, rctx.candle_device())?;
                worker.backward_and_push(rctx, &loss)
            });
            // Recorded for refused (stale) attempts too.
            probes.record(&function, before, worker.overlapped_pushes());
            let out = out?;
            let applied = out.push.is_some_and(|p| p.applied() || p.dropped());
            if applied {
                probes.done.fetch_add(1, Ordering::SeqCst);
            }
            Ok(applied)
        });
    }
}

fn registry(probes: &Probes) -> StepRegistry {
    let mut r = StepRegistry::new();
    register_model::<Heads>(&mut r, probes, "heads", &[]);
    register_model::<Frozen>(&mut r, probes, "frozen", &["late.*"]);
    register_model::<BnNet<false>>(&mut r, probes, "bn", &[]);
    register_gated(&mut r, probes);
    r
}

// ---------------------------------------------------------------------------------------------
// A job in this process.
// ---------------------------------------------------------------------------------------------

struct Job {
    ps: Vec<PsServerHandle>,
    workers: Vec<WorkerExecutorHandle>,
    spec: ClusterSpec,
    probes: Probes,
}

impl Job {
    fn start(num_ps: usize, num_workers: usize) -> Self {
        let probes = Probes::default();
        let mut ps = Vec::new();
        for i in 0..num_ps {
            let mut config = PsServerConfig::new(format!("ps:{i}"), token());
            config.round_timeout = Duration::from_secs(60);
            if i == 0 {
                config.push_chunks = Some(probes.chunks.clone());
            }
            ps.push(PsServerHandle::start("127.0.0.1:0".parse().unwrap(), config).unwrap());
        }
        let ps_addresses: Vec<String> = ps.iter().map(|p| p.address().to_string()).collect();
        let mut workers = Vec::new();
        for i in 0..num_workers {
            let options = WorkerOptions::new(i, ps_addresses.clone(), token());
            workers.push(serve_worker("127.0.0.1:0".parse().unwrap(), registry(&probes), options).unwrap());
        }
        let worker_addresses: Vec<String> = workers.iter().map(|w| w.address().to_string()).collect();
        let spec = ClusterSpec::new([(TaskType::Ps, ps_addresses), (TaskType::Worker, worker_addresses)]).unwrap();
        Self { ps, workers, spec, probes }
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

fn adamw(mode: PsMode) -> ParameterServerOptions {
    let mut o = ParameterServerOptions::new(token());
    o.optimizer = ServerOptimizer::AdamW { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-7, weight_decay: 0.1 };
    o.mode = mode;
    o.seed = 7;
    o
}

fn status(strategy: &ParameterServerStrategy, ps: usize) -> PsStatus {
    strategy.ps_clients()[ps].status().unwrap()
}

/// Every variable's bits, by name.
type Bits = Vec<(String, Vec<u32>)>;

/// Every variable's bits after pulling them from the ps tasks, by name.
fn pulled_bits<M>(model: &PsModel<M>) -> Bits {
    model.pull().unwrap();
    model
        .variables()
        .iter()
        .map(|(n, v)| {
            let values = v.as_tensor().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            (n.clone(), values.iter().map(|x| x.to_bits()).collect())
        })
        .collect()
}

/// Schedules `steps` of `function`, one at a time when `sequential`; every step must report
/// its push applied.
fn run<A: serde::Serialize>(coordinator: &ClusterCoordinator, function: &str, steps: &[A], sequential: bool) {
    let mut pending = Vec::new();
    for s in steps {
        let v = coordinator.schedule::<A, bool>(function, s);
        if sequential {
            assert!(v.fetch().unwrap(), "{function}: step {} was not applied", v.step());
        } else {
            pending.push(v);
        }
    }
    coordinator.join().unwrap();
    for v in pending {
        assert!(v.fetch().unwrap(), "{function}: step {} was not applied", v.step());
    }
}

/// The ps tasks' bits and statuses after `steps` of `function` on a fresh job of `num_ps` ps
/// tasks and `num_workers` workers, and the function's overlapped pushes (committed, given up).
fn train<M, A: serde::Serialize>(
    build: impl FnMut(&Scope) -> candle_core::Result<M>,
    options: ParameterServerOptions,
    num_ps: usize,
    num_workers: usize,
    function: &str,
    steps: &[A],
    sequential: bool,
) -> (Bits, Vec<PsStatus>, (u64, u64)) {
    let job = Job::start(num_ps, num_workers);
    let strategy = job.strategy(options);
    let model = strategy.scope(build).unwrap();
    let coordinator = strategy.coordinator().unwrap();
    run(&coordinator, function, steps, sequential);
    let bits = pulled_bits(&model);
    let statuses = (0..num_ps).map(|ps| status(&strategy, ps)).collect();
    let overlapped = job.probes.overlapped(function);
    drop(coordinator);
    drop(model);
    drop(strategy);
    job.shutdown();
    (bits, statuses, overlapped)
}

fn model_steps(n: usize, examples: usize, seed: u64) -> Vec<ModelStep> {
    (0..n).map(|k| ModelStep { phase: k / 3, seed: seed + k as u64, examples }).collect()
}

// ---------------------------------------------------------------------------------------------
// The tests.
// ---------------------------------------------------------------------------------------------

/// Async, one worker (so the order of updates is fixed), two ps tasks with every variable
/// split over both: models with heads unused in some steps (their early push is given up when
/// the variables with a gradient change), frozen layers, and BatchNorm state (its change
/// joins the push at its end) end on the same bits with overlap on and off, in f32 and bf16
/// on the wire, with exactly one update per step on every ps task.
#[test]
fn async_overlap_on_and_off_end_on_the_same_bits() {
    with_timeout(TEST_LIMIT, "async_overlap_on_and_off_end_on_the_same_bits", || {
        const STEPS: usize = 8;
        for (name, compression) in [
            ("heads", Compression::None),
            ("frozen", Compression::None),
            ("bn", Compression::None),
            ("heads", Compression::Bf16),
        ] {
            let mut results = Vec::new();
            for overlap in ["on", "off"] {
                let mut options = adamw(PsMode::Async);
                options.partitioner = Partitioner::FixedShards(2);
                options.compression = compression;
                let function = format!("{name}:{overlap}");
                let (bits, statuses, (committed, given_up)) = match name {
                    "heads" => train(Heads::build, options, 2, 1, &function, &model_steps(STEPS, 15, 300), true),
                    "frozen" => train(Frozen::build, options, 2, 1, &function, &model_steps(STEPS, 15, 300), true),
                    _ => train(BnNet::<false>::build, options, 2, 1, &function, &model_steps(STEPS, 15, 300), true),
                };
                for st in &statuses {
                    assert_eq!(st.version, STEPS as u64, "{function}: one update per step: {st:?}");
                    assert_eq!(st.pushes_applied, STEPS as u64, "{function}: {st:?}");
                }
                eprintln!("{function} ({compression:?}): {committed} overlapped pushes committed, {given_up} given up");
                match (overlap, name) {
                    ("off", _) => assert_eq!((committed, given_up), (0, 0), "{function}"),
                    // The first step learns the order; the heads change with the phase.
                    ("on", "heads") => {
                        assert_eq!(committed + given_up, STEPS as u64 - 1, "{function}");
                        assert!(committed >= 1 && given_up >= 1, "{function}: {committed} {given_up}");
                    }
                    _ => assert_eq!((committed, given_up), (STEPS as u64 - 1, 0), "{function}"),
                }
                results.push(bits);
            }
            assert_eq!(results[0], results[1], "{name} ({compression:?}): overlap on and off differ");
        }
    });
}

/// Sync, two workers: rounds of one push per worker average to the same bits with overlap on
/// and off, with exactly one round per two steps.
#[test]
fn sync_two_workers_overlap_on_and_off_end_on_the_same_bits() {
    with_timeout(TEST_LIMIT, "sync_two_workers_overlap_on_and_off_end_on_the_same_bits", || {
        const STEPS: usize = 8;
        let mode = PsMode::Sync { workers: 2, backup_workers: 0 };
        for name in ["heads", "frozen"] {
            let mut results = Vec::new();
            for overlap in ["on", "off"] {
                let function = format!("{name}:{overlap}");
                // Round r is steps 2r and 2r + 1, in the same phase.
                let steps: Vec<ModelStep> =
                    (0..STEPS).map(|k| ModelStep { phase: k / 2, seed: 500 + k as u64, examples: 12 }).collect();
                let (bits, statuses, (committed, given_up)) = match name {
                    "heads" => train(Heads::build, adamw(mode), 1, 2, &function, &steps, false),
                    _ => train(Frozen::build, adamw(mode), 1, 2, &function, &steps, false),
                };
                eprintln!("{function}: {committed} overlapped pushes committed, {given_up} given up");
                match (overlap, name) {
                    ("off", _) => assert_eq!((committed, given_up), (0, 0), "{function}"),
                    // Each worker's steps alternate heads (a round per phase), so every early
                    // push is given up and pushed after the pass.
                    ("on", "heads") => assert_eq!(committed + given_up, STEPS as u64 - 2, "{function}"),
                    // Each worker's first step learns the order.
                    _ => assert_eq!((committed, given_up), (STEPS as u64 - 2, 0), "{function}"),
                }
                assert_eq!(statuses[0].rounds, STEPS as u64 / 2, "{function}: {:?}", statuses[0]);
                assert_eq!(statuses[0].version, STEPS as u64 / 2, "{function}: {:?}", statuses[0]);
                results.push(bits);
            }
            assert_eq!(results[0], results[1], "{name}: sync overlap on and off differ");
        }
    });
}

/// The event order: in a step after the first (which learns the order gradients become final
/// in), the ps task receives chunks of the push while the worker's backward pass is held at a
/// gate before its first layer's gradients, which are not computed yet. With overlap off, and
/// with clipping (which falls back to pushing after the pass), nothing arrives while the pass
/// is held. The results of the three are the same as after the pass.
#[test]
fn push_arrives_while_the_backward_pass_is_held() {
    with_timeout(TEST_LIMIT, "push_arrives_while_the_backward_pass_is_held", || {
        let job = Job::start(1, 1);
        let strategy = job.strategy(adamw(PsMode::Async));
        let model = strategy.scope(Gated::build).unwrap();
        let coordinator = strategy.coordinator().unwrap();
        let probes = job.probes.clone();
        // First step: learns the order; the gate is open.
        run(&coordinator, "gated:on", &[GatedStep::open(0)], true);
        let held =
            GatedStep { gate: GateKind::Chunks { limit_ms: GATE_LIMIT.as_millis() as u64 }, ..GatedStep::open(1) };
        run(&coordinator, "gated:on", &[held], true);
        let seen = std::mem::take(&mut *probes.seen.lock().unwrap());
        assert_eq!(seen.len(), 1, "{seen:?}");
        assert!(
            seen[0].is_some_and(|n| n > 0),
            "the ps task received no push chunk while the backward pass was held: {seen:?}"
        );
        // Overlap off, and clipping: the push waits for the pass (a short wait shows it).
        for function in ["gated:off", "gated:clip"] {
            run(&coordinator, function, &[GatedStep::open(2)], true);
            let quick = GatedStep { gate: GateKind::Chunks { limit_ms: 300 }, ..GatedStep::open(3) };
            run(&coordinator, function, &[quick], true);
            let seen = std::mem::take(&mut *probes.seen.lock().unwrap());
            assert_eq!(seen, vec![None], "{function}: a push arrived before the backward pass ended");
        }
        assert_eq!(status(&strategy, 0).version, 6);
        drop(coordinator);
        drop(model);
        drop(strategy);
        job.shutdown();
    });
}

/// Clipping needs every gradient before the push, so a worker that clips pushes after the pass
/// even with overlap on: its results are those of clipping with overlap off, bit for bit (and
/// overlap on and off without clipping agree too, over steps where `side` has a gradient in
/// some steps only).
#[test]
fn clipping_falls_back_to_the_same_bits() {
    with_timeout(TEST_LIMIT, "clipping_falls_back_to_the_same_bits", || {
        const STEPS: usize = 6;
        let steps: Vec<GatedStep> = (0..STEPS).map(|k| GatedStep { phase: k / 2, ..GatedStep::open(k) }).collect();
        let mut results = Vec::new();
        for function in ["gated:on", "gated:off", "gated:clip"] {
            let (bits, statuses, (committed, _)) =
                train(Gated::build, adamw(PsMode::Async), 1, 1, function, &steps, true);
            assert_eq!(statuses[0].version, STEPS as u64, "{function}");
            assert_eq!(committed > 0, function == "gated:on", "{function}: {committed} overlapped pushes");
            results.push(bits);
        }
        assert_eq!(results[0], results[1], "overlap on and off differ");
        assert_ne!(results[0], results[2], "clipping at 0.5 must change the update");
        // Clipping with overlap on (which falls back) against clipping with overlap off.
        let (clip_off, _, _) = train(Gated::build, adamw(PsMode::Async), 1, 1, "gated:clipoff", &steps, true);
        assert_eq!(results[2], clip_off, "clipping with overlap on and off differ");
    });
}

/// Stale mode (bound 0) with overlap, two workers: step A's backward pass is held until step
/// B's push was applied (B's pass waiting until A pulled), so A's overlapped push (part of it already sent) is refused as stale;
/// A pulls again, recomputes and pushes once more. Every step is applied exactly once, and
/// the result is bit for bit that of B then A on one worker without overlap.
#[test]
fn stale_overlapped_push_is_rerun_and_applied_once() {
    with_timeout(TEST_LIMIT, "stale_overlapped_push_is_rerun_and_applied_once", || {
        let mode = PsMode::Stale { staleness: 0 };
        // Two identical steps held at a barrier, so that each worker runs one (and learns its
        // order); one of them is refused as stale and re-run, and the two apply in turn.
        let learn = GatedStep { gate: GateKind::Barrier { parties: 2 }, ..GatedStep::open(0) };
        let a = GatedStep { gate: GateKind::AfterSteps { steps: 3 }, ..GatedStep::open(1) };
        // B's pass waits until A has pulled (and reached its gate), so B's push is applied
        // after A's pull: A's push is necessarily stale.
        let b = GatedStep { gate: GateKind::AfterReached { count: 1 }, ..GatedStep::open(2) };
        let job = Job::start(1, 2);
        let strategy = job.strategy(adamw(mode));
        let model = strategy.scope(Gated::build).unwrap();
        let coordinator = strategy.coordinator().unwrap();
        run(&coordinator, "gated:on", &[learn, learn], false);
        assert_eq!(job.probes.done.load(Ordering::SeqCst), 2);
        // A waits in its backward pass (its last layer's push on its way) until B was applied.
        run(&coordinator, "gated:on", &[a, b], false);
        let st = status(&strategy, 0);
        let seen = job.probes.seen.lock().unwrap().clone();
        let got = pulled_bits(&model);
        let job_overlapped = job.probes.overlapped("gated:on");
        drop(coordinator);
        drop(model);
        drop(strategy);
        job.shutdown();
        assert!(seen.iter().all(Option::is_some), "a gate did not open: {seen:?}");
        assert!(st.pushes_stale >= 2, "a learning step's and A's push should have been refused as stale: {st:?}");
        assert_eq!(st.pushes_applied, 4, "{st:?}");
        assert_eq!(st.version, 4, "{st:?}");
        assert_eq!(st.applied_by_worker.values().sum::<u64>(), 4, "{st:?}");
        assert_eq!(st.applied_by_worker.len(), 2, "both workers applied steps: {st:?}");
        // Overlapped: the refused learning step's re-run, A's first push (refused) and its
        // re-run, and B (each worker's first run learned the order).
        assert_eq!(job_overlapped, (4, 0), "overlapped pushes (committed, given up)");
        // The reference: the same steps one at a time without overlap, B before A.
        let open = |s: GatedStep| GatedStep { gate: GateKind::Open, ..s };
        let (want, _, _) =
            train(Gated::build, adamw(mode), 1, 1, "gated:off", &[open(learn), open(learn), open(b), open(a)], true);
        assert_eq!(got, want, "the stale re-run differs from B then A");
    });
}
