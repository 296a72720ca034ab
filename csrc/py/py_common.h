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

/* Module exec hooks (return 0 on success, -1 with an exception set). */
int ddp_py_errors_register(PyObject *m);
int ddp_py_store_register(PyObject *m);
int ddp_py_pg_register(PyObject *m);
int ddp_py_reducer_register(PyObject *m);

#endif
