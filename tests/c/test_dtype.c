/* test_dtype.c - element types, half-precision conversions and reduction
 * kernels, checked against references written independently here: half
 * decoding with ldexp, rounding by searching the nearest representable
 * value, and every op recomputed in double / int64 per element. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ddp_dtype.h"
#include "testutil.h"

static uint64_t rng = 88172645463325252ull;
static uint64_t next_rand(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static uint32_t fbits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static float bitsf(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ---- independent references ---------------------------------------------- */

static double ref_half_value(uint16_t h) {
    int sign = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    return sign ? -v : v;
}

/* Nearest half to finite f by binary search over the ordered positive
 * encodings; ties to the even encoding; 0x7c00 (Inf) stands for 65536 so
 * that values from 65520 up round to Inf, as IEEE says. */
static uint16_t ref_float_to_half(float f) {
    if (isnan(f)) return 0x7e00;
    uint16_t sign = signbit(f) ? 0x8000 : 0;
    double a = fabs((double)f);
    if (a >= 65536.0) return sign | 0x7c00;
    int lo = 0, hi = 0x7c00; /* value(lo) <= a < value(hi) */
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (ref_half_value((uint16_t)mid) <= a) lo = mid;
        else hi = mid;
    }
    double vlo = ref_half_value((uint16_t)lo), vhi = hi == 0x7c00 ? 65536.0 : ref_half_value((uint16_t)hi);
    int pick = (a - vlo < vhi - a) ? lo : (a - vlo > vhi - a) ? hi : (lo % 2 == 0 ? lo : hi);
    return (uint16_t)(sign | pick);
}

static uint16_t ref_float_to_bf16(float f) {
    if (isnan(f)) return 0;
    uint32_t u = fbits(f), lo = u & 0xffff0000u, hi = lo + 0x10000u;
    double d = fabs((double)f), dl = fabs((double)bitsf(lo));
    double dh = (hi & 0x7fffffffu) == 0x7f800000u ? ldexp(1.0, 128) : fabs((double)bitsf(hi));
    uint32_t pick = (d - dl < dh - d) ? lo : (d - dl > dh - d) ? hi : ((lo >> 16) % 2 == 0 ? lo : hi);
    return (uint16_t)(pick >> 16);
}

/* ---- conversions ------------------------------------------------------------ */

static void test_half_decode_exhaustive(void) {
    for (uint32_t h = 0; h < 65536; h++) {
        float got = ddp_half_to_float((uint16_t)h);
        double want = ref_half_value((uint16_t)h);
        if (isnan(want)) { /* stays a NaN of the same sign */
            uint16_t back = ddp_float_to_half(got);
            T_ASSERT(isnan(got) && (back & 0x7c00) == 0x7c00 && (back & 0x3ff) != 0);
            T_ASSERT((back & 0x8000) == (h & 0x8000));
        } else {
            T_ASSERT((double)got == want);
            T_ASSERT(!signbit(got) == !signbit(want));
            T_ASSERT(ddp_float_to_half(got) == h); /* exact round trip */
        }
    }
}

static void check_half_round(float f) {
    uint16_t got = ddp_float_to_half(f), want = ref_float_to_half(f);
    if (isnan(f)) {
        T_ASSERT((got & 0x7c00) == 0x7c00 && (got & 0x03ff) != 0);
        return;
    }
    if (got != want) fprintf(stderr, "float_to_half(%a) = 0x%04x, want 0x%04x\n", f, got, want);
    T_ASSERT(got == want);
}

static void test_half_round(void) {
    /* a sweep over every float exponent and many mantissas */
    for (uint64_t u = 0; u <= 0xffffffffull; u += 1009) check_half_round(bitsf((uint32_t)u));
    /* every tie and its neighbours: midpoints between consecutive halves */
    for (uint32_t h = 0; h < 0x7c00; h++) {
        double mid = (ref_half_value((uint16_t)h) +
                      (h + 1 == 0x7c00 ? 65536.0 : ref_half_value((uint16_t)(h + 1)))) / 2;
        float m = (float)mid; /* exact: halves have 11 significant bits */
        check_half_round(m);
        check_half_round(nextafterf(m, 0));
        check_half_round(nextafterf(m, INFINITY));
        check_half_round(-m);
    }
    check_half_round(INFINITY);
    check_half_round(-INFINITY);
    check_half_round(NAN);
    T_ASSERT(ddp_float_to_half(65519.0f) == 0x7bff);
    T_ASSERT(ddp_float_to_half(65520.0f) == 0x7c00);
    T_ASSERT(ddp_float_to_half(1e-8f) == 0x0000);
    T_ASSERT(ddp_float_to_half(-0.0f) == 0x8000);
}

static void test_bf16(void) {
    for (uint32_t h = 0; h < 65536; h++) {
        float f = ddp_bf16_to_float((uint16_t)h);
        T_ASSERT(fbits(f) == h << 16);
        if (!isnan(f)) T_ASSERT(ddp_float_to_bf16(f) == h);
    }
    for (uint64_t u = 0; u <= 0xffffffffull; u += 1009) {
        float f = bitsf((uint32_t)u);
        uint16_t got = ddp_float_to_bf16(f);
        if (isnan(f)) {
            T_ASSERT(isnan(ddp_bf16_to_float(got)));
            continue;
        }
        T_ASSERT(got == ref_float_to_bf16(f));
    }
    /* ties: exactly half an ulp goes to the even neighbour */
    T_ASSERT(ddp_float_to_bf16(bitsf(0x3f808000u)) == 0x3f80);
    T_ASSERT(ddp_float_to_bf16(bitsf(0x3f818000u)) == 0x3f82);
    T_ASSERT(ddp_float_to_bf16(bitsf(0x7f7fffffu)) == 0x7f80); /* FLT_MAX rounds to Inf */
}

static void test_bulk_convert(void) {
    uint16_t h[37], back[37];
    float f[37];
    for (int t = DDP_FLOAT16; t <= DDP_BFLOAT16; t++) {
        for (int i = 0; i < 37; i++) h[i] = (uint16_t)(next_rand() & 0x3fff); /* finite */
        ddp_convert_to_f32((ddp_dtype)t, f, h, 37);
        for (int i = 0; i < 37; i++)
            T_ASSERT(f[i] == (t == DDP_FLOAT16 ? ddp_half_to_float(h[i]) : ddp_bf16_to_float(h[i])));
        ddp_convert_from_f32((ddp_dtype)t, back, f, 37);
        T_ASSERT(memcmp(h, back, sizeof h) == 0);
    }
}

/* ---- names and checks ------------------------------------------------------- */

static void test_names(void) {
    static const size_t sizes[DDP_DTYPE_COUNT] = {2, 2, 4, 8, 1, 1, 4, 8, 1};
    for (int t = 0; t < DDP_DTYPE_COUNT; t++) {
        T_ASSERT(ddp_dtype_size((ddp_dtype)t) == sizes[t]);
        for (int op = 0; op < DDP_REDOP_COUNT; op++)
            T_STATUS(ddp_redop_check((ddp_dtype)t, (ddp_redop)op),
                     t == DDP_BOOL && op == DDP_AVG ? DDP_ERR_TYPE : DDP_OK);
    }
    T_STATUS(ddp_redop_check(DDP_BOOL, DDP_AVG), DDP_ERR_TYPE);
    T_ASSERT(strstr(ddp_last_error(), "AVG") && strstr(ddp_last_error(), "bool"));
    T_STATUS(ddp_redop_check(DDP_DTYPE_COUNT, DDP_SUM), DDP_ERR_TYPE);
    T_STATUS(ddp_redop_check(DDP_FLOAT32, DDP_REDOP_COUNT), DDP_ERR_TYPE);
    T_ASSERT(strcmp(ddp_dtype_name(DDP_BFLOAT16), "bfloat16") == 0);
    T_ASSERT(strcmp(ddp_redop_name(DDP_PRODUCT), "product") == 0);
    T_ASSERT(ddp_dtype_size(DDP_DTYPE_COUNT) == 0);
}

/* ---- kernels ------------------------------------------------------------------ */

/* Element i of an array of type t, as a double. */
static double get(ddp_dtype t, const void *p, size_t i) {
    switch (t) {
    case DDP_FLOAT16: return ref_half_value(((const uint16_t *)p)[i]);
    case DDP_BFLOAT16: return (double)bitsf((uint32_t)((const uint16_t *)p)[i] << 16);
    case DDP_FLOAT32: return ((const float *)p)[i];
    case DDP_FLOAT64: return ((const double *)p)[i];
    case DDP_INT8: return ((const int8_t *)p)[i];
    case DDP_UINT8: case DDP_BOOL: return ((const uint8_t *)p)[i];
    case DDP_INT32: return ((const int32_t *)p)[i];
    case DDP_INT64: return (double)((const int64_t *)p)[i];
    default: return 0;
    }
}

static void fill_random(ddp_dtype t, void *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        int v = (int)(next_rand() % 19) - 9; /* -9..9: products of two stay in range */
        switch (t) {
        case DDP_FLOAT16: ((uint16_t *)p)[i] = ref_float_to_half((float)v * 0.375f); break;
        case DDP_BFLOAT16: ((uint16_t *)p)[i] = ref_float_to_bf16((float)v * 0.375f); break;
        case DDP_FLOAT32: ((float *)p)[i] = (float)v * 0.375f; break;
        case DDP_FLOAT64: ((double *)p)[i] = v * 0.375; break;
        case DDP_INT8: ((int8_t *)p)[i] = (int8_t)v; break;
        case DDP_UINT8: ((uint8_t *)p)[i] = (uint8_t)(v + 9); break;
        case DDP_INT32: ((int32_t *)p)[i] = v * 1000; break;
        case DDP_INT64: ((int64_t *)p)[i] = (int64_t)v * 100000; break;
        case DDP_BOOL: ((uint8_t *)p)[i] = (uint8_t)(v > 0); break;
        default: break;
        }
    }
}

static double ref_op(ddp_dtype t, ddp_redop op, double a, double b) {
    if (t == DDP_BOOL)
        return (op == DDP_SUM || op == DDP_MAX) ? (a != 0 || b != 0) : (a != 0 && b != 0);
    switch (op) {
    case DDP_SUM: case DDP_AVG: return a + b;
    case DDP_PRODUCT: return a * b;
    case DDP_MIN: return a < b ? a : b;
    default: return a > b ? a : b;
    }
}

/* The double result as type t would store it (uint8 wraps). */
static double as_type(ddp_dtype t, double v) {
    switch (t) {
    case DDP_FLOAT16: return ref_half_value(ref_float_to_half((float)v));
    case DDP_BFLOAT16: return (double)bitsf((uint32_t)ref_float_to_bf16((float)v) << 16);
    case DDP_FLOAT32: return (float)v;
    case DDP_UINT8: return (uint8_t)(int)v;
    default: return v;
    }
}

static void test_kernels(void) {
    static const size_t lens[] = {0, 1, 3, 17, 100, 1027};
    enum { MAXN = 1027 };
    static unsigned char a[MAXN * 8], b[MAXN * 8], d[MAXN * 8], orig[MAXN * 8];
    for (int t = 0; t < DDP_DTYPE_COUNT; t++) {
        const size_t es = ddp_dtype_size((ddp_dtype)t);
        for (int op = 0; op < DDP_REDOP_COUNT; op++) {
            if (ddp_redop_check((ddp_dtype)t, (ddp_redop)op) != DDP_OK) continue;
            for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
                size_t n = lens[li];
                fill_random((ddp_dtype)t, a, n);
                fill_random((ddp_dtype)t, b, n);
                memcpy(orig, a, n * es);
                /* out of place, then in place (dst aliases a) */
                ddp_reduce3((ddp_dtype)t, (ddp_redop)op, d, a, b, n);
                ddp_reduce((ddp_dtype)t, (ddp_redop)op, a, b, n);
                T_ASSERT(n == 0 || memcmp(a, d, n * es) == 0);
                for (size_t i = 0; i < n; i++) {
                    double want = as_type((ddp_dtype)t, ref_op((ddp_dtype)t, (ddp_redop)op,
                                                           get((ddp_dtype)t, orig, i),
                                                           get((ddp_dtype)t, b, i)));
                    if (get((ddp_dtype)t, d, i) != want)
                        fprintf(stderr, "%s %s [%zu]: got %g want %g\n",
                                ddp_dtype_name((ddp_dtype)t), ddp_redop_name((ddp_redop)op), i,
                                get((ddp_dtype)t, d, i), want);
                    T_ASSERT(get((ddp_dtype)t, d, i) == want);
                }
            }
        }
    }
}

static void test_wrap_and_nan(void) {
    int32_t i32[2] = {INT32_MAX, INT32_MIN}, one32[2] = {1, -1};
    ddp_reduce(DDP_INT32, DDP_SUM, i32, one32, 2); /* wraps, no UB */
    T_ASSERT(i32[0] == INT32_MIN && i32[1] == INT32_MAX);
    int64_t i64 = INT64_MAX, two = 2;
    ddp_reduce(DDP_INT64, DDP_PRODUCT, &i64, &two, 1);
    T_ASSERT(i64 == -2);
    int8_t i8 = 100, i8b = 100;
    ddp_reduce(DDP_INT8, DDP_SUM, &i8, &i8b, 1);
    T_ASSERT(i8 == -56);

    float x[4] = {NAN, 1.0f, NAN, -0.0f}, y[4] = {1.0f, NAN, NAN, 2.0f};
    float mn[4], mx[4];
    ddp_reduce3(DDP_FLOAT32, DDP_MIN, mn, x, y, 4);
    ddp_reduce3(DDP_FLOAT32, DDP_MAX, mx, x, y, 4);
    T_ASSERT(isnan(mn[0]) && isnan(mn[1]) && isnan(mn[2]) && mn[3] == 0.0f);
    T_ASSERT(isnan(mx[0]) && isnan(mx[1]) && isnan(mx[2]) && mx[3] == 2.0f);
    uint16_t h[2] = {0x7e00, 0x3c00}, hb[2] = {0x3c00, 0x7e00};
    ddp_reduce(DDP_FLOAT16, DDP_MAX, h, hb, 2);
    T_ASSERT((h[0] & 0x7c00) == 0x7c00 && (h[0] & 0x3ff) && (h[1] & 0x7c00) == 0x7c00 && (h[1] & 0x3ff));
}

static void test_finish_and_acc(void) {
    int32_t iv[4] = {7, -7, 8, -1};
    ddp_reduce_finish(DDP_INT32, DDP_AVG, iv, 4, 2); /* floor, toward minus infinity */
    T_ASSERT(iv[0] == 3 && iv[1] == -4 && iv[2] == 4 && iv[3] == -1);
    int8_t i8[1] = {-100};
    ddp_reduce_finish(DDP_INT8, DDP_AVG, i8, 1, 200); /* divisor wider than int8 */
    T_ASSERT(i8[0] == -1);
    i8[0] = 120;
    ddp_reduce_finish(DDP_INT8, DDP_AVG, i8, 1, 7);
    T_ASSERT(i8[0] == 17);
    uint8_t u8[1] = {255};
    ddp_reduce_finish(DDP_UINT8, DDP_AVG, u8, 1, 2);
    T_ASSERT(u8[0] == 127);
    double dv[2] = {1.0, -3.0};
    ddp_reduce_finish(DDP_FLOAT64, DDP_AVG, dv, 2, 3);
    T_ASSERT(dv[0] == 1.0 / 3 && dv[1] == -1.0);
    ddp_reduce_finish(DDP_FLOAT64, DDP_SUM, dv, 2, 3); /* not AVG: unchanged */
    T_ASSERT(dv[1] == -1.0);
    uint16_t h[1] = {ref_float_to_half(3.0f)};
    ddp_reduce_finish(DDP_FLOAT16, DDP_AVG, h, 1, 4);
    T_ASSERT(h[0] == ref_float_to_half(0.75f));

    /* float32 accumulation of halves: 2048 + 1 + 1 + 1 stays exact */
    uint16_t big = ref_float_to_half(2048.0f), one = ref_float_to_half(1.0f);
    for (int t = DDP_FLOAT16; t <= DDP_BFLOAT16; t++) {
        uint16_t src[1] = {t == DDP_FLOAT16 ? one : ref_float_to_bf16(1.0f)};
        float acc[1] = {2048.0f};
        for (int k = 0; k < 3; k++) ddp_reduce_acc((ddp_dtype)t, DDP_SUM, acc, src, 1);
        T_ASSERT(acc[0] == 2051.0f);
        float m[1] = {5.0f};
        ddp_reduce_acc((ddp_dtype)t, DDP_MIN, m, src, 1);
        T_ASSERT(m[0] == 1.0f);
    }
    uint16_t h2[1] = {big}, o2[1] = {one};
    ddp_reduce(DDP_FLOAT16, DDP_SUM, h2, o2, 1); /* per-call rounding: 2049 -> 2048 */
    T_ASSERT(h2[0] == big);
}

/* floor(s / n) for the reference: the largest q with q * n <= s. */
static __int128 ref_floor_div(__int128 s, int n) {
    __int128 q = s / n;
    while (q * n > s) q--;
    while ((q + 1) * n <= s) q++;
    return q;
}

/* The accumulators: sizes, and exact floor means of sums that overflow the
 * element type, one contribution at a time (ddp_acc_add, the latency path)
 * and as combined partial sums (ddp_acc_combine, the ring and chain). */
static void test_accumulators(void) {
    T_ASSERT(ddp_acc_size(DDP_FLOAT16, DDP_SUM) == 4 && ddp_acc_size(DDP_BFLOAT16, DDP_AVG) == 4);
    T_ASSERT(ddp_acc_size(DDP_INT8, DDP_AVG) == 8 && ddp_acc_size(DDP_UINT8, DDP_AVG) == 8);
    T_ASSERT(ddp_acc_size(DDP_INT32, DDP_AVG) == 8 && ddp_acc_size(DDP_INT64, DDP_AVG) == 16);
    T_ASSERT(ddp_acc_size(DDP_INT32, DDP_SUM) == 4 && ddp_acc_is_native(DDP_INT64, DDP_MAX));
    T_ASSERT(ddp_acc_is_native(DDP_FLOAT32, DDP_AVG) && !ddp_acc_is_native(DDP_INT8, DDP_AVG));

    /* int64 AVG: ranks near +-2^63, and random values; 1 to 7 ranks */
    enum { N = 64, R = 7 };
    int64_t in[R][N], out[N];
    for (int q = 0; q < R; q++)
        for (int i = 0; i < N; i++) {
            uint64_t x = next_rand();
            in[q][i] = i % 4 == 0 ? INT64_MAX - (int64_t)(x % 5)
                     : i % 4 == 1 ? INT64_MIN + (int64_t)(x % 5)
                     : i % 4 == 2 ? (int64_t)(x >> (x % 64)) * ((x & 1) ? -1 : 1)
                                  : (int64_t)x;
        }
    for (int n = 1; n <= R; n++) {
        uint64_t acc[2 * N], part[2 * N];
        ddp_acc_load(DDP_INT64, DDP_AVG, acc, in[0], N);
        for (int q = 1; q < n; q++) ddp_acc_add(DDP_INT64, DDP_AVG, acc, in[q], N);
        /* the same sum as two partial sums combined: [0, n/2) + [n/2, n) */
        uint64_t lo[2 * N], hi[2 * N];
        ddp_acc_load(DDP_INT64, DDP_AVG, lo, in[0], N);
        for (int q = 1; q < n / 2; q++) ddp_acc_add(DDP_INT64, DDP_AVG, lo, in[q], N);
        ddp_acc_load(DDP_INT64, DDP_AVG, hi, in[n / 2], N);
        for (int q = n / 2 + 1; q < n; q++) ddp_acc_add(DDP_INT64, DDP_AVG, hi, in[q], N);
        if (n >= 2) {
            ddp_acc_combine(DDP_INT64, DDP_AVG, part, lo, hi, N);
            ddp_acc_combine(DDP_INT64, DDP_AVG, lo, lo, hi, N); /* aliased dst */
            T_ASSERT(memcmp(part, lo, sizeof part) == 0 && memcmp(part, acc, sizeof part) == 0);
        }
        ddp_acc_store(DDP_INT64, DDP_AVG, out, acc, N, n);
        for (int i = 0; i < N; i++) {
            __int128 s = 0;
            for (int q = 0; q < n; q++) s += in[q][i];
            if ((__int128)out[i] != ref_floor_div(s, n)) {
                fprintf(stderr, "int64 AVG over %d ranks, element %d: got %lld want %lld\n", n,
                        i, (long long)out[i], (long long)ref_floor_div(s, n));
                exit(1);
            }
        }
    }

    /* narrow types through int64: uint8 200 + 200 -> 200 (a wrapped sum gives 72) */
    uint8_t u[2][3] = {{200, 255, 0}, {200, 254, 1}}, uo[3];
    int64_t a64[3];
    ddp_acc_load(DDP_UINT8, DDP_AVG, a64, u[0], 3);
    ddp_acc_add(DDP_UINT8, DDP_AVG, a64, u[1], 3);
    ddp_acc_store(DDP_UINT8, DDP_AVG, uo, a64, 3, 2);
    T_ASSERT(uo[0] == 200 && uo[1] == 254 && uo[2] == 0);
    int8_t s8[3][2] = {{-128, 127}, {-128, 127}, {-127, 126}}, so[2];
    ddp_acc_load(DDP_INT8, DDP_AVG, a64, s8[0], 2);
    ddp_acc_add(DDP_INT8, DDP_AVG, a64, s8[1], 2);
    ddp_acc_add(DDP_INT8, DDP_AVG, a64, s8[2], 2);
    ddp_acc_store(DDP_INT8, DDP_AVG, so, a64, 2, 3); /* -383/3 -> -128, 380/3 -> 126 */
    T_ASSERT(so[0] == -128 && so[1] == 126);
    int32_t s32[2][1] = {{INT32_MIN}, {INT32_MIN + 1}}, o32[1];
    ddp_acc_load(DDP_INT32, DDP_AVG, a64, s32[0], 1);
    ddp_acc_add(DDP_INT32, DDP_AVG, a64, s32[1], 1);
    ddp_acc_store(DDP_INT32, DDP_AVG, o32, a64, 1, 2); /* floor(-(2^32 - 1) / 2) */
    T_ASSERT(o32[0] == INT32_MIN);

    /* native accumulators are the plain kernels: float AVG divides once */
    double d[2] = {1.0, 2.0}, e[2] = {2.0, 2.0};
    ddp_acc_add(DDP_FLOAT64, DDP_AVG, d, e, 2);
    ddp_acc_store(DDP_FLOAT64, DDP_AVG, d, d, 2, 2);
    T_ASSERT(d[0] == 1.5 && d[1] == 2.0);
}

int main(void) {
    test_names();
    test_half_decode_exhaustive();
    test_half_round();
    test_bf16();
    test_bulk_convert();
    test_kernels();
    test_wrap_and_nan();
    test_finish_and_acc();
    test_accumulators();
    printf("test_dtype: ok\n");
    return 0;
}
