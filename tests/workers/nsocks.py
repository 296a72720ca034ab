"""Worker for tests/test_nsocks.py: collectives over links striped over several TCP
connections per peer (PYDDP_NSOCKS_PERPEER, set by the test), against NumPy.

Run with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT. It checks, independently of pyddp's
own bookkeeping, that this process holds exactly --per-peer established TCP connections
per peer besides its store connections (read from /proc: its socket descriptors,
matched against /proc/net/tcp{,6}), then runs all_reduce, broadcast,
all_gather and reduce_scatter at sizes from 8 B to 8 MiB (latency path, bandwidth
path, sizes that are not multiples of the stripe segment) and compares each result
with the NumPy reference. Prints "rank R: PASS N checks". With --init-only it only
initialises and prints "rank R: ERROR <type>: <message>" if that fails.
"""
import argparse
import os
import sys
import time

import numpy as np

import pyddp as dist
from reference import Checker, check_all_reduce, data, reference

SIZES = [8, 4096, 65536 + 8, 1 << 20, (3 << 20) + 4, 8 << 20]   # bytes


def data_connections(store_port):
    """Established TCP connections of this process whose ends are not the store's port."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            t = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if t.startswith("socket:["):
            inodes.add(t[8:-1])
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            local, remote, state, inode = f[1], f[2], f[3], f[9]
            ports = {int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)}
            if inode in inodes and state == "01" and store_port not in ports:
                n += 1
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-peer", type=int, default=1, help="TCP connections expected per peer")
    ap.add_argument("--init-only", action="store_true")
    a = ap.parse_args()
    if a.init_only:
        try:
            dist.init_process_group("cpu")
        except Exception as e:   # the test checks the type and the message
            print(f"rank {os.environ['RANK']}: ERROR {type(e).__name__}: {e}", flush=True)
            return 1
        dist.destroy_process_group()
        return 0
    dist.init_process_group("cpu")
    rank, ws = dist.get_rank(), dist.get_world_size()
    ck = Checker(rank)
    dist.barrier()   # links are made on first use: a barrier of up to 8 ranks makes every pair's
    # A link both ends dialed at once keeps one connection and closes the other
    # (DDP_HELLO_DUPLICATE): that one may linger a moment, so the count is the one
    # it settles at within seconds.
    want, deadline = a.per_peer * (ws - 1), time.monotonic() + 5
    got = data_connections(int(os.environ["MASTER_PORT"]))
    while got != want and time.monotonic() < deadline:
        time.sleep(0.05)
        got = data_connections(int(os.environ["MASTER_PORT"]))
    ck.eq(got, want, f"data connections ({a.per_peer} per peer)")
    case = 0
    for nbytes in SIZES:
        n = max(1, nbytes // 4)
        for dtype, op in (("float32", "SUM"), ("int64", "MAX")):
            case += 1
            check_all_reduce(dist, ck, rank, ws, case, n if dtype == "float32" else max(1, n // 2),
                             dtype, op)
        case += 1
        root = case % ws
        x = data(rank, case, n, "float32")
        dist.broadcast(x, src=root)
        ck.eq(x, data(root, case, n, "float32"), f"broadcast n={n} root={root}")
        per = max(1, n // ws)
        case += 1
        out = np.empty(ws * per, dtype=np.float32)
        dist.all_gather_into_tensor(out, data(rank, case, per, "float32"))
        ck.eq(out, np.concatenate([data(r, case, per, "float32") for r in range(ws)]),
              f"all_gather per={per}")
        case += 1
        full = [data(r, case, ws * per, "float32") for r in range(ws)]
        out = np.empty(per, dtype=np.float32)
        dist.reduce_scatter_tensor(out, full[rank])
        ck.eq(out, reference(full, "SUM", "float32")[rank * per:(rank + 1) * per],
              f"reduce_scatter per={per}")
    dist.destroy_process_group()
    print(f"rank {rank}: PASS {ck.n} checks", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
