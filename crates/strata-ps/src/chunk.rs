//! Tensors in chunks: what a request carries and what a pull reads, as little-endian f32 bytes.

use std::sync::Arc;

use bytes::Bytes;

use strata_core::cross_device::compression::HalfFormat;

use crate::limits::MAX_CHUNK_ELEMENTS;

#[cfg(target_endian = "big")]
compile_error!("the parameter server's data format is little-endian f32; big-endian hosts are not supported");

/// A received chunk: elements from `offset` on of the request's variable number `var`.
#[derive(Clone, Debug)]
pub struct Chunk {
    /// The variable's number in the request (its header names the variables).
    pub var: u32,
    /// The chunk's first element in the variable.
    pub offset: u64,
    /// The little-endian f32 data, in pieces of whole elements (the frames it arrived in),
    /// [`MAX_CHUNK_BYTES`](crate::MAX_CHUNK_BYTES) at most in all (see [`check_chunk_len`](crate::check_chunk_len)).
    pub pieces: Vec<Bytes>,
}

impl Chunk {
    /// The number of f32 elements.
    pub fn elements(&self) -> usize {
        self.pieces.iter().map(Bytes::len).sum::<usize>() / 4
    }

    /// Appends the elements to `dst`.
    pub(crate) fn extend(&self, dst: &mut Vec<f32>) {
        for p in &self.pieces {
            extend_f32s(p, dst);
        }
    }
}

/// A chunk of a variable's values, as a pull reads them: `data` shares the variable's memory.
#[derive(Clone, Debug)]
pub struct ValueChunk {
    /// The variable's number in the pull.
    pub var: u32,
    /// The chunk's first element in the variable.
    pub offset: u64,
    /// The little-endian f32 values, [`MAX_CHUNK_ELEMENTS`] at most.
    pub data: Bytes,
}

/// A `Vec<f32>` seen as its little-endian bytes.
struct F32Vec(Vec<f32>);

impl AsRef<[u8]> for F32Vec {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

/// A `Vec<u16>` seen as its little-endian bytes.
struct U16Vec(Vec<u16>);

impl AsRef<[u8]> for U16Vec {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

/// The little-endian 16-bit elements `data` (an even number of bytes, any alignment; checked
/// by [`check_chunk_len_in`](crate::check_chunk_len_in)) decoded exactly into little-endian f32 bytes, as a [`Chunk`]'s
/// pieces hold them. Allocates 4 bytes per element.
///
/// # Panics
/// If `data` has an odd length.
pub fn decode_half(data: &[u8], format: HalfFormat) -> Bytes {
    assert!(data.len().is_multiple_of(2), "decode_half: {} bytes are not whole 16-bit elements", data.len());
    let mut out = vec![0f32; data.len() / 2];
    match bytemuck::try_cast_slice::<u8, u16>(data) {
        Ok(bits) => format.decode(bits, &mut out),
        Err(_) => format.decode(&bytemuck::pod_collect_to_vec::<u8, u16>(data), &mut out),
    }
    Bytes::from_owner(F32Vec(out))
}

/// `values` encoded as little-endian 16-bit elements, each rounded to nearest even.
pub fn encode_half(values: &[f32], format: HalfFormat) -> Bytes {
    let mut bits = vec![0u16; values.len()];
    format.encode(values, &mut bits);
    Bytes::from_owner(U16Vec(bits))
}

/// The little-endian f32 `data` (a whole number of elements, any alignment) encoded as
/// [`encode_half`] does.
///
/// # Panics
/// If `data`'s length is not a multiple of 4.
pub fn encode_half_bytes(data: &[u8], format: HalfFormat) -> Bytes {
    assert!(data.len().is_multiple_of(4), "encode_half_bytes: {} bytes are not whole f32 elements", data.len());
    match bytemuck::try_cast_slice::<u8, f32>(data) {
        Ok(values) => encode_half(values, format),
        Err(_) => encode_half(&bytemuck::pod_collect_to_vec::<u8, f32>(data), format),
    }
}

/// The first element of the little-endian f32 `data` that is NaN or infinite, with its index
/// and value. One pass over aligned 32-bit words (its exponent bits all set), which the
/// compiler vectorises; the few bytes around them are checked one element at a time.
pub fn first_non_finite(data: &[u8]) -> Option<(usize, f32)> {
    const EXPONENT: u32 = 0x7f80_0000;
    let at = |i: usize| f32::from_le_bytes([data[4 * i], data[4 * i + 1], data[4 * i + 2], data[4 * i + 3]]);
    let n = data.len() / 4;
    let (head, words, _) = bytemuck::pod_align_to::<u8, u32>(data);
    if head.len() % 4 != 0 {
        // Words do not start on an element: check element by element.
        return (0..n).map(|i| (i, at(i))).find(|(_, v)| !v.is_finite());
    }
    if !words.iter().any(|w| u32::from_le(*w) & EXPONENT == EXPONENT) {
        // Only the elements outside the aligned words remain.
        let skip = head.len() / 4;
        let done = skip + words.len();
        return (0..skip).chain(done..n).map(|i| (i, at(i))).find(|(_, v)| !v.is_finite());
    }
    (0..n).map(|i| (i, at(i))).find(|(_, v)| !v.is_finite())
}

/// Writes the little-endian f32 values in `data` into `dst` (of the same length): a plain copy
/// of the bytes, whatever their alignment (the host is little-endian, like the data).
pub fn copy_f32s(data: &[u8], dst: &mut [f32]) {
    bytemuck::cast_slice_mut::<f32, u8>(dst).copy_from_slice(data);
}

/// Appends the f32 values of `data` (little-endian; bytes past the last whole value are
/// ignored) to `dst`.
pub fn extend_f32s(data: &[u8], dst: &mut Vec<f32>) {
    let (start, n) = (dst.len(), data.len() / 4);
    dst.resize(start + n, 0.0);
    copy_f32s(&data[..n * 4], &mut dst[start..]);
}

/// A range of a variable's values, shared with the variable: the bytes of a pulled chunk
/// without a copy.
struct SharedRange {
    values: Arc<Vec<f32>>,
    start: usize,
    end: usize,
}

impl AsRef<[u8]> for SharedRange {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.values[self.start..self.end])
    }
}

/// Chunks of a variable's values that share its memory (no copy).
pub(crate) fn shared_chunks(var: u32, values: &Arc<Vec<f32>>) -> impl Iterator<Item = ValueChunk> + '_ {
    (0..values.len()).step_by(MAX_CHUNK_ELEMENTS).map(move |start| ValueChunk {
        var,
        offset: start as u64,
        data: Bytes::from_owner(SharedRange {
            values: values.clone(),
            start,
            end: (start + MAX_CHUNK_ELEMENTS).min(values.len()),
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    // The check of their lengths is `checks.rs`' `half_chunks_are_checked_in_elements`.
    #[test]
    fn half_chunks_convert_exactly() {
        // 1 + 2^-9 rounds to 1 in bf16 (a tie, to even) and stays in f16; decoding is exact.
        let values = [1.0 + 2f32.powi(-9), -3.5, 0.1, 65504.0];
        for (format, want) in [
            (HalfFormat::Bf16, [1.0, -3.5, 205.0 / 2048.0, 65536.0]),
            (HalfFormat::F16, [1.0 + 2f32.powi(-9), -3.5, 819.0 / 8192.0, 65504.0]),
        ] {
            let wire = encode_half(&values, format);
            assert_eq!(wire.len(), 8);
            assert_eq!(encode_half_bytes(bytemuck::cast_slice(&values), format), wire);
            // At an odd address too.
            let mut shifted = vec![0u8];
            shifted.extend_from_slice(&wire);
            for data in [&wire[..], &shifted[1..]] {
                let back = decode_half(data, format);
                let back: Vec<f32> =
                    back.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
                assert_eq!(back, want, "{format:?}");
            }
        }
    }

    #[test]
    fn non_finite_elements_are_found_at_any_alignment() {
        let mut values: Vec<f32> = (0..100).map(|i| i as f32 - 50.0).collect();
        let bytes: Vec<u8> = bytemuck::cast_slice(&values).to_vec();
        for offset in 0..4 {
            let mut shifted = vec![0u8; offset];
            shifted.extend_from_slice(&bytes);
            assert_eq!(first_non_finite(&shifted[offset..]), None);
        }
        for (at, bad) in [(0, f32::NAN), (37, f32::INFINITY), (99, f32::NEG_INFINITY)] {
            values[at] = bad;
            let bytes: Vec<u8> = bytemuck::cast_slice(&values).to_vec();
            for offset in 0..4 {
                let mut shifted = vec![0u8; offset];
                shifted.extend_from_slice(&bytes);
                let (i, v) = first_non_finite(&shifted[offset..]).unwrap();
                assert_eq!((i, v.to_bits()), (at, bad.to_bits()), "offset {offset}");
            }
            values[at] = 1.0;
        }
        values[5] = f32::NAN;
        values[60] = f32::INFINITY;
        let bytes: Vec<u8> = bytemuck::cast_slice(&values).to_vec();
        assert_eq!(first_non_finite(&bytes).map(|(i, _)| i), Some(5), "the first of two");
        // Largest finite values and subnormals are finite.
        let edge = [f32::MAX, f32::MIN, f32::MIN_POSITIVE / 2.0, -0.0];
        assert_eq!(first_non_finite(bytemuck::cast_slice(&edge)), None);
    }

    #[test]
    fn shared_chunks_cover_the_values_in_order() {
        let values = Arc::new((0..MAX_CHUNK_ELEMENTS + 3).map(|i| i as f32).collect::<Vec<f32>>());
        let chunks: Vec<ValueChunk> = shared_chunks(7, &values).collect();
        assert_eq!(chunks.len(), 2);
        assert_eq!((chunks[1].var, chunks[1].offset, chunks[1].data.len()), (7, MAX_CHUNK_ELEMENTS as u64, 12));
        let mut back = Vec::new();
        for c in &chunks {
            Chunk { var: c.var, offset: c.offset, pieces: vec![c.data.clone()] }.extend(&mut back);
        }
        assert_eq!(&back, &*values);
    }
}
