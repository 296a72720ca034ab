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

/* The one submit path: c on pg. Takes over everything c holds in every
 * case. GPU arrays are checked against the device, c filled (c->fill), then
 * blocking (run()): inline where the transport takes it (ddp_py_run_inline),
 * else submitted and waited for here; None, or NULL with an exception.
 * Otherwise submitted (an NCCL launch with the GIL released and Ctrl-C
 * watched) and returned as a pyddp._C.Work, or NULL with an exception. */
PyObject *ddp_py_pg_call(ddp_pg pg, ddp_py_call *c, int blocking);

/* submit's tail: import a and b (None: absent) into c, whose core kind, op,
 * root, timeout and stream are set, route it and submit it; the
 * pyddp._C.Work, or NULL with an exception (c released in every case). */
PyObject *ddp_py_pg_submit_call(PGObject *self, ddp_py_call *c, PyObject *a, PyObject *b);

/* The methods submit(...) and run(...) (signatures in py_pg.c's header). */
PyObject *ddp_py_pg_submit(PGObject *self, PyObject *args, PyObject *kw);
PyObject *ddp_py_pg_run(PGObject *self, PyObject *const *args, Py_ssize_t nargs);

/* ---- py_torch_thin.c ---- */

/* torch_run(kind, tensors, opts, timeout_ms) -> None once a blocking call of
 * torch's (opts.asyncOp False) on one contiguous CPU torch tensor (tensors, a
 * list of one; None for BARRIER) has run through run(); for an asynchronous
 * one (opts.asyncOp True) the pyddp._C.Work of its submission, the tensor
 * held by the Work until the transport is done with it; NotImplemented, with
 * nothing sent, for anything the torch backend's Python path must handle;
 * NULL with an exception (a collective's failure as run() raises it, or a
 * refused submission as submit() raises it). The op comes from
 * opts.reduceOp (ALLREDUCE, REDUCE), the group root from opts.rootRank
 * (BROADCAST, REDUCE). */
PyObject *ddp_py_pg_torch_run(PGObject *self, PyObject *const *args, Py_ssize_t nargs);

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
