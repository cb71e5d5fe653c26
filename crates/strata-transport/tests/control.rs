//! The end of a job (`TaskControl.Finish`) over real gRPC on loopback, served beside a
//! parameter server and a worker executor.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use strata_transport::control::{finish_task, MAX_REASON_BYTES};
use strata_transport::executor::{StepFailure, StepHandler, WorkerClient, WorkerExecutorHandle};
use strata_transport::ps::{PsServerConfig, PsServerHandle};
use strata_transport::{ClusterToken, Error};

const TOKEN: &str = "0123456789abcdef0123";
const DEADLINE: Duration = Duration::from_secs(10);

fn token() -> ClusterToken {
    ClusterToken::new(TOKEN).unwrap()
}

struct NoSteps;

impl StepHandler for NoSteps {
    fn functions(&self) -> Vec<String> {
        Vec::new()
    }

    fn run(&self, function: &str, _step: u64, _client: &str, _args: &[u8]) -> Result<Vec<u8>, StepFailure> {
        Err(StepFailure::NotFound(function.into()))
    }
}

#[test]
fn a_ps_task_is_finished_once_by_its_chief_and_strangers_cannot_finish_it() {
    common::within_limit("finish_ps", || {
        let server =
            PsServerHandle::start("127.0.0.1:0".parse().unwrap(), PsServerConfig::new("ps:0", token())).unwrap();
        let address = server.address().to_string();
        assert_eq!(server.finished(), None);
        assert_eq!(server.idle_for(), None, "no call yet");
        // Another cluster's token: refused, and the job goes on.
        let stranger = ClusterToken::new("ffffffffffffffffffff").unwrap();
        let e = finish_task(&address, "ps:0", stranger, "the chief finished training", DEADLINE).unwrap_err();
        assert!(matches!(e, Error::Unauthenticated(_)), "{e}");
        assert_eq!(server.finished(), None);
        assert_eq!(server.idle_for(), None, "a refused call is not a call of the job");
        // A reason over the limit: refused, nothing ends.
        let long = "x".repeat(MAX_REASON_BYTES + 1);
        let e = finish_task(&address, "ps:0", token(), &long, DEADLINE).unwrap_err();
        match &e {
            Error::Rejected { code, detail, .. } => {
                assert_eq!(code, "InvalidArgument");
                assert!(detail.contains(&format!("{}", MAX_REASON_BYTES + 1)) && detail.contains("limit"), "{detail}");
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        assert_eq!(server.finished(), None);
        // The chief's: finished, with its reason on one line; a second call is a no-op.
        let already = finish_task(&address, "ps:0", token(), "the chief\nfinished training", DEADLINE).unwrap();
        assert!(!already);
        assert_eq!(server.finished().as_deref(), Some("the chief finished training"));
        assert!(server.idle_for().is_some_and(|d| d < DEADLINE), "the admitted call counts");
        let already = finish_task(&address, "ps:0", token(), "another reason", DEADLINE).unwrap();
        assert!(already);
        assert_eq!(server.finished().as_deref(), Some("the chief finished training"), "the first reason stays");
        // The ps keeps serving until its program stops it.
        std::thread::sleep(Duration::from_millis(100));
        assert!(server.idle_for().is_some_and(|d| d >= Duration::from_millis(100)));
        server.shutdown();
    });
}

#[test]
fn a_worker_is_finished_with_a_default_reason_and_its_pings_count_as_calls() {
    common::within_limit("finish_worker", || {
        let server =
            WorkerExecutorHandle::start("127.0.0.1:0".parse().unwrap(), "worker:2".into(), token(), Arc::new(NoSteps))
                .unwrap();
        let address = server.address().to_string();
        let client = WorkerClient::connect(&address, "worker:2", token(), DEADLINE).unwrap();
        assert_eq!(server.idle_for(), None);
        client.ping().unwrap();
        let idle = server.idle_for().expect("a ping is a call of the job");
        assert!(idle < DEADLINE);
        assert!(!finish_task(&address, "worker:2", token(), "  ", DEADLINE).unwrap());
        assert_eq!(server.finished().as_deref(), Some("the chief ended the job"));
        server.shutdown();
        // A task that is gone: unavailable, within the deadline.
        let e = finish_task(&address, "worker:2", token(), "late", Duration::from_secs(2)).unwrap_err();
        assert!(matches!(e, Error::Unavailable { .. } | Error::Timeout { .. }), "{e}");
    });
}
