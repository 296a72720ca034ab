"""A rank that all-reduces in a loop until told to stop, for tests/test_multivm.py's
partition and stopped-peer cases: prints READY after a few checked all_reduces, keeps
going for --seconds (rank 0's clock decides, for every rank), then PASS; if a collective
raises, prints RAISED with the time, the exception's class and message, and exits at
once (os._exit: a partitioned peer must not make the exit wait either)."""
import argparse
import json
import os
import sys
import time

import numpy as np

import pyddp as dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--elems", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=60.0)
    a = ap.parse_args()
    dist.init_process_group("cpu", timeout=600)   # far longer than any test waits
    rank, ws = dist.get_rank(), dist.get_world_size()
    want = sum(range(1, ws + 1))
    calls, ready_at = 0, None
    try:
        while True:
            # The last element is rank 0's verdict on the time, summed into every rank's
            # copy, so all ranks stop after the same call (each checking its own clock
            # could leave one rank in an all_reduce its peer never joins).
            x = np.full(a.elems + 1, rank + 1, dtype=np.float32)
            x[-1] = (rank == 0 and ready_at is not None
                     and time.time() - ready_at >= a.seconds)
            dist.all_reduce(x)
            assert np.all(x[:-1] == want), x[:4]
            if x[-1]:
                break
            calls += 1
            if calls == 5:
                ready_at = time.time()
                print("READY", flush=True)
            time.sleep(0.01)
    except Exception as e:   # the point of the test: what is raised, and when
        print("RAISED " + json.dumps({"rank": rank, "t": time.time(), "cls": type(e).__name__,
                                      "msg": str(e)}), flush=True)
        sys.stderr.flush()
        os._exit(3)
    print("PASS " + json.dumps({"rank": rank, "calls": calls}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
