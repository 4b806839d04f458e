//! The collectives of a job whose ranks span hosts, in two tiers: inside
//! each host by cuda-peer ([`Comm`], over peer or shared host memory),
//! across hosts by NCCL ([`NcclComm`]), one NCCL communicator per local
//! index (the ranks with the same place on every host).
//!
//! All-reduce of c elements on L ranks per host: a reduce-scatter inside
//! the host leaves each rank c / L elements of the host's reduction; NCCL
//! all-reduces those across hosts (each link between hosts carries 1 / L
//! of the message); an all-gather inside the host puts the whole back
//! together. The c mod L elements left over take an all-reduce inside the
//! host and one across. Both tiers enqueue on one stream (the host
//! communicator's), so each step follows the one before it.
//!
//! Layout: every host runs the same number of ranks, numbered
//! contiguously (host h has ranks h·L to h·L + L − 1, as torchrun and
//! `cuda-peer-run` number them). Where a job's hosts do not fit,
//! [`crate::comm::Comm`] uses NCCL alone.
//!
//! The per-index NCCL communicators join only ranks of one local index, so
//! they cannot carry a transfer between any two ranks. A third
//! communicator, NCCL over every rank of the job (`world`), made with the
//! other two (its id from rank 0 through the job's authenticated exchange,
//! with the per-index ids; on the same stream, its creation bounded by the
//! same timeout), carries the point-to-point calls and the uneven
//! collectives: [`Collectives::send`], [`Collectives::recv`], the
//! all-to-alls, [`Collectives::all_gather_v`] and
//! [`Collectives::reduce_scatter_v`] (as [`NcclComm`] does them). It costs
//! one more NCCL communicator per rank (NCCL connects its peers on their
//! first transfer). The all-gather and the broadcast stay in two tiers,
//! NCCL moving their bytes (so they take every [`crate::dtype::Movable`]
//! type).

use super::bootstrap::{agree as gather, Bootstrap, Exchange};
use super::comm::{Comm, CommOptions};
use super::nccl::NcclComm;
use super::secret::JobSecret;
use crate::args;
use crate::dtype::{DType, Element, Movable, ReduceOp};
use crate::error::{check, Error, Result};
use crate::graph::{Captures, KeepAlive};
use crate::sync::Orderer;
use crate::traits::{Collectives, PointToPoint, Transfer};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::{Arc, Mutex};

/// `(hosts, ranks per host)` when the ranks (by their host identities, in
/// rank order) run on at least two hosts, the same number on each, at
/// least two per host, numbered contiguously per host; `None` otherwise.
pub(crate) fn layout(hosts_of: &[Vec<u8>]) -> Option<(usize, usize)> {
    let n = hosts_of.len();
    let per = hosts_of.iter().take_while(|h| **h == hosts_of[0]).count();
    if per < 2 || !n.is_multiple_of(per) || n / per < 2 {
        return None;
    }
    let mut seen: Vec<&Vec<u8>> = Vec::new();
    for block in hosts_of.chunks(per) {
        if block.iter().any(|h| *h != block[0]) || seen.contains(&&block[0]) {
            return None;
        }
        seen.push(&block[0]);
    }
    Some((n / per, per))
}

/// This rank's two NCCL ids, from what the first host's ranks sent
/// (`ids[l]` from its rank of local index l): its local index's (the first
/// 128 bytes of `ids[local]`) and the world's (the 128 after them in
/// rank 0's).
fn nccl_ids(ids: &[Vec<u8>], local: usize) -> std::result::Result<([u8; 128], [u8; 128]), String> {
    let cross = ids.get(local).and_then(|i| i.get(..128)).and_then(|i| i.try_into().ok()).ok_or_else(|| format!("rank {local} sent no NCCL id"))?;
    let world = ids
        .first()
        .and_then(|i| i.get(128..256))
        .and_then(|i| i.try_into().ok())
        .ok_or_else(|| "rank 0 sent no NCCL id for every rank".to_string())?;
    Ok((cross, world))
}

/// A communicator of ranks on several hosts in two tiers (see the module
/// docs); made by [`crate::comm::Comm`].
pub struct Tiered {
    // The NCCL communicators are dropped first: a bounded wait for the
    // shared stream, then each aborted, so that NCCL work stuck on a dead
    // host cannot hold up the host communicator's own wait on the stream.
    /// NCCL over every rank (the point-to-point and uneven calls).
    world: NcclComm,
    cross: NcclComm,
    local: Comm,
    exchange: Box<dyn Exchange>,
    rank: usize,
    size: usize,
    host: usize,
    per_host: usize,
    order: Orderer,
    /// Scratch on the shared stream, grown as calls need; held for a whole
    /// call, which also keeps calls one at a time. Shared with each graph
    /// a call that used it was captured into (`captures`), which may
    /// replay it after the scratch is outgrown or the communicator dropped.
    scratch: Mutex<Option<Arc<CudaSlice<u8>>>>,
    /// The captures calls went into, each holding the scratch of its calls
    /// (the tiers' communicators hold their own).
    captures: Captures,
}

impl std::fmt::Debug for Tiered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tiered")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("host", &self.host)
            .field("per_host", &self.per_host)
            .finish()
    }
}

impl Tiered {
    /// Creates the two tiers for the ranks of `exchange` laid out as
    /// `(hosts, per_host)` ([`layout`]), this rank on `device`. Every rank
    /// calls it at the same time; a failure on any rank is an error on
    /// every rank.
    pub(crate) fn new(exchange: Box<dyn Exchange>, (hosts, per_host): (usize, usize), stream: Arc<CudaStream>, opts: &CommOptions) -> Result<Tiered> {
        let ex = &*exchange;
        let (rank, size) = (ex.rank(), ex.size());
        let (host, local) = (rank / per_host, rank % per_host);
        // 1. Each host's rendezvous, from its first rank: a listener bound
        //    here and kept (no other process can take its port in between),
        //    and a new secret, sent through the job's own exchange.
        let listener = if local == 0 {
            std::net::TcpListener::bind("127.0.0.1:0")
                .map_err(|e| Error::Bootstrap { op: "tiered communicator: a port", reason: e.to_string() })
                .and_then(|l| Ok((l, JobSecret::generate()?)))
                .map(Some)
        } else {
            Ok(None)
        };
        let offer = match &listener {
            Ok(Some((l, secret))) => l
                .local_addr()
                .map(|a| [&a.port().to_le_bytes()[..], secret.expose().as_bytes()].concat())
                .map_err(|e| Error::Bootstrap { op: "tiered communicator: a port", reason: e.to_string() }),
            Ok(None) => Ok(Vec::new()),
            Err(e) => Err(e.clone()),
        };
        let offers = gather(ex, "tiered communicator: host rendezvous", offer)?;
        let listener = listener?;
        let bad = |what: String| Error::Bootstrap { op: "tiered communicator", reason: what };
        let offer = offers.get(host * per_host).ok_or_else(|| bad(format!("no rendezvous from host {host}")))?;
        let (port, secret) = match offer.split_at_checked(2) {
            Some((p, s)) => (
                u16::from_le_bytes([p[0], p[1]]),
                std::str::from_utf8(s).map_err(|_| bad(format!("host {host}'s secret is not text"))).and_then(JobSecret::new)?,
            ),
            None => return Err(bad(format!("host {host}'s first rank sent no port"))),
        };
        // 2. Each local index's NCCL id, from its rank on the first host,
        //    and the world's, from rank 0 after its own (every rank loads
        //    NCCL here, so a missing library stops all).
        let id = match (host, local) {
            (0, 0) => NcclComm::unique_id().and_then(|a| NcclComm::unique_id().map(|b| [a, b].concat())),
            (0, _) => NcclComm::unique_id().map(|id| id.to_vec()),
            _ => crate::ipc::nccl::nccl_version().map(|_| Vec::new()),
        };
        let ids = gather(ex, "tiered communicator: NCCL ids", id)?;
        let (id, world_id) = nccl_ids(&ids, local).map_err(bad)?;
        // 3. This host's communicator, over its own rendezvous.
        let made = Bootstrap::new(local, per_host, local, per_host, "127.0.0.1", port)
            .map(|b| b.with_timeout(opts.timeout).with_secret(secret))
            .and_then(|b| match listener {
                Some((l, _)) => b.serve_on(l),
                None => b.connect(),
            })
            .and_then(|rv| Comm::with_stream(Box::new(rv), stream, opts));
        gather(ex, "tiered communicator: every host's communicator", made.as_ref().map(|_| Vec::new()).map_err(Clone::clone))?;
        let local_comm = made?;
        // 4. The NCCL communicator of this local index, on the same stream
        //    (every rank learns whether all were made before going on).
        let cross = NcclComm::with_stream(&id, host, hosts, local_comm.stream().clone(), opts.barrier_timeout);
        gather(ex, "tiered communicator: every NCCL communicator across hosts", cross.as_ref().map(|_| Vec::new()).map_err(Clone::clone))?;
        let cross = cross?;
        // 5. NCCL over every rank, on the same stream, bounded alike (and
        //    agreed alike).
        let world = NcclComm::with_stream(&world_id, rank, size, local_comm.stream().clone(), opts.barrier_timeout);
        gather(ex, "tiered communicator: every NCCL communicator over every rank", world.as_ref().map(|_| Vec::new()).map_err(Clone::clone))?;
        let world = world?;
        Ok(Tiered {
            world,
            cross,
            local: local_comm,
            exchange,
            rank,
            size,
            host,
            per_host,
            order: Orderer::default(),
            scratch: Mutex::new(None),
            captures: Captures::default(),
        })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many ranks the job has.
    pub fn size(&self) -> usize {
        self.size
    }

    /// This rank's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.local.context()
    }

    /// The stream both tiers enqueue on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.local.stream()
    }

    /// The exchange the ranks met through.
    pub fn exchange(&self) -> &dyn Exchange {
        &*self.exchange
    }

    /// Waits, bounded, for the collectives enqueued so far (both tiers,
    /// and the point-to-point calls over every rank). The tiers share one
    /// stream: NCCL's bounded wait comes first (it aborts NCCL's kernels
    /// when a host has died, which would otherwise hold the stream for
    /// ever), then the host tier's, which finds the stream done.
    pub fn synchronize(&self) -> Result<()> {
        self.cross.synchronize()?;
        self.world.synchronize()?;
        self.local.synchronize()?;
        self.order.synchronize()
    }

    /// Scratch of at least `bytes` on the shared stream (grown, never
    /// under graph capture), and its address. A graph the call is captured
    /// into holds the scratch.
    fn scratch(&self, held: &mut Option<Arc<CudaSlice<u8>>>, bytes: usize) -> Result<u64> {
        let stream = self.stream();
        if held.as_ref().is_none_or(|s| s.len() < bytes) {
            if crate::sync::is_capturing(stream)? {
                return Err(Error::Capture {
                    op: "tiered collective",
                    reason: format!("needs {bytes} bytes of scratch, more than it has: run the call once before capturing it"),
                });
            }
            let grown = stream.alloc_zeros::<u8>(bytes.max(256)).map_err(crate::error::cudarc_err("cuMemAllocAsync (tiered scratch)"))?;
            *held = Some(Arc::new(grown));
        }
        let s = held.as_ref().ok_or_else(|| Error::Internal("tiered scratch missing".into()))?;
        self.captures.hold(stream, || KeepAlive { ctx: self.context().clone(), payload: s.clone() })?;
        let (p, _guard) = s.device_ptr(stream);
        Ok(p)
    }

    /// Copies `bytes` on the shared stream.
    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 || dst == src {
            return Ok(());
        }
        crate::driver::bind(self.context())?;
        // SAFETY: both ranges hold `bytes` bytes on this device (the
        // callers' ordered buffers or this communicator's scratch), and
        // the copy is ordered on the stream every step runs on.
        check("cuMemcpyDtoDAsync", unsafe { crate::driver::api()?.cuMemcpyDtoDAsync_v2(dst, src, bytes, crate::driver::raw_stream(self.stream())) })
    }

    /// The two-tier all-reduce on pointers already ordered on the shared
    /// stream (`count` elements each, the same or disjoint), with the
    /// scratch it needs, one call at a time.
    pub(crate) fn all_reduce_ordered<T: Element>(&self, op: ReduceOp, src: u64, dst: u64, count: usize) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let mut held = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let chunk = self.scratch(&mut held, (count / self.per_host).max(1) * T::DTYPE.size())?;
        self.all_reduce_ptrs::<T>(op, src, dst, count, chunk)
    }

    /// The two-tier all-reduce of `count` elements, `src` to `dst` (the
    /// same or disjoint), using `chunk` (at least `count / per_host`
    /// elements) between the tiers.
    fn all_reduce_ptrs<T: Element>(&self, op: ReduceOp, src: u64, dst: u64, count: usize, chunk: u64) -> Result<()> {
        let (l, esz) = (self.per_host, T::DTYPE.size());
        let q = count / l;
        if q > 0 {
            self.local.reduce_scatter_ptrs::<T>(op, src, chunk, q)?;
            self.cross.all_reduce_ptrs(T::DTYPE, op, chunk, chunk, q)?;
            self.local.all_gather_ptrs::<T>(chunk, dst, q)?;
        }
        let main = q * l;
        if main < count {
            let (s, d) = (src + (main * esz) as u64, dst + (main * esz) as u64);
            self.local.all_reduce_ptrs::<T>(op, s, d, count - main)?;
            self.cross.all_reduce_ptrs(T::DTYPE, op, d, d, count - main)?;
        }
        Ok(())
    }
}

/// The two tiers' collectives (see [`Collectives`] for each one's contract).
impl Collectives for Tiered {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn stream(&self) -> &Arc<CudaStream> {
        Tiered::stream(self)
    }

    fn synchronize(&self) -> Result<()> {
        Tiered::synchronize(self)
    }

    fn async_error(&self) -> Result<()> {
        self.local.async_error()?;
        self.cross.async_error()?;
        self.world.async_error()
    }

    /// In-place all-reduce (as [`Comm::all_reduce_in_place`]). `Avg` is the
    /// average of the hosts' averages, which is every rank's average (every
    /// host has as many ranks).
    fn all_reduce_in_place<T: Element, D: DevicePtrMut<T>>(&self, buf: &mut D, op: ReduceOp) -> Result<()> {
        let count = args::all_reduce_in_place(self.context(), buf, op)?;
        let (ptr, guard) = self.order.write(buf, self.stream())?;
        let r = self.all_reduce_ordered::<T>(op, ptr, ptr, count);
        r.and(guard.finish())
    }

    /// Out-of-place all-reduce (as [`Comm::all_reduce`]).
    fn all_reduce<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp) -> Result<()> {
        let count = args::all_reduce(self.context(), send, recv, op)?;
        let (src, read) = self.order.read(send, self.stream())?;
        let (dst, write) = self.order.write(recv, self.stream())?;
        let r = self.all_reduce_ordered::<T>(op, src, dst, count);
        r.and(read.finish()).and(write.finish())
    }

    /// Reduce-scatter (as [`Comm::reduce_scatter`]): the two-tier
    /// all-reduce of the whole `send` into scratch, then this rank's block.
    fn reduce_scatter<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp) -> Result<()> {
        let (c, esz) = (args::reduce_scatter(self.context(), self.size, send, recv, op)?, T::DTYPE.size());
        let total = send.len();
        if c == 0 {
            return Ok(());
        }
        let full = total * esz;
        let mut held = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let base = self.scratch(&mut held, full + (total / self.per_host).max(1) * esz)?;
        let (src, read) = self.order.read(send, self.stream())?;
        let (dst, write) = self.order.write(recv, self.stream())?;
        let r = self
            .all_reduce_ptrs::<T>(op, src, base, total, base + full as u64)
            .and_then(|()| self.copy(dst, base + (self.rank * c * esz) as u64, c * esz));
        r.and(read.finish()).and(write.finish())
    }

    /// All-gather (as [`Comm::all_gather`]): inside the host into the
    /// host's block of `recv`, then the hosts' blocks across hosts, both
    /// as bytes.
    fn all_gather<T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D) -> Result<()> {
        let (c, esz) = (args::all_gather(self.context(), self.size, send, recv)?, std::mem::size_of::<T>());
        if c == 0 {
            return Ok(());
        }
        let _held = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let (src, read) = self.order.read(send, self.stream())?;
        let (dst, write) = self.order.write(recv, self.stream())?;
        let block = self.per_host * c * esz;
        let mine = dst + (self.host * block) as u64;
        let r = self.local.all_gather_ptrs::<u8>(src, mine, c * esz).and_then(|()| self.cross.all_gather_ptrs(DType::U8, mine, dst, block));
        r.and(read.finish()).and(write.finish())
    }

    /// Broadcast in place (as [`Comm::broadcast`]): across hosts among the
    /// ranks with the root's local index (as bytes), then inside every
    /// host.
    fn broadcast_in_place<T: Movable, D: DevicePtrMut<T>>(&self, buf: &mut D, root: usize) -> Result<()> {
        let count = args::broadcast_in_place(self.context(), self.size, buf, root)?;
        if count == 0 {
            return Ok(());
        }
        let bytes = count * std::mem::size_of::<T>();
        let _held = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let (root_host, root_local) = (root / self.per_host, root % self.per_host);
        let (ptr, guard) = self.order.write(buf, self.stream())?;
        let across = if self.rank % self.per_host == root_local { self.cross.broadcast_ptrs(DType::U8, ptr, bytes, root_host) } else { Ok(()) };
        let r = across.and_then(|()| self.local.broadcast_ptrs::<T>(ptr, count, root_local));
        r.and(guard.finish())
    }

    /// The root's `send` copied into its `recv`, then broadcast in place.
    fn broadcast<T: Movable, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: Option<&S>, recv: &mut D, root: usize) -> Result<()> {
        if let Some(send) = args::broadcast(self.context(), self.size, self.rank, send, recv, root)? {
            let bytes = recv.len() * std::mem::size_of::<T>();
            let (src, read) = self.order.read(send, self.stream())?;
            let (dst, write) = self.order.write(recv, self.stream())?;
            self.copy(dst, src, bytes).and(read.finish()).and(write.finish())?;
        }
        self.broadcast_in_place(recv, root)
    }

    /// Reduce to `root` (as [`Comm::reduce`]): the two-tier all-reduce into
    /// scratch, which the root copies into its `recv`.
    fn reduce<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &S, recv: &mut D, op: ReduceOp, root: usize) -> Result<()> {
        let (count, esz) = (args::reduce(self.context(), self.size, send, recv, op, root)?, T::DTYPE.size());
        if count == 0 {
            return Ok(());
        }
        let full = count * esz;
        let mut held = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let base = self.scratch(&mut held, full + (count / self.per_host).max(1) * esz)?;
        let (src, read) = self.order.read(send, self.stream())?;
        let (dst, write) = self.order.write(recv, self.stream())?;
        let mut r = self.all_reduce_ptrs::<T>(op, src, base, count, base + full as u64);
        if self.rank == root {
            r = r.and_then(|()| self.copy(dst, base, full));
        }
        r.and(read.finish()).and(write.finish())
    }

    /// The two-tier all-reduce of `buf` into scratch, which the root copies
    /// back.
    fn reduce_in_place<T: Element, D: DevicePtrMut<T>>(&self, buf: &mut D, op: ReduceOp, root: usize) -> Result<()> {
        let (count, esz) = (args::reduce_in_place(self.context(), self.size, buf, op, root)?, T::DTYPE.size());
        if count == 0 {
            return Ok(());
        }
        let full = count * esz;
        let mut held = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let base = self.scratch(&mut held, full + (count / self.per_host).max(1) * esz)?;
        let (ptr, guard) = self.order.write(buf, self.stream())?;
        let mut r = self.all_reduce_ptrs::<T>(op, ptr, base, count, base + full as u64);
        if self.rank == root {
            r = r.and_then(|()| self.copy(ptr, base, full));
        }
        r.and(guard.finish())
    }

    crate::traits::point_to_point_calls!(all);

    /// Over every rank's NCCL communicator (as
    /// [`NcclComm`]'s: one group of reduces, part j to rank j).
    fn reduce_scatter_v<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(
        &self,
        send: &S,
        recv: &mut D,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let (offsets, _) = args::reduce_scatter_v(self.context(), self.size, self.rank, send, recv, counts, op)?;
        let _held = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let (src, read) = self.order.read(send, self.stream())?;
        let (dst, write) = self.order.write(recv, self.stream())?;
        let r = self.world.reduce_scatter_v_ptrs(T::DTYPE, op, src, dst, counts, &offsets);
        r.and(read.finish()).and(write.finish())
    }
}

/// The point-to-point calls of [`crate::traits`] over every rank's NCCL
/// communicator, the caller's buffers ordered by this communicator's own
/// [`Orderer`] (the one [`Tiered::synchronize`] waits for).
impl PointToPoint for Tiered {
    fn p2p_context(&self) -> &Arc<CudaContext> {
        self.context()
    }

    fn orderer(&self) -> &Orderer {
        &self.order
    }

    /// One NCCL group on `world`, under the lock that keeps this rank's
    /// calls one at a time (so that no two-tier call's steps interleave
    /// with it on the shared stream).
    fn transfers(&self, ts: &[Transfer]) -> Result<()> {
        let _held = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        self.world.transfers_ptrs(ts)
    }
}

impl Tiered {
    /// The path inside this host ([`Comm::path`]).
    pub fn local_path(&self) -> crate::copy::Path {
        self.local.path()
    }

    /// Why the path inside this host is what it is ([`Comm::path_reason`]).
    pub fn local_path_reason(&self) -> &str {
        self.local.path_reason()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(hosts: &[&str]) -> Vec<Vec<u8>> {
        hosts.iter().map(|h| h.as_bytes().to_vec()).collect()
    }

    #[test]
    fn layouts_that_take_two_tiers() {
        assert_eq!(layout(&ids(&["a", "a", "b", "b"])), Some((2, 2)));
        assert_eq!(layout(&ids(&["a", "a", "a", "b", "b", "b", "c", "c", "c"])), Some((3, 3)));
        // One rank per host: NCCL alone; one host: no NCCL.
        assert_eq!(layout(&ids(&["a", "b"])), None);
        assert_eq!(layout(&ids(&["a", "a"])), None);
        // Unequal hosts, interleaved ranks, a host twice: NCCL alone.
        assert_eq!(layout(&ids(&["a", "a", "b"])), None);
        assert_eq!(layout(&ids(&["a", "a", "b", "b", "b", "b"])), None);
        assert_eq!(layout(&ids(&["a", "b", "a", "b"])), None);
        assert_eq!(layout(&ids(&["a", "a", "b", "b", "a", "a"])), None);
        assert_eq!(layout(&[]), None);
    }

    #[test]
    fn each_rank_takes_its_index_id_and_rank_0s_world_id() {
        let (a, b, w) = (vec![1u8; 128], vec![2u8; 128], vec![9u8; 128]);
        let ids = vec![[a.clone(), w.clone()].concat(), b.clone()];
        let (cross, world) = nccl_ids(&ids, 0).unwrap();
        assert_eq!((cross.to_vec(), world.to_vec()), (a, w.clone()));
        let (cross, world) = nccl_ids(&ids, 1).unwrap();
        assert_eq!((cross.to_vec(), world.to_vec()), (b.clone(), w));
        assert!(nccl_ids(&ids, 2).unwrap_err().contains("rank 2"));
        assert!(nccl_ids(&[vec![1u8; 128], b], 1).unwrap_err().contains("every rank"));
        assert!(nccl_ids(&[vec![1u8; 100]], 0).is_err());
    }
}
