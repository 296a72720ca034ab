/* ddp_coll_ring.c - bandwidth-path all-reduce, all-gather and
 * reduce-scatter on a ring (rank r sends to r+1 and receives from r-1).
 *
 * All-reduce = reduce-scatter then all-gather: each rank sends and receives
 * 2*(size-1)/size of the buffer, the minimum for any algorithm. Every step
 * uses ddp_link_sendrecv so that sending to the next rank and receiving from
 * the previous one overlap. The reduce-scatter moves data in chunks of
 * g->chunk_bytes: each chunk is received into scratch and reduced into place
 * while the kernel keeps buffering the next one. Each block's final value is
 * computed by exactly one rank and then copied to all, so every rank ends
 * with identical bytes. Partial sums travel in the wire type
 * (ddp_coll_wire_wide): for integer AVG the input is staged in int64 (int8,
 * uint8, int32) or 128-bit (int64) sums, so that no partial sum wraps and
 * the final floor division gives the exact mean; float16/bfloat16 travel in
 * their own type, combined in float32 and rounded at each step, so they
 * cost half the bytes of float32. The all-gather moves the finished
 * elements in their own type.
 */
#include "ddp_coll_internal.h"

#include <string.h>

static int ring_mod(int x, int n) { return ((x % n) + n) % n; }

/* One ring reduce-scatter over `count` wire-type elements (of the wire
 * type of t and op, wes bytes each) split into size blocks;
 * afterwards this rank holds the reduction of block `rank`. Block b's input
 * is src + off(b). In place (inplace != NULL, equal to src) block b
 * accumulates where it is; otherwise partial sums alternate between alt[0]
 * and alt[1] (each one block long) and the last step writes dst. */
typedef struct ring_rs {
    ddp_dtype t;        /* the element type: combining is ddp_coll_wire_combine(t, op) */
    ddp_redop op;
    size_t wes;         /* bytes per accumulator element */
    size_t count;
    const char *src;
    char *inplace;
    char *alt[2];
    char *dst;
    char *rtmp; /* one chunk: where received partial sums land */
} ring_rs;

/* The previous rank first: it is the lower one but for rank 0, so every rank
 * dials its predecessor at once and then finds its successor's dial (see
 * ddp_group_need_mutual). */
ddp_status ddp_coll_ring_need(ddp_group *g, ddp_wait w) {
    ddp_status st = ddp_group_need_mutual(g, ring_mod(g->rank - 1, g->size), w);
    return st == DDP_OK ? ddp_group_need_mutual(g, ring_mod(g->rank + 1, g->size), w) : st;
}

static ddp_status ring_reduce_scatter(ddp_group *g, const ring_rs *p, ddp_wait w) {
    const int n = g->size, me = g->rank;
    const size_t es = p->wes, ce = ddp_coll_chunk_elems(g, es);
    ddp_status need = ddp_coll_ring_need(g, w);
    if (need != DDP_OK) return need;
    ddp_link *next = g->links[ring_mod(me + 1, n)], *prev = g->links[ring_mod(me - 1, n)];
    const char *sent = NULL; /* the partial sums accumulated in the previous step */
    for (int s = 0; s < n - 1; s++) {
        /* Step s: pass on block me-s-1, take in block me-s-2, so that the
         * last step (s = n-2) takes in block `me`. */
        size_t soff, slen, roff, rlen;
        ddp_coll_block(p->count, n, ring_mod(me - s - 1, n), &soff, &slen);
        ddp_coll_block(p->count, n, ring_mod(me - s - 2, n), &roff, &rlen);
        const char *sp = s == 0 ? p->src + soff * es : (p->inplace ? p->inplace + soff * es : sent);
        char *acc = p->inplace ? p->inplace + roff * es : (s == n - 2 ? p->dst : p->alt[s & 1]);
        const char *own = p->src + roff * es;
        const size_t steps = slen > rlen ? slen : rlen;
        for (size_t c = 0; c < steps; c += ce) {
            size_t sn = c < slen ? (slen - c < ce ? slen - c : ce) : 0;
            size_t rn = c < rlen ? (rlen - c < ce ? rlen - c : ce) : 0;
            ddp_status st = ddp_link_sendrecv(next, sp + c * es, sn * es, prev, p->rtmp,
                                              rn * es, w);
            if (st != DDP_OK) return st;
            ddp_coll_wire_combine(p->t, p->op, acc + c * es, own + c * es, p->rtmp, rn);
        }
        sent = acc;
    }
    return DDP_OK;
}

/* Ring all-gather over `count` elements split into size blocks: this rank
 * holds block `rank` of data; afterwards every block is filled in. Received
 * blocks land directly in place and are forwarded from there. */
static ddp_status ring_all_gather(ddp_group *g, char *data, size_t count, size_t es,
                                  ddp_wait w) {
    const int n = g->size, me = g->rank;
    ddp_status need = ddp_coll_ring_need(g, w);
    if (need != DDP_OK) return need;
    ddp_link *next = g->links[ring_mod(me + 1, n)], *prev = g->links[ring_mod(me - 1, n)];
    for (int s = 0; s < n - 1; s++) {
        size_t soff, slen, roff, rlen;
        ddp_coll_block(count, n, ring_mod(me - s, n), &soff, &slen);
        ddp_coll_block(count, n, ring_mod(me - s - 1, n), &roff, &rlen);
        ddp_status st = ddp_link_sendrecv(next, data + soff * es, slen * es, prev,
                                          data + roff * es, rlen * es, w);
        if (st != DDP_OK) return st;
    }
    return DDP_OK;
}

ddp_status ddp_coll_ring_rs_inplace(ddp_group *g, ddp_dtype t, ddp_redop op, void *data,
                                    size_t count, ddp_wait w) {
    if (g->size == 1 || count == 0) return DDP_OK;
    const size_t es = ddp_dtype_size(t), chunk = ddp_coll_chunk_elems(g, es) * es;
    void *mem;
    ddp_status st = ddp_coll_scratch(g, chunk, &mem);
    if (st != DDP_OK) return st;
    ring_rs p = {.t = t, .op = op, .wes = es, .count = count, .src = data, .inplace = data,
                 .rtmp = mem};
    return ring_reduce_scatter(g, &p, w);
}

ddp_status ddp_coll_ring_ag_inplace(ddp_group *g, void *data, size_t count, size_t es,
                                    ddp_wait w) {
    return g->size == 1 || count == 0 ? DDP_OK : ring_all_gather(g, data, count, es, w);
}

ddp_status ddp_coll_ring_allreduce(ddp_group *g, const ddp_coll_args *a, ddp_wait w) {
    const int n = g->size, me = g->rank, wide = ddp_coll_wire_wide(a->dtype, a->op);
    const size_t es = ddp_dtype_size(a->dtype), wes = ddp_coll_wire_size(a->dtype, a->op);
    const size_t stage = wide ? ddp_coll_align(a->count * wes) : 0;
    const size_t chunk = ddp_coll_chunk_elems(g, wes) * wes;
    if (n == 1) return DDP_OK; /* AVG over one rank is the identity */
    if (ddp_coll_slice_applies(g, a)) return ddp_coll_slice_allreduce(g, a, w);
    void *mem;
    ddp_status st = ddp_coll_scratch(g, stage + chunk, &mem);
    if (st != DDP_OK) return st;
    char *data = wide ? mem : a->buf;
    if (wide) ddp_acc_load(a->dtype, a->op, data, a->buf, a->count);
    ring_rs p = {.t = a->dtype, .op = a->op, .wes = wes, .count = a->count, .src = data,
                 .inplace = data, .rtmp = (char *)mem + stage};
    if ((st = ring_reduce_scatter(g, &p, w)) != DDP_OK) return st;
    size_t off, len;
    ddp_coll_block(a->count, n, me, &off, &len);
    /* native: finish in place; wide: round/divide into this rank's block */
    ddp_coll_wire_store(a->dtype, a->op, (char *)a->buf + off * es, data + off * wes, len, n);
    return ring_all_gather(g, a->buf, a->count, es, w);
}

ddp_status ddp_coll_ring_allgather(ddp_group *g, const ddp_coll_args *a, ddp_wait w) {
    const size_t es = ddp_dtype_size(a->dtype), b = a->count * es;
    char *mine = (char *)a->recvbuf + (size_t)g->rank * b;
    if (mine != a->sendbuf) memcpy(mine, a->sendbuf, b);
    return ring_all_gather(g, a->recvbuf, a->count * (size_t)g->size, es, w);
}

ddp_status ddp_coll_ring_reduce_scatter(ddp_group *g, const ddp_coll_args *a, ddp_wait w) {
    const int n = g->size, me = g->rank, wide = ddp_coll_wire_wide(a->dtype, a->op);
    const size_t wes = ddp_coll_wire_size(a->dtype, a->op), total = a->count * (size_t)n;
    const size_t chunk = ddp_coll_chunk_elems(g, wes) * wes;
    /* Wide accumulators: the whole input widened, reduced in place. Native:
     * two block-sized areas for partial sums (sendbuf is const). */
    const size_t work = wide ? ddp_coll_align(total * wes) : 2 * ddp_coll_align(a->count * wes);
    void *mem;
    ddp_status st = ddp_coll_scratch(g, work + chunk, &mem);
    if (st != DDP_OK) return st;
    char *base = mem;
    ring_rs p = {.t = a->dtype, .op = a->op, .wes = wes, .count = total, .rtmp = base + work};
    if (wide) {
        ddp_acc_load(a->dtype, a->op, base, a->sendbuf, total);
        p.src = p.inplace = base;
    } else {
        p.src = a->sendbuf;
        p.alt[0] = base;
        p.alt[1] = base + work / 2;
        p.dst = a->recvbuf;
    }
    if (n == 1) {
        if (!wide && a->recvbuf != a->sendbuf) memcpy(a->recvbuf, a->sendbuf, a->count * wes);
    } else if ((st = ring_reduce_scatter(g, &p, w)) != DDP_OK) {
        return st;
    }
    void *mine = wide ? base + (size_t)me * a->count * wes : a->recvbuf;
    ddp_coll_wire_store(a->dtype, a->op, a->recvbuf, mine, a->count, n);
    return DDP_OK;
}
