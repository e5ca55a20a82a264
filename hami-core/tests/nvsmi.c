/* nvidia-smi stand-in: queries memory through NVML the way nvidia-smi does, either by
 * linked symbols or by dlopen + dlsym on libnvidia-ml.so.1 (--path=dlsym). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include "nvml_subset.h"

struct nvml_api {
    __typeof__(nvmlInit_v2) *init;
    __typeof__(nvmlDeviceGetCount_v2) *count;
    __typeof__(nvmlDeviceGetHandleByIndex_v2) *handle;
    __typeof__(nvmlDeviceGetMemoryInfo) *mem;
    __typeof__(nvmlDeviceGetMemoryInfo_v2) *mem2;
    __typeof__(nvmlShutdown) *shutdown;
};

static int load(struct nvml_api *api, const char *path, void **lib) {
    if (strcmp(path, "link") == 0) {
        *api = (struct nvml_api){nvmlInit_v2, nvmlDeviceGetCount_v2, nvmlDeviceGetHandleByIndex_v2,
                                 nvmlDeviceGetMemoryInfo, nvmlDeviceGetMemoryInfo_v2, nvmlShutdown};
        return 0;
    }
    *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!*lib) return -1;
    api->init = (__typeof__(api->init))dlsym(*lib, "nvmlInit_v2");
    api->count = (__typeof__(api->count))dlsym(*lib, "nvmlDeviceGetCount_v2");
    api->handle = (__typeof__(api->handle))dlsym(*lib, "nvmlDeviceGetHandleByIndex_v2");
    api->mem = (__typeof__(api->mem))dlsym(*lib, "nvmlDeviceGetMemoryInfo");
    api->mem2 = (__typeof__(api->mem2))dlsym(*lib, "nvmlDeviceGetMemoryInfo_v2");
    api->shutdown = (__typeof__(api->shutdown))dlsym(*lib, "nvmlShutdown");
    return api->init && api->count && api->handle && api->mem && api->mem2 && api->shutdown ? 0 : -1;
}

static void show(struct nvml_api *api, unsigned int i) {
    nvmlDevice_t dev;
    nvmlMemory_t m = {0};
    nvmlMemory_v2_t m2 = {.version = NVML_MEMORY_V2};
    int rc0 = api->handle(i, &dev);
    int rc1 = api->mem(dev, &m);
    int rc2 = api->mem2(dev, &m2);
    int rc3 = api->mem(dev, NULL);
    printf("gpu %u rc=%d,%d,%d,%d v1 used=%llu free=%llu total=%llu v2 used=%llu free=%llu total=%llu "
           "reserved=%llu\n",
           i, rc0, rc1, rc2, rc3, m.used, m.free, m.total, m2.used, m2.free, m2.total, m2.reserved);
    printf("| %lluMiB / %lluMiB |\n", m.used >> 20, m.total >> 20);
}

int main(int argc, char **argv) {
    const char *path = argc > 1 && !strncmp(argv[1], "--path=", 7) ? argv[1] + 7 : "link";
    struct nvml_api api;
    void *lib = NULL;
    unsigned int n = 0;
    if (load(&api, path, &lib) != 0 || api.init() != NVML_SUCCESS || api.count(&n) != NVML_SUCCESS) {
        fprintf(stderr, "nvsmi: NVML unavailable\n");
        return 2;
    }
    for (unsigned int i = 0; i < n; i++) show(&api, i);
    api.shutdown();
    if (lib) dlclose(lib);
    return 0;
}
