//! The one error type of `strata-ps`: every way a request to a parameter-server task can be
//! refused, and every way its checkpoints can fail, each with the data that says what went
//! wrong. [`Error::kind`] sorts them into the few kinds an RPC layer answers with (strata-transport
//! maps each kind to a gRPC status code, in one place).

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use strata_core::optim::schedule::LrSchedule;

use crate::limits::{
    MAX_IDS_PER_REQUEST, MAX_LEASED_IDS, MAX_NAME_BYTES, MAX_POOL_BYTES, MAX_RANK, MAX_ROW_VALUES_PER_REQUEST,
    MAX_TABLES, MAX_TABLE_BYTES, MAX_TABLE_SHARDS, MAX_TASK_BYTES, MAX_VARIABLES, MAX_WORKERS,
};
use crate::{
    PsMode, ServerOptimizer, StaleRate, VariableInfo, WireFormat, MAX_CHUNK_BYTES, MAX_CHUNK_ELEMENTS,
    MAX_VARIABLE_ELEMENTS,
};

/// The kind of an [`Error`]: what the caller can do about it. An RPC layer maps each kind to
/// its status code (gRPC: `INVALID_ARGUMENT`, `FAILED_PRECONDITION`, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The request itself is malformed or out of range: sending it again cannot succeed.
    InvalidArgument,
    /// The request is well-formed but the task is not in a state to take it (no variables
    /// yet, another optimizer or mode, a stale push, no checkpoint directory).
    FailedPrecondition,
    /// The request names a variable the task does not hold.
    NotFound,
    /// The request was overtaken by another one and nothing of it was applied: send it again.
    Aborted,
    /// A wait (a sync round, a version to reach) ran out of time.
    DeadlineExceeded,
    /// The task could not get the memory a request needs; it serves on, and the request may
    /// succeed later or on a task with more memory.
    ResourceExhausted,
    /// The task failed to do what it should have (a checkpoint it could not write or read,
    /// an inconsistency): not the caller's doing.
    Internal,
}

/// Which request a chunk belongs to, as errors name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RequestKind {
    /// `CreateVariables` (named "request" in messages).
    Create,
    /// `Push`.
    Push,
}

impl fmt::Display for RequestKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RequestKind::Create => "request",
            RequestKind::Push => "push",
        })
    }
}

/// Errors from strata-ps. Messages are lower case, without a trailing period, and say what to
/// change where the cause is the caller's.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A name (of a variable, a worker, a client, ...) longer than [`MAX_NAME_BYTES`].
    #[error("a {what} name of {bytes} bytes is over the limit of {MAX_NAME_BYTES} bytes; use a shorter name")]
    NameTooLong {
        /// Which name: `variable`, `table`, `worker`, `client`, `optimizer`, `schedule`,
        /// `mode` or `dtype`.
        what: &'static str,
        /// Its length.
        bytes: usize,
    },

    /// A request that would leave a task with more than [`MAX_VARIABLES`] variables.
    #[error("{task} would hold {count} variables, over the limit of {MAX_VARIABLES}; use fewer, larger variables or more ps tasks")]
    TooManyVariables {
        /// The task.
        task: String,
        /// How many it would hold.
        count: usize,
    },

    /// A request that would leave a task with more than [`MAX_TASK_BYTES`] bytes of variables.
    #[error("{task} would hold {bytes} bytes of variables, over the limit of {MAX_TASK_BYTES}; partition the variables over more ps tasks")]
    TaskTooLarge {
        /// The task.
        task: String,
        /// How many bytes it would hold.
        bytes: u64,
    },

    /// A shape of more than [`MAX_RANK`] axes.
    #[error("variable {variable} has {rank} axes, over the limit of {MAX_RANK}")]
    RankTooLarge {
        /// The variable.
        variable: String,
        /// Its number of axes.
        rank: usize,
    },

    /// A shard whose shape does not fit its whole variable's.
    #[error(
        "variable {variable} has shape {shape:?}, which is not a block of rows of its whole variable's shape {full_shape:?}; every axis but the first must match"
    )]
    ShardShape {
        /// The shard.
        variable: String,
        /// Its shape.
        shape: Vec<usize>,
        /// The whole variable's shape.
        full_shape: Vec<usize>,
    },

    /// A shard whose rows lie outside its whole variable.
    #[error("variable {variable} holds rows from {row_offset} on ({rows} rows), past the {full_rows} rows of its whole variable")]
    ShardRows {
        /// The shard.
        variable: String,
        /// Its first row.
        row_offset: u64,
        /// Its rows.
        rows: usize,
        /// The whole variable's rows.
        full_rows: usize,
    },

    /// A pushed gradient with a NaN or infinite element.
    #[error("the gradient of variable {variable} holds {value} at element {element}; nothing was applied (the worker's training diverged: lower the learning rate or check its data)")]
    NonFiniteGradient {
        /// The variable.
        variable: String,
        /// The element's index in the variable.
        element: usize,
        /// The value (NaN, inf or -inf).
        value: f32,
    },

    /// Initial values with a NaN or infinite element.
    #[error("the initial value of variable {variable} holds {value} at element {element}; give finite values")]
    NonFiniteValue {
        /// The variable.
        variable: String,
        /// The element's index in the variable.
        element: usize,
        /// The value (NaN, inf or -inf).
        value: f32,
    },

    /// A live-worker count out of range.
    #[error("live_workers {live} is out of range; a job has 1 to {max} workers")]
    LiveWorkers {
        /// The count asked for.
        live: u32,
        /// The largest accepted (the sync mode's workers, or [`MAX_WORKERS`]).
        max: u32,
    },

    /// Sync mode with more workers than [`MAX_WORKERS`].
    #[error("sync mode with {workers} workers is over the limit of {MAX_WORKERS}")]
    TooManyWorkers {
        /// The workers asked for.
        workers: u32,
    },

    /// A push from a worker name beyond the [`MAX_WORKERS`] names a task counts.
    #[error("{task} already counts pushes of {MAX_WORKERS} workers, the limit; name workers worker:<index>")]
    TooManyWorkerNames {
        /// The task.
        task: String,
    },

    /// The task could not allocate the memory a request needs.
    #[error("{task} cannot allocate {bytes} bytes for {what}; it serves on, but needs more memory (or fewer, smaller variables) for this request")]
    OutOfMemory {
        /// The task.
        task: String,
        /// The bytes asked for.
        bytes: usize,
        /// What they were for.
        what: &'static str,
    },

    /// A chunk carries more than [`MAX_CHUNK_BYTES`].
    #[error("a chunk carries {bytes} bytes; the limit is {MAX_CHUNK_BYTES} (1 MiB): cut tensors into smaller chunks")]
    ChunkTooLarge {
        /// The chunk's payload bytes.
        bytes: usize,
    },

    /// A chunk's payload is not a whole number of f32 elements.
    #[error("a chunk carries {bytes} bytes, not a whole number of f32 elements")]
    ChunkNotWholeElements {
        /// The chunk's payload bytes.
        bytes: usize,
    },

    /// A 16-bit chunk of more than [`MAX_CHUNK_ELEMENTS`] elements.
    #[error("a chunk carries {elements} {format} elements; the limit is {MAX_CHUNK_ELEMENTS}: cut tensors into smaller chunks")]
    ChunkTooManyElements {
        /// The chunk's elements.
        elements: usize,
        /// Their format.
        format: WireFormat,
    },

    /// A 16-bit chunk whose payload is an odd number of bytes.
    #[error("a chunk carries {bytes} bytes, not a whole number of {format} elements (2 bytes each)")]
    ChunkNotWholeHalfElements {
        /// The chunk's payload bytes.
        bytes: usize,
        /// The format the request names.
        format: WireFormat,
    },

    /// A wire format (the element type of a push or a pull) no parameter server knows.
    #[error("unknown wire format {value}; a parameter server takes 0 (f32), 1 (f16) or 2 (bf16)")]
    UnknownWireFormat {
        /// The value the request carries.
        value: i32,
    },

    /// A chunk refers to a variable number the request does not have.
    #[error("a chunk refers to variable #{index}, but the {request} names {count} variables")]
    UnknownChunkVariable {
        /// The chunk's variable number.
        index: usize,
        /// How many variables the request names.
        count: usize,
        /// The request.
        request: RequestKind,
    },

    /// A chunk does not start where the previous chunk of its variable ended.
    #[error(
        "a chunk of variable {variable} starts at element {offset}, expected {expected} (chunks must cover each variable in order)"
    )]
    ChunkOutOfOrder {
        /// The variable.
        variable: String,
        /// Where the chunk starts.
        offset: u64,
        /// Where it should start.
        expected: usize,
    },

    /// Chunks run past the end of their variable.
    #[error("variable {variable} has {size} elements, the {request} covers at least {covered}")]
    Overrun {
        /// The variable.
        variable: String,
        /// Its number of elements.
        size: usize,
        /// The elements covered so far, the offending chunk included.
        covered: usize,
        /// The request.
        request: RequestKind,
    },

    /// Chunks end before their variable does.
    #[error("variable {variable} has {size} elements, the {request} covers {covered}")]
    Incomplete {
        /// The variable.
        variable: String,
        /// Its number of elements.
        size: usize,
        /// The elements the request covered.
        covered: usize,
        /// The request.
        request: RequestKind,
    },

    /// An optimizer no parameter server runs.
    #[error("unknown optimizer {kind:?}; a parameter server runs sgd, momentum, adamw or adagrad")]
    UnknownOptimizer {
        /// The name asked for.
        kind: String,
    },

    /// An optimizer parameter that is NaN or infinite.
    #[error("the {kind} optimizer's parameters must be finite numbers")]
    NonFiniteOptimizer {
        /// The optimizer's name.
        kind: String,
    },

    /// A learning rate that is zero or negative.
    #[error("the learning rate must be positive, not {lr}")]
    LearningRate {
        /// The learning rate asked for.
        lr: f64,
    },

    /// A momentum outside `[0, 1)`.
    #[error("momentum must be in [0, 1), not {momentum}")]
    Momentum {
        /// The momentum asked for.
        momentum: f64,
    },

    /// An AdamW decay (`beta1` or `beta2`) outside `[0, 1)`.
    #[error("{which} must be in [0, 1), not {value}")]
    Beta {
        /// `"beta1"` or `"beta2"`.
        which: &'static str,
        /// The value asked for.
        value: f64,
    },

    /// AdamW's epsilon not positive, or its weight decay negative.
    #[error("adamw needs epsilon > 0 and weight_decay >= 0")]
    AdamWParameters {
        /// The epsilon asked for.
        eps: f64,
        /// The weight decay asked for.
        weight_decay: f64,
    },

    /// Adagrad's initial accumulator or epsilon negative.
    #[error("adagrad needs initial_accumulator >= 0 and epsilon >= 0")]
    AdagradParameters {
        /// The initial accumulator asked for.
        initial_accumulator: f64,
        /// The epsilon asked for.
        eps: f64,
    },

    /// A learning-rate schedule no parameter server follows.
    #[error(
        "unknown learning-rate schedule {kind:?}; a parameter server follows constant, warmup_cosine or warmup_linear"
    )]
    UnknownSchedule {
        /// The name asked for.
        kind: String,
    },

    /// A learning-rate schedule that cannot be followed (refused as strata-core's
    /// `LrSchedule::validate` refuses it), naming the field that is wrong.
    #[error("{kind} learning-rate schedule: {field} {detail}")]
    InvalidSchedule {
        /// The schedule's kind: `constant`, `warmup_cosine` or `warmup_linear`.
        kind: &'static str,
        /// The field: `lr`, `peak`, `final_lr` or `total_steps`.
        field: &'static str,
        /// Its value, and what to change.
        detail: String,
    },

    /// A mode no parameter server runs.
    #[error("unknown mode {mode:?}; use async, sync or stale")]
    UnknownMode {
        /// The name asked for.
        mode: String,
    },

    /// A rate of stale pushes no parameter server applies.
    #[error("unknown stale_rate {rate:?}; use constant or inverse")]
    UnknownStaleRate {
        /// The name asked for.
        rate: String,
    },

    /// Sync mode with no workers.
    #[error("sync mode needs at least one worker")]
    SyncWithoutWorkers,

    /// Sync mode with as many backup workers as workers, or more.
    #[error(
        "{backup_workers} backup workers leave none of the {workers} workers to aggregate; use fewer backup workers"
    )]
    TooManyBackupWorkers {
        /// The workers.
        workers: u32,
        /// The backup workers.
        backup_workers: u32,
    },

    /// A variable without a name.
    #[error("a variable needs a name")]
    UnnamedVariable,

    /// A variable of a dtype other than f32.
    #[error("variable {variable} has dtype {dtype:?}; a parameter server holds f32 variables only")]
    UnsupportedDtype {
        /// The variable.
        variable: String,
        /// Its dtype.
        dtype: String,
    },

    /// A variable (or its whole variable) of more than [`MAX_VARIABLE_ELEMENTS`] elements.
    #[error("variable {variable} has shape {shape:?}, more than {MAX_VARIABLE_ELEMENTS} elements; partition it")]
    VariableTooLarge {
        /// The variable.
        variable: String,
        /// The shape.
        shape: Vec<u64>,
    },

    /// A shard numbered past its variable's number of shards.
    #[error("variable {variable} is part {part} of {num_parts}")]
    PartOutOfRange {
        /// The shard.
        variable: String,
        /// Its number.
        part: u32,
        /// The variable's number of shards.
        num_parts: u32,
    },

    /// A create request names a variable twice.
    #[error("variable {variable} is named twice")]
    NamedTwice {
        /// The variable.
        variable: String,
    },

    /// A push names a variable twice.
    #[error("variable {variable} is pushed twice in one update")]
    PushedTwice {
        /// The variable.
        variable: String,
    },

    /// A create request asks for another optimizer than the task applies.
    #[error("{task} applies {have:?}; this job asks for {want:?} (start a fresh ps task or use the same optimizer)")]
    OptimizerMismatch {
        /// The task.
        task: String,
        /// The optimizer it applies.
        have: Box<ServerOptimizer>,
        /// The optimizer asked for.
        want: Box<ServerOptimizer>,
    },

    /// A create request asks for another learning-rate schedule (or none) than the task
    /// follows.
    #[error("{task} follows the learning-rate schedule {have:?}; this job asks for {want:?} (start a fresh ps task or use the same schedule)")]
    ScheduleMismatch {
        /// The task.
        task: String,
        /// The schedule it follows (`None`: the optimizer's constant rate).
        have: Box<Option<LrSchedule>>,
        /// The schedule asked for.
        want: Box<Option<LrSchedule>>,
    },

    /// A create request asks for another rate of stale pushes than the task applies.
    #[error("{task} applies stale pushes at the {have} rate; this job asks for {want} (start a fresh ps task or use the same --stale-rate)")]
    StaleRateMismatch {
        /// The task.
        task: String,
        /// The rule it applies.
        have: StaleRate,
        /// The rule asked for.
        want: StaleRate,
    },

    /// A create request asks for another mode than the task runs.
    #[error("{task} runs in mode {have}; this job asks for {want} (start a fresh ps task or use the same mode)")]
    ModeMismatch {
        /// The task.
        task: String,
        /// Its mode.
        have: PsMode,
        /// The mode asked for.
        want: PsMode,
    },

    /// A create request describes a variable the task holds differently.
    #[error(
        "variable {} exists on {task} with shape {:?} (part {} of {}); this job creates it with shape {:?} (part {} of {})",
        want.name, have.shape, have.part, have.num_parts, want.shape, want.part, want.num_parts
    )]
    VariableMismatch {
        /// The task.
        task: String,
        /// The variable as the task holds it.
        have: Box<VariableInfo>,
        /// The variable as the request describes it.
        want: Box<VariableInfo>,
    },

    /// A push reached a task that holds no variables yet.
    #[error("{task} holds no variables yet; create them (strategy.scope) before pushing")]
    NoVariables {
        /// The task.
        task: String,
    },

    /// A push or pull names a variable the task does not hold.
    #[error("{task} holds no variable named {variable:?} (it holds {held} variables)")]
    UnknownVariable {
        /// The task.
        task: String,
        /// The name asked for.
        variable: String,
        /// How many variables the task holds.
        held: usize,
    },

    /// A push computed from a version the task has not reached.
    #[error("the push was computed from version {base}, ahead of {task}'s version {version}")]
    AheadOfTask {
        /// The task.
        task: String,
        /// The push's base version.
        base: u64,
        /// The task's version.
        version: u64,
    },

    /// Bounded staleness: a push computed from a version more than the bound behind. The
    /// message begins with `stale push` and gives the three numbers in this order (clients
    /// read them back).
    #[error("stale push: computed from version {base}, the task is at version {version}, the bound is {bound}")]
    Stale {
        /// The push's base version.
        base: u64,
        /// The task's version.
        version: u64,
        /// The mode's staleness bound.
        bound: u64,
    },

    /// A streamed push under which another update was applied: nothing of it was applied.
    #[error(
        "{task} applied another update while this push arrived (its stream stalled for over a second and lost its turn): nothing of it was applied; send it again"
    )]
    Overtaken {
        /// The task.
        task: String,
    },

    /// Sync mode: a push's round did not complete in time.
    #[error(
        "the sync round from version {base} of {task} did not complete within {timeout:?}: fewer workers pushed than it needs (is a worker down?)"
    )]
    RoundTimeout {
        /// The task.
        task: String,
        /// The round's base version.
        base: u64,
        /// How long the push waited.
        timeout: Duration,
    },

    /// Sync mode: a round completed without an answer for one of its pushes (a bug).
    #[error("the sync round from version {base} of {task} completed without recording this update")]
    RoundUnrecorded {
        /// The task.
        task: String,
        /// The round's base version.
        base: u64,
    },

    /// A pull waited for a version the task did not reach in time.
    #[error("{task} did not reach version {version} within {waited:?}")]
    VersionTimeout {
        /// The task.
        task: String,
        /// The version asked for.
        version: u64,
        /// How long the pull waited.
        waited: Duration,
    },

    /// An embedding table's description that cannot be held: its name, dim, size,
    /// initializer, shard or optimizer, naming the field to change.
    #[error("table {table}: {field} {detail}")]
    InvalidTable {
        /// The table.
        table: String,
        /// The field: `name`, `dim`, `size`, `init`, `shard`, `num_shards` or
        /// `optimizer.<parameter>`.
        field: &'static str,
        /// Its value, and what to change.
        detail: String,
    },

    /// A request that would leave a task with more than [`MAX_TABLES`] tables.
    #[error("{task} would hold {count} embedding tables, over the limit of {MAX_TABLES}; use more ps tasks")]
    TooManyTables {
        /// The task.
        task: String,
        /// How many it would hold.
        count: usize,
    },

    /// A create request names a table twice.
    #[error("table {table} is named twice")]
    TableNamedTwice {
        /// The table.
        table: String,
    },

    /// A create request describes a table the task holds differently.
    #[error("table {table} exists on {task} with another {field}; this job describes it differently (start a fresh ps task or describe the table as before)")]
    TableMismatch {
        /// The task.
        task: String,
        /// The table.
        table: String,
        /// The first field that differs: `dim`, `size`, `init`, `seed`, `shard`,
        /// `num_shards` or `optimizer`.
        field: &'static str,
    },

    /// A row pull or push names a table the task does not hold.
    #[error("{task} holds no table named {table:?} (it holds {held} tables)")]
    UnknownTable {
        /// The task.
        task: String,
        /// The name asked for.
        table: String,
        /// How many tables the task holds.
        held: usize,
    },

    /// A push carries rows of one table twice.
    #[error("table {table}: rows are pushed twice in one update; send one set of rows per table")]
    TableRowsTwice {
        /// The table.
        table: String,
    },

    /// A row pull or push of more ids (or values) than one request may carry.
    #[error("table {table}: field ids holds {ids} ids of {dim} values, over the limit of {MAX_IDS_PER_REQUEST} ids and {MAX_ROW_VALUES_PER_REQUEST} values per request; split the request")]
    TooManyIds {
        /// The table.
        table: String,
        /// The ids.
        ids: usize,
        /// The table's dim.
        dim: usize,
    },

    /// A row pull or push names an id twice.
    #[error(
        "table {table}: row id {id} appears twice in field ids; send each id once (sum the gradients of a repeated id)"
    )]
    DuplicateRowId {
        /// The table.
        table: String,
        /// The id.
        id: u64,
    },

    /// A row pull names an id outside a fixed table's rows.
    #[error("table {table}: row id {id} in field ids is outside its {rows} rows; map ids into 0..{rows} or declare the table by id space")]
    RowIdOutOfRange {
        /// The table.
        table: String,
        /// The id.
        id: u64,
        /// The table's rows.
        rows: u64,
    },

    /// A row pull names an id another shard owns.
    #[error("table {table}: row id {id} in field ids belongs to shard {owner}, not to this task's shard {shard} of {num_shards}; send it to its owner")]
    RowIdNotOwned {
        /// The table.
        table: String,
        /// The id.
        id: u64,
        /// The shard that owns it.
        owner: usize,
        /// This task's shard.
        shard: u32,
        /// The table's shards.
        num_shards: u32,
    },

    /// A push carries the gradient of a row its worker did not pull under the push's lease
    /// (or the lease was forgotten: pushed already, replaced, or lost in a restart).
    #[error("table {table}: row id {id} in field ids was not pulled under lease {lease}; pull the rows under the lease before pushing their gradients")]
    NotLeased {
        /// The table.
        table: String,
        /// The id.
        id: u64,
        /// The push's lease.
        lease: u64,
    },

    /// An update of a process's own shard ([`TableShard`](crate::TableShard)) names a row
    /// the shard does not hold: it was not read in the update.
    #[error("table {table}: row id {id} was not read in this update; read a row before applying its gradient")]
    RowNotRead {
        /// The table.
        table: String,
        /// The id.
        id: u64,
    },

    /// A push's row gradients whose length is not the ids times the table's dim.
    #[error("table {table}: field grads holds {grads} values for {ids} ids, not ids times the table's dim {dim}; send dim values per row")]
    RowWidth {
        /// The table.
        table: String,
        /// The table's dim.
        dim: usize,
        /// The ids pushed.
        ids: usize,
        /// The values pushed.
        grads: usize,
    },

    /// A pushed row gradient with a NaN or infinite element.
    #[error("table {table}: the gradient of row id {id} holds {value} at element {element}; nothing was applied (the worker's training diverged: lower the learning rate or check its data)")]
    NonFiniteRowGradient {
        /// The table.
        table: String,
        /// The row.
        id: u64,
        /// The element's index in the row.
        element: usize,
        /// The value (NaN, inf or -inf).
        value: f32,
    },

    /// An id-space table's shard that would hold more rows than its bound, with no row
    /// evictable.
    #[error("table {table} would hold {rows} rows, over its bound of {bound} rows per shard, and no more rows can be evicted; raise max_rows_per_shard, set a lower evict_after or use more shards")]
    TableFull {
        /// The table.
        table: String,
        /// Its `max_rows_per_shard`.
        bound: u64,
        /// The rows the pull needs the shard to hold.
        rows: u64,
    },

    /// A pull that would leave a task with more than [`MAX_TABLE_BYTES`] of table rows.
    #[error("table {table}: the pull would leave {task} with {bytes} bytes of table rows, over the limit of {MAX_TABLE_BYTES}; shard the tables over more ps tasks")]
    TableBytes {
        /// The task.
        task: String,
        /// The table pulled.
        table: String,
        /// The bytes the task would hold.
        bytes: u64,
    },

    /// A pull that would hold more than [`MAX_LEASED_IDS`] ids of a table under live leases.
    #[error("table {table}: {ids} row ids would be held under live leases, over the limit of {MAX_LEASED_IDS}; push (which releases a lease) before pulling more")]
    TooManyLeasedIds {
        /// The table.
        table: String,
        /// The ids that would be leased.
        ids: usize,
    },

    /// A pull from a worker name beyond the [`MAX_WORKERS`] a table keeps leases for.
    #[error("table {table} already keeps leases of {MAX_WORKERS} workers, the limit; name workers worker:<index>")]
    TooManyLeaseWorkers {
        /// The table.
        table: String,
    },

    /// The old shards given to resharding do not describe one table.
    #[error("resharding table {table}: the old shards disagree on {field}; give the snapshots of one job's ps tasks")]
    ReshardMismatch {
        /// The table.
        table: String,
        /// The field they disagree on.
        field: &'static str,
    },

    /// An old shard missing from (or given twice to) resharding.
    #[error("resharding table {table}: old shard {shard} of {num_shards} is {problem}; give every old ps task's snapshot once")]
    ReshardShards {
        /// The table.
        table: String,
        /// The old shard.
        shard: u32,
        /// The old number of shards.
        num_shards: u32,
        /// `missing` or `given twice`.
        problem: &'static str,
    },

    /// A checkpoint's table whose rows do not fit what a task may hold, or whose tensors
    /// disagree with its metadata.
    #[error("{}: table {table}: {detail}", dir.display())]
    CorruptTable {
        /// The checkpoint's directory.
        dir: PathBuf,
        /// The table.
        table: String,
        /// What is wrong.
        detail: String,
    },

    /// A checkpoint was asked of a task without a checkpoint directory.
    #[error("{task} has no checkpoint directory; start the ps task with one")]
    NoCheckpointDir {
        /// The task.
        task: String,
    },

    /// A restore from a directory that holds no checkpoint.
    #[error("{}: no checkpoint to restore (no ckpt-* directory in it)", path.display())]
    NoCheckpoint {
        /// The directory.
        path: PathBuf,
    },

    /// A checkpoint that is not a parameter server's.
    #[error("{}: not a parameter-server checkpoint (no strata.ps metadata); restore a ps task's own", dir.display())]
    NotPsCheckpoint {
        /// The checkpoint's directory.
        dir: PathBuf,
    },

    /// A parameter-server checkpoint whose metadata cannot be read.
    #[error("{}: corrupt parameter-server metadata: {source}", dir.display())]
    CorruptMetadata {
        /// The checkpoint's directory.
        dir: PathBuf,
        /// Why the metadata does not parse.
        #[source]
        source: serde_json::Error,
    },

    /// A tensor of a parameter-server checkpoint that cannot be read as f32 values.
    #[error("{}: tensor {tensor}: {source}", dir.display())]
    ReadTensor {
        /// The checkpoint's directory.
        dir: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// Why it cannot be read.
        #[source]
        source: Box<candle_core::Error>,
    },

    /// A tensor of a parameter-server checkpoint whose size is not the one its metadata gives.
    #[error("{}: tensor {tensor} has {elements} elements, the manifest says {expected}", dir.display())]
    TensorSize {
        /// The checkpoint's directory.
        dir: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// Its number of elements.
        elements: usize,
        /// The number its variable's shape gives.
        expected: usize,
    },

    /// A variable or slot that could not be made into a checkpoint tensor.
    #[error("building checkpoint tensor {tensor}: {source}")]
    BuildTensor {
        /// The tensor's name.
        tensor: String,
        /// Why.
        #[source]
        source: Box<candle_core::Error>,
    },

    /// The checkpoint's metadata could not be encoded.
    #[error("encoding checkpoint metadata: {0}")]
    EncodeMetadata(#[source] serde_json::Error),

    /// Writing or reading a checkpoint failed (strata-core's checkpoint module names the file
    /// and what to do).
    #[error("{0}")]
    Checkpoint(#[from] strata_core::Error),

    /// Resharding tables onto a shard that would hold more than [`MAX_TABLE_BYTES`] of rows.
    #[error("resharding the tables: shard {shard} of {num_shards} would hold {bytes} bytes of table rows, over the limit of {MAX_TABLE_BYTES}; restore onto more ps tasks")]
    ReshardTooLarge {
        /// The new shard.
        shard: u32,
        /// The new number of shards.
        num_shards: u32,
        /// The bytes of rows it would hold (at least).
        bytes: u64,
    },

    /// A restore of a job's checkpoint onto a place that is no ps task of a job.
    #[error("cannot restore a job's checkpoint onto ps task {shard} of {num_shards}: the index must be below the number of ps tasks, which must be 1 to {MAX_TABLE_SHARDS}")]
    JobPlace {
        /// The task's index.
        shard: u32,
        /// The job's number of ps tasks.
        num_shards: u32,
    },

    /// A restore of a job's checkpoint without this task's place in its job.
    #[error("{}: holds the checkpoints of a job's {tasks} ps tasks (ps-0, ps-1, ...); restoring them needs this task's index and its job's number of ps tasks", dir.display())]
    JobPlaceUnknown {
        /// The job's checkpoint directory.
        dir: PathBuf,
        /// The old job's ps tasks.
        tasks: usize,
    },

    /// A directory given as a job's checkpoint that holds no `ps-<i>` directory.
    #[error("{}: not a job's checkpoint directory (no ps-0, ps-1, ... directories in it)", path.display())]
    NotJobCheckpoint {
        /// The directory.
        path: PathBuf,
    },

    /// A job's checkpoint directory with a gap among its `ps-<i>` directories.
    #[error("{}: ps-{missing} is missing while ps-{present} is there; restore from a directory holding the checkpoints of every ps task of the job", dir.display())]
    JobTaskMissing {
        /// The job's checkpoint directory.
        dir: PathBuf,
        /// The index of a missing task.
        missing: usize,
        /// The index of a task present after it.
        present: usize,
    },

    /// A job's checkpoint directory whose `ps-<i>` directories are not those of the job that
    /// wrote the checkpoints.
    #[error("{}: holds {tasks} ps task directories (ps-0 to ps-{}), but their checkpoints of step {step} were written by a job of {written_by} ps tasks; restore from a directory holding exactly that job's ps-<i> directories", dir.display(), tasks.saturating_sub(1))]
    JobSize {
        /// The job's checkpoint directory.
        dir: PathBuf,
        /// The `ps-<i>` directories found.
        tasks: usize,
        /// The step restored.
        step: u64,
        /// The ps tasks of the job that wrote the checkpoints.
        written_by: u32,
    },

    /// A `ps-<i>` directory holding another task's checkpoint.
    #[error("{}: holds the checkpoint of {task}, not of {expected}; keep each ps task's checkpoints under ps-<its index>", dir.display())]
    JobTaskName {
        /// The checkpoint's directory.
        dir: PathBuf,
        /// The task the directory's name says.
        expected: String,
        /// The task the checkpoint says.
        task: String,
    },

    /// A job's checkpoint whose ps tasks have no checkpoint step in common.
    #[error("{}: the ps tasks' checkpoints have no step in common (the latest: {}); restore from checkpoints of one job taken at the same step", dir.display(), latest_steps(latest))]
    NoCommonStep {
        /// The job's checkpoint directory.
        dir: PathBuf,
        /// Each old task's latest step, by index.
        latest: Vec<u64>,
    },

    /// A job's checkpoint asked for at a step that not every old ps task has a checkpoint of.
    #[error("{}: ps-{task} has no checkpoint of step {step} (its latest: {}); restore a step every ps task checkpointed", dir.display(), latest.map_or_else(|| "none".to_string(), |s| s.to_string()))]
    StepNotInJob {
        /// The job's checkpoint directory.
        dir: PathBuf,
        /// The step asked for.
        step: u64,
        /// The first old task without it.
        task: usize,
        /// That task's latest step.
        latest: Option<u64>,
    },

    /// The old tasks of a job's checkpoint that disagree on what every task of a job shares.
    #[error("{}: ps-{task}'s checkpoint has another {field} than ps-0's; restore the checkpoints of one job", dir.display())]
    JobMismatch {
        /// The job's checkpoint directory.
        dir: PathBuf,
        /// The old task that disagrees with ps-0.
        task: usize,
        /// `optimizer`, `schedule` or `mode`.
        field: &'static str,
    },

    /// A job's checkpoint whose parts of a dense variable do not tile it.
    #[error("the job's checkpoint holds variable {variable} from row {row} {problem}; restore the checkpoints of every ps task of one job")]
    PoolRows {
        /// The whole variable.
        variable: String,
        /// The row where the problem is.
        row: u64,
        /// `twice`, `in a part of another shape` or `nowhere`.
        problem: &'static str,
    },

    /// A job's checkpoint whose dense variables are more than a task restores from.
    #[error("the job's checkpoint holds {parts} dense variable parts of {bytes} bytes (values and optimizer slots), over the {MAX_VARIABLES} parts and {MAX_POOL_BYTES} bytes a restoring ps task holds")]
    PoolTooLarge {
        /// The parts.
        parts: usize,
        /// Their bytes.
        bytes: u64,
    },

    /// Creating, on a task restored from a job's checkpoint, a variable the checkpoint lacks.
    #[error("{task} was restored from a job's checkpoint, which has no variable {variable}; create the model the checkpoint was written for")]
    NotInCheckpoint {
        /// The task.
        task: String,
        /// The variable (its whole name).
        variable: String,
    },

    /// Creating, on a task restored from a job's checkpoint, a variable of another shape.
    #[error("{task} was restored from a job's checkpoint, which holds variable {variable} of shape {have:?}, not {want:?}; create the model the checkpoint was written for")]
    CheckpointShape {
        /// The task.
        task: String,
        /// The variable (its whole name).
        variable: String,
        /// Its shape in the checkpoint.
        have: Vec<usize>,
        /// The shape asked for.
        want: Vec<usize>,
    },

    /// Creating a variable on a task restored from a job's checkpoint after it released the
    /// checkpoint's variables (at its first applied update).
    #[error("{task} released its job checkpoint's variables when it applied its first update, so {variable} cannot be created from them; create every variable before training starts")]
    PoolReleased {
        /// The task.
        task: String,
        /// The variable.
        variable: String,
    },
}

/// `ps-0 at 40, ps-1 at 30`.
fn latest_steps(latest: &[u64]) -> String {
    let steps: Vec<String> = latest.iter().enumerate().map(|(i, s)| format!("ps-{i} at {s}")).collect();
    steps.join(", ")
}

impl Error {
    /// What kind of failure this is (the status an RPC layer answers with).
    pub fn kind(&self) -> ErrorKind {
        use Error::*;
        match self {
            ChunkTooLarge { .. }
            | ChunkNotWholeElements { .. }
            | ChunkTooManyElements { .. }
            | ChunkNotWholeHalfElements { .. }
            | UnknownWireFormat { .. }
            | UnknownChunkVariable { .. }
            | ChunkOutOfOrder { .. }
            | Overrun { .. }
            | Incomplete { .. }
            | UnknownOptimizer { .. }
            | UnknownSchedule { .. }
            | InvalidSchedule { .. }
            | NonFiniteOptimizer { .. }
            | LearningRate { .. }
            | Momentum { .. }
            | Beta { .. }
            | AdamWParameters { .. }
            | AdagradParameters { .. }
            | UnknownMode { .. }
            | UnknownStaleRate { .. }
            | SyncWithoutWorkers
            | TooManyBackupWorkers { .. }
            | UnnamedVariable
            | UnsupportedDtype { .. }
            | VariableTooLarge { .. }
            | PartOutOfRange { .. }
            | NamedTwice { .. }
            | PushedTwice { .. }
            | AheadOfTask { .. }
            | NameTooLong { .. }
            | TooManyVariables { .. }
            | TaskTooLarge { .. }
            | RankTooLarge { .. }
            | ShardShape { .. }
            | ShardRows { .. }
            | NonFiniteGradient { .. }
            | NonFiniteValue { .. }
            | LiveWorkers { .. }
            | TooManyWorkers { .. }
            | TooManyWorkerNames { .. }
            | InvalidTable { .. }
            | TooManyTables { .. }
            | TableNamedTwice { .. }
            | TableRowsTwice { .. }
            | TooManyIds { .. }
            | DuplicateRowId { .. }
            | RowIdOutOfRange { .. }
            | RowIdNotOwned { .. }
            | NotLeased { .. }
            | RowNotRead { .. }
            | RowWidth { .. }
            | NonFiniteRowGradient { .. }
            | TooManyLeaseWorkers { .. }
            | ReshardMismatch { .. }
            | ReshardShards { .. }
            | JobPlace { .. } => ErrorKind::InvalidArgument,
            OutOfMemory { .. }
            | TableFull { .. }
            | TableBytes { .. }
            | TooManyLeasedIds { .. }
            | ReshardTooLarge { .. }
            | PoolTooLarge { .. } => ErrorKind::ResourceExhausted,
            OptimizerMismatch { .. }
            | ScheduleMismatch { .. }
            | StaleRateMismatch { .. }
            | ModeMismatch { .. }
            | VariableMismatch { .. }
            | TableMismatch { .. }
            | NoVariables { .. }
            | Stale { .. }
            | NoCheckpointDir { .. }
            | JobPlaceUnknown { .. }
            | NotInCheckpoint { .. }
            | CheckpointShape { .. }
            | PoolReleased { .. } => ErrorKind::FailedPrecondition,
            UnknownVariable { .. } | UnknownTable { .. } => ErrorKind::NotFound,
            Overtaken { .. } => ErrorKind::Aborted,
            RoundTimeout { .. } | VersionTimeout { .. } => ErrorKind::DeadlineExceeded,
            RoundUnrecorded { .. }
            | NoCheckpoint { .. }
            | NotPsCheckpoint { .. }
            | CorruptMetadata { .. }
            | ReadTensor { .. }
            | TensorSize { .. }
            | BuildTensor { .. }
            | EncodeMetadata(_)
            | CorruptTable { .. }
            | Checkpoint(_)
            | NotJobCheckpoint { .. }
            | JobTaskMissing { .. }
            | JobSize { .. }
            | JobTaskName { .. }
            | NoCommonStep { .. }
            | StepNotInJob { .. }
            | JobMismatch { .. }
            | PoolRows { .. } => ErrorKind::Internal,
        }
    }
}

/// The result type of strata-ps.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_lower_case_without_a_trailing_period_and_kinds_are_sorted() {
        let cases = [
            (Error::ChunkTooLarge { bytes: 5 << 20 }, ErrorKind::InvalidArgument),
            (Error::Stale { base: 1, version: 5, bound: 2 }, ErrorKind::FailedPrecondition),
            (Error::UnknownVariable { task: "ps:0".into(), variable: "nope".into(), held: 2 }, ErrorKind::NotFound),
            (Error::Overtaken { task: "ps:0".into() }, ErrorKind::Aborted),
            (
                Error::RoundTimeout { task: "ps:0".into(), base: 3, timeout: Duration::from_secs(1) },
                ErrorKind::DeadlineExceeded,
            ),
            (Error::NoCheckpoint { path: "/tmp/x".into() }, ErrorKind::Internal),
            (Error::NameTooLong { what: "worker", bytes: 10240 }, ErrorKind::InvalidArgument),
            (Error::LiveWorkers { live: 0, max: 4 }, ErrorKind::InvalidArgument),
            (
                Error::NonFiniteGradient { variable: "w".into(), element: 3, value: f32::NAN },
                ErrorKind::InvalidArgument,
            ),
            (Error::OutOfMemory { task: "ps:0".into(), bytes: 1 << 40, what: "values" }, ErrorKind::ResourceExhausted),
        ];
        for (e, kind) in cases {
            assert_eq!(e.kind(), kind, "{e}");
            let m = e.to_string();
            assert!(!m.ends_with('.'), "{m}");
            assert!(!m.starts_with(|c: char| c.is_uppercase()), "{m}");
        }
        let long = Error::NameTooLong { what: "worker", bytes: 10240 }.to_string();
        assert_eq!(long, "a worker name of 10240 bytes is over the limit of 256 bytes; use a shorter name");
        let nan = Error::NonFiniteGradient { variable: "w".into(), element: 3, value: f32::NAN }.to_string();
        assert!(nan.starts_with("the gradient of variable w holds NaN at element 3; nothing was applied"), "{nan}");
        let stale = Error::Stale { base: 1, version: 5, bound: 2 }.to_string();
        assert_eq!(stale, "stale push: computed from version 1, the task is at version 5, the bound is 2");
    }
}
