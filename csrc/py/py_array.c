/* py_array.c - the one place that turns a Python array object into a raw
 * buffer for the core (contract in py_array.h).
 *
 * Paths, tried in order: an (owner, address, count, dtype) tuple naming host
 * memory by address (a CPU torch tensor's data_ptr(), no capsule made); NumPy
 * arrays through the NumPy C API; objects with __dlpack__ (torch, CuPy,
 * JAX), asking for a versioned capsule first; objects with
 * __cuda_array_interface__; finally the buffer protocol.
 * Every path checks dtype, C-contiguity and writability the same way, so an
 * array is accepted or rejected alike whatever library it comes from.
 */
#include "py_array.h"

#define PY_ARRAY_UNIQUE_SYMBOL ddp_ARRAY_API
#include <numpy/arrayobject.h>

#include <string.h>
#include "ddp_dlpack.h"

static int reject(ddp_status st, const char *argname, const char *fmt, PyObject *obj) {
    char msg[512];
    PyOS_snprintf(msg, sizeof msg, fmt, argname, Py_TYPE(obj)->tp_name);
    ddp_py_raise(st, msg);
    return -1;
}

/* dtype from a (kind, bytes) pair: kind 'f' float, 'i' signed, 'u'
 * unsigned, 'b' bool, 'B' bfloat. -1 if pyddp does not support it. */
static int dtype_of(char kind, int bytes) {
    switch (kind) {
    case 'f': return bytes == 2 ? DDP_FLOAT16 : bytes == 4 ? DDP_FLOAT32 : bytes == 8 ? DDP_FLOAT64 : -1;
    case 'B': return bytes == 2 ? DDP_BFLOAT16 : -1;
    case 'i': return bytes == 1 ? DDP_INT8 : bytes == 4 ? DDP_INT32 : bytes == 8 ? DDP_INT64 : -1;
    case 'u': return bytes == 1 ? DDP_UINT8 : -1;
    case 'b': return bytes == 1 ? DDP_BOOL : -1;
    }
    return -1;
}

static const char SUPPORTED[] = "supported dtypes are float16, bfloat16, float32, float64, "
                                "int8, uint8, int32, int64 and bool";

static int bad_dtype(const char *argname, const char *what) {
    char msg[512];
    PyOS_snprintf(msg, sizeof msg, "%s has unsupported dtype %s; %s", argname, what, SUPPORTED);
    ddp_py_raise(DDP_ERR_TYPE, msg);
    return -1;
}

static int not_contiguous(const char *argname) {
    char msg[256];
    PyOS_snprintf(msg, sizeof msg, "%s is not contiguous; pass a C-contiguous array "
                  "(numpy.ascontiguousarray(x) or x.contiguous())", argname);
    ddp_py_raise(DDP_ERR_INVALID, msg);
    return -1;
}

static int read_only(const char *argname) {
    char msg[256];
    PyOS_snprintf(msg, sizeof msg, "%s is read-only, but this operation writes its result "
                  "into it", argname);
    ddp_py_raise(DDP_ERR_INVALID, msg);
    return -1;
}

/* ---- host memory by address ------------------------------------------- */

/* (owner, address, count, dtype code): `count` elements of dtype code (DT_*)
 * at `address` in this process's memory, which `owner` keeps alive and
 * unchanged in size while it is referenced (the tuple, and so owner, is held
 * until ddp_py_array_release). The caller vouches for the address: this is
 * the form of pyddp's own Python layer, not of user code. */
static int from_address(PyObject *t, ddp_py_array *out) {
    void *ptr = PyLong_AsVoidPtr(PyTuple_GET_ITEM(t, 1));
    long long count = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 2));
    long dt = PyLong_AsLong(PyTuple_GET_ITEM(t, 3));
    if (PyErr_Occurred()) return -1;
    if (count < 0 || dt < 0 || dt >= DDP_DTYPE_COUNT || (ptr == NULL && count > 0)) {
        ddp_py_raise(DDP_ERR_INVALID, "an (owner, address, count, dtype) buffer needs a "
                     "count >= 0, a DT_* dtype code and a non-null address");
        return -1;
    }
    out->ptr = ptr;
    out->count = (size_t)count;
    out->dtype = (ddp_dtype)dt;
    out->device = DDP_DEV_CPU;
    return 0;
}

/* ---- NumPy ---------------------------------------------------------- */

static int from_numpy(PyArrayObject *arr, int writable, const char *argname, ddp_py_array *out) {
    PyArray_Descr *d = PyArray_DESCR(arr);
    int t = -1;
    if (PyDataType_ISNOTSWAPPED(d) || PyArray_ITEMSIZE(arr) == 1) {
        char kind = d->kind;
        if (kind == 'b') t = DDP_BOOL;
        else if (kind == 'V' && strcmp(Py_TYPE(d)->tp_name, "numpy.dtype[bfloat16]") == 0) t = -1;
        else t = dtype_of(kind, (int)PyArray_ITEMSIZE(arr));
        /* ml_dtypes' bfloat16 registers kind 'V' with name bfloat16 */
        if (t < 0 && PyArray_ITEMSIZE(arr) == 2) {
            PyObject *name = PyObject_GetAttrString((PyObject *)d, "name");
            if (name && PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, "bfloat16") == 0)
                t = DDP_BFLOAT16;
            Py_XDECREF(name);
            PyErr_Clear();
        }
    }
    if (t < 0) {
        PyObject *s = PyObject_Str((PyObject *)d);
        const char *name = s ? PyUnicode_AsUTF8(s) : "?";
        int r = bad_dtype(argname, name ? name : "?");
        Py_XDECREF(s);
        return r;
    }
    if (!PyArray_IS_C_CONTIGUOUS(arr)) return not_contiguous(argname);
    if (writable && !PyArray_ISWRITEABLE(arr)) return read_only(argname);
    out->ptr = PyArray_DATA(arr);
    out->count = (size_t)PyArray_SIZE(arr);
    out->dtype = (ddp_dtype)t;
    out->device = DDP_DEV_CPU;
    return 0;
}

/* ---- DLPack --------------------------------------------------------- */

static int dl_compact(const DLTensor *t) {
    if (t->strides == NULL) return 1;
    int64_t expect = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->strides[i] != expect) return 0;
        expect *= t->shape[i];
    }
    return 1;
}

static int from_dltensor(const DLTensor *t, int ro, int writable, const char *argname,
                         ddp_py_array *out) {
    char kind;
    switch (t->dtype.code) {
    case kDLFloat: kind = 'f'; break;
    case kDLBfloat: kind = 'B'; break;
    case kDLInt: kind = 'i'; break;
    case kDLUInt: kind = (t->dtype.bits == 8) ? 'u' : 'x'; break;
    case kDLBool: kind = 'b'; break;
    default: kind = 'x'; break;
    }
    int bits = t->dtype.bits;
    int dt = (t->dtype.lanes == 1 && bits % 8 == 0) ? dtype_of(kind, bits / 8) : -1;
    if (dt < 0) {
        static const char *names[] = {"int", "uint", "float", "opaque handle", "bfloat",
                                      "complex", "bool"};
        const char *name = t->dtype.code < sizeof names / sizeof *names
                               ? names[t->dtype.code] : "unknown kind";
        char what[96];
        PyOS_snprintf(what, sizeof what, "(%s%d%s; DLPack code %d, %d lanes)", name, bits,
                      t->dtype.lanes > 1 ? " vector" : "", t->dtype.code, t->dtype.lanes);
        return bad_dtype(argname, what);
    }
    if (!dl_compact(t)) return not_contiguous(argname);
    if (writable && ro) return read_only(argname);
    size_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= (size_t)t->shape[i];
    out->ptr = (char *)t->data + t->byte_offset;
    out->count = n;
    out->dtype = (ddp_dtype)dt;
    out->device_id = t->device.device_id;
    switch (t->device.device_type) {
    case kDLCPU: case kDLCUDAHost: out->device = DDP_DEV_CPU; break;
    case kDLCUDA: case kDLCUDAManaged: out->device = DDP_DEV_CUDA; break;
    default: {
        char msg[256];
        PyOS_snprintf(msg, sizeof msg, "%s lives on DLPack device type %d; pyddp handles CPU "
                      "and CUDA memory", argname, t->device.device_type);
        ddp_py_raise(DDP_ERR_TYPE, msg);
        return -1;
    }
    }
    return 0;
}

static int from_dlpack(PyObject *obj, int writable, const char *argname, PyObject *stream,
                       ddp_py_array *out) {
    PyObject *meth = PyObject_GetAttrString(obj, "__dlpack__");
    if (meth == NULL) return -1;
    PyObject *kw = PyDict_New(), *args = PyTuple_New(0), *cap = NULL;
    if (kw && args) {
        PyObject *ver = Py_BuildValue("(ii)", 1, 0);
        if (ver) PyDict_SetItemString(kw, "max_version", ver);
        Py_XDECREF(ver);
        if (stream) PyDict_SetItemString(kw, "stream", stream);
        cap = PyObject_Call(meth, args, kw);
        if (cap == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
            /* Producer predates DLPack 1.0: ask for an unversioned capsule. */
            PyErr_Clear();
            PyDict_DelItemString(kw, "max_version");
            cap = PyObject_Call(meth, args, kw);
        }
    }
    Py_XDECREF(kw);
    Py_XDECREF(args);
    Py_DECREF(meth);
    if (cap == NULL) return -1;
    int rc = -1;
    if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
        DLManagedTensorVersioned *m = PyCapsule_GetPointer(cap, "dltensor_versioned");
        int ro = (m->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
        rc = from_dltensor(&m->dl_tensor, ro, writable, argname, out);
        if (rc == 0) {
            PyCapsule_SetName(cap, "used_dltensor_versioned");
            out->dl_managed = m;
            out->dl_versioned = 1;
        }
    } else if (PyCapsule_IsValid(cap, "dltensor")) {
        DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
        rc = from_dltensor(&m->dl_tensor, 0, writable, argname, out);
        if (rc == 0) {
            PyCapsule_SetName(cap, "used_dltensor");
            out->dl_managed = m;
        }
    } else {
        PyErr_Format(PyExc_TypeError, "%s.__dlpack__() returned something that is not a "
                     "DLPack capsule", argname);
    }
    if (rc == 0) out->capsule = cap; else Py_DECREF(cap);
    return rc;
}

/* ---- __cuda_array_interface__ -------------------------------------- */

static int from_cai(PyObject *obj, PyObject *cai, int writable, const char *argname,
                    ddp_py_array *out) {
    PyObject *data = PyDict_Check(cai) ? PyDict_GetItemString(cai, "data") : NULL;
    PyObject *shape = PyDict_Check(cai) ? PyDict_GetItemString(cai, "shape") : NULL;
    PyObject *typestr = PyDict_Check(cai) ? PyDict_GetItemString(cai, "typestr") : NULL;
    PyObject *strides = PyDict_Check(cai) ? PyDict_GetItemString(cai, "strides") : NULL;
    if (!data || !shape || !typestr || !PyTuple_Check(data) || PyTuple_Size(data) != 2 ||
        !PyTuple_Check(shape) || !PyUnicode_Check(typestr)) {
        PyErr_Format(PyExc_TypeError, "%s has a malformed __cuda_array_interface__", argname);
        return -1;
    }
    const char *ts = PyUnicode_AsUTF8(typestr);
    int t = (ts && strlen(ts) >= 3 && ts[0] != '>') ? dtype_of(ts[1], atoi(ts + 2)) : -1;
    if (t < 0) return bad_dtype(argname, ts ? ts : "?");
    size_t n = 1;
    Py_ssize_t nd = PyTuple_Size(shape);
    int has_strides = strides && strides != Py_None;
    if (has_strides && (!PyTuple_Check(strides) || PyTuple_Size(strides) != nd)) {
        PyErr_Format(PyExc_TypeError, "%s has a malformed __cuda_array_interface__ "
                     "(strides do not match shape)", argname);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nd; i++) {
        PyObject *d = PyTuple_GetItem(shape, i);
        if (!PyLong_Check(d) || PyLong_AsSsize_t(d) < 0 ||
            (has_strides && !PyLong_Check(PyTuple_GetItem(strides, i)))) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s has a malformed __cuda_array_interface__ "
                         "(shape and strides must be tuples of non-negative ints)", argname);
            return -1;
        }
        n *= (size_t)PyLong_AsSsize_t(d);
    }
    if (has_strides) {
        size_t expect = ddp_dtype_size((ddp_dtype)t);
        for (Py_ssize_t i = nd - 1; i >= 0; i--) {
            Py_ssize_t dim = PyLong_AsSsize_t(PyTuple_GetItem(shape, i));
            if (dim != 1 && (size_t)PyLong_AsSsize_t(PyTuple_GetItem(strides, i)) != expect)
                return not_contiguous(argname);
            expect *= (size_t)dim;
        }
    }
    if (writable && PyObject_IsTrue(PyTuple_GetItem(data, 1))) return read_only(argname);
    out->ptr = PyLong_AsVoidPtr(PyTuple_GetItem(data, 0));
    if (PyErr_Occurred()) return -1;
    out->count = n;
    out->dtype = (ddp_dtype)t;
    out->device = DDP_DEV_CUDA;
    out->device_id = -1;  /* unknown: the NCCL layer checks the pointer's device */
    (void)obj;
    return 0;
}

/* ---- buffer protocol ------------------------------------------------ */

static int from_buffer(PyObject *obj, int writable, const char *argname, ddp_py_array *out) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &out->view, flags) < 0) {
        if (writable && PyObject_GetBuffer(obj, &out->view, PyBUF_C_CONTIGUOUS) == 0) {
            PyBuffer_Release(&out->view);
            PyErr_Clear();
            return read_only(argname);
        }
        PyErr_Clear();
        return not_contiguous(argname);
    }
    out->has_view = 1;
    const char *f = out->view.format ? out->view.format : "B";
    if (*f == '@' || *f == '=' || *f == '<') f++;
    int t = -1;
    if (f[0] && !f[1]) {
        int sz = (int)out->view.itemsize;
        switch (f[0]) {
        case 'e': case 'f': case 'd': t = dtype_of('f', sz); break;
        case 'b': case 'h': case 'i': case 'l': case 'q': t = dtype_of('i', sz); break;
        case 'B': t = dtype_of('u', sz); break;
        case '?': t = DDP_BOOL; break;
        }
    }
    if (t < 0) return bad_dtype(argname, out->view.format ? out->view.format : "?");
    out->ptr = out->view.buf;
    out->count = (size_t)(out->view.len / (out->view.itemsize ? out->view.itemsize : 1));
    out->dtype = (ddp_dtype)t;
    out->device = DDP_DEV_CPU;
    return 0;
}

int ddp_py_array_import_stream(PyObject *obj, int writable, const char *argname,
                               PyObject *stream, ddp_py_array *out) {
    memset(out, 0, sizeof *out);
    int rc;
    if (PyTuple_CheckExact(obj) && PyTuple_GET_SIZE(obj) == 4) {
        rc = from_address(obj, out);
    } else if (PyArray_Check(obj)) {
        rc = from_numpy((PyArrayObject *)obj, writable, argname, out);
    } else if (PyObject_HasAttrString(obj, "__dlpack__")) {
        rc = from_dlpack(obj, writable, argname, stream, out);
    } else if (PyObject_HasAttrString(obj, "__cuda_array_interface__")) {
        PyObject *cai = PyObject_GetAttrString(obj, "__cuda_array_interface__");
        rc = cai ? from_cai(obj, cai, writable, argname, out) : -1;
        Py_XDECREF(cai);
    } else if (PyObject_CheckBuffer(obj) && !PyBytes_Check(obj) && !PyUnicode_Check(obj)) {
        rc = from_buffer(obj, writable, argname, out);
    } else {
        return reject(DDP_ERR_TYPE, argname, "%s must be an array (a NumPy array, a torch "
                      "tensor, or an object with __dlpack__, __cuda_array_interface__ or the "
                      "buffer protocol), not %s", obj);
    }
    if (rc < 0) {
        ddp_py_array_release(out);
        return -1;
    }
    Py_INCREF(obj);
    out->owner = obj;
    return 0;
}

int ddp_py_array_import(PyObject *obj, int writable, const char *argname, ddp_py_array *out) {
    return ddp_py_array_import_stream(obj, writable, argname, NULL, out);
}

void ddp_py_array_release(ddp_py_array *a) {
    if (a->has_view) PyBuffer_Release(&a->view);
    a->has_view = 0;
    if (a->dl_managed) {
        if (a->dl_versioned) {
            DLManagedTensorVersioned *m = a->dl_managed;
            if (m->deleter) m->deleter(m);
        } else {
            DLManagedTensor *m = a->dl_managed;
            if (m->deleter) m->deleter(m);
        }
        a->dl_managed = NULL;
    }
    Py_CLEAR(a->capsule);
    Py_CLEAR(a->owner);
}

void ddp_py_arrays_free(ddp_py_array *arrs, size_t n) {
    for (size_t i = 0; arrs && i < n; i++) ddp_py_array_release(&arrs[i]);
    PyMem_Free(arrs);
}

int ddp_py_array_init(void) {
    import_array1(-1);
    return 0;
}
