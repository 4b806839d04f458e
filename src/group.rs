//! A group of ranks (a communicator) in one process: its ranks, links and
//! options, which all-reduce algorithm a message takes, and how a call
//! launches one kernel per rank (from launcher threads where it can).
//!
//! Each rank is a device with its stream. Several ranks may share a device
//! (useful for testing rings of 3-8 ranks on one or two GPUs). Each rank
//! pulls from its ring predecessor over the link chosen for that pair:
//! peer loads and peer copies where P2P is verified (or both ranks share a
//! device), the staged-host path where not. A group may mix them.
//!
//! The collectives themselves are in [`crate::collectives`]; the ring
//! engine, the mesh and the one-shot all-reduce each have their own module
//! (`ring`, `mesh`, [`crate::oneshot`]).

use crate::copy::{decide, LinkOptions, LinkStatus, Path};
use crate::driver::{api, bind};
use crate::dtype::DType;
use crate::error::{check, cudarc_err, Error, Result};
use crate::failure::{Ctl, Fault};
use crate::fused_check::Fused;
use crate::graph::{capture_of, retain, KeepAlive};
use crate::kernels;
use crate::launch::{Job, Launchers};
use crate::mesh::Mesh;
use crate::oneshot::OneShot;
use crate::peer::PeerAccess;
use crate::reach::ReachCache;
use crate::ring::Pull;
use crate::sync::Orderer;
use cuda_peer_sys as sys;
use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use once_cell::sync::Lazy;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

/// Which algorithm a group's all-reduce uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Algorithm {
    /// By message size, where the group allows it (2 to 8 ranks, each on
    /// its own device): with P2P verified between every pair, the one-shot
    /// up to [`ONESHOT_AUTO_MAX_BYTES`], the mesh below
    /// [`MESH_AUTO_MAX_BYTES`], the ring above; without, the one-shot
    /// through host memory up to [`HOST_ONESHOT_AUTO_MAX_BYTES`], the ring
    /// above. Other groups always use the ring.
    #[default]
    Auto,
    /// Always the ring (reduce-scatter then all-gather over ring links).
    Ring,
    /// Always the mesh; creating the group fails where it is not possible.
    Mesh,
    /// Always the one-shot all-reduce ([`crate::oneshot`]): slots in peer
    /// device memory where every pair has P2P, else in mapped host memory.
    /// Needs 2 to 8 ranks, each on its own device; creating the group fails
    /// otherwise.
    OneShot,
}

/// Under [`Algorithm::Auto`], a group whose every pair has P2P uses the
/// one-shot all-reduce while each rank stores at most this many bytes into
/// its peers (message bytes times ranks - 1), the mesh above. On 2x H200
/// (NVLink) the one-shot beat the mesh up to 4 MiB (21.0 against 21.3 us)
/// and lost from 8 MiB (38.3 against 33.0 us), both forced, one run
/// (`bench/results/h200x2-algos-allreduce.csv`).
pub const ONESHOT_AUTO_MAX_BYTES: usize = 4 << 20;

/// Under [`Algorithm::Auto`], a group without P2P everywhere (ranks on
/// distinct devices, 2 to 8) uses the one-shot all-reduce through host
/// memory while each rank reads at most this many bytes from it (message
/// bytes times ranks - 1), the staged ring above. On 2x H200 with P2P off
/// the one-shot was ahead up to 16 MiB (521 against 583 us; 12.8 against
/// 71.4 us at 4 KiB), level with the ring from 64 to 256 MiB (within 4%)
/// and behind at 1 GiB (39.6 against 42.3 GB/s), both forced, one run.
pub const HOST_ONESHOT_AUTO_MAX_BYTES: usize = 16 << 20;

/// Under [`Algorithm::Auto`], messages of at least this many bytes per rank
/// use the ring even where the mesh is possible: on 2x H200 (NVLink) the
/// ring's copy-engine all-gather overtook the mesh kernel from 256 MiB on
/// (344 against 337 GB/s busbw at 256 MiB, level at 128 MiB; both forced,
/// one run).
pub const MESH_AUTO_MAX_BYTES: usize = 256 << 20;

impl std::str::FromStr for Algorithm {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Algorithm::Auto),
            "ring" => Ok(Algorithm::Ring),
            "mesh" => Ok(Algorithm::Mesh),
            "oneshot" | "one-shot" => Ok(Algorithm::OneShot),
            other => Err(Error::InvalidArgument(format!("algorithm {other:?}: expected auto, ring, mesh or oneshot"))),
        }
    }
}

/// How long a group's launcher threads spin for the next call after each
/// collective before they park (the default of
/// [`GroupOptions::launch_spin`]).
pub const DEFAULT_LAUNCH_SPIN: Duration = Duration::from_micros(200);

/// Settings for a group.
#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// event tracking). On 2x H200, 4 KiB back to back: 5.9-7.4 us per call
    /// against 7.2-8.6 without launchers, alternating in one process
    /// (`bench/results/h200x2-launchers-enqueue-costs.txt`). A call that
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

/// The default of [`GroupOptions::barrier_timeout`].
pub const DEFAULT_BARRIER_TIMEOUT: Duration = Duration::from_secs(10);

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
}

type ModuleCache = Lazy<Mutex<HashMap<usize, Arc<CudaModule>>>>;

/// The kernel modules (`kernels::modules()`, by index), loaded once per
/// context for the life of the process.
static MODULE_CACHES: [ModuleCache; 11] = [const { Lazy::new(|| Mutex::new(HashMap::new())) }; 11];

/// The environment variable that makes every module load from PTX (JIT)
/// even where a cubin would serve: `CUDA_PEER_FORCE_PTX=1` (any value but
/// empty or `0`).
pub const FORCE_PTX_ENV: &str = "CUDA_PEER_FORCE_PTX";

fn force_ptx() -> bool {
    std::env::var_os(FORCE_PTX_ENV).is_some_and(|v| !v.is_empty() && v != "0")
}

/// Which image of the kernels a context loads: `Some(arch)` (an index in
/// `kernels::CUBIN_ARCHS`) for a cubin, `None` for the PTX.
fn image_for(ctx: &Arc<CudaContext>) -> Result<Option<usize>> {
    use cudarc::driver::sys::CUdevice_attribute::{CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR};
    if force_ptx() {
        return Ok(None);
    }
    let major = ctx.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).map_err(cudarc_err("cuDeviceGetAttribute"))?;
    let minor = ctx.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR).map_err(cudarc_err("cuDeviceGetAttribute"))?;
    Ok(kernels::cubin_for(major.max(0) as u32, minor.max(0) as u32))
}

/// Module `index` of `kernels::modules()` on `ctx`, loaded the first time:
/// from the cubin for the device's architecture where there is one (no
/// JIT), else from the PTX (JIT-compiled by the driver). A cubin that does
/// not decompress or load (an old driver, say) falls back to the PTX, with
/// a warning. The cache is not locked while a module loads, so devices
/// load (and JIT-compile) at the same time; two threads loading one module
/// on one context at once both load it, and the first stored is kept.
fn load_module(ctx: &Arc<CudaContext>, index: usize) -> Result<Arc<CudaModule>> {
    let module = kernels::modules().get(index).ok_or_else(|| Error::Internal(format!("no kernel module {index}")))?;
    let key = ctx.cu_ctx() as usize;
    if let Some(m) = MODULE_CACHES[index].lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return Ok(m.clone());
    }
    let start = std::time::Instant::now();
    let mut loaded = None;
    if let Some(arch) = image_for(ctx)? {
        let result = module
            .cubin(arch)
            .and_then(|image| ctx.load_module(cudarc::nvrtc::Ptx::from_binary(image)).map_err(|e| format!("cuModuleLoadData: {e:?}")));
        match result {
            Ok(m) => loaded = Some((m, kernels::arch_name(arch))),
            Err(e) => log::warn!(
                "cuda-peer: GPU{}: cubin {} of {} unusable ({e}); JIT-compiling the PTX",
                ctx.ordinal(),
                kernels::arch_name(arch),
                module.name
            ),
        }
    }
    let (m, how) = match loaded {
        Some(l) => l,
        None => {
            (ctx.load_module(cudarc::nvrtc::Ptx::from_src(module.ptx())).map_err(cudarc_err("cuModuleLoadData (kernels)"))?, "PTX (JIT)".to_string())
        }
    };
    log::debug!("cuda-peer: GPU{}: kernel module {} loaded from {how} in {:.1} ms", ctx.ordinal(), module.name, start.elapsed().as_secs_f64() * 1e3);
    let mut map = MODULE_CACHES[index].lock().unwrap_or_else(|p| p.into_inner());
    Ok(map.entry(key).or_insert(m).clone())
}

/// Loads modules `0..nmodules` on every context of `ctxs` (distinct
/// contexts), one thread per context, so that the devices load (or
/// JIT-compile) at the same time.
fn load_modules_everywhere(ctxs: &[&Arc<CudaContext>], nmodules: usize) -> Result<()> {
    let load_all = |ctx: &Arc<CudaContext>| -> Result<()> {
        for index in 0..nmodules {
            load_module(ctx, index)?;
        }
        Ok(())
    };
    if ctxs.len() < 2 {
        return ctxs.iter().try_for_each(|c| load_all(c));
    }
    std::thread::scope(|s| {
        let mut handles = Vec::with_capacity(ctxs.len());
        let mut result = Ok(());
        for &ctx in ctxs {
            match std::thread::Builder::new().name("cuda-peer-load".into()).spawn_scoped(s, move || load_all(ctx)) {
                Ok(h) => handles.push(h),
                // No thread: load this context from the calling thread.
                Err(_) => result = result.and_then(|()| load_all(ctx)),
            }
        }
        // Every thread is joined (a scope with an unjoined panicked thread
        // would panic); the first error is kept.
        for h in handles {
            let r = h.join().unwrap_or_else(|_| Err(Error::Internal("a kernel loading thread panicked".into())));
            result = result.and(r);
        }
        result
    })
}

/// The reductions as they appear in kernel names (avg is sum, then the
/// division kernel).
const KERNEL_OPS: [&str; 4] = ["sum", "prod", "min", "max"];

/// `{family}_{op}_{ty}` of the mesh module of `dtype` on `ctx` (loaded
/// once per context).
pub(crate) fn mesh_kernel(ctx: &Arc<CudaContext>, family: &str, op: &str, dtype: DType) -> Result<CudaFunction> {
    let ty = dtype.name();
    let index = kernels::mesh_module(ty).ok_or(Error::UnsupportedOp { op: "mesh all-reduce", dtype: ty })?;
    let module = load_module(ctx, index)?;
    module.load_function(&format!("{family}_{op}_{ty}")).map_err(cudarc_err("cuModuleGetFunction"))
}

/// `name` of the reduction module on `ctx` (loaded once per context).
pub(crate) fn reduce_kernel(ctx: &Arc<CudaContext>, name: &str) -> Result<CudaFunction> {
    let module = load_module(ctx, kernels::REDUCE)?;
    module.load_function(name).map_err(cudarc_err("cuModuleGetFunction"))
}

/// One kernel family's functions for one rank, by (op, element type),
/// each looked up on first use and kept: a launch costs an index, not a
/// name format and a map lookup.
pub(crate) struct FnTable {
    cells: [OnceLock<CudaFunction>; 5 * 10],
}

impl Default for FnTable {
    fn default() -> Self {
        FnTable { cells: [const { OnceLock::new() }; 50] }
    }
}

impl FnTable {
    /// The function for `op` ("sum", "prod", "min", "max", or "div" for
    /// scale_div) and `dtype`, loaded by `load` the first time.
    pub(crate) fn get(&self, op: &str, dtype: DType, load: impl FnOnce() -> Result<CudaFunction>) -> Result<&CudaFunction> {
        let o = match op {
            "sum" => 0,
            "prod" => 1,
            "min" => 2,
            "max" => 3,
            _ => 4,
        };
        let t = DType::ALL.iter().position(|d| *d == dtype).unwrap_or(0);
        let cell = &self.cells[o * 10 + t];
        if let Some(f) = cell.get() {
            return Ok(f);
        }
        let f = load()?;
        Ok(cell.get_or_init(|| f))
    }
}

/// One rank: its device, stream, kernels and step event.
pub(crate) struct Rank {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
    funcs: FnTable,
    /// Recorded on `stream` after each step.
    pub(crate) done: CudaEvent,
    /// Orders callers' buffers with this rank's work (`crate::sync`).
    pub(crate) order: Orderer,
    pub(crate) max_blocks: u32,
}

/// Kernel argument: up to 8 device pointers by value (`struct { void* p[8]; }`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PtrArray(pub(crate) [u64; kernels::MESH_MAX_RANKS]);

// SAFETY: a plain 64-byte array of integers, laid out like the C struct the
// kernels take by value.
unsafe impl cudarc::driver::DeviceRepr for PtrArray {}

impl PtrArray {
    pub(crate) fn from_slice(ptrs: &[u64]) -> Self {
        let mut a = PtrArray::default();
        a.0[..ptrs.len()].copy_from_slice(ptrs);
        a
    }
}

/// A communicator of ranks in one process. See the module docs.
pub struct Group {
    /// Launcher threads for ranks 1.. (fused all-reduces only).
    launchers: Option<Launchers>,
    /// The mesh all-reduce, when the group uses it.
    pub(crate) mesh: Option<Arc<Mesh>>,
    /// The one-shot all-reduce, when the group uses it.
    pub(crate) oneshot: Option<Arc<OneShot>>,
    algorithm: Algorithm,
    pub(crate) ranks: Vec<Rank>,
    /// `pulls[r]`: rank r pulling from rank r-1.
    pub(crate) pulls: Arc<Vec<Pull>>,
    /// Per-rank scratch for reduce-scatter on three or more ranks.
    pub(crate) scratch: Mutex<Vec<Arc<CudaSlice<u8>>>>,
    /// One lock per stream of the group, shared with every other group on
    /// that stream (`stream_locks`), all held (in a fixed order) for the
    /// whole enqueue of one collective: the per-rank step events and the
    /// device-side barriers and counters assume calls in one order on every
    /// rank, so calls from several threads, and calls of two groups that
    /// share streams, are serialised. (Two groups enqueueing on the same
    /// streams in opposite orders would wait for each other on the device.)
    serial: Vec<Arc<Mutex<()>>>,
    /// Whether the call being enqueued (under `serial`) is captured into a
    /// graph on some rank's stream.
    capturing: AtomicBool,
    /// The last captures that hold a reference to the group's resources.
    captures: Mutex<Vec<u64>>,
    access: Arc<Vec<PeerAccess>>,
    /// The fused kernels' control block and the group's failed state
    /// (`crate::failure`), when the group has fused kernels.
    pub(crate) ctl: Option<Arc<Ctl>>,
    /// Buffers known to be mapped for the peers' kernels (`crate::reach`).
    pub(crate) reach: ReachCache,
    /// Events of the raw-pointer collectives ([`crate::raw`]), created on first use.
    pub(crate) raw_events: once_cell::sync::OnceCell<Vec<crate::raw::RawEvents>>,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let devices: Vec<usize> = self.ranks.iter().map(|r| r.ctx.ordinal()).collect();
        let paths: Vec<Path> = self.pulls.iter().map(|p| p.status.path).collect();
        f.debug_struct("Group").field("devices", &devices).field("pulls", &paths).finish()
    }
}

impl Group {
    /// A group with one rank per stream, in ring order. Several streams may
    /// belong to one device. Opens every ring link `r-1 -> r` under
    /// `opts.link` (enabling and verifying P2P, or allocating staging).
    pub fn new(streams: Vec<Arc<CudaStream>>, opts: &GroupOptions) -> Result<Group> {
        if streams.is_empty() {
            return Err(Error::EmptyGroup);
        }
        let n = streams.len();
        if !opts.pull_policies.is_empty() && opts.pull_policies.len() != n {
            return Err(Error::InvalidArgument(format!("{} pull policies for {n} ranks", opts.pull_policies.len())));
        }
        let mut ranks = Vec::with_capacity(n);
        for stream in streams {
            let ctx = stream.context().clone();
            let sms = ctx
                .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .map_err(cudarc_err("cuDeviceGetAttribute"))?;
            ranks.push(Rank {
                module: load_module(&ctx, kernels::REDUCE)?,
                done: ctx.new_event(None).map_err(cudarc_err("cuEventCreate"))?,
                funcs: FnTable::default(),
                order: Orderer::default(),
                max_blocks: (sms.max(1) as u32) * 4,
                ctx,
                stream,
            });
        }
        let mut access = Vec::new();
        let mut pulls = Vec::with_capacity(n);
        for r in 0..n {
            let pred = (r + n - 1) % n;
            let (src, dst) = (&ranks[pred].ctx, &ranks[r].ctx);
            let mut link = opts.link.clone();
            if let Some(&p) = opts.pull_policies.get(r) {
                link.policy = p;
            }
            pulls.push(Pull::open(src, dst, &ranks[r].stream, &link, &mut access)?);
        }
        let mesh = Mesh::open(&ranks, &pulls, opts, &mut access)?.map(Arc::new);
        let oneshot = Self::open_oneshot(&ranks, &pulls, opts, mesh.is_some(), &mut access)?.map(Arc::new);
        let launchers = match opts.launch_spin {
            Some(spin) if mesh.is_some() || oneshot.is_some() => Launchers::start(n, spin),
            _ => None,
        };
        let serial = stream_locks(&ranks);
        let ctl = if mesh.is_some() || oneshot.is_some() { Some(Arc::new(Ctl::new(&ranks, opts.barrier_timeout)?)) } else { None };
        let mut group = Group {
            launchers,
            mesh,
            oneshot,
            algorithm: opts.algorithm,
            ranks,
            pulls: Arc::new(pulls),
            scratch: Mutex::new(Vec::new()),
            serial,
            capturing: AtomicBool::new(false),
            captures: Mutex::new(Vec::new()),
            ctl,
            reach: ReachCache::default(),
            raw_events: once_cell::sync::OnceCell::new(),
            access: Arc::new(access),
        };
        if !opts.lazy_kernels {
            group.warm_up()?;
        }
        if opts.link.verify {
            group.verify_fused(opts)?;
        }
        Ok(group)
    }

    /// Checks the fused algorithms the group has on real data
    /// (`crate::fused_check`). Where one fails, a forced algorithm is an
    /// error ([`Error::FusedUnverified`]); under [`Algorithm::Auto`] the
    /// group keeps only the ring, with a warning.
    fn verify_fused(&mut self, opts: &GroupOptions) -> Result<()> {
        let mut failed = None;
        for (which, name, present) in [(Fused::Mesh, "mesh", self.mesh.is_some()), (Fused::OneShot, "one-shot", self.oneshot.is_some())] {
            if !present || failed.is_some() {
                continue;
            }
            if let (Some((rank, fault)), Some(ctl)) = (opts.check_fault, &self.ctl) {
                ctl.inject(rank, fault);
            }
            if let Err(why) = self.check_fused(which)? {
                failed = Some((name, why));
            }
        }
        let Some((name, why)) = failed else { return Ok(()) };
        if opts.algorithm != Algorithm::Auto {
            return Err(Error::FusedUnverified { algorithm: name, reason: why });
        }
        log::warn!("cuda-peer: the {name} all-reduce failed its check on this group ({why}); using the ring");
        self.mesh = None;
        self.oneshot = None;
        self.ctl = None;
        self.launchers = None;
        Ok(())
    }

    /// Sets up the one-shot all-reduce where `opts` asks for it and the
    /// group allows it: slots in device memory when every pair has P2P
    /// (`mesh_ok`, or checked here), else in host memory.
    fn open_oneshot(ranks: &[Rank], pulls: &[Pull], opts: &GroupOptions, mesh_ok: bool, access: &mut Vec<PeerAccess>) -> Result<Option<OneShot>> {
        if !matches!(opts.algorithm, Algorithm::Auto | Algorithm::OneShot) {
            return Ok(None);
        }
        if let Some(why) = layout_refusal(ranks) {
            return if opts.algorithm == Algorithm::OneShot { Err(impossible("one-shot", &why)) } else { Ok(None) };
        }
        let p2p = mesh_ok || (pulls.iter().all(|p| p.status.path == Path::P2p) && Self::all_pairs_p2p(ranks, opts, access)?.is_ok());
        OneShot::new(ranks, p2p).map(Some)
    }

    /// Enables and verifies P2P between every pair of ranks under
    /// `opts.link`; `Err(why)` for the first pair without it.
    pub(crate) fn all_pairs_p2p(ranks: &[Rank], opts: &GroupOptions, access: &mut Vec<PeerAccess>) -> Result<std::result::Result<(), String>> {
        let n = ranks.len();
        for i in 0..n {
            for j in i + 1..n {
                match decide(&ranks[i].ctx, &ranks[j].ctx, &opts.link) {
                    Ok((guards, st)) if st.path == Path::P2p => access.extend(guards),
                    Ok((_, st)) => return Ok(Err(format!("ranks {i} and {j}: {}", st.reason))),
                    Err(e) => return Ok(Err(format!("ranks {i} and {j}: {e}"))),
                }
            }
        }
        Ok(Ok(()))
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
        self.ranks.len()
    }

    /// Rank `r`'s stream: collectives are ordered on it.
    pub fn stream(&self, r: usize) -> Option<&Arc<CudaStream>> {
        self.ranks.get(r).map(|k| &k.stream)
    }

    /// Rank `r`'s context.
    pub fn context(&self, r: usize) -> Option<&Arc<CudaContext>> {
        self.ranks.get(r).map(|k| &k.ctx)
    }

    /// How rank `r` pulls from rank `r-1`, and why.
    pub fn link_status(&self, r: usize) -> Option<&LinkStatus> {
        self.pulls.get(r).map(|p| &p.status)
    }

    /// Checks that the kernels that read or write `bufs[q]` on a peer's
    /// device can: every other rank's for the mesh (`all`), else the ring
    /// successor's where it pulls from q by peer loads (P2P).
    pub(crate) fn check_reach(&self, op: &'static str, bufs: &[u64], all: bool) -> Result<()> {
        let n = self.size();
        let ctxs: Vec<&CudaContext> = self.ranks.iter().map(|r| &*r.ctx).collect();
        self.reach.check(op, &ctxs, bufs, |q| {
            if all {
                (0..n).filter(|&p| p != q).collect()
            } else {
                let succ = (q + 1) % n;
                if succ != q && self.pulls[succ].status.path == Path::P2p {
                    vec![succ]
                } else {
                    Vec::new()
                }
            }
        })
    }

    /// Waits on the host until every rank's stream is idle. Every stream is
    /// waited for, also after one fails; the first error is returned.
    /// A fused kernel that gave up at a barrier since the last call is
    /// reported here too ([`Error::PeerTimeout`]).
    pub fn synchronize(&self) -> Result<()> {
        let mut first = Ok(());
        for (r, e) in self.synchronize_each() {
            log::debug!("synchronising rank {r}: {e}");
            if first.is_ok() {
                first = Err(e);
            }
        }
        first?;
        self.ctl.as_ref().map_or(Ok(()), |c| c.check())
    }

    /// For tests of failure handling only: the next fused (mesh or
    /// one-shot) launch on `rank` takes `fault` instead. Does nothing on a
    /// group without fused kernels.
    #[doc(hidden)]
    pub fn inject_fault(&self, rank: usize, fault: Fault) {
        if let Some(c) = &self.ctl {
            c.inject(rank, fault);
        }
    }

    /// The address of the control block for rank r's kernels, its barrier
    /// timeout, and whether this launch is to be skipped (an injected
    /// fault: `Err` fails it, `Ok(true)` skips it silently).
    pub(crate) fn ctl_args(&self, r: usize) -> Result<(u64, u64, bool)> {
        let Some(c) = &self.ctl else {
            return Err(Error::Internal("fused kernel launched on a group without a control block".into()));
        };
        match c.take_fault(r) {
            Some(Fault::LaunchFails) => Err(Error::Internal(format!("injected launch failure on rank {r}"))),
            Some(Fault::NeverArrives) => Ok((c.addrs[r], c.timeout_ns, true)),
            None => Ok((c.addrs[r], c.timeout_ns, false)),
        }
    }

    /// Synchronises every rank's stream, and the work ordered with callers'
    /// buffers, and returns each failure with its rank.
    fn synchronize_each(&self) -> Vec<(usize, Error)> {
        let mut errors = Vec::new();
        for (i, r) in self.ranks.iter().enumerate() {
            if let Err(e) = r.stream.synchronize().map_err(cudarc_err("cuStreamSynchronize")).and_then(|_| r.order.synchronize()) {
                errors.push((i, e));
            }
        }
        errors
    }

    /// Rank r's reduction kernel `name` (for `op` and `dtype`), from its table.
    fn function(&self, r: usize, op: &str, dtype: DType, name: impl FnOnce() -> String) -> Result<&CudaFunction> {
        let rank = &self.ranks[r];
        rank.funcs.get(op, dtype, || rank.module.load_function(&name()).map_err(cudarc_err("cuModuleGetFunction")))
    }

    /// Loads `{family}_{op}_{ty}` from the mesh module of `dtype` on rank r
    /// (loaded once per context and type).
    pub(crate) fn mesh_function(&self, r: usize, family: &str, op: &str, dtype: DType) -> Result<CudaFunction> {
        mesh_kernel(&self.ranks[r].ctx, family, op, dtype)
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
        let start = std::time::Instant::now();
        let fused = self.mesh.is_some() || self.oneshot.is_some();
        let nmodules = if fused { kernels::modules().len() } else { 1 };
        let mut ctxs: Vec<&Arc<CudaContext>> = Vec::with_capacity(self.size());
        for rank in &self.ranks {
            if !ctxs.iter().any(|c| c.cu_ctx() == rank.ctx.cu_ctx()) {
                ctxs.push(&rank.ctx);
            }
        }
        load_modules_everywhere(&ctxs, nmodules)?;
        for r in 0..self.size() {
            for dtype in DType::ALL {
                for op in KERNEL_OPS {
                    self.function(r, op, dtype, || kernels::reduce2_name(op, dtype.name()))?;
                    if let Some(mesh) = &self.mesh {
                        mesh.funcs[r].get(op, dtype, || self.mesh_function(r, "cp_meshar", op, dtype))?;
                    }
                    if let Some(os) = &self.oneshot {
                        os.funcs[r].get(op, dtype, || self.mesh_function(r, "cp_oneshot", op, dtype))?;
                    }
                }
                if dtype.is_float() {
                    self.function(r, "div", dtype, || kernels::scale_div_name(dtype.name()))?;
                }
            }
        }
        let images: Vec<String> = self
            .ranks
            .iter()
            .map(|k| image_for(&k.ctx).map(|a| format!("GPU{}: {}", k.ctx.ordinal(), a.map_or_else(|| "PTX".to_string(), kernels::arch_name))))
            .collect::<Result<_>>()?;
        log::info!(
            "cuda-peer: kernels of {nmodules} modules ready on {} ranks in {:.1} ms ({})",
            self.size(),
            start.elapsed().as_secs_f64() * 1e3,
            images.join(", ")
        );
        Ok(())
    }

    fn grid(&self, r: usize, count: usize, dtype: DType) -> LaunchConfig {
        let per_block = (kernels::BLOCK_SIZE as usize) * (16 / dtype.size());
        let blocks = count.div_ceil(per_block).clamp(1, self.ranks[r].max_blocks as usize) as u32;
        LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (kernels::BLOCK_SIZE, 1, 1), shared_mem_bytes: 0 }
    }

    /// Launches `dst = a op b` over `count` elements on rank `r`'s stream.
    #[allow(clippy::too_many_arguments)] // the kernel's own arguments, plus rank, op and type
    pub(crate) fn launch_reduce2(&self, r: usize, op: &str, dtype: DType, dst: u64, a: u64, b: u64, count: usize) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let f = self.function(r, op, dtype, || kernels::reduce2_name(op, dtype.name()))?;
        let n = count as u64;
        let stream = &self.ranks[r].stream;
        let mut launch = stream.launch_builder(f);
        launch.arg(&dst).arg(&a).arg(&b).arg(&n);
        // SAFETY: the kernel's signature is (T*, const T*, const T*, u64); the
        // three addresses hold `count` elements of `dtype` on, or peer-accessible
        // from, rank r's device, and stay alive until the step's events complete.
        unsafe { launch.launch(self.grid(r, count, dtype)) }.map_err(cudarc_err("cuLaunchKernel (reduce)"))?;
        Ok(())
    }

    /// Starts one collective's enqueue: serialises it against calls from
    /// other threads (the guard), notes whether it is being captured into a
    /// graph, and makes each graph it is captured into keep the group's
    /// resources alive for as long as the graph lives (`crate::graph`): a
    /// graph may be replayed after the group is dropped.
    pub(crate) fn enter(&self) -> Result<Vec<std::sync::MutexGuard<'_, ()>>> {
        let serial: Vec<_> = self.serial.iter().map(|m| m.lock().unwrap_or_else(|p| p.into_inner())).collect();
        if let Some(ctl) = &self.ctl {
            ctl.check()?;
        }
        let mut capturing = false;
        for rank in &self.ranks {
            let Some((id, graph)) = capture_of(&rank.stream)? else { continue };
            capturing = true;
            let mut seen = self.captures.lock().unwrap_or_else(|p| p.into_inner());
            if !seen.contains(&id) {
                retain(graph, self.keep_alive())?;
                if seen.len() >= 16 {
                    seen.remove(0);
                }
                seen.push(id);
            }
        }
        self.capturing.store(capturing, Relaxed);
        Ok(serial)
    }

    /// Whether the call being enqueued is captured into a graph (set by
    /// [`Self::enter`]).
    pub(crate) fn capturing(&self) -> bool {
        self.capturing.load(Relaxed)
    }

    /// Everything a captured call of this group can touch when replayed:
    /// the one-shot's and the mesh's slots and flags, the staged links'
    /// buffers, the scratch, and the peer access the kernels rely on.
    fn keep_alive(&self) -> KeepAlive {
        let scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner()).clone();
        KeepAlive {
            ctx: self.ranks[0].ctx.clone(),
            payload: Arc::new((self.mesh.clone(), self.oneshot.clone(), self.ctl.clone(), self.pulls.clone(), scratch, self.access.clone())),
        }
    }

    /// Whether the group has the mesh all-reduce (used below
    /// [`MESH_AUTO_MAX_BYTES`] under [`Algorithm::Auto`]).
    pub fn uses_mesh(&self) -> bool {
        self.mesh.is_some()
    }

    /// Whether the group has the one-shot all-reduce, and where its slots
    /// are: `Some(true)` in host memory, `Some(false)` in device memory.
    pub fn oneshot_on_host(&self) -> Option<bool> {
        self.oneshot.as_ref().map(|o| o.on_host())
    }

    /// The algorithm an all-reduce of `bytes` bytes per rank runs with
    /// ([`Algorithm::Ring`], [`Algorithm::Mesh`] or [`Algorithm::OneShot`]).
    pub fn all_reduce_algorithm(&self, bytes: usize) -> Algorithm {
        choose(self.algorithm, self.size(), self.oneshot_on_host(), self.mesh.is_some(), bytes)
    }

    /// Runs `launch(r)` for every rank r: at once on the launcher threads
    /// where the group has them and no rank's stream is being captured into
    /// a graph (a replayed graph costs no launches), else one after another
    /// from this thread, last rank first (so this thread ends on rank 0's
    /// context, where the callers' buffer guards record their events).
    ///
    /// If any rank's launch fails, the kernels already launched are told to
    /// give up (the control block's abort word) and the group is marked
    /// failed: its ranks are out of step (`crate::failure`).
    pub(crate) fn launch_each(&self, launch: &Job<'_>) -> Result<()> {
        let launched = match &self.launchers {
            Some(l) if !self.capturing() => l.run(launch),
            _ => (0..self.size()).rev().try_for_each(launch),
        };
        if let (Err(e), Some(ctl)) = (&launched, &self.ctl) {
            ctl.abort();
            ctl.fail(Error::GroupFailed { reason: format!("a collective could not be launched on every rank: {e}") });
        }
        launched
    }

    /// The one-shot state, when an all-reduce of `bytes` per rank takes it.
    pub(crate) fn oneshot_for(&self, bytes: usize) -> Option<&OneShot> {
        self.oneshot.as_deref().filter(|_| self.all_reduce_algorithm(bytes) == Algorithm::OneShot)
    }

    /// Resolves the division kernel for `dtype` on every rank.
    pub(crate) fn resolve_scale_div(&self, dtype: DType) -> Result<()> {
        for r in 0..self.size() {
            self.function(r, "div", dtype, || kernels::scale_div_name(dtype.name()))?;
        }
        Ok(())
    }

    /// Launches `x /= divisor` over `count` elements on rank `r`'s stream.
    pub(crate) fn launch_scale_div(&self, r: usize, dtype: DType, x: u64, count: usize, divisor: f64) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let f = self.function(r, "div", dtype, || kernels::scale_div_name(dtype.name()))?;
        let n = count as u64;
        let mut launch = self.ranks[r].stream.launch_builder(f);
        launch.arg(&x).arg(&n).arg(&divisor);
        // SAFETY: signature (T*, u64, double); `x` holds `count` elements on rank r's device.
        unsafe { launch.launch(self.grid(r, count, dtype)) }.map_err(cudarc_err("cuLaunchKernel (scale)"))?;
        Ok(())
    }

    /// A device-to-device copy on rank `r`'s stream (same device).
    pub(crate) fn local_copy(&self, r: usize, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        bind(&self.ranks[r].ctx)?;
        // SAFETY: both ranges hold `bytes` bytes on rank r's device.
        check("cuMemcpyDtoDAsync", unsafe { api()?.cuMemcpyDtoDAsync_v2(dst, src, bytes, self.ranks[r].stream.cu_stream() as sys::CUstream) })
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // Peer access is disabled when the guards drop: no kernel or copy of
        // this group may still be reading a peer's memory then. Every rank
        // is waited for, whatever failed before it.
        for (r, e) in self.synchronize_each() {
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
    (crate::graph::RETAINED.load(Relaxed), crate::graph::RELEASED.load(Relaxed), crate::oneshot::DROPPED.load(Relaxed))
}

/// Locks shared by every group that enqueues on a stream, by (CUDA
/// context, stream) handle; entries go when their last group does.
type StreamKey = (usize, usize);
static STREAM_LOCKS: Lazy<Mutex<HashMap<StreamKey, Weak<Mutex<()>>>>> = Lazy::new(|| Mutex::new(HashMap::new()));

/// The shared locks of `ranks`' streams, one per distinct stream, in the
/// order of their keys: every group takes them in that one order.
fn stream_locks(ranks: &[Rank]) -> Vec<Arc<Mutex<()>>> {
    let mut keys: Vec<StreamKey> = ranks.iter().map(|r| (r.ctx.cu_ctx() as usize, r.stream.cu_stream() as usize)).collect();
    keys.sort_unstable();
    keys.dedup();
    let mut map = STREAM_LOCKS.lock().unwrap_or_else(|p| p.into_inner());
    map.retain(|_, w| w.strong_count() > 0);
    keys.into_iter()
        .map(|k| {
            map.get(&k).and_then(Weak::upgrade).unwrap_or_else(|| {
                let lock = Arc::new(Mutex::new(()));
                map.insert(k, Arc::downgrade(&lock));
                lock
            })
        })
        .collect()
}

/// Why `ranks` cannot run a fused all-reduce (mesh or one-shot), if they
/// cannot: both need 2 to 8 ranks, each on its own device.
pub(crate) fn layout_refusal(ranks: &[Rank]) -> Option<String> {
    let n = ranks.len();
    if !(2..=kernels::MESH_MAX_RANKS).contains(&n) {
        return Some("needs 2 to 8 ranks".into());
    }
    let mut devices: Vec<usize> = ranks.iter().map(|r| r.ctx.ordinal()).collect();
    devices.sort();
    devices.dedup();
    (devices.len() != n).then(|| "needs every rank on its own device".into())
}

/// The error for an all-reduce algorithm (`what`) the group cannot run.
pub(crate) fn impossible(what: &str, why: &str) -> Error {
    Error::InvalidArgument(format!("{what} all-reduce impossible: {why}"))
}

/// The all-reduce algorithm for a message of `bytes` per rank in a group
/// of `n` ranks set up for `algorithm`, with a one-shot (`Some(on_host)`)
/// and a mesh or not.
fn choose(algorithm: Algorithm, n: usize, oneshot: Option<bool>, mesh: bool, bytes: usize) -> Algorithm {
    let pushed = bytes.saturating_mul(n.saturating_sub(1));
    let auto = algorithm == Algorithm::Auto;
    if let Some(on_host) = oneshot {
        let max = if on_host { HOST_ONESHOT_AUTO_MAX_BYTES } else { ONESHOT_AUTO_MAX_BYTES };
        if !auto || pushed <= max {
            return Algorithm::OneShot;
        }
    }
    if mesh && (!auto || bytes < MESH_AUTO_MAX_BYTES) {
        return Algorithm::Mesh;
    }
    Algorithm::Ring
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_group_is_an_error_without_touching_the_driver() {
        assert!(matches!(Group::new(Vec::new(), &GroupOptions::default()), Err(Error::EmptyGroup)));
    }

    #[test]
    fn algorithm_names_parse() {
        assert_eq!("auto".parse::<Algorithm>().unwrap(), Algorithm::Auto);
        assert_eq!("ring".parse::<Algorithm>().unwrap(), Algorithm::Ring);
        assert_eq!("mesh".parse::<Algorithm>().unwrap(), Algorithm::Mesh);
        assert_eq!("oneshot".parse::<Algorithm>().unwrap(), Algorithm::OneShot);
        assert_eq!("one-shot".parse::<Algorithm>().unwrap(), Algorithm::OneShot);
        assert!(matches!("tree".parse::<Algorithm>(), Err(Error::InvalidArgument(_))));
        assert_eq!(GroupOptions::default().algorithm, Algorithm::Auto);
    }

    #[test]
    fn auto_picks_by_size_and_forced_algorithms_stick() {
        use Algorithm::*;
        let (mib, p2p, host) = (1usize << 20, Some(false), Some(true));
        // P2P, two ranks: one-shot to 4 MiB, mesh below 256 MiB, ring above.
        assert_eq!(choose(Auto, 2, p2p, true, 4096), OneShot);
        assert_eq!(choose(Auto, 2, p2p, true, 4 * mib), OneShot);
        assert_eq!(choose(Auto, 2, p2p, true, 4 * mib + 1), Mesh);
        assert_eq!(choose(Auto, 2, p2p, true, 256 * mib - 1), Mesh);
        assert_eq!(choose(Auto, 2, p2p, true, 256 * mib), Ring);
        // More ranks push more: the one-shot ends sooner.
        assert_eq!(choose(Auto, 5, p2p, true, mib), OneShot);
        assert_eq!(choose(Auto, 5, p2p, true, mib + 1), Mesh);
        // Without P2P: one-shot through host memory to 16 MiB, then the ring.
        assert_eq!(choose(Auto, 2, host, false, 16 * mib), OneShot);
        assert_eq!(choose(Auto, 2, host, false, 16 * mib + 1), Ring);
        // Groups with neither (shared devices, one rank): the ring.
        assert_eq!(choose(Auto, 3, None, false, 4096), Ring);
        // Forced algorithms hold at every size where the group has them.
        assert_eq!(choose(OneShot, 2, p2p, false, 1 << 30), OneShot);
        assert_eq!(choose(OneShot, 2, host, false, 1 << 30), OneShot);
        assert_eq!(choose(Mesh, 2, None, true, 1 << 30), Mesh);
        assert_eq!(choose(Ring, 2, None, false, 4096), Ring);
    }

    #[test]
    fn a_group_can_be_shared_between_threads() {
        fn is_send_sync<T: Send + Sync>() {}
        is_send_sync::<Group>();
    }

    #[test]
    fn pointer_arrays_fill_from_the_front() {
        let a = PtrArray::from_slice(&[16, 32, 48]);
        assert_eq!(a.0, [16, 32, 48, 0, 0, 0, 0, 0]);
        assert_eq!(std::mem::size_of::<PtrArray>(), 64, "the kernels take struct {{ void* p[8]; }}");
    }
}
