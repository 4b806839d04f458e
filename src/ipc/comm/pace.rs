//! Ranks that are threads of one process on one device share its context,
//! its hardware work queues and its command queues: the warnings where they
//! may not be enough, and the pacing of such ranks' enqueues ([`Pacer`]).

use super::Comm;
use crate::error::{cudarc_err, Result};
use crate::graph::capture_of;
use crate::sync::wait_bounded;
use cudarc::driver::CudaStream;
use std::sync::{Arc, Mutex, Weak};

/// Says, once per process, where `threads` ranks that are threads of this
/// process share device `device` with fewer hardware work queues than
/// their streams may need: their kernels wait for each other on the
/// device, and two ranks' streams in one queue can hold each other up
/// until the barrier timeout (an error, not a hang).
pub(super) fn warn_of_shared_queues(threads: usize, device: usize) {
    static SAID: std::sync::Once = std::sync::Once::new();
    let queues = hardware_queues();
    if threads > 2 && queues < 32 {
        SAID.call_once(|| {
            log::warn!(
                "cuda-peer: {threads} ranks share device {device} in this process with {queues} hardware work queues: \
                 set CUDA_DEVICE_MAX_CONNECTIONS=32 before CUDA starts (docs/multiprocess.md)"
            )
        });
    }
}

/// The hardware work queues of each context of this process: what
/// `CUDA_DEVICE_MAX_CONNECTIONS` asks for, else the driver's default of 8.
fn hardware_queues() -> usize {
    std::env::var("CUDA_DEVICE_MAX_CONNECTIONS").ok().and_then(|v| v.trim().parse::<usize>().ok()).unwrap_or(8)
}

/// The streams of thread ranks that share a device, by device, as long as
/// each stream lives (a stream of several communicators counts once).
static SHARED_STREAMS: Mutex<Vec<(usize, Weak<CudaStream>)>> = Mutex::new(Vec::new());

/// Says, once per process, where the streams of this process's thread
/// ranks that share `device` are more than its hardware work queues: the
/// queues are shared by every stream of the context, so two ranks of one
/// communicator may land in one queue, whatever the setting, and hold each
/// other up until the barrier timeout (measured: docs/multiprocess.md).
pub(super) fn warn_of_many_streams(stream: &Arc<CudaStream>, device: usize) {
    static SAID: std::sync::Once = std::sync::Once::new();
    let queues = hardware_queues();
    let mut streams = SHARED_STREAMS.lock().unwrap_or_else(|p| p.into_inner());
    let live = live_streams(&mut streams, device, stream);
    if live > queues {
        SAID.call_once(|| {
            log::warn!(
                "cuda-peer: {live} streams of thread ranks share device {device} in this process, more than its {queues} \
                 hardware work queues: two ranks of one communicator may share a queue and time out at a barrier; put \
                 rank r of every communicator on one stream (docs/multiprocess.md)"
            )
        });
    }
}

/// Adds `stream` on `device` to `entries` (once), drops the entries whose
/// stream is gone, and counts the live ones on `device`.
fn live_streams<S>(entries: &mut Vec<(usize, Weak<S>)>, device: usize, stream: &Arc<S>) -> usize {
    entries.retain(|(_, w)| w.strong_count() > 0);
    if !entries.iter().any(|(d, w)| *d == device && std::ptr::eq(w.as_ptr(), Arc::as_ptr(stream))) {
        entries.push((device, Arc::downgrade(stream)));
    }
    entries.iter().filter(|(d, _)| *d == device).count()
}

/// Where other ranks are threads of this process on this device (one
/// context), keeps a rank at most [`Pacer::AHEAD`] synchronisation points
/// (of one run that its peers reach in the same order: a collective's
/// barriers, an exchange's meetings) ahead of its stream: after each
/// point, an event; past `AHEAD`, a bounded wait for the point `AHEAD`
/// before. The ranks' work waits for each other on the device and the
/// context's command queues are shared and finite: a rank that queued far
/// ahead could fill them, so that a peer's enqueue blocked in the driver
/// and the point the first rank waited for never reached the device (7
/// thread ranks on one H200, about 300 enqueues each: a timeout on every
/// run). A point `AHEAD` back completes once every peer has enqueued it,
/// which a peer waiting at its own later point already has. Off while
/// capturing (nothing runs) and for ranks with a context of their own.
/// The events are the communicator's own, made with it: creating an event
/// in the middle of a call may wait for the context's running kernels,
/// among them a peer's, waiting for this rank's next enqueue.
pub(super) struct Pacer<'a> {
    comm: &'a Comm,
    on: bool,
    points: usize,
}

impl Pacer<'_> {
    pub(super) const AHEAD: usize = 8;

    /// After a synchronisation point was enqueued.
    pub(super) fn passed(&mut self) -> Result<()> {
        if !self.on {
            return Ok(());
        }
        let c = self.comm;
        let ring = c.pace_events.len();
        c.pace_events[self.points % ring].record(&c.stream).map_err(cudarc_err("cuEventRecord (pacing)"))?;
        if self.points >= Self::AHEAD {
            let before = &c.pace_events[(self.points - Self::AHEAD) % ring];
            wait_bounded(before, "communicator: pacing the enqueues of ranks sharing a context", c.barrier_timeout)?;
        }
        self.points += 1;
        Ok(())
    }
}

impl Comm {
    /// A pacer for a run of synchronisation points (barriers or meetings)
    /// that the peers reach in the same order ([`Pacer`]).
    pub(super) fn pacer(&self) -> Result<Pacer<'_>> {
        let on = !self.pace_events.is_empty() && capture_of(&self.stream)?.is_none();
        Ok(Pacer { comm: self, on, points: 0 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_streams_count_each_live_stream_once_per_device() {
        let mut entries = Vec::new();
        let (a, b, c) = (Arc::new(1u8), Arc::new(2u8), Arc::new(3u8));
        assert_eq!(live_streams(&mut entries, 0, &a), 1);
        // The same stream of a second communicator counts once.
        assert_eq!(live_streams(&mut entries, 0, &a), 1);
        assert_eq!(live_streams(&mut entries, 0, &b), 2);
        // Another device's streams are counted apart.
        assert_eq!(live_streams(&mut entries, 1, &c), 1);
        drop(b);
        assert_eq!(live_streams(&mut entries, 0, &a), 1);
        assert_eq!(entries.len(), 2);
    }
}
