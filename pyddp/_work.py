"""The handle of an asynchronous collective (``async_op=True``): :class:`Work`, over one
``_C.Work``, and :class:`Joined`, over several (the coalesced calls).

A Work finishes its call's copy-out (list outputs, arrays staged through a contiguous
copy) exactly once, on whichever thread gets there first: the caller's ``wait()`` or
``is_completed()``, or pyddp's completion thread before a done callback. A failed
collective's error is raised by ``wait()`` with the straggler report
(``_errors.raise_explained``).
"""
import threading

from ._C import DistValueError
from ._env import seconds
from ._errors import COLLECTIVE_FAILURES, raise_explained


class Work:
    """Handle of an asynchronous collective (``async_op=True``).

    ``wait(timeout=None)`` blocks until it finishes (the GIL is released; Ctrl-C aborts
    the group), raises its error if it failed, then finishes any copy-out; it returns
    True. ``is_completed()`` never blocks. Keep the handle until it completed: a
    handle dropped earlier waits for its collective when it is garbage-collected (the
    arrays it writes must stay alive until then).
    """

    _source = None      # a receive's source: a group rank, or () -> it (from any source)

    def __init__(self, work, post=None, group=None, source=None):
        self._work = work
        self._post = post
        self._done = False
        self._lock = None if post is None else threading.Lock()
        self._group = group
        self._source = source

    def source_rank(self):
        """For the Work of an irecv: the global rank its data came from (for a receive
        from any source, ``src=None``, the rank that sent it). Waits for the receive,
        raising its error if it failed."""
        if self._source is None:
            raise DistValueError("source_rank() is only for the Work of an irecv")
        self.wait()
        src = self._source() if callable(self._source) else self._source
        return self._group.ranks[src]

    def _copy_out(self):
        """Run the copy-out once, whichever thread gets here first; a second thread
        returns only after it finished (the check is under the lock for that)."""
        if self._lock is None:
            return
        with self._lock:
            post, self._post = self._post, None
            if post is not None:
                post()

    def wait(self, timeout=None):
        if not self._done:
            ms = -1 if timeout is None else int(seconds(timeout) * 1000)
            try:
                self._work.wait(ms)
            except COLLECTIVE_FAILURES as e:
                # A failed collective (not this wait's own timeout): if a peer's timeout
                # caused it, say who had not arrived and where they are.
                raise_explained(self._group if self._work.is_completed() else None, e)
            self._copy_out()
            self._done = True
        return True

    def add_done_callback(self, fn):
        """Call fn(work) once, when the collective finished and its results are in the
        caller's arrays, from pyddp's completion thread (holding the GIL), or at once
        if it already finished. In fn, ``work.exception()`` is None or the error."""
        def done(_w):
            if _w.exception() is None:
                try:
                    self._copy_out()
                except Exception as e:  # noqa: BLE001 - surfaced through fn's work
                    self._post_error = e
            fn(self)
        self._work.add_done_callback(done)

    def is_completed(self):
        """True once the collective finished and its results are in the caller's arrays
        (the copy-out of list outputs and staged arrays runs here, so a True answer
        never shows stale data). Never blocks; an error is raised by wait()."""
        if self._done:
            return True
        if not self._work.is_completed():
            return False
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - reported by wait()/exception(), not here
            pass
        return True

    def is_success(self):
        return self.is_completed() and self._work.exception() is None

    def exception(self):
        return getattr(self, "_post_error", None) or self._work.exception()


class Joined(Work):
    """One handle over several works (coalesced calls)."""

    def __init__(self, works):  # noqa: D107 - no C work of its own
        self._works = works
        self._done = False

    def wait(self, timeout=None):
        for w in self._works:
            w.wait(timeout)
        self._done = True
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self._works)

    def exception(self):
        for w in self._works:
            e = w.exception()
            if e is not None:
                return e
        return None

    def add_done_callback(self, fn):
        left = [len(self._works)]
        lock = threading.Lock()

        def one(_w):
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                fn(self)
        for w in self._works:
            w.add_done_callback(one)
