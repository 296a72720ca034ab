"""PYDDP_AUTH_TOKEN end to end (docs/security.md), and the store server's bounds seen
from outside.

- a 3-rank job with the token while an outsider hammers the store port and every port
  of PYDDP_PORT_RANGE with garbage, forged store requests (VALIDATE + SET of a rank's
  address + PING), a forged authentication with a wrong proof, and forged data-link
  hellos: the job's results are right (checked against NumPy in the worker) and none
  of the outsider's requests is answered beyond the handshake's challenge;
- mismatched tokens, and a token on some ranks only: every rank fails within seconds
  with AuthenticationError naming the peer or the store, none hangs;
- no token: the job runs as before; the multi-host warning (and its silencing);
- pyddp's TCPStore server in its own process under 40 stalled clients that announce
  60 MiB values: its RSS stays near the budget and another client is served; a
  request left incomplete is dropped after PYDDP_STORE_REQUEST_TIMEOUT.

The jobs that spend their seconds waiting (grace periods, timeouts) start together in
one module fixture (waiting_jobs), and each case checks its own job's result.
"""
import importlib.util
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

import launch
from pyddp import _C

TOKEN_ENV = {"PYDDP_AUTH_TOKEN": "correct horse battery staple"}


def fnv(s):
    h = 1469598103934665603
    for b in s.encode():
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def _free_range(n):
    """A run of n consecutive ports that were free a moment ago."""
    for _ in range(50):
        lo = launch.free_port()
        ok = True
        for p in range(lo, lo + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return lo, lo + n - 1
    raise RuntimeError("no free port range")


def _exchange(port, payload, then=None, wait=2.0):
    """Connect, send payload (and `then` after the first reply bytes), read until the
    server closes or `wait` passes. Returns (bytes received, closed by server)."""
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=1.0)
    except OSError:
        return b"", True          # nobody listening (yet, or any more)
    if s.getsockname() == s.getpeername():
        # Nobody listening, and the kernel picked the destination port as the source
        # port: a TCP self-connection, which echoes what is sent (the range's ports
        # are ephemeral ones).
        s.close()
        return b"", True
    got = b""
    closed = False
    with s:
        s.settimeout(0.2)
        try:
            s.sendall(payload)
        except OSError:
            return got, True
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                closed = True
                break
            if not chunk:
                closed = True
                break
            got += chunk
            if then is not None:
                try:
                    s.sendall(then)
                except OSError:
                    pass
                then = None
    return got, closed


class Outsider(threading.Thread):
    """Attacks the store and the data ports until stop is set; records every answer."""

    def __init__(self, port_file, lo, hi):
        super().__init__(daemon=True)
        self.port_file, self.lo, self.hi = port_file, lo, hi
        self.stop = threading.Event()
        self.answers = []        # (what, port, bytes received, closed)

    def run(self):
        while not os.path.exists(self.port_file) and not self.stop.is_set():
            time.sleep(0.05)
        if self.stop.is_set():
            return
        store = int(open(self.port_file).read())
        key = b"/pyddp/none/0/0/rank/1"
        wire = _C.WIRE_VERSION   # this pyddp's: the forgeries look current
        val = f"ver=0;wire={wire};addr=127.0.0.1;port={self.lo};host=x".encode()
        forged = (b"\x00" + struct.pack("<I", 0x3C85F7CE) +
                  b"\x01" + struct.pack("<Q", len(key)) + key + struct.pack("<Q", len(val)) +
                  val + b"\x0d" + struct.pack("<I", 0x3C85F7CE))
        fake_auth = b"\x70" + struct.pack("<I", 0x50444441) + os.urandom(32)
        # claims rank 2 of 3 (with a token) dialing rank 0 or 1, on its first socket
        hellos = [struct.pack("<IIQiiIIiI", 0x44445048, wire, fnv("/pyddp/none/0/0"),
                              2, 3, 1, 0, to, 0) for to in (0, 1)]
        while not self.stop.is_set():
            for what, port, payload, then in (
                    ("garbage", store, b"\xff" + os.urandom(63), None),
                    ("forged set", store, forged, None),
                    ("forged auth", store, fake_auth, os.urandom(32)),
                    *[("data garbage", p, os.urandom(40), None)
                      for p in range(self.lo, self.hi + 1)],
                    *[("forged hello", p, hello + os.urandom(32), os.urandom(32))
                      for p in range(self.lo, self.hi + 1) for hello in hellos]):
                got, closed = _exchange(port, payload, then, wait=1.0)
                self.answers.append((what, port, got, closed))
                if self.stop.is_set():
                    break


def test_job_with_token_and_outsider(tmp_path):
    lo, hi = _free_range(6)
    port_file = str(tmp_path / "port")
    out = Outsider(port_file, lo, hi)
    out.start()
    env = dict(TOKEN_ENV, PYDDP_PORT_RANGE=f"{lo}-{hi}", AUTH_PORT_FILE=port_file,
               AUTH_LATE="2", AUTH_DELAY="3")
    try:
        results = launch.spawn_ranks("auth_job.py", 3, env=env, timeout=90)
    finally:
        out.stop.set()
        out.join(10)
    for r in results:
        assert r.returncode == 0 and "PASS" in r.stdout, r.output
    assert any(w == "forged set" for w, *_ in out.answers), out.answers[:5]
    for what, port, got, closed in out.answers:
        if what == "forged auth":      # the server's challenge (65 bytes), nothing more
            assert len(got) in (0, 65), (what, port, got)
        elif what == "forged hello":   # the reply and the rank's challenge, nothing more
            # (a port that is a connecting rank's may answer with its own 40-byte hello
            # instead of the 8-byte reply: public fields only, then the challenge. A
            # verdict alone closes the others: "duplicate" from a rank that already has
            # its link to the claimed rank, "broken" from a failed group, "gone" from a
            # process that holds no such rank: nothing secret in any of them)
            verdict_only = len(got) == 8 and got[:4] == b"HPDR" and \
                struct.unpack("<I", got[4:])[0] in (4, 5, 6)
            assert len(got) in (0, 8 + 64) or verdict_only or \
                (len(got) == 40 + 64 and got[:4] == b"HPDD"), (what, port, got)
        elif what == "forged set":     # no PING echo: at most "authenticate first"
            assert got in (b"", struct.pack("<I", 0x50444441)), (what, port, got)
        else:                          # no reply of any kind
            assert got == b"", (what, port, got)
        if port not in range(lo, hi + 1):   # a data port may hold it in its backlog
            assert closed, (what, port)
    assert "rejected a store connection" in results[0].stderr


MISMATCHED = [("a", "b", "a"), ("a", "a", None), (None, "a", "a")]


def _mismatched_job(tokens):
    """3 ranks with these tokens (None: unset): (their Results, seconds until all ended)."""
    def prefix(r):
        t = tokens[r]
        return ["env", f"PYDDP_AUTH_TOKEN={t}"] if t else ["env", "-u", "PYDDP_AUTH_TOKEN"]
    t0 = time.monotonic()
    results = launch.spawn_ranks("auth_job.py", 3, timeout=60, prefix=prefix,
                                 env={"PYDDP_TIMEOUT": "120"})
    return results, time.monotonic() - t0


def _client_modes_job():
    """CLIENT_MODES in a process of its own, with the token set: its Result."""
    return launch.run([sys.executable, "-c", CLIENT_MODES], env=TOKEN_ENV, timeout=60)


@pytest.fixture(scope="module")
def waiting_jobs():
    """The jobs of this module that spend their seconds waiting, started together (they
    use next to no CPU, so they overlap): every MISMATCHED job (the authentication
    grace periods) and CLIENT_MODES (a client that asks torch's server to authenticate
    waits for the answer that never comes, 10 s) and _idle_request_job (5 s of a silent
    connection). Keyed by the tokens, "modes" and "idle"."""
    jobs = {t: (lambda t=t: _mismatched_job(t)) for t in MISMATCHED}
    jobs["idle"] = _idle_request_job
    if importlib.util.find_spec("torch") is not None:
        jobs["modes"] = _client_modes_job
    with launch.together(jobs) as started:
        yield started


@pytest.mark.parametrize("tokens", MISMATCHED)
def test_mismatched_tokens_fail_every_rank(tokens, waiting_jobs):
    results, elapsed = waiting_jobs[tokens].result()
    for r in results:
        assert r.returncode == 3, r.output
        assert "INIT FAILED" in r.stdout and "uthentication" in r.stdout, r.output
        assert "AuthenticationError" in r.stdout or "DistNetworkError" in r.stdout, r.output
    assert elapsed < 45, elapsed     # seconds, not PYDDP_TIMEOUT (120 s)
    # the rank whose token differs names the store or the peer it failed with
    odd = [r for r, t in enumerate(tokens) if tokens.count(t) == 1][0]
    assert "store at" in results[odd].stdout or "rank" in results[odd].stdout


def test_no_token_runs_and_multi_host_warning(monkeypatch):
    results = launch.spawn_ranks("auth_job.py", 2, timeout=60,
                                 prefix=lambda r: ["env", "-u", "PYDDP_AUTH_TOKEN"])
    for r in results:
        assert r.returncode == 0 and "PASS" in r.stdout, r.output
        assert "without PYDDP_AUTH_TOKEN" not in r.stderr   # one host: no warning
    from pyddp import _world

    class FakePG:
        size = 2

        def peer(self, r):
            return (f"rank {r}", f"host-{r}")

    class FakeGroup:
        _world_rank = 0

        def pg(self):
            return FakePG()

    monkeypatch.setattr(_world, "_auth_warned", False)
    monkeypatch.delenv("PYDDP_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("PYDDP_AUTH_TOKEN_FILE", raising=False)
    records = []
    handler = type("H", (__import__("logging").Handler,),
                   {"emit": lambda self, rec: records.append(rec.getMessage())})()
    _world.log.addHandler(handler)
    try:
        _world._warn_unauthenticated(FakeGroup())
        assert len(records) == 1 and "spans 2 hosts" in records[0]
        _world._warn_unauthenticated(FakeGroup())      # once per process
        assert len(records) == 1
        monkeypatch.setattr(_world, "_auth_warned", False)
        monkeypatch.setenv("PYDDP_AUTH_TOKEN", "")     # deliberately empty: silenced
        _world._warn_unauthenticated(FakeGroup())
        assert len(records) == 1
    finally:
        _world.log.removeHandler(handler)


def _validated(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(b"\x00" + struct.pack("<I", 0x3C85F7CE))
    return s


def test_store_memory_bound_under_stalled_senders():
    p, port = launch.store_server({"PYDDP_STORE_BUFFER_BYTES": "64M"})
    socks = []
    try:
        base = launch.proc_status_mib(p.pid)
        chunk = b"x" * (4 << 20)
        for _ in range(40):        # each announces a 60 MiB value, sends 4 MiB, stalls
            s = _validated(port)
            socks.append(s)
            s.sendall(b"\x01" + struct.pack("<Q", 1) + b"k" + struct.pack("<Q", 60 << 20))
            try:
                s.settimeout(2)
                s.sendall(chunk)
            except OSError:
                pass               # closed by the server: over the budget
        time.sleep(0.5)
        grown = launch.proc_status_mib(p.pid) - base
        # 40 x 4 MiB = 160 MiB offered; the budget is 64 MiB (plus one buffer doubling)
        assert grown < 64 + 48, grown
        import pyddp
        from datetime import timedelta
        other = pyddp.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=5))
        other.set("k", "v")
        assert other.get("k") == b"v"
        other.close()
    finally:
        for s in socks:
            s.close()
        launch.kill_group(p.pid)
        p.communicate()


def test_store_idle_request_timeout(waiting_jobs):
    waiting_jobs["idle"].result()      # _idle_request_job's checks, run in the fixture


def _idle_request_job():
    """A store server with PYDDP_STORE_REQUEST_TIMEOUT=1: a connection that sent half a
    request is closed after about 1 s, one that never sent its first request after
    about 5 s. Raises AssertionError otherwise."""
    p, port = launch.store_server({"PYDDP_STORE_REQUEST_TIMEOUT": "1"})
    try:
        s = _validated(port)
        s.sendall(b"\x01" + struct.pack("<Q", 1))      # half a SET, then nothing
        s.settimeout(6)
        t0 = time.monotonic()
        assert s.recv(1) == b""                        # closed by the server
        assert 0.8 < time.monotonic() - t0 < 3.5
        s.close()
        silent = socket.create_connection(("127.0.0.1", port), timeout=5)
        silent.settimeout(9)
        t0 = time.monotonic()
        assert silent.recv(1) == b""                   # never sent its first request
        assert 4 < time.monotonic() - t0 < 7.5
        silent.close()
    finally:
        launch.kill_group(p.pid)
        p.communicate()


CLIENT_MODES = """
import torch.distributed as td, pyddp
from datetime import timedelta
t = td.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
c = pyddp.TCPStore("127.0.0.1", t.port, timeout=timedelta(seconds=10))   # auth=None
c.set("a", "b")
assert t.get("a") == b"b"                  # torch's server: plain, no hang, no error
try:
    pyddp.TCPStore("127.0.0.1", t.port, timeout=timedelta(seconds=20), auth=True)
    raise SystemExit("auth=True accepted torch's server")
except pyddp.AuthenticationError as e:
    assert "torch's TCPStore cannot authenticate" in str(e), e
m = pyddp.TCPStore("127.0.0.1", 0, is_master=True)
c2 = pyddp.TCPStore("127.0.0.1", m.port)   # auth=None: authenticates when asked
c2.set("x", "y")
assert m.get("x") == b"y"
print("OK")
"""


def test_client_modes_against_torch_and_pyddp_servers(waiting_jobs):
    pytest.importorskip("torch")
    r = waiting_jobs["modes"].result()
    assert r.returncode == 0 and "OK" in r.stdout, r.output
    assert "rejected" not in r.stderr, r.output   # the probe is turned away quietly


def test_torchrun_with_token():
    """torchrun's agent store is torch's: pyddp does not authenticate to it, and still
    authenticates its data links."""
    pytest.importorskip("torch")
    r = launch.torchrun("auth_job.py", 2, env=TOKEN_ENV, timeout=120)
    assert r.returncode == 0 and r.stdout.count("PASS") == 2, r.output


def test_doctor_never_shows_the_token(monkeypatch):
    from pyddp.doctor import _facts as _doctor_facts
    monkeypatch.setenv("PYDDP_AUTH_TOKEN", "do-not-print-me")
    facts = _doctor_facts.settings()
    assert "do-not-print-me" not in repr(facts)
    assert facts["set"]["PYDDP_AUTH_TOKEN"] == "(set, hidden)"


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_torch_backend_across_hosts_warns_without_a_token(tmp_path):
    """The warning comes on torch's backend "pyddp" too (torch's init_process_group,
    as Lightning and Accelerate use it), not only from pyddp's own init."""
    pytest.importorskip("torch")
    from netns import NetnsUnavailable, exec_prefix, two_hosts
    script = tmp_path / "torch_job.py"
    script.write_text("import torch, torch.distributed as dist\n"
                      "dist.init_process_group('pyddp')\n"
                      "x = torch.ones(3); dist.all_reduce(x); assert x[0] == 2\n"
                      "dist.destroy_process_group(); print('PASS', flush=True)\n")
    try:
        with two_hosts() as hosts:
            results = launch.spawn_ranks(
                str(script), 2, timeout=90, master_addr=hosts[0].addr,
                prefix=lambda r: exec_prefix(hosts[r].ns) + ["env", "-u", "PYDDP_AUTH_TOKEN"])
    except NetnsUnavailable as e:
        pytest.skip(str(e))
    for r in results:
        assert r.returncode == 0 and "PASS" in r.stdout, r.output[-3000:]
    assert results[0].stderr.count("spans 2 hosts without PYDDP_AUTH_TOKEN") == 1, \
        results[0].stderr[-3000:]
    assert "without PYDDP_AUTH_TOKEN" not in results[1].stderr
