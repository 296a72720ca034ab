"""How a failed call of the "pyddp" backend reaches torch code that reads its future.

torch's ``Future.set_exception`` does not fail the future: it completes it with the
exception object as its *value* and leaves an "unwrap" function that raises it, which
only Python's ``wait()``/``value()`` apply. C++ readers see a successful future whose
value is a Python object. torch's DDP reducer is one: at the end of backward it reads
each bucket's value with ``parseCppCommHookResult``, which pickles a Python value to
find its tensors (``torch._jit_internal._extract_tensors``) and returns the first of
them without checking that there is one. So

* an error class that does not pickle (pyddp's mixed torch/pyddp classes once did)
  turns the failure into ``RuntimeError: Cannot extract tensors from value:
  PicklingError ...``, and
* an error class that does pickle yields no tensor at all, and the reducer indexes an
  empty vector: the process dies with SIGSEGV inside autograd. That is what became of
  the first attempt to make the classes importable.

So a failed call's future holds a :class:`Failed` (never the exception itself): the
unwrap function raises a fresh copy of the error, and pickling a ``Failed`` raises the
error, so a C++ reader that extracts tensors from it fails with a RuntimeError naming
the error, never with a crash or with wrong gradients. The error keeps its class for the
user in two ways: :class:`~pyddp.torch_backend._work.PyddpWork` raises the recorded
error (:func:`recorded_error`; a CUDA future has turned the pickling failure into a
C++ error of its own), and a future handed out during a backward pass
(:func:`watch_backward`) is waited for by an autograd callback queued before torch's
DDP queues its own end of backward. When one of them failed, that callback lets the
failed futures yield their output tensors to the reducer (so its end of backward runs
to completion and its hooks go quiet: a wrapper that is replaced after the error must
not fire beside its successor) and queues a second callback, which runs after the
reducer's and raises the first failure as torch's exception (``_errors.torch_error``'s
class): ``loss.backward()`` raises ``torch.distributed.DistNetworkError`` naming the
lost peer, never with the reducer's gradients taken for good ones.
"""
import threading

import torch

from .._errors import COLLECTIVE_FAILURES, raise_explained_as_torch


class Failed:
    """The value of the future of a failed call: the torch-mapped error, and the call's
    output tensors, which pickling yields only once ``yields`` is set (by the end of a
    backward that raises the error next; see the module's docstring)."""

    __slots__ = ("error", "result", "yields")

    def __init__(self, error, result):
        self.error, self.result, self.yields = error, result, False

    def __reduce__(self):
        # torch's C++ readers pickle the value to find its tensors: unless an error is
        # sure to follow, they must fail with it, not go on with these tensors (nor
        # with none, which the reducer would index anyway)
        if self.yields and self.result:
            return list, (list(self.result),)
        raise fresh(self.error)


def fresh(e):
    """A new exception of e's class and arguments with e's cause, so that raising it
    adds no frames to e (a stored error that collects frames keeps them, and the
    objects in them, alive through torch's C++ future)."""
    try:
        out = type(e)(*e.args)
    except Exception:  # noqa: BLE001 - a class that cannot be re-made: e itself
        return e
    out.__cause__ = e.__cause__
    return out


def _unwrap(value):
    if type(value) is Failed:
        raise fresh(value.error)
    return value


def fail_future(fut, error, result):
    """Complete fut (a ``torch.futures.Future`` subclass instance) as failed with error
    (already torch's class); result: the call's output tensors. Python readers get a
    fresh copy of error raised, C++ readers a value that refuses to yield tensors."""
    fut._pyddp_error = error
    fut._pyddp_failed = failed = Failed(error, result)
    fut._set_unwrap_func(_unwrap)
    fut.set_result(failed)


def recorded_error(fut, e):
    """The error fut failed with, as fail_future recorded it, else e (what reading fut
    raised: on a CUDA future, torch's own RuntimeError about the value)."""
    return getattr(fut, "_pyddp_error", None) or e


class _Backward:
    lock = threading.Lock()
    works = {}          # autograd graph task id -> the list its callback will wait for
    KEEP = 64           # tasks remembered (one whose callback never ran is forgotten)


def watch_backward(work):
    """work's future is being handed out: if that happens inside a backward pass (torch's
    DDP reducer takes its bucket futures there), the end of that backward waits for the
    work first and raises its error as torch's exception."""
    task = torch._C._current_graph_task_id()
    if task < 0:
        return
    with _Backward.lock:
        pending = _Backward.works.get(task)
        first = pending is None
        if first:
            pending = _Backward.works[task] = []
            # A backward that failed before its end never runs its callbacks: forget
            # the oldest tasks. Should one still be running, its next future makes it
            # a second list and callback, which is as correct.
            while len(_Backward.works) > _Backward.KEEP:
                del _Backward.works[min(_Backward.works)]
        pending.append(work)
    if first:
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: _end_of_backward(task, pending))


def _end_of_backward(task, works):
    """Autograd callback at the end of graph task `task`, queued before any callback the
    reducer queues after taking the futures: wait for every watched work (each ``wait``
    can be interrupted). If one failed, let the failed futures yield their tensors and
    queue the callback that raises (see the module's docstring)."""
    with _Backward.lock:
        if _Backward.works.get(task) is works:
            del _Backward.works[task]
    first = None
    for w in works:
        try:
            w.wait()
        except Exception as e:  # noqa: BLE001 - raised below, after the others
            first = first or (w, e)
            failed = getattr(w._fut, "_pyddp_failed", None)
            if failed is not None:
                failed.yields = True
    if first is not None:
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: _raise_failure(*first))


def _raise_failure(w, e):
    """Raise e, what waiting for work w raised at the end of a backward: a collective's
    failure with the straggler report of its group (which names the first failure of a
    chain: a rank that lost a peer which had aborted after losing the rank that died)."""
    if w._group is not None and isinstance(e.__cause__, COLLECTIVE_FAILURES):
        raise_explained_as_torch(w._group, e.__cause__)
    raise e
