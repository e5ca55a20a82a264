/* One limit per container: all processes that name the same CUDA_DEVICE_MEMORY_SHARED_CACHE
 * account in one mapped file. Writers serialise on an OFD fcntl lock, which the kernel drops
 * when a holder dies, so SIGKILL can never leave it stuck; a seqlock lets readers (NVML,
 * the node agent) read without the lock. Dead processes' usage is reclaimed on demand. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include "shm_layout.h"
#include "vgpu.h"

#define DEFAULT_PATH "/tmp/cudevshr.cache"

static struct vgpu_shm_file *shm;
static int shm_fd = -1;
static int my_slot = -1;
static int reopen_needed;
static int shm_state = VGPU_SHM_OFF;
static pthread_mutex_t shm_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t shm_once = PTHREAD_ONCE_INIT;

static const char *shm_path(void) {
    const char *p = getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    return p && *p ? p : DEFAULT_PATH;
}

static int file_lock(int fd, short type) {
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = 0, .l_len = 0};
    while (fcntl(fd, F_OFD_SETLKW, &fl) == -1)
        if (errno != EINTR) return -1;
    return 0;
}

/* ---- seqlock writer side (always under the file lock) ---- */

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void begin_write(void) {
    __atomic_add_fetch(&shm->header.seq, 1, __ATOMIC_ACQ_REL);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

static void end_write(void) {
    shm->header.last_update_ns = now_ns();
    __atomic_add_fetch(&shm->header.seq, 1, __ATOMIC_RELEASE);
}

/* A writer killed mid-update leaves seq odd; device totals are rebuilt from the slots. */
static void repair_if_torn(void) {
    if ((__atomic_load_n(&shm->header.seq, __ATOMIC_ACQUIRE) & 1) == 0) return;
    for (int d = 0; d < VGPU_SHM_DEVICES; d++) {
        uint64_t sum = 0;
        for (int s = 0; s < VGPU_SHM_SLOTS; s++) sum += shm->slots[s].used[d];
        shm->devices[d].used = sum;
    }
    end_write();
}

/* ---- process liveness ---- */

/* starttime (field 22) and state of /proc/<pid>/stat; returns -1 when unreadable. */
static int proc_stat(int pid, uint64_t *start, char *state) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = '\0';
    char *p = strrchr(buf, ')'); /* the command name may contain spaces */
    if (!p || p[1] != ' ') return -1;
    *state = p[2];
    p += 2;
    for (int field = 3; field < 22 && p; field++) p = strchr(p + 1, ' ');
    *start = p ? strtoull(p + 1, NULL, 10) : 0;
    return 0;
}

static int process_alive(int pid, uint64_t start) {
    if (kill(pid, 0) == -1 && errno == ESRCH) return 0;
    uint64_t now_start;
    char state;
    if (proc_stat(pid, &now_start, &state) != 0) return 1; /* cannot tell: assume alive */
    return state != 'Z' && state != 'X' && (start == 0 || now_start == start);
}

static void clear_slot(int s) {
    struct vgpu_shm_slot *slot = &shm->slots[s];
    for (int d = 0; d < VGPU_SHM_DEVICES; d++) {
        uint64_t u = slot->used[d];
        shm->devices[d].used -= u < shm->devices[d].used ? u : shm->devices[d].used;
    }
    memset(slot, 0, sizeof *slot);
}

/* The driver frees a dead process's memory; the accounting follows. */
static int reclaim_dead(void) {
    int reclaimed = 0, self = getpid();
    for (int s = 0; s < VGPU_SHM_SLOTS; s++) {
        int pid = shm->slots[s].pid;
        if (pid == 0 || pid == self || process_alive(pid, shm->slots[s].start_time)) continue;
        clear_slot(s);
        reclaimed++;
    }
    return reclaimed;
}

/* ---- slots ---- */

static int find_slot(int pid) {
    for (int s = 0; s < VGPU_SHM_SLOTS; s++)
        if (shm->slots[s].pid == pid) return s;
    return -1;
}

/* A slot already carrying our pid belongs to the image we exec'd from: its memory is gone. */
static int register_slot(void) {
    int pid = getpid();
    int s = find_slot(pid);
    if (s >= 0) clear_slot(s);
    if (s < 0) s = find_slot(0);
    if (s < 0 && reclaim_dead() > 0) s = find_slot(0);
    if (s < 0) return -1;
    uint64_t start = 0;
    char state;
    proc_stat(pid, &start, &state);
    shm->slots[s].start_time = start;
    shm->slots[s].pid = pid;
    return s;
}

/* ---- attach ---- */

static int header_valid(void) {
    const struct vgpu_shm_header *h = &shm->header;
    return h->magic == VGPU_SHM_MAGIC && h->version == VGPU_SHM_VERSION &&
           h->file_size == sizeof(struct vgpu_shm_file) && h->device_slots == VGPU_SHM_DEVICES &&
           h->process_slots == VGPU_SHM_SLOTS;
}

static void initialise_file(void) {
    memset(shm, 0, sizeof *shm);
    for (int d = 0; d < VGPU_SHM_DEVICES; d++) shm->devices[d].limit = vgpu_config_limit(d);
    shm->header.version = VGPU_SHM_VERSION;
    shm->header.file_size = sizeof(struct vgpu_shm_file);
    shm->header.device_slots = VGPU_SHM_DEVICES;
    shm->header.process_slots = VGPU_SHM_SLOTS;
    shm->header.last_update_ns = now_ns();
    __atomic_store_n(&shm->header.magic, VGPU_SHM_MAGIC, __ATOMIC_RELEASE);
}

static void warn_if_limits_differ(void) {
    for (int d = 0; d < VGPU_SHM_DEVICES; d++) {
        if (shm->devices[d].limit == vgpu_config_limit(d)) continue;
        vgpu_log(VGPU_LOG_WARN, "memory limits in the environment differ from %s (device %d: %llu there); "
                 "keeping the shared file's limits", shm_path(), d, (unsigned long long)shm->devices[d].limit);
        return;
    }
}

static int fail(int fd, const char *what) {
    vgpu_log(VGPU_LOG_ERROR, "shared accounting file %s %s; allocations with a limit will fail", shm_path(), what);
    if (fd >= 0) close(fd);
    return VGPU_SHM_BROKEN;
}

static int map_file(int fd) {
    struct stat st;
    if (fstat(fd, &st) != 0) return fail(fd, "cannot be read");
    int fresh = st.st_size == 0;
    if (fresh && (ftruncate(fd, sizeof(struct vgpu_shm_file)) != 0 || fchmod(fd, 0666) != 0))
        return fail(fd, "cannot be sized");
    if (!fresh && st.st_size != (off_t)sizeof(struct vgpu_shm_file)) return fail(fd, "has the wrong size (corrupt or foreign)");
    void *p = mmap(NULL, sizeof(struct vgpu_shm_file), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return fail(fd, "cannot be mapped");
    shm = p;
    if (shm->header.magic == 0 && shm->header.version == 0) initialise_file(); /* new, or creator died */
    if (!header_valid()) {
        munmap(p, sizeof(struct vgpu_shm_file));
        shm = NULL;
        return fail(fd, "has a bad magic number or version (corrupt or foreign)");
    }
    if (!fresh) warn_if_limits_differ();
    repair_if_torn();
    return VGPU_SHM_ON;
}

static void after_fork_in_child(void) {
    vgpu_track_after_fork();
    pthread_mutex_init(&shm_lock, NULL);
    reopen_needed = 1; /* the inherited fd shares the parent's lock */
    my_slot = -1;
}

static void attach_once(void) {
    vgpu_config_init();
    int fd = open(shm_path(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) {
        vgpu_log(VGPU_LOG_WARN, "cannot open %s (%s); limits apply per process only", shm_path(), strerror(errno));
        return;
    }
    if (file_lock(fd, F_WRLCK) != 0) {
        shm_state = fail(fd, "cannot be locked");
        return;
    }
    shm_state = map_file(fd);
    if (shm_state != VGPU_SHM_ON) return;
    shm_fd = fd;
    file_lock(fd, F_UNLCK);
    pthread_atfork(NULL, NULL, after_fork_in_child);
}

int vgpu_shm_state(void) {
    pthread_once(&shm_once, attach_once);
    return shm_state;
}

/* ---- locked operations ---- */

static int lock_shared(void) {
    pthread_mutex_lock(&shm_lock);
    if (reopen_needed) {
        int fd = open(shm_path(), O_RDWR | O_CLOEXEC);
        if (fd >= 0) {
            close(shm_fd);
            shm_fd = fd;
            reopen_needed = 0;
        }
    }
    if (reopen_needed || file_lock(shm_fd, F_WRLCK) != 0) {
        pthread_mutex_unlock(&shm_lock);
        return -1;
    }
    repair_if_torn();
    return 0;
}

static void unlock_shared(void) {
    file_lock(shm_fd, F_UNLCK);
    pthread_mutex_unlock(&shm_lock);
}

static int fits(int idx, uint64_t bytes) {
    uint64_t limit = shm->devices[idx].limit, used = shm->devices[idx].used;
    return bytes <= limit && used <= limit - bytes;
}

int vgpu_shm_reserve(int idx, uint64_t bytes) {
    if (lock_shared() != 0) return 0;
    begin_write();
    if (my_slot < 0 || shm->slots[my_slot].pid != getpid()) my_slot = register_slot();
    if (my_slot >= 0 && !fits(idx, bytes)) reclaim_dead();
    int ok = my_slot >= 0 && fits(idx, bytes);
    if (ok) {
        shm->slots[my_slot].used[idx] += bytes;
        shm->devices[idx].used += bytes;
    }
    end_write();
    unlock_shared();
    if (my_slot < 0) vgpu_log(VGPU_LOG_ERROR, "no free process slot in %s", shm_path());
    return ok;
}

void vgpu_shm_release(int idx, uint64_t bytes) {
    if (lock_shared() != 0) return;
    begin_write();
    if (my_slot >= 0 && shm->slots[my_slot].pid == getpid()) {
        uint64_t *mine = &shm->slots[my_slot].used[idx];
        uint64_t n = bytes < *mine ? bytes : *mine;
        *mine -= n;
        shm->devices[idx].used -= n < shm->devices[idx].used ? n : shm->devices[idx].used;
    }
    end_write();
    unlock_shared();
}

/* Readers that report usage first drop dead processes, so freed memory shows as free. */
uint64_t vgpu_shm_used(int idx, int refresh) {
    if (refresh && lock_shared() == 0) {
        begin_write();
        reclaim_dead();
        end_write();
        unlock_shared();
    }
    return __atomic_load_n(&shm->devices[idx].used, __ATOMIC_ACQUIRE);
}

uint64_t vgpu_shm_limit(int idx) { return shm->devices[idx].limit; }

void vgpu_shm_set_uuid(int idx, const char *uuid) {
    if (strncmp(shm->devices[idx].uuid, uuid, VGPU_SHM_UUID_LEN - 1) == 0 || lock_shared() != 0) return;
    begin_write();
    snprintf(shm->devices[idx].uuid, VGPU_SHM_UUID_LEN, "%s", uuid);
    end_write();
    unlock_shared();
}
