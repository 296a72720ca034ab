/* test_coll_hier.c - the hierarchical algorithms (ddp_coll_hier.c) against a
 * double-precision reference, on threads as ranks with hosts made up by
 * giving each rank a host identity: equal and unequal hosts, contiguous and
 * interleaved rank layouts, counts that do not divide evenly, forced and
 * automatic choice. Checks which algorithm each call takes, that every rank
 * ends with the same bytes, that integer results are exact, and that a rank
 * forced onto another algorithm is a mismatch on every rank, not a wrong
 * answer.
 */
#define H_MAXR 8
#include <math.h>
#include "coll_harness.h"
#include "coll_values.h"
#include "ddp_coll_internal.h"

typedef struct layout {
    const char *name;
    int n;
    int host[H_MAXR];
    int uniform;
    int bcast_flat; /* the chain root n-1, 0, 1, ... enters each host once: auto keeps it */
} layout;

static const layout layouts[] = {
    {"2x2 contiguous", 4, {0, 0, 1, 1}, 1, 0},  /* 3,0,1,2: hosts 1,0,0,1 */
    {"2x2 interleaved", 4, {0, 1, 0, 1}, 1, 0},
    {"2x3", 6, {0, 0, 0, 1, 1, 1}, 1, 0},       /* hosts 1,0,0,0,1,1 */
    {"3x2", 6, {0, 0, 1, 1, 2, 2}, 1, 0},
    {"3x2 interleaved", 6, {0, 1, 2, 0, 1, 2}, 1, 0},
    {"2+1", 3, {0, 0, 1}, 0, 1},                /* 2,0,1: hosts 1,0,0 */
    {"1+2", 3, {0, 1, 1}, 0, 0},                /* hosts 1,0,1 */
    {"3+1+2", 6, {0, 0, 0, 1, 2, 2}, 0, 0},
    {"1 per host", 3, {0, 1, 2}, 1, 0},
};

/* Input element j of rank r: small integers, exact in every type used. */
static double input(int r, size_t j) { return (double)((int)((j * 7 + (size_t)r * 13) % 23) - 11); }

static double ref(ddp_redop op, int n, size_t j) {
    double acc = input(0, j);
    for (int r = 1; r < n; r++) {
        double v = input(r, j);
        if (op == DDP_MAX) acc = v > acc ? v : acc;
        else acc += v;
    }
    return op == DDP_AVG ? acc / n : acc;
}

typedef struct hcase {
    ddp_coll_kind kind;
    ddp_dtype t;
    ddp_redop op;
    size_t count;
} hcase;

static const hcase cases[] = {
    {DDP_COLL_ALLREDUCE, DDP_FLOAT32, DDP_SUM, 10007},
    {DDP_COLL_ALLREDUCE, DDP_FLOAT32, DDP_AVG, 4099},
    {DDP_COLL_ALLREDUCE, DDP_FLOAT64, DDP_MAX, 3},
    {DDP_COLL_ALLREDUCE, DDP_INT32, DDP_SUM, 777},
    {DDP_COLL_ALLREDUCE, DDP_BFLOAT16, DDP_SUM, 5000},
    {DDP_COLL_ALLREDUCE, DDP_INT64, DDP_AVG, 100},   /* wide: stays on the flat ring */
    {DDP_COLL_REDUCE_SCATTER, DDP_FLOAT32, DDP_SUM, 1001},
    {DDP_COLL_REDUCE_SCATTER, DDP_INT32, DDP_AVG, 5}, /* wide: flat */
    {DDP_COLL_REDUCE_SCATTER, DDP_FLOAT16, DDP_AVG, 333},
    {DDP_COLL_ALLGATHER, DDP_INT8, DDP_SUM, 4097},
    {DDP_COLL_ALLGATHER, DDP_FLOAT64, DDP_SUM, 1},
    {DDP_COLL_BROADCAST, DDP_INT32, DDP_SUM, 30011},
    {DDP_COLL_BROADCAST, DDP_BFLOAT16, DDP_SUM, 2},
};

/* Large enough for the pipelined all-reduce (ddp_coll_hier_pipe.c) to cut
 * into several pieces; run on fewer layouts (they take a while under ASan). */
static const hcase big_cases[] = {
    {DDP_COLL_ALLREDUCE, DDP_FLOAT32, DDP_SUM, (2u << 20) + 5},  /* 8 MiB: 8 pieces */
    {DDP_COLL_ALLREDUCE, DDP_BFLOAT16, DDP_AVG, (1u << 20) + 1}, /* 2 pieces */
};

typedef struct hctx {
    const layout *lay;
    int algo;
    const hcase *cases;
    size_t ncases;
} hctx;

static int expect_hier(const hctx *x, const hcase *c) {
    if (x->algo == DDP_ALGO_FLAT) return 0;
    if (c->t == DDP_INT64 || (c->t == DDP_INT32 && c->op == DDP_AVG)) return 0;
    int nh = 0;
    for (int r = 0; r < x->lay->n; r++) nh = x->lay->host[r] + 1 > nh ? x->lay->host[r] + 1 : nh;
    if (x->algo == DDP_ALGO_AUTO && nh == x->lay->n) return 0;
    if (x->algo == DDP_ALGO_AUTO && c->kind == DDP_COLL_BROADCAST && x->lay->bcast_flat) return 0;
    return c->kind == DDP_COLL_ALLREDUCE || c->kind == DDP_COLL_BROADCAST || x->lay->uniform;
}

static void check_value(const hcase *c, double got, double want, int n) {
    double tol = 0;
    if (c->t == DDP_FLOAT32) tol = 1e-5 * n * 11;
    if (c->t == DDP_BFLOAT16 || c->t == DDP_FLOAT16) tol = 0.02 * n * 11;
    if ((c->t == DDP_INT32 || c->t == DDP_INT64) && c->op == DDP_AVG) want = floor(want);
    if (fabs(got - want) > tol) {
        fprintf(stderr, "%s %s %s count %zu: got %g, want %g\n", ddp_coll_name(c->kind), ddp_dtype_name(c->t), ddp_redop_name(c->op), c->count, got, want);
        T_ASSERT(0);
    }
}

static void hier_rank(hworld *w, int r, void *arg) {
    const hctx *x = arg;
    const int n = w->n;
    for (size_t ci = 0; ci < x->ncases; ci++) {
        const hcase *c = &x->cases[ci];
        const size_t es = ddp_dtype_size(c->t), total = c->count * (size_t)n;
        char *in = malloc(total * es), *out = malloc(total * es);
        T_ASSERT(in && out);
        ddp_coll_args a = {.kind = c->kind, .dtype = c->t, .op = c->op, .count = c->count,
                           .buf = in, .sendbuf = in, .recvbuf = out, .root = n - 1};
        const int inplace = c->kind == DDP_COLL_ALLREDUCE || c->kind == DDP_COLL_BROADCAST;
        size_t nin = c->kind == DDP_COLL_ALLGATHER || inplace ? c->count : total;
        for (size_t j = 0; j < nin; j++) put(c->t, in, j, input(r, j));
        T_ASSERT(ddp_coll_hier_applies(&w->g[r], &a) == expect_hier(x, c));
        T_OK(hcoll(w, r, &a));
        const char *res = inplace ? in : out;
        size_t nres = c->kind == DDP_COLL_ALLGATHER ? total : c->count;
        for (size_t j = 0; j < nres; j++) {
            if (c->kind == DDP_COLL_ALLGATHER) {
                T_ASSERT(get(c->t, res, j) == input((int)(j / c->count), j % c->count));
            } else if (c->kind == DDP_COLL_BROADCAST) {
                T_ASSERT(get(c->t, res, j) == input(n - 1, j));
            } else {
                size_t jj = c->kind == DDP_COLL_REDUCE_SCATTER ? (size_t)r * c->count + j : j;
                check_value(c, get(c->t, res, j), ref(c->op, n, jj), n);
            }
        }
        if (c->kind == DDP_COLL_ALLREDUCE) { /* the same bytes on every rank */
            w->shared[r] = in;
            pthread_barrier_wait(&w->bar);
            for (int q = 0; q < n; q++) T_ASSERT(memcmp(in, w->shared[q], c->count * es) == 0);
            pthread_barrier_wait(&w->bar);
        }
        free(in);
        free(out);
    }
}

static void set_hosts(hworld *w, const layout *lay, const int *algo) {
    const char *ids[H_MAXR];
    static const char *names[] = {"host-a", "host-b", "host-c"};
    for (int r = 0; r < lay->n; r++) ids[r] = names[lay->host[r]];
    for (int r = 0; r < lay->n; r++) {
        T_OK(ddp_group_set_layout(&w->g[r], ids));
        T_ASSERT(w->g[r].hier_min_bytes == 1u << 20); /* PYDDP_HIER_MIN_BYTES's default */
        w->g[r].algo = algo[r];
        w->g[r].hier_min_bytes = 0; /* the small cases too (see test_threshold) */
    }
}

static void test_layouts(void) {
    for (size_t li = 0; li < sizeof layouts / sizeof *layouts; li++) {
        for (int algo = DDP_ALGO_AUTO; algo <= DDP_ALGO_HIER; algo++) {
            for (int chunk = 0; chunk < 2; chunk++) {
                const layout *lay = &layouts[li];
                hworld w;
                /* everything on the bandwidth path; small and large chunks */
                hworld_init(&w, lay->n, 0, chunk ? 1u << 20 : 1000);
                int algos[H_MAXR];
                for (int r = 0; r < lay->n; r++) algos[r] = algo;
                set_hosts(&w, lay, algos);
                hctx x = {lay, algo, cases, sizeof cases / sizeof *cases};
                hrun(&w, hier_rank, &x);
                for (int r = 0; r < lay->n; r++) ddp_group_free_layout(&w.g[r]);
                hworld_free(&w);
            }
        }
        printf("layout %s: ok\n", layouts[li].name);
    }
}

static void test_pipeline(void) {
    const size_t picks[] = {0, 4}; /* 2x2 contiguous, 3x2 interleaved */
    for (size_t i = 0; i < 2; i++) {
        const layout *lay = &layouts[picks[i]];
        hworld w;
        hworld_init(&w, lay->n, 0, 1u << 18);
        int algos[H_MAXR];
        for (int r = 0; r < lay->n; r++) algos[r] = DDP_ALGO_AUTO;
        set_hosts(&w, lay, algos);
        hctx x = {lay, DDP_ALGO_AUTO, big_cases, sizeof big_cases / sizeof *big_cases};
        hrun(&w, hier_rank, &x);
        for (int r = 0; r < lay->n; r++) ddp_group_free_layout(&w.g[r]);
        hworld_free(&w);
    }
    printf("pipelined all-reduce: ok\n");
}

/* A link between hosts that dies in the middle of a pipelined all-reduce:
 * every rank fails (the host stage included), within moments, not at the
 * deadline. */
static void dying_rank(hworld *w, int r, void *arg) {
    (void)arg;
    const size_t count = 2u << 20;
    float *buf = calloc(count, sizeof *buf);
    T_ASSERT(buf);
    ddp_coll_args a = {.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT32, .op = DDP_SUM,
                       .count = count, .buf = buf};
    int64_t t0 = ddp_now_ms();
    ddp_status st = hcoll_wait(w, r, &a, ddp_wait_for(20000, NULL));
    T_ASSERT(st != DDP_OK && st != DDP_ERR_TIMEOUT);
    T_ASSERT(ddp_now_ms() - t0 < 10000);
    free(buf);
}

static void test_dying_link(void) {
    hworld w;
    hworld_init(&w, 4, 0, 1u << 18);
    /* rank 1's end of its link to rank 3 (another host, same rail) dies after 3 MiB */
    w.links[1][3] = hwrap_new(w.links[1][3], 3u << 20, 0);
    int algos[4] = {DDP_ALGO_AUTO, DDP_ALGO_AUTO, DDP_ALGO_AUTO, DDP_ALGO_AUTO};
    set_hosts(&w, &layouts[0], algos);
    hrun(&w, dying_rank, NULL);
    for (int r = 0; r < 4; r++) ddp_group_free_layout(&w.g[r]);
    hworld_free(&w);
    printf("a link dying mid-pipeline fails every rank fast: ok\n");
}

/* Rank 0 forced flat while the others go hierarchical: every rank reports
 * the mismatch, naming both algorithms. */
static void mismatch_rank(hworld *w, int r, void *arg) {
    (void)arg;
    float buf[1000];
    for (int i = 0; i < 1000; i++) buf[i] = (float)r;
    ddp_coll_args a = {.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT32, .op = DDP_SUM,
                       .count = 1000, .buf = buf};
    T_STATUS(hcoll(w, r, &a), DDP_ERR_MISMATCH);
    if (!strstr(ddp_last_error(), "PYDDP_ALGO") || !strstr(ddp_last_error(), "hierarchical")) {
        fprintf(stderr, "rank %d: %s\n", r, ddp_last_error());
        T_ASSERT(0);
    }
}

static void test_mismatch(void) {
    hworld w;
    hworld_init(&w, 4, 0, 1u << 16);
    const int algos[4] = {DDP_ALGO_FLAT, DDP_ALGO_AUTO, DDP_ALGO_AUTO, DDP_ALGO_HIER};
    set_hosts(&w, &layouts[0], algos);
    hrun(&w, mismatch_rank, NULL);
    for (int r = 0; r < 4; r++) ddp_group_free_layout(&w.g[r]);
    hworld_free(&w);
    printf("algorithm mismatch: ok\n");
}

/* Under auto, messages below PYDDP_HIER_MIN_BYTES keep the flat ring; a
 * forced choice ignores the threshold. */
static void test_threshold(void) {
    hworld w;
    hworld_init(&w, 4, 0, 1u << 16);
    int algos[4] = {DDP_ALGO_AUTO, DDP_ALGO_AUTO, DDP_ALGO_AUTO, DDP_ALGO_AUTO};
    set_hosts(&w, &layouts[0], algos);
    ddp_group *g = &w.g[0];
    g->hier_min_bytes = 1u << 20;
    float one;
    ddp_coll_args small = {.kind = DDP_COLL_ALLREDUCE, .dtype = DDP_FLOAT32, .count = 1000,
                           .buf = &one};
    ddp_coll_args big = small;
    big.count = 1u << 18; /* exactly 1 MiB */
    ddp_coll_args rs = small;
    rs.kind = DDP_COLL_REDUCE_SCATTER; /* 4 ranks x 64K floats: the whole input counts */
    rs.count = 1u << 16;
    ddp_coll_args bc = small;
    bc.kind = DDP_COLL_BROADCAST; /* one buffer of count elements: 1 MiB - 4 B stays flat */
    bc.count = (1u << 18) - 1;
    bc.root = 1; /* the flat chain 1,2,3,0 crosses twice (see test_broadcast_choice) */
    T_ASSERT(!ddp_coll_hier_applies(g, &small));
    T_ASSERT(ddp_coll_hier_applies(g, &big));
    T_ASSERT(ddp_coll_hier_applies(g, &rs));
    T_ASSERT(!ddp_coll_hier_applies(g, &bc));
    bc.count++;
    T_ASSERT(ddp_coll_hier_applies(g, &bc));
    g->algo = DDP_ALGO_HIER;
    T_ASSERT(ddp_coll_hier_applies(g, &small));
    g->algo = DDP_ALGO_FLAT;
    T_ASSERT(!ddp_coll_hier_applies(g, &big));
    for (int r = 0; r < 4; r++) ddp_group_free_layout(&w.g[r]);
    hworld_free(&w);
    printf("size threshold: ok\n");
}

/* Under auto, a large broadcast takes the host-order chain only where the
 * flat chain from the root (root, root+1, ... wrapping) crosses between
 * hosts more than nhosts-1 times; expectations worked out by hand. */
static void test_broadcast_choice(void) {
    static const struct {
        int n, host[H_MAXR], hier[H_MAXR]; /* hier[root]: 1 when auto takes the host-order chain */
    } t[] = {
        {4, {0, 0, 1, 1}, {0, 1, 0, 1}},             /* root 1: 1,2,3,0 = hosts 0,1,1,0 */
        {4, {0, 1, 0, 1}, {1, 1, 1, 1}},             /* every hop crosses */
        {8, {0, 0, 0, 0, 1, 1, 1, 1}, {0, 1, 1, 1, 0, 1, 1, 1}},
        {4, {0, 1, 1, 0}, {1, 0, 1, 0}},             /* root 1: 1,2,3,0 = hosts 1,1,0,0 */
        {6, {0, 0, 1, 1, 2, 2}, {0, 1, 0, 1, 0, 1}}, /* root 2: hosts 1,1,2,2,0,0 */
    };
    for (size_t i = 0; i < sizeof t / sizeof *t; i++) {
        const int n = t[i].n;
        hworld w;
        hworld_init(&w, n, 0, 1u << 16);
        const char *ids[H_MAXR];
        static const char *names[] = {"host-a", "host-b", "host-c"};
        for (int r = 0; r < n; r++) ids[r] = names[t[i].host[r]];
        T_OK(ddp_group_set_layout(&w.g[0], ids));
        ddp_group *g = &w.g[0];
        float one;
        ddp_coll_args bc = {.kind = DDP_COLL_BROADCAST, .dtype = DDP_FLOAT32,
                            .count = 1u << 20, .buf = &one};
        for (int root = 0; root < n; root++) {
            bc.root = root;
            g->algo = DDP_ALGO_AUTO;
            if (ddp_coll_hier_applies(g, &bc) != t[i].hier[root]) {
                fprintf(stderr, "layout %zu root %d: auto chose wrongly\n", i, root);
                T_ASSERT(0);
            }
            g->algo = DDP_ALGO_HIER; /* forced: always */
            T_ASSERT(ddp_coll_hier_applies(g, &bc));
        }
        ddp_group_free_layout(&w.g[0]);
        hworld_free(&w);
    }
    printf("broadcast chain choice: ok\n");
}

int main(void) {
    test_threshold();
    test_broadcast_choice();
    test_layouts();
    test_pipeline();
    test_dying_link();
    test_mismatch();
    printf("test_coll_hier: ok\n");
    return 0;
}
