"""Clean exits, every time: rounds of fresh rank processes at 3 ranks that init, work
and exit, where every rank's exit status and stderr are checked every round.

* 50 rounds of init_process_group("cpu"), collectives and DDP steps on a NumPy model
  (checked against NumPy), destroy_process_group and exit; 10 more with DDP on a torch
  model: status 0, nothing on stderr (no "terminate called", no sanitizer or abort
  text, no traceback, no "Exception ignored"), and a prompt exit.
* 20 rounds that exit without destroy_process_group (some with a DDP model, an
  unfinished async all_reduce or a subgroup left alive): status 0, nothing on stderr,
  prompt.
* 20 rounds where one rank fails while the others are in an all_reduce or DDP's
  gradient sync (a Python exception, os._exit(3) or SIGKILL; rank 1, 2 or 0, the
  store's host): every other rank raises a pyddp.DistError within moments and exits 0;
  the failing rank's status is what its failure makes it (1, 3, killed by SIGKILL).
* 2 rounds where every rank but the last exits with an async all_reduce the last one
  never joins: each exits PYDDP_EXIT_WAIT (0.5 s here) later with one line on stderr
  saying what it left unfinished, not at the collective's timeout, and the last rank's
  all_reduce then fails at once.
* 6 rounds of torch.distributed.init_process_group("pyddp"): with destroy, without, and
  without while async all_reduces (with future callbacks) are still running.
* 2 rounds of fresh interpreters (no fork), started by tests/launch.py.

The rounds are forked by tests/workers/exits.py from one launcher per test that has
imported everything once (tests/launch.py runs the launcher, with its timeout and
kill by process group); a round's ranks run concurrently.
"""
import json
import os

import pytest

import pyddp
from launch import PY, WORKERS, run, spawn_ranks

WS = 3
# One BLAS/OpenMP thread: the launcher must have no thread but its own when it forks
# (and three ranks share two cores).
ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# EXITING line to reaped: measured about 0.05 s, and 0.3-2.4 s with torch loaded (its
# teardown), on two busy cores; pyddp's timeout in these rounds is 30 s.
EXIT_S = {"torch_ddp": 10.0, "torch": 10.0}
FAIL_S = 5.0     # a survivor's error after its all_reduce began (pyddp's timeout: 30 s)
EXIT_WAIT = 0.5  # PYDDP_EXIT_WAIT of the abandon rounds (tests/workers/exits.py)


def launch(kind, n, timeout):
    """n rounds of kind through the launcher: their reports (dicts), in order."""
    res = run([PY, os.path.join(WORKERS, "exits.py"), "launch", kind, str(n)], env=ENV,
              timeout=timeout)
    assert res.returncode == 0, res.output[-6000:]
    lines = res.stdout.splitlines()
    rounds = [json.loads(ln[len("ROUND "):]) for ln in lines if ln.startswith("ROUND ")]
    assert len(rounds) == n and lines[-1] == "DONE", res.output[-6000:]
    return rounds


def about(rnd, rank=None):
    """A round (or one rank of it) for an assertion message."""
    ranks = rnd["ranks"] if rank is None else [rnd["ranks"][rank]]
    parts = [f"round {rnd['round']} of {rnd['kind']} {rnd['variant']}:"]
    for r in ranks:
        parts.append(f"--- rank {r['rank']}: status {r['status']}, hung {r['hung']}, "
                     f"exit {r['exit_s']} s\n{r['stdout_tail']}\n--- stderr\n{r['stderr']}")
    return "\n".join(parts)


def assert_clean(rnd, rank):
    """rank of rnd exited by itself with status 0, promptly, and said nothing on stderr."""
    r = rnd["ranks"][rank]
    assert r["status"] == 0 and not r["hung"], about(rnd, rank)
    assert r["stderr"] == "", about(rnd, rank)
    limit = EXIT_S.get(rnd["kind"], 5.0)
    assert r["exit_s"] is not None and r["exit_s"] < limit, about(rnd, rank)


def assert_all_clean(rounds):
    for rnd in rounds:
        for rank in range(WS):
            assert_clean(rnd, rank)


def test_init_work_destroy_exit_numpy_ddp():
    assert_all_clean(launch("full", 50, timeout=300))


def test_init_work_destroy_exit_torch_ddp():
    assert_all_clean(launch("torch_ddp", 10, timeout=240))


def test_exit_without_destroy():
    rounds = launch("nodestroy", 20, timeout=240)
    assert {r["variant"]["alive"] for r in rounds} == {"nothing", "async_work", "numpy_ddp",
                                                     "subgroup"}
    assert_all_clean(rounds)


def test_torch_backend_init_work_exit():
    rounds = launch("torch", 6, timeout=240)
    assert {r["variant"]["end"] for r in rounds} == {"destroy", "exit", "exit_async"}
    assert_all_clean(rounds)


def raised(rnd, rank):
    """The one RAISED report of rank in rnd (a dict: cls, secs, msg)."""
    marks = [json.loads(m[len("RAISED "):]) for m in rnd["ranks"][rank]["marks"]
             if m.startswith("RAISED ")]
    assert len(marks) == 1, about(rnd, rank)
    return marks[0]


def assert_dist_error(rnd, rank, named):
    """rank raised a pyddp.DistError whose message holds named, within FAIL_S."""
    err = raised(rnd, rank)
    assert issubclass(getattr(pyddp, err["cls"]), pyddp.DistError), about(rnd, rank)
    assert named in err["msg"], about(rnd, rank)
    assert err["secs"] < FAIL_S, about(rnd, rank)


def test_exit_with_a_collective_nobody_joins():
    for rnd in launch("abandon", 2, timeout=120):
        for rank in range(WS - 1):
            r = rnd["ranks"][rank]
            assert r["status"] == 0 and not r["hung"], about(rnd, rank)
            assert EXIT_WAIT <= r["exit_s"] < EXIT_WAIT + 2.0, about(rnd, rank)
            lines = r["stderr"].splitlines()
            assert len(lines) == 1 and lines[0].startswith(
                f"pyddp: rank {rank}: the process is exiting with 1 collective (the "
                f"oldest: all_reduce #8, 1.1 MiB of float32, running for "), about(rnd, rank)
            assert "(PYDDP_EXIT_WAIT)" in lines[0], about(rnd, rank)
        assert_clean(rnd, WS - 1)
        assert_dist_error(rnd, WS - 1, "rank ")


def test_rank_failing_mid_collective():
    rounds = launch("fail", 20, timeout=300)
    seen = set()
    for rnd in rounds:
        v = rnd["variant"]
        bad = v["failing"]
        seen.add((bad, v["how"], v["when"], v["inside"]))
        r = rnd["ranks"][bad]
        assert not r["hung"], about(rnd, bad)
        if v["how"] == "raise":        # an uncaught exception: status 1 and its traceback
            assert r["status"] == 1, about(rnd, bad)
            assert r["stderr"].count("Traceback") == 1, about(rnd, bad)
            assert r["stderr"].rstrip().endswith(
                f"RuntimeError: rank {bad} gives up mid-collective"), about(rnd, bad)
        else:
            assert r["status"] == (3 if v["how"] == "exit3" else -9), about(rnd, bad)
            assert r["stderr"] == "", about(rnd, bad)
        for rank in range(WS):
            if rank == bad:
                continue
            assert_clean(rnd, rank)
            # It names the failed rank, or (when that was rank 0, whose store went with
            # it, so no record can be read) the rank it lost, which names rank 0.
            assert_dist_error(rnd, rank, f"rank {bad} (" if bad else "rank ")
    assert {s[0] for s in seen} == {0, 1, 2}
    assert {s[1] for s in seen} == {"raise", "exit3", "sigkill"}
    assert {s[2:] for s in seen} == {("before", "all_reduce"), ("during", "all_reduce"),
                                     ("before", "ddp"), ("during", "ddp")}


@pytest.mark.parametrize("round_", [0, 1])
def test_fresh_interpreters(round_):
    res = spawn_ranks("exits.py", WS, args=["rank", "full", str(round_)], env=ENV,
                      timeout=60)
    for rank, r in enumerate(res):
        assert r.returncode == 0 and r.stderr == "", f"rank {rank}:\n{r.output[-4000:]}"
        assert "EXITING" in r.stdout, r.output[-4000:]
