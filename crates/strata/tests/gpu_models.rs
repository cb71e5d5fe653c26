//! On a GPU (feature `candle-cuda`): one training step (forward, loss, backward) of each shipped
//! model computed on the GPU, where candle's CUDA kernels and the fallbacks of
//! `strata::fused` run, gives the CPU's loss and gradients, where the fused CPU kernels run,
//! within 1e-3 relative (summation order and the CPU's rational tanh in GELU differ). This is
//! the CPU reference of the fused operations' GPU path: the CNN's convolution and corrected
//! pooling gradient, the transformer's GELU, causal softmax and layer norm. Skipped without a
//! GPU (`require_gpus`), failing instead with `STRATA_REQUIRE_GPU=1`.

#![cfg(feature = "candle-cuda")]

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use rand::{Rng, SeedableRng};
use strata::cnn::Cnn;
use strata::model::{Classifier, Mlp};
use strata::transformer::{CharTransformer, TransformerConfig};
use strata_cuda::testing::require_gpus;

use crate::common::seeded;

/// The loss and every variable's gradient, on the CPU, by name.
fn step(vm: &VarMap, loss: &Tensor) -> (f32, Vec<(String, Vec<f32>)>) {
    let grads = loss.backward().unwrap();
    let data = vm.data().lock().unwrap();
    let mut out: Vec<(String, Vec<f32>)> = data
        .iter()
        .map(|(name, v)| {
            let g = grads.get(v.as_tensor()).unwrap_or_else(|| panic!("{name} has no gradient"));
            (name.clone(), g.to_device(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1().unwrap())
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    (loss.to_device(&Device::Cpu).unwrap().to_scalar().unwrap(), out)
}

fn each_model(dev: &Device) -> Vec<(&'static str, (f32, Vec<(String, Vec<f32>)>))> {
    let all = strata::digits::load(None).unwrap();
    let batch = all.slice(0..256);
    let (x, y) = (batch.features_tensor(dev).unwrap(), batch.labels_tensor(dev).unwrap());
    let mut out = Vec::new();

    let vm = VarMap::new();
    let mlp = Mlp::new(VarBuilder::from_varmap(&vm, DType::F32, dev), 64, &[256, 256], 10).unwrap();
    seeded(&vm, 1);
    out.push(("mlp", step(&vm, &mlp.loss(&x, &y).unwrap())));

    let vm = VarMap::new();
    let cnn = Cnn::new(VarBuilder::from_varmap(&vm, DType::F32, dev)).unwrap();
    seeded(&vm, 2);
    out.push(("cnn", step(&vm, &cnn.loss(&x, &y).unwrap())));

    let corpus = strata::shakespeare::load().unwrap();
    let config = TransformerConfig { vocab: corpus.vocab_size(), ..Default::default() };
    let vm = VarMap::new();
    let t = CharTransformer::new(config, VarBuilder::from_varmap(&vm, DType::F32, dev)).unwrap();
    seeded(&vm, 3);
    let (ids, targets) = corpus.random_windows(32, config.context, 4).unwrap();
    let (ids, targets) = (ids.to_device(dev).unwrap(), targets.to_device(dev).unwrap());
    out.push(("transformer", step(&vm, &t.loss(&ids, &targets).unwrap())));
    out
}

#[test]
fn a_training_step_on_a_gpu_gives_the_cpus_loss_and_gradients() {
    if !require_gpus(1) {
        return;
    }
    let gpu = Device::new_cuda(0).unwrap();
    let (want, got) = (each_model(&Device::Cpu), each_model(&gpu));
    let mut worst = 0f32;
    let mut wrong = Vec::new();
    for ((model, (loss0, grads0)), (_, (loss, grads))) in want.iter().zip(&got) {
        let rel = (loss - loss0).abs() / loss0.abs();
        if rel >= 1e-3 {
            wrong.push(format!("{model}: loss {loss} on the GPU, {loss0} on the CPU"));
        }
        worst = worst.max(rel);
        for ((name, g0), (name1, g)) in grads0.iter().zip(grads) {
            assert_eq!(name, name1);
            let scale = g0.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(scale > 0.0, "{model} {name}: a zero gradient on the CPU");
            let diff = g0.iter().zip(g).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            if diff / scale >= 1e-3 {
                wrong.push(format!("{model} {name}: gradients differ by {diff} (largest {scale})"));
            }
            worst = worst.max(diff / scale);
        }
    }
    eprintln!("largest relative difference between the GPU's step and the CPU's: {worst:.2e}");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// A fixed pseudo-random tensor on `dev` (the same values on every device).
fn random(shape: &[usize], seed: u64, dev: &Device) -> Tensor {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let v: Vec<f32> = (0..shape.iter().product()).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap().to_device(dev).unwrap()
}

/// `f`'s value and its gradients with respect to its inputs under a loss that weighs every output
/// differently, all on the CPU.
fn value_and_grads(dev: &Device, shapes: &[&[usize]], f: &dyn Fn(&[Tensor]) -> Tensor) -> Vec<Vec<f32>> {
    let vars: Vec<candle_core::Var> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| candle_core::Var::from_tensor(&random(s, 40 + i as u64, dev)).unwrap())
        .collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts);
    let w = random(y.dims(), 99, dev);
    let grads = (&y * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut out = vec![cpu(&y)];
    out.extend(vars.iter().map(|v| grads.get(v.as_tensor()).map(cpu).unwrap_or_default()));
    out
}

/// Each operation the CNN and the transformer use, on the GPU against the CPU, value and every
/// input's gradient: which one disagrees, if the step above does.
#[test]
fn each_operation_on_a_gpu_gives_the_cpus_value_and_gradients() {
    if !require_gpus(1) {
        return;
    }
    let gpu = Device::new_cuda(0).unwrap();
    let same = candle_nn::Conv2dConfig { padding: 1, ..Default::default() };
    type Op = Box<dyn Fn(&[Tensor]) -> Tensor>;
    let ops: Vec<(&str, Vec<&[usize]>, Op)> = vec![
        ("candle conv2d", vec![&[4, 3, 8, 8], &[5, 3, 3, 3]], Box::new(|t| t[0].conv2d(&t[1], 1, 1, 1, 1).unwrap())),
        (
            "candle conv2d + bias",
            vec![&[4, 3, 8, 8], &[5, 3, 3, 3], &[5]],
            Box::new(|t| {
                t[0].conv2d(&t[1], 1, 1, 1, 1).unwrap().broadcast_add(&t[2].reshape((1, 5, 1, 1)).unwrap()).unwrap()
            }),
        ),
        ("candle relu", vec![&[4, 3, 8, 8]], Box::new(|t| t[0].relu().unwrap())),
        ("candle max_pool2d", vec![&[4, 3, 8, 8]], Box::new(|t| t[0].max_pool2d(2).unwrap())),
        (
            "strata conv2d",
            vec![&[4, 3, 8, 8], &[5, 3, 3, 3], &[5]],
            Box::new(move |t| strata::fused::conv2d(&t[0], &t[1], Some(&t[2]), &same).unwrap()),
        ),
        ("strata max_pool2d", vec![&[4, 3, 8, 8]], Box::new(|t| strata::fused::max_pool2d(&t[0], 2).unwrap())),
        (
            "strata relu_max_pool2d",
            vec![&[4, 3, 8, 8]],
            Box::new(|t| strata::fused::relu_max_pool2d(&t[0], 2).unwrap()),
        ),
        ("strata gelu", vec![&[4, 64]], Box::new(|t| strata::fused::gelu(&t[0]).unwrap())),
        ("strata causal_softmax", vec![&[2, 3, 8, 8]], Box::new(|t| strata::fused::causal_softmax(&t[0]).unwrap())),
        (
            "strata layer_norm",
            vec![&[6, 16], &[16], &[16]],
            Box::new(|t| strata::fused::layer_norm(&t[0], &(&t[1] + 1.0).unwrap(), &t[2], 1e-5).unwrap()),
        ),
    ];
    let mut wrong = Vec::new();
    for (name, shapes, f) in &ops {
        let (want, got) = (value_and_grads(&Device::Cpu, shapes, f), value_and_grads(&gpu, shapes, f));
        for (i, (a, b)) in want.iter().zip(&got).enumerate() {
            let what = if i == 0 { "value".to_string() } else { format!("gradient {}", i - 1) };
            let scale = a.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
            let diff = if a.len() == b.len() {
                a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
            } else {
                f32::INFINITY
            };
            eprintln!("{name}, {what}: largest difference {diff:.3e} (largest value {scale:.3e})");
            if diff / scale >= 1e-4 {
                wrong.push(format!("{name}, {what}: the GPU differs from the CPU by {diff} (largest {scale})"));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
