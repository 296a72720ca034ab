"""pyddp.DistributedDataParallel against torch's own DistributedDataParallel (gloo):
the same script, model, data and optimizer give the same per-step losses and final
weights (relative 1e-5), with bit-identical weights on every rank after every step, at
world sizes 2 and 3, for the plain case, no_sync accumulation, unused parameters
(find_unused_parameters, static_graph, also with reentrant checkpointing), gradient_as_bucket_view, tiny buckets,
BatchNorm buffers, a non-contiguous parameter and the generic (non-C) data path; plus the
construction/backward errors (unused parameters, parameters that differ across ranks, a
second gradient in one backward, a destroyed group) and hooks that go quiet once the
wrapper is collected. The checks run inside tests/workers/ddp_parity.py; all configurations share
one torchrun launch per world size."""
import pytest

from launch import assert_cases_passed, torchrun

CASES = ["plain", "no_sync", "unused", "unused_no_sync", "view", "tiny_buckets", "static",
         "static_checkpoint",
         "buffers", "strided", "generic", "generic_unused", "subgroup", "unused_error", "unused_alone",
         "mismatch_error", "twice_error", "destroyed_group", "collected"]


@pytest.mark.parametrize("ws", [2, 3])
def test_parity_with_torch_ddp(ws):
    assert_cases_passed(torchrun("ddp_parity.py", ws, timeout=240), ws, CASES)
