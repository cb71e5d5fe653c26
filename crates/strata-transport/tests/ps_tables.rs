//! Embedding tables on parameter servers over real gRPC on loopback: tables created with the
//! variables, rows pulled under a lease and their gradients pushed in the same update as the
//! variables', exactly once under a retry, in 16-bit wire formats, and bad input refused in one
//! line, the task still serving.

use std::time::Duration;

use strata_core::embedding::{init_row, owner_of, RowInit, TableConfig, TableSize};
use strata_transport::ps::{
    PsClient, PsClientConfig, PsMode, PsServerConfig, PsServerHandle, PushOutcome, RowGrads, RowOptimizer,
    ServerOptimizer, StaleRate, TableInfo, UpdateId, VariableInfo, WireFormat,
};
use strata_transport::{ClusterToken, Error};

use crate::common::within_limit;

fn token() -> ClusterToken {
    ClusterToken::new("0123456789abcdef0123456789abcdef").unwrap()
}

fn start(task: &str) -> (PsServerHandle, PsClient) {
    let server = PsServerHandle::start("127.0.0.1:0".parse().unwrap(), PsServerConfig::new(task, token())).unwrap();
    let config = PsClientConfig { timeout: Duration::from_secs(30), retry_for: Duration::from_secs(30) };
    let client = PsClient::connect(&server.address().to_string(), task, token(), config).unwrap();
    (server, client)
}

fn table(size: TableSize, shard: u32, num_shards: u32, optimizer: RowOptimizer) -> TableInfo {
    let config = TableConfig { name: "emb".into(), dim: 4, size, init: RowInit::Uniform { low: -1.0, high: 1.0 } };
    TableInfo { config, seed: 7, shard, num_shards, optimizer }
}

fn id(step: u64) -> UpdateId {
    UpdateId { worker: "worker:0".into(), client: "worker:0".into(), step, seq: 0 }
}

fn row(id: u64) -> Vec<f32> {
    let mut r = vec![0f32; 4];
    init_row(7, "emb", RowInit::Uniform { low: -1.0, high: 1.0 }, id, &mut r);
    r
}

/// Two ps tasks, each the shard of a 100-row table it owns: a push of a dense variable's
/// gradient and of rows is one update; rows are `init - lr * g` exactly; a retry changes
/// nothing; rows no push touched keep their initial values.
#[test]
fn rows_are_pulled_and_pushed_with_the_variables_as_one_update() {
    within_limit("rows_are_pulled_and_pushed_with_the_variables_as_one_update", || {
        let sgd = RowOptimizer::Sgd { lr: 0.5 };
        let tasks: Vec<_> = (0..2).map(|k| start(&format!("ps:{k}"))).collect();
        for (k, (_, c)) in tasks.iter().enumerate() {
            let w = VariableInfo::whole(format!("w{k}"), vec![2]);
            let out = c
                .create_with_tables(
                    &[(w, &[1.0, 2.0])],
                    &[table(TableSize::Rows(100), k as u32, 2, sgd.clone())],
                    &ServerOptimizer::Sgd { lr: 0.5 },
                    None,
                    StaleRate::Constant,
                    PsMode::Async,
                    WireFormat::F32,
                )
                .unwrap();
            assert!(!out.existed);
        }
        let ids = [3u64, 17, 60, 98];
        for (k, (_, c)) in tasks.iter().enumerate() {
            let mine: Vec<u64> = ids.iter().copied().filter(|&i| owner_of(TableSize::Rows(100), i, 2) == k).collect();
            assert_eq!(mine.len(), 2, "shard {k}");
            let pulled = c.pull_rows("worker:0", 1, &[("emb", &mine)]).unwrap();
            assert_eq!(pulled.values[0], mine.iter().flat_map(|&i| row(i)).collect::<Vec<_>>());
            let grads: Vec<f32> = (0..8).map(|x| x as f32).collect();
            let rows = [RowGrads { table: "emb".into(), lease: 1, ids: mine.clone(), grads: grads.clone() }];
            let name = format!("w{k}");
            let out = c.push_rows(&id(1), 0, &[(&name, &[2.0, 2.0])], &rows).unwrap();
            assert_eq!(out, PushOutcome::Applied { version: 1, duplicate: false });
            // The retry is answered from the applied-update table; nothing changes again.
            let again = c.push_rows(&id(1), 0, &[(&name, &[2.0, 2.0])], &rows).unwrap();
            assert_eq!(again, PushOutcome::Applied { version: 1, duplicate: true });
            let after = c.pull_rows("worker:0", 2, &[("emb", &mine)]).unwrap();
            let want: Vec<f32> = mine.iter().flat_map(|&i| row(i)).zip(&grads).map(|(w, g)| w - 0.5 * g).collect();
            assert_eq!(after.values[0], want);
            assert_eq!(after.version, 1);
            let dense = c.pull(&[&name], 0).unwrap();
            assert_eq!(dense.variables[0].2, vec![0.0, 1.0]);
            // A row no push touched keeps its initial value; status counts the rows created.
            let other = if k == 0 { 0u64 } else { 51 };
            assert_eq!(c.pull_rows("worker:0", 3, &[("emb", &[other])]).unwrap().values[0], row(other));
            let status = c.status().unwrap();
            assert_eq!(status.tables.len(), 1);
            assert_eq!(status.tables[0].rows, 3);
        }
    });
}

/// 16-bit wire formats carry rows rounded to nearest even, applied in f32.
#[test]
fn rows_travel_in_16_bit_wire_formats() {
    within_limit("rows_travel_in_16_bit_wire_formats", || {
        for format in [WireFormat::F16, WireFormat::Bf16] {
            let (_server, c) = start("ps:0");
            let c = c.with_wire_format(format);
            let adagrad = RowOptimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 1e-7 };
            c.create_with_tables(
                &[],
                &[table(TableSize::Rows(10), 0, 1, adagrad)],
                &ServerOptimizer::Sgd { lr: 0.1 },
                None,
                StaleRate::Constant,
                PsMode::Async,
                format,
            )
            .unwrap();
            let half = format.half().unwrap();
            let round = |v: Vec<f32>| {
                let mut bits = vec![0u16; v.len()];
                half.encode(&v, &mut bits);
                let mut out = vec![0f32; v.len()];
                half.decode(&bits, &mut out);
                out
            };
            let pulled = c.pull_rows("worker:0", 1, &[("emb", &[2, 5])]).unwrap();
            assert_eq!(pulled.values[0], round([row(2), row(5)].concat()), "{format}");
            let grads = vec![0.25f32; 8];
            let rows = [RowGrads { table: "emb".into(), lease: 1, ids: vec![2, 5], grads }];
            c.push_rows(&id(1), 0, &[], &rows).unwrap();
            // Adagrad's first step moves every element by lr * g / sqrt(0.1 + g^2).
            let step = 0.1 * 0.25 / (0.1f32 + 0.0625).sqrt();
            let after = c.pull_rows("worker:0", 2, &[("emb", &[2])]).unwrap();
            for (got, w) in after.values[0].iter().zip(row(2)) {
                assert!((got - (w - step)).abs() <= 1e-2 * w.abs().max(1.0), "{format}: {got} vs {}", w - step);
            }
        }
    });
}

/// Bad input: an id outside the table, a pushed id not pulled under the lease, rows of the
/// wrong width, an id-space shard over its bound; each refused in one line naming the table,
/// nothing applied, the task still serving.
#[test]
fn bad_rows_are_refused_in_one_line_and_nothing_is_applied() {
    within_limit("bad_rows_are_refused_in_one_line_and_nothing_is_applied", || {
        let (_server, c) = start("ps:0");
        let grow = TableSize::Ids { max_rows_per_shard: 3, evict_after: None };
        let mut ids_table = table(grow, 0, 1, RowOptimizer::Sgd { lr: 1.0 });
        ids_table.config.name = "grown".into();
        c.create_with_tables(
            &[],
            &[table(TableSize::Rows(10), 0, 1, RowOptimizer::Sgd { lr: 1.0 }), ids_table],
            &ServerOptimizer::Sgd { lr: 1.0 },
            None,
            StaleRate::Constant,
            PsMode::Async,
            WireFormat::F32,
        )
        .unwrap();
        let one_line = |e: Error, want: &[&str]| {
            let m = e.to_string();
            assert!(want.iter().all(|w| m.contains(w)) && !m.contains('\n'), "{m}");
        };
        one_line(c.pull_rows("worker:0", 1, &[("emb", &[10])]).unwrap_err(), &["emb", "10"]);
        c.pull_rows("worker:0", 1, &[("emb", &[1, 2])]).unwrap();
        let unleased = [RowGrads { table: "emb".into(), lease: 1, ids: vec![1, 3], grads: vec![1.0; 8] }];
        one_line(c.push_rows(&id(1), 0, &[], &unleased).unwrap_err(), &["emb", "3"]);
        let narrow = [RowGrads { table: "emb".into(), lease: 1, ids: vec![1, 2], grads: vec![1.0; 6] }];
        one_line(c.push_rows(&id(1), 0, &[], &narrow).unwrap_err(), &["emb"]);
        one_line(c.pull_rows("worker:0", 1, &[("grown", &[1, 2, 3, 4])]).unwrap_err(), &["grown", "3"]);
        // Nothing was applied: the task is at version 0, the rows at their initial values.
        let pulled = c.pull_rows("worker:0", 2, &[("emb", &[1, 2])]).unwrap();
        assert_eq!((pulled.version, pulled.values[0].clone()), (0, [row(1), row(2)].concat()));
        // And it still serves: the right push is applied.
        let good = [RowGrads { table: "emb".into(), lease: 2, ids: vec![1, 2], grads: vec![1.0; 8] }];
        assert_eq!(c.push_rows(&id(2), 0, &[], &good).unwrap(), PushOutcome::Applied { version: 1, duplicate: false });
    });
}

/// A push carried by a pull of rows (`PsClient::push_rows_and_pull`): applied before the rows
/// are read, so the pull reads it; exactly once under dropped requests and replies (the call
/// is retried whole: the push is answered as a duplicate, the pull served again); a push the
/// task refuses fails the call in one line, nothing applied and nothing read; one too large
/// for a request goes on its own first, with the same outcome.
#[test]
fn a_push_carried_by_a_pull_of_rows_is_applied_first_and_exactly_once() {
    within_limit("a_push_carried_by_a_pull_of_rows_is_applied_first_and_exactly_once", || {
        let server_config = || {
            let mut c = PsServerConfig::new("ps:0", token());
            c.faults = strata_transport::ps::FaultInjection { drop_reply_every: 3, drop_request_every: 5 };
            c
        };
        let server = PsServerHandle::start("127.0.0.1:0".parse().unwrap(), server_config()).unwrap();
        let config = PsClientConfig { timeout: Duration::from_secs(30), retry_for: Duration::from_secs(30) };
        let c = PsClient::connect(&server.address().to_string(), "ps:0", token(), config).unwrap();
        let sgd = RowOptimizer::Sgd { lr: 0.5 };
        c.create_with_tables(
            &[],
            &[table(TableSize::Rows(10), 0, 1, sgd)],
            &ServerOptimizer::Sgd { lr: 0.5 },
            None,
            StaleRate::Constant,
            PsMode::Async,
            WireFormat::F32,
        )
        .unwrap();
        let ids = [2u64, 5];
        c.pull_rows("worker:0", 1, &[("emb", &ids)]).unwrap();
        // 30 steps, each pushing the last one's rows (gradient 2 everywhere: each step takes 1
        // off every element) with its own pull: the rows read are those of every push so far.
        let mut want: Vec<f32> = ids.iter().flat_map(|&i| row(i)).collect();
        for step in 1..=30u64 {
            let rows = [RowGrads { table: "emb".into(), lease: step, ids: ids.to_vec(), grads: vec![2.0; 8] }];
            let (outcome, pulled) =
                c.push_rows_and_pull(&id(step), 0, &rows, "worker:0", step + 1, &[("emb", &ids)]).unwrap();
            assert!(matches!(outcome, PushOutcome::Applied { .. }), "step {step}: {outcome:?}");
            want.iter_mut().for_each(|w| *w -= 0.5 * 2.0);
            assert_eq!(pulled.values[0], want, "step {step}: the pull reads its push");
        }
        let status = c.status().unwrap();
        assert_eq!(status.pushes_applied, 30);
        assert!(status.pushes_duplicate > 0, "no dropped reply was retried: {status:?}");
        // A push of a row the worker did not pull under its lease: one line naming the table,
        // nothing applied, the rows not read (and still served).
        let bad = [RowGrads { table: "emb".into(), lease: 31, ids: vec![7], grads: vec![1.0; 4] }];
        let e = c.push_rows_and_pull(&id(31), 0, &bad, "worker:0", 32, &[("emb", &ids)]).unwrap_err().to_string();
        assert!(e.contains("table emb") && e.contains("lease 31") && !e.contains('\n'), "{e}");
        assert_eq!(c.pull_rows("worker:0", 33, &[("emb", &ids)]).unwrap().values[0], want);
        assert_eq!(c.status().unwrap().pushes_applied, 30);
        server.shutdown();
    });
}

/// A carried push too large for one request (1 MiB with the pull) goes on its own first: the
/// same outcome, the pull reading it.
#[test]
fn a_push_too_large_to_carry_goes_on_its_own_first() {
    within_limit("a_push_too_large_to_carry_goes_on_its_own_first", || {
        let (server, c) = start("ps:0");
        let config = TableConfig { name: "emb".into(), dim: 64, size: TableSize::Rows(10_000), init: RowInit::Zeros };
        let info = TableInfo { config, seed: 7, shard: 0, num_shards: 1, optimizer: RowOptimizer::Sgd { lr: 1.0 } };
        c.create_with_tables(
            &[],
            &[info],
            &ServerOptimizer::Sgd { lr: 1.0 },
            None,
            StaleRate::Constant,
            PsMode::Async,
            WireFormat::F32,
        )
        .unwrap();
        // 5,000 rows of 64: 1.28 MB of gradients.
        let ids: Vec<u64> = (0..5_000).collect();
        c.pull_rows("worker:0", 1, &[("emb", &ids)]).unwrap();
        let rows = [RowGrads { table: "emb".into(), lease: 1, ids: ids.clone(), grads: vec![0.25; 5_000 * 64] }];
        let (outcome, pulled) = c.push_rows_and_pull(&id(1), 0, &rows, "worker:0", 2, &[("emb", &ids)]).unwrap();
        assert_eq!(outcome, PushOutcome::Applied { version: 1, duplicate: false });
        assert!(pulled.values[0].iter().all(|&v| v == -0.25));
        assert_eq!(c.status().unwrap().pushes_applied, 1);
        server.shutdown();
    });
}
