//! The doctor's report: one JSON object (`--json`) or text for people.

use crate::gpu::Wake;
use crate::rules::{Checks, DriverPair, Finding, Level, PairVerdict, Severity, Speeds};
use crate::sysfs::{AcsState, RebarState, SystemFacts};
use cuda_peer::topology::DeviceInfo;
use serde::{Deserialize, Serialize};
use std::fmt::Write;

/// One GPU as the driver describes it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GpuReport {
    /// CUDA ordinal.
    pub ordinal: usize,
    /// Name.
    pub name: String,
    /// PCI bus id (normalised).
    pub bdf: String,
    /// Compute capability.
    pub compute_capability: (i32, i32),
    /// Device memory, bytes.
    pub memory_bytes: u64,
}

impl From<&DeviceInfo> for GpuReport {
    fn from(d: &DeviceInfo) -> Self {
        GpuReport {
            ordinal: d.ordinal,
            name: d.name.clone(),
            bdf: crate::sysfs::normalize_bdf(&d.pci_bus_id),
            compute_capability: d.compute_capability,
            memory_bytes: d.total_memory as u64,
        }
    }
}

/// One ordered pair: the verdict and what it was made from.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PairReport {
    /// The verdict.
    #[serde(flatten)]
    pub verdict: PairVerdict,
    /// The driver's and NVML's answers.
    pub driver: Option<DriverPair>,
    /// Functional checks.
    pub checks: Option<Checks>,
    /// Speeds.
    pub speeds: Option<Speeds>,
    /// Seconds each check process ran, by check (`copy`, `sm`, `oneshot`).
    pub check_seconds: Vec<(String, f64)>,
}

impl PairReport {
    /// A pair judged without driver answers, checks or speeds.
    pub fn facts_only(verdict: PairVerdict) -> PairReport {
        PairReport { verdict, driver: None, checks: None, speeds: None, check_seconds: Vec::new() }
    }
}

/// The whole report.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// cuda-peer-cli's version.
    pub version: String,
    /// System facts.
    pub facts: SystemFacts,
    /// Findings about the machine.
    pub machine_findings: Vec<Finding>,
    /// GPUs as the driver lists them.
    pub gpus: Vec<GpuReport>,
    /// Why there is no GPU, when there is none.
    pub no_gpu_reason: Option<String>,
    /// NVIDIA driver version.
    pub driver_version: Option<String>,
    /// `--wake` results.
    pub wake: Option<Vec<Wake>>,
    /// Per ordered pair.
    pub pairs: Vec<PairReport>,
    /// Notes (NVML missing, cache not written, ...).
    pub notes: Vec<String>,
    /// Where the verdict cache was written.
    pub cache_written: Option<String>,
    /// Seconds the doctor took.
    pub elapsed_s: f64,
    /// The exit status: 0 all pairs at full speed, 1 degraded, 2 nothing usable or no GPU.
    pub exit_code: i32,
}

fn size(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{} GiB", b >> 30)
    } else {
        format!("{} MiB", b >> 20)
    }
}

fn opt<T: std::fmt::Display>(v: &Option<T>) -> String {
    v.as_ref().map(|x| x.to_string()).unwrap_or_else(|| "?".into())
}

fn write_finding(s: &mut String, f: &Finding) {
    let tag = match f.severity {
        Severity::Info => "note",
        Severity::Warn => "WARN",
        Severity::Problem => "PROBLEM",
    };
    let _ = writeln!(s, "    [{tag}] {}", f.what);
    if let Some(fix) = &f.fix {
        let _ = writeln!(s, "           fix: {fix}");
    }
}

/// The report as text.
pub fn render(r: &Report) -> String {
    let mut s = String::new();
    let f = &r.facts;
    let _ = writeln!(s, "cuda-peer doctor {}", r.version);
    let _ = writeln!(s, "\nSystem (read under {}):", f.root);
    let _ = writeln!(
        s,
        "  driver: {} ({})",
        opt(&r.driver_version),
        match f.driver.open_module {
            Some(true) => "open kernel module",
            Some(false) => "proprietary kernel module",
            None => "kernel module not found",
        }
    );
    let _ = writeln!(s, "  kernel command line: {}", if f.cmdline.raw.is_empty() { "?" } else { &f.cmdline.raw });
    let iommu = if f.iommu.enabled() {
        let kinds: std::collections::BTreeSet<String> = f.iommu.groups.iter().filter_map(|g| g.kind.clone()).collect();
        format!("on ({} units, {} groups, types: {})", f.iommu.units.len(), f.iommu.groups.len(), kinds.into_iter().collect::<Vec<_>>().join(", "))
    } else {
        "off (no IOMMU groups)".into()
    };
    let _ = writeln!(s, "  IOMMU: {iommu}");
    if let Some(c) = &f.env.container {
        let _ = writeln!(s, "  container: {c}");
    }
    if let Some(v) = &f.env.virtual_machine {
        let _ = writeln!(s, "  virtual machine: {v}");
    }
    for g in &f.gpus {
        let name = r.gpus.iter().find(|x| x.bdf == g.bdf);
        let _ = writeln!(
            s,
            "  GPU {} {}: NUMA {}, link {} x{} (max {} x{}), BAR1 {}{}, IOMMU group {}",
            name.map(|n| n.ordinal.to_string()).unwrap_or_else(|| "-".into()),
            g.bdf,
            opt(&g.numa_node),
            opt(&g.link_speed),
            opt(&g.link_width),
            opt(&g.max_link_speed),
            opt(&g.max_link_width),
            g.bar1_bytes.map(size).unwrap_or_else(|| "?".into()),
            name.map(|n| format!(" of {} memory", size(n.memory_bytes))).unwrap_or_default(),
            opt(&g.iommu_group),
        );
        let rebar = match &g.rebar {
            RebarState::Present(b) => b.iter().map(|(i, c, m)| format!("BAR{i} {} (max {})", size(*c), size(*m))).collect::<Vec<_>>().join(", "),
            RebarState::Absent => "not supported".into(),
            RebarState::Unreadable(_) => "unreadable (needs root)".into(),
        };
        let path: Vec<String> = g
            .bridges
            .iter()
            .map(|b| match &b.acs {
                Some(AcsState::Present { .. }) if b.acs.as_ref().is_some_and(|a| a.redirects()) => {
                    format!("{} [ACS {}]", b.bdf, b.acs.as_ref().map(|a| a.control_names().join("+")).unwrap_or_default())
                }
                Some(AcsState::Unreadable(_)) => format!("{} [ACS ?]", b.bdf),
                _ => b.bdf.clone(),
            })
            .collect();
        let _ = writeln!(
            s,
            "      {}: {} -> {}; Resizable BAR: {rebar}",
            name.map(|n| n.name.as_str()).unwrap_or("NVIDIA GPU"),
            opt(&g.host_bridge),
            if path.is_empty() { "?".into() } else { path.join(" -> ") }
        );
    }
    if let Some(why) = &r.no_gpu_reason {
        let _ = writeln!(s, "\nNo usable GPU: {why}");
    }
    if let Some(w) = &r.wake {
        let _ = writeln!(s, "\nWake (NVML utilisation GPU%/memory%/P-state, before -> after):");
        for x in w {
            let u = |v: &Result<(u32, u32, String), String>| match v {
                Ok((g, m, p)) => format!("{g}%/{m}%/{p}"),
                Err(e) => e.clone(),
            };
            let c = match &x.context {
                Ok(ms) => format!("context created and destroyed in {ms:.0} ms"),
                Err(e) => format!("context failed: {e}"),
            };
            let _ = writeln!(s, "  GPU {} {}: {} -> {}; {c}", x.ordinal, x.bdf, u(&x.before), u(&x.after));
        }
    }
    if !r.machine_findings.is_empty() {
        let _ = writeln!(s, "\nMachine:");
        for fi in &r.machine_findings {
            write_finding(&mut s, fi);
        }
    }
    for p in &r.pairs {
        let v = &p.verdict;
        let level = match v.level {
            Level::Ok => "OK",
            Level::Degraded => "DEGRADED",
            Level::Unusable => "UNUSABLE",
            Level::Untested => "UNTESTED",
        };
        let _ = writeln!(
            s,
            "\nGPU {} -> GPU {} ({} -> {}, {} via {}): {level}",
            v.from,
            v.to,
            v.from_bdf,
            v.to_bdf,
            v.pci_path.abbrev(),
            v.common_ancestor.as_deref().unwrap_or("no common PCIe bridge")
        );
        let _ = writeln!(s, "  {}", v.summary);
        if let Some(d) = &p.driver {
            let nv = d.nvml_p2p.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ");
            let _ = writeln!(
                s,
                "  driver: can access peer {}/{} (both ways), access supported {}, performance rank {}, native atomics {}, array access {}; NVML: {} {}",
                d.can_access_peer,
                d.can_access_peer_back,
                opt(&d.access_supported),
                opt(&d.performance_rank),
                opt(&d.native_atomics),
                opt(&d.cuda_array_access),
                if nv.is_empty() { "-".into() } else { nv },
                d.nvml_topology.as_deref().unwrap_or("")
            );
        }
        if let Some(c) = &p.checks {
            let detail = |o: &crate::rules::Outcome| match o {
                crate::rules::Outcome::WrongData(d) | crate::rules::Outcome::Error(d) | crate::rules::Outcome::Skipped(d) => {
                    format!("{} ({d})", o.word())
                }
                _ => o.word().to_string(),
            };
            let _ = writeln!(
                s,
                "  checks: copy engine {}; mesh {}; one-shot {}; staged {}",
                detail(&c.copy_engine),
                detail(&c.mesh),
                detail(&c.oneshot),
                detail(&c.staged)
            );
        }
        if let Some(sp) = &p.speeds {
            let g = |v: Option<f64>| v.map(|x| format!("{x:.1} GB/s")).unwrap_or_else(|| "-".into());
            let l = |v: Option<f64>| v.map(|x| format!("{x:.1} us")).unwrap_or_else(|| "-".into());
            let _ = writeln!(
                s,
                "  speed ({} MiB one way / 4 B latency): P2P {} / {}; staged {} / {}; driver without peer access {} / {}",
                sp.bytes >> 20,
                g(sp.p2p_gbs),
                l(sp.p2p_lat_us),
                g(sp.staged_gbs),
                l(sp.staged_lat_us),
                g(sp.driver_gbs),
                l(sp.driver_lat_us)
            );
        }
        if !p.check_seconds.is_empty() {
            let t: Vec<String> = p.check_seconds.iter().map(|(k, v)| format!("{k} {v:.1} s")).collect();
            let _ = writeln!(s, "  check processes: {}", t.join(", "));
        }
        for fi in &v.findings {
            write_finding(&mut s, fi);
        }
    }
    if r.pairs.is_empty() && r.no_gpu_reason.is_none() {
        let _ = writeln!(s, "\nOne GPU: no pairs to check.");
    }
    for n in &r.notes {
        let _ = writeln!(s, "\nnote: {n}");
    }
    if let Some(c) = &r.cache_written {
        let _ = writeln!(s, "\nVerdicts cached in {c}");
    }
    let verdict = match r.exit_code {
        0 => "every pair usable at full speed",
        1 => "something is degraded",
        _ => "nothing usable, or no GPU",
    };
    let _ = writeln!(s, "\n{verdict} (exit {}, {:.1} s)", r.exit_code, r.elapsed_s);
    s
}
