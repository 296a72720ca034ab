"""pyddp.DistributedDataParallel: data-parallel training with bucketed, averaged
gradient all-reduce (the reducer's core is C; see docs/ddp.md).

``DistributedDataParallel(module, ...)`` returns

* for a ``torch.nn.Module``: a torch module (``pyddp._ddp_torch``) that behaves like
  ``torch.nn.parallel.DistributedDataParallel``: gradient hooks feed the reducer during
  ``loss.backward()``, which returns with averaged gradients;
* for any other model (NumPy, CuPy, ...): an :class:`ArrayDDP`, which averages gradients
  when you call :meth:`ArrayDDP.sync_gradients` after your backward.

Both are instances of ``DistributedDataParallel``. torch is imported only when the
model is a torch module. This file also holds what both share: choosing the path,
checking that every rank has the same parameters, and broadcasting rank 0's state.
"""
import contextlib

import numpy as np

from . import _C
from ._nccl_backend import caller_stream
from . import _arrays as A
from ._ddp_reducer import GradSync
from ._group import _resolve, timeout_ms
from ._objects import all_gather_object

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


def _is_torch_module(obj):
    for klass in type(obj).__mro__:
        if klass.__module__ == "torch.nn.modules.module" and klass.__name__ == "Module":
            return True
    return False


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
        module = args[0] if args else kwargs.get("module")
        if cls is DistributedDataParallel:
            if _is_torch_module(module):
                from ._ddp_torch import TorchDDP
                cls = TorchDDP
            else:
                cls = ArrayDDP
        return super().__new__(cls)

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


def broadcast_coalesced(arrays, pg, timeout_ms):
    """Overwrite arrays with rank 0's values: packed per dtype and device into flat
    chunks of at most 250 MiB, one broadcast each (as torch's DDP does)."""
    groups = {}
    for a in arrays:
        key = (str(a.dtype), str(getattr(a, "device", "cpu")))
        groups.setdefault(key, []).append(a)
    for group in groups.values():
        chunk, size = [], 0
        for a in group + [None]:
            n = 0 if a is None else int(a.nbytes)
            if chunk and (a is None or size + n > BROADCAST_BUCKET_BYTES):
                _broadcast_chunk(chunk, pg, timeout_ms)
                chunk, size = [], 0
            if a is not None:
                chunk.append(a)
                size += n


def _broadcast_chunk(chunk, pg, timeout_ms):
    total = sum(A.numel(a) for a in chunk)
    flat = A.empty_flat(A.for_core(chunk[0]), total)
    off = 0
    for a in chunk:
        n = A.numel(a)
        A.copy_into(flat[off:off + n], A.for_core(a))
        off += n
    pg.submit(_C.COLL_BROADCAST, flat, None, 0, 0, timeout_ms, caller_stream(flat)).wait()
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


# -- models that are not torch modules ------------------------------------------------------

def _array_params(module):
    """(names, params) for the array protocol. Each param is either an object with
    .data and .grad, or a (data, grad) pair, normalised to _PairParam."""
    if hasattr(module, "named_parameters"):
        items = list(module.named_parameters())
    elif hasattr(module, "parameters"):
        items = [(f"parameters[{i}]", p) for i, p in enumerate(module.parameters())]
    elif isinstance(module, (list, tuple)):
        items = [(f"[{i}]", p) for i, p in enumerate(module)]
    else:
        raise _C.DistTypeError(
            f"DistributedDataParallel needs a torch.nn.Module or a model exposing "
            f"named_parameters()/parameters() (objects with .data and .grad arrays), a list of "
            f"such objects, or a list of (data, grad) array pairs; got {type(module).__name__}")
    names, params = [], []
    for name, p in items:
        if isinstance(p, tuple) and len(p) == 2:
            p = _PairParam(*p)
        if not hasattr(p, "data") or not hasattr(p, "grad"):
            raise _C.DistTypeError(f"DDP: parameter {name!r} has no .data/.grad attributes "
                                   f"(got {type(p).__name__})")
        if not hasattr(p.data, "shape") or not hasattr(p.data, "dtype"):
            raise _C.DistTypeError(f"DDP: parameter {name!r}: .data is not an array "
                                   f"({type(p.data).__name__})")
        names.append(name)
        params.append(p)
    if not params:
        raise _C.DistValueError("DistributedDataParallel is not needed when a model has no "
                                "parameters")
    return names, params


class _PairParam:
    """A (data, grad) pair: the gradient array is fixed, so setting .grad copies into it."""

    def __init__(self, data, grad):
        self.data = data
        self._grad = grad

    @property
    def grad(self):
        return self._grad

    @grad.setter
    def grad(self, value):
        if value is not self._grad:
            A.copy_into(self._grad, value)


class ArrayDDP(DistributedDataParallel):
    """DDP for models outside torch. After your backward pass has filled every
    parameter's ``.grad``, call :meth:`sync_gradients` (alias ``reduce_gradients``): it
    averages the gradients across ranks in place, through the same buckets as the torch
    path. Inside ``no_sync()`` it does nothing, so gradients you accumulate (``+=``)
    are averaged by the first call outside it. Calling the wrapper calls the model."""

    def __init__(self, module, device_ids=None, output_device=None, dim=0,
                 broadcast_buffers=True, init_sync=True, process_group=None,
                 bucket_cap_mb=None, find_unused_parameters=False, check_reduction=False,
                 gradient_as_bucket_view=False, static_graph=False, reduce_dtype=None,
                 _generic_path=None):
        g, pg, tmo = ddp_group(process_group)
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        names, self._params = _array_params(module)
        arrays = [p.data for p in self._params]
        rdt = reduce_dtype_name(reduce_dtype, names, arrays, torch_model=False)
        self.reduce_dtype = reduce_dtype
        if gradient_as_bucket_view and any(isinstance(p, _PairParam) for p in self._params):
            raise _C.DistValueError("gradient_as_bucket_view=True needs parameter objects whose "
                                    ".grad can be replaced, not (data, grad) pairs")
        self._group, self._pg, self._timeout_ms = g, pg, tmo
        self._buffers = self._find_buffers(module)
        if init_sync:
            bufs = self._buffers if broadcast_buffers else []
            sync_initial_state(names + [f"buffer {i}" for i in range(len(bufs))],
                               arrays + bufs, g, pg, self._timeout_ms)
        self._sync = GradSync(
            arrays, names, self._get_grad, self._set_grad, pg=pg, rank=g.rank,
            world_size=g.size, bucket_cap_bytes=bucket_bytes(bucket_cap_mb),
            # every gradient is ready at once here, so a static graph needs nothing more
            find_unused=find_unused_parameters or static_graph, static_graph=False,
            view_mode=gradient_as_bucket_view,
            generic=use_generic_path(pg, arrays, _generic_path), timeout_ms=self._timeout_ms,
            reduce_dtype=rdt, group=g)

    @staticmethod
    def _find_buffers(module):
        if hasattr(module, "named_buffers"):
            return [b for _, b in module.named_buffers()]
        if hasattr(module, "buffers"):
            return list(module.buffers())
        return []

    def _get_grad(self, i):
        return self._params[i].grad

    def _set_grad(self, i, g):
        self._params[i].grad = g

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """Broadcast buffers from rank 0 (broadcast_buffers), then call the model."""
        if (self.require_forward_param_sync and self.broadcast_buffers and self._buffers
                and self._group.size > 1):
            broadcast_coalesced(self._buffers, self._pg, self._timeout_ms)
        self.require_forward_param_sync = self.require_backward_grad_sync
        fn = self.module if callable(self.module) else getattr(self.module, "forward")
        return fn(*args, **kwargs)

    def parameters(self):
        return [p for p in self._params]

    def sync_gradients(self):
        """Average every parameter's .grad across ranks, in place (a collective: every
        rank calls it at the same point). Parameters whose .grad is None are an error
        unless find_unused_parameters=True (then they count as zeros, and get the
        average only if another rank had a gradient). No-op inside no_sync()."""
        if not self.require_backward_grad_sync:
            return
        s = self._sync
        missing = [s.names[i] for i, p in enumerate(self._params) if p.grad is None]
        if missing and not s.dynamic_unused:
            # All gradients are known up front, so fail before any communication.
            raise _C.DistValueError(
                f"DDP: rank {s.rank}: parameter(s) {missing} have no gradient (.grad is "
                f"None); fill every .grad before sync_gradients(), or pass "
                f"find_unused_parameters=True to treat them as unused (zero) this step")
        s.start()
        # Mark in the planned order (reverse registration), so each bucket's
        # all-reduce starts while the next one is still being filled.
        for i in reversed(range(len(self._params))):
            if self._params[i].grad is not None:
                s.on_grad(i)
        s.finalize()

    reduce_gradients = sync_gradients
