//! What the examples share: the one line and exit status 2 of a machine
//! with no usable GPU (CI runs every example on such a machine and checks
//! exactly that).

// Each example uses what it needs of this module.
#![allow(dead_code)]

use cuda_peer::driver;

/// How many CUDA devices there are; with none, or no usable driver, prints
/// `NAME: no usable CUDA device: WHY` on stderr and exits with status 2.
pub fn gpus_or_exit(name: &str) -> usize {
    match driver::device_count() {
        Ok(0) => no_device(name, &cuda_peer::Error::NoDevice),
        Ok(n) => n,
        Err(e) => no_device(name, &e),
    }
}

/// Prints `NAME: no usable CUDA device: WHY` on stderr and exits with
/// status 2 (for a device that fails later, at its first context).
pub fn no_device(name: &str, why: &dyn std::fmt::Display) -> ! {
    eprintln!("{name}: no usable CUDA device: {why}");
    std::process::exit(2)
}
