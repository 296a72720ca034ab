"""pyddp.EtcdStore against real etcd members (tests/etcd_cluster.py; never a mock).

* Its Store API gives what pyddp's TCPStore gives for the same sequence of calls (the
  TCPStore being the reference: tests/test_store.py checks it against torch's server),
  and a wait wakes on a write made through another member.
* The etcd leader killed while requests flow: every one succeeds (each add counted
  once); two of three members killed: a request fails within PYDDP_ETCD_TIMEOUT with an
  error naming etcd and the majority it needs, and works again once a member is back.
* A key held by a lease goes when its process is killed.
* TLS with client certificates, and user/password auth: served with the right
  settings, refused with a clear error without them.
* The C core's rendezvous runs on it: init_process_group(store=EtcdStore(...)) at 2 and
  3 ranks gives NumPy's all_reduce and broadcast results.
"""
import json
import os
import subprocess
import threading
import time
import urllib.request
from datetime import timedelta

import numpy as np
import pytest

from etcd_cluster import EtcdCluster, tls_files
from launch import PY, ROOT, kill_group, spawn_ranks

import pyddp
from pyddp import EtcdStore, TCPStore


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = EtcdCluster(tmp_path_factory.mktemp("etcd"), 3)
    try:
        c.start()
        c.wait_ready()
        yield c
    finally:
        c.close()


def _ns():
    return f"t{time.time_ns()}"


def _sequence(st):
    """A sequence of Store calls; the results, in order."""
    out = []
    st.set("a", "1")
    st.set("b", b"\x00\xffbin")
    out += [st.get("a"), st.get("b"), st.check(["a", "b"]), st.check(["a", "zz"])]
    out += [st.add("n", 1), st.add("n", 41), st.add("n", -2), st.add("n", 0)]
    out += [st.compare_set("c", "", "first"), st.compare_set("c", "x", "y"),
            st.compare_set("c", "first", "second"), st.compare_set("absent", "e", "d")]
    st.multi_set(["m1", "m2", "m1"], ["v1", "v2", "v3"])
    out.append(st.multi_get(["m1", "m2", "a"]))
    st.append("ap", "ab")
    st.append("ap", "cd")
    out.append(st.get("ap"))
    out += [st.delete_key("a"), st.delete_key("a"), st.check(["a"])]
    try:
        st.wait(["never"], timedelta(milliseconds=300))
        out.append("no timeout")
    except pyddp.DistStoreTimeoutError as e:
        out.append(("timeout", isinstance(e, TimeoutError)))
    return out


def test_store_api_matches_tcpstore(cluster):
    tcp = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    etcd = EtcdStore(cluster.endpoint(), _ns(), timedelta(seconds=10))
    try:
        want = _sequence(tcp)
        got = _sequence(etcd)
        assert got == want
        assert want[4:8] == [1, 42, 40, 40]
        assert etcd.num_keys() == 6          # b, n, c, m1, m2, ap
    finally:
        tcp.close()
        etcd.close()


def test_bad_arguments_fail_before_any_request(cluster):
    with pytest.raises(pyddp.DistValueError, match="not HOST:PORT"):
        EtcdStore("etcd://127.0.0.1:notaport", "x")
    with pytest.raises(pyddp.DistValueError, match="names no etcd member"):
        EtcdStore("etcd://", "x")
    st = EtcdStore(cluster.endpoint(), _ns())
    try:
        with pytest.raises(pyddp.DistTypeError):
            st.set("k", 3)
        with pytest.raises(pyddp.DistTypeError):
            st.wait("k")
    finally:
        st.close()


def test_wait_wakes_on_a_write_through_another_member(cluster):
    ns = _ns()
    waiter = EtcdStore(cluster.endpoint([0]), ns, timedelta(seconds=20))
    writer = EtcdStore(cluster.endpoint([2]), ns)
    try:
        t = threading.Timer(0.5, lambda: (writer.set("w1", "1"), writer.set("w2", "2")))
        t.start()
        t0 = time.monotonic()
        assert waiter.multi_get(["w1", "w2"]) == [b"1", b"2"]
        assert time.monotonic() - t0 < 5
        t.join()
    finally:
        waiter.close()
        writer.close()


def test_leader_killed_every_request_succeeds(tmp_path):
    c = EtcdCluster(tmp_path, 3)
    try:
        c.start()
        lead = c.wait_ready()
        # the client prefers the leader first: the worst case
        order = [lead] + [i for i in range(3) if i != lead]
        st = EtcdStore(c.endpoint(order), _ns(), timedelta(seconds=30))
        for _ in range(5):
            st.add("n", 1)
        c.kill(lead)
        t0 = time.monotonic()
        for _ in range(30):
            st.add("n", 1)
        took = time.monotonic() - t0
        assert st.add("n", 0) == 35
        assert took < 15, took
        c.leader()                          # the two left elected one
        c.start(lead)                       # back with its data directory
        c.wait_ready()
        assert EtcdStore(c.endpoint([lead]), st.namespace).get("n") == b"35"
        st.close()
    finally:
        c.close()


def _client(code, env, args=(), timeout=120):
    """Run code in a process of its own with env added (pyddp reads each PYDDP_*
    setting once per process) and args; returns its stdout, failing on a non-zero
    exit."""
    r = subprocess.run([PY, "-c", code, *args], env=dict(os.environ, PYTHONPATH=ROOT, **env),
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


MAJORITY = """
import sys, time
import pyddp
from datetime import timedelta
st = pyddp.EtcdStore(sys.argv[1], "majority", timedelta(seconds=60))
st.set("k", "v")
print("SET", flush=True)
sys.stdin.readline()                       # the test kills two members meanwhile
t0 = time.monotonic()
try:
    st.set("k2", "v2")
    print("NO ERROR")
except pyddp.DistNetworkError as e:
    print("ERROR", round(time.monotonic() - t0, 1), str(e).replace(chr(10), " "), flush=True)
sys.stdin.readline()                       # one member is back: a majority again
st.set("k2", "v2")
print("AGAIN", st.multi_get(["k", "k2"]), flush=True)
"""


def test_without_a_majority_requests_fail_naming_etcd(tmp_path):
    c = EtcdCluster(tmp_path, 3)
    p = None
    try:
        c.start()
        c.wait_ready()
        p = subprocess.Popen([PY, "-c", MAJORITY, c.endpoint()], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, start_new_session=True,
                             env=dict(os.environ, PYTHONPATH=ROOT, PYDDP_ETCD_TIMEOUT="4"))
        assert p.stdout.readline().strip() == "SET"
        c.kill(1)
        c.kill(2)
        p.stdin.write("\n")
        p.stdin.flush()
        line = p.stdout.readline()
        assert line.startswith("ERROR"), line
        took = float(line.split()[1])
        assert 3.5 <= took < 15, line
        assert "etcd" in line and "majority" in line and "2 of 3" in line, line
        c.start(1)
        c.leader(30)
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "AGAIN [b'v', b'v2']"
    finally:
        if p is not None:
            kill_group(p.pid)
        c.close()


LEASE_HOLDER = """
import sys, time
from pyddp import EtcdStore
st = EtcdStore(sys.argv[1], sys.argv[2])
held = st.hold("alive/me", "x", 3)
print("HELD", flush=True)
time.sleep(600)
"""


def test_leased_key_goes_with_its_process(cluster):
    ns = _ns()
    st = EtcdStore(cluster.endpoint(), ns)
    p = subprocess.Popen([PY, "-c", LEASE_HOLDER, cluster.endpoint(), ns],
                         env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "HELD"
        time.sleep(4)                           # past its TTL: kept alive by its refresh
        assert st.keys_under("alive/") == ["alive/me"]
        kill_group(p.pid)
        p.wait(timeout=20)
        deadline = time.monotonic() + 15
        while st.keys_under("alive/") and time.monotonic() < deadline:
            time.sleep(0.3)
        assert st.keys_under("alive/") == []
        h = st.hold("alive/mine", "y", 3)
        assert st.keys_under("alive/") == ["alive/mine"]
        h.release()
        assert st.keys_under("alive/") == []
    finally:
        kill_group(p.pid)
        st.close()


TLS_CLIENT = """
import sys
import pyddp
try:
    st = pyddp.EtcdStore(sys.argv[1], "tls")
    st.set("k", "v")
    print("OK", st.get("k"))
except (pyddp.DistError, pyddp.DistValueError) as e:
    print("REFUSED", type(e).__name__, str(e).replace(chr(10), " "))
"""


def test_tls_with_client_certificates(tmp_path):
    files = tls_files(tmp_path)
    c = EtcdCluster(tmp_path, 1, tls=files)
    try:
        c.start()
        good = {"PYDDP_ETCD_CACERT": files["ca"], "PYDDP_ETCD_CERT": files["client_cert"],
                "PYDDP_ETCD_KEY": files["client_key"], "PYDDP_ETCD_TIMEOUT": "3"}
        assert c.endpoint().startswith("etcd://https://")
        deadline = time.monotonic() + 30
        while True:                             # the member's first seconds
            out = _client(TLS_CLIENT, good, [c.endpoint()])
            if out.startswith("OK") or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert out.strip() == "OK b'v'", out
        # without a client certificate the member refuses the connection
        out = _client(TLS_CLIENT, {"PYDDP_ETCD_CACERT": files["ca"],
                                   "PYDDP_ETCD_TIMEOUT": "3"}, [c.endpoint()])
        assert out.startswith("REFUSED EtcdUnavailable") and "etcd" in out, out
        # a CA file that is not there
        out = _client(TLS_CLIENT, dict(good, PYDDP_ETCD_CACERT=str(tmp_path / "no.pem")),
                      [c.endpoint()])
        assert out.startswith("REFUSED DistValueError") and "PYDDP_ETCD_CACERT" in out, out
    finally:
        c.close()


def _api(c, path, body):
    req = urllib.request.Request(c.client_url(0) + path, data=json.dumps(body).encode(),
                                 method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


AUTH_CLIENT = """
import sys
import pyddp
try:
    st = pyddp.EtcdStore(sys.argv[1], "auth")
    st.set("k", "v")
    print("OK", st.add("n", 5), st.get("k"))
except pyddp.DistError as e:
    print("REFUSED", type(e).__name__, str(e).replace(chr(10), " "))
"""


def test_user_and_password(tmp_path):
    c = EtcdCluster(tmp_path, 1)
    try:
        c.start()
        c.wait_ready()
        _api(c, "/v3/auth/user/add", {"name": "root", "password": "rootpw"})
        _api(c, "/v3/auth/role/add", {"name": "root"})
        _api(c, "/v3/auth/user/grant", {"user": "root", "role": "root"})
        _api(c, "/v3/auth/enable", {})
        ep = [c.endpoint()]
        out = _client(AUTH_CLIENT, {"PYDDP_ETCD_TIMEOUT": "3"}, ep)
        assert out.startswith("REFUSED") and "etcd" in out, out       # no credentials
        out = _client(AUTH_CLIENT, {"PYDDP_ETCD_USER": "root",
                                    "PYDDP_ETCD_PASSWORD": "wrong"}, ep)
        assert out.startswith("REFUSED EtcdError") and "PYDDP_ETCD_USER=root" in out, out
        pw = tmp_path / "pw"
        pw.write_text("rootpw\n")
        out = _client(AUTH_CLIENT, {"PYDDP_ETCD_USER": "root",
                                    "PYDDP_ETCD_PASSWORD_FILE": str(pw)}, ep)
        assert out.strip() == "OK 5 b'v'", out
    finally:
        c.close()


WORKER = """
import os, sys
from datetime import timedelta
import numpy as np
import pyddp as dist
rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
st = dist.EtcdStore(sys.argv[1], sys.argv[2], timeout=timedelta(seconds=60))
dist.init_process_group("cpu", store=st, rank=rank, world_size=ws)
x = np.arange(6, dtype=np.float64) * (rank + 1)
dist.all_reduce(x)
b = np.full(3, float(rank), dtype=np.float32)
dist.broadcast(b, src=ws - 1)
print("RESULT", x.tolist(), b.tolist(), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("ws", [2, 3])
def test_process_group_over_etcd(cluster, tmp_path, ws):
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    res = spawn_ranks(str(script), ws, args=[cluster.endpoint(), _ns()], timeout=120)
    want_x = (np.arange(6, dtype=np.float64) * sum(range(1, ws + 1))).tolist()
    for r in res:
        assert r.returncode == 0, r.stdout + r.stderr
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")][0]
        assert line == f"RESULT {want_x} {[float(ws - 1)] * 3}", line


def test_the_doctor_checks_the_etcd_members(tmp_path):
    """python -m pyddp.doctor --etcd: every member answering with one leader is fine;
    with two of three gone it fails, saying etcd needs a majority."""
    c = EtcdCluster(tmp_path, 3)
    try:
        c.start()
        c.wait_ready()

        def doctor():
            return subprocess.run([PY, "-m", "pyddp.doctor", "--etcd", c.endpoint(),
                                   "--timeout", "2"], capture_output=True, text=True,
                                  timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
        r = doctor()
        assert r.returncode == 0, r.stdout + r.stderr
        assert "3 of 3 members answer from this node, with one leader" in r.stdout, r.stdout
        c.kill(0)
        c.kill(2)
        r = doctor()
        assert r.returncode == 1, r.stdout + r.stderr
        assert "only 1 of 3 members answer" in r.stdout and "majority (2 of 3)" in r.stdout, \
            r.stdout
    finally:
        c.close()


LOSS_WORKER = """
import os, sys, time
from datetime import timedelta
import numpy as np
import pyddp as dist
rank = int(os.environ["RANK"])
st = dist.EtcdStore(sys.argv[1], sys.argv[2], timeout=timedelta(seconds=120))
dist.init_process_group("cpu", store=st, rank=rank, world_size=2)
x = np.ones(4, np.float32)
dist.all_reduce(x)
print("READY", flush=True)
t0 = None
try:
    while True:
        dist.all_reduce(x)
        if t0 is None and os.path.exists(sys.argv[3]):
            t0 = time.monotonic()
        time.sleep(0.01)
except dist.DistError as e:
    print("ERROR", round(time.monotonic() - (t0 or time.monotonic()), 2),
          type(e).__name__, flush=True)
"""


def test_a_lost_peer_is_reported_at_once_without_an_etcd_majority(tmp_path):
    """A collective whose peer died while etcd has no majority fails within seconds: the
    core's failure announcement and the straggler report through the store keep their
    own short deadlines on etcd too (not PYDDP_ETCD_TIMEOUT, 30 s)."""
    c = EtcdCluster(tmp_path, 3)
    procs = []
    try:
        c.start()
        c.wait_ready()
        flag = tmp_path / "killed"
        ns = _ns()
        for r in range(2):
            procs.append(subprocess.Popen(
                [PY, "-c", LOSS_WORKER, c.endpoint(), ns, str(flag)], stdout=subprocess.PIPE,
                text=True, start_new_session=True,
                env=dict(os.environ, PYTHONPATH=ROOT, RANK=str(r), WORLD_SIZE="2")))
        for p in procs:
            assert p.stdout.readline().strip() == "READY"
        c.kill(1)
        c.kill(2)
        kill_group(procs[1].pid)
        flag.write_text("1")
        out = procs[0].communicate(timeout=120)[0]
        line = [ln for ln in out.splitlines() if ln.startswith("ERROR")]
        assert line and float(line[0].split()[1]) < 10, out
    finally:
        for p in procs:
            kill_group(p.pid)
        c.close()
