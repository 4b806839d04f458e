//! The bootstrap's wire: length-prefixed frames read and written against
//! a deadline for the whole frame, the handshake that proves the job's
//! secret in both directions, and links whose every message carries a MAC.
//!
//! Handshake (one per TCP connection, rank 0 is the server):
//!
//! ```text
//! server -> joiner  SERVER_HELLO  magic, server nonce (32 B)
//! joiner -> server  HELLO         magic, rank (u32), world size (u32), joiner nonce (32 B),
//!                                 HMAC(secret, "join" | nonces | rank | world)
//! server -> joiner  PROOF         HMAC(secret, "serve" | nonces | rank | world | status | reason),
//!                                 status (0: accepted, 1: refused), reason (text, refused only)
//! ```
//!
//! The server checks the joiner's MAC before anything else about it, and
//! the joiner the server's before it believes anything the server says, so
//! a process without the secret learns nothing of the job and is dropped,
//! and one that squats on the port is not taken for rank 0. After it, each
//! message on the link is a frame of its bytes and
//! `HMAC(session key, direction | sequence number | bytes)`, with the
//! session key `HMAC(secret, "session" | nonces | rank | world)`: a message
//! that was altered, replayed, reordered or injected is refused. Messages
//! are not encrypted.

use super::secret::{random_bytes, JobSecret};
use crate::error::{Error, Result};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// The magic at the start of the handshake's messages (protocol version 2).
const MAGIC: &[u8; 8] = b"CPEER\x00\x02\x00";
/// Bytes of a nonce, and of a MAC.
const NONCE: usize = 32;
const TAG: usize = 32;
/// Bytes of `SERVER_HELLO` and `HELLO`.
pub(crate) const SERVER_HELLO_BYTES: usize = MAGIC.len() + NONCE;
pub(crate) const HELLO_BYTES: usize = MAGIC.len() + 8 + NONCE + TAG;
/// The most bytes of a `PROOF` (its reason is cut to fit).
pub(crate) const PROOF_MAX_BYTES: usize = TAG + 1 + 1024;

/// The instant `timeout` from now, or far in the future where that does
/// not fit (`Duration::MAX` means "no bound" without overflowing).
pub(crate) fn deadline(timeout: Duration) -> Instant {
    let now = Instant::now();
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
    [timeout, CENTURY, Duration::from_secs(24 * 3600)].into_iter().find_map(|d| now.checked_add(d)).unwrap_or(now)
}

/// Time left until `deadline`, or a timeout error of step `op`.
fn left(deadline: Instant, op: &'static str) -> Result<Duration> {
    match deadline.checked_duration_since(Instant::now()) {
        Some(d) if !d.is_zero() => Ok(d),
        _ => Err(Error::Bootstrap { op, reason: "timed out".into() }),
    }
}

/// Maps an I/O error of step `op`: timeouts, a closed connection, the rest.
pub(crate) fn io_err(op: &'static str) -> impl Fn(std::io::Error) -> Error {
    move |e| match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => Error::Bootstrap { op, reason: format!("timed out ({e})") },
        ErrorKind::UnexpectedEof => Error::Bootstrap { op, reason: "the peer closed the connection (exited?)".into() },
        _ => Error::Bootstrap { op, reason: e.to_string() },
    }
}

/// Moves `len` bytes before `deadline` in steps of `step(time left, bytes
/// done)`, which sets the socket's timeout to the time left and reads or
/// writes from there, so that a peer that trickles bytes cannot stretch
/// the deadline; a step that moves nothing is `zero` (the peer closed).
fn transfer_by(
    len: usize,
    deadline: Instant,
    op: &'static str,
    zero: ErrorKind,
    mut step: impl FnMut(Duration, usize) -> std::io::Result<usize>,
) -> Result<()> {
    let mut done = 0;
    while done < len {
        match step(left(deadline, op)?, done) {
            Ok(0) => return Err(io_err(op)(zero.into())),
            Ok(n) => done += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                left(deadline, op)?;
            }
            Err(e) => return Err(io_err(op)(e)),
        }
    }
    Ok(())
}

/// Reads exactly `buf.len()` bytes before `deadline`.
fn read_exact_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant, op: &'static str) -> Result<()> {
    transfer_by(buf.len(), deadline, op, ErrorKind::UnexpectedEof, |t, at| {
        s.set_read_timeout(Some(t))?;
        s.read(&mut buf[at..])
    })
}

/// Writes all of `buf` before `deadline`.
fn write_all_by(s: &mut TcpStream, buf: &[u8], deadline: Instant, op: &'static str) -> Result<()> {
    transfer_by(buf.len(), deadline, op, ErrorKind::WriteZero, |t, at| {
        s.set_write_timeout(Some(t))?;
        s.write(&buf[at..])
    })
}

/// Reads one frame (a little-endian `u32` length, then that many bytes, at
/// most `max`) before `deadline`.
pub(crate) fn read_frame(s: &mut TcpStream, max: usize, deadline: Instant, op: &'static str) -> Result<Vec<u8>> {
    let mut len = [0u8; 4];
    read_exact_by(s, &mut len, deadline, op)?;
    let len = frame_len(len, max).map_err(|reason| Error::Bootstrap { op, reason })?;
    let mut m = vec![0u8; len];
    read_exact_by(s, &mut m, deadline, op)?;
    Ok(m)
}

/// A frame's length from its prefix, if at most `max`.
pub(crate) fn frame_len(prefix: [u8; 4], max: usize) -> std::result::Result<usize, String> {
    let len = u32::from_le_bytes(prefix) as usize;
    if len > max {
        return Err(format!("a message of {len} bytes (at most {max})"));
    }
    Ok(len)
}

/// Writes one frame before `deadline`.
pub(crate) fn write_frame(s: &mut TcpStream, m: &[u8], deadline: Instant, op: &'static str) -> Result<()> {
    let len = u32::try_from(m.len()).map_err(|_| Error::InvalidArgument(format!("{op}: a message of {} bytes", m.len())))?;
    let mut framed = Vec::with_capacity(4 + m.len());
    framed.extend_from_slice(&len.to_le_bytes());
    framed.extend_from_slice(m);
    write_all_by(s, &framed, deadline, op)
}

/// HMAC-SHA-256 of the concatenated `parts` under `key` (HMAC takes keys
/// of any length, so this fails only if the crate's contract changes).
fn mac(key: &[u8], parts: &[&[u8]]) -> Result<[u8; TAG]> {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).map_err(|e| Error::Internal(format!("HMAC key: {e}")))?;
    for p in parts {
        m.update(p);
    }
    Ok(m.finalize().into_bytes().into())
}

/// Whether `tag` is the MAC of `parts` under `key` (in constant time).
fn verify(key: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
    let mut m = match <Hmac<Sha256> as Mac>::new_from_slice(key) {
        Ok(m) => m,
        Err(_) => return false,
    };
    for p in parts {
        m.update(p);
    }
    m.verify_slice(tag).is_ok()
}

/// The joiner's `HELLO`, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hello {
    pub rank: u32,
    pub world: u32,
    pub nonce: [u8; NONCE],
    pub tag: [u8; TAG],
}

/// What the joiner's and the server's MACs cover besides their label.
fn transcript(server: &[u8; NONCE], joiner: &[u8; NONCE], rank: u32, world: u32) -> [u8; 2 * NONCE + 8] {
    let mut t = [0u8; 2 * NONCE + 8];
    t[..NONCE].copy_from_slice(server);
    t[NONCE..2 * NONCE].copy_from_slice(joiner);
    t[2 * NONCE..2 * NONCE + 4].copy_from_slice(&rank.to_le_bytes());
    t[2 * NONCE + 4..].copy_from_slice(&world.to_le_bytes());
    t
}

/// `SERVER_HELLO`'s nonce, if `m` is one.
pub(crate) fn parse_server_hello(m: &[u8]) -> Option<[u8; NONCE]> {
    let rest = m.strip_prefix(MAGIC.as_slice())?;
    rest.try_into().ok()
}

/// `HELLO`, if `m` is one.
pub(crate) fn parse_hello(m: &[u8]) -> Option<Hello> {
    let rest = m.strip_prefix(MAGIC.as_slice())?;
    if rest.len() != HELLO_BYTES - MAGIC.len() {
        return None;
    }
    let word = |i: usize| u32::from_le_bytes([rest[i], rest[i + 1], rest[i + 2], rest[i + 3]]);
    Some(Hello { rank: word(0), world: word(4), nonce: rest[8..8 + NONCE].try_into().ok()?, tag: rest[8 + NONCE..].try_into().ok()? })
}

/// `PROOF`: its MAC, and the refusal's reason (`None`: accepted), if `m`
/// is one.
pub(crate) fn parse_proof(m: &[u8]) -> Option<([u8; TAG], Option<String>)> {
    if m.len() < TAG + 1 || m.len() > PROOF_MAX_BYTES {
        return None;
    }
    let tag: [u8; TAG] = m[..TAG].try_into().ok()?;
    match m[TAG] {
        0 if m.len() == TAG + 1 => Some((tag, None)),
        1 => Some((tag, Some(String::from_utf8_lossy(&m[TAG + 1..]).into_owned()))),
        _ => None,
    }
}

/// Why a handshake did not give a link.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// The other side did not prove the secret, or did not speak the
    /// protocol, or went silent: drop it and go on.
    Stranger(String),
    /// The other side proved the secret and the two disagree (world size,
    /// rank): a real misconfiguration, an error for the job.
    Job(Error),
}

fn stranger(e: Error) -> Refusal {
    Refusal::Stranger(e.to_string())
}

/// One side of an authenticated connection: every message carries a MAC
/// under the session key, with its direction and sequence number.
#[derive(Debug)]
pub(crate) struct Link {
    stream: TcpStream,
    key: [u8; TAG],
    /// Whether this side is the server (rank 0).
    server: bool,
    sent: u64,
    received: u64,
}

impl Link {
    /// Sends `m` before `deadline`.
    pub(crate) fn send(&mut self, m: &[u8], deadline: Instant, op: &'static str) -> Result<()> {
        let dir = [u8::from(self.server)];
        let seq = self.sent.to_le_bytes();
        let tag = mac(&self.key, &[&dir, &seq, m])?;
        let mut framed = Vec::with_capacity(m.len() + TAG);
        framed.extend_from_slice(m);
        framed.extend_from_slice(&tag);
        write_frame(&mut self.stream, &framed, deadline, op)?;
        self.sent += 1;
        Ok(())
    }

    /// Receives a message of at most `max` bytes before `deadline`; one
    /// whose MAC is wrong is an error (and the link is not to be used again).
    pub(crate) fn recv(&mut self, max: usize, deadline: Instant, op: &'static str) -> Result<Vec<u8>> {
        let mut m = read_frame(&mut self.stream, max.saturating_add(TAG), deadline, op)?;
        if m.len() < TAG {
            return Err(Error::Bootstrap { op, reason: "a message without its MAC".into() });
        }
        let tag = m.split_off(m.len() - TAG);
        let dir = [u8::from(!self.server)];
        let seq = self.received.to_le_bytes();
        if !verify(&self.key, &[&dir, &seq, &m], &tag) {
            return Err(Error::Bootstrap { op, reason: "a message whose MAC is wrong (altered or injected)".into() });
        }
        self.received += 1;
        Ok(m)
    }
}

/// Sets `s` up for the handshake and the link: blocking, no delay.
fn configure(s: &TcpStream) -> Result<()> {
    s.set_nonblocking(false).map_err(io_err("rendezvous: socket"))?;
    s.set_nodelay(true).map_err(io_err("rendezvous: socket"))
}

/// The server's side of the handshake on a new connection: a link to a
/// rank in `1..world` that proved `secret`.
pub(crate) fn accept(mut s: TcpStream, secret: &JobSecret, world: usize, deadline: Instant) -> std::result::Result<(usize, Link), Refusal> {
    const OP: &str = "rendezvous: handshake";
    configure(&s).map_err(stranger)?;
    let ours: [u8; NONCE] = random_bytes().map_err(Refusal::Job)?;
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&ours);
    write_frame(&mut s, &hello, deadline, OP).map_err(stranger)?;
    let m = read_frame(&mut s, HELLO_BYTES, deadline, OP).map_err(stranger)?;
    let h = parse_hello(&m).ok_or_else(|| Refusal::Stranger("not the cuda-peer protocol".into()))?;
    let t = transcript(&ours, &h.nonce, h.rank, h.world);
    if !verify(secret.bytes(), &[b"cuda-peer bootstrap join", &t], &h.tag) {
        return Err(Refusal::Stranger("did not prove the job's secret".into()));
    }
    let (rank, claimed) = (h.rank as usize, h.world as usize);
    let refusal = if claimed != world {
        Some(format!("rank {rank} says the world has {claimed} ranks, rank 0 says {world}"))
    } else if rank == 0 || rank >= world {
        Some(format!("a peer claims rank {rank} in a world of {world}"))
    } else {
        None
    };
    let mut proof_tail = vec![u8::from(refusal.is_some())];
    if let Some(r) = &refusal {
        proof_tail.extend(r.bytes().take(PROOF_MAX_BYTES - TAG - 1));
    }
    let tag = mac(secret.bytes(), &[b"cuda-peer bootstrap serve", &t, &proof_tail]).map_err(Refusal::Job)?;
    let proof = [&tag[..], &proof_tail].concat();
    let sent = write_frame(&mut s, &proof, deadline, OP);
    if let Some(r) = refusal {
        return Err(Refusal::Job(Error::Bootstrap { op: "rendezvous", reason: r }));
    }
    sent.map_err(stranger)?;
    let key = mac(secret.bytes(), &[b"cuda-peer bootstrap session", &t]).map_err(Refusal::Job)?;
    Ok((rank, Link { stream: s, key, server: true, sent: 0, received: 0 }))
}

/// The joiner's side of the handshake: a link to a rank 0 that proved
/// `secret`, as `rank` of `world`.
pub(crate) fn join(mut s: TcpStream, secret: &JobSecret, rank: usize, world: usize, deadline: Instant) -> std::result::Result<Link, Refusal> {
    const OP: &str = "rendezvous: handshake";
    configure(&s).map_err(stranger)?;
    let m = read_frame(&mut s, SERVER_HELLO_BYTES, deadline, OP).map_err(stranger)?;
    let theirs = parse_server_hello(&m).ok_or_else(|| Refusal::Stranger("the server does not speak the cuda-peer protocol".into()))?;
    let ours: [u8; NONCE] = random_bytes().map_err(Refusal::Job)?;
    let (r, w) = (
        u32::try_from(rank).map_err(|_| Refusal::Job(Error::InvalidArgument(format!("rank {rank}"))))?,
        u32::try_from(world).map_err(|_| Refusal::Job(Error::InvalidArgument(format!("world size {world}"))))?,
    );
    let t = transcript(&theirs, &ours, r, w);
    let tag = mac(secret.bytes(), &[b"cuda-peer bootstrap join", &t]).map_err(Refusal::Job)?;
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&r.to_le_bytes());
    hello.extend_from_slice(&w.to_le_bytes());
    hello.extend_from_slice(&ours);
    hello.extend_from_slice(&tag);
    write_frame(&mut s, &hello, deadline, OP).map_err(stranger)?;
    let m = read_frame(&mut s, PROOF_MAX_BYTES, deadline, OP).map_err(stranger)?;
    let (tag, refusal) = parse_proof(&m).ok_or_else(|| Refusal::Stranger("a malformed proof from the server".into()))?;
    if !verify(secret.bytes(), &[b"cuda-peer bootstrap serve", &t, &m[TAG..]], &tag) {
        return Err(Refusal::Stranger("the server did not prove the job's secret (another job, or a squatter on the port)".into()));
    }
    if let Some(reason) = refusal {
        return Err(Refusal::Job(Error::Bootstrap { op: "rendezvous", reason: format!("rank 0 refused this rank: {reason}") }));
    }
    let key = mac(secret.bytes(), &[b"cuda-peer bootstrap session", &t]).map_err(Refusal::Job)?;
    Ok(Link { stream: s, key, server: false, sent: 0, received: 0 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::net::TcpListener;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (l.accept().unwrap().0, c)
    }

    fn secret(s: &str) -> JobSecret {
        JobSecret::new(s).unwrap()
    }

    #[test]
    fn both_sides_prove_the_secret_and_messages_carry_macs() {
        let (srv, cli) = pair();
        let d = deadline(Duration::from_secs(10));
        let k = secret("the job's own secret");
        let k2 = k.clone();
        let h = std::thread::spawn(move || join(cli, &k2, 2, 3, d).map_err(|e| format!("{e:?}")));
        let (rank, mut a) = accept(srv, &k, 3, d).map_err(|e| format!("{e:?}")).unwrap();
        let mut b = h.join().unwrap().unwrap();
        assert_eq!(rank, 2);
        a.send(b"to the joiner", d, "t").unwrap();
        b.send(b"to rank 0", d, "t").unwrap();
        assert_eq!(b.recv(100, d, "t").unwrap(), b"to the joiner");
        assert_eq!(a.recv(100, d, "t").unwrap(), b"to rank 0");
        // A frame injected into the stream without the session key is refused.
        write_frame(&mut a.stream, &[0u8; 40], d, "t").unwrap();
        let r = b.recv(100, d, "t");
        assert!(matches!(&r, Err(Error::Bootstrap { reason, .. }) if reason.contains("MAC")), "{r:?}");
    }

    #[test]
    fn a_wrong_secret_is_a_stranger_on_both_sides() {
        let (srv, cli) = pair();
        let d = deadline(Duration::from_secs(10));
        let h = std::thread::spawn(move || join(cli, &secret("a guess at the secret"), 1, 2, d).map(|_| ()));
        let got = accept(srv, &secret("the job's own secret"), 2, d);
        assert!(matches!(&got, Err(Refusal::Stranger(why)) if why.contains("secret")), "{got:?}");
        // The server closed without proving anything: a stranger to the joiner too.
        assert!(matches!(h.join().unwrap(), Err(Refusal::Stranger(_))));
    }

    #[test]
    fn an_authenticated_disagreement_is_a_job_error_on_both_sides() {
        let (srv, cli) = pair();
        let d = deadline(Duration::from_secs(10));
        let k = secret("the job's own secret");
        let k2 = k.clone();
        let h = std::thread::spawn(move || join(cli, &k2, 1, 3, d).map(|_| ()));
        let got = accept(srv, &k, 2, d);
        assert!(matches!(&got, Err(Refusal::Job(Error::Bootstrap { reason, .. })) if reason.contains("3 ranks")), "{got:?}");
        let joined = h.join().unwrap();
        assert!(matches!(&joined, Err(Refusal::Job(Error::Bootstrap { reason, .. })) if reason.contains("refused")), "{joined:?}");
    }

    #[test]
    fn a_trickling_peer_is_cut_at_the_deadline() {
        let (srv, mut cli) = pair();
        let t = std::thread::spawn(move || {
            for b in MAGIC {
                if cli.write_all(&[*b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(150));
            }
        });
        let start = Instant::now();
        let got = accept(srv, &secret("the job's own secret"), 2, deadline(Duration::from_millis(400)));
        assert!(matches!(got, Err(Refusal::Stranger(_))), "{got:?}");
        assert!(start.elapsed() < Duration::from_secs(1), "{:?}", start.elapsed());
        t.join().unwrap();
    }

    #[test]
    fn deadlines_saturate() {
        let far = deadline(Duration::MAX);
        assert!(far > Instant::now() + Duration::from_secs(3600));
        assert!(left(Instant::now() - Duration::from_millis(1), "t").is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// The parsers take any bytes without panicking, and accept only
        /// messages of their exact shape.
        #[test]
        fn parsers_never_panic(m in proptest::collection::vec(any::<u8>(), 0..200)) {
            if let Some(h) = parse_hello(&m) {
                prop_assert_eq!(m.len(), HELLO_BYTES);
                prop_assert_eq!(&m[..8], MAGIC.as_slice());
                let rank = h.rank.to_le_bytes();
                prop_assert_eq!(rank.as_slice(), &m[8..12]);
            }
            if parse_server_hello(&m).is_some() {
                prop_assert_eq!(m.len(), SERVER_HELLO_BYTES);
            }
            if let Some((_, refusal)) = parse_proof(&m) {
                prop_assert!(m.len() > TAG && m.len() <= PROOF_MAX_BYTES);
                prop_assert_eq!(refusal.is_some(), m[TAG] == 1);
            }
        }

        /// A well-formed HELLO with any fields parses back to them.
        #[test]
        fn hello_round_trips(rank: u32, world: u32, nonce: [u8; 32], tag: [u8; 32]) {
            let mut m = MAGIC.to_vec();
            m.extend_from_slice(&rank.to_le_bytes());
            m.extend_from_slice(&world.to_le_bytes());
            m.extend_from_slice(&nonce);
            m.extend_from_slice(&tag);
            prop_assert_eq!(parse_hello(&m), Some(Hello { rank, world, nonce, tag }));
        }

        /// A frame's length prefix is refused above the bound, whatever it is.
        #[test]
        fn frame_lengths_are_bounded(prefix: [u8; 4], max in 0usize..100_000) {
            let len = u32::from_le_bytes(prefix) as usize;
            prop_assert_eq!(frame_len(prefix, max).is_ok(), len <= max);
        }
    }
}
