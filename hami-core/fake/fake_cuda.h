/* Test-only interface of the fake libcuda.so.1: ground-truth counters that tests
 * read (via dlsym) to check what really reached the "driver". */
#ifndef FAKE_CUDA_H
#define FAKE_CUDA_H

typedef struct {
    unsigned long long total;     /* simulated physical memory */
    unsigned long long used;      /* bytes currently allocated */
    unsigned long long peak;      /* highest value of used ever seen */
    unsigned long long allocs;    /* successful allocations */
    unsigned long long frees;     /* successful releases */
    unsigned long long bad_frees; /* releases of handles the fake never issued */
    unsigned long long reserved;  /* what the driver spends outside allocations: contexts, limits, modules */
} fake_cuda_stats;

/* physical_index ignores CUDA_VISIBLE_DEVICES; FAKE_CUDA_HOST_SLOT reports host VMM
 * memory (cuMemCreate on a host location). Returns 0 on success. */
#define FAKE_CUDA_HOST_SLOT 16
typedef int (*fake_cuda_stats_fn)(int physical_index, fake_cuda_stats *out);
#define FAKE_CUDA_STATS_SYMBOL "fakeCudaStats"

#endif
