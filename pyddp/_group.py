"""Process groups: the :class:`Group` handle, new_group, and the queries about groups
(rank, world size, backend, member ranks); the default group's state.

A :class:`Group` wraps one ``_C.ProcessGroup``, which carries the CPU transport and,
for GPU arrays, an NCCL communicator created on first use (or at init for
``backend="nccl"``). Subgroups from :func:`new_group` run on the links of the group
they are made from (no second rendezvous): creating one is member-only and needs no
communication, and their collectives carry their own group tag, so a rank that calls
a collective on a different group than its peers gets a mismatch error, not a hang.

World groups, the default one and torch's backend's, are made by ``_world`` (the
rendezvous through a store that ``_rendezvous`` finds or hosts).
"""
import logging
import os
import weakref

from . import _C, _env, _forensics
from ._version import __version__

log = logging.getLogger("pyddp")

_BACKENDS = ("cpu", "gloo", "nccl")


class _State:
    """The default group and what init_process_group settled (set by ``_world``)."""
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
    made = []              # weak references to the groups new_group() made since init
    joined = False         # admitted into a running elastic job, state not synced yet
    membership = None      # the in-place elastic job's _membership.Membership
    master_addr = None     # the store's host: the route the advertised address takes
    world_backend = None   # (backend, backend_name) of the world an elastic change rebuilds


class WORLD:
    """Stand-in for torch's ``group.WORLD``: the default group."""


class Group:
    """A process group: its member ranks (``ranks``, global ranks in increasing order),
    this process's rank in it (``rank``; -1 on a rank that is not a member) and its
    ``size``. Pass it as ``group=`` to any collective. Made by :func:`new_group` (or,
    for torch's backend, by ``_world.create_world`` and :meth:`subgroup`)."""

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
        self._stale = None                 # why it can no longer be used (elastic change)
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
        """The _C.ProcessGroup of this group (raises off the group, after destroy, and
        on a group made before an elastic membership change)."""
        if self._pg is None:
            if self._stale is not None:
                raise _C.DistError(f"rank {self._world_rank} called {op} on {self._stale}")
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
        if w is not None and w.group_ref() is not self:
            w = None   # a subgroup: the watcher is its world group's
        if w is not None:
            w.stop()   # closes its store connections: a WAIT on them fails at once
        if pg is not None:
            pg.destroy()   # wakes a thread still waiting for the first collective
        if w is not None:
            # Its thread returns once it sees either (a bounded wait), so that no
            # thread of the group outlives destroy_process_group.
            w.join(_forensics.STOP_S)


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
_ALGOS = {"auto": 0, "flat": 1, "hier": 2, "block": 3}


def _options_algo(pg_options):
    """The algorithm code pg_options asks for (-1: PYDDP_ALGO). pg_options is None or a
    dict; its "algo" is "auto", "flat", "hier" or "block" (other keys are left to the
    torch backend)."""
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
    else:
        g = world.subgroup(ranks, str(n), be, timeout_s, algo)
        if be is not None:
            g.backend_name = _asked_name(backend)
    _State.made.append(weakref.ref(g))
    return g


def retire_groups(why):
    """An elastic membership change replaced the default group: every group made from
    the old one is destroyed, and using one raises a DistError ending in why."""
    for ref in _State.made:
        g = ref()
        if g is not None:
            g._stale = why
            g._destroy()
    _State.made = []


def get_local_rank() -> int:
    """This process's index on its node (torchrun's LOCAL_RANK; 0 when unset)."""
    return _env.local_rank()


def get_local_world_size() -> int:
    """Processes on this node (torchrun's LOCAL_WORLD_SIZE; 1 when unset)."""
    return _env.local_world_size()


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


def default_pg():
    """The _C.ProcessGroup of the default group (raises if not initialized)."""
    return _require().pg()


def default_timeout_ms():
    return int(_State.timeout_s * 1000)


def timeout_ms(g):
    return int(g._timeout_s * 1000)


def dump_flight_record(file=None, group=None):
    """Print the flight record of group's communicator (the default group's if None:
    the last 64 collectives of this process, every group) and return it as a list."""
    return _forensics.print_flight_record(_resolve(group), file)
