//! The restore pool of a task restored from a whole job's checkpoint
//! ([`read_job_checkpoint`](crate::read_job_checkpoint)): every old task's dense variables,
//! keyed by their whole variable's name, which the coordinator's `CreateVariables` draws from
//! wherever the old job held them.
//!
//! A variable is split in parts along its first axis by a partitioner (`<var>/part_<i>`, rows
//! `[row_offset, row_offset + rows)`). The pool keeps the old parts of each whole variable and
//! serves any block of its rows: a part of the same rows as an old part (the same partitioner)
//! is that part, and a part of other rows (another partitioner, or none) is assembled from the
//! old parts' rows. The optimizers are element-wise, so the slots split by rows exactly as the
//! values do; each element keeps its bits. A new part's version is the largest of the old
//! parts its rows come from (they are equal: every update pushes every part of a variable).

use std::collections::BTreeMap;

use crate::limits::{MAX_POOL_BYTES, MAX_VARIABLES};
use crate::table::try_with_capacity;
use crate::{Error, Result, ServerOptimizer, VariableInfo};

/// One old part of a whole variable.
#[derive(Clone, Debug, PartialEq)]
struct Part {
    info: VariableInfo,
    version: u64,
    value: Vec<f32>,
    slots: Vec<Vec<f32>>,
}

impl Part {
    /// Its first row and its rows.
    fn rows(&self) -> (u64, u64) {
        (self.info.row_offset, rows_of(&self.info.shape))
    }
}

/// The rows of a shape along its first axis (1 for a scalar).
fn rows_of(shape: &[usize]) -> u64 {
    shape.first().map_or(1, |&r| r as u64)
}

/// The elements of one row of a shape (1 for a scalar).
fn row_len(shape: &[usize]) -> usize {
    shape.iter().skip(1).product()
}

/// An old part as a snapshot holds it: its info, version, values and optimizer slots (the
/// state module's `SnapshotVariable`).
type SnapshotVariable = (VariableInfo, u64, Vec<f32>, Vec<Vec<f32>>);

/// The values a created part takes from the pool: its values, its optimizer slots and its
/// version.
pub(crate) type Drawn = (Vec<f32>, Vec<Vec<f32>>, u64);

/// Every old task's dense variables, by whole variable; see the module's documentation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RestorePool {
    /// By whole variable: its full shape and its old parts, by first row.
    vars: BTreeMap<String, (Vec<usize>, Vec<Part>)>,
    parts: usize,
    bytes: u64,
}

impl RestorePool {
    /// Adds an old part (checked as a task checks a variable it is asked to create), within
    /// [`MAX_VARIABLES`] parts and [`MAX_POOL_BYTES`] bytes of values and slots.
    pub(crate) fn insert(&mut self, (info, version, value, slots): SnapshotVariable) -> Result<()> {
        info.validate()?;
        let bytes = (value.len() + slots.iter().map(Vec::len).sum::<usize>()) as u64 * 4;
        let (parts, total) = (self.parts + 1, self.bytes.saturating_add(bytes));
        if parts > MAX_VARIABLES || total > MAX_POOL_BYTES {
            return Err(Error::PoolTooLarge { parts, bytes: total });
        }
        let (full, list) =
            self.vars.entry(info.variable.clone()).or_insert_with(|| (info.full_shape.clone(), Vec::new()));
        if *full != info.full_shape {
            let problem = "in a part of another shape";
            return Err(Error::PoolRows { variable: info.variable.clone(), row: info.row_offset, problem });
        }
        list.push(Part { info, version, value, slots });
        (self.parts, self.bytes) = (parts, total);
        Ok(())
    }

    /// Checks that every variable's parts cover its rows exactly once, and orders them.
    pub(crate) fn check_complete(&mut self) -> Result<()> {
        for (name, (full, parts)) in &mut self.vars {
            parts.sort_by_key(|p| p.info.row_offset);
            let mut next = 0u64;
            for p in parts.iter() {
                let (first, rows) = p.rows();
                if first != next {
                    let (row, problem) = if first < next { (first, "twice") } else { (next, "nowhere") };
                    return Err(Error::PoolRows { variable: name.clone(), row, problem });
                }
                next = first + rows;
            }
            if next != rows_of(full) {
                return Err(Error::PoolRows { variable: name.clone(), row: next, problem: "nowhere" });
            }
        }
        Ok(())
    }

    /// The number of old parts held.
    pub fn parts(&self) -> usize {
        self.parts
    }

    /// The whole variables held and their full shapes.
    pub fn variables(&self) -> impl Iterator<Item = (&str, &[usize])> {
        self.vars.iter().map(|(name, (full, _))| (name.as_str(), full.as_slice()))
    }

    /// Refuses a part (validated) the pool cannot serve: its variable is not in the checkpoint,
    /// or is of another full shape.
    pub(crate) fn check(&self, task: &str, info: &VariableInfo) -> Result<()> {
        let Some((full, _)) = self.vars.get(&info.variable) else {
            return Err(Error::NotInCheckpoint { task: task.into(), variable: info.variable.clone() });
        };
        if *full != info.full_shape {
            return Err(Error::CheckpointShape {
                task: task.into(),
                variable: info.variable.clone(),
                have: full.clone(),
                want: info.full_shape.clone(),
            });
        }
        Ok(())
    }

    /// The values, slots (`optimizer`'s) and version of part `info` (validated), from the old
    /// parts holding its rows; memory is reserved fallibly.
    pub(crate) fn draw(&self, task: &str, info: &VariableInfo, optimizer: &ServerOptimizer) -> Result<Drawn> {
        self.check(task, info)?;
        let (_, parts) = &self.vars[&info.variable];
        let n = info.numel();
        let mut value = try_with_capacity(task, n, "the restored variables' values")?;
        value.resize(n, 0.0);
        let Some(mut slots) = optimizer.try_new_slots(n) else {
            let bytes = n.saturating_mul(4 * optimizer.slots());
            return Err(Error::OutOfMemory { task: task.into(), bytes, what: "optimizer slots" });
        };
        let width = row_len(&info.full_shape);
        let (first, end) = (info.row_offset, info.row_offset + rows_of(&info.shape));
        let mut version = 0;
        for p in parts {
            let (p_first, p_rows) = p.rows();
            let (from, to) = (first.max(p_first), end.min(p_first + p_rows));
            if from >= to {
                continue;
            }
            version = version.max(p.version);
            let src = (from - p_first) as usize * width..(to - p_first) as usize * width;
            let dst = (from - first) as usize * width..(to - first) as usize * width;
            value[dst.clone()].copy_from_slice(&p.value[src.clone()]);
            for (slot, old) in slots.iter_mut().zip(&p.slots) {
                slot[dst.clone()].copy_from_slice(&old[src.clone()]);
            }
        }
        Ok((value, slots, version))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Part `part` of `parts` of a `[rows, 2]` variable `w`, its values `row * 10 + column`
    /// plus `base`, one slot of their negatives.
    fn part(rows: usize, parts: u32, part: u32, offset: u64, len: usize, version: u64) -> SnapshotVariable {
        let info = VariableInfo {
            name: if parts > 1 { format!("w/part_{part}") } else { "w".into() },
            shape: vec![len, 2],
            variable: "w".into(),
            part,
            num_parts: parts,
            row_offset: offset,
            full_shape: vec![rows, 2],
            state: false,
        };
        let value: Vec<f32> = (0..len * 2).map(|k| ((offset as usize + k / 2) * 10 + k % 2) as f32 + 0.125).collect();
        let slot = value.iter().map(|v| -v).collect();
        (info, version, value, vec![slot])
    }

    fn whole_as(parts: u32, part: u32, offset: u64, len: usize) -> VariableInfo {
        part_info(5, parts, part, offset, len)
    }

    fn part_info(rows: usize, parts: u32, part: u32, offset: u64, len: usize) -> VariableInfo {
        self::part(rows, parts, part, offset, len, 0).0
    }

    const MOMENTUM: ServerOptimizer = ServerOptimizer::Momentum { lr: 0.1, momentum: 0.9, nesterov: false };

    /// A variable held in 2 parts is served whole, in the same 2 parts and in 3 other ones,
    /// every element and slot with its bits; its version is the parts'.
    #[test]
    fn parts_are_served_in_any_split_bit_for_bit() {
        let mut pool = RestorePool::default();
        pool.insert(part(5, 2, 1, 3, 2, 7)).unwrap();
        pool.insert(part(5, 2, 0, 0, 3, 7)).unwrap();
        pool.check_complete().unwrap();
        assert_eq!(pool.parts(), 2);
        let whole = part(5, 1, 0, 0, 5, 7);
        assert_eq!(pool.draw("ps:0", &whole.0, &MOMENTUM).unwrap(), (whole.2.clone(), whole.3.clone(), 7));
        for (parts, rows) in [(2u32, vec![3usize, 2]), (3, vec![2, 2, 1])] {
            let mut offset = 0;
            for (k, &len) in rows.iter().enumerate() {
                let want = part(5, parts, k as u32, offset, len, 7);
                let got = pool.draw("ps:1", &whole_as(parts, k as u32, offset, len), &MOMENTUM).unwrap();
                assert_eq!(got, (want.2, want.3, 7), "part {k} of {parts}");
                offset += len as u64;
            }
        }
    }

    /// A variable the checkpoint lacks, or of another shape, is refused naming it; parts that
    /// overlap, leave rows out or disagree on the shape are refused at the restore.
    #[test]
    fn what_the_pool_cannot_serve_is_refused_naming_the_variable() {
        let mut pool = RestorePool::default();
        pool.insert(part(5, 1, 0, 0, 5, 1)).unwrap();
        pool.check_complete().unwrap();
        let e = pool.draw("ps:2", &VariableInfo::whole("b", vec![2]), &MOMENTUM).unwrap_err();
        assert!(matches!(&e, Error::NotInCheckpoint { variable, .. } if variable == "b"), "{e}");
        assert_eq!(e.to_string(), "ps:2 was restored from a job's checkpoint, which has no variable b; create the model the checkpoint was written for");
        let e = pool.draw("ps:2", &VariableInfo::whole("w", vec![6, 2]), &MOMENTUM).unwrap_err();
        assert!(
            e.to_string().starts_with(
                "ps:2 was restored from a job's checkpoint, which holds variable w of shape [5, 2], not [6, 2]"
            ),
            "{e}"
        );
        let twice = [part(5, 2, 0, 0, 3, 1), part(5, 2, 0, 0, 3, 1), part(5, 2, 1, 3, 2, 1)];
        let gap = [part(5, 2, 0, 0, 3, 1)];
        for (parts, want) in [(&twice[..], "from row 0 twice"), (&gap[..], "from row 3 nowhere")] {
            let mut pool = RestorePool::default();
            for p in parts {
                pool.insert(p.clone()).unwrap();
            }
            let e = pool.check_complete().unwrap_err();
            assert!(e.to_string().contains(&format!("holds variable w {want}")), "{e}");
        }
        let mut pool = RestorePool::default();
        pool.insert(part(5, 2, 0, 0, 3, 1)).unwrap();
        let e = pool.insert(part(6, 2, 1, 3, 3, 1)).unwrap_err();
        assert!(e.to_string().contains("from row 3 in a part of another shape"), "{e}");
    }
}
