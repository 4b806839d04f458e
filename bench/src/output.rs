//! What the modes write: one measured point as a row of the stdout table
//! and of the CSV, the CSV files (written a line at a time, read back for
//! the summaries).

use crate::exit::Res;
use crate::kinds::{Dt, Op};
use crate::plan::Shape;
use std::collections::HashMap;
use std::io::Write as _;
use std::path::Path;

/// One measured point.
#[derive(Debug, Clone)]
pub(crate) struct Row {
    pub(crate) imp: &'static str,
    pub(crate) op: Op,
    pub(crate) dt: Dt,
    pub(crate) ranks: usize,
    pub(crate) shape: Shape,
    pub(crate) time_us: f64,
    pub(crate) wrong: u64,
    pub(crate) sampled: bool,
}

impl Row {
    pub(crate) fn algbw(&self) -> f64 {
        self.shape.bytes as f64 / self.time_us / 1e3
    }

    pub(crate) fn busbw(&self) -> f64 {
        self.algbw() * self.op.bus_factor(self.ranks)
    }

    pub(crate) fn csv(&self) -> String {
        format!(
            "{},{},{},{},{},{},{:.3},{:.6},{:.6},{}",
            self.imp,
            self.op.name(),
            self.dt.name(),
            self.op.redop(),
            self.ranks,
            self.shape.bytes,
            self.time_us,
            self.algbw(),
            self.busbw(),
            self.wrong
        )
    }

    pub(crate) fn print(&self) {
        println!(
            "{:>16} {:>14} {:>5} {:>5} {:>12} {:>11} {:>10.2} {:>8.2} {:>8.2} {:>7} {:>7}",
            self.imp,
            self.op.name(),
            self.dt.name(),
            self.op.redop(),
            self.shape.bytes,
            self.shape.count,
            self.time_us,
            self.algbw(),
            self.busbw(),
            self.wrong,
            if self.sampled { "sampled" } else { "all" }
        );
    }
}

pub(crate) const CSV_HEADER: &str = "impl,collective,dtype,op,ranks,bytes,time_us,algbw_gbs,busbw_gbs,wrong";
pub(crate) const COPY_CSV_HEADER: &str = "path,src,dst,direction,bytes,time_us,gbs";

pub(crate) fn print_table_header() {
    println!(
        "#{:>15} {:>14} {:>5} {:>5} {:>12} {:>11} {:>10} {:>8} {:>8} {:>7} {:>7}",
        "impl", "collective", "dtype", "redop", "bytes", "count", "time_us", "algbw", "busbw", "#wrong", "checked"
    );
}

/// Appends lines to a CSV file, one write per line, so that a run cut short keeps what it measured.
pub(crate) struct Csv(std::fs::File);

impl Csv {
    pub(crate) fn create(path: &Path, header: &str) -> Res<Csv> {
        let mut f = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
        writeln!(f, "{header}")?;
        Ok(Csv(f))
    }

    pub(crate) fn append(path: &Path) -> Res<Csv> {
        Ok(Csv(std::fs::OpenOptions::new().append(true).open(path).map_err(|e| format!("{}: {e}", path.display()))?))
    }

    pub(crate) fn line(&mut self, line: &str) -> Res<()> {
        self.0.write_all(format!("{line}\n").as_bytes())?;
        Ok(())
    }
}

/// all_reduce's `(time_us, busbw)` by `(impl, dtype, bytes)`, from a CSV
/// of [`CSV_HEADER`]'s columns.
pub(crate) type AllReduceTimes = HashMap<(String, String, usize), (f64, f64)>;

/// Reads back the all_reduce rows of a CSV this program wrote (the NCCL
/// children's rows included).
pub(crate) fn all_reduce_times(path: &Path) -> Res<AllReduceTimes> {
    let text = std::fs::read_to_string(path)?;
    let mut ar = AllReduceTimes::new();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        if f.len() == 10 && f[1] == "all_reduce" {
            if let (Ok(bytes), Ok(t), Ok(bw)) = (f[5].parse(), f[6].parse(), f[8].parse()) {
                ar.insert((f[0].to_string(), f[2].to_string(), bytes), (t, bw));
            }
        }
    }
    Ok(ar)
}
