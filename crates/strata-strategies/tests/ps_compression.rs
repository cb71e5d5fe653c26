//! `ParameterServerStrategy` with compressed pushes and pulls
//! ([`ParameterServerOptions::compression`]), end to end in one process over real gRPC on
//! loopback: the coordinator records the job's wire format on the ps tasks, the workers read it
//! there, push bf16 gradients and pull bf16 values; the ps tasks keep f32 and apply in f32, so a
//! deterministic (sync, one worker) run lands within bf16 rounding of the f32 run.

use std::panic::AssertUnwindSafe;
use std::sync::mpsc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Init, VarBuilder};
use strata_core::cross_device::compression::{Compression, HalfFormat};
use strata_strategies::cluster::{ClusterSpec, TaskType};
use strata_strategies::parameter_server::{
    serve_worker, ParameterServerOptions, ParameterServerStrategy, StepRegistry, WorkerContext, WorkerOptions,
};
use strata_transport::executor::WorkerExecutorHandle;
use strata_transport::ps::{PsMode, PsServerConfig, PsServerHandle, ServerOptimizer, WireFormat};
use strata_transport::ClusterToken;

const TOKEN: &str = "0123456789abcdef0123";

fn token() -> ClusterToken {
    ClusterToken::new(TOKEN).unwrap()
}

fn with_timeout(what: &str, body: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name(what.to_string())
        .spawn(move || {
            let _ = tx.send(std::panic::catch_unwind(AssertUnwindSafe(body)));
        })
        .unwrap();
    match rx.recv_timeout(Duration::from_secs(120)) {
        Ok(Ok(())) => {}
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => panic!("{what} did not finish within 120 s"),
    }
}

/// 8 examples of 3 features, `y = x . [1, -2, 0.5] + 0.25`.
fn data() -> candle_core::Result<(Tensor, Tensor)> {
    let mut x = Vec::with_capacity(24);
    let mut y = Vec::with_capacity(8);
    for i in 0..8 {
        let row: Vec<f32> = (0..3).map(|j| ((i * 3 + j) % 7) as f32 / 4.0 - 0.5).collect();
        y.push(row[0] - 2.0 * row[1] + 0.5 * row[2] + 0.25);
        x.extend(row);
    }
    Ok((Tensor::from_vec(x, (8, 3), &Device::Cpu)?, Tensor::from_vec(y, (8, 1), &Device::Cpu)?))
}

fn build(vb: VarBuilder) -> candle_core::Result<(Tensor, Tensor)> {
    Ok((vb.get_with_hints((3, 1), "w", Init::Const(0.3))?, vb.get_with_hints(1, "b", Init::Const(-0.1))?))
}

/// The worker's variables, pulled (in the job's wire format).
fn pull(ctx: &WorkerContext) -> strata_core::Result<(Var, Var, strata_strategies::parameter_server::PullTicket)> {
    let w = Var::zeros((3, 1), DType::F32, &Device::Cpu)?;
    let b = Var::zeros(1, DType::F32, &Device::Cpu)?;
    let vars = vec![("w".to_string(), w.clone()), ("b".to_string(), b.clone())];
    let ticket = ctx.pull(&vars)?;
    Ok((w, b, ticket))
}

/// One step of linear regression: pull, the mean squared error's gradients, push; the loss.
fn linreg(ctx: &WorkerContext) -> strata_core::Result<f32> {
    let (w, b, ticket) = pull(ctx)?;
    let (x, y) = data()?;
    let loss = (x.matmul(w.as_tensor())?.broadcast_add(b.as_tensor())? - y)?.sqr()?.mean_all()?;
    let grads = loss.backward()?;
    let flat = |v: &Var| -> candle_core::Result<Vec<f32>> {
        grads.get(v.as_tensor()).map_or(Ok(vec![0.0; v.elem_count()]), |g| g.flatten_all()?.to_vec1::<f32>())
    };
    let push = ctx.push(&ticket, &[("w".to_string(), flat(&w)?), ("b".to_string(), flat(&b)?)])?;
    assert!(push.applied());
    Ok(loss.to_scalar::<f32>()?)
}

/// What a worker pulls, and the wire format it pulled in.
fn peek(ctx: &WorkerContext) -> strata_core::Result<(Vec<f32>, String)> {
    let (w, b, _) = pull(ctx)?;
    let mut values = w.as_tensor().flatten_all()?.to_vec1::<f32>()?;
    values.extend(b.as_tensor().to_vec1::<f32>()?);
    Ok((values, ctx.wire_format(0).to_string()))
}

struct Job {
    ps: PsServerHandle,
    worker: WorkerExecutorHandle,
    spec: ClusterSpec,
}

impl Job {
    fn start() -> Self {
        let ps = PsServerHandle::start("127.0.0.1:0".parse().unwrap(), PsServerConfig::new("ps:0", token())).unwrap();
        let mut registry = StepRegistry::new();
        registry.register("linreg", |ctx: &WorkerContext, (): ()| linreg(ctx));
        registry.register("peek", |ctx: &WorkerContext, (): ()| peek(ctx));
        let options = WorkerOptions::new(0, vec![ps.address().to_string()], token());
        let worker = serve_worker("127.0.0.1:0".parse().unwrap(), registry, options).unwrap();
        let spec = ClusterSpec::new([
            (TaskType::Ps, vec![ps.address().to_string()]),
            (TaskType::Worker, vec![worker.address().to_string()]),
        ])
        .unwrap();
        Self { ps, worker, spec }
    }

    fn shutdown(self) {
        self.worker.shutdown();
        self.ps.shutdown();
    }
}

fn options(compression: Compression) -> ParameterServerOptions {
    let mut o = ParameterServerOptions::new(token());
    o.optimizer = ServerOptimizer::Sgd { lr: 0.1 };
    o.mode = PsMode::Sync { workers: 1, backup_workers: 0 };
    o.seed = 7;
    o.compression = compression;
    o
}

/// Trains `steps` steps; the losses, the ps task's f32 values, and what the worker pulls then.
fn train(compression: Compression, steps: usize) -> (Vec<f32>, Vec<f32>, (Vec<f32>, String), WireFormat) {
    let job = Job::start();
    let strategy = ParameterServerStrategy::new(job.spec.clone(), options(compression)).unwrap();
    let model = strategy.scope(|s| build(s.var_builder())).unwrap();
    let coordinator = strategy.coordinator().unwrap();
    let mut losses = Vec::new();
    for _ in 0..steps {
        // One at a time: every step pulls what the previous one applied.
        losses.push(coordinator.schedule::<(), f32>("linreg", &()).fetch().unwrap());
    }
    coordinator.join().unwrap();
    let peeked = coordinator.schedule::<(), (Vec<f32>, String)>("peek", &()).fetch().unwrap();
    model.pull().unwrap();
    let mut values = Vec::new();
    for (_, v) in model.variables() {
        values.extend(v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap());
    }
    let status = strategy.ps_clients()[0].status().unwrap();
    assert_eq!(status.version, steps as u64);
    drop(coordinator);
    job.shutdown();
    (losses, values, peeked, status.wire_format)
}

#[test]
fn bf16_training_lands_within_bf16_rounding_of_f32_and_workers_pull_the_rounded_values() {
    with_timeout("bf16 training", || {
        let steps = 12;
        let (exact_losses, exact, (exact_peek, exact_format), exact_job) = train(Compression::None, steps);
        let (losses, values, (peeked, format), job) = train(Compression::Bf16, steps);
        assert_eq!((exact_job, exact_format.as_str()), (WireFormat::F32, "f32"));
        assert_eq!((job, format.as_str()), (WireFormat::Bf16, "bf16"), "the workers read the job's format");
        assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
        assert!(losses[steps - 1] < losses[0] * 0.8, "training made progress: {losses:?}");
        for (i, (l, e)) in losses.iter().zip(&exact_losses).enumerate() {
            assert!((l - e).abs() <= 1e-2 * e.abs(), "step {i}: loss {l} with bf16, {e} with f32");
        }
        assert_ne!(values, exact, "bf16 rounding changed the run");
        for (i, (v, e)) in values.iter().zip(&exact).enumerate() {
            assert!((v - e).abs() <= 1e-2 * e.abs().max(0.1), "element {i}: {v} with bf16, {e} with f32");
        }
        // A worker's pull is the ps task's f32 values rounded to bf16; with f32 it is exact.
        assert_eq!(exact_peek, exact);
        let mut bits = vec![0u16; values.len()];
        HalfFormat::Bf16.encode(&values, &mut bits);
        let mut rounded = vec![0f32; values.len()];
        HalfFormat::Bf16.decode(&bits, &mut rounded);
        assert_eq!(peeked, rounded);
    });
}

#[test]
fn powersgd_is_refused_for_the_parameter_server() {
    let spec = ClusterSpec::new([
        (TaskType::Ps, vec!["127.0.0.1:1".to_string()]),
        (TaskType::Worker, vec!["127.0.0.1:2".to_string()]),
    ])
    .unwrap();
    let e = ParameterServerStrategy::new(spec.clone(), options(Compression::PowerSgd { rank: 4, start_step: 0 }))
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        strata_core::Error::InvalidArgument(
            "compression powersgd:4 applies to multi-worker-mirrored's ring, not to a parameter server's pushes and pulls; use none, fp16 or bf16 with the parameter server".into()
        )
        .to_string()
    );
    for c in [Compression::None, Compression::Fp16, Compression::Bf16] {
        let s = ParameterServerStrategy::new(spec.clone(), options(c)).unwrap();
        assert_eq!(s.options().compression, c);
    }
}
