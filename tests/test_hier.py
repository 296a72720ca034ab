"""Hierarchical collectives across hosts: ranks spread over two network namespaces
joined by veth (tests/netns.py; root only, skipped otherwise), each namespace a "host"
with its own host identity, so same-namespace ranks talk over shared memory and the
others over TCP. tests/workers/hier.py checks all_reduce, reduce_scatter_tensor,
all_gather_into_tensor and broadcast against NumPy at world sizes 3 to 8, for equal
hosts (2 x 4), unequal ones (2 + 1), interleaved ranks (rank r on host r % 2) and every
PYDDP_ALGO choice; ranks that disagree on PYDDP_ALGO (or on a group's
pg_options={"algo": ...}) get CollectiveMismatchError on every rank; a rank killed in the
middle of hierarchical all-reduces makes every other rank fail within seconds with an
error that names it. Every process is killed by id at the end (launch.spawn_ranks).
"""
import os
import re
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from launch import spawn_ranks  # noqa: E402
from netns import NetnsUnavailable, exec_prefix, two_hosts  # noqa: E402

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")


def _run(host_of, env_of=lambda r: {}, args=(), timeout=300):
    """Run tests/workers/hier.py with rank r in namespace host_of[r]; env_of(r) adds
    variables for rank r. Returns the Results."""
    try:
        with two_hosts() as hosts:
            def prefix(r):
                extra = [f"{k}={v}" for k, v in env_of(r).items()]
                return exec_prefix(hosts[host_of[r]].ns) + ["env"] + extra
            return spawn_ranks("hier.py", len(host_of), args=list(args), prefix=prefix,
                               master_addr=hosts[0].addr, timeout=timeout,
                               env={"PYDDP_TIMEOUT": "120"})
    except NetnsUnavailable as e:
        pytest.skip(str(e))


LAYOUTS = {
    "2x4-auto": ([0, 0, 0, 0, 1, 1, 1, 1], "auto"),
    "2x4-flat": ([0, 0, 0, 0, 1, 1, 1, 1], "flat"),
    "2+1-hier": ([0, 0, 1], "hier"),
    "interleaved-2x2-auto": ([0, 1, 0, 1], "auto"),
    "2x1-hier": ([0, 1], "hier"),
}


@root_only
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_results_match_numpy(name):
    host_of, algo = LAYOUTS[name]
    res = _run(host_of, lambda r: {"PYDDP_ALGO": algo})
    for r, x in enumerate(res):
        assert x.returncode == 0 and "PASS" in x.stdout, f"rank {r}:\n{x.stdout}\n{x.stderr}"


@root_only
def test_ranks_that_disagree_on_the_algorithm_get_a_mismatch_error():
    res = _run([0, 0, 1, 1], lambda r: {"PYDDP_ALGO": "flat" if r == 0 else "auto"},
               args=["--expect-mismatch"], timeout=120)
    for r, x in enumerate(res):
        assert x.returncode == 0, f"rank {r}:\n{x.stdout}\n{x.stderr}"
        assert "MISMATCH" in x.stdout and "PYDDP_ALGO" in x.stdout, x.stdout
        assert "hierarchical" in x.stdout and "flat ring" in x.stdout, x.stdout


@root_only
def test_pg_options_choose_the_algorithm_per_group():
    res = _run([0, 0, 1, 1], args=["--pg-options"], timeout=120)
    for r, x in enumerate(res):
        assert x.returncode == 0 and "PASS 5" in x.stdout, f"rank {r}:\n{x.stdout}\n{x.stderr}"


@root_only
@pytest.mark.parametrize("host_of,victim", [([0, 0, 1, 1], 3), ([0, 0, 0, 0, 1, 1, 1, 1], 1)])
def test_a_rank_killed_mid_collective_fails_every_other_rank_fast(host_of, victim):
    """SIGKILL of one rank while it runs pipelined hierarchical all-reduces (PYDDP_ALGO=hier):
    the others fail in seconds (not at the 120 s timeout), whether they talk to it
    directly (its host's ranks, its rail) or only through ranks that gave up, and each
    error names the dead rank."""
    res = _run(host_of, lambda r: {"PYDDP_ALGO": "hier"}, args=["--victim", str(victim)],
               timeout=120)
    assert "KILLING" in res[victim].stdout, res[victim].output
    for r, x in enumerate(res):
        if r == victim:
            continue
        m = re.search(r"RESULT error=(\w+) seconds=([\d.]+) msg=(.*)", x.stdout)
        assert m, f"rank {r}:\n{x.stdout}\n{x.stderr}"
        assert m.group(1) in ("DistNetworkError", "DistBackendError", "DistError"), m.group(0)
        assert float(m.group(2)) < 15, m.group(0)
        assert f"rank {victim}" in m.group(3), m.group(0)
