//! Attacks on the descriptor channel between the processes of one host
//! (`ipc::fdpass`), as an outsider or a confused process would make them:
//! a descriptor sent from another uid, a header that forges another rank's
//! number, connections that are malformed, silent or closed, a socket that
//! is not the published rank's, guessing the listeners' names, and
//! unbounded timeouts. No GPU is needed.
//!
//! The attackers that must be other processes are this test binary itself,
//! run again with `--exact attacker_process_helper_acts_only_when_spawned`
//! and the attack named in its environment; the other uid is 65534, through
//! `setpriv` (as root; otherwise that test prints `SKIPPED` and passes).
#![cfg(target_os = "linux")]

use cuda_peer::ipc::fdpass::{send_fd, FdListener, Header, PeerAddr, HEADER_BYTES};
use cuda_peer::Error;
use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use std::io::{BufRead, BufReader, IoSlice, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The attack a spawned helper makes, and the victim's published address.
const MODE: &str = "CUDA_PEER_ATTACK_MODE";
const NAME: &str = "CUDA_PEER_ATTACK_NAME";
const PID: &str = "CUDA_PEER_ATTACK_PID";
const UID: &str = "CUDA_PEER_ATTACK_UID";
/// The helper's test name.
const HELPER: &str = "attacker_process_helper_acts_only_when_spawned";

const T: Duration = Duration::from_secs(10);

/// A line on the real stderr (libtest captures `eprintln!`, not this).
fn skipped(test: &str, why: &str) {
    let _ = writeln!(std::io::stderr().lock(), "SKIPPED {test}: {why}");
}

/// A line on the real stdout, read by the test that spawned this process.
fn report(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn memfd_with(content: &[u8]) -> OwnedFd {
    let fd = rustix::fs::memfd_create("attack", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    assert_eq!(rustix::io::write(&fd, content).unwrap(), content.len());
    fd
}

fn content_of(fd: &OwnedFd) -> Vec<u8> {
    let mut buf = vec![0u8; 64];
    let n = rustix::io::pread(fd, &mut buf, 0).unwrap();
    buf.truncate(n);
    buf
}

/// Connects to `name` and sends `bytes` with `fds`, by hand (no checks).
fn raw_send(name: &str, bytes: &[u8], fds: &[BorrowedFd<'_>]) {
    let s = UnixStream::connect_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
    }
    assert_eq!(rustix::net::sendmsg(&s, &[IoSlice::new(bytes)], &mut control, SendFlags::empty()).unwrap(), bytes.len());
}

/// `n` ranks that are threads of this process.
fn ranks(n: usize) -> (Vec<FdListener>, Vec<PeerAddr>) {
    let listeners: Vec<_> = (0..n).map(|r| FdListener::bind(r).unwrap()).collect();
    let addrs = listeners.iter().map(FdListener::addr).collect();
    (listeners, addrs)
}

/// Starts `cmd` (this binary's helper, possibly behind `setpriv`) against
/// `victim` and waits until it has reported every line of `expect`: its
/// connections are then queued at the victim. It stays alive (and its pid
/// its own) until its stdin closes.
fn start_attacker(mut cmd: Command, mode: &str, victim: &PeerAddr, expect: &[&str]) -> Child {
    cmd.args(["--exact", HELPER, "--test-threads=1"])
        .env(MODE, mode)
        .env(NAME, &victim.name)
        .env(PID, victim.pid.to_string())
        .env(UID, victim.uid.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = cmd.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    // Read on a thread, so that an attacker that never reports is a
    // failure, not a hang; and to its end, so that its last lines do not
    // meet a closed pipe.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let _ = tx.send(line);
        }
    });
    let end = Instant::now() + Duration::from_secs(60);
    let mut seen: Vec<String> = Vec::new();
    // libtest's own output shares the lines: a report is found within one.
    while !expect.iter().all(|e| seen.iter().any(|s| s.contains(e))) {
        match rx.recv_timeout(end.saturating_duration_since(Instant::now())) {
            Ok(Ok(l)) => seen.push(l),
            other => {
                let _ = child.kill();
                let status = child.wait();
                panic!("the attacker ended or went quiet ({other:?}, {status:?}) after reporting {seen:?}, not all of {expect:?}");
            }
        }
    }
    child
}

/// Lets the attacker end, and checks that its own assertions held.
fn finish(mut child: Child) {
    drop(child.stdin.take());
    let status = child.wait().unwrap();
    assert!(status.success(), "the attacker failed: {status:?}");
}

/// The helper process of the attacks below; as a test of its own (no
/// attack in its environment), it does nothing.
#[test]
fn attacker_process_helper_acts_only_when_spawned() {
    let Ok(mode) = std::env::var(MODE) else { return };
    let var = |k: &str| std::env::var(k).unwrap();
    let victim = PeerAddr { name: var(NAME), pid: var(PID).parse().unwrap(), uid: var(UID).parse().unwrap() };
    match mode.as_str() {
        "other-uid" => {
            let fd = memfd_with(b"from the other uid");
            // The library sends nothing to a socket of another uid.
            let r = send_fd(&victim, 0, fd.as_fd(), 7, T);
            assert!(matches!(&r, Err(Error::Bootstrap { reason, .. }) if reason.contains("nothing sent")), "{r:?}");
            report("send_fd refused");
            // By hand, as the attack was made: a header claiming rank 0.
            raw_send(&victim.name, &Header { from: 0, tag: 7 }.encode(), &[fd.as_fd()]);
            report("raw sent");
        }
        "forge-rank" => {
            // The victim's socket is genuine, so send_fd sends; the lie is
            // the rank in the header.
            send_fd(&victim, 0, memfd_with(b"forged as rank 0").as_fd(), 7, T).unwrap();
            report("forged sent");
            send_fd(&victim, 2, memfd_with(b"rank 2").as_fd(), 9, T).unwrap();
            report("rank 2 sent");
        }
        other => panic!("unknown attack {other}"),
    }
    // Alive (its pid in use) until the test is done with its connections.
    let mut rest = String::new();
    let _ = std::io::stdin().read_line(&mut rest);
}

/// `setpriv` on the PATH.
fn setpriv() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join("setpriv")).find(|p| p.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

/// Whether a process of another uid (and none of our groups) can run `exe`.
fn runnable_by_others(exe: &Path) -> bool {
    let mode = |p: &Path| p.metadata().map(|m| m.permissions().mode()).unwrap_or(0);
    mode(exe) & 0o005 == 0o005 && exe.ancestors().skip(1).all(|d| mode(d) & 0o001 != 0)
}

#[test]
fn a_descriptor_sent_from_another_uid_is_dropped_and_the_real_one_arrives() {
    const TEST: &str = "a_descriptor_sent_from_another_uid_is_dropped_and_the_real_one_arrives";
    if !rustix::process::geteuid().is_root() {
        return skipped(TEST, "not root: cannot start a process of uid 65534");
    }
    let Some(setpriv) = setpriv() else { return skipped(TEST, "no setpriv on the PATH") };
    let exe = std::env::current_exe().unwrap();
    if !runnable_by_others(&exe) {
        return skipped(TEST, &format!("{} is not readable and executable by uid 65534", exe.display()));
    }
    let (l, peers) = ranks(2);
    let mut cmd = Command::new(setpriv);
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"]).arg(&exe);
    let attacker = start_attacker(cmd, "other-uid", &peers[1], &["send_fd refused", "raw sent"]);
    // The real rank 0 (a thread of this process).
    send_fd(&peers[1], 0, memfd_with(b"rank 0").as_fd(), 1, T).unwrap();
    let got = l[1].receive(&peers, 1, T).unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].from, got[0].tag, content_of(&got[0].fd)), (0, 1, b"rank 0".to_vec()));
    // Both of the stranger's connections (send_fd's and the raw one) were
    // seen and dropped.
    assert_eq!(l[1].refused(), 2);
    finish(attacker);
}

#[test]
fn a_header_forging_another_ranks_number_is_dropped_and_ranks_are_attributed_by_pid() {
    // Ranks 0 and 1 are threads of this process; rank 2 is the attacker,
    // which also claims to be rank 0.
    let (l, mut peers) = ranks(2);
    let attacker = start_attacker(Command::new(std::env::current_exe().unwrap()), "forge-rank", &peers[1], &["forged sent", "rank 2 sent"]);
    let unused = FdListener::bind(2).unwrap();
    peers.push(PeerAddr { name: unused.name().to_string(), pid: attacker.id(), uid: peers[0].uid });
    send_fd(&peers[1], 0, memfd_with(b"rank 0").as_fd(), 5, T).unwrap();
    let mut got: Vec<_> = l[1].receive(&peers, 2, T).unwrap().into_iter().map(|g| (g.from, g.tag, content_of(&g.fd))).collect();
    got.sort();
    assert_eq!(got, vec![(0, 5, b"rank 0".to_vec()), (2, 9, b"rank 2".to_vec())]);
    assert_eq!(l[1].refused(), 1, "the forged message was seen and dropped");
    finish(attacker);
}

#[test]
fn malformed_and_misattributed_messages_from_a_job_process_are_dropped_without_failing_the_receive() {
    let (l, peers) = ranks(3);
    let victim = &peers[1].name;
    let fd = memfd_with(b"stray");
    let good = Header { from: 0, tag: 1 }.encode();
    let mut wrong_magic = good;
    wrong_magic[0] ^= 0xff;
    let mut long = good.to_vec();
    long.push(0);
    let strays: Vec<(&str, Vec<u8>, usize)> = vec![
        ("wrong magic", wrong_magic.to_vec(), 1),
        ("short header", good[..HEADER_BYTES - 4].to_vec(), 1),
        ("long message", long, 1),
        ("no descriptor", good.to_vec(), 0),
        ("two descriptors", good.to_vec(), 2),
        ("rank out of range", Header { from: 99, tag: 1 }.encode().to_vec(), 1),
        ("the receiver's own rank", Header { from: 1, tag: 1 }.encode().to_vec(), 1),
    ];
    for (_, bytes, nfds) in &strays {
        let fds: Vec<BorrowedFd<'_>> = (0..*nfds).map(|_| fd.as_fd()).collect();
        raw_send(victim, bytes, &fds);
    }
    // And one that closes without a word.
    drop(UnixStream::connect_addr(&SocketAddr::from_abstract_name(victim.as_bytes()).unwrap()).unwrap());
    send_fd(&peers[1], 2, memfd_with(b"rank 2").as_fd(), 3, T).unwrap();
    let got = l[1].receive(&peers, 1, T).unwrap();
    assert_eq!((got[0].from, got[0].tag, content_of(&got[0].fd)), (2, 3, b"rank 2".to_vec()));
    assert_eq!(l[1].refused(), strays.len() + 1);
}

#[test]
fn a_silent_connection_from_a_job_process_does_not_hold_the_receive() {
    let (l, peers) = ranks(2);
    let addr = SocketAddr::from_abstract_name(peers[1].name.as_bytes()).unwrap();
    let _silent = UnixStream::connect_addr(&addr).unwrap();
    send_fd(&peers[1], 0, memfd_with(b"rank 0").as_fd(), 4, T).unwrap();
    let start = Instant::now();
    let got = l[1].receive(&peers, 1, Duration::from_secs(60)).unwrap();
    assert!(start.elapsed() < Duration::from_secs(3), "{:?}", start.elapsed());
    assert_eq!((got[0].from, content_of(&got[0].fd)), (0, b"rank 0".to_vec()));
    // With only a silent connection, the receive ends at its deadline.
    let _silent = UnixStream::connect_addr(&addr).unwrap();
    let start = Instant::now();
    let r = l[1].receive(&peers, 1, Duration::from_millis(300));
    assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    assert!(start.elapsed() < Duration::from_secs(3), "{:?}", start.elapsed());
}

#[test]
fn a_socket_not_owned_by_the_published_pid_is_sent_nothing() {
    let (l, peers) = ranks(2);
    // Rank 1 published pid 1; the socket at its name is this process's (a
    // process that took the name after rank 1 exited, say).
    let squatted = PeerAddr { pid: 1, ..peers[1].clone() };
    let r = send_fd(&squatted, 0, memfd_with(b"secret").as_fd(), 1, T);
    assert!(matches!(&r, Err(Error::Bootstrap { reason, .. }) if reason.contains("nothing sent")), "{r:?}");
    // The connection was made, and carried nothing.
    let r = l[1].receive(&peers, 1, Duration::from_millis(300));
    assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    assert_eq!(l[1].refused(), 1);
}

#[test]
fn listener_names_are_random_and_not_predictable_from_the_rank() {
    // Names a stranger could have predicted before: taken, they block nothing.
    let _squatters: Vec<_> = (0..2)
        .map(|r| std::os::unix::net::UnixListener::bind_addr(&SocketAddr::from_abstract_name(format!("cuda-peer/job/{r}")).unwrap()).unwrap())
        .collect();
    let names: Vec<String> = (0..8).map(|_| FdListener::bind(0).unwrap().name().to_string()).collect();
    for (i, n) in names.iter().enumerate() {
        assert!(PeerAddr::valid_name(n), "{n}");
        assert!(!names[..i].contains(n), "{n} twice");
    }
    // Two listeners of one rank at once.
    let (a, b) = (FdListener::bind(0).unwrap(), FdListener::bind(0).unwrap());
    assert_ne!(a.name(), b.name());
}

#[test]
fn duration_max_timeouts_do_not_panic() {
    let (l, peers) = ranks(2);
    send_fd(&peers[1], 0, memfd_with(b"rank 0").as_fd(), 2, Duration::MAX).unwrap();
    let got = l[1].receive(&peers, 1, Duration::MAX).unwrap();
    assert_eq!((got[0].from, got[0].tag), (0, 2));
    // Zero: no waiting at all, still no panic.
    assert!(matches!(l[1].receive(&peers, 1, Duration::ZERO), Err(Error::Timeout { .. })));
}
