#!/usr/bin/env bash
# Builds the libcuda stand-in (fakecuda.c) with gcc; needs no CUDA.
#
#   tests/fakecuda/build.sh [OUTDIR]        (default: target/fakecuda)
#
# OUTDIR/stub/libcuda-real.so.1   an empty library with that soname, linked
#                                 against so that the shim has DT_NEEDED on it;
# OUTDIR/libcuda.so.1             the shim (SONAME libcuda.so.1);
# OUTDIR/libcuda.so               a symlink to it (cudarc tries "libcuda.so" first).
# With a real driver here (ldconfig knows libcuda.so.1, or CUDA_PEER_REAL_LIBCUDA
# names it), OUTDIR/libcuda-real.so.1 becomes a symlink to it, and
# LD_LIBRARY_PATH=OUTDIR puts the shim in front of it (tests/fakecuda/run.sh).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/../../target/fakecuda}
mkdir -p "$out/stub"
out=$(cd "$out" && pwd)
cc=${CC:-gcc}
printf '/* empty: stands for the real driver at link time */\n' > "$out/stub/empty.c"
"$cc" -shared -fPIC -o "$out/stub/libcuda-real.so.1" -Wl,-soname,libcuda-real.so.1 "$out/stub/empty.c"
# --no-as-needed: the shim uses no symbol of the stub, but must depend on it.
# Warnings are errors in CI (FAKECUDA_WERROR=1, set by selftest.sh), not on
# a GPU machine whose gcc may warn about more.
"$cc" -shared -fPIC -O2 -Wall -Wextra ${FAKECUDA_WERROR:+-Werror} -fvisibility=hidden -o "$out/libcuda.so.1" \
  -Wl,-soname,libcuda.so.1 "$here/fakecuda.c" \
  -Wl,--no-as-needed -L"$out/stub" -l:libcuda-real.so.1 -Wl,--as-needed -ldl -lpthread
ln -sf libcuda.so.1 "$out/libcuda.so"
real=${CUDA_PEER_REAL_LIBCUDA:-}
if [ -z "$real" ]; then
  real=$( (ldconfig -p 2>/dev/null || true) | awk '$1 == "libcuda.so.1" && /x86-64/ { print $NF; exit }')
fi
if [ -n "$real" ] && [ -e "$real" ]; then
  real=$(readlink -f "$real")
  case "$real" in
    "$out"/*) echo "fakecuda: $real is the shim itself, not the driver" >&2; exit 1 ;;
  esac
  ln -sf "$real" "$out/libcuda-real.so.1"
  echo "fakecuda: built $out/libcuda.so.1 in front of $real"
else
  rm -f "$out/libcuda-real.so.1"
  echo "fakecuda: built $out/libcuda.so.1 (no real driver here: not runnable)"
fi
