"""The process group's lifetimes under signals and concurrent teardown: a dropped Work
interrupted by Ctrl-C, Ctrl-C during the DDP drain, a signal handler that destroys the
group during backward, and a store closed during the rendezvous. Each must end within
a few seconds with an exception (never a crash, never the collective timeout of 60 s).
The scenarios run in tests/workers/lifetimes.py."""
import json

import pytest

from launch import run, spawn_ranks, PY, WORKERS


def result(res):
    for r in res:
        for line in r.output.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):]), r
    raise AssertionError("no RESULT line: " + "\n".join(r.output[-2000:] for r in res))


@pytest.mark.parametrize("scenario", ["drop_ctrl_c", "drain_ctrl_c"])
def test_ctrl_c_ends_waits_that_have_no_caller(scenario):
    out, r = result(spawn_ranks("lifetimes.py", 2, args=[scenario], timeout=60))
    assert out["cls"] == "KeyboardInterrupt", out
    assert out["seconds"] < 4, out          # SIGINT comes after 1 s; the timeout is 60 s
    if "after" in out:
        assert "aborted" in out["after"] or "broken" in out["after"], out
    assert r.returncode == 0, r.output[-2000:]


def test_signal_handler_destroying_the_group_during_backward():
    out, r = result(spawn_ranks("lifetimes.py", 2, args=["handler_destroy"], timeout=60))
    assert r.returncode == 0, r.output[-3000:]      # no crash on the way out either
    assert out["cls"] is not None and "Error" in out["cls"], out
    assert out["seconds"] < 5 and not out["initialized"], out


def test_store_closed_during_rendezvous():
    import os
    res = run([PY, os.path.join(WORKERS, "lifetimes.py"), "store_close"], timeout=60)
    out, r = result([res])
    assert res.returncode == 0, res.output[-3000:]
    assert out["cls"] is not None and out["seconds"] < 5, out
    assert "closed" in out["msg"], out
