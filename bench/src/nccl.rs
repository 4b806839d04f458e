//! NCCL beside cuda-peer, for both modes: finding the library, starting
//! the NCCL child processes (this program again, with hidden options: NCCL
//! reads `NCCL_P2P_DISABLE` once per process) and what every child prints
//! or exits with first.

use crate::cli::Common;
use crate::exit::Res;
use crate::plan::Progress;
use cudarc::nccl::result;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Exit code of a child that could not load NCCL (it has said so already).
pub(crate) const EXIT_NO_NCCL: i32 = 3;

pub(crate) fn err(what: &str, e: result::NcclError) -> Box<dyn std::error::Error> {
    format!("{what}: {:?}", e.0).into()
}

/// A child without NCCL: prints `why` (one line, where `say`) and exits
/// with [`EXIT_NO_NCCL`], which tells the parent to skip the NCCL impls.
pub(crate) fn skip(say: bool, why: std::fmt::Arguments) -> ! {
    if say {
        println!("{why}");
    }
    std::process::exit(EXIT_NO_NCCL)
}

/// A child's first step: [`skip`] unless cudarc can open the library.
pub(crate) fn require_library(say: bool) {
    // SAFETY: only tries to open the library under cudarc's candidate names.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        skip(say, format_args!("# NCCL: library not found (cudarc looks for libnccl.so; pass --nccl-lib /path/to/libnccl.so.2): nccl impls skipped"));
    }
}

/// The header of an NCCL impl's table: `what`, the library's version, the
/// ranks' `layout`, and NCCL's settings.
pub(crate) fn print_header(what: &str, version: i32, layout: &str) {
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| "(unset)".into());
    println!("#");
    println!(
        "# {what}: NCCL {}.{}.{}, {layout}, NCCL_P2P_DISABLE={}, NCCL_NVLS_ENABLE={}",
        version / 10000,
        version / 100 % 100,
        version % 100,
        var("NCCL_P2P_DISABLE"),
        var("NCCL_NVLS_ENABLE"),
    );
}

/// A directory of this run's own for the NCCL children's files (the
/// `libnccl.so` link [`nccl_shim`] puts first on their `LD_LIBRARY_PATH`,
/// their reports): created under the system temporary directory with a
/// random name (`cuda-peer-bench-*`), mode 0700, so no other user can
/// have made it or put a library in it; removed when dropped.
pub(crate) fn private_tmp() -> std::io::Result<tempfile::TempDir> {
    let mut b = tempfile::Builder::new();
    b.prefix("cuda-peer-bench-");
    // tempfile makes directories with the default mode (0777 less the umask).
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        b.permissions(std::fs::Permissions::from_mode(0o700));
    }
    b.tempdir()
}

/// Where `libnccl.so` must come from for the children, when cudarc would not
/// find it by itself: cudarc opens `libnccl.so` (and a few other names) but
/// not `libnccl.so.2`, the only name a runtime-only NCCL install provides.
/// Returns a directory holding a `libnccl.so` link to the real library, to
/// put first on the children's `LD_LIBRARY_PATH`, or `None` when not needed
/// (or nothing was found: the child then says NCCL is missing). `tmp` is a
/// [`private_tmp`] directory; `nccl_lib` is `--nccl-lib`; `say`: print which
/// library is used.
pub(crate) fn nccl_shim(nccl_lib: Option<&Path>, tmp: &Path, say: bool) -> Option<PathBuf> {
    let target = match nccl_lib {
        Some(p) => p.to_path_buf(),
        None => find_nccl()?,
    };
    let dir = tmp.join("nccl-lib");
    std::fs::create_dir_all(&dir).ok()?;
    #[cfg(unix)]
    std::os::unix::fs::symlink(&target, dir.join("libnccl.so")).ok()?;
    if say {
        println!("# NCCL: using {} (as libnccl.so)", target.display());
    }
    Some(dir)
}

/// `libnccl.so.2` on the loader path, unless `libnccl.so` is there too (then cudarc finds it).
pub(crate) fn find_nccl() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> =
        std::env::var("LD_LIBRARY_PATH").unwrap_or_default().split(':').filter(|d| !d.is_empty()).map(PathBuf::from).collect();
    for ldconfig in ["ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"] {
        if let Ok(out) = std::process::Command::new(ldconfig).arg("-p").output() {
            for line in String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.contains("libnccl.so")) {
                if let Some(path) = line.split("=>").nth(1) {
                    dirs.extend(Path::new(path.trim()).parent().map(Path::to_path_buf));
                }
            }
            break;
        }
    }
    dirs.extend(
        ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/local/cuda/lib64", "/usr/local/lib"].map(PathBuf::from),
    );
    if dirs.iter().any(|d| d.join("libnccl.so").exists()) {
        return None;
    }
    dirs.into_iter().map(|d| d.join("libnccl.so.2")).find(|p| p.exists())
}

/// The flags that give a child this run's points and calls per point,
/// where the CSV goes, and the progress so far; each mode adds its own
/// (which impl, where to report).
pub(crate) fn child_flags(common: &Common, progress: &Progress) -> Vec<OsString> {
    let dtypes: Vec<&str> = common.dtypes.iter().map(|d| d.name()).collect();
    let mut v: Vec<OsString> = [
        format!("--dtypes={}", dtypes.join(",")),
        format!("--min-bytes={}", common.min_bytes),
        format!("--max-bytes={}", common.max_bytes),
        format!("--warmup={}", common.warmup),
        format!("--machine={}", common.machine),
        format!("--progress-offset={}", progress.done),
        format!("--progress-total={}", progress.total),
    ]
    .into_iter()
    .map(Into::into)
    .collect();
    v.extend(["--out".into(), common.out.clone().into_os_string()]);
    v.extend(common.iters.map(|i| format!("--iters={i}").into()));
    if common.quick {
        v.push("--quick".into());
    }
    v
}

/// NCCL's environment in a child.
pub(crate) struct ChildEnv {
    /// `NCCL_P2P_DISABLE=1` (else the variable is removed).
    pub(crate) no_p2p: bool,
    /// Keep the caller's `NCCL_NVLS_ENABLE` where set (else always 0: never NVLink multicast).
    pub(crate) caller_nvls: bool,
    /// `MASTER_PORT` for the children's own rendezvous.
    pub(crate) master_port: Option<u16>,
}

/// Runs this program again with `args` as an NCCL child, in `env`, with
/// `shim` (a [`nccl_shim`] directory) first on its `LD_LIBRARY_PATH`, and
/// waits for it.
pub(crate) fn run_child(args: &[OsString], env: &ChildEnv, shim: Option<&Path>) -> Res<std::process::ExitStatus> {
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.args(args);
    if let Some(port) = env.master_port {
        cmd.env("MASTER_PORT", port.to_string());
    }
    if !env.caller_nvls || std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        cmd.env("NCCL_NVLS_ENABLE", "0");
    }
    if env.no_p2p {
        cmd.env("NCCL_P2P_DISABLE", "1");
    } else {
        cmd.env_remove("NCCL_P2P_DISABLE");
    }
    if let Some(dir) = shim {
        let old = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
        cmd.env("LD_LIBRARY_PATH", if old.is_empty() { dir.display().to_string() } else { format!("{}:{old}", dir.display()) });
    }
    Ok(cmd.status()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_private_directory_is_random_owner_only_and_removed_on_drop() {
        let (a, b) = (private_tmp().unwrap(), private_tmp().unwrap());
        assert_ne!(a.path(), b.path());
        for d in [&a, &b] {
            let name = d.path().file_name().unwrap().to_string_lossy().into_owned();
            assert!(name.starts_with("cuda-peer-bench-") && name != format!("cuda-peer-bench-{}", std::process::id()), "{name}");
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                let meta = std::fs::symlink_metadata(d.path()).unwrap();
                assert!(meta.is_dir());
                assert_eq!(meta.permissions().mode() & 0o777, 0o700);
            }
        }
        let path = a.path().to_path_buf();
        std::fs::write(path.join("x.report"), "enqueue_us=1").unwrap();
        drop(a);
        assert!(!path.exists());
    }
}
