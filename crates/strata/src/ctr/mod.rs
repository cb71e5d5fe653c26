//! A click-through-rate (CTR) workload: Criteo-shaped records generated from a seed
//! ([`CtrData`]: 13 dense features, 26 categorical fields of Zipf-distributed ids in one table,
//! labels from a planted model whose AUC is the best reachable), the [`auc`] of scores, and a
//! DLRM-style model ([`Dlrm`]) whose one [`Embedding`](strata_core::layers::Embedding) table
//! the 26 fields share.
//!
//! ```
//! use candle_core::Device;
//! use strata::ctr::{CtrData, Dlrm, DlrmConfig, Split};
//! use strata::prelude::*;
//!
//! let data = CtrData::new(0, 1_000)?;
//! let strategy = OneDeviceStrategy::cpu()?;
//! let model = strategy.scope(|s| Dlrm::new(s, DlrmConfig::new(data.embedding_rows(), 16)))?;
//! let test = data.batch(Split::Test, 0..2_000, &Device::Cpu)?;
//! let untrained = model.primary().auc(&test)?;
//! assert!((0.0..=1.0).contains(&untrained));
//! # Ok::<(), strata::Error>(())
//! ```
//!
//! `strata train --model ctr` trains it under any strategy that keeps variables whole, and
//! `strata ctr-data` writes the records as files of 160-byte records ([`CtrRecord::to_bytes`])
//! for other frameworks.

mod ahead;
mod auc;
pub mod data;
mod model;

pub use auc::auc;
pub use data::{batch_of, CtrBatch, CtrData, CtrRecord, Split, DENSE, FIELDS, RECORD_BYTES};
pub use model::{bce_with_logits, streamed_task, task, Dlrm, DlrmConfig, INTERACTIONS};
