//! One call of a [`Comm`] at a time, in one order with the replays of its
//! captured calls.
//!
//! A call takes the communicator's call lock (and, with
//! [`super::CommOptions::check_calls`], checks that every rank makes the
//! same call) for as long as it enqueues. Its kernels use this rank's slots,
//! counters and staging buffer, as every call's do, so two calls of one rank
//! must not run at once on the device. Eager calls are ordered by the
//! communicator's stream; a graph replay is launched wherever the caller
//! launches it. So every call also takes its place in one order through an
//! event (`Held::sequence`): before its first enqueue it waits, on the
//! stream, for the event's last record, and after its last it records the
//! event. A captured call does both as the graph's external event nodes: a
//! graph's wait node waits for the event's last record before the graph's
//! launch, and a stream that waits for the event after the launch waits for
//! the replay's record node (`bench/experiments/graph_event_order/`). So this
//! rank's calls and replays run one after another in the order the host
//! issued them, wherever each replay is launched. Eager calls do this only
//! once a call has been captured: before that no replay exists.

use super::Comm;
use crate::driver::{api, bind, raw_event, raw_stream};
use crate::error::{check, Error, Result};
use crate::ipc::shm::CallDesc;
use cuda_peer_sys as sys;
use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::sync::MutexGuard;

/// How the call being enqueued took its place in the order
/// (`Comm::sequenced`).
const NOT_YET: u8 = 0;
/// It waited on the stream: record on the stream.
const EAGER: u8 = 1;
/// It waited as a captured node: record as one.
const CAPTURED: u8 = 2;

/// One call in progress: the call lock, held until the call has enqueued
/// everything, and then its record of the order's event.
pub(super) struct Call<'a> {
    comm: &'a Comm,
    _calls: MutexGuard<'a, u64>,
}

impl Drop for Call<'_> {
    fn drop(&mut self) {
        // A failed record leaves later calls unordered with this one: the
        // communicator fails, and every later call returns the error.
        if let Err(e) = self.comm.sequence_end() {
            log::warn!("cuda-peer: communicator rank {}: ordering a call: {e}", self.comm.rank);
            self.comm.held.ctl.fail(e);
        }
    }
}

impl Comm {
    /// Takes the call lock and, with [`super::CommOptions::check_calls`],
    /// checks that every rank makes the same call (see
    /// [`crate::ipc::shm::CallBoard::agree`]). A mismatch leaves the
    /// communicator usable; a peer that does not make the call in time
    /// fails it.
    pub(super) fn enter(&self, desc: CallDesc) -> Result<Call<'_>> {
        let mut calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        self.held.ctl.check()?;
        let call = *calls;
        if self.check_calls {
            match self.board.agree(self.rank, call, &desc, self.barrier_timeout) {
                Ok(()) => {}
                Err(e @ Error::Mismatch { .. }) => {
                    // Every rank saw the same descriptors and refuses the
                    // call: they stay in step.
                    *calls += 1;
                    return Err(e);
                }
                Err(e) => {
                    self.held.ctl.fail(e.clone());
                    return Err(e);
                }
            }
        }
        *calls += 1;
        Ok(self.start_call(calls))
    }

    /// A call without the call check (the point-to-point exchanges, which
    /// check their own way): the call lock, once the communicator has not
    /// failed.
    pub(super) fn enter_unchecked(&self) -> Result<Call<'_>> {
        let calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        self.held.ctl.check()?;
        Ok(self.start_call(calls))
    }

    /// Numbers the call and starts it, not yet in the order.
    fn start_call<'a>(&'a self, calls: MutexGuard<'a, u64>) -> Call<'a> {
        self.number_call();
        self.sequenced.store(NOT_YET, SeqCst);
        Call { comm: self, _calls: calls }
    }

    /// Numbers a new call (see `call_number`) and returns its number.
    pub(super) fn number_call(&self) -> u32 {
        self.call_number.fetch_add(1, Relaxed).wrapping_add(1)
    }

    /// The number of the call being enqueued.
    pub(super) fn current_call(&self) -> u32 {
        self.call_number.load(Relaxed)
    }

    /// Before each enqueue of a call (through `hold_for_capture`; only the
    /// first does anything): the stream waits for the order's last record,
    /// as a captured node where the stream is `capturing`.
    pub(super) fn sequence_begin(&self, capturing: bool) -> Result<()> {
        if self.sequenced.load(SeqCst) != NOT_YET {
            return Ok(());
        }
        if capturing {
            self.captured.store(true, SeqCst);
        } else if !self.captured.load(SeqCst) {
            return Ok(());
        }
        bind(&self.ctx)?;
        let flags = if capturing { sys::CUevent_wait_flags::CU_EVENT_WAIT_EXTERNAL.0 } else { 0 };
        // SAFETY: the event is of this rank's context (current) and alive
        // in `held`; the stream is this communicator's.
        check("cuStreamWaitEvent (the order of calls)", unsafe {
            api()?.cuStreamWaitEvent(raw_stream(&self.stream), raw_event(&self.held.sequence), flags)
        })?;
        self.sequenced.store(if capturing { CAPTURED } else { EAGER }, SeqCst);
        Ok(())
    }

    /// After a call's last enqueue (when its [`Call`] is dropped): records
    /// the order's event where the call took its place in the order.
    fn sequence_end(&self) -> Result<()> {
        let flags = match self.sequenced.swap(NOT_YET, SeqCst) {
            NOT_YET => return Ok(()),
            CAPTURED => sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL.0,
            _ => 0,
        };
        bind(&self.ctx)?;
        // SAFETY: as in `sequence_begin`.
        check("cuEventRecordWithFlags (the order of calls)", unsafe {
            api()?.cuEventRecordWithFlags(raw_event(&self.held.sequence), raw_stream(&self.stream), flags)
        })
    }
}
