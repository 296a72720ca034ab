"""nccl-tests-style benchmark of pyddp's CPU collectives: ``python -m pyddp.bench``.

Run it under torchrun (or with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set)::

    torchrun --nproc-per-node=2 -m pyddp.bench -e 64M --compare-gloo

For each collective (all_reduce, all_gather, reduce_scatter, broadcast) and each size
from -b to -e (multiplying by -f), rank 0 prints a row in nccl-tests' terms: size in
bytes, element count, dtype, reduction, root, time per call in microseconds (the slowest
rank's), algorithm bandwidth (size / time) and bus bandwidth (algbw times the
collective's traffic factor: 2(n-1)/n for all_reduce, (n-1)/n for all_gather and
reduce_scatter, 1 for broadcast), and #wrong: after timing, each size runs once more
on patterned data and counts the elements that differ from a NumPy reference.

``--compare-gloo`` also initialises torch's gloo backend in the same processes, over
the same buffers, and alternates rounds of the two (pyddp, gloo, pyddp, gloo, ...) so
machine noise hits both alike; every round starts after a barrier (so no round is
charged with bytes of the one before still crossing a slow link, which a broadcast's
root or an early finisher would otherwise leave behind); each side's time is the
median of its rounds, and the last column is pyddp's busbw over gloo's.
``--tcp-stream`` first measures one plain TCP stream from rank 1 to rank 0 over the
address pyddp uses, as the yardstick for links between hosts. The timed buffers are the same every iteration (results of one
call feed the next), as in nccl-tests; the numbers measure transport and reduction,
never Python-side copies.

``--json FILE`` has rank 0 also write the run's numbers (the header's facts and every
row, as ``run_info`` and ``row_values`` give them) to FILE; ``--plot FILE.png`` has it
draw bus bandwidth against message size from them (pyddp/bench_plot.py, which needs
matplotlib: the ``plot`` extra), and ``python -m pyddp.bench_plot FILE.json FILE.png``
redraws it from the saved file.
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time

import numpy as np

import pyddp as dist
from pyddp import _C

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
BUSBW_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
                "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}
REDOPS = {"sum": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX", "avg": "AVG"}
NP_REDUCE = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
             "avg": np.add}
DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64")
CHECK_SLICE = 1 << 22   # elements compared per step, so checks of 256 MiB stay small
# Bytes each host must send at least, per byte of the collective's size, for h hosts
# (h >= 2): what bounds a row when the links between hosts are the limit.
HOST_FACTOR = {"all_reduce": lambda h: 2 * (h - 1) / h, "all_gather": lambda h: (h - 1) / h,
               "reduce_scatter": lambda h: (h - 1) / h, "broadcast": lambda h: 1.0}
FLAT_GROUP = [None]     # --compare-flat: the all-ranks group with the flat ring forced


def parse_size(text):
    """'8', '64K', '256M', '1G' -> bytes."""
    t = text.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m pyddp.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-b", "--minbytes", type=parse_size, default=8, help="smallest size (8)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=256 << 20,
                   help="largest size (256M); lower it to cap memory and time")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="size multiplier (2)")
    p.add_argument("-d", "--datatype", choices=DTYPES, default="float32")
    p.add_argument("-o", "--op", choices=sorted(REDOPS), default="sum")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated collectives")
    p.add_argument("-w", "--warmup_iters", type=int, default=2)
    p.add_argument("-r", "--rounds", type=int, default=3,
                   help="timed rounds per size and backend (the median is reported)")
    p.add_argument("-t", "--round_ms", type=float, default=40.0,
                   help="target length of a round; sets iterations per round")
    p.add_argument("-n", "--max_iters", type=int, default=1000)
    p.add_argument("-c", "--check", type=int, default=1, help="check results (1) or not (0)")
    p.add_argument("--compare-gloo", action="store_true",
                   help="also run torch's gloo backend in the same processes, interleaved")
    p.add_argument("--compare-flat", action="store_true",
                   help="also time pyddp with the flat ring forced (a second group, "
                   "pg_options={'algo': 'flat'}), alternating with the default choice, and "
                   "print the bandwidth the host links allow for each row")
    p.add_argument("--tcp-stream", action="store_true",
                   help="measure one plain TCP stream to rank 0 first (yardstick)")
    p.add_argument("--stream-bytes", type=parse_size, default=1 << 30,
                   help="bytes the TCP stream moves (1G)")
    p.add_argument("--stream-peer", type=int, default=1,
                   help="rank that streams to rank 0 (1); pick one on another host")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="rank 0 also writes the header's facts and every row to FILE (JSON)")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="rank 0 draws busbw against size to FILE.png after the run "
                   "(needs matplotlib: pip install 'pyddp[plot]')")
    a = p.parse_args(argv)
    a.ops = [o.strip() for o in a.ops.split(",") if o.strip()]
    if a.stream_peer < 1:
        p.error("--stream-peer must be a rank other than 0")
    bad = [o for o in a.ops if o not in OPS]
    if bad:
        p.error(f"unknown collective(s) {bad}; choose from {', '.join(OPS)}")
    if a.compare_gloo and a.op == "avg":
        p.error("gloo has no AVG reduction; compare with another --op")
    if a.minbytes < 1 or a.maxbytes < a.minbytes or a.stepfactor < 2:
        p.error("need 1 <= minbytes <= maxbytes and stepfactor >= 2")
    return a


# ---- buffers and reference values -------------------------------------------------

def make_array(n, dtype, fill=0):
    """n elements of dtype as a NumPy array (bfloat16: a torch tensor), written once so
    every page is real memory (np.zeros would map the shared zero page)."""
    if dtype == "bfloat16":
        import torch
        return torch.full((n,), fill, dtype=torch.bfloat16)
    a = np.empty(n, dtype=dtype)
    a.fill(fill)
    return a


def as_numpy64(x):
    if hasattr(x, "numpy"):
        return x.float().numpy().astype(np.float64)
    return x.astype(np.float64)


def pattern(rank, start, n):
    """Rank r's input at elements [start, start+n): small positive integers, so sums,
    products, minima and maxima are exact in every dtype for a handful of ranks."""
    i = np.arange(start, start + n, dtype=np.int64)
    return ((i + 3 * rank) % 5 + 1).astype(np.float64)


def fill_pattern(x, rank):
    for s in range(0, len(x), CHECK_SLICE):
        v = pattern(rank, s, min(CHECK_SLICE, len(x) - s))
        if hasattr(x, "numpy"):
            import torch
            x[s:s + len(v)] = torch.from_numpy(v)
        else:
            x[s:s + len(v)] = v


def reference(op, world, start, n, dtype):
    """The reduction over all ranks of elements [start, start+n), in float64, rounded as
    pyddp defines it (AVG: exact division for floats, the floor of the exact mean for
    integers)."""
    acc = pattern(0, start, n)
    for r in range(1, world):
        acc = NP_REDUCE[op](acc, pattern(r, start, n))
    if dtype.startswith("int") or dtype.startswith("uint"):
        info = np.iinfo(dtype)
        if op == "avg":
            acc = np.floor(acc / world)
        # Integer products wrap as C arithmetic does.
        acc = ((acc.astype(np.int64) - info.min) % (1 << info.bits) + info.min).astype(np.float64)
    elif op == "avg":
        acc = acc / world
    return acc


def count_wrong(got, want, dtype):
    tol = {"float16": 1e-3, "bfloat16": 1e-2}.get(dtype, 1e-6)
    return int(np.count_nonzero(~np.isclose(got, want, rtol=tol, atol=0)))


# ---- one collective on either backend --------------------------------------------

class Case:
    """Buffers and calls for one collective at one size. Buffers are shared by both
    backends (gloo gets torch views of the same memory)."""

    def __init__(self, name, nbytes, args, world, rank):
        self.name, self.world, self.rank, self.dtype = name, world, rank, args.datatype
        es = 2 if self.dtype == "bfloat16" else np.dtype(self.dtype).itemsize
        total = max(1, nbytes // es)
        self.per = None
        if name in ("all_gather", "reduce_scatter"):
            self.per = max(1, total // world)
            total = self.per * world
        self.count, self.nbytes = total, total * es
        self.op = args.op if name in ("all_reduce", "reduce_scatter") else None
        big = make_array(total, self.dtype)
        small = make_array(self.per, self.dtype) if name in ("all_gather", "reduce_scatter") else None
        self.bufs = (big, small)
        self.tbufs = None

    def run(self, backend):
        """One call on backend "pyddp" (the default group), "flat" (pyddp with the
        flat ring forced: FLAT_GROUP) or "gloo"."""
        big, small = self.tbufs if backend == "gloo" else self.bufs
        m = self.tdist if backend == "gloo" else dist
        kw = {"group": FLAT_GROUP[0]} if backend == "flat" else {}
        op = getattr(m.ReduceOp, REDOPS[self.op]) if self.op else None
        if self.name == "all_reduce":
            m.all_reduce(big, op=op, **kw)
        elif self.name == "all_gather":
            m.all_gather_into_tensor(big, small, **kw)
        elif self.name == "reduce_scatter":
            m.reduce_scatter_tensor(small, big, op=op, **kw)
        else:
            m.broadcast(big, src=0, **kw)

    def attach_torch(self, tdist):
        import torch
        self.tdist = tdist
        self.tbufs = tuple(None if b is None else
                           (b if isinstance(b, torch.Tensor) else torch.from_numpy(b))
                           for b in self.bufs)

    def check(self, backend):
        """Run once on patterned inputs; return the number of wrong elements."""
        big, small = self.bufs
        if self.name == "all_gather":
            fill_pattern(small, self.rank)
        elif self.name == "broadcast":
            fill_pattern(big, 0) if self.rank == 0 else fill_pattern(big, 1)
        else:
            fill_pattern(big, self.rank)
        self.run(backend)
        wrong = 0
        out = small if self.name == "reduce_scatter" else big
        got_all = as_numpy64(out)
        for s in range(0, len(got_all), CHECK_SLICE):
            n = min(CHECK_SLICE, len(got_all) - s)
            if self.name == "all_reduce":
                want = reference(self.op, self.world, s, n, self.dtype)
            elif self.name == "reduce_scatter":
                want = reference(self.op, self.world, self.rank * self.per + s, n, self.dtype)
            elif self.name == "all_gather":
                idx = np.arange(s, s + n)
                want = ((idx % self.per + 3 * (idx // self.per)) % 5 + 1).astype(np.float64)
            else:
                want = pattern(0, s, n)
            wrong += count_wrong(got_all[s:s + n], want, self.dtype)
        return wrong


# ---- timing -------------------------------------------------------------------------

def world_max(values):
    """Element-wise maximum over ranks (a small pyddp all_reduce, outside timed code)."""
    a = np.asarray(values, dtype=np.float64)
    dist.all_reduce(a, op=dist.ReduceOp.MAX)
    return a


def time_rounds(case, backends, args):
    """Warm up each backend, agree on iterations per round, then alternate timed rounds
    between backends, each round after a barrier. Returns {backend: median seconds per
    call, slowest rank}."""
    est = []
    for b in backends:
        t0 = time.perf_counter()
        for _ in range(max(1, args.warmup_iters)):
            case.run(b)
        est.append((time.perf_counter() - t0) / max(1, args.warmup_iters))
    est = world_max(est)
    iters = [int(min(args.max_iters, max(1, args.round_ms / 1e3 / max(e, 1e-7)))) for e in est]
    per_round = {b: [] for b in backends}
    for _ in range(args.rounds):
        for b, it in zip(backends, iters):
            # Every rank starts the round with the links idle: without the barrier, a
            # rank that left the previous round early (a broadcast's root, gloo's first
            # receivers) would time the previous backend's bytes still in flight too.
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(it):
                case.run(b)
            per_round[b].append((time.perf_counter() - t0) / it)
    rounds = world_max([x for b in backends for x in per_round[b]])
    k = args.rounds
    return {b: statistics.median(rounds[i * k:(i + 1) * k]) for i, b in enumerate(backends)}


def sizes(args):
    s = args.minbytes
    while s <= args.maxbytes:
        yield s
        s *= args.stepfactor


# ---- a single TCP stream (the yardstick between hosts) ------------------------------

def tcp_stream(args, rank, world):
    """GB/s of one TCP connection moving args.stream_bytes from rank args.stream_peer to
    rank 0 over the address pyddp advertises, with large socket buffers, as a plain
    sendall/recv_into pair would do it (the best a single stream does on this link)."""
    from pyddp import _env
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    addr = [None]
    if rank == 0:
        host = _env.advertise_address(os.environ.get("MASTER_ADDR") or None)
        srv = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        srv.bind((host, 0))
        srv.listen(1)
        addr = [(host, srv.getsockname()[1])]
    dist.broadcast_object_list(addr, src=0)
    elapsed = 0.0
    if rank == 0:
        srv.settimeout(60)
        conn, _ = srv.accept()
        conn.settimeout(120)
        got, t0 = 0, None
        while got < args.stream_bytes:
            k = conn.recv_into(view)
            if k == 0:
                raise RuntimeError("TCP stream: the sender closed early")
            if t0 is None:
                t0 = time.perf_counter()
            got += k
        elapsed = time.perf_counter() - t0
        conn.sendall(b"k")
        conn.close()
        srv.close()
    elif rank == args.stream_peer:
        c = socket.create_connection(addr[0], timeout=60)
        c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        left = args.stream_bytes
        while left > 0:
            k = min(left, len(buf))
            c.sendall(view[:k])
            left -= k
        c.recv(1)
        c.close()
    dist.barrier()
    return args.stream_bytes / elapsed / 1e9 if rank == 0 else 0.0


# ---- main ---------------------------------------------------------------------------

def init_gloo(rank, world):
    """torch's gloo in the same processes, rendezvousing through pyddp's store server
    (or torchrun's agent store) under its own key prefix."""
    import warnings
    import torch.distributed as tdist
    # torch suggests *_single for the *_tensor names it is compared under; not our concern
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use", category=FutureWarning)
    from pyddp._group import _State
    st = tdist.TCPStore(_State.store.host, _State.store.port, is_master=False,
                        wait_for_workers=False)
    tdist.init_process_group("gloo", store=tdist.PrefixStore("pyddp_bench_gloo", st),
                             rank=rank, world_size=world)
    return tdist


def run_info(args, world, backends, stream, hosts):
    """The run's facts, as the header prints them and --json saves them: world, hosts,
    dtype, op, rounds, host (its name), cpus, shm ("on"/"off"), nsocks (as set; "1" when
    not), algo and hier_min_bytes (PYDDP_ALGO and PYDDP_HIER_MIN_BYTES as the core reads
    them: what "pyddp" chose from), backends (the timed variants in column order:
    "pyddp", then "flat" with --compare-flat, then "gloo" with --compare-gloo),
    stream_gbps (one TCP stream's GB/s; 0.0 without --tcp-stream), stream_peer and
    loadavg (rank 0's host's 1-minute load average as the rows start)."""
    return {"world": world, "hosts": hosts, "dtype": args.datatype, "op": args.op,
            "rounds": args.rounds, "host": socket.gethostname(), "cpus": os.cpu_count(),
            "shm": "off" if _C.setting("PYDDP_SHM_DISABLE") else "on",
            "nsocks": _C.setting_text("PYDDP_NSOCKS_PERPEER") or "1",
            "algo": _C.setting("PYDDP_ALGO") or "auto",
            "hier_min_bytes": _C.setting("PYDDP_HIER_MIN_BYTES"),
            "backends": list(backends), "stream_gbps": stream, "stream_peer": args.stream_peer,
            "loadavg": os.getloadavg()[0]}


def header(info):
    """Rank 0's comment lines above the rows, from run_info's dict."""
    backends, stream, hosts = info["backends"], info["stream_gbps"], info["hosts"]
    lines = [f"# pyddp.bench: {info['world']} ranks on {hosts} host(s), dtype {info['dtype']}, "
             f"op {info['op']}, {info['rounds']} rounds per size (median), host {info['host']}, "
             f"{info['cpus']} CPUs, shm {info['shm']}, nsocks {info['nsocks']}"]
    if stream:
        lines.append(f"# single TCP stream rank {info['stream_peer']} -> rank 0: "
                     f"{stream:.3f} GB/s")
    if "flat" in backends:
        lines.append("# pyddp: the algorithm pyddp picks (PYDDP_ALGO, default auto); flat: the "
                     "flat ring forced")
    if stream and hosts > 1:
        lines.append("# bound: the busbw at which each host sends the least it must "
                     "(2(h-1)/h of the size for all_reduce) at the single-stream rate")
    cols = f"{'collective':>14} {'size(B)':>11} {'count':>10} {'type':>8} {'redop':>5} {'root':>4}"
    side = f" {'time(us)':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
    units = f"{'(us)':>11}{'(GB/s)':>8}{'(GB/s)':>8}{'':7}"
    extra = "".join(f" {b + '/gloo':>10}" for b in backends if b != "gloo" and "gloo" in backends)
    extra += " %stream" if stream else ""
    extra += f" {'bound':>7}" if stream and hosts > 1 else ""
    if len(backends) > 1:
        lines.append(f"#{'':58} |" + "|".join(f"{b:^33}" for b in backends) + "|")
        lines.append("#" + cols[1:] + " |" + " |".join(side for _ in backends) + " |" + extra)
        lines.append(f"#{'':58} |" + "|".join(units for _ in backends) + "|")
    else:
        lines.append("#" + cols[1:] + side + extra)
        lines.append(f"#{'':58}{units}")
    return "\n".join(lines)


def count_hosts():
    """How many distinct hosts (host identities) the job's ranks are on."""
    from pyddp import _env
    ids = [None] * dist.get_world_size()
    dist.all_gather_object(ids, _env.host_identity())
    return len(set(ids))


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    dist.init_process_group("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.plot:
        require_plotting(rank)
    tdist = init_gloo(rank, world) if args.compare_gloo else None
    if args.tcp_stream and not 1 <= args.stream_peer < world:
        raise SystemExit(f"--stream-peer {args.stream_peer} is not a rank of this "
                         f"{world}-rank job")
    stream = tcp_stream(args, rank, world) if args.tcp_stream else 0.0
    hosts = count_hosts()
    backends = ["pyddp"] + (["flat"] if args.compare_flat else []) + (["gloo"] if tdist else [])
    if args.compare_flat:
        FLAT_GROUP[0] = dist.new_group(pg_options={"algo": "flat"})
    info = run_info(args, world, backends, stream, hosts)
    if rank == 0:
        print(header(info), flush=True)
    failed, rows = 0, []
    for name in args.ops:
        for nbytes in sizes(args):
            case = Case(name, nbytes, args, world, rank)
            if tdist:
                case.attach_torch(tdist)
            times = time_rounds(case, backends, args)
            wrong = [case.check(b) if args.check else 0 for b in backends]
            wrong = world_max(wrong)   # a wrong element anywhere counts
            failed += int(wrong[0] > 0)
            if rank == 0:
                rows.append(row_values(case, times, wrong, backends, world, stream, hosts))
                print(row(rows[-1]), flush=True)
            del case
    if tdist:
        tdist.destroy_process_group()
    dist.destroy_process_group()
    if failed and rank == 0:
        print(f"# {failed} size(s) gave wrong results", flush=True)
    if rank == 0:
        save(dict(info, rows=rows), args)
    return 1 if failed else 0


def require_plotting(rank):
    """With --plot: stop every rank, before anything is timed, when rank 0 (the one that
    draws) cannot import matplotlib, with bench_plot's message naming the extra."""
    problem = [None]
    if rank == 0:
        from pyddp import bench_plot
        problem = [bench_plot.missing_matplotlib()]
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        dist.destroy_process_group()
        raise SystemExit(problem[0] if rank == 0 else 1)


def save(results, args):
    """Rank 0, after the run: write results (run_info's dict plus "rows", a list of
    row_values' dicts) to --json, and draw them to --plot."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")
        print(f"# wrote {args.json}", flush=True)
    if args.plot:
        from pyddp import bench_plot
        bench_plot.plot(results, args.plot)
        print(f"# wrote {args.plot}", flush=True)


def row_values(case, times, wrong, backends, world, stream, hosts):
    """One row's numbers, as --json saves them and row() prints them: collective, size
    (bytes), count, type, redop, root, backends ({variant: {time_us, algbw, busbw (GB/s),
    wrong}} in column order), vs_gloo ({variant: its busbw over gloo's, None where
    gloo's is 0}; only with gloo), pct_stream (pyddp's busbw in % of one TCP stream;
    only with --tcp-stream) and bound (the busbw the host links allow; only across
    hosts with --tcp-stream)."""
    v = {"collective": case.name, "size": case.nbytes, "count": case.count,
         "type": case.dtype, "redop": case.op or "none",
         "root": 0 if case.name == "broadcast" else -1, "backends": {}}
    for i, b in enumerate(backends):
        alg = case.nbytes / times[b] / 1e9
        v["backends"][b] = {"time_us": times[b] * 1e6, "algbw": alg,
                            "busbw": alg * BUSBW_FACTOR[case.name](world),
                            "wrong": int(wrong[i])}
    bus = {b: x["busbw"] for b, x in v["backends"].items()}
    if "gloo" in backends:
        v["vs_gloo"] = {b: (bus[b] / bus["gloo"] if bus["gloo"] > 0 else None)
                        for b in backends if b != "gloo"}
    if stream:
        v["pct_stream"] = 100 * bus["pyddp"] / stream
    if stream and hosts > 1:
        # time if each host sent only its minimum at the stream rate, as a busbw
        t_min = HOST_FACTOR[case.name](hosts) * case.nbytes / (stream * 1e9)
        v["bound"] = case.nbytes / t_min / 1e9 * BUSBW_FACTOR[case.name](world)
    return v


def row(v):
    """Rank 0's printed line for row_values' dict v."""
    multi = len(v["backends"]) > 1
    s = (f"{v['collective']:>14} {v['size']:>11} {v['count']:>10} {v['type']:>8} "
         f"{v['redop']:>5} {v['root']:>4}")
    for x in v["backends"].values():
        s += (" |" if multi else "") + \
            f" {x['time_us']:>10.1f} {x['algbw']:>7.3f} {x['busbw']:>7.3f} {x['wrong']:>6}"
    if multi:
        s += " |"
    for r in v.get("vs_gloo", {}).values():
        s += f" {r:>9.2f}x" if r is not None else f" {'-':>10}"
    if "pct_stream" in v:
        s += f" {v['pct_stream']:>6.0f}%"
    if "bound" in v:
        s += f" {v['bound']:>7.3f}"
    return s


if __name__ == "__main__":
    sys.exit(main())
