"""Worker: one failure or lifecycle scenario per launch (tests/test_errors.py).

Each scenario prints lines starting with "RESULT " that the test parses; anything else is
diagnostics. Exceptions expected by the scenario are caught and reported with their class
and message and the time it took, so the test can check both the text and the bound.
"""
import argparse
import os
import sys
import threading
import time

import numpy as np

import pyddp as dist


def report(**kw):
    print("RESULT " + " ".join(f"{k}={v!r}" for k, v in kw.items()), flush=True)


def expect_error(fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects the class
        return type(e), str(e), time.monotonic() - t0
    return None, "", time.monotonic() - t0


def classes(e):
    return ",".join(c.__name__ for c in e.__mro__)


def sc_peer_dies(rank, ws):
    dist.init_process_group("cpu")
    x = np.ones(1 << 20, dtype=np.float32)
    dist.all_reduce(x)
    if rank == ws - 1:
        os._exit(3)          # dies without a word, mid-job
    cls, msg, dt = expect_error(lambda: [dist.all_reduce(x) for _ in range(50)])
    report(rank=rank, cls=classes(cls) if cls else None, msg=msg, seconds=round(dt, 2))
    # the group is broken now: later calls fail at once, with the original cause
    cls2, msg2, dt2 = expect_error(lambda: dist.all_reduce(x))
    report(rank=rank, after=classes(cls2) if cls2 else None, seconds_after=round(dt2, 2))


def sc_mismatch(rank, ws, kind):
    dist.init_process_group("cpu")
    x = np.ones(8, dtype=np.float32)
    if kind == "collective":
        f = (lambda: dist.all_reduce(x)) if rank == 0 else (lambda: dist.broadcast(x, 0))
    elif kind == "count":
        y = np.ones(8 + rank, dtype=np.float32)
        f = lambda: dist.all_reduce(y)  # noqa: E731
    elif kind == "dtype":
        y = np.ones(8, dtype=np.float32 if rank == 0 else np.float64)
        f = lambda: dist.all_reduce(y)  # noqa: E731
    elif kind == "op":
        f = lambda: dist.all_reduce(x, op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)  # noqa: E731
    else:  # root
        f = lambda: dist.broadcast(x, src=rank % 2)  # noqa: E731
    cls, msg, dt = expect_error(f)
    report(rank=rank, cls=classes(cls) if cls else None, msg=msg, seconds=round(dt, 2))


def sc_bad_arrays(rank, ws):
    dist.init_process_group("cpu")
    ro = np.ones(4, dtype=np.float32)
    ro.flags.writeable = False
    cases = {
        "object": lambda: dist.all_reduce(np.array([1, "a"], dtype=object)),
        "readonly": lambda: dist.all_reduce(ro),
        "list": lambda: dist.all_reduce([1.0, 2.0]),
        "int16": lambda: dist.all_reduce(np.ones(3, dtype=np.int16)),
        "complex": lambda: dist.all_reduce(np.ones(3, dtype=np.complex64)),
        "bool_avg": lambda: dist.all_reduce(np.ones(3, dtype=bool), op=dist.ReduceOp.AVG),
        "bad_root": lambda: dist.broadcast(np.ones(3), src=ws),
        "bad_op": lambda: dist.all_reduce(np.ones(3), op="median"),
        "gather_size": lambda: dist.all_gather_into_tensor(np.empty(3), np.ones(2)),
        "gather_list": lambda: dist.all_gather([np.empty(2)], np.ones(2)),
        "self_send": lambda: dist.send(np.ones(2), rank),
    }
    for name, f in cases.items():
        cls, msg, _ = expect_error(f)
        report(case=name, cls=classes(cls) if cls else None, msg=msg)
    x = np.full(5, float(rank))
    dist.all_reduce(x)     # the group is still usable
    report(after_ok=bool(np.all(x == ws * (ws - 1) / 2)))


def sc_version(rank, ws):
    import pyddp._world as g
    if rank == 1:
        g.__version__ = "0.0.1-other"
    cls, msg, dt = expect_error(lambda: dist.init_process_group("cpu"))
    report(rank=rank, cls=classes(cls) if cls else None, msg=msg)


def sc_timeout(rank, ws):
    from datetime import timedelta
    dist.init_process_group("cpu", timeout=timedelta(seconds=2))
    if rank == 0:
        cls, msg, dt = expect_error(lambda: dist.all_reduce(np.ones(4)))
        report(rank=rank, cls=classes(cls) if cls else None, msg=msg, seconds=round(dt, 2))
    else:
        time.sleep(6)    # never joins the collective; exits after rank 0 gave up
        report(rank=rank, cls=None, msg="", seconds=0)


def sc_gil(rank, ws):
    dist.init_process_group("cpu")
    count = [0]
    stop = [False]

    def spin():
        while not stop[0]:
            count[0] += 1

    if rank == 1:
        time.sleep(1.0)
    t = threading.Thread(target=spin)
    t.start()
    t0 = time.monotonic()
    dist.barrier()
    waited = time.monotonic() - t0
    stop[0] = True
    t.join()
    report(rank=rank, waited=round(waited, 2), count=count[0])


def sc_reinit(rank, ws):
    for i in range(3):
        dist.init_process_group("gloo")
        x = np.full(3, float(rank + i))
        dist.all_reduce(x)
        assert np.all(x == sum(r + i for r in range(ws))), x
        assert dist.is_initialized() and dist.get_backend() == "gloo"   # as asked
        dist.destroy_process_group()
        assert not dist.is_initialized()
    report(rank=rank, reinit_ok=True)


def sc_init_method(rank, ws, method):
    dist.init_process_group("cpu", init_method=method, rank=rank, world_size=ws)
    x = np.full(3, float(rank))
    dist.all_reduce(x)
    report(rank=rank, ok=bool(np.all(x == ws * (ws - 1) / 2)))
    dist.destroy_process_group()


def sc_sigint(rank, ws):
    dist.init_process_group("cpu")
    if rank == 0:
        print("READY", flush=True)
        t0 = time.monotonic()
        try:
            dist.all_reduce(np.ones(4))    # rank 1 never joins; Ctrl-C arrives
        except KeyboardInterrupt:
            report(rank=rank, cls="KeyboardInterrupt", seconds=round(time.monotonic() - t0, 2))
        # the group is aborted: later calls fail at once
        cls, msg, dt = expect_error(lambda: dist.all_reduce(np.ones(4)))
        report(rank=rank, after=classes(cls) if cls else None, msg=msg)
    else:
        time.sleep(4)
        # rank 0's contribution to the interrupted call may already be in flight, so
        # the first call can still complete; the next ones must fail at once
        cls, msg, dt = expect_error(lambda: [dist.all_reduce(np.ones(4)) for _ in range(3)])
        report(rank=rank, cls=classes(cls) if cls else None, msg=msg, seconds=round(dt, 2))


def sc_handles(rank, ws):
    """Work handles: several threads waiting on one handle, is_completed() only after
    the copy-out, no references kept by a rejected call, destroy with work pending."""
    import sys as _sys
    dist.init_process_group("cpu")
    for _ in range(50):
        x = np.ones(1000)
        w = dist.all_reduce(x, async_op=True)
        ts = [threading.Thread(target=w.wait) for _ in range(3)]
        for t in ts:
            t.start()
        w.wait()
        for t in ts:
            t.join()
        assert np.all(x == ws)
    lst = [np.zeros(4) for _ in range(ws)]
    w = dist.all_gather(lst, np.full(4, float(rank)), async_op=True)
    while not w.is_completed():
        time.sleep(0.001)
    gathered_ok = all(np.all(lst[r] == r) for r in range(ws))
    a, b = np.ones(3), np.ones(5)
    before = (_sys.getrefcount(a), _sys.getrefcount(b))
    for _ in range(20):
        expect_error(lambda: dist.all_gather_into_tensor(b, a))
    leak_free = (_sys.getrefcount(a), _sys.getrefcount(b)) == before
    dist.barrier()
    t0 = time.monotonic()
    if rank == 0:
        pending = dist.irecv(np.empty(4), src=1)   # rank 1 never sends
        dist.destroy_process_group()
        destroy_s = time.monotonic() - t0
        cls, msg, _ = expect_error(pending.wait)
        report(rank=rank, gathered=gathered_ok, leak_free=leak_free,
               destroy_seconds=round(destroy_s, 2), pending=classes(cls) if cls else None)
    else:
        time.sleep(3)
        dist.destroy_process_group()
        report(rank=rank, gathered=gathered_ok, leak_free=leak_free)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario")
    ap.add_argument("--kind", default="")
    ap.add_argument("--init-method", default="")
    a = ap.parse_args()
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if a.scenario == "peer_dies":
        sc_peer_dies(rank, ws)
    elif a.scenario == "mismatch":
        sc_mismatch(rank, ws, a.kind)
    elif a.scenario == "bad_arrays":
        sc_bad_arrays(rank, ws)
    elif a.scenario == "version":
        sc_version(rank, ws)
    elif a.scenario == "timeout":
        sc_timeout(rank, ws)
    elif a.scenario == "gil":
        sc_gil(rank, ws)
    elif a.scenario == "reinit":
        sc_reinit(rank, ws)
    elif a.scenario == "handles":
        sc_handles(rank, ws)
    elif a.scenario == "sigint":
        sc_sigint(rank, ws)
    elif a.scenario == "init_method":
        sc_init_method(rank, ws, a.init_method)
    else:
        sys.exit(f"unknown scenario {a.scenario}")


if __name__ == "__main__":
    main()
