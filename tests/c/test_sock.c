/* test_sock.c - unit tests of ddp_sock: listen/connect/accept over loopback
 * (IPv4, IPv6 where available, names), exact-size transfers larger than the
 * socket buffers, deadlines, abort flags, peer close, port ranges, and the
 * connect-timeout message that must name host:port and what to check. */
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

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

int main(void) {
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
    printf("test_sock: ok\n");
    return 0;
}
