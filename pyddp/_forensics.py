"""Straggler forensics: when a collective times out, say who had not arrived, how far
each rank got, and where its Python code is, and keep a flight record to dump.

How it works, without touching the hot path:

* Every world group (init_process_group's, or torch's "pyddp" backend's) has one
  :class:`Watcher`: a daemon thread holding its own store connection blocked in WAIT on
  ``<prefix>/stall/stuck/<i>``, the next incident's key, and a second short-timeout
  connection for reports, both opened by the thread itself once the group starts its
  first collective (init does not wait for them, nor pay for them: with hundreds of
  ranks on a few cores every rank's two connections would slow everyone's init). The
  store's keys and records are declared once, in
  ``csrc/core/ddp_forensics.h``; this module reads them through ``_C.FX_*``.
* When a collective times out, the C worker announces it in the store before the group
  breaks (``ADD stuck_n``, ``SET stuck/<i> = rank, group tag, collective number``).
* Every watcher wakes, publishes this process's report (its progress on that group from
  the C counters, the tail of the flight record, a traceback of every thread) under
  ``stuck/<i>/report/<rank>``, and prints it to its own stderr.
* A rank whose collective failed (it timed out, or its peers' links closed because a
  peer timed out) looks for an incident on its group with one store round trip, waits
  up to about 2 s for the members' reports, and raises with a summary: which ranks had
  not arrived, the last collective each completed, and where each is now; a rank that
  does not answer is named as possibly dead or stopped.
* Several ranks often time out on the same collective, each announcing its own
  incident. A watcher answers the first and copies the same report to the others of
  the same collective, so no incident waits for a second report to be made.
* Each rank that read the reports says so (``ADD stuck/read/<tag>/<seq>``). The rank
  whose process hosts the store (whose exit would take the reports with it) waits, up
  to LINGER_S, until every rank that had reached the collective has read them before
  it raises: a script that exits on the error cannot cut the others' reports short.
"""
import json
import logging
import os
import re
import sys
import threading
import time
import weakref
from datetime import timedelta

from . import _C, _bgthread

REPORT_WAIT_S = 2.0
STOP_S = 2.0              # destroy's wait for a stopped watcher's thread to return
LINGER_S = REPORT_WAIT_S + 3.0   # the store host's wait for the others to read the reports
CONNECT_S = 30.0          # the watcher's store connections: time to connect
_FRAMES_PER_THREAD = 12

_by_tag = weakref.WeakValueDictionary()   # group tag -> Group of this process
_signal_installed = False

# The store schema (csrc/core/ddp_forensics.h): key names, and each record's fields.
_KEY = _C.FX_KEYS
_STUCK_FIELDS = tuple(_C.FX_STUCK_FIELDS.split(";"))
_BROKEN_FIELDS = tuple(_C.FX_BROKEN_FIELDS.split(";"))


def _stuck_n_key(prefix):
    return f"{prefix}/{_KEY['incidents']}"


def _stuck_key(prefix, i):
    """Incident i's record."""
    return f"{prefix}/{_KEY['incident']}/{i}"


def _report_key(stuck_key, rank):
    """rank's report about the incident whose record is at stuck_key."""
    return f"{stuck_key}/{_KEY['report']}/{rank}"


def _read_key(prefix, tag, seq):
    """The count of ranks that read the reports of collective seq of group tag."""
    return f"{prefix}/{_KEY['incident']}/{_KEY['read']}/{tag:016x}/{seq}"


def _broken_key(prefix, rank=None):
    """rank's failure record; the first failure's for rank None."""
    return f"{prefix}/{_KEY['failure']}" + ("" if rank is None else f"/{rank}")


def _fields(text, names):
    """A record's text as {name: value}: "name=value" fields joined by ';' in the
    order of names, the last one free text (it may hold ';' and '='). ValueError when
    text is not such a record."""
    parts = text.split(";", len(names) - 1)
    out = {}
    for name, part in zip(names, parts):
        key, sep, value = part.partition("=")
        if key != name or not sep:
            raise ValueError(f"not a forensics record with fields {names}: {text[:200]!r}")
        out[name] = value
    if len(out) != len(names):
        raise ValueError(f"not a forensics record with fields {names}: {text[:200]!r}")
    return out


def _parse(text):
    """A STUCK record: {rank, tag, seq, what, what_short (what without "on rank ...")}."""
    d = _fields(text, _STUCK_FIELDS)
    what = d["what"]
    return {"rank": int(d["rank"]), "tag": int(d["tag"], 16), "seq": int(d["seq"]),
            "what": what, "what_short": what.split(" on rank ")[0]}


def _parse_broken(text):
    """A BROKEN record: {rank, what}."""
    d = _fields(text, _BROKEN_FIELDS)
    return {"rank": int(d["rank"]), "what": d["what"]}


def register(group):
    """Remember group by its tag, so a report can describe any group of this process."""
    if group._pg is not None:
        _by_tag[group._pg.progress()["tag"]] = group


def _mib(n):
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


def describe_entry(e):
    """'all_reduce #5, 16.0 MiB, finished 4.1 s ago' for a flight-record entry."""
    what = f"{e['op']} #{e['seq']}" if e["seq"] else e["op"]
    s = f"{what}, {_mib(e['bytes'])} of {e['dtype']}"
    if e["state"] == "done":
        s += f", finished {e['ended_ago']:.1f} s ago"
        if e["status"] != "ok":
            s += f" ({e['status']})"
    elif e["state"] == "running":
        s += f", running for {e['started_ago']:.1f} s"
    else:
        s += f", queued {e['queued_ago']:.1f} s ago"
    return s


def stacks(skip_ident=None):
    """Every thread's innermost frames: [{"thread", "frames": [[file, line, func]]}]."""
    names = {t.ident: t.name for t in threading.enumerate()}
    names.update(_bgthread.names)
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == skip_ident:
            continue
        frames = []
        f = frame
        while f is not None and len(frames) < 64:
            frames.append([f.f_code.co_filename, f.f_lineno, f.f_code.co_name])
            f = f.f_back
        frames.reverse()
        out.append({"thread": names.get(ident, str(ident)),
                    "frames": frames[-_FRAMES_PER_THREAD:]})
    out.sort(key=lambda t: t["thread"] != "MainThread")
    return out


def _where(report):
    """'train.py:40 in load_batch' for the innermost frame of the main thread that is
    not pyddp's own code."""
    for t in report.get("stacks", []):
        if t["thread"] != "MainThread":
            continue
        for f in reversed(t["frames"]):
            if "/pyddp/" not in f[0] and "\\pyddp\\" not in f[0]:
                return f"{f[0]}:{f[1]} in {f[2]}"
        if t["frames"]:
            f = t["frames"][-1]
            return f"{f[0]}:{f[1]} in {f[2]}"
    return "unknown"


def format_flight_record(entries):
    lines = [f"{'id':>5} {'group':>16} {'op':<22} {'dtype':<9} {'bytes':>12} state"]
    for e in entries:
        what = f"{e['op']} #{e['seq']}" if e["seq"] else e["op"]
        lines.append(f"{e['id']:>5} {e['tag']:016x} {what:<22} {e['dtype']:<9} "
                     f"{e['bytes']:>12} {describe_entry(e).split(', ', 2)[-1]}")
    return "\n".join(lines)


class Watcher:
    """The per-process watcher of one world group (see the module's docstring)."""

    def __init__(self, group, torch_rendezvous=False):
        """torch_rendezvous: group is torch's "pyddp" backend's, over the store torch's
        rendezvous made (hosted by rank 0's process unless torchrun's agent hosts it)."""
        st = group._store
        self.group_ref = weakref.ref(group)   # weakly: see _pg
        self.rank = group._world_rank
        self.prefix = f"{group._prefix}/stall"
        # This process hosts the store: pyddp's own server here, or torch's rendezvous
        # (env://, tcp://) without torchrun's agent, where rank 0 hosts it.
        self.hosts_store = getattr(st, "_server", None) is not None or (
            torch_rendezvous and self.rank == 0
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True")
        self._stop = False
        self._waiting = True               # for the group's first collective (_run)
        self._lock = threading.Lock()     # _stop, the connections, arming the group
        self.reports = self._watch = None  # set by the thread once connected
        self._store = st
        self._thread = _bgthread.BackgroundThread(self._run, "pyddp-watcher")

    def _pg(self):
        """The group's communicator; None once destroyed or gone (held weakly: see join)."""
        g = self.group_ref()
        return g._pg if g is not None else None

    def _connect(self):
        """On the watcher's thread once the group's first collective started, so that
        init never waits for it: open the two store connections and arm the group's
        announcements (``set_stall_store``). False if
        the watcher was stopped meanwhile, or the store cannot be reached (then a
        warning: the job goes on without forensics). Until this returns, a timeout or
        failure is not announced and an error gets no straggler summary."""
        conns = []
        if self._stop:
            return False
        try:
            # Connect with time to spare: torch's TCPStore servers (torchrun's agent
            # store) now and then take 5 s to answer a new connection. Only the
            # reports' requests are bounded by REPORT_WAIT_S.
            for wait in (REPORT_WAIT_S, 3600.0):
                conns.append(self._store.clone(timeout=timedelta(seconds=CONNECT_S)))
                conns[-1].set_timeout(timedelta(seconds=wait))
        except Exception as e:  # noqa: BLE001 - forensics are best effort; training is not
            _close(conns)
            if not self._stop:
                logging.getLogger("pyddp").warning(
                    "pyddp: rank %d: no straggler watcher (%s)", self.rank, e)
            return False
        with self._lock:
            pg = self._pg()
            if self._stop or pg is None:
                _close(conns)
                return False
            self.reports, self._watch = conns
            pg.set_stall_store(self.reports._client, self.prefix)
        return True

    def _run(self):
        # Connect once the group (or a subgroup over its links) starts its first
        # collective, the first thing that can time out: init_process_group of many
        # ranks on few cores is then not slowed by every rank's two connections.
        while not self._stop:
            pg = self._pg()
            if pg is None or pg.wait_used(1000):
                break
        self._waiting = False
        if not self._connect():
            return
        i, told, dumped = 1, set(), set()
        while not self._stop:
            key = _stuck_key(self.prefix, i)
            try:
                self._watch.wait([key], timedelta(hours=1))
                info = _parse(self._watch.get(key).decode())
            except _C.DistTimeoutError:
                continue
            except Exception:  # noqa: BLE001 - the store closed: the group is over
                return
            try:
                rep = self.report(info)
                text = json.dumps(rep)
                self._watch.set(_report_key(key, self.rank), text)
                i, announcers = self._answer_same(i, info, text)
                # Several ranks may time out on the same collective: say it once, and
                # dump the flight record once if this rank is one of them.
                what = (info["tag"], info["seq"])
                if what not in told:
                    told.add(what)
                    print(f"pyddp: rank {self.rank}: rank {info['rank']} timed out in "
                          f"{info['what_short']} (collective #{info['seq']} of its group); "
                          f"this rank's state:\n{self.text(rep)}", file=sys.stderr, flush=True)
                if self.rank in announcers and what not in dumped:
                    dumped.add(what)
                    g = self.group_ref()
                    if g is not None:
                        print_flight_record(g)
            except Exception:  # noqa: BLE001 - best effort: never disturb the job
                pass
            i += 1

    def _answer_same(self, i, info, text):
        """Give the incidents announced after incident i for the same collective (other
        ranks that timed out on it) the same report, without waiting for any not yet
        written. Returns the last incident answered and the ranks that announced them."""
        announcers = {info["rank"]}
        for j, key, nxt in _incidents_after(self._watch, self.prefix, i):
            if (nxt["tag"], nxt["seq"]) != (info["tag"], info["seq"]):
                break
            self._watch.set(_report_key(key, self.rank), text)
            announcers.add(nxt["rank"])
            i = j
        return i, announcers

    def report(self, info):
        """This process's answer about incident info."""
        g = _by_tag.get(info["tag"])
        prog = None
        if g is not None and g._pg is not None:
            p = g._pg.progress()
            prog = {"submitted": p["submitted"], "completed": p["completed"],
                    "last_done": p["last_done"]}
        fr = pg.flight_record() if (pg := self._pg()) is not None else []
        return {"rank": self.rank, "pid": os.getpid(), "progress": prog, "flight": fr[-8:],
                "stacks": stacks(skip_ident=threading.get_ident())}

    @staticmethod
    def text(rep):
        lines = []
        p = rep.get("progress")
        if p:
            last = describe_entry(p["last_done"]) if p["last_done"] else "none"
            lines.append(f"  progress on the group: {p['submitted']} collectives called, "
                         f"{p['completed']} completed; last completed: {last}")
        for t in rep.get("stacks", []):
            lines.append(f"  thread {t['thread']}:")
            lines += [f"    {f}:{ln} in {fn}" for f, ln, fn in t["frames"]]
        return "\n".join(lines)

    def stop(self, join_s=None):
        """End the watcher: close its store connections (its thread's WAIT then fails and
        it returns; it opens none from now on); with join_s, wait that long for the
        thread, unless it still waits for the group's first collective (it returns once
        the group is destroyed: join() after that)."""
        with self._lock:
            self._stop = True
            _close((self._watch, self.reports))
        if join_s is not None and not self._waiting:
            self.join(join_s)

    def join(self, join_s):
        """Wait up to join_s for the stopped watcher's thread to return; whether it did
        (it holds the group only weakly: a thread past join_s keeps nothing alive)."""
        return self._thread.is_current() or self._thread.join(join_s)


def _close(stores):
    """Close each store client of stores that is not None, ignoring errors."""
    for s in stores:
        if s is None:
            continue
        try:
            s.close()
        except Exception:  # noqa: BLE001
            pass


def explain(group, err):
    """The straggler summary for err, a failure of a collective on group, or None when
    no rank of its world announced a timeout on this group. Waits at most REPORT_WAIT_S
    for the members' reports; a member that announced a timeout of its own on the same
    collective had reached it, so only the others' reports are waited for."""
    w = getattr(group, "_watcher", None)
    if w is None or group._pg is None or w.reports is None:
        return None
    try:
        tag = group._pg.progress()["tag"]
        n = w.reports.add(_stuck_n_key(w.prefix), 0)
        info = None
        for i in range(n, max(n - 4, 0), -1):
            cand = _parse(w.reports.get(_stuck_key(w.prefix, i)).decode())
            if cand["tag"] == tag:
                info, key = cand, _stuck_key(w.prefix, i)
                break
        if info is None:
            return first_failure(w, err)
        announced, seen = set(), max(n - 4, 0)
        reports, deadline = {}, time.monotonic() + REPORT_WAIT_S
        while True:
            seen = _announced(w, info, seen, announced)
            for r in group.ranks:
                if r not in reports and w.reports.check([_report_key(key, r)]):
                    reports[r] = json.loads(w.reports.get(_report_key(key, r)).decode())
            if all(r in reports or r in announced for r in group.ranks) \
                    or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
    except Exception as e:  # noqa: BLE001 - the store is gone too: nothing to add
        _debug(e)
        return None
    text = summarize(group, info, reports, announced)
    _read_and_linger(w, info, reports, announced)
    return text


def _announced(w, info, seen, ranks):
    """Add to ranks the ranks that announced a timeout of info's collective in the
    incidents after number seen (only those already written); returns the last read."""
    for j, _key, cand in _incidents_after(w.reports, w.prefix, seen):
        if (cand["tag"], cand["seq"]) == (info["tag"], info["seq"]):
            ranks.add(cand["rank"])
        seen = j
    return seen


def _incidents_after(store, prefix, i):
    """(number, key, parsed record) of each incident announced after number i, in order,
    stopping at the first one not written yet (its announcer is between ADD and SET)."""
    n = store.add(_stuck_n_key(prefix), 0)
    for j in range(i + 1, n + 1):
        key = _stuck_key(prefix, j)
        if not store.check([key]):
            return
        yield j, key, _parse(store.get(key).decode())


def _debug(e):
    if _C.setting("PYDDP_DEBUG_FORENSICS"):
        print(f"pyddp: forensics failed: {e!r}", file=sys.stderr)


def _read_and_linger(w, info, reports, announced):
    """Count this rank as having read the reports of info's collective; in the process
    that hosts the store, wait (at most LINGER_S) until every rank that had reached the
    collective has, so that this process exiting on its error does not close the store
    while they still read. Best effort: a store that is gone ends the wait."""
    key = _read_key(w.prefix, info["tag"], info["seq"])
    arrived = len(announced | {r for r, rep in reports.items() if _arrived(rep, info["seq"])})
    try:
        n = w.reports.add(key, 1)
        deadline = time.monotonic() + LINGER_S
        while w.hosts_store and n < arrived and time.monotonic() < deadline:
            time.sleep(0.02)
            n = w.reports.add(key, 0)
    except Exception as e:  # noqa: BLE001
        _debug(e)


def _arrived(rep, k):
    """A member's report says it had called collective #k of the group."""
    p = rep.get("progress")
    return p is not None and p["submitted"] >= k


FIRST_FAILURE_WAIT_S = 0.25

# "receiving from rank 3 (10.0.0.2:4711) (0 of 40 bytes done): the peer closed ..." (the
# link driver's wording, ddp_link.c; peers are named by world rank): the peer this
# failure blames, when the failure is that the peer went away.
_PEER = re.compile(r"(?:receiving from|sending to) rank (\d+) \(")
_LOST = re.compile(r"closed|reset|[Bb]roken pipe|no answer from")


def _blamed(what):
    """The world rank a failure message says went away, or None (its own error)."""
    m = _PEER.search(what)
    return int(m.group(1)) if m and _LOST.search(what) else None


def _record(w, key, deadline):
    """The BROKEN record at key ({rank, what}), waiting until deadline; or None."""
    while not w.reports.check([key]):
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.005)
    return _parse_broken(w.reports.get(key).decode())


def first_failure(w, err):
    """Where a lost connection came from. Every failing rank records its error in the
    store before it breaks its links (broken/<rank>; the C worker's failure_announce),
    so this follows the chain from the peer err blames: a rank that recorded an error of
    its own is the first failure; one that recorded nothing went away without one (died,
    killed, exited). Waits at most FIRST_FAILURE_WAIT_S in all, and only for errors that
    blame a peer. None when there is nothing to add (err already names the cause)."""
    msg = str(err)
    cur = _blamed(msg)
    if cur is None:
        return None
    deadline = time.monotonic() + FIRST_FAILURE_WAIT_S
    seen, last = {w.rank}, None      # last: (rank, message) of the latest record read
    while cur not in seen:
        seen.add(cur)
        rec = _record(w, _broken_key(w.prefix, cur), deadline)
        if rec is None:
            if last is None:         # err's own peer went away: err says so already
                return None
            return (f"Rank {cur} recorded no error of its own: it most likely died, was "
                    f"killed or exited (check its log and exit status). Rank {last[0]} "
                    f"lost it: {last[1]}")
        last = (cur, rec["what"])
        nxt = _blamed(rec["what"])
        if nxt is None:
            return f"The first failure in this job was on rank {cur}: {rec['what']}"
        cur = nxt
    # Ranks that gave up on each other: the first record, if another rank made it.
    first = _record(w, _broken_key(w.prefix), 0)
    if first is None or first["rank"] == w.rank:
        return None
    return f"The first failure in this job was on rank {first['rank']}: {first['what']}"


def summarize(group, info, reports, announced=()):
    """The report's text: reports maps a member to its watcher's report; announced holds
    the members that announced a timeout of this collective (they had reached it)."""
    k = info["seq"]
    head = (f"Straggler report for collective #{k} on the group of ranks {group.ranks} "
            f"({info['what_short']}; rank {info['rank']} timed out waiting):")
    lines, arrived = [head], []
    for r in group.ranks:
        rep = reports.get(r)
        if rep is None and r in announced:
            arrived.append(r)
            continue
        if rep is None:
            lines.append(f"  rank {r} did not answer within {REPORT_WAIT_S:.0f} s: its process "
                         f"is dead or stopped, or its host is unreachable")
            continue
        p = rep.get("progress")
        if not _arrived(rep, k):
            done = p["completed"] if p else 0
            last = describe_entry(p["last_done"]) if p and p["last_done"] else "none"
            lines.append(f"  rank {r} has not arrived: it completed {done} collectives on "
                         f"this group; its last was {last}; its Python code is at "
                         f"{_where(rep)}")
        else:
            arrived.append(r)
    if arrived:
        lines.append(f"  ranks {', '.join(map(str, arrived))} had reached it")
    return "\n".join(lines)


def print_flight_record(group, file=None):
    """Print the flight record of group's communicator (the last 64 collectives of this
    process, every group of its world) on file (stderr) and return it as a list."""
    entries = group.pg("dump_flight_record").flight_record()
    print(f"pyddp: rank {group._world_rank}: flight record (oldest first)\n"
          f"{format_flight_record(entries)}", file=file or sys.stderr, flush=True)
    return entries


def install_signal_dump(dump):
    """With PYDDP_DUMP_ON_SIGNAL=1, SIGUSR1 calls dump() (main thread only; once per
    process): pyddp.dump_flight_record, which prints the default group's record."""
    global _signal_installed
    if _signal_installed or not _C.setting("PYDDP_DUMP_ON_SIGNAL"):
        return
    if threading.current_thread() is not threading.main_thread():
        return
    import signal

    def on_usr1(signum, frame):
        try:
            dump()
        except Exception:  # noqa: BLE001 - no group any more
            pass
    signal.signal(signal.SIGUSR1, on_usr1)
    _signal_installed = True
