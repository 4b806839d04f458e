//! Who is who among the processes of a job, and a small TCP rendezvous
//! that rank 0 serves, to all-gather small byte blobs (host identity,
//! per-rank info) between them.
//!
//! [`Bootstrap`] reads torchrun's variables ([`Bootstrap::from_env`]) or
//! takes them from the caller ([`Bootstrap::new`]); [`Bootstrap::connect`]
//! meets the other ranks and returns a [`Rendezvous`]. A framework with its
//! own key-value store implements [`Exchange`] over it instead and hands
//! that to [`crate::ipc::Comm::new`].
//!
//! Protocol (one TCP connection from each rank to rank 0, kept for the
//! life of the rendezvous): every message is a little-endian `u32` length
//! and that many bytes (at most [`MAX_MESSAGE_BYTES`]). A rank first sends
//! `HELLO` (magic, its rank, the world size); rank 0 answers each with the
//! job id once every rank has arrived. An all-gather is one message from
//! each rank to rank 0 and one message back with every rank's blob. Every
//! read, write, connect and accept is bounded by the bootstrap's timeout.

use crate::error::{Error, Result};
use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a rendezvous step waits by default (for the other ranks to
/// arrive, for a message) before it fails with [`Error::Timeout`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// The largest message of the rendezvous protocol (a sanity bound: blobs
/// are small).
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// The magic at the start of a `HELLO` (protocol version 1).
const MAGIC: &[u8; 8] = b"CPEER\x00\x01\x00";

/// One process's place in a job and where its rank 0 listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bootstrap {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// How many processes (ranks) the job has.
    pub world_size: usize,
    /// This process's rank among those on its host (torchrun's
    /// `LOCAL_RANK`): the device it uses by default.
    pub local_rank: usize,
    /// How many ranks run on this host.
    pub local_world_size: usize,
    /// Host of rank 0's rendezvous server.
    pub master_addr: String,
    /// Port of rank 0's rendezvous server.
    pub master_port: u16,
    /// Bound on every rendezvous step ([`DEFAULT_TIMEOUT`]).
    pub timeout: Duration,
}

impl Bootstrap {
    /// Checks and takes the given places (for frameworks that know them
    /// from their own launcher).
    pub fn new(rank: usize, world_size: usize, local_rank: usize, local_world_size: usize, master_addr: &str, master_port: u16) -> Result<Bootstrap> {
        if world_size == 0 {
            return Err(Error::InvalidArgument("world size 0".into()));
        }
        if rank >= world_size {
            return Err(Error::InvalidArgument(format!("rank {rank} out of range for a world of {world_size}")));
        }
        if local_world_size == 0 || local_world_size > world_size || local_rank >= local_world_size {
            return Err(Error::InvalidArgument(format!("local rank {local_rank} of {local_world_size} does not fit a world of {world_size}")));
        }
        if master_addr.is_empty() {
            return Err(Error::InvalidArgument("empty master address".into()));
        }
        Ok(Bootstrap { rank, world_size, local_rank, local_world_size, master_addr: master_addr.to_string(), master_port, timeout: DEFAULT_TIMEOUT })
    }

    /// Reads torchrun's variables from the environment: `RANK`,
    /// `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` (required),
    /// `LOCAL_RANK` and `LOCAL_WORLD_SIZE` (default: `RANK` and
    /// `WORLD_SIZE`, a one-host job).
    pub fn from_env() -> Result<Bootstrap> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// As [`Self::from_env`], with the variables looked up by `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Bootstrap> {
        fn num<T: std::str::FromStr>(get: &dyn Fn(&str) -> Option<String>, var: &'static str, default: Option<T>) -> Result<T> {
            match get(var) {
                Some(v) => v.trim().parse().map_err(|_| Error::Env { var, problem: format!("{v:?} is not a valid number") }),
                None => default.ok_or(Error::Env { var, problem: "not set".into() }),
            }
        }
        let rank: usize = num(&get, "RANK", None)?;
        let world_size: usize = num(&get, "WORLD_SIZE", None)?;
        let local_rank: usize = num(&get, "LOCAL_RANK", Some(rank))?;
        let local_world_size: usize = num(&get, "LOCAL_WORLD_SIZE", Some(world_size))?;
        let master_port: u16 = num(&get, "MASTER_PORT", None)?;
        let master_addr = get("MASTER_ADDR").ok_or(Error::Env { var: "MASTER_ADDR", problem: "not set".into() })?;
        if world_size == 0 {
            return Err(Error::Env { var: "WORLD_SIZE", problem: "must be at least 1".into() });
        }
        if rank >= world_size {
            return Err(Error::Env { var: "RANK", problem: format!("{rank} is not below WORLD_SIZE {world_size}") });
        }
        if local_world_size == 0 || local_world_size > world_size {
            return Err(Error::Env { var: "LOCAL_WORLD_SIZE", problem: format!("{local_world_size} is not in 1..={world_size}") });
        }
        if local_rank >= local_world_size {
            return Err(Error::Env { var: "LOCAL_RANK", problem: format!("{local_rank} is not below LOCAL_WORLD_SIZE {local_world_size}") });
        }
        if master_addr.trim().is_empty() {
            return Err(Error::Env { var: "MASTER_ADDR", problem: "empty".into() });
        }
        Ok(Bootstrap {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr: master_addr.trim().to_string(),
            master_port,
            timeout: DEFAULT_TIMEOUT,
        })
    }

    /// The same bootstrap with every rendezvous step bounded by `timeout`.
    pub fn with_timeout(mut self, timeout: Duration) -> Bootstrap {
        self.timeout = timeout;
        self
    }

    /// Meets the other ranks: rank 0 listens on `MASTER_PORT` and waits for
    /// every other rank to connect; the others connect (retrying until the
    /// timeout while rank 0 is not up yet). Fails with [`Error::Timeout`]
    /// when a rank does not show up in time, [`Error::Bootstrap`] when one
    /// disagrees (another world size, a rank taken twice).
    pub fn connect(&self) -> Result<Rendezvous> {
        if self.world_size == 1 {
            return Ok(Rendezvous { rank: 0, size: 1, job: new_job_id(self.master_port), timeout: self.timeout, links: Mutex::new(Vec::new()) });
        }
        if self.rank == 0 {
            self.serve()
        } else {
            self.join()
        }
    }

    fn serve(&self) -> Result<Rendezvous> {
        let deadline = Instant::now() + self.timeout;
        let listener = TcpListener::bind((self.master_addr.as_str(), self.master_port))
            .or_else(|_| TcpListener::bind((Ipv4Addr::UNSPECIFIED, self.master_port)))
            .map_err(io_err("rendezvous: bind MASTER_PORT"))?;
        listener.set_nonblocking(true).map_err(io_err("rendezvous: listener"))?;
        let mut links: Vec<Option<TcpStream>> = (0..self.world_size).map(|_| None).collect();
        let mut arrived = 1;
        while arrived < self.world_size {
            let stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                    if Instant::now() > deadline {
                        let missing: Vec<usize> = (1..self.world_size).filter(|&r| links[r].is_none()).collect();
                        log::warn!("cuda-peer rendezvous: ranks {missing:?} did not connect");
                        return Err(Error::Timeout { op: "rendezvous (waiting for every rank to connect)", after: self.timeout });
                    }
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                Err(e) => return Err(io_err("rendezvous: accept")(e)),
            };
            let stream = self.configure(stream)?;
            let mut s = &stream;
            let hello = read_message(&mut s, "rendezvous: HELLO")?;
            let (rank, world) = parse_hello(&hello)?;
            if world != self.world_size {
                return Err(Error::Bootstrap {
                    op: "rendezvous",
                    reason: format!("rank {rank} says the world has {world} ranks, rank 0 says {}", self.world_size),
                });
            }
            if rank == 0 || rank >= self.world_size {
                return Err(Error::Bootstrap { op: "rendezvous", reason: format!("a peer claims rank {rank} in a world of {world}") });
            }
            if links[rank].is_some() {
                return Err(Error::Bootstrap { op: "rendezvous", reason: format!("rank {rank} connected twice") });
            }
            links[rank] = Some(stream);
            arrived += 1;
        }
        let job = new_job_id(self.master_port);
        let links: Vec<TcpStream> = links.into_iter().flatten().collect();
        for mut s in &links {
            write_message(&mut s, job.as_bytes(), "rendezvous: welcome")?;
        }
        Ok(Rendezvous { rank: 0, size: self.world_size, job, timeout: self.timeout, links: Mutex::new(links) })
    }

    fn join(&self) -> Result<Rendezvous> {
        let deadline = Instant::now() + self.timeout;
        let stream = loop {
            let addrs: Vec<SocketAddr> = (self.master_addr.as_str(), self.master_port).to_socket_addrs().map(|a| a.collect()).unwrap_or_default();
            let attempt = addrs.iter().find_map(|a| TcpStream::connect_timeout(a, Duration::from_secs(1)).ok());
            if let Some(s) = attempt {
                break s;
            }
            if Instant::now() > deadline {
                return Err(Error::Timeout { op: "rendezvous (connecting to rank 0)", after: self.timeout });
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let stream = self.configure(stream)?;
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&(self.rank as u32).to_le_bytes());
        hello.extend_from_slice(&(self.world_size as u32).to_le_bytes());
        let mut s = &stream;
        write_message(&mut s, &hello, "rendezvous: HELLO")?;
        // Rank 0 answers once every rank is there: wait up to the whole timeout.
        let job = read_message(&mut s, "rendezvous: welcome")?;
        let job = String::from_utf8(job).map_err(|_| Error::Bootstrap { op: "rendezvous", reason: "job id is not UTF-8".into() })?;
        Ok(Rendezvous { rank: self.rank, size: self.world_size, job, timeout: self.timeout, links: Mutex::new(vec![stream]) })
    }

    fn configure(&self, s: TcpStream) -> Result<TcpStream> {
        let t = Some(self.timeout.max(Duration::from_millis(1)));
        s.set_nonblocking(false).map_err(io_err("rendezvous: socket"))?;
        s.set_read_timeout(t).map_err(io_err("rendezvous: socket"))?;
        s.set_write_timeout(t).map_err(io_err("rendezvous: socket"))?;
        s.set_nodelay(true).map_err(io_err("rendezvous: socket"))?;
        Ok(s)
    }
}

/// All-gather of small byte blobs among the ranks of a job: what
/// [`crate::ipc::Comm`] needs of a bootstrap. [`Rendezvous`] implements it
/// over TCP; a framework with its own store can implement it over that.
pub trait Exchange: Send + Sync {
    /// This process's rank.
    fn rank(&self) -> usize;
    /// How many ranks the job has.
    fn size(&self) -> usize;
    /// A name for the job, the same on every rank and unique among the jobs
    /// on a host at a time (it names the job's Unix sockets).
    fn job_id(&self) -> &str;
    /// Every rank's `blob`, by rank (this rank's own included). Every rank
    /// must call it the same number of times, in the same order.
    fn all_gather(&self, blob: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()> {
        self.all_gather(&[]).map(|_| ())
    }
}

/// The TCP rendezvous of a job (see the module docs): rank 0 holds one
/// connection per other rank, the others one to rank 0.
#[derive(Debug)]
pub struct Rendezvous {
    rank: usize,
    size: usize,
    job: String,
    timeout: Duration,
    /// Rank 0: ranks 1.. in order; the others: the one to rank 0.
    links: Mutex<Vec<TcpStream>>,
}

impl Exchange for Rendezvous {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn job_id(&self) -> &str {
        &self.job
    }

    fn all_gather(&self, blob: &[u8]) -> Result<Vec<Vec<u8>>> {
        let links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        if self.size == 1 {
            return Ok(vec![blob.to_vec()]);
        }
        if self.rank == 0 {
            let mut all = vec![blob.to_vec()];
            for (i, mut s) in links.iter().enumerate() {
                let m = read_message(&mut s, "all-gather").map_err(|e| lost(e, i + 1))?;
                all.push(m);
            }
            let packed = pack(&all);
            for (i, mut s) in links.iter().enumerate() {
                write_message(&mut s, &packed, "all-gather").map_err(|e| lost(e, i + 1))?;
            }
            Ok(all)
        } else {
            let mut s = links.first().ok_or_else(|| Error::Internal("rendezvous without a link".into()))?;
            write_message(&mut s, blob, "all-gather").map_err(|e| lost(e, 0))?;
            let packed = read_message(&mut s, "all-gather").map_err(|e| lost(e, 0))?;
            let all = unpack(&packed)?;
            if all.len() != self.size {
                return Err(Error::Bootstrap { op: "all-gather", reason: format!("{} blobs for {} ranks", all.len(), self.size) });
            }
            Ok(all)
        }
    }
}

impl Rendezvous {
    /// The bound on each step.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}

/// Names the peer in an error of the link to it.
fn lost(e: Error, peer: usize) -> Error {
    match e {
        Error::Bootstrap { op, reason } => Error::Bootstrap { op, reason: format!("rank {peer}: {reason}") },
        other => other,
    }
}

fn new_job_id(port: u16) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("{:x}-{:x}-{port}", std::process::id(), nanos as u64)
}

fn parse_hello(m: &[u8]) -> Result<(usize, usize)> {
    if m.len() != MAGIC.len() + 8 || &m[..MAGIC.len()] != MAGIC {
        return Err(Error::Bootstrap { op: "rendezvous", reason: "a peer that does not speak the cuda-peer protocol connected".into() });
    }
    let word = |i: usize| {
        let mut b = [0u8; 4];
        b.copy_from_slice(&m[MAGIC.len() + 4 * i..MAGIC.len() + 4 * i + 4]);
        u32::from_le_bytes(b) as usize
    };
    Ok((word(0), word(1)))
}

/// Blobs as one message: a `u32` count, then each as a `u32` length and bytes.
pub(crate) fn pack(blobs: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + blobs.iter().map(|b| 4 + b.len()).sum::<usize>());
    out.extend_from_slice(&(blobs.len() as u32).to_le_bytes());
    for b in blobs {
        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        out.extend_from_slice(b);
    }
    out
}

/// The inverse of [`pack`].
pub(crate) fn unpack(mut m: &[u8]) -> Result<Vec<Vec<u8>>> {
    let bad = || Error::Bootstrap { op: "all-gather", reason: "malformed message".into() };
    let word = |m: &mut &[u8]| -> Result<usize> {
        let (head, rest) = m.split_at_checked(4).ok_or_else(bad)?;
        *m = rest;
        let mut b = [0u8; 4];
        b.copy_from_slice(head);
        Ok(u32::from_le_bytes(b) as usize)
    };
    let n = word(&mut m)?;
    let mut out = Vec::with_capacity(n.min(4096));
    for _ in 0..n {
        let len = word(&mut m)?;
        let (b, rest) = m.split_at_checked(len).ok_or_else(bad)?;
        out.push(b.to_vec());
        m = rest;
    }
    if !m.is_empty() {
        return Err(bad());
    }
    Ok(out)
}

/// Writes one length-prefixed message.
pub(crate) fn write_message(s: &mut impl Write, m: &[u8], op: &'static str) -> Result<()> {
    if m.len() > MAX_MESSAGE_BYTES {
        return Err(Error::InvalidArgument(format!("{op}: a message of {} bytes (at most {MAX_MESSAGE_BYTES})", m.len())));
    }
    let mut framed = Vec::with_capacity(4 + m.len());
    framed.extend_from_slice(&(m.len() as u32).to_le_bytes());
    framed.extend_from_slice(m);
    s.write_all(&framed).and_then(|()| s.flush()).map_err(io_err(op))
}

/// Reads one length-prefixed message (bounded by the stream's read timeout).
pub(crate) fn read_message(s: &mut impl Read, op: &'static str) -> Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).map_err(io_err(op))?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_MESSAGE_BYTES {
        return Err(Error::Bootstrap { op, reason: format!("a message of {len} bytes (at most {MAX_MESSAGE_BYTES})") });
    }
    let mut m = vec![0u8; len];
    s.read_exact(&mut m).map_err(io_err(op))?;
    Ok(m)
}

/// Maps an I/O error of step `op`: a timeout to [`Error::Timeout`] (the
/// socket's bound is not known here: reported as zero when unknown), the
/// rest to [`Error::Bootstrap`].
pub(crate) fn io_err(op: &'static str) -> impl Fn(std::io::Error) -> Error {
    move |e| match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => Error::Bootstrap { op, reason: format!("timed out ({e})") },
        ErrorKind::UnexpectedEof => Error::Bootstrap { op, reason: "the peer closed the connection (exited?)".into() },
        _ => Error::Bootstrap { op, reason: e.to_string() },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| map.get(k).cloned()
    }

    const FULL: [(&str, &str); 6] =
        [("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")];

    #[test]
    fn torchrun_variables_parse() {
        let b = Bootstrap::from_vars(vars(&FULL)).unwrap();
        assert_eq!((b.rank, b.world_size, b.local_rank, b.local_world_size), (1, 2, 1, 2));
        assert_eq!((b.master_addr.as_str(), b.master_port), ("127.0.0.1", 29500));
        // LOCAL_* default to the global values.
        let b = Bootstrap::from_vars(vars(&[FULL[0], FULL[1], FULL[4], FULL[5]])).unwrap();
        assert_eq!((b.local_rank, b.local_world_size), (1, 2));
    }

    #[test]
    fn missing_and_invalid_variables_are_typed_errors() {
        for missing in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
            let pairs: Vec<_> = FULL.iter().copied().filter(|(k, _)| *k != missing).collect();
            match Bootstrap::from_vars(vars(&pairs)) {
                Err(Error::Env { var, problem }) => {
                    assert_eq!((var, problem.as_str()), (missing, "not set"))
                }
                other => panic!("{missing}: {other:?}"),
            }
        }
        let cases: [(&str, &str, &str); 6] = [
            ("RANK", "x", "RANK"),
            ("RANK", "2", "RANK"),
            ("WORLD_SIZE", "0", "WORLD_SIZE"),
            ("MASTER_PORT", "70000", "MASTER_PORT"),
            ("LOCAL_RANK", "-1", "LOCAL_RANK"),
            ("LOCAL_WORLD_SIZE", "3", "LOCAL_WORLD_SIZE"),
        ];
        for (key, value, blamed) in cases {
            let pairs: Vec<_> = FULL.iter().map(|&(k, v)| if k == key { (k, value) } else { (k, v) }).collect();
            match Bootstrap::from_vars(vars(&pairs)) {
                Err(Error::Env { var, .. }) => assert_eq!(var, blamed, "{key}={value}"),
                other => panic!("{key}={value}: {other:?}"),
            }
        }
        assert!(matches!(Bootstrap::new(2, 2, 0, 1, "h", 1), Err(Error::InvalidArgument(_))));
        assert!(Bootstrap::new(1, 2, 0, 1, "h", 1).is_ok());
    }

    #[test]
    fn pack_round_trips_and_rejects_garbage() {
        let blobs = vec![vec![], vec![1, 2, 3], vec![9; 300]];
        assert_eq!(unpack(&pack(&blobs)).unwrap(), blobs);
        assert!(unpack(&[1, 0, 0, 0, 5, 0, 0, 0, 1]).is_err());
        assert!(unpack(&[]).is_err());
    }

    /// A free port on 127.0.0.1 (free when asked; the rendezvous binds it again).
    pub(crate) fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    #[test]
    fn ranks_on_threads_meet_and_all_gather() {
        for n in [1usize, 2, 5] {
            let port = free_port();
            let handles: Vec<_> = (0..n)
                .map(|r| {
                    std::thread::spawn(move || {
                        let b = Bootstrap::new(r, n, r, n, "127.0.0.1", port).unwrap().with_timeout(Duration::from_secs(20));
                        let rv = b.connect().unwrap();
                        assert_eq!((rv.rank(), rv.size()), (r, n));
                        let all = rv.all_gather(format!("rank {r}").as_bytes()).unwrap();
                        let again = rv.all_gather(&vec![r as u8; r * 1000]).unwrap();
                        rv.barrier().unwrap();
                        (rv.job_id().to_string(), all, again)
                    })
                })
                .collect();
            let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            for (job, all, again) in &results {
                assert_eq!(job, &results[0].0);
                assert_eq!(all, &(0..n).map(|r| format!("rank {r}").into_bytes()).collect::<Vec<_>>());
                assert_eq!(again, &(0..n).map(|r| vec![r as u8; r * 1000]).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn a_rank_that_never_shows_up_is_a_bounded_timeout() {
        let port = free_port();
        let t = Duration::from_millis(500);
        let start = Instant::now();
        // Rank 0 of 3 with only rank 1 arriving.
        let joiner = std::thread::spawn(move || Bootstrap::new(1, 3, 1, 3, "127.0.0.1", port).unwrap().with_timeout(t).connect().map(|_| ()));
        let served = Bootstrap::new(0, 3, 0, 3, "127.0.0.1", port).unwrap().with_timeout(t).connect();
        assert!(matches!(served, Err(Error::Timeout { .. })), "{served:?}");
        let joined = joiner.join().unwrap();
        assert!(joined.is_err(), "{joined:?}");
        assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
        // Nobody serving: the joiner gives up in time too.
        let start = Instant::now();
        let alone = Bootstrap::new(1, 2, 1, 2, "127.0.0.1", free_port()).unwrap().with_timeout(t).connect();
        assert!(matches!(alone, Err(Error::Timeout { .. })), "{alone:?}");
        assert!(start.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_rank_that_leaves_fails_the_others_all_gather() {
        let port = free_port();
        let t = Duration::from_secs(10);
        let leaver = std::thread::spawn(move || {
            let rv = Bootstrap::new(1, 2, 1, 2, "127.0.0.1", port).unwrap().with_timeout(t).connect().unwrap();
            drop(rv);
        });
        let rv = Bootstrap::new(0, 2, 0, 2, "127.0.0.1", port).unwrap().with_timeout(t).connect().unwrap();
        leaver.join().unwrap();
        let start = Instant::now();
        let r = rv.all_gather(b"x");
        assert!(matches!(r, Err(Error::Bootstrap { .. })), "{r:?}");
        assert!(start.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn disagreeing_world_sizes_are_refused() {
        let port = free_port();
        let t = Duration::from_secs(5);
        let joiner = std::thread::spawn(move || Bootstrap::new(1, 3, 1, 3, "127.0.0.1", port).unwrap().with_timeout(t).connect().map(|_| ()));
        let served = Bootstrap::new(0, 2, 0, 2, "127.0.0.1", port).unwrap().with_timeout(t).connect();
        assert!(matches!(served, Err(Error::Bootstrap { .. })), "{served:?}");
        assert!(joiner.join().unwrap().is_err());
    }
}
