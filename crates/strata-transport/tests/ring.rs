//! Cross-worker collectives on loopback: closed-form results for every op, worker count and
//! awkward size; lengths and roots; and every way a peer can fail (mismatched collectives,
//! wrong token or fingerprint, silence, abort, a dropped ring, a SIGKILLed process). Every
//! wait on another thread or process has a hard timeout.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use strata_core::ReduceOp;
use strata_transport::ring::{AbortSignal, Ring, RingConfig};
use strata_transport::Error;

/// The longest any test waits for its ranks.
const HARD_TIMEOUT: Duration = Duration::from_secs(120);

fn configs(n: usize, tweak: impl Fn(usize, &mut RingConfig)) -> Vec<RingConfig> {
    let listeners: Vec<TcpListener> = (0..n).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    listeners
        .into_iter()
        .enumerate()
        .map(|(r, l)| {
            let mut c = RingConfig::new(r, addrs.clone());
            c.listener = Some(l);
            c.token = Some("cluster-token".into());
            c.fingerprint = "cluster spec v1 / multi-worker-mirrored".into();
            c.timeout = Duration::from_secs(30);
            c.connect_timeout = Duration::from_secs(30);
            tweak(r, &mut c);
            c
        })
        .collect()
}

/// Runs `body(rank, connect result)` on one thread per rank; results in rank order.
fn run<T: Send + 'static>(
    cfgs: Vec<RingConfig>,
    body: impl Fn(usize, strata_transport::Result<Ring>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    run_with_abort(cfgs, AbortSignal::new, body)
}

fn run_with_abort<T: Send + 'static>(
    cfgs: Vec<RingConfig>,
    abort: impl Fn() -> AbortSignal,
    body: impl Fn(usize, strata_transport::Result<Ring>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let n = cfgs.len();
    let body = Arc::new(body);
    let (tx, rx) = mpsc::channel();
    for (r, cfg) in cfgs.into_iter().enumerate() {
        let (body, tx, abort) = (body.clone(), tx.clone(), abort());
        std::thread::spawn(move || {
            let ring = Ring::connect(cfg, abort);
            let _ = tx.send((r, body(r, ring)));
        });
    }
    let deadline = Instant::now() + HARD_TIMEOUT;
    let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        let left = deadline.saturating_duration_since(Instant::now());
        let (r, v) = rx.recv_timeout(left).expect("a rank did not finish within the hard timeout");
        out[r] = Some(v);
    }
    out.into_iter().map(|v| v.unwrap()).collect()
}

/// Rank `r`'s input element `i`: multiples of 0.25 below 100 in magnitude, so sums over five
/// ranks are exact in any order.
fn value(r: usize, i: usize) -> f32 {
    ((i * 7 + r * 13) % 101) as f32 - 50.0 + r as f32 * 0.25
}

fn expected(op: ReduceOp, n: usize, i: usize) -> f32 {
    let xs = (0..n).map(|r| value(r, i));
    match op {
        ReduceOp::Sum => xs.map(f64::from).sum::<f64>() as f32,
        ReduceOp::Mean => xs.map(f64::from).sum::<f64>() as f32 * (1.0 / n as f32),
        ReduceOp::Max => xs.fold(f32::NEG_INFINITY, f32::max),
        ReduceOp::Min => xs.fold(f32::INFINITY, f32::min),
    }
}

const SIZES: [usize; 4] = [0, 1, 7, 1_000_003];

fn check_all_reduce(n: usize, chunk_bytes: usize, small_bytes: usize) {
    let cfgs = configs(n, |_, c| {
        c.chunk_bytes = chunk_bytes;
        c.small_bytes = small_bytes;
    });
    let results = run(cfgs, |r, ring| {
        let ring = ring.unwrap();
        let mut outs = Vec::new();
        let mut step = 0;
        for op in ReduceOp::ALL {
            for len in SIZES {
                let mut data: Vec<f32> = (0..len).map(|i| value(r, i)).collect();
                ring.all_reduce(step, op, &mut data).unwrap();
                step += 1;
                outs.push((op, data));
            }
        }
        outs
    });
    for (k, (op, first)) in results[0].iter().enumerate() {
        let len = first.len();
        let wrong = (0..len).filter(|&i| first[i].to_bits() != expected(*op, n, i).to_bits()).count();
        assert_eq!(wrong, 0, "{n} workers, {op}, {len} elements, chunk {chunk_bytes}, small {small_bytes}");
        for (r, res) in results.iter().enumerate().skip(1) {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(bits(&res[k].1) == bits(first), "rank {r} differs from rank 0: {n} workers, {op}, {len} elements");
        }
    }
}

/// Workers on one host move their connections to Unix sockets; a worker that keeps TCP
/// (`RingConfig::unix_sockets` off, `STRATA_RING_UNIX=0`) keeps it with every peer; the sums
/// are the same bits either way.
#[test]
fn workers_on_one_host_talk_over_unix_sockets_unless_one_keeps_tcp() {
    for (tcp_rank, expected_links) in [(None, [2, 2, 2]), (Some(1), [1, 0, 1]), (Some(0), [0, 1, 1])] {
        let cfgs = configs(3, |r, c| c.unix_sockets = Some(r) != tcp_rank);
        let results = run(cfgs, |r, ring| {
            let ring = ring.unwrap();
            let mut data: Vec<f32> = (0..300_007).map(|i| value(r, i)).collect();
            ring.all_reduce(0, ReduceOp::Sum, &mut data).unwrap();
            (ring.unix_links(), data)
        });
        for (r, (links, data)) in results.iter().enumerate() {
            assert_eq!(*links, expected_links[r], "rank {r}'s Unix links with rank {tcp_rank:?} on TCP");
            let wrong =
                (0..data.len()).filter(|&i| data[i].to_bits() != expected(ReduceOp::Sum, 3, i).to_bits()).count();
            assert_eq!(wrong, 0, "rank {r} with rank {tcp_rank:?} on TCP");
        }
    }
}

#[test]
fn all_reduce_matches_the_closed_form_for_2_workers() {
    check_all_reduce(2, 256 << 10, 64 << 10);
    check_all_reduce(2, 4096 + 4, 0);
}

#[test]
fn all_reduce_matches_the_closed_form_for_3_workers() {
    check_all_reduce(3, 4096 + 4, 64 << 10);
    check_all_reduce(3, 256 << 10, 0);
}

#[test]
fn all_reduce_matches_the_closed_form_for_4_workers() {
    check_all_reduce(4, 256 << 10, 64 << 10);
    check_all_reduce(4, 4096 + 4, 0);
}

#[test]
fn all_reduce_matches_the_closed_form_for_5_workers() {
    check_all_reduce(5, 4096 + 4, 64 << 10);
    check_all_reduce(5, 65536 + 12, 0);
}

#[test]
fn direct_all_reduce_of_a_large_buffer_matches_the_closed_form() {
    let cfgs = configs(3, |_, c| {
        c.chunk_bytes = 4096 + 4;
        c.small_bytes = usize::MAX;
    });
    let results = run(cfgs, |r, ring| {
        let ring = ring.unwrap();
        let mut data: Vec<f32> = (0..100_003).map(|i| value(r, i)).collect();
        ring.all_reduce(0, ReduceOp::Mean, &mut data).unwrap();
        data
    });
    for res in &results {
        assert_eq!((0..res.len()).filter(|&i| res[i] != expected(ReduceOp::Mean, 3, i)).count(), 0);
    }
}

/// Rank `r`'s element `i` with bits that sums in another order would change.
fn inexact(r: usize, i: usize) -> f32 {
    value(r, i) * 0.1 + 1.0 / (1.0 + r as f32 + (i % 13) as f32)
}

/// Reduce-scatter, by the ring (`small` 0) and directly (`small` usize::MAX): each rank's
/// segment holds the closed form, bit for bit what the all-reduce of the same buffer puts there,
/// and the segments of the ranks cover the buffer once.
fn check_reduce_scatter(n: usize, small: usize) {
    let cfgs = configs(n, |_, c| {
        c.chunk_bytes = 4096 + 4;
        c.small_bytes = small;
    });
    let results = run(cfgs, |r, ring| {
        let ring = ring.unwrap();
        let mut outs = Vec::new();
        let mut step = 0;
        for op in ReduceOp::ALL {
            for len in [0usize, 1, 7, 100_003] {
                let mut data: Vec<f32> = (0..len).map(|i| value(r, i)).collect();
                let seg = ring.reduce_scatter(step, op, &mut data).unwrap();
                assert_eq!(seg, ring.scatter_segment(len, r));
                let mut fuzzy: Vec<f32> = (0..len).map(|i| inexact(r, i)).collect();
                let mut all = fuzzy.clone();
                ring.reduce_scatter(step + 1, op, &mut fuzzy).unwrap();
                ring.all_reduce(step + 2, op, &mut all).unwrap();
                step += 3;
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert!(bits(&fuzzy[seg.clone()]) == bits(&all[seg.clone()]), "rank {r}: {op}, {len} elements");
                outs.push((op, len, seg.clone(), data[seg].to_vec()));
            }
        }
        outs
    });
    for k in 0..results[0].len() {
        let (op, len) = (results[0][k].0, results[0][k].1);
        let mut covered = vec![0u8; len];
        for res in &results {
            let (_, _, seg, got) = &res[k];
            for (j, i) in seg.clone().enumerate() {
                covered[i] += 1;
                assert_eq!(got[j].to_bits(), expected(op, n, i).to_bits(), "{n} workers, {op}, {len}, element {i}");
            }
        }
        assert!(covered.iter().all(|&c| c == 1), "{n} workers, {len} elements: the segments cover the buffer once");
    }
}

#[test]
fn reduce_scatter_leaves_each_rank_its_segment_of_the_all_reduce() {
    for n in [2, 3, 5] {
        check_reduce_scatter(n, 0);
        check_reduce_scatter(n, usize::MAX);
    }
}

#[test]
fn a_reduce_scatter_against_an_all_reduce_is_a_mismatch() {
    let cfgs = configs(2, |_, c| c.timeout = Duration::from_secs(20));
    let results = run(cfgs, |r, ring| {
        let ring = ring.unwrap();
        let mut d = vec![1.0f32; 1000];
        if r == 0 {
            ring.reduce_scatter(3, ReduceOp::Sum, &mut d).unwrap_err()
        } else {
            ring.all_reduce(3, ReduceOp::Sum, &mut d).unwrap_err()
        }
    });
    for e in &results {
        assert_mismatch(e, &["reduce_scatter(sum, 1000 f32)", "all_reduce(sum, 1000 f32)"]);
    }
}

#[test]
fn all_gather_returns_every_rank_buffer_whatever_its_length() {
    let lens = [5usize, 0, 70_001, 1];
    let cfgs = configs(4, |_, c| c.chunk_bytes = 4096 + 4);
    let results = run(cfgs, move |r, ring| {
        let ring = ring.unwrap();
        let mine: Vec<f32> = (0..lens[r]).map(|i| value(r, i)).collect();
        let first = ring.all_gather(7, &mine).unwrap();
        let second = ring.all_gather(8, &mine[..mine.len().min(3)]).unwrap();
        (first, second)
    });
    for (first, second) in &results {
        assert_eq!(first.len(), 4);
        for (r, v) in first.iter().enumerate() {
            assert_eq!(v.len(), lens[r]);
            assert!(v.iter().enumerate().all(|(i, x)| *x == value(r, i)), "rank {r}'s buffer");
            assert_eq!(second[r], v[..v.len().min(3)]);
        }
    }
}

#[test]
fn all_gather_into_places_every_rank_buffer_and_refuses_another_count() {
    let lens = [5usize, 0, 70_001, 1];
    let cfgs = configs(4, |_, c| c.chunk_bytes = 4096 + 4);
    let results = run(cfgs, move |r, ring| {
        let ring = ring.unwrap();
        let mine: Vec<f32> = (0..lens[r]).map(|i| value(r, i)).collect();
        let mut out = vec![f32::NAN; lens.iter().sum()];
        ring.all_gather_into(7, &mine, &mut out, &lens).unwrap();
        // A count this rank did not call with, or counts that do not sum to the output: the
        // caller's mistake, refused before anything is sent.
        let bad = ring.all_gather_into(8, &mine, &mut out[1..], &lens).unwrap_err();
        // Rank 0 expects one element fewer from rank 2 than rank 2 sends.
        let mut wrong = lens;
        wrong[2] -= 1;
        let mut short = vec![0f32; wrong.iter().sum()];
        let counts = if r == 0 { wrong } else { lens };
        let out2 = if r == 0 { &mut short[..] } else { &mut out[..] };
        let peer = ring.all_gather_into(8, &mine, out2, &counts).err();
        (out, bad.to_string(), peer.map(|e| e.to_string()))
    });
    let whole: Vec<f32> = (0..4).flat_map(|r| (0..lens[r]).map(move |i| value(r, i))).collect();
    for (r, (out, bad, peer)) in results.iter().enumerate() {
        assert!(
            out.iter().zip(&whole).all(|(a, b)| a.to_bits() == b.to_bits()) && out.len() == whole.len(),
            "rank {r}"
        );
        assert!(bad.contains("summing to the output"), "{bad}");
        if r == 0 {
            let e = peer.as_deref().expect("rank 0 was sent another count than it expects");
            assert!(e.contains("all_gather of 70001 f32 where this task expects 70000"), "{e}");
        }
    }
}

#[test]
fn broadcast_from_a_non_zero_root_reaches_every_rank() {
    // 10 elements take the direct path, 300,001 the pipelined chain.
    for len in [10usize, 300_001] {
        let cfgs = configs(4, |_, c| c.chunk_bytes = 4096 + 4);
        let results = run(cfgs, move |r, ring| {
            let ring = ring.unwrap();
            let mut data: Vec<f32> = (0..len).map(|i| value(r, i)).collect();
            ring.broadcast(3, 2, &mut data).unwrap();
            let mut again: Vec<f32> = vec![r as f32; 4];
            ring.broadcast(4, 1, &mut again).unwrap();
            (data, again)
        });
        for (data, again) in &results {
            assert!(data.iter().enumerate().all(|(i, x)| *x == value(2, i)), "{len} elements");
            assert_eq!(again, &vec![1.0f32; 4]);
        }
    }
}

#[test]
fn u64_broadcasts_carry_integers_bit_for_bit() {
    // 1,001 u64s with 4-byte chunks: a value split between DATA frames, and some more than
    // f32 holds exactly.
    for (n, chunk_bytes) in [(2, 4), (3, 4096)] {
        let cfgs = configs(n, move |_, c| c.chunk_bytes = chunk_bytes);
        let results = run(cfgs, move |r, ring| {
            let ring = ring.unwrap();
            let mut data: Vec<u64> = (0..1001u64).map(|i| (i << 40) ^ (r as u64 + 1)).collect();
            ring.broadcast_u64s(0, n - 1, &mut data).unwrap();
            let mut header = if r == 0 { [1u64, (1 << 53) + 1] } else { [0, 0] };
            ring.broadcast_u64s(1, 0, &mut header).unwrap();
            (data, header)
        });
        for (data, header) in &results {
            assert!(data.iter().enumerate().all(|(i, x)| *x == ((i as u64) << 40) ^ n as u64), "{n} workers");
            assert_eq!(header, &[1, (1 << 53) + 1]);
        }
    }
}

#[test]
fn a_u64_broadcast_against_an_f32_one_is_a_mismatch() {
    let cfgs = configs(2, |_, c| c.timeout = Duration::from_secs(20));
    let results = run(cfgs, |r, ring| {
        let ring = ring.unwrap();
        if r == 0 {
            ring.broadcast_u64s(2, 0, &mut [7u64; 2]).unwrap_err()
        } else {
            ring.broadcast(2, 0, &mut [0f32; 2]).unwrap_err()
        }
    });
    for e in &results {
        assert_mismatch(e, &["worker:0", "worker:1", "broadcast(root 0, 2 u64)", "broadcast(root 0, 2 f32)"]);
    }
}

#[test]
fn barrier_waits_for_every_rank() {
    let late = Arc::new(AtomicBool::new(false));
    let flag = late.clone();
    let cfgs = configs(3, |_, _| {});
    let results = run(cfgs, move |r, ring| {
        let ring = ring.unwrap();
        if r == 2 {
            std::thread::sleep(Duration::from_millis(200));
            flag.store(true, Ordering::SeqCst);
        }
        ring.barrier(1).unwrap();
        let seen = flag.load(Ordering::SeqCst);
        ring.barrier(2).unwrap();
        seen
    });
    assert_eq!(results, vec![true, true, true]);
}

#[test]
fn peers_may_start_in_any_order() {
    let cfgs = configs(3, |_, _| {});
    let results = run(cfgs, |r, _| r);
    assert_eq!(results, vec![0, 1, 2]);
    let cfgs: Vec<(usize, RingConfig)> = configs(3, |_, _| {}).into_iter().enumerate().collect();
    // Rank 0 (which only accepts) starts last.
    let (tx, rx) = mpsc::channel();
    for (r, cfg) in cfgs {
        let tx = tx.clone();
        std::thread::spawn(move || {
            if r == 0 {
                std::thread::sleep(Duration::from_millis(400));
            }
            let ring = Ring::connect(cfg, AbortSignal::new()).unwrap();
            let mut d = vec![1.0f32; 3];
            ring.all_reduce(0, ReduceOp::Sum, &mut d).unwrap();
            let _ = tx.send(d);
        });
    }
    for _ in 0..3 {
        assert_eq!(rx.recv_timeout(HARD_TIMEOUT).unwrap(), vec![3.0f32; 3]);
    }
}

#[test]
fn a_connection_that_is_not_a_peer_is_ignored() {
    let cfgs = configs(2, |_, _| {});
    let target = cfgs[0].addresses[0];
    // Garbage, then silence: rank 0 must still accept the real rank 1.
    let mut junk = TcpStream::connect(target).unwrap();
    junk.write_all(b"GET / HTTP/1.1\r\n\r\nxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx").unwrap();
    let _silent = TcpStream::connect(target).unwrap();
    let results = run(cfgs, |r, ring| {
        let ring = ring.unwrap();
        let mut d = vec![r as f32];
        ring.all_reduce(0, ReduceOp::Max, &mut d).unwrap();
        d[0]
    });
    assert_eq!(results, vec![1.0, 1.0]);
}

fn assert_mismatch(e: &Error, words: &[&str]) {
    assert!(matches!(e, Error::Mismatch { .. }), "expected a mismatch, got: {e}");
    let msg = e.to_string();
    for w in words {
        assert!(msg.contains(w), "{msg:?} should name {w:?}");
    }
}

#[test]
fn mismatched_collectives_fail_on_both_ranks_naming_both() {
    let cfgs = configs(2, |_, c| c.timeout = Duration::from_secs(20));
    let results = run(cfgs, |r, ring| {
        let ring = ring.unwrap();
        let mut d = vec![1.0f32; 1000];
        let first = if r == 0 { ring.all_reduce(5, ReduceOp::Sum, &mut d) } else { ring.broadcast(5, 0, &mut d) };
        // The ring is unusable afterwards.
        let again = ring.barrier(6);
        (first.unwrap_err(), again.unwrap_err())
    });
    for (e, again) in &results {
        assert_mismatch(e, &["worker:0", "worker:1", "all_reduce(sum, 1000 f32)", "broadcast(root 0, 1000 f32)"]);
        assert!(matches!(again, Error::Aborted(m) if m.contains("unusable")), "{again}");
    }
}

#[test]
fn a_mismatch_inside_a_large_ring_fails_every_rank() {
    let cfgs = configs(4, |_, c| c.timeout = Duration::from_secs(20));
    let results = run(cfgs, |r, ring| {
        let ring = ring.unwrap();
        let mut d = vec![1.0f32; 200_000];
        // A task still finishing step 0 may already hear of the step-1 mismatch from a peer
        // that has moved on (peers report errors on every connection at once): then its step 0
        // fails with that error, never with a wrong result.
        match ring.all_reduce(0, ReduceOp::Sum, &mut d) {
            Ok(()) => {
                let op = if r == 2 { ReduceOp::Max } else { ReduceOp::Sum };
                ring.all_reduce(1, op, &mut d).unwrap_err()
            }
            Err(e) => e,
        }
    });
    for e in &results {
        assert_mismatch(e, &["worker:2", "all_reduce(max, 200000 f32)", "all_reduce(sum, 200000 f32)"]);
    }
}

#[test]
fn different_steps_are_a_mismatch() {
    let cfgs = configs(2, |_, c| c.timeout = Duration::from_secs(20));
    let results = run(cfgs, |r, ring| ring.unwrap().barrier(if r == 0 { 3 } else { 4 }).unwrap_err());
    for e in &results {
        assert_mismatch(e, &["barrier as collective #3", "barrier as collective #4"]);
    }
}

#[test]
fn a_wrong_or_missing_token_is_unauthenticated() {
    for other in [Some("not-the-token".to_string()), None] {
        let cfgs = configs(2, |r, c| {
            c.connect_timeout = Duration::from_millis(1500);
            if r == 1 {
                c.token = other.clone();
            }
        });
        let results = run(cfgs, |_, ring| ring.unwrap_err());
        for (r, e) in results.iter().enumerate() {
            assert!(matches!(e, Error::Unauthenticated(_)), "rank {r}: {e}");
            assert!(e.to_string().contains("token"), "{e}");
        }
    }
}

#[test]
fn a_different_fingerprint_is_refused_naming_both_tasks() {
    let cfgs = configs(2, |r, c| {
        c.connect_timeout = Duration::from_secs(10);
        c.fingerprint = format!("spec-{r}");
    });
    let results = run(cfgs, |_, ring| ring.unwrap_err());
    for e in &results {
        assert!(matches!(e, Error::Config(_)), "{e}");
        let msg = e.to_string();
        for w in ["worker:0", "worker:1", "spec-0", "spec-1"] {
            assert!(msg.contains(w), "{msg:?} should name {w:?}");
        }
    }
}

#[test]
fn abort_releases_a_rank_waiting_for_a_silent_peer() {
    let signals: Vec<AbortSignal> = (0..2).map(|_| AbortSignal::new()).collect();
    let handed = std::sync::Mutex::new(signals.clone().into_iter());
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let done_rx = std::sync::Mutex::new(done_rx);
    let cfgs = configs(2, |_, c| c.timeout = Duration::from_secs(60));
    let aborter = signals[0].clone();
    let results = run_with_abort(
        cfgs,
        || handed.lock().unwrap().next().unwrap(),
        move |r, ring| {
            let ring = ring.unwrap();
            if r == 1 {
                // Silent: connected, but calls nothing until rank 0 is done.
                let _ = done_rx.lock().unwrap().recv_timeout(HARD_TIMEOUT);
                return None;
            }
            let aborter = aborter.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                aborter.abort("coordination: task worker:1 stopped sending heartbeats");
            });
            let mut d = vec![1.0f32; 10];
            let e = ring.all_reduce(0, ReduceOp::Sum, &mut d).unwrap_err();
            let later = ring.barrier(1).unwrap_err();
            let _ = done_tx.send(());
            Some((e, later))
        },
    );
    let (e, later) = results[0].as_ref().unwrap();
    assert!(
        matches!(e, Error::Aborted(m) if m.contains("stopped sending heartbeats") && m.contains("all_reduce")),
        "{e}"
    );
    assert!(matches!(later, Error::Aborted(_)), "{later}");
}

#[test]
fn a_silent_peer_times_out_naming_it() {
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let done_rx = std::sync::Mutex::new(done_rx);
    let cfgs = configs(3, |_, c| c.timeout = Duration::from_millis(500));
    let results = run(cfgs, move |r, ring| {
        let ring = ring.unwrap();
        if r == 1 {
            let _ = done_rx.lock().unwrap().recv_timeout(HARD_TIMEOUT);
            let _ = done_rx.lock().unwrap().recv_timeout(HARD_TIMEOUT);
            return None;
        }
        let mut d = vec![1.0f32; 100_000];
        let e = ring.all_reduce(9, ReduceOp::Sum, &mut d).unwrap_err();
        let _ = done_tx.send(());
        Some(e)
    });
    // Rank 2 reads from rank 1, which never sends; rank 0 hears from rank 2 or times out too.
    let e = results[2].as_ref().unwrap();
    assert!(matches!(e, Error::Timeout { task, step: 9, .. } if task == "worker:1"), "{e}");
    let e0 = results[0].as_ref().unwrap();
    assert!(matches!(e0, Error::Timeout { .. }), "{e0}");
}

#[test]
fn a_peer_that_leaves_between_collectives_is_lost() {
    let cfgs = configs(3, |_, c| c.timeout = Duration::from_secs(20));
    let results = run(cfgs, |r, ring| {
        let ring = ring.unwrap();
        let mut d = vec![1.0f32; 50_000];
        ring.all_reduce(0, ReduceOp::Sum, &mut d).unwrap();
        if r == 1 {
            drop(ring);
            return None;
        }
        Some(ring.all_reduce(1, ReduceOp::Sum, &mut d).unwrap_err())
    });
    for e in results.iter().flatten() {
        assert!(matches!(e, Error::PeerLost { task, step: 1, .. } if task == "worker:1"), "{e}");
    }
}

// ---------------------------------------------------------------------------------------------
// Real processes: the test binary re-invoked as a worker.

const WORKER_ENV: &str = "STRATA_RING_TEST_WORKER";

/// Not a test on its own: the body of a worker process when `STRATA_RING_TEST_WORKER` is set
/// (`rank`); prints `PORT`, reads `ADDRS`, then all-reduces until told otherwise, printing
/// `STEP k` after each and `ERROR msg` on failure.
#[test]
fn ring_worker_process() {
    let Ok(rank) = std::env::var(WORKER_ENV) else { return };
    let rank: usize = rank.parse().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    println!("PORT {}", listener.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let addrs: Vec<SocketAddr> =
        line.trim().strip_prefix("ADDRS ").unwrap().split(',').map(|a| a.parse().unwrap()).collect();
    let mut cfg = RingConfig::new(rank, addrs);
    cfg.listener = Some(listener);
    cfg.token = Some("process-token".into());
    cfg.timeout = Duration::from_secs(60);
    cfg.connect_timeout = Duration::from_secs(30);
    let ring = Ring::connect(cfg, AbortSignal::new()).unwrap();
    let mut data = vec![1.0f32; 2_000_000];
    for step in 0..100_000u64 {
        if let Err(e) = ring.all_reduce(step, ReduceOp::Max, &mut data) {
            println!("ERROR {e}");
            std::io::stdout().flush().unwrap();
            std::process::exit(3);
        }
        println!("STEP {step}");
        std::io::stdout().flush().unwrap();
    }
    std::process::exit(0);
}

struct Workers(Vec<Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn a_sigkilled_worker_is_reported_lost_by_every_other_worker() {
    let n = 3;
    let exe = std::env::current_exe().unwrap();
    let (tx, rx) = mpsc::channel::<(usize, String)>();
    let mut workers = Workers(Vec::new());
    for r in 0..n {
        let mut child = Command::new(&exe)
            .args(["--exact", "ring::ring_worker_process", "--nocapture", "--test-threads=1"])
            .env(WORKER_ENV, r.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send((r, line)).is_err() {
                    break;
                }
            }
        });
        workers.0.push(child);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let next = |deadline: Instant| {
        rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).expect("a worker went quiet")
    };
    let mut ports = vec![None; n];
    while ports.iter().any(Option::is_none) {
        let (r, line) = next(deadline);
        // The harness may print "test ring_worker_process ... " on the same line first.
        if let Some((_, p)) = line.split_once("PORT ") {
            ports[r] = Some(p.trim().to_string());
        }
    }
    let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{}", p.as_ref().unwrap())).collect();
    for c in &mut workers.0 {
        writeln!(c.stdin.as_mut().unwrap(), "ADDRS {}", addrs.join(",")).unwrap();
    }
    // Let every worker finish a few collectives, then kill worker 2 in the middle of one.
    let mut steps = vec![0usize; n];
    while steps.iter().any(|&s| s < 3) {
        let (r, line) = next(deadline);
        assert!(!line.contains("ERROR "), "worker {r} failed before the kill: {line}");
        if line.contains("STEP ") {
            steps[r] += 1;
        }
    }
    workers.0[2].kill().unwrap();
    let killed_at = Instant::now();
    let deadline = killed_at + Duration::from_secs(20);
    let mut errors: Vec<Option<String>> = vec![None; 2];
    while errors.iter().any(Option::is_none) {
        let (r, line) = next(deadline);
        if let Some((_, e)) = line.split_once("ERROR ") {
            errors[r] = Some(e.to_string());
        }
    }
    // Worker 0 reads from worker 2 and sees it go. Worker 1 reads from worker 0, whose ERROR
    // frame naming worker 2 is best effort: it goes out only at a frame boundary, so when worker
    // 0 aborts in the middle of a DATA frame to worker 1, worker 1 sees that connection close
    // (or its own send to worker 2 fail) and names the task whose link failed it.
    for (r, e) in errors.iter().enumerate() {
        let e = e.as_ref().unwrap();
        let named_the_lost_task = e.contains("lost task worker:2");
        let upstream_aborted_mid_frame = r == 1 && e.contains("lost task worker:0") && e.contains("connection closed");
        assert!(
            (named_the_lost_task || upstream_aborted_mid_frame) && e.contains("all_reduce(max, 2000000 f32)"),
            "worker {r}: {e}"
        );
    }
    assert!(errors[0].as_ref().unwrap().contains("lost task worker:2"), "worker 0: {:?}", errors[0]);
    for (r, c) in workers.0.iter_mut().take(2).enumerate() {
        let status = loop {
            if let Some(s) = c.try_wait().unwrap() {
                break s;
            }
            assert!(Instant::now() < deadline, "worker {r} did not exit");
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(status.code(), Some(3), "worker {r}");
    }
}

#[test]
fn collectives_work_from_inside_a_tokio_runtime() {
    let cfgs = configs(2, |_, _| {});
    let results = run(cfgs, |r, ring| {
        let ring = Arc::new(ring.unwrap());
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        rt.block_on(async move {
            // From an async task directly, then from spawn_blocking.
            let mut d = vec![r as f32 + 1.0; 5];
            ring.all_reduce(0, ReduceOp::Sum, &mut d).unwrap();
            let ring2 = ring.clone();
            let gathered =
                tokio::task::spawn_blocking(move || ring2.all_gather(1, &[r as f32]).unwrap()).await.unwrap();
            (d, gathered)
        })
    });
    for (d, gathered) in results {
        assert_eq!(d, vec![3.0f32; 5]);
        assert_eq!(gathered, vec![vec![0.0], vec![1.0]]);
    }
}

/// The 16-bit wire of compressed gradients (`Ring::all_reduce_half`): every value travels in
/// f16 or bf16 and every hop adds in f32. Where every partial sum is exact in the format
/// (quarter steps below 256 for f16, small integers for bf16) the result is the closed form,
/// bit for bit; elsewhere each element is within the format's rounding of every hop; and every
/// rank ends with the same bits, since the rank that completes a segment keeps what it sends.
#[test]
fn a_16_bit_wire_sums_in_f32_and_every_rank_gets_the_same_bits() {
    use strata_core::cross_device::compression::HalfFormat;
    let exact = |half: HalfFormat, r: usize, i: usize| -> f32 {
        match half {
            HalfFormat::F16 => value(r, i), // multiples of 0.25 below 100: sums need 11 bits
            HalfFormat::Bf16 => ((i * 7 + r * 13) % 17) as f32 - 8.0, // sums of five below 256
        }
    };
    let inexact = |r: usize, i: usize| -> f32 { ((i * 31 + r * 17) % 1009) as f32 * 0.0137 - 6.9 };
    for n in [2, 3, 5] {
        let cfgs = configs(n, |_, c| c.chunk_bytes = 4096);
        let results = run(cfgs, move |r, ring| {
            let ring = ring.unwrap();
            let mut outs = Vec::new();
            let mut step = 0;
            for half in [HalfFormat::F16, HalfFormat::Bf16] {
                for len in SIZES {
                    let mut data: Vec<f32> = (0..len).map(|i| exact(half, r, i)).collect();
                    ring.all_reduce_half(step, &mut data, half).unwrap();
                    let mut rough: Vec<f32> = (0..len).map(|i| inexact(r, i)).collect();
                    ring.all_reduce_half(step + 1, &mut rough, half).unwrap();
                    step += 2;
                    outs.push((half, data, rough));
                }
            }
            outs
        });
        for (k, (half, data, rough)) in results[0].iter().enumerate() {
            let len = data.len();
            let want = |i: usize| (0..n).map(|r| exact(*half, r, i)).sum::<f32>();
            let wrong = (0..len).filter(|&i| data[i].to_bits() != want(i).to_bits()).count();
            assert_eq!(wrong, 0, "{n} workers, {half:?}, {len} elements: exact sums differ");
            // Each of the n - 1 hops and the final encoding rounds once, to half an ulp.
            let ulp = match half {
                HalfFormat::F16 => 2f32.powi(-11),
                HalfFormat::Bf16 => 2f32.powi(-8),
            };
            for (i, got) in rough.iter().enumerate() {
                let sum: f64 = (0..n).map(|r| f64::from(inexact(r, i))).sum();
                let scale: f64 = (0..n).map(|r| f64::from(inexact(r, i)).abs()).sum();
                let bound = n as f64 * f64::from(ulp) * scale + 1e-30;
                assert!(
                    (f64::from(*got) - sum).abs() <= bound,
                    "{n} workers, {half:?}: element {i} is {got}, the sum {sum}"
                );
            }
            for (r, res) in results.iter().enumerate().skip(1) {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert!(bits(&res[k].1) == bits(data), "rank {r} differs from rank 0 ({n} workers, {half:?}, {len})");
                assert!(bits(&res[k].2) == bits(rough), "rank {r} differs from rank 0 ({n} workers, {half:?}, {len})");
            }
        }
    }
}

/// The int8 wire of local SGD's outer gradients (`Ring::all_reduce_int8`): blocks of 64 values
/// with a power-of-two scale, every hop adding in f32. Small integers travel exactly (a block
/// whose largest magnitude is at most 127 has scale 1), so their sums are the closed form, bit
/// for bit, on chunks that end in a short block too; other values end within a step of every
/// hop's block (its largest magnitude over 127, once per hop); every rank gets the same bits.
#[test]
fn an_int8_wire_sums_in_f32_and_every_rank_gets_the_same_bits() {
    let small = |r: usize, i: usize| -> f32 { ((i * 7 + r * 13) % 41) as f32 - 20.0 };
    let rough = |r: usize, i: usize| -> f32 { ((i * 31 + r * 17) % 1009) as f32 * 0.0137 - 6.9 };
    for n in [2, 3, 5] {
        // Chunks of 1,000 values: every chunk ends in a block of 40.
        let cfgs = configs(n, |_, c| c.chunk_bytes = 4000);
        let results = run(cfgs, move |r, ring| {
            let ring = ring.unwrap();
            let mut outs = Vec::new();
            for (k, len) in SIZES.into_iter().enumerate() {
                let mut exact: Vec<f32> = (0..len).map(|i| small(r, i)).collect();
                ring.all_reduce_int8(2 * k as u64, &mut exact).unwrap();
                let mut other: Vec<f32> = (0..len).map(|i| rough(r, i)).collect();
                ring.all_reduce_int8(2 * k as u64 + 1, &mut other).unwrap();
                outs.push((exact, other));
            }
            outs
        });
        for (k, (exact, other)) in results[0].iter().enumerate() {
            let len = exact.len();
            let wrong = (0..len).filter(|&i| exact[i] != (0..n).map(|r| small(r, i)).sum::<f32>()).count();
            assert_eq!(wrong, 0, "{n} workers, {len} elements: exact sums differ");
            // Every partial sum is below n * 7 in magnitude: a step of its block is at most
            // 2 * n * 7 / 127, once per hop and once at the end.
            let bound = n as f32 * (2.0 * n as f32 * 7.0 / 127.0);
            for (i, got) in other.iter().enumerate() {
                let sum: f32 = (0..n).map(|r| rough(r, i)).sum();
                assert!((got - sum).abs() <= bound, "{n} workers: element {i} is {got}, the sum {sum}");
            }
            for (r, res) in results.iter().enumerate().skip(1) {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert!(bits(&res[k].0) == bits(exact), "rank {r} differs from rank 0 ({n} workers, {len})");
                assert!(bits(&res[k].1) == bits(other), "rank {r} differs from rank 0 ({n} workers, {len})");
            }
        }
    }
}
