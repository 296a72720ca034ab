"""The store a world group rendezvouses through: connecting to one that another process
hosts (with progress lines while it is unreachable), hosting one, the ``file://``
rendezvous (rank 0 hosts a store and writes its address into the file), and the etcd
cluster of a job launched with ``--rdzv-backend=pyddp --rdzv-endpoint=etcd://...``.

Stores this process hosts live as long as the process, like torchrun's agent store: a
peer may still be reading from one when this rank destroys its group or fails its init,
and a later init with the same address reuses the server instead of racing its peers to
rebind the port. After a failed init the hosting rank lingers (at most 10 s) until the
others have read the error from the store.
"""
import os
import re
import sys
import time
import uuid
from datetime import timedelta

from . import _C, _env
from ._group import _State
from .store import EtcdStore, TCPStore

# Stores this process hosts, by (method, port or path) (see the module's docstring).
_hosted = {}

def _warn_slow(what, addr, port, elapsed, total):
    print(f"pyddp: rank {_State.rank}: still trying to reach the store at {addr}:{port} "
          f"after {elapsed:.0f} s ({what}); will keep trying for {total - elapsed:.0f} s more. "
          f"Check that the rank-0 node is up, MASTER_ADDR/MASTER_PORT are right, and that a "
          f"firewall or cloud security-group rule allows TCP to port {port} between the "
          f"nodes.", file=sys.stderr, flush=True)


def _connect_store(addr, port, timeout_s, world_size=None, auth=None):
    """Connect to a store server that someone else hosts, warning on stderr every 15 s
    while it is unreachable and failing with DistNetworkError at the timeout."""
    deadline = time.monotonic() + timeout_s
    start = time.monotonic()
    while True:
        left = deadline - time.monotonic()
        try:
            store = TCPStore(addr, port, is_master=False,
                             timeout=_td(max(min(left, 15.0), 0.001)), auth=auth)
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
    return timedelta(seconds=s)


def _file_store(path, rank, timeout_s):
    """file:// rendezvous: rank 0 hosts a store on an ephemeral port and writes
    "host port nonce" into the file (atomically); the others read it and connect,
    re-reading when they find a stale file from an earlier run."""
    if rank == 0:
        adv = _host_address()
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
        except (OSError, ValueError, _C.DistStoreError) as e:
            last = str(e) or type(e).__name__
        time.sleep(0.1)
    raise _C.DistTimeoutError(f"rank {rank}: file rendezvous through {path} did not complete "
                              f"within {timeout_s:.0f} s ({last}). Check that every rank uses "
                              f"the same path on shared storage and that rank 0 started.")


def _primary_address():
    """The address of the interface of the default route (IPv4), else loopback."""
    try:
        return _C.route_addr("8.8.8.8")   # no packet is sent: only a route lookup
    except _C.DistError:
        return "127.0.0.1"


def _host_address():
    """The address peers reach a store at that this process hosts and announces itself
    (file://, torch's non-TCP stores): PYDDP_SOCKET_IFNAME's interface's when set, else
    the default route's (loopback without one)."""
    return _env.advertise_address(None) if _env.socket_ifname() else _primary_address()


def etcd_endpoint():
    """The etcd members of the job's store (``etcd://...``) when this process is a
    worker of ``--rdzv-backend=pyddp --rdzv-endpoint=etcd://...``, else None."""
    where = _C.setting_text("PYDDP_RDZV_STORE") or ""
    return where if where.startswith(("etcd://", "http://", "https://")) else None


def job_namespace(run_id):
    """The etcd key namespace of the job with torchrun run id run_id."""
    return f"pyddp/{run_id}"


def make_store(rdzv, timeout_s):
    """The store this process rendezvouses through for rdzv (``_env.Rendezvous``): the
    job's etcd cluster (a worker of pyddp's rendezvous on etcd), the file:// store,
    torchrun's agent store (a client), or, without an agent, rank 0's server (hosted
    here on rank 0, a client elsewhere)."""
    etcd = etcd_endpoint()
    if etcd is not None:
        return EtcdStore(etcd, job_namespace(rdzv.run_id), _td(timeout_s))
    if rdzv.method == "file":
        return _file_store(rdzv.file_path, rdzv.rank, timeout_s)
    if rdzv.use_agent_store:
        return _connect_store(rdzv.master_addr, rdzv.master_port, timeout_s)
    if rdzv.rank != 0:   # rank 0 hosts pyddp's server: authenticate with it if a token is set
        return _connect_store(rdzv.master_addr, rdzv.master_port, timeout_s, auth=True)
    # rank 0 hosts the store on MASTER_PORT (plain env:// launch, or tcp://)
    return _hosted_store(("tcp", rdzv.master_port), rdzv.master_addr, rdzv.master_port,
                         timeout_s)


def _hosted_store(key, host, port, timeout_s):
    """The store this process hosts for key, started on first use (see _hosted)."""
    store = _hosted.get(key)
    if store is None:
        store = TCPStore(host, port, is_master=True, timeout=_td(timeout_s))
        _hosted[key] = store
    else:
        store.set_timeout(_td(timeout_s))
    return store


def _is_hosted(store):
    return any(s is store for s in _hosted.values())


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
