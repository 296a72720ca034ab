/* test_coll.c - every collective, dtype and op on worlds of 1 to 4 thread
 * ranks, on both the latency path and the chunked bandwidth path, checked
 * element by element against a reference computed here in double precision
 * (exact for integers); plus in-place variants, counts 0, 1, 7 (not
 * divisible by the world size), large buffers, float32 accumulation of
 * half types, and bit-identical all-reduce results on every rank.
 * Failure behaviour (mismatch, closed links, timeout, abort, validation)
 * is in test_coll_fail.c. */
#include <math.h>
#include <stdlib.h>

#include "coll_harness.h"
#include "coll_values.h"
#include "ddp_coll_internal.h"
#include "ddp_dtype.h"

static int is_float(ddp_dtype t) { return t <= DDP_FLOAT64; }

static int is_reduction(ddp_coll_kind k) {
    return k == DDP_COLL_ALLREDUCE || k == DDP_COLL_REDUCE || k == DDP_COLL_REDUCE_SCATTER;
}

/* Input element j of rank q: values in -3..3 (0..6 for uint8), so that any
 * sum or product over 4 ranks is exact in every dtype (uint8 products wrap
 * modulo 256 in both the kernels and the reference). */
static double val(int q, size_t j, ddp_dtype t) {
    int v = (int)((size_t)q * 5 + j * 3 + 1) % 7 - 3;
    if (is_float(t)) return v * 0.5;
    if (t == DDP_UINT8) return v + 3;
    if (t == DDP_BOOL) return v > 0;
    return v;
}

/* The reduction of element j over n ranks, as dtype t stores it. */
static double ref_reduce(ddp_dtype t, ddp_redop op, int n, size_t j) {
    double acc = val(0, j, t);
    for (int q = 1; q < n; q++) {
        double x = val(q, j, t);
        if (t == DDP_BOOL) acc = (op == DDP_SUM || op == DDP_MAX) ? (acc || x) : (acc && x);
        else if (op == DDP_SUM || op == DDP_AVG) acc += x;
        else if (op == DDP_PRODUCT) acc *= x;
        else if (op == DDP_MIN) acc = fmin(acc, x);
        else acc = fmax(acc, x);
    }
    if (op == DDP_AVG) acc = is_float(t) ? acc / n : floor(acc / n); /* integers: floor */
    if (t == DDP_UINT8) acc = (uint8_t)(int64_t)acc;
    return acc;
}

/* Exact for integers; for floats within the dtype's rounding (only AVG
 * over 3 ranks is inexact with these inputs). */
static void expect(ddp_dtype t, const void *buf, size_t i, double want, const char *what) {
    double got = get(t, buf, i);
    double tol = t == DDP_FLOAT16 ? 1e-3 : t == DDP_BFLOAT16 ? 8e-3
               : t == DDP_FLOAT32 ? 1e-6 : t == DDP_FLOAT64 ? 1e-12 : 0;
    if (fabs(got - want) > tol * fmax(1.0, fabs(want))) {
        fprintf(stderr, "%s, %s: element %zu is %.9g, expected %.9g\n", what,
                ddp_dtype_name(t), i, got, want);
        exit(1);
    }
}

typedef struct ccase {
    ddp_coll_kind kind;
    ddp_dtype t;
    ddp_redop op;
    size_t count;
    int root;    /* root, or the peer for send/recv */
    int inplace; /* use the in-place form of the size-block kinds */
} ccase;

/* Run one collective on rank r and check its result. */
static void run_case(hworld *w, int r, const ccase *c) {
    const int n = w->n;
    const size_t es = ddp_dtype_size(c->t), cnt = c->count, big = cnt * (size_t)n;
    const int big_send = c->kind == DDP_COLL_SCATTER || c->kind == DDP_COLL_REDUCE_SCATTER;
    const int big_recv = c->kind == DDP_COLL_ALLGATHER || c->kind == DDP_COLL_GATHER;
    const size_t alen = big_send ? big : cnt, blen = big_recv ? big : cnt;
    char *a = calloc(alen + 1, es), *b = calloc(blen + 1, es);
    T_ASSERT(a && b);
    for (size_t j = 0; j < alen; j++) put(c->t, a, j, val(r, j, c->t));
    ddp_coll_args args = {.kind = c->kind, .dtype = c->t, .op = c->op, .root = c->root,
                          .count = cnt, .buf = a, .sendbuf = a, .recvbuf = b};
    const int at_root = r == c->root;
    if (c->inplace && big_recv && (c->kind == DDP_COLL_ALLGATHER || at_root)) {
        for (size_t i = 0; i < cnt; i++) put(c->t, b, (size_t)r * cnt + i, val(r, i, c->t));
        args.sendbuf = b + (size_t)r * cnt * es;
    }
    if (c->inplace && big_send && (c->kind == DDP_COLL_REDUCE_SCATTER || at_root))
        args.recvbuf = a + (size_t)r * cnt * es;
    T_OK(hcoll(w, r, &args));

    char what[200];
    snprintf(what, sizeof what, "rank %d of %d: %s(count=%zu, op=%s, root=%d, inplace=%d)", r, n,
             ddp_coll_name(c->kind), cnt, ddp_redop_name(c->op), c->root, c->inplace);
    const char *out = args.recvbuf;
    for (size_t i = 0; i < cnt; i++) {
        switch (c->kind) {
        case DDP_COLL_ALLREDUCE: expect(c->t, a, i, ref_reduce(c->t, c->op, n, i), what); break;
        case DDP_COLL_REDUCE:
            expect(c->t, a, i, at_root ? ref_reduce(c->t, c->op, n, i) : val(r, i, c->t), what);
            break;
        case DDP_COLL_REDUCE_SCATTER:
            expect(c->t, out, i, ref_reduce(c->t, c->op, n, (size_t)r * cnt + i), what);
            break;
        case DDP_COLL_BROADCAST: expect(c->t, a, i, val(c->root, i, c->t), what); break;
        case DDP_COLL_ALLGATHER: case DDP_COLL_GATHER:
            if (c->kind == DDP_COLL_GATHER && !at_root) break;
            for (int p = 0; p < n; p++) expect(c->t, b, (size_t)p * cnt + i, val(p, i, c->t), what);
            break;
        case DDP_COLL_SCATTER:
            expect(c->t, out, i, val(c->root, (size_t)r * cnt + i, c->t), what);
            break;
        case DDP_COLL_SEND: expect(c->t, a, i, val(r, i, c->t), what); break;
        case DDP_COLL_RECV: expect(c->t, a, i, val(c->root, i, c->t), what); break;
        default: break;
        }
    }
    free(a);
    free(b);
}

/* ---- the matrix ------------------------------------------------------------- */

static const ddp_coll_kind matrix_kinds[] = {
    DDP_COLL_ALLREDUCE, DDP_COLL_SEND, DDP_COLL_REDUCE, DDP_COLL_REDUCE_SCATTER,
    DDP_COLL_BROADCAST, DDP_COLL_ALLGATHER, DDP_COLL_GATHER, DDP_COLL_SCATTER,
};
static const ddp_dtype movers[] = {DDP_INT8, DDP_FLOAT16, DDP_FLOAT32, DDP_FLOAT64};
static const size_t matrix_counts[] = {0, 1, 7, 1000};

/* Every rank walks the same sequence of calls. Send/recv pairs rank root
 * with root+1; the other ranks skip them (and the sequence numbers of the
 * later collectives must still agree). */
static void matrix_rank(hworld *w, int r, void *arg) {
    (void)arg;
    const int n = w->n;
    for (size_t k = 0; k < sizeof matrix_kinds / sizeof *matrix_kinds; k++) {
        const ddp_coll_kind kind = matrix_kinds[k];
        const int red = is_reduction(kind);
        const int blocked = kind == DDP_COLL_ALLGATHER || kind == DDP_COLL_GATHER ||
                            kind == DDP_COLL_SCATTER || kind == DDP_COLL_REDUCE_SCATTER;
        const int ntypes = red ? DDP_DTYPE_COUNT : (int)(sizeof movers / sizeof *movers);
        for (int ti = 0; ti < ntypes; ti++) {
            const ddp_dtype t = red ? (ddp_dtype)ti : movers[ti];
            for (int op = 0; op < (red ? DDP_REDOP_COUNT : 1); op++) {
                if (red && ddp_redop_check(t, (ddp_redop)op) != DDP_OK) continue;
                for (size_t ci = 0; ci < sizeof matrix_counts / sizeof *matrix_counts; ci++) {
                    for (int inplace = 0; inplace <= blocked; inplace++) {
                        ccase c = {kind, t, (ddp_redop)op, matrix_counts[ci],
                                   (int)((ci + (size_t)op + (size_t)ti) % (size_t)n), inplace};
                        if (kind == DDP_COLL_SEND) {
                            int src = c.root, dst = (src + 1) % n;
                            if (n == 1 || (r != src && r != dst)) continue;
                            c.kind = r == src ? DDP_COLL_SEND : DDP_COLL_RECV;
                            c.root = r == src ? dst : src;
                        }
                        run_case(w, r, &c);
                    }
                }
            }
        }
    }
}

static void test_matrix(void) {
    for (int n = 1; n <= H_MAXR; n++) {
        /* latency path for everything, then the ring/chain path in tiny chunks */
        const size_t paths[2][2] = {{1u << 20, 1u << 20}, {0, 64}};
        for (int p = 0; p < 2; p++) {
            hworld w;
            hworld_init(&w, n, paths[p][0], paths[p][1]);
            hrun(&w, matrix_rank, NULL);
            for (int r = 0; r < n; r++) T_ASSERT(w.g[r].seq == w.g[0].seq);
            hworld_free(&w);
        }
        printf("matrix: %d rank(s) ok\n", n);
    }
}

/* ---- large buffers ----------------------------------------------------------- */

static void large_rank(hworld *w, int r, void *arg) {
    (void)arg;
    static const ccase cases[] = {
        {DDP_COLL_ALLREDUCE, DDP_FLOAT32, DDP_SUM, 1u << 20, 0, 0},
        {DDP_COLL_ALLREDUCE, DDP_BFLOAT16, DDP_AVG, (1u << 20) + 3, 0, 0},
        {DDP_COLL_ALLREDUCE, DDP_INT64, DDP_MAX, 1u << 18, 0, 0},
        {DDP_COLL_REDUCE_SCATTER, DDP_FLOAT64, DDP_SUM, (1u << 16) + 1, 0, 0},
        {DDP_COLL_REDUCE_SCATTER, DDP_FLOAT16, DDP_PRODUCT, 1u << 16, 0, 1},
        {DDP_COLL_ALLGATHER, DDP_INT8, DDP_SUM, (1u << 18) + 5, 0, 1},
        {DDP_COLL_BROADCAST, DDP_FLOAT32, DDP_SUM, 1u << 20, 1, 0},
        {DDP_COLL_REDUCE, DDP_FLOAT16, DDP_SUM, 1u << 18, 2, 0},
        {DDP_COLL_REDUCE, DDP_INT32, DDP_MIN, 1u << 18, 0, 0},
        {DDP_COLL_GATHER, DDP_INT32, DDP_SUM, 1u << 16, 1, 0},
        {DDP_COLL_SCATTER, DDP_INT32, DDP_SUM, 1u << 16, 2, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) run_case(w, r, &cases[i]);
}

static void test_large(void) {
    for (int n = 3; n <= 4; n++) {
        hworld w;
        hworld_init(&w, n, 64 << 10, 256 << 10);
        hrun(&w, large_rank, NULL);
        hworld_free(&w);
    }
    printf("large buffers: ok\n");
}

/* ---- float32 accumulation and identical results --------------------------------- */

/* 2048 + 1 + 1 + 1: per-step float16 rounding of the whole sum would give
 * 2048 (and bfloat16 256 + 3 would give 256); float32 accumulation gives
 * 2051 -> 2052 (259 -> 260). The latency path and the chain reduce sum all
 * contributions in float32. The ring (bandwidth path of all_reduce and
 * reduce_scatter) sends partial sums in the element type: block b starts at
 * rank b+1 and gathers ranks b+2, ..., b in ring order, each step adding in
 * float32 and rounding once, so the expected value is that fold. */
static uint16_t ring_fold(ddp_dtype dt, int n, int b, float big) {
    float acc = 0;
    for (int s = 0; s < n; s++) {
        const int q = (b + 1 + s) % n;
        const float v = q == 0 ? big : 1.0f;
        acc = s == 0 ? v : acc + v;
        acc = dt == DDP_FLOAT16 ? ddp_half_to_float(ddp_float_to_half(acc))
                                : ddp_bf16_to_float(ddp_float_to_bf16(acc));
    }
    return dt == DDP_FLOAT16 ? ddp_float_to_half(acc) : ddp_float_to_bf16(acc);
}

static void half_acc_rank(hworld *w, int r, void *arg) {
    const int ring = *(const int *)arg;
    for (int t = DDP_FLOAT16; t <= DDP_BFLOAT16; t++) {
        const ddp_dtype dt = (ddp_dtype)t;
        const float big = dt == DDP_FLOAT16 ? 2048.0f : 256.0f, want = big + (float)(w->n - 1);
        const ddp_coll_kind kinds[] = {DDP_COLL_ALLREDUCE, DDP_COLL_REDUCE, DDP_COLL_REDUCE_SCATTER};
        for (size_t k = 0; k < 3; k++) {
            enum { CNT = 40 };
            uint16_t in[CNT * H_MAXR], out[CNT];
            for (int i = 0; i < CNT * w->n; i++) put(dt, in, (size_t)i, r == 0 ? big : 1.0);
            ddp_coll_args a = {.kind = kinds[k], .dtype = dt, .op = DDP_SUM, .root = 0,
                               .count = CNT, .buf = in, .sendbuf = in, .recvbuf = out};
            T_OK(hcoll(w, r, &a));
            const uint16_t *res = kinds[k] == DDP_COLL_REDUCE_SCATTER ? out : in;
            if (kinds[k] == DDP_COLL_REDUCE && r != 0) continue;
            uint16_t expect_bits = dt == DDP_FLOAT16 ? ddp_float_to_half(want) : ddp_float_to_bf16(want);
            T_ASSERT(expect_bits != (dt == DDP_FLOAT16 ? ddp_float_to_half(big) : ddp_float_to_bf16(big)));
            for (int i = 0; i < CNT; i++) {
                if (ring && kinds[k] != DDP_COLL_REDUCE) {
                    /* all_reduce: element i is in block i's ring block;
                     * reduce_scatter: this rank's output is block r */
                    size_t off, len;
                    int b = r;
                    for (int q = 0; kinds[k] == DDP_COLL_ALLREDUCE && q < w->n; q++) {
                        ddp_coll_block(CNT, w->n, q, &off, &len);
                        if ((size_t)i >= off && (size_t)i < off + len) b = q;
                    }
                    T_ASSERT(res[i] == ring_fold(dt, w->n, b, big));
                } else {
                    T_ASSERT(res[i] == expect_bits);
                }
            }
        }
    }
}

/* Inexact float data: every rank must hold the very same bytes. */
static void identity_rank(hworld *w, int r, void *arg) {
    (void)arg;
    static const ddp_dtype types[] = {DDP_FLOAT32, DDP_FLOAT16, DDP_BFLOAT16, DDP_FLOAT64};
    enum { CNT = 3001 };
    for (size_t ti = 0; ti < 4; ti++) {
        for (int op = DDP_SUM; op <= DDP_AVG; op++) {
            const ddp_dtype t = types[ti];
            const size_t es = ddp_dtype_size(t);
            char *buf = malloc(CNT * es);
            T_ASSERT(buf);
            for (size_t j = 0; j < CNT; j++) put(t, buf, j, sin((double)(r * CNT + j)) * 100);
            ddp_coll_args a = {.kind = DDP_COLL_ALLREDUCE, .dtype = t, .op = (ddp_redop)op,
                               .count = CNT, .buf = buf};
            T_OK(hcoll(w, r, &a));
            for (size_t j = 0; j < CNT; j++) { /* against double, within rounding */
                double sum = 0, mag = 0;
                for (int q = 0; q < w->n; q++) {
                    char one[8];
                    put(t, one, 0, sin((double)(q * CNT + j)) * 100);
                    sum += get(t, one, 0);
                    mag += fabs(get(t, one, 0));
                }
                if (op == DDP_AVG) sum /= w->n, mag /= w->n;
                double tol = t == DDP_FLOAT64 ? 1e-13 : t == DDP_FLOAT32 ? 1e-6 : 1e-2;
                T_ASSERT(fabs(get(t, buf, j) - sum) <= tol * (mag + 1));
            }
            w->shared[r] = buf;
            pthread_barrier_wait(&w->bar);
            for (int q = 0; q < w->n; q++) T_ASSERT(memcmp(buf, w->shared[q], CNT * es) == 0);
            pthread_barrier_wait(&w->bar);
            free(buf);
        }
    }
}

static void test_accumulation_and_identity(void) {
    const size_t paths[3][2] = {{1u << 20, 1u << 20}, {0, 64}, {0, 1u << 20}};
    for (int p = 0; p < 3; p++) {
        for (int n = 3; n <= 4; n++) {
            hworld w;
            hworld_init(&w, n, paths[p][0], paths[p][1]);
            int ring = p > 0;
            if (n == 4) hrun(&w, half_acc_rank, &ring);
            hrun(&w, identity_rank, NULL);
            hworld_free(&w);
        }
    }
    printf("half-precision accumulation, identical results: ok\n");
}

int main(void) {
    test_matrix();
    test_large();
    test_accumulation_and_identity();
    printf("test_coll: ok\n");
    return 0;
}
