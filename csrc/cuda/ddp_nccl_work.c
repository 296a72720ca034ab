/* ddp_nccl_work.c - an NCCL collective in flight (contract in
 * ddp_nccl_comm.h): its completion event, polled for the outcome with
 * NCCL's error state and the deadline (either failure breaks the
 * communicator with a message naming the collective), the caller's stream
 * ordered after it, and the device letting go of its buffers after a
 * failure. Completion events are pooled per communicator: creating and
 * destroying one per collective is a measurable part of a launch, and an
 * event whose record completed can be recorded again.
 */
#include "ddp_nccl_internal.h"

#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

/* ---- completion events, pooled per communicator ---------------------- */

/* A completion event of c's device: a pooled one, else a new one; 0 or a CUDA
 * error. c's device is current. */
static ddp_cu_err event_get(ddp_nccl_comm *c, ddp_cu_event *ev) {
    pthread_mutex_lock(&c->ev_mu);
    int have = c->ev_nfree > 0;
    if (have) *ev = c->ev_free[--c->ev_nfree];
    pthread_mutex_unlock(&c->ev_mu);
    return have ? DDP_CU_SUCCESS
                : c->api->cudaEventCreateWithFlags(ev, DDP_CU_EVENT_DISABLE_TIMING);
}

/* Give back the event of a work that is let go of. Only an event whose
 * record completed (the work succeeded) is reused; any other is destroyed
 * (CUDA frees it once it completes). c's device is current. */
static void event_put(ddp_nccl_comm *c, ddp_cu_event ev, int completed) {
    int kept = 0;
    if (completed) {
        pthread_mutex_lock(&c->ev_mu);
        if (c->ev_nfree < DDP_NCCL_EVENT_POOL) {
            c->ev_free[c->ev_nfree++] = ev;
            kept = 1;
        }
        pthread_mutex_unlock(&c->ev_mu);
    }
    if (!kept) c->api->cudaEventDestroy(ev);
}

void ddp_nccl_events_free(ddp_nccl_comm *c) {
    for (int i = 0; i < c->ev_nfree; i++) c->api->cudaEventDestroy(c->ev_free[i]);
    c->ev_nfree = 0;
}

/* ---- works ------------------------------------------------------------ */

ddp_nccl_work *ddp_nccl_work_new(ddp_nccl_comm *c, const ddp_coll_args *a, int64_t timeout_ms) {
    ddp_nccl_work *w = calloc(1, sizeof *w);
    if (w == NULL) return NULL;
    if (event_get(c, &w->done) != DDP_CU_SUCCESS) {
        free(w);
        return NULL;
    }
    w->timeout_ms = timeout_ms < 0 ? c->timeout_ms : timeout_ms;
    w->deadline_ms = ddp_wait_for(w->timeout_ms, NULL).deadline_ms;
    w->kind = a->kind;
    w->dtype = a->dtype;
    w->count = a->count;
    if (a->kind == DDP_COLL_ALLTOALL) {         /* validated: the arrays are there */
        w->count = w->count2 = 0;
        for (int p = 0; p < c->size; p++) {
            w->count += a->scounts[p];
            w->count2 += a->rcounts[p];
        }
    } else if (a->kind == DDP_COLL_P2P_BATCH) {
        w->count = w->count2 = 0;
        for (int i = 0; i < a->nops; i++) {
            if (a->ops[i].is_send) w->count++;
            else w->count2++;
        }
    }
    pthread_mutex_init(&w->mu, NULL);
    atomic_init(&w->state, 0);
    ddp_nccl_comm_retain(c);
    w->comm = c;
    return w;
}

/* Move a pending work to its final state (first caller wins). */
static void work_finish(ddp_nccl_work *w, ddp_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void work_finish(ddp_nccl_work *w, ddp_status st, const char *fmt, ...) {
    pthread_mutex_lock(&w->mu);
    if (atomic_load(&w->state) == 0) {
        w->st = st;
        if (fmt) {
            va_list ap;
            va_start(ap, fmt);
            vsnprintf(w->msg, sizeof w->msg, fmt, ap);
            va_end(ap);
        }
        atomic_store(&w->state, st == DDP_OK ? 1 : 2);
    }
    pthread_mutex_unlock(&w->mu);
}

/* NCCL's send/recv carry no sizes the peer could check, so a size mismatch
 * in a grouped exchange is just a hang: say what has to agree. */
static const char *size_hint(ddp_coll_kind k) {
    if (k == DDP_COLL_ALLTOALL)
        return " (for all_to_all: rank p's input split for rank q must equal rank q's output "
               "split for rank p)";
    if (k == DDP_COLL_P2P_BATCH)
        return " (for batch_isend_irecv: each send needs a receive of the same count and dtype "
               "on its peer, in the same order)";
    return "";
}

/* w's description for messages (made only when one is written). */
static const char *work_desc(const ddp_nccl_work *w, char *d, size_t len) {
    return ddp_nccl_describe(w->comm, w->kind, w->seq, w->count, w->count2, w->dtype, d, len);
}

int ddp_nccl_work_done(ddp_nccl_work *w) {
    if (atomic_load(&w->state) != 0) return 1;
    ddp_nccl_comm *c = w->comm;
    const ddp_cuda_api *api = c->api;
    char d[200], e[600];
    if (atomic_load(&c->broken)) {
        /* After a clean finalize the events are trustworthy; after a failure a
         * completed event may belong to a kernel that gave up. */
        if (atomic_load(&c->finalized) && api->cudaEventQuery(w->done) == DDP_CU_SUCCESS)
            work_finish(w, DDP_OK, NULL);
        else
            work_finish(w, c->broken_st, "%s did not complete: %s", work_desc(w, d, sizeof d),
                        c->broken_msg);
        return 1;
    }
    /* NCCL's error state first: a failed collective's kernels exit early,
     * so its event completing does not mean the data arrived. Skip the
     * check when another thread is inside NCCL (it polls the same state). */
    if (pthread_mutex_trylock(&c->mu) == 0) {
        ddp_nc_result r = DDP_NC_SUCCESS;
        if (c->nc && api->ncclCommGetAsyncError(c->nc, &r) == DDP_NC_SUCCESS &&
            r != DDP_NC_SUCCESS && r != DDP_NC_IN_PROGRESS)
            ddp_nccl_fail_locked(c, ddp_nccl_status_of(r), "%s failed: NCCL reported %s. Another rank "
                                 "probably failed or exited; check its output",
                                 work_desc(w, d, sizeof d), ddp_nccl_errtext(c, r, e, sizeof e));
        pthread_mutex_unlock(&c->mu);
        if (atomic_load(&c->broken)) {
            work_finish(w, c->broken_st, "%s", c->broken_msg);
            return 1;
        }
    }
    ddp_cu_err q = api->cudaEventQuery(w->done);
    if (q == DDP_CU_SUCCESS) {
        work_finish(w, DDP_OK, NULL);
        return 1;
    }
    if (q != DDP_CU_ERR_NOT_READY) {
        ddp_nccl_fail(c, DDP_ERR_ABORTED, "%s failed on the GPU: %s (CUDA error %d)",
                      work_desc(w, d, sizeof d), api->cudaGetErrorString(q), q);
    } else if (ddp_now_ms() >= w->deadline_ms) {
        ddp_nccl_fail(c, DDP_ERR_TIMEOUT, "%s did not complete within its timeout of %.1f s; "
                      "the NCCL communicator was aborted. Some rank did not reach this "
                      "collective, is stuck or died, or called a different collective (NCCL "
                      "cannot tell which): check that every rank calls the same collectives "
                      "in the same order with the same sizes%s", work_desc(w, d, sizeof d),
                      (double)w->timeout_ms / 1000.0, size_hint(w->kind));
    } else {
        return 0;
    }
    work_finish(w, c->broken_st, "%s", c->broken_msg);
    return 1;
}

/* A wait polls without sleeping this long first: a small collective ends a few
 * microseconds after its launch, and the first nap would take tens of them
 * (a sleep is rounded up by the kernel's timer slack). */
#define WAIT_SPIN_US 100

ddp_status ddp_nccl_work_wait(ddp_nccl_work *w, ddp_wait wait) {
    int us = 10;
    int64_t spin_until = ddp_now_us() + WAIT_SPIN_US;
    while (!ddp_nccl_work_done(w)) {
        if (ddp_wait_aborted(wait)) return ddp_error(DDP_ERR_ABORTED, "wait interrupted");
        if (ddp_wait_expired(wait)) return ddp_error(DDP_ERR_TIMEOUT, "wait timed out");
        if (ddp_now_us() < spin_until)
            sched_yield();   /* another thread that needs this core gets it */
        else
            ddp_nccl_nap(&us);
    }
    if (w->st != DDP_OK) return ddp_error(w->st, "%s", w->msg);
    return DDP_OK;
}

const char *ddp_nccl_work_error(const ddp_nccl_work *w) {
    return atomic_load(&w->state) == 2 ? w->msg : "";
}

ddp_status ddp_nccl_work_sync_stream(ddp_nccl_work *w, uintptr_t stream) {
    ddp_nccl_comm *c = w->comm;
    ddp_status st = ddp_nccl_use_device(c);
    if (st != DDP_OK) return st;
    ddp_cu_err e = c->api->cudaStreamWaitEvent((ddp_cu_stream)stream, w->done, 0);
    if (e != DDP_CU_SUCCESS)
        return ddp_error(DDP_ERR_SYS, "rank %d: cudaStreamWaitEvent on the caller's stream "
                         "failed: %s", c->rank, c->api->cudaGetErrorString(e));
    return DDP_OK;
}

int ddp_nccl_work_drained(ddp_nccl_work *w, int64_t ms) {
    const ddp_cuda_api *api = w->comm->api;
    ddp_wait lim = ddp_wait_for(ms, NULL);
    int us = 50;
    for (;;) {
        ddp_cu_err q = api->cudaEventQuery(w->done);
        if (q != DDP_CU_ERR_NOT_READY) return q == DDP_CU_SUCCESS;
        if (ddp_wait_expired(lim)) return 0;
        ddp_nccl_nap(&us);
    }
}

void ddp_nccl_work_release(ddp_nccl_work *w) {
    if (w == NULL) return;
    ddp_nccl_comm *c = w->comm;
    if (ddp_nccl_use_device(c) == DDP_OK) event_put(c, w->done, atomic_load(&w->state) == 1);
    pthread_mutex_destroy(&w->mu);
    free(w);
    ddp_nccl_comm_release(c);
}
