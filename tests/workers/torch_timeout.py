"""Worker for tests/test_torch_backend.py's PYDDP_TIMEOUT case: torch's own
init_process_group("pyddp") (which always passes torch's 30-minute default timeout), then
rank 1 does not join an all_reduce. Rank 0 prints "TIMEOUT_AFTER <seconds> <class>" when
its all_reduce fails and sets the key "reported" in torch's store (torchrun's, not
pyddp's group); rank 1 waits for that key (at most argv[1] seconds), then exits without
destroying anything, so the job ends as soon as the timeout has been seen."""
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("pyddp")
    x = torch.ones(4)
    dist.all_reduce(x)                       # both ranks: the group works
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 1:
        store.wait(["reported"], datetime.timedelta(seconds=float(sys.argv[1])))
        os._exit(0)
    t0 = time.monotonic()
    try:
        dist.all_reduce(x)
        print("TIMEOUT_AFTER none", flush=True)
    except Exception as e:  # noqa: BLE001 - the class is what the test checks
        print(f"TIMEOUT_AFTER {time.monotonic() - t0:.1f} {type(e).__name__}", flush=True)
    store.set("reported", "1")
    os._exit(0)


if __name__ == "__main__":
    main()
