"""pyddp's DDP on models that are not torch modules: gradients averaged exactly as NumPy
computes the mean of all ranks' gradients (C path and generic path; no_sync; unused
parameters; bucket views; (data, grad) pairs; errors; uneven inputs under ddp.join(),
against the same training computed alone), and examples/numpy_mlp.py, whose
DDP-trained weights must equal one process training on the full batch."""
import re

import pytest

from launch import PY, ROOT, run, spawn_ranks, torchrun


def _passes(out, ws, cases):
    for case in cases:
        # lines of different ranks may interleave: no anchoring on newlines
        pattern = rf"rank (\d+): PASS {re.escape(case)}(?! \(generic\))"
        ranks = sorted(int(r) for r in re.findall(pattern, out))
        assert ranks == list(range(ws)), f"{case}: {ranks}\n{out[-4000:]}"


@pytest.mark.parametrize("ws", [1, 3])
def test_array_ddp(ws):
    res = torchrun("ddp_numpy.py", ws, timeout=180)
    assert res.returncode == 0, res.output[-6000:]
    cases = ["average", "no_sync", "unused", "pairs", "errors", "join"]
    _passes(res.output, ws, cases + [c + " (generic)" for c in cases])


def test_numpy_example_equals_full_batch():
    """Two ranks, each accumulating two micro-batches under no_sync()."""
    res = torchrun(f"{ROOT}/examples/numpy_mlp.py", 2, args=["--accum", "2"], timeout=180)
    assert res.returncode == 0, res.output[-6000:]
    m = re.search(r"max \|DDP weight - full-batch weight\| = (\S+): matches", res.output)
    assert m and float(m.group(1)) < 1e-9, res.output[-3000:]
    first, last = map(float, re.search(r"loss (\S+) -> (\S+)", res.output).groups())
    assert last < first / 3


def test_numpy_example_single_process():
    """Without torchrun the example forms a one-rank group by itself."""
    res = run([PY, f"{ROOT}/examples/numpy_mlp.py", "--steps", "5"], timeout=120)
    assert res.returncode == 0, res.output[-3000:]
    assert "world size 1" in res.output and "matches" in res.output


@pytest.mark.parametrize("path", ["c", "generic"])
def test_ctrl_c_during_gradient_sync(path):
    """Ctrl-C while waiting for a peer that never joins the gradient all-reduce."""
    res = spawn_ranks("ddp_interrupt.py", 2, args=[path], timeout=60)
    out = res[0].output
    assert res[0].returncode == 0, out[-3000:]
    secs = float(re.search(r"interrupted after (\S+) s", out).group(1))
    assert secs < 1.0 + 2.0, out           # SIGINT at 1 s; waits check every 100 ms
    assert "then: DistError" in out and "broken" in out, out
