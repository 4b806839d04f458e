# Experiment, not part of the crate or CI: run on a Hopper GPU with CuPy and cuda-python
# (results: bench/experiments/pdl_gap/result-h200x2.txt, docs/experiments.md).
"""Experiment: how much GPU time separates back-to-back dependent kernels on
one stream, and how much of it programmatic dependent launch (PDL, sm_90)
hides. A chain of kernels, each reading and writing the same buffer, is
enqueued behind a spin kernel (so the host's launch cost drops out) and
timed between events: plain launches against cuLaunchKernelEx with
programmatic stream serialization, where each kernel waits
(griddepcontrol.wait) before touching the buffer and lets the next one
launch early (griddepcontrol.launch_dependents)."""
import ctypes
import sys

import cupy as cp
from cuda.bindings import driver as cu

SRC = r'''
extern "C" __global__ void spin(long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < (unsigned long long)ns);
}
// buf[i] += 1 over n floats; pdl: wait for the previous grid first, and let
// the next one launch as soon as every block got here.
extern "C" __global__ void step(float* buf, unsigned long long n, int pdl) {
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x)
    buf[i] += 1.0f;
  if (pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
'''


def check(r):
    err = r[0] if isinstance(r, tuple) else r
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(str(err))
    return r[1:] if isinstance(r, tuple) and len(r) > 1 else None


mod = cp.RawModule(code=SRC, options=("-arch=sm_90",))
spin = mod.get_function("spin")
step = mod.get_function("step")
FPTR = step.kernel.ptr  # the CUfunction behind CuPy's RawKernel
stream = cp.cuda.Stream(non_blocking=True)
t0, t1 = cp.cuda.Event(), cp.cuda.Event()
CALLS = 400


def launch(buf, n, blocks, pdl):
    cfg = cu.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = blocks, 1, 1
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = 512, 1, 1
    cfg.sharedMemBytes = 0
    cfg.hStream = cu.CUstream(stream.ptr)
    if pdl:
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        cfg.attrs = [attr]
        cfg.numAttrs = 1
    else:
        cfg.numAttrs = 0
    args = ((buf.data.ptr, n, int(pdl)), (ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_int))
    check(cu.cuLaunchKernelEx(cfg, cu.CUfunction(FPTR), args, 0))


def run(nbytes, blocks, pdl):
    n = nbytes // 4
    buf = cp.zeros(n, dtype=cp.float32)
    stream.synchronize()
    spin((1,), (1,), (cp.int64(40_000_000),), stream=stream)
    t0.record(stream)
    for _ in range(CALLS):
        launch(buf, n, blocks, pdl)
    t1.record(stream)
    t1.synchronize()
    us = cp.cuda.get_elapsed_time(t0, t1) * 1000 / CALLS
    got = float(buf[::max(1, n // 1024)].min()), float(buf[::max(1, n // 1024)].max())
    ok = got == (CALLS, CALLS)
    print(f"{nbytes:>10d} B  blocks={blocks:4d}  {'PDL  ' if pdl else 'plain'}  {us:8.2f} us per kernel  {'ok' if ok else f'WRONG {got}'}", flush=True)
    return us


print(f"# {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}: {CALLS} dependent kernels back to back behind a spin, GPU time per kernel")
for nbytes, blocks in [(4096, 4), (4096, 132), (1 << 20, 132), (1 << 20, 264), (16 << 20, 264), (64 << 20, 264)]:
    a = run(nbytes, blocks, False)
    b = run(nbytes, blocks, True)
    print(f"{'':33s} PDL saves {a - b:6.2f} us per kernel", flush=True)
