//! What the driver says about the devices and the links between them.
//!
//! The capability answers here are the driver's claims, not facts: a link
//! that says "P2P supported" may still drop or misplace writes (IOMMU, ACS,
//! patched consumer drivers). [`crate::copy::Link`] verifies a link before
//! trusting it.

use crate::driver::{api, device, device_count};
use crate::error::{check, Result};
use cuda_peer_sys as sys;
use std::fmt;

/// One CUDA device as the driver describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device index.
    pub ordinal: usize,
    /// Marketing name, e.g. `NVIDIA H200`.
    pub name: String,
    /// PCI bus id, e.g. `0000:19:00.0`.
    pub pci_bus_id: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Device memory in bytes.
    pub total_memory: usize,
    /// Whether the device supports stream-ordered memory pools.
    pub memory_pools: bool,
}

/// The driver's answer for one ordered pair of devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkInfo {
    /// The accessing device.
    pub from: usize,
    /// The device whose memory is accessed.
    pub to: usize,
    /// `cuDeviceCanAccessPeer`.
    pub can_access_peer: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK` (lower is better).
    pub performance_rank: i32,
    /// `CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED`.
    pub native_atomics: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_CUDA_ARRAY_ACCESS_SUPPORTED`.
    pub cuda_array_access: bool,
}

/// Every device and every ordered pair of distinct devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// The devices, by ordinal.
    pub devices: Vec<DeviceInfo>,
    /// One entry per ordered pair `(from, to)` with `from != to`, row-major.
    pub links: Vec<LinkInfo>,
}

fn attribute(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
    let mut v = 0;
    // SAFETY: writes one int; `dev` came from cuDeviceGet.
    check("cuDeviceGetAttribute", unsafe { api()?.cuDeviceGetAttribute(&mut v, attr, dev) })?;
    Ok(v)
}

fn c_string(buf: &[std::os::raw::c_char]) -> String {
    let bytes: Vec<u8> = buf.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Describes device `ordinal`.
pub fn device_info(ordinal: usize) -> Result<DeviceInfo> {
    let dev = device(ordinal)?;
    let api = api()?;
    let mut name = [0 as std::os::raw::c_char; 256];
    let mut bus = [0 as std::os::raw::c_char; 64];
    let mut total = 0usize;
    // SAFETY: each call writes at most the given length into its buffer, or one usize.
    unsafe {
        check("cuDeviceGetName", api.cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev))?;
        check("cuDeviceGetPCIBusId", api.cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as i32, dev))?;
        check("cuDeviceTotalMem", api.cuDeviceTotalMem_v2(&mut total, dev))?;
    }
    use sys::CUdevice_attribute as A;
    Ok(DeviceInfo {
        ordinal,
        name: c_string(&name),
        pci_bus_id: c_string(&bus),
        compute_capability: (
            attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ),
        total_memory: total,
        memory_pools: attribute(dev, A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)? != 0,
    })
}

/// The driver's answer for `from` accessing `to`'s memory. `from == to` is
/// [`crate::error::Error::SameDevice`].
pub fn link_info(from: usize, to: usize) -> Result<LinkInfo> {
    if from == to {
        return Err(crate::error::Error::SameDevice(from));
    }
    let (a, b) = (device(from)?, device(to)?);
    let api = api()?;
    let mut can = 0;
    // SAFETY: writes one int; both devices are valid handles.
    check("cuDeviceCanAccessPeer", unsafe { api.cuDeviceCanAccessPeer(&mut can, a, b) })?;
    let p2p = |attr: sys::CUdevice_P2PAttribute| -> Result<i32> {
        let mut v = 0;
        // SAFETY: writes one int; both devices are valid and distinct.
        check("cuDeviceGetP2PAttribute", unsafe { api.cuDeviceGetP2PAttribute(&mut v, attr, a, b) })?;
        Ok(v)
    };
    use sys::CUdevice_P2PAttribute as P;
    Ok(LinkInfo {
        from,
        to,
        can_access_peer: can != 0,
        performance_rank: p2p(P::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK)?,
        native_atomics: p2p(P::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED)? != 0,
        cuda_array_access: p2p(P::CU_DEVICE_P2P_ATTRIBUTE_CUDA_ARRAY_ACCESS_SUPPORTED)? != 0,
    })
}

impl Topology {
    /// Asks the driver about every device and pair.
    pub fn probe() -> Result<Topology> {
        let n = device_count()?;
        let devices = (0..n).map(device_info).collect::<Result<Vec<_>>>()?;
        let mut links = Vec::with_capacity(n * n.saturating_sub(1));
        for from in 0..n {
            for to in (0..n).filter(|&t| t != from) {
                links.push(link_info(from, to)?);
            }
        }
        Ok(Topology { devices, links })
    }

    /// The entry for `(from, to)`, if both exist and differ.
    pub fn link(&self, from: usize, to: usize) -> Option<&LinkInfo> {
        self.links.iter().find(|l| l.from == from && l.to == to)
    }

    /// Writes a matrix of `cell(link)` per ordered pair, `X` on the diagonal,
    /// in the layout of `nvidia-smi topo -p2p`.
    pub fn write_matrix(&self, f: &mut dyn fmt::Write, cell: &dyn Fn(&LinkInfo) -> String) -> fmt::Result {
        let n = self.devices.len();
        write!(f, "      ")?;
        for j in 0..n {
            write!(f, " {:>6}", format!("GPU{j}"))?;
        }
        writeln!(f)?;
        for i in 0..n {
            write!(f, "{:<6}", format!("GPU{i}"))?;
            for j in 0..n {
                let c = if i == j { "X".to_string() } else { self.link(i, j).map(cell).unwrap_or_else(|| "?".into()) };
                write!(f, " {c:>6}")?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

/// Prints the device list and the read (`cuDeviceCanAccessPeer`) matrix like
/// `nvidia-smi topo -p2p r`, then the performance rank and atomics matrices.
impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for d in &self.devices {
            writeln!(
                f,
                "GPU{}: {} (sm_{}{}, {} MiB, PCI {})",
                d.ordinal,
                d.name,
                d.compute_capability.0,
                d.compute_capability.1,
                d.total_memory >> 20,
                d.pci_bus_id
            )?;
        }
        writeln!(f, "\nP2P read capability (cuDeviceCanAccessPeer):")?;
        self.write_matrix(f, &|l| if l.can_access_peer { "OK".into() } else { "NS".into() })?;
        writeln!(f, "\nP2P performance rank (lower is better):")?;
        self.write_matrix(f, &|l| l.performance_rank.to_string())?;
        writeln!(f, "\nP2P native atomics:")?;
        self.write_matrix(f, &|l| if l.native_atomics { "OK".into() } else { "NS".into() })?;
        writeln!(f, "\nLegend: X = self, OK = supported, NS = not supported")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two_gpus(ok: bool) -> Topology {
        let dev = |i| DeviceInfo {
            ordinal: i,
            name: "NVIDIA H200".into(),
            pci_bus_id: format!("0000:{:02x}:00.0", 0x19 + i),
            compute_capability: (9, 0),
            total_memory: 143_771 << 20,
            memory_pools: true,
        };
        let link = |from, to| LinkInfo { from, to, can_access_peer: ok, performance_rank: 0, native_atomics: ok, cuda_array_access: ok };
        Topology { devices: vec![dev(0), dev(1)], links: vec![link(0, 1), link(1, 0)] }
    }

    #[test]
    fn prints_like_nvidia_smi_topo_p2p() {
        let text = two_gpus(true).to_string();
        assert!(text.contains("GPU0: NVIDIA H200 (sm_90, 143771 MiB, PCI 0000:19:00.0)"), "{text}");
        let matrix = "         GPU0   GPU1\nGPU0        X     OK\nGPU1       OK      X\n";
        assert!(text.contains(matrix), "{text}");
        let ns = two_gpus(false).to_string();
        assert!(ns.contains("GPU0        X     NS\nGPU1       NS      X\n"), "{ns}");
    }

    #[test]
    fn link_lookup_is_ordered() {
        let mut t = two_gpus(true);
        t.links[1].performance_rank = 3;
        assert_eq!(t.link(1, 0).unwrap().performance_rank, 3);
        assert_eq!(t.link(0, 1).unwrap().performance_rank, 0);
        assert!(t.link(0, 0).is_none());
        assert!(t.link(0, 2).is_none());
    }
}
