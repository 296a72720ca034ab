/* ddp_comm_queue.c - the communicator's work queue: work items and their waits,
 * submission (validation on the caller's thread, then the queue), the worker
 * thread that runs queued collectives in submission order, the inline run of
 * a small collective on the caller's thread when nothing is queued, and the one
 * way both finish a run (failure messages, breaking the communicator, the
 * stall and failure announcements, the flight record and progress counters).
 * Contract in ddp_comm.h; the lifetimes and the process-group table are in
 * ddp_comm.c.
 *
 * The engine runs one collective at a time: `running` (root->mu) is set by
 * whoever runs one, the worker or an inline caller, and the worker does not
 * dequeue while it is set, so queued and inline collectives never overlap
 * and run in the order this process called them.
 */
#include "ddp_comm.h"

#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp_comm_internal.h"
#include "ddp_forensics.h"

/* Hand-off spins. A small collective on shared memory takes a few microseconds,
 * while a futex wake-up of a parked thread costs about as much again on each side
 * (submit -> worker, worker -> caller). So the caller spins this long on its work's
 * done flag before parking, and the idle worker this long for new work before
 * sleeping on the queue's condition variable. Short pause rounds first, then
 * sched_yield, so that on a host with fewer cores than spinning threads the one
 * with real work (the peer's worker, say) gets the core. Bounded: after this the
 * existing deadline- and abort-checked waits run unchanged. */
#define WAIT_SPIN_US 50
#define WORKER_SPIN_US 100
#define SPIN_PAUSES 64

/* Spin until *flag is nonzero or until_us (ddp_now_us scale) passes; returns
 * whether the flag was seen set. Never blocks, touches no lock. */
static int spin_on(const atomic_int *flag, int64_t until_us) {
    for (unsigned n = 0;; n++) {
        if (atomic_load_explicit(flag, memory_order_acquire)) return 1;
        if (n < SPIN_PAUSES) {
            ddp_cpu_relax();
            continue;
        }
        if (ddp_now_us() >= until_us) return 0;
        sched_yield();
    }
}

/* One collective to run, queued or inline. */
typedef struct comm_run {
    ddp_coll_args args;
    ddp_comm *comm;     /* the group it runs on (referenced by the work, or by the
                         * inline caller) */
    int64_t timeout_ms;
    uint64_t flight_id;
} comm_run;

struct ddp_work {
    comm_run run;
    void (*notify)(void *);
    void *notify_ctx;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_int done;    /* set under mu (release) once status and msg are final */
    int refs;           /* caller + worker + ddp_work_retain calls */
    ddp_status status;
    char msg[1024];
    ddp_work *next;
};

/* ---- work items ---------------------------------------------------- */

static void work_unref(ddp_work *w) {
    pthread_mutex_lock(&w->mu);
    int left = --w->refs;
    pthread_mutex_unlock(&w->mu);
    if (left == 0) {
        ddp_comm_release(w->run.comm);
        pthread_mutex_destroy(&w->mu);
        pthread_cond_destroy(&w->cv);
        free(w);
    }
}

static void work_finish(ddp_work *w, ddp_status st, const char *msg) {
    pthread_mutex_lock(&w->mu);
    w->status = st;
    snprintf(w->msg, sizeof w->msg, "%s", msg ? msg : "");
    atomic_store_explicit(&w->done, 1, memory_order_release);
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    if (w->notify) w->notify(w->notify_ctx);
    work_unref(w);
}

int ddp_work_done(ddp_work *w) {
    return atomic_load_explicit(&w->done, memory_order_acquire);
}

ddp_status ddp_work_wait(ddp_work *work, ddp_wait w) {
    /* Spin first (bounded by the wait's own deadline too): most small
     * collectives end before a park and wake-up would. */
    if (ddp_wait_remaining(w) > 0 && !ddp_wait_aborted(w))   /* >= 1 ms > the spin */
        spin_on(&work->done, ddp_now_us() + WAIT_SPIN_US);
    pthread_mutex_lock(&work->mu);
    while (!work->done) {
        if (ddp_wait_aborted(w)) {
            pthread_mutex_unlock(&work->mu);
            return ddp_error(DDP_ERR_ABORTED, "wait aborted");
        }
        if (ddp_wait_expired(w)) {
            pthread_mutex_unlock(&work->mu);
            return ddp_error(DDP_ERR_TIMEOUT, "%s did not finish before the wait's deadline",
                             ddp_coll_name(work->run.args.kind));
        }
        ddp_wait_cond(&work->cv, &work->mu, w);
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

/* ---- worker thread -------------------------------------------------- */

/* Copy the broken message under the lock; returns whether the group is broken. */
static int copy_broken(ddp_comm *c, char *buf, size_t len) {
    pthread_mutex_lock(&c->mu);
    int b = c->broken;
    if (b) snprintf(buf, len, "%s", c->broken_msg);
    pthread_mutex_unlock(&c->mu);
    return b;
}

static int is_p2p(ddp_coll_kind k) {
    return k == DDP_COLL_SEND || k == DDP_COLL_RECV || k == DDP_COLL_P2P_BATCH;
}

/* Record r's end in the flight record and its group's progress; the engine
 * is idle again (the worker, waiting while an inline run held it, is woken).
 * Before a work is finished, so a waiter woken by that sees both. */
static void run_done(ddp_comm *c, const comm_run *r, ddp_status st) {
    ddp_comm *g = r->comm;
    pthread_mutex_lock(&c->mu);
    ddp_flight_ended(&c->flight, r->flight_id, st);
    if (!is_p2p(r->args.kind)) {
        g->completed++;
        ddp_flight_get(&c->flight, r->flight_id, &g->last_done);
    }
    /* the worker waits while an inline run holds the engine: wake it only if
     * it has something to do (a wake-up per call would cost what inline saves) */
    if (c->inline_run && (c->head != NULL || c->stopping)) pthread_cond_signal(&c->cv);
    c->running = 0;
    c->inline_run = 0;
    pthread_mutex_unlock(&c->mu);
}

/* This rank's failure, kept in the stall store so that a rank that only saw
 * a peer close its connection can say what really went wrong, and where:
 * "/<prefix>/broken/<rank>" holds a BROKEN record (ddp_forensics.h) for every
 * failing rank (pyddp/_forensics.py follows who lost whom from there), and
 * "/<prefix>/broken" the same for the first, set by whoever ADDs
 * "/<prefix>/broken_n" to 1 first. Called before the links are shut down, so
 * that a peer that fails because this rank closed its end finds the record
 * already there; bounded by ANNOUNCE_MS in all, so an unreachable store
 * delays the shutdown by at most that. */
#define ANNOUNCE_MS 1000
static void failure_announce(ddp_comm *c, const char *what) {
    if (c->stall_store == NULL) return;
    char key[600], val[1600];
    int64_t i = 0;
    ddp_wait wt = ddp_wait_for(ANNOUNCE_MS, NULL);
    snprintf(val, sizeof val, DDP_FX_BROKEN_FORMAT, c->rank, what);
    snprintf(key, sizeof key, "/%s/" DDP_FX_BROKEN "/%d", c->stall_prefix, c->rank);
    if (ddp_store_set(c->stall_store, key, strlen(key), val, strlen(val), wt) != DDP_OK)
        return;
    snprintf(key, sizeof key, "/%s/" DDP_FX_BROKEN_N, c->stall_prefix);
    if (ddp_store_add(c->stall_store, key, strlen(key), 1, &i, wt) != DDP_OK || i != 1)
        return;
    snprintf(key, sizeof key, "/%s/" DDP_FX_BROKEN, c->stall_prefix);
    ddp_store_set(c->stall_store, key, strlen(key), val, strlen(val), wt);
}

/* Announce a timeout of r in the stall store (see ddp_comm_set_stall_store):
 * a STUCK record (ddp_forensics.h) under the next incident number. Best
 * effort, bounded: a store that is gone only loses the announcement. */
static void stall_announce(ddp_comm *c, const comm_run *r, const char *what) {
    if (c->stall_store == NULL) return;
    char key[600], val[1200];
    int64_t i = 0;
    /* user keys, as the Python TCPStore (and torch's) spell them: with a leading '/' */
    snprintf(key, sizeof key, "/%s/" DDP_FX_STUCK_N, c->stall_prefix);
    if (ddp_store_add(c->stall_store, key, strlen(key), 1, &i, ddp_wait_for(2000, NULL)) != DDP_OK)
        return;
    pthread_mutex_lock(&c->mu);
    ddp_flight_entry e = {0};
    ddp_flight_get(&c->flight, r->flight_id, &e);
    pthread_mutex_unlock(&c->mu);
    uint64_t seq = e.seq;
    snprintf(val, sizeof val, DDP_FX_STUCK_FORMAT, c->rank,
             (unsigned long long)r->comm->group.tag, (unsigned long long)seq, what);
    snprintf(key, sizeof key, "/%s/" DDP_FX_STUCK "/%lld", c->stall_prefix, (long long)i);
    ddp_store_set(c->stall_store, key, strlen(key), val, strlen(val), ddp_wait_for(2000, NULL));
}

/* Run r's collective on this thread (the engine is marked running and r's
 * flight entry started), then finish it as every run finishes: on failure
 * the message (with what to do about a timeout), the stall or failure
 * announcement, then breaking the communicator; then run_done.
 * check/check_ctx: the wait's check hook (ddp_clock.h), NULL for none.
 * Returns the status, with the message in msg on failure. */
static ddp_status run_collective(ddp_comm *c, const comm_run *r, int (*check)(void *),
                                 void *check_ctx, char *msg, size_t len) {
    ddp_wait wt = ddp_wait_for(r->timeout_ms, &c->abort_flag);
    wt.check = check;
    wt.check_ctx = check_ctx;
    ddp_status st = ddp_coll_run(&r->comm->group, &r->args, wt);
    if (st == DDP_OK) {
        run_done(c, r, DDP_OK);
        return DDP_OK;
    }
    /* The algorithms' messages already name the collective, the rank and
     * the peer; add what the user can do about a timeout. */
    char bmsg[sizeof c->broken_msg];
    if (st == DDP_ERR_TIMEOUT)
        snprintf(msg, len, "%s (timeout %.1f s). A peer may be stuck, dead, or "
                 "calling a different collective; the timeout is set by "
                 "init_process_group(timeout=...) or PYDDP_TIMEOUT.", ddp_last_error(),
                 r->timeout_ms / 1000.0);
    else if (st == DDP_ERR_ABORTED && copy_broken(c, bmsg, sizeof bmsg))
        snprintf(msg, len, "rank %d: %s aborted: %s", c->rank, ddp_coll_name(r->args.kind),
                 bmsg);
    else
        snprintf(msg, len, "%s", ddp_last_error());
    if (st == DDP_ERR_TIMEOUT) stall_announce(c, r, msg);
    else failure_announce(c, msg);
    ddp_comm_break(c, msg);
    run_done(c, r, st);
    return st;
}

void *ddp_comm_worker_main(void *arg) {
    ddp_comm *c = arg;
    for (;;) {
        /* Idle: spin briefly for the next submission (back-to-back small
         * collectives) before sleeping on cv. destroy sets stopping and
         * signals cv under mu, which the wait below sees; an inline run
         * (running set) signals cv when it ends. */
        spin_on(&c->queued, ddp_now_us() + WORKER_SPIN_US);
        pthread_mutex_lock(&c->mu);
        while (c->running || (c->head == NULL && !c->stopping))
            pthread_cond_wait(&c->cv, &c->mu);
        ddp_work *w = c->head;
        if (w == NULL) { pthread_mutex_unlock(&c->mu); break; }
        c->head = w->next;
        if (c->head == NULL) c->tail = NULL;
        atomic_fetch_sub_explicit(&c->queued, 1, memory_order_relaxed);
        c->running = 1;
        ddp_flight_started(&c->flight, w->run.flight_id);
        int broken = c->broken;
        char bmsg[sizeof c->broken_msg];
        if (broken) memcpy(bmsg, c->broken_msg, sizeof bmsg);
        pthread_mutex_unlock(&c->mu);

        char msg[1400];
        if (broken) {
            snprintf(msg, sizeof msg,
                     "rank %d: %s cannot run: the process group is broken by an earlier "
                     "error: %s", c->rank, ddp_coll_name(w->run.args.kind), bmsg);
            run_done(c, &w->run, DDP_ERR_ABORTED);
            work_finish(w, DDP_ERR_ABORTED, msg);
            continue;
        }
        ddp_status st = run_collective(c, &w->run, NULL, NULL, msg, sizeof msg);
        work_finish(w, st, st == DDP_OK ? NULL : msg);
    }
    return NULL;
}

/* Bytes of this rank's largest buffer in a call, for the flight record. */
static uint64_t call_bytes(const ddp_comm *g, const ddp_coll_args *a) {
    uint64_t es = ddp_dtype_size(a->dtype), n = 0;
    switch (a->kind) {
    case DDP_COLL_ALLTOALL:
        for (int q = 0; q < g->size; q++) n += a->scounts[q];
        return n * es;
    case DDP_COLL_P2P_BATCH:
        for (int i = 0; i < a->nops; i++) n += a->ops[i].count * ddp_dtype_size(a->ops[i].dtype);
        return n;
    case DDP_COLL_ALLGATHER: case DDP_COLL_REDUCE_SCATTER: case DDP_COLL_GATHER:
    case DDP_COLL_SCATTER:
        return a->count * es * (uint64_t)g->size;
    default:
        return a->count * es;
    }
}

/* Validate a's arguments for group g (before anything is sent). */
static ddp_status check_args(ddp_comm *g, const ddp_coll_args *a) {
    ddp_status st = ddp_coll_validate(&g->group, a);
    if (st != DDP_OK)
        return ddp_error_prefix(st, "rank %d: %s: ", g->root->rank, ddp_coll_name(a->kind));
    return DDP_OK;
}

/* Under c->mu: why a call on g cannot run now (broken, destroyed), or DDP_OK. */
static ddp_status refuse_locked(ddp_comm *c, ddp_comm *g, const ddp_coll_args *a) {
    if (c->broken)
        return ddp_error(DDP_ERR_ABORTED, "rank %d: %s cannot run: the process group is broken "
                         "by an earlier error: %s", c->rank, ddp_coll_name(a->kind),
                         c->broken_msg);
    if (c->stopping || g->destroyed)
        return ddp_error(DDP_ERR_INVALID, "rank %d: %s: the process group was destroyed",
                         c->rank, ddp_coll_name(a->kind));
    return DDP_OK;
}

/* Under c->mu: count a call on g (collectives only) and enter it in the
 * flight record as queued; returns its flight id. */
static uint64_t record_locked(ddp_comm *c, ddp_comm *g, const ddp_coll_args *a) {
    if (!c->used) {   /* the first call: wake ddp_pg_info.wait_used */
        c->used = 1;
        pthread_cond_broadcast(&c->link_cv);
    }
    ddp_flight_entry fe = {.tag = g->group.tag, .seq = is_p2p(a->kind) ? 0 : ++g->submitted,
                           .kind = a->kind, .dtype = a->dtype, .op = a->op, .root = a->root,
                           .group_rank = g->rank, .group_size = g->size,
                           .bytes = call_bytes(g, a)};
    return ddp_flight_queued(&c->flight, &fe);
}

ddp_status ddp_comm_submit_opts(ddp_comm *g, const ddp_coll_args *a, const ddp_pg_opts *o,
                                ddp_work **out) {
    ddp_comm *c = g->root;
    *out = NULL;
    ddp_status st = check_args(g, a);
    if (st != DDP_OK) return st;
    ddp_work *w = calloc(1, sizeof *w);
    if (w == NULL) return ddp_error(DDP_ERR_NOMEM, "out of memory queuing a collective");
    w->run.args = *a;
    w->run.timeout_ms = o && o->timeout_ms >= 0 ? o->timeout_ms : g->timeout_ms;
    w->notify = o ? o->notify : NULL;
    w->notify_ctx = o ? o->notify_ctx : NULL;
    w->refs = 2;
    w->run.comm = g;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    pthread_mutex_lock(&c->mu);
    if ((st = refuse_locked(c, g, a)) != DDP_OK) {
        pthread_mutex_unlock(&c->mu);
        pthread_mutex_destroy(&w->mu);
        pthread_cond_destroy(&w->cv);
        free(w);
        return st;
    }
    ddp_comm_retain(g);
    w->run.flight_id = record_locked(c, g, a);
    if (c->tail) c->tail->next = w; else c->head = w;
    c->tail = w;
    atomic_fetch_add_explicit(&c->queued, 1, memory_order_release);
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
    *out = w;
    return DDP_OK;
}

/* Whether a on g may run inline (ddp_comm_run_inline): a blocking
 * single-buffer kind (ALLREDUCE, BROADCAST, REDUCE, BARRIER) within the
 * latency path's size, on a communicator with a worker to hand the next
 * queued work to. The one place the lean path is decided; the engine's being
 * idle is checked under the lock by the caller. */
static int inline_fits(const ddp_comm *g, const ddp_coll_args *a) {
    return (a->kind == DDP_COLL_ALLREDUCE || a->kind == DDP_COLL_BROADCAST ||
            a->kind == DDP_COLL_REDUCE || a->kind == DDP_COLL_BARRIER) &&
           call_bytes(g, a) <= g->group.small_bytes && g->root->has_worker;
}

ddp_status ddp_comm_run_inline(ddp_comm *g, const ddp_coll_args *a, int64_t timeout_ms,
                               int (*check)(void *ctx), void *check_ctx, int *taken) {
    ddp_comm *c = g->root;
    *taken = 0;
    if (!inline_fits(g, a)) return DDP_OK;
    pthread_mutex_lock(&c->mu);
    if (c->running || c->head != NULL) {    /* busy: behind the queue it goes, and
                                             * submit validates it (once) */
        pthread_mutex_unlock(&c->mu);
        return DDP_OK;
    }
    *taken = 1;
    /* Validation is a few comparisons: under the lock, so the busy answer
     * above needs none and a call is validated once whichever way it goes. */
    ddp_status st = check_args(g, a);
    if (st == DDP_OK) st = refuse_locked(c, g, a);
    if (st != DDP_OK) {
        pthread_mutex_unlock(&c->mu);
        return st;
    }
    comm_run r = {.args = *a, .comm = g,
                  .timeout_ms = timeout_ms >= 0 ? timeout_ms : g->timeout_ms};
    r.flight_id = record_locked(c, g, a);
    ddp_flight_started(&c->flight, r.flight_id);
    c->running = 1;
    c->inline_run = 1;
    c->inline_thread = pthread_self();
    pthread_mutex_unlock(&c->mu);

    char msg[1400];
    st = run_collective(c, &r, check, check_ctx, msg, sizeof msg);
    pthread_mutex_lock(&c->mu);
    int deferred = c->destroy_deferred;
    c->destroy_deferred = 0;
    pthread_mutex_unlock(&c->mu);
    if (deferred) ddp_comm_destroy(c);   /* called during the run, on this thread */
    if (st != DDP_OK) ddp_set_error_text(msg);
    return st;
}

ddp_status ddp_comm_submit(ddp_comm *c, const ddp_coll_args *a, int64_t timeout_ms,
                           ddp_work **out) {
    ddp_pg_opts o = {.timeout_ms = timeout_ms};
    return ddp_comm_submit_opts(c, a, &o, out);
}
