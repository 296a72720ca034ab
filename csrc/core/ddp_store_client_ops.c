/* ddp_store_client_ops.c - the TCPStore client's requests (SET, APPEND,
 * MULTI_SET, GET, MULTI_GET, WAIT with its cancel and the probe that names
 * the missing key, CHECK, ADD, COMPARE_SET, DELETE_KEY, GETNUMKEYS), its
 * close and free, and its implementation table; each request runs on the
 * plumbing of ddp_store_client.c (begin, send, receive, done).
 */
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ddp_store_client_int.h"

/* The last reference went (ddp_store_release): free the client. */
static void tcp_destroy(void *ctx) {
    tcp *s = ctx;
    close(s->fd);
    pthread_mutex_destroy(&s->mu);
    ddp_wbuf_free(&s->req);
    free(s);
}

/* ddp_store_close: only the first close shuts down; SHUT_RDWR wakes a poll()
 * on fd in any thread with POLLHUP, so a blocked recv/send returns within its
 * slice. */
static void tcp_shutdown(void *ctx) {
    tcp *s = ctx;
    if (atomic_exchange(&s->closed, 1) == 0) shutdown(s->fd, SHUT_RDWR);
}

/* SET and APPEND: key, value, no reply. */
static ddp_status put(tcp *s, uint8_t q, const char *key, size_t klen,
                      const void *val, size_t vlen, ddp_wait w) {
    const char *op = q == DDP_Q_SET ? "set" : "append";
    ddp_status st = ddp_store_check_sizes(klen, vlen);
    if (st != DDP_OK) return ddp_error_prefix(st, "store %s: ", op);
    if ((st = ddp_store_begin(s, w, q)) != DDP_OK) return st;
    ddp_wbuf_str(&s->req, key, klen);
    ddp_wbuf_str(&s->req, val, vlen);
    return ddp_store_done(s, ddp_store_send_req(s, w), op);
}

static ddp_status tcp_set(void *ctx, const char *key, size_t klen, const void *val,
                         size_t vlen, ddp_wait w) {
    tcp *s = ctx;
    return put(s, DDP_Q_SET, key, klen, val, vlen, w);
}

static ddp_status tcp_append(void *ctx, const char *key, size_t klen,
                            const void *val, size_t vlen, ddp_wait w) {
    tcp *s = ctx;
    return put(s, DDP_Q_APPEND, key, klen, val, vlen, w);
}

static ddp_status tcp_multi_set(void *ctx, const char *const *keys, const size_t *klens,
                               const void *const *vals, const size_t *vlens, size_t n,
                               ddp_wait w) {
    tcp *s = ctx;
    size_t total = 9;   /* the request: query, count, each key and value with its length */
    for (size_t i = 0; i < n; i++) {
        ddp_status st = ddp_store_check_sizes(klens[i], vlens[i]);
        if (st != DDP_OK) return ddp_error_prefix(st, "store multi_set: ");
        total += 16 + klens[i] + vlens[i];
    }
    if (n > DDP_STORE_MAX_COUNT || total > DDP_STORE_MAX_BUFFERED)   /* the server's limits */
        return ddp_error(DDP_ERR_INVALID, "store multi_set: %zu keys in %zu bytes are more "
                         "than one request may carry: set them in parts", n, total);
    ddp_status st = ddp_store_begin(s, w, DDP_Q_MULTI_SET);
    if (st != DDP_OK) return st;
    ddp_wbuf_u64(&s->req, (uint64_t)n);
    for (size_t i = 0; i < n; i++) {
        ddp_wbuf_str(&s->req, keys[i], klens[i]);
        ddp_wbuf_str(&s->req, vals[i], vlens[i]);
    }
    return ddp_store_done(s, ddp_store_send_req(s, w), "multi_set");
}

/* Append "u64 n, n keys" to the request being built. */
static void put_keys(tcp *s, const char *const *keys, const size_t *klens,
                     size_t n) {
    ddp_wbuf_u64(&s->req, (uint64_t)n);
    for (size_t i = 0; i < n; i++) ddp_wbuf_str(&s->req, keys[i], klens[i]);
}

/* CHECK with the mutex held. */
static ddp_status check_locked(tcp *s, const char *const *keys,
                               const size_t *klens, size_t n, int *ready, ddp_wait w) {
    s->req.start = s->req.len = 0;
    ddp_wbuf_u8(&s->req, DDP_Q_CHECK);
    put_keys(s, keys, klens, n);
    uint8_t r;
    ddp_status st = ddp_store_send_req(s, w);
    if (st == DDP_OK) st = ddp_store_recv_exact(s, &r, 1, w);
    if (st == DDP_OK) *ready = r == DDP_CHECK_READY;
    return st;
}

/* After a WAIT expired: send CANCEL_WAIT and drain. *raced = 1 if the
 * server had already answered STOP_WAITING (all keys exist). */
static ddp_status cancel_wait(tcp *s, const atomic_int *abort, int *raced) {
    ddp_wait g = ddp_wait_for(DDP_STORE_GRACE_MS, abort);
    uint8_t r;
    s->req.start = s->req.len = 0;
    ddp_wbuf_u8(&s->req, DDP_Q_CANCEL_WAIT);
    ddp_status st = ddp_store_send_req(s, g);
    if (st == DDP_OK) st = ddp_store_recv_exact(s, &r, 1, g);
    *raced = st == DDP_OK && r == DDP_WAIT_STOP_WAITING;
    if (*raced) st = ddp_store_recv_exact(s, &r, 1, g);
    if (st == DDP_OK && r != DDP_WAIT_CANCELED)
        st = ddp_store_io_fail(s, ddp_error(DDP_ERR_PROTOCOL, "unexpected reply %u to "
                                            "CANCEL_WAIT", r));
    return st;
}

/* Timeout message naming the first key that is still missing. Returns
 * DDP_OK if every key turned out to exist after all. */
static ddp_status wait_timeout(tcp *s, const char *const *keys,
                               const size_t *klens, size_t n, double secs,
                               const atomic_int *abort) {
    ddp_wait g = ddp_wait_for(DDP_STORE_GRACE_MS, abort);
    size_t missing = n;
    for (size_t i = 0; i < n && i < DDP_STORE_PROBE_KEYS && missing == n; i++) {
        int ready = 0;
        ddp_status st = check_locked(s, &keys[i], &klens[i], 1, &ready, g);
        if (st != DDP_OK) return st;
        if (!ready) missing = i;
    }
    if (missing == n && n <= DDP_STORE_PROBE_KEYS) return DDP_OK;
    char repr[256] = "(one of them)";
    if (missing < n) ddp_store_key_repr(keys[missing], klens[missing], repr, sizeof repr);
    return ddp_error(DDP_ERR_TIMEOUT, "timed out after %.1f s waiting for key '%s' "
                     "(%zu key(s) requested). Another rank may have failed or not "
                     "reached this point: check the other ranks' logs, or raise the "
                     "timeout", secs, repr, n);
}

/* WAIT with the mutex held. */
static ddp_status wait_locked(tcp *s, const char *const *keys,
                              const size_t *klens, size_t n, ddp_wait w) {
    int64_t t0 = ddp_now_ms();
    for (size_t i = 0; i < n; i++)
        if (klens[i] > DDP_STORE_MAX_KEY) return ddp_store_check_sizes(klens[i], 0);
    s->req.start = s->req.len = 0;
    ddp_wbuf_u8(&s->req, DDP_Q_WAIT);
    put_keys(s, keys, klens, n);
    uint8_t r;
    ddp_status st = ddp_store_send_req(s, w);
    if (st != DDP_OK) return st;
    st = ddp_store_recv_buffered(s, &r, 1, w);
    if (st == DDP_OK)
        return r == DDP_WAIT_STOP_WAITING ? DDP_OK
               : ddp_store_io_fail(s, ddp_error(DDP_ERR_PROTOCOL, "unexpected reply %u to WAIT",
                                                r));
    if (st != DDP_ERR_TIMEOUT && st != DDP_ERR_ABORTED) return ddp_store_io_fail(s, st);
    ddp_status why = st;
    int raced = 0;
    if ((st = cancel_wait(s, w.abort, &raced)) != DDP_OK) return st;
    if (why == DDP_ERR_ABORTED)
        return ddp_error(DDP_ERR_ABORTED, "wait aborted");
    if (raced) return DDP_OK;   /* the keys arrived just as we gave up */
    return wait_timeout(s, keys, klens, n, (double)(ddp_now_ms() - t0) / 1000.0, w.abort);
}

static ddp_status tcp_wait(void *ctx, const char *const *keys, const size_t *klens,
                          size_t n, ddp_wait w) {
    tcp *s = ctx;
    ddp_status st = ddp_store_begin(s, w, DDP_Q_WAIT);
    if (st != DDP_OK) return st;
    return ddp_store_done(s, wait_locked(s, keys, klens, n, w), "wait");
}

static ddp_status tcp_get(void *ctx, const char *key, size_t klen, void **val,
                         size_t *vlen, ddp_wait w) {
    tcp *s = ctx;
    ddp_status st = ddp_store_begin(s, w, DDP_Q_WAIT);
    if (st != DDP_OK) return st;
    st = wait_locked(s, &key, &klen, 1, w);
    /* The key exists now; its value is owed even if w ran out meanwhile (a WAIT
     * that raced its own cancel, a late answer). */
    int64_t floor = ddp_now_ms() + DDP_STORE_GRACE_MS;
    if (w.deadline_ms < floor) w.deadline_ms = floor;
    if (st == DDP_OK) {
        s->req.start = s->req.len = 0;
        ddp_wbuf_u8(&s->req, DDP_Q_GET);
        ddp_wbuf_str(&s->req, key, klen);
        st = ddp_store_send_req(s, w);
    }
    if (st == DDP_OK) st = ddp_store_recv_value(s, val, vlen, w);
    return ddp_store_done(s, st, "get");
}

static ddp_status tcp_multi_get(void *ctx, const char *const *keys, const size_t *klens,
                               size_t n, void **vals, size_t *vlens, ddp_wait w) {
    tcp *s = ctx;
    for (size_t i = 0; i < n; i++) vals[i] = NULL;
    ddp_status st = ddp_store_begin(s, w, DDP_Q_WAIT);
    if (st != DDP_OK) return st;
    st = wait_locked(s, keys, klens, n, w);
    int64_t floor = ddp_now_ms() + DDP_STORE_GRACE_MS;   /* the values are owed now */
    if (w.deadline_ms < floor) w.deadline_ms = floor;
    if (st == DDP_OK) {
        s->req.start = s->req.len = 0;
        ddp_wbuf_u8(&s->req, DDP_Q_MULTI_GET);
        put_keys(s, keys, klens, n);
        st = ddp_store_send_req(s, w);
    }
    for (size_t i = 0; st == DDP_OK && i < n; i++)
        st = ddp_store_recv_value(s, &vals[i], &vlens[i], w);
    if (st != DDP_OK)
        for (size_t i = 0; i < n; i++) {
            free(vals[i]);
            vals[i] = NULL;
        }
    return ddp_store_done(s, st, "multi_get");
}

static ddp_status tcp_check(void *ctx, const char *const *keys, const size_t *klens,
                           size_t n, int *ready, ddp_wait w) {
    tcp *s = ctx;
    for (size_t i = 0; i < n; i++)
        if (klens[i] > DDP_STORE_MAX_KEY)
            return ddp_error_prefix(ddp_store_check_sizes(klens[i], 0), "store check: ");
    ddp_status st = ddp_store_begin(s, w, DDP_Q_CHECK);
    if (st != DDP_OK) return st;
    return ddp_store_done(s, check_locked(s, keys, klens, n, ready, w), "check");
}

static ddp_status tcp_add(void *ctx, const char *key, size_t klen, int64_t delta,
                         int64_t *result, ddp_wait w) {
    tcp *s = ctx;
    ddp_status st = ddp_store_check_sizes(klen, 0);
    if (st != DDP_OK) return ddp_error_prefix(st, "store add: ");
    if ((st = ddp_store_begin(s, w, DDP_Q_ADD)) != DDP_OK) return st;
    ddp_wbuf_str(&s->req, key, klen);
    ddp_wbuf_u64(&s->req, (uint64_t)delta);
    st = ddp_store_send_req(s, w);
    if (st == DDP_OK) st = ddp_store_recv_exact(s, result, sizeof *result, w);
    return ddp_store_done(s, st, "add");
}

static ddp_status tcp_compare_set(void *ctx, const char *key, size_t klen,
                                 const void *expected, size_t elen, const void *desired,
                                 size_t dlen, void **out, size_t *outlen, ddp_wait w) {
    tcp *s = ctx;
    ddp_status st = ddp_store_check_sizes(klen, elen > dlen ? elen : dlen);
    if (st != DDP_OK) return ddp_error_prefix(st, "store compare_set: ");
    if ((st = ddp_store_begin(s, w, DDP_Q_COMPARE_SET)) != DDP_OK) return st;
    ddp_wbuf_str(&s->req, key, klen);
    ddp_wbuf_str(&s->req, expected, elen);
    ddp_wbuf_str(&s->req, desired, dlen);
    st = ddp_store_send_req(s, w);
    if (st == DDP_OK) st = ddp_store_recv_value(s, out, outlen, w);
    return ddp_store_done(s, st, "compare_set");
}

static ddp_status tcp_delete(void *ctx, const char *key, size_t klen,
                            int64_t *ndeleted, ddp_wait w) {
    tcp *s = ctx;
    ddp_status st = ddp_store_check_sizes(klen, 0);
    if (st != DDP_OK) return ddp_error_prefix(st, "store delete_key: ");
    if ((st = ddp_store_begin(s, w, DDP_Q_DELETE_KEY)) != DDP_OK) return st;
    ddp_wbuf_str(&s->req, key, klen);
    st = ddp_store_send_req(s, w);
    if (st == DDP_OK) st = ddp_store_recv_exact(s, ndeleted, sizeof *ndeleted, w);
    return ddp_store_done(s, st, "delete_key");
}

static ddp_status tcp_num_keys(void *ctx, int64_t *n, ddp_wait w) {
    tcp *s = ctx;
    ddp_status st = ddp_store_begin(s, w, DDP_Q_GETNUMKEYS);
    if (st != DDP_OK) return st;
    st = ddp_store_send_req(s, w);
    if (st == DDP_OK) st = ddp_store_recv_exact(s, n, sizeof *n, w);
    return ddp_store_done(s, st, "num_keys");
}

const ddp_store_impl ddp_store_tcp_impl = {
    tcp_set, tcp_append, tcp_get, tcp_add, tcp_wait, tcp_multi_get, tcp_multi_set,
    tcp_check, tcp_compare_set, tcp_delete, tcp_num_keys, tcp_shutdown, tcp_destroy,
};
