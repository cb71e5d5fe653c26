//! ZeRO's gather: after each replica stepped its shard, every shard is written into every
//! replica's copy of the variables ([`Shards::gather`]): this worker's replicas' pieces shared
//! in memory, the other workers' in one all-gather of known counts, received straight into one
//! buffer that the copies read as views ([`ReplicaContext::gather_runs`]).
//!
//! This module must not know the optimizer: it moves the values a step left in the pieces.

use candle_core::{Device, Tensor, Var};

use super::layout::Run;
use super::Shards;
use crate::{Error, ReplicaContext, Result};

impl ReplicaContext<'_> {
    /// Gathers every replica's `mine` (1-D tensors; their lengths may differ) across every
    /// replica of every worker, as runs in the order of
    /// [`replica_id_in_sync_group`](ReplicaContext::replica_id_in_sync_group): this worker's
    /// replicas' tensors themselves (shared, not copied), and one f32 run on the CPU per other
    /// worker (its replicas' tensors joined), `counts[w]` elements for worker `w` (a worker
    /// that sends another count is an error). The other workers' runs are received straight
    /// into one buffer and handed out as views of it.
    pub(super) fn gather_runs(&self, mine: Vec<Tensor>, counts: &[usize]) -> Result<Vec<Tensor>> {
        let _p = self.phase("collective", "gather_runs");
        let key = self.next_key("gather_runs".into(), vec![]);
        let local: Vec<Tensor> = self.shared.group.exchange(self.replica, &key, mine)?.into_iter().flatten().collect();
        let Some(w) = self.shared.ext.workers() else { return Ok(local) };
        let me = w.worker_index();
        let gathered = if self.replica == 0 {
            (|| -> Result<Tensor> {
                let total: usize = counts.iter().sum();
                let mut out = vec![0f32; total];
                match local.as_slice() {
                    // One replica on this worker (the common case): sent from its tensor's
                    // storage in place.
                    [t] if t.dtype() == candle_core::DType::F32 && t.device().is_cpu() => {
                        let guard = [t.storage_and_layout()];
                        let slices = crate::cross_device::read_slices(&guard)?;
                        w.all_gather_into(slices[0], &mut out, counts)?;
                    }
                    _ => {
                        let mut flat = Vec::with_capacity(local.iter().map(|t| t.elem_count()).sum());
                        for t in &local {
                            flat.extend(t.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?);
                        }
                        w.all_gather_into(&flat, &mut out, counts)?;
                    }
                }
                Ok(Tensor::from_vec(out, total, &Device::Cpu)?)
            })()
            .map_err(|e| e.to_string())
        } else {
            Ok(Tensor::zeros(0, candle_core::DType::F32, &Device::Cpu)?)
        };
        let all = self.share_from_first("gather_runs(workers)", gathered)?;
        let mut runs = Vec::with_capacity(counts.len() + local.len());
        let mut at = 0;
        for (i, &c) in counts.iter().enumerate() {
            if i == me {
                runs.extend(local.iter().cloned());
            } else {
                runs.push(all.narrow(0, at, c)?);
            }
            at += c;
        }
        Ok(runs)
    }
}

impl Shards {
    /// Writes every replica's shard into this replica's `vars`.
    pub(super) fn gather(&self, ctx: &ReplicaContext<'_>, copy: usize, vars: &[Var]) -> Result<()> {
        let mine: Vec<Tensor> = self.pieces[copy].iter().map(|p| p.value.as_tensor().clone()).collect();
        // This worker's replicas' pieces, one tensor each, and one run per other worker (its
        // replicas' pieces one after another).
        let local = self.pieces.len();
        let counts: Vec<usize> = (0..self.workers_runs())
            .map(|g| self.layout[g * local..(g + 1) * local].iter().flatten().map(|r| r.len).sum())
            .collect();
        let gathered = ctx.gather_runs(mine, &counts)?;
        let me = self.ext.workers().map_or(0, |w| w.worker_index());
        let mut placed: Vec<(Run, Tensor)> = Vec::with_capacity(gathered.len());
        let mut tensors = gathered.into_iter();
        for g in 0..self.workers_runs() {
            let shards = &self.layout[g * local..(g + 1) * local];
            if g == me {
                for r in shards.iter().flatten() {
                    let t = tensors
                        .next()
                        .ok_or_else(|| Error::Scope("the gathered shards are fewer than the pieces".into()))?;
                    placed.push((*r, t));
                }
            } else {
                let t =
                    tensors.next().ok_or_else(|| Error::Scope(format!("worker {g}'s gathered shard is missing")))?;
                let runs = shards.concat();
                let expected: usize = runs.iter().map(|r| r.len).sum();
                if t.elem_count() != expected {
                    return Err(Error::Scope(format!(
                        "worker {g}'s gathered shard holds {} elements, its layout {expected}; every replica must build the same model",
                        t.elem_count()
                    )));
                }
                let mut at = 0;
                for r in runs {
                    placed.push((r, t.narrow(0, at, r.len)?));
                    at += r.len;
                }
            }
        }
        // Each variable's parts, by where they start in it.
        let mut parts: Vec<Vec<(usize, Tensor)>> = vec![Vec::new(); vars.len()];
        for (r, t) in placed {
            if r.len != t.elem_count() {
                return Err(Error::Scope(format!(
                    "a gathered shard's run of variable {} holds {} elements, {} expected; every replica must build the same model",
                    r.var,
                    t.elem_count(),
                    r.len
                )));
            }
            parts[r.var].push((r.start, t));
        }
        for (v, mut parts) in vars.iter().zip(parts) {
            parts.sort_by_key(|(at, _)| *at);
            let covered: usize = parts.iter().map(|(_, p)| p.elem_count()).sum();
            if covered != v.elem_count() {
                return Err(Error::Scope(format!(
                    "the gathered shards hold {covered} of a variable's {} elements; every replica must build the same model",
                    v.elem_count()
                )));
            }
            if v.is_contiguous()
                && parts.iter().all(|(_, p)| p.dtype() == v.dtype() && p.device().same_device(v.device()))
            {
                // In place, run by run: no whole copy of the variable is made. A run that is a
                // view of this very variable (this replica's own piece, which the optimizer
                // stepped in place) is there already. The other runs may be views of the other
                // replicas' variables, which they write at the same time: `copy_run_from`
                // takes the two locks in one order.
                for (at, part) in &parts {
                    v.as_tensor().copy_run_from(*at, part)?;
                }
            } else {
                let parts: Vec<Tensor> = parts
                    .into_iter()
                    .map(|(_, p)| Ok(p.to_dtype(v.dtype())?.to_device(v.device())?))
                    .collect::<Result<_>>()?;
                v.set(&Tensor::cat(&parts, 0)?.reshape(v.shape())?)?;
            }
        }
        Ok(())
    }
}
