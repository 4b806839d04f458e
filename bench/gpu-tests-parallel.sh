#!/usr/bin/env bash
# Runs every staged GPU test binary (../shared/gpu/bundle), each split into
# SHARDS shards run at the same time (one process per shard, one test at a
# time inside it), to fit a small device budget:
#   tar xzf .gpu.tgz && SHARDS=8 bash bench/gpu-tests-parallel.sh
# Writes $OUT/summary.txt and $OUT/results.tgz (every shard's log); exits
# nonzero where a shard failed or was cut off (SHARD_TIMEOUT).
# Tests that read device-wide free memory (ALONE, by default tests/copy.rs's
# thousand_copy_cycles_return_device_memory) would fail here because other
# shards allocate at the same time: they are left out, for a run alone
# (bench/gpu-evidence.sh's phase `alone`, or .gpu/run NAME).
set -u
ALONE=${ALONE:-thousand_copy_cycles_return_device_memory}
export CUDA_PEER_REQUIRE_GPU=1 RUST_BACKTRACE=1 CUDA_PEER_NO_DOCTOR_CACHE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The binaries whose tests run up to 8 ranks as threads on one device get a
# work queue per stream (docs/multiprocess.md, "Ranks sharing a device");
# not every binary: the device holds only so many queues for all the
# contexts the shards open at once (32 each everywhere ran out: context
# creation failed with CUDA_ERROR_OUT_OF_MEMORY).
QUEUES_FOR=${QUEUES_FOR:-p2p comm}
mkdir -p "$OUT/logs"
SHARDS=${SHARDS:-4}
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/logs/gpus.txt" 2>&1
pids=()
names=()
for t in .gpu/tests/*; do
  b=$(basename "$t")
  case "$b" in cuda-peer-cli-*|cuda-peer-bench-*|cuda-peer-run-*|cuda-peer-sys-*) continue ;; esac
  mapfile -t tests < <("$t" --list 2>/dev/null | sed -n 's/: test$//p' | grep -vxF -e "${ALONE// /$'\n'}" || true)
  [ "${#tests[@]}" -eq 0 ] && continue
  n=$SHARDS
  [ "${#tests[@]}" -lt 8 ] && n=1
  for ((s = 0; s < n; s++)); do
    shard=()
    for ((i = s; i < ${#tests[@]}; i += n)); do shard+=("${tests[$i]}"); done
    [ "${#shard[@]}" -eq 0 ] && continue
    queues=
    for q in $QUEUES_FOR; do case "$b" in *-"$q"-test) queues=32 ;; esac; done
    # The others get the driver's default, whatever the caller exported.
    ( if [ -n "$queues" ]; then export CUDA_DEVICE_MAX_CONNECTIONS=$queues; else unset CUDA_DEVICE_MAX_CONNECTIONS; fi
      timeout ${SHARD_TIMEOUT:-200} "$t" --test-threads=1 --exact "${shard[@]}" > "$OUT/logs/$b.$s.log" 2>&1; echo "rc=$?" >> "$OUT/logs/$b.$s.log" ) &
    pids+=($!)
    names+=("$b.$s")
  done
done
for p in "${pids[@]}"; do wait "$p"; done
end=$(date +%s)
{
  echo "GPU tests: $(date -u +%FT%TZ), $(( end - start )) s, $(cat "$OUT/logs/gpus.txt" | head -1)"
  for n in "${names[@]}"; do
    printf '%-60s %s %s\n' "$n" "$(grep -h '^test result' "$OUT/logs/$n.log" | tail -1)" "$(tail -1 "$OUT/logs/$n.log")"
  done
} > "$OUT/summary.txt"
grep -h "^test .* FAILED\|panicked" "$OUT"/logs/*.log | head -40 >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
# Exit nonzero where any shard failed or was cut off (its last line is its rc).
status=0
for n in "${names[@]}"; do
  [ "$(tail -1 "$OUT/logs/$n.log")" = "rc=0" ] || status=1
done
cd "$OUT" && tar czf results.tgz logs summary.txt && rm -rf logs
exit $status
