//! Parser and rule tests on the fixture trees in `tests/fixtures/`
//! (written by `tests/fixtures/make.py`). No GPU needed.

// The workspace's one way to say a test skipped (`SKIPPED <test>: <why>`,
// past libtest's capture): tests/common/skip.rs.
#[path = "../../tests/common/skip.rs"]
mod skip;

use cuda_peer_cli::cache::{self, Cache, CacheKey};
use cuda_peer_cli::rules::{self, Checks, DriverPair, Level, Outcome, PairInput, Severity, Speeds, UsePath};
use cuda_peer_cli::sysfs::{pair_path, AcsState, PciPath, RebarState, SystemFacts};
use std::path::{Path, PathBuf};

const G: u64 = 1 << 30;

/// The fixture tree `name`: under the crate's directory, or (for test
/// binaries staged to another machine and run from the workspace root)
/// under `cli/tests/fixtures` of the current directory.
fn fixture(name: &str) -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    if built.exists() {
        built
    } else {
        Path::new("cli/tests/fixtures").join(name)
    }
}

/// The facts of fixture `name`; `None` (the test skips, saying so) where the
/// tree was copied without its symlinks (a staged test binary on a machine
/// that received the sources as plain files): sysfs is made of symlinks.
fn facts(name: &str) -> Option<SystemFacts> {
    let root = fixture(name);
    let devices = root.join("sys/bus/pci/devices");
    let linked =
        std::fs::read_dir(&devices).ok().and_then(|mut d| d.next()).and_then(|e| e.ok()).is_some_and(|e| e.file_type().is_ok_and(|t| t.is_symlink()));
    if !linked {
        skip::skipped(&format!("(a test of fixture {name})"), format!("fixture {} has no symlinked sysfs tree here", root.display()));
        return None;
    }
    Some(SystemFacts::read(&root, &[]))
}

fn p2p_driver(nvlink: bool) -> DriverPair {
    let ok = |k: &str| (k.to_string(), "Ok".to_string());
    let mut nvml = vec![ok("read"), ok("write"), ok("atomics")];
    nvml.push(("nvlink".into(), if nvlink { "Ok".into() } else { "NotSupported".into() }));
    DriverPair {
        can_access_peer: true,
        can_access_peer_back: true,
        access_supported: Some(true),
        performance_rank: Some(0),
        native_atomics: Some(true),
        cuda_array_access: Some(true),
        nvml_p2p: nvml,
        nvml_topology: None,
    }
}

fn all_pass() -> Checks {
    Checks { copy_engine: Outcome::Pass, mesh: Outcome::Pass, oneshot: Outcome::Pass, staged: Outcome::Pass }
}

fn speeds(p2p: f64, staged: f64) -> Speeds {
    Speeds { bytes: 64 << 20, p2p_gbs: Some(p2p), staged_gbs: Some(staged), ..Default::default() }
}

fn input(f: &SystemFacts, vram: u64, driver: DriverPair, checks: Checks, sp: Speeds) -> PairInput {
    PairInput {
        from: 0,
        to: 1,
        from_bdf: f.gpus[0].bdf.clone(),
        to_bdf: f.gpus[1].bdf.clone(),
        vram: [Some(vram), Some(vram)],
        driver: Some(driver),
        checks: Some(checks),
        speeds: Some(sp),
    }
}

#[test]
fn iommu_translating_is_found_and_named_with_its_fix() {
    let Some(f) = facts("iommu-translating") else {
        return;
    };
    assert_eq!(f.gpus.len(), 2);
    assert_eq!(f.iommu.units, vec!["dmar0", "dmar1"]);
    let g13 = f.iommu.groups.iter().find(|g| g.id == 13).unwrap();
    assert_eq!(g13.kind.as_deref(), Some("DMA-FQ"));
    assert!(g13.translating());
    assert_eq!(g13.devices, vec!["0000:01:00.0"]);
    assert_eq!(f.gpus[0].iommu_group, Some(13));
    assert_eq!(f.cmdline.intel_iommu.as_deref(), Some("on"));
    assert!(!f.cmdline.passthrough());
    assert_eq!(f.driver.open_module, Some(true));
    assert_eq!(f.driver.version.as_deref(), Some("550.54.15"));
    assert_eq!(pair_path(&f.gpus[0], &f.gpus[1]).path, PciPath::SameHostBridge);

    // The driver claims P2P but copy-engine copies come back wrong (zero-filled).
    let checks = Checks { copy_engine: Outcome::WrongData("16777216 of 16777216 bytes wrong, first at 0".into()), ..all_pass() };
    let v = rules::judge(&f, &input(&f, 24 * G, p2p_driver(false), checks, speeds(0.0, 20.0)));
    assert_eq!(v.level, Level::Degraded);
    assert_eq!(v.use_path, UsePath::Staged);
    assert!(v.summary.contains("IOMMU is translating (DMA-FQ) on group 13"), "{}", v.summary);
    let iommu = v.findings.iter().find(|x| x.what.contains("group 13")).unwrap();
    assert_eq!(iommu.severity, Severity::Warn);
    assert!(iommu.fix.as_deref().unwrap().contains("iommu=pt"));
    assert_eq!(v.findings[0].severity, Severity::Problem, "worst first");
    // ACS on the root ports is reported but not blamed: the traffic crosses the root complex anyway.
    let acs = v.findings.iter().find(|x| x.what.contains("ACS")).unwrap();
    assert_eq!(acs.severity, Severity::Info);
    assert_eq!(rules::exit_code(&[v], true), 1);
}

#[test]
fn acs_redirect_on_a_switch_port() {
    let Some(f) = facts("acs-switch") else { return };
    let p = pair_path(&f.gpus[0], &f.gpus[1]);
    assert_eq!(p.path, PciPath::SameSwitch);
    assert_eq!(p.common_ancestor.as_deref(), Some("0000:01:00.0"));
    let between: Vec<&str> = p.bridges_between.iter().map(|b| b.bdf.as_str()).collect();
    assert_eq!(between, vec!["0000:02:08.0", "0000:02:10.0"]);
    let acs = p.bridges_between[0].acs.as_ref().unwrap();
    assert_eq!(*acs, AcsState::Present { capability: 0x005f, control: 0x001d });
    assert!(acs.redirects());
    assert_eq!(acs.control_names(), vec!["SrcValid", "ReqRedir", "CmpltRedir", "UpstreamFwd"]);
    // The switch's upstream port has no ACS capability; the root port's is off.
    assert_eq!(f.gpus[0].bridges[1].acs, Some(AcsState::Absent));
    assert_eq!(f.gpus[0].bridges[0].acs, Some(AcsState::Present { capability: 0x005f, control: 0 }));
    assert!(f.cmdline.passthrough());
    assert!(f.iommu.groups.iter().all(|g| !g.translating()));
    assert_eq!(f.gpus[0].rebar, RebarState::Present(vec![(1, 32 * G, 32 * G)]));

    // P2P works but through the root complex it is slower than staging.
    let v = rules::judge(&f, &input(&f, 24 * G, p2p_driver(false), all_pass(), speeds(6.1, 11.8)));
    assert_eq!(v.level, Level::Degraded);
    assert_eq!(v.use_path, UsePath::Staged);
    assert!(v.summary.starts_with("P2P works but is slower than host staging on this path (6.1 against 11.8 GB/s): staged is used"), "{}", v.summary);
    let acs = v.findings.iter().find(|x| x.what.contains("bridge 0000:02:08.0")).unwrap();
    assert_eq!(acs.severity, Severity::Warn);
    assert!(acs.fix.as_deref().unwrap().contains("setpci -s 0000:02:08.0 ECAP_ACS+6.w=0000"));
}

#[test]
fn bar1_256_mib_on_a_24_gib_card_and_a_chipset_slot() {
    let Some(f) = facts("bar1-small") else { return };
    assert_eq!(f.gpus[0].bar1_bytes, Some(256 << 20));
    assert_eq!(f.gpus[1].link_width, Some(4));
    assert_eq!(f.gpus[1].max_link_width, Some(16));
    assert!(matches!(f.gpus[0].rebar, RebarState::Unreadable(_)));
    assert!(matches!(f.gpus[0].bridges[0].acs, Some(AcsState::Unreadable(_))));
    assert_eq!(f.driver.open_module, Some(false));
    assert!(!f.iommu.enabled());

    let machine = rules::machine_findings(&f);
    assert!(machine.iter().any(|m| m.severity == Severity::Warn && m.what.contains("proprietary")), "{machine:?}");

    // The stock driver reports no peer access; NVML says why.
    let mut drv = p2p_driver(false);
    drv.can_access_peer = false;
    drv.can_access_peer_back = false;
    drv.nvml_p2p[0].1 = "GpuNotSupported".into();
    let checks = Checks {
        copy_engine: Outcome::Skipped("the driver reports no peer access".into()),
        mesh: Outcome::Skipped("the driver reports no peer access".into()),
        oneshot: Outcome::Skipped("the driver reports no peer access".into()),
        staged: Outcome::Pass,
    };
    let v = rules::judge(&f, &input(&f, 24 * G, drv, checks, Speeds { staged_gbs: Some(9.0), ..Default::default() }));
    assert_eq!(v.level, Level::Degraded);
    assert_eq!(v.use_path, UsePath::Staged);
    let bar = v.findings.iter().find(|x| x.what.contains("BAR1 of 0000:01:00.0")).unwrap();
    assert!(bar.what.contains("256 MiB on a 24 GiB card"), "{}", bar.what);
    assert!(bar.fix.as_deref().unwrap().contains("Resizable BAR") || bar.fix.as_deref().unwrap().contains("Re-Size BAR"));
    assert!(v.findings.iter().any(|x| x.what.contains("x4 of x16")));
    assert!(v.findings.iter().any(|x| x.what.contains("unreadable") && x.fix.as_deref().is_some_and(|s| s.contains("sudo"))));
    let no_peer = v.findings.iter().find(|x| x.severity == Severity::Problem).unwrap();
    assert!(no_peer.fix.as_deref().unwrap().contains("open kernel modules"));
    // Without the driver, the BAR1 size alone is a note.
    let untested = rules::judge(&f, &PairInput { from_bdf: f.gpus[0].bdf.clone(), to_bdf: f.gpus[1].bdf.clone(), to: 1, ..Default::default() });
    assert_eq!(untested.level, Level::Untested);
    assert!(untested.findings.iter().any(|x| x.severity == Severity::Info && x.what.contains("BAR1")));
}

#[test]
fn cross_socket_pair() {
    let Some(f) = facts("cross-socket") else {
        return;
    };
    assert_eq!((f.gpus[0].numa_node, f.gpus[1].numa_node), (Some(0), Some(1)));
    let p = pair_path(&f.gpus[0], &f.gpus[1]);
    assert_eq!(p.path, PciPath::CrossSocket);
    assert_eq!(p.common_ancestor, None);
    assert_eq!(f.env.sys_vendor.as_deref(), Some("Supermicro"));
    assert_eq!(f.env.virtual_machine, None);
    let v = rules::judge(&f, &input(&f, 24 * G, p2p_driver(false), all_pass(), speeds(25.0, 21.0)));
    assert_eq!(v.level, Level::Ok, "faster than staging: P2P stays");
    let w = v.findings.iter().find(|x| x.what.contains("different CPU sockets")).unwrap();
    assert_eq!(w.severity, Severity::Warn);
    assert!(w.what.contains("NUMA nodes 0 and 1"));
}

#[test]
fn h200_nvlink_box_is_healthy() {
    let Some(f) = facts("h200-nvlink") else {
        return;
    };
    assert_eq!(f.gpus.iter().map(|g| g.bdf.as_str()).collect::<Vec<_>>(), vec!["0000:19:00.0", "0000:3b:00.0"]);
    assert!(f.gpus.iter().all(|g| g.numa_node == Some(0)));
    let p = pair_path(&f.gpus[0], &f.gpus[1]);
    assert_eq!(p.path, PciPath::SameNumaNode);
    assert_eq!(f.gpus[0].host_bridge.as_deref(), Some("pci0000:15"));
    assert_eq!(f.gpus[0].bar1_bytes, Some(256 * G));
    assert_eq!(f.driver.version.as_deref(), Some("580.95.05"));
    assert_eq!(f.driver.open_module, Some(true));
    assert!(f.env.container.is_some());
    assert_eq!(f.boot_id.as_deref(), Some("5b1f2c3e-8a9d-4e0f-9c1b-2d3e4f5a6b7c"));
    let sp = Speeds { p2p_gbs: Some(370.0), staged_gbs: Some(40.0), ..Default::default() };
    let v = rules::judge(&f, &input(&f, 141 * G, p2p_driver(true), all_pass(), sp.clone()));
    assert_eq!(v.level, Level::Ok);
    assert_eq!(v.use_path, UsePath::P2p);
    assert!(v.findings.iter().all(|x| x.severity == Severity::Info), "{:?}", v.findings);
    let back = rules::judge(
        &f,
        &PairInput {
            from: 1,
            to: 0,
            from_bdf: f.gpus[1].bdf.clone(),
            to_bdf: f.gpus[0].bdf.clone(),
            ..input(&f, 141 * G, p2p_driver(true), all_pass(), sp)
        },
    );
    assert_eq!(rules::exit_code(&[v, back], true), 0);
}

#[test]
fn sm_peer_stores_lost_while_copy_engine_passes() {
    let Some(f) = facts("h200-nvlink") else {
        return;
    };
    let checks = Checks {
        mesh: Outcome::WrongData("rank 1 (GPU 1): 524288 of 1048613 elements wrong, first at 0".into()),
        oneshot: Outcome::Timeout,
        ..all_pass()
    };
    let v = rules::judge(&f, &input(&f, 141 * G, p2p_driver(true), checks, speeds(370.0, 40.0)));
    assert_eq!(v.level, Level::Degraded);
    assert_eq!(v.use_path, UsePath::Staged);
    assert!(v.summary.contains("SM peer access fails"), "{}", v.summary);
    assert!(v.summary.contains("one-shot (SM peer stores, system-scope flags): timed out"));
    assert!(v.findings[0].fix.as_deref().unwrap().contains("runs the copy-engine ring"), "{:?}", v.findings[0].fix);
    // And when staging fails too, nothing is usable.
    let dead = Checks { copy_engine: Outcome::Timeout, staged: Outcome::Error("cuMemcpyDtoH failed".into()), ..all_pass() };
    let v = rules::judge(&f, &input(&f, 141 * G, p2p_driver(true), dead, Speeds::default()));
    assert_eq!((v.level, v.use_path), (Level::Unusable, UsePath::None));
    assert_eq!(rules::exit_code(&[v], true), 2);
    assert_eq!(rules::exit_code(&[], false), 2);
    assert_eq!(rules::exit_code(&[], true), 0, "one GPU: no pairs, nothing degraded");
}

/// The driver says yes but P2P cannot be opened (enabling peer access
/// fails, as under tests/fakecuda's peer-unavailable mode): skipped checks
/// are the claim failing, never "P2P verified".
#[test]
fn a_peer_access_claim_that_cannot_be_opened_is_degraded() {
    let Some(f) = facts("h200-nvlink") else {
        return;
    };
    let no = || Outcome::Skipped("the driver reports no peer access".into());
    let checks = Checks { copy_engine: no(), mesh: no(), oneshot: no(), staged: Outcome::Pass };
    let sp = Speeds { staged_gbs: Some(52.0), ..Default::default() };
    let v = rules::judge(&f, &input(&f, 141 * G, p2p_driver(true), checks, sp));
    assert_eq!((v.level, v.use_path), (Level::Degraded, UsePath::Staged), "{}", v.summary);
    assert!(v.summary.contains("P2P could not be opened"), "{}", v.summary);
    // No system warnings on this box: no "likely causes" that repeat the verdict.
    assert!(!v.summary.contains("likely causes"), "{}", v.summary);
    assert_eq!(rules::exit_code(&[v], true), 1);
    // Copy engine passes but the fused checks were not run: not verified either.
    let checks = Checks { mesh: no(), ..all_pass() };
    let v = rules::judge(&f, &input(&f, 141 * G, p2p_driver(true), checks, speeds(370.0, 40.0)));
    assert_eq!((v.level, v.use_path), (Level::Degraded, UsePath::Staged), "{}", v.summary);
    assert!(v.summary.contains("mesh (SM peer loads and stores): not run"), "{}", v.summary);
}

#[test]
fn verdict_cache_round_trip_and_keying() {
    assert_eq!(cache::cache_path(Some("/x/cache"), Some("/home/u")), Some(PathBuf::from("/x/cache/cuda-peer/doctor.json")));
    assert_eq!(cache::cache_path(None, Some("/home/u")), Some(PathBuf::from("/home/u/.cache/cuda-peer/doctor.json")));
    assert_eq!(cache::cache_path(Some(""), None), None);

    let Some(f) = facts("acs-switch") else { return };
    let slow = rules::judge(&f, &input(&f, 24 * G, p2p_driver(false), all_pass(), speeds(6.0, 12.0)));
    let key = CacheKey { driver_version: "550.54.15".into(), boot_id: "b".into(), bus_ids: vec!["0000:03:00.0".into(), "0000:04:00.0".into()] };
    let c = Cache::new(key.clone(), vec![cache::entry(&slow, Some(&speeds(6.0, 12.0)))]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cuda-peer/doctor.json");
    cache::write(&path, &c).unwrap();
    let back = cache::read(&path).unwrap();
    assert_eq!(back, c);
    assert_eq!(cache::decide(&back, &key, "00000000:03:00.0", "0000:04:00.0"), Some(UsePath::Staged));
    assert_eq!(cache::decide(&back, &key, "0000:04:00.0", "0000:03:00.0"), None, "the reverse pair was not judged");
    let rebooted = CacheKey { boot_id: "other".into(), ..key.clone() };
    assert_eq!(cache::decide(&back, &rebooted, "0000:03:00.0", "0000:04:00.0"), None);
    let new_driver = CacheKey { driver_version: "560.28.03".into(), ..key.clone() };
    assert_eq!(cache::decide(&back, &new_driver, "0000:03:00.0", "0000:04:00.0"), None);

    // The library reads what the doctor wrote: the same file, the same
    // verdict and speeds, and the same speed rule.
    let lib = cuda_peer::verdict::Cache::read(&path).expect("the library reads the doctor's file");
    assert_eq!(lib.applies_to(&key), Ok(()));
    let p = lib.pair("0000:03:00.0", "0000:04:00.0").expect("the pair's verdict");
    assert_eq!(p.path, cache::CachedPath::Staged);
    assert!(p.summary.contains("slower than host staging"), "{}", p.summary);
    let sample = p.speed.expect("the speeds were cached");
    assert_eq!((sample.bytes, sample.p2p_gbs, sample.staged_gbs), (64 << 20, 6.0, 12.0));
    assert_eq!(cuda_peer::verdict::faster_path(&sample), Some(cuda_peer::verdict::CachedPath::Staged));
    drop(dir);
}

#[test]
fn small_timed_copies_do_not_decide_the_path() {
    let Some(f) = facts("acs-switch") else { return };
    let small = Speeds { bytes: 4096, ..speeds(1.0, 2.0) };
    let v = rules::judge(&f, &input(&f, 24 * G, p2p_driver(false), all_pass(), small));
    assert_eq!(v.use_path, UsePath::P2p, "{}", v.summary);
    assert!(v.summary.contains("too small a copy"), "{}", v.summary);
}
