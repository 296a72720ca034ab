"""pyddp as a torch.distributed backend: ``init_process_group(backend="pyddp")``.

Installing pyddp registers the backend through torch's ``torch.backends`` entry point
(``_pyddp_torch_hook``, auto-loaded at ``import torch``); importing this module
registers it too (for ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``). Both register the same
creator, once.

torch calls the creator for the default group and for every ``new_group`` this
process is a member of, with a store, the group rank and size, the timeout, the
group's name and its global ranks (extended API). The creator:

* default group: finds the TCPStore underneath torch's PrefixStores (under torchrun,
  the agent's store) and connects a pyddp store client to it; for any other store
  (FileStore, HashStore) rank 0 hosts a pyddp store on an ephemeral port and
  publishes its address through torch's store. pyddp then rendezvouses under its own
  prefix ``/pyddp/<run id>/torch/<generation>.<group name>/<round>`` (``_round``): a torchrun
  restart (whose agent store still holds the old keys) or a second init in the same
  process starts clean, and torch's own keys are untouched.
* ``new_group(ranks)`` when the default group is pyddp's: a pyddp subgroup running on
  the default group's connections (no new rendezvous). When the default group is
  another backend's, a standalone pyddp group for the members, over the store.

The group itself is :class:`pyddp.torch_backend._pg.ProcessGroupPyddp`. Two torch functions
refuse backends they do not know, so this module wraps them for pyddp groups only:
``monitored_barrier`` (gloo-only in torch) and ``batch_isend_irecv`` (which torch
would issue op by op; pyddp runs the batch at once so that a ring exchange cannot
deadlock). Every other group reaches torch's original functions unchanged.

The package (the torch integration) may import the core and torch; the core never
imports it, and DDP reaches torch through torch alone. ``_pyddp_torch_hook`` (top level,
outside the package) is what torch and torchrun load; it imports this package lazily.
"""
import functools
import threading

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import _pyddp_torch_hook
from .. import _C, _env, _group, _rendezvous, _world
from .. import collectives as C
from .._errors import raise_as_torch
from ._pg import ProcessGroupPyddp
from ._store import TorchStore
from ._work import PyddpWork, _Completion, future_for as _future_for

__all__ = ["ProcessGroupPyddp", "create_process_group", "register", "NAME"]

NAME = _pyddp_torch_hook.NAME

_STORE_KEY = "pyddp_store_addr"   # where rank 0 publishes a store it hosts


class _State:
    lock = threading.Lock()
    generation = 0          # default groups created in this process (prefix part)
    stores = {}             # (host, port) -> [pyddp TCPStore client, groups using it]
    patched = False


def register():
    """Register the "pyddp" backend with torch.distributed (idempotent)."""
    return _pyddp_torch_hook.register()


def _timeout_s(timeout):
    """The group's timeout in seconds: PYDDP_TIMEOUT when it is set, else the one torch
    passes. torch always passes one (its 30-minute default when the script gives none,
    also under Lightning and Accelerate), so pyddp cannot tell a chosen timeout from
    the default; a variable set in the environment is the user's choice, and wins."""
    if _C.setting_text("PYDDP_TIMEOUT"):
        return _env.timeout_seconds(None)
    return _env.timeout_seconds(timeout if timeout is not None and
                                timeout.total_seconds() > 0 else None)


def _base_store(store):
    """The store underneath torch's PrefixStore chain."""
    seen = 0
    while isinstance(store, dist.PrefixStore) and seen < 64:
        store = store.underlying_store
        seen += 1
    return store


def _client(host, port, timeout_s):
    """A pyddp store client for the TCPStore server at host:port, shared by the groups
    of this process that use that server (created on first use, counted; _release
    closes it when the last one shuts down: the server may not outlive them, e.g. a
    store that torch's rank 0 hosts for one init)."""
    key = (host, port)
    with _State.lock:
        entry = _State.stores.get(key)
        if entry is not None:
            entry[1] += 1
            return entry[0]
    client = _rendezvous._connect_store(host, port, timeout_s)    # not under the lock
    with _State.lock:
        entry = _State.stores.setdefault(key, [client, 0])
        entry[1] += 1
    if entry[0] is not client:
        client.close()          # another thread connected first
    return entry[0]


def _release(store):
    """One group less uses store (a client from _client; hosted stores are left)."""
    with _State.lock:
        for key, entry in list(_State.stores.items()):
            if entry[0] is store:
                entry[1] -= 1
                if entry[1] <= 0:
                    del _State.stores[key]
                    store.close()
                return


def _pyddp_store(store, rank, timeout_s):
    """(pyddp store, a host that routes to it): pyddp's own client when torch's store is
    one (a TorchStore: the job's store of pyddp's torchrun rendezvous), a client of the
    server underneath torch's TCPStore, or, for any other store, one that rank 0 hosts
    (for the life of the process, like torchrun's agent store) and announces through
    torch's store."""
    base = _base_store(store)
    if isinstance(base, TorchStore):        # pyddp's client of the job's store
        return base.pyddp_store, base.pyddp_store.route_host
    if isinstance(base, dist.TCPStore):
        host = base.host or "127.0.0.1"
        return _client(host, base.port, timeout_s), host
    if rank == 0:
        addr = _rendezvous._host_address()
        hosted = _rendezvous._hosted_store(("torch-backend",), addr, 0, timeout_s)
        store.set(_STORE_KEY, f"{addr}:{hosted.port}")
        return hosted, addr
    host, _, port = store.get(_STORE_KEY).decode().rpartition(":")
    return _client(host, int(port), timeout_s), host


def _world_prefix(pg_options):
    """The key prefix a caller that agreed it passes for a new default group (pyddp.elastic
    making torch's default group again for a new membership), or None."""
    return pg_options.get("pyddp_prefix") if isinstance(pg_options, dict) else None


def _options_backend(pg_options):
    """pg_options may pick pyddp's transport: {"backend": "cpu"} keeps CUDA tensors
    off NCCL; None (default) routes CPU tensors to the CPU transport and CUDA tensors
    to NCCL."""
    if pg_options is None:
        return None
    be = pg_options.get("backend") if isinstance(pg_options, dict) else \
        getattr(pg_options, "backend", None)
    if be not in (None, "cpu", "nccl"):
        raise _C.DistValueError(f"pg_options backend={be!r}: use 'cpu', 'nccl' or None")
    return be


def _default_pyddp_pg():
    """torch's default group when it is a pyddp one (subgroups are cut from it)."""
    if not dist.is_initialized():
        return None
    pg = c10d._get_default_group()
    return pg if isinstance(pg, ProcessGroupPyddp) else None


def create_process_group(opts, pg_options=None):
    """torch's creator for backend "pyddp" (extended API): the ProcessGroupPyddp of
    this rank. Collective over the group's members (torch calls it on members only).
    On failure nothing is left behind; pyddp's error arrives as torch's DistError
    family."""
    _patch_torch()
    rank, size = opts.group_rank, opts.group_size
    ranks = list(opts.global_ranks_in_group)
    timeout_s = _timeout_s(opts.timeout)
    backend = _options_backend(pg_options)
    name = str(opts.group_id)
    parent = _default_pyddp_pg() if ranks else None
    try:
        if parent is not None:
            # new_group under a pyddp default group: torch's global ranks are the
            # default group's, so the subgroup runs on its connections
            algo = _group._options_algo(pg_options) if isinstance(pg_options, dict) else -1
            handle = parent.handle.subgroup(sorted(ranks), name, backend=backend,
                                            timeout_s=timeout_s, algo=algo)
        else:
            with _State.lock:
                gen = _State.generation
                _State.generation += 1
            store, host = _pyddp_store(opts.store, rank, timeout_s)
            try:
                if ranks:      # a standalone group under another backend's default group
                    handle = _world.create_world(store, rank, size, timeout_s, f"{gen}.{name}",
                                                 backend=backend, master_addr=host)
                else:          # the default group (a plug-in's, or one under a given prefix)
                    handle = _world.torch_world(store, rank, size, timeout_s, f"{gen}.{name}",
                                                backend, host, _world_prefix(pg_options))
            except BaseException:
                _release(store)
                raise
            return ProcessGroupPyddp(handle, handle.rank, handle.size, handle.ranks,
                                     opts.timeout, functools.partial(_close, store))
    except Exception as e:
        raise_as_torch(e)
    return ProcessGroupPyddp(handle, rank, size, handle.ranks, opts.timeout, _close)


def _close(*args):
    """ProcessGroupPyddp's shutdown, _close([store,] pg): destroy pg's pyddp group, then
    release the store client its rendezvous used (torch's destroy_process_group shuts
    subgroups down before the default group)."""
    *store, pg = args
    h = pg.handle
    try:
        if h is not None:
            h._destroy()
    finally:
        if store:
            _release(store[0])


# -- the two torch functions that refuse unknown backends ----------------------------

def _resolve(group):
    return group if group is not None else c10d.GroupMember.WORLD


def _monitored_barrier(orig):
    @functools.wraps(orig)
    def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
        pg = _resolve(group)
        if not isinstance(pg, ProcessGroupPyddp):
            return orig(group, timeout, wait_all_ranks)
        return pg.monitored_barrier(timeout, wait_all_ranks)
    monitored_barrier._pyddp_orig = orig
    return monitored_barrier


def _batch_isend_irecv(orig):
    @functools.wraps(orig)
    def batch_isend_irecv(p2p_op_list):
        c10d._check_p2p_op_list(p2p_op_list)
        pg = _resolve(p2p_op_list[0].group)
        if not isinstance(pg, ProcessGroupPyddp):
            return orig(p2p_op_list)
        ops = []
        for op in p2p_op_list:
            send = op.op in (dist.isend, c10d.isend)
            ops.append(C.P2POp(C.isend if send else C.irecv, op.tensor,
                               pg._global(op.group_peer, "peer"), group=pg.handle, tag=op.tag))
        try:
            works = C.batch_isend_irecv(ops)
        except Exception as e:
            raise_as_torch(e)
        # pyddp completes the whole batch at once; torch hands out one Work per op
        tensors = [op.tensor for op in p2p_op_list]
        fut = _future_for(tensors)
        comp = _Completion(fut, works, tensors)
        return [PyddpWork(fut, comp) for _ in p2p_op_list]
    batch_isend_irecv._pyddp_orig = orig
    return batch_isend_irecv


def _patch_torch():
    """Wrap monitored_barrier and batch_isend_irecv (see the module docstring), once."""
    with _State.lock:
        if _State.patched:
            return
        _State.patched = True
        for fname, wrap in (("monitored_barrier", _monitored_barrier),
                            ("batch_isend_irecv", _batch_isend_irecv)):
            orig = getattr(c10d, fname)
            if getattr(orig, "_pyddp_orig", None) is None:
                new = wrap(orig)
                setattr(c10d, fname, new)
                if getattr(dist, fname, None) is orig:
                    setattr(dist, fname, new)


register()
