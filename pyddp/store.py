"""pyddp's key-value stores with torch.distributed's Store API: ``TCPStore`` (torch's
TCPStore wire protocol) and ``EtcdStore`` (an etcd cluster), on one base, ``Store``.

A pyddp TCPStore can serve torch clients and can use a torch server (classic or libuv),
so pyddp and torch code can share the store that torchrun's agent hosts. The work is
done in C (``pyddp._C.StoreClient`` / ``StoreServer``). An EtcdStore keeps its keys in
an etcd cluster (``_etcd_kv``), so that no process of the job holds them. Both are a
``_client`` speaking one protocol (raw byte keys: what the C core's rendezvous calls
too); ``Store`` adds torch's Python-level conventions:

* user keys travel with torch's ``"/"`` prefix, so ``store.set("k", ...)`` here and in
  torch touch the same key;
* values may be ``str`` (encoded UTF-8) or bytes-like; ``get`` returns ``bytes``;
* with ``world_size`` (and ``wait_for_workers``, the default) every instance does
  ``ADD "init/" 1`` on connect and the master waits until the count reaches
  ``world_size``, exactly like torch.
"""
import os
import time
from datetime import timedelta

from . import _C
from ._C import (DistError, DistNetworkError, DistStoreTimeoutError, DistTypeError,
                 DistValueError, StoreClient, StoreServer)

__all__ = ["Store", "TCPStore", "EtcdStore"]

_INIT_KEY = b"init/"        # torch's worker-count key: deliberately without the "/" prefix
_POLL_S = 0.01              # how often the master re-reads the worker count


def _as_bytes(value, what):
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise DistTypeError(f"{what} must be str or bytes, not {type(value).__name__}")


def _auth_mode(auth, is_master):
    """The C client's authentication mode: 0 never, 1 required, 2 try (see TCPStore)."""
    if auth is not None:
        return 1 if auth else 0
    if is_master:
        return 1
    if _C.setting_text("PYDDP_RDZV_STORE") == "pyddp":
        return 1    # the agents of --rdzv-backend=pyddp host pyddp's own store
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return 0    # torchrun's agent hosts torch's TCPStore, which cannot authenticate
    return 2


def _wire_key(key):
    """User key -> bytes on the wire, with torch's "/" prefix."""
    return b"/" + _as_bytes(key, "key")


def _to_ms(timeout, what="timeout"):
    if not isinstance(timeout, timedelta):
        raise DistTypeError(f"{what} must be a datetime.timedelta, not {type(timeout).__name__}")
    if timeout < timedelta(0):
        raise DistValueError(f"{what} must not be negative, got {timeout}")
    return int(timeout / timedelta(milliseconds=1))


class Store:
    """torch.distributed.Store's API over a store client (``_client``, with the
    ``_C.StoreClient`` protocol); subclasses connect it. Every call raises pyddp's
    DistError family: DistStoreTimeoutError (also a TimeoutError) for a timed-out
    ``get``/``wait``, DistStoreError for a failed request, DistNetworkError when the
    store cannot be reached."""

    _client = None
    _server = None
    _timeout_ms = 300000

    # ---- key-value operations (torch.distributed.Store's API) ----------------

    def set(self, key, value):
        """Store value (str or bytes) under key, replacing any previous value."""
        self._client.set(_wire_key(key), _as_bytes(value, "value"))

    def get(self, key):
        """Return key's value as bytes, waiting up to the store timeout for it."""
        return self._client.get(_wire_key(key))

    def add(self, key, amount):
        """Add amount to the integer counter at key (created at 0); return the result."""
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise DistTypeError(f"amount must be an int, not {type(amount).__name__}")
        return self._client.add(_wire_key(key), amount)

    def append(self, key, value):
        """Append value to key's value, creating the key if absent."""
        self._client.append(_wire_key(key), _as_bytes(value, "value"))

    def wait(self, keys, timeout=None):
        """Wait until every key in keys exists (up to timeout, default the store's)."""
        ms = None if timeout is None else _to_ms(timeout)
        self._client.wait(self._wire_keys(keys), ms)

    def multi_get(self, keys):
        """The values of keys, as a list of bytes, waiting up to the store timeout for
        every one (torch's ``Store.multi_get``): one wait and one read, whatever the
        number of keys."""
        return self._client.multi_get(self._wire_keys(keys))

    def multi_set(self, keys, values):
        """Set keys[i] to values[i] (str or bytes) for every i, in one request (torch's
        ``Store.multi_set``). keys and values must have one length."""
        keys, values = list(keys), list(values)
        if len(keys) != len(values):
            raise DistValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        self._client.multi_set(self._wire_keys(keys), [_as_bytes(v, "value") for v in values])

    def check(self, keys):
        """True if every key in keys exists right now."""
        return self._client.check(self._wire_keys(keys))

    def compare_set(self, key, expected_value, desired_value):
        """Set key to desired_value if its value equals expected_value (or if key is
        absent and expected_value is empty); return the value after the operation."""
        return self._client.compare_set(_wire_key(key), _as_bytes(expected_value, "expected_value"),
                                        _as_bytes(desired_value, "desired_value"))

    def delete_key(self, key):
        """Delete key; True if it existed."""
        return self._client.delete_key(_wire_key(key))

    def num_keys(self):
        """Number of keys in the store (torch's ``init/`` counter included)."""
        return self._client.num_keys()

    def set_timeout(self, timeout):
        """Change the default timeout of get and wait."""
        self._timeout_ms = _to_ms(timeout)
        self._client.timeout_ms = self._timeout_ms

    @property
    def timeout(self):
        """The default timeout, as a timedelta."""
        return timedelta(milliseconds=self._timeout_ms)

    @property
    def where(self):
        """The store's address, for messages ("host:port", or "etcd://members")."""
        return f"{self.host}:{self.port}"

    @property
    def route_host(self):
        """A host of the store's: the local address that routes to it is the one this
        process advertises to its peers when nothing else says which."""
        return self.host

    @property
    def recoverable(self):
        """Whether the store may serve again after it stopped answering (an etcd
        cluster that regains a majority); a TCPStore server that went away is gone."""
        return False

    def close(self):
        """Close the connection. Idempotent."""
        self._client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @staticmethod
    def _wire_keys(keys):
        if isinstance(keys, (str, bytes)):
            raise DistTypeError("keys must be a list of keys, not a single key")
        return [_wire_key(k) for k in keys]


class TCPStore(Store):
    """Key-value store compatible with ``torch.distributed.TCPStore``.

    Args:
        host_name: address of the server. For the master it is where the others reach
            it; the master itself listens on all interfaces (as torch's does) and
            connects its own client over loopback.
        port: server port; with ``is_master`` and port 0 an ephemeral port is chosen
            (read it back from ``.port``).
        world_size: number of store users (clients + 1), or None for any number.
        is_master: start the server in this process (and connect to it).
        timeout: default timeout for connecting, ``get`` and ``wait``.
        wait_for_workers: with ``world_size``, register in ``init/`` and (master) wait
            for every worker to do so before returning.
        auth: whether the client authenticates with PYDDP_AUTH_TOKEN (only when a token
            is set; see docs/security.md): True requires it (a server that cannot is an
            error), False never tries (torch's servers cannot), None (default) decides:
            required towards this process's own server, off under torchrun's agent store
            (``TORCHELASTIC_USE_AGENT_STORE=True``), otherwise used when the server asks
            for it (a pyddp server with a token does; torch's servers cannot).
        multi_tenant, master_listen_fd, use_libuv: accepted for compatibility with
            torch and ignored: every master here owns its own C server, always creates
            its own socket, and there is a single server implementation.

    Raises DistNetworkError (a ConnectionError) when the server cannot be reached or
    the port cannot be bound; DistStoreError when a request fails because the server
    sent garbage or closed the connection, or the store was closed (also from another
    thread, which wakes a ``get``/``wait`` in progress); DistStoreTimeoutError, both a
    DistStoreError (as torch raises) and a DistTimeoutError/TimeoutError, when a request
    or the worker count times out; DistValueError/DistTypeError for bad arguments.
    """

    def __init__(self, host_name, port, world_size=None, is_master=False,
                 timeout=timedelta(seconds=300), wait_for_workers=True, multi_tenant=False,
                 master_listen_fd=None, use_libuv=True, auth=None):
        if not isinstance(host_name, str):
            raise DistTypeError(f"host_name must be str, not {type(host_name).__name__}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise DistValueError(f"port must be an int in 0..65535, got {port!r}")
        if port == 0 and not is_master:
            raise DistValueError("a client TCPStore needs the server's port, not 0")
        if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
            raise DistValueError(f"world_size must be a positive int or None, got {world_size!r}")
        self._host = host_name
        self._timeout_ms = _to_ms(timeout)
        self._server = None
        self._client = StoreClient()
        if is_master:
            self._server = StoreServer()
            try:
                port = self._server.start(None, port)
            except DistError as e:
                # torch reports a busy or unbindable port as DistNetworkError.
                raise DistNetworkError(f"TCPStore master could not listen on port {port}: "
                                       f"{e}") from None
        self._port = port
        try:
            self._client.connect("localhost" if is_master else host_name, port,
                                 self._timeout_ms, _auth_mode(auth, is_master))
            if world_size is not None and wait_for_workers:
                self._client.add(_INIT_KEY, 1)
                if is_master:
                    self._wait_for_workers(world_size)
        except BaseException:
            self.close()
            raise

    def _wait_for_workers(self, world_size):
        """Poll the worker count until it reaches world_size or the timeout passes."""
        deadline = time.monotonic() + self._timeout_ms / 1000.0
        while True:
            joined = self._client.add(_INIT_KEY, 0)
            if joined >= world_size:
                return
            if time.monotonic() >= deadline:
                raise DistStoreTimeoutError(
                    f"TCPStore master on port {self._port}: timed out after "
                    f"{self._timeout_ms / 1000.0:.1f} s waiting for workers: {joined} of "
                    f"{world_size} joined. Check that every worker was started and can reach "
                    f"this host on TCP port {self._port}.")
            time.sleep(_POLL_S)

    # ---- properties and lifetime -------------------------------------------

    @property
    def host(self):
        """The host name this store was created with."""
        return self._host

    @property
    def port(self):
        """The server's port (the bound one, for a master created with port 0)."""
        return self._port

    def clone(self, timeout=None):
        """Another connection of this process's to the same server (a client of this
        store's own server when this is the master)."""
        host = "localhost" if self._server is not None else self._host
        return TCPStore(host, self._port, is_master=False,
                        timeout=self.timeout if timeout is None else timeout)

    def close(self):
        """Close the connection and, on the master, stop the server. Idempotent and
        safe from another thread or a signal handler: a request in progress fails at
        once with DistStoreError."""
        self._client.close()
        if self._server is not None:
            self._server.stop()

    def __repr__(self):
        role = "master" if self._server is not None else "client"
        return f"<pyddp.TCPStore {role} {self._host!r}:{self._port}>"


class EtcdStore(Store):
    """A store whose keys live in an etcd cluster (its v3 API), with torch's Store API:
    the job's store of ``--rdzv-backend=pyddp --rdzv-endpoint=etcd://...`` (no training
    node holds it, so the job can lose any node), also usable as
    ``init_process_group(store=EtcdStore(...), rank=, world_size=)``.

    Args:
        endpoints: the members, ``"etcd://E1:2379,E2:2379,E3:2379"`` (or a list of
            ``HOST:PORT``; ``https://`` members for TLS): any of them may be down, the
            others are tried at once.
        namespace: every key is kept under ``<namespace>/`` in etcd, so one cluster can
            serve many jobs (pyddp's rendezvous uses ``pyddp/<rdzv id>``).
        timeout: default timeout of ``get`` and ``wait``.

    TLS, user/password and how long a request keeps trying the members come from the
    PYDDP_ETCD_* settings (docs/env.md). Connecting sends one request, so an endpoint
    without a working etcd fails here, with EtcdUnavailable (a DistNetworkError) naming
    the members. ``get``/``wait`` watch the keys (no polling); ``add`` and
    ``compare_set`` are etcd transactions."""

    def __init__(self, endpoints, namespace="pyddp", timeout=timedelta(seconds=300)):
        from . import _etcd, _etcd_kv
        if not isinstance(endpoints, str):
            endpoints = ",".join(endpoints)
        if not isinstance(namespace, str) or not namespace.strip("/"):
            raise DistValueError(f"namespace must be a non-empty str, got {namespace!r}")
        self._endpoints, self._namespace = endpoints, namespace.strip("/")
        self._timeout_ms = _to_ms(timeout)
        cluster = _etcd.Cluster(_etcd.parse_members(endpoints))
        self._client = _etcd_kv.EtcdKV(cluster, (self._namespace + "/").encode(),
                                       self._timeout_ms)
        try:
            self._client.num_keys()
        except BaseException:
            self.close()
            raise

    @property
    def host(self):
        """The members, as given (``etcd://...``)."""
        return self._client.peer

    @property
    def port(self):
        return None

    @property
    def where(self):
        return self._client.peer

    @property
    def route_host(self):
        return self._client.cluster.members[0].host

    @property
    def namespace(self):
        return self._namespace

    @property
    def recoverable(self):
        return True

    def clone(self, timeout=None):
        """Another client of the same cluster and namespace."""
        return EtcdStore(self._endpoints, self._namespace,
                         self.timeout if timeout is None else timeout)

    def hold(self, key, value, ttl_s):
        """Keep key set to value while this process refreshes its lease (every third of
        ttl_s): it disappears ttl_s after the process dies or loses etcd. Returns a
        handle whose ``release()`` deletes it at once."""
        return self._client.hold(_wire_key(key), _as_bytes(value, "value"), ttl_s)

    def keys_under(self, prefix):
        """The user keys that start with prefix, now."""
        return [k[1:].decode() for k in self._client.keys_under(_wire_key(prefix))]

    def __repr__(self):
        return f"<pyddp.EtcdStore {self._client.peer} namespace={self._namespace!r}>"
