"""The rank side of benchmarks/scale.py: Python ranks of pyddp, and torch gloo ranks.

Not run by hand: scale.py starts it with three pipes whose read ends are "gates" and
one pipe to report on, their descriptors given as arguments. A gate opens when the
launcher writes a byte to it; every rank polls the same pipe without reading it, so
one write releases them all at once. Ranks report one line each (shorter than
PIPE_BUF, so lines from many processes never interleave) on the report pipe:

    ready <rank> <pid>                       at the first gate, the library imported
    init <rank> <t_done> [<cpu_s>]           init finished (time.monotonic(), which is
                                             the same clock in every process), and the
                                             CPU time init took in this process (all
                                             its threads; forked ranks only)
    done <rank> <first_s> <steady_s>         after the all-reduces (first, median)
    fail <rank> <message>                    any failure (then the rank exits)

The gates: 0 start (init begins), 1 inited (the first all-reduce begins on every rank
at once), 2 exit (the launcher has counted the ranks' sockets; tear down).

Modes:
  pyddp-fork N ITERS TIMEOUT_S G0 G1 G2 REP   a zygote: imports pyddp once and forks
        N ranks, each its own process (what import costs is not what is measured, and
        forked ranks share the imported pages, so hundreds fit); each rank sets RANK
        and WORLD_SIZE and calls pyddp.init_process_group() the env:// way against the
        store the launcher hosts at MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE
        =True: as under torchrun, no rank hosts it); with PYDDP_RDZV_STORE=etcd://...
        (benchmarks/elastic.py's init part) the store is that etcd cluster instead, in
        the namespace of TORCHELASTIC_RUN_ID, as for a worker of pyddp's rendezvous.
  gloo-fork N ITERS TIMEOUT_S G0 G1 G2 REP    the same for torch's gloo: a zygote imports
        torch and torch.distributed once and forks N ranks; each sets RANK and
        WORLD_SIZE and calls torch.distributed.init_process_group("gloo",
        init_method="env://", timeout=...) against the torch TCPStore the launcher hosts
        at MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True: every rank a
        client; TORCH_GLOO_LAZY_INIT=1 is set by the launcher), then dist.all_reduce.
  gloo FIRST COUNT N ITERS TIMEOUT_S G0 G1 G2 REP   (scale.py --gloo-threads-mode, not
        like-for-like) ranks FIRST..FIRST+COUNT-1 of N as threads of this process, each
        with its own torch TCPStore client (connected before the first gate, so not in
        the init time) and a torch.distributed.ProcessGroupGloo(store, rank, N, timeout).

With SCALE_STORE_FIRST=1 (scale.py --store-first) the forked ranks of either library
connect their store client before the first gate and pass it to init_process_group
(store=, rank=, world_size=): init is then timed without the store connection.

Both zygotes check that they run a single thread when they fork (a thread in the zygote
would be missing, with whatever lock it held, in every rank), and call gc.freeze() first
so that the ranks' garbage collections do not write to (and so copy) the shared pages.
"""
import gc
import os
import select
import statistics
import sys
import threading
import time
from datetime import timedelta
from types import SimpleNamespace


def wait_gate(fd, timeout_s):
    """Block until gate fd opens (readable); raise TimeoutError after timeout_s."""
    r, _, _ = select.select([fd], [], [], timeout_s)
    if not r:
        raise TimeoutError(f"gate (fd {fd}) not opened within {timeout_s:.0f} s")


def report(fd, line):
    """Write one line to the report pipe in one write (atomic under PIPE_BUF)."""
    data = (line.replace("\n", " ")[:3000] + "\n").encode()
    os.write(fd, data)


def timed_allreduces(one, iters):
    """(first, median of the next iters) durations in seconds of calling one()."""
    t0 = time.perf_counter()
    one()
    first = time.perf_counter() - t0
    steady = []
    for _ in range(iters):
        t0 = time.perf_counter()
        one()
        steady.append(time.perf_counter() - t0)
    return first, statistics.median(steady) if steady else 0.0


def forked_rank(rank, n, iters, timeout_s, gates, rep, lib):
    """One rank in a forked process, either library alike: gate, lib.init(), gate, the
    timed 8-byte all-reduces (lib.zeros, lib.all_reduce, lib.value), gate, lib.destroy().
    With SCALE_STORE_FIRST=1 the rank connects its store client (lib.connect) before
    the first gate and hands it to lib.init, so init is timed without it."""
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(n)
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = "0", "1"
    t = timedelta(seconds=timeout_s)
    store = lib.connect(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), t) \
        if os.environ.get("SCALE_STORE_FIRST") == "1" else None
    report(rep, f"ready {rank} {os.getpid()}")
    wait_gate(gates[0], timeout_s)
    cpu = time.process_time()
    lib.init(t, store, rank, n)
    report(rep, f"init {rank} {time.monotonic():.6f} {time.process_time() - cpu:.6f}")
    wait_gate(gates[1], timeout_s)
    x = lib.zeros()
    want = n * (n - 1) / 2

    def one():
        x[0] = rank
        lib.all_reduce(x)
        if lib.value(x) != want:
            raise AssertionError(f"all-reduce gave {lib.value(x)}, expected {want}")
    first, steady = timed_allreduces(one, iters)
    report(rep, f"done {rank} {first:.6f} {steady:.6f}")
    wait_gate(gates[2], timeout_s)
    lib.destroy()


def pyddp_rank(rank, n, iters, timeout_s, gates, rep):
    """One pyddp rank: init_process_group("cpu") the env:// way, or with its store (a
    TCPStore client, or an EtcdStore) passed in."""
    import numpy as np
    import pyddp
    def init(t, store, rank, n):
        if store is None:
            pyddp.init_process_group("cpu", timeout=t)
        else:
            pyddp.init_process_group("cpu", timeout=t, store=store, rank=rank, world_size=n)
    def connect(host, port, t):
        etcd = os.environ.get("PYDDP_RDZV_STORE", "")
        if etcd.startswith("etcd://"):          # the job's store a torchrun worker gets
            from pyddp._rendezvous import job_namespace
            return pyddp.EtcdStore(etcd, job_namespace(os.environ["TORCHELASTIC_RUN_ID"]),
                                   timeout=t)
        return pyddp.TCPStore(host, port, timeout=t)
    lib = SimpleNamespace(init=init, connect=connect,
                          zeros=lambda: np.zeros(1, dtype=np.float64),
                          all_reduce=pyddp.all_reduce, value=lambda x: float(x[0]),
                          destroy=pyddp.destroy_process_group)
    forked_rank(rank, n, iters, timeout_s, gates, rep, lib)


def gloo_rank(rank, n, iters, timeout_s, gates, rep):
    """One gloo rank: torch's init_process_group("gloo", init_method="env://")."""
    import torch
    import torch.distributed as dist
    def init(t, store, rank, n):
        if store is None:
            dist.init_process_group("gloo", init_method="env://", timeout=t)
        else:
            dist.init_process_group("gloo", timeout=t, store=store, rank=rank, world_size=n)
    lib = SimpleNamespace(
        init=init, zeros=lambda: torch.zeros(1, dtype=torch.float64),
        connect=lambda h, p, t: dist.TCPStore(h, p, None, False, timeout=t,
                                              wait_for_workers=False),
        all_reduce=lambda x: dist.all_reduce(x, op=dist.ReduceOp.SUM),
        value=lambda x: x.item(), destroy=dist.destroy_process_group)
    forked_rank(rank, n, iters, timeout_s, gates, rep, lib)


def threads_now():
    """The number of threads of this process."""
    return len(os.listdir("/proc/self/task"))


def run_fork(args, mods, rank_fn):
    """The zygote: import mods, fork N ranks running rank_fn, wait for them (each bounded
    by its gates' deadlines; the launcher kills them by pid besides)."""
    n, iters, timeout_s = int(args[0]), int(args[1]), float(args[2])
    gates, rep = [int(a) for a in args[3:6]], int(args[6])
    for mod in mods:   # imported once here, shared by the forked ranks
        __import__(mod)
    if "torch" in mods:
        import torch
        torch.get_num_threads()   # must not start a pool (OMP_NUM_THREADS=1 is set)
    k = threads_now()
    if k != 1:
        report(rep, f"fail zygote: {k} threads before forking (must be 1)")
        sys.exit(1)
    gc.collect()
    gc.freeze()   # the ranks' collections then leave the shared pages unwritten
    pids = []
    for rank in range(n):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                rank_fn(rank, n, iters, timeout_s, gates, rep)
            except BaseException as e:  # noqa: BLE001 - reported, then the rank exits
                report(rep, f"fail {rank} {type(e).__name__}: {e}")
                code = 1
            os._exit(code)
        pids.append(pid)
    # Each rank is bounded by its gates' deadlines; past all three, kill what is left.
    deadline = time.monotonic() + 3 * timeout_s + 60
    left = set(pids)
    while left and time.monotonic() < deadline:
        for pid in list(left):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                left.discard(pid)
        time.sleep(0.05)
    for pid in left:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def run_gloo(args):
    """Ranks FIRST..FIRST+COUNT-1 of a gloo world of N as threads of this process."""
    first_rank, count, n, iters = int(args[0]), int(args[1]), int(args[2]), int(args[3])
    timeout_s = float(args[4])
    gates, rep = [int(a) for a in args[5:8]], int(args[8])
    import torch
    import torch.distributed as dist
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    td = timedelta(seconds=timeout_s)
    want = n * (n - 1) / 2

    def rank_body(rank):
        try:
            # Connected before the gate: torch's client looks its own address up in
            # DNS, which takes seconds where no DNS server answers (as here).
            store = dist.TCPStore(host, port, None, False, timeout=td, wait_for_workers=False)
            report(rep, f"ready {rank} {os.getpid()}")
            wait_gate(gates[0], timeout_s)
            pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, n, td)
            report(rep, f"init {rank} {time.monotonic():.6f}")
            wait_gate(gates[1], timeout_s)
            x = torch.zeros(1, dtype=torch.float64)

            def one():
                x[0] = rank
                pg.allreduce([x]).wait(td)
                if x.item() != want:
                    raise AssertionError(f"all-reduce gave {x.item()}, expected {want}")
            f, s = timed_allreduces(one, iters)
            report(rep, f"done {rank} {f:.6f} {s:.6f}")
            wait_gate(gates[2], timeout_s)
        except BaseException as e:  # noqa: BLE001 - reported to the launcher
            report(rep, f"fail {rank} {type(e).__name__}: {e}")
    threads = [threading.Thread(target=rank_body, args=(r,), daemon=True)
               for r in range(first_rank, first_rank + count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 4)
    os._exit(0)   # gloo's threads are not joined: the launcher has what it needs


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "pyddp-fork":
        run_fork(sys.argv[2:], ("numpy", "pyddp"), pyddp_rank)
    elif mode == "gloo-fork":
        run_fork(sys.argv[2:], ("torch", "torch.distributed"), gloo_rank)
    elif mode == "gloo":
        run_gloo(sys.argv[2:])
    else:
        sys.exit(f"scale_worker: unknown mode {mode!r}")
