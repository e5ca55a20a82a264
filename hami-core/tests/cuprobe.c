/* Test driver program: runs a script of CUDA driver calls given on the command line and
 * prints one line per observation, so pytest can check what the library and the fake
 * driver really did. --path selects how functions are found: linked symbols, dlsym on
 * the libcuda handle, or cuGetProcAddress_v2 (the CUDA 12/13 runtime's way). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <cuda.h>
#include "fake_cuda.h"
#include "shm_layout.h"

CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream);
typedef CUresult (*legacy_alloc_fn)(unsigned int *dptr, unsigned int bytes);

struct api {
    __typeof__(cuInit) *init;
    __typeof__(cuDevicePrimaryCtxRetain) *retain;
    __typeof__(cuCtxSetCurrent) *set_current;
    __typeof__(cuMemAlloc_v2) *alloc;
    __typeof__(cuMemFree_v2) *free;
    __typeof__(cuMemAllocManaged) *managed;
    __typeof__(cuMemAllocPitch_v2) *pitch;
    __typeof__(cuMemAllocAsync) *alloc_async;
    __typeof__(cuMemAllocFromPoolAsync) *alloc_pool;
    __typeof__(cuMemFreeAsync) *free_async;
    __typeof__(cuMemCreate) *create;
    __typeof__(cuMemRelease) *release;
    __typeof__(cuArrayCreate_v2) *array;
    __typeof__(cuArray3DCreate_v2) *array3d;
    __typeof__(cuArrayDestroy) *array_destroy;
    __typeof__(cuMipmappedArrayCreate) *mipmap;
    __typeof__(cuMipmappedArrayDestroy) *mipmap_destroy;
    __typeof__(cuMemGetInfo_v2) *info;
    __typeof__(cuDeviceTotalMem_v2) *total_mem;
    __typeof__(cuGetProcAddress_v2) *getproc;
    __typeof__(cuGraphCreate) *graph_create;
    __typeof__(cuGraphAddMemAllocNode) *graph_alloc;
    __typeof__(cuGraphAddNode_v2) *graph_add_node;
    __typeof__(cuMemPoolSetAttribute) *pool_set;
    __typeof__(cuMemPoolGetAttribute) *pool_get;
};

enum kind { K_NONE, K_PTR, K_ASYNC, K_VMM, K_ARRAY, K_MIPMAP };
struct slot {
    enum kind kind;
    unsigned long long value;
};

static struct api api;
static struct slot slots[4096];
static int nslots;
static char path_arg[64] = "--path=link";
static void *cuda;

static void link_api(void) {
    api = (struct api){cuInit, cuDevicePrimaryCtxRetain, cuCtxSetCurrent, cuMemAlloc_v2, cuMemFree_v2,
                       cuMemAllocManaged, cuMemAllocPitch_v2, cuMemAllocAsync, cuMemAllocFromPoolAsync,
                       cuMemFreeAsync, cuMemCreate, cuMemRelease, cuArrayCreate_v2, cuArray3DCreate_v2,
                       cuArrayDestroy, cuMipmappedArrayCreate, cuMipmappedArrayDestroy, cuMemGetInfo_v2,
                       cuDeviceTotalMem_v2, cuGetProcAddress_v2, cuGraphCreate, cuGraphAddMemAllocNode,
                       cuGraphAddNode_v2, cuMemPoolSetAttribute, cuMemPoolGetAttribute};
}

#define LOOKUP(field, name) api.field = (__typeof__(api.field))find(name)

static void *dlsym_find(const char *name) { return dlsym(cuda, name); }

static int proc_version = 13000;
static cuuint64_t proc_flags = CU_GET_PROC_ADDRESS_LEGACY_STREAM;
static void *procaddr_find(const char *versioned) {
    char base[128];
    snprintf(base, sizeof base, "%s", versioned);
    char *suffix = strstr(base, "_v2");
    if (suffix && suffix[3] == '\0') *suffix = '\0';
    void *fn = NULL;
    if (api.getproc(base, &fn, proc_version, proc_flags, NULL) != CUDA_SUCCESS) return NULL;
    return fn;
}

static void lookup_api(void *(*find)(const char *)) {
    LOOKUP(init, "cuInit");
    LOOKUP(retain, "cuDevicePrimaryCtxRetain");
    LOOKUP(set_current, "cuCtxSetCurrent");
    LOOKUP(alloc, "cuMemAlloc_v2");
    LOOKUP(free, "cuMemFree_v2");
    LOOKUP(managed, "cuMemAllocManaged");
    LOOKUP(pitch, "cuMemAllocPitch_v2");
    LOOKUP(alloc_async, "cuMemAllocAsync");
    LOOKUP(alloc_pool, "cuMemAllocFromPoolAsync");
    LOOKUP(free_async, "cuMemFreeAsync");
    LOOKUP(create, "cuMemCreate");
    LOOKUP(release, "cuMemRelease");
    LOOKUP(array, "cuArrayCreate_v2");
    LOOKUP(array3d, "cuArray3DCreate_v2");
    LOOKUP(array_destroy, "cuArrayDestroy");
    LOOKUP(mipmap, "cuMipmappedArrayCreate");
    LOOKUP(mipmap_destroy, "cuMipmappedArrayDestroy");
    LOOKUP(info, "cuMemGetInfo_v2");
    LOOKUP(total_mem, "cuDeviceTotalMem_v2");
    LOOKUP(graph_create, "cuGraphCreate");
    LOOKUP(graph_alloc, "cuGraphAddMemAllocNode");
    LOOKUP(graph_add_node, "cuGraphAddNode_v2");
    LOOKUP(pool_set, "cuMemPoolSetAttribute");
    LOOKUP(pool_get, "cuMemPoolGetAttribute");
}

static int setup_api(const char *path) {
    if (strcmp(path, "link") == 0) {
        link_api();
        return 0;
    }
    /* dlmopen: a second copy of the driver in a namespace of its own, where no preload applies. */
    cuda = strcmp(path, "dlmopen") == 0 ? dlmopen(LM_ID_NEWLM, "libcuda.so.1", RTLD_NOW) : dlopen("libcuda.so.1", RTLD_NOW);
    if (!cuda) return -1;
    api.getproc = (__typeof__(api.getproc))dlsym(cuda, "cuGetProcAddress_v2");
    if (strcmp(path, "dlsym") == 0 || strcmp(path, "dlmopen") == 0) {
        lookup_api(dlsym_find);
        return 0;
    }
    if (strcmp(path, "procaddr") == 0 && api.getproc) {
        lookup_api(procaddr_find);
        return 0;
    }
    return -1;
}

static unsigned long long num(const char *s) { return strtoull(s, NULL, 0); }

static int remember(CUresult rc, enum kind kind, unsigned long long value) {
    if (rc != CUDA_SUCCESS || nslots >= (int)(sizeof slots / sizeof slots[0])) return -1;
    slots[nslots] = (struct slot){kind, value};
    return nslots++;
}

static void report_alloc(const char *what, unsigned long long size, CUresult rc, enum kind kind,
                         unsigned long long value) {
    int id = remember(rc, kind, value);
    printf("%s %llu rc=%d id=%d\n", what, size, (int)rc, id);
}

static CUresult release_slot(int id) {
    if (id < 0 || id >= nslots || slots[id].kind == K_NONE) return CUDA_ERROR_INVALID_VALUE;
    struct slot s = slots[id];
    slots[id].kind = K_NONE;
    switch (s.kind) {
        case K_PTR: return api.free((CUdeviceptr)s.value);
        case K_ASYNC: return api.free_async((CUdeviceptr)s.value, NULL);
        case K_VMM: return api.release(s.value);
        case K_ARRAY: return api.array_destroy((CUarray)(uintptr_t)s.value);
        case K_MIPMAP: return api.mipmap_destroy((CUmipmappedArray)(uintptr_t)s.value);
        default: return CUDA_ERROR_INVALID_VALUE;
    }
}

static CUresult make_current(int dev) {
    CUcontext ctx;
    CUresult rc = api.retain(&ctx, dev);
    return rc == CUDA_SUCCESS ? api.set_current(ctx) : rc;
}

static void print_fake(int dev) {
    fake_cuda_stats_fn stats = (fake_cuda_stats_fn)dlsym(RTLD_DEFAULT, FAKE_CUDA_STATS_SYMBOL);
    fake_cuda_stats s;
    if (!stats || stats(dev, &s) != 0) {
        printf("fake %d unavailable\n", dev);
        return;
    }
    printf("fake %d used=%llu peak=%llu allocs=%llu frees=%llu bad_frees=%llu total=%llu reserved=%llu\n", dev, s.used,
           s.peak, s.allocs, s.frees, s.bad_frees, s.total, s.reserved);
}

static void print_procaddr(const char *name, int version, cuuint64_t flags) {
    void *fn = NULL;
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult rc = api.getproc(name, &fn, version, flags, &status);
    Dl_info info = {0};
    const char *obj = "none", *sym = "none";
    if (fn && dladdr(fn, &info)) {
        obj = info.dli_fname ? strrchr(info.dli_fname, '/') ? strrchr(info.dli_fname, '/') + 1 : info.dli_fname
                             : "?";
        sym = info.dli_sname ? info.dli_sname : "?";
    }
    printf("procaddr %s %d rc=%d status=%d obj=%s sym=%s\n", name, version, (int)rc, (int)status, obj, sym);
}

static pthread_barrier_t race_start;

struct race_args {
    int iters;
    unsigned long long size;
    unsigned seed;
    int ok, oom, other;
};

static void *race_thread(void *p) {
    struct race_args *a = p;
    CUdeviceptr live[4];
    int nlive = 0;
    if (make_current(0) != CUDA_SUCCESS) a->other++;
    /* Everyone first tries to hold 4 at once, so demand surely exceeds the limit. */
    for (; nlive < 4; nlive++) {
        CUresult rc = api.alloc(&live[nlive], a->size);
        if (rc != CUDA_SUCCESS) {
            a->oom += rc == CUDA_ERROR_OUT_OF_MEMORY;
            a->other += rc != CUDA_ERROR_OUT_OF_MEMORY;
            break;
        }
        a->ok++;
    }
    pthread_barrier_wait(&race_start);
    for (int i = 0; i < a->iters; i++) {
        if (nlive < 4 && (nlive == 0 || rand_r(&a->seed) % 2)) {
            CUresult rc = api.alloc(&live[nlive], a->size);
            if (rc == CUDA_SUCCESS) {
                nlive++;
                a->ok++;
            } else if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
                a->oom++;
            } else {
                a->other++;
            }
        } else {
            int k = (int)(rand_r(&a->seed) % (unsigned)nlive);
            if (api.free(live[k]) != CUDA_SUCCESS) a->other++;
            live[k] = live[--nlive];
        }
    }
    while (nlive > 0)
        if (api.free(live[--nlive]) != CUDA_SUCCESS) a->other++;
    return NULL;
}

static void race(int threads, int iters, unsigned long long size) {
    pthread_t tid[64];
    struct race_args args[64];
    if (threads > 64) threads = 64;
    pthread_barrier_init(&race_start, NULL, (unsigned)threads);
    for (int i = 0; i < threads; i++) {
        args[i] = (struct race_args){.iters = iters, .size = size, .seed = (unsigned)i * 7919u + 1};
        pthread_create(&tid[i], NULL, race_thread, &args[i]);
    }
    int ok = 0, oom = 0, other = 0;
    for (int i = 0; i < threads; i++) {
        pthread_join(tid[i], NULL);
        ok += args[i].ok;
        oom += args[i].oom;
        other += args[i].other;
    }
    pthread_barrier_destroy(&race_start);
    printf("race ok=%d oom=%d other=%d\n", ok, oom, other);
}

static CUDA_ARRAY3D_DESCRIPTOR desc3d(size_t w, size_t h, size_t d) {
    CUDA_ARRAY3D_DESCRIPTOR desc = {0};
    desc.Width = w;
    desc.Height = h;
    desc.Depth = d;
    desc.Format = CU_AD_FORMAT_FLOAT;
    desc.NumChannels = 1;
    return desc;
}

/* A graph holding one memory allocation node, added by the dedicated call or the generic one. */
static void cmd_graph_alloc(unsigned long long size, int generic) {
    CUgraph graph = NULL;
    CUgraphNode node = NULL;
    CUresult rc = api.graph_create(&graph, 0);
    CUdeviceptr ptr = 0;
    if (rc == CUDA_SUCCESS && !generic) {
        CUDA_MEM_ALLOC_NODE_PARAMS params = {.bytesize = size};
        params.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
        params.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        rc = api.graph_alloc(&node, graph, NULL, 0, &params);
        ptr = params.dptr;
    } else if (rc == CUDA_SUCCESS) {
        CUgraphNodeParams params = {.type = CU_GRAPH_NODE_TYPE_MEM_ALLOC};
        params.alloc.bytesize = size;
        rc = api.graph_add_node(&node, graph, NULL, NULL, 0, &params);
        ptr = params.alloc.dptr;
    }
    report_alloc(generic ? "graphnode" : "graphalloc", size, rc, K_PTR, ptr);
}

static void cmd_info(void) {
    size_t free_b = 0, total_b = 0;
    CUresult rc = api.info(&free_b, &total_b);
    printf("info rc=%d free=%zu total=%zu\n", (int)rc, free_b, total_b);
}

static void cmd_info_null(void) {
    size_t v = 0;
    CUresult a = api.info(NULL, NULL);
    CUresult b = api.info(NULL, &v);
    size_t total = v;
    CUresult c = api.info(&v, NULL);
    printf("infonull rc=%d,%d,%d total=%zu free=%zu\n", (int)a, (int)b, (int)c, total, v);
}

static void cmd_create(unsigned long long size, int host) {
    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = host ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    CUmemGenericAllocationHandle h = 0;
    CUresult rc = api.create(&h, size, &prop, 0);
    report_alloc(host ? "create_host" : "create", size, rc, K_VMM, h);
}

static void cmd_legacy(unsigned long long size) {
    legacy_alloc_fn legacy = NULL;
    CUresult rc = api.getproc("cuMemAlloc", (void **)&legacy, 2000, 0, NULL);
    unsigned int ptr = 0;
    if (rc == CUDA_SUCCESS) rc = legacy(&ptr, (unsigned int)size);
    report_alloc("legacy", size, rc, K_PTR, ptr);
}

/* The same entry point found by plain dlsym, or bound at link time (cuda.h renames cuMemAlloc). */
CUresult linked_legacy_alloc(unsigned int *dptr, unsigned int bytesize) __asm__("cuMemAlloc");

static void cmd_legacy_other(const char *how, unsigned long long size) {
    legacy_alloc_fn legacy = strcmp(how, "legacydl") == 0 ? (legacy_alloc_fn)dlsym(cuda, "cuMemAlloc")
                                                          : linked_legacy_alloc;
    unsigned int ptr = 0;
    CUresult rc = legacy ? legacy(&ptr, (unsigned int)size) : CUDA_ERROR_NOT_FOUND;
    report_alloc(how, size, rc, K_PTR, ptr);
}

/* Leaves the shared accounting file as a process killed at the worst moment would: the OFD
 * lock held (the same header range the library takes), a rebuild half done (frozen, odd
 * seq) and this process inside an operation with a device total it never finished. */
static void cmd_crashstate(unsigned long long extra) {
    const char *path = getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    int fd = path ? open(path, O_RDWR | O_CLOEXEC) : -1;
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_len = sizeof(struct vgpu_shm_header)}; /* the structural lock */
    struct vgpu_shm_file *f = NULL;
    /* Polled for at most 10 s, never waited on: a lock someone never releases ends the probe with slot=-1. */
    int locked = -1;
    for (int tries = 0; fd >= 0 && locked != 0 && tries < 1000; tries++) {
        locked = fcntl(fd, F_OFD_SETLK, &fl);
        if (locked != 0) nanosleep(&(struct timespec){.tv_nsec = 10000000}, NULL);
    }
    if (locked == 0) {
        void *p = mmap(NULL, sizeof *f, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        f = p == MAP_FAILED ? NULL : p;
    }
    int slot = -1;
    for (int s = 0; f && s < VGPU_SHM_SLOTS; s++)
        if (f->slots[s].pid == getpid()) slot = s;
    if (slot >= 0) {
        __atomic_fetch_add(&f->slots[slot].inflight, 1, __ATOMIC_SEQ_CST);
        __atomic_fetch_add(&f->devices[0].used, extra, __ATOMIC_SEQ_CST);
        __atomic_store_n(&f->header.frozen, 1, __ATOMIC_SEQ_CST);
        __atomic_fetch_add(&f->header.seq, 1, __ATOMIC_SEQ_CST);
    }
    printf("crashstate slot=%d\n", slot); /* the mapping and lock stay until the process dies */
}

/* Polls until a file exists: a start line for several processes. */
static void cmd_waitfile(const char *path) {
    struct stat st;
    while (stat(path, &st) != 0) nanosleep(&(struct timespec){.tv_nsec = 1000000}, NULL);
    printf("waitfile done\n");
}

/* Runs one command starting at argv[i]; returns how many arguments it consumed, or 0. */
static int run(char **argv, int argc, int i) {
    const char *c = argv[i];
    int left = argc - i - 1;
#define ARG(k) argv[i + (k)]
    /* In-process environment changes, as a tenant's own code makes them before its first CUDA call. */
    if (!strcmp(c, "setenv") && left >= 2) return printf("setenv rc=%d\n", setenv(ARG(1), ARG(2), 1)), 3;
    if (!strcmp(c, "unsetenv") && left >= 1) return printf("unsetenv rc=%d\n", unsetenv(ARG(1))), 2;
    if (!strcmp(c, "graphalloc") && left >= 1) return cmd_graph_alloc(num(ARG(1)), 0), 2;
    if (!strcmp(c, "graphnode") && left >= 1) return cmd_graph_alloc(num(ARG(1)), 1), 2;
    if (!strcmp(c, "poolthreshold") && left >= 1) {
        cuuint64_t threshold = num(ARG(1));
        return printf("poolthreshold rc=%d\n", (int)api.pool_set((CUmemoryPool)(uintptr_t)1, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &threshold)), 2;
    }
    if (!strcmp(c, "info1")) { /* the 32-bit cuMemGetInfo / cuDeviceTotalMem, by name as old binaries bind them */
        typedef CUresult (*info1_fn)(unsigned int *, unsigned int *);
        typedef CUresult (*total1_fn)(unsigned int *, CUdevice);
        info1_fn info1 = (info1_fn)dlsym(cuda ? cuda : RTLD_DEFAULT, "cuMemGetInfo");
        total1_fn total1 = (total1_fn)dlsym(cuda ? cuda : RTLD_DEFAULT, "cuDeviceTotalMem");
        unsigned int f = 0, t = 0, d = 0;
        CUresult a = info1 ? info1(&f, &t) : CUDA_ERROR_NOT_FOUND, b = total1 ? total1(&d, 0) : CUDA_ERROR_NOT_FOUND;
        return printf("info1 rc=%d,%d free=%u total=%u devtotal=%u\n", (int)a, (int)b, f, t, d), 1;
    }
    if (!strcmp(c, "poolget")) {
        cuuint64_t threshold = 0;
        CUresult rc = api.pool_get((CUmemoryPool)(uintptr_t)1, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &threshold);
        return printf("poolget rc=%d threshold=%llu\n", (int)rc, (unsigned long long)threshold), 1;
    }
    if (!strcmp(c, "init")) return printf("init rc=%d\n", (int)api.init(0)), 1;
    if (!strcmp(c, "ctx") && left >= 1) return printf("ctx rc=%d\n", (int)make_current((int)num(ARG(1)))), 2;
    if (!strcmp(c, "noctx")) return printf("noctx rc=%d\n", (int)api.set_current(NULL)), 1;
    if (!strcmp(c, "alloc") && left >= 1) {
        CUdeviceptr p = 0;
        CUresult rc = api.alloc(&p, num(ARG(1)));
        return report_alloc("alloc", num(ARG(1)), rc, K_PTR, p), 2;
    }
    if (!strcmp(c, "allocnull")) return printf("allocnull rc=%d\n", (int)api.alloc(NULL, 1)), 1;
    if (!strcmp(c, "managed") && left >= 1) {
        CUdeviceptr p = 0;
        CUresult rc = api.managed(&p, num(ARG(1)), CU_MEM_ATTACH_GLOBAL);
        return report_alloc("managed", num(ARG(1)), rc, K_PTR, p), 2;
    }
    if (!strcmp(c, "pitch") && left >= 2) {
        CUdeviceptr p = 0;
        size_t pitch = 0;
        CUresult rc = api.pitch(&p, &pitch, num(ARG(1)), num(ARG(2)), 4);
        printf("pitch=%zu\n", pitch);
        return report_alloc("pitch", num(ARG(1)) * num(ARG(2)), rc, K_PTR, p), 3;
    }
    if (!strcmp(c, "async") && left >= 1) {
        CUdeviceptr p = 0;
        CUresult rc = api.alloc_async(&p, num(ARG(1)), NULL);
        return report_alloc("async", num(ARG(1)), rc, K_ASYNC, p), 2;
    }
    if (!strcmp(c, "pool") && left >= 1) {
        CUdeviceptr p = 0;
        CUresult rc = api.alloc_pool(&p, num(ARG(1)), NULL, NULL);
        return report_alloc("pool", num(ARG(1)), rc, K_ASYNC, p), 2;
    }
    if (!strcmp(c, "create") && left >= 1) return cmd_create(num(ARG(1)), 0), 2;
    if (!strcmp(c, "create_host") && left >= 1) return cmd_create(num(ARG(1)), 1), 2;
    if (!strcmp(c, "array") && left >= 2) {
        CUDA_ARRAY_DESCRIPTOR d = {.Width = num(ARG(1)), .Height = num(ARG(2)), .Format = CU_AD_FORMAT_FLOAT,
                                   .NumChannels = 1};
        CUarray a = NULL;
        CUresult rc = api.array(&a, &d);
        return report_alloc("array", num(ARG(1)) * num(ARG(2)) * 4, rc, K_ARRAY, (uintptr_t)a), 3;
    }
    if (!strcmp(c, "array3d") && left >= 3) {
        CUDA_ARRAY3D_DESCRIPTOR d = desc3d(num(ARG(1)), num(ARG(2)), num(ARG(3)));
        CUarray a = NULL;
        CUresult rc = api.array3d(&a, &d);
        return report_alloc("array3d", num(ARG(1)) * num(ARG(2)) * num(ARG(3)) * 4, rc, K_ARRAY, (uintptr_t)a), 4;
    }
    if (!strcmp(c, "mipmap") && left >= 3) {
        CUDA_ARRAY3D_DESCRIPTOR d = desc3d(num(ARG(1)), num(ARG(2)), 0);
        CUmipmappedArray m = NULL;
        CUresult rc = api.mipmap(&m, &d, (unsigned)num(ARG(3)));
        return report_alloc("mipmap", 0, rc, K_MIPMAP, (uintptr_t)m), 4;
    }
    if (!strcmp(c, "legacy") && left >= 1) return cmd_legacy(num(ARG(1))), 2;
    if ((!strcmp(c, "legacydl") || !strcmp(c, "legacylink")) && left >= 1) return cmd_legacy_other(c, num(ARG(1))), 2;
    if (!strcmp(c, "free") && left >= 1) return printf("free rc=%d\n", (int)release_slot((int)num(ARG(1)))), 2;
    if (!strcmp(c, "freeptr") && left >= 1)
        return printf("freeptr rc=%d\n", (int)api.free((CUdeviceptr)num(ARG(1)))), 2;
    if (!strcmp(c, "info")) return cmd_info(), 1;
    if (!strcmp(c, "infonull")) return cmd_info_null(), 1;
    if (!strcmp(c, "totalmem") && left >= 1) {
        size_t bytes = 0;
        CUresult rc = api.total_mem(&bytes, (CUdevice)num(ARG(1)));
        return printf("totalmem rc=%d bytes=%zu\n", (int)rc, bytes), 2;
    }
    if (!strcmp(c, "fake") && left >= 1) return print_fake((int)num(ARG(1))), 2;
    if (!strcmp(c, "procaddr") && left >= 3)
        return print_procaddr(ARG(1), (int)num(ARG(2)), num(ARG(3))), 4;
    if (!strcmp(c, "race") && left >= 3) return race((int)num(ARG(1)), (int)num(ARG(2)), num(ARG(3))), 4;
    if (!strcmp(c, "exec") && left >= 1) { /* the rest of the line becomes a new image, same pid */
        char *args[64] = {argv[0], path_arg};
        int n = 2;
        for (int k = i + 1; k < argc && n < 63; k++) args[n++] = argv[k];
        args[n] = NULL;
        fflush(stdout);
        execv(strchr(argv[0], '/') ? argv[0] : "/proc/self/exe", args); /* argv[0]: valgrind follows it */
        return printf("exec failed\n"), argc - i;
    }
    if (!strcmp(c, "crashstate") && left >= 1) return cmd_crashstate(num(ARG(1))), 2;
    if (!strcmp(c, "waitfile") && left >= 1) return cmd_waitfile(ARG(1)), 2;
    if (!strcmp(c, "hold") && left >= 1) {
        printf("holding\n");
        fflush(stdout);
        usleep((useconds_t)(num(ARG(1)) * 1000));
        return 2;
    }
    if (!strcmp(c, "fork") && left >= 1) { /* child: make current, allocate, report */
        fflush(stdout);
        pid_t child = fork();
        if (child == 0) {
            CUdeviceptr p = 0;
            CUresult rc = make_current(0);
            if (rc == CUDA_SUCCESS) rc = api.alloc(&p, num(ARG(1)));
            printf("child alloc rc=%d\n", (int)rc);
            fflush(stdout);
            _exit(0);
        }
        int status = 0;
        waitpid(child, &status, 0);
        return printf("fork exited=%d\n", WIFEXITED(status) ? WEXITSTATUS(status) : -1), 2;
    }
#undef ARG
    return 0;
}

int main(int argc, char **argv) {
    int i = 1;
    const char *path = "link";
    if (i < argc && !strncmp(argv[i], "--path=", 7)) path = argv[i++] + 7;
    snprintf(path_arg, sizeof path_arg, "--path=%s", path);
    if (i < argc && !strcmp(argv[i], "--ptds")) {
        proc_flags = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
        i++;
    }
    if (setup_api(path) != 0) {
        fprintf(stderr, "cuprobe: cannot set up path %s\n", path);
        return 2;
    }
    while (i < argc) {
        int used = run(argv, argc, i);
        if (!used) {
            fprintf(stderr, "cuprobe: bad command at '%s'\n", argv[i]);
            return 2;
        }
        fflush(stdout);
        i += used;
    }
    for (int k = 0; k < nslots; k++) release_slot(k); /* leave nothing behind for valgrind */
    if (cuda) dlclose(cuda);
    return 0;
}
