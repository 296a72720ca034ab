"""torch-side completion for the "pyddp" backend: the torch Work a call returns, the
future behind it, and pyddp's errors as torch's.

A call of :class:`pyddp._torch_pg.ProcessGroupPyddp` starts one or more pyddp works; a
:class:`_Completion` counts them down from pyddp's completion thread
(``Work.add_done_callback``) and then completes one ``torch.futures.Future``, with the
output tensors or with the first error as torch's exception (:func:`torch_error`), on
a small reused pool (:class:`_Dispatcher`) so that callbacks chained on the future may
wait for other collectives. :class:`PyddpWork` is the torch ``Work`` handed to torch.
"""
import collections
import os
import threading
import time

import torch
import torch.distributed as dist

from . import _C

_MIXED = {}       # (torch class, pyddp class) -> the class raised for both


def torch_error(e):
    """The exception torch code expects for pyddp's exception e: an instance of a class
    derived from both torch's DistError class (DistNetworkError, DistStoreError, else
    DistBackendError, the one torch raises for failed collectives) and e's own pyddp
    class, so ``except torch.distributed.DistBackendError``, ``except
    pyddp.CollectiveMismatchError`` and ``except TimeoutError`` (pyddp's timeouts) all
    catch it. Same message, e as its cause. Anything else (argument errors,
    KeyboardInterrupt, errors that already are torch's) is returned unchanged."""
    if isinstance(e, dist.DistError) or not isinstance(e, _C.DistError):
        return e
    if isinstance(e, _C.DistNetworkError):
        tcls = dist.DistNetworkError
    elif isinstance(e, getattr(_C, "DistStoreError", ())):
        tcls = dist.DistStoreError
    else:
        tcls = dist.DistBackendError
    pcls = type(e)
    cls = _MIXED.get((tcls, pcls))
    if cls is None:
        cls = type(pcls.__name__, (tcls, pcls), {
            "__module__": "pyddp.torch_backend",
            "__doc__": f"pyddp's {pcls.__name__} as torch's {tcls.__name__}."})
        _MIXED[(tcls, pcls)] = cls
    out = cls(str(e))
    out.__cause__ = e
    return out


def raise_as_torch(e):
    """Raise torch_error(e) with e as its cause, or e itself when it needs no mapping
    (call inside the ``except`` block that caught e)."""
    t = torch_error(e)
    if t is e:
        raise e
    raise t from e


def _raise_stored(e):
    """Raise the error e that a torch future holds as a fresh exception of the same class
    and message (cause kept), never e itself. Raising an object gives it the frames it
    passes through; e's would then hold this Work (through the frames' locals), which
    holds the future, which holds e: a cycle through torch's C++ future that the garbage
    collector cannot see, so every failed call would keep its Work, its pyddp group and
    the group's connections alive forever."""
    e.__traceback__ = None
    try:
        fresh = type(e)(*e.args)
    except Exception:  # noqa: BLE001 - a class that cannot be re-made: raise e itself
        raise e from e.__cause__
    fresh.__cause__ = e.__cause__
    raise fresh


class _Dispatcher:
    """Runs the completion of torch futures off pyddp's completion thread.

    Completing a torch future runs the callbacks chained on it with ``then()`` (DDP's
    reducer, comm hooks) on the completing thread. Some of them wait, inside the
    callback, for another collective's future (PowerSGD's hook does); if that ran on
    pyddp's single completion thread, the inner future could never complete. So
    pyddp's thread only queues the completion here, and a small pool of long-lived
    threads runs it: one thread normally (reused by every call, never one per call),
    another started only when every pool thread is busy, up to MAX_THREADS. Idle
    threads exit after IDLE_S seconds.

    The threads are daemons, so an idle one never holds up the exit; but one that is
    running torch code when the interpreter starts finalizing is stopped by Python the
    next time it takes the GIL back (pthread_exit), and the unwinding through torch's
    noexcept C++ frames aborts the process ("terminate called without an active
    exception"). So at exit (pyddp/_exit.py) :meth:`quiesce` lets running completions
    finish and starts no more."""

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


class _Completion:
    """Completes one torch future once every pyddp Work of a call has finished: with
    ``result`` (after ``post()``, if given, put results in place), or with the first
    failure as torch's exception. Whoever gets there first fires it, exactly once: the
    dispatcher, queued by pyddp's completion thread when the last work is done, or a
    thread that waited for every work itself (PyddpWork.wait: no extra thread hop)."""

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
        """pyddp's completion thread: count down; the last one queues fire()."""
        with self.lock:
            self.left -= 1
            if self.left:
                return
        _DISPATCH.submit(self.fire)

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
        if err is None:
            self.fut.set_result(self.result)
        else:
            self.fut.set_exception(torch_error(err))


def _future_for(tensors):
    """A torch future; for CUDA results it lists their devices, so a consumer's stream
    is ordered after the completion (torch records an event when it is set)."""
    devs = sorted({t.device for t in tensors if t.is_cuda}, key=lambda d: d.index or 0)
    return torch.futures.Future(devices=devs) if devs else torch.futures.Future()


class PyddpWork(dist.Work):
    """The torch Work of a pyddp-backed call. torch's own future-wrapping Work
    (``_create_work_from_future``) returns from ``wait()`` even when its future holds an
    error, so this subclass of torch's Work (pybind's trampoline routes C++ callers'
    ``wait`` and ``getFuture`` here too) waits on pyddp's works, which is interruptible
    by Ctrl-C, and then on the future, which raises the collective's error as torch's
    exception. ``get_future()`` gives the future itself (value: the output tensors)."""

    def __init__(self, fut, completion=None):
        super().__init__()
        self._fut = fut
        self._comp = completion

    def wait(self, timeout=None):
        # torch's C++ callers pass kNoTimeout, zero milliseconds, meaning "no timeout"
        if timeout is not None and _seconds(timeout) <= 0:
            timeout = None
        comp = self._comp
        if comp is not None and not self._fut.done():
            for w in comp.works:
                try:
                    w.wait(timeout)
                except Exception as e:  # noqa: BLE001 - failures go through the future
                    if not w.is_completed():          # wait(timeout) expired
                        raise_as_torch(e)
            comp.fire()
        try:
            self._fut.wait()
        except Exception as e:  # noqa: BLE001 - the collective's error, re-raised fresh
            _raise_stored(e)
        return True

    def get_future(self):
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
            e.__traceback__ = None      # no frame of ours on it (see _raise_stored)
            return e
        return None

    def result(self):
        try:
            return self._fut.value()
        except Exception as e:  # noqa: BLE001 - the collective's error, re-raised fresh
            _raise_stored(e)

    def synchronize(self):
        self.wait()

    def __repr__(self):
        state = "done" if self._fut.done() else "pending"
        return f"<pyddp Work {state}>"


def _seconds(t):
    return t.total_seconds() if hasattr(t, "total_seconds") else float(t)


def _first_error_or_empty(all_done):
    """collect_all's callback: re-raise the first member's error, else value []."""
    for f in all_done.value():
        f.value()
    return []
