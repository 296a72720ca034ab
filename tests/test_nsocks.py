"""Links striped over several TCP connections per peer (PYDDP_NSOCKS_PERPEER): results
against NumPy at 2 and 4 ranks over loopback TCP (PYDDP_SHM_DISABLE=1), the number of
connections each rank really holds, extra connections authenticated with a token,
same-host pairs on shared memory getting none extra, and the clear error of ranks that
disagree on the setting. The worker is
tests/workers/nsocks.py; the byte-level striping is tests/c/test_link_stripe.c's."""
import re

import pytest

from launch import spawn_ranks


def assert_pass(results, ws):
    out = "".join(r.output for r in results)
    bad = [f"rank {i} (exit {r.returncode}):\n{r.output[-3000:]}"
           for i, r in enumerate(results) if r.returncode != 0]
    assert not bad, "\n".join(bad)
    passed = sorted(int(x) for x in re.findall(r"rank (\d+): PASS \d+ checks", out))
    assert passed == list(range(ws)), out[-3000:]


@pytest.mark.parametrize("ws", [2, 4])
def test_three_connections_per_peer(ws):
    """Every pair on TCP with 3 connections; every collective and size is right."""
    env = {"PYDDP_NSOCKS_PERPEER": "3", "PYDDP_SHM_DISABLE": "1", "PYDDP_TIMEOUT": "120"}
    assert_pass(spawn_ranks("nsocks.py", ws, args=["--per-peer", "3"], env=env,
                            timeout=240), ws)


def test_extra_connections_authenticate():
    """With PYDDP_AUTH_TOKEN every extra connection passes the challenge-response too."""
    env = {"PYDDP_NSOCKS_PERPEER": "2", "PYDDP_SHM_DISABLE": "1", "PYDDP_TIMEOUT": "120",
           "PYDDP_AUTH_TOKEN": "nsocks-test-token"}
    assert_pass(spawn_ranks("nsocks.py", 3, args=["--per-peer", "2"], env=env,
                            timeout=240), 3)


def test_shared_memory_pairs_get_no_extra_connections():
    """Same host with shared memory on: the pair moves to shared memory and keeps only
    its first TCP connection (for liveness), whatever PYDDP_NSOCKS_PERPEER says."""
    env = {"PYDDP_NSOCKS_PERPEER": "3", "PYDDP_TIMEOUT": "120"}
    assert_pass(spawn_ranks("nsocks.py", 2, args=["--per-peer", "1"], env=env,
                            timeout=240), 2)


def test_ranks_disagree():
    """Rank 1 started with another value: every rank fails init with DistValueError
    naming both values, at once (no timeout)."""
    results = spawn_ranks("nsocks.py", 3, args=["--init-only"],
                          env={"PYDDP_SHM_DISABLE": "1", "PYDDP_TIMEOUT": "60"},
                          prefix=lambda r: ["env", "PYDDP_NSOCKS_PERPEER=2"] if r == 1 else [],
                          timeout=120)
    for r in results:
        assert r.returncode == 1, r.output[-3000:]
        assert "ERROR DistValueError: " in r.stdout, r.output[-3000:]
        assert ("ranks disagree on PYDDP_NSOCKS_PERPEER: rank 0 has 1 and rank 1"
                in r.stdout), r.output[-3000:]
        assert "has 2" in r.stdout, r.output[-3000:]
