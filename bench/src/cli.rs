//! The command line: each mode's options, the settings the modes share,
//! and the names of the implementations. Nothing here runs anything.

use crate::exit::unusable;
use crate::kinds::{Dt, Op};
use crate::units::GIB;
use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

/// The whole command line: the sweep's options, or a subcommand.
#[derive(Parser, Debug)]
#[command(name = "cuda-peer-bench", args_conflicts_with_subcommands = true)]
#[command(about = "cuda-peer collectives and copies against NCCL, nccl-tests style, checked")]
pub(crate) struct Cli {
    /// A mode other than the sweep.
    #[command(subcommand)]
    pub(crate) command: Option<Command>,
    /// The sweep's options (when no subcommand is given).
    #[command(flatten)]
    pub(crate) sweep: Args,
}

/// The modes besides the sweep.
#[derive(Subcommand, Debug)]
pub(crate) enum Command {
    /// Host cost of each driver call on a small collective's enqueue path (first two GPUs).
    EnqueueCosts(EnqueueArgs),
    /// All-reduce between processes, one GPU each, against NCCL with one rank per process;
    /// run under `cuda-peer-run -n N --` (or torchrun).
    MpAllreduce(MpArgs),
    /// Point-to-point calls against NCCL, nccl-tests style (sendrecv_perf,
    /// alltoall_perf): one thread per rank over every GPU, or `--ranks N`
    /// ranks sharing the GPUs round-robin.
    P2p(P2pArgs),
}

/// The options of `enqueue-costs`.
#[derive(clap::Args, Debug)]
pub(crate) struct EnqueueArgs {
    /// Calls per measurement (in batches of 100, drained between batches).
    #[arg(long, default_value_t = 5000)]
    pub(crate) calls: usize,
}

#[derive(Parser, Debug, Clone)]
#[command(about = "cuda-peer collectives and copies against NCCL, nccl-tests style, checked")]
pub(crate) struct Args {
    /// Collectives to run.
    #[arg(long, value_delimiter = ',', default_value = "all_reduce,reduce_scatter,all_gather,broadcast")]
    pub(crate) ops: Vec<Op>,
    /// Element types.
    #[arg(long, value_delimiter = ',', default_value = "f32,bf16")]
    pub(crate) dtypes: Vec<Dt>,
    /// Smallest size in bytes (see the nccl-tests conventions in the docs).
    #[arg(long, default_value_t = 4)]
    pub(crate) min_bytes: usize,
    /// Largest size in bytes.
    #[arg(long, default_value_t = GIB)]
    pub(crate) max_bytes: usize,
    /// Implementations, in the order run.
    #[arg(long, value_delimiter = ',', default_value = "cuda-peer-p2p,cuda-peer-staged,nccl,nccl-no-p2p")]
    pub(crate) impls: Vec<Impl>,
    /// Timed calls per point (default: 2 GiB / bytes, clamped to 5..=200).
    #[arg(long)]
    pub(crate) iters: Option<usize>,
    /// Warm-up calls per point (fewer for large sizes: at most 1 GiB of warm-up, at least 1 call).
    #[arg(long, default_value_t = 5)]
    pub(crate) warmup: usize,
    /// Machine name, used in the CSV file names.
    #[arg(long, default_value = "local")]
    pub(crate) machine: String,
    /// Directory for the CSVs.
    #[arg(long, default_value = "bench/results")]
    pub(crate) out: PathBuf,
    /// Also measure copies between every pair of GPUs (first, before any peer access).
    #[arg(long)]
    pub(crate) copy: bool,
    /// all_reduce only, sizes quadrupling (keeps --dtypes, --min-bytes, --max-bytes).
    #[arg(long)]
    pub(crate) quick: bool,
    /// Time calls replayed from CUDA graphs, as a framework that captures its
    /// step does: per point, one graph of up to GRAPH_CALLS calls (every rank's
    /// stream joined into one capture), launched until --iters calls have run;
    /// #wrong also covers a one-call graph replayed on fresh inputs. Turns off
    /// cudarc's event tracking (a capture may not wait for outside events).
    #[arg(long)]
    pub(crate) graph: bool,
    /// NCCL library to use when `libnccl.so` is not on the loader path (e.g. /usr/lib/x86_64-linux-gnu/libnccl.so.2).
    #[arg(long)]
    pub(crate) nccl_lib: Option<PathBuf>,
    /// Internal: run as the NCCL child and write the enqueue time here.
    #[arg(long, hide = true)]
    pub(crate) child_report: Option<PathBuf>,
    /// Internal: points done before this process (progress lines).
    #[arg(long, hide = true, default_value_t = 0)]
    pub(crate) progress_offset: usize,
    /// Internal: points in the whole run (progress lines).
    #[arg(long, hide = true)]
    pub(crate) progress_total: Option<usize>,
}

/// The options of `mp-allreduce`.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct MpArgs {
    /// Implementations, in the order run.
    #[arg(long, value_delimiter = ',', default_value = "cuda-peer-ipc,nccl-mp,cuda-peer-nccl,cuda-peer-ipc-staged,nccl-mp-no-p2p")]
    pub(crate) impls: Vec<MpImpl>,
    /// Element types.
    #[arg(long, value_delimiter = ',', default_value = "f32,bf16")]
    pub(crate) dtypes: Vec<Dt>,
    /// Smallest size in bytes (the buffer on each rank).
    #[arg(long, default_value_t = 4)]
    pub(crate) min_bytes: usize,
    /// Largest size in bytes.
    #[arg(long, default_value_t = GIB)]
    pub(crate) max_bytes: usize,
    /// Timed calls per point (default: 2 GiB / bytes, clamped to 5..=200).
    #[arg(long)]
    pub(crate) iters: Option<usize>,
    /// Warm-up calls per point (fewer for large sizes: at most 1 GiB of warm-up, at least 1 call).
    #[arg(long, default_value_t = 5)]
    pub(crate) warmup: usize,
    /// Sizes quadrupling instead of doubling.
    #[arg(long)]
    pub(crate) quick: bool,
    /// Machine name, used in the CSV file name.
    #[arg(long, default_value = "local")]
    pub(crate) machine: String,
    /// Directory for the CSV (rank 0 writes it).
    #[arg(long, default_value = "bench/results")]
    pub(crate) out: PathBuf,
    /// NCCL library to use when `libnccl.so` is not on the loader path (e.g. /usr/lib/x86_64-linux-gnu/libnccl.so.2).
    #[arg(long)]
    pub(crate) nccl_lib: Option<PathBuf>,
    /// Host-cost probe: cuda-peer's communicators without the per-call
    /// check that every rank makes the same call (`CommOptions::check_calls`).
    #[arg(long)]
    pub(crate) no_check_calls: bool,
    /// Host-cost probe: cudarc's event tracking off for the buffers
    /// cuda-peer's communicators reduce (each buffer is used on the
    /// communicator's stream only), so no event waits or records per call.
    #[arg(long)]
    pub(crate) no_event_tracking: bool,
    /// Internal: run as this rank's NCCL child for this impl.
    #[arg(long, hide = true)]
    pub(crate) child: Option<MpImpl>,
    /// Internal: points done before this process (progress lines).
    #[arg(long, hide = true, default_value_t = 0)]
    pub(crate) progress_offset: usize,
    /// Internal: points in the whole run (progress lines).
    #[arg(long, hide = true)]
    pub(crate) progress_total: Option<usize>,
}

/// The options of `p2p`.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct P2pArgs {
    /// Calls to run: `sendrecv` (every rank to rank+1, from rank-1, in one
    /// group), `alltoall` (equal blocks) and `allreduce` (a sum, out of
    /// place: the per-rank engine's all-reduce, against NCCL's).
    #[arg(long, value_delimiter = ',', default_value = "sendrecv,alltoall")]
    pub(crate) ops: Vec<P2pOp>,
    /// cuda-peer's all-reduce algorithm (`CommOptions::all_reduce`): `auto`,
    /// `one-shot` or `two-shot` (the CSV names the forced ones).
    #[arg(long, default_value = "auto", value_parser = |s: &str| s.parse::<cuda_peer::AllReduceAlgorithm>())]
    pub(crate) all_reduce: cuda_peer::AllReduceAlgorithm,
    /// How ranks reach each other: `auto`, `p2p` or `staged` (through host
    /// memory), for cuda-peer (`CommOptions::path`, and the group's
    /// `GroupOptions::with_policy`); `staged` runs NCCL with
    /// `NCCL_P2P_DISABLE=1` (its rows then `nccl-no-p2p`).
    #[arg(long, default_value = "auto", value_parser = |s: &str| s.parse::<cuda_peer::copy::PathPolicy>())]
    pub(crate) path: cuda_peer::copy::PathPolicy,
    /// Also run the single-process `Group`'s all-reduce (`allreduce` only,
    /// one thread enqueueing every rank's call; rows `cuda-peer-group`) on
    /// the same ranks, and print cuda-peer's ratios to it.
    #[arg(long)]
    pub(crate) group: bool,
    /// Then capture one all-reduce of every communicator (and of the
    /// group) into a CUDA graph, drop the graph, and run every cuda-peer
    /// point again (rows named `...-after-capture`), with the ratios to the
    /// first rows: once a call has been captured, each eager call takes its
    /// place in the order of the rank's calls and replays (an event wait
    /// and record on each rank's stream).
    #[arg(long)]
    pub(crate) after_capture: bool,
    /// Element types.
    #[arg(long, value_delimiter = ',', default_value = "f32,bf16")]
    pub(crate) dtypes: Vec<Dt>,
    /// Ranks (default: every GPU, at least 2); more than the GPUs share
    /// them round-robin, each rank on its own stream (NCCL is then skipped).
    #[arg(long)]
    pub(crate) ranks: Option<usize>,
    /// Smallest size in bytes (the per-rank buffer, see the docs).
    #[arg(long, default_value_t = 4)]
    pub(crate) min_bytes: usize,
    /// Largest size in bytes.
    #[arg(long, default_value_t = GIB)]
    pub(crate) max_bytes: usize,
    /// Timed calls per point (default: 2 GiB / bytes, clamped to 5..=200).
    #[arg(long)]
    pub(crate) iters: Option<usize>,
    /// Warm-up calls per point (fewer for large sizes: at most 1 GiB of warm-up, at least 1 call).
    #[arg(long, default_value_t = 5)]
    pub(crate) warmup: usize,
    /// Sizes quadrupling instead of doubling.
    #[arg(long)]
    pub(crate) quick: bool,
    /// Machine name, used in the CSV file name.
    #[arg(long, default_value = "local")]
    pub(crate) machine: String,
    /// Directory for the CSV.
    #[arg(long, default_value = "bench/results")]
    pub(crate) out: PathBuf,
    /// NCCL library to use when `libnccl.so` is not on the loader path (e.g. /usr/lib/x86_64-linux-gnu/libnccl.so.2).
    #[arg(long)]
    pub(crate) nccl_lib: Option<PathBuf>,
    /// Internal: run as the NCCL child.
    #[arg(long, hide = true)]
    pub(crate) nccl_child: bool,
    /// Internal: points done before this process (progress lines).
    #[arg(long, hide = true, default_value_t = 0)]
    pub(crate) progress_offset: usize,
    /// Internal: points in the whole run (progress lines).
    #[arg(long, hide = true)]
    pub(crate) progress_total: Option<usize>,
}

/// A call of `p2p`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
pub(crate) enum P2pOp {
    /// Every rank sends to rank+1 and receives from rank-1, in one group.
    #[value(name = "sendrecv")]
    SendRecv,
    /// All-to-all of equal blocks.
    #[value(name = "alltoall")]
    AllToAll,
    /// All-reduce (sum, out of place).
    #[value(name = "allreduce")]
    AllReduce,
}

impl P2pOp {
    /// The name on the command line, in the table and the CSV.
    pub(crate) fn name(self) -> &'static str {
        match self {
            P2pOp::SendRecv => "sendrecv",
            P2pOp::AllToAll => "alltoall",
            P2pOp::AllReduce => "allreduce",
        }
    }
}

/// An implementation of the multi-process all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
pub(crate) enum MpImpl {
    /// cuda-peer's communicator of processes (`ipc::Comm`).
    #[value(name = "cuda-peer-ipc")]
    PeerIpc,
    /// cuda-peer between processes on the staged path (no P2P).
    #[value(name = "cuda-peer-ipc-staged")]
    PeerIpcStaged,
    /// NCCL, one rank per process.
    #[value(name = "nccl-mp")]
    NcclMp,
    /// NCCL, one rank per process, `NCCL_P2P_DISABLE=1`.
    #[value(name = "nccl-mp-no-p2p")]
    NcclMpNoP2p,
    /// cuda-peer's NCCL path (`ipc::NcclComm`), one rank per process.
    #[value(name = "cuda-peer-nccl")]
    PeerNccl,
}

impl MpImpl {
    /// The name in the CSV and on the command line.
    pub(crate) fn name(self) -> &'static str {
        match self {
            MpImpl::PeerIpc => "cuda-peer-ipc",
            MpImpl::PeerIpcStaged => "cuda-peer-ipc-staged",
            MpImpl::NcclMp => "nccl-mp",
            MpImpl::NcclMpNoP2p => "nccl-mp-no-p2p",
            MpImpl::PeerNccl => "cuda-peer-nccl",
        }
    }

    /// Runs NCCL, in a child process per rank (NCCL reads its environment once per process).
    pub(crate) fn is_nccl(self) -> bool {
        matches!(self, MpImpl::NcclMp | MpImpl::NcclMpNoP2p | MpImpl::PeerNccl)
    }
}

/// An implementation under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
pub(crate) enum Impl {
    #[value(name = "cuda-peer-p2p")]
    PeerP2p,
    #[value(name = "cuda-peer-staged")]
    PeerStaged,
    /// cuda-peer over P2P, ring all-reduce forced (for the algorithm crossover).
    #[value(name = "cuda-peer-ring")]
    PeerRing,
    /// cuda-peer over P2P, mesh all-reduce forced (for the algorithm crossover).
    #[value(name = "cuda-peer-mesh")]
    PeerMesh,
    /// cuda-peer over P2P, one-shot all-reduce forced (for the algorithm crossover).
    #[value(name = "cuda-peer-oneshot")]
    PeerOneShot,
    /// cuda-peer without P2P, one-shot through host memory forced.
    #[value(name = "cuda-peer-host-oneshot")]
    PeerHostOneShot,
    /// cuda-peer without P2P, staged ring forced.
    #[value(name = "cuda-peer-staged-ring")]
    PeerStagedRing,
    /// cuda-peer-p2p without launcher threads (every rank launched from the calling thread).
    #[value(name = "cuda-peer-p2p-serial")]
    PeerP2pSerial,
    /// cuda-peer-staged without launcher threads.
    #[value(name = "cuda-peer-staged-serial")]
    PeerStagedSerial,
    #[value(name = "nccl")]
    Nccl,
    #[value(name = "nccl-no-p2p")]
    NcclNoP2p,
}

impl Impl {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Impl::PeerP2p => "cuda-peer-p2p",
            Impl::PeerStaged => "cuda-peer-staged",
            Impl::PeerRing => "cuda-peer-ring",
            Impl::PeerMesh => "cuda-peer-mesh",
            Impl::PeerOneShot => "cuda-peer-oneshot",
            Impl::PeerHostOneShot => "cuda-peer-host-oneshot",
            Impl::PeerStagedRing => "cuda-peer-staged-ring",
            Impl::PeerP2pSerial => "cuda-peer-p2p-serial",
            Impl::PeerStagedSerial => "cuda-peer-staged-serial",
            Impl::Nccl => "nccl",
            Impl::NcclNoP2p => "nccl-no-p2p",
        }
    }

    pub(crate) fn is_nccl(self) -> bool {
        matches!(self, Impl::Nccl | Impl::NcclNoP2p)
    }
}

/// The settings both the sweep and `mp-allreduce` take, under the same
/// flags (each mode's options above, which clap shows, say them in the
/// mode's own words): the points, the calls per point, where the CSV goes,
/// and in a child process the progress so far. A child is given them back
/// as flags (`nccl::child_flags`).
#[derive(Debug, Clone)]
pub(crate) struct Common {
    pub(crate) dtypes: Vec<Dt>,
    pub(crate) min_bytes: usize,
    pub(crate) max_bytes: usize,
    pub(crate) iters: Option<usize>,
    pub(crate) warmup: usize,
    pub(crate) quick: bool,
    pub(crate) machine: String,
    pub(crate) out: PathBuf,
    pub(crate) progress_offset: usize,
    pub(crate) progress_total: Option<usize>,
}

/// [`Common`] from a mode's options, which have its fields under the same
/// names and types.
macro_rules! common_of {
    ($args:expr) => {
        Common {
            dtypes: $args.dtypes.clone(),
            min_bytes: $args.min_bytes,
            max_bytes: $args.max_bytes,
            iters: $args.iters,
            warmup: $args.warmup,
            quick: $args.quick,
            machine: $args.machine.clone(),
            out: $args.out.clone(),
            progress_offset: $args.progress_offset,
            progress_total: $args.progress_total,
        }
    };
}

impl Common {
    /// Exits with one line unless 0 < --min-bytes <= --max-bytes.
    pub(crate) fn require_sizes(&self) {
        if self.min_bytes == 0 || self.min_bytes > self.max_bytes {
            unusable(format_args!("need 0 < --min-bytes <= --max-bytes"));
        }
    }
}

impl Args {
    /// The settings the modes share.
    pub(crate) fn common(&self) -> Common {
        common_of!(self)
    }

    /// The collectives swept: `--ops`, or all_reduce alone with `--quick`.
    pub(crate) fn swept_ops(&self) -> Vec<Op> {
        if self.quick {
            vec![Op::AllReduce]
        } else {
            self.ops.clone()
        }
    }

    /// The CSV of the collectives (every collective, despite the name).
    pub(crate) fn collectives_csv(&self) -> PathBuf {
        self.out.join(format!("{}-allreduce.csv", self.machine))
    }

    /// The CSV of `--copy`.
    pub(crate) fn copy_csv(&self) -> PathBuf {
        self.out.join(format!("{}-copy.csv", self.machine))
    }
}

impl P2pArgs {
    /// The settings the modes share.
    pub(crate) fn common(&self) -> Common {
        common_of!(self)
    }

    /// The CSV of `p2p`.
    pub(crate) fn csv(&self) -> PathBuf {
        self.out.join(format!("{}-p2p.csv", self.machine))
    }
}

impl MpArgs {
    /// The settings the modes share.
    pub(crate) fn common(&self) -> Common {
        common_of!(self)
    }

    /// The CSV rank 0 writes.
    pub(crate) fn csv(&self) -> PathBuf {
        self.out.join(format!("{}-multiprocess-allreduce.csv", self.machine))
    }
}
