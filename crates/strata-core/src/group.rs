//! [`ReplicaGroup`]: how the replica threads of one step meet.
//!
//! Every collective starts at a rendezvous where each replica presents an [`OpKey`]: the
//! collective's sequence number, its kind and its shape. The group checks that all keys agree,
//! so replicas that issue collectives in different orders, or with different shapes, get an
//! error naming both sides instead of a hang or a wrong result. A replica that leaves the step
//! (its closure returned or failed) while its peers wait in a collective releases them with
//! [`Error::ReplicaLeft`], and every wait has a deadline.

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// How long a replica waiting at a rendezvous spins (yielding) before it sleeps.
const SPIN: Duration = Duration::from_millis(2);

/// The default deadline of one collective on one machine.
pub const DEFAULT_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(60);

/// What a replica says it is doing when it arrives at a collective.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpKey {
    /// The replica's collective sequence number within the step.
    pub seq: u64,
    /// The kind of collective (`all_reduce(sum)`, `all_gather`, `merge_call`, ...).
    pub op: String,
    /// The shape (or element count) of the replica's contribution, where it must agree.
    pub shape: Vec<usize>,
}

impl OpKey {
    fn describe(&self) -> String {
        format!("{} of shape {:?}", self.op, self.shape)
    }
}

#[derive(Debug)]
struct State {
    generation: u64,
    arrived: usize,
    keys: Vec<Option<OpKey>>,
    left: Vec<bool>,
    /// Set once the group cannot go on; every later arrival fails with it.
    poisoned: Option<String>,
}

/// One replica's value in an exchange.
type Slot = Option<Box<dyn Any + Send>>;

/// The replicas of one step on one machine, and the rendezvous they share.
pub struct ReplicaGroup {
    n: usize,
    timeout: Duration,
    /// How long a waiting replica spins before it sleeps: [`SPIN`] while every replica has a
    /// core of its own, zero when replicas outnumber cores (a spinner would take its core from
    /// a peer that is still working).
    spin: Duration,
    generation: AtomicU64,
    state: Mutex<State>,
    cv: Condvar,
    seqs: Vec<AtomicU64>,
    slots: [Mutex<Vec<Slot>>; 2],
}

impl std::fmt::Debug for ReplicaGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaGroup").field("n", &self.n).field("timeout", &self.timeout).finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ReplicaGroup {
    /// A group of `n` replicas whose collectives time out after `timeout`.
    pub fn new(n: usize, timeout: Duration) -> Result<Self> {
        if n == 0 {
            return Err(Error::ZeroReplicas);
        }
        let empty = || Mutex::new((0..n).map(|_| None).collect());
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        Ok(Self {
            n,
            timeout,
            spin: if n <= cores { SPIN } else { Duration::ZERO },
            generation: AtomicU64::new(0),
            state: Mutex::new(State {
                generation: 0,
                arrived: 0,
                keys: vec![None; n],
                left: vec![false; n],
                poisoned: None,
            }),
            cv: Condvar::new(),
            seqs: (0..n).map(|_| AtomicU64::new(0)).collect(),
            slots: [empty(), empty()],
        })
    }

    /// The number of replicas.
    pub fn num_replicas(&self) -> usize {
        self.n
    }

    /// The deadline of each collective.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Takes the next collective sequence number of `replica`.
    pub fn next_seq(&self, replica: usize) -> u64 {
        self.seqs[replica].fetch_add(1, Ordering::Relaxed)
    }

    /// Marks `replica` as gone from the step; peers waiting for it are released with an error.
    pub fn leave(&self, replica: usize) {
        let mut st = lock(&self.state);
        st.left[replica] = true;
        drop(st);
        self.cv.notify_all();
    }

    /// Marks the group as failed (a replica's step failed); waiting peers are released.
    pub fn poison(&self, why: String) {
        let mut st = lock(&self.state);
        st.poisoned.get_or_insert(why);
        drop(st);
        self.cv.notify_all();
    }

    /// Waits until every replica has arrived with an equal key.
    pub fn arrive(&self, replica: usize, key: &OpKey) -> Result<()> {
        if self.n == 1 {
            return Ok(());
        }
        let mut st = lock(&self.state);
        if let Some(why) = &st.poisoned {
            return Err(Error::Scope(format!("the step was abandoned: {why}")));
        }
        if let Some(err) = self.departed_error(&st, replica, key) {
            return Err(err);
        }
        st.keys[replica] = Some(key.clone());
        st.arrived += 1;
        if st.arrived == self.n {
            if let Some(err) = Self::check_keys(&st.keys) {
                st.poisoned = Some(err.to_string());
                drop(st);
                self.cv.notify_all();
                return Err(err);
            }
            st.arrived = 0;
            st.keys.iter_mut().for_each(|k| *k = None);
            st.generation += 1;
            self.generation.store(st.generation, Ordering::Release);
            drop(st);
            self.cv.notify_all();
            return Ok(());
        }
        let my_gen = st.generation;
        drop(st);

        // Spin for up to `self.spin` before sleeping: on a step of a few milliseconds, a sleep
        // and wake-up (slow on virtual machines) is a visible cost, and peers usually arrive
        // within a fraction of a step.
        let spin_until = Instant::now() + self.spin;
        let mut i = 0u32;
        while self.generation.load(Ordering::Acquire) == my_gen {
            i = i.wrapping_add(1);
            if i.is_multiple_of(32) {
                if Instant::now() >= spin_until {
                    break;
                }
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        if self.generation.load(Ordering::Acquire) != my_gen {
            return Ok(());
        }

        let deadline = Instant::now() + self.timeout;
        let mut st = lock(&self.state);
        loop {
            if st.generation != my_gen {
                return Ok(());
            }
            if let Some(why) = &st.poisoned {
                // Every replica arrived but their keys disagree: report the mismatch itself.
                if let Some(mismatch) = Self::check_keys(&st.keys) {
                    return Err(mismatch);
                }
                return Err(Error::Scope(format!("the step was abandoned: {why}")));
            }
            if let Some(err) = self.departed_error(&st, replica, key) {
                return Err(err);
            }
            let now = Instant::now();
            if now >= deadline {
                let arrived = st.arrived;
                let err = Error::CollectiveTimeout {
                    seq: key.seq,
                    op: key.op.clone(),
                    replica,
                    timeout: self.timeout,
                    arrived,
                    expected: self.n,
                };
                st.poisoned.get_or_insert(err.to_string());
                drop(st);
                self.cv.notify_all();
                return Err(err);
            }
            st = self.cv.wait_timeout(st, deadline - now).unwrap_or_else(PoisonError::into_inner).0;
        }
    }

    fn departed_error(&self, st: &State, replica: usize, key: &OpKey) -> Option<Error> {
        st.left.iter().position(|&l| l).map(|gone| Error::ReplicaLeft {
            replica: gone,
            waiting: replica,
            seq: key.seq,
            op: key.op.clone(),
        })
    }

    fn check_keys(keys: &[Option<OpKey>]) -> Option<Error> {
        let first = keys[0].as_ref()?;
        for (r, k) in keys.iter().enumerate().skip(1) {
            let k = k.as_ref()?;
            if k.seq != first.seq || k.op != first.op {
                return Some(Error::CollectiveMismatch {
                    seq: first.seq.min(k.seq),
                    detail: format!(
                        "replica 0 called #{} {} while replica {r} called #{} {}; every replica must issue the same collectives in the same order",
                        first.seq,
                        first.describe(),
                        k.seq,
                        k.describe()
                    ),
                });
            }
            if k.shape != first.shape {
                return Some(Error::ShapeMismatch {
                    op: format!("collective #{} {}", first.seq, first.op),
                    detail: format!(
                        "replica 0 contributed shape {:?} but replica {r} contributed {:?}; every replica must pass the same shape",
                        first.shape, k.shape
                    ),
                });
            }
        }
        None
    }

    /// Drops this replica's value of the exchange `seq` (once no peer reads it any more), so
    /// that what it holds is freed now rather than when the slot is next reused.
    pub fn release(&self, replica: usize, seq: u64) {
        let old = lock(&self.slots[(seq % 2) as usize])[replica].take();
        drop(old);
    }

    /// Exchanges one value per replica: every replica gets all values, in replica order.
    pub fn exchange<T: Any + Send + Clone>(&self, replica: usize, key: &OpKey, value: T) -> Result<Vec<T>> {
        if self.n == 1 {
            return Ok(vec![value]);
        }
        let parity = (key.seq % 2) as usize;
        lock(&self.slots[parity])[replica] = Some(Box::new(value));
        self.arrive(replica, key)?;
        let slots = lock(&self.slots[parity]);
        let mut out = Vec::with_capacity(self.n);
        for (r, s) in slots.iter().enumerate() {
            let v = s.as_ref().and_then(|b| b.downcast_ref::<T>()).ok_or_else(|| Error::CollectiveMismatch {
                seq: key.seq,
                detail: format!("replica {r} exchanged a value of another type in {}", key.op),
            })?;
            out.push(v.clone());
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn key(seq: u64, op: &str, n: usize) -> OpKey {
        OpKey { seq, op: op.into(), shape: vec![n] }
    }

    #[test]
    fn all_arrive_then_proceed_many_times() {
        let g = Arc::new(ReplicaGroup::new(4, Duration::from_secs(10)).unwrap());
        std::thread::scope(|s| {
            for r in 0..4 {
                let g = g.clone();
                s.spawn(move || {
                    for i in 0..200 {
                        let v = g.exchange(r, &key(i, "x", 1), r * 1000 + i as usize).unwrap();
                        assert_eq!(v, (0..4).map(|q| q * 1000 + i as usize).collect::<Vec<_>>());
                    }
                });
            }
        });
    }

    #[test]
    fn mismatched_ops_fail_on_every_replica() {
        let g = Arc::new(ReplicaGroup::new(2, Duration::from_secs(10)).unwrap());
        let errs: Vec<Error> = std::thread::scope(|s| {
            let a = s.spawn(|| g.arrive(0, &key(0, "all_reduce(sum)", 3)).unwrap_err());
            let b = s.spawn(|| g.arrive(1, &key(0, "all_gather", 3)).unwrap_err());
            vec![a.join().unwrap(), b.join().unwrap()]
        });
        for e in errs {
            let m = e.to_string();
            assert!(m.contains("all_reduce(sum)") && m.contains("all_gather"), "{m}");
        }
    }

    #[test]
    fn mismatched_shapes_are_a_shape_error() {
        let g = Arc::new(ReplicaGroup::new(2, Duration::from_secs(10)).unwrap());
        std::thread::scope(|s| {
            let a = s.spawn(|| g.arrive(0, &key(0, "all_reduce(sum)", 3)));
            let b = s.spawn(|| g.arrive(1, &key(0, "all_reduce(sum)", 4)));
            for e in [a.join().unwrap().unwrap_err(), b.join().unwrap().unwrap_err()] {
                assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
            }
        });
    }

    #[test]
    fn a_replica_that_leaves_releases_its_peers() {
        let g = Arc::new(ReplicaGroup::new(3, Duration::from_secs(30)).unwrap());
        std::thread::scope(|s| {
            let a = s.spawn(|| g.arrive(0, &key(0, "all_reduce(sum)", 1)));
            let b = s.spawn(|| g.arrive(1, &key(0, "all_reduce(sum)", 1)));
            std::thread::sleep(Duration::from_millis(50));
            g.leave(2);
            for e in [a.join().unwrap().unwrap_err(), b.join().unwrap().unwrap_err()] {
                assert!(matches!(e, Error::ReplicaLeft { replica: 2, .. }), "{e}");
            }
        });
    }

    #[test]
    fn a_missing_replica_times_out() {
        let g = ReplicaGroup::new(2, Duration::from_millis(100)).unwrap();
        let e = g.arrive(0, &key(5, "all_reduce(sum)", 1)).unwrap_err();
        assert!(matches!(e, Error::CollectiveTimeout { seq: 5, arrived: 1, expected: 2, .. }), "{e}");
    }
}
