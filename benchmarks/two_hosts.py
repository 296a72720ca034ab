"""Two "hosts" joined by a veth link (network namespaces): pyddp against gloo and
against one plain TCP stream over the same link, in one run.

    sudo python benchmarks/two_hosts.py                  # 1 rank per host, 8 B .. 256 MiB
    sudo python benchmarks/two_hosts.py --per-host 2 -- -e 64M --ops all_reduce
    sudo python benchmarks/two_hosts.py --rate 2gbit       # the link, not the CPU, limits
    sudo python benchmarks/two_hosts.py --per-host 1,2,4 --rate 512mbit,2gbit \
        -- -b 1M -e 64M -f 4 --ops all_reduce --compare-flat   # hierarchical vs flat vs gloo
    sudo python benchmarks/two_hosts.py --per-host 4 --rate 512mbit \
        -- -b 1M -e 64M -f 4 --ops all_reduce,broadcast --compare-flat -r 5  # 2 x 4 ranks
    sudo python benchmarks/two_hosts.py --per-host 2 --rate 512mbit --ddp-step -- --hidden 2048
    sudo python benchmarks/two_hosts.py --flow-rate 2gbit --nsocks 1,2,4 -- -b 1M -e 64M \
        --ops all_reduce                                   # a cloud's per-flow cap

Creates two network namespaces with a veth pair between them (tests/netns.py; needs root
and iproute2), starts the ranks in them with plain RANK/WORLD_SIZE/MASTER_* variables
(rank 0's namespace hosts the store), runs ``pyddp.bench --tcp-stream --compare-gloo``
and prints rank 0's table. ``--per-host`` and ``--rate`` take comma-separated lists: one
run (and table) per combination, fresh namespaces each. With ``--compare-flat`` (a
pyddp.bench option) each table has pyddp's own choice (hierarchical when a host has
several ranks), the flat ring and gloo side by side, and the busbw the host link allows
(its single-stream rate). The namespaces are removed afterwards.

``--ddp-step`` runs benchmarks/ddp_step.py's part 4 instead: pyddp's DDP step with
float32 gradients against the same step with ``reduce_dtype`` (``--reduce-dtype``,
bfloat16), side by side (arguments after ``--`` go to ddp_step.py, e.g. ``--hidden 2048
--steps 3``).

``--nsocks 1,2,4`` runs the bench once per value of PYDDP_NSOCKS_PERPEER instead (each
run its own job, ``--cycles`` times in turn so noise hits every value alike; no gloo)
and prints one table: each value's bus bandwidth (median over the cycles) and its
ratio to the first value's. ``--flow-rate`` caps each TCP flow rather than the link
(tests/netns.py), as clouds do.
"""
import argparse
import os
import re
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from launch import spawn_ranks  # noqa: E402
from netns import NetnsUnavailable, exec_prefix, two_hosts  # noqa: E402


def bench_rows(stdout):
    """{(collective, size): (busbw GB/s, #wrong)} from rank 0's table."""
    rows = {}
    for line in stdout.splitlines():
        f = line.split()
        if len(f) >= 10 and not line.startswith("#") and f[1].isdigit():
            rows[(f[0], int(f[1]))] = (float(f[8]), int(f[9]))
    return rows


def nsocks_table(values, runs, stream, title):
    """One row per (collective, size): median busbw per value, ratio to the first."""
    keys = list(runs[values[0]][0])
    head = "".join(f" {f'n={v}':>9}" for v in values)
    ratios = "".join(f" {f'n={v}/n={values[0]}':>9}" for v in values[1:])
    out = [title, f"# busbw in GB/s (median of {len(runs[values[0]])} run(s) per value)"
           + (f"; one TCP stream: {stream:.3f} GB/s" if stream else ""),
           f"#{'collective':>13} {'size(B)':>11}{head} |{ratios} #wrong"]
    for k in keys:
        med = {v: statistics.median(r[k][0] for r in runs[v]) for v in values}
        wrong = sum(r[k][1] for v in values for r in runs[v])
        line = f"{k[0]:>14} {k[1]:>11}" + "".join(f" {med[v]:>9.3f}" for v in values)
        line += " |" + "".join(f" {med[v] / med[values[0]]:>8.2f}x" for v in values[1:])
        out.append(line + f" {wrong:>6}")
    return "\n".join(out)


def one_job(a, per_host, rate, nsocks=None):
    """Run one job (bench, or ddp_step.py with --ddp-step) over two fresh namespaces with
    per_host ranks each; returns rank 0's stdout, or None after printing what failed."""
    ws = 2 * per_host
    if a.ddp_step:
        script = os.path.join(ROOT, "benchmarks", "ddp_step.py")
        args = ["--reduce-worker", f"--reduce-dtype={a.reduce_dtype}"] + a.bench_args
    else:
        script = os.path.join(ROOT, "pyddp", "bench.py")
        args = (["--tcp-stream", "--stream-bytes", "256M"] if nsocks
                else ["--tcp-stream", "--compare-gloo"])
        args += ["--stream-peer", str(per_host)] + a.bench_args
    with two_hosts(rate, flow_rate=a.flow_rate) as hosts:
        def prefix(rank):
            h = hosts[rank // per_host]
            # gloo picks its interface by name; pyddp by the route to the store.
            env = [f"GLOO_SOCKET_IFNAME={h.ifname}"]
            return exec_prefix(h.ns) + ["env"] + env + (
                [f"PYDDP_NSOCKS_PERPEER={nsocks}"] if nsocks else [])
        results = spawn_ranks(script, ws, args=args, master_addr=hosts[0].addr,
                              prefix=prefix, timeout=a.timeout)
    bad = [r for r in results if r.returncode != 0]
    for r in bad:
        print(r.output[-3000:], file=sys.stderr)
    return None if bad else results[0].stdout


def title(a, per_host, rate):
    cap = (f"rate cap {rate}" if rate else "") + (f"per-flow cap {a.flow_rate}"
                                                 if a.flow_rate else "")
    return (f"## two network namespaces joined by veth ({cap or 'no rate cap'}), "
            f"{per_host} rank(s) per namespace")


def parse_args(argv=None):
    """This script's options (argv: a list, default sys.argv[1:]); the Namespace that
    one_job and title take (benchmarks/plots.py builds its jobs with it too)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-host", default="1",
                    help="ranks per namespace (1); a comma-separated list runs each")
    ap.add_argument("--rate", default=None,
                    help="cap each direction of the link (tc tbf), e.g. 2gbit; without it "
                    "the veth link is as fast as the CPUs can copy; a comma-separated "
                    "list runs each")
    ap.add_argument("--flow-rate", default=None,
                    help="cap each TCP flow in each direction instead (htb classes chosen "
                    "by port), e.g. 2gbit, as a cloud caps a single flow")
    ap.add_argument("--nsocks", default=None,
                    help="comma-separated PYDDP_NSOCKS_PERPEER values, e.g. 1,2,4: one run "
                    "per value, one table")
    ap.add_argument("--cycles", type=int, default=1,
                    help="with --nsocks: runs per value, in turn (1)")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--ddp-step", action="store_true",
                    help="time a DDP step with float32 against reduced-precision gradients "
                    "(benchmarks/ddp_step.py part 4) instead of pyddp.bench")
    ap.add_argument("--reduce-dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument("bench_args", nargs="*",
                    help="arguments for pyddp.bench, or ddp_step.py with --ddp-step (after --)")
    return ap.parse_args(argv)


def main():
    a = parse_args()
    per_hosts = [int(v) for v in a.per_host.split(",")]
    rates = a.rate.split(",") if a.rate else [None]
    try:
        if a.nsocks:
            values = [int(v) for v in a.nsocks.split(",")]
            runs = {v: [] for v in values}
            stream = 0.0
            for _ in range(a.cycles):
                for v in values:
                    out = one_job(a, per_hosts[0], rates[0], nsocks=v)
                    if out is None:
                        return 1
                    runs[v].append(bench_rows(out))
                    m = re.search(r"single TCP stream .*: ([0-9.]+) GB/s", out)
                    stream = max(stream, float(m.group(1))) if m else stream
            print(nsocks_table(values, runs, stream, title(a, per_hosts[0], rates[0])))
            return 0
        failed = 0
        for rate in rates:
            for per_host in per_hosts:
                out = one_job(a, per_host, rate)
                print(title(a, per_host, rate), flush=True)
                if out is None:
                    failed += 1
                else:
                    print(out, end="", flush=True)
        return 1 if failed else 0
    except NetnsUnavailable as e:
        sys.exit(f"two_hosts.py: {e}")


if __name__ == "__main__":
    sys.exit(main())
