//! Making a [`Comm`]: the creation's steps 1-4 (see the module docs of
//! [`super`]), the checks of what each rank tells the others, each pair's
//! path, and the fallback to the staged path.

use super::pace::{warn_of_many_streams, warn_of_shared_queues, Pacer};
use super::{seeded, Comm, CommOptions, Held, Lane, Memory, On, FUSED_MOST_PARTS, MAX_RANKS, PAIR_AREA_BYTES, PAIR_COUNTER_WORDS};
use crate::algorithms::oneshot::{check_counts, layout};
use crate::copy::decide::{first_step, FirstStep};
use crate::copy::PathPolicy;
use crate::dtype::{DType, ReduceOp};
use crate::error::{cudarc_err, Error, Result};
use crate::failure::Ctl;
use crate::graph::CallOrder;
use crate::ipc::bootstrap::{peer_failed, Exchange};
use crate::ipc::fdpass::{send_fd, FdListener, PeerAddr};
use crate::ipc::shm::{board_bytes, region_len, CallBoard, RegisteredMemory, SharedMemory};
use crate::ipc::vmm::DeviceRegion;
use crate::kernels;
use crate::kernels::load::{function, FnTable, PtrArray};
use crate::kernels::{Kernel, KernelOp};
use crate::sync::{wait_bounded, Orderer};
use crate::traits::Collectives;
use cudarc::driver::DevicePtr;
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The tag of the call board's descriptor (with its length) among the
/// descriptors rank 0 sends.
const BOARD_TAG: u64 = 1 << 63;
/// The tag of the staged path's shared host buffer (with its length).
const HOST_TAG: u64 = 1 << 62;
/// The page after the call board that holds the communicator's control
/// block (`crate::failure`).
const CTL_PAGE: usize = 4096;

/// The bytes of rank 0's call board for `size` ranks: the board's pages,
/// then the control block's page.
fn board_with_ctl(size: usize) -> Result<usize> {
    region_len(board_bytes(size))
        .filter(|_| crate::failure::ctl_bytes(size) <= CTL_PAGE)
        .and_then(|b| b.checked_add(CTL_PAGE))
        .ok_or_else(|| Error::Internal(format!("a call board for {size} ranks")))
}

/// What each rank tells the others in step 1.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RankInfo {
    host: String,
    bus: String,
    /// Its staging buffer's bytes.
    region: usize,
    /// The device's multiprocessors (every rank's lanes take the fewest).
    sms: u32,
    /// Its stream's handle in its process (ranks of one process must not
    /// share one).
    stream: u64,
    /// Where it receives descriptors, and its pid and uid.
    fd: PeerAddr,
}

/// The longest info a rank may publish.
const MAX_INFO_BYTES: usize = 4096;

/// A decimal number of at most 20 digits, nothing else (no sign, no space).
fn number<T: std::str::FromStr>(s: &str) -> Option<T> {
    if s.is_empty() || s.len() > 20 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

impl RankInfo {
    /// One field a line, the host last (its identity may hold anything).
    fn encode(&self) -> String {
        format!("{}\n{}\n{}\n{}\n{}\n{}\n{}\n{}", self.bus, self.region, self.sms, self.stream, self.fd.name, self.fd.pid, self.fd.uid, self.host)
    }

    /// Rank `rank`'s info, every field present and well formed (else
    /// [`Error::Bootstrap`] naming the field).
    fn decode(rank: usize, s: &str) -> Result<RankInfo> {
        let bad = |what: &str| Error::Bootstrap { op: "communicator: rank info", reason: format!("rank {rank} sent a malformed info ({what})") };
        if s.len() > MAX_INFO_BYTES {
            return Err(bad("too long"));
        }
        let mut it = s.splitn(8, '\n');
        let mut field = |what: &'static str| it.next().ok_or_else(|| bad(what));
        let (bus, region, sms, stream, name, pid, uid, host) = (
            field("bus")?,
            field("staging bytes")?,
            field("multiprocessors")?,
            field("stream")?,
            field("socket")?,
            field("pid")?,
            field("uid")?,
            field("host")?,
        );
        if bus.is_empty() || bus.len() > 64 || !bus.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(bad("bus"));
        }
        let region = number::<usize>(region).filter(|&r| r >= 1024).ok_or_else(|| bad("staging bytes"))?;
        let sms = number::<u32>(sms).filter(|&n| n > 0).ok_or_else(|| bad("multiprocessors"))?;
        let stream = number::<u64>(stream).ok_or_else(|| bad("stream"))?;
        if !PeerAddr::valid_name(name) {
            return Err(bad("socket"));
        }
        let pid = number::<u32>(pid).filter(|&p| p > 0 && p <= i32::MAX as u32).ok_or_else(|| bad("pid"))?;
        let uid = number::<u32>(uid).ok_or_else(|| bad("uid"))?;
        if host.is_empty() {
            return Err(bad("host"));
        }
        Ok(RankInfo { host: host.into(), bus: bus.into(), region, sms, stream, fd: PeerAddr { name: name.into(), pid, uid } })
    }
}

/// Each rank's staging buffer for [`CommOptions::buffer_bytes`] and `size`
/// ranks: at least 1 KiB and 512 bytes per rank (so that each half holds a
/// slot of 256 bytes per rank), whole 512 bytes; [`Error::InvalidArgument`]
/// where it would not fit (a region's length travels in a tag below
/// [`HOST_TAG`]).
fn staging_bytes(buffer_bytes: usize, size: usize) -> Result<usize> {
    buffer_bytes
        .max(1024)
        .max(size.saturating_mul(512))
        .checked_next_multiple_of(512)
        .filter(|&b| (b as u64) < HOST_TAG)
        .ok_or_else(|| Error::InvalidArgument(format!("CommOptions::buffer_bytes of {buffer_bytes} bytes is too large")))
}

/// The sizes of step 3.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Sizes {
    /// Each rank's region: its one-shot lanes, then its staging buffer.
    region: usize,
    /// On the staged path, each rank's share of the host buffer (whole pages).
    per_rank: usize,
    /// The staged path's host buffer, for `size` ranks.
    host: usize,
}

/// The sizes of step 3 for `lane_bytes` of one-shot lanes, `staging` bytes
/// of staging buffer and `size` ranks, in checked arithmetic:
/// [`Error::InvalidArgument`] where one would not fit (below [`HOST_TAG`]).
fn sizes(lane_bytes: usize, staging: usize, size: usize) -> Result<Sizes> {
    let too_large = || Error::InvalidArgument(format!("regions of {lane_bytes} + {staging} bytes for {size} ranks are too large"));
    let region = lane_bytes.checked_add(staging).ok_or_else(too_large)?;
    let per_rank = region.checked_next_multiple_of(4096).ok_or_else(too_large)?;
    let host = per_rank.checked_mul(size).filter(|&h| (h as u64) < HOST_TAG).ok_or_else(too_large)?;
    Ok(Sizes { region, per_rank, host })
}

/// All-gathers each rank's outcome of a step (`bootstrap::agree`, the one
/// that every multi-process step uses): `Ok(values)` where every rank
/// succeeded, else the first failing rank's error (this rank's own first).
fn agree(ex: &dyn Exchange, step: &'static str, mine: Result<String>) -> Result<Vec<String>> {
    let all = crate::ipc::bootstrap::agree(ex, step, mine.map(String::into_bytes))?;
    Ok(all.into_iter().map(|v| String::from_utf8_lossy(&v).into_owned()).collect())
}

/// The checks of step 1 on every rank's info: one host, one device per rank
/// (unless `share_devices`), one stream per rank. Returns the most ranks on
/// one device: the one-shot's grids are divided among them, so that the
/// kernels of every rank on a device can be resident at once (ranks that
/// are threads of one process run at the same time, as do processes under
/// MPS).
fn check_layout(infos: &[RankInfo], share_devices: bool) -> Result<u32> {
    if infos.len() > MAX_RANKS {
        return Err(Error::Unsupported(format!("{} ranks in one communicator (at most {MAX_RANKS})", infos.len())));
    }
    for (r, i) in infos.iter().enumerate() {
        if i.host != infos[0].host {
            return Err(Error::Unsupported(format!(
                "ranks on several hosts (rank 0 on {}, rank {r} on {}): use ipc::nccl::NcclComm between hosts",
                infos[0].host, i.host
            )));
        }
        if let Some(k) = infos[..r].iter().position(|j| j.bus == i.bus).filter(|_| !share_devices) {
            return Err(Error::Unsupported(format!(
                "ranks {k} and {r} are on the same device ({}): the one-shot needs one device per rank (or CommOptions::share_devices)",
                i.bus
            )));
        }
        if let Some(k) = infos[..r].iter().position(|j| j.fd.pid == i.fd.pid && j.bus == i.bus && j.stream == i.stream) {
            return Err(Error::InvalidArgument(format!(
                "ranks {k} and {r} are threads of one process on one stream: each rank needs its own (their kernels wait for each other)"
            )));
        }
    }
    let most = infos.iter().map(|i| infos.iter().filter(|j| j.bus == i.bus).count()).max().unwrap_or(1);
    Ok(most as u32)
}

/// The most parts of a one-kernel exchange of `size` ranks, `sharing` of
/// them at most on one device of at least `sms` multiprocessors (see
/// `Comm::pair_parts`).
fn pair_parts(sms: u32, sharing: u32, size: usize) -> usize {
    let blocks_per_part = sharing as usize * size.saturating_sub(1).max(1);
    (sms as usize / blocks_per_part).clamp(1, FUSED_MOST_PARTS)
}

/// One rank's path for its pair with a peer, before any memory is shared
/// (and, over all its peers, its path with them: step 2 of the creation).
#[derive(Debug, Clone, PartialEq, Eq)]
enum PairPath {
    /// Each other's device memory (one device, or P2P between two), with
    /// the doctor's notes where it has some.
    Device(Option<String>),
    /// Staged, for this reason.
    Staged(String),
}

/// The path of the pair of this rank (`me`: rank, device) and peer `k`
/// (`peer`: rank, its device's ordinal here if visible, its bus id), as a
/// single-process link decides it (`copy::decide::first_step`). `claims`
/// says whether the driver reports peer access both ways to a device
/// (asked only where the policy leaves the answer open), `doctor` what the
/// doctor's cache advises for the pair (consulted only where P2P would be
/// tried under `Auto`).
fn pair_path(
    policy: PathPolicy,
    me: (usize, usize),
    peer: (usize, Option<usize>, &str),
    claims: impl FnOnce(usize) -> Result<bool>,
    doctor: impl FnOnce(usize) -> Option<crate::verdict::Advice>,
) -> Result<PairPath> {
    let ((rank, device), (k, ordinal, bus)) = (me, peer);
    let Some(p) = ordinal else {
        let reason = format!("rank {k}'s device {bus} is not visible to rank {rank} (CUDA_VISIBLE_DEVICES?)");
        return match policy {
            PathPolicy::P2pOnly => Err(Error::P2pUnavailable { from: device, to: usize::MAX, reason }),
            _ => Ok(PairPath::Staged(reason)),
        };
    };
    let claims = p == device || policy == PathPolicy::StagedOnly || claims(p)?;
    match first_step(policy, p == device, claims) {
        FirstStep::Local => Ok(PairPath::Device(None)),
        FirstStep::Staged(reason) => Ok(PairPath::Staged(format!("{reason} between rank {rank} and rank {k}"))),
        FirstStep::Unsupported => Err(Error::P2pUnavailable { from: device, to: p, reason: format!("no P2P from rank {rank} to rank {k}") }),
        FirstStep::TryP2p => match (policy == PathPolicy::Auto).then(|| doctor(p)).flatten() {
            Some(advice) if advice.stage => Ok(PairPath::Staged(advice.reason)),
            advice => Ok(PairPath::Device(advice.map(|a| a.reason))),
        },
    }
}

/// Whether the creation's check failed with `e` as a broken P2P path
/// fails it: wrong data, or a barrier that timed out (not a failed launch,
/// allocation or wait, nor a peer's exit), so that, under
/// [`PathPolicy::Auto`], the ranks fall back to the staged path.
fn path_failure(e: &Error) -> bool {
    matches!(e, Error::P2pUnavailable { .. } | Error::PeerTimeout { .. })
}

/// How the creation's check failed with `e`, for a path's reason: the
/// wrong data, the barrier that timed out, or the error.
fn what_failed(e: &Error) -> String {
    match e {
        Error::P2pUnavailable { reason, .. } => reason.clone(),
        Error::PeerTimeout { rank, after, .. } => format!("rank {rank}'s kernel waited {after:?} at a barrier for its peers"),
        e => e.to_string(),
    }
}

/// The ordinal, in this process, of the device at PCI bus id `bus`.
fn ordinal_of(bus: &str) -> Result<Option<usize>> {
    for d in 0..crate::driver::device_count()? {
        if crate::topology::device_info(d)?.pci_bus_id.eq_ignore_ascii_case(bus) {
            return Ok(Some(d));
        }
    }
    Ok(None)
}

impl Comm {
    /// Builds the communicator on the path its ranks decide (steps 1-3),
    /// then verifies it (step 4); where the P2P path fails the check under
    /// [`PathPolicy::Auto`] on every rank, builds and verifies it again on
    /// the staged path, every rank together.
    pub(super) fn create(exchange: Box<dyn Exchange>, on: On, opts: &CommOptions) -> Result<Comm> {
        let exchange: Arc<dyn Exchange> = Arc::from(exchange);
        let comm = Comm::build(exchange.clone(), on, opts)?;
        if !opts.verify {
            return Ok(comm.numbered_from_here());
        }
        if let Some((r, fault)) = opts.verify_fault.filter(|&(r, _)| r == comm.rank) {
            comm.held.ctl.inject(r, fault);
        }
        let checked = comm.verify_agreed(opts.timeout);
        // A fault the check did not take (a two-shot check) is not left armed.
        comm.held.ctl.take_fault(comm.rank);
        let failed = match checked? {
            None => return Ok(comm.numbered_from_here()),
            Some(e) if comm.staged => return Err(e),
            Some(e) => e,
        };
        // The check failed on the P2P path as a broken path fails it, seen
        // alike by every rank: under `Auto` each falls back, and one that
        // may not fails every rank.
        let mine = if opts.path == PathPolicy::Auto { Ok(String::new()) } else { Err(failed.clone()) };
        agree(&*exchange, "communicator: falling back to the staged path", mine)?;
        log::warn!(
            "cuda-peer: communicator rank {}: the P2P path failed the creation's check ({}); using the staged path",
            comm.rank,
            what_failed(&failed)
        );
        let stream = comm.stream.clone();
        // Its drop waits for its kernels, which end at their barriers' timeout.
        drop(comm);
        let mut comm = Comm::build(exchange, On::Stream(stream), &opts.clone().path(PathPolicy::StagedOnly))?;
        if let Some(e) = comm.verify_agreed(opts.timeout)? {
            return Err(match e {
                Error::P2pUnavailable { from, to, reason } => Error::P2pUnavailable {
                    from,
                    to,
                    reason: format!("{reason}, on the staged path, after the P2P path failed the check too ({})", what_failed(&failed)),
                },
                e => e,
            });
        }
        comm.path_reason = format!("staged after the P2P path failed the creation's check: {}", what_failed(&failed));
        Ok(comm.numbered_from_here())
    }

    /// The creation's check on every rank (step 4): `None` where it passed
    /// on every rank; `Some(e)` where it failed on some only as a broken
    /// path fails it ([`path_failure`]: `e` is this rank's own error, or
    /// the first failing rank's as an [`Error::Bootstrap`] naming it); an
    /// error where a rank's failed otherwise.
    fn verify_agreed(&self, timeout: Duration) -> Result<Option<Error>> {
        let mine = self.verify(timeout);
        let word = match &mine {
            Ok(()) => String::new(),
            Err(e) if path_failure(e) => format!("path:{e}"),
            Err(e) => format!("other:{e}"),
        };
        const STEP: &str = "communicator: verification";
        let words = agree(&*self.exchange, STEP, Ok(word))?;
        let Some((k, first)) = words.iter().enumerate().find(|(_, w)| !w.is_empty()) else { return Ok(None) };
        let e = mine.err().unwrap_or_else(|| peer_failed(STEP, k, first.split_once(':').map_or(first.as_str(), |w| w.1)));
        if words.iter().any(|w| w.starts_with("other:")) {
            return Err(e);
        }
        Ok(Some(e))
    }

    /// The caller's first call is call 1 (the creation's are not numbered).
    fn numbered_from_here(self) -> Comm {
        self.call_number.store(0, std::sync::atomic::Ordering::Relaxed);
        self
    }

    /// Steps 1-3 of the creation (see the module docs), and the kernels.
    fn build(exchange: Arc<dyn Exchange>, on: On, opts: &CommOptions) -> Result<Comm> {
        let ex = &*exchange;
        let (rank, size) = (ex.rank(), ex.size());
        if size == 0 || rank >= size {
            return Err(Error::InvalidArgument(format!("rank {rank} of {size}")));
        }

        // Step 1: device, identity, descriptor socket, and (rank 0) the call
        // board.
        let opened = (|| {
            if size > MAX_RANKS {
                return Err(Error::Unsupported(format!("{size} ranks in one communicator (at most {MAX_RANKS})")));
            }
            let staging = staging_bytes(opts.buffer_bytes, size)?;
            let stream = match on {
                On::Device(device) => crate::driver::context(device)?.new_stream().map_err(cudarc_err("cuStreamCreate"))?,
                On::Stream(stream) => {
                    crate::driver::device(stream.context().ordinal())?;
                    stream
                }
            };
            let ctx = stream.context().clone();
            let device = ctx.ordinal();
            let bus = crate::topology::device_info(device)?.pci_bus_id;
            let sms = crate::driver::multiprocessors(&ctx)?;
            let listener = FdListener::bind(rank)?;
            let info = RankInfo {
                host: crate::ipc::host::host_identity(),
                bus,
                region: staging,
                sms,
                stream: stream.cu_stream() as usize as u64,
                fd: listener.addr(),
            };
            // Rank 0 makes the call board and sends it to every peer.
            let board = if rank == 0 { Some(SharedMemory::create(board_with_ctl(size)?)?) } else { None };
            Ok((ctx, stream, info, board, listener))
        })();
        let infos = agree(ex, "communicator: opening the devices", opened.as_ref().map(|o| o.2.encode()).map_err(Clone::clone))?;
        let (ctx, stream, own_info, board, listener) = opened?;
        let device = ctx.ordinal();
        let staging = own_info.region;
        let infos: Vec<RankInfo> = infos.iter().enumerate().map(|(r, s)| RankInfo::decode(r, s)).collect::<Result<_>>()?;
        let sharing = check_layout(&infos, opts.share_devices)?;
        // Descriptors pass between the processes of one user only.
        if let Some((r, i)) = infos.iter().enumerate().find(|(_, i)| i.fd.uid != own_info.fd.uid) {
            return Err(Error::Bootstrap {
                op: "communicator: opening the devices",
                reason: format!("rank {r} runs as uid {}, rank {rank} as uid {}: every rank must run as one user", i.fd.uid, own_info.fd.uid),
            });
        }
        let addrs: Vec<PeerAddr> = infos.iter().map(|i| i.fd.clone()).collect();

        // Step 2: each pair's path, decided as a single-process link's
        // (`pair_path`); one pair that stages stages every rank. This
        // rank's path with all its peers: staged for the first pair that
        // stages, else the device path with the doctor's notes of its pairs.
        let decided = (|| {
            let mut notes: Vec<String> = Vec::new();
            for (k, info) in infos.iter().enumerate().filter(|&(k, _)| k != rank) {
                let peer = ordinal_of(&info.bus)?;
                let claims = |p| Ok(crate::peer::can_access_peer(device, p)? && crate::peer::can_access_peer(p, device)?);
                let doctor = |p| crate::verdict::consult(device, p, opts.use_doctor_verdicts);
                match pair_path(opts.path, (rank, device), (k, peer, &info.bus), claims, doctor)? {
                    staged @ PairPath::Staged(_) => return Ok(staged),
                    PairPath::Device(Some(note)) if !notes.contains(&note) => notes.push(note),
                    PairPath::Device(_) => {}
                }
            }
            Ok(PairPath::Device((!notes.is_empty()).then(|| notes.join("; "))))
        })();
        let word = decided.as_ref().map_err(Clone::clone).map(|d| match d {
            PairPath::Staged(why) => format!("staged:{why}"),
            PairPath::Device(_) => "device".to_string(),
        });
        let verdicts = agree(ex, "communicator: checking P2P", word)?;
        let decided = decided?;
        let staged_by = verdicts.iter().enumerate().find_map(|(k, v)| v.strip_prefix("staged:").map(|why| format!("rank {k}: {why}")));
        let staged = staged_by.is_some();
        let crosses = infos.iter().any(|i| i.bus != own_info.bus);
        let path_reason = staged_by.unwrap_or_else(|| {
            let what = if crosses { "P2P" } else { "one device" };
            let checked = if opts.verify { "verified" } else { "not verified" };
            match decided {
                PairPath::Device(Some(notes)) => format!("{what}, {checked}; {notes}"),
                _ => format!("{what}, {checked}"),
            }
        });
        let sms = infos.iter().map(|i| i.sms).min().unwrap_or(1);
        let (lanes, lane_bytes) = layout(size, !staged, (sms / sharing).max(1));
        // The pair area follows the lanes, the staging buffer the pair area.
        let bytes = lane_bytes + PAIR_AREA_BYTES;

        // Step 3: memory, descriptors out, then in, then mapped.
        let imported = (|| {
            let Sizes { region, per_rank, host: host_bytes } = sizes(bytes, staging, size)?;
            let board_len = board_with_ctl(size)?;
            let own = if staged {
                None
            } else {
                let own = Arc::new(DeviceRegion::allocate(&ctx, region)?);
                own.zero(&stream)?;
                owned::hold(&ctx, &own);
                Some((own.export_fd()?, own))
            };
            // Staged: every rank's region in one shared host buffer of rank 0's.
            let host = if staged && rank == 0 { Some(SharedMemory::create(host_bytes)?) } else { None };
            for (k, peer) in addrs.iter().enumerate().filter(|&(k, _)| k != rank) {
                if let Some((fd, own)) = &own {
                    send_fd(peer, rank, fd.as_fd(), own.len() as u64, opts.timeout)?;
                }
                if let Some(b) = &board {
                    send_fd(peer, rank, b.fd(), BOARD_TAG | b.len() as u64, opts.timeout)?;
                }
                if let Some(h) = &host {
                    send_fd(peer, rank, h.fd(), HOST_TAG | h.len() as u64, opts.timeout)?;
                }
                log::debug!("cuda-peer: rank {rank} sent its descriptors to rank {k}");
            }
            let expected = if staged { 0 } else { size - 1 }
                + if rank == 0 {
                    0
                } else if staged {
                    2
                } else {
                    1
                };
            let mut got = listener.receive(&addrs, expected, opts.timeout)?;
            // Rank 0's shared memory, of exactly the length computed here.
            let mut from_rank0 = |tag: u64, len: usize, what: &str| -> Result<SharedMemory> {
                let i = got
                    .iter()
                    .position(|g| g.from == 0 && g.tag & (BOARD_TAG | HOST_TAG) == tag)
                    .ok_or_else(|| Error::Bootstrap { op: "communicator: descriptors", reason: format!("rank 0 sent no {what}") })?;
                let g = got.remove(i);
                let claimed = g.tag & !(BOARD_TAG | HOST_TAG);
                if claimed != len as u64 {
                    return Err(Error::Bootstrap {
                        op: "communicator: descriptors",
                        reason: format!("rank 0's {what} has {claimed} bytes, {len} expected"),
                    });
                }
                SharedMemory::import(g.fd.as_fd(), len)
            };
            let board = match board {
                Some(b) => b,
                None => from_rank0(BOARD_TAG, board_len, "call board")?,
            };
            let memory = if staged {
                let host = match host {
                    Some(h) => h,
                    None => from_rank0(HOST_TAG, host_bytes, "shared host buffer")?,
                };
                let len = host.len();
                Memory::Host { reg: RegisteredMemory::shared_range(&ctx, Arc::new(host), 0, len)?, per_rank }
            } else {
                got.sort_by_key(|g| g.from);
                let mut peers = Vec::with_capacity(size - 1);
                for (i, g) in got.iter().enumerate() {
                    let expected = if i < rank { i } else { i + 1 };
                    if g.from != expected || g.tag & (BOARD_TAG | HOST_TAG) != 0 {
                        return Err(Error::Bootstrap {
                            op: "communicator: descriptors",
                            reason: format!("unexpected descriptor from rank {} (tag {})", g.from, g.tag),
                        });
                    }
                    let claimed = usize::try_from(g.tag).map_err(|_| Error::Bootstrap {
                        op: "communicator: descriptors",
                        reason: format!("rank {} claims a region of {} bytes", g.from, g.tag),
                    })?;
                    peers.push(Arc::new(DeviceRegion::import(&ctx, g.fd.as_fd(), claimed)?));
                }
                let own = own.map(|o| o.1).ok_or_else(|| Error::Internal("no own region".into()))?;
                Memory::Device { peers, own }
            };
            // The control block: the board's last page, mapped for this
            // device, so that every rank's kernels see one abort word.
            let board = Arc::new(board);
            let ctl_page = RegisteredMemory::shared_range(&ctx, board.clone(), board_len - CTL_PAGE, CTL_PAGE)?;
            Ok((memory, CallBoard::new(board, size)?, ctl_page))
        })();
        drop(listener);
        // Each rank's own mapping of its region (for the peers that are
        // threads of this process on this device) and its length: every
        // rank sees the same lengths, and each descriptor must carry its
        // sender's, so that every rank sizes the staging halves alike.
        let own_region = |m: &Memory| match m {
            Memory::Device { own, .. } => format!("{} {}", own.device_ptr(), own.len()),
            Memory::Host { .. } => String::new(),
        };
        const MAPPING: &str = "communicator: mapping the peers' memory";
        let published = agree(ex, MAPPING, imported.as_ref().map(|(m, _, _)| own_region(m)).map_err(Clone::clone))?;
        let (mut memory, board, ctl_page) = imported?;
        if let Memory::Device { peers, .. } = &mut memory {
            for (k, info) in infos.iter().enumerate().filter(|&(k, _)| k != rank) {
                let slot = if k < rank { k } else { k - 1 };
                let (addr, len) = published[k].split_once(' ').map_or((None, None), |(a, l)| (number::<u64>(a), number::<usize>(l)));
                if len != Some(peers[slot].len()) {
                    return Err(Error::Bootstrap {
                        op: MAPPING,
                        reason: format!("rank {k}'s descriptor carries a region of {} bytes, and it publishes {:?}", peers[slot].len(), published[k]),
                    });
                }
                if info.fd.pid == own_info.fd.pid && info.bus == own_info.bus {
                    peers[slot] = addr.and_then(|a| owned::find(&ctx, a, peers[slot].len())).ok_or_else(|| Error::Bootstrap {
                        op: MAPPING,
                        reason: format!("rank {k} (a thread of this process, on {}) names a region this process does not hold", info.bus),
                    })?;
                }
            }
        }
        // Each rank's region, as mapped here, and its length.
        let regions: Vec<(u64, usize)> = match &memory {
            Memory::Host { reg, per_rank } => (0..size).map(|k| (reg.device_ptr() + (k * per_rank) as u64, *per_rank)).collect(),
            Memory::Device { own, peers } => (0..size)
                .map(|k| match k.cmp(&rank) {
                    std::cmp::Ordering::Equal => own,
                    std::cmp::Ordering::Less => &peers[k],
                    std::cmp::Ordering::Greater => &peers[k - 1],
                })
                .map(|r| (r.device_ptr(), r.len()))
                .collect(),
        };
        // Every rank's staging buffer follows its one-shot lanes; its halves
        // are the same size on every rank (the smallest region's).
        let smallest = regions.iter().map(|r| r.1).min().unwrap_or(0);
        let half = (smallest.saturating_sub(bytes) / 2) & !255;
        if half < 256 * size {
            return Err(Error::Internal(format!("a staging buffer of {half} bytes per half")));
        }
        let data: Vec<u64> = regions.iter().map(|r| r.0 + bytes as u64).collect();
        let pairs: Vec<u64> = regions.iter().map(|r| r.0 + lane_bytes as u64).collect();
        let bar = stream.alloc_zeros::<u32>(4).map_err(cudarc_err("cuMemAlloc (barrier word)"))?;
        let bar_ptr = bar.device_ptr(&stream).0;
        let pair_counters = stream.alloc_zeros::<u32>(PAIR_COUNTER_WORDS).map_err(cudarc_err("cuMemAlloc (meeting counters)"))?;
        let pair_counters_ptr = pair_counters.device_ptr(&stream).0;

        // Counters, and the lanes as this rank launches them.
        let counters = stream.alloc_zeros::<u32>(lanes.len() * kernels::ONESHOT_MAX_BLOCKS).map_err(cudarc_err("cuMemAlloc (one-shot counters)"))?;
        stream.synchronize().map_err(cudarc_err("cuStreamSynchronize"))?;
        let counter_base = counters.device_ptr(&stream).0;
        let lanes = lanes
            .into_iter()
            .enumerate()
            .map(|(l, layout)| Lane {
                layout,
                push: PtrArray::from_slice(
                    &regions.iter().enumerate().filter(|&(k, _)| k != rank).map(|(_, r)| r.0 + layout.offset as u64).collect::<Vec<_>>(),
                ),
                pull: regions[rank].0 + layout.offset as u64,
                counters: counter_base + (l * kernels::ONESHOT_MAX_BLOCKS * 4) as u64,
            })
            .collect();
        let threads_here = infos.iter().filter(|i| i.fd.pid == own_info.fd.pid && i.bus == own_info.bus).count();
        let shares_context = threads_here > 1;
        if rank == 0 || shares_context {
            warn_of_shared_queues(threads_here, device);
        }
        if shares_context {
            warn_of_many_streams(&stream, device);
        }
        let pace_events = if shares_context {
            (0..=Pacer::AHEAD)
                .map(|_| ctx.new_event(None))
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(cudarc_err("cuEventCreate (pacing)"))?
        } else {
            Vec::new()
        };
        let order = CallOrder::new(&ctx)?;
        let comm = Comm {
            rank,
            size,
            ctx,
            stream,
            exchange,
            path_reason,
            lanes,
            npush: size as i32 - 1,
            max_blocks: kernels::launch::max_blocks(own_info.sms),
            order: Orderer::default(),
            calls: Mutex::new(0),
            call_number: std::sync::atomic::AtomicU32::new(0),
            check_calls: opts.check_calls,
            barrier_timeout: opts.barrier_timeout,
            all_reduce: opts.all_reduce,
            board,
            data,
            half,
            bar_ptr,
            pairs,
            pair_counters: pair_counters_ptr,
            pair_parts: pair_parts(sms, sharing, size),
            staged,
            shares_context,
            pace_events,
            captures: Default::default(),
            held: Arc::new(Held {
                order,
                funcs: FnTable::default(),
                div: FnTable::default(),
                red: FnTable::default(),
                // SAFETY: the board's last page (`CTL_PAGE` >= `ctl_bytes(size)`,
                // checked by `board_with_ctl`), page aligned, zeroed by rank 0
                // at creation, registered for this device at `device_ptr` (once
                // per context), and mapped as long as `ctl_page` (which the `Ctl` keeps); every
                // rank's `Ctl` and kernels access it by whole words.
                ctl: unsafe { Ctl::shared(ctl_page.host_ptr(), ctl_page.device_ptr(), size, opts.barrier_timeout, ctl_page) }?,
                _bar: bar,
                _counters: counters,
                _pair_counters: pair_counters,
                _memory: memory,
            }),
        };
        // Every rank's region is zeroed and mapped everywhere before any
        // kernel. Ranks that are threads of this process on this device
        // share its context, where loading a kernel waits for the kernels
        // running in it: a rank that loaded its first kernel while a peer's
        // waited for it would hold them both until the barrier timeout. So
        // such ranks load every kernel they may launch first.
        let loaded = if shares_context { comm.preload() } else { Ok(()) };
        agree(&*comm.exchange, "communicator: loading the kernels", loaded.map(|()| String::new()))?;
        Ok(comm)
    }

    /// Loads every kernel this communicator may launch, for every op and
    /// element type.
    fn preload(&self) -> Result<()> {
        for dtype in DType::ALL {
            for op in KernelOp::ALL {
                for (table, kernel) in [(&self.held.funcs, Kernel::OneShot(op, dtype)), (&self.held.red, Kernel::Reduce2(op, dtype))] {
                    table.get(kernel, || function(&self.ctx, kernel))?;
                }
            }
            if dtype.is_float() {
                self.held.div.get(Kernel::ScaleDiv(dtype), || function(&self.ctx, Kernel::ScaleDiv(dtype)))?;
            }
        }
        for kernel in [Kernel::PairSync, Kernel::PairXchg, Kernel::Copy] {
            self.held.red.get(kernel, || function(&self.ctx, kernel))?;
        }
        Ok(())
    }

    /// Waits, within `timeout`, for this rank's work enqueued so far (`op`
    /// names it in the error). A kernel that gave up at a barrier leaves
    /// its outputs as they were: that failure is the error, so that the
    /// caller never checks the data it left.
    fn settle(&self, op: &'static str, timeout: Duration) -> Result<()> {
        let done = self.ctx.new_event(None).map_err(cudarc_err("cuEventCreate"))?;
        done.record(&self.stream).map_err(cudarc_err("cuEventRecord"))?;
        wait_bounded(&done, op, timeout)?;
        self.held.ctl.check()
    }

    /// Step 4: an all-reduce of seeded data per lane, checked on the host.
    fn verify(&self, timeout: Duration) -> Result<()> {
        // A size for each lane that takes it, in several rounds where it has them.
        let counts = check_counts(&self.lanes.iter().map(|l| l.layout).collect::<Vec<_>>(), std::mem::size_of::<u32>());
        for (l, count) in counts.into_iter().enumerate() {
            let inputs: Vec<Vec<u32>> = (0..self.size).map(|r| seeded(0x5eed_0000 + l as u64 * 64 + r as u64, count)).collect();
            let expected: Vec<u32> = (0..count).map(|i| inputs.iter().fold(0u32, |a, x| a.wrapping_add(x[i]))).collect();
            let mut buf = self.stream.clone_htod(&inputs[self.rank]).map_err(cudarc_err("cuMemcpyHtoD (verification)"))?;
            self.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
            self.settle("communicator verification (all-reduce)", timeout)?;
            let got = self.stream.clone_dtoh(&buf).map_err(cudarc_err("cuMemcpyDtoH (verification)"))?;
            if let Some(i) = (0..count).find(|&i| got[i] != expected[i]) {
                return Err(Error::P2pUnavailable {
                    from: self.ctx.ordinal(),
                    to: self.ctx.ordinal(),
                    reason: format!("verification all-reduce of {count} u32 (lane {l}) wrong at {i}: {} instead of {}", got[i], expected[i]),
                });
            }
        }
        // The copies from the peers' staging buffers.
        let count = 1000;
        let inputs: Vec<Vec<u32>> = (0..self.size).map(|r| seeded(0x5eed_1000 + r as u64, count)).collect();
        let send = self.stream.clone_htod(&inputs[self.rank]).map_err(cudarc_err("cuMemcpyHtoD (verification)"))?;
        let mut recv = self.stream.alloc_zeros::<u32>(count * self.size).map_err(cudarc_err("cuMemAlloc (verification)"))?;
        self.all_gather(&send, &mut recv)?;
        self.settle("communicator verification (all-gather)", timeout)?;
        let got = self.stream.clone_dtoh(&recv).map_err(cudarc_err("cuMemcpyDtoH (verification)"))?;
        if let Some(i) = (0..count * self.size).find(|&i| got[i] != inputs[i / count][i % count]) {
            return Err(Error::P2pUnavailable {
                from: self.ctx.ordinal(),
                to: self.ctx.ordinal(),
                reason: format!("verification all-gather of {count} u32 per rank wrong at {i}"),
            });
        }
        Ok(())
    }
}

/// The device regions of this process's communicators, by context and
/// address: ranks that are threads of one process on one device reach each
/// other's regions through the owner's mapping, found here (and held, so
/// that it outlives the owner as an import would), not through a second,
/// imported mapping of the same memory (accesses to one location through
/// two virtual addresses are outside the guarantees of the GPU's memory
/// model). Only regions this process allocated are found: an address a
/// peer names is never used unless it is one of them, of the length the
/// peer's descriptor claims.
mod owned {
    use crate::ipc::vmm::DeviceRegion;
    use cudarc::driver::CudaContext;
    use std::sync::{Arc, Mutex, Weak};

    type Entry = (usize, u64, Weak<DeviceRegion>);

    static OWNED: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

    /// Records `region`, allocated in `ctx` (dropped entries are pruned).
    pub(super) fn hold(ctx: &CudaContext, region: &Arc<DeviceRegion>) {
        let mut all = OWNED.lock().unwrap_or_else(|p| p.into_inner());
        all.retain(|e| e.2.strong_count() > 0);
        all.push((ctx.cu_ctx() as usize, region.device_ptr(), Arc::downgrade(region)));
    }

    /// The live region at `addr` in `ctx`, if it is `len` bytes long.
    pub(super) fn find(ctx: &CudaContext, addr: u64, len: usize) -> Option<Arc<DeviceRegion>> {
        let all = OWNED.lock().unwrap_or_else(|p| p.into_inner());
        all.iter().filter(|e| e.0 == ctx.cu_ctx() as usize && e.1 == addr).find_map(|e| e.2.upgrade()).filter(|r| r.len() == len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ipc::comm::DEFAULT_BUFFER_BYTES;

    fn info(host: &str, bus: &str) -> RankInfo {
        let fd = PeerAddr { name: format!("cuda-peer/{}", "0123456789abcdef".repeat(2)), pid: 4242, uid: 1000 };
        RankInfo { host: host.into(), bus: bus.into(), region: 2 << 20, sms: 132, stream: 0x5000 + bus.len() as u64, fd }
    }

    fn malformed(r: Result<RankInfo>) -> bool {
        matches!(r, Err(Error::Bootstrap { .. }))
    }

    /// `pair_path` for rank 0 on device 0 and rank 1 on `peer`, the driver
    /// claiming P2P as `claims` says and the doctor advising `doctor`;
    /// either panics where it is asked but must not be.
    fn pair(policy: PathPolicy, peer: Option<usize>, claims: Option<bool>, doctor: Option<Option<(bool, &str)>>) -> Result<PairPath> {
        let claims = |_| claims.map(Ok).expect("the driver was asked");
        let doctor = |_| doctor.expect("the doctor was asked").map(|(stage, r)| crate::verdict::Advice { stage, reason: r.into() });
        pair_path(policy, (0, 0), (1, peer, "0000:3b:00.0"), claims, doctor)
    }

    #[test]
    fn pair_paths_follow_the_policy_the_driver_and_the_doctor() {
        use PathPolicy::*;
        let staged = |r: Result<PairPath>| match r {
            Ok(PairPath::Staged(why)) => why,
            other => panic!("expected staged, got {other:?}"),
        };
        let refused = |r: Result<PairPath>| matches!(r, Err(Error::P2pUnavailable { from: 0, .. }));
        // StagedOnly stages ranks on one device too, asking no one.
        assert_eq!(staged(pair(StagedOnly, Some(0), None, None)), "staged by policy between rank 0 and rank 1");
        assert_eq!(staged(pair(StagedOnly, Some(1), None, None)), "staged by policy between rank 0 and rank 1");
        assert!(staged(pair(StagedOnly, None, None, None)).contains("not visible"));
        // One device: its memory, asking neither the driver nor the doctor.
        for policy in [Auto, P2pOnly] {
            assert_eq!(pair(policy, Some(0), None, None).unwrap(), PairPath::Device(None), "{policy:?}");
        }
        // A device this process cannot see.
        assert!(staged(pair(Auto, None, None, None)).contains("rank 1's device 0000:3b:00.0 is not visible to rank 0"));
        assert!(refused(pair(P2pOnly, None, None, None)));
        // No peer access: staged under Auto, refused under P2pOnly; no doctor.
        assert_eq!(staged(pair(Auto, Some(1), Some(false), None)), "driver reports no peer access between rank 0 and rank 1");
        assert!(matches!(pair(P2pOnly, Some(1), Some(false), None), Err(Error::P2pUnavailable { from: 0, to: 1, .. })));
        // Peer access claimed: the doctor decides under Auto only.
        assert_eq!(staged(pair(Auto, Some(1), Some(true), Some(Some((true, "doctor verdict: broken"))))), "doctor verdict: broken");
        assert_eq!(
            pair(Auto, Some(1), Some(true), Some(Some((false, "doctor verdict: p2p")))).unwrap(),
            PairPath::Device(Some("doctor verdict: p2p".into()))
        );
        assert_eq!(pair(Auto, Some(1), Some(true), Some(None)).unwrap(), PairPath::Device(None));
        assert_eq!(pair(P2pOnly, Some(1), Some(true), None).unwrap(), PairPath::Device(None));
        // The driver's error is the error.
        let failing = pair_path(Auto, (0, 0), (1, Some(1), "b"), |_| Err(Error::Internal("no driver".into())), |_| None);
        assert!(matches!(failing, Err(Error::Internal(_))));
    }

    #[test]
    fn a_failed_check_reads_as_what_failed() {
        let wrong = Error::P2pUnavailable { from: 0, to: 0, reason: "verification all-gather of 1000 u32 per rank wrong at 7".into() };
        assert_eq!(what_failed(&wrong), "verification all-gather of 1000 u32 per rank wrong at 7");
        let timed_out = Error::PeerTimeout { rank: 1, call: 1, after: Duration::from_secs(2) };
        assert_eq!(what_failed(&timed_out), "rank 1's kernel waited 2s at a barrier for its peers");
        let other = Error::Bootstrap { op: "communicator: verification", reason: "rank 1 failed: x".into() };
        assert_eq!(what_failed(&other), other.to_string());
    }

    #[test]
    fn only_wrong_data_or_a_barrier_timeout_is_a_path_failure() {
        let wrong = Error::P2pUnavailable { from: 0, to: 0, reason: "verification all-reduce wrong at 0".into() };
        let timed_out = Error::PeerTimeout { rank: 1, call: 1, after: Duration::from_secs(1) };
        let others = [
            Error::Internal("injected launch failure".into()),
            Error::Timeout { op: "verification", after: Duration::from_secs(1) },
            Error::Bootstrap { op: "communicator: verification", reason: "rank 1 failed: lost".into() },
        ];
        assert!(path_failure(&wrong) && path_failure(&timed_out));
        assert!(others.iter().all(|e| !path_failure(e)));
    }

    #[test]
    fn rank_info_round_trips_and_a_host_may_hold_newlines() {
        let i = info("node/1234", "0000:19:00.0");
        assert_eq!(RankInfo::decode(0, &i.encode()), Ok(i));
        let odd = info("a\nhost\nid", "0000:19:00.0");
        assert_eq!(RankInfo::decode(0, &odd.encode()), Ok(odd));
    }

    #[test]
    fn malformed_rank_infos_are_typed_errors() {
        let good = info("node", "0000:19:00.0").encode();
        let lines: Vec<&str> = good.split('\n').collect();
        let with = |i: usize, v: &str| {
            let mut l = lines.clone();
            l[i] = v;
            l.join("\n")
        };
        assert!(malformed(RankInfo::decode(0, "x\ny")));
        assert!(malformed(RankInfo::decode(0, "")));
        for (field, bad) in [
            (0, ""),
            (0, "bus with spaces"),
            (1, "+2097152"),
            (1, "100"),
            (1, "99999999999999999999999"),
            (2, "0"),
            (2, "-1"),
            (3, "-1"),
            (3, "0x10"),
            (4, "cuda-peer/job/0"),
            (4, "/tmp/socket"),
            (5, "0"),
            (5, "4294967295"),
            (6, "x"),
            (7, ""),
        ] {
            assert!(malformed(RankInfo::decode(3, &with(field, bad))), "field {field} = {bad:?}");
        }
        assert!(malformed(RankInfo::decode(0, &"9".repeat(MAX_INFO_BYTES + 1))));
        match RankInfo::decode(5, &with(5, "0")) {
            Err(Error::Bootstrap { reason, .. }) => assert!(reason.contains("rank 5") && reason.contains("pid"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// Any text decodes to an info or a typed error, never a panic; an
        /// info re-encodes to the same text.
        #[test]
        fn rank_info_decoding_never_panics(text in "[0-9a-z:./\n -]{0,120}") {
            if let Ok(i) = RankInfo::decode(0, &text) {
                proptest::prop_assert_eq!(i.encode(), text);
            }
        }

        /// Infos of any field values: accepted exactly when every field is
        /// in range, and then unchanged.
        #[test]
        fn rank_infos_of_any_values_decode_only_when_valid(region in proptest::prelude::any::<usize>(), sms in proptest::prelude::any::<u32>(),
                                                           pid in proptest::prelude::any::<u32>(), uid in proptest::prelude::any::<u32>()) {
            let mut i = info("node", "0000:19:00.0");
            (i.region, i.sms, i.fd.pid, i.fd.uid) = (region, sms, pid, uid);
            let valid = region >= 1024 && sms > 0 && pid > 0 && pid <= i32::MAX as u32;
            match RankInfo::decode(0, &i.encode()) {
                Ok(d) => proptest::prop_assert!(valid && d == i),
                Err(e) => {
                    let typed = matches!(e, Error::Bootstrap { .. });
                    proptest::prop_assert!(!valid && typed, "{:?}", e);
                }
            }
        }
    }

    #[test]
    fn huge_buffer_bytes_are_invalid_arguments_not_overflows() {
        assert_eq!(staging_bytes(0, 2).unwrap(), 1024);
        assert_eq!(staging_bytes(1025, 2).unwrap(), 1536);
        assert_eq!(staging_bytes(DEFAULT_BUFFER_BYTES, 8).unwrap(), DEFAULT_BUFFER_BYTES);
        for huge in [usize::MAX, usize::MAX - 511, 1 << 62] {
            assert!(matches!(staging_bytes(huge, 2), Err(Error::InvalidArgument(_))), "{huge}");
        }
        let opts = CommOptions::default().buffer_bytes(usize::MAX);
        assert!(matches!(staging_bytes(opts.buffer_bytes, 2), Err(Error::InvalidArgument(_))));
    }

    /// The smallest buffers still give each half a 256-byte slot per rank
    /// (the creation's check of the halves; 1 KiB for 8 ranks gave 512).
    #[test]
    fn the_smallest_staging_buffers_hold_a_slot_per_rank() {
        for size in 1..=MAX_RANKS {
            for asked in [0, 1, 1024, 1025, 2048, 4095] {
                let staging = staging_bytes(asked, size).unwrap();
                assert!(staging >= asked && staging.is_multiple_of(512), "{asked} for {size} ranks: {staging}");
                assert!((staging / 2) & !255 >= 256 * size, "{asked} for {size} ranks: {staging}");
            }
        }
    }

    #[test]
    fn region_sizes_are_checked() {
        assert_eq!(sizes(4096, 1024, 4).unwrap(), Sizes { region: 5120, per_rank: 8192, host: 4 * 8192 });
        assert_eq!(sizes(0, 4096, 8).unwrap(), Sizes { region: 4096, per_rank: 4096, host: 8 * 4096 });
        assert!(matches!(sizes(usize::MAX, 1024, 2), Err(Error::InvalidArgument(_))));
        assert!(matches!(sizes(usize::MAX - 2000, 1024, 2), Err(Error::InvalidArgument(_))));
        assert!(matches!(sizes(1 << 60, 1 << 60, 8), Err(Error::InvalidArgument(_))));
        assert!(matches!(sizes(1 << 61, 0, 2), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn layouts_with_shared_devices_or_hosts_are_refused() {
        assert_eq!(check_layout(&[info("a", "0"), info("a", "1"), info("a", "2")], false), Ok(1));
        assert!(matches!(check_layout(&[info("a", "0"), info("a", "0")], false), Err(Error::Unsupported(m)) if m.contains("same device")));
        // Ranks of other processes may share a device and a stream handle.
        let mut other = info("a", "0");
        other.fd.pid += 1;
        assert_eq!(check_layout(&[info("a", "0"), info("a", "1"), other], true), Ok(2));
        // Threads of one process on one device need a stream each.
        assert!(matches!(check_layout(&[info("a", "0"), info("a", "0")], true), Err(Error::InvalidArgument(m)) if m.contains("one stream")));
        let mut own = info("a", "0");
        own.stream += 1;
        assert_eq!(
            check_layout(
                &[info("a", "0"), own.clone(), {
                    own.stream += 1;
                    own
                }],
                true
            ),
            Ok(3)
        );
        assert!(matches!(check_layout(&[info("a", "0"), info("b", "1")], true), Err(Error::Unsupported(m)) if m.contains("several hosts")));
        let nine: Vec<_> = (0..9).map(|d| info("a", &d.to_string())).collect();
        assert!(matches!(check_layout(&nine, false), Err(Error::Unsupported(_))));
    }

    #[test]
    fn one_kernel_exchanges_of_ranks_sharing_a_device_take_fewer_parts() {
        let most = FUSED_MOST_PARTS;
        assert_eq!(pair_parts(132, 1, 2), most);
        assert_eq!(pair_parts(132, 1, 8), most);
        assert_eq!(pair_parts(132, 2, 2), most);
        assert_eq!(pair_parts(132, 4, 8), most.min(132 / 28));
        assert_eq!(pair_parts(132, 8, 8), 2);
        assert_eq!(pair_parts(10, 8, 8), 1);
        assert_eq!(pair_parts(0, 1, 1), 1);
        for (sms, sharing, size) in [(132, 8, 8), (132, 4, 8), (80, 3, 3), (16, 2, 8)] {
            let parts = pair_parts(sms, sharing, size);
            assert!(parts == 1 || sharing as usize * (size - 1) * parts <= sms as usize, "{sms} {sharing} {size}: {parts}");
        }
    }

    /// Every rank learns of one rank's failure in a step.
    #[test]
    fn one_ranks_failure_fails_every_rank() {
        use crate::ipc::bootstrap::Bootstrap;
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let n = 3;
        let handles: Vec<_> = (0..n)
            .map(|r| {
                std::thread::spawn(move || {
                    let rv = Bootstrap::new(r, n, r, n, "127.0.0.1", port).unwrap().with_timeout(Duration::from_secs(20)).connect().unwrap();
                    let ok = agree(&rv, "step", Ok(format!("v{r}"))).unwrap();
                    let mine = if r == 1 { Err(Error::NoDevice) } else { Ok(String::new()) };
                    (ok, agree(&rv, "step", mine))
                })
            })
            .collect();
        for h in handles {
            let (ok, failed) = h.join().unwrap();
            assert_eq!(ok, vec!["v0", "v1", "v2"]);
            match failed {
                Err(Error::NoDevice) => {}
                Err(Error::Bootstrap { reason, .. }) => {
                    assert!(reason.contains("rank 1 failed"), "{reason}")
                }
                other => panic!("{other:?}"),
            }
        }
    }

    /// Without a driver, creation fails on every rank with the same kind of
    /// error, in bounded time, instead of leaving the others waiting.
    #[test]
    fn without_a_gpu_creation_fails_on_every_rank() {
        if crate::driver::device_count().map(|n| n >= 2).unwrap_or(false) {
            return; // a GPU machine: the GPU tests cover creation
        }
        use crate::ipc::bootstrap::Bootstrap;
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let handles: Vec<_> = (0..2)
            .map(|r| {
                std::thread::spawn(move || {
                    let rv = Bootstrap::new(r, 2, r, 2, "127.0.0.1", port).unwrap().with_timeout(Duration::from_secs(20)).connect().unwrap();
                    Comm::new(Box::new(rv), r, &CommOptions { timeout: Duration::from_secs(5), ..Default::default() }).map(|_| ())
                })
            })
            .collect();
        for h in handles {
            assert!(h.join().unwrap().is_err());
        }
    }
}
