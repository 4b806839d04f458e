# Experiment, not part of the crate or CI: run on a machine with 2 GPUs, CuPy and P2P
# (results: bench/experiments/peer_read/result-h200x2.txt, docs/experiments.md).
"""Experiment: how fast can SMs read a peer GPU's memory over NVLink?
Reduce-scatter step of a 2-rank all-reduce: dst = peer + own (f32), both GPUs
at once, each reading half a buffer from the other. LSU 16-byte loads (like
cuda-peer's ring kernel) against TMA bulk copies (cp.async.bulk) of the peer
tile into shared memory; the copy engine for reference."""
import sys
import time

import cupy as cp

SRC = r'''
typedef unsigned long long u64;
extern "C" __global__ void lsu(float4* dst, const float4* peer, const float4* own, u64 n) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
    float4 a = peer[i], b = own[i];
    a.x += b.x; a.y += b.y; a.z += b.z; a.w += b.w;
    dst[i] = a;
  }
}

static __device__ __forceinline__ unsigned smem_addr(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}

// tile: bytes per TMA copy (multiple of 16); stages: tiles in flight per block.
extern "C" __global__ void tma(float4* dst, const float4* peer, const float4* own, u64 n, unsigned tile, int stages) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) u64 bar[8];
  const u64 tu = tile / 16;
  const u64 ntiles = n / tu;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(&bar[s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      u64 t = blockIdx.x + (u64)s * gridDim.x;
      if (t < ntiles) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(&bar[s])), "r"(tile) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(smem_addr(smem + (u64)s * tile)), "l"(peer + t * tu), "r"(tile), "r"(smem_addr(&bar[s])) : "memory");
      }
    }
  }
  for (u64 k = 0;; ++k) {
    const u64 t = blockIdx.x + k * gridDim.x;
    if (t >= ntiles) break;
    const int s = (int)(k % stages);
    const unsigned par = (unsigned)((k / stages) & 1);
    unsigned done = 0;
    while (!done) {
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done) : "r"(smem_addr(&bar[s])), "r"(par) : "memory");
    }
    const float4* sp = (const float4*)(smem + (u64)s * tile);
    for (u64 i = threadIdx.x; i < tu; i += blockDim.x) {
      float4 a = sp[i], b = own[t * tu + i];
      a.x += b.x; a.y += b.y; a.z += b.z; a.w += b.w;
      dst[t * tu + i] = a;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      const u64 tn = blockIdx.x + (k + stages) * gridDim.x;
      if (tn < ntiles) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(&bar[s])), "r"(tile) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(smem_addr(smem + (u64)s * tile)), "l"(peer + tn * tu), "r"(tile), "r"(smem_addr(&bar[s])) : "memory");
      }
    }
  }
}
'''

BYTES = int(sys.argv[1]) if len(sys.argv) > 1 else 512 << 20  # read from the peer, per GPU
n4 = BYTES // 16

mods, bufs, streams = [], [], []
for d in range(2):
    with cp.cuda.Device(d):
        cp.cuda.runtime.deviceEnablePeerAccess(1 - d)
        mods.append(cp.RawModule(code=SRC, options=("-std=c++17",)))
        x = cp.random.random(BYTES // 4, dtype=cp.float32)
        own = cp.random.random(BYTES // 4, dtype=cp.float32)
        dst = cp.empty(BYTES // 4, dtype=cp.float32)
        bufs.append((x, own, dst))
        streams.append(cp.cuda.Stream(non_blocking=True))


def run(label, launch, reps=6):
    best = 1e9
    for _ in range(reps):
        for d in range(2):
            with cp.cuda.Device(d):
                bufs[d][2].fill(-1.0)
                cp.cuda.Device(d).synchronize()
        t = time.perf_counter()
        for d in range(2):
            with cp.cuda.Device(d):
                launch(d)
        for d in range(2):
            with cp.cuda.Device(d):
                streams[d].synchronize()
        best = min(best, time.perf_counter() - t)
    bad = 0
    for d in range(2):
        with cp.cuda.Device(d):
            peer_host = cp.asnumpy(bufs[1 - d][0][::4099])
            own_host = cp.asnumpy(bufs[d][1][::4099])
            got = cp.asnumpy(bufs[d][2][::4099])
            bad += int(((peer_host + own_host) != got).sum()) if label != "copy-engine" else int((got != peer_host).sum())
    print(f"{label:40s} {BYTES / best / 1e9:7.1f} GB/s per GPU ({best * 1e6:8.1f} us)  wrong(sampled)={bad}", flush=True)


def lsu(blocks, threads=256):
    def go(d):
        f = mods[d].get_function("lsu")
        f((blocks,), (threads,), (bufs[d][2], bufs[1 - d][0], bufs[d][1], cp.uint64(n4)), stream=streams[d])
    return go


def tma(blocks, tile, stages, threads=256):
    def go(d):
        f = mods[d].get_function("tma")
        f.max_dynamic_shared_size_bytes = tile * stages
        f((blocks,), (threads,), (bufs[d][2], bufs[1 - d][0], bufs[d][1], cp.uint64(n4), cp.uint32(tile), cp.int32(stages)),
          shared_mem=tile * stages, stream=streams[d])
    return go


def ce(d):
    cp.cuda.runtime.memcpyPeerAsync(bufs[d][2].data.ptr, d, bufs[1 - d][0].data.ptr, 1 - d, BYTES, streams[d].ptr)


print(f"# {BYTES >> 20} MiB read from the peer by each GPU at once; {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
run("copy-engine", ce)
for b in (528, 1056):
    run(f"lsu blocks={b}", lsu(b))
for blocks, tile, stages in [(132, 16384, 4), (264, 16384, 4), (396, 16384, 3), (264, 32768, 3), (132, 32768, 6), (264, 8192, 6), (528, 8192, 4), (132, 65536, 3)]:
    try:
        run(f"tma blocks={blocks} tile={tile} stages={stages}", tma(blocks, tile, stages))
    except Exception as e:  # noqa: BLE001
        print(f"tma blocks={blocks} tile={tile} stages={stages}: {e}", flush=True)
for b in (528,):
    run(f"lsu blocks={b} (again)", lsu(b))
