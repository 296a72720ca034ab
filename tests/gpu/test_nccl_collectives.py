"""Every collective on one GPU (world size 1, since NCCL refuses two ranks on one GPU):
torch CUDA tensors, CuPy arrays, ``__cuda_array_interface__``-only objects and host
arrays, against a CPU reference computed with torch / NumPy. Also: ordering after the
producer's stream, results visible on the caller's stream, errors, and abort.
"""
from datetime import timedelta

import numpy as np
import pytest

import pyddp
from pyddp import ReduceOp

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64",
          "bool"]
OPS = [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]


@pytest.fixture(scope="module")
def group(gpu):
    store = pyddp.TCPStore("127.0.0.1", 0, is_master=True)
    pyddp.init_process_group("nccl", store=store, rank=0, world_size=1,
                             timeout=timedelta(seconds=60))
    yield pyddp._group.default_pg()
    if pyddp.is_initialized():
        pyddp.destroy_process_group()
    store.close()


def _sample(torch, dtype, n=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = getattr(torch, dtype)
    if dtype == "bool":
        return torch.rand(n, generator=g) > 0.5
    if t.is_floating_point:
        return (torch.randn(n, generator=g) * 4).to(t)
    return torch.randint(0, 100 if dtype == "uint8" else 50, (n,), generator=g).to(t)


def _reference(torch, x, op):
    """op over the stack of every rank's input (one rank here), by torch on the CPU;
    None where the op is undefined (AVG on bool)."""
    s = x.unsqueeze(0)
    if x.dtype == torch.bool:
        return {ReduceOp.SUM: s.any(0), ReduceOp.MAX: s.any(0), ReduceOp.MIN: s.all(0),
                ReduceOp.PRODUCT: s.all(0)}.get(op)
    if op == ReduceOp.SUM:
        return s.sum(0, dtype=x.dtype)
    if op == ReduceOp.AVG:
        total = s.sum(0, dtype=x.dtype)
        return total / s.shape[0] if x.is_floating_point() else \
            torch.div(total, s.shape[0], rounding_mode="trunc")
    if op == ReduceOp.PRODUCT:
        return s.prod(0, dtype=x.dtype)
    return s.amin(0) if op == ReduceOp.MIN else s.amax(0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_torch(group, torch_cuda, dtype):
    torch = torch_cuda
    for op in OPS:
        x = _sample(torch, dtype)
        ref = _reference(torch, x, op)
        d = x.cuda()
        if ref is None:
            with pytest.raises(pyddp.DistTypeError):
                pyddp.all_reduce(d, op=op)
            continue
        pyddp.all_reduce(d, op=op)
        assert torch.equal(d.cpu(), ref.to(x.dtype)), (dtype, op)


@pytest.mark.parametrize("dtype", DTYPES)
def test_other_collectives_torch(group, torch_cuda, dtype):
    torch = torch_cuda
    x = _sample(torch, dtype, seed=1)
    d = x.cuda()
    pyddp.broadcast(d, src=0)
    assert torch.equal(d.cpu(), x)
    pyddp.reduce(d, dst=0)
    assert torch.equal(d.cpu(), x)
    out = torch.zeros_like(d)
    pyddp.all_gather_into_tensor(out, d)
    assert torch.equal(out.cpu(), x)
    lst = [torch.zeros_like(d)]
    pyddp.all_gather(lst, d)
    assert torch.equal(lst[0].cpu(), x)
    if dtype != "bool":
        rs = torch.zeros_like(d)
        pyddp.reduce_scatter_tensor(rs, d, op=ReduceOp.SUM)
        assert torch.equal(rs.cpu(), x)
    g = [torch.zeros_like(d)]
    pyddp.gather(d, g, dst=0)
    assert torch.equal(g[0].cpu(), x)
    s = torch.zeros_like(d)
    pyddp.scatter(s, [d], src=0)
    assert torch.equal(s.cpu(), x)


def test_noncontiguous_and_requires_grad(group, torch_cuda):
    torch = torch_cuda
    base = torch.arange(20, dtype=torch.float32, device="cuda").reshape(4, 5)
    view = base.t()                       # not contiguous: staged and copied back
    pyddp.all_reduce(view, op=ReduceOp.MAX)
    assert torch.equal(base.cpu(), torch.arange(20, dtype=torch.float32).reshape(4, 5))
    w = torch.ones(3, device="cuda", requires_grad=True)
    pyddp.all_reduce(w)
    assert torch.equal(w.detach().cpu(), torch.ones(3))


def test_ordering_after_producer_stream(group, torch_cuda):
    """A collective issued on a busy side stream must see the data written there, and
    work queued there after wait() must see the result."""
    torch = torch_cuda
    n = 1 << 20
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = torch.zeros(n, device="cuda")
        torch.cuda._sleep(50_000_000)     # keep s busy so that a race would show
        x.fill_(3.0)
        out = torch.empty(n, device="cuda")
        pyddp.all_gather_into_tensor(out, x)
        y = out * 2
    torch.cuda.synchronize()
    assert torch.all(y == 6.0).item()


def test_async_work(group, torch_cuda):
    torch = torch_cuda
    x = torch.full((1000,), 2.0, device="cuda")
    w = pyddp.all_reduce(x, async_op=True)
    assert w.wait() is True and w.is_completed() and w.exception() is None
    assert torch.all(x == 2.0).item()


def test_cuda_array_interface_only(group, torch_cuda):
    """An object offering only __cuda_array_interface__ (device found from the pointer)."""
    torch = torch_cuda
    t = torch.arange(10, dtype=torch.int32, device="cuda")

    class CAI:
        __cuda_array_interface__ = t.__cuda_array_interface__

    out = torch.zeros(10, dtype=torch.int32, device="cuda")

    class CAIOut:
        __cuda_array_interface__ = out.__cuda_array_interface__

    pyddp.all_gather_into_tensor(CAIOut(), CAI())
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), torch.arange(10, dtype=torch.int32))


def test_cupy(group):
    cp = pytest.importorskip("cupy")
    for dt in ("float16", "float32", "float64", "int8", "uint8", "int32", "int64"):
        h = (np.arange(13) % 7).astype(dt)
        x = cp.asarray(h)
        pyddp.all_reduce(x, op=ReduceOp.SUM)
        np.testing.assert_array_equal(cp.asnumpy(x), h)
        out = cp.zeros_like(x)
        pyddp.all_gather_into_tensor(out, x)
        np.testing.assert_array_equal(cp.asnumpy(out), h)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        y = cp.full(1 << 20, 5.0, dtype=cp.float32)
        out = cp.empty_like(y)
        pyddp.all_gather_into_tensor(out, y)
        z = out + 1
    s.synchronize()
    assert bool((z == 6.0).all())


def test_host_arrays_and_objects(group):
    x = np.arange(10, dtype=np.int64)
    pyddp.all_reduce(x, op=ReduceOp.MAX)
    np.testing.assert_array_equal(x, np.arange(10))
    objs = [None]
    pyddp.all_gather_object(objs, {"a": [1, 2, 3]})
    assert objs == [{"a": [1, 2, 3]}]
    b = [None, "x"]
    pyddp.broadcast_object_list(b, src=0)
    assert b == [None, "x"]


def test_barrier_and_bad_input(group, torch_cuda):
    torch = torch_cuda
    pyddp.barrier()
    with pytest.raises(pyddp.DistValueError):
        pyddp.send(torch.ones(2, device="cuda"), dst=0)     # to itself
    with pytest.raises(pyddp.DistValueError):
        pyddp.broadcast(torch.ones(2, device="cuda"), src=1)
    with pytest.raises(pyddp.DistValueError):
        pyddp.all_gather_into_tensor(torch.zeros(3, device="cuda"), torch.ones(2, device="cuda"))
    x = torch.ones(4, device="cuda")
    pyddp.all_reduce(x)                                     # still usable afterwards
    assert torch.all(x == 1).item()


def test_wrong_device(group, torch_cuda):
    torch = torch_cuda
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two visible GPUs")
    other = 1 if group.device == 0 else 0
    with pytest.raises(pyddp.DistValueError, match=f"is on cuda:{other}"):
        pyddp.all_reduce(torch.ones(2, device=f"cuda:{other}"))


def test_abort_then_fail_fast(torch_cuda):
    """Runs last in this file: aborting breaks the group for good."""
    torch = torch_cuda
    store = pyddp.TCPStore("127.0.0.1", 0, is_master=True)
    if pyddp.is_initialized():
        pyddp.destroy_process_group()
    pyddp.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        pyddp._group.default_pg().abort("test abort")
        with pytest.raises(pyddp.DistBackendError, match="test abort"):
            pyddp.all_reduce(torch.ones(2, device="cuda"))
    finally:
        pyddp.destroy_process_group()
        store.close()
