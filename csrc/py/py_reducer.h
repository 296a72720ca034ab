/* py_reducer.h - what the DDP files of the binding layer share about the
 * reducer: the core reducer behind a _C.Reducer (py_reducer.c), and the bucket
 * plan read from and described to Python (py_reducer_plan.c). Called with the
 * GIL. */
#ifndef DDP_PY_REDUCER_H
#define DDP_PY_REDUCER_H

#include "py_common.h"
#include "ddp_reducer.h"

/* The core reducer of a pyddp._C.Reducer (borrowed: valid while obj is), or
 * NULL with TypeError when obj is not one. */
ddp_reducer *ddp_py_reducer_core(PyObject *obj);

/* Plan the buckets for Reducer(params, first_cap_bytes, cap_bytes, order,
 * reduce_dtype) (see py_reducer.c). 0 with *out owning the plan, or -1 with
 * an exception and *out owning nothing. */
int ddp_py_plan_parse(PyObject *params, Py_ssize_t first_cap, Py_ssize_t cap, PyObject *order,
                      PyObject *reduce_dtype, ddp_plan *out);

/* Reducer.layout(): ([(members, numel, dtype name, device key)], param_bucket,
 * param_offset), or NULL with an exception. */
PyObject *ddp_py_plan_layout(const ddp_plan *p);

/* Reducer.bucket_rules(world_size): [(narrow, divisor, op)] per bucket
 * (ddp_plan_bucket_rule), or NULL with an exception. */
PyObject *ddp_py_plan_bucket_rules(const ddp_plan *p, int world_size);

/* A new list of the n values of v, or NULL with an exception. */
PyObject *ddp_py_size_list(const size_t *v, size_t n);

#endif
