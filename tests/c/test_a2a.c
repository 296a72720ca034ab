/* test_a2a.c - all_to_all with per-peer counts (DDP_COLL_ALLTOALL): results
 * against a reference computed here from the inputs (random uneven splits
 * with zeros, every element size, contiguous and scattered displacements,
 * 1..4 ranks, blocks of several MiB both ways), argument validation,
 * disagreeing splits and calls reported as DDP_ERR_MISMATCH on every rank
 * with recvbuf untouched, a rank dying mid-transfer making every rank fail
 * fast, and a deadline. */
#include <stdint.h>

#include "coll_harness.h"

#define SENTINEL 0xEE

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) { /* xorshift64: reproducible cases */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* One all_to_all: counts[p][q] elements go from rank p to rank q. */
typedef struct a2a_case {
    ddp_dtype t;
    size_t counts[H_MAXR][H_MAXR];
    size_t sc[H_MAXR][H_MAXR], sd[H_MAXR][H_MAXR]; /* rank p's scounts, sdispls */
    size_t rc[H_MAXR][H_MAXR], rd[H_MAXR][H_MAXR]; /* rank q's rcounts, rdispls */
    size_t slen[H_MAXR], rlen[H_MAXR];             /* elements */
    unsigned char *send[H_MAXR], *recv[H_MAXR];
    int then_allreduce;    /* check the streams are in step afterwards */
    ddp_status st[H_MAXR];
    char msg[H_MAXR][2048];
} a2a_case;

/* Displacements of one side: blocks in rank order packed (torch's prefix
 * sums), or in reverse order with a gap before each (to catch a confusion
 * of displacement and rank order). Returns the buffer length. */
static size_t layout(int n, const size_t *cnt, size_t *disp, int scattered) {
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        int q = scattered ? n - 1 - i : i;
        at += scattered ? (size_t)q + 1 : 0;
        disp[q] = at;
        at += cnt[q];
    }
    return at + (scattered ? 3 : 0);
}

static void case_setup(a2a_case *c, int n, int scattered) {
    const size_t es = ddp_dtype_size(c->t);
    for (int p = 0; p < n; p++) {
        for (int q = 0; q < n; q++) c->sc[p][q] = c->counts[p][q], c->rc[p][q] = c->counts[q][p];
        c->slen[p] = layout(n, c->sc[p], c->sd[p], scattered);
        c->rlen[p] = layout(n, c->rc[p], c->rd[p], !scattered);
        c->send[p] = malloc(c->slen[p] * es + 1);
        c->recv[p] = malloc(c->rlen[p] * es + 1);
        T_ASSERT(c->send[p] && c->recv[p]);
        for (size_t i = 0; i < c->slen[p] * es; i++) c->send[p][i] = (unsigned char)rnd();
        memset(c->recv[p], SENTINEL, c->rlen[p] * es);
    }
}

static void case_free(a2a_case *c, int n) {
    for (int p = 0; p < n; p++) free(c->send[p]), free(c->recv[p]);
}

static ddp_coll_args a2a_args(a2a_case *c, int r) {
    return (ddp_coll_args){.kind = DDP_COLL_ALLTOALL, .dtype = c->t, .sendbuf = c->send[r],
                           .recvbuf = c->recv[r], .scounts = c->sc[r], .sdispls = c->sd[r],
                           .rcounts = c->rc[r], .rdispls = c->rd[r]};
}

static void a2a_rank(hworld *w, int r, void *arg) {
    a2a_case *c = arg;
    ddp_coll_args a = a2a_args(c, r);
    uint64_t seq = w->g[r].seq;
    c->st[r] = hcoll(w, r, &a);
    ddp_copy_error(c->msg[r], sizeof c->msg[r]);
    if (c->st[r] != DDP_OK || !c->then_allreduce) return;
    T_ASSERT(w->g[r].seq == seq + 1); /* a collective */
    int32_t one = 1;
    ddp_coll_args ar = {.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_INT32, .op = DDP_SUM,
                        .count = 1, .buf = &one};
    T_OK(hcoll(w, r, &ar));
    T_ASSERT(one == w->n);
}

/* Rank q's recvbuf as it must be: sentinel bytes, and rank p's block for q
 * (its sendbuf at sd[p][q]) at rd[q][p]. */
static void check_result(const a2a_case *c, int n) {
    const size_t es = ddp_dtype_size(c->t);
    for (int q = 0; q < n; q++) {
        size_t len = c->rlen[q] * es;
        unsigned char *want = malloc(len + 1);
        T_ASSERT(want);
        memset(want, SENTINEL, len);
        for (int p = 0; p < n; p++)
            memcpy(want + c->rd[q][p] * es, c->send[p] + c->sd[p][q] * es, c->counts[p][q] * es);
        for (size_t i = 0; i < len; i++) {
            if (want[i] != c->recv[q][i]) {
                fprintf(stderr, "all_to_all(%s, %d ranks): rank %d byte %zu is 0x%02x, want "
                        "0x%02x\n", ddp_dtype_name(c->t), n, q, i, c->recv[q][i], want[i]);
                exit(1);
            }
        }
        free(want);
    }
}

static void run_case(a2a_case *c, int n, int scattered) {
    hworld w;
    hworld_init(&w, n, 1 << 16, 1 << 20);
    case_setup(c, n, scattered);
    c->then_allreduce = 1;
    hrun(&w, a2a_rank, c);
    for (int r = 0; r < n; r++) {
        if (c->st[r] != DDP_OK) {
            fprintf(stderr, "rank %d: %s: %s\n", r, ddp_status_name(c->st[r]), c->msg[r]);
            exit(1);
        }
    }
    check_result(c, n);
    case_free(c, n);
    hworld_free(&w);
}

static void test_random_splits(void) {
    int cases = 0;
    for (int n = 1; n <= H_MAXR; n++) {
        for (int t = 0; t < DDP_DTYPE_COUNT; t++) {
            for (int rep = 0; rep < 2; rep++) {
                a2a_case c = {.t = (ddp_dtype)t};
                for (int p = 0; p < n; p++)
                    for (int q = 0; q < n; q++) /* a quarter of the blocks empty */
                        c.counts[p][q] = rnd() % 4 == 0 ? 0 : 1 + rnd() % 300;
                run_case(&c, n, rep);
                cases++;
            }
        }
    }
    /* everything empty, and one rank sending nothing */
    for (int n = 1; n <= H_MAXR; n++) {
        a2a_case c = {.t = DDP_FLOAT32};
        run_case(&c, n, 0);
        a2a_case d = {.t = DDP_INT64};
        for (int q = 0; q < n; q++)
            for (int p = 1; p < n; p++) d.counts[p][q] = (size_t)(p + q);
        run_case(&d, n, 1);
        cases += 2;
    }
    printf("random splits: %d cases ok\n", cases);
}

/* Blocks of several MiB in both directions of every link, much more than a
 * socket buffer holds: a schedule that sent before receiving would hang. */
static void test_large(void) {
    for (int n = 2; n <= H_MAXR; n += 2) {
        a2a_case c = {.t = DDP_FLOAT32};
        for (int p = 0; p < n; p++)
            for (int q = 0; q < n; q++) c.counts[p][q] = (3u << 18) + (size_t)(p * 7 + q * 1000);
        run_case(&c, n, 0);
    }
    printf("large blocks: ok\n");
}

/* ---- validation ---------------------------------------------------------------- */

static void test_validate(void) {
    hworld w;
    hworld_init(&w, 2, 1 << 16, 1 << 20);
    const ddp_group *g = &w.g[0];
    float sb[8], rb[8];
    size_t cnt[2] = {2, 3}, disp[2] = {0, 2}, big[2] = {0, SIZE_MAX / 8};
    const ddp_coll_args ok = {.kind = DDP_COLL_ALLTOALL, .dtype = DDP_FLOAT32, .sendbuf = sb,
                              .recvbuf = rb, .scounts = cnt, .sdispls = disp, .rcounts = cnt,
                              .rdispls = disp};
    ddp_coll_args a = ok;
    T_OK(ddp_coll_validate(g, &a));
    a.rdispls = NULL;
    expect_invalid(g, a, DDP_ERR_INVALID, "all_to_all needs scounts, sdispls, rcounts and rdispls");
    a = ok, a.scounts = NULL;
    expect_invalid(g, a, DDP_ERR_INVALID, "one of them is NULL");
    a = ok, a.sdispls = big;
    expect_invalid(g, a, DDP_ERR_INVALID, "send block for rank 1 (displacement");
    a = ok, a.rcounts = big;
    expect_invalid(g, a, DDP_ERR_INVALID, "receive block for rank 1");
    a = ok, a.recvbuf = sb;
    expect_invalid(g, a, DDP_ERR_INVALID, "all_to_all cannot run in place");
    a = ok, a.recvbuf = sb + 4; /* overlaps the end of the 5-element send range */
    expect_invalid(g, a, DDP_ERR_INVALID, "sendbuf and recvbuf overlap");
    a = ok, a.sendbuf = NULL;
    expect_invalid(g, a, DDP_ERR_INVALID, "sendbuf is NULL but rank 0 sends 5 elements");
    a = ok, a.recvbuf = NULL;
    expect_invalid(g, a, DDP_ERR_INVALID, "recvbuf is NULL");
    a = ok, a.dtype = (ddp_dtype)42;
    expect_invalid(g, a, DDP_ERR_TYPE, "dtype");
    size_t zero[2] = {0, 0};
    a = ok, a.scounts = a.rcounts = zero, a.sendbuf = a.recvbuf = NULL; /* nothing to move */
    T_OK(ddp_coll_validate(g, &a));
    a = ok, a.kind = (ddp_coll_kind)(DDP_COLL_P2P_BATCH + 1);
    expect_invalid(g, a, DDP_ERR_INVALID, "unknown collective kind");
    T_ASSERT(strcmp(ddp_coll_name(DDP_COLL_ALLTOALL), "all_to_all") == 0);
    hworld_free(&w);
    printf("validation: ok\n");
}

/* ---- mismatches --------------------------------------------------------------- */

/* Run c (with per-rank overrides applied by the caller through `alt`):
 * every rank must fail with DDP_ERR_MISMATCH mentioning text, and no
 * rank's recvbuf may have been written. */
typedef struct mm {
    a2a_case *c;
    int alt_rank;            /* this rank calls `alt` instead, if >= 0 */
    ddp_coll_args alt;
} mm;

static void mm_rank(hworld *w, int r, void *arg) {
    mm *m = arg;
    a2a_case *c = m->c;
    ddp_coll_args a = r == m->alt_rank ? m->alt : a2a_args(c, r);
    c->st[r] = hcoll(w, r, &a);
    ddp_copy_error(c->msg[r], sizeof c->msg[r]);
}

static void expect_mismatch(a2a_case *c, int n, mm *m, const char *text) {
    hworld w;
    hworld_init(&w, n, 1 << 16, 1 << 20);
    m->c = c;
    hrun(&w, mm_rank, m);
    const size_t es = ddp_dtype_size(c->t);
    for (int r = 0; r < n; r++) {
        if (c->st[r] != DDP_ERR_MISMATCH || !strstr(c->msg[r], text)) {
            fprintf(stderr, "rank %d: %s: \"%s\"; expected DDP_ERR_MISMATCH with \"%s\"\n", r,
                    ddp_status_name(c->st[r]), c->msg[r], text);
            exit(1);
        }
        for (size_t i = 0; i < c->rlen[r] * es; i++) T_ASSERT(c->recv[r][i] == SENTINEL);
    }
    hworld_free(&w);
}

static void test_mismatch(void) {
    a2a_case c = {.t = DDP_FLOAT32};
    for (int p = 0; p < 3; p++)
        for (int q = 0; q < 3; q++) c.counts[p][q] = (size_t)(1 + p + 2 * q);
    case_setup(&c, 3, 0);
    mm m = {.alt_rank = -1};
    /* rank 1 expects one element more from rank 2 than rank 2 sends */
    c.rc[1][2]++;
    expect_mismatch(&c, 3, &m, "all_to_all mismatch: rank 2 sends 5 elements to rank 1 but "
                               "rank 1 expects 6 elements from rank 2");
    c.rc[1][2]--;
    /* a rank whose own block disagrees with itself */
    c.rc[0][0] = 7;
    expect_mismatch(&c, 3, &m, "rank 0 sends 1 elements to rank 0 but rank 0 expects 7");
    c.rc[0][0] = 1;
    /* another dtype, and another collective */
    m.alt_rank = 1, m.alt = a2a_args(&c, 1), m.alt.dtype = DDP_INT32;
    expect_mismatch(&c, 3, &m, "rank 0 called all_to_all(float32) but rank 1 called "
                               "all_to_all(int32)");
    float x[10] = {0};
    m.alt_rank = 2;
    m.alt = (ddp_coll_args){.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT32, .op = DDP_SUM,
                            .count = 10, .buf = x};
    expect_mismatch(&c, 3, &m, "rank 0 called all_to_all(float32) but rank 2 called "
                               "all_reduce(count=10, float32, sum)");
    case_free(&c, 3);
    printf("mismatch detection: ok\n");
}

/* ---- a dying rank, and a deadline -------------------------------------------- */

static void test_dying_rank(void) {
    const int n = 4;
    hworld w;
    hworld_init(&w, n, 1 << 16, 1 << 20);
    /* rank 3's link to rank 0 dies after the header, the tables and 100 KB */
    w.links[3][0] = hwrap_new(w.links[3][0], 32 + 16 * n + 100000, 0);
    for (int r = 0; r < n; r++) w.g[r].links = w.links[r];
    a2a_case c = {.t = DDP_UINT8};
    for (int p = 0; p < n; p++)
        for (int q = 0; q < n; q++) c.counts[p][q] = 3u << 20;
    case_setup(&c, n, 0);
    int64_t t0 = ddp_now_ms();
    hrun(&w, a2a_rank, &c);
    int64_t ms = ddp_now_ms() - t0;
    for (int r = 0; r < n; r++) {
        ddp_status want = r == 3 ? DDP_ERR_ABORTED : DDP_ERR_CLOSED;
        if (c.st[r] != want || !strstr(c.msg[r], "all_to_all(uint8) on rank")) {
            fprintf(stderr, "rank %d: %s: %s\n", r, ddp_status_name(c.st[r]), c.msg[r]);
            exit(1);
        }
    }
    /* The others fail on whichever broken link they touch first (rank 3's,
     * or one a failed rank shut down): all "by the peer", some naming 3. */
    int named = 0;
    for (int r = 0; r < 3; r++) {
        T_ASSERT(strstr(c.msg[r], "by the peer"));
        named += strstr(c.msg[r], "rank 3 (socketpair)") != NULL;
    }
    T_ASSERT(named > 0);
    T_ASSERT(ms < H_DEADLINE_MS / 4);
    case_free(&c, n);
    hworld_free(&w);
    printf("dying rank: ok (%lld ms)\n", (long long)ms);
}

/* Rank 0 calls all_to_all alone and must give up at its deadline. */
static void lonely_rank(hworld *w, int r, void *arg) {
    a2a_case *c = arg;
    if (r == 1) return;
    ddp_coll_args a = a2a_args(c, 0);
    c->st[0] = hcoll_wait(w, 0, &a, ddp_wait_for(300, NULL));
    ddp_copy_error(c->msg[0], sizeof c->msg[0]);
}

static void test_timeout(void) {
    hworld w;
    hworld_init(&w, 2, 1 << 16, 1 << 20);
    a2a_case c = {.t = DDP_FLOAT64, .counts = {{1, 2}, {3, 4}}};
    case_setup(&c, 2, 0);
    int64_t t0 = ddp_now_ms();
    hrun(&w, lonely_rank, &c);
    int64_t ms = ddp_now_ms() - t0;
    T_STATUS(c.st[0], DDP_ERR_TIMEOUT);
    T_ASSERT(strstr(c.msg[0], "all_to_all(float64) on rank 0 of 2: timed out after"));
    T_ASSERT(strstr(c.msg[0], "rank 1 (socketpair)"));
    T_ASSERT(ms >= 290 && ms < H_DEADLINE_MS / 4);
    case_free(&c, 2);
    hworld_free(&w);
    printf("timeout: ok\n");
}

int main(void) {
    test_validate();
    test_random_splits();
    test_large();
    test_mismatch();
    test_dying_rank();
    test_timeout();
    printf("test_a2a: ok\n");
    return 0;
}
