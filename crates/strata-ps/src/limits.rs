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

/// The most workers a job has: the largest sync round and live-worker count, and the most
/// distinct worker names a task counts pushes for.
pub const MAX_WORKERS: u32 = 1 << 16;

/// The most payload bytes (f32 elements times 4) one chunk carries.
pub const MAX_CHUNK_BYTES: usize = 1 << 20;

/// The most f32 elements one chunk carries.
pub const MAX_CHUNK_ELEMENTS: usize = MAX_CHUNK_BYTES / 4;

/// The largest variable (in elements) a task accepts.
pub const MAX_VARIABLE_ELEMENTS: usize = 1 << 31;
