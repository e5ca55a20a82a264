/* The tenant's DSO for the RTLD_DEEPBIND attack: linked against libcuda.so.1, so once it is
 * loaded with RTLD_DEEPBIND its own references bind to the driver ahead of any preload. */
#include <cuda.h>

__attribute__((visibility("default"))) int tenant_alloc(unsigned long long bytes) {
    CUdeviceptr p;
    return (int)cuMemAlloc_v2(&p, (size_t)bytes);
}
