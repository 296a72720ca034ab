"""Worker for tests/test_accelerate.py: a few training steps with Hugging Face Accelerate
on the CPU, under torchrun. argv[1] "pyddp": the documented pattern, torch's default group
made with backend "pyddp" before Accelerator(cpu=True) (which then keeps it); "gloo":
Accelerate's stock CPU path, which makes a gloo group itself. Prints one line
"RESULT <json>" per rank: the backend of torch's default group, whether Accelerate wrapped
the model in DDP, a digest of the trained weights, and what accelerator.gather returned
on its two paths (all_gather of a list, used when Accelerate's backend label is "gloo",
as on the CPU; all_gather_into_tensor otherwise, as on GPUs)."""
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from accelerate import Accelerator
from accelerate.state import PartialState


def main():
    mode = sys.argv[1]
    if mode == "pyddp":
        dist.init_process_group("pyddp")
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=g)
    data = TensorDataset(x, (x[:, 0] > 0).long())
    loader = DataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(2))
    model, opt, loader = acc.prepare(model, opt, loader)
    for xb, yb in loader:
        opt.zero_grad()
        acc.backward(torch.nn.functional.cross_entropy(model(xb), yb))
        opt.step()
    r = acc.process_index
    mine = {"v": torch.tensor([float(r), 10.0 + r]), "i": torch.tensor([r, 2 * r])}
    state = PartialState()
    label = state.backend
    listed = acc.gather(mine)                  # label "gloo": all_gather into a list
    state.backend = "pyddp"                    # the other path: all_gather_into_tensor
    try:
        flat = acc.gather(mine)
    finally:
        state.backend = label
    h = hashlib.sha256()
    for p in acc.unwrap_model(model).parameters():
        h.update(p.detach().numpy().tobytes())
    out = {"rank": r, "world": acc.num_processes, "backend": dist.get_backend(),
           "wrapped": isinstance(model, torch.nn.parallel.DistributedDataParallel),
           "weights": h.hexdigest(), "label": label,
           "listed": {k: v.tolist() for k, v in listed.items()},
           "flat": {k: v.tolist() for k, v in flat.items()}}
    os.write(1, ("RESULT " + json.dumps(out) + "\n").encode())   # whole, not interleaved
    acc.end_training()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
