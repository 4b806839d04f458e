//! One call of a [`Comm`] at a time, in one order with the replays of its
//! captured calls.
//!
//! A call takes the communicator's call lock (and, with
//! [`super::CommOptions::check_calls`], checks that every rank makes the
//! same call) for as long as it enqueues. Its kernels use this rank's slots,
//! counters and staging buffer, as every call's do, so two calls of one rank
//! must not run at once on the device: every call also takes its place in
//! the order of this rank's calls and replays (`Held::order`, a
//! [`crate::graph::CallOrder`]) before its first enqueue
//! (`Comm::hold_for_capture`), and records it after its last enqueue
//! ([`Call::end`], or the [`Call`]'s drop).

use super::Comm;
use crate::error::{Error, Result};
use crate::ipc::shm::CallDesc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::MutexGuard;

/// One call in progress: the call lock, held until the call has enqueued
/// everything, and then its record of the order's event.
pub(super) struct Call<'a> {
    comm: &'a Comm,
    _calls: MutexGuard<'a, u64>,
}

impl Call<'_> {
    /// Records the call's place in the order, after its last enqueue and
    /// before its buffers' events (a stream that joined a capture through
    /// a buffer's event joins back through them); the drop does it
    /// otherwise. A failed record leaves later calls unordered with this
    /// one: the communicator fails, and every later call returns the error.
    pub(super) fn end(&self) -> Result<()> {
        self.comm.held.order.end(&self.comm.stream).inspect_err(|e| {
            log::warn!("cuda-peer: communicator rank {}: ordering a call: {e}", self.comm.rank);
            self.comm.held.ctl.fail(e.clone());
        })
    }
}

impl Drop for Call<'_> {
    fn drop(&mut self) {
        let _ = self.end();
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
}
