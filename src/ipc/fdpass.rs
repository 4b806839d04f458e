//! File descriptors between the processes of one host, with access control.
//!
//! Each rank listens on a Unix domain socket in the abstract namespace at
//! an unguessable name (`cuda-peer/` and 32 hex digits of
//! `getrandom`), and publishes that name, its process id and its
//! effective uid to the job's other ranks ([`PeerAddr`], in the
//! communicator's creation all-gather). A rank sends a descriptor to a peer
//! by connecting to the peer's published name and sending one message:
//! a header ([`Header`]: the sender's rank and a tag) with the descriptor
//! attached (`SCM_RIGHTS`).
//!
//! Abstract sockets have no permissions and their names can be listed
//! (`/proc/net/unix`), so both ends check the other's kernel credentials
//! (`SO_PEERCRED`):
//!
//! * [`send_fd`] sends nothing unless the listening socket belongs to this
//!   process's uid and to the pid that the peer published (a process that
//!   took the name after the peer exited is refused);
//! * [`FdListener::receive`] drops (and logs) every connection from
//!   another uid or from a pid that is no rank of the job, without reading
//!   it, and accepts a message only if the connection's pid is the pid
//!   published by the rank its header names: the header only chooses
//!   among the ranks of one process (ranks that are threads of one
//!   process share a pid). Malformed messages, connections that close or
//!   stay silent are dropped; none of them fails the receive, which ends
//!   when the expected descriptors came or at its deadline.
//!
//! The credentials are compared within one pid namespace: ranks must see
//! each other's pids (as processes of one container or of the host do).
//!
//! Sending does not wait for the peer to accept: the connection waits in
//! the listener's backlog and the message in its buffer, so every rank can
//! first send to every peer and then receive from every peer, without a
//! cycle of ranks waiting for each other. The listener reads its pending
//! connections side by side (none waits for another), each within its own
//! short deadline.

use super::wire::{deadline, io_err};
use crate::error::{Error, Result};
use rustix::net::{
    recvmsg, sendmsg, AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer, SendAncillaryMessage,
    SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};
use rustix::process::{geteuid, getpid};
use std::io::{ErrorKind, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

fn errno(op: &'static str) -> impl Fn(rustix::io::Errno) -> Error {
    move |e| Error::Bootstrap { op, reason: e.to_string() }
}

/// Bytes of a message's header (see [`Header`]).
pub const HEADER_BYTES: usize = 16;

/// The first bytes of every header.
const MAGIC: [u8; 4] = *b"CPfd";

/// The prefix of every listener's name.
const NAME_PREFIX: &str = "cuda-peer/";

/// Random bytes in a listener's name (printed as twice as many hex digits).
const NAME_RANDOM_BYTES: usize = 16;

/// How long a connection from a rank's process may stay silent after it
/// was accepted (within the receive's own deadline).
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(5);

/// The most connections from the job's processes read at a time; more
/// are dropped.
const MAX_PENDING: usize = 64;

/// The most connections accepted between two looks at the pending ones and
/// the deadline (a stream of strangers' connections cannot hold the
/// receive past its deadline).
const ACCEPTS_PER_ROUND: usize = 256;

/// The header of a message: `"CPfd"`, the sender's rank (`u32`, little
/// endian) and a tag (`u64`, little endian). The rank is only a claim: the
/// receiver accepts it where the connection's credentials are that rank's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The rank the sender says it is.
    pub from: u32,
    /// The sender's tag.
    pub tag: u64,
}

impl Header {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut out = [0u8; HEADER_BYTES];
        let (magic, rest) = out.split_at_mut(4);
        let (rank, tag) = rest.split_at_mut(4);
        magic.copy_from_slice(&MAGIC);
        rank.copy_from_slice(&self.from.to_le_bytes());
        tag.copy_from_slice(&self.tag.to_le_bytes());
        out
    }

    /// The header in `bytes`: exactly [`HEADER_BYTES`] starting with the
    /// magic; else what is wrong.
    pub fn parse(bytes: &[u8]) -> std::result::Result<Header, &'static str> {
        let bytes: &[u8; HEADER_BYTES] = bytes.try_into().map_err(|_| "a message that is not one header long")?;
        let (magic, rest) = bytes.split_at(4);
        let (rank, tag) = rest.split_at(4);
        if magic != MAGIC {
            return Err("a message without the header's magic");
        }
        let rank: [u8; 4] = rank.try_into().map_err(|_| "a short header")?;
        let tag: [u8; 8] = tag.try_into().map_err(|_| "a short header")?;
        Ok(Header { from: u32::from_le_bytes(rank), tag: u64::from_le_bytes(tag) })
    }
}

/// Where a rank receives descriptors, as it publishes it to the other
/// ranks: its listener's abstract name, its process id and effective uid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerAddr {
    /// The listener's abstract socket name ([`Self::valid_name`]).
    pub name: String,
    /// The process id of the rank (the listener's owner).
    pub pid: u32,
    /// The rank's effective uid.
    pub uid: u32,
}

impl PeerAddr {
    /// Whether `name` has the form of a listener's name: `cuda-peer/` and
    /// 32 lowercase hex digits.
    pub fn valid_name(name: &str) -> bool {
        name.strip_prefix(NAME_PREFIX)
            .is_some_and(|h| h.len() == 2 * NAME_RANDOM_BYTES && h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
    }
}

/// A fresh listener name from the kernel's random bytes.
fn random_name() -> Result<String> {
    let mut bytes = [0u8; NAME_RANDOM_BYTES];
    let mut filled = 0;
    while filled < bytes.len() {
        let rest = bytes.get_mut(filled..).unwrap_or_default();
        match rustix::rand::getrandom(rest, rustix::rand::GetRandomFlags::empty()) {
            Ok(got) => filled += got,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(errno("fd passing: getrandom")(e)),
        }
    }
    let mut name = String::from(NAME_PREFIX);
    for b in bytes {
        name.push_str(&format!("{b:02x}"));
    }
    Ok(name)
}

/// A Unix socket peer's credentials, as `SO_PEERCRED` gives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Credentials {
    /// Its process id in this process's pid namespace (0: outside it).
    pid: i32,
    /// Its effective uid.
    uid: u32,
}

/// `getsockopt(SOL_SOCKET, SO_PEERCRED)` on `fd`, read into plain integers
/// (the kernel reports pid 0 for a peer outside this pid namespace, which a
/// non-zero pid type cannot hold).
fn peer_credentials(fd: BorrowedFd<'_>) -> std::io::Result<Credentials> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred { pid: 0, uid: u32::MAX, gid: u32::MAX };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, a live
    // `struct ucred` of that size, and the new length into `len`; `fd` is
    // open for the call. Every bit pattern is a valid `ucred` (plain integers).
    let rc = unsafe { libc::getsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&mut cred as *mut libc::ucred).cast(), &mut len) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if len as usize != std::mem::size_of::<libc::ucred>() {
        return Err(std::io::Error::other(format!("SO_PEERCRED returned {len} bytes")));
    }
    Ok(Credentials { pid: cred.pid, uid: cred.uid })
}

/// This process's effective uid.
fn our_uid() -> u32 {
    geteuid().as_raw()
}

/// This process's id.
fn our_pid() -> u32 {
    getpid().as_raw_nonzero().get().unsigned_abs()
}

/// One rank's socket for receiving descriptors (closed on drop; an
/// abstract socket leaves no file behind).
#[derive(Debug)]
pub struct FdListener {
    listener: UnixListener,
    rank: usize,
    name: String,
    refused: AtomicUsize,
}

/// A descriptor received from a peer.
#[derive(Debug)]
pub struct ReceivedFd {
    /// The sender's rank: one whose published pid is the connection's.
    pub from: usize,
    /// The sender's tag.
    pub tag: u64,
    /// The descriptor (a new one in this process, close-on-exec).
    pub fd: OwnedFd,
}

/// A connection accepted from one of the job's processes, not yet read.
struct Pending {
    stream: UnixStream,
    pid: u32,
    until: Instant,
}

/// What reading a pending connection gave.
enum Read {
    /// Nothing yet.
    NotYet,
    /// A message: its header and descriptor.
    Message(Header, OwnedFd),
    /// Something to drop: why.
    Drop(String),
}

impl FdListener {
    /// Listens as `rank` at a fresh random name ([`Self::addr`] is what to
    /// publish to the peers).
    pub fn bind(rank: usize) -> Result<FdListener> {
        let mut last = None;
        // A name already taken is another random name away.
        for _ in 0..4 {
            let name = random_name()?;
            let addr = SocketAddr::from_abstract_name(name.as_bytes()).map_err(io_err("fd passing: socket name"))?;
            match UnixListener::bind_addr(&addr) {
                Ok(listener) => {
                    listener.set_nonblocking(true).map_err(io_err("fd passing: listener"))?;
                    return Ok(FdListener { listener, rank, name, refused: AtomicUsize::new(0) });
                }
                Err(e) if e.kind() == ErrorKind::AddrInUse => last = Some(e),
                Err(e) => return Err(io_err("fd passing: bind")(e)),
            }
        }
        Err(io_err("fd passing: bind")(last.unwrap_or_else(|| std::io::Error::from(ErrorKind::AddrInUse))))
    }

    /// The rank this listener serves.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The listener's abstract socket name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What the peers need to send here: the name, this process's id and
    /// effective uid.
    pub fn addr(&self) -> PeerAddr {
        PeerAddr { name: self.name.clone(), pid: our_pid(), uid: our_uid() }
    }

    /// How many connections this listener has dropped so far (strangers,
    /// forged ranks, malformed or silent connections).
    pub fn refused(&self) -> usize {
        self.refused.load(Ordering::Relaxed)
    }

    fn refuse(&self, why: std::fmt::Arguments<'_>) {
        self.refused.fetch_add(1, Ordering::Relaxed);
        log::warn!("cuda-peer: rank {}'s descriptor socket: dropped {why}", self.rank);
    }

    /// Receives `count` descriptors (one per connection) from the ranks
    /// `peers` describes (by rank; this rank's own entry is never a sender),
    /// waiting at most `timeout` in all: [`Error::Timeout`] when they do not
    /// all come. Connections that are not from those ranks, or not well
    /// formed, are dropped and logged (see the module docs); they never fail
    /// the receive.
    pub fn receive(&self, peers: &[PeerAddr], count: usize, timeout: Duration) -> Result<Vec<ReceivedFd>> {
        let end = deadline(timeout);
        let mut out = Vec::with_capacity(count.min(peers.len().saturating_mul(4)));
        let mut pending: Vec<Pending> = Vec::new();
        while out.len() < count {
            let mut progress = false;
            for _ in 0..ACCEPTS_PER_ROUND {
                match self.listener.accept() {
                    Ok((stream, _)) => {
                        progress = true;
                        self.admit(stream, peers, end, &mut pending);
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) => return Err(io_err("fd passing: accept")(e)),
                }
            }
            let mut i = 0;
            while i < pending.len() && out.len() < count {
                let Some(p) = pending.get(i) else { break };
                match read_message(&p.stream) {
                    Read::NotYet if Instant::now() <= p.until => i += 1,
                    Read::NotYet => {
                        self.refuse(format_args!("a connection from pid {} that sent nothing in time", p.pid));
                        pending.remove(i);
                    }
                    Read::Drop(why) => {
                        progress = true;
                        self.refuse(format_args!("a connection from pid {}: {why}", p.pid));
                        pending.remove(i);
                    }
                    Read::Message(header, fd) => {
                        progress = true;
                        match self.attribute(&header, p.pid, peers) {
                            Ok(from) => out.push(ReceivedFd { from, tag: header.tag, fd }),
                            Err(why) => self.refuse(format_args!("a connection from pid {}: {why}", p.pid)),
                        }
                        pending.remove(i);
                    }
                }
            }
            if out.len() >= count {
                break;
            }
            if Instant::now() > end {
                return Err(Error::Timeout { op: "fd passing (waiting for the peers' descriptors)", after: timeout });
            }
            if !progress {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        Ok(out)
    }

    /// Checks a new connection's credentials: from this uid and a pid of
    /// one of `peers`, it waits to be read; else it is dropped unread.
    fn admit(&self, stream: UnixStream, peers: &[PeerAddr], end: Instant, pending: &mut Vec<Pending>) {
        let cred = match peer_credentials(stream.as_fd()) {
            Ok(c) => c,
            Err(e) => return self.refuse(format_args!("a connection without credentials ({e})")),
        };
        if cred.uid != our_uid() {
            return self.refuse(format_args!("a connection from uid {} (pid {}), not this job's uid {}", cred.uid, cred.pid, our_uid()));
        }
        let pid = u32::try_from(cred.pid).unwrap_or(0);
        if pid == 0 || !peers.iter().any(|p| p.pid == pid) {
            return self.refuse(format_args!("a connection from pid {}, which is no rank of this job", cred.pid));
        }
        if pending.len() >= MAX_PENDING {
            return self.refuse(format_args!("a connection from pid {pid}: {MAX_PENDING} connections already wait"));
        }
        let until = Instant::now().checked_add(CONNECTION_TIMEOUT).map_or(end, |t| t.min(end));
        pending.push(Pending { stream, pid, until });
    }

    /// The rank a message comes from: the one its header names, if that
    /// rank published the connection's pid (and is not this one).
    fn attribute(&self, header: &Header, pid: u32, peers: &[PeerAddr]) -> std::result::Result<usize, String> {
        let from = usize::try_from(header.from).map_err(|_| format!("a header claiming rank {}", header.from))?;
        let Some(peer) = peers.get(from) else {
            return Err(format!("a header claiming rank {from} of {}", peers.len()));
        };
        if from == self.rank {
            return Err(format!("a header claiming this rank ({from})"));
        }
        if peer.pid != pid {
            return Err(format!("a header claiming rank {from}, whose pid is {}", peer.pid));
        }
        Ok(from)
    }
}

/// Reads one message from `stream` without waiting.
fn read_message(stream: &UnixStream) -> Read {
    // One byte more than a header: a longer message is refused, not cut.
    let mut buf = [0u8; HEADER_BYTES + 1];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = loop {
        match recvmsg(stream.as_fd(), &mut [IoSliceMut::new(&mut buf)], &mut control, RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT) {
            Ok(m) => break m,
            Err(rustix::io::Errno::INTR) => continue,
            Err(rustix::io::Errno::AGAIN) => return Read::NotYet,
            Err(e) => return Read::Drop(format!("recvmsg: {e}")),
        }
    };
    // Every descriptor received is owned here (and closed unless kept).
    let mut fds: Vec<OwnedFd> = Vec::new();
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = msg {
            fds.extend(received);
        }
    }
    if got.bytes == 0 {
        return Read::Drop("closed without a message".into());
    }
    if got.flags.contains(ReturnFlags::CTRUNC) {
        return Read::Drop("a message with more ancillary data than one descriptor".into());
    }
    let header = match Header::parse(buf.get(..got.bytes).unwrap_or_default()) {
        Ok(h) => h,
        Err(why) => return Read::Drop(format!("{why} ({} bytes)", got.bytes)),
    };
    let n = fds.len();
    match (fds.pop(), n) {
        (Some(fd), 1) => Read::Message(header, fd),
        _ => Read::Drop(format!("a message with {n} descriptors, not 1")),
    }
}

/// Sends `fd` with `tag` as rank `from` to the rank that published `peer`
/// (whose [`FdListener`] must be bound already), retrying the connection
/// until `timeout`. Sends nothing, and returns [`Error::Bootstrap`], where
/// the socket at `peer.name` does not belong to this uid and to
/// `peer.pid`.
pub fn send_fd(peer: &PeerAddr, from: usize, fd: BorrowedFd<'_>, tag: u64, timeout: Duration) -> Result<()> {
    const OP: &str = "fd passing";
    let end = deadline(timeout);
    if !PeerAddr::valid_name(&peer.name) {
        return Err(Error::Bootstrap { op: OP, reason: format!("{:?} is not a descriptor socket's name", peer.name) });
    }
    let from = u32::try_from(from).map_err(|_| Error::InvalidArgument(format!("fd passing: rank {from}")))?;
    let addr = SocketAddrUnix::new_abstract_name(peer.name.as_bytes()).map_err(errno("fd passing: socket name"))?;
    let socket = loop {
        let s = rustix::net::socket_with(AddressFamily::UNIX, SocketType::STREAM, SocketFlags::CLOEXEC | SocketFlags::NONBLOCK, None)
            .map_err(errno("fd passing: socket"))?;
        match rustix::net::connect(&s, &addr) {
            Ok(()) => break s,
            Err(rustix::io::Errno::INTR) => continue,
            // No listener (yet, or any more), or its backlog is full.
            Err(e @ (rustix::io::Errno::CONNREFUSED | rustix::io::Errno::AGAIN | rustix::io::Errno::NOENT)) => {
                if Instant::now() > end {
                    log::warn!("cuda-peer: cannot reach the descriptor socket {} of pid {}: {e}", peer.name, peer.pid);
                    return Err(Error::Timeout { op: "fd passing (connecting to a peer)", after: timeout });
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(errno("fd passing: connect")(e)),
        }
    };
    let cred = peer_credentials(socket.as_fd()).map_err(io_err("fd passing: SO_PEERCRED"))?;
    if cred.uid != our_uid() || u32::try_from(cred.pid).ok() != Some(peer.pid) {
        let reason = format!(
            "the socket {} belongs to pid {} of uid {}, not to the rank's pid {} of uid {}: nothing sent",
            peer.name,
            cred.pid,
            cred.uid,
            peer.pid,
            our_uid()
        );
        log::warn!("cuda-peer: {reason}");
        return Err(Error::Bootstrap { op: OP, reason });
    }
    let header = Header { from, tag }.encode();
    let fds = [fd];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(Error::Internal("fd passing: ancillary buffer too small".into()));
    }
    let sent = loop {
        match sendmsg(&socket, &[IoSlice::new(&header)], &mut control, SendFlags::DONTWAIT | SendFlags::NOSIGNAL) {
            Ok(n) => break n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(rustix::io::Errno::AGAIN) if Instant::now() <= end => std::thread::sleep(Duration::from_millis(1)),
            Err(rustix::io::Errno::AGAIN) => return Err(Error::Timeout { op: "fd passing (sending to a peer)", after: timeout }),
            Err(e) => return Err(errno("fd passing: sendmsg")(e)),
        }
    };
    if sent != HEADER_BYTES {
        return Err(Error::Bootstrap { op: OP, reason: format!("sent {sent} of {HEADER_BYTES} bytes") });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::io::{Read as _, Write};

    /// `n` ranks that are threads of this process.
    fn ranks(n: usize) -> (Vec<FdListener>, Vec<PeerAddr>) {
        let listeners: Vec<_> = (0..n).map(|r| FdListener::bind(r).unwrap()).collect();
        let addrs = listeners.iter().map(FdListener::addr).collect();
        (listeners, addrs)
    }

    #[test]
    fn a_descriptor_crosses_between_threads_and_still_works() {
        let (mut l, addrs) = ranks(4);
        let listener = l.remove(0);
        // One end of a socket pair travels; we write through the other.
        let (mut ours, theirs) = UnixStream::pair().unwrap();
        let to = addrs[0].clone();
        let sender = std::thread::spawn(move || send_fd(&to, 3, theirs.as_fd(), 0xfeed, Duration::from_secs(5)));
        let got = listener.receive(&addrs, 1, Duration::from_secs(5)).unwrap();
        sender.join().unwrap().unwrap();
        assert_eq!((got[0].from, got[0].tag), (3, 0xfeed));
        let mut received = UnixStream::from(got.into_iter().next().unwrap().fd);
        ours.write_all(b"through the passed fd").unwrap();
        let mut buf = [0u8; 21];
        received.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"through the passed fd");
        assert_eq!(listener.refused(), 0);
    }

    #[test]
    fn every_rank_sends_then_receives_without_deadlock() {
        let n = 4;
        let (listeners, addrs) = ranks(n);
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(r, l)| {
                let addrs = addrs.clone();
                std::thread::spawn(move || {
                    let file = std::fs::File::open("/proc/self/exe").unwrap();
                    for p in (0..n).filter(|&p| p != r) {
                        send_fd(&addrs[p], r, file.as_fd(), r as u64 * 100 + p as u64, Duration::from_secs(5)).unwrap();
                    }
                    let mut got: Vec<_> = l.receive(&addrs, n - 1, Duration::from_secs(5)).unwrap().into_iter().map(|g| (g.from, g.tag)).collect();
                    got.sort();
                    assert_eq!(got, (0..n).filter(|&p| p != r).map(|p| (p, p as u64 * 100 + r as u64)).collect::<Vec<_>>());
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }

    #[test]
    fn a_peer_that_never_sends_is_a_bounded_timeout() {
        let (l, addrs) = ranks(1);
        let start = Instant::now();
        let r = l[0].receive(&addrs, 1, Duration::from_millis(200));
        assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
        assert!(start.elapsed() < Duration::from_secs(3));
        // A name nobody listens at: the connection is retried until the timeout.
        let gone = PeerAddr { name: format!("{NAME_PREFIX}{}", "0".repeat(32)), pid: our_pid(), uid: our_uid() };
        let r = send_fd(&gone, 0, l[0].listener.as_fd(), 0, Duration::from_millis(100));
        assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    }

    #[test]
    fn listener_names_are_random_and_well_formed() {
        let a = FdListener::bind(0).unwrap();
        let b = FdListener::bind(0).unwrap();
        assert_ne!(a.name(), b.name());
        assert!(PeerAddr::valid_name(a.name()) && PeerAddr::valid_name(b.name()), "{} {}", a.name(), b.name());
        assert!(!PeerAddr::valid_name("cuda-peer/job/0"));
        assert!(!PeerAddr::valid_name(&format!("{NAME_PREFIX}{}", "A".repeat(32))));
        assert!(!PeerAddr::valid_name(&format!("{NAME_PREFIX}{}", "a".repeat(33))));
    }

    #[test]
    fn our_credentials_read_through_so_peercred_match_rustix() {
        let (a, _b) = UnixStream::pair().unwrap();
        let ours = peer_credentials(a.as_fd()).unwrap();
        let theirs = rustix::net::sockopt::socket_peercred(&a).unwrap();
        assert_eq!(ours, Credentials { pid: theirs.pid.as_raw_nonzero().get(), uid: theirs.uid.as_raw() });
        assert_eq!((ours.pid as u32, ours.uid), (our_pid(), our_uid()));
    }

    #[test]
    fn deadline_of_duration_max_does_not_panic_and_is_far() {
        let d = deadline(Duration::MAX);
        assert!(d > Instant::now() + Duration::from_secs(365 * 24 * 3600));
        let soon = deadline(Duration::from_millis(10));
        assert!(soon <= Instant::now() + Duration::from_secs(1));
    }

    #[test]
    fn headers_round_trip_and_bad_ones_are_named() {
        let h = Header { from: 7, tag: 1 << 63 | 4096 };
        assert_eq!(Header::parse(&h.encode()), Ok(h));
        assert!(Header::parse(&h.encode()[..12]).is_err());
        let mut bad = h.encode();
        bad[0] ^= 1;
        assert!(Header::parse(&bad).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Any bytes: no panic, and accepted only as exactly one header with
        /// the magic, whose fields are then the bytes'.
        #[test]
        fn header_parsing_never_panics_and_accepts_only_headers(bytes in proptest::collection::vec(any::<u8>(), 0..40), magic in any::<bool>()) {
            let mut bytes = bytes;
            if magic && bytes.len() >= 4 {
                bytes[..4].copy_from_slice(&MAGIC);
            }
            match Header::parse(&bytes) {
                Ok(h) => {
                    prop_assert_eq!(bytes.len(), HEADER_BYTES);
                    prop_assert_eq!(&bytes[..4], &MAGIC[..]);
                    prop_assert_eq!(&h.encode()[..], &bytes[..]);
                }
                Err(_) => prop_assert!(bytes.len() != HEADER_BYTES || bytes[..4] != MAGIC),
            }
        }

        #[test]
        fn headers_round_trip_for_any_rank_and_tag(from in any::<u32>(), tag in any::<u64>()) {
            let h = Header { from, tag };
            prop_assert_eq!(Header::parse(&h.encode()), Ok(h));
        }
    }
}
