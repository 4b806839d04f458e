//! One process per GPU: run as `cuda-peer-run -n 2 -- multiprocess_allreduce`
//! (or under torchrun). Each rank all-reduces seeded random data (every rank
//! can regenerate every rank's input, so each checks its result against a
//! CPU reference), and rank 0 prints the time per call for a few sizes.
//! Exits 0 when every rank's results were right, 1 otherwise, and 2 with one
//! line when there is no GPU or no launcher.

use cuda_peer::ipc::{comm::seeded, Comm, CommOptions};
use cuda_peer::{driver, ReduceOp};
use std::time::Instant;

/// Rank `r`'s input for a message of `count` elements: small integers, so
/// that the f32 sum is exact.
fn input(size_index: usize, r: usize, count: usize) -> Vec<f32> {
    seeded(0xa11 + (size_index as u64) * 64 + r as u64, count).into_iter().map(|x| (x % 17) as f32 - 8.0).collect()
}

fn run(comm: &Comm) -> Result<bool, cuda_peer::Error> {
    let (rank, n) = (comm.rank(), comm.size());
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
    // Every rank learns whether every rank was right.
    let verdicts = comm.exchange().all_gather(&[all_ok as u8])?;
    Ok(verdicts.iter().all(|v| v.first() == Some(&1)))
}

fn main() {
    match driver::device_count() {
        Ok(0) | Err(_) => {
            eprintln!("multiprocess_allreduce: no usable CUDA device");
            std::process::exit(2);
        }
        Ok(_) => {}
    }
    if std::env::var_os("RANK").is_none() {
        eprintln!("multiprocess_allreduce: run it under a launcher: cuda-peer-run -n 2 -- multiprocess_allreduce");
        std::process::exit(2);
    }
    let comm = match Comm::from_env(&CommOptions::default()) {
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
