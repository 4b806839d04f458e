//! NCCL beside cuda-peer: the child process that runs one NCCL
//! implementation, and finding the library.

use crate::cli::{Args, Impl, Op};
use crate::data::BenchElem;
use crate::device::contexts;
use crate::plan::{Plan, Progress};
use crate::sweep::{collectives_csv, enqueue_us, sweep, Backend, Bufs, Csv, Engine};
use crate::Res;
use std::path::{Path, PathBuf};

/// Exit code of a child that could not load NCCL (it has said so already).
pub(crate) const EXIT_NO_NCCL: i32 = 3;

use cudarc::nccl::{group_end, group_start, result, Comm, ReduceOp as NcclOp};

pub(crate) fn err(what: &str, e: result::NcclError) -> Box<dyn std::error::Error> {
    format!("{what}: {:?}", e.0).into()
}

/// One collective on every rank, as one NCCL group (required when one
/// thread drives several ranks).
pub(crate) fn call<T: BenchElem>(comms: &[Comm], op: Op, bufs: &mut Bufs<T>) -> Res<()> {
    group_start().map_err(|e| err("ncclGroupStart", e))?;
    let mut first_err = Ok(());
    for (r, comm) in comms.iter().enumerate() {
        let res = match op {
            Op::AllReduce => comm.all_reduce_in_place(&mut bufs.recv[r], &NcclOp::Sum),
            Op::ReduceScatter => comm.reduce_scatter(&bufs.send[r], &mut bufs.recv[r], &NcclOp::Sum),
            Op::AllGather => comm.all_gather(&bufs.send[r], &mut bufs.recv[r]),
            Op::Broadcast => comm.broadcast_in_place(&mut bufs.recv[r], 0),
        };
        if let Err(e) = res {
            first_err = Err(err(op.name(), e));
            break;
        }
    }
    let end = group_end();
    first_err?;
    end.map_err(|e| err("ncclGroupEnd", e))?;
    Ok(())
}

/// The child's whole job: load NCCL, sweep, report the enqueue time.
pub(crate) fn child(args: &Args, imp: Impl, report: &Path) -> Res<()> {
    // SAFETY: only tries to open the library under cudarc's candidate names.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        println!("# NCCL: library not found (cudarc looks for libnccl.so; pass --nccl-lib /path/to/libnccl.so.2): nccl impls skipped");
        std::process::exit(EXIT_NO_NCCL);
    }
    let v = result::get_nccl_version().map_err(|e| err("ncclGetVersion", e))?;
    let ctxs = contexts(args)?;
    let streams = ctxs.iter().map(|c| c.new_stream()).collect::<Result<Vec<_>, _>>()?;
    let comms = Comm::from_devices(streams.clone()).map_err(|e| err("ncclCommInitAll", e))?;
    println!("#");
    println!(
        "# {}: NCCL {}.{}.{}, {} ranks, NCCL_P2P_DISABLE={}, NCCL_NVLS_ENABLE={}",
        imp.name(),
        v / 10000,
        v / 100 % 100,
        v % 100,
        comms.len(),
        std::env::var("NCCL_P2P_DISABLE").unwrap_or_else(|_| "(unset)".into()),
        std::env::var("NCCL_NVLS_ENABLE").unwrap_or_else(|_| "(unset)".into()),
    );
    let backend = Backend { imp, streams, engine: Engine::Nccl(comms) };
    let plan = Plan::new(args, backend.ranks());
    let total = args.progress_total.unwrap_or(plan.points().len());
    let mut progress = Progress { done: args.progress_offset, total };
    let mut csv = Csv::append(&collectives_csv(args))?;
    sweep(&backend, args, &plan, &mut progress, &mut csv)?;
    let us = enqueue_us(&backend)?;
    std::fs::write(report, format!("enqueue_us={us}\n"))?;
    Ok(())
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

/// The child's command line: this run's sweep settings, one NCCL impl, and
/// where to report.
pub(crate) fn child_args(args: &Args, imp: Impl, progress: &Progress, report: &Path) -> Vec<std::ffi::OsString> {
    let list = |v: Vec<&str>| v.join(",");
    let mut v: Vec<std::ffi::OsString> = [
        "--impls".to_string(),
        imp.name().to_string(),
        "--ops".to_string(),
        list(args.ops.iter().map(|o| o.name()).collect()),
        "--dtypes".to_string(),
        list(args.dtypes.iter().map(|d| d.name()).collect()),
        format!("--min-bytes={}", args.min_bytes),
        format!("--max-bytes={}", args.max_bytes),
        format!("--warmup={}", args.warmup),
        format!("--machine={}", args.machine),
        format!("--progress-offset={}", progress.done),
        format!("--progress-total={}", progress.total),
    ]
    .into_iter()
    .map(Into::into)
    .collect();
    v.extend(["--out".into(), args.out.clone().into_os_string(), "--child-report".into(), report.as_os_str().to_owned()]);
    v.extend(args.iters.map(|i| format!("--iters={i}").into()));
    if args.quick {
        v.push("--quick".into());
    }
    if args.graph {
        v.push("--graph".into());
    }
    v
}

/// How an NCCL child ended.
pub(crate) enum ChildEnd {
    /// Swept everything; its enqueue time in microseconds.
    Finished(f64),
    /// Failed part way (said so); its remaining points are missing.
    Failed,
    /// Could not load NCCL (said so in one line).
    NoNccl,
}

/// Runs one NCCL implementation in a child process: fresh NCCL state and
/// its own environment.
pub(crate) fn run_nccl_child(args: &Args, imp: Impl, progress: &Progress, shim: Option<&Path>, tmp: &Path) -> Res<ChildEnd> {
    let report = tmp.join(format!("{}.report", imp.name()));
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.args(child_args(args, imp, progress, &report));
    // Never NVLink multicast (NVLS); P2P off only for nccl-no-p2p.
    cmd.env("NCCL_NVLS_ENABLE", "0");
    match imp {
        Impl::NcclNoP2p => cmd.env("NCCL_P2P_DISABLE", "1"),
        _ => cmd.env_remove("NCCL_P2P_DISABLE"),
    };
    if let Some(dir) = shim {
        let old = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
        cmd.env("LD_LIBRARY_PATH", if old.is_empty() { dir.display().to_string() } else { format!("{}:{old}", dir.display()) });
    }
    let status = cmd.status()?;
    let report = std::fs::read_to_string(&report).unwrap_or_default();
    let enqueue_us = report.trim().strip_prefix("enqueue_us=").and_then(|v| v.parse().ok());
    Ok(match (status.code(), enqueue_us) {
        (Some(0), Some(us)) => ChildEnd::Finished(us),
        (Some(EXIT_NO_NCCL), _) => ChildEnd::NoNccl,
        _ => {
            println!("# {}: the NCCL child process failed ({status}); its remaining points are missing", imp.name());
            ChildEnd::Failed
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::Cli;
    use clap::Parser;

    #[test]
    fn the_childs_command_line_parses_back_to_the_same_settings() {
        let cli = Cli::try_parse_from(["cuda-peer-bench", "--quick", "--dtypes", "f32", "--machine", "m", "--graph"]).expect("parses");
        let args = cli.sweep;
        let progress = Progress { done: 5, total: 20 };
        let mut argv: Vec<std::ffi::OsString> = vec!["cuda-peer-bench".into()];
        argv.extend(child_args(&args, Impl::NcclNoP2p, &progress, Path::new("/tmp/r")));
        let child = Cli::try_parse_from(argv).expect("the child's arguments parse");
        assert!(child.command.is_none());
        let c = child.sweep;
        assert_eq!(c.impls, vec![Impl::NcclNoP2p]);
        assert_eq!(c.child_report, Some(PathBuf::from("/tmp/r")));
        assert_eq!((c.progress_offset, c.progress_total), (5, Some(20)));
        assert_eq!((c.quick, c.graph, c.machine.as_str(), c.dtypes.clone()), (true, true, "m", args.dtypes.clone()));
    }

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
