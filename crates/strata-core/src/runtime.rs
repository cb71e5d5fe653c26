//! Running a step on in-process replicas: one thread per replica.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, PoisonError};

use candle_core::Tensor;

use crate::cross_device::{CpuCrossDeviceOps, CrossDeviceOps};
pub use crate::device::candle_device;
use crate::device::{LogicalDevice, LogicalKind};
use crate::extended::{
    ReplicaContext, ReplicaJob, StepShared, StrategyExtended, StrategyId, StrategyOptions, VariablePolicy,
};
use crate::{Error, PerReplica, ReduceOp, Result};

/// The threads of a strategy's replicas: one persistent thread per replica (so a replica's
/// thread-local allocator caches and warm stacks survive from step to step) and, for every
/// logical CPU device of `t` threads, a pool of its own of `t` threads in which that replica's
/// job and its parallel candle kernels run.
///
/// A replica's kernels never run on another replica's threads. Were they to share a work-stealing
/// pool, a thread that stole a piece of replica 1's convolution before its own replica's job
/// reached it could start that job inside the stolen piece while waiting for it to finish: its
/// replica would then block in a collective for replica 1, which waits for the piece, and the
/// step would end in a collective timeout (rayon runs a waiting thread's pending broadcast job).
#[derive(Debug, Default)]
pub struct ReplicaPools {
    replicas: Option<rayon::ThreadPool>,
    pools: Vec<Option<rayon::ThreadPool>>,
}

impl ReplicaPools {
    /// Pools for `devices`: a logical CPU device of `t` threads gets a pool of `t` threads, in
    /// which its replica's job and candle's parallel kernels run.
    pub fn for_devices(devices: &[LogicalDevice]) -> Result<Self> {
        // Before any thread starts.
        crate::device::check_replicas(devices.len(), "replicas")?;
        let pools = devices
            .iter()
            .enumerate()
            .map(|(r, d)| match d.kind {
                LogicalKind::Cpu { threads, .. } => rayon::ThreadPoolBuilder::new()
                    .num_threads(threads.max(1))
                    .thread_name(move |i| format!("strata-replica-{r}-kernels-{i}"))
                    .build()
                    .map(Some)
                    .map_err(|e| Error::InvalidArgument(format!("cannot start {threads} threads for {}: {e}", d.spec))),
                _ => Ok(None),
            })
            .collect::<Result<_>>()?;
        let replicas = if devices.len() > 1 {
            Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(devices.len() - 1)
                    .thread_name(|r| format!("strata-replica-{}", r + 1))
                    .build()
                    .map_err(|e| {
                        Error::InvalidArgument(format!("cannot start {} replica threads: {e}", devices.len()))
                    })?,
            )
        } else {
            None
        };
        Ok(Self { replicas, pools })
    }

    fn run<R: Send>(&self, replica: usize, f: impl FnOnce() -> R + Send) -> R {
        match self.pools.get(replica).and_then(Option::as_ref) {
            Some(p) => p.install(f),
            None => f(),
        }
    }
}

struct LeaveOnDrop<'a>(&'a StepShared<'a>, usize);

impl Drop for LeaveOnDrop<'_> {
    fn drop(&mut self) {
        self.0.group().leave(self.1);
    }
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// Whether an error is a consequence of another replica's failure rather than a cause.
fn is_secondary(e: &Error) -> bool {
    matches!(e, Error::ReplicaLeft { .. }) || matches!(e, Error::Scope(m) if m.starts_with("the step was abandoned"))
}

/// Runs `job` on every replica of `ext`, one thread per replica (the calling thread is
/// replica 0). A failing or panicking replica releases its peers; the first root-cause error
/// is returned, naming the replica.
pub fn execute_local(
    ext: &dyn StrategyExtended,
    pools: &ReplicaPools,
    weights: &[f32],
    job: &ReplicaJob<'_>,
) -> Result<()> {
    let n = ext.num_replicas();
    let shared = StepShared::new(ext, weights)?;
    let _step = tracing::trace_span!("step", strategy = ext.name(), replicas = n).entered();
    let run_one = |r: usize| -> Result<()> {
        let _leave = LeaveOnDrop(&shared, r);
        let ctx = ReplicaContext::new(&shared, r);
        let res = pools.run(r, || {
            // Layers find their replica's collectives through the thread's current handle.
            let _current = ctx.handle().enter();
            catch_unwind(AssertUnwindSafe(|| job(&ctx)))
        });
        let res = match res {
            Ok(r) => r,
            Err(p) => Err(Error::ReplicaPanicked { replica: r, message: panic_message(p) }),
        };
        // The rows of embedding tables this replica's step touched go back to their store.
        let res = match &ext.options().tables {
            Some(tables) => {
                let ended = tables.end_step(r, res.is_err());
                res.and(ended)
            }
            None => res,
        };
        if let Err(e) = &res {
            if !is_secondary(e) {
                shared.group().poison(format!("replica {r} failed: {e}"));
            }
        }
        res
    };
    if n == 1 {
        return run_one(0);
    }
    // The calling thread is replica 0; `spawn_broadcast` runs the job exactly once on every
    // thread of the pool (replica r on thread r - 1), and the scope returns when all are done.
    let Some(pool) = pools.replicas.as_ref().filter(|p| p.current_num_threads() == n - 1) else {
        let why = format!("replica threads built for another count than {n} replicas; use ReplicaPools::for_devices");
        return Err(Error::InvalidArgument(why));
    };
    let slots: Vec<std::sync::Mutex<Option<Result<()>>>> = (0..n).map(|_| Default::default()).collect();
    pool.in_place_scope(|s| {
        s.spawn_broadcast(|_, ctx| {
            let r = ctx.index() + 1;
            *slots[r].lock().unwrap_or_else(PoisonError::into_inner) = Some(run_one(r));
        });
        *slots[0].lock().unwrap_or_else(PoisonError::into_inner) = Some(run_one(0));
    });
    let results = slots.into_iter().enumerate().map(|(r, m)| {
        m.into_inner()
            .unwrap_or_else(PoisonError::into_inner)
            .unwrap_or_else(|| Err(Error::Scope(format!("replica {r} did not run"))))
    });
    let mut first_secondary = None;
    for (r, res) in results.enumerate() {
        match res {
            Ok(()) => {}
            // Errors that name their replica already.
            Err(e @ (Error::ReplicaPanicked { .. } | Error::MemoryLimitInStep(_))) => return Err(e),
            Err(e) if is_secondary(&e) => {
                first_secondary.get_or_insert(Error::Replica { replica: r, source: Box::new(e) });
            }
            Err(e) => return Err(Error::Replica { replica: r, source: Box::new(e) }),
        }
    }
    first_secondary.map_or(Ok(()), Err)
}

/// Runs `f` on every replica and collects the results in replica order.
pub fn run_collect<T: Send>(
    ext: &dyn StrategyExtended,
    weights: &[f32],
    f: impl Fn(&ReplicaContext<'_>) -> Result<T> + Sync,
) -> Result<PerReplica<T>> {
    let n = ext.num_replicas();
    let slots: Vec<Mutex<Option<T>>> = (0..n).map(|_| Mutex::new(None)).collect();
    ext.execute(weights, &|ctx| {
        let v = f(ctx)?;
        *slots[ctx.replica_id()].lock().unwrap_or_else(PoisonError::into_inner) = Some(v);
        Ok(())
    })?;
    let values = slots
        .into_iter()
        .enumerate()
        .map(|(r, m)| {
            m.into_inner()
                .unwrap_or_else(PoisonError::into_inner)
                .ok_or_else(|| Error::Scope(format!("replica {r} returned no value")))
        })
        .collect::<Result<_>>()?;
    PerReplica::new(values)
}

/// Reduces per-replica tensors element-wise, in cross-replica context.
pub fn reduce_tensors(op: ReduceOp, value: &PerReplica<Tensor>) -> Result<Tensor> {
    let vals = value.values();
    let first = &vals[0];
    for (r, v) in vals.iter().enumerate().skip(1) {
        if v.shape() != first.shape() {
            return Err(Error::ShapeMismatch {
                op: format!("reduce({op})"),
                detail: format!("replica 0 has shape {:?} but replica {r} has {:?}", first.shape(), v.shape()),
            });
        }
    }
    let on0 = vals.iter().map(|v| v.to_device(first.device())).collect::<candle_core::Result<Vec<_>>>()?;
    let stacked = Tensor::stack(&on0, 0)?;
    Ok(match op {
        ReduceOp::Sum => stacked.sum(0)?,
        ReduceOp::Mean => stacked.mean(0)?,
        ReduceOp::Max => stacked.max(0)?,
        ReduceOp::Min => stacked.min(0)?,
    })
}

/// The strategy that answers outside any scope: one replica on the CPU.
#[derive(Debug)]
pub struct DefaultStrategy {
    id: StrategyId,
    devices: Vec<LogicalDevice>,
    ops: CpuCrossDeviceOps,
    options: StrategyOptions,
}

impl DefaultStrategy {
    /// The default strategy.
    pub fn new() -> Self {
        let devices = crate::device::logical_cpus(1).unwrap_or_default();
        Self {
            id: StrategyId::fresh(),
            devices,
            ops: CpuCrossDeviceOps::one_replica(),
            options: StrategyOptions::default(),
        }
    }
}

impl Default for DefaultStrategy {
    fn default() -> Self {
        Self::new()
    }
}

impl StrategyExtended for DefaultStrategy {
    fn id(&self) -> StrategyId {
        self.id
    }
    fn name(&self) -> &'static str {
        "default"
    }
    fn replica_devices(&self) -> &[LogicalDevice] {
        &self.devices
    }
    fn variable_policy(&self) -> VariablePolicy {
        VariablePolicy::Mirrored
    }
    fn cross_device_ops(&self) -> &dyn CrossDeviceOps {
        &self.ops
    }
    fn options(&self) -> &StrategyOptions {
        &self.options
    }
    fn execute(&self, weights: &[f32], job: &ReplicaJob<'_>) -> Result<()> {
        execute_local(self, &ReplicaPools::default(), weights, job)
    }
}
