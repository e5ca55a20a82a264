/* Attack: a DSO loaded with RTLD_DEEPBIND, whose cuMemAlloc_v2 binds to the driver first.
 * Usage: deepbind <dso> <bytes> [hold_ms]. Prints "alloc <bytes> rc=<CUresult>" then "holding". */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <cuda.h>

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    unsigned long long bytes = strtoull(argv[2], NULL, 10);
    long hold_ms = argc > 3 ? atol(argv[3]) : 600000;
    CUcontext ctx;
    if (cuInit(0) != CUDA_SUCCESS || cuDevicePrimaryCtxRetain(&ctx, 0) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
        printf("setup failed\n");
        return 1;
    }
    void *dso = dlopen(argv[1], RTLD_NOW | RTLD_DEEPBIND);
    int (*tenant_alloc)(unsigned long long) = dso ? (int (*)(unsigned long long))dlsym(dso, "tenant_alloc") : NULL;
    if (!tenant_alloc) {
        printf("load failed: %s\n", dlerror());
        return 1;
    }
    printf("alloc %llu rc=%d\n", bytes, tenant_alloc(bytes));
    printf("holding\n");
    fflush(stdout);
    usleep((useconds_t)(hold_ms * 1000));
    return 0;
}
