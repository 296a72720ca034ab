"""Rank 1 claims another pyddp version and every rank calls
init_process_group("nccl") (with the NCCL test doubles): each reports what it raised, for tests/test_multivm.py."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scenarios import expect_error, report  # noqa: E402

import pyddp as dist  # noqa: E402


def main():
    import pyddp._group
    import pyddp._world
    rank = int(os.environ["RANK"])
    if rank == 1:       # the version the rendezvous (_world) and NCCL's set-up (_group) send
        pyddp._world.__version__ = pyddp._group.__version__ = "0.0.1-other"
    cls, msg, _ = expect_error(lambda: dist.init_process_group("nccl"))
    report(rank=rank, cls=cls.__name__ if cls else None, msg=msg)


if __name__ == "__main__":
    main()
