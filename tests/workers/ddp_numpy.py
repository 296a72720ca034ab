"""Worker for tests/test_ddp_numpy.py: pyddp's DDP on models that are not torch modules.
Every rank makes rank-dependent gradients, calls sync_gradients(), and checks the result
against NumPy arithmetic on all ranks' gradients (gathered separately with
all_gather_object), on the C path and on the generic path. Prints "rank R: PASS <case>"
per case; any failure raises (non-zero exit). torch is never imported here.
"""
import sys

import numpy as np

import pyddp
from pyddp import DistributedDataParallel as DDP


class P:
    def __init__(self, data):
        self.data = data
        self.grad = None


class Model:
    """Mixed dtypes and sizes (several buckets at a 1 KiB cap), plus a buffer."""

    def __init__(self, rank):
        rng = np.random.default_rng(rank)
        self.params = [("a", P(rng.normal(size=(7, 5)))),
                       ("b", P(rng.normal(size=300).astype(np.float32))),
                       ("c", P(rng.normal(size=(3,)))),
                       ("d", P(rng.normal(size=(20, 20)).astype(np.float32)))]
        self.running = np.full(4, float(rank))

    def named_parameters(self):
        return self.params

    def named_buffers(self):
        return [("running", self.running)]

    def __call__(self, x):
        return x * 2


def all_of(x):
    out = [None] * pyddp.get_world_size()
    pyddp.all_gather_object(out, x)
    return out


def fill_grads(model, rank, step, skip=()):
    rng = np.random.default_rng(1000 * step + rank)
    local = {}
    for name, p in model.named_parameters():
        if name in skip:
            p.grad = None
        else:
            p.grad = rng.normal(size=p.data.shape).astype(p.data.dtype)
            local[name] = p.grad.copy()
    return local


def check_average(model, everyone, unused_ok=False):
    for name, p in model.named_parameters():
        got = [d[name] for d in everyone if name in d]
        if not got:
            assert p.grad is None, f"{name}: no rank had a gradient but .grad was set"
            continue
        want = sum(got) / len(everyone)   # ranks without a gradient count as zero
        tol = 1e-6 if p.data.dtype == np.float32 else 1e-13
        np.testing.assert_allclose(p.grad, want, rtol=tol, atol=tol, err_msg=name)


def case_average(rank, world, generic):
    model = Model(rank)
    ddp = DDP(model, bucket_cap_mb=1 / 1024, _generic_path=generic)
    # construction broadcast rank 0's parameters and buffers
    ref = Model(0)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        np.testing.assert_array_equal(p.data, q.data, err_msg=n)
    np.testing.assert_array_equal(model.running, 0.0)
    assert len(ddp._sync.engine.layout) >= 3, ddp._sync.engine.layout
    for step in range(3):
        local = fill_grads(model, rank, step)
        everyone = all_of(local)
        ddp.sync_gradients()
        check_average(model, everyone)
    # forward passes through and re-broadcasts buffers first
    model.running[:] = rank + 5
    assert ddp(3) == 6
    np.testing.assert_array_equal(model.running, 5.0)


def case_no_sync(rank, world, generic):
    model = Model(rank)
    ddp = DDP(model, _generic_path=generic)
    local = fill_grads(model, rank, 7)
    with ddp.no_sync():
        ddp.sync_gradients()            # no-op: gradients stay local
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(p.grad, local[name])
    extra = fill_grads(Model(rank), rank, 8)
    for name, p in model.named_parameters():
        p.grad = p.grad + extra[name]   # accumulate a second micro-batch
        local[name] = p.grad.copy()
    everyone = all_of(local)
    ddp.reduce_gradients()
    check_average(model, everyone)


def case_unused(rank, world, generic):
    model = Model(rank)
    ddp = DDP(model, find_unused_parameters=True, gradient_as_bucket_view=True,
              _generic_path=generic)
    # "c" unused everywhere; "a" unused on rank 0 only
    local = fill_grads(model, rank, 3, skip=("c",) + (("a",) if rank == 0 else ()))
    everyone = all_of(local)
    ddp.sync_gradients()
    check_average(model, everyone)
    views = ddp._sync.engine.views
    for i, (name, p) in enumerate(model.named_parameters()):
        if p.grad is not None:
            assert np.shares_memory(p.grad, views[i]), f"{name}: .grad is not a bucket view"


def case_pairs(rank, world, generic):
    data = [np.full((4, 3), float(rank)), np.arange(5, dtype=np.float32) * (rank + 1)]
    grads = [np.full((4, 3), rank + 1.0), np.full(5, rank * 2.0, dtype=np.float32)]
    ddp = DDP(list(zip(data, grads)), _generic_path=generic)
    np.testing.assert_array_equal(data[0], 0.0)                  # rank 0's values
    np.testing.assert_array_equal(data[1], np.arange(5, dtype=np.float32))
    ddp.sync_gradients()
    np.testing.assert_allclose(grads[0], (world + 1) / 2)          # mean of 1..world
    np.testing.assert_allclose(grads[1], world - 1.0)              # mean of 0, 2, 4, ...


def case_errors(rank, world, generic):
    try:
        DDP(object())
    except pyddp.DistTypeError as e:
        assert "named_parameters" in str(e)
    else:
        raise AssertionError("a model without parameters was accepted")
    model = Model(rank)
    ddp = DDP(model, _generic_path=generic)
    fill_grads(model, rank, 1, skip=("b",))
    try:
        ddp.sync_gradients()
    except pyddp.DistValueError as e:
        assert "'b'" in str(e) and "find_unused_parameters" in str(e), str(e)
    else:
        raise AssertionError("a missing gradient without find_unused_parameters was accepted")
    local = fill_grads(model, rank, 2)          # the DDP is still usable afterwards
    everyone = all_of(local)
    ddp.sync_gradients()
    check_average(model, everyone)


CASES = {"average": case_average, "no_sync": case_no_sync, "unused": case_unused,
         "pairs": case_pairs, "errors": case_errors}


def main():
    pyddp.init_process_group("cpu")
    rank, world = pyddp.get_rank(), pyddp.get_world_size()
    for name in sys.argv[1:] or CASES:
        for generic in (False, True):
            CASES[name](rank, world, generic)
            print(f"rank {rank}: PASS {name}{' (generic)' if generic else ''}", flush=True)
    assert "torch" not in sys.modules, "pyddp's array DDP imported torch"
    pyddp.destroy_process_group()


if __name__ == "__main__":
    main()
