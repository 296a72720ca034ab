"""pyddp.elastic: in-place elastic training. A lost rank or host never ends the job and
a returning node is admitted, without restarting the processes that go on.

Shaped after Horovod Elastic::

    from pyddp import elastic
    state = elastic.TorchState(model=model, optimizer=opt, epoch=0)   # + user counters
    state.register_reset_callbacks([remake_sampler])

    @elastic.run                  # re-enters train(state) after a membership change
    def train(state):
        while state.epoch < EPOCHS:
            ...                   # DDP steps as usual
            state.epoch += 1
            state.commit()        # a point every rank can roll back to
    train(state)

On a change (a collective failed because a peer died or vanished, or a node asks to
join at a commit) every rank's watcher thread aborts the collective in flight, the live
ranks agree on the new membership through the store (``pyddp._membership``), the
default group is made again with dense ranks (pyddp's DDP on it follows; groups made
from the old one raise), each rank rolls back to its last commit, the state of the
rank with the newest commit is broadcast to all (so a joiner gets the model and the
optimizer from a live rank, and every rank holds identical state), the reset callbacks
run, and ``train(state)`` is called again, in the same processes.

``commit()``, ``sync()`` and the function under ``run`` are collective: every rank calls
them at the same points.
"""
import copy
import functools
import logging

import numpy as np

from . import _C, _membership
from ._group import _State, _require
from ._objects import broadcast_object_list, all_gather_object

log = logging.getLogger("pyddp")

__all__ = ["State", "ObjectState", "TorchState", "NumPyState", "run", "joined", "StoreLost"]

StoreLost = _membership.StoreLost


class _JoinersWaiting(Exception):
    """Raised by commit() on every rank when nodes wait to join: run() admits them."""


def _membership_of_job():
    """This job's Membership, made on first use (the job's first ranks) or at a join."""
    if _State.membership is None:
        g = _require()
        m = _membership.start(_State.store, _State.prefix, g.rank, g.size)
        m.watch(g)
        _State.membership = m
    return _State.membership


def joined():
    """True in a process started to join a running job (PYDDP_ELASTIC_JOIN) until
    ``run`` has admitted it and synced its state; until then its default group is this
    process alone (world size 1)."""
    return _State.joined


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
        """A point every rank can roll back to (collective): saves the state, then admits
        the nodes waiting to join, if any (train(state) is then re-entered)."""
        self._commit_no += 1
        self.save()
        m = _membership_of_job()
        g = _require()
        flag = np.zeros(1, np.int64)
        if g.rank == 0:
            flag[0] = m.pending_joiners()
        if g.size > 1:
            from .collectives import broadcast
            broadcast(flag, src=0)
        if flag[0] > 0:
            if g.rank == 0:
                m.notice(f"{int(flag[0])} node process(es) asked to join")
            raise _JoinersWaiting()

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
        from .collectives import broadcast
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
        from .collectives import broadcast
        for a in self._arrays().values():
            broadcast(a, src=src)


def _is_change(e, m):
    """Whether exception e is (or follows from) a membership change. When the job's
    store is lost (e itself, or the watcher saw it) it raises that error instead."""
    if isinstance(e, _membership.StoreLost):
        raise e
    if m.store_error is not None:
        raise m.store_error from e
    if m.changed is not None:
        return True
    if isinstance(e, (_C.CollectiveMismatchError, _C.BackendUnavailableError,
                      _C.VersionMismatchError, _C.AuthenticationError, _C.DistValueError,
                      _C.DistTypeError)):
        return False
    return isinstance(e, (_C.DistNetworkError, _C.DistBackendError, _C.DistTimeoutError))


def _reset(m, state, why):
    """Move this process to the next membership and the state to the newest commit."""
    from . import _world
    from ._ddp_common import rebind_world
    rank, size, prefix, members = m.next_world(_State.timeout_s)
    m.watch(None)
    g = _world.rebuild_world(rank, size, prefix, why)
    m.group = g
    rebind_world()
    state.restore()
    state.sync()
    log.warning("pyddp: elastic: rank %d of %d, going on from commit %d", rank, size,
                state._commit_no)
    state.on_reset()


def _finish(m):
    """The job is over (collective): rank 0 tells waiting joiners, and checks in at
    torchrun's exit barrier for the agents of lost founder nodes (``_agents``)."""
    from . import _agents
    g = _require()
    facts = [None] * g.size
    mine = _agents.node_facts() if m.founder else None
    if g.size > 1:
        all_gather_object(facts, mine)
    else:
        facts = [mine]
    if g.rank == 0:
        m.finish()
        founders = [f for f in facts if f is not None]
        if founders:
            _agents.check_in_for_lost(_State.store, {f[0] for f in founders}, founders[0][1])


def run(func):
    """Decorate the training function ``func(state, ...)``: it is called once, and
    again after each membership change, until it returns (its value is returned). The
    state is synced from rank 0 on the first call. In a process started to join
    (PYDDP_ELASTIC_JOIN) the call first waits for admission and syncs from the job; if
    the job ends first, it returns None without calling func."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        m = _membership_of_job()
        if m.epoch is None:           # started to join: admitted now, then synced
            try:
                _reset(m, state, "joined the job")
            except _membership.JobFinished:
                log.warning("pyddp: elastic: the job ended before it admitted this process")
                return None
        else:
            state.sync()
        while True:
            try:
                out = func(state, *args, **kwargs)
                _finish(m)
                return out
            except _JoinersWaiting:
                why = "nodes joined"
            except BaseException as e:
                if isinstance(e, KeyboardInterrupt) or not _is_change(e, m):
                    raise
                why = m.changed or f"{type(e).__name__}: {e}"
                if m.changed is None:
                    log.warning("pyddp: elastic: rank %d: %s", m.rank, why)
                    m.notice(why)
            while True:     # a change during the reset: the next epoch's change
                try:
                    _reset(m, state, why)
                    break
                except BaseException as e:
                    if isinstance(e, KeyboardInterrupt) or not _is_change(e, m):
                        raise
                    why = m.changed or f"{type(e).__name__}: {e}"
                    if m.changed is None:
                        m.notice(why)
    return wrapper
