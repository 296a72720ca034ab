"""Two "hosts" joined by a veth link (network namespaces): pyddp against gloo and
against one plain TCP stream over the same link, in one run.

    sudo python benchmarks/two_hosts.py                  # 1 rank per host, 8 B .. 256 MiB
    sudo python benchmarks/two_hosts.py --per-host 2 -- -e 64M --ops all_reduce
    sudo python benchmarks/two_hosts.py --rate 2gbit       # the link, not the CPU, limits
    sudo python benchmarks/two_hosts.py --per-host 2 --rate 512mbit --ddp-step -- --hidden 2048

Creates two network namespaces with a veth pair between them (tests/netns.py; needs root
and iproute2), starts the ranks in them with plain RANK/WORLD_SIZE/MASTER_* variables
(rank 0's namespace hosts the store), runs ``pyddp.bench --tcp-stream --compare-gloo``
and prints rank 0's table. With ``--ddp-step`` the ranks run benchmarks/ddp_step.py's
part 4 instead: pyddp's DDP step with float32 gradients against the same step with
``reduce_dtype`` (``--reduce-dtype``, bfloat16), side by side (arguments after ``--`` go
to ddp_step.py, e.g. ``--hidden 2048 --steps 3``). The namespaces are removed afterwards.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from launch import spawn_ranks  # noqa: E402
from netns import NetnsUnavailable, exec_prefix, two_hosts  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-host", type=int, default=1, help="ranks per namespace (1)")
    ap.add_argument("--rate", default=None,
                    help="cap each direction of the link (tc tbf), e.g. 2gbit; without it "
                    "the veth link is as fast as the CPUs can copy")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--ddp-step", action="store_true",
                    help="time a DDP step with float32 against reduced-precision gradients "
                    "(benchmarks/ddp_step.py part 4) instead of pyddp.bench")
    ap.add_argument("--reduce-dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument("bench_args", nargs="*",
                    help="arguments for pyddp.bench, or ddp_step.py with --ddp-step (after --)")
    a = ap.parse_args()
    ws = 2 * a.per_host
    if a.ddp_step:
        script = os.path.join(ROOT, "benchmarks", "ddp_step.py")
        script_args = ["--reduce-worker", f"--reduce-dtype={a.reduce_dtype}"] + a.bench_args
    else:
        script = os.path.join(ROOT, "pyddp", "bench.py")
        script_args = ["--tcp-stream", "--compare-gloo", "--stream-peer",
                       str(a.per_host)] + a.bench_args
    try:
        with two_hosts(a.rate) as hosts:
            def prefix(rank):
                h = hosts[rank // a.per_host]
                # gloo picks its interface by name; pyddp by the route to the store.
                return exec_prefix(h.ns) + ["env", f"GLOO_SOCKET_IFNAME={h.ifname}"]
            results = spawn_ranks(script, ws, args=script_args, master_addr=hosts[0].addr,
                                  prefix=prefix, timeout=a.timeout)
    except NetnsUnavailable as e:
        sys.exit(f"two_hosts.py: {e}")
    print(f"## two network namespaces joined by veth ({a.rate or 'no rate cap'}), "
          f"{a.per_host} rank(s) per namespace")
    print(results[0].stdout, end="")
    bad = [r for r in results if r.returncode != 0]
    for r in bad:
        print(r.output[-3000:], file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
