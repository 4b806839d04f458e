//! A communicator of processes, one rank per process, each on its own GPU
//! of one host, with the collectives of the single-process API between
//! them: every rank's slots, flags and staging buffer live in a
//! [`DeviceRegion`] of its own device memory that every peer process
//! imports and maps.
//!
//! * all-reduce: the one-shot of `crate::algorithms::oneshot`; each rank's kernel
//!   pushes its input into its peers' regions (SM stores over P2P); or,
//!   where asked ([`AllReduceAlgorithm::TwoShot`]), the two-shot: the
//!   reduce-scatter below into this rank's part of the output, then the
//!   all-gather of the parts;
//! * all-gather, broadcast, reduce-scatter, reduce: in chunks of half the
//!   staging buffer ([`CommOptions::buffer_bytes`]), alternating halves:
//!   each rank copies what its peers need into its own buffer, the ranks
//!   meet at a device-side barrier (a one-element one-shot all-reduce,
//!   bounded by [`CommOptions::barrier_timeout`] like any one-shot), and
//!   each rank then reads its peers' buffers: copies (copy engine, over
//!   P2P) for all-gather and broadcast, the reduction kernel (SM loads over
//!   P2P, in rank order) for reduce-scatter and reduce. A last barrier ends
//!   each call, so that no rank overwrites a buffer a peer still reads.
//!
//! Before any of that, each call publishes a descriptor (collective,
//! element type, op, count, root; an all-reduce's algorithm) in host memory the processes share
//! (shared host memory) and compares it with every peer's: ranks that make
//! different calls get [`Error::Mismatch`] on every rank, before anything
//! is enqueued; a rank that does not make the call within the barrier
//! timeout is an [`Error::Timeout`] (see [`CommOptions::check_calls`]).
//!
//! Creating a [`Comm`] takes a few steps, each ended by an all-gather of
//! every rank's outcome, so that a failure on one rank fails every rank at
//! once (with the failing rank's error) instead of leaving them waiting:
//!
//! 1. each rank opens its device (rank 0 also makes the call board) and
//!    binds its descriptor socket at a random name; ranks share their host,
//!    device (PCI bus id), and the socket's name with their pid and uid
//!    ([`super::fdpass::PeerAddr`]). Ranks on several hosts, or two ranks
//!    on one device without [`CommOptions::share_devices`], are
//!    [`Error::Unsupported`]; ranks of different uids, or a malformed
//!    info, are [`Error::Bootstrap`]. A [`CommOptions::buffer_bytes`]
//!    whose sizes overflow is [`Error::InvalidArgument`] (on every rank);
//! 2. each rank decides its pair with every peer as a single-process link
//!    does (`copy::decide`): one device shares its memory; between
//!    devices, P2P where the driver reports peer access both ways
//!    (`cuDeviceCanAccessPeer`) and, under [`PathPolicy::Auto`], the
//!    doctor's cached verdict for the pair does not stage it
//!    ([`CommOptions::use_doctor_verdicts`]); where one pair stages (or a
//!    rank asks for it, [`CommOptions::path`]), every rank takes the staged
//!    path, and [`Comm::path_reason`] names the rank and its reason;
//! 3. P2P: each rank allocates and zeroes its region in its device memory,
//!    sends its descriptor to every peer and imports theirs
//!    ([`super::fdpass`]: a descriptor is taken only from a connection
//!    whose credentials are the sending rank's published pid and this uid).
//!    Staged: rank 0 makes one shared host buffer for every rank's region
//!    and sends it; each rank registers it for its device. Rank 0 also
//!    sends the call board. Shared host memory is sealed against resizing
//!    and imported only with those seals and exactly the length this rank
//!    computes for it;
//! 4. unless [`CommOptions::verify`] is off, an all-reduce of random
//!    data on each lane, in several rounds where the lane has them (the SM
//!    stores into the peers' memory and loads of their flags) and an all-gather (copies from the peers' staging
//!    buffers) are checked against a CPU reference on every rank, bounded
//!    by [`CommOptions::timeout`]. Where the check fails on the P2P path
//!    as a broken path fails it (wrong data, or a barrier that timed out),
//!    every rank falls back together under `Auto`: the communicator is
//!    made again on the staged path (steps 1-3) and checked in turn.
//!
//! A peer process that dies is noticed at creation within the timeout. In a
//! collective, with [`CommOptions::check_calls`] (the default), a dead peer
//! never publishes its call: the call fails with [`Error::Timeout`] after
//! the barrier timeout, before anything is enqueued. Without it (or if the
//! peer dies between publishing and launching), the kernels wait for the
//! peer's flags until the barrier timeout, then give up cleanly (no trap:
//! the context stays usable) and the communicator reports
//! [`Error::PeerTimeout`] from then on.
//!
//! A failed communicator (a timeout) refuses every later call: make a new
//! one. A mismatch leaves it usable.
//!
//! A call captured into a CUDA graph on the communicator's stream (the
//! capture begun there, or on another stream that the communicator's joined
//! before the call) makes the graph hold what the call's kernels and copies
//! touch (its memory as mapped here, the peers' included, its counters,
//! control block and kernels: `crate::graph`), so the graph may be replayed
//! after the communicator is dropped, as long as every rank replays it. A
//! replay uses the same slots, counters and staging buffer as the
//! communicator's other calls: launch it in the order of the
//! communicator's stream (on it, or on a stream that waits for it before
//! the launch and that it waits for after); one that overlaps another call
//! can time out at a barrier or give wrong results.

use super::bootstrap::{peer_failed, Bootstrap, Exchange};
use super::fdpass::{send_fd, FdListener, PeerAddr};
use super::shm::{board_bytes, region_len, CallBoard, CallDesc, Kind, RegisteredMemory, SharedMemory};
use super::vmm::DeviceRegion;
use crate::algorithms::oneshot::{check_counts, lane_index, layout, LaneLayout};
use crate::algorithms::prescales;
use crate::copy::decide::{first_step, FirstStep};
use crate::copy::{Path, PathPolicy};
use crate::dtype::{DType, Element, Movable, ReduceOp};
use crate::error::{cudarc_err, Error, Result};
use crate::failure::{Ctl, Fault};
use crate::graph::{capture_of, retain, KeepAlive};
use crate::kernels;
use crate::kernels::launch::{PAIR_BLOCK_WORDS, PAIR_MAX_BLOCKS};
use crate::kernels::load::{function, FnTable, PtrArray};
use crate::kernels::{Kernel, KernelOp};
use crate::sync::{wait_bounded, Orderer};
use crate::traits::Collectives;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

mod api;
mod ops;
mod p2p;

/// The most ranks a [`Comm`] serves (the one-shot kernel's limit).
pub const MAX_RANKS: usize = kernels::MESH_MAX_RANKS;

/// Bytes of the flags of a rank's pair area (`p2p`): for each part of a
/// one-kernel exchange, a word per rank (part `b`'s flag for rank `r` is
/// word `PAIR_BLOCK_WORDS * b + r`).
const PAIR_FLAG_BYTES: usize = 256;
/// Bytes of a rank's pair area: the flags, then a view slot of two words
/// per rank, each part 256-byte aligned.
const PAIR_AREA_BYTES: usize = PAIR_FLAG_BYTES + 256;
/// The most parts of an exchange that runs in one kernel (`p2p`; the
/// kernel takes up to `PAIR_MAX_BLOCKS`): with thread ranks sharing one
/// H200, exchanges of 5 to 8 parts ran slower than the steps on 4 ranks
/// (docs/point-to-point.md).
const FUSED_MOST_PARTS: usize = 4;
/// Words of a rank's meeting counters (in its device memory), laid out as
/// the flags.
const PAIR_COUNTER_WORDS: usize = PAIR_BLOCK_WORDS * PAIR_MAX_BLOCKS;
const _: () = assert!(
    FUSED_MOST_PARTS <= PAIR_MAX_BLOCKS
        && MAX_RANKS <= PAIR_BLOCK_WORDS
        && PAIR_COUNTER_WORDS * 4 <= PAIR_FLAG_BYTES
        && MAX_RANKS * 16 <= PAIR_AREA_BYTES - PAIR_FLAG_BYTES
);

/// The default of [`CommOptions::buffer_bytes`].
pub const DEFAULT_BUFFER_BYTES: usize = 8 << 20;

/// The tag of the call board's descriptor (with its length) among the
/// descriptors rank 0 sends.
const BOARD_TAG: u64 = 1 << 63;
/// The tag of the staged path's shared host buffer (with its length).
const HOST_TAG: u64 = 1 << 62;
/// The page after the call board that holds the communicator's control
/// block (`crate::failure`).
const CTL_PAGE: usize = 4096;

/// The bytes of rank 0's call board for `size` ranks: the board's pages,
/// then the control block's page.
fn board_with_ctl(size: usize) -> Result<usize> {
    region_len(board_bytes(size))
        .filter(|_| crate::failure::ctl_bytes(size) <= CTL_PAGE)
        .and_then(|b| b.checked_add(CTL_PAGE))
        .ok_or_else(|| Error::Internal(format!("a call board for {size} ranks")))
}

/// Settings of a [`Comm`]: `CommOptions::default()`, then the
/// builder-style setters (one per field).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CommOptions {
    /// Bound on each creation step that waits for peers or the device (the
    /// descriptor exchange, the verification).
    pub timeout: Duration,
    /// Check every rank's slots with a small all-reduce at creation (and
    /// the staging buffers with an all-gather), against the CPU: on the
    /// P2P path under [`PathPolicy::Auto`], a check that fails (wrong data,
    /// or a barrier that timed out) makes every rank fall back to the
    /// staged path, checked the same way; otherwise it fails creation.
    pub verify: bool,
    /// Before each collective, publish its descriptor (collective, element
    /// type, op, count, root) in host memory the processes share, wait
    /// until every rank has published its own for the same call (at most
    /// [`Self::barrier_timeout`]) and compare: ranks that disagree get
    /// [`Error::Mismatch`], and one that does not make the call in time an
    /// [`Error::Timeout`] (the communicator then fails), before anything is
    /// enqueued. Costs well under a microsecond when the ranks call
    /// together, but a call's enqueue waits for every rank's (the host of
    /// a rank cannot run more than one call ahead of its peers'). Off, a
    /// mismatch is undefined (wrong results, or a barrier timeout).
    pub check_calls: bool,
    /// Bytes of each rank's staging buffer (in its device memory, mapped by
    /// every peer) for the collectives other than all-reduce: they run in
    /// chunks of half of it (rounded down to 256 bytes). At least 1 KiB
    /// (rounded up to 512 bytes); on the P2P path each rank's region is
    /// rounded up to the device's allocation granularity (2 MiB on current
    /// GPUs) and what that adds goes to the staging buffer too, so chunks
    /// can be larger than asked ([`Comm::chunk_bytes`] says how large); a size whose regions overflow or reach
    /// 2^62 bytes is [`Error::InvalidArgument`] from [`Comm::new`].
    pub buffer_bytes: usize,
    /// Let ranks share a device (more processes than GPUs, as in testing);
    /// [`Comm::from_env`] then takes device `LOCAL_RANK` modulo the
    /// number of devices. Without it two ranks on one device are
    /// [`Error::Unsupported`]. The kernels of ranks on one device do not
    /// run at the same time but take turns (the driver's time slices
    /// between processes), so each barrier can take a time slice: slow,
    /// but every barrier is still bounded by [`Self::barrier_timeout`].
    pub share_devices: bool,
    /// Which path the ranks' data takes: [`PathPolicy::Auto`],
    /// [`PathPolicy::P2pOnly`] or [`PathPolicy::StagedOnly`], decided for
    /// each pair of ranks as a single-process link decides it
    /// (`copy::decide`): ranks on one device share its memory; between
    /// devices, `Auto` takes P2P where the driver reports peer access
    /// both ways and the doctor's cached verdict for the pair does not
    /// stage it ([`Self::use_doctor_verdicts`]), and where the creation's
    /// verification ([`Self::verify`]) then fails on the P2P path, every
    /// rank falls back to the staged path together and verifies that in
    /// turn. `P2pOnly` ignores the doctor's verdicts and makes a pair
    /// without peer access, or a failed check, an error
    /// ([`Error::P2pUnavailable`]). Staged, every rank's slots, flags and
    /// staging buffer live in host memory the processes share (a `memfd`,
    /// page-locked and mapped for each device with `cuMemHostRegister`):
    /// the kernels and copies reach it over PCIe, no P2P needed. One pair
    /// that stages makes every rank stage; [`Comm::path_reason`] says
    /// which and why.
    pub path: PathPolicy,
    /// Under [`PathPolicy::Auto`], follow the verdicts `cuda-peer doctor`
    /// cached for this machine (default on): a pair of devices it found
    /// unusable by P2P, or slower by P2P than staged, stages the
    /// communicator without trying P2P. Off here or with
    /// `CUDA_PEER_NO_DOCTOR_CACHE=1`. See [`crate::verdict`].
    pub use_doctor_verdicts: bool,
    /// How long this rank's kernel waits for its peers at the barrier
    /// before it gives up (a peer that died or stopped calling): the kernel
    /// ends cleanly, the context stays usable, and the communicator reports
    /// [`Error::PeerTimeout`] from then on. See [`crate::failure`].
    pub barrier_timeout: Duration,
    /// How the all-reduce runs (see [`AllReduceAlgorithm`]). Every rank
    /// must pass the same: with [`Self::check_calls`], ranks whose calls
    /// would take different algorithms get [`Error::Mismatch`].
    pub all_reduce: AllReduceAlgorithm,
    /// For tests of the fallback only: a fault (`(rank, fault)`) that
    /// rank's first one-shot launch of the creation's verification takes
    /// on the first path tried.
    #[doc(hidden)]
    pub verify_fault: Option<(usize, Fault)>,
}

/// The all-reduce algorithms of a [`Comm`] ([`CommOptions::all_reduce`]).
/// Both give the same bits: every element is the reduction of the ranks'
/// inputs in rank order (an average: of each input divided by the rank
/// count first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum AllReduceAlgorithm {
    /// The library's choice: today the one-shot at every size. The
    /// two-shot sends less with many ranks, but it has not yet been
    /// measured where that counts (more than two GPUs were never lent);
    /// with ranks sharing one H200 it was faster at some sizes and slower
    /// at others (docs/multiprocess.md). `Auto` will pick it by size once a
    /// machine with 4 or 8 GPUs has measured both.
    #[default]
    Auto,
    /// Always the one-shot: every rank stores its input into every peer's
    /// slots and reduces all of them (one barrier per round; each rank
    /// sends its whole message to each peer).
    OneShot,
    /// Always the two-shot: a reduce-scatter into this rank's part of the
    /// output, then an all-gather of the parts, both through the ranks'
    /// staging buffers ([`CommOptions::buffer_bytes`]). Each rank sends
    /// about twice its message in all, however many ranks, at the cost of
    /// two barriers per chunk.
    TwoShot,
}

impl AllReduceAlgorithm {
    /// Its name: `auto`, `one-shot` or `two-shot` (what [`str::parse`] takes).
    pub fn name(self) -> &'static str {
        match self {
            AllReduceAlgorithm::Auto => "auto",
            AllReduceAlgorithm::OneShot => "one-shot",
            AllReduceAlgorithm::TwoShot => "two-shot",
        }
    }
}

impl std::str::FromStr for AllReduceAlgorithm {
    type Err = Error;
    /// [`AllReduceAlgorithm::name`] back to the variant; anything else is
    /// [`Error::InvalidArgument`].
    fn from_str(s: &str) -> Result<Self> {
        [AllReduceAlgorithm::Auto, AllReduceAlgorithm::OneShot, AllReduceAlgorithm::TwoShot]
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| Error::InvalidArgument(format!("all-reduce algorithm {s:?}: expected auto, one-shot or two-shot")))
    }
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions {
            timeout: Duration::from_secs(60),
            verify: true,
            check_calls: true,
            buffer_bytes: DEFAULT_BUFFER_BYTES,
            share_devices: false,
            path: PathPolicy::Auto,
            barrier_timeout: crate::failure::DEFAULT_BARRIER_TIMEOUT,
            all_reduce: AllReduceAlgorithm::Auto,
            use_doctor_verdicts: true,
            verify_fault: None,
        }
    }
}

impl CommOptions {
    /// Sets [`Self::timeout`].
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets [`Self::verify`].
    pub fn verify(mut self, verify: bool) -> Self {
        self.verify = verify;
        self
    }

    /// Sets [`Self::check_calls`].
    pub fn check_calls(mut self, check_calls: bool) -> Self {
        self.check_calls = check_calls;
        self
    }

    /// Sets [`Self::barrier_timeout`].
    pub fn barrier_timeout(mut self, barrier_timeout: Duration) -> Self {
        self.barrier_timeout = barrier_timeout;
        self
    }

    /// Sets [`Self::buffer_bytes`] (checked by [`Comm::new`]).
    pub fn buffer_bytes(mut self, buffer_bytes: usize) -> Self {
        self.buffer_bytes = buffer_bytes;
        self
    }

    /// Sets [`Self::share_devices`].
    pub fn share_devices(mut self, share_devices: bool) -> Self {
        self.share_devices = share_devices;
        self
    }

    /// Sets [`Self::path`].
    pub fn path(mut self, path: PathPolicy) -> Self {
        self.path = path;
        self
    }

    /// Sets [`Self::all_reduce`].
    pub fn all_reduce(mut self, all_reduce: AllReduceAlgorithm) -> Self {
        self.all_reduce = all_reduce;
        self
    }

    /// Sets [`Self::use_doctor_verdicts`].
    pub fn use_doctor_verdicts(mut self, use_doctor_verdicts: bool) -> Self {
        self.use_doctor_verdicts = use_doctor_verdicts;
        self
    }

    /// Sets `verify_fault` (tests of the fallback only).
    #[doc(hidden)]
    pub fn verify_fault(mut self, verify_fault: Option<(usize, Fault)>) -> Self {
        self.verify_fault = verify_fault;
        self
    }
}

/// One lane of the one-shot, as this rank launches it.
struct Lane {
    layout: LaneLayout,
    /// The peers' regions at this lane, in rank order.
    push: PtrArray,
    /// This rank's own region at this lane.
    pull: u64,
    /// This rank's block counters of this lane.
    counters: u64,
}

/// A communicator of processes: this process's rank, its device and
/// stream, its own slots and its peers' (see the module docs).
pub struct Comm {
    rank: usize,
    size: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    exchange: Arc<dyn Exchange>,
    /// Why the ranks' memory is where it is ([`Comm::path_reason`]).
    path_reason: String,
    lanes: Vec<Lane>,
    npush: i32,
    /// The largest grid of this rank's elementwise kernels.
    max_blocks: u32,
    order: Orderer,
    /// Number of the next call; held for a whole call.
    calls: Mutex<u64>,
    /// The number of the latest collective or point-to-point call this
    /// rank entered (from 1), for failure records.
    call_number: std::sync::atomic::AtomicU32,
    check_calls: bool,
    barrier_timeout: Duration,
    all_reduce: AllReduceAlgorithm,
    /// The per-call descriptors of every rank (host memory shared with the
    /// peers).
    board: CallBoard,
    /// Every rank's staging buffer, as mapped here (this rank's own at
    /// `rank`): two halves of `half` bytes.
    data: Vec<u64>,
    half: usize,
    /// The device barrier's word's address (the word is in `held`).
    bar_ptr: u64,
    /// Every rank's pair area (the flags and views of the point-to-point
    /// meetings: `p2p`), as mapped here.
    pairs: Vec<u64>,
    /// This rank's meeting counters, per part and peer (the words are in
    /// `held`).
    pair_counters: u64,
    /// The most parts (kernel blocks) of one one-kernel exchange (`p2p`):
    /// the same on every rank, so that an exchange's two sides split it
    /// alike, and few enough that every rank's blocks of one launch with
    /// every peer fit a device's multiprocessors at once, a block each,
    /// where ranks share it.
    pair_parts: usize,
    // Dropped after the fields above (the stream is synchronized in Drop).
    /// Whether the slots and staging buffers are in shared host memory.
    staged: bool,
    /// The events of [`Pacer`] (`Pacer::AHEAD + 1`, where another rank is a
    /// thread of this process on this device; none otherwise).
    pace_events: Vec<cudarc::driver::CudaEvent>,
    /// Whether another rank is a thread of this process on this device
    /// (one context: their streams share its hardware queues, so its
    /// copies run on the SMs, `ops::copy`).
    shares_context: bool,
    /// The graph captures this communicator's calls went into (the latest
    /// few), each of which holds `held`.
    captures: Mutex<Vec<u64>>,
    /// What its kernels and copies touch.
    held: Arc<Held>,
}

/// What a communicator's kernels and copies touch: its kernels, control
/// block, barrier word, counters and every rank's memory as mapped here.
/// Shared with each CUDA graph a call was captured into (`crate::graph`),
/// so that a graph replayed after the communicator is dropped still finds
/// them.
struct Held {
    funcs: FnTable,
    div: FnTable,
    /// The reduction kernels (`dst = a op b`) by op and type.
    red: FnTable,
    /// The kernel's control block and this communicator's failed state.
    ctl: Ctl,
    _bar: CudaSlice<u32>,
    _counters: CudaSlice<u32>,
    _pair_counters: CudaSlice<u32>,
    _memory: Memory,
}

/// Where every rank's slots, flags and staging buffer live.
#[derive(Debug)]
enum Memory {
    /// In each rank's device memory, mapped by every peer (P2P): a peer of
    /// another process through its imported descriptor, a peer that is a
    /// thread of this process on this device through the owner's own
    /// mapping ([`owned`]).
    Device { own: Arc<DeviceRegion>, peers: Vec<Arc<DeviceRegion>> },
    /// In one host buffer the processes share, page-locked and mapped for
    /// each rank's device: rank k's region at `k * per_rank` (the staged
    /// path). Registered once per context: ranks that are threads of this
    /// process on one device share one registration
    /// ([`RegisteredMemory::shared_range`]).
    Host { reg: Arc<RegisteredMemory>, per_rank: usize },
}

/// Where a new communicator enqueues its collectives.
enum On {
    /// A new stream on this device.
    Device(usize),
    /// The caller's stream.
    Stream(Arc<CudaStream>),
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm").field("rank", &self.rank).field("size", &self.size).field("device", &self.ctx.ordinal()).finish()
    }
}

/// What each rank tells the others in step 1.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RankInfo {
    host: String,
    bus: String,
    /// Its staging buffer's bytes.
    region: usize,
    /// The device's multiprocessors (every rank's lanes take the fewest).
    sms: u32,
    /// Its stream's handle in its process (ranks of one process must not
    /// share one).
    stream: u64,
    /// Where it receives descriptors, and its pid and uid.
    fd: PeerAddr,
}

/// The longest info a rank may publish.
const MAX_INFO_BYTES: usize = 4096;

/// A decimal number of at most 20 digits, nothing else (no sign, no space).
fn number<T: std::str::FromStr>(s: &str) -> Option<T> {
    if s.is_empty() || s.len() > 20 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

impl RankInfo {
    /// One field a line, the host last (its identity may hold anything).
    fn encode(&self) -> String {
        format!("{}\n{}\n{}\n{}\n{}\n{}\n{}\n{}", self.bus, self.region, self.sms, self.stream, self.fd.name, self.fd.pid, self.fd.uid, self.host)
    }

    /// Rank `rank`'s info, every field present and well formed (else
    /// [`Error::Bootstrap`] naming the field).
    fn decode(rank: usize, s: &str) -> Result<RankInfo> {
        let bad = |what: &str| Error::Bootstrap { op: "communicator: rank info", reason: format!("rank {rank} sent a malformed info ({what})") };
        if s.len() > MAX_INFO_BYTES {
            return Err(bad("too long"));
        }
        let mut it = s.splitn(8, '\n');
        let mut field = |what: &'static str| it.next().ok_or_else(|| bad(what));
        let (bus, region, sms, stream, name, pid, uid, host) = (
            field("bus")?,
            field("staging bytes")?,
            field("multiprocessors")?,
            field("stream")?,
            field("socket")?,
            field("pid")?,
            field("uid")?,
            field("host")?,
        );
        if bus.is_empty() || bus.len() > 64 || !bus.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(bad("bus"));
        }
        let region = number::<usize>(region).filter(|&r| r >= 1024).ok_or_else(|| bad("staging bytes"))?;
        let sms = number::<u32>(sms).filter(|&n| n > 0).ok_or_else(|| bad("multiprocessors"))?;
        let stream = number::<u64>(stream).ok_or_else(|| bad("stream"))?;
        if !PeerAddr::valid_name(name) {
            return Err(bad("socket"));
        }
        let pid = number::<u32>(pid).filter(|&p| p > 0 && p <= i32::MAX as u32).ok_or_else(|| bad("pid"))?;
        let uid = number::<u32>(uid).ok_or_else(|| bad("uid"))?;
        if host.is_empty() {
            return Err(bad("host"));
        }
        Ok(RankInfo { host: host.into(), bus: bus.into(), region, sms, stream, fd: PeerAddr { name: name.into(), pid, uid } })
    }
}

/// Each rank's staging buffer for [`CommOptions::buffer_bytes`]: at least
/// 1 KiB, whole 512 bytes; [`Error::InvalidArgument`] where it would not
/// fit (a region's length travels in a tag below [`HOST_TAG`]).
fn staging_bytes(buffer_bytes: usize) -> Result<usize> {
    buffer_bytes
        .max(1024)
        .checked_next_multiple_of(512)
        .filter(|&b| (b as u64) < HOST_TAG)
        .ok_or_else(|| Error::InvalidArgument(format!("CommOptions::buffer_bytes of {buffer_bytes} bytes is too large")))
}

/// The sizes of step 3.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Sizes {
    /// Each rank's region: its one-shot lanes, then its staging buffer.
    region: usize,
    /// On the staged path, each rank's share of the host buffer (whole pages).
    per_rank: usize,
    /// The staged path's host buffer, for `size` ranks.
    host: usize,
}

/// The sizes of step 3 for `lane_bytes` of one-shot lanes, `staging` bytes
/// of staging buffer and `size` ranks, in checked arithmetic:
/// [`Error::InvalidArgument`] where one would not fit (below [`HOST_TAG`]).
fn sizes(lane_bytes: usize, staging: usize, size: usize) -> Result<Sizes> {
    let too_large = || Error::InvalidArgument(format!("regions of {lane_bytes} + {staging} bytes for {size} ranks are too large"));
    let region = lane_bytes.checked_add(staging).ok_or_else(too_large)?;
    let per_rank = region.checked_next_multiple_of(4096).ok_or_else(too_large)?;
    let host = per_rank.checked_mul(size).filter(|&h| (h as u64) < HOST_TAG).ok_or_else(too_large)?;
    Ok(Sizes { region, per_rank, host })
}

/// All-gathers each rank's outcome of a step (`bootstrap::agree`, the one
/// that every multi-process step uses): `Ok(values)` where every rank
/// succeeded, else the first failing rank's error (this rank's own first).
fn agree(ex: &dyn Exchange, step: &'static str, mine: Result<String>) -> Result<Vec<String>> {
    let all = super::bootstrap::agree(ex, step, mine.map(String::into_bytes))?;
    Ok(all.into_iter().map(|v| String::from_utf8_lossy(&v).into_owned()).collect())
}

/// The checks of step 1 on every rank's info: one host, one device per rank
/// (unless `share_devices`), one stream per rank. Returns the most ranks on
/// one device: the one-shot's grids are divided among them, so that the
/// kernels of every rank on a device can be resident at once (ranks that
/// are threads of one process run at the same time, as do processes under
/// MPS).
fn check_layout(infos: &[RankInfo], share_devices: bool) -> Result<u32> {
    if infos.len() > MAX_RANKS {
        return Err(Error::Unsupported(format!("{} ranks in one communicator (at most {MAX_RANKS})", infos.len())));
    }
    for (r, i) in infos.iter().enumerate() {
        if i.host != infos[0].host {
            return Err(Error::Unsupported(format!(
                "ranks on several hosts (rank 0 on {}, rank {r} on {}): use ipc::nccl::NcclComm between hosts",
                infos[0].host, i.host
            )));
        }
        if let Some(k) = infos[..r].iter().position(|j| j.bus == i.bus).filter(|_| !share_devices) {
            return Err(Error::Unsupported(format!(
                "ranks {k} and {r} are on the same device ({}): the one-shot needs one device per rank (or CommOptions::share_devices)",
                i.bus
            )));
        }
        if let Some(k) = infos[..r].iter().position(|j| j.fd.pid == i.fd.pid && j.bus == i.bus && j.stream == i.stream) {
            return Err(Error::InvalidArgument(format!(
                "ranks {k} and {r} are threads of one process on one stream: each rank needs its own (their kernels wait for each other)"
            )));
        }
    }
    let most = infos.iter().map(|i| infos.iter().filter(|j| j.bus == i.bus).count()).max().unwrap_or(1);
    Ok(most as u32)
}

/// The most parts of a one-kernel exchange of `size` ranks, `sharing` of
/// them at most on one device of at least `sms` multiprocessors (see
/// `Comm::pair_parts`).
fn pair_parts(sms: u32, sharing: u32, size: usize) -> usize {
    let blocks_per_part = sharing as usize * size.saturating_sub(1).max(1);
    (sms as usize / blocks_per_part).clamp(1, FUSED_MOST_PARTS)
}

/// One rank's path for its pair with a peer, before any memory is shared
/// (and, over all its peers, its path with them: step 2 of the creation).
#[derive(Debug, Clone, PartialEq, Eq)]
enum PairPath {
    /// Each other's device memory (one device, or P2P between two), with
    /// the doctor's notes where it has some.
    Device(Option<String>),
    /// Staged, for this reason.
    Staged(String),
}

/// The path of the pair of this rank (`me`: rank, device) and peer `k`
/// (`peer`: rank, its device's ordinal here if visible, its bus id), as a
/// single-process link decides it (`copy::decide::first_step`). `claims`
/// says whether the driver reports peer access both ways to a device
/// (asked only where the policy leaves the answer open), `doctor` what the
/// doctor's cache advises for the pair (consulted only where P2P would be
/// tried under `Auto`).
fn pair_path(
    policy: PathPolicy,
    me: (usize, usize),
    peer: (usize, Option<usize>, &str),
    claims: impl FnOnce(usize) -> Result<bool>,
    doctor: impl FnOnce(usize) -> Option<crate::verdict::Advice>,
) -> Result<PairPath> {
    let ((rank, device), (k, ordinal, bus)) = (me, peer);
    let Some(p) = ordinal else {
        let reason = format!("rank {k}'s device {bus} is not visible to rank {rank} (CUDA_VISIBLE_DEVICES?)");
        return match policy {
            PathPolicy::P2pOnly => Err(Error::P2pUnavailable { from: device, to: usize::MAX, reason }),
            _ => Ok(PairPath::Staged(reason)),
        };
    };
    let claims = p == device || policy == PathPolicy::StagedOnly || claims(p)?;
    match first_step(policy, p == device, claims) {
        FirstStep::Local => Ok(PairPath::Device(None)),
        FirstStep::Staged(reason) => Ok(PairPath::Staged(format!("{reason} between rank {rank} and rank {k}"))),
        FirstStep::Unsupported => Err(Error::P2pUnavailable { from: device, to: p, reason: format!("no P2P from rank {rank} to rank {k}") }),
        FirstStep::TryP2p => match (policy == PathPolicy::Auto).then(|| doctor(p)).flatten() {
            Some(advice) if advice.stage => Ok(PairPath::Staged(advice.reason)),
            advice => Ok(PairPath::Device(advice.map(|a| a.reason))),
        },
    }
}

/// Whether the creation's check failed with `e` as a broken P2P path
/// fails it: wrong data, or a barrier that timed out (not a failed launch,
/// allocation or wait, nor a peer's exit), so that, under
/// [`PathPolicy::Auto`], the ranks fall back to the staged path.
fn path_failure(e: &Error) -> bool {
    matches!(e, Error::P2pUnavailable { .. } | Error::PeerTimeout { .. })
}

/// How the creation's check failed with `e`, for a path's reason: the
/// wrong data, the barrier that timed out, or the error.
fn what_failed(e: &Error) -> String {
    match e {
        Error::P2pUnavailable { reason, .. } => reason.clone(),
        Error::PeerTimeout { rank, after, .. } => format!("rank {rank}'s kernel waited {after:?} at a barrier for its peers"),
        e => e.to_string(),
    }
}

/// The ordinal, in this process, of the device at PCI bus id `bus`.
fn ordinal_of(bus: &str) -> Result<Option<usize>> {
    for d in 0..crate::driver::device_count()? {
        if crate::topology::device_info(d)?.pci_bus_id.eq_ignore_ascii_case(bus) {
            return Ok(Some(d));
        }
    }
    Ok(None)
}

impl Comm {
    /// Reads torchrun's variables ([`Bootstrap::from_env`]), meets the
    /// other ranks and creates the communicator on device `LOCAL_RANK`
    /// (modulo the device count with [`CommOptions::share_devices`]).
    pub fn from_env(opts: &CommOptions) -> Result<Comm> {
        let boot = Bootstrap::from_env()?;
        let device = if opts.share_devices { boot.local_rank % crate::driver::device_count()?.max(1) } else { boot.local_rank };
        let rv = boot.connect()?;
        Comm::new(Box::new(rv), device, opts)
    }

    /// Creates the communicator of the ranks of `exchange`, this one on
    /// device `device`, on a new stream of its own (see the module docs for
    /// the steps). Every rank must call it at the same time.
    pub fn new(exchange: Box<dyn Exchange>, device: usize, opts: &CommOptions) -> Result<Comm> {
        Comm::create(exchange, On::Device(device), opts)
    }

    /// As [`Self::new`], with every collective enqueued on `stream` (the
    /// caller's, as NCCL communicators are used), on its device. Ranks that
    /// are threads of one process must each have their own stream: two
    /// ranks on one stream are [`Error::InvalidArgument`] on every rank.
    pub fn with_stream(exchange: Box<dyn Exchange>, stream: Arc<CudaStream>, opts: &CommOptions) -> Result<Comm> {
        Comm::create(exchange, On::Stream(stream), opts)
    }

    /// Builds the communicator on the path its ranks decide (steps 1-3),
    /// then verifies it (step 4); where the P2P path fails the check under
    /// [`PathPolicy::Auto`] on every rank, builds and verifies it again on
    /// the staged path, every rank together.
    fn create(exchange: Box<dyn Exchange>, on: On, opts: &CommOptions) -> Result<Comm> {
        let exchange: Arc<dyn Exchange> = Arc::from(exchange);
        let comm = Comm::build(exchange.clone(), on, opts)?;
        if !opts.verify {
            return Ok(comm.numbered_from_here());
        }
        if let Some((r, fault)) = opts.verify_fault.filter(|&(r, _)| r == comm.rank) {
            comm.held.ctl.inject(r, fault);
        }
        let checked = comm.verify_agreed(opts.timeout);
        // A fault the check did not take (a two-shot check) is not left armed.
        comm.held.ctl.take_fault(comm.rank);
        let failed = match checked? {
            None => return Ok(comm.numbered_from_here()),
            Some(e) if comm.staged => return Err(e),
            Some(e) => e,
        };
        // The check failed on the P2P path as a broken path fails it, seen
        // alike by every rank: under `Auto` each falls back, and one that
        // may not fails every rank.
        let mine = if opts.path == PathPolicy::Auto { Ok(String::new()) } else { Err(failed.clone()) };
        agree(&*exchange, "communicator: falling back to the staged path", mine)?;
        log::warn!(
            "cuda-peer: communicator rank {}: the P2P path failed the creation's check ({}); using the staged path",
            comm.rank,
            what_failed(&failed)
        );
        let stream = comm.stream.clone();
        // Its drop waits for its kernels, which end at their barriers' timeout.
        drop(comm);
        let mut comm = Comm::build(exchange, On::Stream(stream), &opts.clone().path(PathPolicy::StagedOnly))?;
        if let Some(e) = comm.verify_agreed(opts.timeout)? {
            return Err(match e {
                Error::P2pUnavailable { from, to, reason } => Error::P2pUnavailable {
                    from,
                    to,
                    reason: format!("{reason}, on the staged path, after the P2P path failed the check too ({})", what_failed(&failed)),
                },
                e => e,
            });
        }
        comm.path_reason = format!("staged after the P2P path failed the creation's check: {}", what_failed(&failed));
        Ok(comm.numbered_from_here())
    }

    /// The creation's check on every rank (step 4): `None` where it passed
    /// on every rank; `Some(e)` where it failed on some only as a broken
    /// path fails it ([`path_failure`]: `e` is this rank's own error, or
    /// the first failing rank's as an [`Error::Bootstrap`] naming it); an
    /// error where a rank's failed otherwise.
    fn verify_agreed(&self, timeout: Duration) -> Result<Option<Error>> {
        let mine = self.verify(timeout);
        let word = match &mine {
            Ok(()) => String::new(),
            Err(e) if path_failure(e) => format!("path:{e}"),
            Err(e) => format!("other:{e}"),
        };
        const STEP: &str = "communicator: verification";
        let words = agree(&*self.exchange, STEP, Ok(word))?;
        let Some((k, first)) = words.iter().enumerate().find(|(_, w)| !w.is_empty()) else { return Ok(None) };
        let e = mine.err().unwrap_or_else(|| peer_failed(STEP, k, first.split_once(':').map_or(first.as_str(), |w| w.1)));
        if words.iter().any(|w| w.starts_with("other:")) {
            return Err(e);
        }
        Ok(Some(e))
    }

    /// The caller's first call is call 1 (the creation's are not numbered).
    fn numbered_from_here(self) -> Comm {
        self.call_number.store(0, std::sync::atomic::Ordering::Relaxed);
        self
    }

    /// Steps 1-3 of the creation (see the module docs), and the kernels.
    fn build(exchange: Arc<dyn Exchange>, on: On, opts: &CommOptions) -> Result<Comm> {
        let ex = &*exchange;
        let (rank, size) = (ex.rank(), ex.size());
        if size == 0 || rank >= size {
            return Err(Error::InvalidArgument(format!("rank {rank} of {size}")));
        }

        // Step 1: device, identity, descriptor socket, and (rank 0) the call
        // board.
        let opened = (|| {
            if size > MAX_RANKS {
                return Err(Error::Unsupported(format!("{size} ranks in one communicator (at most {MAX_RANKS})")));
            }
            let staging = staging_bytes(opts.buffer_bytes)?;
            let stream = match on {
                On::Device(device) => crate::driver::context(device)?.new_stream().map_err(cudarc_err("cuStreamCreate"))?,
                On::Stream(stream) => {
                    crate::driver::device(stream.context().ordinal())?;
                    stream
                }
            };
            let ctx = stream.context().clone();
            let device = ctx.ordinal();
            let bus = crate::topology::device_info(device)?.pci_bus_id;
            let sms = crate::driver::multiprocessors(&ctx)?;
            let listener = FdListener::bind(rank)?;
            let info = RankInfo {
                host: super::host::host_identity(),
                bus,
                region: staging,
                sms,
                stream: stream.cu_stream() as usize as u64,
                fd: listener.addr(),
            };
            // Rank 0 makes the call board and sends it to every peer.
            let board = if rank == 0 { Some(SharedMemory::create(board_with_ctl(size)?)?) } else { None };
            Ok((ctx, stream, info, board, listener))
        })();
        let infos = agree(ex, "communicator: opening the devices", opened.as_ref().map(|o| o.2.encode()).map_err(Clone::clone))?;
        let (ctx, stream, own_info, board, listener) = opened?;
        let device = ctx.ordinal();
        let staging = own_info.region;
        let infos: Vec<RankInfo> = infos.iter().enumerate().map(|(r, s)| RankInfo::decode(r, s)).collect::<Result<_>>()?;
        let sharing = check_layout(&infos, opts.share_devices)?;
        // Descriptors pass between the processes of one user only.
        if let Some((r, i)) = infos.iter().enumerate().find(|(_, i)| i.fd.uid != own_info.fd.uid) {
            return Err(Error::Bootstrap {
                op: "communicator: opening the devices",
                reason: format!("rank {r} runs as uid {}, rank {rank} as uid {}: every rank must run as one user", i.fd.uid, own_info.fd.uid),
            });
        }
        let addrs: Vec<PeerAddr> = infos.iter().map(|i| i.fd.clone()).collect();

        // Step 2: each pair's path, decided as a single-process link's
        // (`pair_path`); one pair that stages stages every rank. This
        // rank's path with all its peers: staged for the first pair that
        // stages, else the device path with the doctor's notes of its pairs.
        let decided = (|| {
            let mut notes: Vec<String> = Vec::new();
            for (k, info) in infos.iter().enumerate().filter(|&(k, _)| k != rank) {
                let peer = ordinal_of(&info.bus)?;
                let claims = |p| Ok(crate::peer::can_access_peer(device, p)? && crate::peer::can_access_peer(p, device)?);
                let doctor = |p| crate::verdict::consult(device, p, opts.use_doctor_verdicts);
                match pair_path(opts.path, (rank, device), (k, peer, &info.bus), claims, doctor)? {
                    staged @ PairPath::Staged(_) => return Ok(staged),
                    PairPath::Device(Some(note)) if !notes.contains(&note) => notes.push(note),
                    PairPath::Device(_) => {}
                }
            }
            Ok(PairPath::Device((!notes.is_empty()).then(|| notes.join("; "))))
        })();
        let word = decided.as_ref().map_err(Clone::clone).map(|d| match d {
            PairPath::Staged(why) => format!("staged:{why}"),
            PairPath::Device(_) => "device".to_string(),
        });
        let verdicts = agree(ex, "communicator: checking P2P", word)?;
        let decided = decided?;
        let staged_by = verdicts.iter().enumerate().find_map(|(k, v)| v.strip_prefix("staged:").map(|why| format!("rank {k}: {why}")));
        let staged = staged_by.is_some();
        let crosses = infos.iter().any(|i| i.bus != own_info.bus);
        let path_reason = staged_by.unwrap_or_else(|| {
            let what = if crosses { "P2P" } else { "one device" };
            let checked = if opts.verify { "verified" } else { "not verified" };
            match decided {
                PairPath::Device(Some(notes)) => format!("{what}, {checked}; {notes}"),
                _ => format!("{what}, {checked}"),
            }
        });
        let sms = infos.iter().map(|i| i.sms).min().unwrap_or(1);
        let (lanes, lane_bytes) = layout(size, !staged, (sms / sharing).max(1));
        // The pair area follows the lanes, the staging buffer the pair area.
        let bytes = lane_bytes + PAIR_AREA_BYTES;

        // Step 3: memory, descriptors out, then in, then mapped.
        let imported = (|| {
            let Sizes { region, per_rank, host: host_bytes } = sizes(bytes, staging, size)?;
            let board_len = board_with_ctl(size)?;
            let own = if staged {
                None
            } else {
                let own = Arc::new(DeviceRegion::allocate(&ctx, region)?);
                own.zero(&stream)?;
                owned::hold(&ctx, &own);
                Some((own.export_fd()?, own))
            };
            // Staged: every rank's region in one shared host buffer of rank 0's.
            let host = if staged && rank == 0 { Some(SharedMemory::create(host_bytes)?) } else { None };
            for (k, peer) in addrs.iter().enumerate().filter(|&(k, _)| k != rank) {
                if let Some((fd, own)) = &own {
                    send_fd(peer, rank, fd.as_fd(), own.len() as u64, opts.timeout)?;
                }
                if let Some(b) = &board {
                    send_fd(peer, rank, b.fd(), BOARD_TAG | b.len() as u64, opts.timeout)?;
                }
                if let Some(h) = &host {
                    send_fd(peer, rank, h.fd(), HOST_TAG | h.len() as u64, opts.timeout)?;
                }
                log::debug!("cuda-peer: rank {rank} sent its descriptors to rank {k}");
            }
            let expected = if staged { 0 } else { size - 1 }
                + if rank == 0 {
                    0
                } else if staged {
                    2
                } else {
                    1
                };
            let mut got = listener.receive(&addrs, expected, opts.timeout)?;
            // Rank 0's shared memory, of exactly the length computed here.
            let mut from_rank0 = |tag: u64, len: usize, what: &str| -> Result<SharedMemory> {
                let i = got
                    .iter()
                    .position(|g| g.from == 0 && g.tag & (BOARD_TAG | HOST_TAG) == tag)
                    .ok_or_else(|| Error::Bootstrap { op: "communicator: descriptors", reason: format!("rank 0 sent no {what}") })?;
                let g = got.remove(i);
                let claimed = g.tag & !(BOARD_TAG | HOST_TAG);
                if claimed != len as u64 {
                    return Err(Error::Bootstrap {
                        op: "communicator: descriptors",
                        reason: format!("rank 0's {what} has {claimed} bytes, {len} expected"),
                    });
                }
                SharedMemory::import(g.fd.as_fd(), len)
            };
            let board = match board {
                Some(b) => b,
                None => from_rank0(BOARD_TAG, board_len, "call board")?,
            };
            let memory = if staged {
                let host = match host {
                    Some(h) => h,
                    None => from_rank0(HOST_TAG, host_bytes, "shared host buffer")?,
                };
                let len = host.len();
                Memory::Host { reg: RegisteredMemory::shared_range(&ctx, Arc::new(host), 0, len)?, per_rank }
            } else {
                got.sort_by_key(|g| g.from);
                let mut peers = Vec::with_capacity(size - 1);
                for (i, g) in got.iter().enumerate() {
                    let expected = if i < rank { i } else { i + 1 };
                    if g.from != expected || g.tag & (BOARD_TAG | HOST_TAG) != 0 {
                        return Err(Error::Bootstrap {
                            op: "communicator: descriptors",
                            reason: format!("unexpected descriptor from rank {} (tag {})", g.from, g.tag),
                        });
                    }
                    let claimed = usize::try_from(g.tag).map_err(|_| Error::Bootstrap {
                        op: "communicator: descriptors",
                        reason: format!("rank {} claims a region of {} bytes", g.from, g.tag),
                    })?;
                    peers.push(Arc::new(DeviceRegion::import(&ctx, g.fd.as_fd(), claimed)?));
                }
                let own = own.map(|o| o.1).ok_or_else(|| Error::Internal("no own region".into()))?;
                Memory::Device { peers, own }
            };
            // The control block: the board's last page, mapped for this
            // device, so that every rank's kernels see one abort word.
            let board = Arc::new(board);
            let ctl_page = RegisteredMemory::shared_range(&ctx, board.clone(), board_len - CTL_PAGE, CTL_PAGE)?;
            Ok((memory, CallBoard::new(board, size)?, ctl_page))
        })();
        drop(listener);
        // Each rank's own mapping of its region, for the peers that are
        // threads of this process on this device.
        let own_addr = |m: &Memory| match m {
            Memory::Device { own, .. } => own.device_ptr().to_string(),
            Memory::Host { .. } => String::new(),
        };
        let addrs = agree(ex, "communicator: mapping the peers' memory", imported.as_ref().map(|(m, _, _)| own_addr(m)).map_err(Clone::clone))?;
        let (mut memory, board, ctl_page) = imported?;
        if let Memory::Device { peers, .. } = &mut memory {
            for (k, info) in infos.iter().enumerate().filter(|&(k, i)| k != rank && i.fd.pid == own_info.fd.pid && i.bus == own_info.bus) {
                let slot = if k < rank { k } else { k - 1 };
                let addr = number::<u64>(&addrs[k]);
                peers[slot] = addr.and_then(|a| owned::find(&ctx, a, peers[slot].len())).ok_or_else(|| Error::Bootstrap {
                    op: "communicator: mapping the peers' memory",
                    reason: format!("rank {k} (a thread of this process, on {}) names a region this process does not hold", info.bus),
                })?;
            }
        }
        // Each rank's region, as mapped here, and its length.
        let regions: Vec<(u64, usize)> = match &memory {
            Memory::Host { reg, per_rank } => (0..size).map(|k| (reg.device_ptr() + (k * per_rank) as u64, *per_rank)).collect(),
            Memory::Device { own, peers } => (0..size)
                .map(|k| match k.cmp(&rank) {
                    std::cmp::Ordering::Equal => own,
                    std::cmp::Ordering::Less => &peers[k],
                    std::cmp::Ordering::Greater => &peers[k - 1],
                })
                .map(|r| (r.device_ptr(), r.len()))
                .collect(),
        };
        // Every rank's staging buffer follows its one-shot lanes; its halves
        // are the same size on every rank (the smallest region's).
        let smallest = regions.iter().map(|r| r.1).min().unwrap_or(0);
        let half = (smallest.saturating_sub(bytes) / 2) & !255;
        if half < 256 * size {
            return Err(Error::Internal(format!("a staging buffer of {half} bytes per half")));
        }
        let data: Vec<u64> = regions.iter().map(|r| r.0 + bytes as u64).collect();
        let pairs: Vec<u64> = regions.iter().map(|r| r.0 + lane_bytes as u64).collect();
        let bar = stream.alloc_zeros::<u32>(4).map_err(cudarc_err("cuMemAlloc (barrier word)"))?;
        let bar_ptr = bar.device_ptr(&stream).0;
        let pair_counters = stream.alloc_zeros::<u32>(PAIR_COUNTER_WORDS).map_err(cudarc_err("cuMemAlloc (meeting counters)"))?;
        let pair_counters_ptr = pair_counters.device_ptr(&stream).0;

        // Counters, and the lanes as this rank launches them.
        let counters = stream.alloc_zeros::<u32>(lanes.len() * kernels::ONESHOT_MAX_BLOCKS).map_err(cudarc_err("cuMemAlloc (one-shot counters)"))?;
        stream.synchronize().map_err(cudarc_err("cuStreamSynchronize"))?;
        let counter_base = counters.device_ptr(&stream).0;
        let lanes = lanes
            .into_iter()
            .enumerate()
            .map(|(l, layout)| Lane {
                layout,
                push: PtrArray::from_slice(
                    &regions.iter().enumerate().filter(|&(k, _)| k != rank).map(|(_, r)| r.0 + layout.offset as u64).collect::<Vec<_>>(),
                ),
                pull: regions[rank].0 + layout.offset as u64,
                counters: counter_base + (l * kernels::ONESHOT_MAX_BLOCKS * 4) as u64,
            })
            .collect();
        let threads_here = infos.iter().filter(|i| i.fd.pid == own_info.fd.pid && i.bus == own_info.bus).count();
        let shares_context = threads_here > 1;
        if rank == 0 || shares_context {
            warn_of_shared_queues(threads_here, device);
        }
        if shares_context {
            warn_of_many_streams(&stream, device);
        }
        let pace_events = if shares_context {
            (0..=Pacer::AHEAD)
                .map(|_| ctx.new_event(None))
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(cudarc_err("cuEventCreate (pacing)"))?
        } else {
            Vec::new()
        };
        let comm = Comm {
            rank,
            size,
            ctx,
            stream,
            exchange,
            path_reason,
            lanes,
            npush: size as i32 - 1,
            max_blocks: kernels::launch::max_blocks(own_info.sms),
            order: Orderer::default(),
            calls: Mutex::new(0),
            call_number: std::sync::atomic::AtomicU32::new(0),
            check_calls: opts.check_calls,
            barrier_timeout: opts.barrier_timeout,
            all_reduce: opts.all_reduce,
            board,
            data,
            half,
            bar_ptr,
            pairs,
            pair_counters: pair_counters_ptr,
            pair_parts: pair_parts(sms, sharing, size),
            staged,
            shares_context,
            pace_events,
            captures: Mutex::new(Vec::new()),
            held: Arc::new(Held {
                funcs: FnTable::default(),
                div: FnTable::default(),
                red: FnTable::default(),
                // SAFETY: the board's last page (`CTL_PAGE` >= `ctl_bytes(size)`,
                // checked by `board_with_ctl`), page aligned, zeroed by rank 0
                // at creation, registered for this device at `device_ptr` (once
                // per context), and mapped as long as `ctl_page` (which the `Ctl` keeps); every
                // rank's `Ctl` and kernels access it by whole words.
                ctl: unsafe { Ctl::shared(ctl_page.host_ptr(), ctl_page.device_ptr(), size, opts.barrier_timeout, ctl_page) }?,
                _bar: bar,
                _counters: counters,
                _pair_counters: pair_counters,
                _memory: memory,
            }),
        };
        // Every rank's region is zeroed and mapped everywhere before any
        // kernel. Ranks that are threads of this process on this device
        // share its context, where loading a kernel waits for the kernels
        // running in it: a rank that loaded its first kernel while a peer's
        // waited for it would hold them both until the barrier timeout. So
        // such ranks load every kernel they may launch first.
        let loaded = if shares_context { comm.preload() } else { Ok(()) };
        agree(&*comm.exchange, "communicator: loading the kernels", loaded.map(|()| String::new()))?;
        Ok(comm)
    }

    /// Loads every kernel this communicator may launch, for every op and
    /// element type.
    fn preload(&self) -> Result<()> {
        for dtype in DType::ALL {
            for op in KernelOp::ALL {
                for (table, kernel) in [(&self.held.funcs, Kernel::OneShot(op, dtype)), (&self.held.red, Kernel::Reduce2(op, dtype))] {
                    table.get(kernel, || function(&self.ctx, kernel))?;
                }
            }
            if dtype.is_float() {
                self.held.div.get(Kernel::ScaleDiv(dtype), || function(&self.ctx, Kernel::ScaleDiv(dtype)))?;
            }
        }
        for kernel in [Kernel::PairSync, Kernel::PairXchg, Kernel::Copy] {
            self.held.red.get(kernel, || function(&self.ctx, kernel))?;
        }
        Ok(())
    }

    /// Waits, within `timeout`, for this rank's work enqueued so far (`op`
    /// names it in the error). A kernel that gave up at a barrier leaves
    /// its outputs as they were: that failure is the error, so that the
    /// caller never checks the data it left.
    fn settle(&self, op: &'static str, timeout: Duration) -> Result<()> {
        let done = self.ctx.new_event(None).map_err(cudarc_err("cuEventCreate"))?;
        done.record(&self.stream).map_err(cudarc_err("cuEventRecord"))?;
        wait_bounded(&done, op, timeout)?;
        self.held.ctl.check()
    }

    /// Step 4: an all-reduce of seeded data per lane, checked on the host.
    fn verify(&self, timeout: Duration) -> Result<()> {
        // A size for each lane that takes it, in several rounds where it has them.
        let counts = check_counts(&self.lanes.iter().map(|l| l.layout).collect::<Vec<_>>(), std::mem::size_of::<u32>());
        for (l, count) in counts.into_iter().enumerate() {
            let inputs: Vec<Vec<u32>> = (0..self.size).map(|r| seeded(0x5eed_0000 + l as u64 * 64 + r as u64, count)).collect();
            let expected: Vec<u32> = (0..count).map(|i| inputs.iter().fold(0u32, |a, x| a.wrapping_add(x[i]))).collect();
            let mut buf = self.stream.clone_htod(&inputs[self.rank]).map_err(cudarc_err("cuMemcpyHtoD (verification)"))?;
            self.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
            self.settle("communicator verification (all-reduce)", timeout)?;
            let got = self.stream.clone_dtoh(&buf).map_err(cudarc_err("cuMemcpyDtoH (verification)"))?;
            if let Some(i) = (0..count).find(|&i| got[i] != expected[i]) {
                return Err(Error::P2pUnavailable {
                    from: self.ctx.ordinal(),
                    to: self.ctx.ordinal(),
                    reason: format!("verification all-reduce of {count} u32 (lane {l}) wrong at {i}: {} instead of {}", got[i], expected[i]),
                });
            }
        }
        // The copies from the peers' staging buffers.
        let count = 1000;
        let inputs: Vec<Vec<u32>> = (0..self.size).map(|r| seeded(0x5eed_1000 + r as u64, count)).collect();
        let send = self.stream.clone_htod(&inputs[self.rank]).map_err(cudarc_err("cuMemcpyHtoD (verification)"))?;
        let mut recv = self.stream.alloc_zeros::<u32>(count * self.size).map_err(cudarc_err("cuMemAlloc (verification)"))?;
        self.all_gather(&send, &mut recv)?;
        self.settle("communicator verification (all-gather)", timeout)?;
        let got = self.stream.clone_dtoh(&recv).map_err(cudarc_err("cuMemcpyDtoH (verification)"))?;
        if let Some(i) = (0..count * self.size).find(|&i| got[i] != inputs[i / count][i % count]) {
            return Err(Error::P2pUnavailable {
                from: self.ctx.ordinal(),
                to: self.ctx.ordinal(),
                reason: format!("verification all-gather of {count} u32 per rank wrong at {i}"),
            });
        }
        Ok(())
    }

    /// Why the ranks' memory is where it is ([`Self::path`]): `P2P,
    /// verified` (or `one device`, `not verified`, with the doctor's notes
    /// for this rank's pairs), or which rank staged and why (the policy,
    /// the driver, the doctor's verdict), or the creation's failed check
    /// that made every rank fall back (see [`CommOptions::path`]).
    pub fn path_reason(&self) -> &str {
        &self.path_reason
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many ranks (processes) the communicator has.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The bytes per rank that each chunk of all-gather, broadcast and
    /// reduce moves (half the staging buffer; a reduce-scatter chunk is
    /// this divided among the ranks): larger messages take several chunks.
    pub fn chunk_bytes(&self) -> usize {
        self.half
    }

    /// The path the ranks' data takes: [`Path::P2p`] or [`Path::Staged`]
    /// (see [`CommOptions::path`]).
    pub fn path(&self) -> Path {
        if self.staged {
            Path::Staged
        } else {
            Path::P2p
        }
    }

    /// This rank's device context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream the collectives run on (ordered after and before the
    /// buffers' own streams, as cudarc tracks them).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The exchange the communicator was made with (for the caller's own
    /// all-gathers and barriers; every rank must make the same calls).
    pub fn exchange(&self) -> &dyn Exchange {
        &*self.exchange
    }

    /// Waits for this rank's collectives to finish on the device.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(cudarc_err("cuStreamSynchronize"))?;
        self.order.synchronize()?;
        // A kernel that gave up waiting for a peer since the last call.
        self.held.ctl.check()
    }

    /// The all-reduce on pointers already ordered on this communicator's
    /// stream (`src` and `dst`: `count` elements, the same or disjoint),
    /// for the collectives built on this one ([`super::tiered`]).
    pub(crate) fn all_reduce_ptrs<T: Element>(&self, op: ReduceOp, src: u64, dst: u64, count: usize) -> Result<()> {
        let _call = self.enter(self.all_reduce_desc::<T>(op, count))?;
        if count == 0 {
            return Ok(());
        }
        self.all_reduce_body::<T>(op, src, dst, count)
    }

    /// Takes the call lock and, with [`CommOptions::check_calls`], checks
    /// that every rank makes the same call (see [`CallBoard::agree`]). A
    /// mismatch leaves the communicator usable; a peer that does not make
    /// the call in time fails it.
    fn enter(&self, desc: CallDesc) -> Result<std::sync::MutexGuard<'_, u64>> {
        let mut calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        self.held.ctl.check()?;
        let call = *calls;
        if self.check_calls {
            match self.board.agree(self.rank, call, &desc, self.barrier_timeout) {
                Ok(()) => {}
                Err(e @ Error::Mismatch { .. }) => {
                    // Every rank saw the same descriptors and refuses the
                    // call: they stay in step.
                    *calls += 1;
                    return Err(e);
                }
                Err(e) => {
                    self.held.ctl.fail(e.clone());
                    return Err(e);
                }
            }
        }
        *calls += 1;
        self.number_call();
        Ok(calls)
    }

    /// Numbers a new call (see `call_number`) and returns its number.
    pub(super) fn number_call(&self) -> u32 {
        self.call_number.fetch_add(1, std::sync::atomic::Ordering::Relaxed).wrapping_add(1)
    }

    /// The number of the call being enqueued.
    pub(super) fn current_call(&self) -> u32 {
        self.call_number.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Before each enqueue on the stream: where the stream is capturing
    /// into a graph (the caller's capture, or one it joined through the
    /// ordering of a buffer written on a capturing stream), the graph holds
    /// what this communicator's kernels and copies touch.
    pub(super) fn hold_for_capture(&self) -> Result<()> {
        if let Some((id, graph)) = capture_of(&self.stream)? {
            let mut seen = self.captures.lock().unwrap_or_else(|p| p.into_inner());
            if !seen.contains(&id) {
                retain(graph, KeepAlive { ctx: self.ctx.clone(), payload: self.held.clone() })?;
                if seen.len() >= 16 {
                    seen.remove(0);
                }
                seen.push(id);
            }
        }
        Ok(())
    }

    /// A pacer for a run of synchronisation points (barriers or meetings)
    /// that the peers reach in the same order ([`Pacer`]).
    pub(super) fn pacer(&self) -> Result<Pacer<'_>> {
        let on = !self.pace_events.is_empty() && capture_of(&self.stream)?.is_none();
        Ok(Pacer { comm: self, on, points: 0 })
    }

    /// This rank's one-shot kernel, then the division of [`ReduceOp::Avg`].
    fn launch<T: Element>(&self, op: ReduceOp, input: u64, output: u64, count: usize) -> Result<()> {
        let dtype = T::DTYPE;
        // A float average sums inputs divided first, as every all-reduce does
        // (`crate::algorithms::prescales`).
        let (op, input) = if prescales(op, dtype, self.size) && count > 0 {
            if input != output {
                self.copy(output, input, count * dtype.size())?;
            }
            self.average::<T>(op, output, count)?;
            (ReduceOp::Sum, output)
        } else {
            (op, input)
        };
        let lane = &self.lanes[lane_index(self.lanes.iter().map(|l| l.layout.max_bytes), count * dtype.size(), self.lanes.len())];
        let kernel = Kernel::OneShot(KernelOp::of(op), dtype);
        let f = self.held.funcs.get(kernel, || function(&self.ctx, kernel))?;
        self.hold_for_capture()?;
        match self.held.ctl.take_fault(self.rank) {
            Some(Fault::LaunchFails) => return Err(Error::Internal(format!("injected launch failure on rank {}", self.rank))),
            Some(Fault::NeverArrives) => return Ok(()),
            None => {}
        }
        let args = kernels::launch::OneShot {
            blocks: lane.layout.blocks,
            push: &lane.push,
            npush: self.npush,
            pull: lane.pull,
            input,
            output,
            counters: lane.counters,
            nranks: self.size as i32,
            rank: self.rank as i32,
            count: count as u64,
            cap: lane.layout.cap as u64,
            ahead: lane.layout.pipeline.arg(),
            ctl: self.held.ctl.addrs[0],
            timeout_ns: self.held.ctl.timeout_ns,
            call: self.current_call(),
        };
        // SAFETY: `f` is this rank's one-shot kernel of `dtype`; the control
        // block (`ctl_bytes(size)`, in the board's last page) is mapped for this device.
        // `input`/`output` hold `count` elements of `dtype` on this rank's
        // device (checked by the callers); the lane's push regions (the
        // peers' regions, imported and mapped with read-write access for
        // this device, P2P checked, or a thread rank's on this device
        // through its owner's mapping, held through `owned`; or the shared
        // host buffer, registered for it) and its pull region were sized by one `layout` on every
        // rank and live in `held`, which this communicator and the graphs
        // its calls were captured into keep alive. Every rank runs the
        // lane's grid and `ahead` on each call of the lane (the callers'
        // contract, checked per call with `check_calls`). Ranks on one
        // device divide its multiprocessors among their grids (`layout`),
        // so every rank's blocks can be resident at once; ranks of other
        // processes are also time-sliced by the driver.
        unsafe { kernels::launch::oneshot(&self.stream, f, &args) }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // The peers' regions must outlive this rank's kernels that store into them.
        if let Err(e) = self.stream.synchronize() {
            log::warn!("cuda-peer: communicator rank {}: synchronize on drop failed: {e:?}", self.rank);
        }
    }
}

/// Says, once per process, where `threads` ranks that are threads of this
/// process share device `device` with fewer hardware work queues than
/// their streams may need: their kernels wait for each other on the
/// device, and two ranks' streams in one queue can hold each other up
/// until the barrier timeout (an error, not a hang).
fn warn_of_shared_queues(threads: usize, device: usize) {
    static SAID: std::sync::Once = std::sync::Once::new();
    let queues = hardware_queues();
    if threads > 2 && queues < 32 {
        SAID.call_once(|| {
            log::warn!(
                "cuda-peer: {threads} ranks share device {device} in this process with {queues} hardware work queues: \
                 set CUDA_DEVICE_MAX_CONNECTIONS=32 before CUDA starts (docs/multiprocess.md)"
            )
        });
    }
}

/// The hardware work queues of each context of this process: what
/// `CUDA_DEVICE_MAX_CONNECTIONS` asks for, else the driver's default of 8.
fn hardware_queues() -> usize {
    std::env::var("CUDA_DEVICE_MAX_CONNECTIONS").ok().and_then(|v| v.trim().parse::<usize>().ok()).unwrap_or(8)
}

/// The streams of thread ranks that share a device, by device, as long as
/// each stream lives (a stream of several communicators counts once).
static SHARED_STREAMS: Mutex<Vec<(usize, Weak<CudaStream>)>> = Mutex::new(Vec::new());

/// Says, once per process, where the streams of this process's thread
/// ranks that share `device` are more than its hardware work queues: the
/// queues are shared by every stream of the context, so two ranks of one
/// communicator may land in one queue, whatever the setting, and hold each
/// other up until the barrier timeout (measured: docs/multiprocess.md).
fn warn_of_many_streams(stream: &Arc<CudaStream>, device: usize) {
    static SAID: std::sync::Once = std::sync::Once::new();
    let queues = hardware_queues();
    let mut streams = SHARED_STREAMS.lock().unwrap_or_else(|p| p.into_inner());
    let live = live_streams(&mut streams, device, stream);
    if live > queues {
        SAID.call_once(|| {
            log::warn!(
                "cuda-peer: {live} streams of thread ranks share device {device} in this process, more than its {queues} \
                 hardware work queues: two ranks of one communicator may share a queue and time out at a barrier; put \
                 rank r of every communicator on one stream (docs/multiprocess.md)"
            )
        });
    }
}

/// Adds `stream` on `device` to `entries` (once), drops the entries whose
/// stream is gone, and counts the live ones on `device`.
fn live_streams<S>(entries: &mut Vec<(usize, Weak<S>)>, device: usize, stream: &Arc<S>) -> usize {
    entries.retain(|(_, w)| w.strong_count() > 0);
    if !entries.iter().any(|(d, w)| *d == device && std::ptr::eq(w.as_ptr(), Arc::as_ptr(stream))) {
        entries.push((device, Arc::downgrade(stream)));
    }
    entries.iter().filter(|(d, _)| *d == device).count()
}

/// Where other ranks are threads of this process on this device (one
/// context), keeps a rank at most [`Pacer::AHEAD`] synchronisation points
/// (of one run that its peers reach in the same order: a collective's
/// barriers, an exchange's meetings) ahead of its stream: after each
/// point, an event; past `AHEAD`, a bounded wait for the point `AHEAD`
/// before. The ranks' work waits for each other on the device and the
/// context's command queues are shared and finite: a rank that queued far
/// ahead could fill them, so that a peer's enqueue blocked in the driver
/// and the point the first rank waited for never reached the device (7
/// thread ranks on one H200, about 300 enqueues each: a timeout on every
/// run). A point `AHEAD` back completes once every peer has enqueued it,
/// which a peer waiting at its own later point already has. Off while
/// capturing (nothing runs) and for ranks with a context of their own.
/// The events are the communicator's own, made with it: creating an event
/// in the middle of a call may wait for the context's running kernels,
/// among them a peer's, waiting for this rank's next enqueue.
pub(super) struct Pacer<'a> {
    comm: &'a Comm,
    on: bool,
    points: usize,
}

impl Pacer<'_> {
    const AHEAD: usize = 8;

    /// After a synchronisation point was enqueued.
    pub(super) fn passed(&mut self) -> Result<()> {
        if !self.on {
            return Ok(());
        }
        let c = self.comm;
        let ring = c.pace_events.len();
        c.pace_events[self.points % ring].record(&c.stream).map_err(cudarc_err("cuEventRecord (pacing)"))?;
        if self.points >= Self::AHEAD {
            let before = &c.pace_events[(self.points - Self::AHEAD) % ring];
            wait_bounded(before, "communicator: pacing the enqueues of ranks sharing a context", c.barrier_timeout)?;
        }
        self.points += 1;
        Ok(())
    }
}

/// The device regions of this process's communicators, by context and
/// address: ranks that are threads of one process on one device reach each
/// other's regions through the owner's mapping, found here (and held, so
/// that it outlives the owner as an import would), not through a second,
/// imported mapping of the same memory (accesses to one location through
/// two virtual addresses are outside the guarantees of the GPU's memory
/// model). Only regions this process allocated are found: an address a
/// peer names is never used unless it is one of them, of the length the
/// peer's descriptor claims.
mod owned {
    use crate::ipc::vmm::DeviceRegion;
    use cudarc::driver::CudaContext;
    use std::sync::{Arc, Mutex, Weak};

    type Entry = (usize, u64, Weak<DeviceRegion>);

    static OWNED: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

    /// Records `region`, allocated in `ctx` (dropped entries are pruned).
    pub(super) fn hold(ctx: &CudaContext, region: &Arc<DeviceRegion>) {
        let mut all = OWNED.lock().unwrap_or_else(|p| p.into_inner());
        all.retain(|e| e.2.strong_count() > 0);
        all.push((ctx.cu_ctx() as usize, region.device_ptr(), Arc::downgrade(region)));
    }

    /// The live region at `addr` in `ctx`, if it is `len` bytes long.
    pub(super) fn find(ctx: &CudaContext, addr: u64, len: usize) -> Option<Arc<DeviceRegion>> {
        let all = OWNED.lock().unwrap_or_else(|p| p.into_inner());
        all.iter().filter(|e| e.0 == ctx.cu_ctx() as usize && e.1 == addr).find_map(|e| e.2.upgrade()).filter(|r| r.len() == len)
    }
}

/// The descriptor of a call on elements of `T`.
fn desc<T: Movable>(kind: Kind, op: Option<ReduceOp>, count: usize, root: Option<usize>) -> CallDesc {
    CallDesc {
        kind,
        dtype: crate::dtype::movable_index::<T>(),
        op: op.and_then(|o| ReduceOp::ALL.iter().position(|x| *x == o)).unwrap_or(255) as u8,
        root: root.map(|r| r.min(u32::MAX as usize - 1) as u32).unwrap_or(u32::MAX),
        count: count as u64,
        extra: 0,
    }
}

/// `count` pseudo-random words from `seed` (splitmix64): the same on every
/// rank, so each can compute every rank's input.
pub fn seeded(seed: u64, count: usize) -> Vec<u32> {
    let mut x = seed;
    (0..count)
        .map(|_| {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            (z ^ (z >> 31)) as u32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(host: &str, bus: &str) -> RankInfo {
        let fd = PeerAddr { name: format!("cuda-peer/{}", "0123456789abcdef".repeat(2)), pid: 4242, uid: 1000 };
        RankInfo { host: host.into(), bus: bus.into(), region: 2 << 20, sms: 132, stream: 0x5000 + bus.len() as u64, fd }
    }

    fn malformed(r: Result<RankInfo>) -> bool {
        matches!(r, Err(Error::Bootstrap { .. }))
    }

    /// `pair_path` for rank 0 on device 0 and rank 1 on `peer`, the driver
    /// claiming P2P as `claims` says and the doctor advising `doctor`;
    /// either panics where it is asked but must not be.
    fn pair(policy: PathPolicy, peer: Option<usize>, claims: Option<bool>, doctor: Option<Option<(bool, &str)>>) -> Result<PairPath> {
        let claims = |_| claims.map(Ok).expect("the driver was asked");
        let doctor = |_| doctor.expect("the doctor was asked").map(|(stage, r)| crate::verdict::Advice { stage, reason: r.into() });
        pair_path(policy, (0, 0), (1, peer, "0000:3b:00.0"), claims, doctor)
    }

    #[test]
    fn pair_paths_follow_the_policy_the_driver_and_the_doctor() {
        use PathPolicy::*;
        let staged = |r: Result<PairPath>| match r {
            Ok(PairPath::Staged(why)) => why,
            other => panic!("expected staged, got {other:?}"),
        };
        let refused = |r: Result<PairPath>| matches!(r, Err(Error::P2pUnavailable { from: 0, .. }));
        // StagedOnly stages ranks on one device too, asking no one.
        assert_eq!(staged(pair(StagedOnly, Some(0), None, None)), "staged by policy between rank 0 and rank 1");
        assert_eq!(staged(pair(StagedOnly, Some(1), None, None)), "staged by policy between rank 0 and rank 1");
        assert!(staged(pair(StagedOnly, None, None, None)).contains("not visible"));
        // One device: its memory, asking neither the driver nor the doctor.
        for policy in [Auto, P2pOnly] {
            assert_eq!(pair(policy, Some(0), None, None).unwrap(), PairPath::Device(None), "{policy:?}");
        }
        // A device this process cannot see.
        assert!(staged(pair(Auto, None, None, None)).contains("rank 1's device 0000:3b:00.0 is not visible to rank 0"));
        assert!(refused(pair(P2pOnly, None, None, None)));
        // No peer access: staged under Auto, refused under P2pOnly; no doctor.
        assert_eq!(staged(pair(Auto, Some(1), Some(false), None)), "driver reports no peer access between rank 0 and rank 1");
        assert!(matches!(pair(P2pOnly, Some(1), Some(false), None), Err(Error::P2pUnavailable { from: 0, to: 1, .. })));
        // Peer access claimed: the doctor decides under Auto only.
        assert_eq!(staged(pair(Auto, Some(1), Some(true), Some(Some((true, "doctor verdict: broken"))))), "doctor verdict: broken");
        assert_eq!(
            pair(Auto, Some(1), Some(true), Some(Some((false, "doctor verdict: p2p")))).unwrap(),
            PairPath::Device(Some("doctor verdict: p2p".into()))
        );
        assert_eq!(pair(Auto, Some(1), Some(true), Some(None)).unwrap(), PairPath::Device(None));
        assert_eq!(pair(P2pOnly, Some(1), Some(true), None).unwrap(), PairPath::Device(None));
        // The driver's error is the error.
        let failing = pair_path(Auto, (0, 0), (1, Some(1), "b"), |_| Err(Error::Internal("no driver".into())), |_| None);
        assert!(matches!(failing, Err(Error::Internal(_))));
    }

    #[test]
    fn a_failed_check_reads_as_what_failed() {
        let wrong = Error::P2pUnavailable { from: 0, to: 0, reason: "verification all-gather of 1000 u32 per rank wrong at 7".into() };
        assert_eq!(what_failed(&wrong), "verification all-gather of 1000 u32 per rank wrong at 7");
        let timed_out = Error::PeerTimeout { rank: 1, call: 1, after: Duration::from_secs(2) };
        assert_eq!(what_failed(&timed_out), "rank 1's kernel waited 2s at a barrier for its peers");
        let other = Error::Bootstrap { op: "communicator: verification", reason: "rank 1 failed: x".into() };
        assert_eq!(what_failed(&other), other.to_string());
    }

    #[test]
    fn only_wrong_data_or_a_barrier_timeout_is_a_path_failure() {
        let wrong = Error::P2pUnavailable { from: 0, to: 0, reason: "verification all-reduce wrong at 0".into() };
        let timed_out = Error::PeerTimeout { rank: 1, call: 1, after: Duration::from_secs(1) };
        let others = [
            Error::Internal("injected launch failure".into()),
            Error::Timeout { op: "verification", after: Duration::from_secs(1) },
            Error::Bootstrap { op: "communicator: verification", reason: "rank 1 failed: lost".into() },
        ];
        assert!(path_failure(&wrong) && path_failure(&timed_out));
        assert!(others.iter().all(|e| !path_failure(e)));
    }

    #[test]
    fn shared_streams_count_each_live_stream_once_per_device() {
        let mut entries = Vec::new();
        let (a, b, c) = (Arc::new(1u8), Arc::new(2u8), Arc::new(3u8));
        assert_eq!(live_streams(&mut entries, 0, &a), 1);
        // The same stream of a second communicator counts once.
        assert_eq!(live_streams(&mut entries, 0, &a), 1);
        assert_eq!(live_streams(&mut entries, 0, &b), 2);
        // Another device's streams are counted apart.
        assert_eq!(live_streams(&mut entries, 1, &c), 1);
        drop(b);
        assert_eq!(live_streams(&mut entries, 0, &a), 1);
        assert_eq!(entries.len(), 2);
    }

    #[test]
    fn all_reduce_algorithm_names_round_trip() {
        for a in [AllReduceAlgorithm::Auto, AllReduceAlgorithm::OneShot, AllReduceAlgorithm::TwoShot] {
            assert_eq!(a.name().parse::<AllReduceAlgorithm>().unwrap(), a);
        }
        assert!(matches!("ring".parse::<AllReduceAlgorithm>(), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn rank_info_round_trips_and_a_host_may_hold_newlines() {
        let i = info("node/1234", "0000:19:00.0");
        assert_eq!(RankInfo::decode(0, &i.encode()), Ok(i));
        let odd = info("a\nhost\nid", "0000:19:00.0");
        assert_eq!(RankInfo::decode(0, &odd.encode()), Ok(odd));
    }

    #[test]
    fn malformed_rank_infos_are_typed_errors() {
        let good = info("node", "0000:19:00.0").encode();
        let lines: Vec<&str> = good.split('\n').collect();
        let with = |i: usize, v: &str| {
            let mut l = lines.clone();
            l[i] = v;
            l.join("\n")
        };
        assert!(malformed(RankInfo::decode(0, "x\ny")));
        assert!(malformed(RankInfo::decode(0, "")));
        for (field, bad) in [
            (0, ""),
            (0, "bus with spaces"),
            (1, "+2097152"),
            (1, "100"),
            (1, "99999999999999999999999"),
            (2, "0"),
            (2, "-1"),
            (3, "-1"),
            (3, "0x10"),
            (4, "cuda-peer/job/0"),
            (4, "/tmp/socket"),
            (5, "0"),
            (5, "4294967295"),
            (6, "x"),
            (7, ""),
        ] {
            assert!(malformed(RankInfo::decode(3, &with(field, bad))), "field {field} = {bad:?}");
        }
        assert!(malformed(RankInfo::decode(0, &"9".repeat(MAX_INFO_BYTES + 1))));
        match RankInfo::decode(5, &with(5, "0")) {
            Err(Error::Bootstrap { reason, .. }) => assert!(reason.contains("rank 5") && reason.contains("pid"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// Any text decodes to an info or a typed error, never a panic; an
        /// info re-encodes to the same text.
        #[test]
        fn rank_info_decoding_never_panics(text in "[0-9a-z:./\n -]{0,120}") {
            if let Ok(i) = RankInfo::decode(0, &text) {
                proptest::prop_assert_eq!(i.encode(), text);
            }
        }

        /// Infos of any field values: accepted exactly when every field is
        /// in range, and then unchanged.
        #[test]
        fn rank_infos_of_any_values_decode_only_when_valid(region in proptest::prelude::any::<usize>(), sms in proptest::prelude::any::<u32>(),
                                                           pid in proptest::prelude::any::<u32>(), uid in proptest::prelude::any::<u32>()) {
            let mut i = info("node", "0000:19:00.0");
            (i.region, i.sms, i.fd.pid, i.fd.uid) = (region, sms, pid, uid);
            let valid = region >= 1024 && sms > 0 && pid > 0 && pid <= i32::MAX as u32;
            match RankInfo::decode(0, &i.encode()) {
                Ok(d) => proptest::prop_assert!(valid && d == i),
                Err(e) => {
                    let typed = matches!(e, Error::Bootstrap { .. });
                    proptest::prop_assert!(!valid && typed, "{:?}", e);
                }
            }
        }
    }

    #[test]
    fn huge_buffer_bytes_are_invalid_arguments_not_overflows() {
        assert_eq!(staging_bytes(0).unwrap(), 1024);
        assert_eq!(staging_bytes(1025).unwrap(), 1536);
        assert_eq!(staging_bytes(DEFAULT_BUFFER_BYTES).unwrap(), DEFAULT_BUFFER_BYTES);
        for huge in [usize::MAX, usize::MAX - 511, 1 << 62] {
            assert!(matches!(staging_bytes(huge), Err(Error::InvalidArgument(_))), "{huge}");
        }
        let opts = CommOptions::default().buffer_bytes(usize::MAX);
        assert!(matches!(staging_bytes(opts.buffer_bytes), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn region_sizes_are_checked() {
        assert_eq!(sizes(4096, 1024, 4).unwrap(), Sizes { region: 5120, per_rank: 8192, host: 4 * 8192 });
        assert_eq!(sizes(0, 4096, 8).unwrap(), Sizes { region: 4096, per_rank: 4096, host: 8 * 4096 });
        assert!(matches!(sizes(usize::MAX, 1024, 2), Err(Error::InvalidArgument(_))));
        assert!(matches!(sizes(usize::MAX - 2000, 1024, 2), Err(Error::InvalidArgument(_))));
        assert!(matches!(sizes(1 << 60, 1 << 60, 8), Err(Error::InvalidArgument(_))));
        assert!(matches!(sizes(1 << 61, 0, 2), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn layouts_with_shared_devices_or_hosts_are_refused() {
        assert_eq!(check_layout(&[info("a", "0"), info("a", "1"), info("a", "2")], false), Ok(1));
        assert!(matches!(check_layout(&[info("a", "0"), info("a", "0")], false), Err(Error::Unsupported(m)) if m.contains("same device")));
        // Ranks of other processes may share a device and a stream handle.
        let mut other = info("a", "0");
        other.fd.pid += 1;
        assert_eq!(check_layout(&[info("a", "0"), info("a", "1"), other], true), Ok(2));
        // Threads of one process on one device need a stream each.
        assert!(matches!(check_layout(&[info("a", "0"), info("a", "0")], true), Err(Error::InvalidArgument(m)) if m.contains("one stream")));
        let mut own = info("a", "0");
        own.stream += 1;
        assert_eq!(
            check_layout(
                &[info("a", "0"), own.clone(), {
                    own.stream += 1;
                    own
                }],
                true
            ),
            Ok(3)
        );
        assert!(matches!(check_layout(&[info("a", "0"), info("b", "1")], true), Err(Error::Unsupported(m)) if m.contains("several hosts")));
        let nine: Vec<_> = (0..9).map(|d| info("a", &d.to_string())).collect();
        assert!(matches!(check_layout(&nine, false), Err(Error::Unsupported(_))));
    }

    #[test]
    fn one_kernel_exchanges_of_ranks_sharing_a_device_take_fewer_parts() {
        let most = FUSED_MOST_PARTS;
        assert_eq!(pair_parts(132, 1, 2), most);
        assert_eq!(pair_parts(132, 1, 8), most);
        assert_eq!(pair_parts(132, 2, 2), most);
        assert_eq!(pair_parts(132, 4, 8), most.min(132 / 28));
        assert_eq!(pair_parts(132, 8, 8), 2);
        assert_eq!(pair_parts(10, 8, 8), 1);
        assert_eq!(pair_parts(0, 1, 1), 1);
        for (sms, sharing, size) in [(132, 8, 8), (132, 4, 8), (80, 3, 3), (16, 2, 8)] {
            let parts = pair_parts(sms, sharing, size);
            assert!(parts == 1 || sharing as usize * (size - 1) * parts <= sms as usize, "{sms} {sharing} {size}: {parts}");
        }
    }

    #[test]
    fn seeded_data_is_reproducible() {
        assert_eq!(seeded(7, 100), seeded(7, 100));
        assert_ne!(seeded(7, 100), seeded(8, 100));
    }

    /// Every rank learns of one rank's failure in a step.
    #[test]
    fn one_ranks_failure_fails_every_rank() {
        use super::super::bootstrap::Bootstrap;
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let n = 3;
        let handles: Vec<_> = (0..n)
            .map(|r| {
                std::thread::spawn(move || {
                    let rv = Bootstrap::new(r, n, r, n, "127.0.0.1", port).unwrap().with_timeout(Duration::from_secs(20)).connect().unwrap();
                    let ok = agree(&rv, "step", Ok(format!("v{r}"))).unwrap();
                    let mine = if r == 1 { Err(Error::NoDevice) } else { Ok(String::new()) };
                    (ok, agree(&rv, "step", mine))
                })
            })
            .collect();
        for h in handles {
            let (ok, failed) = h.join().unwrap();
            assert_eq!(ok, vec!["v0", "v1", "v2"]);
            match failed {
                Err(Error::NoDevice) => {}
                Err(Error::Bootstrap { reason, .. }) => {
                    assert!(reason.contains("rank 1 failed"), "{reason}")
                }
                other => panic!("{other:?}"),
            }
        }
    }

    /// Without a driver, creation fails on every rank with the same kind of
    /// error, in bounded time, instead of leaving the others waiting.
    #[test]
    fn without_a_gpu_creation_fails_on_every_rank() {
        if crate::driver::device_count().map(|n| n >= 2).unwrap_or(false) {
            return; // a GPU machine: the GPU tests cover creation
        }
        use super::super::bootstrap::Bootstrap;
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let handles: Vec<_> = (0..2)
            .map(|r| {
                std::thread::spawn(move || {
                    let rv = Bootstrap::new(r, 2, r, 2, "127.0.0.1", port).unwrap().with_timeout(Duration::from_secs(20)).connect().unwrap();
                    Comm::new(Box::new(rv), r, &CommOptions { timeout: Duration::from_secs(5), ..Default::default() }).map(|_| ())
                })
            })
            .collect();
        for h in handles {
            assert!(h.join().unwrap().is_err());
        }
    }
}
