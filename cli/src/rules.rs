//! From facts to a verdict per ordered pair of GPUs, with the reason and a
//! fix a user can act on. Pure functions: the tests feed them fixture facts
//! and made-up driver and check results.

use crate::sysfs::{pair_path, AcsState, GpuPci, PciPath, RebarState, SystemFacts};
use cuda_peer::verdict::SpeedSample;
use serde::{Deserialize, Serialize};

/// What the driver (and NVML) say about one ordered pair.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DriverPair {
    /// `cuDeviceCanAccessPeer(from, to)`.
    pub can_access_peer: bool,
    /// `cuDeviceCanAccessPeer(to, from)`.
    pub can_access_peer_back: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED`.
    pub access_supported: Option<bool>,
    /// `CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK`.
    pub performance_rank: Option<i32>,
    /// `CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED`.
    pub native_atomics: Option<bool>,
    /// `CU_DEVICE_P2P_ATTRIBUTE_CUDA_ARRAY_ACCESS_SUPPORTED`.
    pub cuda_array_access: Option<bool>,
    /// NVML's P2P status per capability (`read`, `write`, `nvlink`,
    /// `atomics`): `Ok`, or the reason code (`ChipsetNotSupported`, ...).
    pub nvml_p2p: Vec<(String, String)>,
    /// NVML's common ancestor (`Single`, `Multiple`, `HostBridge`, `Node`, `System`).
    pub nvml_topology: Option<String>,
}

impl DriverPair {
    /// Whether NVML says the pair is connected by NVLink.
    pub fn nvlink(&self) -> bool {
        self.nvml_p2p.iter().any(|(k, v)| k == "nvlink" && v == "Ok")
    }
}

/// The result of one functional check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", content = "detail", rename_all = "snake_case")]
pub enum Outcome {
    /// Every byte as expected.
    Pass,
    /// Data arrived wrong (what was wrong).
    WrongData(String),
    /// The check did not finish in time.
    Timeout,
    /// The check failed with an error.
    Error(String),
    /// Not run (why).
    Skipped(String),
}

impl Outcome {
    /// A short word for the table.
    pub fn word(&self) -> &'static str {
        match self {
            Outcome::Pass => "pass",
            Outcome::WrongData(_) => "WRONG DATA",
            Outcome::Timeout => "TIMEOUT",
            Outcome::Error(_) => "error",
            Outcome::Skipped(_) => "skipped",
        }
    }

    /// Whether the check failed (wrong data, timeout or error).
    pub fn failed(&self) -> bool {
        matches!(self, Outcome::WrongData(_) | Outcome::Timeout | Outcome::Error(_))
    }
}

/// The functional checks of one ordered pair.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checks {
    /// Copy-engine peer copy through a verified `Link` (P2P only).
    pub copy_engine: Outcome,
    /// SM peer loads and stores: forced mesh all-reduce.
    pub mesh: Outcome,
    /// SM peer stores and system-scope flags: forced one-shot all-reduce.
    pub oneshot: Outcome,
    /// The staged path (a `Link` with `StagedOnly`), every byte compared.
    pub staged: Outcome,
}

/// Speeds of one ordered pair, one way.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Speeds {
    /// Bytes per bandwidth copy.
    pub bytes: usize,
    /// P2P by copy engine, GB/s.
    pub p2p_gbs: Option<f64>,
    /// Staged through pinned host memory, GB/s.
    pub staged_gbs: Option<f64>,
    /// The driver's own copy without peer access, GB/s.
    pub driver_gbs: Option<f64>,
    /// Latency of a 4-byte P2P copy, us.
    pub p2p_lat_us: Option<f64>,
    /// Latency of a 4-byte staged copy, us.
    pub staged_lat_us: Option<f64>,
    /// Latency of a 4-byte driver copy without peer access, us.
    pub driver_lat_us: Option<f64>,
}

/// The measured bandwidths the speed rule judges, where both were measured
/// (also what the verdict cache stores with a pair).
pub fn speed_sample(s: &Speeds) -> Option<SpeedSample> {
    Some(SpeedSample { bytes: s.bytes, p2p_gbs: s.p2p_gbs?, staged_gbs: s.staged_gbs? })
}

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// Worth knowing.
    Info,
    /// May cost speed or correctness on this kind of setup.
    Warn,
    /// Makes P2P unusable or slow here.
    Problem,
}

/// One observation with, where there is one, the fix.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Finding {
    /// How bad.
    pub severity: Severity,
    /// What was found.
    pub what: String,
    /// What to do about it.
    pub fix: Option<String>,
}

fn finding(severity: Severity, what: impl Into<String>, fix: Option<String>) -> Finding {
    Finding { severity, what: what.into(), fix }
}

/// The verdict's level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Level {
    /// P2P usable at full speed.
    Ok,
    /// Usable, but not by P2P or not at full speed.
    Degraded,
    /// Not usable at all.
    Unusable,
    /// Not tested (no driver or no GPU): only the system facts were judged.
    Untested,
}

/// Which path the pair should use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UsePath {
    /// P2P (copy engine and SM peer access).
    P2p,
    /// Staged through host memory.
    Staged,
    /// Neither works.
    None,
    /// Not known (not tested).
    Unknown,
}

/// The doctor's verdict on one ordered pair.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PairVerdict {
    /// Source GPU (CUDA ordinal, or the index in bus order without a driver).
    pub from: usize,
    /// Destination GPU.
    pub to: usize,
    /// Source bus id.
    pub from_bdf: String,
    /// Destination bus id.
    pub to_bdf: String,
    /// PCIe path class.
    pub pci_path: PciPath,
    /// Common PCIe ancestor.
    pub common_ancestor: Option<String>,
    /// Level.
    pub level: Level,
    /// The path to use.
    pub use_path: UsePath,
    /// One sentence.
    pub summary: String,
    /// Everything found, worst first.
    pub findings: Vec<Finding>,
}

/// Everything known about one ordered pair.
#[derive(Debug, Clone, Default)]
pub struct PairInput {
    /// Source index.
    pub from: usize,
    /// Destination index.
    pub to: usize,
    /// Source bus id.
    pub from_bdf: String,
    /// Destination bus id.
    pub to_bdf: String,
    /// Device memory of source and destination, bytes (from the driver).
    pub vram: [Option<u64>; 2],
    /// The driver's answers (`None`: no driver).
    pub driver: Option<DriverPair>,
    /// Functional checks (`None`: not run).
    pub checks: Option<Checks>,
    /// Speeds (`None`: not measured).
    pub speeds: Option<Speeds>,
}

fn gib(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{} GiB", b >> 30)
    } else {
        format!("{} MiB", b >> 20)
    }
}

fn is_geforce_like(g: &GpuPci) -> bool {
    // Data-centre parts (A100 0x20xx, H100/H200 0x23xx, ...) have P2P on in the
    // stock driver; GeForce/RTX cards (0x22xx, 0x24xx-0x28xx, 0x2bxx) do not.
    let id = g.device_id.as_deref().and_then(|d| u16::from_str_radix(d.trim_start_matches("0x"), 16).ok());
    matches!(id, Some(0x2200..=0x22ff) | Some(0x2400..=0x28ff) | Some(0x2b00..=0x2bff) | Some(0x1b00..=0x1fff))
}

/// The system facts' findings for the pair `a` -> `b`. `nvlink`: P2P goes
/// over NVLink, so PCIe matters only as a fallback.
pub fn system_findings(facts: &SystemFacts, a: &GpuPci, b: &GpuPci, vram: [Option<u64>; 2], nvlink: bool) -> Vec<Finding> {
    let mut out = Vec::new();
    let pcie = |s: Severity| if nvlink { Severity::Info } else { s };
    let nvl_note = if nvlink { " (P2P between these GPUs goes over NVLink, so this matters only for staged copies)" } else { "" };
    // IOMMU.
    for g in [a, b] {
        let group = g.iommu_group.and_then(|id| facts.iommu.groups.iter().find(|x| x.id == id)).or_else(|| facts.iommu.group_of(&g.bdf));
        if let Some(group) = group.filter(|x| x.translating()) {
            let kind = group.kind.clone().unwrap_or_default();
            let intel = facts.iommu.units.iter().any(|u| u.starts_with("dmar"));
            let fix = if facts.cmdline.passthrough() {
                format!("iommu=pt is on the command line but group {} is still {kind}: check `cat /sys/kernel/iommu_groups/{}/type`; with the GPU's driver unbound, `echo identity > /sys/kernel/iommu_groups/{}/type`, or disable the IOMMU in the firmware setup", group.id, group.id, group.id)
            } else if intel {
                "boot with iommu=pt (keep intel_iommu=on if you need VFIO): add it to GRUB_CMDLINE_LINUX in /etc/default/grub, run update-grub, reboot".to_string()
            } else {
                "boot with iommu=pt: add it to GRUB_CMDLINE_LINUX in /etc/default/grub, run update-grub, reboot".to_string()
            };
            out.push(finding(
                pcie(Severity::Warn),
                format!(
                    "IOMMU is translating ({kind}) on group {} ({}): peer writes through it are dropped or zero-filled on many boards{nvl_note}",
                    group.id, g.bdf
                ),
                Some(fix),
            ));
        }
    }
    // Path.
    let p = pair_path(a, b);
    for br in &p.bridges_between {
        let Some(acs) = &br.acs else { continue };
        if acs.redirects() {
            let below_switch = matches!(p.path, PciPath::SameSwitch);
            let (sev, why) = if below_switch {
                (pcie(Severity::Warn), "redirects peer traffic between the GPUs up through the root complex (slower, and subject to the IOMMU)")
            } else {
                (Severity::Info, "is on, but the GPUs' traffic crosses the root complex anyway")
            };
            out.push(finding(
                sev,
                format!("ACS {} on bridge {} {why}{nvl_note}", acs.control_names().join("+"), br.bdf),
                below_switch.then(|| format!("as root, each boot: `setpci -s {} ECAP_ACS+6.w=0000` (or turn off ACS in the firmware setup; with the IOMMU on, the kernel turns it back on: boot with iommu=pt or without the IOMMU)", br.bdf)),
            ));
        }
        if let AcsState::Unreadable(why) = acs {
            out.push(finding(
                Severity::Info,
                format!("ACS control of bridge {} is unreadable: {why}", br.bdf),
                Some("run `sudo cuda-peer doctor` to read it".into()),
            ));
        }
    }
    if let Some(over) = &facts.cmdline.pcie_acs_override {
        out.push(finding(
            Severity::Info,
            format!("pcie_acs_override={over} is set: it only splits IOMMU groups and does not turn ACS off in the bridges"),
            None,
        ));
    }
    match p.path {
        PciPath::CrossSocket => out.push(finding(
            pcie(Severity::Warn),
            format!(
                "the GPUs are on different CPU sockets (NUMA nodes {} and {}): PCIe peer traffic crosses the CPU interconnect, often slower than host staging or not allowed{nvl_note}",
                a.numa_node.unwrap_or(-1),
                b.numa_node.unwrap_or(-1)
            ),
            Some("put both GPUs in slots of one socket (see your board manual's slot-to-CPU map)".into()),
        )),
        PciPath::Unknown => out.push(finding(Severity::Info, "the PCIe path between the GPUs could not be read from sysfs", None)),
        _ => {}
    }
    // Per GPU: BAR1, Resizable BAR, link.
    for (g, mem) in [(a, vram[0]), (b, vram[1])] {
        match (g.bar1_bytes, mem) {
            (Some(bar), Some(mem)) if bar < mem => out.push(finding(
                pcie(Severity::Warn),
                format!("BAR1 of {} is {} on a {} card: peers can map only that window of its memory (patched P2P drivers need BAR1 as large as VRAM){nvl_note}", g.bdf, gib(bar), gib(mem)),
                Some(match &g.rebar {
                    RebarState::Present(_) => "enable 'Above 4G Decoding' and 'Re-Size BAR Support' in the firmware setup (the card supports Resizable BAR)".into(),
                    _ => "enable 'Above 4G Decoding' and 'Re-Size BAR Support' in the firmware setup (a firmware or VBIOS update may be needed for Resizable BAR)".into(),
                }),
            )),
            (Some(bar), None) if bar <= 256 << 20 => out.push(finding(
                Severity::Info,
                format!("BAR1 of {} is {} (device memory unknown without the driver; on a large card this is too small for P2P)", g.bdf, gib(bar)),
                Some("enable 'Above 4G Decoding' and 'Re-Size BAR Support' in the firmware setup".into()),
            )),
            _ => {}
        }
        if let (Some(w), Some(max)) = (g.link_width, g.max_link_width) {
            if w < max {
                out.push(finding(
                    pcie(Severity::Warn),
                    format!("{} trained its PCIe link at x{w} of x{max} (a chipset slot, riser, bifurcation or dirty contacts){nvl_note}", g.bdf),
                    Some("move the card to a CPU-attached x16 slot; reseat it and check risers".into()),
                ));
            }
        }
        if let (Some(s), Some(max)) = (&g.link_speed, &g.max_link_speed) {
            if s != max {
                out.push(finding(
                    Severity::Info,
                    format!(
                        "{} runs its link at {s} of {max}: GPUs lower their link speed when idle; it matters only if it stays low under load",
                        g.bdf
                    ),
                    None,
                ));
            }
        }
    }
    out
}

/// Findings about the machine, not about a pair.
pub fn machine_findings(facts: &SystemFacts) -> Vec<Finding> {
    let mut out = Vec::new();
    if let Some(vm) = &facts.env.virtual_machine {
        out.push(finding(
            Severity::Info,
            format!("this looks like a virtual machine ({vm}): the driver sees the hypervisor's PCIe topology, and P2P also depends on the host's IOMMU and ACS settings"),
            Some("if P2P fails, ask for GPUs passed through as one PCIe switch, or run on the host".into()),
        ));
    }
    if let Some(c) = &facts.env.container {
        out.push(finding(
            Severity::Info,
            format!("running in a container ({c}): sysfs facts are the host's, as far as the container can see them"),
            None,
        ));
    }
    if facts.driver.open_module == Some(false) && facts.gpus.iter().any(is_geforce_like) {
        out.push(finding(
            Severity::Warn,
            format!("the proprietary NVIDIA module ({}) is loaded: it turns P2P off on GeForce cards", facts.driver.version.as_deref().unwrap_or("?")),
            Some("to use P2P on GeForce cards, install a matching build of the open kernel modules with the P2P patch (e.g. tinygrad/open-gpu-kernel-modules), with Resizable BAR on and the IOMMU off or in passthrough".into()),
        ));
    }
    if facts.driver.version_line.is_none() {
        out.push(finding(Severity::Info, "no NVIDIA kernel module is loaded (/proc/driver/nvidia/version is missing)", None));
    }
    out
}

/// Judges one ordered pair.
pub fn judge(facts: &SystemFacts, input: &PairInput) -> PairVerdict {
    let a = facts.gpu(&input.from_bdf).cloned().unwrap_or_else(|| empty_gpu(&input.from_bdf));
    let b = facts.gpu(&input.to_bdf).cloned().unwrap_or_else(|| empty_gpu(&input.to_bdf));
    let nvlink = input.driver.as_ref().is_some_and(DriverPair::nvlink);
    let path = pair_path(&a, &b);
    let mut findings = system_findings(facts, &a, &b, input.vram, nvlink);
    let (level, use_path, summary) = decide(input, &mut findings);
    findings.sort_by_key(|f| std::cmp::Reverse(f.severity));
    PairVerdict {
        from: input.from,
        to: input.to,
        from_bdf: a.bdf.clone(),
        to_bdf: b.bdf.clone(),
        pci_path: path.path,
        common_ancestor: path.common_ancestor,
        level,
        use_path,
        summary,
        findings,
    }
}

fn empty_gpu(bdf: &str) -> GpuPci {
    GpuPci {
        bdf: crate::sysfs::normalize_bdf(bdf),
        device_id: None,
        host_bridge: None,
        bridges: Vec::new(),
        numa_node: None,
        link_speed: None,
        max_link_speed: None,
        link_width: None,
        max_link_width: None,
        bar1_bytes: None,
        rebar: RebarState::Absent,
        iommu_group: None,
    }
}

fn suspects(findings: &[Finding]) -> String {
    // The system's warnings; the problems are the verdict itself.
    let s: Vec<&str> = findings.iter().filter(|f| f.severity == Severity::Warn).map(|f| f.what.as_str()).collect();
    if s.is_empty() {
        String::new()
    } else {
        format!("; likely causes: {}", s.join("; "))
    }
}

/// A problem that takes a pair off P2P: its finding (`what`, `fix`), and the
/// verdict, summarised from `why`: staged, or nothing usable where the
/// staged path failed too.
fn off_p2p(findings: &mut Vec<Finding>, staged_ok: bool, what: String, why: String, fix: &str) -> (Level, UsePath, String) {
    findings.push(finding(Severity::Problem, what, Some(fix.into())));
    let (level, path, summary) = if staged_ok {
        (Level::Degraded, UsePath::Staged, format!("{why}: staged through host memory is used"))
    } else {
        (Level::Unusable, UsePath::None, format!("{why}, and the staged path failed too"))
    };
    (level, path, summary + &suspects(findings))
}

fn decide(input: &PairInput, findings: &mut Vec<Finding>) -> (Level, UsePath, String) {
    let Some(drv) = &input.driver else {
        return (Level::Untested, UsePath::Unknown, "not tested: no usable CUDA driver or GPU".into());
    };
    if let Some(n) = drv.nvml_p2p.iter().filter(|(_, v)| v != "Ok").map(|(k, v)| format!("{k}: {v}")).reduce(|x, y| x + ", " + &y) {
        findings.push(finding(Severity::Info, format!("NVML P2P status: {n}"), None));
    }
    let staged_ok = input.checks.as_ref().is_none_or(|c| !c.staged.failed());
    if !(drv.can_access_peer && drv.can_access_peer_back) {
        let why = "the driver reports no peer access between these GPUs".to_string();
        let reasons = drv.nvml_p2p.iter().filter(|(k, v)| k == "read" && v != "Ok").map(|(_, v)| v.clone()).next();
        let fix = match reasons.as_deref() {
            Some("ChipsetNotSupported") | Some("IohTopologyNotSupported") => "the chipset or CPU topology does not allow P2P: put both GPUs under one PCIe switch or one CPU root complex",
            Some("GpuNotSupported") | Some("DisabledByRegkey") => "the driver disables P2P for this GPU model: on GeForce cards, the open kernel modules with the P2P patch turn it on (with Resizable BAR on and the IOMMU off or in passthrough)",
            _ => "check the findings below; on GeForce cards the stock driver disables P2P",
        };
        return off_p2p(findings, staged_ok, why.clone(), why, fix);
    }
    let Some(checks) = &input.checks else {
        return (Level::Untested, UsePath::Unknown, "the driver reports peer access; functional checks not run".into());
    };
    if checks.copy_engine.failed() {
        let what = match &checks.copy_engine {
            Outcome::WrongData(d) => format!("copy-engine peer copies deliver wrong data ({d})"),
            Outcome::Timeout => "copy-engine peer copies hang".into(),
            Outcome::Error(e) => format!("copy-engine peer copies fail: {e}"),
            _ => String::new(),
        };
        let why = format!("the driver claims P2P but {what}");
        return off_p2p(
            findings,
            staged_ok,
            what,
            why,
            "fix the causes listed; until then cuda-peer's Auto links fall back to staged copies by themselves",
        );
    }
    // The driver said yes (above), so a check that could not even open P2P
    // is the driver's claim failing, not a pass.
    if let Outcome::Skipped(why) = &checks.copy_engine {
        let what = format!("the driver reports peer access, but P2P could not be opened ({why})");
        let fix = "the driver's peer-access report is wrong on this system (look at the findings below); cuda-peer's Auto links fall back to staged copies by themselves";
        return off_p2p(findings, staged_ok, what.clone(), what, fix);
    }
    let sm: Vec<String> = [("mesh (SM peer loads and stores)", &checks.mesh), ("one-shot (SM peer stores, system-scope flags)", &checks.oneshot)]
        .iter()
        .filter(|(_, o)| *o != &Outcome::Pass)
        .map(|(n, o)| {
            format!(
                "{n}: {}",
                match o {
                    Outcome::WrongData(d) => format!("wrong data, {d}"),
                    Outcome::Timeout => "timed out".into(),
                    Outcome::Error(e) => e.clone(),
                    Outcome::Skipped(why) => format!("not run ({why})"),
                    Outcome::Pass => String::new(),
                }
            )
        })
        .collect();
    if !sm.is_empty() {
        let what = format!("copy-engine P2P passes but SM peer access fails ({})", sm.join("; "));
        let fix = "cuda-peer checks its fused kernels when a group is created and runs the copy-engine ring where they fail; with this verdict cached it stages the pair. Other libraries' custom all-reduce kernels (SM peer stores) can hang or return wrong data on this pair until the cause is fixed";
        return off_p2p(findings, staged_ok, what.clone(), what, fix);
    }
    if let Some(sp) = &input.speeds {
        if let Some(sample) = speed_sample(sp) {
            let (p2p, st) = (sample.p2p_gbs, sample.staged_gbs);
            // The rule the library applies to the cached speeds too.
            let faster = cuda_peer::verdict::faster_path(&sample);
            if faster == Some(cuda_peer::verdict::CachedPath::Staged) {
                findings.push(finding(
                    Severity::Problem,
                    format!("P2P works but is slower than host staging on this path ({p2p:.1} against {st:.1} GB/s)"),
                    Some("use PathPolicy::StagedOnly for this pair; the findings below say why the path is slow".into()),
                ));
                let s = format!("P2P works but is slower than host staging on this path ({p2p:.1} against {st:.1} GB/s): staged is used");
                return (Level::Degraded, UsePath::Staged, s + &suspects(findings));
            }
            if faster.is_none() {
                let s = format!(
                    "P2P verified (copy engine and SM loads/stores), {p2p:.1} GB/s against {st:.1} GB/s staged at {} bytes (too small a copy to compare the paths)",
                    sample.bytes
                );
                return (Level::Ok, UsePath::P2p, s);
            }
            return (Level::Ok, UsePath::P2p, format!("P2P verified (copy engine and SM loads/stores), {p2p:.1} GB/s against {st:.1} GB/s staged"));
        }
    }
    (Level::Ok, UsePath::P2p, "P2P verified (copy engine and SM loads/stores); speed not measured".into())
}

/// The process exit status for a set of verdicts: 0 when every pair is
/// usable at full speed, 1 when something is degraded, 2 when nothing is
/// usable or nothing could be tested.
pub fn exit_code(verdicts: &[PairVerdict], have_gpu: bool) -> i32 {
    if !have_gpu || (!verdicts.is_empty() && verdicts.iter().all(|v| matches!(v.level, Level::Unusable | Level::Untested))) {
        2
    } else if verdicts.iter().all(|v| v.level == Level::Ok) {
        0
    } else {
        1
    }
}
