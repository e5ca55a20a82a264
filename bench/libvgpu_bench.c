/* Benchmark body: T threads each run N cuMemAlloc_v2 + cuMemFree_v2 pairs on the
 * current context and the program prints the elapsed wall time. bench/libvgpu.py runs
 * it with and without libvgpu.so preloaded. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <cuda.h>

static long pairs;
static size_t size;
static pthread_barrier_t ready, go;

static void *worker(void *arg) {
    CUcontext ctx;
    int *failed = arg;
    if (cuDevicePrimaryCtxRetain(&ctx, 0) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) *failed = 1;
    pthread_barrier_wait(&ready);
    pthread_barrier_wait(&go);
    for (long i = 0; i < pairs && !*failed; i++) {
        CUdeviceptr p;
        if (cuMemAlloc_v2(&p, size) != CUDA_SUCCESS || cuMemFree_v2(p) != CUDA_SUCCESS) *failed = 1;
    }
    return NULL;
}

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s THREADS PAIRS_PER_THREAD BYTES\n", argv[0]);
        return 2;
    }
    int threads = atoi(argv[1]);
    pairs = atol(argv[2]);
    size = (size_t)atol(argv[3]);
    if (threads < 1 || threads > 256 || pairs < 1 || cuInit(0) != CUDA_SUCCESS) return 2;
    pthread_t tid[256];
    int failed[256] = {0};
    pthread_barrier_init(&ready, NULL, (unsigned)threads + 1);
    pthread_barrier_init(&go, NULL, (unsigned)threads + 1);
    for (int i = 0; i < threads; i++) pthread_create(&tid[i], NULL, worker, &failed[i]);
    pthread_barrier_wait(&ready); /* every worker has its context and waits at `go` */
    double t0 = now_ns();          /* read before any worker can start its first pair */
    pthread_barrier_wait(&go);
    for (int i = 0; i < threads; i++) pthread_join(tid[i], NULL);
    double elapsed = now_ns() - t0;
    for (int i = 0; i < threads; i++)
        if (failed[i]) return 1;
    printf("%.0f\n", elapsed);
    return 0;
}
