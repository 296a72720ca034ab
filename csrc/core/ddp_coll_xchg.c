/* ddp_coll_xchg.c - the 40-byte collective header and the exchange that
 * starts every collective: each rank sends [header][payload] to every peer
 * and receives the same from each, so every rank sees every rank's header
 * and can name exactly who called what when calls differ.
 *
 * The exchange runs in two phases over one set of transfers: first until
 * every peer's header is in (payloads keep flowing meanwhile), then, once
 * the headers agree, until every payload is complete. Checking before the
 * payloads are needed is what lets every rank report a mismatch even when
 * the mismatched calls carry different payload sizes.
 */
#include "ddp_coll_internal.h"
#include "ddp_le.h"

#include <stdio.h>
#include <string.h>

/* ---- header codec --------------------------------------------------------- */

/* Wire layout: offsets of the fields, little-endian, written byte by byte
 * (ddp_le.h), so neither the host's byte order nor struct padding matter. */
enum {
    HDR_MAGIC = 0,  /* u32 */
    HDR_KIND = 4,   /* u8 kind, dtype, op, path */
    HDR_DTYPE = 5,
    HDR_OP = 6,
    HDR_PATH = 7,
    HDR_ROOT = 8,   /* i32 */
    HDR_RANK = 12,  /* u32 */
    HDR_COUNT = 16, /* u64 */
    HDR_SEQ = 24,   /* u64 */
    HDR_TAG = 32,   /* u64: the group's tag */
    HDR_END = 40
};
_Static_assert(HDR_END == DDP_COLL_HDR_BYTES, "the header's fields must fill DDP_COLL_HDR_BYTES");

static void hdr_encode(const ddp_coll_hdr *h, unsigned char *out) {
    ddp_le_put32(out + HDR_MAGIC, h->magic);
    out[HDR_KIND] = h->kind;
    out[HDR_DTYPE] = h->dtype;
    out[HDR_OP] = h->op;
    out[HDR_PATH] = h->path;
    ddp_le_put32(out + HDR_ROOT, (uint32_t)h->root);
    ddp_le_put32(out + HDR_RANK, h->rank);
    ddp_le_put64(out + HDR_COUNT, h->count);
    ddp_le_put64(out + HDR_SEQ, h->seq);
    ddp_le_put64(out + HDR_TAG, h->tag);
}

static void hdr_decode(const unsigned char *in, ddp_coll_hdr *h) {
    h->magic = ddp_le_get32(in + HDR_MAGIC);
    h->kind = in[HDR_KIND];
    h->dtype = in[HDR_DTYPE];
    h->op = in[HDR_OP];
    h->path = in[HDR_PATH];
    h->root = (int32_t)ddp_le_get32(in + HDR_ROOT);
    h->rank = ddp_le_get32(in + HDR_RANK);
    h->count = ddp_le_get64(in + HDR_COUNT);
    h->seq = ddp_le_get64(in + HDR_SEQ);
    h->tag = ddp_le_get64(in + HDR_TAG);
}

void ddp_coll_hdr_encode(const ddp_coll_hdr *h, unsigned char *out) { hdr_encode(h, out); }
void ddp_coll_hdr_decode(const unsigned char *in, ddp_coll_hdr *h) { hdr_decode(in, h); }

ddp_coll_hdr ddp_coll_hdr_make(const ddp_group *g, const ddp_coll_args *a, int path) {
    ddp_coll_hdr h = {.magic = DDP_COLL_MAGIC, .kind = (uint8_t)a->kind, .path = (uint8_t)path,
                      .rank = (uint32_t)g->rank, .seq = g->seq, .tag = g->tag};
    if (a->kind == DDP_COLL_BARRIER) return h;
    h.dtype = (uint8_t)a->dtype;
    h.count = a->count;
    if (a->kind == DDP_COLL_ALLREDUCE || a->kind == DDP_COLL_REDUCE ||
        a->kind == DDP_COLL_REDUCE_SCATTER)
        h.op = (uint8_t)a->op;
    if (a->kind != DDP_COLL_ALLREDUCE && a->kind != DDP_COLL_ALLGATHER &&
        a->kind != DDP_COLL_REDUCE_SCATTER)
        h.root = a->root;
    return h;
}

void ddp_coll_describe(const ddp_coll_hdr *h, char *buf, size_t len) {
    const char *name = ddp_coll_name((ddp_coll_kind)h->kind);
    const char *dt = ddp_dtype_name((ddp_dtype)h->dtype);
    const char *op = ddp_redop_name((ddp_redop)h->op);
    unsigned long long n = (unsigned long long)h->count;
    switch (h->kind) {
    case DDP_COLL_BARRIER: snprintf(buf, len, "barrier()"); break;
    case DDP_COLL_ALLREDUCE: case DDP_COLL_REDUCE_SCATTER:
        snprintf(buf, len, "%s(count=%llu, %s, %s)", name, n, dt, op);
        break;
    case DDP_COLL_REDUCE:
        snprintf(buf, len, "%s(count=%llu, %s, %s, root=%d)", name, n, dt, op, (int)h->root);
        break;
    case DDP_COLL_ALLGATHER: snprintf(buf, len, "%s(count=%llu, %s)", name, n, dt); break;
    case DDP_COLL_SEND:
        snprintf(buf, len, "send(count=%llu, %s, to rank %d)", n, dt, (int)h->root);
        break;
    case DDP_COLL_RECV:
        if (h->root == DDP_ANY_SOURCE)
            snprintf(buf, len, "recv(count=%llu, %s, from any rank)", n, dt);
        else
            snprintf(buf, len, "recv(count=%llu, %s, from rank %d)", n, dt, (int)h->root);
        break;
    case DDP_COLL_ALLTOALL: snprintf(buf, len, "all_to_all(%s)", dt); break;
    case DDP_COLL_P2P_BATCH: /* count: sends << 32 | receives, with rank `root` */
        snprintf(buf, len, "batch_isend_irecv(%llu sends to and %llu receives from rank %d)",
                 n >> 32, n & 0xffffffffu, (int)h->root);
        break;
    default: snprintf(buf, len, "%s(count=%llu, %s, root=%d)", name, n, dt, (int)h->root);
    }
}

/* ---- header checks -------------------------------------------------------- */

static ddp_status hdr_read(const ddp_coll_xres *r, int p, const ddp_coll_hdr *mine,
                           ddp_coll_hdr *h) {
    return ddp_coll_hdr_parse(r->slots + (size_t)p * r->slot_len, p, mine, h);
}

/* The group tag is checked before the sender's rank: a rank that called on
 * another group (a subgroup over the same links, or its parent) numbers the
 * ranks differently, and "different process groups" is the real cause. */
ddp_status ddp_coll_hdr_parse(const unsigned char *in, int p, const ddp_coll_hdr *mine,
                              ddp_coll_hdr *h) {
    hdr_decode(in, h);
    if (h->magic == DDP_COLL_MAGIC && h->tag != mine->tag) {
        char dh[160], dm[160];
        ddp_coll_describe(h, dh, sizeof dh);
        ddp_coll_describe(mine, dm, sizeof dm);
        char renum[80] = "";
        if (h->rank != (uint32_t)p)
            snprintf(renum, sizeof renum, " (rank %d is rank %u of the group it called on)", p,
                     (unsigned)h->rank);
        return ddp_error(DDP_ERR_MISMATCH, "process group mismatch: rank %d called %s on group "
                         "tag 0x%016llx but rank %u called %s on group tag 0x%016llx%s; the "
                         "ranks called the collective on different process groups (every rank "
                         "must call it on the same group)", p, dh, (unsigned long long)h->tag,
                         (unsigned)mine->rank, dm, (unsigned long long)mine->tag, renum);
    }
    if (h->magic != DDP_COLL_MAGIC || h->rank != (uint32_t)p)
        return ddp_error(DDP_ERR_PROTOCOL, "rank %d sent bytes that are not a collective header "
                         "(magic 0x%08x, rank %u); do all ranks run the same pyddp version?", p,
                         (unsigned)h->magic, (unsigned)h->rank);
    return DDP_OK;
}

static int same_call(const ddp_coll_hdr *a, const ddp_coll_hdr *b) {
    return a->kind == b->kind && a->dtype == b->dtype && a->op == b->op && a->root == b->root &&
           a->count == b->count;
}

/* DDP_ERR_MISMATCH naming the two ranks (lower first) and their calls. */
/* The algorithm family a header's path byte names, for messages. */
static const char *path_name(int path) {
    switch (path) {
    case DDP_COLL_PATH_SMALL: return "latency path";
    case DDP_COLL_PATH_LARGE: return "flat ring/chain";
    case DDP_COLL_PATH_HIER: return "hierarchical";
    }
    return "unknown algorithm";
}

static ddp_status mismatch(int ra, const ddp_coll_hdr *a, int rb, const ddp_coll_hdr *b) {
    char da[160], db[160];
    if (ra > rb) {
        const ddp_coll_hdr *t = a;
        int tr = ra;
        a = b, ra = rb, b = t, rb = tr;
    }
    ddp_coll_describe(a, da, sizeof da);
    ddp_coll_describe(b, db, sizeof db);
    if (!same_call(a, b))
        return ddp_error(DDP_ERR_MISMATCH, "collective mismatch: rank %d called %s but rank %d "
                         "called %s; every rank must make the same collective calls (same count, "
                         "dtype, op and root) in the same order", ra, da, rb, db);
    if (a->path != b->path)
        return ddp_error(DDP_ERR_MISMATCH, "ranks %d and %d chose different algorithms for %s "
                         "(rank %d: %s, rank %d: %s): the small-message threshold "
                         "(PYDDP_SMALL_BYTES) and PYDDP_ALGO must be the same on every rank",
                         ra, rb, da, ra, path_name(a->path), rb, path_name(b->path));
    return ddp_error(DDP_ERR_MISMATCH, "collective mismatch: rank %d is at collective #%llu, "
                     "%s, but rank %d is at collective #%llu, %s; every rank must make the same "
                     "collective calls in the same order", ra, (unsigned long long)a->seq + 1, da,
                     rb, (unsigned long long)b->seq + 1, db);
}

/* Collectives: compare every rank's header with rank 0's, so that every rank
 * reports the same first difference. Send/recv: the peer must have made the
 * matching call (recv from us for our send, and the other way round). */
static ddp_status check_headers(const ddp_group *g, const ddp_coll_hdr *mine,
                                const ddp_coll_xchg *x, const ddp_coll_xres *r, int nbr) {
    ddp_coll_hdr first, h;
    ddp_status st;
    if (nbr) {   /* the ring neighbours only: each against this rank's own */
        const int n = g->size, me = g->rank;
        for (int i = 0; i < 2; i++) {
            const int p = (me + (i ? n - 1 : 1)) % n;
            if ((st = hdr_read(r, p, mine, &h)) != DDP_OK) return st;
            if (!same_call(mine, &h) || mine->path != h.path || mine->seq != h.seq)
                return mismatch(me, mine, p, &h);
        }
        return DDP_OK;
    }
    if (x->peer >= 0) {
        if ((st = hdr_read(r, x->peer, mine, &h)) != DDP_OK) return st;
        ddp_coll_hdr want = *mine;
        want.kind = mine->kind == DDP_COLL_SEND ? DDP_COLL_RECV : DDP_COLL_SEND;
        want.root = g->rank;
        want.seq = h.seq; /* send/recv do not advance the sequence */
        return same_call(&want, &h) && want.path == h.path ? DDP_OK
                                                          : mismatch(g->rank, mine, x->peer, &h);
    }
    for (int p = 0; p < g->size; p++) {
        if (p == g->rank)
            h = *mine;
        else if ((st = hdr_read(r, p, mine, &h)) != DDP_OK)
            return st;
        if (p == 0)
            first = h;
        else if (!same_call(&first, &h) || first.path != h.path || first.seq != h.seq)
            return mismatch(0, &first, p, &h);
    }
    return DDP_OK;
}

ddp_status ddp_coll_hdr_agree(const ddp_coll_hdr *mine, int p, const unsigned char *raw) {
    ddp_coll_hdr h;
    ddp_status st = ddp_coll_hdr_parse(raw, p, mine, &h);
    if (st != DDP_OK) return st;
    if (!same_call(mine, &h) || mine->path != h.path || mine->seq != h.seq)
        return mismatch((int)mine->rank, mine, p, &h);
    return DDP_OK;
}

/* After the header phase failed (a peer closed or timed out): if a header
 * that did arrive shows a different call or group, that is the cause (the
 * peer that saw the mismatch first broke its links, which is why this rank's
 * exchange failed); report it instead of the lost connection. Otherwise keep
 * failed's status and message. */
static ddp_status explain_failure(ddp_status failed, const ddp_coll_hdr *mine,
                                  const ddp_xfer *ops, int nops, const ddp_coll_xres *r,
                                  const ddp_group *g) {
    char saved[2048];
    ddp_copy_error(saved, sizeof saved);
    for (int i = 0; i < nops; i++) {
        if (ops[i].send || ops[i].done < DDP_COLL_HDR_BYTES) continue;
        int p = 0;   /* the group rank of this link (a subgroup numbers ranks its own way) */
        while (p < g->size && g->links[p] != ops[i].link) p++;
        if (p == g->size) continue;
        ddp_coll_hdr h;
        ddp_status st = hdr_read(r, p, mine, &h);
        if (st == DDP_ERR_MISMATCH) return st;
        if (st != DDP_OK) continue;
        int is_p2p = mine->kind == DDP_COLL_SEND || mine->kind == DDP_COLL_RECV;
        if (!is_p2p && (!same_call(mine, &h) || mine->path != h.path || mine->seq != h.seq))
            return mismatch(g->rank, mine, p, &h);
    }
    ddp_set_error_text(saved);
    return failed;
}

/* ---- the exchange ----------------------------------------------------------- */

ddp_status ddp_coll_exchange(ddp_group *g, const ddp_coll_hdr *h, const ddp_coll_xchg *x,
                             ddp_wait w, ddp_coll_xres *res) {
    const int n = g->size, me = g->rank;
    const size_t hb = DDP_COLL_HDR_BYTES;
    const int per_dest = x->sbytes > 0 && x->sstride > 0;
    const size_t stage_len = ddp_coll_align(hb + x->sbytes);
    const size_t slot_len = ddp_coll_align(hb + x->rbytes);
    /* scratch: transfers | outgoing message(s) | one incoming slot per rank | extra */
    const size_t off_stage = ddp_coll_align(2 * (size_t)n * sizeof(ddp_xfer));
    const size_t off_slots = off_stage + (per_dest ? (size_t)n : 1) * stage_len;
    const size_t off_extra = off_slots + (size_t)n * slot_len;
    void *mem;
    ddp_status st = ddp_coll_scratch(g, off_extra + x->extra, &mem);
    if (st != DDP_OK) return st;
    unsigned char *base = mem, *stage = base + off_stage;
    ddp_xfer *ops = mem;
    res->slots = base + off_slots;
    res->slot_len = slot_len;
    res->extra = base + off_extra;
    res->own = per_dest || x->sbytes == 0 ? NULL : stage + hb;

    if (!per_dest) { /* one message for every destination */
        hdr_encode(h, stage);
        if (x->sbytes > 0) memcpy(stage + hb, x->sbase, x->sbytes);
    }
    /* A large group checks headers with its ring neighbours only. */
    const int nbr = x->peer < 0 && !x->mesh && n > DDP_COLL_MESH_MAX;
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    int nops = 0;
    for (int p = 0; p < n; p++) {
        if (p == me || (x->peer >= 0 && p != x->peer)) continue;
        if (nbr && p != next && p != prev) continue;
        if ((st = ddp_group_need_mutual(g, p, w)) != DDP_OK) return st;   /* lower first */
        unsigned char *msg = per_dest ? stage + (size_t)p * stage_len : stage;
        size_t sbytes = x->sto < 0 || x->sto == p ? x->sbytes : 0;
        size_t rbytes = x->rfrom < 0 || x->rfrom == p ? x->rbytes : 0;
        if (per_dest) {
            hdr_encode(h, msg);
            memcpy(msg + hb, (const char *)x->sbase + (size_t)p * x->sstride, x->sbytes);
        }
        ops[nops++] = (ddp_xfer){.link = g->links[p], .send = 1, .src = msg,
                                 .len = hb + sbytes, .want = 0};
        ops[nops++] = (ddp_xfer){.link = g->links[p], .send = 0,
                                 .dst = res->slots + (size_t)p * slot_len,
                                 .len = hb + rbytes, .want = hb};
    }

    if ((st = ddp_link_xfer(ops, nops, w)) != DDP_OK)
        return st == DDP_ERR_CLOSED ? explain_failure(st, h, ops, nops, res, g) : st;
    if ((st = check_headers(g, h, x, res, nbr)) != DDP_OK) return st;
    for (int i = 0; i < nops; i++) ops[i].want = ops[i].len;
    return ddp_link_xfer(ops, nops, w);
}
