"""Training checks for tests/test_torch_backend.py, run in processes whose default group
is "pyddp": torch's own DistributedDataParallel over the pyddp group against the same
DDP over a gloo group made with new_group(backend="gloo") in the same processes; FSDP2
(fully_shard) over pyddp against DDP over gloo; DTensor on a DeviceMesh.

Both sides start from the same weights and see the same rank-dependent batches; after
every step their weights must agree (exactly at world size 2, where a two-term sum does
not depend on order; relative 1e-5 above) and every rank must hold bit-identical weights.
"""
import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 4


class Net(nn.Module):
    """A small MLP with a branch that some configurations leave unused, and optional
    BatchNorm (buffers that differ across ranks until broadcast)."""

    def __init__(self, bn=False):
        super().__init__()
        self.fc1 = nn.Linear(10, 48)
        self.bn = nn.BatchNorm1d(48) if bn else None
        self.fc2 = nn.Linear(48, 48)
        self.out = nn.Linear(48, 4)
        self.branch = nn.Linear(48, 4)

    def forward(self, x, use_branch=True):
        h = torch.relu(self.fc1(x))
        if self.bn is not None:
            h = self.bn(h)
        h = torch.relu(self.fc2(h))
        return self.out(h) + self.branch(h) if use_branch else self.out(h)


def _fp16_hook(model):
    model.register_comm_hook(model.process_group, default_hooks.fp16_compress_hook)


def _powersgd(model):
    # PowerSGD's callbacks wait for further all-reduces inside the future chain
    state = powerSGD_hook.PowerSGDState(process_group=model.process_group,
                                        matrix_approximation_rank=2, start_powerSGD_iter=2,
                                        random_seed=0)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


# name -> (Net kwargs, DDP kwargs, micro-batches per step, branch used?(step, rank), setup)
CONFIGS = {
    "plain": ({}, {}, 1, None, None),
    "tiny_buckets": ({}, {"bucket_cap_mb": 0.001}, 1, None, None),
    "bucket_view": ({}, {"gradient_as_bucket_view": True}, 1, None, None),
    "no_sync": ({}, {}, 3, None, None),
    "unused": ({}, {"find_unused_parameters": True}, 1,
               lambda step, rank: step % 2 == 0 or rank == 0, None),
    "static_graph": ({}, {"static_graph": True}, 1, None, None),
    "buffers": ({"bn": True}, {"broadcast_buffers": True}, 1, None, None),
    "fp16_hook": ({}, {}, 1, None, _fp16_hook),
    "powersgd": ({}, {}, 1, None, _powersgd),
}


def _params(model):
    return [p.detach().clone() for p in model.parameters()] + \
        [b.detach().clone() for b in model.buffers() if b.dtype.is_floating_point]


def _compare(ck, ours, ref, what, ws, rtol=1e-5, atol=1e-7):
    for i, (a, b) in enumerate(zip(ours, ref)):
        if ws == 2:
            ck.eq(a, b, f"{what} tensor {i}")
        else:
            ck.true(torch.allclose(a, b, rtol=rtol, atol=atol),
                    f"{what} tensor {i}: max diff {(a - b).abs().max().item()}")


def _same_everywhere(ck, tensors, gloo, what):
    flat = torch.cat([t.flatten().double() for t in tensors])
    lst = [torch.empty_like(flat) for _ in range(gloo.size())]
    dist.all_gather(lst, flat, group=gloo)
    ck.true(all(torch.equal(x, lst[0]) for x in lst), f"{what}: ranks hold different weights")


def _batch(rank, step, micro):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(8, 10, generator=g), torch.randint(0, 4, (8,), generator=g)


def check_ddp(ck, rank, ws, gloo):
    """Every configuration: torch DDP over pyddp equals torch DDP over gloo."""
    for name, (net_kw, ddp_kw, micro, used, setup) in CONFIGS.items():
        torch.manual_seed(7 + rank)          # different per rank: DDP broadcasts rank 0's
        base = Net(**net_kw)
        models = {"pyddp": DDP(copy.deepcopy(base), **ddp_kw),
                  "gloo": DDP(copy.deepcopy(base), process_group=gloo, **ddp_kw)}
        if setup is not None:
            for m in models.values():
                setup(m)
        opts = {k: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
                for k, m in models.items()}
        for step in range(STEPS):
            use = used(step, rank) if used else True
            for k, m in models.items():
                opts[k].zero_grad()
                for mb in range(micro):
                    x, y = _batch(rank, step, mb)
                    last = mb == micro - 1
                    ctx = m.no_sync() if not last else contextlib.nullcontext()
                    with ctx:
                        F.cross_entropy(m(x, use), y).backward()
                opts[k].step()
            ours, ref = _params(models["pyddp"].module), _params(models["gloo"].module)
            # float16 sums of 3+ terms: gloo rounds every partial sum, pyddp accumulates
            # in float32 and rounds once, so they differ by float16 rounding
            tol = {"rtol": 2e-3, "atol": 1e-5} if name == "fp16_hook" else {}
            _compare(ck, ours, ref, f"ddp {name} step {step}", ws, **tol)
            # parameters only: BatchNorm's running statistics are per rank between syncs
            _same_everywhere(ck, [p.detach() for p in models["pyddp"].parameters()], gloo,
                             f"ddp {name} step {step}")
        print(f"PASS ddp_{name} rank={rank}", flush=True)


def check_fsdp2(ck, rank, ws, gloo):
    """fully_shard over the default (pyddp) mesh trains like DDP over gloo: the sharded
    parameters, gathered, equal DDP's after every step."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    torch.manual_seed(11)
    base = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 4))
    ref = DDP(copy.deepcopy(base), process_group=gloo)
    mesh = init_device_mesh("cpu", (ws,))
    sharded = copy.deepcopy(base)
    for layer in sharded:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    o_fs = torch.optim.SGD(sharded.parameters(), lr=0.05)
    for step in range(STEPS):
        x, y = _batch(rank, step, 0)
        for m, o in ((ref, o_ref), (sharded, o_fs)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
        full = [p.full_tensor().detach() for p in sharded.parameters()]
        want = [p.detach() for p in ref.module.parameters()]
        for i, (a, b) in enumerate(zip(full, want)):
            ck.true(torch.allclose(a, b, rtol=1e-5, atol=1e-6),
                    f"fsdp2 step {step} param {i}: max diff {(a - b).abs().max().item()}")
    print(f"PASS fsdp2 rank={rank}", flush=True)


def check_dtensor(ck, rank, ws):
    """DTensor basics on a 1-D CPU mesh: sharding, full_tensor, redistribute, a partial
    sum reduced to a replicated value."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (ws,))
    full = torch.arange(ws * 6, dtype=torch.float32).reshape(ws * 2, 3)
    dt = distribute_tensor(full, mesh, [Shard(0)])
    ck.eq(dt.to_local(), full[2 * rank:2 * rank + 2], "dtensor local shard")
    ck.eq(dt.full_tensor(), full, "dtensor full_tensor")
    rep = dt.redistribute(mesh, [Replicate()])
    ck.eq(rep.to_local(), full, "dtensor redistribute to Replicate")
    total = dt.sum()
    ck.eq(total.full_tensor(), full.sum(), "dtensor sum")
    mm = (dt @ distribute_tensor(torch.ones(3, 2), mesh, [Replicate()])).full_tensor()
    ck.eq(mm, full @ torch.ones(3, 2), "dtensor matmul")
    print(f"PASS dtensor rank={rank}", flush=True)
