//! GPU tests of all-reduces captured in one CUDA graph (every rank's stream
//! joined into one capture, as a framework that replays its step would do)
//! and replayed several times on fresh inputs, against a CPU reference.
//!
//! cudarc's event tracking is turned off on these contexts (but for the
//! test of a capture that reaches the group through its buffers' events,
//! which needs it on): a captured stream may not wait for events recorded
//! outside the capture, and the caller orders work itself under capture
//! anyway. The tests take one lock: one measures the device pool's use,
//! and groups sharing the device would slow each other's barriers.
//! Ranks are laid round robin over the GPUs (rank r on device r % count):
//! on one GPU two ranks share it, the ring, the mesh and the one-shot
//! included, and the staged links (`StagedOnly`: the one-shot through host
//! memory, the staged ring) too. Skips without a GPU (fails with
//! CUDA_PEER_REQUIRE_GPU=1 then).

mod common;

use common::graph::{capture, untracked};
use common::ranks::exclusive;
use cuda_peer::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cuda_peer::{Algorithm, Group, GroupOptions, PathPolicy, ReduceOp};
use rand::Rng;
use std::sync::Arc;

fn sync(streams: &[Arc<CudaStream>]) {
    for s in streams {
        s.synchronize().unwrap();
    }
}

/// Wrapping u32 sums are exact, so every rank must match the reference
/// bit for bit whatever the order of reduction.
fn reference(inputs: &[Vec<u32>]) -> Vec<u32> {
    (0..inputs[0].len()).map(|i| inputs.iter().fold(0u32, |a, v| a.wrapping_add(v[i]))).collect()
}

fn random(n: usize, count: usize) -> Vec<Vec<u32>> {
    let mut rng = rand::rng();
    (0..n).map(|_| (0..count).map(|_| rng.random()).collect()).collect()
}

/// Fills every rank's buffer from the host on its own stream, then makes
/// `streams[0]` (where the graph launches) wait for all of them.
fn fill(streams: &[Arc<CudaStream>], bufs: &mut [CudaSlice<u32>], data: &[Vec<u32>]) {
    for ((s, b), d) in streams.iter().zip(bufs.iter_mut()).zip(data) {
        s.memcpy_htod(d, b).unwrap();
    }
    for s in &streams[1..] {
        streams[0].join(s).unwrap();
    }
}

fn check(what: &str, streams: &[Arc<CudaStream>], bufs: &[CudaSlice<u32>], want: &[u32]) {
    for (r, (s, b)) in streams.iter().zip(bufs).enumerate() {
        let got = s.clone_dtoh(b).unwrap();
        if let Some((first, wrong)) = common::diff(&got, want) {
            panic!("{what}: rank {r}: {wrong} wrong elements, first at {first}: {} instead of {}", got[first], want[first]);
        }
    }
}

/// One group: for each count, an out-of-place and an in-place all-reduce are
/// captured (after an eager run of each), then each graph is replayed three
/// times on fresh inputs with poisoned outputs.
fn capture_and_replay(ctxs: &[Arc<CudaContext>], n: usize, tag: &str, policy: PathPolicy, algorithm: Algorithm, counts: &[usize]) {
    use std::io::Write;
    let streams: Vec<_> = (0..n).map(|r| ctxs[r % ctxs.len()].new_stream().unwrap()).collect();
    let group = Group::new(streams.clone(), &GroupOptions::with_policy(policy).algorithm(algorithm)).expect("group");
    for &count in counts {
        let algo = group.all_reduce_algorithm(count * 4);
        let what = format!("{tag} n={n} count={count} ({algo:?})");
        let _ = writeln!(std::io::stderr(), "  graph {what}");
        let mut send: Vec<CudaSlice<u32>> = streams.iter().map(|s| s.alloc_zeros(count).unwrap()).collect();
        let mut recv: Vec<CudaSlice<u32>> = streams.iter().map(|s| s.alloc_zeros(count).unwrap()).collect();

        // Eager first (loads the kernels), and checked.
        let inputs = random(n, count);
        fill(&streams, &mut send, &inputs);
        group.all_reduce(&send, &mut recv, ReduceOp::Sum).expect("eager all_reduce");
        sync(&streams);
        check(&format!("eager {what}"), &streams, &recv, &reference(&inputs));

        let out_of_place = capture(&streams, || group.all_reduce(&send, &mut recv, ReduceOp::Sum));
        let in_place = capture(&streams, || group.all_reduce_in_place(&mut recv, ReduceOp::Sum));
        for replay in 0..3 {
            let inputs = random(n, count);
            fill(&streams, &mut send, &inputs);
            let poison = vec![vec![0xDEAD_BEEFu32; count]; n];
            fill(&streams, &mut recv, &poison);
            out_of_place.launch().expect("graph launch");
            sync(&streams);
            check(&format!("replay {replay} out of place {what}"), &streams, &recv, &reference(&inputs));
            for (r, (s, b)) in streams.iter().zip(&send).enumerate() {
                assert!(s.clone_dtoh(b).unwrap() == inputs[r], "{what}: rank {r}'s send buffer changed");
            }

            let inputs = random(n, count);
            fill(&streams, &mut recv, &inputs);
            in_place.launch().expect("graph launch");
            sync(&streams);
            check(&format!("replay {replay} in place {what}"), &streams, &recv, &reference(&inputs));
        }
        // The group still works eagerly after its calls were captured.
        let inputs = random(n, count);
        fill(&streams, &mut recv, &inputs);
        group.all_reduce_in_place(&mut recv, ReduceOp::Sum).expect("eager after capture");
        sync(&streams);
        check(&format!("eager after capture {what}"), &streams, &recv, &reference(&inputs));
    }
}

/// Counts (u32): under Auto with P2P, 1024 to 1 << 19 (4 KiB to 2 MiB) take
/// the one-shot and (1 << 21) + 5 (8 MiB + 20 B) the mesh; 4093 ends in a
/// partial 16-byte unit. They span every one-shot lane: over P2P 4-64 KiB
/// take the small lane, 256 KiB the middle one and 2 MiB the large one;
/// through host memory 4 and 16 KiB take the smallest lane, 64 and 256 KiB
/// the next, 2 MiB the one up to 8 MiB and 8 MiB + 20 B the largest (in
/// 1 MiB rounds). The ring takes them all in the ring test.
const COUNTS: [usize; 6] = [1024, 4093, 1 << 14, 1 << 16, 1 << 19, (1 << 21) + 5];

#[test]
fn fused_all_reduces_replay_from_a_graph() {
    let _gpu = exclusive();
    let test = "fused_all_reduces_replay_from_a_graph";
    let Some(ctxs) = untracked(test, 1) else { return };
    // Two ranks sharing the device where there is one GPU; one per device otherwise.
    let n = if ctxs.len() == 1 { 2 } else { ctxs.len().min(8) };
    capture_and_replay(&ctxs, n, "p2p-auto", PathPolicy::P2pOnly, Algorithm::Auto, &COUNTS);
    capture_and_replay(&ctxs, n, "p2p-mesh", PathPolicy::P2pOnly, Algorithm::Mesh, &COUNTS[..2]);
    capture_and_replay(&ctxs, n, "host-oneshot", PathPolicy::StagedOnly, Algorithm::OneShot, &COUNTS);
}

#[test]
fn ring_all_reduces_replay_from_a_graph() {
    let _gpu = exclusive();
    let Some(ctxs) = untracked("ring_all_reduces_replay_from_a_graph", 1) else { return };
    // Two ranks per device where there is one GPU; one per device otherwise.
    let n = if ctxs.len() == 1 { 2 } else { ctxs.len().min(8) };
    capture_and_replay(&ctxs, n, "p2p-ring", PathPolicy::P2pOnly, Algorithm::Ring, &COUNTS);
    capture_and_replay(&ctxs, 3, "p2p-ring-3", PathPolicy::P2pOnly, Algorithm::Ring, &COUNTS[..2]);
    capture_and_replay(&ctxs, n, "staged-ring", PathPolicy::StagedOnly, Algorithm::Ring, &COUNTS[..2]);
}

/// Bytes allocated from device 0's default memory pool and not yet freed
/// (`CU_MEMPOOL_ATTR_USED_MEM_CURRENT`), after synchronising: cudarc
/// allocates from that pool, and memory freed into it stays reserved (so
/// `cuMemGetInfo` does not show a free), but no longer counts as used.
fn pool_used(ctx: &Arc<CudaContext>) -> u64 {
    use cuda_peer::cudarc::driver::sys;
    ctx.synchronize().unwrap();
    let mut pool = std::ptr::null_mut();
    // SAFETY: writes one pool handle of an existing device.
    assert_eq!(unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }, sys::CUresult::CUDA_SUCCESS);
    let mut used = 0u64;
    // SAFETY: USED_MEM_CURRENT writes one u64.
    let r = unsafe { sys::cuMemPoolGetAttribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT, (&mut used as *mut u64).cast()) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    used
}

/// A graph replayed after its group was dropped: the
/// graph keeps the group's slots, flags, pinned buffers and peer access
/// alive, so the replays are still right; once the graph is dropped too,
/// the group's device memory comes back. Rank r on device r % count (both
/// on device 0 where there is one GPU: its pool then holds both ranks'
/// memory); the staged cases need two devices.
#[test]
fn graphs_outlive_their_group() {
    let _gpu = exclusive();
    let test = "graphs_outlive_their_group";
    let Some(ctxs) = untracked(test, 1) else { return };
    let cases = [
        ("one-shot over P2P", PathPolicy::P2pOnly, Algorithm::Auto, 1024, true),
        ("mesh (Auto, 8 MiB)", PathPolicy::P2pOnly, Algorithm::Auto, 1 << 21, true),
        ("ring over P2P", PathPolicy::P2pOnly, Algorithm::Ring, 1 << 14, false),
        ("one-shot through host memory", PathPolicy::StagedOnly, Algorithm::OneShot, 1 << 14, false),
        ("staged ring", PathPolicy::StagedOnly, Algorithm::Ring, 4093, false),
    ];
    let n = 2;
    for (what, policy, algorithm, count, device_slots) in cases {
        let streams: Vec<_> = (0..n).map(|r| ctxs[r % ctxs.len()].new_stream().unwrap()).collect();
        let mut send: Vec<CudaSlice<u32>> = streams.iter().map(|s| s.alloc_zeros(count).unwrap()).collect();
        let mut recv: Vec<CudaSlice<u32>> = streams.iter().map(|s| s.alloc_zeros(count).unwrap()).collect();
        let group = Group::new(streams.clone(), &GroupOptions::with_policy(policy).algorithm(algorithm)).expect("group");
        let inputs = random(n, count);
        fill(&streams, &mut send, &inputs);
        group.all_reduce(&send, &mut recv, ReduceOp::Sum).expect("eager all_reduce");
        sync(&streams);
        let graph = capture(&streams, || group.all_reduce(&send, &mut recv, ReduceOp::Sum));
        let with_group = pool_used(&ctxs[0]);
        drop(group);
        for replay in 0..3 {
            let inputs = random(n, count);
            fill(&streams, &mut send, &inputs);
            fill(&streams, &mut recv, &vec![vec![0xDEAD_BEEFu32; count]; n]);
            graph.launch().expect("graph launch");
            sync(&streams);
            check(&format!("{what}: replay {replay} after the group was dropped"), &streams, &recv, &reference(&inputs));
        }
        if device_slots {
            // The group's device memory (16 MiB of one-shot slots, or the
            // mesh's flags and the one-shot's slots) is still in use while
            // the graph lives...
            let held = pool_used(&ctxs[0]);
            assert!(
                held + (2 << 20) >= with_group,
                "{what}: {} MiB of the group's device memory freed under a live graph",
                (with_group - held) >> 20
            );
            drop(graph);
            // ... and is freed once the graph is gone (by a thread of the
            // library's, after the driver lets go of the graph).
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            loop {
                let now = pool_used(&ctxs[0]);
                if now + (8 << 20) <= with_group {
                    break;
                }
                let (retained, released, dropped) = cuda_peer::group::graph_keep_alives();
                assert!(
                    std::time::Instant::now() < deadline,
                    "{what}: the group's device memory not freed 10 s after the graph was dropped (MiB used in the pool: with the group {}, under the graph {}, now {}; keep-alives retained {retained}, released {released}; one-shot states dropped {dropped})",
                    with_group >> 20,
                    held >> 20,
                    now >> 20
                );
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
    }
}

/// A graph of the group's calls runs wherever the caller launches it, and
/// its kernels use the group's slots, counters and flags as the eager calls
/// do; the group runs each rank's calls and replays in the order the host
/// issued them, wherever each replay is launched. Two ranks (sharing the
/// device where there is one GPU): a graph of an in-place all-reduce of
/// `x` (1 MiB); then, with no host synchronisation, `ROUNDS` rounds of fresh inputs
/// copied into `x`, the graph launched and `x` copied out, all on streams
/// of the caller's, and an eager all-reduce of other fresh inputs on the
/// group's streams. Every result exact, for the one-shot (over P2P and
/// through host memory), the mesh and the ring.
#[test]
fn replays_on_another_stream_are_ordered_with_eager_calls() {
    let _gpu = exclusive();
    const ROUNDS: usize = 48;
    let test = "replays_on_another_stream_are_ordered_with_eager_calls";
    let Some(ctxs) = untracked(test, 1) else { return };
    // 1 MiB and 12 bytes a rank: long enough that a replay and the eager
    // call beside it overlap where nothing orders them, and the same size
    // for both (so the same one-shot lane).
    let (n, count) = (2, (1 << 18) + 3);
    let cases = [
        ("one-shot over P2P", PathPolicy::P2pOnly, Algorithm::Auto),
        ("mesh", PathPolicy::P2pOnly, Algorithm::Mesh),
        ("ring", PathPolicy::P2pOnly, Algorithm::Ring),
        ("one-shot through host memory", PathPolicy::StagedOnly, Algorithm::OneShot),
    ];
    for (what, policy, algorithm) in cases {
        let ctx = |r: usize| &ctxs[r % ctxs.len()];
        let streams: Vec<_> = (0..n).map(|r| ctx(r).new_stream().unwrap()).collect();
        let others: Vec<_> = (0..n).map(|r| ctx(r).new_stream().unwrap()).collect();
        let group = Group::new(streams.clone(), &GroupOptions::with_policy(policy).algorithm(algorithm)).expect("group");
        let mut x: Vec<CudaSlice<u32>> = streams.iter().map(|s| s.alloc_zeros(count).unwrap()).collect();
        group.all_reduce_in_place(&mut x, ReduceOp::Sum).expect("eager all_reduce_in_place");
        sync(&streams);
        let graph = capture(&streams, || group.all_reduce_in_place(&mut x, ReduceOp::Sum));
        let (replay_in, eager_in) =
            ((0..ROUNDS).map(|_| random(n, count)).collect::<Vec<_>>(), (0..ROUNDS).map(|_| random(n, count)).collect::<Vec<_>>());
        let up = |ins: &[Vec<Vec<u32>>]| -> Vec<Vec<CudaSlice<u32>>> {
            ins.iter().map(|round| round.iter().zip(&streams).map(|(v, s)| s.clone_htod(v).unwrap()).collect()).collect()
        };
        let (on_device, mut eager) = (up(&replay_in), up(&eager_in));
        let mut replay_out: Vec<Vec<CudaSlice<u32>>> = (0..ROUNDS).map(|_| streams.iter().map(|s| s.alloc_zeros(count).unwrap()).collect()).collect();
        sync(&streams);
        for k in 0..ROUNDS {
            for r in 0..n {
                others[r].memcpy_dtod(&on_device[k][r], &mut x[r]).unwrap();
                if r > 0 {
                    others[0].join(&others[r]).unwrap();
                }
            }
            others[0].context().bind_to_thread().unwrap();
            // SAFETY: a live executable graph of rank 0's context, launched
            // on a live stream of that context.
            unsafe { cuda_peer::cudarc::driver::result::graph::launch(graph.cu_graph_exec(), others[0].cu_stream()) }.expect("graph launch");
            for r in 0..n {
                if r > 0 {
                    others[r].join(&others[0]).unwrap();
                }
                others[r].memcpy_dtod(&x[r], &mut replay_out[k][r]).unwrap();
            }
            group.all_reduce_in_place(&mut eager[k], ReduceOp::Sum).expect("eager all_reduce_in_place");
        }
        sync(&others);
        sync(&streams);
        for k in 0..ROUNDS {
            check(&format!("{what}: round {k}: the replay on the caller's stream"), &streams, &replay_out[k], &reference(&replay_in[k]));
            check(&format!("{what}: round {k}: the eager call between replays"), &streams, &eager[k], &reference(&eager_in[k]));
        }
    }
}

/// The first launch of a group's first graph must come after the eager
/// calls made before its capture in the caller's stream order (they record
/// nothing before a capture, which would cost every call of applications
/// that never capture): ordered so, a graph captured right after 32 eager
/// all-reduces of 1 MiB, still running, and launched on a stream of the
/// caller's that waits for the group's streams, is right, and so are the
/// eager calls. Two ranks (sharing the device where there is one GPU), the
/// one-shot (over P2P and through host memory) and the mesh.
#[test]
fn a_first_launch_ordered_after_the_eager_calls_before_its_capture_is_right() {
    let _gpu = exclusive();
    const EAGER: usize = 32;
    let test = "a_first_launch_ordered_after_the_eager_calls_before_its_capture_is_right";
    let Some(ctxs) = untracked(test, 1) else { return };
    let (n, count) = (2, (1 << 18) + 3);
    let cases = [
        ("one-shot over P2P", PathPolicy::P2pOnly, Algorithm::Auto),
        ("mesh", PathPolicy::P2pOnly, Algorithm::Mesh),
        ("one-shot through host memory", PathPolicy::StagedOnly, Algorithm::OneShot),
    ];
    for (what, policy, algorithm) in cases {
        let ctx = |r: usize| &ctxs[r % ctxs.len()];
        let streams: Vec<_> = (0..n).map(|r| ctx(r).new_stream().unwrap()).collect();
        let launch = ctx(0).new_stream().unwrap();
        let group = Group::new(streams.clone(), &GroupOptions::with_policy(policy).algorithm(algorithm)).expect("group");
        let eager_in: Vec<Vec<Vec<u32>>> = (0..EAGER).map(|_| random(n, count)).collect();
        let mut eager: Vec<Vec<CudaSlice<u32>>> =
            eager_in.iter().map(|k| k.iter().zip(&streams).map(|(v, s)| s.clone_htod(v).unwrap()).collect()).collect();
        let graph_in = random(n, count);
        let mut x: Vec<CudaSlice<u32>> = graph_in.iter().zip(&streams).map(|(v, s)| s.clone_htod(v).unwrap()).collect();
        sync(&streams);
        for bufs in eager.iter_mut() {
            group.all_reduce_in_place(bufs, ReduceOp::Sum).expect("eager all_reduce_in_place");
        }
        let graph = capture(&streams, || group.all_reduce_in_place(&mut x, ReduceOp::Sum));
        group.wait_for_ranks(&launch).unwrap();
        launch.context().bind_to_thread().unwrap();
        // SAFETY: a live executable graph of rank 0's context, launched on a
        // live stream of that context.
        unsafe { cuda_peer::cudarc::driver::result::graph::launch(graph.cu_graph_exec(), launch.cu_stream()) }.expect("graph launch");
        launch.synchronize().unwrap();
        sync(&streams);
        check(&format!("{what}: the graph's first launch"), &streams, &x, &reference(&graph_in));
        for (k, bufs) in eager.iter().enumerate() {
            check(&format!("{what}: eager call {k} before the capture"), &streams, bufs, &reference(&eager_in[k]));
        }
    }
}

/// With cudarc's event tracking on, a capture begun on streams of the
/// caller's reaches the group's streams through its buffers (the group's
/// streams wait for the buffers' writers, recorded under the capture): the
/// graph must still hold what the group's kernels use and take its place
/// in each rank's order of calls, and the group's streams must join back
/// through the buffers' events. Two ranks (sharing the device where there
/// is one GPU), buffers first used under the capture (inputs copied in
/// from a source buffer, outputs copied out to another); after the group
/// is dropped, three replays on fresh inputs, outputs poisoned; every
/// result exact, and the capture took a keep-alive. The one-shot (each
/// rank's buffers ordered on its own launcher) and the ring.
#[test]
fn a_capture_that_reaches_the_group_through_its_buffers_holds_it() {
    let _gpu = exclusive();
    let test = "a_capture_that_reaches_the_group_through_its_buffers_holds_it";
    let (n, count) = (2, 4099);
    for (what, algorithm) in [("one-shot", Algorithm::OneShot), ("ring", Algorithm::Ring)] {
        // Context objects of this case's own, event tracking on.
        let Some(ctxs) = common::gpus(test, 1) else { return };
        let ctx = |r: usize| &ctxs[r % ctxs.len()];
        let streams: Vec<_> = (0..n).map(|r| ctx(r).new_stream().unwrap()).collect();
        let callers: Vec<_> = (0..n).map(|r| ctx(r).new_stream().unwrap()).collect();
        let group = Group::new(streams.clone(), &GroupOptions::with_policy(PathPolicy::P2pOnly).algorithm(algorithm)).expect("group");
        // SAFETY: every replay writes `src` (before the launch) and `send`,
        // `recv` and `out` (in the graph) before reading them; nothing is
        // recorded on them before the capture.
        let mut alloc = |c: &Arc<CudaStream>| unsafe { c.alloc::<u32>(count) }.unwrap();
        let (mut src, mut send, mut recv, mut out): (Vec<CudaSlice<u32>>, Vec<_>, Vec<_>, Vec<_>) = (
            callers.iter().map(&mut alloc).collect(),
            callers.iter().map(&mut alloc).collect(),
            callers.iter().map(&mut alloc).collect(),
            callers.iter().map(&mut alloc).collect(),
        );
        let (retained, _, _) = cuda_peer::group::graph_keep_alives();
        let graph = common::graph::try_capture(&callers, || {
            for r in 0..n {
                callers[r].memcpy_dtod(&src[r], &mut send[r]).map_err(|e| format!("copy in: {e:?}"))?;
            }
            group.all_reduce(&send, &mut recv, ReduceOp::Sum).map_err(|e| format!("all_reduce under the capture: {e}"))?;
            for r in 0..n {
                callers[r].memcpy_dtod(&recv[r], &mut out[r]).map_err(|e| format!("copy out: {e:?}"))?;
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        let (after, _, _) = cuda_peer::group::graph_keep_alives();
        assert!(after > retained, "{what}: the capture took no keep-alive ({retained} retained before it, {after} after)");
        drop(group);
        for c in &ctxs {
            // SAFETY: this case's own context objects; from here on the test
            // orders its work itself (each upload joined into the launch
            // stream, a synchronisation before reading).
            unsafe { c.disable_event_tracking() };
        }
        for replay in 0..3 {
            let inputs = random(n, count);
            for r in 0..n {
                callers[r].memcpy_htod(&inputs[r], &mut src[r]).unwrap();
                callers[r].memcpy_htod(&vec![0xDEAD_BEEFu32; count], &mut out[r]).unwrap();
                if r > 0 {
                    callers[0].join(&callers[r]).unwrap();
                }
            }
            graph.launch().expect("graph launch");
            callers[0].synchronize().unwrap();
            check(&format!("{what}: replay {replay} after the group was dropped"), &callers, &out, &reference(&inputs));
        }
    }
}
