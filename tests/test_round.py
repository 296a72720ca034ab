"""The rendezvous round (pyddp/_round.py): every rank of one start agrees on one key
prefix through the store, whatever an earlier round left there and however late each
rank starts, at several world sizes; a rank that never starts is named in a timeout.

Ranks are threads of this process, each with its own store client to one server (the
agent's store of a torchrun job, with a previous round's keys still in it)."""
import threading
import time
import uuid
from datetime import timedelta

import pytest

from pyddp import _C
from pyddp import _round
from pyddp.store import TCPStore


def _server():
    return TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))


def _start(port, base, ranks, world, delays, out, timeout_s=20):
    def one(r):
        time.sleep(delays.get(r, 0))
        c = TCPStore("127.0.0.1", port, timeout=timedelta(seconds=30))
        try:
            out[r] = _round.agree(c, base, r, world, timeout_s)
        except Exception as e:  # noqa: BLE001  (the test reads it)
            out[r] = e
        finally:
            c.close()
    ts = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in ts:
        t.start()
    return ts


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_every_rank_agrees_whatever_the_order(world):
    server = _server()
    try:
        for delays in ({}, {0: 0.3}, {r: 0.05 * (world - r) for r in range(world)}):
            out = {}
            base = f"/t/{uuid.uuid4().hex}"
            for t in _start(server.port, base, range(world), world, delays, out):
                t.join(30)
            assert len(set(out.values())) == 1 and len(out) == world, out
            assert all(isinstance(v, str) for v in out.values()), out
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
        first = out[0]
        # a dead process's hello for rank 1, as a killed earlier round leaves it
        server.set(f"{base}/hello/1", uuid.uuid4().hex)
        out2 = {}
        ts = _start(server.port, base, range(world), world, {1: 1.0}, out2)
        for t in ts:
            t.join(30)
        assert len(set(out2.values())) == 1 and len(out2) == world, out2
        assert out2[0] != first
    finally:
        server.close()


def test_a_rank_that_never_starts_is_named():
    server = _server()
    try:
        server.set("/j/hello/2", "a-dead-process")
        out = {}
        for t in _start(server.port, "/j", [0, 1], 3, {}, out, timeout_s=1.5):
            t.join(30)
        assert isinstance(out[0], _C.DistTimeoutError), out
        assert "ranks [2]" in str(out[0]), out[0]
        assert isinstance(out[1], _C.DistTimeoutError), out
    finally:
        server.close()
