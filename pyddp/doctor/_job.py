"""``python -m pyddp.doctor`` under torchrun (RANK and WORLD_SIZE set): every rank
gathers its node's facts, rank 0 prints one table with a row per rank (marking what
differs), the findings, an all_to_all that makes every pair's link (every rank reaches
every other's data port), and a short all_reduce between all ranks and over each kind
of link (shared memory, TCP); every rank exits with rank 0's verdict.

The facts travel through the job's store (keys under
``/pyddp/<run id>/<restart count>/doctor/``), not through the process group: a job
whose data ports are blocked still gets its table, and the failure of the group is one
more finding. Every wait has a deadline (--join-timeout); a rank that never reports is
named in the table.
"""
import json
import sys
import time
from datetime import timedelta
from types import SimpleNamespace

import numpy as np

from .. import _C, _env, _group, _objects, _rendezvous, _world, bench, collectives
from . import _checks as chk
from ._facts import gather, human_bytes

COMPARED = ("iface", "pyddp", "torch", "numpy", "python", "nccl")
COLUMNS = ("rank", "host", "address", "iface", "pyddp", "torch", "numpy", "python", "nccl",
           "/dev/shm", "single-copy")


def _td(s):
    return timedelta(seconds=s)


# ---- the table ------------------------------------------------------------------------

def table(facts):
    """One row per rank (facts[r], None for a rank that never reported); a value of a
    compared column that differs from most ranks' gets a '*'. Returns the lines."""
    got = [(r, f) for r, f in enumerate(facts) if f is not None]
    ref = {}
    for key in COMPARED:
        vals = chk.column([f for _, f in got], key)
        if len(set(vals)) > 1:
            ref[key] = chk.majority(vals)
    rows = [list(COLUMNS)]
    for r, f in enumerate(facts):
        if f is None:
            rows.append([str(r), "(no report)"] + [""] * (len(COLUMNS) - 2))
            continue
        vals = dict(zip(COMPARED, (chk.column([f], k)[0] for k in COMPARED)))
        for k in ref:
            if vals[k] != ref[k]:
                vals[k] += "*"
        c = f["cma"]
        one = "off" if not c["enabled"] else "allowed" if c["probe"] == "allowed" else "blocked"
        rows.append([str(r), f["host"], f["advertise"]["addr"] or "?", vals["iface"],
                     vals["pyddp"], vals["torch"], vals["numpy"], vals["python"], vals["nccl"],
                     human_bytes(f["shm_free"]), one])
    width = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, width)).rstrip() for row in rows]
    if ref:
        lines.append(f"(* differs from most ranks: {', '.join(ref)})")
    return lines


# ---- the all_reduce -------------------------------------------------------------------

class _Timed:
    """bench.time_rounds' case: an all_reduce of nbytes on group g, a no-op on ranks
    outside it (they still join time_rounds' world-wide maxima)."""

    def __init__(self, nbytes, g, member):
        self.x = bench.make_array(max(1, nbytes // 4), "float32") if member else None
        self.g = g

    def run(self, _backend):
        if self.x is not None:
            collectives.all_reduce(self.x, group=self.g)


def plan(matrix):
    """[(label, ranks, pairs)]: the whole world, then per kind of link one pair that
    uses it (rank 0 and its lowest peer of that kind where it has one). pairs: how many
    rank pairs of the world use that kind."""
    w = len(matrix)
    pairs = [(i, j) for i in range(w) for j in range(i + 1, w)]
    out = [("all", list(range(w)), len(pairs))]
    for kind in sorted({matrix[i][j] for i, j in pairs}):
        mine = [p for p in pairs if matrix[p[0]][p[1]] == kind]
        pick = next((p for p in mine if p[0] == 0), mine[0])
        out.append((kind, list(pick), len(mine)))
    return out


def measure(args, rank, world):
    """Check one all_reduce against arithmetic, then time 8 bytes and args.bytes over
    each group of plan(). Collective: every rank calls it. Returns (rows, error) where
    rows are (label, ranks, pairs, seconds for 8 B, seconds for args.bytes)."""
    pg = _group.default_pg()
    # Links are made on first use: one all_to_all makes every pair's (and so checks
    # that every rank reaches every other's data port) before the kinds are read.
    ones = np.full(world, rank, dtype=np.int64)
    got = np.empty(world, dtype=np.int64)
    collectives.all_to_all_single(got, ones)
    if list(got) != list(range(world)):
        return [], f"all_to_all gave {list(got)}, not {list(range(world))}"
    matrix = [None] * world
    _objects.all_gather_object(matrix, [pg.transport(r) for r in range(world)])
    x = np.array([rank + 1.0])
    collectives.all_reduce(x)
    if x[0] != world * (world + 1) / 2:
        return [], f"all_reduce gave {x[0]}, not {world * (world + 1) / 2}"
    groups = plan(matrix)
    handles = [None if len(ranks) == world else _group.new_group(ranks)
               for _, ranks, _ in groups]
    targs = SimpleNamespace(warmup_iters=2, rounds=3, round_ms=args.round_ms, max_iters=200)
    rows, done = [], {}
    for (label, ranks, pairs), g in zip(groups, handles):
        key = tuple(ranks)
        if key not in done:   # a pair that is the whole world is timed once
            done[key] = [bench.time_rounds(_Timed(n, g, rank in ranks), ["pyddp"],
                                           targs)["pyddp"] for n in (8, args.bytes)]
        rows.append((label, ranks, pairs, *done[key]))
    return rows, ""


def measure_lines(rows, nbytes):
    size = human_bytes(nbytes)
    head = (f"  {'link':<4}  {'ranks':<6} {'pairs':>5}  {'8 B latency':>11}  "
            f"{size + ' time':>10}  {size + ' busbw':>11}")
    lines = ["all_reduce float32 sum, time per call of the slowest rank (median of 3 rounds):",
             head]
    for label, ranks, pairs, t8, tb in rows:
        bus = nbytes / tb / 1e9 * bench.BUSBW_FACTOR["all_reduce"](len(ranks))
        lines.append(f"  {label:<4}  {chk.ranks_text(ranks):<6} {pairs:>5}  "
                     f"{t8 * 1e6:>8.1f} us  {tb * 1e3:>7.2f} ms  {bus:>6.2f} GB/s")
    return lines


def _group_run(args, store, rank, world):
    """init_process_group over the doctor's store, measure, destroy; '' or the error."""
    try:
        _world.init_process_group("cpu", store=store, rank=rank, world_size=world,
                                  timeout=_td(args.join_timeout))
        try:
            return measure(args, rank, world)
        finally:
            _world.destroy_process_group()
    except _C.DistError as e:
        return [], f"{type(e).__name__}: {e}"


# ---- the ranks' parts -----------------------------------------------------------------

def run(args):
    """The doctor under torchrun; returns the exit status (rank 0's verdict)."""
    try:
        rdzv = _env.resolve(None, -1, -1)
    except _C.DistValueError as e:
        print(f"pyddp doctor: {e}", file=sys.stderr)
        return 1
    rank, world = rdzv.rank, rdzv.world_size
    facts = gather(rdzv.master_addr, args.timeout)
    _group._State.rank = rank       # names this rank in _connect_store's progress lines
    try:
        store = _rendezvous.make_store(rdzv, args.join_timeout)
    except _C.DistError as e:
        f = chk.unreachable(rdzv.master_addr, rdzv.master_port, e, args.timeout)
        print(f"pyddp doctor: rank {rank} on {facts['host']} could not use the store at "
              f"{rdzv.master_addr}:{rdzv.master_port}\n{chk.findings_block([f])}",
              file=sys.stderr, flush=True)
        return 1
    finally:
        _group._State.rank = -1
    p = f"/pyddp/{rdzv.run_id}/{rdzv.restart_count}/doctor"
    try:
        store.set(f"{p}/facts/{rank}", json.dumps(facts))
        if rank == 0:
            return _lead(args, store, p, rdzv)
        return _follow(args, store, p, rank, world)
    except _C.DistError as e:
        print(f"pyddp doctor: rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1


def _collect(store, keys, timeout):
    """The values of keys (None for a key that did not appear within timeout)."""
    try:
        store.wait(keys, _td(timeout))
    except _C.DistStoreTimeoutError:
        pass
    return [json.loads(store.get(k)) if store.check([k]) else None for k in keys]


def _lead(args, store, p, rdzv):
    world = rdzv.world_size
    facts = _collect(store, [f"{p}/facts/{r}" for r in range(world)], args.join_timeout)
    got = [(r, f) for r, f in enumerate(facts) if f is not None]
    hosts = {f["host_id"] for _, f in got}
    names = ", ".join(dict.fromkeys(f["host"] for _, f in got))
    print(f"pyddp doctor: {world} rank{'s' if world > 1 else ''} on {len(hosts)} "
          f"host{'s' if len(hosts) != 1 else ''} ({names}), master {rdzv.master_addr}:"
          f"{rdzv.master_port}, backend {args.backend}")
    print("\n".join(table(facts)))
    findings = chk.world_findings(facts, args.backend)
    if args.etcd:                               # the job's store is an etcd cluster
        from ._etcd_check import findings as etcd_findings
        findings += etcd_findings(args.etcd, args.timeout)
    per_rank = [[] if f is None else chk.node_findings(
        f, args.backend, sum(1 for _, g in got if g["host_id"] == f["host_id"]),
        len(hosts) > 1, rdzv.master_addr) for f in facts]
    findings += chk.merge(per_rank, facts)
    missing = [r for r, f in enumerate(facts) if f is None]
    if missing:
        findings.append(("FAIL", "ranks", f"rank{'s' if len(missing) > 1 else ''} "
                         f"{chk.ranks_text(missing)} did not report within "
                         f"{args.join_timeout:.0f} s: it could not start or reach the store "
                         f"at {rdzv.master_addr}:{rdzv.master_port}; its own output says why "
                         f"(or run `python -m pyddp.doctor --master {rdzv.master_addr}:"
                         f"{rdzv.master_port}` alone on that node)"))
    print()
    print(chk.findings_block(findings), flush=True)
    store.set(f"{p}/plan", "skip" if missing else "measure")
    late = []
    if not missing:
        rows, err = _group_run(args, store, 0, world)
        results = [{"error": err}] + _collect(
            store, [f"{p}/result/{r}" for r in range(1, world)], args.join_timeout)
        if rows:
            print()
            print("\n".join(measure_lines(rows, args.bytes)))
        errs = {}
        for r, res in enumerate(results):
            e = "did not finish the all_reduce" if res is None else res["error"]
            if e:
                errs.setdefault(e, []).append(r)
        for e, rs in errs.items():
            late.append(("FAIL", "all_reduce", f"{chk.who(facts, rs)}: {e}. If the store "
                         f"works but connections between ranks fail, open the data ports "
                         f"between the nodes (or set PYDDP_PORT_RANGE and open that range)"))
        if late:
            print()
            print(chk.findings_block(late))
    code, line = chk.verdict(findings + late)
    print(line, flush=True)
    store.set(f"{p}/verdict", str(code))
    deadline = time.monotonic() + min(args.join_timeout, 10.0)
    while store.add(f"{p}/done", 0) < world - 1 and time.monotonic() < deadline:
        time.sleep(0.02)   # keep a store this rank hosts up until the others have read
    return code


def _follow(args, store, p, rank, world):
    # Rank 0 may wait a whole join timeout for the slowest rank's facts, then for every
    # result: wait for its plan and verdict longer than that.
    store.set_timeout(_td(2 * args.join_timeout + 10))
    if store.get(f"{p}/plan").decode() == "measure":
        _, err = _group_run(args, store, rank, world)
        store.set(f"{p}/result/{rank}", json.dumps({"error": err}))
    code = int(store.get(f"{p}/verdict"))
    store.add(f"{p}/done", 1)
    return code
