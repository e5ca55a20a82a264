/* Keeps include/nvml_subset.h honest: built once against it and once against NVIDIA's real nvml.h
 * (-DNVML_ABI_REAL with the real header's folder first on the include path), this prints every layout and
 * value the subset declares; the two outputs must be the same, and each build checks every function the
 * subset declares has the signature written below (a mismatch does not compile). go-nvml's copy of the
 * header wraps each handle in a struct of one pointer for cgo (nvmlDevice_t { struct nvmlDevice_st *handle; })
 * where NVIDIA's is the pointer itself: the same size, passed the same way, which is what is printed. */
#include <stddef.h>
#include <stdio.h>
#ifdef NVML_ABI_REAL
#include <nvml.h>
#else
#include "nvml_subset.h"
#endif

#define SIGNATURE(fn, ...) \
    _Static_assert(__builtin_types_compatible_p(__typeof__(fn), nvmlReturn_t(__VA_ARGS__)), #fn "'s signature")

SIGNATURE(nvmlInit_v2, void);
SIGNATURE(nvmlShutdown, void);
SIGNATURE(nvmlDeviceGetCount_v2, unsigned int *);
SIGNATURE(nvmlDeviceGetHandleByIndex_v2, unsigned int, nvmlDevice_t *);
SIGNATURE(nvmlDeviceGetIndex, nvmlDevice_t, unsigned int *);
SIGNATURE(nvmlDeviceGetName, nvmlDevice_t, char *, unsigned int);
SIGNATURE(nvmlDeviceGetUUID, nvmlDevice_t, char *, unsigned int);
SIGNATURE(nvmlDeviceGetMemoryInfo, nvmlDevice_t, nvmlMemory_t *);
SIGNATURE(nvmlDeviceGetMemoryInfo_v2, nvmlDevice_t, nvmlMemory_v2_t *);
SIGNATURE(nvmlDeviceSetMemoryLimits_v1, nvmlDevice_t, nvmlSetMemoryLimits_v1_t *);
SIGNATURE(nvmlDeviceGetMemoryLimits_v1, nvmlDevice_t, nvmlGetMemoryLimits_v1_t *);

#define TYPE_OF(x)                                                                                           \
    _Generic((x), const char *: "const char *", char *: "char *", unsigned long long: "unsigned long long", \
             unsigned int: "unsigned int", default: "another type")
#define FIELD(type, field)                                                                                \
    printf("%s.%s offset=%zu size=%zu type=%s\n", #type, #field, offsetof(type, field), sizeof(((type *)0)->field), \
           TYPE_OF(((type *)0)->field))
#define SIZE(type) printf("sizeof(%s)=%zu\n", #type, sizeof(type))
#define VALUE(name) printf("%s=%llu\n", #name, (unsigned long long)(name))

int main(void) {
    SIZE(nvmlReturn_t);
    SIZE(nvmlDevice_t);
    SIZE(nvmlMemory_t);
    FIELD(nvmlMemory_t, total);
    FIELD(nvmlMemory_t, free);
    FIELD(nvmlMemory_t, used);
    SIZE(nvmlMemory_v2_t);
    FIELD(nvmlMemory_v2_t, version);
    FIELD(nvmlMemory_v2_t, total);
    FIELD(nvmlMemory_v2_t, reserved);
    FIELD(nvmlMemory_v2_t, free);
    FIELD(nvmlMemory_v2_t, used);
    SIZE(nvmlSetMemoryLimits_v1_t);
    FIELD(nvmlSetMemoryLimits_v1_t, nameSpace);
    FIELD(nvmlSetMemoryLimits_v1_t, softLimit);
    FIELD(nvmlSetMemoryLimits_v1_t, hardLimit);
    SIZE(nvmlGetMemoryLimits_v1_t);
    FIELD(nvmlGetMemoryLimits_v1_t, nameSpace);
    FIELD(nvmlGetMemoryLimits_v1_t, softLimit);
    FIELD(nvmlGetMemoryLimits_v1_t, hardLimit);
    FIELD(nvmlGetMemoryLimits_v1_t, currentUsed);
#ifdef NVML_ABI_REAL
    VALUE(nvmlMemory_v2);
#else
    printf("nvmlMemory_v2=%llu\n", (unsigned long long)NVML_MEMORY_V2);
#endif
    VALUE(NVML_DEVICE_MEMORY_LIMIT_MAX);
    VALUE(NVML_SUCCESS);
    VALUE(NVML_ERROR_UNINITIALIZED);
    VALUE(NVML_ERROR_INVALID_ARGUMENT);
    VALUE(NVML_ERROR_NOT_SUPPORTED);
    VALUE(NVML_ERROR_NO_PERMISSION);
    VALUE(NVML_ERROR_NOT_FOUND);
    VALUE(NVML_ERROR_INSUFFICIENT_SIZE);
    VALUE(NVML_ERROR_LIBRARY_NOT_FOUND);
    VALUE(NVML_ERROR_FUNCTION_NOT_FOUND);
    VALUE(NVML_ERROR_OPERATING_SYSTEM);
    VALUE(NVML_ERROR_UNKNOWN);
    return 0;
}
