/* py_pg_vec.c - the calls of pyddp._C.ProcessGroup whose arguments are one
 * per peer: alltoall (counts and offsets per group rank) and p2p_batch (a
 * list of sends and receives). They build their core arguments here and
 * go through the one submit path (py_pg_submit.c's ddp_py_pg_call), so
 * routing (host or GPU), Ctrl-C during an NCCL launch and the Work they
 * return are the same as for every other call.
 */
#include "py_common.h"

#include <string.h>
#include "py_array.h"
#include "py_pg.h"

/* Read a sequence of size non-negative ints into out (elements). */
static int size_list(PyObject *seq, int size, const char *what, size_t *out) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != size) {
        Py_DECREF(fast);
        return ddp_py_bad("%s has %zd entries but the group has %d ranks", what,
                   PySequence_Fast_GET_SIZE(fast), size);
    }
    for (int i = 0; i < size; i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        if (v < 0) {
            Py_DECREF(fast);
            return ddp_py_bad("%s[%d] = %lld is negative", what, i, v);
        }
        out[i] = (size_t)v;
    }
    Py_DECREF(fast);
    return 0;
}

PyObject *ddp_py_pg_alltoall(PGObject *self, PyObject *args) {
    PyObject *ao, *bo, *sc, *sd, *rc, *rd, *so = NULL;
    long long timeout_ms = -1;
    int has_stream;
    uintptr_t stream;
    if (!PyArg_ParseTuple(args, "OOOOOO|LO", &ao, &bo, &sc, &sd, &rc, &rd, &timeout_ms, &so) ||
        ddp_py_stream_arg(so, &has_stream, &stream) < 0)
        return NULL;
    if (self->cpu.ops == NULL) return ddp_py_raise(DDP_ERR_INVALID, "the process group was destroyed");
    int size = self->cpu.ops->size(self->cpu.impl);
    ddp_py_array *arrs = PyMem_Calloc(2, sizeof *arrs);
    size_t *mem = PyMem_Calloc(4 * (size_t)size, sizeof *mem);
    if (arrs == NULL || mem == NULL) {
        PyMem_Free(arrs);
        PyMem_Free(mem);
        return PyErr_NoMemory();
    }
    ddp_pg pg = {NULL, NULL};
    int ok = ddp_py_array_import(ao, 0, "input", &arrs[0]) == 0 &&
             ddp_py_array_import(bo, 1, "output", &arrs[1]) == 0 &&
             size_list(sc, size, "input split", mem) == 0 &&
             size_list(sd, size, "input offsets", mem + size) == 0 &&
             size_list(rc, size, "output split", mem + 2 * size) == 0 &&
             size_list(rd, size, "output offsets", mem + 3 * size) == 0;
    if (ok && arrs[0].dtype != arrs[1].dtype) {
        ddp_py_bad("all_to_all: input dtype %s differs from output dtype %s",
            ddp_dtype_name(arrs[0].dtype), ddp_dtype_name(arrs[1].dtype));
        ok = 0;
    }
    for (int q = 0; ok && q < size; q++) {
        if (mem[size + q] + mem[q] > arrs[0].count || mem[3 * size + q] + mem[2 * size + q] >
            arrs[1].count) {
            ddp_py_bad("all_to_all: the block for rank %d runs past the end of the %s", q,
                mem[size + q] + mem[q] > arrs[0].count ? "input" : "output");
            ok = 0;
        }
    }
    int on_gpu = (arrs[0].device == DDP_DEV_CUDA || arrs[1].device == DDP_DEV_CUDA);
    ok = ok && ddp_py_pg_route(self, on_gpu, &pg) == 0;
    ddp_py_call c = {.arrs = arrs, .narrs = 2, .mem = mem, .has_stream = has_stream,
                     .stream = stream, .timeout_ms = timeout_ms, .on_gpu = on_gpu};
    if (!ok) {
        ddp_py_call_release(&c);
        return NULL;
    }
    c.ca.kind = DDP_COLL_ALLTOALL;
    c.ca.dtype = arrs[0].dtype;
    c.ca.sendbuf = arrs[0].ptr;
    c.ca.recvbuf = arrs[1].ptr;
    c.ca.scounts = mem;
    c.ca.sdispls = mem + size;
    c.ca.rcounts = mem + 2 * size;
    c.ca.rdispls = mem + 3 * size;
    return ddp_py_pg_call(pg, &c, DDP_PY_SUBMIT);
}

PyObject *ddp_py_pg_p2p_batch(PGObject *self, PyObject *args) {
    PyObject *list, *so = NULL;
    long long timeout_ms = -1;
    int has_stream;
    uintptr_t stream;
    if (!PyArg_ParseTuple(args, "O|LO", &list, &timeout_ms, &so) ||
        ddp_py_stream_arg(so, &has_stream, &stream) < 0)
        return NULL;
    if (self->cpu.ops == NULL) return ddp_py_raise(DDP_ERR_INVALID, "the process group was destroyed");
    PyObject *fast = PySequence_Fast(list, "ops must be a sequence of (is_send, array, peer)");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    ddp_py_array *arrs = PyMem_Calloc(n ? (size_t)n : 1, sizeof *arrs);
    ddp_p2p_op *ops = PyMem_Calloc(n ? (size_t)n : 1, sizeof *ops);
    int ok = arrs != NULL && ops != NULL, on_gpu = 0;
    if (!ok) PyErr_NoMemory();
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        int is_send, peer;
        PyObject *arr;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "pOi", &is_send, &arr, &peer)) {
            ok = 0;
            break;
        }
        if (ddp_py_array_import(arr, !is_send, is_send ? "send tensor" : "recv tensor",
                                &arrs[i]) < 0) {
            ok = 0;
            break;
        }
        on_gpu |= arrs[i].device == DDP_DEV_CUDA;
        ops[i].peer = peer;
        ops[i].is_send = is_send;
        ops[i].dtype = arrs[i].dtype;
        ops[i].count = arrs[i].count;
        ops[i].buf = arrs[i].ptr;
    }
    Py_DECREF(fast);
    ddp_pg pg = {NULL, NULL};
    ok = ok && ddp_py_pg_route(self, on_gpu, &pg) == 0;
    /* entries not imported are zeroed (calloc): releasing them is a no-op */
    ddp_py_call c = {.arrs = arrs, .narrs = (int)n, .mem = ops, .has_stream = has_stream,
                     .stream = stream, .timeout_ms = timeout_ms, .on_gpu = on_gpu};
    if (!ok) {
        ddp_py_call_release(&c);
        return NULL;
    }
    c.ca.kind = DDP_COLL_P2P_BATCH;
    c.ca.nops = (int)n;
    c.ca.ops = ops;
    return ddp_py_pg_call(pg, &c, DDP_PY_SUBMIT);
}
