//! What a parameter-server task checks before it takes a setting or a request: names, modes,
//! variables, optimizers, learning-rate schedules and chunk lengths, each refused with the
//! [`Error`] that says what to change.
//!
//! The types themselves (`types.rs`, `optimizer.rs`, `chunk.rs`) are the vocabulary the error
//! names (a mode, a format, a variable, an optimizer); their checks live here, above both, so
//! that the error imports the vocabulary and nothing imports back.

use strata_core::embedding::{RowInit, TableSize, MAX_EMBEDDING_DIM};
use strata_core::optim::schedule::LrSchedule;

use crate::limits::{
    MAX_CHUNK_BYTES, MAX_CHUNK_ELEMENTS, MAX_NAME_BYTES, MAX_RANK, MAX_TABLE_SHARDS, MAX_VARIABLE_ELEMENTS, MAX_WORKERS,
};
use crate::optimizer::schedule_kind;
use crate::{Error, PsMode, Result, RowOptimizer, ServerOptimizer, TableInfo, VariableInfo, WireFormat};

/// Checks a name's length against [`MAX_NAME_BYTES`]; `what` says which name it is.
pub fn check_name(what: &'static str, name: &str) -> Result<()> {
    if name.len() > MAX_NAME_BYTES {
        return Err(Error::NameTooLong { what, bytes: name.len() });
    }
    Ok(())
}

impl PsMode {
    /// Checks the mode: sync mode needs a worker (at most [`MAX_WORKERS`]), and fewer backup
    /// workers than workers.
    pub fn validate(&self) -> Result<()> {
        if let PsMode::Sync { workers, backup_workers } = *self {
            if workers == 0 {
                return Err(Error::SyncWithoutWorkers);
            }
            if workers > MAX_WORKERS {
                return Err(Error::TooManyWorkers { workers });
            }
            if backup_workers >= workers {
                return Err(Error::TooManyBackupWorkers { workers, backup_workers });
            }
        }
        Ok(())
    }
}

impl VariableInfo {
    /// Checks the variable: a name of at most [`MAX_NAME_BYTES`] (its whole variable's too), at
    /// most [`MAX_RANK`] axes and [`MAX_VARIABLE_ELEMENTS`] elements (the shard and the whole
    /// variable), a part number below the number of parts, and the shard a block of rows
    /// inside its whole variable.
    pub fn validate(&self) -> Result<()> {
        if self.name.is_empty() {
            return Err(Error::UnnamedVariable);
        }
        check_name("variable", &self.name)?;
        check_name("variable", &self.variable)?;
        for shape in [&self.shape, &self.full_shape] {
            if shape.len() > MAX_RANK {
                return Err(Error::RankTooLarge { variable: self.name.clone(), rank: shape.len() });
            }
        }
        for shape in [&self.shape, &self.full_shape] {
            let mut n: usize = 1;
            for &d in shape {
                n = n.checked_mul(d).filter(|&n| n <= MAX_VARIABLE_ELEMENTS).ok_or_else(|| {
                    Error::VariableTooLarge {
                        variable: self.name.clone(),
                        shape: shape.iter().map(|&d| d as u64).collect(),
                    }
                })?;
            }
        }
        if self.part >= self.num_parts {
            return Err(Error::PartOutOfRange {
                variable: self.name.clone(),
                part: self.part,
                num_parts: self.num_parts,
            });
        }
        if self.shape.len() != self.full_shape.len() || self.shape.get(1..) != self.full_shape.get(1..) {
            return Err(Error::ShardShape {
                variable: self.name.clone(),
                shape: self.shape.clone(),
                full_shape: self.full_shape.clone(),
            });
        }
        let rows = self.shape.first().copied().unwrap_or(1);
        let full_rows = self.full_shape.first().copied().unwrap_or(1);
        let end = usize::try_from(self.row_offset).ok().and_then(|o| o.checked_add(rows));
        if end.is_none_or(|end| end > full_rows) {
            return Err(Error::ShardRows { variable: self.name.clone(), row_offset: self.row_offset, rows, full_rows });
        }
        Ok(())
    }
}

impl ServerOptimizer {
    /// Checks the parameters: finite numbers, a positive learning rate, decays in `[0, 1)`,
    /// AdamW's epsilon positive and weight decay not negative, Adagrad's accumulator and
    /// epsilon not negative.
    pub fn validate(&self) -> Result<()> {
        let finite = match *self {
            ServerOptimizer::Sgd { lr } => vec![lr],
            ServerOptimizer::Momentum { lr, momentum, .. } => vec![lr, momentum],
            ServerOptimizer::AdamW { lr, beta1, beta2, eps, weight_decay } => vec![lr, beta1, beta2, eps, weight_decay],
            ServerOptimizer::Adagrad { lr, initial_accumulator, eps } => vec![lr, initial_accumulator, eps],
        };
        if finite.iter().any(|v| !v.is_finite()) {
            return Err(Error::NonFiniteOptimizer { kind: self.name().into() });
        }
        let lr = self.learning_rate();
        if lr <= 0.0 {
            return Err(Error::LearningRate { lr });
        }
        match *self {
            ServerOptimizer::Sgd { .. } => {}
            ServerOptimizer::Momentum { momentum, .. } => {
                if !(0.0..1.0).contains(&momentum) {
                    return Err(Error::Momentum { momentum });
                }
            }
            ServerOptimizer::AdamW { beta1, beta2, eps, weight_decay, .. } => {
                for (which, value) in [("beta1", beta1), ("beta2", beta2)] {
                    if !(0.0..1.0).contains(&value) {
                        return Err(Error::Beta { which, value });
                    }
                }
                if eps <= 0.0 || weight_decay < 0.0 {
                    return Err(Error::AdamWParameters { eps, weight_decay });
                }
            }
            ServerOptimizer::Adagrad { initial_accumulator, eps, .. } => {
                if initial_accumulator < 0.0 || eps < 0.0 {
                    return Err(Error::AdagradParameters { initial_accumulator, eps });
                }
            }
        }
        Ok(())
    }
}

impl TableInfo {
    /// Checks the table's description: a name of 1 to [`MAX_NAME_BYTES`] bytes, a dim of 1 to
    /// [`MAX_EMBEDDING_DIM`], at least one row (or a positive bound per shard, and a positive
    /// `evict_after`), a finite initializer (`low < high`, `std >= 0`), a shard below 1 to
    /// [`MAX_TABLE_SHARDS`] shards, and an optimizer whose parameters are in range. Each
    /// refusal names the table and the field.
    pub fn validate(&self) -> Result<()> {
        let table = &self.config.name;
        let bad =
            |field: &'static str, detail: String| Err(Error::InvalidTable { table: table.clone(), field, detail });
        if table.is_empty() {
            return bad("name", "is empty; name the table".into());
        }
        check_name("table", table)?;
        let dim = self.config.dim;
        if dim == 0 || dim > MAX_EMBEDDING_DIM {
            return bad("dim", format!("{dim} is outside 1..={MAX_EMBEDDING_DIM}"));
        }
        match self.config.size {
            TableSize::Rows(0) => return bad("size", "of 0 rows: give the table at least one row".into()),
            TableSize::Ids { max_rows_per_shard: 0, .. } => {
                return bad("size", "bound of 0 rows per shard: give it at least one".into())
            }
            TableSize::Ids { evict_after: Some(0), .. } => {
                return bad("size", "evict_after of 0 updates: give a positive number of updates, or none".into())
            }
            _ => {}
        }
        match self.config.init {
            RowInit::Uniform { low, high } if !(low.is_finite() && high.is_finite() && low < high) => {
                return bad("init", format!("uniform [{low}, {high}): use finite bounds with low < high"));
            }
            RowInit::Normal { std } if !(std.is_finite() && std >= 0.0) => {
                return bad("init", format!("normal std {std}: use a finite std of 0 or more"));
            }
            _ => {}
        }
        if self.num_shards == 0 || self.num_shards > MAX_TABLE_SHARDS {
            return bad("num_shards", format!("{} is outside 1..={MAX_TABLE_SHARDS}", self.num_shards));
        }
        if self.shard >= self.num_shards {
            return bad("shard", format!("{} is not below num_shards {}", self.shard, self.num_shards));
        }
        check_row_optimizer(&self.optimizer).map_err(|(field, detail)| Error::InvalidTable {
            table: table.clone(),
            field,
            detail,
        })
    }
}

/// Checks a row optimizer's parameters; the field and what to change when one is out of range.
fn check_row_optimizer(o: &RowOptimizer) -> std::result::Result<(), (&'static str, String)> {
    let named: Vec<(&'static str, f64)> = match *o {
        RowOptimizer::Sgd { lr } => vec![("optimizer.lr", lr)],
        RowOptimizer::Adagrad { lr, initial_accumulator, eps } => {
            vec![("optimizer.lr", lr), ("optimizer.initial_accumulator", initial_accumulator), ("optimizer.eps", eps)]
        }
        RowOptimizer::Ftrl { lr, lr_power, initial_accumulator, l1, l2, beta } => vec![
            ("optimizer.lr", lr),
            ("optimizer.lr_power", lr_power),
            ("optimizer.initial_accumulator", initial_accumulator),
            ("optimizer.l1", l1),
            ("optimizer.l2", l2),
            ("optimizer.beta", beta),
        ],
        RowOptimizer::LazyAdam { lr, beta1, beta2, eps } => {
            vec![("optimizer.lr", lr), ("optimizer.beta1", beta1), ("optimizer.beta2", beta2), ("optimizer.eps", eps)]
        }
    };
    for &(field, value) in &named {
        let ok = match field {
            "optimizer.lr" => value.is_finite() && value > 0.0,
            "optimizer.lr_power" => value.is_finite() && value <= 0.0,
            "optimizer.beta1" | "optimizer.beta2" => (0.0..1.0).contains(&value),
            "optimizer.eps" if matches!(o, RowOptimizer::LazyAdam { .. }) => value.is_finite() && value > 0.0,
            _ => value.is_finite() && value >= 0.0,
        };
        if !ok {
            let want = match field {
                "optimizer.lr" => "a finite rate above 0",
                "optimizer.lr_power" => "a finite power of 0 or less (Keras: -0.5)",
                "optimizer.beta1" | "optimizer.beta2" => "a decay in [0, 1)",
                "optimizer.eps" if matches!(o, RowOptimizer::LazyAdam { .. }) => "a finite epsilon above 0",
                _ => "a finite value of 0 or more",
            };
            return Err((field, format!("{value} of {}: use {want}", o.name())));
        }
    }
    Ok(())
}

/// Checks a learning-rate schedule a ps task is asked to follow: it accepts exactly the
/// schedules strata-core's [`LrSchedule::validate`] accepts (finite rates of 0 or more, a peak
/// above 0, a decay that ends after the warm-up), and refuses the others with
/// [`Error::InvalidSchedule`] naming the field that is wrong.
pub fn check_schedule(schedule: &LrSchedule) -> Result<()> {
    if schedule.validate().is_ok() {
        return Ok(());
    }
    let kind = schedule_kind(schedule);
    let bad = |field: &'static str, detail: String| Err(Error::InvalidSchedule { kind, field, detail });
    match *schedule {
        LrSchedule::Constant { lr } => bad("lr", format!("{lr}: use a finite rate of 0 or more")),
        LrSchedule::WarmupCosine { peak, warmup_steps, total_steps, final_lr }
        | LrSchedule::WarmupLinear { peak, warmup_steps, total_steps, final_lr } => {
            if !(peak.is_finite() && peak > 0.0) {
                return bad("peak", format!("{peak}: use a finite rate above 0"));
            }
            if !(final_lr.is_finite() && final_lr >= 0.0) {
                return bad("final_lr", format!("{final_lr}: use a finite rate of 0 or more"));
            }
            bad(
                "total_steps",
                format!(
                    "{total_steps} with warmup_steps {warmup_steps}: the decay must end after the warm-up; use more total_steps than warmup_steps"
                ),
            )
        }
    }
}

/// Checks the data length of a chunk: at most [`MAX_CHUNK_BYTES`], whole f32 elements.
pub fn check_chunk_len(len: usize) -> Result<()> {
    if len > MAX_CHUNK_BYTES {
        return Err(Error::ChunkTooLarge { bytes: len });
    }
    if !len.is_multiple_of(4) {
        return Err(Error::ChunkNotWholeElements { bytes: len });
    }
    Ok(())
}

/// Checks the data length of a chunk of `format`: for f32 as [`check_chunk_len`]; for a
/// 16-bit format an even number of bytes, at most [`MAX_CHUNK_ELEMENTS`] elements (the limit
/// is in elements: a 16-bit chunk carries half the bytes of an f32 one).
pub fn check_chunk_len_in(len: usize, format: WireFormat) -> Result<()> {
    if format.half().is_none() {
        return check_chunk_len(len);
    }
    if len / 2 > MAX_CHUNK_ELEMENTS {
        return Err(Error::ChunkTooManyElements { elements: len / 2, format });
    }
    if !len.is_multiple_of(2) {
        return Err(Error::ChunkNotWholeHalfElements { bytes: len, format });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_and_variables_are_checked_and_shown() {
        PsMode::Sync { workers: 3, backup_workers: 2 }.validate().unwrap();
        assert!(matches!(PsMode::Sync { workers: 0, backup_workers: 0 }.validate(), Err(Error::SyncWithoutWorkers)));
        let e = PsMode::Sync { workers: 2, backup_workers: 2 }.validate().unwrap_err();
        assert_eq!(
            e.to_string(),
            "2 backup workers leave none of the 2 workers to aggregate; use fewer backup workers"
        );
        assert_eq!(PsMode::Sync { workers: 3, backup_workers: 1 }.to_string(), "sync(3 workers, 1 backup)");

        VariableInfo::whole("w", vec![1 << 16, 1 << 15]).validate().unwrap();
        let e = VariableInfo::whole("w", vec![1 << 16, 1 << 16]).validate().unwrap_err();
        assert!(
            matches!(&e, Error::VariableTooLarge { variable, shape } if variable == "w" && shape == &[1 << 16, 1 << 16])
        );
        assert!(matches!(VariableInfo::whole("", vec![1]).validate(), Err(Error::UnnamedVariable)));
        let mut shard = VariableInfo::whole("w/part_2", vec![3]);
        shard.part = 2;
        shard.num_parts = 2;
        assert_eq!(shard.validate().unwrap_err().to_string(), "variable w/part_2 is part 2 of 2");

        // A shard is a block of rows inside its whole variable.
        let mut shard = VariableInfo::whole("w/part_1", vec![2, 3]);
        (shard.variable, shard.part, shard.num_parts, shard.row_offset) = ("w".into(), 1, 2, 2);
        shard.full_shape = vec![4, 3];
        shard.validate().unwrap();
        shard.row_offset = u64::MAX - 1;
        let e = shard.validate().unwrap_err();
        assert!(matches!(&e, Error::ShardRows { rows: 2, full_rows: 4, .. }), "{e}");
        shard.row_offset = 3;
        assert!(matches!(shard.validate(), Err(Error::ShardRows { row_offset: 3, .. })));
        shard.row_offset = 2;
        shard.full_shape = vec![4, 5];
        assert!(matches!(shard.validate(), Err(Error::ShardShape { .. })));
        let mut whole = VariableInfo::whole("w", vec![3]);
        whole.row_offset = 1;
        assert!(matches!(whole.validate(), Err(Error::ShardRows { .. })));
        let scalar = VariableInfo::whole("s", vec![]);
        scalar.validate().unwrap();

        // Names and ranks are bounded.
        let e = VariableInfo::whole("x".repeat(257), vec![1]).validate().unwrap_err();
        assert!(matches!(e, Error::NameTooLong { what: "variable", bytes: 257 }), "{e}");
        VariableInfo::whole("x".repeat(256), vec![1]).validate().unwrap();
        let e = VariableInfo::whole("r", vec![1; 33]).validate().unwrap_err();
        assert!(matches!(e, Error::RankTooLarge { rank: 33, .. }), "{e}");
        assert!(matches!(
            PsMode::Sync { workers: MAX_WORKERS + 1, backup_workers: 0 }.validate(),
            Err(Error::TooManyWorkers { .. })
        ));
    }

    #[test]
    fn parameters_are_checked() {
        let ok = [
            ServerOptimizer::Sgd { lr: 0.5 },
            ServerOptimizer::Momentum { lr: 0.1, momentum: 0.0, nesterov: true },
            ServerOptimizer::AdamW { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-7, weight_decay: 0.0 },
            ServerOptimizer::Adagrad { lr: 0.1, initial_accumulator: 0.0, eps: 0.0 },
        ];
        for o in ok {
            o.validate().unwrap();
        }
        let bad = [
            (ServerOptimizer::Sgd { lr: 0.0 }, "the learning rate must be positive, not 0"),
            (ServerOptimizer::Sgd { lr: f64::NAN }, "the sgd optimizer's parameters must be finite numbers"),
            (
                ServerOptimizer::Momentum { lr: 0.1, momentum: 1.0, nesterov: false },
                "momentum must be in [0, 1), not 1",
            ),
            (
                ServerOptimizer::AdamW { lr: 0.1, beta1: 0.9, beta2: -0.1, eps: 1e-7, weight_decay: 0.0 },
                "beta2 must be in [0, 1), not -0.1",
            ),
            (
                ServerOptimizer::AdamW { lr: 0.1, beta1: 0.9, beta2: 0.9, eps: 0.0, weight_decay: 0.0 },
                "adamw needs epsilon > 0 and weight_decay >= 0",
            ),
            (
                ServerOptimizer::Adagrad { lr: 0.1, initial_accumulator: -1.0, eps: 0.0 },
                "adagrad needs initial_accumulator >= 0 and epsilon >= 0",
            ),
        ];
        for (o, message) in bad {
            let e = o.validate().unwrap_err();
            assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument);
            assert_eq!(e.to_string(), message);
        }
    }

    #[test]
    fn chunk_lengths_are_checked() {
        check_chunk_len(MAX_CHUNK_BYTES).unwrap();
        check_chunk_len(0).unwrap();
        assert!(
            matches!(check_chunk_len(MAX_CHUNK_BYTES + 4), Err(Error::ChunkTooLarge { bytes }) if bytes == MAX_CHUNK_BYTES + 4)
        );
        assert!(matches!(check_chunk_len(6), Err(Error::ChunkNotWholeElements { bytes: 6 })));
    }

    #[test]
    fn half_chunks_are_checked_in_elements() {
        check_chunk_len_in(2 * MAX_CHUNK_ELEMENTS, WireFormat::Bf16).unwrap();
        check_chunk_len_in(MAX_CHUNK_BYTES, WireFormat::F32).unwrap();
        let e = check_chunk_len_in(2 * MAX_CHUNK_ELEMENTS + 2, WireFormat::F16).unwrap_err();
        assert_eq!(
            e.to_string(),
            "a chunk carries 262145 f16 elements; the limit is 262144: cut tensors into smaller chunks"
        );
        let e = check_chunk_len_in(7, WireFormat::Bf16).unwrap_err();
        assert_eq!(e.to_string(), "a chunk carries 7 bytes, not a whole number of bf16 elements (2 bytes each)");
        assert!(matches!(check_chunk_len_in(6, WireFormat::F32), Err(Error::ChunkNotWholeElements { bytes: 6 })));
    }
}
