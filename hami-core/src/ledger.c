/* Per-device usage ledger. Reserve-before-allocate makes check-and-charge one atomic
 * step, so racing threads (and, through the shared file, racing processes) never
 * overshoot the limit. Without a usable shared file the ledger is process-local atomics;
 * a corrupt or foreign shared file closes every limited device. */
#include <stdatomic.h>
#include "vgpu.h"

static _Atomic uint64_t local_used[VGPU_MAX_DEVICES];

static int local_reserve(int idx, uint64_t bytes) {
    uint64_t limit = vgpu_config_limit(idx);
    uint64_t cur = atomic_load_explicit(&local_used[idx], memory_order_relaxed);
    do {
        if (bytes > limit || cur > limit - bytes) return 0;
    } while (!atomic_compare_exchange_weak_explicit(&local_used[idx], &cur, cur + bytes,
                                                    memory_order_acq_rel, memory_order_relaxed));
    return 1;
}

int vgpu_ledger_reserve(int idx, uint64_t bytes) {
    switch (vgpu_shm_state()) {
        case VGPU_SHM_ON: return vgpu_shm_reserve(idx, bytes);
        case VGPU_SHM_BROKEN: return 0;
        default: return local_reserve(idx, bytes);
    }
}

void vgpu_ledger_release(int idx, uint64_t bytes) {
    switch (vgpu_shm_state()) {
        case VGPU_SHM_ON: vgpu_shm_release(idx, bytes); break;
        case VGPU_SHM_BROKEN: break;
        default: atomic_fetch_sub_explicit(&local_used[idx], bytes, memory_order_acq_rel);
    }
}

static uint64_t used(int idx, int refresh) {
    switch (vgpu_shm_state()) {
        case VGPU_SHM_ON: return vgpu_shm_used(idx, refresh);
        case VGPU_SHM_BROKEN: return 0;
        default: return atomic_load_explicit(&local_used[idx], memory_order_acquire);
    }
}

uint64_t vgpu_ledger_used(int idx) { return used(idx, 0); }

uint64_t vgpu_ledger_used_fresh(int idx) { return used(idx, 1); }

uint64_t vgpu_ledger_limit(int idx) {
    switch (vgpu_shm_state()) {
        case VGPU_SHM_ON: return vgpu_shm_limit(idx);
        case VGPU_SHM_BROKEN: return 0;
        default: return vgpu_config_limit(idx);
    }
}
