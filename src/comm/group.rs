//! [`Group`]: one rank's sends and receives, launched together
//! ([`Comm::group`]).

use super::{Comm, Inner};
use crate::dtype::Movable;
use crate::error::Result;
use crate::sync::Held;
use crate::traits::{check_peer, Collectives, PointToPoint, Transfer};
use cudarc::driver::{DevicePtr, DevicePtrMut};

/// Sends and receives of one rank, enqueued together when the group ends
/// ([`Group::end`], or its drop): a ring shift, a halo exchange or a
/// pipeline step in which two ranks send to each other, without either
/// waiting for the other's send first. Made by [`Comm::group`].
///
/// Each call checks its arguments and orders its buffer on the
/// communicator's stream at once; the data moves when the group ends. A
/// call that fails (a peer out of range, a buffer of another context)
/// poisons the group, as a failed call inside `ncclGroupStart`/`End` does:
/// when it ends, none of its transfers runs and [`Group::end`] returns that
/// error, so ranks whose groups failed alike stay in step. A
/// group's transfers with one peer are matched with that peer's in order,
/// sends with its receives and receives with its sends, of the same
/// lengths (lengths that differ fail both ranks' communicators with a
/// typed error). Collectives are not part of a group: call them on the
/// communicator before or after it.
///
/// ```no_run
/// # fn demo(comm: &cuda_peer::Comm, send: &cuda_peer::cudarc::driver::CudaSlice<f32>, recv: &mut cuda_peer::cudarc::driver::CudaSlice<f32>) -> cuda_peer::Result<()> {
/// let (rank, n) = (comm.rank(), comm.world_size());
/// let mut group = comm.group();
/// group.send(send, (rank + 1) % n)?;
/// group.recv(recv, (rank + n - 1) % n)?;
/// group.end()?;
/// # Ok(()) }
/// ```
pub struct Group<'g> {
    comm: &'g Comm,
    transfers: Vec<Transfer>,
    held: Vec<Held<'g>>,
    ended: bool,
    /// The first call that failed: the group then moves nothing.
    failed: Option<crate::error::Error>,
}

impl std::fmt::Debug for Group<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group").field("rank", &self.comm.rank()).field("transfers", &self.transfers).finish()
    }
}

impl Comm {
    /// Starts a group of sends and receives (see [`Group`]).
    pub fn group(&self) -> Group<'_> {
        Group { comm: self, transfers: Vec::new(), held: Vec::new(), ended: false, failed: None }
    }
}

/// The engine of `comm` as the point-to-point calls see it.
macro_rules! engine {
    ($comm:expr, $e:ident => $body:expr) => {
        match &$comm.inner {
            Inner::Host($e) => $body,
            Inner::Nccl($e, _) => $body,
            Inner::Tiered($e) => $body,
        }
    };
}

impl<'g> Group<'g> {
    /// Adds a send of `buf` to rank `peer` (see [`crate::Collectives::send`]).
    pub fn send<T: Movable, S: DevicePtr<T>>(&mut self, buf: &'g S, peer: usize) -> Result<()> {
        let comm = self.comm;
        let added = check_peer("send", peer, comm.world_size())
            .and_then(|()| crate::copy::check_context("send", "send", comm.context(), buf.stream().context()))
            .and_then(|()| {
                engine!(comm, e => {
                    let (ptr, held) = PointToPoint::orderer(&**e).read(buf, Collectives::stream(&**e))?;
                    self.transfers.push(Transfer { peer, ptr, bytes: buf.len() * std::mem::size_of::<T>(), send: true });
                    self.held.push(held);
                });
                Ok(())
            });
        self.poison_on(added)
    }

    /// Adds a receive into `buf` from rank `peer` (see
    /// [`crate::Collectives::recv`]).
    pub fn recv<T: Movable, D: DevicePtrMut<T>>(&mut self, buf: &'g mut D, peer: usize) -> Result<()> {
        let comm = self.comm;
        let bytes = buf.len() * std::mem::size_of::<T>();
        let added = check_peer("recv", peer, comm.world_size())
            .and_then(|()| crate::copy::check_context("recv", "recv", comm.context(), buf.stream().context()))
            .and_then(|()| {
                engine!(comm, e => {
                    let (ptr, held) = PointToPoint::orderer(&**e).write(buf, Collectives::stream(&**e))?;
                    self.transfers.push(Transfer { peer, ptr, bytes, send: false });
                    self.held.push(held);
                });
                Ok(())
            });
        self.poison_on(added)
    }

    /// `added`, remembered as the group's failure where it is the first.
    fn poison_on(&mut self, added: Result<()>) -> Result<()> {
        if let (Err(e), None) = (&added, &self.failed) {
            self.failed = Some(e.clone());
        }
        added
    }

    /// Enqueues the group's transfers; its buffers are then ordered after
    /// them.
    pub fn end(mut self) -> Result<()> {
        self.finish()
    }

    fn finish(&mut self) -> Result<()> {
        if self.ended {
            return Ok(());
        }
        self.ended = true;
        let comm = self.comm;
        let r = match self.failed.take() {
            Some(e) => Err(e),
            None if self.transfers.is_empty() => Ok(()),
            None => engine!(comm, e => PointToPoint::transfers(&**e, &self.transfers)),
        };
        self.held.drain(..).fold(r, |r, h| r.and(h.finish()))
    }
}

impl Drop for Group<'_> {
    /// Ends the group ([`Group::end`]); an error is logged (a call that
    /// failed was returned to the caller, and the group moved nothing; an
    /// enqueue that failed part way has failed the communicator, whose next
    /// call and [`Comm::async_error`] report it).
    fn drop(&mut self) {
        if let Err(e) = self.finish() {
            log::warn!("cuda-peer: a group ended with an error: {e}");
        }
    }
}
