"""Worker for tests/test_straggler.py: five all-reduces on every rank, then the last
rank (or the rank argv[3] names) fails to join the sixth: with argv[1] == "late" it sits
in load_batch() (alive, its Python code elsewhere); with "stopped" it stops itself with
SIGSTOP (alive to TCP but unable to answer). argv[2], if given, is the all-reduce's size
in MiB (default 4). The other ranks' collective times out (PYDDP_TIMEOUT is short) and
must explain who had not arrived. Each waiting rank prints "ERROR <class>" and its
message, then "END", and exits at once (rank 0 first kills the straggler): under plain
environment variables rank 0's process hosts the store, so the others' reports must not
depend on it staying up."""
import os
import signal
import sys
import time

import numpy as np

import pyddp as dist


def load_batch():
    time.sleep(60)      # the straggler: still running Python, somewhere else


def main():
    dist.init_process_group("cpu")
    ws, me = dist.get_world_size(), dist.get_rank()
    pids = [None] * ws
    dist.all_gather_object(pids, os.getpid())
    if sys.argv[1] == "ddp":
        return ddp_case(ws, me, pids)
    mib = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    late = int(sys.argv[3]) if len(sys.argv) > 3 else ws - 1
    x = np.ones(mib << 20 >> 3)     # float64
    for _ in range(5):
        dist.all_reduce(x)
    if me == late:
        print("STRAGGLING", flush=True)
        if sys.argv[1] == "stopped":
            os.kill(os.getpid(), signal.SIGSTOP)
        load_batch()
        return
    try:
        dist.all_reduce(x)
        print("ERROR none", flush=True)
    except dist.DistError as e:
        print(f"ERROR {type(e).__name__}\n{e}\nEND", flush=True)
    if me == 0:
        time.sleep(0.5)
        os.kill(pids[late], signal.SIGKILL)    # the straggler would never exit by itself
    os._exit(0)


def ddp_case(ws, me, pids):
    """pyddp's DDP on a torch model: the last rank skips the third backward."""
    import torch
    torch.manual_seed(0)
    ddp = dist.DistributedDataParallel(torch.nn.Linear(256, 256))
    for step in range(3):
        if step == 2 and me == ws - 1:
            print("STRAGGLING", flush=True)
            load_batch()
            return
        try:
            ddp(torch.randn(8, 256)).sum().backward()
        except dist.DistError as e:
            print(f"ERROR {type(e).__name__}\n{e}\nEND", flush=True)
            break
    if me == 0:
        time.sleep(0.5)
        os.kill(pids[-1], signal.SIGKILL)
    os._exit(0)


if __name__ == "__main__":
    main()
