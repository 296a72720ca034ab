"""Scale: how init time, sockets per rank and store load grow with the number of ranks,
measured on one machine that cannot run the real world.

    python benchmarks/scale.py                       # C 8..1024, Python 8,64,256
    python benchmarks/scale.py --quick               # C 8,64; Python 8,32
    python benchmarks/scale.py --sizes 8,64 --py-sizes 8 --hosts-of 8 --json out.json
    python benchmarks/scale.py --no-c --py-sizes 256 --store-first --repeat 5   # the goal

Three parts, each printing one row per world size N (and per run with --repeat R: the
Python parts then run R times, pyddp and gloo alternated size by size, and the goal
against gloo compares the medians of their init times):

* C thread-ranks: benchmarks/scale_ranks.c, compiled here with cc against the core
  (csrc/core, no Python), runs N ranks as threads of one process over loopback with an
  in-process store server. --hosts-of G gives every G consecutive ranks one host id.
* pyddp Python ranks: N processes forked from one that imported pyddp (import time is
  not measured, and the forks share its pages, so hundreds fit), each calling
  pyddp.init_process_group() the env:// way (RANK, WORLD_SIZE, MASTER_ADDR/PORT on
  loopback, TORCHELASTIC_USE_AGENT_STORE=True) against a pyddp store this script hosts.
* torch gloo, like for like with the pyddp part: N processes forked from one that
  imported torch and torch.distributed (and ran no thread when it forked; the forks share
  its pages copy-on-write, so hundreds fit), each calling
  torch.distributed.init_process_group("gloo", init_method="env://", timeout=...) with
  RANK, WORLD_SIZE, MASTER_ADDR/PORT on loopback and TORCHELASTIC_USE_AGENT_STORE=True
  (every rank a client, as pyddp's) against a torch TCPStore this script hosts, with
  TORCH_GLOO_LAZY_INIT=1 (pairs connect on first use, as pyddp's links do), then
  torch.distributed.all_reduce. Its init includes the store connection and torch's
  Python-level init, as pyddp's does, and with it the reverse DNS lookup torch's store
  client makes of its own socket's address on connecting (getnameinfo of
  ::ffff:127.0.0.1, which /etc/hosts does not answer): where the DNS server drops
  queries that arrive together, each dropped one costs a resolver timeout (glibc's
  5 s, or RES_OPTIONS="timeout:T attempts:1", which passes through to the ranks).
  torch's store counts no requests: its "store req" is "-". --store-first times both
  libraries' forked ranks without their store connection (and so without that lookup):
  each connects its client before the clock starts and passes it to
  init_process_group(store=, rank=, world_size=). --gloo-threads-mode runs
  the older variant instead, not like for like: ranks as threads, at most
  --gloo-threads per process, each with its own torch TCPStore client to a pyddp store
  (connected before the start gate, so not timed, and counted in store req) and
  torch.distributed.ProcessGroupGloo(store, rank, N, timeout) alone; the goal against
  gloo is then SKIP.

Columns: init (s): from the moment every rank is released at once (all ranks ready, one
gate opened) to the last rank's init returning (store connection included); init CPU
(ms): the CPU time init took in a rank's process (all its threads), median over ranks
(forked ranks only: on 2 cores hundreds of ranks' init is this per-rank cost, which a
busy machine disturbs far less than the wall clock); sockets/rank:
socket descriptors the ranks hold after the all-reduces (store client, listener, links)
divided by N, the store server's own not counted; store req: requests the store served
from the start to the end of the all-reduces (VALIDATE and PING of each connection
included; "-" for torch's store, which has no such counter); first / steady (ms): the
first 8-byte all-reduce (float64 x1, SUM), started by every rank at once after all have
initialised, slowest rank; and the median of the next --iters, median over ranks.
Results are checked against the sum of the ranks.

Every run uses PYDDP_SHM_DISABLE=1 (every pair on TCP, as ranks on separate hosts)
unless --shm; other PYDDP_* variables pass through. A size that fails (a rank's error,
running out of descriptors, a deadline) is a row saying why, not a crash. Every process
started is killed by pid at the end and on timeout. Goal checks follow the tables as
PASS/FAIL lines.
"""
import argparse
import glob
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "scale_worker.py")
BIN = os.path.join(ROOT, "build", "scale", "scale_ranks")
CFLAGS = ["-std=c11", "-D_GNU_SOURCE", "-O2", "-Wall", "-Wextra", "-Werror",
          "-Wno-format-truncation"]
LIBS = ["-lpthread", "-lm", "-lrt", "-ldl"]     # as tests/c/Makefile links the core


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--sizes", type=ints, default=[8, 16, 64, 256, 1024],
                   help="C thread-rank world sizes (comma-separated)")
    p.add_argument("--py-sizes", type=ints, default=[8, 64, 256],
                   help="pyddp Python-rank world sizes")
    p.add_argument("--gloo-sizes", type=ints, default=None,
                   help="gloo world sizes (default: --py-sizes)")
    p.add_argument("--hosts-of", type=int, default=1,
                   help="C part: ranks per host id (default 1: every rank its own host)")
    p.add_argument("--iters", type=int, default=20, help="steady all-reduces after the first")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds: every wait of a run (a size past it fails)")
    p.add_argument("--gloo-threads-mode", action="store_true",
                   help="gloo ranks as threads calling ProcessGroupGloo directly (not "
                        "like-for-like; the default is one forked process per rank)")
    p.add_argument("--gloo-threads", type=int, default=32,
                   help="--gloo-threads-mode: gloo ranks per process")
    p.add_argument("--shm", action="store_true", help="leave PYDDP_SHM_DISABLE unset")
    p.add_argument("--store-first", action="store_true",
                   help="forked ranks (pyddp and gloo alike) connect their store client "
                        "before the clock starts and pass it to init_process_group(store=)")
    p.add_argument("--no-c", action="store_true")
    p.add_argument("--no-py", action="store_true")
    p.add_argument("--no-gloo", action="store_true")
    p.add_argument("--quick", action="store_true", help="C 8,64; Python and gloo 8,32")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the Python parts this many times, pyddp and gloo alternated "
                        "size by size; the goal against gloo compares the medians")
    p.add_argument("--json", help="also write every result to this file")
    a = p.parse_args(argv)
    if a.repeat < 1:
        p.error("--repeat must be at least 1")
    if a.quick:
        a.sizes, a.py_sizes, a.gloo_sizes = [8, 64], [8, 32], [8, 32]
    if a.gloo_sizes is None:
        a.gloo_sizes = a.py_sizes
    return a


def base_env(args):
    env = dict(os.environ)
    if not args.shm:
        env["PYDDP_SHM_DISABLE"] = "1"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = "1"
    return env


def kill_pids(pids):
    """SIGKILL each pid still there (children this script started, by pid)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# ---- C thread-ranks --------------------------------------------------------------

def build_c():
    """Compile scale_ranks.c against csrc/core/*.c (-O2, no sanitizers) into build/scale
    unless the binary is newer than every source. Returns the binary's path."""
    srcs = [os.path.join(HERE, "scale_ranks.c")] + sorted(
        glob.glob(os.path.join(ROOT, "csrc", "core", "*.c")))
    deps = srcs + glob.glob(os.path.join(ROOT, "csrc", "core", "*.h"))
    if os.path.exists(BIN) and os.path.getmtime(BIN) > max(map(os.path.getmtime, deps)):
        return BIN
    os.makedirs(os.path.dirname(BIN), exist_ok=True)
    cc = os.environ.get("CC", "cc")
    cmd = [cc, *CFLAGS, "-I" + os.path.join(ROOT, "csrc", "core"), "-o", BIN, *srcs, *LIBS]
    print(f"compiling {os.path.relpath(BIN, ROOT)} ...", flush=True)
    subprocess.run(cmd, check=True, timeout=600)
    return BIN


def run_c(args, n):
    """One C run of n thread-ranks: its JSON result, or {"n", "ok": False, "error"}."""
    cmd = [BIN, str(n), "--hosts-of", str(args.hosts_of), "--iters", str(args.iters),
           "--timeout-ms", str(int(args.timeout * 1000))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=base_env(args), text=True)
    try:
        out, err = proc.communicate(timeout=args.timeout * 2 + 30)
    except subprocess.TimeoutExpired:
        kill_pids([proc.pid])
        proc.communicate()
        return {"n": n, "ok": False,
                "error": f"no result within {args.timeout * 2 + 30:.0f} s"}
    finally:
        if proc.poll() is None:   # interrupted: leave nothing behind
            kill_pids([proc.pid])
            proc.wait()
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"n": n, "ok": False,
            "error": f"exit status {proc.returncode}: {(err or out).strip()[-400:]}"}


# ---- Python ranks (pyddp processes, gloo processes or threads) -------------------

class Lines:
    """Lines from the report pipe, read with deadlines."""

    def __init__(self, fd):
        self.fd, self.buf = fd, b""

    def until(self, pred, deadline, alive):
        """Read lines, passing each to pred, until pred returns True (then True), the
        deadline passes or alive() is False with nothing more to read (then False)."""
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                if pred(line.decode(errors="replace")):
                    return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            r, _, _ = select.select([self.fd], [], [], min(left, 0.5))
            if r:
                chunk = os.read(self.fd, 65536)
                if chunk:
                    self.buf += chunk
                    continue
            if not alive():
                return False


def run_ranks(args, kind, n, etcd=None):
    """One world of n ranks of kind "pyddp", "gloo" (processes) or "gloo-threads" (see
    the module docstring) against a store server hosted here (pyddp's; torch's TCPStore
    for "gloo"); the result dict (ok False with the reason). etcd ("etcd://M1,M2,..."),
    for "pyddp" only: the ranks' store is that etcd cluster instead, as for a worker of
    ``--rdzv-backend=pyddp --rdzv-endpoint=etcd://...`` (PYDDP_RDZV_STORE, and a run id
    of this run's own: keys in a namespace nobody else uses; no request count)."""
    host = "127.0.0.1"
    if kind == "gloo":
        import torch.distributed as tdist
        from datetime import timedelta
        tstore = tdist.TCPStore("127.0.0.1", 0, None, True,
                                timeout=timedelta(seconds=args.timeout),
                                wait_for_workers=False)
        srv, port = None, tstore.port
    elif etcd is not None:
        tstore, srv = None, None      # MASTER_ADDR/PORT: the first member, as torchrun's
        host, port = etcd[len("etcd://"):].split(",")[0].rsplit(":", 1)
    else:
        from pyddp import _C
        tstore, srv = None, _C.StoreServer()
        port = srv.start("127.0.0.1", 0)
    requests = lambda: srv.requests if srv is not None else None  # noqa: E731
    env = base_env(args)
    env.update(MASTER_ADDR=host, MASTER_PORT=str(port),
               TORCHELASTIC_USE_AGENT_STORE="True", TORCH_GLOO_LAZY_INIT="1",
               TORCH_CPP_LOG_LEVEL="ERROR", SCALE_STORE_FIRST="1" if args.store_first else "0")
    if etcd is not None:
        env.update(PYDDP_RDZV_STORE=etcd, TORCHELASTIC_RUN_ID=f"scale-{time.time_ns()}")
    gates = [os.pipe() for _ in range(3)]
    rep_r, rep_w = os.pipe()
    child_fds = [g[0] for g in gates] + [rep_w]
    fdargs = [str(fd) for fd in child_fds]
    procs, rank_pids, log = [], {}, tempfile.TemporaryFile()
    res = {"n": n, "ok": False, "kind": kind}
    try:
        common = [str(args.iters), str(args.timeout)] + fdargs
        if kind in ("pyddp", "gloo"):
            cmds = [[sys.executable, WORKER, kind + "-fork", str(n)] + common]
            res["how"] = "1 process per rank (forked)"
        else:
            t = max(1, args.gloo_threads)
            cmds = [[sys.executable, WORKER, "gloo", str(f), str(min(t, n - f)), str(n)]
                    + common for f in range(0, n, t)]
            res["how"] = f"threads, {len(cmds)} process(es)"
        for cmd in cmds:
            procs.append(subprocess.Popen(cmd, env=env, pass_fds=child_fds, stdout=log,
                                          stderr=subprocess.STDOUT, cwd=ROOT))
        for fd in child_fds:
            os.close(fd)
        child_fds = []
        lines, seen = Lines(rep_r), {"ready": {}, "init": {}, "done": {}}
        alive = lambda: any(p.poll() is None for p in procs)  # noqa: E731

        def phase(what, budget):
            def pred(line):
                word, _, rest = line.partition(" ")
                if word == "fail":
                    raise RuntimeError(f"rank {rest}")
                r, _, val = rest.partition(" ")
                seen.setdefault(word, {})[int(r)] = val
                return len(seen[what]) >= n
            if not lines.until(pred, time.monotonic() + budget, alive):
                raise RuntimeError(f"{len(seen[what])} of {n} ranks reached '{what}' within "
                                   f"{budget:.0f} s" + ("" if alive() else
                                                        " (the rank processes exited)"))

        phase("ready", args.timeout + 120)    # imports (torch's are slow) and forks
        rank_pids = {int(v) for v in seen["ready"].values()}
        t_go = time.monotonic()
        os.write(gates[0][1], b"x")
        phase("init", args.timeout)
        res["init_s"] = max(float(v.split()[0]) for v in seen["init"].values()) - t_go
        cpus = sorted(float(v.split()[1]) for v in seen["init"].values() if " " in v)
        res["init_cpu_ms"] = cpus[len(cpus) // 2] * 1e3 if cpus else None
        res["store_requests_init"] = requests()
        os.write(gates[1][1], b"x")
        phase("done", args.timeout)
        res["store_requests"] = requests()
        res["sockets_per_rank"] = sum(count_sockets(pid) for pid in rank_pids) / n
        firsts = [float(v.split()[0]) for v in seen["done"].values()]
        steadies = sorted(float(v.split()[1]) for v in seen["done"].values())
        res["first_us"] = max(firsts) * 1e6
        res["steady_us"] = steadies[len(steadies) // 2] * 1e6
        os.write(gates[2][1], b"x")
        res["ok"] = True
        deadline = time.monotonic() + 30
        while alive() and time.monotonic() < deadline:
            time.sleep(0.05)
    except RuntimeError as e:
        res["error"] = str(e)
        log.seek(0)
        tail = log.read()[-600:].decode(errors="replace").strip()
        if tail:
            res["error"] += f" | output: {tail}"
    finally:
        kill_pids(rank_pids)
        kill_pids([p.pid for p in procs])
        for p in procs:
            p.wait(timeout=30)
        for fd in child_fds + [rep_r] + [g[1] for g in gates]:
            os.close(fd)
        if srv is not None:
            srv.stop()
        del tstore   # torch's server stops with its last reference
        log.close()
    return res


def count_sockets(pid):
    """Socket descriptors open in process pid (0 if it is gone)."""
    d, k = f"/proc/{pid}/fd", 0
    try:
        names = os.listdir(d)
    except OSError:
        return 0
    for name in names:
        try:
            k += os.readlink(os.path.join(d, name)).startswith("socket:")
        except OSError:
            pass
    return k


# ---- output ----------------------------------------------------------------------

def table(title, rows):
    print(f"\n{title}")
    print(f"{'N':>6} {'init s':>9} {'init CPU ms':>12} {'sock/rank':>10} {'store req':>10} "
          f"{'first ms':>10} {'steady ms':>10}")
    for r in rows:
        if not r.get("ok"):
            print(f"{r['n']:>6}   FAILED: {r.get('error', '?')}")
            continue
        req = "-" if r["store_requests"] is None else r["store_requests"]
        cpu = "-" if r.get("init_cpu_ms") is None else f"{r['init_cpu_ms']:.2f}"
        print(f"{r['n']:>6} {r['init_s']:>9.3f} {cpu:>12} {r['sockets_per_rank']:>10.1f} "
              f"{req:>10} {r['first_us'] / 1e3:>10.2f} "
              f"{r['steady_us'] / 1e3:>10.2f}")


def goals(c_rows, py_rows, gloo_rows, gloo_threads=False):
    """The PASS/FAIL lines of the goals (SKIP where a size was not run, and for the goal
    against gloo where gloo ran as threads: that goal is against gloo's processes)."""
    out = []
    c1024 = next((r for r in c_rows if r["n"] == 1024), None)
    if c1024 is None:
        out.append("SKIP  1,024 thread-ranks initialised in <= 10 s: N=1024 not run")
    elif not c1024.get("ok"):
        out.append(f"FAIL  1,024 thread-ranks initialised in <= 10 s: the run failed "
                   f"({c1024.get('error', '?')[:200]})")
    else:
        t = c1024["init_s"]
        out.append(f"{'PASS' if t <= 10 else 'FAIL'}  1,024 thread-ranks initialised in "
                   f"<= 10 s: {t:.2f} s")
        first = c1024["first_us"] / 1e6
        out.append(f"{'PASS' if first < 1 else 'FAIL'}  1,024 thread-ranks' first all-reduce "
                   f"under 1 s: {first:.2f} s")
    ran = [(r["sockets_per_rank"], part, r["n"]) for part, rows in
           (("C", c_rows), ("Python", py_rows)) for r in rows if r.get("ok")]
    if not ran:
        out.append("SKIP  at most 16 sockets per rank: no pyddp run succeeded")
    else:
        worst = max(ran)
        out.append(f"{'PASS' if worst[0] <= 16 else 'FAIL'}  at most 16 sockets per rank: "
                   f"worst {worst[0]:.1f} ({worst[1]} N={worst[2]})")
    p = [r for r in py_rows if r["n"] == 256]
    g = [r for r in gloo_rows if r["n"] == 256]
    goal = "256 Python ranks init at least as fast as gloo's lazy init"
    if gloo_threads:
        out.append(f"SKIP  {goal}: gloo ran as threads (--gloo-threads-mode); the goal is "
                   "against gloo's processes")
    elif not p or not g:
        out.append(f"SKIP  {goal}: N=256 not run for both")
    elif not all(r.get("ok") for r in p + g):
        who = "pyddp" if not all(r.get("ok") for r in p) else "gloo"
        out.append(f"FAIL  {goal}: {who} failed at N=256")
    else:
        pt, gt = ([r["init_s"] for r in rows] for rows in (p, g))
        pm, gm = statistics.median(pt), statistics.median(gt)
        ratio = gm / pm if pm > 0 else float("inf")
        runs = (f" (medians of {len(pt)} alternated runs: pyddp "
                f"{', '.join(f'{t:.3f}' for t in pt)}; gloo "
                f"{', '.join(f'{t:.3f}' for t in gt)})" if len(pt) > 1 else "")
        out.append(f"{'PASS' if ratio >= 1 else 'FAIL'}  {goal}: pyddp {pm:.3f} s, "
                   f"gloo {gm:.3f} s ({ratio:.2f}x){runs}")
    return out


def main(argv=None):
    args = parse(argv)
    sys.path.insert(0, ROOT)
    shm = "on (same-host pairs may use shared memory)" if args.shm else \
        "off (PYDDP_SHM_DISABLE=1: every pair on TCP)"
    print(f"scale: shared memory {shm}; {args.iters} steady all-reduces; "
          f"timeout {args.timeout:.0f} s; {os.cpu_count()} CPUs", flush=True)
    c_rows, py_rows, gloo_rows = [], [], []
    if not args.no_c:
        build_c()
        for n in args.sizes:
            c_rows.append(run_c(args, n))
            print(f"  C N={n}: {json.dumps(c_rows[-1])[:300]}", flush=True)
        table(f"C thread-ranks (one process, {args.hosts_of} rank(s) per host id)", c_rows)
    # The Python parts, alternated size by size and --repeat times, so that pyddp and
    # gloo see the same machine phases (this VM's speed drifts over tens of seconds).
    gloo_kind = "gloo-threads" if args.gloo_threads_mode else "gloo"
    for k in range(args.repeat):
        for n in sorted(set(args.py_sizes) | set(args.gloo_sizes)):
            for kind, rows, sizes, off in (("pyddp", py_rows, args.py_sizes, args.no_py),
                                           (gloo_kind, gloo_rows, args.gloo_sizes,
                                            args.no_gloo)):
                if off or n not in sizes:
                    continue
                rows.append(run_ranks(args, kind, n))
                run = f" (run {k + 1} of {args.repeat})" if args.repeat > 1 else ""
                print(f"  {kind.split('-')[0]} N={n}{run}: {json.dumps(rows[-1])[:300]}",
                      flush=True)
    if not args.no_py:
        table("pyddp Python ranks (one forked process per rank)", py_rows)
    if not args.no_gloo:
        if args.gloo_threads_mode:
            table(f"torch gloo, TORCH_GLOO_LAZY_INIT=1 (ranks as threads, at most "
                  f"{args.gloo_threads} per process; ProcessGroupGloo alone, store "
                  f"clients connected before the gate)", gloo_rows)
        else:
            how = ("init_process_group(store=...), store clients connected before the gate"
                   if args.store_first else "init_process_group env://")
            table(f"torch gloo, TORCH_GLOO_LAZY_INIT=1 (one forked process per rank, {how}; "
                  f"torch's store: no request count)", gloo_rows)
    print()
    for line in goals(c_rows, py_rows, gloo_rows, args.gloo_threads_mode):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"c": c_rows, "pyddp": py_rows, "gloo": gloo_rows}, f, indent=1)


if __name__ == "__main__":
    main()
