//! GPU tests of the raw-pointer all-reduce (`Group::all_reduce_raw`):
//! buffers from raw `cuMemAlloc`, as a framework that does not use cudarc's
//! slices hands them in, ordered on caller streams that are not the group's.
//!
//! Each case writes fresh random inputs on the caller's stream (async, right
//! before the call), runs the all-reduce, reads the results back on the
//! caller's stream, and only then synchronises that stream: so a missing
//! wait in either direction shows up as poisoned or stale data. Integers are
//! compared exactly (wrapping sums), f32 within `common::num`'s per-element
//! bound (inputs in [1, 2), so that a dropped rank lies outside it); calls
//! back to back are chains (`common::chain`) whose every call's error
//! reaches the end. Ranks are laid round robin over the GPUs (rank r on
//! device r % count): on one GPU they share it, every algorithm and the
//! staged links included. Skips without a GPU (fails with
//! CUDA_PEER_REQUIRE_GPU=1 then); where a part needs two GPUs (buffers or
//! streams of the wrong device) and one is present, says so.
mod common;

use common::chain;
use cuda_peer::cudarc::driver::{result, CudaContext, CudaStream};
use cuda_peer::{Algorithm, DType, Error, Group, GroupOptions, PathPolicy, RawBuffer, RawStream, ReduceOp};
use rand::Rng;
use std::sync::Arc;

/// `count` elements of `T` from raw `cuMemAlloc` on `ctx`'s device, freed on drop.
struct DeviceAlloc {
    ctx: Arc<CudaContext>,
    ptr: u64,
    bytes: usize,
}

impl DeviceAlloc {
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Self {
        ctx.bind_to_thread().expect("bind");
        // SAFETY: a plain allocation in the bound context.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }.expect("cuMemAlloc");
        DeviceAlloc { ctx: ctx.clone(), ptr, bytes }
    }

    fn buf(&self) -> RawBuffer {
        RawBuffer(self.ptr)
    }

    fn poison(&self) {
        self.upload(&vec![0xA5u8; self.bytes]);
    }

    /// Copies `data` (at most `bytes` bytes) to the start of the buffer, and
    /// waits until it has landed.
    fn upload<T: bytemuck::Pod>(&self, data: &[T]) {
        assert!(std::mem::size_of_val(data) <= self.bytes, "an upload larger than the buffer");
        self.ctx.bind_to_thread().expect("bind");
        // SAFETY: `ptr` holds `bytes` bytes, at least `data`'s.
        unsafe { result::memcpy_htod_sync(self.ptr, data) }.expect("upload");
        // A copy from pageable memory returns once the bytes are staged, not
        // once they land; it runs on the legacy stream, which the callers'
        // (non-blocking) streams do not wait for: without this the bytes
        // could land after the work that follows. (Seen on one H200 under
        // the sharded suite: a graph replay read stale words, 3,715 of 4,099;
        // and once on 2x H200 under load: every element of an i64
        // all-reduce wrong.)
        result::ctx::synchronize().expect("upload: cuCtxSynchronize");
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by malloc_sync; every user synchronised before the drop.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

trait Elem: common::num::Num + bytemuck::Pod {
    fn random(rng: &mut impl Rng) -> Self;
    /// Whether `got` is right for the sum of one element's inputs `xs`
    /// (one per rank, in rank order).
    fn right(got: Self, xs: &[Self]) -> bool;
    /// The sum of `xs` in this type (wrapping for integers): what a rank
    /// holds after an exact sum, for calls chained on it.
    fn total(xs: &[Self]) -> Self;
}

/// Integers: uniform random, wrapping sums, compared exactly.
macro_rules! int_elem {
    ($($t:ty),*) => {$(impl Elem for $t {
        fn random(rng: &mut impl Rng) -> Self {
            rng.random()
        }
        fn right(got: Self, xs: &[Self]) -> bool {
            got == Self::total(xs)
        }
        fn total(xs: &[Self]) -> Self {
            xs.iter().fold(0, |a: $t, &x| a.wrapping_add(x))
        }
    })*};
}
int_elem!(u32, i64);

impl Elem for f32 {
    /// In [1, 2): every rank's contribution moves the sum by 1 at least.
    fn random(rng: &mut impl Rng) -> Self {
        rng.random_range(1.0f32..2.0)
    }
    /// Within `common::num::float_bound` of the f64 sum.
    fn right(got: Self, xs: &[Self]) -> bool {
        let xs: Vec<f64> = xs.iter().map(|&x| f64::from(x)).collect();
        common::num::accepts(ReduceOp::Sum, &xs, got)
    }
    /// Rounded once, from the f64 sum (chained calls compare within the
    /// bound of each sum anyway).
    fn total(xs: &[Self]) -> Self {
        xs.iter().map(|&x| f64::from(x)).sum::<f64>() as f32
    }
}

/// Ranks r on device r % GPUs, each with a group stream and a caller stream.
struct Setup {
    ctxs: Vec<Arc<CudaContext>>,
    callers: Vec<Arc<CudaStream>>,
    group: Group,
}

fn setup(gpus: &[Arc<CudaContext>], n: usize, opts: &GroupOptions) -> Setup {
    let ctxs: Vec<_> = (0..n).map(|r| gpus[r % gpus.len()].clone()).collect();
    let group_streams = ctxs.iter().map(|c| c.new_stream().expect("stream")).collect();
    let callers = ctxs.iter().map(|c| c.new_stream().expect("stream")).collect();
    let group = Group::new(group_streams, opts).expect("group");
    Setup { ctxs, callers, group }
}

/// One all-reduce of fresh random data (in place, or out of place with the
/// sends checked unchanged), checked against the CPU reference.
fn run<T: Elem>(s: &Setup, count: usize, in_place: bool, tag: &str) {
    let n = s.ctxs.len();
    let bytes = count * std::mem::size_of::<T>();
    let mut rng = rand::rng();
    let inputs: Vec<Vec<T>> = (0..n).map(|_| (0..count).map(|_| T::random(&mut rng)).collect()).collect();
    let column = |i: usize| -> Vec<T> { inputs.iter().map(|v| v[i]).collect() };
    let sends: Vec<DeviceAlloc> = s.ctxs.iter().map(|c| DeviceAlloc::new(c, bytes)).collect();
    let recvs: Vec<DeviceAlloc> = if in_place { Vec::new() } else { s.ctxs.iter().map(|c| DeviceAlloc::new(c, bytes)).collect() };
    let outs = if in_place { &sends } else { &recvs };
    for a in sends.iter().chain(&recvs) {
        a.poison();
    }
    let streams: Vec<RawStream> = s.callers.iter().map(|c| RawStream::of(c)).collect();
    for r in 0..n {
        s.ctxs[r].bind_to_thread().expect("bind");
        // SAFETY: `sends[r]` holds `bytes` bytes; `inputs` outlives the stream's sync below.
        unsafe { result::memcpy_htod_async(sends[r].ptr, &inputs[r], streams[r].0) }.expect("upload");
    }
    let send_bufs: Vec<RawBuffer> = sends.iter().map(DeviceAlloc::buf).collect();
    let recv_bufs: Vec<RawBuffer> = outs.iter().map(DeviceAlloc::buf).collect();
    // SAFETY: every buffer is a live cuMemAlloc allocation of `count` elements
    // on its rank's device, used by nothing else until the caller streams are
    // synchronised below; the streams are live streams of the ranks' contexts.
    let res = unsafe {
        if in_place {
            s.group.all_reduce_raw(&send_bufs, count, T::DTYPE, ReduceOp::Sum, &streams)
        } else {
            s.group.all_reduce_raw_out_of_place(&send_bufs, &recv_bufs, count, T::DTYPE, ReduceOp::Sum, &streams)
        }
    };
    res.unwrap_or_else(|e| panic!("{tag}: {e}"));
    let mut got = vec![vec![T::zeroed(); count]; n];
    let mut sent = vec![vec![T::zeroed(); count]; n];
    for r in 0..n {
        s.ctxs[r].bind_to_thread().expect("bind");
        // SAFETY: the buffers hold `count` elements; the stream is synchronised before reading.
        unsafe {
            result::memcpy_dtoh_async(&mut got[r], outs[r].ptr, streams[r].0).expect("download");
            if !in_place {
                result::memcpy_dtoh_async(&mut sent[r], sends[r].ptr, streams[r].0).expect("download");
            }
            result::stream::synchronize(streams[r].0).expect("sync");
        }
    }
    for r in 0..n {
        let bad: Vec<usize> = (0..count).filter(|&i| !T::right(got[r][i], &column(i))).collect();
        assert!(
            bad.is_empty(),
            "{tag} rank {r}: {} of {count} wrong, first at {}: {:?}, the sum of {:?}",
            bad.len(),
            bad[0],
            got[r][bad[0]],
            column(bad[0])
        );
        assert_eq!(common::diff(&got[r], &got[0]), None, "{tag}: rank {r} differs from rank 0");
        if !in_place {
            assert_eq!(common::diff(&sent[r], &inputs[r]), None, "{tag}: rank {r}'s send buffer changed");
        }
    }
}

fn sizes_and_types(s: &Setup, tag: &str, sizes: &[usize]) {
    for &bytes in sizes {
        let algo = s.group.all_reduce_algorithm(bytes);
        for in_place in [true, false] {
            let what = format!("{tag} {bytes} B {algo:?} in_place={in_place}");
            run::<u32>(s, bytes / 4, in_place, &format!("{what} u32"));
            run::<f32>(s, bytes / 4, in_place, &format!("{what} f32"));
        }
        run::<i64>(s, bytes / 8 + 1, true, &format!("{tag} {bytes} B i64"));
    }
}

#[test]
fn raw_all_reduce_every_algorithm() {
    let test = "raw_all_reduce_every_algorithm";
    let Some(gpus) = common::gpus(test, 1) else {
        return;
    };
    // Two ranks, one per GPU where there are two, else both on the one.
    let two = &gpus[..gpus.len().min(2)];
    // Auto: 4 KiB takes the one-shot, 16 MiB the mesh (P2P, or local on
    // one device) or the host one-shot (none); 4 MiB + 4 B every path's
    // largest case.
    let auto = setup(two, 2, &GroupOptions::default());
    let p2p = auto.group.uses_mesh();
    assert_eq!(auto.group.all_reduce_algorithm(4096), Algorithm::OneShot);
    sizes_and_types(&auto, "auto", &[4096, 16 << 20, (4 << 20) + 4]);
    let forced = [
        ("ring", GroupOptions::default().algorithm(Algorithm::Ring)),
        ("staged-ring", GroupOptions::with_policy(PathPolicy::StagedOnly).algorithm(Algorithm::Ring)),
        ("host-oneshot", GroupOptions::with_policy(PathPolicy::StagedOnly).algorithm(Algorithm::OneShot)),
    ];
    for (tag, opts) in forced {
        let s = setup(two, 2, &opts);
        sizes_and_types(&s, tag, &[4096, 1 << 20]);
    }
    if p2p {
        let s = setup(two, 2, &GroupOptions::default().algorithm(Algorithm::Mesh));
        sizes_and_types(&s, "mesh", &[4096, 16 << 20]);
    } else {
        common::skipped(test, "the forced mesh: the Auto group of devices 0 and 1 has no mesh (no verified P2P)");
    }
    // Three ranks on the GPUs there are, sharing devices (Auto: by size).
    let s = setup(&gpus, 3, &GroupOptions::default());
    sizes_and_types(&s, "3 ranks", &[4096, (1 << 20) + 12]);
}

#[test]
fn raw_all_reduce_back_to_back_on_the_callers_streams() {
    let Some(gpus) = common::gpus("raw_all_reduce_back_to_back_on_the_callers_streams", 1) else {
        return;
    };
    // One rank per GPU where there are two, else both on one (the one-shot either way).
    let s = setup(&gpus[..gpus.len().min(2)], 2, &GroupOptions::default());
    back_to_back(&s, 1024, 24);
}

#[test]
fn raw_oneshot_over_many_rounds_back_to_back() {
    let Some(gpus) = common::gpus("raw_oneshot_over_many_rounds_back_to_back", 1) else {
        return;
    };
    // 23 MiB + 12 B per rank: six rounds of the large lane's 4 MiB slots
    // (ONESHOT_SCRATCH_BYTES, 32 MiB: four sets of one slot per rank), so
    // the slot sets wrap within one call, and each round is pushed while the
    // one before is reduced; then calls back to back, so they wrap across calls.
    // One rank per GPU where there are two, else both sharing the one.
    let s = setup(&gpus[..gpus.len().min(2)], 2, &GroupOptions::default().algorithm(Algorithm::OneShot));
    let bytes = (23 << 20) + 12;
    assert_eq!(s.group.all_reduce_algorithm(bytes), Algorithm::OneShot);
    sizes_and_types(&s, "one-shot rounds", &[bytes]);
    back_to_back(&s, bytes / 4, 5);
}

/// A CUDA graph captured on the callers' streams around the raw all-reduce
/// (the group's streams join the capture only through the call's own
/// ordering) holds what the call touches: replayed twice after the group is
/// dropped, on fresh random words, every rank's result is the exact sum,
/// then the sum of the sums. (The call used to look for captures before
/// that join, and so made the graph hold nothing of the group's.)
#[test]
fn a_graph_captured_on_the_callers_streams_replays_after_the_group_is_dropped() {
    let Some(gpus) = common::gpus("a_graph_captured_on_the_callers_streams_replays_after_the_group_is_dropped", 1) else {
        return;
    };
    let count = 4099;
    for (algorithm, n) in [(Algorithm::OneShot, 2), (Algorithm::Ring, 3)] {
        let tag = format!("{algorithm:?} on {n} ranks");
        let s = setup(&gpus[..gpus.len().min(n)], n, &GroupOptions::default().algorithm(algorithm));
        let bufs: Vec<DeviceAlloc> = s.ctxs.iter().map(|c| DeviceAlloc::new(c, count * 4)).collect();
        let raw: Vec<RawBuffer> = bufs.iter().map(DeviceAlloc::buf).collect();
        let streams: Vec<RawStream> = s.callers.iter().map(|c| RawStream::of(c)).collect();
        let graph = common::graph::try_capture(&s.callers, || {
            // SAFETY: every buffer is a live cuMemAlloc allocation of `count`
            // u32 on its rank's device, touched by nothing else until the
            // callers' streams are synchronised; the streams are the ranks'.
            unsafe { s.group.all_reduce_raw(&raw, count, DType::U32, ReduceOp::Sum, &streams) }.map_err(|e| e.to_string())
        })
        .unwrap_or_else(|e| panic!("{tag}: {e}"));
        let Setup { ctxs, callers, group } = s;
        drop(group);
        let mut rng = rand::rng();
        let inputs: Vec<Vec<u32>> = (0..n).map(|_| (0..count).map(|_| rng.random()).collect()).collect();
        for r in 0..n {
            bufs[r].upload(&inputs[r]);
        }
        let sum = |xs: &[Vec<u32>]| -> Vec<u32> { (0..count).map(|i| xs.iter().fold(0u32, |a, x| a.wrapping_add(x[i]))).collect() };
        let once = sum(&inputs);
        let twice = sum(&vec![once.clone(); n]);
        for (replay, want) in [once, twice].iter().enumerate() {
            graph.launch().unwrap_or_else(|e| panic!("{tag}: replay {replay}: {e:?}"));
            for c in &callers {
                c.synchronize().unwrap_or_else(|e| panic!("{tag}: replay {replay}: synchronize: {e:?}"));
            }
            for r in 0..n {
                ctxs[r].bind_to_thread().expect("bind");
                let mut got = vec![0u32; count];
                // SAFETY: `bufs[r]` holds `count` u32; the replay is done.
                unsafe { result::memcpy_dtoh_sync(&mut got, bufs[r].ptr) }.expect("download");
                assert_eq!(common::diff(&got, want), None, "{tag}: replay {replay}: rank {r}");
            }
        }
        drop(graph);
    }
}

/// A chain (`common::chain`) of `calls` in-place u32 sums of `count`
/// elements on the callers' streams, without host synchronisation in
/// between; before each call but the first on an even number of ranks,
/// the rank the chain names is refilled on its caller's stream.
fn back_to_back(s: &Setup, count: usize, calls: usize) {
    let n = s.ctxs.len();
    let bytes = count * 4;
    let bufs: Vec<DeviceAlloc> = s.ctxs.iter().map(|c| DeviceAlloc::new(c, bytes)).collect();
    let refills: Vec<DeviceAlloc> = s.ctxs.iter().map(|c| DeviceAlloc::new(c, bytes)).collect();
    let streams: Vec<RawStream> = s.callers.iter().map(|c| RawStream::of(c)).collect();
    let mut rng = rand::rng();
    let start: Vec<Vec<u32>> = (0..n).map(|_| (0..count).map(|_| rng.random()).collect()).collect();
    let refill: Vec<Vec<u32>> = (0..n).map(|_| (0..count).map(|_| rng.random()).collect()).collect();
    for r in 0..n {
        s.ctxs[r].bind_to_thread().expect("bind");
        // SAFETY: `bufs[r]` and `refills[r]` hold `count` u32; `start` and
        // `refill` outlive the sync below.
        unsafe {
            result::memcpy_htod_async(bufs[r].ptr, &start[r], streams[r].0).expect("upload");
            result::memcpy_htod_async(refills[r].ptr, &refill[r], streams[r].0).expect("upload");
        }
    }
    let chain = chain::calls(n, 0..count, calls);
    let raw: Vec<RawBuffer> = bufs.iter().map(DeviceAlloc::buf).collect();
    for (k, (_, refilled)) in chain.iter().enumerate() {
        if let Some(p) = *refilled {
            s.ctxs[p].bind_to_thread().expect("bind");
            // SAFETY: both hold `bytes` bytes of rank p's device; ordered on its caller's stream.
            unsafe { result::memcpy_dtod_async(bufs[p].ptr, refills[p].ptr, bytes, streams[p].0) }.expect("refill");
        }
        // SAFETY: as in `run`: live allocations used only here until the sync below.
        unsafe { s.group.all_reduce_raw(&raw, count, DType::U32, ReduceOp::Sum, &streams) }.unwrap_or_else(|e| panic!("call {k}: {e}"));
    }
    let want = chain::simulate(&start, &refill, &chain);
    chain::assert_informative(&format!("{n} ranks, {calls} calls"), &want[0]);
    for r in 0..n {
        let mut got = vec![0u32; count];
        s.ctxs[r].bind_to_thread().expect("bind");
        // SAFETY: as above.
        unsafe {
            result::memcpy_dtoh_async(&mut got, bufs[r].ptr, streams[r].0).expect("download");
            result::stream::synchronize(streams[r].0).expect("sync");
        }
        assert_eq!(common::diff(&got, &want[r]), None, "rank {r} after {calls} calls: (first wrong, count)");
    }
}

#[test]
fn raw_all_reduce_refuses_bad_input() {
    let test = "raw_all_reduce_refuses_bad_input";
    let Some(gpus) = common::gpus(test, 1) else {
        return;
    };
    // One rank per GPU where there are two, else both sharing the one.
    let s = setup(&gpus[..gpus.len().min(2)], 2, &GroupOptions::default());
    let two_devices = common::has_gpus(test, "streams and buffers of the wrong device (swapped between two devices)", gpus.len(), 2);
    let count = 256;
    let a: Vec<DeviceAlloc> = s.ctxs.iter().map(|c| DeviceAlloc::new(c, count * 4)).collect();
    let bufs: Vec<RawBuffer> = a.iter().map(DeviceAlloc::buf).collect();
    let streams: Vec<RawStream> = s.callers.iter().map(|c| RawStream::of(c)).collect();
    let call = |bufs: &[RawBuffer], count: usize, dtype: DType, op: ReduceOp, streams: &[RawStream]| {
        // SAFETY: every case below is refused before anything is enqueued
        // (and the buffers are live allocations on their devices anyway).
        unsafe { s.group.all_reduce_raw(bufs, count, dtype, op, streams) }
    };
    let invalid = |r: Result<(), Error>, what: &str| match r {
        Err(Error::InvalidArgument(text)) => eprintln!("  refused ({what}): {text}"),
        other => panic!("{what}: expected InvalidArgument, got {other:?}"),
    };
    invalid(call(&bufs[..1], count, DType::U32, ReduceOp::Sum, &streams), "one buffer for two ranks");
    invalid(call(&bufs, count, DType::U32, ReduceOp::Sum, &streams[..1]), "one stream for two ranks");
    invalid(call(&[bufs[0], RawBuffer(0)], count, DType::U32, ReduceOp::Sum, &streams), "null pointer");
    invalid(call(&[bufs[0], RawBuffer(bufs[1].0 + 2)], 8, DType::U32, ReduceOp::Sum, &streams), "misaligned");
    if two_devices {
        invalid(call(&bufs, count, DType::U32, ReduceOp::Sum, &[streams[1], streams[0]]), "streams of the wrong contexts");
    }
    assert!(matches!(call(&bufs, count, DType::U32, ReduceOp::Avg, &streams), Err(Error::UnsupportedOp { .. })));
    if two_devices {
        assert!(matches!(call(&[bufs[1], bufs[0]], count, DType::U32, ReduceOp::Sum, &streams), Err(Error::WrongDevice { .. })));
    }
    match call(&bufs, count + 1, DType::U32, ReduceOp::Sum, &streams) {
        Err(Error::LengthMismatch { expected, got, .. }) => assert_eq!((expected, got), (count + 1, count)),
        other => panic!("buffer too short: expected LengthMismatch, got {other:?}"),
    }
    let mut host = [0u32; 4];
    let not_device = RawBuffer(host.as_mut_ptr() as u64);
    // The driver does not know the pointer (an invalid value), or (with
    // heterogeneous memory management) knows it as host memory.
    match call(&[bufs[0], not_device], 4, DType::U32, ReduceOp::Sum, &streams) {
        Err(Error::Driver { op: "all_reduce_raw", name, .. }) if name == "CUDA_ERROR_INVALID_VALUE" => {
            eprintln!("  refused (a host pointer): {name}")
        }
        Err(Error::InvalidArgument(text)) if text.contains("rank 1's send buffer") && text.contains("is not device memory") => {
            eprintln!("  refused (a host pointer): {text}")
        }
        other => panic!("a host pointer: expected the driver's CUDA_ERROR_INVALID_VALUE or InvalidArgument (not device memory), got {other:?}"),
    }
    // Nothing was enqueued: a valid call afterwards works, count 0 too.
    call(&bufs, 0, DType::U32, ReduceOp::Sum, &streams).expect("count 0");
    call(&bufs, count, DType::U32, ReduceOp::Sum, &streams).expect("valid call");
    for st in &s.callers {
        st.synchronize().expect("sync");
    }
}

// ---- The per-rank `Comm::all_reduce_raw` ----
//
// Ranks are threads of this test (`Comm::from_devices`, rank r on device
// r % count), each calling its own communicator on a caller stream of its
// own (not the communicator's), with raw `cuMemAlloc` buffers made and
// poisoned before the ranks' threads start (a `cuMemAlloc` or a context
// synchronisation on one rank's thread could wait for a peer's kernel
// that waits for this rank).

/// `n` per-rank communicators with `opts`, and for each rank its context
/// and a caller stream of its own.
fn per_rank(
    gpus: &[Arc<CudaContext>],
    n: usize,
    opts: &cuda_peer::CommOptions,
) -> (Vec<cuda_peer::Comm>, Vec<Arc<CudaContext>>, Vec<Arc<CudaStream>>) {
    let ctxs: Vec<_> = (0..n).map(|r| gpus[r % gpus.len()].clone()).collect();
    let comms = cuda_peer::Comm::from_devices_with(common::ranks::streams(gpus, n), opts).expect("per-rank communicators");
    let callers = ctxs.iter().map(|c| c.new_stream().expect("stream")).collect();
    (comms, ctxs, callers)
}

/// On every rank at once: `calls` in-place or out-of-place sums of fresh
/// random inputs through `Comm::all_reduce_raw` on the rank's caller
/// stream, back to back (no host synchronisation between them: the first
/// upload, the calls and the download are all enqueued on that stream, then
/// it is synchronised). The first call sums the inputs; each later one
/// (in place) sums the ranks' equal results again, so rank r ends with
/// n^(calls-1) times the sum. Checked against the CPU reference on every
/// rank; out of place, the inputs unchanged.
fn per_rank_run<T: Elem>(
    comms: &[cuda_peer::Comm],
    ctxs: &[Arc<CudaContext>],
    callers: &[Arc<CudaStream>],
    count: usize,
    in_place: bool,
    calls: usize,
    tag: &str,
) {
    let n = comms.len();
    let bytes = count * std::mem::size_of::<T>();
    let mut rng = rand::rng();
    let inputs: Vec<Vec<T>> = (0..n).map(|_| (0..count).map(|_| T::random(&mut rng)).collect()).collect();
    let sends: Vec<DeviceAlloc> = ctxs.iter().map(|c| DeviceAlloc::new(c, bytes)).collect();
    let recvs: Vec<DeviceAlloc> = if in_place { Vec::new() } else { ctxs.iter().map(|c| DeviceAlloc::new(c, bytes)).collect() };
    for a in sends.iter().chain(&recvs) {
        a.poison();
    }
    let outs = if in_place { &sends } else { &recvs };
    let results: Vec<(Vec<T>, Vec<T>)> = common::ranks::each(comms, |r, comm| {
        let stream = RawStream::of(&callers[r]);
        ctxs[r].bind_to_thread().expect("bind");
        // SAFETY: `sends[r]` holds `bytes` bytes; `inputs` outlives the sync below.
        unsafe { result::memcpy_htod_async(sends[r].ptr, &inputs[r], stream.0) }.expect("upload");
        for k in 0..calls {
            // After the first call the result is summed again, in place.
            let (send, recv) = if k == 0 { (sends[r].buf(), outs[r].buf()) } else { (outs[r].buf(), outs[r].buf()) };
            // SAFETY: live cuMemAlloc allocations of `count` elements on this
            // rank's device, used by nothing else until the caller's stream
            // is synchronised below; the stream is a live stream of this
            // rank's context.
            unsafe { comm.all_reduce_raw(send, recv, count, T::DTYPE, ReduceOp::Sum, stream) }
                .unwrap_or_else(|e| panic!("{tag} rank {r} call {k}: {e}"));
        }
        let (mut got, mut sent) = (vec![T::zeroed(); count], vec![T::zeroed(); count]);
        ctxs[r].bind_to_thread().expect("bind");
        // SAFETY: both hold `count` elements; the stream is synchronised before reading.
        unsafe {
            result::memcpy_dtoh_async(&mut got, outs[r].ptr, stream.0).expect("download");
            result::memcpy_dtoh_async(&mut sent, sends[r].ptr, stream.0).expect("download");
            result::stream::synchronize(stream.0).expect("sync");
        }
        (got, sent)
    });
    for (r, (got, sent)) in results.iter().enumerate() {
        for i in 0..count {
            // The last call's inputs: every rank's for the first, then n
            // copies of the sum before.
            let mut column: Vec<T> = inputs.iter().map(|v| v[i]).collect();
            for _ in 1..calls {
                column = vec![T::total(&column); n];
            }
            assert!(T::right(got[i], &column), "{tag} rank {r}: element {i} of {count} is {:?}, expected the sum of {column:?}", got[i]);
        }
        assert_eq!(common::diff(got, &results[0].0), None, "{tag}: rank {r} differs from rank 0");
        if !in_place && calls == 1 {
            assert_eq!(common::diff(sent, &inputs[r]), None, "{tag}: rank {r}'s send buffer changed");
        }
    }
}

/// Sums of fresh random data through the per-rank raw entry on 2 and 3
/// thread ranks (over P2P or one device, and staged), at sizes that take
/// the one-shot's small and large lanes and several of its rounds, in
/// place and out of place, u32 (wrapping, exact), f32 (bounded) and i64;
/// and five calls back to back on the callers' streams.
#[test]
fn per_rank_raw_all_reduce_on_the_callers_streams() {
    let test = "per_rank_raw_all_reduce_on_the_callers_streams";
    let _gpu = common::ranks::exclusive();
    let Some(gpus) = common::gpus(test, 1) else {
        return;
    };
    for (policy, n) in [(PathPolicy::Auto, 2), (PathPolicy::Auto, 3), (PathPolicy::StagedOnly, 2)] {
        let opts = cuda_peer::CommOptions::default().path(policy);
        let (comms, ctxs, callers) = per_rank(&gpus, n, &opts);
        for bytes in [4096, (1 << 20) + 12, 9 << 20] {
            for in_place in [true, false] {
                let tag = format!("{policy:?} n={n} {bytes} B in_place={in_place}");
                per_rank_run::<u32>(&comms, &ctxs, &callers, bytes / 4, in_place, 1, &format!("{tag} u32"));
                per_rank_run::<f32>(&comms, &ctxs, &callers, bytes / 4, in_place, 1, &format!("{tag} f32"));
            }
            per_rank_run::<i64>(&comms, &ctxs, &callers, bytes / 8 + 1, true, 1, &format!("{policy:?} n={n} {bytes} B i64"));
        }
        per_rank_run::<u32>(&comms, &ctxs, &callers, 4099, false, 5, &format!("{policy:?} n={n} five calls back to back"));
    }
}

/// Bad input to the per-rank raw entry is a typed error on the rank that
/// made it, before anything is enqueued or counted: the communicators stay
/// in step, and a valid call on every rank afterwards is right.
#[test]
fn per_rank_raw_all_reduce_refuses_bad_input() {
    let test = "per_rank_raw_all_reduce_refuses_bad_input";
    let _gpu = common::ranks::exclusive();
    let Some(gpus) = common::gpus(test, 1) else {
        return;
    };
    let (comms, ctxs, callers) = per_rank(&gpus, 2, &cuda_peer::CommOptions::default());
    let two_devices = common::has_gpus(test, "streams and buffers of another device", gpus.len(), 2);
    let count = 256;
    let a = DeviceAlloc::new(&ctxs[0], count * 4);
    let stream = RawStream::of(&callers[0]);
    let call = |send: RawBuffer, recv: RawBuffer, count: usize, dtype: DType, op: ReduceOp, stream: RawStream| {
        // SAFETY: every case below is refused before anything is enqueued
        // (and the buffers are live allocations anyway).
        unsafe { comms[0].all_reduce_raw(send, recv, count, dtype, op, stream) }
    };
    let invalid = |r: Result<(), Error>, what: &str, says: &str| match r {
        Err(Error::InvalidArgument(text)) if text.contains(says) => eprintln!("  refused ({what}): {text}"),
        other => panic!("{what}: expected InvalidArgument saying {says:?}, got {other:?}"),
    };
    invalid(call(RawBuffer(0), a.buf(), count, DType::U32, ReduceOp::Sum, stream), "null send", "send buffer is a null pointer");
    invalid(call(a.buf(), RawBuffer(0), count, DType::U32, ReduceOp::Sum, stream), "null recv", "recv buffer is a null pointer");
    invalid(call(RawBuffer(a.ptr + 2), RawBuffer(a.ptr + 2), 8, DType::U32, ReduceOp::Sum, stream), "misaligned", "not aligned");
    invalid(call(a.buf(), RawBuffer(a.ptr + 64), 32, DType::U32, ReduceOp::Sum, stream), "overlapping", "overlap without being identical");
    invalid(call(a.buf(), a.buf(), usize::MAX / 2, DType::U32, ReduceOp::Sum, stream), "a count that overflows", "overflow");
    assert!(matches!(call(a.buf(), a.buf(), count, DType::U32, ReduceOp::Avg, stream), Err(Error::UnsupportedOp { .. })));
    match call(a.buf(), a.buf(), count + 1, DType::U32, ReduceOp::Sum, stream) {
        Err(Error::LengthMismatch { expected, got, .. }) => assert_eq!((expected, got), (count + 1, count)),
        other => panic!("a buffer too short: expected LengthMismatch, got {other:?}"),
    }
    let mut host = [0u32; 4];
    match call(a.buf(), RawBuffer(host.as_mut_ptr() as u64), 4, DType::U32, ReduceOp::Sum, stream) {
        Err(Error::Driver { op: "all_reduce_raw", name, .. }) if name == "CUDA_ERROR_INVALID_VALUE" => {
            eprintln!("  refused (a host pointer): {name}")
        }
        Err(Error::InvalidArgument(text)) if text.contains("is not device memory") => eprintln!("  refused (a host pointer): {text}"),
        other => panic!("a host pointer: expected CUDA_ERROR_INVALID_VALUE or InvalidArgument, got {other:?}"),
    }
    if two_devices {
        let other = DeviceAlloc::new(&gpus[1], count * 4);
        assert!(matches!(call(other.buf(), other.buf(), count, DType::U32, ReduceOp::Sum, stream), Err(Error::WrongDevice { .. })));
        let other_stream = gpus[1].new_stream().expect("stream");
        invalid(
            call(a.buf(), a.buf(), count, DType::U32, ReduceOp::Sum, RawStream::of(&other_stream)),
            "a stream of another device",
            "stream is not of the communicator's context",
        );
    }
    // Nothing was enqueued or counted: both ranks still agree on their calls.
    per_rank_run::<u32>(&comms, &ctxs, &callers, count, false, 1, "after the refusals");
}

/// A graph captured around the per-rank raw entry on every rank holds what
/// the call touches: replayed twice after every `Comm` is dropped, on fresh
/// random words, every rank's result is the exact sum, then the sum of the
/// sums. Where each rank has a GPU of its own, the capture starts on the
/// caller's stream (the communicator's joins it through the call's own
/// ordering); with thread ranks sharing one device, replays of captures
/// forked from another stream sometimes stalled (docs/multiprocess.md), so
/// there the caller passes the communicator's own stream.
#[test]
fn a_per_rank_raw_graph_replays_after_every_comm_is_dropped() {
    let test = "a_per_rank_raw_graph_replays_after_every_comm_is_dropped";
    let _gpu = common::ranks::exclusive();
    let Some(gpus) = common::gpus(test, 1) else {
        return;
    };
    let (n, count) = (2, 4099);
    let (comms, ctxs, callers) = per_rank(&gpus, n, &cuda_peer::CommOptions::default());
    let forked = gpus.len() >= n;
    if !forked {
        common::skipped(
            test,
            "the capture forked from a caller's stream (ranks sharing a device capture on their communicators' streams) needs 2 GPUs",
        );
    }
    let bufs: Vec<DeviceAlloc> = ctxs.iter().map(|c| DeviceAlloc::new(c, count * 4)).collect();
    let mut rng = rand::rng();
    let inputs: Vec<Vec<u32>> = (0..n).map(|_| (0..count).map(|_| rng.random()).collect()).collect();
    let sum = |xs: &[Vec<u32>]| -> Vec<u32> { (0..count).map(|i| xs.iter().fold(0u32, |a, x| a.wrapping_add(x[i]))).collect() };
    let once = sum(&inputs);
    let twice = sum(&vec![once.clone(); n]);
    let (retained, released, _) = cuda_peer::group::graph_keep_alives();
    let barrier = std::sync::Barrier::new(n);
    let got: Vec<Vec<Vec<u32>>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(r, comm)| {
                let (ctxs, bufs, inputs, barrier) = (&ctxs, &bufs, &inputs, &barrier);
                let stream = if forked { callers[r].clone() } else { comm.stream().clone() };
                s.spawn(move || {
                    let graph = common::graph::try_capture(std::slice::from_ref(&stream), || {
                        // SAFETY: `bufs[r]` is a live cuMemAlloc allocation of
                        // `count` u32 on this rank's device, touched by nothing
                        // else until the stream is synchronised; the stream is
                        // a live stream of this rank's context.
                        unsafe { comm.all_reduce_raw(bufs[r].buf(), bufs[r].buf(), count, DType::U32, ReduceOp::Sum, RawStream::of(&stream)) }
                            .map_err(|e| e.to_string())
                    })
                    .unwrap_or_else(|e| panic!("rank {r}: {e}"));
                    drop(comm);
                    // Every rank has captured before any synchronises its
                    // context (ranks may share one).
                    barrier.wait();
                    bufs[r].upload(&inputs[r]);
                    let mut outs = Vec::new();
                    for replay in 0..2 {
                        // Every rank's communicator is gone before the first replay.
                        barrier.wait();
                        graph.launch().unwrap_or_else(|e| panic!("rank {r}: replay {replay}: {e:?}"));
                        stream.synchronize().unwrap_or_else(|e| panic!("rank {r}: replay {replay}: {e:?}"));
                        let mut got = vec![0u32; count];
                        ctxs[r].bind_to_thread().expect("bind");
                        // SAFETY: `bufs[r]` holds `count` u32; the replay is done.
                        unsafe { result::memcpy_dtoh_sync(&mut got, bufs[r].ptr) }.expect("download");
                        outs.push(got);
                    }
                    outs
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("a rank's thread")).collect()
    });
    for (r, outs) in got.iter().enumerate() {
        assert_eq!(common::diff(&outs[0], &once), None, "rank {r}: the first replay after the drop");
        assert_eq!(common::diff(&outs[1], &twice), None, "rank {r}: the second replay");
    }
    let (now_retained, _, _) = cuda_peer::group::graph_keep_alives();
    assert!(now_retained >= retained + n as u64, "{} keep-alives taken by {n} captures", now_retained - retained);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while cuda_peer::group::graph_keep_alives().1 < released + n as u64 {
        assert!(std::time::Instant::now() < deadline, "the graphs' keep-alives were not released 10 s after the graphs were dropped");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
