//! The one harness both modes run: a [`Backend`] (an implementation set
//! up over the ranks of this process, or as this process's rank of
//! several) measures points, and [`sweep`] runs the plan's points on it in
//! order, printing the table and appending the CSV.

use crate::cli::Common;
use crate::data::BenchElem;
use crate::exit::Res;
use crate::kinds::{Dt, Op};
use crate::output::{print_table_header, Csv, Row};
use crate::plan::{Plan, Progress, Shape};
use half::bf16;
use std::path::Path;

/// One point, checked and timed.
pub(crate) struct Measured {
    /// The table's and the CSV's row.
    pub(crate) row: Row,
    /// The host's time per call spent enqueueing, where the backend measures it.
    pub(crate) host_us: Option<f64>,
}

/// An implementation under test, ready to measure points: the ranks of one
/// process (`sweep`), or this process's rank of several (`mp`).
pub(crate) trait Backend {
    /// The name in the table and the CSV.
    fn name(&self) -> &'static str;

    /// Whether this process counts the progress, prints the table and
    /// writes the CSV (the one process; rank 0 of several).
    fn leads(&self) -> bool;

    /// What a point's error starts with (which rank, where there are several processes).
    fn whose(&self) -> String {
        String::new()
    }

    /// Checks, then times, one point.
    fn measure<T: BenchElem>(&self, common: &Common, op: Op, dt: Dt, shape: Shape) -> Res<Measured>;
}

/// Runs every point of `plan` on `backend`; the leading process prints
/// each row and appends it to the CSV at `csv`.
pub(crate) fn sweep<B: Backend>(backend: &B, common: &Common, plan: &Plan, progress: &mut Progress, csv: &Path) -> Res<()> {
    let mut csv = if backend.leads() { Some(Csv::append(csv)?) } else { None };
    if csv.is_some() {
        print_table_header();
    }
    let name = backend.name();
    for (op, dt, shape) in plan.points() {
        if csv.is_some() {
            progress.tick(format_args!("{name} {} {} {}", op.name(), dt.name(), shape.bytes));
        }
        let point = match dt {
            Dt::F32 => backend.measure::<f32>(common, op, dt, shape),
            Dt::Bf16 => backend.measure::<bf16>(common, op, dt, shape),
        }
        .map_err(|e| format!("{}{name} {} {} {} bytes: {e}", backend.whose(), op.name(), dt.name(), shape.bytes))?;
        if let Some(csv) = &mut csv {
            point.row.print();
            if let Some(host_us) = point.host_us {
                // Host time per call, enqueue only (the slowest rank's):
                // above the device time, the calls are host-bound.
                println!("#   host enqueue {host_us:.2} us per call");
            }
            csv.line(&point.row.csv())?;
        }
    }
    Ok(())
}
