"""Worker for tests/test_transport.py: which transport each peer pair got, and that
every collective is right over it.

Run with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (possibly inside a network namespace).
It checks, independently of pyddp's own bookkeeping:

* the number of shared-memory segments this process maps (``/dev/shm/pyddp-...`` in
  ``/proc/self/maps``) is one per peer on the same host (--layout gives each rank's
  host), except where PYDDP_SHM_DISABLE=1 (--disable-shm-rank sets it for one rank);
* /dev/shm holds no segment created by this process (names start ``pyddp-<pid>-``):
  they are unlinked as soon as the peer has mapped them;
* every dtype and op of all_reduce, and all_gather, reduce_scatter and broadcast, on
  the latency path and on the bandwidth path (larger than the 1 MiB shared-memory ring,
  so the ring wraps), against NumPy.

Modes: --big N runs one all_reduce of N MiB of float32; --victim R makes rank R kill
itself with SIGKILL in the middle of a run of all_reduces, and the others report how
long they took to fail. Prints "rank R: PASS N checks" or "RESULT ..." lines.
"""
import argparse
import os
import signal
import sys
import time

import numpy as np

import pyddp as dist
from reference import FLOATS, INTS, Checker, check_all_reduce, data, reference

OPS = ["SUM", "AVG", "MIN", "MAX", "PRODUCT"]
COUNTS = [3, 300_001]          # latency path; bandwidth path, > ring and > chunk


def shm_maps():
    """Distinct pyddp segments mapped into this process (whether or not the creator has
    unlinked the name yet: a peer that mapped one may get here first)."""
    with open("/proc/self/maps") as f:
        return {part for line in f for part in line.split() if part.startswith("/dev/shm/pyddp-")}


def own_names():
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"pyddp-{os.getpid()}-")]


def run_all(ck, rank, ws):
    case = 0
    for dtype in FLOATS + INTS:
        for n in COUNTS:
            for op in OPS:
                case += 1
                check_all_reduce(dist, ck, rank, ws, case, n, dtype, op)
            case += 1
            out = np.empty(ws * n, dtype=dtype)
            dist.all_gather_into_tensor(out, data(rank, case, n, dtype))
            ck.eq(out, np.concatenate([data(r, case, n, dtype) for r in range(ws)]),
                  f"all_gather {dtype} n={n}")
            case += 1
            full = [data(r, case, ws * n, dtype) for r in range(ws)]
            out = np.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(out, full[rank])
            ck.eq(out, reference(full, "SUM", dtype)[rank * n:(rank + 1) * n],
                  f"reduce_scatter {dtype} n={n}")
            case += 1
            root = case % ws
            x = data(rank, case, n, dtype)
            dist.broadcast(x, src=root)
            ck.eq(x, data(root, case, n, dtype), f"broadcast {dtype} n={n} root={root}")


def run_big(ck, rank, ws, mib):
    n = mib << 18          # float32 elements
    x = np.empty(n, dtype=np.float32)
    x[:] = np.arange(n, dtype=np.int64) % 251 + rank      # every element differs locally
    t0 = time.monotonic()
    dist.all_reduce(x)
    dt = time.monotonic() - t0
    want = (np.arange(n, dtype=np.int64) % 251 * ws + ws * (ws - 1) // 2).astype(np.float32)
    ck.eq(x, want, f"all_reduce {mib} MiB float32")
    print(f"RESULT rank={rank} big_mib={mib} seconds={dt:.2f}", flush=True)


def run_victim(rank, victim):
    x = np.ones(1 << 18, dtype=np.float32)
    dist.all_reduce(x)
    if rank == victim:
        print(f"RESULT rank={rank} killing_self=1", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        for _ in range(100000):
            dist.all_reduce(x)
        print(f"RESULT rank={rank} error=None", flush=True)
    except Exception as e:  # noqa: BLE001 - the test checks class and timing
        print(f"RESULT rank={rank} error={type(e).__name__} seconds={time.monotonic() - t0:.2f}"
              f" msg={str(e)[:1500]!r}", flush=True)   # whole: the first failure comes last


def expected_shm(rank, ws, layout, disabled_rank):
    """Segments this rank should map: one per peer on the same "host" (layout letter),
    none with a rank that disabled shared memory, none at all if this one did."""
    if os.environ.get("PYDDP_SHM_DISABLE") == "1":
        return 0
    return sum(1 for p in range(ws)
               if p != rank and p != disabled_rank and layout[p] == layout[rank])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="", help="host letter per rank, e.g. AAB "
                    "(default: all on one host)")
    ap.add_argument("--disable-shm-rank", type=int, default=-1,
                    help="this rank alone sets PYDDP_SHM_DISABLE=1")
    ap.add_argument("--big", type=int, default=0)
    ap.add_argument("--victim", type=int, default=-1)
    a = ap.parse_args()
    print(f"PID rank={os.environ['RANK']} pid={os.getpid()}", flush=True)
    if int(os.environ["RANK"]) == a.disable_shm_rank:
        os.environ["PYDDP_SHM_DISABLE"] = "1"
    dist.init_process_group("cpu", timeout=60)
    rank, ws = dist.get_rank(), dist.get_world_size()
    dist.barrier()   # links are made on first use: a barrier of up to 8 ranks makes every pair's
    want = expected_shm(rank, ws, a.layout or "A" * ws, a.disable_shm_rank)
    maps = shm_maps()
    assert len(maps) == want, f"rank {rank}: {len(maps)} shm segments mapped " \
        f"({sorted(maps)}), expected {want}"
    assert not own_names(), f"rank {rank}: segments still named in /dev/shm: {own_names()}"
    if a.victim >= 0:
        run_victim(rank, a.victim)
        return
    ck = Checker(rank)
    if a.big:
        run_big(ck, rank, ws, a.big)
    else:
        run_all(ck, rank, ws)
    dist.barrier()
    dist.destroy_process_group()
    assert not shm_maps(), f"rank {rank}: segments still mapped after destroy"
    print(f"rank {rank}: PASS {ck.n} checks", flush=True)


if __name__ == "__main__":
    sys.exit(main())
