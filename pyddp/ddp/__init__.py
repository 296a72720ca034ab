"""pyddp.DistributedDataParallel: data-parallel training with bucketed, averaged
gradient all-reduce (the reducer's core is C; see docs/ddp.md).

``DistributedDataParallel(module, ...)`` returns

* for a ``torch.nn.Module``: a torch module (``pyddp.ddp._torch``) that behaves like
  ``torch.nn.parallel.DistributedDataParallel``: gradient hooks feed the reducer during
  ``loss.backward()``, which returns with averaged gradients;
* for any other model (NumPy, CuPy, ...): an :class:`ArrayDDP`, which averages gradients
  when you call :meth:`ArrayDDP.sync_gradients` after your backward.

Both are instances of ``DistributedDataParallel`` (defined with the construction steps
both share in ``pyddp.ddp._common``), and both take uneven inputs under ``with
model.join():`` (``pyddp.ddp._join``, torch's Join semantics). torch is imported only
when the model is a torch module: this module picks the front and imports ``_torch``
then.

The package (DDP) may import the core (the top-level modules of pyddp) and torch, never
the torch integration, elastic or the tools; the core hands it nothing but its group.
"""
from .. import _C
from .. import _arrays as A
from ._common import (BROADCAST_BUCKET_BYTES, REDUCE_DTYPES,  # noqa: F401 - this API
                          DistributedDataParallel, broadcast_coalesced, bucket_bytes,
                          ddp_group, follow_world, reduce_dtype_name, sync_initial_state,
                          use_generic_path,
                          verify_across_ranks)
from ._join import Join, JoinableDDP  # noqa: F401 - Join: this API
from ._reducer import GradSync


def _is_torch_module(obj):
    for klass in type(obj).__mro__:
        if klass.__module__ == "torch.nn.modules.module" and klass.__name__ == "Module":
            return True
    return False


def _front(module):
    """The front DistributedDataParallel(module) builds: TorchDDP for a torch module,
    else ArrayDDP."""
    if _is_torch_module(module):
        from ._torch import TorchDDP
        return TorchDDP
    return ArrayDDP


DistributedDataParallel._front = staticmethod(_front)


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


class ArrayDDP(JoinableDDP, DistributedDataParallel):
    """DDP for models outside torch. After your backward pass has filled every
    parameter's ``.grad``, call :meth:`sync_gradients` (alias ``reduce_gradients``): it
    averages the gradients across ranks in place, through the same buckets as the torch
    path. Inside ``no_sync()`` it does nothing, so gradients you accumulate (``+=``)
    are averaged by the first call outside it. Calling the wrapper calls the model.

    Uneven inputs: ``with model.join():`` around the loop (``divide_by_initial_world_size``,
    ``enable``, ``throw_on_early_termination`` as torch's ``DDP.join``). Each iteration
    must then call the model through the wrapper before ``sync_gradients()``: that call
    tells the ranks that have run out of data what to shadow."""

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
        self._names, self._arrays, self._forced_generic = names, arrays, _generic_path
        # every gradient is ready at once here, so a static graph needs nothing more
        self._sync_opts = dict(bucket_cap_bytes=bucket_bytes(bucket_cap_mb),
                               find_unused=find_unused_parameters or static_graph,
                               static_graph=False, view_mode=gradient_as_bucket_view,
                               reduce_dtype=rdt)
        self._sync = self._new_sync()
        self._forward_seen = False      # join mode: the wrapper was called this iteration
        follow_world(self, process_group)

    def _new_sync(self):
        """The reducer (GradSync) over the current group."""
        g, pg = self._group, self._pg
        return GradSync(self._arrays, self._names, self._get_grad, self._set_grad, pg=pg,
                        rank=g.rank, world_size=g.size,
                        generic=use_generic_path(pg, self._arrays, self._forced_generic),
                        timeout_ms=self._timeout_ms, group=g, **self._sync_opts)

    def _rebind(self):
        """Move to the new default group after an elastic membership change (see
        _common.rebind_world). Gradients are left as they are: their arrays are
        the model's (the next backward overwrites them)."""
        self._sync.hooks.detach()
        self._group, self._pg, self._timeout_ms = ddp_group(None)
        self._sync = self._new_sync()
        self.require_forward_param_sync = True

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

    def _states(self):
        """What a join's end broadcasts: the parameters, and the buffers when
        broadcast_buffers."""
        return self._arrays + (self._buffers if self.broadcast_buffers else [])

    def _buffers_to_sync(self):
        if (self.require_forward_param_sync and self.broadcast_buffers and self._buffers
                and self._group.size > 1):
            return self._buffers
        return []

    @property
    def join_device(self):
        """Where the model's arrays live: "cpu", or the GPU's device object."""
        return getattr(self._arrays[0], "device", "cpu")

    @property
    def join_process_group(self):
        """The pyddp group the model runs on (pyddp.Join's all-reduces go there)."""
        return self._group

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """Broadcast buffers from rank 0 (broadcast_buffers; in join mode from the
        highest rank still training), then call the model."""
        src = 0
        bufs = self._buffers_to_sync()
        if self._join_config.enable:
            src = self._join_forward(self.require_backward_grad_sync, False)
            self._forward_seen = True
        if bufs:
            broadcast_coalesced(bufs, self._pg, self._timeout_ms, src)
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
        if self._join_config.enable and not self._forward_seen:
            raise _C.DistValueError(
                "DDP: inside model.join(), call the model through the DDP wrapper (model(x)) "
                "in every iteration before sync_gradients(): that call tells the ranks that "
                "have run out of data which collectives to match")
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
        self._forward_seen = False
        s.finalize()
        self._join_after_backward()

    reduce_gradients = sync_gradients
