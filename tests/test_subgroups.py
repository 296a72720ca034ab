"""Subgroups (new_group), the collectives that came with them (all_to_all,
all_to_all_single, batch_isend_irecv, all_reduce_coalesced, monitored_barrier,
add_done_callback) and exact integer AVG, against NumPy, at world sizes 2 to 4 under
stock torchrun. The checks run in tests/workers/subgroups.py."""
import re

import pytest

from launch import torchrun


def assert_pass(res, ws, least=60):
    out = res.output
    assert res.returncode == 0, out[-6000:]
    passed = re.findall(r"rank (\d+): PASS (\d+) checks", out)
    assert sorted(int(r) for r, _ in passed) == list(range(ws)), out[-4000:]
    assert all(int(n) >= least for _, n in passed), passed


@pytest.mark.parametrize("ws", [3, 4])
def test_subgroups_and_new_collectives(ws):
    assert_pass(torchrun("subgroups.py", ws, timeout=300), ws)


def test_wrong_group_is_a_mismatch_at_two_ranks():
    """Also covers every check at world size 2; then rank 0 calls on a subgroup while
    rank 1 calls on the world: both fail naming the groups instead of hanging."""
    res = torchrun("subgroups.py", 2, args=["--wrong-group"], timeout=300)
    assert_pass(res, 2)
    assert res.output.count("different process groups") >= 2, res.output[-3000:]
