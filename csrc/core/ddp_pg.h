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
 * Required and optional: every op up to `notifies` is implemented by every
 * transport (work_publish and work_drained may be NULL, as documented at
 * them). After it come the optional ones, NULL where a transport has nothing
 * to offer: run_inline (the CPU communicator runs a small blocking collective
 * on the caller's thread; NCCL has no such path) and info (what a
 * communicator can tell about itself without communicating: peers, links,
 * the flight record, progress; NCCL's communicator is made from a unique id
 * in the store and keeps no peer table of its own). Callers reach them
 * through ddp_pg_run_inline and ddp_pg_info_of, which answer "not offered"
 * for NULL.
 *
 * Threads: every entry may be called from any thread; none touches Python.
 */
#ifndef DDP_PG_H
#define DDP_PG_H

#include <stdint.h>
#include "ddp_clock.h"
#include "ddp_coll.h"
#include "ddp_flight.h"
#include "ddp_status.h"

struct ddp_store;

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

/* What a communicator can tell about itself without communicating (an
 * optional sub-table of ddp_pg_ops; every entry of it is set). Group ranks
 * r are in 0..size-1; the strings live as long as the communicator's memory
 * (until its last release). All thread-safe. */
typedef struct ddp_pg_info {
    /* The group's tag (carried in every collective header). */
    uint64_t (*tag)(const void *impl);
    /* "rank r (host:port)", and the host identity published at rendezvous. */
    const char *(*peer_desc)(const void *impl, int r);
    const char *(*host_id)(const void *impl, int r);
    /* The link to rank r: "tcp", "shm", "self", "closed" once destroyed. */
    const char *(*transport)(void *impl, int r);
    /* The last collectives of the communicator (every group over it),
     * oldest first, up to max; returns how many (ddp_flight.h). */
    size_t (*flight)(void *impl, ddp_flight_entry *out, size_t max);
    /* This group's collectives queued and finished, and the last finished. */
    void (*progress)(void *impl, uint64_t *submitted, uint64_t *completed,
                     ddp_flight_entry *last_done);
    /* Where a timeout or first failure is announced (store retained; see
     * ddp_comm_set_stall_store for the keys). */
    void (*set_stall_store)(void *impl, struct ddp_store *s, const char *prefix);
    /* Collectives queued or running on the communicator now (every group over
     * it); read at process exit to decide whether to wait or abort. */
    int (*pending)(void *impl);
    /* Block until the communicator queued or ran its first collective (on any
     * group over it), broke or was destroyed: 1; 0 when w ends first. */
    int (*wait_used)(void *impl, ddp_wait w);
} ddp_pg_info;

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
    /* Make the caller's stream see the results, on the device: after a
     * successful wait, or before the work finished (the stream then waits for
     * it without the host waiting). NULL for host transports. */
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

    /* ---- optional (NULL: not offered) ---- */
    /* Run a small blocking collective on the calling thread now if the
     * transport can (its kind and size allow it and nothing of this process
     * is queued or running on the communicator): *taken = 1 and the
     * collective's status, exactly as a submitted one would end (sequence
     * number, flight record, timeout, breaking on failure); validation and
     * "broken"/"destroyed" refusals also come with *taken = 1. Otherwise
     * *taken = 0 and nothing happened: submit it. intr (may be NULL) is
     * asked at most every DDP_WAIT_SLICE_MS while the run waits for peers;
     * nonzero ends the run with DDP_ERR_ABORTED, and the caller should abort
     * the group first so that peers fail too. The caller holds a reference
     * on impl for the call. */
    ddp_status (*run_inline)(void *impl, const ddp_coll_args *a, int64_t timeout_ms,
                             const ddp_pg_interrupt *intr, int *taken);
    const ddp_pg_info *info;
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

/* pg's run_inline, or *taken = 0 (submit instead) where it offers none. */
static inline ddp_status ddp_pg_run_inline(ddp_pg pg, const ddp_coll_args *a,
                                           int64_t timeout_ms, const ddp_pg_interrupt *intr,
                                           int *taken) {
    *taken = 0;
    if (pg.ops->run_inline == NULL) return DDP_OK;
    return pg.ops->run_inline(pg.impl, a, timeout_ms, intr, taken);
}

/* pg's info table, NULL where it has none. */
static inline const ddp_pg_info *ddp_pg_info_of(ddp_pg pg) {
    return pg.ops ? pg.ops->info : NULL;
}

#endif
