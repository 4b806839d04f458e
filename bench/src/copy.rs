//! Copies between every pair of GPUs (`--copy`).

use crate::cli::Args;
use crate::data::{check_windows, mix, par_count, par_vec};
use crate::device::{sync_all, time_calls};
use crate::exit::Res;
use crate::output::{Csv, COPY_CSV_HEADER};
use crate::plan::{geometric, iters_for, warmup_for, Progress};
use crate::units::{GIB, KIB};
use cuda_peer::copy::{Link, LinkOptions, PathPolicy};
use cuda_peer::cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;

/// How a copy is carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CopyPath {
    /// `cuMemcpyPeerAsync` with peer access never enabled in this process.
    DriverNoPeer,
    /// cuda-peer's staged link (through pinned host memory).
    Staged,
    /// cuda-peer's verified P2P link.
    P2p,
}

impl CopyPath {
    pub(crate) fn name(self) -> &'static str {
        match self {
            CopyPath::DriverNoPeer => "driver-no-peer",
            CopyPath::Staged => "staged",
            CopyPath::P2p => "p2p",
        }
    }
}

/// The byte at `i` of side `side`'s source buffer (never 0, the poison).
pub(crate) fn pattern(side: usize, i: usize) -> u8 {
    (mix(((side as u64 + 1) << 44) | i as u64) as u8) | 1
}

/// Two GPUs, each with a source buffer (its side's pattern) and a destination
/// buffer; "into side k" copies side 1-k's source into side k's destination
/// on side k's stream.
pub(crate) struct Pair {
    pub(crate) devices: [usize; 2],
    pub(crate) streams: [Arc<CudaStream>; 2],
    pub(crate) src: [CudaSlice<u8>; 2],
    pub(crate) dst: [CudaSlice<u8>; 2],
    /// Raw addresses of `src` and `dst`, for the driver's own copies.
    pub(crate) src_ptr: [u64; 2],
    pub(crate) dst_ptr: [u64; 2],
    /// `links[k]`: the link into side k (cuda-peer paths only).
    pub(crate) links: Option<[Link; 2]>,
}

impl Pair {
    pub(crate) fn new(ctxs: [&Arc<CudaContext>; 2], bytes: usize, path: CopyPath) -> Res<Pair> {
        let links = match path {
            CopyPath::DriverNoPeer => None,
            CopyPath::Staged | CopyPath::P2p => {
                let policy = if path == CopyPath::P2p { PathPolicy::P2pOnly } else { PathPolicy::StagedOnly };
                let opts = LinkOptions::with_policy(policy);
                Some([Link::open(ctxs[1], ctxs[0], &opts)?, Link::open(ctxs[0], ctxs[1], &opts)?])
            }
        };
        let streams = [ctxs[0].new_stream()?, ctxs[1].new_stream()?];
        let mut src = Vec::new();
        let mut dst = Vec::new();
        for (k, s) in streams.iter().enumerate() {
            src.push(s.clone_htod(&par_vec(bytes, |i| pattern(k, i)))?);
            dst.push(s.alloc_zeros::<u8>(bytes)?);
        }
        let ptr = |b: &CudaSlice<u8>, s: &Arc<CudaStream>| b.device_ptr(s).0;
        let src_ptr = [ptr(&src[0], &streams[0]), ptr(&src[1], &streams[1])];
        let dst_ptr = [ptr(&dst[0], &streams[0]), ptr(&dst[1], &streams[1])];
        sync_all(&streams)?;
        let devices = [ctxs[0].ordinal(), ctxs[1].ordinal()];
        let (src, dst) = (to_pair(src), to_pair(dst));
        Ok(Pair { devices, streams, src, dst, src_ptr, dst_ptr, links })
    }

    /// Enqueues one copy of `len` bytes into side `into`.
    pub(crate) fn enqueue(&mut self, path: CopyPath, into: usize, len: usize) -> Res<()> {
        let from = 1 - into;
        let stream = &self.streams[into];
        match (&mut self.links, path) {
            (Some(links), CopyPath::Staged | CopyPath::P2p) => {
                links[into].copy(&self.src[from].slice(..len), &mut self.dst[into].slice_mut(..len), stream)?;
            }
            _ => {
                let (dctx, sctx) = (stream.context(), self.streams[from].context());
                dctx.bind_to_thread()?;
                // SAFETY: both addresses hold at least `len` bytes on their
                // devices and outlive the copy (the pair is synchronised
                // before its buffers are read back or dropped).
                unsafe {
                    cuda_peer::cudarc::driver::result::memcpy_peer_async(
                        dctx.cu_ctx(),
                        self.dst_ptr[into],
                        sctx.cu_ctx(),
                        self.src_ptr[from],
                        len,
                        stream.cu_stream(),
                    )
                }?;
            }
        }
        Ok(())
    }

    /// Zeroes the first `len` bytes of the destinations of `sides`.
    pub(crate) fn poison(&mut self, sides: &[usize], len: usize) -> Res<()> {
        for &k in sides {
            self.streams[k].memset_zeros(&mut self.dst[k].slice_mut(..len))?;
        }
        sync_all(&self.streams)
    }

    /// Wrong bytes in the first `len` bytes of side `into`'s destination.
    pub(crate) fn wrong(&self, into: usize, len: usize) -> Res<u64> {
        let mut wrong = 0;
        for w in check_windows(len, 1) {
            let got = self.streams[into].clone_dtoh(&self.dst[into].slice(w.clone()))?;
            wrong += par_count(got.len(), |k| got[k] != pattern(1 - into, w.start + k));
        }
        Ok(wrong)
    }
}

pub(crate) fn to_pair<T>(v: Vec<T>) -> [T; 2] {
    let mut it = v.into_iter();
    [it.next().expect("two"), it.next().expect("two")]
}

/// Times copies into `sides` (one side: one way; both: both ways at once).
/// Returns (microseconds per round, wrong bytes).
pub(crate) fn time_copy(pair: &mut Pair, args: &Args, path: CopyPath, sides: &[usize], len: usize) -> Res<(f64, u64)> {
    pair.poison(sides, len)?;
    let streams: Vec<_> = sides.iter().map(|&k| pair.streams[k].clone()).collect();
    let (warmup, iters) = (warmup_for(args.warmup, len), iters_for(args.iters, len));
    let us = time_calls(&streams, warmup, iters, || sides.iter().try_for_each(|&k| pair.enqueue(path, k, len)))?;
    let mut wrong = 0;
    for &k in sides {
        wrong += pair.wrong(k, len)?;
    }
    Ok((us, wrong))
}

/// Copies between every pair of GPUs over every path, 4 KiB to 1 GiB
/// (quadrupling, capped by --max-bytes); the driver's own copies first, before
/// this process enables peer access anywhere. One way for each ordered pair;
/// both ways once per unordered pair (the same measurement either way round).
pub(crate) fn copy_sweep(args: &Args, ctxs: &[Arc<CudaContext>]) -> Res<()> {
    let sizes = geometric(4 * KIB, args.max_bytes.min(GIB), 4);
    let Some(&max) = sizes.last() else {
        println!("# copy: --max-bytes below 4 KiB, no copies");
        return Ok(());
    };
    let n = ctxs.len();
    let pairs: Vec<(usize, usize)> = (0..n).flat_map(|i| (i + 1..n).map(move |j| (i, j))).collect();
    let paths = [CopyPath::DriverNoPeer, CopyPath::Staged, CopyPath::P2p];
    let mut progress = Progress { done: 0, total: paths.len() * pairs.len() * sizes.len() * 3 };
    let mut csv = Csv::create(&args.copy_csv(), COPY_CSV_HEADER)?;
    println!("#");
    println!("# copies: driver-no-peer first (no peer access enabled yet), then staged, then p2p; GB/s counts the bytes of every direction");
    println!("#{:>15} {:>4} {:>4} {:>4} {:>12} {:>10} {:>8} {:>7}", "path", "src", "dst", "dir", "bytes", "time_us", "GB/s", "#wrong");
    for path in paths {
        for &(i, j) in &pairs {
            let mut pair = match Pair::new([&ctxs[i], &ctxs[j]], max, path) {
                Ok(p) => p,
                Err(e) => {
                    println!("# copy {} GPU{i} <-> GPU{j}: unavailable: {e}", path.name());
                    progress.done += sizes.len() * 3;
                    continue;
                }
            };
            for &len in &sizes {
                // (sides, src, dst, direction): into side 1 is i -> j.
                let [a, b] = pair.devices;
                for (sides, src, dst, dir) in [(&[1][..], a, b, "uni"), (&[0][..], b, a, "uni"), (&[1, 0][..], a, b, "bi")] {
                    progress.tick(format_args!("copy {} {src}->{dst} {dir} {len}", path.name()));
                    let (us, wrong) = time_copy(&mut pair, args, path, sides, len)?;
                    let gbs = (len * sides.len()) as f64 / us / 1e3;
                    println!("{:>16} {src:>4} {dst:>4} {dir:>4} {len:>12} {us:>10.2} {gbs:>8.2} {wrong:>7}", path.name());
                    csv.line(&format!("{},{src},{dst},{dir},{len},{us:.3},{gbs:.6}", path.name()))?;
                }
            }
        }
    }
    Ok(())
}
