"""Scenarios of the NCCL backend run against the test-double libraries (fake_nccl.c,
fake_cudart.c), one per process because a loaded NCCL stays loaded.

Usage: python scenarios.py NAME. The fakes are named by PYDDP_NCCL_LIBRARY and
PYDDP_CUDART_LIBRARY; each scenario prints one JSON line of observations (prefixed
"RESULT ") that tests/test_nccl_nogpu.py checks. "Device" arrays are NumPy arrays seen
through ``__cuda_array_interface__`` (the fake runtime treats every pointer as device
memory), so the results can be compared with NumPy.
"""
import json
import os
import sys
import time
from datetime import timedelta

import numpy as np

import pyddp
from pyddp import _C, _nccl_backend as nb
from pyddp._group import default_pg

CALLER_STREAM = 0x5150


class FakeDevArray:
    """A NumPy array presented as CUDA memory, produced on CALLER_STREAM."""

    def __init__(self, a, stream=CALLER_STREAM):
        self.a = a
        self.stream = stream

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.a.shape, "typestr": self.a.dtype.str, "version": 3,
                "data": (self.a.ctypes.data, False), "strides": None, "stream": self.stream}


def init(timeout_s=20.0, world_size=1, rank=0):
    store = pyddp.TCPStore("127.0.0.1", 0, is_master=True)
    pyddp.init_process_group("nccl", store=store, rank=rank, world_size=world_size,
                             timeout=timedelta(seconds=timeout_s))
    return store


def error(fn):
    """(exception class name, message) of fn(), or None if it did not raise."""
    try:
        fn()
    except Exception as e:   # noqa: BLE001 - the test inspects whatever was raised
        return [type(e).__name__, str(e)]
    return None


def log_lines():
    with open(os.environ["FAKE_LOG"]) as f:
        return f.read().splitlines()


def collectives():
    """Every collective on device and host arrays, against the one-rank reference."""
    init()
    out = {}
    rng = np.random.default_rng(0)
    for dt in ("float16", "float32", "float64", "int8", "uint8", "int32", "int64"):
        x = (rng.standard_normal(7) * 10).astype(dt)
        ref = x.copy()   # one rank: every reduction is the identity
        for op in (pyddp.ReduceOp.SUM, pyddp.ReduceOp.AVG, pyddp.ReduceOp.MAX):
            pyddp.all_reduce(FakeDevArray(x), op=op)
        out[f"all_reduce_{dt}"] = bool(np.array_equal(x, ref))
    b = np.array([True, False, True])
    pyddp.all_reduce(FakeDevArray(b))
    out["all_reduce_bool"] = b.tolist()
    x = np.arange(6, dtype=np.float32)
    pyddp.broadcast(FakeDevArray(x), src=0)
    pyddp.reduce(FakeDevArray(x), dst=0)
    g = np.zeros(6, dtype=np.float32)
    pyddp.all_gather_into_tensor(FakeDevArray(g), FakeDevArray(x))
    out["all_gather"] = g.tolist()
    rs = np.zeros(6, dtype=np.float32)
    pyddp.reduce_scatter_tensor(FakeDevArray(rs), FakeDevArray(x * 2))
    out["reduce_scatter"] = rs.tolist()
    ga = [np.zeros(6, dtype=np.float32)]
    pyddp.gather(x + 1, ga, dst=0)              # host arrays: staged through the "GPU"
    out["gather_host"] = ga[0].tolist()
    sc = np.zeros(6, dtype=np.float32)
    pyddp.scatter(sc, [x + 2], src=0)
    out["scatter_host"] = sc.tolist()
    h = np.arange(5, dtype=np.int64)
    pyddp.all_reduce(h, op=pyddp.ReduceOp.MAX)
    out["all_reduce_host"] = h.tolist()
    objs = [None]
    pyddp.all_gather_object(objs, {"rank": 0, "v": [1, 2]})
    out["all_gather_object"] = objs
    w = pyddp.all_reduce(FakeDevArray(x), async_op=True)
    out["async"] = [w.wait(), w.is_completed(), w.exception() is None]
    pyddp.barrier()
    out["bool_avg"] = error(lambda: pyddp.all_reduce(FakeDevArray(b), op=pyddp.ReduceOp.AVG))
    out["mixed"] = error(lambda: default_pg().submit(_C.COLL_ALLGATHER, FakeDevArray(x),
                                                     np.zeros(6, np.float32)))
    out["device"] = default_pg().device
    pyddp.destroy_process_group()
    out["log"] = log_lines()
    return out


def wait_after_destroy():
    """A work that completed before a clean destroy still reports success."""
    init()
    x = np.ones(4, dtype=np.float32)
    w = pyddp.all_reduce(FakeDevArray(x), async_op=True)
    pyddp.destroy_process_group()
    return {"wait": error(w.wait), "after": error(lambda: pyddp.all_reduce(FakeDevArray(x)))}


def interrupt():
    """Blocks in wait() on a collective that never completes, until SIGINT arrives."""
    init(timeout_s=120.0)
    x = np.ones(4, dtype=np.float32)
    print("READY", flush=True)
    t0 = time.monotonic()
    try:
        pyddp.all_reduce(FakeDevArray(x))
        got = None
    except KeyboardInterrupt:
        got = "KeyboardInterrupt"
    return {"got": got, "seconds": time.monotonic() - t0, "log": log_lines(),
            "after": error(lambda: pyddp.all_reduce(FakeDevArray(x)))}


def wrong_device():
    init()
    x = np.zeros(4, dtype=np.float32)
    os.environ["FAKE_PTR_DEVICE"] = "1"
    return {"error": error(lambda: pyddp.all_reduce(FakeDevArray(x)))}


def async_error():
    init()
    x = np.ones(4, dtype=np.float32)
    pyddp.all_reduce(FakeDevArray(x))
    second = error(lambda: pyddp.all_reduce(FakeDevArray(x)))
    t0 = time.monotonic()
    third = error(lambda: pyddp.all_reduce(FakeDevArray(x)))
    return {"second": second, "third": third, "third_s": time.monotonic() - t0,
            "log": log_lines()}


def hang():
    init(timeout_s=1.0)
    x = np.ones(4, dtype=np.float32)
    t0 = time.monotonic()
    err = error(lambda: pyddp.all_reduce(FakeDevArray(x)))
    return {"error": err, "seconds": time.monotonic() - t0, "log": log_lines(),
            "after": error(lambda: pyddp.broadcast(FakeDevArray(x), 0))}


def init_hang():
    t0 = time.monotonic()
    err = error(lambda: init(timeout_s=1.0))
    return {"error": err, "seconds": time.monotonic() - t0, "log": log_lines()}


def uid_fail():
    return {"error": error(init)}


def _cpu_pair(store, prefix):
    """Two ranks' _C.ProcessGroup in this process (the rendezvous needs both at once)."""
    import threading
    out = [None, None]
    clients = [store, pyddp.TCPStore("127.0.0.1", store.port)]   # one request in flight each

    def make(r):
        out[r] = _C.ProcessGroup(clients[r]._client, r, 2, prefix, "127.0.0.1", "", 0, 0,
                                 5000, pyddp.__version__, "h")
    ts = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def versions():
    """Rank 0 publishes its NCCL and pyddp versions with the unique id; a rank 1 with
    another NCCL / pyddp is refused when it attaches NCCL to its group."""
    nb.require()
    store = pyddp.TCPStore("127.0.0.1", 0, is_master=True)
    r0, r1 = _cpu_pair(store, "/t/a")
    r0.attach_nccl(store._client, "/t/a/nccl", 0, 5000, pyddp.__version__)
    os.environ["FAKE_NCCL_VERSION"] = "22105"
    nccl = error(lambda: r1.attach_nccl(store._client, "/t/a/nccl", 0, 5000, pyddp.__version__))
    os.environ["FAKE_NCCL_VERSION"] = "22005"
    pyddp_v = error(lambda: r1.attach_nccl(store._client, "/t/a/nccl", 0, 5000, "0.0.1"))
    r0.destroy()
    r1.destroy()
    return {"nccl": nccl, "pyddp": pyddp_v}


def devices():
    """cuda_device_for_local_rank for this process's FAKE_CUDA_DEVICES and LOCAL_RANK."""
    try:
        return {"device": nb.cuda_device_for_local_rank()}
    except _C.DistValueError as e:
        return {"error": str(e)}


def no_device():
    """FAKE_CUDA_DEVICES=0: loads, but backend="nccl" fails before any rendezvous."""
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    return {"usable": nb.usable(), "why": nb.why_unusable(),
            "init": error(lambda: pyddp.init_process_group("nccl")),
            "auto": error(pyddp._group._auto_backend_name)
            or pyddp._group._auto_backend_name()}


def fallback_warning():
    """PYDDP_NCCL_LIBRARY is broken but a later candidate works: warn, then use it."""
    import warnings
    good = os.environ["GOOD_NCCL"]
    nb.nccl_candidates = lambda: [(os.environ["PYDDP_NCCL_LIBRARY"], "PYDDP_NCCL_LIBRARY"),
                                  (good, "test")]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        info = nb.load()
    return {"path": info["nccl_path"], "warnings": [str(x.message) for x in w]}


def load_candidates():
    """_C.nccl_load on the candidate lists in the CANDIDATES environment variable."""
    c = json.loads(os.environ["CANDIDATES"])
    try:
        return {"info": _C.nccl_load(c["nccl"], c["cudart"], c.get("prefer_loaded", True))}
    except Exception as e:   # noqa: BLE001
        return {"error": [type(e).__name__, str(e)]}


if __name__ == "__main__":
    print("RESULT " + json.dumps(globals()[sys.argv[1]]()), flush=True)
