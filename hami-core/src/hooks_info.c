/* Hooks that report memory sizes, so frameworks and nvidia-smi see the granted
 * memory instead of the whole card. Sizes are clamped, never wrapped, and NULL
 * out-pointers are tolerated. */
#include "vgpu.h"

static uint64_t min_u64(uint64_t a, uint64_t b) { return a < b ? a : b; }
static uint64_t room_left(uint64_t total, uint64_t used) { return total > used ? total - used : 0; }

static int limited(int idx) { return idx >= 0 && vgpu_ledger_limit(idx) != VGPU_UNLIMITED; }

VGPU_EXPORT CUresult cuMemGetInfo_v2(size_t *free_out, size_t *total_out) {
    if (vgpu_cuda_load() != 0) return CUDA_ERROR_NOT_INITIALIZED;
    if (!vgpu_cuda.cuMemGetInfo_v2) return CUDA_ERROR_NOT_FOUND;
    size_t free_bytes = 0, total_bytes = 0;
    CUresult rc = vgpu_cuda.cuMemGetInfo_v2(&free_bytes, &total_bytes);
    if (rc != CUDA_SUCCESS) return rc;
    int idx;
    if (vgpu_current_index(&idx) == CUDA_SUCCESS && limited(idx)) {
        uint64_t total = min_u64(vgpu_ledger_limit(idx), total_bytes);
        free_bytes = (size_t)min_u64(free_bytes, room_left(total, vgpu_ledger_used_fresh(idx)));
        total_bytes = (size_t)total;
    }
    if (free_out) *free_out = free_bytes;
    if (total_out) *total_out = total_bytes;
    return CUDA_SUCCESS;
}

VGPU_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    if (vgpu_cuda_load() != 0) return CUDA_ERROR_NOT_INITIALIZED;
    if (!vgpu_cuda.cuDeviceTotalMem_v2) return CUDA_ERROR_NOT_FOUND;
    CUresult rc = vgpu_cuda.cuDeviceTotalMem_v2(bytes, dev);
    int idx = vgpu_config_index(dev);
    if (rc == CUDA_SUCCESS && bytes && limited(idx)) *bytes = (size_t)min_u64(*bytes, vgpu_ledger_limit(idx));
    return rc;
}

/* The 32-bit entry points report the same clamped figures, saturated at 4 GiB as the driver does. */
static unsigned int u32(uint64_t v) { return v > UINT32_MAX ? UINT32_MAX : (unsigned int)v; }

VGPU_EXPORT CUresult vgpu_mem_info_v1_hook(unsigned int *free_out, unsigned int *total_out) {
    if (vgpu_cuda_load() != 0) return CUDA_ERROR_NOT_INITIALIZED;
    if (!vgpu_cuda.mem_info_v1) return CUDA_ERROR_NOT_FOUND;
    if (!free_out || !total_out) return vgpu_cuda.mem_info_v1(free_out, total_out);
    size_t free_bytes, total_bytes;
    CUresult rc = cuMemGetInfo_v2(&free_bytes, &total_bytes);
    if (rc != CUDA_SUCCESS) return rc;
    *free_out = u32(free_bytes);
    *total_out = u32(total_bytes);
    return CUDA_SUCCESS;
}

VGPU_EXPORT CUresult vgpu_total_mem_v1_hook(unsigned int *bytes, CUdevice dev) {
    if (vgpu_cuda_load() != 0) return CUDA_ERROR_NOT_INITIALIZED;
    if (!vgpu_cuda.total_mem_v1) return CUDA_ERROR_NOT_FOUND;
    if (!bytes) return vgpu_cuda.total_mem_v1(bytes, dev);
    size_t total;
    CUresult rc = cuDeviceTotalMem_v2(&total, dev);
    if (rc == CUDA_SUCCESS) *bytes = u32(total);
    return rc;
}

/* NVML reports per NVML index, which is the ledger's index (under a grant: the device's place
 * in it, by UUID). Also records the device's UUID in the shared file, for monitoring. */
static int nvml_index(nvmlDevice_t device) {
    unsigned int index;
    char uuid[96];
    if (vgpu_config_granted())
        return vgpu_nvml.nvmlDeviceGetUUID && vgpu_nvml.nvmlDeviceGetUUID(device, uuid, sizeof uuid) == NVML_SUCCESS
                   ? vgpu_config_index_of_uuid(uuid)
                   : VGPU_CLOSED_INDEX;
    if (!vgpu_nvml.nvmlDeviceGetIndex || vgpu_nvml.nvmlDeviceGetIndex(device, &index) != NVML_SUCCESS ||
        index >= VGPU_MAX_DEVICES)
        return -1;
    if (vgpu_shm_state() == VGPU_SHM_ON && vgpu_nvml.nvmlDeviceGetUUID &&
        vgpu_nvml.nvmlDeviceGetUUID(device, uuid, sizeof uuid) == NVML_SUCCESS)
        vgpu_shm_set_uuid((int)index, uuid);
    return (int)index;
}

/* The rule cuMemGetInfo follows: the card as the grant shows it, never bigger than the card
 * (total = min(limit, physical)) and never freer than the card is (free = min(room left in the
 * grant, what the driver says is free)); `total` and `free` come in as the driver's figures. */
static void granted_view(int idx, unsigned long long *total, unsigned long long *used, unsigned long long *free_bytes) {
    uint64_t physical_free = *free_bytes;
    *total = min_u64(vgpu_ledger_limit(idx), *total);
    *used = vgpu_ledger_used_fresh(idx);
    *free_bytes = min_u64(room_left(*total, *used), physical_free);
}

VGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    if (vgpu_nvml_load() != 0) return NVML_ERROR_LIBRARY_NOT_FOUND;
    if (!vgpu_nvml.nvmlDeviceGetMemoryInfo) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t rc = vgpu_nvml.nvmlDeviceGetMemoryInfo(device, memory);
    int idx = nvml_index(device);
    if (rc != NVML_SUCCESS || !memory || !limited(idx)) return rc;
    granted_view(idx, &memory->total, &memory->used, &memory->free);
    return rc;
}

VGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    if (vgpu_nvml_load() != 0) return NVML_ERROR_LIBRARY_NOT_FOUND;
    if (!vgpu_nvml.nvmlDeviceGetMemoryInfo_v2) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t rc = vgpu_nvml.nvmlDeviceGetMemoryInfo_v2(device, memory);
    int idx = nvml_index(device);
    if (rc != NVML_SUCCESS || !memory || !limited(idx)) return rc;
    memory->reserved = 0; /* driver reservations are outside the container's grant */
    granted_view(idx, &memory->total, &memory->used, &memory->free);
    return rc;
}
