"""What an in-place elastic job rolls back to and hands to new members: State and its
torch, NumPy and plain-object kinds (``pyddp.elastic.TorchState`` and the others).

A state is saved in memory at every ``commit()`` (and, when the job keeps them, on the
node's disk every k commits: ``_persist``), rolled back to that copy after a
membership change, and synced from the rank with the newest commit, so that every
rank, joiners included, goes on from identical state.
"""
import copy
import logging

import numpy as np

from .. import _C
from ._plug import Job
from .._objects import all_gather_object, broadcast_object_list
from ._torchworld import torch_mode, world_group
from . import _rng

log = logging.getLogger("pyddp")


class JoinersWaiting(Exception):
    """Raised by commit() on every rank when nodes wait to join: run() admits them."""


class Leaving(Exception):
    """Raised by commit() on every rank when ranks were sent SIGTERM: run() lets them
    go and carries on with the others from this commit."""


def membership_of_job():
    """This job's Membership, made on first use (the job's first ranks) or at a join."""
    from . import _membership
    if Job.membership is None:
        torch = torch_mode()
        g = world_group()
        store = _membership.own_connection(g._store) if torch else g._store
        if g.rank == 0:
            _refuse_a_second_job(store, f"{g._prefix}/elastic")
        m = _membership.start(store, g._prefix, g.rank, g.size)
        m.torch, m.timeout_s = torch, g._timeout_s
        m.watch(g)
        Job.membership = m
    return Job.membership


def _refuse_a_second_job(store, base):
    """Rank 0 of a job about to start in place: a job running in place in the same store
    (alive) means this process should have joined it, which happens at init only when
    pyddp.elastic was imported before init_process_group; say so instead of starting a
    second job over the first."""
    from . import _live
    rec = _live.live_job(store)
    if rec is not None and rec.get("base") != base and _live.job_alive(store, rec):
        raise _C.DistError(
            f"an in-place elastic job already runs in this job's store ({store.where}), "
            f"and this process started a new world instead of joining it: import "
            f"pyddp.elastic (from pyddp import elastic) before init_process_group, so "
            f"that init joins the running job")


def _stateful(v):
    """Whether v is an object with state (a model, an optimizer, an LR scheduler, a
    GradScaler, an EMA model, an ElasticSampler): it has state_dict/load_state_dict."""
    return not isinstance(v, type) and callable(getattr(v, "state_dict", None)) and \
        callable(getattr(v, "load_state_dict", None))


def _is_module(v):
    import sys
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(v, torch.nn.Module)


class State:
    """What an in-place job rolls back to and hands to new members. Keyword arguments
    become attributes of the state: objects with ``state_dict``/``load_state_dict``
    (models, optimizers, LR schedulers, ``GradScaler``, EMA models, ``ElasticSampler``)
    are saved through their state_dicts and restored in place, in the order given, so a
    scheduler keeps driving its optimizer; any other value (counters, picklable objects)
    is saved by deep copy. A commit also keeps this process's random number generators'
    states (torch's CPU one, NumPy's global one, Python's ``random``): they are rolled
    back per rank, never synced, so every rank keeps a stream of its own; a joiner's are
    seeded from the job and its rank. Subclasses add ``_save``/``_restore``/``_send``."""

    def __init__(self, **kwargs):
        self._objects = [k for k, v in kwargs.items() if _stateful(v)]
        self._names = [k for k in kwargs if k not in self._objects]
        for k, v in kwargs.items():
            setattr(self, k, v)
        self._commit_no = 0
        self._callbacks = []
        self._saved = None
        self._disk = None          # _persist.Disk while run() keeps copies on disk

    def register_reset_callbacks(self, callbacks):
        """Functions called (without arguments) after every membership change, once the
        new world is up and the state synced: re-make what depends on the world size
        (samplers, learning-rate scaling, new_group() groups, torch's DDP wrapper)."""
        self._callbacks.extend(callbacks)

    def on_reset(self):
        for cb in self._callbacks:
            cb()

    def save(self):
        """Keep a copy of the state in memory (commit() does this)."""
        self._saved = (self._commit_no, {k: copy.deepcopy(getattr(self, k)) for k in self._names},
                       ({k: _snapshot(getattr(self, k)) for k in self._objects},
                        _rng.capture(), self._save()))

    def restore(self):
        """Roll back to the last save or commit."""
        if self._saved is None:
            return
        self._commit_no, attrs, (objects, rng, extra) = self._saved
        for k, v in attrs.items():
            setattr(self, k, copy.deepcopy(v))
        for k in self._objects:
            _load(getattr(self, k), objects[k])
        _rng.restore(rng)
        self._restore(extra)

    def commit(self):
        """A point every rank can roll back to (collective): saves the state (on the
        node's disk too, every k commits, when run() keeps copies there), then admits
        the nodes waiting to join, if any (train(state) is then re-entered)."""
        self._commit_no += 1
        self.save()
        if self._disk is not None:
            self._disk.commit(self._commit_no, self._saved)
        m = membership_of_job()
        g = world_group()
        flag = np.zeros(2, np.int64)          # [processes waiting to join, ranks leaving]
        if g.rank == 0:
            flag[0] = m.pending_joiners()
        flag[1] = int(m.leaving)
        if g.size > 1:
            from ..collectives import ReduceOp, all_reduce
            all_reduce(flag, op=ReduceOp.SUM, group=g)
        if flag[1] > 0:
            why = f"{int(flag[1])} rank(s) leaving (SIGTERM)"
            if g.rank == 0:
                m.notice(why)
            raise Leaving(why)
        if flag[0] > 0:
            why = f"{int(flag[0])} node process(es) asked to join"
            if g.rank == 0:
                m.notice(why)
            raise JoinersWaiting(why)

    def load(self, saved):
        """Take a copy read back from disk (``_persist``) as the last commit and roll
        back to it."""
        self._saved = saved
        self.restore()

    def sync(self):
        """Make every rank's state the one of the rank with the newest commit (lowest
        rank among equals; a joiner has none), then save it (collective)."""
        g = world_group()
        if g.size == 1:
            if Job.joined:
                _rng.seed_joiner(Job.membership.base, g.rank)
            Job.joined = False
            self.save()
            return
        mine = -1 if Job.joined else self._commit_no
        nos = [None] * g.size
        all_gather_object(nos, mine, group=g)
        src = nos.index(max(nos))
        objects = [k for k in self._objects if not _is_module(getattr(self, k))]
        box = [(self._commit_no, {k: getattr(self, k) for k in self._names},
                {k: getattr(self, k).state_dict() for k in objects})
               if g.rank == src else None]
        broadcast_object_list(box, src=src, group=g)
        for k in self._objects:
            if k not in objects:
                _send_module(getattr(self, k), src, g)
        if g.rank != src:
            self._commit_no, attrs, dicts = box[0]
            for k, v in attrs.items():
                setattr(self, k, v)
            for k in objects:
                getattr(self, k).load_state_dict(dicts[k])
        self._send(src, g)
        if Job.joined:
            _rng.seed_joiner(Job.membership.base, g.rank)
        Job.joined = False
        self.save()

    def _save(self):
        return None

    def _restore(self, saved):
        pass

    def _send(self, src, group):
        pass


class ObjectState(State):
    """Only user attributes (counters, any picklable objects)."""


class TorchState(State):
    """A torch model (a module or its DDP wrapper) and optimizer, plus any other
    attributes (schedulers, a GradScaler, EMA models, an ElasticSampler, counters; see
    State). The model's parameters and buffers are sent from the source rank by
    broadcasting them in place; the optimizer's and the other objects' state_dicts by
    pickling."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        given = {k: v for k, v in (("model", model), ("optimizer", optimizer))
                 if v is not None}
        super().__init__(**given, **kwargs)
        self.model, self.optimizer = model, optimizer


def _snapshot(obj):
    """A copy of obj's state that later changes to obj do not touch."""
    if _is_module(obj):
        return {k: v.detach().clone() for k, v in obj.state_dict().items()}
    return copy.deepcopy(obj.state_dict())


def _load(obj, snap):
    """Put a _snapshot back into obj, in place (the snapshot stays usable)."""
    if _is_module(obj):
        import torch
        with torch.no_grad():
            obj.load_state_dict(snap)
    else:
        obj.load_state_dict(copy.deepcopy(snap))


def _send_module(module, src, group):
    """Broadcast a torch module's parameters and buffers from src, in place."""
    import torch
    from ..collectives import broadcast
    with torch.no_grad():
        for t in module.state_dict().values():
            broadcast(t, src=src, group=group)


class NumPyState(State):
    """NumPy (or any array-protocol) model state: ``arrays`` is a dict of name -> array
    (or an object with ``.data``), updated in place; plus user attributes."""

    def __init__(self, arrays=None, **kwargs):
        self.arrays = dict(arrays or {})
        super().__init__(**kwargs)

    def _arrays(self):
        return {k: v if hasattr(v, "shape") and hasattr(v, "dtype") else v.data
                for k, v in self.arrays.items()}

    def _save(self):
        return {k: np.array(a, copy=True) for k, a in self._arrays().items()}

    def _restore(self, saved):
        for k, a in self._arrays().items():
            a[...] = saved[k]

    def _send(self, src, group):
        from ..collectives import broadcast
        for a in self._arrays().values():
            broadcast(a, src=src, group=group)
