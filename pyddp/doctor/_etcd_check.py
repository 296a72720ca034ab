"""The doctor's look at the etcd cluster of an in-place elastic job
(``--rdzv-endpoint=etcd://...``): which members answer from this node, which one leads,
and whether a majority does (without one, etcd serves nothing and the job cannot change
its membership). Each member is asked alone (``/v3/maintenance/status``), with the
doctor's --timeout, through pyddp's own etcd client (TLS and login settings included).
"""
import time

from .. import _C, _etcd


def findings(endpoint, timeout):
    """Findings (level, check, text) for the etcd cluster named by endpoint."""
    try:
        members = _etcd.parse_members(endpoint)
    except _C.DistValueError as e:
        return [("FAIL", "etcd", str(e))]
    answers, leaders, bad = [], set(), []
    for m in members:
        try:
            c = _etcd.Cluster([m], timeout_s=timeout)
        except _C.DistValueError as e:
            return [("FAIL", "etcd", str(e))]
        t0 = time.monotonic()
        try:
            st = c.call("/v3/maintenance/status", {})
            ms = (time.monotonic() - t0) * 1e3
            answers.append(f"{m} (etcd {st.get('version', '?')}, {ms:.0f} ms)")
            if st.get("leader") not in (None, "0"):
                leaders.add(st["leader"])
        except (_C.DistError, OSError) as e:
            bad.append(f"{m}: {str(e).split(' (last error: ')[-1].rstrip(')')[:160]}")
        finally:
            c.close()
    n, need = len(members), len(members) // 2 + 1
    out = []
    if len(answers) >= need and len(leaders) == 1:
        out.append(("ok", "etcd", f"{len(answers)} of {n} members answer from this node, "
                    f"with one leader: {', '.join(answers)}"))
    elif len(answers) >= need:
        out.append(("warn", "etcd", f"{len(answers)} of {n} members answer but agree on no "
                    f"leader yet (an election in progress?): {', '.join(answers)}"))
    else:
        out.append(("FAIL", "etcd", f"only {len(answers)} of {n} members answer from this "
                    f"node; etcd serves requests only while a majority ({need} of {n}) is "
                    f"up and reachable: start the members, and open TCP 2379 to them "
                    f"(2380 between them)"))
    if bad:
        out.append(("warn" if len(answers) >= need else "FAIL", "etcd members",
                    "no answer from " + "; ".join(bad)))
    return out
