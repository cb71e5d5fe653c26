//! Argument validation shared by the CPU references and the GPU launchers, so that both accept
//! and reject exactly the same calls, with the same messages ([`Error::InvalidLaunch`]), and so
//! that the launchers' checks are tested on a machine without a GPU.
//!
//! The rules: a reduction needs at least one buffer (and at most `u32::MAX`); every buffer of a
//! call has the same length (a chunk lies inside the buffers); an empty length is valid and does
//! nothing (the launchers do not launch); grids are capped at [`MAX_GRID`] blocks of [`BLOCK`]
//! threads (the kernels loop); vectorized kernels are chosen only when every pointer is
//! [`VECTOR_ALIGN`]-aligned (and a chunk offset a multiple of 4 elements).

use super::{BLOCK, MAX_GRID, VECTOR_ALIGN};
use crate::{Error, Result};

fn invalid(kernel: &'static str, detail: String) -> Error {
    Error::InvalidLaunch { kernel, detail }
}

/// Checks the buffer count of a reduction over `n` buffers: `1 <= n <= u32::MAX`.
pub fn buffer_count(kernel: &'static str, n: usize) -> Result<u32> {
    if n == 0 {
        return Err(invalid(kernel, "no buffers to reduce: a reduction needs at least one".to_string()));
    }
    u32::try_from(n).map_err(|_| invalid(kernel, format!("{n} buffers, more than the {} a launch takes", u32::MAX)))
}

/// The reduction of sources of lengths `src_lens` into a destination of `dst_len` elements:
/// at least one source, every source as long as the destination. Returns the buffer count.
pub fn reduce(kernel: &'static str, src_lens: &[usize], dst_len: usize) -> Result<u32> {
    let n = buffer_count(kernel, src_lens.len())?;
    for (r, &l) in src_lens.iter().enumerate() {
        if l != dst_len {
            return Err(invalid(kernel, format!("source {r} has {l} elements, the destination {dst_len}")));
        }
    }
    Ok(n)
}

/// The chunk `[off, off + len)` of buffers of lengths `buf_lens`: at least one buffer, all of the
/// same length, the chunk inside them. Returns the buffer count.
pub fn allreduce_chunk(kernel: &'static str, buf_lens: &[usize], off: usize, len: usize) -> Result<u32> {
    let n = buffer_count(kernel, buf_lens.len())?;
    let first = buf_lens[0];
    for (b, &l) in buf_lens.iter().enumerate().skip(1) {
        if l != first {
            return Err(invalid(kernel, format!("buffer {b} has {l} elements, buffer 0 has {first}")));
        }
    }
    match off.checked_add(len) {
        Some(end) if end <= first => Ok(n),
        _ => Err(invalid(
            kernel,
            format!("chunk [{off}, {off} + {len}) does not lie inside buffers of {first} elements"),
        )),
    }
}

/// Buffers that must all have the same length, named for the message: `[("dst", 3), ("src", 4)]`.
/// Returns that length.
pub fn same_len(kernel: &'static str, bufs: &[(&str, usize)]) -> Result<usize> {
    let Some(&(first_name, first)) = bufs.first() else {
        return Err(invalid(kernel, "no buffers".to_string()));
    };
    for &(name, l) in &bufs[1..] {
        if l != first {
            return Err(invalid(kernel, format!("{name} has {l} elements, {first_name} has {first}")));
        }
    }
    Ok(first)
}

/// The grid of a launch over `items` work items (elements, or float4 groups), one per thread per
/// iteration of the grid-stride loop: `None` for no work (do not launch), otherwise
/// `(grid, block)` with `grid = min(ceil(items / BLOCK), MAX_GRID)`.
pub fn grid(kernel: &'static str, items: u64) -> Result<Option<(u32, u32)>> {
    if items == 0 {
        return Ok(None);
    }
    // the kernels index with 64-bit integers and add the thread count to the index: the largest
    // index plus the thread count must not wrap
    let threads = u64::from(MAX_GRID) * u64::from(BLOCK);
    if items > u64::MAX - threads {
        return Err(invalid(kernel, format!("{items} items, more than a 64-bit index can cover")));
    }
    let blocks = items.div_ceil(u64::from(BLOCK)).min(u64::from(MAX_GRID));
    let blocks = u32::try_from(blocks).expect("capped at MAX_GRID");
    debug_assert!((1..=MAX_GRID).contains(&blocks));
    Ok(Some((blocks, BLOCK)))
}

/// Whether every address is [`VECTOR_ALIGN`]-aligned, so the `_v4` (`float4`) kernel may be
/// launched; otherwise the element-wise one is.
pub fn vector_aligned(addresses: impl IntoIterator<Item = u64>) -> bool {
    addresses.into_iter().all(|a| a.is_multiple_of(VECTOR_ALIGN))
}

/// Whether the `_v4` chunk kernel may run on buffers starting at `bases` from element `off`: it
/// indexes `float4`s of each buffer from `off / 4`, so the bases must be aligned and `off` a
/// multiple of 4 (aligned chunk addresses alone are not enough).
pub fn chunk_vector_aligned(bases: impl IntoIterator<Item = u64>, off: usize) -> bool {
    off.is_multiple_of(4) && vector_aligned(bases)
}

/// The work items of a `_v4` launch over `len` elements: one per `float4`, the `len % 4` tail
/// done by the first threads, so `ceil(len / 4)` (never zero for a non-empty buffer).
pub fn vector_items(len: usize) -> u64 {
    (len as u64).div_ceil(4)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn detail(r: Result<impl std::fmt::Debug>) -> String {
        match r {
            Err(Error::InvalidLaunch { detail, .. }) => detail,
            other => panic!("expected InvalidLaunch, got {other:?}"),
        }
    }

    #[test]
    fn reduce_needs_a_source_and_equal_lengths() {
        assert_eq!(detail(reduce("k", &[], 3)), "no buffers to reduce: a reduction needs at least one");
        assert_eq!(detail(reduce("k", &[3, 4], 3)), "source 1 has 4 elements, the destination 3");
        assert_eq!(reduce("k", &[3, 3, 3], 3).unwrap(), 3);
        assert_eq!(reduce("k", &[0], 0).unwrap(), 1);
        let e = reduce("strata_reduce_f32", &[], 0).unwrap_err().to_string();
        assert_eq!(e, "invalid launch of strata_reduce_f32: no buffers to reduce: a reduction needs at least one");
    }

    #[test]
    fn chunks_lie_inside_equal_buffers() {
        assert_eq!(allreduce_chunk("k", &[10, 10], 2, 8).unwrap(), 2);
        assert_eq!(allreduce_chunk("k", &[10, 10], 10, 0).unwrap(), 2);
        assert_eq!(
            detail(allreduce_chunk("k", &[10, 10], 3, 8)),
            "chunk [3, 3 + 8) does not lie inside buffers of 10 elements"
        );
        assert_eq!(detail(allreduce_chunk("k", &[10, 9], 0, 1)), "buffer 1 has 9 elements, buffer 0 has 10");
        assert!(allreduce_chunk("k", &[10], usize::MAX, 2).is_err());
        assert!(allreduce_chunk("k", &[], 0, 0).is_err());
    }

    #[test]
    fn same_len_names_the_odd_buffer() {
        assert_eq!(same_len("k", &[("dst", 3), ("src", 3)]).unwrap(), 3);
        assert_eq!(detail(same_len("k", &[("param", 3), ("grad", 3), ("m", 2)])), "m has 2 elements, param has 3");
    }

    #[test]
    fn grids_cover_the_work_and_stay_within_limits() {
        assert_eq!(grid("k", 0).unwrap(), None);
        assert_eq!(grid("k", 1).unwrap(), Some((1, BLOCK)));
        assert_eq!(grid("k", 255).unwrap(), Some((1, BLOCK)));
        assert_eq!(grid("k", 256).unwrap(), Some((1, BLOCK)));
        assert_eq!(grid("k", 257).unwrap(), Some((2, BLOCK)));
        assert_eq!(grid("k", 1_000_003).unwrap(), Some((3907, BLOCK)));
        assert_eq!(grid("k", 1 << 40).unwrap(), Some((MAX_GRID, BLOCK)));
        assert!(grid("k", u64::MAX).is_err());
        for items in [1u64, 7, 255, 256, 257, 1_000_003, 1 << 33] {
            let (g, b) = grid("k", items).unwrap().unwrap();
            assert!((1..=MAX_GRID).contains(&g) && b == BLOCK);
            // the grid-stride loop covers every item: some thread starts at each index below g*b,
            // and g*b >= items unless capped
            assert!(u64::from(g) * u64::from(b) >= items || g == MAX_GRID);
        }
    }

    #[test]
    fn vectorized_only_when_everything_is_aligned() {
        assert!(vector_aligned([0u64, 16, 4096]));
        assert!(!vector_aligned([0u64, 4]));
        assert!(vector_aligned(std::iter::empty()));
        assert!(chunk_vector_aligned([0u64, 32], 8));
        assert!(!chunk_vector_aligned([0u64, 32], 6));
        // aligned chunk addresses (8 + 2 * 4 = 16) on misaligned bases do not qualify
        assert!(!chunk_vector_aligned([8u64], 2));
        assert_eq!(vector_items(1), 1);
        assert_eq!(vector_items(3), 1);
        assert_eq!(vector_items(4), 1);
        assert_eq!(vector_items(257), 65);
        // the tail is done by threads 0..len % 4 of the grid, which always exist
        for len in [1usize, 2, 3, 5, 255, 257, 1_000_003] {
            let (g, b) = grid("k", vector_items(len)).unwrap().unwrap();
            assert!(u64::from(g) * u64::from(b) >= (len % 4) as u64);
        }
    }
}
