"""The CPU transports: shared memory between ranks of one host, TCP otherwise, and mixed
layouts, at world sizes 2 to 4. The worker (tests/workers/transport.py) checks every
dtype and op against NumPy, that each rank maps exactly one shared-memory segment per
same-host peer, and that no segment name survives in /dev/shm once the group is up;
this file checks what happens across processes (a rank killed with SIGKILL, /dev/shm
after the run). Correctness only: speed is measured by benchmarks/ and
``python -m pyddp.bench``."""
import os
import re

import pytest

from launch import spawn_ranks
from netns import NetnsUnavailable, exec_prefix, two_hosts


def run_worker(ws, *args, **kw):
    """Run the worker at world size ws; return (results, all output, the ranks' pids)."""
    results = spawn_ranks("transport.py", ws, args=list(args), timeout=150, **kw)
    out = "".join(r.output for r in results)
    pids = [int(p) for p in re.findall(r"PID rank=\d+ pid=(\d+)", out)]
    assert len(pids) == ws, out[-3000:]
    return results, out, pids


def assert_pass(results, out, ws):
    for r in results:
        assert r.returncode == 0, r.output[-4000:]
    passed = sorted(int(x) for x in re.findall(r"rank (\d+): PASS \d+ checks", out))
    assert passed == list(range(ws)), out[-3000:]


def assert_no_segments(pids):
    """Nothing in /dev/shm was created by these processes (names are pyddp-<pid>-...)."""
    left = [n for n in os.listdir("/dev/shm") for p in pids if n.startswith(f"pyddp-{p}-")]
    assert not left, left


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_shared_memory_every_pair(ws):
    """One host: every pair maps one segment; every dtype and op is right."""
    results, out, pids = run_worker(ws)
    assert_pass(results, out, ws)
    assert_no_segments(pids)


def test_tcp_when_disabled():
    """PYDDP_SHM_DISABLE=1 everywhere: no segment at all, TCP only."""
    results, out, _ = run_worker(2, env={"PYDDP_SHM_DISABLE": "1"})
    assert_pass(results, out, 2)


def test_one_rank_disables_shm():
    """Only rank 2 sets PYDDP_SHM_DISABLE=1: its pairs agree on TCP while the pair
    (0, 1) keeps shared memory, so the ring mixes transports on one host."""
    results, out, pids = run_worker(3, "--disable-shm-rank", "2")
    assert_pass(results, out, 3)
    assert_no_segments(pids)


@pytest.mark.parametrize("layout", ["AAB", "AABA"])
def test_mixed_hosts_through_network_namespaces(layout):
    """Ranks in two network namespaces (two "hosts" joined by veth): shared memory
    between ranks of one namespace, TCP across."""
    ws = len(layout)
    try:
        with two_hosts() as hosts:
            host = {"A": hosts[0], "B": hosts[1]}
            results, out, pids = run_worker(
                ws, "--layout", layout, master_addr=host["A"].addr,
                prefix=lambda r: exec_prefix(host[layout[r]].ns))
    except NetnsUnavailable as e:
        pytest.skip(f"mixed layouts need network namespaces: {e}")
    assert_pass(results, out, ws)
    assert_no_segments(pids)


@pytest.mark.parametrize("shm", ["on", "off"])
def test_256_mib_all_reduce(shm):
    env = {"PYDDP_SHM_DISABLE": "1"} if shm == "off" else {}
    results, out, _ = run_worker(2, "--big", "256", env=env)
    assert_pass(results, out, 2)


def test_rank_killed_with_sigkill():
    """Rank 1 of 3 dies with SIGKILL mid-run: the others fail within seconds (not at
    the 60 s timeout) with an error naming the dead rank, and nothing is left in
    /dev/shm."""
    results, out, pids = run_worker(3, "--victim", "1")
    assert "rank=1 killing_self=1" in out, out[-3000:]
    for r in (0, 2):
        m = re.search(rf"RESULT rank={r} error=(\w+) seconds=([\d.]+) msg=(.*)", out)
        assert m, out[-3000:]
        assert m.group(1) in ("DistNetworkError", "DistBackendError", "DistError"), m.group(0)
        assert float(m.group(2)) < 10, m.group(0)
        assert "rank 1" in m.group(3), m.group(0)
    assert_no_segments(pids)
