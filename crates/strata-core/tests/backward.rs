//! The backward pass Strata builds on: candle-core with Strata's patch (vendor/README.md),
//! which stores a node's first gradient as it is instead of adding it to a fresh zero tensor,
//! and leaves matmul outputs unzeroed. These pin what that must not change: gradients equal
//! closed forms (also through transposed matmul operands, whose gradients the patch computes
//! transposed), every variable's gradient is contiguous, variables' gradients never share an
//! allocation with each other or with the variable (strategies reduce them in place), and a
//! matmul over an empty inner dimension is still zero, and sums over leading dimensions (the
//! patch adds whole rows there) keep their values, and products with a transposed rhs (which the
//! patch may compute column-major) equal a loop. The patch's one seam, `backward_with_hook`,
//! hands each variable's gradient over once, when it is final, in the order gradients become
//! ready, in an allocation of its own; with a `GradHook` that asks, a `Linear` weight's
//! gradient first comes in blocks of rows, bit for bit the whole's.

use candle_core::{DType, Device, Tensor, Var, D};

fn storage_addr(t: &Tensor) -> usize {
    let (s, _) = t.storage_and_layout();
    std::ptr::from_ref(&*s).addr()
}

fn v2(t: &Tensor) -> Vec<Vec<f32>> {
    t.to_vec2::<f32>().unwrap()
}

fn close(a: f32, b: f32) -> bool {
    (a - b).abs() <= 1e-5 * (1.0 + b.abs())
}

/// `loss = sum(relu(x W^T + b1 - b2)^2) - sum(a)`, with `x` a constant: every operation's
/// gradient against the closed form, computed here with loops.
#[test]
fn gradients_equal_closed_forms() {
    let dev = Device::Cpu;
    let xs = [[0.5f32, -1.0, 2.0], [1.5, 0.25, -0.75]];
    let ws = [[0.1f32, 0.2, -0.3], [-0.4, 0.5, 0.6], [0.7, -0.8, 0.9], [0.05, 0.15, -0.25]];
    let b1s = [0.1f32, -0.2, 0.3, 0.0];
    let b2s = [0.05f32, 0.05, -0.1, 0.2];
    let x = Tensor::new(&xs, &dev).unwrap();
    let w = Var::new(&ws, &dev).unwrap();
    let b1 = Var::new(&b1s, &dev).unwrap();
    let b2 = Var::new(&b2s, &dev).unwrap();
    let a = Var::new(&[1.0f32, 2.0], &dev).unwrap();
    let z = x.matmul(&w.t().unwrap()).unwrap().broadcast_add(&(b1.as_tensor() - b2.as_tensor()).unwrap()).unwrap();
    let loss = (z.relu().unwrap().sqr().unwrap().sum_all().unwrap() - a.sum_all().unwrap()).unwrap();
    let grads = loss.backward().unwrap();

    // dL/dz = 2 relu(z); dW = dz^T x; db1 = sum_rows dz; db2 = -db1; da = -1.
    let mut dz = [[0f32; 4]; 2];
    for r in 0..2 {
        for o in 0..4 {
            let zv: f32 = (0..3).map(|i| xs[r][i] * ws[o][i]).sum::<f32>() + b1s[o] - b2s[o];
            dz[r][o] = 2.0 * zv.max(0.0);
        }
    }
    let gw = v2(grads.get(&w).unwrap());
    for o in 0..4 {
        for i in 0..3 {
            let want: f32 = (0..2).map(|r| dz[r][o] * xs[r][i]).sum();
            assert!(close(gw[o][i], want), "dW[{o}][{i}] = {} (want {want})", gw[o][i]);
        }
    }
    let gb1 = grads.get(&b1).unwrap().to_vec1::<f32>().unwrap();
    let gb2 = grads.get(&b2).unwrap().to_vec1::<f32>().unwrap();
    for o in 0..4 {
        let want = dz[0][o] + dz[1][o];
        assert!(close(gb1[o], want) && close(gb2[o], -want), "db[{o}] = {} / {} (want ±{want})", gb1[o], gb2[o]);
    }
    assert_eq!(grads.get(&a).unwrap().to_vec1::<f32>().unwrap(), vec![-1.0, -1.0]);
    // The weight's gradient reaches it through `w.t()`: stored contiguous all the same.
    assert!(grads.get(&w).unwrap().is_contiguous());
}

/// `a + b` hands both variables one gradient tensor; `reshape(c)` and the loss's own seed
/// pass theirs through. Each variable still ends with an allocation of its own.
#[test]
fn variables_sharing_a_gradient_get_their_own_allocations() {
    let dev = Device::Cpu;
    let a = Var::new(&[[1.0f32, 2.0], [3.0, 4.0]], &dev).unwrap();
    let b = Var::new(&[[0.5f32, 0.5], [0.5, 0.5]], &dev).unwrap();
    let c = Var::new(&[1.0f32, 1.0, 1.0, 1.0], &dev).unwrap();
    let s = Var::new(&[2.0f32], &dev).unwrap();
    let h = ((a.as_tensor() + b.as_tensor()).unwrap() + c.reshape((2, 2)).unwrap()).unwrap();
    let weights = Tensor::new(&[[1.0f32, 2.0], [3.0, 4.0]], &dev).unwrap();
    let loss = ((h * &weights).unwrap().sum_all().unwrap().reshape(1).unwrap() + s.as_tensor()).unwrap();
    let loss = loss.squeeze(0).unwrap();
    let grads = loss.backward().unwrap();
    let ga = grads.get(&a).unwrap();
    let gb = grads.get(&b).unwrap();
    let gc = grads.get(&c).unwrap();
    let gs = grads.get(&s).unwrap();
    assert_eq!(v2(ga), vec![vec![1.0, 2.0], vec![3.0, 4.0]]);
    assert_eq!(v2(gb), vec![vec![1.0, 2.0], vec![3.0, 4.0]]);
    assert_eq!(gc.to_vec1::<f32>().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
    assert_eq!(gs.to_vec1::<f32>().unwrap(), vec![1.0]);
    let addrs: Vec<usize> = [ga, gb, gc, gs, a.as_tensor(), b.as_tensor(), c.as_tensor(), s.as_tensor(), &weights]
        .map(storage_addr)
        .to_vec();
    for i in 0..addrs.len() {
        for j in 0..i {
            assert_ne!(addrs[i], addrs[j], "tensors {j} and {i} share an allocation");
        }
    }
    for g in [ga, gb, gc, gs] {
        assert!(g.is_contiguous());
    }
}

/// A variable used once, whose gradient nothing else holds, keeps the tensor the backward
/// pass made for it (no copy): its gradient is the matmul's output itself.
#[test]
fn a_gradient_used_once_is_not_copied() {
    let dev = Device::Cpu;
    let x = Tensor::new(&[[1.0f32, 2.0], [3.0, 4.0]], &dev).unwrap();
    let w = Var::new(&[[1.0f32, 0.0], [0.0, 1.0]], &dev).unwrap();
    let grads = x.matmul(w.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
    // dW = x^T 1 = column sums of x, in every column.
    assert_eq!(v2(grads.get(&w).unwrap()), vec![vec![4.0, 4.0], vec![6.0, 6.0]]);
    // Two sums of the same gradient: the second pass adds into the first's tensor.
    let loss = (x.matmul(w.as_tensor()).unwrap().sum_all().unwrap()
        + x.matmul(w.as_tensor()).unwrap().sum_all().unwrap())
    .unwrap();
    let grads = loss.backward().unwrap();
    assert_eq!(v2(grads.get(&w).unwrap()), vec![vec![8.0, 8.0], vec![12.0, 12.0]]);
}

/// The matmul output is not zeroed before gemm writes it, except where gemm writes nothing:
/// an empty inner dimension gives zeros, batched or not.
#[test]
fn a_matmul_over_an_empty_inner_dimension_is_zero() {
    let dev = Device::Cpu;
    let a = Tensor::zeros((3, 0), DType::F32, &dev).unwrap();
    let b = Tensor::zeros((0, 4), DType::F32, &dev).unwrap();
    // Fill the allocator's free lists with non-zero values of the same size first.
    for _ in 0..4 {
        drop(Tensor::full(f32::NAN, (3, 4), &dev).unwrap().sqrt().unwrap());
    }
    assert_eq!(v2(&a.matmul(&b).unwrap()), vec![vec![0.0; 4]; 3]);
    let a = Tensor::zeros((2, 3, 0), DType::F32, &dev).unwrap();
    let b = Tensor::zeros((2, 0, 4), DType::F32, &dev).unwrap();
    let c = a.matmul(&b).unwrap();
    assert_eq!(c.sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
    assert_eq!(c.max_keepdim(D::Minus1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![0.0; 6]);
}

/// Frees a few NaN-filled tensors of `shape`, so that the next allocation of that size likely
/// reuses NaN memory: an output element a matmul leaves unwritten then shows.
fn poison_freed_memory(shape: (usize, usize, usize), dev: &Device) {
    for _ in 0..4 {
        drop(Tensor::full(f32::NAN, shape, dev).unwrap().sqrt().unwrap());
    }
}

/// Every output element of a matmul over uninitialized memory is gemm's, for the shapes the
/// fast paths take (a row, a column, an outer product, a batch).
#[test]
fn matmul_outputs_are_fully_written() {
    let dev = Device::Cpu;
    for (b, m, k, n) in [(1, 1, 5, 7), (1, 7, 5, 1), (1, 6, 1, 5), (3, 4, 9, 2), (1, 33, 17, 65)] {
        poison_freed_memory((b, m, n), &dev);
        let lhs = Tensor::arange(0f32, (b * m * k) as f32, &dev).unwrap().reshape((b, m, k)).unwrap();
        let rhs = Tensor::ones((b, k, n), DType::F32, &dev).unwrap();
        let out = lhs.matmul(&rhs).unwrap().to_vec3::<f32>().unwrap();
        let l = lhs.to_vec3::<f32>().unwrap();
        for (bi, mat) in out.iter().enumerate() {
            for (r, row) in mat.iter().enumerate() {
                let want: f32 = l[bi][r].iter().sum();
                assert!(row.iter().all(|&v| v == want), "({b}, {m}, {k}, {n}) row {r}: {row:?}, want {want}");
            }
        }
    }
}

/// A product with a transposed rhs (`x w^T`, candle-nn's `Linear`) that the patch computes
/// column-major and transposes (few lhs rows, a long inner dimension), beside shapes that keep
/// the direct call: every element equals a loop's sum (small integers, so exact), in one
/// product and in batches (`b` products through one buffer), and the contiguous rhs gives the
/// same bits.
#[test]
fn products_with_a_transposed_rhs_equal_a_loop() {
    let dev = Device::Cpu;
    for (b, m, n, k) in
        [(1, 8, 64, 512), (1, 17, 35, 600), (3, 5, 40, 513), (1, 1, 2, 512), (1, 40, 64, 512), (2, 4, 50, 100)]
    {
        let lv: Vec<f32> = (0..b * m * k).map(|i| ((i * 7 + 3) % 5) as f32 - 2.0).collect();
        let wv: Vec<f32> = (0..b * n * k).map(|i| ((i * 11 + 1) % 7) as f32 - 3.0).collect();
        let lhs = Tensor::from_vec(lv.clone(), (b, m, k), &dev).unwrap();
        let w = Tensor::from_vec(wv.clone(), (b, n, k), &dev).unwrap();
        poison_freed_memory((b, m, n), &dev);
        let out = lhs.matmul(&w.t().unwrap()).unwrap();
        assert!(out.is_contiguous());
        let got = out.to_vec3::<f32>().unwrap();
        for bi in 0..b {
            for i in 0..m {
                for j in 0..n {
                    let want: f32 = (0..k).map(|p| lv[(bi * m + i) * k + p] * wv[(bi * n + j) * k + p]).sum();
                    assert_eq!(got[bi][i][j], want, "({b}, {m}, {n}, {k}) [{bi}][{i}][{j}]");
                }
            }
        }
        let direct = lhs.matmul(&w.t().unwrap().contiguous().unwrap()).unwrap().to_vec3::<f32>().unwrap();
        assert_eq!(got, direct, "({b}, {m}, {n}, {k})");
    }
}

/// A transposed operand on either side (`a^T b` with both variables, batched `q k^T`): the
/// gradients of the transposed products equal those computed from contiguous copies.
#[test]
fn transposed_operands_get_the_gradients_of_contiguous_ones() {
    let dev = Device::Cpu;
    let det = |shape: &[usize], seed: f32| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|i| ((i as f32 * 0.37 + seed).sin() * 2.0).round() / 4.0).collect();
        Tensor::from_vec(v, shape, &dev).unwrap()
    };
    // 2-D: loss = sum((a^T b) * r).
    let (a0, b0, r) = (det(&[5, 3], 0.1), det(&[5, 4], 0.7), det(&[3, 4], 1.3));
    let (a, b) = (Var::from_tensor(&a0).unwrap(), Var::from_tensor(&b0).unwrap());
    let g = (a.t().unwrap().matmul(b.as_tensor()).unwrap() * &r).unwrap().sum_all().unwrap().backward().unwrap();
    let (ac, bc) = (Var::from_tensor(&a0).unwrap(), Var::from_tensor(&b0).unwrap());
    let at = ac.t().unwrap().contiguous().unwrap();
    let gc = (at.matmul(bc.as_tensor()).unwrap() * &r).unwrap().sum_all().unwrap().backward().unwrap();
    for (x, y) in [(&a, &ac), (&b, &bc)] {
        let (gx, gy) = (g.get(x).unwrap(), gc.get(y).unwrap());
        assert!(gx.is_contiguous());
        assert_eq!(v2(gx), v2(gy));
    }
    // Batched: loss = sum((q k^T) * r) over (2, 3, 4) x (2, 5, 4).
    let (q0, k0, r) = (det(&[2, 3, 4], 0.2), det(&[2, 5, 4], 0.9), det(&[2, 3, 5], 1.7));
    let (q, k) = (Var::from_tensor(&q0).unwrap(), Var::from_tensor(&k0).unwrap());
    let g = (q.matmul(&k.t().unwrap()).unwrap() * &r).unwrap().sum_all().unwrap().backward().unwrap();
    let (qc, kc) = (Var::from_tensor(&q0).unwrap(), Var::from_tensor(&k0).unwrap());
    let kt = kc.t().unwrap().contiguous().unwrap();
    let gc = (qc.matmul(&kt).unwrap() * &r).unwrap().sum_all().unwrap().backward().unwrap();
    for (x, y) in [(&q, &qc), (&k, &kc)] {
        let (gx, gy) = (g.get(x).unwrap(), gc.get(y).unwrap());
        assert!(gx.is_contiguous());
        assert_eq!(gx.to_vec3::<f32>().unwrap(), gy.to_vec3::<f32>().unwrap());
    }
}

/// Sums over leading dimensions (a bias's gradient) take the patch's row-adding path: the
/// same values as a loop here, in the same order, and as the general path on other dims.
#[test]
fn sums_over_leading_dimensions_equal_a_loop() {
    let dev = Device::Cpu;
    let (a, b, c) = (4usize, 3usize, 5usize);
    let v: Vec<f32> = (0..a * b * c).map(|i| ((i as f32 * 0.731).sin() * 1000.0).round() / 7.0).collect();
    let x = Tensor::from_vec(v.clone(), (a, b, c), &dev).unwrap();
    // Over dim 0, in row order as candle's general loop adds them.
    let got = x.sum_keepdim(0).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut want = vec![0f32; b * c];
    for i in 0..a {
        for j in 0..b * c {
            want[j] += v[i * b * c + j];
        }
    }
    assert_eq!(got, want);
    // Over dims 0 and 1.
    let got = x.sum((0, 1)).unwrap().to_vec1::<f32>().unwrap();
    let mut want = vec![0f32; c];
    for i in 0..a * b {
        for j in 0..c {
            want[j] += v[i * c + j];
        }
    }
    assert_eq!(got, want);
    // A bias's gradient through broadcast_add, against the loop.
    let bias = Var::zeros(c, DType::F32, &dev).unwrap();
    let g = (x.broadcast_add(bias.as_tensor()).unwrap() * &x).unwrap().sum_all().unwrap().backward().unwrap();
    let mut want = vec![0f32; c];
    for i in 0..a * b {
        for j in 0..c {
            want[j] += v[i * c + j];
        }
    }
    assert_eq!(g.get(&bias).unwrap().to_vec1::<f32>().unwrap(), want);
    // Empty inner and outer extents.
    let e = Tensor::zeros((0, 3), DType::F32, &dev).unwrap();
    assert_eq!(e.sum_keepdim(0).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![0.0; 3]);
    let e = Tensor::zeros((3, 0), DType::F32, &dev).unwrap();
    assert_eq!(e.sum_keepdim(0).unwrap().elem_count(), 0);
}

/// `index_add` past dim 0 (the patch's slab-by-slab loop; `index_select`'s backward): the
/// same values as a loop adding in the ids' order, with repeated ids, on a middle dimension
/// with a trailing extent and on the last one; a bad id is refused and nothing is returned.
#[test]
fn index_add_past_dim_0_equals_a_loop() {
    let dev = Device::Cpu;
    let (pre, n, post, k) = (3usize, 4usize, 2usize, 5usize);
    let ids: Vec<u32> = vec![2, 0, 2, 3, 2];
    let src: Vec<f32> = (0..pre * k * post).map(|i| ((i as f32 * 0.377).cos() * 1000.0).round() / 9.0).collect();
    let base: Vec<f32> = (0..pre * n * post).map(|i| i as f32 * 0.25).collect();
    let x = Tensor::from_vec(base.clone(), (pre, n, post), &dev).unwrap();
    let s = Tensor::from_vec(src.clone(), (pre, k, post), &dev).unwrap();
    let t = Tensor::new(ids.as_slice(), &dev).unwrap();
    let got = x.index_add(&t, &s, 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut want = base.clone();
    for (j, &id) in ids.iter().enumerate() {
        for p in 0..pre {
            for q in 0..post {
                want[(p * n + id as usize) * post + q] += src[(p * k + j) * post + q];
            }
        }
    }
    assert_eq!(got, want);
    // On the last dimension (post = 1): a DLRM's pair selection, through index_select's backward.
    let z = Var::from_vec(base.clone(), (pre, n * post), &dev).unwrap();
    let picked = z.as_tensor().index_select(&t, 1).unwrap();
    let w = Tensor::from_vec(src[..pre * k].to_vec(), (pre, k), &dev).unwrap();
    let g = (picked * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let mut want = vec![0f32; pre * n * post];
    for (j, &id) in ids.iter().enumerate() {
        for p in 0..pre {
            want[p * n * post + id as usize] += src[p * k + j];
        }
    }
    assert_eq!(g.get(&z).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(), want);
    let bad = Tensor::new(&[1u32, 4], &dev).unwrap();
    let s2 = Tensor::zeros((pre, 2, post), DType::F32, &dev).unwrap();
    assert!(x.index_add(&bad, &s2, 1).is_err());
}

/// Runs `loss.backward_with_hook`, recording each variable handed over (by id) with a copy of
/// its gradient's values at that moment.
fn hand_overs(loss: &Tensor) -> (candle_core::backprop::GradStore, Vec<(candle_core::TensorId, Vec<f32>)>) {
    let mut seen = Vec::new();
    let grads = loss
        .backward_with_hook(&mut |var, grad| {
            assert!(grad.is_contiguous(), "a gradient handed over is contiguous");
            assert_eq!(grad.shape(), var.shape());
            seen.push((var.id(), grad.flatten_all()?.to_vec1::<f32>()?));
            Ok(())
        })
        .unwrap();
    (grads, seen)
}

/// The seam overlap builds on: `backward_with_hook` hands every variable's gradient over once,
/// as soon as it is final (its values then are the pass's final values), in the reverse order
/// of the variables' last use; never an unused variable or a constant; and the pass gives the
/// same gradients, bit for bit, as `backward`.
#[test]
fn the_hook_hands_each_final_gradient_over_once_in_reverse_order_of_use() {
    let dev = Device::Cpu;
    let x = Tensor::new(&[[1.0f32, -2.0, 0.5], [0.25, 3.0, -1.0]], &dev).unwrap();
    let w1 = Var::new(&[[0.5f32, -1.0], [1.5, 0.25], [-0.75, 1.0]], &dev).unwrap(); // 3 x 2
    let b1 = Var::new(&[0.1f32, -0.2], &dev).unwrap();
    let w2 = Var::new(&[[1.0f32, 2.0], [-0.5, 0.75]], &dev).unwrap(); // 2 x 2
    let w3 = Var::new(&[[0.3f32], [-1.2]], &dev).unwrap(); // 2 x 1
    let unused = Var::new(&[1.0f32, 2.0], &dev).unwrap();
    let frozen = Tensor::new(&[[2.0f32, 0.0], [0.0, 0.5]], &dev).unwrap(); // a constant, no gradient
    let forward = || {
        let h = x.matmul(w1.as_tensor()).unwrap().broadcast_add(b1.as_tensor()).unwrap().relu().unwrap();
        let h = h.matmul(&frozen).unwrap().matmul(w2.as_tensor()).unwrap().tanh().unwrap();
        h.matmul(w3.as_tensor()).unwrap().sqr().unwrap().sum_all().unwrap()
    };
    let plain = forward().backward().unwrap();
    let (grads, seen) = hand_overs(&forward());
    let order: Vec<_> = seen.iter().map(|(id, _)| *id).collect();
    assert_eq!(order, vec![w3.id(), w2.id(), b1.id(), w1.id()], "reverse order of last use, each once");
    for var in [&w1, &b1, &w2, &w3] {
        let want = plain.get(var).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let handed = &seen.iter().find(|(id, _)| *id == var.id()).unwrap().1;
        let kept = grads.get(var).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(handed), bits(&want), "the gradient was final when handed over");
        assert_eq!(bits(&kept), bits(&want), "the same bits as backward");
    }
    // The constant gets a gradient in the store (candle's matmul backward computes both), but
    // it is no variable, so it is never handed over; the unused variable gets none at all.
    assert!(grads.get(&unused).is_none());
}

/// A variable used twice (tied weights) is handed over once, after its last use, with the sum
/// of both contributions; a variable that is the root itself is handed over too.
#[test]
fn a_variable_used_twice_is_handed_over_once_with_both_contributions() {
    let dev = Device::Cpu;
    let x = Tensor::new(&[[1.0f32, 2.0], [3.0, -1.0]], &dev).unwrap();
    let w = Var::new(&[[0.5f32, -0.25], [1.0, 2.0]], &dev).unwrap();
    let v = Var::new(&[[1.5f32], [-0.5]], &dev).unwrap();
    let forward = || {
        let h = x.matmul(w.as_tensor()).unwrap().matmul(w.as_tensor()).unwrap(); // w twice
        h.matmul(v.as_tensor()).unwrap().sum_all().unwrap()
    };
    let plain = forward().backward().unwrap();
    let (_, seen) = hand_overs(&forward());
    assert_eq!(seen.iter().map(|(id, _)| *id).collect::<Vec<_>>(), vec![v.id(), w.id()]);
    assert_eq!(seen[1].1, plain.get(&w).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap());
    // The root a variable: its gradient is ones, handed over at the end.
    let (_, seen) = hand_overs(v.as_tensor());
    assert_eq!(seen, vec![(v.id(), vec![1.0, 1.0])]);
}

/// The gradient handed over is the store's own, in an allocation nothing else shares: the
/// hook may write it in place (as an all-reduce does) without touching another variable's
/// gradient, even where the pass first gave both one tensor (`a + b`); an error from the hook
/// ends the pass with it.
#[test]
fn the_hook_may_write_a_gradient_in_place_and_its_error_ends_the_pass() {
    let dev = Device::Cpu;
    let a = Var::new(&[[1.0f32, 2.0], [3.0, 4.0]], &dev).unwrap();
    let b = Var::new(&[[0.5f32, 0.5], [0.5, 0.5]], &dev).unwrap();
    let weights = Tensor::new(&[[1.0f32, 2.0], [3.0, 4.0]], &dev).unwrap();
    let loss = ((a.as_tensor() + b.as_tensor()).unwrap() * &weights).unwrap().sum_all().unwrap();
    let sevens = Tensor::full(7.0f32, (2, 2), &dev).unwrap();
    let mut addrs = Vec::new();
    let grads = loss
        .backward_with_hook(&mut |var, grad| {
            addrs.push(storage_addr(grad));
            if var.id() == a.id() {
                grad.slice_set(&sevens, 0, 0)?; // in place
            }
            Ok(())
        })
        .unwrap();
    assert_eq!(v2(grads.get(&a).unwrap()), vec![vec![7.0, 7.0], vec![7.0, 7.0]], "the store's own tensor");
    assert_eq!(v2(grads.get(&b).unwrap()), vec![vec![1.0, 2.0], vec![3.0, 4.0]], "b's gradient untouched");
    assert_eq!(addrs.len(), 2);
    assert_ne!(addrs[0], addrs[1]);
    assert!(addrs.contains(&storage_addr(grads.get(&a).unwrap())), "the store keeps the tensor handed over");
    let err = loss.backward_with_hook(&mut |_, _| candle_core::bail!("bucket 0 failed")).unwrap_err();
    assert!(err.to_string().contains("bucket 0 failed"), "{err}");
}

/// A [`GradHook`](candle_core::backprop::GradHook) that asks for blocks of `rows` rows and
/// records what it is given: the blocks (first row, values) and the final gradients.
struct Rows {
    rows: usize,
    asked: Vec<candle_core::TensorId>,
    blocks: Vec<(candle_core::TensorId, usize, Vec<Vec<f32>>)>,
    finals: Vec<candle_core::TensorId>,
}

impl candle_core::backprop::GradHook for Rows {
    fn on_final(&mut self, var: &Tensor, grad: &Tensor) -> candle_core::Result<()> {
        assert!(grad.is_contiguous());
        self.finals.push(var.id());
        Ok(())
    }

    fn rows_per_block(&mut self, var: &Tensor) -> Option<usize> {
        self.asked.push(var.id());
        Some(self.rows)
    }

    fn on_rows(&mut self, var: &Tensor, first: usize, block: &Tensor) -> candle_core::Result<()> {
        assert!(block.is_contiguous());
        assert!(self.finals.iter().all(|&id| id != var.id()), "blocks come before the whole gradient");
        self.blocks.push((var.id(), first, block.to_vec2::<f32>()?));
        Ok(())
    }
}

fn bits2(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter().map(|r| r.iter().map(|x| x.to_bits()).collect()).collect()
}

/// The row seam: a weight used once as `x.matmul(&w.t())` (candle-nn's `Linear` on a
/// matrix) or `x.matmul(&w)` has its gradient handed over in blocks of rows, in order, each bit for bit the
/// rows of the whole gradient, before the whole is; over batches below and above the matmul's
/// blocking of the inner dimension, and a last block shorter than the others. Weights used
/// otherwise (twice, under more transposes, through a copy) are never asked and come whole;
/// the gradients equal `backward`'s bit for bit. (A 3-d input to `Linear` is folded into a
/// matrix by candle-nn, so its weights take the seam too.)
#[test]
fn a_linear_weight_s_gradient_comes_in_blocks_of_rows_equal_to_the_whole() {
    let dev = Device::Cpu;
    for transposed in [true, false] {
        for (batch, out, inp, rows) in [(1, 8, 5, 3), (7, 10, 33, 4), (128, 96, 64, 32), (600, 70, 300, 16)] {
            // `x.matmul(&w.t())` with `w` out x inp, or `x.matmul(&w)` with `w` inp x out.
            let w_rows = if transposed { out } else { inp };
            let xs: Vec<f32> = (0..batch * inp).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
            let x = Tensor::from_vec(xs, (batch, inp), &dev).unwrap();
            let w: Vec<f32> = (0..out * inp).map(|i| ((i * 53 % 97) as f32 - 48.0) / 41.0).collect();
            let w = Var::from_tensor(&Tensor::from_vec(w, (w_rows, out * inp / w_rows), &dev).unwrap()).unwrap();
            let b = Var::new(vec![0.25f32; out], &dev).unwrap();
            let forward = || {
                let wt = if transposed { w.as_tensor().t().unwrap() } else { w.as_tensor().clone() };
                let h = x.matmul(&wt).unwrap().broadcast_add(b.as_tensor()).unwrap();
                h.tanh().unwrap().sqr().unwrap().sum_all().unwrap()
            };
            let case = format!("{batch}x{out}x{inp}, transposed {transposed}");
            let plain = forward().backward().unwrap();
            let mut hook = Rows { rows, asked: Vec::new(), blocks: Vec::new(), finals: Vec::new() };
            let grads = forward().backward_with_hooks(&mut hook).unwrap();
            assert_eq!(hook.asked, vec![w.id()], "{case}: only the weight is asked");
            let whole = v2(plain.get(&w).unwrap());
            let firsts: Vec<usize> = hook.blocks.iter().map(|(_, f, _)| *f).collect();
            assert_eq!(firsts, (0..w_rows).step_by(rows).collect::<Vec<_>>(), "{case}: blocks in order");
            for (id, first, block) in &hook.blocks {
                assert_eq!(*id, w.id());
                let n = rows.min(w_rows - first);
                assert_eq!(bits2(block), bits2(&whole[*first..first + n]), "{case}: rows {first}..");
            }
            assert_eq!(hook.finals, vec![b.id(), w.id()]);
            assert_eq!(bits2(&v2(grads.get(&w).unwrap())), bits2(&whole), "{case}: the whole gradient, bit for bit");
            let bias = |g: &candle_core::backprop::GradStore| g.get(&b).unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(bits2(&[bias(&grads)]), bits2(&[bias(&plain)]));
        }
    }
    // Used twice (tied), under more than one transpose, or through a copy: never asked.
    let x = Tensor::new(&[[1.0f32, 2.0], [3.0, -1.0]], &dev).unwrap();
    let w = Var::new(&[[0.5f32, -0.25], [1.0, 2.0], [0.1, 0.2]], &dev).unwrap();
    let losses = [
        x.matmul(&w.as_tensor().t().unwrap()).unwrap().sum_all().unwrap() + w.as_tensor().sum_all().unwrap(),
        x.matmul(&w.as_tensor().t().unwrap().contiguous().unwrap()).unwrap().sum_all().unwrap()
            + w.as_tensor().sum_all().unwrap(),
        Ok(x.matmul(&w.as_tensor().t().unwrap().t().unwrap().t().unwrap()).unwrap().sum_all().unwrap()),
        Ok(x.matmul(&w.as_tensor().t().unwrap().contiguous().unwrap()).unwrap().sum_all().unwrap()),
    ];
    for (case, loss) in losses.into_iter().enumerate() {
        never_asked(&loss.unwrap(), &w, &format!("case {case}"));
    }
}

/// `loss`'s only variable `w` is never asked for blocks of rows: it is handed over whole, with
/// `backward`'s gradient.
fn never_asked(loss: &Tensor, w: &Var, case: &str) {
    let plain = loss.backward().unwrap();
    let mut hook = Rows { rows: 1, asked: Vec::new(), blocks: Vec::new(), finals: Vec::new() };
    let grads = loss.backward_with_hooks(&mut hook).unwrap();
    assert!(hook.asked.is_empty() && hook.blocks.is_empty(), "{case}");
    assert_eq!(hook.finals, vec![w.id()], "{case}");
    assert_eq!(v2(grads.get(w).unwrap()), v2(plain.get(w).unwrap()), "{case}");
}

/// A hook that keeps what it is given and takes it from the pass: blocks of rows never joined
/// (`joins_rows` false) and every final gradient taken from the store (`takes` true), as
/// ZeRO stage 2 runs the pass.
#[derive(Default)]
struct Keeps {
    /// The rows of a block; 3 when 0.
    rows: usize,
    blocks: Vec<(candle_core::TensorId, usize, Vec<f32>)>,
    finals: Vec<(candle_core::TensorId, Vec<f32>)>,
}

impl candle_core::backprop::GradHook for Keeps {
    fn on_final(&mut self, var: &Tensor, grad: &Tensor) -> candle_core::Result<()> {
        self.finals.push((var.id(), grad.flatten_all()?.to_vec1::<f32>()?));
        Ok(())
    }

    fn rows_per_block(&mut self, _var: &Tensor) -> Option<usize> {
        Some(if self.rows == 0 { 3 } else { self.rows })
    }

    fn on_rows(&mut self, var: &Tensor, first: usize, block: &Tensor) -> candle_core::Result<()> {
        self.blocks.push((var.id(), first, block.flatten_all()?.to_vec1::<f32>()?));
        Ok(())
    }

    fn joins_rows(&mut self, _var: &Tensor) -> bool {
        false
    }

    fn takes(&mut self, _var: &Tensor) -> bool {
        true
    }
}

/// Blocks not joined and gradients taken: the weight's blocks are its gradient's rows bit for
/// bit and it is never handed over whole, every other variable (the input before the product
/// included, past the weight's transpose) is handed over with `backward`'s gradient, and the
/// store the pass returns holds no variable's gradient.
#[test]
fn a_hook_may_keep_the_blocks_unjoined_and_take_every_gradient() {
    let dev = Device::Cpu;
    for transposed in [true, false] {
        let (batch, out, inp) = (5, 8, 7);
        let w_rows = if transposed { out } else { inp };
        let xs: Vec<f32> = (0..batch * inp).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
        let x = Var::from_tensor(&Tensor::from_vec(xs, (batch, inp), &dev).unwrap()).unwrap();
        let w: Vec<f32> = (0..out * inp).map(|i| ((i * 53 % 97) as f32 - 48.0) / 41.0).collect();
        let w = Var::from_tensor(&Tensor::from_vec(w, (w_rows, out * inp / w_rows), &dev).unwrap()).unwrap();
        let b = Var::new(vec![0.25f32; out], &dev).unwrap();
        let forward = || {
            let wt = if transposed { w.as_tensor().t().unwrap() } else { w.as_tensor().clone() };
            let h = x.as_tensor().tanh().unwrap().matmul(&wt).unwrap().broadcast_add(b.as_tensor()).unwrap();
            h.tanh().unwrap().sqr().unwrap().sum_all().unwrap()
        };
        let plain = forward().backward().unwrap();
        let mut hook = Keeps::default();
        let grads = forward().backward_with_hooks(&mut hook).unwrap();
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        let whole = flat(plain.get(&w).unwrap());
        let cols = out * inp / w_rows;
        assert_eq!(
            hook.blocks.iter().map(|(_, f, _)| *f).collect::<Vec<_>>(),
            (0..w_rows).step_by(3).collect::<Vec<_>>()
        );
        for (id, first, block) in &hook.blocks {
            assert_eq!(*id, w.id());
            assert_eq!(bits(block), bits(&whole[first * cols..first * cols + block.len()]), "rows {first}..");
        }
        let finals: Vec<candle_core::TensorId> = hook.finals.iter().map(|(id, _)| *id).collect();
        assert_eq!(finals, vec![b.id(), x.id()], "transposed {transposed}: the weight is never handed over whole");
        for (id, g) in &hook.finals {
            let v = if *id == b.id() { &b } else { &x };
            assert_eq!(bits(g), bits(&flat(plain.get(v).unwrap())), "transposed {transposed}");
        }
        for v in [&x, &w, &b] {
            assert!(grads.get(v).is_none(), "transposed {transposed}: the store keeps a gradient taken");
        }
    }
}

/// The row seam through mixed precision's autocast: a weight used once as
/// `x.matmul(&w.to_dtype(t).t())` or `x.matmul(&w.to_dtype(t))`, in bf16 and f16, has its
/// gradient handed over in blocks of rows in the weight's type (f32), each bit for bit the rows
/// of `backward`'s gradient, joined (bit for bit the whole) or kept by the hook (the weight then
/// has no gradient in the store, and the input before the product still gets `backward`'s).
/// A cast outside the transpose (`w.t().to_dtype(t)`), or a cast used twice, is never asked.
#[test]
fn a_cast_weight_s_gradient_comes_in_blocks_of_rows_in_the_weight_s_type() {
    let dev = Device::Cpu;
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for dtype in [DType::BF16, DType::F16] {
        for transposed in [true, false] {
            for (batch, out, inp, rows) in [(1, 8, 5, 3), (7, 10, 33, 4), (9, 6, 5, 1), (96, 70, 64, 16)] {
                let w_rows = if transposed { out } else { inp };
                let xs: Vec<f32> = (0..batch * inp).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
                let x = Var::from_tensor(&Tensor::from_vec(xs, (batch, inp), &dev).unwrap()).unwrap();
                let w: Vec<f32> = (0..out * inp).map(|i| ((i * 53 % 97) as f32 - 48.0) / 41.0).collect();
                let w = Var::from_tensor(&Tensor::from_vec(w, (w_rows, out * inp / w_rows), &dev).unwrap()).unwrap();
                let forward = || {
                    let cast = w.as_tensor().to_dtype(dtype).unwrap();
                    let wt = if transposed { cast.t().unwrap() } else { cast };
                    let h = x.as_tensor().tanh().unwrap().to_dtype(dtype).unwrap().matmul(&wt).unwrap();
                    h.to_dtype(DType::F32).unwrap().tanh().unwrap().sqr().unwrap().sum_all().unwrap()
                };
                let case = format!("{dtype:?} {batch}x{out}x{inp}, transposed {transposed}");
                let plain = forward().backward().unwrap();
                let whole = flat(plain.get(&w).unwrap());
                let cols = out * inp / w_rows;
                let check_blocks = |blocks: Vec<(candle_core::TensorId, usize, Vec<f32>)>| {
                    let firsts: Vec<usize> = blocks.iter().map(|(_, f, _)| *f).collect();
                    assert_eq!(firsts, (0..w_rows).step_by(rows).collect::<Vec<_>>(), "{case}: blocks in order");
                    for (id, first, block) in &blocks {
                        assert_eq!(*id, w.id(), "{case}");
                        let n = rows.min(w_rows - first);
                        assert_eq!(block.len(), n * cols, "{case}");
                        assert_eq!(
                            bits(block),
                            bits(&whole[first * cols..(first + n) * cols]),
                            "{case}: rows {first}.."
                        );
                    }
                };
                // Joined: the whole gradient in f32, bit for bit, handed over after the blocks.
                let mut hook = Rows { rows, asked: Vec::new(), blocks: Vec::new(), finals: Vec::new() };
                let grads = forward().backward_with_hooks(&mut hook).unwrap();
                assert_eq!(hook.asked, vec![w.id()], "{case}: only the weight is asked");
                check_blocks(
                    hook.blocks.iter().map(|(id, f, b)| (*id, *f, b.iter().flatten().copied().collect())).collect(),
                );
                assert_eq!(hook.finals, vec![w.id(), x.id()], "{case}");
                let g = grads.get(&w).unwrap();
                assert_eq!(g.dtype(), DType::F32, "{case}");
                assert_eq!(bits(&flat(g)), bits(&whole), "{case}: the whole gradient, bit for bit");
                assert_eq!(bits(&flat(grads.get(&x).unwrap())), bits(&flat(plain.get(&x).unwrap())), "{case}");
                // Kept by the hook: never joined, never in the store; the input's as `backward`'s.
                let mut keeps = Keeps { rows, ..Keeps::default() };
                let grads = forward().backward_with_hooks(&mut keeps).unwrap();
                check_blocks(keeps.blocks);
                let finals: Vec<candle_core::TensorId> = keeps.finals.iter().map(|(id, _)| *id).collect();
                assert_eq!(finals, vec![x.id()], "{case}: the weight is never handed over whole");
                assert_eq!(bits(&keeps.finals[0].1), bits(&flat(plain.get(&x).unwrap())), "{case}");
                assert!(grads.get(&w).is_none() && grads.get(&x).is_none(), "{case}");
            }
        }
        // A cast outside the transpose, or a cast used twice: never asked, `backward`'s gradient.
        let x = Tensor::new(&[[1.0f32, 2.0], [3.0, -1.0]], &dev).unwrap().to_dtype(dtype).unwrap();
        let w = Var::new(&[[0.5f32, -0.25], [1.0, 2.0], [0.1, 0.2]], &dev).unwrap();
        for case in 0..2 {
            let y = if case == 0 {
                x.matmul(&w.as_tensor().t().unwrap().to_dtype(dtype).unwrap()).unwrap()
            } else {
                // The same cast node, used twice.
                let c = w.as_tensor().to_dtype(dtype).unwrap();
                let row = c.sum_keepdim(1).unwrap().t().unwrap().broadcast_as((2, 3)).unwrap();
                (x.matmul(&c.t().unwrap()).unwrap() + row).unwrap()
            };
            let loss = y.to_dtype(DType::F32).unwrap().sqr().unwrap().sum_all().unwrap();
            never_asked(&loss, &w, &format!("{dtype:?} case {case}"));
        }
    }
}

/// The patch's views for ZeRO's shards: `Var::run_view` steps a run of a variable in place
/// (an update through the view is the variable's, a write to the variable the view's), and
/// `copy_run_from` copies runs between the variables of threads that each write their own
/// while reading the others' (the shape of a shard gather) without deadlock.
#[test]
fn a_run_view_shares_its_variable_and_runs_copy_between_threads() {
    let dev = Device::Cpu;
    let w = Var::from_tensor(&Tensor::arange(0f32, 12., &dev).unwrap().reshape((3, 4)).unwrap()).unwrap();
    let view = w.run_view(5, 4).unwrap();
    assert_eq!(view.to_vec1::<f32>().unwrap(), [5., 6., 7., 8.]);
    assert_eq!(storage_addr(view.as_tensor()), storage_addr(w.as_tensor()));
    view.set(&Tensor::new(&[-1f32, -2., -3., -4.], &dev).unwrap()).unwrap();
    assert_eq!(v2(w.as_tensor()), [[0., 1., 2., 3.], [4., -1., -2., -3.], [-4., 9., 10., 11.]]);
    w.set(&Tensor::zeros((3, 4), DType::F32, &dev).unwrap()).unwrap();
    assert_eq!(view.to_vec1::<f32>().unwrap(), [0.; 4]);
    // The run onto itself: nothing to copy; another run of the same storage: refused.
    w.as_tensor().copy_run_from(5, view.as_tensor()).unwrap();
    assert!(w.as_tensor().copy_run_from(4, view.as_tensor()).is_err());
    assert!(w.as_tensor().copy_run_from(9, &Tensor::zeros(4, DType::F32, &dev).unwrap()).is_err());

    // 4 threads, each owning one variable whose run `k` it fills with its own number, then
    // copying every other thread's run into its own variable, 200 times over.
    let n = 4;
    let vars: Vec<Var> = (0..n).map(|_| Var::zeros(n * 1000, DType::F32, &dev).unwrap()).collect();
    let views: Vec<Var> = (0..n).map(|k| vars[k].run_view(k * 1000, 1000).unwrap()).collect();
    let barrier = std::sync::Barrier::new(n);
    std::thread::scope(|s| {
        for k in 0..n {
            let (vars, views, barrier, dev) = (&vars, &views, &barrier, &dev);
            s.spawn(move || {
                for round in 0..200 {
                    views[k].set(&Tensor::full((k * 1000 + round) as f32, 1000, dev).unwrap()).unwrap();
                    barrier.wait();
                    for (j, run) in views.iter().enumerate() {
                        vars[k].as_tensor().copy_run_from(j * 1000, run.as_tensor()).unwrap();
                    }
                    barrier.wait();
                }
            });
        }
    });
    for v in &vars {
        let got = v.to_vec1::<f32>().unwrap();
        for j in 0..n {
            assert!(got[j * 1000..(j + 1) * 1000].iter().all(|&x| x == (j * 1000 + 199) as f32), "run {j}");
        }
    }
}

/// The patch's second seam, `Tensor::release_storage` (ZeRO stage 3): a released variable's
/// elements are gone until their next use, which restores them through the source: an op
/// through the variable or through a view made before the release, the backward pass reading
/// a saved operand, or `make_resident`. Gradients are bit for bit those of a variable never
/// released, and the source is asked once per release.
mod release {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use candle_core::{Result, StorageSource, Tensor, Var};

    use super::*;

    /// Restores from a copy kept aside, counting the calls.
    struct Kept(Tensor, AtomicUsize);

    impl StorageSource for Kept {
        fn restore(&self) -> Result<Tensor> {
            self.1.fetch_add(1, Ordering::SeqCst);
            self.0.copy()
        }
    }

    fn kept(v: &Var) -> Arc<Kept> {
        Arc::new(Kept(v.as_tensor().copy().unwrap(), AtomicUsize::new(0)))
    }

    fn model(w: &Var, x: &Tensor) -> Tensor {
        x.matmul(&w.t().unwrap()).unwrap().tanh().unwrap().sqr().unwrap().sum_all().unwrap()
    }

    #[test]
    fn a_released_variable_is_restored_on_its_next_use() {
        let dev = Device::Cpu;
        let w = Var::randn(0f32, 1.0, (64, 32), &dev).unwrap();
        let x = Tensor::randn(0f32, 1.0, (8, 32), &dev).unwrap();
        let want = w.as_tensor().to_vec2::<f32>().unwrap();
        let source = kept(&w);
        assert!(w.release_storage(source.clone()).unwrap());
        assert!(w.is_released());
        assert_eq!(source.1.load(Ordering::SeqCst), 0);
        assert_eq!(w.as_tensor().to_vec2::<f32>().unwrap(), want);
        assert!(!w.is_released());
        assert_eq!(source.1.load(Ordering::SeqCst), 1);
        // A view made before the release restores it too.
        let view = w.t().unwrap();
        assert!(w.release_storage(source.clone()).unwrap());
        assert_eq!(view.t().unwrap().to_vec2::<f32>().unwrap(), want);
        assert_eq!(source.1.load(Ordering::SeqCst), 2);
        // make_resident restores now; a second call finds nothing to do.
        assert!(w.release_storage(source.clone()).unwrap());
        w.make_resident().unwrap();
        w.make_resident().unwrap();
        assert_eq!(source.1.load(Ordering::SeqCst), 3);
        // A write after a restore is seen: the owner of the source can save it before it
        // releases again.
        assert!(!w.written_since_restore());
        w.set(&w.as_tensor().ones_like().unwrap()).unwrap();
        assert!(w.written_since_restore());
        assert!(w.release_storage(source.clone()).unwrap());
        w.make_resident().unwrap();
        assert!(!w.written_since_restore());
        // An op through the variable itself.
        assert!(w.release_storage(source.clone()).unwrap());
        let y = x.matmul(&w.t().unwrap()).unwrap();
        assert_eq!(y.dims(), &[8, 64]);
        assert_eq!(source.1.load(Ordering::SeqCst), 5);
    }

    #[test]
    fn the_backward_pass_restores_a_variable_released_after_the_forward_pass() {
        let dev = Device::Cpu;
        let w = Var::randn(0f32, 1.0, (64, 32), &dev).unwrap();
        let x = Tensor::randn(0f32, 1.0, (8, 32), &dev).unwrap();
        let want = model(&w, &x).backward().unwrap().get(&w).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let source = kept(&w);
        let loss = model(&w, &x);
        // Released between the forward pass and the backward pass, as stage 3 releases a unit:
        // the matmul's backward reads `w.t()` again.
        assert!(w.release_storage(source.clone()).unwrap());
        let got = loss.backward().unwrap().get(&w).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(source.1.load(Ordering::SeqCst), 1);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want));
    }

    #[test]
    fn a_storage_in_use_is_not_released_and_a_wrong_restore_is_an_error() {
        let dev = Device::Cpu;
        let w = Var::randn(0f32, 1.0, (4, 4), &dev).unwrap();
        {
            let _in_use = w.as_tensor().storage_and_layout();
            assert!(!w.release_storage(kept(&w)).unwrap());
        }
        assert!(!w.is_released());
        // A view does not cover its storage: refused.
        let narrow = w.as_tensor().narrow(0, 1, 2).unwrap();
        assert!(narrow.release_storage(kept(&w)).is_err());
        // A source that brings back the wrong number of elements: make_resident says so, and
        // the storage stays released.
        struct Wrong;
        impl StorageSource for Wrong {
            fn restore(&self) -> Result<Tensor> {
                Tensor::zeros(3, candle_core::DType::F32, &Device::Cpu)
            }
        }
        assert!(w.release_storage(Arc::new(Wrong)).unwrap());
        let e = w.make_resident().unwrap_err().to_string();
        assert!(e.contains("16") && e.contains("3"), "{e}");
        assert!(w.is_released());
        assert!(w.release_storage(kept(&Var::zeros((4, 4), candle_core::DType::F32, &dev).unwrap())).unwrap());
        assert_eq!(w.as_tensor().sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
    }

    /// `resident_copy` copies a resident storage and restores nothing; `clear_written` forgets
    /// the writes so far.
    #[test]
    fn a_resident_copy_restores_nothing_and_writes_can_be_forgotten() {
        let dev = Device::Cpu;
        let w = Var::randn(0f32, 1.0, (4, 3), &dev).unwrap();
        let want = w.as_tensor().to_vec2::<f32>().unwrap();
        let copy = w.as_tensor().t().unwrap().resident_copy().unwrap().unwrap();
        assert_eq!(copy.t().unwrap().to_vec2::<f32>().unwrap(), want);
        assert_ne!(storage_addr(&copy), storage_addr(w.as_tensor()));
        let source = kept(&w);
        assert!(w.release_storage(source.clone()).unwrap());
        assert!(w.as_tensor().resident_copy().unwrap().is_none());
        assert!(w.is_released());
        assert_eq!(source.1.load(Ordering::SeqCst), 0);
        w.make_resident().unwrap();
        w.set(&w.as_tensor().zeros_like().unwrap()).unwrap();
        assert!(w.written_since_restore());
        w.clear_written();
        assert!(!w.written_since_restore());
    }

    /// A source whose restore fails, with a stand-in of NaN, counting the stand-ins given.
    struct Failing(AtomicUsize);

    impl StorageSource for Failing {
        fn restore(&self) -> Result<Tensor> {
            candle_core::bail!("the peer that held the elements is gone")
        }
        fn stand_in(&self, error: &candle_core::Error) -> Option<Tensor> {
            assert!(error.to_string().contains("the peer that held the elements is gone"), "{error}");
            self.0.fetch_add(1, Ordering::SeqCst);
            Tensor::full(f32::NAN, (4, 4), &Device::Cpu).ok()
        }
    }

    #[test]
    fn a_failed_restore_is_make_resident_s_error_and_an_op_s_stand_in() {
        let dev = Device::Cpu;
        let w = Var::ones((4, 4), candle_core::DType::F32, &dev).unwrap();
        let source = Arc::new(Failing(AtomicUsize::new(0)));
        assert!(w.release_storage(source.clone()).unwrap());
        // make_resident returns the error, takes no stand-in, and the storage stays released.
        let e = w.make_resident().unwrap_err().to_string();
        assert!(e.contains("the peer that held the elements is gone"), "{e}");
        assert!(w.is_released());
        assert_eq!(source.0.load(Ordering::SeqCst), 0);
        // An op, which cannot return it, computes with the stand-in, which the storage keeps
        // as if restored (not written since).
        let y = w.as_tensor().sum_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(y.is_nan());
        assert!(!w.is_released());
        assert!(!w.written_since_restore());
        assert_eq!(source.0.load(Ordering::SeqCst), 1);
    }

    #[test]
    #[should_panic(expected = "a released storage could not be restored: the peer that held the elements is gone")]
    fn a_failed_restore_without_a_stand_in_panics_in_an_op() {
        struct NoStandIn;
        impl StorageSource for NoStandIn {
            fn restore(&self) -> Result<Tensor> {
                candle_core::bail!("the peer that held the elements is gone")
            }
        }
        let w = Var::ones((4, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
        assert!(w.release_storage(Arc::new(NoStandIn)).unwrap());
        let _ = w.as_tensor().sum_all();
    }
}

/// The patch's third seam, `Tensor::with_backward` and `Tensor::backward_from` (activation
/// recomputation): a node of any number of operands whose gradients a function computes, and a
/// backward pass seeded with a given gradient.
mod with_backward {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use candle_core::backprop::BackwardFn;
    use candle_core::{Result, Tensor, Var};

    use super::*;

    /// `y = a * b + c` elementwise, its gradients in closed form, counting the calls.
    struct MulAdd(AtomicUsize);

    impl BackwardFn for MulAdd {
        fn backward(&self, ops: &[Tensor], _node: &Tensor, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok(vec![Some(grad.mul(&ops[1])?), Some(grad.mul(&ops[0])?), Some(grad.clone())])
        }
    }

    #[test]
    fn a_node_s_function_gives_its_operands_gradients_once_per_pass() {
        let dev = Device::Cpu;
        let a = Var::new(&[1f32, 2.0, 3.0], &dev).unwrap();
        let b = Var::new(&[4f32, 5.0, 6.0], &dev).unwrap();
        let c = Var::new(&[7f32, 8.0, 9.0], &dev).unwrap();
        let value = ((a.as_tensor() * b.as_tensor()).unwrap() + c.as_tensor()).unwrap().detach();
        let f = Arc::new(MulAdd(AtomicUsize::new(0)));
        let y = Tensor::with_backward(
            &value,
            vec![a.as_tensor().clone(), b.as_tensor().clone(), c.as_tensor().clone()],
            f.clone(),
        );
        assert_eq!(y.to_vec1::<f32>().unwrap(), [11.0, 18.0, 27.0]);
        // d/da sum(y^2) = 2 y b, and a used again outside the node adds its own part.
        let loss = (y.sqr().unwrap().sum_all().unwrap() + a.as_tensor().sum_all().unwrap()).unwrap();
        let g = loss.backward().unwrap();
        assert_eq!(f.0.load(Ordering::SeqCst), 1);
        assert_eq!(g.get(&a).unwrap().to_vec1::<f32>().unwrap(), [89.0, 181.0, 325.0]);
        assert_eq!(g.get(&b).unwrap().to_vec1::<f32>().unwrap(), [22.0, 72.0, 162.0]);
        assert_eq!(g.get(&c).unwrap().to_vec1::<f32>().unwrap(), [22.0, 36.0, 54.0]);
        // The hook's hand-over counts the node as a use of each operand.
        let mut handed = Vec::new();
        let loss = y.sqr().unwrap().sum_all().unwrap();
        loss.backward_with_hook(&mut |v, _| {
            handed.push(v.id());
            Ok(())
        })
        .unwrap();
        assert_eq!(handed.len(), 3, "each operand once");
        for v in [&a, &b, &c] {
            assert!(handed.contains(&v.as_tensor().id()));
        }
        // Without an operand that tracks gradients, the value itself, detached.
        let plain = Tensor::with_backward(&value, vec![value.clone()], f.clone());
        assert!(!plain.track_op());
    }

    #[test]
    fn a_wrong_number_of_gradients_is_an_error_and_a_seed_of_another_shape_is_refused() {
        struct Short;
        impl BackwardFn for Short {
            fn backward(&self, _: &[Tensor], _: &Tensor, _: &Tensor) -> Result<Vec<Option<Tensor>>> {
                Ok(vec![None])
            }
        }
        let dev = Device::Cpu;
        let a = Var::new(&[1f32, 2.0], &dev).unwrap();
        let y =
            Tensor::with_backward(a.as_tensor(), vec![a.as_tensor().clone(), a.as_tensor().clone()], Arc::new(Short));
        let e = y.sum_all().unwrap().backward().unwrap_err().to_string();
        assert!(e.contains("1 gradients for 2 operands"), "{e}");
        let seed = Tensor::new(&[1f32, 2.0, 3.0], &dev).unwrap();
        assert!(a.as_tensor().sqr().unwrap().backward_from(&seed).is_err());
    }

    #[test]
    fn a_seeded_pass_gives_the_gradients_of_the_product_with_its_seed() {
        let dev = Device::Cpu;
        let w = Var::randn(0f32, 1.0, (16, 8), &dev).unwrap();
        let x = Tensor::randn(0f32, 1.0, (4, 16), &dev).unwrap();
        let seed = Tensor::randn(0f32, 1.0, (4, 8), &dev).unwrap();
        let y = x.matmul(w.as_tensor()).unwrap().tanh().unwrap();
        let got = y.backward_from(&seed).unwrap().get(&w).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        // The seed as a constant factor: sum(y * seed) has y's gradient equal to the seed
        // (ones times the seed), so the same bits.
        let y = x.matmul(w.as_tensor()).unwrap().tanh().unwrap();
        let want = (y * &seed).unwrap().sum_all().unwrap().backward().unwrap();
        let want = want.get(&w).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want));
    }
}

/// Patch item 13: candle's bf16 adds narrow with `half`'s rounding (to nearest even, NaN kept
/// quiet) on every CPU, bit for bit `bf16::from_f32(a + b)`: ties, carries into the exponent,
/// overflow to infinity, subnormals, infinities and NaN, in tensors longer than a vector and
/// with a tail.
#[test]
fn bf16_adds_round_as_half_does() {
    use half::bf16;
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(13);
    let special = [
        0.0f32,
        -0.0,
        1.0,
        1.0 + f32::EPSILON,
        f32::from_bits(0x3F80_8000), // a tie between two bf16 values, even below
        f32::from_bits(0x3F81_8000), // a tie, odd below: rounds up
        f32::from_bits(0x7F7F_FFFF), // f32::MAX: rounds to infinity
        f32::MIN_POSITIVE / 3.0,     // subnormal
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ];
    let n = 1_003;
    let a: Vec<f32> =
        (0..n).map(|i| if i < special.len() { special[i] } else { f32::from_bits(rng.random::<u32>()) }).collect();
    let b: Vec<f32> = (0..n).map(|i| if i % 3 == 0 { 0.0 } else { f32::from_bits(rng.random::<u32>()) }).collect();
    let to = |v: &[f32]| Tensor::new(v, &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap();
    let sum = (to(&a) + to(&b)).unwrap().to_vec1::<bf16>().unwrap();
    let widen = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect::<Vec<f32>>();
    let (wa, wb) = (widen(&a), widen(&b));
    for i in 0..n {
        let want = bf16::from_f32(wa[i] + wb[i]);
        let same = want.to_bits() == sum[i].to_bits() || (want.is_nan() && sum[i].is_nan());
        assert!(same, "element {i}: {} + {} gave {:#06x}, not {:#06x}", wa[i], wb[i], sum[i].to_bits(), want.to_bits());
    }
    // The rows of a sum over them (item 14's loop for bf16): each sum rounded, in order.
    let rows = 2;
    let stacked: Vec<f32> = a.iter().chain(&b).copied().collect();
    let stacked = Tensor::from_slice(&stacked, (rows, n), &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap();
    let sums = stacked.sum_keepdim(0).unwrap().flatten_all().unwrap().to_vec1::<bf16>().unwrap();
    for (i, got) in sums.iter().enumerate() {
        let want = bf16::from_f32(bf16::from_f32(0.0 + wa[i]).to_f32() + wb[i]);
        let same = want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan());
        assert!(same, "sum over rows, column {i}: {:#06x}, not {:#06x}", got.to_bits(), want.to_bits());
    }
}

/// Patch item 14: candle's f16 additions, with a tensor, with one value per row (the scalar
/// loop) and down the rows of a sum over them, are bit for bit `half`'s `f16::from_f32(a + b)`:
/// ties, overflow to infinity, subnormals (which f16 keeps and f32's rounding to them must get
/// right), infinities and NaN, in rows longer than a vector and with a tail. And its dot product
/// (a direct convolution's rows) agrees with f32's within f16's rounding.
#[test]
fn f16_adds_round_as_half_does() {
    use half::f16;
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(14);
    let special = [
        0.0f32,
        -0.0,
        1.0,
        f32::from_bits(0x3F80_1000), // 1 + 2^-11: a tie between two f16 values, even below
        f32::from_bits(0x3F80_3000), // 1 + 3 * 2^-11: a tie, odd below: rounds up
        65_520.0,                    // rounds to infinity
        5.96e-8,                     // about f16's smallest subnormal
        3.0e-5,                      // a subnormal of f16
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ];
    // Values mostly in f16's range (its exponents and subnormals), some beyond it.
    let mut value = |i: usize| -> f32 {
        if i < special.len() {
            return special[i];
        }
        let sign = if rng.random::<bool>() { -1.0 } else { 1.0 };
        sign * 2f32.powf(rng.random_range(-26.0..17.0)) * rng.random_range(1.0..2.0)
    };
    let (rows, cols) = (3, 1_003);
    let a: Vec<f32> = (0..rows * cols).map(&mut value).collect();
    let b: Vec<f32> = (0..rows * cols).map(|i| if i % 5 == 0 { 0.0 } else { value(i + 100) }).collect();
    let per_row: Vec<f32> = (0..rows).map(|i| value(i + 20)).collect();
    let to = |v: &[f32], shape: (usize, usize)| {
        Tensor::from_slice(v, shape, &Device::Cpu).unwrap().to_dtype(DType::F16).unwrap()
    };
    let widen = |v: &[f32]| v.iter().map(|&x| f16::from_f32(x).to_f32()).collect::<Vec<f32>>();
    let (wa, wb, wr) = (widen(&a), widen(&b), widen(&per_row));
    let check = |got: Vec<f16>, other: &dyn Fn(usize) -> f32, what: &str| {
        for (i, g) in got.iter().enumerate() {
            let want = f16::from_f32(wa[i] + other(i));
            let same = want.to_bits() == g.to_bits() || (want.is_nan() && g.is_nan());
            assert!(
                same,
                "{what}, element {i}: {} + {} gave {:#06x}, not {:#06x}",
                wa[i],
                other(i),
                g.to_bits(),
                want.to_bits()
            );
        }
    };
    let sum = (to(&a, (rows, cols)) + to(&b, (rows, cols))).unwrap();
    check(sum.flatten_all().unwrap().to_vec1::<f16>().unwrap(), &|i| wb[i], "tensor + tensor");
    let sum = to(&a, (rows, cols)).broadcast_add(&to(&per_row, (rows, 1))).unwrap();
    check(sum.flatten_all().unwrap().to_vec1::<f16>().unwrap(), &|i| wr[i / cols], "tensor + a value per row");
    // A sum over the rows (a bias's gradient) adds whole rows in order, each sum rounded.
    let sums = to(&a, (rows, cols)).sum_keepdim(0).unwrap().flatten_all().unwrap().to_vec1::<f16>().unwrap();
    for (c, got) in sums.iter().enumerate() {
        let want = (0..rows).fold(f16::ZERO, |acc, r| f16::from_f32(acc.to_f32() + wa[r * cols + c]));
        let same = want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan());
        assert!(same, "sum over rows, column {c}: {:#06x}, not {:#06x}", got.to_bits(), want.to_bits());
    }

    // A direct convolution sums each output over 40 input channels (a vector loop and a tail).
    let x = Tensor::randn(0f32, 1.0, (1, 40, 6, 6), &Device::Cpu).unwrap();
    let w = Tensor::randn(0f32, 0.2, (3, 40, 3, 3), &Device::Cpu).unwrap();
    let half_x = x.to_dtype(DType::F16).unwrap();
    let half_w = w.to_dtype(DType::F16).unwrap();
    let got = half_x.conv2d(&half_w, 1, 1, 1, 1).unwrap().to_dtype(DType::F32).unwrap();
    let exact = half_x.to_dtype(DType::F32).unwrap().conv2d(&half_w.to_dtype(DType::F32).unwrap(), 1, 1, 1, 1).unwrap();
    let worst =
        (got - &exact).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    let scale = exact.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    assert!(worst <= scale * 2e-3, "f16 convolution {worst} from f32's (largest output {scale})");
}
