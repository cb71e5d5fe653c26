//! Per-step and per-evaluation records of a training run, one JSON object per line.
//!
//! `strata train --metrics FILE` writes them (the chief, or the parameter-server coordinator);
//! `strata compare` reads them back into `runs.csv`. A record is written and flushed as soon as
//! it is known, so a run that fails half-way leaves the records of the steps it made.

use std::io::Write;
use std::path::Path;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// What a record describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RecordKind {
    /// One training step (one replica group's step, or one parameter-server worker's push).
    Step,
    /// One evaluation on the test set.
    Eval,
}

/// One line of a metrics file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MetricRecord {
    /// A step or an evaluation.
    pub kind: RecordKind,
    /// Steps done so far, this one included (parameter servers: worker steps, i.e. pushes).
    pub step: u64,
    /// Updates applied to the model so far (optimizer iterations: a synchronous step or sync
    /// round is one update, every applied asynchronous push is one).
    pub updates: u64,
    /// Seconds since the run started (virtual seconds in simulated mode).
    pub wall_s: f64,
    /// Training examples processed so far.
    pub examples: u64,
    /// Step: the batch's mean loss before the update.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<f32>,
    /// Step (parameter servers): updates applied between the step's pull and its push.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staleness: Option<u64>,
    /// Step: bytes this step sent to other processes (all workers together).
    #[serde(default)]
    pub bytes_sent: u64,
    /// Step: bytes this step received from other processes (all workers together).
    #[serde(default)]
    pub bytes_received: u64,
    /// Step: the worker (or replica) that ran it, where one did alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<u32>,
    /// Step (parameter servers, sync mode): a backup worker's late push that was dropped.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dropped: bool,
    /// Eval: test accuracy (the digits models).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accuracy: Option<f32>,
    /// Eval: validation loss in nats per character (the transformer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation_loss: Option<f32>,
    /// Eval: test AUC (the ctr model; its `validation_loss` is the test log loss where the
    /// evaluation measured one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auc: Option<f32>,
}

impl MetricRecord {
    /// A step record.
    pub fn step(step: u64, updates: u64, wall_s: f64, examples: u64, loss: f32) -> Self {
        Self {
            kind: RecordKind::Step,
            step,
            updates,
            wall_s,
            examples,
            loss: Some(loss),
            staleness: None,
            bytes_sent: 0,
            bytes_received: 0,
            worker: None,
            dropped: false,
            accuracy: None,
            validation_loss: None,
            auc: None,
        }
    }

    /// An evaluation record.
    pub fn eval(step: u64, updates: u64, wall_s: f64, examples: u64, accuracy: f32) -> Self {
        Self {
            kind: RecordKind::Eval,
            step,
            updates,
            wall_s,
            examples,
            loss: None,
            staleness: None,
            bytes_sent: 0,
            bytes_received: 0,
            worker: None,
            dropped: false,
            accuracy: Some(accuracy),
            validation_loss: None,
            auc: None,
        }
    }

    /// An evaluation record of a validation loss (the transformer's, in nats per character).
    pub fn eval_loss(step: u64, updates: u64, wall_s: f64, examples: u64, validation_loss: f32) -> Self {
        Self {
            accuracy: None,
            validation_loss: Some(validation_loss),
            ..Self::eval(step, updates, wall_s, examples, 0.0)
        }
    }

    /// An evaluation record of a test AUC (the ctr model's).
    pub fn eval_auc(step: u64, updates: u64, wall_s: f64, examples: u64, auc: f32) -> Self {
        Self { accuracy: None, auc: Some(auc), ..Self::eval(step, updates, wall_s, examples, 0.0) }
    }
}

/// Writes records to a file, one JSON line each, flushed per record.
#[derive(Debug)]
pub struct MetricsWriter {
    file: Mutex<std::io::BufWriter<std::fs::File>>,
}

impl MetricsWriter {
    /// Creates (truncates) `path`.
    pub fn create(path: &Path) -> Result<Self> {
        let file =
            std::fs::File::create(path).map_err(|e| Error::io(format!("cannot create {}", path.display()), e))?;
        Ok(Self { file: Mutex::new(std::io::BufWriter::new(file)) })
    }

    /// Opens `path` to append to it (creating it if need be).
    pub fn append(path: &Path) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| Error::io(format!("cannot open {}", path.display()), e))?;
        Ok(Self { file: Mutex::new(std::io::BufWriter::new(file)) })
    }

    /// Appends one record.
    pub fn write(&self, record: &MetricRecord) -> Result<()> {
        let line = serde_json::to_string(record).map_err(|e| Error::io("cannot encode a metric record", e.into()))?;
        let mut f = self.file.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        writeln!(f, "{line}").and_then(|()| f.flush()).map_err(|e| Error::io("cannot write a metric record", e))
    }
}

/// Reads a metrics file; a torn last line (a run killed while writing) is ignored.
pub fn read(path: &Path) -> Result<Vec<MetricRecord>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(format!("cannot read {}", path.display()), e))?;
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let mut out = Vec::with_capacity(lines.len());
    for (i, line) in lines.iter().enumerate() {
        match serde_json::from_str::<MetricRecord>(line) {
            Ok(r) => out.push(r),
            Err(_) if i + 1 == lines.len() && !text.ends_with('\n') => break,
            Err(e) => return Err(Error::Usage(format!("{} line {}: not a metric record: {e}", path.display(), i + 1))),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_a_torn_last_line_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.jsonl");
        let w = MetricsWriter::create(&path).unwrap();
        let mut s = MetricRecord::step(1, 1, 0.5, 32, 2.25);
        s.staleness = Some(3);
        s.bytes_sent = 100;
        w.write(&s).unwrap();
        w.write(&MetricRecord::eval(1, 1, 0.6, 32, 0.75)).unwrap();
        w.write(&MetricRecord::eval_auc(2, 2, 0.7, 64, 0.71)).unwrap();
        drop(w);
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str("{\"kind\":\"st");
        std::fs::write(&path, &text).unwrap();
        let back = read(&path).unwrap();
        assert_eq!(back, vec![s, MetricRecord::eval(1, 1, 0.6, 32, 0.75), MetricRecord::eval_auc(2, 2, 0.7, 64, 0.71)]);
        assert!(text.contains("\"auc\":0.71") && !text.lines().next().unwrap().contains("auc"), "{text}");
        std::fs::write(&path, "{\"kind\":\"step\"}\nnot json\n").unwrap();
        assert!(read(&path).unwrap_err().to_string().contains("line 1"));
    }
}
