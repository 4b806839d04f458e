//! `cuda-peer-bench`: cuda-peer's collectives and copies against NCCL (with
//! and without P2P), in the style of nccl-tests, every point checked
//! against a CPU reference; the host cost of each driver call on the
//! enqueue path; and the all-reduce between processes against NCCL with one
//! rank per process. See `bench/README.md`.
//!
//!     cargo build --release -p cuda-peer-bench
//!     target/release/cuda-peer-bench [--ops all_reduce,reduce_scatter,all_gather,broadcast]
//!         [--dtypes f32,bf16] [--min-bytes 4] [--max-bytes 1073741824]
//!         [--impls cuda-peer-p2p,cuda-peer-staged,nccl,nccl-no-p2p] [--iters N] [--warmup N]
//!         [--machine NAME] [--out bench/results] [--copy] [--quick] [--nccl-lib PATH]
//!     target/release/cuda-peer-bench enqueue-costs [--calls N]
//!     target/release/cuda-peer-bench p2p [--ops sendrecv,alltoall] [--ranks N] [--quick] [--max-bytes B] [--out DIR]
//!     cuda-peer-run -n 2 -- target/release/cuda-peer-bench mp-allreduce [--machine NAME] ...
//!
//! Conventions are nccl-tests': one rank per GPU; `bytes` is the per-rank
//! buffer for all_reduce and broadcast, the send buffer (N blocks) for
//! reduce_scatter and the receive buffer (N blocks) for all_gather; `count`
//! is the element count passed to the call (for reduce_scatter the receive
//! count, for all_gather the send count); algbw = bytes / time and busbw =
//! algbw * 2(N-1)/N (all_reduce), (N-1)/N (reduce_scatter, all_gather), 1
//! (broadcast). all_reduce and broadcast (root 0) run in place, the others
//! out of place, for every implementation.
//!
//! NCCL runs in a child process per implementation (this program, run
//! again with a hidden `--child-report`): NCCL reads `NCCL_P2P_DISABLE` once
//! per process (it caches it in a static at the first communicator), so
//! `nccl` and `nccl-no-p2p` cannot share one. The parent never loads NCCL.
//! The multi-process mode does the same per rank (see [`mp`]).

mod cli;
mod copy;
mod data;
mod device;
mod enqueue_costs;
mod exit;
mod harness;
mod kinds;
mod mp;
mod nccl;
mod output;
mod p2p;
mod plan;
mod summary;
mod sweep;
mod units;

use clap::Parser;
use cli::{Args, Cli, Command};
use copy::copy_sweep;
use cuda_peer::driver;
use device::contexts;
use exit::{require_gpus, Res};
use nccl::nccl_shim;
use output::{Csv, CSV_HEADER};
use plan::{Plan, Progress};
use std::path::PathBuf;
use summary::print_summary;
use sweep::{run_nccl_child, run_peer, ChildEnd};

/// The parent: copies (optional), then every implementation, then the summary.
fn run(args: &Args) -> Res<()> {
    let ctxs = contexts(args.graph)?;
    let n = ctxs.len();
    std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
    println!("# bench: {} ({n} GPUs: {}), CUDA driver {}", args.machine, ctxs[0].name().unwrap_or_default(), driver::driver_version().unwrap_or(0));
    println!(
        "# #wrong: every element of every rank's output checked up to {} MiB per buffer; larger outputs: {} evenly spaced windows of {} elements per rank (~1M, first and last included) ('sampled')",
        data::FULL_CHECK_BYTES / units::MIB,
        data::WINDOWS,
        data::WINDOW
    );
    if args.graph {
        println!("# --graph: time per call replayed from one CUDA graph of up to {} calls (all ranks in one capture); cudarc's event tracking off; enqueue times below are still eager calls", device::GRAPH_CALLS);
    }
    if args.copy {
        copy_sweep(args, &ctxs)?;
    }
    let plan = Plan::new(args.swept_ops(), &args.common(), n);
    let per_impl = plan.points().len();
    let mut progress = Progress { done: 0, total: per_impl * args.impls.len() };
    Csv::create(&args.collectives_csv(), CSV_HEADER)?;
    // Removed when dropped, at the end of this function.
    let tmp = nccl::private_tmp()?;
    let mut shim: Option<Option<PathBuf>> = None;
    let mut nccl_missing = false;
    let mut enqueue = Vec::new();
    for &imp in &args.impls {
        let start = progress.done;
        if imp.is_nccl() {
            if !nccl_missing {
                let shim = shim.get_or_insert_with(|| nccl_shim(args.nccl_lib.as_deref(), tmp.path(), true));
                match run_nccl_child(args, imp, &progress, shim.as_deref(), tmp.path()) {
                    Ok(ChildEnd::Finished(us)) => enqueue.push((imp, us)),
                    Ok(ChildEnd::Failed) => {}
                    Ok(ChildEnd::NoNccl) => nccl_missing = true,
                    Err(e) => println!("# {}: skipped: could not run the NCCL child: {e}", imp.name()),
                }
            }
        } else {
            match run_peer(args, imp, &ctxs, &plan, &mut progress) {
                Ok(us) => enqueue.push((imp, us)),
                Err(e) => println!("# {}: stopped: {e}", imp.name()),
            }
        }
        progress.done = start + per_impl;
    }
    drop(tmp);
    print_summary(args, &enqueue)
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::EnqueueCosts(args)) => {
            require_gpus(2);
            enqueue_costs::run(&args)
        }
        Some(Command::MpAllreduce(args)) => mp::main(&args),
        Some(Command::P2p(args)) => p2p::main(&args),
        None => sweep_main(&cli.sweep),
    };
    if let Err(e) = result {
        eprintln!("cuda-peer-bench: {e}");
        std::process::exit(1);
    }
}

/// The collective (and copy) sweep over every GPU of this process.
fn sweep_main(args: &Args) -> Res<()> {
    require_gpus(2);
    args.common().require_sizes();
    match &args.child_report {
        Some(report) => match args.impls.as_slice() {
            [imp] if imp.is_nccl() => sweep::nccl_child(args, *imp, report),
            _ => Err("--child-report takes exactly one NCCL impl".into()),
        },
        None => run(args),
    }
}
