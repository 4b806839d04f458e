//! Embedded reduction kernels (PTX, and machine code for common GPUs) and
//! their naming scheme.
//!
//! The kernels are written in CUDA C in `kernels/reduce.cu`, compiled to PTX
//! with NVRTC from CUDA 12.0 (`kernels/gen.sh`, target `compute_70`, PTX ISA
//! 8.0) and committed as `src/kernels/*.ptx`: one module of reduction
//! kernels for the ring (`reduce.ptx`) and one module per element type for
//! the fused all-reduces (`mesh_{ty}.ptx`). The same PTX is assembled by
//! `ptxas` (CUDA 12.9) into machine code (cubins) for [`CUBIN_ARCHS`],
//! committed zstd-compressed as `src/kernels/cubin/sm_XY/{module}.cubin.zst`.
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
//! What the modules hold (sizes at the time of writing: PTX / sm_90 cubin):
//!
//! * `reduce`: `cp_reduce2_{op}_{ty}` for 4 ops x 10 types and
//!   `cp_scale_div_{ty}` for 4 float types (176 KB / 196 KB).
//! * `mesh_{ty}`: `cp_meshar_{op}_{ty}` and `cp_oneshot_{op}_{ty}` for the 4
//!   ops (270 KB-1 MB / 210-450 KB). Most of it is the mesh kernel, whose
//!   rank loop is unrolled for 8 ranks times 4 vectors in flight per thread
//!   times 16/sizeof(T) elements per vector (so 8-bit and 16-bit types are
//!   the largest, bf16 most, with its conversions), and the one-shot, which
//!   keeps 4 vectors in flight with a vector and an element-wise path for
//!   each load and store. Both unrolls are what the kernels' speed rests
//!   on, so they are kept as measured.
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

/// Architectures with embedded cubins, `(major, minor)`, in the order of
/// [`KernelModule`]'s cubins (keep in step with `CUBIN_ARCHS` in
/// `kernels/gen.sh`).
pub(crate) mod load;

pub(crate) const CUBIN_ARCHS: [(u32, u32); 5] = [(7, 0), (8, 0), (9, 0), (10, 0), (12, 0)];

/// One embedded kernel module: its PTX and its cubins.
pub(crate) struct KernelModule {
    /// File name without extension (`reduce`, `mesh_f32`, ...).
    pub(crate) name: &'static str,
    /// Its index in [`modules`].
    index: usize,
}

/// The embedded files, by module index. Plain functions that are never
/// inlined: a static or const holding the bytes (or an inlinable function)
/// would also be written into the rlib's metadata, doubling its size.
macro_rules! embedded {
    ($($i:literal => $name:literal,)*) => {
        /// Every embedded module: [`REDUCE`] first, then the mesh modules in
        /// the order of `DType::ALL`.
        pub(crate) fn modules() -> &'static [KernelModule; 11] {
            static MODULES: [KernelModule; 11] = [$(KernelModule { name: $name, index: $i }),*];
            &MODULES
        }

        #[inline(never)]
        fn ptx_of(index: usize) -> &'static str {
            match index {
                $($i => include_str!(concat!($name, ".ptx")),)*
                _ => "",
            }
        }

        #[inline(never)]
        fn cubins_of(index: usize) -> [&'static [u8]; CUBIN_ARCHS.len()] {
            match index {
                $($i => [
                    include_bytes!(concat!("cubin/sm_70/", $name, ".cubin.zst")),
                    include_bytes!(concat!("cubin/sm_80/", $name, ".cubin.zst")),
                    include_bytes!(concat!("cubin/sm_90/", $name, ".cubin.zst")),
                    include_bytes!(concat!("cubin/sm_100/", $name, ".cubin.zst")),
                    include_bytes!(concat!("cubin/sm_120/", $name, ".cubin.zst")),
                ],)*
                _ => [&[]; CUBIN_ARCHS.len()],
            }
        }
    };
}

embedded! {
    0 => "reduce",
    1 => "mesh_f32",
    2 => "mesh_f64",
    3 => "mesh_f16",
    4 => "mesh_bf16",
    5 => "mesh_i32",
    6 => "mesh_i64",
    7 => "mesh_u32",
    8 => "mesh_u64",
    9 => "mesh_i8",
    10 => "mesh_u8",
}

/// PTX text of the reduction kernels (for tests that read it).
#[cfg(test)]
pub(crate) const REDUCE_PTX: &str = include_str!("reduce.ptx");

/// Index in [`modules`] of the reduction kernels (`kernels/reduce.cu` built
/// with `-DCP_BUILD_REDUCE`).
pub(crate) const REDUCE: usize = 0;

/// Index in [`modules`] of the mesh and one-shot all-reduce kernels for
/// element type `ty` (`kernels/reduce.cu` built with `-DCP_MESH_TY_{ty}`),
/// one module per type.
pub(crate) fn mesh_module(ty: &str) -> Option<usize> {
    modules().iter().skip(1).position(|m| m.name.strip_prefix("mesh_") == Some(ty)).map(|i| i + 1)
}

/// The [`CUBIN_ARCHS`] entry whose cubins run on a device of compute
/// capability `major.minor`: the same major and the highest minor not above
/// the device's (a cubin for sm_XY runs on sm_XZ for Z >= Y, never across
/// majors); `None` where only the PTX can serve.
pub(crate) fn cubin_for(major: u32, minor: u32) -> Option<usize> {
    (0..CUBIN_ARCHS.len()).filter(|&i| CUBIN_ARCHS[i].0 == major && CUBIN_ARCHS[i].1 <= minor).max_by_key(|&i| CUBIN_ARCHS[i].1)
}

/// `sm_XY` for the [`CUBIN_ARCHS`] entry `arch`.
pub(crate) fn arch_name(arch: usize) -> String {
    CUBIN_ARCHS.get(arch).map(|(ma, mi)| format!("sm_{ma}{mi}")).unwrap_or_else(|| "sm_?".into())
}

impl KernelModule {
    /// PTX text (no NUL bytes), the JIT fallback.
    pub(crate) fn ptx(&self) -> &'static str {
        ptx_of(self.index)
    }

    /// The cubin for the [`CUBIN_ARCHS`] entry `arch`, decompressed.
    pub(crate) fn cubin(&self, arch: usize) -> Result<Vec<u8>, String> {
        use std::io::Read;
        let what = || format!("{}.cubin.zst for {}", self.name, arch_name(arch));
        let frame = cubins_of(self.index).get(arch).copied().filter(|f| !f.is_empty()).ok_or_else(|| format!("no {}", what()))?;
        let mut decoder = ruzstd::decoding::StreamingDecoder::new(frame).map_err(|e| format!("{}: {e}", what()))?;
        let mut out = Vec::with_capacity(frame.len() * 12);
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
pub(crate) const ONESHOT_MAX_BLOCKS: usize = 64;

/// Bytes of flags at the start of a one-shot region: `u32 [rank][block]`.
pub(crate) const ONESHOT_FLAG_BYTES: usize = MESH_MAX_RANKS * ONESHOT_MAX_BLOCKS * 4;

/// The one-shot grid with slots in device memory (P2P): enough stores in
/// flight to fill NVLink.
pub(crate) const ONESHOT_DEVICE_BLOCKS: u32 = 64;

/// The one-shot grid with slots in host memory: enough loads in flight to
/// cover PCIe latency.
pub(crate) const ONESHOT_HOST_BLOCKS: u32 = 32;

/// `u32` words in one rank's mesh flag area: two barrier slots of
/// `[block][source rank]` flags, then one counter per block.
pub(crate) const MESH_FLAG_WORDS: usize = 2 * MESH_MAX_BLOCKS * MESH_MAX_RANKS + MESH_MAX_BLOCKS;

/// Reduction operations, as they appear in kernel names.
#[cfg(test)]
pub(crate) const OPS: [&str; 4] = ["sum", "prod", "min", "max"];

/// Element types, as they appear in kernel names.
#[cfg(test)]
///
/// `f16` and `bf16` are 16-bit IEEE half and bfloat16 (stored as `u16`);
/// `i8`/`u8` through `i64`/`u64` are two's-complement / unsigned integers.
pub(crate) const TYPES: [&str; 10] = ["f32", "f64", "f16", "bf16", "i32", "i64", "u32", "u64", "i8", "u8"];

/// Element types for which a `cp_scale_div_*` kernel exists (used for avg).
#[cfg(test)]
pub(crate) const FLOAT_TYPES: [&str; 4] = ["f32", "f64", "f16", "bf16"];

/// Recommended block size (threads per block) for all kernels.
pub(crate) const BLOCK_SIZE: u32 = 256;

/// Name of the two-input reduction kernel for `op` (one of `OPS`) and
/// element type `ty` (one of `TYPES`): `cp_reduce2_{op}_{ty}`.
pub(crate) fn reduce2_name(op: &str, ty: &str) -> String {
    format!("cp_reduce2_{op}_{ty}")
}

/// Name of the in-place division kernel for floating-point type `ty` (one of
/// `FLOAT_TYPES`): `cp_scale_div_{ty}`.
pub(crate) fn scale_div_name(ty: &str) -> String {
    format!("cp_scale_div_{ty}")
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

    fn expected_entries() -> BTreeSet<String> {
        let mut set = BTreeSet::new();
        for op in OPS {
            for ty in TYPES {
                set.insert(reduce2_name(op, ty));
            }
        }
        for ty in FLOAT_TYPES {
            set.insert(scale_div_name(ty));
        }
        set
    }

    #[test]
    fn kernel_names_exist_for_every_pair() {
        for d in crate::dtype::DType::ALL {
            for o in crate::dtype::ReduceOp::ALL {
                let name = reduce2_name(o.kernel_op(), d.name());
                assert!(REDUCE_PTX.contains(&format!(".entry {name}(")), "{name}");
            }
        }
    }

    #[test]
    fn names() {
        assert_eq!(reduce2_name("sum", "f32"), "cp_reduce2_sum_f32");
        assert_eq!(scale_div_name("f16"), "cp_scale_div_f16");
        assert!(FLOAT_TYPES.iter().all(|t| TYPES.contains(t)));
    }

    #[test]
    fn ptx_has_exactly_the_expected_entries() {
        let entries = ptx_entries(modules()[REDUCE].ptx());
        let found: BTreeSet<String> = entries.iter().cloned().collect();
        assert_eq!(found.len(), entries.len(), "duplicate .entry in PTX");
        let expected = expected_entries();
        let missing: Vec<_> = expected.difference(&found).collect();
        let unexpected: Vec<_> = found.difference(&expected).collect();
        assert!(missing.is_empty(), "kernels missing from PTX: {missing:?}");
        assert!(unexpected.is_empty(), "unexpected kernels in PTX: {unexpected:?}");
        assert_eq!(found.len(), OPS.len() * TYPES.len() + FLOAT_TYPES.len());
    }

    #[test]
    fn mesh_ptx_has_the_mesh_and_oneshot_kernels_per_op_for_its_type() {
        for ty in TYPES {
            let ptx = modules()[mesh_module(ty).expect("a mesh module per type")].ptx();
            let found: BTreeSet<String> = ptx_entries(ptx).into_iter().collect();
            let expected: BTreeSet<String> = OPS.iter().flat_map(|op| [format!("cp_meshar_{op}_{ty}"), format!("cp_oneshot_{op}_{ty}")]).collect();
            assert_eq!(found, expected, "{ty}");
        }
        assert!(mesh_module("f8").is_none());
    }

    fn all_ptx() -> Vec<&'static str> {
        modules().iter().map(|m| m.ptx()).collect()
    }

    #[test]
    fn mesh_layout_matches_the_source() {
        let src = include_str!("../../kernels/reduce.cu");
        assert!(src.contains(&format!("#define MESH_MAX_BLOCKS {MESH_MAX_BLOCKS}\n")));
        assert!(src.contains(&format!("#define MESH_MAX_RANKS {MESH_MAX_RANKS}\n")));
        assert!(src.contains("#define MESH_COUNTERS_OFFSET (2 * MESH_MAX_BLOCKS * MESH_MAX_RANKS)"));
        assert!(src.contains("#define MESH_FLAG_WORDS (MESH_COUNTERS_OFFSET + MESH_MAX_BLOCKS)"));
        assert!(src.contains(&format!("#define ONESHOT_MAX_BLOCKS {ONESHOT_MAX_BLOCKS}\n")));
        assert!(src.contains("#define ONESHOT_FLAG_BYTES (MESH_MAX_RANKS * ONESHOT_MAX_BLOCKS * 4)"));
        assert!(ONESHOT_DEVICE_BLOCKS as usize <= ONESHOT_MAX_BLOCKS && ONESHOT_HOST_BLOCKS as usize <= ONESHOT_MAX_BLOCKS);
    }

    #[test]
    fn ptx_version_and_target() {
        for ptx in all_ptx() {
            let version = directive(ptx, ".version").expect("no .version in PTX");
            let (major, minor) = version.split_once('.').expect("bad .version");
            let v = (major.parse::<u32>().unwrap(), minor.parse::<u32>().unwrap());
            assert!(v <= (8, 0), "PTX .version {version} is newer than 8.0 (CUDA 12.0)");
            assert_eq!(directive(ptx, ".target"), Some("sm_70"));
            assert_eq!(directive(ptx, ".address_size"), Some("64"));
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
        assert_eq!(modules()[REDUCE].name, "reduce");
        for (i, d) in crate::dtype::DType::ALL.iter().enumerate() {
            assert_eq!(mesh_module(d.name()), Some(i + 1));
            assert_eq!(modules()[i + 1].name, format!("mesh_{}", d.name()));
            assert_eq!(d.name(), TYPES[i]);
        }
    }

    #[test]
    fn cubin_choice_follows_the_compatibility_rule() {
        let arch = |ma, mi| cubin_for(ma, mi).map(arch_name);
        assert_eq!(arch(7, 0).as_deref(), Some("sm_70"));
        assert_eq!(arch(7, 5).as_deref(), Some("sm_70"));
        assert_eq!(arch(8, 0).as_deref(), Some("sm_80"));
        assert_eq!(arch(8, 6).as_deref(), Some("sm_80"));
        assert_eq!(arch(8, 9).as_deref(), Some("sm_80"));
        assert_eq!(arch(9, 0).as_deref(), Some("sm_90"));
        assert_eq!(arch(10, 0).as_deref(), Some("sm_100"));
        assert_eq!(arch(10, 3).as_deref(), Some("sm_100"));
        assert_eq!(arch(12, 0).as_deref(), Some("sm_120"));
        assert_eq!(arch(12, 1).as_deref(), Some("sm_120"));
        // Other majors (older, or newer than the cubins) take the PTX.
        assert_eq!(arch(6, 1), None);
        assert_eq!(arch(11, 0), None);
        assert_eq!(arch(13, 0), None);
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
