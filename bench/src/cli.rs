//! The command line: the sweep's options, the subcommands, and the names
//! of collectives, element types and implementations.

use crate::plan::GIB;
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
    EnqueueCosts(crate::enqueue_costs::Args),
    /// All-reduce between processes, one GPU each, against NCCL with one rank per process;
    /// run under `cuda-peer-run -n N --` (or torchrun).
    MpAllreduce(crate::mp::Args),
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

/// A collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
pub(crate) enum Op {
    #[value(name = "all_reduce")]
    AllReduce,
    #[value(name = "reduce_scatter")]
    ReduceScatter,
    #[value(name = "all_gather")]
    AllGather,
    #[value(name = "broadcast")]
    Broadcast,
}

impl Op {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllGather => "all_gather",
            Op::Broadcast => "broadcast",
        }
    }

    /// The reduction, as nccl-tests prints it.
    pub(crate) fn redop(self) -> &'static str {
        match self {
            Op::AllReduce | Op::ReduceScatter => "sum",
            Op::AllGather | Op::Broadcast => "none",
        }
    }

    /// busbw / algbw, as nccl-tests defines it.
    pub(crate) fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::ReduceScatter | Op::AllGather => (n - 1.0) / n,
            Op::Broadcast => 1.0,
        }
    }
}

/// An element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
pub(crate) enum Dt {
    #[value(name = "f32")]
    F32,
    #[value(name = "bf16")]
    Bf16,
}

impl Dt {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Dt::F32 => "f32",
            Dt::Bf16 => "bf16",
        }
    }

    pub(crate) fn size(self) -> usize {
        match self {
            Dt::F32 => 4,
            Dt::Bf16 => 2,
        }
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
