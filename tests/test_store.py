"""pyddp.TCPStore against torch.distributed.TCPStore, in both directions.

torch is the reference: a pyddp server must serve torch clients and a pyddp client must
work against both torch servers (libuv and classic), with the same keys visible to each
side. Also: wait timeouts that leave the connection usable, a master waiting for its
workers, raw sockets that send garbage to the pyddp server (which must keep serving
others), and connection failures that name host:port. Every scenario runs in a thread
joined with a timeout, on top of the stores' own timeouts.
"""
import socket
import struct
import threading
import time
from datetime import timedelta

import pytest

import launch
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

def wire_str(b):
    return struct.pack("<Q", len(b)) + b


def raw(port, validate=True):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    if validate:
        s.sendall(struct.pack("<BI", 0, MAGIC))
    return s


def dropped(s):
    """True if the server closes s (EOF or reset) within the socket timeout."""
    try:
        while True:
            if s.recv(4096) == b"":
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False
    finally:
        s.close()


def test_server_survives_bad_clients():
    def scenario():
        master = TCPStore("127.0.0.1", 0, is_master=True, timeout=T)
        port = master.port
        try:
            master.set("keep", "safe")
            s = raw(port, validate=False)
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert dropped(s), "garbage first message"
            s = raw(port, validate=False)
            s.sendall(struct.pack("<B", 7))            # GETNUMKEYS without VALIDATE
            assert dropped(s), "no VALIDATE"
            s = raw(port, validate=False)
            s.sendall(struct.pack("<BI", 0, 0x12345678))
            assert dropped(s), "wrong magic"
            s = raw(port)
            s.sendall(bytes([99]))
            assert dropped(s), "unknown query"
            s = raw(port)
            s.sendall(bytes([1]) + struct.pack("<Q", 1 << 62))
            assert dropped(s), "absurd key length"
            s = raw(port)
            s.sendall(bytes([6]) + struct.pack("<Q", (1 << 64) - 1))
            assert dropped(s), "absurd key count"
            # truncated SET, then the client vanishes mid-request
            s = raw(port)
            s.sendall(bytes([1]) + wire_str(b"/trunc") + struct.pack("<Q", 100) + b"partial")
            time.sleep(0.05)
            s.close()
            # pending WAIT, then vanish; a later SET of that key must be harmless
            s = raw(port)
            s.sendall(bytes([6]) + struct.pack("<Q", 1) + wire_str(b"/orphan"))
            time.sleep(0.05)
            s.close()
            # a request sent in pieces is applied once complete
            s = raw(port)
            req = bytes([1]) + wire_str(b"/pieces") + wire_str(b"assembled")
            for i in range(len(req)):
                s.sendall(req[i:i + 1])
                time.sleep(0.002)
            s.sendall(bytes([13]) + struct.pack("<I", 77))      # PING
            s.settimeout(5)
            assert s.recv(4) == struct.pack("<I", 77)
            s.close()

            # half-close after a request: the reply is still delivered
            s = raw(port)
            s.sendall(bytes([13]) + struct.pack("<I", 5))
            s.shutdown(socket.SHUT_WR)
            assert s.recv(4) == struct.pack("<I", 5)
            s.close()

            master.set("orphan", "fine")
            assert master.get("orphan") == b"fine"
            assert master.check(["trunc"]) is False          # never half-applied
            assert master.get("pieces") == b"assembled"
            other = TCPStore("127.0.0.1", port, timeout=T)
            assert other.get("keep") == b"safe"
            other.close()
            tc = td.TCPStore("127.0.0.1", port, is_master=False, timeout=T)
            assert tc.get("keep") == b"safe"
            del tc
        finally:
            master.close()
    bounded(scenario)


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


def fake_server(replies):
    """A listening socket whose thread answers the handshake of each connection, then
    sends that connection's entry of replies (bytes, or None: close it) after its next
    request arrives. Returns (port, thread)."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(4)
    lsock.settimeout(10)

    def serve():
        with lsock:
            for reply in replies:
                conn, _ = lsock.accept()
                with conn:
                    conn.settimeout(10)
                    hello = b""
                    while len(hello) < 10:               # VALIDATE + PING
                        hello += conn.recv(10 - len(hello))
                    conn.sendall(hello[6:10])
                    conn.recv(4096)                      # the request under test
                    if reply is not None:
                        conn.sendall(reply)
                        try:
                            conn.recv(4096)              # until the client gives up
                        except OSError:
                            pass
    th = threading.Thread(target=serve, daemon=True)
    th.start()
    return lsock.getsockname()[1], th


def test_store_failures_raise_dist_store_error():
    """A reply that is garbage, or a server that closes the connection mid-request,
    raises DistStoreError (not a ConnectionError, not a timeout); the connection is
    then unusable, and says so. A connect to a port nobody serves stays a
    DistNetworkError (tested above)."""
    def scenario():
        port, th = fake_server([b"\x07", None])
        for what in ("unexpected reply 7 to WAIT", "closed"):
            s = TCPStore("127.0.0.1", port, timeout=T)
            t0 = time.monotonic()
            with pytest.raises(_C.DistStoreError) as ei:
                s.wait(["k"])
            assert time.monotonic() - t0 < 5
            err = ei.value
            assert not isinstance(err, (TimeoutError, ConnectionError)), repr(err)
            assert what in str(err) and f"127.0.0.1:{port}" in str(err), str(err)
            with pytest.raises(_C.DistStoreError, match="unusable"):
                s.set("k", "v")
            s.close()
        th.join(10)
        assert not th.is_alive()
        # ADD to a key that is not a number: the pyddp server drops the client
        with TCPStore("127.0.0.1", 0, is_master=True, timeout=T) as master:
            master.set("text", "abc")
            with pytest.raises(_C.DistStoreError, match="closed"):
                master.add("text", 1)
    bounded(scenario)


def test_handshake_garbage_is_a_store_error():
    """A port that answers the handshake with garbage is another service: DistStoreError
    naming MASTER_PORT, at once (not a network error retried until the timeout)."""
    def scenario():
        lsock = socket.socket()
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(1)

        def serve():
            conn, _ = lsock.accept()
            with conn:
                conn.recv(10)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
                time.sleep(0.5)
        th = threading.Thread(target=serve, daemon=True)
        th.start()
        t0 = time.monotonic()
        with pytest.raises(_C.DistStoreError, match="MASTER_PORT") as ei:
            TCPStore("127.0.0.1", lsock.getsockname()[1], timeout=T)
        assert not isinstance(ei.value, ConnectionError)
        assert time.monotonic() - t0 < 5
        th.join(10)
        lsock.close()
    bounded(scenario)


# ---- the budget for incomplete requests, held by stalled clients ----------

def stall_large(port, size, sent):
    """A validated connection that starts a SET of a size-byte value, sends `sent` bytes
    of it and stalls. Returns the socket (the server may already have closed it)."""
    s = raw(port)
    s.settimeout(5)
    try:
        s.sendall(bytes([1]) + wire_str(b"/big") + struct.pack("<Q", size) + b"x" * sent)
    except OSError:
        pass                              # evicted while sending: fine for the caller
    return s


def recv_exact(s, n):
    buf = bytearray()
    while len(buf) < n:
        got = s.recv(n - len(buf))
        assert got, f"connection closed after {len(buf)} of {n} bytes"
        buf += got
    return bytes(buf)


def settle(pid, seconds=3.0):
    """Wait (at most `seconds`) until the server's resident size stops growing: it has
    read what the stalled clients sent."""
    last, deadline = -1.0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = launch.proc_status_mib(pid)
        if abs(now - last) < 1:
            return
        last = now


def test_burst_served_while_stalled_clients_hold_the_budget():
    """40 connections stall part-way through 60 MiB values, holding the default 256 MiB
    budget for incomplete requests, and more keep arriving (each evicting a stalled one,
    as a client that reconnects after its eviction would); another client then sends
    50,000 small SETs in one burst (a large job's rendezvous). Every SET is served, the
    burst's connection stays up, torch's and pyddp's clients still work, and the server
    stays under 1 GiB."""
    p, port = launch.store_server()
    hostile, burst = [], None
    stop = threading.Event()

    def keep_coming():                    # 40 more, while the burst is served
        for _ in range(40):
            if stop.is_set():
                return
            hostile.append(stall_large(port, 60 << 20, 7 << 20))
    churn = threading.Thread(target=keep_coming, daemon=True)
    try:
        hostile.extend(stall_large(port, 60 << 20, 7 << 20) for _ in range(40))
        settle(p.pid)
        held = launch.proc_status_mib(p.pid)
        assert held > 200, held           # the budget really is held
        n = 50_000
        keys = [f"/burst/{i}".encode() for i in range(n)]
        burst = raw(port)
        burst.settimeout(20)
        churn.start()
        t0 = time.monotonic()
        burst.sendall(b"".join(bytes([1]) + wire_str(k) + wire_str(b"v%d" % i)
                               for i, k in enumerate(keys)))
        burst.sendall(bytes([7]))         # GETNUMKEYS: answered once every SET ran
        assert struct.unpack("<Q", recv_exact(burst, 8))[0] == n
        served_s = time.monotonic() - t0
        # every key holds its own value: 50,000 pipelined GETs, read by a second thread
        gets = b"".join(bytes([3]) + wire_str(k) for k in keys)
        sender = threading.Thread(target=burst.sendall, args=(gets,), daemon=True)
        sender.start()
        for i in range(n):
            size = struct.unpack("<Q", recv_exact(burst, 8))[0]
            assert recv_exact(burst, size) == b"v%d" % i
        sender.join(10)
        churn.join(30)
        assert not churn.is_alive()
        tc = td.TCPStore("127.0.0.1", port, is_master=False, timeout=T)
        tc.set("torch", "ok")
        ours = TCPStore("127.0.0.1", port, timeout=T)
        assert ours.get("torch") == b"ok" and ours.num_keys() == n + 1
        ours.close()
        del tc
        peak = launch.proc_status_mib(p.pid, "VmHWM")
        assert peak < 1024, peak
        print(f"burst of {n} SETs served in {served_s:.2f} s; server peak RSS {peak:.0f} MiB")
    finally:
        stop.set()
        if churn.is_alive():
            churn.join(30)
        for s in hostile + [burst]:
            if s is not None:
                s.close()
        launch.kill_group(p.pid)
        p.communicate(timeout=10)


def test_stalled_large_request_is_the_one_evicted():
    """With the budget full, the incomplete large request silent for longest is dropped
    (its connection closed, a log line naming its peer) to make room for a new one;
    a newer stalled one stays and can still complete."""
    p, port = launch.store_server({"PYDDP_STORE_BUFFER_BYTES": "24M"})
    socks = []
    try:
        oldest = stall_large(port, 10 << 20, 6 << 20)     # holds 8 MiB of the budget
        socks.append(oldest)
        time.sleep(0.5)
        newer = stall_large(port, 10 << 20, 6 << 20)      # 8 more
        socks.append(newer)
        time.sleep(0.5)
        peer = "127.0.0.1:%d" % oldest.getsockname()[1]
        full = raw(port)                                   # 10 more: over 24 MiB
        socks.append(full)
        full.settimeout(10)
        full.sendall(bytes([1]) + wire_str(b"/full") + wire_str(b"y" * (10 << 20)) +
                     bytes([13]) + struct.pack("<I", 99))  # PING
        assert recv_exact(full, 4) == struct.pack("<I", 99)
        assert dropped(oldest)
        newer.settimeout(10)
        newer.sendall(b"x" * (4 << 20) + bytes([13]) + struct.pack("<I", 7))
        assert recv_exact(newer, 4) == struct.pack("<I", 7)
        ours = TCPStore("127.0.0.1", port, timeout=T)
        assert ours.get("full") == b"y" * (10 << 20)
        assert ours.get("big") == b"x" * (10 << 20)
        ours.close()
    finally:
        for s in socks:
            s.close()
        launch.kill_group(p.pid)
        _, err = p.communicate(timeout=10)
    assert f"rejected a store request from {peer}" in err, err
    assert "evicted" in err, err


def test_server_counts_requests():
    """_C.StoreServer.requests: every request served, VALIDATE and PING of a connect
    included (a SET has no reply, so a request with one follows it before counting)."""
    srv = _C.StoreServer()
    assert srv.requests == 0
    port = srv.start("127.0.0.1", 0)
    try:
        c = _C.StoreClient()
        c.connect("127.0.0.1", port, 5000, 0)
        assert srv.requests == 2
        c.set(b"/k", b"v")
        assert c.add(b"/n", 1) == 1
        assert srv.requests == 4
        c.close()
    finally:
        srv.stop()
    assert srv.requests == 0


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
