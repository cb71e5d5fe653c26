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
//! The semantics are strata-ps' ([`strata_ps`]: the task's state, the modes, exactly-once,
//! the optimizers, checkpoints), plain Rust without RPC; this module carries them over gRPC and
//! re-exports their types. `convert` is the one place where the protocol's messages become
//! strata-ps' types and back, and where a [`strata_ps::Error`] becomes a gRPC status (by its
//! [`ErrorKind`](strata_ps::ErrorKind)); the protocol's specs of an optimizer, a mode and a
//! variable are [`ProtoSpec`].
//!
//! Semantics (the proto, `proto/strata/v1/ps.proto`, is the reference):
//!
//! - **Chunks.** Tensors travel as little-endian f32 chunks of at most [`MAX_CHUNK_BYTES`] over
//!   streams, never as one message; a larger chunk is refused with `INVALID_ARGUMENT`. `Push`
//!   and `Pull` are served and called below tonic's codec: the messages on the wire are the
//!   proto's, so any gRPC client can call them, but tensor bytes are neither reassembled into a
//!   decode buffer nor encoded into an encode buffer (a pull sends the variable's own memory).
//! - **16-bit pushes and pulls.** A push header and a pull request may name a 16-bit
//!   [`WireFormat`] (f16 or bf16; a [`PsClient`] sends the one
//!   [`with_wire_format`](PsClient::with_wire_format) gives it, f32 by default): the chunks
//!   then carry little-endian u16 elements, at most [`MAX_CHUNK_ELEMENTS`] of them. The task
//!   holds and applies f32 all the same: a 16-bit push is decoded to f32 exactly and applied as
//!   an f32 push is (same modes, same exactly-once), and a 16-bit pull gets each value rounded
//!   to nearest even. An unknown format and a chunk of an odd byte length are refused with
//!   `INVALID_ARGUMENT`, and nothing is applied.
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

use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use crate::ClusterToken;

mod client;
mod convert;
mod faults;
mod server;
mod staged;
mod tables;
mod wire;

pub use client::{PsClient, PsClientConfig};
pub use convert::ProtoSpec;
pub use faults::FaultInjection;
pub use server::PsServerHandle;
pub use staged::{StageError, StagedPush};
pub use strata_ps::{
    CreateOutcome, LrSchedule, PsMode, PsStatus, PushOutcome, RowGrads, RowOptimizer, ServerOptimizer, StaleRate,
    TableInfo, TableStatus, UpdateId, VariableInfo, WireFormat, MAX_CHUNK_BYTES, MAX_CHUNK_ELEMENTS,
    MAX_VARIABLE_ELEMENTS,
};
// A ps task's checkpoints, read back: one task's ([`read_snapshot`]) and a whole job's
// ([`job_checkpoint_tasks`] says whether a directory is one, [`read_job_checkpoint`] restores it
// onto a task of any number), for programs that check or move them.
pub use strata_ps::{
    checkpoint_holds_variables, job_checkpoint_tasks, job_task_dir, read_job_checkpoint, read_job_checkpoint_at,
    read_snapshot, JobRestore, RestorePool, Snapshot, TableRows,
};
pub use tables::RowsPulled;
// The error the types above return (`ServerOptimizer::validate`, `VariableInfo::validate`), named
// here so that a program using this module (or the strata facade's `ps`) can name it too.
pub use strata_ps::{Error as PsError, ErrorKind as PsErrorKind};

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

    /// Elements `r` (within bounds), sharing the memory.
    pub fn slice(&self, r: std::ops::Range<usize>) -> Self {
        Self(self.elements(r))
    }

    /// The bytes of elements `r` (within bounds), sharing the memory.
    pub(crate) fn elements(&self, r: std::ops::Range<usize>) -> prost::bytes::Bytes {
        self.0.slice(r.start * 4..r.end * 4)
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
    /// used) or one `ckpt-<step>` directory; or a whole job's checkpoint root holding each ps
    /// task's, `ps-0`, `ps-1`, ... (the latest step every one has), restored onto this task's
    /// place, [`job_place`](Self::job_place), whatever the old job's number of tasks
    /// ([`strata_ps::read_job_checkpoint`]).
    pub restore: Option<PathBuf>,
    /// The step of [`restore`](Self::restore) to restore: `None`, the latest (every task's,
    /// for a whole job's checkpoint). A hybrid job restores its ps tasks at the step of its
    /// dense layers' latest checkpoint.
    pub restore_step: Option<u64>,
    /// This task's index and its job's number of ps tasks, when known: what restoring a whole
    /// job's checkpoint needs (it is refused without them). `None` by default.
    pub job_place: Option<(u32, u32)>,
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
    /// Counts every push chunk the task receives, as it arrives (before the push is applied,
    /// or refused): for tests and monitoring that watch a push's bytes arrive. `None`: not
    /// counted.
    pub push_chunks: Option<Arc<AtomicU64>>,
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
            restore_step: None,
            job_place: None,
            faults: FaultInjection::default(),
            round_timeout: Duration::from_secs(120),
            stream_min_bytes: Some(2 * MAX_CHUNK_BYTES),
            push_chunks: None,
        }
    }
}

/// Values pulled from one parameter server.
#[derive(Clone, Debug)]
pub struct Pulled {
    /// The task's version when the values were read.
    pub version: u64,
    /// Each variable, its version and its values.
    pub variables: Vec<(VariableInfo, u64, Vec<f32>)>,
}
