"""A plain torch.distributed DDP training script whose only change is the backend name:

    torchrun --standalone --nproc_per_node=2 examples/torch_backend.py

It imports only torch. With pyddp installed, torch loads pyddp's backend at
`import torch` (an entry point), so `init_process_group(backend="pyddp")` is all it
takes: torch's own DistributedDataParallel, DistributedSampler, barrier and object
collectives then run on pyddp's transport. Set BACKEND = "gloo" and the script is the
stock torch one, with the same losses.

(With TORCH_DEVICE_BACKEND_AUTOLOAD=0 torch loads no plugins; add
`import pyddp.torch_backend` to register the backend yourself.)
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

BACKEND = "pyddp"                   # the only change: was "gloo"


def dataset(n=4096, seed=0):
    """Four Gaussian clusters in 20 dimensions: an easy, deterministic task."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(4, 20, generator=g) * 3
    y = torch.randint(0, 4, (n,), generator=g)
    x = centres[y] + torch.randn(n, 20, generator=g)
    return TensorDataset(x, y)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--checkpoint", default=None, help="save rank 0's weights here")
    args = p.parse_args()

    dist.init_process_group(backend=BACKEND)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(20, 128), nn.ReLU(), nn.Linear(128, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = dataset()
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=64, sampler=sampler)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2)
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()                 # gradients are averaged across ranks here
            opt.step()
            total += torch.tensor([loss.item() * len(y), len(y)])
        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}  loss {total[0] / total[1]:.6f}", flush=True)
    with torch.no_grad():
        x, y = data.tensors
        acc = (model(x).argmax(1) == y).float().mean().item()
    summary = [None] * world
    dist.all_gather_object(summary, (rank, round(acc, 6)))
    if rank == 0:
        print(f"backend {dist.get_backend()}, {world} ranks, accuracy {acc:.4f}, per rank "
              f"{summary}", flush=True)
        if args.checkpoint:
            torch.save(model.module.state_dict(), args.checkpoint)
    dist.barrier()
    if args.checkpoint and rank != 0:
        model.module.load_state_dict(torch.load(args.checkpoint))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
