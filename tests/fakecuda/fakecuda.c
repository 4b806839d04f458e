/*
 * fakecuda: a libcuda stand-in that lies, for cuda-peer's fault tests
 * (tests/fault_shim.rs).
 *
 * How it is put in front of the real driver: this library has the SONAME
 * libcuda.so.1 and a DT_NEEDED on "libcuda-real.so.1". The runner
 * (tests/fakecuda/run.sh) puts a directory first on LD_LIBRARY_PATH that
 * holds this library as libcuda.so.1 and libcuda.so, and libcuda-real.so.1
 * as a symlink to the real driver. cudarc (which tries "libcuda.so" first)
 * and cuda-peer-sys ("libcuda.so.1") both dlopen this file (one handle: the
 * same file, and the same soname), and dlsym(handle, "cuX") searches this
 * object first and then its dependencies: the overrides below win, every
 * other symbol is the real driver's. LD_PRELOAD would not work: a symbol
 * looked up with dlsym on a dlopen'ed handle is not interposed.
 * cuGetProcAddress(_v2) are overridden too, so callers that look entry
 * points up through the driver (the CUDA runtime, NCCL) get the overrides.
 *
 * Modes, from the environment variable CUDA_PEER_FAKE (read once):
 *   (unset), "off"          pass everything through.
 *   peer-unavailable        cuDeviceCanAccessPeer and the P2P access
 *                           attribute say yes for every pair of distinct
 *                           devices; cuCtxEnablePeerAccess fails with
 *                           CUDA_ERROR_PEER_ACCESS_UNSUPPORTED.
 *   corrupt-peer-copies     every copy whose source and destination are
 *                           device memory on different devices lands with
 *                           its first byte's low bit flipped: after the real
 *                           copy, on the same stream, the byte goes to a
 *                           pinned host slot, a host function flips it, and
 *                           it comes back (also under graph capture).
 *                           Covered: cuMemcpyPeerAsync, cuMemcpyPeer,
 *                           cuMemcpyAsync, cuMemcpyDtoDAsync_v2, cuMemcpyDtoD_v2.
 *                           (SM peer loads and stores in kernels cannot be
 *                           corrupted from here.)
 *   fail-module-load=N      cuModuleLoadData, cuModuleLoadDataEx and
 *                           cuLibraryLoadData fail with
 *                           CUDA_ERROR_OUT_OF_MEMORY when the current
 *                           context's device is ordinal N.
 *   drop-sm-stores=N        the kernels that store into peers' memory
 *                           (cuda-peer's fused all-reduces, cp_oneshot_*
 *                           and cp_meshar_*, found by name at
 *                           cuModuleGetFunction) are not run when the
 *                           current context's device is ordinal N, and
 *                           cuLaunchKernel says they were: what device N's
 *                           SM peer stores and flags would have carried
 *                           never arrives, as on a pair whose copy-engine
 *                           P2P works while SM peer stores are lost.
 *   corrupt-fused-results=N the same fused kernels run, on every device,
 *                           and their barriers and flags complete as
 *                           usual, but on device N the first byte of each
 *                           one's output (the one-shot's `out`, the mesh's
 *                           `outs[rank]`, read from the launch's kernel
 *                           parameters) then has its low bit flipped, on
 *                           the launch's stream after the kernel, as
 *                           corrupt-peer-copies flips a copy's: wrong data
 *                           behind a clean barrier, as on a pair whose SM
 *                           peer stores land wrong. A launch that passes
 *                           its arguments through `extra` instead is not
 *                           corrupted (nor counted).
 *   fail-call=NAME:N        the Nth call of NAME (one of the overrides
 *                           below, e.g. cuMemcpyDtoHAsync_v2) returns
 *                           CUDA_ERROR_UNKNOWN without reaching the driver;
 *                           every other call passes through.
 *   fail-call=NAME:N@AFTER:M
 *                           the same, counting NAME's calls only after the
 *                           Mth call of AFTER (e.g. cuEventRecord:3@
 *                           cuMemcpyDtoHAsync_v2:2: the third cuEventRecord
 *                           after the second cuMemcpyDtoHAsync_v2).
 *   fail-call=NAME:N@restart
 *                           the same, counting NAME's calls only from the
 *                           first cuda_peer_fake_restart() on (a test arms
 *                           the fault after its setup).
 *                           Counting starts when the library loads, and
 *                           again at each cuda_peer_fake_restart().
 *
 * Under fail-call the shim also watches for memory freed while an
 * asynchronous copy that touches it may still run. Each asynchronous copy
 * (cuMemcpyPeerAsync, cuMemcpyAsync, cuMemcpyDtoDAsync_v2,
 * cuMemcpyDtoHAsync_v2, cuMemcpyHtoDAsync_v2; not under graph capture) is
 * held back on its stream by a host function that sleeps
 * CUDA_PEER_FAKE_GATE_MS milliseconds (default 20; 0: no gate), so that it
 * is still pending for a while after the call returns, and is marked done
 * by a host function enqueued after it. A free of an allocation that a copy
 * not yet marked done reads or writes from its start (the freed address is
 * the copy's source or destination; a copy into the middle of an allocation
 * is not matched) counts as an unsafe free: cuMemFreeHost and cuMemFree_v2
 * when they are called (they free at once), cuMemFreeAsync when it runs in
 * its stream's order (a host function enqueued just before it checks), so
 * that a free ordered after the copy by events, on any stream, is not
 * counted.
 *
 * Exported for tests: cuda_peer_fake_mode() (the mode string, "off" when
 * none), cuda_peer_fake_fired() (how many faults were injected so far),
 * cuda_peer_fake_calls(name) (how many outermost calls an override has had
 * since the library loaded, in every mode; -1 for a name that is not an
 * override), cuda_peer_fake_restart() (fail-call: counts toward the fault
 * start again now; -1 in other modes) and cuda_peer_fake_unsafe_frees()
 * (fail-call: the unsafe frees seen so far).
 *
 * Built without CUDA headers (CI has none): the few types are declared here.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUmodule;
typedef void *CUlibrary;
typedef unsigned long long CUdeviceptr;
typedef int CUjit_option;
typedef int CUlibraryOption;
typedef int CUdevice_P2PAttribute;
typedef void (*CUhostFn)(void *);
typedef void *CUevent;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_PEER_ACCESS_UNSUPPORTED 217
#define CUDA_ERROR_UNKNOWN 999
#define CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED 0x02
#define CU_POINTER_ATTRIBUTE_MEMORY_TYPE 2
#define CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9
#define CU_MEMORYTYPE_DEVICE 2
#define CU_MEMHOSTALLOC_PORTABLE 0x01
#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 0x2

#define EXPORT __attribute__((visibility("default")))

enum mode {
    MODE_OFF, MODE_PEER_UNAVAILABLE, MODE_CORRUPT, MODE_FAIL_MODULE_LOAD, MODE_DROP_SM, MODE_CORRUPT_FUSED, MODE_FAIL_CALL
};

static enum mode g_mode = MODE_OFF;
static int g_fail_ordinal = -1;
static char g_mode_name[160] = "off";
static atomic_long g_fired;
static void *g_real;

/* The overrides, by index: what cuda_peer_fake_calls and fail-call name. */
enum call {
    C_CAN_ACCESS_PEER, C_P2P_ATTRIBUTE, C_ENABLE_PEER, C_MEMCPY_PEER_ASYNC, C_MEMCPY_PEER, C_MEMCPY_ASYNC,
    C_DTOD_ASYNC, C_DTOD, C_DTOH_ASYNC, C_HTOD_ASYNC, C_MODULE_LOAD, C_MODULE_LOAD_EX, C_LIBRARY_LOAD,
    C_GET_FUNCTION, C_LAUNCH, C_EVENT_RECORD, C_FREE_HOST, C_FREE, C_FREE_ASYNC, NCALLS
};
static const char *const g_call_names[NCALLS] = {
    "cuDeviceCanAccessPeer", "cuDeviceGetP2PAttribute", "cuCtxEnablePeerAccess", "cuMemcpyPeerAsync",
    "cuMemcpyPeer", "cuMemcpyAsync", "cuMemcpyDtoDAsync_v2", "cuMemcpyDtoD_v2", "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2", "cuModuleLoadData", "cuModuleLoadDataEx", "cuLibraryLoadData",
    "cuModuleGetFunction", "cuLaunchKernel", "cuEventRecord", "cuMemFreeHost", "cuMemFree_v2", "cuMemFreeAsync",
};

static int call_id(const char *name, size_t len) {
    for (int i = 0; i < NCALLS; i++) {
        if (strlen(g_call_names[i]) == len && strncmp(g_call_names[i], name, len) == 0) {
            return i;
        }
    }
    return -1;
}

/* fail-call: which call fails, and after what (AFTER_NOTHING: from the
 * start; AFTER_RESTART: from a restart on). */
#define AFTER_NOTHING (-1)
#define AFTER_RESTART (-2)
static int g_fail = -1, g_after = AFTER_NOTHING;
static long g_fail_nth, g_after_nth;
/* Since the load or the last restart, under g_trigger_lock. */
static long g_fail_seen, g_after_seen;
static pthread_mutex_t g_trigger_lock = PTHREAD_MUTEX_INITIALIZER;
static long g_gate_ms = 20;

/* Parses "NAME:N" at `s` into a call and a count >= 1; returns the end, or NULL. */
static const char *parse_call(const char *s, int *id, long *nth) {
    const char *colon = strchr(s, ':');
    if (colon == NULL || (*id = call_id(s, (size_t)(colon - s))) < 0) {
        return NULL;
    }
    char *end = NULL;
    *nth = strtol(colon + 1, &end, 10);
    return end == colon + 1 || *nth < 1 ? NULL : end;
}

static void parse_fail_call(const char *m) {
    const char *end = parse_call(m + 10, &g_fail, &g_fail_nth);
    if (end != NULL && strcmp(end, "@restart") == 0) {
        g_after = AFTER_RESTART;
        g_after_nth = 1;
        end += strlen(end);
    } else if (end != NULL && *end == '@') {
        end = parse_call(end + 1, &g_after, &g_after_nth);
    }
    if (end == NULL || *end != '\0') {
        fprintf(stderr, "fakecuda: CUDA_PEER_FAKE=%s: expected fail-call=NAME:N, fail-call=NAME:N@AFTER:M or "
                        "fail-call=NAME:N@restart, N and M >= 1, NAME and AFTER among:", m);
        for (int i = 0; i < NCALLS; i++) {
            fprintf(stderr, " %s", g_call_names[i]);
        }
        fprintf(stderr, "\n");
        abort();
    }
    g_mode = MODE_FAIL_CALL;
    const char *gate = getenv("CUDA_PEER_FAKE_GATE_MS");
    if (gate != NULL && gate[0] != '\0') {
        char *e = NULL;
        long ms = strtol(gate, &e, 10);
        if (*e != '\0' || ms < 0 || ms > 10000) {
            fprintf(stderr, "fakecuda: CUDA_PEER_FAKE_GATE_MS=%s: expected 0 to 10000\n", gate);
            abort();
        }
        g_gate_ms = ms;
    }
}

/* The modes that name a device ordinal ("NAME=<ordinal>"), by the prefix of `m`. */
static enum mode ordinal_mode(const char *m) {
    static const struct {
        const char *prefix;
        enum mode mode;
    } modes[] = {
        {"fail-module-load=", MODE_FAIL_MODULE_LOAD},
        {"drop-sm-stores=", MODE_DROP_SM},
        {"corrupt-fused-results=", MODE_CORRUPT_FUSED},
    };
    for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++) {
        if (strncmp(m, modes[i].prefix, strlen(modes[i].prefix)) == 0) {
            return modes[i].mode;
        }
    }
    return MODE_OFF;
}

static void fake_init(void) {
    const char *m = getenv("CUDA_PEER_FAKE");
    if (m == NULL || m[0] == '\0' || strcmp(m, "off") == 0) {
        g_mode = MODE_OFF;
    } else if (strcmp(m, "peer-unavailable") == 0) {
        g_mode = MODE_PEER_UNAVAILABLE;
    } else if (strcmp(m, "corrupt-peer-copies") == 0) {
        g_mode = MODE_CORRUPT;
    } else if (strncmp(m, "fail-call=", 10) == 0) {
        parse_fail_call(m);
    } else if (ordinal_mode(m) != MODE_OFF) {
        const char *eq = strchr(m, '=');
        size_t skip = (size_t)(eq - m) + 1;
        char *end = NULL;
        long n = strtol(m + skip, &end, 10);
        if (end == m + skip || *end != '\0' || n < 0) {
            fprintf(stderr, "fakecuda: CUDA_PEER_FAKE=%s: expected %.*s<ordinal>\n", m, (int)skip, m);
            abort();
        }
        g_mode = ordinal_mode(m);
        g_fail_ordinal = (int)n;
    } else {
        fprintf(stderr, "fakecuda: unknown CUDA_PEER_FAKE=%s (expected off, peer-unavailable, "
                        "corrupt-peer-copies, fail-module-load=<ordinal>, drop-sm-stores=<ordinal>, "
                        "corrupt-fused-results=<ordinal> or fail-call=NAME:N[@AFTER:M|@restart])\n", m);
        abort();
    }
    if (g_mode != MODE_OFF) {
        snprintf(g_mode_name, sizeof g_mode_name, "%s", m);
    }
    /* Already loaded as this library's dependency: no new load. */
    g_real = dlopen("libcuda-real.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (g_real == NULL) {
        g_real = dlopen("libcuda-real.so.1", RTLD_LAZY);
    }
    if (g_real == NULL) {
        fprintf(stderr, "fakecuda: cannot open the real driver as libcuda-real.so.1: %s\n", dlerror());
    }
    if (getenv("CUDA_PEER_FAKE_VERBOSE") != NULL) {
        fprintf(stderr, "fakecuda: mode %s\n", g_mode_name);
    }
}

static pthread_once_t g_once = PTHREAD_ONCE_INIT;

__attribute__((constructor)) static void fake_ctor(void) { pthread_once(&g_once, fake_init); }

static void *real(const char *name) {
    pthread_once(&g_once, fake_init);
    if (g_real == NULL) {
        return NULL;
    }
    return dlsym(g_real, name);
}

/* The real entry point `name` with type `type`, resolved once. */
#define REAL(type, name)                                                                           \
    static type real_fn = NULL;                                                                    \
    if (real_fn == NULL) {                                                                         \
        real_fn = (type)real(name);                                                                \
    }                                                                                              \
    if (real_fn == NULL) {                                                                         \
        return CUDA_ERROR_NOT_INITIALIZED;                                                         \
    }

EXPORT const char *cuda_peer_fake_mode(void) {
    pthread_once(&g_once, fake_init);
    return g_mode_name;
}

EXPORT long cuda_peer_fake_fired(void) { return atomic_load(&g_fired); }

static void fired(void) { atomic_fetch_add(&g_fired, 1); }

/* Faults apply at the outermost call only: should the driver call one of
 * its own exported entry points through its PLT, that call resolves to the
 * override here (this library comes first in the handle's scope), and must
 * pass through, not corrupt or count twice. */
static __thread int g_depth;
static int enter(void) { return g_depth++ == 0; }
static void leave(void) { g_depth--; }

/* ---- fail-call, and the count of every override's calls ------------------- */

static atomic_long g_calls[NCALLS];

/* Counts an outermost call of `id` and says whether it is the one that
 * fail-call fails (then it counts as fired). Call before enter(). */
static int failing(enum call id) {
    if (g_depth != 0) {
        return 0;
    }
    atomic_fetch_add(&g_calls[id], 1);
    if (g_mode != MODE_FAIL_CALL) {
        return 0;
    }
    int fail = 0;
    pthread_mutex_lock(&g_trigger_lock);
    if (g_after != AFTER_NOTHING && g_after_seen < g_after_nth) {
        g_after_seen += (int)id == g_after;
    } else if ((int)id == g_fail) {
        fail = ++g_fail_seen == g_fail_nth;
    }
    pthread_mutex_unlock(&g_trigger_lock);
    if (fail) {
        fired();
    }
    return fail;
}

EXPORT long cuda_peer_fake_calls(const char *name) {
    int id = name == NULL ? -1 : call_id(name, strlen(name));
    return id < 0 ? -1 : atomic_load(&g_calls[id]);
}

EXPORT int cuda_peer_fake_restart(void) {
    pthread_once(&g_once, fake_init);
    if (g_mode != MODE_FAIL_CALL) {
        return -1;
    }
    pthread_mutex_lock(&g_trigger_lock);
    g_fail_seen = 0;
    g_after_seen = g_after == AFTER_RESTART ? g_after_nth : 0;
    pthread_mutex_unlock(&g_trigger_lock);
    return 0;
}

/* ---- fail-call: copies still pending when their memory is freed ----------- */

typedef CUresult (*launch_host_func_t)(CUstream, CUhostFn, void *);
typedef CUresult (*is_capturing_t)(CUstream, int *);

/* One asynchronous copy: its destination and source; pending until the
 * host function after it on its stream runs. */
struct copy_rec {
    CUdeviceptr addr[2];
    int pending;
};
#define RECS 4096
static struct copy_rec g_recs[RECS];
static int g_next_rec;
static pthread_mutex_t g_recs_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_long g_unsafe_frees;

EXPORT long cuda_peer_fake_unsafe_frees(void) { return atomic_load(&g_unsafe_frees); }

static CUresult host_func(CUstream stream, CUhostFn fn, void *arg) {
    static launch_host_func_t host = NULL;
    if (host == NULL) {
        host = (launch_host_func_t)real("cuLaunchHostFunc");
    }
    return host == NULL ? CUDA_ERROR_NOT_INITIALIZED : host(stream, fn, arg);
}

/* Whether copies and frees on `stream` are watched: fail-call, and the
 * stream is known not to be capturing (a captured host function would run
 * only when the graph does). */
static int watched(CUstream stream) {
    if (g_mode != MODE_FAIL_CALL) {
        return 0;
    }
    static is_capturing_t query = NULL;
    if (query == NULL) {
        query = (is_capturing_t)real("cuStreamIsCapturing");
    }
    int status = -1;
    return query != NULL && query(stream, &status) == CUDA_SUCCESS && status == 0;
}

static void gate_fn(void *arg) {
    (void)arg;
    struct timespec t = {g_gate_ms / 1000, (g_gate_ms % 1000) * 1000000L};
    while (nanosleep(&t, &t) != 0) {
    }
}

/* Before a watched copy: holds its stream back (module comment). */
static void gate(CUstream stream) {
    if (g_gate_ms > 0) {
        (void)host_func(stream, gate_fn, NULL);
    }
}

static void done_fn(void *arg) {
    struct copy_rec *rec = arg;
    pthread_mutex_lock(&g_recs_lock);
    rec->pending = 0;
    pthread_mutex_unlock(&g_recs_lock);
}

/* After a watched copy was enqueued: pending until a host function after it runs. */
static void track(CUdeviceptr dst, CUdeviceptr src, CUstream stream) {
    struct copy_rec *rec = NULL;
    pthread_mutex_lock(&g_recs_lock);
    for (int i = 0; i < RECS && rec == NULL; i++) {
        int k = (g_next_rec + i) % RECS;
        if (!g_recs[k].pending) {
            rec = &g_recs[k];
            g_next_rec = (k + 1) % RECS;
        }
    }
    if (rec != NULL) {
        *rec = (struct copy_rec){{dst, src}, 1};
    }
    pthread_mutex_unlock(&g_recs_lock);
    if (rec == NULL) {
        fprintf(stderr, "fakecuda: more than %d copies pending; not all are watched\n", RECS);
        return;
    }
    if (host_func(stream, done_fn, rec) != CUDA_SUCCESS) {
        done_fn(rec);
    }
}

/* How many pending copies start at `p` (a freed allocation's start). */
static long pending_on(CUdeviceptr p) {
    long n = 0;
    pthread_mutex_lock(&g_recs_lock);
    for (int i = 0; i < RECS; i++) {
        const struct copy_rec *r = &g_recs[i];
        n += r->pending && (r->addr[0] == p || r->addr[1] == p);
    }
    pthread_mutex_unlock(&g_recs_lock);
    return n;
}

/* A free that takes effect now. */
static void check_free_now(CUdeviceptr p) {
    if (g_mode == MODE_FAIL_CALL && pending_on(p) > 0) {
        atomic_fetch_add(&g_unsafe_frees, 1);
    }
}

static void probe_fn(void *arg) {
    check_free_now(*(CUdeviceptr *)arg);
    free(arg);
}

/* A free that takes effect in `stream`'s order: checked there. */
static void check_free_ordered(CUdeviceptr p, CUstream stream) {
    if (!watched(stream)) {
        return;
    }
    CUdeviceptr *arg = malloc(sizeof *arg);
    if (arg == NULL) {
        return;
    }
    *arg = p;
    if (host_func(stream, probe_fn, arg) != CUDA_SUCCESS) {
        free(arg);
    }
}

/* ---- peer-unavailable ---------------------------------------------------- */

typedef CUresult (*can_access_peer_t)(int *, CUdevice, CUdevice);
EXPORT CUresult cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer) {
    REAL(can_access_peer_t, "cuDeviceCanAccessPeer");
    if (failing(C_CAN_ACCESS_PEER)) {
        return CUDA_ERROR_UNKNOWN;
    }
    CUresult r = real_fn(can, dev, peer);
    if (r == CUDA_SUCCESS && g_mode == MODE_PEER_UNAVAILABLE && dev != peer && can != NULL) {
        *can = 1;
    }
    return r;
}

typedef CUresult (*p2p_attr_t)(int *, CUdevice_P2PAttribute, CUdevice, CUdevice);
EXPORT CUresult cuDeviceGetP2PAttribute(int *value, CUdevice_P2PAttribute attr, CUdevice src, CUdevice dst) {
    REAL(p2p_attr_t, "cuDeviceGetP2PAttribute");
    if (failing(C_P2P_ATTRIBUTE)) {
        return CUDA_ERROR_UNKNOWN;
    }
    CUresult r = real_fn(value, attr, src, dst);
    if (r == CUDA_SUCCESS && g_mode == MODE_PEER_UNAVAILABLE && src != dst && value != NULL &&
        attr == CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED) {
        *value = 1;
    }
    return r;
}

typedef CUresult (*enable_peer_t)(CUcontext, unsigned int);
EXPORT CUresult cuCtxEnablePeerAccess(CUcontext peer, unsigned int flags) {
    REAL(enable_peer_t, "cuCtxEnablePeerAccess");
    if (failing(C_ENABLE_PEER)) {
        return CUDA_ERROR_UNKNOWN;
    }
    if (g_mode == MODE_PEER_UNAVAILABLE) {
        fired();
        return CUDA_ERROR_PEER_ACCESS_UNSUPPORTED;
    }
    return real_fn(peer, flags);
}

/* ---- corrupt-peer-copies -------------------------------------------------- */

typedef CUresult (*ptr_attr_t)(void *, int, CUdeviceptr);
typedef CUresult (*memcpy_async_t)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
typedef CUresult (*memcpy_t)(CUdeviceptr, CUdeviceptr, size_t);
typedef CUresult (*host_func_t)(CUstream, CUhostFn, void *);
typedef CUresult (*host_alloc_t)(void **, size_t, unsigned int);
typedef CUresult (*memset_async_t)(CUdeviceptr, unsigned char, size_t, CUstream);

/* The device ordinal of device memory at `p`, or -1 (host memory, unknown). */
static int device_of(CUdeviceptr p) {
    static ptr_attr_t get = NULL;
    if (get == NULL) {
        get = (ptr_attr_t)real("cuPointerGetAttribute");
    }
    if (get == NULL) {
        return -1;
    }
    unsigned int type = 0;
    if (get(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p) != CUDA_SUCCESS || type != CU_MEMORYTYPE_DEVICE) {
        return -1;
    }
    int ordinal = -1;
    if (get(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p) != CUDA_SUCCESS) {
        return -1;
    }
    return ordinal;
}

static int crosses_devices(CUdeviceptr dst, CUdeviceptr src, size_t bytes) {
    if (g_mode != MODE_CORRUPT || bytes == 0) {
        return 0;
    }
    int d = device_of(dst), s = device_of(src);
    return d >= 0 && s >= 0 && d != s;
}

/* Pinned one-byte slots, used round robin (a slot is reused only after
 * SLOTS later corruptions). */
#define SLOTS 65536
static unsigned char *g_slots;
static atomic_ulong g_next_slot;
static pthread_mutex_t g_slots_lock = PTHREAD_MUTEX_INITIALIZER;

static unsigned char *next_slot(void) {
    pthread_mutex_lock(&g_slots_lock);
    if (g_slots == NULL) {
        host_alloc_t alloc = (host_alloc_t)real("cuMemHostAlloc");
        void *p = NULL;
        if (alloc != NULL && alloc(&p, SLOTS, CU_MEMHOSTALLOC_PORTABLE) == CUDA_SUCCESS) {
            g_slots = p;
        }
    }
    pthread_mutex_unlock(&g_slots_lock);
    if (g_slots == NULL) {
        return NULL;
    }
    return g_slots + (atomic_fetch_add(&g_next_slot, 1) % SLOTS);
}

static void flip(void *slot) { *(volatile unsigned char *)slot ^= 0x01; }

/* Enqueues, on `stream` after the copy, the flip of the first byte of `dst`. */
static CUresult corrupt_async(CUdeviceptr dst, CUstream stream) {
    static memcpy_async_t cp = NULL;
    static host_func_t host = NULL;
    if (cp == NULL) {
        cp = (memcpy_async_t)real("cuMemcpyAsync");
    }
    if (host == NULL) {
        host = (host_func_t)real("cuLaunchHostFunc");
    }
    unsigned char *slot = next_slot();
    if (cp == NULL || host == NULL || slot == NULL) {
        /* No pinned memory: overwrite the byte with a fixed value instead. */
        memset_async_t ms = (memset_async_t)real("cuMemsetD8Async");
        if (ms == NULL) {
            return CUDA_ERROR_NOT_INITIALIZED;
        }
        fired();
        return ms(dst, 0xA5, 1, stream);
    }
    CUresult r = cp((CUdeviceptr)(uintptr_t)slot, dst, 1, stream);
    if (r == CUDA_SUCCESS) {
        r = host(stream, flip, slot);
    }
    if (r == CUDA_SUCCESS) {
        r = cp(dst, (CUdeviceptr)(uintptr_t)slot, 1, stream);
    }
    if (r == CUDA_SUCCESS) {
        fired();
    }
    return r;
}

static CUresult corrupt_sync(CUdeviceptr dst) {
    static memcpy_t cp = NULL;
    if (cp == NULL) {
        cp = (memcpy_t)real("cuMemcpy");
    }
    unsigned char byte = 0;
    if (cp == NULL) {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    CUresult r = cp((CUdeviceptr)(uintptr_t)&byte, dst, 1);
    if (r != CUDA_SUCCESS) {
        return r;
    }
    byte ^= 0x01;
    r = cp(dst, (CUdeviceptr)(uintptr_t)&byte, 1);
    if (r == CUDA_SUCCESS) {
        fired();
    }
    return r;
}

typedef CUresult (*memcpy_peer_async_t)(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t, CUstream);
EXPORT CUresult cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx, size_t bytes,
                                  CUstream stream) {
    REAL(memcpy_peer_async_t, "cuMemcpyPeerAsync");
    if (failing(C_MEMCPY_PEER_ASYNC)) {
        return CUDA_ERROR_UNKNOWN;
    }
    int outer = enter();
    int watch = outer && watched(stream);
    if (watch) {
        gate(stream);
    }
    CUresult r = real_fn(dst, dctx, src, sctx, bytes, stream);
    if (outer && r == CUDA_SUCCESS && crosses_devices(dst, src, bytes)) {
        r = corrupt_async(dst, stream);
    }
    if (watch && r == CUDA_SUCCESS) {
        track(dst, src, stream);
    }
    leave();
    return r;
}

typedef CUresult (*memcpy_peer_t)(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t);
EXPORT CUresult cuMemcpyPeer(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx, size_t bytes) {
    REAL(memcpy_peer_t, "cuMemcpyPeer");
    if (failing(C_MEMCPY_PEER)) {
        return CUDA_ERROR_UNKNOWN;
    }
    int outer = enter();
    CUresult r = real_fn(dst, dctx, src, sctx, bytes);
    if (outer && r == CUDA_SUCCESS && crosses_devices(dst, src, bytes)) {
        r = corrupt_sync(dst);
    }
    leave();
    return r;
}

EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream) {
    REAL(memcpy_async_t, "cuMemcpyAsync");
    if (failing(C_MEMCPY_ASYNC)) {
        return CUDA_ERROR_UNKNOWN;
    }
    int outer = enter();
    int watch = outer && watched(stream);
    if (watch) {
        gate(stream);
    }
    CUresult r = real_fn(dst, src, bytes, stream);
    if (outer && r == CUDA_SUCCESS && crosses_devices(dst, src, bytes)) {
        r = corrupt_async(dst, stream);
    }
    if (watch && r == CUDA_SUCCESS) {
        track(dst, src, stream);
    }
    leave();
    return r;
}

EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream) {
    REAL(memcpy_async_t, "cuMemcpyDtoDAsync_v2");
    if (failing(C_DTOD_ASYNC)) {
        return CUDA_ERROR_UNKNOWN;
    }
    int outer = enter();
    int watch = outer && watched(stream);
    if (watch) {
        gate(stream);
    }
    CUresult r = real_fn(dst, src, bytes, stream);
    if (outer && r == CUDA_SUCCESS && crosses_devices(dst, src, bytes)) {
        r = corrupt_async(dst, stream);
    }
    if (watch && r == CUDA_SUCCESS) {
        track(dst, src, stream);
    }
    leave();
    return r;
}

EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes) {
    REAL(memcpy_t, "cuMemcpyDtoD_v2");
    if (failing(C_DTOD)) {
        return CUDA_ERROR_UNKNOWN;
    }
    int outer = enter();
    CUresult r = real_fn(dst, src, bytes);
    if (outer && r == CUDA_SUCCESS && crosses_devices(dst, src, bytes)) {
        r = corrupt_sync(dst);
    }
    leave();
    return r;
}

/* Host <-> device copies: only fail-call acts on them. */
typedef CUresult (*dtoh_async_t)(void *, CUdeviceptr, size_t, CUstream);
EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t bytes, CUstream stream) {
    REAL(dtoh_async_t, "cuMemcpyDtoHAsync_v2");
    if (failing(C_DTOH_ASYNC)) {
        return CUDA_ERROR_UNKNOWN;
    }
    int outer = enter();
    int watch = outer && watched(stream);
    if (watch) {
        gate(stream);
    }
    CUresult r = real_fn(dst, src, bytes, stream);
    if (watch && r == CUDA_SUCCESS) {
        track((CUdeviceptr)(uintptr_t)dst, src, stream);
    }
    leave();
    return r;
}

typedef CUresult (*htod_async_t)(CUdeviceptr, const void *, size_t, CUstream);
EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t bytes, CUstream stream) {
    REAL(htod_async_t, "cuMemcpyHtoDAsync_v2");
    if (failing(C_HTOD_ASYNC)) {
        return CUDA_ERROR_UNKNOWN;
    }
    int outer = enter();
    int watch = outer && watched(stream);
    if (watch) {
        gate(stream);
    }
    CUresult r = real_fn(dst, src, bytes, stream);
    if (watch && r == CUDA_SUCCESS) {
        track(dst, (CUdeviceptr)(uintptr_t)src, stream);
    }
    leave();
    return r;
}

/* ---- fail-call: events and frees ------------------------------------------ */

typedef CUresult (*event_record_t)(CUevent, CUstream);
EXPORT CUresult cuEventRecord(CUevent event, CUstream stream) {
    REAL(event_record_t, "cuEventRecord");
    if (failing(C_EVENT_RECORD)) {
        return CUDA_ERROR_UNKNOWN;
    }
    return real_fn(event, stream);
}

typedef CUresult (*free_host_t)(void *);
EXPORT CUresult cuMemFreeHost(void *p) {
    REAL(free_host_t, "cuMemFreeHost");
    if (failing(C_FREE_HOST)) {
        return CUDA_ERROR_UNKNOWN;
    }
    if (g_depth == 0) {
        check_free_now((CUdeviceptr)(uintptr_t)p);
    }
    return real_fn(p);
}

typedef CUresult (*free_t)(CUdeviceptr);
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
    REAL(free_t, "cuMemFree_v2");
    if (failing(C_FREE)) {
        return CUDA_ERROR_UNKNOWN;
    }
    if (g_depth == 0) {
        check_free_now(p);
    }
    return real_fn(p);
}

typedef CUresult (*free_async_t)(CUdeviceptr, CUstream);
EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream stream) {
    REAL(free_async_t, "cuMemFreeAsync");
    if (failing(C_FREE_ASYNC)) {
        return CUDA_ERROR_UNKNOWN;
    }
    if (g_depth == 0) {
        check_free_ordered(p, stream);
    }
    return real_fn(p, stream);
}

/* ---- fail-module-load ------------------------------------------------------ */

typedef CUresult (*ctx_get_device_t)(CUdevice *);

/* Whether the current context's device is the mode's ordinal. */
static int on_faulty_device(void) {
    static ctx_get_device_t get = NULL;
    if (get == NULL) {
        get = (ctx_get_device_t)real("cuCtxGetDevice");
    }
    CUdevice dev = -1;
    return get != NULL && get(&dev) == CUDA_SUCCESS && dev == g_fail_ordinal;
}

static int module_load_fails(void) {
    if (g_mode != MODE_FAIL_MODULE_LOAD || !on_faulty_device()) {
        return 0;
    }
    fired();
    return 1;
}

typedef CUresult (*module_load_data_t)(CUmodule *, const void *);
EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    REAL(module_load_data_t, "cuModuleLoadData");
    if (failing(C_MODULE_LOAD)) {
        return CUDA_ERROR_UNKNOWN;
    }
    int outer = enter();
    if (outer && module_load_fails()) {
        leave();
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult r = real_fn(module, image);
    leave();
    return r;
}

typedef CUresult (*module_load_data_ex_t)(CUmodule *, const void *, unsigned int, CUjit_option *, void **);
EXPORT CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int n, CUjit_option *opts,
                                   void **vals) {
    REAL(module_load_data_ex_t, "cuModuleLoadDataEx");
    if (failing(C_MODULE_LOAD_EX)) {
        return CUDA_ERROR_UNKNOWN;
    }
    int outer = enter();
    if (outer && module_load_fails()) {
        leave();
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult r = real_fn(module, image, n, opts, vals);
    leave();
    return r;
}

typedef CUresult (*library_load_data_t)(CUlibrary *, const void *, CUjit_option *, void **, unsigned int,
                                        CUlibraryOption *, void **, unsigned int);
EXPORT CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jit_opts, void **jit_vals,
                                  unsigned int njit, CUlibraryOption *lib_opts, void **lib_vals, unsigned int nlib) {
    REAL(library_load_data_t, "cuLibraryLoadData");
    if (failing(C_LIBRARY_LOAD)) {
        return CUDA_ERROR_UNKNOWN;
    }
    int outer = enter();
    if (outer && module_load_fails()) {
        leave();
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult r = real_fn(library, code, jit_opts, jit_vals, njit, lib_opts, lib_vals, nlib);
    leave();
    return r;
}

/* ---- drop-sm-stores and corrupt-fused-results ------------------------------ */

typedef void *CUfunction;

/* Which fused kernel a function is (by its name at cuModuleGetFunction). */
enum fused { NOT_FUSED, FUSED_ONESHOT, FUSED_MESH };

/* The fused kernels' handles, as cuModuleGetFunction handed them out. */
#define FUSED_MAX 4096
static struct {
    CUfunction f;
    enum fused kind;
} g_fused[FUSED_MAX];
static int g_nfused;
static pthread_mutex_t g_fused_lock = PTHREAD_MUTEX_INITIALIZER;

static enum fused fused_name(const char *name) {
    if (name == NULL) {
        return NOT_FUSED;
    }
    if (strncmp(name, "cp_oneshot_", 11) == 0) {
        return FUSED_ONESHOT;
    }
    return strncmp(name, "cp_meshar_", 10) == 0 ? FUSED_MESH : NOT_FUSED;
}

static enum fused fused_kind(CUfunction f) {
    enum fused kind = NOT_FUSED;
    pthread_mutex_lock(&g_fused_lock);
    for (int i = 0; i < g_nfused && kind == NOT_FUSED; i++) {
        if (g_fused[i].f == f) {
            kind = g_fused[i].kind;
        }
    }
    pthread_mutex_unlock(&g_fused_lock);
    return kind;
}

typedef CUresult (*module_get_function_t)(CUfunction *, CUmodule, const char *);
EXPORT CUresult cuModuleGetFunction(CUfunction *f, CUmodule module, const char *name) {
    REAL(module_get_function_t, "cuModuleGetFunction");
    if (failing(C_GET_FUNCTION)) {
        return CUDA_ERROR_UNKNOWN;
    }
    CUresult r = real_fn(f, module, name);
    enum fused kind = fused_name(name);
    if (r == CUDA_SUCCESS && (g_mode == MODE_DROP_SM || g_mode == MODE_CORRUPT_FUSED) && f != NULL && kind != NOT_FUSED) {
        pthread_mutex_lock(&g_fused_lock);
        if (g_nfused < FUSED_MAX) {
            g_fused[g_nfused].f = *f;
            g_fused[g_nfused++].kind = kind;
        }
        pthread_mutex_unlock(&g_fused_lock);
    }
    return r;
}

/* The output a fused kernel's launch writes on its own device, from its
 * kernel parameters (kernels/reduce.cu):
 *   cp_oneshot_*(PtrArray push, int npush, const void* pull, const T* in,
 *                T* out, ...): `out`, parameter 4;
 *   cp_meshar_*(PtrArray ins, PtrArray outs, PtrArray flags, int nranks,
 *               int rank, ...): `outs.p[rank]`, parameters 1 and 4
 *               (PtrArray: 8 device pointers by value).
 * 0 where the parameters are not given this way. */
#define PTR_ARRAY_LEN 8
static CUdeviceptr fused_output(enum fused kind, void **params) {
    if (params == NULL) {
        return 0;
    }
    if (kind == FUSED_ONESHOT) {
        return params[4] == NULL ? 0 : *(const CUdeviceptr *)params[4];
    }
    if (kind == FUSED_MESH && params[1] != NULL && params[4] != NULL) {
        int rank = *(const int *)params[4];
        return rank < 0 || rank >= PTR_ARRAY_LEN ? 0 : ((const CUdeviceptr *)params[1])[rank];
    }
    return 0;
}

typedef CUresult (*launch_kernel_t)(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
                                    unsigned int, unsigned int, CUstream, void **, void **);
EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                               unsigned int by, unsigned int bz, unsigned int shared, CUstream stream, void **params,
                               void **extra) {
    REAL(launch_kernel_t, "cuLaunchKernel");
    if (failing(C_LAUNCH)) {
        return CUDA_ERROR_UNKNOWN;
    }
    if (g_mode == MODE_DROP_SM && fused_kind(f) != NOT_FUSED && on_faulty_device()) {
        fired();
        return CUDA_SUCCESS;
    }
    CUresult r = real_fn(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra);
    if (r == CUDA_SUCCESS && g_mode == MODE_CORRUPT_FUSED) {
        enum fused kind = fused_kind(f);
        CUdeviceptr out = kind == NOT_FUSED ? 0 : fused_output(kind, params);
        if (out != 0 && on_faulty_device()) {
            /* After the kernel, in its stream's order; counts as fired. */
            r = corrupt_async(out, stream);
        }
    }
    return r;
}

/* ---- cuGetProcAddress ----------------------------------------------------- */

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags);
EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags,
                                    int *status);

/* The override for `symbol` (a base name, as cuGetProcAddress takes), or
 * NULL. Per-thread-default-stream lookups keep the real entry points (the
 * overrides call the legacy-stream variants). */
static void *override_for(const char *symbol, int version, unsigned long long flags) {
    if (symbol == NULL || (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0) {
        return NULL;
    }
    static const struct {
        const char *name;
        void *fn;
        int min_version;
    } table[] = {
        {"cuDeviceCanAccessPeer", (void *)cuDeviceCanAccessPeer, 0},
        {"cuDeviceGetP2PAttribute", (void *)cuDeviceGetP2PAttribute, 0},
        {"cuCtxEnablePeerAccess", (void *)cuCtxEnablePeerAccess, 0},
        {"cuMemcpyPeerAsync", (void *)cuMemcpyPeerAsync, 0},
        {"cuMemcpyPeer", (void *)cuMemcpyPeer, 0},
        {"cuMemcpyAsync", (void *)cuMemcpyAsync, 0},
        {"cuMemcpyDtoDAsync", (void *)cuMemcpyDtoDAsync_v2, 3020},
        {"cuMemcpyDtoD", (void *)cuMemcpyDtoD_v2, 3020},
        {"cuModuleLoadData", (void *)cuModuleLoadData, 0},
        {"cuModuleLoadDataEx", (void *)cuModuleLoadDataEx, 0},
        {"cuLibraryLoadData", (void *)cuLibraryLoadData, 0},
        {"cuModuleGetFunction", (void *)cuModuleGetFunction, 0},
        {"cuLaunchKernel", (void *)cuLaunchKernel, 0},
        {"cuMemcpyDtoHAsync", (void *)cuMemcpyDtoHAsync_v2, 3020},
        {"cuMemcpyHtoDAsync", (void *)cuMemcpyHtoDAsync_v2, 3020},
        {"cuEventRecord", (void *)cuEventRecord, 0},
        {"cuMemFreeHost", (void *)cuMemFreeHost, 0},
        {"cuMemFree", (void *)cuMemFree_v2, 3020},
        {"cuMemFreeAsync", (void *)cuMemFreeAsync, 0},
        /* A caller that looks cuGetProcAddress up through itself keeps
         * getting the overrides. */
        {"cuGetProcAddress", (void *)cuGetProcAddress_v2, 12000},
        {"cuGetProcAddress", (void *)cuGetProcAddress, 0},
    };
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        if (strcmp(symbol, table[i].name) == 0 && version >= table[i].min_version) {
            return table[i].fn;
        }
    }
    return NULL;
}

typedef CUresult (*get_proc_t)(const char *, void **, int, unsigned long long);
EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags) {
    REAL(get_proc_t, "cuGetProcAddress");
    CUresult r = real_fn(symbol, pfn, version, flags);
    void *o = override_for(symbol, version, flags);
    if (r == CUDA_SUCCESS && pfn != NULL && *pfn != NULL && o != NULL) {
        *pfn = o;
    }
    return r;
}

typedef CUresult (*get_proc_v2_t)(const char *, void **, int, unsigned long long, int *);
EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags,
                                    int *status) {
    REAL(get_proc_v2_t, "cuGetProcAddress_v2");
    CUresult r = real_fn(symbol, pfn, version, flags, status);
    void *o = override_for(symbol, version, flags);
    if (r == CUDA_SUCCESS && pfn != NULL && *pfn != NULL && o != NULL) {
        *pfn = o;
    }
    return r;
}
