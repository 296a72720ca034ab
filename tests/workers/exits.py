"""Worker for tests/test_exits.py: rounds of "start, work, exit" at a few ranks, where
what is tested is the exit: every rank's exit status and stderr, and how long the exit
took.

Two ways to run it:

  exits.py launch KIND ROUNDS [--world N]
      The launcher. It imports NumPy and pyddp (and torch for TORCH_KINDS, with its lazy
      set-up done once) once, then for each round forks N rank processes (with no
      thread but its own: it never makes a group, and checks), each with its own
      stdout/stderr files
      and a free MASTER_PORT; the ranks run concurrently, each ends with a normal
      interpreter exit (SystemExit, atexit, finalization), and the launcher reaps them
      by pid, killing by pid any rank still alive at the round's deadline (after a
      SIGUSR2 that makes it print every thread's stack). One JSON line per round:
      "ROUND {...}" with every rank's exit status (negative: the signal), stderr,
      marker lines from stdout, and exit_s (from the rank's "EXITING" line to its
      reaping). Then "DONE".
  exits.py rank KIND ROUND
      One rank of one round in this process (RANK/WORLD_SIZE/MASTER_* from the
      environment), for launching fresh interpreters with tests/launch.py.

KIND (the rank programs):
  full       init_process_group("cpu"); all_reduce (inline and queued sizes, blocking
             and async), broadcast, all_gather and barrier checked against NumPy; three
             pyddp DDP steps on a small NumPy model, gradients and weights checked
             against a local reference of the averaged step; destroy_process_group;
             exit 0. torch is not imported.
  torch_ddp  the same with pyddp's DDP on a small torch model.
  nodestroy  init and checked collectives, then exit without destroy_process_group,
             leaving alive by round: nothing more, an async all_reduce every rank
             submitted and nobody waited for, a NumPy DDP model after a step, a
             subgroup of ranks 0 and 1 with an async all_reduce on it.
  fail       one rank (round-dependent: mostly rank 1, sometimes 2 or 0, the store's
             host) fails while the others are in a large all_reduce, or (every fourth
             round) in pyddp DDP's gradient sync: by a Python exception (exit status
             1), os._exit(3), or SIGKILL, either before joining the collective or
             right after starting its share (the DDP sync on a daemon thread, still
             running as the process ends). The others must raise a pyddp.DistError
             (printed as "RAISED {cls, secs, msg}"), then destroy (even rounds) or
             not, and exit 0.
  abandon    init and checked collectives; then every rank but the last submits an
             async all_reduce that the last rank never joins, and exits without waiting
             (PYDDP_EXIT_WAIT=0.5: after half a second its exit aborts the group, with a
             line on stderr). The last rank sleeps ABANDON_S, then its all_reduce must
             raise a pyddp.DistError at once ("RAISED ..."); it exits 0.
  torch      torch.distributed.init_process_group("pyddp"); checked all_reduce,
             broadcast, all_gather, barrier; two torch DDP steps checked against the
             averaged reference; by round: destroy_process_group, or none, or none
             while async all_reduces (futures with callbacks) that the later ranks
             join later are still running; exit 0.

Shared memory links are used between these same-host ranks, except in rounds where
ROUND % 4 == 3 (PYDDP_SHM_DISABLE=1: TCP; with PYDDP_NSOCKS_PERPEER=2 where ROUND % 8
== 7).
"""
import gc
import json
import os
import signal
import sys
import tempfile
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))        # tests/: launch.free_port

import numpy as np                                   # noqa: E402

import reference                                     # noqa: E402

TIMEOUT = timedelta(seconds=30)   # every pyddp wait; a failure must come far sooner
SMALL, LARGE = 24, 300_000        # elements: the inline path, and the worker's (1.2 MB)
ROUND_S = 60.0                    # a round's deadline in the launcher
EXIT_WAIT, ABANDON_S = 0.5, 4.0   # abandon: PYDDP_EXIT_WAIT, and the last rank's sleep
FAIL_RANKS = [1, 1, 2, 1, 0]


def failing(round_):
    """What fails in a fail round: {failing (rank), how, when, inside}, cycling so that
    20 rounds see every rank, every way to fail, both times and both collectives."""
    return {"failing": FAIL_RANKS[round_ % 5],
            "how": ("raise", "exit3", "sigkill")[round_ % 3],
            "when": ("before", "during")[round_ // 3 % 2],
            "inside": "ddp" if round_ % 4 == 1 else "all_reduce"}


def variant(kind, round_, ws):
    """What a round does beyond its kind, as reported in its ROUND line."""
    v = {"shm": round_ % 4 != 3, "nsocks": 2 if round_ % 8 == 7 else 1}
    if kind == "nodestroy":
        v["alive"] = ["nothing", "async_work", "numpy_ddp", "subgroup"][round_ % 4]
    elif kind == "fail":
        v.update(failing(round_), destroy=round_ % 2 == 0)
        v["failing"] %= ws
    elif kind == "torch":
        v["end"] = ("destroy", "exit", "exit_async")[round_ % 3]
    return v


# ---- the rank programs ------------------------------------------------------------

def mark(tag, **kw):
    """A marker line on stdout, which the launcher passes on."""
    print(f"{tag} {json.dumps(kw)}", flush=True)


def check_collectives(dist, rank, ws, round_, make=np.asarray, as_np=np.asarray):
    """all_reduce (SMALL and LARGE elements, blocking and async), broadcast from root
    round_ % ws, all_gather and barrier through dist (pyddp, or torch.distributed with
    make=torch.from_numpy), each result checked against NumPy arithmetic on every
    rank's input (reference.data). Raises AssertionError on a wrong result."""
    ck = reference.Checker(rank)
    for case, n in enumerate((SMALL, LARGE)):
        x = make(reference.data(rank, case, n, "float32"))
        dist.all_reduce(x)
        want = reference.reference([reference.data(r, case, n, "float32") for r in range(ws)],
                                   "SUM", "float32")
        ck.eq(as_np(x), want, f"all_reduce of {n}")
        y = make(reference.data(rank, case + 10, n, "int64"))
        dist.all_reduce(y, async_op=True).wait()
        want = reference.reference([reference.data(r, case + 10, n, "int64")
                                    for r in range(ws)], "SUM", "int64")
        ck.eq(as_np(y), want, f"async all_reduce of {n}")
    root = round_ % ws
    b = make(reference.data(rank, 20, SMALL, "float64"))
    dist.broadcast(b, src=root)
    ck.eq(as_np(b), reference.data(root, 20, SMALL, "float64"), "broadcast")
    out = [make(np.zeros(SMALL, np.int32)) for _ in range(ws)]
    dist.all_gather(out, make(reference.data(rank, 21, SMALL, "int32")))
    for r in range(ws):
        ck.eq(as_np(out[r]), reference.data(r, 21, SMALL, "int32"), f"all_gather from {r}")
    dist.barrier()


def inputs(rank, step):
    """Rank rank's batch at DDP step step: (x, y) float32 arrays."""
    rng = np.random.default_rng(100 * step + rank)
    return rng.normal(size=(6, 8)).astype(np.float32), rng.normal(size=(6, 3)).astype(np.float32)


def torch_model(seed):
    """A small torch MLP (8 -> 16 -> 3) with weights drawn from seed."""
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def torch_grads(model, x, y):
    """The gradients (NumPy float64, one per parameter) of model's MSE loss on (x, y)."""
    import torch
    model.zero_grad()
    torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
    return [p.grad.detach().numpy().astype(np.float64) for p in model.parameters()]


def torch_ddp_steps(wrap, rank, ws, steps, lr=0.1):
    """steps SGD steps of a torch model wrapped by wrap(module) (pyddp's or torch's DDP;
    each rank starts from other random weights, which the wrap makes rank 0's). Each
    step's averaged gradients and the weights after it are checked against a local
    reference model fed every rank's batch, with the mean taken in NumPy. Returns the
    wrapped model."""
    import torch
    ddp = wrap(torch_model(seed=rank))
    ref = torch_model(seed=0)
    ref.load_state_dict(ddp.module.state_dict())
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    for step in range(steps):
        x, y = inputs(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        everyone = [torch_grads(ref, *inputs(r, step)) for r in range(ws)]
        mean = [np.mean(g, axis=0) for g in zip(*everyone)]      # per parameter
        for p, m in zip(ddp.parameters(), mean):
            np.testing.assert_allclose(p.grad.numpy(), m, rtol=1e-5, atol=1e-6,
                                       err_msg=f"rank {rank} step {step}: averaged gradient")
        opt.step()
        with torch.no_grad():
            for p, m in zip(ref.parameters(), mean):
                p -= torch.from_numpy((lr * m).astype(np.float32))
        for p, q in zip(ddp.parameters(), ref.parameters()):
            np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-5,
                                       atol=1e-6, err_msg=f"rank {rank} step {step}: weights")
    return ddp


class P:
    """A parameter of a model outside torch: .data and .grad arrays."""

    def __init__(self, data):
        self.data, self.grad = data, None


class NumpyLinear:
    """y = x @ w + b with hand-written gradients: a model outside torch for pyddp's DDP."""

    def __init__(self, seed):
        rng = np.random.default_rng(seed)
        self.w = P(rng.normal(size=(8, 3)))
        self.b = P(rng.normal(size=3).astype(np.float32))

    def named_parameters(self):
        return [("w", self.w), ("b", self.b)]

    def grads(self, x, y):
        """MSE-loss gradients (w, b) on the batch (x, y), in float64."""
        err = 2 * (x @ self.w.data + self.b.data - y) / y.size
        return x.T.astype(np.float64) @ err, err.sum(axis=0).astype(np.float64)


def numpy_ddp_steps(rank, ws, steps, lr=0.1):
    """steps SGD steps of pyddp's DDP on a NumpyLinear (rank-dependent start, made rank
    0's by DDP), gradients and weights checked against the mean over every rank's
    batch computed here. Returns the DDP wrapper."""
    import pyddp
    model = NumpyLinear(seed=rank)
    ddp = pyddp.DistributedDataParallel(model)
    for step in range(steps):
        everyone = [model.grads(*inputs(r, step)) for r in range(ws)]
        model.w.grad, model.b.grad = (g.astype(p.data.dtype) for g, p in
                                      zip(everyone[rank], (model.w, model.b)))
        ddp.sync_gradients()
        for p, m in zip((model.w, model.b), (np.mean([e[k] for e in everyone], axis=0)
                                             for k in range(2))):
            np.testing.assert_allclose(p.grad, m, rtol=1e-5, atol=1e-6,
                                       err_msg=f"rank {rank} step {step}: averaged gradient")
            p.data -= (lr * p.grad).astype(p.data.dtype)
    return ddp


def run_full(rank, ws, round_, v):
    """Kind full (see the module's docstring); raises on a wrong result."""
    import pyddp
    pyddp.init_process_group("cpu", timeout=TIMEOUT)
    check_collectives(pyddp, rank, ws, round_)
    numpy_ddp_steps(rank, ws, 3)
    pyddp.destroy_process_group()


def run_torch_ddp(rank, ws, round_, v):
    """Kind torch_ddp: full with pyddp's DDP on a torch model."""
    import pyddp
    pyddp.init_process_group("cpu", timeout=TIMEOUT)
    check_collectives(pyddp, rank, ws, round_)
    torch_ddp_steps(pyddp.DistributedDataParallel, rank, ws, 3)
    pyddp.destroy_process_group()


def run_nodestroy(rank, ws, round_, v):
    """Kind nodestroy: returns with the group (and v["alive"]) still alive."""
    import pyddp
    pyddp.init_process_group("cpu", timeout=TIMEOUT)
    check_collectives(pyddp, rank, ws, round_)
    alive = v["alive"]
    if alive == "numpy_ddp":
        keep = numpy_ddp_steps(rank, ws, 1)
    elif alive == "async_work":
        keep = pyddp.all_reduce(np.ones(LARGE, np.float32), async_op=True)
    elif alive == "subgroup":
        sub = pyddp.new_group([0, 1])
        keep = [sub]
        if rank in (0, 1):
            x = np.full(SMALL, rank + 1.0)
            pyddp.all_reduce(x, group=sub)
            reference.Checker(rank).eq(x, np.full(SMALL, 3.0), "subgroup all_reduce")
            keep.append(pyddp.all_reduce(np.ones(LARGE), group=sub, async_op=True))
    else:
        keep = None
    run_nodestroy.keep = keep      # alive until the interpreter's own teardown


class BigModel:
    """Two parameters of LARGE elements (two DDP buckets), gradients set by hand."""

    def __init__(self):
        self.params = [(n, P(np.zeros(LARGE, np.float32))) for n in ("a", "b")]

    def named_parameters(self):
        return self.params

    def set_grads(self, rank):
        for _, p in self.params:
            p.grad = np.full(LARGE, rank + 1.0, np.float32)


def run_fail(rank, ws, round_, v):
    """Kind fail: rank v["failing"] fails as v says (never returns); the others return
    after their DistError, having destroyed the group if v["destroy"]."""
    import threading
    import pyddp
    pyddp.init_process_group("cpu", timeout=TIMEOUT)
    check_collectives(pyddp, rank, ws, round_)
    x = np.ones(LARGE, np.float32)
    model = BigModel()
    ddp = pyddp.DistributedDataParallel(model)

    def step():
        """One collective of the kind the round is about."""
        if v["inside"] == "ddp":
            model.set_grads(rank)
            ddp.sync_gradients()
        else:
            pyddp.all_reduce(x)

    if rank == v["failing"]:
        if v["when"] == "during":          # its share is on the way as it fails
            if v["inside"] == "ddp":
                threading.Thread(target=step, daemon=True).start()
                time.sleep(0.01)
            else:
                run_fail.keep = pyddp.all_reduce(x, async_op=True)
        else:
            time.sleep(0.3)                # the others are waiting
        if v["how"] == "raise":
            raise RuntimeError(f"rank {rank} gives up mid-collective")
        if v["how"] == "exit3":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        for _ in range(100):       # "during": the failing rank's first may still complete
            step()
        raise AssertionError(f"rank {rank}: 100 collectives succeeded without rank "
                             f"{v['failing']}")
    except pyddp.DistError as e:
        mark("RAISED", cls=type(e).__name__, secs=round(time.monotonic() - t0, 3),
             msg=str(e)[:2000])
    if v["destroy"]:
        pyddp.destroy_process_group()


def run_abandon(rank, ws, round_, v):
    """Kind abandon: ranks 0..ws-2 return with an unjoined all_reduce pending; the
    last returns after its all_reduce raised."""
    import pyddp
    pyddp.init_process_group("cpu", timeout=TIMEOUT)
    check_collectives(pyddp, rank, ws, round_)
    x = np.ones(LARGE, np.float32)
    if rank < ws - 1:
        run_abandon.keep = pyddp.all_reduce(x, async_op=True)
        return
    time.sleep(ABANDON_S)          # the others have exited meanwhile
    t0 = time.monotonic()
    try:
        pyddp.all_reduce(x)
        raise AssertionError(f"rank {rank}: all_reduce succeeded after the others exited")
    except pyddp.DistError as e:
        mark("RAISED", cls=type(e).__name__, secs=round(time.monotonic() - t0, 3),
             msg=str(e)[:2000])


def slow_sum(fut):
    """A callback chained on a torch future that is still running (GIL released, then
    torch code) as the interpreter exits."""
    time.sleep(0.2)
    return fut.value()[0].sum().item()


def run_torch(rank, ws, round_, v):
    """Kind torch: the torch backend, ended as v["end"] says."""
    import torch
    import torch.distributed as tdist
    import pyddp.torch_backend  # noqa: F401 - registers "pyddp" (the entry point may be off)
    tdist.init_process_group("pyddp", timeout=TIMEOUT)
    check_collectives(tdist, rank, ws, round_, make=torch.from_numpy,
                      as_np=lambda t: t.numpy())
    keep = [torch_ddp_steps(torch.nn.parallel.DistributedDataParallel, rank, ws, 2)]
    if v["end"] == "destroy":
        del keep
        tdist.destroy_process_group()
        return
    if v["end"] == "exit_async":       # still running as the interpreter shuts down
        time.sleep(0.2 * rank)           # (the lower ranks' ones finish meanwhile)
        for _ in range(4):
            w = tdist.all_reduce(torch.ones(LARGE), async_op=True)
            keep.append(w.get_future().then(slow_sum))
            keep.append(w)
    run_torch.keep = keep


PROGRAMS = {"full": run_full, "torch_ddp": run_torch_ddp, "nodestroy": run_nodestroy,
            "fail": run_fail, "abandon": run_abandon, "torch": run_torch}
TORCH_KINDS = ("torch_ddp", "torch")      # the others never import torch


def rank_main(kind, round_):
    """Run this process's rank of round round_ of kind, then exit the interpreter
    normally (SystemExit(0): atexit handlers and finalization run as in any script);
    an exception propagates as an uncaught one (status 1, traceback on stderr)."""
    import faulthandler
    faulthandler.enable()                              # a crash prints its stacks
    faulthandler.register(signal.SIGUSR2, all_threads=True)   # the launcher's hang dump
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    v = variant(kind, round_, ws)
    if not v["shm"]:
        os.environ["PYDDP_SHM_DISABLE"] = "1"
    os.environ["PYDDP_NSOCKS_PERPEER"] = str(v["nsocks"])
    if kind == "abandon":
        os.environ["PYDDP_EXIT_WAIT"] = str(EXIT_WAIT)
    PROGRAMS[kind](rank, ws, round_, v)
    mark("EXITING", t=time.monotonic())
    raise SystemExit(0)


# ---- the launcher --------------------------------------------------------------------

def fork_rank(kind, round_, rank, ws, port, out, err):
    """Fork rank rank of the round: the child points fd 1 and 2 at the files out and err,
    sets the rendezvous variables and runs rank_main (it never returns here: its
    SystemExit unwinds this launcher's frames, which hold no handlers, to a normal
    exit). Returns the child's pid in the parent."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(ws), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(ws), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    rank_main(kind, round_)


def reap(pids, deadline):
    """Wait for every pid until deadline (time.monotonic()); returns {pid: (exit code or
    -signal, reaped at, hung)}. At the deadline the ones still alive get SIGUSR2 (stack
    dump), a second later SIGKILL, each by its pid, and count as hung."""
    done = {}
    while len(done) < len(pids):
        for pid in pids:
            if pid in done:
                continue
            got, status = os.waitpid(pid, os.WNOHANG)
            if got:
                done[pid] = (os.waitstatus_to_exitcode(status), time.monotonic(), False)
        if len(done) < len(pids) and time.monotonic() > deadline:
            alive = [p for p in pids if p not in done]
            for sig in (signal.SIGUSR2, signal.SIGKILL):
                for pid in alive:
                    os.kill(pid, sig)
                time.sleep(1.0)
            for pid in alive:
                _, status = os.waitpid(pid, 0)
                done[pid] = (os.waitstatus_to_exitcode(status), time.monotonic(), True)
        time.sleep(0.005)
    return done


def read(path):
    with open(path, errors="replace") as f:
        return f.read()


def launch_round(kind, round_, ws, tmp):
    """Fork the round's ws ranks, reap them and return the round's report (a dict)."""
    from launch import free_port
    port = free_port()
    files = [(os.path.join(tmp, f"{rank}.out"), os.path.join(tmp, f"{rank}.err"))
             for rank in range(ws)]
    t0 = time.monotonic()
    pids = [fork_rank(kind, round_, rank, ws, port, *files[rank]) for rank in range(ws)]
    done = reap(pids, t0 + ROUND_S)
    ranks = []
    for rank, pid in enumerate(pids):
        status, reaped, hung = done[pid]
        out, err = read(files[rank][0]), read(files[rank][1])
        marks = [ln for ln in out.splitlines() if ln.split(" ", 1)[0] in ("EXITING", "RAISED")]
        exiting = [json.loads(ln.split(" ", 1)[1])["t"] for ln in marks
                   if ln.startswith("EXITING ")]
        ranks.append({"rank": rank, "status": status, "hung": hung, "stderr": err,
                      "marks": marks, "stdout_tail": out[-2000:],
                      "exit_s": round(reaped - exiting[0], 3) if exiting else None})
        for path in files[rank]:
            os.unlink(path)
    return {"round": round_, "kind": kind, "variant": variant(kind, round_, ws),
            "seconds": round(time.monotonic() - t0, 3), "ranks": ranks}


def launcher(kind, rounds, ws):
    """Import what the ranks use (torch only for TORCH_KINDS), then run and report
    rounds 0..rounds-1 of kind."""
    import pyddp  # noqa: F401 - imported once here, inherited by every fork
    import pyddp.ddp  # noqa: F401
    if kind in TORCH_KINDS:
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401
        import pyddp.ddp._torch  # noqa: F401
        import pyddp.torch_backend  # noqa: F401
        import torch.nn.parallel  # noqa: F401
        model = torch_model(seed=0)     # torch's lazy set-up (autograd, the optimizers'
        torch_grads(model, *inputs(0, 0))      # torch._dynamo import), done once here
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    threads = len(os.listdir("/proc/self/task"))
    assert threads == 1, f"the launcher has {threads} threads: forking it is not safe"
    gc.freeze()     # the imports' objects: no collection (nor copy-on-write) walks them
    tmp = tempfile.mkdtemp(prefix="pyddp-exits-")
    for round_ in range(rounds):
        print("ROUND " + json.dumps(launch_round(kind, round_, ws, tmp)), flush=True)
    os.rmdir(tmp)
    print("DONE", flush=True)


def main():
    args = sys.argv[1:]
    if args[0] == "launch":
        ws = int(args[args.index("--world") + 1]) if "--world" in args else 3
        launcher(args[1], int(args[2]), ws)
    else:
        rank_main(args[1], int(args[2]))


if __name__ == "__main__":
    main()
