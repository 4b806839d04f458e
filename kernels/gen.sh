#!/usr/bin/env bash
# Regenerate / verify src/kernels/reduce.ptx and mesh_TY.ptx from
# kernels/reduce.cu (several builds of one source: -DCP_BUILD_REDUCE, and
# -DCP_MESH_TY_TY for each element type).
#
#   kernels/gen.sh            regenerate src/kernels/*.ptx
#   kernels/gen.sh --check    (1) regenerate into a temp file and fail if it
#                                 differs from the committed PTX,
#                             (2) assemble the committed PTX with ptxas for
#                                 every arch in $ARCHS, failing on any error,
#                                 warning, register spill or stack frame.
#
# Needs python3 with pip and network access to PyPI the first time; the NVRTC
# and nvcc (ptxas) wheels are installed with `pip install --target` under
#   ${CUDA_PEER_TOOLS:-$HOME/.cache/cuda-peer-tools}
# and reused afterwards.  No CUDA toolkit, driver or GPU is required.
#
# NVRTC is pinned to CUDA 12.0 (nvidia-cuda-nvrtc-cu12==12.0.76) so the PTX has
# ISA .version 8.0 and is JIT-compilable by every driver from CUDA 12.0 on.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${CUDA_PEER_TOOLS:-$HOME/.cache/cuda-peer-tools}"
PYTHON="${PYTHON:-python3}"
NVRTC_PKG="nvidia-cuda-nvrtc-cu12"
NVRTC_VERSION="12.0.76"
NVCC_PKG="nvidia-cuda-nvcc-cu12"
NVCC_VERSION="${CUDA_PEER_NVCC_VERSION:-12.0.76}"
SRC="$ROOT/kernels/reduce.cu"
MODULES="reduce:CP_BUILD_REDUCE"
for ty in f32 f64 f16 bf16 i32 i64 u32 u64 i8 u8; do MODULES="$MODULES mesh_$ty:CP_MESH_TY_$ty"; done
ARCHS="sm_70 sm_80 sm_86 sm_89 sm_90"
MAX_PTX_VERSION="8.0"

log() { echo "gen.sh: $*" >&2; }
die() { echo "gen.sh: error: $*" >&2; exit 1; }

mode=gen
case "${1:-}" in
    "") ;;
    --check) mode=check ;;
    -h|--help) sed -n '2,17p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) die "unknown argument '$1' (use --check or nothing)" ;;
esac

# install_wheel PKG VERSION -> prints the install dir.  Installs atomically
# (into DIR.partial, then renamed) so an interrupted install is retried.
install_wheel() {
    local pkg="$1" ver="$2"
    local dir="$TOOLS/$pkg-$ver"
    if [ ! -f "$dir/.complete" ]; then
        log "installing $pkg==$ver into $dir"
        mkdir -p "$TOOLS"
        rm -rf "$dir.partial" "$dir"
        PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps \
            --target "$dir.partial" "$pkg==$ver" >&2 \
            || die "pip install $pkg==$ver failed"
        touch "$dir.partial/.complete"
        mv "$dir.partial" "$dir"
    else
        log "using cached $pkg==$ver in $dir"
    fi
    echo "$dir"
}

find_one() {  # find_one DIR NAME-GLOB -> first match (sorted) or dies
    local hit
    hit="$(find "$1" -name "$2" \( -type f -o -type l \) | LC_ALL=C sort | head -n 1)"
    [ -n "$hit" ] || die "no '$2' under $1"
    echo "$hit"
}

# generate OUT DEFINE: compile $SRC with -DDEFINE with NVRTC into OUT.
generate() {
    local out="$1" define="$2" dir lib builtins
    dir="$(install_wheel "$NVRTC_PKG" "$NVRTC_VERSION")"
    lib="$(find_one "$dir" 'libnvrtc.so.12')"
    builtins="$(find_one "$dir" 'libnvrtc-builtins.so.*')"
    log "NVRTC library: $lib"
    LD_LIBRARY_PATH="$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        "$PYTHON" "$ROOT/kernels/nvrtc_compile.py" \
            --nvrtc "$lib" --builtins "$builtins" \
            --src "$SRC" --banner-name kernels/reduce.cu --out "$out" \
            --max-ptx-version "$MAX_PTX_VERSION" --expect-target sm_70 -- "-D$define"
}

if [ "$mode" = gen ]; then
    for m in $MODULES; do
        PTX="$ROOT/src/kernels/${m%%:*}.ptx"
        mkdir -p "$(dirname "$PTX")"
        generate "$PTX" "${m#*:}"
        log "wrote $PTX"
    done
    exit 0
fi

# ---- check mode ----
tmpdir="$(mktemp -d)"
trap 'rm -rf "$tmpdir"' EXIT
nvcc_dir="$(install_wheel "$NVCC_PKG" "$NVCC_VERSION")"
ptxas="$(find_one "$nvcc_dir" 'ptxas')"
[ -x "$ptxas" ] || chmod +x "$ptxas"
for m in $MODULES; do
PTX="$ROOT/src/kernels/${m%%:*}.ptx"
[ -f "$PTX" ] || die "$PTX does not exist; run kernels/gen.sh first"

log "step 1: regenerating $PTX into $tmpdir and comparing"
generate "$tmpdir/fresh.ptx" "${m#*:}"
if ! cmp -s "$tmpdir/fresh.ptx" "$PTX"; then
    diff -u "$PTX" "$tmpdir/fresh.ptx" | head -n 40 >&2 || true
    die "committed $PTX is stale (differs from a fresh NVRTC build); run kernels/gen.sh"
fi
log "step 1 OK: committed PTX is identical to a fresh build"

log "step 2: assembling committed PTX with ptxas for: $ARCHS"
log "ptxas: $ptxas ($("$ptxas" --version | tail -n 1))"
for arch in $ARCHS; do
    vlog="$tmpdir/ptxas-$arch.log"
    if ! "$ptxas" -arch="$arch" --warning-as-error -v -o "$tmpdir/reduce-$arch.cubin" "$PTX" \
            >"$vlog" 2>&1; then
        grep -v '^ptxas info' "$vlog" >&2 || true
        die "ptxas -arch=$arch failed"
    fi
    nfunc="$(grep -c "Compiling entry function" "$vlog" || true)"
    # ptxas -v prints "N bytes stack frame, N bytes spill stores, N bytes spill loads"
    # per entry; anything other than all zeros is treated as a failure.
    bad="$(grep -E 'bytes stack frame' "$vlog" \
        | grep -Ev '^[[:space:]]*0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads[[:space:]]*$' || true)"
    maxreg="$(grep -oE 'Used [0-9]+ registers' "$vlog" | awk '{print $2}' | sort -n | tail -n 1)"
    if [ -n "$bad" ]; then
        echo "$bad" >&2
        die "ptxas -arch=$arch: register spills or stack frames"
    fi
    log "  $arch OK: $nfunc entry functions, max $maxreg registers, no spills, no stack"
done
done
log "check OK"
