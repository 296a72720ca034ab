"""Worker for tests/test_ddp_numpy.py::test_ctrl_c_during_gradient_sync: rank 1 never
joins the gradient all-reduce; rank 0 gets SIGINT while waiting for it and must raise
KeyboardInterrupt promptly (the group is broken so nothing keeps waiting), and a later
sync_gradients must fail with an error instead of hanging. argv[1]: "c" or "generic"."""
import os
import signal
import sys
import threading
import time

import numpy as np

import pyddp

pyddp.init_process_group("cpu")
params = [(np.zeros(1000), np.ones(1000)) for _ in range(3)]
ddp = pyddp.DistributedDataParallel(params, _generic_path=sys.argv[1] == "generic")
if pyddp.get_rank() == 1:
    time.sleep(4)          # never calls sync_gradients; the launcher reaps it
    os._exit(0)
threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
t0 = time.monotonic()
try:
    ddp.sync_gradients()
    sys.exit("sync_gradients returned although rank 1 never joined")
except KeyboardInterrupt:
    print(f"interrupted after {time.monotonic() - t0:.2f} s", flush=True)
try:
    ddp.sync_gradients()
    sys.exit("sync_gradients succeeded on a broken group")
except pyddp.DistError as e:
    print(f"then: {type(e).__name__}: {e}", flush=True)
