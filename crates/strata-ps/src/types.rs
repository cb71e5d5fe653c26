//! The values a parameter-server task is configured with, the requests it takes and the answers
//! it gives, independent of any wire format.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use strata_core::cross_device::compression::{Compression, HalfFormat};
use strata_core::optim::schedule::LrSchedule;

use strata_core::embedding::TableConfig;

use crate::{RowOptimizer, ServerOptimizer, ValueChunk};

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

/// The learning rate an async or stale-mode task applies a push's dense variables at, by the
/// push's staleness `s`: the updates the task applied between the pull the push was computed
/// from and the push (its version now minus the push's base version).
///
/// Two workers pushing gradients computed at the same values apply, between them, twice the
/// step that one device would take from that point: a stale push's step is in effect larger.
/// [`StaleRate::Inverse`] takes `lr / (1 + s)`, a staleness-dependent rate after Zhang et al.
/// (IJCAI 2016): a push that lands as computed (one worker, or no update in between) takes the
/// full rate, the same bits as [`StaleRate::Constant`]. A schedule's rate is scaled the same
/// way. Embedding tables' rows always take their optimizer's rate: a row a push carries was
/// seldom touched by the updates in between. Sync mode has no staleness and ignores it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StaleRate {
    /// Every push at the optimizer's rate, however stale (TensorFlow's `ParameterServerStrategy`).
    #[default]
    Constant,
    /// A push of staleness `s` at `lr / (1 + s)`.
    Inverse,
}

impl StaleRate {
    /// Its name (`"constant"` or `"inverse"`), as the protocol and `strata train --stale-rate`
    /// spell it.
    pub fn name(self) -> &'static str {
        match self {
            StaleRate::Constant => "constant",
            StaleRate::Inverse => "inverse",
        }
    }

    /// The rate a push of `staleness` takes at base rate `lr`.
    pub fn rate(self, lr: f64, staleness: u64) -> f64 {
        match self {
            StaleRate::Constant => lr,
            StaleRate::Inverse if staleness == 0 => lr,
            StaleRate::Inverse => lr / (1.0 + staleness as f64),
        }
    }
}

impl fmt::Display for StaleRate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The element type of the values a push carries or a pull returns. A task holds and applies
/// f32 whatever travels: a 16-bit push is decoded to f32 exactly ([`HalfFormat::decode`]) and
/// applied as an f32 push is; a 16-bit pull gets each value rounded to nearest even
/// ([`HalfFormat::encode`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum WireFormat {
    /// Little-endian f32, exact (4 bytes per element).
    #[default]
    F32,
    /// IEEE binary16 (2 bytes per element): values beyond ±65504 become infinite.
    F16,
    /// bfloat16 (2 bytes per element): f32's range, 8 significant bits.
    Bf16,
}

impl WireFormat {
    /// The wire format of a gradient compression: `none` is f32, `fp16` and `bf16` their
    /// 16-bit formats; `None` for int8 and PowerSGD, which a parameter server does not take.
    pub fn of(compression: Compression) -> Option<Self> {
        match compression {
            Compression::None => Some(WireFormat::F32),
            Compression::Fp16 => Some(WireFormat::F16),
            Compression::Bf16 => Some(WireFormat::Bf16),
            Compression::Int8 | Compression::PowerSgd { .. } => None,
        }
    }

    /// The 16-bit format, or `None` for f32.
    pub fn half(self) -> Option<HalfFormat> {
        match self {
            WireFormat::F32 => None,
            WireFormat::F16 => Some(HalfFormat::F16),
            WireFormat::Bf16 => Some(HalfFormat::Bf16),
        }
    }

    /// The bytes of one element: 4 or 2.
    pub fn element_bytes(self) -> usize {
        match self {
            WireFormat::F32 => 4,
            WireFormat::F16 | WireFormat::Bf16 => 2,
        }
    }

    /// The format's name: `f32`, `f16` or `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            WireFormat::F32 => "f32",
            WireFormat::F16 => "f16",
            WireFormat::Bf16 => "bf16",
        }
    }
}

impl fmt::Display for WireFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
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
    /// Non-trainable state (BatchNorm's running statistics): a push carries the change a
    /// worker's forward pass made to it, which the task adds (no optimizer, no slots).
    #[serde(default)]
    pub state: bool,
}

impl VariableInfo {
    /// A variable that is not partitioned.
    pub fn whole(name: impl Into<String>, shape: Vec<usize>) -> Self {
        let name = name.into();
        Self {
            variable: name.clone(),
            name,
            full_shape: shape.clone(),
            shape,
            part: 0,
            num_parts: 1,
            row_offset: 0,
            state: false,
        }
    }

    /// The shard's number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
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

/// A task's answer to a push: a [`PushOutcome`], and for a dropped update too whether this was
/// a retry answered from the applied-update table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PushReply {
    /// Applied (in sync mode: its round was).
    Applied {
        /// The task's version after the update.
        version: u64,
        /// This was a retry of an update already taken.
        duplicate: bool,
    },
    /// Sync mode: dropped (it came after its round was complete, or from an older version).
    Dropped {
        /// The task's version.
        version: u64,
        /// This was a retry of an update already dropped.
        duplicate: bool,
    },
}

impl PushReply {
    /// What became of the push.
    pub fn outcome(&self) -> PushOutcome {
        match *self {
            PushReply::Applied { version, duplicate } => PushOutcome::Applied { version, duplicate },
            PushReply::Dropped { version, .. } => PushOutcome::Dropped { version },
        }
    }

    /// The task's version in the answer.
    pub fn version(&self) -> u64 {
        match *self {
            PushReply::Applied { version, .. } | PushReply::Dropped { version, .. } => version,
        }
    }

    /// Whether this was a retry answered from the applied-update table.
    pub fn duplicate(&self) -> bool {
        match *self {
            PushReply::Applied { duplicate, .. } | PushReply::Dropped { duplicate, .. } => duplicate,
        }
    }
}

/// What creating variables answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CreateOutcome {
    /// The versions of the variables, in the order given.
    pub versions: Vec<u64>,
    /// Every variable existed already (a restored task, or a second coordinator), or was
    /// drawn from the whole job's checkpoint the task was restored from: the values are not the
    /// request's.
    pub existed: bool,
    /// The task's version.
    pub version: u64,
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
    /// The learning-rate schedule the task follows, if any (see [`CreateHeader::schedule`]).
    pub schedule: Option<LrSchedule>,
    /// The rate of stale pushes' dense variables (see [`CreateHeader::stale_rate`]).
    pub stale_rate: StaleRate,
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
    /// The element type the job's workers push and pull in, as the last create request set
    /// it ([`CreateHeader::wire_format`]; f32 before any).
    pub wire_format: WireFormat,
    /// The embedding tables' shards the task holds, with their counts.
    pub tables: Vec<TableStatus>,
}

/// The header of a request that creates variables: what the [`Chunk`](crate::Chunk)s after it fill.
#[derive(Clone, Debug, PartialEq)]
pub struct CreateHeader {
    /// The variables, in the order the chunks number them.
    pub variables: Vec<VariableInfo>,
    /// The optimizer the task applies (the same for every request of a task).
    pub optimizer: ServerOptimizer,
    /// The learning-rate schedule the task follows (the same for every request of a task;
    /// `None`: the optimizer's constant rate). With one, the task's update number `n` (0 for
    /// the first) applies the optimizer at `schedule.at(n)` instead of its own `lr`, the
    /// optimizer's other parameters unchanged. `n` is the task's version before the update,
    /// the updates it has applied: in async and stale modes one per applied push (every worker
    /// step pushes once to every ps task, an empty push where none of the task's variables has
    /// a gradient, so `n` counts the job's applied worker steps), in sync mode one per applied
    /// round. A retry answered as a duplicate, a dropped or stale push and an aborted streamed
    /// push are no step. One count for every variable of the task, as Keras' `iterations`
    /// counts applied updates, and the one AdamW's bias correction counts (`t = n + 1`); a
    /// variable pushed in every update has version `n` too. A checkpoint holds the version
    /// and the schedule, so a restored task goes on with the next step's rate.
    pub schedule: Option<LrSchedule>,
    /// The rate of a stale push's dense variables (the same for every request of a task;
    /// async and stale modes).
    pub stale_rate: StaleRate,
    /// How the task applies pushes (the same for every request of a task).
    pub mode: PsMode,
    /// The element type the job's workers push and pull in: the task records it (each create
    /// request sets it, also one that finds its variables existing) and reports it in
    /// [`PsStatus::wire_format`], where workers read it. It describes the job, not the
    /// variables, and is not part of checkpoints. The initial values are f32 whatever it is.
    pub wire_format: WireFormat,
    /// The embedding tables (shards of them) the task holds, created with the variables: a
    /// table the task holds already must be described the same way again. Their rows are
    /// created when first pulled, from [`init_row`](strata_core::embedding::init_row); no
    /// chunk carries them.
    pub tables: Vec<TableInfo>,
}

/// The header of a push: the update's identity, the version it was computed from, and the
/// variables its [`Chunk`](crate::Chunk)s carry gradients for, in the order the chunks number
/// them.
#[derive(Clone, Debug, PartialEq)]
pub struct PushHeader {
    /// The update's identity (exactly once).
    pub id: UpdateId,
    /// The task's version the gradients were computed from.
    pub base_version: u64,
    /// The variables pushed.
    pub variables: Vec<String>,
    /// The gradients of embedding-table rows: the sparse part of the same update (one per
    /// table at most).
    pub rows: Vec<RowGrads>,
}

/// One embedding table's shard as a ps task holds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TableInfo {
    /// The table: its name, row width, size and initializer.
    pub config: TableConfig,
    /// The seed of its rows' initial values ([`init_row`](strata_core::embedding::init_row)).
    pub seed: u64,
    /// This shard's index: it holds the rows whose
    /// [`owner_of`](strata_core::embedding::owner_of) is `shard` (a fixed table's ids
    /// `id % num_shards == shard`, an id-space table's hashed ids).
    pub shard: u32,
    /// How many shards the table has.
    pub num_shards: u32,
    /// The optimizer applied to its rows.
    pub optimizer: RowOptimizer,
}

impl TableInfo {
    /// The table's name.
    pub fn name(&self) -> &str {
        &self.config.name
    }
}

/// A pull of embedding-table rows: a worker reads the rows of `ids` under a lease, whose ids
/// its next push may carry gradients for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowPull {
    /// The worker pulling (the pushes' [`UpdateId::worker`]).
    pub worker: String,
    /// The lease's number, chosen by the worker (its step, say); the same number again
    /// replaces that lease's ids.
    pub lease: u64,
    /// The table.
    pub table: String,
    /// The rows, distinct, each owned by this task's shard.
    pub ids: Vec<u64>,
}

/// The rows a [`RowPull`] read.
#[derive(Clone, Debug, PartialEq)]
pub struct RowPullResult {
    /// The task's version when the rows were read.
    pub version: u64,
    /// The rows' values, `ids.len() * dim`, in the order of the pull's ids.
    pub values: Vec<f32>,
}

/// The gradients of one table's rows in a push.
#[derive(Clone, Debug, PartialEq)]
pub struct RowGrads {
    /// The table.
    pub table: String,
    /// The lease the rows were pulled under (by the pushing worker).
    pub lease: u64,
    /// The rows, distinct (a worker sums the gradients of an id seen twice), each pulled
    /// under `lease`.
    pub ids: Vec<u64>,
    /// Their gradients, `ids.len() * dim`, in the order of `ids`.
    pub grads: Vec<f32>,
}

/// What a ps task holds of one embedding table.
#[derive(Clone, Debug, PartialEq)]
pub struct TableStatus {
    /// The table's shard.
    pub info: TableInfo,
    /// The rows present (created and not evicted).
    pub rows: u64,
    /// The rows evicted so far (checkpoints keep the count; resharded shards start at 0).
    pub evicted: u64,
    /// The bytes of the rows present: values and optimizer slots.
    pub bytes: u64,
}

/// The values a pull reads: the task's version, each variable with its version, and chunks of
/// their values that share the variables' memory (no copy).
#[derive(Clone, Debug)]
pub struct PullResult {
    /// The task's version when the values were read.
    pub version: u64,
    /// The variables pulled and their versions, in the order the chunks number them.
    pub variables: Vec<(VariableInfo, u64)>,
    /// The values, in chunks of at most [`MAX_CHUNK_ELEMENTS`](crate::MAX_CHUNK_ELEMENTS),
    /// each variable's in order.
    pub chunks: Vec<ValueChunk>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_give_the_outcome() {
        let r = PushReply::Dropped { version: 3, duplicate: true };
        assert_eq!((r.outcome(), r.version(), r.duplicate()), (PushOutcome::Dropped { version: 3 }, 3, true));
        let r = PushReply::Applied { version: 4, duplicate: false };
        assert_eq!(r.outcome(), PushOutcome::Applied { version: 4, duplicate: false });
    }
}
