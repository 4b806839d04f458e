//! The crate's one error type.

use cuda_peer_sys as sys;
use std::time::Duration;

/// Every failure the crate reports. `Send + Sync + 'static`, so it crosses
/// threads and boxes into `anyhow`-style errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The CUDA driver library could not be loaded (no driver, or a driver
    /// too old to export the calls this crate needs).
    #[error("{0}")]
    Load(#[from] sys::LoadError),
    /// A driver call returned an error.
    #[error("{op} failed: {name} ({description})")]
    Driver {
        /// The call, or the operation it was part of.
        op: &'static str,
        /// The raw `CUresult`.
        code: u32,
        /// The result's name, e.g. `CUDA_ERROR_INVALID_VALUE`.
        name: String,
        /// The driver's description of it.
        description: String,
    },
    /// The driver loaded but reports no CUDA device.
    #[error("no CUDA device found")]
    NoDevice,
    /// A device index past the last device.
    #[error("device {ordinal} does not exist ({count} CUDA devices)")]
    DeviceOutOfRange {
        /// The index asked for.
        ordinal: usize,
        /// How many devices there are.
        count: usize,
    },
    /// Peer access asked from a device to itself.
    #[error("peer access from device {0} to itself")]
    SameDevice(usize),
    /// The driver reports that `from` cannot access `to`'s memory
    /// (`CUDA_ERROR_PEER_ACCESS_UNSUPPORTED`, or `cuDeviceCanAccessPeer` = 0).
    #[error("peer access from device {from} to device {to} is not supported")]
    PeerUnsupported {
        /// The accessing device.
        from: usize,
        /// The device whose memory would be accessed.
        to: usize,
    },
    /// The device has reached the driver's limit of peers
    /// (`CUDA_ERROR_TOO_MANY_PEERS`).
    #[error("device {from} cannot enable peer access to device {to}: too many peers")]
    TooManyPeers {
        /// The accessing device.
        from: usize,
        /// The device whose memory would be accessed.
        to: usize,
    },
    /// Buffers whose lengths must agree do not.
    #[error("{op}: length mismatch, expected {expected} elements, got {got}")]
    LengthMismatch {
        /// The operation.
        op: &'static str,
        /// The length required.
        expected: usize,
        /// The length given.
        got: usize,
    },
    /// A buffer or stream on another device than the one it was named for.
    #[error("{op}: {what} is on device {got}, expected device {expected}")]
    WrongDevice {
        /// The operation.
        op: &'static str,
        /// Which argument.
        what: &'static str,
        /// The device it should be on.
        expected: usize,
        /// The device it is on.
        got: usize,
    },
    /// A buffer (or stream) is on the right device but in another CUDA
    /// context than the one it is used with (a non-primary context, say):
    /// its memory is not mapped there.
    #[error("{op}: {what} belongs to another CUDA context on device {device} than the one it is used with")]
    WrongContext {
        /// The operation.
        op: &'static str,
        /// Which buffer or stream.
        what: &'static str,
        /// The device.
        device: usize,
    },
    /// A collective's root rank is not in the group.
    #[error("root rank {root} out of range for a group of {size} ranks")]
    RootOutOfRange {
        /// The root asked for.
        root: usize,
        /// The group's size.
        size: usize,
    },
    /// A reduction that the element type does not support (e.g. `Avg` on integers).
    #[error("reduction {op} is not defined for element type {dtype}")]
    UnsupportedOp {
        /// The reduction.
        op: &'static str,
        /// The element type.
        dtype: &'static str,
    },
    /// A group needs at least one rank.
    #[error("a group needs at least one rank")]
    EmptyGroup,
    /// A link was asked to use P2P only, but P2P is unsupported or failed
    /// verification.
    #[error("link {from} -> {to}: P2P required but {reason}")]
    P2pUnavailable {
        /// Source device.
        from: usize,
        /// Destination device.
        to: usize,
        /// Why.
        reason: String,
    },
    /// An operation on the device did not finish in time (a verification
    /// that hung, for example). The device work may still be pending.
    #[error("{op} did not complete within {after:?}")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// How long it was given.
        after: Duration,
    },
    /// A buffer that the kernels of another rank's device would load from
    /// or store to is not mapped for that device (memory from a memory pool
    /// other than the device's default one, or a VMM mapping, without
    /// access granted to the peer): the kernel would fault and take the
    /// context down. Allocate from the default pool or with `cuMemAlloc`,
    /// or grant the peer access (`cuMemPoolSetAccess`, `cuMemSetAccess`).
    #[error("{op}: rank {rank}'s buffer is not mapped for device {device}, whose kernels would access it")]
    Unreachable {
        /// The operation.
        op: &'static str,
        /// The rank whose buffer it is.
        rank: usize,
        /// The device that cannot access it.
        device: usize,
    },
    /// A rank's mesh or one-shot kernel waited longer than the group's
    /// barrier timeout for a peer and gave up (the peer was never launched,
    /// or hangs). The kernels ended cleanly and the contexts are usable, but
    /// the group's ranks are out of step: every later call on the group
    /// returns this error. Make a new group.
    #[error("rank {rank} waited {after:?} for its peers at call {call} and gave up; the group is out of step (make a new one)")]
    PeerTimeout {
        /// The rank whose kernel gave up first.
        rank: usize,
        /// The call that timed out: the communicator's calls counted from
        /// 1 in the order they were made (a replayed CUDA graph's kernel
        /// names the call it was captured from).
        call: u32,
        /// The group's barrier timeout.
        after: Duration,
    },
    /// A group that can no longer run collectives: a call could not be
    /// launched on every rank (that call returned the launch's error), so
    /// the kernels already launched were told to give up. Make a new group.
    #[error("the group failed and is out of step (make a new one): {reason}")]
    GroupFailed {
        /// What happened.
        reason: String,
    },
    /// A fused all-reduce that was forced ([`crate::Algorithm::Mesh`] or
    /// [`crate::Algorithm::OneShot`]) failed its check at group creation:
    /// its SM peer loads and stores or its flags did not carry the data
    /// between the ranks (or timed out). Under `Algorithm::Auto` the group
    /// uses the ring instead.
    #[error("the {algorithm} all-reduce failed its check on these devices: {reason}")]
    FusedUnverified {
        /// Which algorithm.
        algorithm: &'static str,
        /// What went wrong.
        reason: String,
    },
    /// A call that cannot be captured into a CUDA graph as it stands (say,
    /// one that would first have to allocate memory).
    #[error("{op} cannot be captured into a CUDA graph: {reason}")]
    Capture {
        /// The operation.
        op: &'static str,
        /// Why, and what to do instead.
        reason: String,
    },
    /// A failure inside cuda-peer that should not happen (a bug; please
    /// report it), e.g. a panic caught on a launcher thread.
    #[error("internal error: {0}")]
    Internal(String),
    /// A launcher variable (`RANK`, `WORLD_SIZE`, `MASTER_PORT`, ...) is
    /// missing or does not parse.
    #[error("environment variable {var}: {problem}")]
    Env {
        /// The variable.
        var: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// The exchange between processes failed: the rendezvous, a socket, a
    /// peer that went away or disagrees (the multi-process path, `ipc`).
    #[error("{op}: {reason}")]
    Bootstrap {
        /// The step that failed.
        op: &'static str,
        /// Why.
        reason: String,
    },
    /// The ranks of a multi-process communicator (`ipc::Comm`) did not make
    /// the same call: another collective, element type, op, count or root
    /// (each rank's call is compared with every peer's before any data
    /// moves). Every rank returns this error for the call, nothing was
    /// enqueued, and the communicator stays usable for the next call.
    #[error("ranks disagree: this rank calls {ours}, rank {rank} calls {theirs}")]
    Mismatch {
        /// The first rank whose call differs from this rank's.
        rank: usize,
        /// This rank's call.
        ours: String,
        /// That rank's call.
        theirs: String,
    },
    /// An NCCL call failed (the collectives between hosts, [`crate::ipc::nccl`]).
    #[error("{op} failed: NCCL result {code} ({message})")]
    Nccl {
        /// The call.
        op: &'static str,
        /// The raw `ncclResult_t`.
        code: i32,
        /// NCCL's description of it.
        message: String,
    },
    /// A configuration this version does not support yet (say, ranks on
    /// two hosts, or two ranks on one device, in a multi-process group).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// Any other argument that is out of its range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A forced all-reduce algorithm ([`crate::Algorithm`] other than
    /// `Auto`) that the group cannot run (its layout, or its links).
    #[error("{algorithm} all-reduce impossible: {reason}")]
    AlgorithmUnavailable {
        /// Which algorithm (`mesh`, `one-shot`).
        algorithm: &'static str,
        /// Why the group cannot run it.
        reason: String,
    },
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Returns the driver's name and description of a raw `CUresult`.
pub fn describe(code: u32) -> (String, String) {
    let fallback = || (format!("CUresult({code})"), "unknown error".to_string());
    let Ok(api) = sys::driver() else { return fallback() };
    let code = sys::CUresult(code);
    let mut name: *const std::os::raw::c_char = std::ptr::null();
    let mut desc: *const std::os::raw::c_char = std::ptr::null();
    // SAFETY: both calls only write a pointer to a static, NUL-terminated
    // string owned by the driver (or leave it null for unknown codes).
    let (rn, rd) = unsafe { (api.cuGetErrorName(code, &mut name), api.cuGetErrorString(code, &mut desc)) };
    let text = |r: sys::CUresult, p: *const std::os::raw::c_char| {
        if r == sys::CUresult::CUDA_SUCCESS && !p.is_null() {
            // SAFETY: non-null pointers from the driver point at static C strings.
            Some(unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned())
        } else {
            None
        }
    };
    let (fname, fdesc) = fallback();
    (text(rn, name).unwrap_or(fname), text(rd, desc).unwrap_or(fdesc))
}

impl Error {
    /// Builds [`Error::Driver`] for `code` from `op`.
    pub fn driver(op: &'static str, code: u32) -> Self {
        let (name, description) = describe(code);
        Error::Driver { op, code, name, description }
    }

    /// The raw `CUresult` if this is a driver error.
    pub fn cu_result(&self) -> Option<u32> {
        match self {
            Error::Driver { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// A cudarc driver error becomes [`Error::Driver`] with the operation
/// `"cudarc"` and cudarc's `CUresult`, so that `?` works on cudarc calls in
/// code that returns this crate's errors. (Inside the crate each call names
/// its own operation instead.)
impl From<cudarc::driver::DriverError> for Error {
    fn from(e: cudarc::driver::DriverError) -> Self {
        Error::driver("cudarc", e.0 as u32)
    }
}

/// Turns a raw `CUresult` into `Ok(())` or [`Error::Driver`].
pub(crate) fn check(op: &'static str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::driver(op, r.0))
    }
}

/// Maps a cudarc error into ours, naming the operation.
pub(crate) fn cudarc_err(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::driver(op, e.0 as u32)
}

/// [`Error::RootOutOfRange`] unless `root` is a rank of `size`: the one
/// check of every rooted collective's root.
pub(crate) fn check_root(root: usize, size: usize) -> Result<()> {
    if root >= size {
        return Err(Error::RootOutOfRange { root, size });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync + 'static>() {}

    #[test]
    fn error_is_send_sync_static() {
        assert_send_sync::<Error>();
    }

    #[test]
    fn check_maps_success_and_failure() {
        assert_eq!(check("cuInit", sys::CUresult::CUDA_SUCCESS), Ok(()));
        let e = check("cuCtxEnablePeerAccess", sys::CUresult::CUDA_ERROR_TOO_MANY_PEERS).unwrap_err();
        assert_eq!(e.cu_result(), Some(sys::CUresult::CUDA_ERROR_TOO_MANY_PEERS.0));
        let text = e.to_string();
        assert!(text.starts_with("cuCtxEnablePeerAccess failed: "), "{text}");
        // Without a driver the name falls back to the number; with one it is the name.
        let code = sys::CUresult::CUDA_ERROR_TOO_MANY_PEERS.0;
        assert!(text.contains("CUDA_ERROR_TOO_MANY_PEERS") || text.contains(&format!("CUresult({code})")), "{text}");
    }

    #[test]
    fn typed_errors_say_what_is_wrong() {
        let e = Error::LengthMismatch { op: "copy", expected: 4, got: 5 };
        assert_eq!(e.to_string(), "copy: length mismatch, expected 4 elements, got 5");
        let e = Error::DeviceOutOfRange { ordinal: 9, count: 2 };
        assert_eq!(e.to_string(), "device 9 does not exist (2 CUDA devices)");
        let e = Error::UnsupportedOp { op: "avg", dtype: "i32" };
        assert_eq!(e.to_string(), "reduction avg is not defined for element type i32");
    }

    #[test]
    fn cudarc_errors_keep_their_code() {
        let e = cudarc_err("memcpy")(cudarc::driver::DriverError(cudarc::driver::sys::CUresult::CUDA_ERROR_INVALID_VALUE));
        assert_eq!(e.cu_result(), Some(sys::CUresult::CUDA_ERROR_INVALID_VALUE.0));
    }

    #[test]
    fn cudarc_errors_convert_with_question_mark() {
        fn fails() -> Result<()> {
            Err(cudarc::driver::DriverError(cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY))?;
            Ok(())
        }
        let e = fails().unwrap_err();
        assert_eq!(e.cu_result(), Some(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY.0));
        assert!(matches!(e, Error::Driver { op: "cudarc", .. }), "{e:?}");
        assert!(e.to_string().starts_with("cudarc failed: "), "{e}");
    }
}
