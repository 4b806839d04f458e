//! Tests that run as several processes: the test binary re-executes itself
//! as N children (filtered to one test, with torchrun's variables and
//! `CUDA_PEER_MP_CHILD` set); the parent checks that every child succeeded
//! in time.
#![allow(dead_code)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Set in a child: the test it runs.
pub const CHILD: &str = "CUDA_PEER_MP_CHILD";

/// Whether this process is a child (then the test body is the child's).
pub fn child() -> bool {
    std::env::var_os(CHILD).is_some()
}

pub fn rank() -> usize {
    std::env::var("RANK").ok().and_then(|r| r.parse().ok()).unwrap_or(0)
}

/// Runs `test` as `n` children of this binary with `extra(rank)` env vars;
/// returns each child's exit code (None: killed at the deadline) and output.
pub fn spawn(test: &str, n: usize, deadline: Duration, extra: impl Fn(usize) -> Vec<(&'static str, String)>) -> Vec<(Option<i32>, String)> {
    let exe = std::env::current_exe().expect("current_exe");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    // As cuda-peer-run does: one new secret for the job's ranks.
    let secret = format!("{:016x}{:016x}", rand::random::<u64>(), rand::random::<u64>());
    let mut children: Vec<_> = (0..n)
        .map(|r| {
            let mut cmd = Command::new(&exe);
            cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
                .env(CHILD, test)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("CUDA_PEER_JOB_SECRET", &secret)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in extra(r) {
                cmd.env(k, v);
            }
            cmd.spawn().expect("spawn a child")
        })
        .collect();
    let start = Instant::now();
    let mut codes: Vec<Option<Option<i32>>> = vec![None; n];
    while codes.iter().any(Option::is_none) && start.elapsed() < deadline {
        for (c, code) in children.iter_mut().zip(codes.iter_mut()) {
            if code.is_none() {
                if let Ok(Some(s)) = c.try_wait() {
                    *code = Some(s.code());
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    children
        .into_iter()
        .zip(codes)
        .map(|(mut c, code)| {
            let code = code.unwrap_or_else(|| {
                let _ = c.kill();
                None
            });
            let out = c
                .wait_with_output()
                .map(|o| format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
                .unwrap_or_default();
            (code, out)
        })
        .collect()
}

/// Asserts that every child exited 0.
pub fn all_succeeded(test: &str, results: &[(Option<i32>, String)]) {
    for (r, (code, out)) in results.iter().enumerate() {
        assert_eq!(*code, Some(0), "{test}: rank {r} exited with {code:?} (None: killed at the deadline); its output:\n{out}");
    }
}
