#!/usr/bin/env bash
# Cold-start cost of cuda-peer's kernels (issue 19), on a GPU machine with
# the examples staged by ../shared/gpu/bundle (no Rust toolchain needed):
#
#   OUT=/some/dir bench/coldstart.sh [path/to/ring_allreduce]
#
# For f32, bf16 and i8, `ring_allreduce --bytes 4096 --iters 1` as a whole
# process, wall clock, cold and warm:
#   cold:  CUDA_CACHE_DISABLE=1 (no driver JIT cache at all)
#   warm:  CUDA_CACHE_PATH=<fresh dir>, run twice, the second timed
# with three kernel settings:
#   cubin:     the default (embedded cubins, every module loaded at creation)
#   ptx:       CUDA_PEER_FORCE_PTX=1 (every module JIT-compiled at creation)
#   ptx-lazy:  CUDA_PEER_FORCE_PTX=1 --lazy-kernels (only the modules the run
#              uses, on first use: what the crate did before the cubins)
# One repetition (REPS=1, the default) takes about 3-6 minutes on 2 GPUs,
# most of it the ptx runs' JIT.
# Each run also passes --timings (start-up steps and per-module loads on
# stderr). Then the first call of a new (type, reduction) after creation,
# with kernels loaded at creation (default) and lazily (--lazy-kernels).
#
# Writes $OUT/coldstart.csv (one row per timed process), $OUT/coldstart-*.log
# (each process's stdout and stderr) and $OUT/coldstart-first-call.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
EX="${1:-.gpu/examples/ring_allreduce}"
OUT="${OUT:?set OUT to a directory for the results}"
REPS="${REPS:-1}"
mkdir -p "$OUT"
[ -x "$EX" ] || { echo "coldstart.sh: no executable $EX (run ../shared/gpu/bundle first)" >&2; exit 1; }
csv="$OUT/coldstart.csv"
echo "dtype,kernels,cache,rep,wall_s,exit,contexts_ms,group_new_ms,warm_up_ms,run_ms,main_total_ms" > "$csv"

# timed LOG ENV...: runs the example under `env ENV...` (with $extra as
# more arguments), prints "wall exit".
timed() {
    local log="$1" t0 t1 rc
    shift
    t0=$(date +%s.%N)
    set +e
    # shellcheck disable=SC2086
    env "$@" "$EX" --bytes 4096 --iters 1 --timings --dtype "$dtype" $extra >"$log" 2>&1
    rc=$?
    set -e
    t1=$(date +%s.%N)
    echo "$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }') $rc"
}

# field LOG NAME: NAME=value from the example's timings_ms line.
field() { grep -o "$2=[0-9.]*" "$1" | head -n 1 | cut -d= -f2; }

for rep in $(seq 1 "$REPS"); do
    for dtype in f32 bf16 i8; do
        for kernels in cubin ptx ptx-lazy; do
            force=()
            extra=""
            [ "$kernels" != cubin ] && force=(CUDA_PEER_FORCE_PTX=1)
            [ "$kernels" = ptx-lazy ] && extra="--lazy-kernels"
            # cold: no JIT cache
            log="$OUT/coldstart-$dtype-$kernels-cold-$rep.log"
            read -r wall rc < <(timed "$log" CUDA_CACHE_DISABLE=1 "${force[@]}")
            echo "$dtype,$kernels,cold,$rep,$wall,$rc,$(field "$log" contexts),$(field "$log" group_new),$(field "$log" warm_up),$(field "$log" run),$(field "$log" main_total)" >> "$csv"
            # warm: a fresh cache filled by a first run, the second timed
            cache="$(mktemp -d)"
            timed "$OUT/coldstart-$dtype-$kernels-fill-$rep.log" CUDA_CACHE_PATH="$cache" "${force[@]}" >/dev/null
            log="$OUT/coldstart-$dtype-$kernels-warm-$rep.log"
            read -r wall rc < <(timed "$log" CUDA_CACHE_PATH="$cache" "${force[@]}")
            echo "$dtype,$kernels,warm,$rep,$wall,$rc,$(field "$log" contexts),$(field "$log" group_new),$(field "$log" warm_up),$(field "$log" run),$(field "$log" main_total)" >> "$csv"
            rm -rf "$cache"
            tail -n 1 "$csv"
        done
    done
done

# First call of a new (type, reduction) after the group is created: kernels
# loaded at creation (default), then lazily, with cubins and with the PTX
# through a cold cache (the worst case the issue describes).
fc="$OUT/coldstart-first-call.txt"
: > "$fc"
for mode in "" "--lazy-kernels"; do
    for force in "" "CUDA_PEER_FORCE_PTX=1"; do
        echo "== ring_allreduce --bytes 4096 --iters 1 --first-call $mode ${force:-(cubins)} CUDA_CACHE_DISABLE=1" >> "$fc"
        # shellcheck disable=SC2086
        env CUDA_CACHE_DISABLE=1 $force "$EX" --bytes 4096 --iters 1 --first-call $mode 2>&1 | grep -E '^# first call|error' >> "$fc" || true
    done
done
cat "$fc"
echo "coldstart.sh: wrote $csv and $fc"
