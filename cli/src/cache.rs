//! The verdict cache: the doctor's path decisions, written where the
//! library reads them (`cuda_peer::verdict`, which owns the format, the key
//! and the speed rule), and valid only for the driver, boot and GPUs they
//! were made on. This module turns verdicts into cache entries and back.

pub use crate::rules::speed_sample;
use crate::rules::{PairVerdict, Speeds, UsePath};
pub use cuda_peer::verdict::{Cache, CacheKey, CachedPair, CachedPath, SpeedSample};
use std::path::{Path, PathBuf};

/// The cache's word for a verdict's path.
pub fn cached_path(p: UsePath) -> CachedPath {
    match p {
        UsePath::P2p => CachedPath::P2p,
        UsePath::Staged => CachedPath::Staged,
        UsePath::None => CachedPath::Unusable,
        UsePath::Unknown => CachedPath::Unknown,
    }
}

/// The verdict's path for the cache's word.
pub fn use_path(p: CachedPath) -> UsePath {
    match p {
        CachedPath::P2p => UsePath::P2p,
        CachedPath::Staged => UsePath::Staged,
        CachedPath::Unusable => UsePath::None,
        CachedPath::Unknown => UsePath::Unknown,
    }
}

/// The cache entry of one pair's verdict (with its speeds, where measured).
pub fn entry(v: &PairVerdict, speeds: Option<&Speeds>) -> CachedPair {
    CachedPair {
        from: v.from_bdf.clone(),
        to: v.to_bdf.clone(),
        path: cached_path(v.use_path),
        summary: v.summary.clone(),
        speed: speeds.and_then(speed_sample),
    }
}

/// `$XDG_CACHE_HOME/cuda-peer/doctor.json`, else `$HOME/.cache/cuda-peer/doctor.json`
/// (the variables passed in, so tests need not touch the environment).
/// The doctor itself writes to `cuda_peer::verdict::cache_path()`, which
/// `CUDA_PEER_DOCTOR_CACHE` overrides.
pub fn cache_path(xdg_cache_home: Option<&str>, home: Option<&str>) -> Option<PathBuf> {
    cuda_peer::verdict::default_path(xdg_cache_home, home)
}

/// Writes `cache` to `path` (creating the directory), atomically and never
/// through a symlink ([`Cache::write`]).
pub fn write(path: &Path, cache: &Cache) -> std::io::Result<()> {
    cache.write(path).map_err(std::io::Error::other)
}

/// Reads a cache file ([`Cache::read`]: regular files of at most
/// `cuda_peer::verdict::MAX_CACHE_BYTES` only); `None` when missing,
/// refused or unparsable.
pub fn read(path: &Path) -> Option<Cache> {
    Cache::read(path).ok()
}

/// The path the cache says to use for `from` -> `to` (bus ids), if the
/// cache applies to a process whose key is `key` (see
/// `cuda_peer::verdict`); `None` means "no valid answer: decide yourself"
/// (verify as usual).
pub fn decide(cache: &Cache, key: &CacheKey, from: &str, to: &str) -> Option<UsePath> {
    cache.applies_to(key).ok()?;
    cache.pair(from, to).map(|p| use_path(p.path)).filter(|p| *p != UsePath::Unknown)
}
