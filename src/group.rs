//! The public communicator API: a [`Group`] of ranks in one process, its
//! options, and its accessors. The collectives are in
//! [`crate::collectives`] and [`crate::raw`]; underneath, the algorithms
//! (`crate::algorithms`) run on the communicator (`crate::communicator`),
//! whose routes between ranks come from [`crate::copy`].
//!
//! Each rank is a device with its stream. Several ranks may share a device
//! (useful for testing rings of 3-8 ranks on one or two GPUs). Each rank
//! pulls from its ring predecessor over the link chosen for that pair:
//! peer loads and peer copies where P2P is verified (or both ranks share a
//! device), the staged-host path where not. A group may mix them.

use crate::algorithms::{self, check, oneshot, Algorithms, Pick};
use crate::communicator::{ranks_on, Communicator, Entered};
use crate::copy::route::{all_pairs_p2p, RouteEntry, RouteTable};
use crate::copy::{LinkOptions, LinkStatus, Path};
use crate::dtype::DType;
use crate::error::{cudarc_err, Error, Result};
use crate::failure::Fault;
use crate::graph::{CallOrder, KeepAlive};
use crate::kernels::load::{image_for, load_modules_everywhere};
use crate::kernels::{self, Kernel, KernelOp, Module};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use crate::algorithms::{Algorithm, Selected};
pub use crate::kernels::load::FORCE_PTX_ENV;

/// How long a group's launcher threads spin for the next call after each
/// collective before they park (the default of
/// [`GroupOptions::launch_spin`]).
pub const DEFAULT_LAUNCH_SPIN: Duration = Duration::from_micros(200);

/// Settings for a group: `GroupOptions::default()` or
/// [`GroupOptions::with_policy`], then the builder-style setters (one per
/// field), e.g. `GroupOptions::default().algorithm(Algorithm::Ring)`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct GroupOptions {
    /// All-reduce algorithm (see [`Algorithm`]).
    pub algorithm: Algorithm,
    /// How each ring link is opened (policy, verification, staging sizes).
    pub link: LinkOptions,
    /// Per-rank override of `link.policy` for the link from rank r-1 to rank
    /// r (empty: `link.policy` everywhere). Lets a group mix paths on purpose.
    pub pull_policies: Vec<crate::copy::PathPolicy>,
    /// Launcher threads for the fused all-reduces (one-shot and mesh):
    /// `Some(spin)` starts one thread per rank after the first, which
    /// launches its rank's kernel while the calling thread launches rank
    /// 0's, and spins for `spin` after each call before it parks; `None`
    /// launches every rank from the calling thread. In an in-place one-shot
    /// all-reduce each launcher also takes its own rank's buffer (cudarc's
    /// event tracking). Launching in parallel shortens small calls back to
    /// back, whose cost is the host's launches (measured; see
    /// docs/measurements.md). A call that
    /// finds a launcher parked launches that rank itself (and wakes it), so
    /// only calls less than `spin` apart run in parallel, and an idle group
    /// uses no CPU; a busy one keeps up to one core per rank after the first
    /// spinning. Under graph capture every rank is launched from the calling
    /// thread. Default: `Some(`[`DEFAULT_LAUNCH_SPIN`]`)`.
    pub launch_spin: Option<Duration>,
    /// Load kernel modules on first use instead of when the group is
    /// created. By default (`false`) [`Group::new`] calls
    /// [`Group::warm_up`], so that no collective ever loads or JIT-compiles
    /// a kernel on the hot path. With `true` the first call of each
    /// (element type, reduction) loads its module then (resolving it on
    /// every rank before any rank launches); useful where the devices have
    /// no embedded cubin and only a few types are used, since JIT-compiling
    /// every module takes seconds per module. (The ring's reduction module
    /// is loaded at creation either way.)
    pub lazy_kernels: bool,
    /// How long a mesh or one-shot kernel waits at a device-side barrier
    /// for its peers before it gives up (a rank that was never launched, a
    /// hung peer). It then ends cleanly, the contexts stay usable, and the
    /// group reports [`Error::PeerTimeout`] from then on (see
    /// [`crate::failure`]). Default: [`DEFAULT_BARRIER_TIMEOUT`].
    pub barrier_timeout: Duration,
    /// For tests of the fused-path check only: a fault the check's launch
    /// on a rank takes (see [`Group::inject_fault`]).
    #[doc(hidden)]
    pub check_fault: Option<(usize, Fault)>,
}

pub use crate::failure::DEFAULT_BARRIER_TIMEOUT;

impl Default for GroupOptions {
    fn default() -> Self {
        GroupOptions {
            algorithm: Algorithm::default(),
            link: LinkOptions::default(),
            pull_policies: Vec::new(),
            launch_spin: Some(DEFAULT_LAUNCH_SPIN),
            lazy_kernels: false,
            barrier_timeout: DEFAULT_BARRIER_TIMEOUT,
            check_fault: None,
        }
    }
}

impl GroupOptions {
    /// Default options with the given path policy for every link.
    pub fn with_policy(policy: crate::copy::PathPolicy) -> Self {
        GroupOptions { link: LinkOptions::with_policy(policy), ..Default::default() }
    }

    /// Sets [`Self::algorithm`].
    pub fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }

    /// Sets [`Self::link`].
    pub fn link(mut self, link: LinkOptions) -> Self {
        self.link = link;
        self
    }

    /// Sets [`Self::pull_policies`].
    pub fn pull_policies(mut self, pull_policies: Vec<crate::copy::PathPolicy>) -> Self {
        self.pull_policies = pull_policies;
        self
    }

    /// Sets [`Self::launch_spin`].
    pub fn launch_spin(mut self, launch_spin: Option<Duration>) -> Self {
        self.launch_spin = launch_spin;
        self
    }

    /// Sets [`Self::lazy_kernels`].
    pub fn lazy_kernels(mut self, lazy_kernels: bool) -> Self {
        self.lazy_kernels = lazy_kernels;
        self
    }

    /// Sets [`Self::barrier_timeout`].
    pub fn barrier_timeout(mut self, barrier_timeout: Duration) -> Self {
        self.barrier_timeout = barrier_timeout;
        self
    }

    /// For tests of the fused-path check only: sets `check_fault`.
    #[doc(hidden)]
    pub fn check_fault(mut self, check_fault: Option<(usize, Fault)>) -> Self {
        self.check_fault = check_fault;
        self
    }
}

/// What a per-rank scratch buffer of a group holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scratch {
    /// A reduce-scatter's partial sums (three or more ranks).
    Partial = 0,
    /// Each rank's input divided by the rank count, for an average of a
    /// reduce-scatter or a reduce.
    Scaled = 1,
}

/// A communicator of ranks in one process. See the module docs.
pub struct Group {
    // Fields drop in this order (after `Drop::drop` has waited for every
    // rank): the algorithms' state, then the communicator's, as before the
    // split.
    /// The all-reduce algorithms the group opened, and what it was asked for.
    pub(crate) algos: Algorithms,
    /// Ranks, routes, launchers and the control block.
    pub(crate) comm: Communicator,
    /// Per-rank scratch buffers, by [`Scratch`].
    pub(crate) scratch: [Mutex<Vec<Arc<CudaSlice<u8>>>>; 2],
    /// Events of the raw-pointer collectives ([`crate::raw`]), created on first use.
    pub(crate) raw_events: once_cell::sync::OnceCell<Vec<crate::raw::RawEvents>>,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let devices: Vec<usize> = self.comm.ranks.iter().map(|r| r.ctx.ordinal()).collect();
        let paths: Vec<Path> = self.comm.routes.ring.iter().map(|p| p.status.path).collect();
        f.debug_struct("Group").field("devices", &devices).field("pulls", &paths).finish()
    }
}

/// Whether `a` and `b` are one stream: one handle of one context (every
/// context's legacy default stream has the same null handle).
fn same_stream(a: &CudaStream, b: &CudaStream) -> bool {
    a.cu_stream() == b.cu_stream() && a.context().cu_ctx() == b.context().cu_ctx()
}

impl Group {
    /// A group with one rank per stream, in ring order. Several streams may
    /// belong to one device; two ranks on one stream are
    /// [`Error::InvalidArgument`]. Opens every ring link `r-1 -> r` under
    /// `opts.link` (enabling and verifying P2P, or allocating staging).
    pub fn new(streams: Vec<Arc<CudaStream>>, opts: &GroupOptions) -> Result<Group> {
        if streams.is_empty() {
            return Err(Error::EmptyGroup);
        }
        let n = streams.len();
        if !opts.pull_policies.is_empty() && opts.pull_policies.len() != n {
            return Err(Error::InvalidArgument(format!("{} pull policies for {n} ranks", opts.pull_policies.len())));
        }
        // Each rank's fused kernel waits at a device barrier for the
        // others': two on one stream would wait for each other.
        for (r, s) in streams.iter().enumerate() {
            if let Some(k) = streams[..r].iter().position(|t| same_stream(t, s)) {
                return Err(Error::InvalidArgument(format!("ranks {k} and {r} are on one stream: each rank needs its own")));
            }
        }
        let ranks = ranks_on(streams)?;
        let mut access = Vec::new();
        let mut ring = Vec::with_capacity(n);
        for r in 0..n {
            let pred = (r + n - 1) % n;
            let (src, dst) = (&ranks[pred].ctx, &ranks[r].ctx);
            let mut link = opts.link.clone();
            if let Some(&p) = opts.pull_policies.get(r) {
                link.policy = p;
            }
            ring.push(RouteEntry::open(src, dst, &ranks[r].stream, &link, &mut access)?);
        }
        let devices: Vec<usize> = ranks.iter().map(|r| r.ctx.ordinal()).collect();
        let mut routes = RouteTable { ring, all_pairs: None };
        if algorithms::wants_all_pairs(opts.algorithm, &devices) && routes.ring_all_p2p() {
            let ctxs: Vec<&Arc<CudaContext>> = ranks.iter().map(|r| &r.ctx).collect();
            routes.all_pairs = Some(all_pairs_p2p(&ctxs, &opts.link, &mut access));
        }
        let mut comm = Communicator::new(ranks, routes, access);
        let algos = Algorithms::open(&comm, opts.algorithm)?;
        if algos.any_fused() {
            comm.attach_fused(opts.launch_spin, opts.barrier_timeout)?;
        }
        let mut group =
            Group { comm, algos, scratch: [Mutex::new(Vec::new()), Mutex::new(Vec::new())], raw_events: once_cell::sync::OnceCell::new() };
        if !opts.lazy_kernels {
            group.warm_up()?;
        }
        if opts.link.verify {
            check::verify(&mut group.comm, &mut group.algos, opts.check_fault)?;
        }
        Ok(group)
    }

    /// A group with one rank per device in `ordinals` (each on a new stream).
    pub fn from_devices(ordinals: &[usize], opts: &GroupOptions) -> Result<Group> {
        let mut streams = Vec::with_capacity(ordinals.len());
        for &o in ordinals {
            let ctx = crate::driver::context(o)?;
            streams.push(ctx.new_stream().map_err(cudarc_err("cuStreamCreate"))?);
        }
        Group::new(streams, opts)
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// Rank `r`'s stream: collectives are ordered on it.
    pub fn stream(&self, r: usize) -> Option<&Arc<CudaStream>> {
        self.comm.ranks.get(r).map(|k| &k.stream)
    }

    /// Rank `r`'s context.
    pub fn context(&self, r: usize) -> Option<&Arc<CudaContext>> {
        self.comm.ranks.get(r).map(|k| &k.ctx)
    }

    /// How rank `r` pulls from rank `r-1`, and why.
    pub fn link_status(&self, r: usize) -> Option<&LinkStatus> {
        self.comm.routes.ring.get(r).map(|p| &p.status)
    }

    /// Waits on the host until every rank's stream is idle. Every stream is
    /// waited for, also after one fails; the first error is returned.
    /// A fused kernel that gave up at a barrier since the last call is
    /// reported here too ([`Error::PeerTimeout`]).
    pub fn synchronize(&self) -> Result<()> {
        let mut first = Ok(());
        for (r, e) in self.comm.synchronize_each() {
            log::debug!("synchronising rank {r}: {e}");
            if first.is_ok() {
                first = Err(e);
            }
        }
        first?;
        self.comm.ctl.as_ref().map_or(Ok(()), |c| c.check())
    }

    /// Makes `stream` wait for everything enqueued so far on every rank's
    /// stream. The group itself runs each rank's calls and the replays of
    /// graphs captured from them one after another, in the order the host
    /// issued them, wherever a replay is launched, except that the first
    /// launch of the group's first graph must come after the calls made
    /// before its capture (call this before it); this orders the caller's
    /// own work with them too. A CUDA graph captured over the group's streams
    /// (forked from one of them) starts its nodes on every device after the
    /// work on the stream it is launched on only: where a graph must see
    /// what the caller enqueued on the ranks' streams (say, its inputs),
    /// call this on the launch stream before the launch, and
    /// [`Group::ranks_wait_for`] after it, before reading the graph's
    /// results there. Errors are the driver's (event record or wait).
    pub fn wait_for_ranks(&self, stream: &CudaStream) -> Result<()> {
        for rank in self.comm.ranks.iter().filter(|r| !same_stream(&r.stream, stream)) {
            stream.join(&rank.stream).map_err(cudarc_err("cuStreamWaitEvent (waiting for a rank)"))?;
        }
        Ok(())
    }

    /// Makes every rank's stream wait for everything enqueued so far on
    /// `stream`: after a graph launched there (see
    /// [`Group::wait_for_ranks`]), work the caller enqueues on the ranks'
    /// streams afterwards sees the graph's results.
    pub fn ranks_wait_for(&self, stream: &CudaStream) -> Result<()> {
        for rank in self.comm.ranks.iter().filter(|r| !same_stream(&r.stream, stream)) {
            rank.stream.join(stream).map_err(cudarc_err("cuStreamWaitEvent (a rank waiting)"))?;
        }
        Ok(())
    }

    /// For tests of failure handling only: the next fused (mesh or
    /// one-shot) launch on `rank` takes `fault` instead. Does nothing on a
    /// group without fused kernels.
    #[doc(hidden)]
    pub fn inject_fault(&self, rank: usize, fault: Fault) {
        if let Some(c) = &self.comm.ctl {
            c.inject(rank, fault);
        }
    }

    /// Loads every kernel module the group can need on every rank and
    /// resolves every kernel in them: the ring's reductions (4 ops and the
    /// division of avg, for every element type), and the mesh and one-shot
    /// kernels where the group has them. Afterwards no collective of the
    /// group loads or compiles anything. [`Group::new`] calls it unless
    /// [`GroupOptions::lazy_kernels`] is set; calling it again costs little
    /// (lookups in the tables already filled).
    ///
    /// Modules come from the embedded machine code for the device's
    /// architecture (sm_70, sm_80 and up to sm_89, sm_90, sm_100 and sm_103,
    /// sm_120 and sm_121), else from PTX that the driver JIT-compiles (a
    /// few seconds per module and device on a cold driver cache);
    /// `CUDA_PEER_FORCE_PTX=1` forces the PTX. Devices load at the same
    /// time, one thread each. How long it took is logged
    /// (`log::info!`), each module at `log::debug!`.
    pub fn warm_up(&self) -> Result<()> {
        Self::warm(&self.comm, &self.algos)
    }

    /// [`Self::warm_up`] of `comm` with `algos`.
    fn warm(comm: &Communicator, algos: &Algorithms) -> Result<()> {
        let start = std::time::Instant::now();
        let modules: &[Module] = if algos.any_fused() { &Module::all() } else { &[Module::Reduce] };
        let nmodules = modules.len();
        load_modules_everywhere(&comm.distinct_contexts(), modules)?;
        for r in 0..comm.size() {
            for dtype in DType::ALL {
                for op in KernelOp::ALL {
                    comm.function(r, Kernel::Reduce2(op, dtype))?;
                    if let Some(mesh) = &algos.mesh {
                        let k = Kernel::Mesh(op, dtype);
                        mesh.funcs[r].get(k, || comm.kernel_function(r, k))?;
                    }
                    if let Some(os) = &algos.oneshot {
                        let k = Kernel::OneShot(op, dtype);
                        os.funcs[r].get(k, || comm.kernel_function(r, k))?;
                    }
                }
                if dtype.is_float() {
                    comm.function(r, Kernel::ScaleDiv(dtype))?;
                }
            }
        }
        let images: Vec<String> = comm
            .ranks
            .iter()
            .map(|k| image_for(&k.ctx).map(|a| format!("GPU{}: {}", k.ctx.ordinal(), a.map_or_else(|| "PTX".to_string(), kernels::arch_name))))
            .collect::<Result<_>>()?;
        log::info!(
            "cuda-peer: kernels of {nmodules} modules ready on {} ranks in {:.1} ms ({})",
            comm.size(),
            start.elapsed().as_secs_f64() * 1e3,
            images.join(", ")
        );
        Ok(())
    }

    /// Starts one collective's enqueue ([`Communicator::enter`]): captured
    /// calls keep the group's resources alive for as long as their graphs.
    pub(crate) fn enter(&self) -> Result<Entered<'_>> {
        self.comm.enter(|| self.keep_alive())
    }

    /// Looks again for captures of the ranks' streams, after a call has
    /// ordered them after streams of the caller's ([`Communicator::see_captures`]).
    pub(crate) fn see_captures(&self) -> Result<()> {
        self.comm.see_captures(|| self.keep_alive())
    }

    /// Everything a captured call of this group can touch when replayed:
    /// the one-shot's and the mesh's slots and flags, the staged routes'
    /// buffers, the scratch, and the peer access the kernels rely on.
    pub(crate) fn keep_alive(&self) -> KeepAlive {
        let scratch: Vec<Vec<Arc<CudaSlice<u8>>>> = self.scratch.iter().map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).clone()).collect();
        let c = &self.comm;
        let calls: Vec<Arc<CallOrder>> = c.ranks.iter().map(|r| r.calls.clone()).collect();
        KeepAlive {
            ctx: c.ranks[0].ctx.clone(),
            payload: Arc::new((
                self.algos.mesh.clone(),
                self.algos.oneshot.clone(),
                c.ctl.clone(),
                c.routes.clone(),
                scratch,
                c.access.clone(),
                calls,
            )),
        }
    }

    /// Whether the group has the mesh all-reduce (used for medium messages
    /// under [`Algorithm::Auto`]).
    pub fn uses_mesh(&self) -> bool {
        self.algos.mesh.is_some()
    }

    /// Whether the group has the one-shot all-reduce, and where its slots
    /// are: `Some(true)` in host memory, `Some(false)` in device memory.
    pub fn oneshot_on_host(&self) -> Option<bool> {
        self.algos.oneshot.as_ref().map(|o| o.on_host())
    }

    /// The algorithm an all-reduce of `bytes` bytes per rank runs with.
    pub fn all_reduce_algorithm(&self, bytes: usize) -> Selected {
        self.pick(bytes).selected()
    }

    /// The algorithm (with its state) for an all-reduce of `bytes` per
    /// rank: evaluated once per call.
    pub(crate) fn pick(&self, bytes: usize) -> Pick<'_> {
        self.algos.pick(self.size(), bytes)
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // Peer access is disabled when the guards drop: no kernel or copy of
        // this group may still be reading a peer's memory then. Every rank
        // is waited for, whatever failed before it.
        for (r, e) in self.comm.synchronize_each() {
            log::warn!("synchronising rank {r} of a group on drop: {e}");
        }
    }
}

/// For tests: how many times a CUDA graph has taken a reference to a
/// group's or link's resources, how many of those have been released since
/// (the graph destroyed, the resources dropped), and how many one-shot
/// states (slots, flags) have been dropped.
#[doc(hidden)]
pub fn graph_keep_alives() -> (u64, u64, u64) {
    use std::sync::atomic::Ordering::Relaxed;
    (crate::graph::RETAINED.load(Relaxed), crate::graph::RELEASED.load(Relaxed), oneshot::DROPPED.load(Relaxed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_group_is_an_error_without_touching_the_driver() {
        assert!(matches!(Group::new(Vec::new(), &GroupOptions::default()), Err(Error::EmptyGroup)));
        assert_eq!(GroupOptions::default().algorithm, Algorithm::Auto);
    }

    #[test]
    fn a_group_can_be_shared_between_threads() {
        fn is_send_sync<T: Send + Sync>() {}
        is_send_sync::<Group>();
    }

    #[test]
    fn pointer_arrays_fill_from_the_front() {
        use crate::kernels::load::PtrArray;
        let a = PtrArray::from_slice(&[16, 32, 48]);
        assert_eq!(a.0, [16, 32, 48, 0, 0, 0, 0, 0]);
        assert_eq!(std::mem::size_of::<PtrArray>(), 64, "the kernels take struct {{ void* p[8]; }}");
    }
}
