"""A client of an etcd cluster (its v3 API, over the JSON gateway every member serves):
the requests pyddp's etcd-backed store is made of, sent so that the loss of any member,
the leader included, costs a retry and not an error.

Members are named as in ``--rdzv-endpoint=etcd://E1:2379,E2:2379,E3:2379`` (each
``HOST:PORT``, ``[V6]:PORT``, or with ``http://``/``https://``; without a scheme a member
is ``https`` when PYDDP_ETCD_CACERT is set, else ``http``). Settings: PYDDP_ETCD_CACERT,
PYDDP_ETCD_CERT, PYDDP_ETCD_KEY (TLS: the CA that signed the members' certificates, and
this client's certificate and key when the members ask for one), PYDDP_ETCD_USER with
PYDDP_ETCD_PASSWORD or PYDDP_ETCD_PASSWORD_FILE (etcd's user/password auth), and
PYDDP_ETCD_TIMEOUT (how long one request keeps trying the members).

Failover (``Cluster.call``): a request goes to the member that answered last; one that
refuses the connection, does not answer within ``ATTEMPT_S`` (1 s in the first round of
the members, 2 s in the second, 3 s from then on: a member that lost its leader can
hold a request 5-7 s before it gives up, and an election takes 1-2 s), or answers that
it has no leader is left for the next member at once; after a round of all of them the
client waits a little (0.05 s, doubling up to 0.5 s) and goes round again,
until PYDDP_ETCD_TIMEOUT has passed. Then :class:`EtcdUnavailable` names the members and
says that etcd serves requests only while a majority of its members is up. An answer
that is an error of the request itself (permission denied, a bad argument) is raised at
once as :class:`EtcdError`. A request that timed out may still have been applied by the
member: ``put``s are idempotent; compare-and-swap loops (``_etcd_kv``) read again.

Keys and values are bytes (base64 in the JSON). Revisions and lease ids are ints.
"""
import base64
import json
import ssl
import threading
import time

from . import _C
from ._etcd_http import Conn, ProtocolError

ATTEMPT_S = 1.0          # one request on one member in the first round of the members
#                          (2 s in the second, 3 s from the third on)
CONNECT_S = 1.0          # connecting to one member
_RETRYABLE = {1, 2, 4, 8, 10, 14}   # gRPC codes: cancelled, unknown, deadline, exhausted,
#                                     aborted, unavailable (no leader, leader changed, ...)


class EtcdUnavailable(_C.DistNetworkError):
    """No member of the etcd cluster served a request within PYDDP_ETCD_TIMEOUT: the
    cluster has no majority up, or cannot be reached from here."""


class EtcdError(_C.DistStoreError):
    """etcd refused a request (permission denied, a bad argument, a failed login)."""


def b64(data):
    return base64.b64encode(data).decode("ascii")


def unb64(text):
    return base64.b64decode(text) if text else b""


def prefix_end(prefix):
    """The range_end that makes [prefix, range_end) every key starting with prefix."""
    p = bytearray(prefix)
    while p:
        if p[-1] < 0xFF:
            p[-1] += 1
            return bytes(p)
        p.pop()
    return b"\0"


class Member:
    """One etcd member's client URL."""

    def __init__(self, scheme, host, port):
        self.scheme, self.host, self.port = scheme, host, port

    def __str__(self):
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}" if self.scheme == "http" else \
            f"https://{host}:{self.port}"


def parse_members(text):
    """[Member] from ``etcd://M1,M2,...`` (or the list alone); DistValueError naming the
    text when a member is malformed."""
    body = text.strip()
    if body.startswith("etcd://"):
        body = body[len("etcd://"):]
    default = "https" if (_C.setting_text("PYDDP_ETCD_CACERT") or "") else "http"
    out = []
    for item in body.split(","):
        item = item.strip().rstrip("/")
        if not item:
            continue
        scheme = default
        if "://" in item:
            scheme, item = item.split("://", 1)
            if scheme not in ("http", "https"):
                raise _C.DistValueError(f"{text!r}: etcd member {item!r} has the scheme "
                                        f"{scheme!r}; use http:// or https://")
        if item.startswith("["):
            host, _, rest = item[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else ""
        else:
            host, _, port = item.rpartition(":") if ":" in item else (item, "", "")
        if not host or (port and not port.isdigit()) or (port and not 0 < int(port) < 65536):
            raise _C.DistValueError(f"{text!r}: etcd member {item!r} is not HOST:PORT")
        out.append(Member(scheme, host, int(port) if port else 2379))
    if not out:
        raise _C.DistValueError(f"{text!r} names no etcd member: expected "
                                f"etcd://HOST:PORT[,HOST:PORT...]")
    return out


def _tls_context():
    """The TLS context for https members, from PYDDP_ETCD_CACERT/CERT/KEY."""
    ca = _C.setting_text("PYDDP_ETCD_CACERT") or None
    cert = _C.setting_text("PYDDP_ETCD_CERT") or None
    key = _C.setting_text("PYDDP_ETCD_KEY") or None
    try:
        ctx = ssl.create_default_context(cafile=ca)
        if cert:
            ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise _C.DistValueError(f"etcd TLS settings (PYDDP_ETCD_CACERT={ca}, "
                                f"PYDDP_ETCD_CERT={cert}, PYDDP_ETCD_KEY={key}): {e}") from None
    if key and not cert:
        raise _C.DistValueError("PYDDP_ETCD_KEY is set without PYDDP_ETCD_CERT")
    return ctx


def _credentials():
    """(user, password) for etcd's auth, or (None, None)."""
    user = _C.setting_text("PYDDP_ETCD_USER") or None
    if user is None:
        return None, None
    password = _C.setting_text("PYDDP_ETCD_PASSWORD")
    path = _C.setting_text("PYDDP_ETCD_PASSWORD_FILE")
    if password is None and path:
        try:
            with open(path) as f:
                password = f.read().rstrip("\r\n")
        except OSError as e:
            raise _C.DistValueError(f"PYDDP_ETCD_PASSWORD_FILE={path}: {e}") from None
    if password is None:
        raise _C.DistValueError("PYDDP_ETCD_USER is set without PYDDP_ETCD_PASSWORD or "
                                "PYDDP_ETCD_PASSWORD_FILE")
    return user, password


class Cluster:
    """Requests to one etcd cluster, safe to share between threads (each request takes
    an idle connection of its member, or makes one). See the module's docstring."""

    def __init__(self, members, timeout_s=None):
        self.members = list(members)
        self.timeout_s = float(_C.setting("PYDDP_ETCD_TIMEOUT")) if timeout_s is None \
            else float(timeout_s)
        self._tls = _tls_context() if any(m.scheme == "https" for m in self.members) \
            else None
        self._user, self._password = _credentials()
        self._token = None
        self._lock = threading.Lock()
        self._idle = {i: [] for i in range(len(self.members))}
        self._streams = set()          # open watch connections (close() shuts them)
        self._preferred = 0
        self._closed = False

    def describe(self):
        return ",".join(str(m) for m in self.members)

    @property
    def closed(self):
        return self._closed

    def close(self):
        """Close every idle connection and every open watch (a wait in progress on
        another thread fails at once); requests made afterwards fail."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {i: [] for i in range(len(self.members))}
            streams, self._streams = list(self._streams), set()
        for conns in idle.values():
            for c in conns:
                c.close()
        for c in streams:
            c.shutdown()

    def end_stream(self, conn):
        """Close a stream from open_stream."""
        with self._lock:
            self._streams.discard(conn)
        conn.close()

    # -- connections ---------------------------------------------------------------------

    def _conn(self, i):
        with self._lock:
            if self._closed:
                raise _C.DistStoreError(f"the etcd client for {self.describe()} was closed")
            if self._idle[i]:
                return self._idle[i].pop()
        m = self.members[i]
        return Conn(m.scheme, m.host, m.port, self._tls, CONNECT_S)

    def _give_back(self, i, conn):
        if conn.closed:
            return
        with self._lock:
            if not self._closed and len(self._idle[i]) < 4:
                self._idle[i].append(conn)
                return
        conn.close()

    def order(self):
        """Member indices, the one that answered last first."""
        p = self._preferred
        return [(p + k) % len(self.members) for k in range(len(self.members))]

    def unavailable(self, what, last, budget=None):
        n = len(self.members)
        return EtcdUnavailable(
            f"etcd at {self.describe()} did not serve {what} within "
            f"{self.timeout_s if budget is None else budget:.3g} s "
            f"(last error: {last}). etcd serves requests only while a majority of its "
            f"members ({n // 2 + 1} of {n}, if these are all its members) is up and "
            f"reachable: check the members (etcdctl endpoint health), the network to "
            f"them, and PYDDP_ETCD_TIMEOUT")

    # -- one request ---------------------------------------------------------------------

    def call(self, path, body, deadline=None):
        """The decoded JSON reply of POST path (a /v3/... path) with body (a dict), from
        the first member that serves it (see the module's docstring). deadline: a
        time.monotonic() by which to give up (default PYDDP_ETCD_TIMEOUT from now).
        Raises EtcdUnavailable, EtcdError."""
        start = time.monotonic()
        deadline = deadline if deadline is not None else start + self.timeout_s
        data = json.dumps(body).encode()
        last, pause, rnd = "no member was tried", 0.05, 1
        while True:
            for i in self.order():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self.unavailable(path, last, deadline - start)
                try:
                    reply = self._attempt(i, path, data, min(ATTEMPT_S * rnd, left))
                except (OSError, ValueError) as e:
                    last = f"{self.members[i]}: {_why(e)}"
                    continue
                if "code" in reply and ("error" in reply or "message" in reply):
                    code, msg = reply.get("code"), reply.get("message") or reply.get("error")
                    if code in _RETRYABLE or "timed out" in str(msg):
                        last = f"{self.members[i]}: {msg}"
                        continue
                    raise EtcdError(f"etcd at {self.members[i]} refused {path}: {msg} "
                                    f"(code {code})")
                self._preferred = i
                return reply
            time.sleep(min(pause, max(deadline - time.monotonic(), 0)))
            pause, rnd = min(pause * 2, 0.5), min(rnd + 1, 3)

    def _attempt(self, i, path, data, timeout):
        """One try on member i: the decoded reply (a dict; an error reply has "code")."""
        conn = self._conn(i)
        try:
            for _ in range(2):
                status, raw = conn.request(path, data, self._auth_header(i, timeout), timeout)
                reply = json.loads(raw) if raw else {}
                if status == 200 or self._user is None or not _bad_token(reply):
                    break
                self._token = None                    # expired: log in again, once
            if status != 200 and "code" not in reply:
                raise ProtocolError(f"HTTP {status} {raw[:200]!r}")
            return reply
        finally:
            self._give_back(i, conn)

    def _auth_header(self, i, timeout):
        if self._user is None:
            return None
        if self._token is None:
            conn = self._conn(i)
            try:
                status, raw = conn.request("/v3/auth/authenticate", json.dumps(
                    {"name": self._user, "password": self._password}).encode(), None, timeout)
            finally:
                self._give_back(i, conn)
            reply = json.loads(raw) if raw else {}
            if status != 200 or "token" not in reply:
                msg = reply.get("message") or reply.get("error") or raw[:200]
                if reply.get("code") in _RETRYABLE:
                    raise ProtocolError(str(msg))
                raise EtcdError(f"etcd at {self.members[i]} refused the login of "
                                f"PYDDP_ETCD_USER={self._user}: {msg}")
            self._token = reply["token"]
        return {"Authorization": self._token}

    # -- streams -------------------------------------------------------------------------

    def open_stream(self, path, body, deadline):
        """(conn, member index, first line) of a streamed request (a watch) on the first
        member that takes it; the caller reads it and ends it with end_stream. Raises
        EtcdUnavailable, or DistStoreError once the client is closed."""
        data = json.dumps(body).encode()
        last, pause, rnd = "no member was tried", 0.05, 1
        while True:
            for i in self.order():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self.unavailable(path, last)
                t = min(ATTEMPT_S * rnd, left)
                conn = None
                try:
                    headers = self._auth_header(i, t)
                    m = self.members[i]
                    conn = Conn(m.scheme, m.host, m.port, self._tls, min(CONNECT_S, t))
                    status, err = conn.stream(path, data, headers, t)
                    if err is not None or status != 200:
                        raise ProtocolError(f"HTTP {status} {(err or b'')[:200]!r}")
                    first = conn.next_line(time.monotonic() + t)
                    if first is None:
                        raise TimeoutError("no reply to the watch")
                    with self._lock:
                        if self._closed:
                            raise _C.DistStoreError(f"the etcd client for "
                                                    f"{self.describe()} was closed")
                        self._streams.add(conn)
                    return conn, i, json.loads(first)
                except BaseException as e:
                    if conn is not None:
                        conn.close()
                    if not isinstance(e, (OSError, ValueError)):
                        raise
                    last = f"{self.members[i]}: {_why(e)}"
            time.sleep(min(pause, max(deadline - time.monotonic(), 0)))
            pause, rnd = min(pause * 2, 0.5), min(rnd + 1, 3)

    # -- the KV and lease requests --------------------------------------------------------

    def range(self, key, range_end=None, count_only=False, serializable=False,
              deadline=None):
        """(kvs, revision, count): kvs a list of dicts with key/value (bytes),
        mod_revision, create_revision, version, lease (ints). serializable: served by
        the member from its own state (no leader needed; may lag the others)."""
        body = {"key": b64(key)}
        if serializable:
            body["serializable"] = True
        if range_end is not None:
            body["range_end"] = b64(range_end)
        if count_only:
            body["count_only"] = True
        reply = self.call("/v3/kv/range", body, deadline)
        return ([_kv(k) for k in reply.get("kvs", ())], _rev(reply),
                int(reply.get("count", 0)))

    def put(self, key, value, lease=None, deadline=None):
        body = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = str(lease)
        return _rev(self.call("/v3/kv/put", body, deadline))

    def delete(self, key, range_end=None, deadline=None):
        body = {"key": b64(key)}
        if range_end is not None:
            body["range_end"] = b64(range_end)
        return int(self.call("/v3/kv/deleterange", body, deadline).get("deleted", 0))

    def txn(self, compare, success, failure=(), deadline=None):
        """(succeeded, [responses], revision) of a transaction (compare/success/failure
        in the gateway's JSON form: see the helpers below)."""
        reply = self.call("/v3/kv/txn", {"compare": list(compare), "success": list(success),
                                         "failure": list(failure)}, deadline)
        return bool(reply.get("succeeded")), reply.get("responses", []), _rev(reply)

    def grant(self, ttl_s, deadline=None):
        return int(self.call("/v3/lease/grant", {"TTL": str(int(ttl_s))}, deadline)["ID"])

    def keepalive(self, lease, deadline=None):
        """The lease's remaining TTL after refreshing it; 0 when it no longer exists."""
        reply = self.call("/v3/lease/keepalive", {"ID": str(lease)}, deadline)
        return int(reply.get("result", reply).get("TTL", 0))

    def revoke(self, lease, deadline=None):
        try:
            self.call("/v3/lease/revoke", {"ID": str(lease)}, deadline)
        except EtcdError:
            pass                    # already expired: nothing to revoke


def op_put(key, value, lease=None):
    body = {"key": b64(key), "value": b64(value)}
    if lease:
        body["lease"] = str(lease)
    return {"request_put": body}


def op_range(key, range_end=None):
    body = {"key": b64(key)}
    if range_end is not None:
        body["range_end"] = b64(range_end)
    return {"request_range": body}


def cmp_absent(key):
    return {"key": b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}


def cmp_mod(key, revision):
    return {"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(revision)}


def cmp_value(key, value):
    return {"key": b64(key), "target": "VALUE", "result": "EQUAL", "value": b64(value)}


def range_kvs(response):
    """The kvs of one txn response that is a range's."""
    r = response.get("response_range", {})
    return [_kv(k) for k in r.get("kvs", ())]


def _kv(k):
    return {"key": unb64(k.get("key")), "value": unb64(k.get("value")),
            "mod_revision": int(k.get("mod_revision", 0)),
            "create_revision": int(k.get("create_revision", 0)),
            "version": int(k.get("version", 0)), "lease": int(k.get("lease", 0))}


def _rev(reply):
    return int(reply.get("header", {}).get("revision", 0))


def _bad_token(reply):
    msg = str(reply.get("message") or reply.get("error") or "")
    return "auth token" in msg or reply.get("code") == 16


def _why(e):
    text = str(e) or type(e).__name__
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    return text if len(text) < 200 else text[:200]
