/* ddp_coll_batch.c - a batch of sends and receives with any peers, run
 * concurrently (torch's batch_isend_irecv with P2POp).
 *
 * Matching is per direction and in order: this rank's k-th send to q pairs
 * with q's k-th receive from this rank, and they must agree in dtype and
 * count; how sends and receives interleave in either batch does not matter.
 * A batch talks only to the peers in it and does not advance g->seq (like
 * send/recv); the peer must be running a batch too.
 *
 * Two steps, over the links of the peers in the batch only:
 *  1. To each peer q: the collective header (kind P2P_BATCH, root = q, count =
 *     sends to q << 32 | receives from q) followed by one 16-byte descriptor
 *     per op with q (u64 count, u32 dtype, u32 zero; sends first, then
 *     receives, each in batch order). From q: its header, then (as long as
 *     the counts agree, when its message has the length ours has) its
 *     descriptors. Headers are checked as soon as all are in, descriptors
 *     once they are, so both ranks of a pair report a disagreement with the
 *     same message (lower rank first), before any payload moves.
 *  2. Payload rounds: round k moves, with every peer at once, this rank's
 *     k-th send to it and its k-th receive from it. One stream per link and
 *     direction forbids two sends on a link at once; round k of a pair is
 *     round k on both sides, so the rounds cannot deadlock, and within a
 *     round every transfer progresses whenever its link is ready (large
 *     payloads both ways on a ring are fine).
 * Buffers are the caller's: nothing is staged.
 */
#include "ddp_coll_internal.h"

#include <string.h>

#define DESC_BYTES 16

ddp_status ddp_coll_batch_validate(const ddp_group *g, const ddp_coll_args *a) {
    if (a->nops < 0) return ddp_error(DDP_ERR_INVALID, "nops is %d (negative)", a->nops);
    if (a->nops > 0 && !a->ops)
        return ddp_error(DDP_ERR_INVALID, "ops is NULL but nops is %d", a->nops);
    for (int i = 0; i < a->nops; i++) {
        const ddp_p2p_op *o = &a->ops[i];
        const char *verb = o->is_send ? "send to" : "receive from";
        ddp_status st = ddp_redop_check(o->dtype, DDP_SUM); /* dtype alone */
        if (st != DDP_OK) return ddp_error_prefix(st, "op %d: ", i);
        if (o->peer < 0 || o->peer >= g->size)
            return ddp_error(DDP_ERR_INVALID, "op %d: peer %d is out of range for a group of %d "
                             "ranks (valid: 0..%d)", i, o->peer, g->size, g->size - 1);
        if (o->peer == g->rank)
            return ddp_error(DDP_ERR_INVALID, "op %d: rank %d cannot %s itself", i, g->rank,
                             verb);
        if (o->count > (SIZE_MAX / 2) / ddp_dtype_size(o->dtype))
            return ddp_error(DDP_ERR_INVALID, "op %d: count %zu of %s is too large: its size "
                             "in bytes overflows", i, o->count, ddp_dtype_name(o->dtype));
        if (o->count > 0 && !o->buf)
            return ddp_error(DDP_ERR_INVALID, "op %d (%s rank %d): buf is NULL but count is %zu",
                             i, verb, o->peer, o->count);
    }
    return DDP_OK;
}

/* What this rank does with one peer. */
typedef struct pair {
    int peer;
    uint32_t ns, nr;        /* sends to the peer, receives from it */
    int *send_ops, *recv_ops; /* indices into a->ops, in batch order */
    unsigned char *out, *in; /* our message to it, its message to us */
    size_t len;             /* of both messages when the calls agree */
} pair;

/* The layout of one batch inside g->scratch. */
typedef struct plan {
    int np;                 /* peers in the batch */
    pair *pairs;            /* np, ascending peer order */
    ddp_xfer *xf;           /* 2 * np */
} plan;

/* Lay a (validated, nops > 0) batch out in g->scratch: the pairs in
 * ascending peer order, their op lists, and our encoded messages. Fails only
 * for lack of memory (DDP_ERR_NOMEM), before any communication. */
static ddp_status plan_make(ddp_group *g, const ddp_coll_args *a, const ddp_coll_hdr *h,
                            plan *pl) {
    const int n = g->size, nops = a->nops, maxp = nops < n - 1 ? nops : n - 1;
    const size_t hb = DDP_COLL_HDR_BYTES;
    /* Upper bounds (the pairs are counted later): per peer two messages of
     * a header and their descriptors, each padded to 64 bytes. */
    const size_t off_pairs = ddp_coll_align((size_t)n * sizeof(int));
    const size_t off_ops = off_pairs + ddp_coll_align((size_t)maxp * sizeof(pair));
    const size_t off_xf = off_ops + ddp_coll_align((size_t)nops * sizeof(int));
    const size_t off_msg = off_xf + ddp_coll_align(2 * (size_t)maxp * sizeof(ddp_xfer));
    const size_t total = off_msg + 2 * ((size_t)maxp * (hb + 63) + (size_t)nops * DESC_BYTES);
    void *mem;
    ddp_status st = ddp_coll_scratch(g, total, &mem);
    if (st != DDP_OK) return st;
    unsigned char *base = mem;
    int *slot = mem, *opidx = (int *)(base + off_ops);
    pl->pairs = (pair *)(base + off_pairs);
    pl->xf = (ddp_xfer *)(base + off_xf);
    pl->np = 0;

    for (int q = 0; q < n; q++) slot[q] = 0; /* first: ops with q */
    for (int i = 0; i < nops; i++) slot[a->ops[i].peer]++;
    int used = 0;
    unsigned char *msg = base + off_msg;
    for (int q = 0; q < n; q++) {
        const int m = slot[q];
        if (m == 0) { slot[q] = -1; continue; }
        pair *p = &pl->pairs[pl->np];
        *p = (pair){.peer = q, .send_ops = opidx + used, .len = hb + (size_t)m * DESC_BYTES};
        used += m;
        p->out = msg;
        p->in = msg + ddp_coll_align(p->len);
        msg = p->in + ddp_coll_align(p->len);
        slot[q] = pl->np++; /* now: index of q's pair */
    }
    /* Sends fill send_ops upwards; receives are placed after counting. */
    for (int i = 0; i < nops; i++) {
        pair *p = &pl->pairs[slot[a->ops[i].peer]];
        if (a->ops[i].is_send) p->send_ops[p->ns++] = i;
        else p->nr++;
    }
    for (int k = 0; k < pl->np; k++) {
        pair *p = &pl->pairs[k];
        p->recv_ops = p->send_ops + p->ns;
        p->nr = 0;
    }
    for (int i = 0; i < nops; i++) {
        pair *p = &pl->pairs[slot[a->ops[i].peer]];
        if (!a->ops[i].is_send) p->recv_ops[p->nr++] = i;
    }
    for (int k = 0; k < pl->np; k++) {
        pair *p = &pl->pairs[k];
        ddp_coll_hdr ph = *h;
        ph.root = p->peer;
        ph.count = (uint64_t)p->ns << 32 | p->nr;
        ddp_coll_hdr_encode(&ph, p->out);
        for (uint32_t j = 0; j < p->ns + p->nr; j++) {
            const ddp_p2p_op *o = &a->ops[j < p->ns ? p->send_ops[j] : p->recv_ops[j - p->ns]];
            unsigned char *d = p->out + hb + (size_t)j * DESC_BYTES;
            memset(d, 0, DESC_BYTES);
            ddp_coll_put_le64(d, o->count);
            d[8] = (unsigned char)o->dtype;
        }
    }
    return DDP_OK;
}

/* Both ranks of a pair print this for a disagreement: lower rank first. */
static ddp_status kind_mismatch(int me, const ddp_coll_hdr *mine, int q, const ddp_coll_hdr *h) {
    char dm[160], dq[160];
    ddp_coll_describe(mine, dm, sizeof dm);
    ddp_coll_describe(h, dq, sizeof dq);
    return ddp_error(DDP_ERR_MISMATCH, "collective mismatch: rank %d called %s but rank %d "
                     "called %s; a batch of sends and receives must be matched by a batch on "
                     "each peer", me < q ? me : q, me < q ? dm : dq, me < q ? q : me,
                     me < q ? dq : dm);
}

/* Counts of the two directions between ranks lo < hi. */
static ddp_status count_check(int lo, uint64_t lo_cnt, int hi, uint64_t hi_cnt) {
    const unsigned sends[2] = {(unsigned)(lo_cnt >> 32), (unsigned)(hi_cnt >> 32)};
    const unsigned recvs[2] = {(unsigned)(hi_cnt & 0xffffffffu), (unsigned)(lo_cnt & 0xffffffffu)};
    for (int d = 0; d < 2; d++) {
        if (sends[d] == recvs[d]) continue;
        int from = d ? hi : lo, to = d ? lo : hi;
        return ddp_error(DDP_ERR_MISMATCH, "batch_isend_irecv mismatch: rank %d sends %u "
                         "messages to rank %d but rank %d receives %u from rank %d; every send "
                         "needs a matching receive on its peer, in the same order", from,
                         sends[d], to, to, recvs[d], from);
    }
    return DDP_OK;
}

/* Step 1's header check for one pair (after the headers arrived). */
static ddp_status header_check(const ddp_group *g, const ddp_coll_hdr *h, const pair *p) {
    ddp_coll_hdr ph, mine = *h; /* the header we sent this peer, for messages */
    mine.root = p->peer;
    mine.count = (uint64_t)p->ns << 32 | p->nr;
    ddp_status st = ddp_coll_hdr_parse(p->in, p->peer, &mine, &ph);
    if (st != DDP_OK) return st;
    if (ph.kind != DDP_COLL_P2P_BATCH) return kind_mismatch(g->rank, &mine, p->peer, &ph);
    if (ph.root != g->rank)
        return ddp_error(DDP_ERR_PROTOCOL, "rank %d sent this rank (%d) a batch header meant "
                         "for rank %d", p->peer, g->rank, (int)ph.root);
    return g->rank < p->peer ? count_check(g->rank, mine.count, p->peer, ph.count)
                             : count_check(p->peer, ph.count, g->rank, mine.count);
}

/* Descriptor j of a message. */
static void desc_read(const unsigned char *msg, uint32_t j, uint64_t *count, uint32_t *dtype) {
    const unsigned char *d = msg + DDP_COLL_HDR_BYTES + (size_t)j * DESC_BYTES;
    *count = ddp_coll_get_le64(d);
    *dtype = d[8] | (uint32_t)d[9] << 8 | (uint32_t)d[10] << 16 | (uint32_t)d[11] << 24;
}

/* Step 1's descriptor check for one pair whose counts agree: the lower
 * rank's sends against the higher's receives, then the other way. */
static ddp_status desc_check(const ddp_group *g, const ddp_coll_args *a, const pair *p) {
    const int me = g->rank, q = p->peer, lo = me < q ? me : q, hi = me < q ? q : me;
    uint64_t c;
    uint32_t t;
    for (uint32_t j = 0; j < p->ns + p->nr; j++) {
        desc_read(p->in, j, &c, &t);
        if (t >= DDP_DTYPE_COUNT)
            return ddp_error(DDP_ERR_PROTOCOL, "rank %d sent a batch descriptor with dtype %u; "
                             "do all ranks run the same pyddp version?", q, (unsigned)t);
    }
    for (int d = 0; d < 2; d++) {
        const int from = d ? hi : lo, to = d ? lo : hi, we_send = from == me;
        /* The peer's descriptors: its sends to us (as many as our receives),
         * then its receives from us. */
        const uint32_t m = we_send ? p->ns : p->nr;
        for (uint32_t k = 0; k < m; k++) {
            const ddp_p2p_op *o = &a->ops[we_send ? p->send_ops[k] : p->recv_ops[k]];
            desc_read(p->in, we_send ? p->nr + k : k, &c, &t);
            if (c == o->count && t == (uint32_t)o->dtype) continue;
            unsigned long long sc = we_send ? o->count : c, rc = we_send ? c : o->count;
            ddp_dtype st = we_send ? o->dtype : (ddp_dtype)t, rt = we_send ? (ddp_dtype)t : o->dtype;
            return ddp_error(DDP_ERR_MISMATCH, "batch_isend_irecv mismatch: rank %d's send #%u "
                             "to rank %d is %llu %s but rank %d's receive #%u from rank %d is "
                             "%llu %s; the k-th send to a peer must match the peer's k-th "
                             "receive in count and dtype", from, k + 1, to, sc,
                             ddp_dtype_name(st), to, k + 1, from, rc, ddp_dtype_name(rt));
        }
    }
    return DDP_OK;
}

/* Step 1 for every pair; mismatches are looked for in ascending peer order.
 * No payload has moved when it fails. */
static ddp_status handshake(ddp_group *g, const ddp_coll_args *a, const ddp_coll_hdr *h,
                            const plan *pl, ddp_wait w) {
    const size_t hb = DDP_COLL_HDR_BYTES;
    ddp_xfer *x = pl->xf;
    for (int k = 0; k < pl->np; k++) {
        const pair *p = &pl->pairs[k];
        ddp_status need = ddp_group_need(g, p->peer, w);
        if (need != DDP_OK) return need;
        ddp_link *l = g->links[p->peer];
        x[2 * k] = (ddp_xfer){.link = l, .send = 1, .src = p->out, .len = p->len};
        x[2 * k + 1] = (ddp_xfer){.link = l, .send = 0, .dst = p->in, .len = p->len, .want = hb};
    }
    const int nx = 2 * pl->np;
    ddp_status st = ddp_link_xfer(x, nx, w);
    for (int k = 0; k < pl->np && st == DDP_OK; k++) st = header_check(g, h, &pl->pairs[k]);
    if (st != DDP_OK) return st;
    for (int i = 0; i < nx; i++) x[i].want = x[i].len;
    if ((st = ddp_link_xfer(x, nx, w)) != DDP_OK) return st;
    for (int k = 0; k < pl->np && st == DDP_OK; k++) st = desc_check(g, a, &pl->pairs[k]);
    return st;
}

/* Step 2: round k moves the k-th send and the k-th receive of every pair.
 * On failure receive buffers may be partly written. */
static ddp_status payload(ddp_group *g, const ddp_coll_args *a, const plan *pl, ddp_wait w) {
    uint32_t rounds = 0;
    for (int k = 0; k < pl->np; k++) {
        const pair *p = &pl->pairs[k];
        if (p->ns > rounds) rounds = p->ns;
        if (p->nr > rounds) rounds = p->nr;
    }
    for (uint32_t r = 0; r < rounds; r++) {
        int nx = 0;
        for (int k = 0; k < pl->np; k++) {
            const pair *p = &pl->pairs[k];
            for (int send = 1; send >= 0; send--) {
                if (r >= (send ? p->ns : p->nr)) continue;
                const ddp_p2p_op *o = &a->ops[send ? p->send_ops[r] : p->recv_ops[r]];
                const size_t b = o->count * ddp_dtype_size(o->dtype);
                if (b > 0)
                    pl->xf[nx++] = (ddp_xfer){.link = g->links[p->peer], .send = send,
                                              .src = o->buf, .dst = o->buf, .len = b, .want = b};
            }
        }
        ddp_status st = ddp_link_xfer(pl->xf, nx, w);
        if (st != DDP_OK) return st;
    }
    return DDP_OK;
}

ddp_status ddp_coll_batch_run(ddp_group *g, const ddp_coll_args *a, ddp_wait w) {
    /* hdr_make fills what every header carries; root and count are per pair. */
    ddp_coll_hdr h = ddp_coll_hdr_make(g, a, 0);
    h.dtype = 0, h.op = 0, h.root = 0, h.count = 0;
    plan pl;
    ddp_status st = a->nops > 0 ? plan_make(g, a, &h, &pl) : DDP_OK;
    if (st == DDP_OK && a->nops > 0) st = handshake(g, a, &h, &pl, w);
    if (st == DDP_OK && a->nops > 0) st = payload(g, a, &pl, w);
    if (g->scratch_len > DDP_COLL_SCRATCH_KEEP) ddp_group_release_scratch(g);
    if (st != DDP_OK)
        ddp_error_prefix(st, "batch_isend_irecv(%d ops) on rank %d of %d: ", a->nops, g->rank,
                         g->size);
    return st;
}
