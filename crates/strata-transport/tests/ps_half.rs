//! Pushes and pulls in 16 bits (f16 and bf16) over real gRPC on loopback: a 16-bit push is
//! decoded exactly and applied in f32, a 16-bit pull is the task's f32 values rounded to
//! nearest even, f32 and 16-bit clients share a task, and hostile 16-bit requests (unknown
//! formats, odd byte lengths, offsets and lengths that do not fit) are refused with their
//! message and change nothing. Every test runs its body in a thread with a hard limit.

use std::net::SocketAddr;
use std::time::Duration;

use prost::bytes::Bytes;
use strata_core::cross_device::compression::HalfFormat;
use strata_proto::v1::parameter_server_client::ParameterServerClient;
use strata_proto::v1::{push_message, PullRequest, PushHeader, PushMessage, PushResponse, TensorChunk};
use strata_transport::auth::{client_interceptor, ClientAuth};
use strata_transport::ps::{
    PsClient, PsClientConfig, PsMode, PsServerConfig, PsServerHandle, PushOutcome, ServerOptimizer, UpdateId,
    VariableInfo, WireFormat, MAX_CHUNK_ELEMENTS,
};
use strata_transport::ClusterToken;
use tonic::codegen::InterceptedService;
use tonic::transport::Channel;

use crate::common::within_limit;

const TOKEN: &str = "0123456789abcdef0123456789abcdef";

fn token() -> ClusterToken {
    ClusterToken::new(TOKEN).unwrap()
}

fn start(stream_min_bytes: Option<usize>) -> PsServerHandle {
    let mut config = PsServerConfig::new("ps:0", token());
    config.round_timeout = Duration::from_secs(30);
    config.stream_min_bytes = stream_min_bytes;
    PsServerHandle::start("127.0.0.1:0".parse().unwrap(), config).unwrap()
}

fn connect(server: &PsServerHandle) -> PsClient {
    let config = PsClientConfig { timeout: Duration::from_secs(30), retry_for: Duration::from_secs(30) };
    PsClient::connect(&server.address().to_string(), "ps:0", token(), config).unwrap()
}

fn id(worker: &str, step: u64) -> UpdateId {
    UpdateId { worker: worker.to_string(), client: worker.to_string(), step, seq: 0 }
}

fn half(format: WireFormat) -> HalfFormat {
    format.half().unwrap()
}

/// `decode(encode(values))`: what a value becomes on a 16-bit wire.
fn round_trip(values: &[f32], format: HalfFormat) -> Vec<f32> {
    let mut bits = vec![0u16; values.len()];
    format.encode(values, &mut bits);
    let mut out = vec![0f32; values.len()];
    format.decode(&bits, &mut out);
    out
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// Creates `w` on a fresh task, with SGD at rate 1 (an update is `p - g`, exactly) in `mode`.
fn create_w(client: &PsClient, p0: &[f32], mode: PsMode) {
    let w = VariableInfo::whole("w", vec![p0.len()]);
    let out = client.create_variables(&[(w, p0)], &ServerOptimizer::Sgd { lr: 1.0 }, mode).unwrap();
    assert!(!out.existed);
}

/// The task's f32 values of `w` and its version.
fn exact(client: &PsClient) -> (Vec<f32>, u64) {
    let p = client.clone().with_wire_format(WireFormat::F32).pull(&["w"], 0).unwrap();
    (p.variables[0].2.clone(), p.version)
}

/// Values whose 16-bit roundings differ from them: 1 + 2^-9 is a bf16 tie (to even: 1) and an
/// exact f16 value; 1 + 2^-11 is an f16 tie (to even: 1); 0.1 rounds in both.
fn rounding_values(n: usize) -> Vec<f32> {
    let base = [1.0 + 2f32.powi(-9), 1.0 + 2f32.powi(-11), 0.1, -2.5, 3.0e-3, -7.0 / 3.0];
    (0..n).map(|i| base[i % base.len()] * (1.0 + (i / base.len()) as f32 * 2f32.powi(-4))).collect()
}

#[test]
fn a_bf16_push_applies_exactly_the_decoded_gradient() {
    within_limit("bf16 push", || {
        for stream_min_bytes in [None, Some(4)] {
            let server = start(stream_min_bytes);
            let client = connect(&server);
            let p0: Vec<f32> = (0..6).map(|i| 10.0 + i as f32 * 0.375).collect();
            create_w(&client, &p0, PsMode::Async);
            let g = rounding_values(6);
            let bf16 = client.clone().with_wire_format(WireFormat::Bf16);
            assert_eq!(bf16.wire_format(), WireFormat::Bf16);
            let out = bf16.push(&id("worker:0", 0), 0, &[("w", &g)]).unwrap();
            assert_eq!(out, PushOutcome::Applied { version: 1, duplicate: false });
            let sent = round_trip(&g, HalfFormat::Bf16);
            assert_eq!(sent[0], 1.0, "1 + 2^-9 rounds to even in bf16");
            let want: Vec<f32> = p0.iter().zip(&sent).map(|(p, g)| p - g).collect();
            let (got, version) = exact(&client);
            assert_eq!(bits(&got), bits(&want), "{stream_min_bytes:?}: p0 - decode(encode(g))");
            assert_eq!(version, 1);
            // The rounding happened: an f32 push of g would have left another value.
            assert_ne!(got[0], p0[0] - g[0]);
            // A retry is a duplicate, as for f32.
            let again = bf16.push(&id("worker:0", 0), 0, &[("w", &g)]).unwrap();
            assert_eq!(again, PushOutcome::Applied { version: 1, duplicate: true });
            assert_eq!(bits(&exact(&client).0), bits(&want));
            let status = client.status().unwrap();
            assert_eq!((status.pushes_applied, status.pushes_duplicate), (1, 1));
            assert_eq!(status.pushes_streamed, u64::from(stream_min_bytes.is_some()));
            server.shutdown();
        }
    });
}

#[test]
fn a_16_bit_pull_returns_the_values_rounded_to_nearest_even() {
    within_limit("16-bit pull", || {
        let server = start(None);
        let client = connect(&server);
        let v = rounding_values(12);
        create_w(&client, &v, PsMode::Async);
        for format in [WireFormat::F16, WireFormat::Bf16] {
            let c = client.clone().with_wire_format(format);
            let p = c.pull(&["w"], 0).unwrap();
            let want = round_trip(&v, half(format));
            assert_eq!(bits(&p.variables[0].2), bits(&want), "{format}: decode(encode(v))");
            assert_ne!(bits(&want), bits(&v), "{format}: the values round");
            // pull_into, the workers' path, too.
            let mut out = vec![0f32; v.len()];
            let version = c.pull_into(&["w"], 0, &mut [&mut out[..]]).unwrap();
            assert_eq!((version, bits(&out)), (0, bits(&want)));
        }
        assert_eq!(round_trip(&v[..2], HalfFormat::F16), vec![1.0 + 2f32.powi(-9), 1.0]);
        // The task keeps its f32 values: an f32 pull is exact.
        assert_eq!(bits(&exact(&client).0), bits(&v));
        server.shutdown();
    });
}

#[test]
fn big_variables_travel_in_16_bit_chunks_of_at_most_the_element_limit() {
    within_limit("16-bit chunks", || {
        // 2.4 MB of f32: more than two chunks, and streamed in async mode (2 MiB and more).
        let n = 2 * MAX_CHUNK_ELEMENTS + 77_777;
        let server = start(Some(2 << 20));
        let client = connect(&server);
        let p0: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 0.5).collect();
        create_w(&client, &p0, PsMode::Async);
        let g: Vec<f32> = (0..n).map(|i| ((i % 97) as f32 - 48.0) * 0.013).collect();
        let f16 = client.clone().with_wire_format(WireFormat::F16);
        f16.push(&id("worker:0", 0), 0, &[("w", &g)]).unwrap();
        let sent = round_trip(&g, HalfFormat::F16);
        let want: Vec<f32> = p0.iter().zip(&sent).map(|(p, g)| p - g).collect();
        let (got, version) = exact(&client);
        assert_eq!(version, 1);
        assert!(bits(&got) == bits(&want), "a chunked f16 push is p0 - decode(encode(g))");
        assert_eq!(client.status().unwrap().pushes_streamed, 1);
        let pulled = f16.pull(&["w"], 1).unwrap();
        assert!(bits(&pulled.variables[0].2) == bits(&round_trip(&want, HalfFormat::F16)));
        server.shutdown();
    });
}

#[test]
fn f32_and_16_bit_clients_push_to_one_task() {
    within_limit("mixed clients", || {
        // Async: each push applies in turn.
        let server = start(None);
        let client = connect(&server);
        let p0 = vec![4.0f32, -1.0, 0.5];
        create_w(&client, &p0, PsMode::Async);
        let g1 = [0.1f32, 0.2, 1.0 + 2f32.powi(-9)];
        let g2 = [0.1f32, 0.2, 1.0 + 2f32.powi(-9)];
        client.push(&id("worker:0", 0), 1, &[("w", &g1)]).unwrap();
        let bf16 = client.clone().with_wire_format(WireFormat::Bf16);
        assert_eq!(
            bf16.push(&id("worker:1", 0), 1, &[("w", &g2)]).unwrap(),
            PushOutcome::Applied { version: 2, duplicate: false }
        );
        let sent = round_trip(&g2, HalfFormat::Bf16);
        let want: Vec<f32> = p0.iter().zip(&g1).zip(&sent).map(|((p, a), b)| p - a - b).collect();
        assert_eq!(bits(&exact(&client).0), bits(&want));
        let status = client.status().unwrap();
        assert_eq!(status.applied_by_worker.values().copied().collect::<Vec<u64>>(), vec![1, 1]);
        server.shutdown();

        // Sync, two workers: one round, the mean of an f32 and a bf16 gradient (exact here).
        let server = start(None);
        let client = connect(&server);
        create_w(&client, &[2.0, 2.0], PsMode::Sync { workers: 2, backup_workers: 0 });
        let a = client.clone();
        let b = client.clone().with_wire_format(WireFormat::Bf16);
        let t = std::thread::spawn(move || a.push(&id("worker:0", 0), 0, &[("w", &[0.5, 1.0][..])]).unwrap());
        let r = b.push(&id("worker:1", 0), 0, &[("w", &[1.0 + 2f32.powi(-9), 0.25][..])]).unwrap();
        assert_eq!(t.join().unwrap(), PushOutcome::Applied { version: 1, duplicate: false });
        assert_eq!(r, PushOutcome::Applied { version: 1, duplicate: false });
        // (0.5 + 1) / 2 = 0.75 and (1 + 0.25) / 2 = 0.625: the bf16 gradient arrived as 1.
        assert_eq!(exact(&client), (vec![1.25, 1.375], 1));
        server.shutdown();
    });
}

#[test]
fn the_job_wire_format_is_recorded_by_create_and_reported_by_status() {
    within_limit("job wire format", || {
        let server = start(None);
        let client = connect(&server);
        assert_eq!(client.status().unwrap().wire_format, WireFormat::F32);
        let w = VariableInfo::whole("w", vec![2]);
        let sgd = ServerOptimizer::Sgd { lr: 1.0 };
        let vars = [(w, &[1.0f32, 2.0][..])];
        client.create_variables_for_job(&vars, &sgd, None, PsMode::Async, WireFormat::Bf16).unwrap();
        assert_eq!(client.status().unwrap().wire_format, WireFormat::Bf16);
        // A create that finds the variables sets it too.
        let again = client.create_variables_for_job(&vars, &sgd, None, PsMode::Async, WireFormat::F16).unwrap();
        assert!(again.existed);
        assert_eq!(client.status().unwrap().wire_format, WireFormat::F16);
        assert_eq!(exact(&client).0, vec![1.0, 2.0], "initial values travel as f32");
        server.shutdown();
    });
}

// ------------------------------------------------------------------------------------------
// Hostile requests, with the generated client.

type Raw = ParameterServerClient<InterceptedService<Channel, ClientAuth>>;

async fn raw(addr: SocketAddr) -> Raw {
    let channel = Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
    ParameterServerClient::with_interceptor(channel, client_interceptor(token()))
}

fn header(format: i32) -> PushMessage {
    PushMessage {
        kind: Some(push_message::Kind::Header(PushHeader {
            worker: "worker:9".into(),
            client: "raw".into(),
            variables: vec!["w".into()],
            wire_format: format,
            ..Default::default()
        })),
    }
}

fn chunk(offset: u64, data: Vec<u8>) -> PushMessage {
    PushMessage { kind: Some(push_message::Kind::Chunk(TensorChunk { variable: 0, offset, data: Bytes::from(data) })) }
}

/// `n` bf16 elements of 1.0.
fn ones(n: usize) -> Vec<u8> {
    [0x80u8, 0x3f].repeat(n)
}

#[test]
fn hostile_16_bit_requests_are_refused_with_their_message_and_change_nothing() {
    within_limit("hostile 16-bit", || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        // Collected pushes, and pushes applied as they arrive (every push streams).
        for stream_min_bytes in [None, Some(4)] {
            let server = start(stream_min_bytes);
            let client = connect(&server);
            let p0 = vec![1.0f32, 2.0, 3.0, 4.0];
            create_w(&client, &p0, PsMode::Async);
            let bf16 = WireFormat::Bf16 as i32;
            let cases: Vec<(&str, Vec<PushMessage>, &str)> = vec![
                (
                    "an odd byte length",
                    vec![header(2), chunk(0, ones(2)), chunk(2, vec![0x80, 0x3f, 0x80])],
                    "a chunk carries 3 bytes, not a whole number of bf16 elements (2 bytes each)",
                ),
                (
                    "a wrong offset",
                    vec![header(2), chunk(1, ones(4))],
                    "a chunk of variable w starts at element 1, expected 0 (chunks must cover each variable in order)",
                ),
                (
                    "a gap",
                    vec![header(2), chunk(0, ones(2)), chunk(3, ones(1))],
                    "a chunk of variable w starts at element 3, expected 2 (chunks must cover each variable in order)",
                ),
                // Counted in elements (4 bytes each in the task) against what the task holds.
                (
                    "a length past the variable",
                    vec![header(2), chunk(0, ones(5))],
                    "the Push stream carries more than 16 bytes, the limit: more than its variables can hold",
                ),
                ("a short push", vec![header(2), chunk(0, ones(3))], "variable w has 4 elements, the push covers 3"),
                (
                    "too many elements in one chunk",
                    vec![header(2), chunk(0, ones(MAX_CHUNK_ELEMENTS + 1))],
                    "a chunk carries 262145 bf16 elements; the limit is 262144: cut tensors into smaller chunks",
                ),
                (
                    "an unknown wire format",
                    vec![header(7), chunk(0, ones(4))],
                    "unknown wire format 7; a parameter server takes 0 (f32), 1 (f16) or 2 (bf16)",
                ),
                (
                    "an infinite f16 element",
                    vec![header(1), chunk(0, [0x00u8, 0x3c, 0x00, 0x7c, 0x00, 0x3c, 0x00, 0x3c].to_vec())],
                    "the gradient of variable w holds inf at element 1; nothing was applied (the worker's training diverged: lower the learning rate or check its data)",
                ),
            ];
            assert_eq!(bf16, 2);
            for (what, msgs, message) in cases {
                let answer: Result<PushResponse, tonic::Status> = rt.block_on(async {
                    let mut c = raw(server.address()).await;
                    c.push(tokio_stream::iter(msgs)).await.map(|r| r.into_inner())
                });
                let s = match answer {
                    Ok(r) => panic!("{what}: the server took it ({r:?})"),
                    Err(s) => s,
                };
                assert_eq!((s.code(), s.message()), (tonic::Code::InvalidArgument, message), "{what}");
                let (values, version) = exact(&client);
                assert_eq!((bits(&values), version), (bits(&p0), 0), "{what} {stream_min_bytes:?}: nothing applied");
            }
            let status = client.status().unwrap();
            assert_eq!((status.version, status.pushes_applied, status.variables[0].1), (0, 0, 0));
            // A pull asking for a format no server knows.
            let e = rt
                .block_on(async {
                    let mut c = raw(server.address()).await;
                    let r = PullRequest { variables: vec!["w".into()], wire_format: 3, ..Default::default() };
                    c.pull(r).await.map(drop)
                })
                .unwrap_err();
            assert_eq!(
                (e.code(), e.message()),
                (
                    tonic::Code::InvalidArgument,
                    "unknown wire format 3; a parameter server takes 0 (f32), 1 (f16) or 2 (bf16)"
                )
            );
            // The task serves on: a well-formed bf16 push applies.
            let ok = rt.block_on(async {
                let mut c = raw(server.address()).await;
                c.push(tokio_stream::iter(vec![header(2), chunk(0, ones(4))])).await.map(|r| r.into_inner())
            });
            assert_eq!(ok.unwrap().version, 1);
            assert_eq!(exact(&client).0, vec![0.0, 1.0, 2.0, 3.0]);
            server.shutdown();
        }
    });
}
