//! ZeRO's optimizer state for checkpoints: every replica's shard of it gathered into the state
//! one optimizer over the whole model saves ([`Shards::gather_state`], an all-gather across
//! workers), and a replica's shard cut out of such a state ([`Shards::cut_state`]), so that a
//! checkpoint resumes at any stage on any number of replicas and workers.
//!
//! This module must not know the checkpoint's files: it turns tensors into tensors.

use candle_core::{DType, Tensor};

use super::Shards;
use crate::{Error, Result};

impl Shards {
    /// Which piece of local replica `copy` a shard's state tensor `key` (`"m.3"`: per piece,
    /// as the fused optimizers name theirs) belongs to, with the name before the index; `None`
    /// for a tensor of the whole optimizer (AdamW's step count `t`).
    fn piece_key<'k>(&self, copy: usize, key: &'k str, t: &Tensor) -> Option<(&'k str, usize)> {
        let (name, i) = key.rsplit_once('.')?;
        let i: usize = i.parse().ok()?;
        (self.pieces[copy].get(i)?.len == t.elem_count()).then_some((name, i))
    }

    /// The optimizer state of every local replica's shard (`states`, by local replica, as
    /// each copy's optimizer saves it) gathered into the state one optimizer over the whole
    /// model saves at stage 0: `name.i` for the model's `i`-th variable, in its shape. Across
    /// workers every worker must call it (an all-gather).
    pub(crate) fn gather_state(&self, states: Vec<Vec<(String, Tensor)>>) -> Result<Vec<(String, Tensor)>> {
        let first = states.first().ok_or_else(|| Error::Checkpoint("no optimizer copy to save".into()))?;
        // The names of per-piece tensors in copy 0's order (every shard has a piece).
        let mut names: Vec<String> = Vec::new();
        let mut out = Vec::new();
        for (key, t) in first {
            match self.piece_key(0, key, t) {
                Some((name, _)) => {
                    if !names.iter().any(|n| n == name) {
                        names.push(name.to_string());
                    }
                }
                None => out.push((key.clone(), t.clone())),
            }
        }
        // This worker's run of each name: its replicas' pieces in order, one after another.
        let mut run: Vec<f32> = Vec::new();
        let mut dtypes = vec![DType::F32; names.len()];
        for (k, name) in names.iter().enumerate() {
            for (c, state) in states.iter().enumerate() {
                let mut pieces: Vec<Option<&Tensor>> = vec![None; self.pieces[c].len()];
                for (key, t) in state {
                    if let Some((n, i)) = self.piece_key(c, key, t).filter(|(n, _)| n == name) {
                        debug_assert_eq!(n, name);
                        pieces[i] = Some(t);
                    }
                }
                for (i, t) in pieces.into_iter().enumerate() {
                    let t = t.ok_or_else(|| {
                        Error::Checkpoint(format!(
                            "the optimizer of replica copy {c} saved no {name:?} for its piece {i}"
                        ))
                    })?;
                    dtypes[k] = t.dtype();
                    run.extend(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
                }
            }
        }
        let all: Vec<f32> = match self.ext.workers() {
            Some(w) if w.num_workers() > 1 => w.all_gather(&run)?.concat(),
            _ => run,
        };
        let total: usize = self.shapes.iter().map(|s| s.elem_count()).sum();
        if all.len() != total * names.len() {
            return Err(Error::Checkpoint(format!(
                "the gathered optimizer state holds {} values, {} tensors of the model's {total} elements need {}; every worker must build the same model and optimizer",
                all.len(),
                names.len(),
                total * names.len()
            )));
        }
        // `all` holds, worker by worker, each name's run (its replicas' pieces one after
        // another): put every piece in its place, name by name.
        let mut by_name: Vec<Vec<f32>> = vec![vec![0.0; total]; names.len()];
        let local = self.ext.num_replicas();
        let mut at = 0;
        for g in 0..self.workers_runs() {
            let shards = &self.layout[g * local..(g + 1) * local];
            for v in by_name.iter_mut() {
                for r in shards.iter().flatten() {
                    let to = self.offsets[r.var] + r.start;
                    v[to..to + r.len].copy_from_slice(&all[at..at + r.len]);
                    at += r.len;
                }
            }
        }
        for (k, name) in names.iter().enumerate() {
            for (i, shape) in self.shapes.iter().enumerate() {
                let flat = &by_name[k][self.offsets[i]..self.offsets[i] + shape.elem_count()];
                let t = Tensor::from_slice(flat, shape.clone(), &candle_core::Device::Cpu)?.to_dtype(dtypes[k])?;
                out.push((format!("{name}.{i}"), t));
            }
        }
        Ok(out)
    }

    /// The number of workers whose runs [`Self::gather_state`] receives.
    pub(super) fn workers_runs(&self) -> usize {
        self.ext.workers().map_or(1, |w| w.num_workers().max(1))
    }

    /// The state local replica `copy`'s optimizer loads, cut from the state of one optimizer
    /// over the whole model (stage 0's, or [`Self::gather_state`]'s): for each piece, its run
    /// of each `name.i` of its variable; tensors of the whole optimizer as they are.
    pub(crate) fn cut_state(&self, copy: usize, state: &[(String, Tensor)]) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for (key, t) in state {
            let var = key
                .rsplit_once('.')
                .and_then(|(name, i)| Some((name, i.parse::<usize>().ok()?)))
                .filter(|&(_, i)| self.shapes.get(i).is_some_and(|s| s.elem_count() == t.elem_count()));
            match var {
                Some((name, i)) => {
                    for (k, p) in self.pieces[copy].iter().enumerate().filter(|(_, p)| p.var == i) {
                        out.push((format!("{name}.{k}"), t.flatten_all()?.narrow(0, p.start, p.len)?.contiguous()?));
                    }
                }
                None => out.push((key.clone(), t.clone())),
            }
        }
        Ok(out)
    }
}
