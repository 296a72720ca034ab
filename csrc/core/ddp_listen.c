/* ddp_listen.c - the process's data port and its acceptor threads (contract
 * in ddp_listen.h).
 *
 * Listeners live in one process-wide list under g_mu; each has its socket, a
 * wake pipe, up to ACCEPTORS threads and its registrations (hashed by tag and
 * rank: a process of a thousand thread-ranks finds each in O(1) under the
 * lock every acceptor takes). A listener starts with one acceptor; one that
 * takes a connection while no other is idle starts another (up to
 * ACCEPTORS), so handshakes still run side by side where connections come
 * together, and a process whose peers seldom dial (or never: most ranks of a
 * big world link to few others) does not pay for threads at init. An
 * acceptor blocks in poll() on the socket and the pipe's read end; a
 * connection is accepted by whichever thread gets it first (the others see
 * EAGAIN), its hello read (bounded: a peer that dialed sends it at once),
 * and handed to the registration its tag and rank name,
 * which is marked busy for the call so that detach can wait for it. A hello
 * of another wire version is turned away (said once per process); one naming
 * a registration that left is refused with DDP_HELLO_GONE at once, one
 * naming nothing registered when nothing turns up within DDP_LISTEN_READY_MS
 * (a group still agreeing on its round has not its final tag yet); a stray
 * or silent connection is closed.
 */
#include "ddp_listen.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ddp_auth.h"
#include "ddp_comm.h"
#include "ddp_sock.h"

#define ACCEPTORS 4                /* threads per listener: handshakes in parallel */
#define ACCEPTOR_STACK ((size_t)256 << 10)
#define HELLO_MS 5000              /* a dialer sends its hello at once */
#define GONE_KEPT 64               /* registrations that left, remembered per listener */
#define REG_BUCKETS 1024           /* hash chains of a listener's registrations (power of 2) */

typedef struct listener listener;

struct ddp_listen_reg {
    listener *l;
    uint64_t tag;
    int rank;
    ddp_listen_serve serve;
    void *ctx;
    int ready, gone;
    int serving;                   /* serve calls running (g_mu) */
    ddp_listen_reg *hnext;         /* next in its hash chain (g_mu) */
};

struct listener {
    int lfd, wake[2], port, lo, hi;
    char bind[256];
    atomic_int stop;
    pthread_t threads[ACCEPTORS];
    int nthreads;                  /* started (g_mu) */
    atomic_int idle;               /* acceptors not handling a connection */
    struct {
        uint64_t tag;
        int rank, set;
    } gone[GONE_KEPT];             /* the last registrations that left: refused at once */
    int gone_next;
    int dead;                      /* a forked child's copy: no socket, no thread */
    ddp_listen_reg *regs[REG_BUCKETS]; /* registrations by (tag, rank): a thousand ranks of
                                          one process (threads) dispatch in O(1) */
    int nregs;
    listener *next;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static listener *g_list;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static atomic_int g_wire_warned;

/* ---- fork: the child keeps no copy of any port ------------------------------ */

static void before_fork(void) { pthread_mutex_lock(&g_mu); }
static void after_fork_parent(void) { pthread_mutex_unlock(&g_mu); }

/* In the child: close every listener's sockets. Its threads are the
 * parent's (the child has none); its registrations stay, dead, for the
 * child's copies of the communicators to detach, and no new one joins it. */
static void after_fork_child(void) {
    for (listener *l = g_list; l; l = l->next) {
        if (l->dead) continue;
        close(l->lfd);
        close(l->wake[0]);
        close(l->wake[1]);
        l->lfd = l->wake[0] = l->wake[1] = -1;
        l->nthreads = 0;
        l->dead = 1;
    }
    pthread_mutex_unlock(&g_mu);
}

static void install_atfork(void) { pthread_atfork(before_fork, after_fork_parent, after_fork_child); }

/* ---- the acceptor ---------------------------------------------------------- */

/* Read a connecting peer's hello: 0 and h if it is a hello of this wire. */
static int read_hello(listener *l, int fd, ddp_hello *h) {
    unsigned char raw[DDP_HELLO_BYTES];
    ddp_wait w = ddp_wait_for(HELLO_MS, &l->stop);
    memset(raw, 0, sizeof raw);
    if (ddp_sock_recv_all(fd, raw, 24, w, "a connecting peer") != DDP_OK) return -1;
    ddp_hello_decode(raw, h);
    if (h->magic != DDP_HELLO_MAGIC) return -1;
    if (h->wire != DDP_WIRE_VERSION) {
        /* Unauthenticated, so it fails nothing: turned away, said once. */
        if (!atomic_exchange(&g_wire_warned, 1))
            fprintf(stderr, "pyddp: turned away a connection claiming to be rank %d that "
                    "speaks pyddp wire version %u (this process speaks %d); is an older "
                    "pyddp running on some node?\n", (int)h->rank, (unsigned)h->wire,
                    DDP_WIRE_VERSION);
        return -1;
    }
    if (ddp_sock_recv_all(fd, raw + 24, sizeof raw - 24, w, "a connecting peer") != DDP_OK)
        return -1;
    ddp_hello_decode(raw, h);
    return 0;
}

/* The hash chain of (tag, rank) in l. */
static ddp_listen_reg **chain(listener *l, uint64_t tag, int rank) {
    uint64_t x = (tag ^ ((uint64_t)(uint32_t)rank * 0x9E3779B97F4A7C15ull)) * 0xBF58476D1CE4E5B9ull;
    return &l->regs[(x >> 32) & (REG_BUCKETS - 1)];
}

/* Put r in / take r out of its listener's table under its current key;
 * with g_mu held. */
static void reg_link(ddp_listen_reg *r) {
    ddp_listen_reg **c = chain(r->l, r->tag, r->rank);
    r->hnext = *c;
    *c = r;
}

static void reg_unlink(ddp_listen_reg *r) {
    ddp_listen_reg **pp = chain(r->l, r->tag, r->rank);
    while (*pp != r) pp = &(*pp)->hnext;
    *pp = r->hnext;
}

/* The registration (tag, rank) of l, or NULL; with g_mu held. */
static ddp_listen_reg *find(listener *l, uint64_t tag, int rank) {
    for (ddp_listen_reg *r = *chain(l, tag, rank); r; r = r->hnext)
        if (r->tag == tag && r->rank == rank && !r->gone) return r;
    return NULL;
}

/* Whether (tag, rank) left l lately; with g_mu held. */
static int left(const listener *l, uint64_t tag, int rank) {
    for (int i = 0; i < GONE_KEPT; i++)
        if (l->gone[i].tag == tag && l->gone[i].rank == rank && l->gone[i].set) return 1;
    return 0;
}

/* Hand fd (hello h) to its registration once it is ready; refuse it when
 * it left, or when none is ready in time. A registration not there yet may
 * still be agreeing on its round (its tag is the round's: ddp_listen_retag). */
static void dispatch(listener *l, int fd, const ddp_hello *h) {
    char addr[DDP_ADDR_MAX + 16];
    ddp_wait w = ddp_wait_for(DDP_LISTEN_READY_MS, &l->stop);
    pthread_mutex_lock(&g_mu);
    ddp_listen_reg *r = find(l, h->tag, h->to);
    while ((r == NULL || !r->ready) && !left(l, h->tag, h->to) && !ddp_wait_expired(w) &&
           !ddp_wait_aborted(w)) {
        ddp_wait_cond(&g_cv, &g_mu, w);
        r = find(l, h->tag, h->to);
    }
    if (r == NULL || !r->ready) {
        pthread_mutex_unlock(&g_mu);
        ddp_hello_refuse(fd, DDP_HELLO_GONE, ddp_wait_for(1000, &l->stop));
        close(fd);
        return;
    }
    r->serving++;
    pthread_mutex_unlock(&g_mu);
    ddp_auth_peer_name(fd, addr, sizeof addr);
    r->serve(r->ctx, fd, h, addr);
    pthread_mutex_lock(&g_mu);
    r->serving--;
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
}

static void *acceptor_main(void *arg);

/* Start one more acceptor for l unless it has ACCEPTORS or is stopping; 0 or
 * an errno. Takes g_mu unless the caller holds it (locked). */
static int grow(listener *l, int locked) {
    if (!locked) pthread_mutex_lock(&g_mu);
    int e = 0;
    if (l->nthreads < ACCEPTORS && !atomic_load(&l->stop) && !l->dead) {
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setstacksize(&at, ACCEPTOR_STACK);
        atomic_fetch_add(&l->idle, 1);   /* before it runs: no second grow meanwhile */
        e = pthread_create(&l->threads[l->nthreads], &at, acceptor_main, l);
        if (e == 0) l->nthreads++;
        else atomic_fetch_sub(&l->idle, 1);
        pthread_attr_destroy(&at);
    }
    if (!locked) pthread_mutex_unlock(&g_mu);
    return e;
}

/* An acceptor: takes connections until l stops. While it handles one it is
 * not idle, and the last idle one to take a connection starts another. */
static void *acceptor_main(void *arg) {
    listener *l = arg;
    for (;;) {
        struct pollfd p[2] = {{l->lfd, POLLIN, 0}, {l->wake[0], POLLIN, 0}};
        if (poll(p, 2, -1) < 0 && errno != EINTR) usleep(10000);
        if (atomic_load(&l->stop)) break;
        if (!(p[0].revents & POLLIN)) continue;
        int fd = -1;
        ddp_status st = ddp_sock_accept(l->lfd, ddp_wait_for(0, &l->stop), &fd);
        if (st != DDP_OK) {
            if (st == DDP_ERR_SYS) usleep(50000);   /* e.g. EMFILE: do not spin */
            continue;
        }
        if (atomic_fetch_sub(&l->idle, 1) == 1) grow(l, 0);   /* the last idle one: start another */
        ddp_hello h;
        if (read_hello(l, fd, &h) == 0) dispatch(l, fd, &h);
        else close(fd);   /* a stray, stale or silent connection */
        atomic_fetch_add(&l->idle, 1);
    }
    return NULL;
}

/* ---- registrations ---------------------------------------------------------- */

/* Stop l's threads and close its sockets; l is off the list already. An
 * acceptor that grows l does so under g_mu and not once stop is set, so the
 * count read under g_mu after setting stop is every thread there is. */
static void listener_close(listener *l) {
    atomic_store(&l->stop, 1);
    pthread_mutex_lock(&g_mu);
    int n = l->nthreads;
    pthread_mutex_unlock(&g_mu);
    if (n > 0 && write(l->wake[1], "x", 1) < 0) { /* stop is seen on any wake */ }
    for (int i = 0; i < n; i++) pthread_join(l->threads[i], NULL);
    if (!l->dead) {
        close(l->lfd);
        close(l->wake[0]);
        close(l->wake[1]);
    }
    free(l);
}

/* A new listener for bind_host and lo..hi, its first acceptor started; not
 * listed. With g_mu held. */
static ddp_status listener_open(const char *bind_host, int lo, int hi, listener **out) {
    listener *l = calloc(1, sizeof *l);
    if (l == NULL) return ddp_error(DDP_ERR_NOMEM, "out of memory");
    l->wake[0] = l->wake[1] = -1;
    snprintf(l->bind, sizeof l->bind, "%s", bind_host ? bind_host : "");
    l->lo = lo;
    l->hi = hi;
    ddp_status st = ddp_sock_listen(l->bind, 0, lo, hi, &l->lfd, &l->port);
    if (st != DDP_OK) {
        free(l);
        return st;
    }
    if (pipe(l->wake) != 0) {
        st = ddp_error(DDP_ERR_SYS, "pipe: %s", strerror(errno));
        close(l->lfd);
        free(l);
        return st;
    }
    int e = grow(l, 1);
    if (e != 0) {
        st = ddp_error(DDP_ERR_SYS, "could not start the thread that accepts peers' "
                       "connections: %s", strerror(e));
        close(l->lfd);
        close(l->wake[0]);
        close(l->wake[1]);
        free(l);
        return st;
    }
    *out = l;
    return DDP_OK;
}

/* Whether l serves a registration asking for bind_host and lo..hi. */
static int fits(const listener *l, const char *bind_host, int lo, int hi) {
    if (l->dead || strcmp(l->bind, bind_host ? bind_host : "") != 0) return 0;
    return (lo == 0 && hi == 0) || (l->port >= lo && l->port <= hi);
}

ddp_status ddp_listen_attach(uint64_t tag, int rank, const char *bind_host, int lo, int hi,
                             ddp_listen_serve serve, void *ctx, int *port,
                             ddp_listen_reg **out) {
    pthread_once(&g_once, install_atfork);
    *out = NULL;
    ddp_listen_reg *r = calloc(1, sizeof *r);
    if (r == NULL) return ddp_error(DDP_ERR_NOMEM, "out of memory");
    *r = (ddp_listen_reg){.tag = tag, .rank = rank, .serve = serve, .ctx = ctx};
    pthread_mutex_lock(&g_mu);
    listener *l = g_list;
    while (l && !fits(l, bind_host, lo, hi)) l = l->next;
    ddp_status st = DDP_OK;
    if (l && find(l, tag, rank))
        st = ddp_error(DDP_ERR_INVALID, "rank %d of this process group is registered "
                       "already in this process", rank);
    if (st == DDP_OK && l == NULL && (st = listener_open(bind_host, lo, hi, &l)) == DDP_OK) {
        l->next = g_list;
        g_list = l;
    }
    if (st == DDP_OK) {
        r->l = l;
        reg_link(r);
        l->nregs++;
        *port = l->port;
        *out = r;
    }
    pthread_mutex_unlock(&g_mu);
    if (st != DDP_OK) free(r);
    return st;
}

void ddp_listen_retag(ddp_listen_reg *r, uint64_t tag) {
    if (r == NULL) return;
    pthread_mutex_lock(&g_mu);
    reg_unlink(r);
    r->tag = tag;
    reg_link(r);
    pthread_mutex_unlock(&g_mu);
}

void ddp_listen_ready(ddp_listen_reg *r) {
    pthread_mutex_lock(&g_mu);
    r->ready = 1;
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
}

void ddp_listen_detach(ddp_listen_reg *r) {
    if (r == NULL) return;
    listener *l = r->l, *closing = NULL;
    pthread_mutex_lock(&g_mu);
    r->gone = 1;
    pthread_cond_broadcast(&g_cv);   /* connections waiting for it are refused */
    while (r->serving > 0) pthread_cond_wait(&g_cv, &g_mu);
    reg_unlink(r);
    l->gone[l->gone_next].tag = r->tag;
    l->gone[l->gone_next].rank = r->rank;
    l->gone[l->gone_next].set = 1;
    l->gone_next = (l->gone_next + 1) % GONE_KEPT;
    if (--l->nregs == 0) {   /* its last one: off the list, closed below */
        listener **lp = &g_list;
        while (*lp != l) lp = &(*lp)->next;
        *lp = l->next;
        closing = l;
    }
    pthread_mutex_unlock(&g_mu);
    free(r);
    if (closing) listener_close(closing);
}
