//! # cuda-peer-cli
//!
//! The `cuda-peer` command. `cuda-peer doctor` says, per ordered pair of
//! GPUs, whether peer memory works, how fast, and if not, why and what to
//! change: system facts from sysfs/procfs ([`sysfs`]), the driver's and
//! NVML's answers and functional checks in child processes ([`gpu`]), a
//! verdict per pair ([`rules`]) and a cache of the verdicts ([`cache`]).
#![deny(missing_docs)]

pub mod cache;
pub mod gpu;
pub mod report;
pub mod rules;
pub mod sysfs;

use rules::{Checks, Outcome, PairInput, PairVerdict};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Settings of one doctor run.
#[derive(Debug, Clone)]
pub struct DoctorOptions {
    /// Root of the file system to read facts under (`/`).
    pub root: PathBuf,
    /// Create and destroy a context on each GPU first, reporting utilisation.
    pub wake: bool,
    /// Per-check timeout.
    pub timeout: Duration,
    /// Bytes per bandwidth copy.
    pub bytes: usize,
    /// Stop starting checks after this long (whatever is left is skipped).
    pub budget: Duration,
    /// Where to write the verdict cache (`None`: do not write).
    pub cache_path: Option<PathBuf>,
}

/// Runs the doctor and returns its report (with the exit code in it).
pub fn doctor(opts: &DoctorOptions) -> report::Report {
    let t = Instant::now();
    let nvml = gpu::NvmlHandle::init();
    let devices = gpu::devices();
    let infos = devices.as_ref().map(|d| d.as_slice()).unwrap_or(&[]);
    let wake = (opts.wake && !infos.is_empty()).then(|| gpu::wake(infos, &nvml));
    let bdfs: Vec<String> = infos.iter().map(|d| sysfs::normalize_bdf(&d.pci_bus_id)).collect();
    let facts = sysfs::SystemFacts::read(&opts.root, &bdfs);
    let mut pairs = Vec::new();
    let mut notes = Vec::new();
    // The pairs whose checks the time budget cut: a verdict of checks that
    // did not run is not one to cache.
    let mut uncached = Vec::new();
    if let Err(e) = &nvml.0 {
        notes.push(e.clone());
    }
    let have_gpu = !infos.is_empty();
    if have_gpu {
        for from in 0..infos.len() {
            for to in (0..infos.len()).filter(|&t| t != from) {
                let vram = |i: usize| infos.get(i).map(|d| d.total_memory as u64);
                let mut input = PairInput {
                    from,
                    to,
                    from_bdf: bdfs[from].clone(),
                    to_bdf: bdfs[to].clone(),
                    vram: [vram(from), vram(to)],
                    ..Default::default()
                };
                let drv = match gpu::driver_pair(from, to, infos, &nvml) {
                    Ok(d) => d,
                    Err(e) => {
                        notes.push(format!("GPU {from} -> {to}: driver query failed: {e}"));
                        pairs.push(report::PairReport::facts_only(rules::judge(&facts, &input)));
                        continue;
                    }
                };
                let peer = drv.can_access_peer && drv.can_access_peer_back;
                input.driver = Some(drv);
                let (checks, speeds, timings, cut) = run_checks(from, to, peer, opts, t);
                if cut {
                    notes.push(format!(
                        "GPU {from} -> {to}: the time budget ran out before its checks ended; its verdict is not cached (the library checks the pair itself)"
                    ));
                    uncached.push(pairs.len());
                }
                input.checks = Some(checks);
                input.speeds = speeds;
                pairs.push(report::PairReport {
                    verdict: rules::judge(&facts, &input),
                    driver: input.driver.clone(),
                    checks: input.checks.clone(),
                    speeds: input.speeds.clone(),
                    check_seconds: timings,
                });
            }
        }
    } else {
        // No driver or no GPU: judge the pairs sysfs shows, from the facts alone.
        for (from, a) in facts.gpus.iter().enumerate() {
            for (to, b) in facts.gpus.iter().enumerate().filter(|(t, _)| *t != from) {
                let input = PairInput { from, to, from_bdf: a.bdf.clone(), to_bdf: b.bdf.clone(), ..Default::default() };
                pairs.push(report::PairReport::facts_only(rules::judge(&facts, &input)));
            }
        }
    }
    let verdicts: Vec<PairVerdict> = pairs.iter().map(|p| p.verdict.clone()).collect();
    let exit_code = rules::exit_code(&verdicts, have_gpu);
    let driver_version = facts.driver.version.clone().or_else(|| nvml.driver_version());
    let mut cache_written = None;
    if let (true, Some(path)) = (have_gpu, &opts.cache_path) {
        // The key the library computes for itself (cuda_peer::verdict), so
        // that the two match by construction.
        let entries =
            pairs.iter().enumerate().filter(|(i, _)| !uncached.contains(i)).map(|(_, p)| cache::entry(&p.verdict, p.speeds.as_ref())).collect();
        match cache::CacheKey::current().map(|key| cache::Cache::new(key, entries)).and_then(|c| c.write(path)) {
            Ok(()) => cache_written = Some(path.display().to_string()),
            Err(e) => notes.push(format!("could not write the verdict cache {}: {e}", path.display())),
        }
    }
    report::Report {
        version: env!("CARGO_PKG_VERSION").to_string(),
        machine_findings: rules::machine_findings(&facts),
        gpus: infos.iter().map(report::GpuReport::from).collect(),
        no_gpu_reason: devices.err(),
        facts,
        driver_version,
        wake,
        pairs,
        notes,
        cache_written,
        elapsed_s: t.elapsed().as_secs_f64(),
        exit_code,
    }
}

/// The checks of one pair, its speeds, each check's time, and whether the
/// doctor's time budget cut a check (the pair was then not fully checked).
type PairChecks = (Checks, Option<rules::Speeds>, Vec<(String, f64)>, bool);

fn run_checks(from: usize, to: usize, peer: bool, opts: &DoctorOptions, start: Instant) -> PairChecks {
    let mut checks = Checks {
        copy_engine: Outcome::Error("not reported".into()),
        mesh: Outcome::Skipped("the driver reports no peer access".into()),
        oneshot: Outcome::Skipped("the driver reports no peer access".into()),
        staged: Outcome::Error("not reported".into()),
    };
    let mut speeds = None;
    let mut timings = Vec::new();
    let mut cut = false;
    let over = || start.elapsed() >= opts.budget;
    let skipped = || Outcome::Skipped(format!("the doctor's time budget ({:?}) ran out", opts.budget));
    let mut run = |kind: gpu::ChildKind, checks: &mut Checks| {
        if over() {
            cut = true;
            let s = skipped();
            match kind {
                gpu::ChildKind::Copy => {
                    checks.copy_engine = s.clone();
                    checks.staged = s;
                }
                gpu::ChildKind::Mesh => checks.mesh = s,
                gpu::ChildKind::OneShot => checks.oneshot = s,
                gpu::ChildKind::Sm => {
                    checks.mesh = s.clone();
                    checks.oneshot = s;
                }
            }
            return;
        }
        let r = gpu::spawn_child(kind, from, to, opts.bytes, opts.timeout);
        timings.push((kind.name().to_string(), r.elapsed.as_secs_f64()));
        let mut got = [false; 4];
        for line in r.lines {
            match line {
                gpu::ChildLine::CopyEngine(o) => (checks.copy_engine, got[0]) = (o, true),
                gpu::ChildLine::Staged(o) => (checks.staged, got[1]) = (o, true),
                gpu::ChildLine::Mesh(o) => (checks.mesh, got[2]) = (o, true),
                gpu::ChildLine::OneShot(o) => (checks.oneshot, got[3]) = (o, true),
                gpu::ChildLine::Speeds(s) => speeds = Some(s),
            }
        }
        // What the child did not report before it died or timed out takes its end.
        let fail = r.failure.unwrap_or_else(|| Outcome::Error("the check process reported nothing".into()));
        let wanted: &[usize] = match kind {
            gpu::ChildKind::Copy => &[0, 1],
            gpu::ChildKind::Mesh => &[2],
            gpu::ChildKind::OneShot => &[3],
            gpu::ChildKind::Sm => &[2, 3],
        };
        for &w in wanted {
            if !got[w] {
                let slot = match w {
                    0 => &mut checks.copy_engine,
                    1 => &mut checks.staged,
                    2 => &mut checks.mesh,
                    _ => &mut checks.oneshot,
                };
                *slot = fail.clone();
            }
        }
    };
    run(gpu::ChildKind::Copy, &mut checks);
    if peer {
        run(gpu::ChildKind::Sm, &mut checks);
        // A mesh that failed may have left the process's contexts broken:
        // the one-shot gets a process of its own before it is judged.
        if checks.mesh != Outcome::Pass {
            run(gpu::ChildKind::OneShot, &mut checks);
        }
    }
    (checks, speeds, timings, cut)
}
