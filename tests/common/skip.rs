//! The one way a test says that it skipped, wholly or in part: a line
//! `SKIPPED <test>: <why>` on the process's standard error.
//!
//! libtest captures what a test prints through `print!` and `eprintln!`
//! and shows it only when the test fails, so a skip printed that way is
//! invisible in a passing run. The line is written to the stderr handle
//! itself, which libtest does not capture. Standard library only, so that
//! the tests of other crates of the workspace (`cli/tests`) include this
//! file too (`#[path = "../../tests/common/skip.rs"]`).
#![allow(dead_code)]

use std::io::Write;

/// The running test's name: libtest names each test's thread after the
/// test; where the test runs on the main thread, `fallback`.
pub fn test_name(fallback: &str) -> String {
    let current = std::thread::current();
    current.name().filter(|n| *n != "main").unwrap_or(fallback).to_string()
}

/// Prints `SKIPPED <test>: <why>` past libtest's capture. A test that
/// covers only part of its cases says which part it left out in `why`.
pub fn skipped(test: &str, why: impl std::fmt::Display) {
    let line = format!("SKIPPED {}: {why}\n", test_name(test));
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(line.as_bytes());
    let _ = err.flush();
}
