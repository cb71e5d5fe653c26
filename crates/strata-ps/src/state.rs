//! What one parameter-server task holds, and the rules by which pushes change it. Every
//! method either changes the state completely or not at all (requests are validated before
//! anything is applied); a server calls them under one lock per task.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use strata_core::optim::schedule::LrSchedule;

use crate::checks::check_schedule;
use crate::chunk::shared_chunks;
use crate::limits::{MAX_TABLES, MAX_TASK_BYTES, MAX_VARIABLES, MAX_WORKERS};
use crate::optimizer::{apply_le_bytes, apply_le_bytes_from, filled};
use crate::pool::Drawn;
use crate::table::{sum_rows, try_with_capacity, Lease, Table, TableRows};
use crate::{
    check_name, first_non_finite, Chunk, CreateHeader, CreateOutcome, Error, PsMode, PsStatus, PullResult, PushHeader,
    PushReply, RequestKind, RestorePool, Result, RowGrads, RowOptimizer, RowPull, RowPullResult, ServerOptimizer,
    StaleRate, TableInfo, VariableInfo, WireFormat,
};

/// How many applied-update answers a task remembers (the oldest are forgotten first). A retry
/// arrives within seconds of its original, so this covers any retry by a wide margin.
pub const MAX_REMEMBERED_UPDATES: usize = 1 << 20;

/// (client, step, seq): the key of the applied-update table.
pub type UpdateKey = (String, u64, u64);

/// The answer recorded for an update (in the applied-update table and in checkpoints).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Answer {
    /// Applied; the task's version after it.
    Applied(u64),
    /// Dropped (sync mode); the task's version then.
    Dropped(u64),
    /// Accepted into the sync round computed from this base version, not yet applied.
    Pending(u64),
}

impl Answer {
    /// The reply this answer gives (`duplicate` when it answers a retry); `None` while the
    /// update waits in its sync round.
    pub fn reply(self, duplicate: bool) -> Option<PushReply> {
        match self {
            Answer::Applied(version) => Some(PushReply::Applied { version, duplicate }),
            Answer::Dropped(version) => Some(PushReply::Dropped { version, duplicate }),
            Answer::Pending(_) => None,
        }
    }
}

/// The applied-update table's key of a push.
fn key_of(h: &PushHeader) -> UpdateKey {
    (h.id.client.clone(), h.id.step, h.id.seq)
}

/// What a push handler does next.
#[derive(Debug)]
pub enum PushDecision {
    /// Answer at once.
    Done(PushReply),
    /// Sync mode: wait until the round computed from `base` is applied, then answer from the
    /// table.
    Wait {
        /// The update, whose answer the table will hold.
        key: UpdateKey,
        /// The version the push was computed from.
        base: u64,
        /// Whether the push repeats one already taken.
        duplicate: bool,
    },
}

struct Var {
    info: VariableInfo,
    /// Shared with the chunks of pulls in flight and with a streamed push computing from it: an
    /// in-place update copies it only while one of those holds it.
    value: Arc<Vec<f32>>,
    /// The optimizer's slots, shared like `value` (with streamed pushes only).
    slots: Vec<Arc<Vec<f32>>>,
    version: u64,
}

/// Buffers a streamed push computes a variable's new values and slots into: the variable's
/// previous buffers, kept after a streamed push replaced them, so that the next one writes into
/// memory already mapped (a fresh 64 MiB buffer costs the kernel a page fault and a zeroed
/// page every 4 KiB). Kept shared: a pull in flight may still be sending the old values, and
/// the next streamed push takes them if it has finished by then.
type Spare = (Arc<Vec<f32>>, Vec<Arc<Vec<f32>>>);

/// A spare's buffers, if nothing else holds them any more.
fn unwrap_spare((value, slots): Spare) -> Option<(Vec<f32>, Vec<Vec<f32>>)> {
    let value = Arc::try_unwrap(value).ok()?;
    let slots = slots.into_iter().map(|s| Arc::try_unwrap(s).ok()).collect::<Option<Vec<_>>>()?;
    Some((value, slots))
}

/// One variable of a [`Streamed`] push.
struct StreamVar {
    /// The variable's index in the task.
    index: usize,
    /// Its values and slots when the push began (shared with the task, read only).
    base: Arc<Vec<f32>>,
    base_slots: Vec<Arc<Vec<f32>>>,
    /// The new values and slots, computed from `base` as chunks arrive.
    value: Vec<f32>,
    slots: Vec<Vec<f32>>,
    /// Elements covered so far (chunks cover a variable in order).
    next: usize,
    /// The task's update number of this update (AdamW's bias correction).
    t: u64,
    /// Whether the variable is state (the push's change is added, see [`STATE_UPDATE`]).
    state: bool,
}

/// A push applied while it arrives: each chunk updates the variables out of place, from their
/// values when the push began into spare buffers, while later chunks are still on the wire, and
/// is dropped (the connection's receive buffers are reused instead of new memory for every
/// push). [`State::finish_stream`] swaps the new buffers in if nothing was applied to the task
/// in between; otherwise nothing of the push is applied and it is refused with `ABORTED`, for
/// the client to send again. Either way the push is applied whole, once, or not at all.
pub struct Streamed {
    key: UpdateKey,
    worker: String,
    names: Vec<String>,
    /// The task's version the update is computed from.
    task_version: u64,
    optimizer: ServerOptimizer,
    vars: Vec<StreamVar>,
}

impl Streamed {
    /// Validates a received chunk (the push's variables covered in order, none past its end)
    /// and computes the new values of the elements it carries.
    pub fn apply(&mut self, c: &Chunk) -> Result<()> {
        let count = self.vars.len();
        let Some(v) = self.vars.get_mut(c.var as usize) else {
            return Err(Error::UnknownChunkVariable { index: c.var as usize, count, request: RequestKind::Push });
        };
        let name = &self.names[c.var as usize];
        let size = v.base.len();
        if c.offset != v.next as u64 {
            return Err(out_of_order(name, c.offset, v.next));
        }
        if v.next + c.elements() > size {
            return Err(overrun(name, size, v.next + c.elements(), RequestKind::Push));
        }
        check_finite(c, name, v.next, true)?;
        let mut slots0: Vec<&[f32]> = v.base_slots.iter().map(|s| s.as_slice()).collect();
        let mut at = v.next;
        for g in &c.pieces {
            let end = at + g.len() / 4;
            for (s0, s) in slots0.iter_mut().zip(&v.base_slots) {
                *s0 = &s[at..end];
            }
            let mut slots: Vec<&mut [f32]> = v.slots.iter_mut().map(|s| &mut s[at..end]).collect();
            let opt = if v.state { &STATE_UPDATE } else { &self.optimizer };
            apply_le_bytes_from(opt, &v.base[at..end], &mut v.value[at..end], g, &slots0, &mut slots, v.t);
            at = end;
        }
        v.next = at;
        Ok(())
    }
}

/// One push accepted into the current sync round.
struct Contribution {
    worker: String,
    grads: Vec<(usize, Vec<f32>)>,
    rows: Vec<PendingRows>,
}

/// One table's rows of a push waiting in a sync round: the gradients, and the lease they were
/// pulled under, whose rows stay pinned until the round applies.
struct PendingRows {
    table: usize,
    ids: Vec<u64>,
    grads: Vec<f32>,
    lease: Option<Lease>,
}

/// The first field in which two descriptions of a table differ, as errors name it.
fn table_difference(have: &TableInfo, want: &TableInfo) -> Option<&'static str> {
    let (h, w) = (&have.config, &want.config);
    [
        ("dim", h.dim == w.dim),
        ("size", h.size == w.size),
        ("init", h.init == w.init),
        ("seed", have.seed == want.seed),
        ("shard", have.shard == want.shard),
        ("num_shards", have.num_shards == want.num_shards),
        ("optimizer", have.optimizer == want.optimizer),
    ]
    .into_iter()
    .find_map(|(field, same)| (!same).then_some(field))
}

/// The counters a task reports and checkpoints (see [`PsStatus`] for what each counts).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Updates applied (in sync mode, pushes in applied rounds).
    pub pushes_applied: u64,
    /// Retries answered from the applied-update table.
    pub pushes_duplicate: u64,
    /// Sync-mode pushes dropped.
    pub pushes_dropped: u64,
    /// Stale pushes refused.
    pub pushes_stale: u64,
    /// Sync mode: the rounds applied.
    pub rounds: u64,
    /// Per worker, how many of its pushes were applied.
    pub applied_by_worker: BTreeMap<String, u64>,
    /// Pushes applied while they arrived. Absent from checkpoints written before pushes were
    /// streamed.
    #[serde(default)]
    pub pushes_streamed: u64,
    /// Streamed pushes refused because another update was applied while they arrived.
    #[serde(default)]
    pub pushes_aborted: u64,
}

/// What one parameter-server task holds: its variables and their optimizer slots, versions,
/// mode, the applied-update table, the current sync round and the counters. Every method
/// changes the state completely or not at all.
pub struct State {
    task: String,
    vars: Vec<Var>,
    index: HashMap<String, usize>,
    optimizer: Option<ServerOptimizer>,
    /// The learning-rate schedule, by the task's update number (see
    /// [`CreateHeader::schedule`]).
    schedule: Option<LrSchedule>,
    /// The rate of stale pushes' dense variables ([`CreateHeader::stale_rate`]).
    stale_rate: StaleRate,
    mode: Option<PsMode>,
    version: u64,
    table: HashMap<UpdateKey, Answer>,
    order: VecDeque<UpdateKey>,
    round: BTreeMap<UpdateKey, Contribution>,
    live_workers: Option<u32>,
    counters: Counters,
    restored_step: u64,
    restored_version: u64,
    /// Pushes of at least this many bytes are streamed (async and stale modes); `None`: never.
    stream_min_bytes: Option<usize>,
    /// Whether a streamed push is in progress (one at a time).
    streaming: bool,
    /// Per variable, the buffers the next streamed push computes into.
    spare: Vec<Option<Spare>>,
    /// The job's wire format, as the last create request set it.
    wire_format: WireFormat,
    /// The embedding tables' shards.
    tables: Vec<Table>,
    table_index: HashMap<String, usize>,
    /// A task restored from a whole job's checkpoint: the old tasks' dense variables, which
    /// creation draws from, until the first applied update.
    pool: Pool,
}

/// Where the variables a task creates come from.
#[derive(Debug, Default)]
enum Pool {
    /// The create request's initial values (a fresh task, or one restored from its own
    /// checkpoint).
    #[default]
    None,
    /// A whole job's checkpoint ([`State::restore_job`]): every variable is drawn from it.
    Holding(RestorePool),
    /// Restored from a job's checkpoint, whose variables were released at the first update: a
    /// variable the task does not hold cannot be created.
    Released,
}

/// One variable in a snapshot: its info, version, values and optimizer slots.
pub type SnapshotVariable = (VariableInfo, u64, Vec<f32>, Vec<Vec<f32>>);

/// A copy of a task's state for a checkpoint, taken under the lock and written outside it
/// ([`write_snapshot`](crate::write_snapshot)), or read back from one.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    /// The task's name.
    pub task: String,
    /// The task's version.
    pub version: u64,
    /// The variables.
    pub variables: Vec<SnapshotVariable>,
    /// The optimizer, once variables were created.
    pub optimizer: Option<ServerOptimizer>,
    /// The learning-rate schedule, if the task follows one (its step is the task's version).
    pub schedule: Option<LrSchedule>,
    /// The rate of stale pushes' dense variables.
    pub stale_rate: StaleRate,
    /// The mode, once variables were created.
    pub mode: Option<PsMode>,
    /// The counters.
    pub counters: Counters,
    /// The applied-update table's final answers, oldest first.
    pub table: Vec<(UpdateKey, Answer)>,
    /// The embedding tables' shards: their rows created and not evicted (leases are not part
    /// of a snapshot: after a restore, workers pull again before they push rows).
    pub tables: Vec<TableRows>,
}

fn out_of_order(name: &str, offset: u64, expected: usize) -> Error {
    Error::ChunkOutOfOrder { variable: name.into(), offset, expected }
}

fn incomplete(name: &str, size: usize, covered: usize, request: RequestKind) -> Error {
    Error::Incomplete { variable: name.into(), size, covered, request }
}

fn overrun(name: &str, size: usize, covered: usize, request: RequestKind) -> Error {
    Error::Overrun { variable: name.into(), size, covered, request }
}

/// Checks that `chunks` cover each of `sizes` exactly once, in order.
fn check_coverage(chunks: &[Chunk], names: &[&str], sizes: &[usize], what: RequestKind) -> Result<()> {
    let mut next = vec![0usize; sizes.len()];
    for c in chunks {
        let v = c.var as usize;
        let Some(&size) = sizes.get(v) else {
            return Err(Error::UnknownChunkVariable { index: v, count: sizes.len(), request: what });
        };
        let n = c.elements();
        if c.offset != next[v] as u64 {
            return Err(out_of_order(names[v], c.offset, next[v]));
        }
        if next[v] + n > size {
            return Err(overrun(names[v], size, next[v] + n, what));
        }
        next[v] += n;
    }
    for (v, (&covered, &size)) in next.iter().zip(sizes).enumerate() {
        if covered != size {
            return Err(incomplete(names[v], size, covered, what));
        }
    }
    Ok(())
}

/// Refuses a chunk with a NaN or infinite element (`gradient`: of a push, else initial values);
/// `start` is the chunk's first element in its variable.
fn check_finite(c: &Chunk, name: &str, start: usize, gradient: bool) -> Result<()> {
    let mut at = start;
    for p in &c.pieces {
        if let Some((i, value)) = first_non_finite(p) {
            let (variable, element) = (name.to_string(), at + i);
            return Err(if gradient {
                Error::NonFiniteGradient { variable, element, value }
            } else {
                Error::NonFiniteValue { variable, element, value }
            });
        }
        at += p.len() / 4;
    }
    Ok(())
}

/// Refuses chunks (covering their variables in order, already checked) with a NaN or infinite
/// element.
fn check_all_finite(chunks: &[Chunk], names: &[&str], gradient: bool) -> Result<()> {
    for c in chunks {
        let name = names.get(c.var as usize).copied().unwrap_or_default();
        check_finite(c, name, usize::try_from(c.offset).unwrap_or(usize::MAX), gradient)?;
    }
    Ok(())
}

/// An empty vector with room for `n` f32s, or the task's refusal when there is no memory.
fn reserve(task: &str, n: usize, what: &'static str) -> Result<Vec<f32>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| Error::OutOfMemory { task: task.into(), bytes: n.saturating_mul(4), what })?;
    Ok(v)
}

/// How a task applies a push to a variable of [state](VariableInfo::state): it adds the pushed
/// change (`w - (g * -1 + 0)`, plain SGD at a learning rate of -1), with no optimizer slot and
/// no step count.
const STATE_UPDATE: ServerOptimizer = ServerOptimizer::Sgd { lr: -1.0 };

/// The update a variable takes: the task's optimizer, or [`STATE_UPDATE`] for state.
fn update_of<'a>(optimizer: &'a ServerOptimizer, info: &VariableInfo) -> &'a ServerOptimizer {
    if info.state {
        &STATE_UPDATE
    } else {
        optimizer
    }
}

/// Pushes of at least this many bytes are applied on two threads: the pushing worker waits for
/// the answer, so a core is free (the optimizer's pass is memory-bound and took a third of a
/// 64 MiB push on one thread).
const PARALLEL_APPLY_BYTES: usize = 4 << 20;

/// One piece of an update: gradient bytes and the ranges of the variable and of its optimizer
/// slots they land on.
struct Piece<'a> {
    opt: &'a ServerOptimizer,
    g: &'a Bytes,
    w: &'a mut [f32],
    slots: Vec<&'a mut [f32]>,
    t: u64,
}

/// A variable's range not yet handed out, its optimizer slots' ranges, its step count and its
/// update.
type Ranges<'a, 'o> = (&'a mut [f32], Vec<&'a mut [f32]>, u64, &'o ServerOptimizer);

fn apply_pieces(pieces: Vec<Piece<'_>>) {
    for mut p in pieces {
        apply_le_bytes(p.opt, p.w, p.g, &mut p.slots, p.t);
    }
}

/// Applies a validated update (`chunks` cover each of the variables `at` exactly, in order) to
/// the variables, on two threads when it is large; `t` is the task's update number (AdamW's
/// bias correction).
fn apply_update(optimizer: &ServerOptimizer, vars: &mut [Var], at: &[usize], chunks: &[Chunk], t: u64) {
    // The ranges not yet handed out, per pushed variable (`at[k]` is variable `k` of the push).
    let mut rest: Vec<Option<Ranges<'_, '_>>> = at.iter().map(|_| None).collect();
    let mut pushed_as = vec![None; vars.len()];
    for (k, &i) in at.iter().enumerate() {
        pushed_as[i] = Some(k);
    }
    for (var, k) in vars.iter_mut().zip(pushed_as) {
        if let Some(k) = k {
            let opt = update_of(optimizer, &var.info);
            let slots = var.slots.iter_mut().map(|s| Arc::make_mut(s).as_mut_slice()).collect();
            rest[k] = Some((Arc::make_mut(&mut var.value).as_mut_slice(), slots, t, opt));
        }
    }
    let mut pieces = Vec::new();
    let mut bytes = 0;
    for c in chunks {
        let Some((w, slots, t, opt)) = rest.get_mut(c.var as usize).and_then(Option::as_mut) else { continue };
        for g in &c.pieces {
            let n = (g.len() / 4).min(w.len());
            let (head, tail) = std::mem::take(w).split_at_mut(n);
            *w = tail;
            let mut piece_slots = Vec::with_capacity(slots.len());
            for s in slots.iter_mut() {
                let (head, tail) = std::mem::take(s).split_at_mut(n);
                *s = tail;
                piece_slots.push(head);
            }
            bytes += g.len();
            pieces.push(Piece { opt, g, w: head, slots: piece_slots, t: *t });
        }
    }
    if bytes < PARALLEL_APPLY_BYTES {
        return apply_pieces(pieces);
    }
    // Halves by bytes: the second half on a helper thread (or here, if none can start).
    let mut half = 0;
    let split = pieces.iter().position(|p| {
        half += p.g.len();
        half >= bytes / 2
    });
    let second = std::sync::Mutex::new(Some(pieces.split_off(split.map_or(pieces.len(), |i| i + 1))));
    std::thread::scope(|scope| {
        let helper = std::thread::Builder::new().name("strata-ps-apply".into()).spawn_scoped(scope, || {
            if let Some(p) = second.lock().ok().and_then(|mut s| s.take()) {
                apply_pieces(p);
            }
        });
        apply_pieces(pieces);
        if helper.is_err() {
            if let Some(p) = second.lock().ok().and_then(|mut s| s.take()) {
                apply_pieces(p);
            }
        }
    });
}

impl State {
    /// A task that streams pushes of at least `stream_min_bytes` bytes (`None`: never).
    pub fn new(task: String, stream_min_bytes: Option<usize>) -> Self {
        Self {
            task,
            vars: Vec::new(),
            index: HashMap::new(),
            optimizer: None,
            schedule: None,
            stale_rate: StaleRate::Constant,
            mode: None,
            version: 0,
            table: HashMap::new(),
            order: VecDeque::new(),
            round: BTreeMap::new(),
            live_workers: None,
            counters: Counters::default(),
            restored_step: 0,
            restored_version: 0,
            stream_min_bytes,
            streaming: false,
            spare: Vec::new(),
            wire_format: WireFormat::F32,
            tables: Vec::new(),
            table_index: HashMap::new(),
            pool: Pool::None,
        }
    }

    /// Counts an applied update (the task's version goes up by one); the first releases a job
    /// checkpoint's restore pool: creation is over once training has begun.
    fn count_update(&mut self) {
        self.version += 1;
        if matches!(self.pool, Pool::Holding(_)) {
            self.pool = Pool::Released;
        }
    }

    fn remember(&mut self, key: UpdateKey, answer: Answer) {
        if self.table.insert(key.clone(), answer).is_none() {
            self.order.push_back(key);
            while self.order.len() > MAX_REMEMBERED_UPDATES {
                if let Some(old) = self.order.pop_front() {
                    self.table.remove(&old);
                }
            }
        }
    }

    /// The answer recorded for `key`, if any.
    pub fn answer(&self, key: &UpdateKey) -> Option<Answer> {
        self.table.get(key).copied()
    }

    /// The task's version: how many pushes (async and stale modes) or rounds (sync mode) it
    /// has applied.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The task's name.
    pub fn task(&self) -> &str {
        &self.task
    }

    /// The bytes of all the variables the task holds (what one push can carry at most).
    pub fn bytes(&self) -> usize {
        self.vars.iter().map(|v| v.value.len() * 4).sum()
    }

    /// The bytes of gradients a push of `rows` carries for its tables (each table's rows times
    /// its row's bytes; an unknown table counts nothing, and the push is refused for it).
    pub fn row_bytes(&self, rows: &[RowGrads]) -> usize {
        rows.iter()
            .filter_map(|r| {
                self.table_index.get(&r.table).map(|&t| r.ids.len().saturating_mul(self.tables[t].info.config.dim * 4))
            })
            .fold(0usize, usize::saturating_add)
    }

    /// Validates the tables of a create request (each described once, as the task holds it if
    /// it does, no more than [`MAX_TABLES`] in all); returns how many the task holds already.
    fn check_tables(&self, tables: &[TableInfo]) -> Result<usize> {
        for t in tables {
            t.validate()?;
        }
        let mut seen = HashSet::new();
        for t in tables {
            if !seen.insert(t.name()) {
                return Err(Error::TableNamedTwice { table: t.name().into() });
            }
        }
        let mut existing = 0;
        for t in tables {
            if let Some(&at) = self.table_index.get(t.name()) {
                if let Some(field) = table_difference(&self.tables[at].info, t) {
                    return Err(Error::TableMismatch { task: self.task.clone(), table: t.name().into(), field });
                }
                existing += 1;
            }
        }
        let count = self.tables.len() + tables.len() - existing;
        if count > MAX_TABLES {
            return Err(Error::TooManyTables { task: self.task.clone(), count });
        }
        Ok(existing)
    }

    /// `CreateVariables`: validates the header (variables, tables, optimizer, mode) and, unless
    /// every variable exists already, the chunks of their initial values; then creates the
    /// variables and tables that do not exist (a table's rows are created when first pulled).
    /// A task takes one optimizer and one mode, and a variable or table it holds must be
    /// described the same way again.
    pub fn create(&mut self, header: &CreateHeader, chunks: &[Chunk]) -> Result<CreateOutcome> {
        let infos = &header.variables;
        let existing_tables = self.check_tables(&header.tables)?;
        for i in infos {
            i.validate()?;
        }
        let mut seen = HashSet::new();
        for i in infos {
            if !seen.insert(i.name.as_str()) {
                return Err(Error::NamedTwice { variable: i.name.clone() });
            }
        }
        let optimizer = header.optimizer.clone();
        optimizer.validate()?;
        if let Some(schedule) = &header.schedule {
            check_schedule(schedule)?;
        }
        let mode = header.mode;
        mode.validate()?;
        if let Some(have) = &self.optimizer {
            if *have != optimizer {
                return Err(Error::OptimizerMismatch {
                    task: self.task.clone(),
                    have: Box::new(have.clone()),
                    want: Box::new(optimizer),
                });
            }
            if self.schedule != header.schedule {
                return Err(Error::ScheduleMismatch {
                    task: self.task.clone(),
                    have: Box::new(self.schedule.clone()),
                    want: Box::new(header.schedule.clone()),
                });
            }
            if self.stale_rate != header.stale_rate {
                return Err(Error::StaleRateMismatch {
                    task: self.task.clone(),
                    have: self.stale_rate,
                    want: header.stale_rate,
                });
            }
        }
        if let Some(have) = self.mode {
            if have != mode {
                return Err(Error::ModeMismatch { task: self.task.clone(), have, want: mode });
            }
        }
        let mut existing = 0;
        for i in infos {
            if let Some(&at) = self.index.get(&i.name) {
                let have = &self.vars[at].info;
                if have != i {
                    return Err(Error::VariableMismatch {
                        task: self.task.clone(),
                        have: Box::new(have.clone()),
                        want: Box::new(i.clone()),
                    });
                }
                existing += 1;
            }
        }
        let names: Vec<&str> = infos.iter().map(|i| i.name.as_str()).collect();
        let sizes: Vec<usize> = infos.iter().map(VariableInfo::numel).collect();
        // A job checkpoint's pool gives every variable the task does not hold, or refuses.
        let all_exist = (existing == infos.len() || matches!(self.pool, Pool::Holding(_)))
            && existing_tables == header.tables.len()
            && !(infos.is_empty() && header.tables.is_empty());
        if existing != infos.len() {
            let count = self.vars.len() + (infos.len() - existing);
            if count > MAX_VARIABLES {
                return Err(Error::TooManyVariables { task: self.task.clone(), count });
            }
            let adding: u64 = infos
                .iter()
                .filter(|i| !self.index.contains_key(&i.name))
                .map(|i| i.numel() as u64 * 4)
                .fold(self.bytes() as u64, u64::saturating_add);
            if adding > MAX_TASK_BYTES {
                return Err(Error::TaskTooLarge { task: self.task.clone(), bytes: adding });
            }
            check_coverage(chunks, &names, &sizes, RequestKind::Create)?;
            check_all_finite(chunks, &names, false)?;
            for (info, (value, slots, version)) in self.new_variables(infos, chunks, &optimizer)? {
                self.index.insert(info.name.clone(), self.vars.len());
                let slots = slots.into_iter().map(Arc::new).collect();
                self.vars.push(Var { info: info.clone(), value: Arc::new(value), slots, version });
            }
        }
        for t in &header.tables {
            if !self.table_index.contains_key(t.name()) {
                self.table_index.insert(t.name().to_string(), self.tables.len());
                self.tables.push(Table::new(t.clone()));
            }
        }
        self.optimizer = Some(optimizer);
        self.schedule = header.schedule.clone();
        self.stale_rate = header.stale_rate;
        self.mode = Some(mode);
        self.wire_format = header.wire_format;
        let versions = infos.iter().map(|i| self.index.get(&i.name).map_or(0, |&at| self.vars[at].version)).collect();
        Ok(CreateOutcome { versions, existed: all_exist, version: self.version })
    }

    /// The values, optimizer slots and versions of the variables of `infos` the task does not
    /// hold yet: the create request's initial values from `chunks` (which cover every variable
    /// of `infos`) at version 0, or, on a task restored from a whole job's checkpoint, the
    /// checkpoint's, every variable checked before any is drawn. Memory is reserved fallibly.
    fn new_variables<'a>(
        &self,
        infos: &'a [VariableInfo],
        chunks: &[Chunk],
        optimizer: &ServerOptimizer,
    ) -> Result<Vec<(&'a VariableInfo, Drawn)>> {
        let task = &self.task;
        let new = || infos.iter().filter(|i| !self.index.contains_key(&i.name));
        match &self.pool {
            Pool::Holding(pool) => {
                for info in new() {
                    pool.check(task, info)?;
                }
                new().map(|info| Ok((info, pool.draw(task, info, optimizer)?))).collect()
            }
            Pool::Released => match new().next() {
                Some(info) => Err(Error::PoolReleased { task: task.clone(), variable: info.name.clone() }),
                None => Ok(Vec::new()),
            },
            Pool::None => {
                let mut values = Vec::with_capacity(infos.len());
                for info in infos {
                    let new = !self.index.contains_key(&info.name);
                    values.push(if new { Some(reserve(task, info.numel(), "the variables' values")?) } else { None });
                }
                for c in chunks {
                    if let Some(v) = values[c.var as usize].as_mut() {
                        c.extend(v);
                    }
                }
                let mut created = Vec::with_capacity(infos.len());
                for (info, value) in infos.iter().zip(values) {
                    let Some(value) = value else { continue };
                    let Some(slots) = optimizer.try_new_slots(value.len()) else {
                        let bytes = value.len().saturating_mul(4 * optimizer.slots());
                        return Err(Error::OutOfMemory { task: task.clone(), bytes, what: "optimizer slots" });
                    };
                    created.push((info, (value, slots, 0)));
                }
                Ok(created)
            }
        }
    }

    /// The optimizer of the task's next update, number `self.version` (0 for the first): at
    /// the schedule's rate for that step, if the task follows one (see
    /// [`CreateHeader::schedule`]). `None` before variables were created.
    fn optimizer_now(&self) -> Option<ServerOptimizer> {
        let optimizer = self.optimizer.as_ref()?;
        Some(match &self.schedule {
            Some(s) => optimizer.with_learning_rate(s.at(self.version)),
            None => optimizer.clone(),
        })
    }

    /// `optimizer` (the next update's) at the rate of an async or stale-mode push computed
    /// from `base_version` ([`StaleRate`]): its staleness is the updates applied since.
    fn stale_scaled(&self, optimizer: ServerOptimizer, base_version: u64) -> ServerOptimizer {
        let staleness = self.version.saturating_sub(base_version);
        match self.stale_rate {
            StaleRate::Constant => optimizer,
            _ if staleness == 0 => optimizer,
            rate => optimizer.with_learning_rate(rate.rate(optimizer.learning_rate(), staleness)),
        }
    }

    fn required(&self, workers: u32, backup: u32) -> usize {
        let base = workers.saturating_sub(backup).max(1);
        self.live_workers.map_or(base, |l| l.min(base)).max(1) as usize
    }

    /// The answer to a push of an update already taken (counted as a duplicate), if it was.
    fn duplicate(&mut self, key: &UpdateKey) -> Option<PushDecision> {
        let answer = self.answer(key)?;
        self.counters.pushes_duplicate += 1;
        if let Answer::Pending(base) = answer {
            return Some(PushDecision::Wait { key: key.clone(), base, duplicate: true });
        }
        answer.reply(true).map(PushDecision::Done)
    }

    /// Refuses a push whose names are too long, or that comes from one worker name more than
    /// the task counts.
    fn check_pusher(&self, h: &PushHeader) -> Result<()> {
        check_name("worker", &h.id.worker)?;
        check_name("client", &h.id.client)?;
        for name in &h.variables {
            check_name("variable", name)?;
        }
        for rows in &h.rows {
            check_name("table", &rows.table)?;
        }
        let known = self.counters.applied_by_worker.contains_key(&h.id.worker)
            || self.round.values().any(|c| c.worker == h.id.worker);
        if !known && self.counters.applied_by_worker.len() >= MAX_WORKERS as usize {
            return Err(Error::TooManyWorkerNames { task: self.task.clone() });
        }
        Ok(())
    }

    /// `Push`: validates, then applies, drops, refuses or queues the update.
    pub fn push(&mut self, h: &PushHeader, chunks: &[Chunk]) -> Result<PushDecision> {
        self.check_pusher(h)?;
        let key = key_of(h);
        if let Some(answer) = self.duplicate(&key) {
            return Ok(answer);
        }
        let (Some(optimizer), Some(mode)) = (self.optimizer_now(), self.mode) else {
            return Err(Error::NoVariables { task: self.task.clone() });
        };
        // Resolve and validate everything before changing anything.
        let mut at = Vec::with_capacity(h.variables.len());
        let mut seen = HashSet::new();
        for name in &h.variables {
            if !seen.insert(name.as_str()) {
                return Err(Error::PushedTwice { variable: name.clone() });
            }
            match self.index.get(name) {
                Some(&i) => at.push(i),
                None => return Err(self.unknown(name)),
            }
        }
        let names: Vec<&str> = h.variables.iter().map(String::as_str).collect();
        let sizes: Vec<usize> = at.iter().map(|&i| self.vars[i].value.len()).collect();
        check_coverage(chunks, &names, &sizes, RequestKind::Push)?;
        check_all_finite(chunks, &names, true)?;
        let rows = self.check_rows(h)?;
        match mode {
            PsMode::Async => {}
            PsMode::Stale { staleness } => {
                if h.base_version > self.version {
                    return Err(self.ahead(h.base_version));
                }
                if self.version - h.base_version > staleness {
                    self.counters.pushes_stale += 1;
                    return Err(Error::Stale { base: h.base_version, version: self.version, bound: staleness });
                }
            }
            PsMode::Sync { workers, backup_workers } => {
                if h.base_version > self.version {
                    return Err(self.ahead(h.base_version));
                }
                if h.base_version < self.version {
                    self.counters.pushes_dropped += 1;
                    self.remember(key, Answer::Dropped(self.version));
                    self.release_leases(h);
                    return Ok(PushDecision::Done(PushReply::Dropped { version: self.version, duplicate: false }));
                }
                let mut grads: Vec<(usize, Vec<f32>)> = Vec::with_capacity(at.len());
                for (&i, &n) in at.iter().zip(&sizes) {
                    grads.push((i, reserve(&self.task, n, "a sync round's gradient")?));
                }
                for c in chunks {
                    c.extend(&mut grads[c.var as usize].1);
                }
                let rows = self.pending_rows(h, &rows)?;
                let base = self.version;
                self.round.insert(key.clone(), Contribution { worker: h.id.worker.clone(), grads, rows });
                self.remember(key.clone(), Answer::Pending(base));
                if self.round.len() >= self.required(workers, backup_workers) {
                    self.apply_round(&optimizer);
                }
                return Ok(PushDecision::Wait { key, base, duplicate: false });
            }
        }
        // Async and stale: apply where each chunk lands (at the push's staleness's rate), and
        // each table's rows.
        let optimizer = self.stale_scaled(optimizer, h.base_version);
        apply_update(&optimizer, &mut self.vars, &at, chunks, self.version + 1);
        for &i in &at {
            self.vars[i].version += 1;
        }
        for ((table, slab_rows), rg) in rows.into_iter().zip(&h.rows) {
            let opt = self.table_optimizer(table);
            self.tables[table].apply(&opt, &slab_rows, &rg.grads, self.version + 1, self.version + 1);
        }
        self.release_leases(h);
        self.count_update();
        self.counters.pushes_applied += 1;
        *self.counters.applied_by_worker.entry(h.id.worker.clone()).or_default() += 1;
        self.remember(key, Answer::Applied(self.version));
        Ok(PushDecision::Done(PushReply::Applied { version: self.version, duplicate: false }))
    }

    /// Validates the rows of a push (see [`Table::check_push`]), each table once; returns per
    /// pushed table its index and the rows' slab indices.
    fn check_rows(&self, h: &PushHeader) -> Result<Vec<(usize, Vec<usize>)>> {
        let mut out = Vec::new();
        let mut seen = HashSet::new();
        for rg in &h.rows {
            let Some(&table) = self.table_index.get(&rg.table) else {
                return Err(self.unknown_table(&rg.table));
            };
            if !seen.insert(table) {
                return Err(Error::TableRowsTwice { table: rg.table.clone() });
            }
            let rows = self.tables[table].check_push(&self.task, &h.id.worker, rg)?;
            out.try_reserve(1).map_err(|_| Error::OutOfMemory { task: self.task.clone(), bytes: 32, what: "rows" })?;
            out.push((table, rows));
        }
        Ok(out)
    }

    /// A validated push's rows for a sync round: copies of their gradients (all reserved before
    /// anything changes), then the leases taken out of the tables, their rows still pinned.
    fn pending_rows(&mut self, h: &PushHeader, rows: &[(usize, Vec<usize>)]) -> Result<Vec<PendingRows>> {
        let mut pending = try_with_capacity(&self.task, rows.len(), "a sync round's rows")?;
        for (&(table, _), rg) in rows.iter().zip(&h.rows) {
            let mut ids = try_with_capacity(&self.task, rg.ids.len(), "a sync round's row ids")?;
            ids.extend_from_slice(&rg.ids);
            let mut grads = try_with_capacity(&self.task, rg.grads.len(), "a sync round's row gradients")?;
            grads.extend_from_slice(&rg.grads);
            pending.push(PendingRows { table, ids, grads, lease: None });
        }
        for (p, rg) in pending.iter_mut().zip(&h.rows) {
            p.lease = self.tables[p.table].take_lease(&h.id.worker, rg.lease);
        }
        Ok(pending)
    }

    /// Releases the leases a push's rows were pulled under (its update was applied or dropped).
    fn release_leases(&mut self, h: &PushHeader) {
        for rg in &h.rows {
            if let Some(&table) = self.table_index.get(&rg.table) {
                if let Some(lease) = self.tables[table].take_lease(&h.id.worker, rg.lease) {
                    self.tables[table].release(lease);
                }
            }
        }
    }

    /// The optimizer of table `table` for the task's next update (number `self.version`):
    /// its rate scaled by the schedule, if the task follows one ([`RowOptimizer::at_step`]).
    fn table_optimizer(&self, table: usize) -> RowOptimizer {
        self.tables[table].info.optimizer.at_step(self.schedule.as_ref(), self.version)
    }

    fn unknown_table(&self, name: &str) -> Error {
        Error::UnknownTable { task: self.task.clone(), table: name.into(), held: self.tables.len() }
    }

    /// `PullRows`: the rows `req.ids` of table `req.table`, created from their initial values
    /// where not present (evicting rows unseen for long to make room in a bounded id-space
    /// table), recorded under the lease `(req.worker, req.lease)` (replacing that lease's ids
    /// if it exists; a worker's oldest lease is forgotten when it holds
    /// [`MAX_LEASES_PER_WORKER`](crate::limits::MAX_LEASES_PER_WORKER)), and marked seen at the
    /// task's version. Validated first: on an error nothing changed.
    pub fn pull_rows(&mut self, req: &RowPull) -> Result<RowPullResult> {
        check_name("worker", &req.worker)?;
        check_name("table", &req.table)?;
        let Some(&table) = self.table_index.get(&req.table) else {
            return Err(self.unknown_table(&req.table));
        };
        let other = self
            .tables
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != table)
            .map(|(_, t)| t.bytes())
            .fold(0u64, u64::saturating_add);
        let values = self.tables[table].pull(&self.task, &req.worker, req.lease, &req.ids, self.version, other)?;
        Ok(RowPullResult { version: self.version, values })
    }

    fn unknown(&self, name: &str) -> Error {
        Error::UnknownVariable { task: self.task.clone(), variable: name.into(), held: self.vars.len() }
    }

    fn ahead(&self, base: u64) -> Error {
        Error::AheadOfTask { task: self.task.clone(), base, version: self.version }
    }

    /// Starts streaming a push whose header is `h`, if it can be: async or stale mode, its
    /// variables known and named once, at least the streaming size in all, no other streamed
    /// push in progress, its update not already taken, and (stale mode) not too stale. `None`
    /// otherwise: the push is then collected and handled by [`State::push`], which also gives
    /// any error.
    pub fn begin_stream(&mut self, h: &PushHeader) -> Option<Streamed> {
        let min_bytes = self.stream_min_bytes?;
        // A push with table rows is collected: its rows are validated with the rest of it.
        if self.streaming || !h.rows.is_empty() || self.check_pusher(h).is_err() {
            return None;
        }
        let key = key_of(h);
        if self.table.contains_key(&key) {
            return None;
        }
        // A streamed push is swapped in only if no other update was applied meanwhile, so it is
        // update number `self.version` and takes that step's rate.
        let (Some(optimizer), Some(mode)) = (self.optimizer_now(), self.mode) else { return None };
        let optimizer = self.stale_scaled(optimizer, h.base_version);
        match mode {
            PsMode::Async => {}
            PsMode::Stale { staleness } => {
                if h.base_version > self.version || self.version - h.base_version > staleness {
                    return None;
                }
            }
            PsMode::Sync { .. } => return None,
        }
        let mut seen = HashSet::new();
        let mut at = Vec::with_capacity(h.variables.len());
        for name in &h.variables {
            if !seen.insert(name.as_str()) {
                return None;
            }
            at.push(*self.index.get(name)?);
        }
        if at.iter().map(|&i| self.vars[i].value.len() * 4).sum::<usize>() < min_bytes {
            return None;
        }
        self.spare.resize_with(self.vars.len(), || None);
        let mut vars = Vec::with_capacity(at.len());
        for index in at {
            let var = &self.vars[index];
            let n = var.value.len();
            let buffers = match self.spare[index].take().and_then(unwrap_spare) {
                Some(spare) => Some(spare),
                None => filled(n, 0.0).and_then(|value| {
                    let slots = (0..var.slots.len()).map(|_| filled(n, 0.0)).collect::<Option<Vec<_>>>()?;
                    Some((value, slots))
                }),
            };
            // Without memory for the spare buffers the push is collected and applied in place.
            let (value, slots) = buffers?;
            vars.push(StreamVar {
                index,
                base: var.value.clone(),
                base_slots: var.slots.clone(),
                value,
                slots,
                next: 0,
                t: self.version + 1,
                state: var.info.state,
            });
        }
        self.streaming = true;
        Some(Streamed {
            key,
            worker: h.id.worker.clone(),
            names: h.variables.clone(),
            task_version: self.version,
            optimizer,
            vars,
        })
    }

    /// Keeps a streamed push's buffers for the next one (its read-only references to the
    /// variables go first, so that an in-place update need not copy them).
    fn keep_spare(&mut self, s: Streamed) {
        for v in s.vars {
            let StreamVar { index, base, base_slots, value, slots, .. } = v;
            drop((base, base_slots));
            if let Some(spare) = self.spare.get_mut(index) {
                *spare = Some((Arc::new(value), slots.into_iter().map(Arc::new).collect()));
            }
        }
    }

    /// Whether a streamed push is in progress.
    pub fn streaming(&self) -> bool {
        self.streaming
    }

    /// A streamed push that will not finish (its stream broke, or it was refused).
    pub fn abort_stream(&mut self, s: Streamed) {
        self.streaming = false;
        self.keep_spare(s);
    }

    /// Finishes a streamed push whose stream has ended: swaps its new values in when it
    /// covered every variable and the task's version is still the one it was computed from.
    /// Otherwise nothing changes: a duplicate gets the first answer, an incomplete push its
    /// error, and a push under which another update was applied `ABORTED`.
    pub fn finish_stream(&mut self, s: Streamed) -> Result<PushDecision> {
        self.streaming = false;
        if let Some(answer) = self.duplicate(&s.key) {
            self.keep_spare(s);
            return Ok(answer);
        }
        if let Some((v, name)) = s.vars.iter().zip(&s.names).find(|(v, _)| v.next != v.base.len()) {
            let e = incomplete(name, v.base.len(), v.next, RequestKind::Push);
            self.keep_spare(s);
            return Err(e);
        }
        if s.task_version != self.version {
            self.counters.pushes_aborted += 1;
            let e = Error::Overtaken { task: self.task.clone() };
            self.keep_spare(s);
            return Err(e);
        }
        let Streamed { key, worker, vars, .. } = s;
        for v in vars {
            let StreamVar { index, base, base_slots, value, slots, .. } = v;
            drop((base, base_slots));
            let var = &mut self.vars[index];
            let old = std::mem::replace(&mut var.value, Arc::new(value));
            let old_slots = std::mem::replace(&mut var.slots, slots.into_iter().map(Arc::new).collect());
            var.version += 1;
            if let Some(spare) = self.spare.get_mut(index) {
                *spare = Some((old, old_slots));
            }
        }
        self.count_update();
        self.counters.pushes_applied += 1;
        self.counters.pushes_streamed += 1;
        *self.counters.applied_by_worker.entry(worker).or_default() += 1;
        self.remember(key, Answer::Applied(self.version));
        Ok(PushDecision::Done(PushReply::Applied { version: self.version, duplicate: false }))
    }

    /// Applies the current sync round's mean gradient (summed in ascending update order, so
    /// the result does not depend on arrival order). The mean is over the round's pushes: a
    /// variable some pushes carry no gradient for counts zeros for them (as one device's
    /// gradient of the whole batch would), and one no push carries is not updated at all.
    fn apply_round(&mut self, optimizer: &ServerOptimizer) {
        let round = std::mem::take(&mut self.round);
        let pushes = round.len();
        let mut workers = Vec::with_capacity(pushes);
        // Each variable's sum lands in the first gradient pushed for it (no new memory):
        // `0 + g1 + g2 + ...`, in key order. The mean is over the round's pushes: a variable
        // some pushes carry no gradient for counts zeros for them (as one device's gradient of
        // the whole batch would), and one no push carries is not updated at all.
        let mut sums: BTreeMap<usize, Vec<f32>> = BTreeMap::new();
        // Each table's row sums, by id, and the leases that pinned the rows.
        let mut row_sums: BTreeMap<usize, BTreeMap<u64, Vec<f32>>> = BTreeMap::new();
        let mut leases = Vec::new();
        for (key, c) in round {
            for p in c.rows {
                let dim = self.tables[p.table].info.config.dim;
                sum_rows(row_sums.entry(p.table).or_default(), &p.ids, &p.grads, dim);
                leases.extend(p.lease.map(|l| (p.table, l)));
            }
            for (i, mut g) in c.grads {
                match sums.get_mut(&i) {
                    Some(sum) => {
                        for (s, g) in sum.iter_mut().zip(&g) {
                            *s += g;
                        }
                    }
                    None => {
                        for x in &mut g {
                            *x += 0.0;
                        }
                        sums.insert(i, g);
                    }
                }
            }
            workers.push((key, c.worker));
        }
        let scale = 1.0 / pushes.max(1) as f32;
        let t = self.version + 1;
        for (i, mut mean) in sums {
            for m in &mut mean {
                *m *= scale;
            }
            let var = &mut self.vars[i];
            let mut slots: Vec<&mut [f32]> = var.slots.iter_mut().map(|s| Arc::make_mut(s).as_mut_slice()).collect();
            let value: &mut Vec<f32> = Arc::make_mut(&mut var.value);
            update_of(optimizer, &var.info).apply(value, &mean, &mut slots, t);
            var.version += 1;
        }
        for (table, sums) in row_sums {
            let opt = self.table_optimizer(table);
            self.tables[table].apply_mean(&opt, sums, scale, t, t);
        }
        for (table, lease) in leases {
            self.tables[table].release(lease);
        }
        self.count_update();
        self.counters.rounds += 1;
        for (key, worker) in workers {
            self.counters.pushes_applied += 1;
            *self.counters.applied_by_worker.entry(worker).or_default() += 1;
            self.table.insert(key, Answer::Applied(self.version));
        }
    }

    /// `Configure`: the number of live workers, 1 to the sync mode's workers (to
    /// [`MAX_WORKERS`] before the mode is known, or in another mode); may complete the current
    /// round. Returns whether the version changed.
    pub fn configure(&mut self, live: u32) -> Result<bool> {
        let max = match self.mode {
            Some(PsMode::Sync { workers, .. }) => workers,
            _ => MAX_WORKERS,
        };
        if live == 0 || live > max {
            return Err(Error::LiveWorkers { live, max });
        }
        self.live_workers = Some(live);
        if let (Some(PsMode::Sync { workers, backup_workers }), Some(opt)) = (self.mode, self.optimizer_now()) {
            if !self.round.is_empty() && self.round.len() >= self.required(workers, backup_workers) {
                self.apply_round(&opt);
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// `Pull`: the named variables (every variable if none), their versions and chunks of
    /// their values that share the variables' memory.
    pub fn pull(&self, names: &[String]) -> Result<PullResult> {
        for name in names {
            check_name("variable", name)?;
        }
        let at: Vec<usize> = if names.is_empty() {
            (0..self.vars.len()).collect()
        } else {
            names.iter().map(|n| self.index.get(n).copied().ok_or_else(|| self.unknown(n))).collect::<Result<_>>()?
        };
        let mut chunks = Vec::new();
        for (k, &i) in at.iter().enumerate() {
            chunks.extend(shared_chunks(k as u32, &self.vars[i].value));
        }
        Ok(PullResult {
            version: self.version,
            variables: at.iter().map(|&i| (self.vars[i].info.clone(), self.vars[i].version)).collect(),
            chunks,
        })
    }

    /// `Status`.
    pub fn status(&self) -> PsStatus {
        PsStatus {
            task: self.task.clone(),
            version: self.version,
            variables: self.vars.iter().map(|v| (v.info.clone(), v.version)).collect(),
            pushes_applied: self.counters.pushes_applied,
            pushes_duplicate: self.counters.pushes_duplicate,
            pushes_dropped: self.counters.pushes_dropped,
            pushes_stale: self.counters.pushes_stale,
            restored_step: self.restored_step,
            restored_version: self.restored_version,
            mode: self.mode.unwrap_or(PsMode::Async),
            optimizer: self.optimizer.clone(),
            schedule: self.schedule.clone(),
            stale_rate: self.stale_rate,
            rounds: self.counters.rounds,
            applied_by_worker: self.counters.applied_by_worker.clone(),
            pushes_streamed: self.counters.pushes_streamed,
            pushes_aborted: self.counters.pushes_aborted,
            streaming: self.streaming,
            wire_format: self.wire_format,
            tables: self.tables.iter().map(Table::status).collect(),
        }
    }

    /// A copy for a checkpoint. Pushes waiting in an incomplete sync round are not part of
    /// it (their answers are not final).
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            task: self.task.clone(),
            version: self.version,
            variables: self
                .vars
                .iter()
                .map(|v| (v.info.clone(), v.version, v.value.to_vec(), v.slots.iter().map(|s| s.to_vec()).collect()))
                .collect(),
            optimizer: self.optimizer.clone(),
            schedule: self.schedule.clone(),
            stale_rate: self.stale_rate,
            mode: self.mode,
            counters: self.counters.clone(),
            table: self
                .order
                .iter()
                .filter_map(|k| match self.table.get(k) {
                    Some(a @ (Answer::Applied(_) | Answer::Dropped(_))) => Some((k.clone(), *a)),
                    _ => None,
                })
                .collect(),
            tables: self.tables.iter().map(Table::rows).collect(),
        }
    }

    /// [`restore`](Self::restore) a snapshot without variables, which creation then draws from
    /// `pool` (see [`State::restore_job`]).
    pub(crate) fn restore_with_pool(&mut self, snap: Snapshot, step: u64, pool: RestorePool) {
        self.restore(snap, step);
        self.pool = Pool::Holding(pool);
    }

    /// Replaces the state with a restored one.
    pub fn restore(&mut self, snap: Snapshot, step: u64) {
        self.pool = Pool::None;
        self.vars.clear();
        self.index.clear();
        for (info, version, value, slots) in snap.variables {
            self.index.insert(info.name.clone(), self.vars.len());
            let slots = slots.into_iter().map(Arc::new).collect();
            self.vars.push(Var { info, value: Arc::new(value), slots, version });
        }
        self.optimizer = snap.optimizer;
        self.schedule = snap.schedule;
        self.stale_rate = snap.stale_rate;
        self.mode = snap.mode;
        self.version = snap.version;
        self.counters = snap.counters;
        self.table.clear();
        self.order.clear();
        for (k, a) in snap.table {
            self.remember(k, a);
        }
        self.round.clear();
        self.spare.clear();
        self.tables.clear();
        self.table_index.clear();
        for rows in snap.tables {
            self.table_index.insert(rows.info.config.name.clone(), self.tables.len());
            self.tables.push(Table::from_rows(rows));
        }
        self.restored_step = step;
        self.restored_version = snap.version;
    }
}

/// `values` as a connection may deliver them: pieces of `piece` elements, each at an odd
/// address.
#[cfg(test)]
fn misaligned_pieces(values: &[f32], piece: usize) -> Vec<Bytes> {
    values
        .chunks(piece)
        .map(|p| {
            let mut b = vec![0u8];
            b.extend_from_slice(bytemuck::cast_slice(p));
            Bytes::from(b).slice(1..)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{UpdateId, MAX_CHUNK_ELEMENTS};

    fn bytes_of(v: &[f32]) -> Bytes {
        Bytes::copy_from_slice(bytemuck::cast_slice(v))
    }

    /// A push large enough to be applied on two threads, arriving in frames of odd sizes (and
    /// at odd addresses), changes the variables and the optimizer's slots exactly as one pass
    /// of the optimizer over each whole variable does.
    #[test]
    fn a_large_push_applied_on_two_threads_equals_one_pass() {
        let opt = ServerOptimizer::AdamW { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-7, weight_decay: 0.01 };
        let sizes = [MAX_CHUNK_ELEMENTS * 3 + 5, 7, MAX_CHUNK_ELEMENTS + 1];
        let names = ["a", "b", "c"];
        let init: Vec<Vec<f32>> = sizes
            .iter()
            .enumerate()
            .map(|(v, &n)| (0..n).map(|i| ((i * 31 + v) % 97) as f32 * 0.01).collect())
            .collect();
        let grads: Vec<Vec<f32>> =
            sizes.iter().map(|&n| (0..n).map(|i| ((i * 17) % 89) as f32 * 0.1 - 4.0).collect()).collect();
        let mut state = State::new("ps:0".into(), None);
        let header = CreateHeader {
            variables: names.iter().zip(sizes).map(|(n, s)| VariableInfo::whole(*n, vec![s])).collect(),
            optimizer: opt.clone(),
            schedule: None,
            stale_rate: crate::StaleRate::Constant,
            mode: PsMode::Async,
            wire_format: WireFormat::F32,
            tables: Vec::new(),
        };
        let create: Vec<Chunk> = init
            .iter()
            .enumerate()
            .map(|(v, x)| Chunk { var: v as u32, offset: 0, pieces: vec![bytes_of(x)] })
            .collect();
        state.create(&header, &create).unwrap();
        // Pushed in the order c, a, b; chunks of at most 1 MiB cut into pieces of 65,539
        // elements, each piece copied one byte into its buffer so that it is misaligned.
        let order = [2usize, 0, 1];
        let mut chunks = Vec::new();
        for (k, &v) in order.iter().enumerate() {
            for (i, c) in grads[v].chunks(MAX_CHUNK_ELEMENTS).enumerate() {
                let pieces = misaligned_pieces(c, 65_539);
                chunks.push(Chunk { var: k as u32, offset: (i * MAX_CHUNK_ELEMENTS) as u64, pieces });
            }
        }
        let push = PushHeader {
            id: UpdateId { worker: "worker:0".into(), client: "worker:0".into(), step: 0, seq: 0 },
            base_version: 0,
            variables: order.iter().map(|&v| names[v].to_string()).collect(),
            rows: Vec::new(),
        };
        assert!(chunks.iter().map(|c| c.elements() * 4).sum::<usize>() >= PARALLEL_APPLY_BYTES);
        state.push(&push, &chunks).unwrap();
        for (v, name) in names.iter().enumerate() {
            let mut w = init[v].clone();
            let mut slots = opt.new_slots(w.len());
            let mut refs: Vec<&mut [f32]> = slots.iter_mut().map(Vec::as_mut_slice).collect();
            opt.apply(&mut w, &grads[v], &mut refs, 1);
            let var = &state.vars[state.index[*name]];
            assert_eq!(var.version, 1);
            let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same(&var.value, &w), "variable {name}");
            assert!(var.slots.iter().zip(&slots).all(|(a, b)| same(a, b)), "slots of {name}");
        }
    }
}

#[cfg(test)]
mod partial_tests {
    use super::*;
    use crate::UpdateId;

    fn bytes_of(v: &[f32]) -> Bytes {
        Bytes::copy_from_slice(bytemuck::cast_slice(v))
    }

    /// A task of `a` (2 elements) and `b` (1) in `mode`, `a = [1, 2]`, `b = [3]`.
    fn task(opt: &ServerOptimizer, mode: PsMode) -> State {
        task_with(opt, mode, None, VariableInfo::whole("b", vec![1]))
    }

    /// A task holding `a` = [1, 2] and `b` = [3] (described by `b`), streaming from
    /// `stream_min_bytes` when given.
    fn task_with(opt: &ServerOptimizer, mode: PsMode, stream_min_bytes: Option<usize>, b: VariableInfo) -> State {
        let mut state = State::new("ps:0".into(), stream_min_bytes);
        let header = CreateHeader {
            variables: vec![VariableInfo::whole("a", vec![2]), b],
            optimizer: opt.clone(),
            schedule: None,
            stale_rate: crate::StaleRate::Constant,
            mode,
            wire_format: WireFormat::F32,
            tables: Vec::new(),
        };
        let create = vec![
            Chunk { var: 0, offset: 0, pieces: vec![bytes_of(&[1.0, 2.0])] },
            Chunk { var: 1, offset: 0, pieces: vec![bytes_of(&[3.0])] },
        ];
        state.create(&header, &create).unwrap();
        state
    }

    /// A push from `worker` at `step` of `grads` (by name), computed from version `base`.
    fn push(s: &mut State, worker: &str, step: u64, base: u64, grads: &[(&str, &[f32])]) -> PushDecision {
        let h = PushHeader {
            id: UpdateId { worker: worker.into(), client: "c".into(), step, seq: 0 },
            base_version: base,
            variables: grads.iter().map(|(n, _)| n.to_string()).collect(),
            rows: Vec::new(),
        };
        let chunks: Vec<Chunk> = grads
            .iter()
            .enumerate()
            .map(|(k, (_, g))| Chunk { var: k as u32, offset: 0, pieces: vec![bytes_of(g)] })
            .collect();
        s.push(&h, &chunks).unwrap()
    }

    fn value(s: &State, name: &str) -> Vec<f32> {
        s.vars[s.index[name]].value.to_vec()
    }

    /// A push that carries no gradient for a variable leaves it (and its AdamW moments) alone,
    /// an empty push still counts as an update, and AdamW's bias correction counts the task's
    /// updates, as candle-nn's AdamW counts steps on one device.
    #[test]
    fn variables_without_a_gradient_are_not_updated_and_adamw_counts_the_tasks_updates() {
        let opt = ServerOptimizer::AdamW { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-7, weight_decay: 0.5 };
        let mut s = task(&opt, PsMode::Async);
        push(&mut s, "worker:0", 0, 0, &[("a", &[1.0, -1.0])]);
        assert_eq!(value(&s, "b"), vec![3.0], "no decay without a gradient");
        assert!(s.vars[s.index["b"]].slots.iter().all(|sl| sl.iter().all(|x| *x == 0.0)));
        push(&mut s, "worker:0", 1, 1, &[]);
        assert_eq!(s.version(), 2, "an empty push is an update of the task");
        push(&mut s, "worker:0", 2, 2, &[("b", &[0.5])]);
        // One step of AdamW on b at t = 3, from zero moments.
        let mut w = vec![3.0f32];
        let mut slots = opt.new_slots(1);
        let mut refs: Vec<&mut [f32]> = slots.iter_mut().map(Vec::as_mut_slice).collect();
        opt.apply(&mut w, &[0.5], &mut refs, 3);
        assert_eq!(value(&s, "b")[0].to_bits(), w[0].to_bits());
        assert_eq!(s.vars[s.index["b"]].version, 1);
    }

    /// A variable of state takes the pushed change as it is (added, no optimizer), whether
    /// collected, streamed or in a sync round (the round's mean change).
    #[test]
    fn state_adds_the_pushed_change() {
        let opt = ServerOptimizer::AdamW { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-7, weight_decay: 0.5 };
        for mode in [PsMode::Async, PsMode::Sync { workers: 2, backup_workers: 0 }] {
            for streamed in [false, true] {
                let mut b = VariableInfo::whole("b", vec![1]);
                b.state = true;
                let mut state = task_with(&opt, mode, streamed.then_some(0), b);
                let h = |worker: &str, step| PushHeader {
                    id: UpdateId { worker: worker.into(), client: "c".into(), step, seq: 0 },
                    base_version: 0,
                    variables: vec!["b".into()],
                    rows: Vec::new(),
                };
                let c = vec![Chunk { var: 0, offset: 0, pieces: vec![bytes_of(&[0.25])] }];
                if streamed && mode == PsMode::Async {
                    let mut stream = state.begin_stream(&h("worker:0", 0)).unwrap();
                    stream.apply(&c[0]).unwrap();
                    state.finish_stream(stream).unwrap();
                } else {
                    state.push(&h("worker:0", 0), &c).unwrap();
                    if mode != PsMode::Async {
                        state
                            .push(&h("worker:1", 1), &[Chunk { var: 0, offset: 0, pieces: vec![bytes_of(&[0.75])] }])
                            .unwrap();
                    }
                }
                let want = if mode == PsMode::Async { 3.25 } else { 3.5 };
                assert_eq!(value(&state, "b"), vec![want], "{mode:?} streamed {streamed}");
                assert!(state.vars[state.index["b"]].slots.iter().all(|sl| sl.iter().all(|x| *x == 0.0)));
                assert_eq!(value(&state, "a"), vec![1.0, 2.0]);
            }
        }
    }

    /// A sync round averages over its pushes, counting zeros for a push without a variable's
    /// gradient, and leaves a variable no push carries alone.
    #[test]
    fn a_sync_round_counts_zeros_for_a_missing_gradient() {
        let mut s = task(&ServerOptimizer::Sgd { lr: 1.0 }, PsMode::Sync { workers: 2, backup_workers: 0 });
        push(&mut s, "worker:0", 0, 0, &[("a", &[2.0, 4.0])]);
        push(&mut s, "worker:1", 1, 0, &[]);
        assert_eq!(s.version(), 1);
        assert_eq!(value(&s, "a"), vec![0.0, 0.0], "mean of [2, 4] and zeros is [1, 2]");
        assert_eq!(value(&s, "b"), vec![3.0]);
    }
}

#[cfg(test)]
mod stream_tests {
    use super::*;
    use crate::{ErrorKind, UpdateId, MAX_CHUNK_ELEMENTS};

    const NAMES: [&str; 3] = ["a", "b", "c"];
    /// Three chunks and a tail, one element, and a chunk and a tail.
    const SIZES: [usize; 3] = [MAX_CHUNK_ELEMENTS * 3 + 5, 1, MAX_CHUNK_ELEMENTS + 70_001];

    fn optimizers() -> [ServerOptimizer; 5] {
        [
            ServerOptimizer::Sgd { lr: 0.1 },
            ServerOptimizer::Momentum { lr: 0.1, momentum: 0.9, nesterov: false },
            ServerOptimizer::Momentum { lr: 0.1, momentum: 0.9, nesterov: true },
            ServerOptimizer::AdamW { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-7, weight_decay: 0.01 },
            ServerOptimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 1e-7 },
        ]
    }

    /// A task holding [`NAMES`] of [`SIZES`], streaming pushes of any size or none.
    fn task(optimizer: &ServerOptimizer, streamed: bool) -> State {
        let mut state = State::new("ps:0".into(), streamed.then_some(0));
        let header = CreateHeader {
            variables: NAMES.iter().zip(SIZES).map(|(n, s)| VariableInfo::whole(*n, vec![s])).collect(),
            optimizer: optimizer.clone(),
            schedule: None,
            stale_rate: crate::StaleRate::Constant,
            mode: PsMode::Async,
            wire_format: WireFormat::F32,
            tables: Vec::new(),
        };
        let chunks: Vec<Chunk> = SIZES
            .iter()
            .enumerate()
            .map(|(v, &n)| {
                let x: Vec<f32> = (0..n).map(|i| ((i * 31 + v) % 97) as f32 * 0.01 - 0.3).collect();
                Chunk { var: v as u32, offset: 0, pieces: vec![Bytes::copy_from_slice(bytemuck::cast_slice(&x))] }
            })
            .collect();
        state.create(&header, &chunks).unwrap();
        state
    }

    fn header(key: &str, step: u64, order: &[usize]) -> PushHeader {
        PushHeader {
            id: UpdateId { worker: "worker:0".into(), client: key.into(), step, seq: 0 },
            base_version: 0,
            variables: order.iter().map(|&v| NAMES[v].to_string()).collect(),
            rows: Vec::new(),
        }
    }

    /// The chunks of a push of `order`'s variables, step `step`'s gradients, in frames of
    /// 65,539 elements at odd addresses (as a connection cuts them).
    fn chunks(step: u64, order: &[usize]) -> Vec<Chunk> {
        let mut out = Vec::new();
        for (k, &v) in order.iter().enumerate() {
            let g: Vec<f32> = (0..SIZES[v]).map(|i| ((i * 17 + step as usize * 7) % 89) as f32 * 0.1 - 4.0).collect();
            for (i, c) in g.chunks(MAX_CHUNK_ELEMENTS).enumerate() {
                let pieces = misaligned_pieces(c, 65_539);
                out.push(Chunk { var: k as u32, offset: (i * MAX_CHUNK_ELEMENTS) as u64, pieces });
            }
        }
        out
    }

    /// Each variable's version, values and slots, as bits.
    fn bits(s: &State) -> Vec<(u64, Vec<u32>, Vec<Vec<u32>>)> {
        let b = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
        s.vars.iter().map(|v| (v.version, b(&v.value), v.slots.iter().map(|s| b(s)).collect())).collect()
    }

    fn streamed(s: &mut State, h: &PushHeader, chunks: &[Chunk]) -> Result<PushDecision> {
        let mut stream = s.begin_stream(h).expect("the push is streamed");
        for c in chunks {
            stream.apply(c)?;
        }
        s.finish_stream(stream)
    }

    fn applied(d: PushDecision) -> u64 {
        match d {
            PushDecision::Done(PushReply::Applied { duplicate: false, version }) => version,
            _ => panic!("not a fresh apply"),
        }
    }

    /// Streamed pushes (out of place, chunk by chunk, into recycled buffers) leave every
    /// variable and optimizer slot with the bits of the same pushes applied in place, for each
    /// optimizer, over steps that reach the variables in different orders; and a pull while a
    /// push streams sees the values from before it.
    #[test]
    fn streamed_pushes_give_the_bits_of_pushes_applied_in_place() {
        for opt in optimizers() {
            let (mut in_place, mut streaming) = (task(&opt, false), task(&opt, true));
            for step in 0..4u64 {
                let order: Vec<usize> = (0..3).map(|k| (k + step as usize) % 3).collect();
                let (h, c) = (header("w", step, &order), chunks(step, &order));
                assert_eq!(applied(in_place.push(&h, &c).unwrap()), step + 1);
                let before = streaming.pull(&[]).unwrap().chunks;
                let mut stream = streaming.begin_stream(&h).expect("streamed");
                assert!(streaming.begin_stream(&header("other", step, &[0])).is_none(), "one stream at a time");
                for c in &c {
                    stream.apply(c).unwrap();
                    let now = streaming.pull(&[]).unwrap().chunks;
                    assert!(
                        now.iter().zip(&before).all(|(a, b)| a.data == b.data),
                        "{opt:?}: a pull saw a partial push"
                    );
                }
                assert_eq!(applied(streaming.finish_stream(stream).unwrap()), step + 1);
                // The pull from before the push still holds the replaced values: the next
                // streamed push takes them once it is done.
                drop(before);
                assert!(bits(&in_place) == bits(&streaming), "{opt:?} step {step}: streamed bits differ");
            }
            assert_eq!((in_place.counters.pushes_streamed, streaming.counters.pushes_streamed), (0, 4));
            assert_eq!(streaming.counters.pushes_applied, 4);
            assert!(
                streaming.spare.iter_mut().all(|s| s.take().and_then(unwrap_spare).is_some()),
                "the replaced buffers are kept for the next push"
            );
        }
    }

    /// A streamed push that breaks off, covers too little, or sends a chunk out of order
    /// changes nothing and is not recorded: the same update applies afterwards.
    #[test]
    fn a_streamed_push_that_breaks_off_or_is_incomplete_changes_nothing() {
        let opt = ServerOptimizer::AdamW { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-7, weight_decay: 0.01 };
        let mut s = task(&opt, true);
        let start = bits(&s);
        let (h, c) = (header("w", 0, &[0, 1, 2]), chunks(0, &[0, 1, 2]));
        // Broken off after one chunk (the connection went away).
        let mut stream = s.begin_stream(&h).unwrap();
        stream.apply(&c[0]).unwrap();
        s.abort_stream(stream);
        assert!(!s.streaming());
        // The last chunk missing.
        let e = streamed(&mut s, &h, &c[..c.len() - 1]).expect_err("incomplete");
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(
            matches!(&e, Error::Incomplete { variable, request: RequestKind::Push, .. } if variable == "c"),
            "{e:?}"
        );
        assert!(e.to_string().contains("variable c has") && e.to_string().contains("the push covers"), "{e:?}");
        // A chunk out of order.
        let e = streamed(&mut s, &h, &[c[1].clone(), c[0].clone()]).expect_err("out of order");
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(matches!(e, Error::ChunkOutOfOrder { .. }), "{e:?}");
        assert!(e.to_string().contains("must cover each variable in order"), "{e:?}");
        s.streaming = false; // the server aborts a stream whose chunk was refused
        assert!(bits(&s) == start, "a refused streamed push changed the task");
        assert_eq!((s.version, s.counters.pushes_applied), (0, 0));
        assert_eq!(applied(streamed(&mut s, &h, &c).unwrap()), 1);
    }

    /// An update applied while a push streams (its stream stalled) makes the streamed push
    /// fail with ABORTED and change nothing; sent again it applies once, and a third time it
    /// is a duplicate. The result equals the two updates applied in place in that order.
    #[test]
    fn a_push_applied_under_a_streamed_one_aborts_it_and_its_retry_applies_once() {
        let opt = ServerOptimizer::Momentum { lr: 0.1, momentum: 0.9, nesterov: true };
        let (mut s, mut reference) = (task(&opt, true), task(&opt, false));
        let (h1, c1) = (header("slow", 0, &[0, 1, 2]), chunks(1, &[0, 1, 2]));
        let (h2, c2) = (header("fast", 0, &[2, 0]), chunks(2, &[2, 0]));
        let mut stream = s.begin_stream(&h1).unwrap();
        for c in &c1 {
            stream.apply(c).unwrap();
        }
        assert_eq!(applied(s.push(&h2, &c2).unwrap()), 1);
        let e = s.finish_stream(stream).expect_err("aborted");
        assert_eq!(e.kind(), ErrorKind::Aborted, "{e:?}");
        assert!(matches!(e, Error::Overtaken { .. }), "{e:?}");
        assert_eq!((s.version, s.counters.pushes_aborted, s.counters.pushes_applied), (1, 1, 1));
        assert_eq!(applied(streamed(&mut s, &h1, &c1).unwrap()), 2);
        assert!(s.begin_stream(&h1).is_none(), "an update already taken is not streamed again");
        match s.push(&h1, &c1).unwrap() {
            PushDecision::Done(PushReply::Applied { duplicate: true, version: 2 }) => {}
            _ => panic!("the third send is not answered as a duplicate"),
        }
        reference.push(&h2, &c2).unwrap();
        reference.push(&h1, &c1).unwrap();
        assert!(bits(&s) == bits(&reference), "the retried push did not apply onto the newer values");
    }
}

#[cfg(test)]
mod limits_tests {
    use super::*;
    use crate::limits::MAX_NAME_BYTES;
    use crate::{ErrorKind, UpdateId, MAX_VARIABLE_ELEMENTS};

    fn f32s(x: &[f32]) -> Bytes {
        Bytes::copy_from_slice(bytemuck::cast_slice(x))
    }

    fn task(mode: PsMode, streamed: bool) -> State {
        let mut s = State::new("ps:0".into(), streamed.then_some(0));
        let header = CreateHeader {
            variables: vec![VariableInfo::whole("w", vec![4])],
            optimizer: ServerOptimizer::Sgd { lr: 0.5 },
            schedule: None,
            stale_rate: crate::StaleRate::Constant,
            mode,
            wire_format: WireFormat::F32,
            tables: Vec::new(),
        };
        s.create(&header, &[Chunk { var: 0, offset: 0, pieces: vec![f32s(&[1.0, 2.0, 3.0, 4.0])] }]).unwrap();
        s
    }

    fn push_header(worker: &str, step: u64) -> PushHeader {
        PushHeader {
            id: UpdateId { worker: worker.into(), client: "c".into(), step, seq: 0 },
            base_version: 0,
            variables: vec!["w".into()],
            rows: Vec::new(),
        }
    }

    fn grad(g: [f32; 4]) -> Vec<Chunk> {
        vec![Chunk { var: 0, offset: 0, pieces: vec![f32s(&g)] }]
    }

    fn values(s: &State) -> Vec<f32> {
        s.vars[0].value.to_vec()
    }

    /// A NaN or infinite gradient is refused in every mode, streamed or not: nothing is
    /// applied, nothing is recorded, and the corrected push applies afterwards.
    #[test]
    fn non_finite_gradients_are_refused_never_applied() {
        let modes = [PsMode::Async, PsMode::Stale { staleness: 2 }, PsMode::Sync { workers: 1, backup_workers: 0 }];
        for (mode, streamed) in modes.into_iter().flat_map(|m| [(m, false), (m, true)]) {
            let mut s = task(mode, streamed);
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let h = push_header("worker:0", 0);
                let chunks = grad([0.5, 0.5, bad, 0.5]);
                let e = match s.begin_stream(&h) {
                    Some(mut stream) => {
                        let e = stream.apply(&chunks[0]).unwrap_err();
                        s.abort_stream(stream);
                        e
                    }
                    None => s.push(&h, &chunks).unwrap_err(),
                };
                assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{mode} streamed={streamed}: {e}");
                assert!(
                    matches!(&e, Error::NonFiniteGradient { variable, element: 2, .. } if variable == "w"),
                    "{mode}: {e}"
                );
                assert_eq!(values(&s), vec![1.0, 2.0, 3.0, 4.0], "{mode}: applied");
                assert_eq!((s.version, s.counters.pushes_applied), (0, 0));
                assert!(s.answer(&("c".into(), 0, 0)).is_none(), "a refused push is not recorded");
            }
            let h = push_header("worker:0", 0);
            match s.begin_stream(&h) {
                Some(mut stream) => {
                    stream.apply(&grad([2.0; 4])[0]).unwrap();
                    s.finish_stream(stream).unwrap();
                }
                None => {
                    s.push(&h, &grad([2.0; 4])).unwrap();
                }
            }
            assert_eq!(values(&s), vec![0.0, 1.0, 2.0, 3.0], "{mode}: the corrected push applies");
        }
    }

    #[test]
    fn non_finite_initial_values_are_refused() {
        let mut s = State::new("ps:0".into(), None);
        let header = CreateHeader {
            variables: vec![VariableInfo::whole("w", vec![2])],
            optimizer: ServerOptimizer::Sgd { lr: 0.5 },
            schedule: None,
            stale_rate: crate::StaleRate::Constant,
            mode: PsMode::Async,
            wire_format: WireFormat::F32,
            tables: Vec::new(),
        };
        let e = s.create(&header, &[Chunk { var: 0, offset: 0, pieces: vec![f32s(&[1.0, f32::NAN])] }]).unwrap_err();
        assert!(matches!(&e, Error::NonFiniteValue { element: 1, .. }), "{e}");
        assert!(s.vars.is_empty() && s.optimizer.is_none(), "nothing was created");
    }

    #[test]
    fn live_worker_counts_are_checked() {
        let mut s = task(PsMode::Sync { workers: 3, backup_workers: 0 }, false);
        for live in [0, 4, u32::MAX] {
            let e = s.configure(live).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument);
            assert_eq!(e.to_string(), format!("live_workers {live} is out of range; a job has 1 to 3 workers"));
        }
        assert!(!s.configure(3).unwrap());
        let mut fresh = State::new("ps:1".into(), None);
        assert!(fresh.configure(0).is_err());
        assert!(fresh.configure(MAX_WORKERS + 1).is_err());
        assert!(!fresh.configure(MAX_WORKERS).unwrap());
    }

    #[test]
    fn names_are_bounded_before_anything_is_looked_up() {
        let mut s = task(PsMode::Async, false);
        let long = "w".repeat(10 << 10);
        for h in [
            push_header(&long, 0),
            PushHeader {
                id: UpdateId { client: long.clone(), ..push_header("worker:0", 0).id },
                ..push_header("x", 0)
            },
            PushHeader { variables: vec![long.clone()], ..push_header("worker:0", 0) },
        ] {
            let e = s.push(&h, &grad([1.0; 4])).unwrap_err();
            assert!(matches!(e, Error::NameTooLong { bytes: 10240, .. }), "{e}");
            assert!(e.to_string().contains(&format!("over the limit of {MAX_NAME_BYTES} bytes")), "{e}");
            assert!(s.begin_stream(&h).is_none());
        }
        let e = s.pull(&[long]).unwrap_err();
        assert!(matches!(e, Error::NameTooLong { what: "variable", .. }), "{e}");
        assert_eq!(s.version, 0);
    }

    #[test]
    fn the_number_and_size_of_variables_are_bounded() {
        let mut s = State::new("ps:0".into(), None);
        let sgd = ServerOptimizer::Sgd { lr: 0.5 };
        // Three variables of the largest size: 24 GiB declared, refused before any chunk.
        let big = CreateHeader {
            variables: (0..3).map(|i| VariableInfo::whole(format!("v{i}"), vec![MAX_VARIABLE_ELEMENTS])).collect(),
            optimizer: sgd.clone(),
            schedule: None,
            stale_rate: crate::StaleRate::Constant,
            mode: PsMode::Async,
            wire_format: WireFormat::F32,
            tables: Vec::new(),
        };
        let e = s.create(&big, &[]).unwrap_err();
        assert!(matches!(e, Error::TaskTooLarge { bytes, .. } if bytes == 3 * 4 * MAX_VARIABLE_ELEMENTS as u64), "{e}");
        assert!(e.to_string().contains("over the limit of 17179869184"), "{e}");
        // One variable too many.
        let many = CreateHeader {
            variables: (0..=MAX_VARIABLES).map(|i| VariableInfo::whole(format!("v{i}"), vec![0])).collect(),
            optimizer: sgd,
            schedule: None,
            stale_rate: crate::StaleRate::Constant,
            mode: PsMode::Async,
            wire_format: WireFormat::F32,
            tables: Vec::new(),
        };
        let e = s.create(&many, &[]).unwrap_err();
        assert!(matches!(e, Error::TooManyVariables { count, .. } if count == MAX_VARIABLES + 1), "{e}");
        assert!(s.vars.is_empty());
    }

    #[test]
    fn worker_names_beyond_the_limit_are_refused() {
        let mut s = task(PsMode::Async, false);
        for i in 0..MAX_WORKERS as u64 {
            s.push(&push_header(&format!("worker:{i}"), i), &grad([0.0; 4])).unwrap();
        }
        let e = s.push(&push_header("one-more", 1 << 40), &grad([0.0; 4])).unwrap_err();
        assert!(matches!(e, Error::TooManyWorkerNames { .. }), "{e}");
        // A known worker pushes on.
        s.push(&push_header("worker:7", 1 << 41), &grad([0.0; 4])).unwrap();
        assert_eq!(s.counters.applied_by_worker.len(), MAX_WORKERS as usize);
    }
}

#[cfg(test)]
pub(crate) mod schedule_tests {
    use super::*;
    use crate::UpdateId;

    fn f32s(x: &[f32]) -> Bytes {
        Bytes::copy_from_slice(bytemuck::cast_slice(x))
    }

    /// Warm-up over 2 steps to 0.5, cosine down to 0.05 at step 6.
    pub(crate) const SCHEDULE: LrSchedule =
        LrSchedule::WarmupCosine { peak: 0.5, warmup_steps: 2, total_steps: 6, final_lr: 0.05 };
    const W0: [f32; 3] = [1.0, -2.0, 0.75];

    /// A task of SGD (whose own rate, 7, the schedule replaces) holding `w` = [`W0`].
    pub(crate) fn task(schedule: Option<LrSchedule>, mode: PsMode, stream_min_bytes: Option<usize>) -> State {
        let mut s = State::new("ps:0".into(), stream_min_bytes);
        let header = CreateHeader {
            variables: vec![VariableInfo::whole("w", vec![3])],
            optimizer: ServerOptimizer::Sgd { lr: 7.0 },
            schedule,
            stale_rate: crate::StaleRate::Constant,
            mode,
            wire_format: WireFormat::F32,
            tables: Vec::new(),
        };
        s.create(&header, &[Chunk { var: 0, offset: 0, pieces: vec![f32s(&W0)] }]).unwrap();
        s
    }

    fn header(worker: &str, step: u64, base: u64) -> PushHeader {
        PushHeader {
            id: UpdateId { worker: worker.into(), client: "c".into(), step, seq: 0 },
            base_version: base,
            variables: vec!["w".into()],
            rows: Vec::new(),
        }
    }

    /// Pushes `g` (collected, or streamed when the task streams) and returns the decision.
    pub(crate) fn push(s: &mut State, worker: &str, step: u64, g: &[f32]) -> PushDecision {
        let h = header(worker, step, s.version());
        let chunks = [Chunk { var: 0, offset: 0, pieces: vec![f32s(g)] }];
        match s.begin_stream(&h) {
            Some(mut stream) => {
                stream.apply(&chunks[0]).unwrap();
                s.finish_stream(stream).unwrap()
            }
            None => s.push(&h, &chunks).unwrap(),
        }
    }

    pub(crate) fn w(s: &State) -> Vec<f32> {
        s.vars[0].value.to_vec()
    }

    /// The gradient of step `k`: known, different every step.
    pub(crate) fn grad(k: u64) -> [f32; 3] {
        let k = k as f32;
        [0.5 + k, -1.25 * (k + 1.0), 3.0 - 0.5 * k]
    }

    /// `value - lr(step) * g` in f32, element by element: SGD at the schedule's rate of the step.
    fn expected(value: &[f32], step: u64, g: &[f32]) -> Vec<f32> {
        let lr = SCHEDULE.at(step) as f32;
        value.iter().zip(g).map(|(w, g)| w - lr * g).collect()
    }

    pub(crate) fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Async mode, collected and streamed: push number `k` (the task's version before it) is
    /// applied at the schedule's rate of step `k`, exactly `value - lr(k) * g`: 0 at the first
    /// step (the warm-up starts at 0), the peak after the warm-up, the final rate after the
    /// decay; a retry is no step.
    #[test]
    fn sgd_under_a_warmup_cosine_schedule_applies_each_steps_rate() {
        for stream in [None, Some(0)] {
            let mut s = task(Some(SCHEDULE.clone()), PsMode::Async, stream);
            let mut value = W0.to_vec();
            for k in 0..9u64 {
                let g = grad(k);
                assert_eq!(s.version(), k);
                let d = push(&mut s, "worker:0", k, &g);
                assert!(
                    matches!(d, PushDecision::Done(PushReply::Applied { version, duplicate: false }) if version == k + 1)
                );
                value = expected(&value, k, &g);
                assert_eq!(
                    bits(&w(&s)),
                    bits(&value),
                    "step {k} (lr {}), streamed: {}",
                    SCHEDULE.at(k),
                    stream.is_some()
                );
                if k == 0 {
                    assert_eq!(w(&s), W0, "the first step's rate is 0");
                    // A retry of the update is answered from the table and is no step.
                    let retry = [Chunk { var: 0, offset: 0, pieces: vec![f32s(&g)] }];
                    s.push(&header("worker:0", 0, 0), &retry).unwrap();
                    assert_eq!((s.version(), bits(&w(&s))), (1, bits(&value)));
                }
            }
            assert_eq!(s.status().schedule, Some(SCHEDULE));
            assert_eq!(s.counters.pushes_streamed > 0, stream.is_some());
        }
    }

    /// Sync mode: one applied round is one step, at the step's rate, with the round's mean.
    #[test]
    fn a_sync_round_is_one_step() {
        let mut s = task(Some(SCHEDULE.clone()), PsMode::Sync { workers: 2, backup_workers: 0 }, None);
        let mut value = W0.to_vec();
        for k in 0..8u64 {
            let (g0, g1) = (grad(k), grad(k + 10));
            assert!(matches!(push(&mut s, "worker:0", 2 * k, &g0), PushDecision::Wait { .. }));
            assert_eq!(s.version(), k, "half a round is no step");
            push(&mut s, "worker:1", 2 * k + 1, &g1);
            assert_eq!(s.version(), k + 1);
            // The round's mean as the task sums it: `(0 + g0) + g1`, times 1/2.
            let mean: Vec<f32> = g0.iter().zip(&g1).map(|(a, b)| ((a + 0.0) + b) * 0.5).collect();
            value = expected(&value, k, &mean);
            assert_eq!(bits(&w(&s)), bits(&value), "round {k}");
        }
    }

    /// A task without a schedule applies its optimizer's own rate every step.
    #[test]
    fn without_a_schedule_the_rate_is_constant() {
        let mut s = task(None, PsMode::Async, None);
        push(&mut s, "worker:0", 0, &[1.0, 1.0, 1.0]);
        assert_eq!(w(&s), vec![1.0 - 7.0, -2.0 - 7.0, 0.75 - 7.0]);
        assert_eq!(s.status().schedule, None);
    }

    /// A schedule that cannot be followed is refused before anything is created, with one line
    /// naming the field; the task accepts exactly the schedules strata-core's `validate` does.
    #[test]
    fn a_bad_schedule_is_refused_naming_the_field() {
        let cosine = |peak, warmup_steps, total_steps, final_lr| LrSchedule::WarmupCosine {
            peak,
            warmup_steps,
            total_steps,
            final_lr,
        };
        let cases = [
            (
                cosine(0.5, 5, 5, 0.0),
                "warmup_cosine learning-rate schedule: total_steps 5 with warmup_steps 5: the decay must end after the warm-up; use more total_steps than warmup_steps",
            ),
            (cosine(0.0, 1, 5, 0.0), "warmup_cosine learning-rate schedule: peak 0: use a finite rate above 0"),
            (
                LrSchedule::WarmupLinear { peak: 0.5, warmup_steps: 1, total_steps: 5, final_lr: -0.1 },
                "warmup_linear learning-rate schedule: final_lr -0.1: use a finite rate of 0 or more",
            ),
            (LrSchedule::Constant { lr: f64::NAN }, "constant learning-rate schedule: lr NaN: use a finite rate of 0 or more"),
        ];
        for (schedule, message) in cases {
            let mut s = State::new("ps:0".into(), None);
            let header = CreateHeader {
                variables: vec![VariableInfo::whole("w", vec![3])],
                optimizer: ServerOptimizer::Sgd { lr: 7.0 },
                schedule: Some(schedule.clone()),
                stale_rate: crate::StaleRate::Constant,
                mode: PsMode::Async,
                wire_format: WireFormat::F32,
                tables: Vec::new(),
            };
            let e = s.create(&header, &[Chunk { var: 0, offset: 0, pieces: vec![f32s(&W0)] }]).unwrap_err();
            assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument, "{e}");
            assert_eq!(e.to_string(), message);
            assert!(s.vars.is_empty() && s.optimizer.is_none() && s.schedule.is_none(), "nothing was created");
        }
        for peak in [-1.0, 0.0, 0.5, f64::INFINITY, f64::NAN] {
            for final_lr in [-0.5, 0.0, 0.1, f64::NAN] {
                for (warmup_steps, total_steps) in [(0, 0), (0, 1), (3, 3), (3, 2), (3, 4)] {
                    let s = cosine(peak, warmup_steps, total_steps, final_lr);
                    assert_eq!(crate::check_schedule(&s).is_ok(), s.validate().is_ok(), "{s:?}");
                }
                let c = LrSchedule::Constant { lr: peak };
                assert_eq!(crate::check_schedule(&c).is_ok(), c.validate().is_ok(), "{c:?}");
            }
        }
    }
}
