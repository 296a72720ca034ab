"""Per-rank random number streams of an in-place elastic job: each commit keeps this
process's generators' states (torch's CPU generator, NumPy's global one, Python's
``random``), a rollback puts them back, and they are never synced, so that every rank
keeps drawing its own dropout and augmentation stream through membership changes. A
joiner's generators are seeded from the job's key space and its new rank: the same job
and rank always give the same stream. Generators of libraries not imported are left
alone (importing them here would cost every job their start-up).
"""
import hashlib
import random
import sys

import numpy as np


def capture():
    """The states of this process's generators."""
    torch = sys.modules.get("torch")
    return {"random": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.random.get_rng_state() if torch is not None else None}


def restore(states):
    """Put back states from capture()."""
    random.setstate(states["random"])
    np.random.set_state(states["numpy"])
    torch = sys.modules.get("torch")
    if torch is not None and states["torch"] is not None:
        torch.random.set_rng_state(states["torch"])


def seed_joiner(job, rank):
    """Seed a joiner's generators from the job (its key space) and its rank."""
    seed = int.from_bytes(hashlib.sha256(f"{job}/{rank}".encode()).digest()[:4], "little")
    random.seed(seed)
    np.random.seed(seed)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)
