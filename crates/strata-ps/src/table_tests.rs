//! Tests of embedding tables on a ps task, through the task's public API: pulls of rows under
//! leases, sparse pushes in every mode, eviction, checkpoints and resharding.

use std::collections::BTreeMap;

use bytes::Bytes;
use strata_core::embedding::{init_row, owner_of, RowInit, TableConfig, TableSize};
use strata_core::optim::schedule::LrSchedule;

use crate::{
    read_snapshot, reshard_tables, write_snapshot, Chunk, CreateHeader, Error, ErrorKind, PsMode, PushDecision,
    PushHeader, PushReply, RowGrads, RowOptimizer, RowPull, ServerOptimizer, Snapshot, State, TableInfo, TableRows,
    UpdateId, VariableInfo, WireFormat,
};

const SEED: u64 = 7;
const INIT: RowInit = RowInit::Uniform { low: -0.5, high: 0.5 };

fn f32s(x: &[f32]) -> Bytes {
    Bytes::copy_from_slice(bytemuck::cast_slice(x))
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn table(name: &str, size: TableSize, dim: usize, optimizer: RowOptimizer, shard: u32, num_shards: u32) -> TableInfo {
    TableInfo {
        config: TableConfig { name: name.into(), dim, size, init: INIT },
        seed: SEED,
        shard,
        num_shards,
        optimizer,
    }
}

fn header(
    tables: Vec<TableInfo>,
    variables: Vec<VariableInfo>,
    optimizer: ServerOptimizer,
    mode: PsMode,
) -> CreateHeader {
    CreateHeader {
        variables,
        optimizer,
        schedule: None,
        stale_rate: crate::StaleRate::Constant,
        mode,
        wire_format: WireFormat::F32,
        tables,
    }
}

/// A task of `tables` only, in `mode`.
fn task(mode: PsMode, tables: Vec<TableInfo>) -> State {
    let mut s = State::new("ps:0".into(), None);
    s.create(&header(tables, vec![], ServerOptimizer::Sgd { lr: 0.1 }, mode), &[]).unwrap();
    s
}

fn pull(s: &mut State, worker: &str, lease: u64, table: &str, ids: &[u64]) -> Result<Vec<f32>, Error> {
    let req = RowPull { worker: worker.into(), lease, table: table.into(), ids: ids.to_vec() };
    s.pull_rows(&req).map(|r| r.values)
}

fn rows(table: &str, lease: u64, ids: &[u64], grads: Vec<f32>) -> RowGrads {
    RowGrads { table: table.into(), lease, ids: ids.to_vec(), grads }
}

fn push_header(worker: &str, step: u64, base: u64, rows: Vec<RowGrads>) -> PushHeader {
    PushHeader {
        id: UpdateId { worker: worker.into(), client: "c".into(), step, seq: 0 },
        base_version: base,
        variables: vec![],
        rows,
    }
}

/// Pushes `rows` (and no dense gradient) from `worker` at `step`, computed from the task's
/// version.
fn push(s: &mut State, worker: &str, step: u64, rows: Vec<RowGrads>) -> Result<PushDecision, Error> {
    let h = push_header(worker, step, s.version(), rows);
    s.push(&h, &[])
}

/// A known gradient of row `id` at `step`, `dim` values.
fn grad(id: u64, step: u64, dim: usize) -> Vec<f32> {
    (0..dim).map(|j| ((id * 7 + step * 13 + j as u64 * 5) % 23) as f32 * 0.125 - 1.25).collect()
}

fn grads(ids: &[u64], step: u64, dim: usize) -> Vec<f32> {
    ids.iter().flat_map(|&id| grad(id, step, dim)).collect()
}

fn init(table: &str, id: u64, dim: usize) -> Vec<f32> {
    let mut row = vec![0.0; dim];
    init_row(SEED, table, INIT, id, &mut row);
    row
}

fn applied(d: PushDecision) -> (u64, bool) {
    match d {
        PushDecision::Done(PushReply::Applied { version, duplicate }) => (version, duplicate),
        other => panic!("not applied: {other:?}"),
    }
}

/// The one-line message rules, and the error's kind.
fn check_message(e: &Error, kind: ErrorKind, contains: &str) {
    let m = e.to_string();
    assert_eq!(e.kind(), kind, "{m}");
    assert!(!m.contains('\n') && !m.ends_with('.') && !m.starts_with(char::is_uppercase), "{m}");
    assert!(m.contains(contains), "{m:?} should name {contains:?}");
}

/// Sparse SGD and Adagrad pushes leave a fixed table's rows with the bits of a dense variable
/// of the same initial values after dense pushes of the same gradients, zero outside the
/// rows, slots included; rows never touched keep their initial values, and only rows pulled
/// exist. Dense and sparse parts travel in one push, counted once.
#[test]
fn sparse_pushes_equal_the_dense_application_on_touched_rows() {
    let (n, dim) = (6u64, 3usize);
    let pairs = [
        (ServerOptimizer::Sgd { lr: 0.3 }, RowOptimizer::Sgd { lr: 0.3 }),
        (
            ServerOptimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 1e-7 },
            RowOptimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 1e-7 },
        ),
    ];
    for (dense, sparse) in pairs {
        let mut s = State::new("ps:0".into(), None);
        let t = table("t", TableSize::Rows(n), dim, sparse.clone(), 0, 1);
        let w0: Vec<f32> = (0..n).flat_map(|id| init("t", id, dim)).collect();
        let d = VariableInfo::whole("d", vec![n as usize, dim]);
        s.create(
            &header(vec![t], vec![d], dense.clone(), PsMode::Async),
            &[Chunk { var: 0, offset: 0, pieces: vec![f32s(&w0)] }],
        )
        .unwrap();
        let batches: [&[u64]; 3] = [&[1, 4], &[4, 2], &[1]];
        for (step, ids) in batches.iter().enumerate() {
            let step = step as u64;
            let pulled = pull(&mut s, "worker:0", step, "t", ids).unwrap();
            let dense_now = s.pull(&["d".into()]).unwrap().chunks[0].data.clone();
            let dense_now: Vec<f32> = bytemuck::pod_collect_to_vec(&dense_now);
            for (k, &id) in ids.iter().enumerate() {
                let (a, b) = (&pulled[k * dim..(k + 1) * dim], &dense_now[id as usize * dim..(id as usize + 1) * dim]);
                assert_eq!(bits(a), bits(b), "step {step}: pulled row {id}");
            }
            let mut g = vec![0.0f32; w0.len()];
            for &id in *ids {
                g[id as usize * dim..(id as usize + 1) * dim].copy_from_slice(&grad(id, step, dim));
            }
            let h = PushHeader {
                variables: vec!["d".into()],
                ..push_header("worker:0", step, s.version(), vec![rows("t", step, ids, grads(ids, step, dim))])
            };
            let d = s.push(&h, &[Chunk { var: 0, offset: 0, pieces: vec![f32s(&g)] }]).unwrap();
            assert_eq!(applied(d), (step + 1, false), "one update");
        }
        let snap = s.snapshot();
        let (dv, dslots) = (&snap.variables[0].2, &snap.variables[0].3);
        let t = &snap.tables[0];
        assert_eq!(t.ids, vec![1, 2, 4], "only rows pulled exist");
        for (k, &id) in t.ids.iter().enumerate() {
            let r = id as usize * dim..(id as usize + 1) * dim;
            assert_eq!(bits(&t.values[k * dim..(k + 1) * dim]), bits(&dv[r.clone()]), "{sparse}: row {id}");
            if sparse.slots() == 1 {
                assert_eq!(bits(&t.slots[k * dim..(k + 1) * dim]), bits(&dslots[0][r]), "{sparse}: slots of {id}");
            }
        }
        // Rows never pushed are where the dense variable is: at their initial values.
        let all: Vec<u64> = (0..n).collect();
        let every = pull(&mut s, "worker:0", 9, "t", &all).unwrap();
        assert_eq!(bits(&every), bits(dv), "{sparse}");
        for id in [0, 3, 5] {
            assert_eq!(bits(&every[id * dim..(id + 1) * dim]), bits(&init("t", id as u64, dim)));
        }
    }
}

/// A retried push is answered from the applied-update table and changes nothing, though its
/// lease was released when it applied.
#[test]
fn a_retried_push_with_rows_applies_once() {
    let mut s = task(PsMode::Async, vec![table("t", TableSize::Rows(8), 2, RowOptimizer::Sgd { lr: 0.5 }, 0, 1)]);
    pull(&mut s, "worker:0", 1, "t", &[3, 5]).unwrap();
    let h = push_header("worker:0", 0, 0, vec![rows("t", 1, &[3, 5], grads(&[3, 5], 0, 2))]);
    assert_eq!(applied(s.push(&h, &[]).unwrap()), (1, false));
    let after = s.snapshot();
    for _ in 0..2 {
        assert_eq!(applied(s.push(&h, &[]).unwrap()), (1, true));
    }
    let again = s.snapshot();
    assert_eq!(again.tables, after.tables);
    assert_eq!(again.version, 1);
    // A new update under the released lease is refused.
    let e = push(&mut s, "worker:0", 1, vec![rows("t", 1, &[3], grad(3, 1, 2))]).unwrap_err();
    assert!(matches!(e, Error::NotLeased { id: 3, lease: 1, .. }), "{e}");
}

/// Sync mode: a round's rows are summed per row in update order and divided by the round's
/// pushes, whatever order the pushes arrive in; each touched row is stepped once.
#[test]
fn sync_rounds_take_the_mean_of_rows_whatever_the_arrival_order() {
    let dim = 2;
    let lr = 0.5f32;
    let batches: [&[u64]; 3] = [&[1, 2], &[2, 3], &[2]];
    let mut results = Vec::new();
    for order in [[0usize, 1, 2], [2, 0, 1], [1, 2, 0]] {
        let mut s = task(
            PsMode::Sync { workers: 3, backup_workers: 0 },
            vec![table("t", TableSize::Rows(6), dim, RowOptimizer::Sgd { lr: f64::from(lr) }, 0, 1)],
        );
        for (w, ids) in batches.iter().enumerate() {
            pull(&mut s, &format!("worker:{w}"), 0, "t", ids).unwrap();
        }
        for (k, &w) in order.iter().enumerate() {
            let ids = batches[w];
            let r = vec![rows("t", 0, ids, grads(ids, w as u64, dim))];
            let d = s.push(&push_header(&format!("worker:{w}"), w as u64, 0, r), &[]).unwrap();
            assert!(matches!(d, PushDecision::Wait { .. }));
            assert_eq!(s.version(), u64::from(k == 2));
        }
        results.push(s.snapshot().tables);
    }
    assert_eq!(results[0], results[1]);
    assert_eq!(results[0], results[2]);
    // The mean as the task computes it: (0 + g0) + g1 (+ g2), in update order, over 3 pushes.
    let t = &results[0][0];
    for (k, &id) in t.ids.iter().enumerate() {
        let mut sum: Option<Vec<f32>> = None;
        for (w, ids) in batches.iter().enumerate() {
            if ids.contains(&id) {
                let g = grad(id, w as u64, dim);
                sum = Some(match sum {
                    None => g.iter().map(|x| x + 0.0).collect(),
                    Some(s) => s.iter().zip(&g).map(|(a, b)| a + b).collect(),
                });
            }
        }
        let want: Vec<f32> =
            init("t", id, dim).iter().zip(sum.unwrap()).map(|(w, s)| w - ((s * (1.0 / 3.0)) * lr + 0.0)).collect();
        assert_eq!(bits(&t.values[k * dim..(k + 1) * dim]), bits(&want), "row {id}");
    }
}

/// A push of a row not pulled under its lease is refused and applies nothing (its dense part
/// neither); a worker's fifth lease forgets its oldest; a pull under the same lease again
/// replaces the lease's ids.
#[test]
fn leases_bound_what_a_push_may_carry() {
    let mut s = State::new("ps:0".into(), None);
    let t = table("t", TableSize::Rows(100), 2, RowOptimizer::Sgd { lr: 0.5 }, 0, 1);
    let h = header(vec![t], vec![VariableInfo::whole("w", vec![2])], ServerOptimizer::Sgd { lr: 0.5 }, PsMode::Async);
    s.create(&h, &[Chunk { var: 0, offset: 0, pieces: vec![f32s(&[1.0, 2.0])] }]).unwrap();
    pull(&mut s, "worker:0", 0, "t", &[1, 2]).unwrap();
    let before = s.snapshot();
    let h = PushHeader {
        variables: vec!["w".into()],
        ..push_header("worker:0", 0, 0, vec![rows("t", 0, &[1, 3], grads(&[1, 3], 0, 2))])
    };
    let e = s.push(&h, &[Chunk { var: 0, offset: 0, pieces: vec![f32s(&[1.0, 1.0])] }]).unwrap_err();
    check_message(&e, ErrorKind::InvalidArgument, "table t: row id 3 in field ids was not pulled under lease 0");
    assert_eq!(s.snapshot(), before, "nothing applied");
    // Another worker's lease does not cover this worker's push.
    pull(&mut s, "worker:1", 0, "t", &[3]).unwrap();
    let e = push(&mut s, "worker:0", 1, vec![rows("t", 0, &[3], grad(3, 0, 2))]).unwrap_err();
    assert!(matches!(e, Error::NotLeased { id: 3, .. }), "{e}");
    // A retried pull under lease 0 replaces its ids.
    pull(&mut s, "worker:0", 0, "t", &[3, 4]).unwrap();
    let e = push(&mut s, "worker:0", 1, vec![rows("t", 0, &[1], grad(1, 0, 2))]).unwrap_err();
    assert!(matches!(e, Error::NotLeased { id: 1, lease: 0, .. }), "{e}");
    // Leases 1..=4 on top of 0: the fifth forgets lease 0.
    for lease in 1..=4 {
        pull(&mut s, "worker:0", lease, "t", &[10 + lease]).unwrap();
    }
    let e = push(&mut s, "worker:0", 1, vec![rows("t", 0, &[3], grad(3, 0, 2))]).unwrap_err();
    assert!(matches!(e, Error::NotLeased { id: 3, lease: 0, .. }), "{e}");
    assert_eq!(applied(push(&mut s, "worker:0", 1, vec![rows("t", 1, &[11], grad(11, 0, 2))]).unwrap()), (1, false));
}

/// An id-space table creates rows when first seen at their initial values, evicts the least
/// recently seen rows unseen for more than `evict_after` updates when it needs room (never a
/// row of a live lease), and refuses a pull that finds no room, creating nothing.
#[test]
fn id_space_tables_grow_evict_and_refuse_at_their_bound() {
    let dim = 2;
    let size = TableSize::Ids { max_rows_per_shard: 3, evict_after: Some(1) };
    let mut s = task(PsMode::Async, vec![table("h", size, dim, RowOptimizer::Sgd { lr: 0.5 }, 0, 1)]);
    let big = 1u64 << 60;
    let got = pull(&mut s, "w", 1, "h", &[10, big]).unwrap();
    assert_eq!(bits(&got), bits(&[init("h", 10, dim), init("h", big, dim)].concat()), "rows start at init_row");
    push(&mut s, "w", 0, vec![rows("h", 1, &[10], grad(10, 0, dim))]).unwrap(); // version 1, 10 seen at 1
    pull(&mut s, "w", 2, "h", &[12]).unwrap(); // 12 seen at 1, pinned by lease 2
    push(&mut s, "w", 1, vec![]).unwrap();
    push(&mut s, "w", 2, vec![]).unwrap(); // version 3
    let ids = |s: &State| s.snapshot().tables[0].ids.clone();
    pull(&mut s, "w", 3, "h", &[13]).unwrap();
    assert_eq!(ids(&s), vec![10, 12, 13], "the least recently seen row went first");
    pull(&mut s, "w", 4, "h", &[14]).unwrap();
    assert_eq!(ids(&s), vec![12, 13, 14]);
    let st = s.status().tables[0].clone();
    assert_eq!((st.rows, st.evicted, st.bytes), (3, 2, 3 * dim as u64 * 4));
    // 12 is pinned by lease 2, 13 and 14 are pinned and seen now: no room.
    let before = s.snapshot();
    let e = pull(&mut s, "w", 5, "h", &[15]).unwrap_err();
    assert!(matches!(e, Error::TableFull { bound: 3, rows: 4, .. }), "{e}");
    check_message(&e, ErrorKind::ResourceExhausted, "table h would hold 4 rows, over its bound of 3 rows per shard");
    assert_eq!(s.snapshot(), before, "nothing created");
    // Lease 2 released by a push without rows of it: 12 (seen at 1) may go.
    push(&mut s, "w", 3, vec![rows("h", 2, &[], vec![])]).unwrap();
    pull(&mut s, "w", 5, "h", &[15]).unwrap();
    assert_eq!(ids(&s), vec![13, 14, 15]);
    // Pulling again under lease 3 replaces its ids (13), which is then evictable; the evicted
    // row 10 comes back at its initial value.
    push(&mut s, "w", 4, vec![]).unwrap();
    let got = pull(&mut s, "w", 3, "h", &[10]).unwrap();
    assert_eq!(bits(&got), bits(&init("h", 10, dim)));
    assert_eq!(ids(&s), vec![10, 14, 15]);
    assert_eq!(s.status().tables[0].evicted, 4);
    // A table without evict_after refuses at its bound.
    let size = TableSize::Ids { max_rows_per_shard: 1, evict_after: None };
    let mut s = task(PsMode::Async, vec![table("n", size, dim, RowOptimizer::Sgd { lr: 0.5 }, 0, 1)]);
    pull(&mut s, "w", 1, "n", &[1]).unwrap();
    push(&mut s, "w", 0, vec![rows("n", 1, &[1], grad(1, 0, dim))]).unwrap();
    let e = pull(&mut s, "w", 2, "n", &[2, 1]).unwrap_err();
    assert!(matches!(e, Error::TableFull { bound: 1, rows: 2, .. }), "{e}");
}

/// A lease remembers where its rows were; an eviction that moves a leased row (the last one
/// into the evicted one's place) does not misdirect the lease's push or its unpinning: the
/// push steps the moved row itself, the row now at its old place keeps its values, and the
/// moved row is free to go once the push released it.
#[test]
fn a_leased_row_moved_by_an_eviction_is_pushed_and_released_where_it_is() {
    let dim = 2;
    let size = TableSize::Ids { max_rows_per_shard: 3, evict_after: Some(1) };
    let mut s = task(PsMode::Async, vec![table("m", size, dim, RowOptimizer::Sgd { lr: 0.5 }, 0, 1)]);
    let ids = |s: &State| s.snapshot().tables[0].ids.clone();
    pull(&mut s, "a", 1, "m", &[1, 2]).unwrap();
    push(&mut s, "a", 0, vec![rows("m", 1, &[], vec![])]).unwrap(); // version 1: 1 and 2 unpinned
    pull(&mut s, "b", 1, "m", &[3]).unwrap(); // row 3 last, pinned by b's lease 1
    push(&mut s, "a", 1, vec![]).unwrap();
    push(&mut s, "a", 2, vec![]).unwrap(); // version 3: 1 and 2 are stale
    assert_eq!(ids(&s), vec![1, 2, 3]);
    // Row 1 goes (the least recently seen); row 3, the last, moves into its place and 4 takes
    // row 3's (the snapshot lists rows by id).
    pull(&mut s, "a", 2, "m", &[4]).unwrap();
    assert_eq!(ids(&s), vec![2, 3, 4]);
    let g = grad(3, 9, dim);
    // (Updates are numbered per client: b's step is one a never used.)
    let (_, duplicate) = applied(push(&mut s, "b", 100, vec![rows("m", 1, &[3], g.clone())]).unwrap());
    assert!(!duplicate);
    let want3: Vec<f32> = init("m", 3, dim).iter().zip(&g).map(|(w, g)| w - 0.5 * g).collect();
    assert_eq!(bits(&pull(&mut s, "c", 1, "m", &[3]).unwrap()), bits(&want3), "the moved row was stepped");
    assert_eq!(bits(&pull(&mut s, "c", 1, "m", &[4]).unwrap()), bits(&init("m", 4, dim)), "its old place was not");
    // Release c's and a's leases, let 2 and 3 go stale: both may be evicted now (3 is pinned
    // by nothing: b's push released it where it is).
    push(&mut s, "c", 200, vec![rows("m", 1, &[], vec![])]).unwrap();
    push(&mut s, "a", 3, vec![rows("m", 2, &[], vec![])]).unwrap();
    push(&mut s, "a", 4, vec![]).unwrap();
    push(&mut s, "a", 5, vec![]).unwrap();
    pull(&mut s, "d", 1, "m", &[5, 6]).unwrap();
    let mut left = ids(&s);
    left.sort_unstable();
    assert_eq!(left, vec![4, 5, 6], "rows 2 and 3 were evictable");
}

/// Every bad pull or push is refused with one line naming the table and the field, changes
/// nothing (a snapshot is the same, and the lease still serves a good push), and the task
/// serves on.
#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let mut s = State::new("ps:0".into(), None);
    let f = table(
        "f",
        TableSize::Rows(10),
        2,
        RowOptimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 1e-7 },
        0,
        2,
    );
    let h =
        table("h", TableSize::Ids { max_rows_per_shard: 2, evict_after: None }, 2, RowOptimizer::Sgd { lr: 0.1 }, 0, 1);
    let create =
        header(vec![f, h], vec![VariableInfo::whole("w", vec![2])], ServerOptimizer::Sgd { lr: 0.5 }, PsMode::Async);
    s.create(&create, &[Chunk { var: 0, offset: 0, pieces: vec![f32s(&[1.0, 2.0])] }]).unwrap();
    pull(&mut s, "worker:0", 1, "f", &[0, 2]).unwrap();
    pull(&mut s, "worker:0", 1, "h", &[100, 101]).unwrap();
    let before = s.snapshot();
    let pulls: [(&str, Vec<u64>, ErrorKind, &str); 6] = [
        ("f", vec![0, 7], ErrorKind::InvalidArgument, "table f: row id 7 in field ids belongs to shard 1"),
        ("f", vec![12], ErrorKind::InvalidArgument, "table f: row id 12 in field ids is outside its 10 rows"),
        ("f", vec![2, 4, 2], ErrorKind::InvalidArgument, "table f: row id 2 appears twice in field ids"),
        ("h", vec![102], ErrorKind::ResourceExhausted, "table h would hold 3 rows, over its bound of 2"),
        ("g", vec![1], ErrorKind::NotFound, "no table named \"g\""),
        ("f", vec![0; crate::limits::MAX_IDS_PER_REQUEST + 1], ErrorKind::InvalidArgument, "table f: field ids holds"),
    ];
    for (t, ids, kind, message) in pulls {
        let e = pull(&mut s, "worker:0", 1, t, &ids).unwrap_err();
        check_message(&e, kind, message);
        assert_eq!(s.snapshot(), before, "{e}");
    }
    let pushes: [(Vec<RowGrads>, &str); 7] = [
        (vec![rows("f", 1, &[4], grad(4, 0, 2))], "table f: row id 4 in field ids was not pulled under lease 1"),
        (vec![rows("f", 9, &[0], grad(0, 0, 2))], "table f: row id 0 in field ids was not pulled under lease 9"),
        (
            vec![rows("f", 1, &[0], vec![1.0; 3])],
            "table f: field grads holds 3 values for 1 ids, not ids times the table's dim 2",
        ),
        (vec![rows("f", 1, &[0, 0], vec![1.0; 4])], "table f: row id 0 appears twice in field ids"),
        (
            vec![rows("f", 1, &[2, 0], vec![1.0, 1.0, f32::NAN, 1.0])],
            "table f: the gradient of row id 0 holds NaN at element 0",
        ),
        (vec![rows("f", 1, &[0], grad(0, 0, 2)), rows("f", 1, &[2], grad(2, 0, 2))], "table f: rows are pushed twice"),
        (vec![rows("h", 1, &[100], vec![f32::INFINITY, 0.0])], "table h: the gradient of row id 100 holds inf"),
    ];
    for (r, message) in pushes {
        let h = PushHeader { variables: vec!["w".into()], ..push_header("worker:0", 0, 0, r) };
        let e = s.push(&h, &[Chunk { var: 0, offset: 0, pieces: vec![f32s(&[1.0, 1.0])] }]).unwrap_err();
        check_message(&e, ErrorKind::InvalidArgument, message);
        assert_eq!(s.snapshot(), before, "{e}");
        assert!(s.answer(&("c".into(), 0, 0)).is_none(), "a refused push is not recorded");
    }
    // The leases are intact: the corrected push applies, dense and sparse together.
    let h = PushHeader {
        variables: vec!["w".into()],
        ..push_header(
            "worker:0",
            0,
            0,
            vec![rows("f", 1, &[2, 0], grads(&[2, 0], 0, 2)), rows("h", 1, &[101], grad(101, 0, 2))],
        )
    };
    assert_eq!(
        applied(s.push(&h, &[Chunk { var: 0, offset: 0, pieces: vec![f32s(&[1.0, 1.0])] }]).unwrap()),
        (1, false)
    );
    let after = s.snapshot();
    assert_eq!(after.variables[0].2, vec![0.5, 1.5]);
    assert_ne!(after.tables, before.tables);
}

/// Creating the same tables again is answered `existed`; a conflicting or invalid description
/// is refused naming the table and the field, creating nothing.
#[test]
fn tables_are_created_once_and_described_the_same_way_again() {
    let t = table("t", TableSize::Rows(10), 4, RowOptimizer::Sgd { lr: 0.5 }, 0, 1);
    let mut s = State::new("ps:0".into(), None);
    let h = |tables| header(tables, vec![], ServerOptimizer::Sgd { lr: 0.5 }, PsMode::Async);
    assert!(!s.create(&h(vec![t.clone()]), &[]).unwrap().existed);
    assert!(s.create(&h(vec![t.clone()]), &[]).unwrap().existed);
    let other = TableInfo { config: TableConfig { dim: 8, ..t.config.clone() }, ..t.clone() };
    let e = s.create(&h(vec![other]), &[]).unwrap_err();
    check_message(&e, ErrorKind::FailedPrecondition, "table t exists on ps:0 with another dim");
    let other = TableInfo { optimizer: RowOptimizer::Sgd { lr: 0.25 }, ..t.clone() };
    assert!(matches!(s.create(&h(vec![other]), &[]), Err(Error::TableMismatch { field: "optimizer", .. })));
    let bad = [
        (TableInfo { config: TableConfig { dim: 0, ..t.config.clone() }, ..t.clone() }, "table u: dim 0 is outside"),
        (TableInfo { shard: 2, num_shards: 2, ..t.clone() }, "table u: shard 2 is not below num_shards 2"),
        (
            TableInfo { optimizer: RowOptimizer::LazyAdam { lr: 0.1, beta1: 1.0, beta2: 0.9, eps: 1e-7 }, ..t.clone() },
            "table u: optimizer.beta1 1 of lazy_adam: use a decay in [0, 1)",
        ),
        (
            TableInfo {
                optimizer: RowOptimizer::Ftrl {
                    lr: 0.1,
                    lr_power: 0.5,
                    initial_accumulator: 0.1,
                    l1: 0.0,
                    l2: 0.0,
                    beta: 0.0,
                },
                ..t.clone()
            },
            "table u: optimizer.lr_power 0.5 of ftrl",
        ),
    ];
    for (mut info, message) in bad {
        info.config.name = "u".into();
        let e = s.create(&h(vec![info]), &[]).unwrap_err();
        check_message(&e, ErrorKind::InvalidArgument, message);
        assert_eq!(s.status().tables.len(), 1);
    }
    let e = s.create(&h(vec![t.clone(), t.clone()]), &[]).unwrap_err();
    assert!(matches!(e, Error::TableNamedTwice { .. }), "{e}");
}

/// Stale mode refuses a push with rows as it refuses a dense one; a push with rows is never
/// streamed.
#[test]
fn stale_pushes_with_rows_are_refused_and_rows_are_not_streamed() {
    let t = table("t", TableSize::Rows(10), 2, RowOptimizer::Sgd { lr: 0.5 }, 0, 1);
    let mut s = task(PsMode::Stale { staleness: 0 }, vec![t.clone()]);
    pull(&mut s, "w", 0, "t", &[1]).unwrap();
    push(&mut s, "w", 0, vec![]).unwrap();
    let before = s.snapshot();
    let h = push_header("w", 1, 0, vec![rows("t", 0, &[1], grad(1, 0, 2))]);
    assert!(matches!(s.push(&h, &[]), Err(Error::Stale { .. })));
    assert_eq!(s.snapshot().tables, before.tables);
    let mut streaming = State::new("ps:0".into(), Some(0));
    streaming.create(&header(vec![t], vec![], ServerOptimizer::Sgd { lr: 0.5 }, PsMode::Async), &[]).unwrap();
    assert!(streaming.begin_stream(&h).is_none(), "collected");
}

/// Under a learning-rate schedule a table's rate follows the schedule, scaled to the table's
/// own rate (here the schedule's peak: exactly the schedule's rates).
#[test]
fn tables_follow_the_tasks_schedule() {
    let schedule = LrSchedule::WarmupLinear { peak: 0.5, warmup_steps: 2, total_steps: 6, final_lr: 0.05 };
    let mut s = State::new("ps:0".into(), None);
    let t = table("t", TableSize::Rows(4), 2, RowOptimizer::Sgd { lr: 0.5 }, 0, 1);
    let h = CreateHeader {
        schedule: Some(schedule.clone()),
        ..header(vec![t], vec![], ServerOptimizer::Sgd { lr: 7.0 }, PsMode::Async)
    };
    s.create(&h, &[]).unwrap();
    let mut w = init("t", 2, 2);
    for step in 0..5 {
        pull(&mut s, "w", step, "t", &[2]).unwrap();
        push(&mut s, "w", step, vec![rows("t", step, &[2], grad(2, step, 2))]).unwrap();
        let lr = schedule.at(step) as f32;
        w = w.iter().zip(grad(2, step, 2)).map(|(w, g)| w - (g * lr + 0.0)).collect();
        assert_eq!(bits(&s.snapshot().tables[0].values), bits(&w), "step {step}");
    }
}

/// A row grown in an id-space table, with its FTRL slots and when it was last seen, is the
/// same after a checkpoint is written and restored, and trains on identically.
#[test]
fn grown_rows_survive_a_checkpoint_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let ftrl = RowOptimizer::Ftrl { lr: 0.1, lr_power: -0.5, initial_accumulator: 0.1, l1: 0.001, l2: 0.01, beta: 0.0 };
    let size = TableSize::Ids { max_rows_per_shard: 10, evict_after: Some(3) };
    let lazy = RowOptimizer::LazyAdam { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-7 };
    let tables = vec![table("h", size, 3, ftrl, 0, 1), table("f", TableSize::Rows(5), 2, lazy, 0, 1)];
    let mut s = task(PsMode::Async, tables);
    let id = 0xdead_beef_u64;
    for step in 0..3 {
        pull(&mut s, "w", step, "h", &[id, step]).unwrap();
        pull(&mut s, "w", step, "f", &[step]).unwrap();
        let r = vec![rows("h", step, &[id], grad(id, step, 3)), rows("f", step, &[step], grad(step, step, 2))];
        push(&mut s, "w", step, r).unwrap();
    }
    write_snapshot(tmp.path(), 3, s.snapshot(), 1).unwrap();
    let (snap, step) = read_snapshot(tmp.path()).unwrap();
    assert_eq!(snap, s.snapshot());
    assert_eq!(snap.tables[0].ids, vec![0, 1, 2, id]);
    let mut r = State::new("ps:0".into(), None);
    r.restore(snap, step);
    for step in 3..5 {
        for t in [&mut s, &mut r] {
            pull(t, "w", step, "h", &[id]).unwrap();
            pull(t, "w", step, "f", &[1]).unwrap();
            let g = vec![rows("h", step, &[id], grad(id, step, 3)), rows("f", step, &[1], grad(1, step, 2))];
            push(t, "w", step, g).unwrap();
        }
    }
    assert_eq!(r.snapshot().tables, s.snapshot().tables);
    assert_eq!(r.status().tables, s.status().tables);
}

/// A row's values, slots (as bits) and last seen version.
type HeldRow = (Vec<u32>, Vec<u32>, u64);

/// A job of ps tasks holding shards of a fixed LazyAdam table and an id-space FTRL table;
/// a step pulls each task's rows of a batch and pushes their gradients to every task.
struct Job {
    tasks: Vec<State>,
}

const F_ROWS: u64 = 11;

fn job_tables(shard: u32, num_shards: u32) -> Vec<TableInfo> {
    let lazy = RowOptimizer::LazyAdam { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-7 };
    let ftrl = RowOptimizer::Ftrl { lr: 0.1, lr_power: -0.5, initial_accumulator: 0.1, l1: 0.001, l2: 0.01, beta: 0.5 };
    let ids = TableSize::Ids { max_rows_per_shard: 1000, evict_after: None };
    vec![table("f", TableSize::Rows(F_ROWS), 3, lazy, shard, num_shards), table("h", ids, 2, ftrl, shard, num_shards)]
}

impl Job {
    fn new(n: u32) -> Self {
        Self { tasks: (0..n).map(|k| task(PsMode::Async, job_tables(k, n))).collect() }
    }

    /// The ids of `table` (of size `size`) among `batch` that task `k` owns.
    fn owned(&self, size: TableSize, batch: &[u64], k: usize) -> Vec<u64> {
        batch.iter().copied().filter(|&id| owner_of(size, id, self.tasks.len()) == k).collect()
    }

    /// One step: pulls (returning every pulled row by table and id) and pushes.
    fn step(&mut self, step: u64, f: &[u64], h: &[u64]) -> BTreeMap<(String, u64), Vec<u32>> {
        let mut pulled = BTreeMap::new();
        for k in 0..self.tasks.len() {
            let mut r = Vec::new();
            for (name, size, dim, batch) in [
                ("f", TableSize::Rows(F_ROWS), 3, f),
                ("h", TableSize::Ids { max_rows_per_shard: 1000, evict_after: None }, 2, h),
            ] {
                let ids = self.owned(size, batch, k);
                let values = pull(&mut self.tasks[k], "worker:0", step, name, &ids).unwrap();
                for (i, &id) in ids.iter().enumerate() {
                    pulled.insert((name.to_string(), id), bits(&values[i * dim..(i + 1) * dim]));
                }
                r.push(rows(name, step, &ids, grads(&ids, step, dim)));
            }
            push(&mut self.tasks[k], "worker:0", step, r).unwrap();
        }
        pulled
    }

    /// Every row the job holds, by table and id: values, slots and last seen, as bits.
    fn rows(&self) -> BTreeMap<(String, u64), HeldRow> {
        let mut out = BTreeMap::new();
        for t in &self.tasks {
            for rows in t.snapshot().tables {
                let (dim, sw) = (rows.info.config.dim, rows.info.config.dim * rows.info.optimizer.slots());
                for (k, &id) in rows.ids.iter().enumerate() {
                    let row = (
                        bits(&rows.values[k * dim..(k + 1) * dim]),
                        bits(&rows.slots[k * sw..(k + 1) * sw]),
                        rows.last_seen[k],
                    );
                    assert!(out.insert((rows.info.config.name.clone(), id), row).is_none(), "a row on two shards");
                }
            }
        }
        out
    }
}

/// A checkpoint of 2 ps tasks restores on 3 bit for bit: every row (values, slots, last seen)
/// is on its new owner, rows pulled after the restore equal those the 2 tasks give, and
/// training continues identically.
#[test]
fn two_shards_reshard_onto_three_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let mut old = Job::new(2);
    let batches: [(&[u64], &[u64]); 3] =
        [(&[0, 3, 7, 10], &[5, 1 << 40, 99]), (&[3, 4, 9], &[5, 17]), (&[0, 1, 2, 10], &[1 << 40, 3])];
    for (step, (f, h)) in batches.iter().enumerate() {
        old.step(step as u64, f, h);
    }
    let dirs: Vec<_> = (0..2)
        .map(|k| write_snapshot(&tmp.path().join(format!("ps{k}")), 3, old.tasks[k].snapshot(), 1).unwrap())
        .collect();
    let mut new = Job { tasks: Vec::new() };
    for shard in 0..3 {
        let tables = reshard_tables(dirs.iter().map(|d| read_snapshot(d).map(|(s, _)| s.tables)), shard, 3).unwrap();
        assert!(tables.iter().all(|t| t.info.shard == shard && t.info.num_shards == 3));
        let (base, step) = read_snapshot(&dirs[0]).unwrap();
        let mut s = State::new(format!("ps:{shard}"), None);
        s.restore(Snapshot { tables, ..base }, step);
        new.tasks.push(s);
    }
    assert_eq!(new.rows(), old.rows());
    assert!(new.tasks.iter().all(|t| t.version() == 3));
    let more: [(&[u64], &[u64]); 3] =
        [(&[0, 5, 6, 7, 8, 9, 10], &[5, 17, 1 << 40, 1234]), (&[3, 4, 9], &[5, 99]), (&[1, 2], &[3, 8])];
    for (step, (f, h)) in more.iter().enumerate() {
        let step = step as u64 + 3;
        assert_eq!(new.step(step, f, h), old.step(step, f, h), "rows pulled at step {step}");
        assert_eq!(new.rows(), old.rows(), "rows after step {step}");
    }
}

/// Resharding refuses old shards that are missing, given twice or of different tables.
#[test]
fn resharding_checks_its_old_shards() {
    let shard = |k: u32| {
        let mut s = task(PsMode::Async, job_tables(k, 2));
        pull(&mut s, "w", 0, "f", &[0]).ok();
        Ok::<Vec<TableRows>, Error>(s.snapshot().tables)
    };
    let e = reshard_tables([shard(0)], 0, 3).unwrap_err();
    check_message(&e, ErrorKind::InvalidArgument, "resharding table f: old shard 1 of 2 is missing");
    let e = reshard_tables([shard(0), shard(0)], 0, 3).unwrap_err();
    assert!(matches!(e, Error::ReshardShards { problem: "given twice", .. }), "{e}");
    let mut other = shard(1).unwrap();
    other[0].info.seed += 1;
    let e = reshard_tables([shard(0), Ok(other)], 0, 3).unwrap_err();
    assert!(matches!(e, Error::ReshardMismatch { field: "seed", .. }), "{e}");
    assert_eq!(reshard_tables([shard(0), shard(1)], 1, 1).unwrap_err().kind(), ErrorKind::InvalidArgument);
}

/// Sync mode: a pending push with rows is answered as a duplicate when retried (its lease
/// already taken), applies once with its round, and a push from an older version is dropped,
/// releasing its lease.
#[test]
fn sync_pushes_with_rows_are_taken_once_and_dropped_ones_release_their_lease() {
    let t = table("t", TableSize::Rows(10), 2, RowOptimizer::Sgd { lr: 0.5 }, 0, 1);
    let mut s = task(PsMode::Sync { workers: 2, backup_workers: 0 }, vec![t]);
    pull(&mut s, "worker:0", 0, "t", &[1]).unwrap();
    pull(&mut s, "worker:1", 0, "t", &[1, 2]).unwrap();
    pull(&mut s, "worker:2", 0, "t", &[3]).unwrap();
    let h0 = push_header("worker:0", 0, 0, vec![rows("t", 0, &[1], grad(1, 0, 2))]);
    assert!(matches!(s.push(&h0, &[]).unwrap(), PushDecision::Wait { duplicate: false, .. }));
    assert!(matches!(s.push(&h0, &[]).unwrap(), PushDecision::Wait { duplicate: true, .. }), "a retry waits too");
    let h1 = push_header("worker:1", 1, 0, vec![rows("t", 0, &[1, 2], grads(&[1, 2], 1, 2))]);
    s.push(&h1, &[]).unwrap();
    assert_eq!(s.version(), 1);
    let after = s.snapshot().tables;
    assert_eq!(applied(s.push(&h0, &[]).unwrap()), (1, true));
    assert_eq!(s.snapshot().tables, after);
    // worker:2 computed from version 0: dropped, and its lease is gone.
    let h2 = push_header("worker:2", 2, 0, vec![rows("t", 0, &[3], grad(3, 0, 2))]);
    assert!(matches!(s.push(&h2, &[]).unwrap(), PushDecision::Done(PushReply::Dropped { .. })));
    let e = push(&mut s, "worker:2", 3, vec![rows("t", 0, &[3], grad(3, 0, 2))]).unwrap_err();
    assert!(matches!(e, Error::NotLeased { id: 3, .. }), "{e}");
    assert_eq!(s.snapshot().tables, after);
}
