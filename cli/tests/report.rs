//! The text and JSON report of a GPU run, made from a fixture's facts and
//! synthetic driver, check and speed results (the GPU path cannot run here).

// The workspace's one way to say a test skipped (`SKIPPED <test>: <why>`,
// past libtest's capture): tests/common/skip.rs.
#[path = "../../tests/common/skip.rs"]
mod skip;

use cuda_peer_cli::gpu::Wake;
use cuda_peer_cli::report::{render, GpuReport, PairReport, Report};
use cuda_peer_cli::rules::{self, Checks, DriverPair, Outcome, PairInput, Speeds};
use cuda_peer_cli::sysfs::SystemFacts;
use std::path::Path;

fn root() -> std::path::PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/h200-nvlink");
    if built.exists() {
        built
    } else {
        Path::new("cli/tests/fixtures/h200-nvlink").to_path_buf()
    }
}

#[test]
fn a_healthy_two_gpu_report_renders_and_round_trips() {
    let facts = SystemFacts::read(&root(), &["00000000:19:00.0".into(), "0000:3B:00.0".into()]);
    if facts.gpus.iter().any(|g| g.host_bridge.is_none()) {
        skip::skipped("a_healthy_two_gpu_report_renders_and_round_trips", "the fixture's sysfs symlinks are not here");
        return;
    }
    let gpus: Vec<GpuReport> = facts
        .gpus
        .iter()
        .enumerate()
        .map(|(i, g)| GpuReport {
            ordinal: i,
            name: "NVIDIA H200".into(),
            bdf: g.bdf.clone(),
            compute_capability: (9, 0),
            memory_bytes: 143_771 << 20,
        })
        .collect();
    let driver = DriverPair {
        can_access_peer: true,
        can_access_peer_back: true,
        access_supported: Some(true),
        performance_rank: Some(0),
        native_atomics: Some(true),
        cuda_array_access: Some(true),
        nvml_p2p: ["read", "write", "nvlink", "atomics"].iter().map(|k| (k.to_string(), "Ok".to_string())).collect(),
        nvml_topology: Some("Node".into()),
    };
    let checks = Checks { copy_engine: Outcome::Pass, mesh: Outcome::Pass, oneshot: Outcome::Pass, staged: Outcome::Pass };
    let speeds = Speeds {
        bytes: 64 << 20,
        p2p_gbs: Some(368.2),
        staged_gbs: Some(41.0),
        driver_gbs: Some(39.5),
        p2p_lat_us: Some(2.1),
        staged_lat_us: Some(19.0),
        driver_lat_us: Some(12.0),
    };
    let pairs: Vec<PairReport> = [(0, 1), (1, 0)]
        .iter()
        .map(|&(from, to)| {
            let input = PairInput {
                from,
                to,
                from_bdf: gpus[from].bdf.clone(),
                to_bdf: gpus[to].bdf.clone(),
                vram: [Some(143_771 << 20); 2],
                driver: Some(driver.clone()),
                checks: Some(checks.clone()),
                speeds: Some(speeds.clone()),
            };
            PairReport {
                verdict: rules::judge(&facts, &input),
                driver: input.driver,
                checks: input.checks,
                speeds: input.speeds,
                check_seconds: vec![("copy".into(), 2.5), ("sm".into(), 3.0)],
            }
        })
        .collect();
    let verdicts: Vec<_> = pairs.iter().map(|p| p.verdict.clone()).collect();
    let wake = vec![Wake {
        ordinal: 0,
        bdf: gpus[0].bdf.clone(),
        before: Ok((0, 0, "Zero".into())),
        context: Ok(310.0),
        after: Err("NVML unavailable".into()),
    }];
    let r = Report {
        version: "0.1.0".into(),
        machine_findings: rules::machine_findings(&facts),
        gpus,
        no_gpu_reason: None,
        driver_version: facts.driver.version.clone(),
        facts,
        wake: Some(wake),
        pairs,
        notes: vec![],
        cache_written: Some("/tmp/x/cuda-peer/doctor.json".into()),
        elapsed_s: 9.5,
        exit_code: rules::exit_code(&verdicts, true),
    };
    assert_eq!(r.exit_code, 0);
    let text = render(&r);
    for want in [
        "driver: 580.95.05 (open kernel module)",
        "GPU 0 0000:19:00.0: NUMA 0, link 32.0 GT/s PCIe x16",
        "NVIDIA H200: pci0000:15 -> 0000:15:01.0 -> 0000:16:00.0 -> 0000:17:00.0",
        "GPU 0 -> GPU 1 (0000:19:00.0 -> 0000:3b:00.0, NODE via no common PCIe bridge): OK",
        "P2P verified (copy engine and SM loads/stores), 368.2 GB/s against 41.0 GB/s staged",
        "checks: copy engine pass; mesh pass; one-shot pass; staged pass",
        "speed (64 MiB one way / 4 B latency): P2P 368.2 GB/s / 2.1 us; staged 41.0 GB/s / 19.0 us",
        "GPU 0 0000:19:00.0: 0%/0%/Zero -> NVML unavailable; context created and destroyed in 310 ms",
        "every pair usable at full speed (exit 0, 9.5 s)",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }
    let json = serde_json::to_string(&r).unwrap();
    let back: Report = serde_json::from_str(&json).unwrap();
    assert_eq!(back.pairs.len(), 2);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["pairs"][0]["level"], "ok");
    assert_eq!(v["pairs"][0]["use_path"], "p2p");
    assert_eq!(v["pairs"][0]["checks"]["mesh"]["result"], "pass");
}
