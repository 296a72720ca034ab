"""The rendezvous round (csrc/core/ddp_comm_round.c, described in pyddp/_round.py):
every rank of one start agrees on one key prefix through the store, in the rendezvous
itself, whatever an earlier round left there and however late
each rank starts, at several world sizes; the group it makes works (an all-reduce
against the ranks' sum); a rank that never starts is named in a timeout.

Ranks are threads of this process, each with its own store client to one server (the
agent's store of a torchrun job, with a previous round's keys still in it), each making
a ``_C.ProcessGroup`` with ``agree_round=True``."""
import threading
import time
import uuid
from datetime import timedelta

import numpy as np
import pytest

from pyddp import _C
from pyddp._version import __version__
from pyddp.store import TCPStore


def _server():
    return TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))


def _start(port, base, ranks, world, delays, out, timeout_s=20):
    """Rank r (after delays[r] s) makes the group; out[r] = its prefix, and the sum of
    an all-reduce of r + 1 over the group, or the exception."""
    def one(r):
        time.sleep(delays.get(r, 0))
        c = TCPStore("127.0.0.1", port, timeout=timedelta(seconds=30))
        pg = None
        try:
            pg = _C.ProcessGroup(c._client, r, world, base, "127.0.0.1", "", 0, 0,
                                 int(timeout_s * 1000), __version__, f"host-{r}", True)
            x = np.array([r + 1.0])
            pg.run(_C.COLL_ALLREDUCE, x, _C.OP_SUM, 0, int(timeout_s * 1000))
            out[r] = (pg.prefix, float(x[0]))
        except Exception as e:  # noqa: BLE001  (the test reads it)
            out[r] = e
        finally:
            if pg is not None:
                pg.destroy()
            c.close()
    ts = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in ts:
        t.start()
    return ts


def _agreed(out, world, base):
    """The one prefix every rank got, checked: under base, and the group's sum right."""
    assert len(out) == world and all(isinstance(v, tuple) for v in out.values()), out
    assert len({v[0] for v in out.values()}) == 1, out
    assert all(v[1] == world * (world + 1) / 2 for v in out.values()), out
    prefix = out[0][0]
    assert prefix.startswith(base + "/"), prefix
    return prefix


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_every_rank_agrees_whatever_the_order(world):
    server = _server()
    try:
        for delays in ({}, {0: 0.3}, {r: 0.05 * (world - r) for r in range(world)}):
            out = {}
            base = f"/t/{uuid.uuid4().hex}"
            for t in _start(server.port, base, range(world), world, delays, out):
                t.join(30)
            _agreed(out, world, base)
    finally:
        server.close()


@pytest.mark.parametrize("world", [2, 4])
def test_an_earlier_rounds_keys_are_never_this_rounds(world):
    """A previous round wrote every key (and its rank 1 hello stays there as a dead
    process's); the new rank 1 starts 1 s after the others: all still agree, on a
    round that is not the earlier one."""
    server = _server()
    base = "/pyddp/job/0"
    try:
        out = {}
        for t in _start(server.port, base, range(world), world, {}, out):
            t.join(30)
        first = _agreed(out, world, base)
        # a dead process's hello for rank 1, as a killed earlier round leaves it
        # (the Python client puts "/" before a key: the core's keys are read without it)
        server.set(f"{base[1:]}/hello/1", f"ver={__version__};nonce={uuid.uuid4().hex[:16]}")
        out2 = {}
        ts = _start(server.port, base, range(world), world, {1: 1.0}, out2)
        for t in ts:
            t.join(30)
        assert _agreed(out2, world, base) != first
    finally:
        server.close()


def test_a_rank_that_never_starts_is_named():
    server = _server()
    try:
        server.set("j/hello/2", "nonce=a-dead-process")   # the core's key /j/hello/2
        out = {}
        for t in _start(server.port, "/j", [0, 1], 3, {}, out, timeout_s=3):
            t.join(30)
        assert isinstance(out[0], _C.DistTimeoutError), out
        assert "ranks [2]" in str(out[0]), out[0]
        assert isinstance(out[1], _C.DistTimeoutError), out
    finally:
        server.close()
