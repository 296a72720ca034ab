/* ddp_store_map.h - the store server's key-value table: a chained hash map
 * from byte-string keys to byte-string values. Single-threaded (only the
 * server thread touches it). The map owns copies of every key and value.
 */
#ifndef DDP_STORE_MAP_H
#define DDP_STORE_MAP_H

#include <stddef.h>
#include <stdint.h>

typedef struct ddp_kv {
    struct ddp_kv *next;
    uint64_t hash;
    unsigned char *key, *val;
    size_t klen, vlen;
} ddp_kv;

typedef struct ddp_kvmap {
    ddp_kv **buckets;
    size_t nbuckets;   /* a power of two */
    size_t count;
} ddp_kvmap;

/* 0 on success, -1 if out of memory (the map is then empty but valid). */
int ddp_kvmap_init(ddp_kvmap *m);
/* Free every entry and the table. */
void ddp_kvmap_free(ddp_kvmap *m);
/* The entry for key, or NULL. */
ddp_kv *ddp_kvmap_find(const ddp_kvmap *m, const void *key, size_t klen);
/* Replace (or create) key's value with a copy of val. 0, or -1 if out of
 * memory, in which case the map is unchanged. */
int ddp_kvmap_set(ddp_kvmap *m, const void *key, size_t klen, const void *val,
                  size_t vlen);
/* Append a copy of val to key's value, creating it if absent. 0 or -1 (out
 * of memory; map unchanged). */
int ddp_kvmap_append(ddp_kvmap *m, const void *key, size_t klen, const void *val,
                     size_t vlen);
/* Remove key; returns 1 if it existed, 0 otherwise. */
int ddp_kvmap_delete(ddp_kvmap *m, const void *key, size_t klen);

#endif
