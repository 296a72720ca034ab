"""Worker: the lean call path of blocking small collectives (tests/test_lean_path.py).

Blocking all_reduce/broadcast/reduce/barrier of a contiguous NumPy array or CPU torch
tensor skip Staged/Work and go through ProcessGroup.run (torch tensors by data_ptr);
small ones run inline on the calling thread when nothing is queued, the rest are queued
(the caller and the worker thread spin briefly before parking). Scenarios:

  correct   every dtype the lean path takes, NumPy and torch, against NumPy; every size
            from 8 B to just over PYDDP_SMALL_BYTES (inline, then queued) for all_reduce,
            broadcast, reduce and barrier; the fallbacks (non-contiguous, Parameter,
            requires_grad, empty; big-endian refused) give the same answers; lean calls
            interleaved with queued async work run in call order
  late      a peer arrives 1.2 s late (the inline spin gives up, the parked wait finishes)
  dies      the last rank exits while the others run small all-reduces back to back
  killed    the last rank SIGKILLs itself while the others wait inline for it
  mismatch  ranks call all_reduce of torch tensors with different counts
  sigint    rank 0 loops on small all-reduces; the peer stops calling; the test sends
            SIGINT while rank 0 waits
Prints "RESULT ..." lines (tests/test_errors.py's format).
"""
import argparse
import os
import signal
import sys
import time

import numpy as np
import torch

import pyddp as dist
from pyddp._group import _resolve

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scenarios import classes, expect_error, report  # noqa: E402

NP_DTYPES = ["float16", "float32", "float64", "int8", "uint8", "int32", "int64"]


def val(rank, n, dtype, salt=0):
    """Small exact values (multiples of 1/8 for floats) that depend on rank and salt."""
    v = (np.arange(n) * 3 + rank * 5 + salt) % 7 - 2
    if np.dtype(dtype).kind == "f":
        v = v / 8
    if np.dtype(dtype).kind == "u":
        v = np.abs(v)
    return v.astype(dtype)


def check(ok, what):
    if not ok:
        raise AssertionError(what)


def sc_correct(rank, ws):
    dist.init_process_group("cpu")
    n_checks = 0
    for dtype in NP_DTYPES:
        for n in (1, 7, 1000):
            ref = sum(val(r, n, dtype).astype(np.float64) for r in range(ws))
            refmax = np.max([val(r, n, dtype) for r in range(ws)], axis=0)
            x = val(rank, n, dtype)
            dist.all_reduce(x)
            check(np.array_equal(x.astype(np.float64), ref), f"numpy {dtype} n={n} sum")
            x = val(rank, n, dtype)
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
            check(np.array_equal(x, refmax), f"numpy {dtype} n={n} max")
            if dtype != "float16":
                t = torch.from_numpy(val(rank, n, dtype))
                dist.all_reduce(t)
                check(np.array_equal(t.numpy().astype(np.float64), ref), f"torch {dtype} sum")
            for root in range(ws):
                x = val(rank, n, dtype, salt=root)
                dist.broadcast(x, src=root)
                check(np.array_equal(x, val(root, n, dtype, salt=root)), f"bcast {dtype}")
                t = torch.from_numpy(val(rank, n, dtype, salt=root))
                dist.broadcast(t, src=root)
                check(np.array_equal(t.numpy(), val(root, n, dtype, salt=root)), "t bcast")
                x = val(rank, n, dtype)
                mine = x.copy()
                dist.reduce(x, dst=root)
                want = ref if rank == root else mine.astype(np.float64)
                check(np.array_equal(x.astype(np.float64), want), f"reduce {dtype}")
            n_checks += 4 + 3 * ws
    # torch-only dtypes and the fallbacks: every one against the NumPy answer
    ref = sum(val(r, 6, "float32").astype(np.float64) for r in range(ws))
    bf = torch.from_numpy(val(rank, 6, "float32")).to(torch.bfloat16)
    dist.all_reduce(bf)
    check(np.array_equal(bf.float().numpy(), ref), "torch bfloat16")
    b = torch.tensor([rank == 0, True, False])
    dist.all_reduce(b, op=dist.ReduceOp.MAX)
    check(b.tolist() == [True, True, False], f"torch bool {b}")
    base = torch.from_numpy(np.stack([val(rank, 6, "float32"), np.zeros(6, np.float32)], 1))
    nc = base[:, 0]                       # non-contiguous: staged, copied back
    dist.all_reduce(nc)
    check(np.array_equal(base[:, 0].numpy(), ref), "torch non-contiguous")
    p = torch.nn.Parameter(torch.from_numpy(val(rank, 6, "float32")))
    dist.all_reduce(p)
    check(np.array_equal(p.detach().numpy(), ref), "Parameter")
    rg = torch.from_numpy(val(rank, 6, "float32")).requires_grad_()
    dist.all_reduce(rg)
    check(np.array_equal(rg.detach().numpy(), ref), "requires_grad")
    a = np.stack([val(rank, 6, "float32"), np.zeros(6, np.float32)], 1)
    dist.all_reduce(a[:, 0])
    check(np.array_equal(a[:, 0], ref), "numpy non-contiguous")
    be = val(rank, 6, "float32").astype(">f4")   # not taken by the lean path: refused
    cls, msg, _ = expect_error(lambda: dist.all_reduce(be))
    check(cls is not None and "unsupported dtype >f4" in msg, f"big-endian {msg}")
    empty = torch.empty(0)
    dist.all_reduce(empty)
    dist.all_reduce(np.empty(0, np.float32))
    n_checks += check_sizes(rank, ws)
    # order with queued async work: a big async all-reduce, then a lean one; the lean
    # call returns after the async one finished (one queue, submission order)
    big = np.full(1 << 18, float(rank + 1))
    w = dist.all_reduce(big, async_op=True)
    small = np.full(3, float(rank))
    dist.all_reduce(small)
    check(w.is_completed(), "async work queued first is done when the lean call returns")
    w.wait()
    check(np.all(big == ws * (ws + 1) / 2) and np.all(small == ws * (ws - 1) / 2), "order")
    # small async work and blocking (inline) calls interleaved: every rank runs them in
    # call order (a reordering would be a sequence-number mismatch), with right results
    for k in range(60):
        a1 = torch.full((4,), float(rank + k))
        w1 = dist.all_reduce(a1, async_op=True)
        b1 = np.full(2, float(rank * k), np.float32)
        if k % 3:
            dist.broadcast(b1, src=k % ws)
        else:
            dist.all_reduce(b1)
        check(w1.is_completed(), f"async before blocking, step {k}")
        w2 = dist.broadcast(np.full(3, float(rank)), src=ws - 1, async_op=True)
        dist.barrier()
        check(w2.is_completed(), f"async before barrier, step {k}")
        w1.wait()
        check(bool(torch.all(a1 == sum(r + k for r in range(ws)))), f"interleaved {k} {a1}")
        want = (ws - 1) * ws // 2 * k if k % 3 == 0 else (k % ws) * k
        check(np.all(b1 == want), f"interleaved blocking {k} {b1}")
    for _ in range(200):
        dist.barrier()
    x = np.ones(2, np.float32)
    for _ in range(2000):                  # back to back: the spin paths
        dist.all_reduce(x)
        x[:] = 1
    t = torch.ones(2)
    for _ in range(2000):
        dist.all_reduce(t)
        t.fill_(1)
    check(np.all(x == 1) and bool(torch.all(t == 1)), "reset")
    dist.all_reduce(x)
    check(np.all(x == ws), f"back to back {x}")
    # lean calls are counted and recorded like any other (the straggler report reads it)
    pg = _resolve(None).pg()
    prog, fr = pg.progress(), pg.flight_record()
    check(prog["submitted"] == prog["completed"] > 4000, f"progress {prog}")
    check(fr[-1]["op"] == "all_reduce" and fr[-1]["state"] == "done", f"flight {fr[-1]}")
    report(rank=rank, ok=True, checks=n_checks)
    dist.destroy_process_group()


def check_sizes(rank, ws):
    """all_reduce, broadcast, reduce and barrier of 8 B to 64 KiB (and one element more,
    which is queued rather than inline), float32 NumPy and torch, against NumPy."""
    n_checks = 0
    for nbytes in (8, 64, 512, 4096, 32768, 65536, 65540):
        n = nbytes // 4
        ref = sum(val(r, n, "float32").astype(np.float64) for r in range(ws))
        for mk in (lambda a: a, torch.from_numpy):
            x = mk(val(rank, n, "float32"))
            dist.all_reduce(x)
            check(np.array_equal(np.asarray(x, np.float64), ref), f"sizes sum {nbytes}")
            root = (nbytes // 8) % ws
            x = mk(val(rank, n, "float32", salt=3))
            dist.broadcast(x, src=root)
            check(np.array_equal(np.asarray(x), val(root, n, "float32", salt=3)),
                  f"sizes bcast {nbytes}")
            x = mk(val(rank, n, "float32"))
            dist.reduce(x, dst=root)
            want = ref if rank == root else val(rank, n, "float32").astype(np.float64)
            check(np.array_equal(np.asarray(x, np.float64), want), f"sizes reduce {nbytes}")
            dist.barrier()
            n_checks += 3
    return n_checks


def sc_late(rank, ws):
    dist.init_process_group("cpu")
    for i in range(2):
        if rank == ws - 1:
            time.sleep(1.2)
        t0 = time.monotonic()
        x = torch.full((4,), float(rank + i))
        dist.all_reduce(x)
        y = np.full(4, float(rank))
        dist.broadcast(y, src=ws - 1)
        dist.barrier()
        dt = time.monotonic() - t0
        check(bool(torch.all(x == sum(r + i for r in range(ws)))), f"late sum {x}")
        check(np.all(y == ws - 1), f"late bcast {y}")
    report(rank=rank, ok=True, waited=round(dt, 2))
    dist.destroy_process_group()


def sc_dies(rank, ws, kill=False):
    """The last rank exits while the others call back to back, or (kill) SIGKILLs
    itself a second after they started waiting for it (inline)."""
    dist.init_process_group("cpu")
    x = np.ones(4, np.float32)
    for _ in range(500):
        dist.all_reduce(x)
        x[:] = 1
    if rank == ws - 1:
        if kill:
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)
    cls, msg, dt = expect_error(lambda: [dist.all_reduce(x) for _ in range(1_000_000)])
    report(rank=rank, cls=classes(cls) if cls else None, msg=msg, seconds=round(dt, 2))
    cls2, msg2, dt2 = expect_error(lambda: dist.all_reduce(torch.ones(3)))
    report(rank=rank, after=classes(cls2) if cls2 else None, seconds_after=round(dt2, 2))


def sc_killed(rank, ws):
    sc_dies(rank, ws, kill=True)


def sc_mismatch(rank, ws):
    dist.init_process_group("cpu")
    x = torch.ones(4 + rank)               # a different count on every rank
    cls, msg, dt = expect_error(lambda: dist.all_reduce(x))
    report(rank=rank, cls=classes(cls) if cls else None, msg=msg, seconds=round(dt, 2))


def sc_sigint(rank, ws):
    dist.init_process_group("cpu")
    t = torch.ones(2)
    for _ in range(500):
        dist.all_reduce(t)
    if rank == 0:
        print("READY", flush=True)
        t0 = time.monotonic()
        try:
            while True:
                dist.all_reduce(t)     # the peer stops calling: rank 0 waits here
        except KeyboardInterrupt:
            report(rank=rank, cls="KeyboardInterrupt", seconds=round(time.monotonic() - t0, 2))
        cls, msg, dt = expect_error(lambda: dist.all_reduce(np.ones(4)))
        report(rank=rank, after=classes(cls) if cls else None, msg=msg)
    else:
        time.sleep(4)
        cls, msg, dt = expect_error(lambda: [dist.all_reduce(t) for _ in range(3)])
        report(rank=rank, cls=classes(cls) if cls else None, msg=msg, seconds=round(dt, 2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=["correct", "late", "dies", "killed", "mismatch",
                                         "sigint"])
    a = ap.parse_args()
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    globals()["sc_" + a.scenario](rank, ws)


if __name__ == "__main__":
    main()
