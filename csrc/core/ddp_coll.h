/* ddp_coll.h - collective algorithms over a set of links.
 *
 * A ddp_group is the view of a communicator that the algorithms need: this
 * rank, the world size, one link per peer (links[rank] is NULL) and a scratch
 * buffer. The communicator (ddp_comm.c) builds it, runs collectives on one
 * thread in call order, and shuts every link down after any failure so that
 * peers blocked on this rank fail fast instead of waiting for the timeout.
 *
 * Every collective starts with a 40-byte header (kind, dtype, op, root, count,
 * sequence number, group tag) that each rank checks against its peers' (on
 * the latency path it travels with the data), so ranks that call different
 * collectives, or the same one with different counts, dtypes, ops or roots,
 * or on different process groups (g->tag differs), fail with
 * DDP_ERR_MISMATCH and a message naming both sides. In groups of up to
 * DDP_COLL_MESH_MAX ranks every rank checks every other's header, so every
 * rank reports the mismatch. Larger groups check headers only between the
 * ranks an algorithm joins (the ring's neighbours, the partners of each
 * O(log size) step): agreement of every neighbouring pair is agreement of
 * all, the ranks next to a difference report it, and the others fail as
 * their links to those close.
 *
 * Links are made on first use (ddp_group_need), so a rank connects only to
 * the peers its algorithms talk to.
 *
 * Buffer conventions (count is always in elements of dtype):
 *   ALLREDUCE       buf: count, in place
 *   BROADCAST       buf: count, in place, from root
 *   REDUCE          buf: count, in place; result only at root, others unchanged
 *   ALLGATHER       sendbuf: count; recvbuf: size*count (rank order)
 *   REDUCE_SCATTER  sendbuf: size*count; recvbuf: count (this rank's block)
 *   GATHER          sendbuf: count; recvbuf: size*count at root (else unused)
 *   SCATTER         sendbuf: size*count at root (else unused); recvbuf: count
 *   SEND / RECV     buf: count, to / from root (the peer rank); a RECV with
 *                   root DDP_ANY_SOURCE takes the first send to this rank
 *                   from any peer (its rank written to *source)
 *   BARRIER         no data
 *   ALLTOALL        sendbuf: block q (scounts[q] elements at sdispls[q]) goes
 *                   to rank q; recvbuf: rank p's block lands at rdispls[p]
 *                   (rcounts[p] elements); the four arrays have size entries;
 *                   sendbuf and recvbuf must not overlap (no in-place form)
 *   P2P_BATCH       ops[0..nops): sends and receives with any peers, all
 *                   concurrent; each op has its own dtype, count and buf
 * sendbuf may equal the matching slice of recvbuf (in-place variants).
 * float16/bfloat16 reductions accumulate in float32. AVG divides once at the
 * end (sum, then divide by size), as torch does; for integers the sum is
 * exact (int64 or 128-bit accumulators) and the division floors, so integer
 * AVG is the exact mean rounded toward minus infinity (see ddp_acc_size).
 */
#ifndef DDP_COLL_H
#define DDP_COLL_H

#include <stddef.h>
#include <stdint.h>
#include "ddp_clock.h"
#include "ddp_dtype.h"
#include "ddp_link.h"
#include "ddp_status.h"

typedef enum ddp_coll_kind {
    DDP_COLL_ALLREDUCE = 1, DDP_COLL_BROADCAST, DDP_COLL_REDUCE,
    DDP_COLL_ALLGATHER, DDP_COLL_REDUCE_SCATTER, DDP_COLL_GATHER,
    DDP_COLL_SCATTER, DDP_COLL_SEND, DDP_COLL_RECV, DDP_COLL_BARRIER,
    DDP_COLL_ALLTOALL, DDP_COLL_P2P_BATCH
} ddp_coll_kind;

/* One send or receive of a P2P_BATCH (torch's P2POp). A rank's k-th send to
 * q pairs with q's k-th receive from this rank (same dtype and count); the
 * order of sends relative to receives does not matter. */
typedef struct ddp_p2p_op {
    int peer;           /* the other rank (never this one) */
    int is_send;        /* 1: send buf to peer; 0: receive from peer into buf */
    ddp_dtype dtype;
    size_t count;       /* elements of dtype */
    void *buf;          /* read for sends, written for receives */
} ddp_p2p_op;

/* RECV's root for "from any peer" (torch's recv without src). */
#define DDP_ANY_SOURCE (-1)

typedef struct ddp_coll_args {
    ddp_coll_kind kind;
    ddp_dtype dtype;
    ddp_redop op;       /* reductions only */
    int root;           /* root, or peer for SEND/RECV (RECV: or DDP_ANY_SOURCE) */
    /* RECV from DDP_ANY_SOURCE: where the sender's group rank is written once
     * the receive succeeded; NULL: not wanted. Borrowed until the work is done. */
    int *source;
    size_t count;       /* elements, see conventions above */
    void *buf;          /* in-place ops: ALLREDUCE, BROADCAST, REDUCE, SEND, RECV */
    const void *sendbuf;
    void *recvbuf;
    /* ALLTOALL: arrays of group size, in elements of dtype (count unused).
     * All arrays and buffers are borrowed until the work is done. */
    const size_t *scounts, *sdispls, *rcounts, *rdispls;
    /* P2P_BATCH: the ops (dtype, count and buffers above unused). */
    int nops;
    const ddp_p2p_op *ops;
} ddp_coll_args;

typedef struct ddp_group {
    int rank, size;
    ddp_link **links;       /* [size]; links[rank] == NULL; NULL for a link not made
                             * yet: algorithms get theirs by ddp_group_need */
    /* How a missing link is made (ddp_group_need): through connect (a
     * communicator's groups), or as parent's link to parent_rank[p] (a view
     * over some of parent's ranks, e.g. the hierarchical algorithms'); with
     * neither, every link must be there. mutual: see ddp_group_need_mutual. */
    ddp_status (*connect)(void *ctx, int p, int mutual, ddp_wait w, ddp_link **out);
    void *connect_ctx;
    struct ddp_group *parent;
    const int *parent_rank;
    uint64_t seq;           /* collectives run so far; advanced by ddp_coll_run */
    uint64_t tag;           /* identifies the group (set by the communicator; in headers) */
    void *scratch;          /* staging memory owned by the group (may grow) */
    size_t scratch_len;
    size_t small_bytes;     /* messages up to this size take the latency path */
    size_t chunk_bytes;     /* pipeline chunk for the bandwidth path */
    int algo;               /* DDP_ALGO_*: PYDDP_ALGO */
    size_t hier_min_bytes;  /* auto: hierarchical from this size up (PYDDP_HIER_MIN_BYTES) */
    int *host;              /* [size] host of each rank (0.. in order of first rank), or NULL */
    int nhosts;             /* distinct hosts among the ranks (1 when host is NULL) */
    struct ddp_hier *hier;  /* views for the hierarchical algorithms, built on first use */
} ddp_group;

/* Groups larger than this check headers with their algorithm's peers only
 * and run small all-reduce, broadcast, reduce and barrier in O(log size)
 * steps (ddp_coll_tree.c); smaller groups do each in one exchange with
 * every peer. */
#define DDP_COLL_MESH_MAX 8

/* Make sure g->links[p] is there (made through g->connect, or as the
 * parent's link, when missing), by w. DDP_OK at once for p == g->rank or a
 * link already made; otherwise the failure names the peer. */
ddp_status ddp_group_need(ddp_group *g, int p, ddp_wait w);

/* ddp_group_need for a link that p needs at the same step of the same
 * algorithm (both ends of a symmetric exchange): where p's own dial would be
 * the one kept (ddp_comm_link.c), it is given a short grace to arrive
 * before this rank dials too, so that the pair makes one connection instead
 * of two of which one is refused. Bounded by that grace: a peer that never
 * dials (dead, or in another call) is dialed afterwards as by
 * ddp_group_need, and named as then. Algorithms whose ranks each need some
 * peers first should need their lower-ranked peers first. */
ddp_status ddp_group_need_mutual(ddp_group *g, int p, ddp_wait w);

/* Bandwidth-path algorithm choice (PYDDP_ALGO). */
#define DDP_ALGO_AUTO 0
#define DDP_ALGO_FLAT 1
#define DDP_ALGO_HIER 2
#define DDP_ALGO_BLOCK 3 /* flat, and on one host the ring block by block (no slices) */

/* Set g's layout from each rank's host identity (ids[r] for rank r; ranks
 * with equal strings share a host) and its algorithm choice from
 * PYDDP_ALGO (an unknown value warns once and means auto) and
 * PYDDP_HIER_MIN_BYTES. Ranks are
 * numbered by host in order of each host's first rank, so every rank
 * computes the same numbering. DDP_ERR_NOMEM on failure (g unchanged). */
ddp_status ddp_group_set_layout(ddp_group *g, const char *const *ids);

/* Free what ddp_group_set_layout and the hierarchical views allocated. */
void ddp_group_free_layout(ddp_group *g);

/* Validate args against the group (before any communication): root range,
 * dtype/op combination, NULL buffers with nonzero count. DDP_ERR_INVALID or
 * DDP_ERR_TYPE with a message; no side effects. */
ddp_status ddp_coll_validate(const ddp_group *g, const ddp_coll_args *a);

/* Run one collective to completion (or failure) before w's deadline. */
ddp_status ddp_coll_run(ddp_group *g, const ddp_coll_args *a, ddp_wait w);

/* Name of a kind, e.g. "all_reduce". */
const char *ddp_coll_name(ddp_coll_kind k);

/* Free the group's scratch memory (links are owned by the communicator). */
void ddp_group_release_scratch(ddp_group *g);

#endif
