//! Verifying, once at group creation, the paths the fused kernels use.
//!
//! A link is verified by copy-engine copies (`crate::copy::verify`), but the
//! mesh and the one-shot move data with SM peer loads and stores and meet at
//! system-scope flags. On consumer cards with patched drivers the copy
//! engine can pass while SM peer stores are lost or land wrong; a kernel
//! would then wait forever or return wrong data. So before a group uses
//! them, each fused algorithm it has runs all-reduces of fresh random
//! data (exact wrapping u32 sums, counts with a partial 16-byte unit, every
//! rank's result compared with a CPU reference): the mesh one, the one-shot
//! one per lane, each in several rounds where the lane has them
//! (`oneshot::check_counts`), bounded by the group's barrier
//! timeout (a kernel that gives up ends cleanly: `crate::failure`). Where
//! it fails, `Algorithm::Auto` groups drop their fused algorithms and use
//! the ring (whose P2P steps are copy-engine copies and reduction kernels
//! reading the predecessor: verified by the links); a forced algorithm is
//! an error. Nothing is cached: a group created later checks again.

use super::{Algorithm, Algorithms};
use crate::communicator::Communicator;
use crate::dtype::{DType, ReduceOp};
use crate::error::{cudarc_err, Error, Result};
use crate::failure::Fault;
use cudarc::driver::{CudaSlice, DevicePtr};

/// Elements per rank of the mesh's check: a mesh segment per rank, not a
/// multiple of 4 (a partial 16-byte unit).
const MESH_COUNT: usize = (1 << 14) + 3;

/// A pseudo-random word for element `i` of rank `r` under `seed`
/// (splitmix64), so no host buffer needs keeping.
fn word(seed: u64, r: usize, i: usize) -> u32 {
    let mut z = seed ^ ((r as u64) << 40) ^ i as u64;
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) as u32
}

/// Which fused algorithm a check runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fused {
    Mesh,
    OneShot,
}

/// Runs `which` once on `count` elements of fresh data and compares every
/// rank's result with the CPU's; `Ok(Err(why))` where the data or the
/// barrier failed, `Err` for anything else (an allocation, a copy).
fn check_fused(comm: &Communicator, algos: &Algorithms, which: Fused, count: usize) -> Result<std::result::Result<(), String>> {
    let n = comm.size();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let seed = now ^ (comm as *const Communicator as u64).rotate_left(17) ^ which as u64 ^ (count as u64).rotate_left(32);
    let inputs: Vec<Vec<u32>> = (0..n).map(|r| (0..count).map(|i| word(seed, r, i)).collect()).collect();
    let want: Vec<u32> = (0..count).map(|i| inputs.iter().fold(0u32, |a, v| a.wrapping_add(v[i]))).collect();
    let mut bufs: Vec<CudaSlice<u32>> = Vec::with_capacity(n);
    for (r, input) in inputs.iter().enumerate() {
        bufs.push(comm.ranks[r].stream.clone_htod(input).map_err(cudarc_err("cuMemcpyHtoD (fused-path check)"))?);
    }
    for rank in &comm.ranks {
        rank.stream.synchronize().map_err(cudarc_err("cuStreamSynchronize"))?;
    }
    let ptrs: Vec<u64> = bufs.iter().enumerate().map(|(r, b)| b.device_ptr(&comm.ranks[r].stream).0).collect();
    let launched = match which {
        Fused::Mesh => match &algos.mesh {
            Some(mesh) => mesh.check_sum(comm, &ptrs, count),
            None => Ok(()),
        },
        Fused::OneShot => match &algos.oneshot {
            Some(os) => os.ptrs(comm, ReduceOp::Sum, DType::U32, &ptrs, &ptrs, count),
            None => return Ok(Ok(())),
        },
    };
    if let Err(e) = launched {
        return Ok(Err(format!("launching the check failed: {e}")));
    }
    // The kernels end by themselves (at the latest after the barrier
    // timeout), so the synchronisation is bounded.
    for rank in &comm.ranks {
        rank.stream.synchronize().map_err(cudarc_err("cuStreamSynchronize"))?;
    }
    if let Some(ctl) = &comm.ctl {
        if let Err(e) = ctl.check() {
            return Ok(Err(e.to_string()));
        }
    }
    for (r, b) in bufs.iter().enumerate() {
        let got = comm.ranks[r].stream.clone_dtoh(b).map_err(cudarc_err("cuMemcpyDtoH (fused-path check)"))?;
        if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
            let wrong = got.iter().zip(&want).filter(|(a, b)| a != b).count();
            return Ok(Err(format!("rank {r}: {wrong} of {count} results wrong, first at {i}")));
        }
    }
    Ok(Ok(()))
}

/// Checks the fused algorithms `algos` has on real data. Where one fails,
/// a forced algorithm is an error ([`Error::FusedUnverified`]); under
/// [`Algorithm::Auto`] the group keeps only the ring (the fused algorithms,
/// their control block and launchers dropped), with a warning. `fault`
/// (tests only) is injected into the check's launch on a rank.
pub(crate) fn verify(comm: &mut Communicator, algos: &mut Algorithms, fault: Option<(usize, Fault)>) -> Result<()> {
    let mut failed = None;
    for (which, name, present) in [(Fused::Mesh, "mesh", algos.mesh.is_some()), (Fused::OneShot, "one-shot", algos.oneshot.is_some())] {
        if !present || failed.is_some() {
            continue;
        }
        if let (Some((rank, fault)), Some(ctl)) = (fault, &comm.ctl) {
            ctl.inject(rank, fault);
        }
        let counts = match (which, &algos.oneshot) {
            (Fused::OneShot, Some(os)) => os.check_counts(std::mem::size_of::<u32>()),
            _ => vec![MESH_COUNT],
        };
        for count in counts {
            if let Err(why) = check_fused(comm, algos, which, count)? {
                failed = Some((name, format!("{why} ({count} elements)")));
                break;
            }
        }
    }
    let Some((name, why)) = failed else { return Ok(()) };
    if algos.request != Algorithm::Auto {
        return Err(Error::FusedUnverified { algorithm: name, reason: why });
    }
    log::warn!("cuda-peer: the {name} all-reduce failed its check on this group ({why}); using the ring");
    algos.mesh = None;
    algos.oneshot = None;
    comm.detach_fused();
    Ok(())
}
