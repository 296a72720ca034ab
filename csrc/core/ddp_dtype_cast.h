/* ddp_dtype_cast.h - conversions between a gradient's dtype and the narrower
 * dtype DDP reduces it in (DistributedDataParallel's reduce_dtype=).
 *
 * Gradients of float32 or float64 may be reduced as float16 or bfloat16: the
 * copy into the bucket narrows them (and divides by the world size, so the
 * sum across ranks is the average and cannot overflow where the float32 sum
 * would not), the copy out widens the average back. Both are single passes,
 * the same passes that copy a gradient into and out of its bucket anyway.
 */
#ifndef DDP_DTYPE_CAST_H
#define DDP_DTYPE_CAST_H

#include <stddef.h>
#include "ddp_dtype.h"

/* 1 if gradients of dtype t are reduced as `reduce` (float16 or bfloat16):
 * t is float32 or float64, i.e. wider. 0 for every other pair. */
int ddp_cast_narrows(ddp_dtype t, ddp_dtype reduce);

/* dst[i] = src[i] / divisor rounded to `to` (float16 or bfloat16) with
 * round-to-nearest-even, correctly rounded (one rounding of the exact
 * quotient, no double rounding), for src of dtype `from` = float32 or
 * float64. Values too large for a float16 become Inf; NaN stays NaN.
 * divisor >= 1. dst and src do not overlap. */
void ddp_cast_narrow(ddp_dtype to, void *dst, ddp_dtype from, const void *src, size_t n,
                     int divisor);

/* dst[i] = src[i] exactly, widening a float16/bfloat16 `from` to a float32
 * or float64 `to`. dst and src do not overlap. */
void ddp_cast_widen(ddp_dtype to, void *dst, ddp_dtype from, const void *src, size_t n);

#endif
