//! `cuda-peer`: `cuda-peer doctor [--json] [--wake]`.

use clap::{Parser, Subcommand};
use cuda_peer_cli::{doctor, gpu, report, DoctorOptions};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(name = "cuda-peer", version, about = "CUDA peer memory tools")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Checks every ordered pair of GPUs: system facts (IOMMU, ACS, BAR1,
    /// PCIe path, driver), the driver's answers, functional P2P checks and
    /// speeds, and a verdict with its reason and fix. Exit status 0: every
    /// pair usable at full speed; 1: something degraded; 2: nothing usable
    /// or no GPU.
    Doctor {
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        /// First create and destroy a context on each GPU, reporting NVML's
        /// utilisation before and after.
        #[arg(long)]
        wake: bool,
        /// Seconds each check process may run.
        #[arg(long, default_value_t = 20)]
        timeout: u64,
        /// Bytes per bandwidth copy.
        #[arg(long, default_value_t = 64 << 20)]
        bytes: usize,
        /// Start no new checks after this many seconds (a pair whose checks
        /// it cuts is reported but not cached).
        #[arg(long, default_value_t = 60)]
        budget: u64,
        /// Do not write the verdict cache (written to $CUDA_PEER_DOCTOR_CACHE,
        /// else $XDG_CACHE_HOME/cuda-peer/doctor.json or ~/.cache/cuda-peer/doctor.json).
        #[arg(long)]
        no_cache: bool,
        /// Read sysfs and procfs under this directory instead of `/` (for tests).
        #[arg(long, hide = true, default_value = "/")]
        root: PathBuf,
    },
    /// One check in a child process (used by `doctor`).
    #[command(name = "__check", hide = true)]
    Check {
        /// copy, mesh or oneshot.
        kind: String,
        /// Source GPU.
        from: usize,
        /// Destination GPU.
        to: usize,
        /// Bytes per bandwidth copy.
        #[arg(long, default_value_t = 64 << 20)]
        bytes: usize,
    },
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.command {
        Cmd::Check { kind, from, to, bytes } => match gpu::ChildKind::parse(&kind) {
            Some(k) => gpu::run_child(k, from, to, bytes),
            None => {
                eprintln!("cuda-peer __check: unknown check {kind:?}");
                2
            }
        },
        Cmd::Doctor { json, wake, timeout, bytes, budget, no_cache, root } => {
            // Where the library reads it: $CUDA_PEER_DOCTOR_CACHE, else the XDG cache.
            let cache_path = if no_cache { None } else { cuda_peer::verdict::cache_path() };
            let opts = DoctorOptions {
                root,
                wake,
                timeout: Duration::from_secs(timeout),
                bytes: bytes.max(4096),
                budget: Duration::from_secs(budget),
                cache_path,
            };
            let r = doctor(&opts);
            if json {
                match serde_json::to_string_pretty(&r) {
                    Ok(s) => println!("{s}"),
                    Err(e) => eprintln!("cuda-peer doctor: cannot write JSON: {e}"),
                }
            } else {
                print!("{}", report::render(&r));
            }
            r.exit_code
        }
    };
    std::process::exit(code);
}
