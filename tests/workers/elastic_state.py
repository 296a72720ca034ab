"""An in-place elastic job whose state is more than a model and an optimizer, for
tests/test_elastic_inplace.py: one process per rank (env:// variables, or
PYDDP_ELASTIC_JOIN), run as

    elastic_state.py STEP_S STOP_FILE

The model has a counting parameter ``count`` of N entries: the loss of a batch is
``world * count[batch].sum()`` and SGD's step of 1 subtracts exactly 1 from the entry of
every sample trained (DDP averages the gradients over the ranks), so ``count`` says how
often each sample was applied, and it rolls back with the model. Beside it: a LambdaLR
scheduler whose factor is a lambda (the usual warm-up form), momentum in the optimizer,
a step counter, an ElasticSampler whose position is in the state, and a draw from
torch's generator per step (the dropout stream). Commits every 2 steps.

At the end of each epoch rank 0 prints a JSON record: the epoch, the world size, the
fewest and most times a sample was applied in the epoch, how many were applied twice
(a re-shard's padding), and per rank the
learning rate, the scheduler's and the state's step counts, a digest of the model's,
the optimizer's and the scheduler's state, the last random draw and the process id.
"""
import hashlib
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
import pyddp as dist  # noqa: E402
from pyddp import DistributedDataParallel as DDP, elastic  # noqa: E402

N, BATCH = 96, 4


class Counting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.count = torch.nn.Parameter(torch.zeros(N, dtype=torch.float64))

    def forward(self, idx):
        return self.count[idx].sum()


def digest(model, opt, sched):
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().numpy().tobytes())
    for _, st in sorted(opt.state_dict()["state"].items()):
        for _, v in sorted(st.items()):
            if torch.is_tensor(v):
                h.update(v.numpy().tobytes())
    h.update(repr(sorted((k, v) for k, v in sched.state_dict().items()
                         if k != "lr_lambdas")).encode())
    return h.hexdigest()[:16]


def main(step_s, stop_file):
    dist.init_process_group("cpu")
    model = DDP(Counting())
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)   # a lambda on purpose
    sampler = elastic.ElasticSampler(range(N), shuffle=True, seed=3)
    loader = torch.utils.data.DataLoader(range(N), batch_size=BATCH, sampler=sampler)
    state = elastic.TorchState(model=model, optimizer=opt, scheduler=sched, sampler=sampler,
                               epoch=0, step=0, before=[0.0] * N)
    torch.manual_seed(100 + dist.get_rank())        # a stream of its own per rank
    pid, draw = os.getpid(), [0.0]

    @elastic.run
    def train(state):
        while True:
            sampler.set_epoch(state.epoch)
            for i, idx in enumerate(loader):
                opt.zero_grad()
                (dist.get_world_size() * model(idx)).backward()
                opt.step()
                sched.step()
                draw[0] = torch.rand(1).item()
                sampler.record_batch(i, BATCH)
                state.step += 1
                time.sleep(step_s)
                if state.step % 2 == 0:
                    state.commit()
            c = model.module.count.detach()
            applied = torch.tensor(state.before, dtype=torch.float64) - c   # this epoch
            state.before = c.tolist()
            mine = {"lr": opt.param_groups[0]["lr"], "sched": sched.last_epoch,
                    "step": state.step, "digest": digest(model.module, opt, sched),
                    "draw": draw[0], "pid": pid}
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
            stop = [os.path.exists(stop_file)]
            dist.broadcast_object_list(stop, src=0)
            if dist.get_rank() == 0:
                print(json.dumps({"epoch": state.epoch, "world": dist.get_world_size(),
                                  "min": float(applied.min()), "max": float(applied.max()),
                                  "twice": int((applied > 1).sum()), "ranks": ranks}),
                      flush=True)
            state.epoch += 1
            state.commit()
            if stop[0]:
                return state.epoch

    train(state)
    print(f"done pid={pid}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2])
