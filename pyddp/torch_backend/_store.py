"""torch's ``Store`` over a pyddp store, and torch's ``env://`` rendezvous in the workers
of pyddp's torchrun rendezvous (``--rdzv-backend=pyddp``).

Those workers are told where the job's store is by ``PYDDP_RDZV_STORE`` (set by the
agent): ``pyddp`` (pyddp's own server in the endpoint's agent, which authenticates
every client when ``PYDDP_AUTH_TOKEN`` is set) or ``etcd://...`` (an etcd cluster).
torch's own ``init_process_group`` (torch's DDP, Lightning, Accelerate) would make a
torch ``TCPStore`` client of ``MASTER_ADDR:MASTER_PORT``, which can neither
authenticate nor speak to etcd; so in those workers torch's ``env://`` handler is
replaced (``_pyddp_torch_hook`` wraps it at ``import torch``, and it asks
:func:`env_rendezvous` first) by one that hands torch a :class:`TorchStore` over
pyddp's client of the job's store. Everywhere else torch's handler runs unchanged.

:class:`TorchStore` is a ``torch.distributed.Store`` (torch calls its methods from
C++, taking the GIL) whose every call is the pyddp store's; torch's keys reach the
store exactly as torch's own TCPStore client would write them. pyddp's backend creator
finds it under torch's PrefixStores and uses the pyddp store itself (``pyddp_store``).
"""
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist

from .. import _C, _env
from .._rendezvous import make_store


_KEPT = []      # every TorchStore handed to torch (one per env:// init of the process)


class TorchStore(dist.Store):
    """torch.distributed.Store's calls on a pyddp store (TCPStore or EtcdStore)."""

    def __init__(self, store):
        super().__init__()
        self.pyddp_store = store

    def set(self, key, value):
        self.pyddp_store.set(key, value)

    def get(self, key):
        return self.pyddp_store.get(key)

    def add(self, key, value):
        return self.pyddp_store.add(key, value)

    def append(self, key, value):
        self.pyddp_store.append(key, value)

    def compare_set(self, key, expected_value, desired_value):
        return self.pyddp_store.compare_set(key, expected_value, desired_value)

    def check(self, keys):
        return self.pyddp_store.check(keys)

    def wait(self, keys, timeout=None):
        self.pyddp_store.wait(keys, timeout if timeout is not None else self.timeout)

    def delete_key(self, key):
        return self.pyddp_store.delete_key(key)

    def num_keys(self):
        return self.pyddp_store.num_keys()

    def multi_get(self, keys):
        return self.pyddp_store.multi_get(keys)

    def multi_set(self, keys, values):
        self.pyddp_store.multi_set(keys, values)

    def set_timeout(self, timeout):
        super().set_timeout(timeout)
        self.pyddp_store.set_timeout(timeout)


def env_rendezvous(url, timeout, orig, **kwargs):
    """torch's env:// rendezvous: in a worker of pyddp's torchrun rendezvous, (a
    TorchStore over the job's store, rank, world size) from torchrun's variables;
    elsewhere torch's own handler (orig)."""
    if not _C.setting_text("PYDDP_RDZV_STORE"):
        yield from (orig(url, **kwargs) if timeout is None else
                    orig(url, timeout=timeout, **kwargs))
        return
    query = parse_qs(urlparse(url).query)       # torch passes rank= and world_size= here
    rdzv = _env.resolve("env://", int(query.get("rank", [-1])[0]),
                        int(query.get("world_size", [-1])[0]))
    store = TorchStore(make_store(rdzv, _env.seconds(timeout) if timeout is not None else
                                  _env.timeout_seconds(None)))
    # torch keeps only the C++ half of a Python Store: without a reference on the
    # Python side the object would be collected, and torch's calls on it would find
    # no method ("Not implemented")
    _KEPT.append(store)
    yield store, rdzv.rank, rdzv.world_size
    raise RuntimeError("Unable to perform re-rendezvous using env:// method")
