/* py_pg_args.c - the arguments of a pyddp._C.ProcessGroup call, from Python
 * objects to a ddp_py_call (py_pg.h): the optional stream, the arrays of
 * submit (imported with the caller's stream for DLPack producers) and of
 * run (an array, or an address with a count and dtype), and the core
 * arguments filled from them by kind (ddp_py_coll_args_fill, whose sizes and
 * dtypes follow ddp_coll.h's conventions). Nothing here talks to a
 * transport: the call then goes through the one submit path
 * (py_pg_submit.c), where the transport validates what it is given.
 */
#include "py_common.h"

#include <stdarg.h>
#include <string.h>
#include "py_array.h"
#include "py_pg.h"

int ddp_py_bad(const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    PyOS_vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    ddp_py_raise(DDP_ERR_INVALID, msg);
    return -1;
}

/* The optional `stream` argument: 0 with *has = 0 for None, else its value. */
int ddp_py_stream_arg(PyObject *so, int *has, uintptr_t *stream) {
    *has = so != NULL && so != Py_None;
    *stream = 0;
    if (!*has) return 0;
    *stream = (uintptr_t)PyLong_AsUnsignedLongLong(so);
    return PyErr_Occurred() ? -1 : 0;
}

/* Fill the core arguments from the imported arrays, checking that sizes and
 * dtypes agree with the kind's conventions (ddp_coll.h). Declared in
 * py_array.h. */
int ddp_py_coll_args_fill(int kind, int size, int rank, int root, ddp_py_array *a,
                          ddp_py_array *b, ddp_coll_args *ca) {
    const char *nm = ddp_coll_name((ddp_coll_kind)kind);
    int need_a = kind != DDP_COLL_BARRIER && !(kind == DDP_COLL_SCATTER && rank != root);
    int need_b = kind == DDP_COLL_ALLGATHER || kind == DDP_COLL_REDUCE_SCATTER ||
                 kind == DDP_COLL_SCATTER || (kind == DDP_COLL_GATHER && rank == root);
    /* SCATTER's input lives at the root; its output everywhere. */
    if (kind == DDP_COLL_SCATTER) { need_a = rank == root; need_b = 1; }
    if (need_a && a->owner == NULL) return ddp_py_bad("%s: the input array is required", nm);
    if (need_b && b->owner == NULL) return ddp_py_bad("%s: the output array is required", nm);
    int *source = NULL;
    if (kind == DDP_COLL_RECV && root == DDP_ANY_SOURCE) {
        /* b: where the sender's group rank goes (one int32 in host memory) */
        if (b->owner && (b->dtype != DDP_INT32 || b->count != 1 || b->device != DDP_DEV_CPU))
            return ddp_py_bad("recv from any source: the second array must be one int32 in "
                              "host memory (the sender's rank goes there)");
        source = b->owner ? (int *)b->ptr : NULL;
    } else if (a->owner && b->owner && a->dtype != b->dtype)
        return ddp_py_bad("%s: input dtype %s differs from output dtype %s", nm,
                   ddp_dtype_name(a->dtype), ddp_dtype_name(b->dtype));
    ca->kind = (ddp_coll_kind)kind;
    ca->root = root;
    ca->source = source;
    ca->dtype = a->owner ? a->dtype : b->owner ? b->dtype : DDP_UINT8;
    size_t n;
    switch (kind) {
    case DDP_COLL_ALLREDUCE: case DDP_COLL_BROADCAST: case DDP_COLL_REDUCE:
    case DDP_COLL_SEND: case DDP_COLL_RECV:
        ca->buf = a->ptr;
        ca->count = a->count;
        break;
    case DDP_COLL_ALLGATHER: case DDP_COLL_GATHER:
        n = a->count;
        if (b->owner && b->count != n * (size_t)size)
            return ddp_py_bad("%s: the output has %zu elements but needs world_size * input = "
                       "%d * %zu = %zu", nm, b->count, size, n, n * (size_t)size);
        ca->sendbuf = a->ptr;
        ca->recvbuf = b->owner ? b->ptr : NULL;
        ca->count = n;
        break;
    case DDP_COLL_REDUCE_SCATTER:
    case DDP_COLL_SCATTER:
        n = b->count;
        if (a->owner && a->count != n * (size_t)size)
            return ddp_py_bad("%s: the input has %zu elements but needs world_size * output = "
                       "%d * %zu = %zu", nm, a->count, size, n, n * (size_t)size);
        ca->sendbuf = a->owner ? a->ptr : NULL;
        ca->recvbuf = b->ptr;
        ca->count = n;
        break;
    case DDP_COLL_BARRIER:
        ca->count = 0;
        break;
    default:
        return ddp_py_bad("unknown collective kind %d", kind);
    }
    return 0;
}

/* Import an optional array (GIL held); dl_stream goes to __dlpack__. */
static int import_opt(PyObject *obj, int writable, const char *name, PyObject *dl_stream,
                      ddp_py_array *out) {
    memset(out, 0, sizeof *out);
    if (obj == Py_None) return 0;
    return ddp_py_array_import_stream(obj, writable, name,
                                      dl_stream && PyObject_HasAttrString(obj, "__dlpack__")
                                          ? dl_stream : NULL, out);
}

int ddp_py_call_import(ddp_py_call *c, PyObject *ao, PyObject *bo, int kind, int *on_gpu) {
    *on_gpu = 0;
    c->fill = 1;
    /* DLPack's consumer stream: 1 names the legacy default stream (0 is
     * reserved), so the producer orders its work before ours itself too. */
    PyObject *dl_stream = c->has_stream ? PyLong_FromUnsignedLongLong(c->stream ? c->stream : 1)
                                        : NULL;
    if (c->has_stream && dl_stream == NULL) return -1;
    int writable_a = kind == DDP_COLL_ALLREDUCE || kind == DDP_COLL_BROADCAST ||
                     kind == DDP_COLL_REDUCE || kind == DDP_COLL_RECV;
    ddp_py_array *a = &c->two[0], *b = &c->two[1];
    memset(b, 0, sizeof *b);
    int rc = import_opt(ao, writable_a, "input", dl_stream, a);
    if (rc == 0) rc = import_opt(bo, 1, "output", dl_stream, b);
    Py_XDECREF(dl_stream);
    *on_gpu = (a->owner && a->device == DDP_DEV_CUDA) || (b->owner && b->device == DDP_DEV_CUDA);
    if (rc == 0 && a->owner && b->owner && a->device != b->device) {
        ddp_py_raise(DDP_ERR_INVALID, "the input and the output must both be GPU arrays or "
                     "both host arrays");
        rc = -1;
    }
    if (rc < 0) ddp_py_call_release(c);
    return rc;
}

int ddp_py_call_run_buffer(ddp_py_call *c, PyObject *const *args, Py_ssize_t nargs) {
    ddp_coll_args *ca = &c->ca;
    if (nargs == 7) {   /* an address the caller keeps alive: nothing to hold */
        void *ptr = PyLong_AsVoidPtr(args[1]);
        long long count = PyLong_AsLongLong(args[5]);
        long dt = PyLong_AsLong(args[6]);
        if (PyErr_Occurred()) return -1;
        if (count < 0 || dt < 0 || dt >= DDP_DTYPE_COUNT || (ptr == NULL && count > 0))
            return ddp_py_bad("run(): invalid buffer");
        ca->dtype = (ddp_dtype)dt;
        ca->buf = ca->kind == DDP_COLL_BARRIER ? NULL : ptr;
        ca->count = ca->kind == DDP_COLL_BARRIER ? 0 : (size_t)count;
        c->fill = 0;
        return 0;
    }
    c->fill = 1;
    if (args[1] != Py_None &&
        ddp_py_array_import(args[1], ca->kind != DDP_COLL_BARRIER, "tensor", &c->two[0]) < 0)
        return -1;
    if (c->two[0].owner && c->two[0].device != DDP_DEV_CPU) {
        ddp_py_call_release(c);
        return 1;
    }
    return 0;
}

void ddp_py_call_release(ddp_py_call *c) {
    ddp_py_array_release(&c->two[0]);
    ddp_py_array_release(&c->two[1]);
    ddp_py_arrays_free(c->arrs, (size_t)c->narrs);
    PyMem_Free(c->mem);
    c->arrs = NULL;
    c->narrs = 0;
    c->mem = NULL;
}
