/* test_listen.c - the process's one data port (ddp_listen.c):
 *   - two registrations (two groups, or two ranks of one group as threads)
 *     share one port, and each connection reaches the one its hello names;
 *   - a hello naming a registration that left is answered DDP_HELLO_GONE at
 *     once while the port serves others, one naming a tag never registered
 *     after the wait for a group still agreeing on its round; a connection
 *     held until ready is served once ready;
 *   - the port closes with its last registration (a dial is refused), also
 *     while a forked child that inherited it is alive (the child closed its
 *     copy at fork), and a registration in the child gets a port of its own;
 *   - a registration wanting another port range gets another listener; the
 *     same (tag, rank) twice is refused;
 *   - the listener starts one acceptor and more as connections keep them busy:
 *     with three silent connections held open (each one acceptor's, up to the
 *     hello deadline) a peer's hello is still served at once.
 */
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ddp_comm.h"
#include "ddp_listen.h"
#include "ddp_sock.h"
#include "testutil.h"

typedef struct seen {
    int served;   /* connections handed to this registration */
    int rank;     /* the sender's rank in the last one */
} seen;

static void serve_fn(void *ctx, int fd, const ddp_hello *h, const char *addr) {
    (void)addr;
    seen *s = ctx;
    __atomic_add_fetch(&s->served, 1, __ATOMIC_SEQ_CST);
    __atomic_store_n(&s->rank, h->rank, __ATOMIC_SEQ_CST);
    ddp_hello_refuse(fd, DDP_HELLO_OK, ddp_wait_for(1000, NULL));   /* any reply will do */
    close(fd);
}

/* Dial port, send a hello for (tag, to) from `from`, return the verdict
 * (or -1 when the dial is refused or no reply comes). */
static int dial(int port, uint64_t tag, int from, int to) {
    int fd = -1;
    if (ddp_sock_connect_peer("127.0.0.1", port, ddp_wait_for(2000, NULL), "test", &fd) !=
        DDP_OK)
        return -1;
    ddp_hello h = {DDP_HELLO_MAGIC, DDP_WIRE_VERSION, tag, from, 4, 0, 0, to, 0};
    unsigned char raw[DDP_HELLO_BYTES], r[DDP_HELLO_REPLY_BYTES];
    ddp_hello_encode(&h, raw);
    int verdict = -1;
    if (ddp_sock_send_all(fd, raw, sizeof raw, ddp_wait_for(2000, NULL), "test") == DDP_OK &&
        ddp_sock_recv_all(fd, r, sizeof r, ddp_wait_for(15000, NULL), "test") == DDP_OK)
        verdict = (int)(r[4] | r[5] << 8 | r[6] << 16 | (uint32_t)r[7] << 24);
    close(fd);
    return verdict;
}

static void wait_served(seen *s, int n) {
    for (int i = 0; i < 500 && __atomic_load_n(&s->served, __ATOMIC_SEQ_CST) < n; i++)
        usleep(10000);
    T_ASSERT(__atomic_load_n(&s->served, __ATOMIC_SEQ_CST) == n);
}

static void test_shared_port(void) {
    seen a = {0, -1}, b = {0, -1};
    ddp_listen_reg *ra, *rb;
    int pa = 0, pb = 0;
    T_OK(ddp_listen_attach(0x1111, 0, "", 0, 0, serve_fn, &a, &pa, &ra));
    T_OK(ddp_listen_attach(0x1111, 1, "", 0, 0, serve_fn, &b, &pb, &rb));
    T_ASSERT(pa == pb && pa > 0);
    ddp_listen_reg *dup;
    int pd;
    T_STATUS(ddp_listen_attach(0x1111, 1, "", 0, 0, serve_fn, &b, &pd, &dup), DDP_ERR_INVALID);
    ddp_listen_ready(ra);
    ddp_listen_ready(rb);
    T_ASSERT(dial(pa, 0x1111, 3, 1) == DDP_HELLO_OK);
    wait_served(&b, 1);
    T_ASSERT(b.rank == 3 && a.served == 0);
    T_ASSERT(dial(pa, 0x1111, 2, 0) == DDP_HELLO_OK);
    wait_served(&a, 1);
    int64_t t0 = ddp_now_ms();
    T_ASSERT(dial(pa, 0x1111, 3, 1) == DDP_HELLO_OK);      /* (b is served again) */
    wait_served(&b, 2);
    /* no such group: it may still be agreeing on its round (its tag is not final
     * yet), so the connection is held, then refused */
    T_ASSERT(dial(pa, 0x2222, 2, 0) == DDP_HELLO_GONE);
    T_ASSERT(ddp_now_ms() - t0 >= DDP_LISTEN_READY_MS - 500);
    ddp_listen_detach(rb);
    t0 = ddp_now_ms();
    T_ASSERT(dial(pa, 0x1111, 3, 1) == DDP_HELLO_GONE);   /* left; the port serves rank 0 */
    T_ASSERT(ddp_now_ms() - t0 < 5000);                   /* at once */
    T_ASSERT(b.served == 2);
    ddp_listen_detach(ra);
    T_ASSERT(dial(pa, 0x1111, 2, 0) == -1);               /* last one gone: port closed */
    printf("listen: one port for two registrations, gone, closed: ok\n");
}

/* A connection that arrives before ddp_listen_ready is held, then served. */
static void test_held_until_ready(void) {
    seen a = {0, -1};
    ddp_listen_reg *ra;
    int port = 0;
    T_OK(ddp_listen_attach(0x3333, 2, "", 0, 0, serve_fn, &a, &port, &ra));
    pid_t pid = fork();
    T_ASSERT(pid >= 0);
    if (pid == 0) _exit(dial(port, 0x3333, 1, 2) == DDP_HELLO_OK ? 0 : 1);
    usleep(300000);
    T_ASSERT(a.served == 0);
    ddp_listen_ready(ra);
    int status = 0;
    T_ASSERT(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    wait_served(&a, 1);
    ddp_listen_detach(ra);
    printf("listen: a connection waits for its group to be ready: ok\n");
}

/* A forked child does not keep the port: closing the last registration in
 * the parent refuses dials while the child lives; the child gets its own. */
static void test_fork(void) {
    seen a = {0, -1};
    ddp_listen_reg *ra;
    int port = 0;
    T_OK(ddp_listen_attach(0x4444, 0, "", 0, 0, serve_fn, &a, &port, &ra));
    ddp_listen_ready(ra);
    int to_parent[2];
    T_ASSERT(pipe(to_parent) == 0);
    pid_t pid = fork();
    T_ASSERT(pid >= 0);
    if (pid == 0) {
        close(to_parent[0]);
        seen c = {0, -1};
        ddp_listen_reg *rc;
        int cport = 0;
        if (ddp_listen_attach(0x4444, 0, "", 0, 0, serve_fn, &c, &cport, &rc) != DDP_OK ||
            cport == port)
            _exit(2);
        ddp_listen_detach(ra);   /* the child's copy: detaching it touches nothing of the parent */
        if (write(to_parent[1], "r", 1) != 1) _exit(3);
        sleep(30);               /* alive while the parent dials */
        _exit(0);
    }
    close(to_parent[1]);
    char ch;
    T_ASSERT(read(to_parent[0], &ch, 1) == 1);
    T_ASSERT(dial(port, 0x4444, 1, 0) == DDP_HELLO_OK);   /* the parent still serves */
    wait_served(&a, 1);
    ddp_listen_detach(ra);
    T_ASSERT(dial(port, 0x4444, 1, 0) == -1);   /* refused although the child lives */
    kill(pid, SIGKILL);
    int status = 0;
    T_ASSERT(waitpid(pid, &status, 0) == pid && WIFSIGNALED(status));
    close(to_parent[0]);
    printf("listen: a forked child keeps no copy of the port: ok\n");
}

/* A registration whose port range excludes the open port gets its own. */
static void test_other_range(void) {
    seen a = {0, -1}, b = {0, -1};
    ddp_listen_reg *ra, *rb;
    int pa = 0, pb = 0;
    T_OK(ddp_listen_attach(0x5555, 0, "", 0, 0, serve_fn, &a, &pa, &ra));
    int lo = pa == 65535 ? 40000 : pa + 1;
    T_OK(ddp_listen_attach(0x5555, 1, "", lo, 65535, serve_fn, &b, &pb, &rb));
    T_ASSERT(pb != pa && pb >= lo);
    ddp_listen_ready(ra);
    ddp_listen_ready(rb);
    T_ASSERT(dial(pb, 0x5555, 2, 1) == DDP_HELLO_OK);
    T_ASSERT(dial(pb, 0x5555, 2, 0) == DDP_HELLO_GONE);   /* rank 0 is on the other port */
    wait_served(&b, 1);
    ddp_listen_detach(ra);
    ddp_listen_detach(rb);
    printf("listen: another port range, another listener: ok\n");
}

/* Three connections that never say hello hold three acceptors for the hello
 * deadline (5 s); a fourth acceptor, started when the third got busy, serves a
 * real peer meanwhile. */
static void test_busy_acceptors(void) {
    seen a = {0, -1};
    ddp_listen_reg *ra;
    int port = 0, silent[3];
    T_OK(ddp_listen_attach(0x6666, 0, "", 0, 0, serve_fn, &a, &port, &ra));
    ddp_listen_ready(ra);
    for (int i = 0; i < 3; i++) {
        T_OK(ddp_sock_connect_peer("127.0.0.1", port, ddp_wait_for(2000, NULL), "test",
                                   &silent[i]));
        usleep(50000);           /* taken by an acceptor, which starts the next one */
    }
    int64_t t0 = ddp_now_ms();
    T_ASSERT(dial(port, 0x6666, 1, 0) == DDP_HELLO_OK);
    T_ASSERT(ddp_now_ms() - t0 < 2000);   /* not after a silent one's 5 s */
    wait_served(&a, 1);
    for (int i = 0; i < 3; i++) close(silent[i]);
    ddp_listen_detach(ra);
    printf("listen: acceptors grow while silent connections hold them: ok\n");
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    test_shared_port();
    test_held_until_ready();
    test_fork();
    test_other_range();
    test_busy_acceptors();
    printf("test_listen: ok\n");
    return 0;
}
