#!/usr/bin/env bash
# Builds candle_tensor_parallel on a machine with no CUDA toolkit and no GPU, for
# H100/H200 (sm_90, override with CUDA_COMPUTE_CAP) and CUDA 13.0 (driver 580 on), in
# the candle build cache target/candle that examples/candle_data_parallel shares (same
# environment, so candle-core and candle-kernels are not rebuilt): nvcc and the headers
# from PyPI wheels, stub CUDA libraries to link against (the binary loads the real ones
# where it runs: libcuda.so.1, libcublas.so.13, libcublasLt.so.13, libcurand.so.10,
# libnvrtc.so.13, libcudart.so.13, and for the NCCL build libnccl.so.2).
#   examples/candle_tensor_parallel/build.sh            # both builds
#   examples/candle_tensor_parallel/build.sh cuda-peer  # only cuda_peer::compat::nccl's
#   examples/candle_tensor_parallel/build.sh nccl       # only cudarc::nccl's
# Prints the stripped binaries' paths (target/candle/tp/).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
which=${1:-both}
tools=$root/target/cuda-tools
cuda=$tools/cuda13.0
if [ ! -x "$cuda/bin/nvcc" ]; then
  # As examples/candle_data_parallel/build.sh: CUDA 13's wheels, one directory per
  # wheel, merged.
  for p in nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 \
    nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88; do
    python3 -m pip install -q --no-deps --target "$tools/wheels/$p" "$p"
    mkdir -p "$cuda"
    cp -a "$tools/wheels/$p/nvidia/cu13/." "$cuda/"
  done
fi
ln -sf libcudart.so.13 "$cuda/lib/libcudart.so" # candle-kernels links -lcudart
# The same variables as candle_data_parallel's build.sh: any other value rebuilds
# cudarc, candle-kernels and candle-core from nothing (30 min on 2 cores).
export CUDA_HOME=$cuda PATH=$cuda/bin:$PATH CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90} CUDARC_CUDA_VERSION=13000
target=$root/target/candle
out=$target/tp
mkdir -p "$out"
cd "$here"

# The path of the cudarc rlib that a build of this crate with cargo arguments "$@" uses
# (the build may fail at its final link, before there are stubs: only cudarc matters).
cudarc_rlib() {
  # (its "could not compile" is that link, when the stubs lack what it needs: quiet)
  { cargo build --release --target-dir "$target" "$@" --message-format=json 2>/dev/null || true; } | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "cudarc":
        print(next(f for f in m["filenames"] if f.endswith(".rlib")))'
}

variants=()
case $which in
  both) variants=(cuda-peer nccl) ;;
  cuda-peer | nccl) variants=("$which") ;;
  *) echo "usage: $0 [both|cuda-peer|nccl]" >&2; exit 64 ;;
esac

# cudarc (dynamic-linking, candle's choice) links libcuda, libnvrtc, libcurand, libcublas,
# libcublasLt, and with NCCL's bindings libnccl: stubs of them in $CUDA_HOME/lib (which
# cudarc's build script searches), from the symbols the cudarc rlibs of BOTH builds leave
# undefined, so that the stubs serve either build (and candle_data_parallel's, a subset).
rlibs=("$(cudarc_rlib -p cudarc)")
for v in "${variants[@]}"; do
  if [ "$v" = nccl ]; then rlibs+=("$(cudarc_rlib --features nccl)"); fi
done
for r in "${rlibs[@]}"; do [ -f "$r" ] || { echo "build.sh: no cudarc rlib ($r)" >&2; exit 1; }; done
CUDA_MAJOR=13 "$root/ci/compat/link-stubs.sh" "$cuda/lib" "${rlibs[@]}" >&2

for v in "${variants[@]}"; do
  start=$SECONDS
  if [ "$v" = nccl ]; then
    cargo build --release --target-dir "$target" --features nccl >&2
    name=candle_tensor_parallel-nccl
  else
    cargo build --release --target-dir "$target" >&2
    name=candle_tensor_parallel
  fi
  # Both builds write target/candle/release/candle_tensor_parallel: keep a stripped copy
  # of each under its own name.
  strip -o "$out/$name" "$target/release/candle_tensor_parallel"
  echo "build.sh: $v build in $((SECONDS - start)) s, stripped $(stat -c %s "$out/$name") bytes" >&2
  echo "$out/$name"
done
