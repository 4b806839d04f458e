//! The summaries at the end of the sweep and of `mp-allreduce`: ratios of
//! cuda-peer to NCCL, from the CSV (so NCCL's rows, written by the
//! children, are included).

use crate::cli::{Args, Impl, MpArgs, MpImpl};
use crate::exit::Res;
use crate::output::all_reduce_times;
use crate::units::{GIB, KIB, MIB};
use std::fmt::Write as _;

/// Ratios of cuda-peer to NCCL for all_reduce at a few sizes, from the CSV
/// (so NCCL's rows, written by the children, are included).
pub(crate) fn print_summary(args: &Args, enqueue: &[(Impl, f64)]) -> Res<()> {
    // (impl, dtype, bytes) -> (time_us, busbw) for all_reduce.
    let ar = all_reduce_times(&args.collectives_csv())?;
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

/// The targets for cuda-peer-ipc against nccl-mp by size: `(what,
/// met)` from the time and busbw ratios.
fn target(bytes: usize, t_ratio: f64, bw_ratio: f64) -> Option<(&'static str, bool)> {
    match bytes {
        b if (4 * KIB..=256 * KIB).contains(&b) => Some(("t<=0.5", t_ratio <= 0.5)),
        b if (MIB..=16 * MIB).contains(&b) => Some(("bw>=1.3", bw_ratio >= 1.3)),
        b if (64 * MIB..=GIB).contains(&b) => Some(("bw>=1.1", bw_ratio >= 1.1)),
        _ => None,
    }
}

/// Ratios to NCCL from the CSV (the children's rows included): cuda-peer-ipc
/// against nccl-mp with the targets, and cuda-peer-ipc-staged
/// against nccl-mp-no-p2p (target: busbw >= 1.2x) where it has rows.
pub(crate) fn print_mp_summary(args: &MpArgs) -> Res<()> {
    let by = all_reduce_times(&args.csv())?;
    let mut sizes: Vec<usize> = by.keys().map(|k| k.2).collect();
    sizes.sort_unstable();
    sizes.dedup();
    println!("#");
    println!(
        "# summary: t_ratio = cuda-peer time / NCCL time (< 1: cuda-peer faster); bw_ratio = cuda-peer busbw / NCCL busbw (> 1: cuda-peer faster)"
    );
    println!("# targets (issue 17): 4 KiB-256 KiB t_ratio <= 0.5; 1-16 MiB bw_ratio >= 1.3; 64 MiB-1 GiB bw_ratio >= 1.1; staged vs nccl-mp-no-p2p bw_ratio >= 1.2");
    println!(
        "#{:>5} {:>10} | {:>9} {:>9} {:>7} {:>8} {:>8} {:>8} {:>8} {:>4} | {:>9} {:>9} {:>8}",
        "dtype", "bytes", "ipc_us", "nccl_us", "t_ratio", "ipc_bw", "nccl_bw", "bw_ratio", "target", "met", "stg_bw", "nop2p_bw", "bw_ratio"
    );
    let get = |imp: MpImpl, dt: &str, b: usize| by.get(&(imp.name().to_string(), dt.to_string(), b)).copied();
    let (mut met, mut missed) = (0, 0);
    for dt in &args.dtypes {
        for &b in &sizes {
            let mut line = format!("{:>6} {b:>10} |", dt.name());
            match (get(MpImpl::PeerIpc, dt.name(), b), get(MpImpl::NcclMp, dt.name(), b)) {
                (Some((t0, b0)), Some((t1, b1))) => {
                    let (tr, br) = (t0 / t1, b0 / b1);
                    let (what, ok) = target(b, tr, br).map(|(w, ok)| (w, if ok { "yes" } else { "NO" })).unwrap_or(("-", "-"));
                    match ok {
                        "yes" => met += 1,
                        "NO" => missed += 1,
                        _ => {}
                    }
                    line.push_str(&format!(" {t0:>9.2} {t1:>9.2} {tr:>7.2} {b0:>8.2} {b1:>8.2} {br:>8.2} {what:>8} {ok:>4} |"));
                }
                _ => line.push_str(&format!(" {:>9} {:>9} {:>7} {:>8} {:>8} {:>8} {:>8} {:>4} |", "-", "-", "-", "-", "-", "-", "-", "-")),
            }
            match (get(MpImpl::PeerIpcStaged, dt.name(), b), get(MpImpl::NcclMpNoP2p, dt.name(), b)) {
                (Some((_, b0)), Some((_, b1))) => line.push_str(&format!(" {b0:>9.2} {b1:>9.2} {:>8.2}", b0 / b1)),
                (None, Some((_, b1))) => line.push_str(&format!(" {:>9} {b1:>9.2} {:>8}", "-", "-")),
                _ => line.push_str(&format!(" {:>9} {:>9} {:>8}", "-", "-", "-")),
            }
            println!("{line}");
        }
    }
    println!("# cuda-peer-ipc against nccl-mp: {met} points meet their target, {missed} miss it");
    // cuda-peer's NCCL path against NCCL itself (target: within 3%).
    let (mut within, mut worse, mut worst) = (0, 0, 0f64);
    for dt in &args.dtypes {
        for &b in &sizes {
            if let (Some((t0, _)), Some((t1, _))) = (get(MpImpl::PeerNccl, dt.name(), b), get(MpImpl::NcclMp, dt.name(), b)) {
                let r = t0 / t1;
                worst = worst.max(r);
                if r <= 1.03 {
                    within += 1;
                } else {
                    worse += 1;
                }
            }
        }
    }
    if within + worse > 0 {
        println!("# cuda-peer-nccl against nccl-mp (time): {within} points within 3%, {worse} beyond; largest ratio {worst:.3}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_by_size() {
        assert_eq!(target(4 * KIB, 0.5, 0.0), Some(("t<=0.5", true)));
        assert_eq!(target(256 * KIB, 0.51, 9.0), Some(("t<=0.5", false)));
        assert_eq!(target(512 * KIB, 0.1, 9.0), None);
        assert_eq!(target(MIB, 1.0, 1.3), Some(("bw>=1.3", true)));
        assert_eq!(target(16 * MIB, 1.0, 1.29), Some(("bw>=1.3", false)));
        assert_eq!(target(32 * MIB, 1.0, 9.0), None);
        assert_eq!(target(64 * MIB, 1.0, 1.1), Some(("bw>=1.1", true)));
        assert_eq!(target(GIB, 1.0, 1.0), Some(("bw>=1.1", false)));
    }
}
