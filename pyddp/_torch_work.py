"""torch-side completion for the "pyddp" backend: the torch Work a call returns, the
future behind it, and pyddp's errors as torch's.

A call of :class:`pyddp._torch_pg.ProcessGroupPyddp` starts one or more pyddp works; a
:class:`_Completion` counts them down from pyddp's completion thread
(``Work.add_done_callback``) and then completes one ``torch.futures.Future``, with the
output tensors or with the first error as torch's exception (:func:`torch_error`).
:class:`PyddpWork` is the torch ``Work`` handed back to torch.
"""
import threading

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


class _Completion:
    """Completes one torch future once every pyddp Work of a call has finished: with
    ``result`` (after ``post()``, if given, copied results into place), or with the
    first failure as torch's exception. pyddp calls ``done`` from its worker thread
    (holding the GIL), or at once when the work already finished."""

    def __init__(self, fut, n, result, post):
        self.fut, self.left, self.result, self.post = fut, n, result, post
        self.error = None
        self.lock = threading.Lock()

    def done(self, work):
        exc = work.exception()
        with self.lock:
            if exc is not None and self.error is None:
                self.error = exc
            self.left -= 1
            if self.left:
                return
        err = self.error
        if err is None and self.post is not None:
            try:
                self.post()
            except BaseException as e:  # noqa: BLE001 - reported through the future
                err = e
        if err is None:
            self.fut.set_result(self.result)
        else:
            self.fut.set_exception(torch_error(err) if isinstance(err, Exception)
                                   else RuntimeError(str(err)))


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

    def __init__(self, fut, works=()):
        super().__init__()
        self._fut = fut
        self._works = list(works)

    def wait(self, timeout=None):
        # torch's C++ callers pass kNoTimeout, zero milliseconds, meaning "no timeout"
        if timeout is not None and _seconds(timeout) <= 0:
            timeout = None
        for w in self._works:
            try:
                w.wait(timeout)
            except Exception as e:  # noqa: BLE001 - a timeout here is the caller's
                if not self._fut.done():
                    raise torch_error(e) from e
        self._fut.wait()
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
            return e
        return None

    def result(self):
        return self._fut.value()

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


class _NoWorkType:
    """Stands for 'nothing to wait for' in _Completion.done."""

    @staticmethod
    def exception():
        return None


_NoWork = _NoWorkType()


def _when_done(work, fn):
    """Call fn(work) once work finished with its results in place: from pyddp's worker
    through Work.add_done_callback, or (a pyddp without it) by waiting here."""
    add = getattr(work, "add_done_callback", None)
    if add is not None:
        add(fn)
        return
    try:
        work.wait()
    except Exception:  # noqa: BLE001 - fn reads it through work.exception()
        pass
    fn(work)
