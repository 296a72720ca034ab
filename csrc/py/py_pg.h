/* py_pg.h - what the files of pyddp._C.ProcessGroup share: the object
 * (py_pg.c: the type, creation, subgroups, abort and destroy), the one
 * submit path (py_pg_submit.c: routing, submit and run), the arguments of a
 * call (py_pg_args.c: parsing, array import, the core arguments), the
 * per-peer calls (py_pg_vec.c) and the introspection methods (py_pg_info.c).
 * Both transports are held as ddp_pg (ddp_pg.h), the one door to them; only
 * py_pg.c, which makes the CPU communicator, knows what is behind it. Every
 * function here needs the GIL.
 */
#ifndef DDP_PY_PG_H
#define DDP_PY_PG_H

#include "py_common.h"
#include "ddp_pg.h"
#include "py_array.h"

typedef struct {
    PyObject_HEAD
    ddp_pg cpu;            /* CPU transport (TCP, shared memory); ops NULL once destroyed */
    ddp_pg cuda;           /* NCCL transport; ops NULL until attached */
    PyObject *cuda_factory;
} PGObject;

/* One call on its way to a transport: the core arguments and what they
 * point into. A one- or two-buffer call (submit, run) holds its arrays in
 * two[] (input, output; unused ones zeroed); a per-peer call (alltoall,
 * p2p_batch) in arrs[0..narrs), a PyMem block, with the argument memory the
 * transport reads (counts, the op list) in mem. */
typedef struct ddp_py_call {
    ddp_coll_args ca;
    ddp_py_array two[2];
    ddp_py_array *arrs;
    int narrs;
    void *mem;
    int fill;              /* 1: fill ca from two[] by ca.kind, ca.root (after routing) */
    int on_gpu;            /* the arrays are GPU memory: routed to NCCL, checked there */
    int has_stream;        /* the caller's CUDA stream (GPU arrays) */
    uintptr_t stream;
    long long timeout_ms;
} ddp_py_call;

/* ---- py_pg_args.c ---- */

/* Raise DistValueError with a formatted message; returns -1. */
int ddp_py_bad(const char *fmt, ...);

/* Parse an optional stream argument (None or an int cudaStream_t). */
int ddp_py_stream_arg(PyObject *so, int *has, uintptr_t *stream);

/* submit's arrays: import a (input) and b (output; None for either: absent)
 * into c->two, passing the caller's stream to __dlpack__ when c->has_stream;
 * *on_gpu says whether they are GPU memory (mixing is refused). Sets c->fill.
 * 0, or -1 with an exception set and nothing held. */
int ddp_py_call_import(ddp_py_call *c, PyObject *a, PyObject *b, int kind, int *on_gpu);

/* run()'s buffer (args[1], with args[5..6] = count, dtype when nargs == 7):
 * into c (kind, op and root already in c->ca). 0; 1 for a GPU array
 * (nothing held: run() answers NotImplemented); -1 with an exception set. */
int ddp_py_call_run_buffer(ddp_py_call *c, PyObject *const *args, Py_ssize_t nargs);

/* Let go of everything c holds (arrays, PyMem blocks); safe twice. */
void ddp_py_call_release(ddp_py_call *c);

/* ---- py_pg_submit.c ---- */

/* The transport for a call whose arrays are on_gpu (attaching NCCL through
 * the factory on first use); 0 with *out set, or -1 with an exception (the
 * group destroyed, no GPU transport). */
int ddp_py_pg_route(PGObject *self, int on_gpu, ddp_pg *out);

/* How ddp_py_pg_call ends a call. */
typedef enum ddp_py_mode {
    DDP_PY_SUBMIT = 0,   /* submit it and return its pyddp._C.Work */
    DDP_PY_RUN = 1,      /* run it to the end (inline where the transport takes it, else
                          * queued and waited for; a GPU call's results are then
                          * published on c->stream) and return None */
    DDP_PY_ENQUEUE = 2,  /* GPU only: queue it, order c->stream after it at once (no
                          * host wait), let the completion thread watch it, return None */
    DDP_PY_WATCH = 3,    /* GPU only: queue it and return its Work, already watched by
                          * the completion thread and publishing nothing when it ends
                          * (its caller publishes: Work.publish) */
} ddp_py_mode;

/* The one submit path: c on pg, ended as mode says. Takes over everything c
 * holds in every case. GPU arrays are checked against the device and c
 * filled (c->fill) before anything is queued; the launch on a transport
 * that may block (NCCL) runs with the GIL released and Ctrl-C watched. The
 * Work (DDP_PY_SUBMIT, DDP_PY_WATCH), None, or NULL with an exception. A
 * watched work's failure is the completion thread's to find: it breaks the
 * transport (NCCL aborts the communicator at the work's deadline), so the
 * next call fails with the reason. */
PyObject *ddp_py_pg_call(ddp_pg pg, ddp_py_call *c, ddp_py_mode mode);

/* submit's tail: import a and b (None: absent) into c, whose core kind, op,
 * root, timeout and stream are set, route it and submit it; the
 * pyddp._C.Work, or NULL with an exception (c released in every case). */
PyObject *ddp_py_pg_submit_call(PGObject *self, ddp_py_call *c, PyObject *a, PyObject *b);

/* The methods submit(...) and run(...) (signatures in py_pg.c's header). */
PyObject *ddp_py_pg_submit(PGObject *self, PyObject *args, PyObject *kw);
PyObject *ddp_py_pg_run(PGObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *ddp_py_pg_run_async(PGObject *self, PyObject *const *args, Py_ssize_t nargs);

/* ---- py_torch_thin.c ---- */

/* torch_run(kind, tensors, opts, timeout_ms[, work_type]) -> None once a
 * blocking call of torch's (opts.asyncOp False) on one contiguous CPU torch
 * tensor (tensors, a list of one; None for BARRIER) has run through run(),
 * or on one CUDA tensor (py_torch_cuda.c) has been queued with the caller's
 * stream ordered after it; for an asynchronous one (opts.asyncOp True) on a
 * CPU tensor the pyddp._C.Work of its submission, the tensor held by the
 * Work until the transport is done with it, and on a CUDA tensor a new
 * work_type() holding that Work (NotImplemented without work_type);
 * NotImplemented, with nothing sent, for anything the torch backend's
 * Python path must handle; NULL with an exception (a collective's failure
 * as run() raises it, or a refused submission as submit() raises it). The
 * op comes from opts.reduceOp (ALLREDUCE, REDUCE), the group root from
 * opts.rootRank (BROADCAST, REDUCE). */
PyObject *ddp_py_pg_torch_run(PGObject *self, PyObject *const *args, Py_ssize_t nargs);

/* ---- py_torch_cuda.c ---- */

/* Read t into c when it is a non-empty contiguous CUDA tensor of the class
 * _C.torch_cuda_config named, of a dtype the core has: its address, count,
 * dtype and device (c->two[0], holding t), and the caller's current stream
 * on that device (c->has_stream, c->stream); c's kind, op, root and timeout
 * are the caller's. 1; 0 when it is not such a tensor (nothing held); -1
 * with an exception set. */
int ddp_py_torch_cuda_read(PyObject *t, ddp_py_call *c);
/* Whether t is of the torch tensor class the lean path was configured with
 * (torch_cuda_config): a tensor ddp_py_torch_cuda_read did not take (on the
 * CPU, empty, non-contiguous, an unusual dtype) then belongs to the caller's
 * general path. */
int ddp_py_torch_cuda_class(PyObject *t);

/* Route c, read by ddp_py_torch_cuda_read, to the group's NCCL transport
 * (attached on first use) and end it as mode says (ddp_py_pg_call). Takes
 * over what c holds. */
PyObject *ddp_py_torch_cuda_call(PGObject *self, ddp_py_call *c, ddp_py_mode mode);

/* torch's asynchronous call: work_type() (a torch Work class) with its _cw
 * set to the watched pyddp._C.Work of c (DDP_PY_WATCH) and its _result to
 * tensors; NULL with an exception. Takes over what c holds. */
PyObject *ddp_py_torch_cuda_work(PGObject *self, ddp_py_call *c, PyObject *work_type,
                                 PyObject *tensors);

/* ---- py_pg_vec.c ---- */
PyObject *ddp_py_pg_alltoall(PGObject *self, PyObject *args);
PyObject *ddp_py_pg_p2p_batch(PGObject *self, PyObject *args);

/* ---- py_pg_info.c ---- */
PyObject *ddp_py_pg_peer(PGObject *self, PyObject *args);
PyObject *ddp_py_pg_transport(PGObject *self, PyObject *args);
PyObject *ddp_py_pg_flight_record(PGObject *self, PyObject *unused);
PyObject *ddp_py_pg_progress(PGObject *self, PyObject *unused);
/* wait_used(timeout_ms) -> bool: True once the group's communicator ran or queued
 * its first collective, broke or was destroyed; False at the timeout (GIL released). */
PyObject *ddp_py_pg_wait_used(PGObject *self, PyObject *args);
PyObject *ddp_py_pg_pending(PGObject *self, PyObject *unused);
PyObject *ddp_py_pg_set_stall_store(PGObject *self, PyObject *args);

#endif
