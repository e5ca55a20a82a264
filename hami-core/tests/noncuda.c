/* A program that never touches CUDA: prints the process state libvgpu must not change
 * (umask, signal handlers, dlsym results) so a test can compare runs with and without it. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

/* With "call-hook": calls libvgpu's cuMemAlloc_v2 although no driver can be loaded. */
static int call_hook(void) {
    typedef int (*alloc_fn)(unsigned long long *, size_t);
    alloc_fn alloc = (alloc_fn)dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
    unsigned long long ptr = 0;
    printf("hook=%d rc=%d\n", alloc != NULL, alloc ? alloc(&ptr, 1) : -1);
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "call-hook") == 0) return call_hook();
    mode_t mask = umask(022);
    umask(mask);
    int custom = 0;
    for (int sig = 1; sig < NSIG; sig++) {
        struct sigaction sa;
        if (sigaction(sig, NULL, &sa) == 0 && sa.sa_handler != SIG_DFL) custom++;
    }
    void *self = dlopen(NULL, RTLD_NOW);
    size_t (*len)(const char *) = (size_t (*)(const char *))dlsym(RTLD_DEFAULT, "strlen");
    int (*put)(const char *) = (int (*)(const char *))dlsym(RTLD_NEXT, "puts");
    void *missing = dlsym(self, "cuNoSuchFunction");
    printf("umask=%03o handlers=%d strlen=%zu puts=%d missing=%d\n", (unsigned)mask, custom,
           len ? len("hello") : 0, put == puts, missing == NULL);
    dlclose(self);
    return 0;
}
