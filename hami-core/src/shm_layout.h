/* Byte layout of the shared accounting file (CUDA_DEVICE_MEMORY_SHARED_CACHE), format
 * version 3. Little-endian, fixed size; shared/usage_cache.py reads the same layout, so
 * any change here needs a new version number there too. */
#ifndef VGPU_SHM_LAYOUT_H
#define VGPU_SHM_LAYOUT_H

#include <stdint.h>

#define VGPU_SHM_MAGIC 0x55504756u /* "VGPU" as little-endian bytes */
#define VGPU_SHM_VERSION 3u
#define VGPU_SHM_DEVICES 16
#define VGPU_SHM_SLOTS 1024
#define VGPU_SHM_UUID_LEN 96
#define VGPU_SHM_NO_LIMIT UINT64_MAX

struct vgpu_shm_header {         /* offset 0, 64 bytes */
    uint32_t magic;              /* 0: VGPU_SHM_MAGIC once initialised */
    uint32_t version;            /* 4 */
    uint64_t file_size;          /* 8: sizeof(struct vgpu_shm_file) */
    uint32_t device_slots;       /* 16: VGPU_SHM_DEVICES */
    uint32_t process_slots;      /* 20: VGPU_SHM_SLOTS */
    uint64_t seq;                /* 24: odd while a locked writer rebuilds slots/totals */
    uint64_t last_update_ns;     /* 32: CLOCK_REALTIME of the last locked change */
    uint32_t frozen;             /* 40: 1 while a locked writer rebuilds; fast paths wait */
    uint8_t reserved[20];        /* 44 */
};

struct vgpu_shm_device {         /* 128 bytes each; limit/used/last_update share a cache line */
    uint64_t limit;              /* 0: bytes; VGPU_SHM_NO_LIMIT = unlimited; 0 = closed */
    uint64_t used;               /* 8: bytes reserved by all processes (atomic) */
    uint64_t last_update_ns;     /* 16: CLOCK_REALTIME_COARSE of the last change to used */
    uint64_t reserved;           /* 24 */
    char uuid[VGPU_SHM_UUID_LEN]; /* 32: NVML UUID when known, NUL-terminated */
};

struct vgpu_shm_slot {           /* 192 bytes each (3 cache lines, no false sharing) */
    int32_t pid;                 /* 0: 0 = free */
    uint32_t inflight;           /* 4: operations of this process now between two updates */
    uint64_t start_time;         /* 8: /proc/<pid>/stat starttime (informative; liveness is the slot lock) */
    uint64_t used[VGPU_SHM_DEVICES]; /* 16: bytes this process holds per device (atomic) */
    uint8_t reserved[48];        /* 144 */
};

struct vgpu_shm_file {
    struct vgpu_shm_header header;                 /* 0 */
    struct vgpu_shm_device devices[VGPU_SHM_DEVICES]; /* 64 */
    struct vgpu_shm_slot slots[VGPU_SHM_SLOTS];    /* 2112 */
};                                                 /* 198720 bytes in total */

_Static_assert(sizeof(struct vgpu_shm_header) == 64, "header layout");
_Static_assert(sizeof(struct vgpu_shm_device) == 128, "device layout");
_Static_assert(sizeof(struct vgpu_shm_slot) == 192, "slot layout");
_Static_assert(sizeof(struct vgpu_shm_file) == 198720, "file layout");

#endif
