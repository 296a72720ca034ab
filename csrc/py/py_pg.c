/* py_pg.c - pyddp._C.ProcessGroup: the one process group of the Python
 * layer, whatever transports are behind it. It always has the CPU
 * communicator (TCP and shared memory, csrc/core/ddp_comm.h) and may have an
 * NCCL one; each call is routed by where its arrays live: host arrays to the
 * CPU transport, GPU arrays to NCCL, which is created on first use by the
 * Python factory set with set_cuda_factory (or attached at init for
 * backend="nccl"). Both are driven through ddp_pg.h; handles are
 * pyddp._C.Work (py_work.c).
 *
 * ProcessGroup(store, rank, size, prefix, advertise_host, bind_host, port_lo,
 *              port_hi, timeout_ms, version, host_id)
 *   rendezvous (collective; Ctrl-C aborts it); store is held (a reference on
 *   its C client) for the whole rendezvous, so closing it meanwhile is safe.
 * subgroup(ranks, tag[, algo]) -> ProcessGroup   member-only, no communication
 *                                 (algo: DDP_ALGO_*, default PYDDP_ALGO): a
 *   view over this group's links for the group ranks `ranks` (increasing).
 * attach_nccl(store, prefix, device, timeout_ms, version)   collective
 * set_cuda_factory(fn)   fn() must attach NCCL (collective, every member)
 * submit(kind, a, b, op, root, timeout_ms, stream=None) -> Work
 * alltoall(input, output, scounts, sdispls, rcounts, rdispls, timeout_ms, stream=None)
 *   -> Work
 * p2p_batch([(is_send, array, peer), ...], timeout_ms, stream=None) -> Work
 * run(kind, a, op, root, timeout_ms[, count, dtype]) -> None   blocking, host
 *   memory, single-buffer kinds: submit + wait without a Work (see pg_run)
 * where, by kind, a/b are:
 *   ALLREDUCE, BROADCAST, REDUCE, SEND, RECV: a = the array, b = None
 *   ALLGATHER, REDUCE_SCATTER, GATHER, SCATTER: a = input, b = output
 *     (GATHER's output and SCATTER's input only at the root, None elsewhere)
 *   BARRIER: a = b = None
 * root is a rank of this group. Every check (types, dtypes, device, sizes,
 * root) happens in submit, before anything is queued, so a bad call leaves
 * the group usable. `stream` is the caller's CUDA stream for GPU arrays.
 */
#include "py_common.h"

#include <stdarg.h>
#include <string.h>
#include "ddp_comm.h"
#include "ddp_store.h"
#include "py_array.h"
#include "py_nccl.h"
#include "py_work.h"
#include "py_pg.h"


static PyTypeObject *PGType;

static PGObject *as_pg(PyObject *o) {
    if (PGType == NULL || !PyObject_TypeCheck(o, PGType)) {
        PyErr_SetString(PyExc_TypeError, "expected a pyddp._C.ProcessGroup");
        return NULL;
    }
    return (PGObject *)o;
}

struct ddp_comm *ddp_py_pg_comm_ref(PyObject *pg) {
    PGObject *p = as_pg(pg);
    if (p == NULL) return NULL;
    if (p->comm == NULL) {
        ddp_py_raise(DDP_ERR_INVALID, "the process group was destroyed");
        return NULL;
    }
    ddp_comm_retain(p->comm);
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
    PGObject *self = (PGObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    atomic_int abort;
    atomic_init(&abort, 0);
    j.cfg.abort = &abort;
    j.store = ddp_py_store_client_ref(store_obj);   /* held across the rendezvous */
    if (j.store == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    int rc = ddp_py_run_abortable(create_run, &j, &abort);
    ddp_store_release(j.store);
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

static PyObject *pg_subgroup(PGObject *self, PyObject *args) {
    PyObject *ranks;
    unsigned long long tag;
    int algo = -1;
    if (!PyArg_ParseTuple(args, "OK|i", &ranks, &tag, &algo)) return NULL;
    if (algo < -1 || algo > DDP_ALGO_HIER)
        return ddp_py_raise(DDP_ERR_INVALID, "algo must be -1 (PYDDP_ALGO) or 0..2");
    if (self->comm == NULL) return ddp_py_raise(DDP_ERR_INVALID, "the process group was destroyed");
    PyObject *fast = PySequence_Fast(ranks, "ranks must be a sequence of ints");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    int *rk = PyMem_Calloc(n ? (size_t)n : 1, sizeof *rk);
    if (rk == NULL) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) {
            PyMem_Free(rk);
            Py_DECREF(fast);
            return NULL;
        }
        rk[i] = (int)v;
    }
    Py_DECREF(fast);
    ddp_comm *sub = NULL;
    ddp_status st = ddp_comm_subgroup(self->comm, (int)n, rk, (uint64_t)tag, &sub);
    PyMem_Free(rk);
    if (st != DDP_OK) return ddp_py_raise(st, NULL);
    if (algo >= 0) ddp_comm_set_algo(sub, algo);
    PGObject *g = (PGObject *)PGType->tp_alloc(PGType, 0);
    if (g == NULL) {
        ddp_comm_destroy(sub);
        return NULL;
    }
    g->comm = sub;
    return (PyObject *)g;
}

static PyObject *pg_attach_nccl(PGObject *self, PyObject *args) {
    PyObject *store_obj;
    const char *prefix, *version;
    int device;
    long long timeout_ms;
    if (!PyArg_ParseTuple(args, "OsiLs", &store_obj, &prefix, &device, &timeout_ms, &version))
        return NULL;
    if (self->comm == NULL) return ddp_py_raise(DDP_ERR_INVALID, "the process group was destroyed");
    if (self->cuda.ops) return ddp_py_raise(DDP_ERR_INVALID, "NCCL is already attached");
    ddp_pg nccl;
    if (ddp_py_nccl_create(store_obj, ddp_comm_rank(self->comm), ddp_comm_size(self->comm),
                           prefix, device, timeout_ms, version, &nccl) < 0)
        return NULL;
    if (self->comm == NULL || self->cuda.ops) {   /* destroyed or attached meanwhile */
        Py_BEGIN_ALLOW_THREADS
        nccl.ops->destroy(nccl.impl, ddp_wait_for(10000, NULL));
        Py_END_ALLOW_THREADS
        return ddp_py_raise(DDP_ERR_INVALID, "the process group changed while NCCL was "
                            "being set up");
    }
    self->cuda = nccl;
    Py_RETURN_NONE;
}

static PyObject *pg_set_cuda_factory(PGObject *self, PyObject *fn) {
    if (fn != Py_None && !PyCallable_Check(fn))
        return ddp_py_raise(DDP_ERR_INVALID, "the CUDA factory must be callable or None");
    Py_XSETREF(self->cuda_factory, fn == Py_None ? NULL : Py_NewRef(fn));
    Py_RETURN_NONE;
}

/* End both transports (GIL released); safe to call twice. */
static void pg_destroy_all(PGObject *self, int64_t nccl_ms) {
    ddp_comm *c = self->comm;
    ddp_pg cu = self->cuda;
    self->comm = NULL;
    memset(&self->cuda, 0, sizeof self->cuda);
    Py_BEGIN_ALLOW_THREADS
    if (cu.ops) cu.ops->destroy(cu.impl, ddp_wait_for(nccl_ms, NULL));
    if (c) ddp_comm_destroy(c);
    Py_END_ALLOW_THREADS
}

static void pg_dealloc(PGObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    pg_destroy_all(self, 10000);
    Py_XDECREF(self->cuda_factory);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* ---- submit ---------------------------------------------------------- */

int ddp_py_bad(const char *fmt, ...) {
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
    if (need_a && a->owner == NULL) return ddp_py_bad("%s: the input array is required", nm);
    if (need_b && b->owner == NULL) return ddp_py_bad("%s: the output array is required", nm);
    if (a->owner && b->owner && a->dtype != b->dtype)
        return ddp_py_bad("%s: input dtype %s differs from output dtype %s", nm,
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
            return ddp_py_bad("%s: the output has %zu elements but needs world_size * input = "
                       "%d * %zu = %zu", nm, b->count, size, n, n * (size_t)size);
        ca->sendbuf = a->ptr;
        ca->recvbuf = b->owner ? b->ptr : NULL;
        ca->count = n;
        break;
    case DDP_COLL_REDUCE_SCATTER:
    case DDP_COLL_SCATTER:
        n = b->count;
        if (a->owner && a->count != n * (size_t)size)
            return ddp_py_bad("%s: the input has %zu elements but needs world_size * output = "
                       "%d * %zu = %zu", nm, a->count, size, n, n * (size_t)size);
        ca->sendbuf = a->owner ? a->ptr : NULL;
        ca->recvbuf = b->ptr;
        ca->count = n;
        break;
    case DDP_COLL_BARRIER:
        ca->count = 0;
        break;
    default:
        return ddp_py_bad("unknown collective kind %d", kind);
    }
    return 0;
}

/* Import an optional array (GIL held); dl_stream goes to __dlpack__. */
static int import_opt(PyObject *obj, int writable, const char *name, PyObject *dl_stream,
                      ddp_py_array *out) {
    memset(out, 0, sizeof *out);
    if (obj == Py_None) return 0;
    return ddp_py_array_import_stream(obj, writable, name,
                                      dl_stream && PyObject_HasAttrString(obj, "__dlpack__")
                                          ? dl_stream : NULL, out);
}

/* The transport for a call whose arrays are on_gpu: attaches NCCL through the
 * factory on first use. 0 with *out set, or -1 with an exception. */
int ddp_py_pg_route(PGObject *self, int on_gpu, ddp_pg *out) {
    if (!on_gpu) {
        *out = ddp_comm_pg(self->comm);
        return 0;
    }
    if (self->cuda.ops == NULL && self->cuda_factory != NULL) {
        PyObject *r = PyObject_CallNoArgs(self->cuda_factory);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    if (self->comm == NULL) {
        ddp_py_raise(DDP_ERR_INVALID, "the process group was destroyed");
        return -1;
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

static PyObject *pg_submit(PGObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"kind", "a", "b", "op", "root", "timeout_ms", "stream", NULL};
    int kind, op = 0, root = 0;
    PyObject *ao = Py_None, *bo = Py_None, *so = Py_None;
    long long timeout_ms = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "i|OOiiLO", kwlist, &kind, &ao, &bo, &op, &root,
                                     &timeout_ms, &so))
        return NULL;
    if (self->comm == NULL) return ddp_py_raise(DDP_ERR_INVALID, "the process group was destroyed");
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
    int writable_a = kind == DDP_COLL_ALLREDUCE || kind == DDP_COLL_BROADCAST ||
                     kind == DDP_COLL_REDUCE || kind == DDP_COLL_RECV;
    ddp_py_array a, b;
    ddp_coll_args ca;
    memset(&ca, 0, sizeof ca);
    memset(&b, 0, sizeof b);
    ca.op = (ddp_redop)op;
    ddp_pg pg = {NULL, NULL};
    int rc = import_opt(ao, writable_a, "input", dl_stream, &a);
    if (rc == 0) rc = import_opt(bo, 1, "output", dl_stream, &b);
    Py_XDECREF(dl_stream);
    int on_gpu = (a.owner && a.device == DDP_DEV_CUDA) || (b.owner && b.device == DDP_DEV_CUDA);
    if (rc == 0 && a.owner && b.owner && a.device != b.device) {
        ddp_py_raise(DDP_ERR_INVALID, "the input and the output must both be GPU arrays or "
                     "both host arrays");
        rc = -1;
    }
    /* The imports (and the factory) ran Python code, which may have
     * destroyed the group: route checks. */
    if (rc == 0) rc = ddp_py_pg_route(self, on_gpu, &pg);
    if (rc == 0 && on_gpu && a.owner) rc = ddp_py_nccl_check_array(pg, &a, "input");
    if (rc == 0 && on_gpu && b.owner) rc = ddp_py_nccl_check_array(pg, &b, "output");
    if (rc == 0)
        rc = ddp_py_coll_args_fill(kind, pg.ops->size(pg.impl), pg.ops->rank(pg.impl), root,
                                   &a, &b, &ca);
    if (rc < 0) {
        ddp_py_array_release(&a);
        ddp_py_array_release(&b);
        return NULL;
    }
    ddp_pg_opts o = {.timeout_ms = timeout_ms, .has_stream = has_stream, .stream = stream,
                     .notify = ddp_py_work_notify};
    ddp_pg_work work;
    ddp_status st;
    if (pg.ops->notifies) {
        st = ddp_pg_submit(pg, &ca, &o, &work);   /* queues; never blocks */
    } else {
        /* NCCL's launch can wait for peers: release the GIL, keep Ctrl-C. */
        ddp_py_sig_check sc = {NULL, NULL, NULL, NULL};
        ddp_pg_interrupt intr = {ddp_py_check_signals, &sc};
        o.intr = &intr;
        pg.ops->retain(pg.impl);   /* against a destroy() from another thread */
        sc.ts = PyEval_SaveThread();
        st = ddp_pg_submit(pg, &ca, &o, &work);
        PyEval_RestoreThread(sc.ts);
        pg.ops->release(pg.impl);
        if (sc.et != NULL) {
            if (st == DDP_OK) {
                PyObject *w = ddp_py_work_new(pg, work, &a, &b, has_stream, stream);
                Py_XDECREF(w);   /* waits for the aborted work, then lets go */
            }
            ddp_py_array_release(&a);
            ddp_py_array_release(&b);
            PyErr_Restore(sc.et, sc.ev, sc.tb);
            return NULL;
        }
    }
    if (st != DDP_OK) {
        ddp_py_array_release(&a);
        ddp_py_array_release(&b);
        return ddp_py_raise(st, NULL);
    }
    return ddp_py_work_new(pg, work, &a, &b, has_stream, stream);
}

/* run(kind, a, op, root, timeout_ms[, count, dtype]) -> None: the lean path
 * of a blocking single-buffer collective (ALLREDUCE, BROADCAST, REDUCE,
 * BARRIER) on host memory: run and wait in one call, no Work object. `a`
 * is a contiguous host array, None (BARRIER), or, with count and dtype
 * (ddp_dtype codes, DT_*), the address of `count` elements that the caller
 * keeps alive and unchanged in size for the call (a CPU torch tensor's
 * data_ptr()). A small one (PYDDP_SMALL_BYTES) runs inline on this thread
 * when nothing is queued (ddp_py_run_inline); otherwise the work goes through
 * the same queue as submit and the wait through ddp_py_wait. Either way it
 * runs after anything queued before it, the header exchange, flight record
 * and timeouts are unchanged, and Ctrl-C aborts the group and raises.
 * Returns NotImplemented for a GPU array (use submit). */
static PyObject *pg_run(PGObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 && nargs != 7)
        return ddp_py_raise(DDP_ERR_INVALID, "run(kind, a, op, root, timeout_ms[, count, "
                            "dtype])");
    long kind = PyLong_AsLong(args[0]), op = PyLong_AsLong(args[2]),
         root = PyLong_AsLong(args[3]);
    long long timeout_ms = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (self->comm == NULL) return ddp_py_raise(DDP_ERR_INVALID, "the process group was destroyed");
    if (kind != DDP_COLL_ALLREDUCE && kind != DDP_COLL_BROADCAST && kind != DDP_COLL_REDUCE &&
        kind != DDP_COLL_BARRIER)
        return ddp_py_raise(DDP_ERR_INVALID, "run() takes single-buffer collectives only");
    if (op < 0 || op >= DDP_REDOP_COUNT) return ddp_py_raise(DDP_ERR_INVALID, "invalid reduce op");
    ddp_coll_args ca;
    memset(&ca, 0, sizeof ca);
    ca.op = (ddp_redop)op;
    ddp_py_array a, b;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    ddp_pg pg = ddp_comm_pg(self->comm);
    if (nargs == 7) {
        void *ptr = PyLong_AsVoidPtr(args[1]);
        long long count = PyLong_AsLongLong(args[5]);
        long dt = PyLong_AsLong(args[6]);
        if (PyErr_Occurred()) return NULL;
        if (count < 0 || dt < 0 || dt >= DDP_DTYPE_COUNT || (ptr == NULL && count > 0))
            return ddp_py_raise(DDP_ERR_INVALID, "run(): invalid buffer");
        ca.kind = (ddp_coll_kind)kind;
        ca.root = (int)root;
        ca.dtype = (ddp_dtype)dt;
        ca.buf = kind == DDP_COLL_BARRIER ? NULL : ptr;
        ca.count = kind == DDP_COLL_BARRIER ? 0 : (size_t)count;
    } else {
        if (args[1] != Py_None &&
            ddp_py_array_import(args[1], kind != DDP_COLL_BARRIER, "tensor", &a) < 0)
            return NULL;
        if (a.owner && a.device != DDP_DEV_CPU) {
            ddp_py_array_release(&a);
            Py_RETURN_NOTIMPLEMENTED;
        }
        /* The import may have run Python code (a __dlpack__) that destroyed the group. */
        if (self->comm == NULL) {
            ddp_py_array_release(&a);
            return ddp_py_raise(DDP_ERR_INVALID, "the process group was destroyed");
        }
        pg = ddp_comm_pg(self->comm);
        if (ddp_py_coll_args_fill((int)kind, pg.ops->size(pg.impl), pg.ops->rank(pg.impl),
                                  (int)root, &a, &b, &ca) < 0) {
            ddp_py_array_release(&a);
            return NULL;
        }
    }
    int rc = ddp_py_run_inline(self->comm, &ca, timeout_ms);
    if (rc != 1) {   /* ran inline (or failed there) */
        ddp_py_array_release(&a);
        if (rc < 0) return NULL;
        Py_RETURN_NONE;
    }
    ddp_pg_opts o = {.timeout_ms = timeout_ms};
    ddp_pg_work work;
    ddp_status st = ddp_pg_submit(pg, &ca, &o, &work);   /* queues; never blocks */
    if (st != DDP_OK) {
        ddp_py_array_release(&a);
        return ddp_py_raise(st, NULL);
    }
    pg.ops->retain(pg.impl);   /* for the abort on Ctrl-C, against a concurrent destroy() */
    rc = ddp_py_work_run(pg, work);
    pg.ops->release(pg.impl);
    ddp_py_array_release(&a);   /* the transport is done with it in every case */
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* The optional `stream` argument: 0 with *has = 0 for None, else its value. */
int ddp_py_stream_arg(PyObject *so, int *has, uintptr_t *stream) {
    *has = so != NULL && so != Py_None;
    *stream = 0;
    if (!*has) return 0;
    *stream = (uintptr_t)PyLong_AsUnsignedLongLong(so);
    return PyErr_Occurred() ? -1 : 0;
}

/* Queue a collective whose arguments (arrays, counts) were prepared by the
 * caller; takes over arrs[0..n) and mem in every case. On a GPU transport
 * the arrays are checked to be on its device first, the work is ordered
 * after `stream` (has_stream) and published there at wait(), and the launch
 * runs with the GIL released and Ctrl-C watched, as in pg_submit. */
PyObject *ddp_py_pg_submit_prepared(PGObject *self, ddp_pg pg, ddp_coll_args *ca,
                                    long long timeout_ms, int has_stream, uintptr_t stream,
                                    ddp_py_array *arrs, int n, void *mem) {
    ddp_pg_opts o = {.timeout_ms = timeout_ms, .has_stream = has_stream, .stream = stream,
                     .notify = ddp_py_work_notify};
    ddp_pg_work work;
    ddp_status st = DDP_OK;
    int rc = 0;
    ddp_py_sig_check sc = {NULL, NULL, NULL, NULL};
    for (int i = 0; i < n && rc == 0 && !pg.ops->notifies; i++)
        if (arrs[i].owner) rc = ddp_py_nccl_check_array(pg, &arrs[i], "a tensor");
    if (rc == 0 && pg.ops->notifies) {
        st = ddp_pg_submit(pg, ca, &o, &work);   /* queues; never blocks */
    } else if (rc == 0) {
        ddp_pg_interrupt intr = {ddp_py_check_signals, &sc};
        o.intr = &intr;
        pg.ops->retain(pg.impl);   /* against a destroy() from another thread */
        sc.ts = PyEval_SaveThread();
        st = ddp_pg_submit(pg, ca, &o, &work);
        PyEval_RestoreThread(sc.ts);
        pg.ops->release(pg.impl);
    }
    if (rc == 0 && sc.et != NULL && st == DDP_OK) {
        /* Interrupted while launching: the Work waits for the aborted work
         * and then lets go of the arrays. */
        Py_XDECREF(ddp_py_work_new_ex(pg, work, arrs, n, mem, has_stream, stream));
        PyErr_Restore(sc.et, sc.ev, sc.tb);
        return NULL;
    }
    if (rc != 0 || st != DDP_OK || sc.et != NULL) {
        for (int i = 0; i < n; i++) ddp_py_array_release(&arrs[i]);
        PyMem_Free(arrs);
        PyMem_Free(mem);
        if (sc.et != NULL) {
            PyErr_Restore(sc.et, sc.ev, sc.tb);
            return NULL;
        }
        return rc != 0 ? NULL : ddp_py_raise(st, NULL);
    }
    return ddp_py_work_new_ex(pg, work, arrs, n, mem, has_stream, stream);
}

static PyObject *pg_abort(PGObject *self, PyObject *args) {
    const char *reason = "abort() called";
    if (!PyArg_ParseTuple(args, "|s", &reason)) return NULL;
    ddp_comm *c = self->comm;
    ddp_pg cu = self->cuda;
    if (c) ddp_comm_retain(c);
    if (cu.ops) cu.ops->retain(cu.impl);
    Py_BEGIN_ALLOW_THREADS
    if (c) ddp_comm_abort(c, reason);
    if (cu.ops) cu.ops->abort(cu.impl, reason);
    Py_END_ALLOW_THREADS
    if (cu.ops) cu.ops->release(cu.impl);
    ddp_comm_release(c);
    Py_RETURN_NONE;
}

static PyObject *pg_destroy(PGObject *self, PyObject *unused) {
    pg_destroy_all(self, 60000);
    Py_RETURN_NONE;
}

static PyObject *pg_get_rank(PGObject *self, void *c) {
    return self->comm ? PyLong_FromLong(ddp_comm_rank(self->comm)) : ddp_py_raise(DDP_ERR_INVALID, "destroyed");
}
static PyObject *pg_get_size(PGObject *self, void *c) {
    return self->comm ? PyLong_FromLong(ddp_comm_size(self->comm)) : ddp_py_raise(DDP_ERR_INVALID, "destroyed");
}
static PyObject *pg_get_device(PGObject *self, void *c) {
    return PyLong_FromLong(self->cuda.ops ? self->cuda.ops->device(self->cuda.impl) : -1);
}
static PyObject *pg_get_has_cuda(PGObject *self, void *c) {
    return PyBool_FromLong(self->cuda.ops != NULL);
}
static PyObject *pg_get_destroyed(PGObject *self, void *c) {
    return PyBool_FromLong(self->comm == NULL);
}

/* ---- type spec ------------------------------------------------------- */

static PyMethodDef pg_methods[] = {
    {"submit", (PyCFunction)(void (*)(void))pg_submit, METH_VARARGS | METH_KEYWORDS,
     "submit(kind, a=None, b=None, op=0, root=0, timeout_ms=-1, stream=None) -> Work"},
    {"run", (PyCFunction)(void (*)(void))pg_run, METH_FASTCALL,
     "run(kind, a, op, root, timeout_ms[, count, dtype]) -> None: submit and wait (host "
     "memory, single-buffer collectives; NotImplemented for a GPU array)"},
    {"alltoall", (PyCFunction)ddp_py_pg_alltoall, METH_VARARGS,
     "alltoall(input, output, scounts, sdispls, rcounts, rdispls, timeout_ms=-1, stream=None) "
     "-> Work (counts and offsets in elements, one per group rank)"},
    {"p2p_batch", (PyCFunction)ddp_py_pg_p2p_batch, METH_VARARGS,
     "p2p_batch([(is_send, array, peer), ...], timeout_ms=-1, stream=None) -> Work (peers: "
     "group ranks)"},
    {"subgroup", (PyCFunction)pg_subgroup, METH_VARARGS,
     "subgroup(ranks, tag) -> ProcessGroup (member-only, no communication)"},
    {"attach_nccl", (PyCFunction)pg_attach_nccl, METH_VARARGS,
     "attach_nccl(store, prefix, device, timeout_ms, version): collective NCCL set-up"},
    {"set_cuda_factory", (PyCFunction)pg_set_cuda_factory, METH_O,
     "set_cuda_factory(fn): fn() attaches NCCL on first use of a GPU array"},
    {"abort", (PyCFunction)pg_abort, METH_VARARGS, "Break the group now; peers fail fast."},
    {"destroy", (PyCFunction)pg_destroy, METH_NOARGS, "Close all connections."},
    {"peer", (PyCFunction)ddp_py_pg_peer, METH_VARARGS, "peer(rank) -> (description, host_id)"},
    {"flight_record", (PyCFunction)ddp_py_pg_flight_record, METH_NOARGS,
     "flight_record() -> [dict]: the last 64 collectives of this process's communicator"},
    {"pending", (PyCFunction)ddp_py_pg_pending, METH_NOARGS,
     "pending() -> works queued or running on this group's communicator (0 once destroyed)"},
    {"progress", (PyCFunction)ddp_py_pg_progress, METH_NOARGS,
     "progress() -> {submitted, completed, last_done, tag} of this group"},
    {"set_stall_store", (PyCFunction)ddp_py_pg_set_stall_store, METH_VARARGS,
     "set_stall_store(store, prefix): announce a collective timeout there (ddp_comm.h)"},
    {"transport", (PyCFunction)ddp_py_pg_transport, METH_VARARGS,
     "transport(rank) -> 'tcp', 'shm' or 'self': the CPU link to that group rank"},
    {NULL}
};
static PyGetSetDef pg_getset[] = {
    {"rank", (getter)pg_get_rank, NULL, "this rank in the group", NULL},
    {"size", (getter)pg_get_size, NULL, "group size", NULL},
    {"device", (getter)pg_get_device, NULL, "CUDA device of the NCCL transport, -1 if none", NULL},
    {"has_cuda", (getter)pg_get_has_cuda, NULL, "whether NCCL is attached", NULL},
    {"destroyed", (getter)pg_get_destroyed, NULL, "whether destroy() ran", NULL},
    {NULL}
};
static PyType_Slot pg_slots[] = {
    {Py_tp_new, pg_new},
    {Py_tp_dealloc, pg_dealloc},
    {Py_tp_methods, pg_methods},
    {Py_tp_getset, pg_getset},
    {Py_tp_doc, "A process group: the CPU transport, and NCCL for GPU arrays."},
    {0, NULL}
};
static PyType_Spec pg_spec = {"pyddp._C.ProcessGroup", sizeof(PGObject), 0,
                              Py_TPFLAGS_DEFAULT, pg_slots};

int ddp_py_pg_register(PyObject *m) {
    if (ddp_py_array_init() < 0) return -1;
    if (ddp_py_work_register(m) < 0) return -1;
    PGType = (PyTypeObject *)PyType_FromSpec(&pg_spec);
    if (PGType == NULL || PyModule_AddObjectRef(m, "ProcessGroup", (PyObject *)PGType) < 0) return -1;
    struct { const char *n; int v; } consts[] = {
        {"COLL_ALLREDUCE", DDP_COLL_ALLREDUCE}, {"COLL_BROADCAST", DDP_COLL_BROADCAST},
        {"COLL_REDUCE", DDP_COLL_REDUCE}, {"COLL_ALLGATHER", DDP_COLL_ALLGATHER},
        {"COLL_REDUCE_SCATTER", DDP_COLL_REDUCE_SCATTER}, {"COLL_GATHER", DDP_COLL_GATHER},
        {"COLL_SCATTER", DDP_COLL_SCATTER}, {"COLL_SEND", DDP_COLL_SEND},
        {"COLL_RECV", DDP_COLL_RECV}, {"COLL_BARRIER", DDP_COLL_BARRIER},
        {"COLL_ALLTOALL", DDP_COLL_ALLTOALL}, {"COLL_P2P_BATCH", DDP_COLL_P2P_BATCH},
        {"OP_SUM", DDP_SUM}, {"OP_AVG", DDP_AVG}, {"OP_MIN", DDP_MIN}, {"OP_MAX", DDP_MAX},
        {"OP_PRODUCT", DDP_PRODUCT},
        {"DT_FLOAT16", DDP_FLOAT16}, {"DT_BFLOAT16", DDP_BFLOAT16}, {"DT_FLOAT32", DDP_FLOAT32},
        {"DT_FLOAT64", DDP_FLOAT64}, {"DT_INT8", DDP_INT8}, {"DT_UINT8", DDP_UINT8},
        {"DT_INT32", DDP_INT32}, {"DT_INT64", DDP_INT64}, {"DT_BOOL", DDP_BOOL},
    };
    for (size_t i = 0; i < sizeof consts / sizeof consts[0]; i++)
        if (PyModule_AddIntConstant(m, consts[i].n, consts[i].v) < 0) return -1;
    return 0;
}
