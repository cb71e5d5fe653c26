//! The click records of a replica's next step, generated while its current step runs: what
//! `tf.data`'s `prefetch` does for an input pipeline, for [`streamed_task`](super::streamed_task).
//!
//! A step's records are a function of their keys alone ([`CtrData::record`]), so records made
//! ahead are the same bits as records made in the step. What is guessed is which keys come
//! next: a replica whose last two steps took runs of consecutive keys `a..a+n` and then
//! `b..b+n` is expected to take `2b-a..2b-a+n` next (the click records are taken in order, so
//! every strategy's steps stride through them so). The guess is sent, as soon as a step has its
//! records, to a thread that stays for the replica (its cache of the planted model's values
//! with it); a step whose keys are the guess takes its records (waiting for them if they are
//! not made yet), any other step makes its own and the guess's records are dropped unread.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::ThreadId;

use candle_core::{Device, Tensor};

use super::data::{raw_of_keys, CtrBatch, CtrData, RawBatch};
use crate::Result;

/// Whether records are made ahead: unless `STRATA_CTR_AHEAD` is `0` (for measurements).
fn enabled() -> bool {
    std::env::var("STRATA_CTR_AHEAD").map_or(true, |v| v != "0")
}

/// The replica threads remembered at most.
const MAX_THREADS: usize = 256;

/// A replica's maker of records: a thread that makes the records of the keys it is sent, in
/// order, and ends when this is dropped.
struct Maker {
    keys: Sender<Vec<i64>>,
    made: Receiver<Result<RawBatch>>,
    /// The keys sent last, if their records were not taken yet.
    guess: Option<Vec<i64>>,
    /// Records of wrong guesses still to come before the guess's.
    skip: usize,
}

impl Maker {
    fn start(data: Arc<CtrData>) -> Option<Self> {
        let (keys, to_make) = channel::<Vec<i64>>();
        let (done, made) = channel();
        std::thread::Builder::new()
            .name("ctr-ahead".into())
            .spawn(move || {
                for keys in to_make {
                    if done.send(raw_of_keys(&data, &keys)).is_err() {
                        return;
                    }
                }
            })
            .ok()?;
        Some(Self { keys, made, guess: None, skip: 0 })
    }

    /// The records of `keys` if they were the guess, waiting for them; `None` otherwise (the
    /// guess's records are then skipped when they come), or if the thread is gone.
    fn take(&mut self, keys: &[i64]) -> Option<Result<RawBatch>> {
        let guess = self.guess.take()?;
        if guess != keys {
            self.skip += 1;
            return None;
        }
        loop {
            let made = self.made.recv().ok()?;
            if self.skip == 0 {
                return Some(made);
            }
            self.skip -= 1;
        }
    }

    /// Sends `keys` to be made; false if the thread is gone.
    fn send(&mut self, keys: Vec<i64>) -> bool {
        if self.keys.send(keys.clone()).is_err() {
            return false;
        }
        self.guess = Some(keys);
        true
    }
}

/// Per replica thread: the first key and length of its last step, and its maker.
#[derive(Default)]
struct Slot {
    last: Option<(i64, usize)>,
    maker: Option<Maker>,
}

/// Records made a step ahead, per replica thread (see the module).
pub(crate) struct Ahead {
    data: Arc<CtrData>,
    on: bool,
    slots: Mutex<HashMap<ThreadId, Slot>>,
    /// Steps that took records made ahead.
    hits: AtomicU64,
}

impl Ahead {
    pub(crate) fn new(data: &CtrData) -> Self {
        Self::with(data, enabled())
    }

    fn with(data: &CtrData, on: bool) -> Self {
        Self { data: Arc::new(data.clone()), on, slots: Mutex::new(HashMap::new()), hits: AtomicU64::new(0) }
    }

    /// The records of `keys` as a batch on `device` ([`CtrData::batch_of_keys`]'s bits), made
    /// ahead if they were guessed; then sends the next step's guess to be made.
    pub(crate) fn batch(&self, keys: &Tensor, device: &Device) -> Result<CtrBatch> {
        if !self.on {
            return self.data.batch_of_keys(keys, device);
        }
        let keys = keys.flatten_all()?.to_vec1::<i64>()?;
        let me = std::thread::current().id();
        // The slot is taken out for the step: only this thread uses it.
        let mut slot = {
            let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
            // Replicas run on threads that stay; a caller on ever new threads keeps a bounded map.
            if slots.len() >= MAX_THREADS && !slots.contains_key(&me) {
                slots.clear();
            }
            slots.remove(&me).unwrap_or_default()
        };
        let ahead = slot.maker.as_mut().and_then(|m| m.take(&keys));
        let raw = match ahead {
            Some(raw) => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                raw
            }
            None => raw_of_keys(&self.data, &keys),
        };
        if raw.is_ok() {
            self.guess_next(&mut slot, &keys);
        }
        self.slots.lock().unwrap_or_else(PoisonError::into_inner).insert(me, slot);
        raw?.into_batch(device)
    }

    /// Sends the keys expected after `keys` to `slot`'s maker (started if it has none).
    fn guess_next(&self, slot: &mut Slot, keys: &[i64]) {
        let first = match keys.first() {
            Some(&k) if keys.iter().enumerate().all(|(i, &x)| x == k.wrapping_add(i as i64)) => k,
            _ => {
                slot.last = None;
                return;
            }
        };
        let last = slot.last.replace((first, keys.len()));
        let Some(stride) = last.filter(|&(_, n)| n == keys.len()).map(|(a, _)| first.wrapping_sub(a)) else { return };
        let Some(start) = first.checked_add(stride).filter(|_| stride > 0) else { return };
        let next: Vec<i64> = (0..keys.len() as i64).map_while(|i| start.checked_add(i)).collect();
        if next.len() != keys.len() {
            return;
        }
        if slot.maker.is_none() {
            slot.maker = Maker::start(self.data.clone());
        }
        // Without a thread the next step makes its own records, and a later one starts another.
        if let Some(maker) = slot.maker.as_mut() {
            if !maker.send(next) {
                slot.maker = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ctr::Split;

    fn bits(b: &CtrBatch) -> Vec<u32> {
        let (d, i, l) = b;
        let mut out: Vec<u32> =
            d.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect();
        out.extend(i.flatten_all().unwrap().to_vec1::<u32>().unwrap());
        out.extend(l.to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()));
        out
    }

    /// Steps striding through the keys take records made ahead from their third step on, a
    /// step off the stride makes its own (and restarts the guessing), one of another size
    /// too; every batch has the bits of the records made in the step, and so with it off.
    #[test]
    fn records_made_ahead_are_the_records_of_the_keys_and_a_wrong_guess_is_dropped() {
        let data = CtrData::new(3, 1_000).unwrap();
        let cpu = Device::Cpu;
        let starts = [0u64, 8, 16, 24, 100, 108, 116, 1_000];
        for on in [true, false] {
            let ahead = Ahead::with(&data, on);
            for (k, &a) in starts.iter().enumerate() {
                let n = if k == 7 { 5 } else { 8 };
                let keys = data.keys(Split::Train, a..a + n, &cpu).unwrap();
                let want = data.batch(Split::Train, a..a + n, &cpu).unwrap();
                assert_eq!(bits(&ahead.batch(&keys, &cpu).unwrap()), bits(&want), "step {k} at {a}, ahead {on}");
            }
            // Hits: the steps at 16 and 24, then 116 (after 100 and 108 set the stride again).
            assert_eq!(ahead.hits.load(Ordering::Relaxed), if on { 3 } else { 0 });
        }
        // Test records' keys stride too; a key that names no record is refused in one line.
        let ahead = Ahead::with(&data, true);
        for a in [0u64, 4, 8] {
            let keys = data.keys(Split::Test, a..a + 4, &cpu).unwrap();
            let want = data.batch(Split::Test, a..a + 4, &cpu).unwrap();
            assert_eq!(bits(&ahead.batch(&keys, &cpu).unwrap()), bits(&want));
        }
        assert_eq!(ahead.hits.load(Ordering::Relaxed), 1);
        let bad = Tensor::new(&[-1i64], &cpu).unwrap();
        let e = ahead.batch(&bad, &cpu).unwrap_err().to_string();
        assert!(e.contains("-1 is not a record key"), "{e}");
    }
}
