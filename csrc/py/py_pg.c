/* py_pg.c - pyddp._C.ProcessGroup: the one process group of the Python
 * layer, whatever transports are behind it. It always has the CPU
 * communicator (TCP and shared memory, csrc/core/ddp_comm.h) and may have an
 * NCCL one; each call is routed by where its arrays live: host arrays to the
 * CPU transport, GPU arrays to NCCL, which is created on first use by the
 * Python factory set with set_cuda_factory (or attached at init for
 * backend="nccl"). Both are held and driven as ddp_pg (ddp_pg.h), the one
 * door to a transport; this file, which makes the CPU communicator, is the
 * only one of csrc/py that includes ddp_comm.h. Handles are pyddp._C.Work
 * (py_work.c); the one submit path is py_pg_submit.c, the arguments of a
 * call py_pg_args.c.
 *
 * ProcessGroup(store, rank, size, prefix, advertise_host, bind_host, port_lo,
 *              port_hi, timeout_ms, version, host_id, agree_round=False)
 *   rendezvous (collective; Ctrl-C aborts it); store is held (a reference on
 *   its C client) for the whole rendezvous, so closing it meanwhile is safe.
 *   agree_round: prefix is the start's base, and the ranks agree on a round in
 *   the rendezvous (a store that outlives the workers); .prefix is the
 *   group's key prefix, round included.
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
 *   memory, single-buffer kinds: submit + wait without a Work (ddp_py_pg_run)
 * torch_run(kind, tensors, opts, timeout_ms) -> None, Work or NotImplemented
 *   torch's call on one CPU tensor: a blocking one through run(), an
 *   asynchronous one submitted (py_torch_thin.c)
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

int ddp_py_pg_cpu_ref(PyObject *pg, ddp_pg *out) {
    PGObject *p = as_pg(pg);
    if (p == NULL) return -1;
    if (p->cpu.ops == NULL) {
        ddp_py_raise(DDP_ERR_INVALID, "the process group was destroyed");
        return -1;
    }
    p->cpu.ops->retain(p->cpu.impl);
    *out = p->cpu;
    return 0;
}

/* The CPU communicator behind self (NULL once destroyed): only for what the
 * ddp_pg table does not offer because it is the CPU communicator's alone
 * (subgroups: views over its links). */
static ddp_comm *cpu_comm(PGObject *self) { return self->cpu.ops ? self->cpu.impl : NULL; }

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
                             "host_id", "agree_round", NULL};
    PyObject *store_obj;
    create_job j;
    memset(&j, 0, sizeof j);
    long long timeout_ms;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OiisssiiLss|p", kwlist, &store_obj,
                                     &j.cfg.rank, &j.cfg.size, &j.cfg.prefix,
                                     &j.cfg.advertise_host, &j.cfg.bind_host,
                                     &j.cfg.port_lo, &j.cfg.port_hi, &timeout_ms,
                                     &j.cfg.version, &j.cfg.host_id, &j.cfg.agree_round))
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
    self->cpu = ddp_comm_pg(j.comm);
    return (PyObject *)self;
}

static PyObject *pg_subgroup(PGObject *self, PyObject *args) {
    PyObject *ranks;
    unsigned long long tag;
    int algo = -1;
    if (!PyArg_ParseTuple(args, "OK|i", &ranks, &tag, &algo)) return NULL;
    if (algo < -1 || algo > DDP_ALGO_BLOCK)
        return ddp_py_raise(DDP_ERR_INVALID, "algo must be -1 (PYDDP_ALGO) or 0..3");
    if (cpu_comm(self) == NULL)
        return ddp_py_raise(DDP_ERR_INVALID, "the process group was destroyed");
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
    ddp_status st = ddp_comm_subgroup(cpu_comm(self), (int)n, rk, (uint64_t)tag, &sub);
    PyMem_Free(rk);
    if (st != DDP_OK) return ddp_py_raise(st, NULL);
    if (algo >= 0) ddp_comm_set_algo(sub, algo);
    PGObject *g = (PGObject *)PGType->tp_alloc(PGType, 0);
    if (g == NULL) {
        ddp_comm_destroy(sub);
        return NULL;
    }
    g->cpu = ddp_comm_pg(sub);
    return (PyObject *)g;
}

static PyObject *pg_attach_nccl(PGObject *self, PyObject *args) {
    PyObject *store_obj;
    const char *prefix, *version;
    int device;
    long long timeout_ms;
    if (!PyArg_ParseTuple(args, "OsiLs", &store_obj, &prefix, &device, &timeout_ms, &version))
        return NULL;
    ddp_pg cpu = self->cpu;
    if (cpu.ops == NULL) return ddp_py_raise(DDP_ERR_INVALID, "the process group was destroyed");
    if (self->cuda.ops) return ddp_py_raise(DDP_ERR_INVALID, "NCCL is already attached");
    ddp_pg nccl;
    if (ddp_py_nccl_create(store_obj, cpu.ops->rank(cpu.impl), cpu.ops->size(cpu.impl),
                           prefix, device, timeout_ms, version, &nccl) < 0)
        return NULL;
    if (self->cpu.ops == NULL || self->cuda.ops) {   /* destroyed or attached meanwhile */
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

/* End both transports through their tables (GIL released), each destroy
 * bounded by ms (the CPU communicator's bounds itself by its deadlines);
 * safe to call twice. */
static void pg_destroy_all(PGObject *self, int64_t ms) {
    ddp_pg c = self->cpu, cu = self->cuda;
    memset(&self->cpu, 0, sizeof self->cpu);
    memset(&self->cuda, 0, sizeof self->cuda);
    Py_BEGIN_ALLOW_THREADS
    if (cu.ops) cu.ops->destroy(cu.impl, ddp_wait_for(ms, NULL));
    if (c.ops) c.ops->destroy(c.impl, ddp_wait_for(ms, NULL));
    Py_END_ALLOW_THREADS
}

static void pg_dealloc(PGObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    pg_destroy_all(self, 10000);
    Py_XDECREF(self->cuda_factory);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *pg_abort(PGObject *self, PyObject *args) {
    const char *reason = "abort() called";
    if (!PyArg_ParseTuple(args, "|s", &reason)) return NULL;
    ddp_pg both[2] = {self->cpu, self->cuda};
    for (int i = 0; i < 2; i++)
        if (both[i].ops) both[i].ops->retain(both[i].impl);
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < 2; i++)
        if (both[i].ops) both[i].ops->abort(both[i].impl, reason);
    Py_END_ALLOW_THREADS
    for (int i = 0; i < 2; i++)
        if (both[i].ops) both[i].ops->release(both[i].impl);
    Py_RETURN_NONE;
}

static PyObject *pg_destroy(PGObject *self, PyObject *unused) {
    pg_destroy_all(self, 60000);
    Py_RETURN_NONE;
}

static PyObject *pg_get_prefix(PGObject *self, void *closure) {
    (void)closure;
    ddp_comm *c = cpu_comm(self);
    if (c == NULL) Py_RETURN_NONE;
    return PyUnicode_FromString(ddp_comm_prefix(c));
}

static PyObject *pg_get_rank(PGObject *self, void *c) {
    ddp_pg pg = self->cpu;
    return pg.ops ? PyLong_FromLong(pg.ops->rank(pg.impl)) : ddp_py_raise(DDP_ERR_INVALID, "destroyed");
}
static PyObject *pg_get_size(PGObject *self, void *c) {
    ddp_pg pg = self->cpu;
    return pg.ops ? PyLong_FromLong(pg.ops->size(pg.impl)) : ddp_py_raise(DDP_ERR_INVALID, "destroyed");
}
static PyObject *pg_get_device(PGObject *self, void *c) {
    return PyLong_FromLong(self->cuda.ops ? self->cuda.ops->device(self->cuda.impl) : -1);
}
static PyObject *pg_get_has_cuda(PGObject *self, void *c) {
    return PyBool_FromLong(self->cuda.ops != NULL);
}
static PyObject *pg_get_destroyed(PGObject *self, void *c) {
    return PyBool_FromLong(self->cpu.ops == NULL);
}

/* ---- type spec ------------------------------------------------------- */

static PyMethodDef pg_methods[] = {
    {"submit", (PyCFunction)(void (*)(void))ddp_py_pg_submit, METH_VARARGS | METH_KEYWORDS,
     "submit(kind, a=None, b=None, op=0, root=0, timeout_ms=-1, stream=None) -> Work"},
    {"run", (PyCFunction)(void (*)(void))ddp_py_pg_run, METH_FASTCALL,
     "run(kind, a, op, root, timeout_ms[, count, dtype]) -> None: submit and wait (host "
     "memory, single-buffer collectives; NotImplemented for a GPU array)"},
    {"run_async", (PyCFunction)(void (*)(void))ddp_py_pg_run_async, METH_FASTCALL,
     "run_async(kind, a, op, root, timeout_ms) -> Work: a single-buffer collective on one "
     "CUDA torch tensor, submitted (NotImplemented: take the general path)"},
    {"torch_run", (PyCFunction)(void (*)(void))ddp_py_pg_torch_run, METH_FASTCALL,
     "torch_run(kind, tensors, opts, timeout_ms) -> None or Work: torch's call on one CPU "
     "tensor, a blocking one run to the end, an asynchronous one submitted "
     "(NotImplemented: take the Python path)"},
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
    {"wait_used", (PyCFunction)ddp_py_pg_wait_used, METH_VARARGS,
     "wait_used(timeout_ms) -> bool: True once the communicator ran or queued its first "
     "collective (any group over it), broke or was destroyed; False at the timeout"},
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
    {"prefix", (getter)pg_get_prefix, NULL, "the group's store key prefix (the agreed "
     "round's); None once destroyed", NULL},
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
        {"ANY_SOURCE", DDP_ANY_SOURCE},
        {"OP_SUM", DDP_SUM}, {"OP_AVG", DDP_AVG}, {"OP_MIN", DDP_MIN}, {"OP_MAX", DDP_MAX},
        {"OP_PRODUCT", DDP_PRODUCT},
        {"DT_FLOAT16", DDP_FLOAT16}, {"DT_BFLOAT16", DDP_BFLOAT16}, {"DT_FLOAT32", DDP_FLOAT32},
        {"DT_FLOAT64", DDP_FLOAT64}, {"DT_INT8", DDP_INT8}, {"DT_UINT8", DDP_UINT8},
        {"DT_INT32", DDP_INT32}, {"DT_INT64", DDP_INT64}, {"DT_BOOL", DDP_BOOL},
    };
    for (size_t i = 0; i < sizeof consts / sizeof consts[0]; i++)
        if (PyModule_AddIntConstant(m, consts[i].n, consts[i].v) < 0) return -1;
    return PyModule_AddIntConstant(m, "WIRE_VERSION", DDP_WIRE_VERSION);
}
