/* coll_values.h - read and write element i of a buffer of any ddp dtype as a
 * double, for the collective tests' inputs and reference checks. */
#ifndef COLL_VALUES_H
#define COLL_VALUES_H
#include <stdint.h>
#include "ddp_dtype.h"

static inline void put(ddp_dtype t, void *p, size_t i, double v) {
    switch (t) {
    case DDP_FLOAT16: ((uint16_t *)p)[i] = ddp_float_to_half((float)v); break;
    case DDP_BFLOAT16: ((uint16_t *)p)[i] = ddp_float_to_bf16((float)v); break;
    case DDP_FLOAT32: ((float *)p)[i] = (float)v; break;
    case DDP_FLOAT64: ((double *)p)[i] = v; break;
    case DDP_INT8: ((int8_t *)p)[i] = (int8_t)v; break;
    case DDP_UINT8: case DDP_BOOL: ((uint8_t *)p)[i] = (uint8_t)v; break;
    case DDP_INT32: ((int32_t *)p)[i] = (int32_t)v; break;
    case DDP_INT64: ((int64_t *)p)[i] = (int64_t)v; break;
    default: break;
    }
}

static inline double get(ddp_dtype t, const void *p, size_t i) {
    switch (t) {
    case DDP_FLOAT16: return ddp_half_to_float(((const uint16_t *)p)[i]);
    case DDP_BFLOAT16: return ddp_bf16_to_float(((const uint16_t *)p)[i]);
    case DDP_FLOAT32: return ((const float *)p)[i];
    case DDP_FLOAT64: return ((const double *)p)[i];
    case DDP_INT8: return ((const int8_t *)p)[i];
    case DDP_UINT8: case DDP_BOOL: return ((const uint8_t *)p)[i];
    case DDP_INT32: return ((const int32_t *)p)[i];
    case DDP_INT64: return (double)((const int64_t *)p)[i];
    default: return 0;
    }
}

#endif
