//! The hierarchical all-reduce of a multi-worker job.

use std::sync::Arc;

use super::compression::HalfFormat;
use super::{CpuCrossDeviceOps, CrossDeviceOps, Destination, ReduceRequest, Started, WorkerCollectives};
use crate::group::OpKey;
use crate::{Error, ReduceOp, Result};

/// Hierarchical all-reduce: the worker's replicas reduce to replica 0 in memory, replica 0
/// all-reduces across the workers ([`WorkerCollectives::all_reduce`]), and every local replica
/// receives the result (in host pieces, like the CPU ops). Reduces to every replica only.
#[derive(Debug)]
pub struct HierarchicalOps {
    local: CpuCrossDeviceOps,
    workers: Arc<dyn WorkerCollectives>,
    /// The 16-bit wire of gradient buckets across workers, if compressed.
    gradient_wire: Option<HalfFormat>,
}

impl HierarchicalOps {
    /// Reduces this worker's replicas with `local` and across workers with `workers`.
    pub fn new(local: CpuCrossDeviceOps, workers: Arc<dyn WorkerCollectives>) -> Self {
        Self { local, workers, gradient_wire: None }
    }

    /// Sends gradient buckets ([`CrossDeviceOps::start_gradients`]) across the workers in 16
    /// bits (`format`), each hop adding in f32; `None` keeps them in f32.
    pub fn with_gradient_wire(mut self, format: Option<HalfFormat>) -> Self {
        self.gradient_wire = format;
        self
    }

    fn start_with(&self, req: ReduceRequest<'_>, wire: Option<HalfFormat>) -> Result<Started> {
        let ReduceRequest { group, replica, op, dest, input, weight, .. } = req;
        if dest != Destination::AllReplicas {
            return Err(Error::InvalidArgument(
                "multi-worker mirrored reduces to every replica; reduction to one device is not supported".into(),
            ));
        }
        let across = |buf: Vec<f32>| match wire {
            Some(format) if op == ReduceOp::Sum => self.workers.start_all_reduce_half(buf, format),
            _ => self.workers.start_all_reduce(op, buf),
        };
        if group.num_replicas() == 1 {
            let mut buf = Vec::with_capacity(req.len());
            for t in input {
                let v = t.flatten_all()?.to_vec1::<f32>()?;
                if weight == 1.0 {
                    buf.extend_from_slice(&v);
                } else {
                    buf.extend(v.iter().map(|x| x * weight));
                }
            }
            return Ok(Started::AcrossWorkers(Some(across(buf))));
        }
        let mut buf = Vec::new();
        let local = ReduceRequest { dest: Destination::Replica(0), ..req };
        self.local.reduce(local, &mut |p| buf.extend_from_slice(p))?;
        Ok(Started::AcrossWorkers((replica == 0).then(|| across(buf))))
    }
}

impl CrossDeviceOps for HierarchicalOps {
    fn name(&self) -> &'static str {
        "hierarchical(in-memory, ring)"
    }

    fn reduce(&self, req: ReduceRequest<'_>, out: &mut dyn FnMut(&[f32])) -> Result<()> {
        let started = self.start(req, out)?;
        self.finish(req, started, out)
    }

    /// Reduces the worker's replicas in memory to replica 0, which starts the cross-worker
    /// all-reduce and returns without waiting for it.
    fn start(&self, req: ReduceRequest<'_>, _out: &mut dyn FnMut(&[f32])) -> Result<Started> {
        self.start_with(req, None)
    }

    /// [`start`](CrossDeviceOps::start) over the gradient wire, compressed if so configured.
    fn start_gradients(&self, req: ReduceRequest<'_>, _out: &mut dyn FnMut(&[f32])) -> Result<Started> {
        self.start_with(req, self.gradient_wire)
    }

    /// Waits for the cross-worker all-reduce (replica 0) and hands its result to every local
    /// replica.
    fn finish(&self, req: ReduceRequest<'_>, started: Started, out: &mut dyn FnMut(&[f32])) -> Result<()> {
        let ReduceRequest { group, replica, op, .. } = req;
        let Started::AcrossWorkers(pending) = started else { return Ok(()) };
        let result = || match pending {
            Some(p) => p.wait(),
            None => {
                Err(Error::Scope("a cross-worker reduction was finished on a replica that did not start it".into()))
            }
        };
        if group.num_replicas() == 1 {
            out(&result()?);
            return Ok(());
        }
        let mine: std::result::Result<Arc<Vec<f32>>, String> =
            if replica == 0 { result().map(Arc::new).map_err(|e| e.to_string()) } else { Ok(Arc::new(Vec::new())) };
        let key = OpKey { seq: group.next_seq(replica), op: format!("all_reduce({op}) across workers"), shape: vec![] };
        let all = group.exchange(replica, &key, mine)?;
        match all.into_iter().next() {
            Some(Ok(v)) => {
                out(&v);
                Ok(())
            }
            Some(Err(e)) => Err(Error::Cluster(e)),
            None => Err(Error::Scope("a cross-worker reduction produced no result".into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use candle_core::{Device, Tensor};

    use super::*;
    use crate::group::ReplicaGroup;
    use crate::ReduceOp;

    /// `workers` workers whose every replica contributes what this one's do: an all-reduce
    /// multiplies by the number of workers (`Sum`) or leaves the values (`Mean`, `Max`, `Min`).
    #[derive(Debug)]
    struct Mirror {
        workers: usize,
    }

    impl WorkerCollectives for Mirror {
        fn num_workers(&self) -> usize {
            self.workers
        }
        fn worker_index(&self) -> usize {
            0
        }
        fn all_reduce(&self, op: ReduceOp, data: &mut [f32]) -> Result<()> {
            if op == ReduceOp::Sum {
                data.iter_mut().for_each(|x| *x *= self.workers as f32);
            }
            Ok(())
        }
        fn all_gather(&self, mine: &[f32]) -> Result<Vec<Vec<f32>>> {
            Ok(vec![mine.to_vec(); self.workers])
        }
        fn broadcast(&self, _root: usize, _data: &mut [f32]) -> Result<()> {
            Ok(())
        }
        fn broadcast_u64s(&self, _root: usize, _data: &mut [u64]) -> Result<()> {
            Ok(())
        }
        fn barrier(&self) -> Result<()> {
            Ok(())
        }
    }

    fn run(k: usize, dest: Destination, weight: f32) -> Vec<Result<Vec<f32>>> {
        let ops =
            HierarchicalOps::new(CpuCrossDeviceOps::in_memory_all_reduce(k).unwrap(), Arc::new(Mirror { workers: 3 }));
        let group = ReplicaGroup::new(k, Duration::from_secs(30)).unwrap();
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..k)
                .map(|r| {
                    let (ops, group) = (&ops, &group);
                    s.spawn(move || {
                        let input = [Tensor::from_vec(vec![r as f32 + 1.0; 5], 5, &Device::Cpu).unwrap()];
                        let seq = group.next_seq(r);
                        let req =
                            ReduceRequest { group, replica: r, seq, op: ReduceOp::Sum, dest, input: &input, weight };
                        let mut got = Vec::new();
                        ops.reduce(req, &mut |p| got.extend_from_slice(p)).map(|()| got)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn every_local_replica_gets_the_sum_over_replicas_and_workers() {
        for k in [1, 2, 4] {
            // replicas contribute 1, 2, .., k (times the weight), and three workers do the same
            let want = 3.0 * 0.5 * (k * (k + 1) / 2) as f32;
            for (r, got) in run(k, Destination::AllReplicas, 0.5).into_iter().enumerate() {
                assert_eq!(got.unwrap(), vec![want; 5], "k={k} replica {r}");
            }
        }
    }

    #[test]
    fn reduction_to_one_device_is_refused() {
        for got in run(2, Destination::Replica(0), 1.0) {
            let e = got.unwrap_err().to_string();
            assert!(e.contains("reduction to one device is not supported"), "{e}");
        }
    }
}
