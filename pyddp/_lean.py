"""The lean call path: a blocking single-buffer collective (all_reduce, broadcast, reduce,
barrier) in one C call, without ``Staged``, a Python ``Work`` or a ``_C.Work``.

``ProcessGroup.run`` (py_pg.c) submits through the same queue and waits through the
same loop as ``Work.wait`` (a small one runs inline on the calling thread when nothing
is queued), so ordering, headers, timeouts, Ctrl-C and the flight record are those of
the general path. It takes a C-contiguous NumPy array of a native dtype, a contiguous
CPU torch tensor as (data_ptr, numel, dtype code) (``_arrays.torch_cpu_code``, the one
test for such a tensor; torch is recognised by name, never imported), or a contiguous
CUDA torch tensor, which C reads itself (csrc/py/py_torch_cuda.c: its device and the
current stream looked up once) and runs on NCCL, waited for and then published on the
caller's stream: no DLPack capsule per call. Anything else (other GPU arrays,
non-contiguous or unusual arrays, other process-group types) is left to the general
path. With ``async_op`` such a CUDA tensor is submitted in C and its Work returned.
"""
import sys

import numpy as np

from . import _C
from . import _arrays as A
from . import _nccl_backend
from ._errors import COLLECTIVE_FAILURES, raise_explained
from ._work import Work

_ndarray = np.ndarray
_PG = _C.ProcessGroup
_DT = {np.dtype(n): getattr(_C, "DT_" + n.upper()) for n in
       ("float16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool")}
_torch_cpu_code = A.torch_cpu_code     # the one contiguous-CPU-tensor test
_cuda_type = _C.torch_cuda_type       # the CUDA tensor class C takes (None: not set up)


def _cuda_setup(x):
    """Whether x is a CUDA tensor of the class the C lean path takes, setting that path
    up the first time one comes (torch is imported by then)."""
    if _cuda_type() is not None or A._lib(x) != "torch" or not x.is_cuda:
        return False
    _nccl_backend.torch_cuda_setup(sys.modules["torch"])
    return type(x) is _cuda_type()


NOT_TAKEN = object()     # run(): x needs the general path, nothing was sent


def _submit(pg, g, kind, x, op, root):
    """The asynchronous form for a CUDA torch tensor that C takes (ProcessGroup.run_async:
    no DLPack capsule, the stream looked up once): its Work, or NOT_TAKEN."""
    if not (type(x) is _cuda_type() or _cuda_setup(x)):
        return NOT_TAKEN
    w = pg.run_async(kind, x, op, root, int(g._timeout_s * 1000))
    return NOT_TAKEN if w is NotImplemented else Work(w, None, g)


def run(g, kind, x, op, root, async_op=False):
    """Run a single-buffer collective of kind (COLL_*) on x through group g's
    ProcessGroup.run (blocking: None once done) or, async_op, submit it
    (ProcessGroup.run_async: its Work); NOT_TAKEN, with nothing sent, when x needs the
    general path. root is a group rank. A failure of a blocking call raises pyddp's
    error with the straggler report (``_errors.raise_explained``)."""
    pg = g._pg
    if pg is None or type(pg) is not _PG:
        return NOT_TAKEN
    if async_op:
        return _submit(pg, g, kind, x, op, root)
    timeout_ms = int(g._timeout_s * 1000)
    tp = type(x)
    try:
        if tp is _ndarray:
            if not x.flags.c_contiguous or x.dtype not in _DT:
                return NOT_TAKEN
            r = pg.run(kind, x, op, root, timeout_ms)
        elif x is None:
            r = pg.run(kind, None, op, root, timeout_ms)
        else:
            code = _torch_cpu_code(x)
            if code is not None:
                n = x.numel()
                if not n:
                    return NOT_TAKEN
                r = pg.run(kind, x.data_ptr(), op, root, timeout_ms, n, code)
            elif tp is _cuda_type() or _cuda_setup(x):
                r = pg.run(kind, x, op, root, timeout_ms)   # NotImplemented: not taken
            else:
                return NOT_TAKEN
    except COLLECTIVE_FAILURES as e:
        # The collective failed (the wait itself has no timeout): as Work.wait does,
        # say who had not arrived if a peer's timeout caused it.
        raise_explained(g, e)
    return None if r is None else NOT_TAKEN
