/* test_coll_fail.c - how collectives fail: argument validation before any
 * communication, mismatched calls detected and named on every rank (on both
 * paths, and when the mismatched calls take different paths), a rank that
 * dies mid-collective making every other rank fail fast with
 * DDP_ERR_CLOSED, a short deadline giving DDP_ERR_TIMEOUT, the abort
 * flag giving DDP_ERR_ABORTED, and calls on different process groups (group
 * tags differ, also for a subgroup over its parent's links) named as such. */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "coll_harness.h"

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* ---- validation ----------------------------------------------------------------- */

static void test_validate(void) {
    hworld w;
    hworld_init(&w, 3, 1 << 16, 1 << 20);
    const ddp_group *g = &w.g[1];
    float buf[12];
    const ddp_coll_args ar = {.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT32, .op = DDP_SUM,
                              .count = 4, .buf = buf, .sendbuf = buf, .recvbuf = buf};
    ddp_coll_args a = ar;
    T_OK(ddp_coll_validate(g, &a));
    a.kind = DDP_COLL_BROADCAST, a.root = 3;
    expect_invalid(g, a, DDP_ERR_INVALID, "root 3 is out of range for a group of 3 ranks");
    a.kind = DDP_COLL_SEND, a.root = 1;
    expect_invalid(g, a, DDP_ERR_INVALID, "rank 1 cannot send to itself");
    a.kind = DDP_COLL_RECV, a.root = -2;   /* -1 is DDP_ANY_SOURCE (test_recv_any.c) */
    expect_invalid(g, a, DDP_ERR_INVALID, "peer -2 is out of range");
    a = ar, a.dtype = DDP_BOOL, a.op = DDP_AVG;
    expect_invalid(g, a, DDP_ERR_TYPE, "AVG");
    a = ar, a.dtype = (ddp_dtype)42;
    expect_invalid(g, a, DDP_ERR_TYPE, "dtype");
    a = ar, a.kind = (ddp_coll_kind)0;
    expect_invalid(g, a, DDP_ERR_INVALID, "unknown collective");
    a = ar, a.buf = NULL;
    expect_invalid(g, a, DDP_ERR_INVALID, "buf is NULL");
    a.count = 0; /* nothing to touch: fine */
    T_OK(ddp_coll_validate(g, &a));
    a = ar, a.count = SIZE_MAX / 2;
    expect_invalid(g, a, DDP_ERR_INVALID, "too large");
    /* gather: recvbuf matters only at the root */
    a = ar, a.kind = DDP_COLL_GATHER, a.root = 0, a.recvbuf = NULL;
    T_OK(ddp_coll_validate(g, &a));
    a.root = 1;
    expect_invalid(g, a, DDP_ERR_INVALID, "recvbuf is NULL");
    /* in place means exactly this rank's block */
    a = ar, a.kind = DDP_COLL_ALLGATHER, a.sendbuf = buf + 4;
    T_OK(ddp_coll_validate(g, &a));
    a.sendbuf = buf + 2;
    expect_invalid(g, a, DDP_ERR_INVALID, "sendbuf overlaps recvbuf but is not rank 1's block");
    a = ar, a.kind = DDP_COLL_REDUCE_SCATTER, a.recvbuf = buf + 5;
    expect_invalid(g, a, DDP_ERR_INVALID, "recvbuf overlaps sendbuf");
    a = (ddp_coll_args){.kind = DDP_COLL_BARRIER};
    T_OK(ddp_coll_validate(g, &a));
    hworld_free(&w);
    printf("validation: ok\n");
}

/* ---- mismatches ----------------------------------------------------------------- */

typedef struct mm {
    ddp_coll_args a[H_MAXR];      /* buffers are filled in per rank */
    ddp_status st[H_MAXR];
    char msg[H_MAXR][2048];
} mm;

static void mm_rank(hworld *w, int r, void *arg) {
    mm *m = arg;
    float buf[4 * 128] = {0};
    ddp_coll_args a = m->a[r];
    a.buf = a.recvbuf = buf;
    a.sendbuf = buf + 2 * 128;
    m->st[r] = hcoll(w, r, &a);
    ddp_copy_error(m->msg[r], sizeof m->msg[r]);
}

/* Run one call per rank on w; every rank must fail with DDP_ERR_MISMATCH
 * and a message containing `text`. Frees w. */
static void run_mismatch(hworld *w, const ddp_coll_args *calls, const char *text) {
    mm m;
    memcpy(m.a, calls, (size_t)w->n * sizeof *calls);
    hrun(w, mm_rank, &m);
    for (int r = 0; r < w->n; r++) {
        if (m.st[r] != DDP_ERR_MISMATCH || !strstr(m.msg[r], text)) {
            fprintf(stderr, "rank %d: %s: \"%s\"; expected DDP_ERR_MISMATCH with \"%s\"\n", r,
                    ddp_status_name(m.st[r]), m.msg[r], text);
            exit(1);
        }
    }
    hworld_free(w);
}

static void expect_mismatch(int n, size_t small_bytes, const ddp_coll_args *calls,
                            const char *text) {
    hworld w;
    hworld_init(&w, n, small_bytes, 256);
    run_mismatch(&w, calls, text);
}

static void test_mismatch(void) {
    const ddp_coll_args ar = {.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT32, .op = DDP_SUM,
                              .count = 10};
    ddp_coll_args bc = ar;
    bc.kind = DDP_COLL_BROADCAST, bc.root = 0;
    for (int path = 0; path < 2; path++) {
        const size_t small = path ? 0 : 1 << 20;
        ddp_coll_args kinds[3] = {ar, bc, ar};
        expect_mismatch(3, small, kinds, "rank 0 called all_reduce(count=10, float32, sum) but "
                                         "rank 1 called broadcast(count=10, float32, root=0)");
        ddp_coll_args ops[3] = {ar, ar, ar};
        ops[2].op = DDP_MAX;
        expect_mismatch(3, small, ops, "but rank 2 called all_reduce(count=10, float32, max)");
        ddp_coll_args types[4] = {ar, ar, ar, ar};
        types[3].dtype = DDP_INT32;
        expect_mismatch(4, small, types, "but rank 3 called all_reduce(count=10, int32, sum)");
        ddp_coll_args roots[2] = {bc, bc};
        roots[0].root = 1;
        expect_mismatch(2, small, roots, "rank 0 called broadcast(count=10, float32, root=1) but "
                                         "rank 1 called broadcast(count=10, float32, root=0)");
        /* send/recv: only the pair talks */
        ddp_coll_args p2p[2] = {{.kind = DDP_COLL_SEND, .dtype = DDP_FLOAT32, .count = 5, .root = 1},
                                {.kind = DDP_COLL_RECV, .dtype = DDP_FLOAT32, .count = 6, .root = 0}};
        expect_mismatch(2, small, p2p, "rank 0 called send(count=5, float32, to rank 1) but rank 1 "
                                       "called recv(count=6, float32, from rank 0)");
        p2p[1] = ar;
        expect_mismatch(2, small, p2p, "but rank 1 called all_reduce(count=10, float32, sum)");
    }
    /* one rank on the latency path (32 bytes), the others on the ring (400) */
    ddp_coll_args counts[3] = {ar, ar, ar};
    counts[0].count = 8, counts[1].count = counts[2].count = 100;
    expect_mismatch(3, 64, counts, "rank 0 called all_reduce(count=8, float32, sum) but rank 1 "
                                   "called all_reduce(count=100, float32, sum)");
    printf("mismatch detection: ok\n");
}

/* Same call, but a rank that skipped a collective (sequence numbers
 * differ), or ranks configured with different small-message thresholds
 * (they would choose different algorithms). */
static void test_sequence_and_path_mismatch(void) {
    const ddp_coll_args bar[2] = {{.kind = DDP_COLL_BARRIER}, {.kind = DDP_COLL_BARRIER}};
    hworld w;
    hworld_init(&w, 2, 1 << 20, 256);
    w.g[1].seq = 5;
    run_mismatch(&w, bar, "rank 0 is at collective #1, barrier(), but rank 1 is at collective #6");
    const ddp_coll_args ar = {.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT32, .op = DDP_SUM,
                              .count = 100};
    const ddp_coll_args calls[3] = {ar, ar, ar};
    hworld_init(&w, 3, 1 << 20, 256);
    w.g[2].small_bytes = 0;
    run_mismatch(&w, calls, "ranks 0 and 2 chose different algorithms for all_reduce(count=100, "
                            "float32, sum) (rank 0: latency path, rank 2: flat ring/chain): the "
                            "small-message threshold (PYDDP_SMALL_BYTES)");
    printf("sequence and path mismatch: ok\n");
}

/* ---- different process groups ---------------------------------------------------- */

/* Parent group: ranks 0..2 (tag 0xaa). Subgroup: parent ranks 1 and 2 as its
 * ranks 0 and 1, over the parent's link between them (tag 0xbb). Parent
 * rank 1 calls on the subgroup while ranks 0 and 2 call on the parent. */
typedef struct wrong_group {
    ddp_group sub[2]; /* the subgroup's view on parent ranks 1 and 2 */
    ddp_link *sub_links[2][2];
    ddp_status st[3];
    char msg[3][2048];
} wrong_group;

static void wrong_group_rank(hworld *w, int r, void *arg) {
    wrong_group *wg = arg;
    float buf[10] = {0};
    ddp_coll_args a = {.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT32, .op = DDP_SUM,
                       .count = 10, .buf = buf};
    ddp_group *g = r == 1 ? &wg->sub[0] : &w->g[r];
    ddp_status st = ddp_coll_validate(g, &a);
    if (st == DDP_OK) st = ddp_coll_run(g, &a, ddp_wait_for(H_DEADLINE_MS, NULL));
    if (st != DDP_OK) hbreak(w, r);
    wg->st[r] = st;
    ddp_copy_error(wg->msg[r], sizeof wg->msg[r]);
}

static void expect_text(int r, ddp_status st, ddp_status want, const char *msg, const char *text) {
    if (st != want || !strstr(msg, text)) {
        fprintf(stderr, "rank %d: %s: \"%s\"; expected %s with \"%s\"\n", r,
                ddp_status_name(st), msg, ddp_status_name(want), text);
        exit(1);
    }
}

static void test_group_tags(void) {
    const char *groups = "the ranks called the collective on different process groups";
    const ddp_coll_args ar = {.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT32, .op = DDP_SUM,
                              .count = 10};
    for (int path = 0; path < 2; path++) {
        /* same links, rank 1's group has another tag: every rank names it */
        hworld w;
        const ddp_coll_args calls[3] = {ar, ar, ar};
        hworld_init(&w, 3, path ? 0 : 1 << 20, 256);
        for (int r = 0; r < 3; r++) w.g[r].tag = r == 1 ? 0xbb : 0xaa;
        mm m;
        memcpy(m.a, calls, sizeof calls);
        hrun(&w, mm_rank, &m);
        expect_text(0, m.st[0], DDP_ERR_MISMATCH, m.msg[0],
                    "process group mismatch: rank 1 called all_reduce(count=10, float32, sum) on "
                    "group tag 0x00000000000000bb but rank 0 called all_reduce(count=10, float32, "
                    "sum) on group tag 0x00000000000000aa; the ranks called the collective on "
                    "different process groups");
        expect_text(1, m.st[1], DDP_ERR_MISMATCH, m.msg[1],
                    "rank 0 called all_reduce(count=10, float32, sum) on group tag "
                    "0x00000000000000aa but rank 1 called");
        expect_text(2, m.st[2], DDP_ERR_MISMATCH, m.msg[2], groups);
        hworld_free(&w);

        /* send/recv between groups */
        ddp_coll_args p2p[2] = {{.kind = DDP_COLL_SEND, .dtype = DDP_FLOAT32, .count = 5, .root = 1},
                                {.kind = DDP_COLL_RECV, .dtype = DDP_FLOAT32, .count = 5, .root = 0}};
        hworld_init(&w, 2, path ? 0 : 1 << 20, 256);
        w.g[1].tag = 7;
        run_mismatch(&w, p2p, groups);
    }

    /* a subgroup over the parent's links: two ddp_group sets, two tags */
    hworld w;
    wrong_group wg;
    memset(&wg, 0, sizeof wg);
    hworld_init(&w, 3, 1 << 20, 256);
    for (int r = 0; r < 3; r++) w.g[r].tag = 0xaa;
    for (int s = 0; s < 2; s++) {
        wg.sub_links[s][1 - s] = w.links[1 + s][2 - s]; /* borrowed: freed with w */
        wg.sub[s] = (ddp_group){.rank = s, .size = 2, .links = wg.sub_links[s], .tag = 0xbb,
                                .small_bytes = 1 << 20, .chunk_bytes = 256};
    }
    hrun(&w, wrong_group_rank, &wg);
    /* parent rank 2 sees subgroup rank 0 (parent rank 1) on the other tag */
    expect_text(2, wg.st[2], DDP_ERR_MISMATCH, wg.msg[2],
                "rank 1 called all_reduce(count=10, float32, sum) on group tag 0x00000000000000bb "
                "but rank 2 called all_reduce(count=10, float32, sum) on group tag "
                "0x00000000000000aa (rank 1 is rank 0 of the group it called on)");
    expect_text(1, wg.st[1], DDP_ERR_MISMATCH, wg.msg[1],
                "(rank 1 is rank 2 of the group it called on)");
    /* parent rank 0 waited for rank 1, which never sent to it: it fails as
     * the others break their links, not at the deadline */
    T_ASSERT(wg.st[0] == DDP_ERR_CLOSED);
    for (int s = 0; s < 2; s++) ddp_group_release_scratch(&wg.sub[s]);
    hworld_free(&w);
    printf("calls on different process groups: ok\n");
}

/* ---- a rank dying mid-collective ---------------------------------------------- */

typedef struct dying {
    int victim;       /* the rank that fails */
    int skip;         /* 1: the victim never calls, it shuts its links after a pause */
    ddp_status st[H_MAXR];
    int64_t ms[H_MAXR];
    char msg[H_MAXR][2048];
} dying;

enum { BIG = 1 << 18 };

static void dying_rank(hworld *w, int r, void *arg) {
    dying *d = arg;
    int64_t t0 = ddp_now_ms();
    if (r == d->victim && d->skip) {
        sleep_ms(200);
        hbreak(w, r);
        d->st[r] = DDP_OK;
        return;
    }
    float *buf = calloc(BIG, sizeof(float));
    T_ASSERT(buf);
    ddp_coll_args a = {.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT32, .op = DDP_SUM,
                       .count = BIG, .buf = buf};
    d->st[r] = hcoll(w, r, &a);
    d->ms[r] = ddp_now_ms() - t0;
    ddp_copy_error(d->msg[r], sizeof d->msg[r]);
    free(buf);
}

static void test_dying_rank(void) {
    for (int skip = 0; skip <= 1; skip++) {
        hworld w;
        dying d = {.victim = 3, .skip = skip};
        hworld_init(&w, 4, 0, 4096);
        /* mid ring: rank 3's link to its ring successor breaks after the
         * header and 20 KB of reduce-scatter data */
        if (!skip) w.links[3][0] = hwrap_new(w.links[3][0], 40 + 20000, 0);
        hrun(&w, dying_rank, &d);
        for (int r = 0; r < 3; r++) {
            if (d.st[r] != DDP_ERR_CLOSED || !strstr(d.msg[r], "by the peer") ||
                d.ms[r] > H_DEADLINE_MS / 4) {
                fprintf(stderr, "rank %d: %s after %lld ms: %s\n", r, ddp_status_name(d.st[r]),
                        (long long)d.ms[r], d.msg[r]);
                exit(1);
            }
        }
        if (!skip) {
            T_STATUS(d.st[3], DDP_ERR_ABORTED);
            T_ASSERT(strstr(d.msg[3], "sending to rank 0 (socketpair)"));
        }
        hworld_free(&w);
    }
    printf("dying rank: ok\n");
}

/* ---- deadline and abort ----------------------------------------------------------- */

typedef struct lonely {
    atomic_int abort;
    int use_abort;
    atomic_int done;
    ddp_status st;
    int64_t ms;
    char msg[2048];
} lonely;

/* Rank 0 calls all_reduce alone; rank 1 never joins (it only sets the abort
 * flag, in the abort variant) and waits for rank 0 to give up. */
static void lonely_rank(hworld *w, int r, void *arg) {
    lonely *l = arg;
    if (r == 1) {
        if (l->use_abort) {
            sleep_ms(150);
            atomic_store(&l->abort, 1);
        }
        while (!atomic_load(&l->done)) sleep_ms(5);
        return;
    }
    float x[2] = {1, 2};
    ddp_coll_args a = {.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT32, .op = DDP_SUM,
                       .count = 2, .buf = x};
    int64_t t0 = ddp_now_ms();
    ddp_wait wt = l->use_abort ? ddp_wait_for(H_DEADLINE_MS, &l->abort) : ddp_wait_for(300, NULL);
    l->st = hcoll_wait(w, r, &a, wt);
    l->ms = ddp_now_ms() - t0;
    ddp_copy_error(l->msg, sizeof l->msg);
    atomic_store(&l->done, 1);
}

static void test_timeout_and_abort(void) {
    for (int use_abort = 0; use_abort <= 1; use_abort++) {
        hworld w;
        lonely l = {.use_abort = use_abort};
        hworld_init(&w, 2, 1 << 16, 1 << 20);
        hrun(&w, lonely_rank, &l);
        fprintf(stderr, "  %s after %lld ms: %s\n", ddp_status_name(l.st), (long long)l.ms, l.msg);
        T_STATUS(l.st, use_abort ? DDP_ERR_ABORTED : DDP_ERR_TIMEOUT);
        T_ASSERT(strstr(l.msg, use_abort ? "aborted while receiving from rank 1 (socketpair)"
                                         : "timed out after"));
        T_ASSERT(strstr(l.msg, "all_reduce(count=2, float32, sum) on rank 0 of 2"));
        T_ASSERT(l.ms >= (use_abort ? 140 : 290) && l.ms < H_DEADLINE_MS / 4);
        hworld_free(&w);
    }
    printf("timeout and abort: ok\n");
}

int main(void) {
    test_validate();
    test_mismatch();
    test_sequence_and_path_mismatch();
    test_group_tags();
    test_dying_rank();
    test_timeout_and_abort();
    printf("test_coll_fail: ok\n");
    return 0;
}
