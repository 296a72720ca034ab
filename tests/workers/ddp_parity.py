"""Worker for tests/test_ddp_parity.py, run under torchrun: trains the same model with
torch's own DistributedDataParallel (gloo) and with pyddp's, from the same rank-dependent
initial weights and the same rank-dependent data, and checks, for each configuration:

* per-step losses and final weights (and buffers) agree with torch's, relative 1e-5;
* after every step every rank holds bit-identical weights;
* the error cases fail cleanly on every rank with messages naming what is wrong.

Prints "PASS <config> rank=<r> ..." per configuration and rank; exits non-zero on the
first failure. Usage: torchrun --nproc_per_node=N ddp_parity.py [config ...]
"""
import contextlib
import copy
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import pyddp

STEPS = 4
RTOL = 1e-5


class Net(nn.Module):
    """A small MLP with an optional head (used or not per call), an optional head that is
    never used, and optional BatchNorm (buffers that differ across ranks)."""

    def __init__(self, bn=False, dead=False, width=32, strided=False, ckpt=False):
        super().__init__()
        self.ckpt = ckpt
        self.fc1 = nn.Linear(10, width)
        if strided:   # a non-contiguous parameter: its gradient is strided the same way
            self.fc1.weight = nn.Parameter(self.fc1.weight.detach().t().contiguous().t())
        self.bn = nn.BatchNorm1d(width) if bn else None
        self.fc2 = nn.Linear(width, width)
        self.out = nn.Linear(width, 4)
        self.branch = nn.Linear(width, 4)
        self.dead = nn.Linear(3, 3) if dead else None

    def forward(self, x, use_branch=True):
        h = torch.relu(self.fc1(x))
        if self.bn is not None:
            h = self.bn(h)
        if self.ckpt:   # fc2 twice, each under reentrant checkpointing: 2 gradients each
            h = torch.relu(checkpoint(self.fc2, h, use_reentrant=True))
            h = checkpoint(self.fc2, h, use_reentrant=True)
        h = torch.relu(self.fc2(h))
        y = self.out(h)
        return y + self.branch(h) if use_branch else y


# name -> (model kwargs, DDP kwargs, micro-batches per step, branch use rule)
def _always(step, rank):
    return True


def _sometimes(step, rank):
    # unused everywhere on step 1; used only by rank 0 on step 2 (its .grad must
    # then appear on every rank, as torch's DDP does)
    return step not in (1, 2) or (step == 2 and rank == 0)


CONFIGS = {
    "plain": ({}, {}, 1, _always),
    "no_sync": ({}, {}, 3, _always),
    "unused": ({}, {"find_unused_parameters": True}, 1, _sometimes),
    "unused_no_sync": ({}, {"find_unused_parameters": True}, 2, _sometimes),
    "view": ({}, {"gradient_as_bucket_view": True}, 2, _always),
    "tiny_buckets": ({}, {"bucket_cap_mb": 0.0005}, 1, _always),
    "static": ({"dead": True}, {"static_graph": True}, 1, _always),
    "static_checkpoint": ({"ckpt": True}, {"static_graph": True}, 1, _always),
    "buffers": ({"bn": True}, {}, 2, _always),
    "strided": ({"strided": True}, {}, 1, _always),
    "generic": ({}, {"bucket_cap_mb": 0.002, "pyddp": {"_generic_path": True}}, 2, _always),
    "generic_unused": ({}, {"find_unused_parameters": True, "gradient_as_bucket_view": True,
                            "pyddp": {"_generic_path": True}}, 1, _sometimes),
}


def batch(step, micro, rank):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(6, 10, generator=g), torch.randint(0, 4, (6,), generator=g)


def train_step(ddp, opt, step, accum, use_branch, rank, losses):
    """One optimizer step of accum micro-batches (all but the last under no_sync);
    appends each micro-batch's loss to losses."""
    opt.zero_grad()
    for micro in range(accum):
        x, y = batch(step, micro, rank)
        ctx = ddp.no_sync() if micro < accum - 1 else contextlib.nullcontext()
        with ctx:
            loss = F.cross_entropy(ddp(x, use_branch=use_branch(step, rank)), y)
            loss.backward()
        losses.append(loss.item())
    opt.step()


def train(ddp, model, accum, use_branch, rank, check):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(STEPS):
        train_step(ddp, opt, step, accum, use_branch, rank, losses)
        check(model, step)
    return losses


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def identical_across_ranks(model, step):
    # parameters only: buffers such as BatchNorm statistics are per rank until the
    # next forward broadcasts rank 0's
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [None] * pyddp.get_world_size()
    pyddp.all_gather_object(everyone, flat)
    for r, other in enumerate(everyone):
        if not torch.equal(other, everyone[0]):
            raise AssertionError(f"after step {step} rank {r}'s weights differ from rank 0's "
                                 f"(max {float((other - everyone[0]).abs().max())})")


def rel_diff(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def states_agree(name, ref_model, our_model):
    """Assert that our_model's parameters and buffers equal ref_model's (floating point:
    relative RTOL); returns the largest relative difference."""
    ref_state, our_state = state(ref_model), state(our_model)
    worst = 0.0
    for k, v in ref_state.items():
        if v.is_floating_point():
            d = rel_diff(our_state[k], v)
            assert d <= RTOL, f"{name}: {k} differs from torch's DDP (relative {d:.3g})"
            worst = max(worst, d)
        else:
            assert torch.equal(our_state[k], v), f"{name}: buffer {k} differs"
    return worst


def run_parity(name, rank):
    model_kw, ddp_kw, accum, use_branch = CONFIGS[name]
    ddp_kw = dict(ddp_kw)
    pyddp_only = ddp_kw.pop("pyddp", {})
    torch.manual_seed(1234 + rank)            # ranks start different: DDP must broadcast
    base = Net(**model_kw)
    ref_model, our_model = copy.deepcopy(base), copy.deepcopy(base)
    ref = nn.parallel.DistributedDataParallel(ref_model, **ddp_kw)
    ours = pyddp.DistributedDataParallel(our_model, **ddp_kw, **pyddp_only)
    assert isinstance(ours, pyddp.DistributedDataParallel) and ours.module is our_model
    ref_losses = train(ref, ref_model, accum, use_branch, rank, lambda m, s: None)
    our_losses = train(ours, our_model, accum, use_branch, rank, identical_across_ranks)
    worst = rel_diff(torch.tensor(our_losses), torch.tensor(ref_losses))
    assert worst <= RTOL, f"{name}: losses differ from torch's DDP: {our_losses} vs {ref_losses}"
    worst = max(worst, states_agree(name, ref_model, our_model))
    for (k, p), (_, q) in zip(ref_model.named_parameters(), our_model.named_parameters()):
        assert (p.grad is None) == (q.grad is None), f"{name}: {k}.grad presence differs"
    assert list(ours.state_dict()) == list(ref.state_dict())
    # buckets are re-planned once in arrival order, except with a dynamic unused set
    dynamic = ddp_kw.get("find_unused_parameters") and not ddp_kw.get("static_graph")
    assert ours._sync.rebuilt == (not dynamic), name
    print(f"PASS {name} rank={rank} max_rel_diff={worst:.3g}", flush=True)


def run_subgroup(rank):
    """DDP on a subgroup (process_group=): ranks 0 and 1 average only between
    themselves, exactly as torch's DDP on the same gloo subgroup; at world size 3, rank
    2 is not a member and runs plain local training, unaffected."""
    members = [0, 1]
    ours_g = pyddp.new_group(members)      # every rank calls new_group, as in torch
    ref_g = tdist.new_group(members)
    torch.manual_seed(77 + rank)
    base = Net()
    ref_model, our_model = copy.deepcopy(base), copy.deepcopy(base)
    if rank not in members:
        print(f"PASS subgroup rank={rank} (not a member)", flush=True)
        return
    ref = nn.parallel.DistributedDataParallel(ref_model, process_group=ref_g)
    ours = pyddp.DistributedDataParallel(our_model, process_group=ours_g)
    ref_losses = train(ref, ref_model, 1, _always, rank, lambda m, s: None)
    our_losses = train(ours, our_model, 1, _always, rank, lambda m, s: None)
    worst = rel_diff(torch.tensor(our_losses), torch.tensor(ref_losses))
    for (k, p), (_, q) in zip(ref_model.named_parameters(), our_model.named_parameters()):
        worst = max(worst, rel_diff(q.detach(), p.detach()))
    assert worst <= RTOL, f"subgroup: differs from torch's DDP on the subgroup ({worst:.3g})"
    print(f"PASS subgroup rank={rank} max_rel_diff={worst:.3g}", flush=True)


def run_unused_error(rank):
    torch.manual_seed(5)
    model = Net()
    ddp = pyddp.DistributedDataParallel(model)
    x, y = batch(0, 0, rank)
    try:
        F.cross_entropy(ddp(x, use_branch=False), y).backward()
    except pyddp.DistError as e:
        msg = str(e)
        assert "branch.weight" in msg and "branch.bias" in msg, msg
        assert "find_unused_parameters=True" in msg, msg
    else:
        raise AssertionError("an unused parameter without find_unused_parameters did not fail")
    try:
        ddp(x)
    except pyddp.DistError as e:
        assert "branch.weight" in str(e)
    else:
        raise AssertionError("the next forward after the unused-parameter error did not fail")
    # The failing rank broke the process group, so its peers fail fast too.
    try:
        pyddp.barrier()
    except pyddp.DistError as e:
        assert "broken" in str(e) and "received no gradient" in str(e), str(e)
    else:
        raise AssertionError("the group still worked after DDP failed on this rank")
    _reinit()
    print(f"PASS unused_error rank={rank}", flush=True)


def run_unused_alone(rank):
    """Only rank 0 skips a parameter: it fails, and rank 1, waiting in the all-reduce,
    fails within seconds (not at the 60 s timeout) because rank 0 broke the group."""
    torch.manual_seed(5)
    ddp = pyddp.DistributedDataParallel(Net(), bucket_cap_mb=0.0001)
    x, y = batch(0, 0, rank)
    t0 = time.monotonic()
    try:
        F.cross_entropy(ddp(x, use_branch=rank != 0), y).backward()
    except pyddp.DistError as e:
        if rank == 0:
            assert "branch.weight" in str(e), str(e)
    else:
        if rank == 0:
            raise AssertionError("an unused parameter on rank 0 did not fail there")
    if rank != 0:
        try:
            ddp(x)
            pyddp.barrier()
        except pyddp.DistError:
            pass
        else:
            raise AssertionError("rank 1 did not notice that rank 0 failed")
    took = time.monotonic() - t0
    assert took < 15, f"rank {rank} took {took:.1f} s to fail"
    _reinit()
    print(f"PASS unused_alone rank={rank} took={took:.2f}s", flush=True)


def _reinit():
    pyddp.destroy_process_group()
    pyddp.init_process_group("cpu", timeout=timedelta(seconds=60))


def run_mismatch_error(rank):
    for model, what in ((Net(width=32 + (rank == 1)), "shape"),
                        (Net(dead=rank == 1), "count")):
        try:
            pyddp.DistributedDataParallel(model)
        except pyddp.DistValueError as e:
            msg = str(e)
            assert "rank 1" in msg and "rank 0" in msg, msg
            if what == "shape":
                assert "fc1.weight" in msg, msg
        else:
            raise AssertionError(f"parameters differing in {what} across ranks were accepted")
    pyddp.barrier()    # the group is still usable after the error
    print(f"PASS mismatch_error rank={rank}", flush=True)


def run_twice_error(rank):
    """fc2 under reentrant checkpointing twice, without static_graph: its second gradient
    in one backward is an error naming it (the C hook hands such a gradient to the Python
    rules), and the group is broken so the peers fail too."""
    torch.manual_seed(5)
    ddp = pyddp.DistributedDataParallel(Net(ckpt=True))
    x, y = batch(0, 0, rank)
    try:
        F.cross_entropy(ddp(x), y).backward()
    except pyddp.DistError as e:
        assert "fc2.weight" in str(e) or "fc2.bias" in str(e), str(e)
        assert "second gradient" in str(e) and "static_graph=True" in str(e), str(e)
    else:
        raise AssertionError("a second gradient in one backward pass was accepted")
    _reinit()
    print(f"PASS twice_error rank={rank}", flush=True)


def run_destroyed_group(rank):
    """The process group is destroyed under a wrapped model: backward raises DistError
    saying so (from inside the gradient hook), and a new group works."""
    torch.manual_seed(5)
    ddp = pyddp.DistributedDataParallel(Net())
    x, y = batch(0, 0, rank)
    loss = F.cross_entropy(ddp(x), y)
    pyddp.barrier()
    pyddp.destroy_process_group()
    try:
        loss.backward()
    except pyddp.DistError as e:
        assert "destroyed" in str(e), str(e)
    else:
        raise AssertionError("backward on a destroyed process group did not fail")
    pyddp.init_process_group("cpu", timeout=timedelta(seconds=60))
    pyddp.barrier()
    print(f"PASS destroyed_group rank={rank}", flush=True)


def run_collected(rank):
    """Once the DDP wrapper is garbage-collected, its hooks on the module's parameters do
    nothing: backward on the bare module gives this rank's own gradients (as without
    DDP) and communicates nothing, even on rank 0 alone (a launched all-reduce would
    pair with the barrier below: a mismatch)."""
    import gc
    torch.manual_seed(5 + rank)
    model, plain = Net(), Net()
    ddp = pyddp.DistributedDataParallel(model)   # rank 0's weights everywhere
    plain.load_state_dict(model.state_dict())
    x, y = batch(0, 0, rank)
    for _ in range(2):      # synced steps while it lives (the second forward re-plans)
        F.cross_entropy(ddp(x), y).backward()
    model.zero_grad(set_to_none=True)
    if rank == 0:
        ddp(x)                                  # a synced backward expected ...
    del ddp                                     # ... but the wrapper goes away
    gc.collect()
    if rank == 0:
        F.cross_entropy(model(x), y).backward()
        F.cross_entropy(plain(x), y).backward()
        for (k, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
            assert torch.equal(p.grad, q.grad), f"collected: {k}.grad is not the local gradient"
    pyddp.barrier()
    t = torch.ones(3)
    pyddp.all_reduce(t)
    assert t.tolist() == [pyddp.get_world_size()] * 3, t
    print(f"PASS collected rank={rank}", flush=True)


def main():
    names = sys.argv[1:] or list(CONFIGS) + ["subgroup", "unused_error", "unused_alone",
                                             "mismatch_error", "twice_error",
                                             "destroyed_group", "collected"]
    tdist.init_process_group("gloo")
    pyddp.init_process_group("cpu", timeout=timedelta(seconds=60))
    rank = pyddp.get_rank()
    assert rank == tdist.get_rank()
    for name in names:
        if name == "unused_error":
            run_unused_error(rank)
        elif name == "unused_alone":
            run_unused_alone(rank)
        elif name == "subgroup":
            run_subgroup(rank)
        elif name == "mismatch_error":
            run_mismatch_error(rank)
        elif name == "twice_error":
            run_twice_error(rank)
        elif name == "destroyed_group":
            run_destroyed_group(rank)
        elif name == "collected":
            run_collected(rank)
        else:
            run_parity(name, rank)
    pyddp.destroy_process_group()
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
