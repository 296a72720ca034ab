/* py_work.h - pyddp._C.Work: the one handle type for a collective in flight,
 * whatever transport runs it (ddp_pg.h), and its completion callbacks.
 */
#ifndef DDP_PY_WORK_H
#define DDP_PY_WORK_H

#include "py_common.h"
#include "ddp_pg.h"
#include "py_array.h"

/* A Work for a just-submitted core work. Takes over: the caller's reference
 * on work, the arrays a and b (zeroed in the caller), and a new reference on
 * pg's communicator (taken here). has_stream/stream: the caller's CUDA stream
 * to publish results on after the wait. NULL with an exception set (the
 * work then waited for and released, the arrays released). */
PyObject *ddp_py_work_new(ddp_pg pg, ddp_pg_work work, ddp_py_array *a, ddp_py_array *b,
                          int has_stream, uintptr_t stream);

/* The same for any number of arrays: takes over arrs[0..narrs) and the
 * PyMem blocks arrs and mem (argument memory the transport reads, e.g.
 * all_to_all counts; may be NULL), freed once the transport is done. */
PyObject *ddp_py_work_new_ex(ddp_pg pg, ddp_pg_work work, ddp_py_array *arrs, int narrs,
                             void *mem, int has_stream, uintptr_t stream);

/* Wait for a just-submitted CPU work without a Work object (GIL held on
 * entry; released while waiting; Ctrl-C as in Work.wait). Takes over the
 * reference on work. 0, or -1 with an exception set. */
int ddp_py_work_run(ddp_pg pg, ddp_pg_work work);

/* For ddp_pg_opts.notify: wakes the completion thread (no Python, no lock
 * held by the caller, never blocks for long). ctx is ignored. */
void ddp_py_work_notify(void *ctx);

#endif
