/* py_reducer_pg.c - how a pyddp._C.Reducer holds and uses its process
 * group: attach (the bucket arrays, and a reference of its own on the
 * group's CPU transport, through which the C reducer launches its bucket
 * all-reduces: ddp_reducer_pg_ops over the ddp_pg table), the check that
 * the group was not destroyed, abort (on request, and on Ctrl-C during a
 * wait), and the drain waits through the one wait loop (ddp_py_wait).
 * Everything goes through the ddp_pg table (ddp_pg.h); nothing here knows
 * which transport is behind it.
 */
#include "py_common.h"

#include <string.h>
#include "py_reducer.h"

/* Drop *pg's reference, if any, and forget it. */
static void pg_drop(ddp_pg *pg) {
    if (pg->ops) pg->ops->release(pg->impl);
    memset(pg, 0, sizeof *pg);
}

/* Import the bucket arrays of the plan from the sequence `arrays`, each
 * checked against its bucket (CPU memory, dtype, element count), with their
 * addresses in ptrs. A PyMem array, or NULL with an exception. */
static ddp_py_array *import_buckets(const ddp_plan *p, PyObject *arrays, void **ptrs) {
    PyObject *fast = PySequence_Fast(arrays, "buckets must be a sequence of arrays");
    if (fast == NULL) return NULL;
    if ((size_t)PySequence_Fast_GET_SIZE(fast) != p->nbuckets) {
        Py_DECREF(fast);
        ddp_py_raise(DDP_ERR_INVALID, "Reducer.attach: wrong number of bucket arrays");
        return NULL;
    }
    ddp_py_array *bk = PyMem_Calloc(p->nbuckets ? p->nbuckets : 1, sizeof *bk);
    int ok = bk != NULL;
    if (!ok) PyErr_NoMemory();
    for (size_t b = 0; ok && b < p->nbuckets; b++) {
        ok = ddp_py_array_import(PySequence_Fast_GET_ITEM(fast, (Py_ssize_t)b), 1, "bucket",
                                 &bk[b]) == 0;
        if (ok && (bk[b].device != DDP_DEV_CPU || bk[b].dtype != p->bucket_dtype[b] ||
                   bk[b].count != p->bucket_numel[b])) {
            ddp_py_raise(DDP_ERR_INVALID, "Reducer.attach: a bucket array does not match the "
                         "plan (CPU memory, dtype and element count)");
            ok = 0;
        }
        if (ok) ptrs[b] = bk[b].ptr;
    }
    Py_DECREF(fast);
    if (!ok) {
        ddp_py_arrays_free(bk, p->nbuckets);
        return NULL;
    }
    return bk;
}

PyObject *ddp_py_reducer_attach(ReducerObject *self, PyObject *args) {
    PyObject *pg, *arrays;
    if (!PyArg_ParseTuple(args, "OO", &pg, &arrays)) return NULL;
    if (ddp_reducer_in_iteration(self->r) || self->buckets != NULL || self->cpu.ops != NULL)
        return ddp_py_raise(DDP_ERR_INVALID, "Reducer.attach: already attached");
    if (pg != Py_None && ddp_py_pg_cpu_ref(pg, &self->cpu) < 0) return NULL;
    const ddp_plan *p = ddp_reducer_plan(self->r);
    void **ptrs = PyMem_Calloc(p->nbuckets ? p->nbuckets : 1, sizeof *ptrs);
    ddp_py_array *bk = ptrs ? import_buckets(p, arrays, ptrs) : NULL;
    if (bk == NULL) {
        if (ptrs == NULL) PyErr_NoMemory();
        PyMem_Free(ptrs);
        pg_drop(&self->cpu);
        return NULL;
    }
    int world = self->cpu.ops ? self->cpu.ops->size(self->cpu.impl) : 1;
    /* ctx is our own ddp_pg: it lives (and keeps its reference) as long as we do */
    ddp_status st = ddp_reducer_attach(self->r, ptrs, &ddp_reducer_pg_ops, &self->cpu, world);
    PyMem_Free(ptrs);
    if (st != DDP_OK) {
        ddp_py_arrays_free(bk, p->nbuckets);
        pg_drop(&self->cpu);
        return ddp_py_raise(st, NULL);
    }
    self->buckets = bk;
    self->pg = pg == Py_None ? NULL : Py_NewRef(pg);
    Py_RETURN_NONE;
}

int ddp_py_reducer_check_pg(ReducerObject *self) {
    if (self->pg == NULL) return 0;
    PyObject *d = PyObject_GetAttrString(self->pg, "destroyed");
    if (d == NULL) return -1;
    int destroyed = PyObject_IsTrue(d);
    Py_DECREF(d);
    if (destroyed) {
        ddp_py_raise(DDP_ERR_INVALID, "DDP: the process group this model was wrapped with "
                     "was destroyed; wrap the model again after init_process_group()");
        return -1;
    }
    return 0;
}

PyObject *ddp_py_reducer_abort(ReducerObject *self, PyObject *args) {
    const char *reason = "DDP failed on this rank";
    if (!PyArg_ParseTuple(args, "|s", &reason)) return NULL;
    if (self->cpu.ops) self->cpu.ops->abort(self->cpu.impl, reason);
    Py_RETURN_NONE;
}

void ddp_py_reducer_abort_on_signal(ReducerObject *self) {
    if (self->cpu.ops)
        self->cpu.ops->abort(self->cpu.impl, "interrupted (Ctrl-C) during the DDP gradient "
                             "all-reduce");
}

static int drain_slice(void *p, ddp_wait slice) {
    return ddp_reducer_drain(((ReducerObject *)p)->r, slice) == DDP_OK;
}

static void drain_on_signal(void *p) { ddp_py_reducer_abort_on_signal(p); }

int ddp_py_reducer_drain_blocking(ReducerObject *self) {
    if (self->r == NULL || ddp_reducer_pending(self->r) == 0) {
        if (self->r) ddp_reducer_drain(self->r, ddp_wait_for(0, NULL));
        return 0;
    }
    return ddp_py_wait(drain_slice, self, -1, drain_on_signal) < 0 ? -1 : 0;
}

void ddp_py_reducer_drain_quietly(ReducerObject *self) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    if (ddp_py_reducer_drain_blocking(self) < 0) {
        if (PyErr_ExceptionMatches(PyExc_KeyboardInterrupt)) {
            PyErr_Clear();
            PyErr_SetInterrupt();
        } else {
            PyErr_WriteUnraisable((PyObject *)self);
        }
    }
    PyErr_Restore(et, ev, tb);
}

void ddp_py_reducer_detach(ReducerObject *self) {
    if (self->buckets != NULL) ddp_py_arrays_free(self->buckets, ddp_reducer_plan(self->r)->nbuckets);
    self->buckets = NULL;
    pg_drop(&self->cpu);
    Py_CLEAR(self->pg);
}
