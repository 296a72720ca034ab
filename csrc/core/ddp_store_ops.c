/* ddp_store_ops.c - the store server's request handlers: recognise one
 * complete request in a connection's input, run it against the key map and
 * queue its reply, waking WAITs that the change satisfied.
 *
 * Semantics follow torch's TCPStore (docs/design.md, "The store protocol"): ADD keeps
 * ASCII decimal text, COMPARE_SET's three cases, WAIT answered at once or
 * when every key exists, CANCEL_WAIT always answered with WAIT_CANCELED. A
 * request is first framed without side effects (ddp_store_scan.h), so a
 * half-arrived request is never half-applied; WAITs are woken through the
 * waiter index (ddp_store_waiters.h).
 */
#include "ddp_store_server_int.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef const unsigned char *bytes;

static int read_key(ddp_rcur *r, bytes *k, size_t *kl) {
    return ddp_rcur_str(r, k, kl, DDP_STORE_MAX_KEY);
}

static int read_val(ddp_rcur *r, bytes *v, size_t *vl) {
    return ddp_rcur_str(r, v, vl, DDP_STORE_MAX_VALUE);
}

/* Read a count field; marks the cursor bad if above the per-request cap. */
static uint64_t read_count(ddp_rcur *r) {
    uint64_t n = 0;
    if (ddp_rcur_u64(r, &n) == 0 && n > DDP_STORE_MAX_COUNT) r->bad = 1;
    return n;
}

void ddp_store_conn_clear_wait(ddp_store_server *srv, ddp_store_conn *c) {
    ddp_waitmap_remove_list(&srv->waiters, &c->waits);
    c->waiting = 0;
    c->missing = 0;
}

static ddp_waiter **waits_of(void *conn) { return &((ddp_store_conn *)conn)->waits; }

/* A key conn waited for was written: answer once the last one has been. */
static void key_arrived(void *conn, void *arg) {
    (void)arg;
    ddp_store_conn *c = conn;
    if (c->missing > 0 && --c->missing == 0) {
        ddp_wbuf_u8(&c->out, DDP_WAIT_STOP_WAITING);
        c->waiting = 0;
    }
}

/* Key k was written: wake the WAITs that named it (only those: the index
 * is by key). */
static void wake(ddp_store_server *srv, bytes k, size_t kl) {
    ddp_waitmap_fire(&srv->waiters, k, kl, waits_of, key_arrived, NULL);
}

/* Set k to v and wake its waiters. -1 if out of memory. */
static int set_and_wake(ddp_store_server *srv, bytes k, size_t kl, bytes v, size_t vl) {
    if (ddp_kvmap_set(&srv->map, k, kl, v, vl) < 0) return -1;
    wake(srv, k, kl);
    return 0;
}

/* Parse ASCII decimal (torch's ADD format). -1 if v is not such a number. */
static int parse_i64(bytes v, size_t vl, int64_t *out) {
    char buf[32];
    if (vl == 0 || vl >= sizeof buf) return -1;
    memcpy(buf, v, vl);
    buf[vl] = '\0';
    char *end;
    errno = 0;
    long long x = strtoll(buf, &end, 10);
    if (errno != 0 || end != buf + vl) return -1;
    *out = x;
    return 0;
}

static int op_add(ddp_store_server *srv, ddp_store_conn *c, ddp_rcur *r) {
    bytes k;
    size_t kl;
    uint64_t delta;
    read_key(r, &k, &kl);
    ddp_rcur_u64(r, &delta);
    int64_t cur = 0;
    ddp_kv *e = ddp_kvmap_find(&srv->map, k, kl);
    if (e != NULL && parse_i64(e->val, e->vlen, &cur) < 0)
        return -1;   /* not a counter: torch's server drops the client too */
    /* Wrap on overflow (unsigned arithmetic) instead of undefined behaviour. */
    int64_t next = (int64_t)((uint64_t)cur + delta);
    char text[32];
    int tl = snprintf(text, sizeof text, "%lld", (long long)next);
    if (set_and_wake(srv, k, kl, (bytes)text, (size_t)tl) < 0) return -1;
    ddp_wbuf_u64(&c->out, (uint64_t)next);
    return 0;
}

static int op_compare_set(ddp_store_server *srv, ddp_store_conn *c, ddp_rcur *r) {
    bytes k, exp, want;
    size_t kl, el, wl;
    read_key(r, &k, &kl);
    read_val(r, &exp, &el);
    read_val(r, &want, &wl);
    ddp_kv *e = ddp_kvmap_find(&srv->map, k, kl);
    if (e == NULL) {
        if (el != 0) {   /* absent and something else expected: no change */
            ddp_wbuf_str(&c->out, exp, el);
            return 0;
        }
    } else if (e->vlen != el || (el != 0 && memcmp(e->val, exp, el) != 0)) {
        ddp_wbuf_str(&c->out, e->val, e->vlen);
        return 0;
    }
    if (set_and_wake(srv, k, kl, want, wl) < 0) return -1;
    ddp_wbuf_str(&c->out, want, wl);
    return 0;
}

/* CHECK, WAIT and MULTI_GET share the "count, then keys" body. */
static int op_keys(ddp_store_server *srv, ddp_store_conn *c, ddp_rcur *r, uint8_t q) {
    uint64_t n = read_count(r);
    size_t body = r->off;
    int all = 1;
    for (uint64_t i = 0; i < n; i++) {
        bytes k;
        size_t kl;
        read_key(r, &k, &kl);
        ddp_kv *e = ddp_kvmap_find(&srv->map, k, kl);
        if (e == NULL) all = 0;
        if (q == DDP_Q_MULTI_GET) {
            if (e != NULL) ddp_wbuf_str(&c->out, e->val, e->vlen);
            else ddp_wbuf_str(&c->out, "", 0);
        }
    }
    if (q == DDP_Q_CHECK) ddp_wbuf_u8(&c->out, all ? DDP_CHECK_READY : DDP_CHECK_NOT_READY);
    if (q != DDP_Q_WAIT) return 0;
    if (all) {
        ddp_wbuf_u8(&c->out, DDP_WAIT_STOP_WAITING);
        return 0;
    }
    if (c->waiting) return -1;   /* a second outstanding WAIT: protocol misuse */
    c->waiting = 1;
    r->off = body;
    for (uint64_t i = 0; i < n; i++) {
        bytes k;
        size_t kl;
        read_key(r, &k, &kl);
        if (ddp_kvmap_find(&srv->map, k, kl) != NULL) continue;
        if (ddp_waitmap_add(&srv->waiters, k, kl, c, &c->waits) < 0) return -1;
        c->missing++;
    }
    return 0;
}

/* Run one complete request (cursor after the query byte). -1: drop. */
static int run(ddp_store_server *srv, ddp_store_conn *c, ddp_rcur *r, uint8_t q) {
    bytes k, v;
    size_t kl, vl;
    uint32_t u32;
    switch (q) {
    case DDP_Q_VALIDATE:
        ddp_rcur_u32(r, &u32);
        if (u32 != DDP_STORE_MAGIC) return -1;
        c->validated = 1;
        return 0;
    case DDP_Q_PING:
        ddp_rcur_u32(r, &u32);
        ddp_wbuf_u32(&c->out, u32);
        return 0;
    case DDP_Q_SET:
        read_key(r, &k, &kl);
        read_val(r, &v, &vl);
        return set_and_wake(srv, k, kl, v, vl);
    case DDP_Q_APPEND:
        read_key(r, &k, &kl);
        read_val(r, &v, &vl);
        if (ddp_kvmap_append(&srv->map, k, kl, v, vl) < 0) return -1;
        wake(srv, k, kl);
        return 0;
    case DDP_Q_MULTI_SET: {
        uint64_t n = read_count(r);
        for (uint64_t i = 0; i < n; i++) {
            read_key(r, &k, &kl);
            read_val(r, &v, &vl);
            if (set_and_wake(srv, k, kl, v, vl) < 0) return -1;
        }
        return 0;
    }
    case DDP_Q_COMPARE_SET:
        return op_compare_set(srv, c, r);
    case DDP_Q_GET: {
        read_key(r, &k, &kl);
        ddp_kv *e = ddp_kvmap_find(&srv->map, k, kl);
        /* Clients WAIT before GET; a missing key reads as empty. */
        ddp_wbuf_str(&c->out, e ? e->val : (bytes) "", e ? e->vlen : 0);
        return 0;
    }
    case DDP_Q_ADD:
        return op_add(srv, c, r);
    case DDP_Q_CHECK: case DDP_Q_WAIT: case DDP_Q_MULTI_GET:
        return op_keys(srv, c, r, q);
    case DDP_Q_GETNUMKEYS:
        ddp_wbuf_u64(&c->out, (uint64_t)srv->map.count);
        return 0;
    case DDP_Q_DELETE_KEY:
        read_key(r, &k, &kl);
        ddp_wbuf_u64(&c->out, (uint64_t)ddp_kvmap_delete(&srv->map, k, kl));
        return 0;
    case DDP_Q_CANCEL_WAIT:
        /* Answer even if the WAIT already completed: the client then reads
         * STOP_WAITING followed by WAIT_CANCELED. */
        ddp_store_conn_clear_wait(srv, c);
        ddp_wbuf_u8(&c->out, DDP_WAIT_CANCELED);
        return 0;
    }
    return -1;
}

int ddp_store_handle(ddp_store_server *srv, ddp_store_conn *c, const unsigned char *p,
                     size_t n, size_t *used) {
    ddp_rcur r;
    if (n > 0 && !c->validated && p[0] != DDP_Q_VALIDATE) return -1;
    int m = ddp_store_scan_step(&c->scan, p, n);
    if (m <= 0) return m;
    uint8_t q = c->scan.q;
    *used = c->scan.off;
    ddp_store_scan_reset(&c->scan);
    ddp_rcur_init(&r, p + 1, *used - 1);
    atomic_fetch_add_explicit(&srv->requests, 1, memory_order_relaxed);
    return run(srv, c, &r, q) < 0 ? -1 : 1;
}
