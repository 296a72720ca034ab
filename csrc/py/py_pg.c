/* py_pg.c - pyddp._C.ProcessGroup and pyddp._C.Work: the CPU process group
 * over the core communicator, and handles for collectives in flight.
 *
 * ProcessGroup(store, rank, size, prefix, advertise_host, bind_host, port_lo,
 *              port_hi, timeout_ms, version, host_id)
 *   rendezvous (collective; Ctrl-C aborts it), then
 *   submit(kind, a, b, op, root, timeout_ms) -> Work   (kinds: COLL_* constants)
 * where, by kind, a/b are:
 *   ALLREDUCE, BROADCAST, REDUCE, SEND, RECV: a = the array, b = None
 *   ALLGATHER, REDUCE_SCATTER, GATHER, SCATTER: a = input, b = output
 *     (GATHER's output and SCATTER's input only at the root, None elsewhere)
 *   BARRIER: a = b = None
 * Every check (types, dtypes, device, sizes, root) happens in submit, before
 * anything is queued, so a bad call leaves the group usable.
 *
 * Work holds references to the arrays until the collective finishes, so the
 * memory the worker thread reads and writes stays alive even if the caller
 * drops everything. wait() releases the GIL and runs signal handlers every
 * 100 ms; Ctrl-C aborts the group (peers then fail fast too) and raises.
 */
#include "py_common.h"

#include <stdarg.h>
#include <string.h>
#include "ddp_comm.h"
#include "py_array.h"

typedef struct {
    PyObject_HEAD
    ddp_comm *comm;
    atomic_int abort;      /* rendezvous abort flag */
} PGObject;

typedef struct {
    PyObject_HEAD
    ddp_work *work;
    PyObject *pg;          /* keeps the communicator alive */
    ddp_py_array a, b;
    int finished;          /* arrays released, status recorded */
    ddp_status status;
    PyObject *error;       /* saved exception message (str) or NULL */
} WorkObject;

static PyTypeObject *PGType, *WorkType;

struct ddp_comm *ddp_py_pg_comm(PyObject *pg) {
    if (PGType == NULL || !PyObject_TypeCheck(pg, PGType)) {
        PyErr_SetString(PyExc_TypeError, "expected a pyddp._C.ProcessGroup");
        return NULL;
    }
    PGObject *p = (PGObject *)pg;
    if (p->comm == NULL) {
        ddp_py_raise(DDP_ERR_INVALID, "the process group was destroyed");
        return NULL;
    }
    return p->comm;
}

/* ---- creation ------------------------------------------------------- */

typedef struct {
    ddp_comm_config cfg;
    ddp_store *store;
    ddp_comm *comm;
    ddp_status st;
    char msg[2048];
} create_job;

static void create_run(void *p) {
    create_job *j = p;
    j->st = ddp_comm_create(&j->cfg, j->store, &j->comm);
    if (j->st != DDP_OK) ddp_copy_error(j->msg, sizeof j->msg);
}

static PyObject *pg_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"store", "rank", "size", "prefix", "advertise_host",
                             "bind_host", "port_lo", "port_hi", "timeout_ms", "version",
                             "host_id", NULL};
    PyObject *store_obj;
    create_job j;
    memset(&j, 0, sizeof j);
    long long timeout_ms;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OiisssiiLss", kwlist, &store_obj,
                                     &j.cfg.rank, &j.cfg.size, &j.cfg.prefix,
                                     &j.cfg.advertise_host, &j.cfg.bind_host,
                                     &j.cfg.port_lo, &j.cfg.port_hi, &timeout_ms,
                                     &j.cfg.version, &j.cfg.host_id))
        return NULL;
    j.cfg.timeout_ms = timeout_ms;
    j.store = ddp_py_store_client_ptr(store_obj);
    if (j.store == NULL) return NULL;
    PGObject *self = (PGObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    atomic_init(&self->abort, 0);
    j.cfg.abort = &self->abort;
    Py_INCREF(store_obj);  /* the store must outlive the rendezvous */
    int rc = ddp_py_run_abortable(create_run, &j, &self->abort);
    Py_DECREF(store_obj);
    if (rc < 0) {
        ddp_comm_destroy(j.comm);
        Py_DECREF(self);
        return NULL;
    }
    if (j.st != DDP_OK) {
        Py_DECREF(self);
        return ddp_py_raise(j.st, j.msg);
    }
    self->comm = j.comm;
    return (PyObject *)self;
}

static void pg_destroy_comm(PGObject *self) {
    ddp_comm *c = self->comm;
    self->comm = NULL;
    if (c == NULL) return;
    Py_BEGIN_ALLOW_THREADS
    ddp_comm_destroy(c);
    Py_END_ALLOW_THREADS
}

static void pg_dealloc(PGObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    pg_destroy_comm(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* ---- submit ---------------------------------------------------------- */

static int import_opt(PyObject *obj, int writable, const char *name, ddp_py_array *out) {
    memset(out, 0, sizeof *out);
    if (obj == Py_None) return 0;
    if (ddp_py_array_import(obj, writable, name, out) < 0) return -1;
    if (out->device != DDP_DEV_CPU) {
        char msg[300];
        PyOS_snprintf(msg, sizeof msg, "%s is a GPU array, but this process group uses the "
                      "CPU backend; use backend=\"nccl\" for GPU arrays or copy it to the "
                      "CPU first", name);
        ddp_py_raise(DDP_ERR_TYPE, msg);
        ddp_py_array_release(out);
        return -1;
    }
    return 0;
}

static int bad(const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    PyOS_vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    ddp_py_raise(DDP_ERR_INVALID, msg);
    return -1;
}

/* Fill the core arguments from the imported arrays, checking that sizes and
 * dtypes agree with the kind's conventions (ddp_coll.h). Shared with the
 * NCCL process group (py_nccl.c); declared in py_array.h. */
int ddp_py_coll_args_fill(int kind, int size, int rank, int root, ddp_py_array *a,
                          ddp_py_array *b, ddp_coll_args *ca) {
    const char *nm = ddp_coll_name((ddp_coll_kind)kind);
    int need_a = kind != DDP_COLL_BARRIER && !(kind == DDP_COLL_SCATTER && rank != root);
    int need_b = kind == DDP_COLL_ALLGATHER || kind == DDP_COLL_REDUCE_SCATTER ||
                 kind == DDP_COLL_SCATTER || (kind == DDP_COLL_GATHER && rank == root);
    /* SCATTER's input lives at the root; its output everywhere. */
    if (kind == DDP_COLL_SCATTER) { need_a = rank == root; need_b = 1; }
    if (need_a && a->owner == NULL) return bad("%s: the input array is required", nm);
    if (need_b && b->owner == NULL) return bad("%s: the output array is required", nm);
    if (a->owner && b->owner && a->dtype != b->dtype)
        return bad("%s: input dtype %s differs from output dtype %s", nm,
                   ddp_dtype_name(a->dtype), ddp_dtype_name(b->dtype));
    ca->kind = (ddp_coll_kind)kind;
    ca->root = root;
    ca->dtype = a->owner ? a->dtype : b->owner ? b->dtype : DDP_UINT8;
    size_t n;
    switch (kind) {
    case DDP_COLL_ALLREDUCE: case DDP_COLL_BROADCAST: case DDP_COLL_REDUCE:
    case DDP_COLL_SEND: case DDP_COLL_RECV:
        ca->buf = a->ptr;
        ca->count = a->count;
        break;
    case DDP_COLL_ALLGATHER: case DDP_COLL_GATHER:
        n = a->count;
        if (b->owner && b->count != n * (size_t)size)
            return bad("%s: the output has %zu elements but needs world_size * input = "
                       "%d * %zu = %zu", nm, b->count, size, n, n * (size_t)size);
        ca->sendbuf = a->ptr;
        ca->recvbuf = b->owner ? b->ptr : NULL;
        ca->count = n;
        break;
    case DDP_COLL_REDUCE_SCATTER:
    case DDP_COLL_SCATTER:
        n = b->count;
        if (a->owner && a->count != n * (size_t)size)
            return bad("%s: the input has %zu elements but needs world_size * output = "
                       "%d * %zu = %zu", nm, a->count, size, n, n * (size_t)size);
        ca->sendbuf = a->owner ? a->ptr : NULL;
        ca->recvbuf = b->ptr;
        ca->count = n;
        break;
    case DDP_COLL_BARRIER:
        ca->count = 0;
        break;
    default:
        return bad("unknown collective kind %d", kind);
    }
    return 0;
}

static PyObject *pg_submit(PGObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"kind", "a", "b", "op", "root", "timeout_ms", NULL};
    int kind, op = 0, root = 0;
    PyObject *ao = Py_None, *bo = Py_None;
    long long timeout_ms = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "i|OOiiL", kwlist, &kind, &ao, &bo, &op,
                                     &root, &timeout_ms))
        return NULL;
    if (self->comm == NULL) return ddp_py_raise(DDP_ERR_INVALID, "the process group was destroyed");
    if (op < 0 || op >= DDP_REDOP_COUNT) return ddp_py_raise(DDP_ERR_INVALID, "invalid reduce op");
    WorkObject *w = PyObject_New(WorkObject, WorkType);
    if (w == NULL) return NULL;
    w->work = NULL;
    w->pg = NULL;
    w->finished = 0;
    w->status = DDP_OK;
    w->error = NULL;
    memset(&w->a, 0, sizeof w->a);
    memset(&w->b, 0, sizeof w->b);
    int writable_a = kind == DDP_COLL_ALLREDUCE || kind == DDP_COLL_BROADCAST ||
                     kind == DDP_COLL_REDUCE || kind == DDP_COLL_RECV;
    ddp_coll_args ca;
    memset(&ca, 0, sizeof ca);
    ca.op = (ddp_redop)op;
    int size = ddp_comm_size(self->comm), rank = ddp_comm_rank(self->comm);
    if (import_opt(ao, writable_a, "input", &w->a) < 0 ||
        import_opt(bo, 1, "output", &w->b) < 0 ||
        ddp_py_coll_args_fill(kind, size, rank, root, &w->a, &w->b, &ca) < 0) {
        Py_DECREF(w);   /* dealloc releases whatever the imports took */
        return NULL;
    }
    /* The imports ran Python code (__dlpack__), which may have destroyed the group. */
    if (self->comm == NULL) {
        Py_DECREF(w);
        return ddp_py_raise(DDP_ERR_INVALID, "the process group was destroyed");
    }
    ddp_status st = ddp_comm_submit(self->comm, &ca, timeout_ms, &w->work);
    if (st != DDP_OK) {
        Py_DECREF(w);
        return ddp_py_raise(st, NULL);
    }
    Py_INCREF(self);
    w->pg = (PyObject *)self;
    return (PyObject *)w;
}

static PyObject *pg_abort(PGObject *self, PyObject *args) {
    const char *reason = "abort() called";
    if (!PyArg_ParseTuple(args, "|s", &reason)) return NULL;
    if (self->comm) ddp_comm_abort(self->comm, reason);
    Py_RETURN_NONE;
}

static PyObject *pg_destroy(PGObject *self, PyObject *unused) {
    pg_destroy_comm(self);
    Py_RETURN_NONE;
}

static PyObject *pg_peer(PGObject *self, PyObject *args) {
    int r;
    if (!PyArg_ParseTuple(args, "i", &r)) return NULL;
    if (self->comm == NULL || r < 0 || r >= ddp_comm_size(self->comm))
        return ddp_py_raise(DDP_ERR_INVALID, "no such rank");
    return Py_BuildValue("(ss)", ddp_comm_peer_desc(self->comm, r), ddp_comm_host_id(self->comm, r));
}

static PyObject *pg_get_rank(PGObject *self, void *c) {
    return self->comm ? PyLong_FromLong(ddp_comm_rank(self->comm)) : ddp_py_raise(DDP_ERR_INVALID, "destroyed");
}
static PyObject *pg_get_size(PGObject *self, void *c) {
    return self->comm ? PyLong_FromLong(ddp_comm_size(self->comm)) : ddp_py_raise(DDP_ERR_INVALID, "destroyed");
}

/* ---- Work ------------------------------------------------------------ */

/* Record the outcome and drop the array references. Requires the work done. */
static void work_finish(WorkObject *w) {
    if (w->finished) return;
    w->finished = 1;
    if (w->work) {
        ddp_status st = ddp_work_wait(w->work, ddp_wait_for(0, NULL));
        w->status = st;
        if (st != DDP_OK) w->error = PyUnicode_FromString(ddp_work_error(w->work));
        ddp_work_release(w->work);
        w->work = NULL;
    }
    ddp_py_array_release(&w->a);
    ddp_py_array_release(&w->b);
}

/* Wait up to ms (GIL released) on the core work; returns whether it is done.
 * Holds its own reference, since another thread may call work_finish (which
 * releases w->work) while this one waits. Requires w->work != NULL. */
static int work_wait_slice(WorkObject *w, ddp_wait slice) {
    ddp_work *cw = w->work;
    int done;
    ddp_work_retain(cw);
    Py_BEGIN_ALLOW_THREADS
    ddp_work_wait(cw, slice);
    done = ddp_work_done(cw);
    ddp_work_release(cw);
    Py_END_ALLOW_THREADS
    return done;
}

/* Block until the work is done, however long (GIL released meanwhile). */
static void work_block(WorkObject *w) {
    while (!w->finished && w->work != NULL && !work_wait_slice(w, ddp_wait_for(1000, NULL))) {
    }
}

static PyObject *work_raise(WorkObject *w) {
    if (w->status == DDP_OK) Py_RETURN_TRUE;
    const char *msg = w->error ? PyUnicode_AsUTF8(w->error) : NULL;
    return ddp_py_raise(w->status, msg);
}

static PyObject *work_wait(WorkObject *w, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"timeout_ms", NULL};
    long long timeout_ms = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|L", kwlist, &timeout_ms)) return NULL;
    if (w->finished) return work_raise(w);
    ddp_wait total = ddp_wait_for(timeout_ms, NULL);
    for (;;) {
        ddp_wait slice = ddp_wait_for(100, NULL);
        if (total.deadline_ms < slice.deadline_ms) slice.deadline_ms = total.deadline_ms;
        if (w->finished) return work_raise(w);   /* another thread finished it */
        if (work_wait_slice(w, slice)) break;
        if (PyErr_CheckSignals() < 0) {
            /* Interrupted: break the group so the worker (and the peers)
             * stop, then wait for the worker to let go of the arrays. */
            PyObject *et, *ev, *tb;
            PyErr_Fetch(&et, &ev, &tb);
            ddp_comm *c = ddp_py_pg_comm(w->pg);
            PyErr_Clear();
            if (c) ddp_comm_abort(c, "interrupted by a signal (Ctrl-C) while waiting");
            work_block(w);
            work_finish(w);
            PyErr_Restore(et, ev, tb);
            return NULL;
        }
        if (ddp_wait_expired(total)) {
            return ddp_py_raise(DDP_ERR_TIMEOUT, "Work.wait(timeout) expired before the "
                                "collective finished; it is still running");
        }
    }
    work_finish(w);   /* no-op if another thread got there first */
    return work_raise(w);
}

static PyObject *work_is_completed(WorkObject *w, PyObject *unused) {
    if (w->finished || ddp_work_done(w->work)) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

static PyObject *work_exception(WorkObject *w, PyObject *unused) {
    if (!w->finished) {
        if (!ddp_work_done(w->work)) Py_RETURN_NONE;
        work_finish(w);
    }
    if (w->status == DDP_OK) Py_RETURN_NONE;
    work_raise(w);
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyErr_NormalizeException(&et, &ev, &tb);
    Py_XDECREF(et);
    Py_XDECREF(tb);
    return ev;
}

static void work_dealloc(WorkObject *w) {
    PyTypeObject *tp = Py_TYPE(w);
    if (!w->finished) {
        work_block(w);   /* the worker may still use the arrays */
        work_finish(w);
    }
    Py_XDECREF(w->error);
    Py_XDECREF(w->pg);
    PyObject_Free(w);
    Py_DECREF(tp);
}

/* ---- type specs ------------------------------------------------------ */

static PyMethodDef pg_methods[] = {
    {"submit", (PyCFunction)(void (*)(void))pg_submit, METH_VARARGS | METH_KEYWORDS,
     "submit(kind, a=None, b=None, op=0, root=0, timeout_ms=-1) -> Work"},
    {"abort", (PyCFunction)pg_abort, METH_VARARGS, "Break the group now; peers fail fast."},
    {"destroy", (PyCFunction)pg_destroy, METH_NOARGS, "Close all connections."},
    {"peer", (PyCFunction)pg_peer, METH_VARARGS, "peer(rank) -> (description, host_id)"},
    {NULL}
};
static PyGetSetDef pg_getset[] = {
    {"rank", (getter)pg_get_rank, NULL, "this rank", NULL},
    {"size", (getter)pg_get_size, NULL, "world size", NULL},
    {NULL}
};
static PyType_Slot pg_slots[] = {
    {Py_tp_new, pg_new},
    {Py_tp_dealloc, pg_dealloc},
    {Py_tp_methods, pg_methods},
    {Py_tp_getset, pg_getset},
    {Py_tp_doc, "CPU process group over pyddp's C communicator."},
    {0, NULL}
};
static PyType_Spec pg_spec = {"pyddp._C.ProcessGroup", sizeof(PGObject), 0,
                              Py_TPFLAGS_DEFAULT, pg_slots};

static PyMethodDef work_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))work_wait, METH_VARARGS | METH_KEYWORDS,
     "wait(timeout_ms=-1) -> True; raises the collective's error"},
    {"is_completed", (PyCFunction)work_is_completed, METH_NOARGS, "True once finished"},
    {"exception", (PyCFunction)work_exception, METH_NOARGS, "the error, or None"},
    {NULL}
};
static PyType_Slot work_slots[] = {
    {Py_tp_dealloc, work_dealloc},
    {Py_tp_methods, work_methods},
    {Py_tp_doc, "A collective in flight."},
    {0, NULL}
};
static PyType_Spec work_spec = {"pyddp._C.Work", sizeof(WorkObject), 0, Py_TPFLAGS_DEFAULT,
                                work_slots};

int ddp_py_pg_register(PyObject *m) {
    if (ddp_py_array_init() < 0) return -1;
    PGType = (PyTypeObject *)PyType_FromSpec(&pg_spec);
    if (PGType == NULL || PyModule_AddObjectRef(m, "ProcessGroup", (PyObject *)PGType) < 0) return -1;
    WorkType = (PyTypeObject *)PyType_FromSpec(&work_spec);
    if (WorkType == NULL || PyModule_AddObjectRef(m, "Work", (PyObject *)WorkType) < 0) return -1;
    struct { const char *n; int v; } consts[] = {
        {"COLL_ALLREDUCE", DDP_COLL_ALLREDUCE}, {"COLL_BROADCAST", DDP_COLL_BROADCAST},
        {"COLL_REDUCE", DDP_COLL_REDUCE}, {"COLL_ALLGATHER", DDP_COLL_ALLGATHER},
        {"COLL_REDUCE_SCATTER", DDP_COLL_REDUCE_SCATTER}, {"COLL_GATHER", DDP_COLL_GATHER},
        {"COLL_SCATTER", DDP_COLL_SCATTER}, {"COLL_SEND", DDP_COLL_SEND},
        {"COLL_RECV", DDP_COLL_RECV}, {"COLL_BARRIER", DDP_COLL_BARRIER},
        {"OP_SUM", DDP_SUM}, {"OP_AVG", DDP_AVG}, {"OP_MIN", DDP_MIN}, {"OP_MAX", DDP_MAX},
        {"OP_PRODUCT", DDP_PRODUCT},
    };
    for (size_t i = 0; i < sizeof consts / sizeof consts[0]; i++)
        if (PyModule_AddIntConstant(m, consts[i].n, consts[i].v) < 0) return -1;
    return 0;
}
