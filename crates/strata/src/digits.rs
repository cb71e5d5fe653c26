//! The digits data set shipped with Strata (`data/digits.csv.gz`, built into the binary).
//!
//! Optical Recognition of Handwritten Digits (E. Alpaydin, C. Kaynak, 1998), the copy of the
//! UCI test set that scikit-learn ships; UCI, CC BY 4.0. 1,797 rows of 64 pixel values in
//! 0..=16 (an 8x8 image) and a label in 0..=9.

use std::io::Read;
use std::path::Path;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use strata_core::data::Batch;

use crate::{Error, Result};

/// The shipped data file's bytes.
pub const DIGITS_CSV_GZ: &[u8] = include_bytes!("../../../data/digits.csv.gz");
/// Pixels per image.
pub const FEATURES: usize = 64;
/// Classes.
pub const CLASSES: usize = 10;

/// Loads digits from `path`, or the shipped copy when `path` is `None`. Pixel values are
/// scaled to `[0, 1]`. Gzip is detected by its magic bytes, so a plain CSV works too.
pub fn load(path: Option<&Path>) -> Result<Batch> {
    let (name, bytes) = match path {
        None => ("data/digits.csv.gz (built in)".to_string(), DIGITS_CSV_GZ.to_vec()),
        Some(p) => {
            let bytes = std::fs::read(p).map_err(|e| Error::Data {
                path: p.display().to_string(),
                reason: format!("cannot read it ({e}); give the path of a digits CSV (.csv or .csv.gz)"),
            })?;
            (p.display().to_string(), bytes)
        }
    };
    parse(&bytes, &name)
}

/// Parses digits CSV bytes (gzip or plain).
pub fn parse(bytes: &[u8], name: &str) -> Result<Batch> {
    let bad = |reason: String| Error::Data { path: name.to_string(), reason };
    let text = if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut s = String::new();
        flate2::read::GzDecoder::new(bytes)
            .read_to_string(&mut s)
            .map_err(|e| bad(format!("not a valid gzip file of UTF-8 text ({e})")))?;
        s
    } else {
        String::from_utf8(bytes.to_vec()).map_err(|_| bad("not UTF-8 text nor gzip".into()))?
    };
    let mut features = Vec::new();
    let mut labels = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split(',').collect();
        if fields.len() != FEATURES + 1 {
            return Err(bad(format!(
                "line {}: expected {} comma-separated values (64 pixels and a label), found {}",
                i + 1,
                FEATURES + 1,
                fields.len()
            )));
        }
        for (j, f) in fields.iter().enumerate() {
            let v: f32 = f
                .trim()
                .parse()
                .map_err(|_| bad(format!("line {}, column {}: {f:?} is not a number", i + 1, j + 1)))?;
            if j < FEATURES {
                if !(0.0..=16.0).contains(&v) {
                    return Err(bad(format!("line {}, column {}: pixel {v} is outside 0..=16", i + 1, j + 1)));
                }
                features.push(v / 16.0);
            } else {
                if v.fract() != 0.0 || !(0.0..CLASSES as f32).contains(&v) {
                    return Err(bad(format!("line {}: label {v} is not a digit 0..=9", i + 1)));
                }
                labels.push(v as u32);
            }
        }
    }
    if labels.is_empty() {
        return Err(bad("no rows".into()));
    }
    Ok(Batch::new(features, labels, FEATURES)?)
}

/// Splits `all` into train and test sets: a fixed permutation from `seed`, then the last
/// `test_fraction` of it is the test set.
pub fn train_test_split(all: &Batch, test_fraction: f64, seed: u64) -> (Batch, Batch) {
    let mut idx: Vec<usize> = (0..all.len()).collect();
    idx.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
    let n_test = ((all.len() as f64) * test_fraction).round() as usize;
    let (train, test) = idx.split_at(all.len() - n_test);
    (gather(all, train), gather(all, test))
}

/// The rows `idx` of `b`, in that order.
pub fn gather(b: &Batch, idx: &[usize]) -> Batch {
    let mut features = Vec::with_capacity(idx.len() * b.dim);
    let mut labels = Vec::with_capacity(idx.len());
    for &i in idx {
        features.extend_from_slice(&b.features[i * b.dim..(i + 1) * b.dim]);
        labels.push(b.labels[i]);
    }
    Batch { features, labels, dim: b.dim }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_file_parses() {
        let all = load(None).unwrap();
        assert_eq!(all.len(), 1797);
        assert_eq!(all.dim, 64);
        assert!(all.features.iter().all(|&x| (0.0..=1.0).contains(&x)));
        let mut counts = [0usize; 10];
        all.labels.iter().for_each(|&l| counts[l as usize] += 1);
        assert!(counts.iter().all(|&c| c > 150), "{counts:?}");
        let (train, test) = train_test_split(&all, 0.2, 0);
        assert_eq!((train.len(), test.len()), (1438, 359));
    }

    #[test]
    fn corrupt_input_names_the_line() {
        let e = parse(b"1,2,3\n", "x.csv").unwrap_err().to_string();
        assert!(e.contains("x.csv") && e.contains("line 1") && e.contains("65"), "{e}");
        let row = |px: &str, label: &str| format!("{}{label}\n", format!("{px},").repeat(64));
        let e = parse(row("17", "1").as_bytes(), "y.csv").unwrap_err().to_string();
        assert!(e.contains("outside 0..=16"), "{e}");
        let e = parse(row("3", "12").as_bytes(), "y.csv").unwrap_err().to_string();
        assert!(e.contains("not a digit"), "{e}");
        let e = parse(&[0x1f, 0x8b, 1, 2, 3], "z.gz").unwrap_err().to_string();
        assert!(e.contains("gzip"), "{e}");
        assert!(parse(row("3", "7").as_bytes(), "ok.csv").is_ok());
    }
}
