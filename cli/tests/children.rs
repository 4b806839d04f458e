//! The child-process harness the functional checks run in: lines written
//! before a child dies or hangs are kept, a hang becomes a timeout, a crash
//! an error. No GPU needed.

// The workspace's one way to say a test skipped (`SKIPPED <test>: <why>`,
// past libtest's capture): tests/common/skip.rs.
#[path = "../../tests/common/skip.rs"]
mod skip;

use cuda_peer_cli::gpu::{run_with_timeout, ChildLine};
use cuda_peer_cli::rules::Outcome;
use std::process::Command;
use std::time::Duration;

fn sh(script: &str) -> Command {
    let mut c = Command::new("sh");
    c.args(["-c", script]);
    c
}

#[test]
fn a_hanging_child_is_a_timeout() {
    let r = run_with_timeout(sh("exec sleep 10"), Duration::from_millis(300));
    assert_eq!(r.failure, Some(Outcome::Timeout));
    assert!(r.elapsed < Duration::from_secs(5), "{:?}", r.elapsed);
}

#[test]
fn lines_before_a_crash_are_kept() {
    let line = serde_json::to_string(&ChildLine::Mesh(Outcome::Pass)).unwrap();
    let r = run_with_timeout(sh(&format!("echo '{line}'; echo not-json; echo boom >&2; exit 3")), Duration::from_secs(10));
    assert!(matches!(r.lines.as_slice(), [ChildLine::Mesh(Outcome::Pass)]), "{:?}", r.lines);
    match r.failure {
        Some(Outcome::Error(e)) => {
            assert!(e.contains("exit status: 3") && e.contains("boom"), "{e}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_clean_child_has_no_failure() {
    let line = serde_json::to_string(&ChildLine::OneShot(Outcome::WrongData("3 of 9 elements wrong, first at 1".into()))).unwrap();
    let r = run_with_timeout(sh(&format!("echo '{line}'")), Duration::from_secs(10));
    assert_eq!(r.failure, None);
    assert!(matches!(&r.lines[..], [ChildLine::OneShot(Outcome::WrongData(_))]));
}

#[test]
fn the_hidden_check_without_a_driver_fails_cleanly() {
    if cuda_peer::driver::is_available() {
        skip::skipped("the_hidden_check_without_a_driver_fails_cleanly", "the CUDA driver loads here; this test is for machines without one");
        return;
    }
    for kind in ["copy", "mesh", "oneshot"] {
        let out = Command::new(env!("CARGO_BIN_EXE_cuda-peer")).args(["__check", kind, "0", "1"]).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "{kind}: {stderr}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        // copy exits non-zero; mesh and one-shot report an error outcome.
        assert!(!out.status.success() || stdout.contains("\"error\""), "{kind}: {stdout} {stderr}");
    }
}
