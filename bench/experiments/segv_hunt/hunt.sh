#!/usr/bin/env bash
# One device call (carry .gpu.txz, from ../shared/gpu/bundle and bench/pack-gpu.sh): racecheck on the
# two-shot tests (3 and 4 ranks), memcheck and synccheck on the long two-shot test, and, side by side,
# two loops of the per-rank P2P-path test under racecheck with segv.c preloaded (on SIGSEGV, SIGBUS or
# SIGILL it prints the fault address, a backtrace and /proc/self/maps, then dies of the signal).
#   bash bench/experiments/segv_hunt/hunt.sh     (HUNT_SECONDS bounds it, default 520)
set -u
cd "$(dirname "$0")/../../.."
gcc -O1 -shared -fPIC -o /tmp/segv.so bench/experiments/segv_hunt/segv.c || exit 1
python3 -c "import tarfile; tarfile.open('.gpu.txz').extractall()" || exit 1
export NCCL_NVLS_ENABLE=0 CUDA_PEER_REQUIRE_GPU=1 RUST_BACKTRACE=1 CUDA_DEVICE_MAX_CONNECTIONS=32
san=/usr/local/cuda/bin/compute-sanitizer
comm=$(ls .gpu/tests/*-comm-test | head -1)
W=$OUT/w; mkdir -p $W/a $W/b $W/c $W/hunt
end=$((SECONDS + ${HUNT_SECONDS:-520}))
( OUT=$W/a SANITIZER_TIMEOUT=500 SANITIZER_RUNS="racecheck:twoshot-3" bash tests/sanitizer.sh > $W/a/run.txt 2>&1 ) &
( OUT=$W/b SANITIZER_TIMEOUT=500 SANITIZER_RUNS="racecheck:twoshot-4" bash tests/sanitizer.sh > $W/b/run.txt 2>&1 ) &
( OUT=$W/c SANITIZER_TIMEOUT=240 SANITIZER_RUNS="memcheck:twoshot-long synccheck:twoshot-long" bash tests/sanitizer.sh > $W/c/run.txt 2>&1 ) &
hunt() {  # loop id
  local k=0
  while [ $((SECONDS + 60)) -lt $end ]; do
    k=$((k + 1))
    local t=$SECONDS f=$W/hunt/$1-$k
    LD_PRELOAD=/tmp/segv.so timeout -k 5 $((end - SECONDS)) "$san" --tool racecheck --error-exitcode 99 --log-file $f.san.log \
      "$comm" --test-threads=1 --exact threads_every_collective_type_and_op_on_the_p2p_path > $f.prog.log 2>&1
    local rc=$?
    echo "hunt $1 run $k: rc=$rc in $((SECONDS - t)) s; $(grep -ho 'RACECHECK SUMMARY.*' $f.san.log | head -1)" | tee -a $W/hunt/summary.txt
    if [ $rc -eq 0 ]; then rm -f $f.prog.log; fi
  done
}
hunt x & hunt y &
wait
cat $W/a/sanitizer/summary.txt $W/b/sanitizer/summary.txt $W/c/sanitizer/summary.txt 2>/dev/null | grep -v '^$'
cat $W/hunt/summary.txt
grep -l segv-trace $W/hunt/*.prog.log 2>/dev/null && grep -h -A40 'segv-trace\] signal' $W/hunt/*.prog.log | head -60
cd $OUT && tar czf w.tgz w && rm -rf w
