"""A small torch training job for the elastic tests (tests/test_elastic.py), launched by
torchrun on network-namespace hosts.

    elastic_job.py restart STEP_S STOP_FILE   # torchrun restarts the workers on a change
    elastic_job.py inplace STEP_S STOP_FILE   # pyddp.elastic: the processes go on
    elastic_job.py torchddp STEP_S STOP_FILE  # the same with torch's DDP and sampler

A Linear model under pyddp's DDP on 192 samples split by DistributedSampler, batch 8,
sleeping STEP_S after each step so that a host can be killed mid-epoch. After every
epoch rank 0 prints one JSON line: the epoch, the world size, every sample index the
ranks used in it (whether they are each index of the dataset once), each rank's digest of parameters and optimizer state, and
the mode's counters. The job stops after the epoch in which STOP_FILE exists (rank 0
decides, every rank follows) and prints ``done`` on each rank.

restart: each node's local rank 0 saves a checkpoint after every epoch into CKPT_DIR
(a directory of that host's own: no shared storage); on start the newest checkpoint
among the nodes is sent by its holder to every rank (broadcast_object_list).

inplace: the loop runs under pyddp.elastic.run with a TorchState committed after every
epoch (the sampler is made again by a reset callback); each record also lists the
ranks' process ids, so that a test sees survivors go on in the same processes. A
process started with PYDDP_ELASTIC_JOIN is admitted into the running job.

torchddp: inplace with the first seed's script: torch.distributed.init_process_group
("pyddp"), torch's DistributedDataParallel and DistributedSampler; the reset callback
makes torch's DDP wrapper and the sampler again.
"""
import hashlib
import json
import os
import sys
import time

import torch

import pyddp as dist
from pyddp import DistributedDataParallel as DDP
from pyddp import DistributedSampler

N, BATCH = 192, 8


def digest(model, opt):
    h = hashlib.sha256()
    for t in list(model.state_dict().values()):
        h.update(t.detach().contiguous().numpy().tobytes())
    for s in opt.state_dict()["state"].values():
        for t in s.values():
            if torch.is_tensor(t):
                h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, 8, generator=g), torch.randint(0, 4, (N,), generator=g)


def run_epoch(model, opt, sampler, epoch, x, y, step_s):
    """One epoch; returns the sample indices this rank used."""
    sampler.set_epoch(epoch)
    idx = list(sampler)
    for i in range(0, len(idx), BATCH):
        b = idx[i:i + BATCH]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[b]), y[b]).backward()
        opt.step()
        time.sleep(step_s)
    return idx


def report(model, opt, epoch, idx, stop_file, extra, dist=dist):
    """Rank 0's JSON line for the epoch; True when every rank should stop (dist:
    pyddp, or torch.distributed for torchddp)."""
    used = [None] * dist.get_world_size()
    dist.all_gather_object(used, idx)
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest(model.module, opt))
    flag = [os.path.exists(stop_file)]
    dist.broadcast_object_list(flag, src=0)
    if dist.get_rank() == 0:
        print(json.dumps({"epoch": epoch, "world": dist.get_world_size(),
                          "covered": sorted(i for u in used for i in u) == list(range(N)),
                          "used": sum(len(u) for u in used),
                          "digests": digests, **extra}), flush=True)
    return flag[0]


def ckpt_path():
    return os.path.join(os.environ["CKPT_DIR"], "latest.pt")


def resume(model, opt):
    """The epoch to start from: the newest checkpoint on any node, sent by its holder."""
    state, mine = None, -1
    if int(os.environ["LOCAL_RANK"]) == 0 and os.path.exists(ckpt_path()):
        state = torch.load(ckpt_path())
        mine = state["epoch"]
    epochs = [None] * dist.get_world_size()
    dist.all_gather_object(epochs, mine)
    best = max(epochs)
    if best < 0:
        return 0
    box = [state]
    dist.broadcast_object_list(box, src=epochs.index(best))
    model.module.load_state_dict(box[0]["model"])
    opt.load_state_dict(box[0]["optimizer"])
    return best + 1


def save(model, opt, epoch):
    if int(os.environ["LOCAL_RANK"]) == 0:
        os.makedirs(os.environ["CKPT_DIR"], exist_ok=True)
        tmp = f"{ckpt_path()}.{os.getpid()}.tmp"
        torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                    "epoch": epoch}, tmp)
        os.replace(tmp, ckpt_path())


def restart_mode(step_s, stop_file):
    dist.init_process_group("cpu")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = data()
    epoch = resume(model, opt)
    sampler = DistributedSampler(range(N), shuffle=True, seed=1)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    while True:
        idx = run_epoch(model, opt, sampler, epoch, x, y, step_s)
        stop = report(model, opt, epoch, idx, stop_file, {"restart": restart})
        save(model, opt, epoch)
        dist.barrier()
        epoch += 1
        if stop:
            break
    print("done", flush=True)
    dist.destroy_process_group()


def train_in_place(state, box, opt, step_s, stop_file, d):
    """The in-place modes' loop under pyddp.elastic.run: box["model"] and box["sampler"]
    (re-made by the reset callback), d: pyddp or torch.distributed. Prints ``done``."""
    from pyddp import elastic
    x, y = data()
    joined = elastic.joined()
    pid = os.getpid()

    @elastic.run
    def train(state):
        while True:
            idx = run_epoch(box["model"], opt, box["sampler"], state.epoch, x, y, step_s)
            pids = [None] * d.get_world_size()
            d.all_gather_object(pids, pid)
            stop = report(box["model"], opt, state.epoch, idx, stop_file, {"pids": pids},
                          dist=d)
            state.epoch += 1
            state.commit()
            if stop:
                return state.epoch

    last = train(state)
    print(f"done pid={pid} joined={int(joined)} epoch={last}", flush=True)
    d.destroy_process_group()


def inplace_mode(step_s, stop_file):
    """pyddp.elastic: survivors go on in the same processes, joiners are admitted."""
    from pyddp import elastic
    dist.init_process_group("cpu")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = elastic.TorchState(model=model, optimizer=opt, epoch=0)
    box = {"model": model}

    def remake_sampler():
        box["sampler"] = DistributedSampler(range(N), shuffle=True, seed=1)

    remake_sampler()
    state.register_reset_callbacks([remake_sampler])
    train_in_place(state, box, opt, step_s, stop_file, dist)


def torchddp_mode(step_s, stop_file):
    """In place with torch's own DDP and sampler over backend "pyddp"."""
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    from torch.utils.data.distributed import DistributedSampler as TorchSampler
    from pyddp import elastic
    tdist.init_process_group("pyddp")
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    state = elastic.TorchState(model=net, optimizer=opt, epoch=0)
    box = {}

    def remake():
        box["model"] = TorchDDP(net)          # the wrapper holds the old group
        box["sampler"] = TorchSampler(range(N), shuffle=True, seed=1)

    remake()
    state.register_reset_callbacks([remake])
    train_in_place(state, box, opt, step_s, stop_file, tdist)


if __name__ == "__main__":
    mode, step, stop_path = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    assert mode in ("restart", "inplace", "torchddp"), mode
    {"restart": restart_mode, "inplace": inplace_mode,
     "torchddp": torchddp_mode}[mode](step, stop_path)
