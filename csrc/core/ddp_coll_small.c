/* ddp_coll_small.c - the latency path: a whole collective in one exchange.
 *
 * For messages up to g->small_bytes the cost is the number of network round
 * trips, not bandwidth, so each rank sends its header and its data together
 * in a single message to every peer that needs them, and receives the same:
 * one message each way per peer, no separate header round. Reductions are
 * then computed locally by every rank that needs the result, combining the
 * contributions in rank order 0..size-1, so every rank gets bit-identical
 * results (float16/bfloat16 accumulate in float32 and round once; integer
 * AVG sums exactly in a wider type, see ddp_acc_size).
 */
#include "ddp_coll_internal.h"

#include <string.h>

/* How the call's payloads travel in the exchange, and how much scratch the
 * local reduction needs afterwards. */
static ddp_coll_xchg plan(const ddp_group *g, const ddp_coll_args *a) {
    const int me = g->rank, root = a->root;
    const size_t es = ddp_dtype_size(a->dtype), b = a->count * es;
    /* room for the rank-ordered contribution list and an accumulator */
    const size_t red = ddp_coll_align((size_t)g->size * sizeof(void *)) +
                       a->count * ddp_acc_size(a->dtype, a->op);
    ddp_coll_xchg x = {.peer = -1, .sto = -1, .rfrom = -1};
    switch (a->kind) {
    case DDP_COLL_ALLREDUCE:
        x.sbase = a->buf, x.sbytes = b, x.rbytes = b, x.extra = red;
        break;
    case DDP_COLL_BROADCAST:
        if (me == root) x.sbase = a->buf, x.sbytes = b;
        else x.rbytes = b, x.rfrom = root;
        break;
    case DDP_COLL_REDUCE:
        if (me == root) x.rbytes = b, x.extra = red;
        else x.sbase = a->buf, x.sbytes = b, x.sto = root;
        break;
    case DDP_COLL_ALLGATHER:
        x.sbase = a->sendbuf, x.sbytes = b, x.rbytes = b;
        break;
    case DDP_COLL_GATHER:
        if (me == root) x.rbytes = b;
        else x.sbase = a->sendbuf, x.sbytes = b, x.sto = root;
        break;
    case DDP_COLL_SCATTER:
        if (me == root) x.sbase = a->sendbuf, x.sbytes = b, x.sstride = b;
        else x.rbytes = b, x.rfrom = root;
        break;
    case DDP_COLL_REDUCE_SCATTER:
        x.sbase = a->sendbuf, x.sbytes = b, x.sstride = b, x.rbytes = b, x.extra = red;
        break;
    case DDP_COLL_SEND: x.peer = root, x.sbase = a->buf, x.sbytes = b; break;
    case DDP_COLL_RECV: x.peer = root, x.rbytes = b, x.rfrom = root; break;
    case DDP_COLL_BARRIER: break;
    case DDP_COLL_ALLTOALL: case DDP_COLL_P2P_BATCH: break; /* never here: own files */
    }
    return x;
}

/* dst = c[0] op c[1] op ... op c[n-1], combined in that order (then AVG's
 * division). dst may be one of the contributions; acc is scratch for
 * count accumulator elements (ddp_acc_size: float32 for half types, int64 or
 * 128-bit sums for integer AVG, so that the mean is exact). */
static void reduce_in_order(const ddp_coll_args *a, void *dst, const void **c, int n, void *acc) {
    const ddp_dtype t = a->dtype;
    const size_t count = a->count;
    if (count == 0) return;
    if (!ddp_acc_is_native(t, a->op)) {
        ddp_acc_load(t, a->op, acc, c[0], count);
        for (int r = 1; r < n; r++) ddp_acc_add(t, a->op, acc, c[r], count);
        ddp_acc_store(t, a->op, dst, acc, count, n);
        return;
    }
    /* Accumulate straight into dst unless dst is a contribution that is
     * still needed after the first step. */
    void *out = dst;
    for (int r = 1; r < n; r++)
        if (c[r] == dst) out = acc;
    if (n == 1) {
        if (out != c[0]) memcpy(out, c[0], count * ddp_dtype_size(t));
    } else {
        ddp_reduce3(t, a->op, out, c[0], c[1], count);
        for (int r = 2; r < n; r++) ddp_reduce(t, a->op, out, c[r], count);
    }
    ddp_reduce_finish(t, a->op, out, count, n);
    if (out != dst) memcpy(dst, out, count * ddp_dtype_size(t));
}

static void copy_block(void *dst, const void *src, size_t bytes) {
    if (bytes > 0 && dst != src) memcpy(dst, src, bytes);
}

ddp_status ddp_coll_small(ddp_group *g, const ddp_coll_args *a, const ddp_coll_hdr *h,
                          ddp_wait w) {
    const int n = g->size, me = g->rank, root = a->root;
    const size_t b = a->count * ddp_dtype_size(a->dtype);
    const ddp_coll_xchg x = plan(g, a);
    ddp_coll_xres r;
    ddp_status st = ddp_coll_exchange(g, h, &x, w, &r);
    if (st != DDP_OK) return st;

    const void **c = r.extra; /* contributions in rank order */
    void *acc = (char *)r.extra + ddp_coll_align((size_t)n * sizeof(void *));
    char *rbuf = a->recvbuf;
    switch (a->kind) {
    case DDP_COLL_ALLREDUCE:
        for (int p = 0; p < n; p++) c[p] = p == me ? r.own : ddp_coll_payload(&r, p);
        reduce_in_order(a, a->buf, c, n, acc);
        break;
    case DDP_COLL_REDUCE:
        if (me != root) break;
        for (int p = 0; p < n; p++) c[p] = p == me ? a->buf : ddp_coll_payload(&r, p);
        reduce_in_order(a, a->buf, c, n, acc);
        break;
    case DDP_COLL_REDUCE_SCATTER:
        for (int p = 0; p < n; p++)
            c[p] = p == me ? (const char *)a->sendbuf + (size_t)me * b : ddp_coll_payload(&r, p);
        reduce_in_order(a, a->recvbuf, c, n, acc);
        break;
    case DDP_COLL_BROADCAST:
        if (me != root) copy_block(a->buf, ddp_coll_payload(&r, root), b);
        break;
    case DDP_COLL_ALLGATHER: case DDP_COLL_GATHER:
        if (a->kind == DDP_COLL_GATHER && me != root) break;
        for (int p = 0; p < n; p++)
            copy_block(rbuf + (size_t)p * b, p == me ? a->sendbuf : ddp_coll_payload(&r, p), b);
        break;
    case DDP_COLL_SCATTER:
        copy_block(a->recvbuf, me == root ? (const char *)a->sendbuf + (size_t)me * b
                                          : ddp_coll_payload(&r, root), b);
        break;
    case DDP_COLL_RECV: copy_block(a->buf, ddp_coll_payload(&r, root), b); break;
    case DDP_COLL_SEND: case DDP_COLL_BARRIER: break;
    case DDP_COLL_ALLTOALL: case DDP_COLL_P2P_BATCH: break;
    }
    return DDP_OK;
}
