#!/usr/bin/env bash
# The old and the new build's `cuda-peer-bench --quick`, side by side in one
# call on one machine, alternating, so that the spread between runs of the
# same build can be told from a change between builds (issue 15's check):
#
#   OUT=/some/dir bench/oldnew.sh OLD_BENCH NEW_BENCH [ROUNDS] [-- extra bench args]
#
# OLD_BENCH is `cuda-peer-bench` built from the commit before the change
# (`git worktree add /tmp/old REV && cargo build --release -p cuda-peer-bench`
# there), NEW_BENCH this tree's (`.gpu/bin/cuda-peer-bench` after
# ../shared/gpu/bundle). Runs old, new, old, new, ... (ROUNDS of each,
# default 8: a --quick run takes a few seconds, and small calls vary by
# 10-20% between processes, so two runs of each cannot tell a change), all_reduce only, `--impls cuda-peer-p2p` unless extra args
# say otherwise; writes each run's CSV and output under $OUT, then, per
# point, the old runs' spread and the new median against the old median.
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=${1:?old cuda-peer-bench}
NEW=${2:?new cuda-peer-bench}
ROUNDS=${3:-8}
shift $(( $# >= 3 ? 3 : $# ))
[ "${1:-}" = "--" ] && shift
extra=("$@")
[ ${#extra[@]} -eq 0 ] && extra=(--impls cuda-peer-p2p)
OUT="${OUT:?set OUT to a directory for the results}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
for ((r = 1; r <= ROUNDS; r++)); do
  for which in old new; do
    bin=$OLD
    [ $which = new ] && bin=$NEW
    echo "== round $r: $which ($(date -u +%T))"
    "$bin" --machine "$which-$r" --out "$OUT" --quick "${extra[@]}" > "$OUT/$which-$r.txt" 2>&1
  done
done
python3 - "$OUT" "$ROUNDS" <<'PY'
import csv, glob, os, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
runs = {}
for which in ("old", "new"):
    for r in range(1, rounds + 1):
        files = glob.glob(os.path.join(out, f"{which}-{r}-*.csv"))
        for f in files:
            for row in csv.DictReader(open(f)):
                key = (row["impl"], row["collective"], row["dtype"], int(row["bytes"]))
                runs.setdefault(key, {}).setdefault(which, []).append(float(row["time_us"]))
worst = 0.0
print(f"{'impl':>14} {'dtype':>5} {'bytes':>11} | {'old us: median (range, runs)':>30} | {'new us: median (range, runs)':>30} | {'spread':>6} {'change':>7}")
for key in sorted(runs):
    t = runs[key]
    if len(t.get("old", [])) < 1 or len(t.get("new", [])) < 1:
        continue
    o, n = t["old"], t["new"]
    mo, mn = statistics.median(o), statistics.median(n)
    spread = (max(o) - min(o)) / mo if mo else 0.0
    change = (mn - mo) / mo if mo else 0.0
    beyond = change - spread
    worst = max(worst, beyond)
    flag = "  <-- slower beyond the spread by more than 3%" if beyond > 0.03 else ""
    fmt = lambda xs: f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f}, {len(xs)})"
    print(f"{key[0]:>14} {key[2]:>5} {key[3]:>11} | {fmt(o):>30} | {fmt(n):>30} | {spread:6.1%} {change:+7.1%}{flag}")
print(f"# largest slowdown beyond the old build's own spread: {worst:+.1%} (the check: no point above +3%)")
PY
