"""A two-layer MLP in pure NumPy (hand-written backward), trained data-parallel with
pyddp, and checked against one process training on the full batch.

    torchrun --standalone --nproc_per_node=2 examples/numpy_mlp.py
    python examples/numpy_mlp.py            # one process (world size 1) works too

Any model can use pyddp's DDP if its parameters expose arrays: here each parameter is
a small object with ``.data`` and ``.grad`` (NumPy arrays), and the model has
``named_parameters()``. After the hand-written backward has filled every ``.grad``,
one call, ``ddp.sync_gradients()``, averages them across ranks through the same
buckets and C reducer that torch models use. ``ddp.no_sync()`` accumulates
micro-batches locally (``--accum``), exactly as with torch.

Every step, each of the W ranks takes its 1/W share of the global batch and averages
its loss over it, so the averaged gradient equals the full-batch gradient and the
trained weights equal those of one process training on the whole batch; rank 0 trains
that reference at the end and prints the largest difference (float64: ~1e-15).
"""
import argparse
import contextlib
import os
import socket
import sys

import numpy as np

import pyddp as dist
from pyddp import DistributedDataParallel as DDP


class Param:
    """A parameter: its value and its gradient (None until a backward fills it)."""

    def __init__(self, data):
        self.data = data
        self.grad = None


class MLP:
    """x -> tanh(x W1 + b1) W2 + b2, with its own backward."""

    def __init__(self, n_in, n_hidden, n_out, seed):
        rng = np.random.default_rng(seed)
        self.W1 = Param(rng.normal(0, 1 / np.sqrt(n_in), (n_in, n_hidden)))
        self.b1 = Param(np.zeros(n_hidden))
        self.W2 = Param(rng.normal(0, 1 / np.sqrt(n_hidden), (n_hidden, n_out)))
        self.b2 = Param(np.zeros(n_out))

    def named_parameters(self):
        return [("W1", self.W1), ("b1", self.b1), ("W2", self.W2), ("b2", self.b2)]

    def __call__(self, x):
        self._x = x
        self._h = np.tanh(x @ self.W1.data + self.b1.data)
        return self._h @ self.W2.data + self.b2.data

    def backward(self, dout):
        """Accumulate (+=) the gradients of sum(out * dout) into .grad, as autograd does."""
        dh = (dout @ self.W2.data.T) * (1 - self._h ** 2)
        for p, g in ((self.W2, self._h.T @ dout), (self.b2, dout.sum(0)),
                     (self.W1, self._x.T @ dh), (self.b1, dh.sum(0))):
            p.grad = g if p.grad is None else p.grad + g

    def zero_grad(self):
        for _, p in self.named_parameters():
            p.grad = None


def softmax_cross_entropy(logits, y):
    """Mean cross-entropy over the batch and its gradient with respect to logits."""
    z = logits - logits.max(1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(1, keepdims=True)
    n = len(y)
    loss = -np.log(p[np.arange(n), y]).mean()
    p[np.arange(n), y] -= 1
    return loss, p / n


def make_data(n, n_in, n_out, seed):
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 1, (n_out, n_in))
    y = rng.integers(0, n_out, n)
    return centres[y] + rng.normal(0, 1.0, (n, n_in)), y


def train(model, ddp, x, y, args, rank, world):
    """SGD on global batches of args.batch samples; this rank takes its share of each,
    split into args.accum micro-batches. Returns the per-step mean losses of this rank."""
    losses = []
    share = args.batch // world
    micro = share // args.accum
    for step in range(args.steps):
        lo = (step * args.batch) % len(x) + rank * share
        model.zero_grad()
        for m in range(args.accum):
            sl = slice(lo + m * micro, lo + (m + 1) * micro)
            last = m == args.accum - 1
            with (contextlib.nullcontext() if last or ddp is None else ddp.no_sync()):
                loss, dlogits = softmax_cross_entropy(model(x[sl]), y[sl])
                model.backward(dlogits / args.accum)
                if ddp is not None:
                    ddp.sync_gradients()     # averages across ranks (no-op inside no_sync)
            losses.append(loss)
        for _, p in model.named_parameters():
            p.data -= args.lr * p.grad
    return losses


def init():
    """Under torchrun (or with RANK etc. set) use the environment; alone, a 1-rank group."""
    if "RANK" in os.environ:
        dist.init_process_group("cpu")
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("cpu", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=96, help="global batch (all ranks)")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step (no_sync)")
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--bucket-cap-mb", type=float, default=0.01)
    args = p.parse_args(argv)
    init()
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % (world * args.accum):
        sys.exit(f"--batch must be a multiple of world size x --accum ({world * args.accum})")
    x, y = make_data(4096, 20, 5, seed=1)
    model = MLP(20, 64, 5, seed=100 + rank)   # ranks start different; DDP broadcasts rank 0's
    ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    losses = train(model, ddp, x, y, args, rank, world)
    if rank == 0:
        print(f"world size {world}: loss {losses[0]:.4f} -> {losses[-1]:.4f} "
              f"over {args.steps} steps", flush=True)
        # Reference: one process, full global batch, same initial weights (rank 0's).
        ref = MLP(20, 64, 5, seed=100)
        full = argparse.Namespace(**{**vars(args), "accum": 1})
        train(ref, None, x, y, full, 0, 1)
        diff = max(float(np.abs(a.data - b.data).max())
                   for (_, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()))
        ok = diff < 1e-9
        print(f"max |DDP weight - full-batch weight| = {diff:.3g}: "
              f"{'matches' if ok else 'DIFFERS FROM'} single-process full-batch training",
              flush=True)
    else:
        ok = True
    dist.destroy_process_group()
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
