"""Uneven inputs under Join: rank r trains 4 + 3r steps, and pyddp's
DistributedDataParallel under ``model.join()`` (pyddp's Join), under torch's
``Join([model])`` and beside a ZeroRedundancyOptimizer, and torch's own DDP over the
"pyddp" backend, reach the per-step losses and final parameters (relative 1e-5) of
torch's DDP over gloo under torch's Join, the same on every rank; with
divide_by_initial_world_size=False, no_sync accumulation, find_unused_parameters,
BatchNorm buffers, gradient_as_bucket_view, the generic data path and static_graph; at
world sizes 2 and 3; enable=False does nothing. throw_on_early_termination=True raises
on every rank with torch's messages and leaves the group usable; bad uses fail before
communicating. Without any torch.distributed group, model.join() gives the training
computed alone. The checks run inside tests/workers/ddp_join.py (torchrun launches per
world size)."""
import pytest

from launch import assert_cases_passed, torchrun

CASES = ["plain", "torch_join", "divide_false", "no_sync", "unused", "buffers", "view",
         "generic", "zero", "static", "torch_over_pyddp", "disabled", "throw", "errors"]


@pytest.mark.parametrize("ws", [2, 3])
def test_join_matches_torch_ddp_over_gloo(ws):
    assert_cases_passed(torchrun("ddp_join.py", ws, timeout=300), ws, CASES)


@pytest.mark.parametrize("ws", [2, 3])
def test_model_join_without_a_torch_group(ws):
    res = torchrun("ddp_join.py", ws, args=["--pyddp-only"], timeout=180)
    assert_cases_passed(res, ws, ["no_torch_group"])
