"""The PyTorch DDP tutorial's script (basic use, checkpointing, a DataLoader with a
DistributedSampler), moved to pyddp by changing only its imports:

    torchrun --standalone --nproc_per_node=2 examples/from_torch_ddp.py

The three changed lines:

    import torch.distributed as dist                              ->  import pyddp as dist
    from torch.nn.parallel import DistributedDataParallel as DDP  ->  from pyddp import DistributedDataParallel as DDP
    from torch.utils.data.distributed import DistributedSampler   ->  from pyddp import DistributedSampler

Everything else is the torch tutorial's code: "gloo" is accepted as an alias of pyddp's
CPU backend, and checkpoints use the usual save-on-rank-0, barrier, load-everywhere
pattern.
"""
import os
import tempfile

import torch
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import DataLoader, TensorDataset

import pyddp as dist                                # was: import torch.distributed as dist
from pyddp import DistributedDataParallel as DDP    # was: from torch.nn.parallel import ...
from pyddp import DistributedSampler                # was: from torch.utils.data.distributed import ...


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def train_step(ddp_model):
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5)
    loss = loss_fn(outputs, labels)
    loss.backward()
    optimizer.step()
    return loss.item()


def demo_basic(rank):
    print(f"Running basic DDP example on rank {rank}.")
    model = ToyModel()
    ddp_model = DDP(model)
    print(f"rank {rank}: basic step done, loss {train_step(ddp_model):.4f}")


def demo_checkpoint(rank):
    print(f"Running DDP checkpoint example on rank {rank}.")
    model = ToyModel()
    ddp_model = DDP(model)

    CHECKPOINT_PATH = os.path.join(tempfile.gettempdir(),
                                   f"model-{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}.checkpoint")
    if rank == 0:
        # All processes should see same parameters as they all start from same
        # random parameters and gradients are synchronized in backward passes.
        # Therefore, saving it in one process is sufficient.
        torch.save(ddp_model.state_dict(), CHECKPOINT_PATH)

    # Use a barrier() to make sure that process 1 loads the model after process
    # 0 saves it.
    dist.barrier()
    ddp_model.load_state_dict(torch.load(CHECKPOINT_PATH, map_location="cpu"))
    train_step(ddp_model)

    # Not necessary to use a dist.barrier() to guard the file deletion below
    # as the AllReduce ops in the backward pass of DDP already served as
    # a synchronization.
    if rank == 0:
        os.remove(CHECKPOINT_PATH)
    print(f"rank {rank}: checkpoint round trip done")


def demo_data_loader(rank):
    dataset = TensorDataset(torch.randn(256, 10), torch.randn(256, 5))
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    ddp_model = DDP(ToyModel())
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.01)
    loss_fn = nn.MSELoss()
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(ddp_model(x), y)
            loss.backward()
            optimizer.step()
        print(f"rank {rank}: epoch {epoch} last loss {loss.item():.4f}")


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"Start running basic DDP example on rank {rank}.")
    demo_basic(rank)
    demo_checkpoint(rank)
    demo_data_loader(rank)
    dist.destroy_process_group()
    print(f"Finished running DDP example on rank {rank}.")


if __name__ == "__main__":
    main()
