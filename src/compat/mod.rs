//! Shapes of other libraries' APIs over cuda-peer's own, so that switching
//! costs one `use` line: [`nccl`] for `cudarc::nccl`.

pub mod nccl;
