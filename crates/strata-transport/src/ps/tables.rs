//! Embedding tables at the edge between the protocol and strata-ps: table descriptions
//! ([`proto::TableSpec`]), a push's rows ([`proto::RowsSpec`] in its header, their gradients in
//! the chunks numbered after its variables) and the answer of `PullRows`.

use prost::bytes::Bytes;
use strata_core::embedding::{RowInit, TableConfig, TableSize};
use strata_proto::v1 as proto;
use strata_ps::{Chunk, PushHeader, RowGrads, RowOptimizer, TableInfo, TableStatus, WireFormat, MAX_CHUNK_ELEMENTS};

fn invalid(table: &str, field: &'static str, detail: String) -> strata_ps::Error {
    strata_ps::Error::InvalidTable { table: table.to_string(), field, detail }
}

fn row_init_spec(init: RowInit) -> proto::RowInitSpec {
    match init {
        RowInit::Zeros => proto::RowInitSpec { kind: "zeros".into(), ..Default::default() },
        RowInit::Uniform { low, high } => proto::RowInitSpec { kind: "uniform".into(), low, high, std: 0.0 },
        RowInit::Normal { std } => proto::RowInitSpec { kind: "normal".into(), std, ..Default::default() },
    }
}

fn row_init(table: &str, s: &proto::RowInitSpec) -> strata_ps::Result<RowInit> {
    match s.kind.as_str() {
        "zeros" => Ok(RowInit::Zeros),
        "uniform" => Ok(RowInit::Uniform { low: s.low, high: s.high }),
        "normal" => Ok(RowInit::Normal { std: s.std }),
        other => Err(invalid(table, "init", format!("{other:?} is no initialiser; use zeros, uniform or normal"))),
    }
}

fn row_optimizer_spec(o: &RowOptimizer) -> proto::RowOptimizerSpec {
    let mut s =
        proto::RowOptimizerSpec { kind: o.name().into(), learning_rate: o.learning_rate(), ..Default::default() };
    match *o {
        RowOptimizer::Sgd { .. } => {}
        RowOptimizer::Adagrad { initial_accumulator, eps, .. } => {
            s.initial_accumulator = initial_accumulator;
            s.epsilon = eps;
        }
        RowOptimizer::Ftrl { lr_power, initial_accumulator, l1, l2, beta, .. } => {
            s.lr_power = lr_power;
            s.initial_accumulator = initial_accumulator;
            s.l1 = l1;
            s.l2 = l2;
            s.beta = beta;
        }
        RowOptimizer::LazyAdam { beta1, beta2, eps, .. } => {
            s.beta1 = beta1;
            s.beta2 = beta2;
            s.epsilon = eps;
        }
    }
    s
}

fn row_optimizer(table: &str, s: &proto::RowOptimizerSpec) -> strata_ps::Result<RowOptimizer> {
    let lr = s.learning_rate;
    Ok(match s.kind.as_str() {
        "sgd" => RowOptimizer::Sgd { lr },
        "adagrad" => RowOptimizer::Adagrad { lr, initial_accumulator: s.initial_accumulator, eps: s.epsilon },
        "ftrl" => RowOptimizer::Ftrl {
            lr,
            lr_power: s.lr_power,
            initial_accumulator: s.initial_accumulator,
            l1: s.l1,
            l2: s.l2,
            beta: s.beta,
        },
        "lazy_adam" => RowOptimizer::LazyAdam { lr, beta1: s.beta1, beta2: s.beta2, eps: s.epsilon },
        other => {
            return Err(invalid(
                table,
                "optimizer",
                format!("{other:?} is no row optimizer; use sgd, adagrad, ftrl or lazy_adam"),
            ))
        }
    })
}

/// A table as the protocol describes it.
pub(crate) fn table_spec(t: &TableInfo) -> proto::TableSpec {
    let c = &t.config;
    let (rows, max_rows_per_shard, evict_after) = match c.size {
        TableSize::Rows(rows) => (rows, 0, 0),
        TableSize::Ids { max_rows_per_shard, evict_after } => (0, max_rows_per_shard, evict_after.unwrap_or(0)),
    };
    proto::TableSpec {
        name: c.name.clone(),
        dim: c.dim as u64,
        rows,
        max_rows_per_shard,
        evict_after,
        init: Some(row_init_spec(c.init)),
        seed: t.seed,
        shard: t.shard,
        num_shards: t.num_shards,
        optimizer: Some(row_optimizer_spec(&t.optimizer)),
    }
}

/// The table a spec describes, checked as a task checks it ([`TableInfo::validate`]).
pub(crate) fn table_info(s: &proto::TableSpec) -> strata_ps::Result<TableInfo> {
    let name = &s.name;
    let size = match (s.rows, s.max_rows_per_shard) {
        (0, 0) => return Err(invalid(name, "size", "neither rows nor max_rows_per_shard is set; set one".into())),
        (rows, 0) => TableSize::Rows(rows),
        (0, bound) => {
            TableSize::Ids { max_rows_per_shard: bound, evict_after: (s.evict_after > 0).then_some(s.evict_after) }
        }
        (_, _) => return Err(invalid(name, "size", "both rows and max_rows_per_shard are set; set one".into())),
    };
    let dim = usize::try_from(s.dim).map_err(|_| invalid(name, "dim", format!("{} is too large", s.dim)))?;
    let init = row_init(name, &s.init.clone().unwrap_or_default())?;
    let config = TableConfig { name: name.clone(), dim, size, init };
    let optimizer = row_optimizer(name, &s.optimizer.clone().unwrap_or_default())?;
    let info = TableInfo { config, seed: s.seed, shard: s.shard, num_shards: s.num_shards, optimizer };
    info.validate()?;
    Ok(info)
}

/// The protocol's rows of a push header.
pub(crate) fn rows_spec(rows: &[RowGrads]) -> Vec<proto::RowsSpec> {
    rows.iter().map(|r| proto::RowsSpec { table: r.table.clone(), lease: r.lease, ids: r.ids.clone() }).collect()
}

/// A push header's rows, their gradients empty until [`take_row_chunks`] fills them.
pub(crate) fn rows(specs: Vec<proto::RowsSpec>) -> Vec<RowGrads> {
    specs.into_iter().map(|s| RowGrads { table: s.table, lease: s.lease, ids: s.ids, grads: Vec::new() }).collect()
}

/// Moves the chunks of a push that carry its rows' gradients (numbered after its variables,
/// in order, each table's from offset 0 on without a gap) into `header.rows`; returns the
/// variables' chunks. A gap, an overlap or a number beyond the rows is refused.
pub(crate) fn take_row_chunks(header: &mut PushHeader, chunks: Vec<Chunk>) -> strata_ps::Result<Vec<Chunk>> {
    let first = header.variables.len();
    let mut variables = Vec::with_capacity(chunks.len());
    for c in chunks {
        let Some(k) = (c.var as usize).checked_sub(first) else {
            variables.push(c);
            continue;
        };
        let Some(rows) = header.rows.get_mut(k) else {
            return Err(strata_ps::Error::UnknownChunkVariable {
                index: c.var as usize,
                count: first + header.rows.len(),
                request: strata_ps::RequestKind::Push,
            });
        };
        if c.offset != rows.grads.len() as u64 {
            return Err(strata_ps::Error::ChunkOutOfOrder {
                variable: rows.table.clone(),
                offset: c.offset,
                expected: rows.grads.len(),
            });
        }
        rows.grads.try_reserve(c.elements()).map_err(|_| strata_ps::Error::OutOfMemory {
            task: "this task".into(),
            bytes: c.elements() * 4,
            what: "a push's row gradients",
        })?;
        for piece in &c.pieces {
            strata_ps::extend_f32s(piece, &mut rows.grads);
        }
    }
    Ok(variables)
}

/// The chunks of rows' values (a `PullRows` answer's, or the gradients of a push it carries):
/// table `k`'s values in chunks of at most [`MAX_CHUNK_ELEMENTS`], in `format`.
pub(crate) fn row_chunks<'a>(
    values: impl IntoIterator<Item = &'a [f32]>,
    format: WireFormat,
) -> Vec<proto::TensorChunk> {
    let mut out = Vec::new();
    for (k, v) in values.into_iter().enumerate() {
        for (i, c) in v.chunks(MAX_CHUNK_ELEMENTS).enumerate() {
            let data = match format.half() {
                None => Bytes::copy_from_slice(bytemuck::cast_slice(c)),
                Some(h) => strata_ps::encode_half(c, h),
            };
            out.push(proto::TensorChunk { variable: k as u32, offset: (i * MAX_CHUNK_ELEMENTS) as u64, data });
        }
    }
    out
}

/// A table's status as the protocol carries it.
pub(crate) fn table_status_spec(t: &TableStatus) -> proto::TableStatusSpec {
    proto::TableStatusSpec { table: Some(table_spec(&t.info)), rows: t.rows, evicted: t.evicted, bytes: t.bytes }
}

/// A table's status from the protocol.
pub(crate) fn table_status(s: &proto::TableStatusSpec) -> strata_ps::Result<TableStatus> {
    let info = table_info(&s.table.clone().unwrap_or_default())?;
    Ok(TableStatus { info, rows: s.rows, evicted: s.evicted, bytes: s.bytes })
}

/// Rows of embedding tables pulled from one parameter server ([`PsClient::pull_rows`](super::PsClient::pull_rows)).
#[derive(Clone, Debug, PartialEq)]
pub struct RowsPulled {
    /// The task's version when the rows were read.
    pub version: u64,
    /// For each table asked for, its rows' values (`ids.len() * dim`, in the order of the ids).
    pub values: Vec<Vec<f32>>,
}
