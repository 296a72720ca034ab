/* ddp_nccl_internal.h - the state shared by ddp_nccl_comm.c (lifecycle,
 * failures), ddp_nccl_work.c (works: completion, polling) and
 * ddp_nccl_coll.c (issuing collectives). Not for use outside csrc/cuda.
 *
 * Locking: `mu` serialises every call into NCCL and every use of the stream
 * and of `ready`; `stage_mu` owns the host-staging buffers for the whole of
 * one host collective. Code that polls for a long time under `mu` (an NCCL
 * call that returned ncclInProgress) also watches `stop`, which a failing
 * thread sets before it takes `mu` to abort, so the abort never waits long.
 */
#ifndef DDP_NCCL_INTERNAL_H
#define DDP_NCCL_INTERNAL_H

#include <pthread.h>
#include "ddp_nccl_comm.h"

#define DDP_NCCL_EVENT_POOL 64   /* completion events kept for reuse */

struct ddp_nccl_comm {
    const ddp_cuda_api *api;
    int rank, size, device;
    int64_t timeout_ms;
    pthread_mutex_t mu;
    ddp_nc_comm nc;              /* NULL once aborted or destroyed (under mu) */
    ddp_cu_stream stream;        /* dedicated, non-blocking */
    ddp_cu_event ready;          /* producer-order event, re-recorded under mu */
    void *scratch;               /* small device buffer for barrier */
    pthread_mutex_t stage_mu;
    void *stage_dev, *stage_host;   /* host staging: device and pinned memory */
    size_t stage_len;
    uint64_t seq;                /* collectives issued, for messages (under mu) */
    atomic_int stop;             /* an abort is coming: in-progress polls bail out */
    atomic_int broken;           /* 1 once failed or destroyed: broken_st/_msg are final */
    atomic_int finalized;        /* destroyed after a successful ncclCommFinalize */
    ddp_status broken_st;
    char broken_msg[1024];
    atomic_int refs;             /* the owner + each unreleased work */
    pthread_mutex_t ev_mu;       /* guards ev_free/ev_nfree */
    ddp_cu_event ev_free[DDP_NCCL_EVENT_POOL];   /* completed events to reuse */
    int ev_nfree;
};

struct ddp_nccl_work {
    ddp_nccl_comm *comm;         /* counted reference */
    ddp_cu_event done;           /* recorded on the comm stream after the op */
    int64_t deadline_ms;
    int64_t timeout_ms;          /* for messages */
    ddp_coll_kind kind;
    ddp_dtype dtype;
    size_t count;                /* all_to_all: elements sent in all; batch: sends */
    size_t count2;               /* all_to_all: elements received in all; batch: receives */
    uint64_t seq;
    pthread_mutex_t mu;          /* guards the transition out of pending */
    atomic_int state;            /* 0 pending, 1 succeeded, 2 failed */
    ddp_status st;
    char msg[1536];
};

/* The status for a failed NCCL result: network-ish failures (a peer gone,
 * a socket error) become DistNetworkError, the rest DistBackendError. */
ddp_status ddp_nccl_status_of(ddp_nc_result r);

/* Destroy the pooled completion events (the last release; c's device is
 * current). */
void ddp_nccl_events_free(ddp_nccl_comm *c);

/* Make the communicator's device current on this thread (if it is not). */
ddp_status ddp_nccl_use_device(ddp_nccl_comm *c);

/* Break the communicator with st and a formatted message (the first
 * failure wins): abort the NCCL communicator. _locked: the caller holds mu. */
void ddp_nccl_fail(ddp_nccl_comm *c, ddp_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void ddp_nccl_fail_locked(ddp_nccl_comm *c, ddp_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* An NCCL call on c returned r (mu held). Wait while it is in progress,
 * until w ends, intr (may be NULL) says to stop, or `stop` is set; on error
 * break the communicator. Returns DDP_OK once the call took effect, else the
 * communicator's failure. */
ddp_status ddp_nccl_settle_locked(ddp_nccl_comm *c, ddp_nc_result r, const char *what,
                                  ddp_wait w, const ddp_nccl_interrupt *intr);

/* "NCCL all_reduce #12 (1024 x float32) on rank 3 (cuda:3)" into buf; for
 * all_to_all and batches the sizes are count/count2 as in ddp_nccl_work. */
const char *ddp_nccl_describe(const ddp_nccl_comm *c, ddp_coll_kind k, uint64_t seq,
                              size_t count, size_t count2, ddp_dtype t, char *buf, size_t len);

/* NCCL's text for r plus its last error detail, into buf. */
const char *ddp_nccl_errtext(const ddp_nccl_comm *c, ddp_nc_result r, char *buf, size_t len);

/* Sleep *us microseconds and double it, up to 1 ms (polling back-off). */
void ddp_nccl_nap(int *us);

/* A new pending work on c for args a (takes a reference to c), or NULL. */
ddp_nccl_work *ddp_nccl_work_new(ddp_nccl_comm *c, const ddp_coll_args *a, int64_t timeout_ms);

#endif
