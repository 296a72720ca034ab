/* ddp_link_shm.c - shared-memory link: segment creation and mapping, and the
 * ring-buffer progress functions behind ddp_link_ops (contract in
 * ddp_link_shm.h).
 *
 * Memory ordering: the producer copies bytes into the ring and then stores
 * the new head with release semantics; the consumer loads head with acquire,
 * copies the bytes out, and stores the new tail with release. Each side keeps
 * a private copy of the other side's counter and reloads it only when the
 * ring looks full (producer) or empty (consumer), so the shared cache lines
 * move between cores once per slice rather than once per byte.
 */
#include "ddp_link_shm.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#define SHM_MAGIC 0x4d484444u      /* "DDHM" */
#define SHM_VERSION 1u
#define SHM_SLICE (64u << 10)      /* publish head/tail at least this often */
#define LIVENESS_PERIOD_US 1000    /* how often an idle side polls the socket */
#define RING_MIN (64u << 10)
#define RING_MAX (256u << 20)

typedef struct shm_ring_ctl {
    _Alignas(64) _Atomic uint64_t head;   /* bytes ever written (producer) */
    _Alignas(64) _Atomic uint64_t tail;   /* bytes ever consumed (consumer) */
} shm_ring_ctl;

typedef struct shm_hdr {
    uint32_t magic;
    uint32_t version;
    uint64_t ring_bytes;
    uint64_t total_bytes;
    _Alignas(64) _Atomic uint32_t closed[2];   /* side s has shut down */
    shm_ring_ctl ring[2];                      /* ring d: side d -> side 1-d */
} shm_hdr;

_Static_assert(sizeof(_Atomic uint64_t) == 8, "64-bit atomics must be plain words");

#define DATA_OFFSET ((sizeof(shm_hdr) + 4095) & ~(size_t)4095)

struct ddp_shm_seg {
    shm_hdr *hdr;
    size_t map_len;
};

typedef struct shm_impl {
    ddp_shm_seg *seg;
    int side;
    size_t cap, mask;
    uint8_t *tx, *rx;              /* data areas of the send and receive rings */
    shm_ring_ctl *txc, *rxc;
    uint64_t tx_head, tx_tail_seen; /* producer's own head, last tail seen */
    uint64_t rx_tail, rx_head_seen; /* consumer's own tail, last head seen */
    ddp_link *liveness;            /* the pair's TCP link, idle after the upgrade */
    int64_t last_check_us;
    atomic_int shut;
} shm_impl;

size_t ddp_shm_ring_bytes(void) {
    const char *v = getenv("PYDDP_SHM_RING_BYTES");
    if (v == NULL || *v == '\0') return DDP_SHM_RING_DEFAULT;
    char *end;
    unsigned long long x = strtoull(v, &end, 10);
    if (*end != '\0' || x == 0) return DDP_SHM_RING_DEFAULT;
    size_t r = RING_MIN;
    while (r < x && r < RING_MAX) r <<= 1;
    return r;
}

static size_t seg_len(size_t ring_bytes) { return DATA_OFFSET + 2 * ring_bytes; }

/* Unique per process and call: pid, a counter and clock bits. */
static void make_name(char out[DDP_SHM_NAME_MAX]) {
    static atomic_uint counter;
    unsigned n = atomic_fetch_add(&counter, 1u);
    snprintf(out, DDP_SHM_NAME_MAX, "/pyddp-%ld-%u-%llx", (long)getpid(), n,
             (unsigned long long)ddp_now_us());
}

ddp_status ddp_shm_seg_create(size_t ring_bytes, char name_out[DDP_SHM_NAME_MAX],
                              ddp_shm_seg **out) {
    *out = NULL;
    if (ring_bytes < RING_MIN || (ring_bytes & (ring_bytes - 1)) != 0)
        return ddp_error(DDP_ERR_INVALID, "shared-memory ring size %zu is not a power of two "
                         ">= %u", ring_bytes, RING_MIN);
    int fd = -1;
    for (int tries = 0; fd < 0 && tries < 8; tries++) {
        make_name(name_out);
        fd = shm_open(name_out, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd < 0 && errno != EEXIST) break;
    }
    if (fd < 0)
        return ddp_error(DDP_ERR_SYS, "shm_open(%s) failed: %s; check that /dev/shm is "
                         "mounted and writable, or set PYDDP_SHM_DISABLE=1", name_out,
                         strerror(errno));
    size_t len = seg_len(ring_bytes);
    ddp_status st = DDP_OK;
    int err = 0;
    /* Reserve the pages now: a full tmpfs must fail here, not SIGBUS later. */
    if (ftruncate(fd, (off_t)len) != 0) err = errno;
    else err = posix_fallocate(fd, 0, (off_t)len);
    void *p = MAP_FAILED;
    if (err == 0) {
        p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) err = errno;
    }
    close(fd);
    if (err != 0) {
        shm_unlink(name_out);
        st = ddp_error(err == ENOSPC ? DDP_ERR_NOMEM : DDP_ERR_SYS,
                       "could not allocate a %zu-byte shared-memory segment in /dev/shm: %s; "
                       "enlarge /dev/shm (docker --shm-size), lower PYDDP_SHM_RING_BYTES, or "
                       "set PYDDP_SHM_DISABLE=1", len, strerror(err));
        return st;
    }
    ddp_shm_seg *s = malloc(sizeof *s);
    if (s == NULL) {
        munmap(p, len);
        shm_unlink(name_out);
        return ddp_error(DDP_ERR_NOMEM, "out of memory");
    }
    s->hdr = p;
    s->map_len = len;
    /* Fresh tmpfs pages are zero: counters and flags start at 0. */
    s->hdr->ring_bytes = ring_bytes;
    s->hdr->total_bytes = len;
    s->hdr->version = SHM_VERSION;
    atomic_thread_fence(memory_order_release);
    s->hdr->magic = SHM_MAGIC;
    *out = s;
    return DDP_OK;
}

ddp_status ddp_shm_seg_open(const char *name, ddp_shm_seg **out) {
    *out = NULL;
    int fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
    if (fd < 0)
        return ddp_error(DDP_ERR_SYS, "shm_open(%s) of the peer's segment failed: %s "
                         "(does the peer see the same /dev/shm?)", name, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || (size_t)sb.st_size < DATA_OFFSET) {
        close(fd);
        return ddp_error(DDP_ERR_PROTOCOL, "shared-memory segment %s is too small", name);
    }
    size_t len = (size_t)sb.st_size;
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int err = errno;
    close(fd);
    if (p == MAP_FAILED)
        return ddp_error(DDP_ERR_SYS, "mmap of shared-memory segment %s failed: %s", name,
                         strerror(err));
    shm_hdr *h = p;
    if (h->magic != SHM_MAGIC || h->version != SHM_VERSION || h->total_bytes != len ||
        seg_len(h->ring_bytes) != len || h->ring_bytes < RING_MIN ||
        (h->ring_bytes & (h->ring_bytes - 1)) != 0) {
        munmap(p, len);
        return ddp_error(DDP_ERR_PROTOCOL, "shared-memory segment %s has a bad header "
                         "(magic %#x, version %u)", name, h->magic, h->version);
    }
    ddp_shm_seg *s = malloc(sizeof *s);
    if (s == NULL) {
        munmap(p, len);
        return ddp_error(DDP_ERR_NOMEM, "out of memory");
    }
    s->hdr = h;
    s->map_len = len;
    *out = s;
    return DDP_OK;
}

void ddp_shm_unlink(const char *name) {
    if (name && name[0]) shm_unlink(name);
}

void ddp_shm_seg_close(ddp_shm_seg *s) {
    if (s == NULL) return;
    munmap(s->hdr, s->map_len);
    free(s);
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
static ddp_status local_shutdown_error(void) {
    return ddp_error(DDP_ERR_ABORTED, "the link was shut down on this rank (the "
                     "communicator was aborted or broken by an earlier error)");
}

/* Called when no progress was possible: DDP_OK to keep waiting, or
 * DDP_ERR_CLOSED if this side shut down or the peer is gone. recheck says
 * whether data/space appeared meanwhile (the peer may write its last bytes
 * and then close); it is consulted before reporting the peer gone. */
static ddp_status idle_check(shm_impl *s, int (*recheck)(shm_impl *)) {
    if (atomic_load_explicit(&s->shut, memory_order_relaxed))
        return local_shutdown_error();
    const char *why = NULL;
    if (atomic_load_explicit(&s->seg->hdr->closed[1 - s->side], memory_order_acquire)) {
        why = "closed its end of the shared-memory link (it failed, aborted or left the "
              "process group)";
    } else {
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

static int tx_has_space(shm_impl *s) {
    uint64_t t = atomic_load_explicit(&s->txc->tail, memory_order_acquire);
    return s->tx_head - t < s->cap;
}

static int rx_has_data(shm_impl *s) {
    return atomic_load_explicit(&s->rxc->head, memory_order_acquire) != s->rx_tail;
}

static ddp_status shm_send_some(ddp_link *l, const void *buf, size_t n, size_t *done) {
    shm_impl *s = l->impl;
    if (*done >= n) return DDP_OK;
    if (atomic_load_explicit(&s->shut, memory_order_relaxed)) return local_shutdown_error();
    /* Bytes for a peer that has closed would never be read. */
    if (atomic_load_explicit(&s->seg->hdr->closed[1 - s->side], memory_order_acquire))
        return ddp_error(DDP_ERR_CLOSED, "the peer closed its end of the shared-memory link "
                         "(it failed, aborted or left the process group); check its output "
                         "for the first error");
    size_t want = n - *done;
    if (s->cap - (size_t)(s->tx_head - s->tx_tail_seen) < want)
        s->tx_tail_seen = atomic_load_explicit(&s->txc->tail, memory_order_acquire);
    size_t space = s->cap - (size_t)(s->tx_head - s->tx_tail_seen);
    if (space == 0) return idle_check(s, tx_has_space);
    const uint8_t *src = (const uint8_t *)buf + *done;
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
    return DDP_OK;
}

static ddp_status shm_recv_some(ddp_link *l, void *buf, size_t n, size_t *done) {
    shm_impl *s = l->impl;
    if (*done >= n) return DDP_OK;
    if (atomic_load_explicit(&s->shut, memory_order_relaxed)) return local_shutdown_error();
    size_t want = n - *done;
    if ((size_t)(s->rx_head_seen - s->rx_tail) < want)
        s->rx_head_seen = atomic_load_explicit(&s->rxc->head, memory_order_acquire);
    size_t avail = (size_t)(s->rx_head_seen - s->rx_tail);
    if (avail == 0) return idle_check(s, rx_has_data);
    uint8_t *dst = (uint8_t *)buf + *done;
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
    return DDP_OK;
}

/* No descriptor signals ring progress: the generic driver spins/yields. */
static int shm_wait_fd(ddp_link *l) {
    (void)l;
    return -1;
}

static void shm_shutdown(ddp_link *l) {
    shm_impl *s = l->impl;
    atomic_store(&s->shut, 1);
    atomic_store_explicit(&s->seg->hdr->closed[s->side], 1u, memory_order_release);
    if (s->liveness) ddp_link_shutdown(s->liveness);
}

static void shm_destroy(ddp_link *l) {
    shm_impl *s = l->impl;
    if (s == NULL) return;
    /* Tell a peer still waiting on us, before the mapping goes away. */
    atomic_store_explicit(&s->seg->hdr->closed[s->side], 1u, memory_order_release);
    ddp_link_free(s->liveness);
    ddp_shm_seg_close(s->seg);
    free(s);
    l->impl = NULL;
}

static const ddp_link_ops shm_ops = {
    "shm", shm_send_some, shm_recv_some, shm_wait_fd, shm_shutdown, shm_destroy,
};

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
    s->side = side ? 1 : 0;
    s->cap = (size_t)h->ring_bytes;
    s->mask = s->cap - 1;
    s->tx = data + (size_t)s->side * s->cap;
    s->rx = data + (size_t)(1 - s->side) * s->cap;
    s->txc = &h->ring[s->side];
    s->rxc = &h->ring[1 - s->side];
    s->tx_head = s->tx_tail_seen = atomic_load(&s->txc->head);
    s->rx_tail = s->rx_head_seen = atomic_load(&s->rxc->tail);
    s->liveness = liveness;
    s->last_check_us = ddp_now_us();
    atomic_init(&s->shut, 0);
    l->ops = &shm_ops;
    l->peer = peer;
    snprintf(l->desc, sizeof l->desc, "%s", desc ? desc : "peer");
    l->impl = s;
    return l;
}
