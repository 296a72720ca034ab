/* py_array.h - turning any Python array object into a raw buffer.
 *
 * One place that accepts NumPy arrays (NumPy C API), objects with
 * __dlpack__ (torch tensors, CuPy, JAX; versioned and unversioned
 * capsules), objects with __cuda_array_interface__, and the buffer
 * protocol. The result says where the data lives (CPU or CUDA device),
 * its dtype and element count, and holds whatever reference keeps the
 * memory alive until ddp_py_array_release. Must be called with the GIL.
 */
#ifndef DDP_PY_ARRAY_H
#define DDP_PY_ARRAY_H

#include "py_common.h"
#include "ddp_dtype.h"

enum { DDP_DEV_CPU = 0, DDP_DEV_CUDA = 1 };

typedef struct ddp_py_array {
    void *ptr;
    size_t count;          /* elements */
    ddp_dtype dtype;
    int device;            /* DDP_DEV_CPU or DDP_DEV_CUDA */
    int device_id;
    /* keep-alive state (private) */
    PyObject *owner;       /* the object itself */
    PyObject *capsule;     /* DLPack capsule we consumed, or NULL */
    void *dl_managed;      /* DLManagedTensor[Versioned] to delete, or NULL */
    int dl_versioned;
    Py_buffer view;
    int has_view;
} ddp_py_array;

/* Fill *out from obj. obj may also be an (owner, address, count, dtype code)
 * tuple: host memory by address, kept alive by owner (pyddp's own layer passes
 * CPU torch tensors so, without a DLPack capsule). writable: the operation
 * writes into the array (read-only arrays are rejected). argname names the argument in messages. Rejects, with
 * DistTypeError/DistValueError and nothing held: lists and scalars, object or
 * other unsupported dtypes, non-contiguous layouts. Returns 0 or -1. */
int ddp_py_array_import(PyObject *obj, int writable, const char *argname,
                        ddp_py_array *out);

/* The same, passing stream= to __dlpack__ (for CUDA producers); NULL = none. */
int ddp_py_array_import_stream(PyObject *obj, int writable, const char *argname,
                               PyObject *stream, ddp_py_array *out);

/* Release what ddp_py_array_import took. Safe on a zeroed struct. */
void ddp_py_array_release(ddp_py_array *a);

/* Release arrs[0..n) (zeroed entries are fine) and free the PyMem block
 * arrs itself; NULL is a no-op. */
void ddp_py_arrays_free(ddp_py_array *arrs, size_t n);

/* Fill a collective's core arguments from its imported arrays a (input) and
 * b (output) by kind (ddp_coll.h's conventions), checking that they are
 * present where required and that sizes and dtypes agree; -1 with
 * DistValueError otherwise. Defined in py_pg_args.c. */
struct ddp_coll_args;
int ddp_py_coll_args_fill(int kind, int size, int rank, int root, ddp_py_array *a,
                          ddp_py_array *b, struct ddp_coll_args *ca);

/* Called once from module init (imports the NumPy C API). */
int ddp_py_array_init(void);

#endif
