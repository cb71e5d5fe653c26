//! `--table-optimizer` under the in-process strategies: the ctr model's table as rows in this
//! process's memory (`strata_strategies::LocalTables`), stepped by the row optimizer, instead
//! of a variable the dense optimizer steps whole.

use std::sync::Arc;

use strata::StrategyKind;
use strata_core::embedding::TableStore;
use strata_strategies::LocalTables;

use crate::train_args::{ModelKind, TrainArgs};

/// The table store of an in-process strategy's options: local tables stepping the rows with
/// `--table-optimizer` at `--table-lr`, for `--model ctr` with `--table-optimizer`; `None`
/// otherwise (the table is a variable). The flags were checked (`TrainArgs::check_ctr_flags`).
pub fn store(args: &TrainArgs) -> Option<Arc<dyn TableStore>> {
    let local =
        matches!(args.strategy, StrategyKind::OneDevice | StrategyKind::Mirrored | StrategyKind::CentralStorage);
    (local && args.model == ModelKind::Ctr && args.table_optimizer.is_some())
        .then(|| Arc::new(LocalTables::new(args.row_optimizer())) as Arc<dyn TableStore>)
}
