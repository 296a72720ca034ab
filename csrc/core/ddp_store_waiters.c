/* ddp_store_waiters.c - pending WAITs indexed by key (contract in
 * ddp_store_waiters.h). */
#include "ddp_store_waiters.h"

#include <stdlib.h>
#include <string.h>

static uint64_t hash_of(const void *key, size_t klen) {
    const unsigned char *p = key;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < klen; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

int ddp_waitmap_init(ddp_waitmap *m) {
    m->nbuckets = 64;
    m->count = 0;
    m->buckets = calloc(m->nbuckets, sizeof *m->buckets);
    if (m->buckets == NULL) { m->nbuckets = 0; return -1; }
    return 0;
}

static void wkey_free(ddp_wkey *e) {
    for (ddp_waiter *w = e->head, *nx; w; w = nx) { nx = w->next; free(w); }
    free(e->key);
    free(e);
}

void ddp_waitmap_free(ddp_waitmap *m) {
    for (size_t i = 0; i < m->nbuckets; i++)
        for (ddp_wkey *e = m->buckets[i], *nx; e; e = nx) { nx = e->next; wkey_free(e); }
    free(m->buckets);
    memset(m, 0, sizeof *m);
}

/* Double the table when it is as full as it is wide (best effort). */
static void grow(ddp_waitmap *m) {
    size_t nb = m->nbuckets * 2;
    ddp_wkey **b = calloc(nb, sizeof *b);
    if (b == NULL) return;
    for (size_t i = 0; i < m->nbuckets; i++)
        for (ddp_wkey *e = m->buckets[i], *nx; e; e = nx) {
            nx = e->next;
            e->next = b[e->hash & (nb - 1)];
            b[e->hash & (nb - 1)] = e;
        }
    free(m->buckets);
    m->buckets = b;
    m->nbuckets = nb;
}

/* The entry for key and the link pointing at it (for unlinking), or NULL. */
static ddp_wkey *find(ddp_waitmap *m, const void *key, size_t klen, uint64_t h,
                      ddp_wkey ***link) {
    ddp_wkey **l = &m->buckets[h & (m->nbuckets - 1)];
    for (; *l; l = &(*l)->next)
        if ((*l)->hash == h && (*l)->klen == klen &&
            (klen == 0 || memcmp((*l)->key, key, klen) == 0)) {
            if (link) *link = l;
            return *l;
        }
    return NULL;
}

int ddp_waitmap_add(ddp_waitmap *m, const void *key, size_t klen, void *conn,
                    ddp_waiter **list) {
    if (m->nbuckets == 0) return -1;
    uint64_t h = hash_of(key, klen);
    ddp_wkey *e = find(m, key, klen, h, NULL);
    ddp_waiter *w = calloc(1, sizeof *w);
    if (w == NULL) return -1;
    if (e == NULL) {
        e = calloc(1, sizeof *e);
        unsigned char *k = malloc(klen ? klen : 1);
        if (e == NULL || k == NULL) { free(e); free(k); free(w); return -1; }
        memcpy(k, key, klen);
        e->key = k;
        e->klen = klen;
        e->hash = h;
        if (m->count >= m->nbuckets) grow(m);
        e->next = m->buckets[h & (m->nbuckets - 1)];
        m->buckets[h & (m->nbuckets - 1)] = e;
        m->count++;
    }
    w->wk = e;
    w->conn = conn;
    w->next = e->head;
    if (e->head) e->head->prev = w;
    e->head = w;
    w->cnext = *list;
    if (*list) (*list)->cprev = w;
    *list = w;
    return 0;
}

/* Remove entry e from the table and free it (its node list must be empty). */
static void drop_entry(ddp_waitmap *m, ddp_wkey *e) {
    ddp_wkey **link = NULL;
    if (find(m, e->key, e->klen, e->hash, &link) == e) *link = e->next;
    m->count--;
    free(e->key);
    free(e);
}

void ddp_waitmap_remove_list(ddp_waitmap *m, ddp_waiter **list) {
    for (ddp_waiter *w = *list, *nx; w; w = nx) {
        nx = w->cnext;
        ddp_wkey *e = w->wk;
        if (w->prev) w->prev->next = w->next;
        else e->head = w->next;
        if (w->next) w->next->prev = w->prev;
        free(w);
        if (e->head == NULL) drop_entry(m, e);
    }
    *list = NULL;
}

void ddp_waitmap_fire(ddp_waitmap *m, const void *key, size_t klen,
                      ddp_waiter **(*head_of)(void *conn),
                      void (*fired)(void *conn, void *arg), void *arg) {
    if (m->nbuckets == 0) return;
    ddp_wkey **link = NULL;
    ddp_wkey *e = find(m, key, klen, hash_of(key, klen), &link);
    if (e == NULL) return;
    *link = e->next;   /* detach the entry: callbacks may touch other entries only */
    m->count--;
    ddp_waiter *w = e->head;
    free(e->key);
    free(e);
    while (w) {
        ddp_waiter *nx = w->next;
        ddp_waiter **list = head_of(w->conn);
        if (w->cprev) w->cprev->cnext = w->cnext;
        else *list = w->cnext;
        if (w->cnext) w->cnext->cprev = w->cprev;
        void *conn = w->conn;
        free(w);
        fired(conn, arg);
        w = nx;
    }
}
