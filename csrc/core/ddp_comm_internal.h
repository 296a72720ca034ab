/* ddp_comm_internal.h - the communicator's private state, shared by the files
 * that implement it: ddp_comm_boot.c (rendezvous, version check, peer
 * connections), ddp_comm_queue.c (work queue, worker thread), ddp_comm.c
 * (subgroups, lifetimes) and ddp_comm_shm.c (the same-host upgrade of links). Nothing outside the
 * communicator includes it.
 *
 * Who owns what: a communicator made by ddp_comm_create (a "root") owns the
 * links, the rendezvous strings, the data port with its acceptor thread and
 * the engine (queue, worker, broken state).
 * A subgroup owns only its rank map, its borrowed-link array and its group
 * state; it holds a reference on its root and uses the root's engine. Only
 * the thread that runs a collective (the worker, or a caller running a small
 * one inline while the engine is idle; `running` says one does) touches
 * group state (seq, scratch, the group's link cache); `mu` of the root
 * guards the queue, running, stopping, broken, the root's link table
 * (links, slot) and the freeing of links.
 *
 * Links are made on first use (ddp_comm_link.c): the root's `links` is the
 * table of made links, written under mu by whichever thread made one (the
 * thread running a collective, or the acceptor); each group reads its own
 * cache of it (group.links: glinks for a root, the subgroup's array for a
 * subgroup), filled by ddp_group_need through the connect hook.
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
    ddp_link **links;      /* root: [size] the links made so far (mu), owned;
                            * subgroup: [size] its cache of the root's links */
    ddp_link **glinks;     /* root: [size] the root group's cache of links (group.links) */
    char **lines;          /* [size] rendezvous lines (root only) */
    char *prefix;          /* the group's store key prefix, round included (root only) */
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
    int used;              /* a collective was recorded, on any group over the root (mu) */
    ddp_store *stall_store; /* where a timeout is announced (ddp_comm_set_stall_store) */
    char *stall_prefix;

    /* Links on first use (ddp_comm_link.c); root only. */
    struct ddp_listen_reg *lreg; /* this group's registration with the process's data
                            * port (ddp_listen.h), from rendezvous to destroy */
    int nsocks;            /* sockets per TCP pair (PYDDP_NSOCKS_PERPEER, the same everywhere) */
    uint64_t link_tag;     /* the group tag every hello carries */
    const struct ddp_auth *auth;  /* PYDDP_AUTH_TOKEN, or NULL */
    unsigned char *slot;   /* [size] DDP_SLOT_* of each peer (mu) */
    struct ddp_pend **pend;/* [size] connections the acceptor is still completing (its own) */
    char slot_err[700];    /* why the acceptor last failed a peer's connection (mu) */
    ddp_status slot_st;    /* and its status */
    pthread_cond_t link_cv;/* signalled under mu when a slot changes or the comm breaks */
    atomic_int acceptor_stop; /* set at destroy: serving a peer's connection gives up */
    int nlinks;            /* links made so far (mu) */
    int dials, dials_refused; /* this rank's dials; those answered DDP_HELLO_DUPLICATE (mu) */
};

/* What a root knows of its link to one peer (slot[], under mu). */
enum {
    DDP_SLOT_NONE = 0,     /* no link and nobody making one */
    DDP_SLOT_DIALING,      /* a thread of this rank is connecting to the peer */
    DDP_SLOT_WAITING,      /* the peer is connecting to this rank (its dial wins): wait */
    DDP_SLOT_INCOMING,     /* the acceptor is completing the peer's connection */
    DDP_SLOT_READY,        /* links[peer] is the link */
    DDP_SLOT_FAILED        /* the acceptor failed the peer's connection (slot_err) */
};

/* Rendezvous (ddp_comm_boot.c): opens the data port (lfd) and fills lines,
 * desc and host_ids of a freshly allocated root c; makes no link. On
 * failure the caller frees c. */
ddp_status ddp_comm_bootstrap(ddp_comm *c, const ddp_comm_config *cfg, ddp_store *store);

/* Mark c's communicator broken (the first reason wins), set its abort flag
 * and shut every link down so that peers blocked on this rank see EOF at
 * once (ddp_comm.c). Any thread; caller holds no lock. */
void ddp_comm_break(ddp_comm *c, const char *reason);

/* The worker thread of a root communicator (ddp_comm_queue.c): runs queued
 * work in order until the root is stopping and the queue is empty. */
void *ddp_comm_worker_main(void *arg);

/* Pieces of the rendezvous (ddp_comm_boot.c), shared with the round
 * agreement (ddp_comm_round.c):
 * ddp_comm_line: this rank's line (version, wire, address, port, host
 * identity, nsocks), malloc'd, NULL when out of memory.
 * ddp_comm_gather (rank 0): the lines of ranks first..size-1 into c->lines,
 * from the keys fmt (printf with cfg->prefix and the rank, a size_t) makes:
 * one WAIT for all, one MULTI_GET; a rank that never came is named. With t0
 * != 0 it waits in slices watching for authentication failures since t0.
 * ddp_comm_verdict (rank 0, after gathering with status st): with check,
 * versions and settings checked; the member table, or the error text every
 * rank then raises ("error <status>", a newline, the message); *table
 * malloc'd (NULL when out of memory).
 * ddp_comm_read_table: fill c->lines from rank 0's table, or fail with its
 * verdict. ddp_comm_wait_get: key's value (NUL-terminated, malloc'd), waiting
 * for it by w; with t0 != 0 in slices watching for authentication failures;
 * DDP_ERR_TIMEOUT without a message when w expires. */
char *ddp_comm_line(ddp_comm *c, const ddp_comm_config *cfg, int port);
ddp_status ddp_comm_gather(ddp_comm *c, const ddp_comm_config *cfg, ddp_store *store,
                           const char *fmt, size_t first, ddp_wait w, int64_t t0);
ddp_status ddp_comm_verdict(ddp_comm *c, ddp_status st, int check, char **table);
ddp_status ddp_comm_read_table(ddp_comm *c, char *tab);
ddp_status ddp_comm_wait_get(ddp_comm *c, const ddp_comm_config *cfg, ddp_store *store,
                             const char *key, const char *what, ddp_wait w, int64_t t0,
                             char **val);

/* The round agreement (ddp_comm_round.c), for cfg->agree_round: publish
 * line, agree on a round with the other ranks and read rank 0's table into
 * c->lines; *prefix (malloc'd) is "<cfg->prefix>/<round>". */
ddp_status ddp_comm_agree(ddp_comm *c, const ddp_comm_config *cfg, ddp_store *store,
                          const char *line, ddp_wait w, char **prefix);

/* Field `name` of a "k=v;k=v" rendezvous line into out (ddp_comm_boot.c):
 * 0 if found, else -1 and out = "". */
int ddp_comm_line_field(const char *line, const char *name, char *out, size_t outlen);

/* FNV-1a hash of a string (group tags). */
uint64_t ddp_comm_hash(const char *s);

/* Whether root c's rank r shares this rank's host (same host identity). */
int ddp_comm_same_host(const ddp_comm *c, int r);

/* Upgrade a new TCP link *l to same-host peer p to shared memory where it
 * is available and not disabled (PYDDP_SHM_DISABLE=1) (ddp_comm_shm.c): the
 * accepting side offers, the dialing side answers; both always exchange the
 * offer and the ack, so they agree on the transport. *l is replaced by the
 * new link (which owns the TCP one); unchanged for peers on other hosts. */
ddp_status ddp_comm_pair_shm(ddp_comm *c, int p, int accepting, ddp_link **l, ddp_wait w);

/* Links on first use (ddp_comm_link.c). ddp_comm_listen registers root c
 * with the process's data port (its port in *port) at rendezvous; links_start
 * (after the rendezvous) lets peers' connections in; links_stop unregisters
 * (no connection is served for c after it returns) and frees what was held. */
ddp_status ddp_comm_listen(ddp_comm *c, const char *bind_host, int lo, int hi, int *port);
ddp_status ddp_comm_links_start(ddp_comm *c);
void ddp_comm_links_stop(ddp_comm *c);
/* The connect hook of every group over root c (ddp_group.connect): the link
 * to the group's rank p of communicator ctx (a root or a subgroup), made now
 * if nobody made it yet, or (mutual, p the higher world rank) first awaited
 * for a grace as p's dial; by w. Thread-safe. */
ddp_status ddp_comm_connect(void *ctx, int p, int mutual, ddp_wait w, ddp_link **out);

#endif
