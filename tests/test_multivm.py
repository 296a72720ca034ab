"""Real-VM failure modes, reproduced with network namespaces (tests/netns.py; those
tests need root and are skipped without it):

* a host that vanishes mid-job (the router between two host namespaces drops every
  packet: no FIN, no RST) is an error on every rank within PYDDP_PEER_DEAD_S and a few
  seconds, with a 600 s group timeout, naming the peer and its host, and so is a store
  client waiting on a key; a peer that is alive but stopped (SIGSTOP for well over
  PYDDP_PEER_DEAD_S, with 4 MiB all_reduces running) is not declared dead. These
  processes run with PYDDP_PEER_DEAD_S=3 (DEAD_S) instead of the default 15, so that
  the wait is seconds; tests/c/test_sock.c checks the keepalive sized from the setting
  and the message's seconds;
* loopback is never advertised to peers on other hosts;
* a pyddp version mismatch with backend="nccl" fails on every rank with
  VersionMismatchError naming hosts and versions (NCCL test doubles);
* examples/train.py --resume across two namespaces whose checkpoint directories differ
  (no shared storage): every rank resumes from rank 0's file.

Every process is started in its own session and killed by id at the end.
"""
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from launch import PY, ROOT, WORKERS, free_port, kill_group, spawn_ranks  # noqa: E402
from netns import NetnsUnavailable, exec_prefix, partition, routed_hosts, two_hosts  # noqa: E402
from test_errors import results  # noqa: E402
from test_nccl_nogpu import fakes  # noqa: E402,F401  (the NCCL/CUDA test doubles)

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
DEAD_S = 3                                # PYDDP_PEER_DEAD_S of the partition cases
DEAD_ENV = {"PYDDP_PEER_DEAD_S": str(DEAD_S)}
NOTICED_S = DEAD_S + 12                   # the bound on noticing it (30 s with the 15 s default)


class Ranks:
    """world_size ranks of a worker in namespaces, with their output lines in a queue
    (read by one thread per stream); stop() kills each process group by id."""

    def __init__(self, script, hosts, args=(), env=None):
        port = free_port()
        self.q = queue.Queue()
        self.procs = []
        ws = len(hosts)
        for r, h in enumerate(hosts):
            e = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", RANK=str(r),
                     WORLD_SIZE=str(ws), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                     MASTER_ADDR=hosts[0].addr, MASTER_PORT=str(port), **(env or {}))
            e.pop("TORCHELASTIC_USE_AGENT_STORE", None)
            p = subprocess.Popen(exec_prefix(h.ns) + [PY, os.path.join(WORKERS, script),
                                                      *args],
                                 env=e, cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=True)
            self.procs.append(p)
            threading.Thread(target=self._pump, args=(r, p), daemon=True).start()
        self.lines = {r: [] for r in range(ws)}

    def _pump(self, r, p):
        for line in p.stdout:
            self.q.put((r, line.rstrip("\n")))

    def wait_for(self, word, n, deadline):
        """Lines starting with word, one per rank, until n ranks said it (or the
        deadline, time.monotonic()); returns {rank: (time seen, rest of line)}."""
        got = {}
        while len(got) < n and time.monotonic() < deadline:
            try:
                r, line = self.q.get(timeout=0.2)
            except queue.Empty:
                continue
            self.lines[r].append(line)
            if line.startswith(word):
                got[r] = (time.time(), line[len(word):].strip())
        return got

    def output(self):
        while not self.q.empty():
            r, line = self.q.get()
            self.lines[r].append(line)
        return "\n".join(f"[{r}] {x}" for r in self.lines for x in self.lines[r])[-6000:]

    def stop(self):
        for p in self.procs:
            try:
                os.kill(p.pid, signal.SIGCONT)   # a stopped process cannot die of SIGKILL
            except ProcessLookupError:          # ... until it runs; harmless otherwise
                pass
            kill_group(p.pid)
        for p in self.procs:
            p.wait(timeout=20)


def _routed():
    try:
        return routed_hosts()
    except NetnsUnavailable as e:
        pytest.skip(str(e))


@root_only
def test_vanished_host_is_an_error_on_every_rank_within_30_s():
    with _routed() as rt:
        ranks = Ranks("vanish.py", [rt.a, rt.b], args=["--seconds", "120"], env=DEAD_ENV)
        try:
            ready = ranks.wait_for("READY", 2, time.monotonic() + 60)
            assert len(ready) == 2, ranks.output()
            partition(rt)
            t0 = time.time()
            raised = ranks.wait_for("RAISED", 2, time.monotonic() + 40)
            assert len(raised) == 2, ranks.output()
            for r, (_, text) in raised.items():
                d = json.loads(text)
                peer = 1 - r
                peer_addr = (rt.a, rt.b)[peer].addr
                assert d["t"] - t0 < NOTICED_S, (d, ranks.output())
                assert d["cls"] == "DistNetworkError", d
                assert f"no answer from rank {peer} at {peer_addr} for {DEAD_S} s: the host or " \
                       f"the network between us is down" in d["msg"], d
                print(f"rank {r} raised {d['t'] - t0:.1f} s after the partition: {d['msg']}")
        finally:
            ranks.stop()


@root_only
def test_store_client_notices_a_vanished_store_host():
    """The store connection, idle in a wait for a key, is watched the same way."""
    with _routed() as rt:
        ranks = Ranks("vanish_store.py", [rt.a, rt.b], env=DEAD_ENV)
        try:
            ready = ranks.wait_for("READY", 1, time.monotonic() + 60)
            assert 1 in ready, ranks.output()
            partition(rt)
            t0 = time.time()
            raised = ranks.wait_for("RAISED", 1, time.monotonic() + 40)
            assert 1 in raised, ranks.output()
            d = json.loads(raised[1][1])
            assert d["t"] - t0 < NOTICED_S, (d, ranks.output())
            assert f"no answer from {rt.a.addr}:" in d["msg"] and \
                "the host or the network between us is down" in d["msg"], d
            print(f"the store client raised {d['t'] - t0:.1f} s after the partition: "
                  f"{d['cls']}: {d['msg']}")
        finally:
            ranks.stop()


@root_only
def test_stopped_peer_is_not_declared_dead():
    """SIGSTOP stops the process, not its kernel: keepalive and acknowledgements go on,
    so 3 x PYDDP_PEER_DEAD_S stopped with 4 MiB all_reduces pending (the receive window
    closes) is only slow."""
    with _routed() as rt:
        ranks = Ranks("vanish.py", [rt.a, rt.b], args=["--seconds", str(3 * DEAD_S + 3),
                                                       "--elems", str(1 << 20)], env=DEAD_ENV)
        try:
            ready = ranks.wait_for("READY", 2, time.monotonic() + 60)
            assert len(ready) == 2, ranks.output()
            os.kill(ranks.procs[1].pid, signal.SIGSTOP)
            time.sleep(3 * DEAD_S)
            os.kill(ranks.procs[1].pid, signal.SIGCONT)
            done = ranks.wait_for("PASS", 2, time.monotonic() + 30)
            assert len(done) == 2, ranks.output()
        finally:
            ranks.stop()


# ---- the address a rank advertises ------------------------------------------------

def _ip_route_src(ns=None):
    """`ip route get 8.8.8.8`'s source address (the reference), or None."""
    r = subprocess.run((exec_prefix(ns) if ns else []) + ["ip", "route", "get", "8.8.8.8"],
                       capture_output=True, text=True, timeout=20)
    m = re.search(r"\bsrc (\S+)", r.stdout)
    return m.group(1) if r.returncode == 0 and m else None


def test_loopback_is_not_advertised_when_the_job_spans_hosts(monkeypatch):
    from pyddp import _env
    monkeypatch.delenv("PYDDP_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("GROUP_WORLD_SIZE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _env.advertise_address("127.0.0.1") == "127.0.0.1"    # one host: loopback is fine
    src = _ip_route_src()
    if src is None:
        pytest.skip("this machine has no default route")
    for env in ({"LOCAL_WORLD_SIZE": "2"}, {"LOCAL_WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "2"}):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert _env.advertise_address("127.0.0.1") == src
        assert _env.advertise_address("localhost") == src


_ADVERTISE = ("import pyddp, pyddp._env as e\n"
              "try:\n    print('ADDR', e.advertise_address('127.0.0.1'))\n"
              "except pyddp.DistValueError as x:\n    print('ERROR', x)\n")


@root_only
def test_loopback_without_default_route_fails_at_init_and_over_a_router_is_avoided():
    env = dict(os.environ, PYTHONPATH=ROOT, WORLD_SIZE="2", LOCAL_WORLD_SIZE="1")
    env.pop("PYDDP_SOCKET_IFNAME", None)
    try:
        with two_hosts() as (a, _):                 # no default route in these
            out = subprocess.run(exec_prefix(a.ns) + [PY, "-c", _ADVERTISE], env=env,
                                 capture_output=True, text=True, timeout=60).stdout
    except NetnsUnavailable as e:
        pytest.skip(str(e))
    assert out.startswith("ERROR") and "--local-addr" in out and "PYDDP_SOCKET_IFNAME" in out, out
    with _routed() as rt:
        out = subprocess.run(exec_prefix(rt.a.ns) + [PY, "-c", _ADVERTISE], env=env,
                             capture_output=True, text=True, timeout=60).stdout
        assert out.split() == ["ADDR", rt.a.addr] == ["ADDR", _ip_route_src(rt.a.ns)], out
        # a whole job whose MASTER_ADDR is loopback but which says it spans hosts: its
        # ranks connect to each other at the interface's address, not at 127.0.0.1
        res = spawn_ranks("netcfg.py", 2, env={"GROUP_WORLD_SIZE": "2"}, timeout=60,
                          prefix=lambda r: exec_prefix(rt.a.ns))
        rs = results(res)
        assert len(rs) == 2 and all(r["ok"] for r in rs), [r.output for r in res]
        for r in rs:
            for desc in r["peers"].split(";"):
                m = re.search(r"\((.+):(\d+)\)", desc)
                assert m and m.group(1) == rt.a.addr, desc


# ---- versions, through the store, before NCCL ----------------------------------------

def test_version_mismatch_with_nccl_fails_on_every_rank(fakes):  # noqa: F811
    """The CPU rendezvous (and its version check) runs before NCCL is set up, for
    backend="nccl" as for "cpu": every rank gets the list of hosts and versions, and
    NCCL is never initialised."""
    env = {"PYDDP_NCCL_LIBRARY": fakes["nccl"], "PYDDP_CUDART_LIBRARY": fakes["cudart"],
           "FAKE_LOG": fakes["log"], "PYDDP_TIMEOUT": "30"}
    if os.path.exists(fakes["log"]):
        os.unlink(fakes["log"])
    res = spawn_ranks("vm_version.py", 2, env=env, timeout=90)
    rs = results(res)
    assert len(rs) == 2, [r.output for r in res]
    for r in rs:
        assert r["cls"] == "VersionMismatchError", r
        # each rank's host as its peers know it (its advertised address) and version
        assert "rank 0 on 127.0.0.1: pyddp " in r["msg"], r
        assert "rank 1 on 127.0.0.1: pyddp 0.0.1-other" in r["msg"], r
    log = open(fakes["log"]).read() if os.path.exists(fakes["log"]) else ""
    assert "ncclCommInitRank" not in log, log


# ---- resume without shared storage --------------------------------------------------

def _digest(path):
    """The checkpoint's digest, computed here as examples/train.py prints it."""
    import importlib.util
    import torch
    spec = importlib.util.spec_from_file_location("train_example",
                                                  os.path.join(ROOT, "examples", "train.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    state = torch.load(path, map_location="cpu")
    return mod.state_digest(state["model"], state["optimizer"]), state["epoch"]


@root_only
def test_resume_without_shared_storage(tmp_path):
    pytest.importorskip("torch")
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    for d in dirs:
        d.mkdir()
    small = ["--train-samples", "1024", "--test-samples", "256", "--backend", "gloo"]
    try:
        with two_hosts() as hosts:
            def prefix(r):   # each rank in its own namespace and its own directory
                return exec_prefix(hosts[r].ns) + ["sh", "-c", f'cd {dirs[r]} && exec "$0" "$@"']
            train = os.path.join(ROOT, "examples", "train.py")
            first = spawn_ranks(train, 2, args=small + ["--epochs", "1"], timeout=120,
                                master_addr=hosts[0].addr, prefix=prefix)
            assert all(r.returncode == 0 for r in first), [r.output[-3000:] for r in first]
            ckpt = dirs[0] / "checkpoints" / "latest.pt"
            assert ckpt.exists() and not (dirs[1] / "checkpoints").exists()
            want, epoch = _digest(str(ckpt))
            second = spawn_ranks(train, 2, args=small + ["--epochs", "2", "--resume"],
                                 timeout=120, master_addr=hosts[0].addr, prefix=prefix)
    except NetnsUnavailable as e:
        pytest.skip(str(e))
    assert all(r.returncode == 0 for r in second), [r.output[-3000:] for r in second]
    for r, res in enumerate(second):
        m = re.search(rf"rank {r}: starting at epoch (\d+) with state digest (\w+)", res.stdout)
        assert m, res.output[-3000:]
        assert int(m.group(1)) == epoch + 2 and m.group(2) == want, (m.groups(), want)
    assert "epoch 2/2" in second[0].stdout and "epoch 1/2" not in second[0].stdout


def test_nccl_gets_the_interface_chosen_by_route(monkeypatch):
    """Group._nccl_interface, which runs before NCCL initialises: NCCL_SOCKET_IFNAME is
    set to the interface of the address pyddp chose by the route to MASTER_ADDR, left
    alone when the user set it or chose pyddp's interface by name."""
    from pyddp import _group
    r = subprocess.run(["ip", "route", "get", "8.8.8.8"], capture_output=True, text=True,
                       timeout=20)
    m = re.search(r"\bdev (\S+) .*?\bsrc (\S+)", r.stdout)
    if r.returncode != 0 or not m:
        pytest.skip("this machine has no default route")
    dev, src = m.groups()
    g = _group.Group.__new__(_group.Group)
    g._advertise, g._by_route = src, True
    monkeypatch.setattr(_group._State, "pg", None)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    g._nccl_interface()
    assert os.environ.get("NCCL_SOCKET_IFNAME") == dev
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "=ib0")
    g._nccl_interface()
    assert os.environ["NCCL_SOCKET_IFNAME"] == "=ib0"
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    g._by_route = False                        # PYDDP_SOCKET_IFNAME chose it: the user's call
    g._nccl_interface()
    assert "NCCL_SOCKET_IFNAME" not in os.environ
