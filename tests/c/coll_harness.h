/* coll_harness.h - threads as ranks for the collective tests.
 *
 * A "world" is N ranks in one process: every pair of ranks is joined by a
 * socketpair(AF_UNIX, SOCK_STREAM) wrapped in a TCP link, and each rank has
 * its own ddp_group. hrun() runs one function per rank on its own thread
 * and joins them. hcoll() validates and runs one collective the way the
 * communicator does, including shutting the rank's links down after a
 * failure so that its peers fail fast instead of waiting for the deadline.
 */
#ifndef COLL_HARNESS_H
#define COLL_HARNESS_H

#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ddp_coll.h"
#include "testutil.h"

#ifndef H_MAXR
#define H_MAXR 4 /* a test may define more before including this */
#endif
#define H_DEADLINE_MS 60000 /* generous: a hang fails here, never stalls CI */

typedef struct hworld {
    int n;
    ddp_link *links[H_MAXR][H_MAXR]; /* links[r][p]: rank r's end towards p */
    ddp_group g[H_MAXR];
    pthread_barrier_t bar;           /* for comparing results across ranks */
    void *shared[H_MAXR];
} hworld;

/* Validation of a must fail with want and a message containing text. */
static inline void expect_invalid(const ddp_group *g, ddp_coll_args a, ddp_status want,
                                  const char *text) {
    T_STATUS(ddp_coll_validate(g, &a), want);
    if (!strstr(ddp_last_error(), text)) {
        fprintf(stderr, "message \"%s\" lacks \"%s\"\n", ddp_last_error(), text);
        exit(1);
    }
}

static inline void hworld_init(hworld *w, int n, size_t small_bytes, size_t chunk_bytes) {
    memset(w, 0, sizeof *w);
    w->n = n;
    for (int i = 0; i < n; i++) {
        for (int j = i + 1; j < n; j++) {
            int sv[2];
            T_ASSERT(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
            char desc[64];
            for (int k = 0; k < 2; k++)
                T_ASSERT(fcntl(sv[k], F_SETFL, fcntl(sv[k], F_GETFL) | O_NONBLOCK) == 0);
            snprintf(desc, sizeof desc, "rank %d (socketpair)", j);
            T_ASSERT((w->links[i][j] = ddp_link_tcp_new(sv[0], j, desc)) != NULL);
            snprintf(desc, sizeof desc, "rank %d (socketpair)", i);
            T_ASSERT((w->links[j][i] = ddp_link_tcp_new(sv[1], i, desc)) != NULL);
        }
    }
    for (int r = 0; r < n; r++) {
        w->g[r].rank = r;
        w->g[r].size = n;
        w->g[r].links = w->links[r];
        w->g[r].small_bytes = small_bytes;
        w->g[r].chunk_bytes = chunk_bytes;
    }
    T_ASSERT(pthread_barrier_init(&w->bar, NULL, (unsigned)n) == 0);
}

/* Stripe every link of w over k more socketpairs (ddp_link_tcp_add_streams),
 * as PYDDP_NSOCKS_PERPEER = k + 1 does; k at most 7. */
static inline void hworld_stripe(hworld *w, int k) {
    for (int i = 0; i < w->n; i++) {
        for (int j = i + 1; j < w->n; j++) {
            int fa[8], fb[8];
            for (int s = 0; s < k; s++) {
                int sv[2];
                T_ASSERT(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
                fa[s] = sv[0];
                fb[s] = sv[1];
            }
            T_OK(ddp_link_tcp_add_streams(w->links[i][j], fa, k));
            T_OK(ddp_link_tcp_add_streams(w->links[j][i], fb, k));
        }
    }
}

static inline void hworld_free(hworld *w) {
    for (int r = 0; r < w->n; r++) {
        ddp_group_release_scratch(&w->g[r]);
        for (int p = 0; p < w->n; p++) ddp_link_free(w->links[r][p]);
    }
    pthread_barrier_destroy(&w->bar);
}

/* Shut every link of rank r down, as ddp_comm does after a failure. */
static inline void hbreak(hworld *w, int r) {
    for (int p = 0; p < w->n; p++) ddp_link_shutdown(w->links[r][p]);
}

static inline ddp_status hcoll_wait(hworld *w, int r, const ddp_coll_args *a, ddp_wait wt) {
    ddp_status st = ddp_coll_validate(&w->g[r], a);
    if (st == DDP_OK) st = ddp_coll_run(&w->g[r], a, wt);
    if (st != DDP_OK) hbreak(w, r);
    return st;
}

static inline ddp_status hcoll(hworld *w, int r, const ddp_coll_args *a) {
    return hcoll_wait(w, r, a, ddp_wait_for(H_DEADLINE_MS, NULL));
}

/* A link wrapper for fault and transport tests. It forwards to an inner
 * link, lets at most `budget` bytes be sent and then shuts the inner link
 * down (as if the process behind it died mid-send), and with `nofd` hides
 * the descriptor so the drivers must spin, as for shared memory. */
typedef struct hwrap {
    ddp_link *inner;
    size_t budget;
    int nofd;
} hwrap;

static inline ddp_status hwrap_send(ddp_link *l, const void *buf, size_t n, size_t *done) {
    hwrap *h = l->impl;
    size_t before = *done, lim = n - *done > h->budget ? *done + h->budget : n;
    if (h->budget == 0) { /* spent: die, and let the inner link report it */
        ddp_link_shutdown(h->inner);
        lim = n;
    }
    ddp_status st = h->inner->ops->send_some(h->inner, buf, lim, done);
    h->budget -= *done - before;
    return st;
}
static inline ddp_status hwrap_recv(ddp_link *l, void *buf, size_t n, size_t *done) {
    hwrap *h = l->impl;
    return h->inner->ops->recv_some(h->inner, buf, n, done);
}
static inline int hwrap_fd(ddp_link *l) {
    hwrap *h = l->impl;
    return h->nofd ? -1 : h->inner->ops->wait_fd(h->inner);
}
static inline void hwrap_shutdown(ddp_link *l) { ddp_link_shutdown(((hwrap *)l->impl)->inner); }
static inline void hwrap_destroy(ddp_link *l) {
    hwrap *h = l->impl;
    ddp_link_free(h->inner);
    free(h);
}
static const ddp_link_ops hwrap_ops = {.name = "wrap", .send_some = hwrap_send,
                                       .recv_some = hwrap_recv, .wait_fd = hwrap_fd,
                                       .shutdown = hwrap_shutdown, .destroy = hwrap_destroy};

/* Wrap inner (taken over) and return the wrapper, same peer and desc. */
static inline ddp_link *hwrap_new(ddp_link *inner, size_t budget, int nofd) {
    ddp_link *l = calloc(1, sizeof *l);
    hwrap *h = calloc(1, sizeof *h);
    T_ASSERT(l && h);
    *h = (hwrap){inner, budget, nofd};
    *l = *inner;
    l->ops = &hwrap_ops;
    l->impl = h;
    return l;
}

typedef void (*hrank_fn)(hworld *w, int rank, void *arg);

typedef struct hthread {
    hworld *w;
    int rank;
    hrank_fn fn;
    void *arg;
} hthread;

static inline void *hthread_main(void *p) {
    hthread *t = p;
    t->fn(t->w, t->rank, t->arg);
    return NULL;
}

/* Run fn(w, rank, arg) for every rank, one thread each, and join them. */
static inline void hrun(hworld *w, hrank_fn fn, void *arg) {
    pthread_t tid[H_MAXR];
    hthread t[H_MAXR];
    for (int r = 0; r < w->n; r++) {
        t[r] = (hthread){w, r, fn, arg};
        T_ASSERT(pthread_create(&tid[r], NULL, hthread_main, &t[r]) == 0);
    }
    for (int r = 0; r < w->n; r++) T_ASSERT(pthread_join(tid[r], NULL) == 0);
}

#endif
