//! Peer access as RAII guards.
//!
//! [`PeerAccess::enable`] lets one context read and write another device's
//! memory: it calls `cuCtxEnablePeerAccess` and also opens the peer device's
//! default memory pool to the accessing device (`cuMemPoolSetAccess`), since
//! cudarc allocates from that pool and peer access alone does not cover pool
//! memory. Guards for the same pair are counted process-wide.
//!
//! What the last guard does: like NCCL, a guard from [`PeerAccess::enable`]
//! (what links and groups use) leaves the access it enabled in place when
//! it goes, so that another library that found it enabled in the meantime
//! (and was told `CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED`) is never pulled
//! out from under. [`PeerAccess::enable_scoped`] asks for the old state to
//! come back instead: when the last guard of a pair to go is scoped, what
//! the first guard changed (and nothing else) is undone.
//! Access that was already enabled by someone else is success without
//! ownership and is always left enabled.

use crate::driver::{api, bind, raw_context};
use crate::error::{check, Error, Result};
use cuda_peer_sys as sys;
use cudarc::driver::CudaContext;
use once_cell::sync::Lazy;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// What the first guard of a pair changed, to be undone by the last.
struct Entry {
    guards: usize,
    owns_ctx_access: bool,
    /// The pool access flags found before we granted read-write, if we did.
    pool_restore: Option<(PoolHandle, sys::CUmemAccess_flags)>,
}

/// A device's default pool handle, kept in the registry.
#[derive(Clone, Copy)]
struct PoolHandle(sys::CUmemoryPool);

// SAFETY: a pool handle is a process-wide driver object that may be used
// from any thread.
unsafe impl Send for PoolHandle {}

type Key = (usize, usize);
static REGISTRY: Lazy<Mutex<HashMap<Key, Entry>>> = Lazy::new(|| Mutex::new(HashMap::new()));

fn key(ctx: &CudaContext, peer: &CudaContext) -> Key {
    (ctx.cu_ctx() as usize, peer.cu_ctx() as usize)
}

/// `ctx`'s access to `peer`'s memory, held open while this guard lives.
#[must_use = "a scoped guard disables peer access again when it is dropped"]
pub struct PeerAccess {
    ctx: Arc<CudaContext>,
    peer: Arc<CudaContext>,
    /// Made by [`PeerAccess::enable_scoped`].
    scoped: bool,
}

impl std::fmt::Debug for PeerAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PeerAccess({} -> {})", self.ctx.ordinal(), self.peer.ordinal())
    }
}

fn pool_location(ordinal: usize) -> sys::CUmemLocation {
    sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal as i32 }
}

/// Grants `ordinal` read-write access to `pool`; returns the previous flags
/// if they had to change.
fn grant_pool(pool: sys::CUmemoryPool, ordinal: usize) -> Result<Option<sys::CUmemAccess_flags>> {
    let api = api()?;
    let mut loc = pool_location(ordinal);
    let mut flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
    // SAFETY: reads one flag value for a valid pool and location.
    check("cuMemPoolGetAccess", unsafe { api.cuMemPoolGetAccess(&mut flags, pool, &mut loc) })?;
    if flags == sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE {
        return Ok(None);
    }
    set_pool(pool, ordinal, sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE)?;
    Ok(Some(flags))
}

fn set_pool(pool: sys::CUmemoryPool, ordinal: usize, flags: sys::CUmemAccess_flags) -> Result<()> {
    let desc = sys::CUmemAccessDesc { location: pool_location(ordinal), flags };
    // SAFETY: one descriptor, read by the driver during the call.
    check("cuMemPoolSetAccess", unsafe { api()?.cuMemPoolSetAccess(pool, &desc, 1) })
}

fn default_pool(ctx: &CudaContext) -> Result<Option<sys::CUmemoryPool>> {
    let api = api()?;
    let mut pools = 0;
    // SAFETY: writes one int for a valid device.
    check("cuDeviceGetAttribute", unsafe {
        api.cuDeviceGetAttribute(&mut pools, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, ctx.cu_device())
    })?;
    if pools == 0 {
        return Ok(None);
    }
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: writes one pool handle for a valid device.
    check("cuDeviceGetDefaultMemPool", unsafe { api.cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) })?;
    Ok(Some(pool))
}

/// What `cuCtxEnablePeerAccess` from device `from` to `to` returning `r`
/// means: whether this call enabled the access (`false`: it was already
/// enabled), or the error.
fn enabled(r: sys::CUresult, from: usize, to: usize) -> Result<bool> {
    use sys::CUresult as R;
    match r {
        R::CUDA_SUCCESS => Ok(true),
        R::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(false),
        R::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED => Err(Error::PeerUnsupported { from, to }),
        R::CUDA_ERROR_TOO_MANY_PEERS => Err(Error::TooManyPeers { from, to }),
        other => Err(Error::driver("cuCtxEnablePeerAccess", other.0)),
    }
}

impl PeerAccess {
    /// Lets `ctx` access `peer`'s memory (device memory and its default
    /// pool) until the returned guard and every other guard for the same
    /// pair are dropped.
    ///
    /// Errors: [`Error::SameDevice`], [`Error::PeerUnsupported`],
    /// [`Error::TooManyPeers`], or the driver's error.
    pub fn enable(ctx: &Arc<CudaContext>, peer: &Arc<CudaContext>) -> Result<PeerAccess> {
        Self::open(ctx, peer, false)
    }

    /// As [`Self::enable`], but when this guard is the last of the pair to
    /// be dropped, what the first guard enabled (peer access, pool access)
    /// is disabled again. Use it only
    /// where no other code can have started to rely on that access.
    pub fn enable_scoped(ctx: &Arc<CudaContext>, peer: &Arc<CudaContext>) -> Result<PeerAccess> {
        Self::open(ctx, peer, true)
    }

    fn open(ctx: &Arc<CudaContext>, peer: &Arc<CudaContext>, scoped: bool) -> Result<PeerAccess> {
        let (from, to) = (ctx.ordinal(), peer.ordinal());
        if from == to {
            return Err(Error::SameDevice(from));
        }
        let mut reg = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
        let k = key(ctx, peer);
        if let Some(e) = reg.get_mut(&k) {
            e.guards += 1;
            return Ok(PeerAccess { ctx: ctx.clone(), peer: peer.clone(), scoped });
        }
        let api = api()?;
        bind(ctx)?;
        // SAFETY: `ctx` is current; `peer` is a live context kept alive by its Arc.
        let r = unsafe { api.cuCtxEnablePeerAccess(raw_context(peer), 0) };
        let owns_ctx_access = enabled(r, from, to)?;
        let pool_restore = match default_pool(peer).and_then(|p| match p {
            Some(pool) => grant_pool(pool, from).map(|prev| prev.map(|f| (PoolHandle(pool), f))),
            None => Ok(None),
        }) {
            Ok(r) => r,
            Err(e) => {
                if owns_ctx_access {
                    // SAFETY: undoes the enable above, with `ctx` still current.
                    let _ = unsafe { api.cuCtxDisablePeerAccess(raw_context(peer)) };
                }
                return Err(e);
            }
        };
        log::debug!("peer access {from} -> {to} enabled (owned: {owns_ctx_access}, pool granted: {})", pool_restore.is_some());
        reg.insert(k, Entry { guards: 1, owns_ctx_access, pool_restore });
        Ok(PeerAccess { ctx: ctx.clone(), peer: peer.clone(), scoped })
    }

    /// The accessing context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The context whose memory is accessed.
    pub fn peer(&self) -> &Arc<CudaContext> {
        &self.peer
    }

    /// Whether this process currently holds a guard for `ctx -> peer`.
    pub fn is_held(ctx: &CudaContext, peer: &CudaContext) -> bool {
        REGISTRY.lock().unwrap_or_else(|p| p.into_inner()).contains_key(&key(ctx, peer))
    }
}

impl Drop for PeerAccess {
    fn drop(&mut self) {
        let mut reg = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
        let k = key(&self.ctx, &self.peer);
        let Some(e) = reg.get_mut(&k) else { return };
        e.guards -= 1;
        if e.guards > 0 {
            return;
        }
        let Some(e) = reg.remove(&k) else { return };
        if !self.scoped {
            log::debug!("peer access {} -> {} left enabled (last guard dropped)", self.ctx.ordinal(), self.peer.ordinal());
            return;
        }
        if let Some((pool, flags)) = e.pool_restore {
            if let Err(err) = set_pool(pool.0, self.ctx.ordinal(), flags) {
                log::warn!("restoring pool access {} -> {}: {err}", self.ctx.ordinal(), self.peer.ordinal());
            }
        }
        if e.owns_ctx_access {
            let disabled = api().and_then(|api| {
                bind(&self.ctx)?;
                // SAFETY: `ctx` is current and enabled access to `peer` itself (owns_ctx_access).
                check("cuCtxDisablePeerAccess", unsafe { api.cuCtxDisablePeerAccess(raw_context(&self.peer)) })
            });
            if let Err(err) = disabled {
                log::warn!("disabling peer access {} -> {}: {err}", self.ctx.ordinal(), self.peer.ordinal());
            }
        }
    }
}

/// Whether the driver says `from` can access `to`'s memory (a hint; see
/// [`crate::copy::Link`] for verified links).
pub fn can_access_peer(from: usize, to: usize) -> Result<bool> {
    Ok(crate::topology::link_info(from, to)?.can_access_peer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sys::CUresult as R;

    #[test]
    fn the_drivers_answers_to_enabling_peer_access_are_typed() {
        assert_eq!(enabled(R::CUDA_SUCCESS, 0, 1), Ok(true));
        assert_eq!(enabled(R::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, 0, 1), Ok(false));
        assert_eq!(enabled(R::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, 2, 3), Err(Error::PeerUnsupported { from: 2, to: 3 }));
        assert_eq!(enabled(R::CUDA_ERROR_TOO_MANY_PEERS, 3, 7), Err(Error::TooManyPeers { from: 3, to: 7 }));
        match enabled(R::CUDA_ERROR_INVALID_CONTEXT, 0, 1) {
            Err(Error::Driver { op, code, .. }) => assert_eq!((op, code), ("cuCtxEnablePeerAccess", R::CUDA_ERROR_INVALID_CONTEXT.0)),
            other => panic!("an other driver error: {other:?}"),
        }
    }
}
