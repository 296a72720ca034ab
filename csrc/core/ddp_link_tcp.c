/* ddp_link_tcp.c - the TCP transport behind ddp_link: non-blocking
 * send(MSG_NOSIGNAL)/recv (ddp_sock_send_some/recv_some) on one connected
 * stream socket.
 *
 * Each progress call moves what the kernel takes now; the generic drivers in
 * ddp_link.c retry while bytes move and poll() the socket when they stop.
 * Shutdown uses shutdown(SHUT_RDWR), which is safe from any thread: the
 * peer sees EOF at once, and this rank's own pending poll()/recv() wake up.
 * The descriptor itself is closed only in destroy, so it can never be
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

typedef struct tcp_link {
    int fd;
    atomic_int shut; /* set by tcp_shutdown: later failures are ours, not the peer's */
    _Atomic int64_t silent_since; /* ddp_sock_peer_silent's first look, 0: none */
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

static ddp_status tcp_send_some(ddp_link *l, const void *buf, size_t n, size_t *done) {
    tcp_link *t = l->impl;
    errno = 0;
    return tcp_checked(t, ddp_sock_send_some(t->fd, buf, n, done));
}

static ddp_status tcp_recv_some(ddp_link *l, void *buf, size_t n, size_t *done) {
    tcp_link *t = l->impl;
    errno = 0;
    return tcp_checked(t, ddp_sock_recv_some(t->fd, buf, n, done));
}

/* The check op: data out and nothing acknowledged for PYDDP_PEER_DEAD_S. */
static ddp_status tcp_check(ddp_link *l) {
    tcp_link *t = l->impl;
    int64_t since = atomic_load(&t->silent_since);
    int dead = ddp_sock_peer_silent(t->fd, &since);
    atomic_store(&t->silent_since, since);
    if (!dead || atomic_load(&t->shut)) return DDP_OK;
    return ddp_sock_peer_dead_error(t->peer);
}

static int tcp_wait_fd(ddp_link *l) { return ((tcp_link *)l->impl)->fd; }

static void tcp_shutdown(ddp_link *l) {
    tcp_link *t = l->impl;
    atomic_store(&t->shut, 1);
    shutdown(t->fd, SHUT_RDWR);
}

static void tcp_destroy(ddp_link *l) {
    tcp_link *t = l->impl;
    if (!t) return;
    close(t->fd);
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
    t->fd = fd;
    atomic_init(&t->shut, 0);
    atomic_init(&t->silent_since, 0);
    peer_words(desc ? desc : "peer", t->peer, sizeof t->peer);
    l->ops = &tcp_ops;
    l->peer = peer;
    l->impl = t;
    snprintf(l->desc, sizeof l->desc, "%s", desc ? desc : "peer");
    return l;
}
