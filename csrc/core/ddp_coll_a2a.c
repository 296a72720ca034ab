/* ddp_coll_a2a.c - all_to_all with per-peer counts (torch's all_to_all_single
 * with input/output split sizes; the list form is that after packing).
 *
 * Rank p sends block q of its sendbuf (scounts[q] elements at sdispls[q]) to
 * rank q, which receives it at rdispls[p] (rcounts[p] elements). Two steps:
 *
 *  1. The usual header exchange (ddp_coll_exchange) with, as payload, this
 *     rank's whole scounts and rcounts tables (2 * size little-endian u64).
 *     So every rank holds every rank's tables and checks every pair in the
 *     same order: when rank p's scounts[q] differs from rank q's rcounts[p],
 *     every rank fails with the same DDP_ERR_MISMATCH, not only p and q, and
 *     no payload has moved yet (recvbuf is untouched). 16 * size bytes per
 *     peer is small next to any payload worth an all_to_all.
 *  2. One ddp_link_xfer with a send and a receive on every link, straight
 *     from and into the caller's buffers: every direction progresses
 *     whenever its socket is ready, so large blocks both ways cannot
 *     deadlock, and nothing is staged. The own block is a memcpy.
 *
 * In-place (overlapping sendbuf and recvbuf) is refused: blocks of different
 * sizes would overwrite data not yet sent; the caller stages.
 */
#include "ddp_coll_internal.h"

#include <stdlib.h>
#include <string.h>

/* Largest byte offset the buffers may reach (pointer differences stay
 * representable). */
#define A2A_MAX_BYTES (SIZE_MAX / 2)

/* End (in elements) of the furthest non-empty block of counts/displs, after
 * checking that no block's end overflows; `which` names the side. */
static ddp_status extent(const ddp_group *g, const size_t *counts, const size_t *displs,
                         size_t es, const char *which, size_t *end) {
    *end = 0;
    for (int p = 0; p < g->size; p++) {
        if (counts[p] == 0) continue;
        if (displs[p] > A2A_MAX_BYTES / es || counts[p] > A2A_MAX_BYTES / es - displs[p])
            return ddp_error(DDP_ERR_INVALID, "%s block for rank %d (displacement %zu, count "
                             "%zu) is too large: its end in bytes overflows", which, p,
                             displs[p], counts[p]);
        if (displs[p] + counts[p] > *end) *end = displs[p] + counts[p];
    }
    return DDP_OK;
}

ddp_status ddp_coll_a2a_validate(const ddp_group *g, const ddp_coll_args *a) {
    ddp_status st = ddp_redop_check(a->dtype, DDP_SUM); /* dtype alone */
    if (st != DDP_OK) return st;
    if (!a->scounts || !a->sdispls || !a->rcounts || !a->rdispls)
        return ddp_error(DDP_ERR_INVALID, "all_to_all needs scounts, sdispls, rcounts and "
                         "rdispls (arrays of %d entries); one of them is NULL", g->size);
    const size_t es = ddp_dtype_size(a->dtype);
    size_t send_end, recv_end;
    if ((st = extent(g, a->scounts, a->sdispls, es, "send", &send_end)) != DDP_OK ||
        (st = extent(g, a->rcounts, a->rdispls, es, "receive", &recv_end)) != DDP_OK)
        return st;
    if (send_end > 0 && !a->sendbuf)
        return ddp_error(DDP_ERR_INVALID, "sendbuf is NULL but rank %d sends %zu elements",
                         g->rank, send_end);
    if (recv_end > 0 && !a->recvbuf)
        return ddp_error(DDP_ERR_INVALID, "recvbuf is NULL but rank %d receives %zu elements",
                         g->rank, recv_end);
    uintptr_t s = (uintptr_t)a->sendbuf, r = (uintptr_t)a->recvbuf;
    if (send_end > 0 && recv_end > 0 && s < r + recv_end * es && r < s + send_end * es)
        return ddp_error(DDP_ERR_INVALID, "all_to_all cannot run in place: sendbuf and recvbuf "
                         "overlap; pass separate buffers");
    return DDP_OK;
}

/* Rank p's table (scounts then rcounts) from the exchange, or ours. */
static const unsigned char *table(const ddp_coll_xres *r, const unsigned char *mine, int me,
                                  int p) {
    return p == me ? mine : ddp_coll_payload(r, p);
}

/* Every rank's scounts[q] against rank q's rcounts[p], senders in rank
 * order, so every rank names the same first disagreement. */
static ddp_status check_tables(const ddp_group *g, const ddp_coll_xres *r,
                               const unsigned char *mine) {
    const int n = g->size, me = g->rank;
    for (int p = 0; p < n; p++) {
        const unsigned char *tp = table(r, mine, me, p);
        for (int q = 0; q < n; q++) {
            uint64_t sent = ddp_coll_get_le64(tp + 8 * (size_t)q);
            uint64_t want = ddp_coll_get_le64(table(r, mine, me, q) + 8 * ((size_t)n + p));
            if (sent != want)
                return ddp_error(DDP_ERR_MISMATCH, "all_to_all mismatch: rank %d sends %llu "
                                 "elements to rank %d but rank %d expects %llu elements from "
                                 "rank %d; rank p's input split for rank q must equal rank q's "
                                 "output split for rank p", p, (unsigned long long)sent, q, q,
                                 (unsigned long long)want, p);
        }
    }
    return DDP_OK;
}

/* Steps 1 and 2 of the file comment. On failure recvbuf is untouched if the
 * headers or tables disagreed, else partly written. */
static ddp_status a2a(ddp_group *g, const ddp_coll_args *a, const ddp_coll_hdr *h, ddp_wait w) {
    const int n = g->size, me = g->rank;
    const size_t es = ddp_dtype_size(a->dtype), tbl = 16 * (size_t)n;
    /* The table cannot live in g->scratch: the exchange takes that over. */
    unsigned char *mine = malloc(tbl);
    if (!mine) return ddp_error(DDP_ERR_NOMEM, "out of memory for a %zu-byte split table", tbl);
    for (int p = 0; p < n; p++) {
        ddp_coll_put_le64(mine + 8 * (size_t)p, a->scounts[p]);
        ddp_coll_put_le64(mine + 8 * ((size_t)n + p), a->rcounts[p]);
    }
    const ddp_coll_xchg x = {.peer = -1, .mesh = 1, .sbase = mine, .sbytes = tbl, .sto = -1,
                             .rbytes = tbl, .rfrom = -1};
    ddp_coll_xres r;
    ddp_status st = ddp_coll_exchange(g, h, &x, w, &r);
    if (st == DDP_OK) st = check_tables(g, &r, mine);
    free(mine);
    if (st != DDP_OK) return st;

    void *mem; /* the exchange's results are no longer needed */
    if ((st = ddp_coll_scratch(g, 2 * (size_t)n * sizeof(ddp_xfer), &mem)) != DDP_OK) return st;
    ddp_xfer *ops = mem;
    const char *sbuf = a->sendbuf;
    char *rbuf = a->recvbuf;
    int k = 0;
    /* Start with the next rank and go round, so the ranks do not all begin
     * with rank 0 (the order only matters for the first poll round). */
    for (int i = 1; i < n; i++) {
        const int p = (me + i) % n;
        const size_t sb = a->scounts[p] * es, rb = a->rcounts[p] * es;
        if (sb > 0)
            ops[k++] = (ddp_xfer){.link = g->links[p], .send = 1,
                                  .src = sbuf + a->sdispls[p] * es, .len = sb, .want = sb};
        if (rb > 0)
            ops[k++] = (ddp_xfer){.link = g->links[p], .send = 0,
                                  .dst = rbuf + a->rdispls[p] * es, .len = rb, .want = rb};
    }
    if (a->scounts[me] > 0) /* equal to rcounts[me]: checked with the tables */
        memcpy(rbuf + a->rdispls[me] * es, sbuf + a->sdispls[me] * es, a->scounts[me] * es);
    return ddp_link_xfer(ops, k, w);
}

ddp_status ddp_coll_a2a_run(ddp_group *g, const ddp_coll_args *a, ddp_wait w) {
    /* Fields that differ between ranks travel in the tables, so the header
     * carries only what all ranks share (dtype and sequence number). */
    ddp_coll_hdr h = ddp_coll_hdr_make(g, a, DDP_COLL_PATH_LARGE);
    h.op = 0, h.root = 0, h.count = 0;
    g->seq++;
    ddp_status st = a2a(g, a, &h, w);
    if (g->scratch_len > DDP_COLL_SCRATCH_KEEP) ddp_group_release_scratch(g);
    if (st != DDP_OK) {
        char what[160];
        ddp_coll_describe(&h, what, sizeof what);
        ddp_error_prefix(st, "%s on rank %d of %d: ", what, g->rank, g->size);
    }
    return st;
}
