//! A real `strata worker` under hostile `RunStep`s from a holder of the cluster token: step
//! arguments (the job's JSON, `DigitsStep { spec: PsJobSpec, .. }`, the MLP's or the
//! transformer's) asking for models of 2^40 units, absurd replica counts and batch sizes,
//! data files that never end, arguments that do not decode, names of 10 KiB. A few thousand calls from a seeded generator: every
//! one is answered with a refusal (INVALID_ARGUMENT with the limit, or NOT_FOUND), the process
//! lives on, its health check answers SERVING, and it still runs a well-formed step's
//! refusal the same way afterwards.

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use strata_transport::executor::WorkerClient;
use strata_transport::{ClusterToken, Error};

use strata_integration_tests::{free_ports, strata, TOKEN};

/// A small deterministic generator (xorshift64*), so the calls repeat run after run.
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<T: Clone>(&mut self, from: &[T]) -> T {
        from[self.below(from.len() as u64) as usize].clone()
    }
}

struct Worker(Child);

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The spec part of a hostile step: at least one field over its limit, or a data file that
/// must be refused while it is read.
fn hostile_spec(g: &mut Gen) -> (serde_json::Value, &'static str) {
    let huge = [1u64 << 40, 1 << 32, u64::MAX, 65_537];
    let shape =
        |width: u64, heads: u64| json!({"vocab": 65, "width": width, "layers": 2, "heads": heads, "context": 64});
    match g.below(8) {
        0 => (json!({"hidden": [g.pick(&huge)], "replicas": 1, "seed": 0, "data": null}), "over the limit of 65536"),
        1 => (json!({"hidden": [65_536, 65_536], "replicas": 1, "seed": 0, "data": null}), "parameters, the limit"),
        2 => {
            let replicas = g.pick(&[0u64, 1025, 100_000, 1 << 40, u64::MAX]);
            (json!({"hidden": [16], "replicas": replicas, "seed": 1, "data": null}), "replicas per worker; the limit")
        }
        3 => (json!({"hidden": vec![4; 65], "replicas": 1, "seed": 0, "data": null}), "hidden layers, over the limit"),
        4 => (
            json!({"hidden": [2048, 2048], "replicas": 64, "seed": 0, "data": null}),
            "parameters, the limit; use fewer replicas",
        ),
        // The transformer: a shape over the limit, or one that does not split into its heads.
        5 => (
            json!({"model": "transformer", "transformer": shape(g.pick(&huge), 1), "replicas": 1, "seed": 0, "data": null}),
            "parameters, the limit",
        ),
        6 => (
            json!({"model": "transformer", "transformer": shape(130, 4), "replicas": 1, "seed": 0, "data": null}),
            "does not split into 4 heads",
        ),
        // A valid model whose data file never ends: refused after one line.
        _ => {
            (json!({"hidden": [16], "replicas": 2, "seed": 0, "data": "/dev/zero"}), "line 1 is longer than 4096 bytes")
        }
    }
}

#[test]
fn a_real_worker_refuses_hostile_steps_and_lives_on() {
    let ports = free_ports(2);
    let address = format!("127.0.0.1:{}", ports[0]);
    let mut cmd = strata();
    cmd.args(["worker", "--address", &address, "--ps", &format!("127.0.0.1:{}", ports[1])]);
    let worker = Worker(cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("strata worker starts"));
    let token = ClusterToken::new(TOKEN).unwrap();
    let client = WorkerClient::connect(&address, "worker:0", token, Duration::from_secs(20)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while client.ping().is_err() {
        assert!(Instant::now() < deadline, "the worker did not answer within 60 s");
        std::thread::sleep(Duration::from_millis(50));
    }

    let started = Instant::now();
    let mut g = Gen(0x5eed_1234_abcd_0001);
    let (mut invalid, mut not_found) = (0, 0);
    let calls = 2000;
    for i in 0..calls {
        let step = g.next();
        let (function, args, expect): (String, Vec<u8>, Option<&str>) = match g.below(10) {
            // The digits step with a spec over a limit.
            0..=5 => {
                let (spec, expect) = hostile_spec(&mut g);
                let batch_size = g.pick(&[1u64, 64, 1 << 40, u64::MAX]);
                let args = json!({"spec": spec, "epoch": g.next(), "batch": g.next(), "batch_size": batch_size});
                ("digits.train".into(), serde_json::to_vec(&args).unwrap(), Some(expect))
            }
            // A valid spec with a batch of no examples.
            6 => {
                let args = json!({"spec": {"hidden": [8], "replicas": 1, "seed": 0, "data": "/dev/zero"}, "epoch": 0, "batch": 0, "batch_size": 0});
                ("digits.train".into(), serde_json::to_vec(&args).unwrap(), Some("a batch of 0 examples"))
            }
            // Arguments that do not decode: random bytes, a number too large for JSON's u64.
            7 => {
                let args: Vec<u8> = if g.below(2) == 0 {
                    (0..g.below(200)).map(|_| g.next() as u8).collect()
                } else {
                    br#"{"spec":{"hidden":[1e400],"replicas":1,"seed":0,"data":null},"epoch":0,"batch":0,"batch_size":1}"#.to_vec()
                };
                ("digits.train".into(), args, Some("cannot decode its arguments"))
            }
            // No such function, and names of every length.
            8 => (g.pick(&["nope".to_string(), "n".repeat(256), String::new()]), b"{}".to_vec(), None),
            _ => ("x".repeat(10 << 10), b"{}".to_vec(), Some("the limit is 1 to 256 bytes")),
        };
        let client_name = if g.below(20) == 0 { "c".repeat(10 << 10) } else { format!("fuzz-{i}") };
        let e = client.run_step(&function, step, &client_name, &args).expect_err("a hostile step was run");
        match &e {
            Error::Rejected { code, detail, .. } if code == "InvalidArgument" => {
                invalid += 1;
                if client_name.len() > 256 && function.len() <= 256 && !function.is_empty() {
                    assert!(detail.contains("a client name of 10240 bytes; the limit is 256 bytes"), "{detail}");
                } else if let Some(expect) = expect {
                    assert!(detail.contains(expect), "call {i} ({function:.20}): {expect:?} not in {detail}");
                }
            }
            Error::Rejected { code, .. } if code == "NotFound" => {
                assert!(function.len() <= 256 && !function.is_empty() && function != "digits.train", "{e}");
                not_found += 1;
            }
            other => panic!("call {i} ({function:.20}): not a refusal: {other}"),
        }
    }
    assert_eq!(invalid + not_found, calls);
    assert!(not_found > 0 && invalid > calls / 2, "{invalid} invalid, {not_found} not found");
    eprintln!("{calls} hostile steps refused in {:.1} s", started.elapsed().as_secs_f64());

    let mut worker = worker;
    assert!(worker.0.try_wait().unwrap().is_none(), "the worker process died");
    assert!(client.serving().unwrap(), "the worker's health check does not answer SERVING");
    let info = client.ping().unwrap();
    assert_eq!(info.task, "worker:0");
    assert_eq!(info.steps_run, 0, "no hostile step ran");
    // The one that aborted the release binary: a model of 2^40 units.
    let args = json!({"spec": {"hidden": [1u64 << 40], "replicas": 1, "seed": 0, "data": null}, "epoch": 0, "batch": 0, "batch_size": 32});
    let e = client.run_step("digits.train", 1, "after", &serde_json::to_vec(&args).unwrap()).unwrap_err().to_string();
    assert!(
        e.contains("InvalidArgument") && e.contains("a hidden layer of 1099511627776 units, over the limit of 65536"),
        "{e}"
    );
}
