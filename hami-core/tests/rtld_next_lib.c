/* An interposer that chains with dlsym(RTLD_NEXT): it must get libc's getppid, not its own,
 * which only holds if libvgpu's dlsym keeps the caller when forwarding. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <unistd.h>

__attribute__((visibility("default"))) pid_t getppid(void) {
    pid_t (*next)(void) = (pid_t (*)(void))dlsym(RTLD_NEXT, "getppid");
    if (!next) return -1;
    if (next == getppid) return -2; /* would recurse forever */
    return next();
}
