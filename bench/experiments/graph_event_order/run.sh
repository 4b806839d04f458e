#!/usr/bin/env bash
# On the GPU machine, from the repository root: builds and runs the experiment.
set -eu
cd "$(dirname "$0")"
nvcc -O2 -o "${TMPDIR:-/tmp}/geo" graph_event_order.cu
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
nvcc --version | tail -2
"${TMPDIR:-/tmp}/geo"
