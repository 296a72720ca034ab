"""Worker for tests/test_ddp_rules.py, run under torchrun: the static_graph errors of
DDP's per-gradient rules, on every rank alike. A graph that gives a parameter more
gradients than in the first iteration fails in the gradient hook, naming the parameter
and both counts; one that gives a parameter none at all fails at the end of backward,
naming it. Prints "PASS <case> rank=<r>"; exits non-zero on the first failure.
Usage: torchrun --nproc_per_node=N ddp_rules.py
"""
from datetime import timedelta

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import pyddp


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.ckpt = False
        self.fc1 = nn.Linear(10, 16)
        self.fc2 = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)
        self.branch = nn.Linear(16, 4)

    def forward(self, x, use_branch=True):
        h = torch.relu(self.fc1(x))
        if self.ckpt:   # fc2 once more, under reentrant checkpointing: 2 gradients
            h = torch.relu(checkpoint(self.fc2, h, use_reentrant=True))
        h = torch.relu(self.fc2(h))
        y = self.out(h)
        return y + self.branch(h) if use_branch else y


def batch(rank):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(6, 10, generator=g), torch.randint(0, 4, (6,), generator=g)


def expect_failure(fn, *words):
    try:
        fn()
    except pyddp.DistError as e:
        for w in words:
            assert w in str(e), (w, str(e))
        return str(e)
    raise AssertionError(f"no DistError (expected one saying {words})")


def run_static_more(rank):
    torch.manual_seed(5)
    model = Net()
    ddp = pyddp.DistributedDataParallel(model, static_graph=True)
    x, y = batch(rank)
    for _ in range(2):                  # learned in the first, checked in the second
        F.cross_entropy(ddp(x), y).backward()
    model.ckpt = True
    expect_failure(lambda: F.cross_entropy(ddp(x), y).backward(), "static_graph=True",
                   "fc2.", "received 2 gradients", "but 1 in the first iteration",
                   "use static_graph=False")
    expect_failure(lambda: ddp(x), "received 2 gradients")     # DDP stays broken
    print(f"PASS static_more rank={rank}", flush=True)


def run_static_fewer(rank):
    torch.manual_seed(5)
    ddp = pyddp.DistributedDataParallel(Net(), static_graph=True)
    x, y = batch(rank)
    F.cross_entropy(ddp(x), y).backward()
    msg = expect_failure(lambda: F.cross_entropy(ddp(x, use_branch=False), y).backward(),
                         "branch.weight", "branch.bias", "unlike in the first iteration",
                         "static_graph=True requires the same graph every iteration")
    assert "fc2" not in msg, msg
    print(f"PASS static_fewer rank={rank}", flush=True)


def _reinit():
    pyddp.destroy_process_group()
    pyddp.init_process_group("cpu", timeout=timedelta(seconds=60))


def main():
    pyddp.init_process_group("cpu", timeout=timedelta(seconds=60))
    rank = pyddp.get_rank()
    run_static_more(rank)
    _reinit()
    run_static_fewer(rank)
    pyddp.destroy_process_group()


if __name__ == "__main__":
    main()
