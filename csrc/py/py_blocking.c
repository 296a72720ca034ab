/* py_blocking.c - running a blocking C call so that Ctrl-C still works.
 *
 * Python runs signal handlers only on the main thread and only while it holds
 * the GIL. A C call that blocks for minutes with the GIL released would make
 * Ctrl-C wait for it. ddp_py_run_abortable moves the call to a helper thread
 * and keeps the caller in a loop of short GIL-free waits, running the signal
 * handlers between them; a raised KeyboardInterrupt sets the call's abort
 * flag, which every core wait checks within DDP_WAIT_SLICE_MS. ddp_py_wait is
 * the one wait loop for work another thread runs. A call that waits inside
 * the core on this thread (an inline collective, an NCCL launch) instead gets
 * a check hook, ddp_py_check_signals, that the core's wait asks while it
 * parks: it takes the GIL back for a moment and runs the handlers.
 */
#include "py_common.h"

#include <errno.h>
#include <pthread.h>
#include <time.h>

typedef struct job {
    void (*fn)(void *);
    void *arg;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done;
} job;

static void *job_main(void *p) {
    job *j = p;
    j->fn(j->arg);
    pthread_mutex_lock(&j->mu);
    j->done = 1;
    pthread_cond_signal(&j->cv);
    pthread_mutex_unlock(&j->mu);
    return NULL;
}

/* Wait up to ms for the job; returns 1 if done. GIL must be released. */
static int job_wait(job *j, int ms) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += (long)ms * 1000000L;
    ts.tv_sec += ts.tv_nsec / 1000000000L;
    ts.tv_nsec %= 1000000000L;
    pthread_mutex_lock(&j->mu);
    while (!j->done) {
        if (pthread_cond_timedwait(&j->cv, &j->mu, &ts) == ETIMEDOUT) break;
    }
    int d = j->done;
    pthread_mutex_unlock(&j->mu);
    return d;
}

int ddp_py_run_abortable(void (*fn)(void *), void *arg, atomic_int *abort) {
    job j = {fn, arg, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
    pthread_t t;
    if (pthread_create(&t, NULL, job_main, &j) != 0) {
        /* No thread to spare: run inline; Ctrl-C then waits for the deadline. */
        Py_BEGIN_ALLOW_THREADS
        fn(arg);
        Py_END_ALLOW_THREADS
        return 0;
    }
    int interrupted = 0;
    for (;;) {
        int done;
        Py_BEGIN_ALLOW_THREADS
        done = job_wait(&j, 100);
        Py_END_ALLOW_THREADS
        if (done) break;
        if (!interrupted && PyErr_CheckSignals() < 0) {
            interrupted = 1;
            atomic_store(abort, 1);
        }
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_join(t, NULL);
    Py_END_ALLOW_THREADS
    pthread_mutex_destroy(&j.mu);
    pthread_cond_destroy(&j.cv);
    return interrupted ? -1 : 0;
}

int ddp_py_wait(int (*slice_fn)(void *ctx, ddp_wait slice), void *ctx, int64_t timeout_ms,
                void (*on_signal)(void *ctx)) {
    ddp_wait total = ddp_wait_for(timeout_ms, NULL);
    for (;;) {
        ddp_wait slice = ddp_wait_for(DDP_WAIT_SLICE_MS, NULL);
        if (total.deadline_ms < slice.deadline_ms) slice.deadline_ms = total.deadline_ms;
        int done;
        Py_BEGIN_ALLOW_THREADS
        done = slice_fn(ctx, slice);
        Py_END_ALLOW_THREADS
        if (done) return 0;
        if (PyErr_CheckSignals() < 0) {
            /* A handler raised (Ctrl-C): break the communication so the wait
             * ends within moments (peers fail fast too), wait for that, and
             * hand the exception to the caller. */
            PyObject *et, *ev, *tb;
            PyErr_Fetch(&et, &ev, &tb);
            if (on_signal) on_signal(ctx);
            for (;;) {
                Py_BEGIN_ALLOW_THREADS
                done = slice_fn(ctx, ddp_wait_for(DDP_WAIT_SLICE_MS, NULL));
                Py_END_ALLOW_THREADS
                if (done) break;
            }
            PyErr_Restore(et, ev, tb);
            return -1;
        }
        if (ddp_wait_expired(total)) return 1;
    }
}

int ddp_py_check_signals(void *p) {
    ddp_py_sig_check *s = p;
    if (s->et != NULL) return 1;
    PyEval_RestoreThread(s->ts);
    if (PyErr_CheckSignals() < 0) PyErr_Fetch(&s->et, &s->ev, &s->tb);
    s->ts = PyEval_SaveThread();
    return s->et != NULL;
}

typedef struct {
    ddp_py_sig_check sc;
    ddp_pg pg;
} inline_check;

/* The inline run's check hook: on a handler's exception, abort the group as
 * ddp_py_wait's callers do (peers fail fast, the message says why), then end
 * the run. */
static int inline_hook(void *p) {
    inline_check *ic = p;
    if (!ddp_py_check_signals(&ic->sc)) return 0;
    ic->pg.ops->abort(ic->pg.impl, DDP_PY_SIGNAL_ABORT);
    return 1;
}

int ddp_py_run_inline(ddp_pg pg, const ddp_coll_args *a, int64_t timeout_ms) {
    if (pg.ops->run_inline == NULL) return 1;
    inline_check ic = {{NULL, NULL, NULL, NULL}, pg};
    ddp_pg_interrupt intr = {inline_hook, &ic};
    int taken = 0;
    pg.ops->retain(pg.impl);   /* against a destroy() from a handler or another thread */
    ic.sc.ts = PyEval_SaveThread();
    ddp_status st = pg.ops->run_inline(pg.impl, a, timeout_ms, &intr, &taken);
    PyEval_RestoreThread(ic.sc.ts);
    pg.ops->release(pg.impl);
    if (ic.sc.et != NULL) {
        PyErr_Restore(ic.sc.et, ic.sc.ev, ic.sc.tb);
        return -1;
    }
    if (!taken) return 1;
    if (st != DDP_OK) {
        ddp_py_raise(st, NULL);
        return -1;
    }
    return 0;
}
