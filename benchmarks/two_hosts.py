"""Two "hosts" joined by a veth link (network namespaces): pyddp against gloo and
against one plain TCP stream over the same link, in one run.

    sudo python benchmarks/two_hosts.py                  # 1 rank per host, 8 B .. 256 MiB
    sudo python benchmarks/two_hosts.py --per-host 2 -- -e 64M --ops all_reduce
    sudo python benchmarks/two_hosts.py --rate 2gbit       # the link, not the CPU, limits
    sudo python benchmarks/two_hosts.py --flow-rate 2gbit --nsocks 1,2,4 -- -b 1M -e 64M \
        --ops all_reduce                                   # a cloud's per-flow cap

Creates two network namespaces with a veth pair between them (tests/netns.py; needs root
and iproute2), starts the ranks in them with plain RANK/WORLD_SIZE/MASTER_* variables
(rank 0's namespace hosts the store), runs ``pyddp.bench --tcp-stream --compare-gloo``
and prints rank 0's table. The namespaces are removed afterwards.

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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-host", type=int, default=1, help="ranks per namespace (1)")
    ap.add_argument("--rate", default=None,
                    help="cap each direction of the link (tc tbf), e.g. 2gbit; without it "
                    "the veth link is as fast as the CPUs can copy")
    ap.add_argument("--flow-rate", default=None,
                    help="cap each TCP flow in each direction instead (htb classes chosen "
                    "by port), e.g. 2gbit, as a cloud caps a single flow")
    ap.add_argument("--nsocks", default=None,
                    help="comma-separated PYDDP_NSOCKS_PERPEER values, e.g. 1,2,4: one run "
                    "per value, one table")
    ap.add_argument("--cycles", type=int, default=1,
                    help="with --nsocks: runs per value, in turn (1)")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("bench_args", nargs="*", help="arguments for pyddp.bench (after --)")
    a = ap.parse_args()
    ws = 2 * a.per_host
    values = [int(v) for v in a.nsocks.split(",")] if a.nsocks else [None]
    runs = {v: [] for v in values}
    stream = 0.0
    try:
        with two_hosts(a.rate, flow_rate=a.flow_rate) as hosts:
            for _ in range(a.cycles if a.nsocks else 1):
                for v in values:
                    def prefix(rank):
                        h = hosts[rank // a.per_host]
                        # gloo picks its interface by name; pyddp by the route to the store.
                        env = [f"GLOO_SOCKET_IFNAME={h.ifname}"]
                        return exec_prefix(h.ns) + ["env"] + env + (
                            [f"PYDDP_NSOCKS_PERPEER={v}"] if v else [])
                    extra = (["--tcp-stream", "--stream-bytes", "256M"] if v
                             else ["--tcp-stream", "--compare-gloo"])
                    results = spawn_ranks(os.path.join(ROOT, "pyddp", "bench.py"), ws,
                                          args=extra + ["--stream-peer", str(a.per_host)]
                                          + a.bench_args,
                                          master_addr=hosts[0].addr, prefix=prefix,
                                          timeout=a.timeout)
                    bad = [r for r in results if r.returncode != 0]
                    for r in bad:
                        print(r.output[-3000:], file=sys.stderr)
                    if bad:
                        return 1
                    runs[v].append(bench_rows(results[0].stdout))
                    m = re.search(r"single TCP stream .*: ([0-9.]+) GB/s", results[0].stdout)
                    stream = max(stream, float(m.group(1))) if m else stream
    except NetnsUnavailable as e:
        sys.exit(f"two_hosts.py: {e}")
    cap = (f"rate cap {a.rate}" if a.rate else "") + (f"per-flow cap {a.flow_rate}"
                                                     if a.flow_rate else "")
    title = (f"## two network namespaces joined by veth ({cap or 'no rate cap'}), "
             f"{a.per_host} rank(s) per namespace")
    if a.nsocks:
        print(nsocks_table(values, runs, stream, title))
    else:
        print(title)
        print(results[0].stdout, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
