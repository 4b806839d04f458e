# Experiment, not part of the crate or CI: run on a machine with 2 GPUs and CuPy
# (results: bench/experiments/zero_copy_staged/result-h200x2.txt, docs/experiments.md).
# Known flaw: a slot that does not split evenly over the blocks (132 blocks, 4 MiB) leaves
# each slot's last elements uncopied, hence the nonzero wrong counts of that one layout.
"""Experiment: a one-way copy GPU0 -> GPU1 without peer access, driven by
SMs through mapped pinned host memory: a kernel on GPU0 stores rounds into
host slots and raises per-block flags (release, system scope); a kernel on
GPU1 waits for them (acquire), copies the slot into its buffer and frees it.
Against the driver's own cudaMemcpyPeerAsync without peer access."""
import ctypes
import sys
import time

import cupy as cp

SRC = r'''
typedef unsigned long long u64;
static __device__ __forceinline__ unsigned ld_acq(const unsigned* p) {
  unsigned v; asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
static __device__ __forceinline__ void st_rel(unsigned* p, unsigned v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
// Round g uses slot g % nslots; block b owns stripe b of it.
extern "C" __global__ void produce(const float4* src, float4* slots, unsigned* ready, const unsigned* freef,
                                   u64 n4, u64 slot4, int nslots, unsigned base) {
  const u64 per = slot4 / gridDim.x;
  const u64 rounds = (n4 + slot4 - 1) / slot4;
  for (u64 k = 0; k < rounds; ++k) {
    const unsigned g = base + (unsigned)k;
    const int s = g % nslots;
    if (threadIdx.x == 0 && g >= (unsigned)nslots) {
      while (ld_acq(freef + s * gridDim.x + blockIdx.x) < g - nslots + 1) {}
    }
    __syncthreads();
    const u64 off = k * slot4 + blockIdx.x * per;
    const u64 len = off < n4 ? (n4 - off < per ? n4 - off : per) : 0;
    float4* d = slots + (u64)s * slot4 + blockIdx.x * per;
    for (u64 i = threadIdx.x; i < len; i += blockDim.x) d[i] = src[off + i];
    __syncthreads();
    if (threadIdx.x == 0) st_rel(ready + s * gridDim.x + blockIdx.x, g + 1);
  }
}
extern "C" __global__ void consume(float4* dst, const float4* slots, const unsigned* ready, unsigned* freef,
                                   u64 n4, u64 slot4, int nslots, unsigned base) {
  const u64 per = slot4 / gridDim.x;
  const u64 rounds = (n4 + slot4 - 1) / slot4;
  for (u64 k = 0; k < rounds; ++k) {
    const unsigned g = base + (unsigned)k;
    const int s = g % nslots;
    if (threadIdx.x == 0) {
      while (ld_acq(ready + s * gridDim.x + blockIdx.x) < g + 1) {}
    }
    __syncthreads();
    const u64 off = k * slot4 + blockIdx.x * per;
    const u64 len = off < n4 ? (n4 - off < per ? n4 - off : per) : 0;
    const float4* sp = slots + (u64)s * slot4 + blockIdx.x * per;
    for (u64 i = threadIdx.x; i < len; i += blockDim.x) dst[off + i] = sp[i];
    __syncthreads();
    if (threadIdx.x == 0) st_rel(freef + s * gridDim.x + blockIdx.x, g + 1);
  }
}
'''

MAXB = 1 << 30
mods, streams = [], []
for d in range(2):
    with cp.cuda.Device(d):
        mods.append(cp.RawModule(code=SRC))
        streams.append(cp.cuda.Stream(non_blocking=True))
with cp.cuda.Device(0):
    src = cp.random.random(MAXB // 4, dtype=cp.float32)
with cp.cuda.Device(1):
    dst = cp.empty(MAXB // 4, dtype=cp.float32)

HOST = 64 << 20
FLAGS = 64 * 1024
hptr = cp.cuda.runtime.hostAlloc(HOST + 2 * FLAGS, 3)  # portable | mapped
ctypes.memset(hptr, 0, HOST + 2 * FLAGS)
slots_p, ready_p, free_p = hptr, hptr + HOST, hptr + HOST + FLAGS
base = [0]


def zc(nbytes, blocks, slot, nslots, threads=512):
    n4, slot4 = nbytes // 16, slot // 16
    rounds = (n4 + slot4 - 1) // slot4
    b = base[0]
    with cp.cuda.Device(1):
        mods[1].get_function("consume")((blocks,), (threads,), (dst, cp.uint64(slots_p), cp.uint64(ready_p), cp.uint64(free_p),
                                                                cp.uint64(n4), cp.uint64(slot4), cp.int32(nslots), cp.uint32(b)), stream=streams[1])
    with cp.cuda.Device(0):
        mods[0].get_function("produce")((blocks,), (threads,), (src, cp.uint64(slots_p), cp.uint64(ready_p), cp.uint64(free_p),
                                                                cp.uint64(n4), cp.uint64(slot4), cp.int32(nslots), cp.uint32(b)), stream=streams[0])
    base[0] += rounds


def driver(nbytes):
    with cp.cuda.Device(1):
        cp.cuda.runtime.memcpyPeerAsync(dst.data.ptr, 1, src.data.ptr, 0, nbytes, streams[1].ptr)


def measure(label, nbytes, go, reps=8):
    best = 1e9
    for _ in range(reps):
        with cp.cuda.Device(1):
            dst[: nbytes // 4].fill(-1.0)
            cp.cuda.Device(1).synchronize()
        # A new layout (blocks, slot) restarts the flags: wait for both sides, then zero them.
        t = time.perf_counter()
        go()
        for d in range(2):
            with cp.cuda.Device(d):
                streams[d].synchronize()
        best = min(best, time.perf_counter() - t)
    with cp.cuda.Device(1):
        got = cp.asnumpy(dst[: nbytes // 4][::997])
    with cp.cuda.Device(0):
        want = cp.asnumpy(src[: nbytes // 4][::997])
    bad = int((got != want).sum())
    print(f"{label:44s} {nbytes >> 20:5d} MiB {nbytes / best / 1e9:7.1f} GB/s ({best * 1e6:8.1f} us) wrong(sampled)={bad}", flush=True)


def reset_flags():
    for d in range(2):
        with cp.cuda.Device(d):
            cp.cuda.Device(d).synchronize()
    ctypes.memset(ready_p, 0, 2 * FLAGS)
    base[0] = 0


sizes = [int(a) << 20 for a in sys.argv[1:]] or [16 << 20, 64 << 20, 256 << 20]
print(f"# GPU0 -> GPU1, no peer access; {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
for nb in sizes:
    measure("driver cudaMemcpyPeerAsync (no peer access)", nb, lambda: driver(nb))
    for blocks, slot, nslots in [(32, 1 << 20, 4), (64, 1 << 20, 4), (32, 2 << 20, 4), (64, 2 << 20, 8), (132, 4 << 20, 4), (16, 1 << 20, 8), (32, 512 << 10, 8)]:
        reset_flags()
        measure(f"SM zero-copy b={blocks} slot={slot >> 10}K x{nslots}", nb, lambda: zc(nb, blocks, slot, nslots))
