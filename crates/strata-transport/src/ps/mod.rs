//! The parameter server of a `ParameterServerStrategy` job: a gRPC server that holds variables
//! (or shards of them), applies pushed gradients with an optimizer that runs on the server, and
//! serves their values; and the blocking client workers and the coordinator use.
//!
//! ```
//! use strata_transport::ps::{PsClient, PsClientConfig, PsMode, PsServerConfig, PsServerHandle, ServerOptimizer, UpdateId, VariableInfo};
//! use strata_transport::ClusterToken;
//!
//! let token = ClusterToken::new("0123456789abcdef0123")?;
//! let server = PsServerHandle::start("127.0.0.1:0".parse().unwrap(), PsServerConfig::new("ps:0", token.clone()))?;
//! let ps = PsClient::connect(&server.address().to_string(), "ps:0", token, PsClientConfig::default())?;
//! let w = VariableInfo::whole("w", vec![2, 2]);
//! ps.create_variables(&[(w, &[1.0, 2.0, 3.0, 4.0][..])], &ServerOptimizer::Sgd { lr: 0.5 }, PsMode::Async)?;
//! let id = UpdateId { worker: "worker:0".into(), client: "worker:0".into(), step: 0, seq: 0 };
//! ps.push(&id, 0, &[("w", &[2.0, 2.0, 2.0, 2.0][..])])?;
//! let pulled = ps.pull(&["w"], 1)?;
//! assert_eq!(pulled.variables[0].2, vec![0.0, 1.0, 2.0, 3.0]);
//! server.shutdown();
//! # Ok::<(), strata_transport::Error>(())
//! ```
//!
//! Semantics (the proto, `proto/strata/v1/ps.proto`, is the reference):
//!
//! - **Chunks.** Tensors travel as little-endian f32 chunks of at most [`MAX_CHUNK_BYTES`] over
//!   streams, never as one message; a larger chunk is refused with `INVALID_ARGUMENT`. `Push`
//!   and `Pull` are served and called below tonic's codec: the messages on the wire are the
//!   proto's, so any gRPC client can call them, but tensor bytes are neither reassembled into a
//!   decode buffer nor encoded into an encode buffer (a pull sends the variable's own memory).
//! - **Versions.** Every variable counts the updates applied to it; the task's version counts
//!   its applies (one per push in async and stale modes, one per round in sync mode).
//! - **Exactly once.** A push is identified by its [`UpdateId`]; a retry of an update already
//!   taken gets the first answer again, marked `duplicate`, and changes nothing. A refused
//!   push changes nothing and is not recorded, so it can be corrected and sent again.
//! - **Modes.** [`PsMode::Async`] applies each push as it arrives; [`PsMode::Sync`] averages one
//!   push per worker per round (the first `workers - backup_workers` of them; later ones, and
//!   pushes computed from an older version, are dropped); [`PsMode::Stale`] refuses a push
//!   computed from a version more than the bound behind ([`crate::Error::Stale`]).
//! - **Streamed pushes.** In async and stale modes a push of at least
//!   [`PsServerConfig::stream_min_bytes`] (2 MiB) is applied while it arrives: each chunk
//!   updates the variables out of place, into spare buffers, as it comes, and the new buffers
//!   are swapped in when the last one has arrived, so the push is still applied whole or not at
//!   all and a pull never sees part of it. Other pushes to the task wait while such a stream
//!   makes progress (and no new stream begins while they wait); one that stalls for a second
//!   loses its turn, and is then refused with
//!   `ABORTED` and nothing applied, which [`PsClient`] sends again (the update id keeps it
//!   exactly-once).

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use strata_proto::v1::{ModeSpec, OptimizerSpec, VariableSpec};

use crate::{ClusterToken, Error, Result};

mod client;
mod faults;
mod optim;
mod server;
mod state;
mod wire;

pub use client::{PsClient, PsClientConfig};
pub use faults::FaultInjection;
pub use server::PsServerHandle;

/// f32 values in memory the transport can send without a copy (for
/// [`PsClient::push_shared`]): a `Vec<f32>` handed over, shared by clones.
#[derive(Clone, Debug, Default)]
pub struct F32Bytes(prost::bytes::Bytes);

/// A `Vec<f32>` seen as its little-endian bytes.
struct F32Owner(Vec<f32>);

impl AsRef<[u8]> for F32Owner {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

impl F32Bytes {
    /// Takes `values` over, without a copy.
    pub fn from_vec(values: Vec<f32>) -> Self {
        Self(prost::bytes::Bytes::from_owner(F32Owner(values)))
    }

    /// The number of f32 values.
    pub fn len(&self) -> usize {
        self.0.len() / 4
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The bytes of elements `r` (within bounds), sharing the memory.
    pub(crate) fn elements(&self, r: std::ops::Range<usize>) -> prost::bytes::Bytes {
        self.0.slice(r.start * 4..r.end * 4)
    }
}

/// The most payload bytes (f32 elements times 4) one `TensorChunk` carries.
pub const MAX_CHUNK_BYTES: usize = 1 << 20;

/// The most f32 elements one `TensorChunk` carries.
pub const MAX_CHUNK_ELEMENTS: usize = MAX_CHUNK_BYTES / 4;

/// The largest variable (in elements) a task accepts.
pub const MAX_VARIABLE_ELEMENTS: usize = 1 << 31;

/// The optimizer a parameter server applies to every update, in f32.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ServerOptimizer {
    /// `w -= lr * g`.
    Sgd {
        /// The learning rate.
        lr: f64,
    },
    /// Keras' SGD with momentum: `v = m * v - lr * g; w += v` (Nesterov: `w += m * v - lr * g`).
    Momentum {
        /// The learning rate.
        lr: f64,
        /// The momentum `m`.
        momentum: f64,
        /// Nesterov momentum.
        nesterov: bool,
    },
    /// Adam with decoupled weight decay (`w -= lr * wd * w`, then the bias-corrected Adam
    /// step with `eps` outside the square root).
    AdamW {
        /// The learning rate.
        lr: f64,
        /// The first moment's decay.
        beta1: f64,
        /// The second moment's decay.
        beta2: f64,
        /// Added to the denominator.
        eps: f64,
        /// The decoupled weight decay.
        weight_decay: f64,
    },
    /// Keras' Adagrad: `acc += g^2; w -= lr * g / (sqrt(acc) + eps)`.
    Adagrad {
        /// The learning rate.
        lr: f64,
        /// The accumulator's start value (Keras: 0.1).
        initial_accumulator: f64,
        /// Added to the denominator.
        eps: f64,
    },
}

impl ServerOptimizer {
    /// The optimizer as the protocol carries it.
    pub fn to_spec(&self) -> OptimizerSpec {
        let mut s = OptimizerSpec { kind: self.name().into(), ..Default::default() };
        match *self {
            ServerOptimizer::Sgd { lr } => s.learning_rate = lr,
            ServerOptimizer::Momentum { lr, momentum, nesterov } => {
                s.learning_rate = lr;
                s.momentum = momentum;
                s.nesterov = nesterov;
            }
            ServerOptimizer::AdamW { lr, beta1, beta2, eps, weight_decay } => {
                s.learning_rate = lr;
                s.beta1 = beta1;
                s.beta2 = beta2;
                s.epsilon = eps;
                s.weight_decay = weight_decay;
            }
            ServerOptimizer::Adagrad { lr, initial_accumulator, eps } => {
                s.learning_rate = lr;
                s.initial_accumulator = initial_accumulator;
                s.epsilon = eps;
            }
        }
        s
    }

    /// The optimizer a spec names, checked.
    pub fn from_spec(s: &OptimizerSpec) -> Result<Self> {
        let lr = s.learning_rate;
        let finite = [s.learning_rate, s.momentum, s.beta1, s.beta2, s.epsilon, s.weight_decay, s.initial_accumulator];
        if finite.iter().any(|v| !v.is_finite()) {
            return Err(Error::Config(format!("the {} optimizer's parameters must be finite numbers", s.kind)));
        }
        if lr <= 0.0 {
            return Err(Error::Config(format!("the learning rate must be positive, not {lr}")));
        }
        let opt = match s.kind.as_str() {
            "sgd" => ServerOptimizer::Sgd { lr },
            "momentum" => {
                if !(0.0..1.0).contains(&s.momentum) {
                    return Err(Error::Config(format!("momentum must be in [0, 1), not {}", s.momentum)));
                }
                ServerOptimizer::Momentum { lr, momentum: s.momentum, nesterov: s.nesterov }
            }
            "adamw" => {
                for (what, b) in [("beta1", s.beta1), ("beta2", s.beta2)] {
                    if !(0.0..1.0).contains(&b) {
                        return Err(Error::Config(format!("{what} must be in [0, 1), not {b}")));
                    }
                }
                if s.epsilon <= 0.0 || s.weight_decay < 0.0 {
                    return Err(Error::Config("adamw needs epsilon > 0 and weight_decay >= 0".into()));
                }
                ServerOptimizer::AdamW {
                    lr,
                    beta1: s.beta1,
                    beta2: s.beta2,
                    eps: s.epsilon,
                    weight_decay: s.weight_decay,
                }
            }
            "adagrad" => {
                if s.initial_accumulator < 0.0 || s.epsilon < 0.0 {
                    return Err(Error::Config("adagrad needs initial_accumulator >= 0 and epsilon >= 0".into()));
                }
                ServerOptimizer::Adagrad { lr, initial_accumulator: s.initial_accumulator, eps: s.epsilon }
            }
            other => {
                return Err(Error::Config(format!(
                    "unknown optimizer {other:?}; a parameter server runs sgd, momentum, adamw or adagrad"
                )))
            }
        };
        Ok(opt)
    }

    /// `sgd`, `momentum`, `adamw` or `adagrad`.
    pub fn name(&self) -> &'static str {
        match self {
            ServerOptimizer::Sgd { .. } => "sgd",
            ServerOptimizer::Momentum { .. } => "momentum",
            ServerOptimizer::AdamW { .. } => "adamw",
            ServerOptimizer::Adagrad { .. } => "adagrad",
        }
    }

    /// The learning rate.
    pub fn learning_rate(&self) -> f64 {
        match *self {
            ServerOptimizer::Sgd { lr }
            | ServerOptimizer::Momentum { lr, .. }
            | ServerOptimizer::AdamW { lr, .. }
            | ServerOptimizer::Adagrad { lr, .. } => lr,
        }
    }

    /// How many f32 slots per element the optimizer keeps.
    pub fn slots(&self) -> usize {
        match self {
            ServerOptimizer::Sgd { .. } => 0,
            ServerOptimizer::Momentum { .. } | ServerOptimizer::Adagrad { .. } => 1,
            ServerOptimizer::AdamW { .. } => 2,
        }
    }

    /// Applies one update exactly as a ps task does: gradient `g` to `w` and its optimizer
    /// `slots` (as many as [`ServerOptimizer::slots`], each as long as `w`, zero at the start;
    /// Adagrad's accumulator starts at its initial value). `t` is the update's number, from 1
    /// (AdamW's bias correction). Used by `strata compare --simulate`.
    pub fn apply(&self, w: &mut [f32], g: &[f32], slots: &mut [&mut [f32]], t: u64) {
        optim::apply(self, w, g, slots, t)
    }
}

impl fmt::Display for ServerOptimizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}(lr {})", self.name(), self.learning_rate())
    }
}

/// How a parameter server applies pushes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PsMode {
    /// Each push is applied as it arrives (TF's `ParameterServerStrategy`).
    Async,
    /// One mean gradient per round, from the first `workers - backup_workers` pushes computed
    /// from the task's current version; later ones are dropped.
    Sync {
        /// The workers that push each round.
        workers: u32,
        /// How many of them are backups whose late pushes are dropped.
        backup_workers: u32,
    },
    /// Async, but a push computed from a version more than `staleness` behind is refused.
    Stale {
        /// The largest accepted distance between the task's version and a push's base.
        staleness: u64,
    },
}

impl PsMode {
    /// The mode as the protocol carries it.
    pub fn to_spec(&self) -> ModeSpec {
        match *self {
            PsMode::Async => ModeSpec { mode: "async".into(), ..Default::default() },
            PsMode::Sync { workers, backup_workers } => {
                ModeSpec { mode: "sync".into(), workers, backup_workers, ..Default::default() }
            }
            PsMode::Stale { staleness } => ModeSpec { mode: "stale".into(), staleness, ..Default::default() },
        }
    }

    /// The mode a spec names, checked.
    pub fn from_spec(s: &ModeSpec) -> Result<Self> {
        match s.mode.as_str() {
            "async" | "" => Ok(PsMode::Async),
            "sync" => {
                if s.workers == 0 {
                    return Err(Error::Config("sync mode needs at least one worker".into()));
                }
                if s.backup_workers >= s.workers {
                    return Err(Error::Config(format!(
                        "{} backup workers leave none of the {} workers to aggregate; use fewer backup workers",
                        s.backup_workers, s.workers
                    )));
                }
                Ok(PsMode::Sync { workers: s.workers, backup_workers: s.backup_workers })
            }
            "stale" => Ok(PsMode::Stale { staleness: s.staleness }),
            other => Err(Error::Config(format!("unknown mode {other:?}; use async, sync or stale"))),
        }
    }
}

impl fmt::Display for PsMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            PsMode::Async => write!(f, "async"),
            PsMode::Sync { workers, backup_workers } => {
                write!(f, "sync({workers} workers, {backup_workers} backup)")
            }
            PsMode::Stale { staleness } => write!(f, "stale({staleness})"),
        }
    }
}

/// A variable, or one shard of a partitioned variable, as one parameter server holds it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VariableInfo {
    /// The shard's name (the variable's, with `/part_<i>` for a shard).
    pub name: String,
    /// The shard's shape.
    pub shape: Vec<usize>,
    /// The whole variable's name.
    pub variable: String,
    /// This shard's index along the first axis.
    pub part: u32,
    /// How many shards the variable has.
    pub num_parts: u32,
    /// The shard's first row in the whole variable.
    pub row_offset: u64,
    /// The whole variable's shape.
    pub full_shape: Vec<usize>,
}

impl VariableInfo {
    /// A variable that is not partitioned.
    pub fn whole(name: impl Into<String>, shape: Vec<usize>) -> Self {
        let name = name.into();
        Self { variable: name.clone(), name, full_shape: shape.clone(), shape, part: 0, num_parts: 1, row_offset: 0 }
    }

    /// The shard's number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The variable as the protocol carries it.
    pub fn to_spec(&self) -> VariableSpec {
        VariableSpec {
            name: self.name.clone(),
            shape: self.shape.iter().map(|&d| d as u64).collect(),
            dtype: "f32".into(),
            variable: self.variable.clone(),
            part: self.part,
            num_parts: self.num_parts,
            row_offset: self.row_offset,
            full_shape: self.full_shape.iter().map(|&d| d as u64).collect(),
        }
    }

    /// The variable a spec describes, checked (dtype, name, size).
    pub fn from_spec(s: &VariableSpec) -> Result<Self> {
        if s.name.is_empty() {
            return Err(Error::Config("a variable needs a name".into()));
        }
        if s.dtype != "f32" {
            return Err(Error::Config(format!(
                "variable {} has dtype {:?}; a parameter server holds f32 variables only",
                s.name, s.dtype
            )));
        }
        let dims = |d: &[u64]| -> Result<Vec<usize>> {
            let mut n: u64 = 1;
            let mut out = Vec::with_capacity(d.len());
            for &x in d {
                n = n.checked_mul(x).filter(|&n| n <= MAX_VARIABLE_ELEMENTS as u64).ok_or_else(|| {
                    Error::Config(format!(
                        "variable {} has shape {d:?}, more than {MAX_VARIABLE_ELEMENTS} elements; partition it",
                        s.name
                    ))
                })?;
                out.push(x as usize);
            }
            Ok(out)
        };
        let shape = dims(&s.shape)?;
        let full_shape = if s.full_shape.is_empty() { shape.clone() } else { dims(&s.full_shape)? };
        let variable = if s.variable.is_empty() { s.name.clone() } else { s.variable.clone() };
        let num_parts = s.num_parts.max(1);
        if s.part >= num_parts {
            return Err(Error::Config(format!("variable {} is part {} of {num_parts}", s.name, s.part)));
        }
        Ok(Self {
            name: s.name.clone(),
            shape,
            variable,
            part: s.part,
            num_parts,
            row_offset: s.row_offset,
            full_shape,
        })
    }
}

/// How a parameter-server task serves.
#[derive(Clone, Debug)]
pub struct PsServerConfig {
    /// The task's name, `ps:<index>`.
    pub task: String,
    /// The cluster token every call must carry.
    pub token: ClusterToken,
    /// Where the `Checkpoint` RPC writes `ckpt-<step>` directories.
    pub checkpoint_dir: Option<PathBuf>,
    /// How many checkpoints to keep (the oldest are removed).
    pub keep_checkpoints: usize,
    /// A checkpoint to restore at start: a root holding `ckpt-*` directories (the latest is
    /// used) or one `ckpt-<step>` directory.
    pub restore: Option<PathBuf>,
    /// Faults to inject (tests only): when any is asked for, the service is wrapped in a layer
    /// that injects them on `Push` calls.
    pub faults: FaultInjection,
    /// In sync mode, how long a push waits for its round to be applied.
    pub round_timeout: Duration,
    /// Async and stale modes: a push of at least this many bytes is applied while it arrives,
    /// each chunk as it comes, into spare buffers swapped in at the end (the push is still
    /// applied whole or not at all). The task then keeps one spare copy of the variables and
    /// optimizer slots such pushes update. `None`: every push is applied after its last chunk,
    /// in place. Default: 2 MiB (two chunks).
    pub stream_min_bytes: Option<usize>,
}

impl PsServerConfig {
    /// A task with no checkpoints, no faults, a 120 s round timeout, and pushes of 2 MiB and
    /// more applied as they arrive.
    pub fn new(task: impl Into<String>, token: ClusterToken) -> Self {
        Self {
            task: task.into(),
            token,
            checkpoint_dir: None,
            keep_checkpoints: 3,
            restore: None,
            faults: FaultInjection::default(),
            round_timeout: Duration::from_secs(120),
            stream_min_bytes: Some(2 * MAX_CHUNK_BYTES),
        }
    }
}

/// Identifies one update: a parameter server applies it at most once.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct UpdateId {
    /// The task that computed it, e.g. `worker:2`.
    pub worker: String,
    /// Who numbers the steps: the coordinator's run id, or the worker's own name.
    pub client: String,
    /// The step.
    pub step: u64,
    /// The update's number within the step.
    pub seq: u64,
}

/// What became of a push.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PushOutcome {
    /// The update was applied (in sync mode: its round was); `duplicate` when this was a
    /// retry answered from the applied-update table.
    Applied {
        /// The task's version after the update.
        version: u64,
        /// This was a retry of an update already taken.
        duplicate: bool,
    },
    /// Sync mode: the update came after its round was complete and was dropped.
    Dropped {
        /// The task's version.
        version: u64,
    },
}

impl PushOutcome {
    /// The task's version in the answer.
    pub fn version(&self) -> u64 {
        match *self {
            PushOutcome::Applied { version, .. } | PushOutcome::Dropped { version } => version,
        }
    }

    /// Whether the update was dropped.
    pub fn dropped(&self) -> bool {
        matches!(self, PushOutcome::Dropped { .. })
    }
}

/// What `CreateVariables` answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CreateOutcome {
    /// The versions of the variables, in the order given.
    pub versions: Vec<u64>,
    /// Every variable existed already (a restored task, or a second coordinator).
    pub existed: bool,
    /// The task's version.
    pub version: u64,
}

/// Values pulled from one parameter server.
#[derive(Clone, Debug)]
pub struct Pulled {
    /// The task's version when the values were read.
    pub version: u64,
    /// Each variable, its version and its values.
    pub variables: Vec<(VariableInfo, u64, Vec<f32>)>,
}

/// What a parameter server holds and has done.
#[derive(Clone, Debug)]
pub struct PsStatus {
    /// The task's name.
    pub task: String,
    /// The task's version.
    pub version: u64,
    /// The variables and their versions.
    pub variables: Vec<(VariableInfo, u64)>,
    /// Updates applied (in sync mode, pushes in applied rounds).
    pub pushes_applied: u64,
    /// Retries answered from the applied-update table.
    pub pushes_duplicate: u64,
    /// Sync-mode pushes dropped.
    pub pushes_dropped: u64,
    /// Stale pushes refused.
    pub pushes_stale: u64,
    /// The step of the checkpoint the task was restored from (0: started fresh).
    pub restored_step: u64,
    /// The restored checkpoint's task version.
    pub restored_version: u64,
    /// The mode.
    pub mode: PsMode,
    /// The optimizer, once variables were created.
    pub optimizer: Option<ServerOptimizer>,
    /// Sync mode: the rounds applied.
    pub rounds: u64,
    /// Per worker, how many of its pushes were applied.
    pub applied_by_worker: BTreeMap<String, u64>,
    /// Pushes applied while they arrived (async and stale modes; counted in `pushes_applied`
    /// too).
    pub pushes_streamed: u64,
    /// Streamed pushes refused with `ABORTED` because another update was applied while they
    /// arrived (the client sends them again).
    pub pushes_aborted: u64,
    /// Whether a streamed push is arriving now.
    pub streaming: bool,
}
