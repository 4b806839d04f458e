//! `cuda-peer-run -n N -- program args...`: starts `program` as N
//! processes (ranks) with torchrun's variables set (`RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR=127.0.0.1` and a free
//! `MASTER_PORT`, whose listening socket the launcher binds and hands to
//! rank 0 as an inherited descriptor, `CUDA_PEER_LISTEN_FD`, so that no
//! other process can take the port in between) and a new random job secret (`CUDA_PEER_JOB_SECRET`,
//! unless the environment already has one), forwards SIGINT and SIGTERM to them, and when one exits
//! with a failure, stops the others (SIGTERM, then SIGKILL after a grace
//! period). Exits with the first failure's code (128 + the signal for a
//! rank killed by one), or 0 when every rank succeeded.
//!
//! Each rank runs in its own process group, so that a terminal's Ctrl-C
//! reaches the ranks once (through the launcher) and stopping a rank also
//! stops what it started.

use clap::Parser;
use rustix::process::{kill_process_group, Pid, Signal};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Starts a program as N local processes with torchrun's variables set.
#[derive(Parser, Debug)]
#[command(name = "cuda-peer-run", version)]
struct Args {
    /// Number of processes (ranks).
    #[arg(short = 'n', long = "nproc", value_parser = clap::value_parser!(u32).range(1..=1024))]
    nproc: u32,
    /// Rendezvous port (MASTER_PORT); default: a free port.
    #[arg(long)]
    master_port: Option<u16>,
    /// Seconds between SIGTERM and SIGKILL when stopping the ranks.
    #[arg(long, default_value_t = 5.0)]
    grace: f64,
    /// The program and its arguments.
    #[arg(required = true, last = true)]
    command: Vec<String>,
}

/// A new job secret: 32 bytes from the kernel's CSPRNG, as 64 hex digits.
fn new_secret() -> std::io::Result<String> {
    let mut b = [0u8; 32];
    let mut filled = 0;
    while filled < b.len() {
        match rustix::rand::getrandom(&mut b[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Rank 0's rendezvous listener, on `port` (0: a free one).
fn listener(port: u16) -> std::io::Result<(std::net::TcpListener, u16)> {
    let l = std::net::TcpListener::bind(("127.0.0.1", port))?;
    let port = l.local_addr()?.port();
    Ok((l, port))
}

/// Lets the next child `cmd` inherit `l` and names its descriptor in the
/// child's `CUDA_PEER_LISTEN_FD`; false (nothing handed) where the
/// descriptor cannot be made inheritable.
fn hand_over(l: &std::net::TcpListener, cmd: &mut Command) -> bool {
    use std::os::fd::AsRawFd;
    match rustix::io::fcntl_setfd(l, rustix::io::FdFlags::empty()) {
        Ok(()) => {
            cmd.env("CUDA_PEER_LISTEN_FD", l.as_raw_fd().to_string());
            true
        }
        Err(e) => {
            eprintln!("cuda-peer-run: rank 0 binds the port itself ({e})");
            false
        }
    }
}

/// The exit code that stands for `status`: its code, or 128 + the signal.
fn code_of(status: ExitStatus) -> i32 {
    status.code().or_else(|| status.signal().map(|s| 128 + s)).unwrap_or(1)
}

/// Sends `sig` to the process group of each rank still running.
fn signal_all(children: &[(Child, Option<ExitStatus>)], sig: Signal) {
    for (child, status) in children {
        if status.is_none() {
            if let Some(pid) = Pid::from_raw(child.id() as i32) {
                let _ = kill_process_group(pid, sig);
            }
        }
    }
}

fn main() {
    let args = Args::parse();
    std::process::exit(run(&args));
}

fn run(args: &Args) -> i32 {
    let n = args.nproc as usize;
    let (rendezvous, port) = match listener(args.master_port.unwrap_or(0)) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("cuda-peer-run: cannot listen on a rendezvous port: {e}");
            return 1;
        }
    };
    // Only the job's ranks can join its rendezvous: they prove this secret.
    let secret = match std::env::var("CUDA_PEER_JOB_SECRET").ok().filter(|s| !s.is_empty()).map(Ok).unwrap_or_else(new_secret) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("cuda-peer-run: no job secret: {e}");
            return 1;
        }
    };
    let caught = Arc::new(AtomicUsize::new(0));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        if let Err(e) = signal_hook::flag::register_usize(sig, caught.clone(), sig as usize) {
            eprintln!("cuda-peer-run: cannot handle signal {sig}: {e}");
            return 1;
        }
    }
    let mut children: Vec<(Child, Option<ExitStatus>)> = Vec::with_capacity(n);
    for rank in 0..n {
        let mut cmd = Command::new(&args.command[0]);
        cmd.args(&args.command[1..])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("CUDA_PEER_JOB_SECRET", &secret)
            .process_group(0);
        // Rank 0 inherits the listener (at the same descriptor number); the
        // others do not.
        let handed = rank == 0 && hand_over(&rendezvous, &mut cmd);
        let spawned = cmd.spawn();
        if handed {
            if let Err(e) = rustix::io::fcntl_setfd(&rendezvous, rustix::io::FdFlags::CLOEXEC) {
                eprintln!("cuda-peer-run: cannot keep the listener from the other ranks: {e}");
                return 1;
            }
        }
        match spawned {
            Ok(c) => children.push((c, None)),
            Err(e) => {
                eprintln!("cuda-peer-run: cannot start rank {rank} ({}): {e}", args.command[0]);
                signal_all(&children, Signal::KILL);
                for (c, _) in &mut children {
                    let _ = c.wait();
                }
                return 127;
            }
        }
    }
    // Rank 0 holds the listener now.
    drop(rendezvous);
    let grace = Duration::from_secs_f64(args.grace.max(0.0));
    let mut first_failure: Option<i32> = None;
    let mut interrupted: Option<i32> = None;
    let mut stopping_since: Option<Instant> = None;
    let mut killed = false;
    loop {
        let sig = caught.swap(0, Ordering::SeqCst);
        if sig != 0 {
            let forward = if sig == signal_hook::consts::SIGINT as usize { Signal::INT } else { Signal::TERM };
            eprintln!("cuda-peer-run: forwarding signal {sig} to the ranks");
            signal_all(&children, forward);
            interrupted.get_or_insert(128 + sig as i32);
            stopping_since.get_or_insert_with(Instant::now);
        }
        let mut running = 0;
        for (rank, (child, status)) in children.iter_mut().enumerate() {
            if status.is_some() {
                continue;
            }
            match child.try_wait() {
                Ok(Some(s)) => {
                    *status = Some(s);
                    if !s.success() && first_failure.is_none() && interrupted.is_none() {
                        eprintln!("cuda-peer-run: rank {rank} failed ({s}); stopping the others");
                        first_failure = Some(code_of(s));
                    }
                }
                Ok(None) => running += 1,
                Err(e) => {
                    eprintln!("cuda-peer-run: waiting for rank {rank}: {e}");
                    first_failure.get_or_insert(1);
                    *status = Some(ExitStatus::from_raw(1 << 8));
                }
            }
        }
        if running == 0 {
            break;
        }
        if first_failure.is_some() && stopping_since.is_none() {
            signal_all(&children, Signal::TERM);
            stopping_since = Some(Instant::now());
        }
        if let Some(t) = stopping_since {
            if !killed && t.elapsed() >= grace {
                signal_all(&children, Signal::KILL);
                killed = true;
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    first_failure.or(interrupted).unwrap_or(0)
}
