"""Uneven inputs: torch's ``Join`` for pyddp.DistributedDataParallel (both fronts).

A rank that runs out of data leaves the others blocked in their next all-reduce. Under
a join context every rank that is still training says so at each forward (an
all-reduce of 1, the "notify"); a rank that has left its loop runs the context's loop
instead: it all-reduces 0 (so it learns how many ranks still train) and, while some
do, runs each joinable's main hook, which takes part in exactly the collectives one of
their iterations makes ("shadowing"). Once every rank has left, each joinable's post
hook runs (DDP broadcasts the model of the rank that left last). This is torch's
algorithm (``torch.distributed.algorithms.join``) with torch's names and defaults:

* :class:`Join` takes pyddp's DDP models and runs the context's all-reduces on their
  pyddp group, so no torch.distributed group is needed (``model.join()`` returns one);
  given any other joinable (torch's ``ZeroRedundancyOptimizer``) it is torch's
  ``Join``, which runs them through torch.distributed on the joinables' group.
* :class:`JoinableDDP` is what both fronts inherit: ``join()``, ``join_hook()``, the
  forward's part (:meth:`JoinableDDP._join_forward`) and the joined rank's shadow
  (:meth:`JoinableDDP._join_shadow`). The torch front is also a
  ``torch.distributed.algorithms.Joinable``, so torch's ``Join([model, optimizer])``
  works when torch.distributed's default group holds the same ranks (its
  ``join_process_group`` is that group, :func:`torch_join_group`).

What DDP itself communicates in join mode, on its own group: at each forward one
all-reduce (MAX) of [this rank, a synced backward follows, the buckets are re-planned
now, the use flags are all-reduced], which a joined rank answers with zeros (-1 for the
rank); it tells the joined ranks what to shadow and names the highest training rank,
whose buffers are broadcast (rank 0 may have left with stale ones). torch sends two
all-reduces for that; pyddp's peers are pyddp's, so one carries it all. The shadow
then re-plans the buckets if they are, broadcasts the buffers, and all-reduces zeros
for every bucket in bucket order (and the use flags). Gradients are divided by the
initial world size (``divide_by_initial_world_size=True``), else by the number of
ranks still training (the notify's result), as torch does.
"""
import collections
import warnings

import numpy as np

from .. import _C
from .. import _arrays as A
from .. import _lean
from .._errors import COLLECTIVE_FAILURES, raise_explained
from .._nccl_backend import caller_stream
from ._common import broadcast_coalesced
from ._reducer import int_array_like, wait_all

WARN_THRESHOLD = 1000

# torch's _JoinConfig's fields, and the pyddp group the context communicates on
# (None: torch's Join set the config, and torch's notify applies)
JoinConfig = collections.namedtuple(
    "JoinConfig", "enable throw_on_early_termination is_first_joinable channel")
DISABLED = JoinConfig(False, False, False, None)


class _Counted:
    """The notify of pyddp's Join: the count of ranks still training, known at once."""

    def __init__(self, n):
        self.n = n

    def count(self):
        return self.n


class _TorchCount:
    """The notify of torch's Join (a torch Work of an all-reduce of ones)."""

    def __init__(self, work):
        self._work = work

    def count(self):
        self._work.wait()
        v = self._work.get_future().value()
        return int((v[0] if isinstance(v, (list, tuple)) else v).item())


class PgChannel:
    """Small integer all-reduces on a pyddp group (DDP's), in arrays of the library
    and on the device of `like` (so NCCL groups take them too)."""

    def __init__(self, group, pg, timeout_ms, like):
        self.group, self.pg, self._timeout_ms, self._like = group, pg, timeout_ms, like

    def same(self, other):
        return other.pg is self.pg

    def all_reduce(self, values, op=_C.OP_SUM):
        """Blocking: the reduced integers. Host memory takes the lean path (run inline on
        this thread when the group is idle, no hand-off to its worker thread)."""
        a = int_array_like(self._like, values, np.int64)
        if _lean.run(self.group, _C.COLL_ALLREDUCE, a, op, 0) is _lean.NOT_TAKEN:
            w = self.pg.submit(_C.COLL_ALLREDUCE, a, None, op, 0, self._timeout_ms,
                               caller_stream(a))
            try:
                w.wait()
            except COLLECTIVE_FAILURES as e:
                raise_explained(self.group, e)
        return [int(v) for v in a.tolist()]


class Join:
    """torch.distributed.algorithms.Join for pyddp (same signature and behaviour, see the
    module's docstring): ``with Join([model]):`` around a training loop whose ranks
    have different numbers of batches. ``enable=False`` turns it off;
    ``throw_on_early_termination=True`` makes every rank raise once one has run out of
    data; other keyword arguments go to every joinable's ``join_hook`` (DDP's:
    ``divide_by_initial_world_size``). Joinables other than pyddp's DDP models make it
    torch's own Join."""

    def __init__(self, joinables, enable=True, throw_on_early_termination=False, **kwargs):
        joinables = list(joinables)
        if not joinables:
            raise _C.DistValueError("The join context manager requires at least one joinable")
        self._torch = None
        if not all(hasattr(j, "_pyddp_join_channel") for j in joinables):
            from torch.distributed.algorithms.join import Join as TorchJoin
            self._torch = TorchJoin(joinables, enable, throw_on_early_termination, **kwargs)
            return
        channel = joinables[0]._pyddp_join_channel()
        for j in joinables[1:]:
            if not channel.same(j._pyddp_join_channel()):
                raise _C.DistValueError("Join: every joinable must run on the same process "
                                        "group (these DDP models are on different ones)")
        self._hooks = [j.join_hook(**kwargs) for j in joinables]
        self._joinables, self._channel = joinables, channel
        self._enable, self._throw = enable, throw_on_early_termination
        for i, j in enumerate(joinables):
            j._join_config = JoinConfig(enable, throw_on_early_termination, i == 0, channel)

    def __enter__(self):
        if self._torch is not None:
            self._torch.__enter__()
        return self

    def __exit__(self, etype, value, tb):
        """Run the main hooks until every rank has left the loop, then the post hooks
        (nothing when disabled or when the block raised). Raises DistError (a
        RuntimeError) with throw_on_early_termination."""
        if self._torch is not None:
            return self._torch.__exit__(etype, value, tb)
        try:
            if self._enable and etype is None:
                self._join_all()
        finally:
            for j in self._joinables:   # outside the context: no notify, no count
                j._join_config = DISABLED
                j._join_count = None

    def _join_all(self):
        ch, rounds, is_last_joiner = self._channel, 0, True
        while ch.all_reduce([0])[0]:         # the ranks still training notify with 1
            if rounds == WARN_THRESHOLD + 1:
                warnings.warn(f"Detected uneven input skew of greater than {WARN_THRESHOLD}. "
                              f"This means that rank {ch.group.rank} has at least "
                              f"{WARN_THRESHOLD} fewer inputs than other currently-active "
                              f"ranks. This level of skew could lead to performance "
                              f"degradation during training.", stacklevel=3)
            if self._throw:
                ch.all_reduce([1])           # the others' check: someone has run out
                raise _C.DistError(f"Rank {ch.group.rank} exhausted all inputs.")
            for h in self._hooks:
                h.main_hook()
            is_last_joiner = False
            rounds += 1
        for h in self._hooks:
            h.post_hook(is_last_joiner)

    @staticmethod
    def notify_join_context(joinable):
        """What a joinable calls before its iteration's collectives: returns the pending
        count of ranks still training when joinable is the context's first (else None),
        and with throw_on_early_termination raises if a rank has run out."""
        return notify(joinable)


def notify(joinable):
    """Join.notify_join_context for a config of either Join (see Join)."""
    cfg = joinable._join_config
    if not cfg.enable or not cfg.is_first_joinable:
        return None
    ch = getattr(cfg, "channel", None)
    if ch is None:          # torch's Join: its all-reduces, on its group
        from torch.distributed.algorithms.join import Join as TorchJoin
        work = TorchJoin.notify_join_context(joinable)
        return None if work is None else _TorchCount(work)
    # torch's notify is asynchronous; pyddp's waits (on host memory it runs on this
    # thread, see PgChannel), so the count is known at once
    count = _Counted(ch.all_reduce([1])[0])
    if cfg.throw_on_early_termination and ch.all_reduce([0])[0]:
        raise _C.DistError("Detected at least one rank that exhausted inputs. Throwing across "
                           "all ranks.")
    return count


class DDPJoinHook:
    """DDP's join hook: the main hook shadows one iteration, the post hook broadcasts
    the final model from the rank that left last."""

    def __init__(self, ddp, divide_by_initial_world_size):
        ddp._divide_by_initial_world_size = divide_by_initial_world_size
        self.ddp = ddp

    def main_hook(self):
        self.ddp._join_shadow()

    def post_hook(self, is_last_joiner):
        self.ddp._join_final(is_last_joiner)


def torch_join_group(g):
    """torch's default group, for torch's Join over a DDP on pyddp group g: it must hold
    the same ranks in the same order. A DistValueError saying what to use otherwise."""
    import torch.distributed as dist
    if not dist.is_initialized():
        raise _C.DistValueError(
            "torch.distributed.algorithms.Join runs its all-reduces through "
            "torch.distributed, whose default process group is not initialized: use "
            "`with model.join():` or pyddp.Join([model, ...]), which run them on "
            "pyddp's group, or call torch.distributed.init_process_group first")
    if g.ranks != list(range(dist.get_world_size())) or dist.get_rank() != g.ranks[g.rank]:
        raise _C.DistValueError(
            f"torch.distributed.algorithms.Join would run its all-reduces on torch's "
            f"default group ({dist.get_world_size()} ranks), but this DDP runs on pyddp's "
            f"group of ranks {g.ranks}: use `with model.join():` or pyddp.Join([model])")
    return dist.group.WORLD


def shadow_backward(engine, used):
    """A joined rank's side of a synced backward it has no data for, on engine (a
    BucketEngine): every bucket's all-reduce, in bucket order with the bucket's dtype
    and op, on zeros of its own, then (used not None) the all-reduce of the use counts
    it contributes, whose result it returns. Waits for them. Its buckets and gradients
    are left as they are, as torch's DDP leaves them.

    The counts contributed are what the rank's last all-reduce of them left (the caller
    passes them): torch's DDP all-reduces in place the device copy of its map, which
    holds them, so a parameter some rank used before stays counted as used, and the
    ranks that train give it a .grad (zero if none of them used it) instead of leaving
    it untouched. pyddp does the same, so that results match torch's."""
    if engine._world == 1:
        return used
    works = []
    for b, bucket in enumerate(engine.buckets):
        zeros = A.empty_flat(A.for_core(bucket), A.numel(bucket))
        zeros[...] = 0
        works.append(engine._pg.submit(_C.COLL_ALLREDUCE, zeros, None,
                                       engine.bucket_rules[b][2], 0, engine._timeout_ms,
                                       caller_stream(zeros)))
    if used is not None:
        flags = int_array_like(A.for_core(engine._params[0]), used, np.int32)
        works.append(engine._pg.submit(_C.COLL_ALLREDUCE, flags, None, _C.OP_SUM, 0,
                                       engine._timeout_ms, caller_stream(flags)))
    wait_all(works)
    return None if used is None else [int(v) for v in flags.tolist()]


class JoinableDDP:
    """The join side of both DDP fronts (see the module's docstring). A front provides
    ``_sync`` (GradSync), ``_group``, ``_pg``, ``_timeout_ms``, ``_get_grad(i)``,
    ``_buffers_to_sync()`` (the buffers a forward broadcasts now, or []) and
    ``_states()`` (the parameters and buffers the final sync broadcasts)."""

    _join_config = DISABLED
    _divide_by_initial_world_size = True
    _join_count = None      # this iteration's notify: the count of ranks still training

    def join(self, divide_by_initial_world_size=True, enable=True,
             throw_on_early_termination=False):
        """A :class:`Join` context for this model alone (torch's ``DDP.join``)."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs):
        """DDP's hook for a Join (keyword divide_by_initial_world_size, default True)."""
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    def _pyddp_join_channel(self):
        return PgChannel(self._group, self._pg, self._timeout_ms,
                         A.for_core(self._sync.params[0]))

    def _join_flags(self, values):
        return self._pyddp_join_channel().all_reduce(values, _C.OP_MAX)

    def _join_forward(self, expects_sync, rebuild):
        """A training rank's forward in join mode (before the rebuild and the buffers):
        notify the context, then tell joined ranks what this iteration does. Returns
        the rank whose buffers the forward broadcasts (the highest still training)."""
        self._join_count = notify(self)
        s = self._sync
        track = int(expects_sync and (s.dynamic_unused or s.hooks.learning))
        return self._join_flags([self._group.rank, int(expects_sync), int(rebuild), track])[0]

    def _join_shadow(self):
        """A joined rank's part of one iteration of the others (the main hook)."""
        s = self._sync
        s.check_prior()
        src, sync, rebuild, track = self._join_flags([-1, 0, 0, 0])
        if rebuild:
            s.rebuild()
        bufs = self._buffers_to_sync()
        if bufs:
            broadcast_coalesced(bufs, self._pg, self._timeout_ms, src)
        self.require_forward_param_sync = bool(sync)
        if sync:
            mine = (s.synced_used or [0] * len(s.params)) if track else None
            used = shadow_backward(s.engine, mine)
            if used is not None:
                s.synced_used = used

    def _join_final(self, is_last_joiner):
        """Every rank has left: all take the parameters (and broadcast buffers) of the
        highest rank among those that left last."""
        src = self._join_flags([self._group.rank if is_last_joiner else -1])[0]
        if src < 0:
            raise _C.DistError("DDP join: no rank says it left last")
        if self._group.size > 1:
            broadcast_coalesced(self._states(), self._pg, self._timeout_ms, src)

    def _join_after_backward(self):
        """End of a synced backward in join mode: with divide_by_initial_world_size=False,
        scale the averaged gradients from the initial world size to the ranks still
        training (those a rank used; all without use flags)."""
        count, self._join_count = self._join_count, None
        if count is None or self._divide_by_initial_world_size:
            return
        world, active = self._group.size, count.count()
        if not 0 < active < world:
            return
        used = self._sync.synced_used
        for i in range(len(self._sync.params)):
            g = self._get_grad(i)
            if g is not None and (used is None or used[i]):
                g *= world / active
