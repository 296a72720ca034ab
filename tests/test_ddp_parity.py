"""pyddp.DistributedDataParallel against torch's own DistributedDataParallel (gloo):
the same script, model, data and optimizer give the same per-step losses and final
weights (relative 1e-5), with bit-identical weights on every rank after every step, at
world sizes 2 and 3, for the plain case, no_sync accumulation, unused parameters
(find_unused_parameters, static_graph, also with reentrant checkpointing), gradient_as_bucket_view, tiny buckets,
BatchNorm buffers, a non-contiguous parameter and the generic (non-C) data path; plus the two construction/backward
errors. The checks run inside tests/workers/ddp_parity.py; all configurations share
one torchrun launch per world size."""
import re

import pytest

from launch import torchrun

CASES = ["plain", "no_sync", "unused", "unused_no_sync", "view", "tiny_buckets", "static",
         "static_checkpoint",
         "buffers", "strided", "generic", "generic_unused", "subgroup", "unused_error", "unused_alone",
         "mismatch_error"]


@pytest.mark.parametrize("ws", [2, 3])
def test_parity_with_torch_ddp(ws):
    res = torchrun("ddp_parity.py", ws, timeout=240)
    out = res.output
    assert res.returncode == 0, out[-8000:]
    for case in CASES:
        ranks = sorted(int(r) for r in re.findall(rf"PASS {case} rank=(\d+)", out))
        assert ranks == list(range(ws)), f"{case}: passed on ranks {ranks}\n{out[-4000:]}"
