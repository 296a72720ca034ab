"""Where a process finds its rank, world size and store: torchrun's environment,
``tcp://`` and ``file://`` init methods, and the settings pyddp's Python layer parses
itself from ``PYDDP_*`` variables (PYDDP_TIMEOUT, PYDDP_PORT_RANGE, PYDDP_SOCKET_IFNAME).

Nothing here talks to the network. Every check that can fail does so here, before any
connection is attempted, with an error naming the variable or argument at fault.
Every ``PYDDP_*`` variable is declared in the C core's settings table
(``csrc/core/ddp_settings.c``, listed in docs/env.md) and read through it: the core's
parse-once values through ``_C.setting``, the text of the ones parsed here, at each use,
through ``_C.setting_text`` (tests/test_layers.py checks that nothing reads one
otherwise). The launcher's variables (RANK, MASTER_ADDR, TORCHELASTIC_*) are read here
directly.
"""
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional
from urllib.parse import parse_qs, urlparse

from . import _C

DEFAULT_TIMEOUT = timedelta(minutes=30)   # torch.distributed's default_pg_timeout


@dataclass
class Rendezvous:
    """Everything init_process_group needs to know before it connects."""
    rank: int
    world_size: int
    method: str                  # "env", "tcp" or "file"
    master_addr: Optional[str]   # store host (env/tcp)
    master_port: Optional[int]
    file_path: Optional[str]     # file:// path
    use_agent_store: bool        # torchrun's agent already hosts the store
    run_id: str
    restart_count: int


def _bad(msg):
    return _C.DistValueError(msg)


def _env_int(name, required=True):
    v = os.environ.get(name)
    if v is None or v == "":
        if required:
            raise _bad(f"environment variable {name} is not set. Launch with torchrun, or set "
                       f"RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT yourself (or pass "
                       f"rank= and world_size= to init_process_group).")
        return None
    try:
        return int(v)
    except ValueError:
        raise _bad(f"environment variable {name}={v!r} is not an integer") from None


def _check_rank(rank, world_size, rank_src="rank", ws_src="world_size"):
    if world_size < 1:
        raise _bad(f"{ws_src}={world_size} must be at least 1")
    if not 0 <= rank < world_size:
        raise _bad(f"{rank_src}={rank} is out of range for {ws_src}={world_size} "
                   f"(must be 0 <= rank < world_size)")


def _check_port(port, src):
    if not 0 < port < 65536:
        raise _bad(f"{src}={port} is not a valid TCP port (1-65535)")


def resolve(init_method, rank, world_size) -> Rendezvous:
    """Read the rendezvous settings for init_method (None means ``env://``)."""
    init_method = init_method or "env://"
    url = urlparse(init_method)
    run_id, restart = elastic_attempt()
    if url.scheme == "env":
        if rank is None or rank < 0:
            rank = _env_int("RANK")
            rank_src = "RANK"
        else:
            rank_src = "rank"
        if world_size is None or world_size < 0:
            world_size = _env_int("WORLD_SIZE")
            ws_src = "WORLD_SIZE"
        else:
            ws_src = "world_size"
        _check_rank(rank, world_size, rank_src, ws_src)
        addr = os.environ.get("MASTER_ADDR")
        if not addr:
            raise _bad("environment variable MASTER_ADDR is not set: set it to the address of "
                       "the rank-0 node (torchrun sets it for you)")
        port = _env_int("MASTER_PORT")
        _check_port(port, "MASTER_PORT")
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "False") == "True"
        return Rendezvous(rank, world_size, "env", addr, port, None, agent, run_id, restart)
    if url.scheme == "tcp":
        q = parse_qs(url.query)
        if (rank is None or rank < 0) and "rank" in q:
            rank = int(q["rank"][0])
        if (world_size is None or world_size < 0) and "world_size" in q:
            world_size = int(q["world_size"][0])
        if rank is None or rank < 0 or world_size is None or world_size < 0:
            raise _bad(f"init_method={init_method!r} needs rank= and world_size= (as "
                       f"arguments or ?rank=..&world_size=.. in the URL)")
        _check_rank(rank, world_size)
        if not url.hostname or not url.port:
            raise _bad(f"init_method={init_method!r} must look like tcp://host:port")
        _check_port(url.port, "init_method port")
        return Rendezvous(rank, world_size, "tcp", url.hostname, url.port, None, False,
                          run_id, restart)
    if url.scheme == "file":
        if rank is None or rank < 0 or world_size is None or world_size < 0:
            raise _bad(f"init_method={init_method!r} needs rank= and world_size=")
        _check_rank(rank, world_size)
        path = url.path
        if not path:
            raise _bad(f"init_method={init_method!r} has no path; use file:///shared/dir/file")
        return Rendezvous(rank, world_size, "file", None, None, path, False, run_id, restart)
    raise _bad(f"init_method={init_method!r}: supported schemes are env://, tcp://host:port "
               f"and file:///path")


def seconds(t) -> float:
    """A timeout given as a timedelta or a number of seconds, in seconds."""
    return t.total_seconds() if hasattr(t, "total_seconds") else float(t)


def elastic_attempt():
    """(run id, restart count) of torchrun's attempt: TORCHELASTIC_RUN_ID ("none" when
    unset) and TORCHELASTIC_RESTART_COUNT (0 when unset). The run id is part of pyddp's
    key prefix (/pyddp/<run id>/...); the restart count is not part of a group's prefix
    (elastic nodes count their restarts apart, so the ranks agree on a round through the
    store instead: _round); only the doctor's keys use it."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none") or "none"
    return run_id, _env_int("TORCHELASTIC_RESTART_COUNT", required=False) or 0


def timeout_seconds(timeout) -> float:
    """The effective timeout: the argument, else PYDDP_TIMEOUT (seconds), else 30 min."""
    if timeout is not None:
        if isinstance(timeout, timedelta):
            secs = timeout.total_seconds()
        else:
            secs = float(timeout)
        if secs <= 0:
            raise _bad(f"timeout={timeout!r} must be positive")
        return secs
    env = _C.setting_text("PYDDP_TIMEOUT")
    if env:
        try:
            secs = float(env)
        except ValueError:
            raise _bad(f"PYDDP_TIMEOUT={env!r} is not a number of seconds") from None
        if secs <= 0:
            raise _bad(f"PYDDP_TIMEOUT={env!r} must be positive")
        return secs
    return DEFAULT_TIMEOUT.total_seconds()


def port_range():
    """PYDDP_PORT_RANGE="lo-hi" for data connections, or (0, 0) for ephemeral ports."""
    v = (_C.setting_text("PYDDP_PORT_RANGE") or "").strip()
    if not v:
        return 0, 0
    try:
        lo, hi = (int(x) for x in v.split("-", 1))
    except ValueError:
        raise _bad(f"PYDDP_PORT_RANGE={v!r} must look like 40000-40100") from None
    if not (0 < lo <= hi < 65536):
        raise _bad(f"PYDDP_PORT_RANGE={v!r} must satisfy 0 < lo <= hi < 65536")
    return lo, hi


def _is_loopback(addr) -> bool:
    try:
        import ipaddress
        return ipaddress.ip_address(addr.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def spans_hosts() -> bool:
    """Whether the job has ranks on other hosts, as the launcher tells: more ranks than
    this node runs (WORLD_SIZE > LOCAL_WORLD_SIZE), or more than one node's agent
    (torchrun's GROUP_WORLD_SIZE)."""
    def num(name):
        try:
            return int(os.environ.get(name, "") or 0)
        except ValueError:
            return 0
    world, local = num("WORLD_SIZE"), num("LOCAL_WORLD_SIZE")
    return num("GROUP_WORLD_SIZE") > 1 or (local > 0 and world > local)


def default_route_address() -> Optional[str]:
    """The address of the interface of the default route, or None if there is none (a
    route lookup toward a public address: no packet is sent)."""
    for probe in ("8.8.8.8", "2001:4860:4860::8888"):
        try:
            addr = _C.route_addr(probe)
        except _C.DistError:
            continue
        if not _is_loopback(addr):
            return addr
    return None


def advertise_address(master_addr: Optional[str]) -> str:
    """The address peers should use to reach this process.

    PYDDP_SOCKET_IFNAME names an interface to use. Otherwise the local address that
    routes to the store host, which is right on multi-homed VMs where the host name
    resolves to 127.0.1.1. When that address is loopback (the store's name resolves to
    127.0.1.1 here, as with torchrun's c10d form on many cloud images) but the job spans
    hosts, loopback would send every peer on another host back to itself: the address of
    the default route's interface is used instead, and without a default route init
    fails (DistValueError) saying to pass --local-addr or set PYDDP_SOCKET_IFNAME.
    Loopback is advertised only to a job on one host.
    """
    ifname = socket_ifname()
    if ifname:
        return _C.ifname_addr(ifname)
    addr = None
    if master_addr:
        try:
            addr = _C.route_addr(master_addr)
        except _C.DistError:
            pass
    if addr is not None and not _is_loopback(addr):
        return addr
    if not spans_hosts():
        return addr or "127.0.0.1"
    fallback = default_route_address()
    if fallback is not None:
        return fallback
    raise _bad(f"the address that routes to MASTER_ADDR={master_addr!r} is "
               f"{addr or 'none'} (loopback), and this host has no default route, but the "
               f"job spans hosts (WORLD_SIZE={os.environ.get('WORLD_SIZE')}, "
               f"LOCAL_WORLD_SIZE={os.environ.get('LOCAL_WORLD_SIZE')}): peers on other "
               f"hosts cannot reach this rank at a loopback address. Pass --local-addr=IP "
               f"(this node's private address) to torchrun, set PYDDP_SOCKET_IFNAME to the "
               f"interface of the private network, or make MASTER_ADDR's name resolve to "
               f"that address")


def socket_ifname() -> Optional[str]:
    """PYDDP_SOCKET_IFNAME: the interface whose address this rank advertises, or None
    (unset or empty: the address is chosen by the route to the store's host)."""
    return _C.setting_text("PYDDP_SOCKET_IFNAME") or None


def interface_of(addr) -> str:
    """The name of the interface that holds address addr ('' if none does), as
    PYDDP_SOCKET_IFNAME would name it. Interfaces without an address are skipped."""
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:
        return ""
    for n in names:
        try:
            if _C.ifname_addr(n) == addr:
                return n
        except (_C.DistError, ValueError):   # no address: DistValueError
            continue
    return ""


def host_identity() -> str:
    """Ranks with equal identities share memory (same kernel boot, host name and network
    namespace), so they may talk through shared memory instead of TCP."""
    parts = []
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append("noboot")
    parts.append(socket.gethostname())
    try:
        parts.append(os.readlink("/proc/self/ns/net"))
    except OSError:
        pass
    return "|".join(parts).replace(";", ",")


def local_rank() -> int:
    """LOCAL_RANK from torchrun (0 when unset)."""
    return _env_int("LOCAL_RANK", required=False) or 0


def local_world_size() -> int:
    """LOCAL_WORLD_SIZE from torchrun (1 when unset)."""
    return _env_int("LOCAL_WORLD_SIZE", required=False) or 1
