"""Worker for tests/test_torch_backend.py's peer-death-in-backward case: torch's own
DistributedDataParallel over the "pyddp" backend (plain ranks: rank 0 hosts the store),
small buckets so that several all-reduces are in flight during backward. After two
good steps, the last rank SIGKILLs itself from a gradient hook in the middle of the
third backward (some of its buckets already launched, others not). Every survivor
prints one line

    DEATH rank=<r> torch_class=<bool> pyddp_class=<bool> type=<name> msg=<repr> after=<a>

(torch_class: a torch.distributed DistNetworkError or DistBackendError)

with what ``loss.backward()`` raised and, in <a>, whether a backward of the bare module
runs after it (``ok``: the wrapper's reducer finished its end of backward, so its hooks
are quiet, as those of a wrapper replaced after the error must be), then exits 0; rank
0, whose process hosts the store that the survivors' straggler reports read, only once
every survivor has printed. Usage: torch_backward_death.py
"""
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn


def main():
    dist.init_process_group("pyddp")
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                        nn.Linear(256, 4))
    model = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.05)
    x = torch.randn(8, 16)
    for _ in range(2):
        model(x).sum().backward()
    if rank == ws - 1:
        # the first layer's gradient comes last: the later layers' buckets are launched
        net[0].weight.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
    loss = model(x).sum()
    try:
        loss.backward()
        line = f"DEATH rank={rank} no error"
    except Exception as e:  # noqa: BLE001 - what reached the user is what is checked
        import pyddp
        try:
            net.zero_grad()
            net(x).sum().backward()
            after = "ok"
        except Exception as a:  # noqa: BLE001 - reported
            after = repr(str(a)[:200])
        torch_class = isinstance(e, (dist.DistNetworkError, dist.DistBackendError))
        line = (f"DEATH rank={rank} torch_class={torch_class} "
                f"pyddp_class={isinstance(e, pyddp.DistError)} type={type(e).__name__} "
                f"msg={str(e)!r} after={after}")
    os.write(1, (line.replace("\n", " ") + "\n").encode())
    sys.stdout.flush()
    store = dist.distributed_c10d._get_default_store()
    store.add("death_reported", 1)
    deadline = time.monotonic() + 30
    while rank == 0 and store.add("death_reported", 0) < ws - 1 and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(0)


if __name__ == "__main__":
    main()
