"""The plots and the summary table at the top of docs/performance.md, in one rerunnable
command.

    sudo python benchmarks/plots.py                # about 7.5 minutes on 2 cores
    sudo python benchmarks/plots.py --runs 1       # one pass of each job, a third of that
    python benchmarks/plots.py --from-json         # redraw and reprint from the saved JSON

Two jobs of ``pyddp.bench --json`` (all four collectives, float32, 16 B to 64 MiB, x4
a step, ``-r`` rounds per size and variant, alternated in the same processes), each run
``--runs`` times, the two in turn so that the machine's load hits both alike:

1. one host: 2 ranks under torchrun (tests/launch.py), pyddp (shared memory) against
   torch's gloo (``--compare-gloo``);
2. two hosts: two network namespaces joined by veth (benchmarks/two_hosts.py's
   ``one_job``; needs root), ``--per-host`` ranks in each, each direction of the link
   capped at ``--rate``, pyddp's own choice (hierarchical from 1 MiB up), the flat ring
   forced (``--compare-flat``) and gloo, plus one TCP stream's rate as the yardstick.

Each job's runs are merged (``merge_runs``: every number the median over the runs, each
run's busbw kept beside it) into OUT/one_host.json and OUT/two_hosts.json, in
pyddp.bench's --json form, and drawn (pyddp/bench_plot.py) to OUT/one_host.png and
OUT/two_hosts.png (OUT: docs/img); the summary tables (medians, and the range of the
runs' ratios) are printed in markdown, ready for docs/performance.md.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)

import two_hosts  # noqa: E402
from launch import torchrun  # noqa: E402
from pyddp import bench_plot  # noqa: E402

BENCH = os.path.join(ROOT, "pyddp", "bench.py")
ONE_HOST_SIZES = (64, 64 << 10, 1 << 20, 64 << 20)
TWO_HOST_SIZES = (1 << 20, 16 << 20, 64 << 20)
RERUN = "sudo python benchmarks/plots.py"


def bench_args(a, json_path):
    """pyddp.bench's options shared by both runs."""
    return ["-b", "16", "-e", a.max, "-f", "4", "-r", str(a.rounds), "--json", json_path]


def run_one_host(a, json_path):
    """2 ranks on this host, pyddp against gloo; rank 0's table is printed, the results
    saved to json_path. False (after printing the output) when the job failed."""
    res = torchrun(BENCH, 2, args=bench_args(a, json_path) + ["--compare-gloo"],
                   timeout=a.timeout)
    print(res.stdout, end="", flush=True)
    if res.returncode != 0:
        print(res.output[-3000:], file=sys.stderr)
    return res.returncode == 0


def run_two_hosts(a, json_path):
    """a.per_host ranks in each of two namespaces, the link capped at a.rate: pyddp's
    choice, the flat ring and gloo (two_hosts.one_job adds --tcp-stream and
    --compare-gloo). False when the job failed (one_job printed why)."""
    opts = two_hosts.parse_args(["--per-host", str(a.per_host), "--rate", a.rate,
                                 "--timeout", str(a.timeout), "--"]
                                + bench_args(a, json_path)
                                + ["--compare-flat", "--stream-bytes", "128M"])
    print(two_hosts.title(opts, a.per_host, a.rate), flush=True)
    out = two_hosts.one_job(opts, a.per_host, a.rate)
    if out is not None:
        print(out, end="", flush=True)
    return out is not None


def by_key(results):
    """{(collective, size): row} of a pyddp.bench --json file's rows."""
    return {(r["collective"], r["size"]): r for r in results["rows"]}


def size_text(n):
    """64 -> '64 B', 65536 -> '64 KiB', 1 << 20 -> '1 MiB'."""
    s = bench_plot.size_label(n)
    return s[:-1] + " " + {"B": "B", "K": "KiB", "M": "MiB", "G": "GiB"}[s[-1]]


def ratio_cell(row, a, b):
    """Variant a's busbw over b's in one row: '2.47x' from one run, '2.47x (1.73-2.90)'
    (the median of the runs' own ratios, and their range) from several; '-' if none."""
    runs = row.get("busbw_runs") or {v: [x["busbw"]] for v, x in row["backends"].items()}
    got = [x / y for x, y in zip(runs[a], runs[b]) if y > 0]
    if not got:
        return "-"
    mid = statistics.median(got)
    return f"{mid:.2f}x" if len(got) == 1 else f"{mid:.2f}x ({min(got):.2f}-{max(got):.2f})"


def one_host_table(results):
    """Markdown: per collective, pyddp's busbw over gloo's at ONE_HOST_SIZES, and both
    busbw at the largest size."""
    rows, big = by_key(results), ONE_HOST_SIZES[-1]
    ops = list(dict.fromkeys(r["collective"] for r in results["rows"]))
    out = ["| collective | " + " | ".join(size_text(s) for s in ONE_HOST_SIZES)
           + f" | busbw at {size_text(big)}: pyddp, gloo (GB/s) |",
           "|---|" + "---:|" * (len(ONE_HOST_SIZES) + 1)]
    for op in ops:
        cells = [ratio_cell(rows[op, s], "pyddp", "gloo") if (op, s) in rows else "-"
                 for s in ONE_HOST_SIZES]
        r = rows.get((op, big))
        both = (f"{r['backends']['pyddp']['busbw']:.2f}, {r['backends']['gloo']['busbw']:.2f}"
                if r else "-")
        out.append(f"| {op} | " + " | ".join(cells) + f" | {both} |")
    return "\n".join(out)


def two_hosts_table(results):
    """Markdown: per collective and size in TWO_HOST_SIZES, busbw of pyddp's choice
    (hierarchical there), the flat ring and gloo, their ratios, and the bound."""
    rows = by_key(results)
    ops = list(dict.fromkeys(r["collective"] for r in results["rows"]))
    out = ["| collective | size | hierarchical | flat ring | gloo | hier / flat | hier / gloo "
           "| bound |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for op in ops:
        for s in TWO_HOST_SIZES:
            r = rows.get((op, s))
            if r is None:
                continue
            bw = {b: x["busbw"] for b, x in r["backends"].items()}
            out.append(f"| {op} | {size_text(s)} | {bw['pyddp']:.3f} | {bw['flat']:.3f} | "
                       f"{bw['gloo']:.3f} | {ratio_cell(r, 'pyddp', 'flat')} | "
                       f"{ratio_cell(r, 'pyddp', 'gloo')} | {r.get('bound', 0):.3f} |")
    return "\n".join(out)


def load_text(results):
    """'; load average X as it started', or '...A to B as the runs started' for
    several runs; '' where not saved."""
    load = results.get("loadavg")
    load = [x for x in (load if isinstance(load, list) else [load]) if x is not None]
    if not load:
        return ""
    if len(load) == 1:
        return f"; load average {load[0]:.1f} as it started"
    return f"; load average {min(load):.1f} to {max(load):.1f} as the runs started"


def medians_text(results):
    """'the median of 3 rounds', or 'the median over 3 runs of each run's median of 3
    rounds'."""
    rounds = f"the median of {results['rounds']} rounds"
    runs = results.get("runs", 1)
    return rounds if runs == 1 else f"the median over {runs} runs of each run's {rounds[4:]}"


def summary(one, two):
    """The markdown that goes at the top of docs/performance.md: both tables, each after
    a paragraph with the facts of its run, and the command that remakes them."""
    fill = (lambda text: textwrap.fill(text, width=90, break_on_hyphens=False))
    parts = []
    if one:
        parts += [fill(f"One host, {one['world']} ranks, shared memory{load_text(one)}. "
                       f"pyddp's bus bandwidth over gloo's ({medians_text(one)}, the two "
                       "alternated in the same processes; in parentheses the range over the "
                       "runs):"), "", one_host_table(one), ""]
    if two:
        parts += [fill(f"Two hosts x {two['world'] // two['hosts']} ranks (network namespaces "
                       f"joined by veth, {two.get('note', 'no link cap')}{load_text(two)}). "
                       f"Busbw in GB/s ({medians_text(two)}); hierarchical: pyddp's own "
                       "choice; flat ring: the same processes with the flat ring forced; bound: "
                       "each host sends only what it must, at one TCP stream's rate "
                       f"({two['stream_gbps']:.3f} GB/s):"), "", two_hosts_table(two), ""]
    parts.append(fill(f"Rerun: `{RERUN}` (root for the network namespaces; matplotlib from "
                      "the plot extra; `--runs 1` for one pass instead of three; "
                      "`--from-json` redraws the plots and reprints these tables from the "
                      "saved results without running anything)."))
    return "\n".join(parts)


def merge_runs(runs):
    """One results dict in pyddp.bench's --json form from several runs of the same job:
    each row's time, algbw and busbw, its vs_gloo ratios, pct_stream and bound are the
    medians over the runs (ratios: of each run's own ratio), wrong the largest; each
    row's "busbw_runs" keeps every run's busbw per variant, and the top level has
    "runs" (how many), "loadavg" (each run's) and stream_gbps (the median)."""
    med = statistics.median
    first = runs[0]
    merged = dict(first, runs=len(runs), loadavg=[r.get("loadavg") for r in runs],
                  stream_gbps=med(r["stream_gbps"] for r in runs), rows=[])
    for i, row in enumerate(first["rows"]):
        same = [r["rows"][i] for r in runs]
        assert {(x["collective"], x["size"]) for x in same} == {(row["collective"],
                                                                  row["size"])}
        m = dict(row, backends={}, busbw_runs={})
        for b in first["backends"]:
            m["backends"][b] = {k: med(x["backends"][b][k] for x in same)
                                for k in ("time_us", "algbw", "busbw")}
            m["backends"][b]["wrong"] = max(x["backends"][b]["wrong"] for x in same)
            m["busbw_runs"][b] = [x["backends"][b]["busbw"] for x in same]
        if "vs_gloo" in row:
            m["vs_gloo"] = {}
            for b in row["vs_gloo"]:
                got = [x["vs_gloo"][b] for x in same if x["vs_gloo"][b] is not None]
                m["vs_gloo"][b] = med(got) if got else None
        for k in ("pct_stream", "bound"):
            if k in row:
                m[k] = med(x[k] for x in same)
        merged["rows"].append(m)
    return merged


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "img"),
                    help="folder for the JSON results and the PNGs (docs/img)")
    ap.add_argument("--from-json", action="store_true",
                    help="run nothing: redraw and reprint from OUT's saved JSON")
    ap.add_argument("--runs", type=int, default=3,
                    help="runs of each job, in turn (3); tables and plots take the median")
    ap.add_argument("--max", default="64M", help="largest size (64M)")
    ap.add_argument("-r", "--rounds", type=int, default=3,
                    help="rounds per size and variant in each run (3)")
    ap.add_argument("--per-host", type=int, default=2, help="ranks per namespace (2)")
    ap.add_argument("--rate", default="2gbit", help="cap of the link between the hosts")
    ap.add_argument("--only", choices=list(JOBS), default=None,
                    help="run (or redraw) just one of the two")
    ap.add_argument("--timeout", type=int, default=900, help="seconds one run may take")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    names = [a.only] if a.only else list(JOBS)
    if not a.from_json:
        runs = {n: [] for n in names}
        with tempfile.TemporaryDirectory() as tmp:
            for k in range(a.runs):           # in turn, so that load hits both alike
                for n in names:
                    path = os.path.join(tmp, f"{n}.{k}.json")
                    print(f"## {n}, run {k + 1} of {a.runs}", flush=True)
                    try:
                        ok = JOBS[n](a, path)
                    except two_hosts.NetnsUnavailable as e:
                        sys.exit(f"plots.py: two hosts need network namespaces (root): {e}")
                    if not ok:
                        return 1
                    with open(path) as f:
                        runs[n].append(json.load(f))
        for n in names:
            merged = merge_runs(runs[n])
            if n == "two_hosts":    # what the bench cannot know, kept for --from-json
                merged["note"] = f"link capped at {a.rate} each way"
            with open(os.path.join(a.out, n + ".json"), "w") as f:
                json.dump(merged, f, indent=1)
                f.write("\n")
    results = {}
    for n in names:
        with open(os.path.join(a.out, n + ".json")) as f:
            results[n] = json.load(f)
        png = os.path.join(a.out, n + ".png")
        bench_plot.plot(results[n], png)
        print(f"# drew {png} ({os.path.getsize(png) // 1024} KiB)", flush=True)
    print()
    print(summary(results.get("one_host"), results.get("two_hosts")))
    return 0


JOBS = {"one_host": run_one_host, "two_hosts": run_two_hosts}

if __name__ == "__main__":
    sys.exit(main())
