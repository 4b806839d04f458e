//! The doctor's verdicts, read by the library.
//!
//! `cuda-peer doctor` (the `cli/` crate) checks every ordered pair of GPUs
//! (copy-engine P2P, SM peer loads and stores, the staged path, speeds) and
//! writes a verdict per pair to a cache file. This module owns that file:
//! its format (the doctor writes it through [`Cache::write`], the library
//! reads it through [`Cache::read`], so the two cannot drift), the key that
//! says when a cache applies ([`CacheKey`]), the speed rule the doctor
//! judges by ([`faster_path`]), and the hook that lets
//! [`PathPolicy::Auto`](crate::copy::PathPolicy::Auto) links and groups
//! follow a verdict.
//!
//! # Where the cache is
//!
//! `$CUDA_PEER_DOCTOR_CACHE` ([`CACHE_ENV`]) where set, else
//! `$XDG_CACHE_HOME/cuda-peer/doctor.json`, else
//! `$HOME/.cache/cuda-peer/doctor.json` ([`cache_path`]). The doctor writes
//! to the same place (unless `--no-cache`).
//!
//! # The file
//!
//! JSON, read and written with `serde_json` through private mirror structs
//! (the public types carry no serde traits):
//!
//! ```json
//! {
//!   "version": 1,
//!   "key": {"driver_version": "580.95.05", "boot_id": "...", "bus_ids": ["0000:19:00.0", "0000:3b:00.0"]},
//!   "written_at": 1767225600,
//!   "pairs": [
//!     {"from": "0000:19:00.0", "to": "0000:3b:00.0", "path": "p2p", "summary": "...",
//!      "bytes": 67108864, "p2p_gbs": 368.25, "staged_gbs": 25.1}
//!   ]
//! }
//! ```
//!
//! `path` is one of `p2p`, `staged`, `none`, `unknown` ([`CachedPath`]);
//! `bytes`, `p2p_gbs` and `staged_gbs` are present where the doctor measured
//! both paths, and a pair's [`SpeedSample`] is read only where all three are
//! numbers (a bandwidth that was not finite is written as `null`). Fields
//! this module does not know are ignored. Files written by earlier versions
//! of this module, whose writer laid the same fields out by hand, read the
//! same way.
//!
//! [`Cache::write`] creates its directory, writes the text to a new file in
//! that directory (created exclusively under a random name, mode `0644`
//! before the umask, synced), then renames it over the cache path. It never
//! opens an existing file for writing, so a symlink at the cache path or at
//! any other name in the directory is replaced or left alone, never followed:
//! a `sudo cuda-peer doctor` cannot be made to overwrite the file a symlink
//! points to. A cache larger than [`MAX_CACHE_BYTES`] is not written.
//!
//! [`Cache::read`] reads regular files only, of at most [`MAX_CACHE_BYTES`].
//! It checks the path before opening it (so that a device file is never
//! opened), opens it without blocking (`O_NONBLOCK` on Linux, so that a FIFO
//! swapped in after the check does not wait for a writer), checks the opened
//! file again (`fstat`), and reads at most one byte past the limit. A
//! directory, FIFO, socket or device is [`CacheError::NotRegularFile`], a
//! larger file [`CacheError::TooLarge`], a file of another user than this
//! one or root, or one every user may write, [`CacheError::NotTrusted`]
//! (a cache in a shared directory another user planted), text that is not
//! a cache [`CacheError::Format`].
//!
//! # When it applies
//!
//! The file carries the key it was written under: the NVIDIA driver's
//! version, the boot id (`/proc/sys/kernel/random/boot_id`) and the PCI
//! bus ids of the GPUs the doctor saw. It applies to this process when its
//! format version is [`FORMAT_VERSION`], the driver version and boot id are
//! this machine's, and every GPU this process sees is among the cache's
//! bus ids (pairs are named by bus id, so a `CUDA_VISIBLE_DEVICES` subset
//! or reordering still matches). A cache that cannot be used is never an
//! error for a link, which is then decided as without a doctor: a missing
//! or non-matching cache is ignored with a `log::debug!` line; one that was
//! refused or could not be read or parsed is ignored with a `log::warn!`
//! line (the first time in a process; `log::debug!` after that).
//!
//! The driver version is the kernel module's (`/sys/module/nvidia/version`,
//! else `/proc/driver/nvidia/version`, e.g. `580.95.05`); only where neither
//! is readable is it `cuda <n>` from `cuDriverGetVersion`. The module version
//! is the stricter key: `cuDriverGetVersion` names the CUDA API level
//! (`13000`), which stays the same across driver updates of one branch,
//! and a driver update is exactly what may change P2P behaviour.
//!
//! # What a verdict changes
//!
//! Only links and groups under [`PathPolicy::Auto`](crate::copy::PathPolicy::Auto):
//! `P2pOnly` and `StagedOnly` are explicit requests (and the doctor's own
//! checks use them, so that an old cache never decides a new check). A link
//! enables peer access both ways and verifies both ways, and the mesh and
//! one-shot use both directions, so the verdicts of `a -> b` *and*
//! `b -> a` are consulted:
//!
//! - either is `staged` or `none` (P2P unusable): the link stages, without
//!   enabling peer access or running P2P at all;
//! - either carries measured speeds where [`faster_path`] prefers staging
//!   (P2P verified but slower than staging for large messages): it stages;
//! - otherwise a `p2p` verdict skips nothing: P2P is enabled and verified as
//!   usual (the doctor ran on another process's data, so the link still
//!   checks its own);
//! - no entry, or `unknown`: decided as without a doctor.
//!
//! [`LinkStatus::reason`](crate::copy::LinkStatus::reason) then says so:
//! `doctor verdict (cache <path>): <from> -> <to>: <the doctor's summary>`
//! (appended after `; ` to the usual reason when P2P stays).
//!
//! # Opting out
//!
//! [`LinkOptions::use_doctor_verdicts`](crate::copy::LinkOptions::use_doctor_verdicts)
//! `= false` (for groups: `GroupOptions::link`), or the environment variable
//! `CUDA_PEER_NO_DOCTOR_CACHE=1` ([`NO_CACHE_ENV`]; any value but empty or `0`).
//!
//! # Why the library does not measure speeds itself
//!
//! Comparing P2P with staging needs large copies both ways (the doctor
//! times 64 MiB), staging buffers, and a quiet GPU: tens of milliseconds per
//! direction, paid by every [`Link::open`](crate::copy::Link::open) and by
//! every link of every `Group::new`, and noisy when the GPUs are busy with
//! the caller's work. The doctor measures once per boot and driver; the
//! library applies the same rule to its numbers.

use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// Environment variable naming the cache file (overrides the XDG location).
pub const CACHE_ENV: &str = "CUDA_PEER_DOCTOR_CACHE";

/// Environment variable that turns the verdicts off (`1`; any value but
/// empty or `0`).
pub const NO_CACHE_ENV: &str = "CUDA_PEER_NO_DOCTOR_CACHE";

/// The cache format version this module writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// The largest cache file, in bytes, that [`Cache::read`] reads and
/// [`Cache::write`] writes (a cache of 16 GPUs' 240 ordered pairs takes
/// about 100 KiB).
pub const MAX_CACHE_BYTES: u64 = 1 << 20;

/// The smallest copy, in bytes, whose timing [`faster_path`] judges: below
/// it latency, not bandwidth, decides, and the rule is about large messages.
pub const SPEED_RULE_MIN_BYTES: usize = 1 << 20;

/// The words that start the part of a
/// [`LinkStatus::reason`](crate::copy::LinkStatus::reason) taken from a
/// verdict (the whole reason where the verdict staged the link, after `; `
/// where P2P stays).
pub const REASON_PREFIX: &str = "doctor verdict";

/// Why a cache could not be read or written, or no key could be made.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// Reading or writing the file failed.
    #[error("doctor cache {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The path is not a regular file (a directory, FIFO, socket or
    /// device): it was not read, or not replaced.
    #[error("doctor cache {path}: {kind}, not a regular file")]
    NotRegularFile {
        /// The path.
        path: PathBuf,
        /// What it is instead (`"a directory"`, `"a FIFO"`, ...).
        kind: &'static str,
    },
    /// The file, or the text to be written, is larger than
    /// [`MAX_CACHE_BYTES`].
    #[error("doctor cache {path}: larger than {limit} bytes")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// [`MAX_CACHE_BYTES`].
        limit: u64,
    },
    /// The file is not a doctor cache this module can read.
    #[error("doctor cache {path}: {what}")]
    Format {
        /// The file (empty for text not read from a file).
        path: PathBuf,
        /// What is wrong, with the byte offset where there is one.
        what: String,
    },
    /// This machine's key cannot be made (no driver, no boot id).
    #[error("no doctor cache key for this machine: {0}")]
    NoKey(String),
    /// The file belongs to another user (not root), or every user may write
    /// it: whoever could have written it is not trusted to decide this
    /// user's paths.
    #[error("doctor cache {path}: {why}; not read")]
    NotTrusted {
        /// The file.
        path: PathBuf,
        /// Its owner or mode.
        why: String,
    },
}

/// The path the doctor decided for one ordered pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CachedPath {
    /// P2P works (`"p2p"`).
    P2p,
    /// Use the staged path (`"staged"`).
    Staged,
    /// Neither path worked (`"none"`): P2P is unusable.
    Unusable,
    /// Not tested (`"unknown"`).
    Unknown,
}

impl CachedPath {
    /// The word in the file.
    pub fn as_str(self) -> &'static str {
        match self {
            CachedPath::P2p => "p2p",
            CachedPath::Staged => "staged",
            CachedPath::Unusable => "none",
            CachedPath::Unknown => "unknown",
        }
    }

    /// The path for the word in the file.
    pub fn parse(word: &str) -> Option<CachedPath> {
        [CachedPath::P2p, CachedPath::Staged, CachedPath::Unusable, CachedPath::Unknown].into_iter().find(|p| p.as_str() == word)
    }
}

/// Bandwidths the doctor measured for one ordered pair, one way.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpeedSample {
    /// Bytes per timed copy.
    pub bytes: usize,
    /// P2P by copy engine, GB/s.
    pub p2p_gbs: f64,
    /// Staged through pinned host memory, GB/s.
    pub staged_gbs: f64,
}

/// The speed rule, one function for the doctor and the library: where P2P
/// works, which path is faster for large messages.
///
/// `Some(CachedPath::Staged)` when P2P measured slower than staging,
/// `Some(CachedPath::P2p)` when it did not, `None` when the sample says nothing
/// about large messages (copies under [`SPEED_RULE_MIN_BYTES`], or a
/// bandwidth that is not a positive finite number).
pub fn faster_path(s: &SpeedSample) -> Option<CachedPath> {
    let valid = |g: f64| g.is_finite() && g > 0.0;
    if s.bytes < SPEED_RULE_MIN_BYTES || !valid(s.p2p_gbs) || !valid(s.staged_gbs) {
        return None;
    }
    Some(if s.p2p_gbs < s.staged_gbs { CachedPath::Staged } else { CachedPath::P2p })
}

/// What a cache is valid for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheKey {
    /// NVIDIA driver version, e.g. `580.95.05` (see the module docs).
    pub driver_version: String,
    /// `/proc/sys/kernel/random/boot_id`.
    pub boot_id: String,
    /// The GPUs' PCI bus ids (normalised, [`normalize_bus_id`]), by CUDA ordinal.
    pub bus_ids: Vec<String>,
}

static CURRENT_KEY: OnceLock<CacheKey> = OnceLock::new();

impl CacheKey {
    /// This process's key: the driver version, this boot's id and the bus
    /// ids of the devices it sees (computed once per process).
    pub fn current() -> Result<CacheKey, CacheError> {
        if let Some(k) = CURRENT_KEY.get() {
            return Ok(k.clone());
        }
        let no_key = |e: crate::error::Error| CacheError::NoKey(e.to_string());
        let driver_version = match module_version(Path::new("/")) {
            Some(v) => v,
            None => format!("cuda {}", crate::driver::driver_version().map_err(no_key)?),
        };
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_string())
            .map_err(|e| CacheError::NoKey(format!("/proc/sys/kernel/random/boot_id: {e}")))?;
        let n = crate::driver::device_count().map_err(no_key)?;
        let bus_ids = (0..n)
            .map(|i| crate::topology::device_info(i).map(|d| normalize_bus_id(&d.pci_bus_id)))
            .collect::<crate::error::Result<Vec<_>>>()
            .map_err(no_key)?;
        Ok(CURRENT_KEY.get_or_init(|| CacheKey { driver_version, boot_id, bus_ids }).clone())
    }
}

/// The NVIDIA kernel module's version under `root`: `sys/module/nvidia/version`,
/// else the first version-like word of `proc/driver/nvidia/version`.
pub fn module_version(root: &Path) -> Option<String> {
    let read = |p: &str| std::fs::read_to_string(root.join(p)).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty());
    read("sys/module/nvidia/version").or_else(|| {
        let line = read("proc/driver/nvidia/version")?;
        let first = line.lines().next()?;
        first.split_whitespace().find(|w| w.chars().next().is_some_and(|c| c.is_ascii_digit()) && w.contains('.')).map(str::to_string)
    })
}

/// A PCI bus id in one spelling: lower case, a 4-digit domain
/// (`00000000:1B:00.0` and `1b:00.0` are both `0000:1b:00.0`).
pub fn normalize_bus_id(id: &str) -> String {
    let id = id.trim().to_ascii_lowercase();
    let parts: Vec<&str> = id.split(':').collect();
    match parts.as_slice() {
        [dom, bus, devfn] => match u32::from_str_radix(dom, 16) {
            Ok(dom) => format!("{dom:04x}:{bus:0>2}:{devfn}"),
            Err(_) => id,
        },
        [bus, devfn] => format!("0000:{bus:0>2}:{devfn}"),
        _ => id,
    }
}

/// One ordered pair's verdict.
#[derive(Debug, Clone, PartialEq)]
pub struct CachedPair {
    /// Source bus id.
    pub from: String,
    /// Destination bus id.
    pub to: String,
    /// The path to use.
    pub path: CachedPath,
    /// Why, in one sentence.
    pub summary: String,
    /// Measured bandwidths, where the doctor measured both paths.
    pub speed: Option<SpeedSample>,
}

/// The cache file.
#[derive(Debug, Clone, PartialEq)]
pub struct Cache {
    /// Format version ([`FORMAT_VERSION`]).
    pub version: u32,
    /// What it is valid for.
    pub key: CacheKey,
    /// Seconds since the Unix epoch when written.
    pub written_at: u64,
    /// Per ordered pair.
    pub pairs: Vec<CachedPair>,
}

/// `$XDG_CACHE_HOME/cuda-peer/doctor.json`, else `$HOME/.cache/cuda-peer/doctor.json`
/// (the variables passed in; empty counts as unset).
pub fn default_path(xdg_cache_home: Option<&str>, home: Option<&str>) -> Option<PathBuf> {
    let base = match (xdg_cache_home.filter(|s| !s.is_empty()), home.filter(|s| !s.is_empty())) {
        (Some(x), _) => PathBuf::from(x),
        (None, Some(h)) => Path::new(h).join(".cache"),
        (None, None) => return None,
    };
    Some(base.join("cuda-peer").join("doctor.json"))
}

/// The cache file under the environment `env` (a lookup of a variable):
/// [`CACHE_ENV`] where set and not empty, else [`default_path`].
pub fn cache_path_with(env: impl Fn(&str) -> Option<String>) -> Option<PathBuf> {
    if let Some(p) = env(CACHE_ENV).filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    default_path(env("XDG_CACHE_HOME").as_deref(), env("HOME").as_deref())
}

/// The cache file under this process's environment ([`cache_path_with`]).
pub fn cache_path() -> Option<PathBuf> {
    cache_path_with(|k| std::env::var(k).ok())
}

/// Whether verdicts are off: by option (`use_verdicts == false`) or by
/// [`NO_CACHE_ENV`] in the environment `env`.
pub fn opted_out(use_verdicts: bool, env: impl Fn(&str) -> Option<String>) -> bool {
    !use_verdicts || env(NO_CACHE_ENV).is_some_and(|v| !v.is_empty() && v != "0")
}

impl Cache {
    /// A cache of `pairs` under `key`, stamped now.
    pub fn new(key: CacheKey, pairs: Vec<CachedPair>) -> Cache {
        let written_at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        Cache { version: FORMAT_VERSION, key, written_at, pairs }
    }

    /// `Ok` when the cache applies to a process whose key is `here` (see
    /// the module docs), else why not.
    pub fn applies_to(&self, here: &CacheKey) -> Result<(), String> {
        if self.version != FORMAT_VERSION {
            return Err(format!("format version {} (this library reads {FORMAT_VERSION})", self.version));
        }
        if self.key.driver_version != here.driver_version {
            return Err(format!("written under driver {}, this is {}", self.key.driver_version, here.driver_version));
        }
        if self.key.boot_id != here.boot_id {
            return Err("written before the last reboot".into());
        }
        let theirs: Vec<String> = self.key.bus_ids.iter().map(|b| normalize_bus_id(b)).collect();
        if let Some(b) = here.bus_ids.iter().map(|b| normalize_bus_id(b)).find(|b| !theirs.contains(b)) {
            return Err(format!("GPU {b} was not seen by the doctor"));
        }
        Ok(())
    }

    /// The verdict for `from -> to` (bus ids, any spelling), if there is one.
    pub fn pair(&self, from: &str, to: &str) -> Option<&CachedPair> {
        let (from, to) = (normalize_bus_id(from), normalize_bus_id(to));
        self.pairs.iter().find(|p| normalize_bus_id(&p.from) == from && normalize_bus_id(&p.to) == to)
    }

    /// The file's text (see the module docs for its layout).
    pub fn to_json(&self) -> Result<String, CacheError> {
        let mut text = serde_json::to_string_pretty(&FileCache::from(self))
            .map_err(|e| CacheError::Format { path: PathBuf::new(), what: format!("cannot be written as JSON: {e}") })?;
        text.push('\n');
        Ok(text)
    }

    /// Parses the file's text.
    pub fn from_json(text: &str) -> Result<Cache, CacheError> {
        Cache::from_slice(text.as_bytes())
    }

    /// Parses the file's bytes: its format version first, so that a file of
    /// another version says so rather than which field it lacks.
    fn from_slice(bytes: &[u8]) -> Result<Cache, CacheError> {
        fn bad(what: String) -> CacheError {
            CacheError::Format { path: PathBuf::new(), what }
        }
        let FileVersion { version } = serde_json::from_slice(bytes).map_err(|e| bad(format!("not a doctor cache: {e}")))?;
        if version != u64::from(FORMAT_VERSION) {
            return Err(bad(format!("format version {version} (this library reads {FORMAT_VERSION})")));
        }
        let file: FileCache = serde_json::from_slice(bytes).map_err(|e| bad(format!("not a doctor cache: {e}")))?;
        let pairs = file.pairs.into_iter().map(CachedPair::try_from).collect::<Result<Vec<_>, _>>().map_err(bad)?;
        let key = CacheKey { driver_version: file.key.driver_version, boot_id: file.key.boot_id, bus_ids: file.key.bus_ids };
        Ok(Cache { version: file.version, key, written_at: file.written_at, pairs })
    }

    /// Reads and parses the file at `path`: a regular file of at most
    /// [`MAX_CACHE_BYTES`], opened without blocking (see the module docs).
    pub fn read(path: &Path) -> Result<Cache, CacheError> {
        let bytes = read_regular(path, MAX_CACHE_BYTES)?;
        Cache::from_slice(&bytes).map_err(|e| match e {
            CacheError::Format { what, .. } => CacheError::Format { path: path.to_path_buf(), what },
            other => other,
        })
    }

    /// Writes the file at `path` (creating its directory), atomically: into
    /// a new file created exclusively under a random name in the same
    /// directory, then renamed over `path`. A symlink at `path` is replaced,
    /// not followed; a directory there is [`CacheError::NotRegularFile`].
    pub fn write(&self, path: &Path) -> Result<(), CacheError> {
        let text = self.to_json().map_err(|e| match e {
            CacheError::Format { what, .. } => CacheError::Format { path: path.to_path_buf(), what },
            other => other,
        })?;
        if text.len() as u64 > MAX_CACHE_BYTES {
            return Err(CacheError::TooLarge { path: path.to_path_buf(), limit: MAX_CACHE_BYTES });
        }
        replace_file(path, text.as_bytes(), TEMP_RANDOM_CHARS)
    }
}

/// Random characters in the name of the file [`Cache::write`] renames
/// over the cache.
const TEMP_RANDOM_CHARS: usize = 10;

/// The format version alone, read before the rest of the file.
#[derive(Deserialize)]
struct FileVersion {
    version: u64,
}

/// The file's layout (the module docs show it).
#[derive(Serialize, Deserialize)]
struct FileCache {
    version: u32,
    key: FileKey,
    written_at: u64,
    pairs: Vec<FilePair>,
}

/// The key's layout.
#[derive(Serialize, Deserialize)]
struct FileKey {
    driver_version: String,
    boot_id: String,
    bus_ids: Vec<String>,
}

/// One pair's layout: the speed's fields inline, each optional.
#[derive(Serialize, Deserialize)]
struct FilePair {
    from: String,
    to: String,
    path: String,
    summary: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    p2p_gbs: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    staged_gbs: Option<f64>,
}

impl From<&Cache> for FileCache {
    fn from(c: &Cache) -> FileCache {
        let key = FileKey { driver_version: c.key.driver_version.clone(), boot_id: c.key.boot_id.clone(), bus_ids: c.key.bus_ids.clone() };
        let pairs = c
            .pairs
            .iter()
            .map(|p| FilePair {
                from: p.from.clone(),
                to: p.to.clone(),
                path: p.path.as_str().to_string(),
                summary: p.summary.clone(),
                bytes: p.speed.map(|s| s.bytes as u64),
                // serde_json writes a number that is not finite as `null`.
                p2p_gbs: p.speed.map(|s| s.p2p_gbs),
                staged_gbs: p.speed.map(|s| s.staged_gbs),
            })
            .collect();
        FileCache { version: c.version, key, written_at: c.written_at, pairs }
    }
}

impl TryFrom<FilePair> for CachedPair {
    type Error = String;
    fn try_from(p: FilePair) -> Result<CachedPair, String> {
        let path = CachedPath::parse(&p.path).ok_or_else(|| format!("unknown path {:?}", p.path))?;
        let bytes = p.bytes.and_then(|b| usize::try_from(b).ok());
        let speed = match (bytes, p.p2p_gbs, p.staged_gbs) {
            (Some(bytes), Some(p2p_gbs), Some(staged_gbs)) => Some(SpeedSample { bytes, p2p_gbs, staged_gbs }),
            _ => None,
        };
        Ok(CachedPair { from: p.from, to: p.to, path, summary: p.summary, speed })
    }
}

/// What a file type is, in words, where it is not a regular file.
fn kind_of(t: std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_socket() {
            return "a socket";
        }
        if t.is_block_device() || t.is_char_device() {
            return "a device";
        }
    }
    if t.is_dir() {
        "a directory"
    } else if t.is_symlink() {
        "a symlink"
    } else {
        "not a file"
    }
}

/// The bytes of the regular file at `path`, at most `limit` of them.
///
/// The path is checked before it is opened (a device is never opened), the
/// open does not block (Linux: `O_NONBLOCK`, so a FIFO put there after the
/// check opens at once; `O_NOCTTY`), the opened file is checked again, and at
/// most `limit + 1` bytes are read.
fn read_regular(path: &Path, limit: u64) -> Result<Vec<u8>, CacheError> {
    let io = |source| CacheError::Io { path: path.to_path_buf(), source };
    let refuse = |t: std::fs::FileType| CacheError::NotRegularFile { path: path.to_path_buf(), kind: kind_of(t) };
    let too_large = || CacheError::TooLarge { path: path.to_path_buf(), limit };
    let before = std::fs::metadata(path).map_err(io)?;
    if !before.file_type().is_file() {
        return Err(refuse(before.file_type()));
    }
    let file = open_without_blocking(path).map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if !meta.file_type().is_file() {
        return Err(refuse(meta.file_type()));
    }
    trusted(&meta).map_err(|why| CacheError::NotTrusted { path: path.to_path_buf(), why })?;
    if meta.len() > limit {
        return Err(too_large());
    }
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > limit {
        return Err(too_large());
    }
    Ok(bytes)
}

/// Whether a cache file (`meta`, of the opened file) is this user's or
/// root's: owned by one of them, and not writable by every user (Linux;
/// elsewhere every file is).
fn trusted(meta: &std::fs::Metadata) -> Result<(), String> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::MetadataExt;
        let me = rustix::process::geteuid().as_raw();
        if meta.uid() != me && meta.uid() != 0 {
            return Err(format!("owned by uid {}, not by this user (uid {me}) or root", meta.uid()));
        }
        if meta.mode() & 0o002 != 0 {
            return Err(format!("mode {:o}: writable by every user", meta.mode() & 0o7777));
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = meta;
    Ok(())
}

/// Opens `path` for reading without waiting: on Linux with `O_NONBLOCK`
/// (a FIFO without a writer opens at once; reads of a regular file ignore
/// the flag) and `O_NOCTTY`; elsewhere plainly.
fn open_without_blocking(path: &Path) -> std::io::Result<std::fs::File> {
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.custom_flags((rustix::fs::OFlags::NONBLOCK | rustix::fs::OFlags::NOCTTY).bits() as i32);
    }
    opts.open(path)
}

/// Replaces the file at `path` with `bytes` (creating its directory): writes
/// a new file created exclusively (`O_CREAT | O_EXCL`, so never through a
/// symlink) under a name of `.<file name>.` and `random_chars` random
/// characters, `.tmp`, in `path`'s directory, syncs it and renames it over
/// `path`. The new file is removed where any step fails.
fn replace_file(path: &Path, bytes: &[u8], random_chars: usize) -> Result<(), CacheError> {
    let io = |source| CacheError::Io { path: path.to_path_buf(), source };
    let Some(name) = path.file_name() else {
        return Err(io(std::io::Error::new(std::io::ErrorKind::InvalidInput, "the path names no file")));
    };
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io)?;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_dir() => return Err(CacheError::NotRegularFile { path: path.to_path_buf(), kind: kind_of(m.file_type()) }),
        _ => {}
    }
    let prefix = format!(".{}.", name.to_string_lossy());
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix).suffix(".tmp").rand_bytes(random_chars);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        // Readable by the other users a shared cache path serves, as a file
        // made by `std::fs::write` is (the umask still applies).
        builder.permissions(std::fs::Permissions::from_mode(0o644));
    }
    let mut tmp = builder.tempfile_in(dir).map_err(io)?;
    tmp.write_all(bytes).map_err(io)?;
    tmp.as_file().sync_all().map_err(io)?;
    // On failure the PersistError owns the temporary file and removes it when dropped.
    tmp.persist(path).map_err(|e| io(e.error))?;
    Ok(())
}

/// What a cache says about one link (`crate::copy::decide`'s hook).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Advice {
    /// Stage without trying P2P.
    pub(crate) stage: bool,
    /// `doctor verdict (cache <path>): ...`, for `LinkStatus::reason`.
    pub(crate) reason: String,
}

/// What `cache` (read from `origin`) says about the pair of bus ids
/// `a`, `b` for a process whose key is `here`; `Err(why)` where it says
/// nothing (does not apply, no entry, `unknown`).
pub(crate) fn advise(cache: &Cache, origin: &Path, here: &CacheKey, a: &str, b: &str) -> Result<Advice, String> {
    cache.applies_to(here)?;
    let head = format!("{REASON_PREFIX} (cache {})", origin.display());
    let entries: Vec<&CachedPair> = [cache.pair(a, b), cache.pair(b, a)].into_iter().flatten().filter(|p| p.path != CachedPath::Unknown).collect();
    if entries.is_empty() {
        return Err(format!("no verdict for {a} <-> {b}"));
    }
    for p in &entries {
        if matches!(p.path, CachedPath::Staged | CachedPath::Unusable) {
            return Ok(Advice { stage: true, reason: format!("{head}: {} -> {}: {}: {}", p.from, p.to, p.path.as_str(), p.summary) });
        }
    }
    for p in &entries {
        if let Some(s) = p.speed.filter(|s| faster_path(s) == Some(CachedPath::Staged)) {
            let reason = format!(
                "{head}: {} -> {}: P2P measured slower than staging ({:.1} against {:.1} GB/s at {} bytes)",
                p.from, p.to, s.p2p_gbs, s.staged_gbs, s.bytes
            );
            return Ok(Advice { stage: true, reason });
        }
    }
    let p = entries[0];
    Ok(Advice { stage: false, reason: format!("{head}: {} -> {}: p2p: {}", p.from, p.to, p.summary) })
}

/// Whether a cache that could not be read has been warned about in this process.
static WARNED_UNREADABLE: AtomicBool = AtomicBool::new(false);

/// Whether `e` is worth a warning: anything but a missing file.
fn worth_a_warning(e: &CacheError) -> bool {
    !matches!(e, CacheError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
}

/// The hook of `crate::copy::decide`: what the doctor's cache says about
/// devices `a` and `b` under `use_verdicts` and this process's environment.
/// `None` wherever it says nothing: logged at debug level, or at warn level
/// (once per process) where the file is there but was refused or could not
/// be read or parsed.
pub(crate) fn consult(a: usize, b: usize, use_verdicts: bool) -> Option<Advice> {
    let env = |k: &str| std::env::var(k).ok();
    if opted_out(use_verdicts, env) {
        return None;
    }
    let path = cache_path_with(env)?;
    let cache = match Cache::read(&path) {
        Ok(c) => c,
        Err(e) if worth_a_warning(&e) && !WARNED_UNREADABLE.swap(true, Ordering::Relaxed) => {
            log::warn!("cuda-peer: doctor verdicts ignored: {e}");
            return None;
        }
        Err(e) => {
            log::debug!("cuda-peer: no doctor verdicts: {e}");
            return None;
        }
    };
    let here = match CacheKey::current() {
        Ok(k) => k,
        Err(e) => {
            log::debug!("cuda-peer: doctor cache {} not used: {e}", path.display());
            return None;
        }
    };
    let (Some(ba), Some(bb)) = (here.bus_ids.get(a), here.bus_ids.get(b)) else {
        log::debug!("cuda-peer: doctor cache {} not used: device {a} or {b} out of range", path.display());
        return None;
    };
    match advise(&cache, &path, &here, ba, bb) {
        Ok(advice) => {
            log::info!("cuda-peer: link {a} <-> {b}: {}", advice.reason);
            Some(advice)
        }
        Err(why) => {
            log::debug!("cuda-peer: doctor cache {} not used for {a} <-> {b}: {why}", path.display());
            None
        }
    }
}

/// `reason`, with the doctor's `p2p` verdict after it where one applied.
pub(crate) fn annotate(reason: &str, advice: Option<&Advice>) -> String {
    match advice {
        Some(a) => format!("{reason}; {}", a.reason),
        None => reason.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn key() -> CacheKey {
        CacheKey { driver_version: "580.95.05".into(), boot_id: "b0".into(), bus_ids: vec!["0000:19:00.0".into(), "0000:3b:00.0".into()] }
    }

    fn pair(from: &str, to: &str, path: CachedPath, speed: Option<SpeedSample>) -> CachedPair {
        CachedPair { from: from.into(), to: to.into(), path, summary: format!("summary of {from} -> {to}, \"quoted\"\n"), speed }
    }

    fn sample(p2p: f64, staged: f64) -> SpeedSample {
        SpeedSample { bytes: 64 << 20, p2p_gbs: p2p, staged_gbs: staged }
    }

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn the_speed_rule_on_fixture_numbers() {
        assert_eq!(faster_path(&sample(6.0, 12.0)), Some(CachedPath::Staged), "P2P slower than staging");
        assert_eq!(faster_path(&sample(368.2, 25.1)), Some(CachedPath::P2p));
        assert_eq!(faster_path(&sample(12.0, 12.0)), Some(CachedPath::P2p), "a tie keeps P2P");
        assert_eq!(faster_path(&SpeedSample { bytes: 4096, ..sample(1.0, 2.0) }), None, "small copies say nothing");
        assert_eq!(faster_path(&SpeedSample { bytes: SPEED_RULE_MIN_BYTES, ..sample(1.0, 2.0) }), Some(CachedPath::Staged));
        assert_eq!(faster_path(&sample(f64::NAN, 2.0)), None);
        assert_eq!(faster_path(&sample(0.0, 2.0)), None);
        assert_eq!(faster_path(&sample(3.0, f64::INFINITY)), None);
    }

    #[test]
    fn bus_ids_normalise() {
        assert_eq!(normalize_bus_id("00000000:1B:00.0"), "0000:1b:00.0");
        assert_eq!(normalize_bus_id("1b:00.0"), "0000:1b:00.0");
        assert_eq!(normalize_bus_id(" 0000:1b:00.0\n"), "0000:1b:00.0");
        assert_eq!(normalize_bus_id("garbage"), "garbage");
    }

    #[test]
    fn paths_and_opt_outs_from_the_environment() {
        assert_eq!(cache_path_with(env(&[("HOME", "/home/u")])), Some(PathBuf::from("/home/u/.cache/cuda-peer/doctor.json")));
        assert_eq!(cache_path_with(env(&[("HOME", "/home/u"), ("XDG_CACHE_HOME", "/x")])), Some(PathBuf::from("/x/cuda-peer/doctor.json")));
        assert_eq!(cache_path_with(env(&[("HOME", "/home/u"), (CACHE_ENV, "/t/d.json")])), Some(PathBuf::from("/t/d.json")));
        assert_eq!(cache_path_with(env(&[("XDG_CACHE_HOME", ""), ("HOME", "")])), None);
        assert!(!opted_out(true, env(&[])));
        assert!(opted_out(false, env(&[])), "opt-out by option");
        assert!(opted_out(true, env(&[(NO_CACHE_ENV, "1")])), "opt-out by environment");
        assert!(!opted_out(true, env(&[(NO_CACHE_ENV, "0")])));
        assert!(!opted_out(true, env(&[(NO_CACHE_ENV, "")])));
    }

    #[test]
    fn json_round_trip_and_malformed_files() {
        let c = Cache::new(
            key(),
            vec![
                pair("0000:19:00.0", "0000:3b:00.0", CachedPath::Staged, Some(sample(6.5, 12.25))),
                pair("0000:3b:00.0", "0000:19:00.0", CachedPath::Unusable, None),
            ],
        );
        let back = Cache::from_json(&c.to_json().unwrap()).unwrap();
        assert_eq!(back, c);
        let empty = Cache::new(key(), Vec::new());
        assert_eq!(Cache::from_json(&empty.to_json().unwrap()).unwrap(), empty);
        // What the doctor wrote before speeds were cached still reads.
        let old = r#"{"version": 1, "key": {"driver_version": "550.54.15", "boot_id": "b", "bus_ids": ["0000:03:00.0"]}, "written_at": 5,
            "pairs": [{"from": "0000:03:00.0", "to": "0000:04:00.0", "path": "unknown", "summary": "\u00e9\ud83d\ude00\/"}]}"#;
        let o = Cache::from_json(old).unwrap();
        assert_eq!(o.pairs[0].path, CachedPath::Unknown);
        assert_eq!(o.pairs[0].summary, "é😀/");
        assert!(o.pairs[0].speed.is_none());
        for bad in ["", "{", "[1,]", "{\"version\": 2}", "{\"version\": 1}", "nul", "\"\\ud800\"", "[".repeat(100).as_str(), "{} x", "-"] {
            assert!(matches!(Cache::from_json(bad), Err(CacheError::Format { .. })), "{bad:?} parsed");
        }
        let wrong_path = c.to_json().unwrap().replace("\"staged\"", "\"nvlink\"");
        assert!(matches!(Cache::from_json(&wrong_path), Err(CacheError::Format { what, .. }) if what.contains("nvlink")));
        let v2 = c.to_json().unwrap().replace("\"version\": 1", "\"version\": 2");
        assert!(matches!(Cache::from_json(&v2), Err(CacheError::Format { what, .. }) if what.contains("format version 2")));
    }

    /// Every prefix of a real file, and the file with each byte replaced
    /// by each of a few troublesome ones, parses or is an error: never a
    /// panic.
    #[test]
    fn truncated_and_corrupted_files_never_panic() {
        let text = Cache::new(key(), vec![pair("0000:19:00.0", "0000:3b:00.0", CachedPath::Staged, Some(sample(6.5, 12.25)))]).to_json().unwrap();
        let text = text.replace("summary of", "s\\u00e9mmary \\ud83d\\ude00 of");
        let bytes = text.as_bytes();
        for end in 0..bytes.len() {
            if let Ok(t) = std::str::from_utf8(&bytes[..end]) {
                let _ = Cache::from_json(t);
            }
        }
        for i in 0..bytes.len() {
            for b in [b'"', b'\\', b'{', b']', b'-', b'e', b'u', b'0', b' '] {
                let mut v = bytes.to_vec();
                v[i] = b;
                if let Ok(t) = String::from_utf8(v) {
                    let _ = Cache::from_json(&t);
                }
            }
        }
    }

    #[test]
    fn a_cache_applies_only_to_its_key() {
        let c = Cache::new(key(), Vec::new());
        assert_eq!(c.applies_to(&key()), Ok(()));
        let reordered = CacheKey { bus_ids: vec!["00000000:3B:00.0".into(), "0000:19:00.0".into()], ..key() };
        assert_eq!(c.applies_to(&reordered), Ok(()), "CUDA_VISIBLE_DEVICES reordering");
        let subset = CacheKey { bus_ids: vec!["0000:3b:00.0".into()], ..key() };
        assert_eq!(c.applies_to(&subset), Ok(()), "a subset of the GPUs");
        let other_gpu = CacheKey { bus_ids: vec!["0000:19:00.0".into(), "0000:5d:00.0".into()], ..key() };
        assert!(c.applies_to(&other_gpu).is_err());
        assert!(c.applies_to(&CacheKey { boot_id: "b1".into(), ..key() }).is_err(), "rebooted");
        assert!(c.applies_to(&CacheKey { driver_version: "580.82.07".into(), ..key() }).is_err(), "new driver");
        assert!(Cache { version: 2, ..c }.applies_to(&key()).is_err());
    }

    #[test]
    fn advice_follows_verdicts_both_ways() {
        let (a, b) = ("0000:19:00.0", "0000:3b:00.0");
        let at = Path::new("/t/doctor.json");
        let with = |pairs| Cache::new(key(), pairs);
        let staged = with(vec![pair(a, b, CachedPath::Staged, None)]);
        let adv = advise(&staged, at, &key(), a, b).unwrap();
        assert!(adv.stage);
        assert!(adv.reason.starts_with("doctor verdict (cache /t/doctor.json): 0000:19:00.0 -> 0000:3b:00.0: staged: summary"), "{}", adv.reason);
        assert!(advise(&staged, at, &key(), b, a).unwrap().stage, "the reverse link of a staged pair stages too");
        assert!(advise(&with(vec![pair(b, a, CachedPath::Unusable, None)]), at, &key(), a, b).unwrap().stage);
        let p2p = advise(&with(vec![pair(a, b, CachedPath::P2p, Some(sample(300.0, 20.0)))]), at, &key(), a, b).unwrap();
        assert!(!p2p.stage);
        assert_eq!(annotate("P2P, verified", Some(&p2p)), format!("P2P, verified; {}", p2p.reason));
        assert_eq!(annotate("P2P, verified", None), "P2P, verified");
        let slow = advise(&with(vec![pair(a, b, CachedPath::P2p, Some(sample(6.0, 12.0)))]), at, &key(), a, b).unwrap();
        assert!(slow.stage && slow.reason.contains("P2P measured slower than staging (6.0 against 12.0 GB/s"), "{}", slow.reason);
        assert!(advise(&with(vec![pair(a, b, CachedPath::Unknown, None)]), at, &key(), a, b).is_err());
        assert!(advise(&with(vec![pair(a, "0000:5d:00.0", CachedPath::Staged, None)]), at, &key(), a, b).is_err(), "another pair");
        let rebooted = CacheKey { boot_id: "b1".into(), ..key() };
        assert!(advise(&staged, at, &rebooted, a, b).is_err(), "a mismatching key is ignored");
    }

    #[test]
    fn files_round_trip_and_unreadable_ones_are_errors_not_panics() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/doctor.json");
        let c = Cache::new(key(), vec![pair("0000:19:00.0", "0000:3b:00.0", CachedPath::P2p, Some(sample(368.2, 25.1)))]);
        c.write(&path).unwrap();
        assert_eq!(Cache::read(&path).unwrap(), c);
        std::fs::write(&path, "{\"version\": 1").unwrap();
        assert!(matches!(Cache::read(&path), Err(CacheError::Format { .. })));
        std::fs::write(&path, [0xff, 0xfe, b'{']).unwrap();
        assert!(matches!(Cache::read(&path), Err(CacheError::Format { .. })), "not UTF-8");
        let missing = Cache::read(&dir.path().join("missing.json"));
        assert!(matches!(&missing, Err(e @ CacheError::Io { .. }) if !worth_a_warning(e)), "a missing cache is not worth a warning");
        assert!(worth_a_warning(&Cache::read(dir.path()).unwrap_err()), "a directory is");
        // Nothing but the cache is left in its directory.
        let names: Vec<_> = std::fs::read_dir(dir.path().join("sub")).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("doctor.json")]);
    }

    /// The writer's new file is created exclusively: where its name is
    /// taken (here a symlink, planted at the one name a writer without
    /// random characters can use), the write fails and the symlink's target
    /// is untouched, rather than written through.
    #[cfg(unix)]
    #[test]
    fn the_new_file_is_created_exclusively() {
        let dir = tempfile::tempdir().unwrap();
        let (path, victim) = (dir.path().join("doctor.json"), dir.path().join("victim"));
        std::fs::write(&victim, "victim").unwrap();
        std::os::unix::fs::symlink(&victim, dir.path().join(".doctor.json..tmp")).unwrap();
        let e = replace_file(&path, b"new", 0).unwrap_err();
        assert!(matches!(&e, CacheError::Io { source, .. } if source.kind() == std::io::ErrorKind::AlreadyExists), "{e}");
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "victim");
        assert!(std::fs::symlink_metadata(&path).is_err(), "nothing was renamed into place");
        replace_file(&path, b"new", TEMP_RANDOM_CHARS).unwrap();
        assert_eq!((std::fs::read_to_string(&path).unwrap().as_str(), std::fs::read_to_string(&victim).unwrap().as_str()), ("new", "victim"));
    }

    #[test]
    fn reads_stop_at_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, [b'x'; 10]).unwrap();
        assert_eq!(read_regular(&path, 10).unwrap().len(), 10);
        assert!(matches!(read_regular(&path, 9), Err(CacheError::TooLarge { limit: 9, .. })));
        assert!(matches!(read_regular(dir.path(), 10), Err(CacheError::NotRegularFile { kind: "a directory", .. })));
    }

    /// A cache every user may write is refused (another user could have
    /// planted it), and read once it is not; a file of another user is
    /// refused too, which needs a second user to test (root's is allowed).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_cache_every_user_may_write_is_not_read() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"{}").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(matches!(read_regular(&path, 10), Err(CacheError::NotTrusted { .. })));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(read_regular(&path, 10).unwrap(), b"{}");
    }

    /// The second line of defence, for a FIFO put at the path between the
    /// check and the open: the open returns at once, and the opened file is
    /// refused.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_fifo_opens_without_waiting_for_a_writer() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        rustix::fs::mkfifoat(rustix::fs::CWD, &fifo, rustix::fs::Mode::RUSR | rustix::fs::Mode::WUSR).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let at = fifo.clone();
        std::thread::spawn(move || {
            let _ = tx.send(open_without_blocking(&at).and_then(|f| f.metadata()).map(|m| kind_of(m.file_type())));
        });
        match rx.recv_timeout(std::time::Duration::from_secs(5)) {
            Ok(kind) => assert_eq!(kind.unwrap(), "a FIFO"),
            Err(_) => {
                // Let a blocked open finish before failing (never blocks itself).
                use std::os::unix::fs::OpenOptionsExt;
                let _ = std::fs::OpenOptions::new().write(true).custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32).open(&fifo);
                panic!("opening a FIFO blocked for 5 s");
            }
        }
    }

    #[test]
    fn module_versions_from_sysfs_or_procfs() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path();
        assert_eq!(module_version(dir), None);
        std::fs::create_dir_all(dir.join("proc/driver/nvidia")).unwrap();
        std::fs::write(
            dir.join("proc/driver/nvidia/version"),
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build\nGCC version: 13\n",
        )
        .unwrap();
        assert_eq!(module_version(dir).as_deref(), Some("580.95.05"));
        std::fs::create_dir_all(dir.join("sys/module/nvidia")).unwrap();
        std::fs::write(dir.join("sys/module/nvidia/version"), "580.95.06\n").unwrap();
        assert_eq!(module_version(dir).as_deref(), Some("580.95.06"));
    }
}
