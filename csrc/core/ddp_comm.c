/* ddp_comm.c - the communicator: rendezvous, peer connections, and the worker
 * thread that runs collectives in submission order (contract in ddp_comm.h).
 *
 * Rendezvous (ddp_comm_create):
 *   1. listen on a data port (ephemeral, or the first free one of a range);
 *   2. publish "<prefix>/rank/<r>" = one text line of key=value fields
 *      (version, wire version, advertised host and port, host identity);
 *   3. read every rank's line; any version difference fails on every rank
 *      with the full list of ranks, hosts and versions;
 *   4. connect to every lower rank and accept from every higher rank; the
 *      first bytes on a connection are a hello (magic, wire version, group
 *      tag, rank) so stray or stale connections are rejected;
 *   5. upgrade same-host pairs to shared memory where a transport for it is
 *      linked in (ddp_comm_shm.c decides), else keep TCP.
 * The worker thread owns the links and the group scratch memory; the caller
 * only touches the queue under the mutex.
 */
#include "ddp_comm.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ddp_comm_internal.h"
#include "ddp_sock.h"

#define HELLO_MAGIC 0x44445048u /* "HPDD" */

typedef struct hello {
    uint32_t magic;
    uint32_t wire;
    uint64_t tag;    /* hash of the group prefix */
    int32_t rank;
    int32_t size;
} hello;
_Static_assert(sizeof(hello) == 24, "hello is a fixed 24-byte wire struct");

struct ddp_work {
    ddp_coll_args args;
    int64_t timeout_ms;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done;
    int refs;           /* caller + worker + ddp_work_retain calls */
    ddp_status status;
    char msg[1024];
    ddp_work *next;
};

/* FNV-1a, used to tag connections with the group they belong to. */
static uint64_t hash_str(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

static size_t env_size(const char *name, size_t dflt) {
    const char *v = getenv(name);
    if (v == NULL || *v == '\0') return dflt;
    char *end;
    unsigned long long x = strtoull(v, &end, 10);
    return (*end == '\0' && x > 0) ? (size_t)x : dflt;
}

/* Extract field `name` from a "k=v;k=v" line into out. 0 if found. */
static int field(const char *line, const char *name, char *out, size_t outlen) {
    size_t nl = strlen(name);
    const char *p = line;
    while (p && *p) {
        if (strncmp(p, name, nl) == 0 && p[nl] == '=') {
            p += nl + 1;
            size_t i = 0;
            while (p[i] && p[i] != ';' && i + 1 < outlen) { out[i] = p[i]; i++; }
            out[i] = '\0';
            return 0;
        }
        p = strchr(p, ';');
        if (p) p++;
    }
    if (outlen) out[0] = '\0';
    return -1;
}

/* ---- work items ---------------------------------------------------- */

static void work_unref(ddp_work *w) {
    pthread_mutex_lock(&w->mu);
    int left = --w->refs;
    pthread_mutex_unlock(&w->mu);
    if (left == 0) {
        pthread_mutex_destroy(&w->mu);
        pthread_cond_destroy(&w->cv);
        free(w);
    }
}

static void work_finish(ddp_work *w, ddp_status st, const char *msg) {
    pthread_mutex_lock(&w->mu);
    w->status = st;
    snprintf(w->msg, sizeof w->msg, "%s", msg ? msg : "");
    w->done = 1;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    work_unref(w);
}

int ddp_work_done(ddp_work *w) {
    pthread_mutex_lock(&w->mu);
    int d = w->done;
    pthread_mutex_unlock(&w->mu);
    return d;
}

ddp_status ddp_work_wait(ddp_work *work, ddp_wait w) {
    pthread_mutex_lock(&work->mu);
    while (!work->done) {
        if (ddp_wait_aborted(w)) {
            pthread_mutex_unlock(&work->mu);
            return ddp_error(DDP_ERR_ABORTED, "wait aborted");
        }
        if (ddp_wait_expired(w)) {
            pthread_mutex_unlock(&work->mu);
            return ddp_error(DDP_ERR_TIMEOUT, "%s did not finish before the wait's deadline",
                             ddp_coll_name(work->args.kind));
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        int slice = ddp_wait_slice(w);
        ts.tv_nsec += (long)slice * 1000000L;
        ts.tv_sec += ts.tv_nsec / 1000000000L;
        ts.tv_nsec %= 1000000000L;
        pthread_cond_timedwait(&work->cv, &work->mu, &ts);
    }
    ddp_status st = work->status;
    if (st != DDP_OK) ddp_set_error_text(work->msg);
    pthread_mutex_unlock(&work->mu);
    return st;
}

const char *ddp_work_error(const ddp_work *work) { return work->msg; }

void ddp_work_retain(ddp_work *work) {
    pthread_mutex_lock(&work->mu);
    work->refs++;
    pthread_mutex_unlock(&work->mu);
}

void ddp_work_release(ddp_work *work) {
    if (work) work_unref(work);
}

/* ---- breaking the communicator ------------------------------------- */

/* Mark broken (first reason wins) and shut every link down so that peers
 * blocked on this rank see EOF at once. Caller holds no lock. */
static void comm_break(ddp_comm *c, const char *reason) {
    pthread_mutex_lock(&c->mu);
    if (!c->broken) {
        c->broken = 1;
        snprintf(c->broken_msg, sizeof c->broken_msg, "%s", reason);
    }
    pthread_mutex_unlock(&c->mu);
    atomic_store(&c->abort_flag, 1);
    for (int r = 0; r < c->size; r++)
        if (c->links[r]) ddp_link_shutdown(c->links[r]);
}

void ddp_comm_abort(ddp_comm *c, const char *reason) {
    char msg[1200];
    snprintf(msg, sizeof msg, "process group on rank %d was aborted: %s", c->rank,
             reason && *reason ? reason : "abort requested");
    comm_break(c, msg);
}

/* ---- worker thread -------------------------------------------------- */

/* Copy the broken message under the lock; returns whether the group is broken. */
static int copy_broken(ddp_comm *c, char *buf, size_t len) {
    pthread_mutex_lock(&c->mu);
    int b = c->broken;
    if (b) snprintf(buf, len, "%s", c->broken_msg);
    pthread_mutex_unlock(&c->mu);
    return b;
}

static void worker_idle(ddp_comm *c) {
    pthread_mutex_lock(&c->mu);
    c->running = 0;
    pthread_mutex_unlock(&c->mu);
}

static void *worker_main(void *arg) {
    ddp_comm *c = arg;
    for (;;) {
        pthread_mutex_lock(&c->mu);
        while (c->head == NULL && !c->stopping) pthread_cond_wait(&c->cv, &c->mu);
        ddp_work *w = c->head;
        if (w == NULL) { pthread_mutex_unlock(&c->mu); break; }
        c->head = w->next;
        if (c->head == NULL) c->tail = NULL;
        c->running = 1;
        int broken = c->broken;
        char bmsg[sizeof c->broken_msg];
        if (broken) memcpy(bmsg, c->broken_msg, sizeof bmsg);
        pthread_mutex_unlock(&c->mu);

        if (broken) {
            char msg[1400];
            snprintf(msg, sizeof msg,
                     "rank %d: %s cannot run: the process group is broken by an earlier "
                     "error: %s", c->rank, ddp_coll_name(w->args.kind), bmsg);
            work_finish(w, DDP_ERR_ABORTED, msg);
            worker_idle(c);
            continue;
        }
        ddp_wait wt = ddp_wait_for(w->timeout_ms, &c->abort_flag);
        ddp_status st = ddp_coll_run(&c->group, &w->args, wt);
        if (st == DDP_OK) {
            work_finish(w, DDP_OK, NULL);
            worker_idle(c);
            continue;
        }
        /* The algorithms' messages already name the collective, the rank and
         * the peer; add what the user can do about a timeout. */
        char msg[1400];
        if (st == DDP_ERR_TIMEOUT)
            snprintf(msg, sizeof msg, "%s (timeout %.1f s). A peer may be stuck, dead, or "
                     "calling a different collective; the timeout is set by "
                     "init_process_group(timeout=...) or PYDDP_TIMEOUT.", ddp_last_error(),
                     w->timeout_ms / 1000.0);
        else if (st == DDP_ERR_ABORTED && copy_broken(c, bmsg, sizeof bmsg))
            snprintf(msg, sizeof msg, "rank %d: %s aborted: %s", c->rank,
                     ddp_coll_name(w->args.kind), bmsg);
        else
            snprintf(msg, sizeof msg, "%s", ddp_last_error());
        comm_break(c, msg);
        work_finish(w, st, msg);
        worker_idle(c);
    }
    return NULL;
}

ddp_status ddp_comm_submit(ddp_comm *c, const ddp_coll_args *a, int64_t timeout_ms,
                           ddp_work **out) {
    ddp_status st = ddp_coll_validate(&c->group, a);
    if (st != DDP_OK) return ddp_error_prefix(st, "rank %d: %s: ", c->rank, ddp_coll_name(a->kind));
    pthread_mutex_lock(&c->mu);
    if (c->broken) {
        st = ddp_error(DDP_ERR_ABORTED, "rank %d: %s cannot run: the process group is broken "
                       "by an earlier error: %s", c->rank, ddp_coll_name(a->kind), c->broken_msg);
        pthread_mutex_unlock(&c->mu);
        return st;
    }
    pthread_mutex_unlock(&c->mu);
    ddp_work *w = calloc(1, sizeof *w);
    if (w == NULL) return ddp_error(DDP_ERR_NOMEM, "out of memory queuing a collective");
    w->args = *a;
    w->timeout_ms = timeout_ms < 0 ? c->timeout_ms : timeout_ms;
    w->refs = 2;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    pthread_mutex_lock(&c->mu);
    if (c->tail) c->tail->next = w; else c->head = w;
    c->tail = w;
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
    *out = w;
    return DDP_OK;
}

int ddp_comm_rank(const ddp_comm *c) { return c->rank; }
int ddp_comm_size(const ddp_comm *c) { return c->size; }
const char *ddp_comm_peer_desc(const ddp_comm *c, int r) { return c->desc[r]; }
const char *ddp_comm_host_id(const ddp_comm *c, int r) { return c->host_ids[r]; }

/* ---- rendezvous ------------------------------------------------------ */

/* Publish this rank's line and read everyone's into c->lines. */
static ddp_status exchange_lines(ddp_comm *c, const ddp_comm_config *cfg, ddp_store *store,
                                 int port, ddp_wait w) {
    char key[600], line[1200];
    snprintf(line, sizeof line, "ver=%s;wire=%d;addr=%s;port=%d;host=%s", cfg->version,
             DDP_WIRE_VERSION, cfg->advertise_host, port, cfg->host_id);
    snprintf(key, sizeof key, "%s/rank/%d", cfg->prefix, cfg->rank);
    ddp_status st = ddp_store_set(store, key, strlen(key), line, strlen(line), w);
    if (st != DDP_OK) return ddp_error_prefix(st, "rank %d publishing its address: ", c->rank);
    for (int r = 0; r < c->size; r++) {
        void *val = NULL;
        size_t vlen = 0;
        snprintf(key, sizeof key, "%s/rank/%d", cfg->prefix, r);
        st = ddp_store_get(store, key, strlen(key), &val, &vlen, w);
        if (st != DDP_OK) {
            if (st == DDP_ERR_TIMEOUT)
                return ddp_error(st, "rank %d: rank %d did not join the process group within "
                                 "%.1f s (waiting for store key %s on %s). Check that all %d "
                                 "ranks were started with the same WORLD_SIZE and store "
                                 "address.", c->rank, r, cfg->timeout_ms / 1000.0, key,
                                 ddp_store_peer(store), c->size);
            return ddp_error_prefix(st, "rank %d reading rank %d's address: ", c->rank, r);
        }
        c->lines[r] = malloc(vlen + 1);
        if (c->lines[r] == NULL) { free(val); return ddp_error(DDP_ERR_NOMEM, "out of memory"); }
        memcpy(c->lines[r], val, vlen);
        c->lines[r][vlen] = '\0';
        free(val);
    }
    return DDP_OK;
}

/* Every rank compares every rank's version with its own; all fail alike. */
static ddp_status check_versions(ddp_comm *c) {
    char v0[128], w0[32], vr[128], wr[32], h[256], list[2048] = "";
    field(c->lines[0], "ver", v0, sizeof v0);
    field(c->lines[0], "wire", w0, sizeof w0);
    int bad = 0;
    for (int r = 0; r < c->size; r++) {
        field(c->lines[r], "ver", vr, sizeof vr);
        field(c->lines[r], "wire", wr, sizeof wr);
        if (strcmp(vr, v0) != 0 || strcmp(wr, w0) != 0) bad = 1;
    }
    if (!bad) return DDP_OK;
    size_t used = 0;
    for (int r = 0; r < c->size && used < sizeof list - 200; r++) {
        field(c->lines[r], "ver", vr, sizeof vr);
        field(c->lines[r], "wire", wr, sizeof wr);
        field(c->lines[r], "addr", h, sizeof h);
        used += (size_t)snprintf(list + used, sizeof list - used, "%srank %d on %s: pyddp %s "
                                 "(wire %s)", r ? "; " : "", r, h, vr, wr);
    }
    return ddp_error(DDP_ERR_VERSION, "ranks run different pyddp versions: %s. Install the "
                     "same pyddp version on every node (pip install pyddp==<version>).", list);
}

static ddp_status accept_peers(ddp_comm *c, int lfd, uint64_t tag, ddp_wait w) {
    int need = c->size - 1 - c->rank;
    while (need > 0) {
        int fd = -1;
        ddp_status st = ddp_sock_accept(lfd, w, &fd);
        if (st != DDP_OK)
            return ddp_error_prefix(st, "rank %d waiting for %d higher rank(s) to connect: ",
                                    c->rank, need);
        /* A peer sends its hello right after connecting; a connection that stays
         * silent (a port scanner, a health check) is dropped after a few seconds
         * rather than holding up the rendezvous until its deadline. */
        hello h;
        ddp_wait hw = ddp_wait_for(5000, w.abort);
        if (hw.deadline_ms > w.deadline_ms) hw.deadline_ms = w.deadline_ms;
        st = ddp_sock_recv_all(fd, &h, sizeof h, hw, "a connecting peer");
        if (st != DDP_OK || h.magic != HELLO_MAGIC || h.tag != tag || h.rank <= c->rank ||
            h.rank >= c->size || h.size != c->size || c->links[h.rank] != NULL) {
            close(fd);  /* a stray, stale or silent connection: not ours, ignore it */
            if (st == DDP_ERR_ABORTED || (st == DDP_ERR_TIMEOUT && ddp_wait_expired(w)))
                return st;
            continue;
        }
        c->links[h.rank] = ddp_link_tcp_new(fd, h.rank, c->desc[h.rank]);
        if (c->links[h.rank] == NULL) return ddp_error(DDP_ERR_NOMEM, "out of memory");
        need--;
    }
    return DDP_OK;
}

static ddp_status connect_peers(ddp_comm *c, uint64_t tag, ddp_wait w) {
    char addr[DDP_ADDR_MAX], port[32];
    for (int r = 0; r < c->rank; r++) {
        field(c->lines[r], "addr", addr, sizeof addr);
        field(c->lines[r], "port", port, sizeof port);
        int fd = -1;
        ddp_status st = ddp_sock_connect(addr, atoi(port), w, &fd);
        if (st != DDP_OK)
            return ddp_error_prefix(st, "rank %d connecting to rank %d: ", c->rank, r);
        hello h = {HELLO_MAGIC, DDP_WIRE_VERSION, tag, c->rank, c->size};
        st = ddp_sock_send_all(fd, &h, sizeof h, w, c->desc[r]);
        if (st != DDP_OK) { close(fd); return st; }
        c->links[r] = ddp_link_tcp_new(fd, r, c->desc[r]);
        if (c->links[r] == NULL) return ddp_error(DDP_ERR_NOMEM, "out of memory");  /* fd closed */
    }
    return DDP_OK;
}

static ddp_status comm_alloc(const ddp_comm_config *cfg, ddp_comm **out) {
    ddp_comm *c = calloc(1, sizeof *c);
    if (c == NULL) return ddp_error(DDP_ERR_NOMEM, "out of memory");
    c->rank = cfg->rank;
    c->size = cfg->size;
    c->timeout_ms = cfg->timeout_ms;
    c->links = calloc((size_t)cfg->size, sizeof *c->links);
    c->lines = calloc((size_t)cfg->size, sizeof *c->lines);
    c->desc = calloc((size_t)cfg->size, sizeof *c->desc);
    c->host_ids = calloc((size_t)cfg->size, sizeof *c->host_ids);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    *out = c;
    if (!c->links || !c->lines || !c->desc || !c->host_ids)
        return ddp_error(DDP_ERR_NOMEM, "out of memory");
    return DDP_OK;
}

ddp_status ddp_comm_create(const ddp_comm_config *cfg, ddp_store *store, ddp_comm **out) {
    *out = NULL;
    if (cfg->size < 1 || cfg->rank < 0 || cfg->rank >= cfg->size)
        return ddp_error(DDP_ERR_INVALID, "invalid rank %d for world size %d", cfg->rank,
                         cfg->size);
    ddp_comm *c = NULL;
    ddp_status st;
    int lfd = -1, port = 0;
    DDP_CHECK(comm_alloc(cfg, &c), fail);
    ddp_wait w = ddp_wait_for(cfg->timeout_ms, cfg->abort);
    if (cfg->size > 1) {
        st = ddp_sock_listen(cfg->bind_host, 0, cfg->port_lo, cfg->port_hi, &lfd, &port);
        if (st != DDP_OK) { ddp_error_prefix(st, "rank %d opening its data port: ", c->rank); goto fail; }
    }
    DDP_CHECK(exchange_lines(c, cfg, store, port, w), fail);
    DDP_CHECK(check_versions(c), fail);
    for (int r = 0; r < c->size; r++) {
        char addr[DDP_ADDR_MAX], p[32], hp[DDP_ADDR_MAX + 40], host[512];
        field(c->lines[r], "addr", addr, sizeof addr);
        field(c->lines[r], "port", p, sizeof p);
        field(c->lines[r], "host", host, sizeof host);
        ddp_sock_format_hostport(addr, atoi(p), hp, sizeof hp);
        c->desc[r] = malloc(strlen(hp) + 32);
        c->host_ids[r] = strdup(host);
        if (!c->desc[r] || !c->host_ids[r]) { st = ddp_error(DDP_ERR_NOMEM, "out of memory"); goto fail; }
        sprintf(c->desc[r], "rank %d (%s)", r, hp);
    }
    uint64_t tag = hash_str(cfg->prefix);
    DDP_CHECK(connect_peers(c, tag, w), fail);
    DDP_CHECK(accept_peers(c, lfd, tag, w), fail);
    if (lfd >= 0) { close(lfd); lfd = -1; }
    DDP_CHECK(ddp_comm_upgrade_links(c, w), fail);

    c->group.rank = c->rank;
    c->group.size = c->size;
    c->group.links = c->links;
    c->group.small_bytes = env_size("PYDDP_SMALL_BYTES", 64 * 1024);
    c->group.chunk_bytes = env_size("PYDDP_CHUNK_BYTES", 256 << 10);
    if (pthread_create(&c->worker, NULL, worker_main, c) != 0) {
        st = ddp_error(DDP_ERR_SYS, "could not start the communication thread: %s", strerror(errno));
        goto fail;
    }
    c->has_worker = 1;
    *out = c;
    return DDP_OK;
fail:
    if (lfd >= 0) close(lfd);
    ddp_comm_destroy(c);
    return st;
}

void ddp_comm_destroy(ddp_comm *c) {
    if (c == NULL) return;
    if (c->has_worker) {
        pthread_mutex_lock(&c->mu);
        int pending = c->head != NULL || c->running;
        pthread_mutex_unlock(&c->mu);
        /* Work still queued or running when the group is destroyed would wait for
         * peers until its deadline: break the group so it fails at once (and peers
         * waiting on this rank see the connection close). */
        if (pending) ddp_comm_abort(c, "destroy_process_group() was called with work pending");
        pthread_mutex_lock(&c->mu);
        c->stopping = 1;
        pthread_cond_signal(&c->cv);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->worker, NULL);
    }
    for (int r = 0; c->links && r < c->size; r++) ddp_link_free(c->links[r]);
    for (int r = 0; c->lines && r < c->size; r++) free(c->lines[r]);
    for (int r = 0; c->desc && r < c->size; r++) free(c->desc[r]);
    for (int r = 0; c->host_ids && r < c->size; r++) free(c->host_ids[r]);
    free(c->links);
    free(c->lines);
    free(c->desc);
    free(c->host_ids);
    ddp_group_release_scratch(&c->group);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c);
}
