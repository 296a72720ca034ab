/* py_store_server.c - _C.StoreServer: the core's TCPStore-compatible server
 * (ddp_store_server_start) running on its background thread, for
 * pyddp/store.py's TCPStore(is_master=True). Start and stop release the GIL;
 * the object stops its server when it is collected.
 */
#include "py_common.h"

#include "ddp_store.h"

typedef struct {
    PyObject_HEAD
    ddp_store_server *srv;
    int port;
} ServerObject;

static PyObject *sv_start(ServerObject *self, PyObject *args) {
    const char *host = NULL;
    int port;
    if (!PyArg_ParseTuple(args, "zi:start", &host, &port)) return NULL;
    if (self->srv != NULL) return ddp_py_raise(DDP_ERR_INVALID, "StoreServer already started");
    ddp_status st;
    ddp_store_server *srv = NULL;
    int bound = 0;
    Py_BEGIN_ALLOW_THREADS
    st = ddp_store_server_start(host, port, &srv, &bound);
    Py_END_ALLOW_THREADS
    if (st != DDP_OK) return ddp_py_raise(st, NULL);
    self->srv = srv;
    self->port = bound;
    return PyLong_FromLong(bound);
}

static void sv_stop_now(ServerObject *self) {
    ddp_store_server *srv = self->srv;
    self->srv = NULL;
    if (srv == NULL) return;
    Py_BEGIN_ALLOW_THREADS
    ddp_store_server_stop(srv);
    Py_END_ALLOW_THREADS
}

static PyObject *sv_stop(ServerObject *self, PyObject *noargs) {
    sv_stop_now(self);
    Py_RETURN_NONE;
}

static PyObject *sv_get_port(ServerObject *self, void *closure) {
    return PyLong_FromLong(self->port);
}

/* Requests the server has run since it started (ddp_store_server_requests);
 * 0 before start and after stop. */
static PyObject *sv_get_requests(ServerObject *self, void *closure) {
    return PyLong_FromUnsignedLongLong(ddp_store_server_requests(self->srv));
}

static void sv_dealloc(ServerObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    sv_stop_now(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyMethodDef sv_methods[] = {
    {"start", (PyCFunction)sv_start, METH_VARARGS,
     "start(bind_host, port) -> port: serve on bind_host (None/'' = all interfaces)."},
    {"stop", (PyCFunction)sv_stop, METH_NOARGS, "Stop serving and drop every key."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef sv_getset[] = {
    {"port", (getter)sv_get_port, NULL, "The bound port (0 before start).", NULL},
    {"requests", (getter)sv_get_requests, NULL,
     "Requests served since start (VALIDATE and PING of each connect included; 0 when "
     "not running).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot server_slots[] = {
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, sv_dealloc},
    {Py_tp_methods, sv_methods},
    {Py_tp_getset, sv_getset},
    {Py_tp_doc, "TCPStore-compatible server running on a background thread."},
    {0, NULL},
};

static PyType_Spec server_spec = {"pyddp._C.StoreServer", sizeof(ServerObject), 0,
                                  Py_TPFLAGS_DEFAULT, server_slots};

int ddp_py_store_server_register(PyObject *m) {
    PyTypeObject *t = (PyTypeObject *)PyType_FromSpec(&server_spec);
    if (t == NULL) return -1;
    int rc = PyModule_AddObjectRef(m, "StoreServer", (PyObject *)t);
    Py_DECREF(t);
    return rc;
}
