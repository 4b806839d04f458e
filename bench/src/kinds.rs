//! What a point runs: the collective and the element type, by the names
//! the command line, the table and the CSV use.

use clap::ValueEnum;

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
