#!/usr/bin/env bash
# Builds the workspace's test binaries, examples and binaries here (release,
# this machine's target) and stages them in .gpu/ at the repository root, for
# a GPU machine that has no Rust toolchain (docs/gpu-testing.md).
#
#   ci/gpu-bundle.sh [extra cargo args]
#
# Then copy .gpu/ to the GPU machine, into a checkout of the same commit (the
# tests read a few files of the tree: tests/fakecuda/, tests/sanitizer.sh), and
# from the repository root there:
#   .gpu/run                 # every staged test binary, one test at a time
#   .gpu/run ring            # only tests whose name contains "ring"
#   .gpu/examples/NAME ...   # any staged example
#   .gpu/bin/NAME ...        # a workspace binary: cuda-peer, cuda-peer-run, cuda-peer-bench
# BUNDLE_PACK=1 packs .gpu/ into .gpu.tgz instead (unpack with tar xzf .gpu.tgz);
# bench/pack-gpu.sh repacks that into a much smaller .gpu.txz.
# .gpu/run exports CUDA_PEER_REQUIRE_GPU=1 where two or more GPUs are visible, so a
# GPU test that cannot run fails instead of skipping; with one GPU, tests that need
# two skip and say so.
# .gpu/ and .gpu.tgz are ignored through this clone's .git/info/exclude (added here
# once), so they are never committed by accident.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for p in /.gpu/ /.gpu.tgz /.gpu.txz; do grep -qxF "$p" "$exclude" 2>/dev/null || echo "$p" >> "$exclude"; done
rm -rf .gpu .gpu.tgz && mkdir -p .gpu/tests .gpu/examples .gpu/bin

json=$(mktemp)
trap 'rm -f "$json"' EXIT
cargo test --release --workspace --no-run --message-format=json "$@" > "$json"
cargo build --release --workspace --bins --examples --message-format=json "$@" >> "$json"

# Test binaries are named <package folder>-<target>-<kind>: the root package's
# folder is the checkout's own name.
python3 - "$json" <<'PY'
import json, os, shutil, sys
seen = set()
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    kinds = m["target"]["kind"]
    name = m["target"]["name"]
    if m["profile"]["test"]:
        pkg = os.path.basename(os.path.dirname(m["manifest_path"]))
        dest = f".gpu/tests/{pkg}-{name}-{'-'.join(kinds)}"
    elif "example" in kinds:
        dest = f".gpu/examples/{name}"
    elif "bin" in kinds:
        dest = f".gpu/bin/{name}"
    else:
        continue
    if dest in seen:
        continue
    seen.add(dest)
    shutil.copy2(m["executable"], dest)
    print("staged", dest)
PY
strip --strip-debug .gpu/tests/* .gpu/examples/* .gpu/bin/* 2>/dev/null || true

cat > .gpu/run <<'RUN'
#!/usr/bin/env bash
# Runs every staged test binary; a filter argument is passed to each.
# With two or more GPUs a GPU test that cannot run fails (CUDA_PEER_REQUIRE_GPU=1); with
# one GPU, tests that need two skip and say so, and the rest must pass.
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "${gpus:-0}" -ge 2 ]; then export CUDA_PEER_REQUIRE_GPU=1; else unset CUDA_PEER_REQUIRE_GPU; echo "one GPU ($gpus): tests that need two skip, and name themselves"; fi
export RUST_BACKTRACE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/.."
status=0
for t in .gpu/tests/*; do
  echo "=== $t"
  "$t" --test-threads=1 "$@" || status=1
done
exit $status
RUN
chmod +x .gpu/run
du -sh .gpu
if [ -n "${BUNDLE_PACK:-}" ]; then
  tar czf .gpu.tgz .gpu && rm -rf .gpu && du -sh .gpu.tgz
  echo "copy .gpu.tgz to the GPU machine's checkout and run: tar xzf .gpu.tgz && .gpu/run"
else
  echo "copy .gpu/ to the GPU machine's checkout and run: .gpu/run"
fi
