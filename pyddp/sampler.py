"""DistributedSampler: torch.utils.data.DistributedSampler without a hard torch import.

Each rank of a data-parallel job iterates a disjoint, equally long share of a dataset's
indices. The padding, the drop_last truncation and the rank's slice are computed exactly
as torch.utils.data.DistributedSampler computes them (torch 2.x, distributed.py), and
when torch is importable the shuffled order is torch's own (same generator, same call),
so a script that swaps ``torch.utils.data.DistributedSampler`` for this one sees the
same indices on every rank in every epoch.

torch stays optional: importing this module does not import torch. torch is imported
lazily, only inside ``__iter__`` when ``shuffle=True``; without it the shuffle falls back
to NumPy (see ``_permutation``), which splits and pads identically but yields a
different order than torch would.
"""

import math
import operator

__all__ = ["DistributedSampler"]

# Seeds are reduced modulo 2**64 before seeding NumPy, the same normalisation
# torch.Generator.manual_seed applies to negative seeds (it stores them as uint64).
_SEED_MOD = 1 << 64


def _permutation(n, seed):
    """Return a random permutation of range(n) as a list of Python ints, from `seed`.

    With torch importable this is exactly torch's DistributedSampler shuffle:
    ``g = torch.Generator(); g.manual_seed(seed); torch.randperm(n, generator=g)``, so
    the result is bit-identical to torch's (torch raises its own ValueError for seeds
    outside [-2**63, 2**64)). Without torch it is
    ``numpy.random.default_rng(seed % 2**64).permutation(n)``: a uniformly random
    permutation too, deterministic in `seed`, but a different one than torch's.
    Every rank must therefore make the same choice (all with torch or all without),
    or their shares would overlap. Nothing is cached, so the check is made per call.
    """
    try:
        import torch  # lazy: keep `import pyddp` free of torch
    except ImportError:
        import numpy

        return numpy.random.default_rng(seed % _SEED_MOD).permutation(n).tolist()
    g = torch.Generator()
    g.manual_seed(seed)
    return torch.randperm(n, generator=g).tolist()


def _from_process_group(what):
    """Return pyddp.get_world_size() or pyddp.get_rank() (`what` names which).

    Mirrors torch, which asks torch.distributed for the values not passed. They come
    from pyddp._group (not the package, which imports this module), imported lazily
    and by absolute name so this module stays importable on its own. Raises
    RuntimeError when the default process group is not initialized, saying how to fix
    it.
    """
    from pyddp import _group

    if not _group.is_initialized():
        raise RuntimeError(
            f"DistributedSampler: {what} was not given and the default process group "
            "is not initialized; call pyddp.init_process_group(...) first, or pass "
            "num_replicas and rank explicitly"
        )
    return getattr(_group, what)()


def _as_int(value, name):
    """Return `value` as a Python int (accepts NumPy integers); TypeError otherwise."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"DistributedSampler: {name} must be an integer, got {type(value).__name__}"
        ) from None


class DistributedSampler:
    """Sampler restricting each rank to its own share of a dataset's indices.

    Same constructor, attributes and behaviour as torch.utils.data.DistributedSampler:

    - ``num_replicas``/``rank`` default to ``pyddp.get_world_size()`` /
      ``pyddp.get_rank()``; RuntimeError if the process group is not initialized.
      ValueError unless ``0 <= rank < num_replicas``.
    - ``num_samples`` (= ``len(self)``) is ``ceil(N / num_replicas)``, or with
      ``drop_last`` and ``N % num_replicas != 0`` it is
      ``ceil((N - num_replicas) / num_replicas)``, where N = ``len(dataset)``;
      ``total_size = num_samples * num_replicas``.
    - ``__iter__`` takes ``range(N)``, shuffled with seed ``seed + epoch`` when
      ``shuffle`` (bit-identical to torch's order when torch is importable; see
      ``_permutation``), then pads to ``total_size`` by repeating the list from its
      start as many times as needed (so a dataset smaller than ``num_replicas`` is
      wrapped several times), or with ``drop_last`` truncates to ``total_size``; rank r
      gets ``indices[r:total_size:num_replicas]`` as Python ints.
    - ``set_epoch(e)`` changes the shuffle of the next iteration; call it before each
      epoch with the same value on every rank. ``seed`` must be equal on all ranks.

    Only ``len(dataset)`` is used. This is a plain iterable class rather than a
    subclass of torch.utils.data.Sampler (which would import torch); torch's DataLoader
    accepts it as ``sampler=`` all the same.
    """

    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0,
                 drop_last=False):
        if num_replicas is None:
            num_replicas = _from_process_group("get_world_size")
        if rank is None:
            rank = _from_process_group("get_rank")
        num_replicas = _as_int(num_replicas, "num_replicas")
        rank = _as_int(rank, "rank")
        if num_replicas < 1:
            # torch reports this through its rank check ("interval [0, -1]"); say why.
            raise ValueError(
                f"Invalid num_replicas {num_replicas}, num_replicas should be at least 1"
            )
        if rank >= num_replicas or rank < 0:
            raise ValueError(
                f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]"
            )
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.drop_last = drop_last
        n = len(dataset)
        if drop_last and n % num_replicas != 0:
            # Largest multiple of num_replicas below n (0 when n < num_replicas).
            self.num_samples = math.ceil((n - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.shuffle = shuffle
        self.seed = seed

    def _all_indices(self):
        """Return the padded or truncated list of total_size indices shared by all ranks."""
        n = len(self.dataset)
        if self.shuffle:
            indices = _permutation(n, self.seed + self.epoch)
        else:
            indices = list(range(n))
        if self.drop_last:
            return indices[: self.total_size]
        padding = self.total_size - n
        if padding > 0 and n > 0:
            # Repeat from the start, wrapping as often as needed. (n == 0 with padding
            # means the dataset was emptied after __init__; torch divides by zero
            # there, we leave the list short so __iter__ reports the resize.)
            indices += (indices * math.ceil(padding / n))[:padding]
        return indices

    def __iter__(self):
        """Yield this rank's indices: every num_replicas-th one, starting at rank."""
        indices = self._all_indices()
        if len(indices) != self.total_size:
            raise AssertionError(
                f"Number of indices ({len(indices)}) does not match total_size "
                f"({self.total_size}); was the dataset resized after the sampler was built?"
            )
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def __len__(self):
        """Return num_samples, the number of indices each rank yields per epoch."""
        return self.num_samples

    def set_epoch(self, epoch):
        """Set the epoch whose seed (seed + epoch) shuffles the next iteration."""
        self.epoch = epoch
