#!/usr/bin/env bash
# Runs tests/fault_shim.rs under the fakecuda shim, once per mode, on a GPU
# machine (needs gcc, no Rust): builds the shim with gcc (build.sh), puts it
# first on LD_LIBRARY_PATH in front of the real driver, and runs the staged
# test binary (from ../shared/gpu/bundle: .gpu/tests/*-fault_shim-test) with
# CUDA_PEER_REQUIRE_GPU=1 and CUDA_PEER_FAKE_EXPECTED=1, so a test that does
# not find the shim, or a GPU, fails instead of skipping. As a check that
# the shim passes through when it is not lying, the copy tests also run
# under it in mode "off", and the doctor (.gpu/bin/cuda-peer, when staged)
# must judge the lying pairs degraded, never P2P.
#
# A mode passes only if the binary exits 0 and each of the mode's own tests
# (own_tests below) ran to its end under it: printed its last line,
# "<test>: ran to its end under fakecuda mode <mode>". A test that skipped
# (another mode, too few GPUs for the part that needs the mode) or stopped
# early has no such line, and the mode fails.
#
# Which modes run follows the GPUs there are (nvidia-smi -L, within
# CUDA_VISIBLE_DEVICES; FAKECUDA_GPUS=N overrides): with two or more, every
# mode; with one, the modes that lie about device 0 (fail-module-load=0,
# drop-sm-stores=0, corrupt-fused-results=0), the others named in the
# summary as not run (FAKECUDA_REQUIRE_ALL=1 fails the run for them).
#
#   tests/fakecuda/run.sh [TEST_BINARY]      (from the repository root)
#
# Logs and a summary go to $OUT/fakecuda/ (or target/fakecuda-results/).
# FAKECUDA_TIMEOUT bounds each mode's run (seconds, default 300).
# Exit 0 only if every mode run passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
bin=${1:-$(ls .gpu/tests/*-fault_shim-test 2>/dev/null | head -1)}
if [ -z "$bin" ] || [ ! -x "$bin" ]; then
  echo "fakecuda/run.sh: no fault_shim test binary (stage it with ../shared/gpu/bundle, carry .gpu)" >&2
  exit 1
fi
results=${OUT:-target}/fakecuda
[ -n "${OUT:-}" ] || results=target/fakecuda-results
mkdir -p "$results"
shim=$PWD/target/fakecuda
tests/fakecuda/build.sh "$shim" | tee "$results/build.txt"
if [ ! -e "$shim/libcuda-real.so.1" ]; then
  echo "fakecuda/run.sh: no real driver found (ldconfig -p has no libcuda.so.1; set CUDA_PEER_REAL_LIBCUDA)" >&2
  exit 1
fi
# No doctor's cache (crate::verdict): the copy tests' Auto links must meet the driver.
export CUDA_PEER_REQUIRE_GPU=1 CUDA_PEER_FAKE_EXPECTED=1 RUST_BACKTRACE=1 CUDA_PEER_NO_DOCTOR_CACHE=1
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="$shim${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
status=0
summary="$results/summary.txt"
: > "$summary"
run() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" > "$results/$name.txt" 2>&1
  local rc=$?
  local line
  line=$(grep -E '^test result:' "$results/$name.txt" | tail -1)
  echo "$name: rc=$rc in $((SECONDS - start)) s; ${line:-no test result line}" | tee -a "$summary"
  [ "$rc" -eq 0 ] || status=1
}
# Each mode's own tests in tests/fault_shim.rs: the tests that must run to
# their end under it.
own_tests() {
  case $1 in
    peer-unavailable) echo peer_unavailable_falls_back_or_errors ;;
    corrupt-peer-copies) echo corrupt_peer_copies_are_caught corrupt_peer_copies_reach_unverified_p2p per_rank_comms_under_corrupt_peer_copies_fall_back_to_staged ;;
    fail-module-load=*) echo failed_module_load_is_an_error_and_leaves_the_rest_working ;;
    drop-sm-stores=*) echo dropped_sm_stores_leave_the_ring_or_a_typed_error per_rank_comms_under_lying_fused_kernels_fail_their_check ;;
    corrupt-fused-results=*) echo corrupt_fused_results_fail_the_creation_check corrupt_fused_results_reach_an_unchecked_group per_rank_comms_under_lying_fused_kernels_fail_their_check ;;
    fail-call=cuMemcpyPeerAsync:*) echo failed_ring_pull_leaves_no_read_of_a_returned_buffer ;;
    fail-call=cuMemcpyDtoHAsync_v2:* | fail-call=cuEventRecord:*) echo failed_verification_frees_nothing_its_copies_touch ;;
    *) return 1 ;;
  esac
}
run_mode() {  # mode
  local mode=$1 name="mode-${1//[=:@]/-}" tests missing="" t
  CUDA_PEER_FAKE=$mode run "$name" "${FAKECUDA_TIMEOUT:-300}" "$bin" --test-threads=1 --nocapture
  if ! tests=$(own_tests "$mode"); then
    echo "$name: WRONG: no own tests named for mode $mode (own_tests in run.sh)" | tee -a "$summary"
    status=1
    return
  fi
  for t in $tests; do
    grep -qF "$t: ran to its end under fakecuda mode $mode" "$results/$name.txt" || missing="$missing $t"
  done
  if [ -n "$missing" ]; then
    echo "$name: WRONG: its own tests did not run to their end:$missing" | tee -a "$summary"
    status=1
  else
    echo "$name: its own tests ran to their end: $tests" | tee -a "$summary"
  fi
}
gpus=${FAKECUDA_GPUS:-}
if [ -z "$gpus" ]; then
  gpus=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU ')
  if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
    visible=$(printf '%s' "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
    [ "$visible" -ge "$gpus" ] || gpus=$visible
  fi
fi
# The fail-call modes: the second direction's readback copy of a link
# verification fails, or the event recorded after it; a ring all-gather pull
# fails on the second rank (tests/fault_shim.rs says what each checks).
two_gpu_modes="peer-unavailable corrupt-peer-copies fail-module-load=1 drop-sm-stores=1 corrupt-fused-results=1
  corrupt-fused-results=0 fail-call=cuMemcpyDtoHAsync_v2:2@restart fail-call=cuEventRecord:3@cuMemcpyDtoHAsync_v2:2
  fail-call=cuMemcpyPeerAsync:2@restart"
one_gpu_modes="fail-module-load=0 drop-sm-stores=0 corrupt-fused-results=0"
echo "fakecuda/run.sh: $gpus GPUs" | tee -a "$summary"
if [ "$gpus" -ge 2 ]; then
  modes=$two_gpu_modes
else
  modes=$one_gpu_modes
  not_run=$(for m in $two_gpu_modes; do case " $one_gpu_modes " in *" $m "*) ;; *) printf ' %s' "$m" ;; esac; done)
  echo "not run (they need 2 GPUs, $gpus present):$not_run" | tee -a "$summary"
  [ "${FAKECUDA_REQUIRE_ALL:-0}" != 1 ] || status=1
fi
for mode in $modes; do
  run_mode "$mode"
done
copy=$(ls .gpu/tests/*-copy-test 2>/dev/null | head -1)
if [ -n "$copy" ]; then
  CUDA_PEER_FAKE=off run "mode-off-copy-tests" "${FAKECUDA_TIMEOUT:-300}" "$copy" --test-threads=1
fi
# The doctor under the lies (issue 18): a pair whose peer copies are corrupt,
# whose peer access cannot be enabled, whose SM peer stores never arrive
# (fused kernels dropped on device 1), or whose fused kernels' results land
# wrong on device 1, must not be judged P2P (exit 1, degraded, or 2 where it
# also distrusts the driver's own copy, which the shim corrupts too). Its
# check children inherit the shim. It needs a pair: two GPUs.
doctor=.gpu/bin/cuda-peer
if [ -x "$doctor" ] && [ "$gpus" -ge 2 ]; then
  for mode in corrupt-peer-copies peer-unavailable drop-sm-stores=1 corrupt-fused-results=1; do
    name="doctor-${mode//=/-}"
    start=$SECONDS
    CUDA_PEER_FAKE=$mode timeout -k 10 120 "$doctor" doctor --json --no-cache > "$results/$name.json" 2> "$results/$name.err"
    rc=$?
    verdicts=$(python3 -c 'import json, sys
d = json.load(open(sys.argv[1]))
print(" ".join("%s->%s:%s/%s" % (p["from"], p["to"], p["level"], p["use_path"]) for p in d["pairs"]))' "$results/$name.json" 2>"$results/$name.parse.err")
    ok=1
    [ "$rc" -eq 1 ] || [ "$rc" -eq 2 ] || ok=0
    [ -n "$verdicts" ] || ok=0
    case " $verdicts" in *"/p2p"*) ok=0 ;; esac
    echo "$name: rc=$rc in $((SECONDS - start)) s; pairs: ${verdicts:-none}; $([ $ok -eq 1 ] && echo ok || echo WRONG: expected exit 1 or 2 and no pair on p2p)" | tee -a "$summary"
    [ $ok -eq 1 ] || status=1
  done
fi
echo "fakecuda/run.sh: $([ $status -eq 0 ] && echo PASS || echo FAIL); logs in $results" | tee -a "$summary"
exit $status
