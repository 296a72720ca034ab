"""pyddp._bgthread.BackgroundThread, the thread the straggler watcher runs on (started
without waiting for it to be scheduled): it runs its function, stack dumps name it while it
runs, join() waits with a deadline and says whether the function returned, is_current()
tells the thread itself apart, and a forked child, which has no copy of the thread, does not
wait for it."""
import os
import sys
import threading
import time

from pyddp import _bgthread, _forensics


def test_runs_is_named_and_joins():
    started, release = threading.Event(), threading.Event()
    seen = {}

    def fn():
        seen["current"] = t.is_current()
        started.set()
        release.wait(30)

    t = _bgthread.BackgroundThread(fn, "test-bg")
    assert started.wait(30)
    assert seen["current"] is True and not t.is_current()
    assert t.ident in _bgthread.names
    assert "test-bg" in {s["thread"] for s in _forensics.stacks()}
    t0 = time.monotonic()
    assert t.join(0.2) is False                     # still running: the deadline holds
    assert time.monotonic() - t0 >= 0.15
    release.set()
    assert t.join(30) is True
    assert t.join(0) is True                        # and stays joined
    assert t.ident not in _bgthread.names
    assert "test-bg" not in {s["thread"] for s in _forensics.stacks()}


def test_failing_function_still_joins_and_is_reported():
    reported = []
    hook, sys.unraisablehook = sys.unraisablehook, lambda u: reported.append(u.exc_value)
    try:
        def fn():
            raise RuntimeError("from the background thread")

        t = _bgthread.BackgroundThread(fn, "test-bg-fail")
        assert t.join(30) is True
        deadline = time.monotonic() + 10
        while not reported and time.monotonic() < deadline:
            time.sleep(0.01)    # reported after the join's release, as the thread ends
    finally:
        sys.unraisablehook = hook
    assert [str(e) for e in reported] == ["from the background thread"]


def test_forked_child_does_not_wait():
    release = threading.Event()
    t = _bgthread.BackgroundThread(lambda: release.wait(60), "test-bg-fork")
    try:
        pid = os.fork()
        if pid == 0:        # the child: no such thread here, so join answers at once
            t0 = time.monotonic()
            ok = t.join(20) is True and time.monotonic() - t0 < 5 and not t.is_current()
            os._exit(0 if ok else 1)
        deadline = time.monotonic() + 30
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise AssertionError("the forked child waited for the parent's thread")
            time.sleep(0.02)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        assert t.join(0) is False                   # the parent's thread still runs
    finally:
        release.set()
        assert t.join(30) is True
