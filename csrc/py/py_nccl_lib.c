/* py_nccl_lib.c - the NCCL loader's Python entry points:
 *
 *   nccl_load(nccl_candidates, cudart_candidates, prefer_loaded=True) -> dict
 *     load NCCL and the CUDA runtime from (path, origin) candidates, in
 *     order (pyddp/_nccl_backend.py builds the lists); BackendUnavailableError
 *     listing every candidate and why it was refused;
 *   nccl_probe(nccl_candidates, prefer_loaded=True) -> dict
 *     the NCCL that nccl_load would take (path, version), checked without
 *     the CUDA runtime and not kept loaded; the same error when none works;
 *   nccl_tables() -> dict
 *     the NCCL data type of each dtype and the NCCL op of each (dtype, op),
 *     so that tests can check them against nccl.h.
 */
#include "py_nccl.h"

#include "ddp_cuda_lib.h"
#include "ddp_nccl_comm.h"

/* ---- loader ------------------------------------------------------------- */

/* Turn a sequence of (path, origin) pairs into candidates; the strings stay
 * owned by the (kept) sequence items. fn and name (the caller's function and
 * argument) are for messages. */
static ddp_lib_candidate *candidates(PyObject *seq, const char *fn, const char *name,
                                     Py_ssize_t *n) {
    PyObject *fast = PySequence_Fast(seq, "candidates must be a sequence");
    if (fast == NULL) return NULL;
    *n = PySequence_Fast_GET_SIZE(fast);
    ddp_lib_candidate *c = PyMem_Calloc((size_t)*n + 1, sizeof *c);
    for (Py_ssize_t i = 0; c && i < *n; i++) {
        PyObject *it = PySequence_Fast_GET_ITEM(fast, i);
        /* Only lists and tuples: their items are the strings themselves, which
         * `seq` keeps alive while the pointers are used. */
        PyObject *pair = PyTuple_Check(it) || PyList_Check(it) ? PySequence_Tuple(it) : NULL;
        int ok = pair && PyArg_ParseTuple(pair, "ss", &c[i].path, &c[i].origin);
        Py_XDECREF(pair);
        if (!ok) {
            PyErr_Format(PyExc_TypeError, "%s: %s[%zd] must be a (path, origin) pair", fn,
                         name, i);
            PyMem_Free(c);
            c = NULL;
        }
    }
    Py_DECREF(fast);   /* the items are still referenced by seq */
    if (c == NULL && !PyErr_Occurred()) PyErr_NoMemory();
    return c;
}

/* What was loaded as a dict: the NCCL keys, and the CUDA runtime's when
 * with_cudart. */
static PyObject *info_dict(const ddp_cuda_info *i, int with_cudart) {
    char v[32];
    PyObject *d = Py_BuildValue("{s:s,s:s,s:i}", "nccl_path", i->nccl_path, "nccl_version",
                                ddp_nccl_version_str(i->nccl_version, v, sizeof v),
                                "nccl_version_code", i->nccl_version);
    if (d == NULL || !with_cudart) return d;
    PyObject *rt = Py_BuildValue("{s:s,s:i,s:i,s:i,s:s}", "cudart_path", i->cudart_path,
                                 "cudart_version", i->cudart_version, "driver_version",
                                 i->driver_version, "device_count", i->device_count,
                                 "device_error", i->device_error);
    if (rt == NULL || PyDict_Update(d, rt) < 0) Py_CLEAR(d);
    Py_XDECREF(rt);
    return d;
}

/* nccl_load (cs: the CUDA runtime candidates) or nccl_probe (cs NULL): the
 * loader called without the GIL; its description, or the exception. */
static PyObject *load_or_probe(const char *fn, PyObject *ns, PyObject *cs, int prefer_loaded) {
    Py_ssize_t nn = 0, nc = 0;
    ddp_lib_candidate *n = candidates(ns, fn, "nccl", &nn);
    ddp_lib_candidate *c = n && cs ? candidates(cs, fn, "cudart", &nc) : NULL;
    if (n == NULL || (cs && c == NULL)) {
        PyMem_Free(n);
        return NULL;
    }
    ddp_cuda_info info;
    ddp_status st;
    char msg[8192];
    Py_BEGIN_ALLOW_THREADS
    st = cs ? ddp_cuda_load(n, (size_t)nn, c, (size_t)nc, prefer_loaded, &info)
            : ddp_nccl_probe(n, (size_t)nn, prefer_loaded, &info);
    if (st != DDP_OK) ddp_copy_error(msg, sizeof msg);
    Py_END_ALLOW_THREADS
    PyMem_Free(n);
    PyMem_Free(c);
    if (st != DDP_OK) return ddp_py_raise(st, msg);
    return info_dict(&info, cs != NULL);
}

static PyObject *py_nccl_load(PyObject *m, PyObject *args) {
    PyObject *ns, *cs;
    int prefer_loaded = 1;
    if (!PyArg_ParseTuple(args, "OO|p", &ns, &cs, &prefer_loaded)) return NULL;
    return load_or_probe("nccl_load", ns, cs, prefer_loaded);
}

static PyObject *py_nccl_probe(PyObject *m, PyObject *args) {
    PyObject *ns;
    int prefer_loaded = 1;
    if (!PyArg_ParseTuple(args, "O|p", &ns, &prefer_loaded)) return NULL;
    return load_or_probe("nccl_probe", ns, NULL, prefer_loaded);
}

/* {"dtypes": {name: ncclDataType_t}, "ops": {(dtype, op): ncclRedOp_t or None}} */
static PyObject *py_nccl_tables(PyObject *m, PyObject *unused) {
    static const char *OPS[DDP_REDOP_COUNT] = {"SUM", "AVG", "MIN", "MAX", "PRODUCT"};
    PyObject *dt = PyDict_New(), *ops = PyDict_New(), *res = NULL;
    for (int t = 0; dt && ops && t < DDP_DTYPE_COUNT; t++) {
        int nt, no;
        if (ddp_nccl_map((ddp_dtype)t, DDP_SUM, &nt, NULL) != DDP_OK) continue;
        PyObject *v = PyLong_FromLong(nt);
        if (v == NULL || PyDict_SetItemString(dt, ddp_dtype_name((ddp_dtype)t), v) < 0) goto out;
        Py_DECREF(v);
        for (int o = 0; o < DDP_REDOP_COUNT; o++) {
            PyObject *k = Py_BuildValue("(ss)", ddp_dtype_name((ddp_dtype)t), OPS[o]);
            PyObject *x = ddp_nccl_map((ddp_dtype)t, (ddp_redop)o, &nt, &no) == DDP_OK
                              ? PyLong_FromLong(no) : Py_NewRef(Py_None);
            int bad = k == NULL || x == NULL || PyDict_SetItem(ops, k, x) < 0;
            Py_XDECREF(k);
            Py_XDECREF(x);
            if (bad) goto out;
        }
    }
    if (dt && ops) res = Py_BuildValue("{s:O,s:O}", "dtypes", dt, "ops", ops);
out:
    Py_XDECREF(dt);
    Py_XDECREF(ops);
    return res;
}

static PyMethodDef nccl_functions[] = {
    {"nccl_load", py_nccl_load, METH_VARARGS,
     "nccl_load(nccl_candidates, cudart_candidates, prefer_loaded=True) -> dict\n"
     "Load NCCL and the CUDA runtime from (path, origin) candidates, in order."},
    {"nccl_probe", py_nccl_probe, METH_VARARGS,
     "nccl_probe(nccl_candidates, prefer_loaded=True) -> dict\n"
     "The NCCL that nccl_load would take (path, version), checked and not kept loaded."},
    {"nccl_tables", py_nccl_tables, METH_NOARGS,
     "The NCCL data type of each dtype and the NCCL op of each (dtype, op)."},
    {NULL}
};

int ddp_py_nccl_lib_register(PyObject *m) {
    return PyModule_AddFunctions(m, nccl_functions);
}
