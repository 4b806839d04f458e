//! Devices, the P2P capability matrix, and bandwidth/latency matrices for
//! the P2P path, the staged path and the driver's own peer copy, like CUDA
//! samples' p2pBandwidthLatencyTest.
//!
//!     cargo run --release --example p2p_matrix -- [--bytes N] [--iters N] [--json]

#![allow(clippy::needless_range_loop)] // matrices indexed by device pairs

mod common;

use clap::Parser;
use cuda_peer::copy::{Link, LinkOptions, PathPolicy};
use cuda_peer::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cuda_peer::topology::Topology;
use cuda_peer::{driver, Result};
use std::sync::Arc;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "P2P capability, bandwidth and latency between every pair of GPUs")]
struct Args {
    /// Bytes per bandwidth copy.
    #[arg(long, default_value_t = 256 << 20)]
    bytes: usize,
    /// Copies per bandwidth measurement.
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Copies per latency measurement (4-byte copies).
    #[arg(long, default_value_t = 2000)]
    latency_iters: usize,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    json: bool,
}

/// The paths measured, in order: the driver's own copy without peer access
/// (measured before any peer access is enabled), staged, P2P, and the
/// driver's own cuMemcpyPeerAsync with peer access enabled.
const PATHS: [&str; 4] = ["driver-no-peer", "staged", "p2p", "driver-p2p"];

struct Pair {
    ctx: [Arc<CudaContext>; 2],
    streams: [Arc<CudaStream>; 2],
    bufs: [CudaSlice<u8>; 2],
    dsts: [CudaSlice<u8>; 2],
}

/// Enqueues one copy `dir` (0: a -> b on b's stream; 1: b -> a on a's stream).
fn enqueue(path: &str, p: &mut Pair, links: &mut [Option<Link>; 2], dir: usize) -> Result<()> {
    let (from, to) = if dir == 0 { (0, 1) } else { (1, 0) };
    let stream = p.streams[to].clone();
    match path {
        "staged" | "p2p" => links[dir].as_mut().expect("link").copy(&p.bufs[from], &mut p.dsts[to], &stream),
        _ => stream.memcpy_dtod(&p.bufs[from], &mut p.dsts[to]).map_err(|e| cuda_peer::Error::driver("cuMemcpyPeerAsync", e.0 as u32)),
    }
}

fn sync(p: &Pair) -> Result<()> {
    for s in &p.streams {
        s.synchronize().map_err(|e| cuda_peer::Error::driver("cuStreamSynchronize", e.0 as u32))?;
    }
    Ok(())
}

/// GB/s one way (dirs = [0]) or both ways at once (dirs = [0, 1]), counting all bytes moved.
fn bandwidth(path: &str, p: &mut Pair, links: &mut [Option<Link>; 2], dirs: &[usize], iters: usize) -> Result<f64> {
    for &d in dirs {
        enqueue(path, p, links, d)?;
    }
    sync(p)?;
    let t = Instant::now();
    for _ in 0..iters {
        for &d in dirs {
            enqueue(path, p, links, d)?;
        }
    }
    sync(p)?;
    let secs = t.elapsed().as_secs_f64();
    Ok((p.bufs[0].len() * iters * dirs.len()) as f64 / secs / 1e9)
}

/// Microseconds per 4-byte copy a -> b.
fn latency(path: &str, ctx: &[Arc<CudaContext>; 2], links: &mut [Option<Link>; 2], iters: usize) -> Result<f64> {
    let err = |e: cuda_peer::cudarc::driver::DriverError| cuda_peer::Error::driver("alloc", e.0 as u32);
    let streams = [ctx[0].default_stream(), ctx[1].new_stream().map_err(err)?];
    let mut p = Pair {
        ctx: ctx.clone(),
        bufs: [streams[0].alloc_zeros::<u8>(4).map_err(err)?, streams[1].alloc_zeros::<u8>(4).map_err(err)?],
        dsts: [streams[0].alloc_zeros::<u8>(4).map_err(err)?, streams[1].alloc_zeros::<u8>(4).map_err(err)?],
        streams,
    };
    let _ = &p.ctx;
    enqueue(path, &mut p, links, 0)?;
    sync(&p)?;
    let t = Instant::now();
    for _ in 0..iters {
        enqueue(path, &mut p, links, 0)?;
    }
    sync(&p)?;
    Ok(t.elapsed().as_secs_f64() * 1e6 / iters as f64)
}

#[derive(Default, Clone)]
struct Cell {
    uni: f64,
    bi: f64,
    lat: f64,
}

fn run(args: &Args) -> Result<()> {
    let topo = Topology::probe()?;
    let n = topo.devices.len();
    if n == 0 {
        return Err(cuda_peer::Error::NoDevice);
    }
    let ctx = driver::all_contexts()?;
    if !args.json {
        println!("{topo}");
    }
    // results[path][i][j]
    let mut results = vec![vec![vec![Cell::default(); n]; n]; PATHS.len()];
    let mut status = vec![vec![String::new(); n]; n];
    for (pi, path) in PATHS.iter().enumerate() {
        for i in 0..n {
            for j in (0..n).filter(|&j| j != i) {
                let pair_ctx = [ctx[i].clone(), ctx[j].clone()];
                let policy = match *path {
                    "staged" => Some(PathPolicy::StagedOnly),
                    "p2p" | "driver-p2p" => Some(PathPolicy::P2pOnly),
                    _ => None,
                };
                let mut links: [Option<Link>; 2] = [None, None];
                if let Some(pol) = policy {
                    match (Link::open(&ctx[i], &ctx[j], &LinkOptions::with_policy(pol)), Link::open(&ctx[j], &ctx[i], &LinkOptions::with_policy(pol)))
                    {
                        (Ok(a), Ok(b)) => {
                            if *path == "p2p" {
                                status[i][j] = format!("{} ({})", a.path(), a.status().reason);
                            }
                            links = [Some(a), Some(b)];
                        }
                        (Err(e), _) | (_, Err(e)) => {
                            if *path == "p2p" {
                                status[i][j] = format!("unavailable: {e}");
                            }
                            continue;
                        }
                    }
                }
                let err = |e: cuda_peer::cudarc::driver::DriverError| cuda_peer::Error::driver("alloc", e.0 as u32);
                let streams = [ctx[i].new_stream().map_err(err)?, ctx[j].new_stream().map_err(err)?];
                let fill = cuda_peer_example_pattern(args.bytes);
                let mut p = Pair {
                    ctx: pair_ctx.clone(),
                    bufs: [streams[0].clone_htod(&fill).map_err(err)?, streams[1].clone_htod(&fill).map_err(err)?],
                    dsts: [streams[0].alloc_zeros::<u8>(args.bytes).map_err(err)?, streams[1].alloc_zeros::<u8>(args.bytes).map_err(err)?],
                    streams,
                };
                let _ = &p.ctx;
                let uni = bandwidth(path, &mut p, &mut links, &[0], args.iters)?;
                let bi = bandwidth(path, &mut p, &mut links, &[0, 1], args.iters)?;
                // Check the last copy landed: every byte of the destination.
                let got = p.streams[1].clone_dtoh(&p.dsts[1]).map_err(err)?;
                if got != fill {
                    return Err(cuda_peer::Error::InvalidArgument(format!("{path} {i}->{j}: copied data is wrong")));
                }
                let lat = latency(path, &pair_ctx, &mut links, args.latency_iters)?;
                results[pi][i][j] = Cell { uni, bi, lat };
            }
        }
    }
    if args.json {
        let mut out = serde_json::Map::new();
        out.insert(
            "devices".into(),
            serde_json::json!(topo
                .devices
                .iter()
                .map(|d| serde_json::json!({"ordinal": d.ordinal, "name": d.name, "pci_bus_id": d.pci_bus_id}))
                .collect::<Vec<_>>()),
        );
        out.insert(
            "can_access_peer".into(),
            serde_json::json!((0..n)
                .map(|i| (0..n).map(|j| i == j || topo.link(i, j).map(|l| l.can_access_peer).unwrap_or(false)).collect::<Vec<_>>())
                .collect::<Vec<_>>()),
        );
        out.insert("link_status".into(), serde_json::json!(status));
        out.insert("bytes".into(), serde_json::json!(args.bytes));
        for (pi, path) in PATHS.iter().enumerate() {
            let m = |f: fn(&Cell) -> f64| (0..n).map(|i| (0..n).map(|j| f(&results[pi][i][j])).collect::<Vec<_>>()).collect::<Vec<_>>();
            out.insert(
                path.to_string(),
                serde_json::json!({"unidirectional_gbs": m(|c| c.uni), "bidirectional_gbs": m(|c| c.bi), "latency_us": m(|c| c.lat)}),
            );
        }
        println!("{}", serde_json::Value::Object(out));
        return Ok(());
    }
    println!("Link status (P2P policy, verified with a random pattern both ways):");
    for i in 0..n {
        for j in (0..n).filter(|&j| j != i) {
            println!("  GPU{i} -> GPU{j}: {}", status[i][j]);
        }
    }
    for (pi, path) in PATHS.iter().enumerate() {
        for (title, f) in [
            ("unidirectional bandwidth, GB/s", (|c: &Cell| c.uni) as fn(&Cell) -> f64),
            ("bidirectional bandwidth, GB/s (both ways together)", |c: &Cell| c.bi),
            ("latency of a 4-byte copy, us", |c: &Cell| c.lat),
        ] {
            println!("\n[{path}] {title} ({} MiB copies):", args.bytes >> 20);
            print!("   D\\D");
            for j in 0..n {
                print!(" {j:>9}");
            }
            println!();
            for i in 0..n {
                print!("{i:>6}");
                for j in 0..n {
                    if i == j {
                        print!(" {:>9}", "-");
                    } else {
                        print!(" {:>9.2}", f(&results[pi][i][j]));
                    }
                }
                println!();
            }
        }
    }
    Ok(())
}

/// A non-zero byte pattern for the bandwidth buffers.
fn cuda_peer_example_pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8 | 1).collect()
}

fn main() {
    let args = Args::parse();
    common::gpus_or_exit("p2p_matrix");
    if let Err(e) = run(&args) {
        eprintln!("p2p_matrix: {e}");
        std::process::exit(1);
    }
}
