/* py_pg.h - what the files of pyddp._C.ProcessGroup share: the object
 * (py_pg.c: the type, creation, routing, submit), the per-peer calls
 * (py_pg_vec.c) and the introspection methods (py_pg_info.c). Every function
 * here needs the GIL.
 */
#ifndef DDP_PY_PG_H
#define DDP_PY_PG_H

#include "py_common.h"
#include "ddp_comm.h"
#include "ddp_pg.h"
#include "py_array.h"

typedef struct {
    PyObject_HEAD
    ddp_comm *comm;        /* CPU transport; NULL once destroyed */
    ddp_pg cuda;           /* NCCL transport; ops NULL until attached */
    PyObject *cuda_factory;
} PGObject;

/* Raise DistValueError with a formatted message; returns -1. */
int ddp_py_bad(const char *fmt, ...);

/* The transport for a call whose arrays are on_gpu (attaching NCCL through
 * the factory on first use); 0 with *out set, or -1 with an exception. */
int ddp_py_pg_route(PGObject *self, int on_gpu, ddp_pg *out);

/* Parse an optional stream argument (None or an int cudaStream_t). */
int ddp_py_stream_arg(PyObject *so, int *has, uintptr_t *stream);

/* Queue prepared core arguments on pg (GIL released with Ctrl-C watched
 * when the transport may block) and return the Work; takes over arrs[0..n)
 * and mem in every case. */
PyObject *ddp_py_pg_submit_prepared(PGObject *self, ddp_pg pg, ddp_coll_args *ca,
                                    long long timeout_ms, int has_stream, uintptr_t stream,
                                    ddp_py_array *arrs, int n, void *mem);

/* py_pg_vec.c */
PyObject *ddp_py_pg_alltoall(PGObject *self, PyObject *args);
PyObject *ddp_py_pg_p2p_batch(PGObject *self, PyObject *args);

/* py_pg_info.c */
PyObject *ddp_py_pg_peer(PGObject *self, PyObject *args);
PyObject *ddp_py_pg_transport(PGObject *self, PyObject *args);
PyObject *ddp_py_pg_flight_record(PGObject *self, PyObject *unused);
PyObject *ddp_py_pg_progress(PGObject *self, PyObject *unused);
PyObject *ddp_py_pg_pending(PGObject *self, PyObject *unused);
PyObject *ddp_py_pg_set_stall_store(PGObject *self, PyObject *args);

#endif
