/* ddp_coll_root.c - bandwidth-path collectives with a root, and send/recv.
 *
 * Broadcast and reduce run along a chain that starts at the root (positions
 * 0..size-1 = root, root+1, ...), pipelined in chunks of g->chunk_bytes: a
 * middle rank forwards chunk c-1 while receiving chunk c, so a large message
 * takes about one transfer time however many ranks there are, and no rank
 * holds more than a few chunks of scratch. Reduce sends partial results up
 * the chain in the accumulator type (ddp_acc_size: float32 for half types,
 * int64 or 128-bit sums for integer AVG, so the root's floor division gives
 * the exact mean) and leaves non-root buffers untouched.
 * Gather and scatter move each block directly between the root and its
 * owner, the root driving all its peers at once. Send/recv move the buffer
 * itself (no staging) after the header exchange.
 */
#include "ddp_coll_internal.h"

#include <string.h>

/* The rank at chain position pos, for a chain starting at root. */
static int chain_rank(int pos, int root, int n) { return (pos + root) % n; }

/* The links to this rank's neighbours on the chain (made if missing). */
static ddp_status chain_need(ddp_group *g, int pos, int root, ddp_wait w) {
    const int n = g->size;
    ddp_status st = pos > 0 ? ddp_group_need_mutual(g, chain_rank(pos - 1, root, n), w) : DDP_OK;
    return st == DDP_OK && pos < n - 1 ? ddp_group_need_mutual(g, chain_rank(pos + 1, root, n), w)
                                       : st;
}

ddp_status ddp_coll_chain_broadcast(ddp_group *g, const ddp_coll_args *a, ddp_wait w) {
    const int n = g->size, pos = (g->rank - a->root + n) % n;
    const size_t bytes = a->count * ddp_dtype_size(a->dtype);
    if (n == 1) return DDP_OK;
    ddp_status st = chain_need(g, pos, a->root, w);
    if (st != DDP_OK) return st;
    ddp_link *up = pos > 0 ? g->links[chain_rank(pos - 1, a->root, n)] : NULL;
    ddp_link *down = pos < n - 1 ? g->links[chain_rank(pos + 1, a->root, n)] : NULL;
    char *buf = a->buf;
    if (!up) return ddp_link_send(down, buf, bytes, w);
    if (!down) return ddp_link_recv(up, buf, bytes, w);
    const size_t chunk = ddp_coll_chunk_elems(g, 1), nch = (bytes + chunk - 1) / chunk;
    for (size_t c = 0; c <= nch; c++) {
        /* forward chunk c-1 down while chunk c arrives from up */
        size_t sn = c > 0 ? (c == nch ? bytes - (c - 1) * chunk : chunk) : 0;
        size_t rn = c < nch ? (c == nch - 1 ? bytes - c * chunk : chunk) : 0;
        const char *sp = c > 0 ? buf + (c - 1) * chunk : buf;
        if ((st = ddp_link_sendrecv(down, sp, sn, up, buf + c * chunk, rn, w)) != DDP_OK)
            return st;
    }
    return DDP_OK;
}

/* Elements in chunk c of a count-element buffer cut into ce-element chunks. */
static size_t chunk_len(size_t count, size_t ce, size_t c) {
    return count - c * ce < ce ? count - c * ce : ce;
}

ddp_status ddp_coll_chain_reduce(ddp_group *g, const ddp_coll_args *a, ddp_wait w) {
    const int n = g->size, pos = (g->rank - a->root + n) % n;
    const ddp_dtype t = a->dtype;
    const int wide = !ddp_acc_is_native(t, a->op); /* partial sums in a wider type */
    const size_t es = ddp_dtype_size(t), wes = ddp_acc_size(t, a->op);
    const size_t ce = ddp_coll_chunk_elems(g, wes), nch = (a->count + ce - 1) / ce;
    const size_t cb = ddp_coll_align(ce * wes);
    if (n == 1) return DDP_OK; /* AVG over one rank is the identity */
    ddp_status st = chain_need(g, pos, a->root, w);
    if (st != DDP_OK) return st;
    ddp_link *up = pos > 0 ? g->links[chain_rank(pos - 1, a->root, n)] : NULL; /* to root */
    ddp_link *down = pos < n - 1 ? g->links[chain_rank(pos + 1, a->root, n)] : NULL;
    void *mem;
    if ((st = ddp_coll_scratch(g, 3 * cb, &mem)) != DDP_OK) return st;
    char *rtmp = mem, *part[2] = {(char *)mem + cb, (char *)mem + 2 * cb};
    char *buf = a->buf;
    /* The last rank of the chain sends native data straight from buf. */
    const int send_own = !down && !wide;

    for (size_t c = 0; c <= nch; c++) {
        /* pass chunk c-1's partial result up while chunk c arrives from down */
        size_t sn = up && c > 0 ? chunk_len(a->count, ce, c - 1) * wes : 0;
        size_t rn = down && c < nch ? chunk_len(a->count, ce, c) * wes : 0;
        const char *sp = c == 0 ? buf : send_own ? buf + (c - 1) * ce * es : part[(c - 1) & 1];
        if ((st = ddp_link_sendrecv(up, sp, sn, down, rtmp, rn, w)) != DDP_OK) return st;
        if (c == nch || send_own) continue;
        const size_t len = chunk_len(a->count, ce, c);
        char *own = buf + c * ce * es, *acc = part[c & 1];
        if (wide) {
            ddp_acc_load(t, a->op, acc, own, len);
            if (down) ddp_acc_combine(t, a->op, acc, acc, rtmp, len);
            if (!up) ddp_acc_store(t, a->op, own, acc, len, n); /* root: divide/round once */
        } else if (!up) { /* root: combine into its own buffer */
            ddp_reduce(t, a->op, own, rtmp, len);
            ddp_reduce_finish(t, a->op, own, len, n);
        } else {
            ddp_reduce3(t, a->op, acc, own, rtmp, len);
        }
    }
    return DDP_OK;
}

/* The root moves block p of `blocks` to or from every peer p at once; the
 * others make one transfer with the root. The root's own block is copied
 * locally (skipped for the in-place form). */
static ddp_status direct(ddp_group *g, const ddp_coll_args *a, int to_root, ddp_wait w) {
    const int n = g->size, me = g->rank, root = a->root;
    const size_t b = a->count * ddp_dtype_size(a->dtype);
    ddp_status st = DDP_OK;
    for (int p = 0; p < n && st == DDP_OK; p++)   /* the root talks to all, the others to it */
        if (me == root || p == root) st = ddp_group_need(g, p, w);
    if (st != DDP_OK) return st;
    if (me != root)
        return to_root ? ddp_link_send(g->links[root], a->sendbuf, b, w)
                       : ddp_link_recv(g->links[root], a->recvbuf, b, w);
    char *blocks = to_root ? a->recvbuf : (char *)a->sendbuf;
    char *mine = blocks + (size_t)me * b;
    if (to_root && mine != a->sendbuf) memcpy(mine, a->sendbuf, b);
    if (!to_root && mine != a->recvbuf) memcpy(a->recvbuf, mine, b);
    void *mem;
    if ((st = ddp_coll_scratch(g, (size_t)n * sizeof(ddp_xfer), &mem)) != DDP_OK) return st;
    ddp_xfer *ops = mem;
    int k = 0;
    for (int p = 0; p < n; p++) {
        if (p == me) continue;
        char *blk = blocks + (size_t)p * b;
        ops[k++] = (ddp_xfer){.link = g->links[p], .send = !to_root, .src = blk, .dst = blk,
                              .len = b, .want = b};
    }
    return ddp_link_xfer(ops, k, w);
}

ddp_status ddp_coll_direct_gather(ddp_group *g, const ddp_coll_args *a, ddp_wait w) {
    return direct(g, a, 1, w);
}

ddp_status ddp_coll_direct_scatter(ddp_group *g, const ddp_coll_args *a, ddp_wait w) {
    return direct(g, a, 0, w);
}

ddp_status ddp_coll_p2p(ddp_group *g, const ddp_coll_args *a, ddp_wait w) {
    const size_t b = a->count * ddp_dtype_size(a->dtype);
    ddp_status st = ddp_group_need(g, a->root, w);
    if (st != DDP_OK) return st;
    ddp_link *l = g->links[a->root];
    return a->kind == DDP_COLL_SEND ? ddp_link_send(l, a->buf, b, w)
                                    : ddp_link_recv(l, a->buf, b, w);
}
