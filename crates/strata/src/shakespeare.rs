//! Tiny Shakespeare for the character language model ([`crate::transformer::CharTransformer`]):
//! the text built into the binary (`data/tinyshakespeare.txt.gz`, attribution in
//! `data/README.md`), its character vocabulary, the usual split (the first 90% of the
//! characters train, the last 10% validate) and batches of windows.
//!
//! A batch is the general batch type `(inputs, targets)`: two u32 tensors of shape `(N, T)`,
//! where `targets[i][t]` is the character after `inputs[i][t]` (the same window shifted by one).
//! Training windows start at random offsets of the training text, drawn with a seeded RNG
//! ([`Corpus::random_windows`]: the same seed gives the same windows), so a run of `S` steps of
//! `B` windows trains on `S * B` windows drawn once before training; validation windows are
//! fixed: consecutive, non-overlapping windows covering the validation text
//! ([`Corpus::validation_windows`]), so the validation loss is the mean cross-entropy, in nats
//! per character, over (nearly) every validation character.

use std::collections::BTreeMap;
use std::io::Read;

use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};

use crate::{Error, Result};

/// The gzip-compressed text, built into the binary.
pub const TINY_SHAKESPEARE_GZ: &[u8] = include_bytes!("../../../data/tinyshakespeare.txt.gz");

/// The share of the characters that trains (the rest validates).
pub const TRAIN_SHARE: f64 = 0.9;

/// The largest decompressed text accepted (the shipped one has 1,115,394 bytes).
const MAX_TEXT_BYTES: u64 = 64 << 20;

/// The text as character ids, split into training and validation parts, with its vocabulary.
#[derive(Clone, Debug)]
pub struct Corpus {
    /// The vocabulary: the text's distinct characters, sorted (a character's id is its index).
    pub vocab: Vec<char>,
    /// The first [`TRAIN_SHARE`] of the text's characters, as ids.
    pub train: Vec<u32>,
    /// The rest, as ids.
    pub validation: Vec<u32>,
    index: BTreeMap<char, u32>,
}

/// Loads the built-in Tiny Shakespeare.
pub fn load() -> Result<Corpus> {
    let data_error = |reason: String| Error::Data { path: "data/tinyshakespeare.txt.gz (built in)".into(), reason };
    let mut text = String::new();
    flate2::read::GzDecoder::new(TINY_SHAKESPEARE_GZ)
        .take(MAX_TEXT_BYTES)
        .read_to_string(&mut text)
        .map_err(|e| data_error(format!("cannot decompress it ({e}); rebuild with the file from the repository")))?;
    Corpus::from_text(&text).map_err(|e| data_error(e.to_string()))
}

impl Corpus {
    /// The corpus of `text`: its sorted distinct characters as the vocabulary, the first
    /// [`TRAIN_SHARE`] of its characters as training text, the rest as validation text.
    pub fn from_text(text: &str) -> Result<Self> {
        let mut vocab: Vec<char> = text.chars().collect::<std::collections::BTreeSet<_>>().into_iter().collect();
        vocab.sort_unstable();
        let index: BTreeMap<char, u32> = vocab.iter().enumerate().map(|(i, &c)| (c, i as u32)).collect();
        let ids: Vec<u32> = text.chars().map(|c| index[&c]).collect();
        if ids.len() < 20 {
            return Err(Error::Usage(format!(
                "a text of {} characters is too short to split into training and validation parts; give at least 20",
                ids.len()
            )));
        }
        let cut = (ids.len() as f64 * TRAIN_SHARE) as usize;
        Ok(Self { vocab, train: ids[..cut].to_vec(), validation: ids[cut..].to_vec(), index })
    }

    /// The number of distinct characters (65 for Tiny Shakespeare).
    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// The ids of `text`'s characters; a character outside the vocabulary is an error naming it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        text.chars()
            .map(|c| {
                self.index.get(&c).copied().ok_or_else(|| {
                    Error::Usage(format!("the character {c:?} is not in the corpus' vocabulary; leave it out"))
                })
            })
            .collect()
    }

    /// The text of `ids` (ids outside the vocabulary become `?`).
    pub fn decode(&self, ids: &[u32]) -> String {
        ids.iter().map(|&i| self.vocab.get(i as usize).copied().unwrap_or('?')).collect()
    }

    /// `n` training windows of `context` characters at random offsets drawn with `seed`, as
    /// `(inputs, targets)` u32 tensors of shape `(n, context)` on the CPU.
    pub fn random_windows(&self, n: usize, context: usize, seed: u64) -> Result<(Tensor, Tensor)> {
        let span = self.window_span(&self.train, context, "training")?;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let starts: Vec<usize> = (0..n).map(|_| rng.random_range(0..span)).collect();
        windows(&self.train, &starts, context)
    }

    /// The validation text cut into consecutive windows of `context` characters (the last
    /// partial window left out), as `(inputs, targets)` u32 tensors of shape `(n, context)`.
    pub fn validation_windows(&self, context: usize) -> Result<(Tensor, Tensor)> {
        let span = self.window_span(&self.validation, context, "validation")?;
        let starts: Vec<usize> = (0..span).step_by(context).collect();
        windows(&self.validation, &starts, context)
    }

    /// The number of offsets at which a window of `context` characters (and its next
    /// character) fits in `ids`.
    fn window_span(&self, ids: &[u32], context: usize, part: &str) -> Result<usize> {
        if context == 0 || ids.len() <= context {
            return Err(Error::Usage(format!(
                "a context of {context} characters does not fit the {part} text of {} characters; use a context from 1 to {}",
                ids.len(),
                ids.len().saturating_sub(1)
            )));
        }
        Ok(ids.len() - context)
    }
}

/// The windows of `context` ids starting at `starts`, and the same windows shifted by one.
fn windows(ids: &[u32], starts: &[usize], context: usize) -> Result<(Tensor, Tensor)> {
    let mut x = Vec::with_capacity(starts.len() * context);
    let mut y = Vec::with_capacity(starts.len() * context);
    for &s in starts {
        x.extend_from_slice(&ids[s..s + context]);
        y.extend_from_slice(&ids[s + 1..s + context + 1]);
    }
    let shape = (starts.len(), context);
    Ok((Tensor::from_vec(x, shape, &Device::Cpu)?, Tensor::from_vec(y, shape, &Device::Cpu)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_text_has_65_characters_and_a_90_10_split() {
        let c = load().unwrap();
        assert_eq!(c.vocab_size(), 65);
        assert_eq!(c.train.len() + c.validation.len(), 1_115_394);
        assert_eq!(c.train.len(), 1_003_854);
        assert_eq!(c.decode(&c.encode("First Citizen:").unwrap()), "First Citizen:");
        assert!(c.encode("é").unwrap_err().to_string().contains("not in the corpus' vocabulary"));
    }

    #[test]
    fn windows_and_their_targets_are_shifted_by_one() {
        let c = Corpus::from_text(&"abcdefghij".repeat(10)).unwrap();
        let (x, y) = c.random_windows(5, 8, 7).unwrap();
        assert_eq!(x.dims(), [5, 8]);
        let (x, y) = (x.to_vec2::<u32>().unwrap(), y.to_vec2::<u32>().unwrap());
        for (xr, yr) in x.iter().zip(&y) {
            assert_eq!(xr[1..], yr[..7]);
            assert_eq!(yr[7], (xr[7] + 1) % 10);
        }
        let again = c.random_windows(5, 8, 7).unwrap().0.to_vec2::<u32>().unwrap();
        assert_eq!(x, again, "the same seed draws the same windows");
        let (vx, _) = c.validation_windows(4).unwrap();
        assert_eq!(vx.dims(), [2, 4], "10 validation characters: offsets 0 and 4 fit a window and its target");
        assert!(c.validation_windows(10).is_err());
    }
}
