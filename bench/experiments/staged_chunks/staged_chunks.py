# Experiment, not part of the crate or CI: run on a machine with 2 GPUs and CuPy
# (results: bench/experiments/staged_chunks/result-h200x2.txt, docs/experiments.md).
"""Experiment: where a staged copy GPU0 -> host -> GPU1 (copy engines, no peer
access) spends its time at 16-64 MiB. Every timed sequence is enqueued behind
a kernel that holds GPU0's stream for 200 ms, so Python's enqueue cost drops
out; times are CUDA events on GPU0 (the end joins GPU1's stream back through
one cross-device event wait, whose latency is measured on its own)."""
import sys

import cupy as cp

SPIN = r'''
extern "C" __global__ void spin(long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < (unsigned long long)ns);
}
'''
D2H, H2D = 2, 1
MAXB = 256 << 20
CHUNK = 4 << 20
NBUF_MAX = 8
rt = cp.cuda.runtime

streams, ev = [], []
for d in range(2):
    with cp.cuda.Device(d):
        streams.append(cp.cuda.Stream(non_blocking=True))
with cp.cuda.Device(0):
    spin = cp.RawModule(code=SPIN).get_function("spin")
    src = cp.random.random(MAXB // 4, dtype=cp.float32)
    d2h_done = [cp.cuda.Event(disable_timing=True) for _ in range(NBUF_MAX)]
    t_start, t_end = cp.cuda.Event(), cp.cuda.Event()
    back0 = cp.cuda.Event(disable_timing=True)
with cp.cuda.Device(1):
    dst = cp.empty(MAXB // 4, dtype=cp.float32)
    h2d_done = [cp.cuda.Event(disable_timing=True) for _ in range(NBUF_MAX)]
    start1 = cp.cuda.Event(disable_timing=True)
    back1 = cp.cuda.Event(disable_timing=True)
host = [rt.hostAlloc(64 << 20, 1) for _ in range(NBUF_MAX)]  # portable pinned
used = [False] * NBUF_MAX


def plan(nbytes, chunk, first_div=16):
    """The crate's plan (src/copy/plan.rs): a doubling ramp from chunk/16,
    full chunks, the ramp reversed."""
    ramp, s = [], max(chunk // first_div, 4096)
    while s < chunk:
        ramp.append(s)
        s *= 2
    if nbytes < 2 * sum(ramp) + chunk:
        k = max(1, min(8, -(-nbytes // ramp[0] if ramp else 1)))
        return [nbytes // k] * (k - 1) + [nbytes - (k - 1) * (nbytes // k)]
    mid = nbytes - 2 * sum(ramp)
    k = -(-mid // chunk)
    middle = [mid // k] * (k - 1) + [mid - (k - 1) * (mid // k)]
    return ramp + middle + ramp[::-1]


def uniform(nbytes, chunk):
    k = -(-nbytes // chunk)
    return [min(chunk, nbytes - i * chunk) for i in range(k)]


nxt = [0]


def staged(nbytes, lens, nbuf, start_wait, rotate=False):
    """start_wait: the destination stream's earlier work gates the whole copy
    (the crate until now). rotate: buffers go round-robin across copies too,
    and a buffer's first use in a copy waits only for its own last consumer."""
    s0, s1 = streams
    if start_wait:
        with cp.cuda.Device(1):
            start1.record(s1)
        s0.wait_event(start1)
        for b in range(nbuf):
            used[b] = False
    if not rotate:
        nxt[0] = 0
    off = 0
    for ln in lens:
        b = nxt[0] % nbuf
        nxt[0] += 1
        with cp.cuda.Device(0):
            if used[b]:
                s0.wait_event(h2d_done[b])
            used[b] = True
            rt.memcpyAsync(host[b], src.data.ptr + off, ln, D2H, s0.ptr)
            d2h_done[b].record(s0)
        with cp.cuda.Device(1):
            s1.wait_event(d2h_done[b])
            rt.memcpyAsync(dst.data.ptr + off, host[b], ln, H2D, s1.ptr)
            h2d_done[b].record(s1)
        off += ln
    assert off == nbytes


def timed(label, calls, go, nbytes=None):
    """GPU time per call of `calls` back-to-back `go()`s, enqueued behind a spin."""
    for d in range(2):
        cp.cuda.Device(d).synchronize()
    for b in range(NBUF_MAX):
        used[b] = False
    s0, s1 = streams
    with cp.cuda.Device(0):
        spin((1,), (1,), (cp.int64(200_000_000),), stream=s0)
        t_start.record(s0)
        # GPU1's stream starts behind the spin too.
        back0.record(s0)
    s1.wait_event(back0)
    for _ in range(calls):
        go()
    with cp.cuda.Device(1):
        back1.record(s1)
    with cp.cuda.Device(0):
        s0.wait_event(back1)
        t_end.record(s0)
        t_end.synchronize()
    us = cp.cuda.get_elapsed_time(t_start, t_end) * 1000 / calls
    rate = f"{nbytes / us / 1e3:6.1f} GB/s" if nbytes else ""
    print(f"{label:60s} {us:9.1f} us/call {rate}", flush=True)
    return us


def ping(n):
    s0, s1 = streams
    for _ in range(n):
        with cp.cuda.Device(0):
            back0.record(s0)
        s1.wait_event(back0)
        with cp.cuda.Device(1):
            back1.record(s1)
        s0.wait_event(back1)


def d2h_pieces(nbytes, piece):
    with cp.cuda.Device(0):
        for off in range(0, nbytes, piece):
            rt.memcpyAsync(host[0] + off % (64 << 20), src.data.ptr + off, min(piece, nbytes - off), D2H, streams[0].ptr)


def h2d_pieces(nbytes, piece):
    with cp.cuda.Device(1):
        for off in range(0, nbytes, piece):
            rt.memcpyAsync(dst.data.ptr + off, host[0] + off % (64 << 20), min(piece, nbytes - off), H2D, streams[1].ptr)


def check(nbytes):
    for d in range(2):
        cp.cuda.Device(d).synchronize()
    with cp.cuda.Device(1):
        got = cp.asnumpy(dst[: nbytes // 4])
    with cp.cuda.Device(0):
        want = cp.asnumpy(src[: nbytes // 4])
    return int((got != want).sum())


def ramp_up_only(nbytes, chunk, first_div):
    ramp, s = [], max(chunk // first_div, 4096)
    while s < chunk and sum(ramp) + s < nbytes:
        ramp.append(s)
        s *= 2
    return ramp + uniform(nbytes - sum(ramp), chunk)


print(f"# {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()} x2, no peer access enabled")
timed("cross-device event round trip (2 waits)", 100, lambda: ping(1))
timed("nothing (a round trip: GPU1 joins, then GPU0 waits for it)", 1, lambda: None)
sizes = [int(a) << 20 for a in sys.argv[1:]] or [16 << 20, 64 << 20]
for nb in sizes:
    print(f"## {nb >> 20} MiB")
    if len(sys.argv) == 1:
        for piece in [nb, 4 << 20, 1 << 20, 256 << 10]:
            timed(f"D2H alone in pieces of {piece >> 10} KiB", 4, lambda: d2h_pieces(nb, piece), nb)
            timed(f"H2D alone in pieces of {piece >> 10} KiB", 4, lambda: h2d_pieces(nb, piece), nb)
        timed("D2H and H2D at once, one piece each", 4, lambda: (d2h_pieces(nb, nb), h2d_pieces(nb, nb)), nb)
    configs = [
        ("crate plan 4M ramp/16 x3", plan(nb, CHUNK), 3, True, False),
        ("crate plan 4M ramp/16 x3", plan(nb, CHUNK), 3, False, True),
        ("crate plan 4M ramp/4 x3", plan(nb, CHUNK, 4), 3, False, True),
        ("ramp up only 4M/4 x3", ramp_up_only(nb, CHUNK, 4), 3, False, True),
        ("ramp up only 4M/8 x4", ramp_up_only(nb, CHUNK, 8), 4, False, True),
        ("uniform 1M x4", uniform(nb, 1 << 20), 4, False, True),
        ("uniform 2M x3", uniform(nb, 2 << 20), 3, False, True),
        ("uniform 2M x4", uniform(nb, 2 << 20), 4, False, True),
        ("uniform 4M x3", uniform(nb, 4 << 20), 3, False, True),
        ("uniform 4M x4", uniform(nb, 4 << 20), 4, False, True),
        ("uniform 8M x3", uniform(nb, 8 << 20), 3, False, True),
    ]
    for calls in [1, 10]:
        for name, lens, nbuf, start_wait, rotate in configs:
            for d in range(2):
                cp.cuda.Device(d).synchronize()
            with cp.cuda.Device(1):
                dst[: nb // 4].fill(-1.0)
            how = "start wait" if start_wait else "rotating, no start wait"
            tag = f"staged {name}, {len(lens)} chunks, {calls} call(s), {how}"
            timed(tag, calls, lambda: staged(nb, lens, nbuf, start_wait, rotate), nb)
            print(f"{'':60s} wrong={check(nb)}", flush=True)
    with cp.cuda.Device(1):
        for calls in [1, 10]:
            timed(f"driver cudaMemcpyPeerAsync (no peer access), {calls} call(s)", calls,
                  lambda: rt.memcpyPeerAsync(dst.data.ptr, 1, src.data.ptr, 0, nb, streams[1].ptr), nb)
