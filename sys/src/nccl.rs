//! Raw FFI to the few NCCL calls cuda-peer uses between hosts, and the
//! loader that finds `libnccl` at run time.
//!
//! Written by hand from `nccl.h` rather than generated: the calls and types
//! here have kept one ABI through NCCL 2.x (an opaque communicator pointer,
//! a 128-byte unique id, C enums for results, data types and ops), so one
//! table serves every NCCL 2 a user has installed, and nothing is chosen at
//! build time. cudarc's `nccl` module is not used for this: its bindings are
//! picked by a cargo feature per NCCL version (a library would impose one on
//! the application, and framework crates enable their own), it links
//! `libnccl` under `dynamic-linking`, looks only for `libnccl.so` (a
//! runtime-only install has just `libnccl.so.2`), and panics when the
//! library is missing or an abort fails in `Drop`.
//!
//! # Safety
//!
//! Every [`NcclApi`] field is the NCCL entry point of the same name, resolved
//! at load time. Calling one is sound exactly when NCCL's documented
//! contract for that function holds: a live communicator, device pointers
//! valid for `count` elements of the data type on the communicator's
//! device, a stream of that device's current context, and, for the
//! collectives, every rank calling the same collective in the same order;
//! for `ncclSend`/`ncclRecv`, each send matched by the peer's receive of
//! the same size, in the same order, and every call between
//! `ncclGroupStart` and `ncclGroupEnd` made on the thread that opened the
//! group.

use crate::LoadError;
use std::os::raw::{c_char, c_int, c_void};

/// `ncclResult_t`.
pub type NcclResult = c_int;
/// `ncclSuccess`.
pub const NCCL_SUCCESS: NcclResult = 0;
/// `ncclInProgress` (non-blocking communicators only; cuda-peer's are blocking).
pub const NCCL_IN_PROGRESS: NcclResult = 7;

/// `ncclComm_t`: an opaque communicator.
pub type NcclComm = *mut c_void;

/// `ncclUniqueId`: what rank 0 makes and every rank passes to
/// `ncclCommInitRank`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct NcclUniqueId {
    /// The id's bytes, opaque.
    pub internal: [c_char; 128],
}

/// `ncclDataType_t` values (stable since NCCL 2.10, which added bf16).
pub mod dtype {
    use std::os::raw::c_int;
    /// `ncclInt8`
    pub const INT8: c_int = 0;
    /// `ncclUint8`
    pub const UINT8: c_int = 1;
    /// `ncclInt32`
    pub const INT32: c_int = 2;
    /// `ncclUint32`
    pub const UINT32: c_int = 3;
    /// `ncclInt64`
    pub const INT64: c_int = 4;
    /// `ncclUint64`
    pub const UINT64: c_int = 5;
    /// `ncclFloat16`
    pub const FLOAT16: c_int = 6;
    /// `ncclFloat32`
    pub const FLOAT32: c_int = 7;
    /// `ncclFloat64`
    pub const FLOAT64: c_int = 8;
    /// `ncclBfloat16`
    pub const BFLOAT16: c_int = 9;
    /// `ncclFloat8e4m3` (NCCL 2.24 on; reductions need sm_90)
    pub const FLOAT8E4M3: c_int = 10;
    /// `ncclFloat8e5m2` (NCCL 2.24 on; reductions need sm_90)
    pub const FLOAT8E5M2: c_int = 11;
}

/// `ncclRedOp_t` values.
pub mod op {
    use std::os::raw::c_int;
    /// `ncclSum`
    pub const SUM: c_int = 0;
    /// `ncclProd`
    pub const PROD: c_int = 1;
    /// `ncclMax`
    pub const MAX: c_int = 2;
    /// `ncclMin`
    pub const MIN: c_int = 3;
    /// `ncclAvg` (NCCL 2.10 on)
    pub const AVG: c_int = 4;
}

/// Library names tried in order when `CUDA_PEER_NCCL_LIB` is not set: the
/// runtime package's name first.
pub const NCCL_LIBRARY_NAMES: &[&str] = &["libnccl.so.2", "libnccl.so"];

/// The environment variable naming the NCCL library to load (a path or a
/// name), tried instead of [`NCCL_LIBRARY_NAMES`].
pub const NCCL_LIB_ENV: &str = "CUDA_PEER_NCCL_LIB";

/// The NCCL entry points cuda-peer calls, resolved from one library.
#[allow(non_snake_case, missing_docs)]
pub struct NcclApi {
    _lib: libloading::Library,
    pub ncclGetVersion: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    pub ncclGetUniqueId: unsafe extern "C" fn(*mut NcclUniqueId) -> NcclResult,
    pub ncclCommInitRank: unsafe extern "C" fn(*mut NcclComm, c_int, NcclUniqueId, c_int) -> NcclResult,
    pub ncclCommAbort: unsafe extern "C" fn(NcclComm) -> NcclResult,
    pub ncclCommGetAsyncError: unsafe extern "C" fn(NcclComm, *mut NcclResult) -> NcclResult,
    pub ncclGetErrorString: unsafe extern "C" fn(NcclResult) -> *const c_char,
    pub ncclAllReduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, NcclComm, *mut c_void) -> NcclResult,
    pub ncclReduceScatter: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, NcclComm, *mut c_void) -> NcclResult,
    pub ncclAllGather: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, NcclComm, *mut c_void) -> NcclResult,
    pub ncclBroadcast: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, NcclComm, *mut c_void) -> NcclResult,
    pub ncclReduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, c_int, NcclComm, *mut c_void) -> NcclResult,
    /// `ncclSend(sendbuff, count, datatype, peer, comm, stream)` (NCCL 2.7 on).
    pub ncclSend: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, NcclComm, *mut c_void) -> NcclResult,
    /// `ncclRecv(recvbuff, count, datatype, peer, comm, stream)` (NCCL 2.7 on).
    pub ncclRecv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, NcclComm, *mut c_void) -> NcclResult,
    /// `ncclGroupStart()`: the calls until the matching `ncclGroupEnd` on
    /// this thread are issued as one operation.
    pub ncclGroupStart: unsafe extern "C" fn() -> NcclResult,
    /// `ncclGroupEnd()`: issues the group opened by `ncclGroupStart`.
    pub ncclGroupEnd: unsafe extern "C" fn() -> NcclResult,
}

impl std::fmt::Debug for NcclApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NcclApi { .. }")
    }
}

impl NcclApi {
    /// Opens `name` and resolves every entry point.
    ///
    /// # Safety
    ///
    /// `name` must be an NCCL 2 library (its initialisers run; the symbols
    /// are taken to have the signatures above).
    pub unsafe fn open(name: &str) -> Result<NcclApi, libloading::Error> {
        // SAFETY: the caller promises an NCCL 2 library.
        let lib = unsafe { libloading::Library::new(name)? };
        macro_rules! sym {
            ($name:ident) => {
                // SAFETY: the symbol is NCCL's function of that name, with the
                // signature of the field it is stored in (nccl.h, NCCL 2.x).
                *unsafe { lib.get(concat!(stringify!($name), "\0").as_bytes())? }
            };
        }
        Ok(NcclApi {
            ncclGetVersion: sym!(ncclGetVersion),
            ncclGetUniqueId: sym!(ncclGetUniqueId),
            ncclCommInitRank: sym!(ncclCommInitRank),
            ncclCommAbort: sym!(ncclCommAbort),
            ncclCommGetAsyncError: sym!(ncclCommGetAsyncError),
            ncclGetErrorString: sym!(ncclGetErrorString),
            ncclAllReduce: sym!(ncclAllReduce),
            ncclReduceScatter: sym!(ncclReduceScatter),
            ncclAllGather: sym!(ncclAllGather),
            ncclBroadcast: sym!(ncclBroadcast),
            ncclReduce: sym!(ncclReduce),
            ncclSend: sym!(ncclSend),
            ncclRecv: sym!(ncclRecv),
            ncclGroupStart: sym!(ncclGroupStart),
            ncclGroupEnd: sym!(ncclGroupEnd),
            _lib: lib,
        })
    }
}

/// Loads the first of `names` that opens and exports every NCCL entry point.
pub fn load_nccl_from(names: &[&str]) -> Result<NcclApi, LoadError> {
    let mut attempts = Vec::new();
    for name in names {
        // SAFETY: the names are NCCL libraries (the defaults, or the user's
        // CUDA_PEER_NCCL_LIB, which names NCCL by contract).
        match unsafe { NcclApi::open(name) } {
            Ok(api) => return Ok(api),
            Err(e) => attempts.push((name.to_string(), crate::with_sources(&e))),
        }
    }
    Err(LoadError { library: "the NCCL library", attempts })
}

static NCCL: once_cell::sync::OnceCell<Result<NcclApi, LoadError>> = once_cell::sync::OnceCell::new();

/// The process-wide NCCL library, loaded on first call (from
/// `CUDA_PEER_NCCL_LIB` when set, else [`NCCL_LIBRARY_NAMES`]) and kept for
/// the life of the process.
pub fn nccl() -> Result<&'static NcclApi, LoadError> {
    NCCL.get_or_init(|| match std::env::var(NCCL_LIB_ENV) {
        Ok(name) if !name.is_empty() => load_nccl_from(&[&name]),
        _ => load_nccl_from(NCCL_LIBRARY_NAMES),
    })
    .as_ref()
    .map_err(Clone::clone)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_nccl_is_an_error_naming_what_was_tried() {
        let err = match load_nccl_from(&["libnccl-cuda-peer-missing.so.9"]) {
            Ok(_) => panic!("loaded a library that does not exist"),
            Err(e) => e,
        };
        assert_eq!(err.attempts.len(), 1);
        assert!(err.attempts[0].0.contains("libnccl-cuda-peer-missing.so.9"));
    }

    #[test]
    fn the_unique_id_is_nccls_128_bytes() {
        assert_eq!(std::mem::size_of::<NcclUniqueId>(), 128);
    }
}
