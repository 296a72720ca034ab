"""pyddp's store client protocol on an etcd cluster: what ``_C.StoreClient`` does on a
TCPStore server (set, get, add, append, wait, check, multi_get, multi_set, compare_set,
delete_key, num_keys; keys are raw bytes), done with etcd's requests (``_etcd``), every
key under the store's namespace. ``pyddp.EtcdStore`` builds torch's Store API on it, and
the C core's rendezvous uses it through the same protocol (``csrc/py/py_store_py.c``).

* ``wait`` (and ``get`` of a key not there yet) reads the keys once and then watches
  them from the revision it read (no polling): a watch that breaks is opened again on
  another member from the last revision seen. Every ``RECHECK_S`` while nothing arrives
  the keys are read again through the failover path, so that a watch held by a member
  cut off from the others (which would never see the key written) cannot make a wait
  miss it.
* ``add``, ``append`` and ``compare_set`` are compare-and-swap transactions; ``add``
  keeps TCPStore's ASCII decimal value. A transaction whose answer was lost (its member
  died) is read again and retried: an ``add`` may then count twice in the rare case
  that the lost one was applied; pyddp's users of counters tolerate a skipped number.
* Every request gives up once etcd has served nothing for PYDDP_ETCD_TIMEOUT
  (``EtcdUnavailable``, naming etcd and its need for a majority); a ``wait`` gives up at
  its own deadline too (``DistStoreTimeoutError``).
* ``hold(key, value, ttl_s)`` keeps a key alive with a lease (``Held``): a thread
  refreshes it every third of its TTL; the key goes when this process stops refreshing
  (it died, or its host is gone) and etcd's TTL runs out.
"""
import json
import threading
import time

from . import _C
from . import _etcd as E

RECHECK_S = 5.0        # a wait reads its keys again this often while nothing arrives
_TXN_OPS = 64          # operations per transaction (etcd's default limit is 128)


def _deadline(ms):
    return time.monotonic() + (ms / 1000.0 if ms is not None and ms >= 0 else 10 ** 9)


class EtcdKV:
    """The store client protocol over cluster (an ``_etcd.Cluster``), keys under
    namespace (bytes). timeout_ms: the default deadline of get and wait."""

    def __init__(self, cluster, namespace, timeout_ms):
        self.cluster = cluster
        self._ns = namespace
        self.timeout_ms = int(timeout_ms)

    @property
    def peer(self):
        return f"etcd://{self.cluster.describe()}"

    def _k(self, key):
        return self._ns + bytes(key)

    def close(self):
        self.cluster.close()

    # -- writes ----------------------------------------------------------------------------

    def _dl(self, timeout_ms=None):
        """The deadline of one request: the call's timeout (default the client's), at
        most PYDDP_ETCD_TIMEOUT from now."""
        ms = self.timeout_ms if timeout_ms is None else timeout_ms
        s = self.cluster.timeout_s if ms is None or ms < 0 else min(ms / 1000.0,
                                                                   self.cluster.timeout_s)
        return time.monotonic() + s

    def set(self, key, value, timeout_ms=None):
        self.cluster.put(self._k(key), bytes(value), deadline=self._dl(timeout_ms))

    def multi_set(self, keys, values, timeout_ms=None):
        last = {}
        for k, v in zip(keys, values):       # a repeated key: the last value wins
            last[self._k(k)] = bytes(v)
        items = list(last.items())
        dl = self._dl(timeout_ms)
        for i in range(0, len(items), _TXN_OPS):
            self.cluster.txn([], [E.op_put(k, v) for k, v in items[i:i + _TXN_OPS]],
                             deadline=dl)

    def delete_key(self, key, timeout_ms=None):
        return self.cluster.delete(self._k(key), deadline=self._dl(timeout_ms)) > 0

    def add(self, key, delta, timeout_ms=None):
        """TCPStore's ADD: the counter at key (absent: 0) plus delta, stored as ASCII. A
        read (delta 0) is served by the member itself (serializable): it answers
        while etcd elects a leader, at worst a moment behind the others."""
        k, dl = self._k(key), self._dl(timeout_ms)
        kvs = self.cluster.range(k, serializable=delta == 0, deadline=dl)[0]
        while True:
            cur = _as_int(kvs[0]["value"], key) if kvs else 0
            if delta == 0:
                return cur
            cmp = E.cmp_mod(k, kvs[0]["mod_revision"]) if kvs else E.cmp_absent(k)
            ok, resp, _ = self.cluster.txn([cmp], [E.op_put(k, str(cur + delta).encode())],
                                           [E.op_range(k)], deadline=dl)
            if ok:
                return cur + delta
            kvs = E.range_kvs(resp[0])

    def append(self, key, value, timeout_ms=None):
        k, dl = self._k(key), self._dl(timeout_ms)
        kvs = self.cluster.range(k, deadline=dl)[0]
        while True:
            cmp = E.cmp_mod(k, kvs[0]["mod_revision"]) if kvs else E.cmp_absent(k)
            new = (kvs[0]["value"] if kvs else b"") + bytes(value)
            ok, resp, _ = self.cluster.txn([cmp], [E.op_put(k, new)], [E.op_range(k)],
                                           deadline=dl)
            if ok:
                return
            kvs = E.range_kvs(resp[0])

    def compare_set(self, key, expected, desired, timeout_ms=None):
        """TCPStore's COMPARE_SET: absent key and empty expected stores desired; absent
        key otherwise returns expected; a present key is swapped only if its value
        equals expected. Returns the value after the operation."""
        k, expected, desired = self._k(key), bytes(expected), bytes(desired)
        cmp = E.cmp_value(k, expected) if expected else E.cmp_absent(k)
        ok, resp, _ = self.cluster.txn([cmp], [E.op_put(k, desired)], [E.op_range(k)],
                                       deadline=self._dl(timeout_ms))
        if ok:
            return desired
        kvs = E.range_kvs(resp[0])
        return kvs[0]["value"] if kvs else expected

    # -- reads -----------------------------------------------------------------------------

    def _read(self, full, dl=None):
        """({key: value} of the keys of full that exist, revision), in transactions of
        at most _TXN_OPS ranges, by the deadline dl (default PYDDP_ETCD_TIMEOUT from
        now). A wait reads with the default: its own deadline governs its watch."""
        found, rev = {}, 0
        for i in range(0, len(full), _TXN_OPS):
            part = full[i:i + _TXN_OPS]
            if len(part) == 1:
                kvs, r, _ = self.cluster.range(part[0], deadline=dl)
            else:
                _, resp, r = self.cluster.txn([], [E.op_range(k) for k in part],
                                              deadline=dl)
                kvs = [kv for one in resp for kv in E.range_kvs(one)]
            rev = max(rev, r) if rev else r
            for kv in kvs:
                found[kv["key"]] = kv["value"]
        return found, rev

    def check(self, keys, timeout_ms=None):
        full = [self._k(k) for k in keys]
        return len(self._read(full, self._dl(timeout_ms))[0]) == len(set(full))

    def get(self, key, timeout_ms=None):
        """key's value, waiting up to timeout_ms (default: the client's) for it."""
        return self.multi_get([key], timeout_ms)[0]

    def multi_get(self, keys, timeout_ms=None):
        full = [self._k(k) for k in keys]
        deadline = _deadline(self.timeout_ms if timeout_ms is None else timeout_ms)
        while True:
            found, rev = self._read(full)
            if all(k in found for k in full):
                return [found[k] for k in full]
            self._watch_until_present(full, found, rev, deadline, keys)

    def wait(self, keys, timeout_ms=None):
        full = [self._k(k) for k in keys]
        deadline = _deadline(self.timeout_ms if timeout_ms is None else timeout_ms)
        found, rev = self._read(full)
        if not all(k in found for k in full):
            self._watch_until_present(full, found, rev, deadline, keys)

    def num_keys(self, timeout_ms=None):
        return self.cluster.range(self._ns, E.prefix_end(self._ns), count_only=True,
                                  deadline=self._dl(timeout_ms))[2]

    def _watch_until_present(self, full, found, rev, deadline, user_keys):
        """Return once every key of full existed at one revision after rev (found: the
        keys that existed at rev), or raise DistStoreTimeoutError at deadline."""
        missing = {k for k in full if k not in found}
        while missing:
            lo, hi = min(missing), max(missing) + b"\0"
            body = {"create_request": {"key": E.b64(lo), "range_end": E.b64(hi),
                                       "start_revision": str(rev + 1)}}
            conn, _, first = self._open(body, deadline, user_keys, missing)
            try:
                if first.get("result", {}).get("canceled"):
                    missing, rev = self._reread(full, deadline, user_keys)   # compacted
                    continue
                recheck = time.monotonic() + RECHECK_S
                while missing:
                    line = conn.next_line(min(deadline, recheck))
                    if line is None:
                        if time.monotonic() >= deadline:
                            raise self._timeout(user_keys, full, missing)
                        missing, _ = self._reread(full, deadline, user_keys)
                        recheck = time.monotonic() + RECHECK_S
                        continue
                    res = json.loads(line).get("result", {})
                    if res.get("canceled"):
                        break
                    for ev in res.get("events", ()):
                        k = E.unb64(ev.get("kv", {}).get("key"))
                        if k in full:
                            (missing.add if ev.get("type") == "DELETE" else missing.discard)(k)
                    rev = max(rev, int(res.get("header", {}).get("revision", rev)))
            except (OSError, ValueError):
                if self.cluster.closed:
                    raise _C.DistStoreError(f"the etcd client for {self.peer} was closed "
                                            f"while waiting") from None
                # the stream broke (its member died): read again, watch again
            finally:
                self.cluster.end_stream(conn)
            if missing:
                missing, rev = self._reread(full, deadline, user_keys)

    def _reread(self, full, deadline, user_keys):
        if time.monotonic() >= deadline:
            raise self._timeout(user_keys, full, {k for k in full})
        found, rev = self._read(full)
        return {k for k in full if k not in found}, rev

    def _open(self, body, deadline, user_keys, missing):
        """A watch stream (conn, member, first line) within deadline."""
        try:
            return self.cluster.open_stream("/v3/watch", body, min(
                deadline, time.monotonic() + self.cluster.timeout_s))
        except E.EtcdUnavailable:
            if time.monotonic() >= deadline:
                raise self._timeout(user_keys, [self._k(k) for k in user_keys],
                                    missing) from None
            raise

    def _timeout(self, user_keys, full, missing):
        name = next((bytes(u) for u, f in zip(user_keys, full) if f in missing),
                    b"?").decode(errors="replace")
        return _C.DistStoreTimeoutError(
            f"etcd://{self.cluster.describe()}: timed out waiting for key {name!r} "
            f"({len(missing)} of {len(set(full))} keys missing)")

    # -- liveness --------------------------------------------------------------------------

    def hold(self, key, value, ttl_s):
        """Keep key (set to value) alive with a lease of ttl_s seconds until the returned
        Held is released (see the module's docstring)."""
        return Held(self, self._k(key), bytes(value), ttl_s)

    def keys_under(self, prefix):
        """The keys (without this client's namespace) that start with prefix now."""
        p = self._k(prefix)
        kvs = self.cluster.range(p, E.prefix_end(p))[0]
        return [kv["key"][len(self._ns):] for kv in kvs]


class Held:
    """A key kept alive by a lease and a refreshing thread (EtcdKV.hold). If the lease
    ran out meanwhile (this process was stopped, or cut off, for longer than its TTL),
    the thread takes a new one and writes the key again. ``lost`` is the last error of
    a refresh that failed (None while refreshes succeed)."""

    def __init__(self, kv, full_key, value, ttl_s):
        self._kv, self._key, self._value = kv, full_key, value
        self.ttl_s = max(int(ttl_s), 2)
        self.lost = None
        self._stop = threading.Event()
        self._lease = self._grant()
        self._thread = threading.Thread(target=self._run, name="pyddp-etcd-lease",
                                        daemon=True)
        self._thread.start()

    def _grant(self):
        c = self._kv.cluster
        lease = c.grant(self.ttl_s)
        c.put(self._key, self._value, lease=lease)
        return lease

    def _run(self):
        c = self._kv.cluster
        while not self._stop.wait(self.ttl_s / 3.0):
            try:
                if c.keepalive(self._lease, time.monotonic() + self.ttl_s) <= 0:
                    self._lease = self._grant()
                self.lost = None
            except (_C.DistError, OSError) as e:
                self.lost = e

    def release(self):
        """Stop refreshing and revoke the lease (the key goes at once). Best effort."""
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self._kv.cluster.revoke(self._lease, time.monotonic() + 2)
        except (_C.DistError, OSError):
            pass


def _as_int(value, key):
    try:
        return int(value or b"0")
    except ValueError:
        raise _C.DistStoreError(f"add: the value of key {bytes(key)!r} is not an integer: "
                                f"{bytes(value)[:40]!r}") from None
