//! What the host pays per driver call while enqueueing a collective: each
//! call of a small all-reduce's enqueue path timed on its own, on the first
//! two GPUs (mean of many calls, the streams drained between batches so no
//! queue fills); the pair of launches also from two host threads, one per
//! GPU. Then a 4 KiB all-reduce enqueue with cudarc's event tracking on and
//! off, and without the group's launcher threads (each checked once after
//! its timed calls). The first group's
//! first call JIT-compiles its kernels unless the driver's cache has them;
//! a warm-up call keeps that out of the timing. A diagnostic for
//! `bench/NOTES.md`, not a test.
//!
//!     cargo run --release -p cuda-peer-bench -- enqueue-costs [--calls N]

use crate::cli::EnqueueArgs;
use crate::exit::Res;
use cuda_peer::cudarc::driver::{result, CudaContext, CudaStream, LaunchConfig, PushKernelArg};
use cuda_peer::{driver, Group, GroupOptions, ReduceOp};
use std::sync::Arc;
use std::time::Instant;

/// An empty kernel, as PTX any GPU from sm_70 on can JIT.
const NOOP_PTX: &str = ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry noop(.param .u64 p)\n{\n\tret;\n}\n";

const BATCH: usize = 100;

/// Mean microseconds of `f()` over `calls` calls; `drain` runs untimed after every batch.
fn time(calls: usize, mut f: impl FnMut() -> Res<()>, mut drain: impl FnMut() -> Res<()>) -> Res<f64> {
    let mut total = 0.0;
    let mut done = 0;
    while done < calls {
        let n = BATCH.min(calls - done);
        let t = Instant::now();
        for _ in 0..n {
            f()?;
        }
        total += t.elapsed().as_secs_f64();
        drain()?;
        done += n;
    }
    Ok(total * 1e6 / calls as f64)
}

/// The default group options, without launcher threads unless `launchers`
/// (fields set one by one: no struct literal, so this builds when the
/// options struct is `#[non_exhaustive]`).
fn group_options(launchers: bool) -> GroupOptions {
    let mut opts = GroupOptions::default();
    if !launchers {
        opts.launch_spin = None;
    }
    opts
}

/// Measures and prints every row (the caller has checked for two GPUs).
pub(crate) fn run(args: &EnqueueArgs) -> Res<()> {
    let ctxs: Vec<Arc<CudaContext>> = (0..2).map(driver::context).collect::<Result<_, _>>()?;
    let streams: Vec<Arc<CudaStream>> = ctxs.iter().map(|c| c.new_stream()).collect::<Result<_, _>>()?;
    let funcs =
        ctxs.iter().map(|c| Ok(c.load_module(cuda_peer::cudarc::nvrtc::Ptx::from_src(NOOP_PTX))?.load_function("noop")?)).collect::<Res<Vec<_>>>()?;
    let events = ctxs.iter().map(|c| c.new_event(None)).collect::<Result<Vec<_>, _>>()?;
    let drain = || -> Res<()> {
        for s in &streams {
            s.synchronize()?;
        }
        Ok(())
    };
    let raw = |c: &Arc<CudaContext>| c.cu_ctx();
    let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 };
    let arg = 0u64;
    let launch = |r: usize| -> Res<()> {
        let mut l = streams[r].launch_builder(&funcs[r]);
        l.arg(&arg);
        // SAFETY: `noop` takes one u64 and touches no memory.
        unsafe { l.launch(cfg) }?;
        Ok(())
    };
    let n = args.calls;
    let mut rows: Vec<(&str, f64)> = Vec::new();
    ctxs[0].bind_to_thread()?;
    rows.push(("cuCtxGetCurrent", time(n, || Ok(result::ctx::get_current().map(|_| ())?), || Ok(()))?));
    let mut k = 0usize;
    rows.push((
        "cuCtxSetCurrent, alternating GPUs",
        time(
            n,
            || {
                k += 1;
                // SAFETY: both contexts are alive (held in `ctxs`).
                Ok(unsafe { result::ctx::set_current(raw(&ctxs[k % 2])) }?)
            },
            || Ok(()),
        )?,
    ));
    ctxs[0].bind_to_thread()?;
    rows.push(("cuStreamIsCapturing", time(n, || Ok(streams[0].capture_status().map(|_| ())?), || Ok(()))?));
    rows.push(("cuEventRecord", time(n, || Ok(events[0].record(&streams[0])?), drain)?));
    rows.push(("cuStreamWaitEvent, same GPU", time(n, || Ok(streams[0].wait(&events[0])?), drain)?));
    events[1].record(&streams[1])?;
    ctxs[0].bind_to_thread()?;
    rows.push(("cuStreamWaitEvent, other GPU's event", time(n, || Ok(streams[0].wait(&events[1])?), drain)?));
    rows.push(("cuLaunchKernel (cudarc builder), one GPU", time(n, || launch(0), drain)?));
    rows.push((
        "cuLaunchKernel, both GPUs (per pair)",
        time(
            n,
            || {
                launch(1)?;
                launch(0)
            },
            drain,
        )?,
    ));
    let raw_launch = |r: usize| -> Res<()> {
        let mut p = [&arg as *const u64 as *mut std::ffi::c_void];
        // SAFETY: `noop` takes one u64 (p points at `arg`, alive here) and
        // touches no memory; the function belongs to rank r's context.
        unsafe {
            result::launch_kernel(funcs[r].cu_function(), (1, 1, 1), (32, 1, 1), 0, streams[r].cu_stream(), &mut p)?;
        }
        Ok(())
    };
    ctxs[0].bind_to_thread()?;
    rows.push(("cuLaunchKernel (raw), one GPU", time(n, || raw_launch(0), drain)?));
    rows.push((
        "cuLaunchKernel (raw) + cuCtxSetCurrent, both GPUs (per pair)",
        time(
            n,
            || {
                for r in [1, 0] {
                    // SAFETY: the context is alive (held in `ctxs`).
                    unsafe { result::ctx::set_current(raw(&ctxs[r])) }?;
                    raw_launch(r)?;
                }
                Ok(())
            },
            drain,
        )?,
    ));

    // The same pair with rank 1's launch on a second host thread that spins
    // on a counter: whether the driver runs launches on two GPUs in parallel.
    {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        let (go, done, stop) = (AtomicUsize::new(0), AtomicUsize::new(0), AtomicBool::new(false));
        let worker_err = std::thread::scope(|s| -> Res<Option<String>> {
            let h = s.spawn(|| -> Option<String> {
                if let Err(e) = ctxs[1].bind_to_thread() {
                    return Some(e.to_string());
                }
                let mut seen = 0;
                while !stop.load(Ordering::Acquire) {
                    let g = go.load(Ordering::Acquire);
                    if g == seen {
                        std::hint::spin_loop();
                        continue;
                    }
                    seen = g;
                    if let Err(e) = launch(1) {
                        done.store(usize::MAX, Ordering::Release);
                        return Some(e.to_string());
                    }
                    done.store(g, Ordering::Release);
                }
                None
            });
            ctxs[0].bind_to_thread()?;
            let mut k = 0usize;
            let t = time(
                n,
                || {
                    k += 1;
                    go.store(k, Ordering::Release);
                    launch(0)?;
                    loop {
                        match done.load(Ordering::Acquire) {
                            d if d == k => return Ok(()),
                            usize::MAX => return Err("worker failed".into()),
                            _ => std::hint::spin_loop(),
                        }
                    }
                },
                drain,
            );
            stop.store(true, Ordering::Release);
            let e = h.join().map_err(|_| "worker panicked")?;
            rows.push(("cuLaunchKernel, both GPUs, one host thread each (per pair)", t?));
            Ok(e)
        })?;
        if let Some(e) = worker_err {
            return Err(e.into());
        }
    }

    // A 4 KiB all-reduce (Auto: the one-shot) with event tracking on, then
    // off, with launcher threads; then on, without them.
    for (tracking, launchers) in [(true, true), (false, true), (true, false)] {
        for c in &ctxs {
            // SAFETY: no slice of these contexts is alive across the switch:
            // the buffers below are made after it and dropped before the next.
            unsafe {
                if tracking {
                    c.enable_event_tracking();
                } else {
                    c.disable_event_tracking();
                }
            }
        }
        let group = Group::new(streams.clone(), &group_options(launchers))?;
        let mut bufs = streams.iter().map(|s| s.clone_htod(&vec![1.0f32; 1024])).collect::<Result<Vec<_>, _>>()?;
        group.all_reduce_in_place(&mut bufs, ReduceOp::Sum)?; // warm-up: loads the kernels
        group.synchronize()?;
        let label = match (tracking, launchers) {
            (true, true) => "4 KiB all_reduce_in_place, event tracking on",
            (false, true) => "4 KiB all_reduce_in_place, event tracking off",
            _ => "4 KiB all_reduce_in_place, event tracking on, no launcher threads",
        };
        rows.push((label, time(n, || Ok(group.all_reduce_in_place(&mut bufs, ReduceOp::Sum)?), || Ok(group.synchronize()?))?));
        // One more call on fresh values, checked, so a broken enqueue path
        // cannot pass for a fast one.
        let vals = |r: usize| (0..1024).map(|i| ((i * 7 + r * 3) % 101) as f32).collect::<Vec<f32>>();
        for (r, b) in bufs.iter_mut().enumerate() {
            streams[r].memcpy_htod(&vals(r), b)?;
        }
        group.all_reduce_in_place(&mut bufs, ReduceOp::Sum)?;
        let got = streams[0].clone_dtoh(&bufs[0])?;
        let want: Vec<f32> = vals(0).iter().zip(vals(1)).map(|(a, b)| a + b).collect();
        drop(bufs);
        group.synchronize()?;
        if got != want {
            return Err(format!("{label}: wrong result after the timed calls").into());
        }
    }
    // Steady state: 4 KiB all-reduces back to back with the GPUs running,
    // with and without launcher threads, alternating (this host's speed
    // drifts within a process): host time of the loop, and wall time until
    // both GPUs are done, per call.
    for c in &ctxs {
        // SAFETY: no slice of these contexts is alive here (the last loop's dropped).
        unsafe { c.enable_event_tracking() };
    }
    let groups = [true, false].iter().map(|&l| Group::new(streams.clone(), &group_options(l))).collect::<Result<Vec<_>, _>>()?;
    let mut bufs = streams.iter().map(|s| s.clone_htod(&vec![1.0f32; 1024])).collect::<Result<Vec<_>, _>>()?;
    let mut steady = Vec::new();
    for rep in 0..5 {
        for (g, group) in groups.iter().enumerate() {
            for _ in 0..20 {
                group.all_reduce_in_place(&mut bufs, ReduceOp::Sum)?;
            }
            group.synchronize()?;
            let t = Instant::now();
            for _ in 0..2000 {
                group.all_reduce_in_place(&mut bufs, ReduceOp::Sum)?;
            }
            let host = t.elapsed().as_secs_f64();
            group.synchronize()?;
            let wall = t.elapsed().as_secs_f64();
            steady.push(format!(
                "{:8.3} {:8.3}  rep {rep}, {}",
                host * 1e6 / 2000.0,
                wall * 1e6 / 2000.0,
                if g == 0 { "launcher threads" } else { "no launcher threads" }
            ));
        }
    }
    println!("# 4 KiB all_reduce_in_place, 2000 back to back: host us per call, wall us per call (until both GPUs finish)");
    for l in steady {
        println!("{l}");
    }
    println!("# host microseconds per call, mean of {n} calls (batches of {BATCH}, drained between), GPUs 0 and 1");
    for (what, us) in rows {
        println!("{us:8.3}  {what}");
    }
    Ok(())
}
