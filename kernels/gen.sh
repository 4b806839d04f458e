#!/usr/bin/env bash
# Building the kernels from source: `cargo build --features kernels-from-source`
# (or CUDA_PEER_KERNELS_FROM_SOURCE=1) has build.rs compile kernels/reduce.cu at
# build time and embed the result instead of the committed files below: the PTX
# with nvcc (found through CUDA_PATH, CUDA_HOME, PATH or /usr/local/cuda), or
# with NVRTC through kernels/nvrtc_compile.py where CUDA_PEER_NVRTC names a
# libnvrtc, and the cubins with ptxas (CUDA_PEER_PTXAS, else the one beside
# nvcc) for the architectures in CUDA_PEER_ARCHS (default: $CUBIN_ARCHS below;
# e.g. CUDA_PEER_ARCHS=sm_89,sm_121 for machine code the committed set lacks).
# With no toolkit, `eval "$(kernels/gen.sh --env)"` installs the wheels pinned
# here and sets CUDA_PEER_NVRTC and CUDA_PEER_PTXAS to them; a build with those
# reproduces the committed files byte for byte (kernels/gen.sh --compare, run in
# CI, checks that).
#
# Regenerate / verify the embedded kernels from kernels/reduce.cu (several
# builds of one source: -DCP_BUILD_REDUCE, and -DCP_MESH_TY_TY for each
# element type; the list is src/kernels/list.rs, which build.rs checks the
# committed files against):
#   src/kernels/MODULE.ptx                  PTX (NVRTC 12.0, compute_70, ISA 8.0):
#                                           the fallback, JIT-compiled by the driver
#   src/kernels/cubin/ARCH/MODULE.cubin.zst machine code for ARCH in $CUBIN_ARCHS,
#                                           ptxas from the committed PTX, zstd -19
#
#   kernels/gen.sh            regenerate src/kernels/*.ptx, then the cubins
#   kernels/gen.sh --check    (1) regenerate the PTX into a temp dir and fail if it
#                                 differs from the committed PTX,
#                             (2) assemble the committed PTX with ptxas for
#                                 every arch in $CUBIN_ARCHS and $CHECK_ARCHS,
#                                 failing on any error, warning, register spill
#                                 or stack frame, and (3) fail unless every
#                                 committed cubin, decompressed, is
#                                 byte-for-byte the fresh ptxas output (ptxas
#                                 is deterministic for one input and version).
#   kernels/gen.sh --env      install the pinned wheels (as above) and print the
#                             shell lines that point a kernels-from-source build
#                             at them (CUDA_PEER_NVRTC, CUDA_PEER_PTXAS)
#   kernels/gen.sh --compare DIR
#                             fail unless DIR (a kernels-from-source build's
#                             OUT_DIR/kernels) holds the committed set: the same
#                             MODULE.ptx byte for byte, and cubin/ARCH/MODULE.cubin
#                             for every ARCH in $CUBIN_ARCHS, each the committed
#                             .cubin.zst decompressed; needs only zstd.
#
# Needs python3 with pip and network access to PyPI the first time; the NVRTC
# and nvcc (ptxas) wheels are installed with `pip install --target` under
#   ${CUDA_PEER_TOOLS:-$HOME/.cache/cuda-peer-tools}
# and reused afterwards; and the zstd command line tool.  No CUDA toolkit,
# driver or GPU is required.
#
# NVRTC is pinned to CUDA 12.0 (nvidia-cuda-nvrtc-cu12==12.0.76) so the PTX has
# ISA .version 8.0 and is JIT-compilable by every driver from CUDA 12.0 on.
# ptxas is pinned to CUDA 12.9 (nvidia-cuda-nvcc-cu12==12.9.86), the last 12.x,
# which knows sm_100 and sm_120; its cubins load on 12.x drivers (minor version
# compatibility), and where one does not the crate falls back to the PTX.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${CUDA_PEER_TOOLS:-$HOME/.cache/cuda-peer-tools}"
PYTHON="${PYTHON:-python3}"
NVRTC_PKG="nvidia-cuda-nvrtc-cu12"
NVRTC_VERSION="12.0.76"
NVCC_PKG="nvidia-cuda-nvcc-cu12"
NVCC_VERSION="${CUDA_PEER_NVCC_VERSION:-12.9.86}"
SRC="$ROOT/kernels/reduce.cu"
MODULES="reduce:CP_BUILD_REDUCE"
for ty in f32 f64 f16 bf16 i32 i64 u32 u64 i8 u8 f8e4m3 f8e5m2; do MODULES="$MODULES mesh_$ty:CP_MESH_TY_$ty"; done
# Cubins embedded: one per major architecture, lowest minor; a cubin for
# sm_XY runs on every sm_XZ with Z >= Y, so sm_80 serves sm_86/87/89,
# sm_70 serves sm_72/75, sm_100 serves sm_103 and sm_120 serves sm_121.
# Keep in step with COMMITTED_ARCHS in src/kernels/list.rs (a unit test compares them).
CUBIN_ARCHS="sm_70 sm_80 sm_90 sm_100 sm_120"
# Assembled by --check only (no spills there either), served by sm_80 cubins.
CHECK_ARCHS="sm_86 sm_89"
ZSTD="${ZSTD:-zstd}"
JOBS="${CUDA_PEER_GEN_JOBS:-$(nproc 2>/dev/null || echo 2)}"
MAX_PTX_VERSION="8.0"

log() { echo "gen.sh: $*" >&2; }
die() { echo "gen.sh: error: $*" >&2; exit 1; }

mode=gen
case "${1:-}" in
    "") ;;
    --check) mode=check ;;
    --env) mode=env ;;
    --compare)
        mode=compare
        compare_dir="${2:-}"
        [ -d "$compare_dir" ] || die "--compare needs a folder (a kernels-from-source build's OUT_DIR/kernels)" ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) die "unknown argument '$1' (use --check, --env, --compare DIR or nothing)" ;;
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

# assemble PTX ARCH CUBIN LOG: ptxas PTX for ARCH into CUBIN, failing on any
# error, warning, register spill or stack frame; touches CUBIN.ok on success.
assemble() {
    local ptx="$1" arch="$2" cubin="$3" vlog="$4" nfunc bad maxreg
    if ! "$ptxas" -arch="$arch" --warning-as-error -v -o "$cubin" "$ptx" >"$vlog" 2>&1; then
        grep -v '^ptxas info' "$vlog" >&2 || true
        log "ptxas -arch=$arch $ptx failed"
        return 1
    fi
    nfunc="$(grep -c "Compiling entry function" "$vlog" || true)"
    # ptxas -v prints "N bytes stack frame, N bytes spill stores, N bytes spill loads"
    # per entry; anything other than all zeros is treated as a failure.
    bad="$(grep -E 'bytes stack frame' "$vlog" \
        | grep -Ev '^[[:space:]]*0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads[[:space:]]*$' || true)"
    maxreg="$(grep -oE 'Used [0-9]+ registers' "$vlog" | awk '{print $2}' | sort -n | tail -n 1)"
    if [ -n "$bad" ]; then
        echo "$bad" >&2
        log "ptxas -arch=$arch $ptx: register spills or stack frames"
        return 1
    fi
    log "  $(basename "$ptx") $arch OK: $nfunc entry functions, max $maxreg registers, no spills, no stack"
    touch "$cubin.ok"
}

# assemble_all PTXDIR OUTDIR ARCHS...: every module's PTX for every arch, in
# parallel ($JOBS at a time); OUTDIR/ARCH/MODULE.cubin. Fails if any fails.
assemble_all() {
    local ptxdir="$1" outdir="$2" arch m name running=0
    shift 2
    for arch in "$@"; do
        mkdir -p "$outdir/$arch"
        for m in $MODULES; do
            name="${m%%:*}"
            assemble "$ptxdir/$name.ptx" "$arch" "$outdir/$arch/$name.cubin" "$outdir/$arch/$name.log" &
            running=$((running + 1))
            if [ "$running" -ge "$JOBS" ]; then wait -n || true; running=$((running - 1)); fi
        done
    done
    wait || true
    for arch in "$@"; do
        for m in $MODULES; do
            [ -f "$outdir/$arch/${m%%:*}.cubin.ok" ] || die "ptxas -arch=$arch ${m%%:*}.ptx failed (see above)"
        done
    done
}

CUBIN_DIR="$ROOT/src/kernels/cubin"
# The committed cubins' names, ARCH/MODULE.cubin.zst, sorted.
committed_cubins() {
    for arch in $CUBIN_ARCHS; do for m in $MODULES; do echo "$arch/${m%%:*}.cubin.zst"; done; done | LC_ALL=C sort
}

if [ "$mode" = env ]; then
    nvrtc_dir="$(install_wheel "$NVRTC_PKG" "$NVRTC_VERSION")"
    nvcc_dir="$(install_wheel "$NVCC_PKG" "$NVCC_VERSION")"
    ptxas="$(find_one "$nvcc_dir" 'ptxas')"
    [ -x "$ptxas" ] || chmod +x "$ptxas"
    printf 'export CUDA_PEER_NVRTC=%q\n' "$(find_one "$nvrtc_dir" 'libnvrtc.so.12')"
    printf 'export CUDA_PEER_PTXAS=%q\n' "$ptxas"
    exit 0
fi

command -v "$ZSTD" >/dev/null || die "the zstd command line tool is needed (apt-get install zstd)"
tmpdir="$(mktemp -d)"
trap 'rm -rf "$tmpdir"' EXIT

if [ "$mode" = compare ]; then
    found="$(cd "$compare_dir" && find . -type f | sed 's|^\./||' | LC_ALL=C sort)"
    expected="$( (for m in $MODULES; do echo "${m%%:*}.ptx"; done; committed_cubins | sed 's|^|cubin/|; s|\.zst$||') | LC_ALL=C sort)"
    if [ "$expected" != "$found" ]; then
        diff <(echo "$expected") <(echo "$found") >&2 || true
        die "$compare_dir does not hold the committed set of modules and architectures (< committed, > built)"
    fi
    for m in $MODULES; do
        name="${m%%:*}"
        if ! cmp -s "$compare_dir/$name.ptx" "$ROOT/src/kernels/$name.ptx"; then
            diff <(grep -E '^\.visible \.entry' "$ROOT/src/kernels/$name.ptx") \
                <(grep -E '^\.visible \.entry' "$compare_dir/$name.ptx") >&2 \
                && log "$name.ptx: the same kernels, other code (another compiler version?)"
            die "$compare_dir/$name.ptx differs from the committed src/kernels/$name.ptx"
        fi
    done
    for f in $(committed_cubins); do
        "$ZSTD" -q -d -c "$CUBIN_DIR/$f" >"$tmpdir/committed.cubin" || die "cannot decompress $CUBIN_DIR/$f"
        cmp -s "$tmpdir/committed.cubin" "$compare_dir/cubin/${f%.zst}" \
            || die "$compare_dir/cubin/${f%.zst} differs from the committed src/kernels/cubin/$f"
    done
    log "compare OK: $(echo "$MODULES" | wc -w) PTX modules and $(committed_cubins | wc -l) cubins identical to the committed ones"
    exit 0
fi

nvcc_dir="$(install_wheel "$NVCC_PKG" "$NVCC_VERSION")"
ptxas="$(find_one "$nvcc_dir" 'ptxas')"
[ -x "$ptxas" ] || chmod +x "$ptxas"
log "ptxas: $ptxas ($("$ptxas" --version | tail -n 1))"

if [ "$mode" = gen ]; then
    for m in $MODULES; do
        PTX="$ROOT/src/kernels/${m%%:*}.ptx"
        mkdir -p "$(dirname "$PTX")"
        generate "$PTX" "${m#*:}"
        log "wrote $PTX"
    done
    # shellcheck disable=SC2086
    assemble_all "$ROOT/src/kernels" "$tmpdir/cubin" $CUBIN_ARCHS
    rm -rf "$CUBIN_DIR"
    for arch in $CUBIN_ARCHS; do
        mkdir -p "$CUBIN_DIR/$arch"
        for m in $MODULES; do
            "$ZSTD" -q -19 --no-check -f -o "$CUBIN_DIR/$arch/${m%%:*}.cubin.zst" "$tmpdir/cubin/$arch/${m%%:*}.cubin"
        done
        log "wrote $CUBIN_DIR/$arch/*.cubin.zst"
    done
    exit 0
fi

# ---- check mode ----
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
done

log "step 2: assembling committed PTX with ptxas for: $CUBIN_ARCHS $CHECK_ARCHS"
# shellcheck disable=SC2086
assemble_all "$ROOT/src/kernels" "$tmpdir/cubin" $CUBIN_ARCHS $CHECK_ARCHS
log "step 2 OK"

log "step 3: comparing the committed cubins with the fresh ones"
expected="$(committed_cubins)"
found="$(cd "$CUBIN_DIR" 2>/dev/null && find . -type f | sed 's|^\./||' | LC_ALL=C sort)"
if [ "$expected" != "$found" ]; then
    diff <(echo "$expected") <(echo "$found") >&2 || true
    die "src/kernels/cubin/ does not hold exactly one .cubin.zst per arch and module; run kernels/gen.sh"
fi
for arch in $CUBIN_ARCHS; do
    for m in $MODULES; do
        name="${m%%:*}"
        "$ZSTD" -q -d -c "$CUBIN_DIR/$arch/$name.cubin.zst" >"$tmpdir/committed.cubin" \
            || die "cannot decompress $CUBIN_DIR/$arch/$name.cubin.zst"
        cmp -s "$tmpdir/committed.cubin" "$tmpdir/cubin/$arch/$name.cubin" \
            || die "committed $CUBIN_DIR/$arch/$name.cubin.zst differs from a fresh ptxas build; run kernels/gen.sh"
    done
done
log "step 3 OK: $(echo "$expected" | wc -l) cubins identical to a fresh ptxas build"
log "check OK"
