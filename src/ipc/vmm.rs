//! Device memory that another process can map: a region allocated with
//! the driver's virtual memory management calls (`cuMemCreate` with a POSIX
//! file descriptor handle type, pinned on one device), reserved and mapped
//! into this process, exported as a file descriptor, and imported by a
//! peer process that maps it and grants its own device access.
//!
//! Sizes are checked arithmetic: a request that cannot be rounded up to the
//! granularity, and a size a peer claims for its region that is zero or not
//! a multiple of the granularity, are [`Error::InvalidArgument`] (before
//! anything is allocated or imported).
//!
//! Multicast objects are never used here (they can take shared GPUs out of
//! service): only plain allocations, mapped one device at a time.

use crate::driver::{api, bind};
use crate::error::{check, Error, Result};
use cuda_peer_sys as sys;
use cudarc::driver::{CudaContext, CudaStream};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;

/// A region of device memory mapped into this process through the driver's
/// virtual memory management, either allocated here (shareable with other
/// processes through [`Self::export_fd`]) or imported from another process
/// ([`Self::import`]). Unmapped, its address range freed and its handle
/// released on drop (the memory itself is freed once every process that
/// maps it has released it).
#[derive(Debug)]
pub struct DeviceRegion {
    ctx: Arc<CudaContext>,
    handle: sys::CUmemGenericAllocationHandle,
    ptr: sys::CUdeviceptr,
    size: usize,
    /// Whether `ptr..ptr + size` is mapped (else only reserved).
    mapped: bool,
    /// Allocated here (not imported).
    local: bool,
}

fn location(ordinal: usize) -> sys::CUmemLocation {
    sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal as i32 }
}

fn properties(ordinal: usize) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        location: location(ordinal),
        ..Default::default()
    }
}

fn attribute(ctx: &CudaContext, attr: sys::CUdevice_attribute) -> Result<i32> {
    let mut v = 0;
    // SAFETY: writes one int for a valid device handle.
    check("cuDeviceGetAttribute", unsafe { api()?.cuDeviceGetAttribute(&mut v, attr, ctx.cu_device()) })?;
    Ok(v)
}

/// Whether `ctx`'s device supports shareable VMM allocations (virtual
/// memory management and POSIX file descriptor handles).
pub fn supported(ctx: &CudaContext) -> Result<bool> {
    let vmm = attribute(ctx, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)?;
    let fd = attribute(ctx, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)?;
    Ok(vmm != 0 && fd != 0)
}

/// The allocation granularity of a shareable region on `ctx`'s device:
/// sizes are rounded up to a multiple of it.
pub fn granularity(ctx: &CudaContext) -> Result<usize> {
    let prop = properties(ctx.ordinal());
    let mut g = 0usize;
    // SAFETY: reads `prop` and writes one size_t during the call.
    check("cuMemGetAllocationGranularity", unsafe {
        api()?.cuMemGetAllocationGranularity(&mut g, &prop, sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM)
    })?;
    if g == 0 {
        return Err(Error::Internal("cuMemGetAllocationGranularity returned 0".into()));
    }
    Ok(g)
}

/// The size of a region of at least `bytes` on a device of granularity
/// `granularity`: rounded up to a multiple of it (at least one granule).
pub(crate) fn allocation_size(bytes: usize, granularity: usize) -> Result<usize> {
    bytes
        .max(1)
        .checked_next_multiple_of(granularity)
        .ok_or_else(|| Error::InvalidArgument(format!("a region of {bytes} bytes (granularity {granularity})")))
}

/// Checks the size another process claims for the region it exports:
/// nonzero and a multiple of `granularity`.
pub(crate) fn check_imported_size(size: usize, granularity: usize) -> Result<()> {
    if size == 0 || granularity == 0 || !size.is_multiple_of(granularity) {
        return Err(Error::InvalidArgument(format!("imported region of {size} bytes, not a multiple of the granularity {granularity}")));
    }
    Ok(())
}

impl DeviceRegion {
    /// Allocates at least `bytes` (rounded up to [`granularity`]) on
    /// `ctx`'s device, shareable through a file descriptor, and maps it
    /// read-write for that device. The contents are undefined
    /// ([`Self::zero`]). [`Error::InvalidArgument`] where `bytes` cannot
    /// be rounded up.
    pub fn allocate(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DeviceRegion> {
        bind(ctx)?;
        if !supported(ctx)? {
            return Err(Error::Unsupported(format!("device {} has no virtual memory management with POSIX file descriptor handles", ctx.ordinal())));
        }
        let g = granularity(ctx)?;
        let size = allocation_size(bytes, g)?;
        let prop = properties(ctx.ordinal());
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: reads `prop` and writes one handle; flags must be 0.
        check("cuMemCreate", unsafe { api()?.cuMemCreate(&mut handle, size, &prop, 0) })?;
        Self::map(ctx, handle, size, g, true)
    }

    /// Imports the region exported by another process as `fd`
    /// ([`Self::export_fd`] there) of `size` bytes (its [`Self::len`]
    /// there), maps it into this process and grants `ctx`'s device
    /// read-write access to it. The descriptor may be closed afterwards.
    /// `ctx`'s device must be able to access the exporting device's
    /// memory (P2P), or the driver refuses. A `size` that is zero or not a
    /// multiple of the granularity is [`Error::InvalidArgument`], before
    /// anything is imported.
    pub fn import(ctx: &Arc<CudaContext>, fd: BorrowedFd<'_>, size: usize) -> Result<DeviceRegion> {
        bind(ctx)?;
        let g = granularity(ctx)?;
        check_imported_size(size, g)?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: for POSIX file descriptor handles the OS handle argument
        // is the descriptor's value cast to a pointer (CUDA driver API docs);
        // `fd` is open for the duration of the call. Writes one handle.
        check("cuMemImportFromShareableHandle", unsafe {
            api()?.cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        Self::map(ctx, handle, size, g, false)
    }

    /// Reserves an address range for `handle`, maps it and grants `ctx`'s
    /// device access; releases what it made on failure (and `handle`).
    fn map(ctx: &Arc<CudaContext>, handle: sys::CUmemGenericAllocationHandle, size: usize, align: usize, local: bool) -> Result<DeviceRegion> {
        // From here on, Drop undoes whatever was done.
        let mut region = DeviceRegion { ctx: ctx.clone(), handle, ptr: 0, size, mapped: false, local };
        let api = api()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: writes one address; no fixed address asked (0), flags 0.
        check("cuMemAddressReserve", unsafe { api.cuMemAddressReserve(&mut ptr, size, align, 0, 0) })?;
        region.ptr = ptr;
        // SAFETY: maps the whole of `handle` (offset 0, its size) onto the
        // range just reserved for it; flags 0.
        check("cuMemMap", unsafe { api.cuMemMap(ptr, size, 0, handle, 0) })?;
        region.mapped = true;
        let desc = sys::CUmemAccessDesc { location: location(ctx.ordinal()), flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
        // SAFETY: one descriptor for the mapped range, read during the call.
        check("cuMemSetAccess", unsafe { api.cuMemSetAccess(ptr, size, &desc, 1) })?;
        Ok(region)
    }

    /// A file descriptor for this region that another process can import
    /// ([`Self::import`]), e.g. after passing it over a Unix socket. Only
    /// for regions allocated in this process.
    pub fn export_fd(&self) -> Result<OwnedFd> {
        if !self.local {
            return Err(Error::InvalidArgument("an imported region cannot be exported again".into()));
        }
        bind(&self.ctx)?;
        let mut fd: std::os::raw::c_int = -1;
        // SAFETY: for POSIX file descriptor handles the driver writes one int
        // (a new descriptor owned by the caller) through the pointer.
        check("cuMemExportToShareableHandle", unsafe {
            api()?.cuMemExportToShareableHandle(
                (&mut fd as *mut std::os::raw::c_int).cast(),
                self.handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        if fd < 0 {
            return Err(Error::Internal(format!("cuMemExportToShareableHandle returned descriptor {fd}")));
        }
        // SAFETY: the driver made a new descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Sets every byte to 0, on `stream` (of this region's device), and
    /// waits for it.
    pub fn zero(&self, stream: &CudaStream) -> Result<()> {
        bind(&self.ctx)?;
        // SAFETY: the range is mapped and writable from this device, and
        // `stream` belongs to a context of it (the caller's contract, checked
        // by the driver).
        check("cuMemsetD8Async", unsafe { api()?.cuMemsetD8Async(self.ptr, 0, self.size, crate::driver::raw_stream(stream)) })?;
        stream.synchronize().map_err(crate::error::cudarc_err("cuStreamSynchronize"))
    }

    /// The region's device address in this process.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Its size in bytes (a multiple of the granularity).
    pub fn len(&self) -> usize {
        self.size
    }

    /// Never: a region has at least one granule.
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }
}

impl Drop for DeviceRegion {
    fn drop(&mut self) {
        let Ok(api) = api() else { return };
        if bind(&self.ctx).is_err() {
            log::warn!("cuda-peer: cannot bind the context to free a VMM region; leaking it");
            return;
        }
        // SAFETY: each call undoes one step of `map`/`allocate`/`import`
        // that succeeded, in reverse order, once. Work that uses the region
        // must be complete (the owners synchronize before dropping it).
        unsafe {
            if self.mapped {
                let _ = check("cuMemUnmap", api.cuMemUnmap(self.ptr, self.size));
            }
            if self.ptr != 0 {
                let _ = check("cuMemAddressFree", api.cuMemAddressFree(self.ptr, self.size));
            }
            let _ = check("cuMemRelease", api.cuMemRelease(self.handle));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_sizes_round_up_and_huge_ones_are_invalid_arguments() {
        let g = 2 << 20;
        assert_eq!(allocation_size(0, g).unwrap(), g);
        assert_eq!(allocation_size(1, g).unwrap(), g);
        assert_eq!(allocation_size(g, g).unwrap(), g);
        assert_eq!(allocation_size(g + 1, g).unwrap(), 2 * g);
        assert!(matches!(allocation_size(usize::MAX, g), Err(Error::InvalidArgument(_))));
        assert!(matches!(allocation_size(usize::MAX - g + 2, g), Err(Error::InvalidArgument(_))));
        assert!(matches!(allocation_size(5, 0), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn a_claimed_import_size_must_be_whole_granules() {
        let g = 2 << 20;
        assert!(check_imported_size(g, g).is_ok());
        assert!(check_imported_size(3 * g, g).is_ok());
        for bad in [0, 1, g - 1, g + 1, usize::MAX] {
            assert!(matches!(check_imported_size(bad, g), Err(Error::InvalidArgument(_))), "{bad}");
        }
        assert!(matches!(check_imported_size(g, 0), Err(Error::InvalidArgument(_))));
    }
}
