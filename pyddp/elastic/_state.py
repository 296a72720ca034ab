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

from .._group import _State, _require
from .._objects import all_gather_object, broadcast_object_list
from . import _persist

log = logging.getLogger("pyddp")


class JoinersWaiting(Exception):
    """Raised by commit() on every rank when nodes wait to join: run() admits them."""


class Leaving(Exception):
    """Raised by commit() on every rank when ranks were sent SIGTERM: run() lets them
    go and carries on with the others from this commit."""


def membership_of_job():
    """This job's Membership, made on first use (the job's first ranks) or at a join."""
    from . import _membership
    if _State.membership is None:
        g = _require()
        m = _membership.start(_State.store, _State.prefix, g.rank, g.size)
        m.watch(g)
        _State.membership = m
    return _State.membership


class State:
    """What an in-place job rolls back to and hands to new members: user attributes
    (keyword arguments, saved by deep copy and sent by pickling) plus what subclasses
    add. Subclasses implement ``_save``/``_restore``/``_send``."""

    def __init__(self, **kwargs):
        self._names = list(kwargs)
        for k, v in kwargs.items():
            setattr(self, k, v)
        self._commit_no = 0
        self._callbacks = []
        self._saved = None
        self._disk = None          # _persist.Disk while run() keeps copies on disk

    def register_reset_callbacks(self, callbacks):
        """Functions called (without arguments) after every membership change, once the
        new world is up and the state synced: re-make what depends on the world size
        (samplers, learning-rate scaling, new_group() groups)."""
        self._callbacks.extend(callbacks)

    def on_reset(self):
        for cb in self._callbacks:
            cb()

    def save(self):
        """Keep a copy of the state in memory (commit() does this)."""
        self._saved = (self._commit_no, {k: copy.deepcopy(getattr(self, k)) for k in self._names},
                       self._save())

    def restore(self):
        """Roll back to the last save or commit."""
        if self._saved is None:
            return
        self._commit_no, attrs, extra = self._saved
        for k, v in attrs.items():
            setattr(self, k, copy.deepcopy(v))
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
        g = _require()
        flag = np.zeros(2, np.int64)          # [processes waiting to join, ranks leaving]
        if g.rank == 0:
            flag[0] = m.pending_joiners()
        flag[1] = int(m.leaving)
        if g.size > 1:
            from ..collectives import ReduceOp, all_reduce
            all_reduce(flag, op=ReduceOp.SUM)
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
        g = _require()
        if g.size == 1:
            _State.joined = False
            self.save()
            return
        mine = -1 if _State.joined else self._commit_no
        nos = [None] * g.size
        all_gather_object(nos, mine)
        src = nos.index(max(nos))
        box = [(self._commit_no, {k: getattr(self, k) for k in self._names})
               if g.rank == src else None]
        broadcast_object_list(box, src=src)
        if g.rank != src:
            self._commit_no, attrs = box[0]
            for k, v in attrs.items():
                setattr(self, k, v)
        self._send(src)
        _State.joined = False
        self.save()

    def _save(self):
        return None

    def _restore(self, saved):
        pass

    def _send(self, src):
        pass


class ObjectState(State):
    """Only user attributes (counters, any picklable objects)."""


class TorchState(State):
    """A torch model (a module or its DDP wrapper) and optimizer, plus user attributes.
    Saved by copying their state_dicts in memory; sent from the source rank by
    broadcasting the parameters and buffers in place and pickling the optimizer's
    state."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        self.model, self.optimizer = model, optimizer
        super().__init__(**kwargs)

    def _save(self):
        m = {k: v.detach().clone() for k, v in self.model.state_dict().items()} \
            if self.model is not None else None
        o = copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None
        return m, o

    def _restore(self, saved):
        import torch
        m, o = saved
        if m is not None:
            with torch.no_grad():
                self.model.load_state_dict(m)
        if o is not None:
            self.optimizer.load_state_dict(copy.deepcopy(o))

    def _send(self, src):
        import torch
        from ..collectives import broadcast
        g = _require()
        if self.model is not None:
            with torch.no_grad():
                for t in self.model.state_dict().values():
                    broadcast(t, src=src)
        if self.optimizer is not None:
            box = [self.optimizer.state_dict() if g.rank == src else None]
            broadcast_object_list(box, src=src)
            if g.rank != src:
                self.optimizer.load_state_dict(box[0])


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

    def _send(self, src):
        from ..collectives import broadcast
        for a in self._arrays().values():
            broadcast(a, src=src)
