"""A store and its client on two hosts, for tests/test_multivm.py: RANK 0 hosts a
TCPStore at MASTER_PORT and idles; RANK 1 connects, prints READY and waits on a key
that never comes (600 s timeout). When the client's wait raises, it prints RAISED with
the time, the class and the message, and exits at once."""
import json
import os
import sys
import time
from datetime import timedelta

import pyddp


def main():
    rank, port = int(os.environ["RANK"]), int(os.environ["MASTER_PORT"])
    if rank == 0:
        store = pyddp.TCPStore("", port, is_master=True, timeout=timedelta(seconds=600))
        store.set("up", b"1")
        time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 120)
        return
    store = pyddp.TCPStore(os.environ["MASTER_ADDR"], port, is_master=False,
                           timeout=timedelta(seconds=600))
    store.get("up")
    print("READY", flush=True)
    try:
        store.wait(["never"])
    except Exception as e:   # the point of the test: what is raised, and when
        print("RAISED " + json.dumps({"t": time.time(), "cls": type(e).__name__,
                                      "msg": str(e)}), flush=True)
        os._exit(3)


if __name__ == "__main__":
    main()
