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
    """A NumPy array presented as CUDA memory, produced on CALLER_STREAM. shape, dtype,
    reshape and copy are what the public API's array glue (pyddp/_arrays.py) asks of an
    array it does not know."""

    def __init__(self, a, stream=CALLER_STREAM):
        self.a = a
        self.stream = stream

    shape = property(lambda self: self.a.shape)
    dtype = property(lambda self: self.a.dtype)

    def reshape(self, *shape):
        return FakeDevArray(self.a.reshape(*shape), self.stream)   # a view: same memory

    def copy(self):
        return FakeDevArray(self.a.copy(), self.stream)

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
    """Blocks in wait() on a collective that never completes, until SIGINT arrives: an
    all_reduce, or with SCEN_OP=all_to_all rank 0's half of a two-rank all_to_all
    (grouped sends and receives, which can also hang in the launch)."""
    x = np.ones(4, dtype=np.float32)
    if os.environ.get("SCEN_OP") == "all_to_all":
        pg0 = _device_pair(pyddp.TCPStore("127.0.0.1", 0, is_master=True), "/t/i")[0]

        def run():
            pg0.alltoall(*_half_a2a(), 120000).wait()
    else:
        init(timeout_s=120.0)

        def run():
            pyddp.all_reduce(FakeDevArray(x))
    print("READY", flush=True)
    t0 = time.monotonic()
    try:
        run()
        got = None
    except KeyboardInterrupt:
        got = "KeyboardInterrupt"
    after = (lambda: pg0.alltoall(*_half_a2a(), 1000).wait()) \
        if os.environ.get("SCEN_OP") == "all_to_all" else \
        (lambda: pyddp.all_reduce(FakeDevArray(x)))
    return {"got": got, "seconds": time.monotonic() - t0, "log": log_lines(),
            "after": error(after)}


def wrong_device():
    init()
    x = np.zeros(4, dtype=np.float32)
    os.environ["FAKE_PTR_DEVICE"] = "1"
    return {"error": error(lambda: pyddp.all_reduce(FakeDevArray(x))),
            "a2a": error(lambda: pyddp.all_to_all_single(FakeDevArray(x.copy()),
                                                         FakeDevArray(x))),
            "batch": error(lambda: pyddp.batch_isend_irecv(
                [pyddp.P2POp(pyddp.isend, FakeDevArray(x), 0)])),
            "log": log_lines()}


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


def _half_a2a():
    """Rank 0's arguments of a two-rank all_to_all (6 float32 in, 6 out: 3 kept, 3 to rank 1)
    whose rank 1 never comes."""
    return (FakeDevArray(np.ones(6, np.float32)), FakeDevArray(np.zeros(6, np.float32)),
            [3, 3], [0, 3], [3, 3], [0, 3])


def a2a_hang():
    """Rank 0 of a two-rank all_to_all alone: its completion never comes
    (FAKE_CUDA_HANG) or its grouped launch never finishes (FAKE_NCCL_LAUNCH_HANG);
    the timeout ends it."""
    pg0 = _device_pair(pyddp.TCPStore("127.0.0.1", 0, is_master=True), "/t/h")[0]
    t0 = time.monotonic()
    err = error(lambda: pg0.alltoall(*_half_a2a(), 1000).wait())
    return {"error": err, "seconds": time.monotonic() - t0, "log": log_lines()}


def grouped_public():
    """all_to_all_single and batch_isend_irecv through the public API at world size 1,
    on "device" arrays: results against NumPy, the calls made, and validation errors
    (which must leave nothing enqueued and the group usable)."""
    init()
    out = {}
    rng = np.random.default_rng(3)
    for dt in ("float16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool"):
        x = (rng.standard_normal((6, 3)) * 50).astype(dt)
        y = np.zeros_like(x)
        pyddp.all_to_all_single(FakeDevArray(y), FakeDevArray(x))
        out[f"single_{dt}"] = bool(np.array_equal(y, x))   # one rank: its block comes back
    x = np.arange(10, dtype=np.int32)
    y = np.full(10, -1, np.int32)
    w = pyddp.all_to_all_single(FakeDevArray(y), FakeDevArray(x), [10], [10], async_op=True)
    out["async"] = [w.wait(), y.tolist()]
    z = np.arange(8, dtype=np.float64)
    d = FakeDevArray(z)
    pyddp.all_to_all_single(d, d)                  # in place: the API stages the input
    out["in_place"] = z.tolist()
    e = np.zeros((0, 2), np.float32)
    pyddp.all_to_all_single(FakeDevArray(e), FakeDevArray(e.copy()))   # nothing moves
    n_groups = sum(x == "ncclGroupStart" for x in log_lines())
    out["own_split_mismatch"] = error(lambda: pyddp.all_to_all_single(
        FakeDevArray(np.zeros(2, np.float32)), FakeDevArray(np.zeros(3, np.float32))))
    out["overlap"] = error(lambda: pyddp.all_to_all_single(FakeDevArray(z), FakeDevArray(z)))
    b = np.ones(3, np.float32)
    out["recv_any"] = error(lambda: pyddp.irecv(FakeDevArray(b)))
    out["batch_self_send"] = error(lambda: pyddp.batch_isend_irecv(
        [pyddp.P2POp(pyddp.isend, FakeDevArray(b), 0)]))
    out["batch_self_recv"] = error(lambda: pyddp.batch_isend_irecv(
        [pyddp.P2POp(pyddp.irecv, FakeDevArray(b), 0)]))
    out["batch_peer_range"] = error(lambda: pyddp.batch_isend_irecv(
        [pyddp.P2POp(pyddp.isend, FakeDevArray(b), 1)]))
    out["enqueued_by_errors"] = sum(x == "ncclGroupStart" for x in log_lines()) - n_groups
    x = np.arange(4, dtype=np.int64)
    y = np.zeros(4, np.int64)
    pyddp.all_to_all_single(FakeDevArray(y), FakeDevArray(x))   # still usable
    out["after_errors"] = y.tolist()
    pyddp.destroy_process_group()
    out["log"] = log_lines()
    return out


def _device_pair(store, prefix):
    """Two ranks' process groups in this process, each with an NCCL communicator of the
    fake (same clique, so ncclSend/ncclRecv move data between them)."""
    nb.require()
    pgs = _cpu_pair(store, prefix)
    for pg in pgs:
        pg.attach_nccl(store._client, prefix + "/nccl", 0, 5000, pyddp.__version__)
    return pgs


def grouped_pair():
    """all_to_all (uneven splits, displacements with gaps) and batched send/recv (mixed
    dtypes, two sends to one peer, an empty op) between two ranks, against NumPy; the
    log of each launch; and the validation errors of both kinds."""
    store = pyddp.TCPStore("127.0.0.1", 0, is_master=True)
    pgs = _device_pair(store, "/t/g")
    out = {}
    S = [[2, 3], [4, 1]]                           # S[p][q]: elements rank p sends rank q
    ins, outs, args = [], [], []
    for p in range(2):
        sd = [0, S[p][0] + 1]                      # a one-element gap between the blocks
        ins.append((p * 100 + np.arange(sd[1] + S[p][1])).astype(np.float32))
        rc = [S[0][p], S[1][p]]
        rd = [1, 1 + rc[0] + 2]                    # gaps before and between the blocks
        outs.append(np.full(rd[1] + rc[1] + 1, -1, np.float32))
        args.append((S[p], sd, rc, rd))
    ref = [o.copy() for o in outs]
    for q in range(2):
        for p in range(2):
            sc, sd, _, _ = args[p]
            rd = args[q][3]
            ref[q][rd[p]:rd[p] + S[p][q]] = ins[p][sd[q]:sd[q] + S[p][q]]
    n0 = len(log_lines())
    ws = [pgs[p].alltoall(FakeDevArray(ins[p]), FakeDevArray(outs[p]), *args[p], 5000,
                          CALLER_STREAM) for p in range(2)]
    out["a2a_wait"] = [w.wait() for w in ws]
    out["a2a"] = [bool(np.array_equal(outs[p], ref[p])) for p in range(2)]
    out["a2a_log"] = log_lines()[n0:]

    rng = np.random.default_rng(5)
    a0 = rng.standard_normal(5).astype(np.float32)
    b0 = rng.integers(-100, 100, 3).astype(np.int8)
    c1 = rng.integers(-2**62, 2**62, 4).astype(np.int64)
    a1, b1, c0 = np.zeros_like(a0), np.zeros_like(b0), np.zeros_like(c1)
    empty = np.zeros(0, np.float32)
    ops0 = [(True, FakeDevArray(a0), 1), (True, FakeDevArray(empty), 1),
            (False, FakeDevArray(c0), 1), (True, FakeDevArray(b0), 1)]
    ops1 = [(False, FakeDevArray(a1), 0), (True, FakeDevArray(c1), 0),
            (False, FakeDevArray(empty.copy()), 0), (False, FakeDevArray(b1), 0)]
    n0 = len(log_lines())
    ws = [pgs[0].p2p_batch(ops0, 5000, CALLER_STREAM), pgs[1].p2p_batch(ops1, 5000)]
    out["batch_wait"] = [w.wait() for w in ws]
    out["batch"] = [bool(np.array_equal(a1, a0)), bool(np.array_equal(b1, b0)),
                    bool(np.array_equal(c0, c1))]
    out["batch_log"] = log_lines()[n0:]

    x = FakeDevArray(np.ones(4, np.float32))
    n_groups = sum(x == "ncclGroupStart" for x in log_lines())
    pg0 = pgs[0]
    out["errors"] = {
        "peer_range": error(lambda: pg0.p2p_batch([(True, x, 2)], 5000)),
        "peer_negative": error(lambda: pg0.p2p_batch([(False, x, -1)], 5000)),
        "self": error(lambda: pg0.p2p_batch([(True, x, 1), (False, x, 0)], 5000)),
        "own_block": error(lambda: pg0.alltoall(x, FakeDevArray(np.zeros(4, np.float32)),
                                                [1, 3], [0, 1], [2, 2], [0, 2], 5000)),
        "overlap": error(lambda: pg0.alltoall(x, FakeDevArray(x.a[1:]), [1, 1], [0, 1],
                                              [1, 1], [0, 1], 5000)),
    }
    out["enqueued_by_errors"] = sum(x == "ncclGroupStart" for x in log_lines()) - n_groups
    for pg in pgs:
        pg.destroy()
    return out


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
