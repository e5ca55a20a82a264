/* One limit per container: all processes that name the same CUDA_DEVICE_MEMORY_SHARED_CACHE
 * account in one mapped file. Reserve and release are lock-free atomics on the mapping; an
 * OFD fcntl lock on the header (dropped by the kernel when its holder dies) serialises only
 * the rare structural work, and each process holds an OFD lock on its own slot for its whole
 * life: that lock, not PID visibility, is what says a slot's process is alive. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include "shm_layout.h"
#include "vgpu.h"

/* How long a rebuild waits for live processes to finish the operation they are in. A
 * process stopped mid-operation (SIGSTOP, debugger) makes the rebuild give up, not hang. */
#define DRAIN_TIMEOUT_NS 500000000ull

enum { FIT, NO_FIT, FROZEN };

static struct vgpu_shm_file *shm;
static struct vgpu_shm_slot *my_slot; /* NULL until this process's first charge */
static int my_pid;
static int shm_fd = -1;
static int reopen_needed;
static char path_buf[4096]; /* captured at attach: the fork handler must not call getenv */
static int shm_state = VGPU_SHM_OFF;
static int granted; /* captured at attach */
/* Under a grant, its limits, copied at attach onto cache lines of their own: read on every
 * reservation, so nothing written often may share them (8 threads paid ~20 ns a pair for that). */
static uint64_t granted_limits[VGPU_SHM_DEVICES] __attribute__((aligned(64)));
static pthread_mutex_t shm_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t shm_once = PTHREAD_ONCE_INIT;

static const char *shm_path(void) { return path_buf[0] ? path_buf : vgpu_config_state_path(); }

/* Under a grant its limits bound every reservation: the file is the tenant's to rewrite. */
static uint64_t limit_of(struct vgpu_shm_device *dev, int idx) {
    return granted ? granted_limits[idx] : __atomic_load_n(&dev->limit, __ATOMIC_RELAXED);
}

/* The longest wait for the structural lock. Its holders only do short structural work, so a
 * holder that keeps it this long is stopped or hostile (any process of the container can take
 * it): the waiter fails closed instead of hanging in CUDA init with no word. */
#define LOCK_TIMEOUT_S 5
#define LOCK_TIMEOUT_NS (LOCK_TIMEOUT_S * 1000000000ull)
#define LOCK_POLL_MAX_NS 2000000l

static uint64_t clock_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The structural lock covers the header only: slot ranges carry the liveness locks. Linux has
 * no timed F_OFD_SETLKW (and a library may not take a signal for one), so a busy lock is polled
 * with a growing pause until the deadline; ETIMEDOUT then. */
static int file_lock(int fd, short type) {
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = 0,
                       .l_len = sizeof(struct vgpu_shm_header)};
    uint64_t deadline = clock_ns(CLOCK_MONOTONIC) + LOCK_TIMEOUT_NS;
    long pause_ns = 20000;
    while (fcntl(fd, F_OFD_SETLK, &fl) == -1) {
        if (errno != EAGAIN && errno != EACCES && errno != EINTR) return -1;
        if (clock_ns(CLOCK_MONOTONIC) >= deadline) {
            errno = ETIMEDOUT;
            return -1;
        }
        nanosleep(&(struct timespec){.tv_nsec = pause_ns}, NULL);
        pause_ns = pause_ns * 2 < LOCK_POLL_MAX_NS ? pause_ns * 2 : LOCK_POLL_MAX_NS;
    }
    return 0;
}

/* ---- lock-free fast path ----
 * A process announces an operation in its slot's `inflight` before touching any counter
 * and checks `frozen` after; a rebuilder sets `frozen` before reading every `inflight`.
 * Both sides use sequentially consistent accesses, so either the operation backs off to
 * the locked path or the rebuilder waits for it: a rebuild never sees half an operation
 * of a live process. A process that dies mid-operation leaves `inflight` raised, which is
 * why its slot is rebuilt from the others rather than subtracted. */

static int enter(struct vgpu_shm_slot *slot) {
    __atomic_fetch_add(&slot->inflight, 1, __ATOMIC_SEQ_CST);
    if (!__atomic_load_n(&shm->header.frozen, __ATOMIC_SEQ_CST)) return 1;
    __atomic_fetch_sub(&slot->inflight, 1, __ATOMIC_RELEASE);
    return 0;
}

static void leave(struct vgpu_shm_slot *slot, struct vgpu_shm_device *dev) {
    __atomic_store_n(&dev->last_update_ns, clock_ns(CLOCK_REALTIME_COARSE), __ATOMIC_RELAXED);
    __atomic_fetch_sub(&slot->inflight, 1, __ATOMIC_RELEASE);
}

static int try_reserve(struct vgpu_shm_slot *slot, int idx, uint64_t bytes) {
    struct vgpu_shm_device *dev = &shm->devices[idx];
    if (!enter(slot)) return FROZEN;
    uint64_t limit = limit_of(dev, idx);
    uint64_t cur = __atomic_load_n(&dev->used, __ATOMIC_RELAXED);
    do {
        if (bytes > limit || cur > limit - bytes) {
            __atomic_fetch_sub(&slot->inflight, 1, __ATOMIC_RELEASE);
            return NO_FIT;
        }
    } while (!__atomic_compare_exchange_n(&dev->used, &cur, cur + bytes, 1, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED));
    __atomic_fetch_add(&slot->used[idx], bytes, __ATOMIC_RELAXED);
    leave(slot, dev);
    return FIT;
}

/* Only what this process charged is released (tracking guarantees bytes <= its usage). */
static int try_release(struct vgpu_shm_slot *slot, int idx, uint64_t bytes) {
    struct vgpu_shm_device *dev = &shm->devices[idx];
    if (!enter(slot)) return FROZEN;
    __atomic_fetch_sub(&slot->used[idx], bytes, __ATOMIC_RELAXED);
    __atomic_fetch_sub(&dev->used, bytes, __ATOMIC_ACQ_REL);
    leave(slot, dev);
    return FIT;
}

/* ---- process liveness ----
 * A process holds an OFD write lock on its slot's byte range from taking the slot until it
 * dies: the kernel drops it when the last reference to the open file description goes (the
 * fd is O_CLOEXEC and the mapping is replaced in fork children, so exit, exec and death all
 * drop it, and so does a zombie's exit). A slot whose range nobody locks is dead. Unlike
 * kill(pid, 0) this works across PID namespaces: a tenant that cannot see the others' pids
 * still sees their locks, and pid reuse or collisions cannot fool it. */

static struct flock slot_range(const struct vgpu_shm_slot *slot, short type) {
    return (struct flock){.l_type = type, .l_whence = SEEK_SET,
                          .l_start = (off_t)((const char *)slot - (const char *)shm), .l_len = sizeof *slot};
}

/* starttime (field 22) of /proc/<pid>/stat, recorded for readers; 0 when unreadable. */
static uint64_t proc_start_time(int pid) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = '\0';
    char *p = strrchr(buf, ')'); /* the command name may contain spaces */
    for (int field = 2; field < 22 && p; field++) p = strchr(p + 1, ' ');
    return p ? strtoull(p + 1, NULL, 10) : 0;
}

/* Our own slot is alive by definition (our own lock never conflicts with our own query). A
 * query that fails cannot tell: the slot counts as alive (safe side: less memory, never more). */
static int slot_dead(const struct vgpu_shm_slot *slot) {
    int pid = __atomic_load_n(&slot->pid, __ATOMIC_ACQUIRE);
    if (pid == 0 || (slot == my_slot && pid == my_pid)) return 0;
    struct flock fl = slot_range(slot, F_WRLCK);
    if (fcntl(shm_fd, F_OFD_GETLK, &fl) != 0) return 0;
    return fl.l_type == F_UNLCK;
}

/* ---- rebuild (always under the file lock) ---- */

/* seq is odd while a locked writer is inside; a writer that died there left it odd. */
static void begin_write(void) {
    uint64_t seq = __atomic_load_n(&shm->header.seq, __ATOMIC_RELAXED);
    if (!(seq & 1)) __atomic_store_n(&shm->header.seq, seq + 1, __ATOMIC_SEQ_CST);
}

static void end_write(void) {
    shm->header.last_update_ns = clock_ns(CLOCK_REALTIME);
    __atomic_store_n(&shm->header.seq, (__atomic_load_n(&shm->header.seq, __ATOMIC_RELAXED) | 1) + 1,
                     __ATOMIC_RELEASE);
}

/* Waits until no live process is inside an operation; 0 when drained, -1 on timeout.
 * A process found dead while waiting joins `dead`. */
static int drain(unsigned char *dead) {
    uint64_t deadline = clock_ns(CLOCK_MONOTONIC) + DRAIN_TIMEOUT_NS;
    for (int s = 0; s < VGPU_SHM_SLOTS; s++) {
        struct vgpu_shm_slot *slot = &shm->slots[s];
        for (unsigned spins = 0; !dead[s] && __atomic_load_n(&slot->inflight, __ATOMIC_SEQ_CST); spins++) {
            if (spins < 64) {
                sched_yield();
            } else if (slot_dead(slot)) {
                dead[s] = 1;
            } else if (clock_ns(CLOCK_MONOTONIC) > deadline) {
                return -1;
            } else {
                nanosleep(&(struct timespec){.tv_nsec = 50000}, NULL);
            }
        }
    }
    return 0;
}

/* The driver frees a dead process's memory; the accounting follows. Every device total
 * is recomputed from the surviving slots while fast paths are held off, so the result is
 * exact whatever moment the dead died at; only then are dead slots cleared, so each step
 * can be redone. A rebuilder that dies leaves `frozen` set and the next lock holder
 * rebuilds again; one that times out leaves totals that still count the dead (safe). */
static int rebuild(int audit) {
    static unsigned char dead[VGPU_SHM_SLOTS]; /* under the file lock and shm_lock */
    static int tamper_reported;
    int count = 0;
    for (int s = 0; s < VGPU_SHM_SLOTS; s++) count += dead[s] = (unsigned char)slot_dead(&shm->slots[s]);
    if (count == 0 && !audit && !__atomic_load_n(&shm->header.frozen, __ATOMIC_ACQUIRE)) return 0;
    __atomic_store_n(&shm->header.frozen, 1, __ATOMIC_SEQ_CST);
    begin_write();
    int drained = drain(dead) == 0, hidden = 0;
    if (drained) {
        uint64_t totals[VGPU_SHM_DEVICES] = {0};
        count = 0;
        for (int s = 0; s < VGPU_SHM_SLOTS; s++) {
            count += dead[s];
            if (dead[s] || shm->slots[s].pid == 0) continue;
            for (int d = 0; d < VGPU_SHM_DEVICES; d++)
                totals[d] += __atomic_load_n(&shm->slots[s].used[d], __ATOMIC_ACQUIRE);
        }
        /* A crash can leave a total above the sum of the slots (a charge half applied), never
         * below it: a total below what live processes hold was rewritten behind our back. */
        for (int d = 0; d < VGPU_SHM_DEVICES; d++) {
            uint64_t was = __atomic_load_n(&shm->devices[d].used, __ATOMIC_RELAXED);
            if (was < totals[d] && !tamper_reported++)
                vgpu_log(VGPU_LOG_WARN, "%s: device %d total %llu bytes is below the %llu its live processes hold "
                         "(tampered); recounted from the processes", shm_path(), d, (unsigned long long)was,
                         (unsigned long long)totals[d]);
            hidden += was < totals[d];
            __atomic_store_n(&shm->devices[d].used, totals[d], __ATOMIC_RELAXED);
        }
        for (int s = 0; s < VGPU_SHM_SLOTS; s++)
            if (dead[s]) memset(&shm->slots[s], 0, sizeof shm->slots[s]);
    } else {
        vgpu_log(VGPU_LOG_WARN, "a process sharing %s is stuck inside an update; dead processes are reclaimed later",
                 shm_path());
    }
    end_write();
    __atomic_store_n(&shm->header.frozen, 0, __ATOMIC_SEQ_CST);
    return drained ? count + hidden : 0;
}

/* ---- slots ---- */

static struct vgpu_shm_slot *free_slot(void) {
    for (int s = 0; s < VGPU_SHM_SLOTS; s++)
        if (shm->slots[s].pid == 0) return &shm->slots[s];
    return NULL;
}

static struct vgpu_shm_slot *register_slot(void) {
    my_pid = getpid();
    rebuild(1); /* a newcomer trusts no total it did not see being made */
    for (int s = 0; s < VGPU_SHM_SLOTS; s++)
        if (shm->slots[s].pid == my_pid) { /* left by the image we exec'd from */
            rebuild(0);
            break;
        }
    struct vgpu_shm_slot *slot = free_slot();
    if (!slot && rebuild(0) > 0) slot = free_slot();
    if (!slot) return NULL;
    struct flock fl = slot_range(slot, F_WRLCK);
    if (fcntl(shm_fd, F_OFD_SETLK, &fl) != 0) { /* a free slot nobody should hold */
        vgpu_log(VGPU_LOG_ERROR, "cannot lock a process slot in %s (%s)", shm_path(), strerror(errno));
        return NULL;
    }
    uint64_t start = proc_start_time(my_pid);
    begin_write();
    memset(slot, 0, sizeof *slot);
    slot->start_time = start;
    __atomic_store_n(&slot->pid, my_pid, __ATOMIC_RELEASE);
    end_write();
    return slot;
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
    for (int d = 0; d < VGPU_SHM_DEVICES; d++) {
        shm->devices[d].limit = vgpu_config_limit(d);
        snprintf(shm->devices[d].uuid, VGPU_SHM_UUID_LEN, "%s", vgpu_config_uuid(d));
    }
    shm->header.version = VGPU_SHM_VERSION;
    shm->header.file_size = sizeof(struct vgpu_shm_file);
    shm->header.device_slots = VGPU_SHM_DEVICES;
    shm->header.process_slots = VGPU_SHM_SLOTS;
    shm->header.last_update_ns = clock_ns(CLOCK_REALTIME);
    __atomic_store_n(&shm->header.magic, VGPU_SHM_MAGIC, __ATOMIC_RELEASE);
}

/* Under a grant, limits in the file other than the grant's are the tenant's doing: the grant
 * is put back (readers such as the node agent then see the truth) and applies anyway. */
static void restore_granted_limits(void) {
    for (int d = 0; d < VGPU_SHM_DEVICES; d++) {
        if (shm->devices[d].limit == vgpu_config_limit(d)) continue;
        vgpu_log(VGPU_LOG_WARN, "%s: device %d limit %llu is not the grant's %llu (tampered); the grant applies",
                 shm_path(), d, (unsigned long long)shm->devices[d].limit, (unsigned long long)vgpu_config_limit(d));
        begin_write();
        for (int i = 0; i < VGPU_SHM_DEVICES; i++) {
            __atomic_store_n(&shm->devices[i].limit, vgpu_config_limit(i), __ATOMIC_RELAXED);
            snprintf(shm->devices[i].uuid, VGPU_SHM_UUID_LEN, "%s", vgpu_config_uuid(i));
        }
        end_write();
        return;
    }
}

static void warn_if_limits_differ(void) {
    if (granted) {
        restore_granted_limits();
        return;
    }
    for (int d = 0; d < VGPU_SHM_DEVICES; d++) {
        if (shm->devices[d].limit == vgpu_config_limit(d)) continue;
        vgpu_log(VGPU_LOG_WARN, "memory limits in the environment differ from %s (device %d: %llu there); "
                 "keeping the shared file's limits", shm_path(), d, (unsigned long long)shm->devices[d].limit);
        return;
    }
}

static int fail(int fd, const char *what) {
    vgpu_log(VGPU_LOG_ERROR, "shared accounting file %s %s; every allocation will fail", shm_path(), what);
    if (fd >= 0) close(fd);
    return VGPU_SHM_BROKEN;
}

/* Slot locks are the kernel's, not the file's: a file that looks new while some process still
 * holds a slot lock was wiped under it, and what those processes hold cannot be recounted. */
static int slots_locked(int fd) {
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = (off_t)offsetof(struct vgpu_shm_file, slots),
                       .l_len = (off_t)sizeof(((struct vgpu_shm_file *)0)->slots)};
    return fcntl(fd, F_OFD_GETLK, &fl) != 0 || fl.l_type != F_UNLCK;
}

/* Checked before any lock is taken: a device or FIFO at the path may carry some other
 * program's locks (dockerd holds one on /dev/null), which are none of ours to wait for. */
static int check_regular(int fd) {
    struct stat st;
    if (fstat(fd, &st) != 0) return fail(fd, "cannot be read");
    if (!S_ISREG(st.st_mode)) return fail(fd, "is not a regular file");
    return VGPU_SHM_ON;
}

static int map_file(int fd) {
    struct stat st;
    if (fstat(fd, &st) != 0) return fail(fd, "cannot be read");
    int fresh = st.st_size == 0;
    if (fresh && slots_locked(fd)) return fail(fd, "was truncated while its processes hold memory (tampered)");
    if (fresh && (ftruncate(fd, sizeof(struct vgpu_shm_file)) != 0 || fchmod(fd, 0666) != 0))
        return fail(fd, "cannot be sized");
    if (!fresh && st.st_size != (off_t)sizeof(struct vgpu_shm_file)) return fail(fd, "has the wrong size (corrupt or foreign)");
    void *p = mmap(NULL, sizeof(struct vgpu_shm_file), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return fail(fd, "cannot be mapped");
    shm = p;
    if (shm->header.magic == 0 && shm->header.version == 0) { /* new, creator died, or wiped */
        if (!fresh && slots_locked(fd)) {
            munmap(p, sizeof(struct vgpu_shm_file));
            shm = NULL;
            return fail(fd, "was wiped while its processes hold memory (tampered)");
        }
        initialise_file();
    }
    if (!header_valid()) {
        munmap(p, sizeof(struct vgpu_shm_file));
        shm = NULL;
        return fail(fd, "has a bad magic number or version (corrupt or foreign)");
    }
    if (!fresh) warn_if_limits_differ();
    return VGPU_SHM_ON;
}

/* A fork child shares the parent's open file description through the inherited fd and the
 * inherited mapping, and with it the parent's slot lock: through it the parent's slot would
 * look dead to the child, and the child would keep the parent's lock alive after the parent
 * died. So the child opens the file afresh and maps it over the same address (pointers into
 * it stay valid), then drops the inherited fd; the parent's own references keep its lock.
 * Only open/mmap/close system calls here (async-signal-safe in practice); on failure the
 * locked path retries, and fails closed. */
static int reopen(void) {
    if (!shm || shm_fd < 0) return -1;
    int fd = open(path_buf, O_RDWR | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) return -1;
    struct stat was, now; /* a file replaced at the path is not the one mapped (nor sized yet) */
    if (fstat(shm_fd, &was) != 0 || fstat(fd, &now) != 0 || was.st_dev != now.st_dev || was.st_ino != now.st_ino ||
        mmap(shm, sizeof(struct vgpu_shm_file), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) ==
            MAP_FAILED) {
        close(fd);
        return -1;
    }
    close(shm_fd);
    shm_fd = fd;
    reopen_needed = 0;
    return 0;
}

static void after_fork_in_child(void) {
    vgpu_track_after_fork();
    pthread_mutex_init(&shm_lock, NULL);
    my_slot = NULL;
    my_pid = 0;
    reopen_needed = 1;
    reopen();
}

/* A file that cannot be opened is treated like a corrupt one when this process has a
 * limit to enforce: otherwise making the path unusable would escape the shared limit. */
static void attach_once(void) {
    vgpu_config_init();
    granted = vgpu_config_granted();
    for (int d = 0; d < VGPU_SHM_DEVICES; d++) granted_limits[d] = vgpu_config_limit(d);
    snprintf(path_buf, sizeof path_buf, "%s", shm_path());
    /* O_NONBLOCK: opening whatever sits at the path (a FIFO, a device) must not wait either. */
    int fd = open(shm_path(), O_RDWR | O_CREAT | O_CLOEXEC | O_NONBLOCK | O_NOCTTY, 0666);
    if (fd < 0) {
        int err = errno;
        if (vgpu_config_any_limit()) {
            vgpu_log(VGPU_LOG_ERROR, "cannot open shared accounting file %s (%s); every allocation will fail",
                     shm_path(), strerror(err));
            shm_state = VGPU_SHM_BROKEN;
        } else {
            vgpu_log(VGPU_LOG_INFO, "cannot open %s (%s); no limit is set, so usage is not shared", shm_path(),
                     strerror(err));
        }
        return;
    }
    if ((shm_state = check_regular(fd)) != VGPU_SHM_ON) return;
    if (file_lock(fd, F_WRLCK) != 0) {
        char why[96] = "cannot be locked";
        if (errno == ETIMEDOUT)
            snprintf(why, sizeof why, "has been locked by another process for %d s (stopped, or holding it on "
                     "purpose)", LOCK_TIMEOUT_S);
        shm_state = fail(fd, why);
        return;
    }
    shm_state = map_file(fd);
    if (shm_state != VGPU_SHM_ON) return;
    shm_fd = fd;
    pthread_mutex_lock(&shm_lock);
    my_pid = getpid();
    rebuild(0); /* finishes the work of a rebuilder that died, if any */
    pthread_mutex_unlock(&shm_lock);
    file_lock(fd, F_UNLCK);
    pthread_atfork(NULL, NULL, after_fork_in_child);
}

int vgpu_shm_state(void) {
    pthread_once(&shm_once, attach_once);
    return shm_state;
}

/* ---- locked (slow) path ---- */

/* A lock that times out refuses the operation that needed it (fail closed); one line says
 * why, once per process, however many operations it refuses. */
static int lock_shared(void) {
    static int timeout_reported;
    pthread_mutex_lock(&shm_lock);
    if (reopen_needed) reopen();
    if (reopen_needed || file_lock(shm_fd, F_WRLCK) != 0) {
        if (errno == ETIMEDOUT && !timeout_reported++)
            vgpu_log(VGPU_LOG_ERROR, "shared accounting file %s has been locked by another process for %d s "
                     "(stopped, or holding it on purpose); allocations that need it are refused", shm_path(),
                     LOCK_TIMEOUT_S);
        pthread_mutex_unlock(&shm_lock);
        return -1;
    }
    if (!my_pid) my_pid = getpid();
    if (__atomic_load_n(&shm->header.frozen, __ATOMIC_ACQUIRE)) rebuild(0); /* its rebuilder died */
    return 0;
}

static void unlock_shared(void) {
    file_lock(shm_fd, F_UNLCK);
    pthread_mutex_unlock(&shm_lock);
}

/* Our slot, or NULL when we have none or it was taken from us (a rebuild that judged us
 * dead: then its charges went with it and must not be released twice). */
static struct vgpu_shm_slot *own_slot(void) {
    struct vgpu_shm_slot *slot = __atomic_load_n(&my_slot, __ATOMIC_ACQUIRE);
    return slot && __atomic_load_n(&slot->pid, __ATOMIC_RELAXED) == my_pid ? slot : NULL;
}

static int reserve_locked(int idx, uint64_t bytes) {
    struct vgpu_shm_slot *slot = own_slot();
    if (!slot) {
        __atomic_store_n(&my_slot, NULL, __ATOMIC_RELEASE);
        slot = register_slot();
        __atomic_store_n(&my_slot, slot, __ATOMIC_RELEASE);
    }
    if (!slot) {
        vgpu_log(VGPU_LOG_ERROR, "no free process slot in %s", shm_path());
        return 0;
    }
    int r = try_reserve(slot, idx, bytes);
    if (r != FIT && rebuild(1) > 0) r = try_reserve(slot, idx, bytes);
    return r == FIT;
}

int vgpu_shm_reserve(int idx, uint64_t bytes) {
    struct vgpu_shm_slot *slot = own_slot();
    if (slot && try_reserve(slot, idx, bytes) == FIT) return 1;
    if (lock_shared() != 0) return 0;
    int ok = reserve_locked(idx, bytes);
    unlock_shared();
    return ok;
}

void vgpu_shm_release(int idx, uint64_t bytes) {
    struct vgpu_shm_slot *slot = own_slot();
    if (!slot || try_release(slot, idx, bytes) == FIT || lock_shared() != 0) return;
    if ((slot = own_slot())) try_release(slot, idx, bytes); /* not frozen while we hold the lock */
    unlock_shared();
}

/* Readers that report usage first drop dead processes, so freed memory shows as free. */
uint64_t vgpu_shm_used(int idx, int refresh) {
    if (refresh && lock_shared() == 0) {
        rebuild(0);
        unlock_shared();
    }
    return __atomic_load_n(&shm->devices[idx].used, __ATOMIC_ACQUIRE);
}

uint64_t vgpu_shm_limit(int idx) { return limit_of(&shm->devices[idx], idx); }

void vgpu_shm_set_uuid(int idx, const char *uuid) {
    if (strncmp(shm->devices[idx].uuid, uuid, VGPU_SHM_UUID_LEN - 1) == 0 || lock_shared() != 0) return;
    begin_write();
    snprintf(shm->devices[idx].uuid, VGPU_SHM_UUID_LEN, "%s", uuid);
    end_write();
    unlock_shared();
}
