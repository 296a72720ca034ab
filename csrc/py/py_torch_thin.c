/* py_torch_thin.c - the torch backend's thin path in one C call, and the one
 * C test for a contiguous torch tensor.
 *
 * ProcessGroup.torch_run(kind, tensors, opts, timeout_ms[, work_type]) is
 * what pyddp/torch_backend/_pg.py's allreduce, broadcast, reduce and barrier
 * call first:
 * it reads torch's options (asyncOp, reduceOp, rootRank) and the one tensor's
 * facts (class, dtype, device, layout, contiguity, size, address) here in C
 * instead of in Python, and runs a blocking collective through
 * ProcessGroup.run (ddp_py_pg_run: the same queue, inline rule, timeouts and
 * flight record as the lean path), or submits an asynchronous one (torch
 * DDP's bucket all-reduce) as ProcessGroup.submit does and returns its
 * pyddp._C.Work for the caller to wrap in torch's Work. One CUDA tensor
 * goes to py_torch_cuda.c's lean GPU path instead. Anything it does not
 * take returns NotImplemented with nothing sent, and the caller goes on with
 * its Python path: a list of other than one tensor, a tensor that is not an
 * exact contiguous non-empty CPU (or, there, CUDA) torch.Tensor of a dtype
 * the core has, a reduce op other than SUM, AVG, PRODUCT, MIN and MAX
 * (PREMUL_SUM, the bitwise ops), or a torch whose ReduceOp hash was not
 * proven to name the op.
 *
 * torch is never imported: torch_backend/_pg.py hands its classes over once through
 * _C.torch_thin_config (torch.Tensor, torch.strided, dtype -> DT_* code, and
 * hash(ReduceOp) -> pyddp op code for the ops above, checked there).
 */
#include "py_common.h"

#include <string.h>
#include "py_pg.h"
#include "ddp_coll.h"

#define THIN_OPS 16   /* hashes of ReduceOp that index ops_by_hash */

static PyObject *t_tensor, *t_strided, *t_dtypes;   /* torch_thin_config's, owned */
static int ops_by_hash[THIN_OPS];                   /* hash(ReduceOp) -> op, -1: none */
static int ops_known;                               /* ops_by_hash was filled */
static PyObject *s_dtype, *s_layout, *s_is_cpu, *s_is_cuda, *s_is_contiguous, *s_data_ptr,
    *s_numel, *s_asyncOp, *s_reduceOp, *s_rootRank;

int ddp_py_torch_tensor(PyObject *tensor_type, PyObject *strided, PyObject *dtypes,
                        PyObject *t, int cuda, void **ptr, size_t *count, int *code) {
    if (tensor_type == NULL || dtypes == NULL || (PyObject *)Py_TYPE(t) != tensor_type)
        return 0;
    PyObject *v = PyObject_GetAttr(t, s_dtype);
    if (v == NULL) return -1;
    PyObject *c = PyDict_GetItemWithError(dtypes, v);   /* borrowed */
    Py_DECREF(v);
    if (c == NULL) return PyErr_Occurred() ? -1 : 0;
    *code = (int)PyLong_AsLong(c);
    if (*code == -1 && PyErr_Occurred()) return -1;
    if ((v = PyObject_GetAttr(t, cuda ? s_is_cuda : s_is_cpu)) == NULL) return -1;
    int ok = v == Py_True;
    Py_DECREF(v);
    if (!ok) return 0;
    if ((v = PyObject_GetAttr(t, s_layout)) == NULL) return -1;
    ok = v == strided;
    Py_DECREF(v);
    if (!ok) return 0;
    if ((v = PyObject_CallMethodNoArgs(t, s_is_contiguous)) == NULL) return -1;
    ok = v == Py_True;
    Py_DECREF(v);
    if (!ok) return 0;
    if ((v = PyObject_CallMethodNoArgs(t, s_numel)) == NULL) return -1;
    long long n = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (n < 0) return PyErr_Occurred() ? -1 : 0;
    if ((v = PyObject_CallMethodNoArgs(t, s_data_ptr)) == NULL) return -1;
    *ptr = PyLong_AsVoidPtr(v);
    Py_DECREF(v);
    if (PyErr_Occurred()) return -1;
    *count = (size_t)n;
    return 1;
}

int ddp_py_torch_cpu_tensor(PyObject *tensor_type, PyObject *strided, PyObject *dtypes,
                            PyObject *t, void **ptr, size_t *count, int *code) {
    return ddp_py_torch_tensor(tensor_type, strided, dtypes, t, 0, ptr, count, code);
}

/* torch_thin_config(tensor_type, strided, dtypes, ops): ops is None or a dict
 * {hash(ReduceOp): pyddp op code} whose keys are in [0, THIN_OPS). */
static PyObject *thin_config(PyObject *m, PyObject *args) {
    PyObject *tt, *st, *dt, *ops;
    if (!PyArg_ParseTuple(args, "OOO!O", &tt, &st, &PyDict_Type, &dt, &ops)) return NULL;
    int table[THIN_OPS];
    for (int k = 0; k < THIN_OPS; k++) table[k] = -1;
    if (ops != Py_None) {
        if (!PyDict_Check(ops)) return ddp_py_raise(DDP_ERR_TYPE, "ops: a dict or None");
        PyObject *key, *val;
        Py_ssize_t pos = 0;
        while (PyDict_Next(ops, &pos, &key, &val)) {
            long h = PyLong_AsLong(key), op = PyLong_AsLong(val);
            if (PyErr_Occurred()) return NULL;
            if (h < 0 || h >= THIN_OPS || op < 0 || op >= DDP_REDOP_COUNT)
                return ddp_py_raise(DDP_ERR_INVALID, "ops: hash or op out of range");
            table[h] = (int)op;
        }
    }
    Py_INCREF(tt);
    Py_INCREF(st);
    Py_INCREF(dt);
    Py_XSETREF(t_tensor, tt);
    Py_XSETREF(t_strided, st);
    Py_XSETREF(t_dtypes, dt);
    memcpy(ops_by_hash, table, sizeof table);
    ops_known = ops != Py_None;
    Py_RETURN_NONE;
}

/* The int attribute name of opts into *out: 0, or -1 with an exception. */
static int int_attr(PyObject *opts, PyObject *name, long *out) {
    PyObject *v = PyObject_GetAttr(opts, name);
    if (v == NULL) return -1;
    *out = PyLong_AsLong(v);
    Py_DECREF(v);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* opts.reduceOp as a pyddp op code: 1 with *op set, 0 when the thin path
 * does not take it, -1 with an exception. */
static int reduce_op(PyObject *opts, long *op) {
    if (!ops_known) return 0;
    PyObject *v = PyObject_GetAttr(opts, s_reduceOp);
    if (v == NULL) return -1;
    Py_hash_t h = PyObject_Hash(v);
    Py_DECREF(v);
    if (h == -1 && PyErr_Occurred()) return -1;
    if (h < 0 || h >= THIN_OPS || ops_by_hash[h] < 0) return 0;
    *op = ops_by_hash[h];
    return 1;
}

/* c zeroed, then kind, op, root and the timeout (tmo, a Python int) set; 0,
 * or -1 with an exception. */
static int call_init(ddp_py_call *c, long kind, long op, long root, PyObject *tmo) {
    memset(c, 0, sizeof *c);
    c->ca.kind = (ddp_coll_kind)kind;
    c->ca.op = (ddp_redop)op;
    c->ca.root = (int)root;
    c->timeout_ms = PyLong_AsLongLong(tmo);
    return c->timeout_ms == -1 && PyErr_Occurred() ? -1 : 0;
}

/* An asynchronous call of kind on tensor t (NULL for BARRIER) at ptr, count
 * elements of dtype code: submitted as ProcessGroup.submit does, t held as an
 * (owner, address, count, dtype) buffer by the Work; the pyddp._C.Work, or
 * NULL with an exception. */
static PyObject *submit_async(PGObject *self, long kind, long op, long root, PyObject *tmo,
                              PyObject *t, void *ptr, size_t count, int code) {
    ddp_py_call c;
    if (call_init(&c, kind, op, root, tmo) < 0) return NULL;
    PyObject *buf = Py_NewRef(Py_None);
    if (t != NULL) {
        Py_DECREF(buf);
        buf = Py_BuildValue("(ONni)", t, PyLong_FromVoidPtr(ptr), (Py_ssize_t)count, code);
        if (buf == NULL) return NULL;
    }
    PyObject *w = ddp_py_pg_submit_call(self, &c, buf, Py_None);
    Py_DECREF(buf);
    return w;
}

/* torch's call on one CUDA tensor t (py_torch_cuda.c): None once a blocking
 * one is queued, a work_type() for an asynchronous one; NotImplemented when
 * t is not one the lean path takes (or an asynchronous call has no
 * work_type). */
static PyObject *torch_cuda(PGObject *self, long kind, long op, long root, PyObject *tmo,
                            PyObject *tensors, int blocking, PyObject *work_type) {
    ddp_py_call c;
    if (call_init(&c, kind, op, root, tmo) < 0) return NULL;
    if (!blocking && work_type == NULL) Py_RETURN_NOTIMPLEMENTED;
    int rc = ddp_py_torch_cuda_read(PyList_GET_ITEM(tensors, 0), &c);
    if (rc <= 0) return rc < 0 ? NULL : Py_NewRef(Py_NotImplemented);
    if (blocking) return ddp_py_torch_cuda_call(self, &c, DDP_PY_ENQUEUE);
    return ddp_py_torch_cuda_work(self, &c, work_type, tensors);
}

PyObject *ddp_py_pg_torch_run(PGObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 && nargs != 5)
        return ddp_py_raise(DDP_ERR_INVALID, "torch_run(kind, tensors, opts, timeout_ms"
                            "[, work_type])");
    PyObject *tensors = args[1], *opts = args[2];
    PyObject *work_type = nargs == 5 && args[4] != Py_None ? args[4] : NULL;
    long kind = PyLong_AsLong(args[0]);
    if (kind == -1 && PyErr_Occurred()) return NULL;
    if (opts == Py_None || self->cpu.ops == NULL) Py_RETURN_NOTIMPLEMENTED;
    PyObject *v = PyObject_GetAttr(opts, s_asyncOp);
    if (v == NULL) return NULL;
    int blocking = v == Py_False;
    Py_DECREF(v);
    long op = 0, root = 0;
    if (kind == DDP_COLL_ALLREDUCE || kind == DDP_COLL_REDUCE) {
        int rc = reduce_op(opts, &op);
        if (rc <= 0) return rc < 0 ? NULL : Py_NewRef(Py_NotImplemented);
    }
    if ((kind == DDP_COLL_BROADCAST || kind == DDP_COLL_REDUCE) &&
        int_attr(opts, s_rootRank, &root) < 0)
        return NULL;
    if (root < 0 || root >= self->cpu.ops->size(self->cpu.impl))
        Py_RETURN_NOTIMPLEMENTED;   /* the Python path says what is wrong */
    void *ptr = NULL;
    size_t count = 0;
    int code = DDP_UINT8;
    if (kind != DDP_COLL_BARRIER) {
        if (!PyList_CheckExact(tensors) || PyList_GET_SIZE(tensors) != 1)
            Py_RETURN_NOTIMPLEMENTED;
        int rc = ddp_py_torch_cpu_tensor(t_tensor, t_strided, t_dtypes,
                                         PyList_GET_ITEM(tensors, 0), &ptr, &count, &code);
        if (rc < 0) return NULL;
        if (rc == 0)
            return torch_cuda(self, kind, op, root, args[3], tensors, blocking, work_type);
        if (count == 0) Py_RETURN_NOTIMPLEMENTED;
    }
    if (!blocking)
        return submit_async(self, kind, op, root, args[3],
                            kind == DDP_COLL_BARRIER ? NULL : PyList_GET_ITEM(tensors, 0), ptr,
                            count, code);
    /* ProcessGroup.run(kind, ptr, op, root, timeout_ms, count, code) */
    PyObject *a[7] = {args[0], PyLong_FromVoidPtr(ptr), PyLong_FromLong(op),
                      PyLong_FromLong(root), args[3], PyLong_FromSize_t(count),
                      PyLong_FromLong(code)};
    PyObject *r = NULL;
    if (a[1] && a[2] && a[3] && a[5] && a[6]) r = ddp_py_pg_run(self, a, 7);
    for (int k = 1; k < 7; k++)
        if (k != 4) Py_XDECREF(a[k]);
    return r;
}

static PyMethodDef thin_functions[] = {
    {"torch_thin_config", thin_config, METH_VARARGS,
     "torch_thin_config(tensor_type, strided, dtypes, ops): torch's classes for "
     "ProcessGroup.torch_run (ops: {hash(ReduceOp): op code} or None)"},
    {NULL}
};

int ddp_py_torch_thin_register(PyObject *m) {
    static PyObject **names[] = {&s_dtype, &s_layout, &s_is_cpu, &s_is_cuda,
                                 &s_is_contiguous, &s_data_ptr, &s_numel, &s_asyncOp,
                                 &s_reduceOp, &s_rootRank};
    static const char *text[] = {"dtype", "layout", "is_cpu", "is_cuda", "is_contiguous",
                                 "data_ptr", "numel", "asyncOp", "reduceOp", "rootRank"};
    for (size_t k = 0; k < sizeof names / sizeof *names; k++)
        if (*names[k] == NULL && (*names[k] = PyUnicode_InternFromString(text[k])) == NULL)
            return -1;
    for (int k = 0; k < THIN_OPS; k++) ops_by_hash[k] = -1;
    return PyModule_AddFunctions(m, thin_functions);
}
