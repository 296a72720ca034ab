"""The default process group: init_process_group, destroy_process_group and the
queries about it (rank, world size, backend).

init_process_group resolves the rendezvous (``_env``), connects to or hosts the store,
then builds the backend's process group through the C core, which publishes this rank's
address under pyddp's own key prefix ``/pyddp/<run id>/<restart count>/<generation>``
and connects to every peer. The prefix makes a torchrun restart (whose agent store still
holds the previous attempt's keys) and a second init in the same process start clean,
and keeps pyddp out of the way of torch code using the same store.
"""
import logging
import os
import re
import sys
import time
import uuid

from . import _C, _env
from ._version import __version__
from .store import TCPStore

log = logging.getLogger("pyddp")

_BACKENDS = ("cpu", "gloo", "nccl")


class _State:
    pg = None              # the backend's process group (_C.ProcessGroup or NCCL group)
    backend = None         # "cpu" or "nccl"
    store = None           # TCPStore
    rank = -1
    world_size = -1
    timeout_s = None
    generation = 0         # inits so far in this process: part of the key prefix
    file_path = None       # file:// rendezvous file that rank 0 wrote
    prefix = None
    own_store = False      # the store client was made by init_process_group
    # Stores this process hosts, by (method, port or path). They live as long as the
    # process, like torchrun's agent store: a peer may still be reading from one when
    # this rank destroys its group or fails its init, and a later init with the same
    # address reuses the server instead of racing its peers to rebind the port.
    hosted = {}


class WORLD:
    """Stand-in for torch's ``group.WORLD``: the default group."""


group = type("group", (), {"WORLD": WORLD})


def _check_group(g):
    if g is not None and g is not WORLD:
        raise _C.DistValueError("pyddp supports only the default group (group=None); "
                                "new_group() is not implemented")


def _require():
    if _State.pg is None:
        raise _C.DistError("the default process group is not initialized: call "
                           "pyddp.init_process_group() first")
    return _State.pg


def is_available() -> bool:
    """True: pyddp's CPU backend is always built."""
    return True


def is_initialized() -> bool:
    return _State.pg is not None


def get_rank(group=None) -> int:
    _check_group(group)
    _require()
    return _State.rank


def get_world_size(group=None) -> int:
    _check_group(group)
    _require()
    return _State.world_size


def get_backend(group=None) -> str:
    _check_group(group)
    _require()
    return _State.backend


def get_local_rank() -> int:
    """This process's index on its node (torchrun's LOCAL_RANK; 0 when unset)."""
    return _env.local_rank()


def get_local_world_size() -> int:
    """Processes on this node (torchrun's LOCAL_WORLD_SIZE; 1 when unset)."""
    return _env.local_world_size()


def _warn_slow(what, addr, port, elapsed, total):
    print(f"pyddp: rank {_State.rank}: still trying to reach the store at {addr}:{port} "
          f"after {elapsed:.0f} s ({what}); will keep trying for {total - elapsed:.0f} s more. "
          f"Check that the rank-0 node is up, MASTER_ADDR/MASTER_PORT are right, and that a "
          f"firewall or cloud security-group rule allows TCP to port {port} between the "
          f"nodes.", file=sys.stderr, flush=True)


def _connect_store(addr, port, timeout_s, world_size=None):
    """Connect to a store server that someone else hosts, warning on stderr every 15 s
    while it is unreachable and failing with DistNetworkError at the timeout."""
    deadline = time.monotonic() + timeout_s
    start = time.monotonic()
    while True:
        left = deadline - time.monotonic()
        try:
            store = TCPStore(addr, port, is_master=False,
                             timeout=_td(max(min(left, 15.0), 0.001)))
            store.set_timeout(_td(timeout_s))
            return store
        except _C.DistNetworkError as e:
            m = re.search(r"last error: ([^)]*)", str(e))
            reason = m.group(1) if m else "unreachable"
            if time.monotonic() >= deadline:
                # one message for the whole wait, not for its last 15-second slice
                raise _C.DistNetworkError(
                    f"rank {_State.rank}: could not connect to the store at {addr}:{port} "
                    f"within {timeout_s:.1f} s (last error: {reason}). Check that the "
                    f"rank-0 node is running, that MASTER_ADDR/MASTER_PORT are right, and "
                    f"that a firewall or cloud security-group rule allows TCP to port "
                    f"{port} from this host.") from None
            _warn_slow(reason, addr, port, time.monotonic() - start, timeout_s)


def _td(s):
    from datetime import timedelta
    return timedelta(seconds=s)


def _file_store(path, rank, timeout_s):
    """file:// rendezvous: rank 0 hosts a store on an ephemeral port and writes
    "host port nonce" into the file (atomically); the others read it and connect,
    re-reading when they find a stale file from an earlier run."""
    if rank == 0:
        adv = _env.advertise_address(None) if os.environ.get("PYDDP_SOCKET_IFNAME") else \
            _primary_address()
        store = _hosted_store(("file", path), "", 0, timeout_s)
        nonce = uuid.uuid4().hex
        store.set("pyddp_file_nonce", nonce)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(f"{adv} {store.port} {nonce}\n")
        os.replace(tmp, path)
        _State.file_path = path
        return store
    deadline = time.monotonic() + timeout_s
    last = "the file does not exist yet"
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                host, port, nonce = f.read().split()
            store = TCPStore(host, int(port), is_master=False, timeout=_td(2.0))
            store.set_timeout(_td(timeout_s))
            if store.get("pyddp_file_nonce").decode() == nonce:
                return store
            last = "the file names a store of another run"
        except (OSError, ValueError) as e:
            last = str(e) or type(e).__name__
        time.sleep(0.1)
    raise _C.DistTimeoutError(f"rank {rank}: file rendezvous through {path} did not complete "
                              f"within {timeout_s:.0f} s ({last}). Check that every rank uses "
                              f"the same path on shared storage and that rank 0 started.")


def _primary_address():
    try:
        return _C.route_addr("8.8.8.8")   # no packet is sent: only a route lookup
    except _C.DistError:
        return "127.0.0.1"


def _make_store(rdzv, timeout_s):
    if rdzv.method == "file":
        return _file_store(rdzv.file_path, rdzv.rank, timeout_s)
    if rdzv.use_agent_store or rdzv.rank != 0:
        return _connect_store(rdzv.master_addr, rdzv.master_port, timeout_s)
    # rank 0 hosts the store on MASTER_PORT (plain env:// launch, or tcp://)
    return _hosted_store(("tcp", rdzv.master_port), rdzv.master_addr, rdzv.master_port,
                         timeout_s)


def _hosted_store(key, host, port, timeout_s):
    """The store this process hosts for key, started on first use (see _State.hosted)."""
    store = _State.hosted.get(key)
    if store is None:
        store = TCPStore(host, port, is_master=True, timeout=_td(timeout_s))
        _State.hosted[key] = store
    else:
        store.set_timeout(_td(timeout_s))
    return store


def _is_hosted(store):
    return any(s is store for s in _State.hosted.values())


def _linger_after_failure(store, prefix, world_size, timeout_s):
    """After a failed init, count this rank as finished in the store; the rank that
    hosts the store then waits (up to 10 s) for the others before its process may exit
    and take the store with it, so that every rank gets to read the same error (e.g.
    the version list) instead of a closed connection."""
    key = f"{prefix}/finished"
    try:
        store.add(key, 1)
        if _is_hosted(store):
            deadline = time.monotonic() + min(timeout_s, 10.0)
            while store.add(key, 0) < world_size and time.monotonic() < deadline:
                time.sleep(0.05)
    except _C.DistError:
        pass


def _pick_backend(backend):
    if backend is None:
        from . import _nccl_backend
        if _nccl_backend.usable():
            return "nccl"
        log.debug("pyddp: backend=None: no usable GPU/NCCL (%s); using the CPU backend",
                  _nccl_backend.why_unusable())
        return "cpu"
    if not isinstance(backend, str):
        backend = str(backend)
    b = backend.lower()
    if b not in _BACKENDS:
        raise _C.DistValueError(f"backend={backend!r} is not supported; use 'cpu' (alias "
                                f"'gloo'), 'nccl', or None to pick automatically")
    if b == "nccl":
        from . import _nccl_backend
        _nccl_backend.require()   # fail at once, before any rendezvous
    return "cpu" if b == "gloo" else b


def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                       store=None, group_name="", pg_options=None, device_id=None):
    """Initialize the default process group (torch.distributed's signature).

    backend: "cpu" (pyddp's TCP/shared-memory transport; "gloo" is an alias), "nccl",
    or None (nccl when a GPU and NCCL are usable, else cpu). init_method: "env://"
    (default, torchrun's variables), "tcp://host:port" or "file:///path". store: a
    pyddp.TCPStore to rendezvous through instead (then rank and world_size are
    required). timeout: a timedelta bounding every wait (default PYDDP_TIMEOUT or 30 min).
    """
    if _State.pg is not None:
        raise _C.DistError("the default process group is already initialized; call "
                           "destroy_process_group() first")
    be = _pick_backend(backend)
    timeout_s = _env.timeout_seconds(timeout)
    if store is not None:
        if init_method is not None:
            raise _C.DistValueError("pass either init_method or store, not both")
        if rank is None or rank < 0 or world_size is None or world_size < 1:
            raise _C.DistValueError("init_process_group(store=...) needs rank= and world_size=")
        _env._check_rank(rank, world_size)
        if not isinstance(store, TCPStore):
            raise _C.DistTypeError(f"store must be a pyddp.TCPStore, not {type(store).__name__}")
        rdzv = _env.Rendezvous(rank, world_size, "store", store.host, store.port, None, True,
                               os.environ.get("TORCHELASTIC_RUN_ID", "none") or "none",
                               int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0))
    else:
        rdzv = _env.resolve(init_method, rank, world_size)
    lo, hi = _env.port_range()
    _State.rank = rdzv.rank
    own_store = store is None
    if own_store:
        store = _make_store(rdzv, timeout_s)
    else:
        store.set_timeout(_td(timeout_s))
    prefix = f"/pyddp/{rdzv.run_id}/{rdzv.restart_count}/{_State.generation}"
    _State.generation += 1   # per attempt: every rank makes the same attempts
    try:
        advertise = _env.advertise_address(rdzv.master_addr if rdzv.master_addr else None)
        if be == "nccl":
            from . import _nccl_backend
            pg = _nccl_backend.create(store, rdzv.rank, rdzv.world_size, prefix, timeout_s,
                                      device_id)
        else:
            pg = _C.ProcessGroup(store._client, rdzv.rank, rdzv.world_size, prefix, advertise,
                                 "", lo, hi, int(timeout_s * 1000), __version__,
                                 _env.host_identity())
    except BaseException as e:
        _State.rank = -1
        if not isinstance(e, KeyboardInterrupt):
            _linger_after_failure(store, prefix, rdzv.world_size, timeout_s)
        if own_store and not _is_hosted(store):
            store.close()
        raise
    _State.pg, _State.backend, _State.store = pg, be, store
    _State.world_size, _State.timeout_s, _State.prefix = rdzv.world_size, timeout_s, prefix
    _State.own_store = own_store
    log.debug("pyddp: rank %d/%d initialized (%s backend, prefix %s)", rdzv.rank,
              rdzv.world_size, be, prefix)


def destroy_process_group(group=None):
    """Tear down the default group; init_process_group may be called again afterwards."""
    _check_group(group)
    pg, store = _State.pg, _State.store
    if pg is None:
        return
    _State.pg = None
    try:
        pg.destroy()
    finally:
        if store is not None and _State.own_store and not _is_hosted(store):
            store.close()
        if _State.file_path:
            try:
                os.unlink(_State.file_path)
            except OSError:
                pass
            _State.file_path = None
        _State.store = None
        _State.backend = None
        _State.rank = _State.world_size = -1


def default_pg():
    """The backend process group of the default group (raises if not initialized)."""
    return _require()


def default_timeout_ms():
    return int(_State.timeout_s * 1000)
