#!/usr/bin/env bash
# On the GPU machine: runs each planted defect's tests (built by
# tests/planted/build.sh, next to this script) and passes only if every
# listed test fails with its defect, each a test that passes on the library
# as it is. Logs and a summary to $OUT/planted/.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
results=${OUT:-/tmp}/planted
mkdir -p "$results"
rm -f "$results/.missed"
export CUDA_PEER_REQUIRE_GPU=1 NCCL_NVLS_ENABLE=0
status=0
grep -v '^#' "$here/defects.txt" | while read -r patch specs; do
  [ -n "$patch" ] || continue
  name=${patch%.patch}
  for spec in $specs; do
    bin=${spec%%:*}
    IFS=, read -ra tests <<< "${spec#*:}"
    for t in "${tests[@]}"; do
      log=$results/$name.$bin.$t.log
      timeout "${PLANTED_TIMEOUT:-180}" "$here/$name/$bin" --exact "$t" --test-threads=1 > "$log" 2>&1
      rc=$?
      if [ "$rc" -eq 0 ]; then
        echo "NOT CAUGHT  $name  $bin::$t (passed)"
        echo 1 > "$results/.missed"
      else
        echo "caught      $name  $bin::$t (rc=$rc): $(grep -m1 -A1 'panicked' "$log" | tail -1 | cut -c1-200)"
      fi
    done
  done
done | tee "$results/summary.txt"
[ -e "$results/.missed" ] && status=1
exit $status
