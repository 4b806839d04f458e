#!/usr/bin/env bash
# Two builds of cuda-peer-bench's mp-allreduce side by side in one device
# call: ROUNDS alternating runs of each (prev, new, prev, new, ...), two
# processes under cuda-peer-run each time, cuda-peer's own impls only
# (IMPLS), so that a kernel change is judged against the build before it
# on the same machine, in the same minutes. One CSV per run under
# $OUT/prev-K and $OUT/new-K; bench/mpab.py prints the medians.
#   bench/mpab.sh PREV_BENCH NEW_BENCH [ROUNDS]
set -euo pipefail
prev=$1 new=$2 rounds=${3:-3}
impls=${IMPLS:-cuda-peer-ipc,cuda-peer-ipc-staged}
run=.gpu/bin/cuda-peer-run
for k in $(seq 1 "$rounds"); do
  for side in prev new; do
    bin=$prev; [ "$side" = new ] && bin=$new
    echo "== $side round $k ($(date -u +%T))"
    "$run" -n 2 -- "$bin" mp-allreduce --impls "$impls" --machine ab --out "$OUT/$side-$k" | tail -3
  done
done
python3 "$(dirname "$0")/mpab.py" "$OUT"
