"""One small DDP training run, for tests/gpu/test_nccl_ddp.py.

Usage: python ddp_train.py BACKEND DEVICE [gradient_as_bucket_view] [find_unused]
Trains a float64 MLP for a few steps under pyddp.DistributedDataParallel at world size 1
on DEVICE ("cuda" or "cpu") with backend BACKEND ("nccl" or "cpu"), with small buckets so
that there are many, and prints the losses and final parameters as one JSON line.
"""
import json
import sys
from datetime import timedelta

import numpy as np
import torch

import pyddp


def main():
    backend, device = sys.argv[1], sys.argv[2]
    as_view = "gradient_as_bucket_view" in sys.argv[3:]
    unused = "find_unused" in sys.argv[3:]
    torch.backends.cuda.matmul.allow_tf32 = False
    store = pyddp.TCPStore("127.0.0.1", 0, is_master=True)
    pyddp.init_process_group(backend, store=store, rank=0, world_size=1,
                             timeout=timedelta(seconds=60))
    if device == "cuda":
        torch.cuda.set_device(pyddp.cuda_device_for_local_rank())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 4)).double()
    extra = torch.nn.Linear(4, 4).double()            # unused when find_unused
    holder = torch.nn.ModuleDict({"body": model, "extra": extra}).to(device)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = holder

        def forward(self, x):
            y = self.m["body"](x)
            return y if unused else self.m["extra"](y)

    ddp = pyddp.DistributedDataParallel(Net().to(device), bucket_cap_mb=0.004,
                                        gradient_as_bucket_view=as_view,
                                        find_unused_parameters=unused)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.standard_normal((32, 16))).to(device)
    y = torch.from_numpy(rng.standard_normal((32, 4))).to(device)
    losses = []
    for step in range(12):
        opt.zero_grad()
        if step % 4 == 3:
            with ddp.no_sync():                          # accumulate, then a synced step
                torch.nn.functional.mse_loss(ddp(x), y).backward()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = [p.detach().cpu().flatten().tolist() for p in ddp.parameters()]
    pyddp.destroy_process_group()
    store.close()
    print("RESULT " + json.dumps({"losses": losses, "params": params}), flush=True)


if __name__ == "__main__":
    main()
