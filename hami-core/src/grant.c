/* The node-written grant: when /etc/kai-isolator is mounted, limits, devices and the
 * accounting file come from its grant.json (root-owned, read-only), never from the
 * environment the tenant controls. A grant that never appears or does not parse closes
 * every device. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include "vgpu.h"

#define GRANT_MAX_BYTES 65536
#define DEFAULT_WAIT_S 30
#define POLL_NS 100000000L

int vgpu_grant_mounted(void) {
    struct stat st;
    return stat(VGPU_GRANT_DIR, &st) == 0 && S_ISDIR(st.st_mode);
}

/* ---- a strict reader for the one JSON shape shared/grant.py writes ---- */

struct reader {
    const char *p, *end;
};

static void skip_ws(struct reader *r) {
    while (r->p < r->end && (*r->p == ' ' || *r->p == '\t' || *r->p == '\n' || *r->p == '\r')) r->p++;
}

static int expect(struct reader *r, char c) {
    skip_ws(r);
    if (r->p >= r->end || *r->p != c) return -1;
    r->p++;
    return 0;
}

static int peek(struct reader *r, char c) {
    skip_ws(r);
    return r->p < r->end && *r->p == c;
}

static int hex_digit(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

/* A JSON string. With `out`, its value is kept (escapes decoded); a \u escape there is refused, as
 * no field we read carries one (the node agent writes plain ASCII UUIDs and key names). */
static int read_string(struct reader *r, char *out, size_t cap) {
    if (expect(r, '"') != 0) return -1;
    size_t n = 0;
    while (r->p < r->end && *r->p != '"') {
        char c = *r->p++;
        if ((unsigned char)c < 0x20) return -1;
        if (c == '\\') {
            if (r->p >= r->end) return -1;
            c = *r->p++;
            switch (c) {
                case '"': case '\\': case '/': break;
                case 'b': c = '\b'; break;
                case 'f': c = '\f'; break;
                case 'n': c = '\n'; break;
                case 'r': c = '\r'; break;
                case 't': c = '\t'; break;
                case 'u':
                    if (out || r->end - r->p < 4 || !hex_digit(r->p[0]) || !hex_digit(r->p[1]) || !hex_digit(r->p[2]) ||
                        !hex_digit(r->p[3]))
                        return -1;
                    r->p += 4;
                    continue;
                default: return -1;
            }
        }
        if (out) {
            if (n + 1 >= cap) return -1;
            out[n] = c;
        }
        n++;
    }
    if (out) out[n] = '\0';
    return expect(r, '"');
}

static int is_digit(char c) { return c >= '0' && c <= '9'; }

/* A JSON number (to skip it): -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)? */
static int skip_number(struct reader *r) {
    if (r->p < r->end && *r->p == '-') r->p++;
    if (r->p >= r->end || !is_digit(*r->p)) return -1;
    if (*r->p++ != '0')
        while (r->p < r->end && is_digit(*r->p)) r->p++;
    if (r->p < r->end && *r->p == '.') {
        if (++r->p >= r->end || !is_digit(*r->p)) return -1;
        while (r->p < r->end && is_digit(*r->p)) r->p++;
    }
    if (r->p < r->end && (*r->p == 'e' || *r->p == 'E')) {
        if (++r->p < r->end && (*r->p == '+' || *r->p == '-')) r->p++;
        if (r->p >= r->end || !is_digit(*r->p)) return -1;
        while (r->p < r->end && is_digit(*r->p)) r->p++;
    }
    return 0;
}

/* A whole number that fits 64 bits, written as JSON writes it (no sign, fraction, exponent or
 * leading zero). */
static int read_u64(struct reader *r, uint64_t *value) {
    skip_ws(r);
    uint64_t v = 0;
    const char *start = r->p;
    while (r->p < r->end && is_digit(*r->p)) {
        unsigned digit = (unsigned)(*r->p++ - '0');
        if (v > (UINT64_MAX - digit) / 10) return -1;
        v = v * 10 + digit;
    }
    if (r->p == start || (*start == '0' && r->p - start > 1)) return -1;
    if (r->p < r->end && (*r->p == '.' || *r->p == 'e' || *r->p == 'E')) return -1;
    *value = v;
    return 0;
}

static int skip_literal(struct reader *r, const char *word) {
    size_t len = strlen(word);
    if ((size_t)(r->end - r->p) < len || memcmp(r->p, word, len) != 0) return -1;
    r->p += len;
    return 0;
}

static int skip_value(struct reader *r, int depth);

static int skip_container(struct reader *r, char open, char close, int depth) {
    if (expect(r, open) != 0 || depth > 8) return -1;
    if (peek(r, close)) return expect(r, close);
    do {
        if (open == '{' && (read_string(r, NULL, 0) != 0 || expect(r, ':') != 0)) return -1;
        if (skip_value(r, depth + 1) != 0) return -1;
    } while (peek(r, ',') && expect(r, ',') == 0);
    return expect(r, close);
}

static int skip_value(struct reader *r, int depth) {
    skip_ws(r);
    if (r->p >= r->end) return -1;
    switch (*r->p) {
        case '"': return read_string(r, NULL, 0);
        case '{': return skip_container(r, '{', '}', depth);
        case '[': return skip_container(r, '[', ']', depth);
        case 't': return skip_literal(r, "true");
        case 'f': return skip_literal(r, "false");
        case 'n': return skip_literal(r, "null");
        default: return skip_number(r);
    }
}

/* {"uuid": "GPU-…", "limit_bytes": N} in any order; both required, nothing else. */
static int read_device(struct reader *r, struct vgpu_grant_device *device) {
    int have_uuid = 0, have_limit = 0;
    if (expect(r, '{') != 0) return -1;
    do {
        char key[32];
        if (read_string(r, key, sizeof key) != 0 || expect(r, ':') != 0) return -1;
        if (strcmp(key, "uuid") == 0 && !have_uuid) {
            if (read_string(r, device->uuid, sizeof device->uuid) != 0 || !device->uuid[0]) return -1;
            have_uuid = 1;
        } else if (strcmp(key, "limit_bytes") == 0 && !have_limit) {
            if (read_u64(r, &device->limit) != 0 || device->limit == 0) return -1;
            have_limit = 1;
        } else {
            return -1;
        }
    } while (peek(r, ',') && expect(r, ',') == 0);
    return expect(r, '}') == 0 && have_uuid && have_limit ? 0 : -1;
}

static int read_devices(struct reader *r, struct vgpu_grant *grant) {
    if (expect(r, '[') != 0) return -1;
    if (peek(r, ']')) return -1; /* a grant of nothing is not a grant */
    do {
        if (grant->count >= VGPU_GRANT_MAX_DEVICES || read_device(r, &grant->devices[grant->count]) != 0) return -1;
        for (int i = 0; i < grant->count; i++)
            if (strcasecmp(grant->devices[i].uuid, grant->devices[grant->count].uuid) == 0) return -1;
        grant->count++;
    } while (peek(r, ',') && expect(r, ',') == 0);
    return expect(r, ']');
}

int vgpu_grant_parse(const char *text, size_t len, struct vgpu_grant *grant) {
    struct reader r = {text, text + len};
    uint64_t version = 0;
    int have_devices = 0;
    memset(grant, 0, sizeof *grant);
    if (expect(&r, '{') != 0) return -1;
    if (!peek(&r, '}')) {
        do {
            char key[64];
            if (read_string(&r, key, sizeof key) != 0 || expect(&r, ':') != 0) return -1;
            if (strcmp(key, "version") == 0) {
                if (read_u64(&r, &version) != 0) return -1;
            } else if (strcmp(key, "devices") == 0 && !have_devices) {
                if (read_devices(&r, grant) != 0) return -1;
                have_devices = 1;
            } else if (skip_value(&r, 0) != 0) {
                return -1;
            }
        } while (peek(&r, ',') && expect(&r, ',') == 0);
    }
    if (expect(&r, '}') != 0) return -1;
    skip_ws(&r);
    return r.p == r.end && version == 1 && have_devices ? 0 : -1;
}

/* ---- reading it, waiting for the node agent when it is not there yet ---- */

static long wait_seconds(void) {
    /* The tenant may shorten or lengthen its own wait; either way the outcome is fail-closed. */
    const char *text = getenv("VGPU_GRANT_WAIT_SECONDS");
    char *end;
    long v = text && *text ? strtol(text, &end, 10) : DEFAULT_WAIT_S;
    if (text && *text && (*end || v < 0 || v > 3600)) {
        vgpu_log(VGPU_LOG_WARN, "VGPU_GRANT_WAIT_SECONDS=\"%s\" is not 0..3600; waiting %d s", text, DEFAULT_WAIT_S);
        v = DEFAULT_WAIT_S;
    }
    return v;
}

static ssize_t read_file(const char *path, char *buf, size_t cap) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return -1;
    size_t n = 0;
    ssize_t got;
    while (n < cap && (got = read(fd, buf + n, cap - n)) != 0) {
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) {
            close(fd);
            return -1;
        }
        n += (size_t)got;
    }
    close(fd);
    return (ssize_t)n;
}

int vgpu_grant_load(struct vgpu_grant *grant) {
    static char buf[GRANT_MAX_BYTES + 1];
    long waited_ns = 0, limit_ns = wait_seconds() * 1000000000L;
    ssize_t n;
    while ((n = read_file(VGPU_GRANT_FILE, buf, sizeof buf)) < 0 && errno == ENOENT && waited_ns < limit_ns) {
        /* Said once, so an operator (or a test) can see the wait begin rather than infer it from silence. */
        if (waited_ns == 0)
            vgpu_log(VGPU_LOG_INFO, "waiting up to %ld s for the grant at %s", limit_ns / 1000000000L, VGPU_GRANT_FILE);
        nanosleep(&(struct timespec){.tv_nsec = POLL_NS}, NULL);
        waited_ns += POLL_NS;
    }
    if (n < 0) {
        vgpu_log(VGPU_LOG_ERROR, "no grant at %s after %ld s (%s); every allocation will fail", VGPU_GRANT_FILE,
                 waited_ns / 1000000000L, strerror(errno));
        return -1;
    }
    if (waited_ns > 0)  /* how long a container that started before its grant waited (bench/nri_creation.py reads it) */
        vgpu_log(VGPU_LOG_INFO, "found the grant after %ld ms", waited_ns / 1000000L);
    if ((size_t)n > GRANT_MAX_BYTES || vgpu_grant_parse(buf, (size_t)n, grant) != 0) {
        vgpu_log(VGPU_LOG_ERROR, "the grant %s is malformed; every allocation will fail", VGPU_GRANT_FILE);
        return -1;
    }
    return 0;
}
