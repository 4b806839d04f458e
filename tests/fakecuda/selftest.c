/*
 * CPU self-test of the shim's layering (tests/fakecuda/selftest.sh), with
 * no GPU: a pretend driver (built from this file with -DPRETEND_DRIVER as
 * libcuda-real.so.1) stands for the real one. Checks what the GPU runs
 * rely on: "libcuda.so" and "libcuda.so.1" (cudarc's and cuda-peer-sys's
 * names) open one handle, dlsym on it finds the shim's overrides first
 * and the pretend driver's other symbols, cuGetProcAddress hands out the
 * overrides, and each mode answers as documented.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

#ifdef PRETEND_DRIVER
CUresult cuInit(unsigned int f) { (void)f; return 0; }
CUresult cuDeviceCanAccessPeer(int *can, int a, int b) { (void)a; (void)b; *can = 0; return 0; }
CUresult cuDeviceGetP2PAttribute(int *v, int attr, int a, int b) { (void)attr; (void)a; (void)b; *v = 0; return 0; }
CUresult cuCtxEnablePeerAccess(void *peer, unsigned int flags) { (void)peer; (void)flags; return 0; }
CUresult cuCtxGetDevice(int *dev) { *dev = 1; return 0; }
/* A driver that loads and reports no device (Error::NoDevice). */
CUresult cuDeviceGetCount(int *n) { *n = 0; return 0; }
CUresult cuModuleLoadData(void **m, const void *image) { (void)image; *m = (void *)0x1; return 0; }
CUresult cuGetProcAddress(const char *s, void **pfn, int v, unsigned long long f) {
    (void)v; (void)f;
    *pfn = dlsym(RTLD_DEFAULT, s);
    if (strcmp(s, "cuCtxEnablePeerAccess") == 0) *pfn = (void *)cuCtxEnablePeerAccess;
    if (strcmp(s, "cuInit") == 0) *pfn = (void *)cuInit;
    if (strcmp(s, "cuGetProcAddress") == 0) *pfn = (void *)cuGetProcAddress;
    return *pfn ? 0 : 500;
}
/* Pretend device memory: two arrays standing for devices 0 and 1; copies
 * and host functions run at once (a stream in order). */
unsigned char pretend_dev[2][64];
CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
    for (int d = 0; d < 2; d++) {
        if (p >= (CUdeviceptr)(uintptr_t)pretend_dev[d] && p < (CUdeviceptr)(uintptr_t)(pretend_dev[d] + 64)) {
            if (attr == 2) *(unsigned int *)data = 2; /* CU_MEMORYTYPE_DEVICE */
            else if (attr == 9) *(int *)data = d;    /* device ordinal */
            return 0;
        }
    }
    return 1; /* not device memory */
}
CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, void *stream) {
    (void)stream; memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n); return 0;
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void *stream) { return cuMemcpyAsync(dst, src, n, stream); }
CUresult cuMemcpyPeerAsync(CUdeviceptr dst, void *dc, CUdeviceptr src, void *sc, size_t n, void *stream) {
    (void)dc; (void)sc; return cuMemcpyAsync(dst, src, n, stream);
}
CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) { return cuMemcpyAsync(dst, src, n, NULL); }
/* Host functions run at once on the NULL stream; on any other they wait
 * for cuStreamSynchronize of that stream (work "pending" until then). */
static struct { void *stream; void (*fn)(void *); void *arg; } pretend_queue[256];
static int pretend_queued;
CUresult cuLaunchHostFunc(void *stream, void (*fn)(void *), void *arg) {
    if (stream == NULL) { fn(arg); return 0; }
    if (pretend_queued == 256) return 2;
    pretend_queue[pretend_queued].stream = stream;
    pretend_queue[pretend_queued].fn = fn;
    pretend_queue[pretend_queued++].arg = arg;
    return 0;
}
CUresult cuStreamSynchronize(void *stream) {
    int kept = 0;
    for (int i = 0; i < pretend_queued; i++) {
        if (pretend_queue[i].stream == stream) pretend_queue[i].fn(pretend_queue[i].arg);
        else pretend_queue[kept++] = pretend_queue[i];
    }
    pretend_queued = kept;
    return 0;
}
CUresult cuStreamIsCapturing(void *stream, int *status) { (void)stream; *status = 0; return 0; }
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *stream) { (void)stream; memcpy(dst, (const void *)(uintptr_t)src, n); return 0; }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *stream) { (void)stream; memcpy((void *)(uintptr_t)dst, src, n); return 0; }
CUresult cuEventRecord(void *event, void *stream) { (void)event; (void)stream; return 0; }
CUresult cuMemFreeHost(void *p) { free(p); return 0; }
CUresult cuMemFree_v2(CUdeviceptr p) { (void)p; return 0; }
CUresult cuMemFreeAsync(CUdeviceptr p, void *stream) { (void)p; (void)stream; return 0; }
CUresult cuMemHostAlloc(void **p, size_t n, unsigned int flags) { (void)flags; *p = calloc(1, n); return *p ? 0 : 2; }
CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, void *stream) { (void)stream; memset((void *)(uintptr_t)p, v, n); return 0; }
/* Functions are their names' addresses; launches are counted. */
CUresult cuModuleGetFunction(void **f, void *module, const char *name) { (void)module; *f = (void *)name; return 0; }
int pretend_launches;
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned sh,
                        void *stream, void **params, void **extra) {
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)sh; (void)stream; (void)params; (void)extra;
    pretend_launches++;
    return 0;
}
int pretend_driver_marker = 42;
#else
static int failures;
#define CHECK(c, ...) do { if (!(c)) { fprintf(stderr, "selftest FAILED: " __VA_ARGS__); fprintf(stderr, "\n"); failures++; } } while (0)

typedef CUresult (*dtoh_t)(void *, CUdeviceptr, size_t, void *);
typedef CUresult (*record_t)(void *, void *);

/* fail-call=cuMemcpyDtoHAsync_v2:2, cuEventRecord:3@cuMemcpyDtoHAsync_v2:2 or cuEventRecord:2@restart:
 * the chosen call fails once, restart() counts again, and frees of memory
 * a pending copy touches are counted as unsafe, stream-ordered frees where
 * they run. */
static void fail_call(void *b, const char *mode, const char *(*fake_mode)(void), long (*fake_fired)(void)) {
    int before = failures;
    dtoh_t dtoh = (dtoh_t)dlsym(b, "cuMemcpyDtoHAsync_v2");
    record_t record = (record_t)dlsym(b, "cuEventRecord");
    CUresult (*host_alloc)(void **, size_t, unsigned int) = (CUresult (*)(void **, size_t, unsigned int))dlsym(b, "cuMemHostAlloc");
    CUresult (*free_host)(void *) = (CUresult (*)(void *))dlsym(b, "cuMemFreeHost");
    CUresult (*free_dev)(CUdeviceptr) = (CUresult (*)(CUdeviceptr))dlsym(b, "cuMemFree_v2");
    CUresult (*free_async)(CUdeviceptr, void *) = (CUresult (*)(CUdeviceptr, void *))dlsym(b, "cuMemFreeAsync");
    CUresult (*sync)(void *) = (CUresult (*)(void *))dlsym(b, "cuStreamSynchronize");
    CUresult (*peer)(CUdeviceptr, void *, CUdeviceptr, void *, size_t, void *) =
        (CUresult (*)(CUdeviceptr, void *, CUdeviceptr, void *, size_t, void *))dlsym(b, "cuMemcpyPeerAsync");
    long (*calls)(const char *) = (long (*)(const char *))dlsym(b, "cuda_peer_fake_calls");
    int (*restart)(void) = (int (*)(void))dlsym(b, "cuda_peer_fake_restart");
    long (*unsafe_frees)(void) = (long (*)(void))dlsym(b, "cuda_peer_fake_unsafe_frees");
    unsigned char (*dev)[64] = (unsigned char (*)[64])dlsym(b, "pretend_dev");
    CHECK(dtoh && record && host_alloc && free_host && free_dev && free_async && sync && peer && dev, "fail-call: entry points missing");
    if (failures > before) return;
    CHECK(strcmp(fake_mode(), mode) == 0, "mode %s", fake_mode());
#define D(d, off) ((CUdeviceptr)(uintptr_t)&dev[d][off])
    unsigned char host[8];
    long dtoh_calls = calls("cuMemcpyDtoHAsync_v2");
    if (strcmp(mode, "fail-call=cuMemcpyDtoHAsync_v2:2") == 0) {
        CHECK(dtoh(host, D(0, 0), 8, NULL) == 0, "the first call passes");
        CHECK(dtoh(host, D(0, 0), 8, NULL) == 999, "the second call fails with CUDA_ERROR_UNKNOWN");
        CHECK(dtoh(host, D(0, 0), 8, NULL) == 0, "the third call passes");
        CHECK(calls("cuMemcpyDtoHAsync_v2") == dtoh_calls + 3, "calls counted: %ld", calls("cuMemcpyDtoHAsync_v2"));
        CHECK(fake_fired() == 1, "%ld faults fired, expected 1", fake_fired());
        CHECK(restart() == 0, "restart");
        CHECK(dtoh(host, D(0, 0), 8, NULL) == 0 && dtoh(host, D(0, 0), 8, NULL) == 999, "after a restart the second call fails again");
        CHECK(fake_fired() == 2, "%ld faults fired, expected 2", fake_fired());
    } else if (strcmp(mode, "fail-call=cuEventRecord:3@cuMemcpyDtoHAsync_v2:2") == 0) {
        for (int i = 0; i < 5; i++) CHECK(record(NULL, NULL) == 0, "a record before the trigger passes");
        CHECK(dtoh(host, D(0, 0), 8, NULL) == 0, "the first copy");
        for (int i = 0; i < 4; i++) CHECK(record(NULL, NULL) == 0, "a record after the first copy passes");
        CHECK(dtoh(host, D(0, 0), 8, NULL) == 0, "the second copy");
        CHECK(record(NULL, NULL) == 0 && record(NULL, NULL) == 0, "the first two records after the second copy pass");
        CHECK(record(NULL, NULL) == 999, "the third record after the second copy fails");
        CHECK(record(NULL, NULL) == 0, "and only that one");
        CHECK(fake_fired() == 1, "%ld faults fired, expected 1", fake_fired());
    } else if (strcmp(mode, "fail-call=cuEventRecord:2@restart") == 0) {
        for (int i = 0; i < 5; i++) CHECK(record(NULL, NULL) == 0, "a record before the restart passes");
        CHECK(restart() == 0, "restart");
        CHECK(record(NULL, NULL) == 0 && record(NULL, NULL) == 999 && record(NULL, NULL) == 0,
              "the second record after the restart fails, and only that one");
        CHECK(fake_fired() == 1, "%ld faults fired, expected 1", fake_fired());
    } else {
        CHECK(0, "no self-test for %s", mode);
    }
    /* Frees while a copy touching the memory is pending (the pretend driver
     * runs a stream's host functions at its cuStreamSynchronize). */
    void *s1 = (void *)0x51, *s2 = (void *)0x52, *h = NULL;
    long unsafe0 = unsafe_frees();
    CHECK(host_alloc(&h, 64, 0) == 0 && dtoh(h, D(0, 0), 8, s1) == 0, "a copy into pinned memory");
    CHECK(free_host(h) == 0 && unsafe_frees() == unsafe0 + 1, "a pinned buffer freed while a copy into it is pending: %ld", unsafe_frees() - unsafe0);
    CHECK(sync(s1) == 0, "sync");
    CHECK(host_alloc(&h, 64, 0) == 0 && dtoh(h, D(0, 0), 8, s1) == 0 && sync(s1) == 0 && free_host(h) == 0, "copy, sync, free");
    CHECK(unsafe_frees() == unsafe0 + 1, "a free after the copy's stream was synchronised is safe");
    CHECK(peer(D(1, 0), NULL, D(0, 0), NULL, 8, s1) == 0, "a peer copy");
    CHECK(free_async(D(0, 0), s2) == 0 && unsafe_frees() == unsafe0 + 1, "a stream-ordered free is checked where it runs");
    CHECK(sync(s2) == 0 && unsafe_frees() == unsafe0 + 2, "a free on another stream, run while the copy reading it is pending");
    CHECK(sync(s1) == 0, "sync");
    CHECK(peer(D(1, 0), NULL, D(0, 0), NULL, 8, s1) == 0 && free_async(D(0, 0), s1) == 0 && sync(s1) == 0, "copy, free on the same stream");
    CHECK(unsafe_frees() == unsafe0 + 2, "a free ordered after the copy on its stream is safe");
    CHECK(free_dev(D(1, 0)) == 0 && unsafe_frees() == unsafe0 + 2, "a free with nothing pending is safe");
#undef D
}

typedef CUresult (*launch_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                            void **);

/* corrupt-fused-results=N (the pretend context is on device 1): with N = 1
 * every fused launch reaches the driver and then the first byte of its
 * output (the one-shot's parameter 4, the mesh's outs[rank]) has its low
 * bit flipped, once per launch; other kernels, other bytes, and launches
 * without kernel parameters are left alone. With N = 0 nothing changes. */
static void corrupt_fused(void *b, const char *mode, long (*fake_fired)(void)) {
    int on_one = strcmp(mode, "corrupt-fused-results=1") == 0;
    CUresult (*getf)(void **, void *, const char *) = (CUresult (*)(void **, void *, const char *))dlsym(b, "cuModuleGetFunction");
    launch_t launch = (launch_t)dlsym(b, "cuLaunchKernel");
    int *launches = (int *)dlsym(b, "pretend_launches");
    unsigned char (*dev)[64] = (unsigned char (*)[64])dlsym(b, "pretend_dev");
    CHECK(getf && launch && launches && dev, "cuModuleGetFunction, cuLaunchKernel, the launch count or pretend memory missing");
    if (failures) return;
    for (int i = 0; i < 64; i++) { dev[0][i] = (unsigned char)(5 * i + 2); dev[1][i] = (unsigned char)(7 * i + 3); }
    unsigned char before[2][64];
    memcpy(before, dev, sizeof before);
    void *oneshot = NULL, *mesh = NULL, *plain = NULL;
    CHECK(getf(&oneshot, NULL, "cp_oneshot_sum_u32") == 0 && getf(&mesh, NULL, "cp_meshar_sum_u32") == 0
              && getf(&plain, NULL, "cp_reduce2_sum_u32") == 0, "cuModuleGetFunction");
#define D(d, off) ((CUdeviceptr)(uintptr_t)&dev[d][off])
    /* The one-shot's 13 parameters; `out` (4) at dev[1][8], `in` (3) at dev[1][0]. */
    CUdeviceptr os_in = D(1, 0), os_out = D(1, 8), zero = 0;
    unsigned long long arr[8] = {0};
    void *os_params[13] = {arr, &zero, &zero, &os_in, &os_out, &zero, &zero, &zero, &zero, &zero, &zero, &zero, &zero};
    /* The mesh's 10: rank (4) 1, outs (1) {dev[0][32], dev[1][32]}, ins (0) {dev[0][0], dev[1][0]}. */
    unsigned long long ins[8] = {D(0, 0), D(1, 0)}, outs[8] = {D(0, 32), D(1, 32)};
    int nranks = 2, rank = 1;
    void *mesh_params[10] = {ins, outs, arr, &nranks, &rank, &zero, &zero, &zero, &zero, &zero};
    long fired0 = fake_fired();
    int launches0 = *launches;
    CHECK(launch(plain, 1, 1, 1, 1, 1, 1, 0, NULL, os_params, NULL) == 0, "a plain kernel");
    CHECK(memcmp(before, dev, sizeof before) == 0 && fake_fired() == fired0, "a plain kernel's arguments are left alone");
    CHECK(launch(oneshot, 1, 1, 1, 1, 1, 1, 0, NULL, os_params, NULL) == 0, "a one-shot launch");
    CHECK(dev[1][8] == (before[1][8] ^ (on_one ? 1 : 0)), "%s: the one-shot's output byte is %u (was %u)", mode, dev[1][8], before[1][8]);
    CHECK(launch(mesh, 1, 1, 1, 1, 1, 1, 0, NULL, mesh_params, NULL) == 0, "a mesh launch");
    CHECK(dev[1][32] == (before[1][32] ^ (on_one ? 1 : 0)), "%s: the mesh's outs[rank] byte is %u (was %u)", mode, dev[1][32], before[1][32]);
    CHECK(launch(mesh, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) == 0, "a launch without kernel parameters");
    dev[1][8] = before[1][8];
    dev[1][32] = before[1][32];
    CHECK(memcmp(before, dev, sizeof before) == 0, "%s: only the outputs' first bytes changed", mode);
    CHECK(*launches == launches0 + 4, "%s: %d of 4 launches reached the driver", mode, *launches - launches0);
    CHECK(fake_fired() - fired0 == (on_one ? 2 : 0), "%s: %ld faults fired", mode, fake_fired() - fired0);
#undef D
}

int main(void) {
    const char *mode = getenv("CUDA_PEER_FAKE");
    void *a = dlopen("libcuda.so", RTLD_LAZY | RTLD_LOCAL);
    void *b = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (!a || !b) { fprintf(stderr, "selftest FAILED: dlopen: %s\n", dlerror()); return 1; }
    CHECK(a == b, "libcuda.so and libcuda.so.1 opened different objects");
    const char *(*fake_mode)(void) = (const char *(*)(void))dlsym(b, "cuda_peer_fake_mode");
    long (*fake_fired)(void) = (long (*)(void))dlsym(b, "cuda_peer_fake_fired");
    CHECK(fake_mode && fake_fired, "the shim's test symbols are missing");
    CHECK(dlsym(b, "pretend_driver_marker") != NULL, "the driver's own symbols are not reachable through the handle");
    CUresult (*init)(unsigned int) = (CUresult (*)(unsigned int))dlsym(b, "cuInit");
    CUresult (*can)(int *, int, int) = (CUresult (*)(int *, int, int))dlsym(b, "cuDeviceCanAccessPeer");
    CUresult (*enable)(void *, unsigned int) = (CUresult (*)(void *, unsigned int))dlsym(b, "cuCtxEnablePeerAccess");
    CUresult (*load)(void **, const void *) = (CUresult (*)(void **, const void *))dlsym(b, "cuModuleLoadData");
    CUresult (*gpa)(const char *, void **, int, unsigned long long) =
        (CUresult (*)(const char *, void **, int, unsigned long long))dlsym(b, "cuGetProcAddress");
    CHECK(init && can && enable && load && gpa, "symbols missing");
    if (failures) return 1;
    CHECK(init(0) == 0, "cuInit passes through");
    int v = -1;
    CHECK(can(&v, 0, 1) == 0, "cuDeviceCanAccessPeer");
    void *m = NULL;
    void *via_gpa = NULL;
    CHECK(gpa("cuCtxEnablePeerAccess", &via_gpa, 12000, 0) == 0 && via_gpa == (void *)enable,
          "cuGetProcAddress does not hand out the override");
    via_gpa = NULL;
    CHECK(gpa("cuInit", &via_gpa, 12000, 0) == 0 && via_gpa == (void *)init, "cuGetProcAddress(cuInit) is not the driver's");
    via_gpa = NULL;
    CHECK(gpa("cuGetProcAddress", &via_gpa, 12000, 0) == 0 && via_gpa == dlsym(b, "cuGetProcAddress_v2"),
          "cuGetProcAddress(cuGetProcAddress) is not the shim's");
    long (*calls)(const char *) = (long (*)(const char *))dlsym(b, "cuda_peer_fake_calls");
    int (*restart)(void) = (int (*)(void))dlsym(b, "cuda_peer_fake_restart");
    long (*unsafe_frees)(void) = (long (*)(void))dlsym(b, "cuda_peer_fake_unsafe_frees");
    CHECK(calls && restart && unsafe_frees, "the shim's fail-call symbols are missing");
    if (failures) return 1;
    CHECK(calls("cuDeviceCanAccessPeer") == 1, "cuDeviceCanAccessPeer counted %ld times, expected 1", calls("cuDeviceCanAccessPeer"));
    CHECK(calls("cuNotAnOverride") == -1 && calls(NULL) == -1, "a name that is no override is counted");
    if (!mode || !*mode || strncmp(mode, "fail-call=", 10) != 0) {
        CHECK(restart() == -1, "%s: cuda_peer_fake_restart should refuse outside fail-call", fake_mode());
    }
    if (!mode || !*mode || strcmp(mode, "off") == 0) {
        CHECK(strcmp(fake_mode(), "off") == 0, "mode %s, expected off", fake_mode());
        CHECK(v == 0, "off: cuDeviceCanAccessPeer changed to %d", v);
        CHECK(enable(NULL, 0) == 0, "off: cuCtxEnablePeerAccess should pass through");
        CHECK(load(&m, "x") == 0 && m == (void *)0x1, "off: cuModuleLoadData should pass through");
        CHECK(fake_fired() == 0, "off: %ld faults fired", fake_fired());
    } else if (strcmp(mode, "peer-unavailable") == 0) {
        CHECK(strcmp(fake_mode(), mode) == 0, "mode %s", fake_mode());
        CHECK(v == 1, "peer-unavailable: cuDeviceCanAccessPeer says %d", v);
        v = -1;
        CHECK(can(&v, 1, 1) == 0 && v == 0, "peer-unavailable: a device with itself: %d", v);
        CHECK(enable(NULL, 0) == 217, "peer-unavailable: cuCtxEnablePeerAccess should be 217");
        CHECK(fake_fired() == 1, "peer-unavailable: %ld faults fired", fake_fired());
    } else if (strcmp(mode, "corrupt-peer-copies") == 0) {
        unsigned char (*dev)[64] = (unsigned char (*)[64])dlsym(b, "pretend_dev");
        CUresult (*peer)(CUdeviceptr, void *, CUdeviceptr, void *, size_t, void *) =
            (CUresult (*)(CUdeviceptr, void *, CUdeviceptr, void *, size_t, void *))dlsym(b, "cuMemcpyPeerAsync");
        CUresult (*dtod)(CUdeviceptr, CUdeviceptr, size_t, void *) =
            (CUresult (*)(CUdeviceptr, CUdeviceptr, size_t, void *))dlsym(b, "cuMemcpyDtoDAsync_v2");
        CUresult (*cp)(CUdeviceptr, CUdeviceptr, size_t, void *) =
            (CUresult (*)(CUdeviceptr, CUdeviceptr, size_t, void *))dlsym(b, "cuMemcpyAsync");
        CHECK(dev && peer && dtod && cp, "pretend memory or copy entry points missing");
        if (failures) return 1;
        for (int i = 0; i < 64; i++) { dev[0][i] = (unsigned char)(3 * i + 1); dev[1][i] = 0; }
#define D(d, off) ((CUdeviceptr)(uintptr_t)&dev[d][off])
        CHECK(peer(D(1, 0), NULL, D(0, 0), NULL, 16, NULL) == 0, "peer copy");
        CHECK(dev[1][0] == (dev[0][0] ^ 1) && memcmp(&dev[1][1], &dev[0][1], 15) == 0,
              "a peer copy between devices should land with only its first byte flipped");
        CHECK(dtod(D(1, 32), D(0, 16), 8, NULL) == 0 && dev[1][32] == (dev[0][16] ^ 1), "cuMemcpyDtoDAsync_v2 across devices");
        CHECK(cp(D(1, 48), D(0, 40), 8, NULL) == 0 && dev[1][48] == (dev[0][40] ^ 1), "cuMemcpyAsync across devices");
        CHECK(dtod(D(0, 48), D(0, 0), 8, NULL) == 0 && memcmp(&dev[0][48], &dev[0][0], 8) == 0,
              "a copy within one device should be left alone");
        unsigned char host[8];
        CHECK(cp((CUdeviceptr)(uintptr_t)host, D(1, 0), 8, NULL) == 0 && memcmp(host, &dev[1][0], 8) == 0,
              "a device-to-host copy should be left alone");
        CHECK(fake_fired() == 3, "corrupt-peer-copies: %ld faults fired, expected 3", fake_fired());
#undef D
    } else if (strcmp(mode, "fail-module-load=1") == 0) {
        CHECK(load(&m, "x") == 2, "fail-module-load=1 on device 1 should be out of memory");
        CHECK(fake_fired() == 1, "fail-module-load: %ld faults fired", fake_fired());
    } else if (strncmp(mode, "drop-sm-stores=", 15) == 0) {
        /* The pretend context is on device 1. */
        int on_one = strcmp(mode, "drop-sm-stores=1") == 0;
        CUresult (*getf)(void **, void *, const char *) = (CUresult (*)(void **, void *, const char *))dlsym(b, "cuModuleGetFunction");
        CUresult (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **) =
            (CUresult (*)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **))dlsym(b, "cuLaunchKernel");
        int *launches = (int *)dlsym(b, "pretend_launches");
        CHECK(getf && launch && launches, "cuModuleGetFunction, cuLaunchKernel or the launch count missing");
        if (failures) return 1;
        void *fused = NULL, *mesh = NULL, *plain = NULL;
        CHECK(getf(&fused, NULL, "cp_oneshot_sum_f32") == 0 && getf(&mesh, NULL, "cp_meshar_max_u8") == 0
                  && getf(&plain, NULL, "cp_reduce2_sum_f32") == 0, "cuModuleGetFunction");
        CHECK(launch(plain, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) == 0 && *launches == 1, "a plain kernel should run");
        CHECK(launch(fused, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) == 0, "a dropped launch still says success");
        CHECK(launch(mesh, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) == 0, "a dropped launch still says success");
        CHECK(*launches == (on_one ? 1 : 3), "%s: %d launches reached the driver", mode, *launches);
        CHECK(fake_fired() == (on_one ? 2 : 0), "%s: %ld faults fired", mode, fake_fired());
    } else if (strncmp(mode, "corrupt-fused-results=", 22) == 0) {
        corrupt_fused(b, mode, fake_fired);
    } else if (strncmp(mode, "fail-call=", 10) == 0) {
        fail_call(b, mode, fake_mode, fake_fired);
    } else if (strcmp(mode, "fail-module-load=0") == 0) {
        CHECK(load(&m, "x") == 0, "fail-module-load=0 on device 1 should pass");
        CHECK(fake_fired() == 0, "fail-module-load=0: %ld faults fired", fake_fired());
    }
    if (failures) return 1;
    printf("fakecuda selftest (%s): ok\n", fake_mode());
    return 0;
}
#endif
