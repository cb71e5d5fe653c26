//! How variables are split into shards (TF's `tf.distribute.experimental.partitioners`, along
//! axis 0 only) and which parameter-server task holds each shard.
//!
//! A variable split in `n` shards is held as `"<var>/part_<i>"` (`i` in `0..n`), shard `i`
//! holding rows `[row_offset, row_offset + rows)`: TF's split, `dim0 / n` rows each and one more
//! for the first `dim0 % n` shards. A variable that is not split keeps its name. Scalars and
//! variables of 0 or 1 rows are never split.

use std::collections::{BTreeMap, HashSet};
use std::ops::Range;

use strata_core::{Error, Result};
use strata_transport::ps::VariableInfo;

/// The bytes of one f32 element: parameter servers hold f32 values.
const F32_BYTES: usize = 4;

/// How a variable is split along axis 0 (TF's partitioners).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum Partitioner {
    /// Never split.
    #[default]
    None,
    /// `FixedShardsPartitioner(n)`: `min(n, dim0)` shards.
    FixedShards(usize),
    /// `MinSizePartitioner`: as many shards as keep each at least `min_shard_bytes`, at most
    /// `max_shards` and at most `dim0`.
    MinSize {
        /// The smallest shard, in bytes.
        min_shard_bytes: usize,
        /// The most shards.
        max_shards: usize,
    },
    /// `MaxSizePartitioner`: as few shards as keep each at most `max_shard_bytes` (a shard has
    /// at least one row), capped by `max_shards`.
    MaxSize {
        /// The largest shard, in bytes.
        max_shard_bytes: usize,
        /// The most shards, if capped.
        max_shards: Option<usize>,
    },
}

const PARTITIONER_FORMS: &str =
    "\"none\", \"fixed:<shards>\", \"min:<min_shard_bytes>:<max_shards>\" or \"max:<max_shard_bytes>[:<max_shards>]\"";

impl Partitioner {
    /// Parses `"none"`, `"fixed:4"`, `"min:262144:4"`, `"max:1048576"` or `"max:1048576:8"`.
    pub fn parse(text: &str) -> Result<Self> {
        let bad = |why: &str| {
            Error::InvalidArgument(format!(
                "partitioner {text:?} {why}; use {PARTITIONER_FORMS} (sizes in bytes, counts at least 1)"
            ))
        };
        let parts: Vec<&str> = text.trim().split(':').collect();
        let num = |s: &str, what: &str| -> Result<usize> {
            match s.trim().parse::<usize>() {
                Ok(n) if n >= 1 => Ok(n),
                _ => Err(bad(&format!("has {what} {s:?}, not a whole number of at least 1"))),
            }
        };
        match parts.as_slice() {
            ["none"] | ["None"] | [""] => Ok(Partitioner::None),
            ["fixed", n] => Ok(Partitioner::FixedShards(num(n, "shards")?)),
            ["min", b, m] => Ok(Partitioner::MinSize {
                min_shard_bytes: num(b, "min_shard_bytes")?,
                max_shards: num(m, "max_shards")?,
            }),
            ["max", b] => Ok(Partitioner::MaxSize { max_shard_bytes: num(b, "max_shard_bytes")?, max_shards: None }),
            ["max", b, m] => Ok(Partitioner::MaxSize {
                max_shard_bytes: num(b, "max_shard_bytes")?,
                max_shards: Some(num(m, "max_shards")?),
            }),
            _ => Err(bad("is not a partitioner")),
        }
    }

    /// The number of shards of a variable of `shape` whose elements take `dtype_bytes` each,
    /// as TF computes it (1 for scalars and for variables of at most one row).
    pub fn num_shards(&self, shape: &[usize], dtype_bytes: usize) -> usize {
        let Some(&dim0) = shape.first() else { return 1 };
        if dim0 <= 1 {
            return 1;
        }
        let total_bytes = shape.iter().product::<usize>().saturating_mul(dtype_bytes);
        let n = match *self {
            Partitioner::None => 1,
            Partitioner::FixedShards(n) => n.min(dim0),
            Partitioner::MinSize { min_shard_bytes, max_shards } => {
                dim0.min(max_shards).min(total_bytes / min_shard_bytes.max(1))
            }
            Partitioner::MaxSize { max_shard_bytes, max_shards } => {
                let bytes_per_row = (total_bytes / dim0).max(1);
                let rows_per_shard = (max_shard_bytes / bytes_per_row).max(1);
                let n = dim0.div_ceil(rows_per_shard);
                max_shards.map_or(n, |m| n.min(m))
            }
        };
        n.max(1)
    }
}

impl std::fmt::Display for Partitioner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Partitioner::None => write!(f, "none"),
            Partitioner::FixedShards(n) => write!(f, "fixed:{n}"),
            Partitioner::MinSize { min_shard_bytes, max_shards } => write!(f, "min:{min_shard_bytes}:{max_shards}"),
            Partitioner::MaxSize { max_shard_bytes, max_shards: None } => write!(f, "max:{max_shard_bytes}"),
            Partitioner::MaxSize { max_shard_bytes, max_shards: Some(m) } => write!(f, "max:{max_shard_bytes}:{m}"),
        }
    }
}

/// The rows of each of `num_shards` shards of `dim0` rows, as TF splits them: `dim0 / n` each,
/// one more for the first `dim0 % n`.
pub fn rows_per_shard(dim0: usize, num_shards: usize) -> Vec<usize> {
    let n = num_shards.max(1);
    (0..n).map(|i| dim0 / n + usize::from(i < dim0 % n)).collect()
}

/// Which parameter-server task receives each shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PlacementPolicy {
    /// TF's: shard `k` (counting every shard of every variable in creation order) goes to ps
    /// task `k % num_ps`.
    RoundRobin,
    /// Each shard, in creation order, goes to the ps task holding the fewest bytes so far (ties
    /// to the lowest index).
    #[default]
    BalancedBytes,
}

impl PlacementPolicy {
    /// Parses `"round-robin"` or `"balanced"`.
    pub fn parse(text: &str) -> Result<Self> {
        match text.trim() {
            "round-robin" | "round_robin" | "roundrobin" => Ok(PlacementPolicy::RoundRobin),
            "balanced" | "balanced-bytes" | "balanced_bytes" => Ok(PlacementPolicy::BalancedBytes),
            other => Err(Error::InvalidArgument(format!(
                "placement policy {other:?} is not known; use \"round-robin\" or \"balanced\""
            ))),
        }
    }
}

/// One shard and the ps task that holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlacedShard {
    /// The index of the ps task (`ps:<ps>`).
    pub ps: usize,
    /// The shard.
    pub info: VariableInfo,
}

impl PlacedShard {
    /// The shard's elements within its whole variable's row-major values.
    pub fn range(&self) -> Range<usize> {
        shard_range(&self.info)
    }
}

/// The elements of `info`'s shard within its whole variable's row-major values.
pub fn shard_range(info: &VariableInfo) -> Range<usize> {
    let row: usize = info.full_shape.iter().skip(1).product();
    let start = usize::try_from(info.row_offset).unwrap_or(usize::MAX).saturating_mul(row);
    let len: usize = info.shape.iter().product();
    start..start.saturating_add(len)
}

/// Where every shard of every variable lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    num_ps: usize,
    variables: Vec<(String, Vec<usize>)>,
    shards: Vec<PlacedShard>,
    /// For each variable (same order), the indices of its shards in `shards`, by part.
    index: Vec<Vec<usize>>,
}

impl Placement {
    /// Splits `vars` (whole names and shapes, in creation order) with `partitioner` and places
    /// the shards on `num_ps` tasks with `policy`.
    pub fn plan(
        vars: &[(String, Vec<usize>)],
        num_ps: usize,
        partitioner: &Partitioner,
        policy: PlacementPolicy,
    ) -> Result<Self> {
        if num_ps == 0 {
            return Err(Error::InvalidCluster(
                "placing variables needs at least one ps task; add a \"ps\" job to the cluster spec".into(),
            ));
        }
        let mut seen = HashSet::new();
        let mut bytes = vec![0usize; num_ps];
        let mut shards = Vec::new();
        let mut counter = 0usize;
        for (name, shape) in vars {
            if !seen.insert(name.as_str()) {
                return Err(Error::InvalidArgument(format!(
                    "variable {name:?} is given twice; every variable needs its own name"
                )));
            }
            let n = partitioner.num_shards(shape, F32_BYTES);
            let infos: Vec<VariableInfo> = if n <= 1 {
                vec![VariableInfo {
                    name: name.clone(),
                    shape: shape.clone(),
                    variable: name.clone(),
                    part: 0,
                    num_parts: 1,
                    row_offset: 0,
                    full_shape: shape.clone(),
                    state: false,
                }]
            } else {
                let mut offset = 0usize;
                rows_per_shard(shape[0], n)
                    .into_iter()
                    .enumerate()
                    .map(|(i, rows)| {
                        let mut s = shape.clone();
                        s[0] = rows;
                        let info = VariableInfo {
                            name: format!("{name}/part_{i}"),
                            shape: s,
                            variable: name.clone(),
                            part: i as u32,
                            num_parts: n as u32,
                            row_offset: offset as u64,
                            full_shape: shape.clone(),
                            state: false,
                        };
                        offset += rows;
                        info
                    })
                    .collect()
            };
            for info in infos {
                let ps = match policy {
                    PlacementPolicy::RoundRobin => counter % num_ps,
                    PlacementPolicy::BalancedBytes => (0..num_ps).min_by_key(|&p| (bytes[p], p)).unwrap_or(0),
                };
                counter += 1;
                bytes[ps] += info.numel() * F32_BYTES;
                shards.push(PlacedShard { ps, info });
            }
        }
        Self::build(num_ps, vars.to_vec(), shards)
    }

    /// Rebuilds the placement from the shards each ps task reports holding (`tasks[i]`: those of
    /// `ps:<i>`). Checks every variable's parts are present once and tile its full shape.
    /// Variables are ordered by name.
    pub fn from_tasks(tasks: Vec<Vec<VariableInfo>>) -> Result<Self> {
        let num_ps = tasks.len();
        if num_ps == 0 {
            return Err(Error::InvalidCluster("no ps task reported its variables; list the ps tasks".into()));
        }
        let mut by_var: BTreeMap<String, Vec<PlacedShard>> = BTreeMap::new();
        let mut names = HashSet::new();
        for (ps, infos) in tasks.into_iter().enumerate() {
            for info in infos {
                if !names.insert(info.name.clone()) {
                    return Err(Error::InvalidCluster(format!(
                        "shard {:?} is held twice (again by ps:{ps}); give every ps task its own shards",
                        info.name
                    )));
                }
                by_var.entry(info.variable.clone()).or_default().push(PlacedShard { ps, info });
            }
        }
        let mut variables = Vec::with_capacity(by_var.len());
        let mut shards = Vec::new();
        for (var, mut parts) in by_var {
            parts.sort_by_key(|s| s.info.part);
            let first = &parts[0].info;
            let full = first.full_shape.clone();
            let n = first.num_parts as usize;
            if parts.len() != n {
                return Err(Error::InvalidCluster(format!(
                    "variable {var:?} has {} of its {n} parts on the ps tasks; start every ps task of the job \
                     (with the same checkpoint)",
                    parts.len()
                )));
            }
            let mut next_row = 0u64;
            for (i, s) in parts.iter().enumerate() {
                let info = &s.info;
                let ok_shape = info.full_shape == full
                    && info.num_parts as usize == n
                    && info.part as usize == i
                    && info.row_offset == next_row
                    && info.shape.len() == full.len()
                    && (full.is_empty() || info.shape[1..] == full[1..]);
                if !ok_shape {
                    return Err(Error::InvalidCluster(format!(
                        "shard {:?} (part {} of {}, rows from {}, shape {:?}) does not fit variable {var:?} of \
                         shape {full:?}; the ps tasks hold shards of different plans, restart them from one checkpoint",
                        info.name, info.part, info.num_parts, info.row_offset, info.shape
                    )));
                }
                next_row += info.shape.first().copied().unwrap_or(1) as u64;
            }
            let rows = full.first().copied().unwrap_or(1) as u64;
            if next_row != rows {
                return Err(Error::InvalidCluster(format!(
                    "the parts of variable {var:?} hold {next_row} rows of its {rows}; restart the ps tasks from one \
                     checkpoint"
                )));
            }
            variables.push((var, full));
            shards.extend(parts);
        }
        Self::build(num_ps, variables, shards)
    }

    fn build(num_ps: usize, variables: Vec<(String, Vec<usize>)>, shards: Vec<PlacedShard>) -> Result<Self> {
        let pos: BTreeMap<&str, usize> = variables.iter().enumerate().map(|(i, (n, _))| (n.as_str(), i)).collect();
        let mut index = vec![Vec::new(); variables.len()];
        for (k, s) in shards.iter().enumerate() {
            let Some(&v) = pos.get(s.info.variable.as_str()) else {
                return Err(Error::InvalidCluster(format!("shard {:?} has no variable", s.info.name)));
            };
            index[v].push(k);
        }
        for list in &mut index {
            list.sort_by_key(|&k| shards[k].info.part);
        }
        Ok(Self { num_ps, variables, shards, index })
    }

    /// The number of ps tasks.
    pub fn num_ps(&self) -> usize {
        self.num_ps
    }

    /// Marks the shards of `variables` as non-trainable state (see [`VariableInfo::state`]).
    pub fn mark_state(&mut self, variables: &[&str]) {
        for s in &mut self.shards {
            if variables.contains(&s.info.variable.as_str()) {
                s.info.state = true;
            }
        }
    }

    /// Every shard, variable by variable, part by part.
    pub fn shards(&self) -> &[PlacedShard] {
        &self.shards
    }

    /// The shards held by ps task `ps`.
    pub fn on_task(&self, ps: usize) -> Vec<&VariableInfo> {
        self.shards.iter().filter(|s| s.ps == ps).map(|s| &s.info).collect()
    }

    /// The bytes (f32) each ps task holds.
    pub fn bytes_per_task(&self) -> Vec<usize> {
        let mut bytes = vec![0; self.num_ps];
        for s in &self.shards {
            bytes[s.ps] += s.info.numel() * F32_BYTES;
        }
        bytes
    }

    /// The whole variables: names and full shapes, in order.
    pub fn variables(&self) -> &[(String, Vec<usize>)] {
        &self.variables
    }

    /// The full shape of variable `name`, if placed.
    pub fn shape_of(&self, name: &str) -> Option<&[usize]> {
        self.variables.iter().find(|(n, _)| n == name).map(|(_, s)| s.as_slice())
    }

    /// The shards of variable `name`, by part (empty when not placed).
    pub fn shards_of(&self, name: &str) -> Vec<&PlacedShard> {
        self.variables
            .iter()
            .position(|(n, _)| n == name)
            .map(|v| self.index[v].iter().map(|&k| &self.shards[k]).collect())
            .unwrap_or_default()
    }

    /// Splits the row-major values of variable `name` into its shards: `(ps, shard name, values)`.
    pub fn split<'a>(&'a self, name: &str, values: &'a [f32]) -> Result<Vec<(usize, &'a str, &'a [f32])>> {
        let shape = self.shape_of(name).ok_or_else(|| {
            Error::InvalidArgument(format!("variable {name:?} is not on the parameter servers; create it in scope"))
        })?;
        let numel: usize = shape.iter().product();
        if values.len() != numel {
            return Err(Error::InvalidArgument(format!(
                "variable {name:?} of shape {shape:?} has {numel} values; got {}",
                values.len()
            )));
        }
        Ok(self.shards_of(name).into_iter().map(|s| (s.ps, s.info.name.as_str(), &values[s.range()])).collect())
    }

    /// Writes `part` (the values of shard `info`) into `whole` (its variable's row-major values).
    pub fn assemble(info: &VariableInfo, part: &[f32], whole: &mut [f32]) -> Result<()> {
        let r = shard_range(info);
        if part.len() != r.len() || r.end > whole.len() {
            return Err(Error::InvalidArgument(format!(
                "shard {:?} has {} values for elements {r:?} of a variable of {}",
                info.name,
                part.len(),
                whole.len()
            )));
        }
        whole[r].copy_from_slice(part);
        Ok(())
    }
}
