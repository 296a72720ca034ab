/* ddp_link_shm_direct.c - direct access to a shared-memory link's rings
 * (the rx_peek, rx_consume, tx_reserve and tx_commit ops of ddp_link_ops;
 * contract in ddp_link.h, segment layout in ddp_link_shm_int.h).
 *
 * An algorithm that reduces received bytes into its own buffer, or writes
 * what it computes for the peer, can then work on the ring itself: the
 * receiver combines the bytes where the sender put them and the sender
 * produces them there, so each byte crosses memory once between the two
 * processes, with no staging copy and no system call (ddp_coll_slice.c).
 *
 * Bytes that cannot be shown where they lie go through small bounce areas of
 * this process: the bytes of a descriptor the peer posted (a peer that sent
 * with send_some, whose large sends are copied with process_vm_readv), and
 * an element that the ring's wrap splits in two. Received bytes bounced to
 * rxb are handed out from there before anything else, by rx_peek and by
 * recv_some alike, so the stream stays in order whichever op reads it.
 */
#include "ddp_link_shm_int.h"

#include <stdlib.h>
#include <string.h>

/* idle_check's recheck where what arrived meanwhile cannot be enough: fewer
 * than min bytes are there, and a peer that is gone sends no more. */
static int no_progress(shm_impl *s) {
    (void)s;
    return 0;
}

/* Bytes of the receive ring readable now (the head reloaded), or a failure
 * if the peer's counter is impossible. */
static ddp_status rx_avail(shm_impl *s, size_t *avail) {
    s->rx_head_seen = atomic_load_explicit(&s->rxc->head, memory_order_acquire);
    if (s->rx_head_seen - s->rx_tail > s->cap) /* also catches head < tail */
        return ddp_shm_corrupt(s, "producer", s->rx_tail, s->rx_head_seen);
    *avail = (size_t)(s->rx_head_seen - s->rx_tail);
    return DDP_OK;
}

/* Move up to want ring bytes to the end of rxb (both pieces across the wrap). */
static size_t ring_to_rxb(shm_impl *s, size_t avail, size_t want) {
    size_t k = avail < want ? avail : want;
    size_t off = (size_t)s->rx_tail & s->mask, first = k < s->cap - off ? k : s->cap - off;
    memcpy(s->rxb + s->rxb_len, s->rx + off, first);
    memcpy(s->rxb + s->rxb_len + first, s->rx, k - first);
    s->rxb_len += k;
    s->rx_tail += k;
    atomic_store_explicit(&s->rxc->tail, s->rx_tail, memory_order_release);
    ddp_shm_wake_peer(s);
    return k;
}

/* Refill rxb (its unread bytes moved to the front first) from the peer's
 * descriptor or the ring, whichever holds the next bytes of the stream. */
static ddp_status fill_rxb(shm_impl *s, size_t min) {
    if (s->rxb == NULL && (s->rxb = malloc(SHM_BOUNCE)) == NULL)
        return ddp_error(DDP_ERR_NOMEM, "out of memory for a shared-memory bounce area");
    memmove(s->rxb, s->rxb + s->rxb_pos, s->rxb_len - s->rxb_pos);
    s->rxb_len -= s->rxb_pos;
    s->rxb_pos = 0;
    uint64_t posted = atomic_load_explicit(&s->h->desc[1 - s->side].posted,
                                           memory_order_acquire);
    if (posted != s->rx_desc_done) {
        size_t got = 0;
        ddp_status st = ddp_shm_desc_recv(s, posted, s->rxb + s->rxb_len,
                                          SHM_BOUNCE - s->rxb_len, &got);
        s->rxb_len += got;
        return st;
    }
    size_t avail = 0;
    ddp_status st = rx_avail(s, &avail);
    if (st == DDP_OK && avail > 0) ring_to_rxb(s, avail, min > s->rxb_len ? min - s->rxb_len : 0);
    return st;
}

ddp_status ddp_shm_rx_peek(ddp_link *l, size_t min, const void **p, size_t *n) {
    shm_impl *s = l->impl;
    *n = 0;
    if (atomic_load_explicit(&s->shut, memory_order_relaxed)) return ddp_shm_local_shutdown();
    if (min == 0) min = 1;
    uint64_t posted = atomic_load_explicit(&s->h->desc[1 - s->side].posted,
                                           memory_order_acquire);
    if (s->rxb_len == s->rxb_pos && posted == s->rx_desc_done) {
        size_t avail = 0;
        ddp_status st = rx_avail(s, &avail);
        if (st != DDP_OK) return st;
        const size_t off = (size_t)s->rx_tail & s->mask;
        const size_t contig = avail < s->cap - off ? avail : s->cap - off;
        if (contig >= min) { /* the common case: the bytes where the peer wrote them */
            s->rx_peeked_rxb = 0;
            *p = s->rx + off;
            *n = contig;
            return DDP_OK;
        }
        if (avail == 0) return ddp_shm_idle_check(s, ddp_shm_rx_has_data);
        if (avail < min) return ddp_shm_idle_check(s, no_progress); /* rest of an element */
    }
    if (s->rxb_len - s->rxb_pos < min) {
        ddp_status st = fill_rxb(s, min);
        if (st != DDP_OK) return st;
        if (s->rxb_len - s->rxb_pos < min) return ddp_shm_idle_check(s, no_progress);
    }
    s->rx_peeked_rxb = 1;
    *p = s->rxb + s->rxb_pos;
    *n = s->rxb_len - s->rxb_pos;
    return DDP_OK;
}

void ddp_shm_rx_consume(ddp_link *l, size_t k) {
    shm_impl *s = l->impl;
    if (k == 0) return;
    if (s->rx_peeked_rxb || s->rxb_len > s->rxb_pos) {
        s->rxb_pos += k;
        if (s->rxb_pos >= s->rxb_len) s->rxb_pos = s->rxb_len = 0;
        return;
    }
    s->rx_tail += k;
    atomic_store_explicit(&s->rxc->tail, s->rx_tail, memory_order_release);
    ddp_shm_wake_peer(s);
}

ddp_status ddp_shm_tx_reserve(ddp_link *l, size_t min, void **p, size_t *n) {
    shm_impl *s = l->impl;
    *n = 0;
    if (atomic_load_explicit(&s->shut, memory_order_relaxed)) return ddp_shm_local_shutdown();
    if (s->desc_active)
        return ddp_error(DDP_ERR_INTERNAL, "direct send on a shared-memory link while a "
                         "descriptor is outstanding");
    if (atomic_load_explicit(&s->h->closed[1 - s->side], memory_order_acquire))
        return ddp_error(DDP_ERR_CLOSED, "the peer closed its end of the shared-memory link "
                         "(it failed, aborted or left the process group); check its output "
                         "for the first error");
    if (min == 0) min = 1;
    size_t space = s->cap - (size_t)(s->tx_head - s->tx_tail_seen);
    if (space < s->cap / 2) { /* reload the consumer's tail only when it matters */
        s->tx_tail_seen = atomic_load_explicit(&s->txc->tail, memory_order_acquire);
        if (s->tx_head - s->tx_tail_seen > s->cap)
            return ddp_shm_corrupt(s, "consumer", s->tx_head, s->tx_tail_seen);
        space = s->cap - (size_t)(s->tx_head - s->tx_tail_seen);
    }
    if (space == 0) return ddp_shm_idle_check(s, ddp_shm_tx_has_space);
    if (space < min) return ddp_shm_idle_check(s, no_progress);
    const size_t off = (size_t)s->tx_head & s->mask;
    const size_t contig = space < s->cap - off ? space : s->cap - off;
    if (contig >= min) {
        s->tx_lent_txb = 0;
        *p = s->tx + off;
        *n = contig;
    } else { /* an element across the wrap: written to txb, copied in on commit */
        s->tx_lent_txb = 1;
        *p = s->txb;
        *n = min;
    }
    return DDP_OK;
}

/* Ring bytes: the producer's head, the consumer's tail (a descriptor's
 * bytes, which never pass the ring, are counted by neither end). Asked
 * between messages, when rxb holds nothing: a message's bytes are pulled
 * into rxb only while it is being read. */
uint64_t ddp_shm_direct_pos(ddp_link *l, int send) {
    shm_impl *s = l->impl;
    return send ? s->tx_head : s->rx_tail;
}

void ddp_shm_tx_commit(ddp_link *l, size_t k) {
    shm_impl *s = l->impl;
    if (k == 0) return;
    if (s->tx_lent_txb) {
        const size_t off = (size_t)s->tx_head & s->mask, first = s->cap - off;
        memcpy(s->tx + off, s->txb, first < k ? first : k);
        if (k > first) memcpy(s->tx, s->txb + first, k - first);
        s->tx_lent_txb = 0;
    }
    s->tx_head += k;
    atomic_store_explicit(&s->txc->head, s->tx_head, memory_order_release);
    ddp_shm_wake_peer(s);
}
