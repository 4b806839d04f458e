#!/usr/bin/env bash
# The GPU evidence the open issues ask for, in phases, for a device call
# with a staged bundle (../shared/gpu/bundle and bench/pack-gpu.sh; carry
# .gpu.txz and unpack first). Each phase writes under $OUT/<phase>/, prints
# one summary line, and is packed into $OUT/<phase>.tgz as soon as it ends
# (the device returns only a few files, and a call cut short still returns
# the phases that finished).
#
#   BUNDLE_PACK=1 ../shared/gpu/bundle && OLD_BENCH=... bench/pack-gpu.sh   (here; then carry .gpu.txz)
#   python3 -c "import tarfile; tarfile.open('.gpu.txz').extractall()" && bash bench/gpu-evidence.sh tests alone fault
#   bash bench/gpu-evidence.sh soak sanitizer mp oldnew   (OLD defaults to .gpu/old/cuda-peer-bench)
#
# Phases (about how long each takes on 2x H200):
#   tests      every test binary, sharded (bench/gpu-tests-parallel.sh; SHARDS, default 4: leave
#              CUDA_DEVICE_MAX_CONNECTIONS unset, the script sets it where needed, and 8 shards
#              with 32 queues each ran out of memory creating contexts on one H200), ~3 min
#   alone      raw and copy tests alone (their memory and timing checks), ~1 min
#   fault      tests/fakecuda/run.sh: every lying-driver mode and the doctor under it, ~3-5 min
#   edges      tests/edges.rs and the three-process abort test alone (their timing bounds), ~1 min
#   soak       10,000 randomized collectives (examples/soak), ~2 min
#   b2b        examples/soak --back-to-back: batches enqueued with no synchronisation, real floats, ~1-2 min
#              (one H200, ranks sharing it: ~3.5 min for the default 120 batches); the soak measures its
#              resident set after malloc_trim, so glibc's per-thread arenas do not count (soak-b2b-arenas/)
#   rsoak      examples/soak --per-rank: RSOAK_ITERS (default 3000) randomized calls over per-rank Comms
#   rb2b       examples/soak --per-rank --back-to-back: RB2B_ITERS (default 60) batches of 16
#              (both with 32 hardware work queues, as thread ranks sharing a device want, and glibc's
#              arenas bounded, fewer for the soak's per-call rank threads to fill)
#   sanitizer  compute-sanitizer memcheck/racecheck/synccheck (tests/sanitizer.sh; SANITIZER_RUNS picks
#              runs, SANITIZER_PHASE bounds the phase, default 900 s)
#   planted    tests/planted/run.sh: each planted defect must fail its tests (carry planted.txz from tests/planted/build.sh), ~2 min
#   mp         cuda-peer-bench mp-allreduce under cuda-peer-run -n 2, ~3 min
#   oldnew     bench/oldnew.sh $OLD against .gpu/bin/cuda-peer-bench, 8 rounds, ~1 min
#   mpab       bench/mpab.sh $PREV against .gpu/bin/cuda-peer-bench, mp-allreduce, 3 rounds, ~1-2 min
#   sweep      cuda-peer-bench all-reduce sweep against NCCL, 4 B-1 GiB (the README's table), ~2 min
#   twoshot    cuda-peer-bench p2p --ops allreduce, the per-rank engine's one-shot and two-shot side by
#              side on 3, 4 and 8 thread ranks over the GPUs there are (TWOSHOT_RANKS, TWOSHOT_MAX bytes,
#              MACHINE names the CSVs: {MACHINE}-r{n}-{algorithm}-p2p.csv), f32, sizes x4
#   p2pab      cuda-peer-bench p2p of $OLD (prev) and of this tree (new) side by side: sendrecv and alltoall,
#              f32, to P2PAB_MAX bytes (default 4 MiB), on 2 and 4 ranks (P2PAB_RANKS; thread ranks sharing the
#              GPUs there are), P2PAB_ROUNDS rounds (default 3) of prev then new, new first in even rounds;
#              bench/mpab.py's medians in summary.txt, ~10 s a round on one H200
#   p2pnccl    cuda-peer-bench p2p --ops sendrecv,alltoall,allreduce against NCCL in the same run (issue 29's
#              benchmark: f32 and bf16, 4 B-1 GiB, every rank on its own GPU; MACHINE names the CSVs, default
#              h200x2); NCCL needs a GPU per rank, so on one GPU its rows are skipped
#   groupvs    cuda-peer-bench p2p --ops allreduce --group: the per-rank engine and the single-process
#              Group side by side on 2 and 4 thread ranks (GROUPVS_RANKS), P2P and staged, over the GPUs
#              there are (MACHINE names the CSVs: {MACHINE}-r{n}-{path}-p2p.csv), f32, sizes x4 to
#              GROUPVS_MAX bytes (default 256 MiB)
#   callorder  cuda-peer-bench p2p --ops allreduce --group --after-capture: the per-rank engine and the Group,
#              each before and after a captured call (the cost of ordering eager calls with replays), on 2
#              thread ranks over the GPUs there are, P2P and staged, f32, sizes x4 to CALLORDER_MAX bytes
#              (default 16 MiB), CALLORDER_ROUNDS rounds (default 3; MACHINE names the CSVs), ~1 min a round
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:?set OUT (the device sets it)}"
export NCCL_NVLS_ENABLE=0 CUDA_PEER_NO_DOCTOR_CACHE=1
status=0
line() { echo "$*" | tee -a "$OUT/evidence-summary.txt"; }
phase() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  mkdir -p "$OUT/$name"
  local start=$SECONDS
  OUT="$OUT/$name" timeout -k 10 "$limit" "$@" > "$OUT/$name/output.txt" 2>&1
  local rc=$?
  line "$name: rc=$rc in $((SECONDS - start)) s ($(date -u +%T))"
  (cd "$OUT" && tar czf "$name.tgz" "$name" && rm -rf "$name")
  [ "$rc" -eq 0 ] || status=1
}
line "gpu-evidence: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1), $(date -u +%FT%TZ)"
for p in "$@"; do
  case "$p" in
    tests) ALONE="thousand_copy_cycles_return_device_memory a_timeout_between_processes_frees_the_peers_early" SHARDS=${SHARDS:-4} SHARD_TIMEOUT=260 phase tests 300 bash bench/gpu-tests-parallel.sh ;;
    alone) CUDA_PEER_REQUIRE_GPU=1 phase alone 200 bash -c 'for t in .gpu/tests/*-raw-test .gpu/tests/*-copy-test; do echo "== $t"; "$t" --test-threads=1 || exit 1; done' ;;
    edges) CUDA_PEER_REQUIRE_GPU=1 phase edges 200 bash -c 'for t in .gpu/tests/*-edges-test; do "$t" --test-threads=1 --nocapture || exit 1; done; for t in .gpu/tests/*-multiprocess-test; do "$t" --exact a_timeout_between_processes_frees_the_peers_early --nocapture || exit 1; done' ;;
    fault) FAKECUDA_TIMEOUT=70 phase fault 420 tests/fakecuda/run.sh ;;
    soak) phase soak 200 .gpu/examples/soak --iters 10000 --seed 16 --max-ranks 8 ;;
    b2b) phase b2b 300 .gpu/examples/soak --back-to-back --iters "${B2B_ITERS:-120}" --batch 16 ;;
    rsoak) CUDA_DEVICE_MAX_CONNECTIONS=32 MALLOC_ARENA_MAX=4 phase rsoak 240 .gpu/examples/soak --per-rank --iters "${RSOAK_ITERS:-3000}" --seed 16 --max-ranks 8 ;;
    rb2b) CUDA_DEVICE_MAX_CONNECTIONS=32 MALLOC_ARENA_MAX=4 phase rb2b 300 .gpu/examples/soak --per-rank --back-to-back --iters "${RB2B_ITERS:-60}" --batch 16 ;;
    sanitizer) SANITIZER_TIMEOUT=150 phase sanitizer "${SANITIZER_PHASE:-900}" tests/sanitizer.sh ;;
    planted) phase planted 600 bash -c 'python3 -c "import tarfile; tarfile.open(\"planted.txz\").extractall(\".\")" && bash out/run.sh' ;;
    mp) phase mp 300 .gpu/bin/cuda-peer-run -n 2 -- .gpu/bin/cuda-peer-bench mp-allreduce --machine h200x2 --out "$OUT/mp" ;;
    oldnew) phase oldnew 300 bench/oldnew.sh "${OLD:-.gpu/old/cuda-peer-bench}" .gpu/bin/cuda-peer-bench 8 ;;
    mpab) phase mpab 300 bench/mpab.sh "${PREV:-.gpu/prev/cuda-peer-bench}" .gpu/bin/cuda-peer-bench "${MPAB_ROUNDS:-3}" ;;
    sweep) phase sweep 300 .gpu/bin/cuda-peer-bench --machine h200x2 --ops all_reduce --out "$OUT/sweep" ;;
    twoshot) phase twoshot 420 bash -c 'for n in ${TWOSHOT_RANKS:-3 4 8}; do for a in one-shot two-shot; do
               .gpu/bin/cuda-peer-bench p2p --ops allreduce --dtypes f32 --ranks "$n" --all-reduce "$a" --quick \
                 --max-bytes "${TWOSHOT_MAX:-268435456}" --machine "${MACHINE:-h200x1}-r$n-$a" --out "$OUT" || exit 1; done; done' ;;
    groupvs) phase groupvs 540 bash -c 'for n in ${GROUPVS_RANKS:-2 4}; do for p in p2p staged; do
               .gpu/bin/cuda-peer-bench p2p --ops allreduce --dtypes f32 --ranks "$n" --path "$p" --group --quick \
                 --max-bytes "${GROUPVS_MAX:-268435456}" --machine "${MACHINE:-h200x1}-r$n-$p" --out "$OUT" || s=1; done; done; exit ${s:-0}' ;;
    callorder) phase callorder 540 bash -c 'for k in $(seq "${CALLORDER_ROUNDS:-3}"); do for p in p2p staged; do
                 .gpu/bin/cuda-peer-bench p2p --ops allreduce --dtypes f32 --ranks 2 --path "$p" --group --after-capture --quick \
                   --max-bytes "${CALLORDER_MAX:-16777216}" --machine "${MACHINE:-h200x1}-$p-$k" --out "$OUT" || s=1; done; done; exit ${s:-0}' ;;
    p2pnccl) phase p2pnccl 560 .gpu/bin/cuda-peer-bench p2p --ops sendrecv,alltoall,allreduce --machine "${MACHINE:-h200x2}" --out "$OUT" ;;
    p2pab) P2PAB_OLD="${OLD:-.gpu/old/cuda-peer-bench}" phase p2pab 300 bash -c 'for k in $(seq "${P2PAB_ROUNDS:-3}"); do order="prev new"; [ $((k % 2)) -eq 0 ] && order="new prev"
             for n in ${P2PAB_RANKS:-2 4}; do for side in $order; do
               b=.gpu/bin/cuda-peer-bench; [ "$side" = prev ] && b=$P2PAB_OLD
               "$b" p2p --ranks "$n" --ops sendrecv,alltoall --dtypes f32 --max-bytes "${P2PAB_MAX:-4194304}" \
                 --machine "$side-r$n-$k" --out "$OUT/$side-r$n-$k" > "$OUT/$side-r$n-$k.txt" || exit 1; done; done; done
               python3 bench/mpab.py "$OUT" > "$OUT/summary.txt"' ;;
    *) line "unknown phase $p"; status=1 ;;
  esac
done
cat "$OUT/evidence-summary.txt"
exit $status
