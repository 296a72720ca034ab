"""The lean path of blocking small collectives (ProcessGroup.run, torch tensors by
data_ptr, the inline run on the calling thread, the hand-off spins): results against
NumPy at several world sizes, the fallbacks, order with queued async work, and that a
late peer, a peer that dies or is killed, a mismatched call and Ctrl-C during the wait
behave as on the general path. Never timing-based speed checks:
only upper bounds far from the expected times, as in test_errors.py."""

import pytest

from launch import interrupt_rank0, spawn_ranks
from test_errors import results


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_lean_results_match_numpy(ws):
    res = spawn_ranks("lean_path.py", ws, args=["correct"], timeout=240)
    rs = [r for r in results(res) if "ok" in r]
    assert len(rs) == ws and all(r["ok"] for r in rs), [r.output[-3000:] for r in res]


def test_late_peer_falls_back_to_the_parked_wait():
    res = spawn_ranks("lean_path.py", 2, args=["late"], timeout=120)
    rs = [r for r in results(res) if "ok" in r]
    assert len(rs) == 2, [r.output[-3000:] for r in res]
    # the early rank waited for the late one (1.2 s), far longer than any spin
    assert max(r["waited"] for r in rs) >= 1.0, rs


@pytest.mark.parametrize("how", ["dies", "killed"])
def test_peer_dying_during_small_calls(how):
    """dies: exits between back-to-back calls; killed: SIGKILL while the others wait
    inline for it."""
    res = spawn_ranks("lean_path.py", 3, args=[how], env={"PYDDP_TIMEOUT": "120"},
                      timeout=120)
    rs = [r for r in results(res) if "cls" in r]
    assert len(rs) == 2, [r.output[-3000:] for r in res]
    for r in rs:
        assert r["cls"] and "DistError" in r["cls"], r
        assert r["seconds"] < 15, r           # far below the 120 s timeout
        if how == "killed":
            assert "rank 2" in r["msg"], r    # names the rank that died
    after = [r for r in results(res) if "after" in r]
    assert len(after) == 2 and all(a["after"] and a["seconds_after"] < 2 for a in after), after


def test_mismatched_counts_are_a_mismatch_error():
    res = spawn_ranks("lean_path.py", 2, args=["mismatch"], timeout=120)
    rs = [r for r in results(res) if "cls" in r]
    assert len(rs) == 2, [r.output[-3000:] for r in res]
    for r in rs:
        assert r["cls"] and "CollectiveMismatchError" in r["cls"], r
        assert "count" in r["msg"] and r["seconds"] < 10, r


def test_ctrl_c_while_waiting_in_a_loop_of_small_calls():
    outs = interrupt_rank0("lean_path.py", ["sigint"], timeout=60)

    class R:
        def __init__(self, o):
            self.output = o
    rs = results([R(o) for o in outs])
    r0 = [r for r in rs if r.get("rank") == 0 and "seconds" in r]
    assert r0 and r0[0]["cls"] == "KeyboardInterrupt" and r0[0]["seconds"] < 3, outs
    after = [r for r in rs if "after" in r][0]
    assert after["after"] and "aborted" in after["msg"], after
    r1 = [r for r in rs if r.get("rank") == 1][0]
    assert r1["cls"] and "DistError" in r1["cls"] and r1["seconds"] < 10, r1
