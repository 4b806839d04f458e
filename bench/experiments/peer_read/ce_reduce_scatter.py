# Experiment, not part of the crate or CI: run on a machine with 2 GPUs, CuPy and P2P
# (results: bench/experiments/peer_read/result-h200x2.txt, docs/experiments.md).
"""Experiment: the reduce-scatter step of a 2-rank all-reduce by copy engine.
Each GPU pulls the peer's half chunk by chunk into one of two scratch slots
(cudaMemcpyPeerAsync on a copy stream) while a local kernel reduces the
previous chunk (dst = scratch + own) on a second stream. Both GPUs at once.
All work is enqueued behind a spin kernel so Python's host speed does not
matter; the time is between events on the GPU."""
import sys

import cupy as cp

SRC = r'''
typedef unsigned long long u64;
extern "C" __global__ void add(float4* dst, const float4* a, const float4* b, u64 n) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
    float4 x = a[i], y = b[i];
    x.x += y.x; x.y += y.y; x.z += y.z; x.w += y.w;
    dst[i] = x;
  }
}
extern "C" __global__ void lsu(float4* dst, const float4* peer, const float4* own, u64 n) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
    float4 a = peer[i], b = own[i];
    a.x += b.x; a.y += b.y; a.z += b.z; a.w += b.w;
    dst[i] = a;
  }
}
extern "C" __global__ void spin(u64 ns) {
  u64 t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
'''

BYTES = int(sys.argv[1]) if len(sys.argv) > 1 else 512 << 20
F = BYTES // 4

mods, bufs, cs, rs = [], [], [], []
for d in range(2):
    with cp.cuda.Device(d):
        cp.cuda.runtime.deviceEnablePeerAccess(1 - d)
        mods.append(cp.RawModule(code=SRC))
        bufs.append((cp.random.random(F, dtype=cp.float32), cp.random.random(F, dtype=cp.float32), cp.empty(F, dtype=cp.float32)))
        cs.append(cp.cuda.Stream(non_blocking=True))
        rs.append(cp.cuda.Stream(non_blocking=True))


def check(label, ms):
    bad = 0
    for d in range(2):
        with cp.cuda.Device(d):
            want = cp.asnumpy(bufs[1 - d][0][::4099]) + cp.asnumpy(bufs[d][1][::4099])
            bad += int((cp.asnumpy(bufs[d][2][::4099]) != want).sum())
    print(f"{label:44s} {BYTES / ms / 1e6:7.1f} GB/s per GPU ({ms * 1e3:8.1f} us)  wrong(sampled)={bad}", flush=True)


def measure(label, enqueue):
    best = 1e9
    for _ in range(4):
        starts, ends = [], []
        for d in range(2):
            with cp.cuda.Device(d):
                bufs[d][2].fill(-1.0)
                cp.cuda.Device(d).synchronize()
        for d in range(2):
            with cp.cuda.Device(d):
                for s in (cs[d], rs[d]):
                    mods[d].get_function("spin")((1,), (1,), (cp.uint64(30_000_000),), stream=s)
                e0 = cp.cuda.Event()
                e0.record(rs[d])
                cs[d].wait_event(e0)
                starts.append(e0)
        enqueue()
        for d in range(2):
            with cp.cuda.Device(d):
                e1 = cp.cuda.Event()
                rs[d].wait_event(cs[d].record())
                e1.record(rs[d])
                ends.append(e1)
        for d in range(2):
            with cp.cuda.Device(d):
                ends[d].synchronize()
        ms = max(cp.cuda.get_elapsed_time(starts[d], ends[d]) for d in range(2))
        best = min(best, ms)
    check(label, best)


def lsu_all():
    for d in range(2):
        with cp.cuda.Device(d):
            mods[d].get_function("lsu")((528,), (256,), (bufs[d][2], bufs[1 - d][0], bufs[d][1], cp.uint64(F // 4)), stream=rs[d])


def ce_pipeline(chunk, slots=2, grid=528):
    scratch = []
    for d in range(2):
        with cp.cuda.Device(d):
            scratch.append([cp.empty(chunk // 4, dtype=cp.float32) for _ in range(slots)])

    def go():
        nchunks = BYTES // chunk
        red_done = [[None] * slots for _ in range(2)]
        for c in range(nchunks):
            for d in range(2):
                with cp.cuda.Device(d):
                    s = c % slots
                    if red_done[d][s] is not None:
                        cs[d].wait_event(red_done[d][s])
                    off = c * chunk
                    cp.cuda.runtime.memcpyPeerAsync(scratch[d][s].data.ptr, d, bufs[1 - d][0].data.ptr + off, 1 - d, chunk, cs[d].ptr)
                    copied = cs[d].record()
                    rs[d].wait_event(copied)
                    n4 = chunk // 16
                    mods[d].get_function("add")((grid,), (256,), (cp.uint64(bufs[d][2].data.ptr + off), scratch[d][s], cp.uint64(bufs[d][1].data.ptr + off), cp.uint64(n4)), stream=rs[d])
                    red_done[d][s] = rs[d].record()
    return go


def ce_only():
    for d in range(2):
        with cp.cuda.Device(d):
            cp.cuda.runtime.memcpyPeerAsync(bufs[d][2].data.ptr, d, bufs[1 - d][0].data.ptr, 1 - d, BYTES, cs[d].ptr)


print(f"# {BYTES >> 20} MiB of the peer's half reduced into each GPU, both at once; {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
measure("lsu peer loads (ring's way), 528 blocks", lsu_all)
for chunk, slots in [(4 << 20, 2), (8 << 20, 2), (16 << 20, 2), (32 << 20, 2), (16 << 20, 3), (64 << 20, 2)]:
    if chunk <= BYTES:
        measure(f"CE into scratch + local add, {chunk >> 20} MiB x {slots}", ce_pipeline(chunk, slots))
measure("CE into scratch + local add, 16 MiB x 2, 132 blocks", ce_pipeline(16 << 20, 2, 132))
measure("lsu peer loads again", lsu_all)
