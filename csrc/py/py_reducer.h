/* py_reducer.h - what the files of pyddp._C.Reducer share: the object
 * (py_reducer.c: the type, readiness bookkeeping, gradients handed to the CPU
 * data path, finish), how it holds and uses its process group (py_reducer_pg.c:
 * attach, the destroyed check, abort, the drain waits), and the bucket plan
 * read from and described to Python (py_reducer_plan.c). Every function here
 * needs the GIL.
 */
#ifndef DDP_PY_REDUCER_H
#define DDP_PY_REDUCER_H

#include "py_common.h"
#include "ddp_pg.h"
#include "ddp_reducer.h"
#include "py_array.h"

typedef struct {
    PyObject_HEAD
    ddp_reducer *r;
    PyObject *pg;           /* the _C.ProcessGroup; NULL when unattached */
    ddp_pg cpu;             /* its CPU transport, a reference of our own (valid even
                             * after pg is destroyed; the reducer launches through it);
                             * ops NULL when unattached */
    ddp_py_array *buckets;  /* [nbuckets] imported bucket arrays */
    ddp_py_array *grads;    /* [nparams] gradients held for this iteration */
} ReducerObject;

/* ---- py_reducer_pg.c ---- */

/* attach(pg_or_None, buckets): import the bucket arrays, take a reference on
 * pg's CPU transport and give both to the C reducer (ddp_reducer_pg_ops). */
PyObject *ddp_py_reducer_attach(ReducerObject *self, PyObject *args);

/* abort(reason): break the attached process group (peers fail fast). */
PyObject *ddp_py_reducer_abort(ReducerObject *self, PyObject *args);

/* Break the attached group because a signal handler raised (Ctrl-C), so the
 * in-flight all-reduces and the peers' waits on this rank end now. */
void ddp_py_reducer_abort_on_signal(ReducerObject *self);

/* The attached process group must not have been destroyed (destroy_process_group()
 * ends it even while this Reducer, which keeps the memory alive by its
 * reference, still uses it). 0, or -1 with an exception. */
int ddp_py_reducer_check_pg(ReducerObject *self);

/* Wait until every launched all-reduce finished (GIL released, Ctrl-C
 * aborts the group). 0, or -1 with the signal handler's exception set. */
int ddp_py_reducer_drain_blocking(ReducerObject *self);

/* The same where no exception may be raised (dealloc, error paths): an
 * interrupt is re-delivered to the main thread, other errors reported. */
void ddp_py_reducer_drain_quietly(ReducerObject *self);

/* Let go of the bucket arrays and the process group (after a drain). */
void ddp_py_reducer_detach(ReducerObject *self);

/* ---- py_reducer.c, py_reducer_plan.c ---- */

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
