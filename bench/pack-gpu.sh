#!/usr/bin/env bash
# Repacks .gpu.tgz (from BUNDLE_PACK=1 ../shared/gpu/bundle) smaller, for
# the 64 MiB a device call carries: every binary fully stripped, and the
# test binaries that need no GPU (cli, sys, run, bench: CI runs them) left
# out. Prints the sizes before and after.
#   BUNDLE_PACK=1 ../shared/gpu/bundle && bench/pack-gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .gpu.tgz ] || { echo "pack-gpu.sh: no .gpu.tgz (run BUNDLE_PACK=1 ../shared/gpu/bundle first)" >&2; exit 1; }
before=$(stat -c %s .gpu.tgz)
tmp=$(mktemp -d)
tar xzf .gpu.tgz -C "$tmp"
rm -f "$tmp"/.gpu/tests/cli-* "$tmp"/.gpu/tests/sys-* "$tmp"/.gpu/tests/run-* "$tmp"/.gpu/tests/bench-*
strip "$tmp"/.gpu/tests/* "$tmp"/.gpu/examples/* "$tmp"/.gpu/bin/* 2>/dev/null || true
tar czf .gpu.tgz -C "$tmp" .gpu
rm -rf "$tmp"
echo "pack-gpu.sh: .gpu.tgz $before -> $(stat -c %s .gpu.tgz) bytes; tracked tree $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) bytes (limit 67108864 together)"
