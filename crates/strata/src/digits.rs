//! The digits data set shipped with Strata (`data/digits.csv.gz`, built into the binary).
//!
//! Optical Recognition of Handwritten Digits (E. Alpaydin, C. Kaynak, 1998), the copy of the
//! UCI test set that scikit-learn ships; UCI, CC BY 4.0. 1,797 rows of 64 pixel values in
//! 0..=16 (an 8x8 image) and a label in 0..=9.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

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
/// The most bytes of text a digits file may hold, after decompression: 256 MiB, about 2
/// million rows (the shipped file has 1,797 in 0.5 MiB).
pub const MAX_TEXT_BYTES: u64 = 256 << 20;
/// The longest line of a digits file: 4 KiB (a row is 65 numbers, about 200 bytes).
pub const MAX_LINE_BYTES: usize = 4096;
/// The most rows a digits file may hold: 2^21 (0.5 GiB of f32 features).
pub const MAX_ROWS: usize = 1 << 21;

/// Loads digits from `path`, or the shipped copy when `path` is `None`. Pixel values are
/// scaled to `[0, 1]`. Gzip is detected by its magic bytes, so a plain CSV works too. The file
/// is read line by line and refused past [`MAX_LINE_BYTES`] a line, [`MAX_TEXT_BYTES`] or
/// [`MAX_ROWS`] (so `/dev/zero` or a gzip bomb is an error, not a process that grows until it
/// is killed).
///
/// A directory is a data set sharded into files: its shards ([`shard_files`]) joined.
pub fn load(path: Option<&Path>) -> Result<Batch> {
    match path {
        None => parse(DIGITS_CSV_GZ, "data/digits.csv.gz (built in)"),
        Some(p) if p.is_dir() => load_files(&shard_files(p)?),
        Some(p) => {
            let name = p.display().to_string();
            let file = std::fs::File::open(p).map_err(|e| Error::Data {
                path: name.clone(),
                reason: format!("cannot read it ({e}); give the path of a digits CSV (.csv or .csv.gz)"),
            })?;
            parse_reader(BufReader::new(file), &name)
        }
    }
}

/// The files of a digits data set at `path`: the file itself, or, for a directory (a data set
/// sharded into files), its `.csv` and `.csv.gz` files sorted by name. An error names a
/// directory that holds none.
pub fn shard_files(path: &Path) -> Result<Vec<PathBuf>> {
    let name = path.display().to_string();
    if !path.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let entries = std::fs::read_dir(path).map_err(|e| Error::Data {
        path: name.clone(),
        reason: format!("cannot list the directory ({e}); give a digits CSV or a directory of them"),
    })?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let n = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            p.is_file() && (n.ends_with(".csv") || n.ends_with(".csv.gz"))
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::Data {
            path: name,
            reason: "a directory without .csv or .csv.gz files; put the data set's shards in it".into(),
        });
    }
    Ok(files)
}

/// Loads `files` (each as [`load`] does) and joins their rows in order: at most [`MAX_ROWS`]
/// rows in all.
pub fn load_files(files: &[PathBuf]) -> Result<Batch> {
    let mut parts = Vec::with_capacity(files.len());
    let mut rows = 0;
    for f in files {
        let part = load(Some(f))?;
        rows += part.len();
        if rows > MAX_ROWS {
            return Err(Error::Data {
                path: f.display().to_string(),
                reason: format!("the files up to this one hold more than {MAX_ROWS} rows, the limit"),
            });
        }
        parts.push(part);
    }
    Ok(<Batch as strata_core::data::BatchData>::concat(&parts)?)
}

/// Parses digits CSV bytes (gzip or plain).
pub fn parse(bytes: &[u8], name: &str) -> Result<Batch> {
    parse_reader(bytes, name)
}

/// How much a digits file may hold.
#[derive(Clone, Copy, Debug)]
struct Limits {
    text_bytes: u64,
    line_bytes: usize,
    rows: usize,
}

const LIMITS: Limits = Limits { text_bytes: MAX_TEXT_BYTES, line_bytes: MAX_LINE_BYTES, rows: MAX_ROWS };

/// Parses digits CSV (gzip or plain) from `reader`, within the limits of [`load`].
fn parse_reader<R: BufRead>(reader: R, name: &str) -> Result<Batch> {
    parse_limited(reader, name, LIMITS)
}

fn parse_limited<R: BufRead>(mut reader: R, name: &str, limits: Limits) -> Result<Batch> {
    let bad = |reason: String| Error::Data { path: name.to_string(), reason };
    let head = reader.fill_buf().map_err(|e| bad(format!("cannot read it ({e})")))?;
    if head.starts_with(&[0x1f, 0x8b]) {
        let text = BufReader::new(flate2::read::GzDecoder::new(reader));
        parse_lines(text, name, limits, |e| format!("not a valid gzip file of UTF-8 text ({e})"))
    } else {
        parse_lines(reader, name, limits, |e| format!("cannot read it ({e})"))
    }
}

/// Parses the rows of `reader`, line by line; `io` words a read error.
fn parse_lines<R: BufRead>(
    reader: R,
    name: &str,
    limits: Limits,
    io: impl Fn(std::io::Error) -> String,
) -> Result<Batch> {
    let bad = |reason: String| Error::Data { path: name.to_string(), reason };
    let Limits { text_bytes, line_bytes, rows } = limits;
    let mut text = reader.take(text_bytes + 1);
    let mut features = Vec::new();
    let mut labels = Vec::new();
    let mut buf = Vec::with_capacity(256);
    let mut total = 0u64;
    for i in 0.. {
        buf.clear();
        let read = (&mut text).take(line_bytes as u64 + 1).read_until(b'\n', &mut buf).map_err(|e| bad(io(e)))?;
        if read == 0 {
            break;
        }
        total += read as u64;
        if total > text_bytes {
            return Err(bad(format!("more than {text_bytes} bytes of text, the limit; a digits file is a few MiB")));
        }
        if buf.last() == Some(&b'\n') {
            buf.pop();
        } else if buf.len() > line_bytes {
            return Err(bad(format!(
                "line {} is longer than {line_bytes} bytes, the limit; a row is 65 comma-separated numbers",
                i + 1
            )));
        }
        let Ok(line) = std::str::from_utf8(&buf) else {
            return Err(bad(format!("line {} is not UTF-8 text (nor is the file gzip)", i + 1)));
        };
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        if labels.len() >= rows {
            return Err(bad(format!("more than {rows} rows, the limit")));
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
    b.select_rows(idx)
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
        let e = parse(&[0xff, 0xfe, b'\n'], "u.csv").unwrap_err().to_string();
        assert!(e.contains("line 1 is not UTF-8"), "{e}");
    }

    #[test]
    fn absurd_lines_and_sizes_are_refused_without_reading_on() {
        // /dev/zero: one endless line, refused at the real limit.
        let e = parse_reader(BufReader::new(std::io::repeat(0)), "/dev/zero").unwrap_err().to_string();
        assert_eq!(
            e,
            "data file /dev/zero: line 1 is longer than 4096 bytes, the limit; a row is 65 comma-separated numbers"
        );
        // A line of exactly the limit is read.
        let row = format!("{}7", "3,".repeat(64));
        let padded = format!("{row}{}\n", " ".repeat(MAX_LINE_BYTES - row.len()));
        assert_eq!(padded.len(), MAX_LINE_BYTES + 1);
        assert_eq!(parse(padded.as_bytes(), "edge.csv").unwrap().len(), 1);
        // Endless empty lines, and a gzip bomb of them: the text limit (small here, for speed).
        let small = Limits { text_bytes: 1 << 16, line_bytes: MAX_LINE_BYTES, rows: 3 };
        let e = parse_limited(BufReader::new(std::io::repeat(b'\n')), "newlines", small).unwrap_err().to_string();
        assert!(e.contains("more than 65536 bytes of text, the limit"), "{e}");
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        std::io::copy(&mut std::io::repeat(b'\n').take(1 << 20), &mut gz).unwrap();
        let bomb = gz.finish().unwrap();
        assert!(bomb.len() < 1 << 12, "{} bytes", bomb.len());
        let e = parse_limited(&bomb[..], "bomb.csv.gz", small).unwrap_err().to_string();
        assert!(e.contains("more than 65536 bytes of text, the limit"), "{e}");
        // Rows.
        let rows = format!("{row}\n").repeat(4);
        let e = parse_limited(rows.as_bytes(), "rows.csv", small).unwrap_err().to_string();
        assert!(e.contains("more than 3 rows, the limit"), "{e}");
        assert_eq!(parse_limited(format!("{row}\n").repeat(3).as_bytes(), "rows.csv", small).unwrap().len(), 3);
    }
}
