/* py_pg_submit.c - the one submit path of pyddp._C.ProcessGroup: every call
 * (submit, run, torch_run, alltoall, p2p_batch) is routed to a transport by
 * where its arrays live and handed to ddp_py_pg_call, which checks GPU
 * arrays against the device, fills the core arguments, and then, by mode
 * (ddp_py_mode, py_pg.h): runs the call to the end (run(): inline on this
 * thread where the transport takes it, else queued and waited for, results
 * published on the caller's CUDA stream), submits it and returns a
 * pyddp._C.Work, or, for a GPU call that returns once queued as torch's NCCL
 * does, orders the caller's stream after it at once and hands the work to
 * the completion thread, which watches it to the end (timeouts, aborts) and
 * then lets go of the arrays. The launch on a transport that may block
 * (NCCL, waiting for peers) is here once: GIL released, Python's signal
 * handlers asked, Ctrl-C aborting it.
 *
 * Whether a blocking call runs inline is the transport's decision, made in
 * one place (ddp_comm_queue.c's inline_fits for the CPU communicator, asked
 * through the run_inline op of ddp_pg.h); this file only asks. The
 * transports validate the core arguments (once per call) before anything is
 * sent.
 */
#include "py_common.h"

#include <string.h>
#include "py_array.h"
#include "py_nccl.h"
#include "py_work.h"
#include "py_pg.h"

/* The transport for a call whose arrays are on_gpu: attaches NCCL through the
 * factory on first use. 0 with *out set, or -1 with an exception. */
int ddp_py_pg_route(PGObject *self, int on_gpu, ddp_pg *out) {
    if (on_gpu && self->cuda.ops == NULL && self->cuda_factory != NULL) {
        PyObject *r = PyObject_CallNoArgs(self->cuda_factory);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    /* Imports and the factory run Python code, which may have destroyed the group. */
    if (self->cpu.ops == NULL) {
        ddp_py_raise(DDP_ERR_INVALID, "the process group was destroyed");
        return -1;
    }
    if (!on_gpu) {
        *out = self->cpu;
        return 0;
    }
    if (self->cuda.ops == NULL) {
        ddp_py_raise(DDP_ERR_TYPE, "a GPU array was passed, but this process group has no "
                     "GPU transport (backend=\"cpu\"/\"gloo\"); use backend=\"nccl\" or None, "
                     "or copy the array to the CPU first");
        return -1;
    }
    *out = self->cuda;
    return 0;
}

/* Before anything is submitted: GPU arrays on the transport's device, then
 * the core arguments from c->two (c->fill). 0, or -1 with an exception. */
static int prepare(ddp_pg pg, ddp_py_call *c) {
    if (c->on_gpu) {
        if (c->arrs == NULL) {
            if (c->two[0].owner && ddp_py_nccl_check_array(pg, &c->two[0], "input") < 0)
                return -1;
            if (c->two[1].owner && ddp_py_nccl_check_array(pg, &c->two[1], "output") < 0)
                return -1;
        }
        for (int i = 0; i < c->narrs; i++)
            if (c->arrs[i].owner && ddp_py_nccl_check_array(pg, &c->arrs[i], "a tensor") < 0)
                return -1;
    }
    if (!c->fill) return 0;
    return ddp_py_coll_args_fill(c->ca.kind, pg.ops->size(pg.impl), pg.ops->rank(pg.impl),
                                 c->ca.root, &c->two[0], &c->two[1], &c->ca);
}

/* Submit c->ca on pg. A transport that notifies only queues (never blocks),
 * so the GIL stays held; one whose launch may wait for peers (NCCL) runs
 * with the GIL released and Python's signal handlers asked through o->intr
 * (a handler's exception aborts the launch and is left in *sc). publish: a
 * submitted GPU work orders c->stream after itself at once (in the same
 * GIL-free stretch); its failure is left in *pub with the error message set. */
static ddp_status launch(ddp_pg pg, const ddp_py_call *c, ddp_pg_opts *o, ddp_pg_work *work,
                         ddp_py_sig_check *sc, int publish, ddp_status *pub) {
    *pub = DDP_OK;
    if (pg.ops->notifies) return ddp_pg_submit(pg, &c->ca, o, work);
    ddp_pg_interrupt intr = {ddp_py_check_signals, sc};
    o->intr = &intr;
    pg.ops->retain(pg.impl);   /* against a destroy() from another thread */
    sc->ts = PyEval_SaveThread();
    ddp_status st = ddp_pg_submit(pg, &c->ca, o, work);
    if (st == DDP_OK && publish) *pub = pg.ops->work_publish(work->w, c->stream);
    PyEval_RestoreThread(sc->ts);
    pg.ops->release(pg.impl);
    return st;
}

/* The Work for a submitted c; takes over what c holds. has_stream: whether
 * it publishes its results on c->stream when it finishes. */
static PyObject *make_work(ddp_pg pg, ddp_pg_work work, ddp_py_call *c, int has_stream) {
    if (c->arrs == NULL)
        return ddp_py_work_new(pg, work, &c->two[0], &c->two[1], has_stream, c->stream);
    PyObject *w = ddp_py_work_new_ex(pg, work, c->arrs, c->narrs, c->mem, has_stream,
                                     c->stream);
    c->arrs = NULL;
    c->narrs = 0;
    c->mem = NULL;
    return w;
}

/* A GPU work made for a call that does not wait for it (DDP_PY_ENQUEUE,
 * DDP_PY_WATCH): a Work that does not publish when it finishes (the caller
 * publishes), handed to the completion thread to watch. The Work (a new
 * reference), or NULL with an exception (the work then waited for). */
static PyObject *watched_work(ddp_pg pg, ddp_pg_work work, ddp_py_call *c) {
    PyObject *w = make_work(pg, work, c, 0);
    if (w != NULL && ddp_py_work_watch(w) < 0) Py_CLEAR(w);
    return w;
}

PyObject *ddp_py_pg_call(ddp_pg pg, ddp_py_call *c, ddp_py_mode mode) {
    int blocking = mode == DDP_PY_RUN, watched = mode == DDP_PY_ENQUEUE || mode == DDP_PY_WATCH;
    if (watched && (!c->on_gpu || pg.ops->work_publish == NULL)) {
        ddp_py_call_release(c);
        return ddp_py_raise(DDP_ERR_INVALID, "only a GPU call can return before it finished");
    }
    if (prepare(pg, c) < 0) {
        ddp_py_call_release(c);
        return NULL;
    }
    if (blocking) {
        int rc = ddp_py_run_inline(pg, &c->ca, c->timeout_ms);
        if (rc != 1) {   /* ran inline (or failed there) */
            ddp_py_call_release(c);
            if (rc < 0) return NULL;
            Py_RETURN_NONE;
        }
    }
    /* A blocking call is waited for here, a watched one polled: nobody to notify. */
    ddp_pg_opts o = {.timeout_ms = c->timeout_ms, .has_stream = c->has_stream,
                     .stream = c->stream,
                     .notify = blocking || watched ? NULL : ddp_py_work_notify};
    ddp_py_sig_check sc = {NULL, NULL, NULL, NULL};
    ddp_pg_work work;
    ddp_status pub;
    ddp_status st = launch(pg, c, &o, &work, &sc, mode == DDP_PY_ENQUEUE && c->has_stream, &pub);
    if (sc.et != NULL) {
        /* Interrupted while launching: a Work waits for the aborted work and
         * then lets go of the arrays. */
        if (st == DDP_OK) Py_XDECREF(make_work(pg, work, c, 0));
        ddp_py_call_release(c);
        PyErr_Restore(sc.et, sc.ev, sc.tb);
        return NULL;
    }
    if (st != DDP_OK) {
        ddp_py_call_release(c);
        return ddp_py_raise(st, NULL);
    }
    if (watched) {
        PyObject *w = watched_work(pg, work, c);
        if (w == NULL || mode == DDP_PY_WATCH) return w;
        Py_DECREF(w);   /* the completion thread holds it until the work ends */
        if (pub != DDP_OK) return ddp_py_raise(pub, NULL);
        Py_RETURN_NONE;
    }
    if (!blocking) return make_work(pg, work, c, c->has_stream);
    pg.ops->retain(pg.impl);   /* for the abort on Ctrl-C, against a concurrent destroy() */
    int rc = ddp_py_work_run(pg, work, c->has_stream, c->stream);
    pg.ops->release(pg.impl);
    ddp_py_call_release(c);    /* the transport is done with the arrays in every case */
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* submit(kind, a, b, op, root, timeout_ms, stream=None) -> Work */
PyObject *ddp_py_pg_submit(PGObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"kind", "a", "b", "op", "root", "timeout_ms", "stream", NULL};
    int kind, op = 0, root = 0;
    PyObject *ao = Py_None, *bo = Py_None, *so = Py_None;
    long long timeout_ms = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "i|OOiiLO", kwlist, &kind, &ao, &bo, &op, &root,
                                     &timeout_ms, &so))
        return NULL;
    if (self->cpu.ops == NULL) return ddp_py_raise(DDP_ERR_INVALID, "the process group was destroyed");
    if (op < 0 || op >= DDP_REDOP_COUNT) return ddp_py_raise(DDP_ERR_INVALID, "invalid reduce op");
    ddp_py_call c;
    memset(&c, 0, sizeof c);
    c.ca.kind = (ddp_coll_kind)kind;
    c.ca.op = (ddp_redop)op;
    c.ca.root = root;
    c.timeout_ms = timeout_ms;
    if (ddp_py_stream_arg(so, &c.has_stream, &c.stream) < 0) return NULL;
    return ddp_py_pg_submit_call(self, &c, ao, bo);
}

PyObject *ddp_py_pg_submit_call(PGObject *self, ddp_py_call *c, PyObject *ao, PyObject *bo) {
    if (ddp_py_call_import(c, ao, bo, c->ca.kind, &c->on_gpu) < 0) return NULL;
    ddp_pg pg;
    if (ddp_py_pg_route(self, c->on_gpu, &pg) < 0) {
        ddp_py_call_release(c);
        return NULL;
    }
    return ddp_py_pg_call(pg, c, DDP_PY_SUBMIT);
}

/* run(kind, a, op, root, timeout_ms[, count, dtype]) -> None: the lean path
 * of a blocking single-buffer collective (ALLREDUCE, BROADCAST, REDUCE,
 * BARRIER): run and wait in one call, no Work object. `a` is a contiguous
 * host array, None (BARRIER), or, with count and dtype (ddp_dtype codes,
 * DT_*), the address of `count` elements that the caller keeps alive and
 * unchanged in size for the call (a CPU torch tensor's data_ptr()); or a
 * CUDA torch tensor that py_torch_cuda.c takes, which goes to NCCL, is
 * waited for on the host and then published on the caller's current
 * stream. A small host one runs inline on this thread when the transport
 * takes it; otherwise the work goes through the same queue as submit and
 * the wait through ddp_py_wait. Either way it runs after anything queued
 * before it, the header exchange, flight record and timeouts are
 * unchanged, and Ctrl-C aborts the group and raises. Returns
 * NotImplemented, with nothing sent, for any other GPU array (use
 * submit). */
/* The arguments run() and run_async() share (kind, a, op, root, timeout_ms)
 * into c: 0, or -1 with an exception (nothing held). */
static int lean_args(PGObject *self, PyObject *const *args, ddp_py_call *c,
                     const char *name) {
    long kind = PyLong_AsLong(args[0]), op = PyLong_AsLong(args[2]),
         root = PyLong_AsLong(args[3]);
    long long timeout_ms = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred()) return -1;
    if (self->cpu.ops == NULL) {
        ddp_py_raise(DDP_ERR_INVALID, "the process group was destroyed");
        return -1;
    }
    /* the kinds of one buffer (an argument rule; whether the call runs inline is
     * the transport's to say) */
    if (kind != DDP_COLL_ALLREDUCE && kind != DDP_COLL_BROADCAST && kind != DDP_COLL_REDUCE &&
        kind != DDP_COLL_BARRIER) {
        char msg[80];
        PyOS_snprintf(msg, sizeof msg, "%s() takes single-buffer collectives only", name);
        ddp_py_raise(DDP_ERR_INVALID, msg);
        return -1;
    }
    if (op < 0 || op >= DDP_REDOP_COUNT) {
        ddp_py_raise(DDP_ERR_INVALID, "invalid reduce op");
        return -1;
    }
    memset(c, 0, sizeof *c);
    c->ca.kind = (ddp_coll_kind)kind;
    c->ca.op = (ddp_redop)op;
    c->ca.root = (int)root;
    c->timeout_ms = timeout_ms;
    return 0;
}

/* run_async(kind, a, op, root, timeout_ms) -> Work: pyddp's asynchronous call
 * (async_op=True) on one CUDA torch tensor that py_torch_cuda.c takes, with
 * its lean reading (no DLPack capsule, the caller's stream looked up once),
 * submitted as submit() would (the Work orders the caller's stream after the
 * collective when waited for). NotImplemented, with nothing sent, for any
 * other array: the caller's general path takes it. */
PyObject *ddp_py_pg_run_async(PGObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5)
        return ddp_py_raise(DDP_ERR_INVALID, "run_async(kind, a, op, root, timeout_ms)");
    ddp_py_call c;
    if (lean_args(self, args, &c, "run_async") < 0) return NULL;
    int rc = args[1] == Py_None ? 0 : ddp_py_torch_cuda_read(args[1], &c);
    if (rc < 0) return NULL;
    if (rc == 0) Py_RETURN_NOTIMPLEMENTED;
    return ddp_py_torch_cuda_call(self, &c, DDP_PY_SUBMIT);
}

PyObject *ddp_py_pg_run(PGObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 && nargs != 7)
        return ddp_py_raise(DDP_ERR_INVALID, "run(kind, a, op, root, timeout_ms[, count, "
                            "dtype])");
    ddp_py_call c;
    if (lean_args(self, args, &c, "run") < 0) return NULL;
    if (nargs == 5 && args[1] != Py_None) {   /* a CUDA torch tensor: its lean path */
        int rc = ddp_py_torch_cuda_read(args[1], &c);
        if (rc < 0) return NULL;
        if (rc == 1) return ddp_py_torch_cuda_call(self, &c, DDP_PY_RUN);
        if (ddp_py_torch_cuda_class(args[1])) Py_RETURN_NOTIMPLEMENTED;   /* not taken */
    }
    int rc = ddp_py_call_run_buffer(&c, args, nargs);
    if (rc < 0) return NULL;
    if (rc == 1) Py_RETURN_NOTIMPLEMENTED;
    ddp_pg pg;
    if (ddp_py_pg_route(self, 0, &pg) < 0) {
        ddp_py_call_release(&c);
        return NULL;
    }
    return ddp_py_pg_call(pg, &c, DDP_PY_RUN);
}
