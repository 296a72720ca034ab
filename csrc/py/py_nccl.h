/* py_nccl.h - declarations shared by the NCCL binding files of csrc/py
 * (py_nccl.c: the process group and works; py_nccl_lib.c: the loader). */
#ifndef DDP_PY_NCCL_H
#define DDP_PY_NCCL_H

#include "py_common.h"

/* Add nccl_load() and nccl_tables() to the module; 0, or -1 with an
 * exception set. Called by ddp_py_nccl_register. */
int ddp_py_nccl_lib_register(PyObject *m);

#endif
