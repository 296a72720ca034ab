/* ddp_comm_queue.c - the communicator's work queue: work items and their waits,
 * submission (validation on the caller's thread, then the queue), and the worker
 * thread that runs queued collectives in submission order and finishes them
 * (failure messages, breaking the communicator, the stall and failure
 * announcements, the flight record and progress counters). Contract in
 * ddp_comm.h; the lifetimes and the process-group table are in ddp_comm.c.
 */
#include "ddp_comm.h"

#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp_comm_internal.h"

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

struct ddp_work {
    ddp_coll_args args;
    ddp_comm *comm;     /* the group it runs on (referenced) */
    int64_t timeout_ms;
    uint64_t flight_id;
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
        ddp_comm_release(w->comm);
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

/* ---- worker thread -------------------------------------------------- */

/* Copy the broken message under the lock; returns whether the group is broken. */
static int copy_broken(ddp_comm *c, char *buf, size_t len) {
    pthread_mutex_lock(&c->mu);
    int b = c->broken;
    if (b) snprintf(buf, len, "%s", c->broken_msg);
    pthread_mutex_unlock(&c->mu);
    return b;
}

/* Record w's end in the flight record and its group's progress; the worker
 * is idle again. Before work_finish, so a waiter woken by it sees both. */
static void worker_done(ddp_comm *c, ddp_work *w, ddp_status st) {
    ddp_comm *g = w->comm;
    pthread_mutex_lock(&c->mu);
    ddp_flight_ended(&c->flight, w->flight_id, st);
    if (w->args.kind != DDP_COLL_SEND && w->args.kind != DDP_COLL_RECV &&
        w->args.kind != DDP_COLL_P2P_BATCH) {
        g->completed++;
        ddp_flight_get(&c->flight, w->flight_id, &g->last_done);
    }
    c->running = 0;
    pthread_mutex_unlock(&c->mu);
}

/* The first failure of any rank of the world, kept in the stall store so
 * that a rank that only saw a peer close its connection can say what really
 * went wrong first, and where ("/<prefix>/broken" = "rank=R;what=MESSAGE",
 * set by whoever ADDs "/<prefix>/broken_n" to 1 first). Called after the
 * links are shut down, so peers fail at once; bounded by 2 s. */
static void failure_announce(ddp_comm *c, const char *what) {
    if (c->stall_store == NULL) return;
    char key[600], val[1600];
    int64_t i = 0;
    snprintf(key, sizeof key, "/%s/broken_n", c->stall_prefix);
    if (ddp_store_add(c->stall_store, key, strlen(key), 1, &i, ddp_wait_for(2000, NULL)) !=
            DDP_OK || i != 1)
        return;
    snprintf(val, sizeof val, "rank=%d;what=%s", c->rank, what);
    snprintf(key, sizeof key, "/%s/broken", c->stall_prefix);
    ddp_store_set(c->stall_store, key, strlen(key), val, strlen(val), ddp_wait_for(2000, NULL));
}

/* Announce a timeout of w in the stall store (see ddp_comm_set_stall_store).
 * Best effort, bounded: a store that is gone only loses the announcement. */
static void stall_announce(ddp_comm *c, ddp_work *w, const char *what) {
    if (c->stall_store == NULL) return;
    char key[600], val[1200];
    int64_t i = 0;
    /* user keys, as the Python TCPStore (and torch's) spell them: with a leading '/' */
    snprintf(key, sizeof key, "/%s/stuck_n", c->stall_prefix);
    if (ddp_store_add(c->stall_store, key, strlen(key), 1, &i, ddp_wait_for(2000, NULL)) != DDP_OK)
        return;
    pthread_mutex_lock(&c->mu);
    ddp_flight_entry e = {0};
    ddp_flight_get(&c->flight, w->flight_id, &e);
    pthread_mutex_unlock(&c->mu);
    uint64_t seq = e.seq;
    snprintf(val, sizeof val, "rank=%d;tag=%016llx;seq=%llu;what=%s", c->rank,
             (unsigned long long)w->comm->group.tag, (unsigned long long)seq, what);
    snprintf(key, sizeof key, "/%s/stuck/%lld", c->stall_prefix, (long long)i);
    ddp_store_set(c->stall_store, key, strlen(key), val, strlen(val), ddp_wait_for(2000, NULL));
}

void *ddp_comm_worker_main(void *arg) {
    ddp_comm *c = arg;
    for (;;) {
        /* Idle: spin briefly for the next submission (back-to-back small
         * collectives) before sleeping on cv. destroy sets stopping and
         * signals cv under mu, which the wait below sees. */
        spin_on(&c->queued, ddp_now_us() + WORKER_SPIN_US);
        pthread_mutex_lock(&c->mu);
        while (c->head == NULL && !c->stopping) pthread_cond_wait(&c->cv, &c->mu);
        ddp_work *w = c->head;
        if (w == NULL) { pthread_mutex_unlock(&c->mu); break; }
        c->head = w->next;
        if (c->head == NULL) c->tail = NULL;
        atomic_fetch_sub_explicit(&c->queued, 1, memory_order_relaxed);
        c->running = 1;
        ddp_flight_started(&c->flight, w->flight_id);
        int broken = c->broken;
        char bmsg[sizeof c->broken_msg];
        if (broken) memcpy(bmsg, c->broken_msg, sizeof bmsg);
        pthread_mutex_unlock(&c->mu);

        if (broken) {
            char msg[1400];
            snprintf(msg, sizeof msg,
                     "rank %d: %s cannot run: the process group is broken by an earlier "
                     "error: %s", c->rank, ddp_coll_name(w->args.kind), bmsg);
            worker_done(c, w, DDP_ERR_ABORTED);
            work_finish(w, DDP_ERR_ABORTED, msg);
            continue;
        }
        ddp_wait wt = ddp_wait_for(w->timeout_ms, &c->abort_flag);
        ddp_status st = ddp_coll_run(&w->comm->group, &w->args, wt);
        if (st == DDP_OK) {
            worker_done(c, w, DDP_OK);
            work_finish(w, DDP_OK, NULL);
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
        if (st == DDP_ERR_TIMEOUT) stall_announce(c, w, msg);
        ddp_comm_break(c, msg);
        if (st != DDP_ERR_TIMEOUT) failure_announce(c, msg);
        worker_done(c, w, st);
        work_finish(w, st, msg);
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

ddp_status ddp_comm_submit_opts(ddp_comm *g, const ddp_coll_args *a, const ddp_pg_opts *o,
                                ddp_work **out) {
    ddp_comm *c = g->root;
    *out = NULL;
    ddp_status st = ddp_coll_validate(&g->group, a);
    if (st != DDP_OK) return ddp_error_prefix(st, "rank %d: %s: ", c->rank, ddp_coll_name(a->kind));
    ddp_work *w = calloc(1, sizeof *w);
    if (w == NULL) return ddp_error(DDP_ERR_NOMEM, "out of memory queuing a collective");
    w->args = *a;
    w->timeout_ms = o && o->timeout_ms >= 0 ? o->timeout_ms : g->timeout_ms;
    w->notify = o ? o->notify : NULL;
    w->notify_ctx = o ? o->notify_ctx : NULL;
    w->refs = 2;
    w->comm = g;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    pthread_mutex_lock(&c->mu);
    if (c->broken || c->stopping || g->destroyed) {
        if (c->broken)
            st = ddp_error(DDP_ERR_ABORTED, "rank %d: %s cannot run: the process group is broken "
                           "by an earlier error: %s", c->rank, ddp_coll_name(a->kind),
                           c->broken_msg);
        else
            st = ddp_error(DDP_ERR_INVALID, "rank %d: %s: the process group was destroyed",
                           c->rank, ddp_coll_name(a->kind));
        pthread_mutex_unlock(&c->mu);
        pthread_mutex_destroy(&w->mu);
        pthread_cond_destroy(&w->cv);
        free(w);
        return st;
    }
    ddp_comm_retain(g);
    int p2p = a->kind == DDP_COLL_SEND || a->kind == DDP_COLL_RECV || a->kind == DDP_COLL_P2P_BATCH;
    ddp_flight_entry fe = {.tag = g->group.tag, .seq = p2p ? 0 : ++g->submitted,
                           .kind = a->kind, .dtype = a->dtype, .op = a->op, .root = a->root,
                           .group_rank = g->rank, .group_size = g->size,
                           .bytes = call_bytes(g, a)};
    w->flight_id = ddp_flight_queued(&c->flight, &fe);
    if (c->tail) c->tail->next = w; else c->head = w;
    c->tail = w;
    atomic_fetch_add_explicit(&c->queued, 1, memory_order_release);
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
    *out = w;
    return DDP_OK;
}

ddp_status ddp_comm_submit(ddp_comm *c, const ddp_coll_args *a, int64_t timeout_ms,
                           ddp_work **out) {
    ddp_pg_opts o = {.timeout_ms = timeout_ms};
    return ddp_comm_submit_opts(c, a, &o, out);
}
