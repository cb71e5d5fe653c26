//! The coordination service over real gRPC on loopback: rendezvous, refusals, heartbeats,
//! barriers, the key-value store.

use std::sync::mpsc;
use std::time::Duration;

use strata_transport::{ClusterToken, CoordinationConfig, CoordinationMember, CoordinationServerHandle, Error};

fn token() -> ClusterToken {
    ClusterToken::new("0123456789abcdef0123456789abcdef").unwrap()
}

fn config() -> CoordinationConfig {
    CoordinationConfig {
        rendezvous_timeout: Duration::from_secs(20),
        heartbeat_interval: Duration::from_millis(100),
        heartbeat_timeout: Duration::from_millis(1500),
        rpc_timeout: Duration::from_secs(5),
    }
}

fn names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("worker:{i}")).collect()
}

fn server(n: usize) -> CoordinationServerHandle {
    CoordinationServerHandle::start(
        "127.0.0.1:0".parse().unwrap(),
        names(n),
        "cluster-a".into(),
        "mwms/1".into(),
        token(),
        config(),
    )
    .unwrap()
}

#[test]
fn rendezvous_returns_every_address_in_rank_order() {
    let s = server(3);
    let addr = s.address().to_string();
    let handles: Vec<_> = (0..3)
        .rev()
        .map(|i| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let m =
                    CoordinationMember::connect(&addr, "worker:0", &format!("worker:{i}"), token(), config()).unwrap();
                let r = m.register("cluster-a", "mwms/1", &format!("127.0.0.1:{}", 9000 + i)).unwrap();
                m.barrier("end", Duration::from_secs(10)).unwrap();
                r
            })
        })
        .collect();
    let mut regs: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    regs.sort_by_key(|r| r.rank);
    for (i, r) in regs.iter().enumerate() {
        assert_eq!(r.rank, i);
        assert_eq!(r.data_addresses, vec!["127.0.0.1:9000", "127.0.0.1:9001", "127.0.0.1:9002"]);
        assert_eq!(r.task_names, names(3));
    }
}

#[test]
fn a_peer_with_another_cluster_or_token_is_refused() {
    let s = server(2);
    let addr = s.address().to_string();
    let m = CoordinationMember::connect(&addr, "worker:0", "worker:1", token(), config()).unwrap();
    let e = m.register("cluster-b", "mwms/1", "127.0.0.1:1").unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::Config(_)), "{msg}");
    assert!(msg.contains("worker:1") && msg.contains("cluster-b") && msg.contains("cluster-a"), "{msg}");
    let e = m.register("cluster-a", "ps/1", "127.0.0.1:1").unwrap_err().to_string();
    assert!(e.contains("strategy"), "{e}");
    let wrong = ClusterToken::new("ffffffffffffffffffffffffffffffff").unwrap();
    let m = CoordinationMember::connect(&addr, "worker:0", "worker:0", wrong, config()).unwrap();
    let e = m.register("cluster-a", "mwms/1", "127.0.0.1:1").unwrap_err();
    assert!(matches!(e, Error::Unauthenticated(_)), "{e}");
    let m = CoordinationMember::connect(&addr, "worker:0", "worker:7", token(), config()).unwrap();
    let e = m.register("cluster-a", "mwms/1", "127.0.0.1:1").unwrap_err().to_string();
    assert!(e.contains("worker:7") && e.contains("not in this job"), "{e}");
}

#[test]
fn a_silent_task_is_declared_lost_and_every_survivor_hears_it() {
    let s = server(3);
    let addr = s.address().to_string();
    let (tx, rx) = mpsc::channel::<(usize, String)>();
    let handles: Vec<_> = (0..3)
        .map(|i| {
            let (addr, tx) = (addr.clone(), tx.clone());
            std::thread::spawn(move || {
                let mut m =
                    CoordinationMember::connect(&addr, "worker:0", &format!("worker:{i}"), token(), config()).unwrap();
                m.register("cluster-a", "mwms/1", "127.0.0.1:1").unwrap();
                m.progress().enter(41, "all_reduce(sum)");
                if i == 2 {
                    // Sends a few heartbeats, then dies without leaving: its heartbeats stop.
                    m.start_heartbeats(|_| {});
                    std::thread::sleep(Duration::from_millis(400));
                    drop(m);
                    return;
                }
                m.start_heartbeats(move |reason| {
                    let _ = tx.send((i, reason));
                });
                std::thread::sleep(Duration::from_secs(8));
            })
        })
        .collect();
    let mut heard = Vec::new();
    for _ in 0..2 {
        heard.push(rx.recv_timeout(Duration::from_secs(15)).expect("a survivor was not told"));
    }
    heard.sort();
    assert_eq!(heard.iter().map(|h| h.0).collect::<Vec<_>>(), vec![0, 1]);
    for (_, reason) in &heard {
        // What the lost task was doing, and no second counter beside the reporter's step.
        assert!(reason.contains("lost task worker:2") && reason.contains("last seen in all_reduce(sum)"), "{reason}");
        assert!(!reason.contains("#41"), "{reason}");
    }
    assert!(s.error().unwrap().contains("worker:2"));
    drop(handles);
}

#[test]
fn reported_errors_reach_everyone_and_keys_wait_for_their_value() {
    let s = server(2);
    let addr = s.address().to_string();
    let a = CoordinationMember::connect(&addr, "worker:0", "worker:0", token(), config()).unwrap();
    let b = CoordinationMember::connect(&addr, "worker:0", "worker:1", token(), config()).unwrap();
    let t = std::thread::spawn(move || {
        b.register("cluster-a", "mwms/1", "127.0.0.1:2").unwrap();
        b.get_key("nccl-id", Duration::from_secs(10)).unwrap()
    });
    a.register("cluster-a", "mwms/1", "127.0.0.1:1").unwrap();
    a.set_key("nccl-id", b"0123").unwrap();
    a.set_key("nccl-id", b"0123").unwrap();
    assert!(a.set_key("nccl-id", b"other").is_err());
    assert_eq!(t.join().unwrap(), b"0123");
    a.report_error("out of memory").unwrap();
    let e = a.barrier("after", Duration::from_secs(5)).unwrap_err().to_string();
    assert!(e.contains("task worker:0 failed: out of memory"), "{e}");
}

/// The chief is named as the cluster names it: `worker:0` when there is no chief job, never
/// "chief", both when it cannot be reached and when it stops answering heartbeats.
#[test]
fn a_lost_chief_is_named_by_its_task() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = closed.local_addr().unwrap().to_string();
    drop(closed);
    let short = CoordinationConfig { rendezvous_timeout: Duration::from_millis(500), ..config() };
    let e = CoordinationMember::connect(&addr, "worker:0", "worker:1", token(), short).unwrap_err().to_string();
    assert!(e.starts_with("lost task worker:0 during rendezvous:"), "{e}");
    assert!(!e.contains("chief"), "{e}");

    let s = server(2);
    let addr = s.address().to_string();
    let other = {
        let addr = addr.clone();
        std::thread::spawn(move || {
            let m = CoordinationMember::connect(&addr, "worker:0", "worker:0", token(), config()).unwrap();
            m.register("cluster-a", "mwms/1", "127.0.0.1:1").unwrap();
        })
    };
    let mut m = CoordinationMember::connect(&addr, "worker:0", "worker:1", token(), config()).unwrap();
    m.register("cluster-a", "mwms/1", "127.0.0.1:2").unwrap();
    other.join().unwrap();
    let (tx, rx) = mpsc::channel();
    m.start_heartbeats(move |reason| {
        let _ = tx.send(reason);
    });
    drop(s);
    let reason = rx.recv_timeout(Duration::from_secs(15)).expect("the lost service was noticed");
    assert!(reason.starts_with("lost task worker:0: the coordination service at"), "{reason}");
    assert!(!reason.contains("task chief"), "{reason}");
}
