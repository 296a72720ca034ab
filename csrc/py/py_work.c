/* py_work.c - pyddp._C.Work, the one handle for a collective in flight on
 * any transport (ddp_pg.h). The completion thread that runs its callbacks
 * and watches the works nobody waits for is py_completion.c.
 *
 * A Work holds: the core work (a reference), a reference on the
 * communicator that runs it (so abort on Ctrl-C and the final status never
 * touch freed memory, even after destroy_process_group), and the imported
 * arrays until the transport is done with them.
 *
 *   wait(timeout_ms=-1) -> True, or raises the collective's error. Waits
 *       through ddp_py_wait: GIL released, signal handlers every 100 ms,
 *       Ctrl-C aborts the group and raises.
 *   publish(stream) -> True: for a GPU work, torch's wait(): the CUDA stream
 *       waits for the results on the device, the host does not wait; raises
 *       the collective's error if it is already known.
 *   is_completed(), exception()
 *   add_done_callback(fn): fn(work) once the work finished, on the
 *       completion thread (with the GIL), or at once if already finished.
 *
 * A Work dropped unfinished waits for its collective in dealloc through the
 * same loop; a Ctrl-C there aborts the group, waits for the transport to let
 * go of the arrays, and re-delivers the interrupt to the main thread. A
 * watched Work (ddp_py_work_watch) is never dropped unfinished: the
 * completion thread holds it until it ends.
 */
#include "py_work.h"

#include <string.h>
#include <time.h>

#define DRAIN_GRACE_MS 5000

typedef struct {
    PyObject_HEAD
    ddp_pg pg;             /* referenced; ops NULL once finished and released */
    ddp_pg_work work;      /* w NULL once finished */
    ddp_py_array *arrs;    /* [narrs] arrays the transport uses (PyMem) */
    int narrs;
    void *mem;             /* argument memory the transport reads (PyMem), or NULL */
    int has_stream;
    uintptr_t stream;
    int finished;          /* FIN_*: status recorded (DONE), arrays let go */
    ddp_status status;
    PyObject *error;       /* message (str) or NULL */
    PyObject *callbacks;   /* list of callables, or NULL */
    int queued;            /* the completion thread holds it (callbacks, or watched) */
} WorkObject;

static PyTypeObject *WorkType;

/* ---- finishing ------------------------------------------------------- */

/* WorkObject.finished */
enum { FIN_NOT = 0, FIN_BUSY = 1, FIN_DONE = 2 };

static void release_arrays(WorkObject *w) {
    ddp_py_arrays_free(w->arrs, (size_t)w->narrs);
    PyMem_Free(w->mem);
    w->arrs = NULL;
    w->narrs = 0;
    w->mem = NULL;
}

/* Record the outcome, publish results on the caller's stream, and let go of
 * the arrays once the transport is done with them. Requires the work done.
 * The GIL is released in the middle when something may block (a publish, a
 * device's drain after a failure), so another thread can arrive meanwhile:
 * `finished` is FIN_BUSY
 * until status and error are recorded, and such a thread waits for FIN_DONE
 * instead of reading a status not written yet (which would read as success). */
static void work_finish(WorkObject *w) {
    if (w->finished == FIN_DONE) return;
    if (w->finished == FIN_BUSY) {
        /* Bounded by the finisher's own section: a wait on a work already done
         * and a drain of at most DRAIN_GRACE_MS. */
        while (w->finished == FIN_BUSY) {   /* read with the GIL held */
            Py_BEGIN_ALLOW_THREADS
            struct timespec ts = {0, 20000};
            nanosleep(&ts, NULL);
            Py_END_ALLOW_THREADS
        }
        return;
    }
    w->finished = FIN_BUSY;
    ddp_pg_work cw = w->work;
    w->work.w = NULL;
    ddp_status st = DDP_OK;
    char msg[2048] = "";
    int drained = 1;
    if (cw.w) {
        st = cw.ops->work_wait(cw.w, ddp_wait_for(0, NULL));   /* done: returns at once */
        if (st == DDP_OK && !(w->has_stream && cw.ops->work_publish)) {
            /* Nothing here can block: keep the GIL (the completion thread finishes
             * many works per sweep, and handing the GIL back and forth for each
             * would stall whoever else runs Python). */
            cw.ops->work_release(cw.w);
        } else {
            Py_BEGIN_ALLOW_THREADS
            if (st != DDP_OK) {
                snprintf(msg, sizeof msg, "%s", cw.ops->work_error(cw.w));
                if (cw.ops->work_drained) drained = cw.ops->work_drained(cw.w, DRAIN_GRACE_MS);
            } else {
                st = cw.ops->work_publish(cw.w, w->stream);
                if (st != DDP_OK) ddp_copy_error(msg, sizeof msg);
            }
            cw.ops->work_release(cw.w);
            Py_END_ALLOW_THREADS
        }
    }
    w->status = st;
    if (st != DDP_OK) w->error = PyUnicode_FromString(msg);
    if (drained) {
        release_arrays(w);
    } else {
        /* A device may still write into these buffers: keep them forever. */
        w->arrs = NULL;
        w->narrs = 0;
        w->mem = NULL;
    }
    w->finished = FIN_DONE;
}

typedef struct {
    ddp_pg pg;
    ddp_pg_work cw;
} wait_ctx;

static int wait_slice(void *p, ddp_wait slice) {
    wait_ctx *c = p;
    c->cw.ops->work_wait(c->cw.w, slice);
    return c->cw.ops->work_done(c->cw.w);
}

static void wait_on_signal(void *p) {
    wait_ctx *c = p;
    c->pg.ops->abort(c->pg.impl, DDP_PY_SIGNAL_ABORT);
}

/* Wait for the core work through the one wait loop. 0 done, 1 timed out,
 * -1 exception set (the group aborted and the work done). */
static int work_block(WorkObject *w, int64_t timeout_ms) {
    if (w->finished || w->work.w == NULL) return 0;
    wait_ctx c = {w->pg, w->work};
    c.cw.ops->work_retain(c.cw.w);   /* another thread may finish w meanwhile */
    int rc = ddp_py_wait(wait_slice, &c, timeout_ms, wait_on_signal);
    c.cw.ops->work_release(c.cw.w);
    return rc;
}

/* The lean call path (ProcessGroup.run): wait for a just-submitted work
 * through the same loop as Work.wait (GIL released, signal handlers every
 * 100 ms, Ctrl-C aborts the group and waits until the transport let go of
 * the buffers), publish a GPU work's results on the caller's stream, then
 * drop the work. 0 on success; -1 with the collective's error or the signal
 * handler's exception set. Takes over the caller's reference on work in
 * every case. */
int ddp_py_work_run(ddp_pg pg, ddp_pg_work work, int has_stream, uintptr_t stream) {
    wait_ctx c = {pg, work};
    int rc = ddp_py_wait(wait_slice, &c, -1, wait_on_signal);
    ddp_status st = DDP_OK;
    char msg[2048] = "";
    if (rc == 0) {
        st = work.ops->work_wait(work.w, ddp_wait_for(0, NULL));   /* done: no blocking */
        if (st != DDP_OK) snprintf(msg, sizeof msg, "%s", work.ops->work_error(work.w));
        else if (has_stream && work.ops->work_publish) {
            st = work.ops->work_publish(work.w, stream);
            if (st != DDP_OK) ddp_copy_error(msg, sizeof msg);
        }
    }
    work.ops->work_release(work.w);
    if (rc != 0) return -1;   /* the handler's exception (no timeout with -1) */
    if (st != DDP_OK) {
        ddp_py_raise(st, msg);
        return -1;
    }
    return 0;
}

static PyObject *work_raise(WorkObject *w) {
    if (w->status == DDP_OK) Py_RETURN_TRUE;
    return ddp_py_raise(w->status, w->error ? PyUnicode_AsUTF8(w->error) : NULL);
}

/* Call w's callbacks once (GIL held); their errors are reported, not raised. */
static void run_callbacks(WorkObject *w) {
    PyObject *cbs = w->callbacks;
    w->callbacks = NULL;
    if (cbs == NULL) return;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(cbs); i++) {
        PyObject *r = PyObject_CallOneArg(PyList_GET_ITEM(cbs, i), (PyObject *)w);
        if (r == NULL) PyErr_WriteUnraisable(PyList_GET_ITEM(cbs, i));
        Py_XDECREF(r);
    }
    Py_DECREF(cbs);
}

static int core_done(WorkObject *w) {
    return w->finished || w->work.w == NULL || w->work.ops->work_done(w->work.w);
}

/* ---- what the completion thread asks (py_work.h) -------------------- */

void ddp_py_work_kind(PyObject *o, void **impl, int *polled) {
    WorkObject *w = (WorkObject *)o;
    *impl = w->pg.impl;
    *polled = !w->finished && w->work.w != NULL && !w->work.ops->notifies;
}

int ddp_py_work_done(PyObject *o) { return core_done((WorkObject *)o); }

void ddp_py_work_complete(PyObject *o) {
    WorkObject *w = (WorkObject *)o;
    w->queued = 0;
    work_finish(w);
    run_callbacks(w);
}

/* ---- methods ---------------------------------------------------------- */

/* wait(): block up to timeout_ms (-1: no limit), then True or the error. */
static PyObject *wait_for(WorkObject *w, long long timeout_ms) {
    int rc = work_block(w, timeout_ms);
    if (rc == 1)
        return ddp_py_raise(DDP_ERR_TIMEOUT, "Work.wait(timeout) expired before the "
                            "collective finished; it is still running");
    if (rc < 0) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        work_finish(w);
        PyErr_Restore(et, ev, tb);
        return NULL;
    }
    work_finish(w);   /* no-op if another thread got there first */
    return work_raise(w);
}

static PyObject *work_wait(WorkObject *w, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"timeout_ms", NULL};
    long long timeout_ms = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|L", kwlist, &timeout_ms)) return NULL;
    return wait_for(w, timeout_ms);
}

static PyObject *work_is_completed(WorkObject *w, PyObject *unused) {
    if (w->finished) Py_RETURN_TRUE;
    int done;
    ddp_pg_work cw = w->work;
    Py_BEGIN_ALLOW_THREADS   /* NCCL's poll may take its lock */
    done = cw.ops->work_done(cw.w);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(done);
}

static PyObject *work_exception(WorkObject *w, PyObject *unused) {
    if (w->finished != FIN_DONE) {
        if (!core_done(w)) Py_RETURN_NONE;
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

static PyObject *work_add_done_callback(WorkObject *w, PyObject *fn) {
    if (!PyCallable_Check(fn)) return ddp_py_raise(DDP_ERR_INVALID, "add_done_callback needs "
                                                   "a callable");
    if (w->finished && w->callbacks == NULL) {
        PyObject *r = PyObject_CallOneArg(fn, (PyObject *)w);
        if (r == NULL) return NULL;
        Py_DECREF(r);
        Py_RETURN_NONE;
    }
    if (w->callbacks == NULL && (w->callbacks = PyList_New(0)) == NULL) return NULL;
    if (PyList_Append(w->callbacks, fn) < 0) return NULL;
    if (w->queued) Py_RETURN_NONE;
    /* Kick the thread only when its next sweep would otherwise come late: the
     * work is already done (its notify may have come before it was queued),
     * or its transport cannot notify (the thread must start polling). A work
     * of a notifying transport, submitted with ddp_py_work_notify (every
     * Work is: py_pg_submit.c), that is not done yet kicks the thread itself
     * when it ends, after `done` is set, and w is queued by then. Waking the
     * thread here for nothing cost the caller ~0.15 ms per call (the woken
     * thread preempts it and queues for the GIL it holds). */
    int polled = !w->work.ops->notifies;
    if (ddp_py_completion_add((PyObject *)w, core_done(w), polled) < 0) {
        Py_CLEAR(w->callbacks);
        return NULL;
    }
    w->queued = 1;
    Py_RETURN_NONE;
}

int ddp_py_work_watch(PyObject *o) {
    WorkObject *w = (WorkObject *)o;
    if (w->queued) return 0;
    if (ddp_py_completion_add(o, 0, 1) < 0) return -1;
    w->queued = 1;
    return 0;
}

/* publish(stream): see the header. A work already done is finished here (its
 * results are then visible to every stream: the host saw the device finish);
 * a pending GPU one orders stream after itself; a host transport's work, which
 * cannot publish, is waited for as wait() does. */
static PyObject *work_publish_m(WorkObject *w, PyObject *arg) {
    uintptr_t stream = (uintptr_t)PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    if (!w->finished && w->work.w != NULL) {
        ddp_pg_work cw = w->work;
        if (cw.ops->work_publish == NULL) return wait_for(w, -1);
        int done;
        ddp_status st = DDP_OK;
        cw.ops->work_retain(cw.w);   /* the completion thread may finish w meanwhile */
        Py_BEGIN_ALLOW_THREADS
        done = cw.ops->work_done(cw.w);
        if (!done) st = cw.ops->work_publish(cw.w, stream);
        Py_END_ALLOW_THREADS
        cw.ops->work_release(cw.w);
        if (!done) {
            if (st != DDP_OK) return ddp_py_raise(st, NULL);
            Py_RETURN_TRUE;
        }
    }
    work_finish(w);   /* done: records the outcome (or waits for the thread that does) */
    return work_raise(w);
}

static void work_dealloc(WorkObject *w) {
    PyTypeObject *tp = Py_TYPE(w);
    if (!w->finished) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);   /* dealloc may run while an exception unwinds */
        if (work_block(w, -1) < 0) {
            /* Ctrl-C while a dropped handle waited: the group is aborted; make
             * the interrupt reach the main thread again, since dealloc cannot
             * raise. Other handler errors are reported. */
            if (PyErr_ExceptionMatches(PyExc_KeyboardInterrupt)) {
                PyErr_Clear();
                PyErr_SetInterrupt();
            } else {
                PyErr_WriteUnraisable((PyObject *)w);
            }
        }
        work_finish(w);
        PyErr_Restore(et, ev, tb);
    }
    release_arrays(w);
    Py_XDECREF(w->error);
    Py_XDECREF(w->callbacks);
    if (w->pg.ops) w->pg.ops->release(w->pg.impl);
    PyObject_Free(w);
    Py_DECREF(tp);
}

/* Out of memory making the Work: wait (GIL released) until the transport
 * is done with the arrays, then drop the work, so the caller may free them. */
static void drop_work(ddp_pg_work work) {
    Py_BEGIN_ALLOW_THREADS
    while (!work.ops->work_done(work.w)) work.ops->work_wait(work.w, ddp_wait_for(100, NULL));
    Py_END_ALLOW_THREADS
    work.ops->work_release(work.w);
}

PyObject *ddp_py_work_new_ex(ddp_pg pg, ddp_pg_work work, ddp_py_array *arrs, int narrs,
                             void *mem, int has_stream, uintptr_t stream) {
    WorkObject *w = PyObject_New(WorkObject, WorkType);
    if (w == NULL) {
        drop_work(work);
        ddp_py_arrays_free(arrs, (size_t)narrs);
        PyMem_Free(mem);
        return NULL;
    }
    pg.ops->retain(pg.impl);
    w->pg = pg;
    w->work = work;
    w->arrs = arrs;
    w->narrs = narrs;
    w->mem = mem;
    w->has_stream = has_stream;
    w->stream = stream;
    w->finished = FIN_NOT;
    w->status = DDP_OK;
    w->error = NULL;
    w->callbacks = NULL;
    w->queued = 0;
    return (PyObject *)w;
}

PyObject *ddp_py_work_new(ddp_pg pg, ddp_pg_work work, ddp_py_array *a, ddp_py_array *b,
                          int has_stream, uintptr_t stream) {
    ddp_py_array *arrs = PyMem_Calloc(2, sizeof *arrs);
    if (arrs == NULL) {
        PyErr_NoMemory();
        drop_work(work);
        ddp_py_array_release(a);
        ddp_py_array_release(b);
        return NULL;
    }
    arrs[0] = *a;
    arrs[1] = *b;
    memset(a, 0, sizeof *a);
    memset(b, 0, sizeof *b);
    return ddp_py_work_new_ex(pg, work, arrs, 2, NULL, has_stream, stream);
}

static PyMethodDef work_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))work_wait, METH_VARARGS | METH_KEYWORDS,
     "wait(timeout_ms=-1) -> True; raises the collective's error"},
    {"is_completed", (PyCFunction)work_is_completed, METH_NOARGS, "True once finished"},
    {"exception", (PyCFunction)work_exception, METH_NOARGS, "the error, or None"},
    {"add_done_callback", (PyCFunction)work_add_done_callback, METH_O,
     "add_done_callback(fn): fn(work) once finished, from pyddp's completion thread"},
    {"publish", (PyCFunction)work_publish_m, METH_O,
     "publish(stream) -> True: a GPU work's results ordered before the CUDA stream's later "
     "work, without waiting on the host; raises the collective's error if already known"},
    {NULL}
};
static PyType_Slot work_slots[] = {
    {Py_tp_dealloc, work_dealloc},
    {Py_tp_methods, work_methods},
    {Py_tp_doc, "A collective in flight (any transport)."},
    {0, NULL}
};
static PyType_Spec work_spec = {"pyddp._C.Work", sizeof(WorkObject), 0, Py_TPFLAGS_DEFAULT,
                                work_slots};

int ddp_py_work_register(PyObject *m) {
    WorkType = (PyTypeObject *)PyType_FromSpec(&work_spec);
    if (WorkType == NULL || PyModule_AddObjectRef(m, "Work", (PyObject *)WorkType) < 0) return -1;
    return ddp_py_completion_register(m);
}
