//! Tests of the doctor's verdicts.
//!
//! CPU tests of the cache file (run everywhere): a save never writes
//! through a symlink, a FIFO, a directory or an oversized file at the cache
//! path is refused without blocking, and the file round-trips through the
//! library's reader, including a file the earlier hand-written writer
//! produced. They name their paths explicitly and read no environment
//! variable.
//!
//! A GPU test: a cache written for this machine's real key decides `Auto`
//! links, groups and per-rank communicators, says so in their `LinkStatus` (a communicator's `path_reason`), and is ignored when
//! opted out or when its key does not match. It needs a pair of devices
//! and skips without two GPUs, saying so in a `SKIPPED` line (fails instead with CUDA_PEER_REQUIRE_GPU=1
//! where there is no GPU at all), and says which cases it left out where
//! the driver claims no P2P. It is the one test here
//! that sets process environment variables (`CUDA_PEER_DOCTOR_CACHE`,
//! `CUDA_PEER_NO_DOCTOR_CACHE`), so no other test in this binary may read
//! them.

mod common;

use common::{diff, gpus, random_bytes};
use cuda_peer::comm::Engine;
use cuda_peer::cudarc::driver::CudaContext;
use cuda_peer::verdict::{Cache, CacheError, CacheKey, CachedPair, CachedPath, SpeedSample, CACHE_ENV, MAX_CACHE_BYTES, NO_CACHE_ENV, REASON_PREFIX};
use cuda_peer::{Comm, CommOptions, Group, GroupOptions, Link, LinkOptions, Path, ReduceOp};
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

/// Two per-rank communicators (threads) on devices 0 and 1 under `opts`,
/// after a sum all-reduce of random u32 data checked exactly against the
/// CPU's wrapping sum on both ranks.
fn per_rank_sum(ctx: &[Arc<CudaContext>], opts: &CommOptions) -> Vec<Comm> {
    let streams = vec![ctx[0].new_stream().unwrap(), ctx[1].new_stream().unwrap()];
    let comms = Comm::from_devices_with(streams, opts).expect("per-rank communicators");
    let n = 100_003;
    let mut rng = rand::rng();
    let host: Vec<Vec<u32>> = (0..2).map(|_| (0..n).map(|_| rng.random()).collect()).collect();
    let want: Vec<u32> = (0..n).map(|i| host[0][i].wrapping_add(host[1][i])).collect();
    std::thread::scope(|s| {
        for (r, (c, h)) in comms.iter().zip(&host).enumerate() {
            let want = &want;
            s.spawn(move || {
                let mut buf = c.stream().clone_htod(h).unwrap();
                c.all_reduce_in_place(&mut buf, ReduceOp::Sum).expect("per-rank all-reduce");
                let got = c.stream().clone_dtoh(&buf).unwrap();
                assert!(diff(want, &got).is_none(), "per-rank rank {r}: first wrong/count {:?}", diff(want, &got));
            });
        }
    });
    comms
}

fn from_doctor(reason: &str, path: &std::path::Path) -> bool {
    reason.contains(&format!("{REASON_PREFIX} (cache {})", path.display()))
}

#[test]
fn auto_links_and_groups_follow_the_doctors_verdicts() {
    let test = "auto_links_and_groups_follow_the_doctors_verdicts";
    let Some(ctx) = gpus(test, 1) else { return };
    // The doctor's verdicts are for pairs of devices; a pair on one device is local.
    if !common::has_gpus(test, "the doctor's verdicts for the pair of devices 0 and 1", ctx.len(), 2) {
        return;
    }
    let key = CacheKey::current().expect("this machine's cache key");
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("doctor.json");
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
    // The per-rank communicator decides its pairs the same way.
    let comms = per_rank_sum(&ctx, &CommOptions::default());
    for (r, c) in comms.iter().enumerate() {
        let why = c.path_reason().unwrap_or_default();
        assert!(c.engine() == Engine::Host(Path::Staged) && from_doctor(why, &path), "per-rank, rank {r}: {:?}: {why}", c.engine());
    }
    println!("doctor staged the per-rank communicator: {}", comms[0].path_reason().unwrap_or_default());
    drop(comms);

    // Opted out by option, then by environment: decided as without a doctor.
    let expect = if claims { Path::P2p } else { Path::Staged };
    let link = link_copy(&ctx, 0, 1, &no_doctor);
    assert!(link.path() == expect && !link.status().reason.contains(REASON_PREFIX), "{:?}", link.status());
    println!("opted out by option: {:?}", link.status());
    let group = group_sum(&ctx, &GroupOptions::default().link(no_doctor.clone()));
    assert!(group.link_status(1).is_some_and(|st| st.path == expect && !st.reason.contains(REASON_PREFIX)), "{:?}", group.link_status(1));
    drop(group);
    for (r, c) in per_rank_sum(&ctx, &CommOptions::default().use_doctor_verdicts(false)).iter().enumerate() {
        let why = c.path_reason().unwrap_or_default();
        assert!(c.engine() == Engine::Host(expect) && !why.contains(REASON_PREFIX), "per-rank opted out, rank {r}: {:?}: {why}", c.engine());
    }
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
    } else {
        common::skipped(test, "the \"p2p\" verdicts (P2P verified, and staged by the speed rule): the driver claims no P2P between devices 0 and 1");
    }
    std::env::remove_var(CACHE_ENV);
}

// ---- CPU tests of the cache file ----

/// A key that is no machine's, for the file tests.
fn file_key() -> CacheKey {
    CacheKey { driver_version: "580.95.05".into(), boot_id: "b0".into(), bus_ids: vec!["0000:19:00.0".into(), "0000:3b:00.0".into()] }
}

/// A cache of two pairs (one with speeds) whose summary says `note`.
fn file_cache(note: &str) -> Cache {
    let speed = SpeedSample { bytes: 64 << 20, p2p_gbs: 368.25, staged_gbs: 25.1 };
    let pairs = vec![
        CachedPair { from: "0000:19:00.0".into(), to: "0000:3b:00.0".into(), path: CachedPath::P2p, summary: note.into(), speed: Some(speed) },
        CachedPair { from: "0000:3b:00.0".into(), to: "0000:19:00.0".into(), path: CachedPath::Unusable, summary: "corrupt".into(), speed: None },
    ];
    Cache::new(file_key(), pairs)
}

/// Runs `f` on another thread; fails the test where it takes more than 5 s.
fn within_5s<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(5)).unwrap_or_else(|_| panic!("{what} took more than 5 s"))
}

/// A save replaces a symlink at the cache path and writes through none of
/// the symlinks planted at the names a writer could pick: the cache path
/// itself, the `<path>.json.<pid>.tmp` names a predictable writer used (for
/// this process's id and its neighbours), and the new writer's name without
/// its random characters. Its own names are random and created exclusively
/// (the unit tests of `verdict` force a taken name). Every victim keeps its
/// contents, and the cache path ends a regular file holding the new cache.
#[cfg(unix)]
#[test]
fn a_save_never_writes_through_a_symlink() {
    let dir = tempfile::tempdir().unwrap();
    let victims = tempfile::tempdir().unwrap();
    let path = dir.path().join("doctor.json");
    let pid = std::process::id();
    let mut names: Vec<std::path::PathBuf> = vec![path.clone(), dir.path().join(".doctor.json..tmp")];
    for p in pid.saturating_sub(8)..=pid.saturating_add(8) {
        names.push(path.with_extension(format!("json.{p}.tmp")));
        names.push(dir.path().join(format!("doctor.json.{p}.tmp")));
        names.push(dir.path().join(format!(".doctor.json.{p}.tmp")));
    }
    names.sort();
    names.dedup();
    let mut planted = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let victim = victims.path().join(format!("victim-{i}"));
        std::fs::write(&victim, format!("victim {i}, not to be changed\n")).unwrap();
        std::os::unix::fs::symlink(&victim, name).unwrap();
        planted.push((name.clone(), victim));
    }
    for note in ["first save", "second save, over the first"] {
        let c = file_cache(note);
        c.write(&path).expect("save");
        for (i, (name, victim)) in planted.iter().enumerate() {
            assert_eq!(std::fs::read_to_string(victim).unwrap(), format!("victim {i}, not to be changed\n"), "written through {}", name.display());
            if *name != path {
                assert_eq!(std::fs::read_link(name).unwrap(), *victim, "{} was replaced", name.display());
            }
        }
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert!(meta.file_type().is_file(), "the cache path is a regular file after a save: {:?}", meta.file_type());
        assert_eq!(Cache::read(&path).unwrap(), c, "the cache path holds the new cache");
        use std::os::unix::fs::PermissionsExt;
        let mode = meta.permissions().mode() & 0o777;
        assert!(mode & 0o600 == 0o600 && mode & 0o022 == 0, "mode {mode:o}");
        // Nothing of the writer's is left beside the cache.
        let mut left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().path()).collect();
        left.sort();
        assert_eq!(left, names, "the directory holds the cache and the planted symlinks only");
    }
}

/// A FIFO at the cache path: the load returns at once with an error
/// instead of waiting for a writer.
#[cfg(target_os = "linux")]
#[test]
fn a_fifo_at_the_cache_path_is_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("doctor.json");
    rustix::fs::mkfifoat(rustix::fs::CWD, &path, rustix::fs::Mode::RUSR | rustix::fs::Mode::WUSR).unwrap();
    let at = path.clone();
    let got = within_5s("loading a FIFO", move || Cache::read(&at));
    assert!(matches!(&got, Err(CacheError::NotRegularFile { kind: "a FIFO", .. })), "{got:?}");
    // A save replaces the FIFO with the cache.
    let c = file_cache("over a FIFO");
    let at = path.clone();
    let saved = c.clone();
    within_5s("saving over a FIFO", move || saved.write(&at)).unwrap();
    assert!(std::fs::symlink_metadata(&path).unwrap().file_type().is_file());
    assert_eq!(Cache::read(&path).unwrap(), c);
}

/// A directory at the cache path: neither read nor replaced.
#[test]
fn a_directory_at_the_cache_path_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("doctor.json");
    std::fs::create_dir(&path).unwrap();
    std::fs::write(path.join("inside"), "kept").unwrap();
    let got = Cache::read(&path);
    assert!(matches!(&got, Err(CacheError::NotRegularFile { kind: "a directory", .. })), "{got:?}");
    let got = file_cache("over a directory").write(&path);
    assert!(matches!(&got, Err(CacheError::NotRegularFile { kind: "a directory", .. })), "{got:?}");
    assert_eq!(std::fs::read_to_string(path.join("inside")).unwrap(), "kept");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "no file of the writer's left beside it");
}

/// A cache file of more than [`MAX_CACHE_BYTES`] is refused, even where it
/// is valid JSON (a real cache padded with spaces); one of exactly the
/// limit reads.
#[test]
fn an_oversized_cache_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("doctor.json");
    let c = file_cache("padded");
    let text = c.to_json().unwrap();
    let limit = usize::try_from(MAX_CACHE_BYTES).unwrap();
    let padded = |n: usize| format!("{text}{}", " ".repeat(n - text.len()));
    std::fs::write(&path, padded(limit)).unwrap();
    assert_eq!(Cache::read(&path).unwrap(), c, "a file of exactly the limit reads");
    std::fs::write(&path, padded(limit + 1)).unwrap();
    let got = Cache::read(&path);
    assert!(matches!(&got, Err(CacheError::TooLarge { limit: MAX_CACHE_BYTES, .. })), "{got:?}");
    std::fs::write(&path, padded(64 << 20)).unwrap();
    assert!(matches!(Cache::read(&path), Err(CacheError::TooLarge { .. })));
    // Nor is a cache that large written: the file there stays.
    std::fs::write(&path, "old").unwrap();
    let huge = file_cache(&"x".repeat(limit));
    assert!(matches!(huge.write(&path), Err(CacheError::TooLarge { .. })));
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "old");
}

/// A file exactly as the earlier, hand-written writer laid it out (integer
/// bandwidths, a `null` for a bandwidth that was not finite, a pair
/// without speeds).
const OLD_WRITERS_FILE: &str = r#"{
  "version": 1,
  "key": {"driver_version": "580.95.05", "boot_id": "6a1c2f0e-1d2b-4c8e-9f3a-0b1c2d3e4f50", "bus_ids": ["0000:19:00.0", "0000:3b:00.0"]},
  "written_at": 1767225600,
  "pairs": [
    {"from": "0000:19:00.0", "to": "0000:3b:00.0", "path": "p2p", "summary": "P2P verified both ways; \"fast\"\tand é", "bytes": 67108864, "p2p_gbs": 368.25, "staged_gbs": 25.1},
    {"from": "0000:3b:00.0", "to": "0000:19:00.0", "path": "staged", "summary": "P2P measured slower\nthan staging", "bytes": 67108864, "p2p_gbs": null, "staged_gbs": 12},
    {"from": "0000:19:00.0", "to": "0000:5d:00.0", "path": "none", "summary": "peer writes corrupt"}
  ]
}
"#;

#[test]
fn the_cache_round_trips_and_reads_the_old_writers_files() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sub").join("doctor.json");
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, OLD_WRITERS_FILE).unwrap();
    let old = Cache::read(&path).expect("the old writer's file reads");
    assert_eq!((old.version, old.written_at), (1, 1767225600));
    assert_eq!(old.key.boot_id, "6a1c2f0e-1d2b-4c8e-9f3a-0b1c2d3e4f50");
    assert_eq!(old.key.bus_ids, ["0000:19:00.0", "0000:3b:00.0"]);
    let paths: Vec<CachedPath> = old.pairs.iter().map(|p| p.path).collect();
    assert_eq!(paths, [CachedPath::P2p, CachedPath::Staged, CachedPath::Unusable]);
    assert_eq!(old.pairs[0].summary, "P2P verified both ways; \"fast\"\tand é");
    assert_eq!(old.pairs[0].speed, Some(SpeedSample { bytes: 64 << 20, p2p_gbs: 368.25, staged_gbs: 25.1 }));
    assert_eq!(old.pairs[1].summary, "P2P measured slower\nthan staging");
    assert_eq!(old.pairs[1].speed, None, "a null bandwidth: no sample");
    assert_eq!(old.pairs[2].speed, None);

    // Saved again and read back: the same cache.
    old.write(&path).unwrap();
    assert_eq!(Cache::read(&path).unwrap(), old);
    let c = file_cache("new");
    c.write(&path).unwrap();
    assert_eq!(Cache::read(&path).unwrap(), c);
    // A bandwidth that is not finite is written as null and reads as no sample.
    let mut nan = file_cache("nan");
    nan.pairs[0].speed = Some(SpeedSample { bytes: 64 << 20, p2p_gbs: f64::NAN, staged_gbs: 3.0 });
    nan.write(&path).unwrap();
    assert!(std::fs::read_to_string(&path).unwrap().contains("null"));
    assert_eq!(Cache::read(&path).unwrap().pairs[0].speed, None);
    // Malformed text is a format error naming the file.
    std::fs::write(&path, &OLD_WRITERS_FILE[..OLD_WRITERS_FILE.len() / 2]).unwrap();
    let got = Cache::read(&path);
    assert!(matches!(&got, Err(CacheError::Format { path: p, .. }) if *p == path), "{got:?}");
}
