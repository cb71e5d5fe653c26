//! The coordination service of an elastic job over real gRPC on loopback: generations formed
//! from the live tasks, a lost member fenced, a task that starts later admitted at the next
//! agreed boundary, refusals that leave the job unharmed, and the end of a job that falls below
//! its minimum.

use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_transport::{
    ClusterToken, CoordinationConfig, CoordinationMember, CoordinationServerHandle, Error, Generation,
};

fn token() -> ClusterToken {
    ClusterToken::new("0123456789abcdef0123456789abcdef").unwrap()
}

fn config() -> CoordinationConfig {
    CoordinationConfig {
        rendezvous_timeout: Duration::from_secs(20),
        heartbeat_interval: Duration::from_millis(100),
        heartbeat_timeout: Duration::from_millis(800),
        rpc_timeout: Duration::from_secs(5),
        join_window: Duration::from_millis(300),
        ..CoordinationConfig::default()
    }
}

fn names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("worker:{i}")).collect()
}

fn server(n: usize, min: usize) -> CoordinationServerHandle {
    CoordinationServerHandle::start_elastic("127.0.0.1:0".parse().unwrap(), names(n), min, token(), config()).unwrap()
}

/// A member with heartbeats running.
fn member(addr: &str, i: usize) -> Arc<CoordinationMember> {
    let mut m = CoordinationMember::connect(addr, "coordinator:0", &format!("worker:{i}"), token(), config()).unwrap();
    m.start_heartbeats(|_| {});
    Arc::new(m)
}

fn join_all(members: &[Arc<CoordinationMember>], generation: u64) -> Vec<Generation> {
    let handles: Vec<_> = members
        .iter()
        .map(|m| {
            let m = m.clone();
            std::thread::spawn(move || m.join("cluster-a", "mwms/1", "127.0.0.1:9000", generation))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn generations_follow_losses_and_joins() {
    let s = server(3, 2);
    let addr = s.address().to_string();
    let a = member(&addr, 0);
    let b = member(&addr, 1);
    let c = CoordinationMember::connect(&addr, "coordinator:0", "worker:2", token(), config()).unwrap();
    let c = Arc::new(c);
    // worker:2 joins without heartbeats: it will be declared lost.
    let g = join_all(&[a.clone(), b.clone(), c.clone()], 0);
    assert!(g.iter().all(|g| g.generation == 1 && g.data_addresses.len() == 3));
    // The members hear that the next generation forms, and join it from generation 1.
    wait_for("forming", || a.membership().forming() && b.membership().forming());
    let g2 = join_all(&[a.clone(), b.clone()], 1);
    for (i, g) in g2.iter().enumerate() {
        assert_eq!((g.generation, g.rank, g.resumed), (2, i, true));
        assert_eq!(g.task_names, names(2));
    }
    assert_eq!(s.membership(), (2, names(2)));
    assert!(s.lost_tasks().iter().any(|t| t.starts_with("worker:2 (no heartbeat")), "{:?}", s.lost_tasks());
    // The lost process is fenced: it cannot join again, whatever generation it presents.
    for generation in [0, 1, 2] {
        let e = c.join("cluster-a", "mwms/1", "127.0.0.1:9002", generation).unwrap_err();
        assert!(matches!(e, Error::Aborted(_)), "{e}");
        assert!(e.to_string().contains("worker:2") && e.to_string().contains("this process stops"), "{e}");
    }
    // A new process of worker:2 waits until the members agree to admit it.
    let c2 = member(&addr, 2);
    let joiner = {
        let c2 = c2.clone();
        std::thread::spawn(move || c2.join("cluster-a", "mwms/1", "127.0.0.1:9012", 0))
    };
    wait_for("a waiting task", || a.membership().waiting() == 1 && b.membership().waiting() == 1);
    assert!(!joiner.is_finished(), "a joiner is admitted only when the members call Join");
    let g3 = join_all(&[a.clone(), b.clone()], 2);
    let gj = joiner.join().unwrap().unwrap();
    assert_eq!((gj.generation, gj.rank, gj.resumed), (3, 2, true));
    assert_eq!(gj.data_addresses[2], "127.0.0.1:9012");
    assert!(g3.iter().all(|g| g.generation == 3 && g.task_names == names(3)));
    // A member presenting an old generation is refused and stays out.
    let e = a.join("cluster-a", "mwms/1", "127.0.0.1:9000", 1).unwrap_err();
    assert!(e.to_string().contains("generation 1"), "{e}");
}

#[test]
fn a_joiner_with_other_settings_is_refused_and_the_job_is_unharmed() {
    let s = server(3, 1);
    let addr = s.address().to_string();
    let a = member(&addr, 0);
    let b = member(&addr, 1);
    let g = join_all(&[a.clone(), b.clone()], 0);
    assert!(g.iter().all(|g| g.generation == 1 && g.task_names == names(2)), "the window formed it with 2");
    let c = member(&addr, 2);
    let e = c.join("cluster-a", "mwms/2", "127.0.0.1:9002", 0).unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e}");
    assert!(e.to_string().contains("mwms/2") && e.to_string().contains("mwms/1"), "{e}");
    let e = c.join("cluster-b", "mwms/1", "127.0.0.1:9002", 0).unwrap_err();
    assert!(e.to_string().contains("cluster-b"), "{e}");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(s.error(), None);
    assert_eq!(a.membership().waiting(), 0);
    assert_eq!(s.membership(), (1, names(2)));
}

#[test]
fn below_the_minimum_the_job_fails_naming_the_lost_tasks() {
    let s = server(2, 2);
    let addr = s.address().to_string();
    let a = member(&addr, 0);
    let b = Arc::new(CoordinationMember::connect(&addr, "coordinator:0", "worker:1", token(), config()).unwrap());
    join_all(&[a.clone(), b], 0);
    wait_for("the job's error", || s.error().is_some());
    let e = s.error().unwrap();
    assert!(e.contains("1 of the job's workers remain") && e.contains("worker:1 (no heartbeat"), "{e}");
    let e = a.join("cluster-a", "mwms/1", "127.0.0.1:9000", 1).unwrap_err();
    assert!(e.to_string().contains("fewer than the 2"), "{e}");
}

#[test]
fn an_elastic_minimum_outside_the_job_is_refused() {
    for min in [0, 4] {
        let e =
            CoordinationServerHandle::start_elastic("127.0.0.1:0".parse().unwrap(), names(3), min, token(), config())
                .unwrap_err();
        assert!(e.to_string().contains("from 1 to 3"), "{e}");
    }
}
