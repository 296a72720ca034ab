/* ddp_coll_hier.c - hierarchical all-reduce, reduce-scatter, all-gather
 * and broadcast for groups that span several hosts with several ranks on some of them.
 *
 * Between hosts the network, not memory, is the limit. A flat ring over
 * h hosts of L ranks each crosses every host boundary with 2(n-1)/n of the
 * buffer on one connection; here each host first combines its ranks' data
 * over the same-host links (shared memory), then only the reduced data
 * crosses the network: every host sends and receives 2(h-1)/h of the
 * buffer, the minimum, and when every host has the same number of ranks the
 * buffer is cut into L slices so that each local rank carries one slice
 * across the network on its own rail (its counterparts on the other hosts)
 * in parallel:
 *
 *   all_reduce      local reduce-scatter (slice j to local rank j), rail
 *                   all-reduce of slice j, local all-gather; pipelined
 *                   over pieces of the buffer so the host and network
 *                   stages overlap (ddp_coll_hier_pipe.c).
 *   reduce_scatter  the input regrouped so that local rank j's slice is the
 *                   blocks of rail j's ranks, local reduce-scatter, rail
 *                   reduce-scatter.
 *   all_gather      rail all-gather into the regrouped layout, local
 *                   all-gather, then each block copied to its rank's place.
 *   broadcast       one pipelined chain in host order from the root, so the
 *                   buffer enters each host once (any rank numbering). Under
 *                   auto, only where the flat chain (rank order from the root)
 *                   crosses between hosts more often than that: where it does
 *                   not, it enters every host once too (ranks numbered host by
 *                   host), and the flat path runs it.
 *
 * With unequal hosts (2 ranks on one, 1 on another) all_reduce runs on the
 * hosts' first ranks instead: local reduce-scatter and all-gather, ring
 * all-reduce among the leaders, broadcast within each host; reduce_scatter
 * and all_gather keep the flat ring there (ddp_coll_hier_applies).
 *
 * Every element's final value (AVG's division by the whole group's size
 * included) is computed by exactly one rank and copied to the others, so all
 * ranks hold identical bytes, as with the flat ring. Only types whose
 * partial sums travel in the element type take this path (integer AVG
 * keeps the flat ring's exact wide sums). The header of the call was
 * exchanged on the whole group before any of this, so mismatches are
 * caught as before; a failing link fails the call as on the ring.
 */
#include "ddp_coll_internal.h"

#include <string.h>

/* Host changes along the flat chain broadcast from root (positions root,
 * root+1, ..., wrapping): the times its buffer crosses between hosts. */
static int flat_chain_crossings(const ddp_group *g, int root) {
    int crossings = 0;
    for (int p = 0; p + 1 < g->size; p++)
        crossings += g->host[(root + p) % g->size] != g->host[(root + p + 1) % g->size];
    return crossings;
}

int ddp_coll_hier_applies(ddp_group *g, const ddp_coll_args *a) {
    const ddp_hier *h = g->hier;
    if (h == NULL || g->algo == DDP_ALGO_FLAT || g->algo == DDP_ALGO_BLOCK) return 0;
    const int reduces = a->kind == DDP_COLL_ALLREDUCE || a->kind == DDP_COLL_REDUCE_SCATTER;
    if (reduces && ddp_coll_wire_wide(a->dtype, a->op)) return 0;
    if (g->algo == DDP_ALGO_AUTO) {
        /* auto: only when some host has several ranks (else it is the ring), and
         * for large messages (three stages cost more latency than the ring's) */
        if (g->nhosts == g->size || ddp_coll_call_bytes(g, a) < g->hier_min_bytes) return 0;
        /* a flat chain that already enters every host once (ranks numbered host by
         * host) moves the same bytes between hosts as the host-order one: keep it */
        if (a->kind == DDP_COLL_BROADCAST && flat_chain_crossings(g, a->root) == g->nhosts - 1)
            return 0;
    }
    switch (a->kind) {
    case DDP_COLL_ALLREDUCE: case DDP_COLL_BROADCAST: return 1;
    case DDP_COLL_REDUCE_SCATTER: case DDP_COLL_ALLGATHER: return h->uniform;
    default: return 0;
    }
}

/* Broadcast along one pipelined chain that visits the hosts one after the
 * other, the root's first (root, then its host's other ranks, then each next
 * host's ranks): the buffer crosses into each host once, the minimum, however
 * the ranks are numbered (a chain in rank order crosses at every change of
 * host). */
static ddp_status hier_broadcast(ddp_group *g, const ddp_coll_args *a, ddp_wait w) {
    ddp_hier *h = g->hier;
    const int n = g->size, rh = g->host[a->root];
    int pos = 0;
    h->order[pos++] = a->root;
    for (int k = 0; k < g->nhosts; k++)
        for (int r = 0; r < n; r++)
            if (g->host[r] == (rh + k) % g->nhosts && r != a->root) h->order[pos++] = r;
    for (int p = 0; p < n; p++) {
        h->chain.links[p] = g->links[h->order[p]];
        if (h->order[p] == g->rank) h->chain.rank = p;
    }
    ddp_coll_args b = *a;
    b.root = 0;
    return ddp_coll_chain_broadcast(&h->chain, &b, w);
}

/* Unequal hosts: each host's sum on every local rank, the hosts' first
 * ranks all-reduce it, then broadcast it within their hosts. */
static ddp_status allreduce_leaders(ddp_group *g, const ddp_coll_args *a, ddp_wait w) {
    ddp_hier *h = g->hier;
    const size_t es = ddp_dtype_size(a->dtype);
    ddp_status st = ddp_coll_ring_rs_inplace(&h->local, a->dtype, a->op, a->buf, a->count, w);
    if (st == DDP_OK) st = ddp_coll_ring_ag_inplace(&h->local, a->buf, a->count, es, w);
    if (st != DDP_OK) return st;
    if (h->lrank == 0) {
        size_t off, len;
        if ((st = ddp_coll_ring_rs_inplace(&h->rail, a->dtype, a->op, a->buf, a->count, w)))
            return st;
        ddp_coll_block(a->count, g->nhosts, h->myhost, &off, &len);
        char *mine = (char *)a->buf + off * es;
        ddp_coll_wire_store(a->dtype, a->op, mine, mine, len, g->size);
        if ((st = ddp_coll_ring_ag_inplace(&h->rail, a->buf, a->count, es, w)) != DDP_OK)
            return st;
    }
    ddp_coll_args b = {.kind = DDP_COLL_BROADCAST, .dtype = a->dtype, .count = a->count,
                       .buf = a->buf, .root = 0};
    return ddp_coll_chain_broadcast(&h->local, &b, w);
}

/* Block of (host k, local index j) in the regrouped layout: local index
 * major, so local rank j's slice is rail j's blocks in host order. */
static size_t regrouped(int nhosts, int k, int j) {
    return (size_t)j * (size_t)nhosts + (size_t)k;
}

static ddp_status hier_reduce_scatter(ddp_group *g, const ddp_coll_args *a, ddp_wait w) {
    ddp_hier *h = g->hier;
    const int nh = g->nhosts, L = h->per_host;
    const size_t blk = a->count * ddp_dtype_size(a->dtype), n = (size_t)g->size;
    char *p;
    ddp_status st = ddp_coll_scratch(g, n * blk, (void **)&p);
    if (st != DDP_OK) return st;
    for (int j = 0; j < L; j++)
        for (int k = 0; k < nh; k++)
            memcpy(p + regrouped(nh, k, j) * blk,
                   (const char *)a->sendbuf + (size_t)h->rank_at[k * L + j] * blk, blk);
    if ((st = ddp_coll_ring_rs_inplace(&h->local, a->dtype, a->op, p, n * a->count, w)))
        return st;
    char *slice = p + regrouped(nh, 0, h->lrank) * blk;
    if ((st = ddp_coll_ring_rs_inplace(&h->rail, a->dtype, a->op, slice,
                                       (size_t)nh * a->count, w)) != DDP_OK)
        return st;
    ddp_coll_wire_store(a->dtype, a->op, a->recvbuf, slice + (size_t)h->myhost * blk, a->count,
                        g->size);
    return DDP_OK;
}

static ddp_status hier_all_gather(ddp_group *g, const ddp_coll_args *a, ddp_wait w) {
    ddp_hier *h = g->hier;
    const int nh = g->nhosts, L = h->per_host;
    const size_t es = ddp_dtype_size(a->dtype), blk = a->count * es, n = (size_t)g->size;
    char *p;
    ddp_status st = ddp_coll_scratch(g, n * blk, (void **)&p);
    if (st != DDP_OK) return st;
    char *slice = p + regrouped(nh, 0, h->lrank) * blk;
    memcpy(slice + (size_t)h->myhost * blk, a->sendbuf, blk);
    if ((st = ddp_coll_ring_ag_inplace(&h->rail, slice, (size_t)nh * a->count, es, w)))
        return st;
    if ((st = ddp_coll_ring_ag_inplace(&h->local, p, n * a->count, es, w)) != DDP_OK) return st;
    for (int j = 0; j < L; j++)
        for (int k = 0; k < nh; k++)
            memcpy((char *)a->recvbuf + (size_t)h->rank_at[k * L + j] * blk,
                   p + regrouped(nh, k, j) * blk, blk);
    return DDP_OK;
}

ddp_status ddp_coll_hier_run(ddp_group *g, const ddp_coll_args *a, ddp_wait w) {
    ddp_hier_refresh(g);
    switch (a->kind) {
    case DDP_COLL_ALLREDUCE:
        return g->hier->uniform ? ddp_coll_hier_pipeline(g, a, w) : allreduce_leaders(g, a, w);
    case DDP_COLL_REDUCE_SCATTER: return hier_reduce_scatter(g, a, w);
    case DDP_COLL_ALLGATHER: return hier_all_gather(g, a, w);
    case DDP_COLL_BROADCAST: return hier_broadcast(g, a, w);
    default: break;
    }
    return ddp_error(DDP_ERR_INTERNAL, "no hierarchical algorithm for %s", ddp_coll_name(a->kind));
}
