/* A fake libnvidia-ml.so.1 reporting the same devices as the fake libcuda.so.1. With the node's
 * fake-gpu ledger beside this library (fake_ledger.h), the card, the device-wide used memory and the
 * per-process queries (nvmlDevice{Compute,Graphics}RunningProcesses[_v2|_v3]) answer from it, by host
 * PID, as the real driver does; without one, the card is FAKE_CUDA_DEVICES x FAKE_CUDA_TOTAL_MIB, used
 * memory is this process's own fake driver's count, and there is no process list.
 * The node's driver branch (the ledger's, fixed when it starts) decides the versions reported and whether
 * NVML 13.4's per-cgroup memory limits exist: R580 (and a GPU without a ledger) answer them
 * NVML_ERROR_NOT_SUPPORTED; R615 sets and reads them in the ledger, which enforces them. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
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
static int initialised;  /* nvmlInit calls not yet shut down */

nvmlReturn_t fake_nvmlInit_v1(void) __asm__("nvmlInit") EXPORT;

static unsigned long long env_ull(const char *name, unsigned long long fallback, unsigned long long hi) {
    const char *text = getenv(name);
    char *end;
    unsigned long long v = text ? strtoull(text, &end, 10) : fallback;
    return text && (*end || end == text || v < 1 || v > hi) ? fallback : v;
}

static unsigned long long card_total;

/* The node driver's version (from the ledger; R580's without one) and whether it has per-cgroup limits. */
static unsigned int driver_major = 580, driver_minor = 65, driver_patch = 6;
static int driver_cuda = 13000;
#define MEMORY_LIMITS_BRANCH 615

static unsigned long long total_bytes(void) { return card_total; }

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

static int ledger_card(unsigned int *count, unsigned long long *total);
static int ledger_memory_view(unsigned int index, nvmlMemory_v2_t *memory);

/* The card: the node ledger's when one sits beside this library (the environment cannot enlarge it),
 * else FAKE_CUDA_DEVICES x FAKE_CUDA_TOTAL_MIB as the in-process fake driver reads them. */
EXPORT nvmlReturn_t nvmlInit_v2(void) {
    if (!ledger_card(&device_count, &card_total)) {
        device_count = (unsigned int)env_ull("FAKE_CUDA_DEVICES", 1, MAX_DEVICES);
        card_total = env_ull("FAKE_CUDA_TOTAL_MIB", 15360, 1ull << 30) << 20;
    }
    for (unsigned int i = 0; i < device_count; i++) devices[i].index = i;
    __atomic_add_fetch(&initialised, 1, __ATOMIC_SEQ_CST);
    return NVML_SUCCESS;
}

nvmlReturn_t fake_nvmlInit_v1(void) { return nvmlInit_v2(); }

/* Clients print it on every failed call (go-nvml's ErrorString, as KAI's reservation pod does). */
EXPORT const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_OPERATING_SYSTEM: return "Operating System Error";
    default: return "Unknown Error";
    }
}

/* Reference counted, as NVML's own: a library's nvmlShutdown does not end its host process's other users' session. */
EXPORT nvmlReturn_t nvmlShutdown(void) {
    int count = __atomic_load_n(&initialised, __ATOMIC_SEQ_CST);
    while (count > 0 && !__atomic_compare_exchange_n(&initialised, &count, count - 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return count > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
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

/* R615 changed _v2 (not the original) to account for the caller's cgroup: the ledger's view for this
 * process, capped to its cgroup's hard limit there. */
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    if (!valid(device) || !memory) return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != NVML_MEMORY_V2) return NVML_ERROR_INVALID_ARGUMENT;
    if (ledger_memory_view(device->index, memory) == 0) return NVML_SUCCESS;
    memory->total = total_bytes();
    memory->reserved = 0;
    memory->used = used_bytes(device->index);
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

/* ---- running processes, from the fake driver's ledger ---- */

/* nvml.h's process records (nvmlProcessInfo_v1_t for the original entry points;
 * nvmlProcessInfo_v2_t, alias nvmlProcessInfo_t, for _v2 and _v3). */
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
    unsigned int host_pid;
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

/* Live processes charged on NVML device `index`, by host PID, as the node ledger's kernel names them:
 * allocations, contexts, limits, modules and imports alike, as a real NVML reports usedGpuMemory. */
static nvmlReturn_t ledger_processes(unsigned int index, struct held **out, unsigned int *count) {
    *out = NULL;
    *count = 0;
    int fd = fake_ledger_connect((const void *)nvmlInit_v2);
    if (fd == -1) return NVML_ERROR_NOT_SUPPORTED; /* no node-wide view to answer from */
    if (fd < 0) return NVML_ERROR_UNKNOWN;
    fake_ledger_procs_reply *reply = malloc(sizeof *reply);
    struct held *held = malloc(FAKE_LEDGER_MAX_PROCESSES * sizeof *held);
    fake_ledger_request req = {.op = FAKE_OP_PROCESSES, .dev = (int32_t)index};
    ssize_t n = reply && held ? fake_ledger_call(fd, &req, reply, sizeof *reply, -1, NULL) : -1;
    close(fd);
    if (n < 0 || reply->head.status != 0 || reply->head.count > FAKE_LEDGER_MAX_PROCESSES ||
        (size_t)n < sizeof reply->head + reply->head.count * sizeof(fake_ledger_process)) {
        free(reply);
        free(held);
        return NVML_ERROR_UNKNOWN;
    }
    for (unsigned int i = 0; i < reply->head.count; i++)
        held[i] = (struct held){.host_pid = reply->procs[i].pid, .bytes = reply->procs[i].bytes};
    *count = reply->head.count;
    *out = held;
    free(reply);
    return NVML_SUCCESS;
}

/* One request on a connection of its own (NVML calls are rare): the reply's status, or `broken` when
 * there is no ledger to answer (-1 from the connect: none beside the library) or the link fails. */
static int ledger_once(fake_ledger_request *req, fake_ledger_reply *r, int send_fd, int broken) {
    int fd = fake_ledger_connect((const void *)nvmlInit_v2);
    if (fd < 0) return broken;
    ssize_t n = fake_ledger_call(fd, req, r, sizeof *r, send_fd, NULL);
    close(fd);
    return n < 0 ? broken : r->status;
}

/* What the node ledger says is taken on device `index` (allocations and the driver's reservations);
 * -1 when there is no node ledger to ask. */
static int ledger_device_used(unsigned int index, unsigned long long *used) {
    *used = 0;
    fake_ledger_request req = {.op = FAKE_OP_STATS, .dev = (int32_t)index};
    fake_ledger_reply r = {0};
    if (ledger_once(&req, &r, -1, -1) != 0) return -1;
    *used = r.v[0] + r.v[4];
    return 0;
}

/* The node ledger's card (count, bytes each) and driver when one sits beside this library; 0 when none
 * answers. */
static int ledger_card(unsigned int *count, unsigned long long *total) {
    fake_ledger_request req = {.op = FAKE_OP_HELLO};
    fake_ledger_reply r = {0};
    if (ledger_once(&req, &r, -1, -1) != 0 || r.v[0] < 1 || r.v[0] > MAX_DEVICES) return 0;
    *count = (unsigned int)r.v[0];
    *total = r.v[1];
    if (r.v[2]) { /* 0 from a ledger older than driver branches: R580's figures stand */
        driver_major = (unsigned int)r.v[2];
        driver_minor = (unsigned int)(r.v[3] >> 16);
        driver_patch = (unsigned int)(r.v[3] & 0xffff);
        driver_cuda = (int)r.v[4];
    }
    return 1;
}

/* The device as this process's cgroup sees it (fake_ledger.h's FAKE_OP_MEMINFO); -1 without a ledger. */
static int ledger_memory_view(unsigned int index, nvmlMemory_v2_t *memory) {
    fake_ledger_request req = {.op = FAKE_OP_MEMINFO, .dev = (int32_t)index};
    fake_ledger_reply r = {0};
    if (ledger_once(&req, &r, -1, -1) != 0) return -1;
    memory->total = r.v[0];
    memory->free = r.v[1];
    memory->used = r.v[2];
    memory->reserved = 0;
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

/* "580.65.06", the node driver's; NVML's own version is the CUDA major before it ("13.580.65.06"). */
static nvmlReturn_t driver_version(char *version, unsigned int length, int with_nvml) {
    char text[48];
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    int n = with_nvml ? snprintf(text, sizeof text, "%d.", driver_cuda / 1000) : 0;
    snprintf(text + n, sizeof text - (size_t)n, "%u.%02u.%02u", driver_major, driver_minor, driver_patch);
    return copy_text(version, length, text);
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) { return driver_version(version, length, 0); }

EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) { return driver_version(version, length, 1); }

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version) {
    if (!version) return NVML_ERROR_INVALID_ARGUMENT;
    *version = driver_cuda;
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

/* ---- NVML 13.4: per-cgroup device memory limits (driver R615) ----
 * The cgroup travels to the ledger as a directory this process opened (the real NVML opens the path too:
 * NVML_ERROR_OPERATING_SYSTEM when it cannot), so the ledger judges the kernel's object; the ledger checks
 * root, the cgroup and the values, and answers NOT_SUPPORTED for a driver older than R615. */

static nvmlReturn_t limits_call(nvmlDevice_t device, const char *name_space, fake_ledger_request *req,
                                fake_ledger_reply *r) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!valid(device) || !name_space) return NVML_ERROR_INVALID_ARGUMENT;
    if (driver_major < MEMORY_LIMITS_BRANCH) return NVML_ERROR_NOT_SUPPORTED; /* the ledger says so too */
    /* Opened or not, the ledger decides: a caller without root hears NO_PERMISSION first. */
    int dir = open(name_space, O_PATH | O_DIRECTORY | O_CLOEXEC);
    req->dev = (int32_t)device->index;
    int rc = ledger_once(req, r, dir, NVML_ERROR_UNKNOWN);
    if (dir >= 0) close(dir);
    return rc;
}

EXPORT nvmlReturn_t nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t device, nvmlSetMemoryLimits_v1_t *limits) {
    if (!limits) return initialised ? NVML_ERROR_INVALID_ARGUMENT : NVML_ERROR_UNINITIALIZED;
    fake_ledger_request req = {.op = FAKE_OP_SET_LIMITS, .a = limits->softLimit, .b = limits->hardLimit};
    fake_ledger_reply r = {0};
    return limits_call(device, limits->nameSpace, &req, &r);
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t device, nvmlGetMemoryLimits_v1_t *limits) {
    if (!limits) return initialised ? NVML_ERROR_INVALID_ARGUMENT : NVML_ERROR_UNINITIALIZED;
    fake_ledger_request req = {.op = FAKE_OP_GET_LIMITS};
    fake_ledger_reply r = {0};
    nvmlReturn_t rc = limits_call(device, limits->nameSpace, &req, &r);
    if (rc == NVML_SUCCESS) {
        limits->softLimit = r.v[0];
        limits->hardLimit = r.v[1];
        limits->currentUsed = r.v[2];
    }
    return rc;
}
