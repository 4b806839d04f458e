//! Tests that run as several processes: the test binary re-executes itself
//! as N children (filtered to one test, with torchrun's variables,
//! `CUDA_PEER_MP_CHILD` and a new job secret set); the parent checks that
//! every child ran exactly that test and reached its end in time.
//!
//! An exit code alone proves nothing: a filter that matches no test runs
//! nothing and exits 0 ("running 0 tests"). So [`all_succeeded`] requires,
//! of every child, exit status 0, libtest's `running 1 test`, and the line
//! the test body prints at its end (`rank N: ... right`); of a child that
//! returns from the test, libtest's `test result: ok. 1 passed` too (a
//! child that ends its process itself, [`End::Exits`], prints no summary).
#![allow(dead_code)]

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Set in a child: the test it runs.
pub const CHILD: &str = "CUDA_PEER_MP_CHILD";

/// A command every child runs under, its words separated by whitespace
/// (`compute-sanitizer --tool memcheck --log-file x.%p.log`, say): the
/// child's own command line follows it. Unset or empty: the children run
/// as themselves. `tests/sanitizer.sh` sets it, so that each child is a
/// process the tool starts and traces itself.
pub const WRAPPER: &str = "CUDA_PEER_TEST_CHILD_WRAPPER";

/// The command that runs `exe` as a child: `exe` itself, or under the
/// [`WRAPPER`]'s command.
fn child_command(exe: &std::path::Path) -> Command {
    let wrapper = std::env::var(WRAPPER).unwrap_or_default();
    let mut words = wrapper.split_whitespace();
    match words.next() {
        Some(program) => {
            let mut cmd = Command::new(program);
            cmd.args(words).arg(exe);
            cmd
        }
        None => Command::new(exe),
    }
}

/// Whether this process is a child (then the test body is the child's).
pub fn child() -> bool {
    std::env::var_os(CHILD).is_some()
}

pub fn rank() -> usize {
    std::env::var("RANK").ok().and_then(|r| r.parse().ok()).unwrap_or(0)
}

/// Reads all of `from` on a thread of its own (so that a child that writes
/// more than a pipe holds does not block until the deadline).
fn drain(mut from: impl Read + Send + 'static) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut all = Vec::new();
        let _ = from.read_to_end(&mut all);
        all
    })
}

/// Runs `test` as `n` children of this binary with `extra(rank)` env vars;
/// returns each child's exit code (None: killed by a signal, its own or
/// this harness's at the deadline, which the output's last line names) and
/// output (stdout, then stderr).
pub fn spawn(test: &str, n: usize, deadline: Duration, extra: impl Fn(usize) -> Vec<(&'static str, String)>) -> Vec<(Option<i32>, String)> {
    let exe = std::env::current_exe().expect("current_exe");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    // As cuda-peer-run does: one new secret for the job's ranks.
    let secret = format!("{:016x}{:016x}", rand::random::<u64>(), rand::random::<u64>());
    let mut children: Vec<_> = (0..n)
        .map(|r| {
            let mut cmd = child_command(&exe);
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
            let mut child = cmd.spawn().expect("spawn a child");
            let out = drain(child.stdout.take().expect("a child's stdout"));
            let err = drain(child.stderr.take().expect("a child's stderr"));
            (child, out, err)
        })
        .collect();
    let start = Instant::now();
    let mut ends: Vec<Option<std::process::ExitStatus>> = vec![None; n];
    while ends.iter().any(Option::is_none) && start.elapsed() < deadline {
        for ((c, _, _), end) in children.iter_mut().zip(ends.iter_mut()) {
            if end.is_none() {
                if let Ok(Some(s)) = c.try_wait() {
                    *end = Some(s);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    children
        .into_iter()
        .zip(ends)
        .map(|((mut c, out, err), end)| {
            use std::os::unix::process::ExitStatusExt;
            let how = match end {
                Some(s) => s.signal().map(|sig| format!("\n[the child was killed by signal {sig}]")),
                None => {
                    let _ = c.kill();
                    let _ = c.wait();
                    Some(format!("\n[the child was killed at the deadline, {deadline:?}]"))
                }
            };
            let (out, err) = (out.join().unwrap_or_default(), err.join().unwrap_or_default());
            let code = end.and_then(|s| s.code());
            (code, format!("{}{}{}", String::from_utf8_lossy(&out), String::from_utf8_lossy(&err), how.unwrap_or_default()))
        })
        .collect()
}

/// How a child ends, and the line its test body prints at the end (a
/// prefix of one of its output lines).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// The test returns: libtest then prints `test result: ok. 1 passed`.
    Passes(String),
    /// The child ends its process itself (`std::process::exit(0)`, as a
    /// rank that plays a dead peer, or one whose peer is gone), after the
    /// line: no libtest summary follows.
    Exits(String),
}

/// Why a child's outcome (exit code, output) is not that of a child that
/// ran `test` and ended as `end` (`None`: it did).
pub fn failure(test: &str, code: Option<i32>, out: &str, end: &End) -> Option<String> {
    if code != Some(0) {
        return Some(format!("exited with {code:?} (None: killed by a signal, which its output's last line names)"));
    }
    if !out.lines().any(|l| l.trim_end() == "running 1 test") {
        return Some("did not run exactly one test (no `running 1 test` line: the name matched no test, or several)".into());
    }
    let (line, summary) = match end {
        End::Passes(l) => (l, true),
        End::Exits(l) => (l, false),
    };
    // With one test thread libtest prints `test <name> ... ` before the
    // test runs, so the test's first line of output follows it.
    let started = format!("test {test} ... ");
    if !out.lines().any(|l| l.strip_prefix(started.as_str()).unwrap_or(l).starts_with(line.as_str())) {
        return Some(format!("never printed its result line `{line}`"));
    }
    if summary && !out.lines().any(|l| l.starts_with("test result: ok. 1 passed;")) {
        return Some("has no `test result: ok. 1 passed` line (its test did not pass)".into());
    }
    None
}

/// Asserts that every child exited 0 after running exactly `test` and
/// reaching its end: `end(rank)` says how rank `rank` ends and the line it
/// prints there.
pub fn all_succeeded(test: &str, results: &[(Option<i32>, String)], end: impl Fn(usize) -> End) {
    for (r, (code, out)) in results.iter().enumerate() {
        if let Some(why) = failure(test, *code, out, &end(r)) {
            panic!("{test}: rank {r} {why}; its output:\n{out}");
        }
    }
}

/// Every rank passes, printing `rank N: <what>`.
pub fn passes(what: &str) -> impl Fn(usize) -> End + '_ {
    move |r| End::Passes(format!("rank {r}: {what}"))
}
