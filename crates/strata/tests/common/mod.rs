//! What the model-step tests share.

use candle_core::{Device, Tensor};
use candle_nn::VarMap;
use rand::{Rng, SeedableRng};

/// Sets every variable of `vm` from a generator seeded by `seed`, in name order: uniform in
/// +-1/sqrt(fan-in), and 1 for the 1-D `weight`s of layer norms. The values are drawn on the CPU
/// (candle's own generator is unseeded there) and copied to each variable's device, so every
/// build and device starts from the same parameters.
pub fn seeded(vm: &VarMap, seed: u64) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let data = vm.data().lock().unwrap();
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for name in names {
        let v = &data[name];
        let dims = v.dims().to_vec();
        let fan_in = if dims.len() >= 2 { dims[1..].iter().product::<usize>().max(dims[0].min(dims[1])) } else { 1 };
        let bound = if name.ends_with("weight") && dims.len() == 1 { 0.0 } else { 1.0 / (fan_in as f32).sqrt() };
        let base = if name.ends_with("weight") && dims.len() == 1 { 1.0 } else { 0.0 };
        let values: Vec<f32> = (0..v.elem_count()).map(|_| base + bound * rng.random_range(-1.0f32..1.0)).collect();
        let t = Tensor::from_vec(values, dims, &Device::Cpu).unwrap().to_device(v.device()).unwrap();
        v.set(&t).unwrap();
    }
}
