"""Worker: every collective, dtype and op of pyddp's CPU backend against NumPy.

Run under torchrun or with plain RANK/WORLD_SIZE/MASTER_* variables. Every rank's input
is a deterministic function of (rank, case), so each rank computes the expected result
of every collective locally with NumPy (in float64 / exact integers) and compares. Values
are small multiples of 1/8 so float16/bfloat16 sums are exact and comparisons can be
exact. Prints "PASS <checks>" on success; raises on the first wrong result. Inputs and the
reference are in reference.py.
"""
import argparse
import os
import sys

import numpy as np

import pyddp as dist
from reference import FLOATS, INTS, Checker, check_all_reduce, data, reference

COUNTS = [0, 1, 7, 1000, 40_003]       # 40_003 float64 > 64 KiB: the bandwidth path


def run_numpy(ck, rank, ws):
    case = 0
    for dtype in FLOATS + INTS + ["bool"]:
        ops = ["SUM", "MAX", "MIN", "PRODUCT"] if dtype == "bool" else \
            ["SUM", "AVG", "MIN", "MAX", "PRODUCT"]
        for op in ops:
            for n in COUNTS:
                case += 1
                check_all_reduce(dist, ck, rank, ws, case, n, dtype, op)
        for n in (0, 5, 40_003):
            for root in range(ws):
                case += 1
                x = data(rank, case, n, dtype)
                dist.broadcast(x, src=root)
                ck.eq(x, data(root, case, n, dtype), f"broadcast {dtype} n={n} root={root}")
                case += 1
                x = data(rank, case, n, dtype)
                mine = x.copy()
                dist.reduce(x, dst=root, op=dist.ReduceOp.MAX)
                want = reference([data(r, case, n, dtype) for r in range(ws)], "MAX", dtype) \
                    if rank == root else mine
                ck.eq(x, want, f"reduce {dtype} n={n} root={root}")
            case += 1
            x = data(rank, case, n, dtype)
            out = np.empty(ws * n, dtype=dtype)
            dist.all_gather_into_tensor(out, x)
            ck.eq(out, np.concatenate([data(r, case, n, dtype) for r in range(ws)]),
                  f"all_gather_into_tensor {dtype} n={n}")
            lst = [np.empty(n, dtype=dtype) for _ in range(ws)]
            dist.all_gather(lst, x)
            for r in range(ws):
                ck.eq(lst[r], data(r, case, n, dtype), f"all_gather {dtype} n={n} [{r}]")
            if dtype != "bool":
                case += 1
                full = [data(r, case, ws * n, dtype) for r in range(ws)]
                out = np.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(out, full[rank].copy())
                ck.eq(out, reference(full, "SUM", dtype)[rank * n:(rank + 1) * n],
                      f"reduce_scatter_tensor {dtype} n={n}")
            root = ws - 1
            case += 1
            x = data(rank, case, n, dtype)
            glist = [np.empty(n, dtype=dtype) for _ in range(ws)] if rank == root else None
            dist.gather(x, glist, dst=root)
            if rank == root:
                for r in range(ws):
                    ck.eq(glist[r], data(r, case, n, dtype), f"gather {dtype} n={n} [{r}]")
            case += 1
            out = np.empty(n, dtype=dtype)
            slist = [data(100 + r, case, n, dtype) for r in range(ws)] if rank == 0 else None
            dist.scatter(out, slist, src=0)
            ck.eq(out, data(100 + rank, case, n, dtype), f"scatter {dtype} n={n}")
    # point to point around a ring
    if ws > 1:
        for n in (1, 40_003):
            case += 1
            nxt, prv = (rank + 1) % ws, (rank - 1) % ws
            x = data(rank, case, n, "float32")
            y = np.empty(n, dtype=np.float32)
            if rank % 2 == 0:
                dist.send(x, nxt)
                dist.recv(y, prv)
            else:
                dist.recv(y, prv)
                dist.send(x, nxt)
            ck.eq(y, data(prv, case, n, "float32"), f"send/recv n={n}")
    # async: several in flight, completed in order
    case += 1
    xs = [data(rank, case + i, 1000, "float32") for i in range(4)]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    for i, (w, x) in enumerate(zip(works, xs)):
        assert w.wait() is True
        assert w.is_completed()
        ck.eq(x, reference([data(r, case + i, 1000, "float32") for r in range(ws)], "SUM",
                           "float32"), f"async all_reduce {i}")
    case += 10
    # non-contiguous (strided) arrays are staged and written back
    base = np.zeros((6, 4), dtype=np.float64)
    view = base[:, 1]
    view[:] = rank + 1
    dist.all_reduce(view)
    ck.eq(base[:, 1], np.full(6, ws * (ws + 1) / 2), "non-contiguous all_reduce")
    ck.eq(base[:, 0], np.zeros(6), "non-contiguous neighbours untouched")
    # multi-dimensional arrays
    m = np.full((3, 5, 2), float(rank), dtype=np.float32)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    ck.eq(m, np.full((3, 5, 2), ws - 1, dtype=np.float32), "3-d all_reduce")


def run_objects(ck, rank, ws):
    objs = [{"rank": rank, "payload": "x" * (rank * 100)}, None, (1, 2.5)]
    if rank != 0:
        objs = [None, None, None]
    dist.broadcast_object_list(objs, src=0)
    assert objs == [{"rank": 0, "payload": ""}, None, (1, 2.5)], objs
    out = [None] * ws
    dist.all_gather_object(out, {"r": rank, "big": list(range(rank * 50))})
    assert out == [{"r": r, "big": list(range(r * 50))} for r in range(ws)], out
    g = [None] * ws if rank == 0 else None
    dist.gather_object(("g", rank), g, dst=0)
    if rank == 0:
        assert g == [("g", r) for r in range(ws)], g
    o = [None]
    dist.scatter_object_list(o, [f"s{r}" for r in range(ws)] if rank == 0 else None, src=0)
    assert o == [f"s{rank}"], o
    ck.n += 4


def run_torch(ck, rank, ws):
    import torch
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        for n in (3, 40_003):
            t = torch.full((n,), float(rank + 1), dtype=dt)
            dist.all_reduce(t)
            want = torch.full((n,), float(ws * (ws + 1) // 2), dtype=dt)
            assert torch.equal(t, want), (dt, n, t[:4])
            ck.n += 1
    # bfloat16 sums accumulate in float32: 256 + 1 + ... stays exact in float32 and is
    # rounded once (bf16 has 8 significant bits)
    t = torch.tensor([1.0 / 256 if rank else 1.0], dtype=torch.bfloat16)
    dist.all_reduce(t)
    exact = torch.tensor([1.0 + (ws - 1) / 256], dtype=torch.float32).to(torch.bfloat16)
    assert torch.equal(t, exact), (t, exact)
    # a parameter that requires grad, without detaching
    p = torch.nn.Parameter(torch.full((4,), float(rank)))
    dist.all_reduce(p, op=dist.ReduceOp.AVG)
    assert torch.allclose(p.detach(), torch.full((4,), (ws - 1) / 2)), p
    # torch.distributed.ReduceOp is accepted too
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    assert t.item() == ws - 1
    # non-contiguous torch tensor
    b = torch.zeros(4, 3)
    b[:, 2] = rank + 1.0
    dist.all_reduce(b[:, 2])
    assert torch.equal(b[:, 2], torch.full((4,), ws * (ws + 1) / 2)) and b[:, :2].abs().sum() == 0
    # list outputs in torch
    outs = [torch.empty(2, 2) for _ in range(ws)]
    dist.all_gather(outs, torch.full((2, 2), float(rank)))
    assert all(torch.equal(o, torch.full((2, 2), float(r))) for r, o in enumerate(outs))
    ck.n += 5


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--local-rank", "--local_rank", type=int, default=None)
    a = ap.parse_args()
    dist.init_process_group(a.backend)
    rank, ws = dist.get_rank(), dist.get_world_size()
    assert int(os.environ["RANK"]) == rank and int(os.environ["WORLD_SIZE"]) == ws
    ck = Checker(rank)
    run_numpy(ck, rank, ws)
    run_objects(ck, rank, ws)
    if not a.no_torch:
        run_torch(ck, rank, ws)
    dist.barrier()
    dist.destroy_process_group()
    assert "torch" not in sys.modules or not a.no_torch, "pyddp imported torch"
    print(f"rank {rank}: PASS {ck.n} checks", flush=True)


if __name__ == "__main__":
    main()
