/* ddp_store_ops.c - the store server's request handlers: recognise one
 * complete request in a connection's input, run it against the key map and
 * queue its reply, waking WAITs that the change satisfied.
 *
 * Semantics follow torch's TCPStore (docs/design.md, "The store protocol"): ADD keeps
 * ASCII decimal text, COMPARE_SET's three cases, WAIT answered at once or
 * when every key exists, CANCEL_WAIT always answered with WAIT_CANCELED. A
 * request is first "measured" without side effects, so a half-arrived
 * request is never half-applied.
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

/* Walk the request body of query q without acting. 1 if complete, 0 if
 * more bytes are needed, -1 if it can never be valid. */
static int measure(ddp_rcur *r, uint8_t q) {
    bytes s;
    size_t l;
    uint32_t u32;
    uint64_t u64, n;
    switch (q) {
    case DDP_Q_VALIDATE: case DDP_Q_PING:
        ddp_rcur_u32(r, &u32);
        break;
    case DDP_Q_SET: case DDP_Q_APPEND:
        read_key(r, &s, &l);
        read_val(r, &s, &l);
        break;
    case DDP_Q_COMPARE_SET:
        read_key(r, &s, &l);
        read_val(r, &s, &l);
        read_val(r, &s, &l);
        break;
    case DDP_Q_GET: case DDP_Q_DELETE_KEY:
        read_key(r, &s, &l);
        break;
    case DDP_Q_ADD:
        read_key(r, &s, &l);
        ddp_rcur_u64(r, &u64);
        break;
    case DDP_Q_CHECK: case DDP_Q_WAIT: case DDP_Q_MULTI_GET:
        n = read_count(r);
        for (uint64_t i = 0; i < n && !r->more && !r->bad; i++) read_key(r, &s, &l);
        break;
    case DDP_Q_MULTI_SET:
        n = read_count(r);
        for (uint64_t i = 0; i < n && !r->more && !r->bad; i++) {
            read_key(r, &s, &l);
            read_val(r, &s, &l);
        }
        break;
    case DDP_Q_GETNUMKEYS: case DDP_Q_CANCEL_WAIT:
        break;
    default:
        return -1;   /* unknown query: nothing after it can be framed */
    }
    return r->bad ? -1 : r->more ? 0 : 1;
}

void ddp_store_conn_clear_wait(ddp_store_conn *c) {
    for (size_t i = 0; i < c->nwait; i++) free(c->wkeys[i]);
    free(c->wkeys);
    free(c->wklens);
    c->wkeys = NULL;
    c->wklens = NULL;
    c->nwait = 0;
}

static int has_all(const ddp_store_server *srv, const ddp_store_conn *c) {
    for (size_t i = 0; i < c->nwait; i++)
        if (ddp_kvmap_find(&srv->map, c->wkeys[i], c->wklens[i]) == NULL) return 0;
    return 1;
}

/* Key k was written: answer every WAIT that names it and is now complete. */
static void wake(ddp_store_server *srv, bytes k, size_t kl) {
    for (size_t i = 0; i < srv->nconns; i++) {
        ddp_store_conn *c = srv->conns[i];
        int names_k = 0;
        for (size_t j = 0; j < c->nwait && !names_k; j++)
            names_k = c->wklens[j] == kl && (kl == 0 || memcmp(c->wkeys[j], k, kl) == 0);
        if (names_k && has_all(srv, c)) {
            ddp_wbuf_u8(&c->out, DDP_WAIT_STOP_WAITING);
            ddp_store_conn_clear_wait(c);
        }
    }
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
    if (c->nwait != 0) return -1;   /* a second outstanding WAIT: protocol misuse */
    c->wkeys = calloc(n, sizeof *c->wkeys);
    c->wklens = calloc(n, sizeof *c->wklens);
    if (c->wkeys == NULL || c->wklens == NULL) return -1;
    r->off = body;
    for (uint64_t i = 0; i < n; i++, c->nwait++) {
        bytes k;
        read_key(r, &k, &c->wklens[i]);
        c->wkeys[i] = malloc(c->wklens[i] ? c->wklens[i] : 1);
        if (c->wkeys[i] == NULL) return -1;
        memcpy(c->wkeys[i], k, c->wklens[i]);
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
        ddp_store_conn_clear_wait(c);
        ddp_wbuf_u8(&c->out, DDP_WAIT_CANCELED);
        return 0;
    }
    return -1;
}

int ddp_store_handle(ddp_store_server *srv, ddp_store_conn *c, const unsigned char *p,
                     size_t n, size_t *used) {
    ddp_rcur r;
    uint8_t q;
    ddp_rcur_init(&r, p, n);
    if (ddp_rcur_u8(&r, &q) < 0) return 0;
    if (!c->validated && q != DDP_Q_VALIDATE) return -1;
    int m = measure(&r, q);
    if (m <= 0) return m;
    *used = r.off;
    ddp_rcur_init(&r, p + 1, *used - 1);
    return run(srv, c, &r, q) < 0 ? -1 : 1;
}
