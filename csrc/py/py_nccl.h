/* py_nccl.h - declarations shared by the NCCL binding files of csrc/py
 * (py_nccl.c: creating an NCCL communicator for a process group, checking
 * GPU arrays against it; py_nccl_lib.c: the loader). */
#ifndef DDP_PY_NCCL_H
#define DDP_PY_NCCL_H

#include "py_common.h"
#include "ddp_pg.h"
#include "py_array.h"

/* Add nccl_load(), nccl_probe() and nccl_tables() to the module; 0, or -1 with an
 * exception set. Called by ddp_py_nccl_register. */
int ddp_py_nccl_lib_register(PyObject *m);

/* Create an NCCL communicator (collective over the ranks of the group; the
 * unique id travels through store_obj, a pyddp._C.StoreClient, under
 * prefix). Ctrl-C aborts it. On success *out holds the owner's reference;
 * 0, or -1 with an exception set. */
int ddp_py_nccl_create(PyObject *store_obj, int rank, int size, const char *prefix, int device,
                       int64_t timeout_ms, const char *version, ddp_pg *out);

/* Check that an imported GPU array lives on the NCCL communicator's device;
 * 0, or -1 with an exception set (the array is left for the caller). */
int ddp_py_nccl_check_array(ddp_pg nccl, ddp_py_array *arr, const char *name);

#endif
