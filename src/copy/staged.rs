//! Pinned host staging buffers for the device -> host -> device path, and
//! the check of their sizes ([`staging_shape`]) that every staged link and
//! route passes before anything is allocated.

use crate::driver::{api, bind, raw_stream};
use crate::error::{check, cudarc_err, Error, Result};
use crate::sync::is_capturing;
use cuda_peer_sys as sys;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use std::sync::{Arc, Mutex, PoisonError};

/// The most pinned staging buffers a link may have
/// ([`LinkOptions::staging_buffers`](super::LinkOptions::staging_buffers)).
pub const MAX_STAGING_BUFFERS: usize = 64;

/// The largest staging chunk, in bytes ([`LinkOptions::staging_chunk_bytes`](super::LinkOptions::staging_chunk_bytes)).
pub const MAX_STAGING_CHUNK_BYTES: usize = 1 << 30;

/// The most pinned host memory, in bytes, one link's staging buffers may
/// hold together ([`LinkOptions::staging_buffers`](super::LinkOptions::staging_buffers) times
/// [`LinkOptions::staging_chunk_bytes`](super::LinkOptions::staging_chunk_bytes)).
pub const MAX_STAGING_BYTES: u64 = 16 << 30;

/// The fewest pinned staging buffers a link has: smaller counts count as this.
pub(crate) const MIN_STAGING_BUFFERS: usize = 2;

/// The smallest staging chunk, in bytes: smaller sizes count as this.
pub(crate) const MIN_STAGING_CHUNK_BYTES: usize = 4096;

/// The staging buffers (count) and chunk bytes a link of `chunk_bytes` and
/// `buffers` (its [`LinkOptions`](super::LinkOptions) fields) allocates:
/// each raised to its minimum, or [`Error::InvalidArgument`] where one is
/// above its maximum ([`MAX_STAGING_BUFFERS`],
/// [`MAX_STAGING_CHUNK_BYTES`]) or the two together would pin more
/// than [`MAX_STAGING_BYTES`]. Pure: no allocation, no driver call.
pub(crate) fn staging_shape(chunk_bytes: usize, buffers: usize) -> Result<(usize, usize)> {
    if buffers > MAX_STAGING_BUFFERS {
        return Err(Error::InvalidArgument(format!(
            "LinkOptions::staging_buffers = {buffers}: a link has at most {} pinned staging buffers",
            MAX_STAGING_BUFFERS
        )));
    }
    if chunk_bytes > MAX_STAGING_CHUNK_BYTES {
        return Err(Error::InvalidArgument(format!(
            "LinkOptions::staging_chunk_bytes = {chunk_bytes}: a staging chunk has at most {} bytes",
            MAX_STAGING_CHUNK_BYTES
        )));
    }
    let (buffers, chunk_bytes) = (buffers.max(MIN_STAGING_BUFFERS), chunk_bytes.max(MIN_STAGING_CHUNK_BYTES));
    // Both are bounded above, so the product fits in a u64.
    let total = buffers as u64 * chunk_bytes as u64;
    if total > MAX_STAGING_BYTES {
        return Err(Error::InvalidArgument(format!(
            "LinkOptions: {buffers} staging buffers of {chunk_bytes} bytes would pin {total} bytes of host memory per link, more than {}",
            MAX_STAGING_BYTES
        )));
    }
    Ok((buffers, chunk_bytes))
}

/// One page-locked host buffer, portable to every context; freed on drop.
#[derive(Debug)]
pub(crate) struct PinnedBuffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain host memory owned by this value; the driver
// allows any thread to use or free it.
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared references hand out only the address, never a Rust reference
// into the memory.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    pub(crate) fn new(ctx: &CudaContext, len: usize) -> Result<Self> {
        Self::alloc(ctx, len, sys::CU_MEMHOSTALLOC_PORTABLE)
    }

    /// A buffer that kernels of every context can also read and write
    /// directly (mapped), zero-filled.
    pub(crate) fn new_mapped(ctx: &CudaContext, len: usize) -> Result<Self> {
        let b = Self::alloc(ctx, len, sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP)?;
        // SAFETY: the buffer holds `len` bytes (at least 1 allocated), owned by
        // `b`, and no copy or kernel uses it yet.
        unsafe { std::ptr::write_bytes(b.ptr, 0, len) };
        Ok(b)
    }

    fn alloc(ctx: &CudaContext, len: usize, flags: u32) -> Result<Self> {
        bind(ctx)?;
        let mut ptr: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: allocates `len` bytes of page-locked memory and writes its address.
        check("cuMemHostAlloc", unsafe { api()?.cuMemHostAlloc(&mut ptr, len.max(1), flags) })?;
        Ok(PinnedBuffer { ptr: ptr.cast(), len })
    }

    /// The address kernels of `ctx` use for a buffer made by [`Self::new_mapped`].
    pub(crate) fn device_addr(&self, ctx: &CudaContext) -> Result<u64> {
        bind(ctx)?;
        let mut dptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a mapped, portable page-locked allocation alive for
        // the call; the driver writes one device address.
        check("cuMemHostGetDevicePointer", unsafe { api()?.cuMemHostGetDevicePointer_v2(&mut dptr, self.ptr.cast(), 0) })?;
        Ok(dptr)
    }

    pub(crate) fn addr(&self) -> *mut u8 {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if let Ok(api) = api() {
            // SAFETY: `ptr` came from cuMemHostAlloc and is freed once. Every
            // copy through it was ordered before the Staging's final sync.
            let r = unsafe { api.cuMemFreeHost(self.ptr.cast()) };
            if r != sys::CUresult::CUDA_SUCCESS {
                log::warn!("cuMemFreeHost: {}", crate::error::Error::driver("cuMemFreeHost", r.0));
            }
        }
    }
}

/// How a pinned buffer was last filled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LastUse {
    /// Never: nothing to wait for.
    Never,
    /// By an eager transfer: its consumer recorded `h2d_done`, which a later
    /// eager transfer may wait for.
    Eager,
    /// Under a CUDA graph capture: its `h2d_done` record belongs to a graph,
    /// and an eager stream may not wait for it.
    Captured,
}

/// Which buffer the next transfer starts with, and how each was last used.
#[derive(Debug)]
struct Rotation {
    next: usize,
    last: Vec<LastUse>,
}

/// Whether the staging stream must wait for all earlier work on the
/// destination stream before a transfer's first device-to-host copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Start {
    /// The caller has ordered the staging stream after the source's writers
    /// itself; the transfer waits only for each buffer's last consumer.
    Ordered,
    /// The source's writers are ordered through the destination stream
    /// (no event tracking): wait for everything on it first.
    AfterStream,
}

/// The staging resources of one directed link: pinned buffers, the source
/// side's stream, and the events that hand each buffer back and forth.
#[derive(Debug)]
pub(crate) struct Staging {
    pub(crate) buffers: Vec<PinnedBuffer>,
    pub(crate) chunk_bytes: usize,
    /// Device-to-host copies run here (source context).
    pub(crate) d2h: Arc<CudaStream>,
    /// `d2h_done[b]`: buffer b holds a chunk (source context).
    pub(crate) d2h_done: Vec<CudaEvent>,
    /// `h2d_done[b]`: buffer b is free again (destination context).
    pub(crate) h2d_done: Vec<CudaEvent>,
    /// Recorded on the destination stream when a transfer must wait for it (destination context).
    start: CudaEvent,
    /// Buffers go round-robin across transfers too, so a transfer's first
    /// chunks take the buffers its predecessor freed first.
    rotation: Mutex<Rotation>,
}

impl Staging {
    /// The staging of `src -> dst`: `buffers` pinned buffers of
    /// `chunk_bytes` each, as [`staging_shape`] checks and adjusts them.
    pub(crate) fn new(src: &Arc<CudaContext>, dst: &Arc<CudaContext>, chunk_bytes: usize, buffers: usize) -> Result<Self> {
        let (buffers, chunk_bytes) = staging_shape(chunk_bytes, buffers)?;
        let d2h = src.new_stream().map_err(cudarc_err("cuStreamCreate"))?;
        let start = dst.new_event(None).map_err(cudarc_err("cuEventCreate"))?;
        let rotation = Mutex::new(Rotation { next: 0, last: vec![LastUse::Never; buffers] });
        let mut s = Staging { buffers: Vec::new(), chunk_bytes, d2h, d2h_done: Vec::new(), h2d_done: Vec::new(), start, rotation };
        for _ in 0..buffers {
            s.buffers.push(PinnedBuffer::new(src, chunk_bytes)?);
            s.d2h_done.push(src.new_event(None).map_err(cudarc_err("cuEventCreate"))?);
            s.h2d_done.push(dst.new_event(None).map_err(cudarc_err("cuEventCreate"))?);
        }
        Ok(s)
    }

    /// Enqueues the staged copy of `bytes` bytes from device address `src`
    /// (source context) to `dst` (destination context). Device-to-host
    /// copies run on the staging stream, host-to-device copies on `stream`;
    /// chunk k+1 leaves the source while chunk k enters the destination.
    ///
    /// The caller has ordered `stream` after the destination's users, and
    /// the staging stream after the source's writers or, with
    /// [`Start::AfterStream`], `stream` after them.
    pub(crate) fn copy(&self, dst: u64, src: u64, bytes: usize, stream: &CudaStream, start: Start) -> Result<()> {
        let h2d_raw = raw_stream(stream);
        self.transfer(src, bytes, stream, start, |host, offset, len| {
            // SAFETY: `dst + offset .. + len` lies in the destination (the
            // caller checked lengths); the pinned chunk holds `len` bytes
            // filled by the copy that `stream` now waits for.
            check("cuMemcpyHtoDAsync", unsafe { api()?.cuMemcpyHtoDAsync_v2(dst + offset as u64, host.cast(), len, h2d_raw) })
        })
    }

    /// Moves `bytes` bytes from device address `src` (source context) into
    /// the pinned buffers chunk by chunk; for each chunk, `on_chunk(host,
    /// offset, len)` enqueues on `stream` (destination context) whatever
    /// consumes it (a host-to-device copy, then perhaps a kernel). The
    /// device-to-host copy of chunk k+1 overlaps `on_chunk`'s work for chunk k,
    /// and a transfer's first chunks overlap the previous transfer's last.
    pub(crate) fn transfer(
        &self,
        src: u64,
        bytes: usize,
        stream: &CudaStream,
        start: Start,
        mut on_chunk: impl FnMut(*const u8, usize, usize) -> Result<()>,
    ) -> Result<()> {
        let api = api()?;
        let d2h_raw = raw_stream(&self.d2h);
        let capturing = is_capturing(stream)?;
        let mut rot = self.rotation.lock().unwrap_or_else(PoisonError::into_inner);
        let n = self.buffers.len();
        // A buffer is free once the consumer of its last chunk is done, and
        // that consumer recorded the buffer's h2d_done, on whichever stream it
        // ran. An eager transfer waits for exactly that, so it needs nothing
        // else from the destination stream and its first chunks leave the
        // source while the previous transfer's last ones still arrive.
        // Under a capture, waiting for an event recorded outside it crosses
        // the capture's boundary (the driver refuses); and an eager stream
        // may not wait for an event recorded under one. Then the staging
        // stream waits for the whole destination stream instead, as it does
        // when the caller orders the source's writers through that stream.
        let whole_stream = capturing || start == Start::AfterStream || rot.last.contains(&LastUse::Captured);
        if whole_stream {
            self.start.record(stream).map_err(cudarc_err("cuEventRecord"))?;
            self.d2h.wait(&self.start).map_err(cudarc_err("cuStreamWaitEvent"))?;
        }
        let mut ordered = vec![false; n];
        let first = rot.next;
        let mut chunks = 0;
        for c in super::plan::plan(bytes, self.chunk_bytes, n) {
            let b = (first + c.buffer) % n;
            let buf = &self.buffers[b];
            debug_assert!(c.len <= buf.len());
            // Within a transfer, a buffer's earlier consumer is always
            // waited for; across transfers only eagerly (see above).
            let wait = if std::mem::replace(&mut ordered[b], true) { true } else { !capturing && rot.last[b] == LastUse::Eager };
            if wait {
                self.d2h.wait(&self.h2d_done[b]).map_err(cudarc_err("cuStreamWaitEvent"))?;
            }
            rot.last[b] = if capturing { LastUse::Captured } else { LastUse::Eager };
            bind(self.d2h.context())?;
            // SAFETY: `src + offset .. + len` lies in the source allocation
            // (the caller checked lengths); the pinned buffer holds `len`
            // bytes and no other copy uses it until h2d_done/d2h_done say so.
            check("cuMemcpyDtoHAsync", unsafe { api.cuMemcpyDtoHAsync_v2(buf.addr().cast(), src + c.offset as u64, c.len, d2h_raw) })?;
            self.d2h_done[b].record(&self.d2h).map_err(cudarc_err("cuEventRecord"))?;
            stream.wait(&self.d2h_done[b]).map_err(cudarc_err("cuStreamWaitEvent"))?;
            bind(stream.context())?;
            on_chunk(buf.addr(), c.offset, c.len)?;
            self.h2d_done[b].record(stream).map_err(cudarc_err("cuEventRecord"))?;
            chunks += 1;
        }
        rot.next = (first + chunks) % n;
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // The pinned buffers are freed after this; no copy may still use them.
        if let Err(e) = self.d2h.synchronize() {
            log::warn!("staging stream sync on drop: {e:?}");
        }
        // An event last recorded under a CUDA graph capture cannot be
        // waited on (the driver refuses; a graph replaying this transfer may
        // still run): wait for the whole destination context instead, once.
        // Buffers never used have nothing to wait for.
        let last = self.rotation.get_mut().unwrap_or_else(PoisonError::into_inner).last.clone();
        let mut context_synced = false;
        for (e, last) in self.h2d_done.iter().zip(last) {
            let r = match last {
                LastUse::Never => Ok(()),
                // A transfer that failed part way may have left an older
                // (captured) record in the event: then the context.
                LastUse::Eager => e.synchronize().or_else(|_| e.context().synchronize()),
                LastUse::Captured if context_synced => Ok(()),
                LastUse::Captured => {
                    context_synced = true;
                    e.context().synchronize()
                }
            };
            if let Err(err) = r {
                log::warn!("staging event sync on drop: {err:?}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::copy::{MAX_STAGING_BUFFERS, MAX_STAGING_BYTES, MAX_STAGING_CHUNK_BYTES};

    #[test]
    fn staging_shapes_are_checked_before_anything_is_allocated() {
        assert_eq!(staging_shape(4 << 20, 3).unwrap(), (3, 4 << 20));
        assert_eq!(staging_shape(0, 0).unwrap(), (MIN_STAGING_BUFFERS, MIN_STAGING_CHUNK_BYTES), "small values are raised");
        assert_eq!(staging_shape(1, 1).unwrap(), (2, 4096));
        assert_eq!(staging_shape(MAX_STAGING_CHUNK_BYTES, 2).unwrap(), (2, MAX_STAGING_CHUNK_BYTES));
        assert_eq!(staging_shape(4096, MAX_STAGING_BUFFERS).unwrap(), (MAX_STAGING_BUFFERS, 4096));
        let too_many = [
            (4 << 20, MAX_STAGING_BUFFERS + 1, "staging_buffers"),
            (4 << 20, 1 << 40, "staging_buffers"),
            (4 << 20, usize::MAX, "staging_buffers"),
            (MAX_STAGING_CHUNK_BYTES + 1, 3, "staging_chunk_bytes"),
            (usize::MAX, 3, "staging_chunk_bytes"),
            (usize::MAX, usize::MAX, "staging_buffers"),
            (MAX_STAGING_CHUNK_BYTES, MAX_STAGING_BUFFERS, "would pin"),
        ];
        for (chunk, buffers, says) in too_many {
            match staging_shape(chunk, buffers) {
                Err(Error::InvalidArgument(m)) => assert!(m.contains(says), "{chunk} x {buffers}: {m}"),
                other => panic!("{chunk} x {buffers}: {other:?}"),
            }
        }
        let at_most = usize::try_from(MAX_STAGING_BYTES / MAX_STAGING_CHUNK_BYTES as u64).unwrap();
        assert!(staging_shape(MAX_STAGING_CHUNK_BYTES, at_most).is_ok());
        assert!(staging_shape(MAX_STAGING_CHUNK_BYTES, at_most + 1).is_err());
    }
}
