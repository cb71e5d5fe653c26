//! Every gRPC service of the transport under hostile input: random bytes (random framing, and
//! well-framed random messages) and valid messages with extreme sizes, offsets, counts, names
//! and non-finite values, a few thousand calls per service from a seeded generator. Every call
//! gets a gRPC status (none is INTERNAL or UNKNOWN: the server's own failures are not what bad
//! input causes), undecodable requests get INVALID_ARGUMENT, the process lives on, the health
//! check answers SERVING afterwards and a well-formed client is still served correctly.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::BodyExt;
use prost::bytes::Bytes;
use prost::Message;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use strata_proto::v1 as proto;
use strata_transport::executor::{StepFailure, StepHandler, WorkerClient, WorkerExecutorHandle};
use strata_transport::ps::{
    PsClient, PsClientConfig, PsMode, PsServerConfig, PsServerHandle, ServerOptimizer, UpdateId, VariableInfo,
};
use strata_transport::{ClusterToken, CoordinationConfig, CoordinationServerHandle};
use tonic::codegen::Service;
use tonic::transport::Channel;
use tonic::Code;

use crate::common::within_limit;

const TOKEN: &str = "0123456789abcdef0123456789abcdef";

fn token() -> ClusterToken {
    ClusterToken::new(TOKEN).unwrap()
}

/// A gRPC message frame: no compression, the length, the bytes.
fn frame(message: &[u8]) -> Vec<u8> {
    let mut f = vec![0u8];
    f.extend_from_slice(&(message.len() as u32).to_be_bytes());
    f.extend_from_slice(message);
    f
}

fn frames(messages: &[Vec<u8>]) -> Bytes {
    Bytes::from(messages.iter().flat_map(|m| frame(m)).collect::<Vec<u8>>())
}

/// Bytes that are no protobuf message: a field tag of wire type 7, which does not exist.
const UNDECODABLE: [u8; 3] = [0x0f, 0x01, 0x02];

/// One call over HTTP/2 with `body` as it is: the status code and message the server answered.
/// Panics when no gRPC status comes back (a broken connection, a crashed server).
async fn call(channel: &mut Channel, path: &str, body: Bytes, timeout_ms: u64) -> (Code, String) {
    let body_copy = body.clone();
    let request = tonic::codegen::http::Request::builder()
        .method("POST")
        .uri(path)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("authorization", format!("Bearer {TOKEN}"))
        .header("grpc-timeout", format!("{timeout_ms}m"))
        .body(tonic::body::Body::new(http_body_util::Full::new(body)))
        .unwrap();
    std::future::poll_fn(|cx| channel.poll_ready(cx)).await.expect("the connection is ready");
    let response = tokio::time::timeout(Duration::from_millis(timeout_ms + 10_000), channel.call(request))
        .await
        .unwrap_or_else(|_| panic!("{path}: no answer at all"));
    let response = match response {
        Ok(r) => r,
        // The channel ends the call at the deadline it sends (the server ends it there too).
        Err(e) if format!("{e:?}").contains("TimeoutExpired") => {
            return (Code::DeadlineExceeded, "the call's deadline passed".into())
        }
        Err(e) => panic!(
            "{path}: the call failed below gRPC: {e:?} ({} bytes: {:?})",
            body_copy.len(),
            &body_copy[..body_copy.len().min(80)]
        ),
    };
    if let Some(s) = tonic::Status::from_header_map(response.headers()) {
        return (s.code(), s.message().to_string());
    }
    let collected = tokio::time::timeout(Duration::from_millis(timeout_ms + 10_000), response.into_body().collect())
        .await
        .unwrap_or_else(|_| panic!("{path}: the answer never ended"))
        .unwrap_or_else(|e| panic!("{path}: the answer broke off: {e}"));
    let trailers = collected.trailers().cloned().unwrap_or_default();
    let s = tonic::Status::from_header_map(&trailers).unwrap_or_else(|| panic!("{path}: an answer without a status"));
    (s.code(), s.message().to_string())
}

/// Random bytes of random length: sometimes a framing, mostly not.
fn random_bytes(rng: &mut StdRng, max: usize) -> Vec<u8> {
    let n = rng.random_range(0..=max);
    (0..n).map(|_| rng.random()).collect()
}

/// A string of one of the lengths that matter: empty, short, at and over 256 bytes, 10 KiB.
fn name(rng: &mut StdRng) -> String {
    match rng.random_range(0..8) {
        0 => String::new(),
        1 => "x".repeat(256),
        2 => "x".repeat(257),
        3 => "n".repeat(10 << 10),
        4 => "w".into(),
        5 => "big".into(),
        6 => "\u{1F600}é\0".into(),
        _ => format!("v{}", rng.random_range(0..4)),
    }
}

/// A u64 at an edge: 0, 1, small, 2^31, 2^32, 2^40, near u64::MAX, random.
fn extreme_u64(rng: &mut StdRng) -> u64 {
    match rng.random_range(0..9) {
        0 => 0,
        1 => 1,
        2 => rng.random_range(0..8),
        3 => 1 << 31,
        4 => 1 << 32,
        5 => 1 << 40,
        6 => u64::MAX,
        7 => u64::MAX - rng.random_range(0..4),
        _ => rng.random(),
    }
}

/// A `WireFormat` value: mostly a known one (f32, f16, bf16), sometimes none a server knows.
fn wire_format(rng: &mut StdRng) -> i32 {
    match rng.random_range(0..8) {
        0..=3 => 0,
        4 => 1,
        5 => 2,
        6 => 3,
        _ => rng.random(),
    }
}

fn extreme_u32(rng: &mut StdRng) -> u32 {
    match rng.random_range(0..6) {
        0 => 0,
        1 => 1,
        2 => rng.random_range(0..5),
        3 => u32::MAX,
        4 => 1 << 20,
        _ => rng.random(),
    }
}

fn extreme_f64(rng: &mut StdRng) -> f64 {
    [0.0, -1.0, 0.5, 1.0, 1e308, f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 1e-300][rng.random_range(0..9)]
}

fn extreme_f32s(rng: &mut StdRng) -> Vec<u8> {
    let n = match rng.random_range(0..6) {
        0 => 0,
        1 => 4,
        2 => 3,
        3 => rng.random_range(0..64),
        4 => 262_144,
        _ => 300_000,
    };
    let mut v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
    if !v.is_empty() && rng.random_bool(0.5) {
        let at = rng.random_range(0..v.len());
        v[at] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][rng.random_range(0..3)];
    }
    let mut bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    if rng.random_bool(0.1) {
        bytes.push(7); // not whole elements
    }
    bytes
}

fn shape(rng: &mut StdRng) -> Vec<u64> {
    match rng.random_range(0..6) {
        0 => vec![],
        1 => vec![4],
        2 => vec![1 << 40],
        3 => vec![u64::MAX, 2],
        4 => vec![1; 40],
        _ => (0..rng.random_range(0..4)).map(|_| extreme_u64(rng) % 70_000).collect(),
    }
}

fn variable_spec(rng: &mut StdRng) -> proto::VariableSpec {
    proto::VariableSpec {
        name: name(rng),
        shape: shape(rng),
        dtype: ["f32", "f32", "f64", "", "x"][rng.random_range(0..5)].to_string(),
        variable: if rng.random_bool(0.5) { String::new() } else { name(rng) },
        part: extreme_u32(rng),
        num_parts: extreme_u32(rng),
        row_offset: extreme_u64(rng),
        full_shape: if rng.random_bool(0.5) { vec![] } else { shape(rng) },
        state: rng.random_bool(0.5),
    }
}

fn table_spec(rng: &mut StdRng) -> proto::TableSpec {
    let small =
        |rng: &mut StdRng, hi: u64| if rng.random_bool(0.7) { rng.random_range(0..hi) } else { extreme_u64(rng) };
    proto::TableSpec {
        name: if rng.random_bool(0.7) { "emb".into() } else { name(rng) },
        dim: small(rng, 9),
        rows: small(rng, 100),
        max_rows_per_shard: if rng.random_bool(0.5) { 0 } else { small(rng, 50) },
        evict_after: small(rng, 5),
        init: rng.random_bool(0.8).then(|| proto::RowInitSpec {
            kind: ["zeros", "uniform", "normal", "nope"][rng.random_range(0..4)].to_string(),
            low: extreme_f64(rng) as f32,
            high: extreme_f64(rng) as f32,
            std: extreme_f64(rng) as f32,
        }),
        seed: extreme_u64(rng),
        shard: small(rng, 3) as u32,
        num_shards: small(rng, 3) as u32,
        optimizer: rng.random_bool(0.8).then(|| proto::RowOptimizerSpec {
            kind: ["sgd", "adagrad", "ftrl", "lazy_adam", "nope"][rng.random_range(0..5)].to_string(),
            learning_rate: extreme_f64(rng),
            initial_accumulator: extreme_f64(rng),
            epsilon: extreme_f64(rng),
            lr_power: extreme_f64(rng),
            l1: extreme_f64(rng),
            l2: extreme_f64(rng),
            beta: extreme_f64(rng),
            beta1: extreme_f64(rng),
            beta2: extreme_f64(rng),
        }),
    }
}

/// Rows of a table as a push or a pull names them: ids few or many, in range or extreme,
/// repeated now and then.
fn rows_spec(rng: &mut StdRng) -> proto::RowsSpec {
    let n = if rng.random_bool(0.05) { 200_000 } else { rng.random_range(0..6) };
    let ids = (0..n).map(|_| if rng.random_bool(0.8) { rng.random_range(0..120) } else { extreme_u64(rng) }).collect();
    proto::RowsSpec {
        table: if rng.random_bool(0.8) { "emb".into() } else { name(rng) },
        lease: extreme_u64(rng) % 4,
        ids,
    }
}

fn optimizer_spec(rng: &mut StdRng) -> proto::OptimizerSpec {
    proto::OptimizerSpec {
        kind: ["sgd", "adamw", "momentum", "adagrad", "nope", ""][rng.random_range(0..6)].to_string(),
        stale_rate: ["", "constant", "inverse", "nope"][rng.random_range(0..4)].to_string(),
        learning_rate: extreme_f64(rng),
        momentum: extreme_f64(rng),
        nesterov: rng.random(),
        beta1: extreme_f64(rng),
        beta2: extreme_f64(rng),
        epsilon: extreme_f64(rng),
        weight_decay: extreme_f64(rng),
        initial_accumulator: extreme_f64(rng),
        schedule: rng.random_bool(0.5).then(|| schedule_spec(rng)),
    }
}

fn schedule_spec(rng: &mut StdRng) -> proto::LrScheduleSpec {
    proto::LrScheduleSpec {
        kind: ["constant", "warmup_cosine", "warmup_linear", "nope", ""][rng.random_range(0..5)].to_string(),
        lr: extreme_f64(rng),
        peak: extreme_f64(rng),
        warmup_steps: extreme_u64(rng),
        total_steps: extreme_u64(rng),
        final_lr: extreme_f64(rng),
    }
}

fn mode_spec(rng: &mut StdRng) -> proto::ModeSpec {
    proto::ModeSpec {
        mode: ["async", "sync", "stale", "", "bogus"][rng.random_range(0..5)].to_string(),
        workers: extreme_u32(rng),
        backup_workers: extreme_u32(rng),
        staleness: extreme_u64(rng),
    }
}

fn chunk(rng: &mut StdRng) -> proto::TensorChunk {
    proto::TensorChunk {
        variable: if rng.random_bool(0.7) { rng.random_range(0..2) } else { extreme_u32(rng) },
        offset: if rng.random_bool(0.6) { 0 } else { extreme_u64(rng) },
        data: Bytes::from(extreme_f32s(rng)),
    }
}

/// A push header of random fields: the variables, the update's identity, its rows.
fn push_header(rng: &mut StdRng) -> proto::PushHeader {
    let variables = match rng.random_range(0..5) {
        0 => vec![],
        1 => vec!["w".to_string(), "w".to_string()],
        2 => (0..1000).map(|i| format!("v{i}")).collect(),
        3 => vec![name(rng)],
        _ => vec!["w".to_string()],
    };
    proto::PushHeader {
        worker: if rng.random_bool(0.7) { "worker:0".into() } else { name(rng) },
        client: if rng.random_bool(0.7) { "fuzz".into() } else { name(rng) },
        step: extreme_u64(rng),
        seq: extreme_u64(rng),
        base_version: if rng.random_bool(0.7) { 0 } else { extreme_u64(rng) },
        variables,
        wire_format: wire_format(rng),
        rows: if rng.random_bool(0.2) {
            (0..rng.random_range(1..3)).map(|_| rows_spec(rng)).collect()
        } else {
            Vec::new()
        },
    }
}

/// The parameter server's methods and a request for each, valid protobuf with extreme values.
fn ps_request(rng: &mut StdRng) -> (&'static str, Bytes, u64) {
    use proto::{create_message, push_message, CreateMessage, PushMessage};
    let chunks = |rng: &mut StdRng, n: usize| -> Vec<proto::TensorChunk> { (0..n).map(|_| chunk(rng)).collect() };
    match rng.random_range(0..8) {
        0 => {
            let header = proto::CreateHeader {
                variables: (0..rng.random_range(0..4)).map(|_| variable_spec(rng)).collect(),
                optimizer: rng.random_bool(0.8).then(|| optimizer_spec(rng)),
                mode: rng.random_bool(0.8).then(|| mode_spec(rng)),
                wire_format: wire_format(rng),
                // Now and then tables too (mostly a plain create, which the pushes below need).
                tables: if rng.random_bool(0.3) {
                    (0..rng.random_range(1..3)).map(|_| table_spec(rng)).collect()
                } else {
                    Vec::new()
                },
            };
            let mut messages = Vec::new();
            if rng.random_bool(0.9) {
                messages.push(CreateMessage { kind: Some(create_message::Kind::Header(header)) }.encode_to_vec());
            }
            let n = rng.random_range(0..3);
            for c in chunks(rng, n) {
                messages.push(CreateMessage { kind: Some(create_message::Kind::Chunk(c)) }.encode_to_vec());
            }
            ("/strata.v1.ParameterServer/CreateVariables", frames(&messages), 3000)
        }
        1 | 2 => {
            let header = push_header(rng);
            let mut messages = Vec::new();
            if rng.random_bool(0.9) {
                messages.push(PushMessage { kind: Some(push_message::Kind::Header(header)) }.encode_to_vec());
            }
            let n = rng.random_range(0..3);
            for c in chunks(rng, n) {
                messages.push(PushMessage { kind: Some(push_message::Kind::Chunk(c)) }.encode_to_vec());
            }
            ("/strata.v1.ParameterServer/Push", frames(&messages), 3000)
        }
        3 => {
            let huge = rng.random_bool(0.05);
            let request = proto::PullRequest {
                variables: (0..rng.random_range(0..3)).map(|_| name(rng)).collect(),
                min_version: if huge { extreme_u64(rng).max(1 << 20) } else { rng.random_range(0..2) },
                wire_format: wire_format(rng),
            };
            // A pull that waits for a version never reached ends at its deadline.
            ("/strata.v1.ParameterServer/Pull", frames(&[request.encode_to_vec()]), if huge { 50 } else { 3000 })
        }
        4 => {
            let request = proto::PsConfigureRequest { live_workers: extreme_u32(rng) };
            ("/strata.v1.ParameterServer/Configure", frames(&[request.encode_to_vec()]), 3000)
        }
        6 => {
            let request = proto::PullRowsRequest {
                worker: if rng.random_bool(0.7) { "worker:0".into() } else { name(rng) },
                lease: extreme_u64(rng) % 4,
                tables: (0..rng.random_range(0..3)).map(|_| rows_spec(rng)).collect(),
                wire_format: wire_format(rng),
                // A push carried with the pull, or stray chunks without one.
                push: rng.random_bool(0.3).then(|| push_header(rng)),
                push_chunks: match rng.random_range(0..3) {
                    0 => Vec::new(),
                    n => chunks(rng, n),
                },
            };
            ("/strata.v1.ParameterServer/PullRows", frames(&[request.encode_to_vec()]), 3000)
        }
        5 => {
            let request = proto::PsCheckpointRequest { step: extreme_u64(rng), num_tasks: rng.random() };
            ("/strata.v1.ParameterServer/Checkpoint", frames(&[request.encode_to_vec()]), 5000)
        }
        _ => ("/strata.v1.ParameterServer/Status", frames(&[proto::PsStatusRequest {}.encode_to_vec()]), 3000),
    }
}

const PS_PATHS: [&str; 7] = [
    "/strata.v1.ParameterServer/PullRows",
    "/strata.v1.ParameterServer/CreateVariables",
    "/strata.v1.ParameterServer/Push",
    "/strata.v1.ParameterServer/Pull",
    "/strata.v1.ParameterServer/Configure",
    "/strata.v1.ParameterServer/Checkpoint",
    "/strata.v1.ParameterServer/Status",
];

/// What the fuzzing saw.
#[derive(Default, Debug)]
struct Tally {
    calls: usize,
    codes: BTreeMap<String, usize>,
}

impl Tally {
    fn add(&mut self, path: &str, (code, message): &(Code, String)) {
        self.calls += 1;
        *self.codes.entry(format!("{code:?}")).or_default() += 1;
        assert!(
            !matches!(code, Code::Internal | Code::Unknown | Code::Unavailable),
            "{path}: answered {code:?}: {message}"
        );
    }
}

/// Drives `calls` calls of random bytes, well-framed random messages, undecodable messages and
/// `valid(rng)` requests at the server on `addr`; checks every answer.
async fn fuzz(
    addr: SocketAddr,
    seed: u64,
    calls: usize,
    paths: &[&'static str],
    valid: impl Fn(&mut StdRng) -> (&'static str, Bytes, u64),
) -> Tally {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut channel = Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
    let mut tally = Tally::default();
    for _ in 0..calls {
        let path = paths[rng.random_range(0..paths.len())];
        let answer = match rng.random_range(0..10) {
            // Random bytes: a broken framing (or, by chance, a valid one).
            0 | 1 => {
                let bytes = random_bytes(&mut rng, 64);
                let answer = call(&mut channel, path, Bytes::from(bytes.clone()), 2000).await;
                if bytes.first().is_some_and(|&flag| flag > 1) && bytes.len() >= 5 {
                    assert_eq!(
                        answer.0,
                        Code::InvalidArgument,
                        "{path} with compression flag {}: {answer:?}",
                        bytes[0]
                    );
                }
                answer
            }
            // A well-framed message of random bytes (protobuf decodes many of them).
            2 | 3 => call(&mut channel, path, frames(&[random_bytes(&mut rng, 96)]), 2000).await,
            // A message that is no protobuf: always INVALID_ARGUMENT.
            4 => {
                let answer = call(&mut channel, path, frames(&[UNDECODABLE.to_vec()]), 2000).await;
                assert_eq!(answer.0, Code::InvalidArgument, "{path}, undecodable: {answer:?}");
                assert!(["decode", "protobuf", "wire type"].iter().any(|w| answer.1.contains(w)), "{answer:?}");
                answer
            }
            // A frame announcing more bytes than it carries: cut off.
            5 => {
                let mut cut = frame(&[8, 1, 16, 2]);
                cut[4] = 40;
                let answer = call(&mut channel, path, Bytes::from(cut), 2000).await;
                assert_eq!(answer.0, Code::InvalidArgument, "{path}, a message cut off: {answer:?}");
                answer
            }
            _ => {
                let (path, body, timeout) = valid(&mut rng);
                let answer = call(&mut channel, path, body, timeout).await;
                tally.add(path, &answer);
                continue;
            }
        };
        tally.add(path, &answer);
    }
    tally
}

/// Asks the health service whether `service` is SERVING.
async fn serving(addr: SocketAddr, service: &str) -> bool {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let channel = Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
    let mut health = HealthClient::with_interceptor(channel, strata_transport::auth::client_interceptor(token()));
    let answer = health.check(HealthCheckRequest { service: service.into() }).await.unwrap().into_inner();
    answer.status == ServingStatus::Serving as i32
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

#[test]
fn the_parameter_server_survives_hostile_requests() {
    within_limit("ps fuzz", || {
        let dir = tempfile::tempdir().unwrap();
        let mut config = PsServerConfig::new("ps:0", token());
        config.checkpoint_dir = Some(dir.path().to_path_buf());
        config.keep_checkpoints = 1;
        config.round_timeout = Duration::from_millis(200);
        let server = PsServerHandle::start("127.0.0.1:0".parse().unwrap(), config).unwrap();
        let addr = server.address();
        let client = PsClient::connect(&addr.to_string(), "ps:0", token(), PsClientConfig::default()).unwrap();
        let sgd = ServerOptimizer::Sgd { lr: 0.5 };
        let big = vec![0.25f32; 300_000];
        client
            .create_variables(
                &[
                    (VariableInfo::whole("w", vec![4]), &[1.0, 2.0, 3.0, 4.0][..]),
                    (VariableInfo::whole("big", vec![300_000]), &big[..]),
                ],
                &sgd,
                PsMode::Async,
            )
            .unwrap();
        let tally = runtime().block_on(fuzz(addr, 17, 2500, &PS_PATHS, ps_request));
        eprintln!("ps fuzz: {tally:?}");
        assert_eq!(tally.calls, 2500);
        assert!(tally.codes.get("InvalidArgument").copied().unwrap_or(0) > 500, "{tally:?}");
        assert!(runtime().block_on(serving(addr, "strata.v1.ParameterServer")));
        // A well-formed client is served, and nothing of the hostile pushes was applied to w
        // unless it was a valid update: w's values are finite.
        let status = client.status().unwrap();
        let pulled = client.pull(&["w", "big"], 0).unwrap();
        assert!(
            pulled.variables.iter().all(|(_, _, v)| v.iter().all(|x| x.is_finite())),
            "a non-finite value was applied"
        );
        let id = UpdateId { worker: "worker:1".into(), client: "after-fuzz".into(), step: 0, seq: 0 };
        let before = client.pull(&["w"], 0).unwrap().variables[0].2.clone();
        client.push(&id, status.version, &[("w", &[2.0; 4][..])]).unwrap();
        let after = client.pull(&["w"], 0).unwrap().variables[0].2.clone();
        let want: Vec<f32> = before.iter().map(|x| x - 1.0).collect();
        assert_eq!(after, want, "the task applies a valid push after the fuzzing");
        server.shutdown();
    });
}

/// A step handler that decodes its arguments as a model size and refuses absurd ones, as the
/// digits step does.
struct Sized;

impl StepHandler for Sized {
    fn functions(&self) -> Vec<String> {
        vec!["build".into()]
    }

    fn run(&self, function: &str, _step: u64, _client: &str, args: &[u8]) -> Result<Vec<u8>, StepFailure> {
        if function != "build" {
            return Err(StepFailure::NotFound(function.into()));
        }
        let units: u64 = serde_json::from_slice(args).map_err(|e| StepFailure::InvalidArgument(e.to_string()))?;
        if units > 1 << 16 {
            return Err(StepFailure::InvalidArgument(format!("{units} units, over the limit of 65536")));
        }
        let mut v = Vec::new();
        v.try_reserve_exact(units as usize).map_err(|e| StepFailure::Failed(e.to_string()))?;
        v.resize(units as usize, 1u8);
        Ok(serde_json::to_vec(&v.len()).unwrap_or_default())
    }
}

fn executor_request(rng: &mut StdRng) -> (&'static str, Bytes, u64) {
    match rng.random_range(0..4) {
        0 => ("/strata.v1.WorkerExecutor/Ping", frames(&[proto::WorkerPingRequest {}.encode_to_vec()]), 3000),
        _ => {
            let args = match rng.random_range(0..5) {
                0 => extreme_u64(rng).to_string().into_bytes(),
                1 => random_bytes(rng, 64),
                2 => b"-1".to_vec(),
                3 => vec![b'9'; 5000],
                _ => rng.random_range(0..100u64).to_string().into_bytes(),
            };
            let request = proto::RunStepRequest {
                function: if rng.random_bool(0.7) { "build".into() } else { name(rng) },
                step: extreme_u64(rng),
                client: if rng.random_bool(0.8) { "fuzz".into() } else { name(rng) },
                args: Bytes::from(args),
            };
            ("/strata.v1.WorkerExecutor/RunStep", frames(&[request.encode_to_vec()]), 3000)
        }
    }
}

#[test]
fn the_worker_executor_survives_hostile_requests() {
    within_limit("executor fuzz", || {
        let server =
            WorkerExecutorHandle::start("127.0.0.1:0".parse().unwrap(), "worker:0".into(), token(), Arc::new(Sized))
                .unwrap();
        let addr = server.address();
        let paths = ["/strata.v1.WorkerExecutor/RunStep", "/strata.v1.WorkerExecutor/Ping"];
        let tally = runtime().block_on(fuzz(addr, 23, 2500, &paths, executor_request));
        eprintln!("executor fuzz: {tally:?}");
        assert_eq!(tally.calls, 2500);
        assert!(runtime().block_on(serving(addr, "strata.v1.WorkerExecutor")));
        // A request over the size limit is refused naming the limit.
        let over = proto::RunStepRequest {
            function: "build".into(),
            args: Bytes::from(vec![b' '; strata_transport::executor::MAX_ARGS_BYTES + 1]),
            ..Default::default()
        };
        let (code, message) = runtime().block_on(async {
            let mut channel = Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
            call(&mut channel, "/strata.v1.WorkerExecutor/RunStep", frames(&[over.encode_to_vec()]), 5000).await
        });
        assert_eq!(code, Code::InvalidArgument, "{message}");
        assert!(
            message.contains(&format!("the limit is: {} bytes", strata_transport::executor::MAX_ARGS_BYTES)),
            "{message}"
        );
        let c = WorkerClient::connect(&addr.to_string(), "worker:0", token(), Duration::from_secs(10)).unwrap();
        assert_eq!(c.run_step("build", 1, "after-fuzz", b"1000").unwrap(), b"1000");
        let e = c.run_step("build", 2, "after-fuzz", b"1099511627776").unwrap_err().to_string();
        assert!(e.contains("InvalidArgument") && e.contains("over the limit of 65536"), "{e}");
        server.shutdown();
    });
}

fn task_name(rng: &mut StdRng) -> Option<proto::TaskName> {
    rng.random_bool(0.9).then(|| proto::TaskName {
        r#type: ["worker", "chief", "ps", "", "w"][rng.random_range(0..5)].to_string()
            + if rng.random_bool(0.1) { "x".repeat(100) } else { String::new() }.as_str(),
        index: if rng.random_bool(0.8) { rng.random_range(0..3) } else { extreme_u32(rng) },
    })
}

/// A valid coordination request of a kind drawn from `kinds` (0: Register, 1: Barrier, 2: SetKey,
/// 3: GetKey, 4: ReportError, 5: Leave).
fn coordination_request(rng: &mut StdRng, kinds: std::ops::Range<u32>) -> (&'static str, Bytes, u64) {
    let bytes = |rng: &mut StdRng| -> Vec<u8> {
        match rng.random_range(0..4) {
            0 => vec![],
            1 => vec![1; 64 << 10],
            2 => vec![2; (64 << 10) + 1],
            _ => random_bytes(rng, 32),
        }
    };
    let text = |rng: &mut StdRng| -> String {
        match rng.random_range(0..4) {
            0 => "x".repeat(5000),
            1 => "y".repeat(70 << 10),
            _ => name(rng),
        }
    };
    match rng.random_range(kinds) {
        0 => {
            let r = proto::RegisterRequest {
                task: task_name(rng),
                cluster_fingerprint: if rng.random_bool(0.5) { "cluster-f".into() } else { text(rng) },
                strategy_fingerprint: if rng.random_bool(0.5) { "strategy-f".into() } else { text(rng) },
                data_address: if rng.random_bool(0.5) { "127.0.0.1:1".into() } else { text(rng) },
                // One incarnation: a task registered twice by two processes fails the job, as
                // it must (any holder of the token can fail a job, by design).
                incarnation: 7,
            };
            // Registration waits for the other tasks: a short deadline.
            ("/strata.v1.Coordination/Register", frames(&[r.encode_to_vec()]), 100)
        }
        1 => {
            let r =
                proto::BarrierRequest { task: task_name(rng), name: text(rng), timeout_ms: rng.random_range(0..30) };
            ("/strata.v1.Coordination/Barrier", frames(&[r.encode_to_vec()]), 200)
        }
        2 => {
            let r = proto::SetKeyRequest { key: text(rng), value: bytes(rng) };
            ("/strata.v1.Coordination/SetKey", frames(&[r.encode_to_vec()]), 2000)
        }
        3 => {
            let r = proto::GetKeyRequest { key: text(rng), timeout_ms: rng.random_range(0..20) };
            ("/strata.v1.Coordination/GetKey", frames(&[r.encode_to_vec()]), 200)
        }
        4 => {
            // Not the job's task names: a real task's report would fail the job.
            let r = proto::ReportErrorRequest {
                task: Some(proto::TaskName { r#type: "nobody".into(), index: rng.random_range(0..3) }),
                message: text(rng),
                incarnation: rng.random(),
            };
            ("/strata.v1.Coordination/ReportError", frames(&[r.encode_to_vec()]), 2000)
        }
        _ => {
            let r = proto::LeaveRequest {
                task: Some(proto::TaskName { r#type: "nobody".into(), index: 0 }),
                incarnation: extreme_u64(rng),
                stop_code: rng.random(),
                job_goes_on: rng.random(),
            };
            ("/strata.v1.Coordination/Leave", frames(&[r.encode_to_vec()]), 2000)
        }
    }
}

#[test]
fn the_coordination_service_survives_hostile_requests() {
    within_limit("coordination fuzz", || {
        let config =
            CoordinationConfig { rendezvous_timeout: Duration::from_secs(600), ..CoordinationConfig::default() };
        let names = vec!["worker:0".to_string(), "worker:1".to_string()];
        let server = CoordinationServerHandle::start(
            "127.0.0.1:0".parse().unwrap(),
            names,
            "cluster-f".into(),
            "strategy-f".into(),
            token(),
            config,
        )
        .unwrap();
        let addr = server.address();
        // Every service but Register: no call of these may fail the job. (A well-formed
        // registration refused for its fingerprints fails the rendezvous by design, so that the
        // chief names the misconfigured task at once: Register is fuzzed on its own below.)
        let paths = [
            "/strata.v1.Coordination/Barrier",
            "/strata.v1.Coordination/SetKey",
            "/strata.v1.Coordination/GetKey",
            "/strata.v1.Coordination/ReportError",
            "/strata.v1.Coordination/Leave",
        ];
        let tally = runtime().block_on(fuzz(addr, 29, 2000, &paths, |rng| coordination_request(rng, 1..6)));
        eprintln!("coordination fuzz: {tally:?}");
        assert_eq!(tally.calls, 2000);
        assert!(runtime().block_on(serving(addr, "strata.v1.Coordination")));
        // Registrations over a limit, or that name no task, are refused without failing the job.
        runtime().block_on(async {
            let mut channel = Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
            let task = || Some(proto::TaskName { r#type: "worker".into(), index: 1 });
            let r = proto::RegisterRequest {
                task: task(),
                cluster_fingerprint: "c".repeat(70 << 10),
                strategy_fingerprint: "strategy-f".into(),
                data_address: "127.0.0.1:1".into(),
                incarnation: 7,
            };
            let (code, message) =
                call(&mut channel, "/strata.v1.Coordination/Register", frames(&[r.encode_to_vec()]), 2000).await;
            assert_eq!(code, Code::InvalidArgument);
            assert_eq!(message, "a cluster fingerprint of 71680 bytes is over the limit of 65536 bytes");
            let r =
                proto::RegisterRequest { task: None, cluster_fingerprint: "cluster-f".into(), ..Default::default() };
            let (code, _) =
                call(&mut channel, "/strata.v1.Coordination/Register", frames(&[r.encode_to_vec()]), 2000).await;
            assert_eq!(code, Code::InvalidArgument);
            let r = proto::RegisterRequest { task: task(), data_address: "a".repeat(600), ..Default::default() };
            let (code, _) =
                call(&mut channel, "/strata.v1.Coordination/Register", frames(&[r.encode_to_vec()]), 2000).await;
            assert_eq!(code, Code::InvalidArgument);
        });
        // The limits are named in the refusals, and the job is still usable: no hostile call
        // failed it.
        let (code, message) = runtime().block_on(async {
            let mut channel = Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
            let r = proto::SetKeyRequest { key: "k".repeat(300), value: Vec::new() };
            call(&mut channel, "/strata.v1.Coordination/SetKey", frames(&[r.encode_to_vec()]), 2000).await
        });
        assert_eq!(code, Code::InvalidArgument);
        assert_eq!(message, "a key of 300 bytes is over the limit of 256 bytes");
        assert_eq!(server.error(), None, "a hostile call failed the job");
        let member = strata_transport::CoordinationMember::connect(
            &addr.to_string(),
            "worker:0",
            "worker:0",
            token(),
            CoordinationConfig::default(),
        )
        .unwrap();
        member.set_key("after-fuzz", b"v").unwrap();
        assert_eq!(member.get_key("after-fuzz", Duration::from_secs(5)).unwrap(), b"v");
        drop(server);

        // Register alone, on a job of its own: every call gets a status, the service serves
        // afterwards, and the job fails, if at all, only with a refusal at rendezvous.
        let server = CoordinationServerHandle::start(
            "127.0.0.1:0".parse().unwrap(),
            vec!["worker:0".to_string(), "worker:1".to_string()],
            "cluster-f".into(),
            "strategy-f".into(),
            token(),
            CoordinationConfig { rendezvous_timeout: Duration::from_secs(600), ..CoordinationConfig::default() },
        )
        .unwrap();
        let addr = server.address();
        let tally = runtime().block_on(fuzz(addr, 31, 500, &["/strata.v1.Coordination/Register"], |rng| {
            coordination_request(rng, 0..1)
        }));
        eprintln!("register fuzz: {tally:?}, the job's error: {:?}", server.error());
        assert_eq!(tally.calls, 500);
        assert!(runtime().block_on(serving(addr, "strata.v1.Coordination")));
        if let Some(e) = server.error() {
            assert!(e.starts_with("rendezvous failed: task "), "{e}");
        }
    });
}
