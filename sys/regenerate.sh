#!/usr/bin/env bash
# Regenerates sys/src/bindings.rs from CUDA 12.0's cuda.h (the PyPI wheel
# nvidia-cuda-runtime-cu12 ships it; no CUDA toolkit needed). Needs libclang
# (Debian: libclang-dev).
#   sys/regenerate.sh           write sys/src/bindings.rs
#   sys/regenerate.sh --check   fail if the committed file differs from a fresh one
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tools=${CUDA_PEER_TOOLS:-$HOME/.cache/cuda-peer-tools}
wheel_dir="$tools/cuda-runtime-12.0.107"
if [ ! -f "$wheel_dir/nvidia/cuda_runtime/include/cuda.h" ]; then
  mkdir -p "$wheel_dir"
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --disable-pip-version-check --no-deps --target "$wheel_dir" nvidia-cuda-runtime-cu12==12.0.107
fi
out="$here/src/bindings.rs"
[ "${1:-}" = "--check" ] && out=$(mktemp --suffix=.rs)
cargo run -q --release --manifest-path "$here/generate/Cargo.toml" -- "$wheel_dir/nvidia/cuda_runtime/include" "$out"
# The repository's rustfmt.toml in both modes (a --check file lives in /tmp, out of its reach).
rustfmt --edition 2021 --config-path "$here/../rustfmt.toml" "$out"
if [ "${1:-}" = "--check" ]; then
  if diff -u "$here/src/bindings.rs" "$out" > /dev/null; then
    echo "sys/src/bindings.rs: regeneration reproduces the committed file"
  else
    diff -u "$here/src/bindings.rs" "$out" | head -40
    echo "sys/src/bindings.rs differs from a fresh regeneration: run sys/regenerate.sh" >&2
    exit 1
  fi
else
  echo "wrote $out"
fi
