/* ddp_link.h - one point-to-point byte stream between this rank and a peer.
 *
 * A link is a transport-neutral pipe (TCP, over one socket or striped over
 * several to the same peer; shared memory for ranks on one host). Transports implement non-blocking progress functions
 * in a small table of function pointers; the generic drivers below turn them
 * into blocking calls with deadlines and abort checks, and drive a send and a
 * receive on two different links at once (what a ring step needs, even when
 * one neighbour is over shared memory and the other over TCP).
 *
 * Ownership: a link owns its transport resources (the socket, the mapping)
 * and releases them in ddp_link_free. A link is used by one thread at a time
 * (the communicator's worker); ddp_link_shutdown may be called from any
 * thread to make every pending and future operation fail fast.
 */
#ifndef DDP_LINK_H
#define DDP_LINK_H

#include <poll.h>
#include <stddef.h>
#include <stdint.h>
#include "ddp_clock.h"
#include "ddp_status.h"

typedef struct ddp_link ddp_link;

typedef struct ddp_link_ops {
    const char *name;  /* "tcp", "shm" */
    /* Move as many bytes as possible now without blocking, advancing *done
     * (bytes of buf already moved). DDP_OK with no progress is allowed. */
    ddp_status (*send_some)(ddp_link *l, const void *buf, size_t n, size_t *done);
    ddp_status (*recv_some)(ddp_link *l, void *buf, size_t n, size_t *done);
    /* File descriptor to poll() while waiting (POLLIN for recv, POLLOUT for
     * send), or -1 if the transport must be polled by spinning/yielding. */
    int (*wait_fd)(ddp_link *l);
    /* Make pending and future operations fail (thread-safe, idempotent). */
    void (*shutdown)(ddp_link *l);
    /* Release resources; the link struct itself is freed by ddp_link_free. */
    void (*destroy)(ddp_link *l);
    /* Optional (NULL if absent), for links without a descriptor: block for
     * at most timeout_us until the peer may have made progress possible on
     * this link in either direction; returning early is always allowed. The
     * driver parks here instead of spinning once a wait lasts, so a waiting
     * rank gives its core away and is still woken at once. */
    void (*park)(ddp_link *l, int timeout_us);
    /* Optional (NULL if absent): whether the peer still answers, asked about
     * once a second while a transfer on this link makes no progress. DDP_OK,
     * or a failure (with its message) that ends the transfer: a TCP peer
     * whose kernel acknowledged nothing for PYDDP_PEER_DEAD_S (its host or
     * the network is gone; ddp_sock_peer_silent). */
    ddp_status (*check)(ddp_link *l);
    /* Optional (NULL: the driver polls wait_fd's one descriptor), for links
     * over several descriptors: the ones to poll() while a transfer in
     * direction `send` waits, i.e. those that still have bytes of the call
     * in progress to move (a descriptor with nothing to do must not be
     * listed: an idle socket is always writable and would make the wait
     * spin). Fills at most max entries of fds (fd and events) and returns
     * how many it has, which may exceed max (call again with more room). */
    int (*poll_fds)(ddp_link *l, int send, struct pollfd *fds, int max);
    /* Optional, all four or none (a shared-memory link has them): direct
     * access to the link's own buffers, for algorithms that combine
     * received bytes where they lie and produce bytes straight into the
     * link (ddp_coll_slice.c), with no staging copy. rx_peek points *p at
     * the next received bytes, contiguous, without consuming them: *n >= min
     * of them, or *n == 0 when fewer are there now (DDP_OK: wait and ask
     * again), or a failure as recv_some's (the peer gone, a shutdown).
     * rx_consume(l, k) consumes the first k <= *n. tx_reserve and tx_commit
     * do the same for room to send: the k bytes written at *p are sent by
     * tx_commit(l, k). min is at most DDP_LINK_DIRECT_MIN. Between calls
     * they mix freely with send_some and recv_some. */
    ddp_status (*rx_peek)(ddp_link *l, size_t min, const void **p, size_t *n);
    void (*rx_consume)(ddp_link *l, size_t k);
    ddp_status (*tx_reserve)(ddp_link *l, size_t min, void **p, size_t *n);
    void (*tx_commit)(ddp_link *l, size_t k);
    /* Bytes this end has sent (send) or taken (receive) through its buffers
     * so far: at the same point of the stream both ends count the same, so
     * they agree on the padding that aligns it (ddp_link_direct_align). */
    uint64_t (*direct_pos)(ddp_link *l, int send);
} ddp_link_ops;

/* Largest `min` of the direct-access ops: one element of any dtype. */
#define DDP_LINK_DIRECT_MIN 16

/* Most bytes a link holds back for its next receive (ddp_link_unread). */
#define DDP_LINK_HELD_MAX 64

struct ddp_link {
    const ddp_link_ops *ops;
    int peer;              /* peer's rank */
    char desc[300];        /* "rank 3 (10.0.0.5:41234)", for messages */
    void *impl;            /* transport state */
    /* Bytes already taken from the transport and handed back: the drivers
     * give them to the next receives before reading the transport again. */
    unsigned char held[DDP_LINK_HELD_MAX];
    size_t held_len;
    size_t direct_room;    /* direct-access links: bytes buffered per direction */
};

/* Blocking drivers: move exactly n bytes or fail with TIMEOUT, ABORTED,
 * CLOSED (message names l->desc). */
ddp_status ddp_link_send(ddp_link *l, const void *buf, size_t n, ddp_wait w);
ddp_status ddp_link_recv(ddp_link *l, void *buf, size_t n, ddp_wait w);
/* Send sn bytes on sl and receive rn bytes on rl concurrently (sl and rl may
 * be the same link). Either length may be 0. */
ddp_status ddp_link_sendrecv(ddp_link *sl, const void *sbuf, size_t sn,
                             ddp_link *rl, void *rbuf, size_t rn, ddp_wait w);

/* One transfer in a batch driven by ddp_link_xfer: send from src or receive
 * into dst (by `send`), len bytes in all. The caller sets done = 0 once and
 * chooses `want` per call: ddp_link_xfer returns when every transfer has
 * done >= want, while still moving any transfer with done < len whenever
 * its link is ready (so a peer is never starved while this rank waits for
 * something else). A transfer whose link fails after reaching `want` is
 * parked rather than failed; the failure is reported by the first later call
 * that needs more of it. Several transfers may share a link (one per
 * direction). */
typedef struct ddp_xfer {
    ddp_link *link;
    int send;
    int peek;              /* direct-access links only: move nothing, wait until
                            * `want` bytes can be peeked (receive) or reserved
                            * (send); done is then set to len (= want) */
    const void *src;
    void *dst;
    size_t len, want, done;
    int parked;            /* internal: link failed after `want` was met */
} ddp_xfer;

/* Drive n transfers concurrently, polling their links, until each has
 * done >= want; TIMEOUT, ABORTED or the first transfer's failure otherwise
 * (messages name the direction and the link's desc). */
ddp_status ddp_link_xfer(ddp_xfer *x, int n, ddp_wait w);

/* Like ddp_link_xfer, but returns as soon as one transfer has done >= want
 * (*which = its index; the others keep what they moved, so a later call can
 * go on with them). A transfer whose link fails before its want is dropped
 * (done unchanged, parked = 1) and the call goes on with the others; it
 * fails only when every transfer failed (the last failure), or with TIMEOUT
 * or ABORTED. Transfers must have done < want on entry. */
ddp_status ddp_link_xfer_any(ddp_xfer *x, int n, ddp_wait w, int *which);

/* Whether l has the direct-access ops and nothing held back for its next
 * receive (ddp_link_unread), so that ddp_link_rx_peek sees its stream. */
int ddp_link_direct(const ddp_link *l);

/* Wait until rx (if not NULL) has at least rmin bytes to peek and tx (if
 * not NULL) room to reserve tmin, by w: the ddp_link_xfer engine with its
 * deadline, abort flag, parking and liveness checks. Both links must be
 * direct (ddp_link_direct); rx and tx may be the same link. */
ddp_status ddp_link_wait_direct(ddp_link *rx, size_t rmin, ddp_link *tx, size_t tmin,
                                ddp_wait w);

/* Pad the stream to a multiple of align (a power of two, at most 4096) on
 * every link given that has the direct-access ops: tx's sending side writes
 * the padding, rx's receiving side skips it (either may be NULL). Both ends
 * of a link must call it at the same point of its stream; links without the
 * ops are left alone (and so are both their ends). By w. */
ddp_status ddp_link_direct_align(ddp_link *tx, ddp_link *rx, size_t align, ddp_wait w);

/* Prefix the error st of a direct access to l with the direction and the
 * peer, as a transfer's failure is (the peer's description in the message is
 * what names a lost rank); returns st. */
ddp_status ddp_link_direct_failed(const ddp_link *l, int send, ddp_status st);

/* The direct-access ops of a direct link (contract at ddp_link_ops); a
 * failure's message names the peer (ddp_link_direct_failed). */
static inline ddp_status ddp_link_rx_peek(ddp_link *l, size_t min, const void **p,
                                          size_t *n) {
    ddp_status st = l->ops->rx_peek(l, min, p, n);
    return st == DDP_OK ? st : ddp_link_direct_failed(l, 0, st);
}
static inline void ddp_link_rx_consume(ddp_link *l, size_t k) { l->ops->rx_consume(l, k); }
static inline ddp_status ddp_link_tx_reserve(ddp_link *l, size_t min, void **p, size_t *n) {
    ddp_status st = l->ops->tx_reserve(l, min, p, n);
    return st == DDP_OK ? st : ddp_link_direct_failed(l, 1, st);
}
static inline void ddp_link_tx_commit(ddp_link *l, size_t k) { l->ops->tx_commit(l, k); }

/* Hand back n bytes received from l (n + what l already holds at most
 * DDP_LINK_HELD_MAX): the next receive on l gets them first, in front of
 * what it held already. DDP_ERR_INTERNAL if they do not fit. */
ddp_status ddp_link_unread(ddp_link *l, const void *buf, size_t n);

void ddp_link_shutdown(ddp_link *l);
void ddp_link_free(ddp_link *l);   /* NULL is a no-op */

/* A TCP link over a connected socket; takes ownership of fd (made
 * non-blocking, TCP_NODELAY and 4 MiB buffers, best effort). NULL when out
 * of memory, with fd already closed. */
ddp_link *ddp_link_tcp_new(int fd, int peer, const char *desc);

/* Most sockets one TCP link may have (PYDDP_NSOCKS_PERPEER's bound). */
#define DDP_LINK_MAX_STREAMS 16
/* Segment of a striped TCP link: the link's byte stream (per direction) is
 * cut into segments of this size, segment k travelling on socket k mod n,
 * whatever the sizes of the send and receive calls; so both ends must use
 * the same value (it is a constant of the wire). Chosen by measurement
 * (docs/performance.md). */
#define DDP_LINK_STRIPE_BYTES ((size_t)256 << 10)

/* Turn an idle TCP link (no transfer in progress in either direction, and
 * nothing in flight: both ends call this at the same point of their byte
 * streams) into one striped over its socket and the k more connected
 * sockets fds[0..k-1] to the same peer, in the peer's order; the stream
 * offsets restart at 0. Takes ownership of the fds (tuned like the first),
 * also on failure. DDP_ERR_INVALID for a link that is not TCP, a transfer
 * in progress, or more than DDP_LINK_MAX_STREAMS sockets in all. */
ddp_status ddp_link_tcp_add_streams(ddp_link *l, const int *fds, int k);

/* Sockets of a TCP link (1, or its stripe count); 0 for other links. */
int ddp_link_tcp_streams(const ddp_link *l);

#endif
