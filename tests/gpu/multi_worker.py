"""A torchrun worker for tests/gpu/test_nccl_multi.py: every collective over NCCL at the
launch's world size, one GPU per rank, against references computed on the CPU from the
inputs every rank is known to hold. Prints "OK rank R" on success."""
import torch

import pyddp
from pyddp import ReduceOp


def rank_input(r, n, dtype):
    """Rank r's input: known to every rank, so each can compute the reference."""
    base = torch.arange(n, dtype=torch.float64) % 5 + r + 1
    return base.to(dtype)


def main():
    pyddp.init_process_group("nccl")
    r, ws = pyddp.get_rank(), pyddp.get_world_size()
    torch.cuda.set_device(pyddp.cuda_device_for_local_rank())
    n = 1000
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
                  torch.int64, torch.int8, torch.uint8):
        stack = torch.stack([rank_input(q, n, dtype) for q in range(ws)])
        ops = {ReduceOp.SUM: stack.sum(0, dtype=dtype), ReduceOp.MIN: stack.amin(0),
               ReduceOp.MAX: stack.amax(0)}
        if dtype.is_floating_point:
            ops[ReduceOp.AVG] = (stack.double().sum(0) / ws).to(dtype)
        for op, ref in ops.items():
            x = rank_input(r, n, dtype).cuda()
            pyddp.all_reduce(x, op=op)
            tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6
            assert torch.allclose(x.cpu().double(), ref.double(), rtol=tol), (dtype, op)
        x = rank_input(r, n, dtype).cuda()
        pyddp.broadcast(x, src=ws - 1)
        assert torch.equal(x.cpu(), stack[ws - 1])
        out = torch.empty(ws * n, dtype=dtype, device="cuda")
        pyddp.all_gather_into_tensor(out, rank_input(r, n, dtype).cuda())
        assert torch.equal(out.cpu(), stack.flatten())
        rs = torch.empty(n, dtype=dtype, device="cuda")
        big = torch.cat([rank_input(r, n, dtype)] * ws).cuda()
        pyddp.reduce_scatter_tensor(rs, big, op=ReduceOp.MAX)
        assert torch.equal(rs.cpu(), stack.amax(0))
        g = [torch.empty(n, dtype=dtype, device="cuda") for _ in range(ws)] if r == 0 else None
        pyddp.gather(rank_input(r, n, dtype).cuda(), g, dst=0)
        if r == 0:
            assert all(torch.equal(g[q].cpu(), stack[q]) for q in range(ws))
        s = torch.empty(n, dtype=dtype, device="cuda")
        pyddp.scatter(s, [t.cuda() for t in stack] if r == 1 % ws else None, src=1 % ws)
        assert torch.equal(s.cpu(), stack[r])
    # point to point around a ring, even ranks sending first
    x = torch.full((n,), float(r), device="cuda")
    y = torch.empty(n, device="cuda")
    nxt, prv = (r + 1) % ws, (r - 1) % ws
    if r % 2 == 0:
        pyddp.send(x, nxt)
        pyddp.recv(y, prv)
    else:
        pyddp.recv(y, prv)
        pyddp.send(x, nxt)
    assert torch.all(y == prv).item()
    objs = [None] * ws
    pyddp.all_gather_object(objs, {"rank": r})
    assert objs == [{"rank": q} for q in range(ws)]
    pyddp.barrier()
    pyddp.destroy_process_group()
    print(f"OK rank {r}", flush=True)


if __name__ == "__main__":
    main()
