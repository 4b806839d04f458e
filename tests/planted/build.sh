#!/usr/bin/env bash
# Builds, for each planted defect of defects.txt, the test binaries that must
# catch it against a copy of the library with the defect (a worktree of HEAD
# with the patch applied; the kernels regenerated with kernels/gen.sh where
# the patch changes them), stripped into target/planted/out/<defect>/, and
# packs them as planted.txz for the GPU machine (tests/planted/run.sh).
#   tests/planted/build.sh            (from the repository root; ~8 min per
#                                      defect that changes the kernels)
# CUDA_PEER_TOOLS: where kernels/gen.sh keeps its downloaded tools.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
out=$root/target/planted/out
rm -rf "$out" && mkdir -p "$out"
tools=${CUDA_PEER_TOOLS:-$root/target/cuda-peer-tools}
grep -v '^#' tests/planted/defects.txt | while read -r patch specs; do
  [ -n "$patch" ] || continue
  name=${patch%.patch}
  tree=$root/target/planted/tree-$name
  git worktree remove --force "$tree" 2>/dev/null || rm -rf "$tree"
  git worktree add -f --detach "$tree" HEAD >/dev/null
  git -C "$tree" apply "$root/tests/planted/$patch"
  if grep -q '^+++ b/kernels/' "tests/planted/$patch"; then
    (cd "$tree" && CUDA_PEER_TOOLS=$tools bash kernels/gen.sh > "$out/$name.gen.log" 2>&1)
  fi
  # A target directory of its own: cargo judges path sources by their
  # times, and a worktree's files are older than another defect's build.
  tests=()
  for spec in $specs; do tests+=(--test "${spec%%:*}"); done
  (cd "$tree" && CARGO_TARGET_DIR=$root/target/planted/target-$name cargo test --release --no-run "${tests[@]}" > "$out/$name.build.log" 2>&1)
  mkdir -p "$out/$name"
  for spec in $specs; do
    bin=${spec%%:*}
    f=$(ls -t "$root/target/planted/target-$name/release/deps/$bin"-* | grep -v '\.d$' | head -1)
    cp "$f" "$out/$name/$bin" && strip "$out/$name/$bin"
  done
  echo "planted/build.sh: $name built"
done
cp tests/planted/defects.txt tests/planted/run.sh "$out/"
tar -C "$root/target/planted" -cJf planted.txz out
echo "planted/build.sh: carry planted.txz; there: tar xJf planted.txz && bash out/run.sh"
