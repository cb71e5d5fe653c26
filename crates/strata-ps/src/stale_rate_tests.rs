//! Tests of [`StaleRate`]: the rate a ps task applies a stale push's dense variables at, through
//! the task's public API, collected and streamed, and what it leaves alone (rows, fresh pushes,
//! sync mode), through a checkpoint and against another job's create.

use bytes::Bytes;
use strata_core::embedding::{RowInit, TableConfig, TableSize};

use crate::{
    read_snapshot, write_snapshot, Chunk, CreateHeader, ErrorKind, PsMode, PushDecision, PushHeader, PushReply,
    RowGrads, RowOptimizer, RowPull, ServerOptimizer, StaleRate, State, TableInfo, UpdateId, VariableInfo, WireFormat,
};

/// A rate whose quotients by 1, 2, 3 and 4 are exact in f32, as are the products below.
const LR: f64 = 0.75;
const W0: [f32; 2] = [1.0, -2.0];
const G: [f32; 2] = [0.5, -1.0];

fn f32s(x: &[f32]) -> Bytes {
    Bytes::copy_from_slice(bytemuck::cast_slice(x))
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn header(rate: StaleRate, mode: PsMode, tables: Vec<TableInfo>) -> CreateHeader {
    CreateHeader {
        variables: vec![VariableInfo::whole("w", vec![2])],
        optimizer: ServerOptimizer::Sgd { lr: LR },
        schedule: None,
        stale_rate: rate,
        mode,
        wire_format: WireFormat::F32,
        tables,
    }
}

fn task(rate: StaleRate, mode: PsMode, stream_min_bytes: Option<usize>, tables: Vec<TableInfo>) -> State {
    let mut s = State::new("ps:0".into(), stream_min_bytes);
    s.create(&header(rate, mode, tables), &[Chunk { var: 0, offset: 0, pieces: vec![f32s(&W0)] }]).unwrap();
    s
}

fn push_header(worker: &str, step: u64, base: u64, rows: Vec<RowGrads>) -> PushHeader {
    PushHeader {
        id: UpdateId { worker: worker.into(), client: worker.into(), step, seq: 0 },
        base_version: base,
        variables: vec!["w".into()],
        rows,
    }
}

/// Pushes [`G`] computed from version `base` (streamed where the task streams) and returns the
/// task's version after it.
fn push(s: &mut State, worker: &str, step: u64, base: u64) -> u64 {
    let h = push_header(worker, step, base, vec![]);
    let chunks = [Chunk { var: 0, offset: 0, pieces: vec![f32s(&G)] }];
    let d = match s.begin_stream(&h) {
        Some(mut stream) => {
            stream.apply(&chunks[0]).unwrap();
            s.finish_stream(stream).unwrap()
        }
        None => s.push(&h, &chunks).unwrap(),
    };
    match d {
        PushDecision::Done(PushReply::Applied { version, duplicate: false }) => version,
        other => panic!("not applied: {other:?}"),
    }
}

fn w(s: &State) -> Vec<f32> {
    let pulled = s.pull(&["w".into()]).unwrap();
    pulled
        .chunks
        .iter()
        .flat_map(|c| c.data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
        .collect()
}

/// `value - rate * G`, exact in f32 at these numbers.
fn stepped(value: &[f32], rate: f64) -> Vec<f32> {
    value.iter().zip(G).map(|(v, g)| v - rate as f32 * g).collect()
}

/// Under [`StaleRate::Inverse`] a push computed `s` updates before it lands is applied at
/// `lr / (1 + s)`; a fresh one at `lr`, with [`StaleRate::Constant`]'s bits. Constant applies
/// every push at `lr`. Async and stale modes, pushes collected and streamed alike; a retry of a
/// stale push is answered as a duplicate and applies nothing again.
#[test]
fn an_inverse_rate_applies_a_push_s_updates_stale_at_lr_over_one_plus_s() {
    for mode in [PsMode::Async, PsMode::Stale { staleness: 8 }] {
        for stream in [None, Some(0)] {
            for rate in [StaleRate::Constant, StaleRate::Inverse] {
                let mut s = task(rate, mode, stream, vec![]);
                let mut value = W0.to_vec();
                // Staleness 0, then pushes all computed from version 1: staleness 0, 1, 2, 3.
                let bases = [0u64, 1, 1, 1, 1];
                for (step, &base) in bases.iter().enumerate() {
                    let staleness = s.version() - base;
                    let version = push(&mut s, "worker:0", step as u64, base);
                    assert_eq!(version, step as u64 + 1);
                    let lr = match rate {
                        StaleRate::Constant => LR,
                        StaleRate::Inverse => LR / (1 + staleness) as f64,
                    };
                    assert_eq!(rate.rate(LR, staleness), lr);
                    value = stepped(&value, lr);
                    let at = format!("{mode} {rate} stream {stream:?} step {step} staleness {staleness}");
                    assert_eq!(bits(&w(&s)), bits(&value), "{at}");
                }
                // The last push again: a duplicate, nothing applied twice.
                let h = push_header("worker:0", 4, 1, vec![]);
                let d = s.push(&h, &[Chunk { var: 0, offset: 0, pieces: vec![f32s(&G)] }]).unwrap();
                assert!(matches!(d, PushDecision::Done(PushReply::Applied { version: 5, duplicate: true })), "{d:?}");
                assert_eq!(bits(&w(&s)), bits(&value));
            }
        }
    }
}

/// The rows a stale push carries take their table's rate, not the scaled one, while its dense
/// variables take `lr / (1 + s)`.
#[test]
fn a_stale_push_s_rows_keep_their_table_s_rate() {
    let config = TableConfig { name: "t".into(), dim: 2, size: TableSize::Rows(4), init: RowInit::Zeros };
    let table = TableInfo { config, seed: 1, shard: 0, num_shards: 1, optimizer: RowOptimizer::Sgd { lr: LR } };
    let mut s = task(StaleRate::Inverse, PsMode::Async, None, vec![table]);
    let pull = RowPull { worker: "worker:0".into(), lease: 1, table: "t".into(), ids: vec![2] };
    assert_eq!(s.pull_rows(&pull).unwrap().values, vec![0.0, 0.0]);
    // Another worker's update lands first: worker:0's push is 1 update stale.
    assert_eq!(push(&mut s, "worker:1", 0, 0), 1);
    let rows = RowGrads { table: "t".into(), lease: 1, ids: vec![2], grads: G.to_vec() };
    let h = push_header("worker:0", 0, 0, vec![rows]);
    let d = s.push(&h, &[Chunk { var: 0, offset: 0, pieces: vec![f32s(&G)] }]).unwrap();
    assert!(matches!(d, PushDecision::Done(PushReply::Applied { version: 2, duplicate: false })), "{d:?}");
    assert_eq!(bits(&w(&s)), bits(&stepped(&stepped(&W0, LR), LR / 2.0)));
    let again = RowPull { worker: "worker:0".into(), lease: 2, table: "t".into(), ids: vec![2] };
    assert_eq!(bits(&s.pull_rows(&again).unwrap().values), bits(&stepped(&[0.0, 0.0], LR)));
}

/// Sync mode has no stale push: a round of two workers' pushes, both from the round's base,
/// takes the rate whatever the task's stale rate.
#[test]
fn sync_rounds_ignore_the_stale_rate() {
    let mut s = task(StaleRate::Inverse, PsMode::Sync { workers: 2, backup_workers: 0 }, None, vec![]);
    for worker in ["worker:0", "worker:1"] {
        let h = push_header(worker, 0, 0, vec![]);
        s.push(&h, &[Chunk { var: 0, offset: 0, pieces: vec![f32s(&G)] }]).unwrap();
    }
    assert_eq!(s.version(), 1);
    assert_eq!(bits(&w(&s)), bits(&stepped(&W0, LR)));
}

/// A checkpoint holds the rate and a restored task applies it; a job asking for another rate
/// than the task's is refused in one line naming the flag, nothing changed.
#[test]
fn the_rate_survives_a_checkpoint_and_another_one_is_refused() {
    let mut s = task(StaleRate::Inverse, PsMode::Async, None, vec![]);
    push(&mut s, "worker:0", 0, 0);
    let tmp = tempfile::tempdir().unwrap();
    write_snapshot(tmp.path(), 1, s.snapshot(), 1).unwrap();
    let (snap, step) = read_snapshot(tmp.path()).unwrap();
    assert_eq!(snap.stale_rate, StaleRate::Inverse);
    let mut r = State::new("ps:0".into(), None);
    r.restore(snap, step);
    assert_eq!(r.status().stale_rate, StaleRate::Inverse);
    push(&mut r, "worker:0", 1, 0);
    assert_eq!(bits(&w(&r)), bits(&stepped(&stepped(&W0, LR), LR / 2.0)));

    let before = w(&r);
    let e = r.create(&header(StaleRate::Constant, PsMode::Async, vec![]), &[]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::FailedPrecondition);
    assert_eq!(
        e.to_string(),
        "ps:0 applies stale pushes at the inverse rate; this job asks for constant (start a fresh ps task or use the same --stale-rate)"
    );
    assert_eq!(bits(&w(&r)), bits(&before));
    assert!(r.create(&header(StaleRate::Inverse, PsMode::Async, vec![]), &[]).unwrap().existed);

    // A checkpoint of the constant rate leaves the field out, as checkpoints before it did.
    let c = task(StaleRate::Constant, PsMode::Async, None, vec![]);
    let tmp = tempfile::tempdir().unwrap();
    let dir = write_snapshot(tmp.path(), 1, c.snapshot(), 1).unwrap();
    let meta = std::fs::read_dir(&dir).unwrap().filter_map(|e| std::fs::read(e.ok()?.path()).ok()).collect::<Vec<_>>();
    assert!(!meta.iter().any(|m| m.windows(10).any(|x| x == b"stale_rate")));
    assert_eq!(read_snapshot(tmp.path()).unwrap().0.stale_rate, StaleRate::Constant);
}
