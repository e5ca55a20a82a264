/* A fake libcuda.so.1 for tests without a GPU: FAKE_CUDA_DEVICES devices of
 * FAKE_CUDA_TOTAL_MIB MiB each, real bookkeeping of every allocation (so tests can
 * see what reached the driver), and cuGetProcAddress that selects entry points by
 * base name, requested version and stream flags as the real driver does. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <elf.h>
#include <sys/stat.h>
#include <unistd.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cuda.h>
#include "fake_cuda.h"
#include "fake_ledger.h"

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
    uint64_t ticket; /* the node ledger's handle for this charge (0 in-process) */
    int dev;
    int counted;     /* 1: this process's allocation; 0: an import (another process's memory) */
};

struct shard {
    pthread_mutex_t lock;
    struct handle *buckets[256];
};

static struct device local_devices[MAX_DEVICES + 1]; /* the last one counts host VMM memory */
static struct device *devices = local_devices;
#define HOST_SLOT MAX_DEVICES
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

/* Node mode: the books live in the node's fake-gpu ledger (fake_ledger.h, services/devcluster/fake_gpu_ledger.py), found
 * next to this library, never through the environment; the ledger decides the card's size and charges
 * every byte to this process as the kernel names it. Without a ledger beside the library the GPU is this
 * process's own (the counters above), for tests of one process. */
static int ledger_fd = -1;     /* this process's connection; -1 before it is made (or after a fork) */
static int ledger_mode;        /* 0 in-process, 1 node ledger, -1 a ledger that does not answer */
static int ledger_cuda;        /* the CUDA version the node's driver supports; 0: CUDA_VERSION (in-process) */
static pthread_mutex_t ledger_mutex = PTHREAD_MUTEX_INITIALIZER;

static int ledger_connected(void) {
    if (ledger_fd < 0) ledger_fd = fake_ledger_connect((const void *)fakeCudaStats);
    return ledger_fd >= 0;
}

/* One request to the ledger (reconnecting after a fork: the inherited link is the parent's and the
 * ledger refuses it); CUDA_ERROR_UNKNOWN when the ledger is gone. */
static CUresult ledger_ask(uint32_t op, int dev, uint64_t a, uint64_t b, fake_ledger_reply *out, int send_fd, int *recv_fd) {
    fake_ledger_request req = {.op = op, .dev = dev, .a = a, .b = b};
    pthread_mutex_lock(&ledger_mutex);
    ssize_t n = ledger_connected() ? fake_ledger_call(ledger_fd, &req, out, sizeof *out, send_fd, recv_fd) : -1;
    pthread_mutex_unlock(&ledger_mutex);
    return n < 0 ? CUDA_ERROR_UNKNOWN : (CUresult)out->status;
}

/* A charge the ledger holds for this process; 0 when it refused. */
static uint64_t ledger_charge(uint32_t op, int dev, uint64_t a, uint64_t b, CUresult *rc) {
    fake_ledger_reply r = {0};
    *rc = ledger_ask(op, dev, a, b, &r, -1, NULL);
    return *rc == CUDA_SUCCESS ? r.v[0] : 0;
}

static void ledger_free(uint64_t handle) {
    fake_ledger_reply r;
    if (handle) ledger_ask(FAKE_OP_FREE, 0, handle, 0, &r, -1, NULL);
}

static void forget_after_fork(void);

static void attach_ledger(void) {
    int fd = fake_ledger_connect((const void *)fakeCudaStats);
    if (fd == -1) return;
    ledger_mode = -1;
    if (fd < 0) return;
    ledger_fd = fd;
    fake_ledger_reply r = {0};
    if (ledger_ask(FAKE_OP_HELLO, 0, 0, 0, &r, -1, NULL) != CUDA_SUCCESS || r.v[0] < 1 || r.v[0] > MAX_DEVICES) return;
    device_count = (int)r.v[0];
    device_total = r.v[1];
    ledger_cuda = (int)r.v[4]; /* the node's driver branch decides it (13.0 on R580, 13.4 on R615) */
    ledger_mode = 1;
    pthread_atfork(NULL, NULL, forget_after_fork);
}

/* Device-wide counters: the node ledger's when there is one (v: used, peak, allocs, frees, reserved). */
static int ledger_stats(int dev, uint64_t v[5]) {
    fake_ledger_reply r = {0};
    if (ledger_ask(FAKE_OP_STATS, dev, 0, 0, &r, -1, NULL) != CUDA_SUCCESS) return -1;
    memcpy(v, r.v, sizeof r.v);
    return 0;
}

/* cuMemGetInfo's figures for `dev`: the node ledger's view for this process (on R615, capped to the hard
 * limit of the cgroup it is in), or this process's own books in-process. */
static CUresult memory_view(int dev, size_t *free_bytes, size_t *total_bytes) {
    if (ledger_mode != 1) {
        *total_bytes = device_total;
        *free_bytes = device_total - atomic_load(&devices[dev].used);
        return CUDA_SUCCESS;
    }
    fake_ledger_reply r = {0};
    CUresult rc = ledger_ask(FAKE_OP_MEMINFO, dev, 0, 0, &r, -1, NULL);
    if (rc == CUDA_ERROR_INVALID_VALUE) { /* a ledger older than the operation: the whole device */
        uint64_t v[5];
        *total_bytes = device_total;
        *free_bytes = ledger_stats(dev, v) == 0 ? device_total - (v[0] + v[4]) : 0;
        return CUDA_SUCCESS;
    }
    if (rc != CUDA_SUCCESS) return rc;
    *total_bytes = r.v[0];
    *free_bytes = r.v[1];
    return CUDA_SUCCESS;
}

/* ---- contexts: each charges the node ledger's per-context overhead while it lives ---- */

#define CREATED_CONTEXTS 64
#define CREATED_BASE 0x1000 /* handles of created contexts; primary ones are physical index + 1 */
static pthread_mutex_t ctx_mutex = PTHREAD_MUTEX_INITIALIZER;
static struct { int refs; uint64_t ticket; } primary[MAX_DEVICES];
static struct { int phys; int live; uint64_t ticket; } created[CREATED_CONTEXTS];

/* A fork child owns none of its parent's contexts (the ledger frees them with the parent). */
static void forget_contexts(void) {
    pthread_mutex_init(&ctx_mutex, NULL);
    memset(primary, 0, sizeof primary);
    memset(created, 0, sizeof created);
}

static CUresult context_charge(int phys, uint64_t *ticket) {
    *ticket = 0;
    if (ledger_mode < 0) return CUDA_ERROR_NO_DEVICE;
    if (ledger_mode == 0) return CUDA_SUCCESS;
    CUresult rc;
    *ticket = ledger_charge(FAKE_OP_CONTEXT, phys, 0, 0, &rc);
    return rc;
}

/* The physical index + 1 a context handle stands for; 0 for no context. */
static int context_device(uintptr_t v) {
    if (v >= 1 && v <= MAX_DEVICES) return (int)v;
    if (v >= CREATED_BASE && v < CREATED_BASE + CREATED_CONTEXTS && created[v - CREATED_BASE].live)
        return created[v - CREATED_BASE].phys + 1;
    return 0;
}


static void read_config(void) {
    device_count = (int)env_long("FAKE_CUDA_DEVICES", 1, 1, MAX_DEVICES);
    device_total = (unsigned long long)env_long("FAKE_CUDA_TOTAL_MIB", 15360, 1, 1L << 30) << 20;
    attach_ledger(); /* the node ledger's card wins over the environment's */
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

/* A fork child holds no device memory and needs its own link to the ledger (the inherited one is the
 * parent's, which the ledger refuses from any other process). */
static void forget_after_fork(void) {
    for (int i = 0; i < SHARDS; i++) {
        pthread_mutex_init(&shards[i].lock, NULL);
        memset(shards[i].buckets, 0, sizeof shards[i].buckets);
    }
    pthread_mutex_init(&ledger_mutex, NULL);
    if (ledger_fd >= 0) close(ledger_fd);
    ledger_fd = -1;
    forget_contexts();
}

static struct shard *shard_of(uint64_t key, size_t *bucket) {
    uint64_t h = key * 0x9E3779B97F4A7C15ull;
    *bucket = (h >> 20) & 255;
    return &shards[h >> 58];
}

static void uncharge(int dev, uint64_t bytes, uint64_t ticket) {
    if (ledger_mode == 1)
        ledger_free(ticket);
    else
        atomic_fetch_sub(&devices[dev].used, bytes);
}

/* Record a charge already made (ticket: the ledger's handle, 0 in-process) under `key`. */
static CUresult remember(int dev, uint64_t bytes, uint64_t key, uint64_t ticket, int counted) {
    struct handle *h = malloc(sizeof *h);
    if (!h) {
        if (counted) uncharge(dev, bytes, ticket);
        else ledger_free(ticket);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    size_t b;
    struct shard *s = shard_of(key, &b);
    *h = (struct handle){.key = key, .bytes = bytes, .dev = dev, .ticket = ticket, .counted = counted};
    pthread_mutex_lock(&s->lock);
    h->next = s->buckets[b];
    s->buckets[b] = h;
    pthread_mutex_unlock(&s->lock);
    if (counted) atomic_fetch_add(&devices[dev].allocs, 1);
    return CUDA_SUCCESS;
}

/* `flags`: FAKE_ALLOC_* (managed memory counts on the device, but against no cgroup's limit). */
static CUresult charge(int dev, uint64_t bytes, uint64_t key, uint64_t flags) {
    struct device *d = &devices[dev];
    uint64_t ticket = 0;
    if (ledger_mode == 1) {
        CUresult rc;
        ticket = ledger_charge(FAKE_OP_ALLOC, dev, bytes, flags, &rc);
        if (rc != CUDA_SUCCESS) return rc == CUDA_ERROR_UNKNOWN ? CUDA_ERROR_UNKNOWN : CUDA_ERROR_OUT_OF_MEMORY;
    } else if (ledger_mode < 0) {
        return CUDA_ERROR_NO_DEVICE;
    } else {
        unsigned long long cur = atomic_load(&d->used);
        do {
            if (bytes > device_total - cur) return CUDA_ERROR_OUT_OF_MEMORY;
        } while (!atomic_compare_exchange_weak(&d->used, &cur, cur + bytes));
        unsigned long long peak = atomic_load(&d->peak);
        while (cur + bytes > peak && !atomic_compare_exchange_weak(&d->peak, &peak, cur + bytes)) {
        }
    }
    return remember(dev, bytes, key, ticket, 1);
}

static struct handle *take(uint64_t key) {
    size_t b;
    struct shard *s = shard_of(key, &b);
    pthread_mutex_lock(&s->lock);
    struct handle **link = &s->buckets[b];
    while (*link && (*link)->key != key) link = &(*link)->next;
    struct handle *h = *link;
    if (h) *link = h->next;
    pthread_mutex_unlock(&s->lock);
    return h;
}

static struct handle *find(uint64_t key) {
    size_t b;
    struct shard *s = shard_of(key, &b);
    pthread_mutex_lock(&s->lock);
    struct handle *h = s->buckets[b];
    while (h && h->key != key) h = h->next;
    pthread_mutex_unlock(&s->lock);
    return h;
}

static CUresult release(uint64_t key) {
    struct handle *h = take(key);
    if (!h) {
        atomic_fetch_add(&bad_frees, 1);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (h->counted) {
        uncharge(h->dev, h->bytes, h->ticket);
        atomic_fetch_add(&devices[h->dev].frees, 1);
    } else {
        ledger_free(h->ticket); /* an import: the ledger's charge to this process only */
    }
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

static CUresult alloc_flagged(CUdeviceptr *dptr, size_t bytes, uint64_t flags) {
    int dev;
    CUresult rc = current_device(&dev);
    if (rc != CUDA_SUCCESS) return rc;
    if (!dptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
    uint64_t address = new_address(bytes);
    rc = charge(dev, bytes, address, flags);
    if (rc == CUDA_SUCCESS) *dptr = (CUdeviceptr)address;
    return rc;
}

static CUresult alloc_on_current(CUdeviceptr *dptr, size_t bytes) { return alloc_flagged(dptr, bytes, 0); }

/* ---- device and context ---- */

EXPORT CUresult cuInit(unsigned int flags) {
    config();
    if (ledger_mode < 0) return CUDA_ERROR_NO_DEVICE; /* a ledger beside the library that does not answer */
    return flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuDriverGetVersion(int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    config();
    *version = ledger_cuda ? ledger_cuda : CUDA_VERSION;
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
    int phys = physical(dev);
    if (phys < 0) return CUDA_ERROR_INVALID_DEVICE;
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&ctx_mutex);
    if (primary[phys].refs == 0) rc = context_charge(phys, &primary[phys].ticket);
    if (rc == CUDA_SUCCESS) primary[phys].refs++;
    pthread_mutex_unlock(&ctx_mutex);
    if (rc == CUDA_SUCCESS) *pctx = (CUcontext)(uintptr_t)(phys + 1);
    return rc;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    config();
    int phys = physical(dev);
    if (phys < 0) return CUDA_ERROR_INVALID_DEVICE;
    uint64_t gone = 0;
    pthread_mutex_lock(&ctx_mutex);
    if (primary[phys].refs > 0 && --primary[phys].refs == 0) gone = primary[phys].ticket;
    pthread_mutex_unlock(&ctx_mutex);
    ledger_free(gone);
    return CUDA_SUCCESS;
}

/* cuCtxCreate (every ABI): a context of its own on `dev`, made current, with its own overhead. */
static CUresult create_context(CUcontext *pctx, CUdevice dev) {
    config();
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    int phys = physical(dev);
    if (phys < 0) return CUDA_ERROR_INVALID_DEVICE;
    uint64_t ticket;
    CUresult rc = context_charge(phys, &ticket);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&ctx_mutex);
    int slot = 0;
    while (slot < CREATED_CONTEXTS && created[slot].live) slot++;
    if (slot < CREATED_CONTEXTS) created[slot].phys = phys, created[slot].live = 1, created[slot].ticket = ticket;
    pthread_mutex_unlock(&ctx_mutex);
    if (slot == CREATED_CONTEXTS) {
        ledger_free(ticket);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *pctx = (CUcontext)(uintptr_t)(CREATED_BASE + slot);
    current_ctx = phys + 1;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags, CUdevice dev) {
    (void)params, (void)flags;
    return create_context(pctx, dev);
}

CUresult fake_cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) __asm__("cuCtxCreate_v2") EXPORT;
CUresult fake_cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    (void)flags;
    return create_context(pctx, dev);
}

EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) {
    uintptr_t v = (uintptr_t)ctx;
    if (v < CREATED_BASE || v >= CREATED_BASE + CREATED_CONTEXTS) return CUDA_ERROR_INVALID_CONTEXT;
    uint64_t gone = 0;
    int was = 0;
    pthread_mutex_lock(&ctx_mutex);
    if (created[v - CREATED_BASE].live) {
        was = created[v - CREATED_BASE].phys + 1;
        gone = created[v - CREATED_BASE].ticket;
        created[v - CREATED_BASE].live = 0;
    }
    pthread_mutex_unlock(&ctx_mutex);
    if (!was) return CUDA_ERROR_INVALID_CONTEXT;
    ledger_free(gone);
    if (current_ctx == was) current_ctx = 0;
    return CUDA_SUCCESS;
}

/* ---- what a context spends outside cuMemAlloc: limits, modules ---- */

/* Each limit as last set, plus one (0: never set, the default holds). */
static _Atomic size_t limit_values[MAX_DEVICES][3];

static size_t limit_default(CUlimit limit) {
    return limit == CU_LIMIT_STACK_SIZE ? 1024 : limit == CU_LIMIT_PRINTF_FIFO_SIZE ? 1u << 20 : 8u << 20;
}

/* The ledger charges the limit's device footprint (the stack for every resident thread); refused, the
 * old value stays, as the real driver answers CUDA_ERROR_OUT_OF_MEMORY. */
EXPORT CUresult cuCtxSetLimit(CUlimit limit, size_t value) {
    int dev;
    CUresult rc = current_device(&dev);
    if (rc != CUDA_SUCCESS) return rc;
    if (limit != CU_LIMIT_STACK_SIZE && limit != CU_LIMIT_PRINTF_FIFO_SIZE && limit != CU_LIMIT_MALLOC_HEAP_SIZE)
        return CUDA_ERROR_UNSUPPORTED_LIMIT;
    if (ledger_mode == 1) {
        fake_ledger_reply r = {0};
        rc = ledger_ask(FAKE_OP_LIMIT, dev, (uint64_t)limit, value, &r, -1, NULL);
        if (rc != CUDA_SUCCESS) return rc;
    }
    atomic_store(&limit_values[dev][limit], value + 1);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetLimit(size_t *value, CUlimit limit) {
    int dev;
    CUresult rc = current_device(&dev);
    if (rc != CUDA_SUCCESS) return rc;
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    if (limit != CU_LIMIT_STACK_SIZE && limit != CU_LIMIT_PRINTF_FIFO_SIZE && limit != CU_LIMIT_MALLOC_HEAP_SIZE)
        return CUDA_ERROR_UNSUPPORTED_LIMIT;
    size_t set = atomic_load(&limit_values[dev][limit]);
    *value = set ? set - 1 : limit_default(limit);
    return CUDA_SUCCESS;
}

/* Device bytes a module image takes: an ELF cubin's allocated sections (its globals, .nv.global
 * included though the file holds no bytes for it), a fatbinary's size, else PTX text's. */
static uint64_t module_bytes(const void *image) {
    const unsigned char *p = image;
    if (!memcmp(p, ELFMAG, SELFMAG) && p[EI_CLASS] == ELFCLASS64) {
        const Elf64_Ehdr *eh = image;
        const Elf64_Shdr *sh = (const Elf64_Shdr *)(p + eh->e_shoff);
        uint64_t sum = 0;
        for (unsigned i = 0; eh->e_shoff && eh->e_shentsize == sizeof *sh && i < eh->e_shnum; i++)
            if (sh[i].sh_flags & SHF_ALLOC) sum += sh[i].sh_size;
        return sum ? sum : 1;
    }
    uint32_t magic;
    memcpy(&magic, p, sizeof magic);
    if (magic == 0xBA55ED50u) { /* fatbinary header: magic, version, header size, fat size */
        uint16_t header;
        uint64_t fat;
        memcpy(&header, p + 6, sizeof header);
        memcpy(&fat, p + 8, sizeof fat);
        return header + fat;
    }
    return strnlen(image, 1u << 30) + 1;
}

/* A module or library: charged on `dev` as reserved memory until unloaded; its handle is the key. */
static CUresult load_image(void **handle, const void *image, int dev) {
    if (!handle || !image) return CUDA_ERROR_INVALID_VALUE;
    if (ledger_mode < 0) return CUDA_ERROR_NO_DEVICE;
    uint64_t bytes = module_bytes(image), ticket = 0;
    if (ledger_mode == 1) {
        CUresult rc;
        ticket = ledger_charge(FAKE_OP_MODULE, dev, bytes, 0, &rc);
        if (rc != CUDA_SUCCESS) return rc;
    }
    uint64_t key = new_address(1);
    CUresult rc = remember(dev, bytes, key, ticket, 0);
    if (rc == CUDA_SUCCESS) *handle = (void *)(uintptr_t)key;
    return rc;
}

EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    int dev;
    CUresult rc = current_device(&dev);
    return rc != CUDA_SUCCESS ? rc : load_image((void **)module, image, dev);
}

EXPORT CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int n, CUjit_option *options,
                                   void **values) {
    (void)n, (void)options, (void)values;
    return cuModuleLoadData(module, image);
}

EXPORT CUresult cuModuleUnload(CUmodule module) {
    return release((uintptr_t)module) == CUDA_SUCCESS ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* A library is context-independent: charged to the current context's device, else the first visible. */
EXPORT CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jit_options, void **jit_values,
                                  unsigned int jit_count, CUlibraryOption *options, void **values, unsigned int count) {
    (void)jit_options, (void)jit_values, (void)jit_count, (void)options, (void)values, (void)count;
    config();
    int dev = current_ctx ? current_ctx - 1 : visible_count ? visible[0] : -1;
    return dev < 0 ? CUDA_ERROR_NO_DEVICE : load_image((void **)library, code, dev);
}

EXPORT CUresult cuLibraryUnload(CUlibrary library) {
    return release((uintptr_t)library) == CUDA_SUCCESS ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* ---- imports: another process's memory, charged to the importer by the ledger ---- */

static const char ipc_magic[8] = "FAKEIPC";

static CUresult export_of(uint64_t key, uint64_t token[2], int *fd) {
    if (ledger_mode != 1) return CUDA_ERROR_NOT_SUPPORTED;
    struct handle *h = find(key);
    if (!h || !h->counted) return CUDA_ERROR_INVALID_VALUE;
    fake_ledger_reply r = {0};
    CUresult rc = ledger_ask(FAKE_OP_EXPORT, 0, h->ticket, 0, &r, -1, fd);
    token[0] = r.v[0], token[1] = r.v[1];
    return rc;
}

static CUresult import(uint32_t op, uint64_t a, uint64_t b, int fd, uint64_t *key) {
    if (ledger_mode != 1) return CUDA_ERROR_NOT_SUPPORTED;
    fake_ledger_reply r = {0};
    CUresult rc = ledger_ask(op, 0, a, b, &r, fd, NULL);
    if (rc != CUDA_SUCCESS) return rc;
    *key = new_address(r.v[1]);
    return remember((int)r.v[2], r.v[1], *key, r.v[0], 0);
}

EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr dptr) {
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    uint64_t token[2];
    int fd = -1;
    CUresult rc = export_of(dptr, token, &fd);
    if (fd >= 0) close(fd); /* the token names the export; the fd is for shareable handles */
    if (rc != CUDA_SUCCESS) return rc;
    memset(handle, 0, sizeof *handle);
    memcpy(handle->reserved, ipc_magic, sizeof ipc_magic);
    memcpy(handle->reserved + 8, token, sizeof token);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int flags) {
    (void)flags;
    if (!pdptr || memcmp(handle.reserved, ipc_magic, sizeof ipc_magic)) return CUDA_ERROR_INVALID_VALUE;
    uint64_t token[2], key;
    memcpy(token, handle.reserved + 8, sizeof token);
    CUresult rc = import(FAKE_OP_IMPORT_TOKEN, token[0], token[1], -1, &key);
    if (rc == CUDA_SUCCESS) *pdptr = (CUdeviceptr)key;
    return rc;
}

EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr dptr) {
    struct handle *h = find(dptr);
    if (!h || h->counted) return CUDA_ERROR_INVALID_VALUE; /* not an import */
    return release(dptr);
}

EXPORT CUresult cuMemExportToShareableHandle(void *shareable, CUmemGenericAllocationHandle handle,
                                             CUmemAllocationHandleType type, unsigned long long flags) {
    if (!shareable || flags || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_INVALID_VALUE;
    uint64_t token[2];
    int fd = -1;
    CUresult rc = export_of(handle, token, &fd);
    if (rc == CUDA_SUCCESS && fd < 0) rc = CUDA_ERROR_UNKNOWN;
    if (rc != CUDA_SUCCESS) {
        if (fd >= 0) close(fd);
        return rc;
    }
    *(int *)shareable = fd;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *os_handle,
                                               CUmemAllocationHandleType type) {
    if (!handle || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_INVALID_VALUE;
    uint64_t key;
    CUresult rc = import(FAKE_OP_IMPORT_FD, 0, 0, (int)(intptr_t)os_handle, &key);
    if (rc == CUDA_SUCCESS) *handle = key;
    return rc;
}

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    uintptr_t v = (uintptr_t)ctx;
    int dev = context_device(v);
    if (v && !dev) return CUDA_ERROR_INVALID_CONTEXT;
    current_ctx = dev;
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
    return memory_view(dev, free_bytes, total_bytes);
}

/* ---- allocation ---- */

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) { return alloc_on_current(dptr, bytesize); }

CUresult fake_cuMemAlloc_v1(unsigned int *dptr, unsigned int bytesize) {
    int dev;
    CUresult rc = current_device(&dev);
    if (rc != CUDA_SUCCESS) return rc;
    if (!dptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    uint32_t address = atomic_fetch_add(&next_address_v1, (bytesize + 511u) & ~511u);
    rc = charge(dev, bytesize, address, 0);
    if (rc == CUDA_SUCCESS) *dptr = address;
    return rc;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) { return dptr ? release(dptr) : CUDA_SUCCESS; }

/* Charged to the device like any allocation, but, as on R615, against no cgroup's limit: NVIDIA tracks managed memory in
 * system memory only, so a capped cgroup's cuMemAllocManaged neither fails at its limit nor counts toward it. */
EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    (void)flags;
    return alloc_flagged(dptr, bytesize, FAKE_ALLOC_MANAGED);
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
    CUresult rc = charge(dev, size, key, 0);
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
    rc = charge(dev, bytes, key, 0);
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

/* ---- what CUDA clients (numba-cuda, cuda.core, the runtime) ask on their normal paths ----
 * Attributes of a T4-class card (sm_75), the same for every device except its identity; a
 * per-thread context stack over the primary contexts; streams that complete at once (the fake
 * runs no work); copies and sets succeed without data (the fake's memory has no backing). */

static int attribute_value(CUdevice_attribute attr, int phys) {
    switch (attr) {
        case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: return 1024;
        case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: return 1024;
        case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: return 1024;
        case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: return 64;
        case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: return 2147483647;
        case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: return 65535;
        case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: return 65535;
        case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: return 49152;
        case CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY: return 65536;
        case CU_DEVICE_ATTRIBUTE_WARP_SIZE: return 32;
        case CU_DEVICE_ATTRIBUTE_MAX_PITCH: return 2147483647;
        case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: return 65536;
        case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: return 1590000;
        case CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT: return 512;
        case CU_DEVICE_ATTRIBUTE_GPU_OVERLAP: return 1;
        case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: return 40;
        case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: return 1;
        case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS: return 1;
        case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: return 0x3b + phys;
        case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: return 5001000;
        case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: return 256;
        case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: return 4194304;
        case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: return 1024;
        case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: return 3;
        case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: return 1;
        case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: return 7;
        case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: return 5;
        case CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED: return 1;
        case CU_DEVICE_ATTRIBUTE_GLOBAL_L1_CACHE_SUPPORTED: return 1;
        case CU_DEVICE_ATTRIBUTE_LOCAL_L1_CACHE_SUPPORTED: return 1;
        case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: return 65536;
        case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR: return 65536;
        case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY: return 1;
        case CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD_GROUP_ID: return phys;
        case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS: return 1;
        case CU_DEVICE_ATTRIBUTE_COMPUTE_PREEMPTION_SUPPORTED: return 1;
        case CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH: return 1;
        case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: return 65536;
        case CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR: return 16;
        case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: return 1;
        case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: return 1;
        case CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES: return CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        default: return 0; /* a capability this card does not have */
    }
}

EXPORT CUresult cuDeviceGetAttribute(int *value, CUdevice_attribute attr, CUdevice dev) {
    config();
    if (!value || attr <= 0 || attr >= CU_DEVICE_ATTRIBUTE_MAX) return CUDA_ERROR_INVALID_VALUE;
    int phys = physical(dev);
    if (phys < 0) return CUDA_ERROR_INVALID_DEVICE;
    *value = attribute_value(attr, phys);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetPCIBusId(char *bus_id, int len, CUdevice dev) {
    config();
    int phys = physical(dev);
    if (!bus_id || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (phys < 0) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(bus_id, (size_t)len, "0000:%02X:00.0", 0x3b + phys); /* as the fake NVML's busIdLegacy */
    return CUDA_SUCCESS;
}

CUresult fake_cuDeviceTotalMem_v1(unsigned int *bytes, CUdevice dev) __asm__("cuDeviceTotalMem") EXPORT;
CUresult fake_cuDeviceTotalMem_v1(unsigned int *bytes, CUdevice dev) {
    size_t total;
    CUresult rc = cuDeviceTotalMem_v2(bytes ? &total : NULL, dev);
    if (rc == CUDA_SUCCESS) *bytes = total > UINT32_MAX ? UINT32_MAX : (unsigned int)total;
    return rc;
}

CUresult fake_cuMemGetInfo_v1(unsigned int *free_bytes, unsigned int *total_bytes) __asm__("cuMemGetInfo") EXPORT;
CUresult fake_cuMemGetInfo_v1(unsigned int *free_bytes, unsigned int *total_bytes) {
    size_t f, t;
    CUresult rc = cuMemGetInfo_v2(free_bytes ? &f : NULL, total_bytes ? &t : NULL);
    if (rc != CUDA_SUCCESS) return rc;
    *free_bytes = f > UINT32_MAX ? UINT32_MAX : (unsigned int)f;
    *total_bytes = t > UINT32_MAX ? UINT32_MAX : (unsigned int)t;
    return rc;
}

CUresult fake_cuDevicePrimaryCtxRelease_v1(CUdevice dev) __asm__("cuDevicePrimaryCtxRelease") EXPORT;
CUresult fake_cuDevicePrimaryCtxRelease_v1(CUdevice dev) { return cuDevicePrimaryCtxRelease_v2(dev); }

EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
    config();
    if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
    if (physical(dev) < 0) return CUDA_ERROR_INVALID_DEVICE;
    *flags = 0;
    *active = 1;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags) {
    (void)flags;
    config();
    return physical(dev) < 0 ? CUDA_ERROR_INVALID_DEVICE : CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) { return cuDevicePrimaryCtxSetFlags_v2(dev, 0); }

/* A context stack per thread, whose top is the current context, as the driver keeps it. */
static __thread int ctx_stack[32];
static __thread int ctx_depth;

EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    int dev = context_device((uintptr_t)ctx);
    if (!dev) return CUDA_ERROR_INVALID_CONTEXT;
    if (ctx_depth >= (int)(sizeof ctx_stack / sizeof ctx_stack[0])) return CUDA_ERROR_OUT_OF_MEMORY;
    ctx_stack[ctx_depth++] = current_ctx;
    current_ctx = dev;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pctx) {
    if (!current_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    if (pctx) *pctx = (CUcontext)(uintptr_t)current_ctx;
    current_ctx = ctx_depth > 0 ? ctx_stack[--ctx_depth] : 0;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    if (!ctx && !current_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    *version = 13000;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetFlags(unsigned int *flags) {
    if (!flags) return CUDA_ERROR_INVALID_VALUE;
    if (!current_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    *flags = 0;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSynchronize(void) { return current_ctx ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT; }

EXPORT CUresult cuCtxGetId(CUcontext ctx, unsigned long long *id) {
    uintptr_t v = ctx ? (uintptr_t)ctx : (uintptr_t)current_ctx;
    if (!id) return CUDA_ERROR_INVALID_VALUE;
    if (v == 0 || v > MAX_DEVICES) return CUDA_ERROR_INVALID_CONTEXT;
    *id = v;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamCreate(CUstream *stream, unsigned int flags) {
    (void)flags;
    if (!stream) return CUDA_ERROR_INVALID_VALUE;
    if (!current_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    *stream = (CUstream)(uintptr_t)new_address(1);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamCreateWithPriority(CUstream *stream, unsigned int flags, int priority) {
    (void)priority;
    return cuStreamCreate(stream, flags);
}

EXPORT CUresult cuStreamDestroy_v2(CUstream stream) { return stream ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE; }
EXPORT CUresult cuStreamSynchronize(CUstream stream) {
    (void)stream;
    return current_ctx ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}
EXPORT CUresult cuStreamQuery(CUstream stream) { return cuStreamSynchronize(stream); }

EXPORT CUresult cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus *status) {
    (void)stream;
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    *status = CU_STREAM_CAPTURE_STATUS_NONE; /* the fake never captures */
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest) {
    if (least) *least = 0;
    if (greatest) *greatest = -5;
    return CUDA_SUCCESS;
}

/* Release thresholds of the pools whose handles are small (the default pools, 1..16). */
static _Atomic cuuint64_t pool_thresholds[MAX_DEVICES + 1];

/* The default pool of a device: a handle naming it, attributes as an untouched pool has them. */
EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev) {
    config();
    if (!pool) return CUDA_ERROR_INVALID_VALUE;
    int phys = physical(dev);
    if (phys < 0) return CUDA_ERROR_INVALID_DEVICE;
    *pool = (CUmemoryPool)(uintptr_t)(phys + 1);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) { return cuDeviceGetDefaultMemPool(pool, dev); }

EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value) {
    if (!pool || !value) return CUDA_ERROR_INVALID_VALUE;
    switch (attr) {
        case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: *(int *)value = 1; return CUDA_SUCCESS;
        case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
            *(cuuint64_t *)value = (uintptr_t)pool <= MAX_DEVICES ? atomic_load(&pool_thresholds[(uintptr_t)pool]) : 0;
            return CUDA_SUCCESS;
        case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT:
        case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
        case CU_MEMPOOL_ATTR_USED_MEM_CURRENT:
        case CU_MEMPOOL_ATTR_USED_MEM_HIGH: *(cuuint64_t *)value = 0; return CUDA_SUCCESS;
        default: return CUDA_ERROR_INVALID_VALUE;
    }
}

EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, size_t n) {
    (void)dst, (void)value, (void)n;
    return current_ctx ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    (void)dst, (void)src, (void)n;
    return current_ctx ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    (void)src;
    if (!current_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    if (dst) memset(dst, 0, n); /* no backing: device memory reads as zeros */
    return CUDA_SUCCESS;
}

struct error_name {
    CUresult code;
    const char *name, *text;
};

static const struct error_name error_names[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
};

static const struct error_name *error_of(CUresult code) {
    for (size_t i = 0; i < sizeof error_names / sizeof error_names[0]; i++)
        if (error_names[i].code == code) return &error_names[i];
    return NULL;
}

EXPORT CUresult cuGetErrorName(CUresult code, const char **name) {
    const struct error_name *e = error_of(code);
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    *name = e ? e->name : NULL;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorString(CUresult code, const char **text) {
    const struct error_name *e = error_of(code);
    if (!text) return CUDA_ERROR_INVALID_VALUE;
    *text = e ? e->text : NULL;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
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
    if (!pool || !value) return CUDA_ERROR_INVALID_VALUE;
    if (attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD && (uintptr_t)pool <= MAX_DEVICES)
        atomic_store(&pool_thresholds[(uintptr_t)pool], *(cuuint64_t *)value);
    return CUDA_SUCCESS;
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
    {"cuDevicePrimaryCtxRelease", 7000, 0, (void *)fake_cuDevicePrimaryCtxRelease_v1},
    {"cuDevicePrimaryCtxRelease", 11000, 0, (void *)cuDevicePrimaryCtxRelease_v2},
    {"cuDevicePrimaryCtxGetState", 7000, 0, (void *)cuDevicePrimaryCtxGetState},
    {"cuDevicePrimaryCtxSetFlags", 11000, 0, (void *)cuDevicePrimaryCtxSetFlags_v2},
    {"cuDevicePrimaryCtxReset", 11000, 0, (void *)cuDevicePrimaryCtxReset_v2},
    {"cuDeviceGetAttribute", 2000, 0, (void *)cuDeviceGetAttribute},
    {"cuDeviceGetPCIBusId", 4010, 0, (void *)cuDeviceGetPCIBusId},
    {"cuDeviceGetDefaultMemPool", 11020, 0, (void *)cuDeviceGetDefaultMemPool},
    {"cuDeviceGetMemPool", 11020, 0, (void *)cuDeviceGetMemPool},
    {"cuCtxPushCurrent", 4000, 0, (void *)cuCtxPushCurrent_v2},
    {"cuCtxPopCurrent", 4000, 0, (void *)cuCtxPopCurrent_v2},
    {"cuCtxGetApiVersion", 3020, 0, (void *)cuCtxGetApiVersion},
    {"cuCtxGetFlags", 7000, 0, (void *)cuCtxGetFlags},
    {"cuCtxSynchronize", 2000, 0, (void *)cuCtxSynchronize},
    {"cuCtxGetId", 12000, 0, (void *)cuCtxGetId},
    {"cuCtxGetStreamPriorityRange", 5050, 0, (void *)cuCtxGetStreamPriorityRange},
    {"cuStreamCreate", 2000, 0, (void *)cuStreamCreate},
    {"cuStreamCreateWithPriority", 5050, 0, (void *)cuStreamCreateWithPriority},
    {"cuStreamDestroy", 4000, 0, (void *)cuStreamDestroy_v2},
    {"cuStreamSynchronize", 2000, 0, (void *)cuStreamSynchronize},
    {"cuStreamSynchronize", 7000, 1, (void *)cuStreamSynchronize},
    {"cuStreamQuery", 2000, 0, (void *)cuStreamQuery},
    {"cuStreamQuery", 7000, 1, (void *)cuStreamQuery},
    {"cuStreamIsCapturing", 10000, 0, (void *)cuStreamIsCapturing},
    {"cuStreamIsCapturing", 10000, 1, (void *)cuStreamIsCapturing},
    {"cuMemPoolGetAttribute", 11020, 0, (void *)cuMemPoolGetAttribute},
    {"cuMemsetD8", 3020, 0, (void *)cuMemsetD8_v2},
    {"cuMemsetD8", 7000, 1, (void *)cuMemsetD8_v2},
    {"cuMemcpyHtoD", 3020, 0, (void *)cuMemcpyHtoD_v2},
    {"cuMemcpyHtoD", 7000, 1, (void *)cuMemcpyHtoD_v2},
    {"cuMemcpyDtoH", 3020, 0, (void *)cuMemcpyDtoH_v2},
    {"cuMemcpyDtoH", 7000, 1, (void *)cuMemcpyDtoH_v2},
    {"cuGetErrorName", 6000, 0, (void *)cuGetErrorName},
    {"cuGetErrorString", 6000, 0, (void *)cuGetErrorString},
    {"cuMemGetInfo", 2000, 0, (void *)fake_cuMemGetInfo_v1},
    {"cuDeviceTotalMem", 2000, 0, (void *)fake_cuDeviceTotalMem_v1},
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
    {"cuCtxCreate", 3020, 0, (void *)fake_cuCtxCreate_v2},
    {"cuCtxCreate", 12050, 0, (void *)cuCtxCreate_v4},
    {"cuCtxDestroy", 4000, 0, (void *)cuCtxDestroy_v2},
    {"cuCtxSetLimit", 3010, 0, (void *)cuCtxSetLimit},
    {"cuCtxGetLimit", 3010, 0, (void *)cuCtxGetLimit},
    {"cuModuleLoadData", 2000, 0, (void *)cuModuleLoadData},
    {"cuModuleLoadDataEx", 2010, 0, (void *)cuModuleLoadDataEx},
    {"cuModuleUnload", 2000, 0, (void *)cuModuleUnload},
    {"cuLibraryLoadData", 12000, 0, (void *)cuLibraryLoadData},
    {"cuLibraryUnload", 12000, 0, (void *)cuLibraryUnload},
    {"cuIpcGetMemHandle", 4010, 0, (void *)cuIpcGetMemHandle},
    {"cuIpcOpenMemHandle", 11000, 0, (void *)cuIpcOpenMemHandle_v2},
    {"cuIpcCloseMemHandle", 4010, 0, (void *)cuIpcCloseMemHandle},
    {"cuMemExportToShareableHandle", 10020, 0, (void *)cuMemExportToShareableHandle},
    {"cuMemImportFromShareableHandle", 10020, 0, (void *)cuMemImportFromShareableHandle},
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
    uint64_t v[5] = {atomic_load(&d->used), atomic_load(&d->peak), atomic_load(&d->allocs), atomic_load(&d->frees), 0};
    if (ledger_mode < 0 || (ledger_mode == 1 && ledger_stats(physical_index, v) != 0)) return -1;
    *out = (fake_cuda_stats){
        .total = device_total,
        .used = v[0],
        .peak = v[1],
        .allocs = v[2],
        .frees = v[3],
        .bad_frees = atomic_load(&bad_frees),
        .reserved = v[4],
    };
    return 0;
}
