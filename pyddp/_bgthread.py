"""A daemon thread that its starter does not wait for (pyddp's straggler watcher runs on
one, started at the end of init).

``threading.Thread.start()`` blocks until the new thread has taken the GIL and said it
runs. On a loaded machine, hundreds of ranks initialising on a few cores, that is a wait
for the scheduler at the end of every rank's init; here the starter goes on at once.
"""
import os
import threading
import _thread

names = {}      # ident -> name of the running BackgroundThreads, for stack dumps


class BackgroundThread:
    """A daemon thread running fn(), started by the constructor, which returns at once.
    ``name`` is what stack dumps call it (``names``); ``join(timeout)`` waits for fn to
    return. Like any daemon thread it ends with the interpreter."""

    def __init__(self, fn, name):
        self._fn, self.name, self.ident = fn, name, None
        self._pid = os.getpid()           # a forked child has not the thread
        self._done = _thread.allocate_lock()
        self._done.acquire()
        _thread.start_new_thread(self._main, ())

    def _main(self):
        self.ident = threading.get_ident()
        names[self.ident] = self.name
        try:
            self._fn()
        finally:
            names.pop(self.ident, None)
            self._done.release()

    def is_current(self):
        return self.ident == threading.get_ident() and os.getpid() == self._pid

    def join(self, timeout):
        """Wait up to timeout seconds for fn to return; whether it did (at once in a
        forked child, which has no such thread)."""
        if os.getpid() != self._pid:
            return True
        if self._done.acquire(timeout=timeout):
            self._done.release()
            return True
        return False
