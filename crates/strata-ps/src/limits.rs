//! What one request may ask of a parameter-server task. Every size a request makes a task
//! allocate or loop over is checked against one of these before it is used; a request over a
//! limit is refused ([`ErrorKind::InvalidArgument`](crate::ErrorKind), the limit in the
//! message) and changes nothing. Memory a request does get is reserved fallibly: a task that
//! cannot have it answers [`ErrorKind::ResourceExhausted`](crate::ErrorKind) and serves on.

/// The longest name (of a variable, a worker, a client, an optimizer, a mode, a dtype) a task
/// accepts, in bytes.
pub const MAX_NAME_BYTES: usize = 256;

/// The most variables (or shards) one task holds: far more than a model has layers, few enough
/// that a task's tables stay small.
pub const MAX_VARIABLES: usize = 1 << 16;

/// The most axes a variable's shape has.
pub const MAX_RANK: usize = 32;

/// The most bytes of f32 values (its variables, not counting optimizer slots) one task holds:
/// 16 GiB. A larger model is partitioned over more ps tasks.
pub const MAX_TASK_BYTES: u64 = 16 << 30;

/// The most bytes of dense variables, values and optimizer slots together, a task restored
/// from a whole job's checkpoint holds for the coordinator to create (its restore pool: every
/// old task's variables, until the task applies its first update): 64 GiB, a model whose
/// values fill [`MAX_TASK_BYTES`] with AdamW's two slots and some room.
pub const MAX_POOL_BYTES: u64 = 64 << 30;

/// The most workers a job has: the largest sync round and live-worker count, and the most
/// distinct worker names a task counts pushes for.
pub const MAX_WORKERS: u32 = 1 << 16;

/// The most payload bytes (f32 elements times 4) one chunk carries.
pub const MAX_CHUNK_BYTES: usize = 1 << 20;

/// The most f32 elements one chunk carries.
pub const MAX_CHUNK_ELEMENTS: usize = MAX_CHUNK_BYTES / 4;

/// The largest variable (in elements) a task accepts.
pub const MAX_VARIABLE_ELEMENTS: usize = 1 << 31;

/// The most embedding tables (shards of them) one task holds.
pub const MAX_TABLES: usize = 1 << 10;

/// The most ids one row pull or one table's rows of a push carries.
pub const MAX_IDS_PER_REQUEST: usize = 1 << 20;

/// The most f32 values (ids times the table's dim) one row pull returns or one table's rows of
/// a push carry: 1 GiB.
pub const MAX_ROW_VALUES_PER_REQUEST: usize = 1 << 28;

/// The most bytes of embedding-table rows (values and optimizer slots) one task holds: 32 GiB.
/// A pull that would create rows beyond it is refused
/// ([`ErrorKind::ResourceExhausted`](crate::ErrorKind)).
pub const MAX_TABLE_BYTES: u64 = 32 << 30;

/// The most shards a table may have.
pub const MAX_TABLE_SHARDS: u32 = 1 << 16;

/// The leases a task keeps per worker and table: a fifth pull under a new lease forgets the
/// worker's oldest one (its rows are no longer pinned, and a push under it is refused).
pub const MAX_LEASES_PER_WORKER: usize = 4;

/// The most row ids one table holds under live leases (all workers together): 128 MiB of ids.
/// A pull over it is refused ([`ErrorKind::ResourceExhausted`](crate::ErrorKind)) until
/// workers push (which releases their leases).
pub const MAX_LEASED_IDS: usize = 1 << 24;
