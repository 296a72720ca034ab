/* ddp_coll_tree.c - the latency path of large groups: all-reduce, broadcast,
 * reduce and barrier of small messages in O(log size) steps.
 *
 * A group of more than DDP_COLL_MESH_MAX ranks does not send every small
 * collective to every peer (size - 1 messages each way per rank, and a link
 * to every peer). All four kinds run as one recursive doubling: with pof2
 * the largest power of two <= size and rem = size - pof2, each of the first
 * 2*rem ranks that is even hands its value to the next (odd) rank and sits
 * out; the pof2 ranks left exchange values with the rank whose index
 * differs in bit k at step k, log2 pof2 steps; the odd ranks then hand the
 * result back. The value is the accumulator of an all-reduce (and of a
 * reduce, whose result only the root keeps), nothing for a barrier, and for
 * a broadcast the data with a flag saying whether it is the root's (the
 * combination keeps the flagged one).
 *
 * Every message is the call's 40-byte header and the value; the header a
 * rank receives must agree with its own before the value is read. Every
 * rank's result depends on every rank's message, so a rank whose call
 * differs (another root, count, kind or group) is a mismatch for the ranks
 * that exchange with it, and every other rank fails as their links close:
 * no rank completes, none waits for its deadline. A binomial tree would
 * send fewer messages for broadcast and reduce, but ranks outside the
 * branch of a rank with another root would complete, and that rank wait.
 *
 * Values travel in the accumulator type (ddp_acc_size: float32 for half
 * types, wide integers for integer AVG) and are combined as (lower rank's)
 * op (higher rank's), whichever end computes it, so both ends of a step hold
 * bit-identical values and every rank ends with the same result; AVG
 * divides once, at the end.
 */
#include "ddp_coll_internal.h"

#include <string.h>

typedef struct tree {
    ddp_group *g;
    const ddp_coll_hdr *h;
    size_t hb, pay;           /* header bytes, payload bytes (count in the accumulator type) */
    unsigned char *out;       /* the outgoing message: header + payload */
    unsigned char *msg[2];    /* two message buffers; the accumulator is msg[cur] + hb */
    int cur;
} tree;

static unsigned char *acc_of(tree *t, int i) { return t->msg[i] + t->hb; }

/* A broadcast's value: a flag byte (1: the root's data), padding, the data. */
#define BCAST_DATA 8

/* Send the accumulator to rank `to` and/or receive a message from rank
 * `from` into msg[!cur] (either may be -1), concurrently; the received
 * header must agree with this rank's before its payload is read. */
static ddp_status step(tree *t, int to, int from, ddp_wait w) {
    ddp_group *g = t->g;
    ddp_status st;
    if ((st = ddp_group_need_mutual(g, to, w)) != DDP_OK ||
        (st = ddp_group_need_mutual(g, from, w)) != DDP_OK)
        return st;
    ddp_xfer x[2];
    int n = 0;
    if (to >= 0) {
        if (t->pay) memcpy(t->out + t->hb, acc_of(t, t->cur), t->pay);
        x[n++] = (ddp_xfer){.link = g->links[to], .send = 1, .src = t->out,
                            .len = t->hb + t->pay, .want = 0};
    }
    if (from >= 0)
        x[n++] = (ddp_xfer){.link = g->links[from], .send = 0, .dst = t->msg[!t->cur],
                            .len = t->hb + t->pay, .want = t->hb};
    if ((st = ddp_link_xfer(x, n, w)) != DDP_OK) return st;
    if (from >= 0 && (st = ddp_coll_hdr_agree(t->h, from, t->msg[!t->cur])) != DDP_OK) return st;
    for (int i = 0; i < n; i++) x[i].want = x[i].len;
    return ddp_link_xfer(x, n, w);
}

/* Combine the message just received from rank `from` with the accumulator,
 * lower rank's value on the left; the result becomes the accumulator. */
static void combine(tree *t, const ddp_coll_args *a, int from) {
    unsigned char *mine = acc_of(t, t->cur), *theirs = acc_of(t, !t->cur);
    if (a->kind == DDP_COLL_BROADCAST) {   /* keep the root's: flag byte first */
        if (theirs[0]) t->cur = !t->cur;
        return;
    }
    if (a->count == 0) return;
    if (from > t->g->rank) {
        ddp_acc_combine(a->dtype, a->op, mine, mine, theirs, a->count);
    } else {
        ddp_acc_combine(a->dtype, a->op, theirs, theirs, mine, a->count);
        t->cur = !t->cur;
    }
}

/* The group rank of index i among the pof2 ranks of the doubling phase. */
static int doubling_rank(int i, int rem) { return i < rem ? 2 * i + 1 : i + rem; }

static ddp_status doubling(tree *t, const ddp_coll_args *a, ddp_wait w) {
    const int n = t->g->size, me = t->g->rank;
    int pof2 = 1;
    while (pof2 * 2 <= n) pof2 *= 2;
    const int rem = n - pof2;
    const int idle = me < 2 * rem && me % 2 == 0;   /* hands its data to me + 1 */
    ddp_status st;
    if (me < 2 * rem) {
        if (idle) st = step(t, me + 1, -1, w);
        else if ((st = step(t, -1, me - 1, w)) == DDP_OK) combine(t, a, me - 1);
        if (st != DDP_OK) return st;
    }
    if (!idle) {
        const int i = me < 2 * rem ? me / 2 : me - rem;
        for (int mask = 1; mask < pof2; mask <<= 1) {
            const int p = doubling_rank(i ^ mask, rem);
            if ((st = step(t, p, p, w)) != DDP_OK) return st;
            combine(t, a, p);
        }
    }
    if (me < 2 * rem) {
        if (idle) {
            if ((st = step(t, -1, me + 1, w)) != DDP_OK) return st;
            t->cur = !t->cur;   /* the result, as it is */
        } else if ((st = step(t, me - 1, -1, w)) != DDP_OK) {
            return st;
        }
    }
    const unsigned char *res = acc_of(t, t->cur);
    if (a->kind == DDP_COLL_BROADCAST) {
        if (t->pay) memcpy(a->buf, res + BCAST_DATA, t->pay - BCAST_DATA);
    } else if (a->count && (a->kind == DDP_COLL_ALLREDUCE || me == a->root)) {
        ddp_acc_store(a->dtype, a->op, a->buf, acc_of(t, t->cur), a->count, n);
    }
    return DDP_OK;
}

ddp_status ddp_coll_tree(ddp_group *g, const ddp_coll_args *a, const ddp_coll_hdr *h,
                         ddp_wait w) {
    const int kind = a->kind;
    const size_t count = kind == DDP_COLL_BARRIER ? 0 : a->count;
    tree t = {.g = g, .h = h, .hb = DDP_COLL_HDR_BYTES};
    if (kind == DDP_COLL_BROADCAST) t.pay = BCAST_DATA + count * ddp_dtype_size(a->dtype);
    else t.pay = count * ddp_acc_size(a->dtype, a->op);
    const size_t mb = ddp_coll_align(t.hb + t.pay);
    void *mem;
    ddp_status st = ddp_coll_scratch(g, 3 * mb, &mem);
    if (st != DDP_OK) return st;
    t.out = mem;
    t.msg[0] = t.out + mb;
    t.msg[1] = t.out + 2 * mb;
    ddp_coll_hdr_encode(h, t.out);
    unsigned char *v = acc_of(&t, 0);
    if (kind == DDP_COLL_BROADCAST) {
        memset(v, 0, BCAST_DATA);
        v[0] = g->rank == a->root;
        if (v[0] && count) memcpy(v + BCAST_DATA, a->buf, t.pay - BCAST_DATA);
    } else if (count) {
        ddp_acc_load(a->dtype, a->op, v, a->buf, count);
    }
    ddp_coll_args b = *a;
    b.count = count;
    return doubling(&t, &b, w);
}
