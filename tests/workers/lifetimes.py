"""Worker for tests/test_lifetimes.py: the process group's lifetime cases, each timed by
the worker itself. Rank 1 (where there is one) never joins the collective under test,
so rank 0 is left waiting; a timer then sends a signal or closes a store, and rank 0
reports how it came out as one JSON line ("RESULT {...}"). Nothing may crash or hang.

Scenarios (argv[1]):
  drop_ctrl_c      an async Work dropped unfinished: its dealloc waits; Ctrl-C ends that
                   wait, aborts the group, and reaches the main thread as KeyboardInterrupt.
  drain_ctrl_c     Ctrl-C during the DDP reducer's drain of in-flight bucket all-reduces.
  handler_destroy  a signal handler that destroys the group, then raises, while torch
                   DDP's backward waits for the gradient all-reduce.
  store_close      TCPStore.close() from another thread during the rendezvous (one rank
                   of two: the other never comes).
"""
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import numpy as np

import pyddp

SCEN = sys.argv[1]
RANK = int(os.environ.get("RANK", "0"))


def report(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def later(s, fn):
    threading.Timer(s, fn).start()


def sigint_later(s):
    later(s, lambda: os.kill(os.getpid(), signal.SIGINT))


def idle_peer():
    """Rank 1: stay in the group without joining anything, then leave."""
    time.sleep(6)
    os._exit(0)


def drop_ctrl_c():
    pyddp.init_process_group("cpu", timeout=timedelta(seconds=60))
    if RANK == 1:
        idle_peer()
    w = pyddp.all_reduce(np.ones(1000), async_op=True)
    sigint_later(1.0)
    t0 = time.monotonic()
    try:
        del w                    # dealloc waits for the collective that never completes
        for _ in range(100):     # the re-delivered interrupt is raised here
            time.sleep(0.05)
        report(cls=None, seconds=round(time.monotonic() - t0, 2))
        return
    except KeyboardInterrupt:
        dt = time.monotonic() - t0
    try:
        pyddp.all_reduce(np.ones(4))
        after = "worked"
    except pyddp.DistError as e:
        after = str(e)
    report(cls="KeyboardInterrupt", seconds=round(dt, 2), after=after)


def drain_ctrl_c():
    pyddp.init_process_group("cpu", timeout=timedelta(seconds=60))
    if RANK == 1:
        idle_peer()
    from pyddp.ddp._reducer import CPath
    from pyddp._group import default_pg
    params = [np.zeros(4096, dtype=np.float32) for _ in range(4)]
    engine = CPath(params, default_pg(), 2, 4096 * 4, 60000)
    engine.begin()
    for i in reversed(range(len(params))):
        engine.ready(i, np.ones(4096, dtype=np.float32), False)   # launches every bucket
    sigint_later(1.0)
    t0 = time.monotonic()
    try:
        engine.drain()
        report(cls=None, seconds=round(time.monotonic() - t0, 2))
    except KeyboardInterrupt:
        report(cls="KeyboardInterrupt", seconds=round(time.monotonic() - t0, 2))


def handler_destroy():
    import torch
    pyddp.init_process_group("cpu", timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 8))
    ddp = pyddp.DistributedDataParallel(model, bucket_cap_mb=0.01)
    if RANK == 1:
        idle_peer()
    def handler(*a):
        pyddp.destroy_process_group()      # frees what the waiting reducer was using
        raise RuntimeError("handler gave up")   # and the wait must abort through it

    signal.signal(signal.SIGUSR1, handler)
    later(1.0, lambda: os.kill(os.getpid(), signal.SIGUSR1))
    t0 = time.monotonic()
    try:
        ddp(torch.randn(16, 64)).sum().backward()
        report(cls=None, seconds=round(time.monotonic() - t0, 2))
    except Exception as e:  # noqa: BLE001 - the class is what is reported
        report(cls=type(e).__name__, msg=str(e)[:300], seconds=round(time.monotonic() - t0, 2),
               initialized=pyddp.is_initialized())


def store_close():
    store = pyddp.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    later(1.0, store.close)
    t0 = time.monotonic()
    try:
        pyddp.init_process_group("cpu", store=store, rank=0, world_size=2,
                                 timeout=timedelta(seconds=60))
        report(cls=None, seconds=round(time.monotonic() - t0, 2))
    except Exception as e:  # noqa: BLE001 - the class is what is reported
        report(cls=type(e).__name__, msg=str(e)[:300], seconds=round(time.monotonic() - t0, 2))


{"drop_ctrl_c": drop_ctrl_c, "drain_ctrl_c": drain_ctrl_c, "handler_destroy": handler_destroy,
 "store_close": store_close}[SCEN]()
