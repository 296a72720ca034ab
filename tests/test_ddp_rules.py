"""DDP's per-gradient rules through the extension (_C.GradHooks over the C core's
ddp_grad_rules, whose own unit tests are tests/c/test_reducer_rules.c): the verdicts a
Python caller gets, the bucket data rule the generic path asks for, the one
contiguous-CPU-tensor test of pyddp/_arrays.py, and (under torchrun) the static_graph
errors worded with the parameter's name on every rank."""
import numpy as np
import pytest

from pyddp import _C
from pyddp import _arrays as A

from launch import assert_cases_passed, torchrun

IGNORE, WAIT, READY = _C.GRAD_IGNORE, _C.GRAD_WAIT, _C.GRAD_READY


def make(n=3, **modes):
    reducer = _C.Reducer([(4, "float32", -1)] * n, 16, 16)
    hooks = _C.GradHooks(n, **modes)
    hooks.set_reducer(reducer, False)
    return reducer, hooks


def test_plain_and_second_gradient():
    reducer, hooks = make()
    assert not hooks.expect and hooks.on_grad(0, True) == (IGNORE, False, False, 0, 1)
    reducer.begin()
    hooks.begin()
    assert hooks.expect
    assert hooks.on_grad(2, True) == (READY, True, False, 1, 1)
    assert hooks.on_grad(1, True) == (READY, False, False, 1, 1)
    assert hooks.on_grad(2, True) == (_C.GRAD_SECOND, False, False, 2, 1)
    assert hooks.counts() == [0, 1, 2]
    reducer.mark_ready(2)
    reducer.mark_ready(1)
    assert hooks.end_backward() == (_C.GRAD_END_UNUSED, [0], False)
    assert not hooks.expect
    with pytest.raises(IndexError):
        hooks.on_grad(3, True)


def test_find_unused_notes_use_and_hands_in_the_rest():
    reducer, hooks = make(find_unused=True)
    hooks.on_grad(1, True)          # no synced backward (no_sync): use still counts
    hooks.on_grad(2, False)         # a None gradient is no use
    assert reducer.local_used() == [0, 1, 0]
    reducer.begin()
    hooks.begin()
    assert hooks.on_grad(0, True)[0] == READY
    reducer.mark_ready(0)
    assert hooks.end_backward() == (_C.GRAD_END_OK, [1, 2], True)


def test_static_graph_learns_then_checks():
    reducer, hooks = make(static_graph=True)
    assert hooks.learning
    reducer.begin()
    hooks.begin()
    for i in (1, 0, 0):
        assert hooks.on_grad(i, True)[0] == WAIT
    # iteration 1 hands everything in at the end: arrival order, then the unused one
    assert hooks.end_backward() == (_C.GRAD_END_OK, [1, 0, 2], True)
    for i in (1, 0, 2):
        reducer.mark_ready(i)
    reducer.end()
    assert hooks.learn() and not hooks.learning and not hooks.learn()
    assert hooks.never_used() == [2]
    reducer.begin()
    hooks.begin()
    assert hooks.on_grad(0, True) == (WAIT, True, True, 1, 2)   # first: pre-mark [2]
    assert hooks.on_grad(0, True) == (READY, False, False, 2, 2)
    assert hooks.on_grad(0, True) == (_C.GRAD_TOO_MANY, False, False, 3, 2)
    reducer.mark_ready(2)
    reducer.mark_ready(0)
    assert hooks.end_backward() == (_C.GRAD_END_STATIC_UNUSED, [1], False)


def test_detached_hooks_do_nothing():
    reducer, hooks = make()
    hook = hooks.hook(0)
    hooks.detach()
    hooks.begin()
    assert not hooks.expect
    assert hook(object()) is None       # not even .grad is read


@pytest.mark.parametrize("reduce_dtype,narrow,divides", [(None, False, False),
                                                         ("float16", True, True),
                                                         ("bfloat16", True, False)])
def test_bucket_rules(reduce_dtype, narrow, divides):
    specs = [(8, "float32", -1), (8, "float16", -1), (8, "float64", -1)]
    r = _C.Reducer(specs, 4, 4, None, reduce_dtype)
    kinds = [specs[members[0]][1] for members, *_ in r.layout()[0]]
    for world in (1, 3):
        for kind, rule in zip(kinds, r.bucket_rules(world)):
            n = narrow and kind != "float16"
            d = n and divides
            assert rule == (n, world if d else 1, _C.OP_SUM if d else _C.OP_AVG), (kind, rule)


def test_torch_cpu_code():
    torch = pytest.importorskip("torch")
    t = torch.ones(4, 3)
    assert A.torch_cpu_code(t) == _C.DT_FLOAT32
    assert A.torch_cpu_code(t.to(torch.bfloat16)) == _C.DT_BFLOAT16
    assert A.torch_cpu_code(t.to(torch.int64)) == _C.DT_INT64
    assert A.torch_cpu_code(t.t()) is None                      # not contiguous
    assert A.torch_cpu_code(torch.nn.Parameter(t)) is None       # a subclass
    assert A.torch_cpu_code(t.to(torch.complex64)) is None       # no such DT code
    assert A.torch_cpu_code(t.to_sparse()) is None
    assert A.torch_cpu_code(np.ones(3, np.float32)) is None
    assert A.torch_cpu_code(None) is None
    tensor, strided, codes = A.torch_hook_config(torch)
    assert tensor is torch.Tensor and strided is torch.strided
    assert codes[torch.float16] == _C.DT_FLOAT16 and torch.complex64 not in codes


def test_static_graph_errors_on_every_rank():
    assert_cases_passed(torchrun("ddp_rules.py", 2, timeout=180), 2,
                        ["static_more", "static_fewer"])
