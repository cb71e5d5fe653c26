//! The parameter server over real gRPC on loopback: exactly-once pushes under injected faults,
//! the cluster token, refusals of malformed requests, the four server-side optimizers, the sync
//! and bounded-staleness modes, checkpoint and restore, chunked big tensors, and pulls that wait
//! for a version. Every test runs its body in a thread with a hard limit so it cannot hang.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use prost::bytes::Bytes;
use strata_proto::v1::parameter_server_client::ParameterServerClient;
use strata_proto::v1::{
    create_message, pull_message, push_message, CreateHeader, CreateMessage, PsStatusRequest, PullRequest, PushHeader,
    PushMessage, PushResponse, TensorChunk, VariableSpec,
};
use strata_transport::auth::{client_interceptor, ClientAuth};
use strata_transport::ps::{
    F32Bytes, FaultInjection, LrSchedule, ProtoSpec, PsClient, PsClientConfig, PsMode, PsServerConfig, PsServerHandle,
    PushOutcome, ServerOptimizer, UpdateId, VariableInfo, MAX_CHUNK_BYTES, MAX_CHUNK_ELEMENTS,
};
use strata_transport::{ClusterToken, Error};
use tonic::codegen::InterceptedService;
use tonic::transport::Channel;

use crate::common::within_limit;

const TOKEN: &str = "0123456789abcdef0123456789abcdef";

fn token() -> ClusterToken {
    ClusterToken::new(TOKEN).unwrap()
}

fn server_config() -> PsServerConfig {
    let mut c = PsServerConfig::new("ps:0", token());
    c.round_timeout = Duration::from_secs(30);
    c
}

fn start(config: PsServerConfig) -> PsServerHandle {
    PsServerHandle::start("127.0.0.1:0".parse().unwrap(), config).unwrap()
}

fn client_config() -> PsClientConfig {
    PsClientConfig { timeout: Duration::from_secs(30), retry_for: Duration::from_secs(30) }
}

fn connect(server: &PsServerHandle) -> PsClient {
    PsClient::connect(&server.address().to_string(), "ps:0", token(), client_config()).unwrap()
}

fn whole(name: &str, shape: &[usize]) -> VariableInfo {
    VariableInfo::whole(name, shape.to_vec())
}

fn id(worker: &str, step: u64, seq: u64) -> UpdateId {
    UpdateId { worker: worker.to_string(), client: worker.to_string(), step, seq }
}

/// Creates whole variables on a fresh task and checks the answer of a first creation.
fn create(client: &PsClient, vars: &[(&str, &[usize], &[f32])], optimizer: &ServerOptimizer, mode: PsMode) {
    let infos: Vec<(VariableInfo, &[f32])> = vars.iter().map(|(n, s, v)| (whole(n, s), *v)).collect();
    let out = client.create_variables(&infos, optimizer, mode).unwrap();
    assert!(!out.existed);
    assert_eq!(out.versions, vec![0; vars.len()]);
    assert_eq!(out.version, 0);
}

/// One variable's (task version, variable version, value).
fn pull1(client: &PsClient, name: &str) -> (u64, u64, Vec<f32>) {
    let p = client.pull(&[name], 0).unwrap();
    assert_eq!(p.variables.len(), 1);
    let (info, version, value) = p.variables.into_iter().next().unwrap();
    assert_eq!(info.name, name);
    assert_eq!(value.len(), info.numel());
    (p.version, version, value)
}

fn applied(outcome: PushOutcome) -> u64 {
    match outcome {
        PushOutcome::Applied { version, duplicate: false } => version,
        other => panic!("expected a fresh apply, got {other:?}"),
    }
}

/// The gRPC code name of a refusal.
fn rejected_code(e: &Error) -> &str {
    match e {
        Error::Rejected { code, .. } => code,
        other => panic!("expected Error::Rejected, got {other:?}"),
    }
}

/// The first index where two f32 slices differ (bitwise), for messages that do not print
/// millions of elements.
fn first_difference(got: &[f32], want: &[f32]) -> Option<(usize, f32, f32)> {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).enumerate().find(|(_, (g, w))| g.to_bits() != w.to_bits()).map(|(i, (g, w))| (i, *g, *w))
}

fn assert_close(got: &[f32], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let tol = 1e-5 * w.abs().max(1.0);
        assert!((g as f64 - w).abs() <= tol, "{what}: element {i} is {g}, the closed form gives {w}");
    }
}

// ------------------------------------------------------------------------------------------
// The raw generated client, for requests `PsClient` never sends.

type Raw = ParameterServerClient<InterceptedService<Channel, ClientAuth>>;

fn raw_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

async fn channel(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap()
}

async fn raw(addr: SocketAddr) -> Raw {
    ParameterServerClient::with_interceptor(channel(addr).await, client_interceptor(token()))
}

fn f32_bytes(values: &[f32]) -> Bytes {
    Bytes::from(values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())
}

fn push_header(step: u64, variables: &[&str]) -> PushMessage {
    PushMessage {
        kind: Some(push_message::Kind::Header(PushHeader {
            worker: "worker:9".into(),
            client: "raw".into(),
            step,
            seq: 0,
            base_version: 0,
            variables: variables.iter().map(|v| v.to_string()).collect(),
            ..Default::default()
        })),
    }
}

fn push_chunk(variable: u32, offset: u64, data: Bytes) -> PushMessage {
    PushMessage { kind: Some(push_message::Kind::Chunk(TensorChunk { variable, offset, data })) }
}

async fn raw_push(c: &mut Raw, msgs: Vec<PushMessage>) -> Result<PushResponse, tonic::Status> {
    c.push(tokio_stream::iter(msgs)).await.map(|r| r.into_inner())
}

fn expect_code(what: &str, result: Result<PushResponse, tonic::Status>, code: tonic::Code) {
    match result {
        Ok(r) => panic!("{what}: the server took it ({r:?}); expected {code:?}"),
        Err(s) => assert_eq!(s.code(), code, "{what}: {s:?}"),
    }
}

// ------------------------------------------------------------------------------------------

#[test]
fn specs_round_trip_and_display() {
    let optimizers = [
        ServerOptimizer::Sgd { lr: 0.5 },
        ServerOptimizer::Momentum { lr: 0.1, momentum: 0.9, nesterov: true },
        ServerOptimizer::AdamW { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-7, weight_decay: 0.1 },
        ServerOptimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 1e-7 },
    ];
    let names = ["sgd", "momentum", "adamw", "adagrad"];
    for (o, name) in optimizers.iter().zip(names) {
        assert_eq!(o.name(), name);
        let spec = o.to_spec();
        assert_eq!(spec.kind, name);
        assert_eq!(&ServerOptimizer::from_spec(&spec).unwrap(), o);
    }
    let mut bad = optimizers[0].to_spec();
    bad.kind = "rmsprop".into();
    assert!(ServerOptimizer::from_spec(&bad).is_err());

    for m in [PsMode::Async, PsMode::Sync { workers: 3, backup_workers: 1 }, PsMode::Stale { staleness: 2 }] {
        assert_eq!(PsMode::from_spec(&m.to_spec()).unwrap(), m);
    }
    assert_eq!(PsMode::Async.to_string(), "async");
    assert_eq!(PsMode::Sync { workers: 3, backup_workers: 1 }.to_string(), "sync(3 workers, 1 backup)");
    assert_eq!(PsMode::Stale { staleness: 2 }.to_string(), "stale(2)");
    let mut bad = PsMode::Async.to_spec();
    bad.mode = "eventual".into();
    assert!(PsMode::from_spec(&bad).is_err());

    let v = VariableInfo::whole("dense/kernel", vec![3, 4]);
    assert_eq!(v.name, "dense/kernel");
    assert_eq!(v.variable, "dense/kernel");
    assert_eq!((v.part, v.num_parts, v.row_offset), (0, 1, 0));
    assert_eq!(v.full_shape, vec![3, 4]);
    assert_eq!(v.numel(), 12);
}

/// (1) Lost replies and refused requests are retried with the same update id; every update is
/// applied exactly once.
/// Pushes gradients of ones to `w` (`n` elements) from `workers` threads at once, `steps` each
/// (worker `c`'s updates are `(worker:c, step, c)`), and checks that each was applied; with
/// `shared` through `push_shared`, else `push`.
fn push_ones_from_threads(client: &PsClient, workers: u64, steps: u64, n: usize, shared: bool) {
    let threads: Vec<_> = (0..workers)
        .map(|c| {
            let client = client.clone();
            std::thread::spawn(move || {
                let ones = vec![1.0f32; n];
                let handed_over = F32Bytes::from_vec(ones.clone());
                let worker = format!("worker:{c}");
                for step in 0..steps {
                    let id = id(&worker, step, c);
                    let outcome = match shared {
                        true => client.push_shared(&id, 0, &[("w", handed_over.clone())]),
                        false => client.push(&id, 0, &[("w", &ones)]),
                    };
                    match outcome {
                        Ok(PushOutcome::Applied { .. }) => {}
                        other => panic!("{worker} step {step}: {other:?}"),
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn every_update_is_applied_exactly_once_despite_dropped_requests_and_replies() {
    within_limit("exactly_once", || {
        let mut config = server_config();
        config.faults = FaultInjection { drop_reply_every: 3, drop_request_every: 5 };
        let server = start(config);
        let client = connect(&server);
        create(&client, &[("w", &[1024], &[0.0; 1024])], &ServerOptimizer::Sgd { lr: 1.0 }, PsMode::Async);

        push_ones_from_threads(&client, 4, 40, 1024, false);

        let (version, var_version, value) = pull1(&client, "w");
        if let Some((i, g, w)) = first_difference(&value, &[-160.0; 1024]) {
            panic!("element {i} is {g}, expected {w}: an update was lost or applied twice");
        }
        assert_eq!((version, var_version), (160, 160));
        let status = client.status().unwrap();
        assert_eq!(status.task, "ps:0");
        assert_eq!(status.version, 160);
        assert_eq!(status.pushes_applied, 160);
        assert!(status.pushes_duplicate > 0, "no dropped reply was retried: {status:?}");
        assert_eq!(status.applied_by_worker.values().sum::<u64>(), 160, "{status:?}");
        server.shutdown();
    });
}

/// (1b) Large pushes (3 MiB, three chunks: applied while they arrive unless streaming is
/// off) from 4 workers at once, under dropped requests and replies: every logical push is
/// applied exactly once, streamed or not.
#[test]
fn large_pushes_are_applied_exactly_once_despite_faults_streamed_or_not() {
    within_limit("exactly_once_large", || {
        const N: usize = 3 * MAX_CHUNK_ELEMENTS;
        for stream_min_bytes in [Some(2 * MAX_CHUNK_BYTES), None] {
            let mut config = server_config();
            config.faults = FaultInjection { drop_reply_every: 3, drop_request_every: 5 };
            config.stream_min_bytes = stream_min_bytes;
            let server = start(config);
            let client = connect(&server);
            create(&client, &[("w", &[N], &vec![0.0; N])], &ServerOptimizer::Sgd { lr: 1.0 }, PsMode::Async);
            push_ones_from_threads(&client, 4, 10, N, true);
            let (version, var_version, value) = pull1(&client, "w");
            if let Some((i, g, w)) = first_difference(&value, &vec![-40.0; N]) {
                panic!("{stream_min_bytes:?}: element {i} is {g}, expected {w}: an update was lost or applied twice");
            }
            assert_eq!((version, var_version), (40, 40));
            let status = client.status().unwrap();
            assert_eq!(status.pushes_applied, 40, "{status:?}");
            assert!(status.pushes_duplicate > 0, "no dropped reply was retried: {status:?}");
            assert!(!status.streaming);
            match stream_min_bytes {
                Some(_) => assert!(status.pushes_streamed > 0, "no push was streamed: {status:?}"),
                None => assert_eq!(status.pushes_streamed, 0, "{status:?}"),
            }
            server.shutdown();
        }
    });
}

/// (1c) A streamed push whose client stalls loses its turn: a push waiting behind it is
/// applied once the stream has received nothing for a second, the stalled push then gets
/// ABORTED with nothing of it applied, and sent again it applies once.
#[test]
fn a_stalled_streamed_push_loses_its_turn_and_is_aborted() {
    within_limit("stalled stream", || {
        const N: usize = 3 * MAX_CHUNK_ELEMENTS;
        let server = start(server_config());
        let client = connect(&server);
        let sgd = ServerOptimizer::Sgd { lr: 1.0 };
        let infos = [(whole("big", &[N]), &vec![0.0f32; N][..]), (whole("small", &[4]), &[0.0f32; 4][..])];
        client.create_variables(&infos, &sgd, PsMode::Async).unwrap();
        let twos = f32_bytes(&vec![2.0f32; MAX_CHUNK_ELEMENTS]);
        let messages = |from: usize| -> Vec<PushMessage> {
            (from..3).map(|i| push_chunk(0, (i * MAX_CHUNK_ELEMENTS) as u64, twos.clone())).collect()
        };
        // A runtime with a thread of its own, so that the raw call goes on while this thread waits.
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let mut raw = rt.block_on(raw(server.address()));
        // The raw client's push of `big`: its header and first chunk, then nothing.
        let (tx, rx) = tokio::sync::mpsc::channel::<PushMessage>(4);
        let call = {
            let mut raw = raw.clone();
            rt.spawn(async move { raw.push(tokio_stream::wrappers::ReceiverStream::new(rx)).await })
        };
        rt.block_on(async {
            tx.send(push_header(0, &["big"])).await.unwrap();
            tx.send(messages(0).remove(0)).await.unwrap();
        });
        while !client.status().unwrap().streaming {
            std::thread::sleep(Duration::from_millis(10));
        }
        // Another worker's push waits while the stream is stalled, then is applied.
        assert_eq!(applied(client.push(&id("worker:1", 0, 0), 0, &[("small", &[1.0; 4])]).unwrap()), 1);
        // The stalled push resumes and ends: refused, nothing of it applied.
        let result = rt.block_on(async move {
            for m in messages(1) {
                tx.send(m).await.unwrap();
            }
            drop(tx);
            call.await.unwrap().map(|r| r.into_inner())
        });
        expect_code("a push under which another was applied", result, tonic::Code::Aborted);
        assert_eq!(first_difference(&pull1(&client, "big").2, &vec![0.0; N]), None, "the aborted push changed big");
        let status = client.status().unwrap();
        assert_eq!((status.version, status.pushes_applied, status.pushes_aborted), (1, 1, 1), "{status:?}");
        // Sent again, whole: applied once; a third time, a duplicate.
        for (time, duplicate) in [(2, false), (3, true)] {
            let mut msgs = vec![push_header(0, &["big"])];
            msgs.extend(messages(0));
            let r = rt.block_on(raw_push(&mut raw, msgs)).unwrap();
            assert!(r.applied && r.duplicate == duplicate && r.version == 2, "send {time}: {r:?}");
        }
        assert_eq!(first_difference(&pull1(&client, "big").2, &vec![-2.0; N]), None);
        assert_eq!(pull1(&client, "small").2, vec![-1.0; 4]);
        let status = client.status().unwrap();
        assert_eq!((status.pushes_applied, status.pushes_streamed, status.pushes_duplicate), (2, 1, 1), "{status:?}");
        server.shutdown();
    });
}

/// (2) Without the cluster token nothing is answered and nothing changes.
#[test]
fn a_wrong_or_missing_token_is_refused_and_changes_nothing() {
    within_limit("auth", || {
        let server = start(server_config());
        let addr = server.address();
        let good = connect(&server);
        let sgd = ServerOptimizer::Sgd { lr: 1.0 };
        create(&good, &[("w", &[4], &[1.0, 2.0, 3.0, 4.0])], &sgd, PsMode::Async);

        let wrong = ClusterToken::new("ffffffffffffffffffffffffffffffff").unwrap();
        let no_retry = PsClientConfig { timeout: Duration::from_secs(10), retry_for: Duration::ZERO };
        let bad = PsClient::connect(&addr.to_string(), "ps:0", wrong, no_retry).unwrap();
        let unauth = |what: &str, e: Error| assert!(matches!(e, Error::Unauthenticated(_)), "{what}: {e:?}");
        let zeros = [0.0f32; 4];
        unauth("create", bad.create_variables(&[(whole("x", &[4]), &zeros[..])], &sgd, PsMode::Async).unwrap_err());
        unauth(
            "create of an existing name",
            bad.create_variables(&[(whole("w", &[4]), &zeros[..])], &sgd, PsMode::Async).unwrap_err(),
        );
        unauth("push", bad.push(&id("worker:0", 0, 0), 0, &[("w", &[1.0; 4])]).unwrap_err());
        unauth("pull", bad.pull(&["w"], 0).unwrap_err());
        unauth("pull_into", bad.pull_into(&["w"], 0, &mut [&mut [0.0f32; 4][..]]).unwrap_err());
        unauth("status", bad.status().unwrap_err());
        unauth("checkpoint", bad.checkpoint(1).unwrap_err());
        unauth("configure", bad.configure(1).unwrap_err());

        // The same without any token, and the health service behind the token too.
        let rt = raw_runtime();
        rt.block_on(async {
            let ch = channel(addr).await;
            let e = ParameterServerClient::new(ch.clone()).status(PsStatusRequest {}).await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
            let msgs = vec![push_header(0, &["w"]), push_chunk(0, 0, f32_bytes(&[1.0; 4]))];
            let e = ParameterServerClient::new(ch.clone()).push(tokio_stream::iter(msgs)).await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
            use tonic_health::pb::health_check_response::ServingStatus;
            use tonic_health::pb::health_client::HealthClient;
            use tonic_health::pb::HealthCheckRequest;
            let request = || HealthCheckRequest { service: "strata.v1.ParameterServer".into() };
            let e = HealthClient::new(ch.clone()).check(request()).await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unauthenticated, "health without a token: {e:?}");
            let mut health = HealthClient::with_interceptor(ch, client_interceptor(token()));
            let answer = health.check(request()).await.unwrap().into_inner();
            assert_eq!(answer.status, ServingStatus::Serving as i32);
        });

        // Nothing changed, and an authenticated client is still served.
        let (version, var_version, value) = pull1(&good, "w");
        assert_eq!((version, var_version), (0, 0));
        assert_eq!(value, vec![1.0, 2.0, 3.0, 4.0]);
        let status = good.status().unwrap();
        assert_eq!(status.variables.len(), 1, "{status:?}");
        assert_eq!((status.pushes_applied, status.pushes_duplicate), (0, 0));
        assert_eq!(applied(good.push(&id("worker:0", 0, 0), 0, &[("w", &[1.0; 4])]).unwrap()), 1);
        assert_eq!(pull1(&good, "w").2, vec![0.0, 1.0, 2.0, 3.0]);
        server.shutdown();
    });
}

/// `Push` and `Pull` are served below tonic's codec, with the proto's messages on the wire: a
/// plain generated gRPC client pushes a three-chunk gradient that is applied exactly as the
/// `PsClient`'s would be, and pulls the result chunk for chunk.
#[test]
fn a_plain_grpc_client_pushes_and_pulls_through_the_data_path() {
    within_limit("plain gRPC", || {
        let mut config = server_config();
        config.checkpoint_dir = None;
        let server = start(config);
        let client = connect(&server);
        let n = 2 * MAX_CHUNK_ELEMENTS + 3;
        let init: Vec<f32> = (0..n).map(|i| i as f32).collect();
        create(&client, &[("v", &[n], &init)], &ServerOptimizer::Sgd { lr: 0.5 }, PsMode::Async);
        let grad: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
        let want: Vec<f32> = init.iter().zip(&grad).map(|(w, g)| w - 0.5 * g).collect();
        let rt = raw_runtime();
        let pulled = rt.block_on(async {
            let mut raw = raw(server.address()).await.max_decoding_message_size(2 << 20);
            let mut msgs = vec![push_header(0, &["v"])];
            for (i, c) in grad.chunks(MAX_CHUNK_ELEMENTS).enumerate() {
                msgs.push(push_chunk(0, (i * MAX_CHUNK_ELEMENTS) as u64, f32_bytes(c)));
            }
            let r = raw_push(&mut raw, msgs).await.unwrap();
            assert!(r.applied && !r.duplicate && !r.dropped, "{r:?}");
            assert_eq!(r.version, 1);
            let request = PullRequest { variables: vec!["v".into()], min_version: 1, ..Default::default() };
            let mut stream = raw.pull(request).await.unwrap().into_inner();
            let mut values = Vec::new();
            let mut kinds = Vec::new();
            while let Some(m) = stream.message().await.unwrap() {
                match m.kind.unwrap() {
                    pull_message::Kind::Header(h) => {
                        assert_eq!((h.version, h.variable_versions.clone()), (1, vec![1]));
                        kinds.push("header");
                    }
                    pull_message::Kind::Chunk(c) => {
                        assert_eq!((c.variable, c.offset as usize), (0, values.len()));
                        assert!(c.data.len() <= MAX_CHUNK_BYTES);
                        values.extend(c.data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])));
                        kinds.push("chunk");
                    }
                }
            }
            assert_eq!(kinds, ["header", "chunk", "chunk", "chunk"]);
            values
        });
        assert_eq!(first_difference(&pulled, &want), None);
        assert_eq!(first_difference(&pull1(&client, "v").2, &want), None);
        server.shutdown();
    });
}

/// (3) Malformed requests are refused with the right code, change nothing, are not recorded as
/// applied, and the server keeps serving (garbage on its TCP port included).
#[test]
fn malformed_requests_are_refused_and_the_server_keeps_serving() {
    within_limit("malformed", || {
        let mut config = server_config();
        config.checkpoint_dir = None;
        let server = start(config);
        let addr = server.address();
        let client = connect(&server);
        let sgd = ServerOptimizer::Sgd { lr: 1.0 };
        // "big" holds exactly one chunk's worth of elements plus one, so a single oversize
        // chunk covering it is wrong only in its size.
        let big_len = MAX_CHUNK_BYTES / 4 + 1;
        let big0 = vec![0.0f32; big_len];
        create(&client, &[("w", &[4], &[1.0, 2.0, 3.0, 4.0]), ("big", &[big_len], &big0)], &sgd, PsMode::Async);

        // Through the client.
        let e = client.push(&id("worker:0", 0, 0), 0, &[("nope", &[1.0; 4])]).unwrap_err();
        assert_eq!(rejected_code(&e), "NotFound", "{e}");
        assert!(e.to_string().contains("nope"), "the refusal should name the variable: {e}");
        let e = client.push(&id("worker:0", 1, 0), 0, &[("w", &[1.0; 3])]).unwrap_err();
        assert_eq!(rejected_code(&e), "InvalidArgument", "{e}");
        let e = client.push(&id("worker:0", 2, 0), 0, &[("w", &[1.0; 5])]).unwrap_err();
        assert_eq!(rejected_code(&e), "InvalidArgument", "{e}");
        let e = client.pull(&["nope"], 0).unwrap_err();
        assert_eq!(rejected_code(&e), "NotFound", "{e}");
        let e = client.checkpoint(1).unwrap_err();
        assert_eq!(rejected_code(&e), "FailedPrecondition", "checkpoint without a directory: {e}");

        // Re-creating: the same spec is a no-op, anything different is refused.
        let same = client.create_variables(&[(whole("w", &[4]), &[9.0; 4][..])], &sgd, PsMode::Async).unwrap();
        assert!(same.existed);
        assert_eq!(same.versions, vec![0]);
        let e = client.create_variables(&[(whole("w", &[2, 2]), &[1.0; 4][..])], &sgd, PsMode::Async).unwrap_err();
        assert_eq!(rejected_code(&e), "FailedPrecondition", "a different shape: {e}");
        let e = client
            .create_variables(&[(whole("w", &[4]), &[1.0; 4][..])], &ServerOptimizer::Sgd { lr: 0.5 }, PsMode::Async)
            .unwrap_err();
        assert_eq!(rejected_code(&e), "FailedPrecondition", "a different optimizer: {e}");
        let e = client
            .create_variables(&[(whole("w", &[4]), &[1.0; 4][..])], &sgd, PsMode::Stale { staleness: 1 })
            .unwrap_err();
        assert_eq!(rejected_code(&e), "FailedPrecondition", "a different mode: {e}");

        // Streams only a hand-made client can send.
        let rt = raw_runtime();
        rt.block_on(async {
            let mut raw = raw(addr).await;
            let ones = |n: usize| f32_bytes(&vec![1.0; n]);
            let oversize = ones(big_len);
            assert!(oversize.len() > MAX_CHUNK_BYTES);
            expect_code(
                "a chunk over 1 MiB",
                raw_push(&mut raw, vec![push_header(10, &["big"]), push_chunk(0, 0, oversize)]).await,
                tonic::Code::InvalidArgument,
            );
            expect_code(
                "a message over the 1 MiB chunk and its framing",
                raw_push(&mut raw, vec![push_header(10, &["big"]), push_chunk(0, 0, ones(2 * big_len))]).await,
                tonic::Code::InvalidArgument,
            );
            let mut odd = ones(4).to_vec();
            odd.extend_from_slice(&[0, 0]);
            expect_code(
                "data not a multiple of 4 bytes",
                raw_push(&mut raw, vec![push_header(11, &["w"]), push_chunk(0, 0, Bytes::from(odd))]).await,
                tonic::Code::InvalidArgument,
            );
            expect_code(
                "a second header",
                raw_push(&mut raw, vec![push_header(12, &["w"]), push_header(12, &["w"]), push_chunk(0, 0, ones(4))])
                    .await,
                tonic::Code::InvalidArgument,
            );
            expect_code(
                "no header",
                raw_push(&mut raw, vec![push_chunk(0, 0, ones(4))]).await,
                tonic::Code::InvalidArgument,
            );
            expect_code("an empty stream", raw_push(&mut raw, vec![]).await, tonic::Code::InvalidArgument);
            expect_code(
                "a chunk for a variable the header does not list",
                raw_push(&mut raw, vec![push_header(13, &["w"]), push_chunk(0, 0, ones(4)), push_chunk(1, 0, ones(4))])
                    .await,
                tonic::Code::InvalidArgument,
            );
            expect_code(
                "overlapping chunks",
                raw_push(&mut raw, vec![push_header(14, &["w"]), push_chunk(0, 0, ones(2)), push_chunk(0, 0, ones(4))])
                    .await,
                tonic::Code::InvalidArgument,
            );
            expect_code(
                "a gap",
                raw_push(&mut raw, vec![push_header(15, &["w"]), push_chunk(0, 0, ones(2)), push_chunk(0, 3, ones(1))])
                    .await,
                tonic::Code::InvalidArgument,
            );
            expect_code(
                "a chunk past the end",
                raw_push(&mut raw, vec![push_header(16, &["w"]), push_chunk(0, 2, ones(4))]).await,
                tonic::Code::InvalidArgument,
            );
            expect_code(
                "a variable named twice",
                raw_push(
                    &mut raw,
                    vec![push_header(17, &["w", "w"]), push_chunk(0, 0, ones(4)), push_chunk(1, 0, ones(4))],
                )
                .await,
                tonic::Code::InvalidArgument,
            );
            // dtype "f64" at create (the client cannot express it).
            let spec = VariableSpec {
                name: "x".into(),
                shape: vec![2],
                dtype: "f64".into(),
                variable: "x".into(),
                part: 0,
                num_parts: 1,
                row_offset: 0,
                full_shape: vec![2],
                state: false,
            };
            let msgs = vec![
                CreateMessage {
                    kind: Some(create_message::Kind::Header(CreateHeader {
                        variables: vec![spec],
                        optimizer: Some(ServerOptimizer::Sgd { lr: 1.0 }.to_spec()),
                        mode: Some(PsMode::Async.to_spec()),
                        ..Default::default()
                    })),
                },
                CreateMessage {
                    kind: Some(create_message::Kind::Chunk(TensorChunk {
                        variable: 0,
                        offset: 0,
                        data: Bytes::from(vec![0u8; 16]),
                    })),
                },
            ];
            let e = raw.create_variables(tokio_stream::iter(msgs)).await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "dtype f64: {e:?}");
        });

        // Garbage on the TCP port: random bytes, an HTTP/2 preface followed by junk frames,
        // plain HTTP/1, and a connection closed at once.
        let mut junk = Vec::with_capacity(1 << 16);
        let mut x: u32 = 0x1234_5678;
        for _ in 0..(1 << 16) {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            junk.push(x as u8);
        }
        let mut preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        preface.extend_from_slice(&junk[..4096]);
        for payload in [junk.clone(), preface, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(), Vec::new()] {
            let mut s = TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
            let _ = s.write_all(&payload);
            let mut sink = [0u8; 1024];
            let _ = s.read(&mut sink);
        }

        // Nothing was applied, nothing was created, and the refused ids were not recorded.
        let status = client.status().unwrap();
        assert_eq!((status.version, status.pushes_applied, status.pushes_duplicate), (0, 0, 0), "{status:?}");
        let mut names: Vec<_> = status.variables.iter().map(|(v, _)| v.name.clone()).collect();
        names.sort();
        assert_eq!(names, vec!["big", "w"]);
        assert_eq!(pull1(&client, "w"), (0, 0, vec![1.0, 2.0, 3.0, 4.0]));
        assert!(pull1(&client, "big").2.iter().all(|&v| v == 0.0));
        assert_eq!(applied(client.push(&id("worker:0", 1, 0), 0, &[("w", &[1.0; 4])]).unwrap()), 1);
        rt.block_on(async {
            let mut raw = raw(addr).await;
            let ok = raw_push(&mut raw, vec![push_header(11, &["w"]), push_chunk(0, 0, f32_bytes(&[1.0; 4]))])
                .await
                .unwrap();
            assert!(ok.applied && !ok.duplicate && !ok.dropped, "{ok:?}");
            assert_eq!(ok.version, 2);
        });
        assert_eq!(pull1(&client, "w"), (2, 2, vec![-1.0, 0.0, 1.0, 2.0]));
        server.shutdown();
    });
}

/// The closed forms of the four optimizers, in f64.
fn closed_form(optimizer: &ServerOptimizer, w0: &[f32], grads: &[&[f32]]) -> Vec<f64> {
    let n = w0.len();
    let mut w: Vec<f64> = w0.iter().map(|&v| v as f64).collect();
    let mut s1 = vec![0.0f64; n];
    let mut s2 = vec![0.0f64; n];
    if let ServerOptimizer::Adagrad { initial_accumulator, .. } = optimizer {
        s1 = vec![*initial_accumulator; n];
    }
    for (t, g) in grads.iter().enumerate() {
        let t = t as i32 + 1;
        for i in 0..n {
            let g = g[i] as f64;
            match *optimizer {
                ServerOptimizer::Sgd { lr } => w[i] -= lr * g,
                ServerOptimizer::Momentum { lr, momentum, nesterov } => {
                    s1[i] = momentum * s1[i] - lr * g;
                    if nesterov {
                        w[i] += momentum * s1[i] - lr * g;
                    } else {
                        w[i] += s1[i];
                    }
                }
                ServerOptimizer::AdamW { lr, beta1, beta2, eps, weight_decay } => {
                    w[i] -= lr * weight_decay * w[i];
                    s1[i] = beta1 * s1[i] + (1.0 - beta1) * g;
                    s2[i] = beta2 * s2[i] + (1.0 - beta2) * g * g;
                    let m_hat = s1[i] / (1.0 - beta1.powi(t));
                    let v_hat = s2[i] / (1.0 - beta2.powi(t));
                    w[i] -= lr * m_hat / (v_hat.sqrt() + eps);
                }
                ServerOptimizer::Adagrad { lr, eps, .. } => {
                    s1[i] += g * g;
                    w[i] -= lr * g / (s1[i].sqrt() + eps);
                }
            }
        }
    }
    w
}

/// (4) Each optimizer's values after two pushes equal its closed form.
#[test]
fn server_optimizers_match_their_closed_forms() {
    within_limit("optimizers", || {
        let w0 = [0.5f32, -1.0, 2.0, 0.0, 3.0, -0.25];
        let g1 = [0.1f32, -0.2, 0.3, 1.0, -2.0, 0.0];
        let g2 = [0.4f32, 0.5, -0.6, -1.0, 0.0, 0.7];
        let optimizers = [
            ServerOptimizer::Sgd { lr: 0.1 },
            ServerOptimizer::Momentum { lr: 0.1, momentum: 0.9, nesterov: false },
            ServerOptimizer::Momentum { lr: 0.1, momentum: 0.9, nesterov: true },
            ServerOptimizer::AdamW { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-7, weight_decay: 0.1 },
            ServerOptimizer::Adagrad { lr: 0.1, initial_accumulator: 0.1, eps: 1e-7 },
        ];
        for optimizer in optimizers {
            let server = start(server_config());
            let client = connect(&server);
            create(&client, &[("w", &[2, 3], &w0)], &optimizer, PsMode::Async);
            assert_eq!(applied(client.push(&id("worker:0", 0, 0), 0, &[("w", &g1)]).unwrap()), 1);
            let after_one = pull1(&client, "w").2;
            assert_close(&after_one, &closed_form(&optimizer, &w0, &[&g1]), &format!("{optimizer:?} after 1 push"));
            assert_eq!(applied(client.push(&id("worker:0", 1, 0), 1, &[("w", &g2)]).unwrap()), 2);
            let (version, var_version, value) = pull1(&client, "w");
            assert_eq!((version, var_version), (2, 2));
            assert_close(&value, &closed_form(&optimizer, &w0, &[&g1, &g2]), &format!("{optimizer:?} after 2 pushes"));
            let status = client.status().unwrap();
            assert_eq!(status.optimizer.as_ref(), Some(&optimizer));
            assert_eq!(status.mode, PsMode::Async);
            server.shutdown();
        }
    });
}

/// Pushes `grads[i]` from `worker:<i>` concurrently (step `step`, base `base`); the outcomes in
/// worker order.
fn push_concurrently(client: &PsClient, step: u64, base: u64, grads: &[f32], len: usize) -> Vec<PushOutcome> {
    let threads: Vec<_> = grads
        .iter()
        .enumerate()
        .map(|(i, &g)| {
            let client = client.clone();
            std::thread::spawn(move || client.push(&id(&format!("worker:{i}"), step, 0), base, &[("w", &vec![g; len])]))
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap().unwrap()).collect()
}

/// (5) Sync mode: a round's mean is applied once; late pushes and pushes from older versions
/// are dropped; retries of an accepted push are duplicates.
#[test]
fn sync_rounds_apply_the_mean_once_and_drop_late_pushes() {
    within_limit("sync", || {
        let sgd = ServerOptimizer::Sgd { lr: 0.5 };
        let mode = PsMode::Sync { workers: 3, backup_workers: 0 };
        let server = start(server_config());
        let client = connect(&server);
        create(&client, &[("w", &[8], &[10.0; 8])], &sgd, mode);

        let outcomes = push_concurrently(&client, 0, 0, &[1.0, 2.0, 3.0], 8);
        for o in &outcomes {
            assert_eq!(*o, PushOutcome::Applied { version: 1, duplicate: false });
        }
        assert_eq!(pull1(&client, "w"), (1, 1, vec![9.0; 8]));
        // A retry of an accepted push gets its first answer.
        assert_eq!(
            client.push(&id("worker:0", 0, 0), 0, &[("w", &[1.0; 8])]).unwrap(),
            PushOutcome::Applied { version: 1, duplicate: true }
        );
        // A push computed from version 0 when the task is at 1 is dropped.
        assert_eq!(
            client.push(&id("worker:0", 1, 0), 0, &[("w", &[100.0; 8])]).unwrap(),
            PushOutcome::Dropped { version: 1 }
        );
        // One from a version the task has not reached is refused.
        let e = client.push(&id("worker:0", 2, 0), 7, &[("w", &[100.0; 8])]).unwrap_err();
        assert_eq!(rejected_code(&e), "InvalidArgument", "{e}");
        assert_eq!(pull1(&client, "w"), (1, 1, vec![9.0; 8]));
        let status = client.status().unwrap();
        assert_eq!((status.version, status.rounds, status.pushes_dropped), (1, 1, 1), "{status:?}");
        assert_eq!(status.mode, mode);
        let expected: BTreeMap<String, u64> = (0..3).map(|i| (format!("worker:{i}"), 1)).collect();
        assert_eq!(status.applied_by_worker, expected);
        // The next round.
        let outcomes = push_concurrently(&client, 3, 1, &[3.0, 3.0, 3.0], 8);
        for o in &outcomes {
            assert_eq!(*o, PushOutcome::Applied { version: 2, duplicate: false });
        }
        assert_eq!(pull1(&client, "w"), (2, 2, vec![7.5; 8]));
        server.shutdown();

        // One backup: the round is applied after two pushes; the third is dropped.
        let mode = PsMode::Sync { workers: 3, backup_workers: 1 };
        let server = start(server_config());
        let client = connect(&server);
        create(&client, &[("w", &[8], &[10.0; 8])], &sgd, mode);
        let outcomes = push_concurrently(&client, 0, 0, &[1.0, 3.0], 8);
        for o in &outcomes {
            assert_eq!(*o, PushOutcome::Applied { version: 1, duplicate: false });
        }
        assert_eq!(pull1(&client, "w"), (1, 1, vec![9.0; 8]));
        assert_eq!(
            client.push(&id("worker:2", 0, 0), 0, &[("w", &[100.0; 8])]).unwrap(),
            PushOutcome::Dropped { version: 1 }
        );
        assert_eq!(pull1(&client, "w"), (1, 1, vec![9.0; 8]));
        let status = client.status().unwrap();
        assert_eq!((status.version, status.rounds, status.pushes_dropped), (1, 1, 1), "{status:?}");
        assert_eq!(status.applied_by_worker.get("worker:2").copied().unwrap_or(0), 0, "{status:?}");
        server.shutdown();
    });
}

/// (6) Bounded staleness: a push computed too far behind is refused and changes nothing.
#[test]
fn stale_pushes_are_refused() {
    within_limit("stale", || {
        let server = start(server_config());
        let client = connect(&server);
        create(&client, &[("w", &[4], &[0.0; 4])], &ServerOptimizer::Sgd { lr: 1.0 }, PsMode::Stale { staleness: 1 });
        assert_eq!(applied(client.push(&id("worker:0", 0, 0), 0, &[("w", &[1.0; 4])]).unwrap()), 1);
        assert_eq!(applied(client.push(&id("worker:1", 0, 0), 0, &[("w", &[1.0; 4])]).unwrap()), 2);
        match client.push(&id("worker:2", 0, 0), 0, &[("w", &[1.0; 4])]) {
            Err(Error::Stale { peer, base, current, bound }) => {
                assert_eq!(peer, "ps:0");
                assert_eq!((base, current, bound), (0, 2, 1));
            }
            other => panic!("expected Error::Stale, got {other:?}"),
        }
        assert_eq!(pull1(&client, "w"), (2, 2, vec![-2.0; 4]));
        let status = client.status().unwrap();
        assert_eq!((status.version, status.pushes_stale, status.pushes_applied), (2, 1, 2), "{status:?}");
        // The refused id was not recorded: recomputed from a fresh version it is applied.
        assert_eq!(applied(client.push(&id("worker:2", 0, 0), 1, &[("w", &[1.0; 4])]).unwrap()), 3);
        assert_eq!(pull1(&client, "w"), (3, 3, vec![-3.0; 4]));
        server.shutdown();
    });
}

fn pull_all(client: &PsClient) -> (u64, Vec<(String, u64, Vec<f32>)>) {
    let p = client.pull(&[], 0).unwrap();
    let mut vars: Vec<_> = p.variables.into_iter().map(|(info, v, value)| (info.name, v, value)).collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    (p.version, vars)
}

fn safetensors_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    files
}

/// (7) A restored task holds exactly what its checkpoint held; a corrupt checkpoint stops it
/// from starting, naming the file.
#[test]
fn checkpoint_and_restore_round_trip_and_corruption_is_detected() {
    within_limit("checkpoint", || {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("ps0");
        let optimizer = ServerOptimizer::Momentum { lr: 0.5, momentum: 0.5, nesterov: false };
        let mut config = server_config();
        config.checkpoint_dir = Some(root.clone());
        let server = start(config);
        let client = connect(&server);
        let a0 = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let b0 = [0.5f32; 5];
        create(&client, &[("a", &[2, 3], &a0), ("b", &[5], &b0)], &optimizer, PsMode::Async);
        applied(client.push(&id("worker:0", 0, 0), 0, &[("a", &[1.0; 6]), ("b", &[2.0; 5])]).unwrap());
        applied(client.push(&id("worker:0", 1, 0), 1, &[("a", &[1.0; 6])]).unwrap());
        let (path, version) = client.checkpoint(5).unwrap();
        assert_eq!(version, 2);
        assert!(path.starts_with(&root) && path.is_dir(), "{}", path.display());
        assert!(path.file_name().unwrap().to_string_lossy().starts_with("ckpt-"), "{}", path.display());
        let at_checkpoint = pull_all(&client);
        assert_eq!(at_checkpoint.0, 2);
        assert_eq!(at_checkpoint.1.iter().map(|(n, v, _)| (n.as_str(), *v)).collect::<Vec<_>>(), [("a", 2), ("b", 1)]);
        // Later pushes are not in the checkpoint (momentum slots make them visible twice).
        applied(client.push(&id("worker:0", 2, 0), 2, &[("a", &[3.0; 6]), ("b", &[3.0; 5])]).unwrap());
        applied(client.push(&id("worker:0", 3, 0), 3, &[("b", &[1.0; 5])]).unwrap());
        let after_more = pull_all(&client);
        assert_ne!(after_more, at_checkpoint);
        server.shutdown();

        // Restore from the root (its latest checkpoint).
        let mut config = server_config();
        config.checkpoint_dir = Some(root.clone());
        config.restore = Some(root.clone());
        let server = start(config);
        let client = connect(&server);
        assert_eq!(pull_all(&client), at_checkpoint);
        let status = client.status().unwrap();
        assert_eq!((status.restored_step, status.restored_version, status.version), (5, 2, 2), "{status:?}");
        assert_eq!(status.optimizer.as_ref(), Some(&optimizer));
        assert_eq!(status.mode, PsMode::Async);
        let again = client
            .create_variables(&[(whole("a", &[2, 3]), &a0[..]), (whole("b", &[5]), &b0[..])], &optimizer, PsMode::Async)
            .unwrap();
        assert!(again.existed);
        assert_eq!((again.versions, again.version), (vec![2, 1], 2));
        assert_eq!(pull_all(&client), at_checkpoint, "create on a restored task must not write");
        // The applied-update table came back too: a retry of a checkpointed update is a
        // duplicate; an update made after the checkpoint is new to the restored task.
        assert_eq!(
            client.push(&id("worker:0", 1, 0), 1, &[("a", &[1.0; 6])]).unwrap(),
            PushOutcome::Applied { version: 2, duplicate: true }
        );
        assert_eq!(pull_all(&client), at_checkpoint);
        // Optimizer slots came back: the same two pushes give the values the first run had.
        applied(client.push(&id("worker:0", 2, 0), 2, &[("a", &[3.0; 6]), ("b", &[3.0; 5])]).unwrap());
        applied(client.push(&id("worker:0", 3, 0), 3, &[("b", &[1.0; 5])]).unwrap());
        assert_eq!(pull_all(&client), after_more);
        server.shutdown();

        // Restore from the checkpoint directory itself.
        let mut config = server_config();
        config.restore = Some(path.clone());
        let server = start(config);
        let client = connect(&server);
        assert_eq!(pull_all(&client), at_checkpoint);
        assert_eq!(client.status().unwrap().restored_step, 5);
        applied(client.push(&id("worker:0", 2, 0), 2, &[("a", &[3.0; 6]), ("b", &[3.0; 5])]).unwrap());
        applied(client.push(&id("worker:0", 3, 0), 3, &[("b", &[1.0; 5])]).unwrap());
        assert_eq!(pull_all(&client), after_more);
        server.shutdown();

        // A flipped byte in the tensor data: start fails and names the file.
        let files = safetensors_files(&path);
        assert!(!files.is_empty(), "no safetensors file in {}", path.display());
        let victim = files.iter().find(|f| f.ends_with("model.safetensors")).unwrap_or(&files[0]).clone();
        let mut bytes = std::fs::read(&victim).unwrap();
        let n = bytes.len();
        for b in &mut bytes[n - 4..] {
            *b ^= 0xff;
        }
        std::fs::write(&victim, &bytes).unwrap();
        let mut config = server_config();
        config.restore = Some(root.clone());
        match PsServerHandle::start("127.0.0.1:0".parse().unwrap(), config) {
            Ok(server) => {
                server.shutdown();
                panic!("a task started from a corrupt checkpoint");
            }
            Err(e) => {
                let name = victim.file_name().unwrap().to_string_lossy().to_string();
                assert!(e.to_string().contains(&name), "the error should name {name}: {e}");
            }
        }
    });
}

/// (8) A 5,000,000-element variable travels in many chunks and arrives exactly.
#[test]
fn big_tensors_round_trip_exactly() {
    within_limit("big", || {
        const N: usize = 5_000_000;
        let server = start(server_config());
        let client = connect(&server);
        let initial: Vec<f32> = (0..N).map(|i| i as f32 * 0.5).collect();
        create(&client, &[("big", &[N], &initial)], &ServerOptimizer::Sgd { lr: 1.0 }, PsMode::Async);
        let (_, _, value) = pull1(&client, "big");
        if let Some((i, g, w)) = first_difference(&value, &initial) {
            panic!("element {i} came back as {g}, it was created as {w}");
        }
        assert_eq!(applied(client.push(&id("worker:0", 0, 0), 0, &[("big", &vec![1.0; N])]).unwrap()), 1);
        let expected: Vec<f32> = initial.iter().map(|v| v - 1.0).collect();
        let (version, var_version, value) = pull1(&client, "big");
        assert_eq!((version, var_version), (1, 1));
        if let Some((i, g, w)) = first_difference(&value, &expected) {
            panic!("element {i} is {g} after the push, expected {w}");
        }
        let mut out = vec![0.0f32; N];
        assert_eq!(client.pull_into(&["big"], 1, &mut [&mut out[..]]).unwrap(), 1);
        assert!(first_difference(&out, &expected).is_none());
        // The same update from a buffer handed over (no copy): applied once more, exactly.
        let grad: Vec<f32> = (0..N).map(|i| (i % 5) as f32).collect();
        let shared = F32Bytes::from_vec(grad.clone());
        assert_eq!(shared.len(), N);
        assert_eq!(applied(client.push_shared(&id("worker:0", 1, 0), 1, &[("big", shared)]).unwrap()), 2);
        let expected: Vec<f32> = expected.iter().zip(&grad).map(|(v, g)| v - g).collect();
        assert!(first_difference(&pull1(&client, "big").2, &expected).is_none());
        server.shutdown();
    });
}

/// (9) A pull with a minimum version waits for the push that reaches it.
#[test]
fn a_pull_waits_for_its_minimum_version() {
    within_limit("pull_waits", || {
        let server = start(server_config());
        let client = connect(&server);
        create(&client, &[("w", &[3], &[1.0, 2.0, 3.0])], &ServerOptimizer::Sgd { lr: 1.0 }, PsMode::Async);
        let (tx, rx) = mpsc::channel();
        let puller = {
            let client = client.clone();
            std::thread::spawn(move || {
                let _ = tx.send(client.pull(&["w"], 1));
            })
        };
        // The pull cannot be answered before the version reaches 1.
        if let Ok(early) = rx.recv_timeout(Duration::from_millis(300)) {
            panic!("the pull returned at version 0: {early:?}");
        }
        assert_eq!(applied(client.push(&id("worker:0", 0, 0), 0, &[("w", &[1.0; 3])]).unwrap()), 1);
        let pulled = rx.recv_timeout(Duration::from_secs(30)).unwrap().unwrap();
        puller.join().unwrap();
        assert!(pulled.version >= 1);
        assert_eq!(pulled.variables.len(), 1);
        assert_eq!(pulled.variables[0].1, 1);
        assert_eq!(pulled.variables[0].2, vec![0.0, 1.0, 2.0]);
        server.shutdown();
    });
}

/// A pull whose version never comes ends at the call's deadline.
#[test]
fn a_pull_past_its_deadline_times_out() {
    within_limit("pull_deadline", || {
        let server = start(server_config());
        let config = PsClientConfig { timeout: Duration::from_secs(1), retry_for: Duration::ZERO };
        let client = PsClient::connect(&server.address().to_string(), "ps:0", token(), config).unwrap();
        create(&client, &[("w", &[3], &[1.0, 2.0, 3.0])], &ServerOptimizer::Sgd { lr: 1.0 }, PsMode::Async);
        let e = client.pull(&["w"], 100).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
        // The server still answers.
        assert_eq!(pull1(&client, "w"), (0, 0, vec![1.0, 2.0, 3.0]));
        server.shutdown();
    });
}

/// (10) `pull_into` writes each variable into its buffer, in the order asked for.
#[test]
fn pull_into_writes_the_callers_buffers() {
    within_limit("pull_into", || {
        let server = start(server_config());
        let client = connect(&server);
        create(
            &client,
            &[("a", &[3], &[1.0, 2.0, 3.0]), ("b", &[2, 2], &[10.0, 20.0, 30.0, 40.0])],
            &ServerOptimizer::Sgd { lr: 0.5 },
            PsMode::Async,
        );
        applied(client.push(&id("worker:0", 0, 0), 0, &[("b", &[2.0, 4.0, 6.0, 8.0])]).unwrap());
        let mut a = [f32::NAN; 3];
        let mut b = [f32::NAN; 4];
        let version = client.pull_into(&["b", "a"], 1, &mut [&mut b[..], &mut a[..]]).unwrap();
        assert_eq!(version, 1);
        assert_eq!(a, [1.0, 2.0, 3.0]);
        assert_eq!(b, [9.0, 18.0, 27.0, 36.0]);
        // Buffers of the wrong length or number are errors, not panics.
        let mut short = [0.0f32; 3];
        assert!(client.pull_into(&["b"], 0, &mut [&mut short[..]]).is_err());
        let mut long = [0.0f32; 5];
        assert!(client.pull_into(&["b"], 0, &mut [&mut long[..]]).is_err());
        assert!(client.pull_into(&["a", "b"], 0, &mut [&mut a[..]]).is_err());
        let e = client.pull_into(&["nope"], 0, &mut [&mut a[..]]).unwrap_err();
        assert_eq!(rejected_code(&e), "NotFound", "{e}");
        server.shutdown();
    });
}

/// A task following a warm-up cosine schedule over gRPC: push number `k` (the task's version
/// before it) gives exactly `value - lr(k) * g` under SGD, from 0 at the first step through the
/// peak to the final rate; a retry is no step; a task restored from its checkpoint goes on with
/// the next step's rate (the same bits as the task that never stopped); and a bad schedule is
/// refused with `INVALID_ARGUMENT`, one line naming the field, creating nothing.
#[test]
fn a_scheduled_task_applies_each_steps_rate_and_a_restored_one_continues() {
    within_limit("schedule", || {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("ps0");
        let lr = 3e-3;
        let schedule = LrSchedule::WarmupCosine { peak: lr, warmup_steps: 3, total_steps: 10, final_lr: lr / 10.0 };
        // SGD's own rate (1) is replaced by the schedule's.
        let sgd = ServerOptimizer::Sgd { lr: 1.0 };
        let w0 = [0.5f32, -1.0, 2.0, 0.25];
        let grad = |k: u64| -> Vec<f32> { (0..4).map(|i| (i as f32 - 1.5) * (k as f32 + 1.0) + 0.125).collect() };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let mut config = server_config();
        config.checkpoint_dir = Some(root.clone());
        let server = start(config);
        let client = connect(&server);
        let out =
            client.create_variables_scheduled(&[(whole("w", &[4]), &w0[..])], &sgd, Some(&schedule), PsMode::Async);
        assert!(!out.unwrap().existed);
        let status = client.status().unwrap();
        assert_eq!((status.optimizer.as_ref(), status.schedule.as_ref()), (Some(&sgd), Some(&schedule)));
        let mut value = w0.to_vec();
        let mut values = Vec::new();
        for k in 0..12u64 {
            let g = grad(k);
            assert_eq!(applied(client.push(&id("worker:0", k, 0), k, &[("w", &g)]).unwrap()), k + 1);
            let rate = schedule.at(k) as f32;
            value = value.iter().zip(&g).map(|(w, g)| w - rate * g).collect();
            assert_eq!(bits(&pull1(&client, "w").2), bits(&value), "step {k} at rate {}", schedule.at(k));
            if k == 0 {
                assert_eq!(value, w0, "the warm-up starts at rate 0");
                let retry = client.push(&id("worker:0", 0, 0), 0, &[("w", &g)]).unwrap();
                assert_eq!(retry, PushOutcome::Applied { version: 1, duplicate: true });
            }
            if k == 4 {
                client.checkpoint(5).unwrap();
            }
            values.push(value.clone());
        }
        server.shutdown();

        // Restored at version 5: steps 5.. give the bits the first task had.
        let mut config = server_config();
        config.restore = Some(root.clone());
        let server = start(config);
        let client = connect(&server);
        let status = client.status().unwrap();
        assert_eq!((status.version, status.schedule.as_ref()), (5, Some(&schedule)));
        // The coordinator's create again is answered from the restored task.
        let again =
            client.create_variables_scheduled(&[(whole("w", &[4]), &w0[..])], &sgd, Some(&schedule), PsMode::Async);
        assert!(again.unwrap().existed);
        let e = client.create_variables(&[(whole("w", &[4]), &w0[..])], &sgd, PsMode::Async).unwrap_err();
        assert_eq!(rejected_code(&e), "FailedPrecondition", "{e}");
        for k in 5..12u64 {
            applied(client.push(&id("worker:0", k, 0), k, &[("w", &grad(k))]).unwrap());
            assert_eq!(bits(&pull1(&client, "w").2), bits(&values[k as usize]), "restored, step {k}");
        }
        server.shutdown();

        // A bad schedule: refused, one line naming the field, nothing created.
        let server = start(server_config());
        let client = connect(&server);
        let bad = LrSchedule::WarmupCosine { peak: lr, warmup_steps: 10, total_steps: 10, final_lr: 0.0 };
        let e = client.create_variables_scheduled(&[(whole("w", &[4]), &w0[..])], &sgd, Some(&bad), PsMode::Async);
        let e = e.unwrap_err();
        assert_eq!(rejected_code(&e), "InvalidArgument", "{e}");
        let message = e.to_string();
        assert!(!message.contains('\n'), "{message}");
        assert!(
            message.ends_with(
                "warmup_cosine learning-rate schedule: total_steps 10 with warmup_steps 10: the decay must end after the warm-up; use more total_steps than warmup_steps"
            ),
            "{message}"
        );
        let status = client.status().unwrap();
        assert!(status.variables.is_empty() && status.optimizer.is_none() && status.schedule.is_none());
        server.shutdown();
    });
}
