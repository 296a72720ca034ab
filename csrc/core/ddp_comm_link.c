/* ddp_comm_link.c - a communicator's links, made on first use.
 *
 * Rendezvous (ddp_comm_boot.c) only publishes addresses; no connection is
 * made until an algorithm needs a peer (ddp_group_need -> ddp_comm_connect),
 * so a rank holds links to the peers its collectives talk to and nothing
 * else: a ring's two neighbours, the O(log size) partners of the small
 * collectives, the peers of its point-to-point calls.
 *
 * Either end of a pair may need the link first. The one that does dials the
 * other's data port, the process's one port (ddp_listen.h), which this group
 * is registered with for its life and whose acceptor threads serve it, so a
 * dial completes whatever the peer is doing. The hello, the reply and the PYDDP_AUTH_TOKEN handshake are those
 * of ddp_hello.h; then the same-host upgrade to shared memory
 * (ddp_comm_shm.c) and, with PYDDP_NSOCKS_PERPEER = n > 1, the dialer's n-1
 * extra connections, each authenticated like the first, over which the
 * pair's TCP link is striped.
 *
 * When both ends dial each other at once, the connection dialed by the
 * higher rank is kept: an acceptor that is itself dialing a higher peer
 * answers that peer's connection with DDP_HELLO_DUPLICATE, and so does one
 * that already has (or is completing) a link to the peer. A rank whose dial
 * is answered so waits for the peer's connection through its own acceptor.
 * So that the pair does not make that refused connection at all where both
 * ends need the link at the same step (ddp_group_need_mutual: the doubling,
 * ring and exchange algorithms), the lower rank first waits up to
 * MUTUAL_GRACE_MS for the higher one's dial and dials only if none came: at
 * 1,024 ranks a third of the dials of the first collective were refused.
 * Every decision is made under the root's mutex from the peer's slot
 * (DDP_SLOT_*), so the two ends always end up with the same connection.
 *
 * After the communicator broke, the acceptor answers DDP_HELLO_BROKEN, so a
 * peer that dials it fails at once with a message saying so; after destroy
 * the group is unregistered and a dial is answered DDP_HELLO_GONE (or
 * refused, once the process's last group is gone and the port closed).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ddp_comm_internal.h"
#include "ddp_hello.h"
#include "ddp_listen.h"
#include "ddp_sock.h"

/* A dial that gets no connection in this long fails (a blocked port, a dead
 * host), however far the collective's deadline is. */
#define DIAL_MS 20000
/* How long the lower rank of a pair that both need their link now waits for
 * the higher one's dial before it dials too: the peer is at the same step
 * of the same collective, usually within microseconds on one host and a
 * round trip across hosts; a peer that never dials (dead, or in another
 * call) is found out by this rank's own dial this much later. */
#define MUTUAL_GRACE_MS 200
/* Bound on each step the acceptor waits for a dialing peer (the hello, the
 * handshake, the shared-memory exchange): the dialer is at it right now. */
#define ACCEPT_STEP_MS 10000

/* What the acceptor holds of a TCP link whose extra connections are still
 * arriving (PYDDP_NSOCKS_PERPEER > 1). */
typedef struct ddp_pend {
    ddp_link *link;
    int fds[DDP_LINK_MAX_STREAMS];   /* fds[k]: extra connection k (1..n-1), -1 until there */
    int have;
} ddp_pend;

/* Under mu: make l root c's link to peer p and wake the waiters. */
static void publish_locked(ddp_comm *c, int p, ddp_link *l) {
    c->links[p] = l;
    c->slot[p] = DDP_SLOT_READY;
    c->nlinks++;
    if (c->broken) ddp_link_shutdown(l);   /* broken meanwhile: it must fail at once */
    pthread_cond_broadcast(&c->link_cv);
}

static void publish(ddp_comm *c, int p, ddp_link *l) {
    pthread_mutex_lock(&c->mu);
    publish_locked(c, p, l);
    pthread_mutex_unlock(&c->mu);
}

/* The acceptor failed peer p's connection (from state `from`): waiters and
 * later users of the link fail with st and why. */
static void slot_fail(ddp_comm *c, int p, int from, ddp_status st, const char *why) {
    pthread_mutex_lock(&c->mu);
    if (c->slot[p] == from) {
        c->slot[p] = DDP_SLOT_FAILED;
        c->slot_st = st;
        snprintf(c->slot_err, sizeof c->slot_err, "%s", why);
    }
    pthread_cond_broadcast(&c->link_cv);
    pthread_mutex_unlock(&c->mu);
}

/* ---- dialing -------------------------------------------------------------- */

/* Connect socket `stream` to peer p and pass the hello and the handshake.
 * *verdict is the acceptor's reply (DDP_HELLO_DUPLICATE: keep the peer's
 * own connection instead). */
static ddp_status dial_one(ddp_comm *c, int p, int stream, ddp_wait w, int *fd_out,
                           uint32_t *verdict) {
    char addr[DDP_ADDR_MAX], port[32], purpose[160];
    ddp_comm_line_field(c->lines[p], "addr", addr, sizeof addr);
    ddp_comm_line_field(c->lines[p], "port", port, sizeof port);
    ddp_wait cw = ddp_wait_for(DIAL_MS, w.abort);
    if (cw.deadline_ms > w.deadline_ms) cw.deadline_ms = w.deadline_ms;
    int fd = -1;
    *verdict = DDP_HELLO_OK;
    ddp_status st = ddp_sock_connect_peer(addr, atoi(port), cw, c->desc[p], &fd);
    if (st == DDP_OK) {
        ddp_hello h = {DDP_HELLO_MAGIC, DDP_WIRE_VERSION, c->link_tag, c->rank, c->size,
                       c->auth ? DDP_HELLO_HAS_TOKEN : 0u, (uint32_t)stream, p, 0};
        unsigned char raw[DDP_HELLO_BYTES];
        ddp_hello_encode(&h, raw);
        ddp_hello_purpose(c->link_tag, c->rank, p, c->size, stream, purpose, sizeof purpose);
        st = ddp_sock_send_all(fd, raw, sizeof raw, w, c->desc[p]);
        if (st == DDP_OK) st = ddp_hello_connect_v(fd, c->auth, purpose, w, c->desc[p], verdict);
        if (st != DDP_OK) close(fd);
    }
    if (st != DDP_OK) {
        if (stream == 0)
            return ddp_error_prefix(st, "rank %d connecting to %s: ", c->rank, c->desc[p]);
        return ddp_error_prefix(st, "rank %d opening its data connection %d to %s: ", c->rank,
                                stream + 1, c->desc[p]);
    }
    *fd_out = fd;
    return DDP_OK;
}

/* Dial peer p: its link in *out, or *dup = 1 when the peer keeps its own
 * connection to this rank instead (nothing made). */
static ddp_status dial(ddp_comm *c, int p, ddp_wait w, ddp_link **out, int *dup) {
    int fd = -1, fds[DDP_LINK_MAX_STREAMS];
    uint32_t verdict = 0;
    *out = NULL;
    *dup = 0;
    ddp_status st = dial_one(c, p, 0, w, &fd, &verdict);
    if (st != DDP_OK) {
        *dup = verdict == DDP_HELLO_DUPLICATE;
        return st;
    }
    ddp_link *l = ddp_link_tcp_new(fd, p, c->desc[p]);
    if (l == NULL) return ddp_error(DDP_ERR_NOMEM, "out of memory");
    st = ddp_comm_pair_shm(c, p, 0, &l, w);
    if (st == DDP_OK && c->nsocks > 1 && ddp_link_tcp_streams(l) > 0) {
        int made = 0;
        for (int k = 1; k < c->nsocks && st == DDP_OK; k++)
            if ((st = dial_one(c, p, k, w, &fds[k - 1], &verdict)) == DDP_OK) made++;
        if (st == DDP_OK) st = ddp_link_tcp_add_streams(l, fds, c->nsocks - 1); /* owns them */
        else
            for (int j = 0; j < made; j++) close(fds[j]);
    }
    if (st != DDP_OK) {
        ddp_link_free(l);
        return st;
    }
    *out = l;
    return DDP_OK;
}

ddp_status ddp_comm_connect(void *ctx, int p, int mutual, ddp_wait w, ddp_link **out) {
    ddp_comm *g = ctx, *c = g->root;
    const int q = ddp_comm_world_rank(g, p);
    ddp_status st = DDP_OK;
    /* Until then (mutual, q's dial would be kept) a free slot is q's to take. */
    const int64_t grace_end = mutual && q > c->rank ? ddp_now_ms() + MUTUAL_GRACE_MS : 0;
    *out = NULL;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        if (c->destroyed || c->links == NULL) {
            st = ddp_error(DDP_ERR_INVALID, "the process group was destroyed");
            break;
        }
        if (c->broken) {
            st = ddp_error(DDP_ERR_ABORTED, "%s", c->broken_msg);
            break;
        }
        int s = c->slot[q];
        if (s == DDP_SLOT_READY) {
            *out = c->links[q];
            break;
        }
        if (s == DDP_SLOT_FAILED) {
            st = ddp_error(c->slot_st, "rank %d: the connection from %s failed: %s", c->rank,
                           c->desc[q], c->slot_err);
            break;
        }
        const int grace = s == DDP_SLOT_NONE && grace_end && ddp_now_ms() < grace_end;
        if (s == DDP_SLOT_NONE && !grace) {
            c->slot[q] = DDP_SLOT_DIALING;
            pthread_mutex_unlock(&c->mu);
            ddp_link *l = NULL;
            int dup = 0;
            st = dial(c, q, w, &l, &dup);
            pthread_mutex_lock(&c->mu);
            c->dials++;
            if (st == DDP_OK) {
                publish_locked(c, q, l);
                *out = l;
                break;
            }
            if (!dup) {
                if (c->slot[q] == DDP_SLOT_DIALING) c->slot[q] = DDP_SLOT_NONE;
                break;
            }
            if (c->slot[q] == DDP_SLOT_DIALING) c->slot[q] = DDP_SLOT_WAITING;
            c->dials_refused++;
            st = DDP_OK;
            continue;
        }
        /* Someone is making it (this rank's other thread, or the acceptor), or
         * in the grace the peer is expected to. */
        if (ddp_wait_aborted(w)) {
            st = ddp_error(DDP_ERR_ABORTED, "rank %d: aborted while waiting for %s to connect",
                           c->rank, c->desc[q]);
            break;
        }
        if (ddp_wait_expired(w)) {
            st = ddp_error(DDP_ERR_TIMEOUT, "rank %d: %s did not connect to this rank before "
                           "the deadline", c->rank, c->desc[q]);
            break;
        }
        if (w.check) {   /* never under mu: the hook may run a signal handler */
            pthread_mutex_unlock(&c->mu);
            int stop = w.check(w.check_ctx);
            pthread_mutex_lock(&c->mu);
            if (stop) {
                st = ddp_error(DDP_ERR_ABORTED, "rank %d: interrupted while waiting for %s "
                               "to connect", c->rank, c->desc[q]);
                break;
            }
        }
        ddp_wait cw = w;
        if (grace && cw.deadline_ms > grace_end) cw.deadline_ms = grace_end;
        ddp_wait_cond(&c->link_cv, &c->mu, cw);
    }
    pthread_mutex_unlock(&c->mu);
    return st;
}

/* ---- the acceptor --------------------------------------------------------- */

/* A peer's first connection: decide under mu whether it becomes the pair's
 * link, then authenticate it and upgrade it like the dialer does. */
static void serve_first(ddp_comm *c, int fd, const ddp_hello *h, const char *addr) {
    const int p = h->rank;
    char purpose[160];
    pthread_mutex_lock(&c->mu);
    int s = c->slot[p];
    uint32_t refuse = c->broken ? DDP_HELLO_BROKEN
                    : s == DDP_SLOT_READY || s == DDP_SLOT_INCOMING ||
                      (s == DDP_SLOT_DIALING && p < c->rank) ? DDP_HELLO_DUPLICATE : 0;
    if (!refuse) c->slot[p] = DDP_SLOT_INCOMING;
    pthread_mutex_unlock(&c->mu);
    ddp_wait w = ddp_wait_for(ACCEPT_STEP_MS, &c->acceptor_stop);
    if (refuse) {
        ddp_hello_refuse(fd, refuse, w);
        close(fd);
        return;
    }
    ddp_hello_purpose(c->link_tag, p, c->rank, c->size, 0, purpose, sizeof purpose);
    ddp_status st = ddp_hello_accept(fd, h, c->auth, purpose, w, addr);
    if (st != DDP_OK) {
        /* Dropped (and logged): not proof that rank p itself failed, so the
         * slot is free again for its genuine connection. */
        close(fd);
        pthread_mutex_lock(&c->mu);
        if (c->slot[p] == DDP_SLOT_INCOMING) c->slot[p] = s == DDP_SLOT_FAILED ? DDP_SLOT_NONE : s;
        pthread_cond_broadcast(&c->link_cv);
        pthread_mutex_unlock(&c->mu);
        return;
    }
    ddp_link *l = ddp_link_tcp_new(fd, p, c->desc[p]);
    st = l ? ddp_comm_pair_shm(c, p, 1, &l, w) : ddp_error(DDP_ERR_NOMEM, "out of memory");
    if (st == DDP_OK && c->nsocks > 1 && ddp_link_tcp_streams(l) > 0) {
        ddp_pend *pd = calloc(1, sizeof *pd);
        if (pd) {
            pd->link = l;
            for (int k = 0; k < DDP_LINK_MAX_STREAMS; k++) pd->fds[k] = -1;
            pthread_mutex_lock(&c->mu);
            ddp_pend *old = c->pend[p];
            c->pend[p] = pd;
            pthread_cond_broadcast(&c->link_cv);   /* serve_extra may wait for it */
            pthread_mutex_unlock(&c->mu);
            free(old);
            return;   /* published once its extra connections are there */
        }
        st = ddp_error(DDP_ERR_NOMEM, "out of memory");
    }
    if (st != DDP_OK) {
        ddp_link_free(l);
        slot_fail(c, p, DDP_SLOT_INCOMING, DDP_ERR_CLOSED, ddp_last_error());
        return;
    }
    publish(c, p, l);
}

/* An extra connection (stream k > 0) of a link the acceptor is completing.
 * Several acceptor threads may serve one rank's connections at once: the
 * pending link is handled under mu, the handshake outside it. */
static void serve_extra(ddp_comm *c, int fd, const ddp_hello *h, const char *addr) {
    const int p = h->rank, k = (int)h->stream;
    char purpose[160];
    ddp_hello_purpose(c->link_tag, p, c->rank, c->size, k, purpose, sizeof purpose);
    ddp_wait w = ddp_wait_for(ACCEPT_STEP_MS, &c->acceptor_stop);
    pthread_mutex_lock(&c->mu);
    /* The peer dials its extra sockets once its first one was answered: the
     * thread serving that one may not have set the link aside yet. */
    while (c->pend[p] == NULL && c->slot[p] == DDP_SLOT_INCOMING && !ddp_wait_expired(w) &&
           !ddp_wait_aborted(w))
        ddp_wait_cond(&c->link_cv, &c->mu, w);
    int expected = c->pend[p] != NULL && c->pend[p]->fds[k] < 0;
    pthread_mutex_unlock(&c->mu);
    if (!expected || ddp_hello_accept(fd, h, c->auth, purpose, w, addr) != DDP_OK) {
        close(fd);   /* not expected (a stray or stale one), or not genuine */
        return;
    }
    pthread_mutex_lock(&c->mu);
    ddp_pend *pd = c->pend[p];
    if (pd == NULL || pd->fds[k] >= 0) {
        pthread_mutex_unlock(&c->mu);
        close(fd);
        return;
    }
    pd->fds[k] = fd;
    int complete = ++pd->have == c->nsocks - 1;
    if (complete) c->pend[p] = NULL;
    pthread_mutex_unlock(&c->mu);
    if (!complete) return;
    ddp_status st = ddp_link_tcp_add_streams(pd->link, pd->fds + 1, c->nsocks - 1);
    if (st == DDP_OK) publish(c, p, pd->link);
    else {
        ddp_link_free(pd->link);
        slot_fail(c, p, DDP_SLOT_INCOMING, DDP_ERR_CLOSED, ddp_last_error());
    }
    free(pd);
}

/* The listener's serve function (ddp_listen.h): a connection from a rank of
 * this group. */
static void serve(void *ctx, int fd, const ddp_hello *h, const char *addr) {
    ddp_comm *c = ctx;
    if (h->rank < 0 || h->rank >= c->size || h->rank == c->rank || h->size != c->size ||
        h->stream >= (uint32_t)c->nsocks) {
        close(fd);   /* not one of this group's ranks as it was made */
        return;
    }
    if (h->stream == 0) serve_first(c, fd, h, addr);
    else serve_extra(c, fd, h, addr);
}

ddp_status ddp_comm_listen(ddp_comm *c, const char *bind_host, int lo, int hi, int *port) {
    return ddp_listen_attach(c->link_tag, c->rank, bind_host, lo, hi, serve, c, port,
                             &c->lreg);
}

ddp_status ddp_comm_links_start(ddp_comm *c) {
    if (c->size < 2) return DDP_OK;
    c->slot = calloc((size_t)c->size, 1);
    c->pend = calloc((size_t)c->size, sizeof *c->pend);
    if (!c->slot || !c->pend) return ddp_error(DDP_ERR_NOMEM, "out of memory");
    ddp_listen_ready(c->lreg);
    return DDP_OK;
}

void ddp_comm_links_stop(ddp_comm *c) {
    atomic_store(&c->acceptor_stop, 1);   /* serve calls in progress end their waits */
    ddp_listen_detach(c->lreg);
    c->lreg = NULL;
    for (int p = 0; c->pend && p < c->size; p++) {
        ddp_pend *pd = c->pend[p];
        if (pd == NULL) continue;
        ddp_link_free(pd->link);
        for (int k = 1; k < DDP_LINK_MAX_STREAMS; k++)
            if (pd->fds[k] >= 0) close(pd->fds[k]);
        free(pd);
        c->pend[p] = NULL;
    }
}
