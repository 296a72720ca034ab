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
} ddp_link_ops;

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
