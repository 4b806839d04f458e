//! Loading the embedded kernel modules (once per context, from the cubin
//! for the device's architecture or else the PTX) and the per-rank tables of
//! resolved kernel functions.

use crate::error::{cudarc_err, Error, Result};
use crate::kernels::{self, Kernel, Module, FN_SLOTS, MODULE_COUNT};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use once_cell::sync::Lazy;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

type ModuleCache = Lazy<Mutex<HashMap<usize, Arc<CudaModule>>>>;

/// The kernel modules (`kernels::modules()`, by index), loaded once per
/// context for the life of the process.
static MODULE_CACHES: [ModuleCache; MODULE_COUNT] = [const { Lazy::new(|| Mutex::new(HashMap::new())) }; MODULE_COUNT];

/// The environment variable that makes every module load from PTX (JIT)
/// even where a cubin would serve: `CUDA_PEER_FORCE_PTX=1` (any value but
/// empty or `0`).
pub const FORCE_PTX_ENV: &str = "CUDA_PEER_FORCE_PTX";

fn force_ptx() -> bool {
    std::env::var_os(FORCE_PTX_ENV).is_some_and(|v| !v.is_empty() && v != "0")
}

/// Which image of the kernels a context loads: `Some(arch)` (an index in
/// `kernels::CUBIN_ARCHS`) for a cubin, `None` for the PTX.
pub(crate) fn image_for(ctx: &Arc<CudaContext>) -> Result<Option<usize>> {
    use cudarc::driver::sys::CUdevice_attribute::{CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR};
    if force_ptx() {
        return Ok(None);
    }
    let major = ctx.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).map_err(cudarc_err("cuDeviceGetAttribute"))?;
    let minor = ctx.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR).map_err(cudarc_err("cuDeviceGetAttribute"))?;
    Ok(kernels::cubin_for(major.max(0) as u32, minor.max(0) as u32))
}

/// Module `m` on `ctx`, loaded the first time:
/// from the cubin for the device's architecture where there is one (no
/// JIT), else from the PTX (JIT-compiled by the driver). A cubin that does
/// not decompress or load (an old driver, say) falls back to the PTX, with
/// a warning. The cache is not locked while a module loads, so devices
/// load (and JIT-compile) at the same time; two threads loading one module
/// on one context at once both load it, and the first stored is kept.
pub(crate) fn load_module(ctx: &Arc<CudaContext>, m: Module) -> Result<Arc<CudaModule>> {
    let (module, index) = (m.files(), m.index());
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
    log::debug!(
        "cuda-peer: GPU{}: kernel module {} loaded from {how} in {:.1} ms ({})",
        ctx.ordinal(),
        module.name,
        start.elapsed().as_secs_f64() * 1e3,
        kernels::BUILT_WITH
    );
    let mut map = MODULE_CACHES[index].lock().unwrap_or_else(|p| p.into_inner());
    Ok(map.entry(key).or_insert(m).clone())
}

/// Loads `modules` on every context of `ctxs` (distinct contexts), one
/// thread per context, so that the devices load (or JIT-compile) at the
/// same time.
pub(crate) fn load_modules_everywhere(ctxs: &[&Arc<CudaContext>], modules: &[Module]) -> Result<()> {
    let load_all = |ctx: &Arc<CudaContext>| -> Result<()> {
        for &m in modules {
            load_module(ctx, m)?;
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

/// `kernel` on `ctx`, from its module (loaded once per context).
pub(crate) fn function(ctx: &Arc<CudaContext>, kernel: Kernel) -> Result<CudaFunction> {
    let module = load_module(ctx, kernel.module())?;
    module.load_function(&kernel.name()).map_err(cudarc_err("cuModuleGetFunction"))
}

/// One kernel family's functions for one rank, by [`Kernel::slot`], each
/// looked up on first use and kept: a launch costs an index, not a name
/// format and a map lookup.
pub(crate) struct FnTable {
    cells: [OnceLock<CudaFunction>; FN_SLOTS],
}

impl Default for FnTable {
    fn default() -> Self {
        FnTable { cells: [const { OnceLock::new() }; FN_SLOTS] }
    }
}

impl FnTable {
    /// The function for `kernel`, loaded by `load` the first time.
    pub(crate) fn get(&self, kernel: Kernel, load: impl FnOnce() -> Result<CudaFunction>) -> Result<&CudaFunction> {
        let cell = &self.cells[kernel.slot()];
        if let Some(f) = cell.get() {
            return Ok(f);
        }
        let f = load()?;
        Ok(cell.get_or_init(|| f))
    }
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
