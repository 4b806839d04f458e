//! The job's secret: what every bootstrap connection proves it knows
//! ([`super::bootstrap`]), so that only the job's own ranks join it.
//!
//! Where it comes from, in order (what [`super::Bootstrap::connect`] does):
//! 1. given by the program ([`super::Bootstrap::with_secret`]);
//! 2. `CUDA_PEER_JOB_SECRET` ([`SECRET_ENV`]): at least 16 bytes of text
//!    (`cuda-peer-run` sets 64 random hex digits in its children);
//! 3. `CUDA_PEER_JOB_SECRET_FILE` ([`SECRET_FILE_ENV`]): a regular file of at
//!    most 4 KiB, owned by this user and readable by no one else (mode
//!    `0600` or stricter); its text, trimmed, is the secret;
//! 4. a job on one host (`LOCAL_WORLD_SIZE` = `WORLD_SIZE`): a per-user file
//!    that rank 0 writes for its port in a directory only this user can
//!    open ([`local_secret_dir`]), which the other ranks read; rank 0
//!    removes it once every rank has joined;
//! 5. otherwise (ranks on several hosts and no secret) the rendezvous is
//!    refused, unless [`super::Bootstrap::insecure`] (or
//!    `CUDA_PEER_INSECURE_BOOTSTRAP=1`, [`INSECURE_ENV`]) says that anyone
//!    who reaches the port may join.

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// The environment variable that carries the job's secret.
pub const SECRET_ENV: &str = "CUDA_PEER_JOB_SECRET";
/// The environment variable that names a file holding the job's secret.
pub const SECRET_FILE_ENV: &str = "CUDA_PEER_JOB_SECRET_FILE";
/// The environment variable that, set to `1`, lets a job spanning hosts
/// meet without a secret (anyone who reaches `MASTER_PORT` may join).
pub const INSECURE_ENV: &str = "CUDA_PEER_INSECURE_BOOTSTRAP";

/// The fewest bytes a secret may have.
pub const MIN_SECRET_BYTES: usize = 16;
/// The most bytes a secret (or its file) may have.
const MAX_SECRET_BYTES: usize = 4096;

/// A job's shared secret: text, used as the key of HMAC-SHA-256. Its
/// `Debug` shows no part of it.
#[derive(Clone, PartialEq, Eq)]
pub struct JobSecret(String);

impl std::fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JobSecret({} bytes)", self.0.len())
    }
}

impl JobSecret {
    /// A new random secret: 32 bytes from the kernel's CSPRNG, as 64
    /// lowercase hex digits.
    pub fn generate() -> Result<JobSecret> {
        Ok(Self::from_key(&random_bytes::<32>()?))
    }

    /// The secret of 32 key bytes: their 64 hex digits.
    pub(crate) fn from_key(key: &[u8; 32]) -> JobSecret {
        JobSecret(hex(key))
    }

    /// A secret from its text: [`MIN_SECRET_BYTES`] to 4,096 bytes of it.
    pub fn new(text: &str) -> Result<JobSecret> {
        if text.len() < MIN_SECRET_BYTES || text.len() > MAX_SECRET_BYTES {
            return Err(Error::InvalidArgument(format!("a job secret of {} bytes (from {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES})", text.len())));
        }
        Ok(JobSecret(text.to_string()))
    }

    /// The secret's text, for another rank's environment ([`SECRET_ENV`]).
    pub fn expose(&self) -> &str {
        &self.0
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }

    /// The secret the environment gives (`CUDA_PEER_JOB_SECRET`, then
    /// `CUDA_PEER_JOB_SECRET_FILE`), or `None` when neither is set.
    pub fn from_env() -> Result<Option<JobSecret>> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// As [`Self::from_env`], with the variables looked up by `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<JobSecret>> {
        if let Some(s) = get(SECRET_ENV).filter(|s| !s.is_empty()) {
            let s = s.trim();
            return JobSecret::new(s)
                .map(Some)
                .map_err(|_| Error::Env { var: SECRET_ENV, problem: format!("{} bytes; at least {MIN_SECRET_BYTES} are needed", s.len()) });
        }
        if let Some(p) = get(SECRET_FILE_ENV).filter(|s| !s.is_empty()) {
            return read_private_file(Path::new(&p)).map(Some).map_err(|e| Error::Env { var: SECRET_FILE_ENV, problem: e.to_string() });
        }
        Ok(None)
    }
}

/// Whether `CUDA_PEER_INSECURE_BOOTSTRAP=1` is set.
pub fn insecure_from_env() -> bool {
    std::env::var(INSECURE_ENV).is_ok_and(|v| v.trim() == "1")
}

/// `N` bytes from the kernel's CSPRNG.
pub(crate) fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut out = [0u8; N];
    let mut filled = 0;
    while filled < N {
        match rustix::rand::getrandom(&mut out[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(Error::Bootstrap { op: "getrandom", reason: e.to_string() }),
        }
    }
    Ok(out)
}

/// Lowercase hex of `b`.
pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl Fn(std::io::Error) -> Error + 'a {
    move |e| Error::Bootstrap { op, reason: format!("{}: {e}", path.display()) }
}

/// Whether `meta` is owned by this user and has no group or other
/// permission bits.
fn private(meta: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    meta.uid() == rustix::process::geteuid().as_raw() && meta.mode() & 0o077 == 0
}

/// A secret read from a file that only this user can read: a regular file
/// (not a symlink, FIFO or device), owned by this user, mode `0600` or
/// stricter, at most 4 KiB; its text, trimmed.
pub(crate) fn read_private_file(path: &Path) -> Result<JobSecret> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let bad = |why: String| Error::Bootstrap { op: "job secret file", reason: format!("{}: {why}", path.display()) };
    let file = std::fs::OpenOptions::new()
        .read(true)
        // Not through a symlink; a FIFO does not block the open.
        .custom_flags((rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::NONBLOCK).bits() as i32)
        .open(path)
        .map_err(io("job secret file", path))?;
    let meta = file.metadata().map_err(io("job secret file", path))?;
    if !meta.is_file() {
        return Err(bad("not a regular file".into()));
    }
    if !private(&meta) {
        return Err(bad("must be owned by this user and readable by no one else (chmod 600)".into()));
    }
    let mut text = Vec::new();
    file.take(MAX_SECRET_BYTES as u64 + 1).read_to_end(&mut text).map_err(io("job secret file", path))?;
    if text.len() > MAX_SECRET_BYTES {
        return Err(bad(format!("longer than {MAX_SECRET_BYTES} bytes")));
    }
    let text = String::from_utf8(text).map_err(|_| bad("not UTF-8 text".into()))?;
    JobSecret::new(text.trim()).map_err(|e| bad(e.to_string()))
}

/// The directory of this user's one-host secrets: `$XDG_RUNTIME_DIR/cuda-peer`
/// when that is a directory of this user's, else `<temp dir>/cuda-peer-<uid>`;
/// created with mode `0700` and refused unless it is a real directory
/// (not a symlink) owned by this user with no group or other permissions.
pub fn local_secret_dir() -> Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let uid = rustix::process::geteuid().as_raw();
    let runtime =
        std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from).filter(|d| std::fs::symlink_metadata(d).is_ok_and(|m| m.is_dir() && private(&m)));
    let dir = match runtime {
        Some(d) => d.join("cuda-peer"),
        None => std::env::temp_dir().join(format!("cuda-peer-{uid}")),
    };
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io("job secret directory", &dir)(e)),
    }
    let meta = std::fs::symlink_metadata(&dir).map_err(io("job secret directory", &dir))?;
    if !meta.is_dir() || !private(&meta) {
        return Err(Error::Bootstrap {
            op: "job secret directory",
            reason: format!("{} is not a directory of this user's with mode 0700 (someone else made it?)", dir.display()),
        });
    }
    Ok(dir)
}

/// The one-host secret file of the rendezvous on `port`.
pub(crate) fn local_secret_path(port: u16) -> Result<PathBuf> {
    Ok(local_secret_dir()?.join(format!("rendezvous-{port}.secret")))
}

/// Rank 0's side of a one-host job without a given secret: a new secret,
/// written to [`local_secret_path`] (through an exclusively created
/// temporary file, renamed into place).
pub(crate) fn publish_local_secret(port: u16) -> Result<(JobSecret, PathBuf)> {
    use std::io::Write;
    let path = local_secret_path(port)?;
    let dir = path.parent().ok_or_else(|| Error::Internal("a secret path without a directory".into()))?;
    let secret = JobSecret::generate()?;
    // tempfile creates the file with mode 0600, exclusively, at a random name.
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(io("job secret file", dir))?;
    tmp.write_all(secret.bytes()).map_err(io("job secret file", dir))?;
    tmp.persist(&path).map_err(|e| io("job secret file", &path)(e.error))?;
    Ok((secret, path))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn secrets_come_from_the_variable_then_the_file() {
        let none = JobSecret::from_vars(|_| None).unwrap();
        assert_eq!(none, None);
        let s = JobSecret::from_vars(|k| (k == SECRET_ENV).then(|| " 0123456789abcdef0123 ".into())).unwrap().unwrap();
        assert_eq!(s.bytes(), b"0123456789abcdef0123");
        let short = JobSecret::from_vars(|k| (k == SECRET_ENV).then(|| "short".into()));
        assert!(matches!(short, Err(Error::Env { var: SECRET_ENV, .. })), "{short:?}");

        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("secret");
        std::fs::write(&p, "a file secret of enough bytes\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let path = p.to_string_lossy().to_string();
        let s = JobSecret::from_vars(|k| (k == SECRET_FILE_ENV).then(|| path.clone())).unwrap().unwrap();
        assert_eq!(s.bytes(), b"a file secret of enough bytes");
        // Readable by the group: refused.
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o640)).unwrap();
        let r = JobSecret::from_vars(|k| (k == SECRET_FILE_ENV).then(|| path.clone()));
        assert!(matches!(&r, Err(Error::Env { var: SECRET_FILE_ENV, problem }) if problem.contains("chmod 600")), "{r:?}");
    }

    #[test]
    fn a_secret_file_must_be_a_private_regular_file() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real");
        std::fs::write(&real, "0123456789abcdef0123").unwrap();
        std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(read_private_file(&real).is_ok());
        // A symlink to it is not followed.
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert!(read_private_file(&link).is_err());
        // A FIFO is refused at once instead of blocking.
        let fifo = dir.path().join("fifo");
        rustix::fs::mkfifoat(rustix::fs::CWD, &fifo, rustix::fs::Mode::from_raw_mode(0o600)).unwrap();
        let start = std::time::Instant::now();
        assert!(read_private_file(&fifo).is_err());
        assert!(start.elapsed() < std::time::Duration::from_secs(2));
        // Too long, too short.
        std::fs::write(&real, vec![b'x'; 5000]).unwrap();
        assert!(read_private_file(&real).is_err());
        std::fs::write(&real, "short").unwrap();
        assert!(read_private_file(&real).is_err());
    }

    #[test]
    fn a_published_local_secret_is_private_and_reads_back() {
        let port = 1 + (std::process::id() % 60000) as u16;
        let (secret, path) = publish_local_secret(port).unwrap();
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert!(meta.is_file() && private(&meta), "{:o}", meta.permissions().mode());
        let read = read_private_file(&path).unwrap();
        assert_eq!(read, secret);
        // A second job on the port replaces it.
        let (again, _) = publish_local_secret(port).unwrap();
        assert_ne!(again, secret);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn generated_secrets_differ_and_debug_hides_them() {
        let (a, b) = (JobSecret::generate().unwrap(), JobSecret::generate().unwrap());
        assert_ne!(a, b);
        assert_eq!(a.expose().len(), 64);
        assert!(a.expose().bytes().all(|c| c.is_ascii_hexdigit()));
        assert!(!format!("{a:?}").contains(&a.expose()[..8]));
    }
}
