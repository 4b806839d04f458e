//! The summary at the end of the sweep: ratios of cuda-peer to NCCL.

use crate::cli::{Args, Impl};
use crate::plan::{KIB, MIB};
use crate::sweep::collectives_csv;
use crate::Res;
use std::collections::HashMap;
use std::fmt::Write as _;

/// Ratios of cuda-peer to NCCL for all_reduce at a few sizes, from the CSV
/// (so NCCL's rows, written by the children, are included).
pub(crate) fn print_summary(args: &Args, enqueue: &[(Impl, f64)]) -> Res<()> {
    let text = std::fs::read_to_string(collectives_csv(args))?;
    // (impl, dtype, bytes) -> (time_us, busbw) for all_reduce.
    let mut ar: HashMap<(String, String, usize), (f64, f64)> = HashMap::new();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        if f.len() == 10 && f[1] == "all_reduce" {
            if let (Ok(bytes), Ok(t), Ok(bw)) = (f[5].parse(), f[6].parse(), f[8].parse()) {
                ar.insert((f[0].to_string(), f[2].to_string(), bytes), (t, bw));
            }
        }
    }
    let get = |imp: Impl, dt: &str, bytes: usize| ar.get(&(imp.name().to_string(), dt.to_string(), bytes)).copied();
    println!("#");
    println!("# summary, all_reduce: cuda-peer-p2p vs nccl, cuda-peer-staged vs nccl-no-p2p");
    println!("#   t_ratio = cuda-peer time / NCCL time (< 1: cuda-peer faster); bw_ratio = cuda-peer busbw / NCCL busbw (> 1: cuda-peer faster)");
    println!(
        "#{:>5} {:>10} | {:>9} {:>9} {:>7} {:>8} {:>8} {:>8} | {:>9} {:>9} {:>7} {:>8} {:>8} {:>8}",
        "dtype",
        "bytes",
        "p2p_us",
        "nccl_us",
        "t_ratio",
        "p2p_bw",
        "nccl_bw",
        "bw_ratio",
        "stg_us",
        "nop2p_us",
        "t_ratio",
        "stg_bw",
        "nop2p_bw",
        "bw_ratio"
    );
    for dt in ["f32", "bf16"] {
        for bytes in [4 * KIB, 256 * KIB, 16 * MIB, 256 * MIB] {
            let mut line = format!("{dt:>6} {bytes:>10}");
            for (ours, theirs) in [(Impl::PeerP2p, Impl::Nccl), (Impl::PeerStaged, Impl::NcclNoP2p)] {
                line.push_str(" |");
                match (get(ours, dt, bytes), get(theirs, dt, bytes)) {
                    (Some((t0, b0)), Some((t1, b1))) => {
                        write!(line, " {t0:>9.2} {t1:>9.2} {:>7.2} {b0:>8.2} {b1:>8.2} {:>8.2}", t0 / t1, b0 / b1)?;
                    }
                    (a, b) => {
                        let cell = |x: Option<(f64, f64)>, f: fn((f64, f64)) -> f64| x.map(|v| format!("{:.2}", f(v))).unwrap_or("-".into());
                        write!(
                            line,
                            " {:>9} {:>9} {:>7} {:>8} {:>8} {:>8}",
                            cell(a, |v| v.0),
                            cell(b, |v| v.0),
                            "-",
                            cell(a, |v| v.1),
                            cell(b, |v| v.1),
                            "-"
                        )?;
                    }
                }
            }
            println!("{line}");
        }
    }
    if !enqueue.is_empty() {
        let list: Vec<String> = enqueue.iter().map(|(imp, us)| format!("{} {us:.2} us", imp.name())).collect();
        println!("#");
        println!("# host time to enqueue one 4 KiB f32 all_reduce on all ranks (1000 calls in batches of 50, no GPU wait): {}", list.join(", "));
    }
    Ok(())
}
