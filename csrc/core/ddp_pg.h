/* ddp_pg.h - the one process-group interface that every communicator
 * implements: the CPU communicator (ddp_comm.c, TCP and shared memory) and
 * the NCCL communicator (csrc/cuda/ddp_nccl_pg.c). A small table of function
 * pointers, as NCCL does for its transports, so the layers above (the Python
 * ProcessGroup and Work types, the DDP reducer) hold a ddp_pg and never ask
 * which transport is behind it.
 *
 * Lifetimes: a communicator is reference-counted. Every borrower (a work in
 * flight, the DDP reducer, a subgroup, a Python object) holds a reference
 * taken with retain and dropped with release; the memory lives until the last
 * release. destroy ends the communication (joins threads, closes links or
 * finalizes NCCL) and drops the owner's reference; calls on a destroyed
 * communicator fail with a clear status instead of touching freed memory.
 *
 * Works are reference-counted the same way (work_retain/work_release); a work
 * keeps its communicator alive while it exists.
 *
 * Threads: every entry may be called from any thread; none touches Python.
 */
#ifndef DDP_PG_H
#define DDP_PG_H

#include <stdint.h>
#include "ddp_clock.h"
#include "ddp_coll.h"
#include "ddp_status.h"

/* Asked every DDP_WAIT_SLICE_MS while a submit blocks (NCCL launching a
 * collective whose peers are not there yet); nonzero aborts the group. */
typedef struct ddp_pg_interrupt {
    int (*check)(void *ctx);
    void *ctx;
} ddp_pg_interrupt;

/* Per-call options of submit. */
typedef struct ddp_pg_opts {
    int64_t timeout_ms;           /* < 0: the communicator's default */
    int has_stream;               /* NCCL: order after / publish on this stream */
    uintptr_t stream;             /* cudaStream_t value (0 = legacy default) */
    const ddp_pg_interrupt *intr; /* may be NULL */
    /* Called once from the communicator's own thread right after the work
     * finished (success or failure), without any lock held; NULL for none.
     * For transports that only learn of completion by polling (NCCL) it is
     * not called: the waiter must poll. Must not block. */
    void (*notify)(void *ctx);
    void *notify_ctx;
} ddp_pg_opts;

typedef struct ddp_pg_ops {
    const char *name;             /* "cpu", "nccl" */
    /* Validate (before anything is sent) and queue one collective; on
     * success *work is a new work holding one reference for the caller. */
    ddp_status (*submit)(void *impl, const ddp_coll_args *a, const ddp_pg_opts *o,
                         void **work);
    /* Nonzero once the work finished, successfully or not. Never blocks. */
    int (*work_done)(void *work);
    /* Block until done or w ends: the work's status when done, else
     * DDP_ERR_TIMEOUT / DDP_ERR_ABORTED for the wait itself. */
    ddp_status (*work_wait)(void *work, ddp_wait w);
    /* The failed work's message ("" otherwise). */
    const char *(*work_error)(void *work);
    /* After a successful wait: make the caller's stream see the results
     * (NULL for host transports). */
    ddp_status (*work_publish)(void *work, uintptr_t stream);
    /* After a failure: 1 once the device let go of the buffers (polls up to
     * ms); NULL means always 1. */
    int (*work_drained)(void *work, int64_t ms);
    void (*work_retain)(void *work);
    void (*work_release)(void *work);
    /* Break the communicator now: pending and later work fails at once, and
     * peers waiting on this rank fail fast. Idempotent, thread-safe. */
    void (*abort)(void *impl, const char *reason);
    void (*retain)(void *impl);
    void (*release)(void *impl);
    /* End communication (bounded by w), then drop the owner's reference. */
    void (*destroy)(void *impl, ddp_wait w);
    int (*rank)(const void *impl);
    int (*size)(const void *impl);
    /* CUDA device of the communicator, -1 for host transports. */
    int (*device)(const void *impl);
    /* 1: submit honours ddp_pg_opts.notify; 0: completion must be polled. */
    int notifies;
} ddp_pg_ops;

/* A communicator behind the interface. */
typedef struct ddp_pg {
    const ddp_pg_ops *ops;
    void *impl;
} ddp_pg;

/* A work behind the interface. */
typedef struct ddp_pg_work {
    const ddp_pg_ops *ops;
    void *w;
} ddp_pg_work;

static inline ddp_status ddp_pg_submit(ddp_pg pg, const ddp_coll_args *a, const ddp_pg_opts *o,
                                       ddp_pg_work *out) {
    out->ops = pg.ops;
    out->w = NULL;
    return pg.ops->submit(pg.impl, a, o, &out->w);
}

#endif
