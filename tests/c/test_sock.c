/* test_sock.c - unit tests of ddp_sock: listen/connect/accept over loopback
 * (IPv4, IPv6 where available, names), exact-size transfers larger than the
 * socket buffers, deadlines, abort flags, peer close, port ranges, and the
 * connect-timeout message that must name host:port and what to check; a
 * name whose first address swallows SYNs (a loopback listener with a full
 * accept queue, supplied by a resolver hook: no packet leaves the machine)
 * and a resolver that hangs, neither of which may use up the deadline. */
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <netinet/tcp.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ddp_resolve.h"
#include "ddp_settings.h"
#include "ddp_sock.h"
#include "testutil.h"

#define BIG (4u << 20)

typedef struct {
    int fd;
    unsigned char *buf;
    size_t n;
    ddp_status st;
} xfer_arg;

static void *sender(void *p) {
    xfer_arg *a = p;
    a->st = ddp_sock_send_all(a->fd, a->buf, a->n, ddp_wait_for(10000, NULL), "test peer");
    return NULL;
}

/* Connect a client to a fresh listener and accept it; returns both ends. */
static void make_pair(const char *bind_host, const char *conn_host, int *c, int *s) {
    int lfd, port;
    T_OK(ddp_sock_listen(bind_host, 0, 0, 0, &lfd, &port));
    T_ASSERT(port > 0);
    T_OK(ddp_sock_connect(conn_host, port, ddp_wait_for(5000, NULL), c));
    T_OK(ddp_sock_accept(lfd, ddp_wait_for(5000, NULL), s));
    close(lfd);
}

static void test_roundtrip(const char *bind_host, const char *conn_host) {
    int c, s;
    make_pair(bind_host, conn_host, &c, &s);
    /* Larger than any socket buffer, so send_all must wait for the reader. */
    unsigned char *src = malloc(BIG), *dst = malloc(BIG);
    T_ASSERT(src && dst);
    for (size_t i = 0; i < BIG; i++) src[i] = (unsigned char)(i * 131u + 7u);
    xfer_arg a = {c, src, BIG, DDP_ERR_INTERNAL};
    pthread_t th;
    T_ASSERT(pthread_create(&th, NULL, sender, &a) == 0);
    T_OK(ddp_sock_recv_all(s, dst, BIG, ddp_wait_for(10000, NULL), "test peer"));
    pthread_join(th, NULL);
    T_OK(a.st);
    T_ASSERT(memcmp(src, dst, BIG) == 0);
    free(src);
    free(dst);
    close(c);
    close(s);
}

static void test_deadline_abort_close(void) {
    int c, s;
    char b[8];
    make_pair("127.0.0.1", "127.0.0.1", &c, &s);
    int64_t t0 = ddp_now_ms();
    T_STATUS(ddp_sock_recv_all(s, b, sizeof b, ddp_wait_for(200, NULL), "quiet peer"),
             DDP_ERR_TIMEOUT);
    T_ASSERT(ddp_now_ms() - t0 >= 190);
    T_ASSERT(strstr(ddp_last_error(), "quiet peer") != NULL);

    atomic_int flag = 1;
    T_STATUS(ddp_sock_recv_all(s, b, sizeof b, ddp_wait_for(-1, &flag), NULL),
             DDP_ERR_ABORTED);

    size_t done = 0;
    T_OK(ddp_sock_recv_some(s, b, sizeof b, &done));   /* nothing yet: no progress */
    T_ASSERT(done == 0);
    T_OK(ddp_sock_send_all(c, "abc", 3, ddp_wait_for(1000, NULL), NULL));
    close(c);
    T_STATUS(ddp_sock_recv_all(s, b, sizeof b, ddp_wait_for(2000, NULL), "gone peer"),
             DDP_ERR_CLOSED);
    T_ASSERT(strstr(ddp_last_error(), "gone peer") != NULL);
    /* Sending to a closed peer: EPIPE/ECONNRESET, not SIGPIPE. */
    ddp_status st = DDP_OK;
    for (int i = 0; i < 50 && st == DDP_OK; i++)
        st = ddp_sock_send_all(s, b, sizeof b, ddp_wait_for(1000, NULL), "gone peer");
    T_STATUS(st, DDP_ERR_CLOSED);
    close(s);
}

static void test_accept_timeout(void) {
    int lfd, port, fd;
    T_OK(ddp_sock_listen("127.0.0.1", 0, 0, 0, &lfd, &port));
    T_STATUS(ddp_sock_accept(lfd, ddp_wait_for(150, NULL), &fd), DDP_ERR_TIMEOUT);
    T_ASSERT(fd == -1);
    close(lfd);
}

static void test_connect_refused_message(void) {
    int lfd, port, fd;
    /* Reserve a port, then free it: nobody listens there now. */
    T_OK(ddp_sock_listen("127.0.0.1", 0, 0, 0, &lfd, &port));
    close(lfd);
    int64_t t0 = ddp_now_ms();
    T_STATUS(ddp_sock_connect("127.0.0.1", port, ddp_wait_for(400, NULL), &fd),
             DDP_ERR_CONNECT);
    int64_t dt = ddp_now_ms() - t0;
    T_ASSERT(dt >= 390 && dt < 5000);   /* retried until, not past, the deadline */
    char want[64];
    snprintf(want, sizeof want, "127.0.0.1:%d", port);
    T_ASSERT(strstr(ddp_last_error(), want) != NULL);
    T_ASSERT(strstr(ddp_last_error(), "MASTER_ADDR") != NULL);
    T_ASSERT(strstr(ddp_last_error(), "firewall") != NULL);
    T_ASSERT(fd == -1);

    T_STATUS(ddp_sock_connect("", 1, ddp_wait_for(100, NULL), &fd), DDP_ERR_INVALID);
    T_STATUS(ddp_sock_connect("127.0.0.1", 70000, ddp_wait_for(100, NULL), &fd),
             DDP_ERR_INVALID);
    T_STATUS(ddp_sock_connect("no-such-host.invalid", 1, ddp_wait_for(200, NULL), &fd),
             DDP_ERR_CONNECT);
    T_ASSERT(strstr(ddp_last_error(), "no-such-host.invalid") != NULL);
}

static void test_port_range(void) {
    int a, b, c, pa, pb, pc, fd;
    T_OK(ddp_sock_listen("127.0.0.1", 0, 0, 0, &a, &pa));
    /* The range starts at a busy port: the next one in range is used. */
    if (pa < 65535) {
        ddp_status st = ddp_sock_listen("127.0.0.1", 0, pa, pa + 1, &b, &pb);
        if (st == DDP_OK) {
            T_ASSERT(pb == pa + 1);
            T_STATUS(ddp_sock_listen("127.0.0.1", 0, pa, pa + 1, &c, &pc), DDP_ERR_SYS);
            T_ASSERT(strstr(ddp_last_error(), "in use") != NULL);
            close(b);
        }
    }
    T_STATUS(ddp_sock_listen("127.0.0.1", pa, 0, 0, &fd, &pc), DDP_ERR_SYS);
    T_ASSERT(strstr(ddp_last_error(), "in use") != NULL);
    T_STATUS(ddp_sock_listen(NULL, 0, 10, 5, &fd, &pc), DDP_ERR_INVALID);
    close(a);
}

static void test_addresses(void) {
    char out[DDP_ADDR_MAX];
    T_OK(ddp_sock_route_addr("127.0.0.1", out, sizeof out));
    T_ASSERT(strcmp(out, "127.0.0.1") == 0);
    T_OK(ddp_sock_ifname_addr("lo", out, sizeof out));
    T_ASSERT(strcmp(out, "127.0.0.1") == 0);
    T_STATUS(ddp_sock_ifname_addr("nosuchif0", out, sizeof out), DDP_ERR_INVALID);
    T_ASSERT(strstr(ddp_last_error(), "nosuchif0") != NULL);
    ddp_sock_format_hostport("::1", 80, out, sizeof out);
    T_ASSERT(strcmp(out, "[::1]:80") == 0);
    ddp_sock_format_hostport("h", 80, out, sizeof out);
    T_ASSERT(strcmp(out, "h:80") == 0);
}

/* ---- resolver hooks ---------------------------------------------------- */

static int g_ports[2];          /* the addresses the two-address hook returns */
static atomic_int g_release;    /* lets the hanging hook return */
static atomic_int g_hook_calls;

static void loopback(ddp_addr *a, int port) {
    struct sockaddr_in *in = (struct sockaddr_in *)&a->sa;
    memset(a, 0, sizeof *a);
    in->sin_family = AF_INET;
    in->sin_port = htons((uint16_t)port);
    in->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a->family = AF_INET;
    a->len = sizeof *in;
}

static int two_addresses(const char *host, int port, ddp_addr *out, int max, int *gai_err) {
    (void)host, (void)port, (void)gai_err;
    T_ASSERT(max >= 2);
    loopback(&out[0], g_ports[0]);
    loopback(&out[1], g_ports[1]);
    atomic_fetch_add(&g_hook_calls, 1);
    return 2;
}

/* Like a DNS server that never answers, until the test lets it. */
static int hanging(const char *host, int port, ddp_addr *out, int max, int *gai_err) {
    (void)host, (void)port, (void)out, (void)max;
    atomic_fetch_add(&g_hook_calls, 1);
    while (!atomic_load(&g_release)) usleep(5000);
    *gai_err = EAI_NONAME;
    return -1;
}

/* A loopback listener that never accepts, its accept queue (backlog 0)
 * filled by *filler: the kernel drops every further SYN, so a connect to it
 * hangs as one to a host behind a dropping firewall would. */
static int blackhole(int *port, int *filler) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    ddp_addr a;
    loopback(&a, 0);
    T_ASSERT(fd >= 0 && bind(fd, (struct sockaddr *)&a.sa, a.len) == 0 && listen(fd, 0) == 0);
    socklen_t len = sizeof a.sa;
    T_ASSERT(getsockname(fd, (struct sockaddr *)&a.sa, &len) == 0);
    *port = ntohs(((struct sockaddr_in *)&a.sa)->sin_port);
    T_OK(ddp_sock_connect("127.0.0.1", *port, ddp_wait_for(2000, NULL), filler));
    /* Proof that it swallows SYNs now: a connect only times out. */
    int fd2;
    int64_t t0 = ddp_now_ms();
    T_STATUS(ddp_sock_connect("127.0.0.1", *port, ddp_wait_for(300, NULL), &fd2),
             DDP_ERR_CONNECT);
    T_ASSERT(ddp_now_ms() - t0 >= 290);
    return fd;
}

static void test_blackholed_first_address(void) {
    int filler, lfd, fd, acc;
    int bh = blackhole(&g_ports[0], &filler);
    T_OK(ddp_sock_listen("127.0.0.1", 0, 0, 0, &lfd, &g_ports[1]));
    ddp_resolve_set_hook(two_addresses);
    int64_t t0 = ddp_now_ms();
    /* 3 s: the first address gets max(3/2, 2) = 2 s, the second the rest
     * (giving the first the whole deadline would fail here). */
    T_OK(ddp_sock_connect("two-addresses.test", 1, ddp_wait_for(3000, NULL), &fd));
    int64_t dt = ddp_now_ms() - t0;
    T_ASSERT(dt >= 1900 && dt < 2900);
    T_ASSERT(atomic_load(&g_hook_calls) == 1);
    T_OK(ddp_sock_accept(lfd, ddp_wait_for(2000, NULL), &acc));
    T_OK(ddp_sock_send_all(fd, "x", 1, ddp_wait_for(2000, NULL), NULL));
    char c;
    T_OK(ddp_sock_recv_all(acc, &c, 1, ddp_wait_for(2000, NULL), NULL));
    T_ASSERT(c == 'x');
    /* Both black-holed: the retry loop goes on to the deadline, not past. */
    g_ports[1] = g_ports[0];
    t0 = ddp_now_ms();
    T_STATUS(ddp_sock_connect("two-addresses.test", 1, ddp_wait_for(1000, NULL), &fd),
             DDP_ERR_CONNECT);
    dt = ddp_now_ms() - t0;
    T_ASSERT(dt >= 990 && dt < 1500);
    T_ASSERT(strstr(ddp_last_error(), "two-addresses.test:1") != NULL);
    ddp_resolve_set_hook(NULL);
    close(acc);
    close(fd < 0 ? -1 : fd);
    close(lfd);
    close(filler);
    close(bh);
}

typedef struct {
    atomic_int *flag;
    int after_ms;
} raiser_arg;

static void *raise_later(void *p) {
    raiser_arg *a = p;
    usleep((useconds_t)a->after_ms * 1000);
    atomic_store(a->flag, 1);
    return NULL;
}

static void test_hanging_resolver(void) {
    int fd;
    atomic_store(&g_hook_calls, 0);
    ddp_resolve_set_hook(hanging);
    int64_t t0 = ddp_now_ms();
    T_STATUS(ddp_sock_connect("hangs.test", 80, ddp_wait_for(500, NULL), &fd),
             DDP_ERR_CONNECT);
    int64_t dt = ddp_now_ms() - t0;
    T_ASSERT(dt >= 490 && dt < 1500);
    T_ASSERT(strstr(ddp_last_error(), "resolving 'hangs.test' took longer than 0.5 s") != NULL);
    T_ASSERT(strstr(ddp_last_error(), "DNS") != NULL);
    T_ASSERT(strstr(ddp_last_error(), "hangs.test:80") != NULL);
    T_ASSERT(fd == -1);
    /* No deadline: the abort flag alone ends the wait. */
    atomic_int flag = 0;
    raiser_arg ra = {&flag, 200};
    pthread_t th;
    T_ASSERT(pthread_create(&th, NULL, raise_later, &ra) == 0);
    t0 = ddp_now_ms();
    T_STATUS(ddp_sock_connect("hangs.test", 80, ddp_wait_for(-1, &flag), &fd),
             DDP_ERR_ABORTED);
    T_ASSERT(ddp_now_ms() - t0 < 1000);
    pthread_join(th, NULL);
    T_ASSERT(atomic_load(&g_hook_calls) == 2);
    T_ASSERT(ddp_resolve_running() == 2);   /* both lookups still hang */
    ddp_resolve_set_hook(NULL);
    /* Meanwhile other connects are not held up by the stuck lookups. */
    int lfd, port, acc;
    T_OK(ddp_sock_listen("127.0.0.1", 0, 0, 0, &lfd, &port));
    T_OK(ddp_sock_connect("localhost", port, ddp_wait_for(2000, NULL), &fd));
    T_OK(ddp_sock_accept(lfd, ddp_wait_for(2000, NULL), &acc));
    close(fd);
    close(acc);
    close(lfd);
    /* The late answers free what the abandoned lookups left: the leak
     * checker at exit sees nothing once they are done. */
    atomic_store(&g_release, 1);
    for (int i = 0; i < 500 && ddp_resolve_running() > 0; i++) usleep(10000);
    T_ASSERT(ddp_resolve_running() == 0);
}

/* Both ends of a connection get keepalive sized from PYDDP_PEER_DEAD_S (the
 * probes must fit in it), a healthy idle pair is not silent, and the dead
 * peer message names the peer and what happened. */
static void test_keepalive_and_peer_dead(void) {
    setenv("PYDDP_PEER_DEAD_S", "12", 1);
    ddp_settings_reload();
    int c, s;
    make_pair("127.0.0.1", "127.0.0.1", &c, &s);
    int fds[2] = {c, s};
    for (int i = 0; i < 2; i++) {
        int on = 0, idle = 0, intvl = 0, cnt = 0;
        socklen_t l = sizeof on;
        T_ASSERT(getsockopt(fds[i], SOL_SOCKET, SO_KEEPALIVE, &on, &l) == 0 && on == 1);
        l = sizeof idle;
        T_ASSERT(getsockopt(fds[i], IPPROTO_TCP, TCP_KEEPIDLE, &idle, &l) == 0);
        T_ASSERT(getsockopt(fds[i], IPPROTO_TCP, TCP_KEEPINTVL, &intvl, &l) == 0);
        T_ASSERT(getsockopt(fds[i], IPPROTO_TCP, TCP_KEEPCNT, &cnt, &l) == 0);
        T_ASSERT(idle == 4 && idle + intvl * cnt <= 12 && idle + intvl * cnt >= 10);
    }
    int64_t since = 0;
    T_ASSERT(ddp_sock_peer_silent(c, &since) == 0 && since == 0);
    T_ASSERT(ddp_sock_peer_dead_error("rank 1 at 10.0.0.7") == DDP_ERR_CLOSED);
    T_ASSERT(strstr(ddp_last_error(), "no answer from rank 1 at 10.0.0.7 for 12 s: the host "
                    "or the network between us is down") != NULL);
    close(c);
    close(s);
    unsetenv("PYDDP_PEER_DEAD_S");
    ddp_settings_reload();
}

/* A live peer that reads nothing (rank 0 writing a checkpoint while the others
 * send to it) is not dead, however long its receive window stays closed: its
 * kernel answers the window probes. With TCP_USER_TIMEOUT at the dead time,
 * Linux would drop this connection after 2 s. */
static void test_closed_window_is_not_dead(void) {
    setenv("PYDDP_PEER_DEAD_S", "2", 1);
    ddp_settings_reload();
    int c, s;
    make_pair("127.0.0.1", "127.0.0.1", &c, &s);
    static char chunk[1 << 16];
    size_t total = 0;
    int64_t since = 0, t0 = ddp_now_ms();
    while (ddp_now_ms() - t0 < 3500) {
        size_t done = 0;
        T_OK(ddp_sock_send_some(c, chunk, sizeof chunk, &done));
        total += done;
        T_ASSERT(ddp_sock_peer_silent(c, &since) == 0);
        usleep(100 * 1000);
    }
    T_ASSERT(total > 0);
    close(c);
    close(s);
    unsetenv("PYDDP_PEER_DEAD_S");
    ddp_settings_reload();
}

int main(void) {
    test_keepalive_and_peer_dead();
    test_closed_window_is_not_dead();
    test_roundtrip("127.0.0.1", "127.0.0.1");
    test_roundtrip(NULL, "127.0.0.1");     /* all interfaces, reached over IPv4 */
    test_roundtrip(NULL, "localhost");
    int fd, port;
    if (ddp_sock_listen("::1", 0, 0, 0, &fd, &port) == DDP_OK) {   /* host has IPv6 */
        close(fd);
        test_roundtrip("::1", "::1");
        test_roundtrip(NULL, "::1");
    }
    test_deadline_abort_close();
    test_accept_timeout();
    test_connect_refused_message();
    test_port_range();
    test_addresses();
    test_blackholed_first_address();
    test_hanging_resolver();
    printf("test_sock: ok\n");
    return 0;
}
