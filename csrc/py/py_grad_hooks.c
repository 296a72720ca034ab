/* py_grad_hooks.c - pyddp._C.GradHooks: the per-iteration state of DDP's
 * gradient hooks, and the hooks themselves for the common torch case.
 *
 * GradSync (pyddp/_ddp_reducer.py) keeps its iteration state here: whether a
 * synced backward is expected, whether a gradient has arrived in it, and how
 * many gradients each parameter received. The torch front-end registers
 * hook(i) on each parameter (register_post_accumulate_grad_hook). A hook
 * does the whole job in C when the lean conditions hold:
 *   - a CPU reducer is set (set_lean(reducer): the C data path, none of
 *     static_graph, find_unused_parameters or gradient_as_bucket_view);
 *   - the parameter's .grad is a torch.Tensor, CPU, strided, contiguous, of
 *     a dtype in the `dtypes` map (torch dtype -> ddp_dtype code);
 *   - it is the parameter's first gradient of the iteration.
 * Then it counts the gradient, hands it to the reducer by address (copied
 * back when the average is ready) and, for the first gradient of the
 * iteration, calls `first()` (which queues the end-of-backward callback).
 * Anything else calls `slow(i, param)`, the Python path, which keeps every
 * rule and message; so does an error from the reducer (`failed(exc)` turns
 * it into DDP's error and breaks the group). On the lean path a hook does
 * nothing outside an expected synced backward (no_sync, evaluation); without
 * a reducer every call goes to slow().
 *
 * GradHooks(nparams)
 *   expect, started: bools, read and written by GradSync.
 *   count(i), bump(i) -> the new count, counts() -> list, reset().
 *   set_lean(reducer_or_None); slow, first, failed: callables; tensor_type,
 *   strided: torch.Tensor and torch.strided; dtypes: dict.
 *   hook(i) -> the callable for parameter i.
 *   detach(): drop every reference (the DDP is gone; hooks do nothing).
 *
 * The hooks run under the GIL (autograd calls Python hooks with it); the
 * gradient copy itself releases it for large gradients (Reducer.ready).
 */
#include "py_common.h"

#include <stddef.h>
#include <string.h>
#include <structmember.h>
#include "ddp_dtype.h"

typedef struct {
    PyObject_HEAD
    int expect, started, detached;
    Py_ssize_t n;
    int32_t *counts;
    PyObject *reducer;      /* lean path's _C.Reducer, or NULL */
    PyObject *slow, *first, *failed, *tensor_type, *strided, *dtypes;
} HooksObject;

typedef struct {
    PyObject_HEAD
    HooksObject *hooks;
    Py_ssize_t i;
    vectorcallfunc vectorcall;
} HookObject;

static PyTypeObject *HooksType, *HookType;
static PyObject *s_grad, *s_dtype, *s_layout, *s_is_cpu, *s_is_contiguous, *s_data_ptr,
                *s_numel;

/* ---- GradHooks --------------------------------------------------------- */

static PyObject *hooks_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"nparams", NULL};
    Py_ssize_t n;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "n", kwlist, &n)) return NULL;
    if (n < 0) return ddp_py_raise(DDP_ERR_INVALID, "GradHooks: nparams < 0");
    HooksObject *self = (HooksObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->n = n;
    self->counts = PyMem_Calloc(n ? (size_t)n : 1, sizeof *self->counts);
    if (self->counts == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static void hooks_drop(HooksObject *self) {
    Py_CLEAR(self->reducer);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->first);
    Py_CLEAR(self->failed);
    Py_CLEAR(self->tensor_type);
    Py_CLEAR(self->strided);
    Py_CLEAR(self->dtypes);
}

static void hooks_dealloc(HooksObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    hooks_drop(self);
    PyMem_Free(self->counts);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static int index_of(HooksObject *self, PyObject *arg, Py_ssize_t *i) {
    *i = PyLong_AsSsize_t(arg);
    if (*i == -1 && PyErr_Occurred()) return -1;
    if (*i < 0 || *i >= self->n) {
        PyErr_Format(PyExc_IndexError, "parameter index %zd out of range", *i);
        return -1;
    }
    return 0;
}

static PyObject *hooks_count(HooksObject *self, PyObject *arg) {
    Py_ssize_t i;
    if (index_of(self, arg, &i) < 0) return NULL;
    return PyLong_FromLong(self->counts[i]);
}

static PyObject *hooks_bump(HooksObject *self, PyObject *arg) {
    Py_ssize_t i;
    if (index_of(self, arg, &i) < 0) return NULL;
    return PyLong_FromLong(++self->counts[i]);
}

static PyObject *hooks_counts(HooksObject *self, PyObject *unused) {
    PyObject *out = PyList_New(self->n);
    for (Py_ssize_t i = 0; out && i < self->n; i++) {
        PyObject *v = PyLong_FromLong(self->counts[i]);
        if (v == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, v);
    }
    return out;
}

static PyObject *hooks_reset(HooksObject *self, PyObject *unused) {
    memset(self->counts, 0, (size_t)self->n * sizeof *self->counts);
    self->started = 0;
    Py_RETURN_NONE;
}

static PyObject *hooks_set_lean(HooksObject *self, PyObject *arg) {
    Py_XSETREF(self->reducer, arg == Py_None || self->detached ? NULL : Py_NewRef(arg));
    Py_RETURN_NONE;
}

static PyObject *hooks_detach(HooksObject *self, PyObject *unused) {
    self->detached = 1;
    self->expect = 0;
    hooks_drop(self);
    Py_RETURN_NONE;
}

static PyObject *hooks_hook(HooksObject *self, PyObject *arg);

static PyMethodDef hooks_methods[] = {
    {"count", (PyCFunction)hooks_count, METH_O, "count(i): gradients of parameter i"},
    {"bump", (PyCFunction)hooks_bump, METH_O, "bump(i): count one more, return the count"},
    {"counts", (PyCFunction)hooks_counts, METH_NOARGS, "every parameter's count"},
    {"reset", (PyCFunction)hooks_reset, METH_NOARGS, "counts to 0, started to False"},
    {"set_lean", (PyCFunction)hooks_set_lean, METH_O,
     "set_lean(reducer or None): hooks hand gradients to this C reducer"},
    {"detach", (PyCFunction)hooks_detach, METH_NOARGS, "drop every reference"},
    {"hook", (PyCFunction)hooks_hook, METH_O, "hook(i): the hook for parameter i"},
    {NULL}
};

static PyObject *get_flag(HooksObject *self, void *which) {
    return PyBool_FromLong(which ? self->started : self->expect);
}

static int set_flag(HooksObject *self, PyObject *v, void *which) {
    int b = v == NULL ? 0 : PyObject_IsTrue(v);
    if (b < 0) return -1;
    if (which) self->started = b;
    else self->expect = b && !self->detached;
    return 0;
}

/* Getter/setter of one callable or object slot (offset in which). */
static PyObject *get_obj(HooksObject *self, void *off) {
    PyObject *v = *(PyObject **)((char *)self + (size_t)off);
    return Py_NewRef(v ? v : Py_None);
}

static int set_obj(HooksObject *self, PyObject *v, void *off) {
    PyObject **slot = (PyObject **)((char *)self + (size_t)off);
    Py_XSETREF(*slot, v == NULL || v == Py_None || self->detached ? NULL : Py_NewRef(v));
    return 0;
}

#define OBJ_SLOT(name, doc) \
    {#name, (getter)get_obj, (setter)set_obj, doc, (void *)offsetof(HooksObject, name)}

static PyGetSetDef hooks_getset[] = {
    {"expect", (getter)get_flag, (setter)set_flag, "a synced backward is expected", NULL},
    {"started", (getter)get_flag, (setter)set_flag, "a gradient arrived in it", (void *)1},
    OBJ_SLOT(slow, "slow(i, param): the Python hook"),
    OBJ_SLOT(first, "first(): called for the first gradient of a synced iteration"),
    OBJ_SLOT(failed, "failed(exc): the reducer raised exc"),
    OBJ_SLOT(tensor_type, "torch.Tensor"),
    OBJ_SLOT(strided, "torch.strided"),
    OBJ_SLOT(dtypes, "torch dtype -> ddp_dtype code"),
    {NULL}
};

static PyType_Slot hooks_slots[] = {
    {Py_tp_new, hooks_new},
    {Py_tp_dealloc, hooks_dealloc},
    {Py_tp_methods, hooks_methods},
    {Py_tp_getset, hooks_getset},
    {Py_tp_doc, "DDP's gradient-hook state, and the hooks."},
    {0, NULL}
};

static PyType_Spec hooks_spec = {"pyddp._C.GradHooks", sizeof(HooksObject), 0,
                                 Py_TPFLAGS_DEFAULT, hooks_slots};

/* ---- one parameter's hook ------------------------------------------------ */

/* 1 if the tensor t may take the lean path (CPU, strided, contiguous, a
 * known dtype), filling its address, element count and dtype code; 0 if not;
 * -1 with an exception. */
static int lean_tensor(HooksObject *h, PyObject *t, void **ptr, size_t *count, int *code) {
    if (h->tensor_type == NULL || h->dtypes == NULL || (PyObject *)Py_TYPE(t) != h->tensor_type)
        return 0;
    PyObject *v = PyObject_GetAttr(t, s_dtype);
    if (v == NULL) return -1;
    PyObject *c = PyDict_GetItemWithError(h->dtypes, v);   /* borrowed */
    Py_DECREF(v);
    if (c == NULL) return PyErr_Occurred() ? -1 : 0;
    *code = (int)PyLong_AsLong(c);
    if (*code == -1 && PyErr_Occurred()) return -1;
    if ((v = PyObject_GetAttr(t, s_is_cpu)) == NULL) return -1;
    int ok = v == Py_True;
    Py_DECREF(v);
    if (!ok) return 0;
    if ((v = PyObject_GetAttr(t, s_layout)) == NULL) return -1;
    ok = v == h->strided;
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

/* The reducer raised: let failed(exc) make DDP's error of it (it raises). */
static PyObject *reducer_failed(HooksObject *h) {
    if (h->failed == NULL) return NULL;
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyErr_NormalizeException(&et, &ev, &tb);
    if (tb != NULL && ev != NULL) PyException_SetTraceback(ev, tb);
    PyObject *fn = Py_NewRef(h->failed);
    PyObject *r = PyObject_CallOneArg(fn, ev ? ev : Py_None);
    Py_DECREF(fn);
    if (r != NULL) {            /* it did not raise: the original error stands */
        Py_DECREF(r);
        PyErr_Restore(et, ev, tb);
        return NULL;
    }
    Py_XDECREF(et);
    Py_XDECREF(ev);
    Py_XDECREF(tb);
    return NULL;
}

static PyObject *call_slow(HooksObject *h, Py_ssize_t i, PyObject *param) {
    if (h->slow == NULL) Py_RETURN_NONE;
    PyObject *fn = Py_NewRef(h->slow), *idx = PyLong_FromSsize_t(i);
    PyObject *r = idx ? PyObject_CallFunctionObjArgs(fn, idx, param, NULL) : NULL;
    Py_DECREF(fn);
    Py_XDECREF(idx);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;     /* a post-accumulate-grad hook returns None */
}

/* hook(param): see the header. Returns None, or NULL with an exception. */
static PyObject *hook_call(HookObject *self, PyObject *const *args, size_t nargsf,
                           PyObject *kw) {
    if (PyVectorcall_NARGS(nargsf) != 1 || kw != NULL) {
        PyErr_SetString(PyExc_TypeError, "a DDP gradient hook takes the parameter");
        return NULL;
    }
    HooksObject *h = self->hooks;
    Py_ssize_t i = self->i;
    if (h->reducer == NULL) return call_slow(h, i, args[0]);   /* it has its own rules */
    if (!h->expect) Py_RETURN_NONE;
    if (h->counts[i] != 0) return call_slow(h, i, args[0]);
    PyObject *grad = PyObject_GetAttr(args[0], s_grad);
    if (grad == NULL) return NULL;
    void *ptr = NULL;
    size_t count = 0;
    int code = 0;
    int lean = lean_tensor(h, grad, &ptr, &count, &code);
    if (lean <= 0) {
        Py_DECREF(grad);
        return lean < 0 ? NULL : call_slow(h, i, args[0]);
    }
    h->counts[i] = 1;
    int first = !h->started;
    h->started = 1;
    PyObject *reducer = Py_NewRef(h->reducer);
    PyObject *r = ddp_py_reducer_ready(reducer, (size_t)i, grad, ptr, count, code, 1);
    Py_DECREF(reducer);
    Py_DECREF(grad);
    if (r == NULL) return reducer_failed(h);
    Py_DECREF(r);
    if (first && h->first != NULL) {
        PyObject *fn = Py_NewRef(h->first);
        r = PyObject_CallNoArgs(fn);
        Py_DECREF(fn);
        if (r == NULL) return NULL;
        Py_DECREF(r);
    }
    Py_RETURN_NONE;
}

static PyObject *hooks_hook(HooksObject *self, PyObject *arg) {
    Py_ssize_t i;
    if (index_of(self, arg, &i) < 0) return NULL;
    HookObject *k = PyObject_New(HookObject, HookType);
    if (k == NULL) return NULL;
    k->hooks = (HooksObject *)Py_NewRef(self);
    k->i = i;
    k->vectorcall = (vectorcallfunc)hook_call;
    return (PyObject *)k;
}

static void hook_dealloc(HookObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    Py_DECREF(self->hooks);
    PyObject_Free(self);
    Py_DECREF(tp);
}

static PyObject *hook_repr(HookObject *self) {
    return PyUnicode_FromFormat("<pyddp DDP gradient hook of parameter %zd>", self->i);
}

static PyMemberDef hook_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(HookObject, vectorcall), READONLY},
    {NULL}
};

static PyType_Slot hook_slots[] = {
    {Py_tp_dealloc, hook_dealloc},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_repr, hook_repr},
    {Py_tp_members, hook_members},
    {Py_tp_doc, "A DDP gradient hook (GradHooks.hook)."},
    {0, NULL}
};

static PyType_Spec hook_spec = {"pyddp._C.GradHook", sizeof(HookObject), 0,
                                Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL, hook_slots};

int ddp_py_grad_hooks_register(PyObject *m) {
    static PyObject **names[] = {&s_grad, &s_dtype, &s_layout, &s_is_cpu, &s_is_contiguous,
                                 &s_data_ptr, &s_numel};
    static const char *text[] = {"grad", "dtype", "layout", "is_cpu", "is_contiguous",
                                 "data_ptr", "numel"};
    for (size_t k = 0; k < sizeof names / sizeof *names; k++)
        if (*names[k] == NULL && (*names[k] = PyUnicode_InternFromString(text[k])) == NULL)
            return -1;
    HooksType = (PyTypeObject *)PyType_FromSpec(&hooks_spec);
    if (HooksType == NULL) return -1;
    HookType = (PyTypeObject *)PyType_FromSpec(&hook_spec);
    if (HookType == NULL) return -1;
    return PyModule_AddObjectRef(m, "GradHooks", (PyObject *)HooksType);
}
