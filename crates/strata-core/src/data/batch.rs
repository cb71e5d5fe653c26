//! [`BatchData`]: a batch of examples that splits along its first axis, whatever it holds.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use candle_core::{Device, Tensor};

use super::labelled::Batch;
use crate::{Error, Result};

/// A batch of examples that splits along its first axis: every part of it has one row per
/// example. [`distribute_dataset`](crate::Strategy::distribute_dataset),
/// [`run_batch`](crate::Strategy::run_batch), [`run_batches`](crate::Strategy::run_batches),
/// [`distribute_datasets_from_function`](crate::Strategy::distribute_datasets_from_function)
/// and [`distribute_files`](crate::Strategy::distribute_files) take any such batch and give
/// each replica a contiguous run of its rows, weighted exactly by their share of the global
/// batch (`rows / global rows`), and the auto-sharding across workers works the same way for
/// every one.
///
/// Implemented for a [`Tensor`] of any dtype candle has (images `(N, C, H, W)` of f32, bf16
/// or f16, token ids `(N, T)` of u32 or i64, masks of u8), tuples of up to six batches, named
/// maps (`BTreeMap` and `HashMap` from `String`), `Vec`s of batches, and [`Batch`] (row-major
/// f32 features and u32 labels). Parts that disagree on the number of rows are an
/// [`Error::BatchRows`] naming both.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use strata_core::data::DistributedBatch;
///
/// let images = Tensor::zeros((5, 3, 4, 4), DType::F32, &Device::Cpu)?;
/// let tokens = Tensor::zeros((5, 7), DType::U32, &Device::Cpu)?;
/// let split = DistributedBatch::split(&(images, tokens), 2)?;
/// let first = &split.shards.values()[0];
/// assert_eq!((first.batch.0.dims(), first.weight()), (&[3, 3, 4, 4][..], 0.6));
/// # Ok::<(), strata_core::Error>(())
/// ```
///
/// A type of one's own is a batch once it says how many rows it has, how to take a run of
/// them and how to join batches (the last is used to re-cut a stream of batches read from
/// files into global batches of one size):
///
/// ```
/// use std::ops::Range;
/// use candle_core::Tensor;
/// use strata_core::data::BatchData;
///
/// #[derive(Clone)]
/// struct Pairs { left: Tensor, right: Tensor, score: Tensor }
///
/// impl BatchData for Pairs {
///     fn rows(&self) -> strata_core::Result<usize> {
///         // the tuple's check: every part has the same rows, or an error naming them
///         (self.left.clone(), self.right.clone(), self.score.clone()).rows()
///     }
///     fn slice(&self, r: Range<usize>) -> strata_core::Result<Self> {
///         let (left, right, score) = (self.left.clone(), self.right.clone(), self.score.clone()).slice(r)?;
///         Ok(Pairs { left, right, score })
///     }
///     fn concat(parts: &[Self]) -> strata_core::Result<Self> {
///         let cat = |f: fn(&Pairs) -> &Tensor| Tensor::cat(&parts.iter().map(f).collect::<Vec<_>>(), 0);
///         Ok(Pairs { left: cat(|p| &p.left)?, right: cat(|p| &p.right)?, score: cat(|p| &p.score)? })
///     }
/// }
/// ```
pub trait BatchData: Clone + Send + Sync {
    /// The number of examples (rows along the first axis); an error if the parts disagree or a
    /// part has no first axis.
    fn rows(&self) -> Result<usize>;

    /// Rows `range` as a batch of the same kind (a view of the same storage where the parts
    /// allow it, as a tensor's does). An error if `range` is not within `0..rows`.
    fn slice(&self, range: Range<usize>) -> Result<Self>;

    /// The rows of `parts`, one batch after the other (for re-batching a stream); `parts` has
    /// at least one batch, and they agree on everything but their rows.
    fn concat(parts: &[Self]) -> Result<Self>;

    /// Rows `rows`, in that order, as a batch of the same kind (the trainer's seeded shuffle
    /// takes each global batch this way). The default joins [`slice`](Self::slice)s of the runs
    /// of consecutive rows with [`concat`](Self::concat); tensors take their rows with one
    /// `index_select`. An error if a row is not below [`rows`](Self::rows) or `rows` is empty.
    fn take_rows(&self, rows: &[usize]) -> Result<Self> {
        check_rows(self.rows()?, rows)?;
        let mut runs = Vec::new();
        let mut start = 0;
        for i in 1..=rows.len() {
            if i == rows.len() || rows[i] != rows[i - 1] + 1 {
                runs.push(self.slice(rows[start]..rows[i - 1] + 1)?);
                start = i;
            }
        }
        Self::concat(&runs)
    }

    /// The batch with its tensors on `device` (a replica's: `ctx.candle_device()`). The default
    /// returns the batch as it is, which suits batches of host data ([`Batch`]).
    fn to_device(&self, device: &Device) -> Result<Self> {
        let _ = device;
        Ok(self.clone())
    }
}

/// `rows` of every named part, checked equal.
fn agree(parts: impl Iterator<Item = (String, Result<usize>)>) -> Result<usize> {
    let mut first: Option<(String, usize)> = None;
    for (name, rows) in parts {
        let rows = rows?;
        match &first {
            None => first = Some((name, rows)),
            Some((a, r)) if *r != rows => {
                return Err(Error::BatchRows { first: a.clone(), first_rows: *r, other: name, other_rows: rows })
            }
            Some(_) => {}
        }
    }
    Ok(first.map_or(0, |(_, r)| r))
}

fn check_range(rows: usize, range: &Range<usize>) -> Result<()> {
    if range.start > range.end || range.end > rows {
        return Err(Error::Dataset(format!(
            "rows {}..{} of a batch of {rows}: slice within the batch",
            range.start, range.end
        )));
    }
    Ok(())
}

/// Checks that `rows` is not empty and every row is below `have`; returns `have`.
fn check_rows(have: usize, rows: &[usize]) -> Result<usize> {
    if rows.is_empty() {
        return Err(Error::Dataset("taking no rows of a batch; take at least one".into()));
    }
    if let Some(&bad) = rows.iter().find(|&&r| r >= have) {
        return Err(Error::Dataset(format!("row {bad} of a batch of {have}: take rows within the batch")));
    }
    Ok(have)
}

fn no_parts() -> Error {
    Error::Dataset("no batches to join; join at least one".into())
}

impl BatchData for Tensor {
    fn rows(&self) -> Result<usize> {
        match self.dims().first() {
            Some(&n) => Ok(n),
            None => Err(Error::Dataset(
                "a scalar tensor has no examples; give every tensor of a batch a first axis of examples".into(),
            )),
        }
    }

    fn slice(&self, range: Range<usize>) -> Result<Self> {
        check_range(self.rows()?, &range)?;
        Ok(self.narrow(0, range.start, range.end - range.start)?)
    }

    fn concat(parts: &[Self]) -> Result<Self> {
        if parts.is_empty() {
            return Err(no_parts());
        }
        Ok(Tensor::cat(parts, 0)?)
    }

    fn take_rows(&self, rows: &[usize]) -> Result<Self> {
        check_rows(self.rows()?, rows)?;
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let idx = Tensor::from_vec(idx, rows.len(), self.device())?;
        Ok(self.contiguous()?.index_select(&idx, 0)?)
    }

    fn to_device(&self, device: &Device) -> Result<Self> {
        Ok(Tensor::to_device(self, device)?)
    }
}

impl BatchData for Batch {
    fn rows(&self) -> Result<usize> {
        Ok(self.len())
    }

    fn slice(&self, range: Range<usize>) -> Result<Self> {
        check_range(self.len(), &range)?;
        Ok(Batch::slice(self, range))
    }

    fn concat(parts: &[Self]) -> Result<Self> {
        let dim = parts.first().ok_or_else(no_parts)?.dim;
        if let Some(b) = parts.iter().find(|b| b.dim != dim) {
            return Err(Error::Dataset(format!(
                "batches of {dim} and {} features per row cannot be joined; give them the same features",
                b.dim
            )));
        }
        let features = parts.iter().flat_map(|b| b.features.iter().copied()).collect();
        let labels = parts.iter().flat_map(|b| b.labels.iter().copied()).collect();
        Batch::new(features, labels, dim)
    }

    fn take_rows(&self, rows: &[usize]) -> Result<Self> {
        check_rows(self.len(), rows)?;
        Ok(self.select_rows(rows))
    }
}

macro_rules! tuple_batch {
    ($($t:ident $i:tt),+) => {
        impl<$($t: BatchData),+> BatchData for ($($t,)+) {
            fn rows(&self) -> Result<usize> {
                agree([$((format!("part {}", $i), self.$i.rows())),+].into_iter())
            }

            fn slice(&self, range: Range<usize>) -> Result<Self> {
                self.rows()?;
                Ok(($(self.$i.slice(range.clone())?,)+))
            }

            fn concat(parts: &[Self]) -> Result<Self> {
                Ok(($($t::concat(&parts.iter().map(|p| p.$i.clone()).collect::<Vec<_>>())?,)+))
            }

            fn take_rows(&self, rows: &[usize]) -> Result<Self> {
                self.rows()?;
                Ok(($(self.$i.take_rows(rows)?,)+))
            }

            fn to_device(&self, device: &Device) -> Result<Self> {
                Ok(($(self.$i.to_device(device)?,)+))
            }
        }
    };
}

tuple_batch!(A 0);
tuple_batch!(A 0, B 1);
tuple_batch!(A 0, B 1, C 2);
tuple_batch!(A 0, B 1, C 2, D 3);
tuple_batch!(A 0, B 1, C 2, D 3, E 4);
tuple_batch!(A 0, B 1, C 2, D 3, E 4, F 5);

impl<T: BatchData> BatchData for Vec<T> {
    fn rows(&self) -> Result<usize> {
        agree(self.iter().enumerate().map(|(i, t)| (format!("part {i}"), t.rows())))
    }

    fn slice(&self, range: Range<usize>) -> Result<Self> {
        self.rows()?;
        self.iter().map(|t| t.slice(range.clone())).collect()
    }

    fn concat(parts: &[Self]) -> Result<Self> {
        let n = parts.first().ok_or_else(no_parts)?.len();
        if let Some(p) = parts.iter().find(|p| p.len() != n) {
            return Err(Error::Dataset(format!(
                "batches of {n} and {} parts cannot be joined; give every batch the same parts",
                p.len()
            )));
        }
        (0..n).map(|i| T::concat(&parts.iter().map(|p| p[i].clone()).collect::<Vec<_>>())).collect()
    }

    fn take_rows(&self, rows: &[usize]) -> Result<Self> {
        self.rows()?;
        self.iter().map(|t| t.take_rows(rows)).collect()
    }

    fn to_device(&self, device: &Device) -> Result<Self> {
        self.iter().map(|t| t.to_device(device)).collect()
    }
}

macro_rules! map_batch {
    ($map:ident) => {
        impl<T: BatchData> BatchData for $map<String, T> {
            fn rows(&self) -> Result<usize> {
                let mut names: Vec<&String> = self.keys().collect();
                names.sort();
                agree(names.into_iter().map(|k| (format!("{k:?}"), self[k].rows())))
            }

            fn slice(&self, range: Range<usize>) -> Result<Self> {
                self.rows()?;
                self.iter().map(|(k, t)| Ok((k.clone(), t.slice(range.clone())?))).collect()
            }

            fn concat(parts: &[Self]) -> Result<Self> {
                let first = parts.first().ok_or_else(no_parts)?;
                if let Some(p) = parts.iter().find(|p| p.len() != first.len()) {
                    return Err(Error::Dataset(format!(
                        "batches of {} and {} named parts cannot be joined; give every batch the same names",
                        first.len(),
                        p.len()
                    )));
                }
                first
                    .keys()
                    .map(|k| {
                        let all = parts.iter().map(|p| p.get(k).cloned()).collect::<Option<Vec<_>>>().ok_or_else(|| {
                            Error::Dataset(format!(
                                "a batch without {k:?} cannot be joined to one with it; give every batch the same names"
                            ))
                        })?;
                        Ok((k.clone(), T::concat(&all)?))
                    })
                    .collect()
            }

            fn take_rows(&self, rows: &[usize]) -> Result<Self> {
                self.rows()?;
                self.iter().map(|(k, t)| Ok((k.clone(), t.take_rows(rows)?))).collect()
            }

            fn to_device(&self, device: &Device) -> Result<Self> {
                self.iter().map(|(k, t)| Ok((k.clone(), t.to_device(device)?))).collect()
            }
        }
    };
}

map_batch!(BTreeMap);
map_batch!(HashMap);

#[cfg(test)]
mod tests {
    use candle_core::DType;

    use super::*;

    fn t(rows: usize, dtype: DType) -> Tensor {
        Tensor::arange(0u32, (rows * 2) as u32, &Device::Cpu)
            .unwrap()
            .reshape((rows, 2))
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    }

    #[test]
    fn every_dtype_slices_and_joins_exactly() {
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::U32, DType::I64, DType::U8, DType::F64] {
            let x = t(5, dtype);
            let parts = [x.slice(0..2).unwrap(), x.slice(2..5).unwrap()];
            assert_eq!(parts[1].dims(), &[3, 2]);
            assert_eq!(parts[1].dtype(), dtype);
            let back = Tensor::concat(&parts).unwrap();
            let (a, b) = (x.to_dtype(DType::F64).unwrap(), back.to_dtype(DType::F64).unwrap());
            assert_eq!(a.to_vec2::<f64>().unwrap(), b.to_vec2::<f64>().unwrap(), "{dtype:?}");
        }
    }

    #[test]
    fn parts_that_disagree_on_rows_are_named() {
        let e = (t(4, DType::F32), t(3, DType::U32)).rows().unwrap_err().to_string();
        assert!(e.contains("part 0 has 4 rows but part 1 has 3"), "{e}");
        assert!(!e.contains('\n'), "{e}");
        let map: BTreeMap<String, Tensor> =
            [("image".to_string(), t(4, DType::F32)), ("mask".to_string(), t(2, DType::U8))].into();
        let e = map.slice(0..1).unwrap_err().to_string();
        assert!(e.contains("\"image\" has 4 rows but \"mask\" has 2"), "{e}");
        let scalar = Tensor::new(1f32, &Device::Cpu).unwrap();
        assert!(scalar.rows().unwrap_err().to_string().contains("first axis"));
        assert!(t(3, DType::F32).slice(2..4).is_err());
    }

    #[test]
    fn take_rows_in_order_for_every_kind() {
        let order = [3usize, 0, 1, 4, 2, 2];
        for dtype in [DType::F32, DType::U32, DType::I64, DType::U8] {
            let g = t(5, dtype).take_rows(&order).unwrap().to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap();
            let want: Vec<Vec<f64>> = order.iter().map(|&r| vec![2.0 * r as f64, 2.0 * r as f64 + 1.0]).collect();
            assert_eq!(g, want, "{dtype:?}");
        }
        // The default (runs of slices, joined) agrees with a tensor's index_select.
        #[derive(Clone)]
        struct Own(Tensor);
        impl BatchData for Own {
            fn rows(&self) -> Result<usize> {
                self.0.rows()
            }
            fn slice(&self, r: Range<usize>) -> Result<Self> {
                Ok(Own(self.0.slice(r)?))
            }
            fn concat(parts: &[Self]) -> Result<Self> {
                Ok(Own(Tensor::concat(&parts.iter().map(|p| p.0.clone()).collect::<Vec<_>>())?))
            }
        }
        let x = t(5, DType::F32);
        let a = Own(x.clone()).take_rows(&order).unwrap().0.to_vec2::<f32>().unwrap();
        assert_eq!(a, x.take_rows(&order).unwrap().to_vec2::<f32>().unwrap());
        let pair = (t(5, DType::F32), t(5, DType::U8)).take_rows(&[4, 1]).unwrap();
        assert_eq!(pair.1.to_vec2::<u8>().unwrap(), [[8, 9], [2, 3]]);
        let b = Batch::new((0..10).map(|v| v as f32).collect(), (0..5).collect(), 2).unwrap();
        let g = b.take_rows(&[4, 0]).unwrap();
        assert_eq!((g.features, g.labels), (vec![8.0, 9.0, 0.0, 1.0], vec![4, 0]));
        let e = x.take_rows(&[1, 5]).unwrap_err().to_string();
        assert_eq!(e, "dataset: row 5 of a batch of 5: take rows within the batch");
        assert!(Own(x).take_rows(&[]).is_err());
    }

    #[test]
    fn maps_and_vecs_join_by_part() {
        let map = |r: usize| -> HashMap<String, Tensor> {
            [("x".to_string(), t(r, DType::F32)), ("y".to_string(), t(r, DType::I64))].into()
        };
        let joined = HashMap::concat(&[map(2), map(3)]).unwrap();
        assert_eq!(joined.rows().unwrap(), 5);
        assert_eq!(joined["y"].dtype(), DType::I64);
        let v = Vec::concat(&[vec![t(1, DType::U8)], vec![t(2, DType::U8)]]).unwrap();
        assert_eq!(v.rows().unwrap(), 3);
        assert!(Vec::<Tensor>::concat(&[vec![t(1, DType::U8)], vec![]]).is_err());
    }
}
