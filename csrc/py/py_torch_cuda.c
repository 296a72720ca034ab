/* py_torch_cuda.c - a collective on one CUDA torch tensor in one C call: the
 * lean GPU path of torch's API over backend "pyddp" (ProcessGroup.torch_run,
 * py_torch_thin.c) and of pyddp's own blocking calls (ProcessGroup.run).
 *
 * The tensor's facts (class, dtype, layout, contiguity, size, address and
 * device) are read here, the caller's current CUDA stream on that device is
 * asked once (the lookup torch_cuda_config gave: torch's own raw
 * current-stream call), no DLPack capsule is made, and the device is known
 * without asking CUDA about the pointer. The call then goes to the group's
 * NCCL transport through the one submit path (ddp_py_pg_call), ended as the
 * caller's semantics say:
 *
 *   torch's blocking call (DDP_PY_ENQUEUE): queued, the caller's stream
 *     ordered after it, returns at once, as torch's "nccl" backend does; the
 *     completion thread watches it (deadline, abort) and then lets go of the
 *     tensor;
 *   torch's asynchronous call (DDP_PY_WATCH): queued and watched; its
 *     pyddp._C.Work goes into a new instance of the torch Work class the
 *     caller names (pyddp/torch_backend/_cuda.py's CudaWork, attributes _cw
 *     and _result), made here, so torch gets its Work without a Python frame;
 *   pyddp's blocking call (DDP_PY_RUN): queued, waited for on the host (its
 *     errors raised at the call, as pyddp documents), then published on the
 *     caller's stream.
 *
 * Anything else (another class, a CPU, empty or non-contiguous tensor, a
 * dtype the core lacks) is "not taken", with nothing sent, and the caller
 * goes on with its general path. torch is never imported:
 * pyddp/_nccl_backend.py hands the class and the stream lookup over once
 * (_C.torch_cuda_config).
 */
#include "py_common.h"

#include <string.h>
#include "py_pg.h"

static PyObject *c_tensor, *c_strided, *c_dtypes, *c_stream_of;   /* owned */
static PyObject *s_get_device, *s_cw, *s_result;

/* torch_cuda_config(tensor_type, strided, dtypes, stream_of): the exact class
 * of the CUDA tensors the lean path takes, torch.strided, {torch dtype: DT_*
 * code}, and stream_of(device) -> the current cudaStream_t there (an int). */
static PyObject *cuda_config(PyObject *m, PyObject *args) {
    PyObject *tt, *st, *dt, *so;
    if (!PyArg_ParseTuple(args, "OOO!O", &tt, &st, &PyDict_Type, &dt, &so)) return NULL;
    if (!PyCallable_Check(so)) return ddp_py_raise(DDP_ERR_TYPE, "stream_of must be callable");
    Py_XSETREF(c_tensor, Py_NewRef(tt));
    Py_XSETREF(c_strided, Py_NewRef(st));
    Py_XSETREF(c_dtypes, Py_NewRef(dt));
    Py_XSETREF(c_stream_of, Py_NewRef(so));
    Py_RETURN_NONE;
}

/* torch_cuda_type() -> the class torch_cuda_config named, or None. */
static PyObject *cuda_type(PyObject *m, PyObject *unused) {
    return Py_NewRef(c_tensor ? c_tensor : Py_None);
}

int ddp_py_torch_cuda_class(PyObject *t) {
    return c_tensor != NULL && (PyObject *)Py_TYPE(t) == c_tensor;
}

int ddp_py_torch_cuda_read(PyObject *t, ddp_py_call *c) {
    void *ptr;
    size_t count;
    int code;
    int rc = ddp_py_torch_tensor(c_tensor, c_strided, c_dtypes, t, 1, &ptr, &count, &code);
    if (rc <= 0 || count == 0) return rc;
    PyObject *v = PyObject_CallMethodNoArgs(t, s_get_device);
    if (v == NULL) return -1;
    long dev = PyLong_AsLong(v);
    Py_DECREF(v);
    if (dev == -1 && PyErr_Occurred()) return -1;
    if (dev < 0) return 0;
    PyObject *d = PyLong_FromLong(dev);
    v = d ? PyObject_CallOneArg(c_stream_of, d) : NULL;
    Py_XDECREF(d);
    if (v == NULL) return -1;
    uintptr_t stream = (uintptr_t)PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    if (PyErr_Occurred()) return -1;
    ddp_py_array *a = &c->two[0];
    memset(a, 0, sizeof *a);
    a->ptr = ptr;
    a->count = count;
    a->dtype = (ddp_dtype)code;
    a->device = DDP_DEV_CUDA;
    a->device_id = (int)dev;
    a->owner = Py_NewRef(t);   /* keeps the memory for the transport */
    c->fill = 1;
    c->on_gpu = 1;
    c->has_stream = 1;
    c->stream = stream;
    return 1;
}

PyObject *ddp_py_torch_cuda_call(PGObject *self, ddp_py_call *c, ddp_py_mode mode) {
    ddp_pg pg;
    if (ddp_py_pg_route(self, 1, &pg) < 0) {
        ddp_py_call_release(c);
        return NULL;
    }
    return ddp_py_pg_call(pg, c, mode);
}

PyObject *ddp_py_torch_cuda_work(PGObject *self, ddp_py_call *c, PyObject *work_type,
                                 PyObject *tensors) {
    PyObject *tw = PyObject_CallNoArgs(work_type);
    if (tw == NULL) {
        ddp_py_call_release(c);
        return NULL;
    }
    PyObject *cw = ddp_py_torch_cuda_call(self, c, DDP_PY_WATCH);
    if (cw == NULL || PyObject_SetAttr(tw, s_cw, cw) < 0 ||
        PyObject_SetAttr(tw, s_result, tensors) < 0)
        Py_CLEAR(tw);   /* a submitted work stays watched: it ends on its own */
    Py_XDECREF(cw);
    return tw;
}

static PyMethodDef cuda_functions[] = {
    {"torch_cuda_config", cuda_config, METH_VARARGS,
     "torch_cuda_config(tensor_type, strided, dtypes, stream_of): the CUDA tensors the lean "
     "path takes and how to find the caller's current stream (stream_of(device) -> int)"},
    {"torch_cuda_type", cuda_type, METH_NOARGS,
     "torch_cuda_type() -> the class torch_cuda_config named, or None"},
    {NULL}
};

int ddp_py_torch_cuda_register(PyObject *m) {
    static PyObject **names[] = {&s_get_device, &s_cw, &s_result};
    static const char *text[] = {"get_device", "_cw", "_result"};
    for (size_t k = 0; k < sizeof names / sizeof *names; k++)
        if (*names[k] == NULL && (*names[k] = PyUnicode_InternFromString(text[k])) == NULL)
            return -1;
    return PyModule_AddFunctions(m, cuda_functions);
}
