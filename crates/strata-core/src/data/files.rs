//! Datasets read from files: fixed-size records streamed with bounded memory
//! ([`TokenRecords`]: token sequences and their next-token targets), re-cut to the global
//! batch size across file boundaries ([`FileBatches`]), and handed to workers whole under
//! [`AutoShardPolicy::File`](crate::extended::AutoShardPolicy::File) by
//! [`Strategy::distribute_files`](crate::Strategy::distribute_files).
//!
//! Memory: a [`TokenRecords`] reader holds one read of `chunk` records (and a 64 KiB file
//! buffer); [`FileBatches`] holds at most one batch plus one read of the file being read. A
//! file of any size streams through that, never loaded whole.
//!
//! ```
//! # fn main() -> strata_core::Result<()> {
//! use strata_core::data::files::{TokenRecords, TokenWidth};
//! use strata_core::data::TailPolicy;
//! use strata_core::{Strategy, StrategyHandle};
//!
//! # let dir = tempfile::tempdir().unwrap();
//! # let path = dir.path().join("tokens.bin");
//! // 8 records of 5 u16 tokens: inputs of 4 tokens and their next-token targets.
//! # std::fs::write(&path, (0..40u16).flat_map(u16::to_le_bytes).collect::<Vec<u8>>()).unwrap();
//! let strategy = StrategyHandle::current();
//! let files = vec![path];
//! let mut data = strategy.distribute_files(&files, 3, TailPolicy::Split, |p| TokenRecords::open(p, 4, TokenWidth::U16, 2))?;
//! let sizes: Vec<usize> = data.by_ref().map(|b| b.global_len()).collect();
//! assert_eq!(sizes, vec![3, 3, 2]);
//! assert!(data.take_error().is_none(), "every file was read whole");
//! # Ok(())
//! # }
//! ```

use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use super::{BatchData, ErrorSlot};
use crate::{Error, Result};

/// How a token is stored in a record file: little-endian u16 (vocabularies up to 65,536, as
/// most pre-tokenised corpora) or u32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenWidth {
    /// Two bytes per token.
    U16,
    /// Four bytes per token.
    U32,
}

impl TokenWidth {
    /// Bytes per token.
    pub fn bytes(self) -> usize {
        match self {
            TokenWidth::U16 => 2,
            TokenWidth::U32 => 4,
        }
    }
}

/// A file of fixed-size token records, each `seq_len + 1` tokens: a record gives the inputs
/// (its first `seq_len` tokens) and the targets (its last `seq_len`, the next token of each
/// input). Yields `(inputs, targets)`, two u32 tensors of `(k, seq_len)` for up to `chunk`
/// records at a time, reading the file sequentially into one reused buffer; a read that fails
/// is yielded as the error and ends the iteration.
#[derive(Debug)]
pub struct TokenRecords {
    path: PathBuf,
    reader: BufReader<File>,
    seq_len: usize,
    width: TokenWidth,
    chunk: usize,
    remaining: u64,
    buf: Vec<u8>,
}

impl TokenRecords {
    /// Opens `path` as records of `seq_len + 1` tokens of `width`, read `chunk` records at a
    /// time. An error, naming the file, if it cannot be opened or its size is not a multiple
    /// of the record's ([`Error::RecordFile`]).
    pub fn open(path: &Path, seq_len: usize, width: TokenWidth, chunk: usize) -> Result<Self> {
        if seq_len == 0 || chunk == 0 {
            return Err(Error::Dataset(format!(
                "token records of {seq_len} tokens read {chunk} at a time from {}: use a sequence length and a chunk of at least 1",
                path.display()
            )));
        }
        let file = File::open(path).map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
        let size = file.metadata().map_err(|e| Error::io(format!("reading the size of {}", path.display()), e))?.len();
        let record = ((seq_len + 1) * width.bytes()) as u64;
        if size % record != 0 {
            return Err(Error::RecordFile { path: path.display().to_string(), size, record });
        }
        Ok(Self {
            path: path.to_path_buf(),
            reader: BufReader::with_capacity(1 << 16, file),
            seq_len,
            width,
            chunk,
            remaining: size / record,
            buf: Vec::new(),
        })
    }

    /// The records not read yet.
    pub fn remaining(&self) -> u64 {
        self.remaining
    }

    /// The bytes the reader's own record buffer holds (at most one chunk of records).
    pub fn buffer_bytes(&self) -> usize {
        self.buf.capacity()
    }

    fn read_chunk(&mut self) -> Result<(Tensor, Tensor)> {
        let k = self.remaining.min(self.chunk as u64) as usize;
        let tokens = self.seq_len + 1;
        self.buf.resize(k * tokens * self.width.bytes(), 0);
        self.reader.read_exact(&mut self.buf).map_err(|e| Error::io(format!("reading {}", self.path.display()), e))?;
        self.remaining -= k as u64;
        let ids: Vec<u32> = match self.width {
            TokenWidth::U16 => self.buf.chunks_exact(2).map(|b| u32::from(u16::from_le_bytes([b[0], b[1]]))).collect(),
            TokenWidth::U32 => self.buf.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        };
        let all = Tensor::from_vec(ids, (k, tokens), &Device::Cpu)?;
        Ok((all.narrow(1, 0, self.seq_len)?.contiguous()?, all.narrow(1, 1, self.seq_len)?.contiguous()?))
    }
}

impl Iterator for TokenRecords {
    type Item = Result<(Tensor, Tensor)>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.remaining == 0 {
            return None;
        }
        let r = self.read_chunk();
        if r.is_err() {
            self.remaining = 0;
        }
        Some(r)
    }
}

/// Batches of exactly `size` examples (the last one smaller) from files read one after the
/// other with `read`, whatever sizes the reads have: a stream's rows re-cut across file
/// boundaries. Holds at most one batch plus one of `read`'s. An error (a file that cannot be
/// opened or read, reads that cannot be joined) ends the iteration and is left in the
/// dataset's error slot, where [`DistributedDataset::take_error`](super::DistributedDataset::take_error)
/// finds it.
pub struct FileBatches<B, I, F> {
    files: VecDeque<PathBuf>,
    read: F,
    current: Option<I>,
    pending: Vec<B>,
    pending_rows: usize,
    size: usize,
    error: ErrorSlot,
}

impl<B, I, F> std::fmt::Debug for FileBatches<B, I, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileBatches")
            .field("files_left", &self.files.len())
            .field("size", &self.size)
            .field("pending_rows", &self.pending_rows)
            .finish()
    }
}

impl<B, I, F> FileBatches<B, I, F>
where
    B: BatchData,
    I: Iterator<Item = Result<B>>,
    F: FnMut(&Path) -> Result<I>,
{
    /// Batches of `size` examples from `files`, in order, each opened with `read`; errors go
    /// to `error`.
    pub fn new(files: Vec<PathBuf>, size: usize, read: F, error: ErrorSlot) -> Self {
        Self {
            files: files.into(),
            read,
            current: None,
            pending: Vec::new(),
            pending_rows: 0,
            size: size.max(1),
            error,
        }
    }

    /// Rows held and not yet handed out (less than one batch plus one read between calls).
    pub fn pending_rows(&self) -> usize {
        self.pending_rows
    }

    /// The reader of the file being read, if one is open.
    pub fn reading(&self) -> Option<&I> {
        self.current.as_ref()
    }

    /// The files not opened yet.
    pub fn files_left(&self) -> usize {
        self.files.len()
    }

    fn fill(&mut self) -> Result<()> {
        while self.pending_rows < self.size {
            if let Some(it) = &mut self.current {
                match it.next() {
                    Some(b) => {
                        let b = b?;
                        self.pending_rows += b.rows()?;
                        self.pending.push(b);
                        continue;
                    }
                    None => self.current = None,
                }
            }
            let Some(path) = self.files.pop_front() else { return Ok(()) };
            self.current = Some((self.read)(&path)?);
        }
        Ok(())
    }

    fn cut(&mut self) -> Result<Option<B>> {
        self.fill()?;
        if self.pending_rows == 0 {
            return Ok(None);
        }
        let pending = std::mem::take(&mut self.pending);
        let joined = match <[B; 1]>::try_from(pending) {
            Ok([one]) => one,
            Err(many) => B::concat(&many)?,
        };
        let rows = self.pending_rows;
        if rows <= self.size {
            self.pending_rows = 0;
            return Ok(Some(joined));
        }
        self.pending = vec![joined.slice(self.size..rows)?];
        self.pending_rows = rows - self.size;
        Ok(Some(joined.slice(0..self.size)?))
    }
}

impl<B, I, F> Iterator for FileBatches<B, I, F>
where
    B: BatchData,
    I: Iterator<Item = Result<B>>,
    F: FnMut(&Path) -> Result<I>,
{
    type Item = B;

    fn next(&mut self) -> Option<B> {
        match self.cut() {
            Ok(b) => b,
            Err(e) => {
                self.files.clear();
                self.current = None;
                self.pending.clear();
                self.pending_rows = 0;
                self.error.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get_or_insert(e);
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_tokens(path: &Path, tokens: &[u16]) {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        std::fs::write(path, bytes).unwrap();
    }

    #[test]
    fn token_records_stream_inputs_and_shifted_targets_in_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens.bin");
        // 5 records of 4 tokens (seq_len 3): record r is 10r .. 10r + 3.
        let tokens: Vec<u16> = (0..5u16).flat_map(|r| (0..4).map(move |t| 10 * r + t)).collect();
        write_tokens(&path, &tokens);
        let mut rec = TokenRecords::open(&path, 3, TokenWidth::U16, 2).unwrap();
        let (x, y) = rec.next().unwrap().unwrap();
        assert_eq!(x.to_vec2::<u32>().unwrap(), vec![vec![0, 1, 2], vec![10, 11, 12]]);
        assert_eq!(y.to_vec2::<u32>().unwrap(), vec![vec![1, 2, 3], vec![11, 12, 13]]);
        assert_eq!(rec.buffer_bytes(), 2 * 4 * 2, "one chunk of records, never the file");
        let rest: Vec<usize> = rec.map(|r| r.unwrap().0.dims()[0]).collect();
        assert_eq!(rest, vec![2, 1]);
        // A size that is not a multiple of the record.
        write_tokens(&path, &tokens[..7]);
        let e = TokenRecords::open(&path, 3, TokenWidth::U16, 2).unwrap_err().to_string();
        assert!(e.contains("tokens.bin") && e.contains("14 bytes") && e.contains("records of 8 bytes"), "{e}");
    }

    #[test]
    fn file_batches_cut_across_files_with_bounded_memory() {
        let dir = tempfile::tempdir().unwrap();
        let mut files = Vec::new();
        for f in 0..3u16 {
            let path = dir.path().join(format!("part-{f}.bin"));
            // 3 records of 2 tokens each per file (seq_len 1)
            write_tokens(&path, &(0..6).map(|t| 100 * f + t).collect::<Vec<_>>());
            files.push(path);
        }
        let slot = ErrorSlot::default();
        let read = |p: &Path| TokenRecords::open(p, 1, TokenWidth::U16, 2);
        let mut batches = FileBatches::new(files, 4, read, slot.clone());
        let mut firsts = Vec::new();
        let mut sizes = Vec::new();
        while let Some((x, _)) = batches.next() {
            sizes.push(x.dims()[0]);
            firsts.extend(x.flatten_all().unwrap().to_vec1::<u32>().unwrap());
            assert!(batches.pending_rows() < 4 + 2, "at most a batch and a read are held");
        }
        assert_eq!(sizes, vec![4, 4, 1]);
        assert_eq!(firsts, vec![0, 2, 4, 100, 102, 104, 200, 202, 204]);
        assert!(slot.lock().unwrap().is_none());
    }
}
