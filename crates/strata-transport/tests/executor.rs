//! The worker executor service over real gRPC on loopback.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use strata_transport::executor::{StepFailure, StepHandler, WorkerClient, WorkerExecutorHandle};
use strata_transport::{ClusterToken, Error};

const TOKEN: &str = "0123456789abcdef0123";

#[derive(Default)]
struct Steps {
    runs: AtomicU64,
}

impl StepHandler for Steps {
    fn functions(&self) -> Vec<String> {
        vec!["add".into(), "fail".into(), "flaky".into()]
    }

    fn run(&self, function: &str, step: u64, client: &str, args: &[u8]) -> Result<Vec<u8>, StepFailure> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        match function {
            "add" => {
                let (a, b): (i64, i64) =
                    serde_json::from_slice(args).map_err(|e| StepFailure::Failed(e.to_string()))?;
                Ok(serde_json::to_vec(&(a + b, step, client)).unwrap_or_default())
            }
            "fail" => Err(StepFailure::Failed("transport error: connection reset; the loss is nan".into())),
            "flaky" => Err(StepFailure::Unavailable("ps:0 is down".into())),
            other => Err(StepFailure::NotFound(other.into())),
        }
    }
}

fn token() -> ClusterToken {
    ClusterToken::new(TOKEN).unwrap()
}

fn start() -> (WorkerExecutorHandle, Arc<Steps>) {
    let steps = Arc::new(Steps::default());
    let server =
        WorkerExecutorHandle::start("127.0.0.1:0".parse().unwrap(), "worker:3".into(), token(), steps.clone()).unwrap();
    (server, steps)
}

fn client(server: &WorkerExecutorHandle, token: ClusterToken) -> WorkerClient {
    WorkerClient::connect(&server.address().to_string(), "worker:3", token, Duration::from_secs(20)).unwrap()
}

#[test]
fn run_step_round_trip_and_ping() {
    let (server, _) = start();
    let c = client(&server, token());
    let out = c.run_step("add", 7, "coordinator-0", &serde_json::to_vec(&(40i64, 2i64)).unwrap()).unwrap();
    let (sum, step, who): (i64, u64, String) = serde_json::from_slice(&out).unwrap();
    assert_eq!((sum, step, who.as_str()), (42, 7, "coordinator-0"));
    let info = c.ping().unwrap();
    assert_eq!(info.task, "worker:3");
    assert_eq!(info.functions, vec!["add", "fail", "flaky"]);
    assert_eq!(info.steps_run, 1);
    assert_eq!(c.ping().unwrap().incarnation, info.incarnation);
    server.shutdown();
}

#[test]
fn failures_map_to_errors() {
    let (server, _) = start();
    let c = client(&server, token());
    match c.run_step("nope", 1, "c", b"null").unwrap_err() {
        Error::Rejected { code, detail, .. } => {
            assert_eq!(code, "NotFound");
            assert!(detail.contains("no step function named nope is registered in worker:3"), "{detail}");
            assert!(detail.contains("register it in the binary every task runs"), "{detail}");
        }
        other => panic!("expected Rejected, got {other:?}"),
    }
    match c.run_step("fail", 2, "c", b"null").unwrap_err() {
        Error::Rejected { code, detail, .. } => {
            assert_eq!(code, "Internal");
            assert!(detail.contains("the loss is nan"), "{detail}");
            assert!(detail.contains("step 2 (fail) failed in worker:3"), "{detail}");
        }
        other => panic!("expected Rejected, got {other:?}"),
    }
    match c.run_step("flaky", 3, "c", b"null").unwrap_err() {
        Error::Unavailable { peer, detail, .. } => {
            assert_eq!(peer, "worker:3");
            assert_eq!(detail, "step unavailable: ps:0 is down");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    server.shutdown();
}

#[test]
fn unauthenticated_calls_never_run() {
    let (server, steps) = start();
    let wrong = client(&server, ClusterToken::new("ffffffffffffffffffff").unwrap());
    let args = serde_json::to_vec(&(1i64, 2i64)).unwrap();
    assert!(matches!(wrong.run_step("add", 0, "c", &args), Err(Error::Unauthenticated(_))));
    assert!(matches!(wrong.ping(), Err(Error::Unauthenticated(_))));
    // No token at all: a raw tonic client without the interceptor.
    let none = strata_transport::rt::runtime().block_on(async {
        let mut raw = strata_proto::v1::worker_executor_client::WorkerExecutorClient::connect(format!(
            "http://{}",
            server.address()
        ))
        .await
        .unwrap();
        raw.run_step(strata_proto::v1::RunStepRequest {
            function: "add".into(),
            step: 0,
            client: "c".into(),
            args: args.clone().into(),
        })
        .await
    });
    assert_eq!(none.unwrap_err().code(), tonic::Code::Unauthenticated);
    assert_eq!(steps.runs.load(Ordering::SeqCst), 0);
    server.shutdown();
}

#[test]
fn an_unreachable_worker_is_reported_as_such() {
    let (server, _) = start();
    let c = client(&server, token());
    assert!(c.ping().is_ok());
    server.shutdown();
    match c.run_step("add", 0, "c", b"[1,2]").unwrap_err() {
        Error::Unavailable { peer, detail, .. } => {
            assert_eq!(peer, "worker:3");
            assert!(detail.starts_with("worker unreachable"), "{detail}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
}
