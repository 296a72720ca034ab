"""pyddp: data-parallel training with a C core.

Use it as torch.distributed::

    import pyddp as dist
    from pyddp import DistributedDataParallel as DDP, DistributedSampler

    dist.init_process_group("cpu")          # or "nccl"; under torchrun
    ...

Importing pyddp never imports torch; NumPy is the only requirement.
"""
from ._version import __version__
from . import _C
from ._C import (AuthenticationError, BackendUnavailableError, CollectiveMismatchError, DistBackendError,
                 DistError, DistNetworkError, DistStoreError, DistStoreTimeoutError,
                 DistTimeoutError, DistTypeError, DistValueError, VersionMismatchError)
from ._group import (WORLD, Group, dump_flight_record, get_backend, get_global_rank,
                     get_group_rank, get_local_rank, get_local_world_size,
                     get_process_group_ranks, get_rank, get_world_size, group, is_available,
                     is_initialized, new_group)
from ._world import destroy_process_group, init_process_group
from .collectives import (P2POp, ReduceOp, Work, all_gather, all_gather_coalesced,
                          all_gather_into_tensor, all_reduce, all_reduce_coalesced, all_to_all, all_to_all_single,
                          barrier, batch_isend_irecv, broadcast, gather, irecv, isend,
                          monitored_barrier, recv, reduce, reduce_scatter,
                          reduce_scatter_tensor, scatter, send)
from ._objects import (all_gather_object, broadcast_object_list, gather_object,
                       scatter_object_list)
from .store import EtcdStore, TCPStore
from ._nccl_backend import cuda_device_for_local_rank
from .sampler import DistributedSampler


def is_nccl_available() -> bool:
    """True when NCCL and a GPU can be used by this process."""
    from . import _nccl_backend
    return _nccl_backend.usable()


def is_gloo_available() -> bool:
    """True: the CPU backend (alias "gloo") is always available."""
    return True


def __getattr__(name):
    # DistributedDataParallel and Join (torch.distributed.algorithms.Join's semantics
    # for it) live in pyddp.ddp, imported on first use so that `import pyddp` stays light.
    if name in ("DistributedDataParallel", "Join"):
        from . import ddp
        return getattr(ddp, name)
    raise AttributeError(f"module 'pyddp' has no attribute {name!r}")
