/* ddp_store_waiters.h - the store server's index of pending WAITs by key, so
 * that a SET wakes exactly the connections waiting for that key (cost:
 * the waiters of that key) instead of scanning every connection's keys.
 *
 * Each waiting connection owns a list of nodes, one per key it still
 * misses; each key with waiters has an entry listing its nodes. Both lists
 * are doubly linked, so cancelling a WAIT or closing a connection costs the
 * number of its own keys. Single-threaded (the server thread).
 */
#ifndef DDP_STORE_WAITERS_H
#define DDP_STORE_WAITERS_H

#include <stddef.h>
#include <stdint.h>

typedef struct ddp_wkey ddp_wkey;

typedef struct ddp_waiter {
    ddp_wkey *wk;                      /* the key's entry */
    struct ddp_waiter *prev, *next;    /* in the key's list */
    struct ddp_waiter *cprev, *cnext;  /* in the connection's list */
    void *conn;
} ddp_waiter;

struct ddp_wkey {
    struct ddp_wkey *next;             /* hash chain */
    uint64_t hash;
    unsigned char *key;
    size_t klen;
    ddp_waiter *head;
};

typedef struct ddp_waitmap {
    ddp_wkey **buckets;
    size_t nbuckets;                   /* a power of two */
    size_t count;                      /* keys with waiters */
} ddp_waitmap;

/* 0, or -1 if out of memory. */
int ddp_waitmap_init(ddp_waitmap *m);
/* Free every entry and node (the connections' lists become dangling:
 * call at server shutdown only, after the connections are gone). */
void ddp_waitmap_free(ddp_waitmap *m);
/* Register conn as waiting for key; the node goes on *list. 0, or -1 if out
 * of memory (nothing added). */
int ddp_waitmap_add(ddp_waitmap *m, const void *key, size_t klen, void *conn,
                    ddp_waiter **list);
/* Remove and free every node on *list (a WAIT cancelled, a connection gone). */
void ddp_waitmap_remove_list(ddp_waitmap *m, ddp_waiter **list);
/* key was written: remove its entry and, for each of its nodes, unlink the
 * node from its connection's list (whose head is *head_of(conn)), free it
 * and call fired(conn, arg). */
void ddp_waitmap_fire(ddp_waitmap *m, const void *key, size_t klen,
                      ddp_waiter **(*head_of)(void *conn),
                      void (*fired)(void *conn, void *arg), void *arg);

#endif
