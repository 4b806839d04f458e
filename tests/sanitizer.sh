#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, synccheck) over a representative,
# quick subset of the staged GPU binaries (../shared/gpu/bundle -> .gpu/), on
# a GPU machine with the CUDA toolkit (no Rust needed):
#
#   tests/sanitizer.sh            (from the repository root)
#
# Runs (each under a per-run timeout, SANITIZER_TIMEOUT seconds, default 90):
#   copy    P2P and staged copies of every byte, both ways (copy engines only:
#           checks the driver calls and the pinned staging)
#   groups  two collectives tests with small counts (kernels of the ring, the
#           one-shot and the mesh, through the fused-path check at creation)
#   soak    examples/soak, 40 random collectives of at most 1025 elements,
#           every type, op and collective, eager and graph-replayed
#   soak-eager  the same soak with no graphs (for racecheck, below)
#   rings   the ring of 3 to 8 ranks of one process (every type), sharing the
#           GPUs present (copies and reduction kernels, no device barrier)
#   mp      processes (2 and 3, each its own context, sharing the GPUs
#           present): every collective, every type and op, P2P and staged,
#           one-shot lanes included (--target-processes all)
# memcheck runs copy, groups and soak; racecheck and synccheck (shared memory
# and __syncthreads hazards) the two with kernels (SANITIZER_RUNS picks others). The fused kernels wait for
# each other across GPUs at device-side barriers: where a tool serializes
# kernels, a barrier times out after 10 s into a typed error (no hang), the
# fused-path check fails, and Auto groups fall back to the ring; the logs say
# so. Logs (the tool's and the program's) and a summary go to
# $OUT/sanitizer/ (or target/sanitizer/). Exit 0 only if every run ended
# with no sanitizer error and the program's success.
set -uo pipefail
cd "$(dirname "$0")/.."
san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -z "$san" ]; then
  echo "sanitizer.sh: no compute-sanitizer (CUDA toolkit) here" >&2
  exit 2
fi
out=${OUT:+$OUT/sanitizer}
out=${out:-target/sanitizer}
mkdir -p "$out"
limit=${SANITIZER_TIMEOUT:-90}
export CUDA_PEER_REQUIRE_GPU=1 NCCL_NVLS_ENABLE=0 RUST_BACKTRACE=1
copy=$(ls .gpu/tests/*-copy-test 2>/dev/null | head -1)
coll=$(ls .gpu/tests/*-collectives-test 2>/dev/null | head -1)
mp=$(ls .gpu/tests/*-multiprocess-test 2>/dev/null | head -1)
soak=.gpu/examples/soak
for b in "$copy" "$coll" "$soak"; do
  if [ -z "$b" ] || [ ! -x "$b" ]; then
    echo "sanitizer.sh: missing staged binary (copy, collectives test or examples/soak): run ../shared/gpu/bundle and carry .gpu" >&2
    exit 1
  fi
done
"$san" --version | tail -1 | tee "$out/summary.txt"
status=0
run() {  # tool, name, command...
  local tool=$1 name=$2; shift 2
  local start=$SECONDS
  timeout -k 10 "$limit" "$san" --tool "$tool" --target-processes all --error-exitcode 99 --print-limit 50 \
    --log-file "$out/$tool-$name.sanitizer.log" "$@" > "$out/$tool-$name.program.log" 2>&1
  local rc=$?
  local errors
  errors=$(grep -Eo 'ERROR SUMMARY: [0-9]+ errors?|RACECHECK SUMMARY: [0-9]+ hazards?[^)]*' "$out/$tool-$name.sanitizer.log" 2>/dev/null | tail -1)
  local what=ok
  case $rc in 0) ;; 99) what="SANITIZER ERRORS"; status=1 ;; 124|137) what="TIMEOUT after ${limit}s"; status=1 ;; *) what="program failed"; status=1 ;; esac
  echo "$tool $name: rc=$rc ($what) in $((SECONDS - start)) s; ${errors:-no summary line}" | tee -a "$out/summary.txt"
}
copy_args=("$copy" --test-threads=1 --exact p2p_copies_every_byte_both_ways staged_copies_every_byte_both_ways)
coll_args=("$coll" --test-threads=1 --exact single_rank_group_is_identity bad_input_is_refused)
soak_args=("$soak" --iters 40 --max-ranks 2 --max-count 1025 --graph-every 4 --seed 16)
rings_args=("$coll" --test-threads=1 --exact larger_rings_every_type)
mp_args=("$mp" --test-threads=1 --exact two_processes_every_collective_type_and_op two_processes_staged_every_collective_type_and_op three_processes_all_reduce_every_type_and_op)
# racecheck loses track of kernels launched from CUDA graphs ("Internal
# Sanitizer Error: Detected a failure to track a kernel launch", seen on
# H200, compute-sanitizer 2025.3.1, counted as an error): soak-eager is the
# same soak with no graphs, for racecheck; memcheck and synccheck run the
# soak with graphs.
soak_eager_args=("$soak" --iters 40 --max-ranks 2 --max-count 1025 --graph-every 0 --seed 16)
# SANITIZER_RUNS picks a subset ("tool:name ...", e.g. "memcheck:soak").
runs=${SANITIZER_RUNS:-memcheck:copy memcheck:groups memcheck:soak memcheck:rings memcheck:mp racecheck:groups racecheck:soak-eager synccheck:groups synccheck:soak}
for r in $runs; do
  tool=${r%%:*}
  case ${r#*:} in
    copy) run "$tool" copy "${copy_args[@]}" ;;
    groups) run "$tool" groups "${coll_args[@]}" ;;
    soak) run "$tool" soak "${soak_args[@]}" ;;
    soak-eager) run "$tool" soak-eager "${soak_eager_args[@]}" ;;
    rings) run "$tool" rings "${rings_args[@]}" ;;
    mp) [ -n "$mp" ] && run "$tool" mp "${mp_args[@]}" || { echo "sanitizer.sh: no multiprocess test binary" >&2; status=1; } ;;
    *) echo "sanitizer.sh: unknown run $r" >&2; status=1 ;;
  esac
done
echo "sanitizer.sh: $([ $status -eq 0 ] && echo PASS || echo FAIL); logs in $out" | tee -a "$out/summary.txt"
exit $status
