"""pyddp's TCPStore server and client against peers that misbehave: raw sockets that
send garbage, truncated or oversized requests (the server keeps serving the others),
clients that stall mid-request while the budget for incomplete requests
(PYDDP_STORE_BUFFER_BYTES) is used up (the one silent longest is evicted, complete
requests are never held up), fake servers whose replies are garbage (the client raises
DistStoreError naming the server), and the server's request count. The interop with
torch's servers and clients is tests/test_store.py's.
"""
import socket
import struct
import threading
import time

import pytest

import launch
from pyddp import _C
from pyddp.store import TCPStore
from test_store import MAGIC, T, bounded

td = pytest.importorskip("torch.distributed")


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


