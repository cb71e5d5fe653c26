//! The CPU backend changes no result beyond floating-point reassociation: one training step
//! (forward, loss, backward) of each shipped model, from the same parameters and batch, gives
//! the loss and gradients recorded in `tests/data/backend_step.json` within 1e-4 relative.
//!
//! The record was made with the portable backend (`cargo test -p strata --no-default-features
//! --test backend`: gemm's AVX2 kernels); CI runs this test in the default build (gemm's
//! AVX-512 kernels, where the CPU has them) and in the portable one, so the fast and the
//! default backends agree within 1e-4. `STRATA_BLESS_BACKEND=1` rewrites the record (only ever
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
