"""pyddp.elastic.run: the loop that keeps an in-place job training through membership
changes, and the graceful leave a SIGTERM asks for.

``run(train)`` calls ``train(state)``; a change (a peer lost, nodes joining, ranks
leaving) raises out of it on every rank, and the loop moves the process to the next
membership (``_membership``), rebuilds the default group, rolls the state back to its
last commit, syncs it from the rank with the newest commit, runs the reset callbacks
and calls ``train(state)`` again. A SIGTERM (a spot VM's notice, a platform deleting a
pod: torchrun passes it to its workers) only marks the rank as leaving; at the next
``state.commit()`` every rank learns it through the commit's own collective, the
leaving ranks answer the change as leaving and exit, and the others go on from that
commit at once (no settle wait, nothing rolled back).
"""
import functools
import gc
import logging
import signal
import threading

from .. import _C, _errors
from ._plug import Job
from .._objects import all_gather_object
from . import _membership, _persist, _torchworld
from ._state import JoinersWaiting, Leaving, membership_of_job

log = logging.getLogger("pyddp")


def joined():
    """True in a process started to join a running job (PYDDP_ELASTIC_JOIN, or its
    own launch line run again while the job runs) until ``run`` has admitted it and
    synced its state; until then its default group is this process alone."""
    return Job.joined


def _is_change(e, m, resetting=False):
    """Whether exception e is (or follows from) a membership change. When the job's
    store is lost (e itself, or the watcher saw it) it raises that error instead.
    resetting: e came from making the new world; when that world admitted joiners, any
    pyddp error there counts (a joiner that cannot take part is left out next time)."""
    if isinstance(e, (_membership.StoreLost, _membership.LeftOut)):
        raise e
    if m.store_error is not None:
        raise m.store_error from e
    if m.changed is not None:
        return True
    if resetting and m.joined_now and isinstance(e, _C.DistError):
        return True
    cls = type(e)
    if m.torch and not isinstance(e, _C.DistError) and _errors.last_failure is not None:
        cls = _errors.last_failure  # torch's DDP hands a failed all-reduce on as a plain
        #                             RuntimeError: judge the failure pyddp handed to torch
    if issubclass(cls, (_C.CollectiveMismatchError, _C.BackendUnavailableError,
                        _C.VersionMismatchError, _C.AuthenticationError, _C.DistValueError,
                        _C.DistTypeError)):
        return False
    return issubclass(cls, (_C.DistNetworkError, _C.DistBackendError, _C.DistTimeoutError))


def _reset(m, state, why):
    """Move this process to the next membership and the state to the newest commit."""
    from .. import _world
    from ..ddp._common import rebind_world
    m.timeout_s = m.timeout_s or _torchworld.timeout_s()
    rank, size, prefix, _members = m.next_world(m.timeout_s)
    m.watch(None)
    if m.torch:
        g = _torchworld.rebuild_torch(m, rank, size, prefix)
    else:
        g = _world.rebuild_world(rank, size, prefix, why)
        rebind_world()
    m.group = g
    _errors.last_failure = None
    state.restore()
    state.sync()
    m.came_up()
    log.warning("pyddp: elastic: rank %d of %d, going on from commit %d", rank, size,
                state._commit_no)
    state.on_reset()
    # A DDP wrapper the callbacks replaced often lives on in a reference cycle: torch's
    # keeps its reducer's hooks on the parameters until it is collected, and they would
    # fire beside the new wrapper's in the next backward.
    gc.collect()


def _leave(m):
    """This rank leaves (it was sent SIGTERM; every rank learnt so at a commit): its
    watcher answers the change as leaving, and once the others have closed it this
    process's part in the job ends."""
    try:
        m.next_world(m.timeout_s or _torchworld.timeout_s())
    except _membership.LeftOut:
        pass
    m.close()
    log.warning("pyddp: elastic: rank %d left the job (SIGTERM) at commit", m.rank)


def _finish(m):
    """The job is over (collective): rank 0 tells waiting joiners, and checks in at
    torchrun's exit barrier for the agents of lost founder nodes (``_agents``)."""
    from . import _agents
    g = _torchworld.world_group()
    facts = [None] * g.size
    mine = _agents.node_facts() if m.founder else None
    if g.size > 1:
        all_gather_object(facts, mine, group=g)
    else:
        facts = [mine]
    if g.rank == 0:
        m.finish()
        founders = [f for f in facts if f is not None]
        if founders:
            _agents.check_in_for_lost(g._store, {f[0] for f in founders}, founders[0][1])


class _SigTerm:
    """SIGTERM marks this rank as leaving while run() runs (main thread only); the
    handler that was there before comes back when run() returns."""

    def __init__(self, m):
        self.m, self.old = m, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGTERM, self._on_term)
        return self

    def _on_term(self, signum, frame):
        if not self.m.leaving:
            log.warning("pyddp: elastic: rank %d got SIGTERM: leaving the job at the next "
                        "commit", self.m.rank)
        self.m.leaving = True

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGTERM, self.old)


def run(func=None, *, checkpoint_dir=None, checkpoint_every=None):
    """Decorate the training function ``func(state, ...)``: it is called once, and
    again after each membership change, until it returns (its value is returned). The
    state is synced from rank 0 on the first call. In a process that joins a running
    job the call first waits for admission and syncs from the job; if the job ends
    first, it returns None without calling func. A rank sent SIGTERM leaves at its
    next commit and the call returns None there.

    checkpoint_dir / checkpoint_every (or PYDDP_ELASTIC_CHECKPOINT_DIR /
    PYDDP_ELASTIC_CHECKPOINT_EVERY): keep every k-th commit on each node's disk; a job
    started again resumes from the newest copy on any node (``_persist``). Usable as
    ``@run`` and as ``@run(checkpoint_dir=...)``."""
    if func is None:
        return functools.partial(run, checkpoint_dir=checkpoint_dir,
                                 checkpoint_every=checkpoint_every)

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        state._disk = _persist.configured(checkpoint_dir, checkpoint_every)
        m = membership_of_job()
        with _SigTerm(m):
            return _loop(m, state, func, args, kwargs)
    return wrapper


def _loop(m, state, func, args, kwargs):
    """run()'s body: enter, and re-enter after every change (see run)."""
    if m.epoch is None:           # started to join: admitted now, then synced
        try:
            _reset(m, state, "joined the job")
        except _membership.JobFinished:
            log.warning("pyddp: elastic: the job ended before it admitted this process")
            return None
    else:
        saved = state._disk.read() if state._disk is not None else None
        if saved is not None:
            state.load(saved)
        state.sync()
    while True:
        try:
            out = func(state, *args, **kwargs)
            _finish(m)
            return out
        except JoinersWaiting as e:
            why = str(e)
        except Leaving as e:
            if m.leaving:
                _leave(m)
                return None
            why = str(e)
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
                if isinstance(e, KeyboardInterrupt) or not _is_change(e, m, True):
                    raise
                why = m.changed or f"{type(e).__name__}: {e}"
                if m.changed is None:
                    m.notice(why)
