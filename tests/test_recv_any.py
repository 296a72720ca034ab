"""Receives from any source (recv/irecv without src) and the coalesced all_gather, through
pyddp's API and through torch's on the "pyddp" backend, at 2 to 4 ranks, over shared
memory (the default on one host) and over TCP only (PYDDP_SHM_DISABLE=1). The checks
against each rank's own reference are in tests/workers/anysrc.py; a recv from any source
that no peer can satisfy is a mismatch error here, where gloo would wait (the C unit
test tests/c/test_recv_any.c covers the search itself)."""
import re

import pytest

from launch import spawn_ranks


def _assert_pass(results, ws):
    out = "".join(r.output for r in results)
    for r in results:
        assert r.returncode == 0, out[-6000:]
    passed = re.findall(r"rank (\d+): PASS (\d+) checks", out)
    assert sorted(int(r) for r, _ in passed) == list(range(ws)), out[-4000:]


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_pyddp_api(ws):
    _assert_pass(spawn_ranks("anysrc.py", ws, args=["--api", "pyddp"], timeout=180), ws)


@pytest.mark.parametrize("ws", [2, 3])
def test_pyddp_api_over_tcp(ws):
    _assert_pass(spawn_ranks("anysrc.py", ws, args=["--api", "pyddp"],
                             env={"PYDDP_SHM_DISABLE": "1"}, timeout=180), ws)


@pytest.mark.parametrize("ws", [2, 3])
def test_torch_backend(ws):
    pytest.importorskip("torch")
    _assert_pass(spawn_ranks("anysrc.py", ws, args=["--api", "torch"], timeout=240), ws)


_NOBODY_SENDS = r"""
import os, pyddp, numpy as np
pyddp.init_process_group("cpu")
rank = pyddp.get_rank()
try:
    if rank == 0:
        pyddp.recv(np.zeros(4, dtype=np.float32))
    else:
        pyddp.all_reduce(np.ones(4, dtype=np.float32))
except pyddp.DistError as e:
    print(f"rank {rank}: {type(e).__name__}: {e}", flush=True)
"""


def test_nobody_sends_is_a_mismatch(tmp_path):
    script = tmp_path / "nobody_sends.py"
    script.write_text(_NOBODY_SENDS)
    results = spawn_ranks(str(script), 2, timeout=120)
    out = "".join(r.output for r in results)
    assert "rank 0: CollectiveMismatchError" in out, out[-4000:]
    assert "recv(count=4, float32, from any rank)" in out, out[-4000:]
    assert "rank 1 called all_reduce(count=4, float32, sum)" in out, out[-4000:]
    assert "rank 1: " in out, out[-4000:]       # the peer fails fast too, not at its timeout
