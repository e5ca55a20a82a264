/* Internal interface shared by the libvgpu.so translation units: logging,
 * configuration, the real-driver tables, the usage ledger and allocation tracking. */
#ifndef VGPU_H
#define VGPU_H

#include <stddef.h>
#include <stdint.h>
#include <cuda.h>
#include "nvml_subset.h"

#define VGPU_EXPORT __attribute__((visibility("default")))
#define VGPU_MAX_DEVICES 16
#define VGPU_UNLIMITED UINT64_MAX

/* cuda.h only declares the per-thread-stream variants when compiled for them. */
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                      CUstream hStream);
CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream);
typedef CUresult (*vgpu_getproc_v1_fn)(const char *, void **, int, cuuint64_t);
/* The legacy 32-bit cuMemAlloc (cuda.h macro-renames that name to cuMemAlloc_v2). */
typedef CUresult (*vgpu_legacy_alloc_fn)(unsigned int *, unsigned int);
CUresult vgpu_legacy_alloc_hook(unsigned int *dptr, unsigned int bytesize) __asm__("cuMemAlloc");
/* The 32-bit cuMemGetInfo / cuDeviceTotalMem of CUDA before 3.2 (cuda.h renames both to _v2). */
typedef CUresult (*vgpu_mem_info_v1_fn)(unsigned int *, unsigned int *);
typedef CUresult (*vgpu_total_mem_v1_fn)(unsigned int *, CUdevice);
CUresult vgpu_mem_info_v1_hook(unsigned int *free_bytes, unsigned int *total_bytes) __asm__("cuMemGetInfo");
CUresult vgpu_total_mem_v1_hook(unsigned int *bytes, CUdevice dev) __asm__("cuDeviceTotalMem");
/* cuGraphAddNode of CUDA 12.2, without edge data (cuda.h macro-renames that name to _v2). */
typedef CUresult (*vgpu_graph_add_node_v1_fn)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUgraphNodeParams *);
CUresult vgpu_graph_add_node_v1_hook(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t ndeps,
                                     CUgraphNodeParams *params) __asm__("cuGraphAddNode");

/* ---- log.c ---- */
enum { VGPU_LOG_ERROR = 0, VGPU_LOG_WARN = 2, VGPU_LOG_INFO = 3, VGPU_LOG_DEBUG = 4 };
void vgpu_log_init(void);
void vgpu_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- config.c ---- */
/* Parses a size string; returns 0 and stores bytes, or -1 when malformed. */
int vgpu_parse_size(const char *text, uint64_t *bytes);
/* Reads the limit env once; returns the limit of accounting index idx. */
void vgpu_config_init(void);
uint64_t vgpu_config_limit(int idx);
/* 1 when the environment limits (or closes) any device. */
int vgpu_config_any_limit(void);
/* Maps a CUDA ordinal to the accounting index (the NVML index; under a grant, the device's
 * place in the grant, found by its UUID), or -1 when out of range. */
int vgpu_config_index(CUdevice ordinal);
/* 1 under a node-written grant: its limits bound every reservation, whatever the file says. */
int vgpu_config_granted(void);
/* The UUID the grant names for accounting index idx ("" when none). */
const char *vgpu_config_uuid(int idx);
/* Under a grant: the accounting index of the device with this UUID (VGPU_CLOSED_INDEX if none). */
int vgpu_config_index_of_uuid(const char *uuid);
/* The shared accounting file's path. */
const char *vgpu_config_state_path(void);

/* ---- grant.c: the node-written grant (shared/grant.py writes it) ---- */
#define VGPU_GRANT_DIR "/etc/kai-isolator"
#define VGPU_GRANT_FILE VGPU_GRANT_DIR "/grant.json"
/* Under a grant the accounting file is the webhook's fixed per-container state mount. */
#define VGPU_GRANT_STATE_FILE "/run/kai-isolator/usage.cache"
/* The last accounting index is never granted: devices outside the grant are charged there. */
#define VGPU_GRANT_MAX_DEVICES (VGPU_MAX_DEVICES - 1)
#define VGPU_CLOSED_INDEX (VGPU_MAX_DEVICES - 1)
#define VGPU_UUID_LEN 96
struct vgpu_grant_device {
    char uuid[VGPU_UUID_LEN];
    uint64_t limit;
};
struct vgpu_grant {
    int count;
    struct vgpu_grant_device devices[VGPU_GRANT_MAX_DEVICES];
};
/* 1 when the grant directory is mounted (then the environment carries no limits). */
int vgpu_grant_mounted(void);
/* Parses grant.json text; 0 on success. */
int vgpu_grant_parse(const char *text, size_t len, struct vgpu_grant *grant);
/* Waits (bounded) for grant.json and parses it; 0 on success, -1 (logged) to fail closed. */
int vgpu_grant_load(struct vgpu_grant *grant);

/* ---- ledger.c: per-device usage against the limit ---- */
int vgpu_ledger_reserve(int idx, uint64_t bytes);
void vgpu_ledger_release(int idx, uint64_t bytes);
uint64_t vgpu_ledger_used(int idx);
/* As above, after dropping processes that died (for reports such as NVML). */
uint64_t vgpu_ledger_used_fresh(int idx);
uint64_t vgpu_ledger_limit(int idx);

/* ---- shm.c: the shared accounting file (layout in shm_layout.h) ---- */
enum { VGPU_SHM_OFF, VGPU_SHM_ON, VGPU_SHM_BROKEN };
int vgpu_shm_state(void);
int vgpu_shm_reserve(int idx, uint64_t bytes);
void vgpu_shm_release(int idx, uint64_t bytes);
uint64_t vgpu_shm_used(int idx, int refresh);
uint64_t vgpu_shm_limit(int idx);
void vgpu_shm_set_uuid(int idx, const char *uuid);

/* ---- track.c: which live handles the library charged, and for how much ---- */
enum vgpu_kind { VGPU_KIND_PTR = 1, VGPU_KIND_VMM, VGPU_KIND_ARRAY, VGPU_KIND_MIPMAP };
int vgpu_track_add(enum vgpu_kind kind, uint64_t key, int idx, uint64_t bytes);
/* Removes the entry; returns 1 and its charge when the key was tracked. */
int vgpu_track_take(enum vgpu_kind kind, uint64_t key, int *idx, uint64_t *bytes);
/* In a fork child: the parent's allocations are not the child's to free. */
void vgpu_track_after_fork(void);

/* ---- driver.c: the real libcuda / libnvidia-ml, found by soname ---- */
#define VGPU_CUDA_HOOKED(X)                                                              \
    X(cuMemAlloc_v2, "cuMemAlloc", 3020, 0)                                              \
    X(cuMemFree_v2, "cuMemFree", 3020, 0)                                                \
    X(cuMemAllocPitch_v2, "cuMemAllocPitch", 3020, 0)                                    \
    X(cuMemAllocManaged, "cuMemAllocManaged", 6000, 0)                                   \
    X(cuMemAllocAsync, "cuMemAllocAsync", 11020, 0)                                      \
    X(cuMemAllocAsync_ptsz, "cuMemAllocAsync", 11020, 1)                                 \
    X(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 11020, 0)                      \
    X(cuMemAllocFromPoolAsync_ptsz, "cuMemAllocFromPoolAsync", 11020, 1)                 \
    X(cuMemFreeAsync, "cuMemFreeAsync", 11020, 0)                                        \
    X(cuMemFreeAsync_ptsz, "cuMemFreeAsync", 11020, 1)                                   \
    X(cuMemCreate, "cuMemCreate", 10020, 0)                                              \
    X(cuMemRelease, "cuMemRelease", 10020, 0)                                            \
    X(cuArrayCreate_v2, "cuArrayCreate", 3020, 0)                                        \
    X(cuArray3DCreate_v2, "cuArray3DCreate", 3020, 0)                                    \
    X(cuArrayDestroy, "cuArrayDestroy", 2000, 0)                                         \
    X(cuMipmappedArrayCreate, "cuMipmappedArrayCreate", 5000, 0)                         \
    X(cuMipmappedArrayDestroy, "cuMipmappedArrayDestroy", 5000, 0)                       \
    X(cuMemGetInfo_v2, "cuMemGetInfo", 3020, 0)                                          \
    X(cuDeviceTotalMem_v2, "cuDeviceTotalMem", 3020, 0)                                  \
    X(cuGetProcAddress_v2, "cuGetProcAddress", 12000, 0)                                \
    X(cuGraphAddMemAllocNode, "cuGraphAddMemAllocNode", 11040, 0)                        \
    X(cuGraphAddNode_v2, "cuGraphAddNode", 12030, 0)                                     \
    X(cuMemPoolSetAttribute, "cuMemPoolSetAttribute", 11020, 0)

#define VGPU_NVML_HOOKED(X) X(nvmlDeviceGetMemoryInfo) X(nvmlDeviceGetMemoryInfo_v2)

struct vgpu_cuda_real {
#define VGPU_FIELD(name, base, ver, ptds) __typeof__(name) *name;
    VGPU_CUDA_HOOKED(VGPU_FIELD)
#undef VGPU_FIELD
    vgpu_getproc_v1_fn getproc_v1; /* "cuGetProcAddress": cuda.h macro-renames that name */
    vgpu_legacy_alloc_fn legacy_alloc; /* "cuMemAlloc" */
    vgpu_graph_add_node_v1_fn graph_add_node_v1; /* "cuGraphAddNode" */
    vgpu_mem_info_v1_fn mem_info_v1;             /* "cuMemGetInfo" */
    vgpu_total_mem_v1_fn total_mem_v1;           /* "cuDeviceTotalMem" */
    __typeof__(cuCtxGetDevice) *cuCtxGetDevice;
    __typeof__(cuDeviceGetUuid) *cuDeviceGetUuid; /* _v2 where the driver has it */
};

struct vgpu_nvml_real {
#define VGPU_FIELD(name) __typeof__(name) *name;
    VGPU_NVML_HOOKED(VGPU_FIELD)
#undef VGPU_FIELD
    __typeof__(nvmlDeviceGetIndex) *nvmlDeviceGetIndex;
    __typeof__(nvmlDeviceGetUUID) *nvmlDeviceGetUUID;
};

extern struct vgpu_cuda_real vgpu_cuda;
extern struct vgpu_nvml_real vgpu_nvml;
/* Load on first use; return 0 when the real library is usable. */
int vgpu_cuda_load(void);
int vgpu_nvml_load(void);
/* Set while this thread loads a library, so dlsym calls made by the loader pass through. */
int vgpu_loading(void);
typedef void *(*vgpu_dlsym_fn)(void *, const char *);
vgpu_dlsym_fn vgpu_real_dlsym_fn(void);
void *vgpu_real_dlsym(void *handle, const char *name);
void *vgpu_cuda_symbol(const char *name);
void *vgpu_nvml_symbol(const char *name);

/* ---- symbols.c: hook lookup used by dlsym and cuGetProcAddress ---- */
struct vgpu_symbol {
    const char *name;
    void *hook;
    const char *base;  /* name passed to cuGetProcAddress; NULL for NVML */
    int version;       /* cudaVersion that selects this exact entry point */
    int ptds;          /* 1 for the per-thread default stream variant */
    int nvml;
};
const struct vgpu_symbol *vgpu_symbol_by_name(const char *name);
void *vgpu_hook_for_procaddr(const char *symbol, void *resolved, int version, cuuint64_t flags);

/* ---- hooks_mem.c ---- */
/* Accounting index of the calling thread's current context, or a CUresult (< 0 => error). */
CUresult vgpu_current_index(int *idx);

/* ---- symbols.c ---- */
/* 1 when p lies in a copy of the driver (or NVML) other than the one we forward to: another
 * dlmopen namespace, or the same file loaded again. */
int vgpu_in_driver_copy(void *p, int nvml);

#endif
