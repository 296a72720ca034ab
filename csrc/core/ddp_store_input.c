/* ddp_store_input.c - how much of each connection's input the store server
 * buffers, what that memory is billed to, and whose incomplete request
 * gives way when it runs short (contracts in ddp_store_server_int.h; the
 * policy in docs/security.md, "The store server's limits").
 *
 * A buffer of at most DDP_STORE_ALLOWANCE bytes is billed to the allowance
 * pool, a larger one (grown only for one request larger than the allowance)
 * to PYDDP_STORE_BUFFER_BYTES, in full. Running out of either never turns
 * away a newcomer whose request fits: the pool's or the budget's other
 * holders are evicted instead, the one whose incomplete request has been
 * silent longest first (ties: the one that began first), since a stalled
 * request is what holds memory without using it. A connection whose
 * buffered bytes are complete requests (waiting for it to read its replies)
 * is never evicted.
 */
#include "ddp_store_server_int.h"

#include <stdint.h>
#include <stdio.h>

/* 1 if c's buffer is billed to the budget, 0 if to the allowance pool. */
static int large(size_t cap) { return cap > DDP_STORE_ALLOWANCE; }

/* Move c's billing from a buffer of old_cap bytes to its current one. */
static void rebill(ddp_store_server *srv, ddp_store_conn *c, size_t old_cap) {
    if (large(old_cap)) srv->held -= old_cap;
    else srv->allowed -= old_cap;
    if (large(c->in.cap)) srv->held += c->in.cap;
    else srv->allowed += c->in.cap;
}

/* 1 if the pool (is_large: the budget) would be over its ceiling with
 * `extra` more bytes. */
static int over(const ddp_store_server *srv, int is_large, size_t extra) {
    size_t used = is_large ? srv->held : srv->allowed;
    size_t ceiling = is_large ? srv->budget : DDP_STORE_ALLOWANCE_POOL;
    return used > ceiling || extra > ceiling - used;
}

/* The connection other than keep to evict for room in the pool (is_large:
 * the budget): one whose buffer is billed there and holds the start of a
 * request still arriving, silent longest (ties: whose request began
 * first). NULL if there is none. */
static ddp_store_conn *victim(ddp_store_server *srv, const ddp_store_conn *keep,
                              int is_large) {
    ddp_store_conn *best = NULL;
    for (size_t i = 0; i < srv->nconns; i++) {
        ddp_store_conn *v = srv->conns[i];
        size_t have = ddp_wbuf_size(&v->in);
        if (v == keep || v->dead || !v->authed || v->in.cap == 0 ||
            large(v->in.cap) != is_large || have == 0 || have >= v->scan.need)
            continue;
        if (best == NULL || v->heard_ms < best->heard_ms ||
            (v->heard_ms == best->heard_ms && v->partial_ms < best->partial_ms))
            best = v;
    }
    return best;
}

/* Evict connections (logged, marked dead, their input freed) until the
 * pool (is_large: the budget) has room for `extra` more bytes. 0, or -1 if
 * no one is left to evict (those evicted stay evicted). */
static int make_room(ddp_store_server *srv, const ddp_store_conn *keep, int is_large,
                     size_t extra) {
    while (over(srv, is_large, extra)) {
        ddp_store_conn *v = victim(srv, keep, is_large);
        if (v == NULL) return -1;
        char why[240];
        snprintf(why, sizeof why, "evicted with %zu bytes of an incomplete request, silent "
                 "for %.1f s (the longest), when %s was used up", ddp_wbuf_size(&v->in),
                 (double)(ddp_now_ms() - v->heard_ms) / 1000.0, is_large ?
                 "the store's budget for incomplete requests (PYDDP_STORE_BUFFER_BYTES)" :
                 "the store's pool of per-connection allowances");
        ddp_auth_log_reject("a store request", v->addr, why);
        ddp_store_input_release(srv, v);
        v->dead = 1;
    }
    return 0;
}

/* The most bytes c's buffer should hold before its next read (0: read
 * nothing), and in *most the capacity a growth may stop at. -1: the request
 * is over DDP_STORE_MAX_BUFFERED. */
static int64_t read_limit(const ddp_store_conn *c, size_t *most) {
    size_t have = ddp_wbuf_size(&c->in), need = c->scan.need, limit;
    *most = SIZE_MAX;
    if (!c->authed) {   /* the handshake's next step, not a byte more */
        limit = c->auth_stage == 0 ? DDP_STORE_AUTH_HELLO : DDP_AUTH_MAC;
        *most = limit;
        return have < limit ? (int64_t)limit : 0;
    }
    if (have < DDP_STORE_ALLOWANCE) {
        /* The allowance, or all of a request that is larger and whose
         * length is known. */
        limit = need > DDP_STORE_ALLOWANCE ? need : DDP_STORE_ALLOWANCE;
        *most = limit;
    } else if (have < need) {
        /* Beyond the allowance only for the request at the front: as far as
         * its fields go, or, for one of many small fields (MULTI_SET, a
         * WAIT on many keys), a chunk at a time in a buffer that doubles. */
        limit = need;
        *most = limit;
        if (c->scan.in_group && limit < have + DDP_STORE_READ_CHUNK) {
            limit = have + DDP_STORE_READ_CHUNK;
            *most = SIZE_MAX;
        }
        if (limit > DDP_STORE_MAX_BUFFERED) limit = DDP_STORE_MAX_BUFFERED;
        if (have >= limit) return -1;
    } else {
        return 0;   /* complete requests wait their turn (the replies back up) */
    }
    return (int64_t)limit;
}

int ddp_store_input_fits(ddp_store_server *srv, ddp_store_conn *c) {
    size_t need = c->authed ? c->scan.need : 0;
    if (need > DDP_STORE_MAX_BUFFERED) return -1;
    if (large(need) && need > srv->budget) {
        ddp_auth_log_reject("a store request", c->addr, "it alone is larger than the store's "
                            "budget for incomplete requests (PYDDP_STORE_BUFFER_BYTES)");
        return -1;
    }
    return 0;
}

int ddp_store_input_room(ddp_store_server *srv, ddp_store_conn *c, size_t *room) {
    size_t most, have = ddp_wbuf_size(&c->in);
    *room = 0;
    if (ddp_store_input_fits(srv, c) < 0) return -1;
    int64_t limit = read_limit(c, &most);
    if (limit <= 0) return (int)limit;
    size_t n = (size_t)limit - have;
    if (n > DDP_STORE_READ_CHUNK) n = DDP_STORE_READ_CHUNK;
    size_t old_cap = c->in.cap;
    if (!large(most) && old_cap - have < n &&
        make_room(srv, c, 0, most > old_cap ? most - old_cap : 0) < 0) {
        c->starved = 1;   /* the pool is full of complete requests: try next round */
        return 0;
    }
    /* A buffer growing past the allowance is billed to the budget: room is
     * made there before it grows, so the budget holds at every moment. */
    size_t new_cap = ddp_wbuf_cap_for(&c->in, n, most);
    if (large(new_cap) && new_cap > old_cap) {
        size_t extra = new_cap - (large(old_cap) ? old_cap : 0);
        if (new_cap > srv->budget || make_room(srv, c, 1, extra) < 0) {
            ddp_auth_log_reject("a store request", c->addr, "the store's budget for "
                                "incomplete requests (PYDDP_STORE_BUFFER_BYTES) is used up");
            return -1;
        }
    }
    int r = ddp_wbuf_reserve_upto(&c->in, n, most);
    rebill(srv, c, old_cap);
    if (r < 0) return -1;
    /* Whatever of the request fits in the buffer as it is: one recv may
     * fill a large buffer, but only bytes that arrived make it grow. */
    *room = c->in.cap - c->in.len;
    if (*room > (size_t)limit - have) *room = (size_t)limit - have;
    return 0;
}

void ddp_store_input_trim(ddp_store_server *srv, ddp_store_conn *c) {
    size_t have = ddp_wbuf_size(&c->in), old_cap = c->in.cap;
    if (have == 0) {
        ddp_store_input_release(srv, c);
        return;
    }
    /* (A large buffer whose request still needs it stays.) */
    int mostly_empty = large(old_cap)
        ? have <= DDP_STORE_ALLOWANCE && c->scan.need <= DDP_STORE_ALLOWANCE
        : old_cap > 4096 && old_cap / 4 >= have;
    if (!mostly_empty) return;
    ddp_wbuf_compact(&c->in);
    rebill(srv, c, old_cap);
}

void ddp_store_input_release(ddp_store_server *srv, ddp_store_conn *c) {
    size_t old_cap = c->in.cap;
    ddp_wbuf_free(&c->in);
    rebill(srv, c, old_cap);
}
