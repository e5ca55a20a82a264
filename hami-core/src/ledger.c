/* Per-device usage ledger. Reserve-before-allocate with a compare-and-swap makes
 * check-and-charge one atomic step, so racing threads can never overshoot the limit.
 * The state is a plain array of atomics so it can later live in a shared mapping. */
#include <stdatomic.h>
#include "vgpu.h"

static _Atomic uint64_t used[VGPU_MAX_DEVICES];

int vgpu_ledger_reserve(int idx, uint64_t bytes) {
    uint64_t limit = vgpu_config_limit(idx);
    uint64_t cur = atomic_load_explicit(&used[idx], memory_order_relaxed);
    do {
        if (bytes > limit || cur > limit - bytes) return 0;
    } while (!atomic_compare_exchange_weak_explicit(&used[idx], &cur, cur + bytes,
                                                    memory_order_acq_rel, memory_order_relaxed));
    return 1;
}

void vgpu_ledger_release(int idx, uint64_t bytes) {
    atomic_fetch_sub_explicit(&used[idx], bytes, memory_order_acq_rel);
}

uint64_t vgpu_ledger_used(int idx) { return atomic_load_explicit(&used[idx], memory_order_acquire); }

uint64_t vgpu_ledger_limit(int idx) { return vgpu_config_limit(idx); }
