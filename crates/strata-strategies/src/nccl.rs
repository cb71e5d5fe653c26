//! NCCL across worker processes (feature `nccl`): the communicator's unique id agreed through
//! the coordination service, and NCCL's failures reported as the ring's errors.
//!
//! - [`nccl_id_via_coordination`]: rank 0 creates the id (`ncclGetUniqueId`) and sets it in the
//!   coordination service's key-value store under [`nccl_id_key`]`(name)`; every other rank
//!   reads it there, waiting up to its deadline. strata-cuda knows nothing of the transport;
//!   this module joins the two.
//! - [`to_transport_error`]: an NCCL failure becomes the error the ring path gives for the same
//!   event, so a lost task reads the same whichever path reduced: a timeout (init or collective;
//!   the communicator was aborted with `ncclCommAbort`) is [`Error::Timeout`], NCCL blaming a peer
//!   or the network (`ncclRemoteError`, `ncclSystemError`) is [`Error::PeerLost`], and an
//!   abandonment because the job failed elsewhere (the heartbeat's failure signal, passed to
//!   strata-cuda's `abort` check) is [`Error::Aborted`] with the job's reason.

use std::time::{Duration, Instant};

use strata_cuda::nccl::NcclId;
use strata_transport::{CoordinationMember, Error};

/// The prefix of the key-value entries that carry NCCL ids.
pub const NCCL_ID_KEY_PREFIX: &str = "strata/nccl-id/";

/// The key of communicator `name`'s id (`strata/nccl-id/<name>`).
pub fn nccl_id_key(name: &str) -> String {
    format!("{NCCL_ID_KEY_PREFIX}{name}")
}

/// The id of NCCL communicator `name`, agreed across the job: rank 0 creates it with
/// `ncclGetUniqueId` and publishes it; the other ranks wait up to `timeout` for it.
pub fn nccl_id_via_coordination(
    member: &CoordinationMember,
    rank: usize,
    name: &str,
    timeout: Duration,
) -> Result<NcclId, Error> {
    share_nccl_id(member, rank, name, timeout, NcclId::new)
}

/// [`nccl_id_via_coordination`] with rank 0's id from `create` (tests use fixed bytes).
pub fn share_nccl_id(
    member: &CoordinationMember,
    rank: usize,
    name: &str,
    timeout: Duration,
    create: impl FnOnce() -> strata_cuda::Result<NcclId>,
) -> Result<NcclId, Error> {
    let key = nccl_id_key(name);
    let what = format!("nccl id of communicator {name:?}");
    if rank == 0 {
        let id = create().map_err(|e| Error::Aborted(format!("rank 0 could not create the {what}: {e}")))?;
        member.set_key(&key, id.as_bytes())?;
        return Ok(id);
    }
    let started = Instant::now();
    let bytes = member.get_key(&key, timeout).map_err(|e| match e {
        // The service answers DEADLINE_EXCEEDED (read as Aborted) when the key never came.
        Error::Aborted(_) if started.elapsed() >= timeout => {
            Error::Timeout { task: "rank 0 (which creates the id)".into(), collective: what.clone(), step: 0, timeout }
        }
        other => other,
    })?;
    NcclId::from_bytes(&bytes)
        .map_err(|e| Error::Protocol { peer: "rank 0".into(), detail: format!("the {what}: {e}") })
}

/// The transport error for an NCCL failure in `collective` (the agreed collective number
/// `step`), as the ring path would report the same event.
pub fn to_transport_error(e: strata_cuda::Error, collective: &str, step: u64) -> Error {
    const PEER: &str = "another rank of the nccl communicator";
    match e {
        strata_cuda::Error::NcclTimeout { timeout, .. } => {
            Error::Timeout { task: PEER.into(), collective: collective.into(), step, timeout }
        }
        strata_cuda::Error::NcclAborted { reason, .. } => Error::Aborted(reason),
        strata_cuda::Error::Nccl { ref source, .. } if source.is_remote() => {
            Error::PeerLost { task: PEER.into(), collective: collective.into(), step, detail: e.to_string() }
        }
        other => {
            tracing::debug!(%collective, step, "an nccl collective failed");
            Error::Aborted(format!("{collective} failed: {other}"))
        }
    }
}

/// The name of MultiWorkerMirrored's job-wide communicator (its id's key is
/// `strata/nccl-id/multi-worker-mirrored`).
pub const MULTI_WORKER_COMMUNICATOR: &str = "multi-worker-mirrored";

/// MultiWorkerMirrored's cross-worker ops with NCCL (TensorFlow's
/// `CommunicationImplementation.NCCL`): every worker process holds one GPU replica and one
/// rank of a job-wide communicator, whose id the chief creates and publishes through the
/// coordination service; each gradient bucket is then one NCCL all-reduce across every
/// worker's GPU. Joining waits at most the collective timeout and gives up when the job fails
/// elsewhere; its failures read as the ring's (see [`to_transport_error`]).
#[cfg(feature = "candle-cuda")]
pub fn nccl_across_workers() -> crate::CrossWorkerOps {
    use std::sync::Arc;

    use strata_core::Error as CoreError;
    use strata_cuda::candle_ops::GpuCrossDeviceOps;
    use strata_cuda::nccl::NcclComms;

    crate::CrossWorkerOps(Arc::new(|s: &crate::CrossWorkerSetup<'_>| {
        let [replica] = s.local_devices else {
            return Err(CoreError::InvalidArgument(format!(
                "nccl across workers takes one GPU replica per worker process, and task {} has {}; start one task per GPU",
                s.task,
                s.local_devices.len()
            )));
        };
        if replica.physical.device_type != strata_core::device::DeviceType::Gpu {
            return Err(CoreError::InvalidArgument(format!(
                "nccl across workers needs a GPU replica, and task {} computes on {}",
                s.task, replica.spec
            )));
        }
        let cluster = |e: Error| CoreError::Cluster(format!("task {}: {e}", s.task));
        let id = nccl_id_via_coordination(s.member, s.rank, MULTI_WORKER_COMMUNICATOR, s.timeout).map_err(cluster)?;
        let abort = s.abort.clone();
        let comms =
            NcclComms::join(&id, s.rank, s.world, replica.physical.index as usize, s.timeout, &|| abort.reason())
                .map_err(|e| cluster(to_transport_error(e, "joining the nccl communicator", 0)))?;
        let abort = s.abort.clone();
        let ops = GpuCrossDeviceOps::across_processes(replica.clone(), comms, Arc::new(move || abort.reason()))
            .map_err(|e| CoreError::Cluster(format!("task {}: {e}", s.task)))?;
        Ok(Box::new(ops) as Box<dyn strata_core::cross_device::CrossDeviceOps>)
    }))
}

#[cfg(test)]
mod tests {
    use strata_cuda::nccl::NCCL_ID_BYTES;
    use strata_transport::{ClusterToken, CoordinationConfig, CoordinationServerHandle};

    use super::*;

    fn token() -> ClusterToken {
        ClusterToken::new("0123456789abcdef0123456789abcdef").unwrap()
    }

    fn config() -> CoordinationConfig {
        CoordinationConfig {
            rendezvous_timeout: Duration::from_secs(20),
            heartbeat_interval: Duration::from_millis(100),
            heartbeat_timeout: Duration::from_millis(1500),
            rpc_timeout: Duration::from_secs(5),
            ..CoordinationConfig::default()
        }
    }

    fn job(n: usize) -> (CoordinationServerHandle, Vec<CoordinationMember>) {
        let names: Vec<String> = (0..n).map(|i| format!("worker:{i}")).collect();
        let s = CoordinationServerHandle::start(
            "127.0.0.1:0".parse().unwrap(),
            names.clone(),
            "cluster-a".into(),
            "mwms/1".into(),
            token(),
            config(),
        )
        .unwrap();
        let addr = s.address().to_string();
        let members = names
            .iter()
            .map(|t| CoordinationMember::connect(&addr, "worker:0", t, token(), config()).unwrap())
            .collect();
        (s, members)
    }

    fn fake_id(b: u8) -> NcclId {
        NcclId::from_bytes(&[b; NCCL_ID_BYTES]).unwrap()
    }

    #[test]
    fn every_rank_gets_the_id_rank_0_created() {
        let (_s, members) = job(3);
        let got: Vec<NcclId> = std::thread::scope(|sc| {
            let hs: Vec<_> = members
                .iter()
                .enumerate()
                .rev() // the readers start first and wait
                .map(|(rank, m)| {
                    sc.spawn(move || share_nccl_id(m, rank, "grads", Duration::from_secs(10), || Ok(fake_id(42))))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
        });
        assert!(got.iter().all(|id| *id == fake_id(42)), "{got:?}");
        // A second communicator has its own key.
        let (a, b) = (&members[0], &members[1]);
        share_nccl_id(a, 0, "params", Duration::from_secs(5), || Ok(fake_id(7))).unwrap();
        assert_eq!(share_nccl_id(b, 1, "params", Duration::from_secs(5), || unreachable!()).unwrap(), fake_id(7));
    }

    #[test]
    fn a_missing_rank_0_is_a_timeout_naming_the_id() {
        let (_s, members) = job(2);
        let e = share_nccl_id(&members[1], 1, "grads", Duration::from_millis(300), || unreachable!()).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        let msg = e.to_string();
        assert!(msg.contains("nccl id of communicator \"grads\"") && msg.contains("rank 0"), "{msg}");
    }

    #[test]
    fn a_malformed_id_is_a_protocol_error() {
        let (_s, members) = job(2);
        members[0].set_key(&nccl_id_key("grads"), b"short").unwrap();
        let e = share_nccl_id(&members[1], 1, "grads", Duration::from_secs(5), || unreachable!()).unwrap_err();
        assert!(e.to_string().contains("expected 128 bytes, got 5 bytes"), "{e}");
    }

    #[test]
    fn rank_0_without_nccl_says_why() {
        let (_s, members) = job(1);
        let e = share_nccl_id(&members[0], 0, "grads", Duration::from_secs(5), || {
            Err(strata_cuda::Error::NotBuilt { feature: "nccl", what: "NCCL" })
        })
        .unwrap_err();
        assert!(e.to_string().contains("rank 0 could not create the nccl id"), "{e}");
    }

    #[test]
    fn nccl_failures_read_as_the_ring_s_errors() {
        let t = to_transport_error(
            strata_cuda::Error::NcclTimeout {
                what: "all-reduce",
                place: "rank 0 of 2 (GPU 0)".into(),
                timeout: Duration::from_secs(3),
            },
            "all_reduce(sum)",
            57,
        );
        assert!(matches!(&t, Error::Timeout { step: 57, timeout, .. } if *timeout == Duration::from_secs(3)), "{t}");
        assert!(t.to_string().starts_with("all_reduce(sum) timed out after 3s"), "{t}");
        assert!(!t.to_string().contains("57"), "one counter, the caller's: {t}");
        let a = to_transport_error(
            strata_cuda::Error::NcclAborted {
                what: "all-reduce",
                place: "rank 1 of 2 (GPU 0)".into(),
                reason: "lost task worker:0: no heartbeat for 3.0 s".into(),
            },
            "all_reduce(sum)",
            3,
        );
        assert!(matches!(&a, Error::Aborted(r) if r.starts_with("lost task worker:0")), "{a}");
        let o = to_transport_error(strata_cuda::Error::InvalidNcclId("x".into()), "all_reduce(max)", 1);
        assert!(o.to_string().contains("all_reduce(max) failed: invalid nccl unique id"), "{o}");
    }
}
