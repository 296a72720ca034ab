/* ddp_link_shm.c - the shared-memory link's progress functions behind
 * ddp_link_ops (contract in ddp_link_shm.h; segment layout in
 * ddp_link_shm_int.h).
 *
 * Two ways to move bytes, chosen per send:
 *   - the ring: the sender copies into this direction's ring in the segment
 *     and the receiver copies out (two copies; any size; the latency path);
 *   - a descriptor, for sends of at least PYDDP_SHM_CMA_MIN bytes when the
 *     receiver proved at link creation that it may read the sender's memory
 *     (process_vm_readv, "cross-memory attach"; same user, no Yama or seccomp
 *     veto): the sender publishes where its bytes are and the receiver copies
 *     them straight into its own buffer (one copy). The sender's send_some
 *     reports progress as the receiver copies, so the caller's buffer is never
 *     read after the send completes.
 * The byte stream stays in order because the sender never uses both at once:
 * it posts a descriptor only after the receiver has drained the ring, and
 * writes to the ring only when no descriptor is outstanding; the receiver
 * serves an outstanding descriptor before looking at the ring.
 *
 * Memory ordering: the producer copies bytes into the ring and then stores
 * the new head with release semantics; the consumer loads head with acquire,
 * copies the bytes out, and stores the new tail with release. Each side keeps
 * a private copy of the other side's counter and reloads it only when the
 * ring looks full (producer) or empty (consumer), so the shared cache lines
 * move between cores once per slice rather than once per byte. Descriptors
 * are published the same way (fields, then `posted` with release).
 */
#include "ddp_link_shm_int.h"
#include "ddp_settings.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#endif
#include <time.h>

#define SHM_SLICE (64u << 10)        /* publish head/tail at least this often */
#define CMA_PIECE (1u << 20)         /* bytes per process_vm_readv call */
#define LIVENESS_PERIOD_US 1000      /* how often an idle side polls the socket */
#define IDLE_SPINS_PER_CLOCK 16      /* idle checks between clock reads while spinning */


/* ---- parking: sleep until the peer moves ------------------------------ */

/* The peer's counters that can unblock this side, summed: any change means
 * there may be something to do. */
static uint64_t peer_signature(const shm_impl *s) {
    const shm_hdr *h = s->h;
    return atomic_load_explicit(&s->rxc->head, memory_order_acquire) +
           atomic_load_explicit(&s->txc->tail, memory_order_acquire) +
           atomic_load_explicit(&h->desc[s->side].copied, memory_order_acquire) +
           atomic_load_explicit(&h->desc[1 - s->side].posted, memory_order_acquire) +
           atomic_load_explicit(&h->closed[1 - s->side], memory_order_acquire);
}

/* After publishing progress: wake the peer if it is parked. The fence pairs
 * with shm_park's, so either the peer sees our counter or we see its flag. */
void ddp_shm_wake_peer(shm_impl *s) {
    int p = 1 - s->side;
    atomic_thread_fence(memory_order_seq_cst);
    if (!atomic_load_explicit(&s->h->sleeping[p], memory_order_relaxed)) return;
    atomic_fetch_add_explicit(&s->h->bell[p], 1u, memory_order_release);
#ifdef __linux__
    syscall(SYS_futex, (uint32_t *)&s->h->bell[p], FUTEX_WAKE, 1, NULL, NULL, 0);
#endif
}

/* ddp_link_ops.park: sleep on this side's bell until the peer rings it or
 * timeout_us passes; return at once if the peer moved since the last park. */
static void shm_park(ddp_link *l, int timeout_us) {
    shm_impl *s = l->impl;
    shm_hdr *h = s->h;
    uint32_t bell = atomic_load_explicit(&h->bell[s->side], memory_order_acquire);
    atomic_store_explicit(&h->sleeping[s->side], 1u, memory_order_relaxed);
    atomic_thread_fence(memory_order_seq_cst);
    uint64_t sig = peer_signature(s);
    if (sig == s->park_sig && !atomic_load_explicit(&s->shut, memory_order_relaxed)) {
        struct timespec ts = {timeout_us / 1000000, (long)(timeout_us % 1000000) * 1000};
#ifdef __linux__
        syscall(SYS_futex, (uint32_t *)&h->bell[s->side], FUTEX_WAIT, bell, &ts, NULL, 0);
#else
        (void)bell;
        nanosleep(&ts, NULL);
#endif
        sig = peer_signature(s);
    }
    s->park_sig = sig;
    s->parked = 1;
    atomic_store_explicit(&h->sleeping[s->side], 0u, memory_order_relaxed);
}

/* ---- liveness -------------------------------------------------------- */

/* 1 if the idle TCP socket shows EOF or an error (peer died or shut down).
 * Nothing is sent on it after the upgrade, so readable means gone. */
static int liveness_lost(ddp_link *tcp) {
    if (tcp == NULL || tcp->ops->wait_fd == NULL) return 0;
    int fd = tcp->ops->wait_fd(tcp);
    if (fd < 0) return 0;
    struct pollfd pfd = {fd, POLLIN, 0};
    if (poll(&pfd, 1, 0) <= 0) return 0;
    if (pfd.revents & (POLLERR | POLLHUP | POLLNVAL)) return 1;
    char b;
    ssize_t r = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

/* Same status and wording as the TCP link's after a local shutdown. */
ddp_status ddp_shm_local_shutdown(void) {
    return ddp_error(DDP_ERR_ABORTED, "the link was shut down on this rank (the "
                     "communicator was aborted or broken by an earlier error)");
}

/* Called when no progress was possible: DDP_OK to keep waiting, or
 * DDP_ERR_CLOSED if this side shut down or the peer is gone. recheck says
 * whether data/space appeared meanwhile (the peer may write its last bytes
 * and then close); it is consulted before reporting the peer gone. */
ddp_status ddp_shm_idle_check(shm_impl *s, int (*recheck)(shm_impl *)) {
    if (atomic_load_explicit(&s->shut, memory_order_relaxed))
        return ddp_shm_local_shutdown();
    const char *why = NULL;
    if (atomic_load_explicit(&s->h->closed[1 - s->side], memory_order_acquire)) {
        why = "closed its end of the shared-memory link (it failed, aborted or left the "
              "process group)";
    } else if (s->parked || ++s->idle_spins >= IDLE_SPINS_PER_CLOCK) {
        /* The clock is read after a park, or every few spins: a spinning
         * rank asks often, and the clock is not free. */
        s->parked = 0;
        s->idle_spins = 0;
        int64_t now = ddp_now_us();
        if (now - s->last_check_us >= LIVENESS_PERIOD_US) {
            s->last_check_us = now;
            if (liveness_lost(s->liveness))
                why = "closed its connection (the process died or left the process group)";
        }
    }
    if (why == NULL || recheck(s)) return DDP_OK;
    return ddp_error(DDP_ERR_CLOSED, "the peer %s; check its output for the first error",
                     why);
}

/* ---- ring progress -------------------------------------------------- */

int ddp_shm_tx_has_space(shm_impl *s) {
    uint64_t t = atomic_load_explicit(&s->txc->tail, memory_order_acquire);
    return s->tx_head - t < s->cap;
}

int ddp_shm_rx_has_data(shm_impl *s) {
    return atomic_load_explicit(&s->rxc->head, memory_order_acquire) != s->rx_tail;
}

/* The peer's counter moved somewhere a correct peer never puts it (a
 * consumer ahead of the producer, or more bytes than the ring holds). */
ddp_status ddp_shm_corrupt(const shm_impl *s, const char *which, uint64_t mine,
                                  uint64_t theirs) {
    return ddp_error(DDP_ERR_PROTOCOL, "the peer's %s counter of the shared-memory ring is "
                     "inconsistent (%llu against this side's %llu, ring of %zu bytes): the "
                     "segment was overwritten; is another process using it?", which,
                     (unsigned long long)theirs, (unsigned long long)mine, s->cap);
}

/* Copy as much of src[0, want) into the send ring as fits now. */
static ddp_status ring_send(shm_impl *s, const uint8_t *src, size_t want, size_t *done) {
    if (s->cap - (size_t)(s->tx_head - s->tx_tail_seen) < want) {
        s->tx_tail_seen = atomic_load_explicit(&s->txc->tail, memory_order_acquire);
        if (s->tx_head - s->tx_tail_seen > s->cap) /* also catches tail > head */
            return ddp_shm_corrupt(s, "consumer", s->tx_head, s->tx_tail_seen);
    }
    size_t space = s->cap - (size_t)(s->tx_head - s->tx_tail_seen);
    if (space == 0) return ddp_shm_idle_check(s, ddp_shm_tx_has_space);
    size_t moved = 0;
    while (want > 0 && space > 0) {
        size_t k = want < space ? want : space;
        if (k > SHM_SLICE) k = SHM_SLICE;
        size_t off = (size_t)s->tx_head & s->mask;
        size_t first = k < s->cap - off ? k : s->cap - off;
        memcpy(s->tx + off, src + moved, first);
        if (k > first) memcpy(s->tx, src + moved + first, k - first);
        s->tx_head += k;
        atomic_store_explicit(&s->txc->head, s->tx_head, memory_order_release);
        moved += k;
        want -= k;
        space -= k;
    }
    *done += moved;
    ddp_shm_wake_peer(s);
    return DDP_OK;
}

/* Copy up to want bytes out of the receive ring into dst. */
static ddp_status ring_recv(shm_impl *s, uint8_t *dst, size_t want, size_t *done) {
    if ((size_t)(s->rx_head_seen - s->rx_tail) < want) {
        s->rx_head_seen = atomic_load_explicit(&s->rxc->head, memory_order_acquire);
        if (s->rx_head_seen - s->rx_tail > s->cap) /* also catches head < tail */
            return ddp_shm_corrupt(s, "producer", s->rx_tail, s->rx_head_seen);
    }
    size_t avail = (size_t)(s->rx_head_seen - s->rx_tail);
    if (avail == 0) return ddp_shm_idle_check(s, ddp_shm_rx_has_data);
    size_t moved = 0;
    while (want > 0 && avail > 0) {
        size_t k = want < avail ? want : avail;
        if (k > SHM_SLICE) k = SHM_SLICE;
        size_t off = (size_t)s->rx_tail & s->mask;
        size_t first = k < s->cap - off ? k : s->cap - off;
        memcpy(dst + moved, s->rx + off, first);
        if (k > first) memcpy(dst + moved + first, s->rx, k - first);
        s->rx_tail += k;
        atomic_store_explicit(&s->rxc->tail, s->rx_tail, memory_order_release);
        moved += k;
        want -= k;
        avail -= k;
    }
    *done += moved;
    ddp_shm_wake_peer(s);
    return DDP_OK;
}

/* ---- descriptor path (single copy) ---------------------------------- */

/* Whether this process may read the peer's memory: read the peer's probe
 * word with process_vm_readv and compare. Off with PYDDP_SHM_CMA=0. */
static int cma_probe_peer(const shm_hdr *h, int side) {
#ifdef __linux__
    int peer = 1 - side;
    const int64_t pid = (int64_t)ddp_le_get64(h->pid[peer]);
    if (!ddp_setting_int("PYDDP_SHM_CMA") || pid <= 0) return 0;
    uint64_t got = 0;
    struct iovec lo = {&got, sizeof got};
    struct iovec re = {(void *)(uintptr_t)ddp_le_get64(h->probe[peer]), sizeof got};
    return process_vm_readv((pid_t)pid, &lo, 1, &re, 1, 0) == (ssize_t)sizeof got &&
           got == SHM_PROBE;
#else
    (void)h;
    (void)side;
    return 0;
#endif
}

static int tx_drained(shm_impl *s) {
    return atomic_load_explicit(&s->txc->tail, memory_order_acquire) == s->tx_head;
}

static int desc_moved(shm_impl *s) {
    return atomic_load_explicit(&s->h->desc[s->side].copied, memory_order_acquire) >
           s->desc_reported;
}

/* Report the receiver's progress on our outstanding descriptor. */
static ddp_status desc_progress(shm_impl *s, size_t *done) {
    uint64_t c = atomic_load_explicit(&s->h->desc[s->side].copied, memory_order_acquire);
    if (c > s->desc_len) return ddp_shm_corrupt(s, "copied", s->desc_len, c);
    if (c <= s->desc_reported) return ddp_shm_idle_check(s, desc_moved);
    *done += (size_t)(c - s->desc_reported);
    s->desc_reported = c;
    if (c == s->desc_len) s->desc_active = 0;
    return DDP_OK;
}

/* Publish src[0, len) for the receiver to copy in place. The ring must be
 * drained (so the receiver has read every earlier byte). */
static ddp_status desc_post(shm_impl *s, const uint8_t *src, size_t len, size_t *done) {
    shm_desc *d = &s->h->desc[s->side];
    atomic_store_explicit(&d->copied, 0, memory_order_relaxed);
    ddp_le_put64(d->addr, (uint64_t)(uintptr_t)src);
    ddp_le_put64(d->len, len);
    s->desc_active = 1;
    s->desc_len = len;
    s->desc_reported = 0;
    atomic_store_explicit(&d->posted, ++s->desc_seq, memory_order_release);
    ddp_shm_wake_peer(s);
    return desc_progress(s, done);
}

/* Copy the next bytes of the peer's outstanding descriptor into dst. */
ddp_status ddp_shm_desc_recv(shm_impl *s, uint64_t posted, uint8_t *dst, size_t want,
                            size_t *done) {
    shm_desc *d = &s->h->desc[1 - s->side];
    if (s->rx_desc_seen != posted) {
        s->rx_desc_seen = posted;
        s->rx_addr = ddp_le_get64(d->addr);
        s->rx_len = ddp_le_get64(d->len);
        s->rx_copied = 0;
    }
    size_t k = (size_t)(s->rx_len - s->rx_copied);
    if (k > want) k = want;
    if (k > CMA_PIECE) k = CMA_PIECE;
    ssize_t r = -1;
    int err = ENOSYS;
#ifdef __linux__
    struct iovec lo = {dst, k};
    struct iovec re = {(void *)(uintptr_t)(s->rx_addr + s->rx_copied), k};
    r = process_vm_readv((pid_t)s->peer_pid, &lo, 1, &re, 1, 0);
    err = errno;
#endif
    /* A peer that shut down may already have released the buffer: whatever
     * was read is not trusted then. */
    if (atomic_load_explicit(&s->h->closed[1 - s->side], memory_order_acquire))
        return ddp_error(DDP_ERR_CLOSED, "the peer closed its end of the shared-memory link "
                         "while this rank was reading its data; check its output for the "
                         "first error");
    /* No such process: the peer died (SIGKILL raises no closed flag), as a
     * closed connection says on the other transports. */
    if (r <= 0 && err == ESRCH)
        return ddp_error(DDP_ERR_CLOSED, "the peer process %lld is gone, and its end of the "
                         "shared-memory link closed with it (it died or was killed: "
                         "process_vm_readv: %s); check its output for the first error",
                         (long long)s->peer_pid, strerror(err));
    if (r <= 0)
        return ddp_error(DDP_ERR_SYS, "copying %zu bytes out of the peer process %lld with "
                         "process_vm_readv failed: %s (PYDDP_SHM_CMA=0 turns this path off)",
                         k, (long long)s->peer_pid, strerror(err));
    s->rx_copied += (uint64_t)r;
    *done += (size_t)r;
    if (s->rx_copied == s->rx_len) s->rx_desc_done = posted;
    atomic_store_explicit(&d->copied, s->rx_copied, memory_order_release);
    ddp_shm_wake_peer(s);
    return DDP_OK;
}

/* ---- ddp_link_ops ---------------------------------------------------- */

static ddp_status shm_send_some(ddp_link *l, const void *buf, size_t n, size_t *done) {
    shm_impl *s = l->impl;
    if (*done >= n) return DDP_OK;
    if (atomic_load_explicit(&s->shut, memory_order_relaxed)) return ddp_shm_local_shutdown();
    /* The peer may copy our last bytes and close at once: progress first. */
    if (s->desc_active) return desc_progress(s, done);
    /* Bytes for a peer that has closed would never be read. */
    if (atomic_load_explicit(&s->h->closed[1 - s->side], memory_order_acquire))
        return ddp_error(DDP_ERR_CLOSED, "the peer closed its end of the shared-memory link "
                         "(it failed, aborted or left the process group); check its output "
                         "for the first error");
    const uint8_t *src = (const uint8_t *)buf + *done;
    size_t want = n - *done;
    if (want >= s->cma_min &&
        atomic_load_explicit(&s->h->cma_ok[s->side], memory_order_acquire)) {
        if (!tx_drained(s)) return ddp_shm_idle_check(s, tx_drained);
        return desc_post(s, src, want, done);
    }
    return ring_send(s, src, want, done);
}

static ddp_status shm_recv_some(ddp_link *l, void *buf, size_t n, size_t *done) {
    shm_impl *s = l->impl;
    if (*done >= n) return DDP_OK;
    if (atomic_load_explicit(&s->shut, memory_order_relaxed)) return ddp_shm_local_shutdown();
    if (s->rxb_len > s->rxb_pos) { /* bytes a peek took out of the ring or a descriptor */
        size_t k = s->rxb_len - s->rxb_pos < n - *done ? s->rxb_len - s->rxb_pos : n - *done;
        memcpy((uint8_t *)buf + *done, s->rxb + s->rxb_pos, k);
        ddp_shm_rx_consume(l, k);
        *done += k;
        return DDP_OK;
    }
    uint64_t posted = atomic_load_explicit(&s->h->desc[1 - s->side].posted,
                                           memory_order_acquire);
    uint8_t *dst = (uint8_t *)buf + *done;
    if (posted != s->rx_desc_done) return ddp_shm_desc_recv(s, posted, dst, n - *done, done);
    return ring_recv(s, dst, n - *done, done);
}

/* No descriptor signals ring progress: the generic driver spins/yields. */
static int shm_wait_fd(ddp_link *l) {
    (void)l;
    return -1;
}

static void shm_shutdown(ddp_link *l) {
    shm_impl *s = l->impl;
    atomic_store(&s->shut, 1);
    atomic_store_explicit(&s->h->closed[s->side], 1u, memory_order_release);
    ddp_shm_wake_peer(s);
    if (s->liveness) ddp_link_shutdown(s->liveness);
}

static void shm_destroy(ddp_link *l) {
    shm_impl *s = l->impl;
    if (s == NULL) return;
    /* Tell a peer still waiting on us, before the mapping goes away. */
    atomic_store_explicit(&s->h->closed[s->side], 1u, memory_order_release);
    ddp_shm_wake_peer(s);
    ddp_link_free(s->liveness);
    ddp_shm_seg_close(s->seg);
    free(s->rxb);
    free(s);
    l->impl = NULL;
}

static const ddp_link_ops shm_ops = {
    .name = "shm",
    .send_some = shm_send_some,
    .recv_some = shm_recv_some,
    .wait_fd = shm_wait_fd,
    .shutdown = shm_shutdown,
    .destroy = shm_destroy,
    .park = shm_park,
    .rx_peek = ddp_shm_rx_peek,
    .rx_consume = ddp_shm_rx_consume,
    .tx_reserve = ddp_shm_tx_reserve,
    .tx_commit = ddp_shm_tx_commit,
    .direct_pos = ddp_shm_direct_pos,
};

static size_t cma_min_bytes(void) {
    int64_t v = ddp_setting_int("PYDDP_SHM_CMA_MIN"); /* at least 1 */
    return (uint64_t)v > SIZE_MAX ? SIZE_MAX : (size_t)v;
}

ddp_link *ddp_link_shm_new(ddp_shm_seg *seg, int side, ddp_link *liveness, int peer,
                           const char *desc) {
    ddp_link *l = calloc(1, sizeof *l);
    shm_impl *s = calloc(1, sizeof *s);
    if (l == NULL || s == NULL) {
        free(l);
        free(s);
        ddp_link_free(liveness);
        ddp_shm_seg_close(seg);
        return NULL;
    }
    shm_hdr *h = seg->hdr;
    uint8_t *data = (uint8_t *)h + DATA_OFFSET;
    s->seg = seg;
    s->h = h;
    s->side = side ? 1 : 0;
    s->cap = seg->ring_bytes; /* from this process's mapping, not the shared header */
    s->mask = s->cap - 1;
    s->tx = data + (size_t)s->side * s->cap;
    s->rx = data + (size_t)(1 - s->side) * s->cap;
    s->txc = &h->ring[s->side];
    s->rxc = &h->ring[1 - s->side];
    s->tx_head = s->tx_tail_seen = atomic_load(&s->txc->head);
    s->rx_tail = s->rx_head_seen = atomic_load(&s->rxc->tail);
    s->cma_min = cma_min_bytes();
    s->desc_seq = atomic_load(&h->desc[s->side].posted);
    s->rx_desc_seen = s->rx_desc_done = atomic_load(&h->desc[1 - s->side].posted);
    /* Our peer may send us descriptors once we know we can read its memory. */
    atomic_store_explicit(&h->cma_ok[1 - s->side], (uint32_t)cma_probe_peer(h, s->side),
                          memory_order_release);
    s->peer_pid = (int64_t)ddp_le_get64(h->pid[1 - s->side]);
    s->liveness = liveness;
    s->last_check_us = ddp_now_us();
    atomic_init(&s->shut, 0);
    l->ops = &shm_ops;
    l->peer = peer;
    snprintf(l->desc, sizeof l->desc, "%s", desc ? desc : "peer");
    l->impl = s;
    l->direct_room = s->cap;
    return l;
}
