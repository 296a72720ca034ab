/* test_dtype_cast.c - unit tests of DDP's reduce dtype: the narrowing and
 * widening casts (ddp_dtype_cast.c) against a brute-force nearest-value
 * reference, and the reducer with a reduce dtype (planning in the reduce
 * dtype's bytes, narrowed copy-in divided by the world size, SUM on the
 * wire, widened copy-out) with two simulated ranks. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp_dtype_cast.h"
#include "ddp_reducer.h"
#include "testutil.h"

static double narrow_value(ddp_dtype t, uint16_t h) {
    return t == DDP_FLOAT16 ? (double)ddp_half_to_float(h) : (double)ddp_bf16_to_float(h);
}

/* h is the correctly rounded (nearest, ties to even) value of x / w in t:
 * its neighbours are not nearer, and a tie goes to the even one. Distances
 * are compared as |x - w*c|, exact in double for the candidates near x/w. */
static void check_nearest(ddp_dtype t, double x, int w, uint16_t h) {
    double v = narrow_value(t, h);
    if (isnan(x)) { T_ASSERT(isnan(v)); return; }
    if (isinf(v)) {   /* overflow: x / w is at least the halfway point to 2^(emax+1) */
        double maxv = narrow_value(t, t == DDP_FLOAT16 ? 0x7BFF : 0x7F7F);
        double next = t == DDP_FLOAT16 ? 65536.0 : ldexp(1.0, 128);
        T_ASSERT(fabs(x) / w >= (maxv + next) / 2 * (1 - 1e-15));
        return;
    }
    double d = fabs(x - w * v);
    for (int s = -1; s <= 1; s += 2) {
        uint16_t n = (uint16_t)(h + s);
        if ((h & 0x7FFF) == 0 && s < 0) n = (uint16_t)((h ^ 0x8000) + 1);  /* across zero */
        double nv = narrow_value(t, n);
        if (isinf(nv) || isnan(nv)) continue;
        double dn = fabs(x - w * nv);
        if (dn < d) {
            fprintf(stderr, "%s: %.17g / %d gave %.17g but %.17g is nearer\n",
                    ddp_dtype_name(t), x, w, v, nv);
            T_ASSERT(0);
        }
        if (dn == d) T_ASSERT((h & 1) == 0);   /* a tie: the even one */
    }
}

static void test_narrow_random(void) {
    enum { N = 20000 };
    float *f = malloc(N * sizeof *f);
    double *d = malloc(N * sizeof *d);
    uint16_t *h = malloc(N * sizeof *h);
    srand(7);
    const ddp_dtype ts[2] = {DDP_FLOAT16, DDP_BFLOAT16};
    for (int w = 1; w <= 7; w++)
        for (int k = 0; k < 2; k++) {
            for (int i = 0; i < N; i++) {
                /* random bits of a float with an exponent near the narrow
                 * range, plus exact ties (w * a tie of the narrow type) */
                uint32_t u = ((uint32_t)rand() << 16) ^ (uint32_t)rand();
                int e = (ts[k] == DDP_FLOAT16 ? 127 - 20 : 127 - 40) + rand() % 40;
                u = (u & 0x807FFFFFu) | ((uint32_t)e << 23);
                memcpy(&f[i], &u, sizeof u);
                if (i % 4 == 0) {    /* a tie: value with one bit past the narrow mantissa */
                    int mbits = ts[k] == DDP_FLOAT16 ? 10 : 7;
                    f[i] = (float)(ldexp(floor(ldexp(1.0 + (rand() % 1000) / 1000.0, mbits)) +
                                         0.5, -mbits) * w);
                }
                d[i] = (double)f[i] * (1.0 + (i % 3 == 1 ? 0x1p-40 : 0.0));
            }
            ddp_cast_narrow(ts[k], h, DDP_FLOAT32, f, N, w);
            for (int i = 0; i < N; i++) check_nearest(ts[k], f[i], w, h[i]);
            ddp_cast_narrow(ts[k], h, DDP_FLOAT64, d, N, w);
            for (int i = 0; i < N; i++) check_nearest(ts[k], d[i], w, h[i]);
        }
    free(f);
    free(d);
    free(h);
}

static void test_narrow_special(void) {
    const float f[] = {0.0f, -0.0f, 65504.0f, 65520.0f, -70000.0f, INFINITY, NAN, 1e-8f,
                       3.0e38f, 3.4e38f};
    uint16_t h[10], b[10];
    ddp_cast_narrow(DDP_FLOAT16, h, DDP_FLOAT32, f, 10, 1);
    ddp_cast_narrow(DDP_BFLOAT16, b, DDP_FLOAT32, f, 10, 1);
    T_ASSERT(h[0] == 0 && h[1] == 0x8000 && h[2] == 0x7BFF);
    T_ASSERT(h[3] == 0x7C00 && h[4] == 0xFC00 && h[5] == 0x7C00);   /* 65520 ties to Inf */
    T_ASSERT((h[6] & 0x7C00) == 0x7C00 && (h[6] & 0x3FF) != 0);     /* NaN */
    T_ASSERT(h[7] == 0);          /* 1e-8 is below half the smallest float16 subnormal */
    T_ASSERT(b[8] != 0x7F80 && b[9] == 0x7F80);   /* 3.4e38 rounds to bfloat16 Inf */
    /* Dividing first keeps a float16 average finite where the sum would not be. */
    const float big[2] = {60000.0f, 60000.0f};
    ddp_cast_narrow(DDP_FLOAT16, h, DDP_FLOAT32, big, 2, 2);
    T_ASSERT(ddp_half_to_float(h[0]) == 30000.0f);
    const double dbl[3] = {1e300, -1e-300, 0.1};
    ddp_cast_narrow(DDP_BFLOAT16, b, DDP_FLOAT64, dbl, 3, 3);
    T_ASSERT(b[0] == 0x7F80 && b[1] == 0x8000 && b[2] == ddp_float_to_bf16(0.1f / 3));
}

static void test_widen(void) {
    uint16_t h[4] = {0x3C00, 0xC000, 0x0001, 0x7C00};   /* 1, -2, 2^-24, Inf */
    float f[4];
    double d[4];
    ddp_cast_widen(DDP_FLOAT32, f, DDP_FLOAT16, h, 4);
    ddp_cast_widen(DDP_FLOAT64, d, DDP_FLOAT16, h, 4);
    T_ASSERT(f[0] == 1.0f && f[1] == -2.0f && f[2] == 0x1p-24f && isinf(f[3]));
    T_ASSERT(d[0] == 1.0 && d[1] == -2.0 && d[2] == 0x1p-24 && isinf(d[3]));
    uint16_t b[2] = {0x3F80, 0x4049};    /* 1, 3.140625 */
    ddp_cast_widen(DDP_FLOAT64, d, DDP_BFLOAT16, b, 2);
    T_ASSERT(d[0] == 1.0 && d[1] == 3.140625);
    T_ASSERT(ddp_cast_narrows(DDP_FLOAT32, DDP_BFLOAT16) && ddp_cast_narrows(DDP_FLOAT64,
                                                                              DDP_FLOAT16));
    T_ASSERT(!ddp_cast_narrows(DDP_FLOAT16, DDP_BFLOAT16) &&
             !ddp_cast_narrows(DDP_FLOAT32, DDP_FLOAT32) &&
             !ddp_cast_narrows(DDP_INT32, DDP_FLOAT16));
}

static void test_plan_reduce_dtype(void) {
    /* float32 x 256 (1 KiB, 512 B as bfloat16), float64 x 64, float16 x 100:
     * with caps of 512 B every float32 parameter fills a bfloat16 bucket. */
    ddp_plan_param ps[] = {{256, DDP_FLOAT32, -1}, {256, DDP_FLOAT32, -1},
                           {64, DDP_FLOAT64, -1}, {100, DDP_FLOAT16, -1}};
    ddp_plan p;
    T_OK(ddp_plan_buckets_as(ps, 4, NULL, 512, 512, DDP_BFLOAT16, &p));
    T_ASSERT(p.nbuckets == 4);
    for (size_t b = 0; b < p.nbuckets; b++) {
        size_t i = p.members[p.bucket_begin[b]];
        T_ASSERT(p.bucket_grad_dtype[b] == ps[i].dtype);
        T_ASSERT(p.bucket_dtype[b] == (ps[i].dtype == DDP_FLOAT16 ? DDP_FLOAT16 : DDP_BFLOAT16));
    }
    ddp_plan_free(&p);
    /* Without a reduce dtype, 1 KiB float32 parameters still fill 512 B buckets
     * one each, and bucket dtypes are the parameters'. */
    T_OK(ddp_plan_buckets_as(ps, 4, NULL, 2048, 2048, DDP_REDUCE_NATIVE, &p));
    T_ASSERT(p.nbuckets == 3);   /* float32 pair (2 KiB), float64, float16 */
    ddp_plan_free(&p);
    T_OK(ddp_plan_buckets_as(ps, 4, NULL, 1024, 1024, DDP_FLOAT16, &p));
    T_ASSERT(p.nbuckets == 3);   /* the float32 pair is 1 KiB as float16: one bucket */
    ddp_plan_free(&p);
    T_STATUS(ddp_plan_buckets_as(ps, 4, NULL, 512, 512, DDP_FLOAT32, &p), DDP_ERR_INVALID);
    ddp_plan_param ints[] = {{4, DDP_FLOAT32, -1}, {4, DDP_INT64, -1}};
    T_STATUS(ddp_plan_buckets_as(ints, 2, NULL, 512, 512, DDP_FLOAT16, &p), DDP_ERR_TYPE);
    T_OK(ddp_plan_buckets_as(ints, 2, NULL, 512, 512, DDP_REDUCE_NATIVE, &p));
    ddp_plan_free(&p);
}

/* Two ranks in one thread: the second launch of a bucket averages both
 * buffers as the CPU transport does for bfloat16 (add in float32, round,
 * divide by 2 in float32, round). */
typedef struct pair_op { void *buf[2]; size_t count; ddp_dtype t; ddp_redop op; int n; } pair_op;
typedef struct pair_world { pair_op ops[8]; int nlaunch[2]; } pair_world;
typedef struct pair_rank { pair_world *w; int rank; } pair_rank;

static ddp_status pair_launch(void *ctx, void *buf, size_t count, ddp_dtype t, ddp_redop op,
                              void **handle) {
    pair_rank *pr = ctx;
    pair_op *o = &pr->w->ops[pr->w->nlaunch[pr->rank]++];
    o->buf[pr->rank] = buf;
    o->count = count;
    o->t = t;
    o->op = op;
    if (++o->n == 2) {
        /* bfloat16 buckets hold the gradients themselves and are averaged */
        T_ASSERT(t == DDP_BFLOAT16 && op == DDP_AVG);
        for (size_t e = 0; e < count; e++) {
            float s = ddp_bf16_to_float(((uint16_t *)o->buf[0])[e]) +
                      ddp_bf16_to_float(((uint16_t *)o->buf[1])[e]);
            uint16_t avg = ddp_float_to_bf16(ddp_bf16_to_float(ddp_float_to_bf16(s)) / 2);
            ((uint16_t *)o->buf[0])[e] = ((uint16_t *)o->buf[1])[e] = avg;
        }
    }
    *handle = o;
    return DDP_OK;
}

static ddp_status pair_wait(void *ctx, void *handle, ddp_wait w, int *done) {
    (void)ctx;
    (void)w;
    *done = ((pair_op *)handle)->n == 2;
    return *done ? DDP_OK : DDP_ERR_TIMEOUT;
}

static void pair_release(void *ctx, void *handle) { (void)ctx; (void)handle; }

static const ddp_reducer_ops pair_ops = {pair_launch, pair_wait, pair_release};

static void test_reducer_reduce_dtype(void) {
    enum { NA = 300, NB = 50 };
    pair_world w;
    memset(&w, 0, sizeof w);
    pair_rank ctx[2] = {{&w, 0}, {&w, 1}};
    ddp_reducer *r[2];
    uint16_t *mem[2];
    float ga[2][NA], outa[2][NA];
    double gb[2][NB], outb[2][NB];
    for (int k = 0; k < 2; k++) {
        ddp_plan_param ps[] = {{NA, DDP_FLOAT32, -1}, {NB, DDP_FLOAT64, -1}};
        ddp_plan p;
        T_OK(ddp_plan_buckets_as(ps, 2, NULL, 64, 64, DDP_BFLOAT16, &p));
        T_OK(ddp_reducer_create(&p, &r[k]));
        const ddp_plan *pl = ddp_reducer_plan(r[k]);
        T_ASSERT(pl->nbuckets == 2);
        mem[k] = calloc(NA + NB, sizeof(uint16_t));
        void *bufs[2] = {mem[k], mem[k] + pl->bucket_numel[0]};
        T_OK(ddp_reducer_attach(r[k], bufs, &pair_ops, &ctx[k], 2));
        T_OK(ddp_reducer_begin(r[k]));
        for (int e = 0; e < NA; e++) ga[k][e] = (float)(e - 150) * 0.37f + (float)k * 1e-3f;
        for (int e = 0; e < NB; e++) gb[k][e] = (e + 1) * 1.1e-3 * (k ? -1 : 3);
        /* a float64 gradient where a float32 one is expected: refused, nothing changes */
        T_STATUS(ddp_reducer_ready(r[k], 0, gb[k], DDP_FLOAT64, NA, outa[k]), DDP_ERR_TYPE);
        T_OK(ddp_reducer_ready(r[k], 1, gb[k], DDP_FLOAT64, NB, outb[k]));
        T_OK(ddp_reducer_ready(r[k], 0, ga[k], DDP_FLOAT32, NA, outa[k]));
    }
    for (int k = 0; k < 2; k++) T_OK(ddp_reducer_finish(r[k], 0, ddp_wait_for(0, NULL)));
    for (int k = 0; k < 2; k++) {
        for (int e = 0; e < NA; e++) {
            float want = ddp_bf16_to_float(ddp_float_to_bf16(ddp_bf16_to_float(ddp_float_to_bf16(
                ddp_bf16_to_float(ddp_float_to_bf16(ga[0][e])) +
                ddp_bf16_to_float(ddp_float_to_bf16(ga[1][e])))) / 2));
            T_ASSERT(outa[k][e] == want);
        }
        for (int e = 0; e < NB; e++) {
            double want = (double)ddp_bf16_to_float(ddp_float_to_bf16(ddp_bf16_to_float(
                ddp_float_to_bf16(ddp_bf16_to_float(ddp_float_to_bf16((float)gb[0][e])) +
                                  ddp_bf16_to_float(ddp_float_to_bf16((float)gb[1][e])))) / 2));
            T_ASSERT(outb[k][e] == want);
        }
        ddp_reducer_destroy(r[k]);
        free(mem[k]);
    }
    /* World size 1: the gradient copied back onto itself stays exact. */
    ddp_plan_param one[] = {{NA, DDP_FLOAT32, -1}};
    ddp_plan p;
    T_OK(ddp_plan_buckets_as(one, 1, NULL, 64, 64, DDP_FLOAT16, &p));
    ddp_reducer *solo;
    T_OK(ddp_reducer_create(&p, &solo));
    uint16_t buf[NA];
    void *bufs[1] = {buf};
    T_OK(ddp_reducer_attach(solo, bufs, NULL, NULL, 1));
    T_OK(ddp_reducer_begin(solo));
    float g[NA];
    for (int e = 0; e < NA; e++) g[e] = (float)e / 3.0f;
    T_OK(ddp_reducer_ready(solo, 0, g, DDP_FLOAT32, NA, g));
    T_OK(ddp_reducer_finish(solo, 0, ddp_wait_for(0, NULL)));
    for (int e = 0; e < NA; e++) T_ASSERT(g[e] == (float)e / 3.0f);
    ddp_reducer_destroy(solo);
}

int main(void) {
    test_narrow_random();
    test_narrow_special();
    test_widen();
    test_plan_reduce_dtype();
    test_reducer_reduce_dtype();
    printf("test_dtype_cast: all passed\n");
    return 0;
}
