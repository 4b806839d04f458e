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
//! Only the job's ranks join: every connection to rank 0 runs a mutual
//! challenge-response over the job's secret ([`super::secret`] says where
//! the secret comes from; `super::wire` gives the protocol), so a process
//! without it is dropped before it learns anything or is given a rank, and
//! a process squatting on `MASTER_PORT` is not taken for rank 0. Rank 0
//! handles each new connection on its own thread, with a deadline of its
//! own, so that strangers, stray requests and slow peers do not hold up the
//! rendezvous; they are dropped and logged. Rank 0 listens only on the
//! address `MASTER_ADDR` resolves to (or the one
//! [`Bootstrap::with_bind_addr`] / `CUDA_PEER_BIND_ADDR` gives), never on
//! every interface in its stead.
//!
//! After the handshake an all-gather is one message from each rank to rank
//! 0 and one message back with every rank's blob, each with a MAC; every
//! message is bounded in size ([`MAX_MESSAGE_BYTES`]) and must arrive whole
//! within the bootstrap's timeout.

use super::id::Id;
use super::secret::{self, JobSecret};
use super::wire::{self, Link, Refusal};
use crate::error::{Error, Result};
use std::collections::VecDeque;
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub(crate) use super::wire::io_err;

/// How long a rendezvous step waits by default (for the other ranks to
/// arrive, for a message) before it fails with [`Error::Timeout`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// The largest message of the rendezvous protocol (a sanity bound: blobs
/// are small).
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

pub use super::id::BIND_ADDR_ENV;

/// The most ranks of one job: rank 0 holds a connection to every other
/// rank (a star), which does not serve more.
pub const MAX_WORLD_SIZE: usize = 1 << 16;

/// The longest a new connection may take to prove the secret.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// The most connections rank 0 authenticates at once: a new one past it
/// closes the oldest (a flood of silent connections cannot keep the ranks
/// out until their deadlines pass).
const MAX_PENDING: usize = 64;
/// The most connections rank 0 takes from its queue between two looks at
/// the finished handshakes and its deadline.
const ACCEPTS_PER_ROUND: usize = 64;

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
    /// The job's secret (see [`super::secret`] for where it comes from when
    /// `None`).
    pub secret: Option<JobSecret>,
    /// Whether ranks on several hosts may meet without a secret (anyone who
    /// reaches the port may then join).
    pub insecure: bool,
    /// The address rank 0 listens on, when not `master_addr`'s.
    pub bind_addr: Option<String>,
}

/// How a rank proves it belongs to the job.
enum Key {
    /// A secret every rank was given.
    Given(JobSecret),
    /// Rank 0 wrote it to this file (a job on one host); joiners read it,
    /// again at each attempt (a file left by an earlier job on the same
    /// port is replaced by rank 0).
    LocalFile(PathBuf),
}

impl Key {
    /// The secret now, or why there is none yet (its file is missing, or
    /// is not one rank 0 wrote: rank 0 replaces it).
    fn current(&self) -> std::result::Result<JobSecret, String> {
        match self {
            Key::Given(s) => Ok(s.clone()),
            Key::LocalFile(p) => secret::read_private_file(p).map_err(|e| format!("no usable secret file from rank 0 yet ({e})")),
        }
    }
}

/// The key that lets anyone join: used only when [`Bootstrap::insecure`]
/// is set and no secret is given.
const INSECURE_KEY: &str = "cuda-peer: no job secret (insecure)";

impl Bootstrap {
    /// Checks and takes the given places (for frameworks that know them
    /// from their own launcher): a rank outside the world, or a world of
    /// none or of more than [`MAX_WORLD_SIZE`] ranks, is
    /// [`Error::InvalidArgument`].
    pub fn new(rank: usize, world_size: usize, local_rank: usize, local_world_size: usize, master_addr: &str, master_port: u16) -> Result<Bootstrap> {
        if world_size == 0 || world_size > MAX_WORLD_SIZE {
            return Err(Error::InvalidArgument(format!("world size {world_size} (1 to {MAX_WORLD_SIZE})")));
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
        Ok(Bootstrap {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr: master_addr.to_string(),
            master_port,
            timeout: DEFAULT_TIMEOUT,
            secret: None,
            insecure: false,
            bind_addr: None,
        })
    }

    /// Reads torchrun's variables from the environment: `RANK`,
    /// `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` (required),
    /// `LOCAL_RANK` and `LOCAL_WORLD_SIZE` (default: `RANK` and
    /// `WORLD_SIZE`, a one-host job); and cuda-peer's: the job's secret
    /// (`CUDA_PEER_JOB_SECRET` or `CUDA_PEER_JOB_SECRET_FILE`),
    /// `CUDA_PEER_INSECURE_BOOTSTRAP` and `CUDA_PEER_BIND_ADDR`.
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
        if world_size == 0 || world_size > MAX_WORLD_SIZE {
            return Err(Error::Env { var: "WORLD_SIZE", problem: format!("{world_size} is not in 1..={MAX_WORLD_SIZE}") });
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
            secret: JobSecret::from_vars(&get)?,
            insecure: get(secret::INSECURE_ENV).is_some_and(|v| v.trim() == "1"),
            bind_addr: get(BIND_ADDR_ENV).map(|a| a.trim().to_string()).filter(|a| !a.is_empty()),
        })
    }

    /// Rank `rank` of `world_size` in the job of `id` (made by [`Id::new`]
    /// on rank 0, its bytes sent to the others by the application): rank 0
    /// listens where the id says (on the listener `Id::new` bound, when this
    /// process made it), and every rank proves the id's secret. The ranks
    /// may be on one host or several.
    pub fn from_id(rank: usize, world_size: usize, id: &Id) -> Result<Bootstrap> {
        let at = id.addr();
        let mut b = Bootstrap::new(rank, world_size, 0, 1, &at.ip().to_string(), at.port())?;
        b.secret = Some(id.secret());
        Ok(b)
    }

    /// The same bootstrap with every rendezvous step bounded by `timeout`.
    pub fn with_timeout(mut self, timeout: Duration) -> Bootstrap {
        self.timeout = timeout;
        self
    }

    /// The same bootstrap with the job's secret (every rank must be given
    /// the same one).
    pub fn with_secret(mut self, secret: JobSecret) -> Bootstrap {
        self.secret = Some(secret);
        self
    }

    /// The same bootstrap letting ranks on several hosts meet without a
    /// secret: anyone who can reach `MASTER_PORT` can then join the job and
    /// read what it exchanges. For trusted, isolated networks only.
    pub fn insecure(mut self) -> Bootstrap {
        self.insecure = true;
        self
    }

    /// The same bootstrap with rank 0 listening on `addr` instead of the
    /// address `master_addr` resolves to.
    pub fn with_bind_addr(mut self, addr: &str) -> Bootstrap {
        self.bind_addr = Some(addr.to_string());
        self
    }

    /// Meets the other ranks: rank 0 listens on `MASTER_PORT` and waits for
    /// every other rank to connect and prove the job's secret; the others
    /// connect (retrying until the timeout while rank 0 is not up yet, or
    /// while what listens does not prove the secret). Fails with
    /// [`Error::Timeout`] when a rank does not show up in time,
    /// [`Error::Bootstrap`] when one that proved the secret disagrees
    /// (another world size, a rank out of range), when rank 0 cannot listen
    /// where it should, or when ranks on several hosts have no secret.
    pub fn connect(&self) -> Result<Rendezvous> {
        if self.world_size == 1 {
            // A listener an `Id` bound for this job is not needed: closed.
            drop(self.listen_addr().and_then(super::id::take_listener));
            return Ok(Rendezvous { rank: 0, size: 1, job: new_job_id()?, timeout: self.timeout, links: Mutex::new(Vec::new()) });
        }
        if self.rank == 0 {
            super::id::adopt_inherited_listener(self.master_port);
            let listener = match self.listen_addr().and_then(super::id::take_listener) {
                Some(l) => l,
                None => self.listen()?,
            };
            self.serve_on(listener)
        } else {
            self.join()
        }
    }

    /// The key of this job; rank 0 of a one-host job without a secret
    /// writes a new one to its file (removed once every rank has joined).
    fn key(&self, port: u16) -> Result<(Key, Option<PathBuf>)> {
        if let Some(s) = &self.secret {
            return Ok((Key::Given(s.clone()), None));
        }
        if self.local_world_size == self.world_size {
            if self.rank == 0 {
                let (s, path) = secret::publish_local_secret(port)?;
                return Ok((Key::Given(s), Some(path)));
            }
            return Ok((Key::LocalFile(secret::local_secret_path(port)?), None));
        }
        if self.insecure {
            log::warn!("cuda-peer rendezvous: no job secret and CUDA_PEER_INSECURE_BOOTSTRAP set: anyone who reaches port {port} can join");
            return Ok((Key::Given(JobSecret::new(INSECURE_KEY)?), None));
        }
        Err(Error::Bootstrap {
            op: "rendezvous",
            reason: format!(
                "the job spans hosts (LOCAL_WORLD_SIZE {} < WORLD_SIZE {}) and has no secret: give every rank the same \
                 CUDA_PEER_JOB_SECRET (or CUDA_PEER_JOB_SECRET_FILE), or set CUDA_PEER_INSECURE_BOOTSTRAP=1 on a trusted network",
                self.local_world_size, self.world_size
            ),
        })
    }

    /// The one address rank 0 listens on, where it is an IP address (not a
    /// name that needs resolving).
    fn listen_addr(&self) -> Option<SocketAddr> {
        let host = self.bind_addr.as_deref().unwrap_or(&self.master_addr);
        host.parse::<std::net::IpAddr>().ok().map(|ip| SocketAddr::new(ip, self.master_port))
    }

    /// Rank 0's listener: on the bind address if given, else on an address
    /// `master_addr` resolves to that is this host's; never on every
    /// interface in its stead.
    pub(crate) fn listen(&self) -> Result<TcpListener> {
        let host = self.bind_addr.as_deref().unwrap_or(&self.master_addr);
        let addrs: Vec<SocketAddr> = (host, self.master_port)
            .to_socket_addrs()
            .map(|a| a.collect())
            .map_err(|e| Error::Bootstrap { op: "rendezvous: resolving MASTER_ADDR", reason: format!("{host}: {e}") })?;
        Self::listen_on(&addrs, host)
    }

    /// A listener on the first of `addrs` (what `host` resolves to) that is
    /// an address of this host. One that is in use fails the rendezvous at
    /// once: the joiners may reach whoever holds it (another job, or a
    /// squatter collecting their handshakes), so rank 0 must not listen on
    /// another of the job's addresses in its stead.
    fn listen_on(addrs: &[SocketAddr], host: &str) -> Result<TcpListener> {
        let mut last = None;
        for a in addrs {
            match TcpListener::bind(a) {
                Ok(l) => return Ok(l),
                Err(e) if e.kind() == ErrorKind::AddrInUse => {
                    last = Some((a, e));
                    break;
                }
                Err(e) => last = Some((a, e)),
            }
        }
        let reason = match last {
            Some((a, e)) if e.kind() == ErrorKind::AddrInUse => {
                format!("{a} is in use (another job, or another process listening on MASTER_PORT)")
            }
            Some((a, e)) if e.kind() == ErrorKind::AddrNotAvailable => format!(
                "{a} ({host}) is not an address of this host: set {BIND_ADDR_ENV} (or Bootstrap::with_bind_addr) to the local address to listen on"
            ),
            Some((a, e)) => format!("{a}: {e}"),
            None => format!("{host} resolves to no address"),
        };
        Err(Error::Bootstrap { op: "rendezvous: listening on MASTER_PORT", reason })
    }

    /// Rank 0: serves the rendezvous on `listener` (bound already, so that
    /// no other process can take its port in between).
    pub(crate) fn serve_on(&self, listener: TcpListener) -> Result<Rendezvous> {
        let deadline = wire::deadline(self.timeout);
        let port = listener.local_addr().map_err(io_err("rendezvous: listener"))?.port();
        let (key, published) = self.key(port)?;
        // The one-host secret file goes once every rank has joined, or failed to.
        let _remove = published.map(RemoveOnDrop);
        let secret = key.current().map_err(Error::Internal)?;
        listener.set_nonblocking(true).map_err(io_err("rendezvous: listener"))?;
        let mut links: Vec<Option<Link>> = (0..self.world_size).map(|_| None).collect();
        let (tx, rx) = mpsc::channel::<Handshake>();
        // The connections being authenticated, oldest first (a handle each, to close it).
        let mut pending: VecDeque<(u64, TcpStream)> = VecDeque::new();
        let mut next = 0u64;
        while links.iter().skip(1).any(Option::is_none) {
            // A bounded number of connections per round, so that a flood
            // that never lets the queue run dry still leaves time for the
            // results and the deadline below.
            for _ in 0..ACCEPTS_PER_ROUND {
                let (stream, from) = match listener.accept() {
                    Ok(c) => c,
                    Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => break,
                    Err(e) => {
                        log::warn!("cuda-peer rendezvous: accept: {e}");
                        break;
                    }
                };
                // Finished handshakes first: only connections still proving
                // the secret are closed to make room.
                take_results(&rx, &mut pending, &mut links)?;
                if pending.len() >= MAX_PENDING {
                    if let Some((_, oldest)) = pending.pop_front() {
                        let _ = oldest.shutdown(std::net::Shutdown::Both);
                    }
                }
                // A connection that cannot be handed on (no descriptor or
                // thread left) is dropped, not the rendezvous.
                let handle = match stream.try_clone() {
                    Ok(h) => h,
                    Err(e) => {
                        log::warn!("cuda-peer rendezvous: dropped a connection from {from}: {e}");
                        continue;
                    }
                };
                let (tx, secret, world, id) = (tx.clone(), secret.clone(), self.world_size, next);
                let until = deadline.min(wire::deadline(HANDSHAKE_TIMEOUT));
                let spawned = std::thread::Builder::new()
                    .name("cuda-peer-handshake".into())
                    .spawn(move || drop(tx.send((id, from, wire::accept(stream, &secret, world, until)))));
                match spawned {
                    Ok(_) => {
                        next += 1;
                        pending.push_back((id, handle));
                    }
                    Err(e) => {
                        log::warn!("cuda-peer rendezvous: dropped a connection from {from}: {e}");
                        let _ = handle.shutdown(std::net::Shutdown::Both);
                    }
                }
            }
            take_results(&rx, &mut pending, &mut links)?;
            if Instant::now() >= deadline {
                let missing: Vec<usize> = (1..self.world_size).filter(|&r| links[r].is_none()).collect();
                log::warn!("cuda-peer rendezvous: ranks {missing:?} did not connect");
                return Err(Error::Timeout { op: "rendezvous (waiting for every rank to connect)", after: self.timeout });
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let job = new_job_id()?;
        let mut links: Vec<Link> = links.into_iter().flatten().collect();
        for l in &mut links {
            l.send(job.as_bytes(), deadline, "rendezvous: welcome")?;
        }
        Ok(Rendezvous { rank: 0, size: self.world_size, job, timeout: self.timeout, links: Mutex::new(links) })
    }

    fn join(&self) -> Result<Rendezvous> {
        let deadline = wire::deadline(self.timeout);
        let (key, _) = self.key(self.master_port)?;
        let mut why = String::from("rank 0 is not listening yet");
        let mut link = loop {
            if Instant::now() >= deadline {
                log::warn!("cuda-peer rendezvous: rank {} could not join {}:{}: {why}", self.rank, self.master_addr, self.master_port);
                return Err(Error::Timeout { op: "rendezvous (connecting to rank 0)", after: self.timeout });
            }
            let secret = match key.current() {
                Ok(s) => s,
                Err(w) => {
                    why = w;
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
            };
            let addrs: Vec<SocketAddr> = (self.master_addr.as_str(), self.master_port).to_socket_addrs().map(|a| a.collect()).unwrap_or_default();
            // Every address in turn: one that answers but fails the handshake
            // (not rank 0 of this job) must not keep the others from being tried.
            let mut joined = None;
            for a in &addrs {
                // Each attempt within what is left of the deadline.
                let step = Duration::from_secs(1).min(deadline.saturating_duration_since(Instant::now()));
                let Ok(s) = TcpStream::connect_timeout(a, step.max(Duration::from_millis(1))) else { continue };
                let until = deadline.min(wire::deadline(HANDSHAKE_TIMEOUT));
                match wire::join(s, &secret, self.rank, self.world_size, until) {
                    Ok(link) => {
                        joined = Some(link);
                        break;
                    }
                    Err(Refusal::Job(e)) => return Err(e),
                    Err(Refusal::Stranger(w)) => why = format!("{a}: {w}"),
                }
            }
            if let Some(link) = joined {
                break link;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        // Rank 0 answers once every rank is there: wait up to the whole timeout.
        let job = link.recv(256, deadline, "rendezvous: welcome")?;
        let job = String::from_utf8(job).map_err(|_| Error::Bootstrap { op: "rendezvous", reason: "job id is not UTF-8".into() })?;
        Ok(Rendezvous { rank: self.rank, size: self.world_size, job, timeout: self.timeout, links: Mutex::new(vec![link]) })
    }
}

/// A handshake's outcome, from its thread: the connection's number, its
/// address, and the rank it proved with its link, or why it was refused.
type Handshake = (u64, SocketAddr, std::result::Result<(usize, Link), Refusal>);

/// Takes the handshakes finished so far: a rank that proved the secret
/// gets its link (a newer connection replaces an older one), a stranger is
/// dropped, and a job member that disagrees with the job fails it. A
/// handshake whose connection was closed to make room is dropped too (its
/// link is shut).
fn take_results(rx: &mpsc::Receiver<Handshake>, pending: &mut VecDeque<(u64, TcpStream)>, links: &mut [Option<Link>]) -> Result<()> {
    while let Ok((id, from, got)) = rx.try_recv() {
        let Some(at) = pending.iter().position(|(p, _)| *p == id) else {
            log::warn!("cuda-peer rendezvous: a connection from {from} was closed while it proved the secret");
            continue;
        };
        pending.remove(at);
        match got {
            Ok((rank, link)) => {
                if links[rank].replace(link).is_some() {
                    log::warn!("cuda-peer rendezvous: rank {rank} connected again (from {from}); the newer connection is kept");
                }
            }
            Err(Refusal::Stranger(why)) => log::warn!("cuda-peer rendezvous: dropped a connection from {from}: {why}"),
            Err(Refusal::Job(e)) => return Err(e),
        }
    }
    Ok(())
}

/// Removes a file when dropped.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// All-gather of small byte blobs among the ranks of a job: what
/// [`crate::ipc::Comm`] needs of a bootstrap. [`Rendezvous`] implements it
/// over TCP; a framework with its own store can implement it over that.
///
/// What it returns is trusted to come from the job's ranks: an
/// implementation over a framework's store must let only the job's ranks
/// write it (as [`Rendezvous`] does with the job's secret). Its results are
/// still checked (one blob per rank, sizes) before use.
pub trait Exchange: Send + Sync {
    /// This process's rank.
    fn rank(&self) -> usize;
    /// How many ranks the job has.
    fn size(&self) -> usize;
    /// A name for the job, the same on every rank and unique among the jobs
    /// on a host at a time.
    fn job_id(&self) -> &str;
    /// Every rank's `blob`, by rank (this rank's own included). Every rank
    /// must call it the same number of times, in the same order.
    fn all_gather(&self, blob: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()> {
        gather(self, &[]).map(|_| ())
    }
}

/// [`Exchange::all_gather`], checked: one blob per rank, this rank's own
/// where it belongs. Every caller of an exchange goes through it.
pub(crate) fn gather<E: Exchange + ?Sized>(ex: &E, blob: &[u8]) -> Result<Vec<Vec<u8>>> {
    let all = ex.all_gather(blob)?;
    if all.len() != ex.size() {
        return Err(Error::Bootstrap { op: "all-gather", reason: format!("{} blobs for {} ranks", all.len(), ex.size()) });
    }
    if all.get(ex.rank()).map(Vec::as_slice) != Some(blob) {
        return Err(Error::Bootstrap { op: "all-gather", reason: format!("rank {}'s own blob came back altered", ex.rank()) });
    }
    Ok(all)
}

/// A step every rank takes together: every rank's outcome, all-gathered
/// (through [`gather`]), so that a failure on one rank fails every rank at
/// once, with the failing rank's error, instead of leaving them waiting.
/// `Ok` holds every rank's value, by rank.
pub(crate) fn agree<E: Exchange + ?Sized>(ex: &E, step: &'static str, mine: Result<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
    let blob = match &mine {
        Ok(b) => [&[b'+'][..], b].concat(),
        Err(e) => format!("-{e}").into_bytes(),
    };
    let all = gather(ex, &blob)?;
    mine?;
    let mut values = Vec::with_capacity(all.len());
    for (r, b) in all.into_iter().enumerate() {
        match b.split_first() {
            Some((b'+', v)) => values.push(v.to_vec()),
            Some((b'-', why)) => return Err(peer_failed(step, r, &String::from_utf8_lossy(why))),
            _ => return Err(Error::Bootstrap { op: step, reason: format!("rank {r} sent a malformed reply") }),
        }
    }
    Ok(values)
}

/// The error of a step that rank `r` reported failed, `why` (every rank
/// but `r` returns it).
pub(crate) fn peer_failed(step: &'static str, r: usize, why: &str) -> Error {
    Error::Bootstrap { op: step, reason: format!("rank {r} failed: {why}") }
}

/// The TCP rendezvous of a job (see the module docs): rank 0 holds one
/// authenticated link per other rank, the others one to rank 0.
#[derive(Debug)]
pub struct Rendezvous {
    rank: usize,
    size: usize,
    job: String,
    timeout: Duration,
    /// Rank 0: ranks 1.. in order; the others: the one to rank 0.
    links: Mutex<Vec<Link>>,
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
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        if self.size == 1 {
            return Ok(vec![blob.to_vec()]);
        }
        let deadline = wire::deadline(self.timeout);
        if self.rank == 0 {
            let mut all = vec![blob.to_vec()];
            for (i, l) in links.iter_mut().enumerate() {
                let m = l.recv(MAX_MESSAGE_BYTES, deadline, "all-gather").map_err(|e| lost(e, i + 1))?;
                all.push(m);
            }
            let packed = pack(&all)?;
            for (i, l) in links.iter_mut().enumerate() {
                l.send(&packed, deadline, "all-gather").map_err(|e| lost(e, i + 1))?;
            }
            Ok(all)
        } else {
            let l = links.first_mut().ok_or_else(|| Error::Internal("rendezvous without a link".into()))?;
            if blob.len() > MAX_MESSAGE_BYTES {
                return Err(Error::InvalidArgument(format!("all-gather: a blob of {} bytes (at most {MAX_MESSAGE_BYTES})", blob.len())));
            }
            l.send(blob, deadline, "all-gather").map_err(|e| lost(e, 0))?;
            let packed = l.recv(MAX_MESSAGE_BYTES, deadline, "all-gather").map_err(|e| lost(e, 0))?;
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

/// A new job id: 16 random bytes in hex (it names nothing another process
/// could take first: the descriptor sockets have names of their own).
fn new_job_id() -> Result<String> {
    Ok(secret::hex(&secret::random_bytes::<16>()?))
}

/// Blobs as one message: a `u32` count, then each as a `u32` length and
/// bytes; at most [`MAX_MESSAGE_BYTES`] in all.
pub(crate) fn pack(blobs: &[Vec<u8>]) -> Result<Vec<u8>> {
    let total = blobs.iter().fold(4usize, |t, b| t.saturating_add(4).saturating_add(b.len()));
    if total > MAX_MESSAGE_BYTES {
        return Err(Error::InvalidArgument(format!("all-gather: {total} bytes in all (at most {MAX_MESSAGE_BYTES})")));
    }
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(&(blobs.len() as u32).to_le_bytes());
    for b in blobs {
        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        out.extend_from_slice(b);
    }
    Ok(out)
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

    /// A name may resolve to several addresses (`localhost`: ::1 and
    /// 127.0.0.1). Where another process holds the port on one of them,
    /// rank 0 fails naming it, rather than listening on the next while the
    /// joiners reach the squatter.
    #[test]
    fn rank_0_does_not_listen_elsewhere_when_one_of_the_jobs_addresses_is_taken() {
        let squatter = TcpListener::bind("127.0.0.1:0").unwrap();
        let taken = squatter.local_addr().unwrap();
        let other: SocketAddr = format!("127.0.0.2:{}", taken.port()).parse().unwrap();
        match Bootstrap::listen_on(&[taken, other], "a-name") {
            Err(Error::Bootstrap { reason, .. }) => assert!(reason.contains("in use") && reason.contains(&taken.to_string()), "{reason}"),
            Ok(l) => panic!("rank 0 listened on {:?} while {taken} was taken", l.local_addr()),
            Err(e) => panic!("{e}"),
        }
        // An address that is not this host's is passed over (TEST-NET-1).
        let foreign: SocketAddr = format!("192.0.2.1:{}", taken.port()).parse().unwrap();
        if TcpListener::bind(other).is_ok() {
            let l = Bootstrap::listen_on(&[foreign, other], "a-name").expect("the next address");
            assert_eq!(l.local_addr().unwrap(), other);
        }
    }

    /// A job of one rank needs no listener: the one its `Id` bound is
    /// closed (a framework that makes one such communicator per layer
    /// would otherwise keep a listening socket for each).
    #[test]
    fn a_job_of_one_rank_closes_its_ids_listener() {
        for _ in 0..3 {
            let id = super::super::id::Id::with_addr(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)).unwrap();
            Bootstrap::from_id(0, 1, &id).unwrap().connect().unwrap();
            assert!(super::super::id::take_listener(id.addr()).is_none(), "the listener of {} is still held", id.addr());
            assert!(TcpListener::bind(id.addr()).is_ok(), "{} is still bound after the job of one rank met", id.addr());
        }
    }

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
        let too_many = (MAX_WORLD_SIZE + 1).to_string();
        let cases: [(&str, &str, &str); 7] = [
            ("RANK", "x", "RANK"),
            ("RANK", "2", "RANK"),
            ("WORLD_SIZE", "0", "WORLD_SIZE"),
            ("WORLD_SIZE", &too_many, "WORLD_SIZE"),
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
        // Rank 0 holds a slot per rank: a world it cannot serve is refused
        // before anything is sized by it.
        for world in [MAX_WORLD_SIZE + 1, usize::MAX] {
            assert!(matches!(Bootstrap::new(0, world, 0, 1, "h", 1), Err(Error::InvalidArgument(_))), "{world}");
        }
        assert!(Bootstrap::new(0, MAX_WORLD_SIZE, 0, 1, "h", 1).is_ok());
    }

    #[test]
    fn pack_round_trips_and_rejects_garbage() {
        let blobs = vec![vec![], vec![1, 2, 3], vec![9; 300]];
        assert_eq!(unpack(&pack(&blobs).unwrap()).unwrap(), blobs);
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

    /// Rank 0 makes an id, the others rebuild it from its bytes, and all
    /// meet on the listener the id bound; a rank holding another job's id
    /// does not get in.
    #[test]
    fn ranks_meet_through_an_id() {
        let id = Id::with_addr(std::net::Ipv4Addr::LOCALHOST.into()).unwrap();
        let bytes = *id.as_bytes();
        let n = 3;
        let stranger = Id::with_addr(std::net::Ipv4Addr::LOCALHOST.into()).unwrap();
        let wrong = Bootstrap { master_port: id.addr().port(), ..Bootstrap::from_id(1, n, &stranger).unwrap() };
        let handles: Vec<_> = (0..n)
            .map(|r| {
                std::thread::spawn(move || {
                    let id = Id::from_bytes(&bytes).unwrap();
                    let rv = Bootstrap::from_id(r, n, &id).unwrap().with_timeout(Duration::from_secs(20)).connect().unwrap();
                    (rv.job_id().to_string(), rv.all_gather(&[r as u8]).unwrap())
                })
            })
            .collect();
        let intruder = wrong.with_timeout(Duration::from_millis(800)).connect();
        assert!(matches!(intruder, Err(Error::Timeout { .. })), "{intruder:?}");
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        for (job, all) in &results {
            assert_eq!(job, &results[0].0);
            assert_eq!(all, &vec![vec![0u8], vec![1], vec![2]]);
        }
        assert!(super::super::id::take_listener(id.addr()).is_none(), "rank 0 used the id's listener");
        super::super::id::take_listener(stranger.addr());
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
