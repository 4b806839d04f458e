//! The verdict cache: the doctor's path decisions, written where the
//! library (or anyone) can read them later, and valid only for the driver,
//! boot and GPUs they were made on.

use crate::rules::{PairVerdict, UsePath};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// What a cache entry is valid for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheKey {
    /// NVIDIA driver version, e.g. `580.95.05`.
    pub driver_version: String,
    /// `/proc/sys/kernel/random/boot_id`.
    pub boot_id: String,
    /// The GPUs' PCI bus ids, by CUDA ordinal.
    pub bus_ids: Vec<String>,
}

/// One pair's decision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CachedPair {
    /// Source bus id.
    pub from: String,
    /// Destination bus id.
    pub to: String,
    /// The path to use.
    pub path: UsePath,
    /// Why.
    pub summary: String,
}

/// The cache file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cache {
    /// Format version (1).
    pub version: u32,
    /// What it is valid for.
    pub key: CacheKey,
    /// Seconds since the Unix epoch when written.
    pub written_at: u64,
    /// Per ordered pair.
    pub pairs: Vec<CachedPair>,
}

impl Cache {
    /// A cache of `verdicts` under `key`.
    pub fn new(key: CacheKey, verdicts: &[PairVerdict]) -> Self {
        let written_at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let pairs = verdicts
            .iter()
            .map(|v| CachedPair { from: v.from_bdf.clone(), to: v.to_bdf.clone(), path: v.use_path, summary: v.summary.clone() })
            .collect();
        Cache { version: 1, key, written_at, pairs }
    }
}

/// `$XDG_CACHE_HOME/cuda-peer/doctor.json`, else `$HOME/.cache/cuda-peer/doctor.json`
/// (the variables passed in, so tests need not touch the environment).
pub fn cache_path(xdg_cache_home: Option<&str>, home: Option<&str>) -> Option<PathBuf> {
    let base = match (xdg_cache_home.filter(|s| !s.is_empty()), home.filter(|s| !s.is_empty())) {
        (Some(x), _) => PathBuf::from(x),
        (None, Some(h)) => Path::new(h).join(".cache"),
        (None, None) => return None,
    };
    Some(base.join("cuda-peer").join("doctor.json"))
}

/// Writes `cache` to `path` (creating the directory), atomically.
pub fn write(path: &Path, cache: &Cache) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let text = serde_json::to_string_pretty(cache).map_err(std::io::Error::other)?;
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

/// Reads a cache file; `None` when missing or unparsable.
pub fn read(path: &Path) -> Option<Cache> {
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

/// The path the cache says to use for `from` -> `to` (bus ids), if the
/// cache was written for this driver, this boot and these GPUs; `None`
/// means "no valid answer: decide yourself" (verify as usual).
pub fn decide(cache: &Cache, key: &CacheKey, from: &str, to: &str) -> Option<UsePath> {
    if cache.version != 1 || cache.key != *key {
        return None;
    }
    let (from, to) = (crate::sysfs::normalize_bdf(from), crate::sysfs::normalize_bdf(to));
    cache.pairs.iter().find(|p| p.from == from && p.to == to).map(|p| p.path).filter(|p| *p != UsePath::Unknown)
}
