/* py_store_py.c - a core store (ddp_store.h) whose calls are a Python object's
 * methods: how the core's rendezvous, its straggler announcements and the NCCL
 * set-up run on a store that is not a TCPStore server, such as the etcd-backed
 * one (pyddp/_etcd_kv.py). The object speaks _C.StoreClient's protocol (keys
 * and values are bytes, exactly as the core composes them):
 *
 *   set(k, v, ms)  append(k, v, ms)  get(k, ms)  add(k, delta, ms) -> int
 *   wait(keys, ms)  multi_get(keys, ms) -> [bytes]  multi_set(keys, values, ms)
 *   check(keys, ms) -> bool  compare_set(k, e, d, ms) -> bytes
 *   delete_key(k, ms) -> bool  num_keys(ms) -> int
 *
 * where ms (timeout_ms) is what is left of the ddp_wait's deadline (None for
 * no deadline): a call the core bounds (a failure announced within 1 s, say)
 * is bounded there too.
 *
 * The core calls a store from threads of its own (the rendezvous helper, the
 * communicator's workers): each call takes the GIL for its duration
 * (PyGILState_Ensure), which is safe because every Python thread that waits
 * for those threads does so with the GIL released (py_blocking.c). A call
 * made while the interpreter is finalizing fails instead of taking the GIL.
 * An exception becomes DDP_ERR_TIMEOUT (a TimeoutError)
 * or DDP_ERR_STORE with its class and message.
 */
#include "py_common.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "ddp_clock.h"
#include "ddp_store.h"

typedef struct {
    PyObject *obj;          /* a strong reference, dropped in destroy (with the GIL) */
    atomic_int closed;      /* ddp_store_close: later calls fail at once */
} pystore;

static int finalizing(void) {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
}

/* Enter a call: DDP_OK with the GIL taken (*g), or a status when the store
 * was closed or Python is going away. */
static ddp_status enter(pystore *p, const char *op, PyGILState_STATE *g) {
    if (atomic_load(&p->closed))
        return ddp_error(DDP_ERR_STORE, "store %s: the store was closed", op);
    if (finalizing())
        return ddp_error(DDP_ERR_STORE, "store %s: the interpreter is shutting down", op);
    *g = PyGILState_Ensure();
    return DDP_OK;
}

/* The pending exception as a status (and the core's error text); clears it. */
static ddp_status failed(const char *op) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    ddp_status st = DDP_ERR_STORE;
    if (type != NULL && PyErr_GivenExceptionMatches(type, PyExc_TimeoutError))
        st = DDP_ERR_TIMEOUT;
    PyObject *text = value != NULL ? PyObject_Str(value) : NULL;
    const char *msg = text != NULL ? PyUnicode_AsUTF8(text) : NULL;
    if (msg == NULL) PyErr_Clear();
    st = ddp_error(st, "store %s: %s: %s", op,
                   type != NULL ? ((PyTypeObject *)type)->tp_name : "error",
                   msg != NULL ? msg : "(no message)");
    Py_XDECREF(text);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return st;
}

/* What is left of w, as the timeout_ms argument (None: no deadline). */
static PyObject *left_ms(ddp_wait w) {
    if (w.deadline_ms >= DDP_NO_DEADLINE / 2) Py_RETURN_NONE;
    int64_t ms = w.deadline_ms - ddp_now_ms();
    return PyLong_FromLongLong(ms > 0 ? ms : 0);
}

static PyObject *key_list(const char *const *keys, const size_t *klens, size_t n) {
    PyObject *l = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; l != NULL && i < n; i++) {
        PyObject *k = PyBytes_FromStringAndSize(keys[i], (Py_ssize_t)klens[i]);
        if (k == NULL) {
            Py_CLEAR(l);
            break;
        }
        PyList_SET_ITEM(l, (Py_ssize_t)i, k);
    }
    return l;
}

/* A bytes result copied into a malloc'd buffer the caller owns. */
static ddp_status take_bytes(PyObject *r, void **val, size_t *vlen, const char *op) {
    char *p;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(r, &p, &n) < 0) return failed(op);
    *val = malloc(n ? (size_t)n : 1);
    if (*val == NULL) return ddp_error(DDP_ERR_NOMEM, "store %s: out of memory", op);
    memcpy(*val, p, (size_t)n);
    *vlen = (size_t)n;
    return DDP_OK;
}

/* One call: with the GIL, build the arguments with b(a), call the method
 * name, and hand its result to done (NULL: the result is ignored). */
typedef PyObject *(*builder)(void *a);

static ddp_status run(pystore *p, const char *op, const char *name, builder b, void *a,
                      ddp_status (*done)(PyObject *, void *, const char *), void *arg) {
    PyGILState_STATE g = PyGILState_UNLOCKED;
    ddp_status st = enter(p, op, &g);
    if (st != DDP_OK) return st;
    PyObject *args = b(a), *r = NULL;
    if (args != NULL) {
        PyObject *m = PyObject_GetAttrString(p->obj, name);
        if (m != NULL) r = PyObject_Call(m, args, NULL);
        Py_XDECREF(m);
    }
    if (r == NULL) st = failed(op);
    else if (done != NULL) st = done(r, arg, op);
    Py_XDECREF(r);
    Py_XDECREF(args);
    PyGILState_Release(g);
    return st;
}

typedef struct {
    const char *key;
    size_t klen;
    const void *val;
    size_t vlen;
    const void *val2;
    size_t vlen2;
    int64_t num;
    const char *const *keys;
    const size_t *klens;
    const void *const *vals;
    const size_t *vlens;
    size_t n;
    ddp_wait w;
} args_t;

static PyObject *b_kv(void *v) {
    args_t *a = v;
    PyObject *ms = left_ms(a->w);
    return ms ? Py_BuildValue("(y#y#N)", a->key, (Py_ssize_t)a->klen, (const char *)a->val,
                              (Py_ssize_t)a->vlen, ms) : NULL;
}
static PyObject *b_k_ms(void *v) {
    args_t *a = v;
    PyObject *ms = left_ms(a->w);
    return ms ? Py_BuildValue("(y#N)", a->key, (Py_ssize_t)a->klen, ms) : NULL;
}
static PyObject *b_k_num(void *v) {
    args_t *a = v;
    PyObject *ms = left_ms(a->w);
    return ms ? Py_BuildValue("(y#LN)", a->key, (Py_ssize_t)a->klen, (long long)a->num, ms)
              : NULL;
}
static PyObject *b_keys_ms(void *v) {
    args_t *a = v;
    PyObject *l = key_list(a->keys, a->klens, a->n);
    PyObject *ms = l ? left_ms(a->w) : NULL;
    if (ms == NULL) {
        Py_XDECREF(l);
        return NULL;
    }
    return Py_BuildValue("(NN)", l, ms);
}
static PyObject *b_kvs(void *v) {
    args_t *a = v;
    PyObject *k = key_list(a->keys, a->klens, a->n);
    PyObject *vals = k ? key_list((const char *const *)a->vals, a->vlens, a->n) : NULL;
    if (vals == NULL) {
        Py_XDECREF(k);
        return NULL;
    }
    PyObject *ms = left_ms(a->w);
    return ms ? Py_BuildValue("(NNN)", k, vals, ms) : (Py_DECREF(k), Py_DECREF(vals), NULL);
}
static PyObject *b_ked(void *v) {
    args_t *a = v;
    PyObject *ms = left_ms(a->w);
    return ms ? Py_BuildValue("(y#y#y#N)", a->key, (Py_ssize_t)a->klen, (const char *)a->val,
                              (Py_ssize_t)a->vlen, (const char *)a->val2,
                              (Py_ssize_t)a->vlen2, ms) : NULL;
}
static PyObject *b_ms(void *v) {
    args_t *a = v;
    PyObject *ms = left_ms(a->w);
    return ms ? Py_BuildValue("(N)", ms) : NULL;
}

/* ---- results ---------------------------------------------------------- */

typedef struct {
    void **val;
    size_t *vlen;
    void **vals;
    size_t *vlens;
    size_t n;
    int64_t *num;
    int *flag;
} out_t;

static ddp_status d_bytes(PyObject *r, void *o, const char *op) {
    out_t *out = o;
    return take_bytes(r, out->val, out->vlen, op);
}
static ddp_status d_int(PyObject *r, void *o, const char *op) {
    out_t *out = o;
    long long v = PyLong_AsLongLong(r);
    if (v == -1 && PyErr_Occurred()) return failed(op);
    *out->num = v;
    return DDP_OK;
}
static ddp_status d_flag(PyObject *r, void *o, const char *op) {
    out_t *out = o;
    int t = PyObject_IsTrue(r);
    if (t < 0) return failed(op);
    *out->flag = t;
    return DDP_OK;
}
static ddp_status d_list(PyObject *r, void *o, const char *op) {
    out_t *out = o;
    PyObject *fast = PySequence_Fast(r, "multi_get must return a list of bytes");
    if (fast == NULL) return failed(op);
    ddp_status st = DDP_OK;
    if ((size_t)PySequence_Fast_GET_SIZE(fast) != out->n)
        st = ddp_error(DDP_ERR_STORE, "store %s: %zd values for %zu keys", op,
                       PySequence_Fast_GET_SIZE(fast), out->n);
    for (size_t i = 0; st == DDP_OK && i < out->n; i++)
        st = take_bytes(PySequence_Fast_GET_ITEM(fast, (Py_ssize_t)i), &out->vals[i],
                        &out->vlens[i], op);
    if (st != DDP_OK)
        for (size_t i = 0; i < out->n; i++) {
            free(out->vals[i]);
            out->vals[i] = NULL;
        }
    Py_DECREF(fast);
    return st;
}

/* ---- the table ---------------------------------------------------------- */

static ddp_status p_set(void *c, const char *key, size_t klen, const void *val, size_t vlen,
                        ddp_wait w) {
    args_t a = {.key = key, .klen = klen, .val = val, .vlen = vlen, .w = w};
    return run(c, "set", "set", b_kv, &a, NULL, NULL);
}
static ddp_status p_append(void *c, const char *key, size_t klen, const void *val,
                           size_t vlen, ddp_wait w) {
    args_t a = {.key = key, .klen = klen, .val = val, .vlen = vlen, .w = w};
    return run(c, "append", "append", b_kv, &a, NULL, NULL);
}
static ddp_status p_get(void *c, const char *key, size_t klen, void **val, size_t *vlen,
                        ddp_wait w) {
    args_t a = {.key = key, .klen = klen, .w = w};
    out_t o = {.val = val, .vlen = vlen};
    return run(c, "get", "get", b_k_ms, &a, d_bytes, &o);
}
static ddp_status p_add(void *c, const char *key, size_t klen, int64_t delta, int64_t *res,
                        ddp_wait w) {
    args_t a = {.key = key, .klen = klen, .num = delta, .w = w};
    out_t o = {.num = res};
    return run(c, "add", "add", b_k_num, &a, d_int, &o);
}
static ddp_status p_wait(void *c, const char *const *keys, const size_t *klens, size_t n,
                         ddp_wait w) {
    args_t a = {.keys = keys, .klens = klens, .n = n, .w = w};
    return run(c, "wait", "wait", b_keys_ms, &a, NULL, NULL);
}
static ddp_status p_multi_get(void *c, const char *const *keys, const size_t *klens,
                              size_t n, void **vals, size_t *vlens, ddp_wait w) {
    for (size_t i = 0; i < n; i++) vals[i] = NULL;
    args_t a = {.keys = keys, .klens = klens, .n = n, .w = w};
    out_t o = {.vals = vals, .vlens = vlens, .n = n};
    return run(c, "multi_get", "multi_get", b_keys_ms, &a, d_list, &o);
}
static ddp_status p_multi_set(void *c, const char *const *keys, const size_t *klens,
                              const void *const *vals, const size_t *vlens, size_t n,
                              ddp_wait w) {
    args_t a = {.keys = keys, .klens = klens, .vals = vals, .vlens = vlens, .n = n, .w = w};
    return run(c, "multi_set", "multi_set", b_kvs, &a, NULL, NULL);
}
static ddp_status p_check(void *c, const char *const *keys, const size_t *klens, size_t n,
                          int *ready, ddp_wait w) {
    args_t a = {.keys = keys, .klens = klens, .n = n, .w = w};
    out_t o = {.flag = ready};
    return run(c, "check", "check", b_keys_ms, &a, d_flag, &o);
}
static ddp_status p_compare_set(void *c, const char *key, size_t klen, const void *expected,
                                size_t elen, const void *desired, size_t dlen, void **out,
                                size_t *outlen, ddp_wait w) {
    args_t a = {.key = key, .klen = klen, .val = expected, .vlen = elen, .val2 = desired,
                .vlen2 = dlen, .w = w};
    out_t o = {.val = out, .vlen = outlen};
    return run(c, "compare_set", "compare_set", b_ked, &a, d_bytes, &o);
}
static ddp_status p_delete(void *c, const char *key, size_t klen, int64_t *ndeleted,
                           ddp_wait w) {
    int gone = 0;
    args_t a = {.key = key, .klen = klen, .w = w};
    out_t o = {.flag = &gone};
    ddp_status st = run(c, "delete_key", "delete_key", b_k_ms, &a, d_flag, &o);
    *ndeleted = gone;
    return st;
}
static ddp_status p_num_keys(void *c, int64_t *n, ddp_wait w) {
    args_t a = {.w = w};
    out_t o = {.num = n};
    return run(c, "num_keys", "num_keys", b_ms, &a, d_int, &o);
}
static void p_shutdown(void *c) { atomic_store(&((pystore *)c)->closed, 1); }
static void p_destroy(void *c) {
    pystore *p = c;
    if (!finalizing()) {        /* at interpreter exit the object is left to it */
        PyGILState_STATE g = PyGILState_Ensure();
        Py_DECREF(p->obj);
        PyGILState_Release(g);
    }
    free(p);
}

static const ddp_store_impl py_impl = {
    p_set, p_append, p_get, p_add, p_wait, p_multi_get, p_multi_set, p_check,
    p_compare_set, p_delete, p_num_keys, p_shutdown, p_destroy,
};

static const char *const needed[] = {"set", "get", "add", "wait", "multi_get", "multi_set",
                                     "check", "compare_set", "delete_key", "num_keys", NULL};

struct ddp_store *ddp_py_store_wrap(PyObject *obj) {
    for (const char *const *m = needed; *m; m++)
        if (!PyObject_HasAttrString(obj, *m)) {
            PyErr_Format(PyExc_TypeError, "expected a store client (a pyddp._C.StoreClient, "
                         "or an object with its methods), not %.80s: it has no %s()",
                         Py_TYPE(obj)->tp_name, *m);
            return NULL;
        }
    pystore *p = calloc(1, sizeof *p);
    if (p == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    Py_INCREF(obj);
    p->obj = obj;
    atomic_init(&p->closed, 0);
    char peer[256] = "a Python store";
    PyObject *name = PyObject_GetAttrString(obj, "peer");
    const char *text = name != NULL && PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
    if (text != NULL) snprintf(peer, sizeof peer, "%s", text);
    Py_XDECREF(name);
    PyErr_Clear();
    struct ddp_store *s = NULL;
    Py_BEGIN_ALLOW_THREADS     /* on failure p_destroy takes the GIL */
    ddp_store_wrap(&py_impl, p, peer, &s);
    Py_END_ALLOW_THREADS
    if (s == NULL) PyErr_NoMemory();
    return s;
}
