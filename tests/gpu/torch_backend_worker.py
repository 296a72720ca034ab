"""A worker for tests/gpu/test_torch_backend_cuda.py: torch's API over the backend "pyddp"
on CUDA tensors (pyddp's lean GPU path, csrc/py/py_torch_cuda.c and
pyddp/torch_backend/_cuda.py), beside torch's own "nccl" in the same process. Runs under
torchrun (one GPU per rank) or alone (world size 1, plain environment variables set by
the test). Every result is checked against a reference computed on the CPU from inputs
every rank knows; torch's DDP over "pyddp" against torch's DDP over "nccl" from the same
initialisation. Prints one "RESULT " JSON line: the names of the checks that failed
(empty when all passed) and what ran.
"""
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist

import pyddp
import pyddp.torch_backend  # noqa: F401 - registers "pyddp" even with autoload off

R = dist.ReduceOp


def rank_input(r, n, dtype):
    """Rank r's input: known to every rank, so each can compute the reference."""
    base = torch.arange(n, dtype=torch.float64) % 5 + r + 1
    return base.to(dtype)


def check(failed, name, ok):
    if not ok:
        failed.append(name)


def collectives(pg, r, ws, dev, failed):
    """all_reduce (blocking, asynchronous, its future), broadcast and reduce on pg."""
    n = 1000
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
                  torch.int64, torch.uint8):
        stack = torch.stack([rank_input(q, n, dtype) for q in range(ws)])
        refs = {R.SUM: stack.sum(0, dtype=dtype), R.MIN: stack.amin(0), R.MAX: stack.amax(0)}
        if dtype.is_floating_point:
            refs[R.AVG] = (stack.double().sum(0) / ws).to(dtype)
        for op, ref in refs.items():
            x = rank_input(r, n, dtype).to(dev)
            dist.all_reduce(x, op=op, group=pg)
            check(failed, f"all_reduce {dtype} {op}", torch.equal(x.cpu(), ref))
            y = rank_input(r, n, dtype).to(dev)
            w = dist.all_reduce(y, op=op, group=pg, async_op=True)
            fut = w.get_future()
            check(failed, f"async {dtype} {op}", w.wait() is True and
                  torch.equal(y.cpu(), ref) and torch.equal(fut.wait()[0].cpu(), ref))
    x = rank_input(r, n, torch.float32).to(dev)
    dist.broadcast(x, src=ws - 1, group=pg)
    check(failed, "broadcast", torch.equal(x.cpu(), rank_input(ws - 1, n, torch.float32)))
    x = rank_input(r, n, torch.float32).to(dev)
    dist.reduce(x, dst=0, group=pg)
    ref = sum(rank_input(q, n, torch.float32) for q in range(ws))
    check(failed, "reduce", r != 0 or torch.equal(x.cpu(), ref))
    check(failed, "reduce leaves others", r == 0 or torch.equal(x.cpu(), rank_input(r, n,
                                                                               torch.float32)))


def streams(pg, r, ws, dev, failed):
    """Ordered after the producer's stream, visible on the caller's: a side stream kept
    busy, a blocking call, an asynchronous one waited for, a future's callback."""
    n = 1 << 20
    total = sum(q + 1 for q in range(ws))
    s = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(s):
        x = torch.zeros(n, device=dev)
        torch.cuda._sleep(50_000_000)         # keep s busy so that a race would show
        x.fill_(r + 1)
        dist.all_reduce(x, group=pg)
        y = x * 2
    s.synchronize()
    check(failed, "blocking after producer", bool((y == 2 * total).all()))
    with torch.cuda.stream(s):
        x = torch.zeros(n, device=dev)
        torch.cuda._sleep(50_000_000)
        x.fill_(r + 1)
        w = dist.all_reduce(x, group=pg, async_op=True)
        w.wait()
        y = x + 1
    s.synchronize()
    check(failed, "async wait on the stream", bool((y == total + 1).all()))
    x = torch.full((n,), float(r + 1), device=dev)
    fut = dist.all_reduce(x, group=pg, async_op=True).get_future()
    z = fut.then(lambda f: f.value()[0] * 3).wait()
    torch.cuda.synchronize()
    check(failed, "future then", bool((z == 3 * total).all()))


def ddp(pg, r, dev, failed):
    """torch's DDP over "pyddp" and over "nccl" from one initialisation: the same
    parameters after a few steps (one with no_sync)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    base = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                               torch.nn.Linear(256, 256), torch.nn.Tanh(),
                               torch.nn.Linear(256, 8)).double()
    import copy
    models = {"nccl": DDP(copy.deepcopy(base).to(dev), device_ids=[dev], bucket_cap_mb=0.1),
              "pyddp": DDP(copy.deepcopy(base).to(dev), device_ids=[dev], bucket_cap_mb=0.1,
                           process_group=pg)}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for k, m in models.items()}
    g = torch.Generator().manual_seed(10 + r)
    x = torch.randn(32, 64, generator=g, dtype=torch.float64).to(dev)
    y = torch.randn(32, 8, generator=g, dtype=torch.float64).to(dev)
    for step in range(8):
        for k, m in models.items():
            opts[k].zero_grad()
            if step == 3:
                with m.no_sync():
                    torch.nn.functional.mse_loss(m(x), y).backward()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opts[k].step()
    same = all(torch.allclose(p, q, rtol=1e-10, atol=1e-12) for p, q in
               zip(models["nccl"].parameters(), models["pyddp"].parameters()))
    check(failed, "DDP over pyddp = DDP over nccl", same)


def main():
    dev = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", timeout=timedelta(seconds=120))
    r, ws = dist.get_rank(), dist.get_world_size()
    pg = dist.new_group(backend="pyddp")
    failed = []
    collectives(pg, r, ws, dev, failed)
    streams(pg, r, ws, dev, failed)
    ddp(pg, r, dev, failed)
    # an abort breaks the group for good: the next call on a CUDA tensor fails at once,
    # with the reason, as torch's error
    pg.handle._pg.abort("test abort")
    try:
        dist.all_reduce(torch.ones(2, device=dev), group=pg)
        failed.append("call after abort")
    except dist.DistBackendError as e:
        check(failed, "abort message", "test abort" in str(e))
    dist.destroy_process_group()
    print("RESULT " + json.dumps({"rank": r, "world": ws, "failed": failed,
                                  "pyddp": pyddp.__version__, "torch": torch.__version__}),
          flush=True)


if __name__ == "__main__":
    main()
