"""The doctor's conclusions: findings from one node's facts (``_facts``), from
the master port, and from comparing every rank's facts.

A finding is ``(level, check, text)``: "ok", "info", "warn" (would only slow a job),
or "FAIL" (would stop a job; the text says what to do). Everything here is a pure
function of facts except reach(), which connects to the master's port.
"""
import difflib
import os
import re
import time
from collections import Counter
from datetime import timedelta

from .. import _C
from ._facts import human_bytes, is_loopback, resolve, iface_of
from ..store import TCPStore

LISTENER_KEY = "pyddp_doctor/listener"   # set by `doctor --listen`; visitors append below
VISITS_KEY = "pyddp_doctor/visits"
SEG_OVERHEAD = 64 << 10                  # a pair's segment beyond its two rings (bound)


def open_rule(port, src):
    """What to open for TCP port from address src, in the terms of clouds and hosts."""
    return (f"Allow inbound TCP port {port} from {src} on the master (cloud security "
            f"group: an inbound rule for TCP {port} from the nodes' subnet; host firewall: "
            f"`sudo ufw allow {port}/tcp` or `sudo firewall-cmd --add-port={port}/tcp`)")


def _route(host, timeout):
    """(None, source address, "addr (iface)", whether host is this host), or (a FAIL
    finding, None, None, None) when host does not resolve or has no route."""
    try:
        addrs = resolve(host, timeout)
    except (OSError, TimeoutError) as e:
        return (("FAIL", "master port", f"{host!r} does not resolve on this host ({e}): use "
                 f"the master's private IP address as MASTER_ADDR, or add the name to DNS or "
                 f"/etc/hosts"), None, None, None)
    try:
        src = _C.route_addr(addrs[0])
    except _C.DistError as e:
        return (("FAIL", "master port", f"no route from this host to {host} ({addrs[0]}): "
                 f"{e}"), None, None, None)
    return None, src, f"{src} ({iface_of(src) or '?'})", is_loopback(addrs[0]) or src == addrs[0]


def unreachable(host, port, err, timeout):
    """The FAIL finding for a store at host:port that could not be used (err: the
    DistNetworkError or DistStoreError that said so)."""
    bad, src, via, local = _route(host, timeout)
    if bad:
        return bad
    if isinstance(err, _C.DistStoreError):
        return ("FAIL", "master port", f"{host}:{port} answers but not as a TCPStore ({err}): "
                f"MASTER_PORT is another service's port, or something between the nodes "
                f"intercepts the connection")
    m = re.search(r"last error: ([^)]*)", str(err))
    why = m.group(1) if m else str(err)
    if "refused" in why.lower():
        here = " (this is the master's host)" if local else ""
        return ("FAIL", "master port",
                f"{host}:{port} refused the connection from {via}{here}: nothing listens on "
                f"port {port} there yet, or a firewall rejects it. Start the job's torchrun "
                f"on the master first (or `python -m pyddp.doctor --listen 300` there). "
                f"{open_rule(port, src)}")
    return ("FAIL", "master port",
            f"no connection to {host}:{port} from {via} within {timeout:.1f} s (last error: "
            f"{why}): a firewall or cloud security group drops the packets, or {host} is not "
            f"the master's address on this network. {open_rule(port, src)}")


def reach(host, port, timeout):
    """Findings for TCP to the master's store at host:port from this node."""
    if not host or not port:
        return [("info", "master port", "not checked: no master given (--master host:port, "
                 "or MASTER_ADDR and MASTER_PORT)")]
    bad, src, via, _ = _route(host, timeout)
    if bad:
        return [bad]
    t0 = time.monotonic()
    try:
        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
    except (_C.DistNetworkError, _C.DistStoreError) as e:
        return [unreachable(host, port, e, timeout)]
    ms = (time.monotonic() - t0) * 1e3
    try:
        extra = ""
        if store.check([LISTENER_KEY]):
            store.append(VISITS_KEY, f"{os.uname().nodename} ({src})\n")
            extra = f" (the doctor listening on {store.get(LISTENER_KEY).decode()})"
    except _C.DistError:
        pass
    finally:
        store.close()
    return [("ok", "master port", f"{host}:{port} answers as a TCPStore{extra}, reached in "
             f"{ms:.0f} ms from {via}")]


def _settings_findings(f):
    s, out = f["settings"], []
    for name in s["unknown"]:
        near = difflib.get_close_matches(name, [d["name"] for d in _C.settings()], 1)
        out.append(("warn", "settings", f"{name} is not a pyddp setting and is ignored"
                    + (f" (did you mean {near[0]}?)" if near else "")))
    for e in s["errors"]:
        out.append(("FAIL", "settings", f"{e}: init_process_group would refuse it"))
    if s["set"]:
        out.append(("info", "settings", ", ".join(f"{k}={v}" for k, v in
                                                   sorted(s["set"].items()))))
    return out


def node_findings(f, backend, nproc, multi_host=None, master=None):
    """Findings about one node's facts f. backend: "cpu"/"gloo"/"nccl". nproc: ranks
    that will share this host (sizes /dev/shm). multi_host: None when alone (the
    host-name check then warns about torchrun's c10d form in general); under torchrun,
    whether the job spans hosts. master: MASTER_ADDR."""
    out = []
    v = f["versions"]
    out.append(("ok", "versions", f"pyddp {v['pyddp']}, torch {v['torch']}, NumPy "
                f"{v['numpy']}, Python {v['python']}"))
    a = f["advertise"]
    if a["error"]:
        out.append(("FAIL", "advertise", f"{a['error']}"))
    elif a["fallback"]:
        out.append(("warn", "advertise", f"{a['addr']} ({a['how']}): peers on other hosts "
                    f"could not connect to it; set PYDDP_SOCKET_IFNAME to the private "
                    f"network's interface"))
    else:
        out.append(("ok", "advertise", f"{a['addr']} on {a['iface'] or '?'} ({a['how']})"))
    out += _hostname_findings(f, multi_host, master)
    out += _shm_findings(f, nproc)
    out += _nccl_findings(f, backend)
    out += _settings_findings(f)
    return out


def _hostname_findings(f, multi_host, master):
    n = f["names"]
    loop = {k: a for k, a in n["addrs"].items() if a and all(is_loopback(x) for x in a)}
    bad = {k: a for k, a in n["addrs"].items() if a and a[0].startswith("error")}
    if bad:
        k = next(iter(bad))
        return [("warn" if multi_host is not False else "info", "host name",
                 f"{k!r} does not resolve here ({bad[k][0][7:]}); "
                 f"torchrun's c10d form tells the workers this name: pass "
                 f"--local-addr={f['primary']} to torchrun or fix DNS or /etc/hosts")]
    if not loop:
        shown = "; ".join(f"{k} -> {', '.join(a)}" for k, a in n["addrs"].items())
        return [("ok", "host name", shown)]
    k = next(iter(loop))
    text = (f"{k!r} resolves to {', '.join(loop[k])} (loopback). torchrun's c10d form "
            f"(--rdzv-backend=c10d) tells the workers this host name, and on this host it "
            f"leads back to loopback: map it to the private address in /etc/hosts, pass "
            f"--local-addr={f['primary']} (this node's address) to torchrun, or use the "
            f"static form (--master_addr=IP)")
    if multi_host is None:
        return [("warn", "host name", text)]
    c10d = master and master in n["addrs"] and master in loop
    if multi_host and c10d:
        return [("warn", "host name", text)]
    return [("info", "host name", f"{k!r} resolves to loopback (harmless here)")]


def _shm_findings(f, nproc):
    out = []
    if f["settings"]["shm_disable"]:
        return [("info", "/dev/shm", "shared memory is off (PYDDP_SHM_DISABLE): ranks on "
                 "this host use TCP")]
    free, ring = f["shm_free"], f["settings"]["ring_bytes"]
    need = nproc * (nproc - 1) // 2 * (2 * ring + SEG_OVERHEAD)
    if free is None:
        out.append(("warn", "/dev/shm", "missing: ranks on this host fall back to TCP "
                    "(slower). Mount a tmpfs there (docker: --shm-size=1g)"))
    elif free < need:
        out.append(("warn", "/dev/shm", f"{human_bytes(free)} free, {nproc} ranks per host "
                    f"need about {human_bytes(need)}: pairs that get no segment use TCP "
                    f"(slower). Enlarge it (docker: --shm-size=1g) or lower "
                    f"PYDDP_SHM_RING_BYTES"))
    else:
        out.append(("ok", "/dev/shm", f"{human_bytes(free)} free ({nproc} ranks per host "
                    f"need about {human_bytes(need)})"))
    c = f["cma"]
    scope = "no Yama" if c["ptrace_scope"] is None else f"ptrace_scope {c['ptrace_scope']}"
    if not c["enabled"]:
        out.append(("info", "single-copy", "off (PYDDP_SHM_CMA=0)"))
    elif c["probe"] == "allowed":
        out.append(("ok", "single-copy", f"allowed ({scope})"))
    else:
        out.append(("warn", "single-copy", f"blocked ({scope}; a process could not read "
                    f"another's memory: {c['probe']}): large messages between ranks on this "
                    f"host take two copies through the ring. To allow it: `sudo sysctl -w "
                    f"kernel.yama.ptrace_scope=0`, or run with CAP_SYS_PTRACE (docker: "
                    f"--cap-add=SYS_PTRACE)"))
    return out


def _nccl_findings(f, backend):
    n = f["nccl"]
    if "error" in n:
        found = f"NCCL {n['version']} ({n['path']}) loads, but " if "version" in n else ""
        if backend == "nccl":
            return [("FAIL", "NCCL", f"backend nccl needs NCCL and the CUDA runtime: "
                     f"{found}{n['error']}")]
        if found:
            return [("info", "NCCL", f"NCCL {n['version']} ({n['path']}), CUDA runtime not "
                     f"found (backend {backend} does not need them)")]
        return [("info", "NCCL", f"not found (backend {backend} does not need it)")]
    desc = (f"NCCL {n['version']} ({n['path']}), CUDA runtime {n['cudart']} "
            f"({n['cudart_path']}), {n['devices']} GPU(s)")
    if backend == "nccl" and n["devices"] == 0:
        return [("FAIL", "NCCL", f"{desc}, but no GPU is usable: {n['device_error']}. "
                 f"Use --backend cpu on machines without GPUs")]
    return [("ok" if backend == "nccl" else "info", "NCCL", desc)]


# ---- comparing ranks -------------------------------------------------------------------

def ranks_text(ranks):
    """[0, 1, 2, 5] -> '0-2,5'."""
    ranks, parts, i = sorted(ranks), [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(parts)


def who(facts, ranks):
    hosts = ", ".join(dict.fromkeys(facts[r]["host"] for r in ranks))
    return f"rank{'s' if len(ranks) > 1 else ''} {ranks_text(ranks)} ({hosts})"


def column(facts, key):
    """Each rank's value for a compared column."""
    get = {"pyddp": lambda f: f["versions"]["pyddp"], "torch": lambda f: f["versions"]["torch"],
           "numpy": lambda f: f["versions"]["numpy"],
           "python": lambda f: f["versions"]["python"],
           "nccl": lambda f: f["nccl"].get("version", "-"),
           "iface": lambda f: f["advertise"]["iface"] or "?"}[key]
    return [get(f) for f in facts]


def majority(values):
    """The most common value (ties: the lowest rank's)."""
    c = Counter(values)
    best = max(c.values())
    return next(v for v in values if c[v] == best)


def world_findings(facts, backend):
    """Findings from comparing every rank's facts (facts[r] is rank r's; None for a
    rank that never reported, which is left out)."""
    got = [(r, f) for r, f in enumerate(facts) if f is not None]
    out = []
    for key, name in (("pyddp", "pyddp"), ("torch", "torch"), ("numpy", "NumPy"),
                      ("python", "Python"), ("nccl", "NCCL")):
        groups = {}
        for r, f in got:
            groups.setdefault(column([f], key)[0], []).append(r)
        if len(groups) < 2:
            continue
        shown = "; ".join(f"{v} on {who(facts, rs)}" for v, rs in groups.items())
        level = "warn" if key == "nccl" and backend != "nccl" else "FAIL"
        out.append((level, "versions", f"{name} differs between ranks: {shown}. Install the "
                    f"same {name} on every node (e.g. {name} "
                    f"{majority(column([f for _, f in got], key))})"))
    if got and not [x for x in out if x[0] == "FAIL"]:
        v = got[0][1]["versions"]
        out.insert(0, ("ok", "versions", f"the same on every rank: pyddp {v['pyddp']}, "
                       f"torch {v['torch']}, NumPy {v['numpy']}, Python {v['python']}"))
    hosts = {f["host_id"] for _, f in got}
    if len(hosts) > 1:
        loop = [r for r, f in got if is_loopback(f["advertise"]["addr"])]
        if loop:
            out.append(("FAIL", "advertise", f"{who(facts, loop)} advertise loopback, but the "
                        f"job spans {len(hosts)} hosts: peers elsewhere cannot connect. Set "
                        f"PYDDP_SOCKET_IFNAME to the private network's interface there, or "
                        f"make MASTER_ADDR (torchrun --local-addr) the private address"))
        by_addr = {}
        for r, f in got:
            by_addr.setdefault(f["advertise"]["addr"], {})[r] = f["host_id"]
        for addr, rs in by_addr.items():
            if len(set(rs.values())) > 1 and not is_loopback(addr):
                out.append(("FAIL", "advertise", f"{who(facts, list(rs))} on different hosts "
                            f"all advertise {addr} (a container bridge?): set "
                            f"PYDDP_SOCKET_IFNAME to each node's private interface"))
    small = {r: f["settings"]["small_bytes"] for r, f in got}
    if len(set(small.values())) > 1:
        out.append(("FAIL", "settings", f"PYDDP_SMALL_BYTES differs between ranks "
                    f"({', '.join(f'rank {r}: {s}' for r, s in small.items())}); every "
                    f"collective would fail with CollectiveMismatchError. Set the same value "
                    f"everywhere"))
    return out


def merge(per_rank, facts, levels=("warn", "FAIL")):
    """One finding per distinct (level, check, text) over ranks, prefixed with the ranks
    that reported it. per_rank[r]: rank r's findings."""
    seen = {}
    for r, fs in enumerate(per_rank):
        for lv, check, text in fs:
            if lv in levels:
                seen.setdefault((lv, check, text), []).append(r)
    return [(lv, check, f"{who(facts, rs)}: {text}") for (lv, check, text), rs in seen.items()]


# ---- printing --------------------------------------------------------------------------

HEADER = f"  {'status':<6}  {'check':<12} finding"


INDENT = " " * 23                        # where a finding's text starts


def findings_block(findings):
    """The findings under a header (status, check, finding), one line each; a text of
    several lines (NCCL's list of paths tried) continues indented under its first."""
    return "\n".join([HEADER] + [f"  {lv:<6}  {check:<12} " + text.replace("\n", "\n" + INDENT)
                                  for lv, check, text in findings])


def verdict(findings):
    """(exit status, the closing line): 1 when some finding would stop a job."""
    fails = sum(1 for f in findings if f[0] == "FAIL")
    warns = sum(1 for f in findings if f[0] == "warn")
    w = f"{warns} warning{'s' if warns != 1 else ''} (would only slow a job)"
    if fails:
        return 1, (f"doctor: FAIL: {fails} problem{'s' if fails != 1 else ''} would stop a job "
                   f"(the FAIL lines say what to do); {w}")
    return 0, f"doctor: OK: nothing here would stop a job; {w}"
