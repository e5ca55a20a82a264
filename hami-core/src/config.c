/* Reads the environment contract once: memory limits per device and the
 * CUDA-ordinal -> device-index map from CUDA_VISIBLE_DEVICES. */
#include <ctype.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "vgpu.h"

static uint64_t limits[VGPU_MAX_DEVICES];
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

/* Only plain integer lists can be mapped without the driver; UUIDs keep the identity map. */
static void read_visible_devices(void) {
    const char *text = getenv("CUDA_VISIBLE_DEVICES");
    if (!text || !*text) return;
    int count = 0;
    for (const char *p = text; *p && count < VGPU_MAX_DEVICES;) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 0 || v >= VGPU_MAX_DEVICES || (*end && *end != ',')) {
            vgpu_log(VGPU_LOG_INFO, "CUDA_VISIBLE_DEVICES=\"%s\" is not an index list; "
                     "using CUDA ordinals as device indices", text);
            return;
        }
        visible_map[count++] = (int)v;
        p = *end ? end + 1 : end;
    }
    visible_count = count;
}

static void config_init_once(void) {
    vgpu_log_init();
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

int vgpu_config_index(CUdevice ordinal) {
    if (ordinal < 0) return -1;
    if (visible_count < 0) return ordinal < VGPU_MAX_DEVICES ? ordinal : -1;
    return ordinal < visible_count ? visible_map[ordinal] : -1;
}
