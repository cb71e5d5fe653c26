//! Criteo-shaped click records, generated from a seed and a record's index ([`CtrData`]), their
//! labels drawn from a planted model whose probability is known, and the 160-byte record format
//! of `strata ctr-data` ([`CtrRecord::to_bytes`]).

use std::ops::Range;

use candle_core::{Device, Tensor};
use strata_core::embedding::mix64;

use crate::{Error, Result};

/// Dense features per record (Criteo's 13 integer features).
pub const DENSE: usize = 13;
/// Categorical fields per record (Criteo's 26).
pub const FIELDS: usize = 26;
/// Bytes of a record in `strata ctr-data`'s files: the label, the dense features, the ids, each
/// 4 bytes little-endian.
pub const RECORD_BYTES: usize = 4 * (1 + DENSE + FIELDS);
/// The exponent of the ids' Zipf distribution within each field.
pub const ZIPF_EXPONENT: f64 = 1.1;
/// The fewest embedding rows: one id per field.
pub const MIN_ROWS: u64 = FIELDS as u64;

/// Each field's share of the table, smallest first (Criteo's fields run from a handful of
/// values to millions): field `f` gets one row plus its share of the rest.
const FIELD_WEIGHTS: [u64; FIELDS] =
    [1, 1, 2, 2, 3, 3, 4, 5, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 128, 160];

/// Pairs of fields whose ids interact in the planted model (a dot product of their vectors).
const INTERACTIONS: [(usize, usize); 4] = [(0, 9), (4, 17), (12, 23), (20, 25)];
/// The planted model's bias: about a quarter of the records are clicks (24%), as in Criteo.
const BIAS: f64 = -0.5;
/// The standard deviation of an id's own effect on the logit.
const ID_EFFECT: f64 = 0.25;
/// The width of the interacting vectors, and their elements' standard deviation.
const INTERACTION_DIM: usize = 4;
const INTERACTION_STD: f64 = 0.45;

/// One click record: the label, the dense features as the model reads them (`log(1 + x)` of
/// the counts) and one global row id per field.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CtrRecord {
    /// 1 for a click, 0 otherwise.
    pub label: f32,
    /// `log(1 + count)` of each dense feature.
    pub dense: [f32; DENSE],
    /// Each field's id, a row of the one table (`0..embedding_rows`).
    pub ids: [u32; FIELDS],
}

impl CtrRecord {
    /// The record as `strata ctr-data` writes it: `label: f32`, `dense: [f32; 13]`,
    /// `ids: [u32; 26]`, little-endian, 160 bytes.
    pub fn to_bytes(&self) -> [u8; RECORD_BYTES] {
        let mut out = [0u8; RECORD_BYTES];
        let words = std::iter::once(self.label.to_bits())
            .chain(self.dense.iter().map(|x| x.to_bits()))
            .chain(self.ids.iter().copied());
        for (chunk, w) in out.chunks_exact_mut(4).zip(words) {
            chunk.copy_from_slice(&w.to_le_bytes());
        }
        out
    }

    /// The record of [`CtrRecord::to_bytes`]'s bytes.
    pub fn from_bytes(bytes: &[u8; RECORD_BYTES]) -> Self {
        let word = |i: usize| u32::from_le_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]]);
        Self {
            label: f32::from_bits(word(0)),
            dense: std::array::from_fn(|j| f32::from_bits(word(1 + j))),
            ids: std::array::from_fn(|f| word(1 + DENSE + f)),
        }
    }
}

/// Training or test records: two index spaces of one generator, so the test set is the same
/// whatever the number of training records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    /// Record `i` of the training set.
    Train,
    /// Record `i` of the test set.
    Test,
}

/// A counter-based stream: SplitMix64 from a record's key.
struct Stream(u64);

impl Stream {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix64(self.0)
    }

    /// Uniform in `(0, 1)`.
    fn unit(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64)
    }
}

/// A standard normal from the 128 bits of `key` (Box-Muller).
fn normal(key: u64) -> f64 {
    let mut s = Stream(key);
    let (u1, u2) = (s.unit(), s.unit());
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// [`normal`]`(key)`, remembered: a record's planted logit draws 58 normals from its ids, and
/// Zipf's popular ids come back in nearly every record, so each thread keeps the last normal of
/// every slot of a direct-mapped table of keys (1 MiB) and computes only on a miss. The value
/// is the function's, bit for bit.
fn normal_cached(key: u64) -> f64 {
    const SLOTS: usize = 1 << 16;
    thread_local! {
        static SEEN: std::cell::RefCell<Vec<(u64, f64)>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    SEEN.with(|seen| {
        let mut seen = seen.borrow_mut();
        if seen.is_empty() {
            // A key's slot is its low bits, so key 0's slot holds (0, 0.0) only as a miss.
            seen.resize(SLOTS, (u64::MAX, 0.0));
        }
        let slot = &mut seen[(key as usize) & (SLOTS - 1)];
        if slot.0 != key || key == u64::MAX {
            *slot = (key, normal(key));
        }
        slot.1
    })
}

/// Zipf's distribution on `1..=n` with exponent `s` (`s != 1`), sampled by rejection-inversion
/// (Hörmann and Derflinger, 1996) in constant memory, whatever `n`.
#[derive(Clone, Copy, Debug)]
struct Zipf {
    n: f64,
    s: f64,
    h_x1: f64,
    h_n: f64,
    cut: f64,
}

/// `ln(1 + x) / x`, continuous at 0.
fn helper1(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.ln_1p() / x
    } else {
        1.0 - x * (0.5 - x * (1.0 / 3.0 - 0.25 * x))
    }
}

/// `(exp(x) - 1) / x`, continuous at 0.
fn helper2(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.exp_m1() / x
    } else {
        1.0 + x * 0.5 * (1.0 + x / 3.0 * (1.0 + 0.25 * x))
    }
}

impl Zipf {
    fn new(n: u64, s: f64) -> Self {
        let mut z = Zipf { n: n as f64, s, h_x1: 0.0, h_n: 0.0, cut: 0.0 };
        z.h_x1 = z.h_integral(1.5) - 1.0;
        z.h_n = z.h_integral(n as f64 + 0.5);
        z.cut = 2.0 - z.h_integral_inverse(z.h_integral(2.5) - z.h(2.0));
        z
    }

    fn h(&self, x: f64) -> f64 {
        (-self.s * x.ln()).exp()
    }

    fn h_integral(&self, x: f64) -> f64 {
        let lx = x.ln();
        helper2((1.0 - self.s) * lx) * lx
    }

    fn h_integral_inverse(&self, x: f64) -> f64 {
        let t = (x * (1.0 - self.s)).max(-1.0);
        (helper1(t) * x).exp()
    }

    /// A rank in `1..=n`.
    fn sample(&self, rng: &mut Stream) -> u64 {
        loop {
            let u = self.h_n + rng.unit() * (self.h_x1 - self.h_n);
            let x = self.h_integral_inverse(u);
            let k = (x + 0.5).floor().clamp(1.0, self.n);
            if k - x <= self.cut || u >= self.h_integral(k + 0.5) - self.h(k) {
                return k as u64;
            }
        }
    }
}

/// The greatest common divisor.
fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// A generator of click records: record `i` of a split is a function of the seed and `i` only
/// (a counter-based generator), so a worker generates its own records without the others', and
/// nothing the generator holds grows with the table (a 20M-row table costs the same as a
/// 100-row one).
///
/// - **Ids**: the table's `embedding_rows` rows are split over the 26 fields as contiguous
///   ranges (field `f` has rows `field_rows(f)`, from a handful to a sixth of the table); a
///   field's id is Zipf-distributed ([`ZIPF_EXPONENT`]) over its range, its ranks scattered
///   over the range by a fixed bijection.
/// - **Dense features**: 13 counts, zero with some probability and Pareto-tailed otherwise,
///   given as `log(1 + count)`.
/// - **Labels**: drawn from a planted model, `p = sigmoid(b + w . dense + sum_f e(id_f) +
///   sum over 4 field pairs of v(id_a) . v(id_b))`, where `e(id)` and `v(id)` are normals
///   derived from the seed and the id by hashing (nothing stored). The best AUC any model can
///   reach is that of `p` itself ([`CtrData::best_auc`]).
#[derive(Clone, Debug)]
pub struct CtrData {
    seed: u64,
    rows: u64,
    offsets: [u64; FIELDS + 1],
    /// Per field, the odd multiplier that scatters ranks over the field's range.
    scramble: [u64; FIELDS],
    zipf: [Zipf; FIELDS],
    /// Per dense feature: probability of 0, Pareto shape, scale, weight in the planted model.
    dense: [(f64, f64, f64, f64); DENSE],
}

impl CtrData {
    /// The generator of `seed` for a table of `embedding_rows` rows (at least 26, at most
    /// 2^32, the ids being u32).
    pub fn new(seed: u64, embedding_rows: u64) -> Result<Self> {
        if !(MIN_ROWS..=1 << 32).contains(&embedding_rows) {
            return Err(Error::Usage(format!(
                "{embedding_rows} embedding rows: the ctr data needs at least one row per field ({MIN_ROWS}) and at most 2^32 (u32 ids)"
            )));
        }
        let spare = embedding_rows - MIN_ROWS;
        let total: u64 = FIELD_WEIGHTS.iter().sum();
        let mut sizes: [u64; FIELDS] = std::array::from_fn(|f| 1 + spare * FIELD_WEIGHTS[f] / total);
        sizes[FIELDS - 1] += embedding_rows - sizes.iter().sum::<u64>();
        let mut offsets = [0u64; FIELDS + 1];
        for f in 0..FIELDS {
            offsets[f + 1] = offsets[f] + sizes[f];
        }
        let scramble = std::array::from_fn(|f| {
            let n = sizes[f];
            let mut a = (mix64(seed ^ 0x5ca1_ab1e ^ f as u64) % n.max(1)) | 1;
            while n > 1 && gcd(a, n) != 1 {
                a += 2;
            }
            a % n.max(1)
        });
        let zipf = std::array::from_fn(|f| Zipf::new(sizes[f], ZIPF_EXPONENT));
        let dense = std::array::from_fn(|j| {
            let mut s = Stream(mix64(seed ^ 0xde75_e000 ^ j as u64));
            let zero = 0.1 + 0.4 * s.unit();
            let shape = 1.1 + 1.4 * s.unit();
            let scale = (s.unit() * 5.0).exp();
            let weight = 0.25 * normal(s.next());
            (zero, shape, scale, weight)
        });
        Ok(Self { seed, rows: embedding_rows, offsets, scramble, zipf, dense })
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The rows of the table the ids index.
    pub fn embedding_rows(&self) -> u64 {
        self.rows
    }

    /// Field `f`'s rows of the table.
    pub fn field_rows(&self, f: usize) -> Range<u64> {
        self.offsets[f]..self.offsets[f + 1]
    }

    /// Record `index` of `split`.
    pub fn record(&self, split: Split, index: u64) -> CtrRecord {
        let key = match split {
            Split::Train => index,
            Split::Test => index | 1 << 63,
        };
        let mut s = Stream(mix64(mix64(self.seed) ^ mix64(key)));
        let dense = std::array::from_fn(|j| {
            let (zero, shape, scale, _) = self.dense[j];
            let count = if s.unit() < zero { 0.0 } else { (scale * (s.unit().powf(-1.0 / shape) - 1.0)).floor() };
            (count.min(1e12) as f32).ln_1p()
        });
        let ids = std::array::from_fn(|f| {
            let field = self.field_rows(f);
            let rank = self.zipf[f].sample(&mut s) - 1;
            let local = (u128::from(rank) * u128::from(self.scramble[f]) % u128::from(field.end - field.start)) as u64;
            (field.start + local) as u32
        });
        let mut r = CtrRecord { label: 0.0, dense, ids };
        r.label = f32::from(s.unit() < self.planted_probability(&r));
        r
    }

    /// The planted model's logit of a record (its label aside).
    pub fn planted_logit(&self, r: &CtrRecord) -> f64 {
        let base = mix64(self.seed ^ 0x0001_de77_ec75);
        let mut logit = BIAS;
        for (x, (_, _, _, w)) in r.dense.iter().zip(&self.dense) {
            logit += w * f64::from(*x);
        }
        for &id in &r.ids {
            logit += ID_EFFECT * normal_cached(base ^ mix64(u64::from(id)));
        }
        let vector =
            |id: u32, k: usize| INTERACTION_STD * normal_cached(mix64(base ^ 0x7ec ^ k as u64) ^ mix64(u64::from(id)));
        for (a, b) in INTERACTIONS {
            logit += (0..INTERACTION_DIM).map(|k| vector(r.ids[a], k) * vector(r.ids[b], k)).sum::<f64>();
        }
        logit
    }

    /// The planted model's click probability of a record: what its label was drawn from.
    pub fn planted_probability(&self, r: &CtrRecord) -> f64 {
        1.0 / (1.0 + (-self.planted_logit(r)).exp())
    }

    /// Records `range` of `split`, generated one by one.
    pub fn records(&self, split: Split, range: Range<u64>) -> impl Iterator<Item = CtrRecord> + '_ {
        range.map(move |i| self.record(split, i))
    }

    /// The best AUC reachable on the first `count` records of `split`: the planted
    /// probability's, against the labels drawn from it.
    pub fn best_auc(&self, split: Split, count: u64) -> f64 {
        let (scores, labels): (Vec<f64>, Vec<f32>) =
            self.records(split, 0..count).map(|r| (self.planted_probability(&r), r.label)).unzip();
        super::auc(&scores, &labels)
    }

    /// Records `range` of `split` as a batch: dense features f32 `(B, 13)`, ids u32 `(B, 26)`,
    /// labels f32 `(B,)`.
    pub fn batch(&self, split: Split, range: Range<u64>, device: &Device) -> Result<CtrBatch> {
        batch_of(self.records(split, range), device)
    }
}

/// The bit of a record key ([`CtrData::keys`]) that marks a test record.
const TEST_KEY: i64 = 1 << 62;

impl CtrData {
    /// The keys of records `range` of `split`: an i64 tensor `(N,)` of 8 bytes a record (a
    /// record is 160), which strategies split, shuffle and batch like any batch, and from which
    /// [`batch_of_keys`](Self::batch_of_keys) generates the records where a step needs them.
    /// At most 2^62 records.
    pub fn keys(&self, split: Split, range: Range<u64>, device: &Device) -> Result<Tensor> {
        if range.end > TEST_KEY as u64 {
            return Err(Error::Usage(format!("record {} is past the 2^62 records a split has", range.end)));
        }
        let tag = match split {
            Split::Train => 0,
            Split::Test => TEST_KEY,
        };
        let keys: Vec<i64> = range.map(|i| i as i64 | tag).collect();
        let n = keys.len();
        Ok(Tensor::from_vec(keys, n, device)?)
    }

    /// The records of `keys` ([`keys`](Self::keys), any subset in any order) as a batch on
    /// `device`: record `i` of its split for each key, as [`batch`](Self::batch) generates it.
    pub fn batch_of_keys(&self, keys: &Tensor, device: &Device) -> Result<CtrBatch> {
        raw_of_keys(self, &keys.flatten_all()?.to_vec1::<i64>()?)?.into_batch(device)
    }
}

/// The records of `keys` as plain vectors, made on any thread ([`CtrData::batch_of_keys`]
/// before its tensors).
pub(crate) fn raw_of_keys(data: &CtrData, keys: &[i64]) -> Result<RawBatch> {
    if let Some(k) = keys.iter().find(|k| **k < 0) {
        return Err(Error::Usage(format!("{k} is not a record key (keys are 0 or more)")));
    }
    let split = |k: i64| if k & TEST_KEY != 0 { Split::Test } else { Split::Train };
    Ok(RawBatch::of(keys.iter().map(|&k| data.record(split(k), (k & !TEST_KEY) as u64))))
}

/// A batch's dense features, ids and labels, record by record, before they are tensors.
pub(crate) struct RawBatch {
    dense: Vec<f32>,
    ids: Vec<u32>,
    labels: Vec<f32>,
}

impl RawBatch {
    fn of(records: impl IntoIterator<Item = CtrRecord>) -> Self {
        let (mut dense, mut ids, mut labels) = (Vec::new(), Vec::new(), Vec::new());
        for r in records {
            dense.extend_from_slice(&r.dense);
            ids.extend_from_slice(&r.ids);
            labels.push(r.label);
        }
        Self { dense, ids, labels }
    }

    /// The ids, record after record (`FIELDS` each).
    pub(crate) fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The batch on `device`.
    pub(crate) fn into_batch(self, device: &Device) -> Result<CtrBatch> {
        let n = self.labels.len();
        Ok((
            Tensor::from_vec(self.dense, (n, DENSE), device)?,
            Tensor::from_vec(self.ids, (n, FIELDS), device)?,
            Tensor::from_vec(self.labels, n, device)?,
        ))
    }
}

/// A batch of click records: dense features f32 `(B, 13)`, ids u32 `(B, 26)`, labels f32
/// `(B,)`. A tuple of tensors, which strategies split over their replicas like any batch.
pub type CtrBatch = (Tensor, Tensor, Tensor);

/// `records` as a [`CtrBatch`].
pub fn batch_of(records: impl IntoIterator<Item = CtrRecord>, device: &Device) -> Result<CtrBatch> {
    RawBatch::of(records).into_batch(device)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The remembered normal is the normal, bit for bit: repeated keys, keys that share a slot
    /// (evicting each other), the sentinel key and key 0.
    #[test]
    fn a_remembered_normal_is_the_normal() {
        let mut keys: Vec<u64> = (0..5000u64).map(|i| mix64(i % 700)).collect();
        keys.extend((0..50u64).flat_map(|i| [i << 16, (i << 16) + (1 << 16), i << 16]));
        keys.extend([u64::MAX, u64::MAX, 0, 0, u64::MAX - (1 << 16)]);
        for k in keys {
            assert_eq!(normal_cached(k).to_bits(), normal(k).to_bits(), "key {k:#x}");
        }
    }

    #[test]
    fn a_record_is_a_function_of_seed_split_and_index() {
        let data = CtrData::new(7, 10_000).unwrap();
        let again = CtrData::new(7, 10_000).unwrap();
        let whole: Vec<CtrRecord> = data.records(Split::Train, 0..300).collect();
        // Two workers' shards, generated separately, in another order.
        let mut shards: Vec<CtrRecord> = again.records(Split::Train, 150..300).collect();
        shards.splice(0..0, again.records(Split::Train, 0..150));
        assert_eq!(whole, shards);
        assert_eq!(data.record(Split::Test, 5), again.record(Split::Test, 5));
        assert_ne!(data.record(Split::Test, 5), data.record(Split::Train, 5));
        assert_ne!(CtrData::new(8, 10_000).unwrap().record(Split::Train, 3), data.record(Split::Train, 3));
        for r in &whole {
            assert!(r.label == 0.0 || r.label == 1.0);
            assert!(r.dense.iter().all(|x| x.is_finite() && *x >= 0.0));
            for (f, &id) in r.ids.iter().enumerate() {
                assert!(data.field_rows(f).contains(&u64::from(id)), "field {f}: id {id}");
            }
        }
        let r = whole[17];
        assert_eq!(CtrRecord::from_bytes(&r.to_bytes()), r);
    }

    #[test]
    fn fields_split_the_table_and_ids_are_zipf_within_each() {
        let data = CtrData::new(1, 20_000).unwrap();
        assert_eq!(data.field_rows(0).start, 0);
        assert_eq!(data.field_rows(FIELDS - 1).end, 20_000);
        for f in 1..FIELDS {
            assert_eq!(data.field_rows(f).start, data.field_rows(f - 1).end);
        }
        let f = FIELDS - 1;
        let n = data.field_rows(f).end - data.field_rows(f).start;
        let mut counts = vec![0u32; n as usize];
        for r in data.records(Split::Train, 0..50_000) {
            counts[(u64::from(r.ids[f]) - data.field_rows(f).start) as usize] += 1;
        }
        counts.sort_unstable();
        let (top, median) = (counts[counts.len() - 1], counts[counts.len() / 2]);
        // Zipf 1.1 over ~3,700 ids: the head id takes about a sixth of the draws.
        assert!(top > 4_000 && top > 100 * median.max(1), "top {top}, median {median}");
        // The smallest table still works: every field one row.
        let tiny = CtrData::new(1, 26).unwrap();
        assert!(tiny.records(Split::Train, 0..50).all(|r| r.ids.iter().enumerate().all(|(f, &id)| id == f as u32)));
        assert!(CtrData::new(1, 25).is_err());
        // Nothing grows with the table.
        let huge = CtrData::new(1, 20_000_000).unwrap();
        assert!(huge.records(Split::Train, 0..100).all(|r| r.ids.iter().all(|&id| u64::from(id) < 20_000_000)));
    }

    #[test]
    fn the_planted_model_is_well_above_chance() {
        let data = CtrData::new(0, 10_000).unwrap();
        let best = data.best_auc(Split::Test, 20_000);
        let clicks = data.records(Split::Test, 0..20_000).filter(|r| r.label == 1.0).count();
        assert!(best > 0.72, "planted best auc {best}");
        assert!((3_000..8_000).contains(&clicks), "{clicks} clicks in 20,000");
    }
}
