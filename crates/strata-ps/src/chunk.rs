//! Tensors in chunks: what a request carries and what a pull reads, as little-endian f32 bytes.

use std::sync::Arc;

use bytes::Bytes;

use crate::{Error, Result};

#[cfg(target_endian = "big")]
compile_error!("the parameter server's data format is little-endian f32; big-endian hosts are not supported");

/// The most payload bytes (f32 elements times 4) one chunk carries.
pub const MAX_CHUNK_BYTES: usize = 1 << 20;

/// The most f32 elements one chunk carries.
pub const MAX_CHUNK_ELEMENTS: usize = MAX_CHUNK_BYTES / 4;

/// The largest variable (in elements) a task accepts.
pub const MAX_VARIABLE_ELEMENTS: usize = 1 << 31;

/// A received chunk: elements from `offset` on of the request's variable number `var`.
#[derive(Clone, Debug)]
pub struct Chunk {
    /// The variable's number in the request (its header names the variables).
    pub var: u32,
    /// The chunk's first element in the variable.
    pub offset: u64,
    /// The little-endian f32 data, in pieces of whole elements (the frames it arrived in),
    /// [`MAX_CHUNK_BYTES`] at most in all (see [`check_chunk_len`]).
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

/// Checks the data length of a chunk: at most [`MAX_CHUNK_BYTES`], whole f32 elements.
pub fn check_chunk_len(len: usize) -> Result<()> {
    if len > MAX_CHUNK_BYTES {
        return Err(Error::ChunkTooLarge { bytes: len });
    }
    if !len.is_multiple_of(4) {
        return Err(Error::ChunkNotWholeElements { bytes: len });
    }
    Ok(())
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

/// Appends the f32 values of a chunk to `dst`.
fn extend_f32s(data: &[u8], dst: &mut Vec<f32>) {
    let start = dst.len();
    dst.resize(start + data.len() / 4, 0.0);
    copy_f32s(data, &mut dst[start..]);
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

    #[test]
    fn chunk_lengths_are_checked() {
        check_chunk_len(MAX_CHUNK_BYTES).unwrap();
        check_chunk_len(0).unwrap();
        assert!(
            matches!(check_chunk_len(MAX_CHUNK_BYTES + 4), Err(Error::ChunkTooLarge { bytes }) if bytes == MAX_CHUNK_BYTES + 4)
        );
        assert!(matches!(check_chunk_len(6), Err(Error::ChunkNotWholeElements { bytes: 6 })));
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
