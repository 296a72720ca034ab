"""monitored_barrier: a barrier through the store that names the ranks that did not
arrive (torch's gloo-only function, for any pyddp group).

Group rank 0 waits, up to the timeout, for every other rank's arrival key, then writes
a verdict ("ok" or the message naming the missing ranks) that the others wait for.
Running through the store, it works even when the group's connections are in trouble.
"""
import time
from datetime import timedelta

from . import _C
from ._group import _resolve
from ._env import seconds


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
    """A barrier that names the ranks that did not arrive: group rank 0 waits up to
    timeout (default: the group's) for every other rank, and raises DistTimeoutError
    naming the first missing rank (or all of them with wait_all_ranks=True); the other
    ranks then raise an error that carries rank 0's message. The messages begin with
    gloo's sentences ("Rank 1 failed to pass monitoredBarrier in 2000 ms", "Rank 0 timed
    out in monitoredBarrier after 0 ms" when the timeout was spent before a rank was
    waited for, "Rank 2 successfully reached monitoredBarrier, but received errors while
    waiting for send/recv from rank 0"). Runs through the store, so it works even when
    the group's connections are in trouble."""
    g = _resolve(group)
    g.pg("monitored_barrier")
    tmo = g._timeout_s if timeout is None else seconds(timeout)
    n = g._mb
    g._mb += 1
    base = f"{g._prefix}/mb/{n}"
    st = g._store
    if g.rank != 0:
        st.set(f"{base}/arrived/{g.rank}", b"1")
        try:
            st.wait([f"{base}/verdict"], timedelta(seconds=tmo + 10))
        except _C.DistError as e:
            raise _C.DistTimeoutError(f"monitored_barrier: rank {g.ranks[g.rank]} did not hear "
                                      f"from rank {g.ranks[0]} (group rank 0) within "
                                      f"{tmo + 10:.0f} s: {e}") from None
        verdict = st.get(f"{base}/verdict").decode()
        if verdict != "ok":
            raise _C.DistTimeoutError(f"Rank {g.rank} successfully reached monitoredBarrier, "
                                      f"but received errors while waiting for send/recv from "
                                      f"rank 0: {verdict}")
        return None
    missing, out_of_time, deadline = [], False, time.monotonic() + tmo
    for r in range(1, g.size):
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                if not st.check([f"{base}/arrived/{r}"]):
                    out_of_time = not wait_all_ranks
                    raise _C.DistTimeoutError("late")
            else:
                st.wait([f"{base}/arrived/{r}"], timedelta(seconds=left))
        except _C.DistError:
            missing.append(r)
            if not wait_all_ranks:
                break
    if missing:
        msg = _verdict(g, missing, tmo, out_of_time, wait_all_ranks)
        st.set(f"{base}/verdict", msg.encode())
        raise _C.DistTimeoutError(msg)
    st.set(f"{base}/verdict", b"ok")
    return None


def _verdict(g, missing, tmo, out_of_time, wait_all_ranks):
    """Group rank 0's message for the group ranks missing: gloo's first sentence (which
    scripts and torch's tests match), then which global ranks and what to check.
    out_of_time: the timeout was spent before the first missing rank was waited for."""
    ms = int(tmo * 1000)
    glob = [g.ranks[r] for r in missing]
    if out_of_time:
        first = f"Rank 0 timed out in monitoredBarrier after {ms} ms"
    elif wait_all_ranks:
        first = (f"Ranks {', '.join(map(str, missing))} failed to pass monitoredBarrier in "
                 f"{ms} ms")
    else:
        first = f"Rank {missing[0]} failed to pass monitoredBarrier in {ms} ms"
    which = f"ranks {glob}" if wait_all_ranks else f"rank {glob[0]}"
    return (f"{first}. monitored_barrier: {which} (global) did not reach the barrier within "
            f"{tmo:.1f} s on the group of ranks {g.ranks}. Check that rank for a crash, a "
            f"hang, or a code path that skips this barrier.")
