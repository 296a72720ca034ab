"""What becomes of this process's groups when the interpreter exits without
destroy_process_group().

Mostly nothing: the process's end closes their connections, and a peer's next
collective with this rank fails at once. The exception is work still queued or running
on a group (an ``async_op=True`` handle never waited for, say): left alone, the
handle's teardown would wait for its collective until the group's timeout (30 min by
default), and the peers waiting on this rank would wait as long. So an atexit hook
(Python runs it after joining the non-daemon threads, before it tears modules down)
gives every world group this process made that still has work pending
``PYDDP_EXIT_WAIT`` seconds to finish it (peers a little behind still complete it
normally), then aborts it with one line on stderr saying what was unfinished: the work
fails at once, the process ends, and its peers fail at once too. Groups with nothing
pending are left alone. A forked child that exits skips the groups its parent made.

Then the hook leaves no pyddp thread that could run Python code once the interpreter
finalizes. Python stops such a thread when it next takes the GIL (pthread_exit); one
that was inside torch's C++ at that moment (completing a future, running a callback
chained on it) unwinds through noexcept frames and the process aborts with "terminate
called without an active exception". So the torch backend's completion pool finishes
the completions it is running and starts no more, pyddp's completion thread parks
outside Python for good, and the straggler watchers of the live groups stop (their
store connections closed, their threads joined), each within QUIESCE_S.
"""
import atexit
import os
import sys
import time
import weakref

from . import _C, _forensics

_groups = weakref.WeakSet()     # world Groups made by init or the torch backend
POLL_S = 0.005
QUIESCE_S = 5.0   # each thread's time to leave Python code at exit


def track(group):
    """Remember world group (a _group.Group over its own communicator, made in this
    process) for the check at exit."""
    group._made_in = os.getpid()
    _groups.add(group)


def _pending(groups):
    return [g for g in groups if g._pg is not None and g._pg.pending()]


def _unfinished(g):
    """'2 collectives (the oldest: all_reduce #5, 1.1 MiB of float32, running for 10.0 s)'
    for what group g still has queued or running."""
    n = g._pg.pending()
    what = f"{n} collective{'s' if n != 1 else ''}"
    try:
        left = [e for e in g._pg.flight_record() if e["state"] != "done"]
    except _C.DistError:
        left = []
    return f"{what} (the oldest: {_forensics.describe_entry(left[0])})" if left else what


def _mine():
    pid = os.getpid()
    return [g for g in list(_groups) if g._made_in == pid]


def at_exit():
    """The atexit hook (see the module's docstring). Never raises."""
    try:
        finish_pending()
    except BaseException:   # noqa: BLE001 - Ctrl-C, say: the threads still go quiet
        pass
    try:
        quiesce()
    except BaseException:   # noqa: BLE001
        pass


def quiesce():
    """Stop every pyddp thread that could run Python code during finalization: the
    torch backend's completion pool, pyddp's completion thread, the live groups'
    straggler watchers (see the module's docstring)."""
    tw = sys.modules.get("pyddp.torch_backend._work")
    if tw is not None:
        tw._DISPATCH.quiesce(QUIESCE_S)
    _C.completion_park(QUIESCE_S)
    for g in _mine():
        w = g._watcher
        if w is not None and w.group_ref() is g:
            w.stop(join_s=QUIESCE_S)


def finish_pending():
    """Give this process's world groups with work pending PYDDP_EXIT_WAIT seconds to
    finish it, then abort those that still have some, each with a line on stderr."""
    groups = _pending(_mine())
    if not groups:
        return
    wait = _C.setting("PYDDP_EXIT_WAIT")
    deadline = time.monotonic() + wait
    try:
        while groups and time.monotonic() < deadline:
            time.sleep(POLL_S)
            groups = _pending(groups)
    except KeyboardInterrupt:       # Ctrl-C while waiting: stop waiting, abort
        pass
    for g in groups:
        what = _unfinished(g)
        print(f"pyddp: rank {g._world_rank}: the process is exiting with {what} "
              f"unfinished after waiting {wait:g} s for its peers (PYDDP_EXIT_WAIT); its "
              f"process group is aborted so that the other ranks fail now instead of at "
              f"their timeout", file=sys.stderr, flush=True)
        g._pg.abort(f"its process exited with {what} unfinished")


atexit.register(at_exit)
