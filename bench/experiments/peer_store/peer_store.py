# Experiment, not part of the crate or CI: run on a machine with 2 GPUs, CuPy and P2P
# (results: bench/experiments/peer_store/result-h200x2.txt, docs/experiments.md).
"""Experiment: how fast can SMs write into a peer GPU's memory over NVLink?
Both GPUs at once (as in a reduce-scatter by pushes), each storing 512 MiB
of its own memory into the other's: 16-byte stores from registers, and TMA
bulk stores (cp.async.bulk global <- shared) of tiles first loaded into
shared memory; the copy engine pushing, and SM peer loads, for reference."""
import sys
import time

import cupy as cp

SRC = r'''
typedef unsigned long long u64;
// dst (peer) = a (own); `unroll` vectors in flight per thread.
template <int U>
__device__ void push_u(float4* dst, const float4* a, u64 n) {
  const u64 stride = (u64)gridDim.x * blockDim.x;
  u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x;
  for (; i + (U - 1) * stride < n; i += U * stride) {
    float4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = a[i + u * stride];
#pragma unroll
    for (int u = 0; u < U; ++u) dst[i + u * stride] = v[u];
  }
  for (; i < n; i += stride) dst[i] = a[i];
}
extern "C" __global__ void push1(float4* dst, const float4* a, u64 n) { push_u<1>(dst, a, n); }
extern "C" __global__ void push4(float4* dst, const float4* a, u64 n) { push_u<4>(dst, a, n); }
// dst (own) = a (peer): loads, for reference.
extern "C" __global__ void pull4(float4* dst, const float4* a, u64 n) { push_u<4>(dst, a, n); }

static __device__ __forceinline__ unsigned smem_addr(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}
// Tiles of `tile` bytes: loaded from own memory into shared memory by the
// block's threads, then stored into the peer by one TMA bulk store; `stages`
// tiles in flight.
extern "C" __global__ void tma_push(float4* dst, const float4* a, u64 n, unsigned tile, int stages) {
  extern __shared__ __align__(128) unsigned char smem[];
  const u64 tu = tile / 16;
  const u64 ntiles = n / tu;
  for (u64 k = 0;; ++k) {
    const u64 t = blockIdx.x + k * gridDim.x;
    if (t >= ntiles) break;
    const int s = (int)(k % stages);
    if (threadIdx.x == 0) {
      // The bulk store that last read stage s (committed `stages` tiles ago)
      // must be done reading it: at most stages-1 groups may still read.
      if (stages >= 6) asm volatile("cp.async.bulk.wait_group.read 5;" ::: "memory");
      else if (stages >= 4) asm volatile("cp.async.bulk.wait_group.read 3;" ::: "memory");
      else asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
    }
    __syncthreads();
    float4* sp = (float4*)(smem + (u64)s * tile);
    for (u64 i = threadIdx.x; i < tu; i += blockDim.x) sp[i] = a[t * tu + i];
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   :: "l"(dst + t * tu), "r"(smem_addr(sp)), "r"(tile) : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
  }
  if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
'''

BYTES = int(sys.argv[1]) if len(sys.argv) > 1 else 512 << 20  # written into the peer, per GPU
n4 = BYTES // 16

mods, bufs, streams, side = [], [], [], []
for d in range(2):
    with cp.cuda.Device(d):
        cp.cuda.runtime.deviceEnablePeerAccess(1 - d)
        mods.append(cp.RawModule(code=SRC, options=("-std=c++17",)))
        a = cp.random.random(BYTES // 4, dtype=cp.float32)
        dst = cp.empty(BYTES // 4, dtype=cp.float32)
        bufs.append((a, dst))
        streams.append(cp.cuda.Stream(non_blocking=True))
        side.append(cp.cuda.Stream(non_blocking=True))


def run(label, launch, pull=False, gpus=(0, 1), reps=6):
    """launch(d) runs on GPU d's stream; a push writes GPU d's `a` into the
    peer's `dst`, a pull GPU d's `dst` from the peer's `a`."""
    best = 1e9
    for _ in range(reps):
        for d in range(2):
            with cp.cuda.Device(d):
                bufs[d][1].fill(-1.0)
                cp.cuda.Device(d).synchronize()
        t = time.perf_counter()
        for d in gpus:
            with cp.cuda.Device(d):
                launch(d)
        for d in gpus:
            with cp.cuda.Device(d):
                streams[d].synchronize()
                side[d].synchronize()
        best = min(best, time.perf_counter() - t)
    bad = 0
    for d in gpus:
        written = d if pull else 1 - d
        with cp.cuda.Device(d):
            want = cp.asnumpy(bufs[d if not pull else 1 - d][0][::4099])
        with cp.cuda.Device(written):
            got = cp.asnumpy(bufs[written][1][::4099])
        bad += int((got != want).sum())
    ways = "both ways" if len(gpus) == 2 else "one way"
    print(f"{label:44s} {ways:9s} {BYTES / best / 1e9:7.1f} GB/s per GPU ({best * 1e6:8.1f} us)  wrong(sampled)={bad}", flush=True)


def kern(name, blocks, threads=512, pull=False):
    def go(d):
        f = mods[d].get_function(name)
        f((blocks,), (threads,), (bufs[1 - d][1] if not pull else bufs[d][1], bufs[d][0] if not pull else bufs[1 - d][0], cp.uint64(n4)), stream=streams[d])
    return go


def tma(blocks, tile, stages, threads=256):
    def go(d):
        f = mods[d].get_function("tma_push")
        f.max_dynamic_shared_size_bytes = tile * stages
        f((blocks,), (threads,), (bufs[1 - d][1], bufs[d][0], cp.uint64(n4), cp.uint32(tile), cp.int32(stages)),
          shared_mem=tile * stages, stream=streams[d])
    return go


def ce_push(d):
    cp.cuda.runtime.memcpyPeerAsync(bufs[1 - d][1].data.ptr, 1 - d, bufs[d][0].data.ptr, d, BYTES, streams[d].ptr)


print(f"# {BYTES >> 20} MiB per GPU; {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
run("copy-engine push (source's stream)", ce_push)
run("copy-engine push (source's stream)", ce_push, gpus=(0,))
run("SM loads (pull4, 528 blocks)", kern("pull4", 528, 256, pull=True), pull=True)
for name in ("push1", "push4"):
    for blocks, threads in [(132, 512), (264, 512), (528, 256), (1056, 256), (2112, 256)]:
        run(f"SM stores {name} blocks={blocks} threads={threads}", kern(name, blocks, threads))
run("SM stores push4 blocks=528 threads=256", kern("push4", 528, 256), gpus=(0,))
for blocks, tile, stages in [(132, 16384, 4), (264, 16384, 4), (132, 32768, 4), (264, 8192, 6), (528, 8192, 4)]:
    try:
        run(f"TMA stores blocks={blocks} tile={tile} stages={stages}", tma(blocks, tile, stages))
    except Exception as e:  # noqa: BLE001
        print(f"TMA stores blocks={blocks} tile={tile} stages={stages}: {e}", flush=True)


def mixed(frac, blocks=528, threads=256):
    """The copy engine pushes the first `frac` of the buffer (side stream)
    while SM stores push the rest, both at once."""
    def go(d):
        ce_bytes = int(BYTES * frac) // 16 * 16
        cp.cuda.runtime.memcpyPeerAsync(bufs[1 - d][1].data.ptr, 1 - d, bufs[d][0].data.ptr, d, ce_bytes, side[d].ptr)
        f = mods[d].get_function("push4")
        off = ce_bytes // 4
        f((blocks,), (threads,), (bufs[1 - d][1][off:], bufs[d][0][off:], cp.uint64((BYTES - ce_bytes) // 16)), stream=streams[d])
    return go


for frac in (0.5, 0.6, 0.7, 0.8):
    run(f"copy engine {frac:.0%} + SM stores {1 - frac:.0%} at once", mixed(frac))
run("copy-engine push (again)", ce_push)
