/* The few NVML declarations libvgpu, the fake NVML and the tests need; the
 * toolkit ships no nvml.h, and the ABI of these calls has been stable for years.
 * Written from the facts of NVML's API, never copied: hami-core/tests/nvml_abi.c
 * checks every layout, value and signature here against the real nvml.h (go-nvml's). */
#ifndef VGPU_NVML_SUBSET_H
#define VGPU_NVML_SUBSET_H

typedef struct nvmlDevice_st *nvmlDevice_t;
typedef int nvmlReturn_t;

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NO_PERMISSION 4
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_LIBRARY_NOT_FOUND 12
#define NVML_ERROR_FUNCTION_NOT_FOUND 13
#define NVML_ERROR_OPERATING_SYSTEM 17
#define NVML_ERROR_UNKNOWN 999

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

/* NVML_STRUCT_VERSION(Memory, 2) as NVML defines it: size | version << 24. */
#define NVML_MEMORY_V2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))

/* Per-cgroup device memory limits (NVML 13.4, driver R615): `nameSpace` is the full sysfs path of a
 * cgroup v2 directory; soft 0 with hard NVML_DEVICE_MEMORY_LIMIT_MAX means no limit (and clears one). */
#define NVML_DEVICE_MEMORY_LIMIT_MAX 0xFFFFFFFFFFFFFFFFull

typedef struct {
    const char *nameSpace;
    unsigned long long softLimit;
    unsigned long long hardLimit;
} nvmlSetMemoryLimits_v1_t;

typedef struct {
    const char *nameSpace;
    unsigned long long softLimit;   /* out */
    unsigned long long hardLimit;   /* out */
    unsigned long long currentUsed; /* out: what the cgroup holds on the device now */
} nvmlGetMemoryLimits_v1_t;

nvmlReturn_t nvmlInit_v2(void);
nvmlReturn_t nvmlShutdown(void);
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count);
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device);
nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index);
nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length);
nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length);
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory);
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory);
nvmlReturn_t nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t device, nvmlSetMemoryLimits_v1_t *limits);
nvmlReturn_t nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t device, nvmlGetMemoryLimits_v1_t *limits);

#endif
