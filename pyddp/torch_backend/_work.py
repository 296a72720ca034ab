"""torch-side completion for the "pyddp" backend: the torch Work a call returns and the
future behind it.

A call of :class:`pyddp.torch_backend._pg.ProcessGroupPyddp` starts one or more works (a
``_C.Work`` on the thin path, ``collectives.Work`` handles on the general one). A
completion (:class:`_One` for one ``_C.Work``, :class:`_Completion` for several) hears
of the end from pyddp's completion thread (``add_done_callback``) and completes one
``torch.futures.Future`` with the output tensors, or with the first error as torch's
exception (``_errors.torch_error``, delivered as ``_failure`` explains):

* on the completion thread itself, unless Python code chained a callback on the future
  (``then()``/``add_done_callback()``: a comm hook such as PowerSGD, which waits inside
  its callback for another collective, whose own completion that thread must deliver);
* then on a small reused pool (:class:`_Dispatcher`) instead.

A thread that waits for the works itself (:meth:`PyddpWork.wait`) completes the future
on the spot, whoever is first: no thread hop at all. :class:`PyddpWork` is the torch
``Work`` handed to torch.
"""
import collections
import os
import threading
import time

import torch
import torch.distributed as dist

from .._env import seconds
from .._errors import COLLECTIVE_FAILURES, raise_as_torch, torch_error
from ._failure import fail_future, fresh, recorded_error, watch_backward

_LOCK = threading.Lock()        # a future's _chained / _completing, for every future


class _Future(torch.futures.Future):
    """torch's future for a pyddp call, which knows whether Python code chained a
    callback on it: those callbacks may block (see the module's docstring), so such a
    future is completed on the pool; any other (no callback, or torch's C++ ones: DDP's
    reducer, collect_all) is completed where the call ended."""

    _chained = False        # then()/add_done_callback() was called: complete on the pool
    _completing = False     # the completion thread chose to complete it where it is

    def then(self, callback):
        self._chain()
        return super().then(callback)

    def add_done_callback(self, callback):
        self._chain()
        return super().add_done_callback(callback)

    def _chain(self):
        """From now on the future completes on the pool. If pyddp's completion thread
        already chose to complete it itself, wait until it has (a few microseconds),
        so that the callback, chained on a completed future, runs on this thread."""
        with _LOCK:
            self._chained = True
            completing = self._completing
        while completing and not self.done():
            time.sleep(0.0001)


def _deliver(fut, fire):
    """pyddp's completion thread: call fire(), which completes fut, here or, when Python
    callbacks are chained on fut, on the pool."""
    with _LOCK:
        pool = fut._chained
        if not pool:
            fut._completing = True
    if pool:
        _DISPATCH.submit(fire)
    else:
        fire()


class _Dispatcher:
    """Runs the completion of futures with chained Python callbacks off pyddp's
    completion thread (see the module's docstring): one thread normally (reused by every
    call, never one per call), another started only when every pool thread is busy, up
    to MAX_THREADS. Idle threads exit after IDLE_S seconds.

    The threads are daemons, so an idle one never holds up the exit; but one that is
    running torch code when the interpreter starts finalizing is stopped by Python the
    next time it takes the GIL back (pthread_exit), and the unwinding through torch's
    noexcept C++ frames aborts the process ("terminate called without an active
    exception"). So at exit (pyddp/_exit.py) :meth:`quiesce` lets running completions
    finish and starts no more; pyddp's completion thread, which completes the other
    futures, is parked there too (``_C.completion_park``)."""

    MAX_THREADS = 32
    IDLE_S = 30.0

    def __init__(self):
        self._cv = threading.Condition()
        self._queue = collections.deque()
        self._idle = 0
        self._threads = 0
        self._busy = 0          # completions running now (pool threads or inline)
        self._stopping = False  # quiesce() was called: run nothing more

    def submit(self, fn):
        """Queue fn() to run on a pool thread (started if none is idle); after quiesce()
        drop it (the interpreter is exiting: nobody is left to wait for the future)."""
        with self._cv:
            if self._stopping:
                return
            self._queue.append(fn)
            if self._idle > len(self._queue) - 1:
                self._cv.notify()
                return
            if self._threads >= self.MAX_THREADS:
                return          # runs when a busy thread frees up
            self._threads += 1
        try:
            threading.Thread(target=self._loop, name="pyddp-torch-completion",
                             daemon=True).start()
        except RuntimeError:    # cannot start threads (interpreter shutting down)
            with self._cv:
                self._threads -= 1
            self._run_queued()

    def _take(self):
        """The next queued call, counted as running (cv held); None if nothing is
        queued or quiesce() was called."""
        if not self._queue or self._stopping:
            return None
        self._busy += 1
        return self._queue.popleft()

    def _done(self):
        with self._cv:
            self._busy -= 1
            if self._stopping:
                self._cv.notify_all()     # quiesce() waits for the running ones

    def _run_queued(self):
        while True:
            with self._cv:
                fn = self._take()
            if fn is None:
                return
            try:
                fn()
            finally:
                self._done()

    def _loop(self):
        while True:
            with self._cv:
                self._idle += 1
                deadline = time.monotonic() + self.IDLE_S
                while (fn := self._take()) is None:
                    left = deadline - time.monotonic()
                    if left <= 0 or self._stopping:
                        self._idle -= 1
                        self._threads -= 1
                        return
                    self._cv.wait(left)
                self._idle -= 1
            try:
                fn()
            finally:
                fn = None   # an idle thread must not keep the last call's objects alive
                self._done()

    def quiesce(self, timeout_s):
        """At interpreter exit: run no more completions (queued ones are dropped, later
        ones refused), wait up to timeout_s for the running ones to return, and say
        whether none is running any more."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            self._stopping = True
            self._queue.clear()
            self._cv.notify_all()
            while self._busy and time.monotonic() < deadline:
                self._cv.wait(deadline - time.monotonic())
            return self._busy == 0

    def _after_fork(self):
        self.__init__()         # the pool's threads do not exist in a forked child


_DISPATCH = _Dispatcher()
os.register_at_fork(after_in_child=_DISPATCH._after_fork)


class _One:
    """The completion of a thin-path call: one ``_C.Work``, whose end completes fut with
    result (the output tensors), or with its error as torch's. fire() runs once, on
    whichever thread gets there first: pyddp's completion thread (through _deliver) or
    one that waited for the work (wait())."""

    __slots__ = ("fut", "work", "result", "_left")

    def __init__(self, fut, work, result):
        self.fut, self.work, self.result = fut, work, result
        self._left = [None]         # popped by the one fire() that completes fut
        work.add_done_callback(self._done)

    def _done(self, _work):
        _deliver(self.fut, self.fire)

    def wait(self, timeout):
        """Block until the work finished (timeout: seconds, None for no limit; its
        expiry raises torch's DistBackendError family), then complete the future."""
        try:
            self.work.wait(-1 if timeout is None else int(timeout * 1000))
        except Exception as e:  # noqa: BLE001 - failures go through the future
            if not self.work.is_completed():          # wait(timeout) expired
                raise_as_torch(e)
        self.fire()

    def fire(self):
        try:
            self._left.pop()
        except IndexError:
            return
        _settle(self.fut, self.work.exception(), self.result)


class _Completion:
    """The completion of a general-path call: completes one torch future once every
    pyddp Work (``collectives.Work``) of the call has finished, with ``result`` (after
    ``post()``, if given, put results in place), or with the first failure as torch's
    exception. fire() runs once, as for :class:`_One`."""

    def __init__(self, fut, works, result, post=None):
        self.fut, self.works, self.result, self.post = fut, list(works), result, post
        self.left = len(self.works)
        self.fired = False
        self.lock = threading.Lock()
        if not self.works:
            self.fire()
        for w in self.works:
            w.add_done_callback(self._one)

    def _one(self, work):
        """pyddp's completion thread: count down; the last one delivers fire()."""
        with self.lock:
            self.left -= 1
            if self.left:
                return
        _deliver(self.fut, self.fire)

    def wait(self, timeout):
        """Block until every work finished (timeout: seconds each, None for no limit),
        then complete the future."""
        for w in self.works:
            try:
                w.wait(timeout)
            except Exception as e:  # noqa: BLE001 - failures go through the future
                if not w.is_completed():          # wait(timeout) expired
                    raise_as_torch(e)
        self.fire()

    def fire(self):
        """Complete the future (once; later calls return at once). Every work must have
        finished."""
        with self.lock:
            if self.fired:
                return
            self.fired = True
        err = next((e for e in (w.exception() for w in self.works) if e is not None), None)
        if err is None and self.post is not None:
            try:
                self.post()
            except Exception as e:  # noqa: BLE001 - reported through the future
                err = e
        _settle(self.fut, err, self.result)


def _settle(fut, err, result):
    """Complete fut with result, or with err (pyddp's) as torch's exception. Should that
    fail, fut gets the failure instead: a future left pending would hang its waiter
    (DDP's end of backward) for good."""
    try:
        if err is None:
            fut.set_result(result)
        else:
            fail_future(fut, torch_error(err), result)
    except Exception as e:  # noqa: BLE001 - the waiter must wake
        if not fut.done():
            fut.set_exception(e)


def refused(e, result, group):
    """For a call whose submission raised e: a collective failure (the group is broken)
    gives the call's torch Work, its future failed with e as torch's error, as if the
    call itself had failed: torch's C++ callers (DDP's reducer, inside backward) look for
    failures there, and an exception out of their call would leave them half way.
    result: the call's output tensors; group: its pyddp Group. Anything else (a bad
    argument) is raised as torch's error."""
    if not isinstance(e, COLLECTIVE_FAILURES):
        raise_as_torch(e)
    fut = future_for(result)
    _settle(fut, e, result)
    return PyddpWork(fut, None, group)


def future_for(tensors):
    """A future for a call with these output tensors; for CUDA results it lists their
    devices, so a consumer's stream is ordered after the completion (torch records an
    event when it is set)."""
    for t in tensors:
        if t.is_cuda:
            devs = sorted({t.device for t in tensors if t.is_cuda}, key=lambda d: d.index or 0)
            return _Future(devices=devs)
    return _Future()


class PyddpWork(dist.Work):
    """The torch Work of a pyddp-backed call. torch's own future-wrapping Work
    (``_create_work_from_future``) returns from ``wait()`` even when its future holds an
    error, so this subclass of torch's Work (pybind's trampoline routes C++ callers'
    ``wait`` and ``getFuture`` here too) waits on pyddp's works, which is interruptible
    by Ctrl-C, completes the future itself, and then raises the collective's error as
    torch's exception. ``get_future()`` gives the future (value: the output tensors).
    group: the pyddp Group the call ran on, for the straggler report of a failure that
    surfaces at the end of a backward pass (``_failure.watch_backward``)."""

    _source = None      # receive from any source: () -> the sender's group rank

    def __init__(self, fut, completion=None, group=None):
        super().__init__()
        self._fut = fut
        self._comp = completion
        self._group = group

    def _source_rank(self):
        """For a receive from any source (``recv_anysource``): the sender's group rank,
        after waiting for the receive (torch's recv reads it so)."""
        if self._source is None:
            raise ValueError("_source_rank() is only for the Work of a receive from any "
                             "source")
        self.wait()
        return self._source()

    source_rank = _source_rank

    def wait(self, timeout=None):
        # torch's C++ callers pass kNoTimeout, zero milliseconds, meaning "no timeout"
        t = None if timeout is None else seconds(timeout)
        if t is not None and t <= 0:
            t = None
        comp = self._comp
        if comp is not None and not self._fut.done():
            comp.wait(t)
        try:
            self._fut.wait()
        except Exception as e:  # noqa: BLE001 - the collective's error, re-raised fresh
            _raise_stored(recorded_error(self._fut, e))
        return True

    def get_future(self):
        watch_backward(self)
        return self._fut

    def is_completed(self):
        return self._fut.done()

    def is_success(self):
        return self._fut.done() and self.exception() is None

    def exception(self):
        if not self._fut.done():
            return None
        try:
            self._fut.value()
        except Exception as e:  # noqa: BLE001 - the stored error, returned
            return fresh(recorded_error(self._fut, e))
        return None

    def result(self):
        try:
            return self._fut.value()
        except Exception as e:  # noqa: BLE001 - the collective's error, re-raised fresh
            _raise_stored(recorded_error(self._fut, e))

    def synchronize(self):
        self.wait()

    def __repr__(self):
        state = "done" if self._fut.done() else "pending"
        return f"<pyddp Work {state}>"


def _raise_stored(e):
    """Raise the error e that a torch future holds as a fresh exception of the same class
    and message (cause kept), never e itself. Raising an object gives it the frames it
    passes through; e's would then hold this Work (through the frames' locals), which
    holds the future, which holds e: a cycle through torch's C++ future that the garbage
    collector cannot see, so every failed call would keep its Work, its pyddp group and
    the group's connections alive forever."""
    e.__traceback__ = None
    raise fresh(e)


def first_error_or_empty(all_done):
    """collect_all's callback: re-raise the first member's error, else value []."""
    for f in all_done.value():
        f.value()
    return []
