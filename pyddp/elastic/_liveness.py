"""Telling a paused rank from a dead one during an in-place membership change.

Each rank of an in-place job holds a listening socket that nothing but probes connect
to (``liveness_listener``), and publishes its address for each membership epoch. While
a change waits for a rank's answer, the others connect to it (``probe``): a process
that is stopped (SIGSTOP, a long GC pause, a stalled disk) still has its kernel
complete the handshake, so it is alive and waited for, up to PYDDP_PEER_DEAD_S; a dead
process's port refuses at once, and a vanished host's does not answer: both are gone.
The watcher thread closes the probes' connections twice a second (``drain``).
"""
import logging
import socket

from .. import _C, _env
from ._live import get_optional

log = logging.getLogger("pyddp")


def peer_dead_s():
    return float(_C.setting("PYDDP_PEER_DEAD_S"))


def liveness_listener():
    """(socket, "host:port"): a listening socket whose only job is to be connectable
    while this process lives, even stopped (its kernel completes the handshake), and to
    refuse once it died. In PYDDP_PORT_RANGE when set (one more port per rank), else
    an ephemeral port; advertised at the address this rank's data links use. None when
    no port can be had (the rank is then waited for PYDDP_ELASTIC_SETTLE_S)."""
    from .._group import _State
    from ._torchworld import world_group
    try:
        host = world_group()._advertise     # the address this rank's data links use
    except _C.DistError:
        host = None
    host = host or _env.advertise_address(_State.master_addr)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    lo, hi = _env.port_range()
    for port in (range(lo, hi + 1) if lo else [0]):
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            s.bind(("", port))
            s.listen(128)
            s.setblocking(False)
        except OSError:
            s.close()
            continue
        p = s.getsockname()[1]
        return s, (f"[{host}]:{p}" if family == socket.AF_INET6 else f"{host}:{p}")
    log.warning("pyddp: elastic: no port for the liveness listener (PYDDP_PORT_RANGE "
                "full?): a paused rank is waited for PYDDP_ELASTIC_SETTLE_S only")
    return None


def drain(live):
    """Close the probes that arrived (the watcher does it twice a second)."""
    if live is None:
        return
    while True:
        try:
            conn, _ = live[0].accept()
        except (BlockingIOError, OSError):
            return
        conn.close()


def probe(st, key):
    """"alive", "gone" or "unknown" for the rank that published its liveness address
    under key."""
    raw = get_optional(st, key, 0.05)
    if raw is None:
        return "unknown"
    host, _, port = raw.decode().rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=0.5):
            return "alive"
    except ConnectionRefusedError:
        return "gone"
    except OSError:
        return "gone"       # no answer within 0.5 s: the host or the network is gone
