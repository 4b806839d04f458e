#!/usr/bin/env bash
# CPU self-test of the libcuda shim (no GPU, no CUDA): builds it, checks its
# soname, its DT_NEEDED and its exported symbols (nm -D), then runs
# selftest.c against a pretend driver in every mode. Used by .ci/run and by
# the `fakecuda_shim_builds_and_layers` test in tests/fault_shim.rs.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/../../target/fakecuda-selftest}
CUDA_PEER_REAL_LIBCUDA=/nonexistent "$here/build.sh" "$out" >/dev/null
out=$(cd "$out" && pwd)
readelf -d "$out/libcuda.so.1" | grep -q 'SONAME.*\[libcuda.so.1\]' || { echo "shim: soname is not libcuda.so.1" >&2; exit 1; }
readelf -d "$out/libcuda.so.1" | grep -q 'NEEDED.*\[libcuda-real.so.1\]' || { echo "shim: no DT_NEEDED on libcuda-real.so.1" >&2; exit 1; }
want="cuCtxEnablePeerAccess cuDeviceCanAccessPeer cuDeviceGetP2PAttribute cuGetProcAddress cuGetProcAddress_v2
cuLibraryLoadData cuMemcpyAsync cuMemcpyDtoDAsync_v2 cuMemcpyDtoD_v2 cuMemcpyPeer cuMemcpyPeerAsync
cuModuleLoadData cuModuleLoadDataEx cuda_peer_fake_fired cuda_peer_fake_mode"
have=$(nm -D --defined-only "$out/libcuda.so.1" | awk '$2 == "T" { print $3 }' | sort)
if [ "$(echo $want | tr ' ' '\n' | sort)" != "$have" ]; then
  echo "shim exports differ:"; diff <(echo $want | tr ' ' '\n' | sort) <(echo "$have") >&2; exit 1
fi
cc=${CC:-gcc}
mkdir -p "$out/pretend"
"$cc" -shared -fPIC -DPRETEND_DRIVER -o "$out/pretend/libcuda-real.so.1" -Wl,-soname,libcuda-real.so.1 "$here/selftest.c" -ldl
"$cc" -O1 -Wall -o "$out/selftest" "$here/selftest.c" -ldl
ln -sf pretend/libcuda-real.so.1 "$out/libcuda-real.so.1"
for mode in off peer-unavailable fail-module-load=1 fail-module-load=0; do
  CUDA_PEER_FAKE=$mode LD_LIBRARY_PATH="$out" "$out/selftest"
done
echo "fakecuda: exports and layering ok"
