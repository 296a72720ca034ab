"""torch's auto-load hooks for pyddp: registers the torch.distributed backend "pyddp",
and torchrun's rendezvous backend "pyddp" (``--rdzv-backend=pyddp``).

torch loads every entry point of the group ``torch.backends`` at ``import torch``
(unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``); pyproject.toml points one at
:func:`register`. That runs in every torch process on the machine, so this module is a
top-level module of its own: importing anything inside the ``pyddp`` package would run
``pyddp/__init__.py``, which loads the C extension and NumPy. Here nothing is imported
but ``torch.distributed`` (already imported by torch at that point) and nothing can
raise: a failure leaves the backend unregistered, and ``import torch`` works as before.

The creator registered here is a stub that imports ``pyddp.torch_backend`` when a
group is actually created with ``backend="pyddp"``.
"""
import sys

NAME = "pyddp"


def _create(backend_options, pg_options=None):
    """torch's creator (extended API): build the process group in pyddp.torch_backend."""
    from pyddp.torch_backend import create_process_group
    return create_process_group(backend_options, pg_options)


def register():
    """Register the "pyddp" backend with torch.distributed unless it already is (by this
    hook or by ``import pyddp.torch_backend``). Returns True when it is registered
    afterwards; never raises."""
    try:
        dist = sys.modules.get("torch.distributed")
        if dist is None:
            import torch.distributed as dist
        if not dist.is_available():
            return False
        _wrap_env_rendezvous()
        backend = dist.Backend
        if NAME.upper() in backend._plugins:
            return True
        # devices as a list: a string would be iterated character by character.
        backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])
        return True
    except Exception:  # noqa: BLE001 - a broken hook must not break `import torch`
        return False


def _wrap_env_rendezvous():
    """Put pyddp's env:// rendezvous in front of torch's (once): in the workers of
    pyddp's torchrun rendezvous it gives torch the job's store through pyddp's client
    (authenticated, or on etcd); elsewhere it calls torch's own handler
    (``pyddp.torch_backend._store.env_rendezvous``). pyddp is imported only when an
    env:// rendezvous runs; if that fails, torch's handler runs as before."""
    handlers = sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers
    orig = handlers.get("env")
    if orig is None or getattr(orig, "_pyddp_orig", None) is not None:
        return

    def env_rendezvous(url, timeout=None, **kwargs):
        try:
            from pyddp.torch_backend._store import env_rendezvous as ours
        except Exception:  # noqa: BLE001 - pyddp broken or half-installed: torch's own
            return orig(url, **kwargs) if timeout is None else \
                orig(url, timeout=timeout, **kwargs)
        return ours(url, timeout, orig, **kwargs)
    env_rendezvous._pyddp_orig = orig
    handlers["env"] = env_rendezvous


def _create_rdzv_handler(params):
    """torchrun's creator for ``--rdzv-backend=pyddp`` (pyddp.elastic._handler)."""
    from pyddp.elastic._handler import create_handler
    return create_handler(params)


def torchrun_handler():
    """torchrun's ``torchrun.handlers`` entry point: torchrun calls it once, when its
    rendezvous registry loads, and registers what it returns as the creator of
    ``--rdzv-backend=pyddp``. Nothing of pyddp is imported until a job asks for it."""
    return _create_rdzv_handler
