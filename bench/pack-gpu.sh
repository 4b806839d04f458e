#!/usr/bin/env bash
# Repacks .gpu.tgz (from BUNDLE_PACK=1 ../shared/gpu/bundle) into .gpu.txz,
# small enough for the 64 MiB a device call carries: every binary fully
# stripped, the test binaries that need no GPU (cli, sys, run, bench: CI
# runs them) left out, and xz with a 64 MiB dictionary, which stores the
# kernel images every binary embeds once instead of once per binary
# (59 MB gzip -> about 6 MB). With OLD_BENCH=path, that cuda-peer-bench
# travels too, as .gpu/old/cuda-peer-bench (bench/oldnew.sh's old build);
# with PREV_BENCH=path, as .gpu/prev/cuda-peer-bench (bench/mpab.sh's);
# with EXTRA_BENCHES="name=path ...", each as .gpu/name/cuda-peer-bench.
#   BUNDLE_PACK=1 ../shared/gpu/bundle && bench/pack-gpu.sh
#   carry [".gpu.txz"]; unpack there with
#   python3 -c 'import tarfile; tarfile.open(".gpu.txz").extractall()'
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .gpu.tgz ] || { echo "pack-gpu.sh: no .gpu.tgz (run BUNDLE_PACK=1 ../shared/gpu/bundle first)" >&2; exit 1; }
before=$(stat -c %s .gpu.tgz)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tar xzf .gpu.tgz -C "$tmp"
rm -f "$tmp"/.gpu/tests/cli-* "$tmp"/.gpu/tests/sys-* "$tmp"/.gpu/tests/run-* "$tmp"/.gpu/tests/bench-*
extras="${EXTRA_BENCHES:-}"
[ -z "${OLD_BENCH:-}" ] || extras="$extras old=$OLD_BENCH"
[ -z "${PREV_BENCH:-}" ] || extras="$extras prev=$PREV_BENCH"
for extra in $extras; do
  mkdir -p "$tmp/.gpu/${extra%%=*}"
  cp "${extra#*=}" "$tmp/.gpu/${extra%%=*}/cuda-peer-bench"
done
strip "$tmp"/.gpu/tests/* "$tmp"/.gpu/examples/* "$tmp"/.gpu/bin/* "$tmp"/.gpu/*/cuda-peer-bench 2>/dev/null || true
XZ_OPT="-9 -T0" tar cJf .gpu.txz -C "$tmp" .gpu
echo "pack-gpu.sh: .gpu.tgz $before -> .gpu.txz $(stat -c %s .gpu.txz) bytes; tracked tree $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) bytes (limit 67108864 together)"
