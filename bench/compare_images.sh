#!/usr/bin/env bash
# Bitwise check of the embedded cubins against the PTX (issue 19), on a GPU
# machine with the examples staged by ../shared/gpu/bundle:
#
#   OUT=/some/dir bench/compare_images.sh [path/to/kernel_digest]
#
# Runs kernel_digest (every algorithm the GPUs allow x type x reduction x
# size, fixed inputs) with the cubins and with CUDA_PEER_FORCE_PTX=1, and
# fails unless the two outputs are identical. Writes
# $OUT/digest-cubin.txt, $OUT/digest-ptx.txt and their diff.
set -euo pipefail
cd "$(dirname "$0")/.."
EX="${1:-.gpu/examples/kernel_digest}"
OUT="${OUT:?set OUT to a directory for the results}"
mkdir -p "$OUT"
[ -x "$EX" ] || { echo "compare_images.sh: no executable $EX (run ../shared/gpu/bundle first)" >&2; exit 1; }
"$EX" > "$OUT/digest-cubin.txt"
CUDA_PEER_FORCE_PTX=1 "$EX" > "$OUT/digest-ptx.txt"
if diff "$OUT/digest-cubin.txt" "$OUT/digest-ptx.txt" > "$OUT/digest.diff"; then
    echo "compare_images.sh: cubin and PTX results identical ($(grep -c . "$OUT/digest-cubin.txt") cases)"
else
    head -n 20 "$OUT/digest.diff"
    echo "compare_images.sh: cubin and PTX results DIFFER (see $OUT/digest.diff)" >&2
    exit 1
fi
