"""Small-collective latency: pyddp's API (NumPy and torch), torch.distributed over the
"pyddp" backend, gloo and Open MPI.

    python benchmarks/latency.py                 # 2 and 4 ranks on this host
    python benchmarks/latency.py --nproc 2 --iters 2000

For each world size the script starts the ranks itself (plain RANK/WORLD_SIZE/MASTER_*
variables). Every rank initialises pyddp and, in the same process, a gloo group
(torch.distributed) and a "pyddp" backend group beside it; under mpi4py (installed, and
`mpirun` on PATH) a second launch through mpirun times Open MPI's in-place
Allreduce/Bcast/Barrier. Rows: all_reduce (SUM, float32) and broadcast from 8 B to 64
KiB, and barrier; columns: median microseconds per call over rounds of back-to-back
calls (rank 0's clock, every rank calling). ``numpy`` and ``torch`` call pyddp's own
functions (the lean path); ``backend`` calls torch.distributed's on a group of the
"pyddp" backend (``new_group(backend="pyddp")``; with --no-gloo, torch's default group
made with "pyddp"); ``bk-torch`` is backend minus torch. The last part times DDP's
gradient hooks: a model of 200 small parameters (nn.Linear(8, 8) layers), one backward
pass with pyddp's DDP minus the same backward without DDP, divided by the number of
parameters; and the hook call alone (the C hook against the Python path it falls back
to, called directly, best round).
"""
import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SIZES = [8, 64, 512, 4096, 32768, 65536]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, nargs="*", default=[2, 4])
    p.add_argument("--iters", type=int, default=1000, help="calls per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--stat", choices=["median", "min"], default="median",
                   help="per-call time of a row: median or minimum over the rounds (min is "
                        "steadier on a machine others are using)")
    p.add_argument("--no-gloo", action="store_true")
    p.add_argument("--no-mpi", action="store_true")
    p.add_argument("--worker", choices=["pyddp", "mpi"], help=argparse.SUPPRESS)
    return p.parse_args(argv)


STAT = statistics.median


def timeit(fn, iters, rounds, sync):
    """Median seconds per call of fn over rounds of iters calls; sync() lines the
    ranks up before each round. The first calls (links, pages, caches) are not timed."""
    for _ in range(min(iters, 100)):
        fn()
    per = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        per.append((time.perf_counter() - t0) / iters)
    return STAT(per)


def pyddp_worker(a):
    import numpy as np
    import torch
    import torch.distributed as td
    import pyddp as dist
    torch.set_num_threads(1)
    dist.init_process_group("cpu")
    rank, ws = dist.get_rank(), dist.get_world_size()
    import pyddp.torch_backend  # noqa: F401 - registers "pyddp" even with autoload off
    gloo = None
    os.environ["MASTER_PORT"] = os.environ["GLOO_PORT"]
    if not a.no_gloo:
        td.init_process_group("gloo", rank=rank, world_size=ws)
        gloo = True
        backend = td.new_group(backend="pyddp")
    else:
        td.init_process_group("pyddp", rank=rank, world_size=ws)
        backend = None
    rows = []
    it, rd = a.iters, a.rounds
    sync = dist.barrier
    for nbytes in SIZES:
        n = nbytes // 4
        x = np.ones(n, np.float32)
        t = torch.ones(n)
        r = {"op": "all_reduce", "bytes": nbytes,
             "numpy": timeit(lambda: dist.all_reduce(x), it, rd, sync),
             "torch": timeit(lambda: dist.all_reduce(t), it, rd, sync),
             "backend": timeit(lambda: td.all_reduce(t, group=backend), it, rd, sync)}
        if gloo:
            r["gloo"] = timeit(lambda: td.all_reduce(t), max(it // 10, 20), rd, sync)
        rows.append(r)
        r = {"op": "broadcast", "bytes": nbytes,
             "numpy": timeit(lambda: dist.broadcast(x, 0), it, rd, sync),
             "torch": timeit(lambda: dist.broadcast(t, 0), it, rd, sync),
             "backend": timeit(lambda: td.broadcast(t, 0, group=backend), it, rd, sync)}
        if gloo:
            r["gloo"] = timeit(lambda: td.broadcast(t, 0), max(it // 10, 20), rd, sync)
        rows.append(r)
    r = {"op": "barrier", "bytes": 0, "numpy": timeit(dist.barrier, it, rd, sync)}
    r["torch"] = r["numpy"]
    r["backend"] = timeit(lambda: td.barrier(group=backend), it, rd, sync)
    if gloo:
        r["gloo"] = timeit(td.barrier, max(it // 10, 20), rd, sync)
    rows.append(r)
    hook = ddp_hook_cost(dist, torch, rd)
    if rank == 0:
        print("RESULT", repr({"ws": ws, "rows": rows, "hook": hook}), flush=True)
    td.destroy_process_group()
    dist.destroy_process_group()


def ddp_hook_cost(dist, torch, rounds):
    """Microseconds of pyddp per gradient hook: (backward with DDP - backward without)
    / parameters, on 100 Linear(8, 8) layers (200 parameters)."""
    from torch import nn
    from pyddp import DistributedDataParallel as DDP
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8) for _ in range(100)]
    plain = nn.Sequential(*layers)
    model = DDP(nn.Sequential(*[nn.Linear(8, 8) for _ in range(100)]))
    x = torch.ones(4, 8)
    nparam = sum(1 for _ in plain.parameters())

    def step(m):
        m.zero_grad(set_to_none=False)
        m(x).sum().backward()
    out = {}
    for name, m in (("plain", plain), ("ddp", model)):
        step(m)
        per = []
        for _ in range(rounds):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(20):
                step(m)
            per.append((time.perf_counter() - t0) / 20)
        out[name] = statistics.median(per)
    calls = hook_call_cost(dist, torch, model, x, rounds)
    return {"params": nparam, "step_plain_us": out["plain"] * 1e6,
            "step_ddp_us": out["ddp"] * 1e6,
            "per_hook_us": (out["ddp"] - out["plain"]) * 1e6 / nparam, **calls}


def hook_call_cost(dist, torch, model, x, rounds):
    """Microseconds per call of the hooks themselves, without autograd around them: in
    an expected synced backward (after a forward) each parameter's registered C hook
    (GradHooks.hook) is called on it in turn, against the Python path it falls back to
    (GradSync.on_grad through a weak reference, as pyddp.ddp._torch._on_grad does). The
    end-of-backward callback cannot be queued outside backward, so `first` is a no-op
    while this runs, and finalize() is called directly."""
    import weakref
    sync, params = model._sync, model._params
    hooks = [sync.hooks.hook(i) for i in range(len(params))]
    ref = weakref.ref(model)

    def python_hook(i, p):
        m = ref()
        if m is not None:
            m._sync.on_grad(i)
    py = [lambda p, i=i: python_hook(i, p) for i in range(len(params))]
    for p in params:
        p.grad = torch.ones_like(p)
    first, sync.hooks.first = sync.hooks.first, lambda: None
    out = {}
    try:
        for name, hs in (("hook_c_us", hooks), ("hook_python_us", py)) * 2:
            best = float("inf")
            for _ in range(rounds * 4):
                dist.barrier()
                model(x)                    # a synced backward is now expected
                t0 = time.perf_counter()
                for h, p in zip(hs, params):
                    h(p)
                best = min(best, time.perf_counter() - t0)
                sync.finalize()
            out[name] = min(out.get(name, best), best) * 1e6 / len(params)
    finally:
        sync.hooks.first = first
    return out


def mpi_worker(a):
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rows = []
    for nbytes in SIZES:
        x = np.ones(nbytes // 4, np.float32)
        rows.append({"op": "all_reduce", "bytes": nbytes, "mpi": timeit(
            lambda: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM), a.iters, a.rounds,
            comm.Barrier)})
        rows.append({"op": "broadcast", "bytes": nbytes, "mpi": timeit(
            lambda: comm.Bcast(x, root=0), a.iters, a.rounds, comm.Barrier)})
    rows.append({"op": "barrier", "bytes": 0,
                 "mpi": timeit(comm.Barrier, a.iters, a.rounds, comm.Barrier)})
    if comm.Get_rank() == 0:
        print("RESULT", repr({"ws": comm.Get_size(), "rows": rows}), flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def result_of(out):
    import ast
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return ast.literal_eval(line[len("RESULT "):])
    return None


def launch_pyddp(a, ws):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               GLOO_PORT=str(free_port()), WORLD_SIZE=str(ws), OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = [sys.executable, os.path.abspath(__file__), "--worker", "pyddp",
            "--iters", str(a.iters), "--rounds", str(a.rounds), "--stat", a.stat] + \
        (["--no-gloo"] if a.no_gloo else [])
    procs = [subprocess.Popen(args, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, text=True) for r in range(ws)]
    try:
        outs = [p.communicate(timeout=1800)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise SystemExit(f"a pyddp rank failed (world size {ws})")
    return result_of(outs[0])


def launch_mpi(a, ws):
    mpirun = shutil.which("mpirun")
    try:
        import mpi4py  # noqa: F401 - only whether it is installed
    except ImportError:
        return None, "mpi4py is not installed"
    if mpirun is None:
        return None, "mpirun is not on PATH"
    cmd = [mpirun, "--oversubscribe", "--allow-run-as-root", "-np", str(ws), sys.executable,
           os.path.abspath(__file__), "--worker", "mpi", "--iters", str(a.iters),
           "--rounds", str(a.rounds), "--stat", a.stat]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return None, "mpirun timed out"
    res = result_of(p.stdout)
    return res, None if res else f"mpirun failed: {p.stderr.strip()[-300:]}"


def report(ws, res, mpi):
    cols = ["numpy", "torch", "backend", "gloo", "mpi"]
    by = {(r["op"], r["bytes"]): r for r in res["rows"]}
    for r in (mpi or {}).get("rows", []):
        by.setdefault((r["op"], r["bytes"]), {}).update(mpi=r["mpi"])
    print(f"\n## world size {ws}: {STAT.__name__} microseconds per call")
    print(f"{'op':<11}{'bytes':>7}" + "".join(f"{c:>10}" for c in cols) +
          f"{'bk-torch':>10}{'numpy/mpi':>11}{'torch/mpi':>11}")
    for (op, nbytes), r in by.items():
        cells = "".join(f"{r[c] * 1e6:>10.1f}" if c in r else f"{'-':>10}" for c in cols)
        cells += f"{(r['backend'] - r['torch']) * 1e6:>+10.1f}" if "backend" in r and \
            "torch" in r else f"{'-':>10}"
        ratio = "".join(f"{r[c] / r['mpi']:>11.1f}" if "mpi" in r and c in r
                        else f"{'-':>11}" for c in ("numpy", "torch"))
        print(f"{op:<11}{nbytes:>7}{cells}{ratio}")
    h = res["hook"]
    print(f"DDP, {h['params']} parameters: backward {h['step_plain_us']:.0f} us without DDP, "
          f"{h['step_ddp_us']:.0f} us with: {h['per_hook_us']:.1f} us per hook; the hook "
          f"call alone (best round): {h['hook_c_us']:.2f} us in C, "
          f"{h['hook_python_us']:.2f} us through the Python path")


def main():
    a = parse()
    global STAT
    STAT = min if a.stat == "min" else statistics.median
    if a.worker == "pyddp":
        return pyddp_worker(a)
    if a.worker == "mpi":
        return mpi_worker(a)
    for ws in a.nproc:
        res = launch_pyddp(a, ws)
        mpi, why = (None, "--no-mpi") if a.no_mpi else launch_mpi(a, ws)
        if why:
            print(f"(Open MPI skipped at world size {ws}: {why})")
        report(ws, res, mpi)


if __name__ == "__main__":
    main()
