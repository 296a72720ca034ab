"""The world an in-place elastic job runs on: pyddp's default group, or torch's default
group on backend "pyddp" (a script that kept torch's DistributedDataParallel and
``torch.distributed.init_process_group("pyddp")``).

Both are a pyddp world ``Group`` underneath (for torch's, the ``handle`` of its
ProcessGroupPyddp): the membership watches it, aborts it, and the state's collectives
run on it. A change makes the world again at the new size in the same process:
pyddp's with ``_world.rebuild_world``; torch's by destroying torch's default group and
calling ``torch.distributed.init_process_group("pyddp", store=..., rank=, world_size=)``
over the store torch's first init made, with the epoch's key prefix passed to pyddp's
creator (``pg_options``), so that ``dist.get_rank()``/``get_world_size()`` give the new
values. torch's DDP wrapper holds the old group: the script makes it again in a reset
callback (docs/elastic.md).
"""
import sys
from datetime import timedelta

from .. import _C
from .._group import _State

PREFIX_OPTION = "pyddp_prefix"


def _torch_default():
    """torch's default ProcessGroupPyddp, or None."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    from ..torch_backend import ProcessGroupPyddp
    from torch.distributed import distributed_c10d as c10d
    pg = c10d._get_default_group()
    return pg if isinstance(pg, ProcessGroupPyddp) else None


def torch_mode():
    """Whether the job runs on torch's default group (pyddp's is not initialized)."""
    return _State.pg is None and _torch_default() is not None


def world_group():
    """The pyddp world Group the job runs on (see the module's docstring)."""
    if _State.pg is not None:
        return _State.pg
    pg = _torch_default()
    if pg is None:
        raise _C.DistError("pyddp.elastic needs a process group: pyddp.init_process_group(), "
                           "or torch.distributed.init_process_group(\"pyddp\")")
    return pg.handle


def timeout_s():
    g = world_group()
    return g._timeout_s


def torch_store():
    """The store torch's default group was made over (kept for the rebuilds)."""
    from torch.distributed import distributed_c10d as c10d
    return c10d._get_default_store()


def rebuild_torch(m, rank, size, prefix):
    """torch's default group made again: this process is rank of size, the rendezvous
    under prefix (the membership epoch's). Returns its pyddp world Group."""
    import torch.distributed as dist
    if m.torch_store is None:
        m.torch_store = torch_store()
    timeout = timedelta(seconds=m.timeout_s)
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("pyddp", store=m.torch_store, rank=rank, world_size=size,
                            timeout=timeout, pg_options={PREFIX_OPTION: prefix})
    return _torch_default().handle
