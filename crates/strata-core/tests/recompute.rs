//! `strata_core::recompute`: the gradients of a model whose blocks are recomputed are those of
//! the same model keeping every activation, bit for bit (inputs, variables used in several
//! blocks, variables no block uses, frozen tensors, integer inputs); the block's inner
//! activations are not kept (counted through the graph the backward pass walks); a block that
//! is not a function of its inputs and variables is an error of the backward pass, not wrong
//! gradients.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use strata_core::recompute;

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
}

/// A residual block: `x + tanh(x W1 + b) W2 * scale`, `scale` a frozen tensor (not a variable).
#[derive(Clone)]
struct Block {
    w1: Tensor,
    b: Tensor,
    w2: Tensor,
    scale: Tensor,
}

impl Block {
    fn new(width: usize, dev: &Device) -> (Self, Vec<Var>) {
        let w1 = Var::randn(0f32, 0.3, (width, 2 * width), dev).unwrap();
        let b = Var::randn(0f32, 0.1, 2 * width, dev).unwrap();
        let w2 = Var::randn(0f32, 0.3, (2 * width, width), dev).unwrap();
        let scale = Tensor::new(0.5f32, dev).unwrap();
        let block = Self { w1: w1.as_tensor().clone(), b: b.as_tensor().clone(), w2: w2.as_tensor().clone(), scale };
        (block, vec![w1, b, w2])
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = x.matmul(&self.w1)?.broadcast_add(&self.b)?.tanh()?;
        x + h.matmul(&self.w2)?.broadcast_mul(&self.scale)?
    }
}

struct Model {
    embed: Var,
    blocks: Vec<Block>,
    shared: Var,
    unused: Var,
    vars: Vec<Var>,
}

impl Model {
    fn new(dev: &Device) -> Self {
        let embed = Var::randn(0f32, 1.0, (10, 8), dev).unwrap();
        let mut vars = vec![embed.clone()];
        let blocks = (0..3)
            .map(|_| {
                let (b, v) = Block::new(8, dev);
                vars.extend(v);
                b
            })
            .collect();
        let shared = Var::randn(0f32, 1.0, (8, 4), dev).unwrap();
        let unused = Var::zeros(3, DType::F32, dev).unwrap();
        vars.push(shared.clone());
        Self { embed, blocks, shared, unused, vars }
    }

    /// Every block recomputed (when `recompute`), the last one also reading `shared` inside,
    /// which the head reads again outside.
    fn loss(&self, ids: &Tensor, recomputed: bool) -> Tensor {
        let mut x = self.embed.as_tensor().index_select(ids, 0).unwrap();
        for (i, b) in self.blocks.iter().enumerate() {
            let b = b.clone();
            let shared = self.shared.as_tensor().clone();
            let last = i == 2;
            let f = move |xs: &[Tensor]| {
                let y = b.forward(&xs[0])?;
                if last {
                    y.broadcast_add(&shared.sum(1)?.unsqueeze(0)?)
                } else {
                    Ok(y)
                }
            };
            x = if recomputed { recompute(&[x], f).unwrap() } else { f(&[x]).unwrap() };
        }
        x.matmul(self.shared.as_tensor()).unwrap().sqr().unwrap().mean_all().unwrap()
    }
}

#[test]
fn recomputed_blocks_give_the_gradients_of_kept_ones_bit_for_bit() {
    let dev = Device::Cpu;
    let m = Model::new(&dev);
    let ids = Tensor::new(&[1u32, 4, 4, 9, 0, 2], &dev).unwrap();
    let kept = m.loss(&ids, false);
    let again = m.loss(&ids, true);
    assert_eq!(bits(&kept), bits(&again), "the same loss");
    let (gk, gr) = (kept.backward().unwrap(), again.backward().unwrap());
    for (i, v) in m.vars.iter().enumerate() {
        let (a, b) = (gk.get(v).expect("a gradient"), gr.get(v).expect("a gradient when recomputed"));
        assert_eq!(bits(a), bits(b), "variable {i}");
    }
    assert!(gr.get(&m.unused).is_none(), "a variable no block uses gets no gradient");
}

#[test]
fn a_recomputed_block_keeps_only_its_input() {
    let dev = Device::Cpu;
    let m = Model::new(&dev);
    let ids = Tensor::new(&[1u32, 2, 3], &dev).unwrap();
    // The graph the backward pass walks: with every block recomputed it holds, besides the
    // variables, the embedding's lookup and one node per block, then the head.
    let nodes = |recomputed: bool| {
        let loss = m.loss(&ids, recomputed);
        loss.sorted_nodes().iter().filter(|n| !n.is_variable()).count()
    };
    let (kept, recomputed) = (nodes(false), nodes(true));
    // Kept: every product, sum and activation of the three blocks besides the lookup and the
    // head's nodes. Recomputed: the lookup, one node per block, and the head's five.
    assert_eq!((kept, recomputed), (32, 9), "nodes keeping every activation, and recomputing");
}

#[test]
fn a_recomputed_blocks_gradients_hold_none_of_its_activations() {
    // A weight's gradient is `x^T g`, a tensor whose graph reaches the activation `x`: handed
    // over with that graph, the gradients of the variables inside recomputed blocks would keep
    // every recomputed activation alive until the outer pass ends (measured: a 25M-parameter
    // transformer's backward peak 1.3 GB either way). They come detached.
    let dev = Device::Cpu;
    let m = Model::new(&dev);
    let ids = Tensor::new(&[1u32, 2, 3], &dev).unwrap();
    let block_vars = &m.vars[1..10];
    let tracking = |recomputed: bool| {
        let grads = m.loss(&ids, recomputed).backward().unwrap();
        block_vars.iter().filter(|v| grads.get(v).unwrap().track_op()).count()
    };
    // Kept, the gradients of the blocks' matrices (two per block) still hold the forward graph;
    // recomputed, none does.
    assert_eq!((tracking(false), tracking(true)), (6, 0));
}

#[test]
fn inputs_without_gradients_and_several_inputs() {
    let dev = Device::Cpu;
    let w = Var::randn(0f32, 1.0, (4, 4), &dev).unwrap();
    let x = Var::randn(0f32, 1.0, (2, 4), &dev).unwrap();
    let plain = Tensor::randn(0f32, 1.0, (2, 4), &dev).unwrap();
    let ids = Tensor::new(&[1u32, 0], &dev).unwrap();
    let f = {
        let w = w.as_tensor().clone();
        move |xs: &[Tensor]| (xs[0].matmul(&w)? * &xs[1])?.index_select(&xs[2], 0)?.tanh()
    };
    let inputs = [x.as_tensor().clone(), plain.clone(), ids.clone()];
    let want = f(&inputs).unwrap().sum_all().unwrap().backward().unwrap();
    let got = recompute(&inputs, f).unwrap().sum_all().unwrap().backward().unwrap();
    for v in [&w, &x] {
        assert_eq!(bits(want.get(v).unwrap()), bits(got.get(v).unwrap()));
    }
    assert!(got.get(&plain).is_none());
    // Nothing to differentiate: the block's value, no node.
    let y = recompute(std::slice::from_ref(&plain), |xs: &[Tensor]| xs[0].exp()).unwrap();
    assert!(!y.track_op());
    assert_eq!(bits(&y), bits(&plain.exp().unwrap()));
}

#[test]
fn a_block_that_differs_when_recomputed_is_an_error_not_wrong_gradients() {
    let dev = Device::Cpu;
    let w = Var::randn(0f32, 1.0, (4, 4), &dev).unwrap();
    let x = Tensor::randn(0f32, 1.0, (2, 4), &dev).unwrap();
    // A block drawing its own noise: a different value each call.
    let calls = Arc::new(AtomicU32::new(0));
    let f = {
        let (w, calls) = (w.as_tensor().clone(), calls.clone());
        move |xs: &[Tensor]| {
            let n = calls.fetch_add(1, Ordering::SeqCst) as f64;
            xs[0].matmul(&w)?.affine(1.0, n)
        }
    };
    let e = recompute(&[x], f).unwrap().sum_all().unwrap().backward().unwrap_err().to_string();
    assert!(e.contains("a recomputed block gave 8 of 8 values other than its forward pass did"), "{e}");
    assert_eq!(calls.load(Ordering::SeqCst), 2, "one forward, one recomputation");
    // A NaN where the first pass had one is the same value.
    let nan = Tensor::new(&[[f32::NAN, 1.0, 2.0, 3.0]], &dev).unwrap();
    let g = {
        let w = w.as_tensor().clone();
        move |xs: &[Tensor]| xs[0].broadcast_add(&w.sum(0)?)
    };
    recompute(&[nan], g).unwrap().sum_all().unwrap().backward().unwrap();
}
