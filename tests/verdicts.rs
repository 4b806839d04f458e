//! GPU test of the doctor's verdicts (issue 18): a cache written for this
//! machine's real key decides `Auto` links and groups, says so in their
//! `LinkStatus`, and is ignored when opted out or when its key does not
//! match. Skips without two GPUs (fails instead with CUDA_PEER_REQUIRE_GPU=1).
//!
//! One test function: it sets process environment variables
//! (`CUDA_PEER_DOCTOR_CACHE`, `CUDA_PEER_NO_DOCTOR_CACHE`), which no other
//! test in this binary may see change under it.

mod common;

use common::{diff, gpus, random_bytes};
use cuda_peer::cudarc::driver::CudaContext;
use cuda_peer::verdict::{Cache, CacheKey, CachedPair, CachedPath, SpeedSample, CACHE_ENV, NO_CACHE_ENV, REASON_PREFIX};
use cuda_peer::{Group, GroupOptions, Link, LinkOptions, Path, ReduceOp};
use rand::Rng;
use std::sync::Arc;

/// A cache under `key` with one verdict for device 0 -> device 1.
fn cache(key: &CacheKey, path: CachedPath, speed: Option<SpeedSample>) -> Cache {
    let pair = CachedPair {
        from: key.bus_ids[0].clone(),
        to: key.bus_ids[1].clone(),
        path,
        summary: format!("{} by tests/verdicts.rs", path.as_str()),
        speed,
    };
    Cache::new(key.clone(), vec![pair])
}

/// Opens `a -> b` under `opts`, copies random bytes through it (every byte
/// compared) and returns the link.
fn link_copy(ctx: &[Arc<CudaContext>], a: usize, b: usize, opts: &LinkOptions) -> Link {
    let mut link = Link::open(&ctx[a], &ctx[b], opts).expect("open link");
    let (sa, sb) = (ctx[a].new_stream().unwrap(), ctx[b].new_stream().unwrap());
    for n in [1usize, 4097, (3 << 20) + 5] {
        let data = random_bytes(n);
        let src = sa.clone_htod(&data).unwrap();
        let mut dst = sb.alloc_zeros::<u8>(n).unwrap();
        link.copy(&src, &mut dst, &sb).expect("copy");
        let got = sb.clone_dtoh(&dst).unwrap();
        assert!(diff(&data, &got).is_none(), "{a}->{b} {n} bytes over {:?}: first wrong/count {:?}", link.status(), diff(&data, &got));
    }
    link
}

/// A two-rank group on devices 0 and 1 under `opts`, after an in-place sum
/// all-reduce of random u32 data (small and large) checked exactly against
/// the CPU's wrapping sum on both ranks.
fn group_sum(ctx: &[Arc<CudaContext>], opts: &GroupOptions) -> Group {
    let streams = vec![ctx[0].new_stream().unwrap(), ctx[1].new_stream().unwrap()];
    let group = Group::new(streams.clone(), opts).expect("group");
    let mut rng = rand::rng();
    for n in [1000usize, (4 << 20) + 3] {
        let host: Vec<Vec<u32>> = (0..2).map(|_| (0..n).map(|_| rng.random()).collect()).collect();
        let want: Vec<u32> = (0..n).map(|i| host[0][i].wrapping_add(host[1][i])).collect();
        let mut bufs: Vec<_> = streams.iter().zip(&host).map(|(s, h)| s.clone_htod(h).unwrap()).collect();
        group.all_reduce_in_place(&mut bufs, ReduceOp::Sum).expect("all-reduce");
        for (r, (s, b)) in streams.iter().zip(&bufs).enumerate() {
            let got = s.clone_dtoh(b).unwrap();
            assert!(diff(&want, &got).is_none(), "rank {r}, {n} elements: first wrong/count {:?}", diff(&want, &got));
        }
    }
    group
}

fn from_doctor(reason: &str, path: &std::path::Path) -> bool {
    reason.contains(&format!("{REASON_PREFIX} (cache {})", path.display()))
}

#[test]
fn auto_links_and_groups_follow_the_doctors_verdicts() {
    let Some(ctx) = gpus("auto_links_and_groups_follow_the_doctors_verdicts", 2) else { return };
    let key = CacheKey::current().expect("this machine's cache key");
    let dir = std::env::temp_dir().join(format!("cuda-peer-verdicts-{}", std::process::id()));
    let path = dir.join("doctor.json");
    // Set before any link reads it; the test is alone in its binary (see above).
    std::env::set_var(CACHE_ENV, &path);
    std::env::remove_var(NO_CACHE_ENV);
    let claims = cuda_peer::topology::link_info(0, 1).unwrap().can_access_peer && cuda_peer::topology::link_info(1, 0).unwrap().can_access_peer;
    let no_doctor = LinkOptions::default().use_doctor_verdicts(false);

    // "staged" for 0 -> 1: Auto stages both directions without trying P2P.
    cache(&key, CachedPath::Staged, None).write(&path).unwrap();
    for (a, b) in [(0, 1), (1, 0)] {
        let link = link_copy(&ctx, a, b, &LinkOptions::default());
        let st = link.status();
        assert_eq!((st.path, st.verified), (Path::Staged, None), "{a}->{b}: {st:?}");
        assert!(from_doctor(&st.reason, &path) && st.reason.contains("staged by tests/verdicts.rs"), "{a}->{b}: {st:?}");
        println!("doctor staged {a}->{b}: {}", st.reason);
    }
    let group = group_sum(&ctx, &GroupOptions::default());
    for r in 0..2 {
        let st = group.link_status(r).unwrap();
        assert_eq!(st.path, Path::Staged, "rank {r}: {st:?}");
        assert!(from_doctor(&st.reason, &path), "rank {r}: {st:?}");
    }
    drop(group);

    // Opted out by option, then by environment: decided as without a doctor.
    let expect = if claims { Path::P2p } else { Path::Staged };
    let link = link_copy(&ctx, 0, 1, &no_doctor);
    assert!(link.path() == expect && !link.status().reason.contains(REASON_PREFIX), "{:?}", link.status());
    println!("opted out by option: {:?}", link.status());
    let group = group_sum(&ctx, &GroupOptions::default().link(no_doctor.clone()));
    assert!(group.link_status(1).is_some_and(|st| st.path == expect && !st.reason.contains(REASON_PREFIX)), "{:?}", group.link_status(1));
    drop(group);
    std::env::set_var(NO_CACHE_ENV, "1");
    let link = link_copy(&ctx, 0, 1, &LinkOptions::default());
    assert!(link.path() == expect && !link.status().reason.contains(REASON_PREFIX), "{:?}", link.status());
    println!("opted out by {NO_CACHE_ENV}=1: {:?}", link.status());
    std::env::remove_var(NO_CACHE_ENV);

    // A cache of another boot is ignored.
    let stale = CacheKey { boot_id: "not-this-boot".into(), ..key.clone() };
    cache(&stale, CachedPath::Staged, None).write(&path).unwrap();
    let link = link_copy(&ctx, 0, 1, &LinkOptions::default());
    assert!(link.path() == expect && !link.status().reason.contains(REASON_PREFIX), "{:?}", link.status());

    if claims {
        // "p2p" skips nothing: P2P, verified, with the doctor's note.
        let fast = SpeedSample { bytes: 64 << 20, p2p_gbs: 300.0, staged_gbs: 20.0 };
        cache(&key, CachedPath::P2p, Some(fast)).write(&path).unwrap();
        let link = link_copy(&ctx, 0, 1, &LinkOptions::default());
        let st = link.status();
        assert_eq!((st.path, st.verified), (Path::P2p, Some(true)), "{st:?}");
        assert!(st.reason.starts_with("P2P, verified; ") && from_doctor(&st.reason, &path), "{st:?}");
        println!("doctor p2p: {}", st.reason);

        // "p2p" but measured slower than staging: the speed rule stages.
        let slow = SpeedSample { bytes: 64 << 20, p2p_gbs: 6.0, staged_gbs: 12.0 };
        cache(&key, CachedPath::P2p, Some(slow)).write(&path).unwrap();
        let link = link_copy(&ctx, 0, 1, &LinkOptions::default());
        let st = link.status();
        assert_eq!(st.path, Path::Staged, "{st:?}");
        assert!(from_doctor(&st.reason, &path) && st.reason.contains("P2P measured slower than staging"), "{st:?}");
        println!("doctor speeds: {}", st.reason);
    }
    std::env::remove_var(CACHE_ENV);
    let _ = std::fs::remove_dir_all(dir);
}
