"""In-place elastic membership: who is in the job after a rank is lost or a node joins,
agreed through the job's store while the processes go on running.

A job in place (``pyddp.elastic.run``) has a membership epoch ``e`` (0 at the start)
and a key space ``E`` (``<the world's key prefix>/elastic``) in the job's store:

* ``E/<e>/change``: set by whoever notices that epoch ``e`` is over: a rank whose
  collective failed (a peer died or vanished), or rank 0 at a commit when a node asks
  to join. Every rank has a watcher thread (with its own store connection) blocked on
  that key: it aborts the process group at once, so that a collective in flight on any
  rank fails now, and answers for its rank even while the main thread computes.
* ``E/<e>/reg`` (a counter) and ``E/<e>/reg/<ticket>``: each live rank's answer (its
  process id and its rank in epoch ``e``). Once every rank of epoch ``e`` answered, or
  PYDDP_ELASTIC_SETTLE_S after a rank answered, ``E/<e>/proposal`` names the ranks that
  answered and the nodes waiting to join; each proposed rank confirms under
  ``E/<e>/ok/<id>``, and ``E/<e+1>/members`` lists those that confirmed (in their old
  order, so rank 0 stays rank 0 while it lives), then the joiners. Every answering rank
  can write these (compare_set: the first value stands), so losing any rank during a
  change, the first to answer included, does not stall it (``Membership._answer``).
* ``E/join`` (a counter) and ``E/join/<i>``: processes started to join a running job
  (PYDDP_ELASTIC_JOIN), with their node and local rank: a node is admitted once all
  its local ranks wait, all together; ``E/join/<i>/epoch`` tells one it was admitted,
  and into which epoch (or ``done``: the job ended first). ``/pyddp/elastic/live``
  (the live record) names ``E``, the epoch, pyddp's version and a proof of the job's
  PYDDP_AUTH_TOKEN, so a joiner needs only the store address, and one built from
  another version or holding another token is refused on its own side before it
  asks (``_live.check_joiner``).
* ``E/beat``: a counter rank 0's watcher raises twice a second. A live record whose
  counter stands still is a job that is gone (every rank died, the store survived):
  a process that finds it starts a new job instead of waiting to be admitted
  (``_live.job_alive``; a paused rank is told from a dead one by ``_liveness``).
* ``E/<e>/up``: set by rank 0 once epoch ``e``'s group is made and its state synced.
  A change of an epoch that never came up (its rebuild failed: a joiner whose data
  ports the others cannot reach, say) leaves out the processes that epoch admitted,
  with the reason, so the survivors go on after at most one failed rebuild.

Every member of ``E/<e+1>/members`` then makes the new world group under the prefix
``E/<e+1>/pg`` (dense ranks, the members' order); a rank that answered too late finds
itself left out and gets a clear error. A store that fails during all this is reported
as the loss of the job's store host, which in-place recovery cannot outlive.
"""
import json
import logging
import os
import threading
import time
from datetime import timedelta

from .. import _C
from . import _liveness
from ._joiners import JobFinished, admission, new_id, ready_joiners  # noqa: F401 - API
from ._live import LIVE_KEY, check_joiner, get_optional, publish, update_live

log = logging.getLogger("pyddp")

_SLICE_S = 0.3           # a wait during a change looks at other keys this often
_WATCH_POLL = timedelta(seconds=0.5)     # a TCP store: rank 0 beats between waits
_WATCH_LONG = timedelta(seconds=30)      # etcd: the ranks' leases say they live


def _settle_s():
    return float(_C.setting("PYDDP_ELASTIC_SETTLE_S"))


def _store_lost_s():
    return float(_C.setting("PYDDP_ELASTIC_STORE_LOST_S"))


class StoreLost(_C.DistNetworkError):
    """The job's store stopped answering: its host is gone, and the job with it."""


class LeftOut(_C.DistError):
    """This process is not in the job's new membership (it answered a change too late,
    it was refused, or it left)."""


def _wait_slice(st, keys, until):
    """Wait for keys (a watch on etcd, the server's WAIT on a TCP store) until the
    monotonic time until, at most _SLICE_S; True when they all exist."""
    left = min(until - time.monotonic(), _SLICE_S)
    try:
        st.wait(keys, timeout=timedelta(seconds=max(left, 0.005)))
        return True
    except _C.DistTimeoutError:
        return False


def store_lost(store, e):
    """The error for a store request that failed during in-place recovery."""
    if store.recoverable:
        return StoreLost(f"the job's store, etcd at {store.where}, did not answer ({e}). "
                         f"The job cannot change its membership without it: etcd needs a "
                         f"majority of its members up and reachable. Start the job again "
                         f"once it has one (with PYDDP_ELASTIC_CHECKPOINT_DIR it resumes "
                         f"from the newest commit on disk)")
    return StoreLost(f"the job's store at {store.where} stopped answering "
                     f"({e}): its host was lost or the network to it is down. An in-place "
                     f"elastic job cannot outlive the host of its store (the rendezvous "
                     f"endpoint; an etcd endpoint removes that node, see docs/elastic.md); "
                     f"start the job again")


class Membership:
    """This process's part in an in-place job: its id, the epoch, the world group it
    watches, and the outcome of the change that ended the epoch (see the module's
    docstring). Made by :func:`start` (the job's first ranks) or :func:`join`."""

    def __init__(self, store, base, epoch, rank, size, admitted, me):
        self.store, self.base, self.me = store, base, me
        self.epoch, self.rank, self.size = epoch, rank, size
        self.admitted = set(admitted)         # the E/join indices admitted so far
        self.founder = epoch is not None      # started with the job, not joined
        self.changed = None                   # why the current epoch ended, once it has
        self.group = None
        self._watch_store = None
        self._thread = None
        self._stop = threading.Event()
        self.store_error = None                   # the watcher's store error
        self.store_down_since = None              # etcd not answering since (monotonic)
        self._presence = None                     # etcd: this process's lease (live)
        self.leaving = False                      # sent SIGTERM: leaves at a commit
        self.joined_now = False                   # the current epoch admitted joiners
        self._live = None                         # (listening socket, "host:port")
        self.torch = False                        # the world is torch's default group
        self.torch_store = None                   # torch's store (a torch default group)
        self.timeout_s = None                     # the world's timeout

    # -- the watcher ------------------------------------------------------------------

    def watch(self, group):
        """Start the watcher thread for the current epoch over group (the world group)."""
        self.group = group
        self.changed, self.store_error = None, None
        self._stop = threading.Event()
        if self._live is None:
            self._live = _liveness.liveness_listener()
        if self._watch_store is None:
            self._watch_store = self.store.clone(timeout=timedelta(seconds=30))
        self._hold_presence()
        self._thread = threading.Thread(target=self._watch, args=(self.epoch, self._stop),
                                        name="pyddp-elastic", daemon=True)
        self._thread.start()

    def _hold_presence(self):
        """On etcd: this process's key under ``E/alive/``, kept by a lease for as long as
        it lives (a job with no such key left is gone). Retried by the watcher while
        etcd does not answer."""
        if self._presence is None and self.store.recoverable:
            try:
                self._presence = self._watch_store.hold(
                    f"{self.base}/alive/{self.me}", str(os.getpid()),
                    max(2.0, min(_liveness.peer_dead_s(), 6.0)))
            except _C.DistError as e:
                self._store_trouble(e, None)

    def _watch(self, epoch, stop):
        """The watcher thread of epoch: publish this rank's liveness address, then wait
        for the epoch's change key (a TCP store: in slices between rank 0's heartbeats;
        etcd: a watch) and take part in the change. A store that fails makes the job
        end (StoreLost), except etcd within PYDDP_ELASTIC_STORE_LOST_S: training at a
        fixed world goes on while etcd has no majority."""
        key = f"{self.base}/{epoch}/change"
        st = self._watch_store
        slice_ = _WATCH_LONG if st.recoverable else _WATCH_POLL
        published = self._live is None
        while not stop.is_set():
            try:
                if not published:
                    st.set(f"{self.base}/{epoch}/addr/{self.rank}", self._live[1])
                    published = True
                if self.rank == 0 and not st.recoverable:
                    st.add(f"{self.base}/beat", 1)
                self._hold_presence()
                _liveness.drain(self._live)
                try:
                    st.wait([key], timeout=slice_)
                except _C.DistTimeoutError:
                    self._store_back()
                    continue
                self._store_back()
                break
            except _C.DistError as e:
                if stop.is_set() or self._store_trouble(e, stop):
                    continue
                self._lost(e)
                return
        if stop.is_set():
            return
        try:
            self.changed = st.get(key).decode(errors="replace")
            self._abort(f"the elastic membership changed ({self.changed})")
            self._answer(st, epoch)
        except _C.DistError as e:
            if not stop.is_set():
                self._lost(e)

    def _lost(self, e):
        """The job's store is lost: every wait of this rank ends with StoreLost."""
        self.store_error = store_lost(self.store, e)
        self.changed = self.changed or str(self.store_error)
        self._abort(str(self.store_error))

    def _store_trouble(self, e, stop):
        """A request to the job's store failed with e: True to go on (etcd, for up to
        PYDDP_ELASTIC_STORE_LOST_S since it stopped answering; after a pause of a
        second), False when the job must end."""
        if not self.store.recoverable:
            return False
        now = time.monotonic()
        if self.store_down_since is None:
            self.store_down_since = now
            log.warning("pyddp: elastic: rank %d: the job's store (etcd at %s) does not "
                        "answer (%s); training goes on at this size, but the job cannot "
                        "change its membership until etcd answers, and ends if it does not "
                        "within PYDDP_ELASTIC_STORE_LOST_S=%g s", self.rank, self.store.where,
                        e, _store_lost_s())
        if now - self.store_down_since >= _store_lost_s():
            return False
        if stop is not None:
            stop.wait(1.0)
        return True

    def _store_back(self):
        if self.store_down_since is not None:
            log.warning("pyddp: elastic: rank %d: the job's store (etcd at %s) answers "
                        "again", self.rank, self.store.where)
            self.store_down_since = None

    def _abort(self, why):
        g = self.group
        pg = getattr(g, "_pg", None) if g is not None else None
        if pg is not None:
            pg.abort(why)

    def _answer(self, st, epoch):
        """This rank answers for epoch, then takes part in closing it (every answering
        rank runs the same steps; compare_set makes one value win at each, so the loss
        of any rank meanwhile, the first to answer included, cannot stall the change):

        1. proposal: the ranks that answered within the settle time (at once when all
           did), then the joiners whose node is complete;
        2. each proposed rank confirms that it is still alive (a worker its launcher is
           stopping answers first and dies a moment later);
        3. members: the proposed ranks that confirmed within the settle time (at once
           when all did), then the joiners; written to E/<epoch+1>/members.

        A rank later in the answering order waits a little longer before it writes a
        value itself, so that normally the first one's stands."""
        base = f"{self.base}/{epoch}"
        reg, prop_key = f"{base}/reg", f"{base}/proposal"
        members_key = f"{self.base}/{epoch + 1}/members"
        ticket = st.add(reg, 1)
        st.set(f"{reg}/{ticket}", json.dumps({"id": self.me, "rank": self.rank,
                                              "leaving": self.leaving}))
        settle, lag = _settle_s(), 0.2 * (ticket - 1)
        n = self._wait_for_answers(st, epoch, reg, prop_key, settle, lag)
        if not st.check([prop_key]):
            refused = self._failed_joiners(st, epoch)
            answers = [json.loads(a) for a in
                       (get_optional(st, f"{reg}/{t}", settle + 1) for t in range(1, n + 1))
                       if a is not None]
            answers = sorted((a for a in answers if a["id"] not in refused
                              and not a.get("leaving")), key=lambda x: x["rank"])
            joiners = ready_joiners(st, self.base, self.admitted)
            st.compare_set(prop_key, "", json.dumps(
                {"answers": answers, "joiners": [[i, r["id"]] for i, r in joiners],
                 "refused": refused}))
        prop = json.loads(st.get(prop_key))
        answered = [x["id"] for x in prop["answers"]]
        if self.me in answered:
            st.set(f"{base}/ok/{self.me}", "1")
        oks = [f"{base}/ok/{i}" for i in answered]
        deadline = time.monotonic() + settle + lag
        while time.monotonic() < deadline and not st.check([members_key]):
            if _wait_slice(st, oks, deadline):
                break
        if st.check([members_key]):
            return
        alive = [x for x in prop["answers"] if st.check([f"{base}/ok/{x['id']}"])]
        joiners = prop["joiners"]
        ids = [x["id"] for x in alive] + [j for _, j in joiners]
        lost = sorted(set(range(self.size)) - {x["rank"] for x in alive})
        admitted = sorted(self.admitted | {i for i, _ in joiners})
        record = json.dumps({"ids": ids, "lost": lost, "admitted": admitted,
                             "joined": [j for _, j in joiners], "refused": prop["refused"],
                             "why": self.changed})
        if st.compare_set(members_key, "", record).decode() != record:
            return                                  # another rank's value stands
        for i, _ in joiners:
            st.set(f"{self.base}/join/{i}/epoch", str(epoch + 1))
        update_live(st, epoch=epoch + 1)
        log.warning("pyddp: elastic: world %d -> %d (%s; lost ranks %s, %d joined)",
                    self.size, len(ids), self.changed, lost, len(joiners))

    def _wait_for_answers(self, st, epoch, reg, prop_key, settle, lag):
        """Wait until every rank of epoch answered, or until those that did not are all
        known to be gone; returns the number of answers. A rank whose liveness port
        still takes connections is alive (paused by SIGSTOP, a long GC, a stalled disk:
        its kernel answers for it) and is waited for up to PYDDP_PEER_DEAD_S; one whose
        port refuses (its process died) or does not answer (its host vanished) is gone
        at once; one that published no port is waited for PYDDP_ELASTIC_SETTLE_S."""
        t0 = time.monotonic()
        settle_end, alive_end = t0 + settle + lag, t0 + _liveness.peer_dead_s() + lag
        records, next_probe = {}, t0 + 0.1
        while True:
            n = st.add(reg, 0)
            if n >= self.size or st.check([prop_key]):
                return n
            now = time.monotonic()
            if now >= next_probe:
                for t in range(1, n + 1):
                    if t not in records:
                        raw = get_optional(st, f"{reg}/{t}", 0.2)
                        records[t] = json.loads(raw)["rank"] if raw is not None else None
                pending = set(range(self.size)) - set(records.values())
                seen = {r: _liveness.probe(st, f"{self.base}/{epoch}/addr/{r}") for r in pending}
                if all(v == "gone" for v in seen.values()):
                    return n
                if "alive" in seen.values():
                    if now >= alive_end:
                        return n
                elif now >= settle_end:
                    return n
                next_probe = time.monotonic() + 0.3
            _wait_slice(st, [f"{reg}/{self.size}"], next_probe)    # the last answer

    def _failed_joiners(self, st, epoch):
        """{id: why} of the processes admitted into epoch when that epoch never came up
        (its rebuild or sync failed: those are the suspects; the founders of a failed
        epoch were all up in the one before)."""
        if epoch == 0 or st.check([f"{self.base}/{epoch}/up"]):
            return {}
        raw = get_optional(st, f"{self.base}/{epoch}/members", 1)
        joined = json.loads(raw).get("joined", []) if raw is not None else []
        why = (f"the job could not make its process group with this process in it "
               f"({self.changed}): check that the job's ranks can reach this node's data "
               f"ports (the security group, PYDDP_PORT_RANGE, PYDDP_SOCKET_IFNAME)")
        return {j: why for j in joined}

    def came_up(self):
        """Rank 0, once the current epoch's group is made and its state synced."""
        if self.rank == 0:
            try:
                self.store.set(f"{self.base}/{self.epoch}/up", "1")
            except _C.DistError as e:
                raise store_lost(self.store, e) from None

    def stop(self):
        """Stop the watcher (the job ends, or the epoch is over and handled); a watcher
        blocked in a long etcd wait ends when it wakes (or at close)."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)
        self._thread = None

    def close(self):
        self._stop.set()
        if self._presence is not None:
            self._presence.release()
            self._presence = None
        if self._watch_store is not None:
            self._watch_store.close()          # wakes a watcher blocked in a wait
        self.stop()
        if self._live is not None:
            self._live[0].close()
            self._live = None
        if self._watch_store is not None:
            self._watch_store.close()
            self._watch_store = None

    # -- the change ---------------------------------------------------------------------

    def notice(self, why):
        """End the current epoch: the watchers of every rank wake up."""
        try:
            self.store.set(f"{self.base}/{self.epoch}/change", why[:500])
        except _C.DistError as e:
            raise store_lost(self.store, e) from None

    def pending_joiners(self):
        """How many processes wait to join whose node is complete (rank 0 asks at each
        commit: one store request when nobody waits). While etcd does not answer (and
        for up to PYDDP_ELASTIC_STORE_LOST_S) none: the commit goes on without asking."""
        if self.store_down_since is not None and self._store_trouble(
                "no answer since the watcher's last request", None):
            return 0
        try:
            if self.store.add(f"{self.base}/join", 0) <= len(self.admitted):
                return 0
            return len(ready_joiners(self.store, self.base, self.admitted))
        except _C.DistError as e:
            if self._store_trouble(e, None):
                return 0
            raise store_lost(self.store, e) from None

    def finish(self):
        """The job is over (rank 0, when run() returns): processes still waiting to
        join, and any that come later, are told so instead of waiting."""
        st = self.store
        try:
            update_live(st, epoch=self.epoch, done=True)
            for i in range(st.add(f"{self.base}/join", 0)):
                if i not in self.admitted:
                    st.set(f"{self.base}/join/{i}/epoch", "done")
        except _C.DistError as e:
            log.warning("pyddp: elastic: could not tell waiting joiners that the job "
                        "ended (%s)", e)

    def next_world(self, timeout_s):
        """After the current epoch ended (notice, or the watcher saw it), or on a joiner
        not admitted yet: wait for the next epoch's members; returns (rank, size,
        prefix, members record) of this process in it and moves to that epoch. Raises
        StoreLost, or a DistError if this rank was left out."""
        if self.epoch is None:
            try:
                self.epoch = admission(self.store, self.base, self.me, timeout_s) - 1
            except _C.DistTimeoutError:
                raise
            except _C.DistError as e:
                raise store_lost(self.store, e) from None
        t = self._thread
        if t is not None:
            t.join(timeout=_settle_s() + timeout_s)
        self._thread = None
        if self.store_error is not None:
            raise self.store_error
        key = f"{self.base}/{self.epoch + 1}/members"
        try:
            self.store.wait([key], timeout=timedelta(seconds=_settle_s() + timeout_s))
            m = json.loads(self.store.get(key))
        except _C.DistError as e:
            raise store_lost(self.store, e) from None
        self.joined_now = bool(m.get("joined"))
        if self.me in m.get("refused", {}):
            raise LeftOut(f"this process was admitted into the elastic job at "
                          f"{self.store.where} and then left out: "
                          f"{m['refused'][self.me]}")
        if self.me not in m["ids"]:
            raise LeftOut(
                f"rank {self.rank} was left out of the job's new membership: it did not "
                f"answer the change ({m['why']}) while the others waited for it (up to "
                f"PYDDP_PEER_DEAD_S={_liveness.peer_dead_s():g} s while its liveness port "
                f"answered, else PYDDP_ELASTIC_SETTLE_S={_settle_s():g} s). This process "
                f"exits; its node's torchrun agent starts it again (--max-restarts) and it "
                f"rejoins through its own launch line")
        self.epoch += 1
        self.rank, self.size = m["ids"].index(self.me), len(m["ids"])
        self.admitted = set(m["admitted"])
        return self.rank, self.size, f"{self.base}/{self.epoch}/pg", m


def own_connection(store):
    """A connection of the membership's own to the job's store: torch's default group
    closes the store client it made when a change destroys it."""
    return store.clone()


def start(store, world_prefix, rank, size):
    """The membership of a job's first ranks (epoch 0), published for joiners by rank 0."""
    base = f"{world_prefix}/elastic"
    m = Membership(store, base, 0, rank, size, (), new_id())
    if rank == 0:
        publish(store, base)
    return m


def joiner(store, rec=None):
    """The membership of a process joining the running job whose store is store, not
    admitted yet (its epoch is None); next_world, called when it enters
    pyddp.elastic.run, asks for admission and waits for it. rec: the job's live record
    when the caller has read it (a process of the job's own launch line that found the
    job running); without it (PYDDP_ELASTIC_JOIN) it is waited for. Refused here, with
    a clear error, when the job runs another pyddp version or another token."""
    if rec is None:
        try:
            store.wait([LIVE_KEY], timeout=timedelta(
                seconds=min(store.timeout.total_seconds(), 30)))
        except _C.DistTimeoutError:
            raise _C.DistError(
                f"PYDDP_ELASTIC_JOIN={store.where}: that store holds no running "
                f"in-place elastic job (nothing called pyddp.elastic.run there); check the "
                f"address, or start the job itself with its normal launch line") from None
        rec = json.loads(store.get(LIVE_KEY))
    check_joiner(store, rec)
    return Membership(store, rec["base"], None, 0, 1, (), new_id())
