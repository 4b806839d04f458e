"""What CU_POINTER_ATTRIBUTE_ACCESS_FLAGS says about a buffer of device 1 when
asked from device 0's context, for each kind of allocation (docs/experiments.md):
cuMemAlloc, the default memory pool, a new pool, with and without peer access
enabled (context peer access; pool access for the pools). ctypes on libcuda."""
import ctypes as C
cu = C.CDLL("libcuda.so.1")
def ok(r, what):
    if r != 0:
        name = C.c_char_p()
        cu.cuGetErrorName(r, C.byref(name))
        raise RuntimeError(f"{what}: {name.value.decode()}")
ok(cu.cuInit(0), "init")
dev = [C.c_int(), C.c_int()]
ctx = [C.c_void_p(), C.c_void_p()]
for i in range(2):
    ok(cu.cuDeviceGet(C.byref(dev[i]), i), "devget")
    ok(cu.cuDevicePrimaryCtxRetain(C.byref(ctx[i]), dev[i]), "retain")
ACCESS_FLAGS = 16
MEMPOOL_HANDLE = 17
def flags_from(ctx_i, ptr):
    """(result, access flags) asked from context ctx_i, then (result, pool handle)."""
    ok(cu.cuCtxSetCurrent(ctx[ctx_i]), "setcurrent")
    v = C.c_uint(99)
    r = cu.cuPointerGetAttribute(C.byref(v), ACCESS_FLAGS, C.c_uint64(ptr))
    pool = C.c_void_p(0)
    rp = cu.cuPointerGetAttribute(C.byref(pool), MEMPOOL_HANDLE, C.c_uint64(ptr))
    return (r, v.value, rp, hex(pool.value or 0))
# allocations on device 1
ok(cu.cuCtxSetCurrent(ctx[1]), "set1")
legacy = C.c_uint64()
ok(cu.cuMemAlloc_v2(C.byref(legacy), 1 << 20), "alloc")
stream = C.c_void_p()
ok(cu.cuStreamCreate(C.byref(stream), 1), "stream")
pooled = C.c_uint64()
ok(cu.cuMemAllocAsync(C.byref(pooled), 1 << 20, stream), "allocasync")
class PoolProps(C.Structure):
    _fields_ = [("allocType", C.c_int), ("handleTypes", C.c_int), ("loc_type", C.c_int), ("loc_id", C.c_int),
                ("win32", C.c_void_p), ("maxSize", C.c_size_t), ("usage", C.c_ushort), ("reserved", C.c_ubyte * 54)]
props = PoolProps()
props.allocType = 1  # pinned
props.loc_type = 1   # device
props.loc_id = 1
pool = C.c_void_p()
ok(cu.cuMemPoolCreate(C.byref(pool), C.byref(props)), "poolcreate")
other = C.c_uint64()
ok(cu.cuMemAllocFromPoolAsync(C.byref(other), 1 << 20, pool, stream), "allocfrompool")
ok(cu.cuStreamSynchronize(stream), "sync")
kinds = [("cuMemAlloc", legacy.value), ("default pool", pooled.value), ("new pool", other.value)]
print("before any peer access:")
for name, p in kinds:
    print(f"  {name:14s} from ctx1 {flags_from(1, p)}  from ctx0 {flags_from(0, p)}")
ok(cu.cuCtxSetCurrent(ctx[0]), "set0")
r = cu.cuCtxEnablePeerAccess(ctx[1], 0)
print("ctx0 -> ctx1 peer access enable:", r)
print("after context peer access 0 -> 1:")
for name, p in kinds:
    print(f"  {name:14s} from ctx0 {flags_from(0, p)}")
class AccessDesc(C.Structure):
    _fields_ = [("loc_type", C.c_int), ("loc_id", C.c_int), ("flags", C.c_int)]
d = AccessDesc(1, 0, 3)
defpool = C.c_void_p()
ok(cu.cuDeviceGetDefaultMemPool(C.byref(defpool), dev[1]), "defpool")
ok(cu.cuMemPoolSetAccess(defpool, C.byref(d), 1), "setaccess default")
print("after default-pool access for device 0:")
for name, p in kinds:
    print(f"  {name:14s} from ctx0 {flags_from(0, p)}")
ok(cu.cuMemPoolSetAccess(pool, C.byref(d), 1), "setaccess new")
print("after new-pool access for device 0:")
for name, p in kinds:
    print(f"  {name:14s} from ctx0 {flags_from(0, p)}")
