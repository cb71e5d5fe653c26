//! Gradient compression codecs: what a cross-worker reduction may put on the wire instead of
//! f32 gradients ([`Compression`]), as TensorFlow's `CommunicationOptions` and PyTorch DDP's
//! communication hooks offer. The wire itself (the ring's frames) is the transport's; here are
//! the codecs, as plain loops over slices:
//!
//! - **16-bit** ([`HalfFormat`]): each element is rounded to f16 or bf16 for the wire, and
//!   every hop of a ring adds what it receives in f32 ([`add_decoded_into`]) and keeps what
//!   it sends on ([`round_to`]), where DDP's fp16 hook sums in fp16. The conversions are the
//!   `half` crate's (as fast as a loop of our own: `docs/bench/2026-12-02-half-conversion.md`),
//!   except bf16 decoding, a shift that keeps a NaN's bits as they are.
//! - **PowerSGD** ([`PowerSgdState`]), Vogels et al. 2019 as PyTorch's `powerSGD_hook`: a
//!   matrix-shaped gradient travels as two thin factors `P` (rows x R) and `Q` (cols x R),
//!   with error feedback and a warm-started `Q`, in phases between which the caller
//!   all-reduces `P` and then `Q`.

use std::fmt;
use std::str::FromStr;

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// What a gradient travels as between workers. Spelled `none`, `fp16`, `bf16` or
/// `powersgd:RANK` ([`FromStr`] and [`Display`](fmt::Display) round-trip).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Compression {
    /// f32, as computed.
    #[default]
    None,
    /// IEEE half precision, rounded to nearest even; values beyond ±65504 become ±infinity.
    Fp16,
    /// bfloat16 (f32's range, 8 significant bits), rounded to nearest even.
    Bf16,
    /// int8 in blocks of [`INT8_BLOCK`] values, each block scaled by a power of two (see
    /// [`Int8Blocks`]): 65 bytes per 64 values. Local SGD's outer gradients only: a per-step
    /// gradient refuses it.
    Int8,
    /// PowerSGD of the given rank for matrix-shaped gradients (see [`PowerSgdState`]); other
    /// tensors travel as f32. Spelled `powersgd:RANK`, or `powersgd:RANK:START` to reduce the
    /// first `START` gradients of every variable uncompressed (PyTorch's
    /// `start_powerSGD_iter`: the early, large gradients are the ones a low rank loses most of).
    PowerSgd {
        /// The rank `R` of the approximation (at least 1).
        rank: usize,
        /// How many of a variable's gradients travel uncompressed before PowerSGD starts.
        start_step: u64,
    },
}

/// A compression that cannot be parsed or applied; each message says what to change.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CompressionError {
    /// A name that is none of the compressions.
    #[error("unknown compression {0:?}: use none, fp16, bf16, int8 or powersgd:RANK")]
    UnknownName(String),
    /// `powersgd` without its rank.
    #[error("compression {0:?} has no rank: use powersgd:RANK, e.g. powersgd:4")]
    MissingRank(String),
    /// `powersgd:0`.
    #[error("compression {0:?} has rank 0: use a rank of at least 1, e.g. powersgd:4")]
    ZeroRank(String),
    /// A rank that is not a whole number.
    #[error("compression {spec:?} has rank {rank:?}, not a whole number: use powersgd:RANK, e.g. powersgd:4")]
    InvalidRank {
        /// The whole spelling.
        spec: String,
        /// What stood for the rank.
        rank: String,
    },
    /// A PowerSGD rank at which none of a model's matrices would shrink.
    #[error("powersgd rank {rank} compresses none of the model's gradients (the largest matrix, {rows}x{cols}, shrinks only at rank {max} or less): {}", if *max == 0 { "use fp16 or bf16".to_string() } else { format!("use a rank of at most {max}") })]
    CompressesNothing {
        /// The rank asked for.
        rank: usize,
        /// The rows of the matrix that allows the largest rank.
        rows: usize,
        /// Its columns.
        cols: usize,
        /// The largest rank at which it shrinks (0: at none).
        max: usize,
    },
    /// A start step that is not a whole number.
    #[error("compression {spec:?} starts at {start:?}, not a whole number of steps: use powersgd:RANK:START, e.g. powersgd:4:100")]
    InvalidStart {
        /// The whole spelling.
        spec: String,
        /// What stood for the start step.
        start: String,
    },
    /// A rank larger than a matrix's smaller side.
    #[error("powersgd rank {rank} is larger than a {rows}x{cols} matrix allows: use a rank of at most {}", rows.min(cols))]
    RankTooLarge {
        /// The rank asked for.
        rank: usize,
        /// The matrix's rows.
        rows: usize,
        /// The matrix's columns.
        cols: usize,
    },
}

impl From<CompressionError> for crate::Error {
    fn from(e: CompressionError) -> Self {
        crate::Error::InvalidArgument(e.to_string())
    }
}

impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Compression::None => f.write_str("none"),
            Compression::Fp16 => f.write_str("fp16"),
            Compression::Bf16 => f.write_str("bf16"),
            Compression::Int8 => f.write_str("int8"),
            Compression::PowerSgd { rank, start_step: 0 } => write!(f, "powersgd:{rank}"),
            Compression::PowerSgd { rank, start_step } => write!(f, "powersgd:{rank}:{start_step}"),
        }
    }
}

impl FromStr for Compression {
    type Err = CompressionError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" => return Ok(Compression::None),
            "fp16" => return Ok(Compression::Fp16),
            "bf16" => return Ok(Compression::Bf16),
            "int8" => return Ok(Compression::Int8),
            "powersgd" => return Err(CompressionError::MissingRank(s.to_string())),
            _ => {}
        }
        let Some(rest) = s.strip_prefix("powersgd:") else {
            return Err(CompressionError::UnknownName(s.to_string()));
        };
        let (rank, start) = match rest.split_once(':') {
            Some((rank, start)) => (rank, Some(start)),
            None => (rest, None),
        };
        let start_step = match start {
            None => 0,
            Some(start) if !start.is_empty() && start.bytes().all(|b| b.is_ascii_digit()) => start
                .parse::<u64>()
                .map_err(|_| CompressionError::InvalidStart { spec: s.to_string(), start: start.to_string() })?,
            Some(start) => {
                return Err(CompressionError::InvalidStart { spec: s.to_string(), start: start.to_string() })
            }
        };
        if rank.is_empty() {
            return Err(CompressionError::MissingRank(s.to_string()));
        }
        let invalid = || CompressionError::InvalidRank { spec: s.to_string(), rank: rank.to_string() };
        if !rank.bytes().all(|b| b.is_ascii_digit()) {
            return Err(invalid());
        }
        match rank.parse::<usize>().map_err(|_| invalid())? {
            0 => Err(CompressionError::ZeroRank(s.to_string())),
            rank => Ok(Compression::PowerSgd { rank, start_step }),
        }
    }
}

/// The matrix a tensor of `shape` is compressed as: its first axis by the product of the
/// others (PyTorch's `view(shape[0], -1)`), row-major; `None` for scalars and vectors.
pub fn matrix_shape(shape: &[usize]) -> Option<(usize, usize)> {
    match shape {
        [] | [_] => None,
        [rows, rest @ ..] => Some((*rows, rest.iter().product())),
    }
}

impl Compression {
    /// The 16-bit format of [`Compression::Fp16`] and [`Compression::Bf16`].
    pub fn half_format(self) -> Option<HalfFormat> {
        match self {
            Compression::Fp16 => Some(HalfFormat::F16),
            Compression::Bf16 => Some(HalfFormat::Bf16),
            Compression::None | Compression::Int8 | Compression::PowerSgd { .. } => None,
        }
    }

    /// The compact wire of a sum all-reduce under this compression: 16-bit values or int8
    /// blocks (`None`: f32, or PowerSGD's factors).
    pub fn sum_wire(self) -> Option<SumWire> {
        match self {
            Compression::Int8 => Some(SumWire::Int8),
            c => c.half_format().map(SumWire::Half),
        }
    }

    /// Refuses a PowerSGD rank larger than a `rows` x `cols` matrix allows
    /// (`rank > min(rows, cols)`); every other compression fits every matrix.
    pub fn check_matrix(self, rows: usize, cols: usize) -> Result<(), CompressionError> {
        match self {
            Compression::PowerSgd { rank, .. } if rank > rows.min(cols) => {
                Err(CompressionError::RankTooLarge { rank, rows, cols })
            }
            _ => Ok(()),
        }
    }

    /// Refuses a PowerSGD rank at which none of the gradients of `shapes` (a model's
    /// trainable variables) would be compressed, where some of them are matrices: the rank
    /// was meant for them. Every other compression fits every model.
    pub fn check_model<'s>(self, shapes: impl IntoIterator<Item = &'s [usize]>) -> Result<(), CompressionError> {
        let Compression::PowerSgd { rank, .. } = self else { return Ok(()) };
        let mut best: Option<(usize, usize, usize)> = None;
        for shape in shapes {
            if self.compresses(shape) {
                return Ok(());
            }
            if let Some((rows, cols)) = matrix_shape(shape) {
                let max = (rows.saturating_mul(cols).saturating_sub(1)) / rows.saturating_add(cols).max(1);
                if best.is_none_or(|(_, _, m)| max > m) {
                    best = Some((rows, cols, max));
                }
            }
        }
        match best {
            Some((rows, cols, max)) => Err(CompressionError::CompressesNothing { rank, rows, cols, max }),
            None => Ok(()),
        }
    }

    /// Whether a tensor of `shape` travels compressed. 16-bit formats compress every tensor
    /// with elements; PowerSGD only matrices (two axes or more, see [`matrix_shape`]) whose
    /// factors are smaller than they are: `rows * cols > R * (rows + cols)` (which implies
    /// `R < min(rows, cols)`). The others travel as f32.
    pub fn compresses(self, shape: &[usize]) -> bool {
        match self {
            Compression::None => false,
            Compression::Fp16 | Compression::Bf16 | Compression::Int8 => shape.iter().product::<usize>() > 0,
            Compression::PowerSgd { rank, .. } => matrix_shape(shape)
                .is_some_and(|(rows, cols)| rows.saturating_mul(cols) > rank.saturating_mul(rows.saturating_add(cols))),
        }
    }

    /// The bytes a gradient of `shape` (`[len]` for a flat one) puts on the wire under this
    /// compression: 4 per element as f32, 2 per element in 16 bits, and for PowerSGD
    /// `4 * R * (rows + cols)`, its two factors in f32 (each all-reduced once).
    pub fn wire_bytes(self, shape: &[usize]) -> usize {
        let len: usize = shape.iter().product();
        match self {
            Compression::Fp16 | Compression::Bf16 => 2 * len,
            Compression::Int8 => SumWire::Int8.encoded_len(len),
            Compression::PowerSgd { rank, .. } if self.compresses(shape) => {
                let (rows, cols) = matrix_shape(shape).expect("a compressed tensor is a matrix");
                4 * rank * (rows + cols)
            }
            Compression::None | Compression::PowerSgd { .. } => 4 * len,
        }
    }
}

/// A 16-bit wire format. Encoding rounds to nearest even; NaN stays NaN (quiet, sign kept);
/// f16 turns values beyond its range (|x| >= 65520) into ±infinity, so a caller that refuses
/// non-finite gradients refuses them after encoding. Decoding is exact.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HalfFormat {
    /// IEEE binary16.
    F16,
    /// bfloat16.
    Bf16,
}

/// Elements per stack buffer of the f16 hop (no allocation in the hot loops).
const HOP_CHUNK: usize = 256;

/// Elements per stack buffer of [`round_to`].
const ROUND_BLOCK: usize = 512;

fn check_len(what: &str, a: usize, b: usize) {
    assert_eq!(a, b, "{what}: the f32 slice has {a} elements but the 16-bit slice {b}");
}

/// bf16 bits as f32, exactly: a NaN keeps its bits (`half` sets a signalling NaN's quiet bit).
#[inline(always)]
fn bf16_value(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// Encodes `src` as f16 bits into `dst` (see [`HalfFormat`] for rounding and range).
///
/// # Panics
/// If the lengths differ.
pub fn encode_f16(src: &[f32], dst: &mut [u16]) {
    check_len("encode_f16", src.len(), dst.len());
    dst.reinterpret_cast_mut::<half::f16>().convert_from_f32_slice(src);
}

/// Encodes `src` as bf16 bits into `dst` (see [`HalfFormat`]).
///
/// # Panics
/// If the lengths differ.
pub fn encode_bf16(src: &[f32], dst: &mut [u16]) {
    check_len("encode_bf16", src.len(), dst.len());
    dst.reinterpret_cast_mut::<half::bf16>().convert_from_f32_slice(src);
}

/// Decodes f16 bits `src` into `dst`, exactly.
///
/// # Panics
/// If the lengths differ.
pub fn decode_f16(src: &[u16], dst: &mut [f32]) {
    check_len("decode_f16", dst.len(), src.len());
    src.reinterpret_cast::<half::f16>().convert_to_f32_slice(dst);
}

/// Decodes bf16 bits `src` into `dst`, exactly.
///
/// # Panics
/// If the lengths differ.
pub fn decode_bf16(src: &[u16], dst: &mut [f32]) {
    check_len("decode_bf16", dst.len(), src.len());
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = bf16_value(s);
    }
}

impl HalfFormat {
    /// Encodes `src` into `dst` in this format ([`encode_f16`], [`encode_bf16`]).
    pub fn encode(self, src: &[f32], dst: &mut [u16]) {
        match self {
            HalfFormat::F16 => encode_f16(src, dst),
            HalfFormat::Bf16 => encode_bf16(src, dst),
        }
    }

    /// Decodes `src` into `dst` from this format ([`decode_f16`], [`decode_bf16`]).
    pub fn decode(self, src: &[u16], dst: &mut [f32]) {
        match self {
            HalfFormat::F16 => decode_f16(src, dst),
            HalfFormat::Bf16 => decode_bf16(src, dst),
        }
    }
}

/// Adds the decoded `wire` into `acc`, in f32: `acc[i] += decode(wire[i])`. A ring's
/// reduce-scatter hop with 16-bit gradients: the received chunk is added to this worker's own
/// f32 chunk, so the sum is rounded only when it goes on the wire again.
///
/// # Panics
/// If the lengths differ.
pub fn add_decoded_into(acc: &mut [f32], wire: &[u16], format: HalfFormat) {
    check_len("add_decoded_into", acc.len(), wire.len());
    match format {
        HalfFormat::Bf16 => {
            for (a, &w) in acc.iter_mut().zip(wire) {
                *a += bf16_value(w);
            }
        }
        HalfFormat::F16 => {
            let mut buf = [0f32; HOP_CHUNK];
            for (a, w) in acc.chunks_mut(HOP_CHUNK).zip(wire.chunks(HOP_CHUNK)) {
                let buf = &mut buf[..a.len()];
                decode_f16(w, buf);
                for (a, &b) in a.iter_mut().zip(buf.iter()) {
                    *a += b;
                }
            }
        }
    }
}

/// Rounds `data` to what `format` carries (encode, then decode): the value a task keeps of a
/// segment it reduced and sends on in 16 bits, so that every task holds the same bits.
pub fn round_to(data: &mut [f32], format: HalfFormat) {
    let mut words = [0u16; ROUND_BLOCK];
    for d in data.chunks_mut(ROUND_BLOCK) {
        let w = &mut words[..d.len()];
        format.encode(d, w);
        format.decode(w, d);
    }
}

/// Values per block of the int8 wire ([`Int8Blocks`]).
pub const INT8_BLOCK: usize = 64;

/// The int8 wire: blocks of [`INT8_BLOCK`] values (the last may be shorter), each a byte
/// holding the block's scale as a power of two (`e` + 127, so that 0..=254 are scales
/// `2^-127..=2^127`; 255 marks a block with a value that is not finite, decoded as NaN) and one
/// signed byte per value, `q = round(x / 2^e)` to nearest even in -127..=127, where `e` is the
/// smallest exponent that keeps the block's largest magnitude within 127 steps. Decoding is
/// `q * 2^e`, exact in f32; encoding what was decoded gives the same values again, so every
/// task of a ring holds the same bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Int8Blocks;

impl Int8Blocks {
    /// The scale exponent of a block whose largest magnitude is `m` (finite).
    fn exponent(m: f32) -> i32 {
        if m == 0.0 {
            return -127;
        }
        // The smallest e with m <= 127 * 2^e; powers of two are exact.
        let mut e = (f64::from(m) / 127.0).log2().ceil() as i32;
        while f64::from(m) > 127.0 * 2f64.powi(e) {
            e += 1;
        }
        while e > -127 && f64::from(m) <= 127.0 * 2f64.powi(e - 1) {
            e -= 1;
        }
        e.clamp(-127, 127)
    }

    /// Encodes `src` (at most [`INT8_BLOCK`] values) as one block into `dst`
    /// (`1 + src.len()` bytes).
    pub fn encode_block(src: &[f32], dst: &mut [u8]) {
        let m = src.iter().fold(0f32, |m, x| if x.is_finite() { m.max(x.abs()) } else { f32::INFINITY });
        if !m.is_finite() {
            dst[0] = 255;
            dst[1..=src.len()].fill(0);
            return;
        }
        let e = Self::exponent(m);
        dst[0] = (e + 127) as u8;
        let inv = 2f64.powi(-e);
        for (d, &x) in dst[1..=src.len()].iter_mut().zip(src) {
            let q = (f64::from(x) * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
            *d = q as u8;
        }
    }

    /// Decodes one block of `dst.len()` values from `src`, calling `f(slot, value)` for each.
    fn decode_block(src: &[u8], dst: &mut [f32], f: impl Fn(&mut f32, f32)) {
        if src[0] == 255 {
            dst.iter_mut().for_each(|d| f(d, f32::NAN));
            return;
        }
        let scale = 2f64.powi(i32::from(src[0]) - 127);
        for (d, &q) in dst.iter_mut().zip(&src[1..]) {
            f(d, (f64::from(q as i8) * scale) as f32);
        }
    }

    /// Overwrites `dst` with one block decoded from `src`.
    pub fn store_block(src: &[u8], dst: &mut [f32]) {
        Self::decode_block(src, dst, |d, v| *d = v);
    }

    /// Adds one block decoded from `src` into `acc`, in f32.
    pub fn add_block(src: &[u8], acc: &mut [f32]) {
        Self::decode_block(src, acc, |d, v| *d += v);
    }
}

/// A compact wire of a sum all-reduce, every hop adding in f32: 16-bit values or int8 blocks.
/// The wire is a run of *units*: one value in 16 bits, or one int8 block of [`INT8_BLOCK`]
/// values (a run of `n` values ends with a shorter block).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SumWire {
    /// 16 bits a value.
    Half(HalfFormat),
    /// [`Int8Blocks`].
    Int8,
}

impl SumWire {
    /// The values of a whole unit.
    pub fn unit_values(self) -> usize {
        match self {
            SumWire::Half(_) => 1,
            SumWire::Int8 => INT8_BLOCK,
        }
    }

    /// The bytes of a whole unit.
    pub fn unit_bytes(self) -> usize {
        match self {
            SumWire::Half(_) => 2,
            SumWire::Int8 => INT8_BLOCK + 1,
        }
    }

    /// The bytes of `n` values on this wire.
    pub fn encoded_len(self, n: usize) -> usize {
        match self {
            SumWire::Half(_) => 2 * n,
            SumWire::Int8 => n + n.div_ceil(INT8_BLOCK),
        }
    }

    /// Rounds `data` to what this wire carries (encode, then decode), units from its start.
    pub fn round(self, data: &mut [f32]) {
        match self {
            SumWire::Half(format) => round_to(data, format),
            SumWire::Int8 => {
                let mut buf = [0u8; INT8_BLOCK + 1];
                for d in data.chunks_mut(INT8_BLOCK) {
                    Int8Blocks::encode_block(d, &mut buf[..=d.len()]);
                    Int8Blocks::store_block(&buf[..=d.len()], d);
                }
            }
        }
    }
}

/// Where a [`PowerSgdState`] is in its step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Ready,
    PReady,
    QReady,
}

/// PowerSGD's state for one matrix-shaped gradient (`rows` x `cols`, row-major, rank `R`):
/// the error-feedback buffer and the warm-started `Q`.
///
/// One step, in three phases so that a ring can all-reduce between them:
///
/// 1. [`compress_p`](Self::compress_p): `M = grad + error`; returns `P = M Q` to all-reduce;
/// 2. [`after_p_reduced`](Self::after_p_reduced): orthonormalizes the reduced `P`'s columns
///    (Gram-Schmidt, twice); returns this worker's `Q = Mᵀ P` to all-reduce;
/// 3. [`decompress`](Self::decompress): writes the approximation `P Qᵀ` with the reduced
///    `Q`, keeps the reduced `Q` for the next step, and sets `error = M - P Q_localᵀ`.
///
/// **Reductions.** Reduce `P` and `Q` with the op the gradient is reduced with (Strata's
/// gradients are pre-weighted and summed): the output approximates that reduction of the
/// workers' `M`s. `P`'s scale cancels in the orthonormalization, so `Sum` or `Mean` for `P`
/// only changes rounding; `Q`'s reduction is the output's (PyTorch sums `Q` and divides it by
/// the world size, the `Mean` of a hook whose gradients are not pre-divided).
///
/// **Error feedback** is each worker's own residual `M - P Q_localᵀ` (`Q_local` = its `Mᵀ P`
/// before the reduction): the part of its `M` outside the span of `P`, at the scale of its
/// own `M` whatever the reduction. It equals `M - output` for a single worker; the workers'
/// errors sum to the same total as PyTorch's `M - output` with a `Mean` of `Q`.
///
/// **Determinism.** `Q` starts from `seed` alone, every loop has a fixed summation order, and
/// `P` and `Q` are only used reduced: workers whose collectives hand them the same bits end
/// with bitwise identical outputs and `Q`s. A column of `P` that is exactly zero stays zero;
/// a `Q` column that is zero after a step is redrawn (from the state's seeded generator,
/// identically on every worker) so that a zero gradient does not stall later steps. `Q`'s
/// columns are kept at unit norm between steps. NaN and infinities propagate to the output.
///
/// A step abandoned between phases (a failed collective) leaves its gradient in the error
/// buffer, sent with the next step's, and the warm `Q` untouched; a state
/// [`keeping_rollback`](Self::keeping_rollback) can instead [`roll_back`](Self::roll_back) to
/// the error before it (an elastic job runs the abandoned step again).
#[derive(Clone, Debug)]
pub struct PowerSgdState {
    rows: usize,
    cols: usize,
    rank: usize,
    /// `rows * cols`: the error; `M` between phases.
    error: Vec<f32>,
    /// `P`, column after column (`R` columns of `rows`).
    p: Vec<f32>,
    /// The warm `Q`, column after column (`R` columns of `cols`), unit columns.
    q: Vec<f32>,
    /// This worker's `Mᵀ P`, as computed.
    q_local: Vec<f32>,
    /// `Mᵀ P` handed to the caller to reduce.
    q_reduced: Vec<f32>,
    /// One row of `P Q_localᵀ`.
    row: Vec<f32>,
    rng: ChaCha8Rng,
    phase: Phase,
    /// The error before the step in flight (or the last one), kept when the state can roll
    /// back.
    before: Option<Vec<f32>>,
    /// The warm `Q` before the last completed step, kept with `before`.
    q_before: Option<Vec<f32>>,
    /// Steps completed ([`decompress`](Self::decompress)).
    steps: u64,
    /// The generator's seed (of the state, or of its last [`reset`](Self::reset)).
    seed: u64,
}

impl PowerSgdState {
    /// The state of a `rows` x `cols` gradient compressed at `rank`, with a zero error and `Q`
    /// drawn from `seed` (give every worker the same seed for the same variable, e.g. its
    /// index). Whether compressing pays is [`Compression::compresses`]' question.
    pub fn new(rows: usize, cols: usize, rank: usize, seed: u64) -> Result<Self, CompressionError> {
        if rank == 0 {
            return Err(CompressionError::ZeroRank(format!("powersgd:{rank}")));
        }
        Compression::PowerSgd { rank, start_step: 0 }.check_matrix(rows, cols)?;
        let mut state = PowerSgdState {
            rows,
            cols,
            rank,
            error: vec![0.0; rows * cols],
            p: vec![0.0; rows * rank],
            q: vec![0.0; cols * rank],
            q_local: vec![0.0; cols * rank],
            q_reduced: vec![0.0; cols * rank],
            row: vec![0.0; cols],
            rng: ChaCha8Rng::seed_from_u64(seed),
            phase: Phase::Ready,
            before: None,
            q_before: None,
            steps: 0,
            seed,
        };
        for k in 0..rank {
            state.draw_q_column(k);
        }
        Ok(state)
    }

    /// The matrix's rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The matrix's columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The approximation's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The error-feedback buffer (`rows * cols`, row-major), added to the next gradient.
    pub fn error(&self) -> &[f32] {
        &self.error
    }

    /// The warm `Q` the next step starts from: `R` columns of `cols` elements, one after the
    /// other, each of unit norm.
    pub fn q(&self) -> &[f32] {
        &self.q
    }

    /// Keeps a copy of the error at the start of every step (one more buffer of the
    /// gradient's size), so that [`roll_back`](Self::roll_back) can undo a step abandoned
    /// between phases.
    pub fn keeping_rollback(mut self) -> Self {
        self.keep_rollback();
        self
    }

    /// [`keeping_rollback`](Self::keeping_rollback) on a state in use (between steps):
    /// from the next step on, [`undo`](Self::undo) is exact.
    pub fn keep_rollback(&mut self) {
        if self.before.is_none() {
            self.before = Some(self.error.clone());
            self.q_before = Some(self.q.clone());
        }
    }

    /// Undoes the last completed step, whose output was not applied (a loss-scaled step
    /// skipped for a gradient that was not finite on some worker, which leaves `P` and `Q` not
    /// finite on every worker): the error and the warm `Q` go back to what they were before
    /// it, so the skipped gradient leaves no trace. Exact with
    /// [`keeping_rollback`](Self::keeping_rollback), and for a state whose only step it was
    /// (its error was zero and its `Q` the drawn one: both are restored); otherwise the error
    /// is zeroed and a `Q` that is not finite drawn again, so that nothing that is not finite
    /// stays. Between phases it is [`roll_back`](Self::roll_back).
    pub fn undo(&mut self) {
        if self.roll_back() || self.steps == 0 {
            return;
        }
        match (&self.before, &self.q_before) {
            (Some(e), Some(q)) => {
                self.error.copy_from_slice(e);
                self.q.copy_from_slice(q);
            }
            _ => {
                self.error.fill(0.0);
                if self.steps == 1 {
                    // The drawn Q of a fresh state: its generator, seeded alike on every
                    // worker, starts over.
                    self.rng = ChaCha8Rng::seed_from_u64(self.seed);
                    for k in 0..self.rank {
                        self.draw_q_column(k);
                    }
                } else {
                    for k in 0..self.rank {
                        let cols = self.cols;
                        if !self.q[k * cols..(k + 1) * cols].iter().all(|x| x.is_finite()) {
                            self.draw_q_column(k);
                        }
                    }
                }
            }
        }
        self.steps -= 1;
    }

    /// Multiplies the error by `factor`: the gradients it is added to are scaled by it from
    /// now on (fp16's loss scale changed), and the error stays in their units.
    pub fn scale_error(&mut self, factor: f32) {
        for e in &mut self.error {
            *e *= factor;
        }
        if let Some(b) = &mut self.before {
            for e in b {
                *e *= factor;
            }
        }
    }

    /// Undoes a step abandoned between phases: the error goes back to what it was before the
    /// step's gradient was added (bit for bit, with [`keeping_rollback`](Self::keeping_rollback);
    /// without it the gradient stays in the error), `Q` stays the warm one, and the next
    /// [`compress_p`](Self::compress_p) starts a step afresh. Returns whether a step was
    /// undone.
    pub fn roll_back(&mut self) -> bool {
        if self.phase == Phase::Ready {
            return false;
        }
        if let Some(before) = &self.before {
            self.error.copy_from_slice(before);
        }
        self.phase = Phase::Ready;
        true
    }

    /// Replaces the error (an elastic job re-splits the members' errors over a new
    /// membership) and the warm `Q` (`None` keeps it), and restarts `Q`'s generator from
    /// `seed`: states given the same `Q` and seed go on alike.
    ///
    /// # Panics
    /// If a step is between phases, or a length is not the error's or `Q`'s.
    pub fn reset(&mut self, error: &[f32], q: Option<&[f32]>, seed: u64) {
        assert_eq!(self.phase, Phase::Ready, "powersgd: reset between phases; roll_back first");
        self.error.copy_from_slice(error);
        if let Some(q) = q {
            self.q.copy_from_slice(q);
        }
        self.rng = ChaCha8Rng::seed_from_u64(seed);
        self.seed = seed;
    }

    /// Phase 1: adds `grad` (`rows * cols`, row-major) to the error buffer to form `M` and
    /// returns `P = M Q` (`R` columns of `rows`, one after the other) for the caller to
    /// all-reduce in place. May start over a step abandoned between phases.
    ///
    /// # Panics
    /// If `grad` has not `rows * cols` elements.
    pub fn compress_p(&mut self, grad: &[f32]) -> &mut [f32] {
        assert_eq!(
            grad.len(),
            self.error.len(),
            "powersgd: a {}x{} gradient has {} elements, not {}",
            self.rows,
            self.cols,
            self.error.len(),
            grad.len()
        );
        if let (Phase::Ready, Some(before)) = (self.phase, &mut self.before) {
            before.copy_from_slice(&self.error);
            if let Some(q) = &mut self.q_before {
                q.copy_from_slice(&self.q);
            }
        }
        for (m, &g) in self.error.iter_mut().zip(grad) {
            *m += g;
        }
        for (pk, qk) in self.p.chunks_exact_mut(self.rows).zip(self.q.chunks_exact(self.cols)) {
            for (p, m_row) in pk.iter_mut().zip(self.error.chunks_exact(self.cols)) {
                *p = dot(m_row, qk);
            }
        }
        self.phase = Phase::PReady;
        &mut self.p
    }

    /// `P` between phases 1 and 2, for a caller that reduces it out of place: write the
    /// reduced `P` here before [`after_p_reduced`](Self::after_p_reduced).
    ///
    /// # Panics
    /// If [`compress_p`](Self::compress_p) did not come just before.
    pub fn p_mut(&mut self) -> &mut [f32] {
        assert_eq!(self.phase, Phase::PReady, "powersgd: p_mut needs compress_p first");
        &mut self.p
    }

    /// Phase 2, once `P` is reduced: orthonormalizes `P`'s columns and returns this worker's
    /// `Q = Mᵀ P` (`R` columns of `cols`) for the caller to all-reduce in place.
    ///
    /// # Panics
    /// If [`compress_p`](Self::compress_p) did not come just before.
    pub fn after_p_reduced(&mut self) -> &mut [f32] {
        assert_eq!(self.phase, Phase::PReady, "powersgd: after_p_reduced needs compress_p first");
        orthonormalize(&mut self.p, self.rows);
        self.q_local.fill(0.0);
        for (i, m_row) in self.error.chunks_exact(self.cols).enumerate() {
            for (qk, pk) in self.q_local.chunks_exact_mut(self.cols).zip(self.p.chunks_exact(self.rows)) {
                axpy(qk, pk[i], m_row);
            }
        }
        self.q_reduced.copy_from_slice(&self.q_local);
        self.phase = Phase::QReady;
        &mut self.q_reduced
    }

    /// `Q` between phases 2 and 3, for a caller that reduces it out of place: write the
    /// reduced `Q` here before [`decompress`](Self::decompress).
    ///
    /// # Panics
    /// If [`after_p_reduced`](Self::after_p_reduced) did not come just before.
    pub fn q_mut(&mut self) -> &mut [f32] {
        assert_eq!(self.phase, Phase::QReady, "powersgd: q_mut needs after_p_reduced first");
        &mut self.q_reduced
    }

    /// Phase 3, once `Q` is reduced: writes the approximation `P Qᵀ` (`rows * cols`,
    /// row-major) into `out`, sets the error to `M - P Q_localᵀ` and keeps the reduced `Q`,
    /// its columns normalized, for the next step.
    ///
    /// # Panics
    /// If [`after_p_reduced`](Self::after_p_reduced) did not come just before, or `out` has
    /// not `rows * cols` elements.
    pub fn decompress(&mut self, out: &mut [f32]) {
        assert_eq!(self.phase, Phase::QReady, "powersgd: decompress needs after_p_reduced first");
        assert_eq!(
            out.len(),
            self.error.len(),
            "powersgd: the output of a {}x{} gradient has {} elements, not {}",
            self.rows,
            self.cols,
            self.error.len(),
            out.len()
        );
        let (rows, cols) = (self.rows, self.cols);
        for (i, (m_row, out_row)) in self.error.chunks_exact_mut(cols).zip(out.chunks_exact_mut(cols)).enumerate() {
            self.row.fill(0.0);
            out_row.fill(0.0);
            let p_i = self.p.chunks_exact(rows).map(|pk| pk[i]);
            for ((p, ql), qr) in p_i.zip(self.q_local.chunks_exact(cols)).zip(self.q_reduced.chunks_exact(cols)) {
                axpy(&mut self.row, p, ql);
                axpy(out_row, p, qr);
            }
            for (m, &a) in m_row.iter_mut().zip(self.row.iter()) {
                *m -= a;
            }
        }
        self.q.copy_from_slice(&self.q_reduced);
        for k in 0..self.rank {
            if !normalize(&mut self.q[k * cols..(k + 1) * cols]) {
                self.draw_q_column(k);
            }
        }
        self.steps += 1;
        self.phase = Phase::Ready;
    }

    /// The three phases with `all_reduce` (the caller's collective, the same on every worker)
    /// applied to `P` and then to `Q`; writes the approximation into `out`.
    ///
    /// # Panics
    /// As [`compress_p`](Self::compress_p) and [`decompress`](Self::decompress).
    pub fn step<E>(
        &mut self,
        grad: &[f32],
        out: &mut [f32],
        mut all_reduce: impl FnMut(&mut [f32]) -> Result<(), E>,
    ) -> Result<(), E> {
        all_reduce(self.compress_p(grad))?;
        all_reduce(self.after_p_reduced())?;
        self.decompress(out);
        Ok(())
    }

    /// Draws `Q`'s column `k` uniformly in [-1, 1) from the seeded generator, then normalizes it.
    fn draw_q_column(&mut self, k: usize) {
        let col = &mut self.q[k * self.cols..(k + 1) * self.cols];
        loop {
            for x in col.iter_mut() {
                *x = (self.rng.next_u32() >> 8) as f32 * (1.0 / (1 << 23) as f32) - 1.0;
            }
            if normalize(col) || col.is_empty() {
                return;
            }
        }
    }
}

/// `Σ a[i] b[i]` with eight running sums (vectorizable, fixed order).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let tail: f32 = a.chunks_exact(8).remainder().iter().zip(b.chunks_exact(8).remainder()).map(|(x, y)| x * y).sum();
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `y += a x`.
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// `Σ a[i] b[i]` in f64 (no overflow or underflow of f32 squares), in order.
fn dot64(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| f64::from(x) * f64::from(y)).sum()
}

/// Scales `v` to unit norm; an all-zero `v` stays zero and gives `false`. NaN propagates.
fn normalize(v: &mut [f32]) -> bool {
    let norm = dot64(v, v).sqrt();
    if norm == 0.0 {
        return false;
    }
    let inv = 1.0 / norm;
    for x in v.iter_mut() {
        *x = (f64::from(*x) * inv) as f32;
    }
    true
}

/// Modified Gram-Schmidt over the columns (each `len` long, one after the other), each column
/// projected out twice ("twice is enough": orthogonal to working precision even when nearly
/// dependent), then normalized; an exactly zero column stays zero.
fn orthonormalize(m: &mut [f32], len: usize) {
    if len == 0 {
        return;
    }
    for k in 0..m.len() / len {
        let (done, rest) = m.split_at_mut(k * len);
        let col = &mut rest[..len];
        for _ in 0..2 {
            for prev in done.chunks_exact(len) {
                let d = dot64(prev, col) as f32;
                axpy(col, -d, prev);
            }
        }
        normalize(col);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rng(seed: u64) -> ChaCha8Rng {
        ChaCha8Rng::seed_from_u64(seed)
    }

    /// A random normal f32 with exponent in `[min_exp, max_exp]`.
    fn normal(r: &mut ChaCha8Rng, min_exp: i32, max_exp: i32) -> f32 {
        let exp = min_exp + (r.next_u32() % (max_exp - min_exp + 1) as u32) as i32;
        let bits = (r.next_u32() & 0x807F_FFFF) | (((exp + 127) as u32) << 23);
        f32::from_bits(bits)
    }

    fn enc(format: HalfFormat, xs: &[f32]) -> Vec<u16> {
        let mut out = vec![0; xs.len()];
        format.encode(xs, &mut out);
        out
    }

    fn dec(format: HalfFormat, ws: &[u16]) -> Vec<f32> {
        let mut out = vec![0.0; ws.len()];
        format.decode(ws, &mut out);
        out
    }

    #[test]
    fn known_values_encode_to_their_bits() {
        let tiny = |k: i32| 2f32.powi(k);
        let f16_cases: [(f32, u16); 14] = [
            (1.0, 0x3C00),
            (1.0 + tiny(-11), 0x3C00),       // tie, to even
            (1.0 + 3.0 * tiny(-11), 0x3C02), // tie, to even (up)
            (65504.0, 0x7BFF),               // the largest f16
            (65519.99, 0x7BFF),              // below the tie with 65536
            (65520.0, 0x7C00),               // the tie rounds to 2^16: infinity
            (-1e9, 0xFC00),
            (tiny(-24), 0x0001),             // the smallest subnormal
            (tiny(-25), 0x0000),             // tie with zero, to even
            (3.0 * tiny(-25), 0x0002),       // tie, to even (up)
            (tiny(-14) - tiny(-24), 0x03FF), // the largest subnormal
            (-0.0, 0x8000),
            (f32::INFINITY, 0x7C00),
            (f32::NAN, 0x7E00),
        ];
        let bf16_cases: [(f32, u16); 11] = [
            (1.0, 0x3F80),
            (1.0 + tiny(-8), 0x3F80),              // tie, to even
            (1.0 + 3.0 * tiny(-8), 0x3F82),        // tie, to even (up)
            (1.0 + tiny(-8) + tiny(-20), 0x3F81),  // above the tie
            (f32::MAX, 0x7F80),                    // rounds beyond bf16's largest
            (f32::from_bits(0x7F7F_0000), 0x7F7F), // bf16's largest
            (f32::from_bits(0x0000_8000), 0x0000), // f32 subnormal, tie with zero
            (f32::from_bits(0x0001_8000), 0x0002), // f32 subnormal, tie to even (up)
            (-0.0, 0x8000),
            (f32::NAN, 0x7FC0),
            (f32::from_bits(0x7F80_0001), 0x7FC0), // a signalling NaN stays NaN, not infinity
        ];
        for (format, cases) in [(HalfFormat::F16, &f16_cases[..]), (HalfFormat::Bf16, &bf16_cases[..])] {
            let xs: Vec<f32> = cases.iter().map(|c| c.0).collect();
            let want: Vec<u16> = cases.iter().map(|c| c.1).collect();
            let got = enc(format, &xs);
            for ((x, w), g) in xs.iter().zip(&want).zip(&got) {
                assert_eq!(g, w, "{format:?} of {x:e} ({:#010x}): {g:#06x}, expected {w:#06x}", x.to_bits());
            }
            let back = dec(format, &got);
            for ((x, w), b) in xs.iter().zip(&want).zip(&back) {
                if x.is_nan() {
                    assert!(b.is_nan());
                } else if (w & 0x7FFF) != 0x7C00 && (w & 0x7FFF) != 0x7F80 {
                    assert_eq!(enc(format, &[*b])[0], *w, "decoding {w:#06x} gives {b:e}, which does not encode back");
                }
            }
        }
        // -0.0 decodes to -0.0, infinities to infinities.
        assert_eq!(
            dec(HalfFormat::F16, &[0x8000, 0xFC00]).iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            [0x8000_0000, 0xFF80_0000]
        );
        assert_eq!(dec(HalfFormat::Bf16, &[0x8000, 0x7F80])[1], f32::INFINITY);
    }

    #[test]
    fn encodings_match_half_on_random_bits_and_decoding_every_pattern() {
        let mut r = rng(1);
        let xs: Vec<f32> = (0..100_003).map(|_| f32::from_bits(r.next_u32())).collect();
        let f16 = enc(HalfFormat::F16, &xs);
        let bf16 = enc(HalfFormat::Bf16, &xs);
        for ((x, a), b) in xs.iter().zip(&f16).zip(&bf16) {
            assert_eq!(*a, half::f16::from_f32_const(*x).to_bits(), "f16 of {:#010x}", x.to_bits());
            assert_eq!(*b, half::bf16::from_f32(*x).to_bits(), "bf16 of {:#010x}", x.to_bits());
        }
        let all: Vec<u16> = (0..=u16::MAX).collect();
        for (format, one) in [
            (HalfFormat::F16, (|b| half::f16::from_bits(b).to_f32_const()) as fn(u16) -> f32),
            (HalfFormat::Bf16, |b| half::bf16::from_bits(b).to_f32()),
        ] {
            for (b, x) in all.iter().zip(dec(format, &all)) {
                let want = one(*b);
                assert!(
                    x.to_bits() == want.to_bits() || (x.is_nan() && want.is_nan()),
                    "{format:?} decoding {b:#06x}: {x:e}, expected {want:e}"
                );
            }
        }
    }

    #[test]
    fn relative_error_of_normal_values_is_half_an_ulp() {
        // p significant bits round to nearest within 2^-p relative (bf16: p = 8, f16: p = 11).
        let mut r = rng(2);
        for (format, min_exp, max_exp, bound) in
            [(HalfFormat::Bf16, -126, 126, 2f64.powi(-8)), (HalfFormat::F16, -14, 15, 2f64.powi(-11))]
        {
            let xs: Vec<f32> = (0..100_000)
                .map(|_| normal(&mut r, min_exp, max_exp))
                .filter(|x| x.abs() <= 65504.0 || format == HalfFormat::Bf16)
                .collect();
            let back = dec(format, &enc(format, &xs));
            let worst = xs
                .iter()
                .zip(&back)
                .map(|(&x, &y)| ((f64::from(x) - f64::from(y)) / f64::from(x)).abs())
                .fold(0.0, f64::max);
            assert!(worst <= bound, "{format:?}: relative error {worst:e} > {bound:e}");
            assert!(worst > 0.9 * bound, "{format:?}: relative error {worst:e}: the bound {bound:e} is not tight");
        }
    }

    #[test]
    fn hop_sums_in_f32() {
        let mut r = rng(3);
        let n = 3 * HOP_CHUNK + 5;
        for format in [HalfFormat::F16, HalfFormat::Bf16] {
            let a: Vec<f32> = (0..n).map(|_| normal(&mut r, -10, 10)).collect();
            let b: Vec<f32> = (0..n).map(|_| normal(&mut r, -10, 10)).collect();
            let (wa, wb) = (enc(format, &a), enc(format, &b));
            let want: Vec<f32> = dec(format, &wa).iter().zip(dec(format, &wb)).map(|(x, y)| x + y).collect();
            let mut acc = dec(format, &wa);
            add_decoded_into(&mut acc, &wb, format);
            assert_eq!(
                acc.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "{format:?}"
            );
            // What a task keeps of the sum it sends on: the sum as the wire carries it.
            round_to(&mut acc, format);
            assert_eq!(
                acc.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                dec(format, &enc(format, &want)).iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "{format:?}"
            );
        }
    }

    /// The bf16 encoding before it was `half`'s: rounds to nearest even by adding just under
    /// half an ulp (plus one when the kept part is odd); a NaN keeps its sign and top payload
    /// bits with the quiet bit set.
    fn old_bf16_bits(x: f32) -> u16 {
        let x = x.to_bits();
        if x & 0x7FFF_FFFF > 0x7F80_0000 {
            ((x >> 16) | 0x0040) as u16
        } else {
            (x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16) as u16
        }
    }

    #[test]
    fn bf16_encoding_is_the_old_one_bit_for_bit() {
        // Every upper half (each sign, exponent and kept mantissa: zeros, subnormals, the
        // largest finite values, infinities, quiet and signalling NaNs) with the lower halves
        // that decide rounding: exact, just below, at and just above the tie, and the most.
        // Every f32 was compared once, in the measurement's throwaway program.
        let lows = [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFF];
        let xs: Vec<f32> = (0..=u16::MAX)
            .flat_map(|hi| lows.iter().map(move |lo| f32::from_bits((u32::from(hi) << 16) | lo)))
            .collect();
        let got = enc(HalfFormat::Bf16, &xs);
        for (x, g) in xs.iter().zip(&got) {
            assert_eq!(*g, old_bf16_bits(*x), "bf16 of {:#010x}", x.to_bits());
        }
    }

    #[test]
    fn spellings_round_trip_and_errors_say_what_to_change() {
        for c in [
            Compression::None,
            Compression::Fp16,
            Compression::Bf16,
            Compression::Int8,
            Compression::PowerSgd { rank: 4, start_step: 0 },
        ] {
            assert_eq!(c.to_string().parse::<Compression>(), Ok(c));
        }
        assert_eq!("powersgd:12".parse(), Ok(Compression::PowerSgd { rank: 12, start_step: 0 }));
        let late = Compression::PowerSgd { rank: 4, start_step: 100 };
        assert_eq!("powersgd:4:100".parse(), Ok(late));
        assert_eq!(late.to_string(), "powersgd:4:100");
        assert_eq!("powersgd:4:0".parse::<Compression>().map(|c| c.to_string()), Ok("powersgd:4".to_string()));
        let err = |s: &str| s.parse::<Compression>().unwrap_err().to_string();
        assert_eq!(err("zstd"), r#"unknown compression "zstd": use none, fp16, bf16, int8 or powersgd:RANK"#);
        assert_eq!(err("FP16"), r#"unknown compression "FP16": use none, fp16, bf16, int8 or powersgd:RANK"#);
        assert_eq!(err("powersgd"), r#"compression "powersgd" has no rank: use powersgd:RANK, e.g. powersgd:4"#);
        assert_eq!(err("powersgd:"), r#"compression "powersgd:" has no rank: use powersgd:RANK, e.g. powersgd:4"#);
        assert_eq!(
            err("powersgd:0"),
            r#"compression "powersgd:0" has rank 0: use a rank of at least 1, e.g. powersgd:4"#
        );
        assert_eq!(
            err("powersgd:four"),
            r#"compression "powersgd:four" has rank "four", not a whole number: use powersgd:RANK, e.g. powersgd:4"#
        );
        assert_eq!(
            err("powersgd:-1"),
            r#"compression "powersgd:-1" has rank "-1", not a whole number: use powersgd:RANK, e.g. powersgd:4"#
        );
        assert_eq!(
            err("powersgd:4:soon"),
            r#"compression "powersgd:4:soon" starts at "soon", not a whole number of steps: use powersgd:RANK:START, e.g. powersgd:4:100"#
        );
        assert_eq!(
            err("powersgd:4:"),
            r#"compression "powersgd:4:" starts at "", not a whole number of steps: use powersgd:RANK:START, e.g. powersgd:4:100"#
        );
        let big = Compression::PowerSgd { rank: 5, start_step: 0 }.check_matrix(3, 4).unwrap_err();
        assert_eq!(big.to_string(), "powersgd rank 5 is larger than a 3x4 matrix allows: use a rank of at most 3");
        assert_eq!(crate::Error::from(big.clone()).to_string(), big.to_string());
        // A model's matrices: 16x6 shrinks up to rank 4 (96 > 4 * 22), 3x16 up to rank 2.
        let model: [&[usize]; 4] = [&[16, 6], &[16], &[3, 16], &[3]];
        assert_eq!(Compression::PowerSgd { rank: 4, start_step: 0 }.check_model(model), Ok(()));
        assert_eq!(
            Compression::PowerSgd { rank: 5, start_step: 0 }.check_model(model).unwrap_err().to_string(),
            "powersgd rank 5 compresses none of the model's gradients (the largest matrix, 16x6, shrinks only at rank 4 or less): use a rank of at most 4"
        );
        let thin: [&[usize]; 2] = [&[1, 8], &[8]];
        assert_eq!(
            Compression::PowerSgd { rank: 1, start_step: 0 }.check_model(thin).unwrap_err().to_string(),
            "powersgd rank 1 compresses none of the model's gradients (the largest matrix, 1x8, shrinks only at rank 0 or less): use fp16 or bf16"
        );
        let vectors: [&[usize]; 1] = [&[8]];
        assert_eq!(Compression::PowerSgd { rank: 1, start_step: 0 }.check_model(vectors), Ok(()));
        assert_eq!(Compression::Bf16.check_model(thin), Ok(()));
        assert!(Compression::PowerSgd { rank: 3, start_step: 0 }.check_matrix(3, 4).is_ok());
        assert!(Compression::Fp16.check_matrix(1, 1).is_ok());
        assert_eq!(PowerSgdState::new(3, 4, 5, 0).unwrap_err(), big);
        assert!(PowerSgdState::new(3, 4, 0, 0).is_err());
    }

    #[test]
    fn which_shapes_compress_and_their_bytes() {
        let sgd = |rank| Compression::PowerSgd { rank, start_step: 0 };
        assert_eq!(matrix_shape(&[3, 2, 5]), Some((3, 10)));
        assert_eq!(matrix_shape(&[7]), None);
        assert!(sgd(2).compresses(&[12, 10])); // 120 > 2 * 22
        assert!(!sgd(2).compresses(&[4, 4])); // 16 = 2 * 8: would not shrink
        assert!(sgd(2).compresses(&[3, 2, 5]) && !sgd(3).compresses(&[3, 2, 5])); // 30 vs 26, 39
        assert!(!sgd(1).compresses(&[1000]) && !sgd(1).compresses(&[]) && !sgd(1).compresses(&[0, 9]));
        assert!(!sgd(usize::MAX).compresses(&[1 << 20, 1 << 20]));
        assert!(Compression::Bf16.compresses(&[7]) && !Compression::None.compresses(&[7]));
        assert_eq!(Compression::None.wire_bytes(&[12, 10]), 480);
        assert_eq!(Compression::Fp16.wire_bytes(&[12, 10]), 240);
        assert_eq!(Compression::Bf16.wire_bytes(&[1000]), 2000);
        assert_eq!(sgd(2).wire_bytes(&[12, 10]), 4 * 2 * 22);
        assert_eq!(sgd(2).wire_bytes(&[4, 4]), 64);
        assert_eq!(sgd(2).wire_bytes(&[1000]), 4000);
        assert_eq!(Compression::Fp16.half_format(), Some(HalfFormat::F16));
        assert_eq!(sgd(2).half_format(), None);
    }

    /// `Σ_k u_k v_kᵀ`, row-major.
    fn outer_sum(pairs: &[(Vec<f32>, Vec<f32>)]) -> Vec<f32> {
        let (rows, cols) = (pairs[0].0.len(), pairs[0].1.len());
        let mut m = vec![0.0; rows * cols];
        for (u, v) in pairs {
            for i in 0..rows {
                for j in 0..cols {
                    m[i * cols + j] += u[i] * v[j];
                }
            }
        }
        m
    }

    fn vector(n: usize, f: impl Fn(f32) -> f32) -> Vec<f32> {
        (0..n).map(|i| f(i as f32)).collect()
    }

    fn rel(a: &[f32], b: &[f32]) -> f64 {
        let diff: f64 = a.iter().zip(b).map(|(&x, &y)| f64::from(x - y).powi(2)).sum();
        let norm: f64 = b.iter().map(|&y| f64::from(y).powi(2)).sum();
        (diff / norm).sqrt()
    }

    fn norm(a: &[f32]) -> f64 {
        dot64(a, a).sqrt()
    }

    const ROWS: usize = 12;
    const COLS: usize = 10;

    fn u(k: f32) -> Vec<f32> {
        vector(ROWS, |i| (i * (k + 1.0) * 0.37).sin() + 0.1 * k)
    }

    fn v(k: f32) -> Vec<f32> {
        vector(COLS, |j| (j * (k + 2.0) * 0.23).cos() - 0.05 * k)
    }

    fn identity(_: &mut [f32]) -> Result<(), ()> {
        Ok(())
    }

    #[test]
    fn powersgd_reconstructs_a_gradient_of_rank_at_most_r() {
        for terms in [1, 2] {
            let grad = outer_sum(&(0..terms).map(|k| (u(k as f32), v(k as f32))).collect::<Vec<_>>());
            let mut s = PowerSgdState::new(ROWS, COLS, 2, 7).unwrap();
            let mut out = vec![0.0; ROWS * COLS];
            s.step(&grad, &mut out, identity).unwrap();
            assert!(rel(&out, &grad) <= 1e-5, "rank {terms}: relative error {}", rel(&out, &grad));
            assert!(norm(s.error()) <= 1e-5 * norm(&grad), "rank {terms}: error {}", norm(s.error()));
            let q = s.q();
            for k in 0..2 {
                assert!((norm(&q[k * COLS..(k + 1) * COLS]) - 1.0).abs() < 1e-6);
            }
        }
    }

    #[test]
    fn powersgd_error_holds_what_the_approximation_missed() {
        let grad = outer_sum(&(0..3).map(|k| (u(k as f32), v(k as f32))).collect::<Vec<_>>());
        let mut s = PowerSgdState::new(ROWS, COLS, 2, 7).unwrap();
        let mut out = vec![0.0; ROWS * COLS];
        s.step(&grad, &mut out, identity).unwrap();
        for ((&g, &o), &e) in grad.iter().zip(&out).zip(s.error()) {
            assert_eq!(e.to_bits(), (g - o).to_bits());
        }
        assert!(norm(s.error()) > 1e-3 * norm(&grad), "a rank-3 gradient is not rank 2");
        // The next step sends the error with the new gradient: a zero gradient now sends it.
        let missed = s.error().to_vec();
        let mut out2 = vec![0.0; ROWS * COLS];
        s.step(&vec![0.0; ROWS * COLS], &mut out2, identity).unwrap();
        let sent: Vec<f32> = out2.iter().zip(s.error()).map(|(o, e)| o + e).collect();
        assert!(rel(&sent, &missed) <= 1e-6);
    }

    #[test]
    fn a_zero_gradient_does_not_stall_later_steps() {
        let mut s = PowerSgdState::new(ROWS, COLS, 2, 7).unwrap();
        let mut out = vec![1.0; ROWS * COLS];
        s.step(&vec![0.0; ROWS * COLS], &mut out, identity).unwrap();
        assert!(out.iter().chain(s.error()).all(|&x| x == 0.0));
        let grad = outer_sum(&[(u(0.0), v(0.0)), (u(1.0), v(1.0))]);
        s.step(&grad, &mut out, identity).unwrap();
        assert!(rel(&out, &grad) <= 1e-5, "relative error {}", rel(&out, &grad));
    }

    #[test]
    fn two_workers_reducing_the_same_sums_get_identical_bits() {
        // Worker w's gradient is u_w v_wᵀ; their sum has rank 2 = R.
        let grads = [outer_sum(&[(u(0.0), v(0.0))]), outer_sum(&[(u(1.0), vector(COLS, |j| 0.3 * j - 1.0))])];
        let sum: Vec<f32> = grads[0].iter().zip(&grads[1]).map(|(a, b)| a + b).collect();
        let mut workers =
            [PowerSgdState::new(ROWS, COLS, 2, 42).unwrap(), PowerSgdState::new(ROWS, COLS, 2, 42).unwrap()];
        let reduce =
            |parts: [Vec<f32>; 2]| -> Vec<f32> { parts[0].iter().zip(&parts[1]).map(|(a, b)| a + b).collect() };
        for step in 0..3 {
            let [a, b] = &mut workers;
            let ps = [a.compress_p(&grads[0]).to_vec(), b.compress_p(&grads[1]).to_vec()];
            let p = reduce(ps);
            a.p.copy_from_slice(&p);
            b.p.copy_from_slice(&p);
            let qs = [a.after_p_reduced().to_vec(), b.after_p_reduced().to_vec()];
            let q = reduce(qs);
            a.q_reduced.copy_from_slice(&q);
            b.q_reduced.copy_from_slice(&q);
            let (mut oa, mut ob) = (vec![0.0; ROWS * COLS], vec![0.0; ROWS * COLS]);
            a.decompress(&mut oa);
            b.decompress(&mut ob);
            assert_eq!(
                oa.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                ob.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "step {step}"
            );
            assert_eq!(a.q(), b.q());
            assert!(rel(&oa, &sum) <= 1e-5, "step {step}: relative error {}", rel(&oa, &sum));
            // Each worker keeps its own residual; together they are what the sum missed.
            let errors: Vec<f32> = a.error().iter().zip(b.error()).map(|(x, y)| x + y).collect();
            assert!(norm(&errors) <= 1e-5 * norm(&sum));
        }
    }

    /// fp16's loss scaling: a completed step whose gradient was not finite (skipped) is undone,
    /// error and warm `Q`, bit for bit with `keeping_rollback` (turned on in use) and for a
    /// fresh state; the error follows a change of scale.
    #[test]
    fn a_skipped_step_is_undone_and_the_error_follows_the_scale() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let grad = |k: f32| (0..6 * 4).map(|i| ((i as f32) * 0.37 + k).sin()).collect::<Vec<f32>>();
        let mut poisoned = grad(9.0);
        poisoned[5] = f32::INFINITY;
        let mut out = vec![0.0; 24];
        let none = |_: &mut [f32]| Ok::<(), ()>(());
        // A fresh state's first step skipped: as if it never ran.
        let mut s = PowerSgdState::new(6, 4, 2, 5).unwrap();
        let fresh = s.q().to_vec();
        s.step(&poisoned, &mut out, none).unwrap();
        assert!(!out.iter().all(|x| x.is_finite()), "a gradient that is not finite gives an output that is not");
        s.undo();
        assert!(s.error().iter().all(|&x| x == 0.0));
        assert_eq!(bits(s.q()), bits(&fresh));
        let mut twin = PowerSgdState::new(6, 4, 2, 5).unwrap();
        let mut out_twin = vec![0.0; 24];
        s.step(&grad(1.0), &mut out, none).unwrap();
        twin.step(&grad(1.0), &mut out_twin, none).unwrap();
        assert_eq!(bits(&out), bits(&out_twin));
        // Keeping from now on: a later skipped step goes back to the error and Q before it.
        s.keep_rollback();
        twin.keep_rollback();
        s.step(&grad(2.0), &mut out, none).unwrap();
        twin.step(&grad(2.0), &mut out_twin, none).unwrap();
        let (error, q) = (s.error().to_vec(), s.q().to_vec());
        s.step(&poisoned, &mut out, none).unwrap();
        s.undo();
        assert_eq!((bits(s.error()), bits(s.q())), (bits(&error), bits(&q)));
        s.step(&grad(3.0), &mut out, none).unwrap();
        twin.step(&grad(3.0), &mut out_twin, none).unwrap();
        assert_eq!(bits(&out), bits(&out_twin), "the skipped step left no trace");
        // The scale halves: the error is halved, exactly (a power of two).
        let e = s.error().to_vec();
        s.scale_error(0.5);
        assert_eq!(bits(s.error()), bits(&e.iter().map(|x| x * 0.5).collect::<Vec<_>>()));
        // Without keeping, after several steps: the error is zeroed and Q finite again.
        let mut t = PowerSgdState::new(6, 4, 2, 5).unwrap();
        t.step(&grad(1.0), &mut out, none).unwrap();
        t.step(&poisoned, &mut out, none).unwrap();
        t.undo();
        assert!(t.error().iter().all(|&x| x == 0.0) && t.q().iter().all(|x| x.is_finite()));
    }

    #[test]
    fn an_abandoned_step_rolls_back_to_the_error_before_it_bit_for_bit() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let grad = |k: f32| (0..6 * 4).map(|i| ((i as f32) * 0.37 + k).sin()).collect::<Vec<f32>>();
        let mut s = PowerSgdState::new(6, 4, 2, 5).unwrap().keeping_rollback();
        let mut out = vec![0.0; 24];
        s.step::<()>(&grad(1.0), &mut out, |_| Ok(())).unwrap();
        let (error, q) = (s.error().to_vec(), s.q().to_vec());
        assert!(error.iter().any(|&x| x != 0.0), "a rank-2 approximation of a full-rank gradient leaves an error");
        // Abandoned after the first phase, and after the second.
        s.compress_p(&grad(2.0));
        assert!(s.roll_back());
        assert_eq!(bits(s.error()), bits(&error));
        s.compress_p(&grad(3.0));
        s.after_p_reduced();
        assert!(s.roll_back());
        assert_eq!((bits(s.error()), bits(s.q())), (bits(&error), bits(&q)));
        assert!(!s.roll_back(), "nothing in flight");
        // The step run again is the step of a state that never saw the abandoned ones.
        let mut twin = PowerSgdState::new(6, 4, 2, 5).unwrap();
        twin.step::<()>(&grad(1.0), &mut [0.0; 24], |_| Ok(())).unwrap();
        let (mut a, mut b) = (vec![0.0; 24], vec![0.0; 24]);
        s.step::<()>(&grad(4.0), &mut a, |_| Ok(())).unwrap();
        twin.step::<()>(&grad(4.0), &mut b, |_| Ok(())).unwrap();
        assert_eq!(bits(&a), bits(&b));
        // Without the copy, the abandoned gradient stays in the error, sent with the next step.
        let mut keeps = PowerSgdState::new(6, 4, 2, 5).unwrap();
        keeps.compress_p(&grad(2.0));
        assert!(keeps.roll_back());
        assert_eq!(bits(keeps.error()), bits(&grad(2.0)));
        // reset: a given error, Q and generator.
        keeps.reset(&error, Some(&q), 9);
        assert_eq!((bits(keeps.error()), bits(keeps.q())), (bits(&error), bits(&q)));
    }

    #[test]
    fn int8_blocks_round_to_powers_of_two_and_round_again_to_the_same_bits() {
        use rand::Rng;
        let mut rng = rng(7);
        for len in [1, 5, 63, 64, 65, 130, 1000] {
            for scale in [1e-30f32, 1e-3, 1.0, 7.5, 1e30] {
                let x: Vec<f32> = (0..len).map(|_| (rng.random::<f32>() - 0.5) * scale).collect();
                let mut r = x.clone();
                SumWire::Int8.round(&mut r);
                for (block_x, block_r) in x.chunks(INT8_BLOCK).zip(r.chunks(INT8_BLOCK)) {
                    let m = block_x.iter().fold(0f32, |m, v| m.max(v.abs()));
                    // Half a step of at most 2m / 127 apart.
                    for (a, b) in block_x.iter().zip(block_r) {
                        assert!((a - b).abs() <= m / 127.0 + f32::MIN_POSITIVE, "{a} -> {b} (max {m})");
                    }
                }
                let mut again = r.clone();
                SumWire::Int8.round(&mut again);
                assert_eq!(
                    again.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    r.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                );
                assert_eq!(SumWire::Int8.encoded_len(len), len + len.div_ceil(64));
            }
        }
        // A block with a value that is not finite decodes as NaN; zeros stay zeros.
        let mut v = vec![1.0, f32::INFINITY, 2.0];
        SumWire::Int8.round(&mut v);
        assert!(v.iter().all(|x| x.is_nan()));
        let mut z = vec![0.0f32; 10];
        SumWire::Int8.round(&mut z);
        assert!(z.iter().all(|x| *x == 0.0));
        assert_eq!("int8".parse::<Compression>(), Ok(Compression::Int8));
        assert_eq!(Compression::Int8.to_string(), "int8");
    }
}
