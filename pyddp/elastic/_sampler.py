"""ElasticSampler: a DistributedSampler that follows the world size and its position in
the epoch, so that an in-place elastic job applies every sample of every epoch once,
whatever changes happen and however often it commits.

The epoch's order is DistributedSampler's (``range(N)`` shuffled with ``seed + epoch``,
torch's generator when torch is importable). The sampler keeps one number, ``done``:
how many samples at the start of that order the job has trained. Each iteration hands
rank r of W the samples ``order[done + r :: W]`` (padded like DistributedSampler to a
multiple of W, or with drop_last truncated), reading W and r from the process group
when the iteration starts, so a DataLoader made once follows every change. After each
step the script calls ``record_batch(i, batch_size)``; since the ranks take the samples
in turn, after k batches of b the job has trained exactly the first ``done + k*b*W``
samples of the order: a prefix, whatever W is. The sampler's ``state_dict`` is
``{epoch, done}``: put it in the elastic state, and a rollback to a commit rolls the
position back with the model, and a new world goes on from there.
"""
import math

from ..sampler import _as_int, _permutation

__all__ = ["ElasticSampler"]


def _world():
    """(world size, rank) of pyddp's default group, or of torch.distributed's."""
    from .. import _group
    if _group.is_initialized():
        return _group.get_world_size(), _group.get_rank()
    import sys
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    raise RuntimeError("ElasticSampler: no process group is initialized; call "
                       "init_process_group first")


class ElasticSampler:
    """A sampler whose shares follow the world size and the position reached in the
    epoch (see the module's docstring). Use it as DataLoader's ``sampler=``, call
    ``set_epoch(e)`` at the start of each epoch and ``record_batch(i, batch_size)`` after
    each step (i counts the batches of the current iteration from 0), and give it to
    the elastic state (``TorchState(..., sampler=sampler)``)."""

    def __init__(self, dataset, shuffle=True, seed=0, drop_last=False):
        self.dataset = dataset
        self.shuffle, self.seed, self.drop_last = shuffle, _as_int(seed, "seed"), drop_last
        self.epoch = 0
        self.done = 0              # samples of the epoch's order trained so far
        self._start = 0            # done when the current iteration began
        self._size = 1             # the world size of the current iteration

    def set_epoch(self, epoch):
        """Start epoch (its shuffle); calling it again with the same epoch, as a training
        function re-entered after a change does, keeps the position."""
        epoch = _as_int(epoch, "epoch")
        if epoch != self.epoch:
            self.epoch, self.done = epoch, 0

    def record_batch(self, batch_idx, batch_size):
        """Every rank trained batch batch_idx (from 0 in this iteration) of batch_size
        samples: the job has now trained that many more of the order on every rank."""
        n = len(self.dataset)
        self.done = min(n, self._start + (batch_idx + 1) * batch_size * self._size)

    def _rest(self, size):
        """The samples of the epoch's order not trained yet, padded or truncated to a
        multiple of size."""
        n = len(self.dataset)
        order = _permutation(n, self.seed + self.epoch) if self.shuffle else list(range(n))
        rest = order[self.done:]
        if self.drop_last:
            return rest[: len(rest) - len(rest) % size]
        pad = -len(rest) % size
        if pad and rest:
            rest += (rest * math.ceil(pad / len(rest)))[:pad]
        return rest

    def __iter__(self):
        size, rank = _world()
        self._start, self._size = self.done, size
        return iter(self._rest(size)[rank::size])

    def __len__(self):
        size, _ = _world()
        rest = len(self.dataset) - self.done
        return rest // size if self.drop_last else math.ceil(rest / size)

    def state_dict(self):
        """The position: {"epoch", "done"}."""
        return {"epoch": self.epoch, "done": self.done}

    def load_state_dict(self, state):
        self.epoch, self.done = int(state["epoch"]), int(state["done"])
