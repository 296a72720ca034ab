"""A LightningModule trained with Lightning's DDP over pyddp: `strategy="ddp_pyddp"`.

Under the same torchrun line as any torch DDP script (Lightning detects torchrun and
starts no processes of its own), on one machine or on each of N machines:

    torchrun --standalone --nproc_per_node=2 examples/lightning_train.py
    torchrun --nproc_per_node=2 --nnodes=N --node_rank=i --master_addr=IP \
             --master_port=23456 examples/lightning_train.py

Lightning refuses a world size other than num_nodes x devices, so under torchrun both
come from torchrun's variables (GROUP_WORLD_SIZE nodes of LOCAL_WORLD_SIZE processes);
--num-nodes and --devices override them.

or with Lightning's own launcher, which starts the other processes itself:

    python examples/lightning_train.py --devices 2

The one line that differs from a stock Lightning script is `import pyddp.lightning`
(it registers the strategy name); `strategy="ddp"` would train the same model on gloo.
Metrics logged with `sync_dist=True` are averaged across ranks by pyddp, checkpoints
are written by rank 0 as usual, and `trainer.test` runs on every rank. `--resume PATH`
continues from a checkpoint that only rank 0's machine has: the plugin
`pyddp.lightning.rank0_checkpoint_io()` reads it there and broadcasts it (no shared
storage needed).
"""
import argparse
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import pytorch_lightning as pl

import pyddp.lightning  # noqa: F401 - registers strategy "ddp_pyddp"


class Classifier(pl.LightningModule):
    def __init__(self, lr=0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(20, 128), torch.nn.ReLU(),
                                       torch.nn.Linear(128, 4))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True, on_epoch=True, on_step=False)
        return loss

    def validation_step(self, batch, idx):
        x, y = batch
        self.log("val_acc", (self(x).argmax(1) == y).float().mean(), sync_dist=True)

    def test_step(self, batch, idx):
        x, y = batch
        self.log("test_acc", (self(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def dataset(n, seed):
    """Four Gaussian clusters in 20 dimensions (the same task as examples/torch_backend.py)."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(4, 20, generator=g) * 3
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    return TensorDataset(centres[y] + torch.randn(n, 20, generator=g), y)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=None,
                   help="processes to start (default: torchrun's LOCAL_WORLD_SIZE, else 2)")
    p.add_argument("--num-nodes", type=int, default=None,
                   help="machines in the job (default: torchrun's GROUP_WORLD_SIZE, else 1)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--checkpoint-dir", default="checkpoints/lightning")
    p.add_argument("--resume", default=None, metavar="PATH",
                   help="checkpoint to continue from (needed on rank 0's machine only)")
    args = p.parse_args()
    devices = args.devices or int(os.environ.get("LOCAL_WORLD_SIZE", "2"))
    num_nodes = args.num_nodes or int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes,
                         strategy="ddp_pyddp",
                         max_epochs=args.epochs, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=args.checkpoint_dir,
                         plugins=[pyddp.lightning.rank0_checkpoint_io()],
                         callbacks=[pl.callbacks.ModelCheckpoint(dirpath=args.checkpoint_dir,
                                                                 save_last=True)])
    model = Classifier()
    trainer.fit(model, DataLoader(dataset(4096, 1), batch_size=64, shuffle=True),
                DataLoader(dataset(1024, 2), batch_size=256), ckpt_path=args.resume)
    m = dict(trainer.callback_metrics)     # trainer.test replaces them with its own
    result = trainer.test(model, DataLoader(dataset(1024, 3), batch_size=256), verbose=False)
    if trainer.global_rank == 0:
        print(f"strategy ddp_pyddp on {trainer.world_size} ranks: train_loss "
              f"{m['train_loss'].item():.4f}, val_acc {m['val_acc'].item():.4f}, test_acc "
              f"{result[0]['test_acc']:.4f}, checkpoint "
              f"{trainer.checkpoint_callback.last_model_path}, global step "
              f"{trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
