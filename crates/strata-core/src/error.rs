//! The one error type of `strata-core`.

use std::time::Duration;

/// Errors from strata-core. Messages are lower case, without a trailing period, and say what
/// to change where the cause is the caller's input.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A device string that is not of TensorFlow's form.
    #[error("invalid device spec {spec:?}: {reason}")]
    InvalidDeviceSpec {
        /// The string given.
        spec: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A device list (visible devices, a strategy's devices) that cannot be used.
    #[error("invalid device list: {0}")]
    InvalidDeviceList(String),

    /// A device the caller named does not exist or is not visible.
    #[error("unknown device {0}")]
    UnknownDevice(String),

    /// A memory policy or limit that cannot be satisfied.
    #[error("invalid memory configuration: {0}")]
    InvalidMemoryConfig(String),

    /// A strategy needs at least one replica.
    #[error("a strategy needs at least one replica; got 0")]
    ZeroReplicas,

    /// Shapes that must agree across replicas (or with a variable) do not.
    #[error("shape mismatch in {op}: {detail}")]
    ShapeMismatch {
        /// The operation.
        op: String,
        /// Which shapes disagree.
        detail: String,
    },

    /// Replicas issued different collectives at the same point.
    #[error("collective order mismatch at collective #{seq}: {detail}")]
    CollectiveMismatch {
        /// The collective's number in the step.
        seq: u64,
        /// What each replica called.
        detail: String,
    },

    /// A replica left the step while its peers waited in a collective.
    #[error("replica {replica} left the step before collective #{seq} ({op}) that replica {waiting} is waiting in")]
    ReplicaLeft {
        /// The replica that left.
        replica: usize,
        /// A replica still waiting for it.
        waiting: usize,
        /// The collective's number in the step.
        seq: u64,
        /// The collective.
        op: String,
    },

    /// A collective did not complete within its deadline.
    #[error("collective #{seq} ({op}) timed out after {timeout:?} on replica {replica}; {arrived} of {expected} replicas arrived")]
    CollectiveTimeout {
        /// The collective's number in the step.
        seq: u64,
        /// The collective.
        op: String,
        /// The replica whose wait timed out.
        replica: usize,
        /// The deadline.
        timeout: Duration,
        /// Replicas that reached the collective.
        arrived: usize,
        /// Replicas taking part.
        expected: usize,
    },

    /// A value or variable was used with a strategy that did not create it, or outside any scope.
    #[error("{0}")]
    Scope(String),

    /// Two different strategies were mixed.
    #[error("mixing strategies: {0}")]
    MixedStrategies(String),

    /// A replica's step failed; the other replicas were told to stop.
    #[error("replica {replica} failed: {source}")]
    Replica {
        /// The replica.
        replica: usize,
        /// Its error.
        #[source]
        source: Box<Error>,
    },

    /// A replica thread panicked.
    #[error("replica {replica} panicked: {message}")]
    ReplicaPanicked {
        /// The replica.
        replica: usize,
        /// The panic's message.
        message: String,
    },

    /// A variable name or pattern (to freeze, say) that matches no variable of the model.
    #[error("no variable matches {pattern:?}; the model's variables are: {variables}")]
    NoSuchVariable {
        /// The name or pattern given.
        pattern: String,
        /// The model's variables, listed.
        variables: String,
    },

    /// A ZeRO stage 3 unit a program named (a prefix of variable names) that names no trainable
    /// variable of the model, or an empty one.
    #[error("zero stage 3's unit {unit:?} names no trainable variable of the model (its variables are named like {named_like}); give a prefix of their names, such as {example:?}")]
    ZeroUnit {
        /// The unit given.
        unit: String,
        /// The first few trainable variables' names, listed.
        named_like: String,
        /// A unit that would name some: the first variable's default unit.
        example: String,
    },

    /// A learning-rate schedule that cannot be followed.
    #[error("{schedule} learning-rate schedule: {detail}")]
    InvalidSchedule {
        /// The schedule.
        schedule: String,
        /// What is wrong, and what to change.
        detail: String,
    },

    /// An optimizer setting (clipping norm, accumulation) out of its range.
    #[error("{setting} of {value}: {expected}")]
    OptimizerSetting {
        /// The setting.
        setting: &'static str,
        /// The value given.
        value: String,
        /// The range it must be in.
        expected: &'static str,
    },

    /// A ZeRO stage asked of a strategy, an optimizer or a job that cannot run it.
    #[error("zero stage {stage} with {what}: {fix}")]
    ZeroStage {
        /// The stage asked for.
        stage: u8,
        /// What cannot run it.
        what: String,
        /// What to change.
        fix: &'static str,
    },

    /// A replica's model state (parameters, gradients, optimizer state) does not fit its
    /// device's `memory_limit` at the ZeRO stage asked for.
    #[error(transparent)]
    MemoryLimit(Box<MemoryLimitExceeded>),

    /// What a replica held at once in a step (model state and activations, counted) exceeded
    /// its device's `memory_limit`: the step is not applied.
    #[error(transparent)]
    MemoryLimitInStep(Box<MemoryLimitInStep>),

    /// The parts of one batch disagree on its number of examples (its first axis).
    #[error("the parts of a batch disagree on its examples: {first} has {first_rows} rows but {other} has {other_rows}; give every part of a batch one row per example")]
    BatchRows {
        /// The batch's first part.
        first: String,
        /// Its rows.
        first_rows: usize,
        /// A part with another number of rows.
        other: String,
        /// Its rows.
        other_rows: usize,
    },

    /// A file of fixed-size records whose size is not a whole number of records.
    #[error("{path} has {size} bytes, not a whole number of records of {record} bytes; write whole records or give the record's size")]
    RecordFile {
        /// The file.
        path: String,
        /// Its size in bytes.
        size: u64,
        /// The record's size in bytes.
        record: u64,
    },

    /// Fewer files than workers to hand each worker whole files.
    #[error("{files} files for {workers} workers under the file sharding policy: each worker needs a whole file; split the dataset into at least {workers} files or shard by data")]
    TooFewFiles {
        /// The dataset's files.
        files: usize,
        /// The workers.
        workers: usize,
    },

    /// Bad dataset input (sizes, batch sizes).
    #[error("dataset: {0}")]
    Dataset(String),

    /// An invalid argument, with what to change.
    #[error("{0}")]
    InvalidArgument(String),

    /// A cluster configuration (TF_CONFIG, Slurm variables, a cluster spec) that cannot be used;
    /// the message names the field and what to change.
    #[error("invalid cluster configuration: {0}")]
    InvalidCluster(String),

    /// A cross-worker failure: a lost task, a collective that failed or timed out between
    /// workers, a peer that refused this worker. The message names the task, the collective
    /// and the step.
    #[error("{0}")]
    Cluster(String),

    /// A peer task (a parameter server, a worker) could not be reached; the operation may
    /// succeed when retried once the task is back.
    #[error("{0}")]
    Unavailable(String),

    /// A parameter server refused an update computed from values too old (bounded staleness);
    /// pull fresh values and compute it again.
    #[error("{0}")]
    Stale(String),

    /// A checkpoint that cannot be written or read (torn, corrupt, missing); the message names
    /// the file.
    #[error("checkpoint: {0}")]
    Checkpoint(String),

    /// An id outside a fixed embedding table's rows, or a negative one.
    #[error("id {id} is outside embedding table {table:?}'s {rows} rows; map ids into 0..{rows} or declare the table by id space")]
    EmbeddingId {
        /// The table.
        table: String,
        /// The id given.
        id: i64,
        /// The table's rows.
        rows: u64,
    },

    /// An embedding table declared by id space, under a strategy that keeps every variable
    /// whole (a table without a row count cannot be one tensor).
    #[error("embedding table {table:?} is declared by id space, which {strategy} cannot keep as a whole variable; declare rows, or train it on parameter servers")]
    IdSpaceTable {
        /// The table.
        table: String,
        /// The strategy whose scope built it.
        strategy: String,
    },

    /// An embedding table store ([`TableStore`](crate::embedding::TableStore)) that cannot
    /// serve the strategy a model declaring tables is built under.
    #[error("{store} cannot serve {strategy}: {why}")]
    TableStoreStrategy {
        /// The store.
        store: &'static str,
        /// The strategy whose scope built the model.
        strategy: String,
        /// Why, and what to do instead.
        why: &'static str,
    },

    /// An id-space embedding table's shard that would hold more rows than its bound, with no
    /// row that may be evicted; nothing changed.
    #[error("embedding table {table:?} would hold {rows} rows, over its bound of {bound} rows per shard, and no more rows can be evicted; raise max_rows_per_shard, set a lower evict_after or use more shards")]
    TableFull {
        /// The table.
        table: String,
        /// Its `max_rows_per_shard`.
        bound: u64,
        /// The rows the shard would need to hold.
        rows: u64,
    },

    /// An error from candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    /// An I/O error, with the path or operation it concerns.
    #[error("{context}: {source}")]
    Io {
        /// The path or operation.
        context: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// The result type of strata-core.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Whether retrying the operation later may succeed ([`Error::Unavailable`],
    /// [`Error::Stale`]).
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::Unavailable(_) | Error::Stale(_))
    }

    /// An I/O error with context (usually the path).
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io { context: context.into(), source }
    }
}

/// What [`Error::MemoryLimit`] carries: a replica's bytes at a stage, and the stage that fits.
#[derive(Debug, thiserror::Error)]
#[error(
    "replica {replica} on {device} needs {} at zero stage {stage} (parameters {}, gradients {}, optimizer state {}), over its memory_limit of {}; {}",
    crate::units::format_bytes(params + grads + state),
    crate::units::format_bytes(*params),
    crate::units::format_bytes(*grads),
    crate::units::format_bytes(*state),
    crate::units::format_bytes(*limit),
    match fits {
        Some((s, bytes)) => format!("zero stage {s} needs {}: use it (--zero-stage {s})", crate::units::format_bytes(*bytes)),
        None => format!("no zero stage fits (stage {} needs {}): raise memory_limit or add replicas", least.0, crate::units::format_bytes(least.1)),
    }
)]
pub struct MemoryLimitExceeded {
    /// The replica (on this worker).
    pub replica: usize,
    /// Its device's spec (`/job:localhost/replica:0/task:0/device:CPU:0`).
    pub device: String,
    /// The stage the optimizer runs: the stage asked for, or stage 1 where stage 0 was asked
    /// for and mirrored replicas on one machine's CPU step shards
    /// ([`StrategyOptions::host_shards`](crate::StrategyOptions::host_shards)).
    pub stage: u8,
    /// Its parameters' bytes (every variable's copy).
    pub params: u64,
    /// Its gradients' bytes at that stage.
    pub grads: u64,
    /// Its optimizer state's bytes at that stage.
    pub state: u64,
    /// The device's limit.
    pub limit: u64,
    /// The lowest stage that fits, and its bytes.
    pub fits: Option<(u8, u64)>,
    /// The stage that needs the least, and its bytes.
    pub least: (u8, u64),
}

/// What [`Error::MemoryLimitInStep`] carries: what a replica held in a step, counted, and the
/// stage that would hold it.
#[derive(Debug, thiserror::Error)]
#[error(
    "replica {replica} on {device} held {} in step {step} at zero stage {stage} (parameters {}, gradients {}, optimizer state {}, activations {}), over its memory_limit of {}; {}",
    crate::units::format_bytes(held.total()),
    crate::units::format_bytes(held.parameters),
    crate::units::format_bytes(held.gradients),
    crate::units::format_bytes(held.optimizer_state),
    crate::units::format_bytes(held.activations),
    crate::units::format_bytes(*limit),
    match fits {
        Some((s, bytes)) => format!("zero stage {s} would hold about {} with these activations: use it (--zero-stage {s})", crate::units::format_bytes(*bytes)),
        None => "no zero stage holds these activations too: recompute them (strata::recompute, --recompute), give each replica fewer examples, or raise memory_limit".to_string(),
    }
)]
pub struct MemoryLimitInStep {
    /// The replica (on this worker).
    pub replica: usize,
    /// Its device's spec.
    pub device: String,
    /// The training step (counted from 1 by this optimizer's copy).
    pub step: u64,
    /// The stage it ran.
    pub stage: u8,
    /// What it held at once.
    pub held: crate::Footprint,
    /// The device's limit.
    pub limit: u64,
    /// A higher stage whose model state (computed) and these activations fit, and its bytes.
    pub fits: Option<(u8, u64)>,
}
