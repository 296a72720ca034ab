"""pyddp.TCPStore against torch.distributed.TCPStore, in both directions.

torch is the reference: a pyddp server must serve torch clients and a pyddp client must
work against both torch servers (libuv and classic), with the same keys visible to each
side. Also: wait timeouts that leave the connection usable, a master waiting for its
workers, and connection failures that name host:port (the server against clients that
misbehave is tests/test_store_server.py's). Every scenario runs in a thread joined with
a timeout, on top of the stores' own timeouts.
"""
import socket
import threading
import time
from datetime import timedelta

import pytest

from pyddp import _C
from pyddp.store import TCPStore

td = pytest.importorskip("torch.distributed")

T = timedelta(seconds=10)
SHORT = timedelta(milliseconds=300)
MAGIC = 0x3C85F7CE


def bounded(fn, seconds=60):
    """Run fn in a thread; fail (instead of hanging) if it does not finish in time,
    and re-raise what it raised."""
    box = {}

    def body():
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            box["error"] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn.__name__} did not finish within {seconds} s"
    if "error" in box:
        raise box["error"]
    return box.get("result")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_master(use_libuv, world_size=None, port=0):
    return td.TCPStore("127.0.0.1", port, world_size, True, T, use_libuv=use_libuv)


def exercise(writer, reader, ns):
    """Operations through `writer`, checked through `reader` (one pyddp, one torch),
    on keys under the namespace ns."""
    writer.set(ns + "a", "hello")
    assert reader.get(ns + "a") == b"hello"
    writer.set(ns + "bin", b"\x00\xff\x01")
    assert reader.get(ns + "bin") == b"\x00\xff\x01"
    assert writer.add(ns + "ctr", 5) == 5
    assert reader.add(ns + "ctr", -2) == 3
    assert writer.get(ns + "ctr") == b"3"          # counters are ASCII decimal on the wire
    assert writer.check([ns + "a", ns + "ctr"]) is True
    assert reader.check([ns + "a", ns + "missing"]) is False
    # compare_set: absent+empty stores; mismatch keeps; match swaps; absent+nonempty
    assert writer.compare_set(ns + "cs", "", "x") == b"x"
    assert writer.compare_set(ns + "cs", "y", "z") == b"x"
    assert writer.compare_set(ns + "cs", "x", "z") == b"z"
    assert reader.get(ns + "cs") == b"z"
    assert writer.compare_set(ns + "cs2", "e", "d") == b"e"
    assert reader.check([ns + "cs2"]) is False
    writer.append(ns + "ap", "ab")
    writer.append(ns + "ap", b"cd")
    # APPEND has no reply: a round trip on the writer's own connection orders it before
    # the reader's request (the server serves each connection in order, not across them)
    assert writer.get(ns + "ap") == b"abcd"
    assert reader.get(ns + "ap") == b"abcd"
    assert writer.num_keys() == reader.num_keys()
    n = writer.num_keys()
    assert writer.delete_key(ns + "a") is True
    assert writer.delete_key(ns + "a") is False
    assert reader.check([ns + "a"]) is False
    assert reader.num_keys() == n - 1
    # wait woken by the other side
    t = threading.Timer(0.2, lambda: reader.set(ns + "late", "1"))
    t.start()
    writer.wait([ns + "late", ns + "ctr"], T)
    t.join()
    assert writer.get(ns + "late") == b"1"


def wait_timeout_then_reuse(store, expect_exc):
    t0 = time.monotonic()
    with pytest.raises(expect_exc) as ei:
        store.wait(["never"], SHORT)
    assert 0.25 <= time.monotonic() - t0 < 5
    store.set("after_timeout", "ok")        # the same connection still works
    assert store.get("after_timeout") == b"ok"
    return ei.value


def test_pyddp_server_torch_client():
    def scenario():
        master = TCPStore("127.0.0.1", 0, is_master=True, timeout=T)
        try:
            client = td.TCPStore("127.0.0.1", master.port, is_master=False, timeout=T)
            exercise(master, client, "p1/")
            exercise(client, master, "p2/")
            wait_timeout_then_reuse(client, Exception)
            # torch clients also use MULTI_SET / MULTI_GET
            client.multi_set(["m1", "m2"], ["1", "2"])
            assert client.multi_get(["m1", "m2"]) == [b"1", b"2"]
            assert master.get("m2") == b"2"
            del client
        finally:
            master.close()
    bounded(scenario)


@pytest.mark.parametrize("use_libuv", [True, False])
def test_torch_server_pyddp_client(use_libuv):
    def scenario():
        master = torch_master(use_libuv)
        client = TCPStore("127.0.0.1", master.port, timeout=T)
        try:
            exercise(client, master, "p2/")
            exercise(master, client, "p1/")
            err = wait_timeout_then_reuse(client, _C.DistTimeoutError)
            # torch raises DistStoreError for store timeouts; pyddp code catches
            # TimeoutError: the class is both
            assert isinstance(err, TimeoutError) and isinstance(err, _C.DistStoreError)
            assert type(err) is _C.DistStoreTimeoutError
            assert "'/never'" in str(err) and f"127.0.0.1:{master.port}" in str(err)
            client.set_timeout(SHORT)
            with pytest.raises(_C.DistStoreError) as ei:
                client.get("never")   # uses the store's timeout
            assert isinstance(ei.value, TimeoutError)
            client.set_timeout(T)
            assert client.get("after_timeout") == b"ok"
        finally:
            client.close()
    bounded(scenario)


def test_world_size_handshake_both_directions():
    def pyddp_master():
        port = free_port()
        box = {}
        th = threading.Thread(target=lambda: box.setdefault(
            "m", TCPStore("127.0.0.1", port, world_size=2, is_master=True, timeout=T)))
        th.start()
        worker = td.TCPStore("127.0.0.1", port, 2, False, T)
        th.join(20)
        assert not th.is_alive() and "m" in box, "pyddp master did not see the torch worker"
        assert box["m"]._client.get(b"init/") == b"2"   # torch's unprefixed counter
        worker.set("y", "2")
        assert box["m"].get("y") == b"2"
        del worker
        box["m"].close()

    def torch_master_pyddp_worker():
        port = free_port()
        box = {}
        th = threading.Thread(target=lambda: box.setdefault("m", torch_master(True, 2, port)))
        th.start()
        worker = TCPStore("127.0.0.1", port, world_size=2, timeout=T)
        th.join(20)
        assert not th.is_alive() and "m" in box, "torch master did not see the pyddp worker"
        worker.set("x", "1")
        assert box["m"].get("x") == b"1"
        worker.close()

    bounded(pyddp_master)
    bounded(torch_master_pyddp_worker)


def test_master_times_out_waiting_for_workers():
    def scenario():
        t0 = time.monotonic()
        with pytest.raises(_C.DistStoreTimeoutError, match="1 of 2 joined"):
            TCPStore("127.0.0.1", 0, world_size=2, is_master=True, timeout=SHORT)
        assert time.monotonic() - t0 < 5
    bounded(scenario)


def test_connect_to_unused_port_fails_naming_host_port():
    def scenario():
        port = free_port()
        t0 = time.monotonic()
        with pytest.raises(_C.DistNetworkError) as ei:
            TCPStore("127.0.0.1", port, timeout=timedelta(milliseconds=500))
        assert 0.45 <= time.monotonic() - t0 < 5
        assert isinstance(ei.value, ConnectionError)
        assert f"127.0.0.1:{port}" in str(ei.value)
        assert "MASTER_ADDR" in str(ei.value)
    bounded(scenario)


def test_master_port_in_use():
    def scenario():
        first = TCPStore("127.0.0.1", 0, is_master=True, timeout=T)
        try:
            with pytest.raises(_C.DistNetworkError, match="in use"):
                TCPStore("127.0.0.1", first.port, is_master=True, timeout=T)
        finally:
            first.close()
    bounded(scenario)


def test_argument_errors():
    def scenario():
        with TCPStore("127.0.0.1", 0, is_master=True, timeout=T) as s:
            with pytest.raises(TypeError):
                s.set("k", 5)
            with pytest.raises(TypeError):
                s.add("k", "1")
            with pytest.raises(TypeError):
                s.wait("k")
            with pytest.raises(TypeError):
                s.set_timeout(5)
            with pytest.raises(ValueError):
                s.set_timeout(timedelta(seconds=-1))
            s.set_timeout(timedelta(seconds=2))
            assert s.timeout == timedelta(seconds=2)
            assert s.host == "127.0.0.1" and s.port > 0
        with pytest.raises(ValueError):
            TCPStore("127.0.0.1", 0, is_master=False)
        with pytest.raises(ValueError):
            TCPStore("127.0.0.1", 70000, is_master=False)
    bounded(scenario)


# ---- raw sockets against the pyddp server ---------------------------------

def test_concurrent_clients_pyddp_and_torch():
    def scenario():
        master = TCPStore("127.0.0.1", 0, is_master=True, timeout=T)
        errors = []

        def work(make):
            try:
                s = make()
                s.wait(["go"], T)
                for _ in range(100):
                    s.add("shared", 1)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        makers = [lambda: TCPStore("127.0.0.1", master.port, timeout=T)] * 3 + \
                 [lambda: td.TCPStore("127.0.0.1", master.port, is_master=False, timeout=T)] * 2
        threads = [threading.Thread(target=work, args=(m,)) for m in makers]
        for t in threads:
            t.start()
        time.sleep(0.2)
        master.set("go", "1")
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors
        assert int(master.get("shared")) == 100 * len(makers)
        master.close()
    bounded(scenario)


def test_close_from_another_thread_wakes_a_waiting_get():
    """close() on one thread while another is blocked in get(): the get fails at once
    with an error saying the store was closed (no crash, no wait for the timeout), and
    the server keeps serving other clients."""
    def scenario():
        master = TCPStore("127.0.0.1", 0, is_master=True, timeout=T)
        client = TCPStore("127.0.0.1", master.port, timeout=timedelta(seconds=60))
        try:
            box = {}

            def getter():
                t0 = time.monotonic()
                try:
                    client.get("never")
                except BaseException as e:  # noqa: BLE001 - checked below
                    box["error"] = e
                box["seconds"] = time.monotonic() - t0

            th = threading.Thread(target=getter)
            th.start()
            time.sleep(0.3)
            assert th.is_alive(), "get returned before the key existed"
            t0 = time.monotonic()
            client.close()
            th.join(10)
            assert not th.is_alive()
            assert time.monotonic() - t0 < 2
            err = box["error"]
            assert type(err) is _C.DistStoreError, repr(err)
            assert not isinstance(err, (TimeoutError, ConnectionError)), repr(err)
            assert "was closed" in str(err) and f"127.0.0.1:{master.port}" in str(err)
            with pytest.raises(_C.DistStoreError, match="not connected"):
                client.get("never")
            client.close()                      # idempotent
            master.set("still", "serving")
            assert master.get("still") == b"serving"
        finally:
            client.close()
            master.close()
    bounded(scenario)


def test_multi_get_on_pyddp_and_torch_servers():
    """TCPStore.multi_get: the values in the keys' order, against pyddp's server and
    torch's; a key that never comes is a timeout, and the client still works. Then
    multi_set, and its bad arguments refused before anything is sent."""
    import torch.distributed as td
    for torch_server in (False, True):
        srv = (td.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10),
                           wait_for_workers=False) if torch_server else
               TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False))
        c = TCPStore("127.0.0.1", srv.port, timeout=timedelta(seconds=10))
        c.set("a", b"1")
        c.set("b", "two")
        assert c.multi_get(["b", "a", "b"]) == [b"two", b"1", b"two"]
        assert c.multi_get([]) == []
        c.set_timeout(timedelta(milliseconds=300))
        with pytest.raises(_C.DistTimeoutError, match="never"):
            c.multi_get(["a", "never"])
        c.set_timeout(timedelta(seconds=10))
        assert c.get("a") == b"1"
        # multi_set: one request, str or bytes values, the last of a repeated key wins
        c.multi_set(["m1", "m2", "m1"], ["x", b"y", "z"])
        assert c.multi_get(["m1", "m2"]) == [b"z", b"y"]
        c.multi_set([], [])
        with pytest.raises(_C.DistValueError, match="2 keys but 1 values"):
            c.multi_set(["m1", "m2"], ["q"])
        with pytest.raises(_C.DistTypeError):
            c.multi_set(["m1"], [3])
        assert c.get("m1") == b"z"
        c.close()
        if not torch_server:
            srv.close()
