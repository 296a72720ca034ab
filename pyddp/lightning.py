"""PyTorch Lightning support: ``import pyddp.lightning`` registers the strategy name
``"ddp_pyddp"``, so that ``Trainer(strategy="ddp_pyddp")`` trains with Lightning's own
DDPStrategy over pyddp's transport (``process_group_backend="pyddp"``).

Lightning ships as two packages with separate registries and class trees,
``pytorch_lightning`` and ``lightning.pytorch``; the name is registered in each one that
is installed. Nothing else changes: Lightning starts the processes itself under plain
``python train.py`` (``devices=N``) or joins torchrun's, injects torch's
DistributedSampler, and syncs ``self.log(..., sync_dist=True)`` through the backend
(integer means included: pyddp's integer AVG is exact).

``rank0_checkpoint_io()`` is a checkpoint plugin for jobs without shared storage: Lightning
saves checkpoints on global rank 0 only, but ``trainer.fit(ckpt_path=...)`` makes every
rank read the file; with the plugin rank 0 reads it and broadcasts it to the others.
"""
import importlib
import importlib.util

from . import torch_backend  # noqa: F401 - registers the "pyddp" torch backend

STRATEGY = "ddp_pyddp"
__all__ = ["STRATEGY", "register", "registered_in", "rank0_checkpoint_io"]

_PACKAGES = ("pytorch_lightning", "lightning.pytorch")


def _installed(name):
    """True when package name (possibly dotted) can be imported, without importing it
    when it cannot."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        try:
            if importlib.util.find_spec(".".join(parts[:i])) is None:
                return False
        except (ImportError, ValueError):
            return False
    return True


def register():
    """Register "ddp_pyddp" in every installed Lightning package (idempotent). Returns
    the names of the packages it is registered in."""
    done = []
    for pkg in _PACKAGES:
        if not _installed(pkg):
            continue
        strategies = importlib.import_module(f"{pkg}.strategies")
        registry = strategies.StrategyRegistry
        if STRATEGY not in registry:
            registry.register(STRATEGY, strategies.DDPStrategy,
                              description="DDP over pyddp's transport (process_group_backend"
                                          "='pyddp')",
                              process_group_backend=torch_backend.NAME)
        done.append(pkg)
    return done


def registered_in():
    """The Lightning packages in which "ddp_pyddp" is registered now."""
    out = []
    for pkg in _PACKAGES:
        if _installed(pkg):
            if STRATEGY in importlib.import_module(f"{pkg}.strategies").StrategyRegistry:
                out.append(pkg)
    return out


_FABRIC_IO = {"pytorch_lightning": "lightning_fabric.plugins.io.torch_io",
              "lightning.pytorch": "lightning.fabric.plugins.io.torch_io"}
_io_classes = {}


def rank0_checkpoint_io(package=None):
    """A checkpoint plugin (``Trainer(plugins=[...])``) that loads a checkpoint on global
    rank 0 and broadcasts it to every other rank, so that ``ckpt_path`` needs to exist on
    rank 0's machine only. Saving is Lightning's own (rank 0 writes). package:
    "pytorch_lightning" or "lightning.pytorch" (the Trainer's package; default: the first
    installed). The whole checkpoint travels as one pickled object: it must fit in each
    rank's memory, as it does with a plain load."""
    pkg = package or next((p for p in _PACKAGES if _installed(p)), None)
    if pkg not in _FABRIC_IO or not _installed(pkg):
        raise ImportError(f"pyddp.lightning: no Lightning package {package or ''} installed")
    if pkg not in _io_classes:
        _io_classes[pkg] = _rank0_io_class(importlib.import_module(_FABRIC_IO[pkg]))
    return _io_classes[pkg]()


def _rank0_io_class(torch_io):
    import torch.distributed as dist

    class Rank0CheckpointIO(torch_io.TorchCheckpointIO):
        """TorchCheckpointIO whose load reads on global rank 0 and broadcasts."""

        def load_checkpoint(self, path, map_location=lambda storage, loc: storage,
                            weights_only=None):
            if not dist.is_initialized() or dist.get_world_size() == 1:
                return super().load_checkpoint(path, map_location=map_location,
                                               weights_only=weights_only)
            box = [None]
            if dist.get_rank() == 0:
                try:
                    box[0] = (None, super().load_checkpoint(
                        path, map_location=map_location, weights_only=weights_only))
                except Exception as e:  # noqa: BLE001 - every rank raises it below
                    box[0] = (e, None)
            dist.broadcast_object_list(box, src=0)
            err, ckpt = box[0]
            if err is not None:
                msg = f"rank 0 could not load the checkpoint {path}: {err}"
                try:
                    exc = type(err)(msg)
                except Exception:  # noqa: BLE001 - a type that wants other arguments
                    exc = RuntimeError(msg)
                raise exc
            return ckpt

    return Rank0CheckpointIO


register()
