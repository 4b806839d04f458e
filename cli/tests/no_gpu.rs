//! `cuda-peer doctor` without a GPU or driver: it still reports the system
//! facts, says why there is no GPU, exits 2, and does not panic. Skipped
//! (a `SKIPPED` line) on a machine where the CUDA driver loads.

// The workspace's one way to say a test skipped (`SKIPPED <test>: <why>`,
// past libtest's capture): tests/common/skip.rs.
#[path = "../../tests/common/skip.rs"]
mod skip;

use std::path::Path;
use std::process::Command;

fn doctor(test: &str, args: &[&str]) -> Option<(i32, String, String)> {
    if cuda_peer::driver::is_available() {
        skip::skipped(test, "the CUDA driver loads here; this test is for machines without one");
        return None;
    }
    let cache = tempfile::tempdir().expect("a private temporary directory");
    let out =
        Command::new(env!("CARGO_BIN_EXE_cuda-peer")).arg("doctor").args(args).env("XDG_CACHE_HOME", cache.path()).output().expect("run cuda-peer");
    Some((out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned()))
}

#[test]
fn no_gpu_json_reports_facts_and_exits_2() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/h200-nvlink");
    let Some((code, stdout, stderr)) = doctor("no_gpu_json_reports_facts_and_exits_2", &["--json", "--root", root.to_str().unwrap()]) else {
        return;
    };
    assert_eq!(code, 2, "{stdout}\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("one JSON object");
    assert!(v["no_gpu_reason"].as_str().is_some_and(|s| !s.is_empty()), "{v}");
    assert_eq!(v["exit_code"], 2);
    assert_eq!(v["facts"]["gpus"].as_array().map(Vec::len), Some(2));
    assert_eq!(v["facts"]["driver"]["version"], "580.95.05");
    assert_eq!(v["pairs"].as_array().map(Vec::len), Some(2));
    assert_eq!(v["pairs"][0]["level"], "untested");
    assert_eq!(v["pairs"][0]["pci_path"], "SameNumaNode");
    assert!(v["cache_written"].is_null(), "nothing to cache without a GPU");
}

#[test]
fn no_gpu_text_on_this_machine_exits_2() {
    let Some((code, stdout, stderr)) = doctor("no_gpu_text_on_this_machine_exits_2", &["--wake"]) else {
        return;
    };
    assert_eq!(code, 2, "{stdout}\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stdout.contains("No usable GPU: "), "{stdout}");
    assert!(stdout.contains("System (read under /)"), "{stdout}");
}
