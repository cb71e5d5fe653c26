//! The CPU backend changes no result beyond floating-point reassociation: one training step
//! (forward, loss, backward) of each shipped model, from the same parameters and batch, gives
//! the loss and gradients recorded in `tests/data/backend_step.json` within 1e-4 relative.
//!
//! The record was made with the portable backend (`cargo test -p strata --no-default-features
//! --test backend`: gemm's AVX2 kernels, before candle's `rows_gemm` took the products of two
//! row-major operands from them); CI runs this test in the default build (gemm's AVX-512
//! kernels, where the CPU has them) and in the portable one, so the fast and the default
//! backends agree within 1e-4. The file's last tests check `rows_gemm` itself. `STRATA_BLESS_BACKEND=1` rewrites the record (only ever
//! from the portable build).
//!
//! The parameters are drawn from a seeded generator (not candle's, which is unseeded on the
//! CPU), so every build starts from the same values.

mod common;

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use strata::cnn::Cnn;
use strata::model::{Classifier, Mlp};
use strata::transformer::{CharTransformer, TransformerConfig};

use common::seeded;

/// Per model: the loss and, per variable, the gradient's norm and its dot product with a fixed
/// pattern of +-1 (so a gradient that changed direction is caught, not only its size).
type Record = BTreeMap<String, (f64, BTreeMap<String, (f64, f64, usize)>)>;

const RECORD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/backend_step.json");

fn summarise(vm: &VarMap, loss: &Tensor) -> (f64, BTreeMap<String, (f64, f64, usize)>) {
    let grads = loss.backward().unwrap();
    let data = vm.data().lock().unwrap();
    let mut out = BTreeMap::new();
    for (name, v) in data.iter() {
        let g = grads.get(v.as_tensor()).expect("every variable has a gradient");
        let g = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let norm = g.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt();
        let dot = g
            .iter()
            .enumerate()
            .map(|(i, &x)| if (i * 2_654_435_761) & 4 == 0 { f64::from(x) } else { -f64::from(x) })
            .sum();
        out.insert(name.clone(), (norm, dot, g.len()));
    }
    (f64::from(loss.to_scalar::<f32>().unwrap()), out)
}

fn step_of_each_model() -> Record {
    let dev = Device::Cpu;
    let mut record = Record::new();
    let all = strata::digits::load(None).unwrap();
    let batch = all.slice(0..256);
    let (x, y) = (batch.features_tensor(&dev).unwrap(), batch.labels_tensor(&dev).unwrap());

    let vm = VarMap::new();
    let mlp = Mlp::new(VarBuilder::from_varmap(&vm, DType::F32, &dev), 64, &[2048, 2048], 10).unwrap();
    seeded(&vm, 1);
    record.insert("mlp 64-2048-2048-10".into(), summarise(&vm, &mlp.loss(&x, &y).unwrap()));

    let vm = VarMap::new();
    let cnn = Cnn::new(VarBuilder::from_varmap(&vm, DType::F32, &dev)).unwrap();
    seeded(&vm, 2);
    record.insert("cnn".into(), summarise(&vm, &cnn.loss(&x, &y).unwrap()));

    let corpus = strata::shakespeare::load().unwrap();
    let config = TransformerConfig { vocab: corpus.vocab_size(), ..Default::default() };
    let vm = VarMap::new();
    let t = CharTransformer::new(config, VarBuilder::from_varmap(&vm, DType::F32, &dev)).unwrap();
    seeded(&vm, 3);
    let (ids, targets) = corpus.random_windows(32, config.context, 4).unwrap();
    record.insert("transformer".into(), summarise(&vm, &t.loss(&ids, &targets).unwrap()));
    record
}

#[test]
fn a_training_step_of_each_model_matches_the_portable_backend_within_1e_4() {
    eprintln!("backend: {}", strata::cpu_backend());
    let now = step_of_each_model();
    if std::env::var_os("STRATA_BLESS_BACKEND").is_some() {
        std::fs::create_dir_all(std::path::Path::new(RECORD).parent().unwrap()).unwrap();
        std::fs::write(RECORD, serde_json::to_string_pretty(&now).unwrap()).unwrap();
        return;
    }
    let recorded: Record = serde_json::from_str(&std::fs::read_to_string(RECORD).unwrap()).unwrap();
    assert_eq!(now.keys().collect::<Vec<_>>(), recorded.keys().collect::<Vec<_>>());
    let mut worst = 0f64;
    for (model, (loss, vars)) in &now {
        let (loss0, vars0) = &recorded[model];
        let rel = (loss - loss0).abs() / loss0.abs();
        assert!(rel < 1e-4, "{model}: loss {loss} against {loss0} recorded");
        worst = worst.max(rel);
        assert_eq!(vars.keys().collect::<Vec<_>>(), vars0.keys().collect::<Vec<_>>(), "{model}'s variables");
        for (name, &(norm, dot, count)) in vars {
            let (norm0, dot0, count0) = vars0[name];
            assert_eq!(count, count0, "{model} {name}: the size changed");
            assert!(norm0 > 0.0, "{model} {name}: a zero gradient recorded");
            let rel_norm = (norm - norm0).abs() / norm0;
            // A change of the gradient by d moves the dot product by at most |d| sqrt(count).
            let rel_dot = (dot - dot0).abs() / (norm0 * (count as f64).sqrt());
            assert!(rel_norm < 1e-4, "{model} {name}: gradient norm {norm} against {norm0} recorded");
            assert!(rel_dot < 1e-4, "{model} {name}: gradient direction moved ({dot} against {dot0})");
            worst = worst.max(rel_norm).max(rel_dot);
        }
    }
    eprintln!("largest relative difference from the portable backend: {worst:.2e}");
}

/// Values in [-1, 1) from a seeded generator, with a few exact zeros and small magnitudes.
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
    (0..len)
        .map(|i| {
            s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            let x = ((s >> 40) as f32) / (1u64 << 24) as f32 * 2.0 - 1.0;
            if i % 97 == 0 {
                0.0
            } else if i % 89 == 0 {
                x * 1e-20
            } else {
                x
            }
        })
        .collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// candle's `rows_gemm` (the CPU backend's f32 kernel for two row-major operands on AVX2 hosts)
/// gives its scalar reference's bits on every shape: tails of rows (m not a multiple of 6) and
/// of columns (n not a multiple of 16), inner dimensions around its block of 256, rows further
/// apart than their length, and 1, 2 or 3 threads. Wherever the CPU has AVX2 and FMA, whichever
/// the build (in the default build on an AVX-512 CPU the backend does not choose it, but it
/// runs the same).
#[test]
fn rows_gemm_gives_its_scalar_reference_s_bits_on_every_shape() {
    use candle_core::cpu_backend::rows_gemm;
    if !rows_gemm::available() {
        eprintln!("skipped: this CPU has no AVX2 and FMA");
        return;
    }
    let shapes = [
        (1, 1, 1),
        (2, 16, 256),
        (5, 17, 257),
        (6, 512, 512),
        (7, 33, 255),
        (13, 520, 600),
        (128, 64, 1030),
        (131, 531, 513),
        (12, 2048, 300),
        // More columns than a thread keeps packed between calls (alone: its buffer freed after).
        (3, 8200, 300),
    ];
    for (i, &(m, n, k)) in shapes.iter().enumerate() {
        for (pad_a, pad_b) in [(0, 0), (3, 5)] {
            let (lda, ldb) = (k + pad_a, n + pad_b);
            let a = values(m * lda, 2 * i as u64);
            let b = values(k * ldb, 2 * i as u64 + 1);
            let want = rows_gemm::reference(m, n, k, &a, lda, &b, ldb);
            for threads in 1..=3 {
                let got = rows_gemm::product((m, n, k), (&a, lda), (&b, ldb), threads);
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{m}x{k} by {k}x{n}, rows {lda} and {ldb} apart, {threads} thread(s)"
                );
            }
        }
    }
}

/// The property the strategies' bit-for-bit tests rest on: a row of a product has the same bits
/// whatever the other rows, so a replica's half of a batch gives the rows of the whole batch's
/// product. Through `Tensor::matmul` (rows_gemm where the backend chooses it, gemm elsewhere),
/// for the 4.3M MLP's hidden product and a shape with tails.
#[test]
fn a_product_s_rows_have_the_same_bits_in_half_of_the_batch() {
    use candle_core::cpu_backend::rows_gemm;
    for (i, &(m, n, k)) in [(256, 2048, 2048), (262, 530, 700)].iter().enumerate() {
        let a = Tensor::from_vec(values(m * k, 10 + i as u64), (m, k), &Device::Cpu).unwrap();
        let b = Tensor::from_vec(values(k * n, 20 + i as u64), (k, n), &Device::Cpu).unwrap();
        let whole = a.matmul(&b).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mut halves = Vec::new();
        for h in [a.narrow(0, 0, m / 2).unwrap(), a.narrow(0, m / 2, m - m / 2).unwrap()] {
            halves.extend(h.matmul(&b).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap());
        }
        assert_eq!(bits(&halves), bits(&whole), "{m}x{k} by {k}x{n}");
        if rows_gemm::applies(m, n, k, 1, 1) {
            let (a, b) = (
                a.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                b.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            assert_eq!(
                bits(&whole),
                bits(&rows_gemm::reference(m, n, k, &a, k, &b, n)),
                "{m}x{k} by {k}x{n}: the backend's product"
            );
            eprintln!("{m}x{k} by {k}x{n}: the backend chose rows_gemm");
        } else {
            eprintln!(
                "{m}x{k} by {k}x{n}: the backend chose gemm (rows_gemm does not apply in this build on this CPU)"
            );
        }
    }
}

/// A weight's gradient (`x^T dy`, the inner dimension the batch): the backend computes a long
/// product of a short inner dimension in calls of a few hundred rows on AVX2 hosts (candle's
/// `gemm_rows`), and every row has the bits it has when computed alone, in a product of 128
/// rows. The 4.3M MLP's hidden weight (2048 x 128 by 128 x 2048, four calls of 512 rows), and
/// a shape whose last call is short (1500 rows of an inner dimension of 100: 640, 640, 220).
///
/// candle splits products into calls of rows on one thread only, and reads its thread count
/// from `RAYON_NUM_THREADS` at each product: the test runs the check here (as many threads as
/// cores) and in a child process of this test binary with `RAYON_NUM_THREADS=1` (killed after
/// 300 s).
#[test]
fn a_weight_gradient_s_rows_have_the_bits_of_rows_computed_alone() {
    const CHILD: &str = "STRATA_TEST_ONE_THREAD";
    if std::env::var_os(CHILD).is_none() {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "a_weight_gradient_s_rows_have_the_bits_of_rows_computed_alone", "--nocapture"])
            .env(CHILD, "1")
            .env("RAYON_NUM_THREADS", "1")
            .env("CANDLE_NUM_THREADS", "1")
            .spawn()
            .unwrap();
        let start = std::time::Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if start.elapsed() > std::time::Duration::from_secs(300) {
                child.kill().unwrap();
                panic!("the one-thread child ran past 300 s");
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        assert!(status.success(), "the one-thread child failed: {status}");
    }
    for (i, &(m, n, k)) in [(2048, 2048, 128), (1500, 300, 100), (700, 2048, 64)].iter().enumerate() {
        // The forward's input (batch x features) and the output's gradient (batch x outputs).
        let x = Tensor::from_vec(values(k * m, 30 + i as u64), (k, m), &Device::Cpu).unwrap();
        let dy = Tensor::from_vec(values(k * n, 40 + i as u64), (k, n), &Device::Cpu).unwrap();
        let whole = x.t().unwrap().matmul(&dy).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mut alone = Vec::new();
        for i0 in (0..m).step_by(128) {
            let rows = x.narrow(1, i0, 128.min(m - i0)).unwrap().t().unwrap();
            alone.extend(rows.matmul(&dy).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap());
        }
        assert_eq!(bits(&whole), bits(&alone), "{m}x{k} by {k}x{n}");
        // No rows: an empty product, as before.
        let none = x.narrow(1, 0, 0).unwrap().t().unwrap().matmul(&dy).unwrap();
        assert_eq!(none.dims(), &[0, n]);
        // Against f64 sums: the product is right, not only consistent.
        let (xs, ds) = (x.to_vec2::<f32>().unwrap(), dy.to_vec2::<f32>().unwrap());
        for (r, c) in [(0, 0), (m - 1, n - 1), (m / 2 + 3, n / 3)] {
            let want: f64 = (0..k).map(|p| f64::from(xs[p][r]) * f64::from(ds[p][c])).sum();
            let got = f64::from(whole[r * n + c]);
            assert!(
                (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                "{m}x{k} by {k}x{n} at ({r}, {c}): {got} against {want}"
            );
        }
    }
}

/// Mirrored(2) and CentralStorage(2) end where one device ends (relative 1e-5, SGD, five steps
/// of 64 rows) on an MLP whose hidden products are `rows_gemm`'s in the portable build (k and n
/// of 512): each replica's forward of its 32 rows against one device's of 64.
#[test]
fn an_mlp_of_512_wide_layers_ends_under_mirrored_as_on_one_device() {
    use strata::optim::FusedSgd;
    use strata::prelude::*;
    use strata::trainer::{Task, TrainConfig, Trainer};
    let all = strata::digits::load(None).unwrap();
    let (train, test) = strata::digits::train_test_split(&all, 0.2, 0);
    let (train, test) = (train.slice(0..320), test.slice(0..64));
    let mut want: Option<Vec<Vec<f32>>> = None;
    for s in [
        OneDeviceStrategy::cpu().unwrap().handle(),
        MirroredStrategy::logical_cpus(2).unwrap().handle(),
        CentralStorageStrategy::logical_cpus(2).unwrap().handle(),
    ] {
        let model = s.scope(|sc| Mlp::new(sc.var_builder(), 64, &[512, 512], 10)).unwrap();
        let trainer = Trainer::new(TrainConfig { epochs: 1, global_batch: 64, seed: 5, ..Default::default() });
        let opt = trainer.optimizer::<_, FusedSgd>(&model, 0.05).unwrap();
        let report = trainer.fit(&s, &model, &opt, &Task::classifier(), &train, &test).unwrap();
        assert_eq!(report.steps, 5);
        let got: Vec<Vec<f32>> = model
            .values()
            .unwrap()
            .into_iter()
            .map(|(_, t)| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .collect();
        match &want {
            None => want = Some(got),
            Some(w) => {
                for (a, b) in w.iter().zip(&got) {
                    let scale = a.iter().map(|x| x.abs()).fold(0f32, f32::max).max(1e-6);
                    let d = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max) / scale;
                    assert!(d <= 1e-5, "{}: relative difference {d} from one device", s.extended().name());
                }
            }
        }
    }
}
