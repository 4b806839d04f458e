#!/usr/bin/env bash
# Stub CUDA libraries for a link check on a machine without CUDA, like the
# toolkit's own lib64/stubs: one shared library per CUDA library that defines
# every cu*/nvrtc*/curand*/cublas*/cublasLt*/nccl* symbol the given rlibs leave
# undefined, with the real library's SONAME (so a binary linked against them
# loads the real libraries where CUDA is installed). Nothing in them is callable.
#   ci/compat/link-stubs.sh OUT_DIR RLIB...
# CUDA_MAJOR (12 unless set) picks the SONAMEs' majors: 12 or 13.
set -euo pipefail
out=$1
shift
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
nm -u --format=posix "$@" 2>/dev/null | awk '$2 == "U" { print $1 }' | sort -u > "$tmp/syms"
m=${CUDA_MAJOR:-12}
for spec in cuda:libcuda.so.1:'^cu[A-Z]' nvrtc:libnvrtc.so.$m:'^nvrtc' curand:libcurand.so.10:'^curand' \
  cublasLt:libcublasLt.so.$m:'^cublasLt' cublas:libcublas.so.$m:'^cublas[^L]' nccl:libnccl.so.2:'^nccl'; do
  IFS=: read -r name soname re <<< "$spec"
  { grep -E "$re" "$tmp/syms" || true; } | sed 's/.*/void &(void) {}/' > "$tmp/$name.c"
  cc -shared -fPIC -Wl,-soname,"$soname" -o "$out/lib$name.so" "$tmp/$name.c"
  echo "link-stubs: lib$name.so ($soname): $(grep -c . "$tmp/$name.c" || true) symbols"
done
