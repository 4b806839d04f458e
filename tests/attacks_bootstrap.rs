//! The rendezvous attacked as an outsider on the same machine would: each
//! attack must end in a dropped connection or a typed error, and the real
//! job (ranks on threads here) must still meet. No GPU needed.
#![cfg(target_os = "linux")]

use cuda_peer::ipc::{spans_hosts, Bootstrap, Exchange, JobSecret};
use cuda_peer::Error;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A rank's job id and what its all-gather returned.
type Met = (String, Vec<Vec<u8>>);

fn secret() -> JobSecret {
    JobSecret::generate().unwrap()
}

/// Runs a real job of `n` ranks on threads (all with `key`); returns each
/// rank's job id and all-gather, and how long they took.
fn real_job(port: u16, n: usize, key: &JobSecret, timeout: Duration) -> (Vec<Met>, Duration) {
    let start = Instant::now();
    let handles: Vec<_> = (0..n)
        .map(|r| {
            let key = key.clone();
            std::thread::spawn(move || {
                let rv = Bootstrap::new(r, n, r, n, "127.0.0.1", port).unwrap().with_secret(key).with_timeout(timeout).connect()?;
                let all = rv.all_gather(format!("rank {r}").as_bytes())?;
                Ok::<_, Error>((rv.job_id().to_string(), all))
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap().unwrap()).collect();
    let took = start.elapsed();
    for (job, all) in &results {
        assert_eq!(job, &results[0].0);
        assert_eq!(all, &(0..n).map(|r| format!("rank {r}").into_bytes()).collect::<Vec<_>>());
    }
    (results, took)
}

/// Starts rank 0 alone on a thread (it waits for the others).
fn rank0(port: u16, n: usize, key: &JobSecret, timeout: Duration) -> std::thread::JoinHandle<Result<Met, Error>> {
    let key = key.clone();
    std::thread::spawn(move || {
        let rv = Bootstrap::new(0, n, 0, n, "127.0.0.1", port).unwrap().with_secret(key).with_timeout(timeout).connect()?;
        let all = rv.all_gather(b"rank 0")?;
        Ok((rv.job_id().to_string(), all))
    })
}

/// Connects to `port` until rank 0 listens.
fn connect_when_up(port: u16) -> TcpStream {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(s) = TcpStream::connect(("127.0.0.1", port)) {
            return s;
        }
        assert!(Instant::now() < until, "rank 0 never listened");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A joiner of the real protocol with the wrong secret, claiming rank 1
/// before the real rank 1 arrives: it is not given the rank and learns
/// nothing (not even the job id), and the real job meets.
#[test]
fn a_stranger_without_the_secret_is_dropped_and_the_job_meets() {
    let (port, key) = (free_port(), secret());
    let t = Duration::from_secs(20);
    let server = rank0(port, 2, &key, t);
    let stranger = Bootstrap::new(1, 2, 1, 2, "127.0.0.1", port).unwrap().with_secret(secret()).with_timeout(Duration::from_millis(1500)).connect();
    assert!(matches!(stranger, Err(Error::Timeout { .. })), "the stranger joined: {stranger:?}");
    let real = Bootstrap::new(1, 2, 1, 2, "127.0.0.1", port).unwrap().with_secret(key).with_timeout(t).connect().unwrap();
    let all = real.all_gather(b"rank 1").unwrap();
    let (job, all0) = server.join().unwrap().unwrap();
    assert_eq!((real.job_id(), &all), (job.as_str(), &all0));
    assert_eq!(all, vec![b"rank 0".to_vec(), b"rank 1".to_vec()]);
}

/// A stray HTTP request to MASTER_PORT is dropped; the job still meets.
#[test]
fn a_stray_http_request_does_not_disturb_the_rendezvous() {
    let (port, key) = (free_port(), secret());
    let server = rank0(port, 3, &key, Duration::from_secs(20));
    let mut http = connect_when_up(port);
    http.write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
    // Rank 0 answers a stray with its hello only, then drops it: nothing
    // about the job (its id) reaches it.
    http.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut got = Vec::new();
    let _ = http.read_to_end(&mut got);
    assert!(got.len() <= 4 + 40, "a stray got {} bytes", got.len());
    let key2 = key.clone();
    let others: Vec<_> = (1..3)
        .map(|r| {
            let key = key2.clone();
            std::thread::spawn(move || {
                let rv = Bootstrap::new(r, 3, r, 3, "127.0.0.1", port).unwrap().with_secret(key).with_timeout(Duration::from_secs(20)).connect()?;
                rv.all_gather(format!("rank {r}").as_bytes())
            })
        })
        .collect();
    let (_, all) = server.join().unwrap().unwrap();
    assert_eq!(all.len(), 3);
    for h in others {
        assert_eq!(h.join().unwrap().unwrap(), all);
    }
}

/// A peer that sends one byte at a time, slowly, does not hold rank 0:
/// the real ranks meet long before the trickle would end.
#[test]
fn a_slow_trickling_peer_does_not_hold_up_the_job() {
    let (port, key) = (free_port(), secret());
    let server = rank0(port, 2, &key, Duration::from_secs(30));
    let mut slow = connect_when_up(port);
    let trickle = std::thread::spawn(move || {
        let start = Instant::now();
        for _ in 0..40 {
            if slow.write_all(&[0x50]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(300));
        }
        start.elapsed()
    });
    std::thread::sleep(Duration::from_millis(200));
    let start = Instant::now();
    let real = Bootstrap::new(1, 2, 1, 2, "127.0.0.1", port).unwrap().with_secret(key).with_timeout(Duration::from_secs(30)).connect().unwrap();
    real.all_gather(b"rank 1").unwrap();
    server.join().unwrap().unwrap();
    assert!(start.elapsed() < Duration::from_secs(5), "the trickle held the job for {:?}", start.elapsed());
    // The trickler was cut off at its handshake deadline, not served.
    let trickled = trickle.join().unwrap();
    assert!(trickled < Duration::from_secs(8), "the trickler was held {trickled:?}");
}

/// Many silent strangers at once (more than rank 0 authenticates at a
/// time), then the real rank: it meets rank 0 without waiting for the
/// strangers' deadlines.
#[test]
fn a_flood_of_connections_does_not_stop_the_job() {
    let (port, key) = (free_port(), secret());
    let server = rank0(port, 2, &key, Duration::from_secs(30));
    let _first = connect_when_up(port);
    let flood: Vec<TcpStream> = (0..100).filter_map(|_| TcpStream::connect(("127.0.0.1", port)).ok()).collect();
    assert!(flood.len() > 64, "only {} connections", flood.len());
    let start = Instant::now();
    let real = Bootstrap::new(1, 2, 1, 2, "127.0.0.1", port).unwrap().with_secret(key).with_timeout(Duration::from_secs(30)).connect().unwrap();
    real.all_gather(b"rank 1").unwrap();
    server.join().unwrap().unwrap();
    assert!(start.elapsed() < Duration::from_secs(4), "the flood held the job {:?}", start.elapsed());
    drop(flood);
}

/// Outsiders that connect without pause, faster than rank 0 can hand each
/// connection to its handshake, keep its accept queue from ever running
/// dry: rank 0 must still give up at its own timeout (a typed error), not
/// when the flood ends.
#[test]
fn a_flood_that_never_pauses_does_not_hold_rank_0_past_its_timeout() {
    let (port, key) = (free_port(), secret());
    let timeout = Duration::from_secs(2);
    let start = Instant::now();
    let server = rank0(port, 2, &key, timeout);
    drop(connect_when_up(port));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flooders: Vec<_> = (0..4)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut made = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                        made += 1;
                    }
                }
                made
            })
        })
        .collect();
    let flood_ends = start + Duration::from_secs(12);
    while !server.is_finished() && Instant::now() < flood_ends {
        std::thread::sleep(Duration::from_millis(10));
    }
    let held = start.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let made: u64 = flooders.into_iter().map(|f| f.join().unwrap()).sum();
    let result = server.join().unwrap();
    assert!(matches!(result, Err(Error::Timeout { .. })), "{result:?}");
    assert!(held < timeout + Duration::from_secs(3), "rank 0 gave up after {held:?} (timeout {timeout:?}; {made} connections)");
}

/// A process listening on MASTER_PORT before rank 0, playing rank 0: rank
/// 0 fails with a typed error naming the port, and a joiner never takes
/// the squatter for rank 0 (it never receives the squatter's job id).
#[test]
fn a_squatter_on_the_port_is_not_taken_for_rank_0() {
    let squat = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = squat.local_addr().unwrap().port();
    let key = secret();
    let served = Bootstrap::new(0, 2, 0, 2, "127.0.0.1", port).unwrap().with_secret(key.clone()).with_timeout(Duration::from_secs(2)).connect();
    match &served {
        Err(Error::Bootstrap { reason, .. }) => assert!(reason.contains("in use"), "{reason}"),
        other => panic!("rank 0 beside a squatter: {other:?}"),
    }
    // The squatter speaks the protocol's shape with a forged proof and a job id.
    let squatter = std::thread::spawn(move || {
        squat.set_nonblocking(true).unwrap();
        let until = Instant::now() + Duration::from_secs(3);
        let mut served = 0;
        while Instant::now() < until {
            let Ok((mut s, _)) = squat.accept() else {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            };
            s.set_nonblocking(false).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
            let frame = |s: &mut TcpStream, m: &[u8]| {
                let _ = s.write_all(&(m.len() as u32).to_le_bytes());
                let _ = s.write_all(m);
            };
            frame(&mut s, &[b"CPEER\x00\x02\x00".as_slice(), &[7u8; 32]].concat());
            let mut hello = [0u8; 4 + 80];
            if s.read_exact(&mut hello).is_ok() {
                served += 1;
            }
            frame(&mut s, &[[9u8; 32].as_slice(), &[0]].concat());
            frame(&mut s, b"attacker-chosen-job");
        }
        served
    });
    let joined = Bootstrap::new(1, 2, 1, 2, "127.0.0.1", port).unwrap().with_secret(key).with_timeout(Duration::from_secs(2)).connect();
    assert!(squatter.join().unwrap() > 0, "the squatter was never reached: the test proves nothing");
    match joined {
        Err(Error::Timeout { .. }) => {}
        Ok(rv) => panic!("joined the squatter's job {:?}", rv.job_id()),
        Err(e) => panic!("{e:?}"),
    }
}

/// MASTER_ADDR that is not an address of this host: rank 0 does not fall
/// back to listening on every interface; it says what to set.
#[test]
fn a_master_addr_not_of_this_host_is_an_error_not_every_interface() {
    let port = free_port();
    // 192.0.2.0/24 is reserved for documentation: no host has it.
    let r = Bootstrap::new(0, 2, 0, 2, "192.0.2.1", port).unwrap().with_secret(secret()).with_timeout(Duration::from_secs(2)).connect();
    match &r {
        Err(Error::Bootstrap { reason, .. }) => assert!(reason.contains("CUDA_PEER_BIND_ADDR"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err(), "something listens on port {port} of the loopback");
    // With an explicit bind address, it listens there.
    let key = secret();
    let k = key.clone();
    let server = std::thread::spawn(move || {
        Bootstrap::new(0, 2, 0, 2, "192.0.2.1", port)
            .unwrap()
            .with_secret(k)
            .with_bind_addr("127.0.0.1")
            .with_timeout(Duration::from_secs(20))
            .connect()
    });
    let real = Bootstrap::new(1, 2, 1, 2, "127.0.0.1", port).unwrap().with_secret(key).with_timeout(Duration::from_secs(20)).connect().unwrap();
    assert_eq!(server.join().unwrap().unwrap().job_id(), real.job_id());
}

/// Ranks on several hosts with no secret are refused before they listen
/// or connect, unless the caller says "insecure".
#[test]
fn ranks_across_hosts_need_a_secret_or_insecure() {
    let port = free_port();
    for rank in [0, 1] {
        let r = Bootstrap::new(rank, 2, 0, 1, "127.0.0.1", port).unwrap().with_timeout(Duration::from_secs(2)).connect();
        match &r {
            Err(Error::Bootstrap { reason, .. }) => assert!(reason.contains("CUDA_PEER_JOB_SECRET"), "{reason}"),
            other => panic!("rank {rank}: {other:?}"),
        }
    }
    let server =
        std::thread::spawn(move || Bootstrap::new(0, 2, 0, 1, "127.0.0.1", port).unwrap().insecure().with_timeout(Duration::from_secs(20)).connect());
    let joined = Bootstrap::new(1, 2, 0, 1, "127.0.0.1", port).unwrap().insecure().with_timeout(Duration::from_secs(20)).connect().unwrap();
    assert_eq!(server.join().unwrap().unwrap().job_id(), joined.job_id());
}

/// A secret from the environment's variables reaches the rendezvous.
#[test]
fn the_secret_comes_from_the_environment() {
    let key = secret();
    let port = free_port();
    let vars = |rank: usize, key: String| {
        move |k: &str| match k {
            "RANK" => Some(rank.to_string()),
            "WORLD_SIZE" => Some("2".into()),
            "LOCAL_WORLD_SIZE" => Some("1".into()),
            "LOCAL_RANK" => Some("0".into()),
            "MASTER_ADDR" => Some("127.0.0.1".into()),
            "MASTER_PORT" => Some(port.to_string()),
            "CUDA_PEER_JOB_SECRET" => Some(key.clone()),
            _ => None,
        }
    };
    let b0 = Bootstrap::from_vars(vars(0, key.expose().to_string())).unwrap();
    assert_eq!(b0.secret.as_ref(), Some(&key));
    let server = std::thread::spawn(move || b0.with_timeout(Duration::from_secs(20)).connect());
    let joined = Bootstrap::from_vars(vars(1, key.expose().to_string())).unwrap().with_timeout(Duration::from_secs(20)).connect().unwrap();
    assert_eq!(server.join().unwrap().unwrap().job_id(), joined.job_id());
}

/// `Duration::MAX` as a timeout is "no bound", not a panic.
#[test]
fn an_unbounded_timeout_does_not_overflow() {
    let (port, key) = (free_port(), secret());
    let (_, took) = real_job(port, 2, &key, Duration::MAX);
    assert!(took < Duration::from_secs(20));
}

/// Without a given secret, ranks of one host meet through a per-user file
/// that rank 0 writes; one left by an earlier job on the same port does
/// not stop them.
#[test]
fn ranks_of_one_host_meet_without_a_given_secret_despite_a_stale_file() {
    let port = free_port();
    let dir = cuda_peer::ipc::secret::local_secret_dir().unwrap();
    let stale = dir.join(format!("rendezvous-{port}.secret"));
    std::fs::write(&stale, "a secret some earlier job left behind").unwrap();
    let handles: Vec<_> = (0..3)
        .map(|r| std::thread::spawn(move || Bootstrap::new(r, 3, r, 3, "127.0.0.1", port).unwrap().with_timeout(Duration::from_secs(20)).connect()))
        .collect();
    let ids: Vec<String> = handles.into_iter().map(|h| h.join().unwrap().unwrap().job_id().to_string()).collect();
    assert!(ids.iter().all(|i| *i == ids[0]));
    assert!(!stale.exists(), "rank 0 leaves its secret file behind");
}

/// An exchange that returns fewer blobs than ranks (a framework's store
/// gone wrong) is an error, never an out-of-bounds panic.
#[test]
fn an_exchange_that_returns_too_few_blobs_is_an_error() {
    struct Short;
    impl Exchange for Short {
        fn rank(&self) -> usize {
            1
        }
        fn size(&self) -> usize {
            4
        }
        fn job_id(&self) -> &str {
            "short"
        }
        fn all_gather(&self, _: &[u8]) -> cuda_peer::Result<Vec<Vec<u8>>> {
            Ok(vec![])
        }
    }
    let r = spans_hosts(&Short);
    assert!(matches!(&r, Err(Error::Bootstrap { reason, .. }) if reason.contains("0 blobs for 4 ranks")), "{r:?}");
    let r = cuda_peer::driver::context(0).and_then(|c| cuda_peer::Comm::from_exchange(c.default_stream(), Box::new(Short), &Default::default()));
    if matches!(r, Err(Error::NoDevice | Error::Load(_) | Error::DeviceOutOfRange { .. })) {
        return; // no GPU: the exchange is checked above by spans_hosts
    }
    assert!(matches!(&r, Err(Error::Bootstrap { reason, .. }) if reason.contains("0 blobs for 4 ranks")), "{:?}", r.err());
    assert!(Short.barrier().is_err());
}
