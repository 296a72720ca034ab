"""PyTorch Lightning support: ``import pyddp.lightning`` registers the strategy name
``"ddp_pyddp"``, so that ``Trainer(strategy="ddp_pyddp")`` trains with Lightning's own
DDPStrategy over pyddp's transport (``process_group_backend="pyddp"``).

Lightning ships as two packages with separate registries and class trees,
``pytorch_lightning`` and ``lightning.pytorch``; the name is registered in each one that
is installed. Nothing else changes: Lightning starts the processes itself under plain
``python train.py`` (``devices=N``) or joins torchrun's, injects torch's
DistributedSampler, and syncs ``self.log(..., sync_dist=True)`` through the backend
(integer means included: pyddp's integer AVG is exact).
"""
import importlib
import importlib.util

from . import torch_backend  # noqa: F401 - registers the "pyddp" torch backend

STRATEGY = "ddp_pyddp"
__all__ = ["STRATEGY", "register", "registered_in"]

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


register()
