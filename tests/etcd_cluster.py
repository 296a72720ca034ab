"""Real etcd members for the tests (never a mock): a cluster the test starts itself, each
member with its own ports and data directory under the test's temporary folder, on
loopback or one member per network-namespace host, stopped by process id.

The binary is Debian's ``etcd-server`` (``apt-get install etcd-server``; ``.ci/run``
installs it). Without it the tests that need it skip, except under ``CI=true``, where
they fail: CI must run them. ``tls_files`` makes a CA, a server certificate for the
members' addresses and a client certificate with the ``openssl`` command.
benchmarks/elastic.py starts its members with ``EtcdCluster`` too (pytest is then
imported only if the binary is missing).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

from launch import free_port


def etcd_binary():
    """The etcd binary's path; skips the test (fails it under CI=true) without one."""
    path = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd")
                                    else None)
    if path is None:
        import pytest
        msg = "etcd is not installed (Debian: apt-get install etcd-server)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return path


class EtcdCluster:
    """n etcd members. hosts: [(namespace or None, address)] per member (default: all
    on 127.0.0.1, each with free ports; in a namespace a member uses 2379/2380 on its
    host's address). tls: tls_files' dict, to serve clients over TLS with client
    certificates required."""

    def __init__(self, tmp, n=3, hosts=None, tls=None):
        self.bin = etcd_binary()
        self.tmp, self.tls = tmp, tls
        self.hosts = hosts or [(None, "127.0.0.1")] * n
        self.members = []
        for i, (ns, addr) in enumerate(self.hosts):
            cport, pport = (2379, 2380) if ns else (free_port(), free_port())
            self.members.append({"name": f"m{i}", "ns": ns, "addr": addr, "cport": cport,
                                 "pport": pport, "dir": str(tmp / f"etcd-m{i}"),
                                 "proc": None})
        self.token = f"pyddp-test-{os.getpid()}-{time.time_ns()}"

    def client_url(self, i):
        m = self.members[i]
        return f"{'https' if self.tls else 'http'}://{m['addr']}:{m['cport']}"

    def endpoint(self, members=None):
        """``etcd://A:P,B:P,...`` of the given members (default all); with TLS each
        member is written with https://."""
        idx = range(len(self.members)) if members is None else members
        if self.tls:
            return "etcd://" + ",".join(self.client_url(i) for i in idx)
        return "etcd://" + ",".join(f"{self.members[i]['addr']}:{self.members[i]['cport']}"
                                    for i in idx)

    def start(self, i=None):
        """Start member i (all without i); a member started again keeps its data
        directory and rejoins."""
        for k in (range(len(self.members)) if i is None else [i]):
            m = self.members[k]
            cluster = ",".join(f"{x['name']}=http://{x['addr']}:{x['pport']}"
                               for x in self.members)
            peer = f"http://{m['addr']}:{m['pport']}"
            cmd = [self.bin, "--name", m["name"], "--data-dir", m["dir"],
                   "--listen-client-urls", self.client_url(k),
                   "--advertise-client-urls", self.client_url(k),
                   "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                   "--initial-cluster", cluster, "--initial-cluster-state", "new",
                   "--initial-cluster-token", self.token]
            if self.tls:
                cmd += ["--cert-file", self.tls["server_cert"], "--key-file",
                        self.tls["server_key"], "--trusted-ca-file", self.tls["ca"],
                        "--client-cert-auth"]
            if m["ns"]:
                cmd = ["ip", "netns", "exec", m["ns"]] + cmd
            log = open(f"{m['dir']}.log", "ab")
            m["proc"] = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
            log.close()

    def kill(self, i):
        """SIGKILL member i (by process id) and reap it."""
        p = self.members[i]["proc"]
        if p is not None and p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=20)
        self.members[i]["proc"] = None

    def alive(self):
        return [i for i, m in enumerate(self.members)
                if m["proc"] is not None and m["proc"].poll() is None]

    def status(self, i, timeout=1.0):
        """Member i's /v3/maintenance/status, or None (no answer). Plain HTTP only: a
        TLS cluster is asked through pyddp's client instead."""
        try:
            req = urllib.request.Request(self.client_url(i) + "/v3/maintenance/status",
                                         data=b"{}", method="POST")
            with self._opener(i).open(req, timeout=timeout) as r:
                return json.loads(r.read())
        except OSError:
            return None

    def _opener(self, i):
        if self.members[i]["ns"]:
            return _NetnsOpener(self.members[i]["ns"])
        return urllib.request.build_opener()

    def leader(self, timeout=20):
        """The index of the current leader, once the live members agree on one."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ids, leaders = {}, set()
            for i in self.alive():
                st = self.status(i)
                if st is None or not st.get("leader") or st["leader"] == "0":
                    break
                ids[st["header"]["member_id"]] = i
                leaders.add(st["leader"])
            else:
                if len(leaders) == 1 and next(iter(leaders)) in ids:
                    return ids[next(iter(leaders))]
            time.sleep(0.2)
        raise AssertionError(f"etcd members {self.alive()} agreed on no leader within "
                             f"{timeout} s; logs under {self.tmp}")

    def move_leader(self, i, timeout=20):
        """Make member i the leader (etcd's MoveLeader, asked of the current leader) and
        return once the live members agree on it. Plain HTTP only."""
        deadline = time.monotonic() + timeout
        while True:
            lead = self.leader(max(deadline - time.monotonic(), 1))
            if lead == i:
                return
            st = self.status(i)
            if st is not None:
                body = json.dumps({"targetID": st["header"]["member_id"]}).encode()
                req = urllib.request.Request(
                    self.client_url(lead) + "/v3/maintenance/transfer-leadership",
                    data=body, method="POST")
                try:
                    self._opener(lead).open(req, timeout=5).read()
                except OSError:
                    pass
            if time.monotonic() >= deadline:
                raise AssertionError(f"etcd member m{i} did not become the leader within "
                                     f"{timeout} s; logs under {self.tmp}")
            time.sleep(0.2)

    def wait_ready(self, timeout=30):
        """Wait until every live member serves and they agree on a leader."""
        if not self.tls:
            return self.leader(timeout)
        from pyddp import EtcdStore
        deadline = time.monotonic() + timeout
        while True:
            try:
                EtcdStore(self.endpoint(self.alive()), "ready").close()
                return None
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.3)

    def close(self):
        for i in range(len(self.members)):
            self.kill(i)


class _NetnsOpener:
    """urllib for a member inside a namespace: the request is made by curl-less Python
    run in that namespace (the test process itself is outside it)."""

    def __init__(self, ns):
        self.ns = ns

    def open(self, req, timeout=1.0):
        code = ("import sys,urllib.request;r=urllib.request.Request(sys.argv[1],"
                "data=b'{}',method='POST');"
                "sys.stdout.write(urllib.request.urlopen(r,timeout=float(sys.argv[2]))"
                ".read().decode())")
        r = subprocess.run(["ip", "netns", "exec", self.ns, sys.executable, "-c", code,
                            req.full_url, str(timeout)], capture_output=True, timeout=10)
        if r.returncode != 0:
            raise OSError(r.stderr.decode()[-200:])
        return _Reply(r.stdout)


class _Reply:
    def __init__(self, data):
        self.data = data

    def read(self):
        return self.data

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def tls_files(tmp, addrs=("127.0.0.1",)):
    """A CA, a server certificate for addrs (IP SANs) and a client certificate, made with
    the openssl command: {"ca", "server_cert", "server_key", "client_cert",
    "client_key"} (paths)."""
    import pytest
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    d = tmp / "tls"
    d.mkdir(exist_ok=True)

    def ssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60,
                       cwd=d)
    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
        "-keyout", "ca.key", "-out", "ca.pem")
    san = ",".join(f"IP:{a}" for a in addrs)
    for who, ext in (("server", f"subjectAltName={san}"), ("client", "extendedKeyUsage=clientAuth")):
        ssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}", "-keyout",
            f"{who}.key", "-out", f"{who}.csr")
        (d / f"{who}.ext").write_text(ext + "\n")
        ssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-out", f"{who}.pem", "-extfile", f"{who}.ext")
    return {"ca": str(d / "ca.pem"), "server_cert": str(d / "server.pem"),
            "server_key": str(d / "server.key"), "client_cert": str(d / "client.pem"),
            "client_key": str(d / "client.key")}
