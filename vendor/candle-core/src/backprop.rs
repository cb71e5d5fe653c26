//! Methods for backpropagation of gradients.
use crate::op::{BinaryOp, Op, ReduceOp, UnaryOp};
use crate::{Error, Result, Tensor, TensorId};
use std::collections::{hash_map::Entry, HashMap};

// arg has been reduced to node via reduce_dims, expand it back to arg.
// This has to handle keepdims.
fn broadcast_back(arg: &Tensor, node: &Tensor, reduced_dims: &[usize]) -> Result<Tensor> {
    if arg.rank() == node.rank() {
        // keepdim = true
        node.broadcast_as(arg.shape())
    } else {
        // keepdim = false
        // first expand the reduced dims.
        node.reshape(reduced_dims)?.broadcast_as(arg.shape())
    }
}

thread_local! {
    static CANDLE_GRAD_DO_NOT_DETACH: bool = {
        match std::env::var("CANDLE_GRAD_DO_NOT_DETACH") {
            Ok(s) => {
                !s.is_empty() && s != "0"
            },
            Err(_) => false,
        }
    }
}

impl Tensor {
    /// Return all the nodes that lead to this value in a topologically sorted vec, the first
    /// elements having dependencies on the latter ones, e.g. the first element if any is the
    /// argument.
    /// This assumes that the op graph is a DAG.
    pub fn sorted_nodes(&self) -> Vec<&Tensor> {
        // The vec of sorted nodes is passed as an owned value rather than a mutable reference
        // to get around some lifetime limitations.
        fn walk<'a>(
            node: &'a Tensor,
            nodes: Vec<&'a Tensor>,
            already_seen: &mut HashMap<TensorId, bool>,
        ) -> (bool, Vec<&'a Tensor>) {
            if let Some(&tg) = already_seen.get(&node.id()) {
                return (tg, nodes);
            }
            let mut track_grad = false;
            let mut nodes = if node.is_variable() {
                // Do not call recursively on the "leaf" nodes.
                track_grad = true;
                nodes
            } else if node.dtype().is_int() {
                nodes
            } else if let Some(op) = node.op() {
                // STRATA PATCH: the operands are listed by `grad_inputs`, which the backward
                // pass's hook also uses (the same operands, in the same order, as before).
                grad_inputs(op).into_iter().fold(nodes, |nodes, arg| {
                    let (tg, nodes) = walk(arg, nodes, already_seen);
                    track_grad |= tg;
                    nodes
                })
            } else {
                nodes
            };
            already_seen.insert(node.id(), track_grad);
            if track_grad {
                nodes.push(node);
            }
            (track_grad, nodes)
        }
        let (_tg, mut nodes) = walk(self, vec![], &mut HashMap::new());
        nodes.reverse();
        nodes
    }

    pub fn backward(&self) -> Result<GradStore> {
        self.backward_inner(None, None)
    }

    /// STRATA PATCH: [`Tensor::backward`] with `grad` (of this tensor's shape) as this
    /// tensor's gradient in place of ones: the pass a [`BackwardFn`] runs over a sub-graph of
    /// its own, given its node's gradient.
    pub fn backward_from(&self, grad: &Tensor) -> Result<GradStore> {
        if grad.shape() != self.shape() {
            Err(Error::ShapeMismatchBinaryOp {
                lhs: self.shape().clone(),
                rhs: grad.shape().clone(),
                op: "backward_from",
            }
            .bt())?
        }
        self.backward_inner(Some(grad), None)
    }

    /// STRATA PATCH: [`Tensor::backward`], calling `on_final(variable, gradient)` once for every
    /// variable that gets a gradient, as soon as that gradient is final: right after the last
    /// node that uses the variable has been differentiated, while the rest of the pass goes
    /// on. Variables thus come in the order their gradients become ready, the reverse of their
    /// last use in the forward pass. The gradient handed over is the one the returned store
    /// holds, contiguous and in an allocation nothing else shares, and the pass never reads it
    /// again, so the callback may read it or change it in place (reduce it across replicas)
    /// while the pass computes the others. An error from the callback ends the pass with it.
    pub fn backward_with_hook(
        &self,
        on_final: &mut dyn FnMut(&Tensor, &Tensor) -> Result<()>,
    ) -> Result<GradStore> {
        struct FinalOnly<'a>(&'a mut dyn FnMut(&Tensor, &Tensor) -> Result<()>);
        impl GradHook for FinalOnly<'_> {
            fn on_final(&mut self, var: &Tensor, grad: &Tensor) -> Result<()> {
                (self.0)(var, grad)
            }
        }
        self.backward_inner(None, Some(&mut FinalOnly(on_final)))
    }

    /// STRATA PATCH: [`Tensor::backward_with_hook`] with a [`GradHook`], which may also take
    /// the gradients of weights used as `x.matmul(&w.t())` (candle-nn's `Linear` on a matrix)
    /// or `x.matmul(&w)` in blocks of rows, each as soon as it is computed (see
    /// [`GradHook::rows_per_block`]).
    pub fn backward_with_hooks(&self, hook: &mut dyn GradHook) -> Result<GradStore> {
        self.backward_inner(None, Some(hook))
    }

    fn backward_inner(
        &self,
        seed: Option<&Tensor>,
        mut on_final: Option<&mut dyn GradHook>,
    ) -> Result<GradStore> {
        let sorted_nodes = self.sorted_nodes();
        let mut grads = GradStore::new();
        match seed {
            Some(grad) => grads.insert(self, grad.detach()),
            None => grads.insert(self, self.ones_like()?.contiguous()?),
        };
        // STRATA PATCH: with a hook, `ready[i]` lists the variables whose last use is node `i`.
        let mut ready: Vec<Vec<&Tensor>> = Vec::new();
        let mut fired: std::collections::HashSet<TensorId> = std::collections::HashSet::new();
        // STRATA PATCH: the `w.t()` and `w.to_dtype(..)` nodes of weights whose gradient came in
        // blocks of rows (see `GradHook::rows_per_block`): the pass skips them.
        let mut unjoined: std::collections::HashSet<TensorId> = std::collections::HashSet::new();
        // STRATA PATCH: with a hook, how many nodes of the pass use each node.
        let mut used_by: HashMap<TensorId, usize> = HashMap::new();
        if on_final.is_some() {
            let mut last_use: HashMap<TensorId, (usize, &Tensor)> = HashMap::new();
            for (i, node) in sorted_nodes.iter().enumerate() {
                if let (false, Some(op)) = (node.is_variable(), node.op()) {
                    for arg in grad_inputs(op) {
                        *used_by.entry(arg.id()).or_default() += 1;
                        if arg.is_variable() {
                            last_use.insert(arg.id(), (i, arg));
                        }
                    }
                }
            }
            ready = vec![Vec::new(); sorted_nodes.len()];
            let mut uses: Vec<(usize, &Tensor)> = last_use.into_values().collect();
            // Several variables final at one node: in the order `sorted_nodes` lists them.
            let position: HashMap<TensorId, usize> =
                sorted_nodes.iter().enumerate().map(|(i, n)| (n.id(), i)).collect();
            uses.sort_by_key(|(i, v)| (*i, position.get(&v.id()).copied().unwrap_or(usize::MAX)));
            for (i, var) in uses {
                ready[i].push(var);
            }
        }
        for (index, node) in sorted_nodes.iter().enumerate() {
            if let Some(hook) = on_final.as_deref_mut() {
                // The variables the previous node was the last to use are final now.
                if let Some(vars) = index.checked_sub(1).map(|i| &ready[i]) {
                    for var in vars {
                        grads.hand_over(var, hook, &mut fired)?;
                    }
                }
            }
            if node.is_variable() {
                continue;
            }
            // STRATA PATCH: a transpose `w.t()` or cast `w.to_dtype(..)` whose weight's gradient
            // came in blocks of rows has no gradient, and nothing to pass on.
            if unjoined.contains(&node.id()) {
                continue;
            }
            let grad = grads
                .remove(node)
                .expect("candle internal error - grad not populated");
            // https://github.com/huggingface/candle/issues/1241
            // Ideally, we would make these operations in place where possible to ensure that we
            // do not have to allocate too often. Here we just call `.detach` to avoid computing
            // the backprop graph of the backprop itself. This would be an issue for second order
            // derivatives but these are out of scope at the moment.
            let do_not_detach = CANDLE_GRAD_DO_NOT_DETACH.with(|b| *b);
            let grad = if do_not_detach { grad } else { grad.detach() };
            if let Some(op) = node.op() {
                match op {
                    Op::Binary(lhs, rhs, BinaryOp::Add) => {
                        grads.accumulate(lhs, &grad)?;
                        grads.accumulate(rhs, &grad)?;
                    }
                    Op::Binary(lhs, rhs, BinaryOp::Sub) => {
                        grads.accumulate(lhs, &grad)?;
                        grads.accumulate(rhs, &grad.neg()?)?;
                    }
                    Op::Binary(lhs, rhs, BinaryOp::Mul) => {
                        let lhs_grad = grad.mul(rhs)?;
                        grads.accumulate(lhs, &lhs_grad)?;
                        let rhs_grad = grad.mul(lhs)?;
                        grads.accumulate(rhs, &rhs_grad)?;
                    }
                    Op::Binary(lhs, rhs, BinaryOp::Div) => {
                        let lhs_grad = grad.div(rhs)?;
                        grads.accumulate(lhs, &lhs_grad)?;
                        let rhs_grad = grad.mul(lhs)?.div(&rhs.sqr()?)?;
                        grads.accumulate(rhs, &rhs_grad.neg()?)?;
                    }
                    Op::Binary(lhs, rhs, BinaryOp::Minimum)
                    | Op::Binary(lhs, rhs, BinaryOp::Maximum) => {
                        let mask_lhs = node.eq(lhs)?.to_dtype(grad.dtype())?;
                        let mask_rhs = node.eq(rhs)?.to_dtype(grad.dtype())?;

                        // If both masks are 1 one the same point, we want to scale the
                        // gradient by 0.5 rather than 1.
                        let lhs_grad = mask_lhs.mul(&grad)?.div(&(&mask_rhs + 1.)?)?;
                        grads.accumulate(lhs, &lhs_grad)?;

                        let rhs_grad = mask_rhs.mul(&grad)?.div(&(&mask_lhs + 1.)?)?;
                        grads.accumulate(rhs, &rhs_grad)?;
                    }
                    Op::WhereCond(pred, t, f) => {
                        let zeros = grad.zeros_like()?;
                        let t_sum_grad = grads.or_insert(t)?;
                        let t_grad = pred.where_cond(&grad, &zeros)?;
                        *t_sum_grad = t_sum_grad.add(&t_grad)?;
                        let f_sum_grad = grads.or_insert(f)?;
                        let f_grad = pred.where_cond(&zeros, &grad)?;
                        *f_sum_grad = f_sum_grad.add(&f_grad)?;
                    }
                    Op::Conv1D {
                        arg,
                        kernel,
                        padding,
                        stride,
                        dilation,
                    } => {
                        // The output height for conv_transpose1d is:
                        // (l_in - 1) * stride - 2 * padding + dilation * (k_size - 1) + out_padding + 1
                        let grad_l_in = grad.dim(2)?;
                        let k_size = kernel.dim(2)?;
                        let out_size =
                            (grad_l_in - 1) * stride + dilation * (k_size - 1) + 1 - 2 * padding;
                        let out_padding = arg.dim(2)? - out_size;
                        let grad_arg = grad.conv_transpose1d(
                            kernel,
                            *padding,
                            out_padding,
                            *stride,
                            *dilation,
                            /* groups */ 1,
                        )?;
                        grads.accumulate(arg, &grad_arg)?;

                        let grad_kernel = arg
                            .transpose(0, 1)?
                            .conv1d(&grad.transpose(0, 1)?, *padding, *dilation, *stride, 1)?
                            .transpose(0, 1)?;
                        let sum_grad = grads.or_insert(kernel)?;
                        let (_, _, k0) = kernel.dims3()?;
                        let (_, _, g_k0) = grad_kernel.dims3()?;
                        let grad_kernel = if g_k0 != k0 {
                            grad_kernel.narrow(2, 0, k0)?
                        } else {
                            grad_kernel
                        };
                        *sum_grad = sum_grad.add(&grad_kernel)?;
                    }
                    Op::Conv2D {
                        arg,
                        kernel,
                        padding,
                        stride,
                        dilation,
                    } => {
                        // The output height for conv_transpose2d is:
                        // (i_h - 1) * stride - 2 * padding + dilation * (k_h - 1) + out_padding + 1
                        let grad_h = grad.dim(2)?;
                        let k_h = kernel.dim(2)?;
                        let out_size =
                            (grad_h - 1) * stride + dilation * (k_h - 1) + 1 - 2 * padding;
                        let out_padding = arg.dim(2)? - out_size;
                        let grad_arg = grad.conv_transpose2d(
                            kernel,
                            *padding,
                            out_padding,
                            *stride,
                            *dilation,
                        )?;
                        grads.accumulate(arg, &grad_arg)?;

                        let grad_kernel = arg
                            .transpose(0, 1)?
                            .conv2d(&grad.transpose(0, 1)?, *padding, *dilation, *stride, 1)?
                            .transpose(0, 1)?;
                        let sum_grad = grads.or_insert(kernel)?;
                        let (_, _, k0, k1) = kernel.dims4()?;
                        let (_, _, g_k0, g_k1) = grad_kernel.dims4()?;
                        let grad_kernel = if g_k0 != k0 || g_k1 != k1 {
                            grad_kernel.narrow(2, 0, k0)?.narrow(3, 0, k1)?
                        } else {
                            grad_kernel
                        };
                        *sum_grad = sum_grad.add(&grad_kernel)?;
                    }
                    Op::ConvTranspose1D { .. } => Err(Error::BackwardNotSupported {
                        op: "conv-transpose1d",
                    })?,
                    Op::ConvTranspose2D {
                        arg,
                        kernel,
                        padding,
                        stride,
                        dilation,
                        output_padding: _output_padding,
                    } => {
                        let grad_arg = grad.conv2d(kernel, *padding, *stride, *dilation, 1)?;
                        grads.accumulate(arg, &grad_arg)?;

                        let grad_kernel = grad
                            .transpose(0, 1)?
                            .conv2d(&arg.transpose(0, 1)?, *padding, *dilation, *stride, 1)?
                            .transpose(0, 1)?;
                        let sum_grad = grads.or_insert(kernel)?;
                        let (_, _, k0, k1) = kernel.dims4()?;
                        let (_, _, g_k0, g_k1) = grad_kernel.dims4()?;
                        let grad_kernel = if g_k0 != k0 || g_k1 != k1 {
                            grad_kernel.narrow(2, 0, k0)?.narrow(3, 0, k1)?
                        } else {
                            grad_kernel
                        };
                        *sum_grad = sum_grad.add(&grad_kernel)?;
                    }
                    Op::AvgPool2D {
                        arg,
                        kernel_size,
                        stride,
                    } => {
                        if kernel_size != stride {
                            crate::bail!("backward not supported for avgpool2d if ksize {kernel_size:?} != stride {stride:?}")
                        }
                        let (_n, _c, h, w) = arg.dims4()?;
                        let grad_arg = grad.upsample_nearest2d(h, w)?;
                        let grad_arg =
                            (grad_arg * (1f64 / (kernel_size.0 * kernel_size.1) as f64))?;
                        grads.accumulate(arg, &grad_arg)?;
                    }
                    Op::MaxPool2D {
                        arg,
                        kernel_size,
                        stride,
                    } => {
                        if kernel_size != stride {
                            crate::bail!("backward not supported for maxpool2d if ksize {kernel_size:?} != stride {stride:?}")
                        }
                        let (_n, _c, h, w) = arg.dims4()?;
                        // For computing the max-pool gradient, we compute a mask where a 1 means
                        // that the element is the maximum, then we apply this mask to the
                        // upsampled gradient (taking into account that multiple max may exist so
                        // we scale the gradient for this case).
                        let node_upsampled = node.upsample_nearest2d(h, w)?;
                        let mask = arg.eq(&node_upsampled)?.to_dtype(arg.dtype())?;
                        let avg = mask.avg_pool2d_with_stride(*kernel_size, *stride)?;
                        let grad_arg = ((grad * avg)?.upsample_nearest2d(h, w)? * mask)?;
                        grads.accumulate(arg, &grad_arg)?;
                    }
                    Op::UpsampleNearest1D { arg, target_size } => {
                        let (_n, c, size) = arg.dims3()?;
                        if target_size % size != 0 {
                            crate::bail!("backward not supported for non integer upscaling factors")
                        }
                        let scale = target_size / size;

                        let kernel = Tensor::ones((c, 1, scale), arg.dtype(), arg.device())?;
                        let conv_sum = grad.conv1d(&kernel, 0, scale, 1, c)?;
                        let sum_grad = grads.or_insert(arg)?;
                        *sum_grad = conv_sum;
                    }
                    Op::UpsampleNearest2D {
                        arg,
                        target_h,
                        target_w,
                    } => {
                        let (_n, c, h, w) = arg.dims4()?;
                        if target_h % h != 0 || target_w % w != 0 {
                            crate::bail!("backward not supported for non integer upscaling factors")
                        }
                        let scale_h = target_h / h;
                        let scale_w = target_w / w;

                        if scale_h != scale_w {
                            crate::bail!("backward not supported for non uniform upscaling factors")
                        };
                        let kernel =
                            Tensor::ones((c, 1, scale_h, scale_w), arg.dtype(), arg.device())?;
                        let conv_sum = grad.conv2d(&kernel, 0, scale_h, 1, c)?;
                        let sum_grad = grads.or_insert(arg)?;
                        *sum_grad = conv_sum;
                    }
                    Op::UpsampleBilinear2D { .. } => {
                        crate::bail!("backward not supported for upsample_bilinear2d")
                    }
                    Op::SliceScatter0(lhs, rhs, start_rhs) => {
                        let rhs_sum_grad = grads.or_insert(rhs)?;
                        let rhs_grad = grad.narrow(0, *start_rhs, rhs.dim(0)?)?;
                        *rhs_sum_grad = rhs_sum_grad.add(&rhs_grad)?;

                        let lhs_sum_grad = grads.or_insert(lhs)?;
                        let lhs_grad = grad.slice_scatter0(&rhs.zeros_like()?, *start_rhs)?;
                        *lhs_sum_grad = lhs_sum_grad.add(&lhs_grad)?
                    }
                    Op::Gather(arg, indexes, dim) => {
                        let sum_grad = grads.or_insert(arg)?;
                        *sum_grad = sum_grad.scatter_add(indexes, &grad, *dim)?;
                    }
                    Op::Scatter(init, indexes, src, dim) => {
                        grads.accumulate(init, &grad)?;

                        let src_grad = grad.gather(indexes, *dim)?;
                        grads.accumulate(src, &src_grad)?;
                    }
                    Op::ScatterAdd(init, indexes, src, dim) => {
                        let init_sum_grad = grads.or_insert(init)?;
                        let mask = init.ones_like()?;
                        let mask = mask.scatter(indexes, &mask.zeros_like()?, *dim)?;
                        *init_sum_grad = init_sum_grad.add(&grad.mul(&mask)?)?;

                        let src_grad = grad.gather(indexes, *dim)?;
                        grads.accumulate(src, &src_grad)?;
                    }
                    Op::IndexAdd(init, indexes, src, dim) => {
                        grads.accumulate(init, &grad)?;

                        let src_grad = grad.index_select(indexes, *dim)?;
                        grads.accumulate(src, &src_grad)?;
                    }
                    Op::IndexSelect(arg, indexes, dim) => {
                        let sum_grad = grads.or_insert(arg)?;
                        // index_select accepts strided ids but index_add requires contiguous ones.
                        let indexes = indexes.contiguous()?;
                        *sum_grad = sum_grad.index_add(&indexes, &grad, *dim)?;
                    }
                    Op::Matmul(lhs, rhs) => {
                        // Skipping checks, the op went ok, we can skip
                        // the matmul size checks for now.

                        // STRATA PATCH: an operand that is a transposed contiguous matrix (a
                        // `w.t()`, as candle-nn's Linear passes its weight) gets its gradient
                        // computed transposed, `(rhs grad^T)^T` and `(grad^T lhs)^T`: the same
                        // products, but the result is a transposed view of a contiguous tensor,
                        // so the transpose's own backward hands the variable a contiguous
                        // gradient with no strided copy (one of a 2048 x 2048 weight cost 8x
                        // its matmul here).
                        // STRATA PATCH: a weight `w` whose only use is this product, as
                        // `x.matmul(&w.t())` or `x.matmul(&w)` of matrices, may have its gradient
                        // computed, and handed to the hook, in blocks of rows (`grad^T x` or
                        // `x^T grad`, rows `r..r + n` at a time), which it may reduce while the
                        // next are computed. The product of each element is the one the whole
                        // matmul computes; the blocks are then joined.
                        // STRATA PATCH: the weight may also come through one cast of its
                        // type under the transpose (`x.matmul(&w.to_dtype(t).t())`,
                        // `x.matmul(&w.to_dtype(t))`: mixed precision's autocast); each block,
                        // computed in the product's type, is then cast to the weight's, as
                        // the cast's own backward casts the whole.
                        let row_weight = match on_final.as_deref_mut() {
                            Some(hook) if lhs.rank() == 2 => {
                                let once = |t: &Tensor| used_by.get(&t.id()) == Some(&1);
                                let (transposed, below) = match rhs.op() {
                                    Some(Op::Transpose(t, 0, 1) | Op::Transpose(t, 1, 0))
                                        if is_transposed_contiguous(rhs) && once(rhs) =>
                                    {
                                        (true, t)
                                    }
                                    _ => (false, rhs),
                                };
                                let (w, cast) = match below.op() {
                                    Some(Op::ToDType(w)) if once(below) => (w, true),
                                    _ => (below, false),
                                };
                                let rows = w.dims().first().copied().unwrap_or(0);
                                if w.is_variable() && w.rank() == 2 && once(w) {
                                    // The nodes between the product and the weight, which the
                                    // pass then skips: the weight's gradient is the blocks'.
                                    let between = [transposed.then_some(rhs), cast.then_some(below)];
                                    hook.rows_per_block(w)
                                        .filter(|&n| n > 0 && n < rows)
                                        .map(|n| (hook, w, transposed, between, rows, n))
                                } else {
                                    None
                                }
                            }
                            _ => None,
                        };
                        let lhs_grad = |grads: &mut GradStore| -> Result<()> {
                            let lhs_grad = if is_transposed_contiguous(lhs) {
                                rhs.matmul(&grad.t()?)?.t()?
                            } else {
                                grad.matmul(&rhs.t()?)?
                            };
                            grads.accumulate(lhs, &lhs_grad)
                        };
                        if let Some((hook, w, transposed, between, rows, n)) = row_weight {
                            // The weight's blocks first, so that they are handed over as early
                            // in the pass as they can be; then the input's gradient.
                            let (a, b) = if transposed { (grad.t()?, lhs) } else { (lhs.t()?, &grad) };
                            // STRATA PATCH: a hook that keeps what it needs of each block
                            // (`GradHook::joins_rows` false) has them never joined: the weight
                            // then has no gradient in the store.
                            let join = hook.joins_rows(w);
                            let mut blocks = Vec::with_capacity(if join { rows.div_ceil(n) } else { 0 });
                            for first in (0..rows).step_by(n) {
                                // A block of one row is cut from the product of two: gemm
                                // computes a one-row product by another path, whose f16 sums
                                // round otherwise than the whole's.
                                let len = n.min(rows - first);
                                let block = if len == 1 {
                                    let start = first.saturating_sub(1);
                                    a.narrow(0, start, 2)?.matmul(b)?.narrow(0, first - start, 1)?.force_contiguous()?
                                } else {
                                    a.narrow(0, first, len)?.matmul(b)?
                                };
                                let block = block.to_dtype(w.dtype())?;
                                hook.on_rows(w, first, &block)?;
                                if join {
                                    blocks.push(block);
                                }
                            }
                            if join {
                                grads.accumulate(w, &Tensor::cat(&blocks, 0)?)?;
                            }
                            unjoined.extend(between.into_iter().flatten().map(|t| t.id()));
                            lhs_grad(&mut grads)?;
                        } else {
                            lhs_grad(&mut grads)?;
                            let rhs_grad = if is_transposed_contiguous(rhs) {
                                grad.t()?.matmul(lhs)?.t()?
                            } else {
                                lhs.t()?.matmul(&grad)?
                            };
                            grads.accumulate(rhs, &rhs_grad)?;
                        }
                    }
                    Op::Cat(args, dim) => {
                        let mut start_idx = 0;
                        for arg in args {
                            let len = arg.dims()[*dim];
                            let arg_grad = grad.narrow(*dim, start_idx, len)?;
                            grads.accumulate(arg, &arg_grad)?;
                            start_idx += len;
                        }
                    }
                    Op::Broadcast(arg) => {
                        let arg_dims = arg.dims();
                        let node_dims = node.dims();
                        // The number of dims that have been inserted on the left.
                        let left_dims = node_dims.len() - arg_dims.len();
                        let mut sum_dims: Vec<usize> = (0..left_dims).collect();
                        for (dim, (node_dim, arg_dim)) in node_dims[left_dims..]
                            .iter()
                            .zip(arg_dims.iter())
                            .enumerate()
                        {
                            if node_dim != arg_dim {
                                sum_dims.push(dim + left_dims)
                            }
                        }

                        let mut arg_grad = grad.sum_keepdim(sum_dims.as_slice())?;
                        for _i in 0..left_dims {
                            arg_grad = arg_grad.squeeze(0)?
                        }
                        grads.accumulate(arg, &arg_grad.broadcast_as(arg.dims())?)?;
                    }
                    Op::Reduce(arg, ReduceOp::Sum, reduced_dims) => {
                        let grad = broadcast_back(arg, &grad, reduced_dims)?;
                        grads.accumulate(arg, &grad)?;
                    }
                    Op::Reduce(arg, ReduceOp::Max, reduced_dims) => {
                        let node = broadcast_back(arg, node, reduced_dims)?;
                        let grad = broadcast_back(arg, &grad, reduced_dims)?;
                        let grad = node.eq(arg)?.to_dtype(grad.dtype())?.mul(&grad)?;
                        grads.accumulate(arg, &grad.broadcast_as(arg.dims())?)?;
                    }
                    Op::Reduce(arg, ReduceOp::Min, reduced_dims) => {
                        let node = broadcast_back(arg, node, reduced_dims)?;
                        let grad = broadcast_back(arg, &grad, reduced_dims)?;
                        let grad = node.eq(arg)?.to_dtype(grad.dtype())?.mul(&grad)?;
                        grads.accumulate(arg, &grad.broadcast_as(arg.dims())?)?;
                    }
                    Op::ToDType(arg) => {
                        grads.accumulate(arg, &grad.to_dtype(arg.dtype())?)?
                    }
                    Op::Copy(arg) => {
                        grads.accumulate(arg, &grad)?
                    }
                    Op::Affine { arg, mul, .. } => {
                        let arg_grad = grad.affine(*mul, 0.)?;
                        grads.accumulate(arg, &arg_grad)?
                    }
                    Op::Unary(arg, UnaryOp::Log) => {
                        grads.accumulate(arg, &(grad / arg)?)?
                    }
                    Op::Unary(arg, UnaryOp::Sin) => {
                        grads.accumulate(arg, &(&grad * arg.cos())?)?
                    }
                    Op::Unary(arg, UnaryOp::Cos) => {
                        let sum_grad = grads.or_insert(arg)?;
                        *sum_grad = sum_grad.sub(&(&grad * arg.sin())?)?
                    }
                    Op::Unary(arg, UnaryOp::Tanh) => {
                        let sum_grad = grads.or_insert(arg)?;
                        let minus_dtanh = (node.sqr()? - 1.)?;
                        *sum_grad = sum_grad.sub(&(&grad * &minus_dtanh)?)?
                    }
                    Op::Unary(arg, UnaryOp::Abs) => {
                        let sum_grad = grads.or_insert(arg)?;
                        let ones = arg.ones_like()?;
                        let abs_grad = arg.ge(&arg.zeros_like()?)?.where_cond(&ones, &ones.neg()?);
                        *sum_grad = sum_grad.add(&(&grad * abs_grad)?)?
                    }
                    Op::Unary(arg, UnaryOp::Exp) => {
                        grads.accumulate(arg, &(&grad * *node)?)?
                    }
                    Op::Unary(arg, UnaryOp::Neg) => {
                        grads.accumulate(arg, &grad.neg()?)?
                    }
                    Op::Unary(arg, UnaryOp::Recip) => {
                        let sum_grad = grads.or_insert(arg)?;
                        let grad = (grad / arg.sqr()?)?;
                        *sum_grad = sum_grad.sub(&grad)?
                    }
                    &Op::Narrow(ref arg, dim, start_idx, len) => {
                        let arg_dims = arg.dims();
                        let left_pad = if start_idx == 0 {
                            None
                        } else {
                            let mut dims = arg_dims.to_vec();
                            dims[dim] = start_idx;
                            Some(Tensor::zeros(dims, grad.dtype(), grad.device())?)
                        };
                        let right_pad = arg_dims[dim] - start_idx - len;
                        let right_pad = if right_pad == 0 {
                            None
                        } else {
                            let mut dims = arg_dims.to_vec();
                            dims[dim] = right_pad;
                            Some(Tensor::zeros(dims, grad.dtype(), grad.device())?)
                        };
                        let arg_grad = match (left_pad, right_pad) {
                            (None, None) => grad,
                            (Some(l), None) => Tensor::cat(&[&l, &grad], dim)?,
                            (None, Some(r)) => Tensor::cat(&[&grad, &r], dim)?,
                            (Some(l), Some(r)) => Tensor::cat(&[&l, &grad, &r], dim)?,
                        };
                        grads.accumulate(arg, &arg_grad)?
                    }
                    Op::Unary(_, UnaryOp::Floor)
                    | Op::Unary(_, UnaryOp::Round)
                    | Op::Reduce(_, ReduceOp::ArgMin, _)
                    | Op::Reduce(_, ReduceOp::ArgMax, _)
                    | Op::Unary(_, UnaryOp::Sign)
                    | Op::Cmp(_, _) => {}
                    Op::Reshape(arg) => {
                        let arg_grad = grad.reshape(arg.dims())?;
                        grads.accumulate(arg, &arg_grad)?
                    }
                    Op::Unary(_, UnaryOp::Ceil) => Err(Error::BackwardNotSupported { op: "ceil" })?,
                    Op::Unary(arg, UnaryOp::Gelu) => {
                        let sum_grad = grads.or_insert(arg)?;
                        let cube = arg.powf(3.)?;
                        let tanh = (0.0356774 * &cube + (0.797885 * arg)?)?.tanh()?;
                        let gelu_grad = (((0.5 * &tanh)?
                            + (0.0535161 * cube + (0.398942 * arg)?)? * (1. - tanh.powf(2.)?))?
                            + 0.5)?;
                        *sum_grad = sum_grad.add(&(&grad * gelu_grad)?)?
                    }
                    Op::Unary(arg, UnaryOp::Erf) => {
                        let sum_grad = grads.or_insert(arg)?;
                        // d/dx erf(x) = 2/sqrt(pi) * e^(-x^2)
                        let erf_grad =
                            (2. / std::f64::consts::PI.sqrt()) * (arg.sqr()?.neg()?).exp()?;
                        *sum_grad = sum_grad.add(&(&grad * erf_grad)?)?
                    }
                    Op::Unary(arg, UnaryOp::GeluErf) => {
                        let sum_grad = grads.or_insert(arg)?;
                        // d/dx gelu_erf(x) = 0.5 + 0.398942 e^(-x^2/2) x + 0.5 erf(x/sqrt(2))
                        let neg_half_square = (arg.sqr()?.neg()? / 2.)?;
                        let scaled_exp_arg = (0.398942 * neg_half_square.exp()? * arg)?;
                        let arg_scaled_sqrt = (arg / 2f64.sqrt())?;
                        let erf_scaled_sqrt = (0.5 * arg_scaled_sqrt.erf()?)?;
                        let gelu_erf_grad = (0.5 + scaled_exp_arg + erf_scaled_sqrt)?;
                        *sum_grad = sum_grad.add(&(&grad * gelu_erf_grad)?)?;
                    }
                    Op::Unary(arg, UnaryOp::Relu) => {
                        let relu_grad = arg.ge(&arg.zeros_like()?)?.to_dtype(arg.dtype())?;
                        grads.accumulate(arg, &(&grad * relu_grad)?)?
                    }
                    Op::Unary(arg, UnaryOp::Silu) => {
                        let sum_grad = grads.or_insert(arg)?;
                        // d/dx silu = sigmoid(x) * (1 + x * (1 - sigmoid(x))) = sigmoid(x) * (1 - node) + node
                        let sigmoid_arg = (arg.neg()?.exp()? + 1.)?.recip()?;
                        let silu_grad = &sigmoid_arg * (1. - *node) + *node;
                        *sum_grad = sum_grad.add(&(&grad * silu_grad)?)?
                    }
                    Op::Elu(arg, alpha) => {
                        // d/dx elu(x) = 1 for x > 0, alpha * e^x for x <= 0
                        let sum_grad = grads.or_insert(arg)?;
                        let zeros = arg.zeros_like()?;
                        let positive_mask = arg.gt(&zeros)?.to_dtype(arg.dtype())?;
                        let negative_mask = arg.le(&zeros)?.to_dtype(arg.dtype())?;
                        // node == alpha * (e^x - 1) for x <= 0, reuse it
                        let negative_exp_mask = (negative_mask * (*node + *alpha))?;
                        let combined_mask = (positive_mask + negative_exp_mask)?;
                        *sum_grad = sum_grad.add(&(grad * combined_mask)?)?
                    }
                    Op::Powf(arg, e) => {
                        let arg_grad = (&(grad * arg.powf(e - 1.)?)? * *e)?;
                        grads.accumulate(arg, &arg_grad)?
                    }
                    Op::CustomOp1(arg, c) => {
                        if let Some(arg_grad) = c.bwd(arg, node, &grad)? {
                            grads.accumulate(arg, &arg_grad)?
                        }
                    }
                    Op::CustomOp2(arg1, arg2, c) => {
                        let (arg_grad1, arg_grad2) = c.bwd(arg1, arg2, node, &grad)?;
                        if let Some(arg_grad1) = arg_grad1 {
                            grads.accumulate(arg1, &arg_grad1)?
                        }
                        if let Some(arg_grad2) = arg_grad2 {
                            grads.accumulate(arg2, &arg_grad2)?
                        }
                    }
                    Op::CustomOp3(arg1, arg2, arg3, c) => {
                        let (arg_grad1, arg_grad2, arg_grad3) =
                            c.bwd(arg1, arg2, arg3, node, &grad)?;
                        if let Some(arg_grad1) = arg_grad1 {
                            grads.accumulate(arg1, &arg_grad1)?
                        }
                        if let Some(arg_grad2) = arg_grad2 {
                            grads.accumulate(arg2, &arg_grad2)?
                        }
                        if let Some(arg_grad3) = arg_grad3 {
                            grads.accumulate(arg3, &arg_grad3)?
                        }
                    }
                    Op::Backward(args, f) => {
                        let arg_grads = f.backward(args, node, &grad)?;
                        if arg_grads.len() != args.len() {
                            crate::bail!(
                                "a backward function gave {} gradients for {} operands",
                                arg_grads.len(),
                                args.len()
                            )
                        }
                        for (arg, arg_grad) in args.iter().zip(arg_grads) {
                            if let Some(arg_grad) = arg_grad {
                                grads.accumulate(arg, &arg_grad)?
                            }
                        }
                    }
                    Op::Unary(arg, UnaryOp::Sqr) => {
                        let arg_grad = arg.mul(&grad)?.affine(2., 0.)?;
                        grads.accumulate(arg, &arg_grad)?
                    }
                    Op::Unary(arg, UnaryOp::Sqrt) => {
                        let arg_grad = grad.div(node)?.affine(0.5, 0.)?;
                        grads.accumulate(arg, &arg_grad)?
                    }
                    Op::ToDevice(arg) => {
                        let sum_grad = grads.or_insert(arg)?;
                        let arg_grad = grad.to_device(sum_grad.device())?;
                        *sum_grad = sum_grad.add(&arg_grad)?
                    }
                    Op::Transpose(arg, dim1, dim2) => {
                        let arg_grad = grad.transpose(*dim1, *dim2)?;
                        grads.accumulate(arg, &arg_grad)?
                    }
                    Op::Permute(arg, dims) => {
                        let mut inv_dims = vec![0; dims.len()];
                        for (i, &dim_idx) in dims.iter().enumerate() {
                            inv_dims[dim_idx] = i
                        }
                        let arg_grad = grad.permute(inv_dims)?;
                        grads.accumulate(arg, &arg_grad)?
                    }
                };
            }
        }
        // STRATA PATCH: `accumulate` stores a first contribution as it is, so two variables'
        // gradients may share an allocation (`a + b` of two variables hands both the same
        // tensor), or share one with a tensor the caller holds. Callers may update a variable's
        // gradient in place (an all-reduce writing its sum back), so each variable's gradient
        // gets an allocation of its own here, contiguous as upstream's sums were, copied only
        // where it is shared or strided.
        for node in sorted_nodes.iter() {
            if !node.is_variable() || fired.contains(&node.id()) {
                continue;
            }
            if let Some(g) = grads.0.get_mut(&node.id()) {
                if !g.is_contiguous() || !g.is_exclusively_owned() || g.same_storage(node) {
                    *g = g.force_contiguous()?;
                }
            }
        }
        // STRATA PATCH: with a hook, the variables not yet handed over (those the last node
        // used, and the root itself when it is a variable), in the order of `sorted_nodes`.
        if let Some(hook) = on_final.as_deref_mut() {
            for node in sorted_nodes.iter() {
                if node.is_variable() && !fired.contains(&node.id()) {
                    grads.hand_over(node, hook, &mut fired)?;
                }
            }
        }
        Ok(grads)
    }
}

/// STRATA PATCH: the gradients of a node made by [`Tensor::with_backward`].
pub trait BackwardFn: Send + Sync {
    /// The gradient of each of `operands` (in their order; `None` for one that gets none)
    /// given `grad`, the gradient of `node` (the value [`Tensor::with_backward`] returned).
    fn backward(
        &self,
        operands: &[Tensor],
        node: &Tensor,
        grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>>;
}

/// STRATA PATCH: what [`Tensor::backward_with_hooks`] calls as the pass goes on.
pub trait GradHook {
    /// A variable's gradient is final (see [`Tensor::backward_with_hook`]).
    fn on_final(&mut self, var: &Tensor, grad: &Tensor) -> Result<()>;

    /// Asked for a matrix variable `var` whose only use is `x.matmul(&var.t())` or
    /// `x.matmul(&var)` with `x` a matrix, either through one cast `var.to_dtype(..)` under the
    /// transpose, when the pass reaches that product: `Some(n)` (`0 < n <` rows) has its gradient
    /// computed in blocks of `n` rows (each cast to `var`'s type), each handed to
    /// [`GradHook::on_rows`] as soon as it is computed. `None`, the default, computes it whole.
    fn rows_per_block(&mut self, var: &Tensor) -> Option<usize> {
        let _ = var;
        None
    }

    /// Rows `first..first + block.dim(0)` of `var`'s gradient, final, contiguous and in an
    /// allocation of their own, which the pass reads once more, after the last block, to join
    /// them into the whole gradient (then handed to [`GradHook::on_final`]): the hook may read
    /// a block, and keep it, but must not change it.
    fn on_rows(&mut self, var: &Tensor, first: usize, block: &Tensor) -> Result<()> {
        let _ = (var, first, block);
        Ok(())
    }

    /// Whether the blocks of `var`'s gradient handed to [`GradHook::on_rows`] are joined into
    /// its whole gradient afterwards. `false` leaves the store without a gradient for `var`
    /// (and [`GradHook::on_final`] is not called for it): the hook has kept what it needs of
    /// each block. The default is `true`.
    fn joins_rows(&mut self, var: &Tensor) -> bool {
        let _ = var;
        true
    }

    /// Whether the hook takes `var`'s final gradient for its own: the store then drops its
    /// handle once [`GradHook::on_final`] returns, and the store the pass returns has no
    /// gradient for `var`. The default is `false`.
    fn takes(&mut self, var: &Tensor) -> bool {
        let _ = var;
        false
    }
}

/// STRATA PATCH: the operands of `op` that a gradient flows to, in the order `sorted_nodes`
/// walks them: none through rounding, sign, argmin/argmax, an affine map that multiplies by
/// zero or a cast from an integer type.
fn grad_inputs(op: &Op) -> Vec<&Tensor> {
    match op {
        Op::IndexAdd(t1, t2, t3, _)
        | Op::Scatter(t1, t2, t3, _)
        | Op::ScatterAdd(t1, t2, t3, _)
        | Op::CustomOp3(t1, t2, t3, _)
        | Op::WhereCond(t1, t2, t3) => vec![t1, t2, t3],
        Op::Conv1D { arg: lhs, kernel: rhs, .. }
        | Op::ConvTranspose1D { arg: lhs, kernel: rhs, .. }
        | Op::Conv2D { arg: lhs, kernel: rhs, .. }
        | Op::ConvTranspose2D { arg: lhs, kernel: rhs, .. }
        | Op::CustomOp2(lhs, rhs, _)
        | Op::Binary(lhs, rhs, _)
        | Op::Gather(lhs, rhs, _)
        | Op::IndexSelect(lhs, rhs, _)
        | Op::Matmul(lhs, rhs)
        | Op::SliceScatter0(lhs, rhs, _) => vec![lhs, rhs],
        Op::Cat(args, _) | Op::Backward(args, _) => args.iter().collect(),
        Op::Affine { arg, mul, .. } => {
            if *mul == 0. {
                vec![]
            } else {
                vec![arg]
            }
        }
        Op::Unary(_node, UnaryOp::Ceil)
        | Op::Unary(_node, UnaryOp::Floor)
        | Op::Unary(_node, UnaryOp::Round)
        | Op::Unary(_node, UnaryOp::Sign) => vec![],
        Op::Reshape(node)
        | Op::UpsampleNearest1D { arg: node, .. }
        | Op::UpsampleNearest2D { arg: node, .. }
        | Op::UpsampleBilinear2D { arg: node, .. }
        | Op::AvgPool2D { arg: node, .. }
        | Op::MaxPool2D { arg: node, .. }
        | Op::Copy(node)
        | Op::Broadcast(node)
        | Op::Cmp(node, _)
        | Op::Reduce(node, ReduceOp::Min | ReduceOp::Sum | ReduceOp::Max, _)
        | Op::ToDevice(node)
        | Op::Transpose(node, _, _)
        | Op::Permute(node, _)
        | Op::Narrow(node, _, _, _)
        | Op::Unary(node, _)
        | Op::Elu(node, _)
        | Op::Powf(node, _)
        | Op::CustomOp1(node, _) => vec![node],
        Op::ToDType(node) => {
            if node.dtype().is_float() {
                vec![node]
            } else {
                vec![]
            }
        }
        Op::Reduce(_, ReduceOp::ArgMin | ReduceOp::ArgMax, _) => vec![],
    }
}

/// STRATA PATCH: whether `t` is a contiguous tensor with its last two dimensions swapped (`w.t()`
/// of a contiguous `w`), and not contiguous itself.
fn is_transposed_contiguous(t: &Tensor) -> bool {
    t.rank() >= 2 && !t.is_contiguous() && t.layout().transpose(t.rank() - 2, t.rank() - 1).is_ok_and(|l| l.is_contiguous())
}

/// A store for gradients, associating a tensor id to the corresponding gradient tensor, used for back propagation.
#[derive(Default, Debug)]
pub struct GradStore(HashMap<TensorId, Tensor>);

impl GradStore {
    /// Create a new gradient store
    fn new() -> Self {
        Self::default()
    }

    /// Get the gradient tensor corresponding to the given tensor id
    pub fn get_id(&self, id: TensorId) -> Option<&Tensor> {
        self.0.get(&id)
    }

    /// Get the gradient tensor associated with the given tensor
    pub fn get(&self, tensor: &Tensor) -> Option<&Tensor> {
        self.0.get(&tensor.id())
    }

    /// Remove the gradient tensor associated with the given tensor, returning it if it exists
    pub fn remove(&mut self, tensor: &Tensor) -> Option<Tensor> {
        self.0.remove(&tensor.id())
    }

    /// Insert a gradient tensor associated with the given tensor, returning the previous gradient tensor if it existed
    pub fn insert(&mut self, tensor: &Tensor, grad: Tensor) -> Option<Tensor> {
        self.0.insert(tensor.id(), grad)
    }

    /// Insert a gradient tensor associated with the given tensor id, returning the previous gradient tensor if it existed
    pub fn insert_id(&mut self, id: TensorId, grad: Tensor) -> Option<Tensor> {
        self.0.insert(id, grad)
    }

    /// STRATA PATCH: adds `grad` to the gradient of `tensor`. The first contribution is stored
    /// as it is (made contiguous unless it is contiguous or a transposed contiguous matrix,
    /// which copies only other strided views), with no zero tensor and no add: candle's
    /// `or_insert` then `add` cost a zeroed allocation and a pass over it for every node of
    /// the graph. Later ones are summed into a new tensor, as before. A first contribution
    /// whose shape, dtype or device differs from `tensor`'s takes the original path, so it
    /// fails as `add` did.
    fn accumulate(&mut self, tensor: &Tensor, grad: &Tensor) -> Result<()> {
        match self.0.entry(tensor.id()) {
            Entry::Occupied(mut entry) => {
                let sum = entry.get().add(grad)?;
                *entry.get_mut() = sum;
            }
            Entry::Vacant(entry) => {
                if grad.shape() == tensor.shape()
                    && grad.dtype() == tensor.dtype()
                    && grad.device().same_device(tensor.device())
                {
                    // Contiguous, as the sum was, or a transposed contiguous matrix (a
                    // matmul's gradient for a `w.t()`, which the transpose's backward turns
                    // back): the ops that consume it expect no other layout.
                    if grad.is_contiguous() || is_transposed_contiguous(grad) {
                        entry.insert(grad.clone());
                    } else {
                        entry.insert(grad.contiguous()?);
                    }
                } else {
                    entry.insert(tensor.zeros_like()?.add(grad)?);
                }
            }
        }
        Ok(())
    }

    /// STRATA PATCH: hands the final gradient of variable `var`, if it has one, to `hook`,
    /// after making it contiguous and the only handle to its allocation (the end of
    /// `backward` then leaves it as it is), and records that it was handed over.
    fn hand_over(
        &mut self,
        var: &Tensor,
        hook: &mut dyn GradHook,
        fired: &mut std::collections::HashSet<TensorId>,
    ) -> Result<()> {
        if let Some(g) = self.0.get_mut(&var.id()) {
            if !g.is_contiguous() || !g.is_exclusively_owned() || g.same_storage(var) {
                *g = g.force_contiguous()?;
            }
            fired.insert(var.id());
            hook.on_final(var, g)?;
            if hook.takes(var) {
                self.0.remove(&var.id());
            }
        }
        Ok(())
    }

    /// Get the gradient tensor associated with the given tensor, or, if it does not exist,
    /// insert a tensor of zeroes, with the same shape and type as the given tensors and return it
    fn or_insert(&mut self, tensor: &Tensor) -> Result<&mut Tensor> {
        let grad = match self.0.entry(tensor.id()) {
            Entry::Occupied(entry) => entry.into_mut(),
            Entry::Vacant(entry) => {
                let grad = tensor.zeros_like()?;
                entry.insert(grad)
            }
        };
        Ok(grad)
    }

    /// Extend this gradient store with the contents of another.
    /// If an entry is already occupied, updates and ensures new tensor follows correct detach semantics.
    /// Otherwise simply inserts.
    pub fn extend(&mut self, other: Self) -> Result<()> {
        for (id, grad) in other.0 {
            match self.0.entry(id) {
                Entry::Occupied(mut entry) => {
                    let new_grad = entry.get().add(&grad)?;

                    let do_not_detach = CANDLE_GRAD_DO_NOT_DETACH.with(|b| *b);
                    let new_grad = if do_not_detach {
                        new_grad
                    } else {
                        new_grad.detach()
                    };

                    *entry.get_mut() = new_grad;
                }
                Entry::Vacant(entry) => {
                    entry.insert(grad);
                }
            }
        }
        Ok(())
    }

    /// Get the tensor ids of the stored gradient tensors
    pub fn get_ids(&self) -> impl Iterator<Item = &TensorId> {
        self.0.keys()
    }
}
