//! GPU tests of callers' buffers that live on context objects the group or
//! link did not make (issue 16, item 1): cudarc keeps its ordering state per
//! `Arc<CudaContext>` object, and a fresh object that has made no stream
//! orders everything through its own (default) stream and records nothing.
//!
//! Every case puts a long chain of copies at the head of the stream that
//! writes the inputs (or of the group's own stream), so work that is not
//! ordered after it reads stale data or is read back too early: the results,
//! compared exactly against a CPU reference (wrapping u32 sums), then come
//! out wrong. The two ranks are laid round robin over the GPUs (rank r on
//! device r % count): on one GPU both are on it (staged links too, under
//! `StagedOnly`), and the parts that need two devices (a group on the
//! default streams of two devices, memory unmapped for a peer device) say
//! SKIPPED. Skips without
//! a GPU; fails then with CUDA_PEER_REQUIRE_GPU=1.

mod common;

use common::gpus;
use cuda_peer::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cuda_peer::{Algorithm, Error, Group, GroupOptions, Link, LinkOptions, PathPolicy, ReduceOp};
use std::sync::Arc;

/// Bytes of each buffer in the delay chain.
const DELAY_BYTES: usize = 256 << 20;
/// Copies in the delay chain (about 5-10 ms of copy-engine time on an H200).
const DELAY_COPIES: usize = 40;

/// Two device buffers on one stream to copy between, for delays.
struct Delay {
    a: CudaSlice<u8>,
    b: CudaSlice<u8>,
}

impl Delay {
    fn new(stream: &Arc<CudaStream>) -> Delay {
        let d = Delay { a: stream.alloc_zeros(DELAY_BYTES).unwrap(), b: stream.alloc_zeros(DELAY_BYTES).unwrap() };
        stream.synchronize().unwrap();
        d
    }

    /// Enqueues the chain on `stream` (the buffers' own stream).
    fn run(&mut self, stream: &Arc<CudaStream>) {
        for _ in 0..DELAY_COPIES {
            stream.memcpy_dtod(&self.a, &mut self.b).unwrap();
        }
    }
}

fn random_u32(n: usize) -> Vec<u32> {
    common::random_bytes(n * 4).chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn wrapping_sum(inputs: &[Vec<u32>]) -> Vec<u32> {
    (0..inputs[0].len()).map(|i| inputs.iter().fold(0u32, |acc, v| acc.wrapping_add(v[i]))).collect()
}

/// Fresh context objects of devices 0 and 1 (of device r % `gpus` for
/// rank r) that have made no stream (cudarc's single-stream mode), with
/// their default streams.
fn fresh_objects(gpus: usize) -> Vec<Arc<CudaStream>> {
    (0..2).map(|r| CudaContext::new(r % gpus).unwrap().default_stream()).collect()
}

/// The ranks' devices: 0 and 1, or 0 twice on one GPU.
fn devices(gpus: usize) -> [usize; 2] {
    [0, 1 % gpus]
}

/// The group configurations: every all-reduce algorithm, over P2P between
/// two GPUs (local on one) and staged (`StagedOnly`, on one device too).
fn configs() -> Vec<(&'static str, GroupOptions, usize)> {
    let with = |policy: PathPolicy, algorithm: Algorithm| GroupOptions::with_policy(policy).algorithm(algorithm);
    let mut configs = vec![
        ("one-shot over P2P", with(PathPolicy::Auto, Algorithm::OneShot), 1024),
        ("mesh", with(PathPolicy::Auto, Algorithm::Mesh), 1 << 18),
        ("ring over P2P", with(PathPolicy::Auto, Algorithm::Ring), (1 << 18) + 3),
    ];
    configs.push(("one-shot through host memory", with(PathPolicy::StagedOnly, Algorithm::OneShot), 4099));
    configs.push(("staged ring", with(PathPolicy::StagedOnly, Algorithm::Ring), (1 << 18) + 5));
    configs
}

/// The reproduction, for every algorithm, in place and out of place:
/// `Group::from_devices` makes its own context objects; the caller's buffers
/// are written on the default streams of other objects of the same devices.
#[test]
fn single_stream_buffers_of_other_context_objects_are_ordered() {
    let test = "single_stream_buffers_of_other_context_objects_are_ordered";
    let Some(ctxs) = gpus(test, 1) else {
        return;
    };
    let user = fresh_objects(ctxs.len());
    let mut delays: Vec<Delay> = user.iter().map(Delay::new).collect();
    for (name, opts, count) in configs() {
        let group = Group::from_devices(&devices(ctxs.len()), &opts).unwrap();
        for in_place in [true, false] {
            let inputs: Vec<Vec<u32>> = (0..2).map(|_| random_u32(count)).collect();
            let expected = wrapping_sum(&inputs);
            let staged: Vec<CudaSlice<u32>> = (0..2).map(|r| user[r].clone_htod(&inputs[r]).unwrap()).collect();
            let poison = vec![0xdead_beefu32; count];
            let mut send: Vec<CudaSlice<u32>> = (0..2).map(|r| user[r].clone_htod(&poison).unwrap()).collect();
            let mut recv: Vec<CudaSlice<u32>> = (0..2).map(|r| user[r].clone_htod(&poison).unwrap()).collect();
            for s in &user {
                s.synchronize().unwrap();
            }
            // The inputs land only after the delay chain on each default stream.
            for r in 0..2 {
                delays[r].run(&user[r]);
                user[r].memcpy_dtod(&staged[r], &mut send[r]).unwrap();
            }
            if in_place {
                group.all_reduce_in_place(&mut send, ReduceOp::Sum).unwrap();
            } else {
                group.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap();
            }
            // Read back on the caller's stream, with no other synchronisation.
            for r in 0..2 {
                let out = user[r].clone_dtoh(if in_place { &send[r] } else { &recv[r] }).unwrap();
                if let Some((first, wrong)) = common::diff(&out, &expected) {
                    panic!(
                        "{name}, in place {in_place}, rank {r}: {wrong} of {count} wrong, first at {first}: {} != {}",
                        out[first], expected[first]
                    );
                }
                if !in_place {
                    assert_eq!(user[r].clone_dtoh(&send[r]).unwrap(), inputs[r], "{name}: send buffer of rank {r} changed");
                }
            }
            // Dropped right after the call: the frees are ordered after it.
            drop((send, recv, staged));
        }
        group.synchronize().unwrap();
    }
}

/// The other way round: the group runs on the default streams of fresh
/// objects (which record no events), the buffers belong to objects that
/// track events on streams of their own. The caller reads back on its own
/// stream, which waits only for the buffers' events: they must be recorded
/// after the collective, which starts late behind a delay on the group's
/// stream. Needs two devices: on one, both ranks would be on its one
/// default stream (a fused kernel would wait behind itself for its peer).
#[test]
fn event_tracked_buffers_on_a_group_of_default_streams() {
    let test = "event_tracked_buffers_on_a_group_of_default_streams";
    let Some(ctxs) = gpus(test, 1) else {
        return;
    };
    if !common::has_gpus(test, "a group on the default streams of two devices (one device has one default stream)", ctxs.len(), 2) {
        return;
    }
    let group_streams = fresh_objects(ctxs.len());
    let mut delays: Vec<Delay> = group_streams.iter().map(Delay::new).collect();
    let user: Vec<Arc<CudaStream>> = ctxs[..2].iter().map(|c| c.new_stream().unwrap()).collect();
    for (name, opts, count) in configs() {
        let group = Group::new(group_streams.clone(), &opts).unwrap();
        let inputs: Vec<Vec<u32>> = (0..2).map(|_| random_u32(count)).collect();
        let expected = wrapping_sum(&inputs);
        let mut bufs: Vec<CudaSlice<u32>> = (0..2).map(|r| user[r].clone_htod(&inputs[r]).unwrap()).collect();
        for r in 0..2 {
            delays[r].run(&group_streams[r]);
        }
        group.all_reduce_in_place(&mut bufs, ReduceOp::Sum).unwrap();
        for r in 0..2 {
            let out = user[r].clone_dtoh(&bufs[r]).unwrap();
            if let Some((first, wrong)) = common::diff(&out, &expected) {
                panic!("{name}, rank {r}: {wrong} of {count} wrong, first at {first}");
            }
        }
        group.synchronize().unwrap();
    }
}

/// A verified link copies between buffers of single-stream objects on a
/// stream of its own: the copy waits for the source's writer and the
/// destination's stream waits for the copy, under `Auto` and staged. On one
/// GPU the link is within device 0 (local under `Auto`; the two objects'
/// default streams one stream).
#[test]
fn link_copies_order_single_stream_buffers() {
    let test = "link_copies_order_single_stream_buffers";
    let Some(ctxs) = gpus(test, 1) else {
        return;
    };
    let [d0, d1] = devices(ctxs.len());
    let user = fresh_objects(ctxs.len());
    let mut delay = Delay::new(&user[0]);
    let link_stream = ctxs[d1].new_stream().unwrap();
    for policy in [PathPolicy::Auto, PathPolicy::StagedOnly] {
        let mut link = Link::open(&ctxs[d0], &ctxs[d1], &LinkOptions::with_policy(policy)).unwrap();
        let count = (3 << 20) + 7;
        let data = random_u32(count);
        let staged = user[0].clone_htod(&data).unwrap();
        let mut src = user[0].clone_htod(&vec![1u32; count]).unwrap();
        let mut dst = user[1].clone_htod(&vec![2u32; count]).unwrap();
        user[0].synchronize().unwrap();
        user[1].synchronize().unwrap();
        delay.run(&user[0]);
        user[0].memcpy_dtod(&staged, &mut src).unwrap();
        link.copy(&src, &mut dst, &link_stream).unwrap();
        let out = user[1].clone_dtoh(&dst).unwrap();
        if let Some((first, wrong)) = common::diff(&out, &data) {
            panic!("{policy:?} link ({}): {wrong} of {count} wrong, first at {first}", link.path());
        }
    }
}

/// Buffers of a non-primary context are not mapped in the primary context
/// the group and the link use: a typed error, never a kernel fault. Ranks
/// on devices 0 and 1, or both on device 0 where there is one GPU (the
/// check is of contexts, not of devices).
#[test]
fn buffers_of_a_non_primary_context_are_refused() {
    let Some(ctxs) = gpus("buffers_of_a_non_primary_context_are_refused", 1) else {
        return;
    };
    let [d0, d1] = devices(ctxs.len());
    let other = CudaContext::new_non_primary(d0, 0).unwrap();
    let s = other.default_stream();
    let mut foreign = vec![s.clone_htod(&[1u32; 64]).unwrap(), ctxs[d1].default_stream().clone_htod(&[1u32; 64]).unwrap()];
    let group = Group::from_devices(&[d0, d1], &GroupOptions::default()).unwrap();
    let err = group.all_reduce_in_place(&mut foreign, ReduceOp::Sum).unwrap_err();
    assert!(matches!(err, Error::WrongContext { device: 0, .. }), "{err}");
    let mut dst = ctxs[d1].default_stream().clone_htod(&[0u32; 64]).unwrap();
    let mut link = Link::open(&ctxs[d0], &ctxs[d1], &LinkOptions::default()).unwrap();
    let err = link.copy(&foreign[0], &mut dst, &ctxs[d1].default_stream()).unwrap_err();
    assert!(matches!(err, Error::WrongContext { what: "source", .. }), "{err}");
    // A stream of the non-primary context is refused as the copy's stream too.
    let other1 = CudaContext::new_non_primary(d1, 0).unwrap();
    let src = ctxs[d0].default_stream().clone_htod(&[3u32; 64]).unwrap();
    let err = link.copy(&src, &mut dst, &other1.default_stream()).unwrap_err();
    assert!(matches!(err, Error::WrongContext { what: "stream", .. }), "{err}");
}

/// A memory pool of device `dev` other than its default one.
fn private_pool(dev: i32) -> cuda_peer::cudarc::driver::sys::CUmemoryPool {
    use cuda_peer::cudarc::driver::sys;
    // SAFETY: zero is a valid value for every field (the enums' INVALID/NONE
    // variants, a null pointer, zeroed reserved bytes); the fields that
    // matter are set below.
    let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
    props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location = sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: dev };
    let mut pool = std::ptr::null_mut();
    // SAFETY: `props` describes device memory of an existing device.
    assert_eq!(unsafe { sys::cuMemPoolCreate(&mut pool, &props) }, sys::CUresult::CUDA_SUCCESS);
    pool
}

/// Lets device `to` read and write `pool`'s memory.
fn grant(pool: cuda_peer::cudarc::driver::sys::CUmemoryPool, to: i32) {
    use cuda_peer::cudarc::driver::sys;
    let desc = sys::CUmemAccessDesc {
        location: sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: to },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: one descriptor for a live pool.
    assert_eq!(unsafe { sys::cuMemPoolSetAccess(pool, &desc, 1) }, sys::CUresult::CUDA_SUCCESS);
}

/// Buffers from a private memory pool are not mapped for the peer: the mesh
/// and the P2P ring, whose kernels load from and store to peers' buffers,
/// refuse them with a typed error instead of faulting (which would kill the
/// context); once the pools grant the peers access, the same buffers are
/// all-reduced exactly. The one-shot never touches a peer's buffer and
/// takes them as they are. Needs two devices: a device's own pool is
/// always mapped for itself.
#[test]
fn buffers_of_a_private_pool_are_refused_until_granted() {
    use cuda_peer::cudarc::driver::sys;
    let test = "buffers_of_a_private_pool_are_refused_until_granted";
    let Some(ctxs) = gpus(test, 1) else {
        return;
    };
    if !common::has_gpus(test, "memory of a private pool unmapped for the peer device", ctxs.len(), 2) {
        return;
    }
    let streams: Vec<Arc<CudaStream>> = ctxs[..2].iter().map(|c| c.new_stream().unwrap()).collect();
    let pools: Vec<_> = (0..2).map(private_pool).collect();
    let count = (1 << 20) + 3;
    let alloc = |r: usize| -> CudaSlice<u32> {
        ctxs[r].bind_to_thread().unwrap();
        let mut ptr = 0;
        // SAFETY: allocates `count` u32 from a live pool on rank r's stream.
        let res = unsafe { sys::cuMemAllocFromPoolAsync(&mut ptr, count * 4, pools[r], streams[r].cu_stream()) };
        assert_eq!(res, sys::CUresult::CUDA_SUCCESS);
        // SAFETY: the allocation holds `count` u32 on this stream's device and
        // is freed (cuMemFreeAsync) only by the slice.
        unsafe { streams[r].upgrade_device_ptr(ptr, count) }
    };
    let with = |algorithm: Algorithm| GroupOptions::with_policy(PathPolicy::P2pOnly).algorithm(algorithm);
    let groups = [("mesh", with(Algorithm::Mesh)), ("ring over P2P", with(Algorithm::Ring)), ("one-shot", with(Algorithm::OneShot))];
    for granted in [false, true] {
        if granted {
            grant(pools[0], 1);
            grant(pools[1], 0);
        }
        for (name, opts) in &groups {
            let group = Group::new(streams.clone(), opts).unwrap();
            let inputs: Vec<Vec<u32>> = (0..2).map(|_| random_u32(count)).collect();
            let mut bufs: Vec<CudaSlice<u32>> = (0..2).map(&alloc).collect();
            for r in 0..2 {
                streams[r].memcpy_htod(&inputs[r], &mut bufs[r]).unwrap();
            }
            let res = group.all_reduce_in_place(&mut bufs, ReduceOp::Sum);
            if !granted && *name != "one-shot" {
                let err = res.unwrap_err();
                assert!(matches!(err, Error::Unreachable { .. }), "{name}: {err}");
                continue;
            }
            res.unwrap_or_else(|e| panic!("{name}, granted {granted}: {e}"));
            let expected = wrapping_sum(&inputs);
            for r in 0..2 {
                let out = streams[r].clone_dtoh(&bufs[r]).unwrap();
                if let Some((first, wrong)) = common::diff(&out, &expected) {
                    panic!("{name}, granted {granted}, rank {r}: {wrong} of {count} wrong, first at {first}");
                }
            }
        }
    }
    for s in &streams {
        s.synchronize().unwrap();
    }
}
