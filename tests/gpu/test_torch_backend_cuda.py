"""torch's API over the backend "pyddp" on CUDA tensors (pyddp's lean GPU path), run by
tests/gpu/torch_backend_worker.py: alone at world size 1, and under torchrun with one GPU
per rank where there are two or more. Skipped without a usable GPU (conftest.py)."""
import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from launch import free_port, run, torchrun  # noqa: E402

SCRIPT = os.path.join(HERE, "torch_backend_worker.py")


def _results(out):
    return [json.loads(x[len("RESULT "):]) for x in out.splitlines()
            if x.startswith("RESULT ")]


def test_torch_api_over_pyddp_on_one_gpu(torch_cuda):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    r = run([sys.executable, SCRIPT], env=env, timeout=240)
    res = _results(r.stdout)
    assert r.returncode == 0 and res, r.output[-6000:]
    assert res[0]["failed"] == [], res


def test_torch_api_over_pyddp_across_gpus(torch_cuda):
    n = min(torch_cuda.cuda.device_count(), 4)
    if n < 2:
        pytest.skip("needs at least two GPUs (NCCL refuses two ranks on one GPU)")
    r = torchrun(SCRIPT, n, timeout=300)
    res = _results(r.stdout)
    assert r.returncode == 0 and len(res) == n, r.output[-6000:]
    assert all(x["failed"] == [] for x in res), res
