#!/usr/bin/env bash
# Builds of cuda-peer-bench's mp-allreduce side by side in one device call:
# ROUNDS alternating runs of each (prev, new, [more...], prev, new, ...),
# two processes under cuda-peer-run each time, cuda-peer's own impls only
# (IMPLS), so that a kernel change is judged against the build before it
# on the same machine, in the same minutes. MORE="name=path ..." adds
# builds to the rotation; MIN_BYTES and MAX_BYTES bound the sizes. One CSV per run under $OUT/<name>-K (its
# output beside it, <name>-K.txt);
# bench/mpab.py prints the medians, every build against prev.
#   [MORE="name=path ..."] bench/mpab.sh PREV_BENCH NEW_BENCH [ROUNDS]
set -euo pipefail
prev=$1 new=$2 rounds=${3:-3}
impls=${IMPLS:-cuda-peer-ipc,cuda-peer-ipc-staged}
extra=()
[ -n "${MIN_BYTES:-}" ] && extra+=(--min-bytes "$MIN_BYTES")
[ -n "${MAX_BYTES:-}" ] && extra+=(--max-bytes "$MAX_BYTES")
run=.gpu/bin/cuda-peer-run
builds=("prev=$prev" "new=$new")
for b in ${MORE:-}; do builds+=("$b"); done
for k in $(seq 1 "$rounds"); do
  for b in "${builds[@]}"; do
    side=${b%%=*} bin=${b#*=}
    echo "== $side round $k ($(date -u +%T))"
    "$run" -n 2 -- "$bin" mp-allreduce --impls "$impls" --machine ab "${extra[@]}" --out "$OUT/$side-$k" > "$OUT/$side-$k.txt"
    tail -1 "$OUT/$side-$k.txt"
  done
done
python3 "$(dirname "$0")/mpab.py" "$OUT"
