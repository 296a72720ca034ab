/* test_link_stripe.c - TCP links striped over several sockets
 * (ddp_link_tcp_add_streams, PYDDP_NSOCKS_PERPEER), on socketpairs: where the
 * segments go, exact bytes for random and different call sizes on the two
 * sides (1 to 4 sockets), a ring all-reduce over striped links against a
 * plain reference sum, and fast failures for a local shutdown, a peer that
 * shuts its link down, and a peer that closes one of the sockets. */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/ioctl.h>

#include "coll_harness.h"
#include "ddp_sock.h"

#define SEGB DDP_LINK_STRIPE_BYTES

/* A pair of links a <-> b over n socketpairs; raw_b[i] is b's end of socket
 * i (still owned by the link; for the fault tests and the layout check). */
typedef struct spair {
    ddp_link *a, *b;
    int raw_a[DDP_LINK_MAX_STREAMS], raw_b[DDP_LINK_MAX_STREAMS];
} spair;

static void spair_init(spair *p, int n) {
    for (int i = 0; i < n; i++) {
        int sv[2];
        T_ASSERT(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
        p->raw_a[i] = sv[0];
        p->raw_b[i] = sv[1];
    }
    T_ASSERT((p->a = ddp_link_tcp_new(p->raw_a[0], 1, "rank 1 (socketpair)")) != NULL);
    T_ASSERT((p->b = ddp_link_tcp_new(p->raw_b[0], 0, "rank 0 (socketpair)")) != NULL);
    if (n > 1) {
        T_OK(ddp_link_tcp_add_streams(p->a, p->raw_a + 1, n - 1));
        T_OK(ddp_link_tcp_add_streams(p->b, p->raw_b + 1, n - 1));
    }
    T_ASSERT(ddp_link_tcp_streams(p->a) == n && ddp_link_tcp_streams(p->b) == n);
}

static void spair_free(spair *p) {
    ddp_link_free(p->a);
    ddp_link_free(p->b);
}

static unsigned char byte_at(int from, size_t i) {
    return (unsigned char)(i * 131 + (i >> 13) + (size_t)from * 17);
}

static int pending(int fd) {
    int k = 0;
    T_ASSERT(ioctl(fd, FIONREAD, &k) == 0);
    return k;
}

typedef struct sender {
    ddp_link *l;
    const unsigned char *buf;
    size_t n[2]; /* two calls */
} sender;

static void *sender_main(void *arg) {
    sender *s = arg;
    T_OK(ddp_link_send(s->l, s->buf, s->n[0], ddp_wait_for(H_DEADLINE_MS, NULL)));
    T_OK(ddp_link_send(s->l, s->buf + s->n[0], s->n[1], ddp_wait_for(H_DEADLINE_MS, NULL)));
    return NULL;
}

/* Read exactly n bytes of raw socket fd and compare them with want. */
static void expect_raw(int fd, const unsigned char *want, size_t n) {
    unsigned char *got = malloc(n);
    T_ASSERT(got);
    T_OK(ddp_sock_recv_all(fd, got, n, ddp_wait_for(H_DEADLINE_MS, NULL), "raw"));
    T_ASSERT(memcmp(got, want, n) == 0);
    free(got);
}

/* Segment k of the stream goes to socket k mod n, whatever the call sizes:
 * calls of one segment plus 10 bytes, then one segment, put segment 0 on
 * socket 0, segment 1 on socket 1 (across the two calls), 10 bytes of
 * segment 2 on socket 2, and nothing else anywhere (read raw here). */
static void test_layout(void) {
    spair p;
    spair_init(&p, 3);
    unsigned char *buf = malloc(2 * SEGB + 10);
    T_ASSERT(buf);
    for (size_t i = 0; i < 2 * SEGB + 10; i++) buf[i] = byte_at(0, i);
    sender s = {p.a, buf, {SEGB + 10, SEGB}};
    pthread_t t;
    T_ASSERT(pthread_create(&t, NULL, sender_main, &s) == 0);
    expect_raw(p.raw_b[0], buf, SEGB);
    expect_raw(p.raw_b[1], buf + SEGB, SEGB);
    expect_raw(p.raw_b[2], buf + 2 * SEGB, 10);
    T_ASSERT(pthread_join(t, NULL) == 0);
    for (int i = 0; i < 3; i++) T_ASSERT(pending(p.raw_b[i]) == 0);
    /* not a TCP link, or too many sockets: refused, the fds closed */
    ddp_link *w = hwrap_new(ddp_link_tcp_new(dup(p.raw_a[0]), 1, "wrapped"), SIZE_MAX, 0);
    int sv[2];
    T_ASSERT(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    T_STATUS(ddp_link_tcp_add_streams(w, sv, 1), DDP_ERR_INVALID);
    T_ASSERT(strstr(ddp_last_error(), "not a TCP link"));
    int many[DDP_LINK_MAX_STREAMS];
    for (int i = 0; i < DDP_LINK_MAX_STREAMS; i++) T_ASSERT((many[i] = dup(sv[1])) >= 0);
    T_STATUS(ddp_link_tcp_add_streams(p.a, many, DDP_LINK_MAX_STREAMS), DDP_ERR_INVALID);
    T_ASSERT(ddp_link_tcp_streams(p.a) == 3 && ddp_link_tcp_streams(w) == 0);
    close(sv[1]);
    ddp_link_free(w);
    free(buf);
    spair_free(&p);
    printf("layout: segments round-robin by stream offset: ok\n");
}

/* ---- random call sizes --------------------------------------------------- */

enum { TOTAL = (5 << 20) + 12345 };

/* Next call size: mostly small or around a segment, sometimes large. */
static size_t call_size(unsigned *seed, size_t left) {
    size_t n;
    switch (rand_r(seed) % 4) {
    case 0: n = 1 + (size_t)rand_r(seed) % 100; break;
    case 1: n = 1 + (size_t)rand_r(seed) % (64 << 10); break;
    case 2: n = SEGB - 50 + (size_t)rand_r(seed) % 100; break;
    default: n = 1 + (size_t)rand_r(seed) % (3 * SEGB); break;
    }
    return n < left ? n : left;
}

typedef struct side {
    ddp_link *l;
    int me, sending;
    unsigned seed;
    unsigned char *buf; /* TOTAL bytes: what is sent, or what arrived */
} side;

/* One direction of one end: TOTAL bytes in random call sizes. */
static void *side_main(void *arg) {
    side *s = arg;
    ddp_wait wt = ddp_wait_for(H_DEADLINE_MS, NULL);
    for (size_t off = 0; off < TOTAL;) {
        size_t n = call_size(&s->seed, TOTAL - off);
        if (s->sending) T_OK(ddp_link_send(s->l, s->buf + off, n, wt));
        else T_OK(ddp_link_recv(s->l, s->buf + off, n, wt));
        off += n;
    }
    return NULL;
}

/* Both ends send TOTAL bytes to each other at once, each direction with its
 * own random call sizes on the sending and on the receiving side. */
static void test_random_calls(void) {
    for (int n = 1; n <= 4; n++) {
        spair p;
        spair_init(&p, n);
        side s[4];
        pthread_t t[4];
        for (int k = 0; k < 4; k++) {
            int me = k / 2;
            s[k] = (side){me ? p.b : p.a, me, k % 2, 1000u * (unsigned)n + (unsigned)k, malloc(TOTAL)};
            T_ASSERT(s[k].buf);
            if (s[k].sending)
                for (size_t i = 0; i < TOTAL; i++) s[k].buf[i] = byte_at(me, i);
            else memset(s[k].buf, 0xee, TOTAL);
        }
        for (int k = 0; k < 4; k++) T_ASSERT(pthread_create(&t[k], NULL, side_main, &s[k]) == 0);
        for (int k = 0; k < 4; k++) T_ASSERT(pthread_join(t[k], NULL) == 0);
        for (int k = 0; k < 4; k++) {
            if (!s[k].sending)
                for (size_t i = 0; i < TOTAL; i++) T_ASSERT(s[k].buf[i] == byte_at(1 - s[k].me, i));
            free(s[k].buf);
        }
        for (int i = 0; i < n; i++) T_ASSERT(pending(p.raw_a[i]) == 0 && pending(p.raw_b[i]) == 0);
        spair_free(&p);
    }
    printf("random, different call sizes on both sides, 1-4 sockets: exact bytes: ok\n");
}

/* ---- collectives over striped links ------------------------------------- */

enum { AR_COUNT = (3 << 20) / 4 + 77 };

static void allreduce_rank(hworld *w, int r, void *arg) {
    (void)arg;
    float *x = malloc(AR_COUNT * sizeof *x);
    T_ASSERT(x);
    for (size_t i = 0; i < AR_COUNT; i++) x[i] = (float)((i + 3 * (size_t)r) % 7);
    ddp_coll_args a = {.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT32, .op = DDP_SUM,
                       .count = AR_COUNT, .buf = x};
    T_OK(hcoll(w, r, &a));
    for (size_t i = 0; i < AR_COUNT; i++) {
        float want = 0;
        for (int q = 0; q < w->n; q++) want += (float)((i + 3 * (size_t)q) % 7);
        T_ASSERT(x[i] == want);
    }
    free(x);
}

/* A 3-rank ring all-reduce (chunks smaller than a segment, so calls and
 * segments do not line up) over links striped 3 ways. */
static void test_allreduce(void) {
    hworld w;
    hworld_init(&w, 3, 0, 100 << 10);
    hworld_stripe(&w, 2);
    hrun(&w, allreduce_rank, NULL);
    hworld_free(&w);
    printf("all-reduce over 3-way striped links: ok\n");
}

/* ---- failures ------------------------------------------------------------ */

typedef struct waiter {
    ddp_link *l;
    int sending;
    ddp_status st;
    char msg[600];
    int64_t ms;
} waiter;

static void *waiter_main(void *arg) {
    waiter *wt = arg;
    size_t n = 8 * SEGB;
    unsigned char *buf = calloc(1, n);
    T_ASSERT(buf);
    int64_t t0 = ddp_now_ms();
    wt->st = wt->sending ? ddp_link_send(wt->l, buf, n, ddp_wait_for(H_DEADLINE_MS, NULL))
                         : ddp_link_recv(wt->l, buf, n, ddp_wait_for(H_DEADLINE_MS, NULL));
    wt->ms = ddp_now_ms() - t0;
    ddp_copy_error(wt->msg, sizeof wt->msg);
    free(buf);
    return NULL;
}

/* Start a blocked send or receive on p.a, do `what` after 100 ms, and expect
 * the call to end quickly with status want and text in its message. */
static void expect_fast(int n, int sending, int what, ddp_status want, const char *text) {
    spair p;
    spair_init(&p, n);
    waiter wt = {p.a, sending, DDP_OK, "", 0};
    pthread_t t;
    T_ASSERT(pthread_create(&t, NULL, waiter_main, &wt) == 0);
    struct timespec ts = {0, 100 * 1000 * 1000};
    nanosleep(&ts, NULL);
    if (what == 0) ddp_link_shutdown(p.a);            /* this rank aborts */
    else if (what == 1) ddp_link_shutdown(p.b);       /* the peer breaks its link */
    else shutdown(p.raw_b[n - 1], SHUT_RDWR);         /* the peer loses one socket */
    T_ASSERT(pthread_join(t, NULL) == 0);
    if (wt.st != want || !strstr(wt.msg, text) || wt.ms > 5000) {
        fprintf(stderr, "n=%d sending=%d what=%d: %s after %lld ms: %s (wanted %s, \"%s\")\n",
                n, sending, what, ddp_status_name(wt.st), (long long)wt.ms, wt.msg,
                ddp_status_name(want), text);
        exit(1);
    }
    spair_free(&p);
}

static void test_failures(void) {
    for (int n = 1; n <= 3; n += 2) {
        for (int sending = 0; sending <= 1; sending++) {
            expect_fast(n, sending, 0, DDP_ERR_ABORTED, "shut down on this rank");
            expect_fast(n, sending, 1, DDP_ERR_CLOSED, "rank 1 (socketpair)");
        }
    }
    /* One socket of three gone: the transfer needs it, so it fails, naming it. */
    expect_fast(3, 0, 2, DDP_ERR_CLOSED, "stream 3 of 3");
    expect_fast(3, 1, 2, DDP_ERR_CLOSED, "stream 3 of 3");
    printf("local shutdown, peer shutdown, one socket closed: fail fast: ok\n");
}

int main(void) {
    test_layout();
    test_random_calls();
    test_allreduce();
    test_failures();
    printf("test_link_stripe: ok\n");
    return 0;
}
