"""DDP on a CUDA model over NCCL: the losses and parameters of a short training run
match the same run on the CPU backend (float64, so the two agree to rounding)."""
import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from launch import run  # noqa: E402

SCRIPT = os.path.join(HERE, "ddp_train.py")


def _train(backend, device, *flags):
    r = run([sys.executable, SCRIPT, backend, device, *flags], timeout=180)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.output
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("flags", [(), ("gradient_as_bucket_view",), ("find_unused",)])
def test_ddp_cuda_matches_cpu(torch_cuda, flags):
    gpu = _train("nccl", "cuda", *flags)
    cpu = _train("cpu", "cpu", *flags)
    assert len(gpu["losses"]) == 12
    assert gpu["losses"][-1] < gpu["losses"][0]          # it does train
    for a, b in zip(gpu["losses"], cpu["losses"]):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12)
    for pa, pb in zip(gpu["params"], cpu["params"]):
        assert pa == pytest.approx(pb, rel=1e-8, abs=1e-10)
