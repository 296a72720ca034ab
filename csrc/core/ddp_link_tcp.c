/* ddp_link_tcp.c - the TCP transport behind ddp_link: non-blocking
 * send(MSG_NOSIGNAL)/recv on one connected stream socket.
 *
 * Each progress call makes one system call; the generic drivers in
 * ddp_link.c retry while bytes move and poll() the socket when they stop.
 * Shutdown uses shutdown(SHUT_RDWR), which is safe from any thread: the
 * peer sees EOF at once, and this rank's own pending poll()/recv() wake up.
 * The descriptor itself is closed only in destroy, so it can never be
 * reused under a thread still polling it.
 */
#include "ddp_link.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* Socket buffers large enough for a pipeline chunk in flight each way. */
#define TCP_LINK_BUF_BYTES (4 << 20)

typedef struct tcp_link {
    int fd;
    atomic_int shut; /* set by tcp_shutdown: later failures are ours, not the peer's */
} tcp_link;

/* Map a failed send/recv to a status and message. */
static ddp_status tcp_fail(const tcp_link *t, const char *call, int err) {
    if (atomic_load(&t->shut))
        return ddp_error(DDP_ERR_ABORTED, "the link was shut down on this rank (the "
                         "communicator was aborted or broken by an earlier error)");
    if (err == EPIPE || err == ECONNRESET || err == ENOTCONN)
        return ddp_error(DDP_ERR_CLOSED, "the peer closed the connection (%s: %s); it probably "
                         "exited or failed, see its own error", call, strerror(err));
    return ddp_error(DDP_ERR_SYS, "%s failed: %s", call, strerror(err));
}

static ddp_status tcp_send_some(ddp_link *l, const void *buf, size_t n, size_t *done) {
    tcp_link *t = l->impl;
    for (;;) {
        ssize_t k = send(t->fd, (const char *)buf + *done, n - *done, MSG_NOSIGNAL);
        if (k >= 0) {
            *done += (size_t)k;
            return DDP_OK;
        }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return DDP_OK;
        return tcp_fail(t, "send", errno);
    }
}

static ddp_status tcp_recv_some(ddp_link *l, void *buf, size_t n, size_t *done) {
    tcp_link *t = l->impl;
    for (;;) {
        ssize_t k = recv(t->fd, (char *)buf + *done, n - *done, 0);
        if (k > 0) {
            *done += (size_t)k;
            return DDP_OK;
        }
        if (k == 0) {
            if (atomic_load(&t->shut)) return tcp_fail(t, "recv", 0);
            return ddp_error(DDP_ERR_CLOSED, "the peer closed the connection; it probably "
                             "exited or failed, see its own error");
        }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return DDP_OK;
        return tcp_fail(t, "recv", errno);
    }
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
};

/* Best-effort tuning: non-blocking, no Nagle delay for small messages, and
 * large buffers. Failures (e.g. TCP_NODELAY on a Unix socket in tests) are
 * harmless, so they are ignored. */
static void tcp_tune(int fd) {
    int one = 1, bytes = TCP_LINK_BUF_BYTES;
    int flags = fcntl(fd, F_GETFL);
    if (flags >= 0) (void)fcntl(fd, F_SETFL, flags | O_NONBLOCK);
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
    (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof bytes);
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
    l->ops = &tcp_ops;
    l->peer = peer;
    l->impl = t;
    snprintf(l->desc, sizeof l->desc, "%s", desc ? desc : "peer");
    return l;
}
