/* ddp_reducer_int.h - the reducer's private state, shared by the files that
 * implement it (ddp_reducer.c: readiness; ddp_reducer_data.c: the CPU data
 * path). Nothing outside the reducer includes it. */
#ifndef DDP_REDUCER_INT_H
#define DDP_REDUCER_INT_H

#include "ddp_reducer.h"

struct ddp_reducer {
    ddp_plan plan;            /* owned */

    /* readiness of the current synced iteration (reset by begin) */
    int in_iter;
    uint8_t *ready;           /* [nparams] */
    size_t *pending;          /* [nbuckets] members not ready yet */
    size_t next_launch;       /* first bucket not yet handed out */
    size_t *arrival;          /* [nparams] ready order */
    size_t narrival;
    int32_t *used;            /* [nparams] local use since the last synced iteration */

    /* data path (attach); buffers and copy-back targets are borrowed */
    void **bufs;              /* [nbuckets], NULL until attached */
    const ddp_reducer_ops *ops;
    void *ctx;
    int world;
    void **works;             /* [nbuckets] launched, not yet waited for */
    void *used_work;          /* the use-flag all-reduce in flight */
    int used_launched;
    size_t next_wait;         /* first bucket finish has not waited for */
    void **copy_back;         /* [nparams] */
    int32_t *used_global;     /* [nparams] reduced use flags (the wire buffer) */
    ddp_status failed;        /* first failure of this iteration */
    char failed_msg[1024];
};

/* Record the first failure of the iteration (message from ddp_last_error). */
void ddp_reducer_fail(ddp_reducer *r, ddp_status st);

#endif
