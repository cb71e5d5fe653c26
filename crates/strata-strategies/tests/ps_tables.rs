//! Embedding tables on parameter servers, seen from a model: the same model code (the
//! `Embedding` layer) under a strategy whose tables live on ps tasks (real gRPC servers on
//! loopback) pulls only the rows its batches touch and trains them there as one device trains
//! the whole table, bit for bit under SGD; a worker never holds the table.

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use candle_nn::{Linear, Module, SGD};
use strata_core::embedding::{init_row, owner_of, RowInit, TableConfig, TableSize, TableStore};
use strata_core::layers::Embedding;
use strata_core::{Scope, Strategy, StrategyHandle, StrategyOptions};
use strata_strategies::parameter_server::{PsTables, RowsPush};
use strata_strategies::OneDeviceStrategy;
use strata_transport::ps::{
    PsClient, PsClientConfig, PsMode, PsServerConfig, PsServerHandle, RowOptimizer, ServerOptimizer, StaleRate,
    TableInfo, WireFormat,
};
use strata_transport::ClusterToken;

const SEED: u64 = 11;
const LR: f64 = 0.2;
const ROWS: u64 = 40;
const DIM: usize = 3;

fn token() -> ClusterToken {
    ClusterToken::new("0123456789abcdef0123456789abcdef").unwrap()
}

fn table() -> TableConfig {
    TableConfig {
        name: "emb".into(),
        dim: DIM,
        size: TableSize::Rows(ROWS),
        init: RowInit::Uniform { low: -1.0, high: 1.0 },
    }
}

/// A model of one table and a linear layer on the two looked-up rows of each example.
struct Model {
    emb: Embedding,
    lin: Linear,
}

impl Model {
    fn new(s: &Scope) -> candle_core::Result<Self> {
        Self::with_table(s, table())
    }

    fn with_table(s: &Scope, table: TableConfig) -> candle_core::Result<Self> {
        let emb = Embedding::new(s, table).map_err(candle_core::Error::wrap)?;
        let lin = candle_nn::linear(2 * DIM, 1, s.var_builder().pp("lin"))?;
        Ok(Self { emb, lin })
    }

    fn loss(&self, ids: &Tensor, target: &Tensor) -> candle_core::Result<Tensor> {
        let rows = self.emb.forward(ids)?.flatten_from(1)?;
        (self.lin.forward(&rows)? - target)?.sqr()?.mean_all()
    }
}

/// The ps tasks: `n` servers, each holding its shard of the table, stepped with SGD at `LR`.
fn ps_tasks(n: usize) -> (Vec<PsServerHandle>, Vec<PsClient>) {
    ps_tasks_with(n, strata_transport::ps::FaultInjection::default())
}

/// [`ps_tasks`] whose servers drop requests and replies as `faults` says.
fn ps_tasks_with(n: usize, faults: strata_transport::ps::FaultInjection) -> (Vec<PsServerHandle>, Vec<PsClient>) {
    let config = PsClientConfig { timeout: Duration::from_secs(30), retry_for: Duration::from_secs(30) };
    let mut servers = Vec::new();
    let mut clients = Vec::new();
    for k in 0..n {
        let task = format!("ps:{k}");
        let mut server_config = PsServerConfig::new(&task, token());
        server_config.faults = faults.clone();
        let server = PsServerHandle::start("127.0.0.1:0".parse().unwrap(), server_config).unwrap();
        let client = PsClient::connect(&server.address().to_string(), &task, token(), config.clone()).unwrap();
        let info = TableInfo {
            config: table(),
            seed: SEED,
            shard: k as u32,
            num_shards: n as u32,
            optimizer: RowOptimizer::Sgd { lr: LR },
        };
        client
            .create_with_tables(
                &[],
                &[info],
                &ServerOptimizer::Sgd { lr: LR },
                None,
                StaleRate::Constant,
                PsMode::Async,
                WireFormat::F32,
            )
            .unwrap();
        servers.push(server);
        clients.push(client);
    }
    (servers, clients)
}

fn batches() -> Vec<(Tensor, Tensor)> {
    let ids: [[u32; 8]; 4] = [
        [0, 5, 5, 9, 39, 2, 17, 5],
        [9, 9, 9, 1, 30, 31, 2, 0],
        [12, 13, 5, 39, 39, 20, 21, 22],
        [3, 3, 3, 3, 5, 5, 5, 5],
    ];
    ids.iter()
        .enumerate()
        .map(|(k, b)| {
            let ids = Tensor::new(b, &Device::Cpu).unwrap().reshape((4, 2)).unwrap();
            let target = Tensor::new(&[[k as f32], [1.0], [-1.0], [0.5]], &Device::Cpu).unwrap();
            (ids, target)
        })
        .collect()
}

/// Trains the model under `s` with SGD on its variables (the linear layer's; the table's too
/// when it is one); returns the linear layer's weights.
fn train(s: &StrategyHandle) -> (candle_core::Result<Vec<f32>>, strata_core::Replicated<Model>) {
    let model = s.scope(Model::new).unwrap();
    let opt = model.optimizer::<SGD>(LR).unwrap();
    for (ids, target) in batches() {
        s.run(|ctx| {
            let loss = model.on(ctx)?.loss(&ids, &target)?;
            ctx.backward_and_sync(&loss, &opt)
        })
        .unwrap();
    }
    let w = model.primary().lin.weight().flatten_all().and_then(|t| t.to_vec1::<f32>());
    (w, model)
}

#[test]
fn a_table_on_ps_tasks_trains_as_one_device_trains_the_whole_table() {
    let (_servers, clients) = ps_tasks(2);
    let store = Arc::new(PsTables::new("worker:0", clients.clone()));
    let options = StrategyOptions { seed: SEED, tables: Some(store.clone()), ..Default::default() };
    let sparse = OneDeviceStrategy::with_options(strata_core::device::logical_cpus(1).unwrap()[0].clone(), options)
        .unwrap()
        .handle();
    let (sparse_w, sparse_model) = train(&sparse);
    assert!(sparse_model.primary().emb.table().is_none(), "the worker holds no table");
    assert!(sparse_model.variables(0).iter().all(|(n, _)| n != "emb"), "the table is no variable of the worker");
    let options = StrategyOptions { seed: SEED, ..Default::default() };
    let dense = OneDeviceStrategy::with_options(strata_core::device::logical_cpus(1).unwrap()[0].clone(), options)
        .unwrap()
        .handle();
    let (dense_w, dense_model) = train(&dense);
    assert_eq!(sparse_w.unwrap(), dense_w.unwrap(), "the linear layer");
    // Every row, on the task that owns it: pulled after training (a new lease), equal to the
    // dense table's row; rows no batch touched are still their initial values.
    let want = dense_model.primary().emb.table().unwrap().to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
    let touched: std::collections::BTreeSet<u32> =
        batches().iter().flat_map(|(ids, _)| ids.flatten_all().unwrap().to_vec1::<u32>().unwrap()).collect();
    for id in 0..ROWS {
        let k = owner_of(TableSize::Rows(ROWS), id, 2);
        let got = clients[k].pull_rows("reader", 1, &[("emb", &[id])]).unwrap().values.remove(0);
        assert_eq!(got, want[id as usize], "row {id}");
        if !touched.contains(&(id as u32)) {
            let mut init = vec![0f32; DIM];
            init_row(SEED, "emb", table().init, id, &mut init);
            assert_eq!(got, init, "row {id}, untouched");
        }
    }
    // One push per step to each task holding some of its rows, each applied once: the last
    // batch's rows (odd ids) are all on ps:1.
    let pushes: usize = batches()
        .iter()
        .map(|(ids, _)| {
            let ids = ids.flatten_all().unwrap().to_vec1::<u32>().unwrap();
            (0..2).filter(|&k| ids.iter().any(|&i| owner_of(TableSize::Rows(ROWS), u64::from(i), 2) == k)).count()
        })
        .sum();
    let applied: u64 = clients.iter().map(|c| c.status().unwrap().pushes_applied).sum();
    assert_eq!((applied, pushes), (7, 7));
    assert_eq!(store.lease(), 4);
    let declared: Vec<_> = store.tables().into_iter().map(|t| t.name).collect();
    assert_eq!(declared, ["emb"]);
    let _: &dyn TableStore = store.as_ref();
}

/// Several training steps in one run of the strategy (as a trainer's execution runs them): the
/// lookup after a step's backward ends that step, pushing its rows before the next pull, so
/// the table and the dense layer end where one step per run ends them, bit for bit, with one
/// push per step and task.
#[test]
fn several_steps_in_one_run_push_each_step_s_rows_before_the_next_lookup() {
    let run = |steps_per_run: usize| {
        let (servers, clients) = ps_tasks(2);
        let store = Arc::new(PsTables::new("worker:0", clients.clone()));
        let options = StrategyOptions { seed: SEED, tables: Some(store.clone()), ..Default::default() };
        let s = OneDeviceStrategy::with_options(strata_core::device::logical_cpus(1).unwrap()[0].clone(), options)
            .unwrap()
            .handle();
        let model = s.scope(Model::new).unwrap();
        let opt = model.optimizer::<SGD>(LR).unwrap();
        for chunk in batches().chunks(steps_per_run) {
            s.run(|ctx| {
                for (ids, target) in chunk {
                    let loss = model.on(ctx)?.loss(ids, target)?;
                    ctx.backward_and_sync(&loss, &opt)?;
                }
                Ok(())
            })
            .unwrap();
        }
        let w = model.primary().lin.weight().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let rows: Vec<Vec<f32>> = (0..ROWS)
            .map(|id| {
                let k = owner_of(TableSize::Rows(ROWS), id, 2);
                clients[k].pull_rows("reader", 1, &[("emb", &[id])]).unwrap().values.remove(0)
            })
            .collect();
        let applied: u64 = clients.iter().map(|c| c.status().unwrap().pushes_applied).sum();
        drop(servers);
        (w, rows, applied, store.traffic().steps)
    };
    let one = run(1);
    let all = run(4);
    assert_eq!(all.0, one.0, "the linear layer");
    assert_eq!(all.1, one.1, "the table's rows");
    assert_eq!((all.2, one.2), (7, 7), "one push per step and task holding some of its rows");
    assert_eq!((all.3, one.3), (4, 4), "four steps pushed rows");
}

/// A parameter-server job in this process (2 ps tasks and one worker over real gRPC on
/// loopback, steps scheduled by a coordinator): the model's table is created in shards on the
/// ps tasks, never on the worker or the coordinator; each step pulls its rows and pushes their
/// gradients with the linear layer's in one update per task. Under SGD on both, the job ends
/// where one device's dense training ends, rows bit for bit.
#[test]
fn a_parameter_server_job_trains_a_table_it_never_holds_whole() {
    ps_job_against_one_device(TableSize::Rows(ROWS), Prefetch::None);
}

/// The same job with each step's rows pulled ahead (`Embedding::prefetch`, beside the pull of
/// the dense variables): the step's lookup takes them without a pull of its own, and the job
/// ends on the same bits, with one update a step.
#[test]
fn rows_pulled_ahead_train_as_rows_pulled_by_the_lookup() {
    ps_job_against_one_device(TableSize::Rows(ROWS), Prefetch::Same);
    ps_job_against_one_device(TableSize::Ids { max_rows_per_shard: 64, evict_after: None }, Prefetch::Same);
}

/// Rows pulled ahead that the step does not look up (another batch's ids) are dropped and the
/// lookup pulls its own: nothing of them is pushed, and the job still ends on one device's bits.
#[test]
fn rows_pulled_ahead_for_other_ids_are_pulled_again() {
    ps_job_against_one_device(TableSize::Rows(ROWS), Prefetch::Other);
}

/// What a step of `ps_job_against_one_device` pulls ahead of its lookup.
#[derive(Clone, Copy, Debug)]
enum Prefetch {
    /// Nothing: the lookup pulls.
    None,
    /// The rows of the step's own batch.
    Same,
    /// The rows of the next batch (the lookup must pull its own).
    Other,
}

/// The same job with the table declared by id space: its rows appear on the ps tasks as the
/// batches first touch them (each id hashed to its task), from the initial values a fixed
/// table of the same name starts at, so the job still ends on one device's bits; the tasks
/// hold exactly the rows some batch touched.
#[test]
fn a_table_declared_by_id_space_grows_on_the_ps_tasks_as_one_device_trains() {
    ps_job_against_one_device(TableSize::Ids { max_rows_per_shard: 64, evict_after: None }, Prefetch::None);
}

fn ps_job_against_one_device(size: TableSize, prefetch: Prefetch) {
    use strata_strategies::cluster::{ClusterSpec, TaskType};
    use strata_strategies::parameter_server::{
        serve_worker, ParameterServerOptions, ParameterServerStrategy, PsWorkerModel, StepRegistry, WorkerContext,
        WorkerOptions,
    };
    crate::common::with_timeout(Duration::from_secs(180), "a_parameter_server_job_trains_a_table", move || {
        let sized = TableConfig { size, ..table() };
        let ps: Vec<PsServerHandle> = (0..2)
            .map(|k| {
                PsServerHandle::start("127.0.0.1:0".parse().unwrap(), PsServerConfig::new(format!("ps:{k}"), token()))
                    .unwrap()
            })
            .collect();
        let ps_addresses: Vec<String> = ps.iter().map(|p| p.address().to_string()).collect();
        let worker_options = StrategyOptions { seed: SEED, ..Default::default() };
        let worker_table = sized.clone();
        let worker = Arc::new(
            PsWorkerModel::new(1, worker_options, move |s| Model::with_table(s, worker_table.clone())).unwrap(),
        );
        let stepper = worker.clone();
        let mut registry = StepRegistry::new();
        registry.register("step", move |w: &WorkerContext, k: usize| -> strata_core::Result<bool> {
            let worker = &stepper;
            let (ids, target) = batches()[k].clone();
            let ahead = match prefetch {
                Prefetch::None => None,
                Prefetch::Same => Some(ids.clone()),
                Prefetch::Other => Some(batches()[(k + 1) % batches().len()].0.clone()),
            };
            let step = |ctx: &strata_core::ReplicaContext<'_>, shard: &strata_core::data::Shard<(Tensor, Tensor)>| {
                let (ids, target) = &shard.batch;
                let loss = worker.model().on(ctx)?.loss(ids, target)?;
                ctx.backward_and_sync(&loss, worker.optimizer())
            };
            // Without rows pulled ahead, the plain step (`run_batch`); with them, the step of a
            // batch made beside the dense pull.
            let out = match ahead {
                None => worker.run_batch(w, &(ids, target), step)?,
                Some(ahead) => {
                    let pull_ahead = |m: &Model, _: &(Tensor, Tensor)| Ok(m.emb.prefetch(&ahead)?);
                    worker.run_batch_made(w, || Ok((ids, target)), pull_ahead, step)?
                }
            };
            Ok(out.push.is_some_and(|p| p.applied()))
        });
        let server = serve_worker(
            "127.0.0.1:0".parse().unwrap(),
            registry,
            WorkerOptions::new(0, ps_addresses.clone(), token()),
        )
        .unwrap();
        let spec =
            ClusterSpec::new([(TaskType::Ps, ps_addresses), (TaskType::Worker, vec![server.address().to_string()])])
                .unwrap();
        let mut options = ParameterServerOptions::new(token());
        options.optimizer = ServerOptimizer::Sgd { lr: LR };
        options.table_optimizer = RowOptimizer::Sgd { lr: LR };
        options.seed = SEED;
        let strategy = ParameterServerStrategy::new(spec, options).unwrap();
        let coordinator_table = sized.clone();
        let model = strategy.scope(move |s| Model::with_table(s, coordinator_table.clone())).unwrap();
        assert!(model.model().emb.table().is_none(), "the coordinator holds no table");
        assert!(model.variables().iter().all(|(n, _)| n != "emb"));
        let coordinator = strategy.coordinator().unwrap();
        for k in 0..batches().len() {
            // One step at a time: each pulls what the previous one pushed, as one device steps.
            assert!(coordinator.schedule::<usize, bool>("step", &k).fetch().unwrap(), "step {k}");
        }
        coordinator.join().unwrap();
        model.pull().unwrap();
        let dense = OneDeviceStrategy::with_options(
            strata_core::device::logical_cpus(1).unwrap()[0].clone(),
            StrategyOptions { seed: SEED, ..Default::default() },
        )
        .unwrap()
        .handle();
        let (dense_w, dense_model) = train(&dense);
        let got_w = model.model().lin.weight().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(got_w, dense_w.unwrap(), "the linear layer");
        let want = dense_model.primary().emb.table().unwrap().to_vec2::<f32>().unwrap();
        let touched: std::collections::BTreeSet<u64> = batches()
            .iter()
            .flat_map(|(ids, _)| ids.flatten_all().unwrap().to_vec1::<u32>().unwrap())
            .map(u64::from)
            .collect();
        let held: u64 = (0..2).map(|k| strategy.ps_clients()[k].status().unwrap().tables[0].rows).sum();
        assert_eq!(held, touched.len() as u64, "the ps tasks hold the rows some batch touched");
        for &id in &touched {
            let k = owner_of(size, id, 2);
            let got = strategy.ps_clients()[k].pull_rows("reader", 1, &[("emb", &[id])]).unwrap().values.remove(0);
            assert_eq!(got, want[id as usize], "row {id}");
        }
        // The coordinator's copy looks rows up on the ps tasks: its loss is one device's.
        let (ids, target) = &batches()[0];
        let there = model.model().loss(ids, target).unwrap().to_scalar::<f32>().unwrap();
        let here = dense_model.primary().loss(ids, target).unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(there, here);
        for k in 0..2 {
            let st = strategy.ps_clients()[k].status().unwrap();
            assert_eq!(st.pushes_applied, batches().len() as u64, "ps:{k}: one update a step");
            assert_eq!(st.tables.len(), 1);
        }
        // One pull of rows a step (the prefetch's, or the lookup's), two where the rows pulled
        // ahead were another batch's.
        let steps = batches().len() as u64;
        let pulls = match prefetch {
            Prefetch::None | Prefetch::Same => steps,
            Prefetch::Other => 2 * steps,
        };
        assert_eq!((worker.table_traffic().pulls, worker.table_traffic().steps), (pulls, steps), "{prefetch:?}");
        drop(coordinator);
        drop(model);
        drop(strategy);
        server.shutdown();
        for p in ps {
            p.shutdown();
        }
    });
}

/// Hybrid training (PERSIA's): two MultiWorkerMirrored workers (threads of this process, each
/// a whole worker with its own ring membership) keep the dense layer synchronous, all-reduced
/// every step, while the table lives on 2 ps tasks and each worker pushes its own rows'
/// gradients there asynchronously, exactly once each. With a flush and a barrier between steps
/// (so that every push of a step lands before the next pulls), the job ends where one device ends
/// training the dense layer at the rate and the table at twice it on the global batch: each
/// worker's push is its half's mean gradient, and the two add.
#[test]
fn hybrid_dense_layers_synchronous_and_tables_asynchronous_on_ps_tasks() {
    use strata_strategies::cluster::ClusterSpec;
    crate::common::with_timeout(Duration::from_secs(180), "hybrid_dense_sync_tables_async", || {
        let (_servers, clients) = ps_tasks_empty(2);
        let ports = crate::common::loopback_ports(2);
        let spec = ClusterSpec::workers(ports.iter().map(|p| format!("127.0.0.1:{p}")).collect::<Vec<_>>()).unwrap();
        let workers: Vec<_> = (0..2)
            .map(|i| {
                let (spec, clients) = (spec.clone(), clients.clone());
                std::thread::spawn(move || {
                    let store = Arc::new(PsTables::new(format!("worker:{i}"), clients));
                    let s = hybrid_worker(spec, i, &store);
                    let model = s.scope(Model::new).unwrap();
                    store.create_tables(SEED, &RowOptimizer::Sgd { lr: LR }, PsMode::Async).unwrap();
                    let opt = model.optimizer::<SGD>(LR).unwrap();
                    for (ids, target) in batches() {
                        // Worker i's half of the global batch.
                        let (ids, target) = (ids.narrow(0, 2 * i, 2).unwrap(), target.narrow(0, 2 * i, 2).unwrap());
                        s.run(|ctx| {
                            let loss = model.on(ctx)?.loss(&ids, &target)?;
                            ctx.backward_and_sync(&loss, &opt)
                        })
                        .unwrap();
                        // The step's rows, held for the next pull, go now: the other worker's
                        // next pull must read them.
                        store.flush().unwrap();
                        s.run(|ctx| ctx.barrier()).unwrap();
                    }
                    let w = model.primary().lin.weight().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    let _ = s.finish();
                    w
                })
            })
            .collect();
        let weights: Vec<Vec<f32>> = workers.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(weights[0], weights[1], "the dense layer is synchronous: both workers hold the same");
        // One device: the dense layer at LR, the table at 2 LR, on the global batch.
        let (dense, want) = one_device_reference(2.0 * LR);
        close(&weights[0], &dense, "dense");
        let mut pushes = 0;
        for (ids, _) in batches() {
            for i in 0..2 {
                let half = ids.narrow(0, 2 * i, 2).unwrap().flatten_all().unwrap().to_vec1::<u32>().unwrap();
                pushes += (0..2)
                    .filter(|&k| half.iter().any(|&id| owner_of(TableSize::Rows(ROWS), u64::from(id), 2) == k))
                    .count() as u64;
            }
            for id in ids.flatten_all().unwrap().to_vec1::<u32>().unwrap() {
                let k = owner_of(TableSize::Rows(ROWS), u64::from(id), 2);
                let got = clients[k].pull_rows("reader", 1, &[("emb", &[u64::from(id)])]).unwrap().values.remove(0);
                close(&got, &want[id as usize], &format!("row {id}"));
            }
        }
        let applied: u64 = clients.iter().map(|c| c.status().unwrap().pushes_applied).sum();
        assert_eq!(applied, pushes, "every worker's rows of every step applied once");
    });
}

/// A hybrid worker's steps handed over together (`run_batches`, as the trainer hands them):
/// under a table store each step is an execution of its own, whose rows go to the ps tasks
/// with the next step's pull (or at its end), so a worker alone reads its own updates and
/// ends where one device ends (the dense layer and the table both at the rate), with one push
/// applied per step and task that owns some of the step's rows, and one lease a step. Both
/// ways of sending the rows end on the same bits; the last step's rows wait for
/// `finish`'s flush when they go with the next pull.
#[test]
fn a_hybrid_worker_s_steps_in_one_execution_read_their_own_pushes() {
    crate::common::with_timeout(Duration::from_secs(180), "hybrid_one_execution", || {
        let with_pull = hybrid_alone(RowsPush::WithNextPull, false);
        let at_end = hybrid_alone(RowsPush::AtStepEnd, false);
        assert_eq!(with_pull, at_end, "the dense layer and the rows, bit for bit");
        // Told each next step's ids, the store pulls them with the step's push once the step's
        // rows are final: the same bits again.
        let early = hybrid_alone(RowsPush::WithNextPull, true);
        assert_eq!(early, at_end, "the dense layer and the rows, bit for bit, pulled early");
    });
}

/// One hybrid worker's run of [`batches`] in one execution, its rows sent `when` (`early`:
/// each step tells the store the next step's ids): checked against one device; returns the
/// dense layer's weight and the rows the steps touched.
fn hybrid_alone(when: RowsPush, early: bool) -> (Vec<f32>, Vec<Vec<f32>>) {
    use strata_core::data::DistributedBatch;
    use strata_strategies::cluster::ClusterSpec;
    let (_servers, clients) = ps_tasks_empty(2);
    let ports = crate::common::loopback_ports(1);
    let spec = ClusterSpec::workers(vec![format!("127.0.0.1:{}", ports[0])]).unwrap();
    let store = Arc::new(PsTables::new("worker:0", clients.clone()).pushing_rows(when));
    let s = hybrid_worker(spec, 0, &store);
    let model = s.scope(Model::new).unwrap();
    store.create_tables(SEED, &RowOptimizer::Sgd { lr: LR }, PsMode::Async).unwrap();
    let opt = model.optimizer::<SGD>(LR).unwrap();
    let all = batches();
    let split: Vec<_> = all.iter().map(|b| DistributedBatch::split(b, 1).unwrap()).collect();
    let step = std::sync::atomic::AtomicUsize::new(0);
    s.run_batches(&split, |ctx, shard| {
        let (ids, target) = &shard.batch;
        let k = step.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Some((next, _)) = all.get(k + 1).filter(|_| early) {
            model.on(ctx)?.emb.expect_next(next)?;
        }
        let loss = model.on(ctx)?.loss(ids, target)?;
        ctx.backward_and_sync(&loss, &opt)
    })
    .unwrap();
    let dense = model.primary().lin.weight().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let applied = |clients: &[PsClient]| clients.iter().map(|c| c.status().unwrap().pushes_applied).sum::<u64>();
    let steps = batches().len() as u64;
    let before_finish = applied(&clients);
    s.finish().unwrap();
    // One device, both at the rate.
    let (reference, want) = one_device_reference(LR);
    close(&dense, &reference, "dense");
    let (mut pushes, mut last_pushes, mut rows) = (0, 0, Vec::new());
    for (ids, _) in batches() {
        let ids = ids.flatten_all().unwrap().to_vec1::<u32>().unwrap();
        last_pushes = (0..2)
            .filter(|&k| ids.iter().any(|&id| owner_of(TableSize::Rows(ROWS), u64::from(id), 2) == k))
            .count() as u64;
        pushes += last_pushes;
        for id in ids {
            let k = owner_of(TableSize::Rows(ROWS), u64::from(id), 2);
            let got = clients[k].pull_rows("reader", 1, &[("emb", &[u64::from(id)])]).unwrap().values.remove(0);
            close(&got, &want[id as usize], &format!("{when:?}: row {id}"));
            rows.push(got);
        }
    }
    assert_eq!(applied(&clients), pushes, "{when:?}: every step's rows applied once");
    let held = if when == RowsPush::WithNextPull { last_pushes } else { 0 };
    assert_eq!(before_finish, pushes - held, "{when:?}: the last step's rows until finish");
    assert_eq!(store.lease(), steps, "{when:?}: one lease a step");
    let traffic = store.traffic();
    assert_eq!(traffic.pulls, steps, "{when:?}: one pull a step");
    assert_eq!(
        traffic.pulls_early,
        if early { steps - 1 } else { 0 },
        "{when:?}: every step but the first pulled early"
    );
    (dense, rows)
}

/// A store told each next step's ids pulls them with the step's push once the step's rows are
/// final, through the calls a hybrid worker's steps make, against ps tasks that drop requests
/// and replies: every step reads its own earlier pushes, each push is applied once, the rows
/// end as SGD at the rate leaves them; a step that asks for other ids than it was told pulls
/// its own (the push went with the early pull all the same); a flush sends nothing twice.
#[test]
fn rows_pulled_early_with_a_step_s_push_are_applied_once_under_faults() {
    crate::common::with_timeout(Duration::from_secs(120), "rows_pulled_early", || {
        let faults = strata_transport::ps::FaultInjection { drop_reply_every: 3, drop_request_every: 5 };
        let (_servers, clients) = ps_tasks_with(2, faults);
        let store = PsTables::new("worker:0", clients.clone()).pushing_rows(RowsPush::WithNextPull);
        store.declare(&table()).unwrap();
        let init = |id: u64| {
            let mut row = vec![0f32; DIM];
            init_row(SEED, "emb", table().init, id, &mut row);
            row
        };
        // Step k looks up steps[k]; it is told told[k] as the next step's ids.
        let steps: [&[u64]; 4] = [&[1, 2], &[2, 3], &[3, 4], &[5]];
        let told: [&[u64]; 4] = [&[2, 3], &[3, 4], &[9], &[]];
        let mut touched = [0u32; ROWS as usize];
        let mut pushes = 0;
        for (k, ids) in steps.iter().enumerate() {
            if !told[k].is_empty() {
                store.expect_next(0, "emb", told[k]).unwrap();
            }
            let got = store.pull(0, "emb", ids).unwrap();
            for (i, &id) in ids.iter().enumerate() {
                let want: Vec<f32> = init(id).iter().map(|w| w - touched[id as usize] as f32 * LR as f32).collect();
                close(&got[i * DIM..(i + 1) * DIM], &want, &format!("step {k}: row {id} with every earlier push"));
                touched[id as usize] += 1;
            }
            store.gradient(0, "emb", ids, vec![1.0; ids.len() * DIM], ids.len()).unwrap();
            store.end_step(0, false).unwrap();
            pushes += (0..2).filter(|&t| ids.iter().any(|&id| owner_of(TableSize::Rows(ROWS), id, 2) == t)).count();
        }
        store.flush().unwrap();
        store.flush().unwrap();
        for id in 1..=5u64 {
            let k = owner_of(TableSize::Rows(ROWS), id, 2);
            let got = clients[k].pull_rows("reader", 1, &[("emb", &[id])]).unwrap().values.remove(0);
            let want: Vec<f32> = init(id).iter().map(|w| w - touched[id as usize] as f32 * LR as f32).collect();
            close(&got, &want, &format!("row {id} at the end"));
        }
        let applied: u64 = clients.iter().map(|c| c.status().unwrap().pushes_applied).sum();
        assert_eq!(applied, pushes as u64, "every step's push applied once");
        let traffic = store.traffic();
        assert_eq!(traffic.pulls_early, 2, "steps 1 and 2 took rows pulled early, step 3 asked for others");
        assert_eq!(traffic.pulls, 5, "4 lookups, one of them after an early pull of ids it did not ask for");
        assert_eq!(store.lease(), 4);
    });
}

/// A store that pushes a step's rows with the next pull, dropped while it holds some, pushes
/// them, once, as a flush does.
#[test]
fn a_store_holding_a_step_s_rows_pushes_them_when_dropped_or_flushed() {
    crate::common::with_timeout(Duration::from_secs(120), "store_drop_flush", || {
        let (_servers, clients) = ps_tasks(2);
        let id = 5u64;
        let k = owner_of(TableSize::Rows(ROWS), id, 2);
        let mut init = vec![0f32; DIM];
        init_row(SEED, "emb", table().init, id, &mut init);
        let row = |c: &PsClient| c.pull_rows("reader", 1, &[("emb", &[id])]).unwrap().values.remove(0);
        let step = |store: &PsTables| {
            store.declare(&table()).unwrap();
            store.pull(0, "emb", &[id]).unwrap();
            store.gradient(0, "emb", &[id], vec![1.0; DIM], 1).unwrap();
            store.end_step(0, false).unwrap();
        };
        let store = PsTables::new("worker:0", clients.clone()).pushing_rows(RowsPush::WithNextPull);
        step(&store);
        assert_eq!(row(&clients[k]), init, "held until the next pull, a flush or the drop");
        drop(store);
        let once: Vec<f32> = init.iter().map(|w| w - LR as f32).collect();
        assert_eq!(row(&clients[k]), once);
        let store = PsTables::new("worker:1", clients.clone()).pushing_rows(RowsPush::WithNextPull);
        step(&store);
        let twice: Vec<f32> = once.iter().map(|w| w - LR as f32).collect();
        store.flush().unwrap();
        assert_eq!(row(&clients[k]), twice);
        // Nothing is held now: dropping sends nothing more.
        drop(store);
        assert_eq!(row(&clients[k]), twice);
        let applied: u64 = clients.iter().map(|c| c.status().unwrap().pushes_applied).sum();
        assert_eq!(applied, 2);
    });
}

/// Worker `i` of a hybrid job of the workers of `spec`: multi-worker mirrored, one replica,
/// its tables in `store` on the ps tasks.
fn hybrid_worker(
    spec: strata_strategies::cluster::ClusterSpec,
    i: usize,
    store: &Arc<PsTables>,
) -> strata_strategies::MultiWorkerMirroredStrategy {
    use strata_strategies::cluster::{ClusterConfig, TaskId};
    let mut o = strata_strategies::MultiWorkerOptions::new(token()).unwrap();
    o.local_devices = strata_core::device::logical_cpus(1).unwrap();
    o.coordination.rendezvous_timeout = Duration::from_secs(30);
    o.options.collective_timeout = Duration::from_secs(30);
    o.options.seed = SEED;
    o.options.tables = Some(store.clone());
    strata_strategies::MultiWorkerMirroredStrategy::new(ClusterConfig::new(spec, TaskId::worker(i)).unwrap(), o)
        .unwrap()
}

/// One device trained on the whole of [`batches`] by hand: the dense layer at `LR`, the table
/// at `table_lr`. Returns the dense layer's weight and the table's rows.
fn one_device_reference(table_lr: f64) -> (Vec<f32>, Vec<Vec<f32>>) {
    let one = OneDeviceStrategy::with_options(
        strata_core::device::logical_cpus(1).unwrap()[0].clone(),
        StrategyOptions { seed: SEED, ..Default::default() },
    )
    .unwrap()
    .handle();
    let model = one.scope(Model::new).unwrap();
    let table = model.primary().emb.table().unwrap().clone();
    let vars = model.trainable_variables(0);
    for (ids, target) in batches() {
        let grads = model.primary().loss(&ids, &target).unwrap().backward().unwrap();
        for (_, v) in &vars {
            let lr = if v.as_tensor().id() == table.id() { table_lr } else { LR };
            let g = grads.get(v).unwrap();
            v.set(&(v.as_tensor() - (g * lr).unwrap()).unwrap()).unwrap();
        }
    }
    (model.primary().lin.weight().flatten_all().unwrap().to_vec1::<f32>().unwrap(), table.to_vec2::<f32>().unwrap())
}

/// Each of `a` equal to `b`'s within f32 rounding of their sums' order.
fn close(a: &[f32], b: &[f32], what: &str) {
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= 1e-5 * y.abs().max(1.0), "{what}: {x} vs {y}");
    }
}

/// `n` ps tasks serving nothing yet (the workers create the table's shards).
fn ps_tasks_empty(n: usize) -> (Vec<PsServerHandle>, Vec<PsClient>) {
    let config = PsClientConfig { timeout: Duration::from_secs(30), retry_for: Duration::from_secs(30) };
    (0..n)
        .map(|k| {
            let task = format!("ps:{k}");
            let server =
                PsServerHandle::start("127.0.0.1:0".parse().unwrap(), PsServerConfig::new(&task, token())).unwrap();
            let client = PsClient::connect(&server.address().to_string(), &task, token(), config.clone()).unwrap();
            (server, client)
        })
        .unzip()
}

/// A step's rows pulled ahead a second time under the same lease (a step tried again) are
/// pulled afresh: the lookup reads what another worker pushed in between, not the first try's
/// rows.
#[test]
fn rows_pulled_ahead_again_are_pulled_afresh() {
    use strata_transport::ps::{RowGrads, UpdateId};
    let (_servers, clients) = ps_tasks(2);
    let store = PsTables::new("worker:0", clients.clone());
    store.declare(&table()).unwrap();
    let id = 5u64;
    let k = owner_of(TableSize::Rows(ROWS), id, 2);
    store.prefetch(0, "emb", &[id]).unwrap();
    // Another worker steps row 5 (SGD at LR, gradient 1 everywhere).
    clients[k].pull_rows("worker:9", 1, &[("emb", &[id])]).unwrap();
    let update = UpdateId { worker: "worker:9".into(), client: "other".into(), step: 0, seq: 0 };
    let rows = RowGrads { table: "emb".into(), lease: 1, ids: vec![id], grads: vec![1.0; DIM] };
    clients[k].push_rows(&update, 0, &[], &[rows]).unwrap();
    store.prefetch(0, "emb", &[id]).unwrap();
    let got = store.pull(0, "emb", &[id]).unwrap();
    let mut want = vec![0f32; DIM];
    init_row(SEED, "emb", table().init, id, &mut want);
    for (g, w) in got.iter().zip(&want) {
        assert!((g - (w - LR as f32)).abs() < 1e-6, "the second prefetch's rows: {got:?}, initially {want:?}");
    }
    // Two pulls, the prefetches'; the lookup took the second one's rows.
    assert_eq!(store.traffic().pulls, 2);
}
