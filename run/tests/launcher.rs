//! The launcher on the CPU: `sh -c` ranks.

use std::process::Command;
use std::time::{Duration, Instant};

/// The launcher built with this test, or, where the test binary was moved
/// (a GPU machine's `.gpu/tests/`), the staged one in `.gpu/bin/`.
fn launcher() -> Command {
    let built = std::path::Path::new(env!("CARGO_BIN_EXE_cuda-peer-run"));
    let staged = std::path::Path::new(".gpu/bin/cuda-peer-run");
    Command::new(if built.exists() || !staged.exists() { built } else { staged })
}

#[test]
fn every_rank_gets_torchrun_variables() {
    let out = launcher()
        .args(["-n", "3", "--", "sh", "-c", "echo $RANK/$WORLD_SIZE/$LOCAL_RANK/$LOCAL_WORLD_SIZE/$MASTER_ADDR/$MASTER_PORT"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let mut lines: Vec<String> = String::from_utf8(out.stdout).unwrap().lines().map(String::from).collect();
    lines.sort();
    assert_eq!(lines.len(), 3, "{lines:?}");
    let port = lines[0].rsplit('/').next().unwrap().to_string();
    assert!(port.parse::<u16>().unwrap() > 0);
    for (r, l) in lines.iter().enumerate() {
        assert_eq!(l, &format!("{r}/3/{r}/3/127.0.0.1/{port}"));
    }
}

/// Rank 0, and only rank 0, inherits the rendezvous listener, bound to
/// MASTER_PORT and listening, at the descriptor CUDA_PEER_LISTEN_FD names.
#[test]
fn rank_0_inherits_the_listening_socket() {
    let script = r#"if [ -n "$CUDA_PEER_LISTEN_FD" ]; then echo "$RANK:$(readlink /proc/$$/fd/$CUDA_PEER_LISTEN_FD)"; else echo "$RANK:none"; fi"#;
    let out = launcher().args(["-n", "3", "--", "sh", "-c", script]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let mut lines: Vec<String> = String::from_utf8(out.stdout).unwrap().lines().map(String::from).collect();
    lines.sort();
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert!(lines[0].starts_with("0:socket:["), "{lines:?}");
    assert_eq!(&lines[1..], ["1:none", "2:none"]);
}

/// Every rank gets the same new secret, 64 hex digits, and another run
/// another one; a secret already in the environment is passed on.
#[test]
fn every_rank_gets_the_same_new_job_secret() {
    let secrets = |env: Option<&str>| {
        let mut cmd = launcher();
        cmd.args(["-n", "3", "--", "sh", "-c", "echo $CUDA_PEER_JOB_SECRET"]).env_remove("CUDA_PEER_JOB_SECRET");
        if let Some(v) = env {
            cmd.env("CUDA_PEER_JOB_SECRET", v);
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap().lines().map(String::from).collect::<Vec<_>>()
    };
    let first = secrets(None);
    assert_eq!(first.len(), 3);
    assert!(first.iter().all(|s| *s == first[0]), "{first:?}");
    assert!(first[0].len() == 64 && first[0].bytes().all(|c| c.is_ascii_hexdigit()), "{first:?}");
    assert_ne!(secrets(None)[0], first[0]);
    assert_eq!(secrets(Some("a secret the user chose, long enough")), vec!["a secret the user chose, long enough"; 3]);
}

#[test]
fn a_failing_rank_stops_a_sleeping_sibling_and_its_code_is_the_exit_code() {
    let start = Instant::now();
    let status = launcher()
        .args(["-n", "2", "--grace", "1", "--", "sh", "-c", r#"if [ "$RANK" = 1 ]; then sleep 0.2; exit 7; else sleep 60; fi"#])
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(7));
    assert!(start.elapsed() < Duration::from_secs(20), "{:?}", start.elapsed());
}

#[test]
fn a_rank_that_ignores_sigterm_is_killed_after_the_grace_period() {
    let start = Instant::now();
    let status = launcher()
        .args(["-n", "2", "--grace", "0.5", "--", "sh", "-c", r#"if [ "$RANK" = 0 ]; then exit 3; else trap '' TERM; sleep 60; fi"#])
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(3));
    assert!(start.elapsed() < Duration::from_secs(20), "{:?}", start.elapsed());
}

#[test]
fn success_is_zero_and_a_missing_program_is_127() {
    assert_eq!(launcher().args(["-n", "2", "--", "true"]).status().unwrap().code(), Some(0));
    let status = launcher().args(["-n", "2", "--", "/nonexistent/program"]).status().unwrap();
    assert_eq!(status.code(), Some(127));
}

#[test]
fn sigterm_is_forwarded() {
    let mut child = launcher().args(["-n", "2", "--", "sh", "-c", "sleep 60"]).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let start = Instant::now();
    Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(128 + 15));
    assert!(start.elapsed() < Duration::from_secs(20));
}
