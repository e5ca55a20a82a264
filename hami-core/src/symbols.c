/* The hook table and the two lookup paths that are not plain symbol interposition:
 * an exported dlsym (how nvidia-smi, PyTorch and cudart find driver functions) and
 * cuGetProcAddress / cuGetProcAddress_v2 (how CUDA 12/13 runtimes get every entry point). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>
#include <sys/stat.h>
#include "vgpu.h"

CUresult vgpu_getproc_v1_hook(const char *symbol, void **pfn, int version, cuuint64_t flags)
    __asm__("cuGetProcAddress") VGPU_EXPORT;

static const struct vgpu_symbol symbols[] = {
#define VGPU_ENTRY(name, base, ver, ptds) {#name, (void *)&name, base, ver, ptds, 0},
    VGPU_CUDA_HOOKED(VGPU_ENTRY)
#undef VGPU_ENTRY
    {"cuGetProcAddress", (void *)&vgpu_getproc_v1_hook, "cuGetProcAddress", 11030, 0, 0},
    {"cuMemAlloc", (void *)&vgpu_legacy_alloc_hook, "cuMemAlloc", 2000, 0, 0},
    {"cuGraphAddNode", (void *)&vgpu_graph_add_node_v1_hook, "cuGraphAddNode", 12020, 0, 0},
    {"cuMemGetInfo", (void *)&vgpu_mem_info_v1_hook, "cuMemGetInfo", 2000, 0, 0},
    {"cuDeviceTotalMem", (void *)&vgpu_total_mem_v1_hook, "cuDeviceTotalMem", 2000, 0, 0},
#define VGPU_ENTRY(name) {#name, (void *)&name, NULL, 0, 0, 1},
    VGPU_NVML_HOOKED(VGPU_ENTRY)
#undef VGPU_ENTRY
};
#define NSYMBOLS (sizeof symbols / sizeof symbols[0])

const struct vgpu_symbol *vgpu_symbol_by_name(const char *name) {
    if (!name || !((name[0] == 'c' && name[1] == 'u') || strncmp(name, "nvml", 4) == 0)) return NULL;
    for (size_t i = 0; i < NSYMBOLS; i++)
        if (strcmp(symbols[i].name, name) == 0) return &symbols[i];
    return NULL;
}

/* Asks the driver which entry point the hook's exact ABI corresponds to, and compares it with
 * what the caller got: the driver's own version and stream-flag selection stays authoritative,
 * so a caller asking for an older ABI never receives a hook with a different signature. */
void *vgpu_hook_for_procaddr(const char *symbol, void *resolved, int version, cuuint64_t flags) {
    (void)version;
    (void)flags;
    if (!symbol || !resolved || !vgpu_cuda.cuGetProcAddress_v2) return resolved;
    for (size_t i = 0; i < NSYMBOLS; i++) {
        const struct vgpu_symbol *s = &symbols[i];
        if (s->nvml || strcmp(s->base, symbol) != 0) continue;
        void *canonical = NULL;
        cuuint64_t want = s->ptds ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
                                  : CU_GET_PROC_ADDRESS_LEGACY_STREAM;
        if (vgpu_cuda.cuGetProcAddress_v2(symbol, &canonical, s->version, want, NULL) == CUDA_SUCCESS &&
            canonical == resolved)
            return s->hook;
    }
    return resolved;
}

static void *real_of(const struct vgpu_symbol *s) {
    return s->nvml ? vgpu_nvml_symbol(s->name) : vgpu_cuda_symbol(s->name);
}

static int same_file(const char *a, const char *b) {
    struct stat sa, sb;
    return a && b && stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

/* By the object the pointer lies in: a file with the driver's soname, or the very file our
 * driver was loaded from (a copy under another name in another namespace is still it). */
int vgpu_in_driver_copy(void *p, int nvml) {
    Dl_info where, ours;
    void *reference = nvml ? vgpu_nvml_symbol("nvmlInit_v2") : vgpu_cuda_symbol("cuInit");
    if (!dladdr(p, &where) || !where.dli_fname) return 0;
    const char *base = strrchr(where.dli_fname, '/');
    base = base ? base + 1 : where.dli_fname;
    if (strncmp(base, nvml ? "libnvidia-ml.so" : "libcuda.so", nvml ? 15 : 10) == 0) return 1;
    return reference && dladdr(reference, &ours) && same_file(where.dli_fname, ours.dli_fname);
}

static __attribute__((noinline)) void *hooked_dlsym(void *handle, const char *name,
                                                    const struct vgpu_symbol *s) {
    void *p = vgpu_real_dlsym(handle, name);
    if (!p || p == s->hook || vgpu_loading()) return p;
    return p == real_of(s) || vgpu_in_driver_copy(p, s->nvml) ? s->hook : p;
}

/* Everything that is not a hook lookup goes straight to the real dlsym as a tail call, so
 * glibc still sees the original caller: RTLD_NEXT is relative to the caller, and other
 * interposers chain through it, so RTLD_NEXT lookups are never redirected. */
VGPU_EXPORT __attribute__((optimize("optimize-sibling-calls"))) void *dlsym(void *handle, const char *name) {
    const struct vgpu_symbol *s = vgpu_symbol_by_name(name);
    if (s && handle != RTLD_NEXT) return hooked_dlsym(handle, name, s);
    vgpu_dlsym_fn real = vgpu_real_dlsym_fn();
    return real ? real(handle, name) : NULL;
}

static CUresult getproc(const char *symbol, void **pfn, int version, cuuint64_t flags,
                        CUdriverProcAddressQueryResult *status, int v1) {
    if (vgpu_cuda_load() != 0) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc;
    if (v1 && vgpu_cuda.getproc_v1)
        rc = vgpu_cuda.getproc_v1(symbol, pfn, version, flags);
    else if (vgpu_cuda.cuGetProcAddress_v2)
        rc = vgpu_cuda.cuGetProcAddress_v2(symbol, pfn, version, flags, status);
    else
        return CUDA_ERROR_NOT_FOUND;
    if (rc == CUDA_SUCCESS && pfn) *pfn = vgpu_hook_for_procaddr(symbol, *pfn, version, flags);
    return rc;
}

VGPU_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                                         CUdriverProcAddressQueryResult *status) {
    return getproc(symbol, pfn, version, flags, status, 0);
}

CUresult vgpu_getproc_v1_hook(const char *symbol, void **pfn, int version, cuuint64_t flags) {
    return getproc(symbol, pfn, version, flags, NULL, 1);
}
