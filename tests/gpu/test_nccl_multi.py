"""NCCL at world sizes above 1 under stock torchrun, one GPU per rank (skipped on
machines with fewer than two GPUs)."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from launch import torchrun  # noqa: E402


def test_collectives_across_gpus(torch_cuda):
    n = min(torch_cuda.cuda.device_count(), 4)
    if n < 2:
        pytest.skip("needs at least two GPUs (NCCL refuses two ranks on one GPU)")
    r = torchrun(os.path.join(HERE, "multi_worker.py"), n, timeout=240)
    assert r.returncode == 0, r.output
    for q in range(n):
        assert f"OK rank {q}" in r.stdout, r.output
