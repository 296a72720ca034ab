/* ddp_comm_internal.h - the communicator's private state, shared by the files
 * that implement it (ddp_comm.c: rendezvous and worker; ddp_comm_shm.c: the
 * same-host upgrade of links). Nothing outside the communicator includes it.
 */
#ifndef DDP_COMM_INTERNAL_H
#define DDP_COMM_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include "ddp_comm.h"

struct ddp_comm {
    int rank, size;
    int64_t timeout_ms;
    ddp_link **links;      /* [size], owned; links[rank] == NULL */
    char **lines;          /* [size] rendezvous lines, owned */
    char **desc;           /* [size] "rank r (host:port)", owned */
    char **host_ids;       /* [size] host identities, owned */
    ddp_group group;       /* worker-thread state for the algorithms */

    pthread_t worker;
    int has_worker;
    pthread_mutex_t mu;    /* guards the queue, stopping and broken */
    pthread_cond_t cv;
    struct ddp_work *head, *tail;
    int stopping;
    int running;           /* the worker is running a collective */
    int broken;
    char broken_msg[1400];
    atomic_int abort_flag; /* set when broken: every wait returns ABORTED */
};

/* Replace TCP links to same-host peers by faster transports where one is
 * available and not disabled (PYDDP_SHM_DISABLE=1). Collective over the
 * existing links; on failure the caller destroys the communicator. */
ddp_status ddp_comm_upgrade_links(ddp_comm *c, ddp_wait w);

#endif
