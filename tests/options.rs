//! GPU tests of options and error variants: lazy kernel loading and
//! `Group::warm_up`, a `P2pOnly` link within one device, a multi-process
//! communicator created without its verification, the typed errors of a
//! device past the last, of a communicator of too many ranks and of
//! reduce-scatter scratch that would grow under graph capture, the raw
//! all-reduce with `Min`, `Max` and `Prod` on `i32` and `f64` (eager and
//! captured), and the capture of reduce-scatter, broadcast and reduce.
//!
//! Every test runs on one GPU (the ranks of a group are streams of device
//! 0, the processes of a communicator share it): fresh random inputs,
//! poisoned outputs, and a CPU reference (integers exact, float products
//! within `(n - 1) * 4 * eps` relative). Skips without a GPU (fails with
//! `CUDA_PEER_REQUIRE_GPU=1` then); the communicator of too many ranks needs
//! no GPU.
//!
//! Not covered here, because no configuration produces them
//! deterministically on one GPU:
//! - `Error::P2pUnavailable` from `PathPolicy::P2pOnly`: within one device
//!   a link is local (tested below); between two devices it needs a pair
//!   whose driver claims P2P but whose verification fails, which no healthy
//!   machine has.
//! - `Error::PeerUnsupported`: needs two devices without peer access.
//! - `Error::TooManyPeers`: the driver's peer limit, reached only with more
//!   than eight peer devices.
//! - `Error::NoDevice`: returned only where the driver loads and reports
//!   zero devices; on a machine with a GPU every ordinal past the last is
//!   `Error::DeviceOutOfRange` instead (tested below); the fault shim's
//!   pretend driver reports none (`layering_probe` in `tests/fault_shim.rs`,
//!   in CI).
//!
//! `Error::Load` is tested where no driver library loads (CI, no GPU):
//! `without_a_driver_every_way_in_is_a_load_error`.

mod common;

use common::gpus;
use cuda_peer::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cuda_peer::cudarc::driver::{CudaContext, CudaGraph, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits};
use cuda_peer::{
    driver, Algorithm, Collectives, DType, Error, Group, GroupOptions, Link, LinkOptions, Path, PathPolicy, RawBuffer, RawStream, ReduceOp,
};
use rand::Rng;
use std::sync::Arc;

fn random_u32(n: usize, count: usize) -> Vec<Vec<u32>> {
    let mut rng = rand::rng();
    (0..n).map(|_| (0..count).map(|_| rng.random()).collect()).collect()
}

fn sum_u32(inputs: &[Vec<u32>]) -> Vec<u32> {
    (0..inputs[0].len()).map(|i| inputs.iter().fold(0u32, |a, v| a.wrapping_add(v[i]))).collect()
}

fn sync(streams: &[Arc<CudaStream>]) {
    for s in streams {
        s.synchronize().expect("synchronize");
    }
}

/// Uploads `data[r]` into `bufs[r]` on rank r's stream, then makes
/// `streams[0]` (where a graph launches) wait for every stream.
fn fill<T: DeviceRepr>(streams: &[Arc<CudaStream>], bufs: &mut [CudaSlice<T>], data: &[Vec<T>]) {
    for ((s, b), d) in streams.iter().zip(bufs.iter_mut()).zip(data) {
        s.memcpy_htod(d, b).expect("upload");
    }
    for s in &streams[1..] {
        streams[0].join(s).expect("join");
    }
}

fn upload<T: DeviceRepr + ValidAsZeroBits>(streams: &[Arc<CudaStream>], data: &[Vec<T>]) -> Vec<CudaSlice<T>> {
    streams.iter().zip(data).map(|(s, d)| s.clone_htod(d).expect("upload")).collect()
}

fn poisoned(streams: &[Arc<CudaStream>], count: usize) -> Vec<CudaSlice<u32>> {
    streams.iter().map(|s| s.clone_htod(&vec![0xDEAD_BEEFu32; count]).expect("poison")).collect()
}

fn assert_same(what: &str, got: &[u32], want: &[u32]) {
    if let Some((first, wrong)) = common::diff(got, want) {
        panic!("{what}: {wrong} of {} elements wrong, first at {first}: {:#x} instead of {:#x}", got.len(), got[first], want[first]);
    }
}

/// Captures `call` (which enqueues on every stream) into one graph: the
/// other streams join `streams[0]`'s capture through an event, and it joins
/// theirs at the end. The capture ends whatever `call` returns; its error
/// is returned with the graph (if any).
fn try_capture(streams: &[Arc<CudaStream>], call: impl FnOnce() -> cuda_peer::Result<()>) -> (cuda_peer::Result<()>, Option<CudaGraph>) {
    let s0 = &streams[0];
    s0.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).expect("begin capture");
    let fork = s0.record_event(None).expect("fork event");
    for s in &streams[1..] {
        s.wait(&fork).expect("joining the capture");
    }
    let res = call();
    for s in &streams[1..] {
        s0.join(s).expect("joining back");
    }
    let graph = s0.end_capture(CUgraphInstantiate_flags(0)).expect("end capture / instantiate");
    (res, graph)
}

/// [`try_capture`] of a call that must succeed and enqueue work.
fn capture(streams: &[Arc<CudaStream>], call: impl FnOnce() -> cuda_peer::Result<()>) -> CudaGraph {
    let (res, graph) = try_capture(streams, call);
    res.expect("collective under capture");
    graph.expect("a non-empty graph")
}

/// Device 0's context with cudarc's event tracking off (a captured stream
/// may not wait for events recorded outside the capture; these tests order
/// their work themselves), or `None` after the skip line.
fn untracked(test: &str) -> Option<Arc<CudaContext>> {
    let ctx = gpus(test, 1)?.swap_remove(0);
    // SAFETY: this handle is the test's own; every buffer of the test is
    // created after this, and the test orders all work itself (joins and
    // synchronisations).
    unsafe { ctx.disable_event_tracking() };
    Some(ctx)
}

/// `n` streams of `ctx`'s device and the ring group over them.
fn ring_group(ctx: &Arc<CudaContext>, n: usize, opts: &GroupOptions) -> (Vec<Arc<CudaStream>>, Group) {
    let streams: Vec<_> = (0..n).map(|_| ctx.new_stream().expect("stream")).collect();
    let group = Group::new(streams.clone(), opts).expect("group");
    (streams, group)
}

/// A group created with `lazy_kernels(true)` (no warm-up at creation)
/// all-reduces exactly on first use, and again after `Group::warm_up`.
#[test]
fn lazy_kernels_all_reduce_is_exact_before_and_after_warm_up() {
    let test = "lazy_kernels_all_reduce_is_exact_before_and_after_warm_up";
    let Some(ctxs) = gpus(test, 1) else { return };
    let opts = GroupOptions::default().algorithm(Algorithm::Ring).lazy_kernels(true);
    assert!(opts.lazy_kernels);
    let (streams, group) = ring_group(&ctxs[0], 2, &opts);
    let count = (1 << 16) + 3;
    for stage in ["lazy, first call", "lazy, second call", "after warm_up", "after a second warm_up"] {
        if stage.starts_with("after") {
            group.warm_up().expect("warm_up");
        }
        let inputs = random_u32(2, count);
        let send = upload(&streams, &inputs);
        let mut recv = poisoned(&streams, count);
        group.all_reduce(&send, &mut recv, ReduceOp::Sum).expect("all_reduce");
        let want = sum_u32(&inputs);
        for (r, (s, b)) in streams.iter().zip(&recv).enumerate() {
            assert_same(&format!("{stage}: rank {r} out of place"), &s.clone_dtoh(b).unwrap(), &want);
        }
        let inputs = random_u32(2, count);
        let mut bufs = upload(&streams, &inputs);
        group.all_reduce_in_place(&mut bufs, ReduceOp::Sum).expect("all_reduce_in_place");
        let want = sum_u32(&inputs);
        for (r, (s, b)) in streams.iter().zip(&bufs).enumerate() {
            assert_same(&format!("{stage}: rank {r} in place"), &s.clone_dtoh(b).unwrap(), &want);
        }
    }
}

/// `PathPolicy::P2pOnly` between a device and itself is the local path
/// (no peer access involved), and its copies are exact.
#[test]
fn a_p2p_only_link_within_one_device_is_local_and_exact() {
    let test = "a_p2p_only_link_within_one_device_is_local_and_exact";
    let Some(ctxs) = gpus(test, 1) else { return };
    let ctx = &ctxs[0];
    let mut link = Link::open(ctx, ctx, &LinkOptions::with_policy(PathPolicy::P2pOnly)).expect("P2pOnly link within one device");
    assert_eq!(link.path(), Path::Local);
    let status = link.status();
    assert!(status.driver_claims_p2p && status.verified.is_none() && status.reason == "same device", "{status:?}");
    let stream = ctx.new_stream().unwrap();
    let data = common::random_bytes((4 << 20) + 7);
    let src = stream.clone_htod(&data).unwrap();
    let mut dst = stream.clone_htod(&vec![0xA5u8; data.len()]).unwrap();
    link.copy(&src, &mut dst, &stream).expect("copy");
    let got = stream.clone_dtoh(&dst).unwrap();
    if let Some((first, wrong)) = common::diff(&got, &data) {
        panic!("{wrong} of {} bytes wrong, first at {first}", data.len());
    }
}

/// A device ordinal past the last is `Error::DeviceOutOfRange` naming the
/// ordinal and the device count, from `driver::context` and from
/// `Group::from_devices`.
#[test]
fn a_device_past_the_last_is_out_of_range_with_the_count() {
    let test = "a_device_past_the_last_is_out_of_range_with_the_count";
    let Some(ctxs) = gpus(test, 1) else { return };
    let count = ctxs.len();
    for ordinal in [count, count + 1, 9999] {
        match driver::context(ordinal) {
            Err(Error::DeviceOutOfRange { ordinal: o, count: c }) => assert_eq!((o, c), (ordinal, count)),
            Err(e) => panic!("context({ordinal}): expected DeviceOutOfRange {{ {ordinal}, {count} }}, got {e:?}"),
            Ok(_) => panic!("context({ordinal}): expected DeviceOutOfRange {{ {ordinal}, {count} }}, got a context"),
        }
    }
    match Group::from_devices(&[0, 9999], &GroupOptions::default()) {
        Err(Error::DeviceOutOfRange { ordinal: 9999, count: c }) => assert_eq!(c, count),
        Err(e) => panic!("from_devices([0, 9999]): expected DeviceOutOfRange {{ 9999, {count} }}, got {e:?}"),
        Ok(_) => panic!("from_devices([0, 9999]): expected DeviceOutOfRange {{ 9999, {count} }}, got a group"),
    }
}

/// A stand-in for a job's exchange of `size` ranks that hands this rank's
/// blob back for every rank.
#[cfg(target_os = "linux")]
struct Echo {
    size: usize,
}

#[cfg(target_os = "linux")]
impl cuda_peer::ipc::Exchange for Echo {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        self.size
    }
    fn job_id(&self) -> &str {
        "options-echo"
    }
    fn all_gather(&self, blob: &[u8]) -> cuda_peer::Result<Vec<Vec<u8>>> {
        Ok(vec![blob.to_vec(); self.size])
    }
}

/// A communicator of more than `MAX_RANKS` ranks is `Error::Unsupported`
/// saying how many ranks and the limit, before any device is opened (no
/// GPU needed).
#[cfg(target_os = "linux")]
#[test]
fn a_comm_of_more_than_max_ranks_is_unsupported() {
    use cuda_peer::ipc::comm::MAX_RANKS;
    use cuda_peer::ipc::{Comm, CommOptions};
    for size in [MAX_RANKS + 1, MAX_RANKS + 8] {
        match Comm::new(Box::new(Echo { size }), 0, &CommOptions::default()) {
            Err(Error::Unsupported(m)) => assert_eq!(m, format!("{size} ranks in one communicator (at most {MAX_RANKS})")),
            Err(e) => panic!("{size} ranks: expected Error::Unsupported, got {e:?}"),
            Ok(_) => panic!("{size} ranks: expected Error::Unsupported, got a communicator"),
        }
    }
}

/// A communicator created with `CommOptions::verify(false)` between two
/// processes sharing the device: creation succeeds without the check, and
/// all-reduces (out of place into poisoned buffers, and in place) of a
/// random seed's data are exact.
#[cfg(target_os = "linux")]
#[test]
fn two_processes_without_verification_all_reduce_exactly() {
    use common::procs::{all_succeeded, child, passes, spawn};
    use cuda_peer::ipc::{comm::seeded, Comm, CommOptions};
    use std::time::Duration;
    const SEED: &str = "CUDA_PEER_OPTIONS_SEED";
    let name = "two_processes_without_verification_all_reduce_exactly";
    if child() {
        let seed: u64 = std::env::var(SEED).expect("seed").parse().expect("seed");
        let opts = CommOptions::default().timeout(Duration::from_secs(30)).share_devices(true).verify(false);
        assert!(!opts.verify);
        let comm = Comm::from_env(&opts).expect("communicator without verification");
        let (rank, n) = (comm.rank(), comm.size());
        let stream = comm.stream().clone();
        for (k, count) in [1usize, 4093, (1 << 18) + 5].into_iter().enumerate() {
            let inputs: Vec<Vec<u32>> = (0..n).map(|r| seeded(seed + (k * n + r) as u64 * 2, count)).collect();
            let want = sum_u32(&inputs);
            let send = stream.clone_htod(&inputs[rank]).unwrap();
            let mut recv = stream.clone_htod(&vec![0xDEAD_BEEFu32; count]).unwrap();
            comm.all_reduce(&send, &mut recv, ReduceOp::Sum).expect("all_reduce");
            assert_same(&format!("rank {rank} count {count} out of place"), &stream.clone_dtoh(&recv).unwrap(), &want);
            let inputs: Vec<Vec<u32>> = (0..n).map(|r| seeded(seed + (k * n + r) as u64 * 2 + 1, count)).collect();
            let want = sum_u32(&inputs);
            let mut buf = stream.clone_htod(&inputs[rank]).unwrap();
            comm.all_reduce_in_place(&mut buf, ReduceOp::Sum).expect("all_reduce_in_place");
            assert_same(&format!("rank {rank} count {count} in place"), &stream.clone_dtoh(&buf).unwrap(), &want);
        }
        comm.synchronize().unwrap();
        println!("rank {rank}: unverified all-reduces right");
        return;
    }
    if common::gpu_count(name, 1).is_none() {
        return;
    }
    let seed = rand::rng().random::<u32>() as u64;
    let results = spawn(name, 2, Duration::from_secs(180), |_| vec![(SEED, seed.to_string())]);
    all_succeeded(name, &results, passes("unverified all-reduces right"));
}

/// Under capture, a reduce-scatter on three ranks whose scratch would have
/// to grow is `Error::Capture` naming the call and the bytes it needs,
/// enqueues nothing, and leaves the group usable: a capture of the size
/// already allocated replays exactly, and an eager call of the larger size
/// is exact.
#[test]
fn reduce_scatter_scratch_growth_under_capture_is_a_capture_error() {
    let test = "reduce_scatter_scratch_growth_under_capture_is_a_capture_error";
    let Some(ctx) = untracked(test) else { return };
    let n = 3;
    let (streams, group) = ring_group(&ctx, n, &GroupOptions::default().algorithm(Algorithm::Ring));
    let (small, large) = (1000usize, 4096usize);
    let reduce_scatter_ref = |inputs: &[Vec<u32>], c: usize| -> Vec<Vec<u32>> {
        let sum = sum_u32(inputs);
        (0..n).map(|r| sum[r * c..(r + 1) * c].to_vec()).collect()
    };
    let check = |what: &str, recv: &[CudaSlice<u32>], want: &[Vec<u32>]| {
        for (r, (s, b)) in streams.iter().zip(recv).enumerate() {
            assert_same(&format!("{what}: rank {r}"), &s.clone_dtoh(b).unwrap(), &want[r]);
        }
    };

    // Eager: allocates the scratch for `small`.
    let inputs = random_u32(n, n * small);
    let mut send = upload(&streams, &inputs);
    let mut recv = poisoned(&streams, small);
    group.reduce_scatter(&send, &mut recv, ReduceOp::Sum).expect("eager reduce_scatter");
    sync(&streams);
    check("eager small", &recv, &reduce_scatter_ref(&inputs, small));

    // Captured at the larger size: refused.
    let big_send = upload(&streams, &random_u32(n, n * large));
    let mut big_recv = poisoned(&streams, large);
    let (res, _graph) = try_capture(&streams, || group.reduce_scatter(&big_send, &mut big_recv, ReduceOp::Sum));
    match res {
        Err(Error::Capture { op: "reduce_scatter", reason }) => {
            assert!(reason.contains(&format!("{} bytes per rank", large * 4)), "{reason}")
        }
        other => panic!("expected Error::Capture {{ op: \"reduce_scatter\", .. }}, got {other:?}"),
    }
    sync(&streams);
    check("the refused call's outputs", &big_recv, &vec![vec![0xDEAD_BEEFu32; large]; n]);

    // The size already allocated captures and replays exactly.
    let graph = capture(&streams, || group.reduce_scatter(&send, &mut recv, ReduceOp::Sum));
    for replay in 0..3 {
        let inputs = random_u32(n, n * small);
        fill(&streams, &mut send, &inputs);
        fill(&streams, &mut recv, &vec![vec![0xDEAD_BEEFu32; small]; n]);
        graph.launch().expect("graph launch");
        sync(&streams);
        check(&format!("replay {replay}"), &recv, &reduce_scatter_ref(&inputs, small));
    }

    // Eagerly the larger size grows the scratch and is exact.
    let inputs = random_u32(n, n * large);
    let big_send = upload(&streams, &inputs);
    let mut big_recv = poisoned(&streams, large);
    group.reduce_scatter(&big_send, &mut big_recv, ReduceOp::Sum).expect("eager reduce_scatter, larger");
    sync(&streams);
    check("eager large", &big_recv, &reduce_scatter_ref(&inputs, large));
}

/// Element types of the raw all-reduce tests: random inputs per op, the
/// CPU combination, and the comparison.
trait RawElem: DeviceRepr + ValidAsZeroBits + Copy + PartialEq + std::fmt::Debug + Unpin + Send + Sync + 'static {
    const DTYPE: DType;
    fn input(op: ReduceOp, rng: &mut impl Rng) -> Self;
    fn poison() -> Self;
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self;
    /// Whether `got` is right for `want`, the reduction of `n` ranks.
    fn matches(op: ReduceOp, n: usize, got: Self, want: Self) -> bool;
}

impl RawElem for i32 {
    const DTYPE: DType = DType::I32;
    fn input(_: ReduceOp, rng: &mut impl Rng) -> Self {
        rng.random()
    }
    fn poison() -> Self {
        0x5A5A_5A5A
    }
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
        match op {
            ReduceOp::Min => a.min(b),
            ReduceOp::Max => a.max(b),
            ReduceOp::Prod => a.wrapping_mul(b),
            other => panic!("no CPU reference for {other:?}"),
        }
    }
    fn matches(_: ReduceOp, _: usize, got: Self, want: Self) -> bool {
        got == want
    }
}

impl RawElem for f64 {
    const DTYPE: DType = DType::F64;
    /// Min and max of any values are exact; products of values in
    /// [1.25, 2] stay far from overflow and denormals.
    fn input(op: ReduceOp, rng: &mut impl Rng) -> Self {
        match op {
            ReduceOp::Prod => rng.random_range(1.25..=2.0),
            _ => rng.random_range(-1.0e6..1.0e6),
        }
    }
    fn poison() -> Self {
        f64::NAN
    }
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
        match op {
            ReduceOp::Min => a.min(b),
            ReduceOp::Max => a.max(b),
            ReduceOp::Prod => a * b,
            other => panic!("no CPU reference for {other:?}"),
        }
    }
    fn matches(op: ReduceOp, n: usize, got: Self, want: Self) -> bool {
        match op {
            ReduceOp::Prod => (got - want).abs() <= (n as f64 - 1.0) * 4.0 * f64::EPSILON * want.abs(),
            _ => got.to_bits() == want.to_bits(),
        }
    }
}

fn random_inputs<T: RawElem>(op: ReduceOp, n: usize, count: usize) -> Vec<Vec<T>> {
    let mut rng = rand::rng();
    (0..n).map(|_| (0..count).map(|_| T::input(op, &mut rng)).collect()).collect()
}

fn reduced<T: RawElem>(op: ReduceOp, inputs: &[Vec<T>]) -> Vec<T> {
    (0..inputs[0].len()).map(|i| inputs[1..].iter().fold(inputs[0][i], |a, v| T::combine(op, a, v[i]))).collect()
}

fn check_reduced<T: RawElem>(what: &str, op: ReduceOp, streams: &[Arc<CudaStream>], bufs: &[CudaSlice<T>], want: &[T]) {
    let n = streams.len();
    for (r, (s, b)) in streams.iter().zip(bufs).enumerate() {
        let got = s.clone_dtoh(b).unwrap();
        let wrong: Vec<usize> = (0..want.len()).filter(|&i| !T::matches(op, n, got[i], want[i])).collect();
        if let Some(&first) = wrong.first() {
            panic!(
                "{what}: rank {r}: {} of {} elements wrong, first at {first}: {:?} instead of {:?}",
                wrong.len(),
                want.len(),
                got[first],
                want[first]
            );
        }
    }
}

/// The raw buffers of `bufs` (event tracking is off: the guards do nothing).
fn raw_bufs<T>(streams: &[Arc<CudaStream>], bufs: &[CudaSlice<T>]) -> Vec<RawBuffer> {
    streams.iter().zip(bufs).map(|(s, b)| RawBuffer(b.device_ptr(s).0)).collect()
}

/// For each of Min, Max and Prod on `T`: an eager raw all-reduce (out of
/// place into poisoned buffers, then in place), then the out-of-place call
/// captured once and replayed three times on fresh inputs.
fn raw_ops<T: RawElem>(streams: &[Arc<CudaStream>], group: &Group, count: usize) {
    let n = streams.len();
    let rs: Vec<RawStream> = streams.iter().map(|s| RawStream::of(s)).collect();
    let poison = vec![vec![T::poison(); count]; n];
    for op in [ReduceOp::Min, ReduceOp::Max, ReduceOp::Prod] {
        let what = format!("{} {op:?} count {count}", T::DTYPE);
        let inputs = random_inputs::<T>(op, n, count);
        let mut send = upload(streams, &inputs);
        let mut recv = upload(streams, &poison);
        sync(streams);
        let (s, d) = (raw_bufs(streams, &send), raw_bufs(streams, &recv));
        // SAFETY: the buffers hold `count` elements of `T` on each rank's
        // device and outlive the call (synchronised below).
        unsafe { group.all_reduce_raw_out_of_place(&s, &d, count, T::DTYPE, op, &rs) }.expect("raw all-reduce");
        sync(streams);
        check_reduced(&format!("eager out of place {what}"), op, streams, &recv, &reduced(op, &inputs));

        let inputs = random_inputs::<T>(op, n, count);
        let bufs = upload(streams, &inputs);
        sync(streams);
        let b = raw_bufs(streams, &bufs);
        // SAFETY: as above.
        unsafe { group.all_reduce_raw(&b, count, T::DTYPE, op, &rs) }.expect("raw all-reduce in place");
        sync(streams);
        check_reduced(&format!("eager in place {what}"), op, streams, &bufs, &reduced(op, &inputs));

        // SAFETY: as above; the graph is replayed while the buffers live.
        let graph = capture(streams, || unsafe { group.all_reduce_raw_out_of_place(&s, &d, count, T::DTYPE, op, &rs) });
        for replay in 0..3 {
            let inputs = random_inputs::<T>(op, n, count);
            fill(streams, &mut send, &inputs);
            fill(streams, &mut recv, &poison);
            graph.launch().expect("graph launch");
            sync(streams);
            check_reduced(&format!("replay {replay} {what}"), op, streams, &recv, &reduced(op, &inputs));
        }
    }
}

/// The raw-pointer all-reduce with Min, Max and Prod on `i32` (exact) and
/// `f64` (min and max exact, products within the bound), on a ring of two
/// ranks on one device: eager, and captured into a graph replayed on fresh
/// inputs.
#[test]
fn raw_all_reduce_min_max_prod_on_i32_and_f64_eager_and_captured() {
    let test = "raw_all_reduce_min_max_prod_on_i32_and_f64_eager_and_captured";
    let Some(ctx) = untracked(test) else { return };
    let (streams, group) = ring_group(&ctx, 2, &GroupOptions::default().algorithm(Algorithm::Ring));
    for count in [1, 4093, (1 << 18) + 5] {
        raw_ops::<i32>(&streams, &group, count);
        raw_ops::<f64>(&streams, &group, count);
    }
}

/// A launch of a call from send buffers into recv buffers (eager or a graph's).
type SendRecv<'a> = dyn Fn(&[CudaSlice<u32>], &mut [CudaSlice<u32>]) + 'a;

/// Reduce-scatter, broadcast and reduce (u32 sums) on a ring of two ranks
/// on one device, each run eagerly, then captured once and replayed three
/// times on fresh inputs with poisoned outputs; send buffers stay
/// unchanged.
#[test]
fn captured_reduce_scatter_broadcast_and_reduce_replay_exactly() {
    let test = "captured_reduce_scatter_broadcast_and_reduce_replay_exactly";
    let Some(ctx) = untracked(test) else { return };
    let n = 2;
    let (streams, group) = ring_group(&ctx, n, &GroupOptions::default().algorithm(Algorithm::Ring));
    let read = |bufs: &[CudaSlice<u32>]| -> Vec<Vec<u32>> { streams.iter().zip(bufs).map(|(s, b)| s.clone_dtoh(b).unwrap()).collect() };
    for c in [1usize, 4093, (1 << 18) + 5] {
        // Reduce-scatter: send n * c, recv c.
        let mut send: Vec<CudaSlice<u32>> = streams.iter().map(|s| s.alloc_zeros(n * c).unwrap()).collect();
        let mut recv: Vec<CudaSlice<u32>> = streams.iter().map(|s| s.alloc_zeros(c).unwrap()).collect();
        let run = |send: &mut Vec<CudaSlice<u32>>, recv: &mut Vec<CudaSlice<u32>>, what: &str, launch: &SendRecv<'_>| {
            let inputs = random_u32(n, n * c);
            fill(&streams, send, &inputs);
            fill(&streams, recv, &vec![vec![0xDEAD_BEEFu32; c]; n]);
            launch(send, recv);
            sync(&streams);
            let sum = sum_u32(&inputs);
            for (r, got) in read(recv).iter().enumerate() {
                assert_same(&format!("{what} reduce_scatter c={c} rank {r}"), got, &sum[r * c..(r + 1) * c]);
            }
            assert!(read(send) == inputs, "{what} reduce_scatter c={c}: a send buffer changed");
        };
        run(&mut send, &mut recv, "eager", &|s, d| group.reduce_scatter(s, d, ReduceOp::Sum).expect("eager reduce_scatter"));
        let graph = capture(&streams, || group.reduce_scatter(&send, &mut recv, ReduceOp::Sum));
        for replay in 0..3 {
            run(&mut send, &mut recv, &format!("replay {replay}"), &|_, _| graph.launch().expect("graph launch"));
        }

        for root in 0..n {
            // Broadcast in place from `root`.
            let mut bufs: Vec<CudaSlice<u32>> = streams.iter().map(|s| s.alloc_zeros(c).unwrap()).collect();
            let run = |bufs: &mut Vec<CudaSlice<u32>>, what: &str, launch: &dyn Fn(&mut [CudaSlice<u32>])| {
                let inputs = random_u32(n, c);
                fill(&streams, bufs, &inputs);
                launch(bufs);
                sync(&streams);
                for (r, got) in read(bufs).iter().enumerate() {
                    assert_same(&format!("{what} broadcast c={c} root {root} rank {r}"), got, &inputs[root]);
                }
            };
            run(&mut bufs, "eager", &|b| group.broadcast(b, root).expect("eager broadcast"));
            let graph = capture(&streams, || group.broadcast(&mut bufs, root));
            for replay in 0..3 {
                run(&mut bufs, &format!("replay {replay}"), &|_| graph.launch().expect("graph launch"));
            }

            // Reduce to `root`: only the root's recv is the result.
            let mut send: Vec<CudaSlice<u32>> = streams.iter().map(|s| s.alloc_zeros(c).unwrap()).collect();
            let mut recv: Vec<CudaSlice<u32>> = streams.iter().map(|s| s.alloc_zeros(c).unwrap()).collect();
            let run = |send: &mut Vec<CudaSlice<u32>>, recv: &mut Vec<CudaSlice<u32>>, what: &str, launch: &SendRecv<'_>| {
                let inputs = random_u32(n, c);
                fill(&streams, send, &inputs);
                fill(&streams, recv, &vec![vec![0xDEAD_BEEFu32; c]; n]);
                launch(send, recv);
                sync(&streams);
                assert_same(&format!("{what} reduce c={c} root {root}"), &read(recv)[root], &sum_u32(&inputs));
                assert!(read(send) == inputs, "{what} reduce c={c} root {root}: a send buffer changed");
            };
            run(&mut send, &mut recv, "eager", &|s, d| group.reduce(s, d, root, ReduceOp::Sum).expect("eager reduce"));
            let graph = capture(&streams, || group.reduce(&send, &mut recv, root, ReduceOp::Sum));
            for replay in 0..3 {
                run(&mut send, &mut recv, &format!("replay {replay}"), &|_, _| graph.launch().expect("graph launch"));
            }
        }
    }
}

/// Where no CUDA driver library loads (the CI machine), every way in is
/// `Error::Load` naming the library and each name tried, never a panic;
/// where one loads, says SKIPPED (the GPU machine). (`Error::NoDevice`, a
/// driver that loads and reports no device, is tested over the fault
/// shim's pretend driver: `layering_probe` in `tests/fault_shim.rs`.)
#[test]
fn without_a_driver_every_way_in_is_a_load_error() {
    let test = "without_a_driver_every_way_in_is_a_load_error";
    let e = match driver::api() {
        Ok(_) => return common::skipped(test, "a CUDA driver library loads here"),
        Err(e) => e,
    };
    let Error::Load(load) = &e else { panic!("driver::api() without a driver: expected Error::Load, got {e:?}") };
    assert_eq!(load.library, "the CUDA driver library");
    assert!(load.attempts.iter().any(|(name, _)| name.starts_with("libcuda.so")), "the names tried: {:?}", load.attempts);
    assert!(e.to_string().starts_with("could not load the CUDA driver library: libcuda.so"), "{e}");
    let is_load = |r: Result<(), Error>, what: &str| assert!(matches!(r, Err(Error::Load(_))), "{what}: {r:?}");
    is_load(driver::device_count().map(drop), "driver::device_count");
    is_load(driver::context(0).map(drop), "driver::context(0)");
    is_load(driver::all_contexts().map(drop), "driver::all_contexts");
    is_load(Group::from_devices(&[0, 1], &GroupOptions::default()).map(drop), "Group::from_devices");
    is_load(cuda_peer::peer::can_access_peer(0, 1).map(drop), "peer::can_access_peer");
}
