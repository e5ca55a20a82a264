/* Many small GPU processes at once, for the enforcer's benchmark: forks <n> children that each
 * allocate <bytes> on device 0 through the (fake) driver and keep it until killed; prints "ready"
 * once every child holds its memory. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <cuda.h>

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    int n = atoi(argv[1]);
    size_t bytes = (size_t)strtoull(argv[2], NULL, 10);
    int ready[2];
    if (pipe(ready) != 0 || cuInit(0) != CUDA_SUCCESS) return 1;
    for (int i = 0; i < n; i++) {
        pid_t pid = fork();
        if (pid < 0) return 1;
        if (pid == 0) {
            CUcontext ctx;
            CUdeviceptr p;
            char ok = cuDevicePrimaryCtxRetain(&ctx, 0) == CUDA_SUCCESS && cuCtxSetCurrent(ctx) == CUDA_SUCCESS &&
                      cuMemAlloc_v2(&p, bytes) == CUDA_SUCCESS;
            if (write(ready[1], &ok, 1) != 1) _exit(1);
            for (;;) pause();
        }
    }
    int held = 0;
    for (int i = 0; i < n; i++) {
        char ok = 0;
        if (read(ready[0], &ok, 1) == 1 && ok) held++;
    }
    printf("ready %d\n", held);
    fflush(stdout);
    for (;;) pause();
}
