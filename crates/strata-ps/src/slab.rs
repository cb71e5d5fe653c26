//! A table shard's rows in blocks: [`Slab`] grows by a block of rows at a time and never moves
//! a row. A `Vec` that doubles copies every row into its new allocation and holds both at once:
//! a shard of 200 MB of rows needed 600 MB at its last doubling (the copy, and the new pages the
//! kernel zeroes), and held the task's state lock through the copy.

/// Rows a block holds: at 16 f32 values a row, 1 MiB blocks.
pub(crate) const BLOCK_ROWS: usize = 1 << 14;

/// Rows of `width` elements each, in blocks of [`BLOCK_ROWS`] rows (a width of 0 holds only a
/// count).
#[derive(Clone, Debug, Default)]
pub(crate) struct Slab<T> {
    width: usize,
    rows: usize,
    /// Every block but those past `rows` is full; a block is allocated whole, with its capacity
    /// exact, before a row is written to it.
    blocks: Vec<Vec<T>>,
}

impl<T: Copy + Default> Slab<T> {
    /// An empty slab of rows of `width` elements.
    pub(crate) fn new(width: usize) -> Self {
        Self { width, rows: 0, blocks: Vec::new() }
    }

    /// The `rows` rows of `values` (`width` elements each, one after another; `rows * width`
    /// values).
    pub(crate) fn from_slice(width: usize, rows: usize, values: &[T]) -> Self {
        let mut s = Self::new(width);
        s.rows = rows;
        if width == 0 {
            return s;
        }
        s.blocks = values
            .chunks(BLOCK_ROWS * width)
            .map(|c| {
                let mut b = Vec::with_capacity(BLOCK_ROWS * width);
                b.extend_from_slice(c);
                b
            })
            .collect();
        s
    }

    /// The number of rows.
    pub(crate) fn len(&self) -> usize {
        self.rows
    }

    /// Row `r`.
    pub(crate) fn row(&self, r: usize) -> &[T] {
        if self.width == 0 {
            return &[];
        }
        let at = (r % BLOCK_ROWS) * self.width;
        &self.blocks[r / BLOCK_ROWS][at..at + self.width]
    }

    /// Row `r`, to change.
    pub(crate) fn row_mut(&mut self, r: usize) -> &mut [T] {
        if self.width == 0 {
            return &mut [];
        }
        let at = (r % BLOCK_ROWS) * self.width;
        &mut self.blocks[r / BLOCK_ROWS][at..at + self.width]
    }

    /// Makes room for `n` more rows (allocating the blocks they need); `Err` when the memory
    /// is not there, with nothing changed that [`Self::push`] would see.
    pub(crate) fn try_reserve(&mut self, n: usize) -> Result<(), std::collections::TryReserveError> {
        if self.width == 0 {
            return Ok(());
        }
        let need = (self.rows + n).div_ceil(BLOCK_ROWS);
        while self.blocks.len() < need {
            let mut b = Vec::new();
            b.try_reserve_exact(BLOCK_ROWS * self.width)?;
            self.blocks.try_reserve(1)?;
            self.blocks.push(b);
        }
        Ok(())
    }

    /// Appends a row of default values and returns it (room reserved by [`Self::try_reserve`]
    /// first, or a block is allocated here).
    pub(crate) fn push(&mut self) -> &mut [T] {
        let r = self.rows;
        self.rows += 1;
        if self.width == 0 {
            return &mut [];
        }
        if self.blocks.len() <= r / BLOCK_ROWS {
            self.blocks.push(Vec::with_capacity(BLOCK_ROWS * self.width));
        }
        let block = &mut self.blocks[r / BLOCK_ROWS];
        let at = block.len();
        block.resize(at + self.width, T::default());
        &mut block[at..]
    }

    /// Removes row `r`, moving the last row into its place; a block left empty is freed,
    /// beyond one spare.
    pub(crate) fn swap_remove(&mut self, r: usize) {
        let last = self.rows - 1;
        if self.width > 0 {
            if r != last {
                let moved: Vec<T> = self.row(last).to_vec();
                self.row_mut(r).copy_from_slice(&moved);
            }
            let block = &mut self.blocks[last / BLOCK_ROWS];
            block.truncate(block.len() - self.width);
            // Keep at most one empty block past the rows, so a shard at its bound that evicts and
            // creates in turn does not allocate and free a block each time.
            while self.blocks.len() > last.div_ceil(BLOCK_ROWS) + 1 {
                self.blocks.pop();
            }
        }
        self.rows = last;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against a `Vec` of rows, through block boundaries: pushes, swap removes to an empty
    /// slab and back, rows read and changed, and a slab built from a slice.
    #[test]
    fn a_slab_holds_what_a_vec_of_rows_holds() {
        for width in [0, 1, 3, 16] {
            let mut s: Slab<u32> = Slab::new(width);
            let mut v: Vec<Vec<u32>> = Vec::new();
            let n = 2 * BLOCK_ROWS + 5;
            s.try_reserve(10).unwrap();
            for i in 0..n {
                let row: Vec<u32> = (0..width as u32).map(|j| i as u32 * 31 + j).collect();
                s.push().copy_from_slice(&row);
                v.push(row);
            }
            // Remove every third row from the front, some from the end.
            let mut i = 0;
            while i < s.len() {
                s.swap_remove(i);
                v.swap_remove(i);
                i += 3;
            }
            for _ in 0..7 {
                let last = s.len() - 1;
                s.swap_remove(last);
                v.pop();
            }
            assert_eq!(s.len(), v.len(), "width {width}");
            for (r, row) in v.iter().enumerate() {
                assert_eq!(s.row(r), row.as_slice(), "width {width}, row {r}");
            }
            s.row_mut(5).iter_mut().for_each(|x| *x = 7);
            v[5].iter_mut().for_each(|x| *x = 7);
            let flat: Vec<u32> = v.concat();
            let rebuilt = Slab::from_slice(width, v.len(), &flat);
            assert_eq!(rebuilt.len(), v.len());
            for r in 0..rebuilt.len() {
                assert_eq!(rebuilt.row(r), s.row(r), "width {width}, row {r}");
            }
            while s.len() > 0 {
                s.swap_remove(0);
                v.swap_remove(0);
                if let Some(row) = v.first() {
                    assert_eq!(s.row(0), row.as_slice());
                }
            }
            assert!(s.blocks.len() <= 1, "empty blocks freed, one spare kept");
            s.push();
            assert_eq!(s.len(), 1);
        }
    }
}
