//! The kernel images cuda-peer embeds, and the table `src/kernels/mod.rs`
//! includes (`OUT_DIR/kernels.rs`).
//!
//! By default: the committed images (`src/kernels/*.ptx`, and
//! `src/kernels/cubin/ARCH/*.cubin.zst`, zstd-compressed, both made by
//! `kernels/gen.sh`), after a check that they are exactly the modules and
//! architectures `src/kernels/list.rs` names. No compiler runs.
//!
//! With the feature `kernels-from-source` (or `CUDA_PEER_KERNELS_FROM_SOURCE=1`):
//! `kernels/reduce.cu` compiled here, one build per module with the define
//! `src/kernels/list.rs` gives it, into `OUT_DIR/kernels/`: the PTX with nvcc
//! (`nvcc -ptx`, from `CUDA_PATH`, `CUDA_HOME`, `PATH` or `/usr/local/cuda`), or
//! with NVRTC through `kernels/nvrtc_compile.py` where `CUDA_PEER_NVRTC` names a
//! libnvrtc; the cubins (uncompressed) with ptxas (`CUDA_PEER_PTXAS`, or the one
//! beside nvcc or NVRTC, or found as nvcc is) from that PTX, for the architectures
//! in `CUDA_PEER_ARCHS` (default: the committed ones).

use std::env;
use std::ffi::OsString;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

include!("src/kernels/list.rs");

/// Turns the from-source build on without the feature (any value but empty, `0`,
/// `false` or `no`).
const FROM_SOURCE_ENV: &str = "CUDA_PEER_KERNELS_FROM_SOURCE";
/// The cubins' architectures, `sm_XY` separated by commas or spaces (`none`: the
/// PTX only).
const ARCHS_ENV: &str = "CUDA_PEER_ARCHS";
/// A libnvrtc (`libnvrtc.so.12`): the PTX is compiled with it, not with nvcc.
const NVRTC_ENV: &str = "CUDA_PEER_NVRTC";
/// The Python that runs `kernels/nvrtc_compile.py` (default `python3`).
const PYTHON_ENV: &str = "CUDA_PEER_PYTHON";
/// The ptxas that assembles the cubins.
const PTXAS_ENV: &str = "CUDA_PEER_PTXAS";
/// Toolkit folders, in the order they are looked in.
const TOOLKIT_ENVS: [&str; 2] = ["CUDA_PATH", "CUDA_HOME"];
/// The toolkit's usual place, looked in last.
const DEFAULT_TOOLKIT: &str = "/usr/local/cuda";
/// The PTX target: the oldest architecture cuda-peer serves (and the committed
/// PTX's).
const PTX_ARCH: u32 = 70;

/// The embedded images: what `OUT_DIR/kernels.rs` is written from.
struct Images {
    /// Built from source (else the committed ones).
    from_source: bool,
    /// How they were made, for the logs.
    built_with: String,
    /// The PTX's `.target`.
    ptx_target: String,
    /// The cubins' architectures, ascending.
    archs: Vec<(u32, u32)>,
    /// Whether the cubins are zstd frames (else ELF images).
    compressed: bool,
    /// Per module (in the order of `MODULES`): its PTX, and its cubins in the order of
    /// `archs`.
    files: Vec<(PathBuf, Vec<PathBuf>)>,
}

fn main() {
    let root = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/kernels/list.rs");
    println!("cargo:rerun-if-env-changed={FROM_SOURCE_ENV}");
    let from_source = env::var_os("CARGO_FEATURE_KERNELS_FROM_SOURCE").is_some()
        || env::var(FROM_SOURCE_ENV).is_ok_and(|v| !matches!(v.trim(), "" | "0" | "false" | "no"));
    let images = if from_source {
        from_source::build(&root, &out)
    } else {
        // The committed files, and any file added beside them.
        println!("cargo:rerun-if-changed=src/kernels");
        committed(&root)
    };
    if let Err(e) = images.and_then(|images| write_table(&root, &out, &images)) {
        eprintln!("error: cuda-peer: {e}");
        std::process::exit(1);
    }
}

/// `sm_XY` (`XY` the compute capability, its last digit the minor) as `(major,
/// minor)`.
fn parse_arch(arch: &str) -> Option<(u32, u32)> {
    let digits = arch.strip_prefix("sm_")?;
    if digits.len() < 2 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let (major, minor) = digits.split_at(digits.len() - 1);
    Some((major.parse().ok()?, minor.parse().ok()?))
}

fn arch_name((major, minor): (u32, u32)) -> String {
    format!("sm_{major}{minor}")
}

/// The committed images, checked against `src/kernels/list.rs`: every module's
/// PTX, every module's cubin for every committed architecture, and nothing else
/// in their folders.
fn committed(root: &Path) -> Result<Images, String> {
    let kernels = root.join("src/kernels");
    let archs = COMMITTED_ARCHS.map(|a| parse_arch(a).ok_or_else(|| format!("src/kernels/list.rs: {a:?} is not sm_XY")));
    let archs = archs.into_iter().collect::<Result<Vec<_>, _>>()?;
    let mut problems = Vec::new();
    let mut files = Vec::new();
    for (name, _) in MODULES {
        let ptx = kernels.join(format!("{name}.ptx"));
        if !ptx.is_file() {
            problems.push(format!("src/kernels/{name}.ptx is missing"));
        }
        let mut cubins = Vec::new();
        for arch in COMMITTED_ARCHS {
            let cubin = kernels.join(format!("cubin/{arch}/{name}.cubin.zst"));
            match fs::read(&cubin) {
                Ok(bytes) if bytes.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) => {}
                Ok(_) => problems.push(format!("src/kernels/cubin/{arch}/{name}.cubin.zst is not a zstd frame")),
                Err(_) => problems.push(format!("src/kernels/cubin/{arch}/{name}.cubin.zst is missing")),
            }
            cubins.push(cubin);
        }
        files.push((ptx, cubins));
    }
    let names = |dir: &Path| -> Vec<(String, bool)> {
        let Ok(entries) = fs::read_dir(dir) else { return Vec::new() };
        let mut names: Vec<(String, bool)> = entries.flatten().map(|e| (e.file_name().to_string_lossy().into_owned(), e.path().is_dir())).collect();
        names.sort();
        names
    };
    for (file, _) in names(&kernels) {
        if let Some(module) = file.strip_suffix(".ptx") {
            if !MODULES.iter().any(|(name, _)| *name == module) {
                problems.push(format!("src/kernels/{file} is not a module of src/kernels/list.rs"));
            }
        }
    }
    for (arch, is_dir) in names(&kernels.join("cubin")) {
        if !is_dir || !COMMITTED_ARCHS.contains(&arch.as_str()) {
            problems.push(format!("src/kernels/cubin/{arch} is not a committed architecture of src/kernels/list.rs"));
            continue;
        }
        for (file, _) in names(&kernels.join("cubin").join(&arch)) {
            if !MODULES.iter().any(|(name, _)| file == format!("{name}.cubin.zst")) {
                problems.push(format!("src/kernels/cubin/{arch}/{file} is not a module of src/kernels/list.rs"));
            }
        }
    }
    if !problems.is_empty() {
        return Err(format!(
            "the committed kernels do not match src/kernels/list.rs:\n  {}\n\
             Regenerate them with kernels/gen.sh (it installs the pinned NVRTC and ptxas wheels from PyPI; \
             needs python3 with pip and zstd), or build with the feature kernels-from-source.",
            problems.join("\n  ")
        ));
    }
    Ok(Images {
        from_source: false,
        built_with: "the committed PTX and cubins".into(),
        ptx_target: arch_name((PTX_ARCH / 10, PTX_ARCH % 10)),
        archs,
        compressed: true,
        files,
    })
}

/// A path as a Rust string expression for `include_bytes!`: under `OUT_DIR`
/// or the package's directory it is `concat!(env!(..), "/rest")`, so that
/// the table never names the directory it was generated in (a checkout
/// moved, or another checkout building into the same target directory,
/// reuses the build script's output).
fn literal(path: &Path, root: &Path, out: &Path) -> Result<String, String> {
    let utf8 = |p: &Path| p.to_str().map(str::to_owned).ok_or_else(|| format!("{} is not UTF-8", path.display()));
    for (var, base) in [("OUT_DIR", out), ("CARGO_MANIFEST_DIR", root)] {
        if let Ok(rest) = path.strip_prefix(base) {
            return Ok(format!("concat!(env!({var:?}), {:?})", format!("/{}", utf8(rest)?)));
        }
    }
    Ok(format!("{:?}", utf8(path)?))
}

/// `OUT_DIR/kernels.rs`: the constants and the embedded files of `images`, in
/// functions that are never inlined (a static or const holding the bytes, or an
/// inlinable function, would also be written into the rlib's metadata).
fn write_table(root: &Path, out: &Path, images: &Images) -> Result<(), String> {
    let n = images.archs.len();
    let mut t = String::new();
    let archs: Vec<String> = images.archs.iter().map(|(ma, mi)| format!("({ma}, {mi})")).collect();
    let _ = writeln!(t, "// Generated by build.rs: the embedded kernel images ({}).", images.built_with);
    let _ = writeln!(t, "/// Whether the embedded kernel images were built from source (else they are the committed ones).");
    let _ = writeln!(t, "#[cfg(test)]\npub(crate) const FROM_SOURCE: bool = {};", images.from_source);
    let _ = writeln!(t, "/// How the embedded kernel images were made.");
    let _ = writeln!(t, "pub(crate) const BUILT_WITH: &str = {:?};", images.built_with);
    let _ = writeln!(t, "/// The `.target` of the embedded PTX.");
    let _ = writeln!(t, "#[cfg(test)]\npub(crate) const PTX_TARGET: &str = {:?};", images.ptx_target);
    let _ = writeln!(t, "/// Architectures with embedded cubins, `(major, minor)`, ascending, in the order of [`KernelModule`]'s cubins.");
    let _ = writeln!(t, "pub(crate) const CUBIN_ARCHS: [(u32, u32); {n}] = [{}];", archs.join(", "));
    let _ = writeln!(t, "/// Whether the embedded cubins are zstd frames (else ELF images as ptxas wrote them).");
    let _ = writeln!(t, "const CUBINS_COMPRESSED: bool = {};", images.compressed);
    let _ = writeln!(t, "mod files {{");
    for ((name, _), (ptx, cubins)) in MODULES.iter().zip(&images.files) {
        let cubins = cubins.iter().map(|c| literal(c, root, out).map(|l| format!("include_bytes!({l})"))).collect::<Result<Vec<_>, _>>()?;
        let _ = writeln!(t, "    pub(super) mod {name} {{");
        let _ = writeln!(t, "        #[inline(never)]");
        let _ = writeln!(t, "        pub(in super::super) fn ptx() -> &'static str {{ include_str!({}) }}", literal(ptx, root, out)?);
        let _ = writeln!(t, "        #[inline(never)]");
        let _ = writeln!(t, "        pub(in super::super) fn cubins() -> [&'static [u8]; {n}] {{ [{}] }}", cubins.join(", "));
        let _ = writeln!(t, "    }}");
    }
    let _ = writeln!(t, "}}");
    let modules: Vec<String> = MODULES
        .iter()
        .map(|(name, _)| format!("KernelModule {{ name: {name:?}, ptx: files::{name}::ptx, cubins: files::{name}::cubins }}"))
        .collect();
    let _ = writeln!(t, "static MODULES: [KernelModule; {}] = [{}];", MODULES.len(), modules.join(", "));
    let path = out.join("kernels.rs");
    // Rewritten only when it changes, so that an unchanged table does not rebuild the crate.
    if fs::read_to_string(&path).ok().as_deref() != Some(t.as_str()) {
        fs::write(&path, t).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    Ok(())
}

/// The from-source build (feature `kernels-from-source`).
mod from_source {
    use super::*;

    /// How the PTX is made.
    enum PtxCompiler {
        /// `nvcc -ptx`.
        Nvcc(PathBuf),
        /// NVRTC (the library, and its builtins beside it), through
        /// `kernels/nvrtc_compile.py` run by `python`.
        Nvrtc { lib: PathBuf, builtins: Option<PathBuf>, python: OsString },
    }

    /// The value of an environment variable, declared to cargo; `None` when unset
    /// or empty.
    fn var(name: &str) -> Option<OsString> {
        println!("cargo:rerun-if-env-changed={name}");
        env::var_os(name).filter(|v| !v.is_empty())
    }

    /// `tool` in `CUDA_PATH/bin`, `CUDA_HOME/bin`, `PATH` or `/usr/local/cuda/bin`,
    /// the first that has it.
    fn find_tool(tool: &str) -> Option<PathBuf> {
        let mut dirs: Vec<PathBuf> = TOOLKIT_ENVS.iter().filter_map(|e| var(e)).map(|d| PathBuf::from(d).join("bin")).collect();
        if let Some(path) = var("PATH") {
            dirs.extend(env::split_paths(&path));
        }
        dirs.push(Path::new(DEFAULT_TOOLKIT).join("bin"));
        dirs.into_iter().map(|d| d.join(tool)).find(|p| p.is_file())
    }

    /// The error for no compiler found.
    fn no_toolkit(root: &Path) -> String {
        format!(
            "the feature kernels-from-source compiles kernels/reduce.cu at build time, and no CUDA compiler was found. \
             Install a CUDA toolkit with nvcc (it is looked for in $CUDA_PATH/bin, $CUDA_HOME/bin, PATH and \
             {DEFAULT_TOOLKIT}/bin), or set CUDA_PATH to one; or, with no toolkit, use the PyPI wheels nvidia-cuda-nvrtc-cu12 \
             (NVRTC) and nvidia-cuda-nvcc-cu12 (ptxas; the 12.x wheel has no nvcc) with {NVRTC_ENV} and {PTXAS_ENV} set to \
             their libnvrtc.so.12 and ptxas: `eval \"$({}/kernels/gen.sh --env)\"` installs the versions the committed \
             kernels were built with and sets both; or build without kernels-from-source, which embeds the committed kernels.",
            root.display()
        )
    }

    /// The first line of `tool --version`'s output that names a release, for the logs.
    fn version(tool: &Path) -> String {
        let out = Command::new(tool).arg("--version").output();
        let text = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
        text.lines().rev().find(|l| l.contains("release")).unwrap_or("version unknown").trim().to_string()
    }

    /// Runs `cmd`: its output (stdout, then stderr), or an error that has it
    /// (`what` names the step).
    fn run(cmd: &mut Command, what: &str) -> Result<String, String> {
        let out = cmd.output().map_err(|e| format!("{what}: cannot run {:?}: {e}", cmd.get_program()))?;
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        if out.status.success() {
            Ok(text)
        } else {
            Err(format!("{what} failed ({}):\n{}", out.status, text.trim_end()))
        }
    }

    /// Runs `f` on every job, several at a time; the results in the jobs' order,
    /// or every error.
    fn parallel<J: Sync, R: Send>(jobs: &[J], f: impl Fn(&J) -> Result<R, String> + Sync) -> Result<Vec<R>, String> {
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(1, jobs.len().max(1));
        let next = AtomicUsize::new(0);
        let results: Mutex<Vec<Option<Result<R, String>>>> = Mutex::new((0..jobs.len()).map(|_| None).collect());
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(job) = jobs.get(i) else { break };
                    let r = f(job);
                    results.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(r);
                });
            }
        });
        let results = results.into_inner().unwrap_or_else(|p| p.into_inner());
        let (mut ok, mut errors) = (Vec::new(), Vec::new());
        for r in results {
            match r.unwrap_or_else(|| Err("a compiler thread panicked".into())) {
                Ok(r) => ok.push(r),
                Err(e) => errors.push(e),
            }
        }
        if errors.is_empty() {
            Ok(ok)
        } else {
            Err(errors.join("\n"))
        }
    }

    /// The `.target` of a PTX text.
    fn ptx_target(ptx: &str) -> Option<&str> {
        ptx.lines().find_map(|l| l.trim().strip_prefix(".target")).map(|t| t.trim())
    }

    /// The PTX target nvcc is given: compute_70, or the oldest it lists where it
    /// no longer has compute_70 (CUDA 13 starts at compute_75).
    fn nvcc_ptx_arch(nvcc: &Path) -> u32 {
        let listed = Command::new(nvcc).arg("--list-gpu-arch").output().ok().filter(|o| o.status.success());
        let archs: Vec<u32> = listed
            .map(|o| String::from_utf8_lossy(&o.stdout).lines().filter_map(|l| l.trim().strip_prefix("compute_")?.parse().ok()).collect())
            .unwrap_or_default();
        match archs.iter().copied().filter(|&a| a >= PTX_ARCH).min() {
            Some(a) if !archs.contains(&PTX_ARCH) => {
                println!(
                    "cargo:warning=cuda-peer: {} has no compute_{PTX_ARCH}: the kernels target compute_{a}, and GPUs older than sm_{a} are not served",
                    nvcc.display()
                );
                a
            }
            _ => PTX_ARCH,
        }
    }

    pub(super) fn build(root: &Path, out: &Path) -> Result<Images, String> {
        println!("cargo:rerun-if-changed=kernels/reduce.cu");
        println!("cargo:rerun-if-changed=kernels/nvrtc_compile.py");
        let src = root.join("kernels/reduce.cu");

        // The compilers.
        let (compiler, ptx_arch) = match var(NVRTC_ENV) {
            Some(lib) => {
                let lib = PathBuf::from(lib);
                if !lib.is_file() {
                    return Err(format!("{NVRTC_ENV}={}: no such file (it names a libnvrtc, e.g. libnvrtc.so.12)", lib.display()));
                }
                let dir = lib.parent().unwrap_or(Path::new("."));
                let mut builtins: Vec<PathBuf> = fs::read_dir(dir)
                    .map(|d| d.flatten().map(|e| e.path()).filter(|p| p.to_string_lossy().contains("libnvrtc-builtins.so")).collect())
                    .unwrap_or_default();
                builtins.sort();
                let python = var(PYTHON_ENV).unwrap_or_else(|| "python3".into());
                (PtxCompiler::Nvrtc { lib, builtins: builtins.into_iter().next(), python }, PTX_ARCH)
            }
            None => {
                let nvcc = find_tool("nvcc").ok_or_else(|| no_toolkit(root))?;
                let arch = nvcc_ptx_arch(&nvcc);
                (PtxCompiler::Nvcc(nvcc), arch)
            }
        };
        let ptxas = match var(PTXAS_ENV) {
            Some(p) => {
                let p = PathBuf::from(p);
                p.is_file().then_some(p.clone()).ok_or_else(|| format!("{PTXAS_ENV}={}: no such file", p.display()))?
            }
            None => {
                // Beside nvcc, or in the toolkit of the NVRTC library (lib64/../bin), or as nvcc is found.
                let beside = match &compiler {
                    PtxCompiler::Nvcc(nvcc) => nvcc.with_file_name("ptxas"),
                    PtxCompiler::Nvrtc { lib, .. } => lib.parent().and_then(Path::parent).unwrap_or(Path::new(".")).join("bin/ptxas"),
                };
                if beside.is_file() {
                    beside
                } else {
                    find_tool("ptxas").ok_or_else(|| format!("no ptxas (to assemble the cubins): set {PTXAS_ENV}, or see: {}", no_toolkit(root)))?
                }
            }
        };
        for tool in [&ptxas].into_iter().chain(match &compiler {
            PtxCompiler::Nvcc(p) => Some(p),
            PtxCompiler::Nvrtc { lib, .. } => Some(lib),
        }) {
            println!("cargo:rerun-if-changed={}", tool.display());
        }

        // The architectures.
        let archs_env = var(ARCHS_ENV).map(|v| v.to_string_lossy().into_owned());
        let mut archs = Vec::new();
        match archs_env.as_deref().map(str::trim) {
            Some("none") => {}
            Some(list) => {
                for a in list.split(|c: char| c == ',' || c.is_whitespace()).filter(|a| !a.is_empty()) {
                    let arch = parse_arch(a).ok_or_else(|| {
                        format!(
                            "{ARCHS_ENV}: {a:?} is not an architecture like sm_89 (plain sm_XY: the kernels use no architecture-specific features)"
                        )
                    })?;
                    if arch.0 * 10 + arch.1 < ptx_arch {
                        return Err(format!("{ARCHS_ENV}: {a} is older than the PTX's target, compute_{ptx_arch}"));
                    }
                    archs.push(arch);
                }
            }
            None => {
                for a in COMMITTED_ARCHS {
                    let arch = parse_arch(a).ok_or_else(|| format!("src/kernels/list.rs: {a:?} is not sm_XY"))?;
                    if arch.0 * 10 + arch.1 >= ptx_arch {
                        archs.push(arch);
                    }
                }
            }
        }
        archs.sort();
        archs.dedup();

        // The PTX, one build per module.
        let dir = out.join("kernels");
        let _ = fs::remove_dir_all(&dir);
        for sub in std::iter::once(dir.clone()).chain(archs.iter().map(|&a| dir.join("cubin").join(arch_name(a)))) {
            fs::create_dir_all(&sub).map_err(|e| format!("creating {}: {e}", sub.display()))?;
        }
        let target = format!("sm_{ptx_arch}");
        let ptx_files = parallel(&MODULES, |&(name, define)| {
            let ptx = dir.join(format!("{name}.ptx"));
            let what = format!("compiling kernels/reduce.cu with -D{define}");
            let text = match &compiler {
                PtxCompiler::Nvcc(nvcc) => run(
                    Command::new(nvcc)
                        .args([
                            "-ptx",
                            &format!("--gpu-architecture=compute_{ptx_arch}"),
                            "--std=c++14",
                            "--fmad=false",
                            "-Wno-deprecated-gpu-targets",
                        ])
                        .arg(format!("-D{define}"))
                        .arg("-o")
                        .arg(&ptx)
                        .arg(&src),
                    &what,
                )?,
                PtxCompiler::Nvrtc { lib, builtins, python } => {
                    let mut cmd = Command::new(python);
                    cmd.arg(root.join("kernels/nvrtc_compile.py")).arg("--nvrtc").arg(lib);
                    if let Some(b) = builtins {
                        cmd.arg("--builtins").arg(b);
                    }
                    cmd.arg("--src").arg(&src).args(["--banner-name", "kernels/reduce.cu", "--max-ptx-version", "99.99", "--expect-target"]);
                    cmd.arg(&target).arg("--out").arg(&ptx).arg("--").arg(format!("-D{define}"));
                    run(&mut cmd, &what)?
                }
            };
            for line in text.lines().filter(|l| l.contains("warning")) {
                println!("cargo:warning=cuda-peer: {name}: {line}");
            }
            let body = fs::read_to_string(&ptx).map_err(|e| format!("{what}: reading {}: {e}", ptx.display()))?;
            if ptx_target(&body) != Some(target.as_str()) {
                return Err(format!("{what}: {} has .target {:?}, not {target}", ptx.display(), ptx_target(&body)));
            }
            Ok((ptx, body.len()))
        })?;

        // The cubins, from that PTX: every module for every architecture, the
        // largest PTX first.
        let mut jobs: Vec<(usize, (u32, u32))> = (0..MODULES.len()).flat_map(|m| archs.iter().map(move |&a| (m, a))).collect();
        jobs.sort_by_key(|&(m, _)| std::cmp::Reverse(ptx_files[m].1));
        parallel(&jobs, |&(m, arch)| {
            let (name, arch) = (MODULES[m].0, arch_name(arch));
            let cubin = dir.join(format!("cubin/{arch}/{name}.cubin"));
            // The flags of kernels/gen.sh, so that the same ptxas makes the same image.
            let log = run(
                Command::new(&ptxas).arg(format!("-arch={arch}")).args(["--warning-as-error", "-v", "-o"]).arg(&cubin).arg(&ptx_files[m].0),
                &format!("ptxas -arch={arch} {name}.ptx"),
            )?;
            let spills = log
                .lines()
                .filter(|l| l.contains("bytes stack frame") && l.trim() != "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads")
                .count();
            if spills > 0 {
                println!("cargo:warning=cuda-peer: {name} for {arch}: {spills} entries with register spills or a stack frame (ptxas -v)");
            }
            Ok(())
        })?;

        let ptx_with = match &compiler {
            PtxCompiler::Nvcc(nvcc) => format!("nvcc ({}), compute_{ptx_arch}", version(nvcc)),
            PtxCompiler::Nvrtc { lib, .. } => {
                // nvrtc_compile.py's banner names the version: `// NVRTC 12.0, options: ...`.
                let banner = fs::read_to_string(&ptx_files[0].0).unwrap_or_default();
                let version = banner.lines().find_map(|l| l.strip_prefix("// NVRTC ")?.split(',').next()).unwrap_or("(version unknown)");
                format!("NVRTC {version} ({}), compute_{ptx_arch}", lib.display())
            }
        };
        let built_with = format!(
            "built from kernels/reduce.cu: PTX with {ptx_with}; cubins for {} with ptxas ({})",
            if archs.is_empty() { "no architecture".to_string() } else { archs.iter().map(|&a| arch_name(a)).collect::<Vec<_>>().join(", ") },
            version(&ptxas)
        );
        println!("{built_with}");
        let files = MODULES
            .iter()
            .zip(ptx_files)
            .map(|((name, _), (ptx, _))| (ptx, archs.iter().map(|&a| dir.join(format!("cubin/{}/{name}.cubin", arch_name(a)))).collect()))
            .collect();
        Ok(Images { from_source: true, built_with, ptx_target: target, archs, compressed: false, files })
    }
}
