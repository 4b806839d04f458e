#!/usr/bin/env bash
# Builds candle_data_parallel on a machine with no CUDA toolkit and no GPU (as
# CI's), for H100/H200 (sm_90, override with CUDA_COMPUTE_CAP) and CUDA 13.0
# (driver 580 on): nvcc and the headers from PyPI wheels, and stub CUDA
# libraries to link against (the binary loads the real ones where it runs:
# libcuda.so.1, libcublas.so.13, libcublasLt.so.13, libcurand.so.10,
# libnvrtc.so.13, libcudart.so.13). Prints the binary's path.
#   examples/candle_data_parallel/build.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
tools=$root/target/cuda-tools
cuda=$tools/cuda13.0
if [ ! -x "$cuda/bin/nvcc" ]; then
  # CUDA 13's wheels put everything under nvidia/cu13/: one directory per wheel
  # (pip --target replaces a shared top directory), merged afterwards.
  for p in nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 \
    nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88; do
    python3 -m pip install -q --no-deps --target "$tools/wheels/$p" "$p"
    mkdir -p "$cuda"
    cp -a "$tools/wheels/$p/nvidia/cu13/." "$cuda/"
  done
fi
ln -sf libcudart.so.13 "$cuda/lib/libcudart.so" # candle-kernels links -lcudart
export CUDA_HOME=$cuda PATH=$cuda/bin:$PATH CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90} CUDARC_CUDA_VERSION=13000
target=$root/target/candle
cd "$here"
# cudarc (dynamic-linking, candle's choice) links libcuda, libnvrtc, libcurand,
# libcublas and libcublasLt: stubs of them, from the symbols cudarc leaves
# undefined, in $CUDA_HOME/lib, which cudarc's build script searches.
rlib=$(cargo build --release -q -p cudarc --target-dir "$target" --message-format=json | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "cudarc":
        print(next(f for f in m["filenames"] if f.endswith(".rlib")))')
CUDA_MAJOR=13 "$root/ci/compat/link-stubs.sh" "$cuda/lib" "$rlib"
cargo build --release --target-dir "$target"
echo "$target/release/candle_data_parallel"
