"""GPU tests: every test here is skipped, with the reason, unless NCCL and the CUDA
runtime load and a CUDA device is visible.

The check runs in a child process so that the test runner itself never initialises
CUDA on machines where it is not wanted (CI). On a GPU machine, run
``tests/gpu/check.sh`` (build, these tests, a summary).
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PROBE = ("import json, pyddp._nccl_backend as nb; "
          "print(json.dumps([nb.usable(), nb.why_unusable()]))")


def _probe():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get(
        "PYTHONPATH")])))
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                           timeout=120, env=env, cwd=ROOT)
        ok, why = json.loads(r.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
        return False, f"probing NCCL failed: {e}"
    return ok, why


@pytest.fixture(scope="session", autouse=True)
def gpu():
    """Skip unless backend="nccl" can work here."""
    ok, why = _probe()
    if not ok:
        first = (why or "unknown").splitlines()[0].rstrip(":;")
        pytest.skip(f"no usable GPU/NCCL: {first} (full report: python -c 'import "
                    f"pyddp._nccl_backend as nb; print(nb.why_unusable())')")


@pytest.fixture(scope="session")
def torch_cuda(gpu):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip(f"torch {torch.__version__} has no CUDA support")
    return torch
