/* ddp_dtype.h - element types and reduction operations.
 *
 * Reduction kernels combine `n` elements of `src` into `dst` in place
 * (dst[i] = dst[i] op src[i]). float16 and bfloat16 are converted to float32,
 * combined, and rounded back (round-to-nearest-even) on each call; the
 * collectives that need float32 accumulation over several steps convert to
 * float32 staging buffers (ddp_convert_to_f32), reduce there as DDP_FLOAT32
 * or with ddp_reduce_acc, and round once at the end. Kernels are plain loops
 * written so that the compiler vectorises them.
 */
#ifndef DDP_DTYPE_H
#define DDP_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include "ddp_status.h"

typedef enum ddp_dtype {
    DDP_FLOAT16 = 0, DDP_BFLOAT16, DDP_FLOAT32, DDP_FLOAT64,
    DDP_INT8, DDP_UINT8, DDP_INT32, DDP_INT64, DDP_BOOL,
    DDP_DTYPE_COUNT
} ddp_dtype;

typedef enum ddp_redop {
    DDP_SUM = 0, DDP_AVG, DDP_MIN, DDP_MAX, DDP_PRODUCT, DDP_REDOP_COUNT
} ddp_redop;

size_t ddp_dtype_size(ddp_dtype t);
const char *ddp_dtype_name(ddp_dtype t);
const char *ddp_redop_name(ddp_redop op);
/* DDP_OK if op is defined for t (e.g. SUM on bool is logical or), else
 * DDP_ERR_TYPE with a message. */
ddp_status ddp_redop_check(ddp_dtype t, ddp_redop op);

/* dst[i] = dst[i] op src[i] for i < n. AVG combines as SUM (the division is
 * applied once, at the end, by ddp_reduce_finish or ddp_acc_store); integers
 * wrap, so integer AVG must go through the accumulators below. */
void ddp_reduce(ddp_dtype t, ddp_redop op, void *dst, const void *src, size_t n);

/* dst[i] = dst[i] op src[i] and out[i] = the same value, in one pass (the
 * three do not overlap): a result kept and sent on at once. */
void ddp_reduce_dup(ddp_dtype t, ddp_redop op, void *dst, void *out, const void *src,
                    size_t n);

/* dst[i] = a[i] op b[i] (out of place; dst may alias a). */
void ddp_reduce3(ddp_dtype t, ddp_redop op, void *dst, const void *a,
                 const void *b, size_t n);

/* acc[i] = acc[i] op float(src[i]) for a float16 or bfloat16 src (float32
 * accumulation without a separate conversion pass). Other t: no-op. */
void ddp_reduce_acc(ddp_dtype t, ddp_redop op, float *acc, const void *src, size_t n);

/* After a SUM-style reduction across `nranks`, apply AVG's division in place:
 * floats divide (sum then one division, as torch does); integers floor-divide
 * (rounding toward minus infinity, like NumPy's and torch's //), which is
 * exact only if the sum itself fitted the type: the collectives never call
 * it for integers, they accumulate integer AVG in a wider type (below).
 * No-op for other ops. */
void ddp_reduce_finish(ddp_dtype t, ddp_redop op, void *buf, size_t n, int nranks);

/* ---- accumulators ------------------------------------------------------
 * A reduction across ranks combines the contributions in an accumulator
 * type, which is the element type itself except for:
 *   - float16/bfloat16, any op: float32, rounded once at the end;
 *   - AVG of int8, uint8, int32: int64 (fewer than 2^32 contributions of
 *     magnitude at most 2^31 sum to less than 2^63: never wraps);
 *   - AVG of int64: a 128-bit two's-complement integer stored as two
 *     uint64_t words, low word first (exact for any world size).
 * So integer AVG is the exact mean rounded toward minus infinity (floor,
 * as NumPy's and torch's //), never a wrapped sum divided; the result
 * always fits the element type. Partial sums that travel between ranks
 * travel in the accumulator type (chain algorithms), except on the ring,
 * where float16/bfloat16 partial sums travel in their own type (combined in
 * float32 and rounded at each step: see ddp_coll_wire_wide). Float AVG stays a sum and one division at the end.
 * Buffers of the accumulator type hold n * ddp_acc_size(t, op) bytes. */
size_t ddp_acc_size(ddp_dtype t, ddp_redop op);
/* 1 if the accumulator is the element type itself (no staging needed). */
int ddp_acc_is_native(ddp_dtype t, ddp_redop op);
/* acc = src widened (src in the element type). */
void ddp_acc_load(ddp_dtype t, ddp_redop op, void *acc, const void *src, size_t n);
/* acc = acc op src widened (src in the element type). */
void ddp_acc_add(ddp_dtype t, ddp_redop op, void *acc, const void *src, size_t n);
/* dst = a op b, all three in the accumulator type (dst may alias a). */
void ddp_acc_combine(ddp_dtype t, ddp_redop op, void *dst, const void *a, const void *b,
                     size_t n);
/* dst = the final value of acc in the element type, after AVG's division by
 * nranks. dst either is acc (native accumulators only) or does not overlap
 * it; acc's contents are clobbered. */
void ddp_acc_store(ddp_dtype t, ddp_redop op, void *dst, void *acc, size_t n, int nranks);

/* half <-> float conversions (exposed for tests and staging). */
float ddp_half_to_float(uint16_t h);
uint16_t ddp_float_to_half(float f);
float ddp_bf16_to_float(uint16_t h);
uint16_t ddp_float_to_bf16(float f);
/* Whole-array conversions for t = FLOAT16, BFLOAT16 (or FLOAT32: a copy). */
void ddp_convert_to_f32(ddp_dtype t, float *dst, const void *src, size_t n);
void ddp_convert_from_f32(ddp_dtype t, void *dst, const float *src, size_t n);

#endif
