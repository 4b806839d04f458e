//! System facts from sysfs and procfs. Every reader takes the root of the
//! file system it reads (`/` on a real machine, a fixture tree in tests) and
//! never fails: what it cannot read is `None`, an empty list, or a note.

use serde::{Deserialize, Serialize};
use std::fs;
use std::path::{Path, PathBuf};

/// NVIDIA's PCI vendor id.
pub const NVIDIA_VENDOR: u16 = 0x10de;
/// PCI extended capability id of Access Control Services.
pub const ECAP_ACS: u16 = 0x000d;
/// PCI extended capability id of Resizable BAR.
pub const ECAP_REBAR: u16 = 0x0015;

fn read(root: &Path, rel: &str) -> Option<String> {
    fs::read_to_string(root.join(rel.trim_start_matches('/'))).ok().map(|s| s.trim().to_string())
}

fn read_at(dir: &Path, name: &str) -> Option<String> {
    fs::read_to_string(dir.join(name)).ok().map(|s| s.trim().to_string())
}

/// Normalises a PCI bus id (`00000000:19:00.0`, `0000:19:00.0`, `19:00.0`,
/// any case) to sysfs' form, `0000:19:00.0`.
pub fn normalize_bdf(id: &str) -> String {
    // One spelling for the doctor and the library's verdict cache.
    cuda_peer::verdict::normalize_bus_id(id)
}

/// What the kernel command line says about the IOMMU and ACS.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CmdlineFacts {
    /// The whole command line, as read.
    pub raw: String,
    /// `iommu=` (e.g. `pt`).
    pub iommu: Option<String>,
    /// `intel_iommu=` (e.g. `on`).
    pub intel_iommu: Option<String>,
    /// `amd_iommu=` (e.g. `on`, `off`).
    pub amd_iommu: Option<String>,
    /// `pcie_acs_override=` (from the out-of-tree ACS override patch).
    pub pcie_acs_override: Option<String>,
}

impl CmdlineFacts {
    /// Parses a kernel command line (the last of repeated keys wins, as in the kernel).
    pub fn parse(raw: &str) -> Self {
        let mut c = CmdlineFacts { raw: raw.trim().to_string(), ..Default::default() };
        for word in raw.split_whitespace() {
            let Some((k, v)) = word.split_once('=') else {
                continue;
            };
            let v = Some(v.to_string());
            match k {
                "iommu" => c.iommu = v,
                "intel_iommu" => c.intel_iommu = v,
                "amd_iommu" => c.amd_iommu = v,
                "pcie_acs_override" => c.pcie_acs_override = v,
                _ => {}
            }
        }
        c
    }

    /// Whether the command line puts the IOMMU in passthrough (`iommu=pt`).
    pub fn passthrough(&self) -> bool {
        self.iommu.as_deref().is_some_and(|v| v.split(',').any(|x| x == "pt"))
    }
}

/// One IOMMU group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IommuGroup {
    /// Group number.
    pub id: u32,
    /// Its domain type (`identity`, `DMA`, `DMA-FQ`, `blocked`, ...), if readable.
    pub kind: Option<String>,
    /// The PCI devices in it.
    pub devices: Vec<String>,
}

impl IommuGroup {
    /// Whether DMA from the group's devices goes through IOMMU translation
    /// (`DMA` or `DMA-FQ`), which drops or zero-fills peer writes on many
    /// consumer platforms.
    pub fn translating(&self) -> bool {
        matches!(self.kind.as_deref(), Some(k) if k.starts_with("DMA"))
    }
}

/// The IOMMU as sysfs shows it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IommuFacts {
    /// IOMMU units (`/sys/class/iommu/*`, e.g. `dmar0`, `ivhd0`).
    pub units: Vec<String>,
    /// Every group, by number.
    pub groups: Vec<IommuGroup>,
}

impl IommuFacts {
    /// Reads `/sys/class/iommu` and `/sys/kernel/iommu_groups`.
    pub fn read(root: &Path) -> Self {
        let mut units = list_dir(&root.join("sys/class/iommu"));
        units.sort();
        let mut groups: Vec<IommuGroup> = list_dir(&root.join("sys/kernel/iommu_groups"))
            .into_iter()
            .filter_map(|name| {
                let id = name.parse().ok()?;
                let dir = root.join("sys/kernel/iommu_groups").join(&name);
                let mut devices = list_dir(&dir.join("devices"));
                devices.sort();
                Some(IommuGroup { id, kind: read_at(&dir, "type"), devices })
            })
            .collect();
        groups.sort_by_key(|g| g.id);
        IommuFacts { units, groups }
    }

    /// The group holding PCI device `bdf`.
    pub fn group_of(&self, bdf: &str) -> Option<&IommuGroup> {
        self.groups.iter().find(|g| g.devices.iter().any(|d| d == bdf))
    }

    /// Whether an IOMMU is present and on.
    pub fn enabled(&self) -> bool {
        !self.units.is_empty() || !self.groups.is_empty()
    }
}

fn list_dir(dir: &Path) -> Vec<String> {
    fs::read_dir(dir).map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect()).unwrap_or_default()
}

/// The ACS control register of one bridge.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum AcsState {
    /// The config space past 256 bytes could not be read (it needs root).
    Unreadable(String),
    /// The bridge has no ACS capability.
    Absent,
    /// ACS capability and control registers.
    Present {
        /// Capability register (what the bridge supports).
        capability: u16,
        /// Control register (what is on).
        control: u16,
    },
}

impl AcsState {
    /// Whether peer requests or completions are redirected upstream
    /// (P2P Request Redirect, bit 2, or Completion Redirect, bit 3) or
    /// blocked by egress control (bit 5).
    pub fn redirects(&self) -> bool {
        matches!(self, AcsState::Present { control, .. } if control & 0b10_1100 != 0)
    }

    /// The control bits that are on, by name.
    pub fn control_names(&self) -> Vec<&'static str> {
        const NAMES: [&str; 7] = ["SrcValid", "TransBlk", "ReqRedir", "CmpltRedir", "UpstreamFwd", "EgressCtrl", "DirectTrans"];
        match self {
            AcsState::Present { control, .. } => (0..7).filter(|b| control & (1 << b) != 0).map(|b| NAMES[b]).collect(),
            _ => Vec::new(),
        }
    }
}

/// Walks the PCI extended capability list of a config space dump and
/// returns the offset of capability `id`. `None` if absent; `Err` if the
/// dump stops before the extended space (an unprivileged read).
pub fn find_ext_cap(config: &[u8], id: u16) -> Result<Option<usize>, String> {
    if config.len() < 0x104 {
        return Err(format!("only {} bytes of config space are readable (the extended space needs root)", config.len()));
    }
    let mut off = 0x100usize;
    for _ in 0..512 {
        let Some(h) = config.get(off..off + 4) else {
            return Ok(None);
        };
        let header = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
        if header == 0 || header == 0xffff_ffff {
            return Ok(None);
        }
        if (header & 0xffff) as u16 == id {
            return Ok(Some(off));
        }
        let next = (header >> 20) as usize & 0xffc;
        if next < 0x100 || next <= off {
            return Ok(None);
        }
        off = next;
    }
    Ok(None)
}

fn u16_at(config: &[u8], off: usize) -> Option<u16> {
    config.get(off..off + 2).map(|b| u16::from_le_bytes([b[0], b[1]]))
}

fn u32_at(config: &[u8], off: usize) -> Option<u32> {
    config.get(off..off + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Reads the ACS capability of a config space dump.
pub fn parse_acs(config: &[u8]) -> AcsState {
    match find_ext_cap(config, ECAP_ACS) {
        Err(e) => AcsState::Unreadable(e),
        Ok(None) => AcsState::Absent,
        Ok(Some(off)) => match (u16_at(config, off + 4), u16_at(config, off + 6)) {
            (Some(capability), Some(control)) => AcsState::Present { capability, control },
            _ => AcsState::Unreadable("ACS capability cut short".into()),
        },
    }
}

/// Resizable BAR as the config space shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RebarState {
    /// The extended space could not be read (needs root).
    Unreadable(String),
    /// The device has no Resizable BAR capability.
    Absent,
    /// Resizable BAR capability; per resizable BAR: (BAR index, current
    /// size in bytes, largest supported size in bytes).
    Present(Vec<(u8, u64, u64)>),
}

/// Reads the Resizable BAR capability of a config space dump.
pub fn parse_rebar(config: &[u8]) -> RebarState {
    let off = match find_ext_cap(config, ECAP_REBAR) {
        Err(e) => return RebarState::Unreadable(e),
        Ok(None) => return RebarState::Absent,
        Ok(Some(off)) => off,
    };
    let mut bars = Vec::new();
    let Some(ctrl0) = u32_at(config, off + 8) else {
        return RebarState::Unreadable("Resizable BAR capability cut short".into());
    };
    let count = ((ctrl0 >> 5) & 7).clamp(1, 6) as usize;
    for i in 0..count {
        let (Some(cap), Some(ctrl)) = (u32_at(config, off + 4 + 8 * i), u32_at(config, off + 8 + 8 * i)) else {
            break;
        };
        let index = (ctrl & 7) as u8;
        // A size field past 2^63 bytes (reserved encodings) reads as the largest.
        let current = 1u64.checked_shl(20 + ((ctrl >> 8) & 0x3f)).unwrap_or(1 << 63);
        // Capability bits 4..31: sizes 1 MiB << (bit - 4) supported.
        let largest = (4..32).rev().find(|b| cap & (1 << b) != 0).map(|b| 1u64 << (20 + b - 4)).unwrap_or(0);
        bars.push((index, current, largest));
    }
    RebarState::Present(bars)
}

/// Sizes of a device's memory regions from its sysfs `resource` file (one
/// `start end flags` line per region, BAR 0 first), in bytes; 0 where unused.
pub fn parse_resource(text: &str) -> Vec<u64> {
    text.lines()
        .map(|l| {
            let n: Vec<u64> = l.split_whitespace().filter_map(|w| u64::from_str_radix(w.trim_start_matches("0x"), 16).ok()).collect();
            match n.as_slice() {
                [start, end, ..] if *end > *start => (end - start).saturating_add(1),
                _ => 0,
            }
        })
        .collect()
}

/// One PCI device on a GPU's path: the GPU itself or a bridge above it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PciNode {
    /// Bus id, e.g. `0000:00:01.1`.
    pub bdf: String,
    /// ACS state (bridges only; `None` on the GPU).
    pub acs: Option<AcsState>,
}

/// A GPU's PCI facts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuPci {
    /// Bus id, `0000:19:00.0`.
    pub bdf: String,
    /// PCI device id (`0x2684` is an RTX 4090).
    pub device_id: Option<String>,
    /// The host bridge (root bus) it hangs off, e.g. `pci0000:00`.
    pub host_bridge: Option<String>,
    /// Bridges from the root port down to the GPU's parent, in order.
    pub bridges: Vec<PciNode>,
    /// NUMA node (`None` when the kernel reports -1 or nothing).
    pub numa_node: Option<i32>,
    /// `current_link_speed`, e.g. `16.0 GT/s PCIe`.
    pub link_speed: Option<String>,
    /// `max_link_speed`.
    pub max_link_speed: Option<String>,
    /// `current_link_width`.
    pub link_width: Option<u32>,
    /// `max_link_width`.
    pub max_link_width: Option<u32>,
    /// Size of BAR1 (the VRAM aperture peers map), bytes.
    pub bar1_bytes: Option<u64>,
    /// Resizable BAR.
    pub rebar: RebarState,
    /// IOMMU group number.
    pub iommu_group: Option<u32>,
}

/// The bus ids of every NVIDIA display or 3D controller sysfs lists.
pub fn nvidia_gpus(root: &Path) -> Vec<String> {
    let base = root.join("sys/bus/pci/devices");
    let mut out: Vec<String> = list_dir(&base)
        .into_iter()
        .filter(|bdf| {
            let dir = base.join(bdf);
            let vendor = read_at(&dir, "vendor").and_then(|v| u16::from_str_radix(v.trim_start_matches("0x"), 16).ok());
            let class = read_at(&dir, "class").and_then(|v| u32::from_str_radix(v.trim_start_matches("0x"), 16).ok());
            vendor == Some(NVIDIA_VENDOR) && class.is_some_and(|c| c >> 16 == 0x03)
        })
        .collect();
    out.sort();
    out
}

fn is_bdf(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12 && b[4] == b':' && b[7] == b':' && b[10] == b'.'
}

/// The chain of a PCI device's ancestors under `root`: (host bridge,
/// bridges top-down), from the target of `/sys/bus/pci/devices/<bdf>`.
pub fn pci_chain(root: &Path, bdf: &str) -> Option<(String, Vec<String>)> {
    let link = root.join("sys/bus/pci/devices").join(bdf);
    let real: PathBuf = fs::canonicalize(&link).ok()?;
    let comps: Vec<String> = real.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
    let host = comps.iter().position(|c| c.starts_with("pci") && c.contains(':'))?;
    let chain: Vec<String> = comps[host + 1..].iter().filter(|c| is_bdf(c)).cloned().collect();
    let (last, bridges) = chain.split_last()?;
    if last != bdf {
        return None;
    }
    Some((comps[host].clone(), bridges.to_vec()))
}

fn config_of(root: &Path, bdf: &str) -> Option<Vec<u8>> {
    fs::read(root.join("sys/bus/pci/devices").join(bdf).join("config")).ok()
}

/// Reads a GPU's PCI facts.
pub fn read_gpu(root: &Path, bdf: &str) -> GpuPci {
    let dir = root.join("sys/bus/pci/devices").join(bdf);
    let (host_bridge, chain) = match pci_chain(root, bdf) {
        Some((h, c)) => (Some(h), c),
        None => (None, Vec::new()),
    };
    let bridges = chain
        .into_iter()
        .map(|b| {
            let acs = match config_of(root, &b) {
                Some(cfg) => parse_acs(&cfg),
                None => AcsState::Unreadable("no config file".into()),
            };
            PciNode { bdf: b, acs: Some(acs) }
        })
        .collect();
    let num = |name: &str| read_at(&dir, name).and_then(|v| v.parse::<i64>().ok());
    let rebar = match config_of(root, bdf) {
        Some(cfg) => parse_rebar(&cfg),
        None => RebarState::Unreadable("no config file".into()),
    };
    let iommu_group = fs::read_link(dir.join("iommu_group")).ok().and_then(|p| p.file_name().and_then(|n| n.to_str().and_then(|s| s.parse().ok())));
    GpuPci {
        bdf: bdf.to_string(),
        device_id: read_at(&dir, "device"),
        host_bridge,
        bridges,
        numa_node: num("numa_node").filter(|&n| n >= 0).map(|n| n as i32),
        link_speed: read_at(&dir, "current_link_speed"),
        max_link_speed: read_at(&dir, "max_link_speed"),
        link_width: num("current_link_width").map(|n| n as u32),
        max_link_width: num("max_link_width").map(|n| n as u32),
        bar1_bytes: read_at(&dir, "resource").map(|t| parse_resource(&t)).and_then(|r| r.get(1).copied()).filter(|&b| b > 0),
        rebar,
        iommu_group,
    }
}

/// How two GPUs are connected over PCIe, in `nvidia-smi topo -m`'s terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PciPath {
    /// Below one PCIe switch (through at most one bridge each: PIX) or
    /// several switches without a host bridge (PXB).
    SameSwitch,
    /// Below one root port (PXB through the root port).
    SameRootPort,
    /// Through one host bridge (PHB).
    SameHostBridge,
    /// Through several host bridges of one NUMA node (NODE).
    SameNumaNode,
    /// Across the CPU interconnect between NUMA nodes or sockets (SYS).
    CrossSocket,
    /// The sysfs layout could not be read.
    Unknown,
}

impl PciPath {
    /// nvidia-smi's abbreviation.
    pub fn abbrev(self) -> &'static str {
        match self {
            PciPath::SameSwitch => "PIX/PXB",
            PciPath::SameRootPort => "PXB",
            PciPath::SameHostBridge => "PHB",
            PciPath::SameNumaNode => "NODE",
            PciPath::CrossSocket => "SYS",
            PciPath::Unknown => "?",
        }
    }
}

/// The PCIe relation of two GPUs: the path class, the common ancestor and
/// the bridges that peer traffic passes below it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PairPath {
    /// Path class.
    pub path: PciPath,
    /// The lowest bridge (or host bridge) above both, if any.
    pub common_ancestor: Option<String>,
    /// The bridges below the common ancestor on either side, which peer
    /// traffic passes (and whose ACS can redirect it), with their ACS state.
    pub bridges_between: Vec<PciNode>,
}

/// Classifies the path between two GPUs.
pub fn pair_path(a: &GpuPci, b: &GpuPci) -> PairPath {
    let (Some(ha), Some(hb)) = (&a.host_bridge, &b.host_bridge) else {
        return PairPath { path: PciPath::Unknown, common_ancestor: None, bridges_between: Vec::new() };
    };
    let common = a.bridges.iter().zip(&b.bridges).take_while(|(x, y)| x.bdf == y.bdf).count();
    let between: Vec<PciNode> = a.bridges[common..].iter().chain(&b.bridges[common..]).cloned().collect();
    if ha != hb {
        let path = match (a.numa_node, b.numa_node) {
            (Some(x), Some(y)) if x != y => PciPath::CrossSocket,
            (Some(_), Some(_)) => PciPath::SameNumaNode,
            _ => {
                // No NUMA information: root buses on different domains or
                // far apart are likely on different sockets; say unknown.
                PciPath::Unknown
            }
        };
        return PairPath { path, common_ancestor: None, bridges_between: a.bridges.iter().chain(&b.bridges).cloned().collect() };
    }
    let (path, ancestor) = match common {
        0 => (PciPath::SameHostBridge, ha.clone()),
        1 => (PciPath::SameRootPort, a.bridges[0].bdf.clone()),
        n => (PciPath::SameSwitch, a.bridges[n - 1].bdf.clone()),
    };
    PairPath { path, common_ancestor: Some(ancestor), bridges_between: between }
}

/// The NVIDIA kernel module.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverFacts {
    /// First line of `/proc/driver/nvidia/version`.
    pub version_line: Option<String>,
    /// Driver version, e.g. `550.54.14`.
    pub version: Option<String>,
    /// Whether it is the open kernel module (`Some(false)`: proprietary).
    pub open_module: Option<bool>,
    /// `/sys/module/nvidia/taint`.
    pub taint: Option<String>,
}

impl DriverFacts {
    /// Reads `/proc/driver/nvidia/version` and `/sys/module/nvidia/{version,taint}`.
    pub fn read(root: &Path) -> Self {
        let line = read(root, "proc/driver/nvidia/version").and_then(|t| t.lines().next().map(str::to_string));
        let version = read(root, "sys/module/nvidia/version").or_else(|| {
            line.as_deref().and_then(|l| {
                l.split_whitespace().find(|w| w.chars().next().is_some_and(|c| c.is_ascii_digit()) && w.contains('.')).map(str::to_string)
            })
        });
        let taint = read(root, "sys/module/nvidia/taint");
        let open_module = match (&line, &taint) {
            (Some(l), _) => Some(l.contains("Open Kernel Module")),
            // Proprietary modules taint the kernel with P.
            (None, Some(t)) => Some(!t.contains('P')),
            _ => None,
        };
        DriverFacts { version_line: line, version, open_module, taint }
    }
}

/// Hints that this is a virtual machine or a container.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvFacts {
    /// `/.dockerenv` or `/run/.containerenv` exists, or PID 1's cgroup names a container runtime.
    pub container: Option<String>,
    /// The CPU's hypervisor flag, or a DMI vendor of a known hypervisor.
    pub virtual_machine: Option<String>,
    /// `/sys/class/dmi/id/sys_vendor`.
    pub sys_vendor: Option<String>,
}

impl EnvFacts {
    /// Reads the hints.
    pub fn read(root: &Path) -> Self {
        let container = if root.join(".dockerenv").exists() {
            Some("/.dockerenv exists".to_string())
        } else if root.join("run/.containerenv").exists() {
            Some("/run/.containerenv exists (podman)".to_string())
        } else {
            read(root, "proc/1/cgroup").and_then(|c| {
                ["docker", "kubepods", "containerd", "lxc", "libpod"].iter().find(|k| c.contains(*k)).map(|k| format!("PID 1's cgroup mentions {k}"))
            })
        };
        let sys_vendor = read(root, "sys/class/dmi/id/sys_vendor");
        let hv_flag =
            read(root, "proc/cpuinfo").is_some_and(|c| c.lines().any(|l| l.starts_with("flags") && l.split_whitespace().any(|w| w == "hypervisor")));
        let known = ["QEMU", "KVM", "VMware", "Xen", "Microsoft Corporation", "innotek", "Amazon EC2", "Google"];
        let virtual_machine = match &sys_vendor {
            Some(v) if known.iter().any(|k| v.contains(k)) => Some(format!("DMI vendor {v}")),
            _ if hv_flag => Some("the CPU reports the hypervisor flag".to_string()),
            _ => None,
        };
        EnvFacts { container, virtual_machine, sys_vendor }
    }
}

/// Everything read from the file system.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SystemFacts {
    /// The root the facts were read under.
    pub root: String,
    /// The kernel command line.
    pub cmdline: CmdlineFacts,
    /// The IOMMU.
    pub iommu: IommuFacts,
    /// The NVIDIA kernel module.
    pub driver: DriverFacts,
    /// VM / container hints.
    pub env: EnvFacts,
    /// `/proc/sys/kernel/random/boot_id`.
    pub boot_id: Option<String>,
    /// NVIDIA GPUs on the PCI bus, in bus order.
    pub gpus: Vec<GpuPci>,
}

impl SystemFacts {
    /// Reads every fact under `root`, for the GPUs `bdfs` (all NVIDIA GPUs
    /// in sysfs when empty).
    pub fn read(root: &Path, bdfs: &[String]) -> Self {
        let list = if bdfs.is_empty() { nvidia_gpus(root) } else { bdfs.iter().map(|b| normalize_bdf(b)).collect() };
        SystemFacts {
            root: root.display().to_string(),
            cmdline: CmdlineFacts::parse(&read(root, "proc/cmdline").unwrap_or_default()),
            iommu: IommuFacts::read(root),
            driver: DriverFacts::read(root),
            env: EnvFacts::read(root),
            boot_id: read(root, "proc/sys/kernel/random/boot_id"),
            gpus: list.iter().map(|b| read_gpu(root, b)).collect(),
        }
    }

    /// The GPU with bus id `bdf`.
    pub fn gpu(&self, bdf: &str) -> Option<&GpuPci> {
        let bdf = normalize_bdf(bdf);
        self.gpus.iter().find(|g| g.bdf == bdf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bdfs_normalise() {
        assert_eq!(normalize_bdf("00000000:19:00.0"), "0000:19:00.0");
        assert_eq!(normalize_bdf("0000:1A:00.0"), "0000:1a:00.0");
        assert_eq!(normalize_bdf("1a:00.0"), "0000:1a:00.0");
    }

    #[test]
    fn cmdline_keys() {
        let c = CmdlineFacts::parse("BOOT_IMAGE=/vmlinuz ro quiet intel_iommu=on iommu=pt pcie_acs_override=downstream,multifunction");
        assert_eq!(c.intel_iommu.as_deref(), Some("on"));
        assert!(c.passthrough());
        assert_eq!(c.pcie_acs_override.as_deref(), Some("downstream,multifunction"));
        assert!(!CmdlineFacts::parse("ro quiet").passthrough());
    }

    #[test]
    fn short_config_is_unreadable_and_broken_lists_end() {
        assert!(matches!(parse_acs(&[0u8; 64]), AcsState::Unreadable(_)));
        let mut cfg = vec![0u8; 4096];
        // A capability that points at itself must not loop.
        cfg[0x100..0x104].copy_from_slice(&(0x0001u32 | (0x100 << 20)).to_le_bytes());
        assert_eq!(parse_acs(&cfg), AcsState::Absent);
    }

    #[test]
    fn resource_sizes() {
        let r = "0x00000000fb000000 0x00000000fbffffff 0x0000000000040200\n0x000000d000000000 0x000000d00fffffff 0x000000000014220c\n0x0000000000000000 0x0000000000000000 0x0000000000000000\n";
        assert_eq!(parse_resource(r), vec![16 << 20, 256 << 20, 0]);
        // The whole address space is one region, not an overflow.
        assert_eq!(parse_resource("0x0 0xffffffffffffffff 0x0\n"), vec![u64::MAX]);
    }
}
