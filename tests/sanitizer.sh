#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, synccheck) over the staged GPU
# binaries (../shared/gpu/bundle -> .gpu/), on a GPU machine with the CUDA
# toolkit (no Rust needed):
#
#   tests/sanitizer.sh                          (from the repository root)
#   SANITIZER_RUNS="memcheck:mesh racecheck:mp" tests/sanitizer.sh
#
# Runs (each under a per-run timeout, SANITIZER_TIMEOUT seconds, default 150):
#   copy     P2P and staged copies of every byte, both ways (copy engines
#            only: checks the driver calls and the pinned staging)
#   groups   two collectives tests with small counts (kernels of the ring, the
#            one-shot and the mesh, through the fused-path check at creation)
#   soak     examples/soak, 40 random collectives of at most 1025 elements,
#            every type, op and collective, eager and graph-replayed
#   soak-eager  the same soak with no graphs (for racecheck, below)
#   b2b      examples/soak --back-to-back: 12 batches of 10 random collectives
#            enqueued with nothing synchronised between them, real floats
#            within the per-element bound, up to 6 MiB per rank, lane edges
#            included (two-rank Auto groups reach the mesh above 4 MiB and the
#            one-shot's large lane), groups of 2 to 4 ranks
#   rings    tests/sanitize.rs: the ring forced, 3 to 8 ranks, every
#            collective, back to back
#   oneshot  tests/sanitize.rs: the one-shot forced on 2 and 4 ranks, every
#            lane's edges, the large lane over 5 rounds (20 MiB per rank for
#            2 ranks), and the host lanes (staged links, on one GPU too)
#   mesh     tests/sanitize.rs: the mesh above 4 MiB (2 ranks under Auto, 3
#            and 4 forced), 4 to 6 MiB per rank
#   staged   the staged path's chunks: the Comm's, 2 to 4 thread ranks on a
#            4 KiB staging buffer (tests/comm.rs), and the group's staged
#            ring with 64 KiB chunks (tests/sanitize.rs)
#   mp       tests/sanitize.rs: two processes, on the P2P and the staged path,
#            the one-shot on every lane of each and the other collectives over
#            several chunks (4 children in all)
#   twoshot  (not run by default) the per-rank two-shot all-reduce,
#            tests/comm.rs: 2 to 4 thread ranks, P2P and staged, against
#            the one-shot; twoshot-2, twoshot-3 and twoshot-4 take one rank
#            count's test alone, twoshot-long the long messages on 3 ranks
#            (racecheck takes about 300 s for the 2-rank one on an H200:
#            raise SANITIZER_TIMEOUT)
#   mp-full  (not run by default) the multi-process tests' own cases,
#            tests/multiprocess.rs: 2 processes every collective (P2P and
#            staged) and 3 processes every all-reduce (7 children)
# Every run traces every process it counts into a log file of its own
# (--log-file NAME.%p.sanitizer.log). The single-process runs start the
# program under the tool (--target-processes all). The mp runs start the
# test binary as it is, and it starts each child (a rank) under the tool
# through tests/common/procs.rs's CUDA_PEER_TEST_CHILD_WRAPPER: the parent
# only starts and checks its children, and the tool does not follow the
# children the binary spawns (on the H200, 2025.3.1, the children of a
# traced parent logged nothing). A run passes only if the program
# succeeded, the tool found no error, and the logs hold one summary per
# traced process, each with no error (racecheck: no hazard), and no tool
# error line.
# The fused kernels wait for each other at device-side barriers: where a
# tool serializes kernels, a barrier times out after 10 s into a typed
# error (no hang): Auto groups fall back to the ring (their logs say so)
# and a forced mesh or one-shot fails its creation check (FusedUnverified),
# which fails the run. Logs (the tool's and the program's) and a summary go
# to $OUT/sanitizer/ (or target/sanitizer/). Exit 0 only if every run
# passed.
set -uo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.." || exit 1
found_san=(/usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer)
san=$(command -v compute-sanitizer || echo "${found_san[0]:-}")
if [ -z "$san" ]; then
  echo "sanitizer.sh: no compute-sanitizer (CUDA toolkit) here" >&2
  exit 2
fi
out=${OUT:+$OUT/sanitizer}
out=${out:-target/sanitizer}
mkdir -p "$out"
limit=${SANITIZER_TIMEOUT:-150}
# Up to 8 ranks as threads share one device here: a work queue per stream
# (docs/multiprocess.md, "Ranks sharing a device").
export CUDA_PEER_REQUIRE_GPU=1 NCCL_NVLS_ENABLE=0 RUST_BACKTRACE=1 CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
bin() {
  local f=(.gpu/tests/*-"$1"-test)
  echo "${f[0]:-}"
}
copy=$(bin copy)
coll=$(bin collectives)
comm=$(bin comm)
mp=$(bin multiprocess)
sanitize=$(bin sanitize)
soak=.gpu/examples/soak
"$san" --version | tail -1 | tee "$out/summary.txt"
status=0

# run TOOL NAME PROCESSES COMMAND...: runs COMMAND under TOOL (a run named
# mp*: its children, see above), every traced process into NAME's log of
# its own, and checks the logs: PROCESSES summaries (one per traced
# process), each clean.
run() {
  local tool=$1 name=$2 procs=$3; shift 3
  local start=$SECONDS base="$out/$tool-$name"
  rm -f "$base".*.sanitizer.log
  local tool_args=(--tool "$tool" --error-exitcode 99 --print-limit 50 --log-file "$base.%p.sanitizer.log")
  case $name in
    mp*) CUDA_PEER_TEST_CHILD_WRAPPER="$san ${tool_args[*]}" timeout -k 10 "$limit" "$@" > "$base.program.log" 2>&1 ;;
    *) timeout -k 10 "$limit" "$san" "${tool_args[@]}" --target-processes all "$@" > "$base.program.log" 2>&1 ;;
  esac
  local rc=$?
  local logs=("$base".*.sanitizer.log)
  local summary clean
  if [ "$tool" = racecheck ]; then
    summary='RACECHECK SUMMARY: [0-9]+ hazards?'
    clean='RACECHECK SUMMARY: 0 hazards displayed \(0 errors, 0 warnings\)'
  else
    summary='ERROR SUMMARY: [0-9]+ errors?'
    clean='ERROR SUMMARY: 0 errors'
  fi
  local found=0 dirty=0 tool_errors=0 f
  for f in "${logs[@]}"; do
    found=$((found + $(grep -Ec "$summary" "$f")))
    dirty=$((dirty + $(grep -E "$summary" "$f" | grep -Evc "$clean")))
    # racecheck's and synccheck's summaries come with memcheck-style ones
    # too in some versions: any error count but 0 is an error.
    dirty=$((dirty + $(grep -Eo 'ERROR SUMMARY: [0-9]+ errors?' "$f" | grep -vc 'ERROR SUMMARY: 0 errors')))
    tool_errors=$((tool_errors + $(grep -Ec '^=+ (Internal Sanitizer Error|Error)' "$f")))
  done
  local what=ok
  case $rc in
    0) ;;
    99) what="SANITIZER ERRORS" ;;
    124|137) what="TIMEOUT after ${limit}s" ;;
    *) what="program failed" ;;
  esac
  if [ "$what" = ok ]; then
    if [ "$dirty" -ne 0 ]; then what="SANITIZER ERRORS in a summary"
    elif [ "$tool_errors" -ne 0 ]; then what="TOOL ERROR lines"
    elif [ "$found" -ne "$procs" ]; then what="$found summaries for $procs processes"
    fi
  fi
  [ "$what" = ok ] || status=1
  local last
  last=$(cat "${logs[@]}" /dev/null | grep -Eo "${summary}[^)]*\)?" | sort | uniq -c | tr -s ' ' | paste -sd ';' -)
  echo "$tool $name: rc=$rc ($what) in $((SECONDS - start)) s; ${#logs[@]} logs, $found of $procs process summaries:${last:- none}" | tee -a "$out/summary.txt"
}

# need NAME BINARY: the binary a run needs is staged, or the run fails.
need() {
  [ -n "$2" ] && [ -x "$2" ] && return 0
  echo "sanitizer.sh: $1: no staged $1 binary (run ../shared/gpu/bundle)" | tee -a "$out/summary.txt" >&2
  status=1
  return 1
}

copy_args=("$copy" --test-threads=1 --exact p2p_copies_every_byte_both_ways staged_copies_every_byte_both_ways)
coll_args=("$coll" --test-threads=1 --exact single_rank_group_is_identity bad_input_is_refused)
soak_args=("$soak" --iters 40 --max-ranks 2 --max-count 1025 --graph-every 4 --seed 16)
# racecheck loses track of kernels launched from CUDA graphs ("Internal
# Sanitizer Error: Detected a failure to track a kernel launch", seen on
# H200, compute-sanitizer 2025.3.1, counted as an error): soak-eager is the
# same soak with no graphs, for racecheck; memcheck and synccheck run the
# soak with graphs. The back-to-back soak and tests/sanitize.rs use none.
soak_eager_args=("$soak" --iters 40 --max-ranks 2 --max-count 1025 --graph-every 0 --seed 16)
b2b_args=("$soak" --back-to-back --iters 12 --batch 10 --max-ranks 4 --max-bytes $((6 << 20)) --seed 7)
rings_args=("$sanitize" --test-threads=1 --exact ring_of_three_to_eight_ranks)
oneshot_args=("$sanitize" --test-threads=1 --exact oneshot_every_lane)
mesh_args=("$sanitize" --test-threads=1 --exact mesh_above_4_mib)
staged_comm_args=("$comm" --test-threads=1 --exact threads_every_collective_type_and_op_on_the_staged_path)
staged_ring_args=("$sanitize" --test-threads=1 --exact staged_ring_rotation)
# twoshot_test N: the two-shot test on N ranks.
twoshot_test() { echo "threads_two_shot_all_reduces_match_the_cpu_and_the_one_shot_on_$1_ranks"; }
twoshot_long=threads_two_shot_long_all_reduces_match_the_cpu_and_the_one_shot
twoshot_args=("$comm" --test-threads=1 --exact "$(twoshot_test 2)" "$(twoshot_test 3)" "$(twoshot_test 4)" "$twoshot_long")
# A parent and two children per test.
mp_args=("$sanitize" --test-threads=1 --exact two_processes_every_lane two_processes_staged_every_lane_and_chunk)
mp_full_args=("$mp" --test-threads=1 --exact two_processes_every_collective_type_and_op two_processes_staged_every_collective_type_and_op three_processes_all_reduce_every_type_and_op)
# SANITIZER_RUNS picks a subset ("tool:name ...", e.g. "memcheck:soak").
default_runs="memcheck:copy memcheck:groups memcheck:soak memcheck:b2b memcheck:rings memcheck:oneshot memcheck:mesh memcheck:staged memcheck:mp
  racecheck:groups racecheck:soak-eager racecheck:b2b racecheck:rings racecheck:oneshot racecheck:mesh racecheck:mp
  synccheck:groups synccheck:soak synccheck:b2b synccheck:rings synccheck:oneshot synccheck:mesh synccheck:staged synccheck:mp"
runs=${SANITIZER_RUNS:-$default_runs}
for r in $runs; do
  tool=${r%%:*}
  case ${r#*:} in
    copy) need copy "$copy" && run "$tool" copy 1 "${copy_args[@]}" ;;
    groups) need collectives "$coll" && run "$tool" groups 1 "${coll_args[@]}" ;;
    soak) need soak "$soak" && run "$tool" soak 1 "${soak_args[@]}" ;;
    soak-eager) need soak "$soak" && run "$tool" soak-eager 1 "${soak_eager_args[@]}" ;;
    b2b) need soak "$soak" && run "$tool" b2b 1 "${b2b_args[@]}" ;;
    rings) need sanitize "$sanitize" && run "$tool" rings 1 "${rings_args[@]}" ;;
    oneshot) need sanitize "$sanitize" && run "$tool" oneshot 1 "${oneshot_args[@]}" ;;
    mesh) need sanitize "$sanitize" && run "$tool" mesh 1 "${mesh_args[@]}" ;;
    staged)
      need comm "$comm" && run "$tool" staged-comm 1 "${staged_comm_args[@]}"
      need sanitize "$sanitize" && run "$tool" staged-ring 1 "${staged_ring_args[@]}" ;;
    mp) need sanitize "$sanitize" && run "$tool" mp 4 "${mp_args[@]}" ;;
    twoshot) need comm "$comm" && run "$tool" twoshot 1 "${twoshot_args[@]}" ;;
    twoshot-[234]) need comm "$comm" && run "$tool" "${r#*:}" 1 "$comm" --test-threads=1 --exact "$(twoshot_test "${r##*-}")" ;;
    twoshot-long) need comm "$comm" && run "$tool" twoshot-long 1 "$comm" --test-threads=1 --exact "$twoshot_long" ;;
    mp-full) need multiprocess "$mp" && run "$tool" mp-full 7 "${mp_full_args[@]}" ;;
    *) echo "sanitizer.sh: unknown run $r" | tee -a "$out/summary.txt" >&2; status=1 ;;
  esac
done
# Where the fused kernels fell back or skipped, the program logs say so.
grep -h "SKIPPED\|using the ring\|FusedUnverified" "$out"/*.program.log 2>/dev/null | sort | uniq -c | head -20 | tee -a "$out/summary.txt"
echo "sanitizer.sh: $([ $status -eq 0 ] && echo PASS || echo FAIL); logs in $out" | tee -a "$out/summary.txt"
exit $status
