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
 */
#include "ddp_store_server_int.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ddp_sock.h"

#define READ_CHUNK ((size_t)64 << 10)
#define READ_BUDGET ((size_t)4 << 20)     /* bytes read per connection per round */
#define OUT_HIGH_WATER ((size_t)4 << 20)  /* stop parsing while this much is queued */
#define MAX_BUFFERED ((size_t)256 << 20)  /* one request may not exceed this */
#define ACCEPTS_PER_ROUND 64

/* Close and free one connection (its pending WAIT goes with it). */
static void conn_free(ddp_store_conn *c) {
    if (c == NULL) return;
    if (c->fd >= 0) close(c->fd);
    ddp_wbuf_free(&c->in);
    ddp_wbuf_free(&c->out);
    ddp_store_conn_clear_wait(c);
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

/* Read what the connection has (up to a budget, for fairness). Returns 0,
 * or -1 if the peer closed/reset or sent more than one request may hold;
 * bytes already buffered are still parsed by the caller in either case. */
static int conn_read(ddp_store_conn *c) {
    size_t total = 0;
    while (total < READ_BUDGET) {
        if (ddp_wbuf_size(&c->in) > MAX_BUFFERED) return -1;
        if (ddp_wbuf_reserve(&c->in, READ_CHUNK) < 0) return -1;
        size_t room = c->in.cap - c->in.len, got = 0;
        ddp_status st = ddp_sock_recv_some(c->fd, c->in.p + c->in.len, room, &got);
        c->in.len += got;
        total += got;
        if (st != DDP_OK) return -1;
        if (got < room) break;   /* the socket is drained for now */
    }
    return 0;
}

/* Parse and run every complete request in c's input. Returns -1 if the
 * connection must be dropped (bad request or out of memory). */
static int conn_process(ddp_store_server *srv, ddp_store_conn *c) {
    while (ddp_wbuf_size(&c->out) < OUT_HIGH_WATER && ddp_wbuf_size(&c->in) > 0) {
        size_t used = 0;
        int r = ddp_store_handle(srv, c, ddp_wbuf_data(&c->in), ddp_wbuf_size(&c->in),
                                 &used);
        if (r < 0) return -1;
        if (r == 0) break;   /* incomplete: wait for more bytes */
        ddp_wbuf_consume(&c->in, used);
    }
    return c->out.oom ? -1 : 0;
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

/* Free dropped connections and close the gaps in the array. */
static void reap(ddp_store_server *srv) {
    size_t j = 0;
    for (size_t i = 0; i < srv->nconns; i++) {
        if (srv->conns[i]->dead)
            conn_free(srv->conns[i]);
        else
            srv->conns[j++] = srv->conns[i];
    }
    srv->nconns = j;
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
        if (ddp_wbuf_size(&c->out) < OUT_HIGH_WATER) ev |= POLLIN;
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
        if (re & (POLLIN | POLLHUP | POLLERR)) gone = conn_read(c) < 0;
        /* Requests that fully arrived before a disconnect still take effect,
         * and a client that only half-closed still gets their replies. */
        if (conn_process(srv, c) < 0 || gone) c->dead = 1;
        if (gone) conn_flush(c);
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
    if (ddp_kvmap_init(&srv->map) < 0 || ddp_store_grow_conns(srv) < 0) {
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
    free(srv->conns);
    free(srv->pfds);
    free(srv);
    return st;
}

void ddp_store_server_stop(ddp_store_server *srv) {
    if (srv == NULL) return;
    atomic_store(&srv->stop, 1);
    ssize_t w = write(srv->wake[1], "x", 1);   /* the poll slice bounds it anyway */
    (void)w;
    pthread_join(srv->thread, NULL);
    for (size_t i = 0; i < srv->nconns; i++) conn_free(srv->conns[i]);
    close(srv->lfd);
    close(srv->wake[0]);
    close(srv->wake[1]);
    ddp_kvmap_free(&srv->map);
    free(srv->conns);
    free(srv->pfds);
    free(srv);
}
