/* ddp_comm.c - the communicator's lifetimes: creation (the worker thread),
 * breaking on failure, subgroups, reference counts, destroy, the flight record
 * and progress, and the process-group interface (ddp_pg.h) over all of it.
 * Contract in ddp_comm.h; the work queue and the worker thread's loop are in
 * ddp_comm_queue.c, the rendezvous and peer connections in ddp_comm_boot.c.
 *
 * Every queued work holds a reference on the group it runs on, and every
 * subgroup one on its root, so a destroy from another thread (or a signal
 * handler) while work is queued or running never frees memory in use: it
 * breaks the engine, joins the worker, frees the links, and leaves the rest
 * to the last release.
 */
#include "ddp_comm.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ddp_comm_internal.h"
#include "ddp_settings.h"

/* ---- breaking the communicator ------------------------------------- */

/* Mark broken (first reason wins) and shut every link down so that peers
 * blocked on this rank see EOF at once. Caller holds no lock. */
void ddp_comm_break(ddp_comm *c, const char *reason) {
    c = c->root;
    pthread_mutex_lock(&c->mu);
    if (!c->broken) {
        c->broken = 1;
        snprintf(c->broken_msg, sizeof c->broken_msg, "%s", reason);
    }
    atomic_store(&c->abort_flag, 1);
    /* Under mu: destroy frees the links under the same lock. */
    for (int r = 0; c->links && r < c->size; r++)
        if (c->links[r]) ddp_link_shutdown(c->links[r]);
    pthread_cond_broadcast(&c->link_cv);   /* threads waiting for a peer's connection */
    pthread_mutex_unlock(&c->mu);
}

void ddp_comm_abort(ddp_comm *c, const char *reason) {
    char msg[1200];
    snprintf(msg, sizeof msg, "process group on rank %d was aborted: %s", c->root->rank,
             reason && *reason ? reason : "abort requested");
    ddp_comm_break(c, msg);
}


int ddp_comm_rank(const ddp_comm *c) { return c->rank; }
const char *ddp_comm_prefix(const ddp_comm *c) { return c->root->prefix; }
uint64_t ddp_comm_tag(const ddp_comm *c) { return c->group.tag; }
int ddp_comm_size(const ddp_comm *c) { return c->size; }
int ddp_comm_world_rank(const ddp_comm *c, int r) { return c->members ? c->members[r] : r; }
const char *ddp_comm_peer_desc(const ddp_comm *c, int r) {
    return c->root->desc[ddp_comm_world_rank(c, r)];
}
const char *ddp_comm_transport(ddp_comm *c, int r) {
    if (r == c->rank) return "self";
    ddp_comm *root = c->root;
    pthread_mutex_lock(&root->mu);
    ddp_link *l = root->links ? root->links[ddp_comm_world_rank(c, r)] : NULL;
    const char *name = l ? l->ops->name : root->destroyed || !root->links ? "closed" : "none";
    pthread_mutex_unlock(&root->mu);
    return name;
}

int ddp_comm_links_made(ddp_comm *c) {
    ddp_comm *root = c->root;
    pthread_mutex_lock(&root->mu);
    int n = root->nlinks;
    pthread_mutex_unlock(&root->mu);
    return n;
}

int ddp_comm_dials(ddp_comm *c, int *refused) {
    ddp_comm *root = c->root;
    pthread_mutex_lock(&root->mu);
    int n = root->dials;
    *refused = root->dials_refused;
    pthread_mutex_unlock(&root->mu);
    return n;
}

const char *ddp_comm_host_id(const ddp_comm *c, int r) {
    return c->root->host_ids[ddp_comm_world_rank(c, r)];
}

/* ---- creation, subgroups, lifetimes ----------------------------------- */

/* The algorithms' view of c: its links, tag, tuning settings and which of
 * its ranks share a host (from the root's rendezvous). */
static ddp_status group_init(ddp_comm *c, uint64_t tag) {
    c->group.rank = c->rank;
    c->group.size = c->size;
    c->group.links = c->members ? c->links : c->glinks;   /* made on first use */
    c->group.connect = ddp_comm_connect;
    c->group.connect_ctx = c;
    c->group.tag = tag;
    c->group.small_bytes = (size_t)ddp_setting_int("PYDDP_SMALL_BYTES");
    c->group.chunk_bytes = (size_t)ddp_setting_int("PYDDP_CHUNK_BYTES");
    const char **ids = calloc((size_t)c->size, sizeof *ids);
    if (ids == NULL) return ddp_error(DDP_ERR_NOMEM, "out of memory");
    for (int r = 0; r < c->size; r++) ids[r] = c->root->host_ids[ddp_comm_world_rank(c, r)];
    ddp_status st = ddp_group_set_layout(&c->group, ids);
    free(ids);
    return st;
}

static ddp_status comm_alloc(const ddp_comm_config *cfg, ddp_comm **out) {
    ddp_comm *c = calloc(1, sizeof *c);
    if (c == NULL) return ddp_error(DDP_ERR_NOMEM, "out of memory");
    c->rank = cfg->rank;
    c->size = cfg->size;
    c->timeout_ms = cfg->timeout_ms;
    c->root = c;
    atomic_init(&c->refs, 1);
    atomic_init(&c->queued, 0);
    atomic_init(&c->acceptor_stop, 0);
    c->links = calloc((size_t)cfg->size, sizeof *c->links);
    c->glinks = calloc((size_t)cfg->size, sizeof *c->glinks);
    c->lines = calloc((size_t)cfg->size, sizeof *c->lines);
    c->desc = calloc((size_t)cfg->size, sizeof *c->desc);
    c->host_ids = calloc((size_t)cfg->size, sizeof *c->host_ids);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    pthread_cond_init(&c->link_cv, NULL);
    *out = c;
    if (!c->links || !c->glinks || !c->lines || !c->desc || !c->host_ids)
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
    DDP_CHECK(comm_alloc(cfg, &c), fail);
    DDP_CHECK(ddp_comm_bootstrap(c, cfg, store), fail);
    DDP_CHECK(group_init(c, ddp_comm_hash(c->prefix)), fail);
    DDP_CHECK(ddp_comm_links_start(c), fail);
    if (pthread_create(&c->worker, NULL, ddp_comm_worker_main, c) != 0) {
        st = ddp_error(DDP_ERR_SYS, "could not start the communication thread: %s", strerror(errno));
        goto fail;
    }
    c->has_worker = 1;
    *out = c;
    return DDP_OK;
fail:
    ddp_comm_destroy(c);
    return st;
}

ddp_status ddp_comm_subgroup(ddp_comm *parent, int n, const int *ranks, uint64_t tag,
                             ddp_comm **out) {
    *out = NULL;
    ddp_comm *root = parent->root;
    int me = -1;
    for (int i = 0; i < n; i++) {
        if (ranks[i] < 0 || ranks[i] >= parent->size || (i > 0 && ranks[i] <= ranks[i - 1]))
            return ddp_error(DDP_ERR_INVALID, "subgroup ranks must be distinct, increasing and "
                             "within 0..%d (got %d at position %d)", parent->size - 1, ranks[i], i);
        if (ranks[i] == parent->rank) me = i;
    }
    if (n < 1 || me < 0)
        return ddp_error(DDP_ERR_INVALID, "rank %d is not a member of the subgroup it is "
                         "creating", parent->rank);
    ddp_comm *c = calloc(1, sizeof *c);
    if (c == NULL) return ddp_error(DDP_ERR_NOMEM, "out of memory");
    c->members = calloc((size_t)n, sizeof *c->members);
    c->links = calloc((size_t)n, sizeof *c->links);
    if (!c->members || !c->links) {
        free(c->members);
        free(c->links);
        free(c);
        return ddp_error(DDP_ERR_NOMEM, "out of memory");
    }
    pthread_mutex_lock(&root->mu);
    int dead = root->stopping || parent->destroyed;
    for (int i = 0; !dead && i < n; i++)   /* links: made or fetched on first use */
        c->members[i] = ddp_comm_world_rank(parent, ranks[i]);
    pthread_mutex_unlock(&root->mu);
    if (dead) {
        free(c->members);
        free(c->links);
        free(c);
        return ddp_error(DDP_ERR_INVALID, "the parent process group was destroyed");
    }
    c->rank = me;
    c->size = n;
    c->timeout_ms = parent->timeout_ms;
    c->root = root;
    atomic_init(&c->refs, 1);
    ddp_comm_retain(root);
    ddp_status st = group_init(c, tag);
    if (st != DDP_OK) {
        ddp_comm_release(c);
        return st;
    }
    *out = c;
    return DDP_OK;
}

void ddp_comm_set_algo(ddp_comm *c, int algo) { c->group.algo = algo; }

void ddp_comm_retain(ddp_comm *c) {
    if (c) atomic_fetch_add(&c->refs, 1);
}

/* Free what a root or subgroup owns; the engine is already stopped. */
static void comm_free(ddp_comm *c) {
    ddp_group_release_scratch(&c->group);
    ddp_group_free_layout(&c->group);
    if (c->members) {           /* a subgroup: links and strings are borrowed */
        ddp_comm *root = c->root;
        free(c->members);
        free(c->links);
        free(c);
        ddp_comm_release(root);
        return;
    }
    ddp_comm_links_stop(c);   /* the acceptor, if a failed create left it running */
    for (int r = 0; c->links && r < c->size; r++) ddp_link_free(c->links[r]);
    for (int r = 0; c->lines && r < c->size; r++) free(c->lines[r]);
    for (int r = 0; c->desc && r < c->size; r++) free(c->desc[r]);
    for (int r = 0; c->host_ids && r < c->size; r++) free(c->host_ids[r]);
    free(c->links);
    free(c->glinks);
    free(c->slot);
    free(c->pend);
    free(c->lines);
    free(c->desc);
    free(c->host_ids);
    ddp_store_release(c->stall_store);
    free(c->stall_prefix);
    free(c->prefix);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    pthread_cond_destroy(&c->link_cv);
    free(c);
}

void ddp_comm_release(ddp_comm *c) {
    if (c && atomic_fetch_sub(&c->refs, 1) == 1) comm_free(c);
}

void ddp_comm_destroy(ddp_comm *c) {
    if (c == NULL) return;
    ddp_comm *root = c->root;
    if (c != root) {
        pthread_mutex_lock(&root->mu);
        c->destroyed = 1;
        pthread_cond_broadcast(&root->link_cv);   /* wait_used's waiters */
        pthread_mutex_unlock(&root->mu);
        ddp_comm_release(c);
        return;
    }
    if (c->has_worker) {
        pthread_mutex_lock(&c->mu);
        int pending = c->head != NULL || c->running;
        /* Called from inside an inline run on this thread (a signal handler
         * run by its check hook): the run still uses the links, so it
         * finishes the destroy once it returns (ddp_comm_run_inline). */
        int defer = c->running && c->inline_run && pthread_equal(c->inline_thread, pthread_self());
        if (defer) c->destroy_deferred = 1;
        pthread_mutex_unlock(&c->mu);
        /* Work still queued or running when the group is destroyed would wait for
         * peers until its deadline: break the group so it fails at once (and peers
         * waiting on this rank see the connection close). */
        if (pending) ddp_comm_abort(c, "destroy_process_group() was called with work pending");
        if (defer) return;
        pthread_mutex_lock(&c->mu);
        c->stopping = 1;
        pthread_cond_signal(&c->cv);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->worker, NULL);
        c->has_worker = 0;
    }
    /* The data port closes (later dials are refused), then the links go
     * (peers see the close); subgroups and works that still hold references
     * only read the strings and fail their submissions. */
    ddp_comm_links_stop(c);
    pthread_mutex_lock(&c->mu);
    c->stopping = 1;
    c->destroyed = 1;
    pthread_cond_broadcast(&c->link_cv);   /* wait_used's waiters */
    for (int r = 0; c->links && r < c->size; r++) {
        ddp_link_free(c->links[r]);
        c->links[r] = NULL;
    }
    pthread_mutex_unlock(&c->mu);
    ddp_comm_release(c);
}

/* ---- flight record and progress -------------------------------------- */

size_t ddp_comm_flight(ddp_comm *c, ddp_flight_entry *out, size_t max) {
    ddp_comm *root = c->root;
    pthread_mutex_lock(&root->mu);
    size_t n = ddp_flight_copy(&root->flight, out, max);
    pthread_mutex_unlock(&root->mu);
    return n;
}

void ddp_comm_progress(ddp_comm *c, uint64_t *submitted, uint64_t *completed,
                       ddp_flight_entry *last_done) {
    ddp_comm *root = c->root;
    pthread_mutex_lock(&root->mu);
    *submitted = c->submitted;
    *completed = c->completed;
    *last_done = c->last_done;
    pthread_mutex_unlock(&root->mu);
}

int ddp_comm_pending(ddp_comm *c) {
    ddp_comm *root = c->root;
    pthread_mutex_lock(&root->mu);
    int n = root->destroyed ? 0 : atomic_load(&root->queued) + root->running;
    pthread_mutex_unlock(&root->mu);
    return n;
}

void ddp_comm_set_stall_store(ddp_comm *c, ddp_store *s, const char *prefix) {
    ddp_comm *root = c->root;
    char *p = strdup(prefix ? prefix : "");
    ddp_store_retain(s);
    pthread_mutex_lock(&root->mu);
    ddp_store *old = root->stall_store;
    char *oldp = root->stall_prefix;
    root->stall_store = s;
    root->stall_prefix = p;
    pthread_mutex_unlock(&root->mu);
    ddp_store_release(old);
    free(oldp);
}

/* ---- the process-group interface (ddp_pg.h) ---------------------------- */

static ddp_status pg_submit(void *impl, const ddp_coll_args *a, const ddp_pg_opts *o,
                            void **work) {
    ddp_work *w = NULL;
    ddp_status st = ddp_comm_submit_opts(impl, a, o, &w);
    *work = w;
    return st;
}
static int pg_work_done(void *w) { return ddp_work_done(w); }
static ddp_status pg_work_wait(void *w, ddp_wait wt) { return ddp_work_wait(w, wt); }
static const char *pg_work_error(void *w) { return ddp_work_error(w); }
static void pg_work_retain(void *w) { ddp_work_retain(w); }
static void pg_work_release(void *w) { ddp_work_release(w); }
static void pg_abort(void *impl, const char *reason) { ddp_comm_abort(impl, reason); }
static void pg_retain(void *impl) { ddp_comm_retain(impl); }
static void pg_release(void *impl) { ddp_comm_release(impl); }
static void pg_destroy(void *impl, ddp_wait w) { (void)w; ddp_comm_destroy(impl); }
static int pg_rank(const void *impl) { return ddp_comm_rank(impl); }
static int pg_size(const void *impl) { return ddp_comm_size(impl); }
static int pg_device(const void *impl) { (void)impl; return -1; }
static ddp_status pg_run_inline(void *impl, const ddp_coll_args *a, int64_t timeout_ms,
                                const ddp_pg_interrupt *intr, int *taken) {
    return ddp_comm_run_inline(impl, a, timeout_ms, intr ? intr->check : NULL,
                               intr ? intr->ctx : NULL, taken);
}

static uint64_t pg_tag(const void *impl) { return ddp_comm_tag(impl); }
static const char *pg_peer_desc(const void *impl, int r) { return ddp_comm_peer_desc(impl, r); }
static const char *pg_host_id(const void *impl, int r) { return ddp_comm_host_id(impl, r); }
static const char *pg_transport(void *impl, int r) { return ddp_comm_transport(impl, r); }
static size_t pg_flight(void *impl, ddp_flight_entry *out, size_t max) {
    return ddp_comm_flight(impl, out, max);
}
static void pg_progress(void *impl, uint64_t *submitted, uint64_t *completed,
                        ddp_flight_entry *last_done) {
    ddp_comm_progress(impl, submitted, completed, last_done);
}
static void pg_set_stall_store(void *impl, ddp_store *s, const char *prefix) {
    ddp_comm_set_stall_store(impl, s, prefix);
}

static int pg_pending(void *impl) { return ddp_comm_pending(impl); }

/* ddp_pg_info.wait_used: on the root's link_cv, which record_locked
 * broadcasts on the first call, and break and destroy on theirs. */
static int pg_wait_used(void *impl, ddp_wait w) {
    ddp_comm *g = impl, *c = g->root;
    pthread_mutex_lock(&c->mu);
    int done;
    while (!(done = c->used || c->broken || c->stopping || c->destroyed || g->destroyed) &&
           !ddp_wait_expired(w) && !ddp_wait_aborted(w))
        ddp_wait_cond(&c->link_cv, &c->mu, w);
    pthread_mutex_unlock(&c->mu);
    return done;
}

static const ddp_pg_info comm_pg_info = {
    .tag = pg_tag, .peer_desc = pg_peer_desc, .host_id = pg_host_id,
    .transport = pg_transport, .flight = pg_flight, .progress = pg_progress,
    .set_stall_store = pg_set_stall_store, .pending = pg_pending, .wait_used = pg_wait_used,
};

static const ddp_pg_ops comm_pg_ops = {
    .name = "cpu", .submit = pg_submit, .work_done = pg_work_done, .work_wait = pg_work_wait,
    .work_error = pg_work_error, .work_publish = NULL, .work_drained = NULL,
    .work_retain = pg_work_retain, .work_release = pg_work_release, .abort = pg_abort,
    .retain = pg_retain, .release = pg_release, .destroy = pg_destroy, .rank = pg_rank,
    .size = pg_size, .device = pg_device, .notifies = 1,
    .run_inline = pg_run_inline, .info = &comm_pg_info,
};

ddp_pg ddp_comm_pg(ddp_comm *c) {
    ddp_pg pg = {&comm_pg_ops, c};
    return pg;
}
