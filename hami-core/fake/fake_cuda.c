/* A fake libcuda.so.1 for tests without a GPU: FAKE_CUDA_DEVICES devices of
 * FAKE_CUDA_TOTAL_MIB MiB each, real bookkeeping of every allocation (so tests can
 * see what reached the driver), and cuGetProcAddress that selects entry points by
 * base name, requested version and stream flags as the real driver does. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cuda.h>
#include "fake_cuda.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEVICES 16
#define SHARDS 64
#define SHARED_PROCS 4096

/* Names cuda.h macro-renames or only declares for per-thread-stream builds. */
CUresult fake_cuMemAlloc_v1(unsigned int *dptr, unsigned int bytesize) __asm__("cuMemAlloc") EXPORT;
CUresult fake_cuGetProcAddress_v1(const char *symbol, void **pfn, int version, cuuint64_t flags)
    __asm__("cuGetProcAddress") EXPORT;
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) EXPORT;
CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                      CUstream hStream) EXPORT;
CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) EXPORT;
int fakeCudaStats(int physical_index, fake_cuda_stats *out) EXPORT;

struct device {
    _Atomic unsigned long long used, peak, allocs, frees;
};

struct handle {
    struct handle *next;
    uint64_t key;
    uint64_t bytes;
    int dev;
};

struct shard {
    pthread_mutex_t lock;
    struct handle *buckets[256];
};

static struct device local_devices[MAX_DEVICES + 1]; /* the last one counts host VMM memory */
static struct device *devices = local_devices;
#define HOST_SLOT MAX_DEVICES

/* Cross-process mode (FAKE_CUDA_STATE): what each live process holds, so the memory of a
 * process that died is released, as the real driver does at process teardown. */
struct shared_proc {
    int pid;
    int pad;
    unsigned long long start;
    unsigned long long used[MAX_DEVICES + 1];
};

struct shared_state {
    struct device devices[MAX_DEVICES + 1]; /* used = sum over live processes */
    struct shared_proc procs[SHARED_PROCS];
};

static struct shared_state *shared;
static int shared_fd = -1;
static struct shared_proc *me;
static char shared_path[4096];
static pthread_mutex_t shared_mutex = PTHREAD_MUTEX_INITIALIZER;
static struct shard shards[SHARDS] = {[0 ... SHARDS - 1] = {.lock = PTHREAD_MUTEX_INITIALIZER}};
static _Atomic unsigned long long bad_frees;
static _Atomic uint64_t next_address = 0x7f0000000000ull;
static _Atomic uint32_t next_address_v1 = 0x1000000u;
static int device_count = 1;
static unsigned long long device_total = 15360ull << 20;
static int visible[MAX_DEVICES];
static int visible_count;
static pthread_once_t config_once = PTHREAD_ONCE_INIT;
static __thread int current_ctx; /* physical index + 1; 0 = no current context */

static long env_long(const char *name, long fallback, long lo, long hi) {
    const char *text = getenv(name);
    char *end;
    long v = text ? strtol(text, &end, 10) : fallback;
    return text && (*end || end == text || v < lo || v > hi) ? fallback : v;
}

static void forget_after_fork(void);

/* FAKE_CUDA_STATE=<file>: device memory is shared by every process using that file. */
static void map_shared_state(void) {
    const char *path = getenv("FAKE_CUDA_STATE");
    if (!path || !*path || strlen(path) >= sizeof shared_path) return;
    strcpy(shared_path, path);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return;
    struct stat st;
    if (fstat(fd, &st) == 0 && (st.st_size == (off_t)sizeof *shared || ftruncate(fd, sizeof *shared) == 0)) {
        void *p = mmap(NULL, sizeof *shared, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p != MAP_FAILED) {
            shared = p;
            devices = shared->devices;
            shared_fd = fd;
            pthread_atfork(NULL, NULL, forget_after_fork);
            return;
        }
    }
    close(fd);
}

/* OFD lock on the state file's device counters (dropped by the kernel if the holder dies)
 * plus a mutex, because threads of one process share the open file description. */
static void shared_lock(int type) {
    struct flock fl = {.l_type = (short)type, .l_whence = SEEK_SET, .l_len = offsetof(struct shared_state, procs)};
    if (type == F_WRLCK) pthread_mutex_lock(&shared_mutex);
    while (fcntl(shared_fd, F_OFD_SETLKW, &fl) == -1 && errno == EINTR) {
    }
    if (type == F_UNLCK) pthread_mutex_unlock(&shared_mutex);
}

/* Each process holds an OFD lock on its own record for its whole life; the kernel drops it
 * when the process dies (or execs: the fd is O_CLOEXEC), as the real driver tears the
 * process's memory down. PID visibility plays no part, so a process in another PID
 * namespace can neither be mistaken for dead nor mistake others for dead. */
static struct flock proc_range(const struct shared_proc *proc, short type) {
    return (struct flock){.l_type = type, .l_whence = SEEK_SET,
                          .l_start = (off_t)((const char *)proc - (const char *)shared), .l_len = sizeof *proc};
}

static int alive(const struct shared_proc *proc) {
    struct flock fl = proc_range(proc, F_WRLCK);
    return fcntl(shared_fd, F_OFD_GETLK, &fl) != 0 || fl.l_type != F_UNLCK;
}

/* Under the lock: drop dead processes and recompute every device's used bytes. */
static void reap(void) {
    unsigned long long sums[MAX_DEVICES + 1] = {0};
    for (int i = 0; i < SHARED_PROCS; i++) {
        struct shared_proc *p = &shared->procs[i];
        if (!p->pid) continue;
        if (p != me && !alive(p)) {
            memset(p, 0, sizeof *p);
            continue;
        }
        for (int d = 0; d <= MAX_DEVICES; d++) sums[d] += p->used[d];
    }
    for (int d = 0; d <= MAX_DEVICES; d++) atomic_store(&shared->devices[d].used, sums[d]);
}

/* Under the lock, after reap(): the image we exec'd from is already gone (its lock went). */
static struct shared_proc *claim_proc(void) {
    for (int i = 0; i < SHARED_PROCS; i++) {
        struct shared_proc *p = &shared->procs[i];
        struct flock fl = proc_range(p, F_WRLCK);
        if (p->pid || fcntl(shared_fd, F_OFD_SETLK, &fl) != 0) continue;
        memset(p, 0, sizeof *p);
        p->pid = getpid();
        return p;
    }
    return NULL;
}

static CUresult shared_charge(struct device *d, int dev, uint64_t bytes) {
    CUresult rc = CUDA_ERROR_OUT_OF_MEMORY;
    shared_lock(F_WRLCK);
    reap();
    if (!me) me = claim_proc();
    unsigned long long used = atomic_load(&d->used);
    if (me && bytes <= device_total - used) {
        me->used[dev] += bytes;
        atomic_store(&d->used, used + bytes);
        if (used + bytes > atomic_load(&d->peak)) atomic_store(&d->peak, used + bytes);
        rc = CUDA_SUCCESS;
    }
    shared_lock(F_UNLCK);
    return rc;
}

static void shared_uncharge(int dev, uint64_t bytes) {
    shared_lock(F_WRLCK);
    if (me && me->used[dev] >= bytes) {
        me->used[dev] -= bytes;
        atomic_fetch_sub(&shared->devices[dev].used, bytes);
    }
    shared_lock(F_UNLCK);
}

static unsigned long long used_now(int dev) {
    if (!shared) return atomic_load(&devices[dev].used);
    shared_lock(F_WRLCK);
    reap();
    unsigned long long used = atomic_load(&devices[dev].used);
    shared_lock(F_UNLCK);
    return used;
}

/* The UUIDs the fake NVML reports; CUDA accepts any unique prefix of "GPU-<uuid>". */
static int device_by_uuid_prefix(const char *token, size_t len) {
    if (len <= 4 || strncmp(token, "GPU-", 4) != 0) return -1;
    int found = -1;
    for (int i = 0; i < device_count; i++) {
        char uuid[64];
        snprintf(uuid, sizeof uuid, "GPU-%02d00fa4e-1111-2222-3333-%012d", i, i);
        if (len <= strlen(uuid) && strncmp(uuid, token, len) == 0) found = found == -1 ? i : -2; /* ambiguous prefixes name nothing */
    }
    return found;
}

static void read_config(void) {
    map_shared_state();
    device_count = (int)env_long("FAKE_CUDA_DEVICES", 1, 1, MAX_DEVICES);
    device_total = (unsigned long long)env_long("FAKE_CUDA_TOTAL_MIB", 15360, 1, 1L << 30) << 20;
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    for (const char *p = cvd; p && *p && visible_count < MAX_DEVICES;) {
        size_t len = strcspn(p, ",");
        int v = device_by_uuid_prefix(p, len);
        if (v < 0) {
            char *end;
            long n = strtol(p, &end, 10);
            v = end == p + len && n < device_count ? (int)n : -1;
        }
        if (v < 0) break; /* the driver stops at the first bad entry */
        visible[visible_count++] = v;
        p += len + (p[len] == ',');
    }
    if (!cvd)
        for (int i = 0; i < device_count; i++) visible[visible_count++] = i;
}

static void config(void) { pthread_once(&config_once, read_config); }

static int physical(CUdevice ordinal) { return ordinal >= 0 && ordinal < visible_count ? visible[ordinal] : -1; }

/* ---- handle bookkeeping ---- */

/* A fork child holds no device memory and must take its own lock (the inherited open file
 * description is the parent's). */
static void forget_after_fork(void) {
    for (int i = 0; i < SHARDS; i++) {
        pthread_mutex_init(&shards[i].lock, NULL);
        memset(shards[i].buckets, 0, sizeof shards[i].buckets);
    }
    pthread_mutex_init(&shared_mutex, NULL);
    me = NULL;
    /* The inherited fd and mapping share the parent's open file description and its record
     * lock: map a fresh one over the same address so the parent's lock dies with the parent. */
    int fd = shared ? open(shared_path, O_RDWR | O_CLOEXEC) : -1;
    if (fd >= 0 && mmap(shared, sizeof *shared, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) != MAP_FAILED) {
        close(shared_fd);
        shared_fd = fd;
    } else if (fd >= 0) {
        close(fd);
    }
}

static struct shard *shard_of(uint64_t key, size_t *bucket) {
    uint64_t h = key * 0x9E3779B97F4A7C15ull;
    *bucket = (h >> 20) & 255;
    return &shards[h >> 58];
}

static void uncharge(int dev, uint64_t bytes) {
    if (shared)
        shared_uncharge(dev, bytes);
    else
        atomic_fetch_sub(&devices[dev].used, bytes);
}

static CUresult charge(int dev, uint64_t bytes, uint64_t key) {
    struct device *d = &devices[dev];
    if (shared) {
        if (shared_charge(d, dev, bytes) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        unsigned long long cur = atomic_load(&d->used);
        do {
            if (bytes > device_total - cur) return CUDA_ERROR_OUT_OF_MEMORY;
        } while (!atomic_compare_exchange_weak(&d->used, &cur, cur + bytes));
        unsigned long long peak = atomic_load(&d->peak);
        while (cur + bytes > peak && !atomic_compare_exchange_weak(&d->peak, &peak, cur + bytes)) {
        }
    }
    struct handle *h = malloc(sizeof *h);
    if (!h) {
        uncharge(dev, bytes);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    size_t b;
    struct shard *s = shard_of(key, &b);
    *h = (struct handle){.key = key, .bytes = bytes, .dev = dev};
    pthread_mutex_lock(&s->lock);
    h->next = s->buckets[b];
    s->buckets[b] = h;
    pthread_mutex_unlock(&s->lock);
    atomic_fetch_add(&d->allocs, 1);
    return CUDA_SUCCESS;
}

static CUresult release(uint64_t key) {
    size_t b;
    struct shard *s = shard_of(key, &b);
    pthread_mutex_lock(&s->lock);
    struct handle **link = &s->buckets[b];
    while (*link && (*link)->key != key) link = &(*link)->next;
    struct handle *h = *link;
    if (h) *link = h->next;
    pthread_mutex_unlock(&s->lock);
    if (!h) {
        atomic_fetch_add(&bad_frees, 1);
        return CUDA_ERROR_INVALID_VALUE;
    }
    uncharge(h->dev, h->bytes);
    atomic_fetch_add(&devices[h->dev].frees, 1);
    free(h);
    return CUDA_SUCCESS;
}

static uint64_t new_address(uint64_t bytes) {
    return atomic_fetch_add(&next_address, (bytes + 511) & ~511ull);
}

static CUresult current_device(int *dev) {
    config();
    if (!current_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    *dev = current_ctx - 1;
    return CUDA_SUCCESS;
}

static CUresult alloc_on_current(CUdeviceptr *dptr, size_t bytes) {
    int dev;
    CUresult rc = current_device(&dev);
    if (rc != CUDA_SUCCESS) return rc;
    if (!dptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
    uint64_t address = new_address(bytes);
    rc = charge(dev, bytes, address);
    if (rc == CUDA_SUCCESS) *dptr = (CUdeviceptr)address;
    return rc;
}

/* ---- device and context ---- */

EXPORT CUresult cuInit(unsigned int flags) {
    config();
    return flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuDriverGetVersion(int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = CUDA_VERSION;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetCount(int *count) {
    config();
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = visible_count;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    config();
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (physical(ordinal) < 0) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    config();
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (physical(dev) < 0) return CUDA_ERROR_INVALID_DEVICE;
    strncpy(name, "Fake GPU", (size_t)len - 1);
    name[len - 1] = '\0';
    return CUDA_SUCCESS;
}

/* The 16 bytes behind the fake NVML's "GPU-<ii>00fa4e-1111-2222-3333-<i, 12 digits>" of the
 * physical device, so both APIs name a device alike, as the real ones do. */
EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) {
    config();
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    int phys = physical(dev);
    if (phys < 0) return CUDA_ERROR_INVALID_DEVICE;
    char text[64], *p = text;
    snprintf(text, sizeof text, "%02d00fa4e111122223333%012d", phys, phys);
    for (int i = 0; i < 16; i++, p += 2) {
        unsigned byte;
        sscanf(p, "%2x", &byte);
        uuid->bytes[i] = (char)byte;
    }
    return CUDA_SUCCESS;
}

CUresult fake_cuDeviceGetUuid_v1(CUuuid *uuid, CUdevice dev) __asm__("cuDeviceGetUuid") EXPORT;
CUresult fake_cuDeviceGetUuid_v1(CUuuid *uuid, CUdevice dev) { return cuDeviceGetUuid_v2(uuid, dev); }

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    config();
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    if (physical(dev) < 0) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = device_total;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    config();
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (physical(dev) < 0) return CUDA_ERROR_INVALID_DEVICE;
    *pctx = (CUcontext)(uintptr_t)(physical(dev) + 1);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    config();
    return physical(dev) < 0 ? CUDA_ERROR_INVALID_DEVICE : CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    uintptr_t v = (uintptr_t)ctx;
    if (v > MAX_DEVICES) return CUDA_ERROR_INVALID_CONTEXT;
    current_ctx = (int)v;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx) {
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = (CUcontext)(uintptr_t)current_ctx;
    return CUDA_SUCCESS;
}

/* Reports the CUDA ordinal of the current context, as the real driver does. */
EXPORT CUresult cuCtxGetDevice(CUdevice *device) {
    int dev;
    CUresult rc = current_device(&dev);
    if (rc != CUDA_SUCCESS) return rc;
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    for (int i = 0; i < visible_count; i++)
        if (visible[i] == dev) *device = i;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    int dev;
    CUresult rc = current_device(&dev);
    if (rc != CUDA_SUCCESS) return rc;
    if (!free_bytes || !total_bytes) return CUDA_ERROR_INVALID_VALUE;
    *total_bytes = device_total;
    *free_bytes = device_total - used_now(dev);
    return CUDA_SUCCESS;
}

/* ---- allocation ---- */

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) { return alloc_on_current(dptr, bytesize); }

CUresult fake_cuMemAlloc_v1(unsigned int *dptr, unsigned int bytesize) {
    int dev;
    CUresult rc = current_device(&dev);
    if (rc != CUDA_SUCCESS) return rc;
    if (!dptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    uint32_t address = atomic_fetch_add(&next_address_v1, (bytesize + 511u) & ~511u);
    rc = charge(dev, bytesize, address);
    if (rc == CUDA_SUCCESS) *dptr = address;
    return rc;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) { return dptr ? release(dptr) : CUDA_SUCCESS; }

EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    (void)flags;
    return alloc_on_current(dptr, bytesize);
}

EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                                   unsigned int element) {
    if (!pitch || (element != 4 && element != 8 && element != 16)) return CUDA_ERROR_INVALID_VALUE;
    size_t p = (width + 511) & ~(size_t)511;
    CUresult rc = alloc_on_current(dptr, p * height);
    if (rc == CUDA_SUCCESS) *pitch = p;
    return rc;
}

EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream stream) {
    (void)stream;
    return alloc_on_current(dptr, bytesize);
}

EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream stream) {
    return cuMemAllocAsync(dptr, bytesize, stream);
}

EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                        CUstream stream) {
    (void)pool;
    return cuMemAllocAsync(dptr, bytesize, stream);
}

EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                             CUstream stream) {
    return cuMemAllocFromPoolAsync(dptr, bytesize, pool, stream);
}

EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream) {
    (void)stream;
    return cuMemFree_v2(dptr);
}

EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream) { return cuMemFreeAsync(dptr, stream); }

EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long flags) {
    config();
    if (!handle || !prop || size == 0 || flags) return CUDA_ERROR_INVALID_VALUE;
    int dev = prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE ? physical(prop->location.id) : HOST_SLOT;
    if (dev < 0) return CUDA_ERROR_INVALID_DEVICE;
    uint64_t key = new_address(size);
    CUresult rc = charge(dev, size, key);
    if (rc == CUDA_SUCCESS) *handle = key;
    return rc;
}

EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) { return release(handle); }

static uint64_t format_bytes(CUarray_format f) {
    switch (f) {
        case CU_AD_FORMAT_UNSIGNED_INT8:
        case CU_AD_FORMAT_SIGNED_INT8: return 1;
        case CU_AD_FORMAT_UNSIGNED_INT16:
        case CU_AD_FORMAT_SIGNED_INT16:
        case CU_AD_FORMAT_HALF: return 2;
        default: return 4;
    }
}

static uint64_t one(size_t v) { return v ? v : 1; }

static uint64_t extent(size_t w, size_t h, size_t d, unsigned ch, CUarray_format f) {
    return one(w) * one(h) * one(d) * one(ch) * format_bytes(f);
}

static CUresult create_array(void **handle, uint64_t bytes) {
    int dev;
    CUresult rc = current_device(&dev);
    if (rc != CUDA_SUCCESS) return rc;
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    uint64_t key = new_address(bytes);
    rc = charge(dev, bytes, key);
    if (rc == CUDA_SUCCESS) *handle = (void *)(uintptr_t)key;
    return rc;
}

EXPORT CUresult cuArrayCreate_v2(CUarray *handle, const CUDA_ARRAY_DESCRIPTOR *d) {
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    return create_array((void **)handle, extent(d->Width, d->Height, 1, d->NumChannels, d->Format));
}

EXPORT CUresult cuArray3DCreate_v2(CUarray *handle, const CUDA_ARRAY3D_DESCRIPTOR *d) {
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    return create_array((void **)handle, extent(d->Width, d->Height, d->Depth, d->NumChannels, d->Format));
}

EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *handle, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                       unsigned int levels) {
    if (!d || levels == 0) return CUDA_ERROR_INVALID_VALUE;
    uint64_t bytes = 0;
    for (unsigned l = 0; l < levels && l < 64; l++)
        bytes += extent(d->Width >> l, d->Height >> l, d->Depth >> l, d->NumChannels, d->Format);
    return create_array((void **)handle, bytes);
}

/* ---- graphs and pools: enough for the memory they hold ----
 * The real driver maps a graph's allocation node when the graph is launched; the fake charges
 * it when the node is added (it has no launches), so what a graph holds is counted as soon as
 * it exists. A pool's release threshold is accepted and, like the real one, changes nothing
 * the ledger shows until memory is freed into the pool. */

EXPORT CUresult cuGraphCreate(CUgraph *graph, unsigned int flags) {
    config();
    if (!graph || flags) return CUDA_ERROR_INVALID_VALUE;
    *graph = (CUgraph)(uintptr_t)new_address(1);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                                       CUDA_MEM_ALLOC_NODE_PARAMS *params) {
    (void)deps;
    (void)ndeps;
    if (!node || !graph || !params) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = alloc_on_current(&params->dptr, params->bytesize);
    if (rc == CUDA_SUCCESS) *node = (CUgraphNode)(uintptr_t)params->dptr;
    return rc;
}

static CUresult add_node(CUgraphNode *node, CUgraph graph, CUgraphNodeParams *params) {
    if (!node || !graph || !params) return CUDA_ERROR_INVALID_VALUE;
    if (params->type != CU_GRAPH_NODE_TYPE_MEM_ALLOC) return CUDA_ERROR_NOT_SUPPORTED; /* the fake runs no kernels */
    CUresult rc = alloc_on_current(&params->alloc.dptr, params->alloc.bytesize);
    if (rc == CUDA_SUCCESS) *node = (CUgraphNode)(uintptr_t)params->alloc.dptr;
    return rc;
}

EXPORT CUresult cuGraphAddNode_v2(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps,
                                  const CUgraphEdgeData *edges, size_t ndeps, CUgraphNodeParams *params) {
    (void)deps;
    (void)edges;
    (void)ndeps;
    return add_node(node, graph, params);
}

CUresult fake_cuGraphAddNode_v1(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                                CUgraphNodeParams *params) __asm__("cuGraphAddNode") EXPORT;
CUresult fake_cuGraphAddNode_v1(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                                CUgraphNodeParams *params) {
    (void)deps;
    (void)ndeps;
    return add_node(node, graph, params);
}

EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value) {
    (void)attr;
    return pool && value ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuArrayDestroy(CUarray handle) { return release((uintptr_t)handle); }

EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray handle) { return release((uintptr_t)handle); }

/* ---- entry-point lookup ---- */

struct entry_point {
    const char *base;
    int version; /* first cudaVersion that gets this variant */
    int ptds;
    void *fn;
};

static const struct entry_point entry_points[] = {
    {"cuInit", 2000, 0, (void *)cuInit},
    {"cuDriverGetVersion", 2020, 0, (void *)cuDriverGetVersion},
    {"cuDeviceGet", 2000, 0, (void *)cuDeviceGet},
    {"cuDeviceGetCount", 2000, 0, (void *)cuDeviceGetCount},
    {"cuDeviceGetName", 2000, 0, (void *)cuDeviceGetName},
    {"cuDeviceTotalMem", 3020, 0, (void *)cuDeviceTotalMem_v2},
    {"cuDeviceGetUuid", 9020, 0, (void *)fake_cuDeviceGetUuid_v1},
    {"cuDeviceGetUuid", 11040, 0, (void *)cuDeviceGetUuid_v2},
    {"cuDevicePrimaryCtxRetain", 7000, 0, (void *)cuDevicePrimaryCtxRetain},
    {"cuDevicePrimaryCtxRelease", 11000, 0, (void *)cuDevicePrimaryCtxRelease_v2},
    {"cuCtxSetCurrent", 4000, 0, (void *)cuCtxSetCurrent},
    {"cuCtxGetCurrent", 4000, 0, (void *)cuCtxGetCurrent},
    {"cuCtxGetDevice", 2000, 0, (void *)cuCtxGetDevice},
    {"cuMemGetInfo", 3020, 0, (void *)cuMemGetInfo_v2},
    {"cuMemAlloc", 2000, 0, (void *)fake_cuMemAlloc_v1},
    {"cuMemAlloc", 3020, 0, (void *)cuMemAlloc_v2},
    {"cuMemFree", 3020, 0, (void *)cuMemFree_v2},
    {"cuMemAllocManaged", 6000, 0, (void *)cuMemAllocManaged},
    {"cuMemAllocPitch", 3020, 0, (void *)cuMemAllocPitch_v2},
    {"cuMemAllocAsync", 11020, 0, (void *)cuMemAllocAsync},
    {"cuMemAllocAsync", 11020, 1, (void *)cuMemAllocAsync_ptsz},
    {"cuMemAllocFromPoolAsync", 11020, 0, (void *)cuMemAllocFromPoolAsync},
    {"cuMemAllocFromPoolAsync", 11020, 1, (void *)cuMemAllocFromPoolAsync_ptsz},
    {"cuMemFreeAsync", 11020, 0, (void *)cuMemFreeAsync},
    {"cuMemFreeAsync", 11020, 1, (void *)cuMemFreeAsync_ptsz},
    {"cuMemCreate", 10020, 0, (void *)cuMemCreate},
    {"cuMemRelease", 10020, 0, (void *)cuMemRelease},
    {"cuArrayCreate", 3020, 0, (void *)cuArrayCreate_v2},
    {"cuArray3DCreate", 3020, 0, (void *)cuArray3DCreate_v2},
    {"cuArrayDestroy", 2000, 0, (void *)cuArrayDestroy},
    {"cuMipmappedArrayCreate", 5000, 0, (void *)cuMipmappedArrayCreate},
    {"cuMipmappedArrayDestroy", 5000, 0, (void *)cuMipmappedArrayDestroy},
    {"cuGraphCreate", 10000, 0, (void *)cuGraphCreate},
    {"cuGraphAddMemAllocNode", 11040, 0, (void *)cuGraphAddMemAllocNode},
    {"cuGraphAddNode", 12020, 0, (void *)fake_cuGraphAddNode_v1},
    {"cuGraphAddNode", 12030, 0, (void *)cuGraphAddNode_v2},
    {"cuMemPoolSetAttribute", 11020, 0, (void *)cuMemPoolSetAttribute},
    {"cuGetProcAddress", 11030, 0, (void *)fake_cuGetProcAddress_v1},
    {"cuGetProcAddress", 12000, 0, (void *)cuGetProcAddress_v2},
};

static int has_ptds_variant(const char *symbol) {
    for (size_t i = 0; i < sizeof entry_points / sizeof entry_points[0]; i++)
        if (entry_points[i].ptds && strcmp(entry_points[i].base, symbol) == 0) return 1;
    return 0;
}

/* Newest variant whose version the caller asked for; per-thread variants only on request. */
static const struct entry_point *select_entry(const char *symbol, int version, int ptds, int *known) {
    const struct entry_point *best = NULL;
    int want_ptds = ptds && has_ptds_variant(symbol);
    for (size_t i = 0; i < sizeof entry_points / sizeof entry_points[0]; i++) {
        const struct entry_point *e = &entry_points[i];
        if (strcmp(e->base, symbol) != 0) continue;
        *known = 1;
        if (e->ptds == want_ptds && e->version <= version && (!best || e->version > best->version)) best = e;
    }
    return best;
}

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *status) {
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    int known = 0;
    const struct entry_point *e =
        select_entry(symbol, version, (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0, &known);
    *pfn = e ? e->fn : NULL;
    if (status)
        *status = e ? CU_GET_PROC_ADDRESS_SUCCESS
                    : known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return e ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

CUresult fake_cuGetProcAddress_v1(const char *symbol, void **pfn, int version, cuuint64_t flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}

/* ---- test-only ---- */

int fakeCudaStats(int physical_index, fake_cuda_stats *out) {
    config();
    if (!out || physical_index < 0 || (physical_index >= device_count && physical_index != HOST_SLOT)) return -1;
    struct device *d = &devices[physical_index];
    *out = (fake_cuda_stats){
        .total = device_total,
        .used = used_now(physical_index),
        .peak = atomic_load(&d->peak),
        .allocs = atomic_load(&d->allocs),
        .frees = atomic_load(&d->frees),
        .bad_frees = atomic_load(&bad_frees),
    };
    return 0;
}
