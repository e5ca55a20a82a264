/* Finds the real libcuda.so.1 / libnvidia-ml.so.1 by soname at first use (never at
 * load time, so programs that do not use CUDA pay nothing) and resolves the entry
 * points the hooks forward to. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include "vgpu.h"

struct vgpu_cuda_real vgpu_cuda;
struct vgpu_nvml_real vgpu_nvml;

static void *cuda_handle;
static void *nvml_handle;
static pthread_once_t cuda_once = PTHREAD_ONCE_INIT;
static pthread_once_t nvml_once = PTHREAD_ONCE_INIT;
static __thread int loading_depth;

int vgpu_loading(void) { return loading_depth; }

/* glibc 2.34 moved dlsym into libc under a new version; older ones use the arch base. */
static vgpu_dlsym_fn find_real_dlsym(void) {
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0"};
    for (size_t i = 0; i < sizeof versions / sizeof versions[0]; i++) {
        vgpu_dlsym_fn f = (vgpu_dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
        if (f) return f;
    }
    return NULL;
}

vgpu_dlsym_fn vgpu_real_dlsym_fn(void) {
    static _Atomic(vgpu_dlsym_fn) cached;
    vgpu_dlsym_fn f = atomic_load_explicit(&cached, memory_order_acquire);
    if (!f) {
        f = find_real_dlsym();
        atomic_store_explicit(&cached, f, memory_order_release);
    }
    return f;
}

void *vgpu_real_dlsym(void *handle, const char *name) {
    vgpu_dlsym_fn f = vgpu_real_dlsym_fn();
    return f ? f(handle, name) : NULL;
}

static void *open_by_soname(const char *soname) {
    void *h = dlopen(soname, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
    if (!h) vgpu_log(VGPU_LOG_INFO, "cannot load %s: %s", soname, dlerror());
    return h;
}

static void load_cuda_once(void) {
    loading_depth++;
    vgpu_config_init();
    cuda_handle = open_by_soname("libcuda.so.1");
    if (cuda_handle) {
#define VGPU_RESOLVE(name, base, ver, ptds) \
    vgpu_cuda.name = (__typeof__(vgpu_cuda.name))vgpu_real_dlsym(cuda_handle, #name);
        VGPU_CUDA_HOOKED(VGPU_RESOLVE)
#undef VGPU_RESOLVE
        vgpu_cuda.getproc_v1 = (vgpu_getproc_v1_fn)vgpu_real_dlsym(cuda_handle, "cuGetProcAddress");
        vgpu_cuda.legacy_alloc = (vgpu_legacy_alloc_fn)vgpu_real_dlsym(cuda_handle, "cuMemAlloc");
        vgpu_cuda.graph_add_node_v1 = (vgpu_graph_add_node_v1_fn)vgpu_real_dlsym(cuda_handle, "cuGraphAddNode");
        vgpu_cuda.mem_info_v1 = (vgpu_mem_info_v1_fn)vgpu_real_dlsym(cuda_handle, "cuMemGetInfo");
        vgpu_cuda.total_mem_v1 = (vgpu_total_mem_v1_fn)vgpu_real_dlsym(cuda_handle, "cuDeviceTotalMem");
        vgpu_cuda.cuCtxGetDevice =
            (__typeof__(vgpu_cuda.cuCtxGetDevice))vgpu_real_dlsym(cuda_handle, "cuCtxGetDevice");
        void *uuid = vgpu_real_dlsym(cuda_handle, "cuDeviceGetUuid_v2");
        vgpu_cuda.cuDeviceGetUuid =
            (__typeof__(vgpu_cuda.cuDeviceGetUuid))(uuid ? uuid : vgpu_real_dlsym(cuda_handle, "cuDeviceGetUuid"));
    }
    loading_depth--;
}

static void load_nvml_once(void) {
    loading_depth++;
    vgpu_config_init();
    nvml_handle = open_by_soname("libnvidia-ml.so.1");
    if (nvml_handle) {
#define VGPU_RESOLVE(name) vgpu_nvml.name = (__typeof__(vgpu_nvml.name))vgpu_real_dlsym(nvml_handle, #name);
        VGPU_NVML_HOOKED(VGPU_RESOLVE)
        VGPU_RESOLVE(nvmlDeviceGetIndex)
        VGPU_RESOLVE(nvmlDeviceGetUUID)
#undef VGPU_RESOLVE
    }
    loading_depth--;
}

int vgpu_cuda_load(void) {
    pthread_once(&cuda_once, load_cuda_once);
    return cuda_handle ? 0 : -1;
}

int vgpu_nvml_load(void) {
    pthread_once(&nvml_once, load_nvml_once);
    return nvml_handle ? 0 : -1;
}

void *vgpu_cuda_symbol(const char *name) {
    return vgpu_cuda_load() == 0 ? vgpu_real_dlsym(cuda_handle, name) : NULL;
}

void *vgpu_nvml_symbol(const char *name) {
    return vgpu_nvml_load() == 0 ? vgpu_real_dlsym(nvml_handle, name) : NULL;
}
