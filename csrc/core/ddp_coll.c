/* ddp_coll.c - entry points of ddp_coll.h: argument validation, the choice
 * between the latency path (one message per peer) and the bandwidth path
 * (header exchange, then ring / chain / direct algorithms, or the
 * hierarchical ones across hosts), and the group's scratch memory. The algorithms live in ddp_coll_small.c, ddp_coll_ring.c
 * and ddp_coll_root.c; the header exchange in ddp_coll_xchg.c; a receive from
 * any source is found in ddp_coll_anysrc.c.
 */
#include "ddp_coll_internal.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

const char *ddp_coll_name(ddp_coll_kind k) {
    switch (k) {
    case DDP_COLL_ALLREDUCE: return "all_reduce";
    case DDP_COLL_BROADCAST: return "broadcast";
    case DDP_COLL_REDUCE: return "reduce";
    case DDP_COLL_ALLGATHER: return "all_gather";
    case DDP_COLL_REDUCE_SCATTER: return "reduce_scatter";
    case DDP_COLL_GATHER: return "gather";
    case DDP_COLL_SCATTER: return "scatter";
    case DDP_COLL_SEND: return "send";
    case DDP_COLL_RECV: return "recv";
    case DDP_COLL_BARRIER: return "barrier";
    case DDP_COLL_ALLTOALL: return "all_to_all";
    case DDP_COLL_P2P_BATCH: return "batch_isend_irecv";
    }
    return "unknown-collective";
}

static int is_p2p(ddp_coll_kind k) { return k == DDP_COLL_SEND || k == DDP_COLL_RECV; }

/* Kinds whose buffers are size*count elements on one side. */
static int is_blocked(ddp_coll_kind k) {
    return k == DDP_COLL_ALLGATHER || k == DDP_COLL_REDUCE_SCATTER || k == DDP_COLL_GATHER ||
           k == DDP_COLL_SCATTER;
}

size_t ddp_coll_call_bytes(const ddp_group *g, const ddp_coll_args *a) {
    size_t b = a->count * ddp_dtype_size(a->dtype);
    return is_blocked(a->kind) ? b * (size_t)g->size : b;
}

static int ranges_overlap(const void *a, size_t alen, const void *b, size_t blen) {
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return alen > 0 && blen > 0 && x < y + blen && y < x + alen;
}

/* Buffers: the ones this rank uses must be non-NULL, and a one-block buffer
 * that overlaps the size-block one must be exactly this rank's block (the
 * in-place form). Off the root, gather's recvbuf and scatter's sendbuf are
 * unused. */
static ddp_status check_buffers(const ddp_group *g, const ddp_coll_args *a) {
    const int me = g->rank, at_root = a->root == me;
    const size_t blk = a->count * ddp_dtype_size(a->dtype);
    const void *one, *all;          /* the one-block and the size-block buffer */
    int all_used = 1, one_is_send = 1;
    switch (a->kind) {
    case DDP_COLL_ALLREDUCE: case DDP_COLL_BROADCAST: case DDP_COLL_REDUCE:
    case DDP_COLL_SEND: case DDP_COLL_RECV:
        if (!a->buf) return ddp_error(DDP_ERR_INVALID, "buf is NULL but count is %zu", a->count);
        return DDP_OK;
    case DDP_COLL_ALLGATHER: case DDP_COLL_GATHER:
        one = a->sendbuf;
        all = a->recvbuf;
        all_used = a->kind == DDP_COLL_ALLGATHER || at_root;
        break;
    case DDP_COLL_REDUCE_SCATTER: case DDP_COLL_SCATTER:
        one = a->recvbuf;
        all = a->sendbuf;
        all_used = a->kind == DDP_COLL_REDUCE_SCATTER || at_root;
        one_is_send = 0;
        break;
    default:
        return DDP_OK;
    }
    const char *one_name = one_is_send ? "sendbuf" : "recvbuf";
    const char *all_name = one_is_send ? "recvbuf" : "sendbuf";
    if (!one) return ddp_error(DDP_ERR_INVALID, "%s is NULL but count is %zu", one_name, a->count);
    if (!all_used) return DDP_OK;
    if (!all) return ddp_error(DDP_ERR_INVALID, "%s is NULL but count is %zu", all_name, a->count);
    const char *mine = (const char *)all + (size_t)me * blk;
    if (ranges_overlap(one, blk, all, blk * (size_t)g->size) && (const char *)one != mine)
        return ddp_error(DDP_ERR_INVALID, "%s overlaps %s but is not rank %d's block of it; for "
                         "the in-place form pass %s + rank * count", one_name, all_name, me,
                         all_name);
    return DDP_OK;
}

ddp_status ddp_coll_validate(const ddp_group *g, const ddp_coll_args *a) {
    if (!g || !a || g->size < 1 || g->rank < 0 || g->rank >= g->size)
        return ddp_error(DDP_ERR_INTERNAL, "collective on an invalid group");
    if (a->kind < DDP_COLL_ALLREDUCE || a->kind > DDP_COLL_P2P_BATCH)
        return ddp_error(DDP_ERR_INVALID, "unknown collective kind %d", (int)a->kind);
    if (a->kind == DDP_COLL_ALLTOALL) return ddp_coll_a2a_validate(g, a);
    if (a->kind == DDP_COLL_P2P_BATCH) return ddp_coll_batch_validate(g, a);
    if (a->kind == DDP_COLL_BARRIER) return DDP_OK;
    ddp_status st = ddp_redop_check(a->dtype, DDP_SUM); /* dtype alone */
    if (st != DDP_OK) return st;
    if (a->kind == DDP_COLL_ALLREDUCE || a->kind == DDP_COLL_REDUCE ||
        a->kind == DDP_COLL_REDUCE_SCATTER) {
        if ((st = ddp_redop_check(a->dtype, a->op)) != DDP_OK) return st;
    }
    const int n = g->size;
    if (a->kind != DDP_COLL_ALLREDUCE && a->kind != DDP_COLL_ALLGATHER &&
        a->kind != DDP_COLL_REDUCE_SCATTER) {
        const char *what = is_p2p(a->kind) ? "peer" : "root";
        if (a->kind == DDP_COLL_RECV && a->root == DDP_ANY_SOURCE) {
            if (n < 2)
                return ddp_error(DDP_ERR_INVALID, "a receive from any rank needs another rank, "
                                 "but the group has only rank %d", g->rank);
        } else if (a->root < 0 || a->root >= n)
            return ddp_error(DDP_ERR_INVALID, "%s %d is out of range for a group of %d ranks "
                             "(valid: 0..%d)", what, a->root, n, n - 1);
        if (is_p2p(a->kind) && a->root == g->rank)
            return ddp_error(DDP_ERR_INVALID, "rank %d cannot %s itself", g->rank,
                             a->kind == DDP_COLL_SEND ? "send to" : "receive from");
    }
    /* Largest scratch need is size * count elements widened to their
     * accumulator type (float32 for half types, up to 16 bytes for integer
     * AVG), with headroom for headers and alignment. */
    size_t es = ddp_dtype_size(a->dtype), wide = es < 4 ? 4 : es;
    if (ddp_acc_size(a->dtype, a->op) > wide) wide = ddp_acc_size(a->dtype, a->op);
    if (a->count > (SIZE_MAX / 4) / (size_t)n / wide)
        return ddp_error(DDP_ERR_INVALID, "count %zu of %s is too large: its size in bytes "
                         "overflows", a->count, ddp_dtype_name(a->dtype));
    return a->count > 0 ? check_buffers(g, a) : DDP_OK;
}

static ddp_status need(ddp_group *g, int p, int mutual, ddp_wait w) {
    if (p < 0 || p >= g->size || p == g->rank || g->links[p]) return DDP_OK;
    ddp_link *l = NULL;
    ddp_status st;
    if (g->parent) {
        const int q = g->parent_rank[p];
        st = need(g->parent, q, mutual, w);
        l = g->parent->links[q];
    } else if (g->connect) {
        st = g->connect(g->connect_ctx, p, mutual, w, &l);
    } else {
        st = ddp_error(DDP_ERR_INTERNAL, "rank %d has no link to rank %d", g->rank, p);
    }
    if (st == DDP_OK) g->links[p] = l;
    return st;
}

ddp_status ddp_group_need(ddp_group *g, int p, ddp_wait w) { return need(g, p, 0, w); }

ddp_status ddp_group_need_mutual(ddp_group *g, int p, ddp_wait w) { return need(g, p, 1, w); }

ddp_status ddp_coll_scratch(ddp_group *g, size_t n, void **out) {
    if (n > g->scratch_len) {
        /* free + malloc rather than realloc: the old contents are not needed. */
        free(g->scratch);
        g->scratch_len = 0;
        if (!(g->scratch = malloc(n)))
            return ddp_error(DDP_ERR_NOMEM, "out of memory allocating %zu bytes of collective "
                             "scratch space", n);
        g->scratch_len = n;
    }
    *out = g->scratch;
    return DDP_OK;
}

void ddp_group_release_scratch(ddp_group *g) {
    free(g->scratch);
    g->scratch = NULL;
    g->scratch_len = 0;
}

void ddp_coll_wire_store(ddp_dtype t, ddp_redop op, void *dst, void *acc, size_t n, int nranks) {
    if (ddp_coll_wire_wide(t, op)) {
        ddp_acc_store(t, op, dst, acc, n, nranks);
        return;
    }
    if (n > 0 && dst != acc) memcpy(dst, acc, n * ddp_dtype_size(t));
    ddp_reduce_finish(t, op, dst, n, nranks);
}

void ddp_coll_block(size_t count, int n, int b, size_t *off, size_t *len) {
    size_t q = count / (size_t)n, r = count % (size_t)n, ub = (size_t)b;
    *off = ub * q + (ub < r ? ub : r);
    *len = q + (ub < r ? 1 : 0);
}

size_t ddp_coll_chunk_elems(const ddp_group *g, size_t esize) {
    size_t bytes = g->chunk_bytes ? g->chunk_bytes : DDP_COLL_DEFAULT_CHUNK;
    return bytes >= esize ? bytes / esize : 1;
}

/* The bandwidth-path algorithm for a kind (after the header exchange). */
static ddp_status run_large(ddp_group *g, const ddp_coll_args *a, ddp_wait w) {
    switch (a->kind) {
    case DDP_COLL_ALLREDUCE: return ddp_coll_ring_allreduce(g, a, w);
    case DDP_COLL_ALLGATHER: return ddp_coll_ring_allgather(g, a, w);
    case DDP_COLL_REDUCE_SCATTER: return ddp_coll_ring_reduce_scatter(g, a, w);
    case DDP_COLL_BROADCAST: return ddp_coll_chain_broadcast(g, a, w);
    case DDP_COLL_REDUCE: return ddp_coll_chain_reduce(g, a, w);
    case DDP_COLL_GATHER: return ddp_coll_direct_gather(g, a, w);
    case DDP_COLL_SCATTER: return ddp_coll_direct_scatter(g, a, w);
    case DDP_COLL_SEND: case DDP_COLL_RECV: return ddp_coll_p2p(g, a, w);
    case DDP_COLL_BARRIER: return DDP_OK;
    case DDP_COLL_ALLTOALL: case DDP_COLL_P2P_BATCH: break; /* run by ddp_coll_run itself */
    }
    return ddp_error(DDP_ERR_INTERNAL, "no algorithm for collective kind %d", (int)a->kind);
}

/* A RECV from DDP_ANY_SOURCE: find the sender (ddp_coll_anysrc.c), then
 * the ordinary receive from it, which prefixes its own errors. */
static ddp_status run_recv_any(ddp_group *g, const ddp_coll_args *a, ddp_wait w) {
    int src = -1;
    ddp_status st = ddp_coll_recv_find(g, a, w, &src);
    if (st != DDP_OK) {
        char what[160];
        const ddp_coll_hdr h = ddp_coll_hdr_make(g, a, DDP_COLL_PATH_SMALL);
        ddp_coll_describe(&h, what, sizeof what);
        return ddp_error_prefix(st, "%s on rank %d of %d: ", what, g->rank, g->size);
    }
    ddp_coll_args from = *a;
    from.root = src;
    from.source = NULL;
    st = ddp_coll_run(g, &from, w);
    if (st == DDP_OK && a->source) *a->source = src;
    return st;
}

ddp_status ddp_coll_run(ddp_group *g, const ddp_coll_args *a, ddp_wait w) {
    /* per-peer sizes: their own header exchange and error prefix */
    if (a->kind == DDP_COLL_ALLTOALL) return ddp_coll_a2a_run(g, a, w);
    if (a->kind == DDP_COLL_P2P_BATCH) return ddp_coll_batch_run(g, a, w);
    if (a->kind == DDP_COLL_RECV && a->root == DDP_ANY_SOURCE) return run_recv_any(g, a, w);
    int small = a->kind == DDP_COLL_BARRIER || ddp_coll_call_bytes(g, a) <= g->small_bytes;
    /* A large group takes the O(log size) path for the kinds it has, and the
     * bandwidth path's neighbour algorithms for the other collectives. */
    const int tree = small && g->size > DDP_COLL_MESH_MAX &&
                     (a->kind == DDP_COLL_ALLREDUCE || a->kind == DDP_COLL_BROADCAST ||
                      a->kind == DDP_COLL_REDUCE || a->kind == DDP_COLL_BARRIER);
    if (small && g->size > DDP_COLL_MESH_MAX && !tree && !is_p2p(a->kind)) small = 0;
    const int path = small ? DDP_COLL_PATH_SMALL
                     : !is_p2p(a->kind) && ddp_coll_hier_applies(g, a) ? DDP_COLL_PATH_HIER
                                                                      : DDP_COLL_PATH_LARGE;
    const ddp_coll_hdr h = ddp_coll_hdr_make(g, a, path);
    ddp_status st;
    if (!is_p2p(a->kind)) g->seq++; /* send/recv involve two ranks only */
    if (tree) {
        st = ddp_coll_tree(g, a, &h, w);
    } else if (small) {
        st = ddp_coll_small(g, a, &h, w);
    } else {
        ddp_coll_xchg x = {.peer = is_p2p(a->kind) ? a->root : -1, .sto = -1, .rfrom = -1};
        ddp_coll_xres res;
        st = ddp_coll_exchange(g, &h, &x, w, &res);
        if (st == DDP_OK) st = path == DDP_COLL_PATH_HIER ? ddp_coll_hier_run(g, a, w)
                                                          : run_large(g, a, w);
    }
    /* Keep scratch for the next call unless one huge call (e.g. float16
     * staging of a giant buffer) grew it far beyond the usual needs. */
    if (g->scratch_len > DDP_COLL_SCRATCH_KEEP) ddp_group_release_scratch(g);
    if (st != DDP_OK) {
        char what[160];
        ddp_coll_describe(&h, what, sizeof what);
        ddp_error_prefix(st, "%s on rank %d of %d: ", what, g->rank, g->size);
    }
    return st;
}
