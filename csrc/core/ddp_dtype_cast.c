/* ddp_dtype_cast.c - gradient narrowing and widening for DDP's reduce_dtype
 * (contract in ddp_dtype_cast.h).
 *
 * Narrowing rounds exactly once. The quotient q = src / divisor is formed in
 * double, brought to float32 with round-to-odd (truncate, then set the
 * lowest bit if anything was dropped; with 13 or more spare bits this keeps
 * the final rounding correct), and rounded to float16/bfloat16 by
 * ddp_dtype.c's round-to-nearest-even converters. The double rounding of q
 * never decides a tie: a tie t of the narrow type times the integer divisor
 * lies on src's grid (for divisors below 2^12), so q != t means
 * |q - t| >= ulp(src) / divisor, more than half an ulp of q in double, and
 * the double quotient stays on q's side of t. The float32 staging runs in
 * cache-sized blocks, so each element is read from and written to memory
 * once.
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

/* d rounded to float32 with round-to-odd: the nearest float32 toward zero,
 * with its last mantissa bit set when d was not exactly representable.
 * Beyond FLT_MAX it gives FLT_MAX (odd), which the narrower types round to
 * Inf as they should; NaN stays NaN. */
static inline float f32_round_odd(double d) {
    union { float f; uint32_t u; } v = {.f = (float)d};
    const double back = (double)v.f;
    const uint32_t inexact = back != d;            /* also 1 for NaN: stays NaN */
    const uint32_t away = fabs(back) > fabs(d);    /* rounded up in magnitude */
    v.u = (v.u - (inexact & away)) | inexact;      /* one step toward zero, then odd */
    return v.f;
}

void ddp_cast_narrow(ddp_dtype to, void *dst, ddp_dtype from, const void *src, size_t n,
                     int divisor) {
    float stage[BLOCK];
    double quot[BLOCK];
    const double dv = divisor > 1 ? (double)divisor : 1.0;
    char *out = dst;
    const size_t osz = ddp_dtype_size(to);
    for (size_t at = 0; at < n; at += BLOCK) {
        size_t k = n - at < BLOCK ? n - at : BLOCK;
        if (from == DDP_FLOAT64) {
            const double *s = (const double *)src + at;
            for (size_t i = 0; i < k; i++) stage[i] = f32_round_odd(s[i] / dv);
        } else if (dv == 1.0) {                    /* float32 / 1: already exact */
            memcpy(stage, (const float *)src + at, k * sizeof(float));
        } else {
            /* the quotients first (a loop the compiler vectorises), then round-odd */
            const float *s = (const float *)src + at;
            for (size_t i = 0; i < k; i++) quot[i] = (double)s[i] / dv;
            for (size_t i = 0; i < k; i++) stage[i] = f32_round_odd(quot[i]);
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
