/* ddp_comm_internal.h - the communicator's private state, shared by the files
 * that implement it: ddp_comm_boot.c (rendezvous, version check, peer
 * connections), ddp_comm_queue.c (work queue, worker thread), ddp_comm.c
 * (subgroups, lifetimes) and ddp_comm_shm.c (the same-host upgrade of links). Nothing outside the
 * communicator includes it.
 *
 * Who owns what: a communicator made by ddp_comm_create (a "root") owns the
 * links, the rendezvous strings and the engine (queue, worker, broken state).
 * A subgroup owns only its rank map, its borrowed-link array and its group
 * state; it holds a reference on its root and uses the root's engine. Only
 * the thread that runs a collective (the worker, or a caller running a small
 * one inline while the engine is idle; `running` says one does) touches
 * links and group state (seq, scratch); `mu` of the root guards the queue,
 * running, stopping, broken and the freeing of links.
 */
#ifndef DDP_COMM_INTERNAL_H
#define DDP_COMM_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include "ddp_comm.h"
#include "ddp_flight.h"

struct ddp_comm {
    int rank, size;        /* in this group */
    int64_t timeout_ms;
    ddp_link **links;      /* [size]; links[rank] == NULL. Owned by a root,
                            * borrowed from the root by a subgroup */
    char **lines;          /* [size] rendezvous lines (root only) */
    char **desc;           /* [size] "rank r (host:port)" (root owns; subgroup borrows) */
    char **host_ids;       /* [size] host identities (root owns; subgroup borrows) */
    ddp_group group;       /* worker-thread state for the algorithms */

    /* Progress of this group (root->mu): collectives queued and finished
     * (point-to-point excluded, so these match the group's sequence numbers),
     * and the last one that finished. */
    uint64_t submitted, completed;
    ddp_flight_entry last_done;

    struct ddp_comm *root; /* self for a root; the parent's root for a subgroup */
    int *members;          /* subgroup: [size] root rank of each group rank; NULL for a root */
    atomic_int refs;
    int destroyed;         /* set by ddp_comm_destroy (under root->mu) */

    /* Engine: used on the root only. */
    pthread_t worker;
    int has_worker;
    pthread_mutex_t mu;    /* guards the queue, stopping, broken, destroyed, links' lifetime */
    pthread_cond_t cv;
    struct ddp_work *head, *tail;
    atomic_int queued;     /* works in the queue (written under mu; the idle worker spins on it) */
    int stopping;
    int running;           /* a collective is running: the worker's, or an inline one */
    int inline_run;        /* the running one is inline, on inline_thread */
    pthread_t inline_thread;
    int destroy_deferred;  /* destroy was called on inline_thread during its run: the
                            * inline run finishes it when it returns */
    int broken;
    char broken_msg[1400];
    atomic_int abort_flag; /* set when broken: every wait returns ABORTED */
    ddp_flight flight;     /* the last collectives of every group (mu) */
    ddp_store *stall_store; /* where a timeout is announced (ddp_comm_set_stall_store) */
    char *stall_prefix;
};

/* Rendezvous and connect (ddp_comm_boot.c): fills rank, size, links, lines,
 * desc and host_ids of a freshly allocated root c. On failure the caller
 * frees c. */
ddp_status ddp_comm_bootstrap(ddp_comm *c, const ddp_comm_config *cfg, ddp_store *store);

/* Mark c's communicator broken (the first reason wins), set its abort flag
 * and shut every link down so that peers blocked on this rank see EOF at
 * once (ddp_comm.c). Any thread; caller holds no lock. */
void ddp_comm_break(ddp_comm *c, const char *reason);

/* The worker thread of a root communicator (ddp_comm_queue.c): runs queued
 * work in order until the root is stopping and the queue is empty. */
void *ddp_comm_worker_main(void *arg);

/* FNV-1a hash of a string (group tags). */
uint64_t ddp_comm_hash(const char *s);

/* Replace TCP links to same-host peers by faster transports where one is
 * available and not disabled (PYDDP_SHM_DISABLE=1). Collective over the
 * existing links; on failure the caller destroys the communicator. */
ddp_status ddp_comm_upgrade_links(ddp_comm *c, ddp_wait w);

#endif
