//! Embedding tables in this process's memory (`LocalTables`) under the in-process strategies:
//! the same model code (the `Embedding` layer) trains its table row by row, with a row
//! optimizer, where a table held as a variable is stepped whole. Under SGD the rows end on the
//! bits the variable ends on under the same strategy (the replicas' rows reduced row-wise as
//! the in-memory all-reduce reduces the variable's gradient), and within a tight tolerance of
//! one device on the global batch; the other row optimizers step only the touched rows.

use std::collections::BTreeSet;
use std::sync::Arc;

use candle_core::{Device, Tensor};
use candle_nn::{Linear, Module, SGD};
use rand::{Rng, SeedableRng};
use strata_core::data::DistributedBatch;
use strata_core::embedding::{init_row, RowInit, TableConfig, TableSize, TableStore};
use strata_core::layers::Embedding;
use strata_core::{Replicated, Scope, Strategy, StrategyHandle, StrategyOptions};
use strata_ps::RowOptimizer;
use strata_strategies::{CentralStorageStrategy, CpuReduction, LocalTables, MirroredStrategy, OneDeviceStrategy};

use crate::common::{self, max_rel_diff};

const SEED: u64 = 7;
const ROWS: u64 = 40;
const DIM: usize = 4;
const FIELDS: usize = 3;
const LR: f64 = 0.5;

/// The in-process strategy configurations of `strategy_test!` (not MultiWorkerMirrored, which
/// local tables refuse).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Config {
    OneDevice,
    Mirrored(usize),
    MirroredToOne(usize),
    Central(usize),
    MirroredInPlace(usize),
    CentralInPlace(usize),
}

fn strategy(c: Config, tables: Option<Arc<dyn TableStore>>) -> StrategyHandle {
    let options = StrategyOptions { seed: SEED, tables, ..Default::default() };
    let cpus = |n| strata_core::device::logical_cpus(n).unwrap();
    match c {
        Config::OneDevice => OneDeviceStrategy::with_options(cpus(1).remove(0), options).unwrap().handle(),
        Config::Mirrored(n) => {
            MirroredStrategy::with_options(cpus(n), CpuReduction::InMemoryAllReduce, options).unwrap().handle()
        }
        Config::MirroredToOne(n) => {
            MirroredStrategy::with_options(cpus(n), CpuReduction::ReductionToOneDevice, options).unwrap().handle()
        }
        Config::Central(n) => {
            CentralStorageStrategy::with_options(cpus(n), CpuReduction::InMemoryAllReduce, options).unwrap().handle()
        }
        Config::MirroredInPlace(n) => {
            MirroredStrategy::with_cross_device_ops(cpus(n), common::in_place_ops(n), options).unwrap().handle()
        }
        Config::CentralInPlace(n) => {
            CentralStorageStrategy::with_cross_device_ops(cpus(n), common::in_place_ops(n), options).unwrap().handle()
        }
    }
}

/// One test body under every in-process configuration.
macro_rules! local_tables_test {
    ($name:ident, $body:expr) => {
        mod $name {
            use super::*;
            fn body(c: Config) {
                ($body)(c)
            }
            #[test]
            fn one_device() {
                body(Config::OneDevice)
            }
            #[test]
            fn mirrored_2() {
                body(Config::Mirrored(2))
            }
            #[test]
            fn mirrored_3() {
                body(Config::Mirrored(3))
            }
            #[test]
            fn mirrored_4() {
                body(Config::Mirrored(4))
            }
            #[test]
            fn mirrored_reduction_to_one_3() {
                body(Config::MirroredToOne(3))
            }
            #[test]
            fn central_storage_2() {
                body(Config::Central(2))
            }
            #[test]
            fn central_storage_4() {
                body(Config::Central(4))
            }
            #[test]
            fn mirrored_in_place_3() {
                body(Config::MirroredInPlace(3))
            }
            #[test]
            fn central_storage_in_place_2() {
                body(Config::CentralInPlace(2))
            }
        }
    };
}

fn table() -> TableConfig {
    TableConfig { init: RowInit::Normal { std: 0.3 }, ..TableConfig::rows("emb", ROWS, DIM) }
}

/// A table, a linear head on the looked-up rows and, with `extras`, a frozen layer between
/// them and a layer the loss never uses.
struct Model {
    emb: Embedding,
    frozen: Option<Linear>,
    _unused: Option<Linear>,
    head: Linear,
}

impl Model {
    fn build(s: &Scope, table: TableConfig, extras: bool) -> candle_core::Result<Self> {
        let emb = Embedding::new(s, table).map_err(candle_core::Error::wrap)?;
        let vb = s.var_builder();
        let (frozen, unused) = if extras {
            (
                Some(candle_nn::linear(FIELDS * DIM, FIELDS * DIM, vb.pp("frozen"))?),
                Some(candle_nn::linear(2, 2, vb.pp("unused"))?),
            )
        } else {
            (None, None)
        };
        Ok(Self { emb, frozen, _unused: unused, head: candle_nn::linear(FIELDS * DIM, 3, vb.pp("head"))? })
    }

    fn loss(&self, ids: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        let mut x = self.emb.forward(ids)?.flatten_from(1)?;
        if let Some(f) = &self.frozen {
            x = (&x + f.forward(&x)?.tanh()?)?;
        }
        candle_nn::loss::cross_entropy(&self.head.forward(&x)?, y)
    }
}

/// `n` examples of 3 Zipf-ish ids (some rows hit by several replicas, some by none) and a
/// class; `bad` puts id `ROWS` (outside the table) in the last example.
fn batch(n: usize, seed: u64, bad: bool) -> (Tensor, Tensor) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut ids: Vec<u32> = (0..n * FIELDS).map(|_| (rng.random::<f32>().powi(3) * ROWS as f32) as u32).collect();
    if bad {
        ids[n * FIELDS - 1] = ROWS as u32;
    }
    let labels: Vec<u32> = (0..n).map(|_| rng.random_range(0..3u32)).collect();
    (Tensor::from_vec(ids, (n, FIELDS), &Device::Cpu).unwrap(), Tensor::from_vec(labels, n, &Device::Cpu).unwrap())
}

const STEPS: usize = 6;
/// Uneven over 4 replicas: the weighting is checked too.
const GLOBAL: usize = 30;

fn build(s: &StrategyHandle, extras: bool) -> Replicated<Model> {
    let mut model = s.scope(|sc| Model::build(sc, table(), extras)).unwrap();
    if extras {
        model.freeze(&["frozen.*"]).unwrap();
    }
    model
}

/// Runs the steps of `batches` under `s` with SGD at `LR` on the variables: one execution per
/// batch, or all in one (`run_batches`).
fn steps(s: &StrategyHandle, model: &Replicated<Model>, batches: &[(Tensor, Tensor)], one_execution: bool) {
    let opt = model.optimizer::<SGD>(LR).unwrap();
    let split: Vec<_> = batches.iter().map(|b| DistributedBatch::split(b, s.num_replicas_in_sync()).unwrap()).collect();
    let step = |ctx: &strata_core::ReplicaContext<'_>, shard: &strata_core::data::Shard<(Tensor, Tensor)>| {
        let (ids, y) = &shard.batch;
        let loss = model.on(ctx)?.loss(ids, y)?;
        ctx.backward_and_sync(&loss, &opt)
    };
    if one_execution {
        s.run_batches(&split, step).unwrap();
    } else {
        for db in &split {
            s.run_batch(db, step).unwrap();
        }
    }
}

fn batches() -> Vec<(Tensor, Tensor)> {
    (0..STEPS).map(|k| batch(GLOBAL, k as u64, false)).collect()
}

/// The ids the batches touch.
fn touched(batches: &[(Tensor, Tensor)]) -> BTreeSet<u64> {
    batches.iter().flat_map(|(ids, _)| ids.flatten_all().unwrap().to_vec1::<u32>().unwrap()).map(u64::from).collect()
}

fn all_ids() -> Vec<u64> {
    (0..ROWS).collect()
}

/// The model's variables and the table's rows (from the store, or the variable).
fn trained(model: &Replicated<Model>, store: Option<&LocalTables>) -> Vec<(String, Vec<f32>)> {
    let mut params = common::params(model);
    if let Some(store) = store {
        params.push(("emb".into(), store.read("emb", &all_ids()).unwrap()));
    }
    params.sort_by(|a, b| a.0.cmp(&b.0));
    params
}

fn bits(v: &[(String, Vec<f32>)]) -> Vec<(String, Vec<u32>)> {
    v.iter().map(|(n, x)| (n.clone(), x.iter().map(|f| f.to_bits()).collect())).collect()
}

/// Trains under `c` with local tables (SGD rows) and returns the parameters and the store.
fn train_local(c: Config, extras: bool, one_execution: bool) -> (Vec<(String, Vec<f32>)>, Arc<LocalTables>) {
    let store = Arc::new(LocalTables::new(RowOptimizer::Sgd { lr: LR }));
    let s = strategy(c, Some(store.clone()));
    let model = build(&s, extras);
    assert!(model.primary().emb.table().is_none(), "no variable holds the table");
    assert!(model.variables(0).iter().all(|(n, _)| n != "emb"));
    steps(&s, &model, &batches(), one_execution);
    (trained(&model, Some(&store)), store)
}

fn train_dense(c: Config, extras: bool) -> Vec<(String, Vec<f32>)> {
    let s = strategy(c, None);
    let model = build(&s, extras);
    steps(&s, &model, &batches(), false);
    trained(&model, None)
}

local_tables_test!(sgd_rows_are_the_dense_tables_bits_and_one_devices_within_tolerance, |c: Config| {
    let (local, store) = train_local(c, false, false);
    let dense = train_dense(c, false);
    assert_eq!(bits(&local), bits(&dense), "the rows and the head, bit for bit, as the table held as a variable");
    // The store holds exactly the rows some batch touched; every other row has its initial
    // value (the dense table's untouched rows kept theirs).
    let want = touched(&batches());
    let held = store.rows("emb").unwrap();
    assert_eq!(held.len(), 1, "one shard");
    assert_eq!(held[0].ids.iter().copied().collect::<BTreeSet<u64>>(), want);
    let rows = &local.iter().find(|(n, _)| n == "emb").unwrap().1;
    for id in (0..ROWS).filter(|id| !want.contains(id)) {
        let mut init = [0f32; DIM];
        init_row(SEED, "emb", table().init, id, &mut init);
        assert_eq!(&rows[id as usize * DIM..(id as usize + 1) * DIM], init.as_slice(), "row {id}, untouched");
    }
    assert_eq!(store.version(), STEPS as u64, "one update a step");
    // Against one device on the global batch (a replica's mean over its rows times its share
    // rounds differently from the mean over all rows).
    if c != Config::OneDevice {
        let (one, _) = train_local(Config::OneDevice, false, false);
        let d = max_rel_diff(&one, &local);
        assert!(d <= 2e-6, "relative difference {d} from one device");
    }
});

local_tables_test!(a_frozen_and_an_unused_parameter_beside_the_table_match_one_device, |c: Config| {
    let (local, _) = train_local(c, true, false);
    assert_eq!(bits(&local), bits(&train_dense(c, true)), "as the table held as a variable");
    let (one, _) = train_local(Config::OneDevice, true, false);
    let d = max_rel_diff(&one, &local);
    assert!(d <= 2e-6, "relative difference {d} from one device");
    for name in ["frozen.weight", "frozen.bias", "unused.weight", "unused.bias"] {
        let s = strategy(c, Some(Arc::new(LocalTables::new(RowOptimizer::Sgd { lr: LR }))));
        let initial = common::params(&build(&s, true));
        let before = &initial.iter().find(|(n, _)| n == name).unwrap().1;
        let after = &local.iter().find(|(n, _)| n == name).unwrap().1;
        assert_eq!(before, after, "{name} does not train");
    }
});

/// The trainer hands a whole epoch to the replicas at once (`run_batches`): under a table
/// store every step is still stepped before the next looks its rows up.
#[test]
fn steps_of_one_execution_step_the_rows_one_by_one() {
    for c in [Config::OneDevice, Config::Mirrored(3)] {
        let (each, _) = train_local(c, false, false);
        let (together, store) = train_local(c, false, true);
        assert_eq!(bits(&each), bits(&together), "{c:?}");
        assert_eq!(store.version(), STEPS as u64);
    }
}

local_tables_test!(a_bad_id_is_refused_in_one_line_naming_the_table_and_nothing_is_applied, |c: Config| {
    let store = Arc::new(LocalTables::new(RowOptimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 1e-7 }));
    let s = strategy(c, Some(store.clone()));
    let model = build(&s, false);
    steps(&s, &model, &[batch(GLOBAL, 0, false)], false);
    let before = (trained(&model, Some(&store)), store.rows("emb").unwrap()[0].slots.clone(), store.version());
    let opt = model.optimizer::<SGD>(LR).unwrap();
    let db = DistributedBatch::split(&batch(GLOBAL, 1, true), s.num_replicas_in_sync()).unwrap();
    let e = s
        .run_batch(&db, |ctx, shard| {
            let (ids, y) = &shard.batch;
            let loss = model.on(ctx)?.loss(ids, y)?;
            ctx.backward_and_sync(&loss, &opt)
        })
        .unwrap_err()
        .to_string();
    // candle appends a backtrace under RUST_BACKTRACE: the message is the first line.
    let line = e.lines().next().unwrap();
    assert!(line.contains("id 40 is outside embedding table \"emb\"'s 40 rows"), "{e}");
    let slots_of = |ids: &[u64]| {
        let rows = store.rows("emb").unwrap().remove(0);
        let k = RowOptimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 1e-7 }.slots() * DIM;
        let mut out = Vec::new();
        for (i, id) in rows.ids.iter().enumerate() {
            if ids.contains(id) {
                out.extend_from_slice(&rows.slots[i * k..(i + 1) * k]);
            }
        }
        out
    };
    let first: Vec<u64> = touched(&[batch(GLOBAL, 0, false)]).into_iter().collect();
    assert_eq!(trained(&model, Some(&store)), before.0, "no row and no variable changed");
    assert_eq!(slots_of(&first), before.1, "no slot changed");
    assert_eq!(store.version(), before.2);
    // The store goes on as if the step had not been asked for.
    steps(&s, &model, &[batch(GLOBAL, 2, false)], false);
    assert_eq!(store.version(), before.2 + 1);
});

/// The looked-up rows' gradients of `loss = sum(rows(ids) * c)`: each id's sum of its
/// examples' `c`, in batch order from 0 (as the layer sums them).
fn row_grads(ids: &[u64], c: &[f32]) -> Vec<(u64, Vec<f32>)> {
    let distinct: BTreeSet<u64> = ids.iter().copied().collect();
    distinct
        .into_iter()
        .map(|id| {
            let mut g = vec![0f32; DIM];
            for (k, _) in ids.iter().enumerate().filter(|(_, &i)| i == id) {
                g.iter_mut().zip(&c[k * DIM..(k + 1) * DIM]).for_each(|(g, c)| *g += c);
            }
            (id, g)
        })
        .collect()
}

/// Adagrad, FTRL and LazyAdam: after three steps every touched row and its slots are the
/// row optimizer applied by hand to the row's gradients (update numbers 1, 2, 3); a row a
/// step did not touch keeps its value and its slots through that step (lazy semantics).
#[test]
fn row_optimizers_step_the_touched_rows_as_applied_by_hand() {
    let optimizers = [
        RowOptimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 1e-7 },
        RowOptimizer::Ftrl { lr: 0.1, lr_power: -0.5, initial_accumulator: 0.1, l1: 0.001, l2: 0.01, beta: 0.0 },
        RowOptimizer::LazyAdam { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-7 },
    ];
    let steps: [&[u64]; 3] = [&[1, 3, 1], &[3, 5], &[1, 1, 7]];
    let config = TableConfig { init: RowInit::Uniform { low: -1.0, high: 1.0 }, ..TableConfig::rows("emb", 8, DIM) };
    for opt in optimizers {
        let store = Arc::new(LocalTables::new(opt.clone()));
        let s = strategy(Config::OneDevice, Some(store.clone()));
        let model = s.scope(|sc| Embedding::new(sc, config.clone()).map_err(candle_core::Error::wrap)).unwrap();
        // By hand: each row's values and slots, from its initial value and initial slots.
        let mut want: std::collections::BTreeMap<u64, (Vec<f32>, Vec<f32>)> = Default::default();
        let mut slots_after_step_1 = None;
        for (k, ids) in steps.iter().enumerate() {
            let c: Vec<f32> = (0..ids.len() * DIM).map(|i| ((i * 7 + k * 3) % 11) as f32 * 0.25 - 1.25).collect();
            let ids_t = Tensor::new(&ids.iter().map(|&i| i as u32).collect::<Vec<_>>()[..], &Device::Cpu).unwrap();
            let c_t = Tensor::from_vec(c.clone(), (ids.len(), DIM), &Device::Cpu).unwrap();
            s.run(|ctx| {
                let loss = (model.on(ctx)?.forward(&ids_t)? * &c_t)?.sum_all()?;
                loss.backward()?;
                Ok(())
            })
            .unwrap();
            for (id, g) in row_grads(ids, &c) {
                let (w, slots) = want.entry(id).or_insert_with(|| {
                    let mut w = vec![0f32; DIM];
                    init_row(SEED, "emb", config.init, id, &mut w);
                    let mut slots = vec![0f32; opt.slots() * DIM];
                    opt.init_slots(&mut slots);
                    (w, slots)
                });
                opt.apply(w, &g, slots, k as u64 + 1);
            }
            if k == 1 {
                slots_after_step_1 = Some(store.rows("emb").unwrap().remove(0));
            }
        }
        let got = store.rows("emb").unwrap().remove(0);
        assert_eq!(got.ids, want.keys().copied().collect::<Vec<_>>(), "{opt}: the rows touched");
        let k = opt.slots() * DIM;
        for (i, (id, (w, slots))) in want.iter().enumerate() {
            assert_eq!(&got.values[i * DIM..(i + 1) * DIM], w.as_slice(), "{opt}: row {id}");
            assert_eq!(&got.slots[i * k..(i + 1) * k], slots.as_slice(), "{opt}: row {id}'s slots");
        }
        // Row 5 (touched in step 2 only) and row 3 (steps 1 and 2) kept everything in step 3.
        let mid = slots_after_step_1.unwrap();
        for id in [3u64, 5] {
            let (a, b) =
                (mid.ids.iter().position(|&i| i == id).unwrap(), got.ids.iter().position(|&i| i == id).unwrap());
            assert_eq!(mid.values[a * DIM..(a + 1) * DIM], got.values[b * DIM..(b + 1) * DIM], "{opt}: row {id}");
            assert_eq!(mid.slots[a * k..(a + 1) * k], got.slots[b * k..(b + 1) * k], "{opt}: row {id}'s slots");
        }
        // One closed form: Adagrad's first step of row 3 (one example, gradient c).
        if let RowOptimizer::Adagrad { lr, initial_accumulator, eps } = opt {
            let c0: Vec<f64> = (0..3 * DIM).map(|i| ((i * 7) % 11) as f64 * 0.25 - 1.25).collect();
            let mut w0 = [0f32; DIM];
            init_row(SEED, "emb", config.init, 3, &mut w0);
            // Row 3 is example 1 of the first step, its gradient c0[DIM..2 DIM]; the second
            // step moved it again, so the first step is checked on a fresh store.
            let fresh = Arc::new(LocalTables::new(opt.clone()));
            let s = strategy(Config::OneDevice, Some(fresh.clone()));
            let model = s.scope(|sc| Embedding::new(sc, config.clone()).map_err(candle_core::Error::wrap)).unwrap();
            let c_t = Tensor::from_vec(c0.iter().map(|&x| x as f32).collect(), (3, DIM), &Device::Cpu).unwrap();
            let ids_t = Tensor::new(&[1u32, 3, 1], &Device::Cpu).unwrap();
            s.run(|ctx| Ok((model.on(ctx)?.forward(&ids_t)? * &c_t)?.sum_all()?.backward().map(drop)?)).unwrap();
            let got = fresh.read("emb", &[3]).unwrap();
            for j in 0..DIM {
                let g = c0[DIM + j];
                let want = f64::from(w0[j]) - lr * g / ((initial_accumulator + g * g).sqrt() + eps);
                assert!((f64::from(got[j]) - want).abs() < 1e-6, "adagrad closed form: {} vs {want}", got[j]);
            }
        }
    }
}

/// A table declared by id space grows row by row as batches first touch ids, from the
/// initial values a fixed table of the same name starts at: under SGD it trains as the
/// fixed table held as a variable does.
#[test]
fn an_id_space_table_grows_as_one_device_trains_the_fixed_table() {
    let ids_table = TableConfig { size: TableSize::Ids { max_rows_per_shard: 64, evict_after: None }, ..table() };
    let store = Arc::new(LocalTables::new(RowOptimizer::Sgd { lr: LR }));
    let s = strategy(Config::Mirrored(2), Some(store.clone()));
    let model = s.scope(|sc| Model::build(sc, ids_table.clone(), false)).unwrap();
    steps(&s, &model, &batches(), false);
    let dense = train_dense(Config::Mirrored(2), false);
    assert_eq!(bits(&trained(&model, Some(&store))), bits(&dense));
    assert_eq!(store.status("emb").unwrap()[0].rows, touched(&batches()).len() as u64);
}

/// Runs one step of SGD on the table alone looking up `ids` (one device).
fn touch(s: &StrategyHandle, model: &Replicated<Embedding>, ids: &[u32]) -> strata_core::Result<()> {
    let ids = Tensor::new(ids, &Device::Cpu)?;
    s.run(|ctx| Ok(model.on(ctx)?.forward(&ids)?.sum_all()?.backward().map(drop)?)).map(drop)
}

/// An id-space table at its bound evicts the rows unseen for more than `evict_after`
/// updates, least recently seen first, as a ps task does; an evicted row reads its initial
/// value again. Without `evict_after` a table at its bound refuses new rows in one line,
/// nothing applied.
#[test]
fn an_id_space_table_evicts_at_its_bound_or_refuses_new_rows() {
    let bounded = |evict_after| TableConfig {
        size: TableSize::Ids { max_rows_per_shard: 6, evict_after },
        ..TableConfig::rows("ids", 1, DIM)
    };
    let store = Arc::new(LocalTables::new(RowOptimizer::Sgd { lr: LR }));
    let s = strategy(Config::OneDevice, Some(store.clone()));
    let model = s.scope(|sc| Embedding::new(sc, bounded(Some(1))).map_err(candle_core::Error::wrap)).unwrap();
    let init = |id| {
        let mut r = vec![0f32; DIM];
        init_row(SEED, "ids", RowInit::default(), id, &mut r);
        r
    };
    for ids in [&[100u32, 101, 102, 103][..], &[4, 5], &[4, 5]] {
        touch(&s, &model, ids).unwrap();
    }
    assert_ne!(store.read("ids", &[100]).unwrap(), init(100), "trained");
    // 6 rows held; 2 more need 2 evicted: 100 and 101, seen 2 updates ago, then by id.
    touch(&s, &model, &[6, 7]).unwrap();
    let st = store.status("ids").unwrap().remove(0);
    assert_eq!((st.rows, st.evicted), (6, 2));
    assert_eq!(store.read("ids", &[100]).unwrap(), init(100), "an evicted row reads its initial value");
    assert_ne!(store.read("ids", &[102]).unwrap(), init(102), "102 is held still");

    let store = Arc::new(LocalTables::new(RowOptimizer::Sgd { lr: LR }));
    let s = strategy(Config::OneDevice, Some(store.clone()));
    let model = s.scope(|sc| Embedding::new(sc, bounded(None)).map_err(candle_core::Error::wrap)).unwrap();
    touch(&s, &model, &[1, 2, 3, 4, 5]).unwrap();
    let e = touch(&s, &model, &[6, 7]).unwrap_err().to_string();
    let line = e.lines().next().unwrap();
    assert!(line.contains("embedding table \"ids\" would hold 7 rows, over its bound of 6 rows per shard"), "{e}");
    assert_eq!(store.version(), 1, "nothing applied");
    assert_eq!(store.status("ids").unwrap()[0].rows, 5);
}

/// Two shards per table, as a job of two ps tasks splits it: the same training.
#[test]
fn tables_in_several_shards_train_as_in_one() {
    let store = Arc::new(LocalTables::new(RowOptimizer::Sgd { lr: LR }).with_shards(3));
    let s = strategy(Config::Mirrored(2), Some(store.clone()));
    let model = build(&s, false);
    steps(&s, &model, &batches(), false);
    let (one_shard, _) = train_local(Config::Mirrored(2), false, false);
    assert_eq!(bits(&trained(&model, Some(&store))), bits(&one_shard));
    let held: u64 = store.status("emb").unwrap().iter().map(|s| s.rows).sum();
    assert_eq!(held, touched(&batches()).len() as u64);
    assert_eq!(store.rows("emb").unwrap().len(), 3);
}

/// A checkpoint of the strategy's (the trainer's `save_checkpoint`) holds the rows a store
/// created, with their slots and when they were last seen: a job resumed from it into a new
/// store (a new process's) steps on as the job that never stopped, bit for bit; a checkpoint
/// without rows is refused, nothing restored.
#[test]
fn a_checkpoint_holds_the_rows_and_a_resumed_job_steps_on_as_one_that_never_stopped() {
    use strata_core::elastic::{restore_latest, save_checkpoint, CheckpointConfig};
    // The dense layers' optimizer as a checkpoint holds it (SGD keeps no state; the steps
    // run candle-nn's, whose bits FusedSgd's are).
    use strata_core::optim::FusedSgd;
    let opt = RowOptimizer::LazyAdam { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-7 };
    let dir = tempfile::tempdir().unwrap();
    let ckpt = CheckpointConfig { dir: dir.path().to_path_buf(), every_steps: 1, keep: 2 };
    let all = batches();
    let start = |restore: bool| {
        let store = Arc::new(LocalTables::new(opt.clone()).with_shards(2));
        let s = strategy(Config::Mirrored(2), Some(store.clone()));
        let model = build(&s, false);
        let dense = model.optimizer::<FusedSgd>(LR).unwrap();
        if restore {
            let step = restore_latest(&**s.extended(), &model, &dense, &ckpt).unwrap();
            assert_eq!(step, Some(3));
        }
        (store, s, model)
    };
    let (store, s, model) = start(false);
    steps(&s, &model, &all[..3], false);
    let opt_state = model.optimizer::<FusedSgd>(LR).unwrap();
    save_checkpoint(&**s.extended(), &model, &opt_state, &ckpt, 3).unwrap();
    steps(&s, &model, &all[3..], false);
    let never_stopped = trained(&model, Some(&store));

    let (resumed_store, s2, model2) = start(true);
    assert_eq!(resumed_store.version(), 3);
    assert_eq!(resumed_store.rows("emb").unwrap(), {
        // The rows at step 3, as the first store held them then.
        let (again, s3, m3) = start(false);
        steps(&s3, &m3, &all[..3], false);
        again.rows("emb").unwrap()
    });
    steps(&s2, &model2, &all[3..], false);
    assert_eq!(bits(&trained(&model2, Some(&resumed_store))), bits(&never_stopped));

    // A checkpoint of the model with the table held as a variable has no rows.
    let plain = tempfile::tempdir().unwrap();
    let plain_ckpt = CheckpointConfig { dir: plain.path().to_path_buf(), every_steps: 1, keep: 1 };
    let d = strategy(Config::Mirrored(2), None);
    let dm = build(&d, false);
    save_checkpoint(&**d.extended(), &dm, &dm.optimizer::<FusedSgd>(LR).unwrap(), &plain_ckpt, 1).unwrap();
    let (fresh, s4, m4) = start(false);
    let e = restore_latest(&**s4.extended(), &m4, &m4.optimizer::<FusedSgd>(LR).unwrap(), &plain_ckpt).unwrap_err();
    assert!(e.to_string().contains("no \"version\" among the embedding rows the checkpoint holds"), "{e}");
    assert_eq!(fresh.version(), 0);
}

/// MultiWorkerMirrored (each worker would hold and step the whole table alone) is refused
/// in one line when the model is built.
#[test]
fn multi_worker_mirrored_is_refused_in_one_line() {
    use strata_strategies::cluster::{ClusterConfig, ClusterSpec, TaskId};
    let port = common::loopback_ports(1)[0];
    let spec = ClusterSpec::workers(vec![format!("127.0.0.1:{port}")]).unwrap();
    let token = strata_transport::ClusterToken::new("0123456789abcdef0123456789abcdef").unwrap();
    let mut o = strata_strategies::MultiWorkerOptions::new(token).unwrap();
    o.local_devices = strata_core::device::logical_cpus(1).unwrap();
    o.options.tables = Some(Arc::new(LocalTables::new(RowOptimizer::Sgd { lr: LR })));
    let s =
        strata_strategies::MultiWorkerMirroredStrategy::new(ClusterConfig::new(spec, TaskId::worker(0)).unwrap(), o)
            .unwrap();
    let e = s.scope(|sc| Model::build(sc, table(), false)).map(drop).unwrap_err().to_string();
    // candle appends a backtrace under RUST_BACKTRACE: the message is the first line.
    let line = e.lines().next().unwrap();
    assert!(
        line.starts_with("local tables (embedding rows in this process) cannot serve multi-worker-mirrored:"),
        "{e}"
    );
    assert!(line.ends_with("or train under one-device, mirrored or central-storage"), "{e}");
    let _ = s.finish();
    let e = LocalTables::check_strategy("parameter-server", false).unwrap_err().to_string();
    assert!(e.contains("put the tables on parameter servers"), "{e}");
    LocalTables::check_strategy("mirrored", false).unwrap();
}
