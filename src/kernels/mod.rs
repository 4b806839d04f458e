//! Embedded reduction kernels (PTX) and their naming scheme.
//!
//! The kernels are written in CUDA C in `kernels/reduce.cu`, compiled to PTX
//! with NVRTC from CUDA 12.0 (`kernels/gen.sh`, target `compute_70`, PTX ISA
//! 8.0) and committed as `src/kernels/reduce.ptx`.  The driver JIT-compiles the
//! PTX for the actual GPU at module load, so one PTX file serves sm_70 and
//! newer.  `kernels/gen.sh --check` verifies the committed PTX is up to date
//! and assembles with `ptxas` for sm_70, sm_80, sm_86, sm_89 and sm_90.
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
//!   (one-shot all-reduce), in per-type modules ([`mesh_ptx`]); `PtrArray`
//!   is `struct { const void* p[8]; }` by value. Signatures and protocols
//!   are documented in `kernels/reduce.cu`.
//!
//! Semantics: integer `sum`/`prod` wrap; floating-point `min`/`max` propagate
//! NaN; `f16`/`bf16` are computed in `f32` and rounded back (nearest-even)
//! after every binary op.

/// PTX text of the reduction kernels (`kernels/reduce.cu` built with
/// `-DCP_BUILD_REDUCE`).
pub(crate) const REDUCE_PTX: &str = include_str!("reduce.ptx");

/// PTX text of the mesh all-reduce kernels for element type `ty`
/// (`kernels/reduce.cu` built with `-DCP_MESH_TY_{ty}`), one module per
/// type so that a program JIT-compiles only the types it reduces.
pub(crate) fn mesh_ptx(ty: &str) -> Option<&'static str> {
    Some(match ty {
        "f32" => include_str!("mesh_f32.ptx"),
        "f64" => include_str!("mesh_f64.ptx"),
        "f16" => include_str!("mesh_f16.ptx"),
        "bf16" => include_str!("mesh_bf16.ptx"),
        "i32" => include_str!("mesh_i32.ptx"),
        "i64" => include_str!("mesh_i64.ptx"),
        "u32" => include_str!("mesh_u32.ptx"),
        "u64" => include_str!("mesh_u64.ptx"),
        "i8" => include_str!("mesh_i8.ptx"),
        "u8" => include_str!("mesh_u8.ptx"),
        _ => return None,
    })
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
pub(crate) const TYPES: [&str; 10] = [
    "f32", "f64", "f16", "bf16", "i32", "i64", "u32", "u64", "i8", "u8",
];

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
                let name: String = rest
                    .trim_start()
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
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
    fn names() {
        assert_eq!(reduce2_name("sum", "f32"), "cp_reduce2_sum_f32");
        assert_eq!(scale_div_name("f16"), "cp_scale_div_f16");
        assert!(FLOAT_TYPES.iter().all(|t| TYPES.contains(t)));
    }

    #[test]
    fn ptx_has_exactly_the_expected_entries() {
        let entries = ptx_entries(REDUCE_PTX);
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
            let ptx = mesh_ptx(ty).expect("a mesh module per type");
            let found: BTreeSet<String> = ptx_entries(ptx).into_iter().collect();
            let expected: BTreeSet<String> =
                OPS.iter().flat_map(|op| [format!("cp_meshar_{op}_{ty}"), format!("cp_oneshot_{op}_{ty}")]).collect();
            assert_eq!(found, expected, "{ty}");
        }
        assert!(mesh_ptx("f8").is_none());
    }

    fn all_ptx() -> Vec<&'static str> {
        std::iter::once(REDUCE_PTX).chain(TYPES.iter().filter_map(|t| mesh_ptx(t))).collect()
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
}
