/* A fake libnvidia-ml.so.1 reporting the same devices as the fake libcuda.so.1
 * (FAKE_CUDA_DEVICES x FAKE_CUDA_TOTAL_MIB); used memory is the fake driver's own
 * count when that library is loaded in the process, else 0. The per-process queries
 * (nvmlDevice{Compute,Graphics}RunningProcesses[_v2|_v3]) answer from the fake driver's
 * node-wide ledger (FAKE_CUDA_STATE), by host PID, as the real driver does. */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>
#include "fake_cuda.h"
#include "fake_ledger.h"
#include "nvml_subset.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEVICES 16

struct nvmlDevice_st {
    unsigned int index;
};

static struct nvmlDevice_st devices[MAX_DEVICES];
static unsigned int device_count;
static int initialised;

nvmlReturn_t fake_nvmlInit_v1(void) __asm__("nvmlInit") EXPORT;

static unsigned long long env_ull(const char *name, unsigned long long fallback, unsigned long long hi) {
    const char *text = getenv(name);
    char *end;
    unsigned long long v = text ? strtoull(text, &end, 10) : fallback;
    return text && (*end || end == text || v < 1 || v > hi) ? fallback : v;
}

static unsigned long long total_bytes(void) { return env_ull("FAKE_CUDA_TOTAL_MIB", 15360, 1ull << 30) << 20; }

static int ledger_device_used(unsigned int index, unsigned long long *used);

/* Device-wide usage as the real NVML reports it: every live process on the node (the ledger),
 * whether or not this process ever loaded libcuda; without a node-wide ledger, this process's
 * own fake driver's count. */
static unsigned long long used_bytes(unsigned int index) {
    unsigned long long node_wide;
    if (ledger_device_used(index, &node_wide) == 0) return node_wide;
    void *cuda = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (!cuda) return 0;
    fake_cuda_stats_fn stats = (fake_cuda_stats_fn)dlsym(cuda, FAKE_CUDA_STATS_SYMBOL);
    fake_cuda_stats s = {0};
    unsigned long long used = stats && stats((int)index, &s) == 0 ? s.used : 0;
    dlclose(cuda);
    return used;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) {
    device_count = (unsigned int)env_ull("FAKE_CUDA_DEVICES", 1, MAX_DEVICES);
    for (unsigned int i = 0; i < device_count; i++) devices[i].index = i;
    initialised = 1;
    return NVML_SUCCESS;
}

nvmlReturn_t fake_nvmlInit_v1(void) { return nvmlInit_v2(); }

EXPORT nvmlReturn_t nvmlShutdown(void) {
    initialised = 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = device_count;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= device_count) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &devices[index];
    return NVML_SUCCESS;
}

static int valid(nvmlDevice_t device) {
    return initialised && device >= devices && device < devices + device_count;
}

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    if (!valid(device) || !index) return NVML_ERROR_INVALID_ARGUMENT;
    *index = device->index;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    if (!valid(device) || !name) return NVML_ERROR_INVALID_ARGUMENT;
    if (length < sizeof "Fake GPU") return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(name, "Fake GPU");
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    if (!valid(device) || !uuid) return NVML_ERROR_INVALID_ARGUMENT;
    if (length < 41) return NVML_ERROR_INSUFFICIENT_SIZE;
    snprintf(uuid, length, "GPU-%02u00fa4e-1111-2222-3333-%012u", device->index, device->index);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    if (!valid(device) || !memory) return NVML_ERROR_INVALID_ARGUMENT;
    memory->total = total_bytes();
    memory->used = used_bytes(device->index);
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    if (!valid(device) || !memory) return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != NVML_MEMORY_V2) return NVML_ERROR_INVALID_ARGUMENT;
    memory->total = total_bytes();
    memory->reserved = 0;
    memory->used = used_bytes(device->index);
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

/* ---- running processes, from the fake driver's ledger ---- */

/* nvml.h's return codes and process records (nvmlProcessInfo_v1_t for the original entry
 * points; nvmlProcessInfo_v2_t, alias nvmlProcessInfo_t, for _v2 and _v3). */
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_UNKNOWN 999
#define NVML_NO_INSTANCE 0xFFFFFFFFu /* gpuInstanceId / computeInstanceId outside MIG */

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_v2_t;

_Static_assert(sizeof(nvmlProcessInfo_v1_t) == 16 && sizeof(nvmlProcessInfo_v2_t) == 24, "nvml.h record sizes");

struct held {
    int slot;               /* record index in the ledger */
    int hint;               /* the pid the process wrote: its own PID namespace's */
    unsigned int host_pid;  /* 0 until the kernel tells us */
    unsigned long long bytes;
};

static int env_is(const char *name, const char *value) {
    const char *text = getenv(name);
    return text && strcmp(text, value) == 0;
}

/* FAKE_NVML_PROCESS_API=1|2 plays an older driver that lacks the newer entry points. */
static int api_supported(int version) {
    return version <= (int)env_ull("FAKE_NVML_PROCESS_API", 3, 3);
}

static off_t record_offset(int slot) {
    return (off_t)(offsetof(fake_ledger, procs) + (size_t)slot * sizeof(fake_ledger_proc));
}

/* Does open file `fd` of host process `pid` hold the OFD write lock on ledger bytes
 * [start, end]? /proc/<pid>/fdinfo/<fd> lists the locks held through that very open file. */
static int fd_holds(const char *pid, const char *fd, unsigned int major_, unsigned int minor_, unsigned long inode,
                    unsigned long long start, unsigned long long end) {
    char path[96], text[4096];
    snprintf(path, sizeof path, "/proc/%s/fdinfo/%s", pid, fd);
    int info = open(path, O_RDONLY | O_CLOEXEC);
    if (info < 0) return 0;
    ssize_t n = read(info, text, sizeof text - 1);
    close(info);
    if (n <= 0) return 0;
    text[n] = '\0';
    for (char *line = strstr(text, "lock:"); line; line = strstr(line + 5, "lock:")) {
        /* lock:	1: OFDLCK ADVISORY  WRITE -1 fe:00:10051812 2112 2263 */
        char kind[16], type[16], last[32];
        unsigned int ma, mi;
        unsigned long ino;
        unsigned long long first;
        if (sscanf(line, "lock: %*d: %15s %*s %15s %*d %x:%x:%lu %llu %31s", kind, type, &ma, &mi, &ino, &first, last) == 7 &&
            !strcmp(kind, "OFDLCK") && !strcmp(type, "WRITE") && ma == major_ && mi == minor_ && ino == inode &&
            first == start && strtoull(last, NULL, 10) == end)
            return 1;
    }
    return 0;
}

/* Which of host process `pid`'s open files hold the lock of record `slot`. */
static int process_holds(const char *pid, const struct stat *ledger, int slot) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%s/fd", pid);
    DIR *dir = opendir(path);
    if (!dir) return 0;
    unsigned long long start = (unsigned long long)record_offset(slot), end = start + sizeof(fake_ledger_proc) - 1;
    int found = 0;
    for (struct dirent *e; !found && (e = readdir(dir));) {
        struct stat st;
        if (e->d_name[0] == '.' || fstatat(dirfd(dir), e->d_name, &st, 0) != 0) continue;
        if (st.st_dev == ledger->st_dev && st.st_ino == ledger->st_ino)
            found = fd_holds(pid, e->d_name, major(ledger->st_dev), minor(ledger->st_dev), ledger->st_ino, start, end);
    }
    closedir(dir);
    return found;
}

/* The pid a host process has in its innermost PID namespace (the last NSpid field). */
static int innermost_pid(const char *pid) {
    char path[64], text[4096];
    snprintf(path, sizeof path, "/proc/%s/status", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, text, sizeof text - 1);
    close(fd);
    if (n <= 0) return -1;
    text[n] = '\0';
    char *line = strstr(text, "\nNSpid:");
    if (!line) return atoi(pid);
    char *end = strchr(line + 1, '\n');
    if (end) *end = '\0';
    char *last = strrchr(line, '\t');
    return last ? atoi(last + 1) : -1;
}

/* The host PID of each record, as the kernel shows it, never as the process wrote it.
 *
 * The fake libcuda records getpid(), which inside a PID namespace the tenant made
 * (`unshare -Urpf`) is a small number naming some other host process, and which any process
 * could overwrite. The real driver reports host PIDs whatever the process does, so neither
 * may decide here. What the tenant cannot fake is the kernel's record of which open file
 * holds the record's lock: /proc/<host pid>/fdinfo shows it. The written pid is only tried
 * first (the common case, a process in the host's PID namespace, costs one directory); a
 * record no host process is seen holding is left out, never guessed. When an open file is
 * shared (a fork that skipped the fake's atfork handler), the holder whose own namespace pid
 * is the one written wins, then the lowest host PID. Reading others' fdinfo needs what the
 * node agent has: root in the host's PID namespace. */
static void resolve_host_pids(const struct stat *ledger, struct held *held, unsigned int n) {
    /* per record: 0 nothing found yet, 1 a holder in another namespace, 2 the holder in the
     * namespace that wrote the pid (settled) */
    unsigned char *found = calloc(n ? n : 1, 1);
    if (!found) return;
    unsigned int unresolved = 0;
    for (unsigned int i = 0; i < n; i++) {
        char pid[16];
        snprintf(pid, sizeof pid, "%d", held[i].hint);
        if (held[i].hint > 0 && process_holds(pid, ledger, held[i].slot) && innermost_pid(pid) == held[i].hint) {
            held[i].host_pid = (unsigned int)held[i].hint;
            found[i] = 2;
        } else {
            unresolved++;
        }
    }
    DIR *proc = unresolved ? opendir("/proc") : NULL;
    for (struct dirent *e; proc && (e = readdir(proc));) {
        if (e->d_name[0] < '1' || e->d_name[0] > '9') continue;
        unsigned int host = (unsigned int)strtoul(e->d_name, NULL, 10);
        int inner = -2;
        for (unsigned int i = 0; i < n; i++) {
            if (found[i] == 2 || !process_holds(e->d_name, ledger, held[i].slot)) continue;
            if (inner == -2) inner = innermost_pid(e->d_name);
            unsigned char rank = inner == held[i].hint ? 2 : 1;
            if (rank > found[i] || (rank == found[i] && host < held[i].host_pid)) {
                held[i].host_pid = host;
                found[i] = rank;
            }
        }
    }
    if (proc) closedir(proc);
    free(found);
}

/* Live processes holding memory on NVML device `index`, by host PID. The ledger's counters
 * are read under the same lock its writers take, so no allocation is seen half made; a
 * record whose lock nobody holds is a process that died (the real driver drops it too). */
static nvmlReturn_t ledger_processes(unsigned int index, struct held **out, unsigned int *count) {
    *out = NULL;
    *count = 0;
    const char *path = getenv("FAKE_CUDA_STATE");
    if (!path || !*path) return NVML_ERROR_NOT_SUPPORTED; /* no node-wide view to answer from */
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT ? NVML_SUCCESS : NVML_ERROR_UNKNOWN; /* nobody has allocated yet */
    struct stat st;
    if (fstat(fd, &st) != 0 || (st.st_size != 0 && st.st_size != (off_t)sizeof(fake_ledger))) {
        close(fd);
        return NVML_ERROR_UNKNOWN; /* not the layout fake_ledger.h describes */
    }
    if (st.st_size == 0) { /* created, not sized yet */
        close(fd);
        return NVML_SUCCESS;
    }
    const fake_ledger *ledger = mmap(NULL, sizeof *ledger, PROT_READ, MAP_SHARED, fd, 0);
    struct held *held = malloc(FAKE_LEDGER_PROCS * sizeof *held);
    if (ledger == MAP_FAILED || !held) {
        if (ledger != MAP_FAILED) munmap((void *)ledger, sizeof *ledger);
        free(held);
        close(fd);
        return NVML_ERROR_UNKNOWN;
    }
    struct flock counters = {.l_type = F_RDLCK, .l_whence = SEEK_SET, .l_len = FAKE_LEDGER_COUNTERS_LEN};
    while (fcntl(fd, F_OFD_SETLKW, &counters) == -1 && errno == EINTR) {
    }
    unsigned int n = 0;
    for (int i = 0; i < FAKE_LEDGER_PROCS; i++) {
        const fake_ledger_proc *p = &ledger->procs[i];
        if (p->pid && p->used[index]) held[n++] = (struct held){.slot = i, .hint = p->pid, .bytes = p->used[index]};
    }
    counters.l_type = F_UNLCK;
    fcntl(fd, F_OFD_SETLK, &counters);
    unsigned int live = 0;
    for (unsigned int i = 0; i < n; i++) {
        struct flock probe = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = record_offset(held[i].slot),
                              .l_len = sizeof(fake_ledger_proc)};
        if (fcntl(fd, F_OFD_GETLK, &probe) == 0 && probe.l_type != F_UNLCK) held[live++] = held[i];
    }
    resolve_host_pids(&st, held, live);
    n = 0;
    for (unsigned int i = 0; i < live; i++)
        if (held[i].host_pid) held[n++] = held[i]; /* exited while we looked */
    munmap((void *)ledger, sizeof *ledger);
    close(fd);
    *out = held;
    *count = n;
    return NVML_SUCCESS;
}

/* Sum of what live records hold on device `index` (0 when nobody has allocated yet); -1 when
 * there is no node-wide ledger to read. */
static int ledger_device_used(unsigned int index, unsigned long long *used) {
    const char *path = getenv("FAKE_CUDA_STATE");
    *used = 0;
    if (!path || !*path) return -1;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0) return errno == ENOENT ? 0 : -1; /* nobody has allocated yet */
    if (fstat(fd, &st) != 0 || st.st_size != (off_t)sizeof(fake_ledger)) {
        int not_sized_yet = st.st_size == 0;
        close(fd);
        return not_sized_yet ? 0 : -1;
    }
    const fake_ledger *ledger = mmap(NULL, sizeof *ledger, PROT_READ, MAP_SHARED, fd, 0);
    if (ledger == MAP_FAILED) {
        close(fd);
        return -1;
    }
    for (int i = 0; i < FAKE_LEDGER_PROCS; i++) {
        const fake_ledger_proc *p = &ledger->procs[i];
        if (!p->pid || !p->used[index]) continue;
        struct flock probe = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = record_offset(i), .l_len = sizeof *p};
        if (fcntl(fd, F_OFD_GETLK, &probe) == 0 && probe.l_type != F_UNLCK) *used += p->used[index];
    }
    munmap((void *)ledger, sizeof *ledger);
    close(fd);
    return 0;
}

/* NVML's contract: *infoCount in is the room in `infos`; too little room (a count query
 * with 0 is the usual way) answers NVML_ERROR_INSUFFICIENT_SIZE with the number needed,
 * none running answers NVML_SUCCESS with 0. */
static nvmlReturn_t running_processes(nvmlDevice_t device, unsigned int *infoCount, void *infos, int version,
                                      int graphics) {
    if (!api_supported(version)) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!valid(device) || !infoCount) return NVML_ERROR_INVALID_ARGUMENT;
    struct held *held = NULL;
    unsigned int n = 0;
    /* The fake has no graphics contexts; FAKE_NVML_GRAPHICS=all plays processes that hold a
     * graphics and a compute context, listed in both with all their memory (nvml.h). */
    nvmlReturn_t rc = graphics && !env_is("FAKE_NVML_GRAPHICS", "all") ? NVML_SUCCESS : ledger_processes(device->index, &held, &n);
    if (rc != NVML_SUCCESS) return rc;
    if (n > *infoCount) {
        *infoCount = n;
        free(held);
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (n && !infos) {
        free(held);
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    /* FAKE_NVML_USED=unavailable plays a driver that withholds per-process memory (WDDM,
     * some permission setups): NVML_VALUE_NOT_AVAILABLE. */
    int unavailable = env_is("FAKE_NVML_USED", "unavailable");
    for (unsigned int i = 0; i < n; i++) {
        unsigned long long bytes = unavailable ? ~0ull : held[i].bytes;
        if (version == 1)
            ((nvmlProcessInfo_v1_t *)infos)[i] = (nvmlProcessInfo_v1_t){.pid = held[i].host_pid, .usedGpuMemory = bytes};
        else
            ((nvmlProcessInfo_v2_t *)infos)[i] = (nvmlProcessInfo_v2_t){
                .pid = held[i].host_pid, .usedGpuMemory = bytes, .gpuInstanceId = NVML_NO_INSTANCE,
                .computeInstanceId = NVML_NO_INSTANCE};
    }
    *infoCount = n;
    free(held);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                         nvmlProcessInfo_v1_t *infos) {
    return running_processes(device, infoCount, infos, 1, 0);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                            nvmlProcessInfo_v2_t *infos) {
    return running_processes(device, infoCount, infos, 2, 0);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                            nvmlProcessInfo_v2_t *infos) {
    return running_processes(device, infoCount, infos, 3, 0);
}

EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                          nvmlProcessInfo_v1_t *infos) {
    return running_processes(device, infoCount, infos, 1, 1);
}

EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                             nvmlProcessInfo_v2_t *infos) {
    return running_processes(device, infoCount, infos, 2, 1);
}

EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                             nvmlProcessInfo_v2_t *infos) {
    return running_processes(device, infoCount, infos, 3, 1);
}

/* ---- what monitoring clients ask about a device (pynvml, gpustat, nvitop) ----
 * Signatures and struct layouts as nvml.h declares them; values are those of an idle
 * T4-class card, the same for every device except its identity (index, UUID, PCI bus). */


#define FAKE_DRIVER_VERSION "580.65.06"

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} fake_nvmlPciInfo_t;

typedef struct {
    unsigned int gpu, memory;
} fake_nvmlUtilization_t;

typedef struct {
    unsigned long long bar1Total, bar1Free, bar1Used;
} fake_nvmlBAR1Memory_t;

static nvmlReturn_t copy_text(char *out, unsigned int length, const char *text) {
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    if (length < strlen(text) + 1) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(out, text);
    return NVML_SUCCESS;
}

static nvmlReturn_t put_uint(nvmlDevice_t device, unsigned int *out, unsigned int value) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!valid(device) || !out) return NVML_ERROR_INVALID_ARGUMENT;
    *out = value;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags; /* NVML_INIT_FLAG_NO_GPUS / NO_ATTACH change nothing for a fake */
    return nvmlInit_v2();
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    return initialised ? copy_text(version, length, FAKE_DRIVER_VERSION) : NVML_ERROR_UNINITIALIZED;
}

EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    return initialised ? copy_text(version, length, "13." FAKE_DRIVER_VERSION) : NVML_ERROR_UNINITIALIZED;
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version) {
    if (!version) return NVML_ERROR_INVALID_ARGUMENT;
    *version = 13000;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version) { return nvmlSystemGetCudaDriverVersion(version); }

/* The command line of a host process, as NVML reads it from /proc. */
EXPORT nvmlReturn_t nvmlSystemGetProcessName(unsigned int pid, char *name, unsigned int length) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!name || length == 0) return NVML_ERROR_INVALID_ARGUMENT;
    char path[64], text[256] = "";
    snprintf(path, sizeof path, "/proc/%u/comm", pid);
    FILE *f = fopen(path, "r");
    if (!f) return NVML_ERROR_NOT_FOUND;
    if (!fgets(text, sizeof text, f)) text[0] = '\0';
    fclose(f);
    text[strcspn(text, "\n")] = '\0';
    snprintf(name, length, "%s", text);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!uuid || !device) return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < device_count; i++) {
        char mine[64];
        nvmlDeviceGetUUID(&devices[i], mine, sizeof mine);
        if (strcmp(mine, uuid) == 0) {
            *device = &devices[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

static unsigned int pci_bus(const struct nvmlDevice_st *device) { return 0x3b + device->index; }

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, fake_nvmlPciInfo_t *pci) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!valid(device) || !pci) return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    pci->bus = pci_bus(device);
    pci->pciDeviceId = 0x1eb810de; /* 10de vendor, 1eb8 a T4 */
    pci->pciSubSystemId = 0x12a210de;
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "0000:%02X:00.0", pci->bus);
    snprintf(pci->busId, sizeof pci->busId, "00000000:%02X:00.0", pci->bus);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, fake_nvmlPciInfo_t *pci) { return nvmlDeviceGetPciInfo_v3(device, pci); }

EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor) { return put_uint(device, minor, valid(device) ? device->index : 0); }
EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensor, unsigned int *temp) { return sensor == 0 ? put_uint(device, temp, 34) : NVML_ERROR_INVALID_ARGUMENT; }
EXPORT nvmlReturn_t nvmlDeviceGetFanSpeed(nvmlDevice_t device, unsigned int *speed) {
    (void)speed; /* passively cooled, like a T4: the real driver says so */
    return valid(device) ? NVML_ERROR_NOT_SUPPORTED : NVML_ERROR_INVALID_ARGUMENT;
}
EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *milliwatts) { return put_uint(device, milliwatts, 27000); }
EXPORT nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *milliwatts) { return put_uint(device, milliwatts, 70000); }
EXPORT nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t device, unsigned int *milliwatts) { return put_uint(device, milliwatts, 70000); }
EXPORT nvmlReturn_t nvmlDeviceGetPerformanceState(nvmlDevice_t device, int *state) { return put_uint(device, (unsigned int *)state, 8); }
EXPORT nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, int *mode) { return put_uint(device, (unsigned int *)mode, 1); }
EXPORT nvmlReturn_t nvmlDeviceGetDisplayMode(nvmlDevice_t device, int *mode) { return put_uint(device, (unsigned int *)mode, 0); }
EXPORT nvmlReturn_t nvmlDeviceGetDisplayActive(nvmlDevice_t device, int *active) { return put_uint(device, (unsigned int *)active, 0); }
EXPORT nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t device, int *mode) { return put_uint(device, (unsigned int *)mode, 0); }
EXPORT nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t device, unsigned int *gen) { return put_uint(device, gen, 3); }
EXPORT nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t device, unsigned int *width) { return put_uint(device, width, 16); }
EXPORT nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t device, int counter, unsigned int *kbps) {
    (void)counter;
    return put_uint(device, kbps, 0);
}

/* NVML_CLOCK_GRAPHICS, SM, MEM, VIDEO */
static const unsigned int clocks_now[] = {300, 300, 405, 540}, clocks_max[] = {1590, 1590, 5001, 1470};

EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, int type, unsigned int *mhz) {
    return type >= 0 && type < 4 ? put_uint(device, mhz, clocks_now[type]) : NVML_ERROR_INVALID_ARGUMENT;
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, int type, unsigned int *mhz) {
    return type >= 0 && type < 4 ? put_uint(device, mhz, clocks_max[type]) : NVML_ERROR_INVALID_ARGUMENT;
}

EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!valid(device) || !major || !minor) return NVML_ERROR_INVALID_ARGUMENT;
    *major = 7;
    *minor = 5;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t device, int *current, int *pending) {
    if (!valid(device) || !current || !pending) return NVML_ERROR_INVALID_ARGUMENT;
    *current = *pending = 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending) {
    (void)current;
    (void)pending; /* a T4 has no MIG */
    return valid(device) ? NVML_ERROR_NOT_SUPPORTED : NVML_ERROR_INVALID_ARGUMENT;
}

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, fake_nvmlUtilization_t *utilization) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!valid(device) || !utilization) return NVML_ERROR_INVALID_ARGUMENT;
    utilization->gpu = utilization->memory = 0; /* the fake runs no kernels */
    return NVML_SUCCESS;
}

static nvmlReturn_t codec_utilization(nvmlDevice_t device, unsigned int *utilization, unsigned int *period_us) {
    if (!valid(device) || !utilization || !period_us) return NVML_ERROR_INVALID_ARGUMENT;
    *utilization = 0;
    *period_us = 167000;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t device, unsigned int *u, unsigned int *p) { return codec_utilization(device, u, p); }
EXPORT nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t device, unsigned int *u, unsigned int *p) { return codec_utilization(device, u, p); }

EXPORT nvmlReturn_t nvmlDeviceGetBAR1MemoryInfo(nvmlDevice_t device, fake_nvmlBAR1Memory_t *bar1) {
    if (!valid(device) || !bar1) return NVML_ERROR_INVALID_ARGUMENT;
    bar1->bar1Total = bar1->bar1Free = 256ull << 20;
    bar1->bar1Used = 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char *serial, unsigned int length) {
    char text[32];
    if (!valid(device)) return NVML_ERROR_INVALID_ARGUMENT;
    snprintf(text, sizeof text, "fake%010u", device->index);
    return copy_text(serial, length, text);
}

EXPORT nvmlReturn_t nvmlDeviceGetBoardPartNumber(nvmlDevice_t device, char *part, unsigned int length) {
    return valid(device) ? copy_text(part, length, "900-2G183-0000-000") : NVML_ERROR_INVALID_ARGUMENT;
}
