/* ddp_sock.c - TCP socket helpers with deadlines and abort flags.
 *
 * Implements ddp_sock.h. Every descriptor made here is non-blocking and
 * close-on-exec from birth (so a fork+exec in another thread cannot leak it),
 * connected TCP sockets get TCP_NODELAY (store requests and collective
 * headers are small and latency-bound) and kernel keepalive with intervals
 * derived from PYDDP_PEER_DEAD_S (ddp_sock_alive.c: a host that vanishes sends no FIN or RST;
 * without keepalive an idle wait on it lasts until the group timeout, and
 * keepalive is answered by the peer's kernel, so a peer that is merely
 * stopped or slow is never taken for dead), sends use MSG_NOSIGNAL (a peer that
 * vanished must give EPIPE, not kill the process with SIGPIPE), and every
 * wait is a poll() of at most ddp_wait_slice() ms so the abort flag is seen
 * promptly. Connect resolves names through ddp_resolve.c, whose lookups a
 * deadline can walk away from.
 */
#include "ddp_sock.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ddp_resolve.h"

/* The least time one address of a name gets while others remain to try
 * (unless less than that is left in all): enough for a loopback or LAN
 * connect, and the SYN retransmit at 1 s, to happen. */
#define DDP_CONNECT_ADDR_MIN_MS 2000

#ifndef MSG_NOSIGNAL
#define MSG_NOSIGNAL 0
#endif

/* ---- descriptor setup -------------------------------------------------- */

/* Make fd non-blocking and close-on-exec. Used where the platform lacks
 * SOCK_NONBLOCK/SOCK_CLOEXEC; harmless when they were already applied. */
static void set_flags(int fd) {
    int fl = fcntl(fd, F_GETFL, 0);
    if (fl >= 0) fcntl(fd, F_SETFL, fl | O_NONBLOCK);
    int fdfl = fcntl(fd, F_GETFD, 0);
    if (fdfl >= 0) fcntl(fd, F_SETFD, fdfl | FD_CLOEXEC);
}

int ddp_sock_open(int family, int type, int proto) {
#if defined(SOCK_NONBLOCK) && defined(SOCK_CLOEXEC)
    int fd = socket(family, type | SOCK_NONBLOCK | SOCK_CLOEXEC, proto);
#else
    int fd = socket(family, type, proto);
#endif
    if (fd >= 0) set_flags(fd);
    return fd;
}

static void set_nodelay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

void ddp_sock_set_bufsize(int fd, int bytes) {
    if (bytes <= 0) return;
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof bytes);
}

void ddp_sock_format_hostport(const char *host, int port, char *out, size_t outlen) {
    if (outlen == 0) return;
    if (host == NULL) host = "";
    if (strchr(host, ':') != NULL)
        snprintf(out, outlen, "[%s]:%d", host, port);
    else
        snprintf(out, outlen, "%s:%d", host, port);
}

/* Sleep up to one wait slice on fd for events; EINTR counts as a wake-up.
 * Returns nothing: the caller re-checks the socket, the deadline and the
 * abort flag after every slice. */
static void poll_slice(int fd, short events, ddp_wait w) {
    struct pollfd p = {.fd = fd, .events = events, .revents = 0};
    (void)poll(&p, 1, ddp_wait_slice(w));
}

/* ---- connect ----------------------------------------------------------- */

/* Wait for a non-blocking connect() on fd to finish, within w. Returns 0 on
 * success, else an errno (ETIMEDOUT when w expires, EINTR when aborted). */
static int finish_connect(int fd, ddp_wait w) {
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLOUT, .revents = 0};
        int r = poll(&p, 1, ddp_wait_slice(w));
        if (r > 0) {
            int err = 0;
            socklen_t len = sizeof err;
            if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0) return errno;
            return err;
        }
        if (r < 0 && errno != EINTR) return errno;
        if (ddp_wait_aborted(w)) return EINTR;
        if (ddp_wait_expired(w)) return ETIMEDOUT;
    }
}

/* 1 if fd is connected to itself. Connecting to an unused port in the
 * ephemeral range on loopback can "succeed" by TCP simultaneous open with
 * the socket's own address; treat it as refused. */
static int self_connected(int fd) {
    struct sockaddr_storage a, b;
    socklen_t la = sizeof a, lb = sizeof b;
    if (getsockname(fd, (struct sockaddr *)&a, &la) < 0) return 0;
    if (getpeername(fd, (struct sockaddr *)&b, &lb) < 0) return 0;
    return la == lb && memcmp(&a, &b, la) == 0;
}

/* The wait for address i of n: a share of what is left, so an address that
 * swallows SYNs (a firewall that drops, a dead host) cannot use up the time
 * of the ones after it: min(left, max(left / addresses left, a floor)).
 * Without a deadline the kernel's own connect timeout bounds each address. */
static ddp_wait addr_wait(ddp_wait w, int i, int n) {
    int64_t left = ddp_wait_remaining(w);
    if (left == INT64_MAX) return w;
    int64_t share = left / (n - i);
    if (share < DDP_CONNECT_ADDR_MIN_MS) share = DDP_CONNECT_ADDR_MIN_MS;
    if (share < left) w.deadline_ms = ddp_now_ms() + share;
    return w;
}

/* One pass over the addresses of a name. Returns a connected fd, or -1 with
 * *err set to the last errno (EINTR if w's flag aborted the pass). */
int ddp_sock_connect_addrs(const ddp_addrs *as, ddp_wait w, int *err) {
    for (int i = 0; i < as->n; i++) {
        const ddp_addr *a = &as->a[i];
        int s = ddp_sock_open(a->family, SOCK_STREAM, 0);
        if (s < 0) {
            *err = errno;
            continue;
        }
        int e = 0;
        if (connect(s, (const struct sockaddr *)&a->sa, a->len) < 0) {
            e = errno;
            if (e == EINPROGRESS || e == EINTR) e = finish_connect(s, addr_wait(w, i, as->n));
        }
        if (e == 0 && self_connected(s)) e = ECONNREFUSED;
        if (e == 0) {
            set_nodelay(s);
            ddp_sock_set_keepalive(s);
            return s;
        }
        *err = e;
        close(s);
        if (ddp_wait_aborted(w)) {
            *err = EINTR;
            return -1;
        }
    }
    return -1;
}

ddp_status ddp_sock_connect(const char *host, int port, ddp_wait w, int *fd_out) {
    char hp[DDP_ADDR_MAX + 16];
    *fd_out = -1;
    if (host == NULL || host[0] == '\0')
        return ddp_error(DDP_ERR_INVALID, "connect: empty host name (set MASTER_ADDR)");
    if (port <= 0 || port > 65535)
        return ddp_error(DDP_ERR_INVALID, "connect to %s: port %d is not in 1..65535 "
                         "(check MASTER_PORT)", host, port);
    ddp_sock_format_hostport(host, port, hp, sizeof hp);
    int64_t start = ddp_now_ms();
    int err = 0, gai_err = 0, answered = 0;
    for (;;) {
        ddp_addrs as;
        int g = 0, sys_err = 0;
        ddp_status st = ddp_resolve_tcp(host, port, w, &as, &g, &sys_err);
        if (st == DDP_ERR_TIMEOUT) {
            /* The deadline passed inside a lookup. If the resolver never
             * answered, DNS is the problem; if it did before, this lookup
             * merely got the last few ms: report the earlier failure. */
            if (!answered)
                return ddp_error_prefix(DDP_ERR_CONNECT, "could not connect to %s: ", hp);
            break;
        }
        if (st == DDP_ERR_ABORTED || st == DDP_ERR_INVALID || st == DDP_ERR_NOMEM)
            return ddp_error_prefix(st, "connect to %s: ", hp);
        answered = 1;
        gai_err = g;
        if (g == EAI_SYSTEM) err = sys_err;
        if (st == DDP_OK) {
            int fd = ddp_sock_connect_addrs(&as, w, &err);
            if (fd >= 0) {
                *fd_out = fd;
                return DDP_OK;
            }
        }
        if (ddp_wait_aborted(w))
            return ddp_error(DDP_ERR_ABORTED, "connect to %s aborted", hp);
        if (ddp_wait_expired(w)) break;
        /* Refused/unreachable/unresolvable: the master may not be up yet, or
         * its DNS name not yet published. Wait one slice and try again. */
        poll_slice(-1, 0, w);
    }
    double secs = (double)(ddp_now_ms() - start) / 1000.0;
    if (gai_err != 0)
        return ddp_error(DDP_ERR_CONNECT,
                         "could not resolve host name '%s' within %.1f s (%s). Check "
                         "MASTER_ADDR and that this host's DNS (or /etc/hosts) knows "
                         "the name", host, secs,
                         gai_err == EAI_SYSTEM ? strerror(err) : gai_strerror(gai_err));
    return ddp_error(DDP_ERR_CONNECT,
                     "could not connect to %s within %.1f s (last error: %s). Check "
                     "that the master is running, that MASTER_ADDR/MASTER_PORT are "
                     "right, and that a firewall or cloud security-group rule allows "
                     "TCP to that port from this host.",
                     hp, secs, err ? strerror(err) : "none");
}

/* ---- listen and accept ------------------------------------------------- */

/* Bind a listening socket to addr. Returns fd or -1 with errno set. */
static int listen_addr(int family, const struct sockaddr *addr, socklen_t len,
                       int dual_stack) {
    int fd = ddp_sock_open(family, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    int one = 1, zero = 0;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (dual_stack) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    if (bind(fd, addr, len) < 0 || listen(fd, SOMAXCONN) < 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

/* Listen on every interface at port: a dual-stack IPv6 socket if the host
 * has IPv6, else IPv4 0.0.0.0. Returns fd or -1 with errno set. */
static int listen_any(int port) {
    struct sockaddr_in6 a6;
    memset(&a6, 0, sizeof a6);
    a6.sin6_family = AF_INET6;
    a6.sin6_addr = in6addr_any;
    a6.sin6_port = htons((uint16_t)port);
    int fd = listen_addr(AF_INET6, (struct sockaddr *)&a6, sizeof a6, 1);
    if (fd >= 0 || errno == EADDRINUSE || errno == EACCES) return fd;
    struct sockaddr_in a4;
    memset(&a4, 0, sizeof a4);
    a4.sin_family = AF_INET;
    a4.sin_addr.s_addr = htonl(INADDR_ANY);
    a4.sin_port = htons((uint16_t)port);
    return listen_addr(AF_INET, (struct sockaddr *)&a4, sizeof a4, 0);
}

/* Listen on bind_host at port (first address that binds). Returns fd or -1
 * with errno set; *gai_err gets a resolver error if the name is unknown. */
static int listen_host(const char *bind_host, int port, int *gai_err) {
    struct addrinfo hints, *res = NULL;
    char portstr[16];
    snprintf(portstr, sizeof portstr, "%d", port);
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    *gai_err = getaddrinfo(bind_host, portstr, &hints, &res);
    if (*gai_err != 0) return -1;
    int fd = -1, e = EADDRNOTAVAIL;
    for (struct addrinfo *ai = res; ai != NULL && fd < 0; ai = ai->ai_next) {
        fd = listen_addr(ai->ai_family, ai->ai_addr, ai->ai_addrlen, 0);
        if (fd < 0) e = errno;
    }
    freeaddrinfo(res);
    if (fd < 0) errno = e;
    return fd;
}

/* The port a bound socket actually got (for port 0). */
static int bound_port(int fd) {
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    if (getsockname(fd, (struct sockaddr *)&ss, &len) < 0) return -1;
    if (ss.ss_family == AF_INET6) return ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
    return ntohs(((struct sockaddr_in *)&ss)->sin_port);
}

ddp_status ddp_sock_listen(const char *bind_host, int port, int lo, int hi,
                           int *fd_out, int *port_out) {
    int any = bind_host == NULL || bind_host[0] == '\0';
    const char *where = any ? "all interfaces" : bind_host;
    *fd_out = -1;
    if (port < 0 || port > 65535)
        return ddp_error(DDP_ERR_INVALID, "listen on %s: port %d is not in 0..65535",
                         where, port);
    int ranged = port == 0 && (lo != 0 || hi != 0);
    if (ranged && (lo <= 0 || hi > 65535 || lo > hi))
        return ddp_error(DDP_ERR_INVALID, "listen on %s: port range %d-%d is not a "
                         "valid range within 1..65535", where, lo, hi);
    int first = ranged ? lo : port, last = ranged ? hi : port;
    int err = 0, gai_err = 0;
    for (int p = first; p <= last; p++) {
        int fd = any ? listen_any(p) : listen_host(bind_host, p, &gai_err);
        if (fd >= 0) {
            *fd_out = fd;
            *port_out = bound_port(fd);
            return DDP_OK;
        }
        if (gai_err != 0)
            return ddp_error(DDP_ERR_INVALID, "listen: cannot resolve bind address "
                             "'%s' (%s)", bind_host, gai_strerror(gai_err));
        err = errno;
        if (err != EADDRINUSE) break;   /* only a busy port is worth skipping */
    }
    if (ranged && err == EADDRINUSE)
        return ddp_error(DDP_ERR_SYS, "listen on %s: every port in %d-%d is in use. "
                         "Widen the port range (or free a port in it)", where, lo, hi);
    char hp[DDP_ADDR_MAX + 16];
    ddp_sock_format_hostport(any ? "*" : bind_host, first, hp, sizeof hp);
    if (err == EADDRINUSE)
        return ddp_error(DDP_ERR_SYS, "could not listen on %s: %s. Another process "
                         "(a previous run, or torchrun's own store) holds the port; "
                         "choose another port (MASTER_PORT) or stop that process",
                         hp, strerror(err));
    return ddp_error(DDP_ERR_SYS, "could not listen on %s: %s%s", hp, strerror(err),
                     err == EADDRNOTAVAIL ? " (the address is not one of this host's)"
                                          : "");
}

ddp_status ddp_sock_accept(int lfd, ddp_wait w, int *fd_out) {
    *fd_out = -1;
    for (;;) {
#if defined(SOCK_NONBLOCK) && defined(SOCK_CLOEXEC) && defined(__linux__)
        int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
#else
        int fd = accept(lfd, NULL, NULL);
#endif
        if (fd >= 0) {
            set_flags(fd);
            set_nodelay(fd);
            ddp_sock_set_keepalive(fd);
            *fd_out = fd;
            return DDP_OK;
        }
        int e = errno;
        if (e != EAGAIN && e != EWOULDBLOCK && e != EINTR && e != ECONNABORTED &&
            e != EPROTO)
            return ddp_error(DDP_ERR_SYS, "accept: %s%s", strerror(e),
                             e == EMFILE || e == ENFILE
                                 ? " (raise the open-file limit, ulimit -n)" : "");
        if (ddp_wait_aborted(w)) return ddp_error(DDP_ERR_ABORTED, "accept aborted");
        if (ddp_wait_expired(w))
            return ddp_error(DDP_ERR_TIMEOUT, "accept: no connection arrived before "
                             "the deadline");
        poll_slice(lfd, POLLIN, w);
    }
}

/* ---- data transfer ----------------------------------------------------- */

/* The kernel dropped the connection (keepalive or retransmissions
 * unanswered): the peer-dead message, with errno left ETIMEDOUT for callers
 * that reword it with the peer's name (ddp_sock.h). */
static ddp_status peer_gave_up(void) {
    ddp_status st = ddp_sock_peer_dead_error("the peer");
    errno = ETIMEDOUT;
    return st;
}

ddp_status ddp_sock_send_some(int fd, const void *buf, size_t n, size_t *done) {
    const char *p = buf;
    while (*done < n) {
        ssize_t r = send(fd, p + *done, n - *done, MSG_NOSIGNAL);
        if (r > 0) {
            *done += (size_t)r;
            continue;
        }
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return DDP_OK;
        if (r < 0 && (errno == EPIPE || errno == ECONNRESET || errno == ENOTCONN))
            return ddp_error(DDP_ERR_CLOSED, "connection closed by the peer (%s)",
                             strerror(errno));
        if (r < 0 && errno == ETIMEDOUT) return peer_gave_up();
        return ddp_error(DDP_ERR_SYS, "send: %s", r < 0 ? strerror(errno) : "no progress");
    }
    return DDP_OK;
}

ddp_status ddp_sock_recv_some(int fd, void *buf, size_t n, size_t *done) {
    char *p = buf;
    while (*done < n) {
        ssize_t r = recv(fd, p + *done, n - *done, 0);
        if (r > 0) {
            *done += (size_t)r;
            continue;
        }
        if (r == 0) return ddp_error(DDP_ERR_CLOSED, "connection closed by the peer");
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return DDP_OK;
        if (errno == ECONNRESET || errno == ENOTCONN || errno == EPIPE)
            return ddp_error(DDP_ERR_CLOSED, "connection reset by the peer (%s)",
                             strerror(errno));
        if (errno == ETIMEDOUT) return peer_gave_up();
        return ddp_error(DDP_ERR_SYS, "recv: %s", strerror(errno));
    }
    return DDP_OK;
}

/* Shared loop of send_all/recv_all/recv_atleast: make progress (up to n
 * bytes), then wait one slice, until at least min bytes moved (*moved: how
 * many), the deadline passes or the flag aborts. */
static ddp_status xfer_min(int fd, void *buf, size_t min, size_t n, size_t *moved,
                           ddp_wait w, const char *what, int sending) {
    size_t done = 0, seen = 0;
    int64_t since = 0, checked = ddp_now_ms();
    const char *verb = sending ? "send" : "receive";
    if (what == NULL) what = "peer";
    for (;;) {
        errno = 0;
        ddp_status st = sending ? ddp_sock_send_some(fd, buf, n, &done)
                                : ddp_sock_recv_some(fd, buf, n, &done);
        if (done >= min) { /* an error after min is left to the next call to meet */
            *moved = done;
            return DDP_OK;
        }
        if (st != DDP_OK && errno == ETIMEDOUT) /* keepalive gave up: name the peer */
            st = ddp_sock_peer_dead_error(what);
        if (st != DDP_OK)
            return ddp_error_prefix(st, "%s %zu bytes %s %s (after %zu): ", verb, min,
                                    sending ? "to" : "from", what, done);
        if (done != seen) {
            seen = done;
            checked = ddp_now_ms();
        } else if (ddp_now_ms() - checked >= 1000) { /* idle a second: still answering? */
            checked = ddp_now_ms();
            if (ddp_sock_peer_silent(fd, &since))
                return ddp_error_prefix(ddp_sock_peer_dead_error(what), "%s %zu bytes %s %s "
                                        "(after %zu): ", verb, min, sending ? "to" : "from",
                                        what, done);
        }
        if (ddp_wait_aborted(w))
            return ddp_error(DDP_ERR_ABORTED, "%s %s %s aborted", verb,
                             sending ? "to" : "from", what);
        if (ddp_wait_expired(w))
            return ddp_error(DDP_ERR_TIMEOUT, "timed out trying to %s %zu bytes %s %s "
                             "(%zu done); the peer may be stuck, overloaded or gone",
                             verb, min, sending ? "to" : "from", what, done);
        poll_slice(fd, sending ? POLLOUT : POLLIN, w);
    }
}

ddp_status ddp_sock_send_all(int fd, const void *buf, size_t n, ddp_wait w,
                             const char *what) {
    size_t moved;
    return xfer_min(fd, (void *)buf, n, n, &moved, w, what, 1);
}

ddp_status ddp_sock_recv_all(int fd, void *buf, size_t n, ddp_wait w,
                             const char *what) {
    size_t moved;
    return xfer_min(fd, buf, n, n, &moved, w, what, 0);
}

ddp_status ddp_sock_recv_atleast(int fd, void *buf, size_t min, size_t cap, size_t *got,
                                 ddp_wait w, const char *what) {
    *got = 0;
    if (min > cap) return ddp_error(DDP_ERR_INTERNAL, "receiving at least %zu bytes into "
                                    "%zu", min, cap);
    return xfer_min(fd, buf, min, cap, got, w, what, 0);
}
