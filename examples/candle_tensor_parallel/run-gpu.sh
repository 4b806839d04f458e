#!/usr/bin/env bash
# Runs candle_tensor_parallel on a GPU machine (CUDA 13 libraries and libnccl.so.2
# installed; no Rust needed) and writes every run's JSON and log into OUT_DIR:
#   W=1 reference (no communicator)                       w1.json
#   W=2 over cuda_peer::compat::nccl (on GPU 0 twice with one GPU) w2-cuda-peer.json
#   W=2 over NCCL (cudarc::nccl), only with two GPUs or more  w2-nccl.json
# then the same W=1 / W=2 cuda-peer pair in f32 (TP_F32=0 skips it), each W=2 run
# compared with its reference (compare.txt), the result lines in summary.txt.
#
#   run-gpu.sh OUT_DIR [BIN [NCCL_BIN [CUDA_PEER_RUN]]]
#
# BIN, NCCL_BIN, CUDA_PEER_RUN default to $TP_BIN, $TP_NCCL_BIN, $CUDA_PEER_RUN, else to
# target/candle/tp/candle_tensor_parallel, target/candle/tp/candle_tensor_parallel-nccl
# and target/release/cuda-peer-run beside this script's repository; a binary given as
# .xz or .gz is unpacked into a temporary directory first (not OUT_DIR, which stays small). TP_ARGS: extra arguments for every run
# (e.g. "--small" or "--layers 4 --tokens 64"; default: the full 8-layer model).
# Exit status: 0 when every run and comparison passed. Never changes GPU clocks or modes.
set -uo pipefail
if [ $# -lt 1 ]; then
  sed -n '2,20p' "$0" >&2
  exit 64
fi
out=$1
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bin=${2:-${TP_BIN:-$root/target/candle/tp/candle_tensor_parallel}}
nccl_bin=${3:-${TP_NCCL_BIN:-$root/target/candle/tp/candle_tensor_parallel-nccl}}
runner=${4:-${CUDA_PEER_RUN:-$root/target/release/cuda-peer-run}}
read -r -a extra <<< "${TP_ARGS:-}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
unpacked=$(mktemp -d)

# A binary, unpacked if compressed; empty if missing.
unpack() {
  local f=$1 name
  [ -f "$f" ] || { echo ""; return; }
  name=$(basename "$f")
  case $f in
    *.xz) xz -dc "$f" > "$unpacked/${name%.xz}" && chmod +x "$unpacked/${name%.xz}" && echo "$unpacked/${name%.xz}" ;;
    *.gz) gzip -dc "$f" > "$unpacked/${name%.gz}" && chmod +x "$unpacked/${name%.gz}" && echo "$unpacked/${name%.gz}" ;;
    *) echo "$f" ;;
  esac
}
bin=$(unpack "$bin")
nccl_bin=$(unpack "$nccl_bin")
runner=$(unpack "$runner")
if [ -z "$bin" ] || [ -z "$runner" ]; then
  echo "run-gpu.sh: need the cuda-peer build ($bin) and cuda-peer-run ($runner)" >&2
  exit 64
fi

# NVLink SHARP (multicast) stays off for NCCL on these machines; cuda-peer never uses it.
export NCCL_NVLS_ENABLE=0
# The CUDA 13 libraries, where ldconfig does not already know them.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d
done
# The directory where rank 0 leaves the communicator's id for the other ranks: private
# to this user (mktemp -d makes it 0700), removed at the end.
CANDLE_TP_ID_DIR=$(mktemp -d)
export CANDLE_TP_ID_DIR
trap 'rm -rf "$CANDLE_TP_ID_DIR" "$unpacked"' EXIT

# TP_GPUS overrides the count nvidia-smi gives.
gpus=${TP_GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
gpus=${gpus:-0}
{
  date -u +%FT%TZ
  echo "gpus: $gpus"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv 2>&1 || true
  echo "bin: $bin ($(stat -c %s "$bin") bytes)"
  [ -n "$nccl_bin" ] && echo "nccl_bin: $nccl_bin ($(stat -c %s "$nccl_bin") bytes)"
  echo "runner: $runner"
  echo "TP_ARGS: ${extra[*]:-}"
  echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
  ldconfig -p 2>/dev/null | grep -E 'libnccl.so.2|libcublas.so.13' || true
} > "$out/env.txt"
cat "$out/env.txt"

status=0
# run NAME CMD...: runs it with its output in NAME.log (and on the terminal).
run() {
  local name=$1
  shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" > >(tee "$out/$name.log") 2>&1
  local rc=$?
  echo "== $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$out/$name.log"
  [ $rc -eq 0 ] || status=1
  return $rc
}
# check REF OTHER: compares two runs' JSON (tokens, first-step logits).
check() {
  if [ -f "$out/$1.json" ] && [ -f "$out/$2.json" ]; then
    "$bin" compare "$out/$1.json" "$out/$2.json" 2>&1 | tee -a "$out/compare.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  else
    echo "compare $1 $2: missing JSON" | tee -a "$out/compare.txt"
    status=1
  fi
}
: > "$out/compare.txt"

run w1 "$bin" "${extra[@]}" --out "$out/w1.json"
run w2-cuda-peer "$runner" -n 2 -- "$bin" "${extra[@]}" --out "$out/w2-cuda-peer.json"
check w1 w2-cuda-peer
if [ "$gpus" -ge 2 ] && [ -n "$nccl_bin" ]; then
  run w1-nccl-build "$nccl_bin" "${extra[@]}" --out "$out/w1-nccl-build.json"
  run w2-nccl "$runner" -n 2 -- "$nccl_bin" "${extra[@]}" --out "$out/w2-nccl.json"
  check w1 w2-nccl
else
  echo "== w2-nccl: skipped ($gpus GPU(s): NCCL refuses two ranks on one GPU; or no NCCL build: '$nccl_bin')" | tee "$out/w2-nccl.skipped"
fi
if [ "${TP_F32:-1}" != 0 ]; then
  run w1-f32 "$bin" "${extra[@]}" --dtype f32 --out "$out/w1-f32.json"
  run w2-cuda-peer-f32 "$runner" -n 2 -- "$bin" "${extra[@]}" --dtype f32 --out "$out/w2-cuda-peer-f32.json"
  check w1-f32 w2-cuda-peer-f32
fi
grep -h '^candle_tensor_parallel: build=' "$out"/*.log > "$out/summary.txt" 2>/dev/null
echo "== summary ($out/summary.txt)"
cat "$out/summary.txt" "$out/compare.txt"
echo "run-gpu.sh: exit $status"
exit $status
