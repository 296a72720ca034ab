"""World groups: init_process_group and destroy_process_group (the default group),
create_world and torch_world (the world groups of torch's "pyddp" backend),
rebuild_world (the default group made again at a new size), and the hooks through which
a plug-in takes part in making a world (``WorldHooks``: ``pyddp.elastic`` registers one;
nothing here knows it).

init_process_group resolves the rendezvous (``_env``), connects to or hosts the store
(``_rendezvous``), then builds the backend's process group through the C core, which
publishes this rank's address under pyddp's own key prefix
``/pyddp/<run id>/<generation>/<round>`` and connects to every peer. The round is
agreed through the store (``_round``), so a torchrun restart or an elastic membership
change (whose agent store still holds the previous round's keys, and whose nodes count
restarts apart) and a second init in the same process start clean; the prefix keeps
pyddp out of the way of torch code using the same store. Every world group of more than
one rank gets a straggler watcher (``_forensics.Watcher``).
"""
import logging
import os
import time

from . import _C, _env, _exit, _forensics
from ._group import Group, WORLD, _State, _asked_name, _auto_backend_name, _pick_backend, \
    _resolve, dump_flight_record, retire_groups
from ._rendezvous import _is_hosted, _linger_after_failure, make_store, _td
from ._version import __version__
from .store import Store

log = logging.getLogger("pyddp")


class WorldHooks:
    """A plug-in's part in making worlds, registered with :func:`add_hooks` (the
    in-place elastic mode registers one when ``pyddp.elastic`` is imported). Each
    method is asked in turn; one that makes the default group itself (through
    :func:`make_group` and :func:`adopt_default_group`) returns True, and init is done."""

    def before_store(self, be, backend, timeout_s, device_id):
        """init_process_group without a store passed in, before it makes one."""
        return False

    def on_store(self, store, rdzv, be, backend, timeout_s, device_id):
        """init_process_group has made its own store (a client of a store that others
        host: the world it joins may already be running there)."""
        return False

    def torch_world(self, store, rank, world_size, timeout_s, be, master_addr):
        """torch's default group on backend "pyddp" is being made over store: a Group
        to give torch instead of a new world, or None."""
        return None

    def on_destroy(self):
        """destroy_process_group() of the default group, before the group goes."""


_hooks = []


def add_hooks(hooks):
    """Register a WorldHooks (once per class)."""
    if not any(type(h) is type(hooks) for h in _hooks):
        _hooks.append(hooks)


def create_world(store, rank, world_size, timeout_s, name, backend=None, master_addr=None):
    """A standalone world group over store (a pyddp store), not the default group:
    collective over its world_size ranks, keys under
    ``/pyddp/<run id>/torch/<name>/<round>`` (``_round``). For torch's "pyddp" backend.
    master_addr: the store's host, so that this rank advertises the local address that
    routes to it (as init_process_group does with MASTER_ADDR), not loopback."""
    be = None if backend is None else _pick_backend(backend)
    run_id, _restart = _env.elastic_attempt()
    base = f"/pyddp/{run_id}/torch/{name}"
    g = make_group(store, rank, world_size, base, timeout_s, be, master_addr, True,
                   agree_round=True)
    _warn_unauthenticated(g)
    return g


def torch_world(store, rank, world_size, timeout_s, name, backend, master_addr, prefix=None):
    """torch's default group on backend "pyddp" (collective): create_world's group; with
    prefix, a world under that key prefix, agreed by the caller (``pyddp.elastic``'s new
    membership: its rendezvous gets at most 30 s + PYDDP_ELASTIC_SETTLE_S); or the
    group a plug-in gives (WorldHooks.torch_world)."""
    be = None if backend is None else _pick_backend(backend)
    if prefix is not None:
        return make_group(store, rank, world_size, prefix, timeout_s, be, master_addr,
                          True, rdzv_timeout_s=_change_rdzv_s(timeout_s))
    for h in _hooks:
        g = h.torch_world(store, rank, world_size, timeout_s, be, master_addr)
        if g is not None:
            return g
    return create_world(store, rank, world_size, timeout_s, name, backend, master_addr)


def _change_rdzv_s(timeout_s):
    """The rendezvous deadline of a world made again after a membership change."""
    return min(timeout_s, 30 + float(_C.setting("PYDDP_ELASTIC_SETTLE_S")))


def _agree_round(store, rdzv, base, timeout_s, own_store, make):
    """(store, group): the group make(store, prefix, agree_round) rendezvouses, under
    this start's key prefix ``<base>/<round>`` (``_round``). A store that rank 0 of this
    start hosts (plain env://, tcp://, file://, and torchrun with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) holds only this start's keys: the round is
    then "0", and the core's rendezvous, which notices a rank refused for its
    PYDDP_AUTH_TOKEN, is the first wait. On a store that outlives the workers
    (torchrun's agent store, or one passed in) the core's rendezvous agrees on a round
    in the same requests; a client whose server goes away before it is agreed
    reconnects to the address it was given and agrees again, until timeout_s; a store
    this process was handed is used as it is."""
    if not rdzv.use_agent_store and rdzv.method != "store":
        return store, make(store, f"{base}/0", False)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return store, make(store, base, True)
        except _C.DistNetworkError as e:
            left = deadline - time.monotonic()
            if not own_store or _is_hosted(store) or rdzv.method == "file" or left <= 0:
                raise
            log.warning("pyddp: rank %d: the store at %s:%s went away during the "
                        "rendezvous (%s); connecting again", rdzv.rank, rdzv.master_addr,
                        rdzv.master_port, e)
            store.close()
            store = make_store(rdzv, left)
            store.set_timeout(_td(timeout_s))


def make_group(store, rank, world_size, prefix, timeout_s, backend, master_addr,
               torch_rendezvous=False, rdzv_timeout_s=None, agree_round=False):
    """Rendezvous a world Group under prefix (collective); backend "nccl" attaches NCCL
    at once.
    torch_rendezvous: the group is torch's "pyddp" backend's (see _forensics.Watcher).
    rdzv_timeout_s: the rendezvous's own deadline, if shorter than timeout_s.
    agree_round: prefix is the start's base, and the ranks agree on a round there
    (``_round``); the group's prefix is then ``<prefix>/<round>``."""
    lo, hi = _env.port_range()
    advertise = _env.advertise_address(master_addr)
    pg = _C.ProcessGroup(store._client, rank, world_size, prefix, advertise, "", lo, hi,
                         int((rdzv_timeout_s or timeout_s) * 1000), __version__,
                         _env.host_identity(), agree_round)
    g = Group(pg, range(world_size), backend, store, pg.prefix, timeout_s, rank)
    _exit.track(g)           # pending work at exit gets PYDDP_EXIT_WAIT, then an abort
    g._advertise = advertise
    g._by_route = not _env.socket_ifname() and bool(master_addr)
    if world_size > 1:
        g._watcher = _forensics.Watcher(g, torch_rendezvous)   # connects on its thread
    _forensics.install_signal_dump(dump_flight_record)
    if backend == "nccl":
        try:
            g._attach_nccl()
        except BaseException:
            g._destroy()
            raise
    return g


def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                       store=None, group_name="", pg_options=None, device_id=None):
    """Initialize the default process group (torch.distributed's signature).

    backend: "cpu" (pyddp's TCP/shared-memory transport; "gloo" is an alias; GPU arrays
    are refused), "nccl" (NCCL set up at init, for GPU arrays; host arrays still use the
    CPU transport), or None (like "cpu:gloo,cuda:nccl": host arrays on the CPU
    transport, GPU arrays on NCCL, set up on first use). init_method: "env://"
    (default, torchrun's variables), "tcp://host:port" or "file:///path". store: a
    pyddp.TCPStore or pyddp.EtcdStore to rendezvous through instead (then rank and world_size are
    required). timeout: a timedelta bounding every wait (default PYDDP_TIMEOUT or 30 min).
    """
    if _State.pg is not None:
        raise _C.DistError("the default process group is already initialized; call "
                           "destroy_process_group() first")
    be = _pick_backend(backend)
    timeout_s = _env.timeout_seconds(timeout)
    if store is None and any(h.before_store(be, backend, timeout_s, device_id)
                             for h in _hooks):
        return
    if store is not None:
        if init_method is not None:
            raise _C.DistValueError("pass either init_method or store, not both")
        if rank is None or rank < 0 or world_size is None or world_size < 1:
            raise _C.DistValueError("init_process_group(store=...) needs rank= and world_size=")
        _env._check_rank(rank, world_size)
        if not isinstance(store, Store):
            raise _C.DistTypeError(f"store must be a pyddp.TCPStore or pyddp.EtcdStore, not "
                                   f"{type(store).__name__}")
        rdzv = _env.Rendezvous(rank, world_size, "store", store.host, store.port, None, True,
                               *_env.elastic_attempt())
    else:
        rdzv = _env.resolve(init_method, rank, world_size)
    _State.rank = rdzv.rank
    own_store = store is None
    if own_store:
        store = make_store(rdzv, timeout_s)
        if not _is_hosted(store) and _a_hook_adopts(store, rdzv, be, backend, timeout_s,
                                                    device_id):
            return
    else:
        store.set_timeout(_td(timeout_s))
    base = f"/pyddp/{rdzv.run_id}/{_State.generation}"
    _State.generation += 1   # per attempt: every rank makes the same attempts
    prefix = base   # failures linger under it (_linger_after_failure)
    try:
        _State.device_id = device_id
        def make(st, pre, agree):
            return make_group(st, rdzv.rank, rdzv.world_size, pre, timeout_s, be,
                              rdzv.master_addr or None, agree_round=agree)
        store, pg = _agree_round(store, rdzv, base, timeout_s, own_store, make)
        prefix = pg._prefix
    except BaseException as e:
        _State.rank = -1
        if prefix is not None and not isinstance(e, KeyboardInterrupt):
            _linger_after_failure(store, prefix, rdzv.world_size, timeout_s)
        if own_store and not _is_hosted(store):
            store.close()
        raise
    adopt_default_group(pg, store, backend, be, timeout_s, rdzv.master_addr or None,
                        own_store)
    _warn_unauthenticated(pg)
    log.debug("pyddp: rank %d/%d initialized (%s backend, prefix %s)", rdzv.rank,
              rdzv.world_size, _State.backend, prefix)


def _a_hook_adopts(store, rdzv, be, backend, timeout_s, device_id):
    """Whether a plug-in made the default group on init's own store (WorldHooks.on_store).
    On its failure the store is closed and the error raised."""
    try:
        return any(h.on_store(store, rdzv, be, backend, timeout_s, device_id) for h in _hooks)
    except BaseException:
        _State.rank = -1
        store.close()
        raise


def adopt_default_group(g, store, backend, be, timeout_s, master_addr, own_store):
    """Make world group g (from make_group) the default group, over store: what
    init_process_group does with the group it made, and what a plug-in does with one
    it made itself. own_store: the store client is the default group's own (closed
    with it). backend is the name asked for, be the transport picked for it."""
    _State.pg, _State.store = g, store
    g.backend_name = _asked_name(backend)
    _State.backend = g.backend_name or be or _auto_backend_name()
    _State.groups_made = 0
    _State.made = []
    _State.rank, _State.world_size = g.rank, g.size
    _State.timeout_s, _State.prefix = timeout_s, g._prefix
    _State.own_store = own_store
    _State.master_addr = master_addr


def rebuild_world(rank, size, prefix, why):
    """A membership change (``pyddp.elastic``): replace the default group by a world of
    size ranks under prefix, this process being rank (collective over the new members).
    Groups made from the old one raise from now on; a rendezvous that does not complete
    within PYDDP_ELASTIC_SETTLE_S + 30 s (a member lost meanwhile) raises."""
    old = _State.pg             # None after a rebuild that failed
    retire_groups(f"a group made before the elastic membership change ({why}); make it "
                  f"again after the change, in a reset callback")
    if old is not None:
        old._destroy()
    timeout_s = _State.timeout_s
    _State.pg = None
    if old is not None:
        _State.world_backend = (old.backend, old.backend_name)
    backend, backend_name = _State.world_backend
    g = make_group(_State.store, rank, size, prefix, timeout_s, backend,
                   _State.master_addr, rdzv_timeout_s=_change_rdzv_s(timeout_s))
    g.backend_name = backend_name
    _State.pg, _State.rank, _State.world_size, _State.prefix = g, rank, size, prefix
    _State.groups_made, _State.made = 0, []
    return g


_auth_warned = False


def _warn_unauthenticated(g):
    """One line, once per process, on world rank 0, when a job spans hosts without
    PYDDP_AUTH_TOKEN (an explicitly empty PYDDP_AUTH_TOKEN= silences it): anyone who
    reaches its ports could join it. For pyddp's own init and torch's backend alike."""
    global _auth_warned
    if _auth_warned or g._world_rank != 0 or _C.setting_text("PYDDP_AUTH_TOKEN") is not None \
            or _C.setting_text("PYDDP_AUTH_TOKEN_FILE"):
        return      # only rank 0 says it: the others need not look at every peer's host
    pg = g.pg()
    hosts = {pg.peer(r)[1] for r in range(pg.size)}
    if len(hosts) > 1:
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
        for h in _hooks:
            h.on_destroy()
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
