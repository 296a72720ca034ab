/* py_reducer_plan.c - the bucket plan between Python and the core
 * (contract in py_reducer.h): Reducer()'s parameter specs read into
 * ddp_plan_buckets_as, and the plan described back (layout(), and each
 * bucket's reduction rule for the generic path, which moves the data with
 * the array library but must fill and reduce buckets as the C path does). */
#include "py_reducer.h"

#include <string.h>

static int dtype_from_name(PyObject *name, ddp_dtype *out) {
    const char *s = PyUnicode_AsUTF8(name);
    if (s == NULL) return -1;
    for (int t = 0; t < DDP_DTYPE_COUNT; t++)
        if (strcmp(s, ddp_dtype_name((ddp_dtype)t)) == 0) {
            *out = (ddp_dtype)t;
            return 0;
        }
    PyErr_Format(PyExc_TypeError, "DDP: unsupported parameter dtype %R", name);
    return -1;
}

/* Read a sequence of Python ints into a new size_t array (PyMem). */
static size_t *size_array(PyObject *seq, size_t n, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL) return NULL;
    if ((size_t)PySequence_Fast_GET_SIZE(fast) != n) {
        PyErr_Format(PyExc_ValueError, "%s has %zd entries, expected %zu", what,
                     PySequence_Fast_GET_SIZE(fast), n);
        Py_DECREF(fast);
        return NULL;
    }
    size_t *out = PyMem_Calloc(n ? n : 1, sizeof *out);
    for (size_t i = 0; out && i < n; i++) {
        out[i] = PyLong_AsSize_t(PySequence_Fast_GET_ITEM(fast, (Py_ssize_t)i));
        if (out[i] == (size_t)-1 && PyErr_Occurred()) {
            PyMem_Free(out);
            out = NULL;
        }
    }
    Py_DECREF(fast);
    return out;
}

int ddp_py_plan_parse(PyObject *params, Py_ssize_t first_cap, Py_ssize_t cap, PyObject *order_obj,
                      PyObject *reduce_obj, ddp_plan *out) {
    memset(out, 0, sizeof *out);
    ddp_dtype reduce = DDP_REDUCE_NATIVE;
    if (reduce_obj != Py_None && dtype_from_name(reduce_obj, &reduce) < 0) return -1;
    if (first_cap <= 0 || cap <= 0) {
        ddp_py_raise(DDP_ERR_INVALID, "bucket caps must be positive: check that "
                     "bucket_cap_mb > 0");
        return -1;
    }
    PyObject *fast = PySequence_Fast(params, "params must be a sequence");
    if (fast == NULL) return -1;
    size_t n = (size_t)PySequence_Fast_GET_SIZE(fast);
    ddp_plan_param *ps = PyMem_Calloc(n ? n : 1, sizeof *ps);
    size_t *order = NULL;
    int rc = -1;
    if (ps == NULL) { PyErr_NoMemory(); goto done; }
    for (size_t i = 0; i < n; i++) {
        PyObject *name;
        Py_ssize_t numel;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, (Py_ssize_t)i), "nOi;params "
                              "entries are (numel, dtype name, device key)", &numel, &name,
                              &ps[i].device) ||
            dtype_from_name(name, &ps[i].dtype) < 0)
            goto done;
        ps[i].numel = (size_t)numel;
    }
    if (order_obj != Py_None && (order = size_array(order_obj, n, "order")) == NULL) goto done;
    ddp_status st = ddp_plan_buckets_as(ps, n, order, (size_t)first_cap, (size_t)cap, reduce,
                                        out);
    if (st != DDP_OK) ddp_py_raise(st, NULL);
    else rc = 0;
done:
    PyMem_Free(ps);
    PyMem_Free(order);
    Py_DECREF(fast);
    return rc;
}

PyObject *ddp_py_size_list(const size_t *v, size_t n) {
    PyObject *l = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; l && i < n; i++) {
        PyObject *x = PyLong_FromSize_t(v[i]);
        if (x == NULL) { Py_CLEAR(l); break; }
        PyList_SET_ITEM(l, (Py_ssize_t)i, x);
    }
    return l;
}

PyObject *ddp_py_plan_layout(const ddp_plan *p) {
    PyObject *buckets = PyList_New((Py_ssize_t)p->nbuckets);
    for (size_t b = 0; buckets && b < p->nbuckets; b++) {
        PyObject *members = ddp_py_size_list(p->members + p->bucket_begin[b],
                                             p->bucket_begin[b + 1] - p->bucket_begin[b]);
        PyObject *t = members ? Py_BuildValue("(Nnsi)", members, (Py_ssize_t)p->bucket_numel[b],
                                              ddp_dtype_name(p->bucket_dtype[b]),
                                              p->bucket_device[b]) : NULL;
        if (t == NULL) { Py_CLEAR(buckets); break; }
        PyList_SET_ITEM(buckets, (Py_ssize_t)b, t);
    }
    if (buckets == NULL) return NULL;
    return Py_BuildValue("(NNN)", buckets, ddp_py_size_list(p->param_bucket, p->nparams),
                         ddp_py_size_list(p->param_offset, p->nparams));
}

PyObject *ddp_py_plan_bucket_rules(const ddp_plan *p, int world_size) {
    if (world_size < 1)
        return ddp_py_raise(DDP_ERR_INVALID, "bucket_rules: the world size must be >= 1");
    PyObject *out = PyList_New((Py_ssize_t)p->nbuckets);
    for (size_t b = 0; out && b < p->nbuckets; b++) {
        ddp_bucket_rule rule = ddp_plan_bucket_rule(p, b, world_size);
        PyObject *t = Py_BuildValue("(Nii)", PyBool_FromLong(rule.narrow), rule.divisor,
                                    (int)rule.op);
        if (t == NULL) { Py_CLEAR(out); break; }
        PyList_SET_ITEM(out, (Py_ssize_t)b, t);
    }
    return out;
}
