/* ddp_store_client.c - the TCPStore client, one of the store's two
 * implementations (ddp_store.c holds the handle and its references; the other
 * is a Python object's, csrc/py/py_store_py.c): one connection, one request in
 * flight, shared between threads by a mutex (see ddp_store.h). This file makes
 * the connection (the ping, the authentication) and carries one request on it:
 * the lock, the request buffer, replies read through a buffer, failures; the
 * requests themselves are ddp_store_client_ops.c's.
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
#include "ddp_store_client_int.h"
#include "ddp_store_wire.h"
#define AUTH_REPLY_MS 10000        /* a server's answer to the authentication request */

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
ddp_status ddp_store_io_fail(tcp *s, ddp_status st) {
    s->broken = 1;
    ddp_copy_error(s->broken_msg, sizeof s->broken_msg);
    return st;
}

/* Unlock and return st, prefixing a failure with the operation and server.
 * A failure while the client was being closed is reported as the close (the
 * socket error it caused says only "closed by the peer"). Broken streams
 * (peer closed or reset, garbage, socket errors) become DDP_ERR_STORE;
 * timeouts, aborts and out-of-memory keep their status. */
ddp_status ddp_store_done(tcp *s, ddp_status st, const char *op) {
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
ddp_status ddp_store_begin(tcp *s, ddp_wait w, uint8_t q) {
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

ddp_status ddp_store_send_req(tcp *s, ddp_wait w) {
    if (s->req.oom) return ddp_error(DDP_ERR_NOMEM, "out of memory building a request");
    ddp_status st = ddp_sock_send_all(s->fd, s->req.p, s->req.len, w, s->peer);
    return st == DDP_OK ? st : ddp_store_io_fail(s, st);
}

/* Receive exactly n bytes of the reply into buf by w: first those read
 * ahead, then from the socket (n or more when n is small: the surplus stays
 * read ahead). Failures are the socket layer's; the stream is not marked
 * broken (recv_exact does that). */
ddp_status ddp_store_recv_buffered(tcp *s, void *buf, size_t n, ddp_wait w) {
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

ddp_status ddp_store_recv_exact(tcp *s, void *buf, size_t n, ddp_wait w) {
    ddp_status st = ddp_store_recv_buffered(s, buf, n, w);
    return st == DDP_OK ? st : ddp_store_io_fail(s, st);
}

/* Receive a length-prefixed value into a malloc'd buffer owned by caller. */
ddp_status ddp_store_recv_value(tcp *s, void **val, size_t *vlen, ddp_wait w) {
    uint64_t n;
    ddp_status st = ddp_store_recv_exact(s, &n, sizeof n, w);
    if (st != DDP_OK) return st;
    if (n > DDP_STORE_MAX_REPLY)
        return ddp_store_io_fail(s, ddp_error(DDP_ERR_PROTOCOL, "reply claims a %llu-byte "
                                              "value; is this a TCPStore server?",
                                              (unsigned long long)n));
    void *p = malloc(n ? (size_t)n : 1);
    if (p == NULL) return ddp_store_io_fail(s, ddp_error(DDP_ERR_NOMEM, "out of memory"));
    st = ddp_store_recv_exact(s, p, (size_t)n, w);
    if (st != DDP_OK) {
        free(p);
        return st;
    }
    *val = p;
    *vlen = (size_t)n;
    return DDP_OK;
}

/* Reject keys and values the server would refuse, before sending. */
ddp_status ddp_store_check_sizes(size_t klen, size_t vlen) {
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
    if (st == DDP_OK) st = ddp_store_recv_buffered(s, rep, 1, w);
    if (st != DDP_OK) return st;
    if (rep[0] == 1)
        return ddp_error(DDP_ERR_AUTH, "authentication failed with the store at %s: it is "
                         "pyddp's without PYDDP_AUTH_TOKEN, and this process has one. Set the "
                         "same token on every node.", s->peer);
    if (rep[0] != 0)
        return ddp_error(DDP_ERR_AUTH, "authentication failed with the store at %s: it "
                         "answered %u", s->peer, rep[0]);
    st = ddp_store_recv_buffered(s, rep + 1, sizeof rep - 1, w);
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
    DDP_CHECK(ddp_store_begin(s, w, DDP_Q_VALIDATE), fail);
    ddp_wbuf_u32(&s->req, DDP_STORE_MAGIC);
    ddp_wbuf_u8(&s->req, DDP_Q_PING);
    ddp_wbuf_u32(&s->req, nonce);
    st = ddp_store_send_req(s, w);
    if (st == DDP_OK) st = ddp_store_recv_exact(s, &echo, sizeof echo, w);
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
    return ddp_store_wrap(&ddp_store_tcp_impl, s, s->peer, out);
fail:
    close(s->fd);
fail_noconn:
    pthread_mutex_destroy(&s->mu);
    ddp_wbuf_free(&s->req);
    free(s);
    return st;
}
