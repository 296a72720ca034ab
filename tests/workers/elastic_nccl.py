"""An in-place elastic job on the NCCL path, against the test-double NCCL/CUDA libraries
(tests/nccl_fake, one-rank communicators): tests/test_nccl_nogpu.py starts 3 ranks with
plain env:// variables and FAKE_LOG per rank.

Each step all-reduces a "device" array (the fake's NCCL) and a host gradient (pyddp's
CPU transport), then updates a NumPy parameter held in an elastic.NumPyState, committed
every 3 steps. Rank 2 dies (os._exit) at step 5, before its host all-reduce; the others
must rebuild the process group, NCCL communicator included (the old one aborted, a new
one of 2 ranks set up), roll back, and finish 12 steps. Each survivor prints RESULT with
its rank, the world size, a digest of the parameter, and its fake NCCL log's set-ups
and aborts.
"""
import hashlib
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "nccl_fake"))
from scenarios import FakeDevArray, log_lines  # noqa: E402

import pyddp  # noqa: E402
from pyddp import elastic  # noqa: E402

STEPS = 12


def main():
    pyddp.init_process_group("nccl")
    me = pyddp.get_rank()
    w = np.zeros(16, np.float64)
    state = elastic.NumPyState(arrays={"w": w}, step=0)

    @elastic.run
    def train(state):
        while state.step < STEPS:
            dev = FakeDevArray(np.full(4, 1.0, np.float32))
            pyddp.all_reduce(dev)
            if me == 2 and state.step == 5:
                os._exit(1)
            g = np.arange(16, dtype=np.float64) * (state.step + 1)
            pyddp.all_reduce(g)
            w[...] -= 0.01 * g / pyddp.get_world_size()
            state.step += 1
            if state.step % 3 == 0:
                state.commit()

    train(state)
    digests = [None] * pyddp.get_world_size()
    pyddp.all_gather_object(digests, hashlib.sha256(w.tobytes()).hexdigest()[:16])
    log = log_lines()
    print("RESULT " + json.dumps({
        "rank": pyddp.get_rank(), "world": pyddp.get_world_size(), "digests": digests,
        "w": w.tolist(), "step": state.step,
        "inits": [x for x in log if x.startswith("ncclCommInitRankConfig")],
        "aborts": sum(x == "ncclCommAbort" for x in log)}), flush=True)
    pyddp.destroy_process_group()


if __name__ == "__main__":
    main()
