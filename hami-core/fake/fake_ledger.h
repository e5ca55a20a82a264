/* The wire protocol between the fake driver (fake_cuda.c, fake_nvml.c) and the node's fake-gpu ledger
 * (services/devcluster/fake_gpu_ledger.py), which owns the node-wide books as a real GPU's kernel driver does. Both libraries
 * reach it through FAKE_LEDGER_SOCKET in their own directory (dladdr, never the environment): a
 * SOCK_SEQPACKET unix socket, one fixed-size request and one reply per call. The ledger charges every
 * byte to the connection's process as the kernel names it (SO_PEERCRED, and each message's
 * SCM_CREDENTIALS must agree), never to a pid the message carries; a connection's memory goes when it
 * closes (exec, exit, close) or its process dies. The layouts must match services/devcluster/fake_gpu_ledger.py's structs. */
#ifndef FAKE_LEDGER_H
#define FAKE_LEDGER_H

#include <stdint.h>

#define FAKE_LEDGER_SOCKET "fake-gpu.sock"
#define FAKE_LEDGER_SLOTS 17 /* 16 devices, then host VMM memory */

enum fake_ledger_op {
    FAKE_OP_HELLO = 1,        /* -> v[0] device count, v[1] bytes per device, v[2] driver branch (580, 615; 0 from a
                                 ledger older than the branch), v[3] minor << 16 | patch of its version, v[4] the
                                 CUDA version it supports (13000, 13040) */
    FAKE_OP_ALLOC = 2,        /* dev, a=bytes, b=FAKE_ALLOC_* flags -> v[0] handle (cuMemAlloc and its family) */
    FAKE_OP_FREE = 3,         /* a=handle (any kind, the caller's own only) */
    FAKE_OP_STATS = 4,        /* dev -> v[0] used, v[1] peak, v[2] allocs, v[3] frees, v[4] reserved */
    FAKE_OP_PROCESSES = 5,    /* dev -> fake_ledger_procs_reply: each process, all it is charged */
    FAKE_OP_CONTEXT = 6,      /* dev -> v[0] handle: the per-context overhead the ledger decides */
    FAKE_OP_LIMIT = 7,        /* dev, a=CUlimit, b=value -> v[0] bytes charged now for that limit */
    FAKE_OP_MODULE = 8,       /* dev, a=bytes of module globals and code -> v[0] handle */
    FAKE_OP_EXPORT = 9,       /* a=handle -> v[0], v[1] token; one fd (SCM_RIGHTS) naming the export */
    FAKE_OP_IMPORT_TOKEN = 10, /* a, b = token -> v[0] handle, v[1] bytes, v[2] device */
    FAKE_OP_IMPORT_FD = 11,   /* the export's fd (SCM_RIGHTS) -> v[0] handle, v[1] bytes, v[2] device */
    FAKE_OP_MEMINFO = 12,     /* dev -> v[0] total, v[1] free, v[2] used: the device as the caller's cgroup sees it
                                 (capped to that cgroup's hard limit on an R615 node) */
    /* NVML 13.4's per-cgroup limits; the cgroup is named by an open directory fd (SCM_RIGHTS, none when the
     * caller could not open the path), so the ledger judges the kernel's object, not a string. `status` is
     * an nvmlReturn_t for these two. */
    FAKE_OP_SET_LIMITS = 13,  /* dev, a=soft, b=hard + the cgroup's fd */
    FAKE_OP_GET_LIMITS = 14,  /* dev + the cgroup's fd -> v[0] soft, v[1] hard, v[2] current use */
};

/* FAKE_OP_ALLOC's flags. Managed memory lives in system memory as far as a cgroup's limit goes (NVIDIA:
 * cudaMallocManaged is not capped on the device), so the flag grants nothing cuMemAllocManaged does not. */
#define FAKE_ALLOC_MANAGED 1u

typedef struct {
    uint32_t op;
    int32_t dev;
    uint64_t a, b;
} fake_ledger_request;

typedef struct {
    int32_t status; /* a CUresult: 0, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_INVALID_VALUE, ... (limits: nvmlReturn_t) */
    uint32_t count; /* FAKE_OP_PROCESSES: records that follow */
    uint64_t v[5];
} fake_ledger_reply;

typedef struct {
    uint32_t pid; /* host PID, as the ledger's kernel names it */
    uint32_t pad;
    uint64_t bytes;
} fake_ledger_process;

#define FAKE_LEDGER_MAX_PROCESSES 4096

typedef struct {
    fake_ledger_reply head;
    fake_ledger_process procs[FAKE_LEDGER_MAX_PROCESSES];
} fake_ledger_procs_reply;

_Static_assert(sizeof(fake_ledger_request) == 24 && sizeof(fake_ledger_reply) == 48 && sizeof(fake_ledger_process) == 16,
               "services/devcluster/fake_gpu_ledger.py's struct formats");

/* Connect to the ledger next to the library that holds `self` (a function of that library). Returns the
 * socket, -1 when no ledger sits next to the library (an in-process GPU), -2 when one should but does
 * not answer. Defined here so both fakes agree on the rule; static, each library has its own copy. */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

static int fake_ledger_connect(const void *self) {
    Dl_info info;
    if (!dladdr(self, &info) || !info.dli_fname) return -1;
    /* Beside the file itself, however the loader reached it (a symlinked directory, /lib for /usr/lib). */
    char real[PATH_MAX];
    const char *path = realpath(info.dli_fname, real) ? real : info.dli_fname;
    char folder[PATH_MAX];
    const char *slash = strrchr(path, '/');
    size_t dir = slash ? (size_t)(slash - path) + 1 : 0;
    if (dir >= sizeof folder) return -2;
    memcpy(folder, dir ? path : ".", dir ? dir : 2);
    folder[dir ? dir : 1] = '\0';
    /* Through the folder's descriptor: a socket path is limited to 108 bytes, a folder's path is not. */
    int folder_fd = open(folder, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (folder_fd < 0) return errno == ENOENT ? -1 : -2;
    struct stat st;
    if (fstatat(folder_fd, FAKE_LEDGER_SOCKET, &st, 0) != 0) {
        int missing = errno == ENOENT;
        close(folder_fd);
        return missing ? -1 : -2;
    }
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof addr.sun_path, "/proc/self/fd/%d/%s", folder_fd, FAKE_LEDGER_SOCKET);
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0) return -2;
    struct timeval bound = {.tv_sec = 10}; /* a ledger that stops answering fails calls, never hangs them */
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &bound, sizeof bound);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &bound, sizeof bound);
    int connected = connect(fd, (struct sockaddr *)&addr, sizeof addr);
    close(folder_fd);
    if (connected != 0) {
        close(fd);
        return -2;
    }
    return fd;
}

/* One call: the request (with `send_fd` attached when >= 0), then the reply into `reply` (`size`
 * bytes at most; with `recv_fd`, an attached fd). Returns the reply's length, -1 on a broken link. */
static ssize_t fake_ledger_call(int fd, const fake_ledger_request *req, void *reply, size_t size, int send_fd,
                                int *recv_fd) {
    union {
        struct cmsghdr h;
        char space[CMSG_SPACE(sizeof(int))];
    } control;
    struct iovec iov = {.iov_base = (void *)req, .iov_len = sizeof *req};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    if (send_fd >= 0) {
        memset(&control, 0, sizeof control);
        msg.msg_control = control.space;
        msg.msg_controllen = sizeof control.space;
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &send_fd, sizeof(int));
    }
    ssize_t n;
    while ((n = sendmsg(fd, &msg, MSG_NOSIGNAL)) < 0 && errno == EINTR) {
    }
    if (n != (ssize_t)sizeof *req) return -1;
    struct iovec in = {.iov_base = reply, .iov_len = size};
    struct msghdr back = {.msg_iov = &in, .msg_iovlen = 1};
    memset(&control, 0, sizeof control);
    back.msg_control = control.space;
    back.msg_controllen = sizeof control.space;
    while ((n = recvmsg(fd, &back, MSG_CMSG_CLOEXEC)) < 0 && errno == EINTR) {
    }
    if (n < (ssize_t)sizeof(fake_ledger_reply)) return -1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&back); c; c = CMSG_NXTHDR(&back, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        int got;
        memcpy(&got, CMSG_DATA(c), sizeof got);
        if (recv_fd)
            *recv_fd = got;
        else
            close(got);
    }
    return n;
}

#endif
