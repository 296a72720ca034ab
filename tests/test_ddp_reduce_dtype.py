"""pyddp.DistributedDataParallel(reduce_dtype=...): gradients reduced as bfloat16 or
float16. At world sizes 2 and 3 (one torchrun launch each, every case inside
tests/workers/ddp_reduce_dtype.py): the loss curve of a small MLP equals torch's DDP
(gloo) with bf16_compress_hook / fp16_compress_hook, averaged gradients equal NumPy's
average of the rounded per-rank gradients, mixed parameter dtypes, float16 overflow,
NumPy models, and bad reduce_dtype values raising before any communication; on the C
path and on the generic path."""
import pytest

from launch import assert_cases_passed, torchrun

CASES = ["errors", "curve_bfloat16", "curve_float16", "average_bfloat16", "average_float16",
         "mixed", "overflow", "numpy"]


@pytest.mark.parametrize("ws", [2, 3])
def test_reduce_dtype(ws):
    assert_cases_passed(torchrun("ddp_reduce_dtype.py", ws, timeout=240), ws, CASES)
