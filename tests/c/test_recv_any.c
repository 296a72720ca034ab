/* test_recv_any.c - receives from any source (RECV with DDP_ANY_SOURCE,
 * ddp_coll_anysrc.c) and what they stand on: bytes handed back to a link
 * (ddp_link_unread) come first, also on striped TCP links where a call may
 * start with bytes already done; ddp_link_xfer_any returns on the first
 * transfer done and drops failed links. Then, at 2 to 4 ranks on plain and
 * 3-way striped links, on the latency and the bandwidth path: every rank in
 * turn receives from any source while the others send to it, and the data
 * and reported sources are checked against the senders; a peer whose next
 * call is a collective is passed over (its header read and handed back, the
 * collective then runs); a peer that left is dropped; a receive no peer can
 * satisfy is a mismatch naming the peers' calls; the deadline and the abort
 * flag end the search; validation. */
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#include "coll_harness.h"

static void ms_sleep(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* ---- the link layer ---------------------------------------------------- */

static ddp_link *pair_link(int fd, int peer) {
    T_ASSERT(fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) == 0);
    ddp_link *l = ddp_link_tcp_new(fd, peer, "rank (socketpair)");
    T_ASSERT(l);
    return l;
}

static void test_unread(void) {
    int sv[2];
    T_ASSERT(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    ddp_link *a = pair_link(sv[0], 1), *b = pair_link(sv[1], 0);
    ddp_wait w = ddp_wait_for(5000, NULL);
    T_OK(ddp_link_send(a, "world", 5, w));
    T_OK(ddp_link_unread(b, "lo ", 3));
    T_OK(ddp_link_unread(b, "hel", 3)); /* in front of what it held */
    char got[12] = {0};
    T_OK(ddp_link_recv(b, got, 11, w));
    T_ASSERT(memcmp(got, "hello world", 11) == 0);
    T_ASSERT(b->held_len == 0);
    unsigned char big[DDP_LINK_HELD_MAX + 1] = {0};
    T_STATUS(ddp_link_unread(b, big, sizeof big), DDP_ERR_INTERNAL);
    T_OK(ddp_link_unread(b, big, DDP_LINK_HELD_MAX));
    T_STATUS(ddp_link_unread(b, big, 1), DDP_ERR_INTERNAL);
    ddp_link_free(a);
    ddp_link_free(b);
    printf("unread: ok\n");
}

static void test_xfer_any(void) {
    int s1[2], s2[2];
    T_ASSERT(socketpair(AF_UNIX, SOCK_STREAM, 0, s1) == 0);
    T_ASSERT(socketpair(AF_UNIX, SOCK_STREAM, 0, s2) == 0);
    ddp_link *p1 = pair_link(s1[0], 0), *me1 = pair_link(s1[1], 1);
    ddp_link *p2 = pair_link(s2[0], 0), *me2 = pair_link(s2[1], 2);
    ddp_wait w = ddp_wait_for(5000, NULL);
    char b1[4], b2[4];
    ddp_xfer x[2] = {{.link = me1, .dst = b1, .len = 4, .want = 4},
                     {.link = me2, .dst = b2, .len = 4, .want = 4}};
    T_OK(ddp_link_send(p2, "two!", 4, w));
    T_OK(ddp_link_send(p1, "o", 1, w)); /* one byte of the other: partial */
    int which = -1;
    T_OK(ddp_link_xfer_any(x, 2, w, &which));
    T_ASSERT(which == 1 && memcmp(b2, "two!", 4) == 0);
    /* the first link fails: dropped, the other still answers */
    x[1].done = 0;
    ddp_link_shutdown(p1);
    T_OK(ddp_link_send(p2, "more", 4, w));
    T_OK(ddp_link_xfer_any(x, 2, w, &which));
    T_ASSERT(which == 1 && memcmp(b2, "more", 4) == 0 && x[0].parked);
    /* both failed: the failure */
    x[0].parked = 0;
    x[1].done = 0;
    ddp_link_shutdown(p2);
    T_STATUS(ddp_link_xfer_any(x, 2, w, &which), DDP_ERR_CLOSED);
    /* the deadline */
    int s3[2];
    T_ASSERT(socketpair(AF_UNIX, SOCK_STREAM, 0, s3) == 0);
    ddp_link *p3 = pair_link(s3[0], 0), *me3 = pair_link(s3[1], 3);
    ddp_xfer y = {.link = me3, .dst = b1, .len = 4, .want = 4};
    T_STATUS(ddp_link_xfer_any(&y, 1, ddp_wait_for(150, NULL), &which), DDP_ERR_TIMEOUT);
    ddp_link *all[] = {p1, me1, p2, me2, p3, me3};
    for (int i = 0; i < 6; i++) ddp_link_free(all[i]);
    printf("xfer_any: ok\n");
}

typedef struct sender_arg {
    ddp_link *l;
    const void *buf;
    size_t n;
    ddp_status st;
} sender_arg;

static void *send_all(void *p) {
    sender_arg *s = p;
    s->st = ddp_link_send(s->l, s->buf, s->n, ddp_wait_for(10000, NULL));
    return NULL;
}

/* A striped link: a call may start with bytes already done (held), and an
 * open call that moved nothing may be given up for another. */
static void test_striped_held(void) {
    int a_fd[3], b_fd[3];
    for (int i = 0; i < 3; i++) {
        int sv[2];
        T_ASSERT(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
        a_fd[i] = sv[0];
        b_fd[i] = sv[1];
    }
    ddp_link *a = ddp_link_tcp_new(a_fd[0], 1, "a"), *b = ddp_link_tcp_new(b_fd[0], 0, "b");
    T_ASSERT(a && b);
    T_OK(ddp_link_tcp_add_streams(a, a_fd + 1, 2));
    T_OK(ddp_link_tcp_add_streams(b, b_fd + 1, 2));
    const size_t n = 3 * DDP_LINK_STRIPE_BYTES + 777;
    unsigned char *src = malloc(n), *dst = malloc(n);
    T_ASSERT(src && dst);
    for (size_t i = 0; i < n; i++) src[i] = (unsigned char)(i * 7 + (i >> 11));
    ddp_wait w = ddp_wait_for(10000, NULL);
    /* an open receive that moves nothing, given up */
    size_t done = 0;
    T_OK(b->ops->recv_some(b, dst, 40, &done));
    T_ASSERT(done == 0);
    /* the sender's message is bigger than the socket buffers: from a thread */
    sender_arg sa = {a, src, n, DDP_OK};
    pthread_t th;
    T_ASSERT(pthread_create(&th, NULL, send_all, &sa) == 0);
    T_OK(ddp_link_recv(b, dst, 40, w));   /* the first 40 bytes, then handed back */
    T_OK(ddp_link_unread(b, dst, 40));
    memset(dst, 0, n);
    T_OK(ddp_link_recv(b, dst, n, w));
    T_ASSERT(pthread_join(th, NULL) == 0);
    T_OK(sa.st);
    T_ASSERT(memcmp(src, dst, n) == 0);
    free(src);
    free(dst);
    ddp_link_free(a);
    ddp_link_free(b);
    printf("striped link with held bytes: ok\n");
}

/* ---- receives from any source ---------------------------------------- */

typedef struct turn {
    size_t count;           /* elements (int32) per message */
    int src_seen[H_MAXR][H_MAXR]; /* [receiver][sender]: messages taken */
} turn;

static int32_t value(int sender, int k, size_t i) {
    return (int32_t)(sender * 1000003 + k * 7919 + (int32_t)i);
}

/* Every rank in turn receives 2*(n-1) messages from any source while each
 * other rank sends it two; then an all-reduce checks the streams agree. */
static void turns_rank(hworld *w, int r, void *arg) {
    turn *t = arg;
    const int n = w->n;
    int32_t *buf = malloc(t->count * sizeof(int32_t) + 4);
    T_ASSERT(buf);
    for (int dst = 0; dst < n; dst++) {
        if (dst == r) {
            int per[H_MAXR] = {0};
            for (int k = 0; k < 2 * (n - 1); k++) {
                int src = -5;
                ddp_coll_args a = {.kind = DDP_COLL_RECV, .dtype = DDP_INT32,
                                   .root = DDP_ANY_SOURCE, .count = t->count, .buf = buf,
                                   .source = &src};
                T_OK(hcoll(w, r, &a));
                T_ASSERT(src >= 0 && src < n && src != r);
                for (size_t i = 0; i < t->count; i++)
                    T_ASSERT(buf[i] == value(src, per[src], i));
                per[src]++;
            }
            for (int p = 0; p < n; p++) T_ASSERT(p == r || per[p] == 2);
        } else {
            for (int k = 0; k < 2; k++) {
                for (size_t i = 0; i < t->count; i++) buf[i] = value(r, k, i);
                ddp_coll_args a = {.kind = DDP_COLL_SEND, .dtype = DDP_INT32, .root = dst,
                                   .count = t->count, .buf = buf};
                T_OK(hcoll(w, r, &a));
            }
        }
    }
    int32_t one = 1;
    ddp_coll_args ar = {.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_INT32, .op = DDP_SUM,
                        .count = 1, .buf = &one};
    T_OK(hcoll(w, r, &ar));
    T_ASSERT(one == n);
    free(buf);
}

static void test_turns(void) {
    const size_t counts[] = {1, 10, 70000};   /* 70000 int32: the bandwidth path */
    for (int striped = 0; striped < 2; striped++) {
        for (int n = 2; n <= H_MAXR; n++) {
            for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
                hworld w;
                hworld_init(&w, n, 1 << 16, 1 << 20);
                if (striped) hworld_stripe(&w, 2);
                turn t = {.count = counts[c]};
                hrun(&w, turns_rank, &t);
                hworld_free(&w);
            }
        }
    }
    printf("any-source turns at 2..%d ranks, plain and striped links: ok\n", H_MAXR);
}

/* Rank 0 receives from any source while rank 1's next call is an
 * all-reduce and rank 2 sends (late): rank 1 is passed over, the message
 * comes from rank 2, and the all-reduce then runs on every rank. */
typedef struct passover {
    int src;
    ddp_status st[H_MAXR];
    char msg[H_MAXR][1024];
    int mode;   /* 0: rank 2 sends; 1: nobody sends (mismatch); 2: rank 1 leaves */
} passover;

static void passover_rank(hworld *w, int r, void *arg) {
    passover *p = arg;
    int32_t data[8] = {0}, one = 1;
    ddp_coll_args ar = {.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_INT32, .op = DDP_SUM,
                        .count = 1, .buf = &one};
    if (r == 0) {
        ddp_coll_args a = {.kind = DDP_COLL_RECV, .dtype = DDP_INT32, .root = DDP_ANY_SOURCE,
                           .count = 8, .buf = data, .source = &p->src};
        p->st[0] = hcoll(w, 0, &a);
        ddp_copy_error(p->msg[0], sizeof p->msg[0]);
        if (p->st[0] != DDP_OK) return;
        for (int i = 0; i < 8; i++) T_ASSERT(data[i] == 100 + i);
        if (p->mode == 2) return;   /* rank 1 is gone: no all-reduce */
    } else if (r == 2 && p->mode != 1) {
        ms_sleep(100);   /* rank 1's header is in first */
        for (int i = 0; i < 8; i++) data[i] = 100 + i;
        ddp_coll_args s = {.kind = DDP_COLL_SEND, .dtype = DDP_INT32, .root = 0, .count = 8,
                           .buf = data};
        T_OK(hcoll(w, 2, &s));
        if (p->mode == 2) return;
    } else if (r == 1 && p->mode == 2) {
        hbreak(w, 1);    /* leaves without a word */
        return;
    }
    p->st[r] = hcoll(w, r, &ar);
    ddp_copy_error(p->msg[r], sizeof p->msg[r]);
    if (p->st[r] == DDP_OK) T_ASSERT(one == w->n);
}

static void test_passover(void) {
    hworld w;
    for (int striped = 0; striped < 2; striped++) {
        hworld_init(&w, 3, 1 << 16, 1 << 20);
        if (striped) hworld_stripe(&w, 2);
        passover p = {.src = -1};
        hrun(&w, passover_rank, &p);
        for (int r = 0; r < 3; r++) T_OK(p.st[r]);
        T_ASSERT(p.src == 2);
        hworld_free(&w);
    }
    /* nobody sends to rank 0: a mismatch naming the others' calls */
    hworld_init(&w, 3, 1 << 16, 1 << 20);
    passover m = {.src = -1, .mode = 1};
    hrun(&w, passover_rank, &m);
    T_STATUS(m.st[0], DDP_ERR_MISMATCH);
    T_ASSERT(strstr(m.msg[0], "recv(count=8, int32, from any rank) on rank 0 of 3"));
    T_ASSERT(strstr(m.msg[0], "rank 1 called all_reduce(count=1, int32, sum)"));
    T_ASSERT(strstr(m.msg[0], "rank 2 called all_reduce"));
    T_ASSERT(m.src == -1 && m.st[1] != DDP_OK && m.st[2] != DDP_OK);
    hworld_free(&w);
    /* rank 1 left: dropped; rank 2's message still arrives */
    hworld_init(&w, 3, 1 << 16, 1 << 20);
    passover d = {.src = -1, .mode = 2};
    hrun(&w, passover_rank, &d);
    if (d.st[0] != DDP_OK) fprintf(stderr, "rank 0: %s\n", d.msg[0]);
    T_OK(d.st[0]);
    T_ASSERT(d.src == 2);
    hworld_free(&w);
    printf("passed-over peer, mismatch, dropped peer: ok\n");
}

/* The deadline, the abort flag, and validation. */
static atomic_int abort_flag;

static void *raise_abort(void *arg) {
    (void)arg;
    ms_sleep(150);
    atomic_store(&abort_flag, 1);
    return NULL;
}

static void test_limits(void) {
    hworld w;
    hworld_init(&w, 2, 1 << 16, 1 << 20);
    int32_t x = 0;
    ddp_coll_args a = {.kind = DDP_COLL_RECV, .dtype = DDP_INT32, .root = DDP_ANY_SOURCE,
                       .count = 1, .buf = &x};
    T_OK(ddp_coll_validate(&w.g[0], &a));
    T_STATUS(ddp_coll_run(&w.g[0], &a, ddp_wait_for(150, NULL)), DDP_ERR_TIMEOUT);
    T_ASSERT(strstr(ddp_last_error(), "from any rank"));
    pthread_t th;
    T_ASSERT(pthread_create(&th, NULL, raise_abort, NULL) == 0);
    T_STATUS(ddp_coll_run(&w.g[1], &a, ddp_wait_for(10000, &abort_flag)), DDP_ERR_ABORTED);
    T_ASSERT(pthread_join(th, NULL) == 0);
    ddp_group one = {.rank = 0, .size = 1};
    expect_invalid(&one, a, DDP_ERR_INVALID, "needs another rank");
    a.kind = DDP_COLL_SEND;   /* a send needs a real peer */
    expect_invalid(&w.g[0], a, DDP_ERR_INVALID, "out of range");
    hworld_free(&w);
    printf("deadline, abort, validation: ok\n");
}

int main(void) {
    test_unread();
    test_xfer_any();
    test_striped_held();
    test_turns();
    test_passover();
    test_limits();
    printf("test_recv_any: ok\n");
    return 0;
}
