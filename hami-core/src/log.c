/* Logging to stderr, gated by LIBCUDA_LOG_LEVEL (HAMi-core's levels); errors always print. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "vgpu.h"

static int log_level = VGPU_LOG_WARN;
static const char *const level_names[] = {"ERROR", "ERROR", "WARN", "INFO", "DEBUG"};

void vgpu_log_init(void) {
    const char *text = getenv("LIBCUDA_LOG_LEVEL");
    if (!text || !*text) return;
    char *end = NULL;
    errno = 0;
    long value = strtol(text, &end, 10);
    if (errno || end == text || *end || value < 0 || value > 4) {
        vgpu_log(VGPU_LOG_ERROR, "LIBCUDA_LOG_LEVEL=\"%s\" is not 0-4; keeping level %d", text,
                 log_level);
        return;
    }
    log_level = (int)value;
}

/* One write(2) per line so lines from concurrent threads never interleave. */
void vgpu_log(int level, const char *fmt, ...) {
    if (level > log_level && level != VGPU_LOG_ERROR) return;
    int saved_errno = errno;
    char line[512];
    int n = snprintf(line, sizeof line, "[libvgpu %s pid=%d] ", level_names[level], (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    n += vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof line - 2) n = (int)sizeof line - 2;
    line[n++] = '\n';
    ssize_t ignored = write(STDERR_FILENO, line, (size_t)n);
    (void)ignored;
    errno = saved_errno;
}
