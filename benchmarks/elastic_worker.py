"""The training script of benchmarks/elastic.py, run by torchrun on every loopback node:

    elastic_worker.py MODE STEPS_PER_EPOCH HIDDEN STOP_FILE

an MLP under pyddp's DDP on DistributedSampler data. MODE ``inplace``: the state in
``pyddp.elastic`` (a commit every epoch; the same script for the agent's store and for
etcd, only torchrun's line differs); ``restart``: a checkpoint on each node's own disk
(CKPT_DIR) every epoch, resumed from the newest one on any node. Rank 0 prints one line
per step, ``STEP <time.time()> <world size> <global step>``, which is all the driver
reads; the job ends after the epoch in which STOP_FILE appears.
"""
import os
import sys
import time

N = 4096        # samples


def train(mode, steps_per_epoch, hidden, stop_file):
    """Train until STOP_FILE exists (checked by rank 0 after each epoch, broadcast)."""
    import torch
    import pyddp as dist
    from pyddp import DistributedDataParallel as DDP, DistributedSampler
    if mode == "inplace":
        from pyddp import elastic  # noqa: F401 - before init: a returning node joins
    dist.init_process_group("cpu")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                                    torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                    torch.nn.Linear(hidden, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 64, generator=g), torch.randint(0, 10, (N,), generator=g)
    box = {}

    def remake():
        ws = dist.get_world_size()
        box["sampler"] = DistributedSampler(range(N), shuffle=True, seed=1)
        box["batch"] = max(N // (ws * steps_per_epoch), 1)

    def epoch_steps(epoch):
        sampler = box["sampler"]
        sampler.set_epoch(epoch)
        idx, b = list(sampler), box["batch"]
        for i in range(0, len(idx) - b + 1, b):
            batch = idx[i:i + b]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            opt.step()
            if dist.get_rank() == 0:
                print(f"STEP {time.time():.4f} {dist.get_world_size()} "
                      f"{epoch * steps_per_epoch + i // b}", flush=True)

    def stop():
        flag = [os.path.exists(stop_file)]
        dist.broadcast_object_list(flag, src=0)
        return flag[0]

    remake()
    if mode == "inplace":
        state = elastic.TorchState(model=model, optimizer=opt, epoch=0)
        state.register_reset_callbacks([remake])

        @elastic.run
        def loop(state):
            while True:
                epoch_steps(state.epoch)
                state.epoch += 1
                state.commit()
                if stop():
                    return
        loop(state)
    else:
        _restart_loop(dist, model, opt, epoch_steps, stop)
    dist.destroy_process_group()


def _restart_loop(dist, model, opt, epoch_steps, stop):
    """Restart-based: resume from the newest checkpoint on any node, save one per epoch."""
    import torch
    ckpt = os.path.join(os.environ["CKPT_DIR"], "latest.pt")
    mine, saved = -1, None
    if int(os.environ["LOCAL_RANK"]) == 0 and os.path.exists(ckpt):
        saved = torch.load(ckpt)
        mine = saved["epoch"]
    epochs = [None] * dist.get_world_size()
    dist.all_gather_object(epochs, mine)
    epoch = max(epochs) + 1
    if epoch > 0:
        box = [saved if mine == epoch - 1 else None]
        dist.broadcast_object_list(box, src=epochs.index(epoch - 1))
        model.module.load_state_dict(box[0]["model"])
        opt.load_state_dict(box[0]["optimizer"])
    while True:
        epoch_steps(epoch)
        if int(os.environ["LOCAL_RANK"]) == 0:
            os.makedirs(os.environ["CKPT_DIR"], exist_ok=True)
            torch.save({"model": model.module.state_dict(),
                        "optimizer": opt.state_dict(), "epoch": epoch}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        epoch += 1
        if stop():
            break


if __name__ == "__main__":
    mode, steps, hidden, stop_file = sys.argv[1:5]
    train(mode, int(steps), int(hidden), stop_file)
