"""Straggler forensics: when a collective times out, say who had not arrived, how far
each rank got, and where its Python code is, and keep a flight record to dump.

How it works, without touching the hot path:

* Every world group (init_process_group's, or torch's "pyddp" backend's) has one
  :class:`Watcher`: a daemon thread holding its own store connection blocked in WAIT on
  ``<prefix>/stall/stuck/<i>``, the next incident's key, and a second short-timeout
  connection for reports.
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
"""
import json
import os
import re
import sys
import threading
import time
import weakref
from datetime import timedelta

from . import _C

REPORT_WAIT_S = 2.0
CONNECT_S = 30.0          # the watcher's store connections: time to connect
_FRAMES_PER_THREAD = 12

_by_tag = weakref.WeakValueDictionary()   # group tag -> Group of this process
_signal_installed = False


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

    def __init__(self, group):
        from .store import TCPStore
        st = group._store
        self.group = group
        self.rank = group._world_rank
        self.prefix = f"{group._prefix}/stall"
        self._stop = False
        host = st.host or "127.0.0.1"     # "" names a server this process hosts
        # Connect with time to spare: torch's TCPStore servers (torchrun's agent store)
        # now and then take 5 s to answer a new connection. Only the reports' requests
        # are bounded by REPORT_WAIT_S.
        connect = timedelta(seconds=CONNECT_S)
        self.reports = TCPStore(host, st.port, timeout=connect)
        self.reports.set_timeout(timedelta(seconds=REPORT_WAIT_S))
        self._watch = TCPStore(host, st.port, timeout=connect)
        self._watch.set_timeout(timedelta(hours=1))
        group._pg.set_stall_store(self.reports._client, self.prefix)
        self._thread = threading.Thread(target=self._run, name="pyddp-watcher", daemon=True)
        self._thread.start()

    def _run(self):
        i, told = 1, set()
        while not self._stop:
            key = f"{self.prefix}/stuck/{i}"
            try:
                self._watch.wait([key], timedelta(hours=1))
                info = _parse(self._watch.get(key).decode())
            except _C.DistTimeoutError:
                continue
            except Exception:  # noqa: BLE001 - the store closed: the group is over
                return
            try:
                rep = self.report(info)
                self._watch.set(f"{key}/report/{self.rank}", json.dumps(rep))
                # Several ranks may time out on the same collective: say it once.
                if (info["tag"], info["seq"]) not in told:
                    told.add((info["tag"], info["seq"]))
                    print(f"pyddp: rank {self.rank}: rank {info['rank']} timed out in "
                          f"{info['what_short']} (collective #{info['seq']} of its group); "
                          f"this rank's state:\n{self.text(rep)}", file=sys.stderr, flush=True)
                    if info["rank"] == self.rank:
                        dump_flight_record(group=self.group)
            except Exception:  # noqa: BLE001 - best effort: never disturb the job
                pass
            i += 1

    def report(self, info):
        """This process's answer about incident info."""
        g = _by_tag.get(info["tag"])
        prog = None
        if g is not None and g._pg is not None:
            p = g._pg.progress()
            prog = {"submitted": p["submitted"], "completed": p["completed"],
                    "last_done": p["last_done"]}
        fr = self.group._pg.flight_record() if self.group._pg is not None else []
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
        """End the watcher: close its store connections (its thread's WAIT then fails
        and the thread returns); with join_s, wait that long for the thread."""
        self._stop = True
        for s in (self._watch, self.reports):
            try:
                s.close()
            except Exception:  # noqa: BLE001
                pass
        if join_s is not None and self._thread is not threading.current_thread():
            self._thread.join(join_s)


def _parse(text):
    d = dict(kv.split("=", 1) for kv in text.split(";", 3))
    what = d.get("what", "")
    return {"rank": int(d["rank"]), "tag": int(d["tag"], 16), "seq": int(d["seq"]),
            "what": what, "what_short": what.split(" on rank ")[0]}


def explain(group, err):
    """The straggler summary for err, a failure of a collective on group, or None when
    no rank of its world announced a timeout on this group."""
    w = getattr(group, "_watcher", None)
    if w is None or group._pg is None:
        return None
    try:
        tag = group._pg.progress()["tag"]
        n = w.reports.add(f"{w.prefix}/stuck_n", 0)
        info = None
        for i in range(n, max(n - 4, 0), -1):
            cand = _parse(w.reports.get(f"{w.prefix}/stuck/{i}").decode())
            if cand["tag"] == tag:
                info, key = cand, f"{w.prefix}/stuck/{i}"
                break
        if info is None:
            return first_failure(w, err)
        reports, deadline = {}, time.monotonic() + REPORT_WAIT_S
        while len(reports) < len(group.ranks) and time.monotonic() < deadline:
            for r in group.ranks:
                if r not in reports and w.reports.check([f"{key}/report/{r}"]):
                    reports[r] = json.loads(w.reports.get(f"{key}/report/{r}").decode())
            if len(reports) < len(group.ranks):
                time.sleep(0.05)
    except Exception as e:  # noqa: BLE001 - the store is gone too: nothing to add
        if os.environ.get("PYDDP_DEBUG_FORENSICS"):
            print(f"pyddp: forensics failed: {e!r}", file=sys.stderr)
        return None
    return summarize(group, info, reports)


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
    """The "rank=R;what=..." record at key as a dict, waiting until deadline; or None."""
    while not w.reports.check([key]):
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.005)
    return dict(kv.split("=", 1) for kv in w.reports.get(key).decode().split(";", 1))


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
        rec = _record(w, f"{w.prefix}/broken/{cur}", deadline)
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
    first = _record(w, f"{w.prefix}/broken", 0)
    if first is None or int(first["rank"]) == w.rank:
        return None
    return f"The first failure in this job was on rank {first['rank']}: {first['what']}"


def summarize(group, info, reports):
    k = info["seq"]
    head = (f"Straggler report for collective #{k} on the group of ranks {group.ranks} "
            f"({info['what_short']}; rank {info['rank']} timed out waiting):")
    lines, arrived = [head], []
    for r in group.ranks:
        rep = reports.get(r)
        if rep is None:
            lines.append(f"  rank {r} did not answer within {REPORT_WAIT_S:.0f} s: its process "
                         f"is dead or stopped, or its host is unreachable")
            continue
        p = rep.get("progress")
        if p is None or p["submitted"] < k:
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


def dump_flight_record(file=None, group=None):
    """Print the flight record of group's communicator (the default group's if None:
    the last 64 collectives of this process, every group) and return it as a list."""
    from ._group import _resolve
    g = _resolve(group)
    entries = g.pg("dump_flight_record").flight_record()
    print(f"pyddp: rank {g._world_rank}: flight record (oldest first)\n"
          f"{format_flight_record(entries)}", file=file or sys.stderr, flush=True)
    return entries


def install_signal_dump():
    """With PYDDP_DUMP_ON_SIGNAL=1, SIGUSR1 prints the flight record (main thread only)."""
    global _signal_installed
    if _signal_installed or not _C.setting("PYDDP_DUMP_ON_SIGNAL"):
        return
    if threading.current_thread() is not threading.main_thread():
        return
    import signal

    def on_usr1(signum, frame):
        try:
            dump_flight_record()
        except Exception:  # noqa: BLE001 - no group any more
            pass
    signal.signal(signal.SIGUSR1, on_usr1)
    _signal_installed = True
