//! NCCL all-reduce on real GPUs, checked against closed forms: every op, in place and out of
//! place, over every visible GPU (sizes 1, 1000, 1_000_003), and across two processes with one
//! GPU each (the id handed over in an environment variable). Every test starts with
//! `require_gpus(n)`: skipped here, a failure with `STRATA_REQUIRE_GPU=1` and too few GPUs.
//!
//! Inputs are `value(r, i) = (i % 251) + r / 2`: every partial sum is a multiple of 0.5 far below
//! 2^24, so `Sum`, `Max` and `Min` are exact in any order; `Mean` (NCCL's `ncclAvg`, a sum of
//! inputs premultiplied by `1/n`) is exact when `n` is a power of two and within `n` ulps of the
//! closed form otherwise.
#![cfg(feature = "nccl")]

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use strata_core::ReduceOp;
use strata_cuda::nccl::bench::{is_right, value};
use strata_cuda::nccl::{NcclComms, NcclId};
use strata_cuda::testing::{gpu_count, require_gpus};
use strata_cuda::Error;

const SIZES: [usize; 3] = [1, 1000, 1_000_003];
const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min];

/// Counts elements that differ from the closed form ([`is_right`]: exact, except `Mean` over a
/// world size that is not a power of two: within `n` ulps).
fn count_wrong(op: ReduceOp, n: usize, got: &[f32]) -> usize {
    got.iter().enumerate().filter(|&(i, &x)| !is_right(op, n, i, x)).count()
}

fn streams(n: usize) -> Vec<Arc<CudaStream>> {
    (0..n).map(|o| CudaContext::new(o).expect("CUDA context").default_stream()).collect()
}

fn upload(streams: &[Arc<CudaStream>], count: usize, fill: impl Fn(usize, usize) -> f32) -> Vec<CudaSlice<f32>> {
    streams
        .iter()
        .enumerate()
        .map(|(r, s)| {
            let host: Vec<f32> = (0..count).map(|i| fill(r, i)).collect();
            s.clone_htod(&host).expect("upload")
        })
        .collect()
}

fn download(bufs: &[CudaSlice<f32>]) -> Vec<Vec<f32>> {
    bufs.iter().map(|b| b.stream().clone_dtoh(b).expect("download")).collect()
}

#[test]
fn in_place_all_reduce_over_every_gpu_matches_the_closed_form() {
    if !require_gpus(1) {
        return;
    }
    let n = gpu_count().unwrap();
    let mut comms = NcclComms::all_local(&(0..n).collect::<Vec<_>>()).unwrap();
    assert_eq!((comms.world_size(), comms.ranks()), (n, (0..n).collect::<Vec<_>>()));
    let streams = streams(n);
    for count in SIZES {
        for op in OPS {
            let mut bufs = upload(&streams, count, value);
            comms.all_reduce_in_place(&mut bufs, op).unwrap();
            for (r, got) in download(&bufs).iter().enumerate() {
                assert_eq!(got.len(), count);
                assert_eq!(count_wrong(op, n, got), 0, "{op} over {n} GPU(s), {count} elements, rank {r}");
            }
        }
    }
}

#[test]
fn out_of_place_all_reduce_leaves_the_input_and_fills_the_output() {
    if !require_gpus(1) {
        return;
    }
    let n = gpu_count().unwrap();
    let mut comms = NcclComms::all_local(&(0..n).collect::<Vec<_>>()).unwrap();
    let streams = streams(n);
    for count in SIZES {
        for op in OPS {
            let send = upload(&streams, count, value);
            // Poisoned: a result element NCCL did not write stays NaN and counts as wrong.
            let mut recv = upload(&streams, count, |_, _| f32::NAN);
            comms.all_reduce(&send, &mut recv, op).unwrap();
            for (r, got) in download(&recv).iter().enumerate() {
                assert_eq!(count_wrong(op, n, got), 0, "{op} over {n} GPU(s), {count} elements, rank {r}");
            }
            for (r, input) in download(&send).iter().enumerate() {
                assert!(input.iter().enumerate().all(|(i, &x)| x == value(r, i)), "rank {r}'s input changed");
            }
        }
    }
}

#[test]
fn repeated_async_all_reduces_then_one_synchronize() {
    if !require_gpus(1) {
        return;
    }
    let n = gpu_count().unwrap();
    let mut comms = NcclComms::all_local(&(0..n).collect::<Vec<_>>()).unwrap();
    let streams = streams(n);
    // Max is idempotent: ten all-reduces in a row give the same closed form.
    let mut bufs = upload(&streams, 1000, value);
    for _ in 0..10 {
        comms.all_reduce_in_place_async(&mut bufs, ReduceOp::Max).unwrap();
    }
    comms.synchronize(&streams, &|| None).unwrap();
    for got in download(&bufs) {
        assert_eq!(count_wrong(ReduceOp::Max, n, &got), 0);
    }
}

#[test]
fn bad_buffers_are_refused_before_nccl_runs() {
    if !require_gpus(1) {
        return;
    }
    let n = gpu_count().unwrap();
    let mut comms = NcclComms::all_local(&(0..n).collect::<Vec<_>>()).unwrap();
    let streams = streams(n);
    // One buffer too few.
    let mut short = upload(&streams[..n - 1], 10, value);
    let e = comms.all_reduce_in_place(&mut short, ReduceOp::Sum).unwrap_err();
    assert!(matches!(e, Error::InvalidLaunch { .. }), "{e}");
    if n >= 2 {
        // Unequal lengths.
        let mut bufs = upload(&streams, 10, value);
        bufs[1] = streams[1].clone_htod(&[1.0f32; 9]).unwrap();
        let e = comms.all_reduce_in_place(&mut bufs, ReduceOp::Sum).unwrap_err().to_string();
        assert!(e.contains("buffer 1 holds 9 elements but buffer 0 holds 10"), "{e}");
        // Buffers in the wrong device order.
        let mut bufs = upload(&streams, 10, value);
        bufs.swap(0, 1);
        let e = comms.all_reduce_in_place(&mut bufs, ReduceOp::Sum).unwrap_err().to_string();
        assert!(e.contains("buffer 0 is on GPU 1 but rank 0 of the communicator is on GPU 0"), "{e}");
    }
    // The communicators are still usable.
    let mut bufs = upload(&streams, 10, value);
    comms.all_reduce_in_place(&mut bufs, ReduceOp::Sum).unwrap();
}

#[test]
fn a_gpu_listed_twice_is_refused() {
    if !require_gpus(1) {
        return;
    }
    let e = NcclComms::all_local(&[0, 0]).unwrap_err().to_string();
    assert!(e.contains("GPU 0 is listed twice"), "{e}");
}

#[test]
fn a_rank_that_never_joins_times_out_and_aborts() {
    if !require_gpus(1) {
        return;
    }
    let id = NcclId::new().unwrap();
    let t0 = Instant::now();
    // Rank 1 of 2 never comes: initialisation must end at the timeout, not hang.
    let e = NcclComms::join(&id, 0, 2, 0, Duration::from_secs(5), &|| None).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(60), "the timeout was not enforced: {:?}", t0.elapsed());
    match &e {
        Error::NcclTimeout { place, .. } => assert_eq!(place, "rank 0 of 2 (GPU 0)"),
        other => panic!("expected a timeout, got {other}"),
    }
}

#[test]
fn the_job_failing_elsewhere_aborts_initialisation() {
    if !require_gpus(1) {
        return;
    }
    let id = NcclId::new().unwrap();
    let t0 = Instant::now();
    let abort = move || (t0.elapsed() > Duration::from_secs(1)).then(|| "lost task worker:1".to_string());
    let e = NcclComms::join(&id, 0, 2, 0, Duration::from_secs(120), &abort).unwrap_err();
    match &e {
        Error::NcclAborted { reason, .. } => assert_eq!(reason, "lost task worker:1"),
        other => panic!("expected an abort, got {other}"),
    }
}

/// Environment of the multi-process test's children.
const ID_ENV: &str = "STRATA_TEST_NCCL_ID";
const RANK_ENV: &str = "STRATA_TEST_NCCL_RANK";
const WORLD: usize = 2;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
}

/// A child of `two_processes_one_gpu_each_reduce_through_one_communicator`; does nothing when
/// run on its own.
#[test]
fn multi_process_child() {
    let (Ok(id), Ok(rank)) = (std::env::var(ID_ENV), std::env::var(RANK_ENV)) else {
        return;
    };
    let id = NcclId::from_bytes(&unhex(&id)).unwrap();
    let rank: usize = rank.parse().unwrap();
    let mut comm = NcclComms::join(&id, rank, WORLD, rank, Duration::from_secs(60), &|| None).unwrap();
    assert_eq!(comm.ranks(), vec![rank]);
    let stream = CudaContext::new(rank).unwrap().default_stream();
    for count in SIZES {
        for op in OPS {
            let host: Vec<f32> = (0..count).map(|i| value(rank, i)).collect();
            let mut bufs = vec![stream.clone_htod(&host).unwrap()];
            comm.all_reduce_in_place(&mut bufs, op).unwrap();
            let got = stream.clone_dtoh(&bufs[0]).unwrap();
            assert_eq!(count_wrong(op, WORLD, &got), 0, "{op}, {count} elements, rank {rank}");
        }
    }
}

#[test]
fn two_processes_one_gpu_each_reduce_through_one_communicator() {
    if !require_gpus(WORLD) {
        return;
    }
    let id = NcclId::new().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut children: Vec<_> = (0..WORLD)
        .map(|r| {
            Command::new(&exe)
                .args(["--exact", "multi_process_child", "--nocapture", "--test-threads=1"])
                .env(ID_ENV, hex(id.as_bytes()))
                .env(RANK_ENV, r.to_string())
                .stdout(Stdio::inherit())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut status = vec![None; WORLD];
    while status.iter().any(Option::is_none) {
        for (r, c) in children.iter_mut().enumerate() {
            if status[r].is_none() {
                status[r] = c.try_wait().unwrap();
            }
        }
        if Instant::now() > deadline {
            for c in &mut children {
                let _ = c.kill();
            }
            panic!("the two NCCL processes did not finish within 180 s: {status:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for (r, s) in status.into_iter().enumerate() {
        assert!(s.unwrap().success(), "rank {r} failed");
    }
}
