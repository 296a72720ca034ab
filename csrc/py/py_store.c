/* py_store.c - the Python type over the core store's client: _C.StoreClient
 * (one connection to a TCPStore-compatible server; the server's type is in
 * py_store_server.c). pyddp/store.py builds torch's TCPStore API on top of
 * them; keys here are raw wire bytes (no "/" prefix is added).
 *
 * Every network call runs without the GIL. Calls that may block for long
 * (connect, wait, get) run through ddp_py_run_abortable so Ctrl-C still
 * interrupts them; the others are bounded by the client's timeout and just
 * release the GIL. Each call holds its own reference to the C client, and
 * so does a process group's rendezvous (ddp_py_store_client_ref); close()
 * (from another thread, or a signal handler running while this thread
 * waits) shuts the connection down at once, so those calls fail promptly
 * with "closed", and the memory goes with the last reference. Failures
 * raise through ddp_py_raise_store: DistStoreError for a failed request,
 * DistStoreTimeoutError (also a TimeoutError) for a timed-out one,
 * DistNetworkError for a server that cannot be reached.
 */
#include "py_common.h"

#include <string.h>

#include "ddp_store.h"

typedef struct {
    PyObject_HEAD
    ddp_store *s;        /* this object's reference; NULL once closed */
    int64_t timeout_ms;  /* default deadline of each call */
} ClientObject;

static PyTypeObject *ClientType;

/* ---- one store call, run with the GIL released ----------------------- */

enum { OP_SET, OP_GET, OP_ADD, OP_APPEND, OP_WAIT, OP_CHECK, OP_CAS, OP_DELETE,
       OP_NUMKEYS, OP_CONNECT, OP_MGET, OP_MSET };

typedef struct {
    int op;
    ddp_store *s;
    ddp_wait w;
    atomic_int abort;
    Py_buffer key, val, val2;        /* key, value / expected, desired */
    const char **keys;               /* WAIT / CHECK / MULTI_* */
    size_t *klens, nkeys;
    const char **ivals;              /* MULTI_SET values (the caller's bytes) */
    size_t *ivlens;
    const char *host;                /* CONNECT */
    int port;
    int64_t num;                     /* ADD delta in; ADD/DELETE/NUMKEYS result out */
    int ready;                       /* CHECK result */
    void *out;                       /* GET / COMPARE_SET result (malloc'd) */
    void **vals;                     /* MULTI_GET results (each malloc'd) */
    size_t *vlens;
    size_t outlen;
    ddp_status st;
    char msg[2048];                  /* the error, copied off the calling thread */
} call;

static void call_run(void *p) {
    call *c = p;
    const char *k = c->key.buf;
    size_t kl = (size_t)c->key.len;
    switch (c->op) {
    case OP_CONNECT:
        c->st = ddp_store_connect_auth(c->host, c->port, (int)c->num, NULL, c->w, &c->s);
        break;
    case OP_SET: c->st = ddp_store_set(c->s, k, kl, c->val.buf, (size_t)c->val.len, c->w); break;
    case OP_APPEND:
        c->st = ddp_store_append(c->s, k, kl, c->val.buf, (size_t)c->val.len, c->w);
        break;
    case OP_GET: c->st = ddp_store_get(c->s, k, kl, &c->out, &c->outlen, c->w); break;
    case OP_ADD: c->st = ddp_store_add(c->s, k, kl, c->num, &c->num, c->w); break;
    case OP_WAIT:
        c->st = ddp_store_wait(c->s, c->keys, c->klens, c->nkeys, c->w);
        break;
    case OP_CHECK:
        c->st = ddp_store_check(c->s, c->keys, c->klens, c->nkeys, &c->ready, c->w);
        break;
    case OP_CAS:
        c->st = ddp_store_compare_set(c->s, k, kl, c->val.buf, (size_t)c->val.len,
                                      c->val2.buf, (size_t)c->val2.len, &c->out,
                                      &c->outlen, c->w);
        break;
    case OP_DELETE: c->st = ddp_store_delete(c->s, k, kl, &c->num, c->w); break;
    case OP_NUMKEYS: c->st = ddp_store_num_keys(c->s, &c->num, c->w); break;
    case OP_MGET:
        c->st = ddp_store_multi_get(c->s, c->keys, c->klens, c->nkeys, c->vals, c->vlens, c->w);
        break;
    case OP_MSET:
        c->st = ddp_store_multi_set(c->s, c->keys, c->klens, (const void *const *)c->ivals,
                                    c->ivlens, c->nkeys, c->w);
        break;
    }
    if (c->st != DDP_OK) ddp_copy_error(c->msg, sizeof c->msg);
}

static void call_init(call *c, int op, int64_t timeout_ms) {
    memset(c, 0, sizeof *c);
    c->op = op;
    atomic_init(&c->abort, 0);
    c->w = ddp_wait_for(timeout_ms, &c->abort);
}

static void call_release(call *c) {
    if (c->key.obj) PyBuffer_Release(&c->key);
    if (c->val.obj) PyBuffer_Release(&c->val);
    if (c->val2.obj) PyBuffer_Release(&c->val2);
    for (size_t i = 0; c->vals && i < c->nkeys; i++) free(c->vals[i]);
    PyMem_Free(c->vals);
    PyMem_Free(c->vlens);
    PyMem_Free(c->keys);
    PyMem_Free(c->klens);
    PyMem_Free(c->ivals);
    PyMem_Free(c->ivlens);
    free(c->out);
}

/* Run c on self's connection, holding a reference of its own for the call
 * (self->s may be closed meanwhile). Returns 0, or -1 with an exception set
 * (and c's buffers released). Long operations go through the abortable
 * runner. */
static int call_do(ClientObject *self, call *c) {
    if (self->s == NULL) {
        call_release(c);
        ddp_py_raise(DDP_ERR_STORE, "StoreClient is not connected (never connected, "
                     "or closed)");
        return -1;
    }
    c->s = self->s;
    ddp_store_retain(c->s);
    int rc = 0;
    if (c->op == OP_WAIT || c->op == OP_GET || c->op == OP_MGET) {
        rc = ddp_py_run_abortable(call_run, c, &c->abort);
    } else {
        Py_BEGIN_ALLOW_THREADS
        call_run(c);
        Py_END_ALLOW_THREADS
    }
    ddp_store_release(c->s);
    c->s = NULL;
    if (rc == 0 && c->st != DDP_OK) {
        ddp_py_raise_store(c->st, c->msg);
        rc = -1;
    }
    if (rc < 0) call_release(c);
    return rc;
}

/* Fill c->keys from a sequence of bytes objects (kept alive by keys_fast). */
/* A list of bytes as (pointer, length) arrays *ptrs and *lens of *n items,
 * pointing into the objects of *fast (a new reference the caller keeps until
 * the call is over). -1 with an exception set (TypeError naming what). */
static int parse_bytes_list(PyObject *seq, const char *what, PyObject **fast,
                            const char ***ptrs, size_t **lens, size_t *n) {
    *fast = PySequence_Fast(seq, what);
    if (*fast == NULL) return -1;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(*fast);
    *ptrs = PyMem_Calloc(m ? (size_t)m : 1, sizeof **ptrs);
    *lens = PyMem_Calloc(m ? (size_t)m : 1, sizeof **lens);
    if (*ptrs == NULL || *lens == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *k = PySequence_Fast_GET_ITEM(*fast, i);
        if (!PyBytes_Check(k)) {
            PyErr_Format(PyExc_TypeError, "%s, not %.80s", what, Py_TYPE(k)->tp_name);
            return -1;
        }
        (*ptrs)[i] = PyBytes_AS_STRING(k);
        (*lens)[i] = (size_t)PyBytes_GET_SIZE(k);
    }
    *n = (size_t)m;
    return 0;
}

static int parse_keys(call *c, PyObject *seq, PyObject **keys_fast) {
    return parse_bytes_list(seq, "keys must be a list of bytes", keys_fast, &c->keys,
                            &c->klens, &c->nkeys);
}

/* Timeout argument: None means the client's default. */
static int parse_timeout(PyObject *o, int64_t dflt, int64_t *out) {
    if (o == NULL || o == Py_None) {
        *out = dflt;
        return 0;
    }
    *out = PyLong_AsLongLong(o);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* ---- StoreClient methods --------------------------------------------- */

static PyObject *cl_connect(ClientObject *self, PyObject *args) {
    const char *host;
    int port;
    long long timeout_ms;
    int auth = DDP_STORE_AUTH_AUTO;
    if (!PyArg_ParseTuple(args, "siL|i:connect", &host, &port, &timeout_ms, &auth)) return NULL;
    if (self->s != NULL) return ddp_py_raise(DDP_ERR_INVALID, "StoreClient is already connected");
    call c;
    call_init(&c, OP_CONNECT, timeout_ms);
    c.host = host;
    c.port = port;
    c.num = auth;
    if (ddp_py_run_abortable(call_run, &c, &c.abort) < 0) {
        ddp_store_close(c.s);
        return NULL;
    }
    if (c.st != DDP_OK) return ddp_py_raise_store(c.st, c.msg);
    self->s = c.s;
    self->timeout_ms = timeout_ms;
    Py_RETURN_NONE;
}

/* set and append: (key, value). */
static PyObject *cl_put(ClientObject *self, PyObject *args, int op) {
    call c;
    call_init(&c, op, self->timeout_ms);
    if (!PyArg_ParseTuple(args, "y*y*", &c.key, &c.val)) return NULL;
    if (call_do(self, &c) < 0) return NULL;
    call_release(&c);
    Py_RETURN_NONE;
}

static PyObject *cl_set(ClientObject *self, PyObject *args) { return cl_put(self, args, OP_SET); }
static PyObject *cl_append(ClientObject *self, PyObject *args) {
    return cl_put(self, args, OP_APPEND);
}

/* Wrap a call's malloc'd result as bytes and release the call. */
static PyObject *out_bytes(call *c) {
    PyObject *r = PyBytes_FromStringAndSize(c->out, (Py_ssize_t)c->outlen);
    call_release(c);
    return r;
}

static PyObject *cl_get(ClientObject *self, PyObject *args) {
    call c;
    call_init(&c, OP_GET, self->timeout_ms);
    if (!PyArg_ParseTuple(args, "y*:get", &c.key)) return NULL;
    if (call_do(self, &c) < 0) return NULL;
    return out_bytes(&c);
}

static PyObject *cl_add(ClientObject *self, PyObject *args) {
    call c;
    long long delta;
    call_init(&c, OP_ADD, self->timeout_ms);
    if (!PyArg_ParseTuple(args, "y*L:add", &c.key, &delta)) return NULL;
    c.num = delta;
    if (call_do(self, &c) < 0) return NULL;
    call_release(&c);
    return PyLong_FromLongLong(c.num);
}

/* wait(keys, timeout_ms=None) and check(keys). */
static PyObject *cl_keys(ClientObject *self, PyObject *args, int op) {
    PyObject *seq, *tmo = NULL, *fast = NULL;
    int64_t timeout_ms;
    call c;
    if (!PyArg_ParseTuple(args, op == OP_WAIT ? "O|O:wait" : "O:check", &seq, &tmo))
        return NULL;
    if (parse_timeout(tmo, self->timeout_ms, &timeout_ms) < 0) return NULL;
    call_init(&c, op, timeout_ms);
    if (parse_keys(&c, seq, &fast) < 0) {
        Py_XDECREF(fast);
        call_release(&c);
        return NULL;
    }
    int rc = call_do(self, &c);
    Py_DECREF(fast);
    if (rc < 0) return NULL;
    call_release(&c);
    if (op == OP_CHECK) return PyBool_FromLong(c.ready);
    Py_RETURN_NONE;
}

static PyObject *cl_wait(ClientObject *self, PyObject *args) { return cl_keys(self, args, OP_WAIT); }

/* multi_get(keys) -> [bytes]: waits for every key, then one MULTI_GET. */
static PyObject *cl_multi_get(ClientObject *self, PyObject *args) {
    PyObject *seq, *fast = NULL, *out = NULL;
    call c;
    if (!PyArg_ParseTuple(args, "O:multi_get", &seq)) return NULL;
    call_init(&c, OP_MGET, self->timeout_ms);
    if (parse_keys(&c, seq, &fast) < 0) goto fail;
    c.vals = PyMem_Calloc(c.nkeys ? c.nkeys : 1, sizeof *c.vals);
    c.vlens = PyMem_Calloc(c.nkeys ? c.nkeys : 1, sizeof *c.vlens);
    if (c.vals == NULL || c.vlens == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    int rc = call_do(self, &c);   /* releases c on failure */
    Py_DECREF(fast);
    if (rc < 0) return NULL;
    out = PyList_New((Py_ssize_t)c.nkeys);
    for (size_t i = 0; out && i < c.nkeys; i++) {
        PyObject *b = PyBytes_FromStringAndSize(c.vals[i], (Py_ssize_t)c.vlens[i]);
        if (b == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, (Py_ssize_t)i, b);
    }
    call_release(&c);
    return out;
fail:
    Py_XDECREF(fast);
    call_release(&c);
    return NULL;
}
/* multi_set(keys, values): one MULTI_SET request (keys and values lists of
 * bytes, of one length). */
static PyObject *cl_multi_set(ClientObject *self, PyObject *args) {
    PyObject *kseq, *vseq, *kfast = NULL, *vfast = NULL;
    size_t nv = 0;
    call c;
    if (!PyArg_ParseTuple(args, "OO:multi_set", &kseq, &vseq)) return NULL;
    call_init(&c, OP_MSET, self->timeout_ms);
    if (parse_keys(&c, kseq, &kfast) < 0 ||
        parse_bytes_list(vseq, "values must be a list of bytes", &vfast, &c.ivals,
                         &c.ivlens, &nv) < 0)
        goto fail;
    if (nv != c.nkeys) {
        PyErr_Format(PyExc_ValueError, "multi_set: %zu keys but %zu values", c.nkeys, nv);
        goto fail;
    }
    int rc = call_do(self, &c);   /* releases c on failure */
    Py_DECREF(kfast);
    Py_DECREF(vfast);
    if (rc < 0) return NULL;
    call_release(&c);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(kfast);
    Py_XDECREF(vfast);
    call_release(&c);
    return NULL;
}

static PyObject *cl_check(ClientObject *self, PyObject *args) {
    return cl_keys(self, args, OP_CHECK);
}

static PyObject *cl_compare_set(ClientObject *self, PyObject *args) {
    call c;
    call_init(&c, OP_CAS, self->timeout_ms);
    if (!PyArg_ParseTuple(args, "y*y*y*:compare_set", &c.key, &c.val, &c.val2)) return NULL;
    if (call_do(self, &c) < 0) return NULL;
    return out_bytes(&c);
}

static PyObject *cl_delete_key(ClientObject *self, PyObject *args) {
    call c;
    call_init(&c, OP_DELETE, self->timeout_ms);
    if (!PyArg_ParseTuple(args, "y*:delete_key", &c.key)) return NULL;
    if (call_do(self, &c) < 0) return NULL;
    call_release(&c);
    return PyBool_FromLong(c.num > 0);
}

static PyObject *cl_num_keys(ClientObject *self, PyObject *noargs) {
    call c;
    call_init(&c, OP_NUMKEYS, self->timeout_ms);
    if (call_do(self, &c) < 0) return NULL;
    call_release(&c);
    return PyLong_FromLongLong(c.num);
}

/* Shut down and drop this object's reference; never blocks (calls in flight
 * on other threads wake and fail, then drop theirs). */
static PyObject *cl_close(ClientObject *self, PyObject *noargs) {
    ddp_store *s = self->s;
    self->s = NULL;
    ddp_store_close(s);
    Py_RETURN_NONE;
}

static PyObject *cl_get_timeout(ClientObject *self, void *closure) {
    return PyLong_FromLongLong(self->timeout_ms);
}

static int cl_set_timeout(ClientObject *self, PyObject *v, void *closure) {
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete timeout_ms");
        return -1;
    }
    return parse_timeout(v, self->timeout_ms, &self->timeout_ms);
}

static PyObject *cl_get_peer(ClientObject *self, void *closure) {
    if (self->s == NULL) Py_RETURN_NONE;
    return PyUnicode_FromString(ddp_store_peer(self->s));
}

static void cl_dealloc(ClientObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    ddp_store_close(self->s);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyMethodDef cl_methods[] = {
    {"connect", (PyCFunction)cl_connect, METH_VARARGS,
     "connect(host, port, timeout_ms, auth=2): connect, authenticate when a token is set "
     "(auth: 0 never, 1 required, 2 try and fall back for torch's servers), VALIDATE and "
     "PING."},
    {"set", (PyCFunction)cl_set, METH_VARARGS, "set(key, value)"},
    {"get", (PyCFunction)cl_get, METH_VARARGS, "get(key) -> bytes (waits for the key)"},
    {"add", (PyCFunction)cl_add, METH_VARARGS, "add(key, delta) -> int"},
    {"append", (PyCFunction)cl_append, METH_VARARGS, "append(key, value)"},
    {"wait", (PyCFunction)cl_wait, METH_VARARGS,
     "wait(keys, timeout_ms=None): wait until every key exists."},
    {"check", (PyCFunction)cl_check, METH_VARARGS, "check(keys) -> bool"},
    {"multi_get", (PyCFunction)cl_multi_get, METH_VARARGS,
     "multi_get(keys) -> [bytes] (waits for every key, then one request)"},
    {"multi_set", (PyCFunction)cl_multi_set, METH_VARARGS,
     "multi_set(keys, values): every key set in one request"},
    {"compare_set", (PyCFunction)cl_compare_set, METH_VARARGS,
     "compare_set(key, expected, desired) -> bytes"},
    {"delete_key", (PyCFunction)cl_delete_key, METH_VARARGS, "delete_key(key) -> bool"},
    {"num_keys", (PyCFunction)cl_num_keys, METH_NOARGS, "num_keys() -> int"},
    {"close", (PyCFunction)cl_close, METH_NOARGS, "Close the connection."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef cl_getset[] = {
    {"timeout_ms", (getter)cl_get_timeout, (setter)cl_set_timeout,
     "Default timeout of each call, in ms (negative: none).", NULL},
    {"peer", (getter)cl_get_peer, NULL, "host:port of the server, or None.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot client_slots[] = {
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, cl_dealloc},
    {Py_tp_methods, cl_methods},
    {Py_tp_getset, cl_getset},
    {Py_tp_doc, "Connection to a TCPStore-compatible server; keys are wire bytes."},
    {0, NULL},
};

static PyType_Spec client_spec = {"pyddp._C.StoreClient", sizeof(ClientObject), 0,
                                  Py_TPFLAGS_DEFAULT, client_slots};

/* The connected client behind obj (borrowed), or NULL with an exception. */
static ddp_store *client_of(PyObject *obj) {
    if (ClientType == NULL || !PyObject_TypeCheck(obj, ClientType)) {
        PyErr_Format(PyExc_TypeError, "expected a pyddp._C.StoreClient, not %.80s",
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    ClientObject *c = (ClientObject *)obj;
    if (c->s == NULL) {
        ddp_py_raise(DDP_ERR_STORE, "the store client is not connected (never "
                     "connected, or closed)");
        return NULL;
    }
    return c->s;
}

ddp_store *ddp_py_store_client_ref(PyObject *obj) {
    if (ClientType == NULL || !PyObject_TypeCheck(obj, ClientType))
        return ddp_py_store_wrap(obj);      /* a Python store client (py_store_py.c) */
    ddp_store *s = client_of(obj);
    if (s != NULL) ddp_store_retain(s);
    return s;
}

int ddp_py_store_register(PyObject *m) {
    ClientType = (PyTypeObject *)PyType_FromSpec(&client_spec);
    if (ClientType == NULL || PyModule_AddObjectRef(m, "StoreClient", (PyObject *)ClientType) < 0)
        return -1;
    return 0;
}
