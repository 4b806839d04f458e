//! One process per GPU: run as `cuda-peer-run -n 2 -- multiprocess_allreduce`
//! (or under torchrun). Each rank all-reduces seeded random data (every rank
//! can regenerate every rank's input, so each checks its result against a
//! CPU reference), and rank 0 prints the time per call for a few sizes;
//! then an all-gather and a reduce-scatter, checked and timed the same way.
//! `CUDA_PEER_IPC_PATH=staged` (or `p2p`, `auto`: the default) picks the
//! path between the processes (`CommOptions::path`). The communicator is the
//! per-rank `Comm`: cuda-peer's own paths when every rank is on this host, NCCL
//! when the ranks span hosts (`CUDA_PEER_HOST_ID` simulates that). Exits 0 when every rank's results were right, 1 otherwise, and 2 with one
//! line when there is no GPU or no launcher.

mod common;

use cuda_peer::ipc::comm::seeded;
use cuda_peer::{Comm, CommOptions, ReduceOp};
use std::time::Instant;

/// Rank `r`'s input for a message of `count` elements: small integers, so
/// that the f32 sum is exact.
fn input(size_index: usize, r: usize, count: usize) -> Vec<f32> {
    seeded(0xa11 + (size_index as u64) * 64 + r as u64, count).into_iter().map(|x| (x % 17) as f32 - 8.0).collect()
}

/// Times `call` (after a warm-up) on every rank; rank 0 prints the slowest
/// rank's time per call with `what`.
fn time(comm: &Comm, what: &str, mut call: impl FnMut() -> Result<(), cuda_peer::Error>) -> Result<(), cuda_peer::Error> {
    for _ in 0..5 {
        call()?;
    }
    comm.synchronize()?;
    comm.exchange().barrier()?;
    let iters = 50;
    let start = Instant::now();
    for _ in 0..iters {
        call()?;
    }
    comm.synchronize()?;
    let per_call = start.elapsed().as_secs_f64() * 1e6 / iters as f64;
    let all = comm.exchange().all_gather(format!("{per_call:.1}").as_bytes())?;
    if comm.rank() == 0 {
        let times: Vec<String> = all.iter().map(|b| String::from_utf8_lossy(b).into_owned()).collect();
        let slowest = times.iter().map(|t| t.parse::<f64>().unwrap_or(0.0)).fold(0.0, f64::max);
        println!("{} processes ({:?}), {what}: {slowest:.1} us per call (per rank: {})", comm.world_size(), comm.engine(), times.join(", "));
    }
    Ok(())
}

/// An all-gather and a reduce-scatter of 1 MiB per rank (f32), checked
/// against the CPU reference, then timed.
fn others(comm: &Comm) -> Result<bool, cuda_peer::Error> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let stream = comm.stream().clone();
    let drv = |op: &'static str| move |e: cuda_peer::cudarc::driver::DriverError| cuda_peer::Error::driver(op, e.0 as u32);
    let count = (1 << 20) / 4;
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(100, r, count)).collect();
    let send = stream.clone_htod(&inputs[rank]).map_err(drv("cuMemcpyHtoD"))?;
    let mut gathered = stream.alloc_zeros::<f32>(n * count).map_err(drv("cuMemAlloc"))?;
    comm.all_gather(&send, &mut gathered)?;
    let got = stream.clone_dtoh(&gathered).map_err(drv("cuMemcpyDtoH"))?;
    let mut ok = got == inputs.concat();
    // Reduce-scatter of the gathered vector: block r is the sum of every
    // rank's copy of rank r's input, n times it.
    let mut block = stream.alloc_zeros::<f32>(count).map_err(drv("cuMemAlloc"))?;
    comm.reduce_scatter(&gathered, &mut block, ReduceOp::Sum)?;
    let got = stream.clone_dtoh(&block).map_err(drv("cuMemcpyDtoH"))?;
    ok &= got.iter().zip(&inputs[rank]).all(|(g, x)| *g == x * n as f32);
    if !ok {
        eprintln!("rank {rank}: all-gather or reduce-scatter wrong");
    }
    time(comm, &format!("all-gather of {} bytes per rank", count * 4), || comm.all_gather(&send, &mut gathered))?;
    time(comm, &format!("reduce-scatter of {} bytes per rank", count * 4), || comm.reduce_scatter(&gathered, &mut block, ReduceOp::Sum))?;
    Ok(ok)
}

fn run(comm: &Comm) -> Result<bool, cuda_peer::Error> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let stream = comm.stream().clone();
    let mut all_ok = true;
    for (si, bytes) in [4usize << 10, 64 << 10, 1 << 20, 16 << 20].into_iter().enumerate() {
        let count = bytes / 4;
        let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(si, r, count)).collect();
        let expected: Vec<f32> = (0..count).map(|i| inputs.iter().map(|x| x[i]).sum()).collect();
        let send = stream.clone_htod(&inputs[rank]).map_err(|e| cuda_peer::Error::driver("cuMemcpyHtoD", e.0 as u32))?;
        let mut recv = stream.alloc_zeros::<f32>(count).map_err(|e| cuda_peer::Error::driver("cuMemAlloc", e.0 as u32))?;
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum)?;
        let got = stream.clone_dtoh(&recv).map_err(|e| cuda_peer::Error::driver("cuMemcpyDtoH", e.0 as u32))?;
        let wrong = got.iter().zip(&expected).filter(|(a, b)| a != b).count();
        if wrong > 0 {
            eprintln!("rank {rank}: {bytes} bytes: {wrong} of {count} elements wrong");
            all_ok = false;
        }
        // Timing: back-to-back calls after a warm-up.
        for _ in 0..5 {
            comm.all_reduce(&send, &mut recv, ReduceOp::Sum)?;
        }
        comm.synchronize()?;
        comm.exchange().barrier()?;
        let iters = 50;
        let start = Instant::now();
        for _ in 0..iters {
            comm.all_reduce(&send, &mut recv, ReduceOp::Sum)?;
        }
        comm.synchronize()?;
        let per_call = start.elapsed().as_secs_f64() * 1e6 / iters as f64;
        let all = comm.exchange().all_gather(format!("{per_call:.1}").as_bytes())?;
        if rank == 0 {
            let times: Vec<String> = all.iter().map(|b| String::from_utf8_lossy(b).into_owned()).collect();
            println!(
                "{n} processes, {bytes:>9} bytes f32 sum: {} us per call (per rank: {})",
                times
                    .iter()
                    .max_by(|a, b| a.parse::<f64>().unwrap_or(0.0).total_cmp(&b.parse::<f64>().unwrap_or(0.0)))
                    .map(String::as_str)
                    .unwrap_or("?"),
                times.join(", ")
            );
        }
    }
    all_ok &= others(comm)?;
    // Every rank learns whether every rank was right.
    let verdicts = comm.exchange().all_gather(&[all_ok as u8])?;
    Ok(verdicts.iter().all(|v| v.first() == Some(&1)))
}

fn main() {
    common::gpus_or_exit("multiprocess_allreduce");
    if std::env::var_os("RANK").is_none() {
        eprintln!("multiprocess_allreduce: run it under a launcher: cuda-peer-run -n 2 -- multiprocess_allreduce");
        std::process::exit(2);
    }
    let path = match std::env::var("CUDA_PEER_IPC_PATH").map(|p| p.parse()) {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => {
            eprintln!("multiprocess_allreduce: CUDA_PEER_IPC_PATH: {e}");
            std::process::exit(2);
        }
        Err(_) => cuda_peer::PathPolicy::Auto,
    };
    // More ranks on this host than GPUs (as on a one-GPU machine): the ranks share them.
    let local = std::env::var("LOCAL_WORLD_SIZE").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(1);
    let share = cuda_peer::driver::device_count().is_ok_and(|d| d < local);
    let comm = match Comm::from_env(&CommOptions::default().path(path).share_devices(share)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("multiprocess_allreduce: cannot create the communicator: {e}");
            std::process::exit(1);
        }
    };
    match run(&comm) {
        Ok(true) => {
            if comm.rank() == 0 {
                println!("every rank's results match the CPU reference");
            }
        }
        Ok(false) => {
            if comm.rank() == 0 {
                println!("WRONG results on some rank");
            }
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("rank {}: {e}", comm.rank());
            std::process::exit(1);
        }
    }
}
