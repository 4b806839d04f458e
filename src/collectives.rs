//! The collectives: all-reduce, reduce-scatter, all-gather, broadcast and
//! reduce over a [`Group`]: the all-reduce by the algorithm the group picks
//! for the size, the others as ring schedules run by the ring engine.
//!
//! Every call is asynchronous and ordered on the ranks' streams: each rank's
//! work starts after the pending writers of its buffers and the work already
//! on its stream, and work enqueued on the rank's stream afterwards sees the
//! result. There is no host synchronisation inside. Buffers are cudarc
//! slices or views; rank r's buffers must be on rank r's device.
//!
//! Results are bitwise identical on every rank: each element is combined
//! exactly once, in a fixed order, then copied. A group may be shared
//! between threads; its collectives are then enqueued one at a time.

use crate::algorithms::ring::{self, PullOp};
use crate::algorithms::schedule;
use crate::algorithms::{prescale, prescales, Pick};
use crate::copy::check_context;
use crate::dtype::{Element, ReduceOp};
use crate::error::{cudarc_err, Error, Result};
use crate::group::{Group, Scratch};
use crate::kernels::KernelOp;
use crate::sync::Held;
use cudarc::driver::{DevicePtr, DevicePtrMut};
use std::ops::Range;
use std::sync::Arc;

/// `result`, once every buffer is ordered after the enqueued work (the
/// first error wins).
fn ordered<const N: usize>(result: Result<()>, bufs: [Bufs<'_>; N]) -> Result<()> {
    let mut first = result;
    for b in bufs {
        let r = b.finish();
        if first.is_ok() {
            first = r;
        }
    }
    first
}

/// Pointers to one buffer per rank, with the guards that order the buffers
/// after the collective once it is enqueued (`crate::sync`).
struct Bufs<'a> {
    ptrs: Vec<u64>,
    held: Vec<Held<'a>>,
}

impl Bufs<'_> {
    /// Orders every buffer after the enqueued work now, with the first error.
    fn finish(self) -> Result<()> {
        let mut first = Ok(());
        for h in self.held {
            let r = h.finish();
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

impl Group {
    fn check_bufs<T, S: cudarc::driver::DeviceSlice<T>>(&self, op: &'static str, what: &'static str, bufs: &[S], len: usize) -> Result<()> {
        if bufs.len() != self.size() {
            return Err(Error::InvalidArgument(format!("{op}: {} {what} buffers for a group of {} ranks", bufs.len(), self.size())));
        }
        for (r, b) in bufs.iter().enumerate() {
            check_context(op, what, &self.comm.ranks[r].ctx, b.stream().context())?;
            if b.len() != len {
                return Err(Error::LengthMismatch { op, expected: len, got: b.len() });
            }
        }
        Ok(())
    }

    /// Each rank's buffer ordered for reading on its stream. The ordering
    /// may have made a rank's stream join a capture (a buffer's event
    /// recorded under one): the group looks again ([`Group::see_captures`]).
    fn read_ptrs<'a, T, S: DevicePtr<T>>(&'a self, bufs: &'a [S]) -> Result<Bufs<'a>> {
        let (mut ptrs, mut held) = (Vec::with_capacity(bufs.len()), Vec::with_capacity(bufs.len()));
        for (r, b) in bufs.iter().enumerate() {
            let rank = &self.comm.ranks[r];
            let (p, h) = rank.order.read(b, &rank.stream)?;
            ptrs.push(p);
            held.push(h);
        }
        let bufs = Bufs { ptrs, held };
        self.see_captures()?;
        Ok(bufs)
    }

    /// As [`Self::read_ptrs`], for writing.
    fn write_ptrs<'a, T, D: DevicePtrMut<T>>(&'a self, bufs: &'a mut [D]) -> Result<Bufs<'a>> {
        let (mut ptrs, mut held) = (Vec::with_capacity(bufs.len()), Vec::with_capacity(bufs.len()));
        for (r, b) in bufs.iter_mut().enumerate() {
            let rank = &self.comm.ranks[r];
            let (p, h) = rank.order.write(b, &rank.stream)?;
            ptrs.push(p);
            held.push(h);
        }
        let bufs = Bufs { ptrs, held };
        self.see_captures()?;
        Ok(bufs)
    }

    /// The inputs a reduction of `op` reads: where [`prescales`], each
    /// rank's `count` elements at `ptrs[r]` divided by the rank count into
    /// the group's scratch (on the rank's stream), to be summed, so that an
    /// average cannot overflow where the mean is representable (as every
    /// all-reduce averages); else `ptrs` and `op` as they are.
    fn prescaled<T: Element>(&self, op: ReduceOp, ptrs: &[u64], count: usize, name: &'static str) -> Result<(ReduceOp, Vec<u64>)> {
        if !prescales(op, T::DTYPE, self.size()) {
            return Ok((op, ptrs.to_vec()));
        }
        let scaled = self.scratch(Scratch::Scaled, count * T::DTYPE.size(), name)?;
        for (r, (&to, &from)) in scaled.iter().zip(ptrs).enumerate() {
            prescale(&self.comm, op, T::DTYPE, r, from, to, count)?;
        }
        Ok((ReduceOp::Sum, scaled))
    }

    fn segments<T: Element>(&self, count: usize, parts: usize) -> Vec<Range<usize>> {
        ring::segments(T::DTYPE, count, parts)
    }

    /// In-place all-reduce: every rank's buffer becomes the reduction of all
    /// ranks' buffers. With the mesh ([`crate::group::Algorithm`]) it is one
    /// kernel per rank: rank r reduces segment r of every rank's buffer by
    /// peer loads and writes it back into every rank's buffer by peer
    /// stores, between two device-side barriers. Otherwise it is the ring:
    /// reduce-scatter then all-gather, where over P2P links each step is one
    /// fused kernel that reads the predecessor's memory. Buffers are `Send`
    /// (cudarc's slices and views are): with launcher threads
    /// ([`crate::GroupOptions::launch_spin`]) each rank's buffer is taken
    /// and its event recorded on that rank's launcher.
    pub fn all_reduce_in_place<T: Element, D: DevicePtrMut<T> + Send>(&self, bufs: &mut [D], op: ReduceOp) -> Result<()> {
        let _serial = self.enter()?;
        op.check(T::DTYPE)?;
        let count = bufs.first().map(|b| b.len()).unwrap_or(0);
        self.check_bufs("all_reduce", "buffer", bufs, count)?;
        let pick = self.pick(count * T::DTYPE.size());
        if let (Pick::OneShot(os), true) = (&pick, count > 0 && streams_distinct(bufs)) {
            return os.in_place(&self.comm, op, bufs, count, &|| self.keep_alive());
        }
        let b = self.write_ptrs(bufs)?;
        let r = pick.enqueue(&self.comm, op, T::DTYPE, &b.ptrs, &b.ptrs, count);
        // The call's place in the order of calls before the buffers' events.
        self.comm.end_calls();
        ordered(r, [b])
    }

    /// Out-of-place all-reduce: `recv[r]` becomes the reduction of every
    /// `send`; `send` is unchanged. The bounds are those of
    /// [`Self::all_reduce_in_place`]'s (cudarc's slices and views meet
    /// them): with launcher threads each rank's buffers are taken on its
    /// launcher.
    pub fn all_reduce<T: Element, S: DevicePtr<T> + Sync, D: DevicePtrMut<T> + Send>(&self, send: &[S], recv: &mut [D], op: ReduceOp) -> Result<()> {
        let _serial = self.enter()?;
        op.check(T::DTYPE)?;
        let count = send.first().map(|b| b.len()).unwrap_or(0);
        self.check_bufs("all_reduce", "send", send, count)?;
        self.check_bufs("all_reduce", "recv", recv, count)?;
        let pick = self.pick(count * T::DTYPE.size());
        if let (Pick::OneShot(os), true) = (&pick, count > 0 && streams_distinct(send) && streams_distinct(recv)) {
            return os.out_of_place(&self.comm, op, send, recv, count, &|| self.keep_alive());
        }
        let s = self.read_ptrs(send)?;
        let d = self.write_ptrs(recv)?;
        let r = pick.enqueue(&self.comm, op, T::DTYPE, &s.ptrs, &d.ptrs, count);
        // The call's place in the order of calls before the buffers' events.
        self.comm.end_calls();
        ordered(r, [s, d])
    }

    /// Reduce-scatter: `send[r]` holds `size() * c` elements; `recv[r]`
    /// (c elements) becomes block r of the reduction. For groups of three or
    /// more ranks, each rank keeps one scratch buffer of `c` elements
    /// (allocated on first use, kept with the group, grown when needed).
    pub fn reduce_scatter<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &[S], recv: &mut [D], op: ReduceOp) -> Result<()> {
        let _serial = self.enter()?;
        op.check(T::DTYPE)?;
        let n = self.size();
        let c = recv.first().map(|b| b.len()).unwrap_or(0);
        let total = c.checked_mul(n).ok_or_else(|| Error::InvalidArgument("reduce_scatter: count overflows".into()))?;
        self.check_bufs("reduce_scatter", "recv", recv, c)?;
        self.check_bufs("reduce_scatter", "send", send, total)?;
        if c == 0 {
            return Ok(());
        }
        let esz = T::DTYPE.size();
        let s = self.read_ptrs(send)?;
        let d = self.write_ptrs(recv)?;
        let r = (|| -> Result<()> {
            if n == 1 {
                return self.comm.local_copy(0, d.ptrs[0], s.ptrs[0], c * esz);
            }
            // Taken once the buffers' ordering has shown whether the call is captured.
            let scratch = if n >= 3 { self.scratch(Scratch::Partial, c * esz, "reduce_scatter")? } else { Vec::new() };
            self.comm.check_reach("reduce_scatter", &s.ptrs, false)?;
            self.comm.check_reach("reduce_scatter", &d.ptrs, false)?;
            let (op, src) = self.prescaled::<T>(op, &s.ptrs, total, "reduce_scatter")?;
            self.comm.check_reach("reduce_scatter", &src, false)?;
            let partial = |r: usize, which: usize| if which == 0 { d.ptrs[r] } else { scratch[r] };
            let blk = |q: usize| (q * c * esz) as u64;
            let steps: Vec<Vec<Option<PullOp>>> = schedule::reduce_scatter(n)
                .into_iter()
                .enumerate()
                .map(|(st, step)| {
                    (0..n)
                        .map(|r| {
                            let pred = (r + n - 1) % n;
                            let q = step[r].part();
                            let from = if st == 0 { src[pred] + blk(q) } else { partial(pred, schedule::partial_buffer(n, st - 1)) };
                            Some(PullOp::Reduce { dst: partial(r, schedule::partial_buffer(n, st)), pred: from, own: src[r] + blk(q), count: c })
                        })
                        .collect()
                })
                .collect();
            ring::run(&self.comm, KernelOp::of(op), T::DTYPE, &steps)
        })();
        // The call's place in the order of calls before the buffers' events.
        self.comm.end_calls();
        ordered(r, [s, d])
    }

    /// All-gather: `send[r]` holds c elements; every `recv[r]` (`size() * c`
    /// elements) becomes the concatenation of all `send`s in rank order.
    pub fn all_gather<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &[S], recv: &mut [D]) -> Result<()> {
        let _serial = self.enter()?;
        let n = self.size();
        let c = send.first().map(|b| b.len()).unwrap_or(0);
        let total = c.checked_mul(n).ok_or_else(|| Error::InvalidArgument("all_gather: count overflows".into()))?;
        self.check_bufs("all_gather", "send", send, c)?;
        self.check_bufs("all_gather", "recv", recv, total)?;
        if c == 0 {
            return Ok(());
        }
        let bytes = c * T::DTYPE.size();
        let s = self.read_ptrs(send)?;
        let d = self.write_ptrs(recv)?;
        let r = (|| -> Result<()> {
            for r in 0..n {
                self.comm.local_copy(r, d.ptrs[r] + (r * bytes) as u64, s.ptrs[r], bytes)?;
            }
            let steps: Vec<Vec<Option<PullOp>>> = schedule::all_gather(n)
                .into_iter()
                .map(|step| {
                    (0..n)
                        .map(|r| {
                            let off = (step[r].part() * bytes) as u64;
                            Some(PullOp::Copy { dst: d.ptrs[r] + off, pred: d.ptrs[(r + n - 1) % n] + off, bytes })
                        })
                        .collect()
                })
                .collect();
            ring::run(&self.comm, KernelOp::Sum, T::DTYPE, &steps)
        })();
        // The call's place in the order of calls before the buffers' events.
        self.comm.end_calls();
        ordered(r, [s, d])
    }

    /// Chunks for the pipelined chains: one for two ranks (nothing to
    /// overlap), else about 1 MiB each, at most 64.
    fn chain_chunks<T: Element>(&self, count: usize) -> Vec<Range<usize>> {
        let bytes = count * T::DTYPE.size();
        let parts = if self.size() <= 2 { 1 } else { bytes.div_ceil(1 << 20).clamp(1, 64) };
        self.segments::<T>(count, parts).into_iter().filter(|r| !r.is_empty()).collect()
    }

    /// Broadcast in place: every rank's buffer becomes a copy of `root`'s.
    /// A chain from the root, pipelined in chunks.
    pub fn broadcast<T: Element, D: DevicePtrMut<T>>(&self, bufs: &mut [D], root: usize) -> Result<()> {
        let _serial = self.enter()?;
        let n = self.size();
        crate::error::check_root(root, n)?;
        let count = bufs.first().map(|b| b.len()).unwrap_or(0);
        self.check_bufs("broadcast", "buffer", bufs, count)?;
        let chunks = self.chain_chunks::<T>(count);
        let esz = T::DTYPE.size();
        let b = self.write_ptrs(bufs)?;
        let r = {
            let steps: Vec<Vec<Option<PullOp>>> = schedule::broadcast(n, root, chunks.len())
                .into_iter()
                .map(|step| {
                    (0..n)
                        .map(|r| {
                            step[r].map(|a| {
                                let ch = &chunks[a.part()];
                                let off = (ch.start * esz) as u64;
                                PullOp::Copy { dst: b.ptrs[r] + off, pred: b.ptrs[(r + n - 1) % n] + off, bytes: ch.len() * esz }
                            })
                        })
                        .collect()
                })
                .collect();
            ring::run(&self.comm, KernelOp::Sum, T::DTYPE, &steps)
        };
        // The call's place in the order of calls before the buffers' events.
        self.comm.end_calls();
        ordered(r, [b])
    }

    /// Reduce to `root`: `recv[root]` becomes the reduction of every `send`.
    /// Every rank's `recv` is used as working space (a chain from root+1 to
    /// the root, pipelined in chunks); only the root's holds the result.
    pub fn reduce<T: Element, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, send: &[S], recv: &mut [D], root: usize, op: ReduceOp) -> Result<()> {
        let _serial = self.enter()?;
        op.check(T::DTYPE)?;
        let n = self.size();
        crate::error::check_root(root, n)?;
        let count = send.first().map(|b| b.len()).unwrap_or(0);
        self.check_bufs("reduce", "send", send, count)?;
        self.check_bufs("reduce", "recv", recv, count)?;
        if count == 0 {
            return Ok(());
        }
        let esz = T::DTYPE.size();
        let s = self.read_ptrs(send)?;
        let d = self.write_ptrs(recv)?;
        let r = (|| -> Result<()> {
            if n == 1 {
                return self.comm.local_copy(0, d.ptrs[0], s.ptrs[0], count * esz);
            }
            self.comm.check_reach("reduce", &s.ptrs, false)?;
            self.comm.check_reach("reduce", &d.ptrs, false)?;
            let (op, src) = self.prescaled::<T>(op, &s.ptrs, count, "reduce")?;
            self.comm.check_reach("reduce", &src, false)?;
            let chunks = self.chain_chunks::<T>(count);
            let start = (root + 1) % n; // chain position 0 reads its send buffer
            let steps: Vec<Vec<Option<PullOp>>> = schedule::reduce(n, root, chunks.len())
                .into_iter()
                .map(|step| {
                    (0..n)
                        .map(|r| {
                            step[r].map(|a| {
                                let pred = (r + n - 1) % n;
                                let ch = &chunks[a.part()];
                                let off = (ch.start * esz) as u64;
                                let from = if pred == start { src[pred] } else { d.ptrs[pred] };
                                PullOp::Reduce { dst: d.ptrs[r] + off, pred: from + off, own: src[r] + off, count: ch.len() }
                            })
                        })
                        .collect()
                })
                .collect();
            ring::run(&self.comm, KernelOp::of(op), T::DTYPE, &steps)
        })();
        // The call's place in the order of calls before the buffers' events.
        self.comm.end_calls();
        ordered(r, [s, d])
    }

    /// Per-rank scratch `which` of at least `bytes`, kept with the group
    /// (grown by an eager call; under capture, growing it is an error).
    fn scratch(&self, which: Scratch, bytes: usize, op: &'static str) -> Result<Vec<u64>> {
        let mut held = self.scratch[which as usize].lock().unwrap_or_else(|p| p.into_inner());
        if held.len() != self.size() || held.iter().any(|s| s.len() < bytes) {
            if self.comm.capturing() {
                return Err(Error::Capture {
                    op,
                    reason: format!(
                        "its scratch ({bytes} bytes per rank) is allocated by an eager call of this size or larger, made before the capture"
                    ),
                });
            }
            // Graphs captured earlier keep the old scratch alive themselves.
            held.clear();
            for rank in &self.comm.ranks {
                // SAFETY: scratch is written (by a copy or a reduction) before it is read.
                held.push(Arc::new(unsafe { rank.stream.alloc::<u8>(bytes) }.map_err(cudarc_err("cuMemAlloc (scratch)"))?));
            }
        }
        Ok(held.iter().enumerate().map(|(r, s)| s.device_ptr(&self.comm.ranks[r].stream).0).collect())
    }
}

/// Whether no two ranks' buffers were last used on one stream. The
/// one-shot orders each rank's buffers on that rank's launcher, and a rank
/// hands its buffer back to the buffer's stream right after its kernel: two
/// ranks whose buffers share one stream (ranks sharing a device, buffers on
/// its default stream) would then have the second rank's kernel wait, on
/// that stream, for the first's, which waits for the second's on the device
/// (until the barrier timeout). Such buffers take the path that orders
/// every rank's buffers before any kernel.
fn streams_distinct<T, B: cudarc::driver::DeviceSlice<T>>(bufs: &[B]) -> bool {
    let streams: Vec<(usize, usize)> = bufs.iter().map(|b| (b.stream().context().cu_ctx() as usize, b.stream().cu_stream() as usize)).collect();
    streams.iter().enumerate().all(|(i, s)| !streams[..i].contains(s))
}
