//! A digest of every all-reduce result, per algorithm, element type,
//! reduction and size, on fixed pseudo-random inputs (every bit pattern:
//! NaNs, infinities, subnormals, -0 included), to check that two kernel
//! images give bitwise identical results: run it with the embedded cubins
//! and with `CUDA_PEER_FORCE_PTX=1` (the PTX, JIT-compiled by the driver)
//! and compare the outputs; they must be identical.
//!
//!     cargo run --release --example kernel_digest -- [--ranks N] > cubin.txt
//!     CUDA_PEER_FORCE_PTX=1 cargo run --release --example kernel_digest > ptx.txt
//!     diff cubin.txt ptx.txt
//!
//! Each line: algorithm, type, reduction, elements, the FNV-1a 64 digest of
//! rank 0's result, and whether every rank's result is identical to it.

mod common;

use clap::Parser;
use cuda_peer::cudarc::driver::{CudaSlice, CudaStream};
use cuda_peer::{driver, Algorithm, DType, Element, Group, GroupOptions, ReduceOp};
use half::{bf16, f16};
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(about = "Digests of all-reduce results on fixed inputs, to compare kernel images")]
struct Args {
    /// Ranks in the group (default: one per GPU), laid round-robin over the GPUs.
    #[arg(long)]
    ranks: Option<usize>,
}

/// Element counts: one element, a message with a scalar tail, one over
/// several one-shot rounds and mesh blocks.
const COUNTS: [usize; 3] = [1, 1027, 1 << 20 | 7];

fn err<E: std::fmt::Debug>(what: &'static str) -> impl Fn(E) -> cuda_peer::Error {
    move |e| cuda_peer::Error::InvalidArgument(format!("{what}: {e:?}"))
}

/// Deterministic bytes (xorshift64*), a different stream per `seed`.
fn fill(bytes: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in bytes.chunks_mut(8) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let v = x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// One all-reduce of `count` elements of `T` with `op`: (digest of rank 0's
/// result, every rank identical).
fn digest<T: Element>(group: &Group, streams: &[Arc<CudaStream>], op: ReduceOp, count: usize, seed: u64) -> cuda_peer::Result<(u64, bool)> {
    let mut bufs: Vec<CudaSlice<T>> = Vec::with_capacity(streams.len());
    for (r, s) in streams.iter().enumerate() {
        let mut host: Vec<T> = vec![<T as bytemuck::Zeroable>::zeroed(); count];
        fill(bytemuck::cast_slice_mut(&mut host), seed ^ ((r as u64 + 1) << 32));
        bufs.push(s.clone_htod(&host).map_err(err("upload"))?);
    }
    group.all_reduce_in_place(&mut bufs, op)?;
    let mut first: Option<Vec<T>> = None;
    let mut same = true;
    for (b, s) in bufs.iter().zip(streams) {
        let got = s.clone_dtoh(b).map_err(err("download"))?;
        match &first {
            None => first = Some(got),
            Some(f) => same &= bytemuck::cast_slice::<T, u8>(f) == bytemuck::cast_slice::<T, u8>(&got),
        }
    }
    let bytes = first.as_deref().map(bytemuck::cast_slice::<T, u8>).unwrap_or(&[]);
    Ok((fnv1a(bytes), same))
}

fn digest_of(dtype: DType, group: &Group, streams: &[Arc<CudaStream>], op: ReduceOp, count: usize, seed: u64) -> cuda_peer::Result<(u64, bool)> {
    match dtype {
        DType::F32 => digest::<f32>(group, streams, op, count, seed),
        DType::F64 => digest::<f64>(group, streams, op, count, seed),
        DType::F16 => digest::<f16>(group, streams, op, count, seed),
        DType::BF16 => digest::<bf16>(group, streams, op, count, seed),
        DType::I32 => digest::<i32>(group, streams, op, count, seed),
        DType::I64 => digest::<i64>(group, streams, op, count, seed),
        DType::U32 => digest::<u32>(group, streams, op, count, seed),
        DType::U64 => digest::<u64>(group, streams, op, count, seed),
        DType::I8 => digest::<i8>(group, streams, op, count, seed),
        DType::U8 => digest::<u8>(group, streams, op, count, seed),
        DType::F8E4M3 => digest::<cuda_peer::float8::F8E4M3>(group, streams, op, count, seed),
        DType::F8E5M2 => digest::<cuda_peer::float8::F8E5M2>(group, streams, op, count, seed),
    }
}

fn main() {
    let args = Args::parse();
    let gpus = common::gpus_or_exit("kernel_digest");
    let result = (|| -> cuda_peer::Result<bool> {
        let ranks = args.ranks.unwrap_or(gpus);
        let ctx = driver::all_contexts()?;
        let streams: Vec<Arc<CudaStream>> = (0..ranks).map(|r| ctx[r % gpus].new_stream()).collect::<Result<_, _>>().map_err(err("stream"))?;
        let mut all_same = true;
        for (name, algorithm) in [("oneshot", Algorithm::OneShot), ("mesh", Algorithm::Mesh), ("ring", Algorithm::Ring)] {
            let group = match Group::new(streams.clone(), &GroupOptions::default().algorithm(algorithm)) {
                Ok(g) => g,
                Err(e) => {
                    println!("{name}: not possible here ({e})");
                    continue;
                }
            };
            for dtype in DType::ALL {
                for op in ReduceOp::ALL {
                    if op.check(dtype).is_err() {
                        continue;
                    }
                    for (i, &count) in COUNTS.iter().enumerate() {
                        let seed = (dtype as u64) << 16 | (op as u64) << 8 | i as u64;
                        let (d, same) = digest_of(dtype, &group, &streams, op, count, seed)?;
                        all_same &= same;
                        println!("{name} {} {} {count} {d:016x} {}", dtype.name(), op.name(), if same { "ranks-equal" } else { "RANKS-DIFFER" });
                    }
                }
            }
        }
        Ok(all_same)
    })();
    match result {
        Ok(true) => {}
        Ok(false) => {
            eprintln!("kernel_digest: some ranks' results differ");
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("kernel_digest: {e}");
            std::process::exit(1);
        }
    }
}
