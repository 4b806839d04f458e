//! Whether a caller's buffer is mapped for kernels on a peer device.
//!
//! Peer access (`cuCtxEnablePeerAccess`) maps memory from `cuMemAlloc` for
//! the peer, and the group opens each device's default memory pool to its
//! peers; memory from another pool or a VMM mapping is mapped for a peer
//! only where its owner granted it (`cuMemPoolSetAccess`, `cuMemSetAccess`).
//! A kernel that loads from or stores to memory not mapped for it faults,
//! and the fault kills the context, so the mesh and the P2P ring (the
//! algorithms whose kernels touch peers' buffers) ask first, and refuse a
//! buffer with [`Error::Unreachable`].
//!
//! Each allocation has a process-wide unique buffer id; verdicts are cached
//! by (address, buffer id), so a call costs one driver query per buffer once
//! its buffers have been seen. Pool memory is judged by the pool's access
//! list (`cuMemPoolGetAccess`), a VMM mapping by its own
//! (`cuMemGetAccess`).

use crate::driver::{api, bind};
use crate::error::{check, Error, Result};
use cuda_peer_sys as sys;
use cudarc::driver::CudaContext;
use std::ffi::c_void;
use std::sync::Mutex;

/// Buffers remembered as reachable, per group.
const CACHE: usize = 32;

/// What a group remembers of buffers it has checked.
#[derive(Debug, Default)]
pub(crate) struct ReachCache {
    /// (address, buffer id, the devices it is mapped for, as a bit mask).
    seen: Mutex<Vec<(u64, u64, u64)>>,
}

/// One pointer attribute, written into `T`.
fn attribute<T: Default>(ptr: u64, attr: sys::CUpointer_attribute) -> Result<T> {
    let mut v = T::default();
    // SAFETY: the driver writes one value of the attribute's type, which
    // the callers give as `T` (ints, handles, u64s); any address may be
    // asked about.
    check("cuPointerGetAttribute", unsafe { api()?.cuPointerGetAttribute((&mut v as *mut T).cast::<c_void>(), attr, ptr) })?;
    Ok(v)
}

/// Whether memory at `ptr` of `owner`'s device is mapped for kernels of
/// `peer`'s device. (`CU_POINTER_ATTRIBUTE_ACCESS_FLAGS` cannot tell: on
/// 2x H200 it answered read-write from every context for every kind of
/// allocation, with or without access; `bench/experiments/pointer_access`.)
fn mapped_for(ptr: u64, owner: &CudaContext, peer: &CudaContext) -> Result<bool> {
    if owner.ordinal() == peer.ordinal() {
        return Ok(true);
    }
    let api = api()?;
    let location = sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: peer.ordinal() as i32 };
    // Pool memory: the pool's access list says.
    let pool = attribute::<sys::CUmemoryPool>(ptr, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE).unwrap_or(std::ptr::null_mut());
    if !pool.is_null() {
        let mut flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
        let mut loc = location;
        // SAFETY: reads one flag value for a live pool (it holds `ptr`) and a
        // device location.
        check("cuMemPoolGetAccess", unsafe { api.cuMemPoolGetAccess(&mut flags, pool, &mut loc) })?;
        return Ok(flags == sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    }
    // cuMemAlloc memory (IPC-capable) and managed memory: context peer
    // access, which the group enabled, maps it. (cuMemGetAccess answers for
    // cuMemAlloc memory too, but without the peer's access: on 2x H200 it
    // refused buffers that peer access maps.)
    use sys::CUpointer_attribute as A;
    if attribute::<i32>(ptr, A::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE).unwrap_or(0) != 0
        || attribute::<i32>(ptr, A::CU_POINTER_ATTRIBUTE_IS_MANAGED).unwrap_or(0) != 0
    {
        return Ok(true);
    }
    // A VMM mapping: its access list says. Anything the driver does not
    // answer for is left to context peer access.
    let mut flags: std::os::raw::c_ulonglong = 0;
    // SAFETY: writes one integer; any address may be asked about (the call
    // fails for addresses that are not VMM mappings).
    match unsafe { api.cuMemGetAccess(&mut flags, &location, ptr) } {
        sys::CUresult::CUDA_SUCCESS => Ok(flags == sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE.0 as std::os::raw::c_ulonglong),
        _ => Ok(true),
    }
}

impl ReachCache {
    /// Checks that every buffer `bufs[r]` (of rank r, on `ctxs[r]`) is
    /// mapped for the kernels of every rank in `readers(r)`; the first one
    /// that is not is an [`Error::Unreachable`] naming the rank and device.
    pub(crate) fn check(&self, op: &'static str, ctxs: &[&CudaContext], bufs: &[u64], readers: impl Fn(usize) -> Vec<usize>) -> Result<()> {
        for (r, &ptr) in bufs.iter().enumerate() {
            let peers = readers(r);
            if peers.is_empty() {
                continue;
            }
            let mask = peers.iter().fold(0u64, |m, &p| m | 1 << (ctxs[p].ordinal() % 64));
            bind(ctxs[r])?;
            let id = attribute::<u64>(ptr, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID)?;
            {
                let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
                if seen.iter().any(|&(a, b, m)| a == ptr && b == id && m & mask == mask) {
                    continue;
                }
            }
            for &p in &peers {
                if !mapped_for(ptr, ctxs[r], ctxs[p])? {
                    return Err(Error::Unreachable { op, rank: r, device: ctxs[p].ordinal() });
                }
            }
            let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
            if seen.len() >= CACHE {
                seen.remove(0);
            }
            seen.push((ptr, id, mask));
        }
        Ok(())
    }
}
