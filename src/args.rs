//! The argument checks of each per-rank collective, written once for every
//! engine ([`crate::ipc::Comm`], [`crate::ipc::NcclComm`], the two tiers):
//! the op for the element type, the root, every buffer on the rank's
//! context, the lengths. Each returns the count the call moves, so that an
//! engine checks before it orders or enqueues anything, and every engine
//! refuses a bad call with the same error.

use crate::copy::check_context;
use crate::dtype::{Element, ReduceOp};
use crate::error::{check_root, Error, Result};
use cudarc::driver::{CudaContext, DeviceSlice};

fn on<T, B: DeviceSlice<T>>(ctx: &CudaContext, op: &'static str, what: &'static str, b: &B) -> Result<()> {
    check_context(op, what, ctx, b.stream().context())
}

fn same_len(op: &'static str, expected: usize, got: usize) -> Result<()> {
    if got != expected {
        return Err(Error::LengthMismatch { op, expected, got });
    }
    Ok(())
}

/// `per * ranks`, or an error naming `op`.
fn times(op: &'static str, per: usize, ranks: usize) -> Result<usize> {
    per.checked_mul(ranks).ok_or_else(|| Error::InvalidArgument(format!("{op}: count overflows")))
}

/// All-reduce: `send` and `recv` of one length; the count.
pub(crate) fn all_reduce<T: Element, S: DeviceSlice<T>, D: DeviceSlice<T>>(ctx: &CudaContext, send: &S, recv: &D, op: ReduceOp) -> Result<usize> {
    op.check(T::DTYPE)?;
    on(ctx, "all_reduce", "send", send)?;
    on(ctx, "all_reduce", "recv", recv)?;
    same_len("all_reduce", send.len(), recv.len())?;
    Ok(send.len())
}

/// All-reduce in place: the count.
pub(crate) fn all_reduce_in_place<T: Element, D: DeviceSlice<T>>(ctx: &CudaContext, buf: &D, op: ReduceOp) -> Result<usize> {
    op.check(T::DTYPE)?;
    on(ctx, "all_reduce", "buffer", buf)?;
    Ok(buf.len())
}

/// All-gather over `ranks`: `recv` holds `ranks` times `send`; the count
/// of one rank's part.
pub(crate) fn all_gather<T, S: DeviceSlice<T>, D: DeviceSlice<T>>(ctx: &CudaContext, ranks: usize, send: &S, recv: &D) -> Result<usize> {
    on(ctx, "all_gather", "send", send)?;
    on(ctx, "all_gather", "recv", recv)?;
    same_len("all_gather", times("all_gather", send.len(), ranks)?, recv.len())?;
    Ok(send.len())
}

/// Reduce-scatter over `ranks`: `send` holds `ranks` times `recv`; the
/// count of one rank's part.
pub(crate) fn reduce_scatter<T: Element, S: DeviceSlice<T>, D: DeviceSlice<T>>(
    ctx: &CudaContext,
    ranks: usize,
    send: &S,
    recv: &D,
    op: ReduceOp,
) -> Result<usize> {
    op.check(T::DTYPE)?;
    on(ctx, "reduce_scatter", "send", send)?;
    on(ctx, "reduce_scatter", "recv", recv)?;
    same_len("reduce_scatter", times("reduce_scatter", recv.len(), ranks)?, send.len())?;
    Ok(recv.len())
}

/// Broadcast from `root` of `ranks`, on rank `rank`: the root's `send`
/// (which it must pass, of `recv`'s length; the others' is ignored), or
/// `None` off the root.
pub(crate) fn broadcast<'a, T, S: DeviceSlice<T>, D: DeviceSlice<T>>(
    ctx: &CudaContext,
    ranks: usize,
    rank: usize,
    send: Option<&'a S>,
    recv: &D,
    root: usize,
) -> Result<Option<&'a S>> {
    check_root(root, ranks)?;
    on(ctx, "broadcast", "recv", recv)?;
    if rank != root {
        return Ok(None);
    }
    let send = send.ok_or_else(|| Error::InvalidArgument("broadcast: the root passes no send buffer".into()))?;
    on(ctx, "broadcast", "send", send)?;
    same_len("broadcast", recv.len(), send.len())?;
    Ok(Some(send))
}

/// Broadcast in place from `root` of `ranks`: the count.
pub(crate) fn broadcast_in_place<T, D: DeviceSlice<T>>(ctx: &CudaContext, ranks: usize, buf: &D, root: usize) -> Result<usize> {
    check_root(root, ranks)?;
    on(ctx, "broadcast", "buffer", buf)?;
    Ok(buf.len())
}

/// Reduce to `root` of `ranks`: `send` and `recv` of one length; the
/// count.
pub(crate) fn reduce<T: Element, S: DeviceSlice<T>, D: DeviceSlice<T>>(
    ctx: &CudaContext,
    ranks: usize,
    send: &S,
    recv: &D,
    op: ReduceOp,
    root: usize,
) -> Result<usize> {
    op.check(T::DTYPE)?;
    check_root(root, ranks)?;
    on(ctx, "reduce", "send", send)?;
    on(ctx, "reduce", "recv", recv)?;
    same_len("reduce", send.len(), recv.len())?;
    Ok(send.len())
}

/// Reduce in place to `root` of `ranks`: the count.
pub(crate) fn reduce_in_place<T: Element, D: DeviceSlice<T>>(ctx: &CudaContext, ranks: usize, buf: &D, op: ReduceOp, root: usize) -> Result<usize> {
    op.check(T::DTYPE)?;
    check_root(root, ranks)?;
    on(ctx, "reduce", "buffer", buf)?;
    Ok(buf.len())
}

/// The parts of a collective with uneven parts over `ranks`: the prefix
/// sums of `counts` (one per rank), and their total.
pub(crate) fn parts(op: &'static str, counts: &[usize], ranks: usize) -> Result<(Vec<usize>, usize)> {
    if counts.len() != ranks {
        return Err(Error::InvalidArgument(format!("{op}: {} counts for {ranks} ranks", counts.len())));
    }
    let mut offsets = Vec::with_capacity(ranks);
    let mut total = 0usize;
    for &c in counts {
        offsets.push(total);
        total = total.checked_add(c).ok_or_else(|| Error::InvalidArgument(format!("{op}: the counts overflow")))?;
    }
    Ok((offsets, total))
}

/// All-gather with uneven parts on rank `rank` of `ranks`: `send` holds
/// `counts[rank]`, `recv` their total; the parts' offsets and the total.
pub(crate) fn all_gather_v<T, S: DeviceSlice<T>, D: DeviceSlice<T>>(
    ctx: &CudaContext,
    ranks: usize,
    rank: usize,
    send: &S,
    recv: &D,
    counts: &[usize],
) -> Result<(Vec<usize>, usize)> {
    const OP: &str = "all_gather_v";
    on(ctx, OP, "send", send)?;
    on(ctx, OP, "recv", recv)?;
    let (offsets, total) = parts(OP, counts, ranks)?;
    same_len(OP, counts[rank], send.len())?;
    same_len(OP, total, recv.len())?;
    Ok((offsets, total))
}

/// Reduce-scatter with uneven parts on rank `rank` of `ranks`: `send`
/// holds the counts' total, `recv` `counts[rank]`; the parts' offsets and
/// the total.
pub(crate) fn reduce_scatter_v<T: Element, S: DeviceSlice<T>, D: DeviceSlice<T>>(
    ctx: &CudaContext,
    ranks: usize,
    rank: usize,
    send: &S,
    recv: &D,
    counts: &[usize],
    op: ReduceOp,
) -> Result<(Vec<usize>, usize)> {
    const OP: &str = "reduce_scatter_v";
    op.check(T::DTYPE)?;
    on(ctx, OP, "send", send)?;
    on(ctx, OP, "recv", recv)?;
    let (offsets, total) = parts(OP, counts, ranks)?;
    same_len(OP, total, send.len())?;
    same_len(OP, counts[rank], recv.len())?;
    Ok((offsets, total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_prefix_sums() {
        assert_eq!(parts("agv", &[3, 0, 5], 3).unwrap(), (vec![0, 3, 3], 8));
        assert!(matches!(parts("agv", &[3, 0], 3), Err(Error::InvalidArgument(m)) if m.contains("2 counts")));
        assert!(matches!(parts("agv", &[usize::MAX, 1], 2), Err(Error::InvalidArgument(m)) if m.contains("overflow")));
        assert!(times("ag", usize::MAX, 2).is_err());
        assert!(matches!(same_len("x", 3, 4), Err(Error::LengthMismatch { op: "x", expected: 3, got: 4 })));
    }
}
