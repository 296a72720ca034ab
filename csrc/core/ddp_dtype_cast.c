/* ddp_dtype_cast.c - gradient narrowing and widening for DDP's reduce_dtype
 * (contract in ddp_dtype_cast.h).
 *
 * Narrowing rounds exactly once. The quotient src / divisor is formed in
 * double (exact for a float32 src up to a last-place error far below any
 * half-precision tie), brought to float32 with round-to-odd (truncate, then
 * set the lowest bit if anything was dropped; with 13 or more spare bits
 * this keeps the final rounding correct), and rounded to float16/bfloat16
 * by ddp_dtype.c's round-to-nearest-even converters. The float32 staging
 * runs in cache-sized blocks, so each element is read from and written to
 * memory once.
 */
#include "ddp_dtype_cast.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Elements per staging block: 16 KiB of float32, well inside L1/L2. */
#define BLOCK 4096

int ddp_cast_narrows(ddp_dtype t, ddp_dtype reduce) {
    return (reduce == DDP_FLOAT16 || reduce == DDP_BFLOAT16) &&
           (t == DDP_FLOAT32 || t == DDP_FLOAT64);
}

/* The exact value hi + (something of sign `below`: -1, 0 or 1, smaller than
 * half a double ulp of hi) rounded to float32 with round-to-odd: the nearest
 * float32 toward zero, with its last mantissa bit set when anything was
 * dropped. Beyond FLT_MAX it gives FLT_MAX (odd), which the narrower types
 * round to Inf as they should; NaN stays NaN. */
static inline float f32_round_odd(double hi, int below) {
    float f = (float)hi;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    double back = (double)f;
    /* back != hi: hi is off the float32 grid, and so is the exact value, on
     * the same side of back. back == hi: the exact value is off by `below`. */
    uint32_t off_grid = back != hi;                /* also 1 for NaN: stays NaN */
    uint32_t inexact = off_grid | (below != 0);
    uint32_t away = off_grid ? fabs(back) > fabs(hi)
                             : (below != 0 && (below < 0) != (hi < 0));
    u = (u - (inexact & away)) | inexact;          /* one step toward zero, then odd */
    memcpy(&f, &u, sizeof f);
    return f;
}

void ddp_cast_narrow(ddp_dtype to, void *dst, ddp_dtype from, const void *src, size_t n,
                     int divisor) {
    float stage[BLOCK];
    const double dv = divisor > 1 ? (double)divisor : 1.0;
    /* Dividing by a power of two is exact in double. For float32 sources
     * the double quotient never lands on a float16/bfloat16 rounding tie
     * unless the exact quotient is that tie (float32 has 29 bits fewer than
     * double), so only float64 by other divisors needs the exact residual
     * (fma) to know on which side of its double the quotient lies. */
    const int exact = divisor <= 1 || (divisor & (divisor - 1)) == 0;
    char *out = dst;
    const size_t osz = ddp_dtype_size(to);
    for (size_t at = 0; at < n; at += BLOCK) {
        size_t k = n - at < BLOCK ? n - at : BLOCK;
        if (from == DDP_FLOAT64 && exact) {
            const double *s = (const double *)src + at;
            for (size_t i = 0; i < k; i++) stage[i] = f32_round_odd(s[i] / dv, 0);
        } else if (from == DDP_FLOAT64) {
            const double *s = (const double *)src + at;
            for (size_t i = 0; i < k; i++) {
                double q = s[i] / dv;
                double r = fma(-q, dv, s[i]);      /* s - q * dv, exactly */
                stage[i] = f32_round_odd(q, (r > 0) - (r < 0));
            }
        } else if (dv == 1.0) {                    /* float32 / 1: already exact */
            memcpy(stage, (const float *)src + at, k * sizeof(float));
        } else {
            const float *s = (const float *)src + at;
            for (size_t i = 0; i < k; i++) stage[i] = f32_round_odd((double)s[i] / dv, 0);
        }
        ddp_convert_from_f32(to, out + at * osz, stage, k);
    }
}

void ddp_cast_widen(ddp_dtype to, void *dst, ddp_dtype from, const void *src, size_t n) {
    if (to == DDP_FLOAT32) {
        ddp_convert_to_f32(from, dst, src, n);
        return;
    }
    float stage[BLOCK];
    const char *in = src;
    const size_t isz = ddp_dtype_size(from);
    double *d = dst;
    for (size_t at = 0; at < n; at += BLOCK) {
        size_t k = n - at < BLOCK ? n - at : BLOCK;
        ddp_convert_to_f32(from, stage, in + at * isz, k);
        for (size_t i = 0; i < k; i++) d[at + i] = (double)stage[i];
    }
}
