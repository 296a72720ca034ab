"""torchrun's ``--rdzv-backend=pyddp``: one launch line for every node of an elastic job,
at its first start and at every return.

torch 2.13's torchrun loads rendezvous handlers from the ``torchrun.handlers`` entry
points of installed packages; pyddp's (``_pyddp_torch_hook.torchrun_handler``) makes
this one. Against torch's c10d handler it changes three things:

* **Where the store lives.** With ``--rdzv-endpoint=etcd://E1:2379,E2:2379,E3:2379``
  the job's store is that etcd cluster (``pyddp.EtcdStore``, keys under
  ``pyddp/<rdzv id>/``): the agents rendezvous through it and the workers keep every
  key there (``PYDDP_RDZV_STORE`` tells them, and gives torch's own ``env://`` a client
  of it), so no training node holds anything the job needs. With
  ``--rdzv-endpoint=HOST[:PORT]`` the agent on that host (found by binding its address,
  or ``--rdzv-conf is_host=1``) serves pyddp's own store there, for the agent's whole
  life: authenticated with PYDDP_AUTH_TOKEN, bounded, outliving that node's workers
  (a crashed worker there is restarted by its agent, with ``--max-restarts``, and joins
  again), but not the node itself.
* **A node that arrives while an in-place job runs** (``pyddp.elastic``'s live record
  in the store, alive) is no new round: its agent gets a round of its own (group rank
  0 of 1), its workers find the job running and join it in place (``_plug``), and the
  running agents are never told a node waits, so they never restart their workers
  (``num_nodes_waiting`` is 0 while the job runs in place, and when the store does not
  answer).
* **The exit barrier** of the agents does not wait for agents that the in-place job
  lost: once the job has finished, the barrier's wait returns.

Without an in-place job (any other script) it is an ordinary restart-based rendezvous:
rounds of MIN..MAX nodes, closed when MAX arrived or ``last_call_timeout`` after MIN did,
and a node arriving later makes the running agents restart into the next round.

Keys (under ``pyddp/rdzv/<run id>/``): ``round`` (the open round's number), ``<r>/n``
(arrivals, a counter), ``<r>/closed`` (the round's size), ``<r>/agents/...`` (torchrun's
own keys for round r), ``solo/<uuid>/...`` (an agent whose node joins in place),
``closed`` (the job's rendezvous is over).
"""
import json
import logging
import os
import socket
import time
import uuid
from datetime import timedelta

from torch.distributed.elastic.rendezvous.api import (RendezvousClosedError, RendezvousHandler,
                                                      RendezvousInfo, RendezvousStoreInfo)

from .. import _C
from . import _live

log = logging.getLogger("pyddp")

DEFAULT_PORT = 29400
_POLL_S = 0.5           # a waiting agent looks at the arrivals this often (it waits on
#                         the round's closing key in between, woken at once when it closes)
_ETCD_SCHEMES = ("etcd://", "http://", "https://")
_BARRIER_LAST = "torchelastic/agent/terminal_state/last_member"


def _is_local(host):
    """Whether host names an address of this machine (or network namespace)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


class AgentStore:
    """What torchrun's agent uses as its round's store: pyddp's store under a key
    prefix, with the calls the agent makes (set, get, add, wait, check, multi_get,
    multi_set, timeout). Its exit barrier's wait returns once the in-place job this
    agent's workers belong to has finished, so agents the job lost are not waited for."""

    def __init__(self, store, prefix):
        self._s, self._p = store, prefix

    def _k(self, key):
        return self._p + key

    @property
    def timeout(self):
        return self._s.timeout

    def set_timeout(self, timeout):
        self._s.set_timeout(timeout)

    def set(self, key, value):
        self._s.set(self._k(key), value)

    def get(self, key):
        return self._s.get(self._k(key))

    def add(self, key, amount):
        return self._s.add(self._k(key), amount)

    def check(self, keys):
        return self._s.check([self._k(k) for k in keys])

    def compare_set(self, key, expected, desired):
        return self._s.compare_set(self._k(key), expected, desired)

    def delete_key(self, key):
        return self._s.delete_key(self._k(key))

    def multi_get(self, keys):
        return [self.get(k) for k in keys]

    def multi_set(self, keys, values):
        for k, v in zip(keys, values):
            self.set(k, v)

    def wait(self, keys, timeout=None):
        keys = list(keys)
        if keys != [_BARRIER_LAST]:
            self._s.wait([self._k(k) for k in keys], timeout)
            return
        deadline = time.monotonic() + (timeout or self._s.timeout).total_seconds()
        while True:            # the exit barrier: all agents, or the in-place job over
            if self.check(keys) or _job_finished(self._s):
                return
            if time.monotonic() >= deadline:
                raise _C.DistStoreTimeoutError(f"torchrun's exit barrier: timed out after "
                                               f"{(timeout or self._s.timeout)}")
            time.sleep(0.5)


def _job_finished(store):
    """An in-place job ran on store and has finished."""
    if not store.check([_live.LIVE_KEY]):
        return False
    return bool(json.loads(store.get(_live.LIVE_KEY)).get("done"))


class PyddpRendezvousHandler(RendezvousHandler):
    """torch.distributed.elastic's RendezvousHandler for ``--rdzv-backend=pyddp`` (see
    the module's docstring). Made by :func:`create_handler` from torchrun's
    RendezvousParameters."""

    def __init__(self, params):
        endpoint = (params.endpoint or "").strip()
        self.run_id = params.run_id
        self.min_nodes, self.max_nodes = params.min_nodes, params.max_nodes
        self.join_timeout = float(params.get("join_timeout", 600))
        self.last_call = float(params.get("last_call_timeout", 30))
        self.prefix = f"pyddp/rdzv/{self.run_id}/"
        self._round = None
        self._solo = False
        self._server = None
        if endpoint.startswith(_ETCD_SCHEMES):
            self._open_etcd(endpoint)
        else:
            self._open_agent_store(endpoint, params.get_as_bool("is_host", None))

    def _open_etcd(self, endpoint):
        """The job's store is an etcd cluster: no node holds anything the job needs."""
        from .._rendezvous import job_namespace
        from ..store import EtcdStore
        self.store = EtcdStore(endpoint, job_namespace(self.run_id),
                               timeout=timedelta(seconds=self.join_timeout))
        first = self.store._client.cluster.members[0]
        self.host, self.port = first.host, first.port       # torchrun's MASTER_ADDR/PORT
        # the workers this agent starts keep the job's keys in the same cluster
        os.environ["PYDDP_RDZV_STORE"] = endpoint

    def _open_agent_store(self, endpoint, is_host):
        """The job's store is pyddp's server in the endpoint node's agent."""
        host, _, port = endpoint.rpartition(":")
        if not host:
            host, port = endpoint, ""
        if not host:
            raise _C.DistValueError("--rdzv-backend=pyddp needs --rdzv-endpoint=HOST[:PORT] "
                                    "(the node whose agent hosts the job's store) or "
                                    "etcd://HOST:PORT[,HOST:PORT...] (an etcd cluster)")
        self.host = host.strip("[]")
        self.port = int(port) if port else DEFAULT_PORT
        if is_host is None:
            is_host = _is_local(self.host)
        if is_host:
            self._server = _C.StoreServer()
            try:
                self._server.start(None, self.port)
            except _C.DistError as e:
                raise _C.DistNetworkError(
                    f"--rdzv-backend=pyddp: this node is the endpoint {self.host}:{self.port} "
                    f"but could not serve the job's store on port {self.port} ({e}); is "
                    f"another job using it?") from None
        self.store = self._connect()
        # the workers this agent starts use pyddp's store: they authenticate to it
        os.environ["PYDDP_RDZV_STORE"] = "pyddp"

    def _connect(self):
        from .._rendezvous import _connect_store
        where = "localhost" if self._server is not None else self.host
        return _connect_store(where, self.port, self.join_timeout,
                              auth=True if self._server is not None else None)

    # -- RendezvousHandler --------------------------------------------------------------

    def get_backend(self):
        return "pyddp"

    @property
    def use_agent_store(self):
        return True

    def get_run_id(self):
        return self.run_id

    def is_closed(self):
        return self.store.check([self.prefix + "closed"])

    def set_closed(self):
        self.store.set(self.prefix + "closed", "1")

    def shutdown(self):
        try:
            self.store.close()
        except _C.DistError:
            pass
        return True

    def num_nodes_waiting(self):
        """Nodes waiting for the next round: none while an in-place job runs (a node
        that arrives joins it in place), else the arrivals of a newer round."""
        try:
            if self._solo or self._in_place():
                return 0
            cur = self._current_round()
            if self._round is None or cur <= self._round:
                return 0
            return self.store.add(f"{self.prefix}{cur}/n", 0)
        except _C.DistError as e:
            # the store not answering must not make torchrun stop healthy workers: the
            # workers report a lost store themselves when it matters to them
            log.warning("pyddp rendezvous: the job's store at %s did not answer (%s)",
                        self.store.where, e)
            return 0

    def next_rendezvous(self):
        """This agent's round: (store, group rank, group size, the workers' store).
        A node that finds an in-place job running gets a round of its own."""
        if self.is_closed():
            raise RendezvousClosedError()
        boot = RendezvousStoreInfo(self.host, self.port)
        while True:
            try:
                return self._next(boot)
            except _RoundMissed:
                continue

    def _next(self, boot):
        if self._joins_in_place():
            self._solo = True
            prefix = f"{self.prefix}solo/{uuid.uuid4().hex}/"
            log.warning("pyddp rendezvous: an in-place elastic job runs at %s; this "
                        "node's workers join it", self.store.where)
            return RendezvousInfo(AgentStore(self.store, prefix), 0, 1, boot)
        self._solo = False
        rank, size, r = self._join_round()
        self._round = r
        log.info("pyddp rendezvous: round %d: node %d of %d", r, rank, size)
        return RendezvousInfo(AgentStore(self.store, f"{self.prefix}{r}/agents/"), rank,
                              size, boot)

    # -- rounds -------------------------------------------------------------------------

    def _in_place(self):
        return _live.live_job(self.store) is not None

    def _joins_in_place(self):
        rec = _live.live_job(self.store)
        return rec is not None and _live.job_alive(self.store, rec)

    def _current_round(self):
        raw = self.store.compare_set(self.prefix + "round", "", "0")
        return int(raw)

    def _join_round(self):
        """Arrive in the open round and wait for it to close: (rank, size, round).
        A round is closed by whichever agent first sees MAX arrivals, or MIN arrivals
        for last_call_timeout; an agent that arrived after its round closed goes on to
        the next (whose arrivals the running agents see in num_nodes_waiting)."""
        deadline = time.monotonic() + self.join_timeout
        while True:
            r = self._current_round()
            closed = f"{self.prefix}{r}/closed"
            if self.store.check([closed]):
                self.store.compare_set(self.prefix + "round", str(r), str(r + 1))
                continue
            me = self.store.add(f"{self.prefix}{r}/n", 1)
            enough_since = None
            while not self.store.check([closed]):
                n = self.store.add(f"{self.prefix}{r}/n", 0)
                if n >= self.max_nodes:
                    self.store.compare_set(closed, "", str(self.max_nodes))
                    break
                if n >= self.min_nodes:
                    enough_since = enough_since or time.monotonic()
                    if time.monotonic() - enough_since >= self.last_call:
                        self.store.compare_set(closed, "", str(n))
                        break
                if self._joins_in_place():
                    break
                if time.monotonic() >= deadline:
                    raise _C.DistTimeoutError(
                        f"pyddp rendezvous at {self.store.where}: {n} of at least "
                        f"{self.min_nodes} nodes arrived within join_timeout="
                        f"{self.join_timeout:.0f} s; check that every node was started "
                        f"and can reach the endpoint")
                try:
                    self.store.wait([closed], timeout=timedelta(seconds=_POLL_S))
                except _C.DistTimeoutError:
                    pass
            if not self.store.check([closed]):
                # an in-place job started meanwhile: this round never closes for us
                raise _RoundMissed()
            size = int(self.store.get(closed))
            if me <= size:
                return me - 1, size, r
            self.store.compare_set(self.prefix + "round", str(r), str(r + 1))


class _RoundMissed(Exception):
    """Internal: an in-place job started while this agent waited in a round."""


def create_handler(params):
    """torchrun's creator for ``--rdzv-backend=pyddp``."""
    return PyddpRendezvousHandler(params)
