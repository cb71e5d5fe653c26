//! The click records of a replica's next step, generated while its current step runs: what
//! `tf.data`'s `prefetch` does for an input pipeline, for [`streamed_task`](super::streamed_task).
//!
//! A step's records are a function of their keys alone ([`CtrData::record`]), so records made
//! ahead are the same bits as records made in the step. What is guessed is which keys come
//! next: a replica whose last two steps took runs of consecutive keys `a..a+n` and then
//! `b..b+n` is expected to take `2b-a..2b-a+n` next, and `3b-2a..` after it (the click
//! records are taken in order, so every strategy's steps stride through them so). The guesses
//! go to a thread that stays for the replica (its cache of the planted model's values with
//! it) and makes their records in order, two steps ahead: a step whose keys are the first
//! guess takes its records (waiting for them if they are not made yet), and learns the ids of
//! the next step's records ([`Ahead::batch`]), which a store on parameter servers can pull
//! beside the end of this step. Any other step makes its own records, and the guesses' thread
//! is dropped with its records unread.

use std::collections::{HashMap, VecDeque};
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

/// Steps whose records are made ahead.
const DEPTH: usize = 2;

/// A replica's maker of records: a thread that makes the records of the keys it is sent, in
/// order, and ends when this is dropped.
struct Maker {
    keys: Sender<Vec<i64>>,
    made: Receiver<Result<RawBatch>>,
    /// The keys sent, oldest first, with their records once received (in the order sent).
    queue: VecDeque<(Vec<i64>, Option<Result<RawBatch>>)>,
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
        Some(Self { keys, made, queue: VecDeque::new() })
    }

    /// The oldest guess's records, waited for; `None` if there is none or the thread is gone.
    fn first_made(&mut self) -> Option<&Result<RawBatch>> {
        let (_, made) = self.queue.front_mut()?;
        if made.is_none() {
            *made = Some(self.made.recv().ok()?);
        }
        made.as_ref()
    }

    /// The records of `keys` if they are the oldest guess, waited for.
    fn take(&mut self, keys: &[i64]) -> Option<Result<RawBatch>> {
        if self.queue.front()?.0 != keys {
            return None;
        }
        self.first_made()?;
        self.queue.pop_front().and_then(|(_, made)| made)
    }

    /// Sends `keys` to be made; false if the thread is gone.
    fn send(&mut self, keys: Vec<i64>) -> bool {
        if self.keys.send(keys.clone()).is_err() {
            return false;
        }
        self.queue.push_back((keys, None));
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
    /// ahead if they were guessed; and the ids (u32 `(B, 26)`) of the next step's guessed
    /// records, once the stride is known. Sends the guesses after them to be made.
    pub(crate) fn batch(&self, keys: &Tensor, device: &Device) -> Result<(CtrBatch, Option<Tensor>)> {
        if !self.on {
            return Ok((self.data.batch_of_keys(keys, device)?, None));
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
        let raw = match slot.maker.as_mut().map(|m| m.take(&keys)) {
            Some(Some(raw)) => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                raw
            }
            ahead => {
                // A wrong guess: the maker and its guesses go.
                if ahead.is_some() {
                    slot.maker = None;
                }
                raw_of_keys(&self.data, &keys)
            }
        };
        let next = match &raw {
            Ok(_) => self.guess_next(&mut slot, &keys),
            Err(_) => None,
        };
        self.slots.lock().unwrap_or_else(PoisonError::into_inner).insert(me, slot);
        let next = next.map(|ids| Tensor::from_vec(ids, (keys.len(), super::FIELDS), device)).transpose()?;
        Ok((raw?.into_batch(device)?, next))
    }

    /// Sends the keys expected after `keys` to `slot`'s maker (started if it has none), up to
    /// [`DEPTH`] steps ahead; the ids of the next step's records, if guessed and made.
    fn guess_next(&self, slot: &mut Slot, keys: &[i64]) -> Option<Vec<u32>> {
        let first = match keys.first() {
            Some(&k) if keys.iter().enumerate().all(|(i, &x)| x == k.wrapping_add(i as i64)) => k,
            _ => {
                slot.last = None;
                slot.maker = None;
                return None;
            }
        };
        let last = slot.last.replace((first, keys.len()));
        let stride = last.filter(|&(_, n)| n == keys.len()).map(|(a, _)| first.wrapping_sub(a)).filter(|&s| s > 0)?;
        if slot.maker.is_none() {
            slot.maker = Maker::start(self.data.clone());
        }
        let maker = slot.maker.as_mut()?;
        // The guesses go on from the last one sent, or from this step.
        let mut from = maker.queue.back().and_then(|(k, _)| k.first().copied()).unwrap_or(first);
        while maker.queue.len() < DEPTH {
            let start = from.checked_add(stride)?;
            let next: Vec<i64> = (0..keys.len() as i64).map_while(|i| start.checked_add(i)).collect();
            if next.len() != keys.len() || !maker.send(next) {
                slot.maker = None;
                return None;
            }
            from = start;
        }
        match maker.first_made()? {
            Ok(raw) => Some(raw.ids().to_vec()),
            Err(_) => None,
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
                let (batch, next) = ahead.batch(&keys, &cpu).unwrap();
                assert_eq!(bits(&batch), bits(&want), "step {k} at {a}, ahead {on}");
                // From a step whose stride is known, the next step's ids, as its records have them.
                let stride = if k > 0 && n == 8 { a.checked_sub(starts[k - 1]) } else { None };
                match (on, stride) {
                    (true, Some(s)) => {
                        let then = data.batch(Split::Train, a + s..a + s + n, &cpu).unwrap();
                        let ids = next.expect("the next step's ids");
                        assert_eq!(ids.to_vec2::<u32>().unwrap(), then.1.to_vec2::<u32>().unwrap(), "step {k}");
                    }
                    _ => assert!(next.is_none(), "step {k}"),
                }
            }
            // Hits: the steps at 16 and 24, then 116 (after 100 and 108 set the stride again).
            assert_eq!(ahead.hits.load(Ordering::Relaxed), if on { 3 } else { 0 });
        }
        // Test records' keys stride too; a key that names no record is refused in one line.
        let ahead = Ahead::with(&data, true);
        for a in [0u64, 4, 8] {
            let keys = data.keys(Split::Test, a..a + 4, &cpu).unwrap();
            let want = data.batch(Split::Test, a..a + 4, &cpu).unwrap();
            assert_eq!(bits(&ahead.batch(&keys, &cpu).unwrap().0), bits(&want));
        }
        assert_eq!(ahead.hits.load(Ordering::Relaxed), 1);
        let bad = Tensor::new(&[-1i64], &cpu).unwrap();
        let e = ahead.batch(&bad, &cpu).unwrap_err().to_string();
        assert!(e.contains("-1 is not a record key"), "{e}");
    }
}
