/* Reads the limits once: from the node-written grant when it is mounted (devices by UUID),
 * else from the environment contract (limits per device and the CUDA-ordinal -> device-index
 * map from CUDA_VISIBLE_DEVICES). */
#include <ctype.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include "vgpu.h"

#define VGPU_UUID_TOKEN 96
#define DEFAULT_STATE_PATH "/tmp/cudevshr.cache"

static uint64_t limits[VGPU_MAX_DEVICES];
static int granted;
static struct vgpu_grant grant;
/* Under a grant: CUDA ordinal -> accounting index, learnt from the device's UUID on first use. */
static int ordinal_index[VGPU_MAX_DEVICES];
static int visible_map[VGPU_MAX_DEVICES];
static int visible_count = -1; /* -1: identity mapping */
static pthread_once_t config_once = PTHREAD_ONCE_INIT;

static int unit_shift(char c) {
    switch (tolower((unsigned char)c)) {
        case 'k': return 10;
        case 'm': return 20;
        case 'g': return 30;
        case 't': return 40;
        default: return -1;
    }
}

static const char *skip_space(const char *p) {
    while (*p && isspace((unsigned char)*p)) p++;
    return p;
}

/* Accepts "<digits>[k|m|g|t][i][b]" (any case) with optional surrounding spaces. */
int vgpu_parse_size(const char *text, uint64_t *bytes) {
    const char *p = skip_space(text);
    uint64_t value = 0;
    if (!isdigit((unsigned char)*p)) return -1;
    for (; isdigit((unsigned char)*p); p++) {
        unsigned digit = (unsigned)(*p - '0');
        if (value > (UINT64_MAX - digit) / 10) return -1;
        value = value * 10 + digit;
    }
    int shift = 0;
    if (*p && unit_shift(*p) >= 0) {
        shift = unit_shift(*p++);
        if (*p == 'i' || *p == 'I') p++;
        if (*p == 'b' || *p == 'B') p++;
    }
    if (*skip_space(p)) return -1;
    if (shift && value > (UINT64_MAX >> shift)) return -1;
    *bytes = value << shift;
    return 0;
}

/* Reads one limit variable; unset, empty and 0 all mean "not set here". A malformed
 * value is an error and becomes a zero-byte limit, so the device fails closed. */
static int read_limit(const char *name, uint64_t *limit) {
    const char *text = getenv(name);
    uint64_t bytes = 0;
    if (!text || !*skip_space(text)) return 0;
    if (vgpu_parse_size(text, &bytes) != 0) {
        vgpu_log(VGPU_LOG_ERROR,
                 "%s=\"%s\" is not a size (use e.g. 4096m, 4g, 4GiB or bytes); "
                 "allocations on the affected device(s) will fail",
                 name, text);
        *limit = 0;
        return 1;
    }
    if (bytes == 0) return 0;
    *limit = bytes;
    return 1;
}

static void read_limits(void) {
    uint64_t fallback = VGPU_UNLIMITED;
    read_limit("CUDA_DEVICE_MEMORY_LIMIT", &fallback);
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) {
        char name[48];
        snprintf(name, sizeof name, "CUDA_DEVICE_MEMORY_LIMIT_%d", i);
        if (!read_limit(name, &limits[i])) limits[i] = fallback;
    }
}

/* CUDA_VISIBLE_DEVICES entries that are UUIDs ("GPU-…", possibly abbreviated) are kept
 * and resolved to NVML indices on first use, through NVML, which ignores the variable. */
static char visible_tokens[VGPU_MAX_DEVICES][VGPU_UUID_TOKEN];
static int visible_tokens_count;
static pthread_once_t resolve_once = PTHREAD_ONCE_INIT;

static int parse_index(const char *token, long *v) {
    char *end;
    *v = strtol(token, &end, 10);
    return end != token && *end == '\0' && *v >= 0 && *v < VGPU_MAX_DEVICES ? 0 : -1;
}

static void read_visible_devices(void) {
    const char *text = getenv("CUDA_VISIBLE_DEVICES");
    if (!text || !*text) return;
    int count = 0, uuids = 0;
    for (const char *p = text; *p && count < VGPU_MAX_DEVICES;) {
        size_t len = strcspn(p, ",");
        char *token = visible_tokens[count];
        snprintf(token, VGPU_UUID_TOKEN, "%.*s", (int)(len < VGPU_UUID_TOKEN ? len : VGPU_UUID_TOKEN - 1), p);
        long v;
        if (parse_index(token, &v) == 0) {
            visible_map[count++] = (int)v;
        } else if (strncmp(token, "GPU-", 4) == 0 && len > 4 && len < VGPU_UUID_TOKEN) {
            visible_map[count++] = -1;
            uuids++;
        } else {
            break; /* the driver ignores this entry and everything after it */
        }
        p += len;
        if (*p == ',') p++;
    }
    if (count == 0) {
        vgpu_log(VGPU_LOG_INFO, "CUDA_VISIBLE_DEVICES=\"%s\" names no device index or GPU UUID; "
                 "using CUDA ordinals as device indices", text);
        return;
    }
    visible_tokens_count = uuids ? count : 0;
    visible_count = count;
}

typedef nvmlReturn_t (*nvml_void_fn)(void);
typedef nvmlReturn_t (*nvml_count_fn)(unsigned int *);
typedef nvmlReturn_t (*nvml_handle_fn)(unsigned int, nvmlDevice_t *);

/* NVML index of the only device whose UUID starts with token, or -1. */
static int nvml_index_of(const char *token, unsigned count, nvml_handle_fn handle_of) {
    int found = -1;
    for (unsigned i = 0; i < count && i < VGPU_MAX_DEVICES; i++) {
        nvmlDevice_t dev;
        char uuid[96];
        if (handle_of(i, &dev) == NVML_SUCCESS && vgpu_nvml.nvmlDeviceGetUUID &&
            vgpu_nvml.nvmlDeviceGetUUID(dev, uuid, sizeof uuid) == NVML_SUCCESS &&
            strncmp(uuid, token, strlen(token)) == 0) {
            if (found >= 0) return -1; /* ambiguous, as for the driver */
            found = (int)i;
        }
    }
    return found;
}

static void resolve_uuids(void) {
    nvml_void_fn init = (nvml_void_fn)vgpu_nvml_symbol("nvmlInit_v2");
    nvml_void_fn shutdown = (nvml_void_fn)vgpu_nvml_symbol("nvmlShutdown");
    nvml_count_fn count_of = (nvml_count_fn)vgpu_nvml_symbol("nvmlDeviceGetCount_v2");
    nvml_handle_fn handle_of = (nvml_handle_fn)vgpu_nvml_symbol("nvmlDeviceGetHandleByIndex_v2");
    unsigned count = 0;
    int ok = init && shutdown && count_of && handle_of && init() == NVML_SUCCESS;
    if (ok && count_of(&count) != NVML_SUCCESS) count = 0;
    int unknown = -1;
    for (int k = 0; k < visible_tokens_count && unknown < 0; k++)
        if (visible_map[k] < 0 && (visible_map[k] = ok ? nvml_index_of(visible_tokens[k], count, handle_of) : -1) < 0)
            unknown = k;
    if (ok) shutdown();
    if (unknown < 0) return;
    vgpu_log(VGPU_LOG_WARN, "CUDA_VISIBLE_DEVICES entry \"%s\" matches no GPU known to NVML; "
             "using CUDA ordinals as device indices", visible_tokens[unknown]);
    __atomic_store_n(&visible_count, -1, __ATOMIC_RELEASE);
}

/* Every device the grant names gets its limit; every other index stays closed (0). A grant
 * that cannot be read leaves all of them closed. */
static void read_grant(void) {
    granted = 1;
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) ordinal_index[i] = -2;
    if (vgpu_grant_load(&grant) != 0) grant.count = 0;
    for (int i = 0; i < grant.count; i++) limits[i] = grant.devices[i].limit;
}

static void config_init_once(void) {
    vgpu_log_init();
    if (vgpu_grant_mounted()) {
        read_grant();
        return;
    }
    read_limits();
    read_visible_devices();
}

void vgpu_config_init(void) { pthread_once(&config_once, config_init_once); }

uint64_t vgpu_config_limit(int idx) { return limits[idx]; }

int vgpu_config_any_limit(void) {
    vgpu_config_init();
    for (int i = 0; i < VGPU_MAX_DEVICES; i++)
        if (limits[i] != VGPU_UNLIMITED) return 1;
    return 0;
}

int vgpu_config_granted(void) {
    vgpu_config_init();
    return granted;
}

const char *vgpu_config_uuid(int idx) { return granted && idx < grant.count ? grant.devices[idx].uuid : ""; }

const char *vgpu_config_state_path(void) {
    vgpu_config_init();
    if (granted) return VGPU_GRANT_STATE_FILE;
    const char *p = getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    return p && *p ? p : DEFAULT_STATE_PATH;
}

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as NVML and nvidia-smi spell it. */
static void format_uuid(const CUuuid *uuid, char *out, size_t cap) {
    const unsigned char *b = (const unsigned char *)uuid->bytes;
    snprintf(out, cap, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
             b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

/* The device's place in the grant, by the UUID the driver gives it: which device the tenant
 * made ordinal 0 (CUDA_VISIBLE_DEVICES, in-process or not) changes nothing. */
static int granted_index(CUdevice ordinal) {
    CUuuid uuid;
    char text[VGPU_UUID_LEN];
    if (!vgpu_cuda.cuDeviceGetUuid || vgpu_cuda.cuDeviceGetUuid(&uuid, ordinal) != CUDA_SUCCESS) return VGPU_CLOSED_INDEX;
    format_uuid(&uuid, text, sizeof text);
    int idx = vgpu_config_index_of_uuid(text);
    if (idx == VGPU_CLOSED_INDEX)
        vgpu_log(VGPU_LOG_ERROR, "device %s is not in the grant %s; allocations on it will fail", text, VGPU_GRANT_FILE);
    return idx;
}

int vgpu_config_index_of_uuid(const char *uuid) {
    for (int i = 0; i < grant.count; i++)
        if (strcasecmp(grant.devices[i].uuid, uuid) == 0) return i;
    return VGPU_CLOSED_INDEX;
}

int vgpu_config_index(CUdevice ordinal) {
    if (ordinal < 0) return -1;
    if (granted) {
        if (ordinal >= VGPU_MAX_DEVICES) return VGPU_CLOSED_INDEX;
        int idx = __atomic_load_n(&ordinal_index[ordinal], __ATOMIC_ACQUIRE);
        if (idx == -2) __atomic_store_n(&ordinal_index[ordinal], idx = granted_index(ordinal), __ATOMIC_RELEASE);
        return idx;
    }
    if (visible_tokens_count) pthread_once(&resolve_once, resolve_uuids);
    int count = __atomic_load_n(&visible_count, __ATOMIC_ACQUIRE);
    if (count < 0) return ordinal < VGPU_MAX_DEVICES ? ordinal : -1;
    return ordinal < count ? visible_map[ordinal] : -1;
}
