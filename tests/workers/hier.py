"""Worker: the collectives the hierarchical algorithms serve (all_reduce,
reduce_scatter_tensor, all_gather_into_tensor), and broadcast next to them, checked
against the NumPy reference of reference.py, for a job whose ranks are spread over
several "hosts" (network namespaces; tests/test_hier.py). Sizes span the latency path
and the bandwidth path, counts that do not split evenly over ranks or hosts included.
Whatever PYDDP_ALGO says (flat, hier, auto), the results must be the same: exact for
integers and for the float inputs of reference.py, within rounding for float AVG.

With --expect-mismatch the job's ranks were started with different PYDDP_ALGO values:
the first bandwidth-path all_reduce must raise CollectiveMismatchError naming
PYDDP_ALGO on every rank. With --pg-options the choice is made per group instead
(new_group(pg_options={"algo": ...})): flat and hierarchical groups give the NumPy
results, a bad value raises DistValueError before any communication, and a group whose
members asked for different algorithms gets CollectiveMismatchError. With --victim R,
rank R kills itself (SIGKILL, from a timer thread) while it runs 4 MiB all-reduces (the
pipelined hierarchical path) and every other rank prints "RESULT error=<class> seconds=<s> msg=<message>".
Prints "PASS <checks>" (or "MISMATCH <message>").
"""
import argparse
import os
import signal
import sys
import threading
import time

import numpy as np

import pyddp as dist
from reference import Checker, check_all_reduce, data, reference

COUNTS = [1000, 40_003, 300_001]   # float32: the latency path, then the bandwidth path
DTYPES = ["float32", "float64", "float16", "int32", "int64", "uint8"]


def run(ck, rank, ws):
    case = 0
    for dtype in DTYPES:
        for op in ("SUM", "AVG", "MAX"):
            for n in COUNTS:
                case += 1
                check_all_reduce(dist, ck, rank, ws, case, n, dtype, op)
    for dtype in ("float32", "int32", "float16"):
        for n in (3, 20_001):
            case += 1
            full = [data(r, case, n * ws, dtype) for r in range(ws)]
            out = np.zeros(n, dtype)
            dist.reduce_scatter_tensor(out, full[rank].copy())
            want = reference(full, "SUM", dtype)[rank * n:(rank + 1) * n]
            ck.eq(out, want, f"reduce_scatter_tensor {dtype} n={n}")
            case += 1
            mine = data(rank, case, n, dtype)
            got = np.zeros(n * ws, dtype)
            dist.all_gather_into_tensor(got, mine)
            want = np.concatenate([data(r, case, n, dtype) for r in range(ws)])
            ck.eq(got, want, f"all_gather_into_tensor {dtype} n={n}")
    case += 1
    x = data(rank, case, 300_001, "float32")
    dist.broadcast(x, src=ws - 1)
    ck.eq(x, data(ws - 1, case, 300_001, "float32"), "broadcast")


def run_pg_options(ck, rank, ws):
    n = 300_001      # float32: above PYDDP_HIER_MIN_BYTES
    for case, algo in enumerate(("flat", "hier", "auto")):
        g = dist.new_group(pg_options={"algo": algo})
        x = data(rank, 900 + case, n, "float32")
        dist.all_reduce(x, group=g)
        want = reference([data(r, 900 + case, n, "float32") for r in range(ws)], "SUM",
                         "float32")
        ck.eq(x, want, f"all_reduce on a group with algo={algo}")
    try:
        dist.new_group(pg_options={"algo": "tree"})
        raise AssertionError("pg_options algo='tree' was accepted")
    except dist.DistValueError as e:
        assert "tree" in str(e), e
        ck.n += 1
    odd = dist.new_group(pg_options={"algo": "flat" if rank == 0 else "hier"})
    try:
        dist.all_reduce(np.ones(n, np.float32), group=odd)
        raise AssertionError("different algorithms per rank were not detected")
    except dist.CollectiveMismatchError as e:
        assert "hierarchical" in str(e) and "flat ring" in str(e), e
        ck.n += 1


def run_victim(rank, victim):
    x = np.ones(1 << 20, np.float32)       # 4 MiB: the pipelined hierarchical all-reduce
    dist.all_reduce(x)
    if rank == victim:
        # from another thread while this one is inside the all-reduces: mid-transfer
        def die():
            print("KILLING", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(0.3, die).start()
    t0 = time.monotonic()
    try:
        for _ in range(10000):
            dist.all_reduce(x)
        print("RESULT error=None", flush=True)
    except Exception as e:  # noqa: BLE001 - the test checks class, time and message
        msg = str(e).replace("\n", " ")
        print(f"RESULT error={type(e).__name__} seconds={time.monotonic() - t0:.2f} "
              f"msg={msg}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--expect-mismatch", action="store_true")
    ap.add_argument("--pg-options", action="store_true")
    ap.add_argument("--victim", type=int, default=-1)
    a = ap.parse_args()
    dist.init_process_group("cpu")
    rank, ws = dist.get_rank(), dist.get_world_size()
    ck = Checker(rank)
    if a.expect_mismatch:
        x = np.ones(1 << 20, np.float32)
        try:
            dist.all_reduce(x)
        except dist.CollectiveMismatchError as e:
            print("MISMATCH", str(e).replace("\n", " "), flush=True)
            return 0
        print(f"rank {rank}: no error", flush=True)
        return 1
    if a.victim >= 0:
        run_victim(rank, a.victim)
        return 0
    if a.pg_options:
        run_pg_options(ck, rank, ws)
        print(f"PASS {ck.n}", flush=True)     # the mismatch broke the groups: no teardown
        return 0
    run(ck, rank, ws)
    dist.destroy_process_group()
    print(f"PASS {ck.n}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
