"""Process groups: init_process_group, new_group, destroy_process_group and the
queries about them (rank, world size, backend).

A :class:`Group` wraps one ``_C.ProcessGroup``, which carries the CPU transport and,
for GPU arrays, an NCCL communicator created on first use (or at init for
``backend="nccl"``). Subgroups from :func:`new_group` run on the links of the group
they are made from (no second rendezvous): creating one is member-only and needs no
communication, and their collectives carry their own group tag, so a rank that calls
a collective on a different group than its peers gets a mismatch error, not a hang.

init_process_group resolves the rendezvous (``_env``), connects to or hosts the store,
then builds the backend's process group through the C core, which publishes this rank's
address under pyddp's own key prefix ``/pyddp/<run id>/<restart count>/<generation>``
and connects to every peer. The prefix makes a torchrun restart (whose agent store still
holds the previous attempt's keys) and a second init in the same process start clean,
and keeps pyddp out of the way of torch code using the same store.
"""
import logging
import os
import re
import sys
import time
import uuid

from . import _C, _env, _exit, _forensics
from ._version import __version__
from .store import TCPStore

log = logging.getLogger("pyddp")

_BACKENDS = ("cpu", "gloo", "nccl")


class _State:
    pg = None              # the default Group
    backend = None         # what get_backend() says: the name asked for ("cpu", "gloo",
                           # "nccl"), or for backend=None "nccl" where GPU arrays use NCCL
                           # and "cpu" otherwise
    groups_made = 0        # new_group() calls since init: every rank counts the same
    store = None           # TCPStore
    rank = -1
    world_size = -1
    timeout_s = None
    generation = 0         # inits so far in this process: part of the key prefix
    file_path = None       # file:// rendezvous file that rank 0 wrote
    device_id = None       # init_process_group(device_id=...)
    prefix = None
    own_store = False      # the store client was made by init_process_group
    # Stores this process hosts, by (method, port or path). They live as long as the
    # process, like torchrun's agent store: a peer may still be reading from one when
    # this rank destroys its group or fails its init, and a later init with the same
    # address reuses the server instead of racing its peers to rebind the port.
    hosted = {}


class WORLD:
    """Stand-in for torch's ``group.WORLD``: the default group."""


class Group:
    """A process group: its member ranks (``ranks``, global ranks in increasing order),
    this process's rank in it (``rank``; -1 on a rank that is not a member) and its
    ``size``. Pass it as ``group=`` to any collective. Made by :func:`new_group` (or,
    for torch's backend, by :func:`create_world` and :meth:`subgroup`)."""

    def __init__(self, pg, ranks, backend, store, prefix, timeout_s, world_rank):
        self._pg = pg                      # _C.ProcessGroup, None off the group
        self.ranks = list(ranks)
        self.backend = backend             # "cpu", "nccl", or None (NCCL on first GPU use)
        self.backend_name = None           # get_backend()'s answer if not backend's ("gloo")
        self._advertise = None             # the address this rank advertised (world groups)
        self._by_route = False             # ... chosen by the route to MASTER_ADDR
        self._store = store
        self._prefix = prefix
        self._timeout_s = timeout_s
        self._world_rank = world_rank
        self._made = 0                     # subgroups made from this group
        self._mb = 0                       # monitored barriers run on it
        self._index = {r: i for i, r in enumerate(self.ranks)}
        self._watcher = None               # the world group's straggler watcher (_forensics)
        if pg is not None and backend != "cpu":
            pg.set_cuda_factory(self._attach_nccl)
        if pg is not None:
            _forensics.register(self)

    rank = property(lambda self: self._index.get(self._world_rank, -1))
    size = property(lambda self: len(self.ranks))
    is_member = property(lambda self: self._pg is not None)

    def __repr__(self):
        return f"<pyddp group of ranks {self.ranks}, rank {self.rank}, backend {self.backend}>"

    def group_rank(self, global_rank, what="rank"):
        """The rank in this group of a global rank (a clear error if it is not a member)."""
        i = self._index.get(global_rank)
        if i is None:
            raise _C.DistValueError(f"{what}={global_rank} is not a member of this group "
                                    f"(ranks {self.ranks})")
        return i

    def pg(self, op="this collective"):
        """The _C.ProcessGroup of this group (raises off the group or after destroy)."""
        if self._pg is None:
            raise _C.DistValueError(f"rank {self._world_rank} called {op} on a group it is not "
                                    f"a member of (ranks {self.ranks})")
        return self._pg

    def _attach_nccl(self):
        """The CUDA factory: set up NCCL for this group on its first GPU array. Every
        member reaches it at the same collective, so the set-up is collective too."""
        from . import _nccl_backend
        _nccl_backend.require()
        self._nccl_interface()
        dev = _nccl_backend._device_index(_State.device_id if self is _State.pg else None)
        self._pg.attach_nccl(self._store._client, f"{self._prefix}/nccl", dev,
                             int(self._timeout_s * 1000), __version__)

    def _nccl_interface(self):
        """Give NCCL the interface pyddp chose by the route to MASTER_ADDR, unless the
        user named one (NCCL_SOCKET_IFNAME) or pyddp's own was named (then NCCL's
        choice is the user's to make too). NCCL reads the variable when it first
        initialises, so it is set before that; left alone for loopback (one host)."""
        world = _State.pg if _State.pg is not None else self
        addr = world._advertise or self._advertise
        if os.environ.get("NCCL_SOCKET_IFNAME") or not (world._by_route or self._by_route):
            return
        ifname = _env.interface_of(addr) if addr else ""
        if ifname and ifname != "lo":
            os.environ["NCCL_SOCKET_IFNAME"] = ifname
            log.debug("pyddp: NCCL_SOCKET_IFNAME=%s (the interface of %s, which routes to "
                      "the master)", ifname, addr)

    def subgroup(self, ranks, name, backend=None, timeout_s=None, algo=-1):
        """A subgroup of this group's global ranks ``ranks``: member-only (only the
        members call it, all with the same name) and without communication. algo: the
        bandwidth-path algorithm code (_ALGOS), -1 for PYDDP_ALGO."""
        ranks = sorted(int(r) for r in ranks)
        if len(set(ranks)) != len(ranks):
            raise _C.DistValueError(f"new_group: ranks {ranks} has duplicates")
        idx = [self.group_rank(r, "ranks entry") for r in ranks]
        prefix = f"{self._prefix}/g/{name}"
        tag = _fnv(prefix)        # the same on every member: a hash of the key prefix
        sub = self.pg("new_group").subgroup(idx, tag, algo)
        g = Group(sub, ranks, self.backend if backend is None else backend, self._store,
                  prefix, self._timeout_s if timeout_s is None else timeout_s,
                  self._world_rank)
        g._watcher = self._watcher
        if backend is None:
            g.backend_name = self.backend_name
        return g

    def _destroy(self):
        pg, self._pg = self._pg, None
        w, self._watcher = self._watcher, None
        if w is not None and w.group is self:
            w.stop()
        if pg is not None:
            pg.destroy()


def _fnv(s):
    """64-bit FNV-1a of s (the C core tags a world group with the same hash)."""
    h = 1469598103934665603
    for c in s.encode():
        h = ((h ^ c) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


group = type("group", (), {"WORLD": WORLD})


def _resolve(g):
    """The Group for a group= argument (None or WORLD: the default group)."""
    if g is None or g is WORLD:
        return _require()
    if isinstance(g, Group):
        return g
    raise _C.DistTypeError(f"group must be a pyddp group from new_group(), None or "
                           f"group.WORLD, not {type(g).__name__}")


def _check_group(g):
    _resolve(g)


def _require():
    if _State.pg is None:
        raise _C.DistError("the default process group is not initialized: call "
                           "pyddp.init_process_group() first")
    return _State.pg


def is_available() -> bool:
    """True: pyddp's CPU backend is always built."""
    return True


def is_initialized() -> bool:
    return _State.pg is not None


def get_rank(group=None) -> int:
    """This process's rank in group (the default group: its global rank); -1 on a rank
    that is not a member of group, as in torch."""
    return _resolve(group).rank


def get_world_size(group=None) -> int:
    return _resolve(group).size


def get_backend(group=None) -> str:
    """The backend's name as it was asked for ("gloo" when init_process_group or
    new_group got "gloo", which is pyddp's CPU backend); for backend=None, "nccl" where
    GPU arrays go to NCCL, else "cpu"."""
    g = _resolve(group)
    if g.backend_name is not None:
        return g.backend_name
    return _State.backend if g.backend is None else g.backend


def get_process_group_ranks(group):
    """The global ranks of group's members, in group-rank order."""
    return list(_resolve(group).ranks)


def get_global_rank(group, group_rank):
    g = _resolve(group)
    if not 0 <= group_rank < g.size:
        raise _C.DistValueError(f"group rank {group_rank} is out of range for a group of "
                                f"{g.size}")
    return g.ranks[group_rank]


def get_group_rank(group, global_rank):
    return _resolve(group).group_rank(global_rank)


# pg_options={"algo": ...} of new_group: the C core's DDP_ALGO_* codes
_ALGOS = {"auto": 0, "flat": 1, "hier": 2}


def _options_algo(pg_options):
    """The algorithm code pg_options asks for (-1: PYDDP_ALGO). pg_options is None or a
    dict; its "algo" is "auto", "flat" or "hier" (other keys are left to the torch
    backend)."""
    if pg_options is None:
        return -1
    if not isinstance(pg_options, dict):
        raise _C.DistValueError(f"new_group: pg_options must be a dict such as "
                                f"{{'algo': 'flat'}}, not {type(pg_options).__name__}")
    algo = pg_options.get("algo")
    if algo is None:
        return -1
    if algo not in _ALGOS:
        raise _C.DistValueError(f"new_group: pg_options algo={algo!r}: use one of "
                                f"{', '.join(_ALGOS)}")
    return _ALGOS[algo]


def new_group(ranks=None, timeout=None, backend=None, pg_options=None,
              use_local_synchronization=False, group_desc=None, device_id=None):
    """A group of the global ranks ``ranks`` (default: all), as torch's new_group: every
    rank calls it for every group, in the same order, also ranks that are not members
    (they get a handle whose rank is -1 and on which collectives raise). It runs on the
    default group's connections, so making one costs no communication. timeout: the
    default deadline of its collectives (default: the default group's). backend: "cpu"
    ("gloo") or "nccl"/None (GPU arrays use NCCL, set up for this group on first use).
    pg_options: None, or {"algo": "auto" | "flat" | "hier"} to choose this group's
    bandwidth-path algorithm instead of PYDDP_ALGO (the same on every member)."""
    world = _require()
    n = _State.groups_made
    _State.groups_made += 1
    if ranks is None:
        ranks = list(range(world.size))
    ranks = sorted(int(r) for r in ranks)
    for r in ranks:
        if not 0 <= r < world.size:
            raise _C.DistValueError(f"new_group: rank {r} is out of range for world size "
                                    f"{world.size}")
    be = None if backend is None else _pick_backend(backend, check=False)
    algo = _options_algo(pg_options)
    timeout_s = _env.timeout_seconds(timeout) if timeout is not None else world._timeout_s
    if world.rank not in ranks:
        g = Group(None, ranks, be or world.backend, world._store, None, timeout_s,
                  world.rank)
        g.backend_name = world.backend_name if be is None else _asked_name(backend)
        return g
    g = world.subgroup(ranks, str(n), be, timeout_s, algo)
    if be is not None:
        g.backend_name = _asked_name(backend)
    return g


def create_world(store, rank, world_size, timeout_s, name, backend=None, master_addr=None):
    """A standalone world group over store (a pyddp TCPStore), not the default group:
    collective over its world_size ranks, keys under
    ``/pyddp/<run id>/<restart count>/torch/<name>``. For torch's "pyddp" backend.
    master_addr: the store's host, so that this rank advertises the local address that
    routes to it (as init_process_group does with MASTER_ADDR), not loopback."""
    be = None if backend is None else _pick_backend(backend)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none") or "none"
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    prefix = f"/pyddp/{run_id}/{restart}/torch/{name}"
    g = _make_group(store, rank, world_size, prefix, timeout_s, be, master_addr, True)
    _warn_unauthenticated(g)
    return g


def _make_group(store, rank, world_size, prefix, timeout_s, backend, master_addr,
                torch_rendezvous=False):
    """Rendezvous a world Group (collective); backend "nccl" attaches NCCL at once.
    torch_rendezvous: the group is torch's "pyddp" backend's (see _forensics.Watcher)."""
    lo, hi = _env.port_range()
    advertise = _env.advertise_address(master_addr)
    pg = _C.ProcessGroup(store._client, rank, world_size, prefix, advertise, "", lo, hi,
                         int(timeout_s * 1000), __version__, _env.host_identity())
    g = Group(pg, range(world_size), backend, store, prefix, timeout_s, rank)
    _exit.track(g)           # pending work at exit gets PYDDP_EXIT_WAIT, then an abort
    g._advertise = advertise
    g._by_route = not os.environ.get("PYDDP_SOCKET_IFNAME") and bool(master_addr)
    if world_size > 1:
        try:
            g._watcher = _forensics.Watcher(g, torch_rendezvous)
        except _C.DistError as e:      # forensics are best effort; training is not
            log.warning("pyddp: rank %d: no straggler watcher (%s)", rank, e)
    _forensics.install_signal_dump()
    if backend == "nccl":
        try:
            g._attach_nccl()
        except BaseException:
            g._destroy()
            raise
    return g


def get_local_rank() -> int:
    """This process's index on its node (torchrun's LOCAL_RANK; 0 when unset)."""
    return _env.local_rank()


def get_local_world_size() -> int:
    """Processes on this node (torchrun's LOCAL_WORLD_SIZE; 1 when unset)."""
    return _env.local_world_size()


def _warn_slow(what, addr, port, elapsed, total):
    print(f"pyddp: rank {_State.rank}: still trying to reach the store at {addr}:{port} "
          f"after {elapsed:.0f} s ({what}); will keep trying for {total - elapsed:.0f} s more. "
          f"Check that the rank-0 node is up, MASTER_ADDR/MASTER_PORT are right, and that a "
          f"firewall or cloud security-group rule allows TCP to port {port} between the "
          f"nodes.", file=sys.stderr, flush=True)


def _connect_store(addr, port, timeout_s, world_size=None, auth=None):
    """Connect to a store server that someone else hosts, warning on stderr every 15 s
    while it is unreachable and failing with DistNetworkError at the timeout."""
    deadline = time.monotonic() + timeout_s
    start = time.monotonic()
    while True:
        left = deadline - time.monotonic()
        try:
            store = TCPStore(addr, port, is_master=False,
                             timeout=_td(max(min(left, 15.0), 0.001)), auth=auth)
            store.set_timeout(_td(timeout_s))
            return store
        except _C.DistNetworkError as e:
            m = re.search(r"last error: ([^)]*)", str(e))
            reason = m.group(1) if m else "unreachable"
            if time.monotonic() >= deadline:
                # one message for the whole wait, not for its last 15-second slice
                raise _C.DistNetworkError(
                    f"rank {_State.rank}: could not connect to the store at {addr}:{port} "
                    f"within {timeout_s:.1f} s (last error: {reason}). Check that the "
                    f"rank-0 node is running, that MASTER_ADDR/MASTER_PORT are right, and "
                    f"that a firewall or cloud security-group rule allows TCP to port "
                    f"{port} from this host.") from None
            _warn_slow(reason, addr, port, time.monotonic() - start, timeout_s)


def _td(s):
    from datetime import timedelta
    return timedelta(seconds=s)


def _file_store(path, rank, timeout_s):
    """file:// rendezvous: rank 0 hosts a store on an ephemeral port and writes
    "host port nonce" into the file (atomically); the others read it and connect,
    re-reading when they find a stale file from an earlier run."""
    if rank == 0:
        adv = _env.advertise_address(None) if os.environ.get("PYDDP_SOCKET_IFNAME") else \
            _primary_address()
        store = _hosted_store(("file", path), "", 0, timeout_s)
        nonce = uuid.uuid4().hex
        store.set("pyddp_file_nonce", nonce)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(f"{adv} {store.port} {nonce}\n")
        os.replace(tmp, path)
        _State.file_path = path
        return store
    deadline = time.monotonic() + timeout_s
    last = "the file does not exist yet"
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                host, port, nonce = f.read().split()
            store = TCPStore(host, int(port), is_master=False, timeout=_td(2.0))
            store.set_timeout(_td(timeout_s))
            if store.get("pyddp_file_nonce").decode() == nonce:
                return store
            last = "the file names a store of another run"
        except (OSError, ValueError, _C.DistStoreError) as e:
            last = str(e) or type(e).__name__
        time.sleep(0.1)
    raise _C.DistTimeoutError(f"rank {rank}: file rendezvous through {path} did not complete "
                              f"within {timeout_s:.0f} s ({last}). Check that every rank uses "
                              f"the same path on shared storage and that rank 0 started.")


def _primary_address():
    try:
        return _C.route_addr("8.8.8.8")   # no packet is sent: only a route lookup
    except _C.DistError:
        return "127.0.0.1"


def _make_store(rdzv, timeout_s):
    if rdzv.method == "file":
        return _file_store(rdzv.file_path, rdzv.rank, timeout_s)
    if rdzv.use_agent_store:
        return _connect_store(rdzv.master_addr, rdzv.master_port, timeout_s)
    if rdzv.rank != 0:   # rank 0 hosts pyddp's server: authenticate with it if a token is set
        return _connect_store(rdzv.master_addr, rdzv.master_port, timeout_s, auth=True)
    # rank 0 hosts the store on MASTER_PORT (plain env:// launch, or tcp://)
    return _hosted_store(("tcp", rdzv.master_port), rdzv.master_addr, rdzv.master_port,
                         timeout_s)


def _hosted_store(key, host, port, timeout_s):
    """The store this process hosts for key, started on first use (see _State.hosted)."""
    store = _State.hosted.get(key)
    if store is None:
        store = TCPStore(host, port, is_master=True, timeout=_td(timeout_s))
        _State.hosted[key] = store
    else:
        store.set_timeout(_td(timeout_s))
    return store


def _is_hosted(store):
    return any(s is store for s in _State.hosted.values())


def _linger_after_failure(store, prefix, world_size, timeout_s):
    """After a failed init, count this rank as finished in the store; the rank that
    hosts the store then waits (up to 10 s) for the others before its process may exit
    and take the store with it, so that every rank gets to read the same error (e.g.
    the version list) instead of a closed connection."""
    key = f"{prefix}/finished"
    try:
        store.add(key, 1)
        if _is_hosted(store):
            deadline = time.monotonic() + min(timeout_s, 10.0)
            while store.add(key, 0) < world_size and time.monotonic() < deadline:
                time.sleep(0.05)
    except _C.DistError:
        pass


def _pick_backend(backend, check=True):
    """"cpu", "nccl", or None (CPU transport, NCCL on first GPU use where usable)."""
    if backend is None:
        return None
    if not isinstance(backend, str):
        backend = str(backend)
    b = backend.lower()
    if ":" in b or "," in b:     # torch's "cpu:gloo,cuda:nccl" form
        devs = dict(part.split(":", 1) for part in b.split(",") if ":" in part)
        b = "nccl" if devs.get("cuda") == "nccl" else "cpu"
        return b if b == "cpu" else None
    if b not in _BACKENDS:
        raise _C.DistValueError(f"backend={backend!r} is not supported; use 'cpu' (alias "
                                f"'gloo'), 'nccl', or None to pick automatically")
    if b == "nccl" and check:
        from . import _nccl_backend
        _nccl_backend.require()   # fail at once, before any rendezvous
    return "cpu" if b == "gloo" else b


def _asked_name(backend):
    """get_backend()'s answer for a backend that was named: "gloo" for "gloo" (scripts
    branch on it), else the name _pick_backend settles on; None for automatic."""
    if isinstance(backend, str) and backend.lower() == "gloo":
        return "gloo"
    return None


def _auto_backend_name():
    """get_backend()'s answer for backend=None: "nccl" where GPU arrays will go to
    NCCL, else "cpu"."""
    from . import _nccl_backend
    if _nccl_backend.usable():
        return "nccl"
    log.debug("pyddp: backend=None: no usable GPU/NCCL (%s); using the CPU backend "
              "(GPU arrays are refused)", _nccl_backend.why_unusable())
    return "cpu"


def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                       store=None, group_name="", pg_options=None, device_id=None):
    """Initialize the default process group (torch.distributed's signature).

    backend: "cpu" (pyddp's TCP/shared-memory transport; "gloo" is an alias; GPU arrays
    are refused), "nccl" (NCCL set up at init, for GPU arrays; host arrays still use the
    CPU transport), or None (like "cpu:gloo,cuda:nccl": host arrays on the CPU
    transport, GPU arrays on NCCL, set up on first use). init_method: "env://"
    (default, torchrun's variables), "tcp://host:port" or "file:///path". store: a
    pyddp.TCPStore to rendezvous through instead (then rank and world_size are
    required). timeout: a timedelta bounding every wait (default PYDDP_TIMEOUT or 30 min).
    """
    if _State.pg is not None:
        raise _C.DistError("the default process group is already initialized; call "
                           "destroy_process_group() first")
    be = _pick_backend(backend)
    timeout_s = _env.timeout_seconds(timeout)
    if store is not None:
        if init_method is not None:
            raise _C.DistValueError("pass either init_method or store, not both")
        if rank is None or rank < 0 or world_size is None or world_size < 1:
            raise _C.DistValueError("init_process_group(store=...) needs rank= and world_size=")
        _env._check_rank(rank, world_size)
        if not isinstance(store, TCPStore):
            raise _C.DistTypeError(f"store must be a pyddp.TCPStore, not {type(store).__name__}")
        rdzv = _env.Rendezvous(rank, world_size, "store", store.host, store.port, None, True,
                               os.environ.get("TORCHELASTIC_RUN_ID", "none") or "none",
                               int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0))
    else:
        rdzv = _env.resolve(init_method, rank, world_size)
    _State.rank = rdzv.rank
    own_store = store is None
    if own_store:
        store = _make_store(rdzv, timeout_s)
    else:
        store.set_timeout(_td(timeout_s))
    prefix = f"/pyddp/{rdzv.run_id}/{rdzv.restart_count}/{_State.generation}"
    _State.generation += 1   # per attempt: every rank makes the same attempts
    try:
        _State.device_id = device_id
        pg = _make_group(store, rdzv.rank, rdzv.world_size, prefix, timeout_s, be,
                         rdzv.master_addr or None)
    except BaseException as e:
        _State.rank = -1
        if not isinstance(e, KeyboardInterrupt):
            _linger_after_failure(store, prefix, rdzv.world_size, timeout_s)
        if own_store and not _is_hosted(store):
            store.close()
        raise
    _State.pg, _State.store = pg, store
    pg.backend_name = _asked_name(backend)
    _State.backend = pg.backend_name or be or _auto_backend_name()
    _State.groups_made = 0
    _State.world_size, _State.timeout_s, _State.prefix = rdzv.world_size, timeout_s, prefix
    _State.own_store = own_store
    _warn_unauthenticated(pg)
    log.debug("pyddp: rank %d/%d initialized (%s backend, prefix %s)", rdzv.rank,
              rdzv.world_size, _State.backend, prefix)


_auth_warned = False


def _warn_unauthenticated(g):
    """One line, once per process, on world rank 0, when a job spans hosts without
    PYDDP_AUTH_TOKEN (an explicitly empty PYDDP_AUTH_TOKEN= silences it): anyone who
    reaches its ports could join it. For pyddp's own init and torch's backend alike."""
    global _auth_warned
    if _auth_warned or "PYDDP_AUTH_TOKEN" in os.environ or \
            os.environ.get("PYDDP_AUTH_TOKEN_FILE"):
        return
    pg = g.pg()
    hosts = {pg.peer(r)[1] for r in range(pg.size)}
    if len(hosts) > 1 and g._world_rank == 0:
        _auth_warned = True
        log.warning("pyddp: this job spans %d hosts without PYDDP_AUTH_TOKEN: any machine that "
                    "can reach its ports can join it or send it data (see docs/security.md; "
                    "set PYDDP_AUTH_TOKEN= empty to silence this)", len(hosts))


def destroy_process_group(group=None):
    """Tear down group (default: the default group, and with it every subgroup's
    connections); init_process_group may be called again afterwards."""
    if group is not None and group is not WORLD:
        _resolve(group)._destroy()
        return
    pg, store = _State.pg, _State.store
    if pg is None:
        return
    _State.pg = None
    try:
        pg._destroy()
    finally:
        if store is not None and _State.own_store and not _is_hosted(store):
            store.close()
        if _State.file_path:
            try:
                os.unlink(_State.file_path)
            except OSError:
                pass
            _State.file_path = None
        _State.store = None
        _State.backend = None
        _State.rank = _State.world_size = -1


def default_pg():
    """The _C.ProcessGroup of the default group (raises if not initialized)."""
    return _require().pg()


def default_timeout_ms():
    return int(_State.timeout_s * 1000)


def timeout_ms(g):
    return int(g._timeout_s * 1000)
