//! `strata ctr-data`: the ctr model's generated records as files, for other frameworks (a
//! TensorFlow peer trains on them): `train.bin` and `test.bin`, fixed 160-byte little-endian
//! records (`label: f32` 0.0 or 1.0, `dense: [f32; 13]` already `log(1 + x)`, `ids: [u32; 26]`
//! global row ids), and `meta.json`. The records are those `strata train --model ctr` trains
//! and tests on with the same `--seed` and `--embedding-rows`.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use strata::ctr::{CtrData, Split, FIELDS, RECORD_BYTES};

use crate::train_args::{CTR_ROWS, CTR_TEST_RECORDS, CTR_TRAIN_RECORDS};
use crate::{Error, Result};

/// `strata ctr-data` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct CtrDataArgs {
    /// The directory to write `train.bin`, `test.bin` and `meta.json` into (made if missing).
    #[arg(long)]
    pub out: PathBuf,
    /// Training records.
    #[arg(long, default_value_t = CTR_TRAIN_RECORDS)]
    pub train_records: u64,
    /// Test records.
    #[arg(long, default_value_t = CTR_TEST_RECORDS)]
    pub test_records: u64,
    /// Rows of the table the ids index (`0..N`), split over the 26 fields.
    #[arg(long, default_value_t = CTR_ROWS)]
    pub embedding_rows: u64,
    /// The generator's seed (`strata train --seed`).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// `meta.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CtrMeta {
    /// Records in `train.bin`.
    pub records_train: u64,
    /// Records in `test.bin`.
    pub records_test: u64,
    /// Rows of the table the ids index.
    pub embedding_rows: u64,
    /// Categorical fields per record (26).
    pub fields: usize,
    /// Dense features per record (13).
    pub dense: usize,
    /// The generator's seed.
    pub seed: u64,
    /// The planted model's AUC on the test records: the best any model can reach.
    pub best_test_auc: f64,
}

/// Records written per buffered write.
const CHUNK: usize = 4096;

/// Writes `count` records of `split` to `path` through a buffer of [`CHUNK`] records; returns
/// the planted probability and the label of each (for the AUC).
fn write_split(data: &CtrData, split: Split, count: u64, path: &Path, scores: bool) -> Result<(Vec<f64>, Vec<f32>)> {
    let io = |e| Error::io(format!("cannot write {}", path.display()), e);
    let file = std::fs::File::create(path).map_err(io)?;
    let mut out = std::io::BufWriter::with_capacity(CHUNK * RECORD_BYTES, file);
    let (mut p, mut labels) = (Vec::new(), Vec::new());
    for r in data.records(split, 0..count) {
        out.write_all(&r.to_bytes()).map_err(io)?;
        if scores {
            p.push(data.planted_probability(&r));
            labels.push(r.label);
        }
    }
    out.into_inner().map_err(|e| io(e.into_error()))?.sync_all().map_err(io)?;
    Ok((p, labels))
}

/// Writes the files.
pub fn run(args: &CtrDataArgs) -> Result<()> {
    if args.train_records == 0 || args.test_records == 0 {
        return Err(Error::Usage(format!(
            "--train-records {} and --test-records {}: write at least one record of each",
            args.train_records, args.test_records
        )));
    }
    let data = CtrData::new(args.seed, args.embedding_rows)?;
    std::fs::create_dir_all(&args.out).map_err(|e| Error::io(format!("cannot make {}", args.out.display()), e))?;
    write_split(&data, Split::Train, args.train_records, &args.out.join("train.bin"), false)?;
    let (p, labels) = write_split(&data, Split::Test, args.test_records, &args.out.join("test.bin"), true)?;
    let meta = CtrMeta {
        records_train: args.train_records,
        records_test: args.test_records,
        embedding_rows: args.embedding_rows,
        fields: FIELDS,
        dense: strata::ctr::DENSE,
        seed: args.seed,
        best_test_auc: strata::ctr::auc(&p, &labels),
    };
    let path = args.out.join("meta.json");
    let json = serde_json::to_string_pretty(&meta).map_err(|e| Error::io("cannot encode meta.json", e.into()))?;
    std::fs::write(&path, json + "\n").map_err(|e| Error::io(format!("cannot write {}", path.display()), e))?;
    println!(
        "wrote {} training and {} test records of {RECORD_BYTES} bytes to {} (planted best test auc {:.4})",
        args.train_records,
        args.test_records,
        args.out.display(),
        meta.best_test_auc
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata::ctr::CtrRecord;

    #[test]
    fn the_files_read_back_as_the_generator_s_records() {
        let dir = tempfile::tempdir().unwrap();
        let args = CtrDataArgs {
            out: dir.path().join("ctr"),
            train_records: 5_000,
            test_records: 3_000,
            embedding_rows: 2_000,
            seed: 11,
        };
        run(&args).unwrap();
        let data = CtrData::new(11, 2_000).unwrap();
        for (name, split, count) in [("train.bin", Split::Train, 5_000u64), ("test.bin", Split::Test, 3_000)] {
            let bytes = std::fs::read(args.out.join(name)).unwrap();
            assert_eq!(bytes.len() as u64, count * 160);
            for (i, chunk) in bytes.chunks_exact(RECORD_BYTES).enumerate() {
                let r = CtrRecord::from_bytes(chunk.try_into().unwrap());
                assert_eq!(r, data.record(split, i as u64), "{name} record {i}");
            }
            // The layout itself: the label first, then 13 floats, then 26 ids.
            let first = data.record(split, 0);
            assert_eq!(f32::from_le_bytes(bytes[0..4].try_into().unwrap()), first.label);
            assert_eq!(f32::from_le_bytes(bytes[4..8].try_into().unwrap()), first.dense[0]);
            assert_eq!(u32::from_le_bytes(bytes[56..60].try_into().unwrap()), first.ids[0]);
            assert_eq!(u32::from_le_bytes(bytes[156..160].try_into().unwrap()), first.ids[25]);
        }
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(args.out.join("meta.json")).unwrap()).unwrap();
        let keys: Vec<&str> = meta.as_object().unwrap().keys().map(String::as_str).collect();
        for k in ["records_train", "records_test", "embedding_rows", "fields", "dense", "seed", "best_test_auc"] {
            assert!(keys.contains(&k), "meta.json lacks {k}: {meta}");
        }
        let meta: CtrMeta = serde_json::from_value(meta).unwrap();
        assert_eq!((meta.records_train, meta.records_test, meta.embedding_rows), (5_000, 3_000, 2_000));
        assert_eq!((meta.fields, meta.dense, meta.seed), (26, 13, 11));
        assert!((meta.best_test_auc - data.best_auc(Split::Test, 3_000)).abs() < 1e-12);
    }
}
