#!/usr/bin/env python3
# Temporary GPU self-test of src/kernels/reduce.ptx (pure Python + libcuda ctypes).
import ctypes, math, random, struct, sys, time

cu = ctypes.CDLL("libcuda.so.1")
def ck(rc, what):
    if rc != 0:
        s = ctypes.c_char_p(); cu.cuGetErrorString(rc, ctypes.byref(s))
        raise RuntimeError("%s: %d %s" % (what, rc, s.value))
ck(cu.cuInit(0), "init")
dev = ctypes.c_int(); ck(cu.cuDeviceGet(ctypes.byref(dev), 0), "dev")
ctx = ctypes.c_void_p(); ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "ctx")
ck(cu.cuCtxSetCurrent(ctx), "setcur")
ptx = open("src/kernels/reduce.ptx", "rb").read() + b"\0"
mod = ctypes.c_void_p()
t0 = time.time()
ck(cu.cuModuleLoadData(ctypes.byref(mod), ptx), "modload")
print("module load (JIT) %.2fs" % (time.time() - t0))
funcs = {}
def fn(name):
    if name not in funcs:
        f = ctypes.c_void_p(); ck(cu.cuModuleGetFunction(ctypes.byref(f), mod, name.encode()), name); funcs[name] = f
    return funcs[name]

ARENA = 1 << 26
base = ctypes.c_uint64(); ck(cu.cuMemAlloc_v2(ctypes.byref(base), ARENA), "alloc"); base = base.value
def h2d(addr, data): ck(cu.cuMemcpyHtoD_v2(ctypes.c_uint64(addr), data, len(data)), "h2d")
def d2h(addr, n):
    b = ctypes.create_string_buffer(n); ck(cu.cuMemcpyDtoH_v2(b, ctypes.c_uint64(addr), n), "d2h"); return b.raw
def launch(name, args, grid, block):
    holders = []
    for kind, v in args:
        holders.append({"p": ctypes.c_uint64, "u64": ctypes.c_uint64, "i32": ctypes.c_int32, "f64": ctypes.c_double}[kind](v) if kind != "arr" else (ctypes.c_uint64 * 8)(*v))
    params = (ctypes.c_void_p * len(holders))(*[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in holders])
    ck(cu.cuLaunchKernel(fn(name), grid, 1, 1, block, 1, 1, 0, None, params, None), "launch " + name)
    ck(cu.cuCtxSynchronize(), "sync " + name)

# ---- type model ----
def f32r(x):
    try: return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError: return math.copysign(math.inf, x)
def f16_pack(x):
    try: return struct.unpack("<H", struct.pack("<e", x))[0]
    except OverflowError: return 0x7c00 if x > 0 else 0xfc00
def f16_val(h): return struct.unpack("<e", struct.pack("<H", h))[0]
def bf16_val(h): return struct.unpack("<f", struct.pack("<I", h << 16))[0]
def bf16_pack(x):
    u = struct.unpack("<I", struct.pack("<f", f32r(x)))[0]
    if (u & 0x7fffffff) > 0x7f800000: return (u >> 16) | 0x40
    u = (u + 0x7fff + ((u >> 16) & 1)) & 0xffffffff
    return u >> 16
INTS = {"i32": ("i", 32, True), "i64": ("q", 64, True), "u32": ("I", 32, False), "u64": ("Q", 64, False), "i8": ("b", 8, True), "u8": ("B", 8, False)}
FMT = {"f32": "f", "f64": "d", "f16": "H", "bf16": "H"}
FMT.update({k: v[0] for k, v in INTS.items()})
SIZE = {k: struct.calcsize(v) for k, v in FMT.items()}

def isnan_raw(ty, v):
    if ty in ("f32", "f64"): return v != v
    if ty == "f16": return (v & 0x7fff) > 0x7c00
    if ty == "bf16": return (v & 0x7fff) > 0x7f80
    return False
def fval(ty, v): return f16_val(v) if ty == "f16" else bf16_val(v) if ty == "bf16" else v
def op_ref(ty, op, a, b):
    if ty in INTS:
        _, bits, signed = INTS[ty]
        if op == "sum": r = a + b
        elif op == "prod": r = a * b
        elif op == "min": return b if b < a else a
        else: return b if b > a else a
        r &= (1 << bits) - 1
        if signed and r >> (bits - 1): r -= 1 << bits
        return r
    if op in ("min", "max"):
        if isnan_raw(ty, a): return a
        if isnan_raw(ty, b): return b
        fa, fb = fval(ty, a), fval(ty, b)
        return (b if fb < fa else a) if op == "min" else (b if fb > fa else a)
    fa, fb = fval(ty, a), fval(ty, b)
    try: r = fa + fb if op == "sum" else fa * fb
    except OverflowError: r = math.inf
    if ty == "f64": return r
    r = f32r(r)
    if ty == "f32": return r
    return f16_pack(r) if ty == "f16" else bf16_pack(r)
def div_ref(ty, x, d):
    if ty == "f64": return x / d if d != 0 else math.copysign(math.inf, x)
    r = f32r(fval(ty, x) / f32r(d))
    return r if ty == "f32" else f16_pack(r) if ty == "f16" else bf16_pack(r)
SPECIAL = {"f32": [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, 3e38],
           "f64": [math.nan, math.inf, -math.inf, 0.0, -0.0, 5e-324, 1e308],
           "f16": [0x7e00, 0x7c00, 0xfc00, 0x0000, 0x8000, 0x0001, 0x7bff, 0x7d01],
           "bf16": [0x7fc0, 0x7f80, 0xff80, 0x0000, 0x8000, 0x0001, 0x7f7f, 0x7f81]}
def rand_elem(ty, rng):
    if ty in INTS:
        _, bits, signed = INTS[ty]
        lo = -(1 << (bits - 1)) if signed else 0
        return rng.randrange(lo, lo + (1 << bits)) if rng.random() < 0.5 else rng.randrange(-5 if signed else 0, 6)
    if ty in SPECIAL and rng.random() < 0.05:
        s = rng.choice(SPECIAL[ty]); return f32r(s) if ty == "f32" else s
    x = rng.uniform(-2, 2)
    if ty == "f32": return f32r(x)
    if ty == "f64": return x
    return f16_pack(x) if ty == "f16" else bf16_pack(x)
def same(ty, got, want):
    if ty in INTS: return got == want
    if isnan_raw(ty, want): return isnan_raw(ty, got)
    if ty in ("f32", "f64"): return struct.pack(FMT[ty], got) == struct.pack(FMT[ty], want)
    return got == want
def pack(ty, vals): return struct.pack("<%d%s" % (len(vals), FMT[ty]), *vals)
def unpack(ty, raw): return list(struct.unpack("<%d%s" % (len(raw) // SIZE[ty], FMT[ty]), raw))

SLOT = 1 << 22  # bytes per array slot
PAD = 64
fails = 0; checks = 0
def run_case(kind, ty, op, n, offs, alias, nsrc, grid, block, rng, divisor=None):
    """offs: element offsets per array (dst first); alias: index of src that dst aliases, or None."""
    global fails, checks
    es = SIZE[ty]
    nsl = len(offs)
    addrs = [base + k * SLOT + PAD + offs[k] * es for k in range(nsl)]
    bufs = []
    for k in range(nsl):
        full = [rand_elem(ty, rng) for _ in range(n + 2 * PAD // es)]
        bufs.append(full)
        h2d(addrs[k] - PAD, pack(ty, full))
    srcs_idx = list(range(1, nsl))
    src_addrs = [addrs[k] for k in srcs_idx]
    dst_addr = addrs[0] if alias is None else src_addrs[alias]
    dst_buf = bufs[0] if alias is None else bufs[1 + alias]
    srcv = [bufs[k][PAD // es: PAD // es + n] for k in srcs_idx]
    if kind == "div":
        src_addrs = []; dst_addr = addrs[0]; dst_buf = bufs[0]
        want = [div_ref(ty, x, divisor) for x in bufs[0][PAD // es: PAD // es + n]]
        launch("cp_scale_div_" + ty, [("p", dst_addr), ("u64", n), ("f64", divisor)], grid, block)
    else:
        want = []
        for i in range(n):
            acc = srcv[0][i]
            for s in srcv[1:]: acc = op_ref(ty, op, acc, s[i])
            want.append(acc)
        if kind == "r2":
            launch("cp_reduce2_%s_%s" % (op, ty), [("p", dst_addr), ("p", src_addrs[0]), ("p", src_addrs[1]), ("u64", n)], grid, block)
        else:
            arr = src_addrs + [0] * (8 - len(src_addrs))
            launch("cp_reduceN_%s_%s" % (op, ty), [("p", dst_addr), ("arr", arr), ("i32", nsrc), ("u64", n)], grid, block)
    raw = unpack(ty, d2h(dst_addr - PAD, (n + 2 * PAD // es) * es))
    got = raw[PAD // es: PAD // es + n]
    checks += 1
    bad = [i for i in range(n) if not same(ty, got[i], want[i])]
    guard_ok = pack(ty, raw[:PAD // es]) == pack(ty, dst_buf[:PAD // es]) and pack(ty, raw[PAD // es + n:]) == pack(ty, dst_buf[PAD // es + n:])
    if bad or not guard_ok:
        fails += 1
        if fails < 30:
            i = bad[0] if bad else -1
            print("FAIL %s %s %s n=%d offs=%s alias=%s nsrc=%s grid=%d block=%d bad=%d guard_ok=%s first=%d got=%r want=%r srcs=%r" % (
                kind, ty, op, n, offs, alias, nsrc, grid, block, len(bad), guard_ok, i,
                got[i] if bad else None, want[i] if bad else None, [s[i] for s in srcv] if bad else None))

rng = random.Random(1234)
TYPES = ["f32", "f64", "f16", "bf16", "i32", "i64", "u32", "u64", "i8", "u8"]
OPS = ["sum", "prod", "min", "max"]
launchcfg = [(1, 1), (2, 256), (3, 33), (1024, 256), (1, 1024)]
t0 = time.time()
for ty in TYPES:
    E = 16 // SIZE[ty]
    for op in OPS:
        for n in [0, 1, 2, 3, E - 1, E, E + 1, 2 * E + 3, 37, 1000, 4099]:
            for offs, alias in [((0, 0, 0), None), ((1, 1, 1), None), ((3, 3, 3), None), ((0, 1, 0), None), ((0, 0, 1), None),
                                ((2, 2, 2), 0), ((5, 5, 5), 1), ((0, 1, 2), 0)]:
                g, b = rng.choice(launchcfg)
                run_case("r2", ty, op, n, offs, alias, 2, g, b, rng)
        for nsrc in range(1, 9):
            for n in [0, 5, 2 * E + 3, 1000]:
                for mode in ["aligned", "shifted", "mis", "alias"]:
                    if mode == "aligned": offs = (0,) * (nsrc + 1); alias = None
                    elif mode == "shifted": offs = (E - 1,) * (nsrc + 1); alias = None
                    elif mode == "mis": offs = tuple([1] + [1] * (nsrc - 1) + [0]); alias = None
                    else: offs = (3,) * (nsrc + 1); alias = nsrc - 1
                    g, b = rng.choice(launchcfg)
                    run_case("rN", ty, op, n, offs, alias, nsrc, g, b, rng)
    if ty in ("f32", "f64", "f16", "bf16"):
        for n in [0, 1, 9, 1000]:
            for off in [0, 1, 3]:
                for d in [3.0, 8.0, 0.1, 1e-3]:
                    g, b = rng.choice(launchcfg)
                    run_case("div", ty, None, n, (off,), None, 0, g, b, rng, divisor=d)
    print("%s done (%.1fs, %d checks, %d fails)" % (ty, time.time() - t0, checks, fails)); sys.stdout.flush()
# big-ish single case, tiny grid
run_case("rN", "f32", "sum", 300001, (0, 0, 0, 0), None, 3, 7, 256, rng)
run_case("r2", "u8", "sum", 300001, (1, 1, 1), 1, 2, 7, 96, rng)
# nsrc out of range: must be a no-op (dst unchanged)
for bad_nsrc in (0, 9, -1):
    before = bytes(range(256)) * 4
    h2d(base, before)
    launch("cp_reduceN_sum_u8", [("p", base), ("arr", [base + SLOT] * 8), ("i32", bad_nsrc), ("u64", 1000)], 4, 256)
    checks += 1
    if d2h(base, 1024) != before: fails += 1; print("FAIL nsrc=%d not a no-op" % bad_nsrc)
print("TOTAL checks=%d fails=%d" % (checks, fails))
sys.exit(1 if fails else 0)
