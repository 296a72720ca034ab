"""The torch front-end of pyddp.DistributedDataParallel (imported only for torch modules).

``TorchDDP`` is a ``torch.nn.Module`` that mirrors ``torch.nn.parallel.
DistributedDataParallel``: the wrapped model is ``.module`` (so ``state_dict()`` keys
start with ``module.``), forward passes straight through, and ``loss.backward()``
returns with gradients averaged across ranks:

* each trainable parameter gets a ``register_post_accumulate_grad_hook`` that hands its
  gradient to the reducer the moment autograd has accumulated it, so full buckets are
  all-reduced on the communication thread while backward goes on (a C hook,
  ``_C.GradHooks``: it asks DDP's per-gradient rules, in C, does the common CPU case
  itself and calls ``_act`` for the rest);
* the first such hook of a synced iteration queues an autograd engine callback,
  which runs when backward ends: it deals with parameters that got no gradient and
  waits for every bucket (``GradSync.finalize``).

Forward follows torch's order: check the previous iteration finished, rebuild buckets
once (first forward after the first synced backward), broadcast buffers from rank 0,
run the module, then expect a synced backward if grad is enabled outside ``no_sync()``.

It is a ``torch.distributed.algorithms.Joinable`` (``_join.JoinableDDP``): under a join
context (``model.join()``, ``pyddp.Join``, torch's ``Join``) the forward first tells
the context and the ranks that have run out of data what this iteration does, and
buffers come from the highest rank still training.
"""
import functools
import weakref

import torch
from torch.distributed.algorithms.join import Joinable

from .. import _C
from .. import _arrays as A
from ._join import JoinableDDP, torch_join_group
from ._reducer import GradSync
from ._common import (DistributedDataParallel, broadcast_coalesced, bucket_bytes,
                          ddp_group, follow_world, reduce_dtype_name, sync_initial_state,
                          use_generic_path)


def _act(ddp_ref, i, verdict):
    """What the C hook leaves to Python: the rules' verdict on parameter i's gradient
    (other data paths and modes, errors worded with the parameter's name)."""
    ddp = ddp_ref()
    if ddp is not None:
        ddp._sync.act(i, verdict)


def _queue_finalize(ddp_ref):
    """The C hook took the first gradient of a synced iteration: finalize after backward."""
    ddp = ddp_ref()
    if ddp is not None:
        torch.autograd.Variable._execution_engine.queue_callback(ddp._finalize_backward)


def _hook_failed(ddp_ref, e):
    ddp = ddp_ref()
    if ddp is not None:
        ddp._sync.hook_failed(e)


def _install_hooks(ddp, params):
    """One C hook per parameter (GradHooks): the rules and the common case run in C, the
    rest calls back into _act. The hooks hold the DDP weakly; once it is collected they
    do nothing."""
    ref = weakref.ref(ddp)
    hooks = ddp._sync.hooks
    hooks.act = functools.partial(_act, ref)
    hooks.first = functools.partial(_queue_finalize, ref)
    hooks.failed = functools.partial(_hook_failed, ref)
    hooks.tensor_type, hooks.strided, hooks.dtypes = A.torch_hook_config(torch)
    weakref.finalize(ddp, hooks.detach)
    return [p.register_post_accumulate_grad_hook(hooks.hook(i)) for i, p in enumerate(params)]


def _to_device(obj, device):
    """Move the tensors in (nested) inputs to device, as torch's DDP does with device_ids."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


class TorchDDP(JoinableDDP, DistributedDataParallel, torch.nn.Module, Joinable):
    """pyddp.DistributedDataParallel for a torch.nn.Module (see DistributedDataParallel)."""

    def __init__(self, module, device_ids=None, output_device=None, dim=0,
                 broadcast_buffers=True, init_sync=True, process_group=None,
                 bucket_cap_mb=None, find_unused_parameters=False, check_reduction=False,
                 gradient_as_bucket_view=False, static_graph=False, reduce_dtype=None,
                 _generic_path=None):
        torch.nn.Module.__init__(self)
        g, pg, tmo = ddp_group(process_group)
        self._ignore = ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        named = [(n, p) for n, p in module.named_parameters() if n not in ignore]
        trainable = [(n, p) for n, p in named if p.requires_grad]
        if not trainable:
            raise _C.DistError("DistributedDataParallel is not needed when a module doesn't "
                               "have any parameter that requires a gradient.")
        self._check_devices(trainable, device_ids, output_device)
        rdt = reduce_dtype_name(reduce_dtype, [n for n, _ in trainable],
                                [p for _, p in trainable], torch_model=True)
        self.reduce_dtype = reduce_dtype
        self.module = module
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._module_buffers = [b for n, b in module.named_buffers() if n not in ignore]
        self._group, self._pg, self._timeout_ms = g, pg, tmo
        names = [n for n, _ in trainable]
        params = [p for _, p in trainable]
        self._params = params
        self._names = names
        self._sync_opts = dict(bucket_cap_bytes=bucket_bytes(bucket_cap_mb),
                               find_unused=find_unused_parameters, static_graph=static_graph,
                               view_mode=gradient_as_bucket_view, reduce_dtype=rdt)
        self._forced_generic = _generic_path
        with torch.no_grad():
            if init_sync:
                states = self._named_states()
                sync_initial_state([n for n, _ in states], [t for _, t in states], g, pg,
                                   self._timeout_ms)
            self._sync = self._new_sync()
        self._hook_handles = _install_hooks(self, params)
        follow_world(self, process_group)

    def _new_sync(self):
        """The reducer (GradSync) over the current group."""
        g, pg = self._group, self._pg
        return GradSync([p.detach() for p in self._params], self._names, self._get_grad,
                        self._set_grad, pg=pg, rank=g.rank, world_size=g.size,
                        generic=use_generic_path(pg, self._params, self._forced_generic),
                        timeout_ms=self._timeout_ms, group=g, **self._sync_opts)

    def _rebind(self):
        """Move to the new default group after an elastic membership change (see
        _common.rebind_world): new reducer and hooks, gradients cleared."""
        for h in self._hook_handles:
            h.remove()
        self._sync.hooks.detach()
        self._group, self._pg, self._timeout_ms = ddp_group(None)
        for p in self._params:
            p.grad = None
        with torch.no_grad():
            self._sync = self._new_sync()
        self._hook_handles = _install_hooks(self, self._params)
        self.require_forward_param_sync = True

    def _check_devices(self, trainable, device_ids, output_device):
        types = {p.device.type for _, p in trainable}
        if len(types) != 1:
            raise _C.DistValueError(f"DistributedDataParallel's module must have all its "
                                    f"parameters on one type of device, not {sorted(types)}")
        if device_ids is not None and len(device_ids) > 1:
            raise _C.DistValueError("device_ids can only be None or contain a single element.")
        devices = {p.device for _, p in trainable}
        if not device_ids or types == {"cpu"} or len(devices) > 1:
            if device_ids or output_device is not None:
                raise _C.DistValueError(
                    f"device_ids and output_device only work with single-device GPU modules; "
                    f"this module's parameters are on {sorted(str(d) for d in devices)}")
            self.device_ids = None
            self.output_device = None
            return
        dev = torch.device(device_ids[0]) if not isinstance(device_ids[0], int) else \
            torch.device("cuda", device_ids[0])
        self.device_ids = [dev.index]
        self.output_device = output_device if output_device is not None else dev.index

    def _named_states(self):
        """(name, tensor) of what construction and a join's end broadcast: every
        parameter, then the buffers when broadcast_buffers (ignored names left out)."""
        states = [(n, p.detach()) for n, p in self.module.named_parameters()
                  if n not in self._ignore]
        if self.broadcast_buffers:
            states += [(n, b.detach()) for n, b in self.module.named_buffers()
                       if n not in self._ignore]
        return states

    def _states(self):
        return [t for _, t in self._named_states()]

    def _buffers_to_sync(self):
        """The buffers this forward broadcasts (none inside no_sync's iterations)."""
        if (self.require_forward_param_sync and self.broadcast_buffers and self._module_buffers
                and self._group.size > 1):
            return [b.detach() for b in self._module_buffers]
        return []

    @property
    def join_device(self):
        return self._params[0].device

    @property
    def join_process_group(self):
        """torch's default group (torch's Join runs its all-reduces there); it must hold
        the ranks of this DDP's group, else a DistValueError names what to use."""
        return torch_join_group(self._group)

    def _get_grad(self, i):
        return self._params[i].grad

    def _set_grad(self, i, g):
        self._params[i].grad = g

    def _finalize_backward(self):
        self._sync.finalize()
        if self._join_count is not None:
            with torch.no_grad():
                self._join_after_backward()

    def forward(self, *inputs, **kwargs):
        sync = self._sync
        grad_on = torch.is_grad_enabled()
        if grad_on:
            sync.check_prior()
        rebuild = grad_on and sync.rebuild_due()
        bufs = self._buffers_to_sync()
        src = 0
        if self._join_config.enable:
            src = self._join_forward(grad_on and self.require_backward_grad_sync, rebuild)
        if rebuild:
            sync.rebuild()
        if bufs:
            with torch.no_grad():
                broadcast_coalesced(bufs, self._pg, self._timeout_ms, src)
        if self.device_ids:
            dev = torch.device("cuda", self.device_ids[0])
            inputs, kwargs = _to_device(inputs, dev), _to_device(kwargs, dev)
        out = self.module(*inputs, **kwargs)
        if grad_on and self.require_backward_grad_sync:
            self.require_forward_param_sync = True
            sync.start()
        else:
            self.require_forward_param_sync = False
        return out

    def register_comm_hook(self, state, hook):
        raise NotImplementedError("pyddp's DistributedDataParallel does not support "
                                  "communication hooks; gradients are always averaged")
