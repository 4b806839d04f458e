//! Point-to-point calls of the per-rank communicator, `cuda_peer::Comm`:
//! `send` and `recv` alone and in groups (`Comm::group`), and the
//! collectives with per-rank blocks built on them or beside them
//! (`all_to_all`, `all_to_all_v`, `all_gather_v`, `reduce_scatter_v`),
//! `Comm::split`, graphs of grouped calls replayed after every `Comm` is
//! gone, and two processes exchanging through an `Id` in a file.
//!
//! Ranks are threads (`Comm::from_devices_with`), each on a stream of its
//! own, round robin over the GPUs there are (so on one GPU they share it),
//! on the P2P path (`Auto`) and on the staged path (`StagedOnly`).
//!
//! As docs/testing.md asks: fresh random inputs on every run (the seed is
//! printed, and named in every failure), outputs poisoned before each
//! call, a CPU reference for every result; data moved is compared bit for
//! bit (every type, both fp8 types included, with random bit patterns:
//! NaNs and infinities too), the gaps between the blocks of an
//! `all_to_all_v` must keep their poison, integer reductions are exact
//! (wrapping), float reductions within `common::num`'s per-element bound.
//! Every GPU test takes `exclusive()` (their spinning kernels must not
//! share the device with another test's) and says `SKIPPED <test>: <why>`
//! without a GPU.

mod common;

use common::num::{self, Num};
use common::procs::{self, all_succeeded, child, passes, spawn};
use common::ranks::{each, exclusive, streams};
use common::{gpu_count, gpus, has_gpus, skipped};
use cuda_peer::comm::Engine;
use cuda_peer::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cuda_peer::cudarc::driver::{CudaContext, CudaGraph, CudaSlice, CudaStream};
use cuda_peer::dtype::Movable;
use cuda_peer::traits::Blocks;
use cuda_peer::{Comm, CommOptions, Error, Id, Path, PathPolicy, ReduceOp};
use float8::{F8E4M3, F8E5M2};
use half::{bf16, f16};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

// ---- ranks as threads ----

fn next(r: usize, n: usize) -> usize {
    (r + 1) % n
}

fn prev(r: usize, n: usize) -> usize {
    (r + n - 1) % n
}

/// The partner of rank `r` in a pairwise exchange of `n` ranks: `r ^ 1`,
/// or `r` itself for the last rank of an odd count (a send to itself).
fn partner(r: usize, n: usize) -> usize {
    if r ^ 1 < n {
        r ^ 1
    } else {
        r
    }
}

// ---- fresh random inputs ----

/// splitmix64 from a seed (drawn from the OS by [`Fresh::new`]).
struct Fresh(u64);

impl Fresh {
    fn new() -> (Fresh, u64) {
        let seed = rand::random();
        (Fresh(seed), seed)
    }

    fn seeded(seed: u64) -> Fresh {
        Fresh(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n` > 0).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// `len` random bytes.
    fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(len + 8);
        while v.len() < len {
            v.extend_from_slice(&self.next().to_le_bytes());
        }
        v.truncate(len);
        v
    }

    /// A magnitude in [1, 2) of the sign given.
    fn magnitude(&mut self, negative: bool) -> f64 {
        let m = 1.0 + (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        if negative {
            -m
        } else {
            m
        }
    }
}

/// Random bytes to take the inputs of data movement from: `take` gives
/// `count` elements at a fresh random offset (cheap in a debug build for
/// millions of elements; two takes of one call are the same bytes only if
/// their offsets are, which `take_distinct` rules out).
struct Pool {
    bytes: Vec<u8>,
    rng: Fresh,
    seed: u64,
}

impl Pool {
    fn new(len: usize) -> Pool {
        let (mut rng, seed) = Fresh::new();
        let bytes = rng.bytes(len);
        println!("pool of {len} random bytes from seed {seed:#018x}");
        Pool { bytes, rng, seed }
    }

    fn take_at<T: Moved>(&self, at: usize, count: usize) -> Vec<T> {
        let len = count * std::mem::size_of::<T>();
        from_bytes(&self.bytes[at..at + len])
    }

    /// `ranks` inputs of `count` elements at distinct random offsets.
    fn take_distinct<T: Moved>(&mut self, ranks: usize, count: usize) -> Vec<Vec<T>> {
        let len = count * std::mem::size_of::<T>();
        assert!(len < self.bytes.len(), "a take of {len} bytes from a pool of {}", self.bytes.len());
        let mut at: Vec<usize> = Vec::with_capacity(ranks);
        while at.len() < ranks {
            let o = self.rng.below(self.bytes.len() - len + 1);
            if len == 0 || !at.contains(&o) {
                at.push(o);
            }
        }
        at.into_iter().map(|o| self.take_at(o, count)).collect()
    }
}

/// `bytes` as elements of `T` (a copy, so any alignment will do).
fn from_bytes<T: Moved>(bytes: &[u8]) -> Vec<T> {
    let sz = std::mem::size_of::<T>();
    assert!(bytes.len().is_multiple_of(sz), "{} bytes of {}-byte elements", bytes.len(), sz);
    let mut v = vec![<T as bytemuck::Zeroable>::zeroed(); bytes.len() / sz];
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(bytes);
    v
}

/// A type these tests move: every `Movable` (printable).
trait Moved: Movable + std::fmt::Debug {}
impl<T: Movable + std::fmt::Debug> Moved for T {}

/// The type's short name.
fn name<T>() -> &'static str {
    std::any::type_name::<T>().rsplit("::").next().unwrap_or("?")
}

/// The byte every output holds before a call.
const POISON: u8 = 0xA5;

/// `count` poisoned elements.
fn poison<T: Moved>(count: usize) -> Vec<T> {
    from_bytes(&vec![POISON; count * std::mem::size_of::<T>()])
}

/// A device buffer of `count` poisoned elements on `s`.
fn poisoned<T: Moved>(s: &Arc<CudaStream>, count: usize) -> CudaSlice<T> {
    s.clone_htod(&poison::<T>(count)).expect("a poisoned buffer")
}

/// The first element where `got` and `want` differ in their bits, and how
/// many do.
fn first_difference<T: Moved>(got: &[T], want: &[T]) -> Option<(usize, usize)> {
    let (g, w): (&[u8], &[u8]) = (bytemuck::cast_slice(got), bytemuck::cast_slice(want));
    if got.len() == want.len() && g == w {
        return None;
    }
    if got.len() != want.len() {
        return Some((got.len().min(want.len()), got.len().abs_diff(want.len())));
    }
    let sz = std::mem::size_of::<T>();
    let wrong: Vec<usize> = (0..got.len()).filter(|&i| g[i * sz..(i + 1) * sz] != w[i * sz..(i + 1) * sz]).collect();
    wrong.first().map(|&i| (i, wrong.len()))
}

/// Asserts that `got` and `want` are the same bits.
fn assert_bits<T: Moved>(what: &str, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some((i, wrong)) = first_difference(got, want) {
        panic!("{what}: {wrong} of {} {} elements differ, first [{i}] = {:?} instead of {:?}", got.len(), name::<T>(), got[i], want[i]);
    }
}

/// Calls `$f::<T>($args)` for every `Movable` type.
macro_rules! every_movable {
    ($f:ident($($arg:expr),* $(,)?)) => {{
        $f::<f32>($($arg),*);
        $f::<f64>($($arg),*);
        $f::<f16>($($arg),*);
        $f::<bf16>($($arg),*);
        $f::<i32>($($arg),*);
        $f::<i64>($($arg),*);
        $f::<u32>($($arg),*);
        $f::<u64>($($arg),*);
        $f::<i8>($($arg),*);
        $f::<u8>($($arg),*);
        $f::<F8E4M3>($($arg),*);
        $f::<F8E5M2>($($arg),*);
    }};
}

// ---- paths and chunks ----

/// The staging buffer asked for on the P2P path (its region is rounded up
/// to the VMM granularity, so its chunks are about half of that).
const P2P_BUFFER: usize = 4096;

/// The staging buffer of the staged path: chunks of about 8 KiB, so that
/// the point-to-point slots (a chunk divided among the ranks) are 1 to 4
/// KiB.
const STAGED_BUFFER: usize = 16 << 10;

fn options(policy: PathPolicy) -> CommOptions {
    let buffer = if policy == PathPolicy::StagedOnly { STAGED_BUFFER } else { P2P_BUFFER };
    CommOptions::default().buffer_bytes(buffer).path(policy)
}

/// Bytes that cross a chunk of `path` (and so its point-to-point slots, a
/// chunk divided among the ranks) at least three times, plus an odd tail:
/// on the P2P path at least 3 MiB, and three times its chunk (below
/// `(P2P_BUFFER + granularity) / 2`); staged, three times its chunk
/// (below `(STAGED_BUFFER + 4096) / 2`: the region is rounded up to whole
/// pages).
fn big_bytes(ctxs: &[Arc<CudaContext>], path: Path) -> usize {
    if path == Path::Staged {
        return 3 * (STAGED_BUFFER + 4096) / 2 + 333;
    }
    let g = ctxs.iter().map(|c| cuda_peer::ipc::vmm::granularity(c).expect("VMM granularity")).max().unwrap_or(2 << 20);
    (3 * (P2P_BUFFER + g) / 2).max(3 << 20) + 333
}

/// The path a communicator of `n` ranks over `gpus` devices (round robin)
/// takes under `policy`: staged where asked, else P2P unless two of its
/// devices lack P2P (then `Auto` stages, which is said).
fn expected_path(test: &str, n: usize, gpus: usize, policy: PathPolicy) -> Path {
    if policy == PathPolicy::StagedOnly {
        return Path::Staged;
    }
    let devices: Vec<usize> = (0..n.min(gpus)).collect();
    for &a in &devices {
        for &b in devices.iter().filter(|&&b| b != a) {
            if !cuda_peer::peer::can_access_peer(a, b).expect("cuDeviceCanAccessPeer") {
                skipped(test, format!("n={n}: the P2P path: no P2P from GPU {a} to GPU {b}, so Auto stages (the staged path ran instead)"));
                return Path::Staged;
            }
        }
    }
    Path::P2p
}

/// `n` ranks as threads on `policy`'s path, each on its own stream, the
/// engine and ranks checked.
fn make(test: &str, ctxs: &[Arc<CudaContext>], n: usize, opts: &CommOptions) -> (Vec<Comm>, Path) {
    let path = expected_path(test, n, ctxs.len(), opts.path);
    let streams = streams(ctxs, n);
    let comms = Comm::from_devices_with(streams.clone(), opts).unwrap_or_else(|e| panic!("n={n} {:?}: from_devices_with: {e}", opts.path));
    for (r, c) in comms.iter().enumerate() {
        assert_eq!(c.engine(), Engine::Host(path), "n={n}: rank {r}'s engine");
        assert_eq!((c.rank(), c.world_size()), (r, n), "n={n}: rank {r}'s rank and size");
        assert!(Arc::ptr_eq(c.stream(), &streams[r]), "n={n}: rank {r}: not the caller's stream");
    }
    (comms, path)
}

/// Says once that the ranks share the devices present (each `n` above
/// their count).
fn say_shared(test: &str, g: usize, most: usize) {
    has_gpus(test, &format!("up to {most} ranks with a device each (more than {g} ranks share the {g} present)"), g, most);
}

// ---- 1. send and receive of every type, count, rank count and path ----

/// One rank's outputs of [`moves`]: the ring shift's, the pairwise
/// exchange's, the chain's (send then receive on rank 0, receive then
/// send on the others, no group), and the send buffers after the calls.
struct Moves<T> {
    ring: Vec<T>,
    pair: Vec<T>,
    chain: Vec<T>,
    sent: Vec<T>,
}

/// `count` elements of `T` on every rank of `comms`: a ring shift in a
/// group (from `r - 1`, to `r + 1`), a pairwise exchange in a group (with
/// `r ^ 1`, to itself for the last of an odd count), and the same ring as
/// a chain of plain sends and receives, into poisoned outputs; every output
/// bit-exact, every send buffer unchanged.
fn moves<T: Moved>(comms: &[Comm], pool: &mut Pool, tag: &str, count: usize) {
    let n = comms.len();
    let what = |call: &str, r: usize| format!("{tag}: {} {call} of {count}: rank {r}", name::<T>());
    let ins = pool.take_distinct::<T>(n, count);
    let got = each(comms, |r, c| {
        let s = c.stream();
        let fail = |call: &str, e: Error| -> ! { panic!("{}: {e}", what(call, r)) };
        let send = s.clone_htod(&ins[r]).unwrap();
        let (mut ring, mut pair, mut chain) = (poisoned::<T>(s, count), poisoned::<T>(s, count), poisoned::<T>(s, count));
        let mut g = c.group();
        g.send(&send, next(r, n)).unwrap_or_else(|e| fail("ring shift: group send", e));
        g.recv(&mut ring, prev(r, n)).unwrap_or_else(|e| fail("ring shift: group recv", e));
        g.end().unwrap_or_else(|e| fail("ring shift: end", e));
        let p = partner(r, n);
        let mut g = c.group();
        // The receive first on odd ranks: the order within a group does not matter.
        if r % 2 == 1 {
            g.recv(&mut pair, p).unwrap_or_else(|e| fail("pairwise exchange: group recv", e));
            g.send(&send, p).unwrap_or_else(|e| fail("pairwise exchange: group send", e));
        } else {
            g.send(&send, p).unwrap_or_else(|e| fail("pairwise exchange: group send", e));
            g.recv(&mut pair, p).unwrap_or_else(|e| fail("pairwise exchange: group recv", e));
        }
        drop(g); // ends it
        if r == 0 {
            c.send(&send, next(r, n)).unwrap_or_else(|e| fail("chain: send", e));
            c.recv(&mut chain, prev(r, n)).unwrap_or_else(|e| fail("chain: recv", e));
        } else {
            c.recv(&mut chain, prev(r, n)).unwrap_or_else(|e| fail("chain: recv", e));
            c.send(&send, next(r, n)).unwrap_or_else(|e| fail("chain: send", e));
        }
        c.synchronize().unwrap_or_else(|e| fail("synchronize", e));
        let down = |b: &CudaSlice<T>| s.clone_dtoh(b).unwrap();
        Moves { ring: down(&ring), pair: down(&pair), chain: down(&chain), sent: down(&send) }
    });
    for (r, m) in got.iter().enumerate() {
        assert_bits(&what(&format!("ring shift (from rank {})", prev(r, n)), r), &m.ring, &ins[prev(r, n)]);
        assert_bits(&what(&format!("pairwise exchange (with rank {})", partner(r, n)), r), &m.pair, &ins[partner(r, n)]);
        assert_bits(&what(&format!("chain (from rank {})", prev(r, n)), r), &m.chain, &ins[prev(r, n)]);
        assert_bits(&what("the send buffer", r), &m.sent, &ins[r]);
    }
}

/// [`moves`] at 0, 1 and 1023 elements, and past several point-to-point
/// slots (`big` bytes) where `big` is given.
fn moves_at<T: Moved>(comms: &[Comm], pool: &mut Pool, tag: &str, big: Option<usize>) {
    for count in [0, 1, 1023] {
        moves::<T>(comms, pool, tag, count);
    }
    if let Some(b) = big {
        moves::<T>(comms, pool, tag, b / std::mem::size_of::<T>());
    }
}

/// The suite of [`moves`] on 2 to 8 ranks under `policy`: every type at
/// 0, 1 and 1023 elements; past several slots every type on 2, 3 and 8
/// ranks, u8 (an odd count of bytes) and F8E5M2 on the others.
fn send_recv_suite(test: &str, policy: PathPolicy) {
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    let g = ctxs.len();
    say_shared(test, g, 8);
    let mut pool = Pool::new(3 * big_bytes(&ctxs, Path::P2p));
    for n in 2..=8 {
        let (comms, path) = make(test, &ctxs, n, &options(policy));
        let big = big_bytes(&ctxs, path);
        let tag = format!("n={n} {path:?} (seed {:#018x})", pool.seed);
        let every_big = matches!(n, 2 | 3 | 8);
        let b = every_big.then_some(big);
        every_movable!(moves_at(&comms, &mut pool, &tag, b));
        if !every_big {
            moves::<u8>(&comms, &mut pool, &tag, big);
            moves::<F8E5M2>(&comms, &mut pool, &tag, big);
        }
    }
}

/// Every `Movable` type (both fp8 types too) at 0, 1, 1023 elements and
/// past several chunks, on 2 to 8 ranks, on the P2P path: a grouped ring
/// shift, a grouped pairwise exchange (a send to itself on odd counts), a
/// chain of plain sends and receives; bit-exact, send buffers unchanged.
#[test]
fn send_recv_every_type_count_and_rank_count_on_the_p2p_path() {
    send_recv_suite("send_recv_every_type_count_and_rank_count_on_the_p2p_path", PathPolicy::Auto);
}

/// The same on the staged path (chunks of about 8 KiB, a slot of 1 to 4
/// KiB per pair).
#[test]
fn send_recv_every_type_count_and_rank_count_on_the_staged_path() {
    send_recv_suite("send_recv_every_type_count_and_rank_count_on_the_staged_path", PathPolicy::StagedOnly);
}

/// The largest exchange that runs as one kernel (docs/point-to-point.md):
/// up to four parts of 64 KiB.
const ONE_KERNEL_MOST: usize = 256 << 10;

/// A ring shift in a group between views at odd byte offsets (rank `r`
/// sends bytes `3..3 + len` of a buffer to `r + 1` and receives from
/// `r - 1` into bytes `5..5 + len` of a poisoned one), so that neither
/// end is 16-byte aligned, at lengths of one to four parts of the
/// one-kernel exchange, around its bound and past several slots, on 2
/// and 3 ranks: P2P with slots of a few hundred KiB and with the default
/// (slots of a MiB or more), and staged: bit-exact, the bytes around each view
/// untouched.
#[test]
fn send_recv_between_views_at_odd_offsets() {
    let test = "send_recv_between_views_at_odd_offsets";
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    say_shared(test, ctxs.len(), 3);
    let mut pool = Pool::new(2 * ONE_KERNEL_MOST);
    let default = CommOptions::default().path(PathPolicy::Auto);
    for opts in [options(PathPolicy::Auto), default, options(PathPolicy::StagedOnly)] {
        for n in [2, 3] {
            let (comms, path) = make(test, &ctxs, n, &opts);
            let path = format!("{path:?} (buffer of {} bytes)", opts.buffer_bytes);
            let lens = [1, 15, 17, 4093, (64 << 10) - 3, (64 << 10) + 5, 200_003, 458_759, ONE_KERNEL_MOST - 1, ONE_KERNEL_MOST, ONE_KERNEL_MOST + 1];
            for len in lens {
                let seed = pool.seed;
                let what = |r: usize| format!("{path} n={n} len={len} (seed {seed:#018x}): rank {r}");
                let ins = pool.take_distinct::<u8>(n, len + 8);
                let got = each(&comms, |r, c| {
                    let s = c.stream();
                    let send = s.clone_htod(&ins[r]).unwrap();
                    let mut out = poisoned::<u8>(s, len + 11);
                    {
                        let (view, mut into) = (send.slice(3..3 + len), out.slice_mut(5..5 + len));
                        let mut g = c.group();
                        g.send(&view, next(r, n)).unwrap_or_else(|e| panic!("{}: send: {e}", what(r)));
                        g.recv(&mut into, prev(r, n)).unwrap_or_else(|e| panic!("{}: recv: {e}", what(r)));
                        g.end().unwrap_or_else(|e| panic!("{}: end: {e}", what(r)));
                    }
                    c.synchronize().unwrap_or_else(|e| panic!("{}: synchronize: {e}", what(r)));
                    s.clone_dtoh(&out).unwrap()
                });
                for (r, out) in got.iter().enumerate() {
                    let from = &ins[prev(r, n)];
                    assert_bits(&format!("{}: the view received", what(r)), &out[5..5 + len], &from[3..3 + len]);
                    assert_bits(&format!("{}: the bytes before the view", what(r)), &out[..5], &poison::<u8>(5));
                    assert_bits(&format!("{}: the bytes after the view", what(r)), &out[5 + len..], &poison::<u8>(6));
                }
            }
        }
    }
}

// ---- 2. several transfers with one peer in a group, and with itself ----

/// The lengths of the messages every rank sends every rank (itself
/// included), in order: `lens[from][to]`.
fn message_lengths(rng: &mut Fresh, n: usize, long: usize) -> Vec<Vec<Vec<usize>>> {
    let choices = [0, 1, 3, 1000, 4099, long];
    (0..n).map(|_| (0..n).map(|_| (0..1 + rng.below(3)).map(|_| choices[rng.below(choices.len())]).collect()).collect()).collect()
}

/// One transfer of a group: to or from `peer`, message `index` of that
/// peer's in that direction.
#[derive(Debug, Clone, Copy)]
struct Step {
    peer: usize,
    send: bool,
    index: usize,
}

/// A random interleaving of rank `me`'s sends and receives that keeps each
/// peer's sends, and each peer's receives, in their order.
fn interleave(rng: &mut Fresh, lens: &[Vec<Vec<usize>>], me: usize) -> Vec<Step> {
    let mut queues: Vec<(usize, bool, usize, usize)> = Vec::new(); // peer, send, next, total
    for (q, from_q) in lens.iter().enumerate() {
        queues.push((q, true, 0, lens[me][q].len()));
        queues.push((q, false, 0, from_q[me].len()));
    }
    let mut steps = Vec::new();
    loop {
        let open: Vec<usize> = (0..queues.len()).filter(|&i| queues[i].2 < queues[i].3).collect();
        if open.is_empty() {
            return steps;
        }
        let i = open[rng.below(open.len())];
        let (peer, send, index, _) = queues[i];
        steps.push(Step { peer, send, index });
        queues[i].2 += 1;
    }
}

/// On `comms`: every rank sends every rank (itself too) one to three
/// messages of `T` of different lengths (0 among them, and one of `long`
/// elements), all in one group, in a random interleaving of its own that
/// keeps each peer's order; every message lands in its own poisoned
/// receive, bit-exact.
fn several_messages<T: Moved>(comms: &[Comm], pool: &mut Pool, tag: &str, long: usize) {
    let n = comms.len();
    let (mut rng, seed) = Fresh::new();
    let tag = format!("{tag}: {} (layout seed {seed:#018x})", name::<T>());
    let lens = message_lengths(&mut rng, n, long);
    let plans: Vec<Vec<Step>> = (0..n).map(|r| interleave(&mut rng, &lens, r)).collect();
    // msgs[from][to][k]
    let msgs: Vec<Vec<Vec<Vec<T>>>> =
        lens.iter().map(|to| to.iter().map(|ks| ks.iter().map(|&l| pool.take_distinct::<T>(1, l).remove(0)).collect()).collect()).collect();
    let got = each(comms, |r, c| {
        let s = c.stream();
        let sends: Vec<Vec<CudaSlice<T>>> = (0..n).map(|q| msgs[r][q].iter().map(|m| s.clone_htod(m).unwrap()).collect()).collect();
        let mut recvs: Vec<Vec<CudaSlice<T>>> = (0..n).map(|q| lens[q][r].iter().map(|&l| poisoned::<T>(s, l)).collect()).collect();
        {
            let mut slots: Vec<Vec<Option<&mut CudaSlice<T>>>> = recvs.iter_mut().map(|v| v.iter_mut().map(Some).collect()).collect();
            let mut g = c.group();
            for st in &plans[r] {
                let res = if st.send {
                    g.send(&sends[st.peer][st.index], st.peer)
                } else {
                    g.recv(slots[st.peer][st.index].take().expect("each receive once"), st.peer)
                };
                res.unwrap_or_else(|e| panic!("{tag}: rank {r}: {st:?}: {e}"));
            }
            g.end().unwrap_or_else(|e| panic!("{tag}: rank {r}: the group's end: {e}"));
        }
        c.synchronize().unwrap_or_else(|e| panic!("{tag}: rank {r}: synchronize: {e}"));
        recvs.iter().map(|v| v.iter().map(|b| s.clone_dtoh(b).unwrap()).collect::<Vec<_>>()).collect::<Vec<_>>()
    });
    for (r, from) in got.iter().enumerate() {
        for (q, ks) in from.iter().enumerate() {
            for (k, m) in ks.iter().enumerate() {
                let what = format!("{tag}: rank {r}: message {k} of {} from rank {q} ({} elements; lengths {:?})", ks.len(), m.len(), lens[q][r]);
                assert_bits(&what, m, &msgs[q][r][k]);
            }
        }
    }
}

/// On 2, 3 and 4 ranks, P2P and staged: one group per rank with one to
/// three messages to every rank and itself, of lengths 0 to past a slot,
/// u32 and F8E5M2, interleaved at random (each peer's order kept): each
/// message in its own receive.
#[test]
fn several_messages_to_one_peer_and_to_itself_match_in_order() {
    let test = "several_messages_to_one_peer_and_to_itself_match_in_order";
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    say_shared(test, ctxs.len(), 4);
    let mut pool = Pool::new(4 << 20);
    for policy in [PathPolicy::Auto, PathPolicy::StagedOnly] {
        for n in [2, 3, 4] {
            let (comms, path) = make(test, &ctxs, n, &options(policy));
            let tag = format!("n={n} {path:?} (seed {:#018x})", pool.seed);
            for _ in 0..2 {
                several_messages::<u32>(&comms, &mut pool, &tag, 70_001);
                several_messages::<F8E5M2>(&comms, &mut pool, &tag, 300_001);
            }
        }
    }
}

/// A rank's messages to itself are matched one with one, in order, as a
/// peer's are: a send of 8 words against two receives of 4 (or two sends
/// against one receive) is an error before anything moves, which leaves
/// the receives poisoned and the communicator usable; sends of 5 and 3
/// words against receives of 5 and 3 land each in its own. Two ranks
/// sharing the GPUs there are, P2P and staged.
#[test]
fn messages_to_itself_are_matched_one_by_one() {
    let test = "messages_to_itself_are_matched_one_by_one";
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    let (mut fresh, seed) = Fresh::new();
    for policy in [PathPolicy::Auto, PathPolicy::StagedOnly] {
        let (comms, path) = make(test, &ctxs, 2, &options(policy));
        let tag = format!("{path:?} (seed {seed:#x})");
        let words: Vec<Vec<u32>> = (0..2).map(|_| (0..8).map(|_| fresh.next() as u32).collect()).collect();
        let got = each(&comms, |r, c| {
            let s = c.stream();
            let send = s.clone_htod(&words[r]).unwrap();
            let (mut x, mut y) = (poisoned::<u32>(s, 4), poisoned::<u32>(s, 4));
            let mut g = c.group();
            g.send(&send, r).unwrap();
            g.recv(&mut x, r).unwrap();
            g.recv(&mut y, r).unwrap();
            let split = g.end();
            assert!(matches!(&split, Err(Error::InvalidArgument(_))), "{tag}: rank {r}: one send of 8 into receives of 4 and 4: {split:?}");
            let (a, b) = (send.slice(0..5), send.slice(5..8));
            let mut whole = poisoned::<u32>(s, 8);
            let mut g = c.group();
            g.send(&a, r).unwrap();
            g.send(&b, r).unwrap();
            g.recv(&mut whole, r).unwrap();
            let joined = g.end();
            assert!(matches!(&joined, Err(Error::InvalidArgument(_))), "{tag}: rank {r}: sends of 5 and 3 into one receive of 8: {joined:?}");
            let (mut five, mut three) = (poisoned::<u32>(s, 5), poisoned::<u32>(s, 3));
            let mut g = c.group();
            g.send(&a, r).unwrap();
            g.send(&b, r).unwrap();
            g.recv(&mut five, r).unwrap();
            g.recv(&mut three, r).unwrap();
            g.end().unwrap_or_else(|e| panic!("{tag}: rank {r}: sends of 5 and 3 into receives of 5 and 3: {e}"));
            c.synchronize().unwrap_or_else(|e| panic!("{tag}: rank {r}: synchronize: {e}"));
            [x, y, whole, five, three].map(|b| s.clone_dtoh(&b).unwrap())
        });
        for (r, [x, y, whole, five, three]) in got.iter().enumerate() {
            assert_bits(&format!("{tag}: rank {r}'s refused receives"), &[x.as_slice(), y, whole].concat(), &poison::<u32>(16));
            assert_bits(&format!("{tag}: rank {r}'s receive of 5"), five, &words[r][..5]);
            assert_bits(&format!("{tag}: rank {r}'s receive of 3"), three, &words[r][5..]);
        }
    }
}

/// A send or receive that fails inside a group poisons it, as a failed
/// call between `ncclGroupStart` and `ncclGroupEnd` does: the group moves
/// nothing and `end` returns the error, so ranks whose groups failed alike
/// stay in step. Two ranks (sharing the GPU where there is one), P2P and
/// staged: each adds a send to the other, then a receive from a rank that
/// does not exist; both groups end with an error, the communicators stay
/// usable, the refused receive's buffer keeps its poison, and a valid
/// exchange afterwards is exact.
#[test]
fn a_failed_call_in_a_group_moves_nothing() {
    let test = "a_failed_call_in_a_group_moves_nothing";
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    let (mut fresh, seed) = Fresh::new();
    for policy in [PathPolicy::Auto, PathPolicy::StagedOnly] {
        let (comms, path) = make(test, &ctxs, 2, &options(policy));
        let tag = format!("{path:?} (seed {seed:#x})");
        let words: Vec<Vec<u32>> = (0..2).map(|_| (0..1000).map(|_| fresh.next() as u32).collect()).collect();
        let got = each(&comms, |r, c| {
            let s = c.stream();
            let send = s.clone_htod(&words[r]).unwrap();
            let (mut x, mut y) = (poisoned::<u32>(s, 1000), poisoned::<u32>(s, 1000));
            let mut g = c.group();
            g.send(&send, 1 - r).unwrap_or_else(|e| panic!("{tag}: rank {r}: the send: {e}"));
            let refused = g.recv(&mut x, 2);
            assert!(refused.is_err(), "{tag}: rank {r}: a receive from rank 2 of 2: {refused:?}");
            let ended = g.end();
            assert!(ended.is_err(), "{tag}: rank {r}: a group with a failed call ended without an error");
            c.synchronize().unwrap_or_else(|e| panic!("{tag}: rank {r}: after the failed group: {e}"));
            let mut g = c.group();
            g.send(&send, 1 - r).unwrap();
            g.recv(&mut y, 1 - r).unwrap();
            g.end().unwrap_or_else(|e| panic!("{tag}: rank {r}: the exchange after the failed group: {e}"));
            c.synchronize().unwrap_or_else(|e| panic!("{tag}: rank {r}: synchronize: {e}"));
            [x, y].map(|b| s.clone_dtoh(&b).unwrap())
        });
        for (r, [x, y]) in got.iter().enumerate() {
            assert_bits(&format!("{tag}: rank {r}'s refused receive"), x, &poison::<u32>(1000));
            assert_bits(&format!("{tag}: rank {r}'s receive after the failed group"), y, &words[1 - r]);
        }
    }
}

// ---- 3. all-to-all, all-to-all-v, all-gather-v, reduce-scatter-v ----

/// `count` elements of `T` to and from every rank: block `j` of rank `r`'s
/// output is block `r` of rank `j`'s input.
fn all_to_all<T: Moved>(comms: &[Comm], pool: &mut Pool, tag: &str, c: usize) {
    let n = comms.len();
    let ins = pool.take_distinct::<T>(n, n * c);
    let got = each(comms, |r, comm| {
        let s = comm.stream();
        let send = s.clone_htod(&ins[r]).unwrap();
        let mut recv = poisoned::<T>(s, n * c);
        comm.all_to_all(&send, &mut recv).unwrap_or_else(|e| panic!("{tag}: {} all_to_all of {c}: rank {r}: {e}", name::<T>()));
        comm.synchronize().unwrap_or_else(|e| panic!("{tag}: all_to_all: rank {r}: synchronize: {e}"));
        (s.clone_dtoh(&recv).unwrap(), s.clone_dtoh(&send).unwrap())
    });
    for (r, (out, sent)) in got.iter().enumerate() {
        let want: Vec<T> = (0..n).flat_map(|j| ins[j][r * c..(r + 1) * c].iter().copied()).collect();
        assert_bits(&format!("{tag}: {} all_to_all of {c} per block: rank {r}", name::<T>()), out, &want);
        assert_bits(&format!("{tag}: all_to_all: rank {r}'s send buffer"), sent, &ins[r]);
    }
}

/// Where each rank's blocks of an all-to-all-v lie.
#[derive(Debug, Clone)]
struct Layout {
    /// `send_counts[r][j]`: what rank `r` sends rank `j`.
    send_counts: Vec<Vec<usize>>,
    send_offsets: Vec<Vec<usize>>,
    send_len: Vec<usize>,
    /// `recv_counts[r][j] = send_counts[j][r]`.
    recv_counts: Vec<Vec<usize>>,
    recv_offsets: Vec<Vec<usize>>,
    recv_len: Vec<usize>,
}

/// A random layout of `n` ranks: counts per pair in `0..=most` (a quarter
/// of them 0); send blocks anywhere in the send buffer (they may overlap);
/// receive blocks in a random order with random gaps (often none) and a
/// tail, never overlapping.
fn layout(rng: &mut Fresh, n: usize, most: usize) -> Layout {
    let send_counts: Vec<Vec<usize>> = (0..n).map(|_| (0..n).map(|_| if rng.below(4) == 0 { 0 } else { rng.below(most + 1) }).collect()).collect();
    let recv_counts: Vec<Vec<usize>> = (0..n).map(|r| (0..n).map(|j| send_counts[j][r]).collect()).collect();
    let mut send_len = Vec::new();
    let mut send_offsets = Vec::new();
    for counts in &send_counts {
        let len = counts.iter().copied().max().unwrap_or(0) + rng.below(9);
        send_offsets.push(counts.iter().map(|&c| rng.below(len - c + 1)).collect());
        send_len.push(len);
    }
    let mut recv_len = Vec::new();
    let mut recv_offsets = Vec::new();
    for counts in &recv_counts {
        let mut order: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            order.swap(i, rng.below(i + 1));
        }
        let (mut at, mut offsets) = (0, vec![0; n]);
        for j in order {
            at += if rng.below(2) == 0 { 0 } else { 1 + rng.below(7) };
            offsets[j] = at;
            at += counts[j];
        }
        recv_offsets.push(offsets);
        recv_len.push(at + 1 + rng.below(5));
    }
    Layout { send_counts, send_offsets, send_len, recv_counts, recv_offsets, recv_len }
}

/// Whether the receive blocks of rank `r` are inside its buffer and
/// disjoint.
fn recv_blocks_disjoint(l: &Layout, r: usize) -> bool {
    let mut spans: Vec<(usize, usize)> =
        (0..l.recv_counts[r].len()).map(|j| (l.recv_offsets[r][j], l.recv_offsets[r][j] + l.recv_counts[r][j])).filter(|s| s.0 < s.1).collect();
    spans.sort_unstable();
    spans.iter().all(|s| s.1 <= l.recv_len[r]) && spans.windows(2).all(|w| w[0].1 <= w[1].0)
}

/// What rank `r`'s receive buffer holds after an all-to-all-v of `ins`
/// (rank by rank) over `l`: the blocks, and the poison elsewhere.
fn all_to_all_v_reference<T: Moved>(l: &Layout, ins: &[Vec<T>], r: usize) -> Vec<T> {
    let mut want = poison::<T>(l.recv_len[r]);
    for (j, input) in ins.iter().enumerate() {
        let (c, at, from) = (l.recv_counts[r][j], l.recv_offsets[r][j], l.send_offsets[j][r]);
        want[at..at + c].copy_from_slice(&input[from..from + c]);
    }
    want
}

/// One all-to-all-v of `T` over a random layout with counts up to `most`.
fn all_to_all_v<T: Moved>(comms: &[Comm], pool: &mut Pool, tag: &str, most: usize) {
    let n = comms.len();
    let (mut rng, seed) = Fresh::new();
    let l = layout(&mut rng, n, most);
    let tag = format!("{tag}: {} all_to_all_v, counts up to {most} (layout seed {seed:#018x})", name::<T>());
    let ins: Vec<Vec<T>> = (0..n).map(|r| pool.take_distinct::<T>(1, l.send_len[r]).remove(0)).collect();
    let got = each(comms, |r, c| {
        let s = c.stream();
        let send = s.clone_htod(&ins[r]).unwrap();
        let mut recv = poisoned::<T>(s, l.recv_len[r]);
        let (sb, rb) = (Blocks::new(&l.send_counts[r], &l.send_offsets[r]), Blocks::new(&l.recv_counts[r], &l.recv_offsets[r]));
        c.all_to_all_v(&send, &sb, &mut recv, &rb).unwrap_or_else(|e| panic!("{tag}: rank {r}: {e}"));
        c.synchronize().unwrap_or_else(|e| panic!("{tag}: rank {r}: synchronize: {e}"));
        (s.clone_dtoh(&recv).unwrap(), s.clone_dtoh(&send).unwrap())
    });
    for (r, (out, sent)) in got.iter().enumerate() {
        let what = format!("{tag}: rank {r} (recv counts {:?} at {:?} of {})", l.recv_counts[r], l.recv_offsets[r], l.recv_len[r]);
        assert_bits(&what, out, &all_to_all_v_reference(&l, &ins, r));
        assert_bits(&format!("{tag}: rank {r}'s send buffer"), sent, &ins[r]);
    }
}

/// Uneven counts of `n` ranks in `0..=most`, one of them 0.
fn uneven_counts(rng: &mut Fresh, n: usize, most: usize) -> Vec<usize> {
    let mut counts: Vec<usize> = (0..n).map(|_| rng.below(most + 1)).collect();
    counts[rng.below(n)] = 0;
    counts
}

/// One all-gather-v of `T` with uneven counts (one rank's 0).
fn all_gather_v<T: Moved>(comms: &[Comm], pool: &mut Pool, tag: &str, most: usize) {
    let n = comms.len();
    let (mut rng, seed) = Fresh::new();
    let counts = uneven_counts(&mut rng, n, most);
    let tag = format!("{tag}: {} all_gather_v of {counts:?} (counts seed {seed:#018x})", name::<T>());
    let ins: Vec<Vec<T>> = (0..n).map(|r| pool.take_distinct::<T>(1, counts[r]).remove(0)).collect();
    let total: usize = counts.iter().sum();
    let got = each(comms, |r, c| {
        let s = c.stream();
        let send = s.clone_htod(&ins[r]).unwrap();
        let mut recv = poisoned::<T>(s, total);
        c.all_gather_v(&send, &mut recv, &counts).unwrap_or_else(|e| panic!("{tag}: rank {r}: {e}"));
        c.synchronize().unwrap_or_else(|e| panic!("{tag}: rank {r}: synchronize: {e}"));
        (s.clone_dtoh(&recv).unwrap(), s.clone_dtoh(&send).unwrap())
    });
    let want = ins.concat();
    for (r, (out, sent)) in got.iter().enumerate() {
        assert_bits(&format!("{tag}: rank {r}"), out, &want);
        assert_bits(&format!("{tag}: rank {r}'s send buffer"), sent, &ins[r]);
    }
}

/// An element type of the reductions here: how its fresh inputs are drawn.
trait Arith: Num + Moved {
    /// Any value of an integer type; for a float, a magnitude in [1, 2) of
    /// the sign given (`negative`).
    fn draw(rng: &mut Fresh, negative: bool) -> Self;
}

impl Arith for u32 {
    fn draw(rng: &mut Fresh, _: bool) -> u32 {
        (rng.next() >> 32) as u32
    }
}

impl Arith for i32 {
    fn draw(rng: &mut Fresh, _: bool) -> i32 {
        (rng.next() >> 32) as u32 as i32
    }
}

impl Arith for f32 {
    fn draw(rng: &mut Fresh, negative: bool) -> f32 {
        rng.magnitude(negative) as f32
    }
}

impl Arith for bf16 {
    fn draw(rng: &mut Fresh, negative: bool) -> bf16 {
        bf16::from_f64(rng.magnitude(negative))
    }
}

/// Fresh inputs of `n` ranks, `count` elements each; element `i` has one
/// sign on every rank (so that a dropped rank lies outside the bound).
fn draw<T: Arith>(rng: &mut Fresh, n: usize, count: usize) -> Vec<Vec<T>> {
    let signs: Vec<bool> = (0..count).map(|_| rng.next() & 1 == 1).collect();
    (0..n).map(|_| signs.iter().map(|&neg| T::draw(rng, neg)).collect()).collect()
}

/// Asserts that `got[i]` is a right reduction of element `offset + i` of
/// every rank's inputs: integers exactly the wrapping reduction, floats
/// within `num::float_bound` of the f64 reference.
fn assert_reduced<T: Arith>(what: &str, op: ReduceOp, ins: &[Vec<T>], offset: usize, got: &[T]) {
    let mut xs = vec![0f64; ins.len()];
    let wrong: Vec<usize> = (0..got.len())
        .filter(|&i| match T::BITS {
            None => {
                let want = ins[1..].iter().fold(ins[0][offset + i], |a, x| T::combine(op, a, x[offset + i]));
                bytemuck::bytes_of(&got[i]) != bytemuck::bytes_of(&want)
            }
            Some(_) => {
                for (d, x) in xs.iter_mut().zip(ins) {
                    *d = x[offset + i].to_f64();
                }
                !num::accepts(op, &xs, got[i])
            }
        })
        .collect();
    if let Some(&i) = wrong.first() {
        let xs: Vec<f64> = ins.iter().map(|x| x[offset + i].to_f64()).collect();
        let bound = T::BITS.map(|b| num::float_bound(op, &xs, b)).unwrap_or(0.0);
        panic!(
            "{what}: {} of {} elements wrong, first [{i}] = {:?} from the inputs {xs:?}, expected {} (within {bound:e})",
            wrong.len(),
            got.len(),
            got[i],
            num::reference(op, &xs)
        );
    }
}

/// One reduce-scatter-v of `T` and `op` with uneven counts (one rank's 0).
fn reduce_scatter_v<T: Arith>(comms: &[Comm], tag: &str, op: ReduceOp, most: usize) {
    let n = comms.len();
    let (mut rng, seed) = Fresh::new();
    let counts = uneven_counts(&mut rng, n, most);
    let total: usize = counts.iter().sum();
    let offsets: Vec<usize> = counts.iter().scan(0, |at, &c| Some(std::mem::replace(at, *at + c))).collect();
    let tag = format!("{tag}: {} {op:?} reduce_scatter_v of {counts:?} (seed {seed:#018x})", name::<T>());
    let ins = draw::<T>(&mut rng, n, total);
    let got = each(comms, |r, c| {
        let s = c.stream();
        let send = s.clone_htod(&ins[r]).unwrap();
        let mut recv = poisoned::<T>(s, counts[r]);
        c.reduce_scatter_v(&send, &mut recv, &counts, op).unwrap_or_else(|e| panic!("{tag}: rank {r}: {e}"));
        c.synchronize().unwrap_or_else(|e| panic!("{tag}: rank {r}: synchronize: {e}"));
        (s.clone_dtoh(&recv).unwrap(), s.clone_dtoh(&send).unwrap())
    });
    for (r, (out, sent)) in got.iter().enumerate() {
        assert_reduced(&format!("{tag}: rank {r}'s part"), op, &ins, offsets[r], out);
        assert_bits(&format!("{tag}: rank {r}'s send buffer"), sent, &ins[r]);
    }
}

/// On 2, 3, 4 and 8 ranks, P2P and staged: all-to-all (u32, f16,
/// F8E4M3; 0, 1, 1023 elements per block, u32 blocks of several parts of
/// the one-kernel exchange, and past several chunks), all-to-all-v on
/// random layouts (u32, bf16, F8E5M2; counts per pair with zeros, receive
/// blocks in a random order with poisoned gaps and tail; four calls on one
/// communicator with new counts each, one of several parts per pair, one
/// past several slots), all-gather-v with uneven counts (one 0; u32, f32,
/// F8E4M3), reduce-scatter-v with uneven counts (u32 and i32 sums exact,
/// f32 sum and avg and bf16 sum within the bound).
#[test]
fn all_to_all_and_the_uneven_collectives_against_the_cpu() {
    let test = "all_to_all_and_the_uneven_collectives_against_the_cpu";
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    say_shared(test, ctxs.len(), 8);
    let mut pool = Pool::new(2 * big_bytes(&ctxs, Path::P2p));
    for policy in [PathPolicy::Auto, PathPolicy::StagedOnly] {
        for n in [2, 3, 4, 8] {
            let (comms, path) = make(test, &ctxs, n, &options(policy));
            let big = big_bytes(&ctxs, path);
            let tag = format!("n={n} {path:?} (pool seed {:#018x})", pool.seed);
            for c in [0, 1, 1023] {
                all_to_all::<u32>(&comms, &mut pool, &tag, c);
                all_to_all::<f16>(&comms, &mut pool, &tag, c);
                all_to_all::<F8E4M3>(&comms, &mut pool, &tag, c);
            }
            // Blocks of three parts of the one-kernel exchange, where a slot holds them.
            all_to_all::<u32>(&comms, &mut pool, &tag, 40_001);
            all_to_all::<u32>(&comms, &mut pool, &tag, big / (4 * n) + 1);
            all_to_all::<F8E4M3>(&comms, &mut pool, &tag, big / n + 1);
            // Up to 3000 elements: one part; up to 100,000: several, each
            // direction with its own length; `big`: past several slots.
            for most in [3000, 0, 100_000, big / (4 * n)] {
                all_to_all_v::<u32>(&comms, &mut pool, &tag, most);
            }
            all_to_all_v::<bf16>(&comms, &mut pool, &tag, 3000);
            all_to_all_v::<F8E5M2>(&comms, &mut pool, &tag, 5001);
            for most in [3000, big / (4 * n)] {
                all_gather_v::<u32>(&comms, &mut pool, &tag, most);
            }
            all_gather_v::<f32>(&comms, &mut pool, &tag, 2000);
            all_gather_v::<F8E4M3>(&comms, &mut pool, &tag, 9001);
            reduce_scatter_v::<u32>(&comms, &tag, ReduceOp::Sum, 5000);
            reduce_scatter_v::<u32>(&comms, &tag, ReduceOp::Sum, big / (4 * n));
            reduce_scatter_v::<i32>(&comms, &tag, ReduceOp::Sum, 3000);
            reduce_scatter_v::<f32>(&comms, &tag, ReduceOp::Sum, 3000);
            reduce_scatter_v::<f32>(&comms, &tag, ReduceOp::Avg, 3000);
            reduce_scatter_v::<bf16>(&comms, &tag, ReduceOp::Sum, 2000);
        }
    }
}

// ---- 4. failures ----

/// The barrier timeout of the failure tests.
const BT: Duration = Duration::from_millis(1500);

fn failing_options() -> CommOptions {
    CommOptions::default().barrier_timeout(BT)
}

/// Asserts that `r` is `GroupFailed` naming a disagreement.
fn expect_disagree(what: &str, r: &cuda_peer::Result<()>) {
    match r {
        Err(Error::GroupFailed { reason }) if reason.contains("disagree") => {}
        other => panic!("{what}: expected GroupFailed (\"disagree\"), got {other:?}"),
    }
}

/// What a rank of a failure test saw: its call's result, its
/// `synchronize()`'s, how long after the call's start that came, its
/// `async_error()`, and a next call's result and how long it took.
#[derive(Debug)]
struct Failed {
    call: cuda_peer::Result<()>,
    sync: cuda_peer::Result<()>,
    took: Duration,
    async_error: cuda_peer::Result<()>,
    next: cuda_peer::Result<()>,
    next_took: Duration,
}

/// Runs `call` on rank `r` of `c`, then `synchronize`, `async_error` and a
/// next call (an all-reduce every failed rank must refuse at once).
fn fail_with(c: &Comm, call: impl FnOnce() -> cuda_peer::Result<()>) -> Failed {
    let t = Instant::now();
    let call = call();
    let sync = c.synchronize();
    let took = t.elapsed();
    let async_error = c.async_error();
    let mut x = c.stream().clone_htod(&[1u32; 16]).unwrap();
    let t = Instant::now();
    let next = c.all_reduce_in_place(&mut x, ReduceOp::Sum);
    Failed { call, sync, took, async_error, next, next_took: t.elapsed() }
}

/// Asserts that a rank failed with a disagreement, at once (well within
/// the barrier timeout), and that its communicator then refuses calls.
fn assert_disagreed(what: &str, f: &Failed) {
    if f.call.is_err() {
        expect_disagree(&format!("{what}: the call"), &f.call);
    }
    expect_disagree(&format!("{what}: synchronize"), &f.sync);
    expect_disagree(&format!("{what}: async_error"), &f.async_error);
    assert!(f.took < BT, "{what}: the disagreement took {:?} (barrier timeout {BT:?}): found by a timeout, not by the views", f.took);
    assert!(f.next.is_err(), "{what}: the failed communicator ran the next call");
    assert!(f.next_took < BT, "{what}: the failed communicator took {:?} to refuse the next call", f.next_took);
}

/// On a new communicator of 2 ranks, a group on each rank that sends the
/// other `lens[r].0` bytes of `fill` and receives `lens[r].1` into a
/// poisoned buffer, lengths that disagree: both ranks fail as
/// [`assert_disagreed`] requires.
fn grouped_exchange_disagrees(test: &str, ctxs: &[Arc<CudaContext>], opts: &CommOptions, what: &str, fill: u8, lens: [(usize, usize); 2]) {
    let (comms, _) = make(test, ctxs, 2, opts);
    let got = each(&comms, |r, c| {
        let s = c.stream();
        let (out, inn) = lens[r];
        let a = s.clone_htod(&vec![fill; out]).unwrap();
        let mut b = poisoned::<u8>(s, inn);
        fail_with(c, || {
            let mut g = c.group();
            g.send(&a, 1 - r)?;
            g.recv(&mut b, 1 - r)?;
            g.end()
        })
    });
    for (r, f) in got.iter().enumerate() {
        assert_disagreed(&format!("{what}: rank {r}"), f);
    }
}

/// On 2 ranks: a send of 100 u32 against a receive of 99 (plain calls);
/// a grouped exchange whose receive on rank 1 is one element longer than
/// rank 0's send; a grouped exchange in one kernel whose sides have
/// different numbers of parts; an all-to-all-v whose rank 0 sends rank 1 five elements
/// where rank 1 expects six. Each: `Error::GroupFailed` naming the
/// disagreement on both ranks, at once, from `synchronize()` and
/// `async_error()` (or the call), and both communicators then refuse the
/// next call.
#[test]
fn mismatched_lengths_fail_both_ranks_with_group_failed() {
    let test = "mismatched_lengths_fail_both_ranks_with_group_failed";
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    let opts = failing_options();

    let (comms, _) = make(test, &ctxs, 2, &opts);
    let got = each(&comms, |r, c| {
        let s = c.stream();
        if r == 0 {
            let a = s.clone_htod(&[7u32; 100]).unwrap();
            fail_with(c, || c.send(&a, 1))
        } else {
            let mut b = poisoned::<u32>(s, 99);
            fail_with(c, || c.recv(&mut b, 0))
        }
    });
    for (r, f) in got.iter().enumerate() {
        assert_disagreed(&format!("send of 100 against recv of 99: rank {r}"), f);
    }
    drop(comms);

    grouped_exchange_disagrees(test, &ctxs, &opts, "a grouped exchange of 1000 against 1001", 3, [(1000, 1000), (1000, 1001)]);
    // Both sides in one kernel, in different numbers of parts (rank 0: 3
    // for 150,000 bytes out, 100,000 in; rank 1: 4 for 100,000 out,
    // 250,000 in): part 0 finds the disagreement, and the part that only
    // rank 1 has gives up with it instead of waiting.
    let what = "a one-kernel exchange of 150,000 against 250,000 bytes";
    grouped_exchange_disagrees(test, &ctxs, &opts, what, 5, [(150_000, 100_000), (100_000, 250_000)]);

    let (comms, _) = make(test, &ctxs, 2, &opts);
    let got = each(&comms, |r, c| {
        let s = c.stream();
        let send = s.clone_htod(&[9u32; 20]).unwrap();
        let mut recv = poisoned::<u32>(s, 20);
        // Rank 0 sends 2 to itself and 5 to rank 1; rank 1 expects 6 from rank 0.
        let (sc, so, rc, ro) = if r == 0 { ([2, 5], [0, 2], [2, 4], [0, 2]) } else { ([4, 3], [0, 4], [6, 3], [0, 6]) };
        fail_with(c, || c.all_to_all_v(&send, &Blocks::new(&sc, &so), &mut recv, &Blocks::new(&rc, &ro)))
    });
    for (r, f) in got.iter().enumerate() {
        assert_disagreed(&format!("an all_to_all_v whose counts disagree: rank {r}"), f);
    }
}

/// Asserts that a rank's call timed out: `PeerTimeout` or `Timeout` from
/// the call or `synchronize()`, not before the barrier timeout and well
/// within a few seconds after it (or, where `disagree_ok`, a
/// disagreement, which may come at once).
fn assert_timed_out(what: &str, f: &Failed, disagree_ok: bool) {
    let e = match (&f.call, &f.sync) {
        (Err(e), _) | (Ok(()), Err(e)) => e,
        (Ok(()), Ok(())) => panic!("{what}: the call and synchronize() succeeded"),
    };
    match e {
        Error::PeerTimeout { .. } | Error::Timeout { .. } => {
            assert!(f.took >= BT.mul_f64(0.9), "{what}: timed out after {:?}, before the barrier timeout {BT:?}", f.took);
        }
        Error::GroupFailed { reason } if disagree_ok && reason.contains("disagree") => {}
        other => panic!("{what}: expected PeerTimeout or Timeout, got {other:?}"),
    }
    assert!(f.took < BT + Duration::from_secs(5), "{what}: the error came after {:?} (barrier timeout {BT:?})", f.took);
    assert!(f.next.is_err(), "{what}: the failed communicator ran the next call");
}

/// On 2 ranks with a barrier timeout of 1.5 s: a send rank 1 never
/// receives, and a receive rank 0 never sends: a typed timeout
/// (`PeerTimeout` or `Timeout`) on the waiting rank after the barrier
/// timeout, not a hang; two plain sends that cross (each rank sends the
/// other first): a timeout or a disagreement on both, bounded.
#[test]
fn a_send_or_recv_without_its_peer_times_out() {
    let test = "a_send_or_recv_without_its_peer_times_out";
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    let opts = failing_options();
    for waiting in [0, 1] {
        let (comms, _) = make(test, &ctxs, 2, &opts);
        let got = each(&comms, |r, c| {
            let s = c.stream();
            (r == waiting).then(|| {
                if r == 0 {
                    let a = s.clone_htod(&[1u32; 1000]).unwrap();
                    fail_with(c, || c.send(&a, 1))
                } else {
                    let mut b = poisoned::<u32>(s, 1000);
                    fail_with(c, || c.recv(&mut b, 0))
                }
            })
        });
        let what = if waiting == 0 { "rank 0: a send rank 1 never receives" } else { "rank 1: a receive rank 0 never sends" };
        assert_timed_out(what, got[waiting].as_ref().expect("the waiting rank's outcome"), false);
    }
    let (comms, _) = make(test, &ctxs, 2, &opts);
    let got = each(&comms, |r, c| {
        let s = c.stream();
        let a = s.clone_htod(&[1u32; 1000]).unwrap();
        let mut b = poisoned::<u32>(s, 1000);
        fail_with(c, || {
            c.send(&a, 1 - r)?;
            c.recv(&mut b, 1 - r)
        })
    });
    for (r, f) in got.iter().enumerate() {
        assert_timed_out(&format!("rank {r}: plain sends that cross"), f, true);
    }
}

fn expect_invalid(what: &str, r: cuda_peer::Result<()>) {
    match r {
        Err(Error::InvalidArgument(_)) => {}
        other => panic!("{what}: expected InvalidArgument, got {other:?}"),
    }
}

/// On 3 ranks, every rank at once: sends and receives (plain and in a
/// group) to peers out of range, all-to-all-v blocks that overlap, do not
/// fit their buffer, are not one per rank, or send this rank itself
/// another count than it receives, and all-to-alls of buffers that are not
/// `n` equal blocks: `InvalidArgument` (or `LengthMismatch`) on every rank
/// (a group with a refused call ends with that error too), the outputs
/// still poisoned; then a grouped ring shift and an
/// all-to-all-v on the same communicators are right.
#[test]
fn bad_arguments_are_invalid_arguments_and_the_comm_still_works() {
    let test = "bad_arguments_are_invalid_arguments_and_the_comm_still_works";
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    let n = 3;
    let (comms, path) = make(test, &ctxs, n, &failing_options());
    let mut pool = Pool::new(1 << 20);
    let got = each(&comms, |r, c| {
        let s = c.stream();
        let w = |what: &str| format!("rank {r}: {what}");
        let a = s.clone_htod(&[5u32; 12]).unwrap();
        let mut b = poisoned::<u32>(s, 12);
        for peer in [n, n + 1, usize::MAX] {
            expect_invalid(&w(&format!("send to peer {peer}")), c.send(&a, peer));
            expect_invalid(&w(&format!("recv from peer {peer}")), c.recv(&mut b, peer));
            let mut g = c.group();
            expect_invalid(&w(&format!("group send to peer {peer}")), g.send(&a, peer));
            expect_invalid(&w("the end of a group whose send was refused"), g.end());
            let mut g = c.group();
            expect_invalid(&w(&format!("group recv from peer {peer}")), g.recv(&mut b, peer));
            drop(g);
        }
        let ones = [4, 4, 4];
        let apart = [0, 4, 8];
        let blocks = Blocks::new(&ones, &apart);
        for (what, rc, ro) in [
            ("overlapping recv blocks", [4, 4, 4], [0, 3, 8]),
            ("recv blocks at one offset", [4, 4, 4], [0, 0, 8]),
            ("a recv block past the end", [4, 4, 4], [0, 4, 9]),
        ] {
            let res = c.all_to_all_v(&a, &blocks, &mut b, &Blocks::new(&rc, &ro));
            expect_invalid(&w(&format!("all_to_all_v: {what} ({rc:?} at {ro:?})")), res);
        }
        expect_invalid(&w("all_to_all_v: a send block past the end"), c.all_to_all_v(&a, &Blocks::new(&ones, &[0, 4, 9]), &mut b, &blocks));
        expect_invalid(&w("all_to_all_v: two counts for three ranks"), c.all_to_all_v(&a, &Blocks::new(&[4, 4], &[0, 4]), &mut b, &blocks));
        // Every rank sends itself 4 and expects 3 from itself.
        let mut self_counts = ones;
        self_counts[r] = 3;
        expect_invalid(
            &w("all_to_all_v: another count to itself than from itself"),
            c.all_to_all_v(&a, &blocks, &mut b, &Blocks::new(&self_counts, &apart)),
        );
        let mut short = poisoned::<u32>(s, 11);
        match c.all_to_all(&a, &mut short) {
            Err(Error::LengthMismatch { .. }) | Err(Error::InvalidArgument(_)) => {}
            other => panic!("{}: expected LengthMismatch, got {other:?}", w("all_to_all of 12 into 11")),
        }
        let (eleven, mut eleven_out) = (s.clone_htod(&[1u32; 11]).unwrap(), poisoned::<u32>(s, 11));
        expect_invalid(&w("all_to_all of 11 elements on 3 ranks"), c.all_to_all(&eleven, &mut eleven_out));
        c.synchronize().unwrap_or_else(|e| panic!("{}: {e}", w("synchronize after the refused calls")));
        [b, short, eleven_out].iter().map(|x| s.clone_dtoh(x).unwrap()).collect::<Vec<_>>()
    });
    for (r, outs) in got.iter().enumerate() {
        for o in outs {
            assert_bits(&format!("rank {r}: an output of a refused call"), o, &poison::<u32>(o.len()));
        }
    }
    let tag = format!("n={n} {path:?} after the refused calls (seed {:#018x})", pool.seed);
    moves::<u32>(&comms, &mut pool, &tag, 1023);
    all_to_all_v::<u32>(&comms, &mut pool, &tag, 1000);
}

fn expect_mismatch(what: &str, me: usize, r: cuda_peer::Result<()>) {
    match r {
        Err(Error::Mismatch { rank, ours, theirs }) if rank != me && ours != theirs => {}
        other => panic!("{what}: rank {me}: expected Mismatch naming another rank, got {other:?}"),
    }
}

/// On 2 and 3 ranks: an all-gather-v and a reduce-scatter-v whose counts
/// differ between the ranks (each rank's buffers fit its own counts):
/// `Error::Mismatch` on every rank (`check_calls`, on by default), the
/// outputs still poisoned; then the same calls with counts every rank
/// shares are right.
#[test]
fn uneven_collectives_whose_counts_differ_are_a_mismatch_on_every_rank() {
    let test = "uneven_collectives_whose_counts_differ_are_a_mismatch_on_every_rank";
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    let mut pool = Pool::new(1 << 20);
    for n in [2, 3] {
        let (comms, path) = make(test, &ctxs, n, &failing_options());
        let got = each(&comms, |r, c| {
            let s = c.stream();
            let mut counts = vec![10; n];
            counts[0] = 5 + r; // each rank's own view of rank 0's count
            let total: usize = counts.iter().sum();
            let send = s.clone_htod(&vec![2u32; counts[r]]).unwrap();
            let mut recv = poisoned::<u32>(s, total);
            expect_mismatch(&format!("n={n}: all_gather_v with counts {counts:?}"), r, c.all_gather_v(&send, &mut recv, &counts));
            let big = s.clone_htod(&vec![3u32; total]).unwrap();
            let mut part = poisoned::<u32>(s, counts[r]);
            expect_mismatch(
                &format!("n={n}: reduce_scatter_v with counts {counts:?}"),
                r,
                c.reduce_scatter_v(&big, &mut part, &counts, ReduceOp::Sum),
            );
            (s.clone_dtoh(&recv).unwrap(), s.clone_dtoh(&part).unwrap())
        });
        for (r, (a, b)) in got.iter().enumerate() {
            assert_bits(&format!("n={n}: rank {r}: the refused all_gather_v's output"), a, &poison::<u32>(a.len()));
            assert_bits(&format!("n={n}: rank {r}: the refused reduce_scatter_v's output"), b, &poison::<u32>(b.len()));
        }
        let tag = format!("n={n} {path:?} after the mismatches (seed {:#018x})", pool.seed);
        all_gather_v::<u32>(&comms, &mut pool, &tag, 1000);
        reduce_scatter_v::<u32>(&comms, &tag, ReduceOp::Sum, 1000);
    }
}

/// On 2 ranks: rank 0 sends rank 1 nothing (a send of 0 elements) where
/// rank 1 receives 10. The lengths differ, so both ranks' communicators
/// fail with `GroupFailed` naming the disagreement (as `Collectives::send`
/// documents), rather than rank 0 succeeding and rank 1 waiting for the
/// barrier timeout.
#[test]
fn a_send_of_nothing_against_a_receive_of_ten_fails_both_ranks() {
    let test = "a_send_of_nothing_against_a_receive_of_ten_fails_both_ranks";
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    let (comms, _) = make(test, &ctxs, 2, &failing_options());
    let got = each(&comms, |r, c| {
        let s = c.stream();
        if r == 0 {
            let a = s.clone_htod(&[0u32; 0]).unwrap();
            fail_with(c, || c.send(&a, 1))
        } else {
            let mut b = poisoned::<u32>(s, 10);
            fail_with(c, || c.recv(&mut b, 0))
        }
    });
    for (r, f) in got.iter().enumerate() {
        assert_disagreed(&format!("a send of 0 against a recv of 10: rank {r}"), f);
    }
}

/// On 2 ranks, one group each: rank 0 sends rank 1 messages of 3 and 5
/// elements; rank 1 receives 5 then 3. The totals agree but the messages
/// do not (matched in order, of the same lengths): both ranks fail with
/// `GroupFailed` naming the disagreement, rather than the bytes landing
/// across the two receives.
#[test]
fn messages_whose_lengths_differ_in_order_fail_both_ranks() {
    let test = "messages_whose_lengths_differ_in_order_fail_both_ranks";
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    let (comms, _) = make(test, &ctxs, 2, &failing_options());
    let got = each(&comms, |r, c| {
        let s = c.stream();
        if r == 0 {
            let (a, b) = (s.clone_htod(&[1u32; 3]).unwrap(), s.clone_htod(&[2u32; 5]).unwrap());
            fail_with(c, || {
                let mut g = c.group();
                g.send(&a, 1)?;
                g.send(&b, 1)?;
                g.end()
            })
        } else {
            let (mut x, mut y) = (poisoned::<u32>(s, 5), poisoned::<u32>(s, 3));
            fail_with(c, || {
                let mut g = c.group();
                g.recv(&mut x, 0)?;
                g.recv(&mut y, 0)?;
                g.end()
            })
        }
    });
    for (r, f) in got.iter().enumerate() {
        assert_disagreed(&format!("messages of 3 and 5 against receives of 5 and 3: rank {r}"), f);
    }
}

/// On 2 ranks: rank 0 makes a plain send to rank 1 and then a plain
/// receive from it; rank 1 receives and sends in one group. An exchange
/// is matched as a whole (docs/point-to-point.md: a group is mirrored by a
/// group), so the first meeting's views disagree: both ranks fail with
/// `GroupFailed` naming the disagreement, at once, rather than moving
/// data into the wrong buffers or waiting for the barrier timeout.
#[test]
fn a_group_on_one_side_against_plain_calls_on_the_other_fails_both_ranks() {
    let test = "a_group_on_one_side_against_plain_calls_on_the_other_fails_both_ranks";
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    let (comms, _) = make(test, &ctxs, 2, &failing_options());
    let got = each(&comms, |r, c| {
        let s = c.stream();
        let send = s.clone_htod(&[7u32; 5000]).unwrap();
        let mut recv = poisoned::<u32>(s, 5000);
        if r == 0 {
            fail_with(c, || {
                c.send(&send, 1)?;
                c.recv(&mut recv, 1)
            })
        } else {
            fail_with(c, || {
                let mut g = c.group();
                g.recv(&mut recv, 0)?;
                g.send(&send, 0)?;
                g.end()
            })
        }
    });
    for (r, f) in got.iter().enumerate() {
        assert_disagreed(&format!("plain calls against a group: rank {r}"), f);
    }
}

// ---- 5. split ----

/// What one rank of the split test saw of its sub-communicator: its rank
/// and size, the gathered parent ranks (in the new order), the sum.
type Sub = Option<(usize, usize, Vec<u32>, Vec<u32>)>;

/// What one rank of a split round gives back: what it saw, the parent's
/// sum, and its sub-communicator (dropped once every rank is done).
type SplitOut = (Sub, Vec<u32>, Option<Comm>);

/// Each rank splits with `color(r)` and key `3 - r` (reversed), then,
/// on its sub-communicator, all-gathers its parent rank and all-reduces
/// (sum) fresh u32; then an all-reduce on the parent.
fn split_round(comms: &[Comm], color: impl Fn(usize) -> Option<u32> + Sync, ins: &[Vec<u32>], parent_ins: &[Vec<u32>]) -> Vec<SplitOut> {
    let n = comms.len();
    each(comms, |r, c| {
        let s = c.stream();
        let key = (n - 1 - r) as u32;
        let sub = c.split(color(r), key).unwrap_or_else(|e| panic!("rank {r}: split({:?}, {key}): {e}", color(r)));
        let seen = sub.as_ref().map(|sub| {
            let (sr, sn) = (sub.rank(), sub.world_size());
            let me = s.clone_htod(&[r as u32]).unwrap();
            let mut all = poisoned::<u32>(s, sn);
            sub.all_gather(&me, &mut all).unwrap_or_else(|e| panic!("rank {r}: the sub-communicator's all_gather: {e}"));
            let send = s.clone_htod(&ins[r]).unwrap();
            let mut sum = poisoned::<u32>(s, ins[r].len());
            sub.all_reduce(&send, &mut sum, ReduceOp::Sum).unwrap_or_else(|e| panic!("rank {r}: the sub-communicator's all_reduce: {e}"));
            sub.synchronize().unwrap_or_else(|e| panic!("rank {r}: the sub-communicator's synchronize: {e}"));
            (sr, sn, s.clone_dtoh(&all).unwrap(), s.clone_dtoh(&sum).unwrap())
        });
        let mut buf = s.clone_htod(&parent_ins[r]).unwrap();
        c.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap_or_else(|e| panic!("rank {r}: the parent's all_reduce after the split: {e}"));
        (seen, s.clone_dtoh(&buf).unwrap(), sub)
    })
}

/// Checks a split round against its colors: each rank's sub-communicator
/// holds the ranks of its color ordered by key (reversed rank), and its
/// sum is over those ranks only; a rank without a color has none; the
/// parent's sum is over every rank.
fn check_split(tag: &str, got: &[SplitOut], color: impl Fn(usize) -> Option<u32>, ins: &[Vec<u32>], parent_ins: &[Vec<u32>]) {
    let n = got.len();
    let sum_of = |ranks: &[usize], xs: &[Vec<u32>]| -> Vec<u32> {
        (0..xs[0].len()).map(|i| ranks.iter().fold(0u32, |a, &k| a.wrapping_add(xs[k][i]))).collect()
    };
    for (r, (sub, parent, _)) in got.iter().enumerate() {
        match (color(r), sub) {
            (None, None) => {}
            (None, Some(_)) => panic!("{tag}: rank {r} passed no color and got a communicator"),
            (Some(c), None) => panic!("{tag}: rank {r} (color {c}) got no communicator"),
            (Some(c), Some((sr, sn, order, sum))) => {
                // By key (n - 1 - rank), then parent rank: descending ranks.
                let members: Vec<usize> = (0..n).rev().filter(|&k| color(k) == Some(c)).collect();
                assert_eq!(*sn, members.len(), "{tag}: rank {r}'s sub-communicator size (color {c})");
                assert_eq!(members.get(*sr), Some(&r), "{tag}: rank {r} is rank {sr} of color {c}'s {members:?}");
                assert_eq!(*order, members.iter().map(|&k| k as u32).collect::<Vec<_>>(), "{tag}: rank {r}: color {c}'s ranks in its order");
                let want = sum_of(&members, ins);
                if let Some((i, wrong)) = first_difference(sum, &want) {
                    panic!(
                        "{tag}: rank {r}: the sum over color {c} ({members:?}): {wrong} elements wrong, first [{i}] = {} instead of {}",
                        sum[i], want[i]
                    );
                }
            }
        }
        let want = sum_of(&(0..n).collect::<Vec<_>>(), parent_ins);
        assert!(
            first_difference(parent, &want).is_none(),
            "{tag}: rank {r}: the parent's sum after the split wrong at {:?}",
            first_difference(parent, &want)
        );
    }
}

/// Four ranks split by `rank % 2` with the keys reversed: two
/// sub-communicators of two, each ranked by key (rank 2 before 0, 3 before
/// 1); the all-gather of the parent ranks says their order, and an
/// all-reduce on each sums its members' fresh inputs only. Then colors
/// `rank % 2` for ranks 0 to 2 and none for rank 3: `Ok(None)` on rank 3,
/// a sub-communicator of one on rank 1. The parent still all-reduces
/// right after each split.
#[test]
fn split_by_parity_with_reversed_keys() {
    let test = "split_by_parity_with_reversed_keys";
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    say_shared(test, ctxs.len(), 4);
    let n = 4;
    for policy in [PathPolicy::Auto, PathPolicy::StagedOnly] {
        let (comms, path) = make(test, &ctxs, n, &options(policy));
        let (mut rng, seed) = Fresh::new();
        let tag = format!("{path:?} (seed {seed:#018x})");
        let ins = draw::<u32>(&mut rng, n, 4099);
        let parent_ins = draw::<u32>(&mut rng, n, 1000);
        let parity = |r: usize| Some((r % 2) as u32);
        let got = split_round(&comms, parity, &ins, &parent_ins);
        check_split(&format!("{tag}: colors rank % 2"), &got, parity, &ins, &parent_ins);
        let ins = draw::<u32>(&mut rng, n, 777);
        let some = |r: usize| (r != 3).then_some((r % 2) as u32);
        let got = split_round(&comms, some, &ins, &parent_ins);
        check_split(&format!("{tag}: rank 3 without a color"), &got, some, &ins, &parent_ins);
    }
}

// ---- 6. graphs ----

/// One rank's buffers of a graph round (the graph captures their
/// addresses): the ring shift's send and receive, the all-to-all's.
struct GraphBufs {
    a: CudaSlice<u32>,
    b: CudaSlice<u32>,
    x: CudaSlice<u32>,
    y: CudaSlice<u32>,
}

/// One rank's inputs of a graph round: the ring shift's, the all-to-all's.
type GraphIn = (Vec<u32>, Vec<u32>);
/// One rank's outputs of a graph round.
type GraphOut = (Vec<u32>, Vec<u32>);

fn driver_err<E: std::fmt::Debug>(what: &'static str) -> impl Fn(E) -> String {
    move |e| format!("{what}: {e:?}")
}

impl GraphBufs {
    fn new(s: &Arc<CudaStream>, count: usize, all: usize) -> Result<GraphBufs, String> {
        let z = |len: usize| s.alloc_zeros::<u32>(len).map_err(driver_err("cuMemAlloc"));
        Ok(GraphBufs { a: z(count)?, b: z(count)?, x: z(all)?, y: z(all)? })
    }

    /// The inputs copied into the buffers and the outputs poisoned, in the
    /// stream's order.
    fn fill(&mut self, s: &Arc<CudaStream>, ins: &GraphIn) -> Result<(), String> {
        let up = driver_err("cuMemcpyHtoD");
        s.memcpy_htod(&ins.0, &mut self.a).map_err(&up)?;
        s.memcpy_htod(&ins.1, &mut self.x).map_err(&up)?;
        s.memcpy_htod(&poison::<u32>(self.b.len()), &mut self.b).map_err(&up)?;
        s.memcpy_htod(&poison::<u32>(self.y.len()), &mut self.y).map_err(&up)?;
        Ok(())
    }

    fn read(&self, s: &Arc<CudaStream>) -> Result<GraphOut, String> {
        let down = |b: &CudaSlice<u32>| s.clone_dtoh(b).map_err(driver_err("cuMemcpyDtoH"));
        Ok((down(&self.b)?, down(&self.y)?))
    }
}

/// The calls of a graph round: a grouped ring shift, then an all-to-all.
fn graph_calls(c: &Comm, b: &mut GraphBufs) -> cuda_peer::Result<()> {
    let (r, n) = (c.rank(), c.world_size());
    let mut g = c.group();
    g.send(&b.a, next(r, n))?;
    g.recv(&mut b.b, prev(r, n))?;
    g.end()?;
    c.all_to_all(&b.x, &mut b.y)
}

/// One rank of the graph test, on its own thread: round 0 eagerly; then,
/// once every rank is there, the calls captured into a graph on its
/// stream (every rank at once); the graph replayed on rounds `1..=half`
/// (fresh inputs copied in before each replay, outputs poisoned); every
/// rank drops its `Comm`; the rest of the rounds replayed. Every rank
/// reaches every barrier whatever fails (none is left waiting).
fn graph_rank(comm: Comm, rounds: &[Vec<GraphIn>], barrier: &Barrier, count: usize, c: usize) -> Result<Vec<GraphOut>, String> {
    let (r, n) = (comm.rank(), comm.world_size());
    let s = comm.stream().clone();
    let mut outs = Vec::new();
    let eager = GraphBufs::new(&s, count, n * c).and_then(|mut b| {
        b.fill(&s, &rounds[0][r])?;
        graph_calls(&comm, &mut b).map_err(|e| format!("rank {r}: the eager calls: {e}"))?;
        comm.synchronize().map_err(|e| format!("rank {r}: synchronize: {e}"))?;
        outs.push(b.read(&s)?);
        Ok(b)
    });
    barrier.wait();
    let captured = eager.and_then(|mut b| {
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(driver_err("cuStreamBeginCapture"))?;
        let called = graph_calls(&comm, &mut b);
        let graph = s.end_capture(CUgraphInstantiate_flags(0));
        called.map_err(|e| format!("rank {r}: the calls under capture: {e}"))?;
        let graph: CudaGraph = graph.map_err(driver_err("cuStreamEndCapture / cuGraphInstantiate"))?.ok_or("an empty graph")?;
        Ok((b, graph))
    });
    barrier.wait();
    let half = rounds.len() / 2;
    let replay = |b: &mut GraphBufs, graph: &CudaGraph, k: usize, outs: &mut Vec<GraphOut>| -> Result<(), String> {
        b.fill(&s, &rounds[k][r])?;
        graph.launch().map_err(driver_err("cuGraphLaunch"))?;
        s.synchronize().map_err(|e| format!("rank {r}: replay {k}: synchronize: {e:?}"))?;
        outs.push(b.read(&s)?);
        Ok(())
    };
    // Each rank's replays wait for its peers' on the device: all of them
    // replay, or none (one that could not capture leaves the others to
    // time out at their barriers, bounded).
    let replayed = captured.and_then(|(mut b, graph)| {
        for k in 1..half {
            replay(&mut b, &graph, k, &mut outs)?;
        }
        Ok((b, graph))
    });
    barrier.wait();
    drop(comm);
    barrier.wait();
    let (mut b, graph) = replayed?;
    for k in half..rounds.len() {
        replay(&mut b, &graph, k, &mut outs).map_err(|e| format!("{e} (every Comm dropped)"))?;
    }
    drop(graph);
    Ok(outs)
}

/// On 2, 3 and 4 ranks (threads), P2P and staged: an eager round of a
/// grouped ring shift (40,001 u32: three parts of the one-kernel exchange
/// on the P2P path, many chunks of the staged path) and an all-to-all
/// (1000 per block); then every rank captures the same calls
/// into a CUDA graph on its stream, all at once; each graph is replayed 20
/// times on fresh inputs copied into the captured buffers before each
/// replay (outputs poisoned), the last 11 after every `Comm` is dropped;
/// every round's outputs bit-exact.
#[test]
fn graphs_of_a_group_and_an_all_to_all_replay_after_every_comm_is_dropped() {
    let test = "graphs_of_a_group_and_an_all_to_all_replay_after_every_comm_is_dropped";
    let _gpu = exclusive();
    let Some(ctxs) = gpus(test, 1) else { return };
    // SAFETY: these context handles are this test's own (`gpus` makes new
    // ones); every buffer of the test is made after this, on its rank's
    // stream, and each rank's work is all on that stream (a captured stream
    // may not wait for events recorded outside the capture).
    for c in &ctxs {
        unsafe { c.disable_event_tracking() };
    }
    say_shared(test, ctxs.len(), 4);
    let (count, c) = (40_001, 1000);
    let replays = 20;
    for policy in [PathPolicy::Auto, PathPolicy::StagedOnly] {
        for n in [2, 3, 4] {
            let opts = options(policy).buffer_bytes(4096);
            let (comms, path) = make(test, &ctxs, n, &opts);
            let (mut rng, seed) = Fresh::new();
            let tag = format!("n={n} {path:?} (seed {seed:#018x})");
            let rounds: Vec<Vec<GraphIn>> = (0..=replays)
                .map(|_| {
                    let (a, x) = (draw::<u32>(&mut rng, n, count), draw::<u32>(&mut rng, n, n * c));
                    a.into_iter().zip(x).collect()
                })
                .collect();
            let barrier = Barrier::new(n);
            let outs: Vec<Result<Vec<GraphOut>, String>> = std::thread::scope(|s| {
                let hs: Vec<_> = comms
                    .into_iter()
                    .map(|comm| {
                        let (rounds, barrier) = (&rounds, &barrier);
                        s.spawn(move || graph_rank(comm, rounds, barrier, count, c))
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().expect("a rank's thread")).collect()
            });
            let outs: Vec<Vec<GraphOut>> = outs.into_iter().map(|o| o.unwrap_or_else(|e| panic!("{tag}: {e}"))).collect();
            for (r, per_round) in outs.iter().enumerate() {
                assert_eq!(per_round.len(), rounds.len(), "{tag}: rank {r}: rounds missing");
                for (k, (ring, a2a)) in per_round.iter().enumerate() {
                    let round = match k {
                        0 => "the eager round".to_string(),
                        k if k < rounds.len() / 2 => format!("replay {k}"),
                        k => format!("replay {k}, every Comm dropped"),
                    };
                    assert_bits(&format!("{tag}: {round}: rank {r}: the ring shift"), ring, &rounds[k][prev(r, n)].0);
                    let want: Vec<u32> = (0..n).flat_map(|j| rounds[k][j].1[r * c..(r + 1) * c].iter().copied()).collect();
                    assert_bits(&format!("{tag}: {round}: rank {r}: the all_to_all"), a2a, &want);
                }
            }
        }
    }
}

// ---- 7. processes ----

/// Set in a child of the process test: the file rank 0 writes its `Id`'s
/// bytes to (hex), which the other rank reads.
const ID_FILE: &str = "CUDA_PEER_P2P_TEST_ID_FILE";
/// Set in a child of the process test: the run's seed (fresh inputs every
/// run, the same on every rank).
const SEED: &str = "CUDA_PEER_P2P_TEST_SEED";
/// What a child of the process test prints at its end.
const PROCS_LINE: &str = "send, recv, group exchange and all_to_all_v right";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2) && s.is_ascii(), "not hex: {s:?}");
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap_or_else(|e| panic!("not hex: {s:?}: {e}"))).collect()
}

/// The `Id` of a child: made by rank 0 and written to the file (through a
/// rename, so that no reader sees half of it), read by the others
/// (bounded).
fn id_through_a_file(rank: usize) -> Id {
    let file = std::path::PathBuf::from(std::env::var(ID_FILE).expect("the id file"));
    if rank == 0 {
        let id = Id::new().expect("Id::new");
        let part = file.with_extension("part");
        std::fs::write(&part, hex(id.as_bytes())).expect("writing the id");
        std::fs::rename(&part, &file).expect("publishing the id");
        return id;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match std::fs::read_to_string(&file) {
            Ok(text) => break Id::from_bytes(&unhex(text.trim())).unwrap_or_else(|e| panic!("rank {rank}: Id::from_bytes: {e}")),
            Err(e) if Instant::now() >= deadline => panic!("rank {rank}: no id in {} after 60 s: {e}", file.display()),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// A child of the process test: joins with `Comm::from_rank_with`
/// (`share_devices`: the ranks may share a GPU) on a stream of its own;
/// every rank draws every rank's inputs from the run's seed; then a
/// grouped exchange of 1 Mi + 3 u32 (past several chunks), plain calls in
/// order (rank 0 sends then receives F8E4M3, rank 1 receives then sends),
/// and two all-to-all-v of u32 on seeded layouts, into poisoned outputs,
/// each bit-exact.
fn p2p_child() {
    let rank = procs::rank();
    let n: usize = std::env::var("WORLD_SIZE").expect("WORLD_SIZE").parse().expect("WORLD_SIZE");
    let seed: u64 = std::env::var(SEED).expect("the seed").parse().expect("the seed");
    let id = id_through_a_file(rank);
    let devices = cuda_peer::driver::device_count().expect("device count");
    let stream = cuda_peer::driver::context(rank % devices).expect("context").new_stream().expect("stream");
    let opts = CommOptions::default().share_devices(true).timeout(Duration::from_secs(60));
    let comm = Comm::from_rank_with(stream.clone(), rank, n, id, &opts).unwrap_or_else(|e| panic!("rank {rank}: from_rank_with: {e}"));
    assert_eq!((comm.rank(), comm.world_size()), (rank, n));
    assert!(matches!(comm.engine(), Engine::Host(_)), "rank {rank}: engine {:?}", comm.engine());
    let s = &stream;
    let fail = |what: &str, e: Error| -> ! { panic!("rank {rank}: {what}: {e} (seed {seed:#018x})") };
    let inputs = |k: u64, len: usize| -> Vec<Vec<u8>> { (0..n).map(|r| Fresh::seeded(seed ^ (k << 8) ^ r as u64).bytes(len)).collect() };

    let count = (1 << 20) + 3;
    let ins: Vec<Vec<u32>> = inputs(1, 4 * count).iter().map(|b| from_bytes(b)).collect();
    let p = partner(rank, n);
    let send = s.clone_htod(&ins[rank]).unwrap();
    let mut recv = poisoned::<u32>(s, count);
    let mut g = comm.group();
    g.send(&send, p).unwrap_or_else(|e| fail("group send", e));
    g.recv(&mut recv, p).unwrap_or_else(|e| fail("group recv", e));
    g.end().unwrap_or_else(|e| fail("group end", e));
    comm.synchronize().unwrap_or_else(|e| fail("synchronize", e));
    assert_bits(&format!("rank {rank}: the group exchange with rank {p} (seed {seed:#018x})"), &s.clone_dtoh(&recv).unwrap(), &ins[p]);

    let f8: Vec<Vec<F8E4M3>> = inputs(2, 100_001).iter().map(|b| from_bytes(b)).collect();
    let send = s.clone_htod(&f8[rank]).unwrap();
    let mut recv = poisoned::<F8E4M3>(s, 100_001);
    if rank == 0 {
        comm.send(&send, next(rank, n)).unwrap_or_else(|e| fail("send", e));
        comm.recv(&mut recv, prev(rank, n)).unwrap_or_else(|e| fail("recv", e));
    } else {
        comm.recv(&mut recv, prev(rank, n)).unwrap_or_else(|e| fail("recv", e));
        comm.send(&send, next(rank, n)).unwrap_or_else(|e| fail("send", e));
    }
    comm.synchronize().unwrap_or_else(|e| fail("synchronize", e));
    assert_bits(
        &format!("rank {rank}: the chain from rank {} (seed {seed:#018x})", prev(rank, n)),
        &s.clone_dtoh(&recv).unwrap(),
        &f8[prev(rank, n)],
    );

    for (k, most) in [(3u64, 50_000), (4, 700_000)] {
        let l = layout(&mut Fresh::seeded(seed ^ (k << 32)), n, most);
        let bytes = inputs(k, 4 * l.send_len.iter().copied().max().unwrap_or(0));
        let ins: Vec<Vec<u32>> = (0..n).map(|r| from_bytes(&bytes[r][..4 * l.send_len[r]])).collect();
        let send = s.clone_htod(&ins[rank]).unwrap();
        let mut recv = poisoned::<u32>(s, l.recv_len[rank]);
        let (sb, rb) = (Blocks::new(&l.send_counts[rank], &l.send_offsets[rank]), Blocks::new(&l.recv_counts[rank], &l.recv_offsets[rank]));
        comm.all_to_all_v(&send, &sb, &mut recv, &rb).unwrap_or_else(|e| fail("all_to_all_v", e));
        comm.synchronize().unwrap_or_else(|e| fail("synchronize", e));
        let what = format!("rank {rank}: all_to_all_v with counts up to {most} (recv counts {:?}, seed {seed:#018x})", l.recv_counts[rank]);
        assert_bits(&what, &s.clone_dtoh(&recv).unwrap(), &all_to_all_v_reference(&l, &ins, rank));
    }
    println!("rank {rank}: {PROCS_LINE}");
}

/// Two processes, rank 0 making the `Id` and passing it through a file:
/// a grouped exchange past several chunks, plain sends and receives of
/// F8E4M3, and two all-to-all-v on seeded layouts, each against the CPU;
/// every child must run this test and print its `rank N: ... right` line.
#[test]
fn two_processes_send_recv_and_all_to_all_v() {
    let test = "two_processes_send_recv_and_all_to_all_v";
    if child() {
        return p2p_child();
    }
    let _gpu = exclusive();
    let Some(g) = gpu_count(test, 1) else { return };
    has_gpus(test, &format!("2 processes with one device each (they share the {g} present)"), g, 2);
    let dir = tempfile::tempdir().expect("a directory for the id");
    let file = dir.path().join("id");
    let seed: u64 = rand::random();
    println!("{test}: seed {seed:#018x}");
    let env = vec![(ID_FILE, file.display().to_string()), (SEED, seed.to_string())];
    let results = spawn(test, 2, Duration::from_secs(180), |_| env.clone());
    all_succeeded(test, &results, passes(PROCS_LINE));
}

// ---- CPU-only checks of this file's helpers ----

/// The layouts of the all-to-all-v tests keep every rank's receive blocks
/// inside the buffer and disjoint, with gaps and zero counts among them,
/// counts mirrored between ranks; the reference puts each block where it
/// belongs and leaves the rest poisoned, and the comparison rejects
/// planted defects: a block one element off, a gap written, a block from
/// the wrong rank. No GPU needed.
#[test]
fn the_layouts_and_the_reference_catch_planted_defects() {
    let (mut rng, seed) = Fresh::new();
    let (mut gaps, mut zeros) = (0, 0);
    for n in 1..=8 {
        for most in [0, 1, 7, 300] {
            let l = layout(&mut rng, n, most);
            let ins: Vec<Vec<u32>> = (0..n).map(|r| (0..l.send_len[r]).map(|i| ((r as u32) << 24) | i as u32).collect()).collect();
            for r in 0..n {
                assert!(recv_blocks_disjoint(&l, r), "seed {seed:#x}: n={n} rank {r}: {l:?}");
                for j in 0..n {
                    assert_eq!(l.recv_counts[r][j], l.send_counts[j][r], "seed {seed:#x}");
                    assert!(l.send_offsets[j][r] + l.send_counts[j][r] <= l.send_len[j], "seed {seed:#x}");
                    zeros += usize::from(l.send_counts[j][r] == 0);
                }
                let want = all_to_all_v_reference(&l, &ins, r);
                let covered: usize = l.recv_counts[r].iter().sum();
                let poisoned_left = want.iter().filter(|&&x| x == poison::<u32>(1)[0]).count();
                assert_eq!(poisoned_left, l.recv_len[r] - covered, "seed {seed:#x}: n={n} rank {r}: poison left outside the blocks");
                gaps += usize::from(l.recv_len[r] - covered > 1);
                for (j, input) in ins.iter().enumerate() {
                    let (c, at, from) = (l.recv_counts[r][j], l.recv_offsets[r][j], l.send_offsets[j][r]);
                    assert_eq!(&want[at..at + c], &input[from..from + c], "seed {seed:#x}");
                    if c == 0 {
                        continue;
                    }
                    // A block one element off.
                    let mut bad = want.clone();
                    for (i, x) in bad[at..at + c].iter_mut().enumerate() {
                        *x = input.get(from + i + 1).copied().unwrap_or(u32::MAX);
                    }
                    assert!(first_difference(&bad, &want).is_some(), "seed {seed:#x}: a shifted block accepted");
                    // A block from another rank.
                    if n > 1 {
                        let k = (j + 1) % n;
                        let mut bad = want.clone();
                        for (i, x) in bad[at..at + c].iter_mut().enumerate() {
                            *x = ((k as u32) << 24) | (from + i) as u32;
                        }
                        assert!(first_difference(&bad, &want).is_some(), "seed {seed:#x}: a block from rank {k} accepted");
                    }
                }
                // The tail written.
                let mut bad = want.clone();
                *bad.last_mut().expect("a tail") = 0;
                assert!(first_difference(&bad, &want).is_some(), "seed {seed:#x}: a written tail accepted");
            }
        }
    }
    assert!(gaps > 0 && zeros > 0, "seed {seed:#x}: the layouts had no gaps ({gaps}) or no zero counts ({zeros})");
    assert!(first_difference::<F8E4M3>(&[F8E4M3::from_bits(0x80)], &[F8E4M3::from_bits(0)]).is_some(), "fp8 -0 and +0 must differ bit for bit");
    assert!(first_difference::<f32>(&[f32::from_bits(0x7fc0_0001)], &[f32::from_bits(0x7fc0_0001)]).is_none(), "a NaN moved is its own bits");
}

/// `Blocks` says each peer's count and offset, and 0 past the ranks it
/// was given. No GPU needed.
#[test]
fn blocks_name_each_peers_count_and_offset() {
    let b = Blocks::new(&[3, 0, 5], &[10, 0, 2]);
    assert_eq!((0..3).map(|j| (b.count(j), b.offset(j))).collect::<Vec<_>>(), vec![(3, 10), (0, 0), (5, 2)]);
    assert_eq!((b.count(3), b.offset(99)), (0, 0));
}

/// The pairing of the pairwise exchange is an involution (every rank the
/// partner of its partner), with a rank paired with itself only as the
/// last of an odd count. No GPU needed.
#[test]
fn the_pairwise_exchange_pairs_every_rank() {
    for n in 1..=8 {
        for r in 0..n {
            assert_eq!(partner(partner(r, n), n), r, "n={n} r={r}");
            assert_eq!(partner(r, n) == r, n % 2 == 1 && r == n - 1, "n={n} r={r}");
            assert_eq!(prev(next(r, n), n), r);
        }
    }
}

/// `cuda_peer::compat::nccl`'s `Comm::group`, cudarc's shape (views by
/// value): a ring shift of fresh random words and an all-reduce through
/// one group, on 2 and 3 thread ranks, every result exact against the CPU;
/// a peer out of range, and a receive into a buffer of another context
/// (refused at the call, as cudarc's are, not when the group ends), are
/// typed errors and leave the group usable. Then an empty reduce whose
/// ranks but the root pass no receive buffer (cudarc passes none there).
#[test]
fn compat_groups_take_views_as_cudarcs_do() {
    use cuda_peer::compat::nccl::safe::{Comm as NcclComm, ReduceOp as NcclOp};
    let test = "compat_groups_take_views_as_cudarcs_do";
    let Some(ctxs) = gpus(test, 1) else { return };
    let _gpu = exclusive();
    let (mut fresh, seed) = Fresh::new();
    for n in [2, 3] {
        let what = format!("n={n}, seed {seed:#x}");
        let comms = NcclComm::from_devices(streams(&ctxs, n)).unwrap_or_else(|e| panic!("{what}: from_devices: {e}"));
        let count = 4099;
        let inputs: Vec<Vec<u32>> = (0..n).map(|_| (0..count).map(|_| fresh.next() as u32).collect()).collect();
        // Made before any rank calls, so that no context is made while a
        // peer's kernels wait.
        let other = CudaContext::new_non_primary(ctxs[0].ordinal(), 0).unwrap();
        let foreign: Vec<std::sync::Mutex<_>> =
            (0..n).map(|_| std::sync::Mutex::new(other.default_stream().alloc_zeros::<u32>(count).unwrap())).collect();
        let outs = each(&comms, |r, c| {
            let s = c.stream();
            let mine = s.clone_htod(&inputs[r]).unwrap();
            let mut from_prev = s.clone_htod(&vec![0xDEAD_BEEFu32; count]).unwrap();
            let mut sum = s.clone_htod(&vec![0xDEAD_BEEFu32; count]).unwrap();
            let mut foreign = foreign[r].lock().unwrap();
            {
                let mut g = c.group();
                g.send(mine.slice(..), next(r, n) as i32).unwrap_or_else(|e| panic!("{what}: rank {r}: send: {e}"));
                let bad = g.send(mine.slice(..), n as i32);
                assert!(matches!(&bad, Err(e) if matches!(e.0, Error::InvalidArgument(_))), "{what}: rank {r}: a send to rank {n}: {bad:?}");
                let bad = g.recv(foreign.slice_mut(..), prev(r, n) as i32);
                assert!(
                    matches!(&bad, Err(e) if matches!(e.0, Error::WrongContext { .. })),
                    "{what}: rank {r}: a receive of another context: {bad:?}"
                );
                g.recv(from_prev.slice_mut(..), prev(r, n) as i32).unwrap_or_else(|e| panic!("{what}: rank {r}: recv: {e}"));
                g.all_reduce(mine.slice(..), sum.slice_mut(..), &NcclOp::Sum).unwrap_or_else(|e| panic!("{what}: rank {r}: all_reduce: {e}"));
                g.end().unwrap_or_else(|e| panic!("{what}: rank {r}: end: {e}"));
            }
            c.async_error().unwrap_or_else(|e| panic!("{what}: rank {r}: async_error: {e}"));
            let empty = mine.slice(0..0);
            let reduced = if r == 0 {
                c.reduce(&empty, Some(&mut sum.slice_mut(0..0)), &NcclOp::Sum, 0)
            } else {
                c.reduce(&empty, None::<&mut cuda_peer::cudarc::driver::CudaViewMut<u32>>, &NcclOp::Sum, 0)
            };
            reduced.unwrap_or_else(|e| panic!("{what}: rank {r}: an empty reduce: {e}"));
            c.async_error().unwrap_or_else(|e| panic!("{what}: rank {r}: async_error after the empty reduce: {e}"));
            (s.clone_dtoh(&from_prev).unwrap(), s.clone_dtoh(&sum).unwrap())
        });
        let want_sum: Vec<u32> = (0..count).map(|i| inputs.iter().fold(0u32, |a, x| a.wrapping_add(x[i]))).collect();
        for (r, (shifted, sum)) in outs.iter().enumerate() {
            assert!(*shifted == inputs[prev(r, n)], "{what}: rank {r} did not receive rank {}'s words", prev(r, n));
            assert!(*sum == want_sum, "{what}: rank {r}'s all-reduce through the group is wrong");
        }
    }
}
