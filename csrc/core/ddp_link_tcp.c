/* ddp_link_tcp.c - the TCP transport behind ddp_link: non-blocking
 * send(MSG_NOSIGNAL)/recv (ddp_sock_send_some/recv_some) on one connected
 * stream socket, or striped over several connected to the same peer
 * (PYDDP_NSOCKS_PERPEER; ddp_link_tcp_add_streams): the link's byte stream is
 * cut into fixed segments dealt round-robin to the sockets by stream offset,
 * so both ends agree where every byte goes whatever their call sizes, and
 * each call moves every socket that can move (one full socket never stalls
 * the others); poll_fds lists the sockets that still have work.
 *
 * Each progress call moves what the kernel takes now; the generic drivers in
 * ddp_link.c retry while bytes move and poll() the socket when they stop.
 * Shutdown uses shutdown(SHUT_RDWR), which is safe from any thread: the
 * peer sees EOF at once, and this rank's own pending poll()/recv() wake up.
 * Shutdown, the peer-dead check and destroy cover every socket.
 * The descriptors themselves are closed only in destroy, so none can ever be
 * reused under a thread still polling it.
 *
 * A peer whose host vanished is reported as such ("no answer from rank 1 at
 * 10.0.0.7 for 15 s: the host or the network between us is down"), both
 * when the kernel's keepalive gives the connection up (ETIMEDOUT from
 * ddp_sock) and when data this rank sent stays unacknowledged (the check op,
 * ddp_sock_peer_silent).
 */
#include "ddp_link.h"
#include "ddp_settings.h"
#include "ddp_sock.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* Socket buffer size: PYDDP_SOCKET_BUFFER_BYTES, or 0 (the default) to leave
 * the kernel's autotuning on. Setting SO_SNDBUF/SO_RCVBUF turns autotuning off
 * for that socket; measured on loopback, fixed 4 MiB buffers were slower than
 * autotuned ones at 64 MiB (in-flight data falls out of cache), and on real
 * networks autotuning grows buffers to tcp_rmem/tcp_wmem's maximum anyway. */
static int tcp_buffer_bytes(void) {
    return (int)ddp_setting_int("PYDDP_SOCKET_BUFFER_BYTES"); /* bounded to 1 GiB */
}

/* One direction of a striped link. Segment k of the direction's byte stream
 * (bytes [k*S, (k+1)*S), S = DDP_LINK_STRIPE_BYTES) travels on socket k mod
 * n, so socket i carries segments i, i+n, i+2n, ... back to back, and
 * moved[i] bytes of its share say exactly where in the stream its next byte
 * is. A call (one buffer, moved by repeated send_some/recv_some until done)
 * covers stream bytes [at, at+len); every socket moves its part of it as
 * far as its kernel lets it (bytes beyond the contiguous prefix included),
 * but never beyond the call, so when the call completes the stream is
 * exactly at its end. */
typedef struct tcp_dir {
    uint64_t moved[DDP_LINK_MAX_STREAMS];
    uint64_t at;     /* stream offset of the open call's first byte (or of the next call) */
    const void *buf; /* the open call; NULL: none */
    size_t len;
    size_t skip;     /* bytes of buf done before the call opened (held bytes, ddp_link.h) */
    uint64_t got;    /* bytes the open call moved on any socket so far */
} tcp_dir;

typedef struct tcp_link {
    atomic_int n;    /* sockets (1: not striped); fd[0..n) are valid */
    int fd[DDP_LINK_MAX_STREAMS];
    atomic_int shut; /* set by tcp_shutdown: later failures are ours, not the peer's */
    /* ddp_sock_peer_silent's first look per socket, 0: none */
    _Atomic int64_t silent_since[DDP_LINK_MAX_STREAMS];
    tcp_dir dir[2];  /* [0] receiving, [1] sending (striped links only) */
    char peer[DDP_ADDR_MAX + 32]; /* "rank 1 at 10.0.0.7", for the peer-dead message */
} tcp_link;

/* "rank 1 (10.0.0.7:41233)" -> "rank 1 at 10.0.0.7" (the host without the
 * data port, which says nothing about a host that is gone); any other
 * description is kept as it is. */
static void peer_words(const char *desc, char *out, size_t len) {
    const char *open = strstr(desc, " (");
    const char *colon = open ? strrchr(open, ':') : NULL;
    if (!open || !colon || colon < open + 2) {
        snprintf(out, len, "%s", desc);
        return;
    }
    snprintf(out, len, "%.*s at %.*s", (int)(open - desc), desc, (int)(colon - open - 2),
             open + 2);
}

/* The socket calls are ddp_sock's; a failure after this rank shut the link
 * down is reported as this rank's abort, not as the peer's doing, and a
 * connection the kernel gave up (errno ETIMEDOUT, ddp_sock.h) names the
 * peer's host. */
static ddp_status tcp_checked(const tcp_link *t, ddp_status st) {
    int timed_out = st != DDP_OK && errno == ETIMEDOUT;
    if (st != DDP_OK && atomic_load(&t->shut))
        return ddp_error(DDP_ERR_ABORTED, "the link was shut down on this rank (the "
                         "communicator was aborted or broken by an earlier error)");
    if (timed_out) return ddp_sock_peer_dead_error(t->peer);
    return st;
}

/* ---- striping ------------------------------------------------------------ */

#define SEG ((uint64_t)DDP_LINK_STRIPE_BYTES)

/* Stream offset of socket i's next byte after it moved `moved` of its share. */
static uint64_t sock_pos(int n, int i, uint64_t moved) {
    return (moved / SEG * (uint64_t)n + (uint64_t)i) * SEG + moved % SEG;
}

/* Open the call (buf, len) in direction d, of which the first `done` bytes
 * came from elsewhere (bytes the link held back), or check that it is the
 * open one. An open call that moved nothing yet may be given up for another
 * (a receive from any source drops the links that did not answer first). */
static ddp_status stripe_call(tcp_dir *d, const void *buf, size_t len, size_t done) {
    if (d->buf == NULL || d->got == 0) {   /* (re)open: nothing of the open one moved */
        d->buf = buf;
        d->len = len;
        d->skip = done;
        d->got = 0;
        return DDP_OK;
    }
    if (d->buf != buf || d->len != len)
        return ddp_error(DDP_ERR_INTERNAL, "a transfer on a striped link was left unfinished "
                         "(%zu bytes) and another one begun: the stream would be misaligned",
                         d->len);
    return DDP_OK;
}

/* Move what every socket of t can move now of the call (buf, len) in
 * direction `send`; *done = the contiguous prefix of the call moved. On a
 * socket's failure the message names the stream. */
static ddp_status stripe_move(tcp_link *t, int send, void *buf, size_t len, size_t *done) {
    tcp_dir *d = &t->dir[send];
    ddp_status st = stripe_call(d, buf, len, *done);
    if (st != DDP_OK) return st;
    const int n = atomic_load_explicit(&t->n, memory_order_relaxed);
    /* stream bytes [base, end) are buf[skip, len) */
    const uint64_t base = d->at, end = base + (len - d->skip);
    char *from = (char *)buf + d->skip;
    uint64_t low = end;
    for (int i = 0; i < n && st == DDP_OK; i++) {
        for (;;) {
            uint64_t pos = sock_pos(n, i, d->moved[i]);
            if (pos >= end) break;
            uint64_t seg_end = pos - pos % SEG + SEG;
            size_t want = (size_t)((seg_end < end ? seg_end : end) - pos), k = 0;
            char *p = from + (pos - base);
            errno = 0;
            st = send ? ddp_sock_send_some(t->fd[i], p, want, &k)
                      : ddp_sock_recv_some(t->fd[i], p, want, &k);
            d->moved[i] += k;
            d->got += k;
            if (st != DDP_OK) {
                st = ddp_error_prefix(tcp_checked(t, st), "stream %d of %d: ", i + 1, n);
                break;
            }
            if (k < want) break; /* the kernel takes (or has) no more now */
        }
    }
    for (int i = 0; i < n; i++) {
        uint64_t pos = sock_pos(n, i, d->moved[i]);
        if (pos < low) low = pos;
    }
    *done = d->skip + (size_t)(low - base);
    if (*done == len) { /* complete: the stream is at the call's end on every socket */
        d->buf = NULL;
        d->at = end;
    }
    return st;
}

/* The descriptors of the sockets that still have bytes of direction
 * `send`'s open call to move (poll_fds). */
static int stripe_fds(const tcp_link *t, int send, struct pollfd *fds, int max) {
    const tcp_dir *d = &t->dir[send];
    const int n = atomic_load_explicit(&t->n, memory_order_relaxed);
    int k = 0;
    for (int i = 0; i < n && d->buf; i++) {
        if (sock_pos(n, i, d->moved[i]) >= d->at + (d->len - d->skip)) continue;
        if (k < max) fds[k] = (struct pollfd){t->fd[i], send ? POLLOUT : POLLIN, 0};
        k++;
    }
    return k;
}

/* ---- the ops --------------------------------------------------------------- */

static int striped(const tcp_link *t) {
    return atomic_load_explicit(&t->n, memory_order_relaxed) > 1;
}

static ddp_status tcp_send_some(ddp_link *l, const void *buf, size_t n, size_t *done) {
    tcp_link *t = l->impl;
    if (striped(t)) return *done < n ? stripe_move(t, 1, (void *)buf, n, done) : DDP_OK;
    errno = 0;
    return tcp_checked(t, ddp_sock_send_some(t->fd[0], buf, n, done));
}

static ddp_status tcp_recv_some(ddp_link *l, void *buf, size_t n, size_t *done) {
    tcp_link *t = l->impl;
    if (striped(t)) return *done < n ? stripe_move(t, 0, buf, n, done) : DDP_OK;
    errno = 0;
    return tcp_checked(t, ddp_sock_recv_some(t->fd[0], buf, n, done));
}

/* The check op: data out and nothing acknowledged for PYDDP_PEER_DEAD_S, on
 * any of the link's sockets. */
static ddp_status tcp_check(ddp_link *l) {
    tcp_link *t = l->impl;
    const int n = atomic_load(&t->n);
    for (int i = 0; i < n; i++) {
        int64_t since = atomic_load(&t->silent_since[i]);
        int dead = ddp_sock_peer_silent(t->fd[i], &since);
        atomic_store(&t->silent_since[i], since);
        if (dead && !atomic_load(&t->shut)) return ddp_sock_peer_dead_error(t->peer);
    }
    return DDP_OK;
}

static int tcp_wait_fd(ddp_link *l) { return ((tcp_link *)l->impl)->fd[0]; }

static int tcp_poll_fds(ddp_link *l, int send, struct pollfd *fds, int max) {
    tcp_link *t = l->impl;
    if (striped(t)) return stripe_fds(t, send, fds, max);
    if (max > 0) fds[0] = (struct pollfd){t->fd[0], send ? POLLOUT : POLLIN, 0};
    return 1;
}

/* Every socket: the peer sees EOF on each at once. */
static void tcp_shutdown(ddp_link *l) {
    tcp_link *t = l->impl;
    atomic_store(&t->shut, 1);
    const int n = atomic_load(&t->n);
    for (int i = 0; i < n; i++) shutdown(t->fd[i], SHUT_RDWR);
}

static void tcp_destroy(ddp_link *l) {
    tcp_link *t = l->impl;
    if (!t) return;
    const int n = atomic_load(&t->n);
    for (int i = 0; i < n; i++) close(t->fd[i]);
    free(t);
    l->impl = NULL;
}

static const ddp_link_ops tcp_ops = {
    .name = "tcp",
    .send_some = tcp_send_some,
    .recv_some = tcp_recv_some,
    .wait_fd = tcp_wait_fd,
    .shutdown = tcp_shutdown,
    .destroy = tcp_destroy,
    .check = tcp_check,
    .poll_fds = tcp_poll_fds,
};

/* Best-effort tuning: non-blocking, no Nagle delay for small messages, and
 * the buffer size above. Failures (e.g. TCP_NODELAY on a Unix socket in tests) are
 * harmless, so they are ignored. */
static void tcp_tune(int fd) {
    int one = 1;
    int flags = fcntl(fd, F_GETFL);
    if (flags >= 0) (void)fcntl(fd, F_SETFL, flags | O_NONBLOCK); /* a blocking fd would hang */
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int buf = tcp_buffer_bytes();
    if (buf > 0) ddp_sock_set_bufsize(fd, buf);
}

ddp_link *ddp_link_tcp_new(int fd, int peer, const char *desc) {
    ddp_link *l = calloc(1, sizeof *l);
    tcp_link *t = calloc(1, sizeof *t);
    if (!l || !t) {
        free(l);
        free(t);
        close(fd); /* ownership was transferred even on failure */
        return NULL;
    }
    tcp_tune(fd);
    t->fd[0] = fd;
    atomic_init(&t->n, 1);
    atomic_init(&t->shut, 0);
    for (int i = 0; i < DDP_LINK_MAX_STREAMS; i++) atomic_init(&t->silent_since[i], 0);
    peer_words(desc ? desc : "peer", t->peer, sizeof t->peer);
    l->ops = &tcp_ops;
    l->peer = peer;
    l->impl = t;
    snprintf(l->desc, sizeof l->desc, "%s", desc ? desc : "peer");
    return l;
}

ddp_status ddp_link_tcp_add_streams(ddp_link *l, const int *fds, int k) {
    tcp_link *t = l && l->ops == &tcp_ops ? l->impl : NULL;
    const int n = t ? atomic_load(&t->n) : 0;
    const char *why = t == NULL ? "it is not a TCP link"
                      : k < 0 || n + k > DDP_LINK_MAX_STREAMS ? "too many sockets"
                      : t->dir[0].buf || t->dir[1].buf ? "a transfer is in progress" : NULL;
    if (why) {
        for (int i = 0; i < k; i++) close(fds[i]);
        return ddp_error(DDP_ERR_INVALID, "cannot stripe the link to %s over %d more "
                         "socket(s): %s", l ? l->desc : "?", k, why);
    }
    for (int i = 0; i < k; i++) {
        tcp_tune(fds[i]);
        t->fd[n + i] = fds[i];
    }
    memset(t->dir, 0, sizeof t->dir);
    atomic_store(&t->n, n + k); /* after the fds: tcp_shutdown on another thread reads them */
    return DDP_OK;
}

int ddp_link_tcp_streams(const ddp_link *l) {
    return l && l->ops == &tcp_ops ? atomic_load(&((tcp_link *)l->impl)->n) : 0;
}
