"""NCCL backend entry points used by init_process_group.

The NCCL backend (GPU arrays, libnccl loaded at run time) is not part of this build
yet: ``usable()`` is False and ``backend="nccl"`` raises BackendUnavailableError.
"""
from . import _C

_REASON = "this pyddp build has no NCCL backend yet"


def usable():
    return False


def why_unusable():
    return _REASON


def create(store, rank, world_size, prefix, timeout_s, device_id):
    raise _C.BackendUnavailableError(f"backend='nccl' is unavailable: {_REASON}. Use "
                                     f"backend='cpu'.")
