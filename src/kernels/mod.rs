//! Embedded reduction kernels (PTX, and machine code for common GPUs) and
//! their naming scheme.
//!
//! # Building the kernels from source
//!
//! By default the crate embeds the committed kernels described below, and its
//! build script runs no compiler: it only checks that the committed files are
//! exactly the modules and architectures of `src/kernels/list.rs`. With the
//! cargo feature `kernels-from-source` (or `CUDA_PEER_KERNELS_FROM_SOURCE=1` in
//! the build's environment), the build script compiles `kernels/reduce.cu`
//! with the local CUDA toolchain instead and embeds the result: the PTX with
//! `nvcc -ptx` (nvcc found through `CUDA_PATH`, `CUDA_HOME`, `PATH` or
//! `/usr/local/cuda`; target `compute_70`, or the oldest the toolkit has where it
//! has no `compute_70`, as CUDA 13), or with NVRTC through
//! `kernels/nvrtc_compile.py` where `CUDA_PEER_NVRTC` names a libnvrtc; the
//! cubins with ptxas (`CUDA_PEER_PTXAS`, or the one beside nvcc) for the
//! architectures in `CUDA_PEER_ARCHS` (default: the committed ones; e.g.
//! `CUDA_PEER_ARCHS=sm_89,sm_121` for machine code the committed set lacks,
//! `none` for the PTX only). The loading is the same in both modes. With no
//! toolkit, `eval "$(kernels/gen.sh --env)"` installs the PyPI wheels the
//! committed kernels were built with (NVRTC 12.0, ptxas 12.9) and sets those two
//! variables; a build with them reproduces the committed files byte for byte.
//!
//! # The committed kernels
//!
//! The kernels are written in CUDA C in `kernels/reduce.cu`, compiled to PTX
//! with NVRTC from CUDA 12.0 (`kernels/gen.sh`, target `compute_70`, PTX ISA
//! 8.0) and committed as `src/kernels/*.ptx`: one module of reduction
//! kernels for the ring (`reduce.ptx`) and one module per element type for
//! the fused all-reduces (`mesh_{ty}.ptx`). The same PTX is assembled by
//! `ptxas` (CUDA 12.9) into machine code (cubins) for sm_70, sm_80, sm_90,
//! sm_100 and sm_120 (the embedded set: [`CUBIN_ARCHS`]), committed
//! zstd-compressed as `src/kernels/cubin/sm_XY/{module}.cubin.zst`.
//! At module load ([`cubin_for`]) a device whose major architecture has a
//! cubin of the same major and an equal or lower minor gets the cubin (no
//! JIT: a cubin for sm_XY runs on every sm_XZ with Z >= Y); any other
//! device, or any device with `CUDA_PEER_FORCE_PTX=1` in the environment,
//! gets the PTX, which the driver JIT-compiles (and caches, in its JIT
//! cache) for the actual GPU. `kernels/gen.sh --check` verifies that the
//! committed PTX and cubins are exactly what the pinned compilers produce,
//! and that every module assembles for sm_70, sm_80, sm_86, sm_89, sm_90,
//! sm_100 and sm_120 without spills.
//!
//! What the modules hold (their sizes: docs/architecture.md):
//!
//! * `reduce`: `cp_reduce2_{op}_{ty}` for 4 ops x 12 types and
//!   `cp_scale_div_{ty}` for the 6 float types (fp8 included).
//! * `mesh_{ty}`: `cp_meshar_{op}_{ty}` and `cp_oneshot_{op}_{ty}` for the 4
//!   ops. Most of it is the mesh kernel, whose
//!   rank loop is unrolled for 8 ranks times 4 vectors in flight per thread
//!   times 16/sizeof(T) elements per vector (so 8-bit and 16-bit types are
//!   the largest, bf16 most, with its conversions), and the one-shot, which
//!   keeps 4 vectors in flight with a vector and an element-wise path for
//!   each load and store. Both unrolls are what the kernels' speed rests
//!   on, so they are kept (measured; see docs/measurements.md).
//!
//! Launch convention (reduce2 and scale_div): 1-D grid and block, block size
//! 256 intended (any block size is correct), any grid size (grid-stride
//! loops), no shared memory.  Pointers must be aligned to the element size and may
//! point into a peer GPU's memory.  Element counts are `u64`
//! (`unsigned long long`).
//!
//! Kernel signatures (`T` is the element type named by the type suffix):
//!
//! * [`reduce2_name`]: `(T* dst, const T* a, const T* b, u64 n)`;
//!   `dst[i] = a[i] op b[i]`; `dst` may equal `a` or `b` exactly.
//! * [`scale_div_name`]: `(T* x, u64 n, f64 divisor)`; `x[i] /= divisor`
//!   (floating-point types only).
//! * `cp_meshar_{op}_{ty}` (mesh all-reduce) and `cp_oneshot_{op}_{ty}`
//!   (one-shot all-reduce), in per-type modules ([`mesh_module`]); `PtrArray`
//!   is `struct { const void* p[8]; }` by value. Signatures and protocols
//!   are documented in `kernels/reduce.cu`.
//!
//! Semantics: integer `sum`/`prod` wrap; floating-point `min`/`max` propagate
//! NaN; `f16`/`bf16` are computed in `f32` and rounded back (nearest-even)
//! after every binary op. The cubins are the same PTX compiled ahead of
//! time by the same compiler back end as the driver's JIT; the PTX spells
//! every float operation with its rounding (`add.rn`, `mul.rn`: NVRTC ran
//! with `--fmad=false`), so no contraction can change a result.

pub(crate) mod launch;
pub(crate) mod load;

use crate::dtype::{DType, ReduceOp};

/// One embedded kernel module: its PTX and its cubins.
pub(crate) struct KernelModule {
    /// File name without extension (`reduce`, `mesh_f32`, ...).
    pub(crate) name: &'static str,
    /// Its PTX text.
    ptx: fn() -> &'static str,
    /// Its cubins, in the order of [`CUBIN_ARCHS`].
    cubins: fn() -> [&'static [u8]; CUBIN_ARCHS.len()],
}

// The table build.rs writes from `src/kernels/list.rs`: `BUILT_WITH` (for the
// logs), `CUBIN_ARCHS`, `CUBINS_COMPRESSED` (the committed cubins are zstd frames,
// those built from source ELF images), `MODULES` (the embedded files of every
// module, in never-inlined functions: a static or const holding the bytes, or an
// inlinable function, would also be written into the rlib's metadata), and for the
// tests `FROM_SOURCE` and `PTX_TARGET`.
include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// How many kernel modules there are: the reduction module and a mesh
/// module per element type (the length of `src/kernels/list.rs`'s list:
/// [`modules`]'s type checks it).
pub(crate) const MODULE_COUNT: usize = 1 + DType::ALL.len();

/// Every embedded module, in the order of [`Module::index`]: the reduction
/// module first, then the mesh modules in the order of `DType::ALL`.
pub(crate) fn modules() -> &'static [KernelModule; MODULE_COUNT] {
    &MODULES
}

/// PTX text of the reduction kernels (for tests that read it).
#[cfg(test)]
pub(crate) const REDUCE_PTX: &str = include_str!("reduce.ptx");

/// The index of `dtype` in `DType::ALL` (and among the mesh modules).
pub(crate) fn dtype_index(dtype: DType) -> usize {
    match dtype {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::F16 => 2,
        DType::BF16 => 3,
        DType::I32 => 4,
        DType::I64 => 5,
        DType::U32 => 6,
        DType::U64 => 7,
        DType::I8 => 8,
        DType::U8 => 9,
        DType::F8E4M3 => 10,
        DType::F8E5M2 => 11,
    }
}

/// An embedded kernel module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Module {
    /// The ring's reductions and the division of avg (`kernels/reduce.cu`
    /// built with `-DCP_BUILD_REDUCE`).
    Reduce,
    /// The mesh and one-shot all-reduce kernels of one element type
    /// (`kernels/reduce.cu` built with `-DCP_MESH_TY_{ty}`).
    Mesh(DType),
}

impl Module {
    /// Its index in [`modules`].
    pub(crate) fn index(self) -> usize {
        match self {
            Module::Reduce => 0,
            Module::Mesh(dtype) => 1 + dtype_index(dtype),
        }
    }

    /// Every module: the reduction module, then the mesh modules in the
    /// order of `DType::ALL`.
    pub(crate) fn all() -> [Module; MODULE_COUNT] {
        let mut all = [Module::Reduce; MODULE_COUNT];
        for (i, d) in DType::ALL.into_iter().enumerate() {
            all[i + 1] = Module::Mesh(d);
        }
        all
    }

    /// Its files.
    pub(crate) fn files(self) -> &'static KernelModule {
        &modules()[self.index()]
    }
}

/// How a kernel combines two values: a [`ReduceOp`]'s kernel operation
/// (avg sums, then divides).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum KernelOp {
    /// `a + b` (integers wrap).
    Sum,
    /// `a * b` (integers wrap).
    Prod,
    /// `min(a, b)` (floats propagate NaN).
    Min,
    /// `max(a, b)` (floats propagate NaN).
    Max,
}

impl KernelOp {
    /// Every kernel operation.
    pub(crate) const ALL: [KernelOp; 4] = [KernelOp::Sum, KernelOp::Prod, KernelOp::Min, KernelOp::Max];

    /// The kernel operation of `op`.
    pub(crate) fn of(op: ReduceOp) -> KernelOp {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => KernelOp::Sum,
            ReduceOp::Prod => KernelOp::Prod,
            ReduceOp::Min => KernelOp::Min,
            ReduceOp::Max => KernelOp::Max,
        }
    }

    /// As it appears in kernel names.
    pub(crate) fn name(self) -> &'static str {
        match self {
            KernelOp::Sum => "sum",
            KernelOp::Prod => "prod",
            KernelOp::Min => "min",
            KernelOp::Max => "max",
        }
    }

    fn index(self) -> usize {
        match self {
            KernelOp::Sum => 0,
            KernelOp::Prod => 1,
            KernelOp::Min => 2,
            KernelOp::Max => 3,
        }
    }
}

/// One kernel of the embedded modules: its family, operation and element
/// type. Its name and module follow from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Kernel {
    /// `cp_reduce2_{op}_{ty}`: `dst = a op b` (the ring's steps).
    Reduce2(KernelOp, DType),
    /// `cp_scale_div_{ty}`: `x /= divisor` (floating-point types only).
    ScaleDiv(DType),
    /// `cp_meshar_{op}_{ty}`: the mesh all-reduce.
    Mesh(KernelOp, DType),
    /// `cp_oneshot_{op}_{ty}`: the one-shot all-reduce.
    OneShot(KernelOp, DType),
    /// `cp_pair_sync`: two ranks meet (point-to-point transfers).
    PairSync,
    /// `cp_pair_xchg`: a one-chunk exchange between two ranks in one kernel.
    PairXchg,
    /// `cp_copy`: bytes copied by the SMs.
    Copy,
}

/// Slots in a [`load::FnTable`]: one per kernel operation and one for the
/// division, each per element type, one for the pair meeting, one for the
/// copy and one for the pair exchange.
pub(crate) const FN_SLOTS: usize = (KernelOp::ALL.len() + 1) * DType::ALL.len() + 3;

impl Kernel {
    /// Its entry name in the module.
    pub(crate) fn name(self) -> String {
        match self {
            Kernel::Reduce2(op, ty) => format!("cp_reduce2_{}_{ty}", op.name()),
            Kernel::ScaleDiv(ty) => format!("cp_scale_div_{ty}"),
            Kernel::Mesh(op, ty) => format!("cp_meshar_{}_{ty}", op.name()),
            Kernel::OneShot(op, ty) => format!("cp_oneshot_{}_{ty}", op.name()),
            Kernel::PairSync => "cp_pair_sync".into(),
            Kernel::PairXchg => "cp_pair_xchg".into(),
            Kernel::Copy => "cp_copy".into(),
        }
    }

    /// The module that holds it.
    pub(crate) fn module(self) -> Module {
        match self {
            Kernel::Reduce2(..) | Kernel::ScaleDiv(_) | Kernel::PairSync | Kernel::PairXchg | Kernel::Copy => Module::Reduce,
            Kernel::Mesh(_, ty) | Kernel::OneShot(_, ty) => Module::Mesh(ty),
        }
    }

    /// Its slot in a function table of its family (below [`FN_SLOTS`]).
    pub(crate) fn slot(self) -> usize {
        let (op, ty) = match self {
            Kernel::Reduce2(op, ty) | Kernel::Mesh(op, ty) | Kernel::OneShot(op, ty) => (op.index(), ty),
            Kernel::ScaleDiv(ty) => (KernelOp::ALL.len(), ty),
            Kernel::PairSync => return FN_SLOTS - 1,
            Kernel::Copy => return FN_SLOTS - 2,
            Kernel::PairXchg => return FN_SLOTS - 3,
        };
        op * DType::ALL.len() + dtype_index(ty)
    }
}

/// The [`CUBIN_ARCHS`] entry whose cubins run on a device of compute
/// capability `major.minor`: the same major and the highest minor not above
/// the device's (a cubin for sm_XY runs on sm_XZ for Z >= Y, never across
/// majors); `None` where only the PTX can serve.
pub(crate) fn cubin_for(major: u32, minor: u32) -> Option<usize> {
    cubin_in(&CUBIN_ARCHS, major, minor)
}

/// [`cubin_for`] among `archs`.
fn cubin_in(archs: &[(u32, u32)], major: u32, minor: u32) -> Option<usize> {
    (0..archs.len()).filter(|&i| archs[i].0 == major && archs[i].1 <= minor).max_by_key(|&i| archs[i].1)
}

/// `sm_XY` for the [`CUBIN_ARCHS`] entry `arch`.
pub(crate) fn arch_name(arch: usize) -> String {
    CUBIN_ARCHS.get(arch).map(|(ma, mi)| format!("sm_{ma}{mi}")).unwrap_or_else(|| "sm_?".into())
}

impl KernelModule {
    /// PTX text (no NUL bytes), the JIT fallback.
    pub(crate) fn ptx(&self) -> &'static str {
        (self.ptx)()
    }

    /// The cubin for the [`CUBIN_ARCHS`] entry `arch` (decompressed).
    pub(crate) fn cubin(&self, arch: usize) -> Result<Vec<u8>, String> {
        use std::io::Read;
        let what = || format!("{} cubin for {}", self.name, arch_name(arch));
        let image = (self.cubins)().get(arch).copied().filter(|f| !f.is_empty()).ok_or_else(|| format!("no {}", what()))?;
        if !CUBINS_COMPRESSED {
            return Ok(image.to_vec());
        }
        let mut decoder = ruzstd::decoding::StreamingDecoder::new(image).map_err(|e| format!("{}: {e}", what()))?;
        let mut out = Vec::with_capacity(image.len() * 12);
        decoder.read_to_end(&mut out).map_err(|e| format!("{}: {e}", what()))?;
        Ok(out)
    }
}

/// Largest grid of a mesh kernel (its flag area has a slot per block).
pub(crate) const MESH_MAX_BLOCKS: usize = 1024;

/// Most ranks a mesh kernel serves (the length of `PtrArray`).
pub(crate) const MESH_MAX_RANKS: usize = 8;

/// Largest grid of a one-shot kernel (its flag area has a slot per block
/// and source rank).
pub(crate) const ONESHOT_MAX_BLOCKS: usize = 128;

/// Slot sets of a one-shot region: four, so that a block may push two
/// rounds ahead of the one it reduces ([`OneShotPipeline::Deep`],
/// `kernels/reduce.cu`); a power of two.
pub(crate) const ONESHOT_SETS: usize = 4;

/// How a one-shot lane overlaps its rounds (the kernel's `ahead`; every
/// rank passes the same one on every launch of a lane).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OneShotPipeline {
    /// Per round: push, flag, wait, reduce.
    Plain = 0,
    /// Round v + 1 pushed right after flag v, before round v is reduced.
    Ahead = 1,
    /// Rounds 0 and 1 pushed first, then round v reduced in one pass with
    /// round v + 2's push.
    Deep = 2,
}

impl OneShotPipeline {
    /// The kernel argument.
    pub(crate) fn arg(self) -> i32 {
        self as i32
    }
}

/// Bytes of flags at the start of a one-shot region: `u32 [rank][block]`.
pub(crate) const ONESHOT_FLAG_BYTES: usize = MESH_MAX_RANKS * ONESHOT_MAX_BLOCKS * 4;

/// The one-shot grid with slots in host memory: enough loads in flight to
/// cover PCIe latency.
pub(crate) const ONESHOT_HOST_BLOCKS: u32 = 32;

/// `u32` words in one rank's mesh flag area: two barrier slots of
/// `[block][source rank]` flags, then one counter per block.
pub(crate) const MESH_FLAG_WORDS: usize = 3 * MESH_MAX_BLOCKS * MESH_MAX_RANKS + MESH_MAX_BLOCKS;

/// Recommended block size (threads per block) for all kernels.
pub(crate) const BLOCK_SIZE: u32 = 256;

/// `src/kernels/list.rs`, which build.rs reads.
#[cfg(test)]
mod list {
    include!("list.rs");
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// All `.entry` names declared in a PTX text.
    fn ptx_entries(ptx: &str) -> Vec<String> {
        ptx.lines()
            .filter_map(|line| {
                let rest = line.trim_start();
                let rest = rest.strip_prefix(".visible").unwrap_or(rest).trim_start();
                let rest = rest.strip_prefix(".entry")?;
                let name: String = rest.trim_start().chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                Some(name)
            })
            .collect()
    }

    /// The value of the first `.directive` line, e.g. `.version 8.0` -> `8.0`.
    fn directive(ptx: &'static str, name: &str) -> Option<&'static str> {
        ptx.lines().find_map(|line| {
            let rest = line.trim().strip_prefix(name)?;
            rest.starts_with(char::is_whitespace).then(|| rest.trim())
        })
    }

    /// Every kernel the crate can ask for.
    fn every_kernel() -> Vec<Kernel> {
        let mut all = Vec::new();
        for ty in DType::ALL {
            for op in KernelOp::ALL {
                all.extend([Kernel::Reduce2(op, ty), Kernel::Mesh(op, ty), Kernel::OneShot(op, ty)]);
            }
            if ty.is_float() {
                all.push(Kernel::ScaleDiv(ty));
            }
        }
        all.extend([Kernel::PairSync, Kernel::PairXchg, Kernel::Copy]);
        all
    }

    #[test]
    fn kernel_names_exist_for_every_pair() {
        for d in DType::ALL {
            for o in ReduceOp::ALL {
                let name = Kernel::Reduce2(KernelOp::of(o), d).name();
                assert!(REDUCE_PTX.contains(&format!(".entry {name}(")), "{name}");
            }
        }
    }

    #[test]
    fn names() {
        assert_eq!(Kernel::Reduce2(KernelOp::Sum, DType::F32).name(), "cp_reduce2_sum_f32");
        assert_eq!(Kernel::ScaleDiv(DType::F16).name(), "cp_scale_div_f16");
        assert_eq!(Kernel::Mesh(KernelOp::Max, DType::BF16).name(), "cp_meshar_max_bf16");
        assert_eq!(Kernel::OneShot(KernelOp::Prod, DType::U8).name(), "cp_oneshot_prod_u8");
        assert_eq!(Kernel::PairSync.name(), "cp_pair_sync");
        assert_eq!(Kernel::PairXchg.name(), "cp_pair_xchg");
        assert_eq!(Kernel::Copy.name(), "cp_copy");
        assert_eq!(KernelOp::of(ReduceOp::Avg), KernelOp::Sum);
    }

    #[test]
    fn every_module_has_exactly_its_kernels() {
        for (i, m) in modules().iter().enumerate() {
            let entries = ptx_entries(m.ptx());
            let found: BTreeSet<String> = entries.iter().cloned().collect();
            assert_eq!(found.len(), entries.len(), "duplicate .entry in {}", m.name);
            let expected: BTreeSet<String> = every_kernel().into_iter().filter(|k| k.module().index() == i).map(|k| k.name()).collect();
            assert_eq!(found, expected, "{}", m.name);
        }
        assert_eq!(every_kernel().iter().filter(|k| k.module() == Module::Reduce).count(), 4 * 12 + 6 + 3);
    }

    #[test]
    fn function_table_slots_are_distinct_within_a_family() {
        let families: [fn(KernelOp, DType) -> Kernel; 3] = [Kernel::Reduce2, Kernel::Mesh, Kernel::OneShot];
        for family in families {
            let mut slots: Vec<usize> = DType::ALL.iter().flat_map(|&ty| KernelOp::ALL.map(|op| family(op, ty).slot())).collect();
            slots.extend(DType::ALL.map(|ty| Kernel::ScaleDiv(ty).slot()));
            slots.extend([Kernel::PairSync.slot(), Kernel::PairXchg.slot(), Kernel::Copy.slot()]);
            assert!(slots.iter().all(|&s| s < FN_SLOTS));
            slots.sort();
            slots.dedup();
            assert_eq!(slots.len(), FN_SLOTS);
        }
    }

    fn all_ptx() -> Vec<&'static str> {
        modules().iter().map(|m| m.ptx()).collect()
    }

    #[test]
    fn mesh_layout_matches_the_source() {
        let src = include_str!("../../kernels/reduce.cu");
        assert!(src.contains(&format!("#define MESH_MAX_BLOCKS {MESH_MAX_BLOCKS}\n")));
        assert!(src.contains(&format!("#define MESH_MAX_RANKS {MESH_MAX_RANKS}\n")));
        assert!(src.contains("#define MESH_COUNTERS_OFFSET (3 * MESH_MAX_BLOCKS * MESH_MAX_RANKS)"));
        assert!(src.contains("#define MESH_FLAG_WORDS (MESH_COUNTERS_OFFSET + MESH_MAX_BLOCKS)"));
        assert!(src.contains(&format!("#define ONESHOT_MAX_BLOCKS {ONESHOT_MAX_BLOCKS}\n")));
        assert!(src.contains(&format!("#define PAIR_MAX_JOBS {}\n", launch::PAIR_MAX_JOBS)));
        assert!(src.contains(&format!("#define PAIR_MAX_BLOCKS {}\n", launch::PAIR_MAX_BLOCKS)));
        assert!(src.contains(&format!("#define PAIR_BLOCK_WORDS {}\n", launch::PAIR_BLOCK_WORDS)));
        assert!(src.contains("#define ONESHOT_FLAG_BYTES (MESH_MAX_RANKS * ONESHOT_MAX_BLOCKS * 4)"));
        assert!(src.contains(&format!("#define ONESHOT_SETS {ONESHOT_SETS}\n")));
        assert!(ONESHOT_SETS.is_power_of_two() && ONESHOT_SETS >= 4);
        for (name, mode) in [("PLAIN", OneShotPipeline::Plain), ("AHEAD", OneShotPipeline::Ahead), ("DEEP", OneShotPipeline::Deep)] {
            assert!(src.contains(&format!("#define ONESHOT_{name} {}\n", mode.arg())), "{name}");
        }
        assert!(ONESHOT_HOST_BLOCKS as usize <= ONESHOT_MAX_BLOCKS);
    }

    #[test]
    fn ptx_version_and_target() {
        for ptx in all_ptx() {
            let version = directive(ptx, ".version").expect("no .version in PTX");
            let (major, minor) = version.split_once('.').expect("bad .version");
            let v = (major.parse::<u32>().unwrap(), minor.parse::<u32>().unwrap());
            // The committed PTX is JIT-compiled by every driver from CUDA 12.0 on; PTX
            // built from source has the ISA of the compiler that built it.
            if !FROM_SOURCE {
                assert!(v <= (8, 0), "PTX .version {version} is newer than 8.0 (CUDA 12.0)");
            }
            assert_eq!(directive(ptx, ".target"), Some(PTX_TARGET));
            assert_eq!(directive(ptx, ".address_size"), Some("64"));
        }
        if !FROM_SOURCE {
            assert_eq!(PTX_TARGET, "sm_70");
        }
    }

    #[test]
    fn ptx_is_plain_text() {
        // cuModuleLoadData needs a NUL-terminated string; the PTX itself must
        // not contain NUL bytes (callers append one).
        for ptx in all_ptx() {
            assert!(!ptx.as_bytes().contains(&0));
            assert!(ptx.is_ascii());
        }
    }

    #[test]
    fn modules_follow_the_dtype_order() {
        assert_eq!(Module::Reduce.files().name, "reduce");
        for (i, d) in DType::ALL.iter().enumerate() {
            assert_eq!(dtype_index(*d), i);
            assert_eq!(Module::Mesh(*d).index(), i + 1);
            assert_eq!(Module::Mesh(*d).files().name, format!("mesh_{}", d.name()));
        }
    }

    /// `sm_XY` as `(X, Y)`.
    fn parse_arch(arch: &str) -> (u32, u32) {
        let digits = arch.strip_prefix("sm_").unwrap_or_else(|| panic!("{arch}"));
        let (major, minor) = digits.split_at(digits.len() - 1);
        (major.parse().unwrap(), minor.parse().unwrap())
    }

    /// The committed architectures, `(major, minor)`.
    fn committed_archs() -> Vec<(u32, u32)> {
        list::COMMITTED_ARCHS.iter().map(|a| parse_arch(a)).collect()
    }

    #[test]
    fn cubin_choice_follows_the_compatibility_rule() {
        let committed = committed_archs();
        let arch = |ma, mi| cubin_in(&committed, ma, mi).map(|i| list::COMMITTED_ARCHS[i]);
        assert_eq!(arch(7, 0), Some("sm_70"));
        assert_eq!(arch(7, 5), Some("sm_70"));
        assert_eq!(arch(8, 0), Some("sm_80"));
        assert_eq!(arch(8, 6), Some("sm_80"));
        assert_eq!(arch(8, 9), Some("sm_80"));
        assert_eq!(arch(9, 0), Some("sm_90"));
        assert_eq!(arch(10, 0), Some("sm_100"));
        assert_eq!(arch(10, 3), Some("sm_100"));
        assert_eq!(arch(12, 0), Some("sm_120"));
        assert_eq!(arch(12, 1), Some("sm_120"));
        // Other majors (older, or newer than the cubins) take the PTX.
        assert_eq!(arch(6, 1), None);
        assert_eq!(arch(11, 0), None);
        assert_eq!(arch(13, 0), None);
        // Several minors of one major (a from-source build for sm_89, say): the
        // highest not above the device's.
        let with_89 = [(8, 0), (8, 9), (12, 0), (12, 1)];
        assert_eq!(cubin_in(&with_89, 8, 6), Some(0));
        assert_eq!(cubin_in(&with_89, 8, 9), Some(1));
        assert_eq!(cubin_in(&with_89, 12, 0), Some(2));
        assert_eq!(cubin_in(&with_89, 12, 1), Some(3));
        // The embedded set: each architecture gets its own cubins.
        for (i, &(ma, mi)) in CUBIN_ARCHS.iter().enumerate() {
            assert_eq!(cubin_for(ma, mi), Some(i), "{}", arch_name(i));
        }
        assert!(CUBIN_ARCHS.windows(2).all(|w| w[0] < w[1]), "CUBIN_ARCHS ascending");
        if !FROM_SOURCE {
            assert_eq!(CUBIN_ARCHS.to_vec(), committed);
        }
    }

    /// `src/kernels/list.rs`, build.rs's list, is the Rust code's modules and
    /// `kernels/gen.sh`'s, and names the defines of `kernels/reduce.cu`.
    #[test]
    fn the_kernel_list_is_the_code_s_and_gen_sh_s() {
        for (m, (name, _)) in Module::all().into_iter().zip(list::MODULES) {
            assert_eq!(m.files().name, name);
        }
        let gen = include_str!("../../kernels/gen.sh");
        let value = |key: &str| gen.lines().find_map(|l| l.strip_prefix(key)).unwrap_or_else(|| panic!("no {key} in kernels/gen.sh"));
        let archs: Vec<&str> = value("CUBIN_ARCHS=\"").trim_end_matches('"').split_whitespace().collect();
        assert_eq!(archs, list::COMMITTED_ARCHS, "CUBIN_ARCHS in kernels/gen.sh");
        let first = value("MODULES=\"").trim_end_matches('"');
        let tys = value("for ty in ").split_once(';').expect("for ty in ...; do").0;
        assert!(value("for ty in ").contains("MODULES=\"$MODULES mesh_$ty:CP_MESH_TY_$ty\""));
        let gen_modules: Vec<String> =
            std::iter::once(first.to_string()).chain(tys.split_whitespace().map(|ty| format!("mesh_{ty}:CP_MESH_TY_{ty}"))).collect();
        let list_modules: Vec<String> = list::MODULES.iter().map(|(name, define)| format!("{name}:{define}")).collect();
        assert_eq!(gen_modules, list_modules, "MODULES in kernels/gen.sh");
        let src = include_str!("../../kernels/reduce.cu");
        for (_, define) in list::MODULES {
            assert!(src.contains(&format!("#ifdef {define}\n")) || src.contains(&format!("defined({define})")), "{define} in kernels/reduce.cu");
        }
    }

    /// `(name, st_value-less)` check of a cubin: an ELF64 image for the
    /// right `sm` (the low byte of e_flags holds it) naming every entry of
    /// the module's PTX.
    #[test]
    fn cubins_are_elf_images_of_every_entry_for_their_arch() {
        for m in modules() {
            let entries = ptx_entries(m.ptx());
            for (a, &(major, minor)) in CUBIN_ARCHS.iter().enumerate() {
                let img = m.cubin(a).unwrap_or_else(|e| panic!("{e}"));
                assert_eq!(&img[..4], b"\x7fELF", "{} {}", m.name, arch_name(a));
                assert_eq!(img[4], 2, "ELF64");
                let flags = u32::from_le_bytes([img[48], img[49], img[50], img[51]]);
                let sm = major * 10 + minor;
                assert!(flags & 0xff == sm || (flags >> 8) & 0xff == sm, "{} {}: e_flags {flags:#x}", m.name, arch_name(a));
                for e in &entries {
                    let needle = format!("\0{e}\0");
                    assert!(img.windows(needle.len()).any(|w| w == needle.as_bytes()), "{} {}: no {e}", m.name, arch_name(a));
                }
            }
        }
    }
}
