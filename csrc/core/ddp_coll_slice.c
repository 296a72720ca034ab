/* ddp_coll_slice.c - the bandwidth-path all-reduce of a group whose ranks
 * are all on one host: a ring reduce-scatter and all-gather run slice by
 * slice, so that each slice's bytes are combined, forwarded and copied back
 * while they are still in the caches, and, over shared memory, with one
 * pass over each byte and no staging copy or system call.
 *
 * The stream. The buffer is cut into size blocks (ddp_coll_block) and each
 * block into slices of DDP_COLL_SLICE_BYTES. For each slice index k in
 * turn, a rank sends its ring successor 2(size-1) messages, j = 0..2n-3,
 * and receives as many from its predecessor:
 *   j < n-1   reduce-scatter step j: it sends slice k of block me-j-1 (its
 *             own input at j = 0, else the partial result it computed from
 *             message j-1) and receives block me-j-2's partial result, which
 *             it combines with its own input; at j = n-2 that is block me,
 *             final: finished (AVG's division) and written in place;
 *   j >= n-1  all-gather step t = j-n+1: it sends block me-t (its own final
 *             slice at t = 0, else what it received at j-1) and receives block
 *             me-t-1's final slice, written in place.
 * Every rank computes the same cut, so the streams agree whatever each rank's
 * way of moving them.
 *
 * Two ways to run it, chosen by each rank for itself (the streams are the
 * same bytes either way):
 *   direct  both ring links give direct access to their buffers
 *           (ddp_link_direct: shared memory) with room for two slices: the
 *           rank combines received bytes where the peer wrote them and
 *           writes what it sends straight into the successor's ring, so a
 *           received partial sum is reduced with the own input into the
 *           outgoing ring in one pass, the final slice goes to the own buffer
 *           and the ring together, and the all-gather copies out of the ring
 *           into place;
 *   staged  otherwise (TCP, or a ring too small): each message is one
 *           ddp_link_sendrecv, partial sums accumulated in place as in
 *           ddp_coll_ring.c, received partial sums in one slice of scratch.
 * Program order on a direct rank: slice k+1's first message (the own input
 * of block me-1) is pushed right after slice k's last sending take, before
 * slice k's last received block is copied into place, so the successor starts
 * the next slice while this rank finishes the last one. Each link still
 * carries the messages in stream order; only when a rank writes them moves.
 * Deadlock: a message is at most one slice and a ring holds two. A rank
 * sends at most one message more than it has received, two only in that
 * early push, which waits for its successor to read no more than the message
 * before it. So along a chain of ranks each waiting for room, the number of
 * messages read falls strictly from each rank to its successor, which cannot
 * close a ring; a rank waiting for bytes has a predecessor with an empty
 * link, so not waiting for room; and ranks all waiting for bytes would need
 * every link empty while each has sent more than it received.
 */
#include "ddp_coll_internal.h"

#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Bytes of one slice (a constant of the stream: every rank must cut alike). */
#define DDP_COLL_SLICE_BYTES ((size_t)256 << 10)
/* Most bytes combined per step of a direct message: what stays in L1/L2
 * between combining and forwarding, and how often the peer sees progress. */
#define PIECE_BYTES ((size_t)64 << 10)
/* Calls from this size up take the slices; smaller ones (a slice or two per
 * block) gain nothing from the pipeline and keep the block ring. */
#define SLICE_MIN_BYTES ((size_t)512 << 10)
/* Buffers from this size up are written back with streaming stores. */
#define STREAM_MIN_BYTES ((size_t)8 << 20)

typedef struct slicer {
    ddp_dtype t;
    ddp_redop op;
    size_t es, count, se; /* element size, elements, elements per slice */
    char *buf;
    int n, me;
    ddp_link *next, *prev;
    ddp_wait w;
    int stream;           /* copy_out with streaming stores */
} slicer;

/* What a rank does with a received message (see the file comment). */
enum { REDUCE_SEND, REDUCE_FINAL, COPY_SEND, COPY_LAST };

static int mod(int x, int n) { return ((x % n) + n) % n; }

/* Slice k of block b: *p at its first element, its length in elements. */
static size_t slice_at(const slicer *c, int b, size_t k, char **p) {
    size_t off, len;
    ddp_coll_block(c->count, c->n, mod(b, c->n), &off, &len);
    const size_t first = k * c->se;
    *p = c->buf + (off + first) * c->es;
    return first >= len ? 0 : (len - first < c->se ? len - first : c->se);
}

/* Message j's received block, and the action on it. */
static int recv_block(const slicer *c, int j, int *action) {
    const int n = c->n;
    if (j < n - 1) {
        *action = j < n - 2 ? REDUCE_SEND : REDUCE_FINAL;
        return c->me - j - 2;
    }
    *action = j < 2 * n - 3 ? COPY_SEND : COPY_LAST;
    return c->me - (j - n + 1) - 1;
}

/* ---- direct --------------------------------------------------------------- */

/* Copy m bytes received into the rank's own buffer. A large buffer is not
 * read again before the call ends, so its bytes go out with streaming stores
 * (no read for ownership, the caches kept for the rings). */
static void copy_out(const slicer *c, char *dst, const void *src, size_t m) {
#if defined(__SSE2__)
    if (c->stream) {
        const char *s = src;
        size_t head = (size_t)(-(uintptr_t)dst & 15);
        if (head > m) head = m;
        memcpy(dst, s, head);
        size_t i = head;
        for (; i + 64 <= m; i += 64) {
            __m128i x0 = _mm_loadu_si128((const __m128i *)(s + i));
            __m128i x1 = _mm_loadu_si128((const __m128i *)(s + i + 16));
            __m128i x2 = _mm_loadu_si128((const __m128i *)(s + i + 32));
            __m128i x3 = _mm_loadu_si128((const __m128i *)(s + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), x0);
            _mm_stream_si128((__m128i *)(dst + i + 16), x1);
            _mm_stream_si128((__m128i *)(dst + i + 32), x2);
            _mm_stream_si128((__m128i *)(dst + i + 48), x3);
        }
        memcpy(dst + i, s + i, m - i);
        return;
    }
#endif
    memcpy(dst, src, m);
}

/* Nothing to peek on rx or no room on tx (NULL: not waited for): wait with
 * the link driver's deadline, abort flag, spinning and parking. */
static ddp_status idle(const slicer *c, ddp_link *rx, ddp_link *tx) {
    return ddp_link_wait_direct(rx, c->es, tx, c->es, c->w);
}

/* Copy len bytes from src into the successor's ring. */
static ddp_status push(const slicer *c, const char *src, size_t len) {
    while (len > 0) {
        void *tp;
        size_t tn;
        ddp_status st = ddp_link_tx_reserve(c->next, c->es, &tp, &tn);
        if (st != DDP_OK) return st;
        if (tn == 0) {
            if ((st = idle(c, NULL, c->next)) != DDP_OK) return st;
            continue;
        }
        size_t m = len < tn ? len : tn;
        if (m > PIECE_BYTES) m = PIECE_BYTES;
        m -= m % c->es;
        memcpy(tp, src, m);
        ddp_link_tx_commit(c->next, m);
        src += m;
        len -= m;
    }
    return DDP_OK;
}

/* Take one received message of len bytes for own (slice of the block it
 * belongs to) and do `action` with it, piece by piece as bytes arrive. */
static ddp_status take(const slicer *c, int action, char *own, size_t len) {
    const int sends = action != COPY_LAST;
    while (len > 0) {
        const void *rp;
        void *tp = NULL;
        size_t rn, tn = len;
        ddp_status st = ddp_link_rx_peek(c->prev, c->es, &rp, &rn);
        if (st == DDP_OK && sends) st = ddp_link_tx_reserve(c->next, c->es, &tp, &tn);
        if (st != DDP_OK) return st;
        if (rn == 0 || tn == 0) {
            if ((st = idle(c, rn ? NULL : c->prev, tn ? NULL : c->next)) != DDP_OK) return st;
            continue;
        }
        size_t m = len < rn ? len : rn;
        if (m > tn) m = tn;
        if (m > PIECE_BYTES) m = PIECE_BYTES;
        m -= m % c->es;
        const size_t k = m / c->es;
        switch (action) {
        case REDUCE_SEND: ddp_reduce3(c->t, c->op, tp, own, rp, k); break;
        case REDUCE_FINAL:
            if (c->op == DDP_AVG) {
                ddp_reduce3(c->t, c->op, own, own, rp, k);
                ddp_reduce_finish(c->t, c->op, own, k, c->n);
                memcpy(tp, own, m);
            } else {
                ddp_reduce_dup(c->t, c->op, own, tp, rp, k);
            }
            break;
        case COPY_SEND: memcpy(tp, rp, m); copy_out(c, own, rp, m); break;
        default: copy_out(c, own, rp, m); break;
        }
        ddp_link_rx_consume(c->prev, m);
        if (sends) ddp_link_tx_commit(c->next, m);
        own += m;
        len -= m;
    }
    return DDP_OK;
}

/* Push slice k of the block a rank sends first (block me-1, its own input). */
static ddp_status push_slice(const slicer *c, size_t k) {
    char *p;
    const size_t len = slice_at(c, c->me - 1, k, &p);
    return push(c, p, len * c->es);
}

/* Run every slice's 2(n-1) messages in stream order, with slice k+1's
 * first message pushed as soon as slice k's last sending take is done (see
 * the file comment: the streams are unchanged, the successor starts on the
 * next slice while this rank copies slice k's last block into place). */
static ddp_status run_direct(const slicer *c, size_t nslices) {
    const int last_send = 2 * c->n - 4; /* j of slice k's last sending take */
    ddp_status st = nslices ? push_slice(c, 0) : DDP_OK;
    for (size_t k = 0; st == DDP_OK && k < nslices; k++) {
        for (int j = 0; st == DDP_OK && j < 2 * c->n - 2; j++) {
            int action;
            char *p;
            const size_t len = slice_at(c, recv_block(c, j, &action), k, &p);
            st = take(c, action, p, len * c->es);
            if (st == DDP_OK && j == last_send && k + 1 < nslices) st = push_slice(c, k + 1);
        }
    }
    return st;
}

/* ---- staged --------------------------------------------------------------- */

static ddp_status run_staged(const slicer *c, size_t nslices, char *tmp) {
    for (size_t k = 0; k < nslices; k++) {
        char *sp = NULL;
        size_t sn = slice_at(c, c->me - 1, k, &sp);
        for (int j = 0; j < 2 * c->n - 2; j++) {
            int action;
            char *own;
            const size_t rn = slice_at(c, recv_block(c, j, &action), k, &own);
            const int reduce = action == REDUCE_SEND || action == REDUCE_FINAL;
            ddp_status st = ddp_link_sendrecv(c->next, sp, sn * c->es, c->prev,
                                              reduce ? tmp : own, rn * c->es, c->w);
            if (st != DDP_OK) return st;
            if (reduce) ddp_reduce3(c->t, c->op, own, own, tmp, rn);
            if (action == REDUCE_FINAL) ddp_reduce_finish(c->t, c->op, own, rn, c->n);
            sp = own; /* message j+1 is the block just received, as it is now */
            sn = rn;
        }
    }
    return DDP_OK;
}

int ddp_coll_slice_applies(const ddp_group *g, const ddp_coll_args *a) {
    return g->nhosts == 1 && g->size > 1 && g->algo != DDP_ALGO_BLOCK &&
           a->count * ddp_dtype_size(a->dtype) >= SLICE_MIN_BYTES &&
           !ddp_coll_wire_wide(a->dtype, a->op);
}

ddp_status ddp_coll_slice_allreduce(ddp_group *g, const ddp_coll_args *a, ddp_wait w) {
    ddp_status st = ddp_coll_ring_need(g, w);
    if (st != DDP_OK) return st;
    const int n = g->size, me = g->rank;
    slicer c = {.t = a->dtype, .op = a->op, .es = ddp_dtype_size(a->dtype),
                .count = a->count, .buf = a->buf, .n = n, .me = me,
                .next = g->links[mod(me + 1, n)], .prev = g->links[mod(me - 1, n)], .w = w};
    c.se = DDP_COLL_SLICE_BYTES / c.es;
    size_t off, maxlen;
    ddp_coll_block(a->count, n, 0, &off, &maxlen); /* block 0 is a longest one */
    const size_t nslices = (maxlen + c.se - 1) / c.se;
    const size_t room = 2 * DDP_COLL_SLICE_BYTES;
    /* Every link with direct access starts the data 64-byte aligned, whatever
     * this rank's way (both ends pad alike), so elements never straddle a
     * cache line and the kernels get aligned pointers. */
    if ((st = ddp_link_direct_align(c.next, c.prev, 64, w)) != DDP_OK) return st;
    if (ddp_link_direct(c.next) && ddp_link_direct(c.prev) && c.next->direct_room >= room &&
        c.prev->direct_room >= room) {
        c.stream = a->count * c.es >= STREAM_MIN_BYTES;
        st = run_direct(&c, nslices);
#if defined(__SSE2__)
        if (c.stream) _mm_sfence(); /* streamed stores ordered before the call's end */
#endif
        return st;
    }
    void *tmp;
    if ((st = ddp_coll_scratch(g, DDP_COLL_SLICE_BYTES, &tmp)) != DDP_OK) return st;
    return run_staged(&c, nslices, tmp);
}
