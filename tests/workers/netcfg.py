"""Worker: PYDDP_PORT_RANGE and PYDDP_SOCKET_IFNAME are honoured. Prints every peer's
advertised host:port as this rank sees it."""
import numpy as np

import pyddp as dist

dist.init_process_group("cpu")
pg = dist._group.default_pg()
peers = [pg.peer(r)[0] for r in range(dist.get_world_size())]
x = np.ones(4)
dist.all_reduce(x)
print("RESULT peers=" + repr(";".join(peers)) + f" ok={bool(np.all(x == dist.get_world_size()))!r}",
      flush=True)
dist.destroy_process_group()
