//! A convolutional network's step on the CPU: 2-D convolution with bias, and max pooling (with
//! the ReLU before it folded in), forward and backward.
//!
//! candle's CPU convolution is im2col and a matrix product forward, but its backward pass is a
//! direct `conv_transpose2d` loop for the input's gradient, a second convolution for the
//! weight's, and the bias's gradient a strided sum that walks every element with a division per
//! axis; its max pooling's backward is six passes (upsampling, a mask, an average pool). On the
//! digits CNN those took most of a step. Here the convolution is im2col and one matrix product
//! forward (candle's matmul), and backward one product for the weight, one
//! for the columns and col2im for the input, the bias summed in the same pass that lays out the
//! output's gradient; pooling is one pass each way.
//!
//! Gradients: the convolution's are the exact ones (tested against candle's composed operations
//! within 1e-5). Max pooling splits a window's gradient evenly among its largest elements (one,
//! almost always; PyTorch and TensorFlow pick the first). Ties are not rare: a convolution over
//! the digits' blank background gives equal values across whole windows, and the even split is
//! what a composed fallback on other devices can compute, so a GPU step equals the CPU's.
//! candle 0.11's `max_pool2d` backward scales it by the fraction of the window that holds
//! the maximum (a quarter for a unique maximum in a 2x2 window), so its gradients below a pooling
//! layer are 1/k^2 of the true ones; a test here pins that down.

use candle_core::{CpuStorage, CustomOp1, CustomOp3, Device, Layout, Result, Shape, Storage, Tensor};
use candle_nn::Conv2dConfig;

use super::{f32_only as f32s, fusable};

/// The shapes of one convolution (NCHW input, OIHW weight, groups 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Geometry {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    o: usize,
    kh: usize,
    kw: usize,
    padding: usize,
    stride: usize,
    dilation: usize,
    oh: usize,
    ow: usize,
}

impl Geometry {
    fn new(x: &Shape, w: &Shape, cfg: &Conv2dConfig) -> Result<Self> {
        let (n, c, h, wd) = x.dims4()?;
        let (o, c2, kh, kw) = w.dims4()?;
        if c != c2 {
            candle_core::bail!("strata conv2d: the input has {c} channels, the weight expects {c2}");
        }
        if cfg.stride == 0 || cfg.dilation == 0 {
            candle_core::bail!("strata conv2d: stride and dilation must be 1 or more");
        }
        let span_h = cfg.dilation * (kh - 1) + 1;
        let span_w = cfg.dilation * (kw - 1) + 1;
        if h + 2 * cfg.padding < span_h || wd + 2 * cfg.padding < span_w {
            candle_core::bail!("strata conv2d: a {kh}x{kw} kernel does not fit a padded {h}x{wd} input");
        }
        Ok(Self {
            n,
            c,
            h,
            w: wd,
            o,
            kh,
            kw,
            padding: cfg.padding,
            stride: cfg.stride,
            dilation: cfg.dilation,
            oh: (h + 2 * cfg.padding - span_h) / cfg.stride + 1,
            ow: (wd + 2 * cfg.padding - span_w) / cfg.stride + 1,
        })
    }

    /// Output positions per image.
    fn p(&self) -> usize {
        self.oh * self.ow
    }

    /// Column length: input channels times kernel positions (the weight's row).
    fn k(&self) -> usize {
        self.c * self.kh * self.kw
    }

    /// The output positions `[lo, hi)` along one axis (input length `len`, `out` outputs) whose
    /// input, at kernel offset `offset` (kernel index times dilation), is inside the input.
    fn inside(&self, len: usize, out: usize, offset: usize) -> (usize, usize) {
        let (s, pad) = (self.stride, self.padding);
        // o * s + offset - pad >= 0, and < len.
        let lo = if pad > offset { (pad - offset).div_ceil(s) } else { 0 }.min(out);
        let hi = if len + pad > offset { (len + pad - offset).div_ceil(s) } else { 0 }.clamp(lo, out);
        (lo, hi)
    }

    /// Calls `f(column row, image, output row oy, input row y, [ox_lo, ox_hi), first input x)`
    /// for every run of output positions of one output row that reads inside the input: the
    /// one loop nest of im2col and col2im.
    fn runs(&self, mut f: impl FnMut(usize, usize, usize, usize, (usize, usize), usize)) {
        for c in 0..self.c {
            for ky in 0..self.kh {
                let (ylo, yhi) = self.inside(self.h, self.oh, ky * self.dilation);
                for kx in 0..self.kw {
                    let (xlo, xhi) = self.inside(self.w, self.ow, kx * self.dilation);
                    let row = (c * self.kh + ky) * self.kw + kx;
                    for img in 0..self.n {
                        for oy in ylo..yhi {
                            let y = oy * self.stride + ky * self.dilation - self.padding;
                            let x0 = xlo * self.stride + kx * self.dilation - self.padding;
                            f(row, img, oy, y, (xlo, xhi), x0);
                        }
                    }
                }
            }
        }
    }

    /// im2col: `(k, n * p)` row-major, row `(channel, ky, kx)` (the weight's order), column
    /// `(image, output position)`; padding reads as 0. With stride 1 each run is a slice copy.
    fn im2col(&self, x: &[f32]) -> Vec<f32> {
        let (p, np, plane, c) = (self.p(), self.n * self.p(), self.h * self.w, self.c);
        let mut col = vec![0f32; self.k() * np];
        self.runs(|row, img, oy, y, (lo, hi), x0| {
            let ch = row / (self.kh * self.kw);
            let src = &x[(img * c + ch) * plane + y * self.w..][..self.w];
            let dst = &mut col[row * np + img * p + oy * self.ow..][..self.ow];
            if self.stride == 1 {
                dst[lo..hi].copy_from_slice(&src[x0..x0 + hi - lo]);
            } else {
                for (d, v) in dst[lo..hi].iter_mut().zip(src[x0..].iter().step_by(self.stride)) {
                    *d = *v;
                }
            }
        });
        col
    }

    /// col2im: the input's gradient from the columns' gradient (the adjoint of [`Self::im2col`]).
    fn col2im(&self, col: &[f32]) -> Vec<f32> {
        let (p, np, plane, c) = (self.p(), self.n * self.p(), self.h * self.w, self.c);
        let mut x = vec![0f32; self.n * c * plane];
        self.runs(|row, img, oy, y, (lo, hi), x0| {
            let ch = row / (self.kh * self.kw);
            let dst = &mut x[(img * c + ch) * plane + y * self.w..][..self.w];
            let src = &col[row * np + img * p + oy * self.ow..][..self.ow];
            if self.stride == 1 {
                for (d, v) in dst[x0..x0 + hi - lo].iter_mut().zip(&src[lo..hi]) {
                    *d += *v;
                }
            } else {
                for (d, v) in dst[x0..].iter_mut().step_by(self.stride).zip(&src[lo..hi]) {
                    *d += *v;
                }
            }
        });
        x
    }
}

/// The f32 elements of a contiguous CPU tensor, read under its storage lock.
fn with_f32s<R>(t: &Tensor, op: &str, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => Ok(f(f32s(s, layout, op)?)),
        _ => candle_core::bail!("{op} runs on CPU tensors"),
    }
}

struct Conv2d {
    cfg: Conv2dConfig,
    /// The forward pass's im2col columns, which the backward pass needs again (taken there).
    col: std::sync::Mutex<Option<Tensor>>,
}

impl Conv2d {
    fn geometry(&self, x: &Layout, w: &Layout) -> Result<Geometry> {
        Geometry::new(x.shape(), w.shape(), &self.cfg)
    }
}

impl CustomOp3 for Conv2d {
    fn name(&self) -> &'static str {
        "strata-conv2d"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let g = self.geometry(l1, l2)?;
        let (x, w, b) = (f32s(s1, l1, self.name())?, f32s(s2, l2, self.name())?, f32s(s3, l3, self.name())?);
        if b.len() != g.o {
            candle_core::bail!("strata conv2d: the bias has {} elements, the weight {} filters", b.len(), g.o);
        }
        let (p, k, o) = (g.p(), g.k(), g.o);
        let cpu = Device::Cpu;
        let col = Tensor::from_vec(g.im2col(x), (k, g.n * p), &cpu)?;
        let w = Tensor::from_slice(w, (o, k), &cpu)?;
        // filters x (image, position): the weight (o, k) times the columns (k, n*p).
        let planes = w.matmul(&col)?;
        *self.col.lock().unwrap_or_else(|e| e.into_inner()) = Some(col);
        // NCHW with the bias: out[img][f] = planes[f][img] + b[f].
        let out = with_f32s(&planes, self.name(), |planes| {
            let mut out = Vec::with_capacity(g.n * o * p);
            for img in 0..g.n {
                for (f, &bias) in b.iter().enumerate() {
                    out.extend(planes[(f * g.n + img) * p..][..p].iter().map(|&v| v + bias));
                }
            }
            out
        })?;
        Ok((CpuStorage::F32(out), Shape::from((g.n, o, g.oh, g.ow))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let name = self.name();
        let (x, w, grad) = (x.contiguous()?, w.contiguous()?, grad.contiguous()?);
        let g = Geometry::new(x.shape(), w.shape(), &self.cfg)?;
        let (p, k, o) = (g.p(), g.k(), g.o);
        // The output's gradient as filters x (image, position), and the bias's gradient.
        let (planes, db) = with_f32s(&grad, name, |dy| {
            let mut planes = vec![0f32; o * g.n * p];
            let mut db = vec![0f32; o];
            for (img, src) in dy.chunks_exact(o * p).enumerate() {
                for (f, plane) in src.chunks_exact(p).enumerate() {
                    db[f] += plane.iter().sum::<f32>();
                    planes[(f * g.n + img) * p..][..p].copy_from_slice(plane);
                }
            }
            (planes, db)
        })?;
        let dev = x.device();
        let planes = Tensor::from_vec(planes, (o, g.n * p), dev)?;
        let saved = self.col.lock().unwrap_or_else(|e| e.into_inner()).take();
        let col = match saved {
            Some(col) if col.dims() == [k, g.n * p] => col,
            _ => Tensor::from_vec(with_f32s(&x, name, |x| g.im2col(x))?, (k, g.n * p), dev)?,
        };
        // dW (o, k) = planes (o, n*p) * col^T (n*p, k).
        let dw = planes.matmul(&col.t()?)?.reshape(w.shape())?;
        // dcol (k, n*p) = W^T (k, o) * planes (o, n*p); dx = col2im(dcol). Skipped for an input
        // no variable depends on (a network's first layer reads the data).
        let dx = if x.track_op() {
            let dcol = w.reshape((o, k))?.t()?.matmul(&planes)?;
            Some(Tensor::from_vec(with_f32s(&dcol, name, |d| g.col2im(d))?, x.shape(), dev)?)
        } else {
            None
        };
        Ok((dx, Some(dw), Some(Tensor::from_vec(db, o, dev)?)))
    }
}

/// 2-D convolution of `x` `(N, C, H, W)` by `weight` `(O, C, KH, KW)` plus `bias` `(O)`, as
/// candle-nn's `Conv2d` computes it (padding, stride and dilation of `cfg`), im2col and one
/// matrix product each way on f32 CPU tensors with groups 1; candle's `conv2d` elsewhere.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let x = Tensor::ones((2, 1, 8, 8), candle_core::DType::F32, &Device::Cpu)?;
/// let w = Tensor::ones((4, 1, 3, 3), candle_core::DType::F32, &Device::Cpu)?;
/// let cfg = candle_nn::Conv2dConfig { padding: 1, ..Default::default() };
/// let y = strata::fused::conv2d(&x, &w, None, &cfg)?;
/// assert_eq!(y.dims(), &[2, 4, 8, 8]);
/// assert_eq!(y.get(0)?.get(0)?.get(0)?.get(0)?.to_scalar::<f32>()?, 4.0); // a corner: 2x2 taps
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn conv2d(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, cfg: &Conv2dConfig) -> Result<Tensor> {
    let fast = fusable(x)
        && fusable(weight)
        && bias.is_none_or(fusable)
        && cfg.groups == 1
        && x.rank() == 4
        && weight.rank() == 4
        && cfg.cudnn_fwd_algo.is_none();
    if fast {
        let zeros;
        let bias = match bias {
            Some(b) => b,
            None => {
                zeros = Tensor::zeros(weight.dim(0)?, x.dtype(), x.device())?;
                &zeros
            }
        };
        return x.contiguous()?.apply_op3(
            &weight.contiguous()?,
            &bias.contiguous()?,
            Conv2d { cfg: *cfg, col: Default::default() },
        );
    }
    let y = x.conv2d(weight, cfg.padding, cfg.stride, cfg.dilation, cfg.groups)?;
    match bias {
        Some(b) => y.broadcast_add(&b.reshape((1, b.elem_count(), 1, 1))?),
        None => Ok(y),
    }
}

/// Max pooling over `k x k` windows with stride `k` (the last rows and columns that do not fill
/// a window dropped, as candle does), optionally of `max(x, 0)`.
struct MaxPool {
    k: usize,
    relu: bool,
}

impl MaxPool {
    /// Calls `f(output index, input index of the window's top-left element, input index of its
    /// first largest element)` for every window, in output order; returns the output's shape.
    fn windows(&self, x: &[f32], shape: &Shape, mut f: impl FnMut(usize, usize, usize)) -> Result<Shape> {
        let (n, c, h, w) = shape.dims4()?;
        let k = self.k;
        if k == 0 || h < k || w < k {
            candle_core::bail!("strata max_pool2d: a {k}x{k} window does not fit a {h}x{w} input");
        }
        let (oh, ow) = (h / k, w / k);
        let mut out = 0;
        for (pi, plane) in x.chunks_exact(h * w).enumerate() {
            for oy in 0..oh {
                let rows = &plane[oy * k * w..(oy * k + k) * w];
                for ox in 0..ow {
                    let (mut best, mut at) = (f32::NEG_INFINITY, usize::MAX);
                    for dy in 0..k {
                        let start = dy * w + ox * k;
                        for (j, &v) in rows[start..start + k].iter().enumerate() {
                            // `at == MAX`: the first element even if it is NaN or -inf.
                            if v > best || at == usize::MAX {
                                best = v;
                                at = start + j;
                            }
                        }
                    }
                    let corner = pi * h * w + oy * k * w;
                    f(out, corner + ox * k, corner + at);
                    out += 1;
                }
            }
        }
        debug_assert_eq!(out, n * c * oh * ow);
        Ok(Shape::from((n, c, oh, ow)))
    }

    /// The input's gradient (any `k`): each window's gradient split evenly among its elements
    /// equal to its maximum (of `max(x, 0)` with ReLU, then passed where `x >= 0`).
    fn grad(&self, x: &[f32], dy: &[f32], shape: &Shape) -> Result<Vec<f32>> {
        let (_, _, _, w) = shape.dims4()?;
        let k = self.k;
        let r = |v: f32| if self.relu { v.max(0.0) } else { v };
        let mut dx = vec![0f32; x.len()];
        let mut at = Vec::with_capacity(k * k);
        self.windows(x, shape, |o, corner, first| {
            let m = r(x[first]);
            at.clear();
            for dy_ in 0..k {
                for dx_ in 0..k {
                    let i = corner + dy_ * w + dx_;
                    if r(x[i]) == m {
                        at.push(i);
                    }
                }
            }
            let g = dy[o] / at.len().max(1) as f32;
            for &i in &at {
                if !self.relu || x[i] >= 0.0 {
                    dx[i] = g;
                }
            }
        })?;
        Ok(dx)
    }
}

impl CustomOp1 for MaxPool {
    fn name(&self) -> &'static str {
        if self.relu {
            "strata-relu-max-pool2d"
        } else {
            "strata-max-pool2d"
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32s(s, l, self.name())?;
        let relu = self.relu;
        if self.k == 2 {
            return pool2_fwd(x, l.shape(), relu).map(|(out, shape)| (CpuStorage::F32(out), shape));
        }
        let mut out = Vec::with_capacity(x.len() / (self.k * self.k).max(1));
        let shape = self.windows(x, l.shape(), |_, _, i| out.push(if relu { x[i].max(0.0) } else { x[i] }))?;
        Ok((CpuStorage::F32(out), shape))
    }

    fn bwd(&self, arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let op = MaxPoolGrad { k: self.k, relu: self.relu };
        Ok(Some(arg.contiguous()?.apply_op3_no_bwd(&res.contiguous()?, &grad.contiguous()?, &op)?))
    }
}

/// `(x, y, dy) -> dx` of [`MaxPool`]: each window's gradient split evenly among its largest
/// elements (with ReLU, of `max(x, 0)`, then passed where `x >= 0`).
struct MaxPoolGrad {
    k: usize,
    relu: bool,
}

impl CustomOp3 for MaxPoolGrad {
    fn name(&self) -> &'static str {
        "strata-max-pool2d-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, y, dy) = (f32s(s1, l1, self.name())?, f32s(s2, l2, self.name())?, f32s(s3, l3, self.name())?);
        let pool = MaxPool { k: self.k, relu: self.relu };
        let (n, c, h, w) = l1.shape().dims4()?;
        let want = Shape::from((n, c, h / self.k.max(1), w / self.k.max(1)));
        if want != *l3.shape() || want != *l2.shape() {
            candle_core::bail!("strata max_pool2d: gradient shape {:?}, output {:?}", l3.shape(), want);
        }
        if self.k == 2 {
            return Ok((CpuStorage::F32(pool2_bwd(x, y, dy, l1.shape(), self.relu)?), l1.shape().clone()));
        }
        Ok((CpuStorage::F32(pool.grad(x, dy, l1.shape())?), l1.shape().clone()))
    }
}

/// `a` or `b`, the larger (one `maxps`; NaN handling is not needed where this is used).
#[inline(always)]
fn larger(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

/// The 2x2 windows' maxima (with `relu`, of `max(x, 0)`): the common case, plain indexed loops
/// over a pair of rows that the compiler vectorizes (stride-2 loads), without the general loop's
/// per-element branches.
fn pool2_fwd(x: &[f32], shape: &Shape, relu: bool) -> Result<(Vec<f32>, Shape)> {
    let (n, c, h, w) = shape.dims4()?;
    if h < 2 || w < 2 {
        candle_core::bail!("strata max_pool2d: a 2x2 window does not fit a {h}x{w} input");
    }
    let (oh, ow) = (h / 2, w / 2);
    let floor = if relu { 0.0 } else { f32::NEG_INFINITY };
    let mut out = vec![0f32; n * c * oh * ow];
    for (plane, oplane) in x.chunks_exact(h * w).zip(out.chunks_exact_mut(oh * ow)) {
        for (oy, orow) in oplane.chunks_exact_mut(ow).enumerate() {
            let (r0, r1) = (&plane[2 * oy * w..][..2 * ow], &plane[(2 * oy + 1) * w..][..2 * ow]);
            for j in 0..ow {
                let top = larger(r0[2 * j], r0[2 * j + 1]);
                let bottom = larger(r1[2 * j], r1[2 * j + 1]);
                orow[j] = larger(larger(top, bottom), floor);
            }
        }
    }
    Ok((out, Shape::from((n, c, oh, ow))))
}

/// The gradient of [`pool2_fwd`] given its output `y`: each window's split evenly among the
/// window's elements equal to the maximum (of `max(x, 0)` with `relu`, then passed where
/// `x >= 0`), every element of the window written, so the loop has no branch on the data.
fn pool2_bwd(x: &[f32], y: &[f32], dy: &[f32], shape: &Shape, relu: bool) -> Result<Vec<f32>> {
    let (n, c, h, w) = shape.dims4()?;
    let (oh, ow) = (h / 2, w / 2);
    if dy.len() != n * c * oh * ow || y.len() != dy.len() {
        candle_core::bail!("strata max_pool2d: {} gradient elements for {} windows", dy.len(), n * c * oh * ow);
    }
    let floor = if relu { 0.0 } else { f32::NEG_INFINITY };
    // The gradient an element gets: its share where it is a maximum, ReLU's mask on top.
    let share = |v: f32, m: f32, g: f32| if larger(v, floor) == m && (!relu || v >= 0.0) { g } else { 0.0 };
    let mut dx = vec![0f32; x.len()];
    let planes = x.chunks_exact(h * w).zip(dx.chunks_exact_mut(h * w));
    for ((plane, dplane), (yplane, gplane)) in planes.zip(y.chunks_exact(oh * ow).zip(dy.chunks_exact(oh * ow))) {
        for oy in 0..oh {
            let (r0, r1) = (&plane[2 * oy * w..][..2 * ow], &plane[(2 * oy + 1) * w..][..2 * ow]);
            let (top, bottom) = dplane[2 * oy * w..(2 * oy + 2) * w].split_at_mut(w);
            let (top, bottom) = (&mut top[..2 * ow], &mut bottom[..2 * ow]);
            let (yrow, grow) = (&yplane[oy * ow..][..ow], &gplane[oy * ow..][..ow]);
            for j in 0..ow {
                let m = yrow[j];
                let (a0, a1, b0, b1) = (r0[2 * j], r0[2 * j + 1], r1[2 * j], r1[2 * j + 1]);
                let at = |v: f32| u8::from(larger(v, floor) == m);
                let ties = at(a0) + at(a1) + at(b0) + at(b1);
                let g = if ties == 0 { 0.0 } else { grow[j] / f32::from(ties) };
                top[2 * j] = share(a0, m, g);
                top[2 * j + 1] = share(a1, m, g);
                bottom[2 * j] = share(b0, m, g);
                bottom[2 * j + 1] = share(b1, m, g);
            }
        }
    }
    Ok(dx)
}

/// candle's `max_pool2d`, its gradient made the fused kernel's: candle's backward gives each of a
/// window's `m` largest elements `m / k^2` of the window's gradient (`avg` below, computed as
/// candle computes it), so the window's gradient is first scaled by `1 / (avg^2 k^2)`, which
/// leaves each of them `1 / m` of it. The forward value is candle's, bit for bit. Exact where
/// `k` divides the input's height and width (candle's backward upsamples to the input's size).
fn candle_max_pool2d(x: &Tensor, k: usize) -> Result<Tensor> {
    let (_, _, h, w) = x.dims4()?;
    let y = x.max_pool2d(k)?;
    let value = y.detach();
    let at_max = x.detach().eq(&value.upsample_nearest2d(h, w)?)?.to_dtype(x.dtype())?;
    let avg = at_max.avg_pool2d_with_stride(k, k)?;
    let scale = (avg.sqr()? * (k * k) as f64)?.recip()?;
    &value + ((y - &value)? * scale)?
}

/// Max pooling of `x` `(N, C, H, W)` over `k x k` windows with stride `k`, one pass each way on
/// f32 CPU tensors (each window's gradient split evenly among its largest elements, see the
/// module's note); elsewhere candle's `max_pool2d` with the gradient corrected to the same.
pub fn max_pool2d(x: &Tensor, k: usize) -> Result<Tensor> {
    if fusable(x) && x.rank() == 4 {
        x.contiguous()?.apply_op1(MaxPool { k, relu: false })
    } else {
        candle_max_pool2d(x, k)
    }
}

/// `max_pool2d(relu(x), k)` in one pass each way on f32 CPU tensors, with the gradients of
/// those two operations composed: each window's split evenly among the largest elements of
/// `relu(x)`, then ReLU's (candle's: it passes where `x >= 0`); elsewhere candle's `relu` and
/// [`max_pool2d`]'s corrected fallback.
pub fn relu_max_pool2d(x: &Tensor, k: usize) -> Result<Tensor> {
    if fusable(x) && x.rank() == 4 {
        x.contiguous()?.apply_op1(MaxPool { k, relu: true })
    } else {
        candle_max_pool2d(&x.relu()?, k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn rand(shape: &[usize], seed: u64) -> Tensor {
        // A fixed pseudo-random fill (SplitMix64), so ties are absent and runs repeat.
        let n: usize = shape.iter().product();
        let mut s = seed;
        let v: Vec<f32> = (0..n)
            .map(|_| {
                s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let mut z = s;
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        assert_eq!(a.dims(), b.dims());
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    /// Forward and the three gradients against candle's conv2d plus a broadcast bias.
    fn check_conv(x: &[usize], w: &[usize], cfg: Conv2dConfig) {
        let xv = Var::from_tensor(&rand(x, 1)).unwrap();
        let wv = Var::from_tensor(&rand(w, 2)).unwrap();
        let bv = Var::from_tensor(&rand(&[w[0]], 3)).unwrap();
        let composed = xv
            .conv2d(&wv, cfg.padding, cfg.stride, cfg.dilation, 1)
            .unwrap()
            .broadcast_add(&bv.reshape((1, w[0], 1, 1)).unwrap())
            .unwrap();
        let fused = conv2d(&xv, &wv, Some(&bv), &cfg).unwrap();
        assert!(max_diff(&composed, &fused) < 1e-5, "forward {x:?} {w:?} {cfg:?}");
        // A loss that weighs every output differently.
        let weights = rand(composed.dims(), 4);
        let ga = (composed * &weights).unwrap().sum_all().unwrap().backward().unwrap();
        let gb = (fused * &weights).unwrap().sum_all().unwrap().backward().unwrap();
        for (v, what) in [(&xv, "input"), (&wv, "weight"), (&bv, "bias")] {
            let (a, b) = (ga.get(v).unwrap(), gb.get(v).unwrap());
            assert!(max_diff(a, b) < 1e-4, "{what} gradient {x:?} {w:?} {cfg:?}: {}", max_diff(a, b));
        }
    }

    #[test]
    fn conv2d_matches_candle_forward_and_backward() {
        let same = Conv2dConfig { padding: 1, ..Default::default() };
        check_conv(&[3, 1, 8, 8], &[16, 1, 3, 3], same);
        check_conv(&[3, 16, 4, 4], &[32, 16, 3, 3], same);
        check_conv(&[2, 3, 9, 8], &[5, 3, 3, 2], Conv2dConfig { padding: 2, stride: 2, ..Default::default() });
        check_conv(&[2, 2, 10, 10], &[4, 2, 3, 3], Conv2dConfig { dilation: 2, ..Default::default() });
        check_conv(&[1, 4, 5, 5], &[3, 4, 5, 5], Conv2dConfig::default());
    }

    /// Where the stride leaves input rows or columns over, candle's own backward fails (its
    /// transposed convolution makes a smaller input); the fused gradient still satisfies the
    /// adjoint identity of a linear map: sum(dx * x) = sum(conv(x) * weights) without a bias.
    #[test]
    fn conv2d_gradient_is_the_adjoint_where_candles_backward_fails() {
        let cfg = Conv2dConfig { padding: 2, stride: 2, ..Default::default() };
        let xv = Var::from_tensor(&rand(&[2, 3, 9, 7], 11)).unwrap();
        let w = rand(&[5, 3, 3, 2], 12);
        let composed = xv.conv2d(&w, 2, 2, 1, 1).unwrap();
        let weights = rand(composed.dims(), 13);
        let e = (&composed * &weights).unwrap().sum_all().unwrap().backward().unwrap_err();
        assert!(e.to_string().contains("shape mismatch"), "{e}");
        let y = conv2d(&xv, &w, None, &cfg).unwrap();
        assert!(max_diff(&composed, &y) < 1e-5);
        let lhs = (&y * &weights).unwrap().sum_all().unwrap();
        let dx = lhs.backward().unwrap().get(&xv).unwrap().clone();
        let rhs = (dx * xv.as_tensor()).unwrap().sum_all().unwrap();
        let (a, b) = (lhs.to_scalar::<f32>().unwrap(), rhs.to_scalar::<f32>().unwrap());
        assert!((a - b).abs() <= 1e-4 * a.abs().max(1.0), "{a} vs {b}");
    }

    #[test]
    fn conv2d_without_bias_and_bad_shapes() {
        let x = rand(&[2, 3, 6, 6], 5);
        let w = rand(&[4, 3, 3, 3], 6);
        let cfg = Conv2dConfig::default();
        let want = x.conv2d(&w, 0, 1, 1, 1).unwrap();
        assert!(max_diff(&want, &conv2d(&x, &w, None, &cfg).unwrap()) < 1e-5);
        let wrong = rand(&[4, 2, 3, 3], 7);
        let e = conv2d(&x, &wrong, None, &cfg).unwrap_err().to_string();
        assert!(e.contains("3 channels"), "{e}");
        let big = rand(&[4, 3, 9, 9], 8);
        let e = conv2d(&x, &big, None, &cfg).unwrap_err().to_string();
        assert!(e.contains("does not fit"), "{e}");
    }

    #[test]
    fn max_pool_sends_each_windows_gradient_to_its_maximum() {
        // One 1x1x4x4 image: the maxima of the 2x2 windows are 5, 7, 9 and -1 (relu: 0).
        #[rustfmt::skip]
        let x = Tensor::from_vec(vec![
            1f32, 5., 7., 2.,
            3., 4., 0., 6.,
            9., -3., -4., -1.,
            2., 8., -2., -5.,
        ], (1, 1, 4, 4), &Device::Cpu).unwrap();
        let xv = Var::from_tensor(&x).unwrap();
        let y = max_pool2d(&xv, 2).unwrap();
        assert_eq!(y.flatten_all().unwrap().to_vec1::<f32>().unwrap(), [5., 7., 9., -1.]);
        let g = y.sum_all().unwrap().backward().unwrap();
        #[rustfmt::skip]
        let want = [
            0f32, 1., 1., 0.,
            0., 0., 0., 0.,
            1., 0., 0., 1.,
            0., 0., 0., 0.,
        ];
        assert_eq!(g.get(&xv).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(), want);
        let y = relu_max_pool2d(&xv, 2).unwrap();
        assert_eq!(y.flatten_all().unwrap().to_vec1::<f32>().unwrap(), [5., 7., 9., 0.]);
        let g = y.sum_all().unwrap().backward().unwrap();
        let mut want_relu = want;
        want_relu[11] = 0.0;
        assert_eq!(g.get(&xv).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(), want_relu);

        // candle 0.11's own max_pool2d backward gives a quarter of that for 2x2 windows (the
        // note in this module); if candle fixes it, this fails and the note must change.
        let g = xv.max_pool2d(2).unwrap().sum_all().unwrap().backward().unwrap();
        let candle: Vec<f32> = g.get(&xv).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(candle, want.map(|v| v / 4.0));
    }

    /// The fallback for other devices (run here on the CPU) gives the fused kernel's values and
    /// gradients where every window's maximum is unique.
    #[test]
    fn the_composed_fallback_gives_the_fused_gradients() {
        let x = rand(&[3, 4, 8, 6], 21);
        let rounded = ((&x * 2.0).unwrap().round().unwrap() / 2.0).unwrap();
        let weights = rand(&[3, 4, 4, 3], 22);
        for (relu, x) in [(false, &x), (true, &x), (false, &rounded), (true, &rounded)] {
            let xv = Var::from_tensor(x).unwrap();
            let fused = if relu { relu_max_pool2d(&xv, 2) } else { max_pool2d(&xv, 2) }.unwrap();
            let composed = if relu { candle_max_pool2d(&xv.relu().unwrap(), 2) } else { candle_max_pool2d(&xv, 2) };
            let composed = composed.unwrap();
            assert_eq!(max_diff(&fused, &composed), 0.0);
            let gf = (fused * &weights).unwrap().sum_all().unwrap().backward().unwrap();
            let gc = (composed * &weights).unwrap().sum_all().unwrap().backward().unwrap();
            assert!(max_diff(gf.get(&xv).unwrap(), gc.get(&xv).unwrap()) < 1e-6, "relu {relu}");
        }
    }

    /// The 2x2 fast path and the general loop agree, forward and backward, on odd sizes and on
    /// inputs full of ties (values rounded to halves, zeros among them).
    #[test]
    fn the_two_by_two_path_equals_the_general_loop() {
        for (shape, round) in [([2usize, 3, 8, 6], false), ([1, 2, 7, 5], false), ([2, 3, 8, 6], true)] {
            let x = rand(&shape, 31).flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let x: Vec<f32> = if round { x.iter().map(|v| (v * 2.0).round() / 2.0).collect() } else { x };
            let shape = Shape::from(shape.to_vec());
            for relu in [false, true] {
                let pool = MaxPool { k: 2, relu };
                let mut general = Vec::new();
                let out_shape =
                    pool.windows(&x, &shape, |_, _, i| general.push(if relu { x[i].max(0.0) } else { x[i] })).unwrap();
                let (fast, fast_shape) = pool2_fwd(&x, &shape, relu).unwrap();
                assert_eq!((&general, &out_shape), (&fast, &fast_shape));
                let dy: Vec<f32> = (0..fast_shape.elem_count()).map(|i| i as f32 + 1.0).collect();
                let want = pool.grad(&x, &dy, &shape).unwrap();
                assert_eq!(want, pool2_bwd(&x, &fast, &dy, &shape, relu).unwrap(), "relu {relu}, ties {round}");
            }
        }
    }

    /// Tied maxima share the window's gradient; with ReLU, windows of non-positive values share
    /// it among their elements and ReLU passes it only where `x >= 0`.
    #[test]
    fn tied_maxima_share_the_gradient() {
        #[rustfmt::skip]
        let x = Tensor::from_vec(vec![
            1f32, 1., 0., -1.,
            0., 1., 0., -2.,
        ], (1, 1, 2, 4), &Device::Cpu).unwrap();
        let xv = Var::from_tensor(&x).unwrap();
        let g = (max_pool2d(&xv, 2).unwrap() * 6.0).unwrap().sum_all().unwrap().backward().unwrap();
        let got = g.get(&xv).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(got, [2., 2., 3., 0., 0., 2., 3., 0.]);
        let g = (relu_max_pool2d(&(xv.as_tensor() - 1.0).unwrap(), 2).unwrap() * 6.0)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        // x - 1: [0, 0, -1, -2; -1, 0, -1, -3]: every relu value is 0, the ties are 4 per window.
        let got = g.get(&xv).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(got, [1.5, 1.5, 0., 0., 0., 1.5, 0., 0.]);
        // The composed fallback gives the same.
        let g = (candle_max_pool2d(&(xv.as_tensor() - 1.0).unwrap().relu().unwrap(), 2).unwrap() * 6.0)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        assert_eq!(g.get(&xv).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(), got);
    }

    #[test]
    fn pooling_drops_partial_windows_and_matches_candle_forward() {
        let x = rand(&[2, 3, 7, 5], 9);
        assert!(max_diff(&x.max_pool2d(2).unwrap(), &max_pool2d(&x, 2).unwrap()) == 0.0);
        let r = relu_max_pool2d(&x, 3).unwrap();
        assert!(max_diff(&x.relu().unwrap().max_pool2d(3).unwrap(), &r) == 0.0);
        assert_eq!(r.dims(), &[2, 3, 2, 1]);
        assert!(max_pool2d(&x, 6).unwrap_err().to_string().contains("does not fit"));
    }
}
