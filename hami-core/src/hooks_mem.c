/* Driver hooks that allocate or release device memory. Each allocation reserves its
 * size in the ledger before the driver is called and is tracked by handle afterwards,
 * so the matching free gives back exactly what was charged. */
#include "vgpu.h"

typedef CUresult (*undo_fn)(uint64_t key);

CUresult vgpu_current_index(int *idx) {
    CUdevice dev;
    if (!vgpu_cuda.cuCtxGetDevice) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = vgpu_cuda.cuCtxGetDevice(&dev);
    if (rc != CUDA_SUCCESS) return rc;
    *idx = vgpu_config_index(dev);
    return *idx < 0 ? CUDA_ERROR_INVALID_DEVICE : CUDA_SUCCESS;
}

/* Loads the driver on first use; a driver without this entry point cannot be forwarded to. */
#define REQUIRE(fn)                                                      \
    do {                                                                 \
        if (vgpu_cuda_load() != 0) return CUDA_ERROR_NOT_INITIALIZED;    \
        if (!vgpu_cuda.fn) return CUDA_ERROR_NOT_FOUND;                  \
    } while (0)

static CUresult charge(int idx, uint64_t bytes) {
    if (vgpu_ledger_reserve(idx, bytes)) return CUDA_SUCCESS;
    vgpu_log(VGPU_LOG_INFO, "device %d: %llu + %llu bytes exceeds the limit of %llu", idx,
             (unsigned long long)vgpu_ledger_used(idx), (unsigned long long)bytes,
             (unsigned long long)vgpu_ledger_limit(idx));
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* After the driver answered: keep the charge and remember the handle, or give it back. */
static CUresult settle(CUresult rc, enum vgpu_kind kind, uint64_t key, int idx, uint64_t bytes,
                       undo_fn undo) {
    if (rc != CUDA_SUCCESS) {
        vgpu_ledger_release(idx, bytes);
        return rc;
    }
    if (vgpu_track_add(kind, key, idx, bytes) == 0) return CUDA_SUCCESS;
    undo(key); /* cannot track it, so it must not exist */
    vgpu_ledger_release(idx, bytes);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* Called after the driver's release; untracked handles were never charged. */
static void uncharge(int taken, CUresult rc, enum vgpu_kind kind, uint64_t key, int idx,
                     uint64_t bytes) {
    if (!taken) return;
    if (rc == CUDA_SUCCESS || vgpu_track_add(kind, key, idx, bytes) != 0)
        vgpu_ledger_release(idx, bytes);
}

static CUresult undo_ptr(uint64_t key) { return vgpu_cuda.cuMemFree_v2((CUdeviceptr)key); }
static CUresult undo_vmm(uint64_t key) { return vgpu_cuda.cuMemRelease(key); }
static CUresult undo_array(uint64_t key) { return vgpu_cuda.cuArrayDestroy((CUarray)(uintptr_t)key); }
static CUresult undo_mipmap(uint64_t key) {
    return vgpu_cuda.cuMipmappedArrayDestroy((CUmipmappedArray)(uintptr_t)key);
}

/* ---- linear device memory ---- */

VGPU_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    REQUIRE(cuMemAlloc_v2);
    int idx;
    CUresult rc = vgpu_current_index(&idx);
    if (!dptr || rc != CUDA_SUCCESS) return dptr ? rc : vgpu_cuda.cuMemAlloc_v2(dptr, bytesize);
    if ((rc = charge(idx, bytesize)) != CUDA_SUCCESS) return rc;
    rc = vgpu_cuda.cuMemAlloc_v2(dptr, bytesize);
    return settle(rc, VGPU_KIND_PTR, rc == CUDA_SUCCESS ? *dptr : 0, idx, bytesize, undo_ptr);
}

/* The legacy 32-bit entry point is refused wherever a limit applies: counting it would need
 * a second pointer width through tracking and every free path for an ABI no current
 * toolkit emits, and leaving it uncounted would be a way around the limit. Without a limit
 * it is the driver's, untouched. */
VGPU_EXPORT CUresult vgpu_legacy_alloc_hook(unsigned int *dptr, unsigned int bytesize) {
    REQUIRE(legacy_alloc);
    int idx;
    CUresult rc = vgpu_current_index(&idx);
    if (!dptr || rc != CUDA_SUCCESS) return dptr ? rc : vgpu_cuda.legacy_alloc(dptr, bytesize);
    if (vgpu_ledger_limit(idx) == VGPU_UNLIMITED) return vgpu_cuda.legacy_alloc(dptr, bytesize);
    vgpu_log(VGPU_LOG_INFO, "device %d: the legacy 32-bit cuMemAlloc is not supported under a memory limit", idx);
    return CUDA_ERROR_NOT_SUPPORTED;
}

VGPU_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    REQUIRE(cuMemAllocManaged);
    int idx;
    CUresult rc = vgpu_current_index(&idx);
    if (!dptr || rc != CUDA_SUCCESS) return dptr ? rc : vgpu_cuda.cuMemAllocManaged(dptr, bytesize, flags);
    if ((rc = charge(idx, bytesize)) != CUDA_SUCCESS) return rc;
    rc = vgpu_cuda.cuMemAllocManaged(dptr, bytesize, flags);
    return settle(rc, VGPU_KIND_PTR, rc == CUDA_SUCCESS ? *dptr : 0, idx, bytesize, undo_ptr);
}

/* The driver picks the pitch, so charge the minimum first and top up to pitch * height. */
static CUresult adjust_pitch_charge(CUdeviceptr ptr, int idx, uint64_t charged, uint64_t actual) {
    if (actual < charged) vgpu_ledger_release(idx, charged - actual);
    if (actual <= charged || vgpu_ledger_reserve(idx, actual - charged)) return CUDA_SUCCESS;
    vgpu_cuda.cuMemFree_v2(ptr);
    vgpu_ledger_release(idx, charged);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

VGPU_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
                                        size_t Height, unsigned int ElementSizeBytes) {
    REQUIRE(cuMemAllocPitch_v2);
    int idx;
    uint64_t estimate;
    CUresult rc = vgpu_current_index(&idx);
    if (!dptr || !pPitch || rc != CUDA_SUCCESS)
        return rc != CUDA_SUCCESS && dptr && pPitch
                   ? rc
                   : vgpu_cuda.cuMemAllocPitch_v2(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    if (__builtin_mul_overflow((uint64_t)WidthInBytes, (uint64_t)Height, &estimate))
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = charge(idx, estimate)) != CUDA_SUCCESS) return rc;
    rc = vgpu_cuda.cuMemAllocPitch_v2(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    if (rc != CUDA_SUCCESS) return settle(rc, VGPU_KIND_PTR, 0, idx, estimate, undo_ptr);
    uint64_t actual = (uint64_t)*pPitch * Height;
    if ((rc = adjust_pitch_charge(*dptr, idx, estimate, actual)) != CUDA_SUCCESS) return rc;
    return settle(CUDA_SUCCESS, VGPU_KIND_PTR, *dptr, idx, actual, undo_ptr);
}

static CUresult free_ptr(CUdeviceptr dptr, CUresult (*release)(CUdeviceptr, CUstream), CUstream stream) {
    int idx = 0;
    uint64_t bytes = 0;
    int taken = dptr != 0 && vgpu_track_take(VGPU_KIND_PTR, dptr, &idx, &bytes);
    CUresult rc = release ? release(dptr, stream) : vgpu_cuda.cuMemFree_v2(dptr);
    uncharge(taken, rc, VGPU_KIND_PTR, dptr, idx, bytes);
    return rc;
}

VGPU_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
    REQUIRE(cuMemFree_v2);
    return free_ptr(dptr, NULL, NULL);
}

/* ---- stream-ordered allocations ---- */

typedef CUresult (*alloc_async_fn)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*alloc_pool_fn)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);

static CUresult alloc_stream_ordered(alloc_async_fn real_async, alloc_pool_fn real_pool, CUdeviceptr *dptr,
                                     size_t bytesize, CUmemoryPool pool, CUstream stream) {
    int idx;
    CUresult rc = vgpu_current_index(&idx);
    if (dptr && rc != CUDA_SUCCESS) return rc;
    if (dptr && (rc = charge(idx, bytesize)) != CUDA_SUCCESS) return rc;
    rc = real_async ? real_async(dptr, bytesize, stream) : real_pool(dptr, bytesize, pool, stream);
    if (!dptr) return rc;
    return settle(rc, VGPU_KIND_PTR, rc == CUDA_SUCCESS ? *dptr : 0, idx, bytesize, undo_ptr);
}

VGPU_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    REQUIRE(cuMemAllocAsync);
    return alloc_stream_ordered(vgpu_cuda.cuMemAllocAsync, NULL, dptr, bytesize, NULL, hStream);
}

VGPU_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    REQUIRE(cuMemAllocAsync_ptsz);
    return alloc_stream_ordered(vgpu_cuda.cuMemAllocAsync_ptsz, NULL, dptr, bytesize, NULL, hStream);
}

VGPU_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                             CUstream hStream) {
    REQUIRE(cuMemAllocFromPoolAsync);
    return alloc_stream_ordered(NULL, vgpu_cuda.cuMemAllocFromPoolAsync, dptr, bytesize, pool, hStream);
}

VGPU_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                                  CUstream hStream) {
    REQUIRE(cuMemAllocFromPoolAsync_ptsz);
    return alloc_stream_ordered(NULL, vgpu_cuda.cuMemAllocFromPoolAsync_ptsz, dptr, bytesize, pool, hStream);
}

VGPU_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    REQUIRE(cuMemFreeAsync);
    return free_ptr(dptr, vgpu_cuda.cuMemFreeAsync, hStream);
}

VGPU_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) {
    REQUIRE(cuMemFreeAsync_ptsz);
    return free_ptr(dptr, vgpu_cuda.cuMemFreeAsync_ptsz, hStream);
}

/* ---- virtual memory management: only physical memory placed on a device counts ---- */

VGPU_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                                 const CUmemAllocationProp *prop, unsigned long long flags) {
    REQUIRE(cuMemCreate);
    int idx = -1;
    if (handle && prop && prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE)
        idx = vgpu_config_index(prop->location.id);
    if (idx < 0) return vgpu_cuda.cuMemCreate(handle, size, prop, flags);
    CUresult rc = charge(idx, size);
    if (rc != CUDA_SUCCESS) return rc;
    rc = vgpu_cuda.cuMemCreate(handle, size, prop, flags);
    return settle(rc, VGPU_KIND_VMM, rc == CUDA_SUCCESS ? *handle : 0, idx, size, undo_vmm);
}

VGPU_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    REQUIRE(cuMemRelease);
    int idx = 0;
    uint64_t bytes = 0;
    int taken = vgpu_track_take(VGPU_KIND_VMM, handle, &idx, &bytes);
    CUresult rc = vgpu_cuda.cuMemRelease(handle);
    uncharge(taken, rc, VGPU_KIND_VMM, handle, idx, bytes);
    return rc;
}

/* ---- CUDA arrays: charged by an estimate of their footprint ---- */

static uint64_t format_bytes(CUarray_format format) {
    switch (format) {
        case CU_AD_FORMAT_UNSIGNED_INT8:
        case CU_AD_FORMAT_SIGNED_INT8: return 1;
        case CU_AD_FORMAT_UNSIGNED_INT16:
        case CU_AD_FORMAT_SIGNED_INT16:
        case CU_AD_FORMAT_HALF: return 2;
        default: return 4; /* 32-bit and exotic formats: err on the generous side */
    }
}

static uint64_t at_least_one(size_t v) { return v ? (uint64_t)v : 1; }

static uint64_t array_bytes(size_t w, size_t h, size_t d, unsigned channels, CUarray_format format) {
    uint64_t bytes = at_least_one(w);
    uint64_t factors[] = {at_least_one(h), at_least_one(d), at_least_one(channels), format_bytes(format)};
    for (size_t i = 0; i < sizeof factors / sizeof factors[0]; i++)
        if (__builtin_mul_overflow(bytes, factors[i], &bytes)) return UINT64_MAX;
    return bytes;
}

static uint64_t mipmap_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels) {
    uint64_t total = 0;
    for (unsigned l = 0; l < levels && l < 64; l++) {
        uint64_t level = array_bytes(d->Width >> l, d->Height >> l, d->Depth >> l, d->NumChannels, d->Format);
        if (__builtin_add_overflow(total, level, &total)) return UINT64_MAX;
    }
    return total;
}

VGPU_EXPORT CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *desc) {
    REQUIRE(cuArrayCreate_v2);
    int idx;
    CUresult rc = vgpu_current_index(&idx);
    if (!pHandle || !desc || rc != CUDA_SUCCESS)
        return rc != CUDA_SUCCESS && pHandle && desc ? rc : vgpu_cuda.cuArrayCreate_v2(pHandle, desc);
    uint64_t bytes = array_bytes(desc->Width, desc->Height, 1, desc->NumChannels, desc->Format);
    if ((rc = charge(idx, bytes)) != CUDA_SUCCESS) return rc;
    rc = vgpu_cuda.cuArrayCreate_v2(pHandle, desc);
    return settle(rc, VGPU_KIND_ARRAY, rc == CUDA_SUCCESS ? (uintptr_t)*pHandle : 0, idx, bytes, undo_array);
}

VGPU_EXPORT CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc) {
    REQUIRE(cuArray3DCreate_v2);
    int idx;
    CUresult rc = vgpu_current_index(&idx);
    if (!pHandle || !desc || rc != CUDA_SUCCESS)
        return rc != CUDA_SUCCESS && pHandle && desc ? rc : vgpu_cuda.cuArray3DCreate_v2(pHandle, desc);
    uint64_t bytes = array_bytes(desc->Width, desc->Height, desc->Depth, desc->NumChannels, desc->Format);
    if ((rc = charge(idx, bytes)) != CUDA_SUCCESS) return rc;
    rc = vgpu_cuda.cuArray3DCreate_v2(pHandle, desc);
    return settle(rc, VGPU_KIND_ARRAY, rc == CUDA_SUCCESS ? (uintptr_t)*pHandle : 0, idx, bytes, undo_array);
}

VGPU_EXPORT CUresult cuArrayDestroy(CUarray hArray) {
    REQUIRE(cuArrayDestroy);
    int idx = 0;
    uint64_t bytes = 0;
    int taken = vgpu_track_take(VGPU_KIND_ARRAY, (uintptr_t)hArray, &idx, &bytes);
    CUresult rc = vgpu_cuda.cuArrayDestroy(hArray);
    uncharge(taken, rc, VGPU_KIND_ARRAY, (uintptr_t)hArray, idx, bytes);
    return rc;
}

VGPU_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                            unsigned int numMipmapLevels) {
    REQUIRE(cuMipmappedArrayCreate);
    int idx;
    CUresult rc = vgpu_current_index(&idx);
    if (!pHandle || !desc || rc != CUDA_SUCCESS)
        return rc != CUDA_SUCCESS && pHandle && desc
                   ? rc
                   : vgpu_cuda.cuMipmappedArrayCreate(pHandle, desc, numMipmapLevels);
    uint64_t bytes = mipmap_bytes(desc, numMipmapLevels);
    if ((rc = charge(idx, bytes)) != CUDA_SUCCESS) return rc;
    rc = vgpu_cuda.cuMipmappedArrayCreate(pHandle, desc, numMipmapLevels);
    return settle(rc, VGPU_KIND_MIPMAP, rc == CUDA_SUCCESS ? (uintptr_t)*pHandle : 0, idx, bytes,
                  undo_mipmap);
}

VGPU_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray) {
    REQUIRE(cuMipmappedArrayDestroy);
    int idx = 0;
    uint64_t bytes = 0;
    uint64_t key = (uintptr_t)hMipmappedArray;
    int taken = vgpu_track_take(VGPU_KIND_MIPMAP, key, &idx, &bytes);
    CUresult rc = vgpu_cuda.cuMipmappedArrayDestroy(hMipmappedArray);
    uncharge(taken, rc, VGPU_KIND_MIPMAP, key, idx, bytes);
    return rc;
}
