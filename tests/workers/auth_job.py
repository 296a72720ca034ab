"""Worker for tests/test_auth.py: a short job checked against NumPy.

Rank 0 writes MASTER_PORT to $AUTH_PORT_FILE before init (so the test's outsider knows
where the store is); a rank listed in $AUTH_LATE sleeps $AUTH_DELAY seconds before init
(so rendezvous stays open while the outsider attacks). Then all_reduce, broadcast and
all_gather_object, each compared with the value computed locally. Prints "PASS".
"""
import os
import sys
import time

import numpy as np

import pyddp as dist


def main():
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == 0 and os.environ.get("AUTH_PORT_FILE"):
        with open(os.environ["AUTH_PORT_FILE"] + ".tmp", "w") as f:
            f.write(os.environ["MASTER_PORT"])
        os.rename(os.environ["AUTH_PORT_FILE"] + ".tmp", os.environ["AUTH_PORT_FILE"])
    if str(rank) in os.environ.get("AUTH_LATE", "").split(","):
        time.sleep(float(os.environ.get("AUTH_DELAY", "0")))
    t0 = time.monotonic()
    try:
        dist.init_process_group("cpu")
    except dist.DistError as e:
        print(f"INIT FAILED after {time.monotonic() - t0:.1f} s: {type(e).__name__}: {e}",
              flush=True)
        sys.exit(3)
    for n in (5, 100_003):
        x = np.arange(n, dtype=np.float64) * (rank + 1)
        dist.all_reduce(x)
        want = np.arange(n, dtype=np.float64) * sum(r + 1 for r in range(ws))
        assert np.array_equal(x, want), f"all_reduce n={n} wrong on rank {rank}"
    y = np.full(7, rank, dtype=np.int64)
    dist.broadcast(y, src=ws - 1)
    assert np.array_equal(y, np.full(7, ws - 1)), "broadcast wrong"
    objs = [None] * ws
    dist.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": r} for r in range(ws)], f"all_gather_object wrong: {objs}"
    dist.destroy_process_group()
    print("PASS", flush=True)


if __name__ == "__main__":
    main()
