// cuda-peer reduction kernels.
//
// Compiled to PTX by kernels/gen.sh (NVRTC from CUDA 12.0, target compute_70);
// the result is committed as src/kernels/reduce.ptx and embedded in the crate.
// This file must stay free of #include: NVRTC is run without any headers.
//
// LAUNCH CONVENTION
//   * blockDim.x = 256 is the intended block size, but every kernel is correct
//     for any 1-D block size and any grid size (all loops are grid-stride, so
//     even a single thread processes everything).
//   * Only the x dimension is used; launch with blockDim.y = blockDim.z = 1 and
//     gridDim.y = gridDim.z = 1.
//   * No shared memory, dynamic shared memory size 0.
//   * Pointers may point into a peer GPU's memory (P2P / UVA); only plain
//     global loads and stores are used.
//   * Pointers must be aligned to their element size.  n may be 0.
//
// KERNELS (OP in sum, prod, min, max; TY in f32 f64 f16 bf16 i32 i64 u32 u64 i8 u8
//          f8e4m3 f8e5m2)
//   cp_reduce2_OP_TY(T* dst, const T* a, const T* b, unsigned long long n)
//       dst[i] = a[i] OP b[i] for i < n.  dst may be == a or == b (exactly);
//       no other overlap is allowed.
//   cp_scale_div_TY(T* x, unsigned long long n, double divisor)   (float TY only)
//       x[i] = x[i] / divisor; f32/f16/bf16 compute in float with
//       (float)divisor, f64 in double.  Used to turn a sum into an average.
//
// SEMANTICS
//   * Integer sum/prod wrap modulo 2^bits (computed in the unsigned type, no UB).
//   * Float min/max propagate NaN: if either input is NaN, the result is NaN
//     (the NaN input itself, first operand preferred).  Ties (e.g. -0 vs +0)
//     return the first operand.
//   * f16/bf16 are stored as unsigned short; each binary op converts both
//     operands to float, computes in float, and rounds back once (round to
//     nearest even).  min/max return one of the inputs bit-for-bit.
//   * f8e4m3/f8e5m2 are stored as unsigned char; each binary op computes in
//     float, rounds to f16, then to fp8 (nearest even, saturating to the
//     largest finite value), as NCCL does on sm_90.
//
// VECTORIZATION
//   When dst and every source share the same address modulo 16, a scalar head
//   runs up to the first 16-byte boundary, then a grid-stride loop over 16-byte
//   vectors (4 x 32-bit loads/stores), then a scalar tail.  Otherwise a plain
//   grid-stride scalar loop is used.

typedef unsigned long long u64;

// ---------------------------------------------------------------------------
// 16-byte vector and per-element view of it.
// ---------------------------------------------------------------------------

struct alignas(16) V16 {
    unsigned int x, y, z, w;
};

template <class T>
union VecView {
    V16 v;
    T e[16 / sizeof(T)];
};

// Kernel argument carrying up to 8 source pointers by value.
struct PtrArray {
    const void* p[8];
};

__device__ __forceinline__ u64 addr_of(const void* p) {
    return (u64)p;
}

static __device__ __forceinline__ u64 global_tid() {
    return (u64)blockIdx.x * (u64)blockDim.x + (u64)threadIdx.x;
}

static __device__ __forceinline__ u64 global_stride() {
    return (u64)gridDim.x * (u64)blockDim.x;
}

// ---------------------------------------------------------------------------
// f16 / bf16 <-> f32 conversion (no headers, valid on sm_70).
// ---------------------------------------------------------------------------

static __device__ __forceinline__ float f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

static __device__ __forceinline__ unsigned short f32_to_f16(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

static __device__ __forceinline__ float bf16_to_f32(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

// Round to nearest even; NaN stays NaN (quietened, sign kept).
static __device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((u >> 16) | 0x0040u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// ---------------------------------------------------------------------------
// fp8 (OCP FP8): to f32 (exact), and from f16 bits. E4M3: bias 7, no
// infinities, NaN S.1111.111, largest finite 448. E5M2: bias 15, the top
// byte of an IEEE f16 (infinities, NaNs), largest finite 57344. From f16:
// round to nearest even, saturating to the largest finite value
// (infinities too: PTX's .satfinite); NaN stays NaN.
// ---------------------------------------------------------------------------

// E4M3's magnitude bits are an f16's shifted right by 7 with the exponent
// rebiased by 8 (subnormals included): its value is that f16's times 2^8.
static __device__ __forceinline__ float e4m3_to_f32(unsigned char v) {
    const unsigned int x = v;
    const float f = f16_to_f32((unsigned short)(((x & 0x80u) << 8) | ((x & 0x7fu) << 7))) * 256.0f;
    return (x & 0x7fu) == 0x7fu ? __uint_as_float(0x7fc00000u) : f;
}

static __device__ __forceinline__ float e5m2_to_f32(unsigned char v) {
    return f16_to_f32((unsigned short)((unsigned int)v << 8));
}

// The E5M2 of f16 bits h: E5M2 is f16's top byte, rounded at bit 8.
static __device__ __forceinline__ unsigned char f16_to_e5m2(unsigned short h) {
    const unsigned int sign = ((unsigned int)h >> 8) & 0x80u, m = (unsigned int)h & 0x7fffu;
    if (m > 0x7c00u) return (unsigned char)(sign | 0x7fu);
    const unsigned int r = (m + 0x7fu + ((m >> 8) & 1u)) >> 8;
    return (unsigned char)(sign | (r > 0x7bu ? 0x7bu : r));
}

// The E4M3 of f16 bits h: from an f16 exponent of 9 on (E4M3's normals),
// the bits rebiased by 8 and rounded at bit 7; below, multiples of 2^-9
// (E4M3's subnormals; the largest rounds up to the smallest normal's code).
static __device__ __forceinline__ unsigned char f16_to_e4m3(unsigned short h) {
    const unsigned int sign = ((unsigned int)h >> 8) & 0x80u, m = (unsigned int)h & 0x7fffu;
    if (m > 0x7c00u) return (unsigned char)(sign | 0x7fu);
    unsigned int r;
    if ((m >> 10) >= 9u) {
        r = (m - 0x2000u + 0x3fu + ((m >> 7) & 1u)) >> 7;
        r = r > 0x7eu ? 0x7eu : r;
    } else {
        r = __float2uint_rn(f16_to_f32((unsigned short)m) * 512.0f);
    }
    return (unsigned char)(sign | r);
}

// ---------------------------------------------------------------------------
// Per-type traits: storage type T and the four binary ops (+ div for floats).
// ---------------------------------------------------------------------------

// Native float types (float, double).
#define CP_FLOAT_TRAITS(NAME, CT)                                               \
    struct NAME {                                                               \
        typedef CT T;                                                           \
        static __device__ __forceinline__ T sum(T a, T b) { return a + b; }     \
        static __device__ __forceinline__ T prod(T a, T b) { return a * b; }    \
        static __device__ __forceinline__ T min(T a, T b) {                     \
            if (a != a) return a;                                               \
            if (b != b) return b;                                               \
            return (b < a) ? b : a;                                             \
        }                                                                       \
        static __device__ __forceinline__ T max(T a, T b) {                     \
            if (a != a) return a;                                               \
            if (b != b) return b;                                               \
            return (b > a) ? b : a;                                             \
        }                                                                       \
        static __device__ __forceinline__ T div(T x, double d) {                \
            return x / (CT)d;                                                   \
        }                                                                       \
    };

// Float types narrower than f32 (f16 and bf16 stored as unsigned short, the
// fp8 types as unsigned char), computed in float and rounded back once by
// FROM_F32; min/max return one of the inputs bit-for-bit.
#define CP_NARROW_FLOAT_TRAITS(NAME, ST, TO_F32, FROM_F32)                      \
    struct NAME {                                                               \
        typedef ST T;                                                           \
        static __device__ __forceinline__ T sum(T a, T b) {                     \
            return FROM_F32(TO_F32(a) + TO_F32(b));                             \
        }                                                                       \
        static __device__ __forceinline__ T prod(T a, T b) {                    \
            return FROM_F32(TO_F32(a) * TO_F32(b));                             \
        }                                                                       \
        static __device__ __forceinline__ T min(T a, T b) {                     \
            float fa = TO_F32(a), fb = TO_F32(b);                               \
            if (fa != fa) return a;                                             \
            if (fb != fb) return b;                                             \
            return (fb < fa) ? b : a;                                           \
        }                                                                       \
        static __device__ __forceinline__ T max(T a, T b) {                     \
            float fa = TO_F32(a), fb = TO_F32(b);                               \
            if (fa != fa) return a;                                             \
            if (fb != fb) return b;                                             \
            return (fb > fa) ? b : a;                                           \
        }                                                                       \
        static __device__ __forceinline__ T div(T x, double d) {                \
            return FROM_F32(TO_F32(x) / (float)d);                              \
        }                                                                       \
    };

// An fp8 step's rounding: the f32 result (exact for a sum or product of two
// fp8 values) rounded to f16, then to fp8 (saturating), as NCCL 2.24+ adds
// and multiplies (in f16, then the saturating conversion).
static __device__ __forceinline__ unsigned char f32_to_e4m3(float f) {
    return f16_to_e4m3(f32_to_f16(f));
}

static __device__ __forceinline__ unsigned char f32_to_e5m2(float f) {
    return f16_to_e5m2(f32_to_f16(f));
}

// Integer types.  U is an unsigned type at least as wide as CT and not
// subject to integer promotion (unsigned int or unsigned long long), so sum
// and prod wrap without UB; the final conversion back to CT truncates
// modulo 2^bits(CT).
#define CP_INT_TRAITS(NAME, CT, U)                                              \
    struct NAME {                                                               \
        typedef CT T;                                                           \
        static __device__ __forceinline__ T sum(T a, T b) {                     \
            return (T)((U)a + (U)b);                                            \
        }                                                                       \
        static __device__ __forceinline__ T prod(T a, T b) {                    \
            return (T)((U)a * (U)b);                                            \
        }                                                                       \
        static __device__ __forceinline__ T min(T a, T b) { return (b < a) ? b : a; } \
        static __device__ __forceinline__ T max(T a, T b) { return (b > a) ? b : a; } \
    };

CP_FLOAT_TRAITS(Ty_f32, float)
CP_FLOAT_TRAITS(Ty_f64, double)
CP_NARROW_FLOAT_TRAITS(Ty_f16, unsigned short, f16_to_f32, f32_to_f16)
CP_NARROW_FLOAT_TRAITS(Ty_bf16, unsigned short, bf16_to_f32, f32_to_bf16)
CP_NARROW_FLOAT_TRAITS(Ty_f8e4m3, unsigned char, e4m3_to_f32, f32_to_e4m3)
CP_NARROW_FLOAT_TRAITS(Ty_f8e5m2, unsigned char, e5m2_to_f32, f32_to_e5m2)
CP_INT_TRAITS(Ty_i32, int, unsigned int)
CP_INT_TRAITS(Ty_i64, long long, unsigned long long)
CP_INT_TRAITS(Ty_u32, unsigned int, unsigned int)
CP_INT_TRAITS(Ty_u64, unsigned long long, unsigned long long)
CP_INT_TRAITS(Ty_i8, signed char, unsigned int)
CP_INT_TRAITS(Ty_u8, unsigned char, unsigned int)

// Op adaptors: Op<Traits>::apply(a, b).
#define CP_OP_ADAPTOR(OP)                                                       \
    template <class Tr>                                                         \
    struct Op_##OP {                                                            \
        typedef typename Tr::T T;                                               \
        static __device__ __forceinline__ T apply(T a, T b) { return Tr::OP(a, b); } \
    };

CP_OP_ADAPTOR(sum)
CP_OP_ADAPTOR(prod)
CP_OP_ADAPTOR(min)
CP_OP_ADAPTOR(max)

#if defined(CP_MESH_TY_f32) || defined(CP_MESH_TY_f64) || defined(CP_MESH_TY_f16) ||   \
    defined(CP_MESH_TY_bf16) || defined(CP_MESH_TY_i32) || defined(CP_MESH_TY_i64) ||  \
    defined(CP_MESH_TY_u32) || defined(CP_MESH_TY_u64) || defined(CP_MESH_TY_i8) ||    \
    defined(CP_MESH_TY_u8) || defined(CP_MESH_TY_f8e4m3) || defined(CP_MESH_TY_f8e5m2)
#define CP_BUILD_MESH
#endif

// Several PTX modules come from this file (kernels/gen.sh): reduce.ptx with
// -DCP_BUILD_REDUCE, and mesh_TY.ptx with -DCP_MESH_TY_TY (one per element
// type), so that a program JIT-compiles only the kernels it uses.
#ifdef CP_BUILD_REDUCE
// ---------------------------------------------------------------------------
// Generic bodies.
// ---------------------------------------------------------------------------

// Split [0, n) into a scalar head [0, head), 16-byte vectors covering
// [head, tail) (nvec of them, starting at element `head`), and a scalar tail
// [tail, n).  `p` (dst) must be aligned to sizeof(T), so the distance to the
// next 16-byte boundary is a whole number of elements.  When `vectorizable` is
// false (operands do not share alignment mod 16) everything is head.
template <class T>
static __device__ __forceinline__ void split_range(const void* p, bool vectorizable, u64 n,
                                                   u64& head, u64& nvec, u64& tail) {
    const u64 E = 16 / sizeof(T);
    if (!vectorizable) {
        head = n;
        nvec = 0;
        tail = n;
        return;
    }
    u64 h = ((16u - (addr_of(p) & 15u)) & 15u) / sizeof(T);
    head = h < n ? h : n;
    nvec = (n - head) / E;
    tail = head + nvec * E;
}

// Maps k in [0, head + (n - tail)) onto the scalar elements: the head
// [0, head) followed by the tail [tail, n).
static __device__ __forceinline__ u64 scalar_index(u64 k, u64 head, u64 tail) {
    return k < head ? k : tail + (k - head);
}

template <class Op>
static __device__ __forceinline__ void reduce2_body(typename Op::T* dst,
                                                    const typename Op::T* a,
                                                    const typename Op::T* b,
                                                    u64 n) {
    typedef typename Op::T T;
    const u64 E = 16 / sizeof(T);
    const u64 tid = global_tid();
    const u64 stride = global_stride();

    const u64 mis = (addr_of(dst) ^ addr_of(a)) | (addr_of(dst) ^ addr_of(b));
    u64 head, nvec, tail;
    split_range<T>(dst, (mis & 15u) == 0, n, head, nvec, tail);

    const V16* va = (const V16*)(a + head);
    const V16* vb = (const V16*)(b + head);
    V16* vd = (V16*)(dst + head);
    for (u64 j = tid; j < nvec; j += stride) {
        VecView<T> x, y;
        x.v = va[j];
        y.v = vb[j];
#pragma unroll
        for (int e = 0; e < (int)E; ++e) {
            x.e[e] = Op::apply(x.e[e], y.e[e]);
        }
        vd[j] = x.v;
    }

    const u64 nscalar = head + (n - tail);
    for (u64 k = tid; k < nscalar; k += stride) {
        const u64 i = scalar_index(k, head, tail);
        dst[i] = Op::apply(a[i], b[i]);
    }
}

template <class Tr>
static __device__ __forceinline__ void scale_div_body(typename Tr::T* x, u64 n,
                                                      double divisor) {
    typedef typename Tr::T T;
    const u64 E = 16 / sizeof(T);
    const u64 tid = global_tid();
    const u64 stride = global_stride();

    u64 head, nvec, tail;
    split_range<T>(x, true, n, head, nvec, tail);

    V16* vx = (V16*)(x + head);
    for (u64 j = tid; j < nvec; j += stride) {
        VecView<T> v;
        v.v = vx[j];
#pragma unroll
        for (int e = 0; e < (int)E; ++e) {
            v.e[e] = Tr::div(v.e[e], divisor);
        }
        vx[j] = v.v;
    }

    const u64 nscalar = head + (n - tail);
    for (u64 k = tid; k < nscalar; k += stride) {
        const u64 i = scalar_index(k, head, tail);
        x[i] = Tr::div(x[i], divisor);
    }
}

// ---------------------------------------------------------------------------
// Kernel instantiation.
// ---------------------------------------------------------------------------

#define CP_REDUCE_KERNELS(OP, TY)                                               \
    extern "C" __global__ void cp_reduce2_##OP##_##TY(                          \
        Ty_##TY::T* dst, const Ty_##TY::T* a, const Ty_##TY::T* b, u64 n) {    \
        reduce2_body<Op_##OP<Ty_##TY> >(dst, a, b, n);                          \
    }

#define CP_ALL_OPS(TY)                                                          \
    CP_REDUCE_KERNELS(sum, TY)                                                  \
    CP_REDUCE_KERNELS(prod, TY)                                                 \
    CP_REDUCE_KERNELS(min, TY)                                                  \
    CP_REDUCE_KERNELS(max, TY)

#define CP_SCALE_DIV_KERNEL(TY)                                                 \
    extern "C" __global__ void cp_scale_div_##TY(Ty_##TY::T* x, u64 n,          \
                                                 double divisor) {              \
        scale_div_body<Ty_##TY>(x, n, divisor);                                 \
    }

CP_ALL_OPS(f32)
CP_ALL_OPS(f64)
CP_ALL_OPS(f16)
CP_ALL_OPS(bf16)
CP_ALL_OPS(i32)
CP_ALL_OPS(i64)
CP_ALL_OPS(u32)
CP_ALL_OPS(u64)
CP_ALL_OPS(i8)
CP_ALL_OPS(u8)
CP_ALL_OPS(f8e4m3)
CP_ALL_OPS(f8e5m2)

CP_SCALE_DIV_KERNEL(f32)
CP_SCALE_DIV_KERNEL(f64)
CP_SCALE_DIV_KERNEL(f16)
CP_SCALE_DIV_KERNEL(bf16)
CP_SCALE_DIV_KERNEL(f8e4m3)
CP_SCALE_DIV_KERNEL(f8e5m2)

// n bytes from src to dst (distinct) by threads tid, tid + stride, ...:
// 16-byte vectors where both are 16-byte aligned, U loads in flight per
// thread before their stores (U = 4 where one block copies from a peer's
// memory, so that a copy is not one round trip per vector), bytes
// otherwise.
template <int U>
static __device__ __forceinline__ void copy_bytes(unsigned char* dst, const unsigned char* src, u64 n, u64 tid,
                                                  u64 stride) {
    if ((((u64)dst | (u64)src) & 15u) == 0) {
        const u64 nv = n / 16;
        uint4* vd = (uint4*)dst;
        const uint4* vs = (const uint4*)src;
        for (u64 i = tid; i < nv; i += U * stride) {
            uint4 v[U];
#pragma unroll
            for (int k = 0; k < U; ++k)
                if (i + k * stride < nv) v[k] = vs[i + k * stride];
#pragma unroll
            for (int k = 0; k < U; ++k)
                if (i + k * stride < nv) vd[i + k * stride] = v[k];
        }
        for (u64 i = nv * 16 + tid; i < n; i += stride) dst[i] = src[i];
    } else {
        for (u64 i = tid; i < n; i += stride) dst[i] = src[i];
    }
}

// cp_copy(dst, src, n): n bytes from src to dst (distinct), with the SMs
// (copy_bytes). For ranks that are threads sharing one device, whose copies
// must not queue behind one another's on the copy engines while their
// kernels wait for each other (see `Comm::copy` in src/ipc/comm/ops.rs).
extern "C" __global__ void cp_copy(unsigned char* dst, const unsigned char* src, u64 n) {
    copy_bytes<1>(dst, src, n, (u64)blockIdx.x * blockDim.x + threadIdx.x, (u64)gridDim.x * blockDim.x);
}
#endif  // CP_BUILD_REDUCE

// ---------------------------------------------------------------------------
// Mesh all-reduce: one kernel per rank, every rank P2P-connected to every
// other (distinct GPUs). Two-shot: rank r reduces segment r of every rank's
// input by peer loads, in rank order 0..N-1 (so every rank's result is
// bitwise identical), and writes the result into segment r of every rank's
// output by peer stores. Per-block barriers of flags (release/acquire at
// system scope) open and close the kernel:
//   start: every rank's kernel has begun, so its inputs are ready (stream
//          order) and its previous collective is over, and every rank has
//          decided to go on (see mesh_start: a rank that gave up is never
//          touched afterwards);
//   end:   every peer's block b has written its segment into our output.
// Block b of every rank handles the same element indices of its own
// segment, so a barrier between blocks with the same index is enough.
//
//   cp_meshar_OP_TY(PtrArray ins, PtrArray outs, PtrArray flags,
//                   int nranks, int rank, u64 n, u64 seg, int vec,
//                   unsigned* ctl, u64 timeout_ns, unsigned call)
//     ins/outs: each rank's buffers (outs may equal ins: in place);
//     flags: each rank's flag area (MESH_FLAG_WORDS u32, zeroed once at
//            creation; the block counters at its end are this rank's own);
//     seg: elements per segment, a multiple of 16/sizeof(T);
//     vec: 1 when every ins/outs pointer is 16-byte aligned.
//   Launch: the same grid on every rank, at most MESH_MAX_BLOCKS blocks,
//   small enough that every block is resident at once; 1-D blocks of at
//   least nranks threads.
//   ctl, timeout_ns: the group's control block and how long a barrier may
//   wait (see wait_flag): a barrier that gives up ends the kernel early,
//   cleanly, with the reason in ctl; the group is then out of step and
//   the host refuses further calls on it. A kernel that starts with the
//   abort word set (a graph replayed after a failure) touches no buffer.
//   call: the host's number of the call, for the failure record.
// ---------------------------------------------------------------------------


// The flag and control-block helpers: the mesh and one-shot kernels', and
// the point-to-point meeting's (in the reduction module).
#if defined(CP_BUILD_REDUCE) || defined(CP_BUILD_MESH)

static __device__ __forceinline__ void st_release_sys(unsigned int* p, unsigned int v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

static __device__ __forceinline__ unsigned int ld_acquire_sys(const unsigned int* p) {
    unsigned int v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

static __device__ __forceinline__ u64 global_timer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

static __device__ __forceinline__ void st_relaxed_sys_u64(u64* p, u64 v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

static __device__ __forceinline__ u64 ld_relaxed_sys_u64(const u64* p) {
    u64 v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// A communicator's control block, in pinned host memory mapped for every
// rank's device (see `Ctl` in src/failure.rs; between processes, memory the
// processes share, so that every rank's kernels see one abort word):
//   word CTL_ABORT: nonzero asks every waiting kernel to give up (the host
//     sets it when a call could not be launched on every rank; a kernel
//     sets it when it times out, so that its peers give up too);
//   the u64 at word CTL_RECORD(r) (8-byte aligned): rank r's first failure,
//     its code (CTL_TIMEOUT, CTL_ABORTED, CTL_MISMATCH) in the low half and
//     the call (the host's call number; for a mismatch, the peer) in the
//     high half, written in one store, before the abort word (a release):
//     whoever sees the abort word set by a kernel sees its record.
#define CTL_ABORT 0
#define CTL_RECORD(r) (2 + 2 * (r))
#define CTL_TIMEOUT 1u
#define CTL_ABORTED 2u

// Records rank `rank`'s failure unless it has one.
static __device__ __forceinline__ void ctl_fail(unsigned int* ctl, int rank, unsigned int code, unsigned int call) {
    u64* rec = (u64*)(ctl + CTL_RECORD(rank));
    if (ld_relaxed_sys_u64(rec) == 0u) st_relaxed_sys_u64(rec, (u64)code | ((u64)call << 32));
}

// Records the failure, then sets the abort word: the release publishes the
// record with it.
static __device__ __forceinline__ void ctl_fail_abort(unsigned int* ctl, int rank, unsigned int code,
                                                      unsigned int call) {
    ctl_fail(ctl, rank, code, call);
    st_release_sys(ctl + CTL_ABORT, 1u);
}

static __device__ __forceinline__ bool ctl_aborted(const unsigned int* ctl) {
    return ld_acquire_sys(ctl + CTL_ABORT) != 0u;
}

// Spins until *p reaches `value` (acquire, system scope). Gives up, and
// returns false, after `timeout_ns` of waiting (a signed difference of
// %globaltimer, so a clock that steps back cannot make it fire early),
// recording a timeout of call `call` and setting the abort word; with
// `heed_abort`, also when the abort word is set (recording CTL_ABORTED).
// Never traps: the context survives.
static __device__ __forceinline__ bool wait_flag(const unsigned int* p, unsigned int value, unsigned int* ctl,
                                                 u64 timeout_ns, int rank, unsigned int call, bool heed_abort) {
    u64 start = 0;
    unsigned int spins = 0;
    while ((int)(ld_acquire_sys(p) - value) < 0) {
        if ((++spins & 1023u) == 0) {
            if (heed_abort && ctl_aborted(ctl)) {
                ctl_fail(ctl, rank, CTL_ABORTED, call);
                return false;
            }
            const u64 now = global_timer_ns();
            if (start == 0) {
                start = now;
            } else if ((long long)(now - start) > (long long)timeout_ns) {
                ctl_fail_abort(ctl, rank, CTL_TIMEOUT, call);
                return false;
            }
        }
    }
    return true;
}

#endif  // CP_BUILD_REDUCE || CP_BUILD_MESH

// ---------------------------------------------------------------------------
// Point-to-point: two ranks meet (send/recv, groups, all-to-all(-v)).
//
// A meeting's words (PairMeet), for part `b` of an exchange: the flags and
// counters of part b lie PAIR_BLOCK_WORDS words after those of part b - 1
// (part 0's are the ones the host names), the view slots are part 0's.
//     counter: this rank's count of meetings with the peer for the part,
//              in its own device memory (so a replayed graph advances it
//              too); the meeting's value is counter + 1, stored back on
//              success;
//     theirs:  the peer's flag word for this rank (in the peer's region),
//              set to the value with a release (system scope), after
//              this rank's earlier stores and copies;
//     mine:    this rank's flag word for the peer, waited for (see
//              wait_flag);
//     check:   the first meeting of an exchange (part 0 only): this rank's
//              view of it (out_view: what it sends the peer, in_view: what
//              it receives, each a value the host computes from the message
//              lengths) goes into the peer's view slot for this rank before
//              the flag; after the wait, the peer's view (in my_view) must
//              mirror it, else the meeting fails with CTL_MISMATCH (its
//              record names the peer) and sets the abort word.
//
//   cp_pair_sync(PairMeet m, unsigned* ctl, int rank, unsigned call,
//                u64 timeout_ns)
//     One meeting of part 0 (one thread); `call` is the host's number of
//     the call (for the failure record).
//
//   cp_pair_xchg(PairJobs jobs, int njobs, unsigned* ctl, int rank,
//                unsigned call, u64 timeout_ns)
//     Whole exchanges of one chunk (job j = blockIdx.y < njobs <=
//     PAIR_MAX_JOBS; the jobs do not wait for each other), each split into
//     `parts` parts (blockIdx.x < parts <= PAIR_MAX_BLOCKS, both ranks
//     split by the same lengths: see pair_part), a block each, in the order
//     the host otherwise enqueues an exchange as four steps: the block
//     copies its part of the out_bytes it sends from src into this rank's
//     slot for the peer (my_slot), meets the peer's block of the same part
//     (the first meeting, views compared in part 0 when `check`), copies
//     its part of the in_bytes it receives from the peer's slot for this
//     rank (their_slot) into dst, and meets the peer's block again, so that
//     neither refills a slot the other still reads. Each part's counter
//     advances by two. A failed meeting ends the block (dst then holds
//     undefined data, as after a failed exchange of steps).
//
//   A kernel that finds the abort word set does nothing (CTL_ABORTED).
// ---------------------------------------------------------------------------

#ifdef CP_BUILD_REDUCE
#define CTL_MISMATCH 3u
#define PAIR_MAX_JOBS 8
#define PAIR_MAX_BLOCKS 8
#define PAIR_BLOCK_WORDS 8

// The words of one meeting (see above); 64 bytes, the layout of `PairMeet`
// in src/kernels/launch.rs.
struct PairMeet {
    unsigned int* theirs;
    const unsigned int* mine;
    unsigned int* counter;
    u64* their_view;
    const u64* my_view;
    u64 out_view;
    u64 in_view;
    int peer;
    int check;
};

// One meeting of part `b` with value v, by one thread: whether it
// succeeded.
static __device__ __forceinline__ bool pair_meet(const PairMeet& m, unsigned int b, unsigned int v, bool check,
                                                 unsigned int* ctl, int rank, unsigned int call, u64 timeout_ns) {
    if (check) {
        st_relaxed_sys_u64(m.their_view, m.out_view);
        st_relaxed_sys_u64(m.their_view + 1, m.in_view);
    }
    st_release_sys(m.theirs + b * PAIR_BLOCK_WORDS, v);
    if (!wait_flag(m.mine + b * PAIR_BLOCK_WORDS, v, ctl, timeout_ns, rank, call, true)) return false;
    if (check && (ld_relaxed_sys_u64(m.my_view) != m.in_view || ld_relaxed_sys_u64(m.my_view + 1) != m.out_view)) {
        ctl_fail_abort(ctl, rank, CTL_MISMATCH, (unsigned int)m.peer);
        return false;
    }
    return true;
}

extern "C" __global__ void cp_pair_sync(PairMeet m, unsigned int* ctl, int rank, unsigned int call,
                                        u64 timeout_ns) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const unsigned int v = *m.counter + 1u;
    if (ctl_aborted(ctl)) {
        ctl_fail(ctl, rank, CTL_ABORTED, call);
        return;
    }
    if (pair_meet(m, 0, v, m.check != 0, ctl, rank, call, timeout_ns)) *m.counter = v;
}

// One exchange of cp_pair_xchg (see above); 120 bytes, the layout of
// `PairJob` in src/kernels/launch.rs.
struct PairJob {
    PairMeet meet;
    unsigned char* my_slot;
    const unsigned char* src;
    u64 out_bytes;
    unsigned char* dst;
    const unsigned char* their_slot;
    u64 in_bytes;
    int parts;
};

struct PairJobs {
    PairJob j[PAIR_MAX_JOBS];
};

// Bytes [*lo, *hi) of n: part b of `parts`, in multiples of 256 bytes but
// for the last part's end. Both ranks of an exchange split one length the
// same way.
static __device__ __forceinline__ void pair_part(u64 n, unsigned int b, unsigned int parts, u64* lo, u64* hi) {
    const u64 per = (n / parts + 255u) & ~(u64)255u;
    *lo = min(n, (u64)b * per);
    *hi = b + 1 == parts ? n : min(n, (u64)(b + 1) * per);
}

extern "C" __global__ void cp_pair_xchg(PairJobs jobs, int njobs, unsigned int* ctl, int rank, unsigned int call,
                                        u64 timeout_ns) {
    if ((int)blockIdx.y >= njobs || blockIdx.y >= PAIR_MAX_JOBS) return;
    __shared__ PairJob job;
    __shared__ int ok;
    __shared__ unsigned int value;
    const u64 tid = threadIdx.x, stride = blockDim.x;
    const unsigned int b = blockIdx.x;
    if (tid == 0) {
        // Constant indices: a dynamic index into the parameter would put
        // it on the stack.
#pragma unroll
        for (int k = 0; k < PAIR_MAX_JOBS; ++k)
            if (k == (int)blockIdx.y) job = jobs.j[k];
        ok = b < (unsigned int)job.parts && job.parts <= PAIR_MAX_BLOCKS;
        if (ok) {
            value = job.meet.counter[b * PAIR_BLOCK_WORDS] + 1u;
            ok = !ctl_aborted(ctl);
            if (!ok) ctl_fail(ctl, rank, CTL_ABORTED, call);
        }
    }
    __syncthreads();
    if (!ok) return;
    const unsigned int parts = (unsigned int)job.parts;
    u64 lo, hi;
    pair_part(job.out_bytes, b, parts, &lo, &hi);
    copy_bytes<4>(job.my_slot + lo, job.src + lo, hi - lo, tid, stride);
    // Cumulative release after __syncthreads (see mesh_barrier): the
    // meeting's flag publishes the block's copy into the slot.
    __syncthreads();
    if (tid == 0) ok = pair_meet(job.meet, b, value, b == 0 && job.meet.check != 0, ctl, rank, call, timeout_ns);
    __syncthreads();
    if (!ok) return;
    pair_part(job.in_bytes, b, parts, &lo, &hi);
    copy_bytes<4>(job.dst + lo, job.their_slot + lo, hi - lo, tid, stride);
    __syncthreads();
    if (tid == 0 && pair_meet(job.meet, b, value + 1u, false, ctl, rank, call, timeout_ns))
        job.meet.counter[b * PAIR_BLOCK_WORDS] = value + 1u;
}
#endif  // CP_BUILD_REDUCE

#ifdef CP_BUILD_MESH
#define MESH_MAX_BLOCKS 1024
#define MESH_MAX_RANKS 8
#define MESH_UNROLL 4
#define MESH_COUNTERS_OFFSET (3 * MESH_MAX_BLOCKS * MESH_MAX_RANKS)
#define MESH_FLAG_WORDS (MESH_COUNTERS_OFFSET + MESH_MAX_BLOCKS)
#define MESH_ARRIVE 0
#define MESH_END 1
#define MESH_DECIDE 2

static __device__ __forceinline__ unsigned int ld_relaxed_sys(const unsigned int* p) {
    unsigned int v;
    asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// The thread that reads the abort word when a fused kernel starts: one
// outside the first warp where the block has one, so that the load (host
// memory) runs beside the first barrier's waits instead of before them.
static __device__ __forceinline__ bool abort_reader() {
    return threadIdx.x == (blockDim.x > 32u ? 32u : 0u);
}
// Rank `to`'s cell for rank `from` in barrier `slot` of this block.
static __device__ __forceinline__ unsigned int* mesh_cell(unsigned int* const* flags, int to, int from, int slot) {
    return flags[to] + (u64)(slot * MESH_MAX_BLOCKS + blockIdx.x) * MESH_MAX_RANKS + from;
}

// One barrier of the block: thread p < nranks stores `value` into peer p's
// cell for this rank and waits for peer p's value in this rank's cell.
// `flags` is a copy of the flag pointers in shared memory (a dynamic index
// into the kernel parameter would put the array on the stack). Returns
// whether every wait of the block succeeded (see wait_flag).
static __device__ __forceinline__ bool mesh_barrier(unsigned int* const* flags, int nranks, int rank,
                                                    unsigned int value, int slot, unsigned int* ctl,
                                                    u64 timeout_ns, unsigned int call, bool heed_abort,
                                                    int also = 1) {
    __syncthreads();
    int ok = 1;
    if ((int)threadIdx.x < nranks) {
        const int p = threadIdx.x;
        // No fence before the release: __syncthreads orders the block's
        // stores before this thread's, and a release is cumulative, so the
        // flag publishes them at system scope. (A __threadfence_system here
        // cost 2-4 us per call on 2x H200, 1-16 MiB, one run.)
        st_release_sys(mesh_cell(flags, p, rank, slot), value);
        ok = wait_flag(mesh_cell(flags, rank, p, slot), value, ctl, timeout_ns, rank, call, heed_abort);
    }
    // `also` last: a load it comes from stays in flight through the waits.
    return __syncthreads_and(ok && also) != 0;
}

// The start of a call (value v): whether this block may touch the peers'
// buffers. A rank touches them only if every rank of the group decided so,
// and a rank that gave up has decided not to, so no rank ever reads or
// writes the buffers of a rank whose call returned without them:
//   arrive: every rank's kernel has begun (its inputs are ready, its
//           previous call is over), bounded by the timeout;
//   decide: each rank tells every peer whether all arrived and the abort
//           word is clear (2v: go, 2v + 1: not), then, if it said go,
//           waits for every peer's word. Every peer arrived, so each one
//           decides within its own timeout; this wait does not heed the
//           abort word (a peer that said go may be past it already), and
//           gives up only after twice the timeout (a kernel stalled that
//           long after it arrived). The block goes on only if every word
//           says go.
// `entry_abort`: in the thread that read it (abort_reader), the abort word
// as read when the kernel started (a load left in flight until here).
static __device__ __forceinline__ bool mesh_start(unsigned int* const* flags, int nranks, int rank, unsigned int v,
                                                  unsigned int* ctl, u64 timeout_ns, unsigned int call,
                                                  unsigned int entry_abort) {
    const bool go = mesh_barrier(flags, nranks, rank, v, MESH_ARRIVE, ctl, timeout_ns, call, true, entry_abort == 0u);
    if (entry_abort != 0u) ctl_fail(ctl, rank, CTL_ABORTED, call);
    const unsigned int word = 2u * v + (go ? 0u : 1u);
    if ((int)threadIdx.x < nranks) st_release_sys(mesh_cell(flags, threadIdx.x, rank, MESH_DECIDE), word);
    if (!go) return false;
    int all = 1;
    if ((int)threadIdx.x < nranks) {
        const unsigned int* mine = mesh_cell(flags, rank, threadIdx.x, MESH_DECIDE);
        const u64 most = 0x7fffffffffffffffull;
        const u64 longer = timeout_ns > most / 2 ? most : 2 * timeout_ns;
        all = wait_flag(mine, 2u * v, ctl, longer, rank, call, false) && ld_acquire_sys(mine) == 2u * v;
    }
    return __syncthreads_and(all) != 0;
}

template <class Op>
static __device__ __forceinline__ void meshar_body(const PtrArray& ins, const PtrArray& outs,
                                   const PtrArray& flags, int nranks, int rank,
                                   u64 n, u64 seg, int vec, unsigned int* ctl, u64 timeout_ns,
                                   unsigned int call) {
    typedef typename Op::T T;
    if (nranks < 1 || nranks > MESH_MAX_RANKS || rank < 0 || rank >= nranks) return;
    if (gridDim.x > MESH_MAX_BLOCKS || (int)blockDim.x < nranks) return;
    __shared__ unsigned int value;
    __shared__ unsigned int* sflags[MESH_MAX_RANKS];
    const unsigned int entry_abort = abort_reader() ? ld_relaxed_sys(ctl + CTL_ABORT) : 0u;
    if (threadIdx.x == 0) {
#pragma unroll
        for (int k = 0; k < MESH_MAX_RANKS; ++k) sflags[k] = (unsigned int*)flags.p[k];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int* counters = sflags[rank] + MESH_COUNTERS_OFFSET;
        value = counters[blockIdx.x] + 1u;
        counters[blockIdx.x] = value;
    }
    __syncthreads();
    const unsigned int v = value;
    if (!mesh_start(sflags, nranks, rank, v, ctl, timeout_ns, call, entry_abort)) return;

    const u64 lo = (u64)rank * seg < n ? (u64)rank * seg : n;
    const u64 hi = lo + seg < n ? lo + seg : n;
    const u64 len = hi - lo;
    const u64 E = 16 / sizeof(T);
    const u64 nvec = vec ? len / E : 0;
    const u64 tid = global_tid();
    const u64 stride = global_stride();

    // Each thread keeps MESH_UNROLL vectors in flight per rank (indices
    // j0, j0 + stride, ...: the same grid-stride set as without unrolling,
    // so block b still handles the same elements on every rank).
    for (u64 j0 = tid; j0 < nvec; j0 += stride * MESH_UNROLL) {
        VecView<T> acc[MESH_UNROLL];
#pragma unroll
        for (int u = 0; u < MESH_UNROLL; ++u) {
            const u64 j = j0 + (u64)u * stride;
            if (j < nvec) acc[u].v = ((const V16*)((const T*)ins.p[0] + lo))[j];
        }
#pragma unroll
        for (int k = 1; k < MESH_MAX_RANKS; ++k) {
            if (k < nranks) {
                VecView<T> x[MESH_UNROLL];
#pragma unroll
                for (int u = 0; u < MESH_UNROLL; ++u) {
                    const u64 j = j0 + (u64)u * stride;
                    if (j < nvec) x[u].v = ((const V16*)((const T*)ins.p[k] + lo))[j];
                }
#pragma unroll
                for (int u = 0; u < MESH_UNROLL; ++u) {
#pragma unroll
                    for (int e = 0; e < (int)E; ++e) {
                        acc[u].e[e] = Op::apply(acc[u].e[e], x[u].e[e]);
                    }
                }
            }
        }
#pragma unroll
        for (int k = 0; k < MESH_MAX_RANKS; ++k) {
            if (k < nranks) {
#pragma unroll
                for (int u = 0; u < MESH_UNROLL; ++u) {
                    const u64 j = j0 + (u64)u * stride;
                    if (j < nvec) ((V16*)((T*)outs.p[k] + lo))[j] = acc[u].v;
                }
            }
        }
    }
    for (u64 i = nvec * E + tid; i < len; i += stride) {
        T acc = ((const T*)ins.p[0])[lo + i];
#pragma unroll
        for (int k = 1; k < MESH_MAX_RANKS; ++k) {
            if (k < nranks) acc = Op::apply(acc, ((const T*)ins.p[k])[lo + i]);
        }
#pragma unroll
        for (int k = 0; k < MESH_MAX_RANKS; ++k) {
            if (k < nranks) ((T*)outs.p[k])[lo + i] = acc;
        }
    }

    // Every rank said go, so every rank reaches this barrier: it does not
    // heed the abort word (a rank leaves only after its peers' stores into
    // its output are done).
    mesh_barrier(sflags, nranks, rank, v, MESH_END, ctl, timeout_ns, call, false);
}

// ---------------------------------------------------------------------------
// One-shot all-reduce through scratch slots. Every rank pushes its input into
// a slot that every other rank can read, raises a flag, waits for the other
// ranks' flags, then reduces all slots (its own input read locally) in rank
// order 0..N-1 into its output: one barrier, and stores only on the link.
// The slots live either in every peer's device memory (P2P: rank r stores
// into each peer's region) or in one mapped pinned host buffer shared by all
// ranks (no P2P: rank r stores once, every rank reads from host memory).
//
// A region is ONESHOT_FLAG_BYTES of flags, u32 [source rank][block], then
// the data: [set ONESHOT_SETS][source rank nranks][cap bytes]. Messages
// longer than cap bytes run in rounds of cap bytes; a round uses slot set
// (v mod ONESHOT_SETS), v being the block's round counter. Data is handled in
// 16-byte units; unit j of a round always belongs to thread j % stride of
// the grid, and the grid is the same on every launch of a lane, so block b
// of every rank always writes and reads the same units. A block raises its
// flag v once it has pushed round v. Modes (`ahead`, the same on every
// rank for every launch of a lane):
//   ONESHOT_PLAIN: per round, push v, raise flag v, wait for the peers'
//   flags v, reduce v. Flag v also says the block reduced round v - 1.
//   Pushing v overwrites the set of round v - ONESHOT_SETS, which every
//   peer has reduced: its flag v - 1, already seen, was raised after it
//   reduced round v - 2.
//   ONESHOT_AHEAD: push round v + 1 right after raising flag v, so that
//   those stores cross the link while the block waits for round v and
//   reduces it. Flag v + 1 is raised after the reduction of v, as above.
//   Pushing v + 1 overwrites the set of round v + 1 - ONESHOT_SETS, which
//   every peer has reduced by the same argument (three sets would do).
//   ONESHOT_DEEP: push rounds 0 and 1 (raising their flags), then for each
//   round v: wait for the peers' flags v, then reduce v and push v + 2 in
//   one pass, group by group, and raise flag v + 2. Flag v + 2 says the
//   block reduced round v. Pushing v + 2 overwrites the set of round v - 2,
//   which every peer reduced before raising its flag v, just seen; a peer
//   pushes into the set this block reduces (v + 4) only after this block's
//   flag v + 2. This needs all four sets.
//   Four sets, a power of two, keep the set index continuous where the u32
//   counter wraps. A call's first pushes rely on its previous call on the
//   lane: its last wait saw every peer's flag of the last round, raised
//   after every earlier round was reduced (by that kernel or, in stream
//   order, by one before it).
//
//   cp_oneshot_OP_TY(PtrArray push, int npush, const void* pull,
//                    const T* in, T* out, unsigned* counters,
//                    int nranks, int rank, u64 n, u64 cap, int ahead,
//                    unsigned* ctl, u64 timeout_ns, unsigned call)
//     push:  the regions this rank stores its slot and flags into (npush);
//     pull:  the region this rank reads slots and polls flags from;
//     in/out: element-aligned (out may equal in); 16-byte vector loads
//            and stores where both are 16-byte aligned;
//     counters: this rank's own block counters (ONESHOT_MAX_BLOCKS words,
//            zeroed at creation);
//     cap:   slot bytes, a multiple of 16;
//     ahead: ONESHOT_PLAIN, ONESHOT_AHEAD or ONESHOT_DEEP (see above).
//   Launch: the same grid on every rank and for every call of the group, at
//   most ONESHOT_MAX_BLOCKS blocks, all resident at once; 1-D blocks of at
//   least nranks threads. ctl, timeout_ns, call: as for the mesh; a kernel
//   that starts with the abort word set (a graph replayed after a failure)
//   writes nothing into `out` and leaves its counters (it may still push
//   into the slots: memory of the failed group's own).
// ---------------------------------------------------------------------------
#define ONESHOT_MAX_BLOCKS 128
#define ONESHOT_FLAG_BYTES (MESH_MAX_RANKS * ONESHOT_MAX_BLOCKS * 4)
#define ONESHOT_UNROLL 4
#define ONESHOT_SETS 4
#define ONESHOT_PLAIN 0
#define ONESHOT_AHEAD 1
#define ONESHOT_DEEP 2


// The last, partial 16-byte unit of a round (elements [j*E, len)), as a
// whole unit with the missing elements zero.
template <class T>
static __device__ __forceinline__ V16 load_partial(const T* src, u64 j, u64 len) {
    const u64 E = 16 / sizeof(T);
    VecView<T> x;
    x.v.x = x.v.y = x.v.z = x.v.w = 0u;
#pragma unroll
    for (int e = 0; e < (int)E; ++e) {
        if (j * E + e < len) x.e[e] = src[j * E + e];
    }
    return x.v;
}

// Unit j (16 bytes) of src, by one vector load when `vec`, else element by
// element (src is then only element-aligned).
template <class T>
static __device__ __forceinline__ V16 load_unit(const T* src, u64 j, bool vec) {
    if (vec) return ((const V16*)src)[j];
    const u64 E = 16 / sizeof(T);
    VecView<T> x;
#pragma unroll
    for (int e = 0; e < (int)E; ++e) x.e[e] = src[j * E + e];
    return x.v;
}

// Stores unit j of dst, as load_unit reads it.
template <class T>
static __device__ __forceinline__ void store_unit(T* dst, u64 j, V16 v, bool vec) {
    if (vec) {
        ((V16*)dst)[j] = v;
        return;
    }
    const u64 E = 16 / sizeof(T);
    VecView<T> x;
    x.v = v;
#pragma unroll
    for (int e = 0; e < (int)E; ++e) dst[j * E + e] = x.e[e];
}

// The elements of round `round` of n in rounds of per_round.
static __device__ __forceinline__ u64 round_len(u64 n, u64 round, u64 per_round) {
    const u64 off = round * per_round;
    return n - off < per_round ? n - off : per_round;
}

// The first slot of round value v's set: slot_of(v, nranks) + k is rank k's.
static __device__ __forceinline__ u64 slot_of(unsigned int v, int nranks) {
    return (u64)(v & (ONESHOT_SETS - 1u)) * (u64)nranks;
}

// Pushes this thread's group of ONESHOT_UNROLL units j0, j0 + stride, ...
// (those below `full`) of src into slot `slot` of every push region.
template <class T>
static __device__ __forceinline__ void push_group(char* const* spush, int npush, const T* src, u64 full, u64 slot,
                                                  u64 cap, bool vec, u64 j0, u64 stride) {
    V16 x[ONESHOT_UNROLL];
#pragma unroll
    for (int u = 0; u < ONESHOT_UNROLL; ++u) {
        const u64 j = j0 + (u64)u * stride;
        if (j < full) x[u] = load_unit<T>(src, j, vec);
    }
    for (int k = 0; k < npush; ++k) {
        V16* to = (V16*)(spush[k] + ONESHOT_FLAG_BYTES + slot * cap);
#pragma unroll
        for (int u = 0; u < ONESHOT_UNROLL; ++u) {
            const u64 j = j0 + (u64)u * stride;
            if (j < full) to[j] = x[u];
        }
    }
}

// The last, partial unit of a pushed round (len elements), by its thread.
template <class T>
static __device__ __forceinline__ void push_tail(char* const* spush, int npush, const T* src, u64 len, u64 slot,
                                                 u64 cap, u64 tid, u64 stride) {
    const u64 E = 16 / sizeof(T);
    const u64 full = len / E;
    if (full * E < len && tid == full % stride) {
        const V16 x = load_partial<T>(src, full, len);
        for (int k = 0; k < npush; ++k) ((V16*)(spush[k] + ONESHOT_FLAG_BYTES + slot * cap))[full] = x;
    }
}

// Reduces this thread's group of units j0, j0 + stride, ... (those below
// `full`): every rank's slot `slot0 + k` of pdata (this rank's own units
// read from src instead), in rank order, into dst.
template <class Op>
static __device__ __forceinline__ void reduce_group(const char* pdata, const typename Op::T* src,
                                                    typename Op::T* dst, u64 full, u64 slot0, u64 cap,
                                                    int nranks, int rank, bool vec, u64 j0, u64 stride) {
    typedef typename Op::T T;
    const u64 E = 16 / sizeof(T);
    VecView<T> acc[ONESHOT_UNROLL];
#pragma unroll 1
    for (int k = 0; k < MESH_MAX_RANKS; ++k) {
        if (k < nranks) {
            const V16* from = (const V16*)(pdata + (slot0 + (u64)k) * cap);
            VecView<T> x[ONESHOT_UNROLL];
#pragma unroll
            for (int u = 0; u < ONESHOT_UNROLL; ++u) {
                const u64 j = j0 + (u64)u * stride;
                if (j < full) x[u].v = k == rank ? load_unit<T>(src, j, vec) : from[j];
            }
#pragma unroll
            for (int u = 0; u < ONESHOT_UNROLL; ++u) {
                if (k == 0) {
                    acc[u].v = x[u].v;
                } else {
#pragma unroll
                    for (int e = 0; e < (int)E; ++e) acc[u].e[e] = Op::apply(acc[u].e[e], x[u].e[e]);
                }
            }
        }
    }
#pragma unroll
    for (int u = 0; u < ONESHOT_UNROLL; ++u) {
        const u64 j = j0 + (u64)u * stride;
        if (j < full) store_unit<T>(dst, j, acc[u].v, vec);
    }
}

// The last, partial unit of a reduced round (len elements), by its thread.
template <class Op>
static __device__ __forceinline__ void reduce_tail(const char* pdata, const typename Op::T* src,
                                                   typename Op::T* dst, u64 len, u64 slot0, u64 cap,
                                                   int nranks, int rank, u64 tid, u64 stride) {
    typedef typename Op::T T;
    const u64 E = 16 / sizeof(T);
    const u64 full = len / E;
    if (full * E < len && tid == full % stride) {
        for (u64 i = full * E; i < len; ++i) {
            T acc = src[i];
            for (int k = 0; k < nranks; ++k) {
                const T x = k == rank ? src[i] : ((const T*)(pdata + (slot0 + (u64)k) * cap))[i];
                acc = k == 0 ? x : Op::apply(acc, x);
            }
            dst[i] = acc;
        }
    }
}

// Stores this rank's units of one round (len elements of src) into slot
// `slot` of every push region; unit j is thread (j % stride)'s of the
// threads doing this (tid: this thread's index among them).
template <class T>
static __device__ __forceinline__ void oneshot_push(char* const* spush, int npush, const T* src, u64 len,
                                                    u64 slot, u64 cap, bool vec, u64 tid, u64 stride) {
    const u64 full = len / (16 / sizeof(T));
    for (u64 j0 = tid; j0 < full; j0 += stride * ONESHOT_UNROLL) push_group<T>(spush, npush, src, full, slot, cap, vec, j0, stride);
    push_tail<T>(spush, npush, src, len, slot, cap, tid, stride);
}

// Reduces one round: every rank's slot `slot0 + k` of pdata (this rank's own
// units read from src instead), in rank order, into dst; units as for
// oneshot_push.
template <class Op>
static __device__ __forceinline__ void oneshot_reduce(const char* pdata, const typename Op::T* src,
                                                      typename Op::T* dst, u64 len, u64 slot0, u64 cap,
                                                      int nranks, int rank, bool vec, u64 tid, u64 stride) {
    const u64 full = len / (16 / sizeof(typename Op::T));
    for (u64 j0 = tid; j0 < full; j0 += stride * ONESHOT_UNROLL) {
        reduce_group<Op>(pdata, src, dst, full, slot0, cap, nranks, rank, vec, j0, stride);
    }
    reduce_tail<Op>(pdata, src, dst, len, slot0, cap, nranks, rank, tid, stride);
}

// One pass that pushes a round (plen elements of psrc into slot pslot) and
// reduces another (as oneshot_reduce), group by group, so that each warp
// has stores crossing the link while it loads and stores locally.
template <class Op>
static __device__ __forceinline__ void oneshot_fused(char* const* spush, int npush, const typename Op::T* psrc,
                                                     u64 plen, u64 pslot, const char* pdata,
                                                     const typename Op::T* src, typename Op::T* dst, u64 len,
                                                     u64 slot0, u64 cap, int nranks, int rank, bool vec, u64 tid,
                                                     u64 stride) {
    typedef typename Op::T T;
    const u64 E = 16 / sizeof(T);
    const u64 pfull = plen / E;
    const u64 full = len / E;
    const u64 most = pfull > full ? pfull : full;
    for (u64 j0 = tid; j0 < most; j0 += stride * ONESHOT_UNROLL) {
        push_group<T>(spush, npush, psrc, pfull, pslot, cap, vec, j0, stride);
        reduce_group<Op>(pdata, src, dst, full, slot0, cap, nranks, rank, vec, j0, stride);
    }
    push_tail<T>(spush, npush, psrc, plen, pslot, cap, tid, stride);
    reduce_tail<Op>(pdata, src, dst, len, slot0, cap, nranks, rank, tid, stride);
}

// Flag v of this block in every push region: everything the block stored
// (and read) before it is done.
static __device__ __forceinline__ void oneshot_flag(char* const* spush, int npush, int rank, unsigned int v) {
    __syncthreads();
    if ((int)threadIdx.x < npush) {
        unsigned int* f = (unsigned int*)spush[threadIdx.x] + rank * ONESHOT_MAX_BLOCKS + blockIdx.x;
        // Cumulative release after __syncthreads: see mesh_barrier.
        st_release_sys(f, v);
    }
}

// Waits for every peer's flag v of this block; false if a wait gave up.
// `also` is ANDed in last (see mesh_barrier).
static __device__ __forceinline__ bool oneshot_wait(const unsigned int* pflags, int nranks, int rank, unsigned int v,
                                                    unsigned int* ctl, u64 timeout_ns, unsigned int call,
                                                    int also = 1) {
    int ok = 1;
    if ((int)threadIdx.x < nranks && (int)threadIdx.x != rank) {
        ok = wait_flag(pflags + threadIdx.x * ONESHOT_MAX_BLOCKS + blockIdx.x, v, ctl, timeout_ns, rank, call, true);
    }
    return __syncthreads_and(ok && also) != 0;
}

template <class Op>
static __device__ __forceinline__ void oneshot_body(const PtrArray& push, int npush, const void* pull,
                                    const typename Op::T* in, typename Op::T* out,
                                    unsigned int* counters, int nranks, int rank, u64 n, u64 cap,
                                    int ahead, unsigned int* ctl, u64 timeout_ns, unsigned int call) {
    typedef typename Op::T T;
    if (nranks < 1 || nranks > MESH_MAX_RANKS || rank < 0 || rank >= nranks) return;
    if (npush < 0 || npush > MESH_MAX_RANKS || cap < 16 || (cap & 15u) != 0) return;
    if (gridDim.x > ONESHOT_MAX_BLOCKS || (int)blockDim.x < nranks || (int)blockDim.x < npush) return;
    if (ahead < ONESHOT_PLAIN || ahead > ONESHOT_DEEP) return;
    __shared__ unsigned int base_v;
    __shared__ char* spush[MESH_MAX_RANKS];
    // The abort word, read as the kernel starts and checked at its first
    // wait: nothing is reduced into `out` once the group has failed.
    const unsigned int entry_abort = abort_reader() ? ld_relaxed_sys(ctl + CTL_ABORT) : 0u;
    if (threadIdx.x == 0) {
#pragma unroll
        for (int k = 0; k < MESH_MAX_RANKS; ++k) spush[k] = (char*)push.p[k];
        base_v = counters[blockIdx.x];
    }
    __syncthreads();
    // in/out need only be element-aligned: 16-byte vectors where both are.
    const bool vec = (((u64)in | (u64)out) & 15u) == 0;
    const u64 per_round = cap / sizeof(T);
    const u64 rounds = (n + per_round - 1) / per_round;
    const u64 tid = global_tid();
    const u64 stride = global_stride();
    const char* pdata = (const char*)pull + ONESHOT_FLAG_BYTES;
    const unsigned int* pflags = (const unsigned int*)pull;
    if (ahead == ONESHOT_DEEP) {
        // Rounds 0 and 1 pushed before any wait, then round r reduced in one
        // pass with round r + 2's push.
        for (u64 round = 0; round < rounds && round < 2; ++round) {
            const unsigned int v = base_v + (unsigned int)round + 1u;
            oneshot_push<T>(spush, npush, in + round * per_round, round_len(n, round, per_round),
                            slot_of(v, nranks) + (u64)rank, cap, vec, tid, stride);
            oneshot_flag(spush, npush, rank, v);
        }
        for (u64 round = 0; round < rounds; ++round) {
            const unsigned int v = base_v + (unsigned int)round + 1u;
            const u64 off = round * per_round;
            if (!oneshot_wait(pflags, nranks, rank, v, ctl, timeout_ns, call, round != 0 || entry_abort == 0u)) {
                if (entry_abort != 0u) ctl_fail(ctl, rank, CTL_ABORTED, call);
                return;
            }
            if (round + 2 < rounds) {
                oneshot_fused<Op>(spush, npush, in + off + 2 * per_round, round_len(n, round + 2, per_round),
                                  slot_of(v + 2u, nranks) + (u64)rank, pdata, in + off, out + off,
                                  round_len(n, round, per_round), slot_of(v, nranks), cap, nranks, rank, vec, tid,
                                  stride);
                oneshot_flag(spush, npush, rank, v + 2u);
            } else {
                oneshot_reduce<Op>(pdata, in + off, out + off, round_len(n, round, per_round), slot_of(v, nranks),
                                   cap, nranks, rank, vec, tid, stride);
            }
        }
    } else {
        for (u64 round = 0; round < rounds; ++round) {
            const unsigned int v = base_v + (unsigned int)round + 1u;
            const u64 off = round * per_round;
            // Push round v, unless it was pushed ahead last round.
            if (ahead == ONESHOT_PLAIN || round == 0) {
                oneshot_push<T>(spush, npush, in + off, round_len(n, round, per_round),
                                slot_of(v, nranks) + (u64)rank, cap, vec, tid, stride);
            }
            // Flag v: this block has pushed round v (and reduced round v - 1).
            oneshot_flag(spush, npush, rank, v);
            // Ahead: push round v + 1 now, so that its stores cross the link
            // while this block waits for round v and reduces it.
            if (ahead == ONESHOT_AHEAD && round + 1 < rounds) {
                oneshot_push<T>(spush, npush, in + off + per_round, round_len(n, round + 1, per_round),
                                slot_of(v + 1u, nranks) + (u64)rank, cap, vec, tid, stride);
            }
            if (!oneshot_wait(pflags, nranks, rank, v, ctl, timeout_ns, call, round != 0 || entry_abort == 0u)) {
                if (entry_abort != 0u) ctl_fail(ctl, rank, CTL_ABORTED, call);
                return;
            }
            oneshot_reduce<Op>(pdata, in + off, out + off, round_len(n, round, per_round), slot_of(v, nranks), cap,
                               nranks, rank, vec, tid, stride);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) counters[blockIdx.x] = base_v + (unsigned int)rounds;
}

#define CP_MESH_KERNEL(OP, TY)                                                  \
    extern "C" __global__ void cp_meshar_##OP##_##TY(                           \
        PtrArray ins, PtrArray outs, PtrArray flags, int nranks, int rank,      \
        u64 n, u64 seg, int vec, unsigned int* ctl, u64 timeout_ns,             \
        unsigned int call) {                                                    \
        meshar_body<Op_##OP<Ty_##TY> >(ins, outs, flags, nranks, rank, n, seg,  \
                                       vec, ctl, timeout_ns, call);             \
    }                                                                           \
    extern "C" __global__ void cp_oneshot_##OP##_##TY(                          \
        PtrArray push, int npush, const void* pull, const Ty_##TY::T* in,       \
        Ty_##TY::T* out, unsigned int* counters, int nranks, int rank, u64 n,   \
        u64 cap, int ahead, unsigned int* ctl, u64 timeout_ns,                  \
        unsigned int call) {                                                    \
        oneshot_body<Op_##OP<Ty_##TY> >(push, npush, pull, in, out, counters,   \
                                        nranks, rank, n, cap, ahead, ctl,       \
                                        timeout_ns, call);                      \
    }

#define CP_MESH_ALL_OPS(TY)                                                     \
    CP_MESH_KERNEL(sum, TY)                                                     \
    CP_MESH_KERNEL(prod, TY)                                                    \
    CP_MESH_KERNEL(min, TY)                                                     \
    CP_MESH_KERNEL(max, TY)

#ifdef CP_MESH_TY_f32
CP_MESH_ALL_OPS(f32)
#endif
#ifdef CP_MESH_TY_f64
CP_MESH_ALL_OPS(f64)
#endif
#ifdef CP_MESH_TY_f16
CP_MESH_ALL_OPS(f16)
#endif
#ifdef CP_MESH_TY_bf16
CP_MESH_ALL_OPS(bf16)
#endif
#ifdef CP_MESH_TY_i32
CP_MESH_ALL_OPS(i32)
#endif
#ifdef CP_MESH_TY_i64
CP_MESH_ALL_OPS(i64)
#endif
#ifdef CP_MESH_TY_u32
CP_MESH_ALL_OPS(u32)
#endif
#ifdef CP_MESH_TY_u64
CP_MESH_ALL_OPS(u64)
#endif
#ifdef CP_MESH_TY_i8
CP_MESH_ALL_OPS(i8)
#endif
#ifdef CP_MESH_TY_u8
CP_MESH_ALL_OPS(u8)
#endif
#ifdef CP_MESH_TY_f8e4m3
CP_MESH_ALL_OPS(f8e4m3)
#endif
#ifdef CP_MESH_TY_f8e5m2
CP_MESH_ALL_OPS(f8e5m2)
#endif
#endif  // CP_BUILD_MESH
