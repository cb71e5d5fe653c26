//! [`Batch`]: the labelled examples of the shipped data sets (row-major f32 features, u32
//! class labels), the batch type the trainer and the harness default to. A leaf of `data`: it
//! knows neither [`BatchData`](super::BatchData) nor the distributed datasets.

use candle_core::{Device, Tensor};

use crate::{Error, Result};

/// A batch of examples: row-major f32 features and u32 class labels.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// `rows * dim` features, row-major.
    pub features: Vec<f32>,
    /// One label per row.
    pub labels: Vec<u32>,
    /// Features per row.
    pub dim: usize,
}

impl Batch {
    /// A batch, checked: `features.len() == labels.len() * dim`.
    pub fn new(features: Vec<f32>, labels: Vec<u32>, dim: usize) -> Result<Self> {
        if dim == 0 || features.len() != labels.len() * dim {
            return Err(Error::Dataset(format!(
                "a batch of {} labels with {dim} features per row needs {} features, got {}",
                labels.len(),
                labels.len() * dim,
                features.len()
            )));
        }
        Ok(Self { features, labels, dim })
    }

    /// The number of examples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether the batch has no example.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Rows `range` as a new batch.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Batch {
        Batch {
            features: self.features[range.start * self.dim..range.end * self.dim].to_vec(),
            labels: self.labels[range].to_vec(),
            dim: self.dim,
        }
    }

    /// Rows `idx`, in that order, as a new batch (every index below [`Batch::len`]).
    pub fn select_rows(&self, idx: &[usize]) -> Batch {
        let mut features = Vec::with_capacity(idx.len() * self.dim);
        let mut labels = Vec::with_capacity(idx.len());
        for &i in idx {
            features.extend_from_slice(&self.features[i * self.dim..(i + 1) * self.dim]);
            labels.push(self.labels[i]);
        }
        Batch { features, labels, dim: self.dim }
    }

    /// The features as a `(rows, dim)` tensor on `device`.
    pub fn features_tensor(&self, device: &Device) -> Result<Tensor> {
        Ok(Tensor::from_slice(&self.features, (self.len(), self.dim), device)?)
    }

    /// The labels as a `(rows,)` u32 tensor on `device`.
    pub fn labels_tensor(&self, device: &Device) -> Result<Tensor> {
        Ok(Tensor::from_slice(&self.labels, self.len(), device)?)
    }
}
