//! The click records of a replica's next step, generated while its current step runs: what
//! `tf.data`'s `prefetch` does for an input pipeline, for [`streamed_task`](super::streamed_task).
//!
//! A step's records are a function of their keys alone ([`CtrData::record`]), so records made
//! ahead are the same bits as records made in the step. What is guessed is which keys come
//! next: a replica whose last two steps took runs of consecutive keys `a..a+n` and then
//! `b..b+n` is expected to take `2b-a..2b-a+n` next (the click records are taken in order, so
//! every strategy's steps stride through them so). The guess is made on a thread of its own as
//! soon as a step has its records; a step whose keys are the guess takes them (waiting for the
//! thread if it has not finished), any other step makes its own and the guess is dropped.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{JoinHandle, ThreadId};

use candle_core::{Device, Tensor};

use super::data::{raw_of_keys, CtrBatch, CtrData, RawBatch};
use crate::Result;

/// Whether records are made ahead: unless `STRATA_CTR_AHEAD` is `0` (for measurements).
fn enabled() -> bool {
    std::env::var("STRATA_CTR_AHEAD").map_or(true, |v| v != "0")
}

/// The replica threads remembered at most.
const MAX_THREADS: usize = 256;

/// Per replica thread: the first key of its last step, and the records being made for the
/// guess of its next step's keys.
#[derive(Default)]
struct Slot {
    last: Option<(i64, usize)>,
    ahead: Option<(Vec<i64>, JoinHandle<Result<RawBatch>>)>,
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
    /// ahead if they were guessed; then starts making the next step's guess.
    pub(crate) fn batch(&self, keys: &Tensor, device: &Device) -> Result<CtrBatch> {
        if !self.on {
            return self.data.batch_of_keys(keys, device);
        }
        let keys = keys.flatten_all()?.to_vec1::<i64>()?;
        let me = std::thread::current().id();
        let ahead = {
            let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
            // Replicas run on threads that stay; a caller on ever new threads keeps a bounded map.
            if slots.len() >= MAX_THREADS && !slots.contains_key(&me) {
                slots.clear();
            }
            slots.entry(me).or_default().ahead.take()
        };
        let raw = match ahead {
            Some((guess, made)) if guess == keys => match made.join() {
                Ok(raw) => {
                    self.hits.fetch_add(1, Ordering::Relaxed);
                    raw?
                }
                // A panic of the maker is this step's to make again.
                Err(_) => raw_of_keys(&self.data, &keys)?,
            },
            // A wrong guess goes on to its end on its own thread, unread.
            _ => raw_of_keys(&self.data, &keys)?,
        };
        self.guess_next(me, &keys);
        raw.into_batch(device)
    }

    /// Starts making the records of the keys expected after `keys` on thread `me`.
    fn guess_next(&self, me: ThreadId, keys: &[i64]) {
        let first = match keys.first() {
            Some(&k) if keys.iter().enumerate().all(|(i, &x)| x == k.wrapping_add(i as i64)) => k,
            _ => {
                self.slots.lock().unwrap_or_else(PoisonError::into_inner).entry(me).or_default().last = None;
                return;
            }
        };
        let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        let slot = slots.entry(me).or_default();
        let last = slot.last.replace((first, keys.len()));
        let Some(stride) = last.filter(|&(_, n)| n == keys.len()).map(|(a, _)| first.wrapping_sub(a)) else { return };
        let Some(start) = first.checked_add(stride).filter(|_| stride > 0) else { return };
        let next: Vec<i64> = (0..keys.len() as i64).map_while(|i| start.checked_add(i)).collect();
        if next.len() != keys.len() || next.iter().any(|&k| k < 0) {
            return;
        }
        let data = self.data.clone();
        let guess = next.clone();
        let made = std::thread::Builder::new().name("ctr-ahead".into()).spawn(move || raw_of_keys(&data, &guess));
        // Without a thread the next step makes its own records.
        if let Ok(made) = made {
            slot.ahead = Some((next, made));
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
