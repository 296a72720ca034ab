/* ddp_store_server.c - the TCPStore-compatible server: one background thread
 * that poll()s a listening socket, a wake-up pipe and every client
 * connection, buffers each connection's input until a whole request is
 * there, and hands complete requests to ddp_store_ops.c.
 *
 * Robustness is per connection: garbage, an unknown query, an absurd length,
 * a request that never completes, or a client that disappears mid-request
 * closes that one connection; the server keeps serving the others. A client
 * that does not read its replies is back-pressured (its requests are not
 * parsed while too much output is queued for it).
 *
 * With PYDDP_AUTH_TOKEN set, a connection must first pass the token
 * handshake (ddp_store.h): until it has, only the bytes of the handshake's
 * next step are read from it, and anything else closes it (logged once per
 * host). Memory and time are bounded against clients that stall: complete
 * requests are run as soon as they are framed, between reads, so a
 * connection buffers at most a small allowance plus one large request
 * (ddp_store_input.c decides how much, and who is evicted when the
 * budget for large ones, PYDDP_STORE_BUFFER_BYTES, runs out); a request
 * may stay incomplete for at most PYDDP_STORE_REQUEST_TIMEOUT, and a
 * connection must complete its first request (the handshake and VALIDATE)
 * within FIRST_REQUEST_MS; a connection over any of these is closed,
 * everyone else keeps being served.
 */
#include "ddp_store_server_int.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ddp_hello.h"
#include "ddp_settings.h"
#include "ddp_sock.h"

#define READ_BUDGET ((size_t)4 << 20)     /* bytes read per connection per round */
#define OUT_HIGH_WATER ((size_t)4 << 20)  /* stop parsing while this much is queued */
#define ACCEPTS_PER_ROUND 64
#define FIRST_REQUEST_MS 5000

/* Close and free one connection (its pending WAIT goes with it). */
static void conn_free(ddp_store_server *srv, ddp_store_conn *c) {
    if (c == NULL) return;
    if (c->fd >= 0) close(c->fd);
    ddp_store_input_release(srv, c);
    ddp_wbuf_free(&c->out);
    ddp_store_conn_clear_wait(srv, c);
    free(c);
}

/* Accept every pending connection (up to a per-round limit). On a resource
 * error (out of descriptors) pause accepting for one slice instead of
 * spinning on a listening socket that stays readable. */
static void accept_new(ddp_store_server *srv) {
    for (int i = 0; i < ACCEPTS_PER_ROUND; i++) {
        int fd;
        ddp_status st = ddp_sock_accept(srv->lfd, ddp_wait_for(0, NULL), &fd);
        if (st == DDP_ERR_TIMEOUT) return;
        if (st != DDP_OK) {
            srv->accept_pause_until = ddp_now_ms() + DDP_WAIT_SLICE_MS;
            return;
        }
        ddp_store_conn *c = calloc(1, sizeof *c);
        if (c == NULL || (srv->nconns == srv->capconns && ddp_store_grow_conns(srv) < 0)) {
            free(c);
            close(fd);
            return;
        }
        c->fd = fd;
        c->opened_ms = c->heard_ms = ddp_now_ms();
        ddp_auth_peer_name(fd, c->addr, sizeof c->addr);
        c->authed = !srv->has_key;
        ddp_wbuf_init(&c->in);
        ddp_wbuf_init(&c->out);
        srv->conns[srv->nconns++] = c;
    }
}

int ddp_store_grow_conns(ddp_store_server *srv) {
    size_t cap = srv->capconns ? srv->capconns * 2 : 16;
    ddp_store_conn **cs = realloc(srv->conns, cap * sizeof *cs);
    if (cs == NULL) return -1;
    srv->conns = cs;
    struct pollfd *pf = realloc(srv->pfds, (cap + 2) * sizeof *pf);
    if (pf == NULL) return -1;
    srv->pfds = pf;
    srv->capconns = cap;
    return 0;
}

/* Send as much queued output as the socket takes. -1 if the peer is gone. */
static int conn_flush(ddp_store_conn *c) {
    if (ddp_wbuf_size(&c->out) == 0) return 0;
    size_t done = 0;
    ddp_status st = ddp_sock_send_some(c->fd, ddp_wbuf_data(&c->out),
                                       ddp_wbuf_size(&c->out), &done);
    ddp_wbuf_consume(&c->out, done);
    return st == DDP_OK ? 0 : -1;
}

/* Log and note a connection that failed authentication; returns -1. */
static int auth_reject(ddp_store_conn *c, const char *why, int note) {
    char msg[600];
    const char *addr = c->addr;
    ddp_auth_log_reject("a store connection", addr, why);
    if (note) {   /* looks like a rank with another token: rendezvous watches for it */
        snprintf(msg, sizeof msg, "authentication failed: the store rejected a connection "
                 "from %s (%s)", addr, why);
        ddp_auth_note_reject(msg);
    }
    return -1;
}

/* The server's side of the token handshake (ddp_store.h). 1: authenticated
 * (go on parsing), 0: wait for more bytes, -1: drop the connection. */
static int conn_auth(ddp_store_server *srv, ddp_store_conn *c) {
    const unsigned char *p = ddp_wbuf_data(&c->in);
    size_t n = ddp_wbuf_size(&c->in);
    if (c->auth_stage == 0) {
        if (n == 0) return 0;
        if (p[0] == DDP_Q_VALIDATE) {
            /* Where a PING's echo would be, a marker a pyddp client recognises: one
             * with a token then reconnects with the handshake, one without fails
             * with a clear error (torch's reads a wrong echo). A pyddp client's
             * probe (PING of DDP_STORE_AUTH_PROBE) is turned away quietly. */
            if (n < 10) return 0;   /* VALIDATE and the PING that follows it */
            uint32_t nonce;
            memcpy(&nonce, p + 6, 4);
            int probe = p[5] == DDP_Q_PING && nonce == DDP_STORE_AUTH_PROBE;
            ddp_wbuf_u32(&c->out, DDP_STORE_AUTH_MAGIC);
            conn_flush(c);
            if (probe) return -1;
            return auth_reject(c, "no PYDDP_AUTH_TOKEN handshake (a client without the "
                               "token, or torch's)", 1);
        }
        if (p[0] != DDP_Q_AUTH) return auth_reject(c, "garbage before authenticating", 0);
        if (n < DDP_STORE_AUTH_HELLO) return 0;
        uint32_t magic;
        memcpy(&magic, p + 1, 4);
        if (magic != DDP_STORE_AUTH_MAGIC) return auth_reject(c, "a malformed challenge", 0);
        memcpy(c->nc, p + 5, DDP_AUTH_NONCE);
        unsigned char mac[DDP_AUTH_MAC];
        if (ddp_auth_nonce(c->ns) != DDP_OK ||
            ddp_auth_proof(&srv->key, "responder", DDP_STORE_AUTH_PURPOSE, c->nc, c->ns,
                           mac) != DDP_OK)
            return -1;
        ddp_wbuf_u8(&c->out, 0);
        ddp_wbuf_raw(&c->out, c->ns, DDP_AUTH_NONCE);
        ddp_wbuf_raw(&c->out, mac, DDP_AUTH_MAC);
        ddp_wbuf_consume(&c->in, DDP_STORE_AUTH_HELLO);
        c->auth_stage = 1;
        return 0;
    }
    if (n < DDP_AUTH_MAC) return 0;
    unsigned char want[DDP_AUTH_MAC];
    if (ddp_auth_proof(&srv->key, "initiator", DDP_STORE_AUTH_PURPOSE, c->nc, c->ns,
                       want) != DDP_OK)
        return -1;
    if (!ddp_auth_equal(want, p, DDP_AUTH_MAC))
        return auth_reject(c, "a wrong PYDDP_AUTH_TOKEN proof", 1);
    ddp_wbuf_consume(&c->in, DDP_AUTH_MAC);
    c->authed = 1;
    return 1;
}

int ddp_store_conn_process(ddp_store_server *srv, ddp_store_conn *c) {
    if (!srv->has_key && !c->validated && ddp_wbuf_size(&c->in) > 0 &&
        ddp_wbuf_data(&c->in)[0] == DDP_Q_AUTH) {
        /* A client with a token, a server without: say so before closing. */
        ddp_wbuf_u8(&c->out, 1);
        conn_flush(c);
        return auth_reject(c, "it has PYDDP_AUTH_TOKEN set and this store has none", 1);
    }
    if (!c->authed) {
        int a = conn_auth(srv, c);
        if (a <= 0) return a < 0 || c->out.oom ? -1 : 0;
    }
    int progress = 0;
    while (ddp_wbuf_size(&c->out) < OUT_HIGH_WATER && ddp_wbuf_size(&c->in) > 0) {
        size_t used = 0;
        if (ddp_wbuf_size(&c->in) < c->scan.need) break;   /* nothing new to frame */
        int r = ddp_store_handle(srv, c, ddp_wbuf_data(&c->in), ddp_wbuf_size(&c->in),
                                 &used);
        if (r < 0) return -1;
        if (r == 0) break;   /* incomplete: wait for more bytes */
        ddp_wbuf_consume(&c->in, used);
        progress = 1;
    }
    if (ddp_wbuf_size(&c->in) == 0) {
        c->partial_ms = 0;
    } else if (progress || c->partial_ms == 0) {
        c->partial_ms = ddp_now_ms();
    }
    return c->out.oom ? -1 : 0;
}

/* Read what the connection has, up to a budget per round (for fairness),
 * running the requests framed so far before each read: the input holds at
 * most the allowance, or one large request, never a whole burst of
 * pipelined ones (ddp_store_input_room says how much to read). Returns 0;
 * -1 if the peer closed or reset, or its request cannot be held (over
 * DDP_STORE_MAX_BUFFERED or the budget): bytes already buffered are still
 * run by the caller. A bad request sets c->dead (and returns 0). */
static int conn_read(ddp_store_server *srv, ddp_store_conn *c) {
    size_t total = 0;
    while (total < READ_BUDGET) {
        if (ddp_store_conn_process(srv, c) < 0) {
            c->dead = 1;
            return 0;
        }
        size_t room = 0, got = 0;
        if (ddp_wbuf_size(&c->out) >= OUT_HIGH_WATER) break;   /* back-pressure */
        /* A handshake step's answer goes out before the next step is read. */
        if (!c->authed && ddp_wbuf_size(&c->out) > 0) break;
        if (ddp_store_input_room(srv, c, &room) < 0) return -1;
        if (room == 0) break;
        if (room > READ_BUDGET - total) room = READ_BUDGET - total;
        ddp_status st = ddp_sock_recv_some(c->fd, c->in.p + c->in.len, room, &got);
        c->in.len += got;
        total += got;
        if (got > 0) c->heard_ms = ddp_now_ms();
        if (st != DDP_OK) return -1;
        if (got < room) break;   /* the socket is drained for now */
    }
    return 0;
}

/* Free dropped connections and close the gaps in the array. */
static void reap(ddp_store_server *srv) {
    size_t j = 0;
    for (size_t i = 0; i < srv->nconns; i++) {
        if (srv->conns[i]->dead)
            conn_free(srv, srv->conns[i]);
        else
            srv->conns[j++] = srv->conns[i];
    }
    srv->nconns = j;
}

/* 1 if c has held an incomplete request, or not finished its first one,
 * for too long (logged once per host). */
static int conn_overdue(ddp_store_server *srv, ddp_store_conn *c, int64_t now) {
    const char *why = NULL;
    if (!c->validated && now - c->opened_ms > FIRST_REQUEST_MS)
        why = "its first request did not complete within 5 s of connecting";
    else if (c->partial_ms != 0 && now - c->partial_ms > srv->request_timeout_ms)
        why = "a request stayed incomplete longer than PYDDP_STORE_REQUEST_TIMEOUT";
    if (why == NULL) return 0;
    ddp_auth_log_reject("a store connection", c->addr, why);
    return 1;
}

/* One poll round: wait up to a slice, accept, read, run requests, flush. */
static void serve_round(ddp_store_server *srv) {
    size_t n = srv->nconns;
    int accepting = ddp_now_ms() >= srv->accept_pause_until;
    srv->pfds[0] = (struct pollfd){.fd = srv->wake[0], .events = POLLIN};
    srv->pfds[1] = (struct pollfd){.fd = accepting ? srv->lfd : -1, .events = POLLIN};
    for (size_t i = 0; i < n; i++) {
        ddp_store_conn *c = srv->conns[i];
        short ev = 0;
        if (ddp_wbuf_size(&c->out) < OUT_HIGH_WATER && !c->starved) ev |= POLLIN;
        c->starved = 0;
        if (ddp_wbuf_size(&c->out) > 0) ev |= POLLOUT;
        srv->pfds[i + 2] = (struct pollfd){.fd = c->fd, .events = ev};
    }
    if (poll(srv->pfds, n + 2, DDP_WAIT_SLICE_MS) < 0) return;   /* EINTR: go round */
    if (srv->pfds[0].revents) {
        char drain[64];
        while (read(srv->wake[0], drain, sizeof drain) > 0) {}
    }
    for (size_t i = 0; i < n; i++) {
        ddp_store_conn *c = srv->conns[i];
        short re = srv->pfds[i + 2].revents;
        int gone = 0;
        if (c->dead) continue;   /* evicted this round to make room for another */
        if (re & (POLLIN | POLLHUP | POLLERR)) gone = conn_read(srv, c) < 0;
        /* Requests that fully arrived before a disconnect still take effect,
         * and a client that only half-closed still gets their replies. */
        if (!c->dead && ddp_store_conn_process(srv, c) < 0) c->dead = 1;
        if (gone || (!c->dead && ddp_store_input_fits(srv, c) < 0)) c->dead = 1;
        if (gone && !c->authed && c->auth_stage == 1)   /* it saw our proof and left */
            auth_reject(c, "it closed the connection after the server's proof (a different "
                        "PYDDP_AUTH_TOKEN)", 1);
        if (gone) conn_flush(c);
        if (!c->dead && conn_overdue(srv, c, ddp_now_ms())) c->dead = 1;
        if (!c->dead) ddp_store_input_trim(srv, c);
    }
    if (srv->pfds[1].revents) accept_new(srv);
    /* Flush everyone: a SET from one client may have woken another's WAIT. */
    for (size_t i = 0; i < srv->nconns; i++)
        if (!srv->conns[i]->dead && conn_flush(srv->conns[i]) < 0) srv->conns[i]->dead = 1;
    reap(srv);
}

static void *serve(void *arg) {
    ddp_store_server *srv = arg;
    while (!atomic_load(&srv->stop)) serve_round(srv);
    return NULL;
}

/* Make a close-on-exec, non-blocking pipe for waking the thread. */
static int wake_pipe(int p[2]) {
    if (pipe(p) < 0) return -1;
    for (int i = 0; i < 2; i++) {
        fcntl(p[i], F_SETFD, FD_CLOEXEC);
        fcntl(p[i], F_SETFL, fcntl(p[i], F_GETFL, 0) | O_NONBLOCK);
    }
    return 0;
}

ddp_status ddp_store_server_start(const char *bind_host, int port,
                                  ddp_store_server **out, int *port_out) {
    ddp_status st;
    *out = NULL;
    ddp_store_server *srv = calloc(1, sizeof *srv);
    if (srv == NULL) return ddp_error(DDP_ERR_NOMEM, "store server: out of memory");
    srv->lfd = srv->wake[0] = srv->wake[1] = -1;
    atomic_init(&srv->stop, 0);
    atomic_init(&srv->requests, 0);
    const ddp_auth *key = NULL;
    st = ddp_auth_get(&key);   /* a bad token file or no libcrypto fails the start */
    if (st != DDP_OK) {
        free(srv);
        return ddp_error_prefix(st, "store server: ");
    }
    if (key != NULL) {
        srv->key = *key;
        srv->has_key = 1;
    }
    srv->budget = (size_t)ddp_setting_int("PYDDP_STORE_BUFFER_BYTES");
    srv->request_timeout_ms = (int64_t)(ddp_setting_seconds("PYDDP_STORE_REQUEST_TIMEOUT") *
                                        1000.0);
    if (ddp_kvmap_init(&srv->map) < 0 || ddp_waitmap_init(&srv->waiters) < 0 ||
        ddp_store_grow_conns(srv) < 0) {
        st = ddp_error(DDP_ERR_NOMEM, "store server: out of memory");
        goto fail;
    }
    DDP_CHECK(ddp_sock_listen(bind_host, port, 0, 0, &srv->lfd, &srv->port), fail_listen);
    if (wake_pipe(srv->wake) < 0) {
        st = ddp_error(DDP_ERR_SYS, "store server: pipe: %s", strerror(errno));
        goto fail;
    }
    int e = pthread_create(&srv->thread, NULL, serve, srv);
    if (e != 0) {
        st = ddp_error(DDP_ERR_SYS, "store server: cannot start its thread: %s",
                       strerror(e));
        goto fail;
    }
    *port_out = srv->port;
    *out = srv;
    return DDP_OK;
fail_listen:
    ddp_error_prefix(st, "store server: ");
fail:
    if (srv->lfd >= 0) close(srv->lfd);
    for (int i = 0; i < 2; i++)
        if (srv->wake[i] >= 0) close(srv->wake[i]);
    ddp_kvmap_free(&srv->map);
    ddp_waitmap_free(&srv->waiters);
    free(srv->conns);
    free(srv->pfds);
    free(srv);
    return st;
}

uint64_t ddp_store_server_requests(const ddp_store_server *srv) {
    return srv == NULL ? 0 : (uint64_t)atomic_load_explicit(&srv->requests,
                                                            memory_order_relaxed);
}

void ddp_store_server_stop(ddp_store_server *srv) {
    if (srv == NULL) return;
    atomic_store(&srv->stop, 1);
    ssize_t w = write(srv->wake[1], "x", 1);   /* the poll slice bounds it anyway */
    (void)w;
    pthread_join(srv->thread, NULL);
    for (size_t i = 0; i < srv->nconns; i++) conn_free(srv, srv->conns[i]);
    close(srv->lfd);
    close(srv->wake[0]);
    close(srv->wake[1]);
    ddp_kvmap_free(&srv->map);
    ddp_waitmap_free(&srv->waiters);
    free(srv->conns);
    free(srv->pfds);
    free(srv);
}
