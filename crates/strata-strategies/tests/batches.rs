//! General batches: images `(N, C, H, W)`, token sequences (u32) with targets, and a named
//! map of several inputs of several dtypes split exactly over the replicas, uneven batches
//! weighted exactly, so that training under Mirrored(2, 3) and CentralStorage(2) ends on one
//! device's parameters; datasets streamed from record files with bounded memory, handed to
//! workers whole under the file sharding policy; bad input as one-line errors.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::common::max_rel_diff;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{AdamW, ParamsAdamW, SGD};
use rand::{Rng, SeedableRng};
use strata_core::data::files::{TokenRecords, TokenWidth};
use strata_core::data::{BatchData, DistributedBatch, TailPolicy};
use strata_core::optim::OptimizerMemory;
use strata_core::strategy::AutoShardPolicy;
use strata_core::{Replicated, Scope, Strategy, StrategyHandle};

type Params = Vec<(String, Vec<f32>)>;

const TOLERANCE: f32 = 1e-5;

fn values<M>(m: &Replicated<M>) -> Params {
    m.values().unwrap().into_iter().map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect()
}

fn rng(seed: u64) -> rand_chacha::ChaCha8Rng {
    rand_chacha::ChaCha8Rng::seed_from_u64(seed)
}

/// Every element of `t`, as f64 (exact for every dtype used here).
fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()
}

/// A model trained on batches of `B`: its loss is the mean over the batch's examples.
trait Model<B>: Sized + Send + Sync {
    fn build(sc: &Scope) -> candle_core::Result<Self>;
    fn loss(&self, b: &B) -> candle_core::Result<Tensor>;
}

/// Trains `M` with `O` on `batches` under `s`, checking that every global batch is split
/// into shards of the expected sizes (the first `B % N` replicas one larger); returns the
/// final parameters.
fn train<B: BatchData, M: Model<B>, O: OptimizerMemory + Send>(
    s: &StrategyHandle,
    cfg: O::Config,
    batches: &[B],
) -> Params
where
    O::Config: Clone,
{
    let model = s.scope(M::build).unwrap();
    let opt = model.optimizer::<O>(cfg).unwrap();
    let mut ds = s.distribute_dataset(batches.to_vec(), TailPolicy::Split);
    let mut steps = 0;
    for db in ds.by_ref() {
        let rows: Vec<usize> = db.shards.values().iter().map(|sh| sh.batch.rows().unwrap()).collect();
        let (n, g) = (rows.len(), db.global_len());
        assert_eq!(rows, (0..n).map(|i| g / n + usize::from(i < g % n)).collect::<Vec<_>>());
        s.run_batch(&db, |ctx, shard| {
            let b = shard.batch.to_device(ctx.candle_device())?;
            let loss = model.on(ctx)?.loss(&b)?;
            ctx.backward_and_sync(&loss, &opt)
        })
        .unwrap();
        steps += 1;
    }
    assert!(ds.take_error().is_none());
    assert_eq!(steps, batches.len(), "no batch skipped");
    values(&model)
}

/// `M` trained on `batches` with SGD and AdamW under Mirrored(2), Mirrored(3) and
/// CentralStorage(2) ends on one device's parameters.
fn same_as_one_device<B: BatchData, M: Model<B>>(batches: &[B]) {
    let one = common::one_device();
    let adamw = ParamsAdamW { lr: 0.01, weight_decay: 0.1, ..Default::default() };
    let sgd_one = train::<B, M, SGD>(&one, 0.1, batches);
    let adamw_one = train::<B, M, AdamW>(&one, adamw.clone(), batches);
    let initial = one.scope(M::build).map(|m| values(&m)).unwrap();
    assert!(max_rel_diff(&initial, &sgd_one) > 1e-3, "training moved the parameters");
    for (name, s) in [
        ("mirrored 2", common::mirrored(2)),
        ("mirrored 3", common::mirrored(3)),
        ("central storage 2", common::central(2)),
    ] {
        let d = max_rel_diff(&sgd_one, &train::<B, M, SGD>(&s, 0.1, batches));
        eprintln!("{name}, sgd: max relative difference to one device {d:e}");
        assert!(d <= TOLERANCE, "{name}, sgd: {d}");
        let d = max_rel_diff(&adamw_one, &train::<B, M, AdamW>(&s, adamw.clone(), batches));
        eprintln!("{name}, adamw: max relative difference to one device {d:e}");
        assert!(d <= TOLERANCE, "{name}, adamw: {d}");
    }
}

/// A batch's shards, joined, are the batch: every row once, in order.
fn assert_split_exact<B: BatchData>(b: &B, n: usize, parts: impl Fn(&B) -> Vec<Tensor>) {
    let db = DistributedBatch::split(b, n).unwrap();
    let shards: Vec<B> = db.shards.values().iter().map(|s| s.batch.clone()).collect();
    let weights: f32 = db.weights().iter().sum();
    assert!((weights - 1.0).abs() < 1e-6);
    let joined = B::concat(&shards).unwrap();
    for (a, b) in parts(b).iter().zip(parts(&joined)) {
        assert_eq!((a.dims(), a.dtype()), (b.dims(), b.dtype()));
        assert_eq!(flat(a), flat(&b));
    }
}

// ---------------------------------------------------------------------------------------------
// Images

/// conv2d(2 -> 4, 3x3) -> relu -> max-pool 2 -> linear(16 -> 3), on 2x6x6 images.
struct Cnn {
    conv: candle_nn::Conv2d,
    fc: candle_nn::Linear,
}

impl Model<(Tensor, Tensor)> for Cnn {
    fn build(sc: &Scope) -> candle_core::Result<Self> {
        let vb = sc.var_builder();
        Ok(Self {
            conv: candle_nn::conv2d(2, 4, 3, Default::default(), vb.pp("conv"))?,
            fc: candle_nn::linear(16, 3, vb.pp("fc"))?,
        })
    }
    fn loss(&self, (x, y): &(Tensor, Tensor)) -> candle_core::Result<Tensor> {
        let h = self.conv.forward(x)?.relu()?.max_pool2d(2)?.flatten_from(1)?;
        candle_nn::loss::cross_entropy(&self.fc.forward(&h)?, y)
    }
}

fn images(n: usize, seed: u64) -> (Tensor, Tensor) {
    let mut r = rng(seed);
    let px: Vec<f32> = (0..n * 2 * 36).map(|_| r.random::<f32>() * 2.0 - 1.0).collect();
    let labels: Vec<u32> = (0..n).map(|_| r.random_range(0..3u32)).collect();
    (Tensor::from_vec(px, (n, 2, 6, 6), &Device::Cpu).unwrap(), Tensor::from_vec(labels, n, &Device::Cpu).unwrap())
}

#[test]
fn image_batches_split_exactly_and_train_as_on_one_device() {
    let batches: Vec<_> = [7, 8, 5, 6].iter().enumerate().map(|(k, &n)| images(n, 10 + k as u64)).collect();
    for n in [2, 3] {
        assert_split_exact(&batches[0], n, |(x, y)| vec![x.clone(), y.clone()]);
    }
    same_as_one_device::<_, Cnn>(&batches);
}

// ---------------------------------------------------------------------------------------------
// Token sequences

const VOCAB: usize = 512;

/// embedding(512, 8) -> layer norm -> linear(8 -> 512): next-token logits per position.
struct TokenModel {
    emb: candle_nn::Embedding,
    norm: candle_nn::LayerNorm,
    out: candle_nn::Linear,
}

impl Model<(Tensor, Tensor)> for TokenModel {
    fn build(sc: &Scope) -> candle_core::Result<Self> {
        let vb = sc.var_builder();
        Ok(Self {
            emb: candle_nn::embedding(VOCAB, 8, vb.pp("emb"))?,
            norm: candle_nn::layer_norm(8, 1e-5, vb.pp("norm"))?,
            out: candle_nn::linear(8, VOCAB, vb.pp("out"))?,
        })
    }
    fn loss(&self, (x, y): &(Tensor, Tensor)) -> candle_core::Result<Tensor> {
        let logits = self.out.forward(&self.norm.forward(&self.emb.forward(x)?)?)?;
        candle_nn::loss::cross_entropy(&logits.flatten_to(1)?, &y.flatten_all()?)
    }
}

/// `n` sequences of 6 u32 tokens and their next tokens.
fn tokens(n: usize, seed: u64) -> (Tensor, Tensor) {
    let mut r = rng(seed);
    let seq: Vec<u32> = (0..n * 7).map(|_| r.random_range(0..VOCAB as u32)).collect();
    let all = Tensor::from_vec(seq, (n, 7), &Device::Cpu).unwrap();
    (all.narrow(1, 0, 6).unwrap().contiguous().unwrap(), all.narrow(1, 1, 6).unwrap().contiguous().unwrap())
}

#[test]
fn token_sequences_split_exactly_and_train_as_on_one_device() {
    let batches: Vec<_> = [9, 7, 4].iter().enumerate().map(|(k, &n)| tokens(n, 20 + k as u64)).collect();
    assert_eq!(batches[0].0.dtype(), DType::U32);
    for n in [2, 3] {
        assert_split_exact(&batches[1], n, |(x, y)| vec![x.clone(), y.clone()]);
    }
    same_as_one_device::<_, TokenModel>(&batches);
}

// ---------------------------------------------------------------------------------------------
// A named map of several inputs, of several dtypes

type Named = BTreeMap<String, Tensor>;

/// Regression on an image (bf16), an id (i64), extra features (f16), masked per example (u8).
struct MultiInput {
    img: candle_nn::Linear,
    id: candle_nn::Embedding,
    head: candle_nn::Linear,
}

impl Model<Named> for MultiInput {
    fn build(sc: &Scope) -> candle_core::Result<Self> {
        let vb = sc.var_builder();
        Ok(Self {
            img: candle_nn::linear(16, 4, vb.pp("img"))?,
            id: candle_nn::embedding(10, 4, vb.pp("id"))?,
            head: candle_nn::linear(6, 1, vb.pp("head"))?,
        })
    }
    fn loss(&self, b: &Named) -> candle_core::Result<Tensor> {
        let image = b["image"].to_dtype(DType::F32)?.flatten_from(1)?;
        let h = (self.img.forward(&image)? + self.id.forward(&b["id"])?)?.tanh()?;
        let extra = b["extra"].to_dtype(DType::F32)?;
        let pred = self.head.forward(&Tensor::cat(&[&h, &extra], 1)?)?.squeeze(1)?;
        let mask = b["mask"].to_dtype(DType::F32)?;
        ((pred - &b["target"])?.sqr()? * mask)?.mean_all()
    }
}

fn named(n: usize, seed: u64) -> Named {
    let mut r = rng(seed);
    let dev = &Device::Cpu;
    let mut f = |k: usize| (0..k).map(|_| r.random::<f32>() * 2.0 - 1.0).collect::<Vec<f32>>();
    let image = Tensor::from_vec(f(n * 16), (n, 1, 4, 4), dev).unwrap().to_dtype(DType::BF16).unwrap();
    let extra = Tensor::from_vec(f(n * 2), (n, 2), dev).unwrap().to_dtype(DType::F16).unwrap();
    let target = Tensor::from_vec(f(n), n, dev).unwrap();
    let ids: Vec<i64> = (0..n).map(|i| ((i as u64 * 7 + seed) % 10) as i64).collect();
    let mask: Vec<u8> = (0..n).map(|i| u8::from(!(i as u64 + seed).is_multiple_of(4))).collect();
    [
        ("image", image),
        ("extra", extra),
        ("target", target),
        ("id", Tensor::from_vec(ids, n, dev).unwrap()),
        ("mask", Tensor::from_vec(mask, n, dev).unwrap()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

#[test]
fn a_map_of_several_inputs_splits_exactly_and_trains_as_on_one_device() {
    let batches: Vec<_> = [7, 10, 5].iter().enumerate().map(|(k, &n)| named(n, 30 + k as u64)).collect();
    let dtypes: Vec<DType> = batches[0].values().map(Tensor::dtype).collect();
    assert_eq!(dtypes, vec![DType::F16, DType::I64, DType::BF16, DType::U8, DType::F32]);
    for n in [2, 3] {
        assert_split_exact(&batches[0], n, |m| m.values().cloned().collect());
    }
    same_as_one_device::<_, MultiInput>(&batches);
}

#[test]
fn pipelines_from_a_function_yield_tensor_batches_weighted_by_their_rows() {
    let s = common::mirrored(2);
    let mut pipes = s
        .distribute_datasets_from_function(|ctx| {
            let per = ctx.per_replica_batch_size(6)?;
            Ok((0..4).map(move |k| tokens(per, k)))
        })
        .unwrap();
    let steps: Vec<_> = pipes.by_ref().collect();
    assert_eq!(steps.len(), 2);
    assert!(steps.iter().all(|d| d.weights() == vec![0.5, 0.5] && d.global_len() == 6));
    assert!(pipes.take_error().is_none());
    // A pipeline whose batch's parts disagree ends the iteration with the error.
    let mut bad =
        s.distribute_datasets_from_function(|_| Ok((0..2).map(|k| (tokens(3, k).0, tokens(2, k).1)))).unwrap();
    assert!(bad.next().is_none());
    let e = bad.take_error().unwrap().to_string();
    assert!(e.contains("part 0 has 3 rows but part 1 has 2"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// Bad input

#[test]
fn tensors_that_disagree_on_the_first_axis_are_a_one_line_error() {
    let (x, _) = tokens(7, 1);
    let (_, y) = tokens(6, 1);
    let e = DistributedBatch::split(&(x.clone(), y.clone()), 2).unwrap_err().to_string();
    assert!(e.contains("part 0 has 7 rows but part 1 has 6") && e.contains("give every part"), "{e}");
    assert!(!e.contains('\n') && !e.ends_with('.'), "{e}");
    let s = common::mirrored(2);
    let mut ds = s.distribute_dataset(vec![tokens(4, 2), (x, y)], TailPolicy::Split);
    assert!(ds.next().is_some(), "the good batch");
    assert!(ds.next().is_none(), "the bad batch ends the iteration");
    let e = ds.take_error().unwrap().to_string();
    assert!(e.contains("part 0 has 7 rows but part 1 has 6"), "{e}");
    let mut map = named(5, 1);
    map.insert("mask".into(), Tensor::zeros(4, DType::U8, &Device::Cpu).unwrap());
    let e = DistributedBatch::split(&map, 2).unwrap_err().to_string();
    assert!(e.contains("\"extra\" has 5 rows but \"mask\" has 4"), "{e}");
}

/// Writes `records` records of `seq + 1` u16 tokens to `path`, token `t` of record `r` being
/// `base + r * (seq + 1) + t`.
fn write_records(path: &Path, base: u16, records: usize, seq: usize) {
    let bytes: Vec<u8> = (0..records * (seq + 1)).flat_map(|i| (base + i as u16).to_le_bytes()).collect();
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn a_record_file_whose_size_is_not_a_whole_number_of_records_is_a_one_line_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("short.bin");
    std::fs::write(&path, [0u8; 14]).unwrap(); // 7 tokens; records of 4 tokens are 8 bytes
    let e = TokenRecords::open(&path, 3, TokenWidth::U16, 4).unwrap_err().to_string();
    assert!(e.contains("short.bin has 14 bytes") && e.contains("records of 8 bytes"), "{e}");
    assert!(!e.contains('\n'), "{e}");
    // Through a dataset: the iteration ends and says why.
    let good = dir.path().join("good.bin");
    write_records(&good, 0, 4, 3);
    let s = common::mirrored(2);
    let mut ds = s
        .distribute_files(&[good, path], 4, TailPolicy::Split, |p| TokenRecords::open(p, 3, TokenWidth::U16, 4))
        .unwrap();
    assert_eq!(ds.by_ref().count(), 1, "the good file's batch, then the error");
    let e = ds.take_error().unwrap().to_string();
    assert!(e.contains("short.bin has 14 bytes"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// Streaming from files

#[test]
fn streaming_from_files_is_exact_and_holds_at_most_a_batch_and_a_read() {
    let dir = tempfile::tempdir().unwrap();
    let (seq, chunk, global) = (15usize, 256usize, 96usize);
    // 3 files of 20,000 records of 16 u16 tokens (640,000 bytes each).
    let files: Vec<PathBuf> = (0..3)
        .map(|f| {
            let p = dir.path().join(format!("shard-{f}.bin"));
            let bytes: Vec<u8> =
                (0..20_000 * (seq + 1)).flat_map(|i| (((f * 20_000 * 16 + i) % 65_521) as u16).to_le_bytes()).collect();
            std::fs::write(&p, bytes).unwrap();
            p
        })
        .collect();
    let s = common::mirrored(2);
    let mut ds = s
        .distribute_files(&files, global, TailPolicy::Split, |p| TokenRecords::open(p, seq, TokenWidth::U16, chunk))
        .unwrap();
    let (mut rows, mut next_token, mut steps) = (0usize, 0usize, 0usize);
    let record_bytes = (seq + 1) * 2;
    while let Some(db) = ds.next() {
        let held = ds.get_ref().pending_rows();
        assert!(held < global + chunk, "step {steps}: {held} rows held");
        if let Some(r) = ds.get_ref().reading() {
            assert!(r.buffer_bytes() <= chunk * record_bytes, "one read of {chunk} records");
        }
        let sizes: Vec<usize> = db.shards.values().iter().map(|s| s.batch.rows().unwrap()).collect();
        assert!(db.global_len() == global || ds.get_ref().files_left() == 0);
        assert_eq!(sizes.iter().sum::<usize>(), db.global_len());
        // Every record's inputs, in order, and its targets shifted by one.
        for sh in db.shards.values() {
            let (x, y) = &sh.batch;
            let (x, y) = (x.to_vec2::<u32>().unwrap(), y.to_vec2::<u32>().unwrap());
            for (xr, yr) in x.iter().zip(&y) {
                let want: Vec<u32> = (0..=seq).map(|t| ((next_token + t) % 65_521) as u32).collect();
                assert_eq!((&xr[..], &yr[..]), (&want[..seq], &want[1..]), "record {rows}");
                next_token += seq + 1;
                rows += 1;
            }
        }
        steps += 1;
    }
    assert!(ds.take_error().is_none());
    assert_eq!(rows, 60_000, "every record once");
    assert_eq!(steps, 60_000usize.div_ceil(global));
}

// ---------------------------------------------------------------------------------------------
// Across workers

/// Runs `body(worker index, strategy)` on `n` MultiWorkerMirrored workers of one replica each,
/// sharding input by `policy`.
fn on_workers<T: Send + 'static>(
    n: usize,
    policy: AutoShardPolicy,
    body: impl Fn(usize, &strata_strategies::MultiWorkerMirroredStrategy) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    use strata_strategies::cluster::{ClusterConfig, ClusterSpec, TaskId};
    let ports: Vec<u16> = crate::common::loopback_ports(n);
    let spec = ClusterSpec::workers(ports.iter().map(|p| format!("127.0.0.1:{p}")).collect::<Vec<_>>()).unwrap();
    let handles: Vec<_> = (0..n)
        .map(|i| {
            let (spec, body) = (spec.clone(), body.clone());
            std::thread::spawn(move || {
                let token = strata_transport::ClusterToken::new("0123456789abcdef0123456789abcdef").unwrap();
                let mut o = strata_strategies::MultiWorkerOptions::new(token).unwrap();
                o.local_devices = strata_core::device::logical_cpus(1).unwrap();
                o.auto_shard = policy;
                o.coordination.rendezvous_timeout = std::time::Duration::from_secs(30);
                o.options.collective_timeout = std::time::Duration::from_secs(30);
                let config = ClusterConfig::new(spec, TaskId::worker(i)).unwrap();
                let s = strata_strategies::MultiWorkerMirroredStrategy::new(config, o).unwrap();
                let out = body(i, &s);
                let _ = s.finish();
                out
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// 4 files of 6 records of 4 tokens (seq 3); file `f`'s tokens start at `100 f`.
fn record_files(dir: &Path) -> Vec<PathBuf> {
    (0..4u16)
        .map(|f| {
            let p = dir.join(format!("part-{f}.bin"));
            write_records(&p, 100 * f, 6, 3);
            p
        })
        .collect()
}

fn open_records(p: &Path) -> strata_core::Result<TokenRecords> {
    TokenRecords::open(p, 3, TokenWidth::U16, 4)
}

#[test]
fn file_sharding_hands_each_of_two_workers_whole_files_and_trains_as_one_device() {
    let dir = tempfile::tempdir().unwrap();
    let files = record_files(dir.path());
    let lr = 0.1;
    let shared = files.clone();
    let out = on_workers(2, AutoShardPolicy::File, move |_, s| {
        // One file for two workers: each needs a whole one.
        let e = s.distribute_files(&shared[..1], 4, TailPolicy::Split, open_records).unwrap_err().to_string();
        assert!(e.contains("1 files for 2 workers") && e.contains("at least 2 files"), "{e}");
        assert!(!e.contains('\n'), "{e}");
        let model = s.scope(TokenModel::build).unwrap();
        let opt = model.optimizer::<SGD>(lr).unwrap();
        let mut ds = s.distribute_files(&shared, 4, TailPolicy::Split, open_records).unwrap();
        let mut firsts = Vec::new();
        for db in ds.by_ref() {
            assert_eq!((db.local_len(), db.global_len()), (2, 4), "half of each global batch");
            let (x, _) = &db.shards.values()[0].batch;
            firsts.extend(x.to_vec2::<u32>().unwrap().into_iter().map(|r| r[0]));
            s.run_batch(&db, |ctx, shard| {
                let loss = model.on(ctx)?.loss(&shard.batch)?;
                ctx.backward_and_sync(&loss, &opt)
            })
            .unwrap();
        }
        assert!(ds.take_error().is_none());
        (firsts, values(&model))
    });
    // Worker 0 read files 0 and 2 whole, worker 1 files 1 and 3, every record once.
    let file_records = |f: u32| (0..6).map(move |r| 100 * f + 4 * r);
    assert_eq!(out[0].0, file_records(0).chain(file_records(2)).collect::<Vec<_>>());
    assert_eq!(out[1].0, file_records(1).chain(file_records(3)).collect::<Vec<_>>());
    // One device on the global batches the two workers made together.
    let stream = |fs: [usize; 2]| -> Vec<(Tensor, Tensor)> {
        let all: Vec<(Tensor, Tensor)> =
            fs.iter().flat_map(|&f| open_records(&files[f]).unwrap().map(Result::unwrap)).collect();
        let all = <(Tensor, Tensor)>::concat(&all).unwrap();
        (0..6).map(|k| all.slice(2 * k..2 * k + 2).unwrap()).collect()
    };
    let global: Vec<(Tensor, Tensor)> = stream([0, 2])
        .into_iter()
        .zip(stream([1, 3]))
        .map(|(a, b)| <(Tensor, Tensor)>::concat(&[a, b]).unwrap())
        .collect();
    let one = train::<_, TokenModel, SGD>(&common::one_device(), lr, &global);
    for (w, (_, params)) in out.iter().enumerate() {
        let d = max_rel_diff(&one, params);
        eprintln!("file sharding, worker {w}: max relative difference to one device {d:e}");
        assert!(d <= TOLERANCE, "worker {w}: {d}");
    }
}

#[test]
fn data_sharding_of_files_keeps_each_workers_slice_of_every_global_batch() {
    let dir = tempfile::tempdir().unwrap();
    let files = record_files(dir.path());
    let out = on_workers(2, AutoShardPolicy::Data, move |_, s| {
        let mut ds = s.distribute_files(&files, 5, TailPolicy::Split, open_records).unwrap();
        let mut firsts = Vec::new();
        for db in ds.by_ref() {
            let (x, _) = &db.shards.values()[0].batch;
            firsts.push(x.to_vec2::<u32>().unwrap().into_iter().map(|r| r[0]).collect::<Vec<_>>());
        }
        assert!(ds.take_error().is_none());
        firsts
    });
    // 24 records in global batches of 5 (the last of 4): worker 0 the first 3 (or 2) of each.
    let rec = |i: u32| 100 * (i / 6) + 4 * (i % 6);
    for (k, (a, b)) in out[0].iter().zip(&out[1]).enumerate() {
        let start = 5 * k as u32;
        let len = (24 - start).min(5);
        let cut = len.div_ceil(2);
        assert_eq!(a, &(start..start + cut).map(rec).collect::<Vec<_>>());
        assert_eq!(b, &(start + cut..start + len).map(rec).collect::<Vec<_>>());
    }
    assert_eq!(out[0].len(), 5);
}
