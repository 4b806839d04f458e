//! Which host a rank runs on, and whether a job's ranks span hosts.

use super::bootstrap::{self, Exchange};

/// The environment variable that overrides [`host_identity`] (to simulate
/// several hosts on one machine in tests, or to name hosts whose names and
/// boot ids would not tell them apart).
pub const HOST_ID_ENV: &str = "CUDA_PEER_HOST_ID";

/// This host's identity: `CUDA_PEER_HOST_ID` when set, else its name and
/// boot id (two containers of one machine share the boot id but may not
/// share device memory handles, so the name is part of it).
pub fn host_identity() -> String {
    if let Ok(id) = std::env::var(HOST_ID_ENV) {
        if !id.is_empty() {
            return id;
        }
    }
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string()).unwrap_or_default();
    format!("{}/{}", read("/proc/sys/kernel/hostname"), read("/proc/sys/kernel/random/boot_id"))
}

/// Whether the ranks of `exchange` run on more than one host (their
/// [`host_identity`] differ), all-gathered: every rank must call it, and
/// every rank gets the same answer. Between hosts the collectives run on
/// NCCL ([`super::NcclComm`]); within one, on cuda-peer's own paths ([`super::Comm`]).
pub fn spans_hosts(exchange: &dyn Exchange) -> crate::error::Result<bool> {
    let all = bootstrap::gather(exchange, host_identity().as_bytes())?;
    Ok(all.iter().any(|h| *h != all[0]))
}
