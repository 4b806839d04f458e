#!/usr/bin/env bash
# Experiment, not part of the crate or CI: does where the calling process runs
# (which NUMA node's CPUs) explain the process-to-process spread of small
# all-reduces (docs/experiments.md)? Runs the quick small-message
# sweep of cuda-peer and NCCL in several processes, unpinned and pinned to
# each node's CPUs in turn. Needs the bench staged in .gpu/ (../shared/gpu/bundle
# stages .gpu/bin/cuda-peer-bench; before the bench crate: .gpu/examples/bench,
# built with --features nccl). Usage: bench/experiments/cpu_placement/cpu_placement.sh OUTDIR [ROUNDS]
set -u
out=$1; rounds=${2:-2}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
{
  nvidia-smi topo -m
  lscpu | grep -E 'NUMA|^CPU\(s\)|Thread|Core|Socket|Model name'
  for n in /sys/devices/system/node/node[0-9]*; do echo "$(basename "$n"): $(cat "$n/cpulist")"; done
  for g in 0 1; do
    bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader -i $g | tr 'A-Z' 'a-z' | sed 's/^0000//')
    d=/sys/bus/pci/devices/0000${bus#0000}
    [ -e "$d" ] || d=$(ls -d /sys/bus/pci/devices/*"${bus: -12}" 2>/dev/null | head -1)
    echo "GPU$g $bus numa_node=$(cat "$d/numa_node" 2>/dev/null) local_cpulist=$(cat "$d/local_cpulist" 2>/dev/null)"
  done
} > "$out/topology.txt" 2>&1
placements=("none:")
for n in /sys/devices/system/node/node[0-9]*; do placements+=("$(basename "$n"):$(cat "$n/cpulist")"); done
for r in $(seq 1 "$rounds"); do
  for p in "${placements[@]}"; do
    name=${p%%:*}; cpus=${p#*:}
    pre=(); [ -n "$cpus" ] && pre=(taskset -c "$cpus")
    "${pre[@]}" .gpu/bin/cuda-peer-bench --quick --dtypes f32 --min-bytes 4096 --max-bytes 262144 \
      --impls cuda-peer-p2p,cuda-peer-p2p-serial,nccl --machine "$name-r$r" --out "$out" \
      > "$out/$name-r$r.txt" 2>&1
    echo "== $name round $r (cpus ${cpus:-any})"
    awk -F, 'NR>1 {printf "%-22s %8d %8.2f us\n", $1, $6, $7}' "$out/$name-r$r-allreduce.csv"
  done
done
