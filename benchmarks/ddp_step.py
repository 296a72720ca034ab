"""DDP training-step time: pyddp's DistributedDataParallel against torch's (gloo), the
cost of DDP itself at world size 1, and torch's DDP over the "pyddp" backend against
gloo. One command runs parts 1 to 3 (part 4 with --reduce-dtype):

    python benchmarks/ddp_step.py            # add --steps/--rounds/--batch to change the run
    python benchmarks/ddp_step.py --part backend    # part 3 only, 3 runs and their median

Part 1 launches 2 ranks with stock torchrun. Each rank builds the same ~21M-parameter
MLP twice, wraps one copy in torch's DDP (gloo) and the other in pyddp's DDP (pyddp's
CPU backend), and times full steps (zero_grad, forward, backward with the gradient
all-reduce, SGD step) in turns, one step each, so that both see the same machine
conditions. Part 2 runs one process (world size 1) and times the same step with no
DDP, pyddp's DDP and torch's DDP. Part 3 ("backend") launches 2 ranks whose default
torch.distributed group is the "pyddp" backend and times torch's own DDP over it
against the same torch DDP over a gloo group (new_group(backend="gloo")) in the same
processes, steps alternated (each after an untimed barrier), on a ~6M-parameter MLP
(--backend-hidden 2048), with a third copy whose all-reduce costs nothing (a comm hook
returning each bucket as it is): the floor that no backend's step can go below. Prints the
median step times (wall clock, and the process's CPU time, which a busy machine
disturbs far less), the ratios, and the backend's overhead ratio: (step over "pyddp" -
floor) / (step over gloo - floor), what each backend adds to the step beyond the
compute. Part 3 runs --repeat times (default 3, each a fresh torchrun launch) and ends
with every run's overhead ratio and their median, wall clock and CPU time; the wall
clock median is the figure of merit (what users feel), the CPU one the steadier check.
Part 4 ("reduce", run by ``--reduce-dtype bfloat16`` or ``--part reduce``) launches 2
ranks that wrap the same MLP twice in pyddp's DDP, once reducing float32 gradients and
once with ``reduce_dtype=`` (gradients on the wire as bfloat16/float16), steps
alternated, and prints both step times and their ratio. benchmarks/two_hosts.py
--ddp-step runs this part across two network namespaces with a capped link.
Compute threads: one per rank (torchrun's OMP_NUM_THREADS=1; parts 2 and 4 match it).
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5, help="timed steps per round and variant")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--backend-hidden", type=int, default=2048,
                   help="hidden width of part 3's MLP (2048: 6.3M parameters)")
    p.add_argument("--repeat", type=int, default=3,
                   help="part 3: runs (separate launches) whose overhead ratios' median "
                        "is printed")
    p.add_argument("--part", choices=["all", "ranks", "single", "backend", "reduce"],
                   default="all", help="all: parts 1-3, and 4 with --reduce-dtype")
    p.add_argument("--reduce-dtype", choices=["bfloat16", "float16"], default=None,
                   help="part 4: DDP step with float32 gradients against this reduce dtype")
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--reduce-worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def make_model(hidden):
    import torch
    from torch import nn
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                         nn.ReLU(), nn.Linear(hidden, 10))


def timed_step(model, opt, x, y):
    """(wall, CPU) seconds of one full training step. CPU time is this process's, all
    threads: on a busy machine it is far steadier than wall time."""
    import torch.nn.functional as F
    t0, c0 = time.perf_counter(), time.process_time()
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    return time.perf_counter() - t0, time.process_time() - c0


def compare(variants, args, x, y, sync=None):
    """Warm each variant up, then time them in turns, one step each, args.steps *
    args.rounds times, so that slow phases of a shared machine hit all of them alike.
    variants: name -> (model, optimizer); sync: None, or a barrier called (untimed)
    before each timed step, for a set with a variant whose ranks never synchronize (the
    floor): they drift apart there, and whichever variant came next would absorb the
    drift in its first collective. Returns name -> (median wall, median CPU)."""
    for model, opt in variants.values():
        for _ in range(args.warmup):
            timed_step(model, opt, x, y)
    samples = {name: [] for name in variants}
    for _ in range(args.rounds * args.steps):
        for name, (model, opt) in variants.items():
            if sync is not None:
                sync()
            samples[name].append(timed_step(model, opt, x, y))
    return {name: tuple(statistics.median(s[k] for s in t) for k in (0, 1))
            for name, t in samples.items()}


def report(med):
    for name, (wall, cpu) in med.items():
        print(f"  {name:18s} {wall * 1000:8.1f} ms/step wall  {cpu * 1000:8.1f} ms/step CPU")


def sgd(model):
    import torch
    return torch.optim.SGD(model.parameters(), lr=1e-3)


def worker(args):
    """Part 1, on each rank: torch DDP (gloo) and pyddp DDP side by side."""
    import torch
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import pyddp
    tdist.init_process_group("gloo")
    pyddp.init_process_group("cpu")
    rank, world = pyddp.get_rank(), pyddp.get_world_size()
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, 1024, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    ref, ours = TorchDDP(make_model(args.hidden)), pyddp.DistributedDataParallel(make_model(args.hidden))
    nparams = sum(p.numel() for p in ref.parameters())
    med = compare({"torch DDP (gloo)": (ref, sgd(ref)), "pyddp DDP": (ours, sgd(ours))},
                  args, x, y)
    if rank == 0:
        print(f"{world} ranks, {nparams / 1e6:.1f}M parameters, batch {args.batch} per rank, "
              f"{torch.get_num_threads()} compute thread(s) per rank")
        report(med)
        print(f"  pyddp / torch step time ratio: "
              f"{med['pyddp DDP'][0] / med['torch DDP (gloo)'][0]:.3f}")
    pyddp.destroy_process_group()
    tdist.destroy_process_group()


def _no_communication(state, bucket):
    """A DDP comm hook that reduces nothing: the bucket comes back as it is, at once."""
    import torch
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def backend_worker(args):
    """Part 3, on each rank: torch's DDP over the "pyddp" backend against torch's DDP
    over gloo, both groups in these processes."""
    import torch
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import pyddp.torch_backend  # noqa: F401 - registers "pyddp" even with autoload off
    tdist.init_process_group("pyddp")
    gloo = tdist.new_group(backend="gloo")
    rank, world = tdist.get_rank(), tdist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, 1024, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    ref = TorchDDP(make_model(args.backend_hidden), process_group=gloo)
    ours = TorchDDP(make_model(args.backend_hidden))
    # The floor: the same DDP step whose gradient all-reduce costs nothing (a comm hook
    # that hands each bucket back at once), what no backend can beat.
    floor = TorchDDP(make_model(args.backend_hidden))
    floor.register_comm_hook(None, _no_communication)
    nparams = sum(p.numel() for p in ref.parameters())
    names = ("torch DDP over gloo", "torch DDP over pyddp", "no communication")
    med = compare({names[0]: (ref, sgd(ref)), names[1]: (ours, sgd(ours)),
                   names[2]: (floor, sgd(floor))}, args, x, y, sync=tdist.barrier)
    if rank == 0:
        print(f"torch's DDP, {world} ranks, {nparams / 1e6:.1f}M parameters, batch {args.batch} "
              f"per rank, {torch.get_num_threads()} compute thread(s) per rank")
        report(med)
        for name, what in ((names[1], "over pyddp"), (names[2], "floor (no communication)")):
            print(f"  {what} / over gloo step time ratio: "
                  f"{med[name][0] / med[names[0]][0]:.3f} wall, "
                  f"{med[name][1] / med[names[0]][1]:.3f} CPU")
        ratio = overhead_ratio(med[names[1]], med[names[0]], med[names[2]])
        print(f"  overhead over the floor, (pyddp - floor) / (gloo - floor): "
              f"{ratio[0]:.3f} wall, {ratio[1]:.3f} CPU")
        if args.result_file:
            with open(args.result_file, "w") as f:
                json.dump(ratio, f)
    tdist.destroy_process_group()


def overhead_ratio(ours, ref, floor):
    """(wall, CPU) of (ours - floor) / (ref - floor), each a (wall, CPU) step time: the
    share of the reference backend's cost over the floor that ours adds. NaN where the
    reference does not exceed the floor (no overhead to compare to)."""
    return tuple((o - f) / (r - f) if r > f else float("nan")
                 for o, r, f in zip(ours, ref, floor))


def backend_runs(cmd, env, repeat):
    """Part 3, repeat times, each a fresh launch; prints each run's overhead ratio and
    the median (wall clock: the figure of merit; CPU time: the steadier check)."""
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(repeat):
            out = os.path.join(tmp, f"run{k}.json")
            if repeat > 1:
                print(f"part 3, run {k + 1} of {repeat}", flush=True)
            subprocess.run(cmd + [f"--result-file={out}"], env=env, check=True)
            with open(out) as f:
                ratios.append(json.load(f))
    walls, cpus = ([r[i] for r in ratios] for i in (0, 1))
    print(f"backend overhead ratio (pyddp - floor) / (gloo - floor), {repeat} run(s): "
          f"wall {', '.join(f'{w:.3f}' for w in walls)}, median {statistics.median(walls):.3f}; "
          f"CPU {', '.join(f'{c:.3f}' for c in cpus)}, median {statistics.median(cpus):.3f}")


def reduce_worker(args):
    """Part 4, on each rank (torchrun or plain RANK/WORLD_SIZE/MASTER_* variables): pyddp's
    DDP reducing float32 gradients against the same with reduce_dtype=, side by side."""
    import torch

    import pyddp
    torch.set_num_threads(1)
    pyddp.init_process_group("cpu")
    rank, world = pyddp.get_rank(), pyddp.get_world_size()
    dt = args.reduce_dtype or "bfloat16"
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, 1024, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    full = pyddp.DistributedDataParallel(make_model(args.hidden))
    half = pyddp.DistributedDataParallel(make_model(args.hidden), reduce_dtype=getattr(torch, dt))
    nparams = sum(p.numel() for p in full.parameters())
    names = ("float32 gradients", f"{dt} gradients")
    med = compare({names[0]: (full, sgd(full)), names[1]: (half, sgd(half))}, args, x, y)
    if rank == 0:
        print(f"pyddp DDP, {world} ranks, {nparams / 1e6:.1f}M parameters "
              f"({nparams * 4 / 1e6:.0f} MB of float32 gradients), batch {args.batch} per rank")
        report(med)
        print(f"  float32 / {dt} step time ratio: {med[names[0]][0] / med[names[1]][0]:.3f} "
              f"wall, {med[names[0]][1] / med[names[1]][1]:.3f} CPU")
    pyddp.destroy_process_group()


def single(args):
    """Part 2: world size 1, no DDP vs pyddp DDP vs torch DDP, in one process."""
    import torch
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import pyddp
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    pyddp.init_process_group("cpu", init_method=f"tcp://127.0.0.1:{port + 1}", rank=0,
                             world_size=1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(args.batch, 1024, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    plain = make_model(args.hidden)
    ours = pyddp.DistributedDataParallel(make_model(args.hidden))
    ref = TorchDDP(make_model(args.hidden))
    med = compare({"no DDP": (plain, sgd(plain)), "pyddp DDP": (ours, sgd(ours)),
                   "torch DDP (gloo)": (ref, sgd(ref))}, args, x, y)
    print("world size 1, 1 compute thread")
    report(med)
    for name in ("pyddp DDP", "torch DDP (gloo)"):
        wall, cpu = (med[name][k] / med["no DDP"][k] - 1 for k in (0, 1))
        print(f"  {name} overhead over no DDP: {wall * 100:+.1f}% wall, {cpu * 100:+.1f}% CPU")
    pyddp.destroy_process_group()
    tdist.destroy_process_group()


def main():
    args = parse()
    if args.worker:
        return worker(args)
    if args.backend_worker:
        return backend_worker(args)
    if args.reduce_worker:
        return reduce_worker(args)
    passthrough = [f"--steps={args.steps}", f"--rounds={args.rounds}",
                   f"--warmup={args.warmup}", f"--batch={args.batch}", f"--hidden={args.hidden}",
                   f"--backend-hidden={args.backend_hidden}"]
    if args.reduce_dtype:
        passthrough.append(f"--reduce-dtype={args.reduce_dtype}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get(
        "PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.nproc}", os.path.abspath(__file__)]
    if args.part in ("all", "ranks"):
        subprocess.run(cmd + ["--worker"] + passthrough, env=env, check=True)
    if args.part in ("all", "backend"):
        backend_runs(cmd + ["--backend-worker"] + passthrough, env, args.repeat)
    if args.part in ("all", "single"):
        sys.path.insert(0, ROOT)
        single(args)
    if args.part == "reduce" or (args.part == "all" and args.reduce_dtype):
        subprocess.run(cmd + ["--reduce-worker"] + passthrough, env=env, check=True)


if __name__ == "__main__":
    main()
