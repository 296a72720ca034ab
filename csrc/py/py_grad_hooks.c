/* py_grad_hooks.c - pyddp._C.GradHooks: DDP's gradient hooks, and the
 * Python face of DDP's per-gradient rules (ddp_grad_rules, in
 * csrc/core/ddp_reducer.c), which it owns.
 *
 * The rules are asked through one entry, whichever path a gradient takes:
 * the torch front-end registers hook(i) on each parameter
 * (register_post_accumulate_grad_hook), and the hook applies the rules in C;
 * the array front-end (and any caller without a hook) calls on_grad(i,
 * has_grad), which applies the same rules and returns their verdict. The
 * rules note use in the reducer set by set_reducer(reducer, lean), count the
 * gradient, and decide (see ddp_grad_verdict). After the verdict, a hook
 * does the whole job in C when:
 *   - lean is set (the CPU reducer's C data path, none of static_graph,
 *     find_unused_parameters or gradient_as_bucket_view);
 *   - the verdict is "ready" with nothing to pre-mark;
 *   - the parameter's .grad is a torch.Tensor, CPU, strided, contiguous, of
 *     a dtype in the `dtypes` map (torch dtype -> ddp_dtype code; the same
 *     test as pyddp/_arrays.py's torch_cpu_code, which supplies the map).
 * Then it hands the gradient to the reducer by address (copied back when the
 * average is ready); a reducer error calls `failed(exc)`, which turns it into
 * DDP's error and breaks the group. Any other verdict that asks for work
 * (ready, pre-mark, an error) calls `act(i, verdict)`, the Python side, which
 * moves the data with the array library and words the errors. Last, for the
 * first gradient of a synced backward, the hook calls `first()` (which
 * queues the end-of-backward callback).
 *
 * GradHooks(nparams, static_graph=False, find_unused=False)
 *   begin(); on_grad(i, has_grad) -> verdict; end_backward() -> (outcome,
 *   indices, track_used); learn() -> bool; never_used() -> list;
 *   counts() -> list; expect, learning: read-only bools.
 *   A verdict is (action, first, premark, count, expected): the fields of
 *   ddp_grad_verdict, action one of GRAD_IGNORE/WAIT/READY/SECOND/TOO_MANY;
 *   outcome one of GRAD_END_OK/UNUSED/STATIC_UNUSED (module constants).
 *   set_reducer(reducer_or_None, lean); act, first, failed: callables;
 *   tensor_type, strided: torch.Tensor and torch.strided; dtypes: dict.
 *   hook(i) -> the callable for parameter i.
 *   detach(): drop every reference (the DDP is gone; hooks do nothing).
 *
 * The hooks run under the GIL (autograd calls Python hooks with it); the
 * gradient copy itself releases it for large gradients (Reducer.ready).
 */
#include "py_reducer.h"

#include <stddef.h>
#include <string.h>
#include <structmember.h>
#include "ddp_dtype.h"

typedef struct {
    PyObject_HEAD
    int lean, detached;
    Py_ssize_t n;
    ddp_grad_rules *rules;
    size_t *idx;            /* [n] scratch for index lists */
    PyObject *reducer;      /* the _C.Reducer the rules note use in, or NULL */
    ddp_reducer *core;      /* its core reducer (valid while reducer is held), or NULL */
    PyObject *act, *first, *failed, *tensor_type, *strided, *dtypes;
} HooksObject;

typedef struct {
    PyObject_HEAD
    HooksObject *hooks;
    Py_ssize_t i;
    vectorcallfunc vectorcall;
} HookObject;

static PyTypeObject *HooksType, *HookType;
static PyObject *s_grad;

/* ---- GradHooks --------------------------------------------------------- */

static PyObject *hooks_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"nparams", "static_graph", "find_unused", NULL};
    Py_ssize_t n;
    int static_graph = 0, find_unused = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "n|pp", kwlist, &n, &static_graph,
                                     &find_unused))
        return NULL;
    if (n < 0) return ddp_py_raise(DDP_ERR_INVALID, "GradHooks: nparams < 0");
    HooksObject *self = (HooksObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->n = n;
    self->idx = PyMem_Calloc(n ? (size_t)n : 1, sizeof *self->idx);
    if (self->idx == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    ddp_status st = ddp_grad_rules_create((size_t)n, static_graph, find_unused, &self->rules);
    if (st != DDP_OK) {
        Py_DECREF(self);
        return ddp_py_raise(st, NULL);
    }
    return (PyObject *)self;
}

static void hooks_drop(HooksObject *self) {
    self->core = NULL;
    Py_CLEAR(self->reducer);
    Py_CLEAR(self->act);
    Py_CLEAR(self->first);
    Py_CLEAR(self->failed);
    Py_CLEAR(self->tensor_type);
    Py_CLEAR(self->strided);
    Py_CLEAR(self->dtypes);
}

static void hooks_dealloc(HooksObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    hooks_drop(self);
    ddp_grad_rules_destroy(self->rules);
    PyMem_Free(self->idx);
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

/* (action, first, premark, count, expected), or NULL with an exception. */
static PyObject *verdict_tuple(const ddp_grad_verdict *v) {
    PyObject *t = PyTuple_New(5);
    if (t == NULL) return NULL;
    PyObject *items[5] = {PyLong_FromLong(v->action), PyBool_FromLong(v->first),
                          PyBool_FromLong(v->premark), PyLong_FromLong(v->count),
                          PyLong_FromLong(v->expected)};
    for (Py_ssize_t k = 0; k < 5; k++) {
        if (items[k] == NULL) {
            for (Py_ssize_t j = k + 1; j < 5; j++) Py_XDECREF(items[j]);
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, k, items[k]);
    }
    return t;
}

static PyObject *hooks_begin(HooksObject *self, PyObject *unused) {
    if (!self->detached) ddp_grad_rules_begin(self->rules);
    Py_RETURN_NONE;
}

static PyObject *hooks_on_grad(HooksObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t i;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "on_grad(i, has_grad) takes 2 arguments");
        return NULL;
    }
    int has_grad = PyObject_IsTrue(args[1]);
    if (has_grad < 0 || index_of(self, args[0], &i) < 0) return NULL;
    ddp_grad_verdict v;
    ddp_status st = ddp_grad_rules_on_grad(self->rules, self->core, (size_t)i, has_grad, &v);
    if (st != DDP_OK) return ddp_py_raise(st, NULL);
    return verdict_tuple(&v);
}

static PyObject *hooks_end_backward(HooksObject *self, PyObject *unused) {
    ddp_reducer *r = self->core;
    if (r == NULL) {
        ddp_grad_rules_stop(self->rules);
        return ddp_py_raise(DDP_ERR_INVALID, "GradHooks.end_backward: no reducer set");
    }
    ddp_grad_end e;
    ddp_grad_rules_end(self->rules, r, self->idx, &e);
    return Py_BuildValue("(iNN)", (int)e.outcome, ddp_py_size_list(self->idx, e.n),
                         PyBool_FromLong(e.track_used));
}

static PyObject *hooks_learn(HooksObject *self, PyObject *unused) {
    return PyBool_FromLong(ddp_grad_rules_learn(self->rules));
}

static PyObject *hooks_never_used(HooksObject *self, PyObject *unused) {
    return ddp_py_size_list(self->idx, ddp_grad_rules_never_used(self->rules, self->idx));
}

static PyObject *hooks_counts(HooksObject *self, PyObject *unused) {
    PyObject *out = PyList_New(self->n);
    for (Py_ssize_t i = 0; out && i < self->n; i++) {
        PyObject *v = PyLong_FromLong(ddp_grad_rules_count(self->rules, (size_t)i));
        if (v == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, v);
    }
    return out;
}

static PyObject *hooks_set_reducer(HooksObject *self, PyObject *args) {
    PyObject *reducer;
    int lean;
    if (!PyArg_ParseTuple(args, "Op", &reducer, &lean)) return NULL;
    if (reducer != Py_None && ddp_py_reducer_core(reducer) == NULL) return NULL;
    Py_XSETREF(self->reducer, reducer == Py_None || self->detached ? NULL : Py_NewRef(reducer));
    self->core = self->reducer ? ddp_py_reducer_core(self->reducer) : NULL;
    self->lean = lean && self->reducer != NULL;
    Py_RETURN_NONE;
}

static PyObject *hooks_detach(HooksObject *self, PyObject *unused) {
    self->detached = 1;
    self->lean = 0;
    ddp_grad_rules_stop(self->rules);
    hooks_drop(self);
    Py_RETURN_NONE;
}

static PyObject *hooks_hook(HooksObject *self, PyObject *arg);

static PyMethodDef hooks_methods[] = {
    {"begin", (PyCFunction)hooks_begin, METH_NOARGS,
     "a synced backward is expected: counts to 0, no gradient yet"},
    {"on_grad", (PyCFunction)(void (*)(void))hooks_on_grad, METH_FASTCALL,
     "on_grad(i, has_grad) -> (action, first, premark, count, expected): the rules' verdict"},
    {"end_backward", (PyCFunction)hooks_end_backward, METH_NOARGS,
     "end_backward() -> (outcome, indices, track_used): what the end of backward does"},
    {"learn", (PyCFunction)hooks_learn, METH_NOARGS,
     "static graph: the first iteration's counts become the expected ones (True if now)"},
    {"never_used", (PyCFunction)hooks_never_used, METH_NOARGS,
     "parameters a learned static graph never gives a gradient"},
    {"counts", (PyCFunction)hooks_counts, METH_NOARGS, "every parameter's gradient count"},
    {"set_reducer", (PyCFunction)hooks_set_reducer, METH_VARARGS,
     "set_reducer(reducer or None, lean): the rules note use in it; lean: hooks hand "
     "contiguous CPU gradients to it by address"},
    {"detach", (PyCFunction)hooks_detach, METH_NOARGS, "drop every reference"},
    {"hook", (PyCFunction)hooks_hook, METH_O, "hook(i): the hook for parameter i"},
    {NULL}
};

static PyObject *get_flag(HooksObject *self, void *which) {
    return PyBool_FromLong(which ? ddp_grad_rules_learning(self->rules)
                                 : ddp_grad_rules_expecting(self->rules));
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
    {"expect", (getter)get_flag, NULL, "a synced backward is expected", NULL},
    {"learning", (getter)get_flag, NULL, "a static graph whose counts are not learned yet",
     (void *)1},
    OBJ_SLOT(act, "act(i, verdict): the Python side of a verdict (data, errors)"),
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

/* 1 if the tensor t may take the lean path (ddp_py_torch_cpu_tensor), filling
 * its address, element count and dtype code; 0 if not; -1 with an exception. */
static int lean_tensor(HooksObject *h, PyObject *t, void **ptr, size_t *count, int *code) {
    return ddp_py_torch_cpu_tensor(h->tensor_type, h->strided, h->dtypes, t, ptr, count, code);
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

/* Call fn() or fn(i, verdict) (verdict NULL: no arguments). 0, or -1 with
 * fn's exception. */
static int call_back(PyObject *fn, Py_ssize_t i, const ddp_grad_verdict *v) {
    if (fn == NULL) return 0;
    fn = Py_NewRef(fn);     /* the call may replace the slot */
    PyObject *r = NULL;
    if (v == NULL) {
        r = PyObject_CallNoArgs(fn);
    } else {
        PyObject *idx = PyLong_FromSsize_t(i), *vt = verdict_tuple(v);
        if (idx != NULL && vt != NULL) r = PyObject_CallFunctionObjArgs(fn, idx, vt, NULL);
        Py_XDECREF(idx);
        Py_XDECREF(vt);
    }
    Py_DECREF(fn);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* The C data path for grad, parameter i's ready gradient: 1 handed to the
 * reducer by address, 0 not a lean tensor (nothing done), -1 with DDP's error
 * (the reducer raised: failed(exc)) or another exception. */
static int lean_ready(HooksObject *h, Py_ssize_t i, PyObject *grad) {
    void *ptr = NULL;
    size_t count = 0;
    int code = 0;
    int lean = lean_tensor(h, grad, &ptr, &count, &code);
    if (lean <= 0) return lean;
    PyObject *reducer = Py_NewRef(h->reducer);
    PyObject *r = ddp_py_reducer_ready(reducer, (size_t)i, grad, ptr, count, code, 1);
    Py_DECREF(reducer);
    if (r == NULL) {
        reducer_failed(h);
        return -1;
    }
    Py_DECREF(r);
    return 1;
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
    /* Nothing to do: DDP is gone, or neither a synced backward nor use tracking. */
    if (h->core == NULL || !ddp_grad_rules_listening(h->rules)) Py_RETURN_NONE;
    PyObject *grad = PyObject_GetAttr(args[0], s_grad);
    if (grad == NULL) return NULL;
    ddp_grad_verdict v;
    ddp_status st = ddp_grad_rules_on_grad(h->rules, h->core, (size_t)i, grad != Py_None, &v);
    int done = 0;
    if (st == DDP_OK && v.action == DDP_GRAD_READY && !v.premark && h->lean)
        done = lean_ready(h, i, grad);
    Py_DECREF(grad);
    if (st != DDP_OK) return ddp_py_raise(st, NULL);
    if (done < 0) return NULL;
    int work = v.premark || (v.action != DDP_GRAD_IGNORE && v.action != DDP_GRAD_WAIT);
    if (!done && work && call_back(h->act, i, &v) < 0) return NULL;
    if (v.first && call_back(h->first, i, NULL) < 0) return NULL;
    Py_RETURN_NONE;     /* a post-accumulate-grad hook returns None */
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
    if (s_grad == NULL && (s_grad = PyUnicode_InternFromString("grad")) == NULL) return -1;
    HooksType = (PyTypeObject *)PyType_FromSpec(&hooks_spec);
    if (HooksType == NULL) return -1;
    HookType = (PyTypeObject *)PyType_FromSpec(&hook_spec);
    if (HookType == NULL) return -1;
    static const struct { const char *name; int value; } consts[] = {
        {"GRAD_IGNORE", DDP_GRAD_IGNORE}, {"GRAD_WAIT", DDP_GRAD_WAIT},
        {"GRAD_READY", DDP_GRAD_READY}, {"GRAD_SECOND", DDP_GRAD_SECOND},
        {"GRAD_TOO_MANY", DDP_GRAD_TOO_MANY}, {"GRAD_END_OK", DDP_GRAD_END_OK},
        {"GRAD_END_UNUSED", DDP_GRAD_END_UNUSED},
        {"GRAD_END_STATIC_UNUSED", DDP_GRAD_END_STATIC_UNUSED}};
    for (size_t k = 0; k < sizeof consts / sizeof *consts; k++)
        if (PyModule_AddIntConstant(m, consts[k].name, consts[k].value) < 0) return -1;
    return PyModule_AddObjectRef(m, "GradHooks", (PyObject *)HooksType);
}
