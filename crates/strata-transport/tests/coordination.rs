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
        refusal_grace: Duration::from_millis(500),
        ..CoordinationConfig::default()
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
                if i == 2 {
                    // Sends a few heartbeats, then dies without leaving: its heartbeats stop.
                    m.start_heartbeats(|_| {});
                    m.progress().enter(41, "all_reduce(sum)");
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

/// A TCP relay between a client and a server that can freeze: the connections stay open but
/// nothing moves, as when the server's process is stopped (SIGSTOP) or the network between
/// them is cut.
struct Relay {
    address: std::net::SocketAddr,
    frozen: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Relay {
    fn start(upstream: std::net::SocketAddr) -> Relay {
        use std::io::{Read, Write};
        use std::sync::atomic::Ordering;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let frozen = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let f = frozen.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = std::net::TcpStream::connect(upstream) else { return };
                for (mut from, mut to) in [(client.try_clone().unwrap(), server.try_clone().unwrap()), (server, client)]
                {
                    let f = f.clone();
                    std::thread::spawn(move || {
                        let mut buf = vec![0u8; 64 << 10];
                        loop {
                            while f.load(Ordering::Relaxed) {
                                std::thread::sleep(Duration::from_millis(10));
                            }
                            match from.read(&mut buf) {
                                Ok(0) | Err(_) => return,
                                Ok(n) => {
                                    while f.load(Ordering::Relaxed) {
                                        std::thread::sleep(Duration::from_millis(10));
                                    }
                                    if to.write_all(&buf[..n]).is_err() {
                                        return;
                                    }
                                }
                            }
                        }
                    });
                }
            }
        });
        Relay { address, frozen }
    }

    fn freeze(&self) {
        self.frozen.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

#[test]
fn survivors_hear_of_a_lost_task_at_once_not_at_their_next_heartbeat() {
    // Heartbeats every 2 s: a survivor that learned of the loss only with its next heartbeat
    // would hear of it up to 2 s late; the long poll answers at once.
    let cfg = CoordinationConfig { heartbeat_interval: Duration::from_secs(2), ..config() };
    let s = CoordinationServerHandle::start(
        "127.0.0.1:0".parse().unwrap(),
        names(2),
        "cluster-a".into(),
        "mwms/1".into(),
        token(),
        cfg.clone(),
    )
    .unwrap();
    let addr = s.address().to_string();
    let mut a = CoordinationMember::connect(&addr, "worker:0", "worker:0", token(), cfg.clone()).unwrap();
    let b = CoordinationMember::connect(&addr, "worker:0", "worker:1", token(), cfg).unwrap();
    let t = std::thread::spawn(move || {
        b.register("cluster-a", "mwms/1", "127.0.0.1:2").unwrap();
        b
    });
    a.register("cluster-a", "mwms/1", "127.0.0.1:1").unwrap();
    let b = t.join().unwrap();
    let (tx, rx) = mpsc::channel();
    a.start_heartbeats(move |reason| {
        let _ = tx.send((std::time::Instant::now(), reason));
    });
    std::thread::sleep(Duration::from_millis(300));
    let reported = std::time::Instant::now();
    b.report_error("disk full").unwrap();
    let (heard, reason) = rx.recv_timeout(Duration::from_secs(10)).expect("worker:0 was not told");
    let delay = heard.duration_since(reported);
    eprintln!("heard the failure {delay:?} after it was reported");
    assert!(reason.contains("task worker:1 failed: disk full"), "{reason}");
    assert!(delay < Duration::from_millis(1000), "heard it {delay:?} later");
}

#[test]
fn a_service_that_stops_answering_is_declared_lost_within_the_heartbeat_timeout() {
    let s = server(2);
    let relay = Relay::start(s.address());
    let mut m =
        CoordinationMember::connect(&relay.address.to_string(), "worker:0", "worker:1", token(), config()).unwrap();
    // Registration would wait for worker:0; heartbeats need only the connection.
    m.progress().enter(12, "all_reduce");
    let (tx, rx) = mpsc::channel();
    m.start_heartbeats(move |reason| {
        let _ = tx.send((std::time::Instant::now(), reason));
    });
    std::thread::sleep(Duration::from_millis(600));
    assert!(rx.try_recv().is_err(), "a healthy service was declared lost");
    let frozen = std::time::Instant::now();
    relay.freeze();
    let (heard, reason) = rx.recv_timeout(Duration::from_secs(10)).expect("the lost service was not noticed");
    let took = heard.duration_since(frozen);
    eprintln!("the frozen service was declared lost after {took:?}: {reason}");
    assert!(
        reason.contains("lost task worker:0") && reason.contains("was in all_reduce") && !reason.contains("#12"),
        "{reason}"
    );
    assert!(m.service_lost());
    // Within the timeout (1.5 s) of the last answer, which came at most one interval before.
    assert!(took <= Duration::from_millis(1500) + Duration::from_millis(300), "took {took:?}");
    // Nothing waits on the lost service: the report is skipped, dropping does not block.
    let t0 = std::time::Instant::now();
    m.report_error("whatever").unwrap();
    drop(m);
    assert!(t0.elapsed() < Duration::from_millis(500), "{:?}", t0.elapsed());
}

#[test]
fn a_task_with_the_wrong_token_fails_the_rendezvous_early_naming_it() {
    let s = server(3);
    let addr = s.address().to_string();
    let started = std::time::Instant::now();
    let waiting: Vec<_> = [0usize, 2]
        .into_iter()
        .map(|i| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let m =
                    CoordinationMember::connect(&addr, "worker:0", &format!("worker:{i}"), token(), config()).unwrap();
                m.register("cluster-a", "mwms/1", "127.0.0.1:1").unwrap_err()
            })
        })
        .collect();
    let wrong = ClusterToken::new("ffffffffffffffffffffffffffffffff").unwrap();
    let m = CoordinationMember::connect(&addr, "worker:0", "worker:1", wrong, config()).unwrap();
    assert!(matches!(m.register("cluster-a", "mwms/1", "127.0.0.1:1").unwrap_err(), Error::Unauthenticated(_)));
    for w in waiting {
        let e = w.join().unwrap().to_string();
        assert!(e.contains("worker:1 was refused: wrong cluster token"), "{e}");
        assert!(e.contains("127.0.0.1:"), "the refused call's address: {e}");
    }
    // The grace is 0.5 s; the rendezvous timeout, 20 s.
    let took = started.elapsed();
    eprintln!("the rendezvous failed after {took:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert!(s.error().unwrap().contains("worker:1 was refused"));
}

#[test]
fn a_refused_impostor_does_not_stop_the_real_task_from_joining() {
    // A call without the token that claims to be worker:1, then the real worker:1 within the
    // grace period: the rendezvous completes.
    let s = server(2);
    let addr = s.address().to_string();
    let a = {
        let addr = addr.clone();
        std::thread::spawn(move || {
            let m = CoordinationMember::connect(&addr, "worker:0", "worker:0", token(), config()).unwrap();
            m.register("cluster-a", "mwms/1", "127.0.0.1:1")
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    let impostor = ClusterToken::new("ffffffffffffffffffffffffffffffff").unwrap();
    let i = CoordinationMember::connect(&addr, "worker:0", "worker:1", impostor, config()).unwrap();
    assert!(i.register("cluster-a", "mwms/1", "127.0.0.1:9").is_err());
    std::thread::sleep(Duration::from_millis(200));
    let b = CoordinationMember::connect(&addr, "worker:0", "worker:1", token(), config()).unwrap();
    let rb = b.register("cluster-a", "mwms/1", "127.0.0.1:2").unwrap();
    let ra = a.join().unwrap().unwrap();
    assert_eq!((ra.rank, rb.rank), (0, 1));
    assert_eq!(rb.data_addresses, ["127.0.0.1:1", "127.0.0.1:2"]);
    assert!(s.error().is_none());
}

#[test]
fn a_task_refused_for_its_strategy_fails_the_others_rendezvous_at_once() {
    let s = server(2);
    let addr = s.address().to_string();
    let started = std::time::Instant::now();
    let a = {
        let addr = addr.clone();
        std::thread::spawn(move || {
            let m = CoordinationMember::connect(&addr, "worker:0", "worker:0", token(), config()).unwrap();
            m.register("cluster-a", "mwms/1", "127.0.0.1:1").unwrap_err().to_string()
        })
    };
    let b = CoordinationMember::connect(&addr, "worker:0", "worker:1", token(), config()).unwrap();
    let e = b.register("cluster-a", "mwms/2", "127.0.0.1:2").unwrap_err().to_string();
    assert!(e.contains("strategy"), "{e}");
    let chief = a.join().unwrap();
    assert!(chief.contains("rendezvous failed") && chief.contains("task worker:1 runs strategy [mwms/2]"), "{chief}");
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
}
