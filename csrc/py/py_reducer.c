/* py_reducer.c - pyddp._C.Reducer: the Python face of the gradient reducer
 * (csrc/core/ddp_reducer.h). pyddp/ddp/_reducer.py drives it. How it holds
 * and uses its process group (attach, abort, the drain waits) is in
 * py_reducer_pg.c.
 *
 * Reducer(params, first_cap_bytes, cap_bytes, order=None, reduce_dtype=None)
 *     params: sequence of (numel, dtype name, device key); plans the buckets.
 *     reduce_dtype: None, "float16" or "bfloat16" (float32/float64 gradients
 *     reduced in that dtype: ddp_plan_buckets_as).
 *   layout() -> (buckets, param_bucket, param_offset), buckets being
 *     [(members, numel, dtype name, device key)], for allocating them (the
 *     dtype is the bucket's own, the reduce dtype for narrowed buckets);
 *     bucket_rules(world_size) -> [(narrow, divisor, op)], how each bucket is
 *     filled and all-reduced (ddp_plan_bucket_rule; the plan's face is
 *     py_reducer_plan.c).
 *   Bookkeeping (both paths): begin(), mark_ready(i) -> (first, count),
 *     note_used(i), unready(), arrival(), local_used(), end().
 *   CPU data path: attach(pg, buckets) with a _C.ProcessGroup (or None for
 *     one rank); ready(i, grad, copy_back[, ptr, count, dtype]);
 *     finish(track_used);
 *     global_used(); drain().
 *
 * The Reducer holds references to the bucket arrays and to every gradient
 * handed to ready() until the iteration's finish/drain, so the memory the
 * communicator's worker thread reads and writes stays alive whatever the
 * caller drops. Large gradient copies and every wait run with the GIL
 * released; waits wake every 100 ms for Ctrl-C, which breaks the process
 * group (so peers fail fast), waits for the in-flight all-reduces to let go
 * of the buckets, and raises KeyboardInterrupt.
 */
#include "py_common.h"

#include <string.h>
#include "py_reducer.h"

/* Copies at least this large run with the GIL released. */
#define RELEASE_GIL_BYTES (64 * 1024)

static PyTypeObject *ReducerType;

static PyObject *reducer_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"params", "first_cap_bytes", "cap_bytes", "order", "reduce_dtype",
                             NULL};
    PyObject *params, *order_obj = Py_None, *reduce_obj = Py_None;
    Py_ssize_t first_cap, cap;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Onn|OO", kwlist, &params, &first_cap, &cap,
                                     &order_obj, &reduce_obj))
        return NULL;
    ddp_plan plan;
    if (ddp_py_plan_parse(params, first_cap, cap, order_obj, reduce_obj, &plan) < 0) return NULL;
    size_t n = plan.nparams;
    ReducerObject *self = (ReducerObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        ddp_plan_free(&plan);
        return NULL;
    }
    ddp_status st = ddp_reducer_create(&plan, &self->r);
    self->grads = PyMem_Calloc(n ? n : 1, sizeof *self->grads);
    if (st != DDP_OK || self->grads == NULL) {
        if (st != DDP_OK) ddp_py_raise(st, NULL); else PyErr_NoMemory();
        Py_CLEAR(self);
    }
    return (PyObject *)self;
}

/* Drop the gradients held for the iteration. */
static void release_grads(ReducerObject *self) {
    size_t n = ddp_reducer_plan(self->r)->nparams;
    for (size_t i = 0; i < n; i++) ddp_py_array_release(&self->grads[i]);
}

static void reducer_dealloc(ReducerObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    if (self->r) {
        ddp_py_reducer_drain_quietly(self);   /* the worker may still use the buckets */
        release_grads(self);
    }
    ddp_py_reducer_detach(self);
    ddp_reducer_destroy(self->r);
    PyMem_Free(self->grads);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* Use flags and counts (never negative) as a list of ints. */
static PyObject *int32_list(const int32_t *v, size_t n) {
    size_t *tmp = PyMem_Malloc((n ? n : 1) * sizeof *tmp);
    if (tmp == NULL) return PyErr_NoMemory();
    for (size_t i = 0; i < n; i++) tmp[i] = (size_t)(v[i] > 0 ? v[i] : 0);
    PyObject *l = ddp_py_size_list(tmp, n);
    PyMem_Free(tmp);
    return l;
}

static PyObject *reducer_layout(ReducerObject *self, PyObject *unused) {
    return ddp_py_plan_layout(ddp_reducer_plan(self->r));
}

static PyObject *reducer_bucket_rules(ReducerObject *self, PyObject *args) {
    int world;
    if (!PyArg_ParseTuple(args, "i", &world)) return NULL;
    return ddp_py_plan_bucket_rules(ddp_reducer_plan(self->r), world);
}

static PyObject *check_status(ddp_status st) {
    if (st != DDP_OK) return ddp_py_raise(st, NULL);
    Py_RETURN_NONE;
}

static PyObject *reducer_begin(ReducerObject *self, PyObject *unused) {
    return check_status(ddp_reducer_begin(self->r));
}

static PyObject *reducer_end(ReducerObject *self, PyObject *unused) {
    ddp_reducer_end(self->r);
    Py_RETURN_NONE;
}

/* 0 if i names a parameter of the plan, else -1 with IndexError. */
static int index_in_range(ReducerObject *self, size_t i) {
    if (i < ddp_reducer_plan(self->r)->nparams) return 0;
    PyErr_Format(PyExc_IndexError, "parameter index %zu out of range", i);
    return -1;
}

static int param_index(ReducerObject *self, PyObject *arg, size_t *i) {
    *i = PyLong_AsSize_t(arg);
    if (*i == (size_t)-1 && PyErr_Occurred()) return -1;
    return index_in_range(self, *i);
}

static PyObject *reducer_mark_ready(ReducerObject *self, PyObject *arg) {
    size_t i, first, count;
    if (param_index(self, arg, &i) < 0) return NULL;
    ddp_status st = ddp_reducer_mark_ready(self->r, i, &first, &count);
    if (st != DDP_OK) return ddp_py_raise(st, NULL);
    return Py_BuildValue("(nn)", (Py_ssize_t)first, (Py_ssize_t)count);
}

static PyObject *reducer_note_used(ReducerObject *self, PyObject *arg) {
    size_t i;
    if (param_index(self, arg, &i) < 0) return NULL;
    ddp_reducer_note_used(self->r, i);
    Py_RETURN_NONE;
}

/* A list of the parameter indices that fill(r, out, cap) reports. */
static PyObject *index_list(ReducerObject *self,
                            size_t (*fill)(const ddp_reducer *, size_t *, size_t)) {
    size_t n = ddp_reducer_plan(self->r)->nparams;
    size_t *idx = PyMem_Malloc((n ? n : 1) * sizeof *idx);
    if (idx == NULL) return PyErr_NoMemory();
    size_t k = fill(self->r, idx, n);
    PyObject *l = ddp_py_size_list(idx, k);
    PyMem_Free(idx);
    return l;
}

static PyObject *reducer_unready(ReducerObject *self, PyObject *unused) {
    return index_list(self, ddp_reducer_unready);
}

static PyObject *reducer_arrival(ReducerObject *self, PyObject *unused) {
    return index_list(self, ddp_reducer_arrival);
}

static PyObject *reducer_local_used(ReducerObject *self, PyObject *unused) {
    return int32_list(ddp_reducer_local_used(self->r), ddp_reducer_plan(self->r)->nparams);
}

static PyObject *reducer_global_used(ReducerObject *self, PyObject *unused) {
    return int32_list(ddp_reducer_global_used(self->r), ddp_reducer_plan(self->r)->nparams);
}

/* ---- CPU data path ---------------------------------------------------- */

/* Hand gradient g (owned by the call: released or kept) of parameter i to
 * the C reducer; see ddp_py_reducer_ready in py_common.h. */
static PyObject *ready_array(ReducerObject *self, size_t i, ddp_py_array g, int copy_back) {
    size_t bytes = g.count * ddp_dtype_size(g.dtype);
    ddp_status st;
    if (bytes >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        st = ddp_reducer_ready(self->r, i, g.ptr, g.dtype, g.count, copy_back ? g.ptr : NULL);
        Py_END_ALLOW_THREADS
    } else {
        st = ddp_reducer_ready(self->r, i, g.ptr, g.dtype, g.count, copy_back ? g.ptr : NULL);
    }
    /* Keep the gradient alive until finish when the average lands in it
     * (marked ready means it was accepted, even if a launch then failed). */
    if (copy_back && g.owner != NULL && ddp_reducer_slot(self->r, i) != g.ptr &&
        st != DDP_ERR_TYPE && st != DDP_ERR_INVALID) {
        ddp_py_array_release(&self->grads[i]);
        self->grads[i] = g;
    } else {
        ddp_py_array_release(&g);
    }
    return check_status(st);
}

/* Checks shared by both entries: buckets attached, group not destroyed. */
static int ready_checks(ReducerObject *self) {
    if (self->buckets == NULL) {
        ddp_py_raise(DDP_ERR_INVALID, "Reducer.ready: no buckets attached");
        return -1;
    }
    return ddp_py_reducer_check_pg(self);
}

ddp_reducer *ddp_py_reducer_core(PyObject *obj) {
    if (PyObject_TypeCheck(obj, ReducerType)) return ((ReducerObject *)obj)->r;
    ddp_py_raise(DDP_ERR_TYPE, "not a pyddp._C.Reducer");
    return NULL;
}

PyObject *ddp_py_reducer_ready(PyObject *reducer, size_t i, PyObject *owner, void *ptr,
                               size_t count, int dtype, int copy_back) {
    if (!PyObject_TypeCheck(reducer, ReducerType))
        return ddp_py_raise(DDP_ERR_TYPE, "not a pyddp._C.Reducer");
    ReducerObject *self = (ReducerObject *)reducer;
    if (index_in_range(self, i) < 0 || ready_checks(self) < 0) return NULL;
    if (dtype < 0 || dtype >= DDP_DTYPE_COUNT || (ptr == NULL && count > 0))
        return ddp_py_raise(DDP_ERR_INVALID, "Reducer.ready: invalid gradient buffer");
    ddp_py_array g;
    memset(&g, 0, sizeof g);
    g.ptr = ptr;
    g.count = count;
    g.dtype = (ddp_dtype)dtype;
    g.device = DDP_DEV_CPU;
    g.owner = Py_NewRef(owner);
    return ready_array(self, i, g, copy_back);
}

/* ready(i, grad, copy_back[, ptr, count, dtype]): with ptr, count and dtype
 * (a ddp_dtype code) grad is not imported: it is the owner (kept alive, like
 * an imported one) of `count` contiguous host elements at address ptr (a
 * CPU torch tensor's data_ptr(): no DLPack capsule or NumPy view per call). */
static PyObject *reducer_ready(ReducerObject *self, PyObject *args) {
    PyObject *idx, *grad, *ptro = NULL;
    int copy_back, dt = -1;
    long long count = -1;
    if (!PyArg_ParseTuple(args, "OOp|OLi", &idx, &grad, &copy_back, &ptro, &count, &dt))
        return NULL;
    size_t i;
    if (param_index(self, idx, &i) < 0) return NULL;
    if (ptro != NULL) {
        void *ptr = PyLong_AsVoidPtr(ptro);
        if (PyErr_Occurred()) return NULL;
        if (grad == Py_None || count < 0)
            return ddp_py_raise(DDP_ERR_INVALID, "Reducer.ready: invalid gradient buffer");
        return ddp_py_reducer_ready((PyObject *)self, i, grad, ptr, (size_t)count, dt,
                                    copy_back);
    }
    if (ready_checks(self) < 0) return NULL;
    ddp_py_array g;
    memset(&g, 0, sizeof g);
    if (grad != Py_None) {
        if (ddp_py_array_import(grad, copy_back, "gradient", &g) < 0) return NULL;
        if (g.device != DDP_DEV_CPU) {
            ddp_py_array_release(&g);
            return ddp_py_raise(DDP_ERR_TYPE, "DDP: a gradient is on a GPU but the CPU "
                                "reducer is in use");
        }
    }
    return ready_array(self, i, g, copy_back);
}

static PyObject *reducer_finish(ReducerObject *self, PyObject *args) {
    int track_used;
    if (!PyArg_ParseTuple(args, "p", &track_used)) return NULL;
    if (self->buckets == NULL)
        return ddp_py_raise(DDP_ERR_INVALID, "Reducer.finish: no buckets attached");
    if (ddp_py_reducer_check_pg(self) < 0) {
        /* Its work failed when the communicator went away: let go of it. */
        ddp_py_reducer_drain_quietly(self);
        release_grads(self);
        return NULL;
    }
    ddp_status st;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        st = ddp_reducer_finish(self->r, track_used, ddp_wait_for(100, NULL));
        Py_END_ALLOW_THREADS
        if (st != DDP_ERR_TIMEOUT || !ddp_reducer_in_iteration(self->r) ||
            ddp_reducer_pending(self->r) == 0)
            break;
        if (PyErr_CheckSignals() < 0) {
            /* Ctrl-C: break the group so our all-reduces (and the peers'
             * waits on us) end now, then let go of everything. */
            ddp_py_reducer_abort_on_signal(self);
            PyObject *et, *ev, *tb;
            PyErr_Fetch(&et, &ev, &tb);
            ddp_py_reducer_drain_quietly(self);
            release_grads(self);
            PyErr_Restore(et, ev, tb);
            return NULL;
        }
    }
    if (st == DDP_OK || !ddp_reducer_in_iteration(self->r)) release_grads(self);
    return check_status(st);
}

static PyObject *reducer_drain(ReducerObject *self, PyObject *unused) {
    int rc = ddp_py_reducer_drain_blocking(self);
    release_grads(self);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *reducer_get_in_iteration(ReducerObject *self, void *c) {
    return PyBool_FromLong(ddp_reducer_in_iteration(self->r));
}

static PyObject *reducer_get_pending(ReducerObject *self, void *c) {
    return PyLong_FromSize_t(ddp_reducer_pending(self->r));
}

static PyObject *reducer_get_nbuckets(ReducerObject *self, void *c) {
    return PyLong_FromSize_t(ddp_reducer_plan(self->r)->nbuckets);
}

static PyMethodDef reducer_methods[] = {
    {"layout", (PyCFunction)reducer_layout, METH_NOARGS,
     "layout() -> ([(members, numel, dtype, device)], param_bucket, param_offset)"},
    {"bucket_rules", (PyCFunction)reducer_bucket_rules, METH_VARARGS,
     "bucket_rules(world_size) -> [(narrow, divisor, op)]: how each bucket is reduced"},
    {"begin", (PyCFunction)reducer_begin, METH_NOARGS, "start a synced iteration"},
    {"end", (PyCFunction)reducer_end, METH_NOARGS, "end the iteration (bookkeeping only)"},
    {"mark_ready", (PyCFunction)reducer_mark_ready, METH_O,
     "mark_ready(i) -> (first, count): buckets that may now be launched"},
    {"note_used", (PyCFunction)reducer_note_used, METH_O, "note_used(i)"},
    {"unready", (PyCFunction)reducer_unready, METH_NOARGS, "parameters not ready yet"},
    {"arrival", (PyCFunction)reducer_arrival, METH_NOARGS, "ready order of this iteration"},
    {"local_used", (PyCFunction)reducer_local_used, METH_NOARGS, "local use flags"},
    {"global_used", (PyCFunction)reducer_global_used, METH_NOARGS, "reduced use counts"},
    {"attach", (PyCFunction)ddp_py_reducer_attach, METH_VARARGS, "attach(pg_or_None, buckets)"},
    {"ready", (PyCFunction)reducer_ready, METH_VARARGS,
     "ready(i, grad_or_None, copy_back[, ptr, count, dtype]): copy into the bucket, launch "
     "full buckets (ptr, count, dtype: grad's memory, not imported)"},
    {"finish", (PyCFunction)reducer_finish, METH_VARARGS,
     "finish(track_used): wait for every bucket, copy averages back"},
    {"abort", (PyCFunction)ddp_py_reducer_abort, METH_VARARGS,
     "abort(reason): break the attached process group (peers fail fast)"},
    {"drain", (PyCFunction)reducer_drain, METH_NOARGS,
     "wait for in-flight all-reduces and end the iteration without copying back"},
    {NULL}
};

static PyGetSetDef reducer_getset[] = {
    {"in_iteration", (getter)reducer_get_in_iteration, NULL, "between begin and end", NULL},
    {"pending", (getter)reducer_get_pending, NULL, "all-reduces in flight", NULL},
    {"nbuckets", (getter)reducer_get_nbuckets, NULL, "number of buckets", NULL},
    {NULL}
};

static PyType_Slot reducer_slots[] = {
    {Py_tp_new, reducer_new},
    {Py_tp_dealloc, reducer_dealloc},
    {Py_tp_methods, reducer_methods},
    {Py_tp_getset, reducer_getset},
    {Py_tp_doc, "Gradient bucketing and averaged all-reduce for DDP."},
    {0, NULL}
};

static PyType_Spec reducer_spec = {"pyddp._C.Reducer", sizeof(ReducerObject), 0,
                                   Py_TPFLAGS_DEFAULT, reducer_slots};

int ddp_py_reducer_register(PyObject *m) {
    ReducerType = (PyTypeObject *)PyType_FromSpec(&reducer_spec);
    if (ReducerType == NULL) return -1;
    if (PyModule_AddObjectRef(m, "Reducer", (PyObject *)ReducerType) < 0) return -1;
    return PyModule_AddIntConstant(m, "REDUCER_FIRST_BUCKET_BYTES",
                                   (long)DDP_REDUCER_FIRST_BUCKET_BYTES);
}
