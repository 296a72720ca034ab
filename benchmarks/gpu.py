"""The GPU path's cost per call and per DDP step, side by side with torch's "nccl"
(issue 38). One command prints every figure:

    python benchmarks/gpu.py                 # on a GPU: both tables (about a minute)
    python benchmarks/gpu.py --fake          # anywhere: the per-call CPU cost, no GPU
    python benchmarks/gpu.py --json out.json # also write the figures as JSON

On a GPU (world size 1 in one process: NCCL refuses two ranks on one GPU):

1. Per call: ``all_reduce`` (SUM) of a float32 CUDA tensor of 4 KiB and of 64 MiB,
   blocking ("sync": host time until the call returns) and ``async_op=True`` ("async":
   until the Work is returned), through torch's API over torch's "nccl", torch's API
   over the backend "pyddp" (a ``new_group(backend="pyddp")``) and pyddp's own API over
   its "nccl"; microseconds per call, the median over --rounds rounds of --calls calls,
   the rows taking turns, the GPU synchronised between rounds (not timed), and the ratio
   to torch's "nccl".
2. DDP step: the same MLP (--layers x Linear(--width, --width) with ReLU, batch
   --batch, float32) wrapped three times from one initialisation: torch's DDP over
   "nccl", torch's DDP over "pyddp", pyddp's DistributedDataParallel over its "nccl";
   one step each in turns (zero_grad, forward, MSE loss, backward with the gradient
   all-reduce, SGD step; the GPU synchronised around each), median step time over
   --steps steps after --warmup, the ratio to torch's DDP over "nccl", and the largest
   parameter difference of each copy from it at the end (the three must agree).

Without a GPU (--fake): the test-double NCCL and CUDA runtime of tests/nccl_fake (built
here with the C compiler) and a CPU tensor that says it lives on cuda:0
(tests/nccl_fake/torch_fakes.py) run the same calls through pyddp's real code, so what
is measured is the CPU cost of the call path itself, the GPU's share (the CUDA and NCCL
calls) left out. Rows: torch's API over "pyddp" and pyddp's own API, beside torch's own
wrapper over a backend whose methods return at once (the floor every backend pays; its
"async" returns one ready-made Work), with the ratio to that floor and the Python
functions one call runs (pyddp's, torch's).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)      # the checkout's pyddp (an in-place build), installed or not
SIZES = (("4 KiB", 1024), ("64 MiB", 16 << 20))      # float32 elements


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fake", action="store_true", help="no GPU: the test doubles")
    p.add_argument("--calls", type=int, default=200, help="calls per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=40, help="timed DDP steps per wrapper")
    p.add_argument("--warmup", type=int, default=5, help="untimed DDP steps first")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--no-ddp", action="store_true", help="skip the DDP step table")
    p.add_argument("--json", help="write the figures here too")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def timed(cases, calls, rounds, sync):
    """{name: median seconds per call} of cases {name: fn}: each round runs every fn
    `calls` times, the names taking turns; whatever fn returns that has ``wait`` (a Work)
    is waited for after its timed loop, then sync() (neither is timed)."""
    per = {k: [] for k in cases}
    for _ in range(rounds + 1):          # the first round warms up (links, caches)
        for name, fn in cases.items():
            out = [None] * calls
            t0 = time.perf_counter()
            for i in range(calls):
                out[i] = fn()
            dt = time.perf_counter() - t0
            for w in out:
                if hasattr(w, "wait"):
                    w.wait()
            sync()
            per[name].append(dt / calls)
    return {k: statistics.median(v[1:]) for k, v in per.items()}


def per_call_table(rows, ref, title):
    """Print {row: {column: seconds}} in microseconds, with the ratio to row ref (a
    column a row lacks prints as "-")."""
    cols = list(rows[ref])
    print(f"\n{title}\n{'':38}" + "".join(f"{c:>22}" for c in cols))
    for name, vals in rows.items():
        cells = "".join(f"{vals[c] * 1e6:12.1f} us ({vals[c] / rows[ref][c]:4.2f})"
                        if c in vals else f"{'-':>22}" for c in cols)
        print(f"{name:38}{cells}")


# ---- on a GPU --------------------------------------------------------------------

def gpu_setup():
    """torch's default group ("nccl"), a torch group of the backend "pyddp", and pyddp's
    own default group ("nccl"), all of world size 1 in this process."""
    import socket
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    import pyddp
    import pyddp.torch_backend  # noqa: F401 - registers "pyddp" even with autoload off
    torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl", timeout=timedelta(seconds=120))
    backend = dist.new_group(backend="pyddp")
    store = pyddp.TCPStore("127.0.0.1", 0, is_master=True)
    pyddp.init_process_group("nccl", store=store, rank=0, world_size=1,
                             timeout=timedelta(seconds=120))
    return backend, store


def gpu_per_call(a, backend):
    import torch
    import torch.distributed as dist
    import pyddp
    rows = {"torch's API, backend \"nccl\"": {}, "torch's API, backend \"pyddp\"": {},
            "pyddp's own API, \"nccl\"": {}}
    for label, n in SIZES:
        t = [torch.ones(n, device="cuda") for _ in range(3)]
        cases = {
            ("torch's API, backend \"nccl\"", "sync"): lambda: dist.all_reduce(t[0]),
            ("torch's API, backend \"nccl\"", "async"):
                lambda: dist.all_reduce(t[0], async_op=True),
            ("torch's API, backend \"pyddp\"", "sync"):
                lambda: dist.all_reduce(t[1], group=backend),
            ("torch's API, backend \"pyddp\"", "async"):
                lambda: dist.all_reduce(t[1], group=backend, async_op=True),
            ("pyddp's own API, \"nccl\"", "sync"): lambda: pyddp.all_reduce(t[2]),
            ("pyddp's own API, \"nccl\"", "async"):
                lambda: pyddp.all_reduce(t[2], async_op=True)}
        got = timed(cases, a.calls, a.rounds, torch.cuda.synchronize)
        for (row, mode), s in got.items():
            rows[row][f"{label} {mode}"] = s
        assert all(bool((x == 1).all()) for x in t), "all_reduce at world size 1 changed data"
    per_call_table(rows, "torch's API, backend \"nccl\"",
                   f"all_reduce of a CUDA tensor, world size 1: host time per call (median of "
                   f"{a.rounds} rounds of {a.calls} calls; ratio to torch's \"nccl\")")
    return rows


def gpu_ddp(a, backend):
    import copy
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    import pyddp
    torch.manual_seed(0)
    layers = []
    for _ in range(a.layers):
        layers += [nn.Linear(a.width, a.width), nn.ReLU()]
    base = nn.Sequential(*layers[:-1])
    nparam = sum(p.numel() for p in base.parameters())
    wrappers = {"torch DDP over torch's \"nccl\"": lambda m: TorchDDP(m, device_ids=[0]),
                "torch DDP over backend \"pyddp\"":
                    lambda m: TorchDDP(m, device_ids=[0], process_group=backend),
                "pyddp DistributedDataParallel over \"nccl\"":
                    lambda m: pyddp.DistributedDataParallel(m, device_ids=[0])}
    models = {k: w(copy.deepcopy(base).cuda()) for k, w in wrappers.items()}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(a.batch, a.width, device="cuda", generator=g)
    y = torch.randn(a.batch, a.width, device="cuda", generator=g)

    def step(k):
        opts[k].zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(models[k](x), y)
        loss.backward()
        opts[k].step()
    times = {k: [] for k in models}
    for i in range(a.warmup + a.steps):
        for k in models:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(k)
            torch.cuda.synchronize()
            if i >= a.warmup:
                times[k].append(time.perf_counter() - t0)
    ref = next(iter(models))
    ref_params = [p.detach() for p in models[ref].parameters()]
    out = {}
    print(f"\nDDP step, world size 1: {a.layers} x Linear({a.width}, {a.width}), batch "
          f"{a.batch}, {nparam / 1e6:.0f}M parameters (median of {a.steps} steps, in turns)")
    for k in models:
        ms = statistics.median(times[k]) * 1e3
        diff = max(float((p.detach() - q).abs().max()) for p, q in
                   zip(models[k].parameters(), ref_params))
        out[k] = {"step_ms": ms, "ratio": ms / (statistics.median(times[ref]) * 1e3),
                  "max_param_diff": diff}
        print(f"  {k:44} {ms:8.2f} ms  {out[k]['ratio']:5.3f}   parameters differ by at "
              f"most {diff:.3g}")
    return out


def gpu_main(a):
    import torch
    import torch.distributed as dist
    import pyddp
    from pyddp import _nccl_backend
    info = _nccl_backend.load()
    v = torch.cuda.nccl.version()
    v = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    print(f"GPU {torch.cuda.get_device_name(0)}, torch {torch.__version__} (CUDA "
          f"{torch.version.cuda}, its NCCL {v}), pyddp {pyddp.__version__} with NCCL "
          f"{info['nccl_version']} ({info['nccl_path']})")
    backend, store = gpu_setup()
    res = {"per_call": gpu_per_call(a, backend)}
    if not a.no_ddp:
        res["ddp"] = gpu_ddp(a, backend)
    pyddp.destroy_process_group()
    store.close()
    dist.destroy_process_group()
    return res


# ---- without a GPU: the test doubles --------------------------------------------------

def fake_worker(a):
    """The per-call CPU cost through pyddp's real code against the test doubles (this
    process was started with them: PYDDP_NCCL_LIBRARY, PYDDP_CUDART_LIBRARY)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import torch
    import torch.distributed as dist
    from nccl_fake import lean_scenarios as ls
    from nccl_fake import torch_fakes as tf
    import pyddp

    class Done(dist.Work):
        def wait(self, timeout=None):
            return True

    class Null(dist.ProcessGroup):
        """torch's floor: a group whose all_reduce returns at once."""
        done = Done()

        def allreduce(self, tensors, opts=None):
            return self.done if opts.asyncOp else None
    ls.torch_init()
    store = pyddp.TCPStore("127.0.0.1", 0, is_master=True)
    pyddp.init_process_group("nccl", store=store, rank=0, world_size=1)
    null = Null(0, 1)
    rows = {"torch's API, a backend doing nothing": {}, "torch's API, backend \"pyddp\"": {},
            "pyddp's own API, \"nccl\"": {}}
    for label, n in SIZES:
        t = tf.cuda(torch.ones(n))
        cases = {
            ("torch's API, a backend doing nothing", "sync"):
                lambda: dist.all_reduce(t, group=null),
            ("torch's API, a backend doing nothing", "async"):
                lambda: dist.all_reduce(t, group=null, async_op=True),
            ("torch's API, backend \"pyddp\"", "sync"): lambda: dist.all_reduce(t),
            ("torch's API, backend \"pyddp\"", "async"):
                lambda: dist.all_reduce(t, async_op=True),
            ("pyddp's own API, \"nccl\"", "sync"): lambda: pyddp.all_reduce(t),
            ("pyddp's own API, \"nccl\"", "async"):
                lambda: pyddp.all_reduce(t, async_op=True)}
        got = timed(cases, a.calls, a.rounds, lambda: time.sleep(0.005))
        for (row, mode), s in got.items():
            rows[row][f"{label} {mode}"] = s
    t = tf.cuda(torch.ones(1024))
    calls = {"torch sync": ls.python_calls(lambda: dist.all_reduce(t)),
             "torch async": ls.python_calls(lambda: dist.all_reduce(t, async_op=True)),
             "pyddp sync": ls.python_calls(lambda: pyddp.all_reduce(t)),
             "pyddp async": ls.python_calls(lambda: pyddp.all_reduce(t, async_op=True))}
    pyddp.destroy_process_group()
    dist.destroy_process_group()
    return {"per_call": rows, "python_calls": calls}


def fake_main(a):
    """Build the test doubles, run fake_worker in a child process with them, print."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from nccl_fake import build
    with tempfile.TemporaryDirectory() as d:
        fakes = build.build(d)
        env = dict(os.environ, PYTHONPATH=ROOT, **build.env_of(fakes, log=False))
        argv = [sys.executable, os.path.abspath(__file__), "--worker", "--fake",
                "--calls", str(a.calls), "--rounds", str(a.rounds)]
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode != 0 or not line:
        sys.exit(f"the worker failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    res = json.loads(line[-1][len("RESULT "):])
    per_call_table(res["per_call"], "torch's API, a backend doing nothing",
                   f"CPU cost per all_reduce call of a CUDA tensor against the test doubles "
                   f"(no GPU work; median of {a.rounds} rounds of {a.calls} calls; ratio to "
                   f"torch's wrapper over a backend doing nothing)")
    print("\nPython functions one call runs (pyddp's / torch's), and the C functions "
          "pyddp's frames call:")
    for k, v in res["python_calls"].items():
        print(f"  {k:12} {sum(v['pyddp'].values()):3} / {sum(v['torch'].values()):3}   "
              f"pyddp: {', '.join(v['pyddp'])}; C: {', '.join(v['c_from_pyddp'])}")
    return res


def main():
    a = parse()
    if a.worker:
        print("RESULT " + json.dumps(fake_worker(a)), flush=True)
        return
    res = fake_main(a) if a.fake else gpu_main(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
