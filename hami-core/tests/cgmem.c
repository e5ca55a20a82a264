/* Test program for NVML 13.4's per-cgroup memory limits: an application linked to the driver by soname
 * (libcuda.so.1 and libnvidia-ml.so.1), running a script of calls given on the command line and printing
 * one line per observation, "<step> key=value ...", so pytest can check what the driver answered.
 *
 *   init                 cuInit, the primary context of device 0 made current, nvmlInit_v2
 *   alloc BYTES          cuMemAlloc_v2             -> "alloc rc=R"
 *   managed BYTES        cuMemAllocManaged         -> "managed rc=R"
 *   ctx                  cuCtxCreate on device 0 -> "ctx rc=R" (its overhead counts too)
 *   free N               cuMemFree_v2 of the N-th successful alloc (from 0) -> "free rc=R"
 *   cuinfo               cuMemGetInfo_v2           -> "cuinfo rc=R free=F total=T"
 *   nvinfo               nvmlDeviceGetMemoryInfo_v2 -> "nvinfo rc=R total=T free=F used=U"
 *   nvinfo1              nvmlDeviceGetMemoryInfo   -> "nvinfo1 rc=R total=T free=F used=U"
 *   set PATH SOFT HARD   nvmlDeviceSetMemoryLimits_v1 ("max": NVML_DEVICE_MEMORY_LIMIT_MAX) -> "set rc=R"
 *   get PATH             nvmlDeviceGetMemoryLimits_v1 -> "get rc=R soft=S hard=H used=U"
 *   version              cuDriverGetVersion, nvmlSystemGet{Driver,NVML,CudaDriver}Version
 *   wait                 "waiting", then one line from stdin before going on (the test moves things)
 * PATH "null" passes a NULL nameSpace. Every call is on device 0. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cuda.h>
#include "nvml_subset.h"

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length);
nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length);
nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version);

static CUdeviceptr ptrs[256];
static int nptrs;
static nvmlDevice_t nvml_dev;

static unsigned long long number(const char *text) {
    return strcmp(text, "max") == 0 ? NVML_DEVICE_MEMORY_LIMIT_MAX : strtoull(text, NULL, 0);
}

static const char *name_space(const char *text) { return strcmp(text, "null") == 0 ? NULL : text; }

static int need(int i, int n, int argc, const char *step) {
    if (i + n < argc) return 1;
    fprintf(stderr, "cgmem: %s needs %d argument(s)\n", step, n);
    exit(2);
}

static void init(void) {
    CUdevice dev;
    CUcontext ctx;
    int rc = cuInit(0);
    if (!rc) rc = cuDeviceGet(&dev, 0);
    if (!rc) rc = cuDevicePrimaryCtxRetain(&ctx, dev);
    if (!rc) rc = cuCtxSetCurrent(ctx);
    int nv = nvmlInit_v2();
    if (!nv) nv = nvmlDeviceGetHandleByIndex_v2(0, &nvml_dev);
    printf("init rc=%d nvml=%d\n", rc, nv);
}

static void version(void) {
    int cuda = 0, nvcuda = 0;
    char driver[80] = "", nvml[80] = "";
    cuDriverGetVersion(&cuda);
    nvmlSystemGetDriverVersion(driver, sizeof driver);
    nvmlSystemGetNVMLVersion(nvml, sizeof nvml);
    nvmlSystemGetCudaDriverVersion(&nvcuda);
    printf("version cuda=%d driver=%s nvml=%s nvcuda=%d\n", cuda, driver, nvml, nvcuda);
}

static void alloc(const char *step, unsigned long long bytes, int managed) {
    CUdeviceptr p = 0;
    int rc = managed ? cuMemAllocManaged(&p, bytes, CU_MEM_ATTACH_GLOBAL) : cuMemAlloc_v2(&p, bytes);
    if (rc == 0 && nptrs < (int)(sizeof ptrs / sizeof ptrs[0])) ptrs[nptrs++] = p;
    printf("%s rc=%d\n", step, rc);
}

static void memory_info(int v2) {
    if (v2) {
        nvmlMemory_v2_t m = {.version = NVML_MEMORY_V2};
        int rc = nvmlDeviceGetMemoryInfo_v2(nvml_dev, &m);
        printf("nvinfo rc=%d total=%llu free=%llu used=%llu\n", rc, m.total, m.free, m.used);
    } else {
        nvmlMemory_t m = {0};
        int rc = nvmlDeviceGetMemoryInfo(nvml_dev, &m);
        printf("nvinfo1 rc=%d total=%llu free=%llu used=%llu\n", rc, m.total, m.free, m.used);
    }
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (int i = 1; i < argc; i++) {
        const char *step = argv[i];
        if (!strcmp(step, "init")) {
            init();
        } else if (!strcmp(step, "alloc") && need(i, 1, argc, step)) {
            alloc(step, number(argv[++i]), 0);
        } else if (!strcmp(step, "managed") && need(i, 1, argc, step)) {
            alloc(step, number(argv[++i]), 1);
        } else if (!strcmp(step, "ctx")) {
            CUcontext ctx;
            CUcontext primary;
            cuCtxGetCurrent(&primary);
            printf("ctx rc=%d\n", cuCtxCreate(&ctx, NULL, 0, 0));
            cuCtxSetCurrent(primary);
        } else if (!strcmp(step, "free") && need(i, 1, argc, step)) {
            int n = atoi(argv[++i]);
            printf("free rc=%d\n", n >= 0 && n < nptrs ? (int)cuMemFree_v2(ptrs[n]) : -1);
        } else if (!strcmp(step, "cuinfo")) {
            size_t free_bytes = 0, total = 0;
            int rc = cuMemGetInfo_v2(&free_bytes, &total);
            printf("cuinfo rc=%d free=%zu total=%zu\n", rc, free_bytes, total);
        } else if (!strcmp(step, "nvinfo") || !strcmp(step, "nvinfo1")) {
            memory_info(!strcmp(step, "nvinfo"));
        } else if (!strcmp(step, "set") && need(i, 3, argc, step)) {
            nvmlSetMemoryLimits_v1_t limits = {name_space(argv[i + 1]), number(argv[i + 2]), number(argv[i + 3])};
            i += 3;
            printf("set rc=%d\n", nvmlDeviceSetMemoryLimits_v1(nvml_dev, &limits));
        } else if (!strcmp(step, "get") && need(i, 1, argc, step)) {
            nvmlGetMemoryLimits_v1_t limits = {.nameSpace = name_space(argv[++i])};
            int rc = nvmlDeviceGetMemoryLimits_v1(nvml_dev, &limits);
            printf("get rc=%d soft=%llu hard=%llu used=%llu\n", rc, limits.softLimit, limits.hardLimit,
                   limits.currentUsed);
        } else if (!strcmp(step, "version")) {
            version();
        } else if (!strcmp(step, "wait")) {
            char line[64];
            printf("waiting\n");
            if (!fgets(line, sizeof line, stdin)) return 0;
        } else {
            fprintf(stderr, "cgmem: unknown step %s\n", step);
            return 2;
        }
    }
    return 0;
}
