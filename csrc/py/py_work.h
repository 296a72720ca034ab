/* py_work.h - pyddp._C.Work (py_work.c): the one handle type for a
 * collective in flight, whatever transport runs it (ddp_pg.h), and the
 * completion thread (py_completion.c) that finishes the Works queued on it
 * and runs their callbacks.
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

/* Wait for a just-submitted work without a Work object (GIL held on entry;
 * released while waiting; Ctrl-C as in Work.wait), then, when has_stream,
 * publish a GPU work's results on stream. Takes over the reference on work.
 * 0, or -1 with an exception set. */
int ddp_py_work_run(ddp_pg pg, ddp_pg_work work, int has_stream, uintptr_t stream);

/* Hand a just-made Work to the completion thread, which polls it until it
 * finishes (for NCCL, enforcing its deadline) and then finishes it (status
 * recorded, arrays let go); it holds a reference until then, so the caller
 * may drop its own at once. 0, or -1 with an exception set. */
int ddp_py_work_watch(PyObject *w);

/* ---- between py_work.c and py_completion.c (GIL held) ---- */

/* w's transport (its impl) and whether w is still pending on a transport
 * that cannot notify (it must be polled). Never blocks. */
void ddp_py_work_kind(PyObject *w, void **impl, int *polled);
/* Poll w once: nonzero once it finished. */
int ddp_py_work_done(PyObject *w);
/* A finished w, let go of by the completion thread: record its outcome,
 * release its arrays, run its callbacks. */
void ddp_py_work_complete(PyObject *w);
/* Queue w on the completion thread (started on first use), which holds a
 * reference until w is done. done: w is already done; polled: w must be
 * polled. Wakes the thread when it would otherwise come late. 0, or -1 with
 * an exception set. */
int ddp_py_completion_add(PyObject *w, int done, int polled);
/* Add completion_park() to the module. */
int ddp_py_completion_register(PyObject *m);

/* For ddp_pg_opts.notify: wakes the completion thread (no Python, no lock
 * held by the caller, never blocks for long). ctx is ignored. */
void ddp_py_work_notify(void *ctx);

#endif
