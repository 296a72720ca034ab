"""The all-reduce on one host against a memcpy of the same size, and against older code,
side by side in one run:

    python benchmarks/memcpy_ratio.py                          # 64 MiB, 2 ranks, 3 launches
    python benchmarks/memcpy_ratio.py --ref /tmp/wave3         # and an older build, alternated
    python benchmarks/memcpy_ratio.py --sizes 128K,1M,16M,64M  # the sweep: slices vs blocks

Each launch starts 2 ranks (plain RANK/WORLD_SIZE/MASTER_* variables on loopback, ranks
on this host: shared memory) that time, in turns of --rounds rounds, a float32 SUM
all_reduce of each size on the default group (pyddp's choice: the ring slice by slice,
ddp_coll_slice.c), the same on a group with pg_options={"algo": "block"} (the ring block
by block, the all-reduce before slices), and on rank 0 alone a memcpy of the same bytes
(NumPy's copyto between two arrays written once, while rank 1 waits in a barrier): the
floor, one pass over the data in one process. Every round starts after a barrier; a
variant's time is its best round's mean call (the slowest rank's). Each launch prints the
ratio of every variant to its memcpy; --launches launches alternate between this tree and
every --ref tree (a checkout whose extension is built in place, e.g. the wave-3 code:
``git worktree add /tmp/wave3 df16fea && (cd /tmp/wave3 && python setup.py build_ext
--inplace)``), and the summary gives each tree's best and median ratio over its
launches, with the load average at the start and end. Results are checked: after the
timed rounds each group reduces every rank's index-based pattern once more, and every
element must be the exact sum. Ranks run with
one BLAS thread (OpenBLAS's idle threads spin on a core the ranks need otherwise).
"""
import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def parse_size(text):
    t = text.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="64M", help="comma-separated sizes (64M)")
    p.add_argument("--ref", action="append", default=[], metavar="TREE",
                   help="an older checkout with its extension built in place (repeatable)")
    p.add_argument("--launches", type=int, default=3, help="launches per tree (3)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per variant (5)")
    p.add_argument("--iters", type=int, default=0,
                   help="calls per round (0: about 50 ms worth, at least 2)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.sizes = [parse_size(s) for s in a.sizes.split(",") if s]
    return a


# ---- one rank ----------------------------------------------------------------------

def worker(args):
    import numpy as np
    import pyddp as dist
    dist.init_process_group("cpu")
    rank = dist.get_rank()
    try:
        block = dist.new_group(pg_options={"algo": "block"})
    except Exception:  # noqa: BLE001  (an older tree has no "block")
        block = None
    groups = {"slices": None, "blocks": block} if block is not None else {"ring": None}
    for nbytes in args.sizes:
        n = nbytes // 4
        a = np.empty(n, np.float32)
        a.fill(1.0)
        src, dst = np.empty(n, np.float32), np.empty(n, np.float32)
        src.fill(2.0)
        dst.fill(0.0)
        est = {}
        for name, g in groups.items():
            t0 = time.perf_counter()
            for _ in range(2):
                dist.all_reduce(a, group=g)
            est[name] = (time.perf_counter() - t0) / 2
        t = np.array([max(est.values())])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        iters = args.iters or max(2, int(0.05 / max(t[0], 1e-6)))
        best = {name: float("inf") for name in list(groups) + ["memcpy"]}
        for _ in range(args.rounds):
            for name, g in groups.items():
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    dist.all_reduce(a, group=g)
                x = np.array([(time.perf_counter() - t0) / iters])
                dist.all_reduce(x, op=dist.ReduceOp.MAX)
                best[name] = min(best[name], x[0])
            dist.barrier()
            if rank == 0:
                t0 = time.perf_counter()
                for _ in range(iters):
                    np.copyto(dst, src)
                best["memcpy"] = min(best["memcpy"], (time.perf_counter() - t0) / iters)
            dist.barrier()
        ok = True
        for g in groups.values():   # the check: each rank's index plus one, summed
            a[:] = np.arange(n, dtype=np.float32) % 1024 + rank + 1
            dist.all_reduce(a, group=g)
            ok &= bool(np.array_equal(a, 2 * (np.arange(n, dtype=np.float32) % 1024) + 3))
        flags = np.array([0.0 if ok else 1.0])
        dist.all_reduce(flags)
        if rank == 0:
            mc = best.pop("memcpy")
            print("RESULT", nbytes, mc, " ".join(f"{k}={v}" for k, v in best.items()),
                  "wrong" if flags[0] else "ok", flush=True)
        del a, src, dst
    dist.destroy_process_group()


# ---- the launcher ------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tree, args):
    """One launch of 2 ranks against tree; returns [(size, memcpy s, {variant: s}, ok)]."""
    port = free_port()
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONPATH=tree)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker",
               f"--sizes={','.join(str(s) for s in args.sizes)}", f"--rounds={args.rounds}",
               f"--iters={args.iters}"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    out = ""
    try:
        out, _ = procs[0].communicate(timeout=args.timeout)
        procs[1].wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    rows = []
    for line in out.splitlines():
        if line.startswith("RESULT"):
            f = line.split()
            rows.append((int(f[1]), float(f[2]),
                         {k: float(v) for k, v in (x.split("=") for x in f[3:-1])},
                         f[-1] == "ok"))
    if procs[0].returncode != 0 or len(rows) != len(args.sizes):
        raise SystemExit(f"launch against {tree} failed (exit {procs[0].returncode})")
    return rows


def main():
    args = parse()
    if args.worker:
        return worker(args)
    trees = [ROOT] + [os.path.abspath(t) for t in args.ref]
    print(f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    ratios = {}   # (tree, size, variant) -> [ratio per launch]
    for k in range(args.launches):
        for tree in trees:
            for nbytes, mc, times, ok in launch(tree, args):
                cells = "  ".join(f"{v} {t * 1e3:7.2f} ms ({t / mc:.3f}x)"
                                  for v, t in times.items())
                print(f"launch {k + 1} {tree}: {nbytes >> 10} KiB: memcpy {mc * 1e3:.2f} ms"
                      f"  {cells}  {'ok' if ok else 'WRONG RESULT'}", flush=True)
                for v, t in times.items():
                    ratios.setdefault((tree, nbytes, v), []).append(t / mc)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    print("all_reduce time / memcpy time (2 ranks, float32 sum): best and median over "
          f"{args.launches} launches")
    for (tree, nbytes, v), rs in ratios.items():
        print(f"  {nbytes >> 10:8d} KiB  {v:7s} best {min(rs):.3f}  median "
              f"{statistics.median(rs):.3f}  ({tree})")


if __name__ == "__main__":
    main()
