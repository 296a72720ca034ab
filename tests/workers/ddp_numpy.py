"""Worker for tests/test_ddp_numpy.py: pyddp's DDP on models that are not torch modules.
Every rank makes rank-dependent gradients, calls sync_gradients(), and checks the result
against NumPy arithmetic on all ranks' gradients (gathered separately with
all_gather_object), on the C path and on the generic path; ``join`` trains with uneven
inputs under ddp.join() and checks against the training computed alone. Prints "rank R: PASS <case>"
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


class Linear:
    """y = x @ w + b, with a buffer that follows the outputs' mean (updated by each
    forward), trained by hand on the squared error."""

    def __init__(self, rank):
        rng = np.random.default_rng(50 + rank)
        self.w, self.b = P(rng.normal(size=(6, 2))), P(rng.normal(size=2))
        self.running = np.zeros(2)

    def named_parameters(self):
        return [("w", self.w), ("b", self.b)]

    def named_buffers(self):
        return [("running", self.running)]

    def __call__(self, x):
        y = x @ self.w.data + self.b.data
        self.running[:] = 0.9 * self.running + 0.1 * y.mean(0)
        return y


def join_data(step, rank):
    rng = np.random.default_rng(100 * step + rank)
    return rng.normal(size=(5, 6)), rng.normal(size=(5, 2))


def lsq_grads(w, b, x, t):
    """Gradients of sum((x @ w + b - t)**2) / len(x) with respect to w and b."""
    d = 2 * (x @ w + b - t) / len(x)
    return x.T @ d, d.sum(0)


def join_steps(rank):
    return 2 + 2 * rank


def join_reference(world, divide_initial, lr):
    """Every rank's training under Join, computed alone: rank 0's initial weights, at
    each step the gradients of the ranks still training summed and divided by the
    world size (or their number), and the buffer of the highest rank still training
    (the last one: it trains every step), whose model the join's end hands to all."""
    m = Linear(0)
    w, b, running = m.w.data.copy(), m.b.data.copy(), m.running.copy()
    for step in range(join_steps(world - 1)):
        active = [r for r in range(world) if join_steps(r) > step]
        gw, gb = np.zeros_like(w), np.zeros_like(b)
        for r in active:
            x, t = join_data(step, r)
            if r == world - 1:
                running = 0.9 * running + 0.1 * (x @ w + b).mean(0)
            g = lsq_grads(w, b, x, t)
            gw, gb = gw + g[0], gb + g[1]
        div = world if divide_initial else len(active)
        w, b = w - lr * gw / div, b - lr * gb / div
    return w, b, running


def case_join(rank, world, generic):
    """Uneven inputs under ddp.join() (rank r trains 2 + 2r steps): the final weights and
    buffer, the same on every rank, are the reference's; with
    throw_on_early_termination every rank raises once rank 0 has run out; a
    sync_gradients() without a forward through the wrapper fails before sending."""
    lr = 0.1
    for divide in (True, False):
        model = Linear(rank)
        ddp = DDP(model, bucket_cap_mb=1 / 1024, _generic_path=generic)
        with ddp.join(divide_by_initial_world_size=divide):
            for step in range(join_steps(rank)):
                x, t = join_data(step, rank)
                ddp(x)
                model.w.grad, model.b.grad = lsq_grads(model.w.data, model.b.data, x, t)
                ddp.sync_gradients()
                model.w.data -= lr * model.w.grad
                model.b.data -= lr * model.b.grad
        w, b, running = join_reference(world, divide, lr)
        for got, want, what in ((model.w.data, w, "w"), (model.b.data, b, "b"),
                                (model.running, running, "running")):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12,
                                       err_msg=f"{what} (divide={divide})")
    raised = None
    try:
        with ddp.join(throw_on_early_termination=True):
            for step in range(join_steps(rank)):
                ddp(join_data(step, rank)[0])
                ddp.sync_gradients()
    except pyddp.DistError as e:
        raised = str(e)
    if world > 1:
        want = "Rank 0 exhausted all inputs." if rank == 0 else "Detected at least one rank"
        assert raised is not None and want in raised, raised
    else:
        assert raised is None, raised
    with ddp.join():
        try:
            ddp.sync_gradients()
        except pyddp.DistValueError as e:
            assert "through the DDP wrapper" in str(e), str(e)
        else:
            raise AssertionError("sync_gradients() without a forward in join mode was accepted")
        ddp(join_data(0, rank)[0])
        ddp.sync_gradients()


CASES = {"average": case_average, "no_sync": case_no_sync, "unused": case_unused,
         "pairs": case_pairs, "errors": case_errors, "join": case_join}


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
