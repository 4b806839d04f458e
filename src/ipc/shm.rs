//! Host memory that the processes of one host share: an anonymous file
//! (`memfd_create`) of a few pages, mapped shared into each process, whose
//! descriptor travels to the peers over [`super::fdpass`].
//!
//! The file is sealed before its descriptor leaves the process that made
//! it: its size can never change (`F_SEAL_SHRINK`, `F_SEAL_GROW`) and no
//! seal can be added or removed (`F_SEAL_SEAL`), so no process that holds
//! the descriptor can truncate it under the others' mappings (which would
//! kill them with `SIGBUS` on their next access). [`SharedMemory::import`]
//! maps only a file that carries those seals and has exactly the expected
//! size: an unsealed memfd, a regular file or a file of another size is
//! [`Error::Bootstrap`].
//!
//! A [`Comm`](super::Comm) keeps its per-call descriptors here
//! (its call board): each rank publishes what it is about to call, and every
//! rank compares them before any data moves.

use crate::error::{Error, Result};
use rustix::fs::SealFlags;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

fn io_err(op: &'static str) -> impl FnOnce(rustix::io::Errno) -> Error {
    move |e| Error::Bootstrap { op, reason: e.to_string() }
}

/// The bytes of a page, the unit of a region's length.
const PAGE: usize = 4096;

/// The seals every region carries (and that [`SharedMemory::import`]
/// requires): its size is fixed, and so are its seals.
pub(crate) const SEALS: SealFlags = SealFlags::SHRINK.union(SealFlags::GROW).union(SealFlags::SEAL);

/// The length of a region of at least `bytes`: whole pages, at least one;
/// `None` where that does not fit in `usize`.
pub(crate) fn region_len(bytes: usize) -> Option<usize> {
    bytes.max(1).checked_next_multiple_of(PAGE)
}

/// A region of host memory shared between processes, mapped read-write
/// into this one (unmapped on drop; the memory lives while any process maps
/// it or holds its descriptor).
#[derive(Debug)]
pub struct SharedMemory {
    ptr: *mut u64,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is process-wide and its contents are only accessed
// through atomics (`CallBoard`), so it may be used from any thread.
unsafe impl Send for SharedMemory {}
// SAFETY: as for Send.
unsafe impl Sync for SharedMemory {}

impl SharedMemory {
    /// A new zeroed region of at least `bytes` (whole pages), sealed (see
    /// the module docs) and mapped here. [`Error::InvalidArgument`] where
    /// that many bytes cannot be a region.
    pub fn create(bytes: usize) -> Result<SharedMemory> {
        let len = region_len(bytes).ok_or_else(|| Error::InvalidArgument(format!("shared memory of {bytes} bytes")))?;
        let size = u64::try_from(len).map_err(|_| Error::InvalidArgument(format!("shared memory of {bytes} bytes")))?;
        let fd = rustix::fs::memfd_create("cuda-peer-ipc", rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING)
            .map_err(io_err("memfd_create"))?;
        rustix::fs::ftruncate(&fd, size).map_err(io_err("ftruncate (shared memory)"))?;
        rustix::fs::fcntl_add_seals(&fd, SEALS).map_err(io_err("sealing shared memory"))?;
        Self::map(fd, len)
    }

    /// Maps the region of exactly `len` bytes that a peer created and sent
    /// as `fd`: [`Error::Bootstrap`] (saying what is wrong) unless `fd` is
    /// a memfd with the seals of [`SharedMemory::create`] and `len` bytes.
    pub fn import(fd: BorrowedFd<'_>, len: usize) -> Result<SharedMemory> {
        const OP: &str = "shared memory from a peer";
        if len == 0 || !len.is_multiple_of(PAGE) {
            return Err(Error::Bootstrap { op: OP, reason: format!("a region of {len} bytes expected (not whole pages)") });
        }
        let seals = rustix::fs::fcntl_get_seals(fd)
            .map_err(|e| Error::Bootstrap { op: OP, reason: format!("the descriptor is not a sealable memfd (F_GET_SEALS: {e})") })?;
        if !seals.contains(SEALS) {
            return Err(Error::Bootstrap {
                op: OP,
                reason: format!("the memfd is not sealed against resizing (seals {seals:?}; SHRINK | GROW | SEAL required)"),
            });
        }
        let st = rustix::fs::fstat(fd).map_err(io_err("fstat (shared memory)"))?;
        if u64::try_from(st.st_size).ok() != u64::try_from(len).ok() {
            return Err(Error::Bootstrap { op: OP, reason: format!("the memfd has {} bytes, exactly {len} expected", st.st_size) });
        }
        let fd = fd.try_clone_to_owned().map_err(|e| Error::Bootstrap { op: "dup (shared memory)", reason: e.to_string() })?;
        Self::map(fd, len)
    }

    fn map(fd: OwnedFd, len: usize) -> Result<SharedMemory> {
        use rustix::mm::{MapFlags, ProtFlags};
        // SAFETY: a new shared mapping of `len` bytes of the file at an
        // address the kernel picks: no existing memory is replaced. The file
        // has exactly `len` bytes and is sealed against shrinking (checked
        // by `import`, done by `create`), so every page of the mapping stays
        // backed while it lives.
        let p = unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, &fd, 0) }
            .map_err(io_err("mmap (shared memory)"))?;
        Ok(SharedMemory { ptr: p.cast(), len, fd })
    }

    /// The descriptor to send to the peers.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Its length in bytes (whole pages).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Its address in this process.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.cast()
    }

    /// Word `i` (of 8 bytes), as an atomic; `None` past the end.
    fn word(&self, i: usize) -> Option<&AtomicU64> {
        if i.checked_add(1).and_then(|n| n.checked_mul(8)).is_none_or(|end| end > self.len) {
            return None;
        }
        // SAFETY: in bounds (checked), 8-byte aligned (the mapping is page
        // aligned), live as long as `self`; every process accesses the
        // words only atomically, so an `AtomicU64` view is sound.
        Some(unsafe { AtomicU64::from_ptr(self.ptr.add(i)) })
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once; no reference
        // into it outlives `self` (`word` borrows `self`).
        if let Err(e) = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) } {
            log::warn!("cuda-peer: munmap of shared memory failed: {e}");
        }
    }
}

/// [`SharedMemory`] (all of it, or a range of whole pages) page-locked and
/// mapped for one device (`cuMemHostRegister` with `DEVICEMAP`), so that
/// the device's kernels and copies reach it at [`Self::device_ptr`]: the
/// staged path and the control block between processes. Unregistered on
/// drop, then unmapped (when no other holder of the mapping is left).
#[derive(Debug)]
pub struct RegisteredMemory {
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
    dptr: u64,
    /// Where the registered range starts in `mem`.
    offset: usize,
    // Dropped after `drop` unregisters it.
    mem: std::sync::Arc<SharedMemory>,
}

impl RegisteredMemory {
    /// Bytes `offset..offset + len` of `mem` registered for `ctx`'s device,
    /// once per context: where this process already holds that range of
    /// the same memory (the same memfd, by device and inode) registered for
    /// `ctx` (ranks that are threads of one process on one device, each
    /// with its own mapping of rank 0's memory), that registration, so that
    /// the device reaches the memory through one virtual address (accesses
    /// through two are outside the guarantees of its memory model); else a
    /// new one ([`Self::register_range`]), recorded while it lives.
    pub(crate) fn shared_range(
        ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
        mem: std::sync::Arc<SharedMemory>,
        offset: usize,
        len: usize,
    ) -> Result<std::sync::Arc<RegisteredMemory>> {
        use std::sync::{Arc, Mutex, Weak};
        type Key = (usize, u64, u64, usize, usize);
        static HELD: Mutex<Vec<(Key, Weak<RegisteredMemory>)>> = Mutex::new(Vec::new());
        let st = rustix::fs::fstat(mem.fd()).map_err(io_err("fstat (shared memory)"))?;
        let key: Key = (ctx.cu_ctx() as usize, st.st_dev as u64, st.st_ino as u64, offset, len);
        // Held while registering, so that two ranks registering at once make one registration.
        let mut held = HELD.lock().unwrap_or_else(|p| p.into_inner());
        held.retain(|e| e.1.strong_count() > 0);
        if let Some(reg) = held.iter().filter(|e| e.0 == key).find_map(|e| e.1.upgrade()) {
            return Ok(reg);
        }
        let reg = Arc::new(Self::register_range(ctx, mem, offset, len)?);
        held.push((key, Arc::downgrade(&reg)));
        Ok(reg)
    }

    /// Registers bytes `offset..offset + len` of `mem` (whole pages) for
    /// `ctx`'s device.
    fn register_range(
        ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
        mem: std::sync::Arc<SharedMemory>,
        offset: usize,
        len: usize,
    ) -> Result<RegisteredMemory> {
        let fits = offset.checked_add(len).is_some_and(|end| end <= mem.len());
        if !fits || len == 0 || !offset.is_multiple_of(PAGE) || !len.is_multiple_of(PAGE) {
            return Err(Error::Internal(format!("registering bytes {offset}..+{len} of a shared region of {}", mem.len())));
        }
        crate::driver::bind(ctx)?;
        let host = mem.as_ptr().wrapping_add(offset);
        // SAFETY: `host..host + len` lies in the live mapping of `mem`
        // (checked above), page aligned, registered once here and
        // unregistered in `drop` before `mem` can be unmapped (this holds
        // it); a context is current (bound above).
        unsafe { crate::driver::host_register("cuMemHostRegister", host.cast(), len) }?;
        let mut dptr: cuda_peer_sys::CUdeviceptr = 0;
        // SAFETY: the registered range, alive for the call; the driver writes
        // one device address.
        let got = crate::error::check("cuMemHostGetDevicePointer", unsafe {
            crate::driver::api()?.cuMemHostGetDevicePointer_v2(&mut dptr, host.cast(), 0)
        });
        let reg = RegisteredMemory { ctx: ctx.clone(), dptr, offset, mem };
        got?;
        Ok(reg)
    }

    /// Its address for the device's kernels and copies.
    pub fn device_ptr(&self) -> u64 {
        self.dptr
    }

    /// Its address in this process.
    pub fn host_ptr(&self) -> *mut u8 {
        self.mem.as_ptr().wrapping_add(self.offset)
    }
}

impl Drop for RegisteredMemory {
    fn drop(&mut self) {
        if crate::driver::bind(&self.ctx).is_err() {
            log::warn!("cuda-peer: no context to unregister shared host memory");
            return;
        }
        // SAFETY: registered in `register_range`, unregistered once; its
        // users (the communicator's kernels and copies) were synchronized
        // first.
        if let Err(e) = unsafe { crate::driver::host_unregister("cuMemHostUnregister", self.host_ptr().cast()) } {
            log::warn!("cuda-peer: {e}");
        }
    }
}

/// What a rank calls: compared between the ranks before data moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CallDesc {
    /// The collective (its name).
    pub kind: Kind,
    /// The element type's index in [`crate::dtype::DType::ALL`].
    pub dtype: u8,
    /// The op's index in [`crate::dtype::ReduceOp::ALL`], or 255 for none.
    pub op: u8,
    /// The root, or `u32::MAX` for none.
    pub root: u32,
    /// The count, as each collective's docs define it.
    pub count: u64,
    /// A digest of the per-rank counts of the collectives with uneven
    /// parts (`counts_digest` of the traits module); for an all-reduce, 1
    /// where it runs as the two-shot; else 0.
    pub extra: u64,
}

/// The collectives, as published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    AllReduce = 1,
    ReduceScatter = 2,
    AllGather = 3,
    Broadcast = 4,
    Reduce = 5,
    AllToAll = 6,
    AllGatherV = 7,
    ReduceScatterV = 8,
}

const KINDS: [Kind; 8] =
    [Kind::AllReduce, Kind::ReduceScatter, Kind::AllGather, Kind::Broadcast, Kind::Reduce, Kind::AllToAll, Kind::AllGatherV, Kind::ReduceScatterV];

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::AllReduce => "all_reduce",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::AllGather => "all_gather",
            Kind::Broadcast => "broadcast",
            Kind::Reduce => "reduce",
            Kind::AllToAll => "all_to_all",
            Kind::AllGatherV => "all_gather_v",
            Kind::ReduceScatterV => "reduce_scatter_v",
        }
    }
}

impl CallDesc {
    fn pack(&self) -> u64 {
        (self.kind as u64) | (self.dtype as u64) << 8 | (self.op as u64) << 16 | (self.root as u64) << 32
    }

    fn unpack(w: u64, count: u64, extra: u64) -> Option<CallDesc> {
        let kind = *KINDS.iter().find(|k| **k as u64 == w & 0xff)?;
        Some(CallDesc { kind, dtype: (w >> 8) as u8, op: (w >> 16) as u8, root: (w >> 32) as u32, count, extra })
    }
}

impl std::fmt::Display for CallDesc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ty = crate::dtype::movable_name(self.dtype);
        write!(f, "{}({} x {ty}", self.kind.name(), self.count)?;
        if let Some(op) = crate::dtype::ReduceOp::ALL.get(self.op as usize) {
            write!(f, ", {}", op.name())?;
        }
        if self.root != u32::MAX {
            write!(f, ", root {}", self.root)?;
        }
        match (self.kind, self.extra) {
            (_, 0) => {}
            (Kind::AllReduce, _) => write!(f, ", two-shot")?,
            (_, e) => write!(f, ", counts {e:016x}")?,
        }
        write!(f, ")")
    }
}

/// Slots per rank: a rank publishes call k in slot k % SLOTS. A rank can be
/// at most one call ahead of any other (it waits for every rank's call k
/// before it publishes k + 1), so two would do.
const SLOTS: usize = 4;
/// Words per slot: the call number + 1 (0: none yet), the packed
/// descriptor, the count, the counts' digest.
const WORDS: usize = 4;

/// Every rank's per-call descriptors, in [`SharedMemory`].
#[derive(Debug)]
pub(crate) struct CallBoard {
    mem: std::sync::Arc<SharedMemory>,
    size: usize,
}

/// The bytes of a board for `size` ranks.
pub(crate) fn board_bytes(size: usize) -> usize {
    size.saturating_mul(SLOTS * WORDS * 8)
}

impl CallBoard {
    /// The board of `size` ranks in `mem` (zeroed by its creator).
    pub(crate) fn new(mem: impl Into<std::sync::Arc<SharedMemory>>, size: usize) -> Result<CallBoard> {
        let mem = mem.into();
        if mem.len() < board_bytes(size) {
            return Err(Error::Internal(format!("a call board of {} bytes for {size} ranks", mem.len())));
        }
        Ok(CallBoard { mem, size })
    }

    fn slot(&self, rank: usize, call: u64) -> [&AtomicU64; 4] {
        let base = (rank * SLOTS + (call % SLOTS as u64) as usize) * WORDS;
        // In bounds: rank < size, checked against the length in `new`.
        let w = |i| self.mem.word(base + i).unwrap_or_else(|| unreachable_word());
        [w(0), w(1), w(2), w(3)]
    }

    /// Publishes `desc` as this rank's call number `call`, waits (at most
    /// `timeout`) until every rank has published its call `call`, and
    /// compares: `Ok` where every rank calls the same, else
    /// [`Error::Mismatch`] (the same verdict on every rank, which all
    /// compare the same descriptors) or [`Error::Timeout`] (a rank that
    /// does not reach the call: dead, or stopped calling).
    pub(crate) fn agree(&self, rank: usize, call: u64, desc: &CallDesc, timeout: Duration) -> Result<()> {
        let [seq, packed, count, extra] = self.slot(rank, call);
        packed.store(desc.pack(), Ordering::Relaxed);
        count.store(desc.count, Ordering::Relaxed);
        extra.store(desc.extra, Ordering::Relaxed);
        seq.store(call + 1, Ordering::Release);
        let start = Instant::now();
        let mut spins = 0u32;
        let mut mismatch = None;
        for k in 0..self.size {
            if k == rank {
                continue;
            }
            let [seq, packed, count, extra] = self.slot(k, call);
            loop {
                let s = seq.load(Ordering::Acquire);
                if s == call + 1 {
                    break;
                }
                if s > call + 1 + SLOTS as u64 || start.elapsed() > timeout {
                    let why = if s > call + 1 { "is ahead of" } else { "did not reach" };
                    log::warn!("cuda-peer: rank {k} {why} call {call} of rank {rank}");
                    return Err(Error::Timeout { op: "communicator: waiting for a peer to make the same call", after: timeout });
                }
                spins += 1;
                if spins < 2000 {
                    std::hint::spin_loop();
                } else if spins < 4000 {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
            let theirs = CallDesc::unpack(packed.load(Ordering::Relaxed), count.load(Ordering::Relaxed), extra.load(Ordering::Relaxed));
            if theirs != Some(*desc) && mismatch.is_none() {
                // Every other peer's call is still waited for: a rank returns
                // only once every rank has published this call, so that none
                // runs ahead of a slow one by more than a call.
                mismatch = Some(Error::Mismatch {
                    rank: k,
                    ours: desc.to_string(),
                    theirs: theirs.map(|t| t.to_string()).unwrap_or_else(|| "an unknown call".into()),
                });
            }
        }
        mismatch.map_or(Ok(()), Err)
    }
}

#[cold]
fn unreachable_word() -> &'static AtomicU64 {
    // Only reached by a bug (an index past the board): a private dummy word
    // keeps it from being undefined behaviour or a panic.
    static DUMMY: AtomicU64 = AtomicU64::new(u64::MAX);
    &DUMMY
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(count: u64) -> CallDesc {
        CallDesc { kind: Kind::AllGather, dtype: 0, op: 255, root: u32::MAX, count, extra: 0 }
    }

    /// The reason of an import's refusal (which must be a refusal).
    fn refusal(r: Result<SharedMemory>) -> String {
        match r {
            Err(Error::Bootstrap { reason, .. }) => reason,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    /// Sends `fd` as rank 1 to rank 0 (threads of this process) and returns
    /// the descriptor rank 0 received: what a peer's import would see.
    fn through_fdpass(fd: BorrowedFd<'_>) -> OwnedFd {
        use super::super::fdpass::{send_fd, FdListener};
        let (a, b) = (FdListener::bind(0).unwrap(), FdListener::bind(1).unwrap());
        let peers = [a.addr(), b.addr()];
        send_fd(&peers[0], 1, fd, 4096, Duration::from_secs(5)).unwrap();
        let mut got = a.receive(&peers, 1, Duration::from_secs(5)).unwrap();
        assert_eq!(got[0].from, 1);
        got.remove(0).fd
    }

    #[test]
    fn a_created_region_is_sealed_and_cannot_be_truncated_or_resealed() {
        let mem = SharedMemory::create(100).unwrap();
        assert_eq!(mem.len(), PAGE);
        let seals = rustix::fs::fcntl_get_seals(mem.fd()).unwrap();
        assert!(seals.contains(SEALS), "{seals:?}");
        // What a peer holding the descriptor would try.
        let theirs = through_fdpass(mem.fd());
        assert_eq!(rustix::fs::ftruncate(&theirs, 0), Err(rustix::io::Errno::PERM));
        assert_eq!(rustix::fs::ftruncate(&theirs, 2 * PAGE as u64), Err(rustix::io::Errno::PERM));
        assert_eq!(rustix::fs::fcntl_add_seals(&theirs, SealFlags::WRITE), Err(rustix::io::Errno::PERM));
        assert_eq!(rustix::fs::fstat(&theirs).unwrap().st_size, PAGE as i64);
        // The mapping still works, and the peer's import sees the same memory.
        let peer = SharedMemory::import(theirs.as_fd(), PAGE).unwrap();
        mem.word(3).unwrap().store(0xdead_beef, Ordering::Relaxed);
        assert_eq!(peer.word(3).unwrap().load(Ordering::Relaxed), 0xdead_beef);
        assert!(mem.word(PAGE / 8).is_none() && mem.word(usize::MAX).is_none());
    }

    #[test]
    fn an_unsealed_memfd_sent_as_shared_memory_is_refused() {
        use rustix::fs::{memfd_create, MemfdFlags};
        // Sealable but not sealed: the attack's memfd, which its sender can
        // truncate under the importer's mapping.
        let unsealed = memfd_create("attack", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&unsealed, PAGE as u64).unwrap();
        let received = through_fdpass(unsealed.as_fd());
        let why = refusal(SharedMemory::import(received.as_fd(), PAGE));
        assert!(why.contains("not sealed"), "{why}");
        assert_eq!(rustix::fs::ftruncate(&unsealed, 0), Ok(()), "the refused memfd really was truncatable");
        // Only partly sealed (it can still shrink).
        let partly = memfd_create("attack", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&partly, PAGE as u64).unwrap();
        rustix::fs::fcntl_add_seals(&partly, SealFlags::GROW | SealFlags::SEAL).unwrap();
        assert!(refusal(SharedMemory::import(partly.as_fd(), PAGE)).contains("not sealed"));
        // Made without ALLOW_SEALING: its only seal is SEAL.
        let plain = memfd_create("attack", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&plain, PAGE as u64).unwrap();
        assert!(refusal(SharedMemory::import(plain.as_fd(), PAGE)).contains("not sealed"));
    }

    #[test]
    fn a_regular_file_sent_as_shared_memory_is_refused() {
        let file = tempfile::tempfile().unwrap();
        file.set_len(PAGE as u64).unwrap();
        let received = through_fdpass(file.as_fd());
        let why = refusal(SharedMemory::import(received.as_fd(), PAGE));
        assert!(why.contains("not a sealable memfd"), "{why}");
        // A file on tmpfs supports seals but is born with SEAL alone.
        if std::path::Path::new("/dev/shm").is_dir() {
            if let Ok(shm) = tempfile::tempfile_in("/dev/shm") {
                shm.set_len(PAGE as u64).unwrap();
                assert!(SharedMemory::import(shm.as_fd(), PAGE).is_err());
            }
        }
    }

    #[test]
    fn a_sealed_region_of_another_size_is_refused() {
        let mem = SharedMemory::create(2 * PAGE).unwrap();
        for len in [PAGE, 3 * PAGE, 0, 100, usize::MAX] {
            let why = refusal(SharedMemory::import(mem.fd(), len));
            assert!(why.contains("expected"), "{len}: {why}");
        }
        assert_eq!(SharedMemory::import(mem.fd(), 2 * PAGE).unwrap().len(), 2 * PAGE);
    }

    #[test]
    fn sizes_past_usize_are_invalid_arguments_not_panics() {
        assert!(matches!(SharedMemory::create(usize::MAX), Err(Error::InvalidArgument(_))));
        assert_eq!(region_len(0), Some(PAGE));
        assert_eq!(region_len(PAGE + 1), Some(2 * PAGE));
        assert_eq!(region_len(usize::MAX - 1), None);
        assert_eq!(board_bytes(usize::MAX), usize::MAX);
    }

    #[test]
    fn descriptors_round_trip_and_print() {
        let d = CallDesc { kind: Kind::Reduce, dtype: 3, op: 2, root: 1, count: 77, extra: 0 };
        assert_eq!(CallDesc::unpack(d.pack(), 77, 0), Some(d));
        assert_eq!(d.to_string(), "reduce(77 x bf16, min, root 1)");
        assert_eq!(desc(5).to_string(), "all_gather(5 x f32)");
        for kind in KINDS {
            let v = CallDesc { kind, dtype: 10, op: 255, root: u32::MAX, count: 9, extra: 0xabc };
            assert_eq!(CallDesc::unpack(v.pack(), 9, 0xabc), Some(v));
        }
        let v = CallDesc { kind: Kind::AllGatherV, dtype: 11, op: 255, root: u32::MAX, count: 9, extra: 0xabc };
        assert_eq!(v.to_string(), "all_gather_v(9 x f8e5m2, counts 0000000000000abc)");
    }

    /// Two "ranks" (threads) on one region, one imported from the other's
    /// descriptor: equal calls agree, a different count is a mismatch on
    /// both, the next call agrees again, and a missing peer is a timeout.
    #[test]
    fn ranks_agree_disagree_and_time_out() {
        let a = SharedMemory::create(board_bytes(2)).unwrap();
        let b = SharedMemory::import(a.fd(), a.len()).unwrap();
        let (a, b) = (CallBoard::new(a, 2).unwrap(), CallBoard::new(b, 2).unwrap());
        let t = Duration::from_secs(10);
        std::thread::scope(|s| {
            let h = s.spawn(|| (0..3).map(|c| b.agree(1, c, &desc(if c == 1 { 9 } else { 5 }), t)).collect::<Vec<_>>());
            let mine: Vec<_> = (0..3).map(|c| a.agree(0, c, &desc(5), t)).collect();
            for got in [mine, h.join().unwrap()] {
                assert!(got[0].is_ok() && got[2].is_ok(), "{got:?}");
                assert!(matches!(&got[1], Err(Error::Mismatch { .. })), "{got:?}");
            }
        });
        let start = Instant::now();
        assert!(matches!(a.agree(0, 3, &desc(5), Duration::from_millis(100)), Err(Error::Timeout { .. })));
        assert!(start.elapsed() < Duration::from_secs(5));
    }
}
