"""Train a classifier with pyddp under stock torchrun: the README's main job.

    torchrun --standalone --nproc_per_node=2 examples/train.py
    torchrun --standalone --nproc_per_node=2 examples/train.py --resume   # continue
    torchrun --nproc_per_node=G ... examples/train.py --device cuda   # one GPU per process

The script makes its own synthetic dataset (no downloads): noisy points around 10
random class centres in 32 dimensions, split into a training and a test set that
every rank generates identically from the same seed. pyddp.DistributedSampler
gives each rank its share, pyddp.DistributedDataParallel averages the gradients, rank
0 logs one line per epoch (mean loss over all ranks, samples/s) and saves a checkpoint
every --checkpoint-every epochs (the model's and the optimizer's state_dict, written
atomically, on rank 0's disk); --resume continues from the latest one: rank 0 reads it
and every rank receives the state from rank 0, so VMs without shared storage resume
from the same weights (only node 0 needs the file). The run ends with the accuracy on
the test set. About 10 s on 2 CPU cores.

It is an ordinary torch DDP script; only these three lines differ from one:

    import pyddp as dist                                  # torch.distributed
    from pyddp import DistributedDataParallel as DDP      # torch.nn.parallel
    from pyddp import DistributedSampler                  # torch.utils.data

On GPU machines ``--device cuda`` puts each process on its own GPU (number
``pyddp.cuda_device_for_local_rank()``, which is ``LOCAL_RANK``, as torch scripts do with
``device_ids=[local_rank]``) and the gradients go through NCCL; ``--device auto`` takes
the GPU where there is one and the CPU elsewhere, so the same line runs on both.

The deprecated ``python -m torch.distributed.launch`` passes ``--local-rank``; it is
accepted (and ignored: the rank comes from the environment either way).
"""
import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pyddp as dist
from pyddp import DistributedDataParallel as DDP
from pyddp import DistributedSampler

DIM, CLASSES = 32, 10


def add_training_args(p):
    """The options every training example here shares: epochs, batch, lr, data, seed."""
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--train-samples", type=int, default=16384)
    p.add_argument("--test-samples", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_training_args(p)
    p.add_argument("--backend", choices=["cpu", "gloo", "nccl"], default=None,
                   help="cpu (alias gloo) or nccl; default: pyddp's choice (host arrays "
                        "on the CPU transport, GPU arrays on NCCL)")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu",
                   help="where the model trains (auto: cuda if a GPU is visible)")
    p.add_argument("--checkpoint-dir", default="checkpoints")
    p.add_argument("--checkpoint-every", type=int, default=1, help="epochs (0: never)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--local-rank", "--local_rank", type=int, default=None,
                   help="set by the deprecated torch.distributed.launch; not needed")
    return p.parse_args(argv)


def make_data(n_train, n_test, seed, noise=1.5):
    """Synthetic classification data, identical on every rank for a given seed: points
    scattered around CLASSES random centres in DIM dimensions (overlapping enough that
    the best accuracy is about 95%)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, DIM, generator=g)
    y = torch.randint(0, CLASSES, (n_train + n_test,), generator=g)
    x = centres[y] + noise * torch.randn(n_train + n_test, DIM, generator=g)
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


def make_model():
    return nn.Sequential(nn.Linear(DIM, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, CLASSES))


def checkpoint_path(directory):
    return os.path.join(directory, "latest.pt")


def save_checkpoint(directory, model, opt, epoch):
    """Rank 0 writes the unwrapped model's state (keys without "module.") atomically;
    the barrier keeps other ranks from reading a half-written file later."""
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        tmp = checkpoint_path(directory) + ".tmp"
        torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                    "epoch": epoch}, tmp)
        os.replace(tmp, checkpoint_path(directory))
    dist.barrier()


def load_checkpoint(directory, model, opt):
    """Rank 0 reads the checkpoint and every rank receives its model and optimizer state
    from rank 0 (broadcast_object_list), so only rank 0's disk needs the file: on VMs
    without shared storage the other nodes have no copy (or an older one), and no rank
    may start from weights of its own. Returns the epoch to start from."""
    state = None
    if dist.get_rank() == 0:
        path = checkpoint_path(directory)
        if os.path.exists(path):
            state = torch.load(path, map_location="cpu")
            print(f"resumed from {path} after epoch {state['epoch'] + 1}", flush=True)
        else:
            print(f"no checkpoint at {path}; starting from scratch", flush=True)
    box = [state]
    dist.broadcast_object_list(box, src=0)
    state = box[0]
    if state is None:
        return 0
    model.module.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    print(f"rank {dist.get_rank()}: starting at epoch {state['epoch'] + 2} with state digest "
          f"{state_digest(model.module.state_dict(), opt.state_dict())}", flush=True)
    return state["epoch"] + 1


def state_digest(model_state, opt_state):
    """A short hash of a model's and an optimizer's tensors, equal on ranks that hold the
    same state (printed on resume; the tests compare it with the checkpoint file's)."""
    import hashlib
    h = hashlib.sha256()
    tensors = list(model_state.values())
    for _, st in sorted(opt_state["state"].items()):
        tensors += [v for _, v in sorted(st.items()) if torch.is_tensor(v)]
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def global_mean(total, count, device="cpu"):
    t = torch.tensor([total, count], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def evaluate(model, dataset, batch_size, device):
    sampler = DistributedSampler(dataset, shuffle=False, drop_last=True)
    correct = seen = 0
    model.eval()
    with torch.no_grad():
        for x, y in DataLoader(dataset, batch_size=batch_size, sampler=sampler):
            x, y = x.to(device), y.to(device)
            correct += (model(x).argmax(dim=1) == y).sum().item()
            seen += len(y)
    model.train()
    return global_mean(correct, seen, device), int(seen * dist.get_world_size())


def pick_device(choice):
    """torch.device for --device: one GPU per process (its number from LOCAL_RANK),
    made current before anything is allocated on it; or the CPU."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU is visible to torch on this machine "
                         "(use --device cpu or auto)")
    index = dist.cuda_device_for_local_rank()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def main(argv=None):
    args = parse_args(argv)
    device = pick_device(args.device)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed + rank)   # ranks start different; DDP broadcasts rank 0's
    train_set, test_set = make_data(args.train_samples, args.test_samples, args.seed)
    model = DDP(make_model().to(device),
                device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start = load_checkpoint(args.checkpoint_dir, model, opt) if args.resume else 0
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    if rank == 0:
        print(f"training on {world} process(es), {len(train_set)} samples, "
              f"{sum(p.numel() for p in model.parameters())} parameters, backend "
              f"{dist.get_backend()}, device {device.type}", flush=True)
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        t0, total, count = time.perf_counter(), 0.0, 0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()                  # gradients are averaged across ranks here
            opt.step()
            total += loss.item() * len(y)
            count += len(y)
        mean_loss = global_mean(total, count, device)
        elapsed = time.perf_counter() - t0
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}  loss {mean_loss:.4f}  "
                  f"samples/s {count * world / elapsed:,.0f}  ({elapsed:.1f} s)", flush=True)
        if args.checkpoint_every and (epoch + 1) % args.checkpoint_every == 0:
            save_checkpoint(args.checkpoint_dir, model, opt, epoch)
    accuracy, n = evaluate(model, test_set, 256, device)
    if rank == 0:
        print(f"final accuracy {accuracy:.4f} on {n} test samples", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
