/* Live allocations charged to the ledger, keyed by (kind, handle). Sharded
 * chained hash tables: O(1) lookup on free and little contention between threads. */
#include <pthread.h>
#include <stdlib.h>
#include "vgpu.h"

#define SHARD_BITS 6
#define SHARDS (1u << SHARD_BITS)
#define INITIAL_BUCKETS 64u

struct entry {
    struct entry *next;
    uint64_t key;
    uint64_t bytes;
    int kind;
    int idx;
};

struct shard {
    pthread_mutex_t lock;
    struct entry **buckets;
    size_t nbuckets; /* power of two */
    size_t count;
};

static struct shard shards[SHARDS] = {
    [0 ... SHARDS - 1] = {.lock = PTHREAD_MUTEX_INITIALIZER},
};

static uint64_t hash_of(int kind, uint64_t key) {
    uint64_t h = (key ^ ((uint64_t)kind << 56)) * 0x9E3779B97F4A7C15ull;
    return h ^ (h >> 29);
}

static struct shard *shard_of(uint64_t h) { return &shards[h >> (64 - SHARD_BITS)]; }

static int grow(struct shard *s) {
    size_t n = s->nbuckets ? s->nbuckets * 2 : INITIAL_BUCKETS;
    struct entry **fresh = calloc(n, sizeof *fresh);
    if (!fresh) return s->nbuckets ? 0 : -1; /* a full table still works, just slower */
    for (size_t i = 0; i < s->nbuckets; i++) {
        struct entry *e = s->buckets[i];
        while (e) {
            struct entry *next = e->next;
            size_t b = hash_of(e->kind, e->key) & (n - 1);
            e->next = fresh[b];
            fresh[b] = e;
            e = next;
        }
    }
    free(s->buckets);
    s->buckets = fresh;
    s->nbuckets = n;
    return 0;
}

int vgpu_track_add(enum vgpu_kind kind, uint64_t key, int idx, uint64_t bytes) {
    struct entry *e = malloc(sizeof *e);
    if (!e) return -1;
    *e = (struct entry){.key = key, .bytes = bytes, .kind = kind, .idx = idx};
    uint64_t h = hash_of(kind, key);
    struct shard *s = shard_of(h);
    pthread_mutex_lock(&s->lock);
    if (s->count >= s->nbuckets * 2 && grow(s) != 0) {
        pthread_mutex_unlock(&s->lock);
        free(e);
        return -1;
    }
    size_t b = h & (s->nbuckets - 1);
    e->next = s->buckets[b];
    s->buckets[b] = e;
    s->count++;
    pthread_mutex_unlock(&s->lock);
    return 0;
}

int vgpu_track_take(enum vgpu_kind kind, uint64_t key, int *idx, uint64_t *bytes) {
    uint64_t h = hash_of(kind, key);
    struct shard *s = shard_of(h);
    struct entry *found = NULL;
    pthread_mutex_lock(&s->lock);
    if (s->nbuckets) {
        struct entry **link = &s->buckets[h & (s->nbuckets - 1)];
        while (*link && ((*link)->key != key || (*link)->kind != (int)kind)) link = &(*link)->next;
        found = *link;
        if (found) {
            *link = found->next;
            s->count--;
        }
    }
    pthread_mutex_unlock(&s->lock);
    if (!found) return 0;
    *idx = found->idx;
    *bytes = found->bytes;
    free(found);
    return 1;
}

/* Runs in a fork child: locks may have been held by parent threads that do not exist here. */
void vgpu_track_after_fork(void) {
    for (unsigned i = 0; i < SHARDS; i++) {
        pthread_mutex_init(&shards[i].lock, NULL);
        shards[i].buckets = NULL; /* the parent's entries stay allocated but unused */
        shards[i].nbuckets = 0;
        shards[i].count = 0;
    }
}
