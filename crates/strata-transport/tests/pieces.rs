//! The piece service ZeRO stage 3 pulls parameters through (`Ring::serve_pieces`), on
//! loopback: every rank's values from every other rank in closed form, a request that waits for
//! the version it names, refusals (a variable the model lacks, a length the shard does not
//! have, a version the worker is past) as errors naming the peer, and a peer that is gone as
//! an error, not a hang. Every wait has a hard timeout.

use std::net::{SocketAddr, TcpListener};
use std::sync::{mpsc, Arc, Barrier, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use strata_core::cross_device::{PeerPieces, PieceSource};
use strata_transport::ring::{AbortSignal, Ring, RingConfig};

const HARD_TIMEOUT: Duration = Duration::from_secs(120);
const VARIABLES: usize = 4;

/// Rank `rank`'s pieces: `var + rank + 1` values of variable `var` at `version`, each a closed
/// form of the four.
struct Source {
    rank: usize,
    version: Mutex<u64>,
    moved: Condvar,
}

fn value(rank: usize, var: usize, version: u64, i: usize) -> f32 {
    (rank * 1000 + var * 100 + version as usize * 10 + i) as f32
}

fn len(rank: usize, var: usize) -> usize {
    var + rank + 1
}

impl PieceSource for Source {
    fn pieces(&self, var: usize, version: u64, deadline: Instant) -> strata_core::Result<Vec<f32>> {
        if var >= VARIABLES {
            return Err(strata_core::Error::Cluster(format!("no variable {var}")));
        }
        let mut v = self.version.lock().unwrap();
        while *v < version {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(strata_core::Error::Cluster(format!("version {version} not reached")));
            }
            v = self.moved.wait_timeout(v, left).unwrap().0;
        }
        if *v > version {
            return Err(strata_core::Error::Cluster(format!("past version {version}")));
        }
        Ok((0..len(self.rank, var)).map(|i| value(self.rank, var, version, i)).collect())
    }
}

impl Source {
    fn step(&self) {
        *self.version.lock().unwrap() += 1;
        self.moved.notify_all();
    }
}

/// Runs `body(rank, ring, source)` on one thread per rank of `n`; results in rank order.
fn on_ranks<T: Send + 'static>(
    n: usize,
    timeout: Duration,
    body: impl Fn(usize, Ring, Arc<Source>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let listeners: Vec<TcpListener> = (0..n).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let body = Arc::new(body);
    let (tx, rx) = mpsc::channel();
    for (r, l) in listeners.into_iter().enumerate() {
        let mut c = RingConfig::new(r, addrs.clone());
        c.listener = Some(l);
        c.token = Some("cluster-token".into());
        c.fingerprint = "pieces test".into();
        c.timeout = timeout;
        let (body, tx) = (body.clone(), tx.clone());
        std::thread::spawn(move || {
            let ring = Ring::connect(c, AbortSignal::new()).unwrap();
            let source = Arc::new(Source { rank: r, version: Mutex::new(0), moved: Condvar::new() });
            let _ = tx.send((r, body(r, ring, source)));
        });
    }
    let deadline = Instant::now() + HARD_TIMEOUT;
    let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        let (r, v) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).expect("a rank hung");
        out[r] = Some(v);
    }
    out.into_iter().map(Option::unwrap).collect()
}

fn weak(s: &Arc<Source>) -> Weak<dyn PieceSource> {
    Arc::downgrade(s) as Weak<dyn PieceSource>
}

#[test]
fn every_rank_pulls_every_other_rank_s_pieces_in_any_order() {
    for n in [2, 3] {
        let pulled = on_ranks(n, Duration::from_secs(30), move |r, ring, source| {
            let pieces = ring.serve_pieces(1, weak(&source)).unwrap();
            // Each rank pulls in its own order: the service needs none.
            let mut got = Vec::new();
            for k in 0..n * VARIABLES {
                let (peer, var) = ((r + 1 + k / VARIABLES) % n, (k * (r + 1)) % VARIABLES);
                if peer != r {
                    got.push((peer, var, pieces.pull(peer, var, 0, len(peer, var)).unwrap()));
                }
            }
            // Nobody leaves before everybody pulled.
            ring.barrier(2).unwrap();
            got
        });
        for (r, got) in pulled.iter().enumerate() {
            assert_eq!(got.len(), (n - 1) * VARIABLES, "{n} ranks: rank {r}");
            for (peer, var, values) in got {
                let want: Vec<f32> = (0..len(*peer, *var)).map(|i| value(*peer, *var, 0, i)).collect();
                assert_eq!(values, &want, "{n} ranks: rank {r} from {peer}, variable {var}");
            }
        }
    }
}

#[test]
fn a_request_waits_for_its_version_and_refusals_name_the_peer() {
    let gate = Arc::new(Barrier::new(2));
    let results = on_ranks(2, Duration::from_secs(10), move |r, ring, source| {
        let pieces = ring.serve_pieces(1, weak(&source)).unwrap();
        if r == 1 {
            // Rank 0 asks for version 1 before this rank reaches it: it waits, then gets it.
            gate.wait();
            std::thread::sleep(Duration::from_millis(300));
            source.step();
            ring.barrier(2).unwrap();
            return Vec::new();
        }
        gate.wait();
        // Version 1's values exist only once rank 1 stepped: the answer waited for them.
        let waited = pieces.pull(1, 2, 1, len(1, 2)).unwrap();
        assert_eq!(waited, (0..len(1, 2)).map(|i| value(1, 2, 1, i)).collect::<Vec<_>>());
        let refused = [
            pieces.pull(1, VARIABLES, 1, 1).unwrap_err().to_string(),
            pieces.pull(1, 0, 1, len(1, 0) + 5).unwrap_err().to_string(),
            pieces.pull(1, 0, 0, len(1, 0)).unwrap_err().to_string(),
        ];
        // The connection still serves after the refusals.
        assert_eq!(pieces.pull(1, 0, 1, len(1, 0)).unwrap().len(), len(1, 0));
        ring.barrier(2).unwrap();
        refused.to_vec()
    });
    let refused = &results[0];
    assert!(refused[0].contains("worker:1") && refused[0].contains("no variable 4"), "{}", refused[0]);
    assert!(refused[1].contains("it holds 2 values of variable 0, not 7"), "{}", refused[1]);
    assert!(refused[2].contains("past version 0"), "{}", refused[2]);
    for e in refused {
        assert!(!e.contains('\n'), "{e}");
    }
}

#[test]
fn a_peer_that_is_gone_is_an_error_not_a_hang() {
    let both = Arc::new(Barrier::new(2));
    let results = on_ranks(3, Duration::from_secs(5), move |r, ring, source| {
        let pieces = ring.serve_pieces(1, weak(&source)).unwrap();
        ring.barrier(2).unwrap();
        if r == 2 {
            drop(pieces);
            drop(ring);
            return (String::new(), String::new());
        }
        std::thread::sleep(Duration::from_millis(300));
        let gone = pieces.pull(2, 0, 0, len(2, 0)).unwrap_err().to_string();
        // A version never reached: the peer's deadline, then its refusal (not a hang; the
        // hard timeout would catch one).
        let other = 1 - r;
        let late =
            if r == 0 { pieces.pull(other, 0, 9, len(other, 0)).unwrap_err().to_string() } else { String::new() };
        both.wait();
        (gone, late)
    });
    for (r, (gone, late)) in results.iter().take(2).enumerate() {
        assert!(gone.contains("lost task worker:2") || gone.contains("worker:2"), "rank {r}: {gone}");
        if r == 0 {
            // The peer's refusal (it answers within 80% of the request's deadline), or, on a
            // loaded machine, the request's own timeout: an error either way.
            let why = late.contains("version 9 not reached") || late.contains("timed out");
            assert!(late.contains("worker:1") && why, "{late}");
        }
    }
}
