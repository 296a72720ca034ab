"""Worker for tests/test_lightning.py: the same LightningModule fitted and tested twice in
the same processes, first with Lightning's stock "ddp" strategy on CPU (gloo), then
with "ddp_pyddp" (Lightning's DDPStrategy over the "pyddp" torch backend), each from the
same seed; the process group is destroyed in between.

Under Lightning's own launcher rank 0 hosts the job's store on MASTER_PORT for each fit
and the next fit reuses the port: a rank that started the second fit before rank 0's
first store was gone would connect to that old store and lose it mid-rendezvous. So
between fits rank 0 waits until the port no longer answers and then leaves a mark in
--out that the other ranks wait for (under torchrun the agent's store serves both fits).

Run under torchrun (Lightning detects TorchElasticEnvironment and starts nothing) or as
plain ``python lightning_fit.py --devices N`` (Lightning's own launcher re-runs this
script for the other ranks). Rank 0 prints one line per strategy:
``RESULT {json}`` with the final weights, every logged metric (train with sync_dist
means, an integer mean, test metrics), the sampler class Lightning injected and a
checkpoint round trip.
"""
import argparse
import gc
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint

import pyddp.lightning  # noqa: F401 - registers "ddp_pyddp"
from pyddp.torch_backend import ProcessGroupPyddp

SEEN = set()       # (dtype, op) of every all_reduce that reached the pyddp group
_allreduce = ProcessGroupPyddp.allreduce


def _spy(self, tensors, opts=None):
    for t in tensors:
        SEEN.add((str(t.dtype), str(opts.reduceOp.op) if opts is not None else "SUM"))
    return _allreduce(self, tensors, opts)


ProcessGroupPyddp.allreduce = _spy


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=True)
        # an integer metric averaged across ranks (Lightning sends AVG on it as is)
        self.log("rank_code", torch.tensor(3 * self.global_rank + idx % 2), sync_dist=True,
                 reduce_fx="mean", on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch, idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y), sync_dist=True)
        self.log("test_abs", (self(x) - y).abs().mean(), sync_dist=True, reduce_fx="max")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def loaders():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(200, 6, generator=g)        # 200 = not a multiple of 3 ranks * 8
    y = (x @ torch.linspace(-1, 1, 6)).unsqueeze(1) + 0.1 * torch.randn(200, 1, generator=g)
    ds = TensorDataset(x, y)
    return (DataLoader(ds, batch_size=8, shuffle=True),
            DataLoader(TensorDataset(x[:64], y[:64]), batch_size=8))


def fit(strategy, devices, out):
    pl.seed_everything(0, workers=True, verbose=False)
    model = Regressor()
    ckpt = ModelCheckpoint(dirpath=os.path.join(out, strategy), save_last=True)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=3,
                         logger=False, callbacks=[ckpt], enable_progress_bar=False,
                         enable_model_summary=False, deterministic=True)
    train, val = loaders()
    trainer.fit(model, train, val)
    metrics = {k: v.item() for k, v in trainer.callback_metrics.items()}
    sampler = type(trainer.train_dataloader.sampler).__name__
    backend = dist.get_backend()
    tested = trainer.test(model, val, verbose=False)[0]
    restored = Regressor.load_from_checkpoint(ckpt.last_model_path)
    same = all(torch.equal(a, b) for a, b in zip(restored.state_dict().values(),
                                                 model.state_dict().values()))
    result = {"strategy": strategy, "backend": backend, "world": trainer.world_size,
              "strategy_class": type(trainer.strategy).__name__,
              "registered_in": pyddp.lightning.registered_in(),
              "weights": [p.detach().flatten().tolist() for p in model.parameters()],
              "metrics": metrics, "test": tested, "sampler": sampler,
              "checkpoint_round_trip": same, "allreduce_kinds": sorted(SEEN)}
    if trainer.global_rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()
    return trainer.global_rank


def _port_answers(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def between_fits(rank, out, k, deadline_s=60.0):
    """See the module's docstring: rank 0 until its store on MASTER_PORT is gone, every
    other rank until rank 0 says so (a file in out); fails past deadline_s."""
    mark = os.path.join(out, f"fit{k}.done")
    end = time.monotonic() + deadline_s
    if rank == 0:
        gc.collect()   # the trainer's cycles hold the store that rank 0 hosts
        port = int(os.environ.get("MASTER_PORT", "0"))
        while port and _port_answers(port):
            if time.monotonic() > end:
                raise TimeoutError(f"the store on port {port} outlived its fit")
            gc.collect()
            time.sleep(0.05)
        open(mark, "w").close()
        return
    while not os.path.exists(mark):
        if time.monotonic() > end:
            raise TimeoutError(f"rank 0 did not finish fit {k} within {deadline_s:.0f} s")
        time.sleep(0.05)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--strategies", default="ddp,ddp_pyddp")
    a = p.parse_args()
    devices = a.devices or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    own_launcher = "TORCHELASTIC_RUN_ID" not in os.environ
    strategies = a.strategies.split(",")
    for k, strategy in enumerate(strategies):
        rank = fit(strategy, devices, a.out)
        if own_launcher and k + 1 < len(strategies):
            between_fits(rank, a.out, k)


if __name__ == "__main__":
    main()
