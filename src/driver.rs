//! The driver: loading it, device enumeration, and cudarc contexts created
//! only once the driver is known to load (cudarc panics when it cannot find
//! libcuda; this module asks first, so the caller gets an [`Error`]).
//!
//! It is also the crate's one FFI layer: every driver call goes through
//! [`api`] (cuda-peer-sys) and `error::check`, and the handles that cudarc
//! hands out are converted to cuda-peer-sys's here and nowhere else
//! (`raw_*`: the same C types, from two bindgen outputs).

use crate::error::{check, cudarc_err, Error, Result};
use cuda_peer_sys as sys;
use cudarc::driver::{sys as cusys, CudaContext, CudaEvent, CudaStream};
use once_cell::sync::OnceCell;
use std::sync::Arc;

static INIT: OnceCell<Result<(), Error>> = OnceCell::new();

/// The loaded and initialised driver API. Every other function in the crate
/// goes through this, so it is the one place where a missing driver becomes
/// an error. (The raw driver table: for the crate's own tools and tests.)
#[doc(hidden)]
pub fn api() -> Result<&'static sys::DriverApi> {
    let api = sys::driver()?;
    INIT.get_or_init(|| {
        // SAFETY: cuInit takes flags (must be 0) and may be called any number of times.
        check("cuInit", unsafe { api.cuInit(0) })
    })
    .clone()?;
    Ok(api)
}

/// Whether the driver loads and initialises, without failing.
pub fn is_available() -> bool {
    api().is_ok()
}

/// The driver's CUDA version, e.g. `12080` for 12.8.
pub fn driver_version() -> Result<i32> {
    let api = api()?;
    let mut v = 0;
    // SAFETY: writes one int.
    check("cuDriverGetVersion", unsafe { api.cuDriverGetVersion(&mut v) })?;
    Ok(v)
}

/// How many CUDA devices the driver reports (0 is not an error here).
pub fn device_count() -> Result<usize> {
    let api = api()?;
    let mut n = 0;
    // SAFETY: writes one int.
    check("cuDeviceGetCount", unsafe { api.cuDeviceGetCount(&mut n) })?;
    Ok(n.max(0) as usize)
}

/// Checks that `ordinal` names an existing device and returns its handle.
pub(crate) fn device(ordinal: usize) -> Result<sys::CUdevice> {
    let count = device_count()?;
    if count == 0 {
        return Err(Error::NoDevice);
    }
    if ordinal >= count {
        return Err(Error::DeviceOutOfRange { ordinal, count });
    }
    let api = api()?;
    let mut dev = 0;
    // SAFETY: writes one CUdevice; the ordinal was range-checked above.
    check("cuDeviceGet", unsafe { api.cuDeviceGet(&mut dev, ordinal as i32) })?;
    Ok(dev)
}

/// The primary context of device `ordinal`, as a cudarc context, or an error
/// if there is no driver, no device, or no such device.
pub fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    device(ordinal)?;
    CudaContext::new(ordinal).map_err(cudarc_err("cuDevicePrimaryCtxRetain"))
}

/// Contexts for every device, in order. Errors with [`Error::NoDevice`] when
/// there is none.
pub fn all_contexts() -> Result<Vec<Arc<CudaContext>>> {
    let n = device_count()?;
    if n == 0 {
        return Err(Error::NoDevice);
    }
    (0..n).map(context).collect()
}

/// Free and total device memory of `ctx`'s device, in bytes (cuMemGetInfo).
pub fn mem_info(ctx: &CudaContext) -> Result<(usize, usize)> {
    ctx.mem_get_info().map_err(cudarc_err("cuMemGetInfo"))
}

/// The multiprocessors of `ctx`'s device (at least 1).
pub(crate) fn multiprocessors(ctx: &CudaContext) -> Result<u32> {
    let sms = ctx
        .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(crate::error::cudarc_err("cuDeviceGetAttribute (multiprocessors)"))?;
    Ok(sms.max(1) as u32)
}

/// Makes `ctx` current on this thread.
pub(crate) fn bind(ctx: &CudaContext) -> Result<()> {
    ctx.bind_to_thread().map_err(cudarc_err("cuCtxSetCurrent"))
}

/// `stream`'s handle, for cuda-peer-sys calls.
pub(crate) fn raw_stream(stream: &CudaStream) -> sys::CUstream {
    raw_stream_of(stream.cu_stream())
}

/// A cudarc stream handle (as [`crate::raw::RawStream`] holds), for
/// cuda-peer-sys calls.
pub(crate) fn raw_stream_of(stream: cusys::CUstream) -> sys::CUstream {
    stream as sys::CUstream
}

/// `ctx`'s handle, for cuda-peer-sys calls.
pub(crate) fn raw_context(ctx: &CudaContext) -> sys::CUcontext {
    ctx.cu_ctx() as sys::CUcontext
}

/// `event`'s handle, for cuda-peer-sys calls.
pub(crate) fn raw_event(event: &CudaEvent) -> sys::CUevent {
    event.cu_event() as sys::CUevent
}

/// Records `event` on `stream` (`cuEventRecord`), the error named `op`.
///
/// # Safety
///
/// `event` and `stream` are live handles of the current context (or
/// `stream` is null, the current context's legacy default stream).
pub(crate) unsafe fn event_record(op: &'static str, event: sys::CUevent, stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's contract.
    check(op, unsafe { api()?.cuEventRecord(event, stream) })
}

/// Makes `stream` wait for `event` (`cuStreamWaitEvent`), the error named `op`.
///
/// # Safety
///
/// As for [`event_record`].
pub(crate) unsafe fn stream_wait_event(op: &'static str, stream: sys::CUstream, event: sys::CUevent) -> Result<()> {
    // SAFETY: the caller's contract; flags 0 is CU_EVENT_WAIT_DEFAULT.
    check(op, unsafe { api()?.cuStreamWaitEvent(stream, event, 0) })
}

/// The context of `stream` (`cuStreamGetCtx`), the error named `op`.
///
/// # Safety
///
/// `stream` is a live stream, or null (the current context's).
pub(crate) unsafe fn stream_context(op: &'static str, stream: cusys::CUstream) -> Result<sys::CUcontext> {
    let mut got: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: writes one context handle; the caller's contract for `stream`.
    check(op, unsafe { api()?.cuStreamGetCtx(raw_stream_of(stream), &mut got) })?;
    Ok(got)
}

/// Page-locks `len` bytes at `ptr` and maps them for every context
/// (`cuMemHostRegister`, portable and device-mapped), the error named `op`.
///
/// # Safety
///
/// `ptr` is a live, page-aligned mapping of `len` bytes that stays mapped
/// until [`host_unregister`] undoes this; a context is current.
pub(crate) unsafe fn host_register(op: &'static str, ptr: *mut std::ffi::c_void, len: usize) -> Result<()> {
    let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
    // SAFETY: the caller's contract.
    check(op, unsafe { api()?.cuMemHostRegister_v2(ptr, len, flags) })
}

/// Undoes [`host_register`] (`cuMemHostUnregister`), the error named `op`.
///
/// # Safety
///
/// `ptr` was registered by [`host_register`] and no device work uses it.
pub(crate) unsafe fn host_unregister(op: &'static str, ptr: *mut std::ffi::c_void) -> Result<()> {
    // SAFETY: the caller's contract.
    check(op, unsafe { api()?.cuMemHostUnregister(ptr) })
}

/// Work in progress on a thread of the library's that calls CUDA or NCCL
/// (a graph's release, an NCCL communicator's creation or abort), held for
/// as long as it runs: the process's exit waits for every such work, for at
/// most [`EXIT_WAIT`], so that `exit` does not tear CUDA down under it (on
/// the H200 a child process that had passed its test died of a signal at
/// exit, with the library's graph release thread aborting an NCCL
/// communicator, and once with an NCCL initialisation left running after
/// its timeout). Exit handlers run in the reverse order of their
/// registration: the wait is registered with the first `Busy`, and again
/// after the first NCCL communicator is made ([`wait_after_the_runtime`]),
/// since NCCL may start the CUDA runtime, and its exit handlers, later. An
/// initialisation that never ends (a peer that never arrives) is waited for
/// only until [`EXIT_WAIT`].
pub(crate) struct Busy(());

/// Work that a [`Busy`] holds.
static BUSY: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How long the process's exit waits for [`Busy`] work.
const EXIT_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

impl Busy {
    /// Counts one work in progress until the `Busy` is dropped.
    pub(crate) fn start() -> Busy {
        static FIRST: std::sync::Once = std::sync::Once::new();
        FIRST.call_once(register_exit_wait);
        BUSY.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Busy(())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        BUSY.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Run by `exit`: waits, for at most [`EXIT_WAIT`], until no [`Busy`] is held.
extern "C" fn wait_for_busy_at_exit() {
    let start = std::time::Instant::now();
    while BUSY.load(std::sync::atomic::Ordering::SeqCst) > 0 && start.elapsed() < EXIT_WAIT {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// Registers [`wait_for_busy_at_exit`] with `exit`.
fn register_exit_wait() {
    // SAFETY: registers a function that takes no argument, touches only an
    // atomic and sleeps, and never unwinds.
    #[cfg(target_os = "linux")]
    if unsafe { libc::atexit(wait_for_busy_at_exit) } != 0 {
        log::warn!("cuda-peer: cannot register the wait for the library's threads at exit");
    }
}

/// Registers the exit wait of [`Busy`] again (once), to run before the exit
/// handlers of the CUDA runtime, which NCCL has started by now: called
/// after the first NCCL communicator is made.
pub(crate) fn wait_after_the_runtime() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(register_exit_wait);
}
