//! `cudarc::nccl`'s paths and signatures (cudarc 0.19) over [`crate::comm::Comm`],
//! so that a program written against cudarc's NCCL bindings (mistral.rs's
//! distributed module, candle's `llama_multiprocess` example) switches to
//! cuda-peer by changing one `use` line:
//!
//! ```text
//! -use cudarc::nccl::safe::{Comm, Id, ReduceOp};
//! +use cuda_peer::compat::nccl::safe::{Comm, Id, ReduceOp};
//! ```
//!
//! The same names as cudarc's, in the same places: [`safe`] (re-exported
//! here, as `cudarc::nccl` re-exports its `safe`) has [`Comm`], [`Id`],
//! [`ReduceOp`], [`NcclType`] and [`group_start`]/[`group_end`];
//! [`result`] has [`result::NcclError`] (a tuple struct: `e.0` is the
//! [`crate::error::Error`]) and [`result::NcclStatus`]. Every collective of
//! cudarc's `Comm` is here with cudarc's generic parameters, argument types
//! and order (`&ReduceOp`, `root: i32`, `Option<&S>`), and returns what
//! cudarc's returns. Nothing here moves data itself: each call is one call
//! of [`crate::comm::Comm`].
//!
//! ```no_run
//! use cuda_peer::compat::nccl::safe::{Comm, Id, ReduceOp};
//! # fn send_to_other_ranks(_: &[std::ffi::c_char; 128]) {}
//! # fn receive_from_rank0() -> [std::ffi::c_char; 128] { [0; 128] }
//! # fn main() -> Result<(), cuda_peer::compat::nccl::result::NcclError> {
//! # let (rank, world_size) = (0usize, 2usize);
//! let id = if rank == 0 {
//!     let id = Id::new()?;
//!     send_to_other_ranks(id.internal()); // the application's own channel
//!     id
//! } else {
//!     Id::uninit(receive_from_rank0())
//! };
//! let stream = cuda_peer::driver::context(rank)?.default_stream();
//! let comm = Comm::from_rank(stream.clone(), rank, world_size, id)?;
//! let x = stream.clone_htod(&[rank as f32; 1024]).unwrap();
//! let mut sum = stream.alloc_zeros::<f32>(1024).unwrap();
//! comm.all_reduce(&x, &mut sum, &ReduceOp::Sum)?;
//! # Ok(()) }
//! ```
//!
//! # What differs from cudarc's
//!
//! - The ranks: 2 to 8 ranks of one host run on cuda-peer's own paths;
//!   ranks on several hosts use NCCL between the hosts (loaded at run time;
//!   see [`crate::comm::Comm`]). An [`Id`] holds rank 0's rendezvous address and
//!   a job secret, not an `ncclUniqueId`: it is made by this module's
//!   [`Id::new`] and read by this module's `Comm::from_rank`, never mixed
//!   with NCCL's.
//! - [`Comm::from_devices`]: each communicator must be called from a thread
//!   of its own, concurrently with the others (a call waits for every
//!   rank's). cudarc's are driven from one thread inside `group_start` /
//!   `group_end`, which this module does not have.
//! - [`ReduceOp::Avg`] on integer types is refused
//!   ([`crate::error::Error::UnsupportedOp`]), where NCCL divides with truncation.
//! - [`NcclType`] is implemented for the ten element types cudarc and
//!   cuda-peer share ([`crate::dtype::DType`] but fp8, which cudarc's lacks): not
//!   for `char`, which cudarc maps to NCCL's one-byte `ncclUint8` although a
//!   Rust `char` is four bytes.
//! - Errors are values: no call panics (cudarc's `from_rank` panics on a
//!   rank that does not fit an `i32`, its `Drop` on a failed
//!   `ncclCommAbort`). [`result::NcclError`]'s `.0` is a [`crate::error::Error`]
//!   (cudarc's is an `ncclResult_t`); it also implements `Display` and
//!   `std::error::Error`.
//! - Buffer lengths: where cudarc takes the count from one buffer and lets
//!   the other be longer, a collective here needs the lengths its
//!   collective defines (all-reduce and broadcast: equal; all-gather and
//!   reduce-scatter: one `world_size()` times the other) and refuses
//!   others with [`crate::error::Error::LengthMismatch`]; pass views of
//!   the lengths meant. A rank but the root of `reduce` ignores its
//!   receive buffer, as NCCL does.
//! - A [`Group`] groups the calls made through it: a `send` or `recv` made
//!   on the [`Comm`] itself while a group is open runs at once (cudarc's
//!   group is NCCL's per-thread state, which takes every call of the
//!   thread).
//! - [`Comm`] is `Send + Sync` (cudarc's holds a raw pointer and is
//!   neither).
//!
//! # What cudarc lacks and this module adds
//!
//! - [`Comm::abort`]: marks the communicator failed, so that every later
//!   call on it returns an error (see its docs for what it does not stop).
//! - [`Comm::async_error`]: the failure already recorded, without waiting.
//! - A `Drop` that never panics.
//! - [`Comm::inner`] and `From<crate::comm::Comm>`: the cuda-peer communicator
//!   underneath, for what cudarc's API has no name for (`from_env`, options,
//!   `synchronize`, `engine`).
//!
//! # What is missing
//!
//! - Point-to-point: [`Comm::send`] and [`Comm::recv`] are cuda-peer's
//!   ([`crate::comm::Comm::send`]), matched in order as NCCL's are.
//! - Groups: [`group_start`] and [`group_end`] return
//!   [`crate::error::Error::Unsupported`] ([`Comm::group`] and [`Group`], cudarc's
//!   shape, are here).
//! - cudarc's `nccl::result`'s raw calls (`comm_init_rank`, ...) and
//!   `nccl::sys`, and the `group!` macro.

pub mod result {
    //! `cudarc::nccl::result`'s error and status types: [`NcclError`], whose
    //! `.0` is the [`crate::error::Error`] a call failed with, and [`NcclStatus`].
    //! Also [`group_start`] and [`group_end`], which cuda-peer does not have
    //! (they return [`crate::error::Error::Unsupported`]).

    /// A failed call: `.0` is cuda-peer's error (cudarc's holds an
    /// `ncclResult_t` there). `Display` and `source` are the inner error's, so
    /// `{e}`, `{:?}` of `e.0` and `?` into [`crate::error::Error`] all say what went
    /// wrong.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct NcclError(pub crate::error::Error);

    impl std::fmt::Display for NcclError {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            std::fmt::Display::fmt(&self.0, f)
        }
    }

    impl std::error::Error for NcclError {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            std::error::Error::source(&self.0)
        }
    }

    impl From<crate::error::Error> for NcclError {
        fn from(e: crate::error::Error) -> Self {
            NcclError(e)
        }
    }

    impl From<NcclError> for crate::error::Error {
        fn from(e: NcclError) -> Self {
            e.0
        }
    }

    /// What a call that succeeded returns, as cudarc's `NcclStatus`. Every call
    /// of this module returns [`NcclStatus::Success`]: the work is enqueued on
    /// the communicator's stream (as NCCL's `ncclSuccess` means too); it is
    /// never left in progress on the host.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum NcclStatus {
        /// The call's work is enqueued.
        Success,
        /// NCCL's `ncclInProgress` (a non-blocking communicator still working);
        /// never returned here.
        InProgress,
        /// NCCL's `ncclNumResults`; never returned here.
        NumResults,
    }

    /// The error of what cuda-peer does not have (yet): `what` names the call.
    pub(super) fn unsupported(what: &str) -> NcclError {
        NcclError(crate::error::Error::Unsupported(format!(
            "{what}: cuda-peer has no ncclGroupStart/ncclGroupEnd (one thread driving several ranks' calls); group one rank's sends and receives with Comm::group (cuda_peer::compat::nccl); nothing was enqueued"
        )))
    }

    /// NCCL's `ncclGroupStart`, which cuda-peer does not have: always
    /// [`crate::error::Error::Unsupported`], so that code that groups calls fails
    /// here, not later in a wait for calls the group would have merged.
    pub fn group_start() -> Result<NcclStatus, NcclError> {
        Err(unsupported("group_start"))
    }

    /// NCCL's `ncclGroupEnd`, which cuda-peer does not have: always
    /// [`crate::error::Error::Unsupported`] (see [`group_start`]).
    pub fn group_end() -> Result<NcclStatus, NcclError> {
        Err(unsupported("group_end"))
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn the_error_is_a_tuple_struct_around_cuda_peers() {
            let e = NcclError(crate::error::Error::NoDevice);
            let inner: &crate::error::Error = &e.0;
            assert_eq!(inner, &crate::error::Error::NoDevice);
            assert_eq!(e.to_string(), crate::error::Error::NoDevice.to_string());
            assert!(format!("{:?}", e.0).contains("NoDevice"));
            assert!(format!("{e:?}").starts_with("NcclError(NoDevice"));
            let back: crate::error::Error = e.clone().into();
            assert_eq!(back, crate::error::Error::NoDevice);
            assert_eq!(NcclError::from(crate::error::Error::EmptyGroup).0, crate::error::Error::EmptyGroup);
            fn boxes(e: NcclError) -> Box<dyn std::error::Error + Send + Sync + 'static> {
                Box::new(e)
            }
            assert_eq!(boxes(e).to_string(), "no CUDA device found");
        }

        #[test]
        fn question_mark_converts_both_ways() {
            fn peer() -> crate::error::Result<()> {
                Err(crate::error::Error::EmptyGroup)
            }
            fn compat() -> Result<(), NcclError> {
                peer()?;
                Ok(())
            }
            fn back() -> crate::error::Result<()> {
                compat()?;
                Ok(())
            }
            assert_eq!(compat().unwrap_err().0, crate::error::Error::EmptyGroup);
            assert_eq!(back().unwrap_err(), crate::error::Error::EmptyGroup);
        }

        #[test]
        fn groups_are_refused_with_a_typed_error() {
            for (name, r) in [("group_start", group_start()), ("group_end", group_end())] {
                match r {
                    Err(NcclError(crate::error::Error::Unsupported(why))) => assert!(why.starts_with(name), "{why}"),
                    other => panic!("{name}: {other:?}"),
                }
            }
        }
    }
}

pub mod safe {
    //! `cudarc::nccl::safe` over [`crate::comm::Comm`]: [`Comm`], [`Id`],
    //! [`ReduceOp`], [`NcclType`], with cudarc 0.19's names, generic
    //! parameters, argument types and order (see [`super`] for what differs).

    pub use super::result::{group_end, group_start};
    use super::result::{NcclError, NcclStatus};
    use crate::dtype::{DType, Element};
    use crate::error::{cudarc_err, Error};
    use cudarc::driver::{CudaContext, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice, ValidAsZeroBits};
    use std::ffi::c_char;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, OnceLock};

    /// Bytes of an [`Id`], as of NCCL's `ncclUniqueId`.
    const ID_BYTES: usize = 128;
    const _: () = assert!(crate::ipc::Id::BYTES == ID_BYTES, "compat::nccl::Id carries a cuda_peer::Id's bytes");

    /// Where a job's ranks meet, as cudarc's `Id`: the 128 bytes of a
    /// [`crate::ipc::Id`] (rank 0's rendezvous address and port, and a new job
    /// secret) as `c_char`s. Rank 0 makes it with [`Id::new`] and sends
    /// [`Id::internal`] to the other ranks by the application's own channel;
    /// they rebuild it with [`Id::uninit`]. Anyone who holds the bytes can join
    /// the job: send them only to its ranks. Its `Debug` shows the address,
    /// never the secret.
    #[derive(Clone, Copy, PartialEq, Eq)]
    pub struct Id {
        internal: [c_char; ID_BYTES],
    }

    impl Id {
        /// A new id for a job whose rank 0 is this process ([`crate::ipc::Id::new`]):
        /// a listener is bound now (so no other process can take its port before
        /// the ranks meet) on `CUDA_PEER_BIND_ADDR`, or else this host's first
        /// non-loopback address, and kept for this process's
        /// [`Comm::from_rank`] as rank 0. Needs no GPU and no NCCL.
        pub fn new() -> Result<Self, NcclError> {
            Ok(Id::from(crate::ipc::Id::new()?))
        }

        /// The id whose bytes rank 0 sent ([`Id::internal`]). Not checked here
        /// (cudarc's does not check either, and returns no `Result`):
        /// [`Comm::from_rank`] refuses bytes that are not a cuda-peer id
        /// ([`crate::error::Error::InvalidArgument`]), an `ncclUniqueId` among them.
        pub fn uninit(internal: [c_char; 128]) -> Self {
            Id { internal }
        }

        /// The 128 bytes to send to the other ranks.
        pub fn internal(&self) -> &[c_char; 128] {
            &self.internal
        }

        /// The id's bytes as `u8`s.
        fn bytes(&self) -> [u8; ID_BYTES] {
            self.internal.map(|c| c.to_ne_bytes()[0])
        }
    }

    impl From<crate::ipc::Id> for Id {
        fn from(id: crate::ipc::Id) -> Self {
            Id { internal: id.as_bytes().map(|b| c_char::from_ne_bytes([b])) }
        }
    }

    impl TryFrom<Id> for crate::ipc::Id {
        type Error = NcclError;

        /// The cuda-peer id these bytes are, or [`crate::error::Error::InvalidArgument`].
        fn try_from(id: Id) -> Result<Self, NcclError> {
            Ok(crate::ipc::Id::from_bytes(&id.bytes())?)
        }
    }

    impl std::fmt::Debug for Id {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            match crate::ipc::Id::try_from(*self) {
                Ok(id) => write!(f, "Id({})", id.addr()),
                Err(_) => f.write_str("Id(not a cuda-peer id)"),
            }
        }
    }

    /// A reduction, as cudarc's `ReduceOp` (each variant is the
    /// [`crate::dtype::ReduceOp`] of the same name).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum ReduceOp {
        /// Sum ([`crate::dtype::ReduceOp::Sum`]; integers wrap).
        Sum,
        /// Product ([`crate::dtype::ReduceOp::Prod`]; integers wrap).
        Prod,
        /// Maximum ([`crate::dtype::ReduceOp::Max`]; NaN in any input gives NaN).
        Max,
        /// Minimum ([`crate::dtype::ReduceOp::Min`]; NaN in any input gives NaN).
        Min,
        /// Mean over the ranks ([`crate::dtype::ReduceOp::Avg`]): floating-point types
        /// only; on integers a call returns [`crate::error::Error::UnsupportedOp`]
        /// (NCCL's `ncclAvg` truncates).
        Avg,
    }

    impl From<&ReduceOp> for crate::dtype::ReduceOp {
        fn from(op: &ReduceOp) -> Self {
            match op {
                ReduceOp::Sum => crate::dtype::ReduceOp::Sum,
                ReduceOp::Prod => crate::dtype::ReduceOp::Prod,
                ReduceOp::Max => crate::dtype::ReduceOp::Max,
                ReduceOp::Min => crate::dtype::ReduceOp::Min,
                ReduceOp::Avg => crate::dtype::ReduceOp::Avg,
            }
        }
    }

    impl From<ReduceOp> for crate::dtype::ReduceOp {
        fn from(op: ReduceOp) -> Self {
            crate::dtype::ReduceOp::from(&op)
        }
    }

    impl From<crate::dtype::ReduceOp> for ReduceOp {
        fn from(op: crate::dtype::ReduceOp) -> Self {
            match op {
                crate::dtype::ReduceOp::Sum => ReduceOp::Sum,
                crate::dtype::ReduceOp::Prod => ReduceOp::Prod,
                crate::dtype::ReduceOp::Max => ReduceOp::Max,
                crate::dtype::ReduceOp::Min => ReduceOp::Min,
                crate::dtype::ReduceOp::Avg => ReduceOp::Avg,
            }
        }
    }

    /// The element types of the collectives, in the place of cudarc's
    /// `NcclType`: the ten it shares with cudarc ([`crate::dtype::DType`]: `f32`,
    /// `f64`, `f16`, `bf16`, `i8`, `i32`, `i64`, `u8`, `u32`, `u64`; not fp8,
    /// which cudarc's lacks: use [`crate::comm::Comm`] for fp8), each an
    /// [`Element`]. (Not `char`, which cudarc lists as NCCL's one-byte
    /// `ncclUint8` though a Rust `char` is four bytes.) Every type here is
    /// also valid as zero bits, so that [`Comm::reduce`] can give a rank that
    /// passes no receive buffer one of its own. Only these types implement it
    /// ([`Element`] is sealed).
    pub trait NcclType: Element + ValidAsZeroBits {
        /// The element type, as cuda-peer names it (cudarc's returns an
        /// `ncclDataType_t`).
        fn as_nccl_type() -> DType;
    }

    macro_rules! nccl_type {
        ($($t:ty),* $(,)?) => {$(
            impl NcclType for $t {
                fn as_nccl_type() -> DType {
                    <$t as Element>::DTYPE
                }
            }
        )*};
    }
    nccl_type!(f32, f64, i8, i32, i64, u8, u32, u64, half::f16, half::bf16);

    /// What this module records about one communicator: whether it was
    /// aborted, and the first failure a call returned that leaves it unusable.
    #[derive(Debug, Default)]
    struct State {
        aborted: AtomicBool,
        failure: OnceLock<Error>,
    }

    impl State {
        /// The error of a call on an aborted communicator.
        fn aborted_error() -> Error {
            Error::GroupFailed { reason: "aborted on this rank (cuda_peer::compat::nccl::Comm::abort)".into() }
        }

        fn abort(&self) {
            self.aborted.store(true, Ordering::SeqCst);
        }

        fn is_aborted(&self) -> bool {
            self.aborted.load(Ordering::SeqCst)
        }

        /// Whether a call may go on: not after [`Self::abort`].
        fn admit(&self) -> Result<(), NcclError> {
            if self.is_aborted() {
                return Err(NcclError(State::aborted_error()));
            }
            Ok(())
        }

        /// Whether `e` leaves the communicator unusable (see
        /// [`Comm::async_error`]), as opposed to an error about one call's
        /// arguments, after which it stays usable.
        fn breaks_comm(e: &Error) -> bool {
            matches!(
                e,
                Error::PeerTimeout { .. }
                    | Error::GroupFailed { .. }
                    | Error::Timeout { .. }
                    | Error::Bootstrap { .. }
                    | Error::Nccl { .. }
                    | Error::Driver { .. }
                    | Error::Load(_)
                    | Error::Internal(_)
            )
        }

        /// A call's result as cudarc's, recording the first failure that
        /// leaves the communicator unusable.
        fn outcome(&self, r: crate::error::Result<()>) -> Result<NcclStatus, NcclError> {
            match r {
                Ok(()) => Ok(NcclStatus::Success),
                Err(e) => {
                    if State::breaks_comm(&e) {
                        // Only the first is kept: later ones are its consequences.
                        let _ = self.failure.set(e.clone());
                    }
                    Err(NcclError(e))
                }
            }
        }

        /// The recorded failure, else the abort, else `Ok`.
        fn async_error(&self) -> Result<(), NcclError> {
            if let Some(e) = self.failure.get() {
                return Err(NcclError(e.clone()));
            }
            self.admit()
        }
    }

    /// A collective's root rank as cuda-peer's: refused when negative.
    fn root_rank(root: i32) -> crate::error::Result<usize> {
        usize::try_from(root).map_err(|_| Error::InvalidArgument(format!("root rank {root} is negative")))
    }

    /// A peer's rank from cudarc's `i32`.
    fn peer_rank(peer: i32) -> crate::error::Result<usize> {
        usize::try_from(peer).map_err(|_| Error::InvalidArgument(format!("peer rank {peer} is negative")))
    }

    /// One rank's communicator, as cudarc's `Comm`, over a [`crate::comm::Comm`]: the
    /// same engine (cuda-peer between the ranks of one host, NCCL across hosts)
    /// with cudarc's method names and signatures. Every collective enqueues on
    /// [`Comm::stream`] and returns [`NcclStatus::Success`]; buffers written or
    /// read on other streams are ordered with it. Every rank must make the same
    /// calls in the same order.
    ///
    /// Unlike cudarc's it is `Send + Sync`, never panics, and can be aborted
    /// ([`Comm::abort`]) and polled ([`Comm::async_error`]); its
    /// [`Comm::group`] enqueues the collectives called through it at once
    /// (see [`Group`]).
    ///
    /// Dropping it never panics: it waits for this rank's enqueued work on the
    /// stream (the peers' memory that its kernels write must outlive them; the
    /// kernels give up at the barrier timeout, so a dead peer does not hold it
    /// forever), logs a failure instead of panicking, then frees the
    /// communicator; an NCCL communicator underneath is aborted
    /// (`ncclCommAbort`), never destroyed with a wait on a dead peer.
    #[derive(Debug)]
    pub struct Comm {
        inner: crate::comm::Comm,
        state: State,
    }

    impl From<crate::comm::Comm> for Comm {
        /// The cudarc-shaped communicator over `inner` (made with
        /// [`crate::comm::Comm::from_env`], with options, ...).
        fn from(inner: crate::comm::Comm) -> Self {
            Comm { inner, state: State::default() }
        }
    }

    impl Comm {
        /// One communicator per stream, rank r on `streams[r]`, for one process
        /// driving every rank ([`crate::comm::Comm::from_devices`]). Unlike cudarc's,
        /// each must be called from a thread of its own, concurrently with the
        /// others: a call waits for every rank's (this module has no
        /// `group_start`/`group_end` for one thread to drive them all).
        pub fn from_devices(streams: Vec<Arc<CudaStream>>) -> Result<Vec<Self>, NcclError> {
            Ok(crate::comm::Comm::from_devices(streams)?.into_iter().map(Comm::from).collect())
        }

        /// The stream every collective is enqueued on (a clone of the `Arc`, as
        /// cudarc returns it).
        pub fn stream(&self) -> Arc<CudaStream> {
            self.inner.stream().clone()
        }

        /// This rank's device context.
        pub fn context(&self) -> &Arc<CudaContext> {
            self.inner.context()
        }

        /// This rank's device ordinal.
        pub fn ordinal(&self) -> usize {
            self.inner.ordinal()
        }

        /// This rank.
        pub fn rank(&self) -> usize {
            self.inner.rank()
        }

        /// How many ranks the communicator has.
        pub fn world_size(&self) -> usize {
            self.inner.world_size()
        }

        /// Rank `rank` of `world_size`, meeting the others where `id` says
        /// ([`crate::comm::Comm::from_rank`]), every collective enqueued on `stream`.
        /// Blocks until every rank has joined, bounded (60 s by default). Bytes
        /// in `id` that are not a cuda-peer [`Id`] are
        /// [`crate::error::Error::InvalidArgument`].
        pub fn from_rank(stream: Arc<CudaStream>, rank: usize, world_size: usize, id: Id) -> Result<Self, NcclError> {
            let id = crate::ipc::Id::try_from(id)?;
            Ok(Comm::from(crate::comm::Comm::from_rank(stream, rank, world_size, id)?))
        }

        /// The cuda-peer communicator underneath, for what cudarc's API has no
        /// name for ([`crate::comm::Comm::synchronize`], [`crate::comm::Comm::engine`],
        /// [`crate::comm::Comm::exchange`]). Calls made on it directly are not
        /// refused after [`Self::abort`] nor recorded for
        /// [`Self::async_error`].
        pub fn inner(&self) -> &crate::comm::Comm {
            &self.inner
        }

        /// Marks this communicator failed, on this rank: from now on every call
        /// on it returns [`crate::error::Error::GroupFailed`] (saying it was aborted)
        /// without reaching the communicator underneath, and
        /// [`Self::async_error`] reports it. It cannot be undone: make a new
        /// communicator (on every rank).
        ///
        /// What it does not do (cuda-peer's communicator has no abort of its
        /// own yet): stop or undo work already enqueued on the stream (kernels
        /// in flight finish, or give up at the barrier timeout); interrupt a
        /// call another thread is in at the moment; tell the other ranks (their
        /// next collective waits for this rank until its timeout, then fails:
        /// abort on every rank, or let them time out); free anything (dropping
        /// the communicator does). Safe to call from any thread, any number of
        /// times.
        pub fn abort(&self) {
            self.state.abort();
        }

        /// The failure this communicator has already recorded, without waiting
        /// and without touching the device (NCCL's `ncclCommGetAsyncError`, in
        /// cuda-peer's terms): `Err` after [`Self::abort`], or after a call
        /// returned an error that leaves the communicator unusable (a peer that
        /// gave up or timed out, a failed group, a bootstrap, NCCL or driver
        /// failure: the first such error, as it was returned); `Ok(())`
        /// otherwise. Errors about one call's arguments (lengths, devices, a
        /// root, a type, ranks that called different collectives) do not count:
        /// the communicator stays usable after them.
        ///
        /// A failure that no call has returned yet is asked of the
        /// communicator underneath, without waiting
        /// ([`crate::comm::Comm::async_error`]: a peer that gave up on the device,
        /// NCCL's asynchronous error), and recorded like a call's.
        pub fn async_error(&self) -> Result<(), NcclError> {
            self.state.async_error()?;
            self.call(|c| c.async_error()).map(|_| ())
        }

        /// Runs one call of the communicator underneath, unless aborted, and
        /// records its failure.
        pub(crate) fn call(&self, f: impl FnOnce(&crate::comm::Comm) -> crate::error::Result<()>) -> Result<NcclStatus, NcclError> {
            self.state.admit()?;
            self.state.outcome(f(&self.inner))
        }

        /// Sends `data` to rank `peer`, matched in order with that rank's
        /// [`Self::recv`] from this one ([`crate::comm::Comm::send`]). Alone, a send
        /// moves its data only while the peer's receive runs: two ranks that
        /// send to each other put their sends and receives in one
        /// [`Self::group`].
        pub fn send<S: DevicePtr<T>, T: NcclType>(&self, data: &S, peer: i32) -> Result<(), NcclError> {
            self.call(|c| c.send::<T, S>(data, peer_rank(peer)?)).map(|_| ())
        }

        /// Receives into `buff` what rank `peer` sends this one
        /// ([`crate::comm::Comm::recv`]).
        pub fn recv<R: DevicePtrMut<T>, T: NcclType>(&self, buff: &mut R, peer: i32) -> Result<NcclStatus, NcclError> {
            self.call(|c| c.recv::<T, R>(buff, peer_rank(peer)?))
        }

        /// Every rank's `recvbuff` becomes rank `root`'s `sendbuff`, which only
        /// the root passes (`None` elsewhere; `None` on the root is an error,
        /// where cudarc only debug-asserts) ([`crate::comm::Comm::broadcast`]).
        pub fn broadcast<S: DevicePtr<T>, R: DevicePtrMut<T>, T: NcclType>(
            &self,
            sendbuff: Option<&S>,
            recvbuff: &mut R,
            root: i32,
        ) -> Result<NcclStatus, NcclError> {
            self.call(|c| c.broadcast::<T, S, R>(sendbuff, recvbuff, root_rank(root)?))
        }

        /// In place version of [`Self::broadcast`]: every rank's `recvbuff`
        /// becomes rank `root`'s ([`crate::comm::Comm::broadcast_in_place`]).
        pub fn broadcast_in_place<R: DevicePtrMut<T>, T: NcclType>(&self, recvbuff: &mut R, root: i32) -> Result<NcclStatus, NcclError> {
            self.call(|c| c.broadcast_in_place::<T, R>(recvbuff, root_rank(root)?))
        }

        /// `recvbuff` (`world_size()` times `sendbuff`'s length) becomes every
        /// rank's `sendbuff` in rank order ([`crate::comm::Comm::all_gather`]).
        pub fn all_gather<S: DevicePtr<T>, R: DevicePtrMut<T>, T: NcclType>(&self, sendbuff: &S, recvbuff: &mut R) -> Result<NcclStatus, NcclError> {
            self.call(|c| c.all_gather::<T, S, R>(sendbuff, recvbuff))
        }

        /// `recvbuff` becomes the reduction, in rank order, of every rank's
        /// `sendbuff` ([`crate::comm::Comm::all_reduce`]).
        pub fn all_reduce<S: DevicePtr<T>, R: DevicePtrMut<T>, T: NcclType>(
            &self,
            sendbuff: &S,
            recvbuff: &mut R,
            reduce_op: &ReduceOp,
        ) -> Result<NcclStatus, NcclError> {
            self.call(|c| c.all_reduce::<T, S, R>(sendbuff, recvbuff, reduce_op.into()))
        }

        /// In place version of [`Self::all_reduce`]
        /// ([`crate::comm::Comm::all_reduce_in_place`]).
        pub fn all_reduce_in_place<R: DevicePtrMut<T>, T: NcclType>(&self, buff: &mut R, reduce_op: &ReduceOp) -> Result<NcclStatus, NcclError> {
            self.call(|c| c.all_reduce_in_place::<T, R>(buff, reduce_op.into()))
        }

        /// Rank `root`'s `recvbuff` becomes the reduction of every rank's
        /// `sendbuff` ([`crate::comm::Comm::reduce`]). The root passes a receive
        /// buffer (`None` there is an error, where cudarc only debug-asserts);
        /// another rank may pass `None`, and then gets one allocated on the
        /// stream for the call (as long as `sendbuff`; cuda-peer's reduce takes
        /// one on every rank), freed on the stream after it; a buffer it passes
        /// is not written.
        pub fn reduce<S: DevicePtr<T>, R: DevicePtrMut<T>, T: NcclType>(
            &self,
            sendbuff: &S,
            recvbuff: Option<&mut R>,
            reduce_op: &ReduceOp,
            root: i32,
        ) -> Result<NcclStatus, NcclError> {
            self.call(|c| {
                let (op, root) = (reduce_op.into(), root_rank(root)?);
                match recvbuff {
                    Some(recv) if root == c.rank() || recv.len() == sendbuff.len() => c.reduce::<T, S, R>(sendbuff, recv, op, root),
                    None if root == c.rank() => Err(Error::InvalidArgument(format!("reduce: rank {root} is the root and passes no receive buffer"))),
                    // A rank but the root with no receive buffer, or one of
                    // another length, which NCCL ignores there: scratch of
                    // the send's length (at least one element: the driver
                    // allocates none; the call sees `len` of them).
                    _ => {
                        let len = sendbuff.len();
                        let mut recv = c
                            .stream()
                            .alloc_zeros::<T>(len.max(1))
                            .map_err(cudarc_err("reduce: a receive buffer for a rank that is not the root"))?;
                        c.reduce::<T, S, _>(sendbuff, &mut recv.slice_mut(0..len), op, root)
                    }
                }
            })
        }

        /// In place version of [`Self::reduce`]: rank `root`'s `recvbuff`
        /// becomes the reduction of every rank's; the others' are not written
        /// ([`crate::comm::Comm::reduce_in_place`]).
        pub fn reduce_in_place<R: DevicePtrMut<T>, T: NcclType>(
            &self,
            recvbuff: &mut R,
            reduce_op: &ReduceOp,
            root: i32,
        ) -> Result<NcclStatus, NcclError> {
            self.call(|c| c.reduce_in_place::<T, R>(recvbuff, reduce_op.into(), root_rank(root)?))
        }

        /// `recvbuff` (c elements) becomes block `rank()` of the reduction of
        /// every rank's `sendbuff` (`world_size()` times c elements)
        /// ([`crate::comm::Comm::reduce_scatter`]).
        pub fn reduce_scatter<S: DevicePtr<T>, R: DevicePtrMut<T>, T: NcclType>(
            &self,
            sendbuff: &S,
            recvbuff: &mut R,
            reduce_op: &ReduceOp,
        ) -> Result<NcclStatus, NcclError> {
            self.call(|c| c.reduce_scatter::<T, S, R>(sendbuff, recvbuff, reduce_op.into()))
        }
    }

    impl Drop for Comm {
        /// Never panics (see [`Comm`]): the communicator underneath waits for
        /// this rank's enqueued work and logs, never panics, on a failure; this
        /// only notes, at debug level, a communicator dropped after an abort or
        /// a recorded failure.
        fn drop(&mut self) {
            if let Err(e) = self.state.async_error() {
                log::debug!("cuda-peer: compat::nccl::Comm rank {} dropped after: {e}", self.inner.rank());
            }
        }
    }

    /// A send or a receive a [`Group`] holds until it ends.
    trait Pending {
        /// Adds it to `group`, borrowing its view for as long as the group.
        fn add<'x>(&'x mut self, group: &mut crate::comm::group::Group<'x>) -> crate::error::Result<()>;
    }

    enum Transfer<'v, T> {
        Send(CudaView<'v, T>, usize),
        Recv(CudaViewMut<'v, T>, usize),
    }

    impl<T: NcclType> Pending for Transfer<'_, T> {
        fn add<'x>(&'x mut self, group: &mut crate::comm::group::Group<'x>) -> crate::error::Result<()> {
            match self {
                Transfer::Send(view, peer) => group.send::<T, _>(view, *peer),
                Transfer::Recv(view, peer) => group.recv::<T, _>(view, *peer),
            }
        }
    }

    /// The sends and receives of one rank, started together when the group
    /// ends, as cudarc's `Group` (made by [`Comm::group`]; the views it is
    /// given must outlive it). Its sends and receives are those of
    /// [`crate::comm::group::Group`]: matched with each peer's in order, two
    /// ranks that send to each other inside a group never deadlock, and
    /// lengths that differ fail both ranks' communicators with a typed error.
    ///
    /// Differences from cudarc's:
    /// - The collectives called through a group ([`Group::all_reduce`], ...)
    ///   are enqueued at once, each as [`Comm`]'s own call, before the
    ///   group's sends and receives; NCCL orders nothing inside a group either,
    ///   and every rank must still call the collectives in the same order.
    /// - Dropping it ends it and logs an error where cudarc's panics;
    ///   [`Group::end`] ends it and returns the error.
    pub struct Group<'g> {
        comm: &'g Comm,
        pending: Vec<Box<dyn Pending + 'g>>,
        ended: bool,
    }

    impl std::fmt::Debug for Group<'_> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Group").field("rank", &self.comm.rank()).field("pending", &self.pending.len()).finish()
        }
    }

    impl Comm {
        /// Starts a group of sends and receives (see [`Group`]), as cudarc's
        /// `Comm::group`.
        pub fn group(&self) -> Group<'_> {
            Group { comm: self, pending: Vec::new(), ended: false }
        }
    }

    /// A peer's rank from cudarc's `i32`, in range.
    fn peer_of(comm: &Comm, peer: i32) -> Result<usize, NcclError> {
        let p = peer_rank(peer)?;
        crate::traits::check_peer("group", p, comm.world_size())?;
        Ok(p)
    }

    impl<'g> Group<'g> {
        /// The communicator the group belongs to.
        pub fn comm(&self) -> &'g Comm {
            self.comm
        }

        /// Adds a send of `data` to rank `peer` ([`Comm::send`]); it moves when
        /// the group ends.
        pub fn send<'s: 'g, T: NcclType>(&mut self, data: CudaView<'s, T>, peer: i32) -> Result<(), NcclError> {
            let peer = peer_of(self.comm, peer)?;
            crate::copy::check_context("send", "send", self.comm.inner().context(), data.stream().context())?;
            self.pending.push(Box::new(Transfer::Send(data, peer)));
            Ok(())
        }

        /// Adds a receive into `buff` from rank `peer` ([`Comm::recv`]); it
        /// moves when the group ends.
        pub fn recv<'r: 'g, T: NcclType>(&mut self, buff: CudaViewMut<'r, T>, peer: i32) -> Result<NcclStatus, NcclError> {
            let peer = peer_of(self.comm, peer)?;
            crate::copy::check_context("recv", "recv", self.comm.inner().context(), buff.stream().context())?;
            self.pending.push(Box::new(Transfer::Recv(buff, peer)));
            Ok(NcclStatus::Success)
        }

        /// [`Comm::broadcast`], enqueued at once.
        pub fn broadcast<'s: 'g, 'r: 'g, T: NcclType>(
            &mut self,
            sendbuff: Option<CudaView<'s, T>>,
            mut recvbuff: CudaViewMut<'r, T>,
            root: i32,
        ) -> Result<NcclStatus, NcclError> {
            self.comm.broadcast(sendbuff.as_ref(), &mut recvbuff, root)
        }

        /// [`Comm::broadcast_in_place`], enqueued at once.
        pub fn broadcast_in_place<'r: 'g, T: NcclType>(&mut self, mut recvbuff: CudaViewMut<'r, T>, root: i32) -> Result<NcclStatus, NcclError> {
            self.comm.broadcast_in_place(&mut recvbuff, root)
        }

        /// [`Comm::all_gather`], enqueued at once.
        pub fn all_gather<'s: 'g, 'r: 'g, T: NcclType>(
            &mut self,
            sendbuff: CudaView<'s, T>,
            mut recvbuff: CudaViewMut<'r, T>,
        ) -> Result<NcclStatus, NcclError> {
            self.comm.all_gather(&sendbuff, &mut recvbuff)
        }

        /// [`Comm::all_reduce`], enqueued at once.
        pub fn all_reduce<'s: 'g, 'r: 'g, T: NcclType>(
            &mut self,
            sendbuff: CudaView<'s, T>,
            mut recvbuff: CudaViewMut<'r, T>,
            reduce_op: &ReduceOp,
        ) -> Result<NcclStatus, NcclError> {
            self.comm.all_reduce(&sendbuff, &mut recvbuff, reduce_op)
        }

        /// [`Comm::all_reduce_in_place`], enqueued at once.
        pub fn all_reduce_in_place<'r: 'g, T: NcclType>(
            &mut self,
            mut buff: CudaViewMut<'r, T>,
            reduce_op: &ReduceOp,
        ) -> Result<NcclStatus, NcclError> {
            self.comm.all_reduce_in_place(&mut buff, reduce_op)
        }

        /// [`Comm::reduce`], enqueued at once.
        pub fn reduce<'s: 'g, 'r: 'g, T: NcclType>(
            &mut self,
            sendbuff: CudaView<'s, T>,
            mut recvbuff: Option<CudaViewMut<'r, T>>,
            reduce_op: &ReduceOp,
            root: i32,
        ) -> Result<NcclStatus, NcclError> {
            self.comm.reduce(&sendbuff, recvbuff.as_mut(), reduce_op, root)
        }

        /// [`Comm::reduce_in_place`], enqueued at once.
        pub fn reduce_in_place<'s: 'g, T: NcclType>(
            &mut self,
            mut recvbuff: CudaViewMut<'s, T>,
            reduce_op: &ReduceOp,
            root: i32,
        ) -> Result<NcclStatus, NcclError> {
            self.comm.reduce_in_place(&mut recvbuff, reduce_op, root)
        }

        /// [`Comm::reduce_scatter`], enqueued at once.
        pub fn reduce_scatter<'s: 'g, 'r: 'g, T: NcclType>(
            &mut self,
            sendbuff: CudaView<'s, T>,
            mut recvbuff: CudaViewMut<'r, T>,
            reduce_op: &ReduceOp,
        ) -> Result<NcclStatus, NcclError> {
            self.comm.reduce_scatter(&sendbuff, &mut recvbuff, reduce_op)
        }

        /// Ends the group: enqueues its sends and receives together on the
        /// communicator's stream (their buffers are then ordered after them).
        pub fn end(mut self) -> Result<(), NcclError> {
            self.finish()
        }

        fn finish(&mut self) -> Result<(), NcclError> {
            if std::mem::replace(&mut self.ended, true) || self.pending.is_empty() {
                return Ok(());
            }
            let pending = &mut self.pending;
            self.comm
                .call(|c| {
                    let mut group = c.group();
                    for p in pending.iter_mut() {
                        p.add(&mut group)?;
                    }
                    group.end()
                })
                .map(|_| ())
        }
    }

    impl Drop for Group<'_> {
        /// Ends the group ([`Group::end`]); an error is logged, never a panic
        /// (the communicator has recorded it: [`Comm::async_error`]).
        fn drop(&mut self) {
            if let Err(e) = self.finish() {
                log::warn!("cuda-peer: compat::nccl group ended with an error: {e}");
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use cudarc::driver::CudaSlice;
        use std::net::{IpAddr, Ipv4Addr};

        #[test]
        fn every_reduce_op_is_cuda_peers_of_the_same_name() {
            let pairs = [
                (ReduceOp::Sum, crate::dtype::ReduceOp::Sum),
                (ReduceOp::Prod, crate::dtype::ReduceOp::Prod),
                (ReduceOp::Max, crate::dtype::ReduceOp::Max),
                (ReduceOp::Min, crate::dtype::ReduceOp::Min),
                (ReduceOp::Avg, crate::dtype::ReduceOp::Avg),
            ];
            for (ours, theirs) in pairs {
                assert_eq!(crate::dtype::ReduceOp::from(&ours), theirs);
                assert_eq!(crate::dtype::ReduceOp::from(ours), theirs);
                assert_eq!(ReduceOp::from(theirs), ours);
            }
            let mapped: Vec<crate::dtype::ReduceOp> = pairs.iter().map(|(o, _)| o.into()).collect();
            assert_eq!(mapped.len(), crate::dtype::ReduceOp::ALL.len());
            assert!(crate::dtype::ReduceOp::ALL.iter().all(|o| mapped.contains(o)), "every cuda-peer op is reached");
        }

        #[test]
        fn an_id_round_trips_through_its_c_chars() {
            let peer = crate::ipc::Id::with_addr(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap();
            let id = Id::from(peer);
            assert_eq!(id.bytes(), *peer.as_bytes());
            // What a rank sends and what the other ranks rebuild from it.
            let sent: [c_char; 128] = *id.internal();
            let got = Id::uninit(sent);
            assert_eq!(got, id);
            assert_eq!(crate::ipc::Id::try_from(got).unwrap(), peer);
            assert_eq!(format!("{got:?}"), format!("Id({})", peer.addr()));
            assert!(!format!("{got:?}").contains(&peer.secret().expose()[..8]), "Debug hides the secret");
            crate::ipc::id::take_listener(peer.addr()).expect("the listener kept for rank 0");
        }

        #[test]
        fn id_new_needs_only_a_socket() {
            let id = Id::new().unwrap();
            let peer = crate::ipc::Id::try_from(id).unwrap();
            assert_ne!(peer.addr().port(), 0);
            assert_eq!(Id::uninit(*id.internal()), id);
            crate::ipc::id::take_listener(peer.addr()).expect("the listener kept for rank 0");
        }

        #[test]
        fn every_byte_value_survives_c_char() {
            let mut internal = [0 as c_char; 128];
            for (i, c) in internal.iter_mut().enumerate() {
                *c = c_char::from_ne_bytes([(i * 2) as u8]);
            }
            let id = Id::uninit(internal);
            let bytes = id.bytes();
            assert!(bytes.iter().enumerate().all(|(i, &b)| b == (i * 2) as u8), "{bytes:?}");
            assert_eq!(bytes[127], 254);
        }

        #[test]
        fn bytes_that_are_not_a_cuda_peer_id_are_refused_when_used() {
            let nccl_like = Id::uninit([1 as c_char; 128]);
            match crate::ipc::Id::try_from(nccl_like) {
                Err(NcclError(Error::InvalidArgument(why))) => assert!(why.contains("not a cuda-peer Id"), "{why}"),
                other => panic!("{other:?}"),
            }
            assert_eq!(format!("{nccl_like:?}"), "Id(not a cuda-peer id)");
        }

        /// Generic code bounded by `NcclType` compiles for each type and names
        /// its cuda-peer type.
        #[test]
        fn nccl_type_is_every_cuda_peer_element_type() {
            fn dtype<T: NcclType>() -> DType {
                T::as_nccl_type()
            }
            let got = [
                dtype::<f32>(),
                dtype::<f64>(),
                dtype::<half::f16>(),
                dtype::<half::bf16>(),
                dtype::<i32>(),
                dtype::<i64>(),
                dtype::<u32>(),
                dtype::<u64>(),
                dtype::<i8>(),
                dtype::<u8>(),
            ];
            // cudarc's ten: every cuda-peer type but fp8, which cudarc's
            // `NcclType` does not list.
            assert_eq!(got[..], DType::ALL[..10]);
            fn matches_layout<T: NcclType>() {
                assert_eq!(T::as_nccl_type(), T::DTYPE);
                assert_eq!(T::as_nccl_type().size(), std::mem::size_of::<T>());
            }
            matches_layout::<f32>();
            matches_layout::<half::bf16>();
            matches_layout::<u8>();
        }

        #[test]
        fn an_abort_refuses_every_later_call_and_is_reported() {
            let s = State::default();
            assert!(s.admit().is_ok() && s.async_error().is_ok());
            s.abort();
            s.abort();
            for r in [s.admit(), s.async_error()] {
                match r {
                    Err(NcclError(Error::GroupFailed { reason })) => assert!(reason.contains("abort"), "{reason}"),
                    other => panic!("{other:?}"),
                }
            }
            assert!(s.is_aborted());
        }

        #[test]
        fn the_first_failure_that_breaks_the_comm_is_recorded() {
            let s = State::default();
            assert_eq!(s.outcome(Ok(())), Ok(NcclStatus::Success));
            // Errors about one call's arguments leave the communicator usable.
            let e = Error::LengthMismatch { op: "all_reduce", expected: 4, got: 5 };
            assert_eq!(s.outcome(Err(e.clone())), Err(NcclError(e)));
            let e = Error::Mismatch { rank: 1, ours: "all_reduce".into(), theirs: "broadcast".into() };
            assert!(s.outcome(Err(e)).is_err());
            assert!(s.async_error().is_ok());
            // A peer that gave up does not, and is what async_error reports from then on.
            let first = Error::PeerTimeout { rank: 1, call: 7, after: std::time::Duration::from_secs(10) };
            assert_eq!(s.outcome(Err(first.clone())), Err(NcclError(first.clone())));
            let later = Error::GroupFailed { reason: "out of step".into() };
            assert!(s.outcome(Err(later)).is_err());
            assert_eq!(s.async_error(), Err(NcclError(first.clone())));
            // The calls are still made (the communicator underneath refuses them itself); an abort refuses them here.
            assert!(s.admit().is_ok());
            s.abort();
            assert!(s.admit().is_err());
            assert_eq!(s.async_error(), Err(NcclError(first)), "the cause stays what is reported");
        }

        #[test]
        fn a_root_is_not_negative() {
            assert_eq!(root_rank(0), Ok(0));
            assert_eq!(root_rank(7), Ok(7));
            assert!(matches!(root_rank(-1), Err(Error::InvalidArgument(_))));
        }

        #[test]
        fn a_comm_may_be_shared_between_threads() {
            fn send_sync<T: Send + Sync>() {}
            send_sync::<Comm>();
            send_sync::<Id>();
            send_sync::<NcclError>();
        }

        /// cudarc's calls, with its generic parameters in its order
        /// (turbofish), type-check here; not run (no GPU).
        #[allow(dead_code)]
        fn cudarcs_signatures(comm: &Comm, x: &CudaSlice<f32>, y: &mut CudaSlice<f32>) -> Result<(), NcclError> {
            type S = CudaSlice<f32>;
            let _: NcclStatus = comm.all_reduce::<S, S, f32>(x, y, &ReduceOp::Sum)?;
            comm.all_reduce_in_place::<S, f32>(y, &ReduceOp::Avg)?;
            comm.all_gather::<S, S, f32>(x, y)?;
            comm.reduce_scatter::<S, S, f32>(x, y, &ReduceOp::Max)?;
            comm.broadcast::<S, S, f32>(Some(x), y, 0)?;
            comm.broadcast(None::<&S>, y, 0)?;
            comm.broadcast_in_place::<S, f32>(y, 0)?;
            comm.reduce::<S, S, f32>(x, Some(y), &ReduceOp::Min, 0)?;
            comm.reduce(x, None::<&mut S>, &ReduceOp::Prod, 0)?;
            comm.reduce_in_place::<S, f32>(y, &ReduceOp::Sum, 0)?;
            comm.send::<S, f32>(x, 1)?;
            let _: NcclStatus = comm.recv::<S, f32>(y, 1)?;
            let _: Arc<CudaStream> = comm.stream();
            let _: (&Arc<CudaContext>, usize, usize, usize) = (comm.context(), comm.ordinal(), comm.rank(), comm.world_size());
            let _: NcclStatus = group_start()?;
            let _: NcclStatus = group_end()?;
            comm.abort();
            comm.async_error()
        }
    }
}

pub use safe::*;
