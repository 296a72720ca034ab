/* py_common.h - shared declarations of the Python binding layer (csrc/py).
 *
 * Only files in csrc/py include Python.h. Each binding file registers its
 * types on the module through a ddp_py_*_register function called from
 * module.c's exec slot. ddp_py_raise is the one place that maps a core
 * ddp_status to a Python exception class (pyddp's own, which subclass the
 * built-ins users catch).
 */
#ifndef DDP_PY_COMMON_H
#define DDP_PY_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "ddp_status.h"

/* Raise the exception class for st with msg (NULL = this thread's
 * ddp_last_error()). Always returns NULL. */
PyObject *ddp_py_raise(ddp_status st, const char *msg);

/* ddp_py_raise for a failed store request: a timeout becomes
 * DistStoreTimeoutError (a DistStoreError and a DistTimeoutError). */
PyObject *ddp_py_raise_store(ddp_status st, const char *msg);

/* Run fn(arg) on a helper thread while the calling thread waits with the GIL
 * released, waking every 100 ms to run Python's signal handlers. If a handler
 * raises (Ctrl-C), sets *abort so fn's waits end, waits for fn to return, and
 * returns -1 with that exception set. Otherwise returns 0 once fn returned.
 * fn must not touch Python. Called with the GIL. */
#include <stdatomic.h>
int ddp_py_run_abortable(void (*fn)(void *), void *arg, atomic_int *abort);

/* The one wait loop of the binding layer: calls slice_fn(ctx, slice) with
 * the GIL released, in slices of at most DDP_WAIT_SLICE_MS, until it returns
 * nonzero (done: 0 is returned) or timeout_ms passes (>= 0; 1 is returned).
 * Between slices Python's signal handlers run; if one raises (Ctrl-C),
 * on_signal(ctx) is called (it must make the wait end soon, e.g. abort the
 * group), the loop waits until slice_fn reports done, and -1 is returned with
 * that exception set. Called with the GIL. */
#include "ddp_clock.h"
int ddp_py_wait(int (*slice_fn)(void *ctx, ddp_wait slice), void *ctx, int64_t timeout_ms,
                void (*on_signal)(void *ctx));

/* Why a wait interrupted by a signal handler's exception aborts its group. */
#define DDP_PY_SIGNAL_ABORT "interrupted by a signal (Ctrl-C) while waiting"

/* Running Python's signal handlers from inside a C call that released the
 * GIL (a check hook: ddp_pg_interrupt, ddp_wait.check): ts is the thread
 * state PyEval_SaveThread returned; ddp_py_check_signals takes the GIL back
 * for a moment, runs the handlers, keeps a raised exception in et/ev/tb (for
 * the caller to PyErr_Restore once it holds the GIL again) and returns
 * nonzero from then on. Threads other than the main thread see no signals. */
typedef struct {
    PyThreadState *ts;
    PyObject *et, *ev, *tb;
} ddp_py_sig_check;
int ddp_py_check_signals(void *sig_check);

/* The inline fast path of a blocking small collective through pg's
 * run_inline op (ddp_pg.h; the CPU communicator has one, NCCL none): runs it
 * on this thread with the GIL released when the transport takes it, Python's
 * signal handlers asked every 100 ms while it waits for peers; a handler's
 * exception (Ctrl-C) aborts the group as ddp_py_wait does, and is raised once
 * the run returned. 0 done, -1 with an exception set (the collective's error
 * or the handler's), 1 not taken (nothing happened: queue it). Called with
 * the GIL; the arrays of a must stay valid for the call. */
#include "ddp_coll.h"
#include "ddp_pg.h"
int ddp_py_run_inline(ddp_pg pg, const ddp_coll_args *a, int64_t timeout_ms);

/* The CPU transport behind a pyddp._C.ProcessGroup into *out, with a
 * reference the caller drops with out->ops->release; 0, or -1 with an
 * exception set when obj is not a ProcessGroup or was destroyed. */
int ddp_py_pg_cpu_ref(PyObject *pg, ddp_pg *out);

/* The C client behind a pyddp._C.StoreClient with a reference of the caller's
 * own (give it back with ddp_store_release, with or without the GIL), or NULL
 * with TypeError (or an error saying it is not connected) set. The reference
 * keeps the memory valid without the GIL even if the StoreClient is closed or
 * freed meanwhile; after a close, requests on it fail promptly with "closed".
 * Any other object with the StoreClient's methods (the etcd-backed client) is
 * wrapped as a core store whose calls are its methods (ddp_py_store_wrap). */
struct ddp_store *ddp_py_store_client_ref(PyObject *obj);

/* A new core store (one reference) whose calls are obj's methods, taking the
 * GIL for each (py_store_py.c); NULL with TypeError when obj lacks one. */
struct ddp_store *ddp_py_store_wrap(PyObject *obj);

/* The CPU reducer's ready() for a gradient given by address: parameter i's
 * `count` contiguous host elements of ddp_dtype `dtype` at ptr, owned by
 * `owner` (kept alive until the iteration ends when the average is copied
 * back into it, copy_back). None, or NULL with an exception. Used by
 * Reducer.ready and by the DDP gradient hooks (py_grad_hooks.c). */
PyObject *ddp_py_reducer_ready(PyObject *reducer, size_t i, PyObject *owner, void *ptr,
                               size_t count, int dtype, int copy_back);

/* The one C test for a contiguous torch tensor (py_torch_thin.c; for the
 * CPU the same test as pyddp/_arrays.py's torch_cpu_code): t is exactly
 * tensor_type, its dtype a key of dtypes (torch dtype -> DT_* code), is_cpu
 * (cuda 0) or is_cuda (cuda 1), layout strided, contiguous. 1 with its
 * address, element count and dtype code filled; 0 if not (or
 * tensor_type/dtypes NULL); -1 with an exception. The CPU form is used by
 * the DDP gradient hooks and by ProcessGroup.torch_run, the CUDA one by
 * py_torch_cuda.c. */
int ddp_py_torch_tensor(PyObject *tensor_type, PyObject *strided, PyObject *dtypes,
                        PyObject *t, int cuda, void **ptr, size_t *count, int *code);
int ddp_py_torch_cpu_tensor(PyObject *tensor_type, PyObject *strided, PyObject *dtypes,
                            PyObject *t, void **ptr, size_t *count, int *code);

/* Module exec hooks (return 0 on success, -1 with an exception set). */
int ddp_py_errors_register(PyObject *m);
int ddp_py_store_register(PyObject *m);
int ddp_py_store_server_register(PyObject *m);
int ddp_py_pg_register(PyObject *m);
int ddp_py_net_register(PyObject *m);
int ddp_py_reducer_register(PyObject *m);
int ddp_py_grad_hooks_register(PyObject *m);
int ddp_py_nccl_register(PyObject *m);
int ddp_py_work_register(PyObject *m);
int ddp_py_settings_register(PyObject *m);
int ddp_py_torch_thin_register(PyObject *m);
int ddp_py_torch_cuda_register(PyObject *m);

#endif
