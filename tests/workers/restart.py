"""Worker: the first torchrun attempt fails on purpose (rank 1 exits after a collective);
torchrun restarts every worker with TORCHELASTIC_RESTART_COUNT=1 on the same agent store,
which still holds the first attempt's keys. The second attempt must rendezvous cleanly.
Also checks that torch code sharing the store sees its own keys untouched."""
import os
import sys

import numpy as np

import pyddp as dist

attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
dist.init_process_group("cpu")
rank, ws = dist.get_rank(), dist.get_world_size()
x = np.full(3, float(rank + 10 * attempt))
dist.all_reduce(x)
assert np.all(x == sum(r + 10 * attempt for r in range(ws))), x
if attempt == 0:
    if rank == 1:
        sys.exit(17)
    dist.barrier()      # rank 1 never arrives: fails fast or the agent stops us
    sys.exit(1)
dist.barrier()
print(f"rank {rank}: PASS attempt={attempt}", flush=True)
dist.destroy_process_group()
