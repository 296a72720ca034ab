/* ddp_coll_anysrc.c - the search behind a receive from any source (torch's
 * recv without src): which peer sends to this rank first.
 *
 * Every peer's link is read for its next 40-byte collective header, all at
 * once (ddp_link_xfer_any). The first complete header that is a send to this
 * rank on this group names the sender. A header that is anything else (the
 * peer's next call is a collective, a send to another rank, or a call on
 * another group) takes that peer out of the search: its stream must deliver
 * that call first, so it cannot send to this rank now. When no peer is left
 * the calls do not match (every peer waits for something else from this
 * rank) and the search fails naming their calls, where gloo would wait for
 * the timeout. A peer whose link fails is dropped too; the search fails with
 * that failure only when no peer is left.
 *
 * Nothing is consumed: once the sender is known, headers that began to
 * arrive are read to their end (a peer writes its header in one piece, so
 * the rest is on its way) and every byte read goes back to its link
 * (ddp_link_unread). The ordinary receive from the sender, and later calls
 * with the other peers, then read the streams as if the search had not
 * happened. Sequence numbers are not touched (send/recv do not advance them).
 */
#include "ddp_coll_internal.h"

#include <stdio.h>
#include <string.h>

/* Append "; rank p called <call>" (or the failure) to why. */
static void note_other_call(char *why, size_t len, int p, const ddp_coll_hdr *h,
                            const ddp_group *g) {
    char call[160];
    size_t used = strlen(why);
    if (used + 1 >= len) return;
    if (h == NULL) {
        snprintf(why + used, len - used, "%srank %d's link failed", used ? "; " : "", p);
        return;
    }
    ddp_coll_describe(h, call, sizeof call);
    snprintf(why + used, len - used, "%srank %d called %s%s", used ? "; " : "", p, call,
             h->tag == g->tag ? "" : " on another process group");
}

/* Read to their end the headers of x[0..n) that began to arrive (the
 * sender's included), then hand every byte read back to its link. */
static ddp_status hand_back(ddp_xfer *x, int n, int finish, ddp_wait w) {
    ddp_status st = DDP_OK;
    if (finish) {
        int k = 0;
        for (int i = 0; i < n; i++) {
            if (x[i].parked || x[i].done == 0 || x[i].done == x[i].len) continue;
            x[i].want = x[i].len;
            if (i != k) {   /* gather the partial ones at the front */
                ddp_xfer t = x[k];
                x[k] = x[i];
                x[i] = t;
            }
            k++;
        }
        if (k > 0) st = ddp_link_xfer(x, k, w);
    }
    for (int i = 0; i < n; i++) {
        ddp_status ust = ddp_link_unread(x[i].link, x[i].dst, x[i].done);
        if (st == DDP_OK) st = ust;
    }
    return st;
}

ddp_status ddp_coll_recv_find(ddp_group *g, const ddp_coll_args *a, ddp_wait w, int *src) {
    (void)a;
    const int n = g->size, me = g->rank;
    const size_t hb = DDP_COLL_HDR_BYTES;
    const size_t off_peer = ddp_coll_align((size_t)n * sizeof(ddp_xfer));
    const size_t off_hdr = off_peer + ddp_coll_align((size_t)n * sizeof(int));
    void *mem;
    ddp_status st = ddp_coll_scratch(g, off_hdr + (size_t)n * hb, &mem);
    if (st != DDP_OK) return st;
    ddp_xfer *x = mem;
    int *peer = (int *)((char *)mem + off_peer);
    unsigned char *hdr = (unsigned char *)mem + off_hdr;
    int nx = 0;
    /* Any peer may be the sender: a link to each (made now where missing). */
    for (int p = 0; p < n && st == DDP_OK; p++) st = ddp_group_need(g, p, w);
    if (st != DDP_OK) return st;
    for (int p = 0; p < n; p++) {
        if (p == me) continue;
        x[nx] = (ddp_xfer){.link = g->links[p], .send = 0, .dst = hdr + (size_t)nx * hb,
                           .len = hb, .want = hb};
        peer[nx++] = p;
    }
    *src = -1;
    char why[1024] = "";
    int live = nx;   /* x[0..live) are searched; x[live..nx) are out of the search */
    while (live > 0) {
        int i = -1;
        if ((st = ddp_link_xfer_any(x, live, w, &i)) != DDP_OK) break;
        ddp_coll_hdr h;
        ddp_coll_hdr_decode(x[i].dst, &h);
        if (h.magic != DDP_COLL_MAGIC) {
            st = ddp_error(DDP_ERR_PROTOCOL, "rank %d sent bytes that are not a collective "
                           "header (magic 0x%08x); do all ranks run the same pyddp version?",
                           peer[i], (unsigned)h.magic);
            break;
        }
        if (h.tag == g->tag && h.rank == (uint32_t)peer[i] && h.kind == DDP_COLL_SEND &&
            h.root == me) {
            *src = peer[i];
            break;
        }
        note_other_call(why, sizeof why, peer[i], &h, g);
        /* out of the search: i, and every transfer whose link failed */
        for (int j = live - 1; j >= 0; j--) {
            if (j != i && !x[j].parked) continue;
            if (j != i) note_other_call(why, sizeof why, peer[j], NULL, g);
            live--;
            ddp_xfer t = x[j];
            x[j] = x[live];
            x[live] = t;
            int tp = peer[j];
            peer[j] = peer[live];
            peer[live] = tp;
        }
    }
    if (st == DDP_OK && *src < 0)
        st = ddp_error(DDP_ERR_MISMATCH, "no peer can send to rank %d now: %s; every rank's "
                       "calls must match (a send to this rank before the call named)", me, why);
    ddp_status hst = hand_back(x, nx, st == DDP_OK, w);
    return st != DDP_OK ? st : hst;
}
