#!/usr/bin/env python3
"""Compile a header-free CUDA C file to PTX with NVRTC, driven through ctypes.

Usage: nvrtc_compile.py --nvrtc PATH/libnvrtc.so.12 [--builtins PATH] \
           --src kernels/reduce.cu --out src/kernels/reduce.ptx \
           [--max-ptx-version 8.0] [--expect-target sm_70] [-- extra nvrtc options]

The output is deterministic: the PTX produced by NVRTC (which contains no
timestamps or paths) prefixed with a fixed banner naming the source file and
its SHA-256, written with '\n' line endings and no trailing NUL.
"""

import argparse
import ctypes
import hashlib
import os
import re
import sys

DEFAULT_OPTIONS = [
    "--gpu-architecture=compute_70",
    "-default-device",
    "--std=c++14",
    "--fmad=false",
]


def fail(msg):
    sys.stderr.write("nvrtc_compile.py: error: " + msg + "\n")
    sys.exit(1)


def load_nvrtc(path, builtins):
    # libnvrtc dlopen()s libnvrtc-builtins.so.<ver> by soname at compile time.
    # Pre-loading it RTLD_GLOBAL from its full path makes that lookup succeed
    # even when LD_LIBRARY_PATH was not set before this process started.
    if builtins:
        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(path)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
    return lib


def check(lib, rc, what):
    if rc != 0:
        fail("%s failed: %s (%d)" % (what, lib.nvrtcGetErrorString(rc).decode(), rc))


def compile_ptx(lib, source, name, options):
    prog = ctypes.c_void_p()
    check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source, name.encode(),
                                      0, None, None), "nvrtcCreateProgram")
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = lib.nvrtcCompileProgram(prog, len(options), opts)
        log_size = ctypes.c_size_t()
        check(lib, lib.nvrtcGetProgramLogSize(prog, ctypes.byref(log_size)),
              "nvrtcGetProgramLogSize")
        log = ctypes.create_string_buffer(log_size.value)
        check(lib, lib.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
        log_text = log.value.decode(errors="replace").strip()
        if rc != 0:
            sys.stderr.write(log_text + "\n")
            check(lib, rc, "nvrtcCompileProgram")
        if log_text:
            # Treat any diagnostic (warnings included) as an error: the
            # committed PTX should come from a warning-free compile.
            sys.stderr.write(log_text + "\n")
            fail("NVRTC produced diagnostics (see above)")
        ptx_size = ctypes.c_size_t()
        check(lib, lib.nvrtcGetPTXSize(prog, ctypes.byref(ptx_size)), "nvrtcGetPTXSize")
        buf = ctypes.create_string_buffer(ptx_size.value)
        check(lib, lib.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
        return buf.raw.rstrip(b"\0").decode("ascii")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def parse_version(v):
    major, minor = v.split(".")
    return int(major), int(minor)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvrtc", required=True, help="path to libnvrtc.so.12")
    ap.add_argument("--builtins", help="path to libnvrtc-builtins.so.12.x")
    ap.add_argument("--src", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--banner-name", help="source name written in the banner")
    ap.add_argument("--max-ptx-version", default="8.0")
    ap.add_argument("--expect-target", default="sm_70")
    ap.add_argument("extra", nargs="*", help="extra NVRTC options (after --)")
    args = ap.parse_args()

    lib = load_nvrtc(args.nvrtc, args.builtins)
    major, minor = ctypes.c_int(), ctypes.c_int()
    check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    nvrtc_version = "%d.%d" % (major.value, minor.value)

    with open(args.src, "rb") as f:
        source = f.read()
    if re.search(rb"^\s*#\s*include", source, re.M):
        fail("%s must not #include anything" % args.src)

    options = DEFAULT_OPTIONS + list(args.extra)
    banner_name = args.banner_name or os.path.basename(args.src)
    ptx = compile_ptx(lib, source, os.path.basename(args.src), options)

    m = re.search(r"^\.version\s+(\d+\.\d+)\s*$", ptx, re.M)
    if not m:
        fail("no .version line in PTX")
    if parse_version(m.group(1)) > parse_version(args.max_ptx_version):
        fail("PTX .version %s is newer than allowed %s" % (m.group(1), args.max_ptx_version))
    t = re.search(r"^\.target\s+(\S+)\s*$", ptx, re.M)
    if not t or t.group(1) != args.expect_target:
        fail("unexpected .target %r (want %s)" % (t and t.group(1), args.expect_target))

    banner = (
        "//\n"
        "// GENERATED FILE -- DO NOT EDIT.\n"
        "// Regenerate with kernels/gen.sh; verify with kernels/gen.sh --check.\n"
        "// Source: %s (sha256 %s)\n"
        "// NVRTC %s, options: %s\n"
        "//\n"
    ) % (banner_name, hashlib.sha256(source).hexdigest(), nvrtc_version, " ".join(options))
    text = banner + ptx.replace("\r\n", "\n")
    if not text.endswith("\n"):
        text += "\n"

    tmp = args.out + ".tmp"
    with open(tmp, "w", newline="\n") as f:
        f.write(text)
    os.replace(tmp, args.out)

    entries = re.findall(r"^\.visible \.entry (\w+)\(", ptx, re.M)
    sys.stderr.write("nvrtc_compile.py: NVRTC %s -> %s (%d bytes, .version %s, .target %s, %d entries)"
          % (nvrtc_version, args.out, len(text.encode()), m.group(1), t.group(1), len(entries)) + "\n")


if __name__ == "__main__":
    main()
