"""Train the main demo's classifier in place elastically: a lost node never ends the
job, a node that comes back (with the same launch line) is admitted without
restarting the others, a node sent SIGTERM (a spot VM's notice) leaves at the next
commit.

On every node, the same line, at the first start and at every return, the job's
coordination in an etcd cluster (any node can go, the first one included;
docs/elastic.md has the other forms, and where etcd runs):

    torchrun --rdzv-backend=pyddp --rdzv-endpoint=etcd://E1:2379,E2:2379,E3:2379 \\
             --rdzv-id=job1 --nnodes=1:4 --nproc_per_node=2 --max-restarts=100 \\
             examples/elastic_train.py

or, with nothing to install, ``--rdzv-endpoint=$MASTER:29500`` (the job's store in that
node's torchrun agent: the one node the job cannot lose).

On one machine, to try it: ``torchrun --standalone --nproc_per_node=2
examples/elastic_train.py``.

The data and model are examples/train.py's (synthetic, made by every rank from the same
seed). What makes it elastic, as in docs/elastic.md's script:

* ``elastic.TorchState`` holds the model, the optimizer, the sampler and the epoch;
  ``state.commit()`` every ``--commit-every`` steps and at the end of each epoch;
* ``elastic.ElasticSampler`` hands each rank its share of the samples of the epoch not
  trained yet, at whatever world size each pass starts with, and ``record_batch``
  after every step keeps that position; it rolls back with the model, so every sample
  of every epoch is trained once whatever the changes (padding aside), and the
  ``DataLoader`` is made once;
* ``@elastic.run`` re-enters ``train(state)`` after every change, in the same process.

``--checkpoint-dir`` (or PYDDP_ELASTIC_CHECKPOINT_DIR) keeps every commit on each node's
disk too, so even losing the endpoint's node (without etcd), or etcd's majority, costs
only the steps since the last commit: the job started again resumes from the newest
copy on any node.
"""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pyddp as dist  # noqa: E402
from pyddp import DistributedDataParallel as DDP  # noqa: E402
from pyddp import elastic  # noqa: E402
from train import add_training_args, evaluate, make_data, make_model  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_training_args(p)
    p.add_argument("--commit-every", type=int, default=20, help="steps between commits")
    p.add_argument("--checkpoint-dir", default=None,
                   help="keep commits on this node's disk (default: memory only)")
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="seconds to sleep per step (to watch a change happen)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    dist.init_process_group("cpu")
    torch.manual_seed(args.seed)
    train_set, test_set = make_data(args.train_samples, args.test_samples, args.seed)
    model = DDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = elastic.ElasticSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)  # made once
    state = elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0)

    @elastic.run(checkpoint_dir=args.checkpoint_dir)
    def train(state):
        while state.epoch < args.epochs:
            sampler.set_epoch(state.epoch)     # keeps the position on re-entry
            t0, loss_sum, seen = time.perf_counter(), 0.0, 0
            for i, (x, y) in enumerate(loader):
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                loss_sum, seen = loss_sum + loss.item() * len(y), seen + len(y)
                sampler.record_batch(i, args.batch_size)
                if args.step_delay:
                    time.sleep(args.step_delay)
                if (i + 1) % args.commit_every == 0:
                    state.commit()             # every rank can roll back to here
            if dist.get_rank() == 0:
                print(f"epoch {state.epoch + 1}/{args.epochs}  world {dist.get_world_size()}  "
                      f"loss {loss_sum / max(seen, 1):.4f}  "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
            state.epoch += 1
            state.commit()
        return True

    finished = train(state)
    if finished:
        acc, n = evaluate(model, test_set, 256, "cpu")
        if dist.get_rank() == 0:
            print(f"final accuracy {acc:.3f} on {n} test samples", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
