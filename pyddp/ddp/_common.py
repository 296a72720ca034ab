"""What both fronts of pyddp.DistributedDataParallel share: the
:class:`DistributedDataParallel` base class (``no_sync``, and the choice of front at
construction), and the construction steps (the group, checking that every rank holds
the same parameters, broadcasting rank 0's state, the bucket size, reduce_dtype, the
choice of the C or generic data path).

The fronts subclass the base: ``pyddp.ddp._torch.TorchDDP`` for torch modules and
``pyddp.ddp.ArrayDDP`` for everything else. Which one a call of the base class builds
is decided by ``pyddp.ddp`` (it sets ``DistributedDataParallel._front``), the module
that knows both: this one imports neither, so the fronts import it without a cycle.
"""
import contextlib
import weakref

import numpy as np

from .. import _C
from .._nccl_backend import caller_stream
from .. import _arrays as A
from .._group import WORLD, _resolve, timeout_ms
from .._objects import all_gather_object

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


class DistributedDataParallel:
    """Wrap a model for data-parallel training (torch.nn.parallel.DistributedDataParallel's
    signature and behaviour).

    module: a ``torch.nn.Module``, or a model from another library: an object with
    ``named_parameters()`` or ``parameters()`` yielding objects with ``.data`` (array)
    and ``.grad`` (array or None), a list of such objects, or a list of ``(data, grad)``
    array pairs. Parameters and buffers are broadcast from rank 0 at construction, and
    their names, shapes and dtypes are compared across ranks first.

    bucket_cap_mb: bucket size in MiB (the first bucket is 1 MiB). find_unused_parameters:
    parameters that get no gradient in an iteration count as zero. gradient_as_bucket_view:
    ``.grad`` arrays are views into the buckets (saves a copy and memory).
    static_graph: the set of used parameters and the number of gradients per parameter
    are the same every iteration. ``no_sync()``: accumulate gradients locally.

    reduce_dtype: None (gradients are reduced in their own dtype), or float16/bfloat16
    (``torch.float16``/``torch.bfloat16`` for torch modules, ``numpy.float16`` or
    ``ml_dtypes.bfloat16`` for array models, or the strings ``"float16"``/``"bfloat16"``):
    float32/float64 gradients are divided by the world size and rounded to that dtype as
    they are copied into their bucket, summed across ranks at that precision, and
    widened back into ``.grad``. Halves the bytes on the wire. gradient_as_bucket_view
    does not apply to those parameters (their ``.grad`` stays their own array).
    """

    def __new__(cls, *args, **kwargs):
        if cls is DistributedDataParallel:
            cls = cls._front(args[0] if args else kwargs.get("module"))
        return super().__new__(cls)

    @staticmethod
    def _front(module):
        """The front class for module (set by pyddp.ddp, which knows the fronts)."""
        raise _C.DistError("pyddp.ddp is not imported: use pyddp.DistributedDataParallel")

    @contextlib.contextmanager
    def no_sync(self):
        """Inside this context gradients are not averaged: they accumulate locally, and
        the first synced backward after it averages the accumulated sum."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old


# -- shared construction steps ------------------------------------------------------------

def use_generic_path(pg, arrays, forced):
    """The C data path serves host memory (the CPU transport); everything else (GPU
    arrays) takes the generic path. forced=None reads PYDDP_DDP_GENERIC_PATH."""
    if forced is None:
        forced = _C.setting("PYDDP_DDP_GENERIC_PATH")
    if forced:
        return True
    return any(A._lib(a) not in ("torch", "numpy") or getattr(a, "is_cuda", False)
               for a in arrays)


def ddp_group(process_group):
    """(Group, _C.ProcessGroup, timeout in ms) for DDP's process_group= argument."""
    g = _resolve(process_group)
    return g, g.pg("DistributedDataParallel"), timeout_ms(g)


_ON_WORLD = weakref.WeakSet()     # the DDPs on the default group


def follow_world(ddp, process_group):
    """Record that ddp (a front) runs on the default group when process_group says so,
    so that an elastic membership change moves it to the new one (rebind_world)."""
    if process_group is None or process_group is WORLD:
        _ON_WORLD.add(ddp)


def rebind_world():
    """After an elastic membership change: every DDP on the default group drops its
    reducer (and its .grad arrays, which belong to the interrupted iteration) and makes
    a new one over the new default group, with no communication."""
    for ddp in list(_ON_WORLD):
        ddp._rebind()


def sync_initial_state(names, arrays, g, pg, timeout_ms):
    """Construction: check that every rank of group g holds the same state, then
    overwrite it with group rank 0's (names/arrays: parameters, then the buffers that
    are broadcast)."""
    verify_across_ranks(names, arrays, g)
    if g.size > 1:
        broadcast_coalesced(arrays, pg, timeout_ms)


def verify_across_ranks(names, arrays, g=None):
    """Every rank must hold the same parameters and buffers (names, shapes, dtypes,
    count); raise the same DistValueError on every rank, naming the first difference
    and the ranks. One object all-gather; nothing is sent when world size is 1."""
    mine = [(n, tuple(int(d) for d in a.shape), str(a.dtype).rsplit(".", 1)[-1])
            for n, a in zip(names, arrays)]
    g = _resolve(g)
    world = g.size
    if world == 1:
        return
    everyone = [None] * world
    all_gather_object(everyone, mine, group=g)
    ref = everyone[0]
    for r in range(1, world):
        other = everyone[r]
        if other == ref:
            continue
        for k, (a, b) in enumerate(zip(ref, other)):
            if a != b:
                raise _C.DistValueError(
                    f"DDP: ranks hold different models: entry {k} of the parameters and "
                    f"buffers is {a[0]!r} with shape {a[1]} and dtype {a[2]} on rank 0 but "
                    f"{b[0]!r} with shape {b[1]} and dtype {b[2]} on rank {r}; build the "
                    f"same model on every rank")
        raise _C.DistValueError(
            f"DDP: ranks hold different models: rank 0 has {len(ref)} parameters and buffers "
            f"but rank {r} has {len(other)} (the first {min(len(ref), len(other))} agree); "
            f"build the same model on every rank")


def broadcast_coalesced(arrays, pg, timeout_ms, src=0):
    """Overwrite arrays with group rank src's values: packed per dtype and device into
    flat chunks of at most 250 MiB, one broadcast each (as torch's DDP does)."""
    groups = {}
    for a in arrays:
        key = (str(a.dtype), str(getattr(a, "device", "cpu")))
        groups.setdefault(key, []).append(a)
    for group in groups.values():
        chunk, size = [], 0
        for a in group + [None]:
            n = 0 if a is None else int(a.nbytes)
            if chunk and (a is None or size + n > BROADCAST_BUCKET_BYTES):
                _broadcast_chunk(chunk, pg, timeout_ms, src)
                chunk, size = [], 0
            if a is not None:
                chunk.append(a)
                size += n


def _broadcast_chunk(chunk, pg, timeout_ms, src):
    total = sum(A.numel(a) for a in chunk)
    flat = A.empty_flat(A.for_core(chunk[0]), total)
    off = 0
    for a in chunk:
        n = A.numel(a)
        A.copy_into(flat[off:off + n], A.for_core(a))
        off += n
    pg.submit(_C.COLL_BROADCAST, flat, None, 0, src, timeout_ms, caller_stream(flat)).wait()
    off = 0
    for a in chunk:
        n = A.numel(a)
        A.copy_into(a, flat[off:off + n])
        off += n


REDUCE_DTYPES = ("float16", "bfloat16")


def reduce_dtype_name(reduce_dtype, names, arrays, torch_model):
    """'float16', 'bfloat16' or None for DDP's reduce_dtype= argument, checked against
    the parameters (names, arrays) before any communication: DistTypeError for a value
    that is not a float16/bfloat16 dtype of the model's library (torch_model: torch
    dtypes, else NumPy/ml_dtypes ones; strings for both) or for a parameter that is not
    floating point, DistValueError where the library has no such dtype."""
    if reduce_dtype is None:
        return None
    name = None
    if isinstance(reduce_dtype, str):
        name = reduce_dtype
    elif type(reduce_dtype).__module__.startswith("torch"):
        name = str(reduce_dtype).rsplit(".", 1)[-1] if torch_model else None
    elif not torch_model:
        try:
            name = np.dtype(reduce_dtype).name
        except TypeError:
            name = None
    if name not in REDUCE_DTYPES:
        kinds = ("torch.bfloat16 or torch.float16" if torch_model else
                 "numpy.float16 or ml_dtypes.bfloat16")
        raise _C.DistTypeError(f"DDP: reduce_dtype must be None, {kinds} (or the string "
                               f"'bfloat16'/'float16'), not {reduce_dtype!r}")
    for n, a in zip(names, arrays):
        t = str(a.dtype).rsplit(".", 1)[-1]
        if t not in ("float16", "bfloat16", "float32", "float64"):
            raise _C.DistTypeError(f"DDP: reduce_dtype={name} applies to floating-point "
                                   f"gradients, but parameter {n!r} has dtype {t}")
        if t in ("float32", "float64") and A.dtype_in(a, name) is None:
            raise _C.DistValueError(
                f"DDP: reduce_dtype={name}: parameter {n!r} is a {A._lib(a)} array and that "
                f"library has no {name} dtype" +
                (" (install ml_dtypes for NumPy bfloat16, or use float16)"
                 if A._lib(a) == "numpy" else " (use float16)"))
    return name


def bucket_bytes(bucket_cap_mb):
    mb = 25 if bucket_cap_mb is None else bucket_cap_mb
    if not isinstance(mb, (int, float)) or isinstance(mb, bool) or mb <= 0:
        raise _C.DistValueError(f"bucket_cap_mb must be a positive number, not {bucket_cap_mb!r}")
    return max(1, int(mb * 1024 * 1024))
