/* ddp_comm_link.c - a communicator's links, made on first use.
 *
 * Rendezvous (ddp_comm_boot.c) only publishes addresses; no connection is
 * made until an algorithm needs a peer (ddp_group_need -> ddp_comm_connect),
 * so a rank holds links to the peers its collectives talk to and nothing
 * else: a ring's two neighbours, the O(log size) partners of the small
 * collectives, the peers of its point-to-point calls.
 *
 * Either end of a pair may need the link first. The one that does dials the
 * other's data port, which stays open for the communicator's life and is
 * served by an acceptor thread, so a dial completes whatever the peer is
 * doing. The hello, the reply and the PYDDP_AUTH_TOKEN handshake are those
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
 * Every decision is made under the root's mutex from the peer's slot
 * (DDP_SLOT_*), so the two ends always end up with the same connection.
 *
 * After the communicator broke, the acceptor answers DDP_HELLO_BROKEN, so a
 * peer that dials it fails at once with a message saying so; after destroy
 * the port is closed and a dial is refused.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ddp_comm_internal.h"
#include "ddp_hello.h"
#include "ddp_sock.h"

/* A dial that gets no connection in this long fails (a blocked port, a dead
 * host), however far the collective's deadline is. */
#define DIAL_MS 20000
/* Bound on each step the acceptor waits for a dialing peer (the hello, the
 * handshake, the shared-memory exchange): the dialer is at it right now. */
#define ACCEPT_STEP_MS 10000
#define ACCEPTOR_STACK ((size_t)256 << 10)

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
                       c->auth ? DDP_HELLO_HAS_TOKEN : 0u, (uint32_t)stream};
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

ddp_status ddp_comm_connect(void *ctx, int p, ddp_wait w, ddp_link **out) {
    ddp_comm *g = ctx, *c = g->root;
    const int q = ddp_comm_world_rank(g, p);
    ddp_status st = DDP_OK;
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
        if (s == DDP_SLOT_NONE) {
            c->slot[q] = DDP_SLOT_DIALING;
            pthread_mutex_unlock(&c->mu);
            ddp_link *l = NULL;
            int dup = 0;
            st = dial(c, q, w, &l, &dup);
            pthread_mutex_lock(&c->mu);
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
            st = DDP_OK;
            continue;
        }
        /* Someone is making it: this rank's other thread, or the acceptor. */
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
        ddp_wait_cond(&c->link_cv, &c->mu, w);
    }
    pthread_mutex_unlock(&c->mu);
    return st;
}

/* ---- the acceptor --------------------------------------------------------- */

/* Read a connecting peer's hello; 0 and h if it is one of this group's. */
static int read_hello(ddp_comm *c, int fd, ddp_hello *h) {
    unsigned char raw[DDP_HELLO_BYTES];
    ddp_wait hw = ddp_wait_for(5000, &c->acceptor_stop);
    memset(raw, 0, sizeof raw);
    /* The first 24 bytes are laid out alike in every wire version. */
    if (ddp_sock_recv_all(fd, raw, 24, hw, "a connecting peer") != DDP_OK) return -1;
    ddp_hello_decode(raw, h);
    if (h->magic != DDP_HELLO_MAGIC || h->tag != c->link_tag) return -1;
    if (h->wire != DDP_WIRE_VERSION) {
        /* Another wire version (the version check at rendezvous normally
         * catches this first). Unauthenticated, so it fails nothing: it is
         * turned away, and said once. */
        if (!c->wire_warned) {
            c->wire_warned = 1;
            fprintf(stderr, "pyddp: rank %d: turned away a connection claiming to be rank %d "
                    "that speaks pyddp wire version %u (this rank speaks %d); is an older "
                    "pyddp running on some node?\n", c->rank, (int)h->rank,
                    (unsigned)h->wire, DDP_WIRE_VERSION);
        }
        return -1;
    }
    if (ddp_sock_recv_all(fd, raw + 24, sizeof raw - 24, hw, "a connecting peer") != DDP_OK)
        return -1;
    ddp_hello_decode(raw, h);
    if (h->rank < 0 || h->rank >= c->size || h->rank == c->rank || h->size != c->size ||
        h->stream >= (uint32_t)c->nsocks)
        return -1;
    return 0;
}

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
            free(c->pend[p]);
            c->pend[p] = pd;
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

/* An extra connection (stream k > 0) of a link the acceptor is completing. */
static void serve_extra(ddp_comm *c, int fd, const ddp_hello *h, const char *addr) {
    const int p = h->rank, k = (int)h->stream;
    ddp_pend *pd = c->pend[p];
    char purpose[160];
    if (pd == NULL || pd->fds[k] >= 0) {   /* not expected: a stray or stale one */
        close(fd);
        return;
    }
    ddp_hello_purpose(c->link_tag, p, c->rank, c->size, k, purpose, sizeof purpose);
    ddp_wait w = ddp_wait_for(ACCEPT_STEP_MS, &c->acceptor_stop);
    if (ddp_hello_accept(fd, h, c->auth, purpose, w, addr) != DDP_OK) {
        close(fd);
        return;
    }
    pd->fds[k] = fd;
    if (++pd->have < c->nsocks - 1) return;
    c->pend[p] = NULL;
    ddp_status st = ddp_link_tcp_add_streams(pd->link, pd->fds + 1, c->nsocks - 1);
    if (st == DDP_OK) publish(c, p, pd->link);
    else {
        ddp_link_free(pd->link);
        slot_fail(c, p, DDP_SLOT_INCOMING, DDP_ERR_CLOSED, ddp_last_error());
    }
    free(pd);
}

static void *acceptor_main(void *arg) {
    ddp_comm *c = arg;
    while (!atomic_load(&c->acceptor_stop)) {
        int fd = -1;
        ddp_status st = ddp_sock_accept(c->lfd, ddp_wait_for(-1, &c->acceptor_stop), &fd);
        if (st != DDP_OK) {
            if (st != DDP_ERR_ABORTED && st != DDP_ERR_TIMEOUT) usleep(50000);  /* e.g. EMFILE */
            continue;
        }
        ddp_hello h;
        char addr[DDP_ADDR_MAX + 16];
        if (read_hello(c, fd, &h) != 0) {   /* a stray, stale or silent connection */
            close(fd);
            continue;
        }
        ddp_auth_peer_name(fd, addr, sizeof addr);
        if (h.stream == 0) serve_first(c, fd, &h, addr);
        else serve_extra(c, fd, &h, addr);
    }
    return NULL;
}

ddp_status ddp_comm_links_start(ddp_comm *c) {
    if (c->size < 2) return DDP_OK;
    c->slot = calloc((size_t)c->size, 1);
    c->pend = calloc((size_t)c->size, sizeof *c->pend);
    if (!c->slot || !c->pend) return ddp_error(DDP_ERR_NOMEM, "out of memory");
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setstacksize(&at, ACCEPTOR_STACK);
    int e = pthread_create(&c->acceptor, &at, acceptor_main, c);
    pthread_attr_destroy(&at);
    if (e != 0)
        return ddp_error(DDP_ERR_SYS, "could not start the thread that accepts peers' "
                         "connections: %s", strerror(e));
    c->has_acceptor = 1;
    return DDP_OK;
}

void ddp_comm_links_stop(ddp_comm *c) {
    if (c->has_acceptor) {
        atomic_store(&c->acceptor_stop, 1);
        pthread_join(c->acceptor, NULL);
        c->has_acceptor = 0;
    }
    if (c->lfd >= 0) close(c->lfd);
    c->lfd = -1;
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
