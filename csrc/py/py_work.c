/* py_work.c - pyddp._C.Work, the one handle for a collective in flight on
 * any transport (ddp_pg.h), and the completion thread that runs its
 * callbacks.
 *
 * A Work holds: the core work (a reference), a reference on the
 * communicator that runs it (so abort on Ctrl-C and the final status never
 * touch freed memory, even after destroy_process_group), and the imported
 * arrays until the transport is done with them.
 *
 *   wait(timeout_ms=-1) -> True, or raises the collective's error. Waits
 *       through ddp_py_wait: GIL released, signal handlers every 100 ms,
 *       Ctrl-C aborts the group and raises.
 *   is_completed(), exception()
 *   add_done_callback(fn): fn(work) once the work finished, on the
 *       completion thread (with the GIL), or at once if already finished.
 *
 * A Work dropped unfinished waits for its collective in dealloc through the
 * same loop; a Ctrl-C there aborts the group, waits for the transport to let
 * go of the arrays, and re-delivers the interrupt to the main thread.
 *
 * The completion thread: one per process, started by the first
 * add_done_callback. It keeps the Works that have callbacks, is woken by the
 * CPU worker's notify hook (ddp_py_work_notify) and polls every millisecond
 * while a work of a transport that cannot notify (NCCL) is pending. At
 * interpreter exit, before finalization, completion_park() (pyddp/_exit.py)
 * parks it for good outside Python: a thread that takes the GIL back once
 * finalization has begun is stopped by Python with pthread_exit, and if it
 * was inside a callback running C++ (torch's futures) the unwinding through
 * noexcept frames aborts the process.
 */
#include "py_work.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

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
 * The GIL is released in the middle (the transport's last wait, a device's
 * drain), so another thread can arrive meanwhile: `finished` is FIN_BUSY
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
        Py_BEGIN_ALLOW_THREADS
        st = cw.ops->work_wait(cw.w, ddp_wait_for(0, NULL));
        if (st != DDP_OK) {
            snprintf(msg, sizeof msg, "%s", cw.ops->work_error(cw.w));
            if (cw.ops->work_drained) drained = cw.ops->work_drained(cw.w, DRAIN_GRACE_MS);
        } else if (w->has_stream && cw.ops->work_publish) {
            st = cw.ops->work_publish(cw.w, w->stream);
            if (st != DDP_OK) ddp_copy_error(msg, sizeof msg);
        }
        cw.ops->work_release(cw.w);
        Py_END_ALLOW_THREADS
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
 * the buffers), then drop the work. 0 on success; -1 with the collective's
 * error or the signal handler's exception set. Takes over the caller's
 * reference on work in every case. */
int ddp_py_work_run(ddp_pg pg, ddp_pg_work work) {
    wait_ctx c = {pg, work};
    int rc = ddp_py_wait(wait_slice, &c, -1, wait_on_signal);
    ddp_status st = DDP_OK;
    char msg[2048] = "";
    if (rc == 0) {
        st = work.ops->work_wait(work.w, ddp_wait_for(0, NULL));   /* done: no blocking */
        if (st != DDP_OK) snprintf(msg, sizeof msg, "%s", work.ops->work_error(work.w));
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

/* ---- completion thread ----------------------------------------------- */

static pthread_mutex_t cmu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t ccv = PTHREAD_COND_INITIALIZER;
static pthread_cond_t parked_cv = PTHREAD_COND_INITIALIZER;  /* parked was set */
static int kicked;
static int started;
static int parking, parked;   /* completion_park() asked / the thread is parked (cmu) */
static pid_t started_in;      /* the process that started it (not a forked child) */
static PyObject *pending;  /* list of Works with callbacks (GIL) */

void ddp_py_work_notify(void *ctx) {
    (void)ctx;
    if (!started) return;
    pthread_mutex_lock(&cmu);
    kicked = 1;
    pthread_cond_signal(&ccv);
    pthread_mutex_unlock(&cmu);
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

/* Finish and call back every pending work that is done; returns whether a
 * still-pending work must be polled. GIL held. */
static int sweep(void) {
    int poll = 0;
    Py_ssize_t i = 0;
    while (i < PyList_GET_SIZE(pending)) {
        WorkObject *w = (WorkObject *)PyList_GET_ITEM(pending, i);
        if (!core_done(w)) {
            if (!w->work.ops->notifies) poll = 1;
            i++;
            continue;
        }
        Py_INCREF(w);
        PyList_SetSlice(pending, i, i + 1, NULL);
        work_finish(w);
        run_callbacks(w);
        Py_DECREF(w);
    }
    return poll;
}

static void *completer_main(void *unused) {
    (void)unused;
    PyGILState_STATE gs = PyGILState_Ensure();
    for (;;) {
        int poll = sweep();
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&cmu);
        if (!kicked) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            long ns = poll ? 1000000L : 200000000L;
            ts.tv_nsec += ns;
            ts.tv_sec += ts.tv_nsec / 1000000000L;
            ts.tv_nsec %= 1000000000L;
            pthread_cond_timedwait(&ccv, &cmu, &ts);
        }
        kicked = 0;
        if (parking) {    /* for good: the process is exiting */
            parked = 1;
            pthread_cond_broadcast(&parked_cv);
            for (;;) pthread_cond_wait(&ccv, &cmu);
        }
        pthread_mutex_unlock(&cmu);
        Py_END_ALLOW_THREADS
    }
    PyGILState_Release(gs);
    return NULL;
}

static int completer_start(void) {
    if (started) return 0;
    pending = PyList_New(0);
    if (pending == NULL) return -1;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    pthread_t t;
    int rc = pthread_create(&t, &at, completer_main, NULL);
    pthread_attr_destroy(&at);
    if (rc != 0) {
        Py_CLEAR(pending);
        ddp_py_raise(DDP_ERR_SYS, "could not start pyddp's completion thread");
        return -1;
    }
    started = 1;
    started_in = getpid();
    return 0;
}

/* ---- methods ---------------------------------------------------------- */

static PyObject *work_wait(WorkObject *w, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"timeout_ms", NULL};
    long long timeout_ms = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|L", kwlist, &timeout_ms)) return NULL;
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
    if (completer_start() < 0) return NULL;
    if (w->callbacks == NULL) {
        if ((w->callbacks = PyList_New(0)) == NULL) return NULL;
        if (PyList_Append(pending, (PyObject *)w) < 0) {
            Py_CLEAR(w->callbacks);
            return NULL;
        }
    }
    if (PyList_Append(w->callbacks, fn) < 0) return NULL;
    /* Kick the thread only when its next sweep would otherwise come late: the
     * work is already done (its notify may have come before it was pending),
     * or its transport cannot notify (the thread must start polling). A work
     * of a notifying transport, submitted with ddp_py_work_notify (every
     * Work is: py_pg_submit.c), that is not done yet kicks the thread itself
     * when it ends, after `done` is set, and w is pending by then. Waking the
     * thread here for nothing cost the caller ~0.15 ms per call (the woken
     * thread preempts it and queues for the GIL it holds). */
    if (core_done(w) || !w->work.ops->notifies) ddp_py_work_notify(NULL);
    Py_RETURN_NONE;
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

/* completion_park(timeout_s) -> bool: park the completion thread outside
 * Python for the rest of the process (callbacks of works that finish later
 * never run); waits up to timeout_s (GIL released) for it to get there from
 * the callback it may be running. True once parked, or if it never started. */
static PyObject *completion_park(PyObject *m, PyObject *arg) {
    (void)m;
    double timeout_s = PyFloat_AsDouble(arg);
    if (timeout_s == -1.0 && PyErr_Occurred()) return NULL;
    if (!started || started_in != getpid()) Py_RETURN_TRUE;   /* none in this process */
    int ok;
    Py_BEGIN_ALLOW_THREADS
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    long long ns = (long long)(timeout_s * 1e9);
    ts.tv_sec += (time_t)(ns / 1000000000LL);
    ts.tv_nsec += (long)(ns % 1000000000LL);
    ts.tv_sec += ts.tv_nsec / 1000000000L;
    ts.tv_nsec %= 1000000000L;
    pthread_mutex_lock(&cmu);
    parking = kicked = 1;
    pthread_cond_signal(&ccv);
    while (!parked && pthread_cond_timedwait(&parked_cv, &cmu, &ts) != ETIMEDOUT) {}
    ok = parked;
    pthread_mutex_unlock(&cmu);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
}

static PyMethodDef module_methods[] = {
    {"completion_park", completion_park, METH_O,
     "completion_park(timeout_s) -> bool: at exit, park the completion thread outside "
     "Python for good (see py_work.c)"},
    {NULL}
};

int ddp_py_work_register(PyObject *m) {
    WorkType = (PyTypeObject *)PyType_FromSpec(&work_spec);
    if (WorkType == NULL || PyModule_AddObjectRef(m, "Work", (PyObject *)WorkType) < 0) return -1;
    return PyModule_AddFunctions(m, module_methods);
}
