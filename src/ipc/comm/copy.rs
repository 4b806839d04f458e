//! The copy-engine lane of the all-reduce between processes: for large
//! messages over P2P, each rank's copy engines push its rounds into the
//! peers' slots while its SMs only reduce, since copy engines carry more over
//! NVLink than SM stores (`bench/NOTES.md`, ceilings).
//!
//! Per call, on this rank: an event on the communicator's stream before the
//! kernel; the kernel (the one-shot in [`OneShotPipeline::Copy`] mode: it
//! waits, reduces and frees each set); then, on this lane's own copy stream,
//! a wait for that event and per round v and peer k: wait until k has freed
//! the set of round v - 4 in its region (`cuStreamWaitValue32` on k's
//! `COPY_FREED` word of that set, which k's kernel writes into this rank's
//! region), copy the round into this rank's slot of k's region, and write
//! k's `COPY_ARRIVED` word of the set in this rank's row; after every peer,
//! this rank's own `COPY_SENT` word of the set (the kernel reduces round v
//! only after it, as the input may be the output). Round v goes on copy
//! stream v mod 4 (one per set): on one stream, each round's words and
//! waits left the copy engine idle for about as long as the copy took
//! (1.36-1.39x the SM lane's time, `bench/NOTES.md`). Last, events join the
//! copy streams back into the communicator's stream, so that the caller's
//! buffers are released only after the copies.
//!
//! The words carry absolute round numbers, which the host computes from its
//! own count of the lane's rounds (the kernel's from its block counters:
//! both start at zero and advance by the same rounds per call). Graph
//! replays would repeat the captured numbers, so a call being captured
//! takes an SM lane instead (and says so in its call descriptor, so that
//! ranks capturing and ranks not are a mismatch, not a hang).
//!
//! Failure: a copy stream waits without bound, so nothing may leave it
//! waiting. A kernel that gives up (a timeout, an abort) marks its rank dead
//! in every peer's region and moves its own rank's `COPY_FREED` words far
//! ahead: its copy stream's waits then pass (the peers that still read see
//! the mark and report the failure). A rank whose enqueue fails part way
//! aborts its kernel, which does the same.

use super::Comm;
use crate::algorithms::oneshot::LaneLayout;
use crate::driver::{bind, copy_async, raw_stream, stream_write_value};
use crate::error::{cudarc_err, Result};
use crate::kernels::load::PtrArray;
use crate::kernels::{self, OneShotPipeline};
use cudarc::driver::{CudaEvent, CudaStream};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

/// The copy-engine lane as this rank launches it.
pub(super) struct CopyLane {
    /// Its grid, slot bytes and offset (pipeline [`OneShotPipeline::Copy`]).
    pub(super) layout: LaneLayout,
    /// The smallest message in bytes per rank that takes it.
    pub(super) min_bytes: usize,
    /// The peers' regions at this lane (the kernel frees sets there).
    pub(super) push: PtrArray,
    /// This rank's own region at this lane.
    pub(super) pull: u64,
    /// This rank's block counters of this lane.
    pub(super) counters: u64,
    /// Per peer: its rank and its region at this lane, as mapped here.
    pub(super) peers: Vec<(usize, u64)>,
    /// The streams the copies and words are enqueued on, one per set (round
    /// v on stream v mod ONESHOT_SETS), so that one round's copies run while
    /// another's words are written and waited for.
    pub(super) streams: Vec<Arc<CudaStream>>,
    /// Recorded on the communicator's stream before the kernel.
    pub(super) start: CudaEvent,
    /// Recorded on each copy stream after a call's copies.
    pub(super) ends: Vec<CudaEvent>,
    /// Rounds run on this lane so far (the kernel's block counters).
    pub(super) rounds: AtomicU32,
}

impl CopyLane {
    /// Byte address of word `word` of rank `row`'s row in the lane's flag
    /// area of the region at `region`.
    fn word(region: u64, row: usize, word: usize) -> u64 {
        region + ((row * kernels::ONESHOT_MAX_BLOCKS + word) * 4) as u64
    }
}

impl Comm {
    /// Enqueues the copies of one call on the copy-engine lane (after its
    /// kernel, see the module docs): `count` elements of `esz` bytes from
    /// `input`. On failure part way the kernels are told to give up and the
    /// communicator fails.
    pub(super) fn copy_rounds(&self, lane: &CopyLane, input: u64, count: usize, esz: usize) -> Result<()> {
        debug_assert_eq!(lane.layout.pipeline, OneShotPipeline::Copy);
        let per_round = (lane.layout.cap / esz).max(1);
        let rounds = count.div_ceil(per_round);
        let base = lane.rounds.load(Ordering::Relaxed);
        let r = self.enqueue_copies(lane, input, count, esz, per_round, base);
        // The kernel counts every round of the call whatever happens here.
        lane.rounds.store(base.wrapping_add(rounds as u32), Ordering::Relaxed);
        if let Err(e) = &r {
            self.ctl.abort();
            self.ctl.fail(crate::Error::GroupFailed { reason: format!("rank {}: the all-reduce's copies failed part way: {e}", self.rank) });
        }
        r
    }

    fn enqueue_copies(&self, lane: &CopyLane, input: u64, count: usize, esz: usize, per_round: usize, base: u32) -> Result<()> {
        let (cap, sets) = (lane.layout.cap, kernels::ONESHOT_SETS);
        let rounds = count.div_ceil(per_round);
        // Every copy stream after what preceded the kernel (a call of fewer
        // than four rounds uses some of them, which ones depends on `base`).
        for cs in &lane.streams {
            cs.wait(&lane.start).map_err(cudarc_err("cuStreamWaitEvent (copy lane)"))?;
        }
        bind(&self.ctx)?;
        for round in 0..rounds {
            let v = base.wrapping_add(round as u32 + 1);
            let set = (v as usize) & (sets - 1);
            let raw = raw_stream(&lane.streams[set]);
            let len = per_round.min(count - round * per_round) * esz;
            let src = input + (round * per_round * esz) as u64;
            for &(k, region) in &lane.peers {
                let freed = CopyLane::word(lane.pull, k, kernels::COPY_FREED + set);
                let slot = region + (kernels::ONESHOT_FLAG_BYTES + (set * self.size + self.rank) * cap) as u64;
                // SAFETY: `raw` is one of this lane's live streams, of this
                // rank's context (bound above). `freed` and the COPY_ARRIVED
                // word are words of the lane's flag area in this rank's own
                // region and in peer k's (imported, mapped here read-write,
                // P2P checked), alive as long as the communicator, which
                // synchronizes these streams before dropping them. Peer k's
                // kernel writes `freed` as it reduces each round, and a
                // kernel that gives up moves this rank's own `freed` words
                // past every value waited for here (see the module docs), so
                // the wait ends. The copy's source is `len` bytes of the
                // caller's input (held until the communicator's stream,
                // which joins these, has run), its destination this rank's
                // slot of the set in k's region (`cap` >= `len` bytes).
                unsafe {
                    crate::driver::stream_wait_value("cuStreamWaitValue32 (copy lane)", raw, freed, v.wrapping_sub(sets as u32))?;
                    copy_async("cuMemcpyDtoDAsync (copy lane)", raw, slot, src, len)?;
                    let arrived = CopyLane::word(region, self.rank, kernels::COPY_ARRIVED + set);
                    stream_write_value("cuStreamWriteValue32 (copy lane)", raw, arrived, v)?;
                }
            }
            let sent = CopyLane::word(lane.pull, self.rank, kernels::COPY_SENT + set);
            // SAFETY: as above; this rank's own COPY_SENT word of the set.
            unsafe { stream_write_value("cuStreamWriteValue32 (copy lane)", raw, sent, v)? };
        }
        for (cs, end) in lane.streams.iter().zip(&lane.ends) {
            end.record(cs).map_err(cudarc_err("cuEventRecord (copy lane)"))?;
            self.stream.wait(end).map_err(cudarc_err("cuStreamWaitEvent (copy lane)"))?;
        }
        Ok(())
    }
}
