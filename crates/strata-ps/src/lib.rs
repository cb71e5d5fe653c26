//! # strata-ps
//!
//! The semantics of a parameter-server task of a `ParameterServerStrategy` job, as plain Rust:
//! what one task holds ([`State`]: variables or shards of them, their optimizer slots and
//! versions), the rules by which pushes change it, and its checkpoints. No RPC: strata-transport
//! carries requests to a [`State`] over gRPC and its answers and [`Error`]s back (each error's
//! [`ErrorKind`] is the status it answers with), and `strata compare --simulate` applies
//! updates with the same [`ServerOptimizer`].
//!
//! ```
//! use bytes::Bytes;
//! use strata_ps::{Chunk, CreateHeader, PsMode, PushDecision, PushHeader, PushReply, ServerOptimizer, State, UpdateId, VariableInfo};
//!
//! let f32s = |x: &[f32]| Bytes::copy_from_slice(bytemuck::cast_slice(x));
//! let mut task = State::new("ps:0".into(), None);
//! let header = CreateHeader {
//!     variables: vec![VariableInfo::whole("w", vec![2, 2])],
//!     optimizer: ServerOptimizer::Sgd { lr: 0.5 },
//!     schedule: None,
//!     stale_rate: strata_ps::StaleRate::Constant,
//!     mode: PsMode::Async,
//!     wire_format: strata_ps::WireFormat::F32,
//!     tables: Vec::new(),
//! };
//! task.create(&header, &[Chunk { var: 0, offset: 0, pieces: vec![f32s(&[1.0, 2.0, 3.0, 4.0])] }])?;
//! let push = PushHeader {
//!     id: UpdateId { worker: "worker:0".into(), client: "worker:0".into(), step: 0, seq: 0 },
//!     base_version: 0,
//!     variables: vec!["w".into()],
//!     rows: Vec::new(),
//! };
//! let grads = [Chunk { var: 0, offset: 0, pieces: vec![f32s(&[2.0; 4])] }];
//! assert!(matches!(task.push(&push, &grads)?, PushDecision::Done(PushReply::Applied { version: 1, duplicate: false })));
//! // The same update again is answered from the applied-update table and changes nothing.
//! assert!(matches!(task.push(&push, &grads)?, PushDecision::Done(PushReply::Applied { version: 1, duplicate: true })));
//! let pulled = task.pull(&[])?;
//! assert_eq!(pulled.chunks[0].data, f32s(&[0.0, 1.0, 2.0, 3.0]));
//! # Ok::<(), strata_ps::Error>(())
//! ```
//!
//! Semantics:
//!
//! - **Chunks.** Tensors travel as little-endian f32 [`Chunk`]s of at most [`MAX_CHUNK_BYTES`],
//!   which must cover each variable of a request exactly once, in order. On the wire a push or
//!   a pull may carry 16-bit elements instead ([`WireFormat`]); the RPC layer decodes a 16-bit
//!   chunk to f32 exactly ([`decode_half`]) before a [`State`] sees it, and encodes pulled
//!   values rounding to nearest even ([`encode_half_bytes`]): a task holds and applies f32.
//! - **Validation first.** Every request is validated completely (names, sizes, coverage,
//!   versions, finite values) before anything changes; a refused request changes nothing and
//!   is not recorded, so it can be corrected and sent again. Every size a request can make a
//!   task allocate or loop over has a limit ([`limits`]); memory a request gets is reserved
//!   fallibly, so a task that cannot have it refuses the request and serves on.
//! - **Finite values only.** A pushed gradient (or an initial value) with a NaN or infinite
//!   element is refused ([`Error::NonFiniteGradient`]), never applied: one diverged worker
//!   would otherwise turn every variable into NaN.
//! - **Versions.** Every variable counts the updates applied to it; the task's version counts
//!   its applies (one per push in async and stale modes, one per round in sync mode).
//! - **Learning-rate schedules.** A task may follow an [`LrSchedule`] ([`CreateHeader::schedule`]):
//!   its update number `n`, the task's version before the update, is applied at
//!   `schedule.at(n)` instead of the optimizer's constant rate.
//! - **Exactly once.** A push is identified by its [`UpdateId`]; a retry of an update already
//!   taken gets the first answer again, marked `duplicate`, and changes nothing.
//! - **Modes.** [`PsMode::Async`] applies each push as it arrives; [`PsMode::Sync`] averages one
//!   push per worker per round (the first `workers - backup_workers` of them, summed in update
//!   order so the mean does not depend on arrival order; later ones, and pushes computed from an
//!   older version, are dropped); [`PsMode::Stale`] refuses a push computed from a version more
//!   than the bound behind ([`Error::Stale`]).
//! - **Streamed pushes.** In async and stale modes a large push can be applied while it
//!   arrives ([`State::begin_stream`], [`Streamed::apply`] per chunk, [`State::finish_stream`]):
//!   each chunk updates the variables out of place, into spare buffers, and the new buffers are
//!   swapped in at the end, so the push is still applied whole or not at all and a pull never
//!   sees part of it. If another update was applied meanwhile, nothing of the streamed push is
//!   applied and it is refused ([`Error::Overtaken`]) for the client to send again.
//!   A push carrying table rows is never streamed: it is collected and validated whole.
//! - **Tables.** Besides dense variables a task may hold shards of embedding tables
//!   ([`TableInfo`], in [`CreateHeader::tables`]; strata-core's `embedding` vocabulary): a
//!   fixed table's shard holds a contiguous block of its rows, an id-space table's shard the
//!   ids it owns, and each table steps its rows with its own [`RowOptimizer`] (SGD, Adagrad,
//!   FTRL, LazyAdam; under a schedule its rate is scaled by the schedule's shape). Rows are
//!   created when first pulled ([`State::pull_rows`]), from their initial values, so a shard
//!   costs memory only for the rows seen; an id-space shard over its `max_rows_per_shard`
//!   evicts the rows unseen for more than `evict_after` updates, least recently seen first,
//!   or refuses the pull ([`Error::TableFull`]). A pull records a lease (worker, number) of
//!   the ids pulled, which pins those rows; a push carries row gradients
//!   ([`PushHeader::rows`]) only for ids pulled under its lease, and dense chunks and rows
//!   of one push are one update (validated whole, counted once, exactly once under retry).
//!   The lease is released when the update is applied or dropped; a worker keeps at most
//!   [`limits::MAX_LEASES_PER_WORKER`] leases per table, the oldest forgotten. In sync mode a
//!   round steps each touched row once by the mean of its gradients over the round's pushes.
//!   Checkpoints hold the rows created (values, slots, when last seen), and
//!   [`reshard_tables`] moves the rows of every old shard to a new number of shards, bit for
//!   bit. Leases are not checkpointed: after a restore, workers pull before they push rows.
//! - **Large pushes** collected whole (4 MiB and more) are applied on two threads.
//! - **Checkpoints** ([`write_snapshot`], [`read_snapshot`]) hold the values, the optimizer
//!   slots, the versions, the counters, the applied-update table and the tables' rows, in
//!   strata-core's checkpoint format. A whole job's checkpoints (one directory per ps task,
//!   `ps-<i>`) restore onto task `k` of a job of any number of tasks
//!   ([`read_job_checkpoint`], [`State::restore_job`]): the tables resharded, the dense
//!   variables in a [`RestorePool`] that creation draws from, whatever their new placement and
//!   split.

// The facade (the strata crate) re-exports this crate's items: every public one is documented.
#![warn(missing_docs)]

mod checkpoint;
mod checks;
mod chunk;
mod error;
pub mod limits;
mod optimizer;
mod pool;
mod restore;
#[cfg(test)]
mod restore_tests;
mod row_optimizer;
mod shard;
mod slab;
#[cfg(test)]
mod stale_rate_tests;
mod state;
mod table;
#[cfg(test)]
mod table_tests;
mod types;

pub use checkpoint::{
    checkpoint_holds_variables, read_snapshot, write_job_snapshot, write_snapshot, PsMeta, ScheduleMeta, TableMeta,
    META_KEY, PS_META_FORMAT, VARIABLES_FILE,
};
pub use checks::{check_chunk_len, check_chunk_len_in, check_name, check_schedule};
pub use chunk::{
    copy_f32s, decode_half, encode_half, encode_half_bytes, extend_f32s, first_non_finite, Chunk, ValueChunk,
};
pub use error::{Error, ErrorKind, RequestKind, Result};
pub use limits::{MAX_CHUNK_BYTES, MAX_CHUNK_ELEMENTS, MAX_VARIABLE_ELEMENTS};
pub use optimizer::{schedule_kind, ServerOptimizer};
pub use pool::RestorePool;
pub use restore::{job_checkpoint_tasks, job_task_dir, read_job_checkpoint, read_job_checkpoint_at, JobRestore};
pub use row_optimizer::RowOptimizer;
pub use shard::TableShard;
pub use state::{
    Answer, Counters, PushDecision, Snapshot, SnapshotVariable, State, Streamed, UpdateKey, MAX_REMEMBERED_UPDATES,
};
/// The learning-rate schedules a task can follow (strata-core's).
pub use strata_core::optim::schedule::LrSchedule;
pub use table::{reshard_tables, TableRows};
pub use types::{
    CreateHeader, CreateOutcome, PsMode, PsStatus, PullResult, PushHeader, PushOutcome, PushReply, RowGrads, RowPull,
    RowPullResult, StaleRate, TableInfo, TableStatus, UpdateId, VariableInfo, WireFormat,
};
