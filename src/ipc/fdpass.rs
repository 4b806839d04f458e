//! File descriptors between processes on one host: each rank listens on a
//! Unix domain socket in the abstract namespace named by the job and its
//! rank, and a rank sends a descriptor to a peer by connecting to the
//! peer's socket and sending one message with the descriptor attached
//! (`SCM_RIGHTS`) and a small header (the sender's rank and a tag).
//!
//! Sending does not wait for the peer to accept: the connection waits in
//! the listener's backlog and the message in its buffer, so every rank can
//! first send to every peer and then receive from every peer, without a
//! cycle of ranks waiting for each other.

use super::bootstrap::io_err;
use crate::error::{Error, Result};
use rustix::net::{recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use std::io::{ErrorKind, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::{Duration, Instant};

/// Bytes of a message's header: the sender's rank (`u32`) and a tag (`u64`).
const HEADER: usize = 12;

/// The abstract socket name of `rank` in job `job`.
fn name(job: &str, rank: usize) -> String {
    format!("cuda-peer/{job}/{rank}")
}

fn abstract_addr(job: &str, rank: usize) -> Result<SocketAddr> {
    SocketAddr::from_abstract_name(name(job, rank).as_bytes()).map_err(io_err("fd passing: socket name"))
}

/// One rank's socket for receiving descriptors (closed on drop; an
/// abstract socket leaves no file behind).
#[derive(Debug)]
pub struct FdListener {
    listener: UnixListener,
    rank: usize,
}

/// A descriptor received from a peer.
#[derive(Debug)]
pub struct ReceivedFd {
    /// The sender's rank.
    pub from: usize,
    /// The sender's tag.
    pub tag: u64,
    /// The descriptor (a new one in this process, close-on-exec).
    pub fd: OwnedFd,
}

impl FdListener {
    /// Listens as `rank` of job `job` (fails if that name is taken on this
    /// host, e.g. by a rank of the same job started twice).
    pub fn bind(job: &str, rank: usize) -> Result<FdListener> {
        let listener = UnixListener::bind_addr(&abstract_addr(job, rank)?).map_err(io_err("fd passing: bind"))?;
        listener.set_nonblocking(true).map_err(io_err("fd passing: listener"))?;
        Ok(FdListener { listener, rank })
    }

    /// The rank this listener serves.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Receives `count` descriptors (one per connection), waiting at most
    /// `timeout` in all: [`Error::Timeout`] when they do not all come.
    pub fn receive(&self, count: usize, timeout: Duration) -> Result<Vec<ReceivedFd>> {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::with_capacity(count);
        while out.len() < count {
            let stream = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                    if Instant::now() > deadline {
                        return Err(Error::Timeout { op: "fd passing (waiting for the peers' descriptors)", after: timeout });
                    }
                    std::thread::sleep(Duration::from_millis(2));
                    continue;
                }
                Err(e) => return Err(io_err("fd passing: accept")(e)),
            };
            stream.set_nonblocking(false).map_err(io_err("fd passing: socket"))?;
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10));
            stream.set_read_timeout(Some(left)).map_err(io_err("fd passing: socket"))?;
            out.push(receive_one(&stream)?);
        }
        Ok(out)
    }
}

fn receive_one(stream: &UnixStream) -> Result<ReceivedFd> {
    let mut header = [0u8; HEADER];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = loop {
        match recvmsg(stream.as_fd(), &mut [IoSliceMut::new(&mut header)], &mut control, RecvFlags::CMSG_CLOEXEC) {
            Ok(m) => break m,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(io_err("fd passing: recvmsg")(e.into())),
        }
    };
    let mut fd = None;
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = msg {
            for f in fds {
                // Keep the first; any other is closed as it drops.
                fd.get_or_insert(f);
            }
        }
    }
    if got.bytes != HEADER {
        return Err(Error::Bootstrap { op: "fd passing", reason: format!("a message of {} bytes, expected {HEADER}", got.bytes) });
    }
    let fd = fd.ok_or_else(|| Error::Bootstrap { op: "fd passing", reason: "a message without a descriptor".into() })?;
    let mut rank = [0u8; 4];
    rank.copy_from_slice(&header[..4]);
    let mut tag = [0u8; 8];
    tag.copy_from_slice(&header[4..]);
    Ok(ReceivedFd { from: u32::from_le_bytes(rank) as usize, tag: u64::from_le_bytes(tag), fd })
}

/// Sends `fd` with `tag` from rank `from` to rank `to` of job `job`
/// (whose [`FdListener`] must be bound already), retrying the connection
/// until `timeout`.
pub fn send_fd(job: &str, from: usize, to: usize, fd: BorrowedFd<'_>, tag: u64, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let addr = abstract_addr(job, to)?;
    let stream = loop {
        match UnixStream::connect_addr(&addr) {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => {
                log::warn!("cuda-peer: cannot reach rank {to}'s socket: {e}");
                return Err(Error::Timeout { op: "fd passing (connecting to a peer)", after: timeout });
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    };
    stream.set_write_timeout(Some(timeout.max(Duration::from_millis(10)))).map_err(io_err("fd passing: socket"))?;
    let mut header = [0u8; HEADER];
    header[..4].copy_from_slice(&(from as u32).to_le_bytes());
    header[4..].copy_from_slice(&tag.to_le_bytes());
    let fds = [fd];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(Error::Internal("fd passing: ancillary buffer too small".into()));
    }
    let sent = loop {
        match sendmsg(stream.as_fd(), &[IoSlice::new(&header)], &mut control, SendFlags::empty()) {
            Ok(n) => break n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(io_err("fd passing: sendmsg")(e.into())),
        }
    };
    if sent != HEADER {
        return Err(Error::Bootstrap { op: "fd passing", reason: format!("sent {sent} of {HEADER} bytes") });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    fn job(test: &str) -> String {
        format!("test-{test}-{}-{:?}", std::process::id(), Instant::now())
    }

    #[test]
    fn a_descriptor_crosses_between_threads_and_still_works() {
        let job = job("cross");
        let listener = FdListener::bind(&job, 0).unwrap();
        // One end of a socket pair travels; we write through the other.
        let (mut ours, theirs) = UnixStream::pair().unwrap();
        let j = job.clone();
        let sender = std::thread::spawn(move || send_fd(&j, 3, 0, theirs.as_fd(), 0xfeed, Duration::from_secs(5)));
        let got = listener.receive(1, Duration::from_secs(5)).unwrap();
        sender.join().unwrap().unwrap();
        assert_eq!((got[0].from, got[0].tag), (3, 0xfeed));
        let mut received = UnixStream::from(got.into_iter().next().unwrap().fd);
        ours.write_all(b"through the passed fd").unwrap();
        let mut buf = [0u8; 21];
        received.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"through the passed fd");
    }

    #[test]
    fn every_rank_sends_then_receives_without_deadlock() {
        let job = job("all");
        let n = 4;
        let listeners: Vec<_> = (0..n).map(|r| FdListener::bind(&job, r).unwrap()).collect();
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(r, l)| {
                let job = job.clone();
                std::thread::spawn(move || {
                    let file = std::fs::File::open("/proc/self/exe").unwrap();
                    for p in (0..n).filter(|&p| p != r) {
                        send_fd(&job, r, p, file.as_fd(), r as u64 * 100 + p as u64, Duration::from_secs(5)).unwrap();
                    }
                    let mut got: Vec<_> = l.receive(n - 1, Duration::from_secs(5)).unwrap().into_iter().map(|g| (g.from, g.tag)).collect();
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
        let listener = FdListener::bind(&job("none"), 0).unwrap();
        let start = Instant::now();
        let r = listener.receive(1, Duration::from_millis(200));
        assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
        assert!(start.elapsed() < Duration::from_secs(3));
        let r = send_fd(&job("nobody"), 0, 1, listener.listener.as_fd(), 0, Duration::from_millis(100));
        assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    }

    #[test]
    fn a_name_is_taken_once() {
        let job = job("twice");
        let _a = FdListener::bind(&job, 0).unwrap();
        assert!(FdListener::bind(&job, 0).is_err());
    }
}
