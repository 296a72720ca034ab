/* test_coll_avg.c - integer ReduceOp.AVG is the exact mean rounded toward
 * minus infinity (floor, as NumPy's and torch's //), never a wrapped sum
 * divided: int8, uint8, int32 and int64 inputs at the extremes of their type
 * (so every sum overflows the type), at world sizes 2, 3 and 4, for
 * all-reduce, reduce (every root) and reduce-scatter, on the latency path and
 * on the ring/chain path in chunks small enough that partial sums cross
 * ranks many times. The reference is computed here in 128-bit arithmetic
 * with its own floor division, independently of the core's accumulators. */
#include <stdint.h>
#include <stdlib.h>

#include "coll_harness.h"
#include "ddp_dtype.h"

static const ddp_dtype INTS[] = {DDP_INT8, DDP_UINT8, DDP_INT32, DDP_INT64};
#define NINTS (sizeof INTS / sizeof INTS[0])
enum { CNT = 29 }; /* per block: not a multiple of any world size or chunk */

typedef __int128 i128;

static void type_range(ddp_dtype t, i128 *lo, i128 *hi) {
    switch (t) {
    case DDP_INT8: *lo = INT8_MIN, *hi = INT8_MAX; break;
    case DDP_UINT8: *lo = 0, *hi = UINT8_MAX; break;
    case DDP_INT32: *lo = INT32_MIN, *hi = INT32_MAX; break;
    default: *lo = INT64_MIN, *hi = INT64_MAX; break;
    }
}

/* Input element j of rank q: mostly values within 3 of the type's maximum or
 * minimum (the same extreme on every rank for most j, so the sum overflows),
 * some mixed signs, some near 2^62 for int64; never random, so every run
 * checks the same cases. */
static i128 val(ddp_dtype t, int q, size_t j) {
    i128 lo, hi;
    type_range(t, &lo, &hi);
    const i128 k = (i128)((j * 7 + (size_t)q * 3) % 4); /* 0..3 */
    switch (j % 6) {
    case 0: case 1: return hi - k;                    /* all large: sum overflows up */
    case 2: return t == DDP_UINT8 ? hi - 2 * k : lo + k; /* all small: overflows down */
    case 3: return (q & 1) ? lo + k : hi - k;         /* mixed signs around zero */
    case 4: return t == DDP_INT64 ? ((i128)1 << 62) + k * 12345 - q : hi - (i128)q;
    default: return (q == 0 ? lo : hi) - k * (q == 0 ? -1 : 1); /* one extreme vs the rest */
    }
}

static void put(ddp_dtype t, void *p, size_t i, i128 v) {
    switch (t) {
    case DDP_INT8: ((int8_t *)p)[i] = (int8_t)v; break;
    case DDP_UINT8: ((uint8_t *)p)[i] = (uint8_t)v; break;
    case DDP_INT32: ((int32_t *)p)[i] = (int32_t)v; break;
    default: ((int64_t *)p)[i] = (int64_t)v; break;
    }
}

static i128 get(ddp_dtype t, const void *p, size_t i) {
    switch (t) {
    case DDP_INT8: return ((const int8_t *)p)[i];
    case DDP_UINT8: return ((const uint8_t *)p)[i];
    case DDP_INT32: return ((const int32_t *)p)[i];
    default: return ((const int64_t *)p)[i];
    }
}

/* floor(s / n), by the definition: the largest q with q * n <= s. */
static i128 ref_floor_div(i128 s, int n) {
    i128 q = s / n;
    while (q * n > s) q--;
    while ((q + 1) * n <= s) q++;
    return q;
}

/* The exact floor mean of element j over n ranks; also checks that the
 * inputs really overflow the type for most elements (else the test would
 * not test anything). */
static i128 ref_avg(ddp_dtype t, int n, size_t j, int *overflows) {
    i128 s = 0, lo, hi;
    for (int q = 0; q < n; q++) s += val(t, q, j);
    type_range(t, &lo, &hi);
    if (s < lo || s > hi) (*overflows)++;
    return ref_floor_div(s, n);
}

static void check(ddp_dtype t, const void *buf, size_t i, i128 want, const char *what, int r) {
    i128 got = get(t, buf, i);
    if (got != want) {
        fprintf(stderr, "rank %d: %s %s AVG element %zu is %lld, expected %lld\n", r, what,
                ddp_dtype_name(t), i, (long long)got, (long long)want);
        exit(1);
    }
}

static void avg_rank(hworld *w, int r, void *arg) {
    (void)arg;
    const int n = w->n;
    for (size_t ti = 0; ti < NINTS; ti++) {
        const ddp_dtype t = INTS[ti];
        const size_t es = ddp_dtype_size(t), total = (size_t)n * CNT;
        char *a = malloc(total * es), *b = malloc(total * es);
        T_ASSERT(a && b);
        int overflows = 0;

        /* all-reduce */
        for (size_t j = 0; j < CNT; j++) put(t, a, j, val(t, r, j));
        ddp_coll_args ar = {.kind = DDP_COLL_ALLREDUCE, .dtype = t, .op = DDP_AVG,
                            .count = CNT, .buf = a};
        T_OK(hcoll(w, r, &ar));
        for (size_t j = 0; j < CNT; j++) check(t, a, j, ref_avg(t, n, j, &overflows), "all_reduce", r);
        T_ASSERT(overflows > CNT / 2);

        /* reduce to every root: the result at the root, others unchanged */
        for (int root = 0; root < n; root++) {
            for (size_t j = 0; j < CNT; j++) put(t, a, j, val(t, r, j));
            ddp_coll_args rd = {.kind = DDP_COLL_REDUCE, .dtype = t, .op = DDP_AVG,
                                .root = root, .count = CNT, .buf = a};
            T_OK(hcoll(w, r, &rd));
            for (size_t j = 0; j < CNT; j++)
                check(t, a, j, r == root ? ref_avg(t, n, j, &overflows) : val(t, r, j), "reduce",
                      r);
        }

        /* reduce-scatter, out of place and in place */
        for (int inplace = 0; inplace < 2; inplace++) {
            for (size_t j = 0; j < total; j++) put(t, a, j, val(t, r, j));
            char *out = inplace ? a + (size_t)r * CNT * es : b;
            ddp_coll_args rs = {.kind = DDP_COLL_REDUCE_SCATTER, .dtype = t, .op = DDP_AVG,
                                .count = CNT, .sendbuf = a, .recvbuf = out};
            T_OK(hcoll(w, r, &rs));
            for (size_t j = 0; j < CNT; j++)
                check(t, out, j, ref_avg(t, n, (size_t)r * CNT + j, &overflows),
                      "reduce_scatter", r);
        }
        free(a);
        free(b);
    }
}

/* The reference itself: floor, not truncation, and the overflowing sums. */
static void test_reference(void) {
    T_ASSERT(ref_floor_div(-7, 2) == -4 && ref_floor_div(7, 2) == 3 && ref_floor_div(-6, 3) == -2);
    int ov = 0;
    /* uint8 255 and 252 average to 253 (a wrapped sum would give 125) */
    T_ASSERT(val(DDP_UINT8, 0, 0) >= 252 && ref_avg(DDP_UINT8, 2, 0, &ov) >= 252 && ov == 1);
}

int main(void) {
    test_reference();
    /* latency path; ring/chain in 64-byte chunks (int64 AVG: 4 elements of
     * 16-byte partial sums per chunk); ring/chain in one chunk per block */
    const size_t paths[3][2] = {{1u << 20, 1u << 20}, {0, 64}, {0, 1u << 20}};
    for (int n = 2; n <= 4; n++) {
        for (int p = 0; p < 3; p++) {
            hworld w;
            hworld_init(&w, n, paths[p][0], paths[p][1]);
            hrun(&w, avg_rank, NULL);
            hworld_free(&w);
        }
        printf("integer AVG: %d ranks ok (latency and bandwidth paths)\n", n);
    }
    printf("test_coll_avg: ok\n");
    return 0;
}
