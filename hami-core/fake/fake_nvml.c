/* A fake libnvidia-ml.so.1 reporting the same devices as the fake libcuda.so.1
 * (FAKE_CUDA_DEVICES x FAKE_CUDA_TOTAL_MIB); used memory is the fake driver's own
 * count when that library is loaded in the process, else 0. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "fake_cuda.h"
#include "nvml_subset.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEVICES 16

struct nvmlDevice_st {
    unsigned int index;
};

static struct nvmlDevice_st devices[MAX_DEVICES];
static unsigned int device_count;
static int initialised;

nvmlReturn_t fake_nvmlInit_v1(void) __asm__("nvmlInit") EXPORT;

static unsigned long long env_ull(const char *name, unsigned long long fallback, unsigned long long hi) {
    const char *text = getenv(name);
    char *end;
    unsigned long long v = text ? strtoull(text, &end, 10) : fallback;
    return text && (*end || end == text || v < 1 || v > hi) ? fallback : v;
}

static unsigned long long total_bytes(void) { return env_ull("FAKE_CUDA_TOTAL_MIB", 15360, 1ull << 30) << 20; }

static unsigned long long used_bytes(unsigned int index) {
    void *cuda = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (!cuda) return 0;
    fake_cuda_stats_fn stats = (fake_cuda_stats_fn)dlsym(cuda, FAKE_CUDA_STATS_SYMBOL);
    fake_cuda_stats s = {0};
    unsigned long long used = stats && stats((int)index, &s) == 0 ? s.used : 0;
    dlclose(cuda);
    return used;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) {
    device_count = (unsigned int)env_ull("FAKE_CUDA_DEVICES", 1, MAX_DEVICES);
    for (unsigned int i = 0; i < device_count; i++) devices[i].index = i;
    initialised = 1;
    return NVML_SUCCESS;
}

nvmlReturn_t fake_nvmlInit_v1(void) { return nvmlInit_v2(); }

EXPORT nvmlReturn_t nvmlShutdown(void) {
    initialised = 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = device_count;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= device_count) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &devices[index];
    return NVML_SUCCESS;
}

static int valid(nvmlDevice_t device) {
    return initialised && device >= devices && device < devices + device_count;
}

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    if (!valid(device) || !index) return NVML_ERROR_INVALID_ARGUMENT;
    *index = device->index;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    if (!valid(device) || !name) return NVML_ERROR_INVALID_ARGUMENT;
    if (length < sizeof "Fake GPU") return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(name, "Fake GPU");
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    if (!valid(device) || !uuid) return NVML_ERROR_INVALID_ARGUMENT;
    if (length < 41) return NVML_ERROR_INSUFFICIENT_SIZE;
    snprintf(uuid, length, "GPU-%02u00fa4e-1111-2222-3333-%012u", device->index, device->index);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    if (!valid(device) || !memory) return NVML_ERROR_INVALID_ARGUMENT;
    memory->total = total_bytes();
    memory->used = used_bytes(device->index);
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    if (!valid(device) || !memory) return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != NVML_MEMORY_V2) return NVML_ERROR_INVALID_ARGUMENT;
    memory->total = total_bytes();
    memory->reserved = 0;
    memory->used = used_bytes(device->index);
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}
