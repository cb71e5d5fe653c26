//! ZeRO stage 3's parameters ([`Residency`]): each replica holds its shard of every trainable
//! parameter, its pieces (own copies, which its optimizer steps: the master values), and a
//! variable's whole value exists only while the step uses it. A variable is released with
//! candle's `Tensor::release_storage` (Strata's patch): its elements are freed, and its next
//! use, by any op of the forward or backward pass or by a program reading it, brings them back
//! from every replica's pieces ([`Source`]). Variables are grouped in units ([`unit_name`]);
//! when a replica's step first uses a variable of another unit than the last one it brought
//! back, that last unit is released, as FSDP2 reshards a module after its forward, and after
//! every optimizer step all of them are.
//!
//! On one machine every replica's pieces are in this process's memory, so a variable comes
//! back by copying its runs out of them, without a collective: a replica's use needs no other
//! replica to use the same variable at the same time, and a program may read a variable
//! between steps. The pieces change only in the optimizer step, which ends with a barrier
//! before the variables are released, so a copy never reads a piece while it is stepped.
//!
//! Across workers the other workers' runs are pulled from them, not gathered in a collective:
//! each worker answers its peers' requests from a thread of the transport's
//! ([`WorkerCollectives::serve_pieces`](crate::cross_device::WorkerCollectives::serve_pieces)),
//! so no worker has to bring units back in the order another does, and a worker may read a
//! variable alone (the chief, for a checkpoint). A request names the version of the pieces it
//! needs: the updates (optimizer steps, loads of a checkpoint) its copy has made, which every
//! worker makes alike. A worker behind it waits to reach it before it answers; none can be
//! past it, since no worker steps again before every worker's gradient of the step arrives.
//! After the last step [`Residency::unshard`] (collective) makes every variable whole on every
//! worker, so that a worker reads its model without its peers once they are gone.
//!
//! In an elastic job the shards follow the membership ([`Residency::reshard`]): the members
//! lay them out over the new one, start a new service over its ring, and count versions from
//! the new generation's (a version's high 32 bits are the generation), so that no request or
//! value pulled ahead of an earlier generation is ever taken for one of this one. A worker that
//! joins under way keeps its variables whole until it first lays its shards out with the
//! members.
//!
//! This module must not know the optimizer nor how gradients are reduced: it holds the
//! variables and brings them back from the shards.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError, RwLock, Weak};
use std::time::Instant;

use candle_core::{DType, Device, StorageSource, Tensor, Var};

use super::ahead::Ahead;
use super::Shards;
use crate::cross_device::{PeerPieces, PieceSource};
use crate::{Error, Result};

/// The unit a variable named `name` belongs to by default: its name's first part, or its
/// first two when the second is a number (`layer.3.attn.q.weight` is in `layer.3`,
/// `embed.weight` in `embed`, `w` in `w`), as FSDP2 wraps each block of a model's list.
pub fn unit_name(name: &str) -> &str {
    let mut parts = name.split('.');
    let first = parts.next().unwrap_or(name);
    match parts.next() {
        Some(second) if !second.is_empty() && second.bytes().all(|b| b.is_ascii_digit()) => {
            &name[..first.len() + 1 + second.len()]
        }
        _ => first,
    }
}

/// The unit of the variable named `name`: the longest of the program's `units` (prefixes) it
/// starts with, followed by a dot or its end, otherwise its default [`unit_name`].
pub(crate) fn unit_of<'a>(name: &'a str, units: &'a [String]) -> &'a str {
    units
        .iter()
        .filter(|u| name == u.as_str() || name.strip_prefix(u.as_str()).is_some_and(|rest| rest.starts_with('.')))
        .max_by_key(|u| u.len())
        .map_or_else(|| unit_name(name), String::as_str)
}

/// Refuses a program's unit (a prefix of `ZeroStage::Parameters`' units) that names none of the
/// trainable variables `names`, or an empty one.
pub(crate) fn check_units(names: &[String], units: &[String]) -> Result<()> {
    for u in units {
        if u.is_empty() || !names.iter().any(|n| unit_of(n, units) == u.as_str()) {
            let known: Vec<&str> = names.iter().take(4).map(String::as_str).collect();
            return Err(Error::ZeroUnit {
                unit: u.clone(),
                named_like: known.join(", "),
                example: names.first().map_or("layer.0", |n| unit_name(n)).to_string(),
            });
        }
    }
    Ok(())
}

/// The elements of the two largest units of `vars` (a copy's trainable variables, named
/// `names`, with the program's `units`): what stage 3 holds whole at once besides its shard.
pub(crate) fn two_largest_units(names: &[String], vars: &[Var], custom: &[String]) -> usize {
    let mut units: Vec<(&str, usize)> = Vec::new();
    for (n, v) in names.iter().zip(vars) {
        let u = unit_of(n, custom);
        match units.iter_mut().find(|(x, _)| *x == u) {
            Some((_, e)) => *e += v.elem_count(),
            None => units.push((u, v.elem_count())),
        }
    }
    units.sort_unstable_by_key(|u| std::cmp::Reverse(u.1));
    units.iter().take(2).map(|(_, e)| e).sum()
}

/// A pull ahead: copy, variables, version.
type PullJob = (usize, Vec<usize>, u64);

/// Each local replica's variables at stage 3, their units, and the unit each replica brought
/// back last.
#[derive(Debug)]
pub(crate) struct Residency {
    /// The shards, laid out again when an elastic job's membership changes.
    shards: RwLock<Arc<Shards>>,
    /// Each local copy's trainable variables, in the optimizer's order.
    vars: Vec<Vec<Var>>,
    /// Each variable's unit.
    unit_of: Vec<usize>,
    /// Each unit's variables.
    units: Vec<Vec<usize>>,
    /// Each unit's name.
    names: Vec<String>,
    /// Each local copy's unit brought back last (`None` after a step).
    current: Vec<Mutex<Option<usize>>>,
    /// This residency, for the sources it hands to the variables it releases.
    me: Weak<Residency>,
    /// Across workers: the requests for the other workers' pieces, with the generation of the
    /// membership whose ring serves them (one service per generation).
    peers: RwLock<Option<(u64, Arc<dyn PeerPieces>)>>,
    /// Each local copy's updates of its pieces so far (optimizer steps and loads) above its
    /// generation's base ([`version_base`]): the version a request for pieces names.
    versions: Mutex<Vec<u64>>,
    /// Notified when a version changes.
    updated: Condvar,
    /// After [`Self::unshard`]: every variable stays whole.
    held: AtomicBool,
    /// Between [`Self::begin_load`] and [`Self::loaded`]: a variable comes back as zeros, to
    /// be overwritten.
    loading: AtomicBool,
    /// Across workers: the next unit, pulled ahead.
    ahead: Ahead,
    /// The thread that pulls ahead (started at the first pull).
    puller: Mutex<Option<std::sync::mpsc::Sender<PullJob>>>,
    /// Across workers: the variables brought back from values pulled ahead, and those pulled
    /// when used.
    pulls: [std::sync::atomic::AtomicU64; 2],
    /// Across workers: why an op's use could not bring a variable back (it computed on with
    /// NaN), until the shards are laid out again: no step is applied meanwhile.
    failed: Mutex<Option<String>>,
}

impl Residency {
    /// The residency of `vars` (every local copy's trainable variables, named `names` in the
    /// optimizer's order) over `shards` (their stage 3 pieces), in the program's `units` and
    /// the default ones, every variable released.
    pub(crate) fn new(
        shards: Arc<Shards>,
        vars: Vec<Vec<Var>>,
        names: &[String],
        custom: &[String],
    ) -> Result<Arc<Self>> {
        let workers = shards.ext().workers();
        // A worker that joined an elastic job under way starts its service when it first lays
        // its shards out with the members (they do it then); its variables stay whole until.
        let joined = workers.is_some_and(|w| w.is_elastic() && w.joined_under_way());
        let base = version_base(&shards);
        let mut names_of_units: Vec<String> = Vec::new();
        let mut unit_of = Vec::with_capacity(names.len());
        let mut units: Vec<Vec<usize>> = Vec::new();
        for (i, n) in names.iter().enumerate() {
            let u = self::unit_of(n, custom);
            let k = match names_of_units.iter().position(|x| x == u) {
                Some(k) => k,
                None => {
                    names_of_units.push(u.to_string());
                    units.push(Vec::new());
                    names_of_units.len() - 1
                }
            };
            units[k].push(i);
            unit_of.push(k);
        }
        let current = (0..vars.len()).map(|_| Mutex::new(None)).collect();
        let copies = vars.len();
        let r = Arc::new_cyclic(|me| Residency {
            shards: RwLock::new(shards),
            vars,
            unit_of,
            units,
            names: names_of_units,
            current,
            me: me.clone(),
            peers: RwLock::new(None),
            versions: Mutex::new(vec![base; copies]),
            updated: Condvar::new(),
            held: AtomicBool::new(false),
            loading: AtomicBool::new(false),
            ahead: Ahead::new(copies),
            puller: Mutex::new(None),
            pulls: Default::default(),
            failed: Mutex::new(None),
        });
        if !joined {
            r.serve()?;
            for copy in 0..r.vars.len() {
                r.release_all(copy)?;
            }
        }
        Ok(r)
    }

    /// The shards as they are laid out now.
    fn shards(&self) -> Arc<Shards> {
        self.shards.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Across workers: the requests for the other workers' pieces, once served.
    fn peers(&self) -> Option<Arc<dyn PeerPieces>> {
        self.peers.read().unwrap_or_else(PoisonError::into_inner).as_ref().map(|(_, p)| p.clone())
    }

    /// Whether a released variable comes back from other workers' pieces too, and their
    /// service has not started yet (a worker that joined an elastic job under way, before it
    /// laid its shards out with the members): its variables then stay whole.
    fn unserved(&self) -> bool {
        self.shards().workers_runs() > 1 && self.peers().is_none()
    }

    /// Across workers: starts answering the other workers' requests for this worker's pieces,
    /// over the membership's ring now (collective: every worker calls it at the same point),
    /// unless it already does in this generation; the service of an earlier generation stops.
    /// Alone there is nothing to serve.
    fn serve(&self) -> Result<()> {
        let shards = self.shards();
        let Some(w) = shards.ext().workers().filter(|_| shards.workers_runs() > 1) else {
            *self.peers.write().unwrap_or_else(PoisonError::into_inner) = None;
            return Ok(());
        };
        let generation = w.generation();
        if self.peers.read().unwrap_or_else(PoisonError::into_inner).as_ref().is_some_and(|(g, _)| *g == generation) {
            return Ok(());
        }
        // The earlier generation's service stops (its ring is gone): its connections close.
        *self.peers.write().unwrap_or_else(PoisonError::into_inner) = None;
        let source: Weak<dyn PieceSource> = self.me.clone() as Weak<dyn PieceSource>;
        let peers = w.serve_pieces(source)?;
        *self.peers.write().unwrap_or_else(PoisonError::into_inner) = Some((generation, peers));
        Ok(())
    }

    /// An elastic job's membership changed (every member calls it, the same point of the
    /// recovery: a collective): the shards are `shards`, laid out over the new membership
    /// (their pieces of a released variable are zeros: a load of every variable follows, from
    /// the most advanced member or a checkpoint), versions count from the new generation's
    /// base, the service answers over the new ring, and nothing pulled ahead is kept. The
    /// variables stay as they are until the load writes them: whole ones (every one, after a
    /// change the members saw coming and held the model whole for) are then taken into the
    /// new pieces when released, and none is held whole any more.
    pub(crate) fn reshard(&self, shards: Arc<Shards>) -> Result<()> {
        self.ahead.clear();
        *self.failed.lock().unwrap_or_else(PoisonError::into_inner) = None;
        let base = version_base(&shards);
        *self.shards.write().unwrap_or_else(PoisonError::into_inner) = shards;
        {
            let mut v = self.versions.lock().unwrap_or_else(PoisonError::into_inner);
            v.iter_mut().for_each(|x| *x = base);
            self.updated.notify_all();
        }
        for c in &self.current {
            *c.lock().unwrap_or_else(PoisonError::into_inner) = None;
        }
        self.held.store(false, Ordering::Release);
        self.serve()
    }

    /// The units' names, in the order of their first variable.
    pub(crate) fn unit_names(&self) -> &[String] {
        &self.names
    }

    /// Fails where an op's use could not bring a variable back since the shards were laid out
    /// (the step computed with a stand-in): called before a step is applied.
    pub(crate) fn check_restored(&self) -> Result<()> {
        match self.failed.lock().unwrap_or_else(PoisonError::into_inner).as_ref() {
            Some(why) => Err(Error::Cluster(why.clone())),
            None => Ok(()),
        }
    }

    /// An op's use of variable `var` of copy `copy` could not bring it back (`error`): across
    /// workers the op computes on with NaN, the failure is kept ([`Self::check_restored`]) and
    /// this generation's collectives end on this worker, so that nothing computed from the
    /// stand-in reaches another worker or is applied; the step fails at its next collective,
    /// and an elastic job goes on in the next generation. On one machine (nothing to pull) there
    /// is no stand-in: the op panics with the error.
    fn stand_in(&self, copy: usize, var: usize, error: &candle_core::Error) -> Option<Tensor> {
        let shards = self.shards();
        let w = shards.ext().workers().filter(|_| self.peers().is_some())?;
        let why = format!("ZeRO stage 3 could not bring a parameter back: {error}");
        tracing::warn!(%why, "a parameter could not be brought back; this worker's collectives of the generation end");
        self.failed.lock().unwrap_or_else(PoisonError::into_inner).get_or_insert_with(|| why.clone());
        w.abort_generation(&why);
        let v = &self.vars[copy][var];
        Tensor::full(f32::NAN, v.shape(), &Device::Cpu).and_then(|t| t.to_dtype(v.dtype())?.to_device(v.device())).ok()
    }

    /// Before local copy `copy`'s optimizer step: a variable still whole and written since it
    /// was brought back (a checkpoint's or a member's values loaded, a program's assignment)
    /// has its values taken into the copy's pieces, which the step then starts from; its
    /// writes are forgotten then, so that nothing takes the values from before the step back
    /// over the stepped pieces.
    pub(crate) fn settle(&self, copy: usize) -> Result<()> {
        let shards = self.shards();
        for var in 0..self.vars[copy].len() {
            let v = &self.vars[copy][var];
            if !v.is_released() && v.written_since_restore() {
                shards.take_from(copy, var, v)?;
            }
        }
        Ok(())
    }

    /// Held whole: variable `var` of copy `copy` brought back from the pieces now (released,
    /// then restored), so that it holds their values and is not marked written.
    fn refresh(&self, copy: usize, var: usize) -> Result<()> {
        let v = &self.vars[copy][var];
        let source = Arc::new(Source { shards: self.shards(), residency: self.me.clone(), copy, var });
        if v.release_storage(source)? {
            v.make_resident()?;
        }
        Ok(())
    }

    /// Local copy `copy` stepped its pieces (an optimizer step, applied or skipped alike on
    /// every worker): its version moves on, and its variables are released (held whole:
    /// brought back with the stepped values).
    pub(crate) fn stepped(&self, copy: usize) -> Result<()> {
        self.bump(Some(copy));
        if self.held.load(Ordering::Acquire) {
            for var in 0..self.vars[copy].len() {
                self.refresh(copy, var)?;
            }
            return Ok(());
        }
        self.release_all(copy)?;
        if let Some(first) = self.ahead.stepped(copy) {
            self.pull_ahead(copy, first);
        }
        Ok(())
    }

    /// Across workers: pulls unit `unit` of copy `copy` (its released variables) ahead of its
    /// use, on the puller thread, at the copy's version now.
    fn pull_ahead(&self, copy: usize, unit: usize) {
        if self.peers().is_none() || self.held.load(Ordering::Acquire) || self.loading.load(Ordering::Acquire) {
            return;
        }
        let released: Vec<usize> =
            self.units[unit].iter().copied().filter(|&v| self.vars[copy][v].is_released()).collect();
        let version = self.version(copy);
        let current = *self.current[copy].lock().unwrap_or_else(PoisonError::into_inner);
        let in_use = current.map_or(&[][..], |u| &self.units[u][..]);
        let vars = self.ahead.claim(copy, &released, in_use, version);
        if vars.is_empty() {
            return;
        }
        let mut puller = self.puller.lock().unwrap_or_else(PoisonError::into_inner);
        if puller.is_none() {
            let (tx, rx) = std::sync::mpsc::channel::<PullJob>();
            let me = self.me.clone();
            let started = std::thread::Builder::new().name("strata-zero3-ahead".into()).spawn(move || {
                while let Ok((copy, vars, version)) = rx.recv() {
                    let Some(r) = me.upgrade() else { return };
                    for var in vars {
                        let value = r.pull_whole(copy, var, version).map_err(|e| e.to_string());
                        r.ahead.put(copy, var, version, value);
                    }
                }
            });
            if started.is_err() {
                // No thread: every use pulls for itself. The claimed values never arrive.
                drop(puller);
                self.ahead.clear_claims(copy);
                return;
            }
            *puller = Some(tx);
        }
        if puller.as_ref().is_some_and(|tx| tx.send((copy, vars.clone(), version)).is_err()) {
            self.ahead.clear_claims(copy);
        }
    }

    /// Local copy `copy`'s version: the updates its pieces have had.
    fn version(&self, copy: usize) -> u64 {
        self.versions.lock().unwrap_or_else(PoisonError::into_inner)[copy]
    }

    /// Every local copy's variables took a checkpoint's values (every worker loads it): the
    /// versions move on, so that a peer's request of the new version waits for the load.
    pub(crate) fn loaded(&self) {
        self.bump(None);
        self.loading.store(false, Ordering::Release);
    }

    /// Every local copy's variables are about to take a checkpoint's values: until
    /// [`Self::loaded`] a released variable comes back as zeros (they are replaced at once),
    /// without asking the other workers, which may be past this worker's version already.
    pub(crate) fn begin_load(&self) {
        self.loading.store(true, Ordering::Release);
    }

    fn bump(&self, copy: Option<usize>) {
        let mut v = self.versions.lock().unwrap_or_else(PoisonError::into_inner);
        match copy {
            Some(c) => v[c] += 1,
            None => v.iter_mut().for_each(|x| *x += 1),
        }
        self.updated.notify_all();
    }

    /// Brings every variable of every local copy back and keeps them whole from then on
    /// (collective across workers: every worker calls it after its last step, so that each
    /// may read its model once the others are gone). Nothing changes below stage 3's
    /// release after it, and the memory is a whole model's again.
    pub(crate) fn unshard(&self) -> Result<()> {
        if self.held.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        self.ahead.clear();
        // Held from here: a variable brought back is released no more.
        for v in self.vars.iter().flatten() {
            v.make_resident()?;
        }
        if let Some(w) = self.shards().ext().workers().filter(|_| self.peers().is_some()) {
            // No worker leaves before every worker has pulled what it needs from it.
            w.barrier()?;
        }
        Ok(())
    }

    /// Releases every variable of local copy `copy` (after its optimizer step).
    pub(crate) fn release_all(&self, copy: usize) -> Result<()> {
        *self.current[copy].lock().unwrap_or_else(PoisonError::into_inner) = None;
        for var in 0..self.vars[copy].len() {
            self.release(copy, var)?;
        }
        Ok(())
    }

    /// Releases variable `var` of copy `copy`, unless an op holds its storage now (then it
    /// stays until the next release). A variable written since it was brought back (a
    /// checkpoint's values, a program's assignment) first has its values taken into the
    /// copy's own pieces, so that the write is not lost; a program writes every copy of a
    /// mirrored variable, so every replica's pieces take it.
    fn release(&self, copy: usize, var: usize) -> Result<()> {
        let v = &self.vars[copy][var];
        let shards = self.shards();
        if self.held.load(Ordering::Acquire) || self.unserved() {
            if v.written_since_restore() {
                shards.take_from(copy, var, v)?;
            }
            return Ok(());
        }
        if !v.is_released() && v.written_since_restore() {
            shards.take_from(copy, var, v)?;
        }
        let source = Arc::new(Source { shards, residency: self.me.clone(), copy, var });
        v.release_storage(source)?;
        Ok(())
    }

    /// Before variable `var` is joined from every copy's pieces: where another copy still
    /// holds it written since it was brought back (a checkpoint's values, a program's
    /// assignment) and not released since, that copy's pieces take the write now. Otherwise a
    /// replica thread that lags behind (it releases the variable, taking the write, only at
    /// its own next use) hands an earlier value to the replicas ahead of it: a resumed job on
    /// a loaded machine once trained on from a mix of the checkpoint and the initial values.
    fn take_written(&self, var: usize) -> Result<()> {
        let shards = self.shards();
        for (copy, vars) in self.vars.iter().enumerate() {
            let v = &vars[var];
            if !v.is_released() && v.written_since_restore() {
                shards.take_from(copy, var, v)?;
            }
        }
        Ok(())
    }

    /// Variable `var`'s whole value for local copy `copy`: every local copy's writes taken
    /// first, then joined from this worker's pieces and, across workers, the others' pulled
    /// at the copy's version.
    fn bring(&self, copy: usize, var: usize) -> Result<Tensor> {
        if self.loading.load(Ordering::Acquire) {
            let v = &self.vars[copy][var];
            return Ok(Tensor::zeros(v.shape(), v.dtype(), v.device())?);
        }
        if self.peers().is_none() {
            self.take_written(var)?;
            return self.shards().whole(var);
        }
        let version = self.version(copy);
        if let Some(pulled) = self.ahead.take(copy, var, version) {
            self.pulls[0].fetch_add(1, Ordering::Relaxed);
            return pulled.map_err(Error::Cluster);
        }
        self.pulls[1].fetch_add(1, Ordering::Relaxed);
        self.pull_whole(copy, var, version)
    }

    /// Across workers: the variables brought back so far from values pulled ahead of their
    /// use, and those pulled when used.
    pub(crate) fn pulls(&self) -> (u64, u64) {
        (self.pulls[0].load(Ordering::Relaxed), self.pulls[1].load(Ordering::Relaxed))
    }

    /// Variable `var`'s whole value at `version` for local copy `copy`: this worker's pieces
    /// (every local copy's writes taken first) and the other workers', pulled.
    fn pull_whole(&self, copy: usize, var: usize, version: u64) -> Result<Tensor> {
        self.take_written(var)?;
        let shards = self.shards();
        let Some(peers) = self.peers() else { return shards.whole(var) };
        let v = &self.vars[copy][var];
        shards.whole_across(var, v.dtype(), v.device(), |worker, len| {
            peers.pull(worker, var, version, len).map_err(|e| {
                Error::Cluster(format!(
                    "{e} (at ZeRO stage 3 across workers a worker keeps its optimizer until every worker has called DistributedOptimizer::unshard_parameters, as Trainer::fit does)"
                ))
            })
        })
    }

    /// Copy `copy` brought variable `var` back: when it is in another unit than the one the
    /// copy brought back last, that one is released.
    fn brought_back(&self, copy: usize, var: usize) {
        let unit = self.unit_of[var];
        let previous = {
            let mut current = self.current[copy].lock().unwrap_or_else(PoisonError::into_inner);
            match *current {
                Some(u) if u == unit => return,
                _ => current.replace(unit),
            }
        };
        if let Some(previous) = previous.filter(|_| !self.held.load(Ordering::Acquire)) {
            for &v in &self.units[previous] {
                // A failed release leaves the variable whole: more memory, the same values.
                let _ = self.release(copy, v);
            }
        }
        // After the release: the next unit may be the one just released (a backward pass
        // comes back to it).
        if let Some(next) = self.ahead.entered(copy, unit) {
            self.pull_ahead(copy, next);
        }
    }
}

/// Brings a released variable back from every replica's pieces of it.
struct Source {
    shards: Arc<Shards>,
    residency: Weak<Residency>,
    copy: usize,
    var: usize,
}

impl StorageSource for Source {
    fn restore(&self) -> candle_core::Result<Tensor> {
        let residency = self.residency.upgrade();
        if let Some(r) = &residency {
            let whole = r.bring(self.copy, self.var).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            r.brought_back(self.copy, self.var);
            return Ok(whole);
        }
        self.shards.whole(self.var).map_err(|e| candle_core::Error::Msg(e.to_string()))
    }

    fn stand_in(&self, error: &candle_core::Error) -> Option<Tensor> {
        self.residency.upgrade()?.stand_in(self.copy, self.var, error)
    }
}

impl PieceSource for Residency {
    fn pieces(&self, var: usize, version: u64, deadline: Instant) -> Result<Vec<f32>> {
        let n = self.unit_of.len();
        if var >= n {
            return Err(Error::Cluster(format!("a peer asked for variable {var} of a model of {n} trainable variables; every worker must build the same model")));
        }
        let mut v = self.versions.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            let have = v.iter().copied().min().unwrap_or(0);
            if have == version {
                break;
            }
            if have > version {
                return Err(Error::Cluster(format!(
                    "a peer asked for the parameters after {} updates, and this worker's are past it ({}); every worker must step and load checkpoints alike",
                    updates(version),
                    updates(have)
                )));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Cluster(format!(
                    "a peer asked for the parameters after {} updates, and this worker's did not get past {} in time",
                    updates(version),
                    updates(have)
                )));
            }
            v = self.updated.wait_timeout(v, deadline - now).unwrap_or_else(PoisonError::into_inner).0;
        }
        drop(v);
        self.take_written(var)?;
        self.shards().pieces_of(var)
    }
}

/// A version as its updates, with its generation where it has one (an elastic job's).
fn updates(version: u64) -> String {
    match version >> 32 {
        0 => version.to_string(),
        g => format!("{} in generation {g}", version & 0xffff_ffff),
    }
}

/// The version a residency over `shards` counts from: 0 on one machine and in a job of fixed
/// membership, the generation in the high 32 bits in an elastic one, so that every member
/// counts alike from the change on and no earlier generation's version matches a later one's.
fn version_base(shards: &Shards) -> u64 {
    shards.ext().workers().filter(|w| w.is_elastic()).map_or(0, |w| w.generation() << 32)
}

impl Shards {
    /// This worker's pieces of variable `var`, local replica after replica, each in order.
    fn pieces_of(&self, var: usize) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        for p in self.pieces.iter().flatten().filter(|p| p.var == var) {
            out.extend(p.value.as_tensor().to_dtype(DType::F32)?.to_vec1::<f32>()?);
        }
        Ok(out)
    }

    /// Variable `var`'s whole value (of `dtype`, on `device`), joined from this worker's
    /// pieces and every other worker's, which `pull(worker, len)` brings (`len` values: that
    /// worker's runs of the variable, replica after replica, each in order).
    fn whole_across(
        &self,
        var: usize,
        dtype: DType,
        device: &Device,
        pull: impl Fn(usize, usize) -> Result<Vec<f32>>,
    ) -> Result<Tensor> {
        let shape = &self.shapes[var];
        let n = shape.elem_count();
        let mut out = vec![0f32; n];
        let mut covered = 0;
        for p in self.pieces.iter().flatten().filter(|p| p.var == var) {
            let values = p.value.as_tensor().to_dtype(DType::F32)?.to_vec1::<f32>()?;
            out[p.start..p.start + p.len].copy_from_slice(&values);
            covered += p.len;
        }
        let local = self.pieces.len();
        let me = self.ext.workers().map_or(0, |w| w.worker_index());
        for g in (0..self.workers_runs()).filter(|&g| g != me) {
            let runs: Vec<_> =
                self.layout[g * local..(g + 1) * local].iter().flatten().filter(|r| r.var == var).collect();
            let len: usize = runs.iter().map(|r| r.len).sum();
            if len == 0 {
                continue;
            }
            let values = pull(g, len)?;
            if values.len() != len {
                return Err(Error::Cluster(format!(
                    "worker {g} answered {} values of variable {var} where its shard holds {len}; every worker must build the same model",
                    values.len()
                )));
            }
            let mut at = 0;
            for r in runs {
                out[r.start..r.start + r.len].copy_from_slice(&values[at..at + r.len]);
                at += r.len;
                covered += r.len;
            }
        }
        if covered != n {
            return Err(Error::Scope(format!(
                "the shards hold {covered} of variable {var}'s {n} elements; every replica must build the same model"
            )));
        }
        Ok(Tensor::from_vec(out, shape, &Device::Cpu)?.to_dtype(dtype)?.to_device(device)?)
    }

    /// Copy `copy`'s pieces of variable `var` take their values from `value` (the variable,
    /// whole), whose writes are then forgotten: taken once, they are not taken again over
    /// what the pieces become (a step).
    /// A variable released meanwhile (by its replica's thread, which took its writes first)
    /// is left alone: the values are read without restoring anything, so that another thread
    /// (a peer's request, another replica's restore) never restores a variable while it
    /// writes that variable's pieces.
    pub(crate) fn take_from(&self, copy: usize, var: usize, value: &Var) -> Result<()> {
        let pieces: Vec<_> = self.pieces[copy].iter().filter(|p| p.var == var).collect();
        if !pieces.is_empty() {
            let Some(whole) = value.as_tensor().resident_copy()? else { return Ok(()) };
            let flat = whole.flatten_all()?;
            for p in pieces {
                p.value.set(&flat.narrow(0, p.start, p.len)?)?;
            }
        }
        value.clear_written();
        Ok(())
    }

    /// Variable `var`'s whole value, joined from every local replica's pieces of it (stage 3 on
    /// one machine: every replica's shard is here).
    pub(crate) fn whole(&self, var: usize) -> Result<Tensor> {
        let mut parts: Vec<(usize, &Var)> =
            self.pieces.iter().flatten().filter(|p| p.var == var).map(|p| (p.start, &p.value)).collect();
        parts.sort_by_key(|(at, _)| *at);
        let shape = &self.shapes[var];
        let covered: usize = parts.iter().map(|(_, p)| p.elem_count()).sum();
        if covered != shape.elem_count() {
            return Err(Error::Scope(format!(
                "the shards hold {covered} of variable {var}'s {} elements; every replica must build the same model",
                shape.elem_count()
            )));
        }
        // Detached: the whole value is a tensor of its own, outside any graph.
        let parts: Vec<Tensor> = parts.into_iter().map(|(_, p)| p.as_tensor().detach()).collect();
        let whole = if parts.len() == 1 { parts[0].copy()? } else { Tensor::cat(&parts, 0)? };
        Ok(whole.reshape(shape)?)
    }
}

#[cfg(test)]
mod tests {
    use super::{check_units, unit_name, unit_of};

    #[test]
    fn a_program_s_units_take_the_longest_prefix_at_a_dot_and_must_name_a_variable() {
        let units = ["enc".to_string(), "enc.layer.1".to_string()];
        assert_eq!(unit_of("enc.layer.1.w", &units), "enc.layer.1");
        assert_eq!(unit_of("enc.layer.10.w", &units), "enc");
        assert_eq!(unit_of("enc", &units), "enc");
        assert_eq!(unit_of("encoder.w", &units), "encoder");
        assert_eq!(unit_of("head.3.w", &units), "head.3");
        let names: Vec<String> = ["enc.layer.0.w", "enc.layer.1.w", "head.w"].map(String::from).to_vec();
        assert!(check_units(&names, &units).is_ok());
        // A prefix whose every variable a longer one takes is a unit of nothing.
        assert!(check_units(&names[1..], &units).is_err());
        let e = check_units(&names, &["dec".to_string()]).unwrap_err().to_string();
        assert!(e.starts_with("zero stage 3's unit \"dec\" names no trainable variable"), "{e}");
        assert!(check_units(&names, &[String::new()]).is_err());
    }

    #[test]
    fn units_are_the_first_part_of_a_name_or_two_when_the_second_is_a_number() {
        assert_eq!(unit_name("layer.3.attn.q.weight"), "layer.3");
        assert_eq!(unit_name("layer.12"), "layer.12");
        assert_eq!(unit_name("embed.weight"), "embed");
        assert_eq!(unit_name("head.0x.weight"), "head");
        assert_eq!(unit_name("w"), "w");
        assert_eq!(unit_name("blocks..x"), "blocks");
    }
}
