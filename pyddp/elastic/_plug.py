"""How the in-place elastic mode plugs into the world (``_world.WorldHooks``): a process
started while its job runs in place joins that job instead of starting a new world
over it, and the job's membership lives here, not in the core.

Registered when ``pyddp.elastic`` is imported (a script of the in-place kind imports it
before ``init_process_group``). At init:

* ``before_store``: ``PYDDP_ELASTIC_JOIN=<the job's store>`` (a node added to a job it
  was not launched with) joins that job;
* ``on_store``: a process of the job's own launch line (a node that came back and ran
  its line again, or a new one) whose store holds a running in-place job (its live
  record, alive) joins it;
* ``torch_world``: the same for torch's default group on backend "pyddp".

Until ``pyddp.elastic.run`` admits it (at one of the job's commits) a joiner's default
group is a world of this process alone, so that the script builds its model, DDP and
optimizer without holding the job up. ``Job`` holds the process's membership.
"""
import logging

from .. import _C, _world
from .._group import _State
from .._rendezvous import job_namespace
from ..store import EtcdStore, TCPStore
from . import _joiners, _live, _membership

log = logging.getLogger("pyddp")


class Job:
    """This process's part in an in-place job."""
    membership = None     # its _membership.Membership, once it has one
    joined = False        # admitted into a running job, state not synced yet


class ElasticHooks(_world.WorldHooks):
    """pyddp.elastic's part in making worlds (see the module's docstring)."""

    def before_store(self, be, backend, timeout_s, device_id):
        where = (_C.setting_text("PYDDP_ELASTIC_JOIN") or "").strip()
        if not where:
            return False
        store, host = _join_store(where, timeout_s)
        try:
            _join_with(store, _membership.joiner(store), be, backend, timeout_s, device_id,
                       host)
        except BaseException:
            store.close()
            raise
        return True

    def on_store(self, store, rdzv, be, backend, timeout_s, device_id):
        g = _join_running_job(store, rdzv.rank, be, timeout_s, rdzv.master_addr or None,
                              own=False)
        if g is None:
            return False
        _State.device_id = device_id
        _world.adopt_default_group(g, store, backend, be, timeout_s,
                                   rdzv.master_addr or None, True)
        return True

    def torch_world(self, store, rank, world_size, timeout_s, be, master_addr):
        if Job.membership is not None:
            return None
        return _join_running_job(store, rank, be, timeout_s, master_addr, own=True)

    def on_destroy(self):
        mem, Job.membership, Job.joined = Job.membership, None, False
        if mem is not None:
            mem.close()


def _join_running_job(store, rank, be, timeout_s, master_addr, own):
    """The one path of a process of a job's own launch line (a node that came back and
    ran its line again, a new one, a restarted worker) whose store holds a running
    in-place job: None when no job runs there (a job recorded there that is gone is
    marked finished); else it joins: the job's version and token checked here, a world
    of this process alone returned, and the membership (not admitted yet) kept in Job.
    own: the membership gets a connection of its own (torch's default group closes
    the store client it made when a change destroys it)."""
    rec = _live.live_job(store)
    if rec is None or not _live.job_alive(store, rec):
        return None
    mem = _membership.joiner(_membership.own_connection(store) if own else store, rec)
    log.warning("pyddp: rank %d: an in-place elastic job runs at %s; joining it "
                "(admitted at its next commit)", rank, store.where)
    g = _world.make_group(store, 0, 1, f"{mem.base}/solo/{mem.me}", timeout_s, be,
                          master_addr, own)
    mem.torch, mem.timeout_s = own, timeout_s
    Job.joined, Job.membership = True, mem
    return g


def _join_store(where, timeout_s):
    """(the store, its host) named by PYDDP_ELASTIC_JOIN: ``host:port`` (the static
    form's store), ``host:port/<rdzv id>`` (a c10d launch's endpoint and id: the store
    its agents share with their workers) or ``etcd://members/<rdzv id>``."""
    from .._rendezvous import _td
    if where.startswith("etcd://"):
        members, _, rdzv_id = where.rpartition("/")
        if not rdzv_id or members in ("etcd:", "etcd:/"):
            raise _C.DistValueError(f"PYDDP_ELASTIC_JOIN={where!r}: expected "
                                    f"etcd://HOST:PORT[,HOST:PORT...]/<rdzv id>")
        store = EtcdStore(members, job_namespace(rdzv_id), _td(timeout_s))
        return store, store.route_host
    hostport, _, rdzv_id = where.partition("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise _C.DistValueError(f"PYDDP_ELASTIC_JOIN={where!r}: expected host:port of the "
                                f"job's store (the static form's --master_addr:--master_port), "
                                f"host:port/<rdzv id> of the c10d form's --rdzv-endpoint "
                                f"and --rdzv-id, or etcd://HOST:PORT[,...]/<rdzv id>")
    host = host.strip("[]")
    store = TCPStore(host, int(port), is_master=False, timeout=_td(timeout_s))
    try:
        found = _joiners.torch_worker_store(store, rdzv_id) if rdzv_id else None
    except BaseException:
        store.close()
        raise
    if found is not None:
        store.close()
        host, port = found
        store = TCPStore(host, port, is_master=False, timeout=_td(timeout_s))
    return store, host


def _join_with(store, mem, be, backend, timeout_s, device_id, host):
    """The default group of a process started to join (PYDDP_ELASTIC_JOIN), not admitted
    yet into the job of membership mem: this process alone, until pyddp.elastic.run
    admits it."""
    _State.device_id = device_id
    g = _world.make_group(store, 0, 1, f"{mem.base}/solo/{mem.me}", timeout_s, be, host)
    _world.adopt_default_group(g, store, backend, be, timeout_s, host, True)
    Job.joined, Job.membership = True, mem


def install():
    """Register the hooks (pyddp.elastic's import does it)."""
    _world.add_hooks(ElasticHooks())


__all__ = ["Job", "ElasticHooks", "install"]
