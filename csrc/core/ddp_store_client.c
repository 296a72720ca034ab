/* ddp_store_client.c - the TCPStore client, one of the store's two
 * implementations (ddp_store.c holds the handle and its references; the other
 * is a Python object's, csrc/py/py_store_py.c): one connection, one request in
 * flight, shared between threads by a mutex (see ddp_store.h).
 *
 * Every request is bounded by the caller's ddp_wait. A request that fails in
 * the middle (timeout waiting for a reply, peer reset, malformed reply) makes
 * the client "broken": the byte stream can no longer be trusted, so every later
 * call fails at once with the original reason. Except WAIT: its timeout is
 * part of the protocol (CANCEL_WAIT, then drain the reply, which may be a
 * STOP_WAITING that raced the cancel), so an expired wait leaves it usable.
 * Garbage, a broken connection or a closed client give DDP_ERR_STORE;
 * connecting keeps the socket layer's DDP_ERR_CONNECT.
 *
 * Closing does not take the request mutex (the request holding it may be a
 * WAIT with no deadline): it sets `closed` and shutdown()s the socket, so the
 * request's poll()/recv() returns at once; the descriptor is closed only with
 * the last reference, never reused under a thread still polling it.
 */
#include "ddp_store.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "ddp_auth.h"
#include "ddp_sock.h"
#include "ddp_store_wire.h"

/* How long a reply the server owes may take when the caller's own deadline
 * has run out: the cancel/drain after an expired WAIT, and the GET after a
 * WAIT that succeeded (the key exists). Giving up on an owed reply leaves
 * the connection out of step, so it would be unusable afterwards; torch's
 * TCPStore servers sometimes take 5 s to answer. */
#define DDP_STORE_GRACE_MS 30000
#define AUTH_REPLY_MS 10000        /* a server's answer to the authentication request */
#define DDP_STORE_PROBE_KEYS 64    /* keys of a timed-out WAIT probed to name the missing one */
/* Replies are read through a buffer of this size: a MULTI_GET of N values is
 * 2N fields, read with a few system calls instead of 2N. Larger fields go
 * straight to their destination. */
#define RBUF_BYTES (64u << 10)

typedef struct tcp {
    atomic_int closed;      /* ddp_store_close was called: every request fails */
    pthread_mutex_t mu;     /* held for a whole request (one in flight) */
    int fd;                 /* valid until the last reference goes */
    int broken;             /* the byte stream is out of sync (under mu) */
    char broken_msg[1024];
    char peer[DDP_ADDR_MAX + 16];
    ddp_wbuf req;
    /* Bytes received and not yet consumed: rbuf[rpos..rlen) (under mu). Only
     * replies the client asked for arrive, one request in flight, so what is
     * read ahead is always the rest of the current reply. */
    size_t rpos, rlen;
    unsigned char rbuf[RBUF_BYTES];
} tcp;

/* The error of a request on a closed client. */
static ddp_status closed_error(tcp *s) {
    return ddp_error(DDP_ERR_STORE, "the store client for %s was closed (close() was "
                     "called on it, from another thread or a signal handler)", s->peer);
}

/* Take the mutex within w, in slices, so a thread stuck behind another
 * thread's long WAIT still honours its own deadline, abort flag and a close. */
static ddp_status lock(tcp *s, ddp_wait w) {
    for (;;) {
        if (atomic_load(&s->closed)) return closed_error(s);
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += (long)ddp_wait_slice(w) * 1000000L;
        ts.tv_sec += ts.tv_nsec / 1000000000L;
        ts.tv_nsec %= 1000000000L;
        int r = pthread_mutex_timedlock(&s->mu, &ts);
        if (r == 0) return DDP_OK;
        if (ddp_wait_aborted(w))
            return ddp_error(DDP_ERR_ABORTED, "store request to %s aborted", s->peer);
        if (ddp_wait_expired(w))
            return ddp_error(DDP_ERR_TIMEOUT, "store request to %s timed out waiting for "
                             "another thread's request on the same connection", s->peer);
    }
}

/* Record an I/O failure: the connection is unusable from now on. */
static ddp_status io_fail(tcp *s, ddp_status st) {
    s->broken = 1;
    ddp_copy_error(s->broken_msg, sizeof s->broken_msg);
    return st;
}

/* Unlock and return st, prefixing a failure with the operation and server.
 * A failure while the client was being closed is reported as the close (the
 * socket error it caused says only "closed by the peer"). Broken streams
 * (peer closed or reset, garbage, socket errors) become DDP_ERR_STORE;
 * timeouts, aborts and out-of-memory keep their status. */
static ddp_status done(tcp *s, ddp_status st, const char *op) {
    pthread_mutex_unlock(&s->mu);
    if (st == DDP_OK) return st;
    if (st == DDP_ERR_CLOSED || st == DDP_ERR_PROTOCOL || st == DDP_ERR_SYS)
        st = DDP_ERR_STORE;
    if (atomic_load(&s->closed)) {
        st = ddp_error(DDP_ERR_STORE, "the store client was closed while this request "
                       "was in flight (close() was called on it, from another thread or "
                       "a signal handler)");
    }
    return ddp_error_prefix(st, "store %s on %s: ", op, s->peer);
}

/* Lock and check the connection is usable. */
static ddp_status begin(tcp *s, ddp_wait w, uint8_t q) {
    ddp_status st = lock(s, w);
    if (st != DDP_OK) return st;
    if (atomic_load(&s->closed)) {
        pthread_mutex_unlock(&s->mu);
        return closed_error(s);
    }
    if (s->broken) {
        pthread_mutex_unlock(&s->mu);
        return ddp_error(DDP_ERR_STORE, "store connection to %s is unusable after an "
                         "earlier error: %s", s->peer, s->broken_msg);
    }
    s->req.start = s->req.len = 0;
    s->req.oom = 0;
    ddp_wbuf_u8(&s->req, q);
    return DDP_OK;
}

static ddp_status send_req(tcp *s, ddp_wait w) {
    if (s->req.oom) return ddp_error(DDP_ERR_NOMEM, "out of memory building a request");
    ddp_status st = ddp_sock_send_all(s->fd, s->req.p, s->req.len, w, s->peer);
    return st == DDP_OK ? st : io_fail(s, st);
}

/* Receive exactly n bytes of the reply into buf by w: first those read
 * ahead, then from the socket (n or more when n is small: the surplus stays
 * read ahead). Failures are the socket layer's; the stream is not marked
 * broken (recv_exact does that). */
static ddp_status recv_buffered(tcp *s, void *buf, size_t n, ddp_wait w) {
    unsigned char *p = buf;
    size_t k = s->rlen - s->rpos;
    if (k > n) k = n;
    memcpy(p, s->rbuf + s->rpos, k);
    s->rpos += k;
    if (k == n) return DDP_OK;
    p += k;
    n -= k;
    s->rpos = s->rlen = 0;
    if (n >= RBUF_BYTES / 2) return ddp_sock_recv_all(s->fd, p, n, w, s->peer);
    size_t got = 0;
    ddp_status st = ddp_sock_recv_atleast(s->fd, s->rbuf, n, RBUF_BYTES, &got, w, s->peer);
    if (st != DDP_OK) return st;
    memcpy(p, s->rbuf, n);
    s->rpos = n;
    s->rlen = got;
    return DDP_OK;
}

static ddp_status recv_exact(tcp *s, void *buf, size_t n, ddp_wait w) {
    ddp_status st = recv_buffered(s, buf, n, w);
    return st == DDP_OK ? st : io_fail(s, st);
}

/* Receive a length-prefixed value into a malloc'd buffer owned by caller. */
static ddp_status recv_value(tcp *s, void **val, size_t *vlen, ddp_wait w) {
    uint64_t n;
    ddp_status st = recv_exact(s, &n, sizeof n, w);
    if (st != DDP_OK) return st;
    if (n > DDP_STORE_MAX_REPLY)
        return io_fail(s, ddp_error(DDP_ERR_PROTOCOL, "reply claims a %llu-byte value; "
                                    "is this a TCPStore server?", (unsigned long long)n));
    void *p = malloc(n ? (size_t)n : 1);
    if (p == NULL) return io_fail(s, ddp_error(DDP_ERR_NOMEM, "out of memory"));
    st = recv_exact(s, p, (size_t)n, w);
    if (st != DDP_OK) {
        free(p);
        return st;
    }
    *val = p;
    *vlen = (size_t)n;
    return DDP_OK;
}

/* Reject keys and values the server would refuse, before sending. */
static ddp_status check_sizes(size_t klen, size_t vlen) {
    if (klen > DDP_STORE_MAX_KEY)
        return ddp_error(DDP_ERR_INVALID, "key of %zu bytes exceeds the %zu-byte limit",
                         klen, DDP_STORE_MAX_KEY);
    if (vlen > DDP_STORE_MAX_VALUE)
        return ddp_error(DDP_ERR_INVALID, "value of %zu bytes exceeds the %zu MiB limit",
                         vlen, DDP_STORE_MAX_VALUE >> 20);
    return DDP_OK;
}

/* The client's side of the authentication exchange (ddp_store.h) on a
 * fresh connection. DDP_OK; DDP_ERR_CLOSED if the server closed it without
 * answering (torch's server: the caller decides); DDP_ERR_AUTH with the
 * reason otherwise. */
static ddp_status authenticate(tcp *s, const ddp_auth *a, ddp_wait w) {
    unsigned char req[DDP_STORE_AUTH_HELLO], rep[1 + DDP_AUTH_NONCE + DDP_AUTH_MAC],
        want[DDP_AUTH_MAC];
    req[0] = DDP_Q_AUTH;
    uint32_t magic = DDP_STORE_AUTH_MAGIC;
    memcpy(req + 1, &magic, 4);   /* host order, like the rest of the store protocol */
    ddp_status st = ddp_auth_nonce(req + 5);
    if (st != DDP_OK) return st;
    st = ddp_sock_send_all(s->fd, req, sizeof req, w, s->peer);
    if (st == DDP_OK) st = recv_buffered(s, rep, 1, w);
    if (st != DDP_OK) return st;
    if (rep[0] == 1)
        return ddp_error(DDP_ERR_AUTH, "authentication failed with the store at %s: it is "
                         "pyddp's without PYDDP_AUTH_TOKEN, and this process has one. Set the "
                         "same token on every node.", s->peer);
    if (rep[0] != 0)
        return ddp_error(DDP_ERR_AUTH, "authentication failed with the store at %s: it "
                         "answered %u", s->peer, rep[0]);
    st = recv_buffered(s, rep + 1, sizeof rep - 1, w);
    if (st == DDP_ERR_CLOSED || st == DDP_ERR_SYS)
        return ddp_error(DDP_ERR_AUTH, "authentication failed with the store at %s: it "
                         "closed the connection during the exchange", s->peer);
    if (st != DDP_OK) return st;
    st = ddp_auth_proof(a, "responder", DDP_STORE_AUTH_PURPOSE, req + 5, rep + 1, want);
    if (st != DDP_OK) return st;
    if (!ddp_auth_equal(want, rep + 1 + DDP_AUTH_NONCE, DDP_AUTH_MAC))
        return ddp_error(DDP_ERR_AUTH, "authentication failed with the store at %s: its "
                         "proof does not match this process's PYDDP_AUTH_TOKEN (a different "
                         "token, or not the job's store)", s->peer);
    st = ddp_auth_proof(a, "initiator", DDP_STORE_AUTH_PURPOSE, req + 5, rep + 1, want);
    if (st == DDP_OK) st = ddp_sock_send_all(s->fd, want, sizeof want, w, s->peer);
    return st;
}

static const ddp_store_impl tcp_impl;

ddp_status ddp_store_connect(const char *host, int port, ddp_wait w, ddp_store **out) {
    return ddp_store_connect_auth(host, port, DDP_STORE_AUTH_AUTO, NULL, w, out);
}

ddp_status ddp_store_connect_auth(const char *host, int port, int mode,
                                  const ddp_auth *key, ddp_wait w, ddp_store **out) {
    ddp_status st;
    *out = NULL;
    if (key == NULL && mode != DDP_STORE_AUTH_OFF) {
        st = ddp_auth_get(&key);
        if (st != DDP_OK) return st;
    }
    if (mode == DDP_STORE_AUTH_OFF) key = NULL;
    tcp *s = calloc(1, sizeof *s);
    if (s == NULL) return ddp_error(DDP_ERR_NOMEM, "store connect: out of memory");
    ddp_sock_format_hostport(host, port, s->peer, sizeof s->peer);
    ddp_wbuf_init(&s->req);
    atomic_init(&s->closed, 0);
    pthread_mutex_init(&s->mu, NULL);
    /* AUTO first connects plainly: torch's servers answer the PING (they neither
     * answer nor close at an AUTH request), a pyddp server with a token answers
     * with its marker instead, and only then is the connection made again with
     * the handshake. */
    int with_auth = key != NULL && mode == DDP_STORE_AUTH_REQUIRE;
again:
    s->rpos = s->rlen = 0;
    DDP_CHECK(ddp_sock_connect(host, port, w, &s->fd), fail_noconn);
    if (with_auth) {
        ddp_wait aw = ddp_wait_for(AUTH_REPLY_MS, w.abort);   /* pyddp answers at once */
        if (aw.deadline_ms > w.deadline_ms) aw.deadline_ms = w.deadline_ms;
        st = authenticate(s, key, aw);
        if (st == DDP_ERR_CLOSED || (st == DDP_ERR_TIMEOUT && !ddp_wait_expired(w)))
            st = ddp_error(DDP_ERR_AUTH, "authentication failed with the store at %s: it "
                           "did not answer the authentication request, so it is not a pyddp "
                           "store with PYDDP_AUTH_TOKEN set (torch's TCPStore cannot "
                           "authenticate; see docs/security.md)", s->peer);
        if (st != DDP_OK) goto fail;
    }
    uint32_t nonce = (uint32_t)ddp_now_us() ^ (uint32_t)getpid(), echo = 0;
    if (key != NULL && !with_auth) nonce = DDP_STORE_AUTH_PROBE;   /* AUTO's plain try */
    if (nonce == DDP_STORE_AUTH_MAGIC) nonce++;
    DDP_CHECK(begin(s, w, DDP_Q_VALIDATE), fail);
    ddp_wbuf_u32(&s->req, DDP_STORE_MAGIC);
    ddp_wbuf_u8(&s->req, DDP_Q_PING);
    ddp_wbuf_u32(&s->req, nonce);
    st = send_req(s, w);
    if (st == DDP_OK) st = recv_exact(s, &echo, sizeof echo, w);
    if (st == DDP_OK && echo == DDP_STORE_AUTH_MAGIC && echo != nonce && key != NULL &&
        !with_auth) {
        pthread_mutex_unlock(&s->mu);   /* a pyddp server that wants the handshake */
        close(s->fd);
        with_auth = 1;
        goto again;
    }
    if (st == DDP_OK && echo == DDP_STORE_AUTH_MAGIC && echo != nonce)
        st = ddp_error(DDP_ERR_AUTH, "authentication failed with the store at %s: it "
                       "requires PYDDP_AUTH_TOKEN and this process has none. Set the same "
                       "token on every node.", s->peer);
    if (st == DDP_OK && echo != nonce)
        st = ddp_error(DDP_ERR_PROTOCOL, "handshake reply did not echo the ping");
    /* Garbage means the port is some other service: a store error. A closed or
     * reset connection stays a network error (the caller may retry). */
    if (st == DDP_ERR_PROTOCOL) st = DDP_ERR_STORE;
    pthread_mutex_unlock(&s->mu);
    if (st == DDP_ERR_AUTH) goto fail;
    if (st != DDP_OK) {
        if (st == DDP_ERR_CLOSED && key == NULL)
            ddp_error_prefix(st, "(if that store requires authentication, set the same "
                             "PYDDP_AUTH_TOKEN here) ");
        ddp_error_prefix(st, "store handshake with %s failed (is MASTER_PORT the "
                         "store's port and not another service's?): ", s->peer);
        goto fail;
    }
    return ddp_store_wrap(&tcp_impl, s, s->peer, out);
fail:
    close(s->fd);
fail_noconn:
    pthread_mutex_destroy(&s->mu);
    ddp_wbuf_free(&s->req);
    free(s);
    return st;
}

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
    ddp_status st = check_sizes(klen, vlen);
    if (st != DDP_OK) return ddp_error_prefix(st, "store %s: ", op);
    if ((st = begin(s, w, q)) != DDP_OK) return st;
    ddp_wbuf_str(&s->req, key, klen);
    ddp_wbuf_str(&s->req, val, vlen);
    return done(s, send_req(s, w), op);
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
        ddp_status st = check_sizes(klens[i], vlens[i]);
        if (st != DDP_OK) return ddp_error_prefix(st, "store multi_set: ");
        total += 16 + klens[i] + vlens[i];
    }
    if (n > DDP_STORE_MAX_COUNT || total > DDP_STORE_MAX_BUFFERED)   /* the server's limits */
        return ddp_error(DDP_ERR_INVALID, "store multi_set: %zu keys in %zu bytes are more "
                         "than one request may carry: set them in parts", n, total);
    ddp_status st = begin(s, w, DDP_Q_MULTI_SET);
    if (st != DDP_OK) return st;
    ddp_wbuf_u64(&s->req, (uint64_t)n);
    for (size_t i = 0; i < n; i++) {
        ddp_wbuf_str(&s->req, keys[i], klens[i]);
        ddp_wbuf_str(&s->req, vals[i], vlens[i]);
    }
    return done(s, send_req(s, w), "multi_set");
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
    ddp_status st = send_req(s, w);
    if (st == DDP_OK) st = recv_exact(s, &r, 1, w);
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
    ddp_status st = send_req(s, g);
    if (st == DDP_OK) st = recv_exact(s, &r, 1, g);
    *raced = st == DDP_OK && r == DDP_WAIT_STOP_WAITING;
    if (*raced) st = recv_exact(s, &r, 1, g);
    if (st == DDP_OK && r != DDP_WAIT_CANCELED)
        st = io_fail(s, ddp_error(DDP_ERR_PROTOCOL, "unexpected reply %u to CANCEL_WAIT", r));
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
        if (klens[i] > DDP_STORE_MAX_KEY) return check_sizes(klens[i], 0);
    s->req.start = s->req.len = 0;
    ddp_wbuf_u8(&s->req, DDP_Q_WAIT);
    put_keys(s, keys, klens, n);
    uint8_t r;
    ddp_status st = send_req(s, w);
    if (st != DDP_OK) return st;
    st = recv_buffered(s, &r, 1, w);
    if (st == DDP_OK)
        return r == DDP_WAIT_STOP_WAITING ? DDP_OK
               : io_fail(s, ddp_error(DDP_ERR_PROTOCOL, "unexpected reply %u to WAIT", r));
    if (st != DDP_ERR_TIMEOUT && st != DDP_ERR_ABORTED) return io_fail(s, st);
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
    ddp_status st = begin(s, w, DDP_Q_WAIT);
    if (st != DDP_OK) return st;
    return done(s, wait_locked(s, keys, klens, n, w), "wait");
}

static ddp_status tcp_get(void *ctx, const char *key, size_t klen, void **val,
                         size_t *vlen, ddp_wait w) {
    tcp *s = ctx;
    ddp_status st = begin(s, w, DDP_Q_WAIT);
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
        st = send_req(s, w);
    }
    if (st == DDP_OK) st = recv_value(s, val, vlen, w);
    return done(s, st, "get");
}

static ddp_status tcp_multi_get(void *ctx, const char *const *keys, const size_t *klens,
                               size_t n, void **vals, size_t *vlens, ddp_wait w) {
    tcp *s = ctx;
    for (size_t i = 0; i < n; i++) vals[i] = NULL;
    ddp_status st = begin(s, w, DDP_Q_WAIT);
    if (st != DDP_OK) return st;
    st = wait_locked(s, keys, klens, n, w);
    int64_t floor = ddp_now_ms() + DDP_STORE_GRACE_MS;   /* the values are owed now */
    if (w.deadline_ms < floor) w.deadline_ms = floor;
    if (st == DDP_OK) {
        s->req.start = s->req.len = 0;
        ddp_wbuf_u8(&s->req, DDP_Q_MULTI_GET);
        put_keys(s, keys, klens, n);
        st = send_req(s, w);
    }
    for (size_t i = 0; st == DDP_OK && i < n; i++) st = recv_value(s, &vals[i], &vlens[i], w);
    if (st != DDP_OK)
        for (size_t i = 0; i < n; i++) {
            free(vals[i]);
            vals[i] = NULL;
        }
    return done(s, st, "multi_get");
}

static ddp_status tcp_check(void *ctx, const char *const *keys, const size_t *klens,
                           size_t n, int *ready, ddp_wait w) {
    tcp *s = ctx;
    for (size_t i = 0; i < n; i++)
        if (klens[i] > DDP_STORE_MAX_KEY)
            return ddp_error_prefix(check_sizes(klens[i], 0), "store check: ");
    ddp_status st = begin(s, w, DDP_Q_CHECK);
    if (st != DDP_OK) return st;
    return done(s, check_locked(s, keys, klens, n, ready, w), "check");
}

static ddp_status tcp_add(void *ctx, const char *key, size_t klen, int64_t delta,
                         int64_t *result, ddp_wait w) {
    tcp *s = ctx;
    ddp_status st = check_sizes(klen, 0);
    if (st != DDP_OK) return ddp_error_prefix(st, "store add: ");
    if ((st = begin(s, w, DDP_Q_ADD)) != DDP_OK) return st;
    ddp_wbuf_str(&s->req, key, klen);
    ddp_wbuf_u64(&s->req, (uint64_t)delta);
    st = send_req(s, w);
    if (st == DDP_OK) st = recv_exact(s, result, sizeof *result, w);
    return done(s, st, "add");
}

static ddp_status tcp_compare_set(void *ctx, const char *key, size_t klen,
                                 const void *expected, size_t elen, const void *desired,
                                 size_t dlen, void **out, size_t *outlen, ddp_wait w) {
    tcp *s = ctx;
    ddp_status st = check_sizes(klen, elen > dlen ? elen : dlen);
    if (st != DDP_OK) return ddp_error_prefix(st, "store compare_set: ");
    if ((st = begin(s, w, DDP_Q_COMPARE_SET)) != DDP_OK) return st;
    ddp_wbuf_str(&s->req, key, klen);
    ddp_wbuf_str(&s->req, expected, elen);
    ddp_wbuf_str(&s->req, desired, dlen);
    st = send_req(s, w);
    if (st == DDP_OK) st = recv_value(s, out, outlen, w);
    return done(s, st, "compare_set");
}

static ddp_status tcp_delete(void *ctx, const char *key, size_t klen,
                            int64_t *ndeleted, ddp_wait w) {
    tcp *s = ctx;
    ddp_status st = check_sizes(klen, 0);
    if (st != DDP_OK) return ddp_error_prefix(st, "store delete_key: ");
    if ((st = begin(s, w, DDP_Q_DELETE_KEY)) != DDP_OK) return st;
    ddp_wbuf_str(&s->req, key, klen);
    st = send_req(s, w);
    if (st == DDP_OK) st = recv_exact(s, ndeleted, sizeof *ndeleted, w);
    return done(s, st, "delete_key");
}

static ddp_status tcp_num_keys(void *ctx, int64_t *n, ddp_wait w) {
    tcp *s = ctx;
    ddp_status st = begin(s, w, DDP_Q_GETNUMKEYS);
    if (st != DDP_OK) return st;
    st = send_req(s, w);
    if (st == DDP_OK) st = recv_exact(s, n, sizeof *n, w);
    return done(s, st, "num_keys");
}

static const ddp_store_impl tcp_impl = {
    tcp_set, tcp_append, tcp_get, tcp_add, tcp_wait, tcp_multi_get, tcp_multi_set,
    tcp_check, tcp_compare_set, tcp_delete, tcp_num_keys, tcp_shutdown, tcp_destroy,
};
