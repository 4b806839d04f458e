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
//!    (`cuDeviceCanAccessPeer`) and, under [`PathPolicy::Auto`](crate::copy::PathPolicy::Auto), the
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
//!    computes for it; a peer's device region only at the length the peer
//!    publishes to every rank;
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
//! communicator's other calls, so each rank's calls and replays are put in
//! one order, the order the host issued them, through an event the graph
//! waits for and records too (`calls`): a replay may be launched on any
//! stream of this rank's context, and runs after the calls and replays
//! issued before its launch and before those issued after it; only the
//! first launch of the communicator's first graph must come after the
//! calls made before its capture in your stream order (eager calls record
//! their place only once a call has been captured: `crate::graph::CallOrder`).
//! (With thread ranks sharing one device, launch replays on the
//! communicator's stream: see docs/multiprocess.md, "Ranks sharing a
//! device".)

use super::bootstrap::{Bootstrap, Exchange};
use super::shm::{CallBoard, CallDesc, Kind, RegisteredMemory};
use super::vmm::DeviceRegion;
use crate::algorithms::oneshot::{lane_index, LaneLayout};
use crate::algorithms::prescales;
use crate::copy::Path;
use crate::dtype::{Element, Movable, ReduceOp};
use crate::error::{cudarc_err, Error, Result};
use crate::failure::{Ctl, Fault};
use crate::graph::{CallOrder, Captures, KeepAlive};
use crate::kernels;
use crate::kernels::launch::{PAIR_BLOCK_WORDS, PAIR_MAX_BLOCKS};
use crate::kernels::load::{function, FnTable, PtrArray};
use crate::kernels::{Kernel, KernelOp};
use crate::sync::Orderer;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod api;
mod calls;
mod create;
mod ops;
mod options;
mod p2p;
mod pace;

pub use options::{AllReduceAlgorithm, CommOptions, DEFAULT_BUFFER_BYTES};

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
    captures: Captures,
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
    /// This rank's calls and replays in one order (`calls`): graphs wait
    /// for its event and record it too.
    order: CallOrder,
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

    /// Before each enqueue on the stream: where the stream is capturing
    /// into a graph (the caller's capture, or one it joined through the
    /// ordering of a buffer written on a capturing stream), the graph holds
    /// what this communicator's kernels and copies touch; and the call is
    /// put in order with this rank's other calls and replays (`calls`).
    pub(super) fn hold_for_capture(&self) -> Result<()> {
        let capturing = self.captures.hold(&self.stream, || KeepAlive { ctx: self.ctx.clone(), payload: self.held.clone() })?;
        self.held.order.begin(&self.stream, capturing)
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

    #[test]
    fn seeded_data_is_reproducible() {
        assert_eq!(seeded(7, 100), seeded(7, 100));
        assert_ne!(seeded(7, 100), seeded(8, 100));
    }
}
