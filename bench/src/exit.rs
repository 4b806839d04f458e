//! The error type of the benchmark, and the exit for a setting it cannot
//! measure on.

use cuda_peer::driver;

/// The error type of everything fallible in the benchmark.
pub(crate) type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Exit status when there is nothing to measure on (no GPU, too few, no
/// launcher) or the command line is wrong: one line on stderr says why.
pub(crate) const EXIT_UNUSABLE: i32 = 2;

/// Prints `what` (one line) and exits with [`EXIT_UNUSABLE`].
pub(crate) fn unusable(what: std::fmt::Arguments) -> ! {
    eprintln!("cuda-peer-bench: {what}");
    std::process::exit(EXIT_UNUSABLE)
}

/// The number of CUDA devices, or exit 2 with one line when there is none
/// or fewer than `need`.
pub(crate) fn require_gpus(need: usize) -> usize {
    match driver::device_count() {
        Err(e) => unusable(format_args!("no usable CUDA device: {e}")),
        Ok(0) => unusable(format_args!("no usable CUDA device: {}", cuda_peer::Error::NoDevice)),
        Ok(n) if n < need => unusable(format_args!("needs at least {need} GPUs, found {n}")),
        Ok(n) => n,
    }
}
