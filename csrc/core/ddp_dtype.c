/* ddp_dtype.c - element types, reduction operations and reduction kernels.
 *
 * Every kernel is a plain element-wise loop over restrict pointers with the
 * switch on the operation outside the loop, so that -O3 vectorises each
 * (dtype, op) pair on its own. Integer arithmetic wraps (it is done in the
 * unsigned type, as torch's wraps, and without undefined behaviour).
 * Float MIN/MAX propagate NaN like torch.minimum/maximum. float16 and
 * bfloat16 are widened to float32, combined, and rounded back with
 * round-to-nearest-even; the conversions are branch-free bit manipulations
 * (no lookup tables) so that they vectorise as well. The accumulators at the
 * end (ddp_acc_*) are what the collectives combine in: float32 for the half
 * types, and for integer AVG int64 or 128-bit sums so the mean is exact.
 */
#include "ddp_dtype.h"

#include <string.h>

/* ---- names, sizes, checks ------------------------------------------------ */

static const struct {
    const char *name;
    size_t size;
} dtype_info[DDP_DTYPE_COUNT] = {
    [DDP_FLOAT16] = {"float16", 2}, [DDP_BFLOAT16] = {"bfloat16", 2},
    [DDP_FLOAT32] = {"float32", 4}, [DDP_FLOAT64] = {"float64", 8},
    [DDP_INT8] = {"int8", 1},       [DDP_UINT8] = {"uint8", 1},
    [DDP_INT32] = {"int32", 4},     [DDP_INT64] = {"int64", 8},
    [DDP_BOOL] = {"bool", 1},
};

static const char *const redop_names[DDP_REDOP_COUNT] = {
    [DDP_SUM] = "sum", [DDP_AVG] = "avg", [DDP_MIN] = "min",
    [DDP_MAX] = "max", [DDP_PRODUCT] = "product",
};

size_t ddp_dtype_size(ddp_dtype t) {
    return (unsigned)t < DDP_DTYPE_COUNT ? dtype_info[t].size : 0;
}

const char *ddp_dtype_name(ddp_dtype t) {
    return (unsigned)t < DDP_DTYPE_COUNT ? dtype_info[t].name : "unknown-dtype";
}

const char *ddp_redop_name(ddp_redop op) {
    return (unsigned)op < DDP_REDOP_COUNT ? redop_names[op] : "unknown-op";
}

ddp_status ddp_redop_check(ddp_dtype t, ddp_redop op) {
    if ((unsigned)t >= DDP_DTYPE_COUNT)
        return ddp_error(DDP_ERR_TYPE, "unsupported dtype code %d; supported: float16, "
                         "bfloat16, float32, float64, int8, uint8, int32, int64, bool", (int)t);
    if ((unsigned)op >= DDP_REDOP_COUNT)
        return ddp_error(DDP_ERR_TYPE, "unsupported reduction op code %d; supported: sum, "
                         "avg, min, max, product", (int)op);
    if (t == DDP_BOOL && op == DDP_AVG)
        return ddp_error(DDP_ERR_TYPE, "ReduceOp.AVG is not defined for bool tensors; use "
                         "SUM/MAX (logical or) or MIN/PRODUCT (logical and)");
    return DDP_OK;
}

/* ---- float16 / bfloat16 <-> float32 -------------------------------------- */

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* IEEE half -> float, exact. Normal and Inf/NaN halves: shift the exponent
 * and mantissa into place and rescale by 2^-112 (the bias difference); the
 * exponent offset maps half's all-ones exponent onto float's, keeping Inf/NaN.
 * Subnormal halves: place the mantissa under a float of exponent 2^-1 and
 * subtract 0.5, which normalises it exactly. Both values are computed and the
 * right one selected, so the loop has no branches. */
float ddp_half_to_float(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & UINT32_C(0x80000000);
    const uint32_t two_w = w + w; /* drops the sign */
    const float normalized = f32_from_bits((two_w >> 4) + (UINT32_C(0xE0) << 23)) * 0x1.0p-112f;
    const float denormalized = f32_from_bits((two_w >> 17) | (UINT32_C(126) << 23)) - 0.5f;
    const uint32_t bits = two_w < (UINT32_C(1) << 27) ? f32_bits(denormalized)
                                                      : f32_bits(normalized);
    return f32_from_bits(sign | bits);
}

/* float -> IEEE half with round-to-nearest-even. The float unit does the
 * rounding: scaling |f| up by 2^112 then down by 2^-110 saturates values too
 * large for a half to Inf, and adding a power of two chosen from f's exponent
 * (at least 2^-14's worth, so subnormal halves round at the right bit) leaves
 * exactly the half's 10 mantissa bits in the sum's low bits, rounded to
 * nearest even by the hardware. NaN is kept quiet with its sign. */
uint16_t ddp_float_to_half(float f) {
    float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f32_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & UINT32_C(0x80000000);
    uint32_t bias = shl1_w & UINT32_C(0xFF000000);
    if (bias < UINT32_C(0x71000000)) bias = UINT32_C(0x71000000);
    base = f32_from_bits((bias >> 1) + UINT32_C(0x07800000)) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t exp_bits = (bits >> 13) & UINT32_C(0x00007C00);
    const uint32_t mantissa_bits = bits & UINT32_C(0x00000FFF);
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return (uint16_t)((sign >> 16) | (shl1_w > UINT32_C(0xFF000000) ? UINT32_C(0x7E00) : nonsign));
}

float ddp_bf16_to_float(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

/* float -> bfloat16 with round-to-nearest-even on the dropped 16 bits
 * (overflow carries into the exponent and reaches Inf correctly; subnormals
 * need nothing special). NaN must not round to Inf: keep it, quieted. */
uint16_t ddp_float_to_bf16(float f) {
    const uint32_t u = f32_bits(f);
    const uint32_t rounded = (u + UINT32_C(0x7FFF) + ((u >> 16) & 1)) >> 16;
    const uint32_t quiet_nan = (u >> 16) | UINT32_C(0x0040);
    return (uint16_t)((u & UINT32_C(0x7FFFFFFF)) > UINT32_C(0x7F800000) ? quiet_nan : rounded);
}

void ddp_convert_to_f32(ddp_dtype t, float *restrict dst, const void *restrict src, size_t n) {
    const uint16_t *s = src;
    if (t == DDP_FLOAT16)
        for (size_t i = 0; i < n; i++) dst[i] = ddp_half_to_float(s[i]);
    else if (t == DDP_BFLOAT16)
        for (size_t i = 0; i < n; i++) dst[i] = ddp_bf16_to_float(s[i]);
    else if (t == DDP_FLOAT32 && n > 0)
        memcpy(dst, src, n * sizeof(float));
}

void ddp_convert_from_f32(ddp_dtype t, void *restrict dst, const float *restrict src, size_t n) {
    uint16_t *d = dst;
    if (t == DDP_FLOAT16)
        for (size_t i = 0; i < n; i++) d[i] = ddp_float_to_half(src[i]);
    else if (t == DDP_BFLOAT16)
        for (size_t i = 0; i < n; i++) d[i] = ddp_float_to_bf16(src[i]);
    else if (t == DDP_FLOAT32 && n > 0)
        memcpy(dst, src, n * sizeof(float));
}

/* ---- element operations --------------------------------------------------- */

/* Integers: wrap-around arithmetic done in the unsigned type U. */
#define DEF_INT_OPS(sfx, T, U)                                                          \
    static inline T add_##sfx(T a, T b) { return (T)((U)a + (U)b); }                    \
    static inline T mul_##sfx(T a, T b) { return (T)((U)a * (U)b); }                    \
    static inline T min_##sfx(T a, T b) { return a < b ? a : b; }                       \
    static inline T max_##sfx(T a, T b) { return a > b ? a : b; }
DEF_INT_OPS(i8, int8_t, uint8_t)
DEF_INT_OPS(u8, uint8_t, uint8_t)
DEF_INT_OPS(i32, int32_t, uint32_t)
DEF_INT_OPS(i64, int64_t, uint64_t)

/* Floats: MIN/MAX return a NaN operand if there is one. */
#define DEF_FLOAT_OPS(sfx, T)                                                           \
    static inline T add_##sfx(T a, T b) { return a + b; }                               \
    static inline T mul_##sfx(T a, T b) { return a * b; }                               \
    static inline T min_##sfx(T a, T b) { return (a < b || a != a) ? a : b; }          \
    static inline T max_##sfx(T a, T b) { return (a > b || a != a) ? a : b; }
DEF_FLOAT_OPS(f32, float)
DEF_FLOAT_OPS(f64, double)

/* Half types: widen, combine in float32, round back. */
#define DEF_HALF_OPS(sfx, TO_F, FROM_F)                                                 \
    static inline uint16_t add_##sfx(uint16_t a, uint16_t b) { return FROM_F(add_f32(TO_F(a), TO_F(b))); } \
    static inline uint16_t mul_##sfx(uint16_t a, uint16_t b) { return FROM_F(mul_f32(TO_F(a), TO_F(b))); } \
    static inline uint16_t min_##sfx(uint16_t a, uint16_t b) { return FROM_F(min_f32(TO_F(a), TO_F(b))); } \
    static inline uint16_t max_##sfx(uint16_t a, uint16_t b) { return FROM_F(max_f32(TO_F(a), TO_F(b))); }
DEF_HALF_OPS(f16, ddp_half_to_float, ddp_float_to_half)
DEF_HALF_OPS(bf16, ddp_bf16_to_float, ddp_float_to_bf16)

/* Bool (one byte, 0 or 1): SUM/MAX are logical or, MIN/PRODUCT logical and. */
static inline uint8_t or_b(uint8_t a, uint8_t b) { return (uint8_t)((a | b) != 0); }
static inline uint8_t and_b(uint8_t a, uint8_t b) { return (uint8_t)((a != 0) & (b != 0)); }

/* ---- kernels ----------------------------------------------------------- */

/* dst[i] = F(a[i], LOAD(b[i])): the one loop every kernel is made of. */
#define LOOP(F, LOAD, dst, a, b, n) \
    for (size_t i_ = 0; i_ < (n); i_++) (dst)[i_] = F((a)[i_], LOAD((b)[i_]))
#define AS_IS(x) (x)

/* The switch over op, outside the loops. AVG accumulates as SUM. */
#define OP_SWITCH(op, ADD, MUL, MIN, MAX, LOAD, dst, a, b, n)     \
    switch (op) {                                                 \
    case DDP_SUM: case DDP_AVG: LOOP(ADD, LOAD, dst, a, b, n); break; \
    case DDP_PRODUCT: LOOP(MUL, LOAD, dst, a, b, n); break;       \
    case DDP_MIN: LOOP(MIN, LOAD, dst, a, b, n); break;           \
    case DDP_MAX: LOOP(MAX, LOAD, dst, a, b, n); break;           \
    default: break;                                               \
    }

/* d[i] = o[i] = F(d[i], s[i]): in place and a second copy in one pass. */
#define LOOP_DUP(F, d, o, s, n)                                                          \
    for (size_t i_ = 0; i_ < (n); i_++) (o)[i_] = (d)[i_] = F((d)[i_], (s)[i_])

/* For each element type, an in-place kernel (d op= s), the same with a copy
 * of each result (o), and an out-of-place one (d = a op b); separate
 * functions so that every pointer is restrict. */
#define DEF_KERNELS(sfx, T, ADD, MUL, MIN, MAX)                                          \
    static void red2_##sfx(ddp_redop op, T *restrict d, const T *restrict s, size_t n) {  \
        OP_SWITCH(op, ADD, MUL, MIN, MAX, AS_IS, d, d, s, n)                              \
    }                                                                                     \
    static void dup_##sfx(ddp_redop op, T *restrict d, T *restrict o, const T *restrict s, \
                          size_t n) {                                                     \
        switch (op) {                                                                     \
        case DDP_SUM: case DDP_AVG: LOOP_DUP(ADD, d, o, s, n); break;                     \
        case DDP_PRODUCT: LOOP_DUP(MUL, d, o, s, n); break;                               \
        case DDP_MIN: LOOP_DUP(MIN, d, o, s, n); break;                                   \
        case DDP_MAX: LOOP_DUP(MAX, d, o, s, n); break;                                   \
        default: break;                                                                   \
        }                                                                                 \
    }                                                                                     \
    static void red3_##sfx(ddp_redop op, T *restrict d, const T *restrict a,              \
                           const T *restrict b, size_t n) {                               \
        OP_SWITCH(op, ADD, MUL, MIN, MAX, AS_IS, d, a, b, n)                              \
    }
DEF_KERNELS(f16, uint16_t, add_f16, mul_f16, min_f16, max_f16)
DEF_KERNELS(bf16, uint16_t, add_bf16, mul_bf16, min_bf16, max_bf16)
DEF_KERNELS(f32, float, add_f32, mul_f32, min_f32, max_f32)
DEF_KERNELS(f64, double, add_f64, mul_f64, min_f64, max_f64)
DEF_KERNELS(i8, int8_t, add_i8, mul_i8, min_i8, max_i8)
DEF_KERNELS(u8, uint8_t, add_u8, mul_u8, min_u8, max_u8)
DEF_KERNELS(i32, int32_t, add_i32, mul_i32, min_i32, max_i32)
DEF_KERNELS(i64, int64_t, add_i64, mul_i64, min_i64, max_i64)
DEF_KERNELS(b, uint8_t, or_b, and_b, and_b, or_b)

void ddp_reduce(ddp_dtype t, ddp_redop op, void *dst, const void *src, size_t n) {
    switch (t) {
    case DDP_FLOAT16: red2_f16(op, dst, src, n); break;
    case DDP_BFLOAT16: red2_bf16(op, dst, src, n); break;
    case DDP_FLOAT32: red2_f32(op, dst, src, n); break;
    case DDP_FLOAT64: red2_f64(op, dst, src, n); break;
    case DDP_INT8: red2_i8(op, dst, src, n); break;
    case DDP_UINT8: red2_u8(op, dst, src, n); break;
    case DDP_INT32: red2_i32(op, dst, src, n); break;
    case DDP_INT64: red2_i64(op, dst, src, n); break;
    case DDP_BOOL: red2_b(op, dst, src, n); break;
    default: break;
    }
}

void ddp_reduce_dup(ddp_dtype t, ddp_redop op, void *dst, void *out, const void *src,
                    size_t n) {
    switch (t) {
    case DDP_FLOAT16: dup_f16(op, dst, out, src, n); break;
    case DDP_BFLOAT16: dup_bf16(op, dst, out, src, n); break;
    case DDP_FLOAT32: dup_f32(op, dst, out, src, n); break;
    case DDP_FLOAT64: dup_f64(op, dst, out, src, n); break;
    case DDP_INT8: dup_i8(op, dst, out, src, n); break;
    case DDP_UINT8: dup_u8(op, dst, out, src, n); break;
    case DDP_INT32: dup_i32(op, dst, out, src, n); break;
    case DDP_INT64: dup_i64(op, dst, out, src, n); break;
    case DDP_BOOL: dup_b(op, dst, out, src, n); break;
    default: break;
    }
}

void ddp_reduce3(ddp_dtype t, ddp_redop op, void *dst, const void *a, const void *b, size_t n) {
    if (dst == a) {
        ddp_reduce(t, op, dst, b, n);
        return;
    }
    switch (t) {
    case DDP_FLOAT16: red3_f16(op, dst, a, b, n); break;
    case DDP_BFLOAT16: red3_bf16(op, dst, a, b, n); break;
    case DDP_FLOAT32: red3_f32(op, dst, a, b, n); break;
    case DDP_FLOAT64: red3_f64(op, dst, a, b, n); break;
    case DDP_INT8: red3_i8(op, dst, a, b, n); break;
    case DDP_UINT8: red3_u8(op, dst, a, b, n); break;
    case DDP_INT32: red3_i32(op, dst, a, b, n); break;
    case DDP_INT64: red3_i64(op, dst, a, b, n); break;
    case DDP_BOOL: red3_b(op, dst, a, b, n); break;
    default: break;
    }
}

void ddp_reduce_acc(ddp_dtype t, ddp_redop op, float *restrict acc, const void *restrict src,
                    size_t n) {
    const uint16_t *s = src;
    if (t == DDP_FLOAT16) {
        OP_SWITCH(op, add_f32, mul_f32, min_f32, max_f32, ddp_half_to_float, acc, acc, s, n)
    } else if (t == DDP_BFLOAT16) {
        OP_SWITCH(op, add_f32, mul_f32, min_f32, max_f32, ddp_bf16_to_float, acc, acc, s, n)
    }
}

/* ---- AVG ---------------------------------------------------------------- */

/* floor(s / n) for n >= 1: C's division truncates toward zero, so a negative
 * quotient with a remainder is one too high. */
static inline int64_t floor_div64(int64_t s, int64_t n) {
    int64_t q = s / n;
    return (s % n != 0 && s < 0) ? q - 1 : q;
}

/* buf[i] = buf[i] / n for a float type T, in T (one IEEE division, as torch). */
#define DIVIDE_FLOAT(T, buf, count, n)                                         \
    do {                                                                       \
        T *restrict p_ = (buf);                                                \
        const T d_ = (T)(n);                                                   \
        for (size_t i_ = 0; i_ < (count); i_++) p_[i_] = p_[i_] / d_;          \
    } while (0)

/* buf[i] = floor(buf[i] / n) for an integer type T, dividing in int64 (so
 * the divisor never wraps, e.g. 200 ranks with int8). */
#define DIVIDE_INT(T, buf, count, n)                                           \
    do {                                                                       \
        T *restrict p_ = (buf);                                                \
        for (size_t i_ = 0; i_ < (count); i_++)                                \
            p_[i_] = (T)floor_div64((int64_t)p_[i_], (int64_t)(n));            \
    } while (0)

void ddp_reduce_finish(ddp_dtype t, ddp_redop op, void *buf, size_t n, int nranks) {
    if (op != DDP_AVG || nranks <= 1) return;
    uint16_t *h = buf;
    const float fn = (float)nranks;
    switch (t) {
    case DDP_FLOAT16:
        for (size_t i = 0; i < n; i++) h[i] = ddp_float_to_half(ddp_half_to_float(h[i]) / fn);
        break;
    case DDP_BFLOAT16:
        for (size_t i = 0; i < n; i++) h[i] = ddp_float_to_bf16(ddp_bf16_to_float(h[i]) / fn);
        break;
    case DDP_FLOAT32: DIVIDE_FLOAT(float, buf, n, nranks); break;
    case DDP_FLOAT64: DIVIDE_FLOAT(double, buf, n, nranks); break;
    case DDP_INT8: DIVIDE_INT(int8_t, buf, n, nranks); break;
    case DDP_UINT8: DIVIDE_INT(uint8_t, buf, n, nranks); break;
    case DDP_INT32: DIVIDE_INT(int32_t, buf, n, nranks); break;
    case DDP_INT64: DIVIDE_INT(int64_t, buf, n, nranks); break;
    default: break; /* bool: AVG is rejected by ddp_redop_check */
    }
}

/* ---- accumulators ---------------------------------------------------------- */

typedef enum acc_kind { ACC_NATIVE, ACC_F32, ACC_I64, ACC_I128 } acc_kind;

static acc_kind acc_of(ddp_dtype t, ddp_redop op) {
    if (t == DDP_FLOAT16 || t == DDP_BFLOAT16) return ACC_F32;
    if (op != DDP_AVG) return ACC_NATIVE;
    if (t == DDP_INT8 || t == DDP_UINT8 || t == DDP_INT32) return ACC_I64;
    return t == DDP_INT64 ? ACC_I128 : ACC_NATIVE;
}

size_t ddp_acc_size(ddp_dtype t, ddp_redop op) {
    switch (acc_of(t, op)) {
    case ACC_F32: return sizeof(float);
    case ACC_I64: return sizeof(int64_t);
    case ACC_I128: return 2 * sizeof(uint64_t);
    default: return ddp_dtype_size(t);
    }
}

int ddp_acc_is_native(ddp_dtype t, ddp_redop op) { return acc_of(t, op) == ACC_NATIVE; }

/* int64 accumulators of a narrower integer type T: load, add, narrow. The
 * additions are done in uint64_t (wrap-free by the bound in ddp_dtype.h, and
 * free of undefined behaviour even if it were exceeded). */
#define I64_LOAD(T, acc, src, n)                                               \
    do {                                                                       \
        int64_t *restrict a_ = (acc);                                          \
        const T *restrict s_ = (src);                                          \
        for (size_t i_ = 0; i_ < (n); i_++) a_[i_] = (int64_t)s_[i_];          \
    } while (0)
#define I64_ADD(T, acc, src, n)                                                \
    do {                                                                       \
        int64_t *restrict a_ = (acc);                                          \
        const T *restrict s_ = (src);                                          \
        for (size_t i_ = 0; i_ < (n); i_++)                                    \
            a_[i_] = (int64_t)((uint64_t)a_[i_] + (uint64_t)(int64_t)s_[i_]);  \
    } while (0)
#define I64_STORE(T, dst, acc, n, nranks)                                      \
    do {                                                                       \
        T *restrict d_ = (dst);                                                \
        const int64_t *restrict a_ = (acc);                                    \
        for (size_t i_ = 0; i_ < (n); i_++)                                    \
            d_[i_] = (T)floor_div64(a_[i_], (int64_t)(nranks));                \
    } while (0)

/* 128-bit accumulators: element i is the words a[2i] (low) and a[2i+1]
 * (high) of a two's-complement integer. */
static void i128_load(uint64_t *restrict a, const int64_t *restrict s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        a[2 * i] = (uint64_t)s[i];
        a[2 * i + 1] = s[i] < 0 ? UINT64_MAX : 0; /* sign extension */
    }
}

static void i128_add(uint64_t *restrict a, const int64_t *restrict s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        const uint64_t lo = a[2 * i] + (uint64_t)s[i];
        a[2 * i + 1] += (s[i] < 0 ? UINT64_MAX : 0) + (lo < a[2 * i]);
        a[2 * i] = lo;
    }
}

/* d = x + y; d may alias x (element by element, each read before written). */
static void i128_combine(uint64_t *d, const uint64_t *x, const uint64_t *y, size_t n) {
    for (size_t i = 0; i < n; i++) {
        const uint64_t lo = x[2 * i] + y[2 * i];
        d[2 * i + 1] = x[2 * i + 1] + y[2 * i + 1] + (lo < x[2 * i]);
        d[2 * i] = lo;
    }
}

/* floor((hi:lo) / n) for a signed 128-bit value and 1 <= n < 2^31, when
 * the quotient fits int64 (it does for a sum of n int64 values). Sums that
 * fit int64 themselves divide directly; others divide the magnitude in
 * 32-bit limbs (each partial dividend below 2^63) and round the negative
 * case down. The quotient's low word is exact, and it is all that is kept. */
static int64_t i128_floor_div(uint64_t lo, uint64_t hi, int64_t n) {
    if (hi == ((int64_t)lo < 0 ? UINT64_MAX : 0)) return floor_div64((int64_t)lo, n);
    const int neg = (int64_t)hi < 0;
    if (neg) { /* magnitude: -(hi:lo) */
        lo = ~lo + 1;
        hi = ~hi + (lo == 0);
    }
    const uint64_t d = (uint64_t)n;
    const uint32_t limb[4] = {(uint32_t)(hi >> 32), (uint32_t)hi, (uint32_t)(lo >> 32),
                              (uint32_t)lo};
    uint64_t rem = 0, q = 0;
    for (int k = 0; k < 4; k++) {
        const uint64_t cur = (rem << 32) | limb[k];
        q = (q << 32) | (cur / d); /* the top limbs' quotient bits fall off: low word */
        rem = cur % d;
    }
    return (int64_t)(neg ? (uint64_t)0 - (q + (rem != 0)) : q);
}

void ddp_acc_load(ddp_dtype t, ddp_redop op, void *acc, const void *src, size_t n) {
    switch (acc_of(t, op)) {
    case ACC_F32: ddp_convert_to_f32(t, acc, src, n); return;
    case ACC_I128: i128_load(acc, src, n); return;
    case ACC_I64:
        if (t == DDP_INT8) I64_LOAD(int8_t, acc, src, n);
        else if (t == DDP_UINT8) I64_LOAD(uint8_t, acc, src, n);
        else I64_LOAD(int32_t, acc, src, n);
        return;
    case ACC_NATIVE:
        if (n > 0 && acc != src) memcpy(acc, src, n * ddp_dtype_size(t));
        return;
    }
}

void ddp_acc_add(ddp_dtype t, ddp_redop op, void *acc, const void *src, size_t n) {
    switch (acc_of(t, op)) {
    case ACC_F32: ddp_reduce_acc(t, op, acc, src, n); return;
    case ACC_I128: i128_add(acc, src, n); return;
    case ACC_I64:
        if (t == DDP_INT8) I64_ADD(int8_t, acc, src, n);
        else if (t == DDP_UINT8) I64_ADD(uint8_t, acc, src, n);
        else I64_ADD(int32_t, acc, src, n);
        return;
    case ACC_NATIVE: ddp_reduce(t, op, acc, src, n); return;
    }
}

void ddp_acc_combine(ddp_dtype t, ddp_redop op, void *dst, const void *a, const void *b,
                     size_t n) {
    switch (acc_of(t, op)) {
    case ACC_F32: ddp_reduce3(DDP_FLOAT32, op, dst, a, b, n); return;
    case ACC_I64: ddp_reduce3(DDP_INT64, DDP_SUM, dst, a, b, n); return;
    case ACC_I128: i128_combine(dst, a, b, n); return;
    case ACC_NATIVE: ddp_reduce3(t, op, dst, a, b, n); return;
    }
}

void ddp_acc_store(ddp_dtype t, ddp_redop op, void *dst, void *acc, size_t n, int nranks) {
    const int64_t div = nranks > 1 && op == DDP_AVG ? nranks : 1;
    switch (acc_of(t, op)) {
    case ACC_F32:
        ddp_reduce_finish(DDP_FLOAT32, op, acc, n, nranks);
        ddp_convert_from_f32(t, dst, acc, n);
        return;
    case ACC_I128: {
        const uint64_t *a = acc;
        int64_t *d = dst;
        for (size_t i = 0; i < n; i++) d[i] = i128_floor_div(a[2 * i], a[2 * i + 1], div);
        return;
    }
    case ACC_I64:
        if (t == DDP_INT8) I64_STORE(int8_t, dst, acc, n, div);
        else if (t == DDP_UINT8) I64_STORE(uint8_t, dst, acc, n, div);
        else I64_STORE(int32_t, dst, acc, n, div);
        return;
    case ACC_NATIVE:
        if (n > 0 && dst != acc) memcpy(dst, acc, n * ddp_dtype_size(t));
        ddp_reduce_finish(t, op, dst, n, nranks);
        return;
    }
}
