/* py_completion.c - pyddp's completion thread: one per process, started by
 * the first Work queued on it (py_work.c: add_done_callback, or a GPU work
 * nobody waits for, ddp_py_work_watch). It keeps the queued Works, is woken
 * by the CPU worker's notify hook (ddp_py_work_notify) and polls every
 * millisecond while a work of a transport that cannot notify (NCCL) is
 * queued; a finished Work is finished there (its status recorded, its
 * arrays let go) and its callbacks run, with the GIL.
 *
 * Polling a GPU work is what enforces its deadline: an NCCL work that is not
 * done by then breaks its communicator (ncclCommAbort), so a collective
 * that returned before it finished (torch's API on CUDA tensors) still
 * cannot hang the job. The thread keeps polling for LINGER_MS after the last
 * such work ended, so a stream of short GPU calls does not wake it once per
 * call (each wake takes the GIL from the caller). Works on one NCCL
 * communicator finish in the order
 * they were queued (one stream), so a sweep stops polling a communicator at
 * its first work that is still pending.
 *
 * At interpreter exit, before finalization, completion_park()
 * (pyddp/_exit.py) parks the thread for good outside Python: a thread that
 * takes the GIL back once finalization has begun is stopped by Python with
 * pthread_exit, and if it was inside a callback running C++ (torch's
 * futures) the unwinding through noexcept frames aborts the process.
 */
#include "py_work.h"

#include <errno.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>
#include "ddp_clock.h"

#define SKIP_MAX 8     /* communicators a sweep remembers as still busy */
#define LINGER_MS 100  /* polling goes on this long after the last polled work ended */

static pthread_mutex_t cmu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t ccv = PTHREAD_COND_INITIALIZER;
static pthread_cond_t parked_cv = PTHREAD_COND_INITIALIZER;  /* parked was set */
static int kicked;
static int started;
static int polling;           /* the thread polls every 1 ms (cmu): queuing a work that
                                 must be polled need not wake it */
static int parking, parked;   /* completion_park() asked / the thread is parked (cmu) */
static pid_t started_in;      /* the process that started it (not a forked child) */
static PyObject *queued;      /* list of Works the thread holds (GIL) */

void ddp_py_work_notify(void *ctx) {
    (void)ctx;
    if (!started) return;
    pthread_mutex_lock(&cmu);
    kicked = 1;
    pthread_cond_signal(&ccv);
    pthread_mutex_unlock(&cmu);
}

/* Whether impl is among the first n entries of busy. */
static int seen(void *const *busy, int n, const void *impl) {
    for (int i = 0; i < n; i++)
        if (busy[i] == impl) return 1;
    return 0;
}

/* Finish and call back every queued work that is done; returns whether the
 * sweep met a work of a transport that must be polled (pending or not).
 * GIL held. */
static int sweep(void) {
    int polled_any = 0, nbusy = 0;
    void *busy[SKIP_MAX];   /* polled communicators with a pending work this sweep */
    Py_ssize_t i = 0;
    while (i < PyList_GET_SIZE(queued)) {
        PyObject *w = PyList_GET_ITEM(queued, i);
        void *impl;
        int polled;
        ddp_py_work_kind(w, &impl, &polled);
        polled_any |= polled;
        if (polled && seen(busy, nbusy, impl)) {   /* an earlier one there is pending */
            i++;
            continue;
        }
        if (!ddp_py_work_done(w)) {
            if (polled && nbusy < SKIP_MAX) busy[nbusy++] = impl;
            i++;
            continue;
        }
        Py_INCREF(w);
        PyList_SetSlice(queued, i, i + 1, NULL);
        ddp_py_work_complete(w);
        Py_DECREF(w);
    }
    return polled_any;
}

static void *completer_main(void *unused) {
    (void)unused;
    PyGILState_STATE gs = PyGILState_Ensure();
    int64_t linger_until = 0;   /* keep polling until then (ms) */
    for (;;) {
        int64_t now = ddp_now_ms();
        if (sweep()) linger_until = now + LINGER_MS;
        pthread_mutex_lock(&cmu);   /* with the GIL: a work queued later sees this */
        polling = now < linger_until;
        pthread_mutex_unlock(&cmu);
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&cmu);
        if (!kicked) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            long ns = polling ? 1000000L : 200000000L;
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
    queued = PyList_New(0);
    if (queued == NULL) return -1;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    pthread_t t;
    int rc = pthread_create(&t, &at, completer_main, NULL);
    pthread_attr_destroy(&at);
    if (rc != 0) {
        Py_CLEAR(queued);
        ddp_py_raise(DDP_ERR_SYS, "could not start pyddp's completion thread");
        return -1;
    }
    started = 1;
    started_in = getpid();
    return 0;
}

int ddp_py_completion_add(PyObject *w, int done, int polled) {
    if (completer_start() < 0 || PyList_Append(queued, w) < 0) return -1;
    pthread_mutex_lock(&cmu);
    int kick = done || (polled && !polling);
    pthread_mutex_unlock(&cmu);
    if (kick) ddp_py_work_notify(NULL);
    return 0;
}

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
     "Python for good (see py_completion.c)"},
    {NULL}
};

int ddp_py_completion_register(PyObject *m) { return PyModule_AddFunctions(m, module_methods); }
