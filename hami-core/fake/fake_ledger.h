/* The layout of the fake driver's node-wide ledger (the FAKE_CUDA_STATE file fake_cuda.c keeps):
 * device counters, then one record per process that holds device memory. The fake NVML reads
 * it to answer the per-process queries; it must match fake_cuda.c's struct shared_state, which
 * is why the reader refuses a file of any other size. */
#ifndef FAKE_LEDGER_H
#define FAKE_LEDGER_H

#include <stddef.h>

#define FAKE_LEDGER_SLOTS 17 /* 16 devices, then host VMM memory */
#define FAKE_LEDGER_PROCS 4096

typedef struct {
    unsigned long long used, peak, allocs, frees; /* _Atomic in fake_cuda.c: same size and alignment */
} fake_ledger_device;

/* A live process holds an OFD write lock on its own record for its whole life. `pid` is what
 * getpid() said in the process's own PID namespace: a hint, never proof (see fake_nvml.c). */
typedef struct {
    int pid;
    int pad;
    unsigned long long start;
    unsigned long long used[FAKE_LEDGER_SLOTS];
} fake_ledger_proc;

typedef struct {
    fake_ledger_device devices[FAKE_LEDGER_SLOTS];
    fake_ledger_proc procs[FAKE_LEDGER_PROCS];
} fake_ledger;

/* Writers hold a write lock on this range while they change any counter or record. */
#define FAKE_LEDGER_COUNTERS_LEN offsetof(fake_ledger, procs)

#endif
