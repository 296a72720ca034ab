/* ddp_nccl_pg.c - the NCCL communicator behind the one process-group
 * interface (csrc/core/ddp_pg.h), so the Python ProcessGroup and Work types
 * drive it exactly as they drive the CPU communicator.
 *
 * NCCL works have no reference count of their own; a small wrapper adds one
 * (the Python Work retains the work while a thread waits on it with the GIL
 * released, so another thread may finish and release it meanwhile).
 * Completion is learnt by polling the work's CUDA event, so ddp_pg_opts'
 * notify is never called here: waiters poll.
 */
#include <stdatomic.h>
#include <stdlib.h>

#include "ddp_nccl_comm.h"
#include "ddp_nccl_pg.h"

typedef struct nwork {
    ddp_nccl_work *w;
    atomic_int refs;
} nwork;

static ddp_status np_submit(void *impl, const ddp_coll_args *a, const ddp_pg_opts *o,
                            void **work) {
    *work = NULL;
    ddp_status st = ddp_nccl_validate(impl, a);
    if (st != DDP_OK) return st;
    nwork *nw = calloc(1, sizeof *nw);
    if (nw == NULL) return ddp_error(DDP_ERR_NOMEM, "out of memory queuing an NCCL collective");
    atomic_init(&nw->refs, 1);
    st = ddp_nccl_submit(impl, a, o ? o->has_stream : 0, o ? o->stream : 0,
                         o ? o->timeout_ms : -1, o ? o->intr : NULL, &nw->w);
    if (st != DDP_OK) {
        free(nw);
        return st;
    }
    *work = nw;
    return DDP_OK;
}

static int np_done(void *w) { return ddp_nccl_work_done(((nwork *)w)->w); }
static ddp_status np_wait(void *w, ddp_wait wt) { return ddp_nccl_work_wait(((nwork *)w)->w, wt); }
static const char *np_error(void *w) { return ddp_nccl_work_error(((nwork *)w)->w); }
static ddp_status np_publish(void *w, uintptr_t stream) {
    return ddp_nccl_work_sync_stream(((nwork *)w)->w, stream);
}
static int np_drained(void *w, int64_t ms) { return ddp_nccl_work_drained(((nwork *)w)->w, ms); }
static void np_work_retain(void *w) { atomic_fetch_add(&((nwork *)w)->refs, 1); }
static void np_work_release(void *w) {
    nwork *nw = w;
    if (nw && atomic_fetch_sub(&nw->refs, 1) == 1) {
        ddp_nccl_work_release(nw->w);
        free(nw);
    }
}
static void np_abort(void *impl, const char *reason) { ddp_nccl_comm_abort(impl, reason); }
static void np_retain(void *impl) { ddp_nccl_comm_retain(impl); }
static void np_release(void *impl) { ddp_nccl_comm_release(impl); }
static void np_destroy(void *impl, ddp_wait w) { ddp_nccl_comm_destroy(impl, w); }
static int np_rank(const void *impl) { return ddp_nccl_comm_rank(impl); }
static int np_size(const void *impl) { return ddp_nccl_comm_size(impl); }
static int np_device(const void *impl) { return ddp_nccl_comm_device(impl); }

/* No inline path and no info table: NCCL launches asynchronously on its own
 * stream, and the communicator keeps no peer table of its own (made from a
 * unique id in the store); introspection goes to the group's CPU
 * communicator. */
static const ddp_pg_ops nccl_pg_ops = {
    .name = "nccl", .submit = np_submit, .work_done = np_done, .work_wait = np_wait,
    .work_error = np_error, .work_publish = np_publish, .work_drained = np_drained,
    .work_retain = np_work_retain, .work_release = np_work_release, .abort = np_abort,
    .retain = np_retain, .release = np_release, .destroy = np_destroy, .rank = np_rank,
    .size = np_size, .device = np_device, .notifies = 0,
    .run_inline = NULL, .info = NULL,
};

ddp_pg ddp_nccl_pg(ddp_nccl_comm *c) {
    ddp_pg pg = {&nccl_pg_ops, c};
    return pg;
}
