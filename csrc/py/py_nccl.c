/* py_nccl.c - pyddp._C.NcclProcessGroup and pyddp._C.NcclWork: the NCCL
 * process group, with the interface of pyddp._C.ProcessGroup (the loader
 * functions are in py_nccl_lib.c).
 *
 * NcclProcessGroup(store, rank, size, prefix, device, timeout_ms, version)
 *   collective set-up (Ctrl-C aborts it), then
 *   submit(kind, a, b, op, root, timeout_ms, stream=None) -> NcclWork
 * with the array conventions of ProcessGroup.submit (py_pg.c). `stream` is
 * the caller's CUDA stream (an int cudaStream_t; None: no ordering needed),
 * found by pyddp/_nccl_backend.py from torch or CuPy: the collective runs
 * after the work queued there, and wait() makes that stream wait for the
 * result. GPU arrays must live on the group's device. Host arrays (NumPy,
 * CPU tensors) are staged through the GPU and the collective completes
 * inside submit, so object collectives work on this backend too.
 *
 * NcclWork holds the arrays until the GPU is done with them; wait() polls
 * (GIL released, signals run every 100 ms) and raises the collective's
 * error; Ctrl-C aborts the communicator. If an aborted kernel still has not
 * let go of the buffers after a grace period, their references are kept
 * forever rather than risk the GPU writing into freed memory.
 */
#include "py_common.h"

#include <string.h>
#include "ddp_cuda_lib.h"
#include "ddp_nccl_comm.h"
#include "py_array.h"
#include "py_nccl.h"

#define DRAIN_GRACE_MS 5000

typedef struct {
    PyObject_HEAD
    ddp_nccl_comm *comm;
    atomic_int abort;          /* set-up abort flag */
} NPGObject;

typedef struct {
    PyObject_HEAD
    ddp_nccl_work *work;       /* NULL when finished inside submit */
    PyObject *pg;
    ddp_py_array a, b;
    int has_stream;
    uintptr_t stream;
    int finished;
    ddp_status status;
    PyObject *error;
} NWorkObject;

static PyTypeObject *NPGType, *NWorkType;

/* ---- process group ------------------------------------------------------ */

typedef struct {
    ddp_nccl_config cfg;
    ddp_store *store;
    ddp_nccl_comm *comm;
    ddp_status st;
    char msg[2048];
} create_job;

static void create_run(void *p) {
    create_job *j = p;
    j->st = ddp_nccl_comm_create(&j->cfg, j->store, &j->comm);
    if (j->st != DDP_OK) ddp_copy_error(j->msg, sizeof j->msg);
}

static PyObject *npg_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"store", "rank", "size", "prefix", "device", "timeout_ms",
                             "version", NULL};
    PyObject *store_obj;
    create_job j;
    memset(&j, 0, sizeof j);
    long long timeout_ms;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OiisiLs", kwlist, &store_obj, &j.cfg.rank,
                                     &j.cfg.size, &j.cfg.prefix, &j.cfg.device, &timeout_ms,
                                     &j.cfg.version))
        return NULL;
    if (ddp_cuda_api_get() == NULL)
        return ddp_py_raise(DDP_ERR_UNAVAILABLE, "NCCL is not loaded: call pyddp._C.nccl_load "
                            "first (pyddp._nccl_backend does)");
    j.cfg.timeout_ms = timeout_ms;
    j.store = ddp_py_store_client_ptr(store_obj);
    if (j.store == NULL) return NULL;
    NPGObject *self = (NPGObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    atomic_init(&self->abort, 0);
    j.cfg.abort = &self->abort;
    Py_INCREF(store_obj);   /* the store must outlive the set-up */
    int rc = ddp_py_run_abortable(create_run, &j, &self->abort);
    Py_DECREF(store_obj);
    if (rc < 0) {
        ddp_nccl_comm_destroy(j.comm, ddp_wait_for(0, NULL));
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

typedef struct {
    ddp_nccl_comm *comm;
    int64_t timeout_ms;
    atomic_int abort;       /* Ctrl-C: stop finalizing, abort instead */
} destroy_job;

static void destroy_run(void *p) {
    destroy_job *d = p;
    ddp_nccl_comm_destroy(d->comm, ddp_wait_for(d->timeout_ms, &d->abort));
}

/* Destroy the communicator, bounded by ms; with_signals: run Python's signal
 * handlers meanwhile (a Ctrl-C then aborts instead of finalizing). */
static int npg_destroy_comm(NPGObject *self, int64_t ms, int with_signals) {
    ddp_nccl_comm *c = self->comm;
    self->comm = NULL;
    if (c == NULL) return 0;
    destroy_job d = {c, ms, 0};
    if (with_signals) return ddp_py_run_abortable(destroy_run, &d, &d.abort);
    Py_BEGIN_ALLOW_THREADS
    destroy_run(&d);
    Py_END_ALLOW_THREADS
    return 0;
}

static void npg_dealloc(NPGObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    npg_destroy_comm(self, 10000, 0);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *npg_destroy(NPGObject *self, PyObject *unused) {
    if (npg_destroy_comm(self, 60000, 1) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *npg_abort(NPGObject *self, PyObject *args) {
    const char *reason = "abort() called";
    if (!PyArg_ParseTuple(args, "|s", &reason)) return NULL;
    atomic_store(&self->abort, 1);
    if (self->comm) {
        ddp_nccl_comm *c = self->comm;
        ddp_nccl_comm_retain(c);
        Py_BEGIN_ALLOW_THREADS
        ddp_nccl_comm_abort(c, reason);
        ddp_nccl_comm_release(c);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static ddp_nccl_comm *live_comm(NPGObject *self) {
    if (self->comm == NULL) ddp_py_raise(DDP_ERR_INVALID, "the NCCL process group was destroyed");
    return self->comm;
}

static PyObject *npg_get_rank(NPGObject *self, void *c) {
    return live_comm(self) ? PyLong_FromLong(ddp_nccl_comm_rank(self->comm)) : NULL;
}
static PyObject *npg_get_size(NPGObject *self, void *c) {
    return live_comm(self) ? PyLong_FromLong(ddp_nccl_comm_size(self->comm)) : NULL;
}
static PyObject *npg_get_device(NPGObject *self, void *c) {
    return live_comm(self) ? PyLong_FromLong(ddp_nccl_comm_device(self->comm)) : NULL;
}

/* ---- submit ----------------------------------------------------------------- */

/* Import an optional array; GPU arrays must be on the group's device. */
static int import_arg(ddp_nccl_comm *c, PyObject *obj, int writable, const char *name,
                      PyObject *dl_stream, ddp_py_array *out) {
    memset(out, 0, sizeof *out);
    if (obj == Py_None) return 0;
    if (ddp_py_array_import_stream(obj, writable, name,
                                   PyObject_HasAttrString(obj, "__dlpack__") ? dl_stream : NULL,
                                   out) < 0)
        return -1;
    if (out->device != DDP_DEV_CUDA) return 0;
    int dev = out->device_id;
    ddp_status st = DDP_OK;
    if (dev < 0 && out->count > 0) {
        Py_BEGIN_ALLOW_THREADS
        st = ddp_nccl_pointer_device(c, out->ptr, name, &dev);
        Py_END_ALLOW_THREADS
    }
    if (st == DDP_OK && dev >= 0 && dev != ddp_nccl_comm_device(c)) {
        char msg[400];
        int d = ddp_nccl_comm_device(c);
        PyOS_snprintf(msg, sizeof msg, "%s is on cuda:%d, but this rank's NCCL process group "
                      "uses cuda:%d; move it there (x.to('cuda:%d')), or call "
                      "torch.cuda.set_device(%d) before creating tensors", name, dev, d, d, d);
        ddp_py_raise(DDP_ERR_INVALID, msg);
        ddp_py_array_release(out);
        return -1;
    }
    if (st != DDP_OK) {
        ddp_py_raise(st, NULL);
        ddp_py_array_release(out);
        return -1;
    }
    return 0;
}

typedef struct {
    ddp_nccl_comm *comm;
    ddp_coll_args ca;
    int64_t timeout_ms;
    atomic_int abort;
    ddp_status st;
    char msg[2048];
} host_job;

static void host_run(void *p) {
    host_job *h = p;
    h->st = ddp_nccl_run_host(h->comm, &h->ca, h->timeout_ms, &h->abort);
    if (h->st != DDP_OK) ddp_copy_error(h->msg, sizeof h->msg);
}

/* Lets a slow NCCL launch (GIL released) run Python's signal handlers: the
 * submitting thread takes the GIL back for a moment; a raised exception is
 * kept for submit to re-raise, and aborts the launch. */
typedef struct {
    PyThreadState *ts;
    PyObject *et, *ev, *tb;
} sig_check;

static int check_signals(void *p) {
    sig_check *s = p;
    if (s->et != NULL) return 1;
    PyEval_RestoreThread(s->ts);
    if (PyErr_CheckSignals() < 0) PyErr_Fetch(&s->et, &s->ev, &s->tb);
    s->ts = PyEval_SaveThread();
    return s->et != NULL;
}

static NWorkObject *new_work(void) {
    NWorkObject *w = PyObject_New(NWorkObject, NWorkType);
    if (w == NULL) return NULL;
    w->work = NULL;
    w->pg = NULL;
    memset(&w->a, 0, sizeof w->a);
    memset(&w->b, 0, sizeof w->b);
    w->has_stream = 0;
    w->stream = 0;
    w->finished = 1;   /* nothing to wait for until a work is attached */
    w->status = DDP_OK;
    w->error = NULL;
    return w;
}

static PyObject *npg_submit(NPGObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"kind", "a", "b", "op", "root", "timeout_ms", "stream", NULL};
    int kind, op = 0, root = 0;
    PyObject *ao = Py_None, *bo = Py_None, *so = Py_None;
    long long timeout_ms = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "i|OOiiLO", kwlist, &kind, &ao, &bo, &op, &root,
                                     &timeout_ms, &so))
        return NULL;
    ddp_nccl_comm *c = live_comm(self);
    if (c == NULL) return NULL;
    if (op < 0 || op >= DDP_REDOP_COUNT) return ddp_py_raise(DDP_ERR_INVALID, "invalid reduce op");
    int has_stream = so != Py_None;
    uintptr_t stream = 0;
    if (has_stream) {
        stream = (uintptr_t)PyLong_AsUnsignedLongLong(so);
        if (PyErr_Occurred()) return NULL;
    }
    /* DLPack's consumer stream: 1 names the legacy default stream (0 is
     * reserved), so the producer orders its work before ours itself too. */
    PyObject *dl_stream = has_stream ? PyLong_FromUnsignedLongLong(stream ? stream : 1) : NULL;
    if (has_stream && dl_stream == NULL) return NULL;
    NWorkObject *w = new_work();
    int writable_a = kind == DDP_COLL_ALLREDUCE || kind == DDP_COLL_BROADCAST ||
                     kind == DDP_COLL_REDUCE || kind == DDP_COLL_RECV;
    ddp_coll_args ca;
    memset(&ca, 0, sizeof ca);
    ca.op = (ddp_redop)op;
    int rc = w == NULL ? -1 : 0;
    if (rc == 0) rc = import_arg(c, ao, writable_a, "input", dl_stream, &w->a);
    if (rc == 0) rc = import_arg(c, bo, 1, "output", dl_stream, &w->b);
    Py_XDECREF(dl_stream);
    if (rc == 0 && w->a.owner && w->b.owner && w->a.device != w->b.device) {
        ddp_py_raise(DDP_ERR_INVALID, "the input and the output must both be GPU arrays or "
                     "both host arrays");
        rc = -1;
    }
    if (rc == 0)
        rc = ddp_py_coll_args_fill(kind, ddp_nccl_comm_size(c), ddp_nccl_comm_rank(c), root,
                                   &w->a, &w->b, &ca);
    ddp_status vst = rc == 0 ? ddp_nccl_validate(c, &ca) : DDP_OK;
    if (vst != DDP_OK) {
        ddp_py_raise(vst, NULL);
        rc = -1;
    }
    if (rc < 0) {
        Py_XDECREF(w);
        return NULL;
    }
    int on_host = (w->a.owner && w->a.device == DDP_DEV_CPU) ||
                  (w->b.owner && w->b.device == DDP_DEV_CPU);
    if (on_host) {
        host_job *h = PyMem_Calloc(1, sizeof *h);
        if (h == NULL) {
            Py_DECREF(w);
            return PyErr_NoMemory();
        }
        h->comm = c;
        h->ca = ca;
        h->timeout_ms = timeout_ms;
        atomic_init(&h->abort, 0);
        ddp_nccl_comm_retain(c);   /* against a destroy() from another thread */
        rc = ddp_py_run_abortable(host_run, h, &h->abort);
        ddp_nccl_comm_release(c);
        ddp_py_array_release(&w->a);
        ddp_py_array_release(&w->b);
        ddp_status st = h->st;
        PyObject *res = NULL;
        if (rc == 0 && st != DDP_OK) ddp_py_raise(st, h->msg);
        else if (rc == 0) res = (PyObject *)w;
        PyMem_Free(h);
        if (res == NULL) Py_DECREF(w);
        return res;   /* a finished work: the arrays were released with it */
    }
    ddp_status st;
    ddp_nccl_work *nw = NULL;
    ddp_nccl_comm_retain(c);
    sig_check sc = {NULL, NULL, NULL, NULL};
    ddp_nccl_interrupt intr = {check_signals, &sc};
    sc.ts = PyEval_SaveThread();
    st = ddp_nccl_submit(c, &ca, has_stream, stream, timeout_ms, &intr, &nw);
    ddp_nccl_comm_release(c);
    PyEval_RestoreThread(sc.ts);
    if (sc.et != NULL) {   /* Ctrl-C while NCCL was launching: the group is aborted */
        Py_DECREF(w);
        PyErr_Restore(sc.et, sc.ev, sc.tb);
        return NULL;
    }
    if (st != DDP_OK) {
        Py_DECREF(w);
        return ddp_py_raise(st, NULL);
    }
    w->work = nw;
    w->finished = 0;
    w->has_stream = has_stream;
    w->stream = stream;
    Py_INCREF(self);
    w->pg = (PyObject *)self;
    return (PyObject *)w;
}

/* ---- NcclWork --------------------------------------------------------------- */

/* Record the outcome, make the caller's stream wait for the result, and let
 * go of the arrays once the GPU is done with them. Requires the work done. */
static void nwork_finish(NWorkObject *w) {
    if (w->finished) return;
    w->finished = 1;
    ddp_nccl_work *nw = w->work;
    w->work = NULL;
    ddp_status st;
    char msg[2048];
    int drained = 1;
    Py_BEGIN_ALLOW_THREADS
    st = ddp_nccl_work_wait(nw, ddp_wait_for(0, NULL));
    if (st != DDP_OK) {
        ddp_copy_error(msg, sizeof msg);
        drained = ddp_nccl_work_drained(nw, DRAIN_GRACE_MS);
    } else if (w->has_stream) {
        st = ddp_nccl_work_sync_stream(nw, w->stream);
        if (st != DDP_OK) ddp_copy_error(msg, sizeof msg);
    }
    ddp_nccl_work_release(nw);
    Py_END_ALLOW_THREADS
    w->status = st;
    if (st != DDP_OK) w->error = PyUnicode_FromString(msg);
    if (drained) {
        ddp_py_array_release(&w->a);
        ddp_py_array_release(&w->b);
    } else {
        /* The GPU may still write into these buffers: keep them forever. */
        memset(&w->a, 0, sizeof w->a);
        memset(&w->b, 0, sizeof w->b);
    }
}

/* Poll (GIL released) until the work is done, however long: its own
 * deadline ends it, aborting the communicator if need be. */
static void nwork_block(NWorkObject *w) {
    if (w->finished) return;
    ddp_nccl_work *nw = w->work;
    Py_BEGIN_ALLOW_THREADS
    ddp_nccl_work_wait(nw, ddp_wait_for(-1, NULL));
    Py_END_ALLOW_THREADS
}

static PyObject *nwork_raise(NWorkObject *w) {
    if (w->status == DDP_OK) Py_RETURN_TRUE;
    return ddp_py_raise(w->status, w->error ? PyUnicode_AsUTF8(w->error) : NULL);
}

static PyObject *nwork_wait(NWorkObject *w, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"timeout_ms", NULL};
    long long timeout_ms = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|L", kwlist, &timeout_ms)) return NULL;
    ddp_wait total = ddp_wait_for(timeout_ms, NULL);
    while (!w->finished) {
        ddp_wait slice = ddp_wait_for(DDP_WAIT_SLICE_MS, NULL);
        if (total.deadline_ms < slice.deadline_ms) slice.deadline_ms = total.deadline_ms;
        ddp_nccl_work *nw = w->work;
        int done;
        Py_BEGIN_ALLOW_THREADS
        ddp_nccl_work_wait(nw, slice);
        done = ddp_nccl_work_done(nw);
        Py_END_ALLOW_THREADS
        if (done) break;
        if (PyErr_CheckSignals() < 0) {
            /* Interrupted: abort the communicator (its kernels exit, peers
             * fail fast), then finish so the arrays are let go safely. */
            PyObject *et, *ev, *tb;
            PyErr_Fetch(&et, &ev, &tb);
            NPGObject *pg = (NPGObject *)w->pg;
            if (pg->comm) {
                ddp_nccl_comm *c = pg->comm;
                Py_BEGIN_ALLOW_THREADS
                ddp_nccl_comm_abort(c, "interrupted by a signal (Ctrl-C) while waiting");
                Py_END_ALLOW_THREADS
            }
            nwork_block(w);
            nwork_finish(w);
            PyErr_Restore(et, ev, tb);
            return NULL;
        }
        if (ddp_wait_expired(total))
            return ddp_py_raise(DDP_ERR_TIMEOUT, "Work.wait(timeout) expired before the NCCL "
                                "collective finished; it is still running");
    }
    nwork_finish(w);
    return nwork_raise(w);
}

static PyObject *nwork_is_completed(NWorkObject *w, PyObject *unused) {
    if (w->finished) Py_RETURN_TRUE;
    int done;
    ddp_nccl_work *nw = w->work;
    Py_BEGIN_ALLOW_THREADS
    done = ddp_nccl_work_done(nw);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(done);
}

static PyObject *nwork_exception(NWorkObject *w, PyObject *unused) {
    if (!w->finished) {
        PyObject *d = nwork_is_completed(w, NULL);
        int done = d == Py_True;
        Py_XDECREF(d);
        if (!done) Py_RETURN_NONE;
        nwork_finish(w);
    }
    if (w->status == DDP_OK) Py_RETURN_NONE;
    nwork_raise(w);
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyErr_NormalizeException(&et, &ev, &tb);
    Py_XDECREF(et);
    Py_XDECREF(tb);
    return ev;
}

static void nwork_dealloc(NWorkObject *w) {
    PyTypeObject *tp = Py_TYPE(w);
    if (!w->finished) {
        nwork_block(w);   /* the GPU may still use the arrays */
        nwork_finish(w);
    }
    ddp_py_array_release(&w->a);
    ddp_py_array_release(&w->b);
    Py_XDECREF(w->error);
    Py_XDECREF(w->pg);
    PyObject_Free(w);
    Py_DECREF(tp);
}

/* ---- type specs and registration ----------------------------------------- */

static PyMethodDef npg_methods[] = {
    {"submit", (PyCFunction)(void (*)(void))npg_submit, METH_VARARGS | METH_KEYWORDS,
     "submit(kind, a=None, b=None, op=0, root=0, timeout_ms=-1, stream=None) -> NcclWork"},
    {"abort", (PyCFunction)npg_abort, METH_VARARGS, "Abort the NCCL communicator now."},
    {"destroy", (PyCFunction)npg_destroy, METH_NOARGS, "Finalize and free the communicator."},
    {NULL}
};
static PyGetSetDef npg_getset[] = {
    {"rank", (getter)npg_get_rank, NULL, "this rank", NULL},
    {"size", (getter)npg_get_size, NULL, "world size", NULL},
    {"device", (getter)npg_get_device, NULL, "CUDA device ordinal", NULL},
    {NULL}
};
static PyType_Slot npg_slots[] = {
    {Py_tp_new, npg_new},
    {Py_tp_dealloc, npg_dealloc},
    {Py_tp_methods, npg_methods},
    {Py_tp_getset, npg_getset},
    {Py_tp_doc, "NCCL process group: one communicator on one device, own stream."},
    {0, NULL}
};
static PyType_Spec npg_spec = {"pyddp._C.NcclProcessGroup", sizeof(NPGObject), 0,
                               Py_TPFLAGS_DEFAULT, npg_slots};

static PyMethodDef nwork_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))nwork_wait, METH_VARARGS | METH_KEYWORDS,
     "wait(timeout_ms=-1) -> True; raises the collective's error"},
    {"is_completed", (PyCFunction)nwork_is_completed, METH_NOARGS, "True once finished"},
    {"exception", (PyCFunction)nwork_exception, METH_NOARGS, "the error, or None"},
    {NULL}
};
static PyType_Slot nwork_slots[] = {
    {Py_tp_dealloc, nwork_dealloc},
    {Py_tp_methods, nwork_methods},
    {Py_tp_doc, "An NCCL collective in flight."},
    {0, NULL}
};
static PyType_Spec nwork_spec = {"pyddp._C.NcclWork", sizeof(NWorkObject), 0,
                                 Py_TPFLAGS_DEFAULT, nwork_slots};

int ddp_py_nccl_register(PyObject *m) {
    NPGType = (PyTypeObject *)PyType_FromSpec(&npg_spec);
    if (NPGType == NULL || PyModule_AddObjectRef(m, "NcclProcessGroup", (PyObject *)NPGType) < 0)
        return -1;
    NWorkType = (PyTypeObject *)PyType_FromSpec(&nwork_spec);
    if (NWorkType == NULL || PyModule_AddObjectRef(m, "NcclWork", (PyObject *)NWorkType) < 0)
        return -1;
    return ddp_py_nccl_lib_register(m);
}
