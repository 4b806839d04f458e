// The kernel modules and the architectures of the committed cubins: the one list
// that build.rs (through `include!`) checks the committed files against and builds
// the embedded table from. Keep in step with MODULES and CUBIN_ARCHS in
// kernels/gen.sh (a unit test in src/kernels/mod.rs compares them). Plain
// constants only: build.rs compiles this file on its own.

/// Every kernel module, in the order of `Module::index` (the reduction module,
/// then the mesh modules in the order of `DType::ALL`): its file name and the
/// define that selects it in `kernels/reduce.cu`.
pub(crate) const MODULES: [(&str, &str); 13] = [
    ("reduce", "CP_BUILD_REDUCE"),
    ("mesh_f32", "CP_MESH_TY_f32"),
    ("mesh_f64", "CP_MESH_TY_f64"),
    ("mesh_f16", "CP_MESH_TY_f16"),
    ("mesh_bf16", "CP_MESH_TY_bf16"),
    ("mesh_i32", "CP_MESH_TY_i32"),
    ("mesh_i64", "CP_MESH_TY_i64"),
    ("mesh_u32", "CP_MESH_TY_u32"),
    ("mesh_u64", "CP_MESH_TY_u64"),
    ("mesh_i8", "CP_MESH_TY_i8"),
    ("mesh_u8", "CP_MESH_TY_u8"),
    ("mesh_f8e4m3", "CP_MESH_TY_f8e4m3"),
    ("mesh_f8e5m2", "CP_MESH_TY_f8e5m2"),
];

/// Architectures of the committed cubins (`src/kernels/cubin/ARCH/`), ascending:
/// one per major architecture, its lowest minor.
pub(crate) const COMMITTED_ARCHS: [&str; 5] = ["sm_70", "sm_80", "sm_90", "sm_100", "sm_120"];
