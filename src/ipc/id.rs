//! [`Id`]: where a job's ranks meet and what they prove, as 128 bytes that
//! rank 0 makes and the application sends to the other ranks by its own
//! channel, in the spirit of NCCL's `ncclUniqueId`.
//!
//! An `Id` holds rank 0's rendezvous address and port and a new random job
//! secret ([`super::secret`]). [`Id::new`] binds the listener at once and
//! keeps it for this process's rank 0 ([`super::Bootstrap::from_id`]), so no
//! other process can take the port between making the id and meeting.
//! Anyone who holds the bytes can join the job: send them only to its ranks.
//!
//! Layout (little-endian): magic `CPid` (4), version 1 (1), address family
//! 4 or 6 (1), port (2), address (16; IPv4 in the first 4), secret (32
//! random bytes), zero (72).

use super::secret::{random_bytes, JobSecret};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::Mutex;

/// The environment variable naming the address rank 0 listens on, where
/// it is not the one `MASTER_ADDR` resolves to (a service address, NAT).
pub const BIND_ADDR_ENV: &str = "CUDA_PEER_BIND_ADDR";

/// The magic at the start of an id.
const MAGIC: &[u8; 4] = b"CPid";
/// The layout's version.
const VERSION: u8 = 1;

/// A job's meeting point and secret (see the module docs). Its `Debug`
/// shows the address, never the secret.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Id {
    internal: [u8; Id::BYTES],
}

impl std::fmt::Debug for Id {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Id({})", self.addr())
    }
}

/// Listeners bound by [`Id::new`] in this process, by address, until this
/// process's rank 0 takes its own.
static LISTENERS: Mutex<Option<HashMap<SocketAddr, TcpListener>>> = Mutex::new(None);

impl Id {
    /// Bytes of an id.
    pub const BYTES: usize = 128;

    /// A new id for a job whose rank 0 is this process: a listener bound
    /// now on the address of [`Self::local_addr`] (any free port), kept for
    /// [`super::Bootstrap::from_id`], and a new secret.
    pub fn new() -> Result<Id> {
        Self::with_addr(Self::local_addr())
    }

    /// As [`Self::new`], listening on `addr` (an address of this host that
    /// the other ranks reach).
    pub fn with_addr(addr: IpAddr) -> Result<Id> {
        let listener = TcpListener::bind((addr, 0)).map_err(|e| Error::Bootstrap {
            op: "Id::new: listening",
            reason: format!("{addr}: {e} (CUDA_PEER_BIND_ADDR names the address to use)"),
        })?;
        let at = listener.local_addr().map_err(|e| Error::Bootstrap { op: "Id::new: listening", reason: e.to_string() })?;
        let id = Id::encode(at, &random_bytes::<32>()?);
        LISTENERS.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert_with(HashMap::new).insert(at, listener);
        Ok(id)
    }

    /// The address [`Self::new`] listens on: `CUDA_PEER_BIND_ADDR` where it
    /// is an IP address, else the first non-loopback address this host's
    /// name resolves to, else the loopback (a job of one host).
    pub fn local_addr() -> IpAddr {
        if let Some(a) = std::env::var(BIND_ADDR_ENV).ok().and_then(|a| a.trim().parse().ok()) {
            return a;
        }
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_default();
        (host.as_str(), 0)
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.find(|a| !a.ip().is_loopback() && !a.ip().is_unspecified()).map(|a| a.ip()))
            .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
    }

    fn encode(at: SocketAddr, secret: &[u8; 32]) -> Id {
        let mut b = [0u8; Id::BYTES];
        b[..4].copy_from_slice(MAGIC);
        b[4] = VERSION;
        match at.ip() {
            IpAddr::V4(v4) => {
                b[5] = 4;
                b[8..12].copy_from_slice(&v4.octets());
            }
            IpAddr::V6(v6) => {
                b[5] = 6;
                b[8..24].copy_from_slice(&v6.octets());
            }
        }
        b[6..8].copy_from_slice(&at.port().to_le_bytes());
        b[24..56].copy_from_slice(secret);
        Id { internal: b }
    }

    /// The id whose bytes another rank sent: refused unless it is one
    /// ([`Self::as_bytes`] of an id this version of cuda-peer made).
    pub fn from_bytes(bytes: &[u8]) -> Result<Id> {
        let bad = |why: &str| Error::InvalidArgument(format!("not a cuda-peer Id: {why}"));
        let b: [u8; Id::BYTES] = bytes.try_into().map_err(|_| bad(&format!("{} bytes, not {}", bytes.len(), Id::BYTES)))?;
        if &b[..4] != MAGIC {
            return Err(bad("no magic"));
        }
        if b[4] != VERSION {
            return Err(bad(&format!("layout version {}, this is {VERSION}", b[4])));
        }
        let v4_tail_zero = b[12..24].iter().all(|&x| x == 0);
        if !(b[5] == 6 || (b[5] == 4 && v4_tail_zero)) || b[56..].iter().any(|&x| x != 0) {
            return Err(bad("malformed"));
        }
        if u16::from_le_bytes([b[6], b[7]]) == 0 {
            return Err(bad("port 0"));
        }
        Ok(Id { internal: b })
    }

    /// The 128 bytes to send to the other ranks.
    pub fn as_bytes(&self) -> &[u8; Id::BYTES] {
        &self.internal
    }

    /// Rank 0's rendezvous address and port.
    pub fn addr(&self) -> SocketAddr {
        let b = &self.internal;
        let port = u16::from_le_bytes([b[6], b[7]]);
        let ip = if b[5] == 6 {
            let mut o = [0u8; 16];
            o.copy_from_slice(&b[8..24]);
            IpAddr::V6(Ipv6Addr::from(o))
        } else {
            IpAddr::V4(Ipv4Addr::new(b[8], b[9], b[10], b[11]))
        };
        SocketAddr::new(ip, port)
    }

    /// The job's secret.
    pub fn secret(&self) -> JobSecret {
        let mut key = [0u8; 32];
        key.copy_from_slice(&self.internal[24..56]);
        JobSecret::from_key(&key)
    }
}

/// The environment variable through which a launcher (`cuda-peer-run`)
/// hands rank 0 the rendezvous listener it bound: the number of an
/// inherited file descriptor. Rank 0 then serves on it, so no other process
/// can take `MASTER_PORT` between the launcher choosing it and rank 0
/// listening.
pub const LISTEN_FD_ENV: &str = "CUDA_PEER_LISTEN_FD";

/// Takes, once per process, the listener a launcher handed this process
/// ([`LISTEN_FD_ENV`]) for [`take_listener`], where it is a listening TCP
/// socket on `port`; anything else is left alone (and logged).
pub(crate) fn adopt_inherited_listener(port: u16) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Some(fd) = std::env::var(LISTEN_FD_ENV).ok().and_then(|v| v.trim().parse::<i32>().ok()) {
            if let Err(why) = adopt_listener_fd(fd, port) {
                log::warn!("cuda-peer: {LISTEN_FD_ENV}={fd} not used: {why}");
            }
        }
    });
}

/// Takes descriptor `fd` as the listener on `port` for [`take_listener`]
/// where it is one: open, a listening TCP socket, bound to that port.
/// Ownership moves here only then (the descriptor is closed when the
/// listener is dropped); the caller must not use `fd` again.
fn adopt_listener_fd(fd: i32, port: u16) -> std::result::Result<(), String> {
    use std::os::fd::{BorrowedFd, FromRawFd, OwnedFd};
    if fd < 3 {
        return Err("not a descriptor a launcher would hand over".into());
    }
    // SAFETY: fcntl(F_GETFD) on any number only reads the descriptor table.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err("not an open descriptor".into());
    }
    // SAFETY: `fd` is open (checked above) and stays open while borrowed:
    // nothing here closes it.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    let stream = rustix::net::sockopt::socket_type(borrowed).map_err(|e| format!("not a socket ({e})"))?;
    let listening = rustix::net::sockopt::socket_acceptconn(borrowed).map_err(|e| e.to_string())?;
    let at = rustix::net::getsockname(borrowed).map_err(|e| e.to_string())?;
    let at = SocketAddr::try_from(at).map_err(|_| "not an IP socket".to_string())?;
    if stream != rustix::net::SocketType::STREAM || !listening || at.port() != port {
        return Err(format!("not a TCP listener on port {port} ({at}, listening: {listening})"));
    }
    // SAFETY: an open descriptor (checked), which the launcher handed to this
    // process alone for this use; taken once (`adopt_inherited_listener`'s
    // `Once`), so nothing else here owns it.
    let listener = TcpListener::from(unsafe { OwnedFd::from_raw_fd(fd) });
    LISTENERS.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert_with(HashMap::new).insert(at, listener);
    Ok(())
}

/// The listener [`Id::new`] (or a launcher, [`LISTEN_FD_ENV`]) bound for
/// `at` in this process, if any (taken: rank 0 uses it once).
pub(crate) fn take_listener(at: SocketAddr) -> Option<TcpListener> {
    LISTENERS.lock().unwrap_or_else(|p| p.into_inner()).as_mut()?.remove(&at)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn an_id_round_trips_and_hides_its_secret() {
        let id = Id::with_addr(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap();
        let back = Id::from_bytes(id.as_bytes()).unwrap();
        assert_eq!(back, id);
        assert_eq!(back.addr().ip(), IpAddr::V4(Ipv4Addr::LOCALHOST));
        assert_ne!(back.addr().port(), 0);
        assert_eq!(back.secret(), id.secret());
        assert_eq!(id.secret().expose().len(), 64);
        assert!(!format!("{id:?}").contains(&id.secret().expose()[..8]));
        let other = Id::with_addr(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap();
        assert_ne!(other.secret(), id.secret());
        assert_ne!(other.addr(), id.addr());
        assert!(take_listener(id.addr()).is_some());
        assert!(take_listener(id.addr()).is_none(), "a listener is taken once");
        assert!(take_listener(other.addr()).is_some());
    }

    #[test]
    fn ids_of_ipv6_round_trip() {
        let Ok(id) = Id::with_addr(IpAddr::V6(Ipv6Addr::LOCALHOST)) else {
            return; // no IPv6 loopback here
        };
        assert_eq!(Id::from_bytes(id.as_bytes()).unwrap().addr(), id.addr());
        take_listener(id.addr());
    }

    #[test]
    fn bytes_that_are_not_an_id_are_refused() {
        let id = Id::encode("127.0.0.1:29500".parse().unwrap(), &[7; 32]);
        assert!(Id::from_bytes(&id.as_bytes()[..127]).is_err());
        for (i, v) in [(0, b'x'), (4, 2), (5, 5), (100, 1), (12, 1)] {
            let mut b = *id.as_bytes();
            b[i] = v;
            assert!(Id::from_bytes(&b).is_err(), "byte {i} = {v}");
        }
        let mut b = *id.as_bytes();
        b[6..8].copy_from_slice(&[0, 0]);
        assert!(Id::from_bytes(&b).is_err(), "port 0");
    }

    /// A listener handed over by descriptor number is served on; anything
    /// else is refused and left open.
    #[test]
    fn a_handed_over_listener_is_adopted_and_nothing_else() {
        use std::os::fd::{AsRawFd, IntoRawFd};
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        let fd = l.into_raw_fd();
        assert!(adopt_listener_fd(fd, at.port() ^ 1).is_err(), "another port");
        adopt_listener_fd(fd, at.port()).unwrap();
        let got = take_listener(at).expect("adopted");
        assert_eq!(got.local_addr().unwrap(), at);
        // A regular file, a connected socket, a closed number: refused, and still open.
        let f = std::fs::File::open("/proc/self/exe").unwrap();
        assert!(adopt_listener_fd(f.as_raw_fd(), 80).is_err());
        let c = std::net::TcpStream::connect(at).unwrap();
        assert!(adopt_listener_fd(c.as_raw_fd(), c.local_addr().unwrap().port()).is_err());
        assert!(adopt_listener_fd(1 << 20, at.port()).is_err());
        assert!(f.metadata().is_ok() && c.peer_addr().is_ok());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Any bytes parse or are refused without a panic, and what parses
        /// round-trips.
        #[test]
        fn parsing_never_panics(b in proptest::collection::vec(any::<u8>(), 0..160)) {
            if let Ok(id) = Id::from_bytes(&b) {
                prop_assert_eq!(id.as_bytes().as_slice(), b.as_slice());
                let _ = (id.addr(), id.secret());
            }
        }
    }
}
