/* ddp_store_map.c - chained hash map of byte strings for the store server
 * (see ddp_store_map.h). FNV-1a hashing; the table doubles when the load
 * factor passes 1, so lookups stay O(1) for any number of ranks' keys. */
#include "ddp_store_map.h"

#include <stdlib.h>
#include <string.h>

#define INITIAL_BUCKETS 64

static uint64_t hash_bytes(const void *p, size_t n) {
    const unsigned char *s = p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        h ^= s[i];
        h *= 1099511628211ull;
    }
    return h;
}

int ddp_kvmap_init(ddp_kvmap *m) {
    m->count = 0;
    m->buckets = calloc(INITIAL_BUCKETS, sizeof *m->buckets);
    m->nbuckets = m->buckets ? INITIAL_BUCKETS : 0;
    return m->buckets ? 0 : -1;
}

static void free_entry(ddp_kv *e) {
    free(e->key);
    free(e->val);
    free(e);
}

void ddp_kvmap_free(ddp_kvmap *m) {
    for (size_t i = 0; i < m->nbuckets; i++) {
        ddp_kv *e = m->buckets[i];
        while (e != NULL) {
            ddp_kv *next = e->next;
            free_entry(e);
            e = next;
        }
    }
    free(m->buckets);
    m->buckets = NULL;
    m->nbuckets = m->count = 0;
}

/* The link that points at key's entry (or at the NULL ending its chain). */
static ddp_kv **slot(const ddp_kvmap *m, const void *key, size_t klen, uint64_t h) {
    if (m->nbuckets == 0) return NULL;
    ddp_kv **pp = &m->buckets[h & (m->nbuckets - 1)];
    while (*pp != NULL && !((*pp)->hash == h && (*pp)->klen == klen &&
                            (klen == 0 || memcmp((*pp)->key, key, klen) == 0)))
        pp = &(*pp)->next;
    return pp;
}

ddp_kv *ddp_kvmap_find(const ddp_kvmap *m, const void *key, size_t klen) {
    ddp_kv **pp = slot(m, key, klen, hash_bytes(key, klen));
    return pp ? *pp : NULL;
}

/* Double the table (best effort: on failure the map keeps its old size). */
static void grow(ddp_kvmap *m) {
    size_t nb = m->nbuckets ? m->nbuckets * 2 : INITIAL_BUCKETS;
    ddp_kv **b = calloc(nb, sizeof *b);
    if (b == NULL) return;
    for (size_t i = 0; i < m->nbuckets; i++) {
        ddp_kv *e = m->buckets[i];
        while (e != NULL) {
            ddp_kv *next = e->next;
            e->next = b[e->hash & (nb - 1)];
            b[e->hash & (nb - 1)] = e;
            e = next;
        }
    }
    free(m->buckets);
    m->buckets = b;
    m->nbuckets = nb;
}

/* Find key's entry or create it with an empty value. NULL if out of memory. */
static ddp_kv *find_or_add(ddp_kvmap *m, const void *key, size_t klen) {
    uint64_t h = hash_bytes(key, klen);
    if (m->count >= m->nbuckets) grow(m);
    ddp_kv **pp = slot(m, key, klen, h);
    if (pp == NULL) return NULL;
    if (*pp != NULL) return *pp;
    ddp_kv *e = calloc(1, sizeof *e);
    if (e == NULL) return NULL;
    e->key = malloc(klen ? klen : 1);
    if (e->key == NULL) {
        free(e);
        return NULL;
    }
    if (klen) memcpy(e->key, key, klen);
    e->klen = klen;
    e->hash = h;
    *pp = e;
    m->count++;
    return e;
}

/* Undo find_or_add of a fresh entry after a later allocation failed. */
static void drop_if_fresh(ddp_kvmap *m, ddp_kv *e, int existed) {
    if (!existed) ddp_kvmap_delete(m, e->key, e->klen);
}

int ddp_kvmap_set(ddp_kvmap *m, const void *key, size_t klen, const void *val,
                  size_t vlen) {
    int existed = ddp_kvmap_find(m, key, klen) != NULL;
    ddp_kv *e = find_or_add(m, key, klen);
    if (e == NULL) return -1;
    unsigned char *v = malloc(vlen ? vlen : 1);
    if (v == NULL) {
        drop_if_fresh(m, e, existed);
        return -1;
    }
    if (vlen) memcpy(v, val, vlen);
    free(e->val);
    e->val = v;
    e->vlen = vlen;
    return 0;
}

int ddp_kvmap_append(ddp_kvmap *m, const void *key, size_t klen, const void *val,
                     size_t vlen) {
    int existed = ddp_kvmap_find(m, key, klen) != NULL;
    ddp_kv *e = find_or_add(m, key, klen);
    if (e == NULL) return -1;
    unsigned char *v = realloc(e->val, e->vlen + vlen ? e->vlen + vlen : 1);
    if (v == NULL) {
        drop_if_fresh(m, e, existed);
        return -1;
    }
    if (vlen) memcpy(v + e->vlen, val, vlen);
    e->val = v;
    e->vlen += vlen;
    return 0;
}

int ddp_kvmap_delete(ddp_kvmap *m, const void *key, size_t klen) {
    ddp_kv **pp = slot(m, key, klen, hash_bytes(key, klen));
    if (pp == NULL || *pp == NULL) return 0;
    ddp_kv *e = *pp;
    *pp = e->next;
    free_entry(e);
    m->count--;
    return 1;
}
