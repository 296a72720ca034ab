"""Elastic recovery time, side by side: torchrun restarting the workers, pyddp.elastic in
place with the job's store in node 0's torchrun agent (today's line), and in place with
the job's store in etcd; and init at 64 ranks over an EtcdStore against the agent-style
TCPStore.

    python benchmarks/elastic.py                         # all of it (about 9 min, 2 cores)
    python benchmarks/elastic.py --lines agent,etcd      # the in-place lines only
    python benchmarks/elastic.py --init-runs 0           # no init part
    python benchmarks/elastic.py --lines "" --init-runs 5   # the init part alone
    python benchmarks/elastic.py --json out.json         # also every figure as JSON
    python benchmarks/elastic.py --logs DIR              # and every node's output

**Recovery** (``--lines``, default ``restart,agent,etcd``; benchmarks/elastic_nodes.py
starts the nodes). Two "nodes" on loopback, each a stock torchrun agent
(``--nnodes=1:2 --nproc_per_node=2``) running benchmarks/elastic_worker.py (an MLP under
pyddp's DDP, a commit in place or a checkpoint on each node's disk every epoch); node 0
starts first and trains alone, then node 1 joins, so rank 0 starts on node 0. On the
etcd line three etcd members run on loopback; nodes 0 and 1 each own one (a killed node
takes its member along; it starts it again when it returns), the third stands for a
machine that trains nothing. Each change is timed from the moment it happens to rank
0's first step after it (rank 0 prints every step with its time):

1. (agent, etcd) a quiet window of ``--window`` s: the typical (median) and longest gap
   between two steps; on etcd then the etcd leader (member 2, made leader beforehand
   with etcd's MoveLeader) is killed and the next window measured the same way:
   training's pause, if any (the member starts again after);
2. node 1 killed mid-epoch (not rank 0's; on etcd its member a follower, or with
   ``--lost-member-leads`` the leader) -> first step at world 2; started again with
   the same line -> first step at world 4, and how long the survivors were held up (the
   longest gap between two of rank 0's steps meanwhile; the new processes' start-up,
   imports included, is in the return time);
3. one worker of node 0 killed: its agent starts the node's workers again (crash ->
   the first step after it; -> first step at world 4 again);
4. node 1's torchrun sent SIGTERM, a spot VM's notice (-> first step at world 2; steps
   done again after it), its etcd member left running;
5. (agent, etcd) node 1 started again (world 4, not timed), then rank 0's node, node 0,
   killed. On the agent line node 0 is the endpoint's, whose agent holds the job's
   store: **the job ends there**; measured is the time until node 1 prints StoreLost
   and until its torchrun exits. On etcd, with node 0's member the leader (the worst
   case: rank 0's node and etcd's leader at once): -> first step at world 2 (rank 0 is
   then on node 1), and node 0 back with its line (and member) -> first step at world 4.

Restart runs with c10d, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (the only way it can grow
back, see docs/elastic.md) and --max-restarts=6; in place with docs/elastic.md's lines
(``--rdzv-backend=pyddp --max-restarts=100``, the endpoint ``127.0.0.1:PORT`` or
``etcd://M0,M1,M2``).

**Init** (``--init-runs``, default 3; 0 skips it): ``--init-ranks`` (64) processes
forked from one that imported pyddp (benchmarks/scale.py's pyddp ranks), each
connecting its store before the clock starts and then calling
``pyddp.init_process_group("cpu", store=..., rank=, world_size=)``: a TCPStore client
of a pyddp server this script hosts (as the agent's store), or an EtcdStore of a fresh
3-member cluster on loopback (a namespace of the run's own). Runs alternate between the
two; medians with the range. ``--init-with-connect`` times the env:// way instead, each
rank's store connection included.

The load average is printed with every part; on a 2-core machine the figures scatter
from run to run.
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from elastic_nodes import LINES, START_S, Nodes, etcd_cluster  # noqa: E402


def _load():
    return os.getloadavg()[0]


def _gaps(before, window):
    """(median gap, longest gap, the step that ended the longest) of the steps [before] +
    window ((time, world, global step) each); None for each without two steps."""
    steps = [before] + list(window)
    if len(steps) < 2:
        return None, None, None
    gaps = [b[0] - a[0] for a, b in zip(steps, steps[1:])]
    i = max(range(len(gaps)), key=gaps.__getitem__)
    return statistics.median(gaps), gaps[i], steps[i + 1]


def _undisturbed(before, window, world):
    """Every step of the window at this world and numbered one after the last: no
    change, nothing rolled back."""
    gs = [before[2]] + [s[2] for s in window]
    return all(s[1] == world for s in window) and all(b == a + 1 for a, b in zip(gs, gs[1:]))


def _windows(nodes, args, out):
    """Step 1: a quiet window, and on etcd a window from the leader's loss."""
    time.sleep(args.warm)
    before = nodes.drain()
    win = nodes.window(args.window)
    out["quiet_median_gap_s"], out["quiet_longest_gap_s"], end = _gaps(before, win)
    out["quiet_longest_at_commit"] = end[2] % args.steps_per_epoch == 0
    out["quiet_undisturbed"] = _undisturbed(before, win, 4)
    if nodes.etcd is None:
        return
    etcd, lead = nodes.etcd, 2
    etcd.move_leader(lead)
    time.sleep(args.warm)
    before = nodes.drain()
    t = time.time()
    nodes.mark(f"kill etcd leader m{lead}")
    etcd.kill(lead)
    win = nodes.window(args.window)
    out["leader_median_gap_s"], out["leader_longest_gap_s"], end = _gaps(before, win)
    out["leader_longest_at_s"] = end[0] - t
    out["leader_longest_at_commit"] = end[2] % args.steps_per_epoch == 0
    out["leader_undisturbed"] = _undisturbed(before, win, 4)
    etcd.start(lead)
    etcd.wait_ready(60)


def _loss_and_return(nodes, node, args, out, key, leads):
    """Kill node (with its member on etcd, which leads if `leads`, else member 2 does)
    -> world 2; start it again -> world 4."""
    if nodes.etcd is not None:
        nodes.etcd.move_leader(node if leads else 2)
        out[f"{key}_member_led"] = leads
    time.sleep(args.warm)
    nodes.drain()
    out[f"{key}_rank0_before"] = nodes.rank0
    t = time.time()
    nodes.kill(node)
    out[f"{key}_loss_s"] = nodes.first_step(2, START_S, t)[0] - t
    time.sleep(args.warm)
    nodes.drain()
    t = time.time()
    nodes.start(node)
    t_big, gap, _ = nodes.first_step(4, START_S, t)
    out[f"{key}_return_s"], out[f"{key}_held_s"] = t_big - t, gap


def _store_node_lost(nodes, args, out):
    """Agent line: node 0 (the endpoint's, rank 0's) killed; the job ends. How long until
    node 1 says StoreLost, and until its torchrun exits (and with what status)."""
    time.sleep(args.warm)
    nodes.drain()
    out["rank0_rank0_before"] = nodes.rank0
    t = time.time()
    nodes.kill(0)
    seen = nodes.wait_line(1, "StoreLost", START_S, t)
    out["rank0_error_s"] = None if seen is None else seen - t
    t_exit, rc = nodes.wait_exit(1, START_S)
    out["rank0_exit_s"] = None if t_exit is None else t_exit - t
    out["rank0_exit_status"] = rc
    if seen is None or t_exit is None:
        out["rank0_tail"] = nodes.tail(30)


def recover(line, args):
    """Every change of the module's docstring on one line: {figure: value}."""
    tmp = tempfile.mkdtemp(prefix=f"pyddp-elastic-{line}-")
    out = {"load_start": _load()}
    nodes = None
    try:
        nodes = Nodes(line, args, tmp)
        nodes.start(0)                      # alone first, so that rank 0 is on node 0
        nodes.first_step(2, START_S)
        nodes.start(1)
        nodes.first_step(4, START_S)
        if line != "restart":
            _windows(nodes, args, out)
        _loss_and_return(nodes, 1, args, out, "node1", args.lost_member_leads)
        time.sleep(args.warm)
        nodes.drain()
        t = time.time()
        nodes.mark("kill a worker of node 0")
        os.kill(nodes.worker_of(0), signal.SIGKILL)
        out["crash_to_step_s"] = nodes.first_step(None, START_S, t)[0] - t
        out["crash_to_full_s"] = nodes.first_step(4, START_S, t)[0] - t
        time.sleep(args.warm)
        before = nodes.drain()[2]
        t = time.time()
        nodes.mark("SIGTERM to node 1's torchrun")
        nodes.node_proc[1].send_signal(signal.SIGTERM)
        t_small, _, g = nodes.first_step(2, START_S, t)
        out["leave_to_step_s"], out["leave_steps_lost"] = t_small - t, max(0, before - g + 1)
        if line != "restart":
            nodes.wait_exit(1, 60)
            nodes.start(1)
            nodes.first_step(4, START_S, time.time())
            if line == "agent":
                _store_node_lost(nodes, args, out)
            else:
                _loss_and_return(nodes, 0, args, out, "rank0", True)
        nodes.stop()
        out["load_end"] = _load()
        return out
    finally:
        if nodes is not None:
            nodes.close()
        shutil.rmtree(tmp, ignore_errors=True)


def init_compare(args):
    """The init part: {"tcp": [result...], "etcd": [result...], "load_start", "load_end"}
    (benchmarks/scale.py's run_ranks results, alternated run by run)."""
    import scale
    tmp = tempfile.mkdtemp(prefix="pyddp-elastic-init-")
    sargs = SimpleNamespace(timeout=args.init_timeout, iters=5, shm=False,
                            store_first=not args.init_with_connect)
    out = {"tcp": [], "etcd": [], "load_start": _load()}
    etcd = etcd_cluster(tmp)
    try:
        for i in range(args.init_runs):
            for kind in (("tcp", "etcd") if i % 2 == 0 else ("etcd", "tcp")):
                r = scale.run_ranks(sargs, "pyddp", args.init_ranks,
                                    etcd=etcd.endpoint() if kind == "etcd" else None)
                out[kind].append(r)
                print(f"  init {kind} run {i + 1}: "
                      f"{r['init_s']:.3f} s" if r.get("ok") else
                      f"  init {kind} run {i + 1}: FAILED {r.get('error')}", flush=True)
    finally:
        etcd.close()
        shutil.rmtree(tmp, ignore_errors=True)
    out["load_end"] = _load()
    return out


# -- the tables ---------------------------------------------------------------------------

def _cell(v, unit=" s", width=12):
    if v is None:
        return f"{'-':>{width}}"
    if isinstance(v, str):
        return f"{v:>{width}}"
    return f"{v:>{width - len(unit)}.2f}{unit}"


RECOVERY_ROWS = (
    ("node1_loss_s", "node 1 killed -> first step at world 2", " s"),
    ("node1_return_s", "node 1 back, same line -> world 4", " s"),
    ("node1_held_s", "  survivors held up by that return", " s"),
    ("crash_to_step_s", "a worker of node 0 killed -> next step", " s"),
    ("crash_to_full_s", "  ... -> world 4 again", " s"),
    ("leave_to_step_s", "SIGTERM to node 1 -> first step at world 2", " s"),
    ("leave_steps_lost", "  steps done again (rolled back)", ""),
    ("rank0_loss_s", "rank 0's node 0 killed -> step at world 2", " s"),
    ("rank0_error_s", "  agent: the job ends; StoreLost after", " s"),
    ("rank0_exit_s", "  agent: node 1's torchrun exited after", " s"),
    ("rank0_return_s", "node 0 back, same line -> world 4", " s"),
    ("rank0_held_s", "  survivors held up by that return", " s"),
)
NAMES = {"restart": "restart", "agent": "agent store", "etcd": "etcd"}


def print_recovery(rows, args):
    lines = list(rows)
    print(f"\nRecovery: 2 nodes x 2 ranks on loopback, MLP hidden={args.hidden}, "
          f"{args.steps_per_epoch} steps/epoch, PYDDP_ELASTIC_SETTLE_S={args.settle:g}")
    print(f"{'':46}" + "".join(f"{NAMES[ln]:>14}" for ln in lines))
    for key, name, unit in RECOVERY_ROWS:
        if not any(key in rows[ln] for ln in lines):
            continue
        cells = []
        for ln in lines:
            v = rows[ln].get(key)
            if key == "rank0_loss_s" and ln == "agent":
                v = "job ends"
            elif v is None and key in rows[ln]:
                v = "never"
            cells.append(_cell(v, unit, 14))
        print(f"{name:46}" + "".join(cells))
    for ln in lines:
        r = rows[ln]
        extra = ""
        if "rank0_exit_status" in r:
            extra = f"; node 1's torchrun exit status {r['rank0_exit_status']}"
        if "node1_member_led" in r:
            role = "the leader" if r["node1_member_led"] else "a follower"
            extra = (f"; node 1's etcd member {role} when node 1 was killed, node 0's the "
                     f"leader when node 0 was")
        print(f"  {NAMES[ln]}: rank 0 was on node {r.get('node1_rank0_before')} when node 1 "
              f"was killed, on node {r.get('rank0_rank0_before', '-')} when node 0 was"
              f"{extra}; load average {r['load_start']:.1f} -> {r.get('load_end', 0):.1f}")
        if "rank0_tail" in r:
            print("  " + r["rank0_tail"].replace("\n", "\n  "))


def print_windows(rows, args):
    cols = [(f"{NAMES[ln]}, quiet", rows[ln], "quiet") for ln in ("agent", "etcd")
            if ln in rows] + [("etcd, leader lost", rows["etcd"], "leader")
                              for _ in [0] if "etcd" in rows]
    print(f"\nThe etcd leader killed while training at world 4 ({args.window:g} s windows of "
          f"rank 0's steps; quiet: nothing happens)")
    print(f"{'':40}" + "".join(f"{c[0]:>20}" for c in cols))
    print(f"{'typical gap between steps (median)':40}"
          + "".join(_cell(r[f'{k}_median_gap_s'], ' s', 20) for _, r, k in cols))
    print(f"{'longest gap':40}"
          + "".join(_cell(r[f'{k}_longest_gap_s'], ' s', 20) for _, r, k in cols))
    print(f"{'no change, nothing rolled back':40}"
          + "".join(f"{str(r[f'{k}_undisturbed']):>20}" for _, r, k in cols))
    if "etcd" in rows:
        r = rows["etcd"]
        print(f"  the leader was member 2 (no node's); the longest gap ended "
              f"{r['leader_longest_at_s']:.2f} s after it was killed, "
              f"{'at' if r['leader_longest_at_commit'] else 'not at'} a commit (the first "
              f"step of an epoch)")


def _med(rs, key, scale=1.0):
    vals = [r[key] * scale for r in rs if r.get("ok")]
    if not vals:
        return "failed"
    return f"{statistics.median(vals):.3f} ({min(vals):.3f}-{max(vals):.3f})"


def print_init(res, args):
    how = ("env:// (each rank's store connection timed)" if args.init_with_connect else
           "init_process_group(store=...), each store connected before the clock")
    print(f"\nInit at {args.init_ranks} ranks: forked processes, {how}, {args.init_runs} "
          f"run(s) each, median (range); load average {res['load_start']:.1f} -> "
          f"{res['load_end']:.1f}")
    cols = (("pyddp TCPStore (agent)", res["tcp"]), ("EtcdStore (3 members)", res["etcd"]))
    print(f"{'':28}" + "".join(f"{c[0]:>28}" for c in cols))
    print(f"{'init s':28}" + "".join(f"{_med(rs, 'init_s'):>28}" for _, rs in cols))
    print(f"{'first 8-byte all-reduce ms':28}"
          + "".join(f"{_med(rs, 'first_us', 1e-3):>28}" for _, rs in cols))
    print(f"{'sockets per rank':28}"
          + "".join(f"{_med(rs, 'sockets_per_rank'):>28}" for _, rs in cols))
    for name, rs in cols:
        for r in rs:
            if not r.get("ok"):
                print(f"  {name}: FAILED {r.get('error')}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lines", default="restart,agent,etcd",
                    help="the launch lines to measure recovery on (comma-separated, of "
                         f"{','.join(LINES)}; empty: none)")
    ap.add_argument("--steps-per-epoch", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--settle", type=float, default=1.0, help="PYDDP_ELASTIC_SETTLE_S")
    ap.add_argument("--warm", type=float, default=3.0, help="seconds of steps before a change")
    ap.add_argument("--window", type=float, default=8.0,
                    help="seconds of steps in the quiet and the leader-lost windows")
    ap.add_argument("--lost-member-leads", action="store_true",
                    help="etcd: node 1's member is the leader when node 1 is killed (by "
                         "default a follower; rank 0's node's member always leads)")
    ap.add_argument("--init-ranks", type=int, default=64)
    ap.add_argument("--init-runs", type=int, default=3, help="runs of each store; 0: none")
    ap.add_argument("--init-timeout", type=float, default=120.0)
    ap.add_argument("--init-with-connect", action="store_true",
                    help="time init the env:// way, each rank's store connection included")
    ap.add_argument("--json", help="also write every figure to this file")
    ap.add_argument("--logs", help="write every node's output (and the recovery times' "
                                   "moments) under this folder")
    a = ap.parse_args()
    lines = [ln for ln in a.lines.split(",") if ln]
    bad = [ln for ln in lines if ln not in LINES]
    if bad:
        ap.error(f"--lines: unknown {bad}; choose from {','.join(LINES)}")
    if a.init_ranks < 2 or a.init_runs < 0:
        ap.error("--init-ranks must be at least 2 and --init-runs at least 0")
    print(f"load average (1 min) at the start: {_load():.1f}; {os.cpu_count()} CPUs",
          flush=True)
    rows = {}
    for ln in lines:
        rows[ln] = recover(ln, a)
        print(f"  {ln}: {json.dumps(rows[ln])[:400]}", flush=True)
    init = init_compare(a) if a.init_runs else None
    if rows:
        print_recovery(rows, a)
    if "agent" in rows or "etcd" in rows:
        print_windows(rows, a)
    if init:
        print_init(init, a)
    print(f"\nload average (1 min) at the end: {_load():.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"recovery": rows, "init": init}, f, indent=1)


if __name__ == "__main__":
    main()
